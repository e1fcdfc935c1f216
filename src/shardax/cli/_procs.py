"""Run a group of processes as one job: labelled output, first failure tears the rest down, signals forwarded.

This is the engine behind ``shardax launch`` and :mod:`shardax.testing`. It knows nothing about JAX: it starts the
commands it is given, each in its own process group, and watches them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import IO, Literal, Protocol

Stream = Literal["stdout", "stderr"]

# How long children get between SIGTERM and SIGKILL when the job is torn down.
GRACE_S = 3.0
_POLL_S = 0.05


@dataclasses.dataclass(frozen=True)
class ProcessSpec:
    """One process of the job: its command line, environment and label (``"0"`` prints as ``[0]``)."""

    argv: Sequence[str]
    env: Mapping[str, str]
    label: str
    name: str  # how messages name it: "rank 1", "mpirun"


class Sink(Protocol):
    """Where the job's output goes: child lines and the launcher's own messages."""

    def line(self, label: str, stream: Stream, text: str) -> None: ...

    def message(self, text: str) -> None: ...


class ConsoleSink:
    """Child lines to this process's stdout/stderr (the same stream as the child's), prefixed ``[label] ``."""

    def __init__(self, stdout: IO[str] | None = None, stderr: IO[str] | None = None):
        self._stdout = stdout or sys.stdout
        self._stderr = stderr or sys.stderr
        self._lock = threading.Lock()

    def _write(self, out: IO[str], text: str) -> None:
        # A closed reader (`shardax launch ... | head`) must not stop the pumps: the children would block on a full
        # pipe. Their output is dropped instead.
        with self._lock, contextlib.suppress(BrokenPipeError, ValueError):
            out.write(text)
            out.flush()

    def line(self, label: str, stream: Stream, text: str) -> None:
        self._write(self._stdout if stream == "stdout" else self._stderr, f"[{label}] {text}\n")

    def message(self, text: str) -> None:
        self._write(self._stderr, f"shardax launch: {text}\n")


class CaptureSink:
    """Keeps every line, in arrival order, for the caller to format (used by :mod:`shardax.testing`)."""

    def __init__(self) -> None:
        # (label, stream, text); label None marks the launcher's own messages.
        self.lines: list[tuple[str | None, Stream, str]] = []
        self._lock = threading.Lock()

    def line(self, label: str, stream: Stream, text: str) -> None:
        with self._lock:
            self.lines.append((label, stream, text))

    def message(self, text: str) -> None:
        with self._lock:
            self.lines.append((None, "stderr", text))

    def text(self) -> str:
        """Everything, interleaved as it arrived, as ``shardax launch`` prints it."""
        with self._lock:
            return "".join(f"shardax launch: {text}\n" if label is None else f"[{label}] {text}\n"
                           for label, _, text in self.lines)

    def by_label(self) -> dict[str, str]:
        """Each process's lines (stdout and stderr interleaved, in arrival order), by label."""
        out: dict[str, list[str]] = {}
        with self._lock:
            for label, _, text in self.lines:
                if label is not None:
                    out.setdefault(label, []).append(text + "\n")
        return {label: "".join(texts) for label, texts in out.items()}


@dataclasses.dataclass(frozen=True)
class JobResult:
    """How the job ended.

    Attributes:
        returncode: 0 if every process succeeded; else the first failing process's exit code (``128 + K`` when it
            was killed by signal ``K``), 124 on timeout, ``128 + K`` when the launcher itself received signal ``K``.
        message: the launcher's explanation ("" on success).
        signal_received: the signal that interrupted the launcher, if any.
    """

    returncode: int
    message: str = ""
    signal_received: int | None = None


# A traceback's last line: ``shardax._errors.ProgramMismatchError: processes are about to run ...``.
_ERROR_LINE = re.compile(r"^(?:[A-Za-z_]\w*\.)*[A-Z]\w*(?:Error|Exception|Interrupt): \S")
# Errors that explain the other processes' failures too: their line goes first, whoever failed first.
_EXPLAINS_OTHERS = ("ProgramMismatchError",)


