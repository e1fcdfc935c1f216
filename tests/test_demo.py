"""``shardax demo``: the default run end to end (2 processes x 4 CPU devices), failing checks giving failed rows and a
non-zero exit, the comparisons themselves, bad flags (the references are tested in test_testing.py)."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest

import shardax as sx
from shardax.cli import _demo_checks as check
from shardax.cli import _demo_stages
from shardax.cli._demo import run_cli
from shardax.cli._demo_body import run_demo
from shardax.cli._demo_plots import write_plots
from shardax.cli._demo_table import (
    CAPABILITIES,
    REPORT_NAME,
    Report,
    Row,
    exit_code,
    format_plain,
    read_report,
)
from shardax.cli._halos import generate


@pytest.mark.slow  # its kernels and checks are tested at every scale elsewhere; `pytest -m slow` runs it
@pytest.mark.multiprocess
@pytest.mark.timeout(1200)  # about 2 minutes on an idle 2-core machine, mostly XLA compiling; much more under load
def test_default_demo_passes_every_check(tmp_path) -> None:
    out = tmp_path / "demo"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SHARDAX_", "JAX_NUM_CPU"))}
    proc = subprocess.run([sys.executable, "-m", "shardax.cli", "demo", "--out", str(out), "--plain"],
                          capture_output=True, text=True, timeout=1150, env=env)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-6000:]
    assert "shardax demo on 8 cpu device(s) (2 process(es) x 4)" in proc.stdout
    assert "[8/8] paint + power spectrum ..." in proc.stdout
    table = proc.stdout[proc.stdout.index("capability"):]
    for name in CAPABILITIES:
        line = next(line for line in table.splitlines() if line.startswith(name))
        assert line.rstrip().endswith("PASS"), line
    assert "demo: every check passed" in proc.stdout
    report = read_report(str(out / REPORT_NAME))
    assert report is not None and [row.capability for row in report.rows] == list(CAPABILITIES)
    assert all(row.ok for row in report.rows)
    for name in ("halo_mass_function.png", "knn_density_slice.png", "power_spectrum.png"):
        assert (out / name).stat().st_size > 5000, name


def _namespace(out: str) -> argparse.Namespace:
    return argparse.Namespace(particles=2000, matrix=32, grid=16, seed=1, cpu_devices=None, out=out, plain=True)


def test_a_wrong_kernel_result_is_a_failed_row_and_exit_code_1(tmp_path, monkeypatch, capsys) -> None:
    """A kernel whose answer is off in one element (fftn), and one that raises, fail their rows; the demo goes on
    and returns 1."""

    def off_by_one_element(x: jax.Array, **options: object) -> jax.Array:
        return sx.fft.fftn(x, **options).at[1, 2, 3].add(0.5)

    def raising(ctx: _demo_stages.Context) -> _demo_stages.Outcome:
        raise sx.CapacityError("a buffer was too small")

    monkeypatch.setattr(_demo_stages, "fftn", off_by_one_element)
    monkeypatch.setattr(_demo_stages, "STAGES", (("fftn", _demo_stages.fftn_stage), ("potrs", raising),
                                                 ("syevd", _demo_stages.syevd_stage)))
    assert run_demo(_namespace(str(tmp_path)), print_table=True) == 1
    text = capsys.readouterr().out
    assert "[1/3] fftn ..." in text and "[3/3] syevd ..." in text
    rows = {line.split()[0]: line for line in text.splitlines() if line.startswith(("fftn ", "potrs ", "syevd "))}
    assert rows["fftn"].rstrip().endswith("FAIL") and rows["potrs"].rstrip().endswith("FAIL")
    assert rows["syevd"].rstrip().endswith("PASS")
    assert "fftn: fftn: 1 of 4096 values outside rtol=0.0001, atol=0.0001 (complex64, fft)" in text
    assert "potrs: CapacityError: a buffer was too small" in text
    assert "zsort: did not finish" not in text  # only the stages asked for are in the printed table
    report = read_report(str(tmp_path / REPORT_NAME))
    assert report is not None and [r.ok for r in report.rows] == [False, False, True]
    assert exit_code(report, ["fftn", "potrs", "syevd"]) == 1
    monkeypatch.setattr(_demo_stages, "STAGES", (("syevd", _demo_stages.syevd_stage),))
    assert run_demo(_namespace(str(tmp_path)), print_table=True) == 0
    assert "demo: every check passed" in capsys.readouterr().out


def test_report_verdict_and_missing_capabilities(tmp_path) -> None:
    passed = tuple(Row(name, "s", 1.0, 0.1, "NumPy", True) for name in CAPABILITIES)
    assert exit_code(Report("w", passed)) == 0
    failed = (*passed[:2], Row("knn density", "s", 1.0, 0.1, "brute force", False, ("knn indices: 3 differ",)),
              *passed[3:])
    text = format_plain(Report("w", failed))
    assert exit_code(Report("w", failed)) == 1
    assert "knn density: knn indices: 3 differ" in text and "demo: FAILED (knn density)" in text
    partial = Report("w", passed[:3]).with_missing()
    assert exit_code(Report("w", passed[:3])) == 1
    assert [r.ok for r in partial.rows] == [True] * 3 + [False] * 5
    assert "fof + catalogue: did not finish: the run ended first" in format_plain(partial)
    path = tmp_path / "r.json"
    path.write_text(json.dumps({"world": "w", "rows": [], "plots": [], "notes": []}))
    assert read_report(str(path)) == Report("w", ())
    assert read_report(str(tmp_path / "absent.json")) is None


def test_checks_catch_wrong_answers() -> None:
    pos, _ = generate(3000, 1.0, 2)
    order = sx.testing.reference.morton_order(pos, box=1.0, ids=np.arange(3000))
    assert check.exact("ids", order, order) == ""
    assert "2 of 3000 values differ" in check.exact("ids", order[[1, 0, *range(2, 3000)]], order)
    queries = np.arange(0, 3000, 97)
    d, i = sx.testing.reference.brute_knn(pos, 6, queries=queries, box=1.0)
    assert check.knn_mismatch(d[:, :5], i[:, :5], d, i, np.float32) == ""
    wrong = i[:, :5].copy()
    wrong[3, 2] = wrong[3, 3] + 1
    assert "knn indices" in check.knn_mismatch(d[:, :5], wrong, d, i, np.float32)
    assert "knn distances" in check.knn_mismatch(d[:, :5] * 1.001, i[:, :5], d, i, np.float32)
    assert check.below("residual", 1e-7, 1e-5) == "" and "residual" in check.below("residual", float("nan"), 1e-5)


def test_plots_are_skipped_without_matplotlib(tmp_path, monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    paths, notes = write_plots({"halo_mass": np.ones(3)}, np.zeros((4, 3)), 1.0, str(tmp_path))
    assert paths == [] and notes == ["plots skipped: matplotlib is not installed (pip install matplotlib, or "
                                     "shardax[all])"]
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("args, message", [
    (["--grid", "60"], "--grid 60 must be divisible by the 8 devices of the run (slabs of the FFT); try --grid 64"),
    (["--processes", "0"], "argument --processes: must be a positive integer, got 0"),
    (["--particles", "10"], "--particles must be at least 1000, got 10"),
    (["--timeout", "0"], "argument --timeout: must be a positive number of seconds, got 0"),
    (["--matrix", "many"], "argument --matrix: invalid int value: 'many'"),
    (["--fast"], "unrecognized arguments: --fast"),
])
def test_bad_flags(args, message, capsys) -> None:
    with pytest.raises(SystemExit) as exit_info:
        run_cli(args)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err
