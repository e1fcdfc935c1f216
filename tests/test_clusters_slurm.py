"""Slurm: a single-node Slurm (Debian's slurm-wlm + munge, started here) runs ``srun -n 2 python script.py``.

The script calls ``sx.initialize()`` with no arguments; shardax must detect Slurm from what ``srun`` really sets,
with 1 and several CPU devices per task, and an allreduce over every device must be right. The exact environments
``srun`` set here are kept in tests/cluster/envs/ and checked by test_clusters_detect.py. Skipped (with the reason)
when not root or when slurm-wlm/munge are not installed.
"""

from __future__ import annotations

import os
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "cluster"))

import slurm  # noqa: E402
import world_body  # noqa: E402

REASON = slurm.unavailable()
pytestmark = [pytest.mark.multiprocess, pytest.mark.skipif(REASON is not None, reason=REASON or "")]


@pytest.fixture(scope="module")
def cluster():
    with slurm.LocalSlurm() as local:
        yield local


@pytest.mark.parametrize("devices", [1, 3])
def test_srun_two_tasks_autodetected(cluster: slurm.LocalSlurm, devices: int) -> None:
    done = cluster.srun(["-n", "2", sys.executable, world_body.__file__], timeout_s=180,
                        env={"JAX_NUM_CPU_DEVICES": str(devices)})
    assert done.returncode == 0, f"srun exited with {done.returncode}:\n{done.stdout[-4000:]}"
    found = world_body.reports(done.stdout)
    world_body.check(found, processes=2, devices=devices, source="slurm", output=done.stdout)
    for r in found:
        assert r["env"]["SLURM_PROCID"] == str(r["process_id"])
        assert r["env"]["SLURM_STEP_NUM_TASKS"] == "2"


def test_srun_failing_task_ends_the_step(cluster: slurm.LocalSlurm, tmp_path) -> None:
    script = tmp_path / "fail.py"
    script.write_text("import os, sys\nimport shardax as sx\nw = sx.initialize()\n"
                      "sys.exit(3 if w.process_id == 1 else 0)\n")
    done = cluster.srun(["-n", "2", sys.executable, str(script)], timeout_s=120, env={"JAX_NUM_CPU_DEVICES": "1"})
    assert done.returncode == 3, f"srun exited with {done.returncode}:\n{done.stdout[-3000:]}"
