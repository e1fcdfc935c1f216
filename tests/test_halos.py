"""``shardax halos``: generated data and a snapshot file, checked against the SciPy FoF reference; bad arguments."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

import shardax as sx
from shardax.cli._halos import generate, run_cli
from test_fof_multiprocess import reference_labels


def _reference_counts(pos: np.ndarray, linking_length: float, box: float, min_members: int) -> np.ndarray:
    labels = reference_labels(pos, linking_length, box, min_members)
    _, counts = np.unique(labels[labels >= 0], return_counts=True)
    return np.sort(counts)


def test_generated(tmp_path, capsys) -> None:
    out = tmp_path / "gen"
    code = run_cli(["--particles", "6000", "--min-members", "10", "--seed", "3", "--out", str(out)])
    assert code == 0
    text = capsys.readouterr().out
    assert "[5/5] mass function plot" in text and "largest halos" in text
    cat = sx.io.read(out / "halos.h5")
    assert (out / "mass_function.png").stat().st_size > 1000
    pos, _ = generate(6000, 1.0, 3)
    want = _reference_counts(pos, 0.2 / 6000 ** (1 / 3), 1.0, 10)
    got = np.sort(np.concatenate([cat["count"][d, : cat["num"][d]] for d in range(len(cat["num"]))]))
    assert len(want) >= 5
    np.testing.assert_array_equal(got, want)


def test_snapshot_absolute_linking_length(tmp_path, capsys) -> None:
    pos, vel = generate(4000, 20.0, 5)
    snap = tmp_path / "snap.hdf5"
    sx.io.write_snapshot(snap, pos, box=20.0, vel=vel, mass=2.0)
    out = tmp_path / "snap_out"
    code = run_cli([str(snap), "--linking-length", "0.25", "--absolute", "--min-members", "8", "--out", str(out),
                    "--per-rank"])
    assert code == 0
    text = capsys.readouterr().out
    assert f"snapshot {snap}" in text
    cat = sx.io.read(out / "halos.h5")
    got = np.concatenate([cat["count"][d, : cat["num"][d]] for d in range(len(cat["num"]))])
    np.testing.assert_array_equal(np.sort(got), _reference_counts(pos, 0.25, 20.0, 8))
    mass = np.concatenate([cat["mass"][d, : cat["num"][d]] for d in range(len(cat["num"]))])
    np.testing.assert_allclose(np.sort(mass), 2.0 * np.sort(got))


@pytest.mark.parametrize("args, message", [
    (["--linking-length", "-1"], "--linking-length must be positive"),
    (["--min-members", "0"], "--min-members must be a positive integer"),
    (["no_such_snapshot.hdf5"], "does not exist"),
])
def test_bad_arguments(args, message, capsys) -> None:
    with pytest.raises(SystemExit) as exit_info:
        run_cli(args)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_bad_snapshot_file(tmp_path, capsys) -> None:
    bad = tmp_path / "bad.hdf5"
    bad.write_bytes(b"\x89HDF\r\n" + b"0" * 100)
    assert run_cli([str(bad), "--out", str(tmp_path / "o")]) == 1
    assert "truncated or corrupt" in capsys.readouterr().err


@pytest.mark.multiprocess
def test_two_processes_on_snapshot(tmp_path) -> None:
    pos, vel = generate(3000, 1.0, 8)
    snap = tmp_path / "snap.hdf5"
    sx.io.write_snapshot(snap, pos, box=1.0, vel=vel)
    out = tmp_path / "mp"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SHARDAX_", "JAX_NUM_CPU"))}
    proc = subprocess.run([sys.executable, "-m", "shardax.cli", "halos", str(snap), "--processes", "2",
                           "--cpu-devices", "2", "--min-members", "10", "--out", str(out)],
                          capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "RuntimeWarning" not in proc.stderr, proc.stderr  # the ranks run `python -m shardax.cli halos`
    assert "[0] [5/5] mass function plot" in proc.stdout
    cat = sx.io.read(out / "halos.h5")
    assert cat["num"].shape == (4,)
    got = np.concatenate([cat["count"][d, : cat["num"][d]] for d in range(4)])
    np.testing.assert_array_equal(np.sort(got), _reference_counts(pos, 0.2 / 3000 ** (1 / 3), 1.0, 10))
