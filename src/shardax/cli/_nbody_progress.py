"""Progress of ``shardax nbody``: numbered stage lines with their time and compile time, printed plain or with rich.

The job prints two plain lines per stage (``[2/7] particle-mesh N-body ...`` then ``      particle-mesh N-body:
21.4 s (compile 15.2 s)``), so that a launched process's output reads well in a log. The command that shows them
(:class:`ProgressPrinter`) renders them with rich on a terminal: a spinner with the elapsed time while a stage runs,
then a line with its time.
"""

from __future__ import annotations

import re
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from typing import Any, TypeVar

from ._procs import ConsoleSink, Stream

T = TypeVar("T")

_START = re.compile(r"^\[(\d+)/(\d+)\] (.*) \.\.\.$")
_END = re.compile(r"^ +(.*): (\d+\.\d+ s.*)$")

# JAX's compile events: tracing, lowering to StableHLO and XLA's compilation of one program.
_COMPILE_EVENTS = ("/jax/core/compile/jaxpr_trace_duration", "/jax/core/compile/jaxpr_to_mlir_module_duration",
                   "/jax/core/compile/backend_compile_duration")


class _CompileClock:
    """Seconds JAX spent compiling in this process while :meth:`listening` (summed over threads)."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self._lock = threading.Lock()

    def _event(self, event: str, duration: float, **_: Any) -> None:
        if event in _COMPILE_EVENTS:
            with self._lock:
                self.seconds += duration

    @contextmanager
    def listening(self) -> Iterator[None]:
        import jax.monitoring

        jax.monitoring.register_event_duration_secs_listener(self._event)
        try:
            yield
        finally:
            jax.monitoring.unregister_event_duration_listener(self._event)


class Stages:
    """Runs the job's named stages in order; ``emit`` (process 0's printer, or None) gets their lines.

    ``times[name]`` is each stage's wall time and ``compile_times[name]`` the part of it JAX spent compiling.
    """

    def __init__(self, total: int, emit: Callable[[str], None] | None):
        self.total, self.emit, self.index = total, emit, 0
        self.times: dict[str, float] = {}
        self.compile_times: dict[str, float] = {}
        self._clock = _CompileClock()

    def run(self, name: str, fn: Callable[[], T]) -> T:
        self.index += 1
        if self.emit:
            self.emit(f"[{self.index}/{self.total}] {name} ...")
        start, compiled = time.perf_counter(), self._clock.seconds
        with self._clock.listening():
            out = fn()
        self.times[name] = time.perf_counter() - start
        self.compile_times[name] = self._clock.seconds - compiled
        if self.emit:
            self.emit(f"      {name}: {self.times[name]:.2f} s{self._compile_note(name)}")
        return out

    def _compile_note(self, name: str) -> str:
        seconds = self.compile_times[name]
        if seconds < 0.05:
            return ""
        return f" (of which compiling {seconds:.1f} s: first call in this process)"


class ProgressPrinter:
    """Prints the job's lines: as they are, or on a terminal with ``rich`` installed as a live stage display."""

    def __init__(self, *, plain: bool = False):
        self._lock = threading.Lock()
        self._progress: Any = None
        self._task: Any = None
        self._rich = not plain and sys.stdout.isatty() and _has_rich()
        self._labelled = ConsoleSink()

    def line(self, text: str) -> None:
        with self._lock:
            if not self._rich:
                with suppress(BrokenPipeError, ValueError):
                    sys.stdout.write(text + "\n")
                    sys.stdout.flush()
                return
            self._rich_line(text)

    def labelled(self, label: str, stream: Stream, text: str) -> None:
        """Another process's line, or process 0's standard error, prefixed ``[label]`` as ``shardax launch`` does."""
        with self._lock:
            if self._progress is None:
                self._labelled.line(label, stream, text)
            else:
                style = "red" if stream == "stderr" else "default"
                self._progress.console.print(f"[{label}] {text}", style=style, markup=False, highlight=False)

    def _rich_line(self, text: str) -> None:
        from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

        if self._progress is None:
            self._progress = Progress(SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn(),
                                      transient=True)
            self._progress.start()
        progress = self._progress
        start, end = _START.match(text), _END.match(text)
        if start:
            self._finish_task()
            self._task = progress.add_task(f"[bold]{start[3]}[/] [dim]({start[1]}/{start[2]})[/]", total=None)
        elif end and self._task is not None:
            self._finish_task()
            progress.console.print(f"[green]done[/] {end[1]}  [cyan]{end[2]}[/]", highlight=False)
        else:
            progress.console.print(text, markup=False, highlight=False)

    def _finish_task(self) -> None:
        if self._task is not None:
            self._progress.remove_task(self._task)
            self._task = None

    def close(self) -> None:
        with self._lock:
            if self._progress is not None:
                self._finish_task()
                self._progress.stop()
                self._progress = None


def _has_rich() -> bool:
    try:
        import rich  # noqa: F401
    except ImportError:
        return False
    return True


def is_noise(text: str) -> bool:
    """Whether ``text`` is a line of the runtime's chatter: gloo's connection reports and XLA's "Very slow
    compile?" banner (large programs take tens of seconds to compile on CPU, which XLA logs as an error)."""
    stripped = text.strip()
    return (not stripped or set(stripped) == {"*"} or "[Gloo]" in stripped or "connected peer ranks" in stripped
            or "slow_operation_alarm" in stripped or "Very slow compile?" in stripped)


class ProgressSink:
    """The launched job's output: process 0's standard output through the printer, other lines labelled by rank as
    ``shardax launch`` prints them, without the runtime's chatter (:func:`is_noise`)."""

    def __init__(self, printer: ProgressPrinter):
        self._printer = printer

    def line(self, label: str, stream: Stream, text: str) -> None:
        if is_noise(text):
            return
        if label == "0" and stream == "stdout":
            self._printer.line(text)
        else:
            self._printer.labelled(label, stream, text)

    def message(self, text: str) -> None:
        self._printer.close()
        sys.stderr.write(f"shardax launch: {text}\n")
        sys.stderr.flush()
