"""Never hang: the program guard, the watchdog and dead processes, provoked for real in 2 processes."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

import shardax as sx

SCRIPT = str(Path(__file__).parent / "scripts" / "diverge.py")
MISMATCH = str(Path(__file__).parent / "scripts" / "mismatch.py")
pytestmark = pytest.mark.multiprocess


def _launch(monkeypatch, *args, **env):
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    t0 = time.monotonic()
    result = sx.testing.launch_script(SCRIPT, *args, num_processes=2, cpu_devices=2, timeout_s=120)
    return result, time.monotonic() - t0


def test_guard_names_the_disagreeing_shapes(monkeypatch):
    result, elapsed = _launch(monkeypatch, "shape")
    assert result.returncode != 0
    assert "ProgramMismatchError" in result.output
    assert "with argument 'x' of step float32(4, 1024), process" in result.output or \
        "with argument 'x' of step float32(4, 1500), process" in result.output, result.output
    assert "finished" not in result.output
    # The launcher's summary starts with the mismatch, before "rank N exited with code 1".
    summary = [line for line in result.output.splitlines() if line.startswith("shardax launch: ")]
    assert "ProgramMismatchError: processes are about to run different" in summary[0], result.output
    assert "exited with code 1" in summary[1], result.output
    assert elapsed < 30, elapsed
    print(f"[reliability] guard, different shapes: run ended after {elapsed:.1f} s, start-up included")


# Each case changes one static argument (or the code) on process 1; the message must name it.
MISMATCHES = {
    "lambda": "and their code differs",
    "zsort": "calls zsort.smap with equalize=False, process",
    "knn": "calls knn.smap with k=9, process",
    "fof": "calls fof.smap with linking_length=0.06, process",
    "paint": "calls shardax.fields.paint with capacity=300, process",
    "readout": "calls shardax.fields.readout with capacity=300, process",
    "power_spectrum": "calls shardax.fields.power_spectrum with bins=5, process",
    "fftn": "calls shardax.fft.fftn with norm='ortho', process",
    "potrs": "calls shardax.linalg.potrs with with_logdet=True, process",
}


def test_guard_compares_code_and_static_arguments(monkeypatch):
    """Every kernel wrapper, one launch: one process changes one static argument, both get ProgramMismatchError
    naming it, in seconds; the same lambda written twice still runs."""
    monkeypatch.setenv("SHARDAX_GUARD_TIMEOUT", "60")
    t0 = time.monotonic()
    result = sx.testing.launch_script(MISMATCH, num_processes=2, cpu_devices=2, timeout_s=300)
    elapsed = time.monotonic() - t0
    assert result.returncode == 0, result.output
    lines = result.output.splitlines()
    for rank in (0, 1):
        mine = [line for line in lines if line.startswith(f"[{rank}] case ")]
        assert f"[{rank}] case same: NO ERROR" in mine, result.output
        for case, words in MISMATCHES.items():
            [line] = [line for line in mine if line.startswith(f"[{rank}] case {case}:")]
            assert "mismatch after" in line, line
            assert float(line.split("mismatch after ")[1].split(" s")[0]) < 60, line
            if rank == 0:
                assert words in line, line
    print(f"[reliability] guard, {len(MISMATCHES)} mismatched programs in one launch: {elapsed:.1f} s")


def test_guard_times_out_on_a_process_running_an_old_program(monkeypatch):
    result, elapsed = _launch(monkeypatch, "stale", SHARDAX_GUARD_TIMEOUT="5")
    assert result.returncode != 0
    assert "process 1 did not reach shardax's program check #2 within 5 s" in result.output, result.output
    assert elapsed < 40, elapsed
    print(f"[reliability] guard timeout 5 s, stale program: run ended after {elapsed:.1f} s, start-up included")


def test_strict_guard_catches_it_at_once(monkeypatch):
    result, elapsed = _launch(monkeypatch, "strict", SHARDAX_GUARD="strict", SHARDAX_GUARD_TIMEOUT="60")
    assert result.returncode != 0
    assert "ProgramMismatchError" in result.output and "float32(4, 2000)" in result.output, result.output
    assert elapsed < 30, elapsed
    print(f"[reliability] strict guard, old program re-run: run ended after {elapsed:.1f} s, start-up included")


def test_watchdog_reports_and_ends_a_stuck_run(monkeypatch):
    result, elapsed = _launch(monkeypatch, "watchdog", SHARDAX_GUARD="off", SHARDAX_WATCHDOG_S="4")
    assert result.returncode == 75, result.output
    assert "shardax watchdog: process 0: distributed call #2" in result.output, result.output
    assert "process 1: no report" in result.output
    assert elapsed < 40, elapsed
    print(f"[reliability] watchdog 4 s, sleeping rank: run ended after {elapsed:.1f} s, start-up included")


@pytest.mark.parametrize(("cause", "code", "message"), [
    ("exit", 3, "rank 1 exited with code 3"),
    ("kill", 137, "rank 1 was killed by SIGKILL"),
    ("raise", 1, "rank 1 exited with code 1"),
])
def test_dead_process_ends_the_run(monkeypatch, cause, code, message):
    result, elapsed = _launch(monkeypatch, "die", cause, SHARDAX_GUARD="off")
    assert result.returncode == code, result.output
    assert message in result.output, result.output
    if cause == "raise":
        assert "RuntimeError: process 1 fails on purpose" in result.output, result.output
    assert "finished" not in result.output
    assert elapsed < 30, elapsed
    print(f"[reliability] process 1 died by {cause}: run ended after {elapsed:.1f} s, start-up included")


@pytest.mark.mpi
@pytest.mark.skipif(shutil.which("mpirun") is None, reason="Open MPI's mpirun is not installed")
@pytest.mark.parametrize("cause", ["exit", "kill"])
def test_dead_process_ends_the_run_under_mpirun(cause):
    env = {k: v for k, v in os.environ.items() if not k.startswith("SHARDAX_")}
    env.update(JAX_NUM_CPU_DEVICES="2", SHARDAX_GUARD="off", JAX_PLATFORMS="cpu")
    t0 = time.monotonic()
    out = subprocess.run(["mpirun", "--allow-run-as-root", "--oversubscribe", "-n", "2", sys.executable, SCRIPT,
                          "die", cause], capture_output=True, text=True, timeout=120, env=env)
    elapsed = time.monotonic() - t0
    assert out.returncode != 0
    assert "finished" not in out.stdout
    assert elapsed < 40, (elapsed, out.stdout, out.stderr)
    print(f"[reliability] mpirun, process 1 died by {cause}: run ended after {elapsed:.1f} s")
