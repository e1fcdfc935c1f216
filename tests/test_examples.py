"""Every script in examples/ runs green as 2 processes x 4 CPU devices through the launcher (and, for the
single-process-capable ones, as a plain `python` run).

These launches run without JAX's compilation cache, as a user's script does by default, so their sorts on CPU take
NumPy's host sort at 2 processes (the FoF and z-order examples); ``sx.testing.run_distributed``'s launches turn the
cache on and sort in XLA."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

import shardax as sx

# The two slowest launches (FoF's and kNN's programs at 2 x 4, compiled again: 20-40 s each) run with
# ``pytest -m slow``; tests/test_fof_multiprocess.py and tests/test_knn.py launch the same kernels at that scale.
_SLOW = {"fof_catalogue", "knn_density"}
EXAMPLES = [pytest.param(path, marks=pytest.mark.slow) if path.stem in _SLOW else path
            for path in sorted((Path(__file__).parent.parent / "examples").glob("*.py"))]


@pytest.mark.multiprocess
@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: getattr(p, "stem", None))
def test_example_two_processes(example):
    result = sx.testing.launch_script(str(example), num_processes=2, cpu_devices=4, timeout_s=400)
    assert result.returncode == 0, result.output
    assert "[0] " in result.output   # (some examples print on rank 0 only; gloo's reports are hidden)


def test_expanding_smap_single_process():
    example = Path(__file__).parent.parent / "examples" / "expanding_smap.py"
    out = subprocess.run([sys.executable, str(example)], capture_output=True, text=True, timeout=300,
                         env={"JAX_PLATFORMS": "cpu", "PATH": "/usr/bin:/bin", "JAX_NUM_CPU_DEVICES": "1"})
    assert out.returncode == 0, out.stdout + out.stderr
    assert "outside (1, 10000, 3) (1,) ()" in out.stdout
