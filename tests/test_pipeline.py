"""The whole pipeline (collectives, zsort, knn, fof, potrs, fftn; tests/cluster/pipeline.py) at every scale.

One device, 8 devices in one process and 2 processes x 4 devices give identical integer results and float results
within tolerance, and the NumPy/SciPy results on the gathered data. Where the machine allows (root, iproute2), the
2 x 4 run is a multi-host run over a real (virtual) network: each process on its own network namespace with its own
address on a bridge (tests/cluster/netns.py), the processes finding each other through a static config (explicit
coordinator on host 0, as on Kubernetes) and gloo's traffic crossing the veth links; in the same processes the
pipeline then runs again with 5 ms delay and 1% loss on every link (the same results, slower). Elsewhere the 2 x 4
run is two processes on loopback (``sx.testing.run_distributed``) and the network test is skipped with the reason.
One launch serves both tests: compiling the pipeline on 2 x 4 devices is most of their time.
"""

from __future__ import annotations

import dataclasses
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from jax.sharding import Mesh

import shardax as sx
from shardax.testing import reference

sys.path.insert(0, str(Path(__file__).parent / "cluster"))
import netns
import pipeline

pytestmark = pytest.mark.multiprocess

INTEGER = ("zsort_ids", "knn_indices", "fof_labels")
FLOAT = ("zsort_pos", "knn_distances", "potrs_x", "fftn")


@dataclasses.dataclass
class TwoByFour:
    """The pipeline's results on 2 processes x 4 devices, and how they were obtained."""

    results: list[dict[str, np.ndarray]]  # per process
    no_network: str | None  # why the run was on loopback; None: on two network namespaces
    crossed: int = 0  # bytes over the virtual links
    no_faults: str | None = None  # why the faulty phase did not run
    fault_method: str = ""
    warm_s: np.ndarray | None = None  # (phases, repeats): clean, then faulty
    stages: dict[str, np.ndarray] = dataclasses.field(default_factory=dict)  # per-stage warm medians per phase


def pipeline_in_world() -> dict:
    return pipeline.run_pipeline(sx.flat_mesh())


def _link_bytes(cluster: netns.VirtualCluster) -> int:
    total = 0
    for link in cluster.links:
        with open(f"/sys/class/net/{link}/statistics/rx_bytes") as f:
            total += int(f.read())
    return total


def _on_two_hosts(tmp: Path) -> TwoByFour:
    out = tmp / "process0.npz"
    with netns.virtual_cluster(2) as cluster:
        methods: list[str] = []

        def faults_on_between_phases() -> None:
            deadline = time.monotonic() + 480
            while not (tmp / "phase1.ready").exists() and time.monotonic() < deadline:
                time.sleep(0.05)
            methods.extend(cluster.impair(h, delay_ms=5.0, loss=0.01) for h in range(cluster.num_hosts))
            (tmp / "phase1.go").write_text("go\n")

        no_faults = cluster.faults_unavailable()
        before = _link_bytes(cluster)
        switcher = threading.Thread(target=faults_on_between_phases, daemon=True)
        if no_faults is None:
            switcher.start()
        runs = cluster.launch([sys.executable, pipeline.__file__, "--out", str(out), "--out-others",
                               str(tmp / "process{process}.npz"), "--repeats", "1",
                               "--phases", "1" if no_faults else "2", "--sync-dir", str(tmp)], cpu_devices=4,
                              timeout_s=600, grace_s=5)
        crossed = _link_bytes(cluster) - before
        if no_faults is None:
            switcher.join(timeout=1)
    for rank, (code, text) in enumerate(runs):
        assert code == 0, f"process {rank} exited with {code}:\n{text[-4000:]}"
    results = []
    for rank in range(2):
        with np.load(tmp / f"process{rank}.npz") as data:
            results.append({k: data[k] for k in data.files})
    first = results[0]
    assert int(first["num_processes"]) == 2 and int(first["num_devices"]) == 8
    stages = {k.removeprefix("time_"): np.median(first[k], axis=1) for k in first if k.startswith("time_")}
    return TwoByFour(results, None, crossed, no_faults, methods[0] if methods else "", first["warm_s"], stages)


@pytest.fixture(scope="module")
def two_by_four(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TwoByFour]:
    why = netns.unavailable()
    if why is None:
        yield _on_two_hosts(tmp_path_factory.mktemp("two_hosts"))
    else:
        yield TwoByFour(sx.testing.run_distributed(pipeline_in_world, num_processes=2, cpu_devices=4,
                                                   timeout_s=900), why)


