"""`shardax launch` (CLI, `shardax.runtime.launch` and `shardax.cli.launch`) and `shardax doctor`.

The launcher tests run JAX-free scripts (tests/mp_bodies/ranks.py, and TAGGED below, which writes the way gloo and an
unbuffered Python print do), so each launch costs a fraction of a second; only the CLI and doctor tests start the
JAX-importing `python -m shardax.cli`.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import shardax as sx
from shardax.cli import launch, main
from shardax.runtime._lines import MAX_LINE, Line, LineAssembler, TaggedLines

RANKS = str(Path(__file__).parent / "mp_bodies" / "ranks.py")
CLI = [sys.executable, "-m", "shardax.cli"]


def _cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=timeout)


def test_cli_prefixes_streams_and_environment() -> None:
    proc = _cli("launch", "-n", "2", "--cpu-devices", "3", RANKS, "ok", "-x", "--flag")
    assert proc.returncode == 0, proc.stderr
    for rank in (0, 1):
        assert f"[{rank}] hello from rank {rank} of 2" in proc.stdout.splitlines()
        assert f"[{rank}] cpu devices 3 3" in proc.stdout.splitlines()
        assert f"[{rank}] unbuffered 1" in proc.stdout.splitlines()
        # Options after the script belong to the script.
        assert f"[{rank}] args -x --flag" in proc.stdout.splitlines()
        # stderr lines stay on stderr, prefixed too.
        assert f"[{rank}] stderr line from rank {rank}" in proc.stderr.splitlines()
        assert f"stderr line from rank {rank}" not in proc.stdout
    coordinators = set(re.findall(r"coordinator (\S+)", proc.stdout))
    assert len(coordinators) == 1, coordinators
    host, port = coordinators.pop().split(":")
    assert host == "127.0.0.1" and 0 < int(port) < 65536
    assert "shardax launch:" not in proc.stderr


def test_python_api_and_module_target(capsys: pytest.CaptureFixture[str]) -> None:
    result = sx.runtime.launch(RANKS, "ok", "a", num_processes=3)
    assert (result.returncode, result.message, result.failed, result.error) == (0, "", None, None)
    out = capsys.readouterr().out.splitlines()
    assert sorted(line for line in out if "hello" in line) == [f"[{r}] hello from rank {r} of 3" for r in range(3)]
    assert "[2] args a" in out
    # `-m module` with options for the module (platform --terse prints one short line per rank).
    assert main(["launch", "-n", "2", "-m", "platform", "--terse"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert sorted(line[:4] for line in out) == ["[0] ", "[1] "] and all(len(line) > 4 for line in out)


GLOO = "[Gloo] Rank {r} is connected to 1 peer ranks. Expected number of connected peer ranks is : 1"
# Writes as a launched JAX program does: an unbuffered print is several writes, and gloo's thread prints its report
# to the same descriptor in between; both streams interleaved; the last lines without a newline. `fail`: rank 1
# raises after its output while rank 0 sleeps.
TAGGED = f"""
import os, sys, time
rank = int(os.environ["SHARDAX_PROCESS_ID"])
out = lambda text: os.write(1, text.encode())
err = lambda text: os.write(2, text.encode())
out(f"X (8, 1000) from {{rank}}")
out("{GLOO}".format(r=rank) + "\\n")
out(" total 42\\n")
for i in range(3):
    out(f"out {{i}}\\n")
    err(f"err {{i}}\\n")
if sys.argv[1] == "fail":
    if rank == 1:
        raise ValueError("boom from rank 1")
    time.sleep(60)
