"""Run a group of processes as one job: tagged output, first failure tears the rest down, signals forwarded.

This is the engine under :func:`shardax.runtime.launch` (and so ``shardax launch`` and :mod:`shardax.testing`). It
knows nothing about JAX: it starts the commands it is given, each in its own process group, reads each one's stdout
and stderr from separate pipes as whole lines (:mod:`._lines`), and watches them.
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

from ._lines import Line, LineAssembler, TaggedLines

Stream = Literal["stdout", "stderr"]

# How long children get between SIGTERM and SIGKILL when the job is torn down.
GRACE_S = 3.0
_POLL_S = 0.05


@dataclasses.dataclass(frozen=True)
class ProcessSpec:
    """One process of a job.

    Attributes:
        argv: its command line (``[sys.executable, "script.py", ...]``).
        env: its whole environment.
        label: the tag of its output lines (``"0"`` prints as ``[0] ...``).
        name: how the launcher's messages name it (``"rank 0"``, ``"mpirun"``).
        tagged: its lines carry ``mpirun --tag-output`` tags (``[1,3]<stdout>:``): each is given under the rank
            its tag names (``"3"``), untagged lines (``mpirun``'s own) under ``label``.
    """

    argv: Sequence[str]
    env: Mapping[str, str]
    label: str
    name: str
    tagged: bool = False


class Sink(Protocol):
    """Where a job's output goes: the processes' whole lines and the launcher's own messages."""

    def line(self, label: str, stream: Stream, text: str) -> None: ...

    def message(self, text: str) -> None: ...


class ConsoleSink:
    """Each line to the stream it was written to (stdout or stderr) prefixed ``[label] ``, as ``mpirun
    --tag-output`` does; the launcher's messages to stderr, prefixed ``shardax launch: ``."""

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
    """Keeps every line, in arrival order, for the caller to read (used by :mod:`shardax.testing`)."""

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

    def text(self, stream: Stream | None = None) -> str:
        """The lines as :class:`ConsoleSink` prints them, in arrival order: both streams, or only ``stream`` (the
        launcher's messages count as stderr)."""
        with self._lock:
            return "".join(f"shardax launch: {text}\n" if label is None else f"[{label}] {text}\n"
                           for label, s, text in self.lines if stream is None or s == stream)

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
    """How a job ended.

    Attributes:
        returncode: 0 if every process succeeded; else the first failing process's exit code (``128 + K`` when it
            was killed by signal ``K``), 124 on timeout, ``128 + K`` when the launcher itself received signal ``K``.
        message: what the launcher printed at the end ("" on success): the first error, then the verdict.
        signal_received: the signal that interrupted the launcher, if any.
        failed: the name of the first process that failed (``"rank 1"``), if one did.
        error: the line that says why, with the process that printed it (``"rank 1: ValueError: ..."``): a
            traceback's last line (a program mismatch first, whoever printed it), else the failed process's last
            stderr line; None when there is none.
    """

    returncode: int
    message: str = ""
    signal_received: int | None = None
    failed: str | None = None
    error: str | None = None


# A traceback's last line: ``shardax._errors.ProgramMismatchError: processes are about to run ...``.
_ERROR_LINE = re.compile(r"^(?:[A-Za-z_]\w*\.)*[A-Z]\w*(?:Error|Exception|Interrupt): \S")
# Errors that explain the other processes' failures too: their line goes first, whoever failed first.
_EXPLAINS_OTHERS = ("ProgramMismatchError",)


class _Errors:
    """Each process's last exception line and last stderr line, to say at the end why the job failed."""

    def __init__(self) -> None:
        self.last_error: dict[str, str] = {}
        self.last_stderr: dict[str, str] = {}
        self.first_error: tuple[str, str] | None = None
        self.explaining: tuple[str, str] | None = None
        self._lock = threading.Lock()

    def see(self, label: str, stream: Stream, text: str) -> None:
        if stream != "stderr" or not text.strip():
            return
        with self._lock:
            self.last_stderr[label] = text
            if _ERROR_LINE.match(text):
                self.last_error[label] = text
                self.first_error = self.first_error or (label, text)
                if self.explaining is None and any(n in text.split(":", 1)[0] for n in _EXPLAINS_OTHERS):
                    self.explaining = (label, text)

    def error(self, label: str, *, signalled: bool, tagged: bool) -> tuple[str, str] | None:
        """``(label, line)`` that says why process ``label`` failed: a program mismatch, else its last exception
        line (for ``mpirun``, whose ranks' lines come under their own labels: the first exception line of any),
        else (when it exited rather than being killed) its last stderr line."""
        with self._lock:
            if self.explaining is not None:
                return self.explaining
            if label in self.last_error:
                return label, self.last_error[label]
            if tagged and self.first_error is not None:
                return self.first_error
            if not signalled and label in self.last_stderr:
                return label, self.last_stderr[label]
            return None


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


def _pump(pipe: IO[bytes], emit: Callable[[str, Line], None], label: str, tagged: bool) -> None:
    """Whole lines of ``pipe`` to ``emit`` as they complete, the last ones when the process ends.

    Lines are given under ``label``, or, ``tagged``, under the rank their ``mpirun --tag-output`` tags name.
    """
    assembler: LineAssembler | TaggedLines = TaggedLines(label) if tagged else LineAssembler()
    with pipe:
        fd = pipe.fileno()
        while chunk := os.read(fd, 1 << 16):
            for item in assembler.feed(chunk):
                emit(*_labelled(label, item))
        for item in assembler.close():
            emit(*_labelled(label, item))


def _labelled(label: str, item: Line | tuple[str, Line]) -> tuple[str, Line]:
    return (label, item) if isinstance(item, Line) else item


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
    def __init__(self, specs: Sequence[ProcessSpec], sink: Sink, verbose: bool):
        self.specs = list(specs)
        self.sink = sink
        self.verbose = verbose
        self.errors = _Errors()
        self.procs: list[subprocess.Popen[bytes]] = []
        self.readers: list[list[threading.Thread]] = []
        self.received: int | None = None

    def emitter(self, stream: Stream) -> Callable[[str, Line], None]:
        def emit(label: str, line: Line) -> None:
            if line.chatter and not self.verbose:
                return
            self.errors.see(label, stream, line.text)
            self.sink.line(label, stream, line.text)

        return emit

    def start(self) -> None:
        for spec in self.specs:
            # Own process group per child: a terminal's Ctrl-C reaches only the launcher, which forwards it once,
            # and a teardown also reaches whatever the child started itself.
            proc = subprocess.Popen(list(spec.argv), env=dict(spec.env), stdin=subprocess.DEVNULL,
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, process_group=0)
            self.procs.append(proc)
            threads = []
            streams: tuple[tuple[IO[bytes] | None, Stream], ...] = ((proc.stdout, "stdout"), (proc.stderr, "stderr"))
            for pipe, stream in streams:
                assert pipe is not None
                t = threading.Thread(target=_pump, args=(pipe, self.emitter(stream), spec.label, spec.tagged),
                                     daemon=True)
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


def run_processes(specs: Sequence[ProcessSpec], *, sink: Sink | None = None, timeout_s: float | None = None,
                  verbose: bool = False, grace_s: float = GRACE_S) -> JobResult:
    """Start every process of ``specs`` and wait for the job to end.

    Each process's stdout and stderr are read from separate pipes, as whole lines, and given to ``sink`` with the
    stream they came from (default: :class:`ConsoleSink`, which prints them ``[label] ...`` on that stream). gloo's
    connection reports are left out unless ``verbose``. The first process to fail (non-zero exit or killed by a
    signal) ends the job: the others get SIGTERM, then SIGKILL after ``grace_s``. ``timeout_s`` ends a job that runs
    too long the same way (exit code 124). SIGINT, SIGTERM and SIGHUP received meanwhile (main thread only) are
    forwarded to every process group. At the end ``sink`` gets the launcher's messages: the first error with the
    process that printed it, then the verdict (:class:`JobResult` ``.message``).

    Args:
        specs: the processes (:func:`rank_specs` makes those of a launch).
        sink: where the lines go.
        timeout_s: end the job after this many seconds; ``None`` waits forever.
        verbose: keep gloo's connection reports.
        grace_s: seconds between SIGTERM and SIGKILL at the teardown.

    Returns:
        A :class:`JobResult`.

    Raises:
        ValueError: no processes, or a non-positive ``timeout_s``.

    Example:
        >>> import sys, shardax as sx
        >>> spec = sx.runtime.ProcessSpec([sys.executable, "-c", "print('hi')"], {}, label="0", name="rank 0")
        >>> sx.runtime.run_processes([spec]).returncode  # doctest: +SKIP
        [0] hi
        0
    """
    if not specs:
        raise ValueError("specs is empty: give at least one ProcessSpec")
    if timeout_s is not None and (isinstance(timeout_s, bool) or not isinstance(timeout_s, int | float)
                                  or not timeout_s > 0):
        raise ValueError(f"timeout_s must be a positive number of seconds or None, got {timeout_s!r}")
    sink = ConsoleSink() if sink is None else sink
    job = _Job(specs, sink, verbose)
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


def _failure(job: _Job, index: int, code: int) -> JobResult:
    """The result of a job whose process ``index`` failed first with ``Popen.returncode`` ``code``."""
    job.drain(index)
    spec = job.specs[index]
    others = [i for i in job.running() if i != index]
    verdict = describe_exit(spec.name, code)
    if others:
        verdict += f"; stopping the other {_running_word(job)}: {job.names(others)}"
    found = job.errors.error(spec.label, signalled=code < 0, tagged=spec.tagged)
    if found is None:
        return JobResult(shell_code(code), verdict, failed=spec.name)
    label, text = found
    by = next((s.name for s in job.specs if s.label == label), f"rank {label}")
    error = f"{by}: {text}"
    return JobResult(shell_code(code), f"error on {error}\n{verdict}", failed=spec.name, error=error)


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
            code = codes[failed[0]]
            assert code is not None
            return _failure(job, failed[0], code)
        if all(c == 0 for c in codes):
            return JobResult(0)
        if timeout_s is not None and time.monotonic() - start > timeout_s:
            return JobResult(124, f"timed out after {_format_seconds(timeout_s)} s; "
                                  f"{_running_word(job)} still running: {job.names(job.running())}")
        time.sleep(_POLL_S)


def _running_word(job: _Job) -> str:
    return "ranks" if all(s.name.startswith("rank") for s in job.specs) else "processes"
