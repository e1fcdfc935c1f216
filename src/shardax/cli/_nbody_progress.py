"""What ``shardax nbody`` shows of the processes it launches: process 0's step lines, rendered with rich on a terminal.

A launched process writes to a pipe, so its steps (``shardax.cli._progress.Progress``) come as two plain lines each:
``[2/5] friends-of-friends ...`` then ``      friends-of-friends: 21.4 s (compiled 3 programs in 15.2 s)``.
:class:`ProgressPrinter` prints them as they are, or on a terminal with rich installed shows a spinner with the
elapsed time while a step runs and a line with its time when it ends.
"""

from __future__ import annotations

import re
import sys
import threading
from contextlib import suppress
from typing import Any

from ..runtime import ConsoleSink, Stream

_START = re.compile(r"^\[(\d+)/(\d+)\] (.*) \.\.\.$")
_END = re.compile(r"^ +(.*): (\d+\.\d+ s.*)$")


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