out("stdout tail without newline")
err("stderr tail without newline")
"""


def test_lines_are_whole_and_gloo_reports_cut_out() -> None:
    report = GLOO.format(r=3).encode()
    a = LineAssembler()
    # A user line in pieces, a report in between (fed byte by byte: any pipe read boundary).
    got = [line for byte in b"X (8, 1000)" + report + b"\n 42\r\n" for line in a.feed(bytes([byte]))]
    assert got == [Line(report.decode(), chatter=True), Line("X (8, 1000) 42")]
    # Reports of several gloo threads printed into each other are chatter; a line that only mentions gloo is not.
    mixed = (b"[Gloo] Rank [Gloo] Rank 01 is connected to  is connected to 77 peer ranks.  peer ranks. Expected "
             b"number of connected peer ranks is : Expected number of connected peer ranks is : 77\n")
    # Each report ends with its own newline: the ends of those printed into the line before (the last number, or
    # nothing) come as lines of their own, and are chatter; a user's line of numbers after a whole line is not.
    assert a.feed(mixed + b"\n") == [Line(mixed.decode().strip(), chatter=True), Line("", chatter=True)]
    tails = (b"[Gloo] Rank 0 is connected to [Gloo] Rank 1 is connected to 7 peer ranks. 7 peer ranks. Expected "
             b"number of connected peer ranks is : Expected number of connected peer ranks is : 7\n")
    assert a.feed(tails + b"7\n12 34\n" + tails + b"\n") == [
        Line(tails.decode().strip(), chatter=True), Line("7", chatter=True), Line("12 34"),
        Line(tails.decode().strip(), chatter=True), Line("", chatter=True)]
    assert a.feed(b"7\n") == [Line("7")]
    assert a.feed(b"notes on [Gloo] Rank 0: is connected to 7 peer ranks. slow\n")[0].chatter is False
    # gloo's report of missing peers is shown, as a line of its own.
    assert a.feed(b"half [Gloo] Rank 2 is NOT connected to: [0, 1]\nline\n") == [
        Line("[Gloo] Rank 2 is NOT connected to: [0, 1]"), Line("half line")]
    # UTF-8 split between reads; the partial last line given whole at the end; nothing is held forever.
    cafe = "caf\u00e9\n".encode()
    assert a.feed(cafe[:-2]) == [] and a.feed(cafe[-2:]) == [Line("caf\u00e9")]
    assert a.feed(b"tail") == [] and a.close() == [Line("tail")] and a.close() == []
    assert a.feed(b"x" * (MAX_LINE + 1)) == [Line("x" * (MAX_LINE + 1))]


def test_mpirun_pieces_are_joined_under_their_ranks() -> None:
    # mpirun tags every piece it read, not every line: two ranks' unbuffered prints arrive in each other's pieces
    # (the order a CI run saw), rank 1's with a gloo report inside; mpirun's own line follows a newline untagged.
    report = GLOO.format(r=1).encode()
    stream = (b"[1,0]<stdout>:X (8, 1000) from 0[1,1]<stdout>:X (8, 1000) from 1" + report + b"\n"
              b"[1,1]<stdout>: total 42\n[1,0]<stdout>: total 42\n[1,1]<stdout>:out 0\n[1,1]<stdout>:tail"
              b"\n\nPrimary job terminated normally\n[1,0]<stdout>:[not a tag] [1,")
    want = [("1", Line(report.decode(), chatter=True)), ("1", Line("X (8, 1000) from 1 total 42")),
            ("0", Line("X (8, 1000) from 0 total 42")), ("1", Line("out 0")), ("1", Line("tail")),
            ("mpirun", Line("")), ("mpirun", Line("Primary job terminated normally"))]
    for step in (1, 7, len(stream)):  # any pipe read boundary, tags cut in two included
        t = TaggedLines("mpirun")
        got = [item for i in range(0, len(stream), step) for item in t.feed(stream[i:i + step])]
        assert got == want, step
        assert t.close() == [("0", Line("[not a tag] [1,"))] and t.close() == []


def test_tagged_output_streams_and_chatter(tmp_path: Path) -> None:
    script = tmp_path / "tagged.py"
    script.write_text(TAGGED)
    proc = _cli("launch", "-n", "2", str(script), "ok")
    assert proc.returncode == 0, proc.stderr
    out, err = proc.stdout.splitlines(), proc.stderr.splitlines()
    # Every line is tagged and whole, on the stream it was written to; gloo's report is gone and the user line
    # it landed in is joined again.
    assert all(line[:4] in ("[0] ", "[1] ") for line in out + err), (out, err)
    assert "[Gloo]" not in proc.stdout + proc.stderr
    for r in (0, 1):
        mine = [line for line in out if line.startswith(f"[{r}] ")]
        assert mine == [f"[{r}] X (8, 1000) from {r} total 42", *(f"[{r}] out {i}" for i in range(3)),
                        f"[{r}] stdout tail without newline"]
        assert [line for line in err if line.startswith(f"[{r}] ")] == [
            *(f"[{r}] err {i}" for i in range(3)), f"[{r}] stderr tail without newline"]


def test_verbose_and_the_first_error_repeated(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    script = tmp_path / "tagged.py"
    script.write_text(TAGGED)
    assert main(["launch", "-n", "2", "--verbose", str(script), "fail"]) == 1
    captured = capsys.readouterr()
    out, err = captured.out.splitlines(), captured.err.splitlines()
    # --verbose keeps gloo's report, as a line of its own, and the user line whole.
    assert "[1] " + GLOO.format(r=1) in out and "[1] X (8, 1000) from 1 total 42" in out
    assert "[1] Traceback (most recent call last):" in err and "[1] ValueError: boom from rank 1" in err
    # The error the run failed on is repeated last, with its rank, before the verdict.
    assert err[-2:] == ["shardax launch: error on rank 1: ValueError: boom from rank 1",
                        "shardax launch: rank 1 exited with code 1; stopping the other ranks: 0"]
    # The library API says the same in its result; no gloo report without verbose.
    sink = sx.runtime.CaptureSink()
    result = sx.runtime.launch(script, "fail", num_processes=2, sink=sink)
    assert (result.returncode, result.failed, result.error) == (1, "rank 1", "rank 1: ValueError: boom from rank 1")
    assert ["shardax launch: " + line for line in result.message.splitlines()] == err[-2:]
    assert "[Gloo]" not in sink.text() and "[1] X (8, 1000) from 1 total 42" in sink.text("stdout").splitlines()
    assert "err 0" not in sink.text("stdout") and "out 0" not in sink.text("stderr")


@pytest.mark.mpi
@pytest.mark.skipif(shutil.which("mpirun") is None, reason="Open MPI's mpirun is not installed")
def test_mpirun_lines_come_back_under_their_ranks(tmp_path: Path) -> None:
    script = tmp_path / "tagged.py"
    script.write_text(TAGGED.replace('os.environ["SHARDAX_PROCESS_ID"]', 'os.environ["OMPI_COMM_WORLD_RANK"]'))
    sink = sx.runtime.CaptureSink()
    spec = sx.runtime.mpirun_spec([str(script), "fail"], num_processes=2, env={**os.environ, "PYTHONPATH": ""})
    result = sx.runtime.run_processes([spec], sink=sink, timeout_s=60)
    assert (result.returncode, result.failed, result.error) == (1, "mpirun", "rank 1: ValueError: boom from rank 1")
    out = sink.text("stdout").splitlines()
    assert "[1] X (8, 1000) from 1 total 42" in out and "[1] out 2" in out and "[Gloo]" not in sink.text()
    assert "[1] ValueError: boom from rank 1" in sink.text("stderr").splitlines()


def test_failing_rank_sets_exit_code_and_stops_the_others(capsys: pytest.CaptureFixture[str]) -> None:
    start = time.monotonic()
    code = launch([RANKS, "fail", "1", "3"], num_processes=3)
    elapsed = time.monotonic() - start
    err = capsys.readouterr().err
    assert code == 3
    assert elapsed < 20, f"the other ranks (sleeping 300 s) were not torn down quickly: {elapsed:.1f} s"
    assert "shardax launch: rank 1 exited with code 3; stopping the other ranks: 0, 2" in err
    # The failing rank's last words come before the launcher's verdict.
    assert err.index("[1] rank 1 is failing") < err.index("rank 1 exited with code 3")


def test_killed_rank_reports_signal(capsys: pytest.CaptureFixture[str]) -> None:
    start = time.monotonic()
    code = launch([RANKS, "kill", "1"], num_processes=2)
    assert code == 128 + signal.SIGKILL == 137
    assert time.monotonic() - start < 20
    assert "rank 1 was killed by SIGKILL" in capsys.readouterr().err


def test_timeout(capsys: pytest.CaptureFixture[str]) -> None:
    start = time.monotonic()
    code = launch([RANKS, "sleep"], num_processes=2, timeout_s=1.5)
    elapsed = time.monotonic() - start
    assert code == 124
    assert 1.5 <= elapsed < 15
    assert "timed out after 1.5 s; ranks still running: 0, 1" in capsys.readouterr().err


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_signals_reach_every_rank(signum: signal.Signals) -> None:
    # The launcher runs in its own session, as under a terminal: only the launcher gets the signal, and it forwards.
    launcher = subprocess.Popen([*CLI, "launch", "-n", "2", RANKS, "term"], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        pids = []
        assert launcher.stdout is not None
        while len(pids) < 2:
            line = launcher.stdout.readline()
            assert line, "the launcher ended before both ranks were ready"
            match = re.search(r"ready rank \d+ pid (\d+)", line)
            if match:
                pids.append(int(match.group(1)))
        launcher.send_signal(signum)
        out, err = launcher.communicate(timeout=20)
    finally:
        if launcher.poll() is None:
            launcher.kill()
    assert launcher.returncode == 128 + signum
    for rank in (0, 1):
        assert f"[{rank}] rank {rank} got {signum.name}" in out
    assert f"shardax launch: received {signum.name}" in err
    deadline = time.monotonic() + 5
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(_alive(p) for p in pids)


def test_bad_input(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(ValueError, match="does not exist"):
        launch("no/such/script.py", num_processes=2)
    with pytest.raises(ValueError, match="num_processes must be a positive int"):
        launch(RANKS, num_processes=0)
    with pytest.raises(ValueError, match="timeout_s"):
        launch(RANKS, num_processes=1, timeout_s=-1)
    with pytest.raises(ValueError, match="module name"):
        launch(["-m"], num_processes=1)
    with pytest.raises(TypeError, match="target"):
        launch(3, num_processes=1)  # type: ignore[arg-type]
    for argv in (["launch", "-n", "2"], ["launch", RANKS], ["launch", "-n", "0", RANKS],
                 ["launch", "-n", "2", "missing.py"], ["frobnicate"]):
        with pytest.raises(SystemExit) as exc:
            main(argv)
        assert exc.value.code == 2, argv
    err = capsys.readouterr().err
    assert "missing the script" in err and "'missing.py' does not exist" in err and "unknown command" in err


def _lines(text: str) -> list[str]:
    return [" ".join(line.split()) for line in text.splitlines()]


def test_doctor_one_process() -> None:
    proc = _cli("doctor", "--cpu-devices", "8", "--size-mb", "0.25", "--repeats", "2")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = _lines(proc.stdout)
    for key in ("jax 0.10", "num_processes 1", "global devices 8", "mode single", "device grid (1 x 8)"):
        assert any(line.startswith(key) for line in lines), (key, proc.stdout)
    for check in ("allreduce", "alltoall", "alltoallv"):
        row = next(line for line in lines if re.search(rf"\b{check}\b", line) and re.search("PASS|FAIL", line))
        assert "PASS" in row, row
    assert "doctor: all checks passed" in lines


def test_doctor_two_processes() -> None:
    proc = _cli("doctor", "--processes", "2", "--cpu-devices", "4", "--size-mb", "0.25", "--repeats", "2",
                "--plain", timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = _lines(proc.stdout)
    for key in ("[0] num_processes 2", "[0] local devices 4", "[0] global devices 8", "[0] mode spmd",
                "[0] device grid (2 x 4):", "[0] doctor: all checks passed"):
        assert key in lines, (key, proc.stdout)
    assert any(line.startswith("[0] started by shardax-launch (coordinator 127.0.0.1:") for line in lines)
    for check in ("allreduce", "alltoall", "alltoallv"):
        row = next(line for line in lines if line.startswith(f"[0] {check} "))
        assert row.endswith("PASS"), row
        assert float(row.split()[-2]) > 0  # GB/s
    # Only rank 0 reports, and gloo's connection reports are not shown.
    assert not any(line.startswith("[1] doctor") for line in lines)
    assert "[Gloo]" not in proc.stdout + proc.stderr and "peer ranks" not in proc.stdout + proc.stderr


def test_doctor_reports_failures() -> None:
    # A wrong allreduce (identity) and a broken alltoallv must turn into FAIL rows and exit code 1.
    code = ("import sys, shardax.comm as comm\n"
            "comm.allreduce = lambda x, *a, **k: x\n"
            "def broken(*a, **k):\n"
            "    raise RuntimeError('alltoallv is broken')\n"
            "comm.alltoallv = broken\n"
            "from shardax.cli import main\n"
            "sys.exit(main(['doctor', '--plain', '--cpu-devices', '2', '--size-mb', '0.01', '--repeats', '1']))\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    lines = _lines(proc.stdout)
    rows = {line.split()[0]: line for line in lines if line.endswith(("PASS", "FAIL"))}
    assert rows["allreduce"].endswith("FAIL") and rows["alltoallv"].endswith("FAIL")
    assert rows["alltoall"].endswith("PASS")
    assert "alltoallv: RuntimeError: alltoallv is broken" in lines
    assert "doctor: FAILED: allreduce, alltoallv" in lines


def test_coordinator_port_is_free_on_every_address_and_outside_the_ephemeral_range() -> None:
    """The launch's coordinator port: free on the wildcard address JAX's coordinator binds (a port a listener holds
    on ``[::]`` or ``0.0.0.0`` is refused), and below the range the OS hands out for outgoing connections and
    ``bind(0)``, where concurrent launches and gloo's sockets took it before the coordinator bound it."""
    import socket

    from shardax.runtime._launch import _bindable, _ephemeral_low, free_port

    low = _ephemeral_low()
    ports = {free_port() for _ in range(20)}
    assert all(max(1024, low - 16384) <= p < low for p in ports), sorted(ports)
    assert len(ports) > 10  # picked at random, not one port again and again
    family, address = (socket.AF_INET6, "::") if socket.has_ipv6 else (socket.AF_INET, "0.0.0.0")
    with socket.socket(family, socket.SOCK_STREAM) as held:
        if family == socket.AF_INET6:
            held.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        held.bind((address, 0))
        held.listen()
        port = held.getsockname()[1]
        assert not _bindable("127.0.0.1", port)
    assert _bindable("127.0.0.1", port)


