"""The process-running names the other commands use, from :mod:`shardax.runtime` (where the engine lives)."""

from ..runtime import CaptureSink as CaptureSink
from ..runtime import ConsoleSink as ConsoleSink
from ..runtime import JobResult as JobResult
from ..runtime import ProcessSpec as ProcessSpec
from ..runtime import Sink as Sink
from ..runtime import Stream as Stream
from ..runtime import run_processes as run_job

__all__ = ["CaptureSink", "ConsoleSink", "JobResult", "ProcessSpec", "Sink", "Stream", "run_job"]