class _Headlines:
    """A sink that passes everything on and keeps each process's last exception line (a traceback's verdict)."""

    def __init__(self, sink: Sink) -> None:
        self.sink = sink
        self.last: dict[str, str] = {}
        self.explaining: str | None = None
        self._lock = threading.Lock()

    def line(self, label: str, stream: Stream, text: str) -> None:
        if stream == "stderr" and _ERROR_LINE.match(text):
            with self._lock:
                self.last[label] = text
                if self.explaining is None and any(name in text.split(":", 1)[0] for name in _EXPLAINS_OTHERS):
                    self.explaining = f"[{label}] {text}"
        self.sink.line(label, stream, text)

    def message(self, text: str) -> None:
        self.sink.message(text)

    def headline(self, label: str) -> str | None:
        """The line that says why the job failed: a mismatch of programs, else ``label``'s last exception line."""
        with self._lock:
            if self.explaining is not None:
                return self.explaining
            return f"[{label}] {self.last[label]}" if label in self.last else None


def describe_exit(name: str, returncode: int) -> str:
    """``"rank 1 exited with code 3"`` or ``"rank 1 was killed by SIGKILL"`` from a ``Popen.returncode``."""
    if returncode < 0:
        try:
            signame = signal.Signals(-returncode).name
        except ValueError:
            signame = f"signal {-returncode}"
        return f"{name} was killed by {signame}"
    return f"{name} exited with code {returncode}"


def shell_code(returncode: int) -> int:
    """A ``Popen.returncode`` as a shell reports it: a process killed by signal K gives 128 + K."""
    return 128 - returncode if returncode < 0 else returncode


def _pump(pipe: IO[bytes], label: str, stream: Stream, sink: Sink) -> None:
    with pipe:
        for raw in iter(pipe.readline, b""):
            sink.line(label, stream, raw.decode("utf-8", errors="replace").rstrip("\r\n"))


def _signal_group(proc: subprocess.Popen[bytes], signum: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signum)


def _peek(proc: subprocess.Popen[bytes]) -> int | None:
    """``proc``'s return code (as ``Popen.returncode``) if it ended, else None, without reaping it.

    An unreaped child keeps its pid, hence its process group id, reserved: signalling the group stays safe until
    :meth:`_Job.teardown` reaps it.
    """
    if proc.returncode is not None:
        return proc.returncode
    info = os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    if info is None:
        return None
    return info.si_status if info.si_code == os.CLD_EXITED else -info.si_status


def _format_seconds(seconds: float) -> str:
    return str(int(seconds)) if float(seconds).is_integer() else f"{seconds:.6g}"