# A parent that may not import JAX: an import hook that makes ``import jax`` fail, set before shardax is imported.
_NO_JAX = (
    "import sys\n"
    "class NoJax:\n"
    "    def find_spec(self, name, path=None, target=None):\n"
    "        if name == 'jax' or name.startswith(('jax.', 'jaxlib')):\n"
    "            raise ImportError('the launching process imported ' + name)\n"
    "sys.meta_path.insert(0, NoJax())\n"
)


def test_launching_imports_no_jax(tmp_path: Path) -> None:
    """The process that only starts others (``shardax launch``, ``shardax halos --processes N``) never imports JAX,
    nor does ``import shardax`` with its public names; the launched processes do, and the job still runs."""
    names = ("sx.CapacityError, sx.retry_capacity, sx.__version__, sx.runtime.launch, sx.runtime.ENV_NUM_PROCESSES, "
             "sx.runtime.detect_launch, sx.runtime.run_processes")
    code = (_NO_JAX + "import shardax as sx\n"
            f"{names}\n"
            "from shardax.cli import main\n"
            f"assert main(['launch', '-n', '2', {RANKS!r}, 'ok']) == 0\n"
            f"assert main(['halos', '--processes', '2', '--cpu-devices', '2', '--particles', '3000', '--plain', "
            f"'--no-cache', '--min-members', '10', '--out', {str(tmp_path)!r}]) == 0\n"
            "assert not [m for m in sys.modules if m == 'jax' or m.startswith('jax.')]\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "[1] hello from rank 1 of 2" in proc.stdout and "halos (>= 10)" in proc.stdout
    assert (tmp_path / "fof_tab_000.hdf5").exists()
    # The last process plots (process 0 prints): the summary names the file it wrote.
    assert (tmp_path / "mass_function.png").stat().st_size > 1000
    assert f"mass function     {tmp_path / 'mass_function.png'}" in proc.stdout


def test_public_faces_resolve_every_name() -> None:
    """``shardax`` and ``shardax.runtime`` import their parts on first use: every public name resolves (to the
    object of the module that defines it), ``dir`` lists them, and a wrong name fails as on any module."""
    import shardax.runtime._world as world_module

    for face in (sx, sx.runtime):
        assert set(face.__all__) <= set(dir(face)), face.__name__
        for name in face.__all__:
            assert getattr(face, name) is not None, (face.__name__, name)
    assert sx.World is world_module.World and sx.runtime.world is world_module.world and sx.comm.allreduce
    assert sx.runtime.detect_launch is sx.runtime._env.detect
    for face in (sx, sx.runtime):
        with pytest.raises(AttributeError, match=f"module '{face.__name__}' has no attribute 'no_such_name'"):
            face.no_such_name  # noqa: B018


def test_job_process_ends_with_its_exit_code_and_output(tmp_path: Path) -> None:
    """``python -m shardax.cli`` ends a process that ran JAX without tearing the interpreter down: its exit code
    and every line it wrote still come through, and so do the exit handlers' lines."""
    bad = tmp_path / "bad.hdf5"
    bad.write_bytes(b"\x89HDF\r\n" + b"0" * 100)
    code = ("import atexit, runpy, sys\n"
            "atexit.register(lambda: print('exit handler ran', flush=False))\n"
            f"sys.argv = ['shardax', 'halos', {str(bad)!r}, '--no-cache', '--out', {str(tmp_path / 'o')!r}]\n"
            "runpy.run_module('shardax.cli', run_name='__main__')\n")
    env = {**os.environ, "SHARDAX_MALLOC": "system"}  # no restart with the allocator's settings: this process ends
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 1, proc.stderr
    assert "truncated or corrupt" in proc.stderr and "exit handler ran" in proc.stdout
    good = _cli("halos", "--particles", "2000", "--min-members", "10", "--no-cache", "--plain", "--out",
                str(tmp_path / "g"))
    assert good.returncode == 0, good.stderr
    assert good.stdout.rstrip().splitlines()[-1].startswith("  ") and "halos (>= 10)" in good.stdout
