"""Process and device world: launch, initialize, World, meshes, host replication, program guard, watchdog and the
CPUs XLA:CPU compiles for.

:func:`launch` starts N local processes of one program (the library under ``shardax launch`` and
:mod:`shardax.testing`); the ``ENV_*`` names are the environment contract between a launcher and :func:`initialize`.
Launching needs no JAX: the names that do (``initialize``, ``World``, the meshes ...) are imported on first use.
"""

from typing import TYPE_CHECKING

from .._lazy import attach
from .._transport import cpu_collectives as cpu_collectives
from ._env import ENV_COORDINATOR as ENV_COORDINATOR
from ._env import ENV_CPU_DEVICES as ENV_CPU_DEVICES
from ._env import ENV_INITIALIZED as ENV_INITIALIZED
from ._env import ENV_JAX_CPU_DEVICES as ENV_JAX_CPU_DEVICES
from ._env import ENV_NUM_PROCESSES as ENV_NUM_PROCESSES
from ._env import ENV_PROCESS_ID as ENV_PROCESS_ID
from ._env import RUN_VARS as RUN_VARS
from ._env import LaunchInfo as LaunchInfo
from ._env import detect as detect_launch
from ._launch import child_env as child_env
from ._launch import launch as launch
from ._launch import mpirun_spec as mpirun_spec
from ._launch import process_env as process_env
from ._launch import rank_specs as rank_specs
from ._malloc import malloc_env as malloc_env
from ._malloc import restart_with_malloc_env as restart_with_malloc_env
from ._procs import CaptureSink as CaptureSink
from ._procs import ConsoleSink as ConsoleSink
from ._procs import JobResult as JobResult
from ._procs import ProcessSpec as ProcessSpec
from ._procs import Sink as Sink
from ._procs import Stream as Stream
from ._procs import run_processes as run_processes

if TYPE_CHECKING:
    from .._compile import limited_cpus as limited_cpus
    from .._guard import configure_guard as configure_guard
    from .._tuning import TuningBackend as TuningBackend
    from .._tuning import tuning_backend as tuning_backend
    from .._watchdog import configure_watchdog as configure_watchdog
    from ._initialize import initialize as initialize
    from ._replicate import host_replicate as host_replicate
    from ._world import World as World
    from ._world import device_grid as device_grid
    from ._world import flat_mesh as flat_mesh
    from ._world import grid_mesh as grid_mesh
    from ._world import world as world

__getattr__, __dir__ = attach(__name__, globals(), {
    "limited_cpus": ".._compile", "configure_guard": ".._guard", "TuningBackend": ".._tuning",
    "tuning_backend": ".._tuning", "configure_watchdog": ".._watchdog", "initialize": "._initialize",
    "host_replicate": "._replicate",
    **dict.fromkeys(("World", "device_grid", "flat_mesh", "grid_mesh", "world"), "._world"),
})

__all__ = ["ENV_COORDINATOR", "ENV_CPU_DEVICES", "ENV_INITIALIZED", "ENV_JAX_CPU_DEVICES", "ENV_NUM_PROCESSES",
           "ENV_PROCESS_ID", "RUN_VARS", "CaptureSink", "ConsoleSink", "JobResult", "LaunchInfo", "ProcessSpec",
           "Sink", "Stream", "TuningBackend", "World", "child_env", "configure_guard", "configure_watchdog", "cpu_collectives",
           "detect_launch", "device_grid", "flat_mesh", "grid_mesh", "host_replicate", "initialize", "launch",
           "limited_cpus", "malloc_env", "mpirun_spec", "process_env", "rank_specs", "restart_with_malloc_env",
           "run_processes", "tuning_backend", "world"]
