"""Progress of the CLI jobs: each long step says what it does while it runs and how long it took, with the time
JAX spent compiling (and how many programs came from the persistent cache).

On a terminal with ``rich`` installed a step shows a live spinner and its elapsed seconds; otherwise (no ``rich``,
output to a file or a pipe, ``--plain``) one line when it starts and one when it ends.
"""

from __future__ import annotations

import contextlib
import dataclasses
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

T = TypeVar("T")

_BACKEND_COMPILE = "/jax/core/compile/backend_compile_duration"
_TRACING = ("/jax/core/compile/jaxpr_trace_duration", "/jax/core/compile/jaxpr_to_mlir_module_duration")
_CACHE_HIT = "/jax/compilation_cache/cache_hits"


@dataclasses.dataclass
class CompileCount:
    """Programs XLA compiled, programs loaded from the persistent cache, and the seconds spent on both (``compile_s``)
    and on tracing and lowering to XLA (``trace_s``)."""

    programs: int = 0
    compile_s: float = 0.0
    cached: int = 0
    trace_s: float = 0.0

    @property
    def compiled(self) -> int:
        """Programs XLA compiled (JAX's compile event also fires for those loaded from the cache)."""
        return max(self.programs - self.cached, 0)

    def describe(self) -> str:
        if not self.programs and self.trace_s < 0.05:
            return "nothing compiled"
        parts = [f"compiled {self.compiled} program{'s' * (self.compiled != 1)}"] if self.compiled else []
        if self.cached:
            parts.append(f"loaded {self.cached} program{'s' * (self.cached != 1)} from the cache")
        text = ", ".join(parts) + f" in {self.compile_s:.1f} s" if parts else ""
        if not parts:
            return f"tracing and lowering {self.trace_s:.1f} s"
        return text + (f"; tracing and lowering {self.trace_s:.1f} s" if self.trace_s >= 0.05 else "")


class _Watch:
    """Adds JAX's compile events to the counts of the steps that are running (listeners are registered once)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.active: list[CompileCount] = []
        self.registered = False

    def start(self) -> CompileCount:
        from jax import monitoring

        with self.lock:
            if not self.registered:
                monitoring.register_event_duration_secs_listener(self._duration)
                monitoring.register_event_listener(self._event)
                self.registered = True
            count = CompileCount()
            self.active.append(count)
            return count

    def stop(self, count: CompileCount) -> None:
        with self.lock:
            self.active.remove(count)

    def _duration(self, event: str, duration_secs: float, **_: Any) -> None:
        if event == _BACKEND_COMPILE:
            with self.lock:
                for count in self.active:
                    count.programs += 1
                    count.compile_s += duration_secs
        elif event in _TRACING:
            with self.lock:
                for count in self.active:
                    count.trace_s += duration_secs

    def _event(self, event: str, **_: Any) -> None:
        if event == _CACHE_HIT:
            with self.lock:
                for count in self.active:
                    count.cached += 1


_WATCH = _Watch()


@contextlib.contextmanager
def watch_compiles() -> Iterator[CompileCount]:
    """Count the programs JAX compiles (and loads from the persistent cache) inside the ``with`` block."""
    count = _WATCH.start()
    try:
        yield count
    finally:
        _WATCH.stop(count)


def _rich_console() -> Any:
    try:
        from rich.console import Console
    except ImportError:
        return None
    return Console()


class Progress:
    """Numbered steps of a job, shown by one process (``show``).

    Example:
        >>> steps = Progress(2, show=True, plain=True)
        >>> steps.run("read particles", lambda: 1)  # doctest: +SKIP
    """

    def __init__(self, total: int, *, show: bool, plain: bool = False) -> None:
        self.total, self.show, self.index = total, show, 0
        self.times: dict[str, float] = {}
        self.compiles: dict[str, CompileCount] = {}
        live = show and not plain and sys.stdout.isatty()
        self._console = _rich_console() if live else None

    def say(self, text: str) -> None:
        if self.show:
            sys.stdout.write(text + "\n")
            sys.stdout.flush()

    def run(self, name: str, fn: Callable[[], T], *, doing: str | None = None) -> T:
        """Run step ``name`` (``doing``: what it does, shown while it runs) and record its time and compiles."""
        self.index += 1
        head = f"[{self.index}/{self.total}] {doing or name}"
        start = time.perf_counter()
        with watch_compiles() as count:
            if self._console is not None:
                with self._console.status(head) as status:
                    stop = threading.Event()
                    ticker = threading.Thread(target=self._tick, args=(status, head, start, stop), daemon=True)
                    ticker.start()
                    try:
                        out = fn()
                    finally:
                        stop.set()
                        ticker.join()
            else:
                self.say(f"{head} ...")
                out = fn()
        seconds = time.perf_counter() - start
        self.times[name], self.compiles[name] = seconds, count
        detail = f" ({count.describe()})" if count.programs or count.trace_s >= 0.05 else ""
        if self._console is not None:
            self._console.print(f"[green]done[/] {head}: {seconds:.2f} s{detail}", highlight=False)
        else:
            self.say(f"      {name}: {seconds:.2f} s{detail}")
        return out

    @staticmethod
    def _tick(status: Any, head: str, start: float, stop: threading.Event) -> None:
        while not stop.wait(0.5):
            status.update(f"{head} ... {time.perf_counter() - start:.0f} s")