def check_against_numpy(res: dict[str, np.ndarray]) -> None:
    """Every stage against a plain NumPy/SciPy reference on the gathered data; integers exactly."""
    x = res["comm_input"]
    ndev = len(x)
    for r in range(ndev):
        np.testing.assert_array_equal(res["comm_allreduce"][r], x.sum(0))
        np.testing.assert_array_equal(res["comm_allmax"][r], x.max(0))
        np.testing.assert_array_equal(res["comm_allgather"][r], x)
        np.testing.assert_array_equal(res["comm_alltoall"][r], x[:, r])
        np.testing.assert_array_equal(res["comm_bcast"][r], x[ndev - 1])
    np.testing.assert_array_equal(res["comm_shift"], np.roll(x, 1, axis=0))
    np.testing.assert_array_equal(res["comm_scan"], np.cumsum(x, axis=0))
    np.testing.assert_array_equal(res["comm_allreduce_f32"], np.full((ndev, 256), ndev * (ndev + 1) / 2, np.float32))
    pos = res["particles_input"]
    np.testing.assert_array_equal(res["zsort_ids"], reference.morton_order(pos, box=1.0, ids=np.arange(len(pos))))
    np.testing.assert_array_equal(res["zsort_pos"], pos[res["zsort_ids"]])
    ref_d, _ = reference.brute_knn(pos, pipeline.K_NEIGHBOURS, box=1.0)
    np.testing.assert_allclose(res["knn_distances"], ref_d, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(res["knn_indices"][:, 0], np.arange(len(pos)))
    wide = pos.astype(np.float64)
    got = np.sqrt((reference.minimum_image(wide[res["knn_indices"]] - wide[:, None, :], 1.0) ** 2).sum(-1))
    np.testing.assert_allclose(got, res["knn_distances"], rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(res["fof_labels"],
                                  reference.fof_labels(pos, pipeline.LINKING_LENGTH, box=1.0, min_members=5))
    np.testing.assert_allclose(res["potrs_x"], np.linalg.solve(res["potrs_a"].astype(np.float64), res["potrs_b"]),
                               rtol=2e-3, atol=2e-4)
    np.testing.assert_allclose(res["fftn"], np.fft.fftn(res["fft_input"]), rtol=1e-4, atol=1e-3)


def _mesh(n: int) -> Mesh:
    import jax

    return Mesh(np.array(jax.devices()[:n]), ("d",))


def test_same_results_at_every_scale(two_by_four: TwoByFour) -> None:
    one = pipeline.run_pipeline(_mesh(1))
    eight = pipeline.run_pipeline(_mesh(8))
    where = "loopback" if two_by_four.no_network else "two hosts"
    first, second = two_by_four.results
    check_against_numpy(one)
    assert len(np.unique(one["fof_labels"])) > 2, "the pipeline's FoF finds groups"
    for label, other in (("8 devices", eight), (f"2 processes x 4 ({where})", first), (f"process 1 ({where})", second)):
        for key in INTEGER:
            np.testing.assert_array_equal(other[key], one[key], err_msg=f"{key}: {label} vs 1 device")
        for key in FLOAT:
            try:
                sx.testing.assert_allclose(other[key], one[key], kind="linalg" if key == "potrs_x" else "default")
            except AssertionError as err:
                raise AssertionError(f"{key}: {label} vs 1 device\n{err}") from None


def test_two_hosts_clean_then_delay_and_loss(two_by_four: TwoByFour, capsys: pytest.CaptureFixture[str]) -> None:
    if two_by_four.no_network is not None:
        pytest.skip(f"the 2 x 4 run was on loopback: {two_by_four.no_network}")
    assert two_by_four.crossed > 1 << 20, \
        f"only {two_by_four.crossed} bytes crossed the virtual links: gloo did not use the network"
    check_against_numpy(two_by_four.results[0])
    if two_by_four.no_faults is not None:
        pytest.skip(f"the clean run passed; faults on the wire: {two_by_four.no_faults}")
    assert two_by_four.warm_s is not None
    clean, faulty = (float(np.median(w)) for w in two_by_four.warm_s)
    assert faulty > clean, f"5 ms delay did not slow the pipeline ({clean:.3f} s clean, {faulty:.3f} s faulty)"
    with capsys.disabled():
        per_stage = ", ".join(f"{k} {c:.3f}->{f:.3f} s" for k, (c, f) in two_by_four.stages.items())
        print(f"\n[clusters] 2 hosts x 4 devices, pipeline warm median {clean:.3f} s clean, {faulty:.3f} s with "
              f"5 ms + 1% loss on every link ({faulty / clean:.1f}x; {per_stage}; faults by "
              f"{two_by_four.fault_method}); {two_by_four.crossed / 2**20:.1f} MiB crossed the links")