@contextlib.contextmanager
def _forward_signals(on_signal: Callable[[int], None]) -> Iterator[None]:
    """While active, SIGINT/SIGTERM/SIGHUP to this process call ``on_signal`` (main thread only; else no-op)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    signums = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
    previous = {s: signal.getsignal(s) for s in signums}
    for s in signums:
        signal.signal(s, lambda signum, _frame: on_signal(signum))
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


class _Job:
    def __init__(self, specs: Sequence[ProcessSpec], sink: Sink):
        self.specs = list(specs)
        self.sink = self.headlines = _Headlines(sink)
        self.procs: list[subprocess.Popen[bytes]] = []
        self.readers: list[list[threading.Thread]] = []
        self.received: int | None = None

    def start(self) -> None:
        for spec in self.specs:
            # Own process group per child: a terminal's Ctrl-C reaches only the launcher, which forwards it once,
            # and a teardown also reaches whatever the child started itself.
            proc = subprocess.Popen(list(spec.argv), env=dict(spec.env), stdin=subprocess.DEVNULL,
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, process_group=0)
            self.procs.append(proc)
            threads = []
            for pipe, stream in ((proc.stdout, "stdout"), (proc.stderr, "stderr")):
                assert pipe is not None
                t = threading.Thread(target=_pump, args=(pipe, spec.label, stream, self.sink), daemon=True)
                t.start()
                threads.append(t)
            self.readers.append(threads)

    def on_signal(self, signum: int) -> None:
        if self.received is None:
            self.received = signum
        for proc in self.procs:
            if _peek(proc) is None:
                _signal_group(proc, signum)

    def running(self) -> list[int]:
        return [i for i, p in enumerate(self.procs) if _peek(p) is None]

    def drain(self, index: int, timeout_s: float = 2.0) -> None:
        """Let process ``index``'s last lines (e.g. a traceback) arrive before the launcher speaks."""
        deadline = time.monotonic() + timeout_s
        for t in self.readers[index]:
            t.join(max(0.0, deadline - time.monotonic()))

    def teardown(self, grace_s: float) -> None:
        """SIGTERM to every live process group, SIGKILL to the survivors after ``grace_s``, then reap them all."""
        for i in self.running():
            _signal_group(self.procs[i], signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        while self.running() and time.monotonic() < deadline:
            time.sleep(_POLL_S)
        for proc in self.procs:
            # Survivors, and grandchildren left in an ended child's group (they would keep its pipes open).
            _signal_group(proc, signal.SIGKILL)
            proc.wait()
        for i in range(len(self.procs)):
            self.drain(i)

    def names(self, indices: Sequence[int]) -> str:
        return ", ".join(self.specs[i].label for i in indices)


def run_job(specs: Sequence[ProcessSpec], *, sink: Sink, timeout_s: float | None = None,
            grace_s: float = GRACE_S) -> JobResult:
    """Start every process of ``specs`` and wait for the job to end.

    The first process to fail (non-zero exit or killed by a signal) ends the job: the others get SIGTERM, then
    SIGKILL after ``grace_s``. ``timeout_s`` ends a job that runs too long the same way (exit code 124). SIGINT,
    SIGTERM and SIGHUP received meanwhile (main thread only) are forwarded to every process group.
    """
    job = _Job(specs, sink)
    start = time.monotonic()
    # The verdict is printed after the teardown, so that it is the last line of the job's output.
    with _forward_signals(job.on_signal):
        try:
            job.start()
            result = _watch(job, start, timeout_s, grace_s)
        finally:
            job.teardown(grace_s)
    for line in result.message.splitlines():
        sink.message(line)
    return result


def _watch(job: _Job, start: float, timeout_s: float | None, grace_s: float) -> JobResult:
    while True:
        if job.received is not None:
            signum = job.received
            name = signal.Signals(signum).name
            still = job.running()
            deadline = time.monotonic() + grace_s
            while job.running() and time.monotonic() < deadline:
                time.sleep(_POLL_S)
            message = f"received {name}; forwarded it to all processes"
            if still:
                message += f" (still running then: {job.names(still)})"
            return JobResult(128 + signum, message, signum)
        codes = [_peek(p) for p in job.procs]
        failed = [i for i, c in enumerate(codes) if c is not None and c != 0]
        if failed:
            first = failed[0]
            code = codes[first]
            assert code is not None
            job.drain(first)
            others = [i for i in job.running() if i != first]
            message = describe_exit(job.specs[first].name, code)
            if others:
                message += f"; stopping the other {_running_word(job)}: {job.names(others)}"
            headline = job.headlines.headline(job.specs[first].label)
            return JobResult(shell_code(code), message if headline is None else f"{headline}\n{message}")
        if all(c == 0 for c in codes):
            return JobResult(0)
        if timeout_s is not None and time.monotonic() - start > timeout_s:
            return JobResult(124, f"timed out after {_format_seconds(timeout_s)} s; "
                                  f"{_running_word(job)} still running: {job.names(job.running())}")
        time.sleep(_POLL_S)


def _running_word(job: _Job) -> str:
    return "ranks" if all(s.name.startswith("rank") for s in job.specs) else "processes"
