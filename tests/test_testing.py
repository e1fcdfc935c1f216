"""`sx.testing`: run_distributed (through sx.runtime.launch and mpirun), launch_script, the tolerance table.

`world_checks` is the multi-process body: one launch per launcher runs every check (world, device grid, a psum across
processes, seed 000's host replication, seed 001's psum over all devices) and the parent compares the per-process
results with NumPy.
"""

from __future__ import annotations

import dataclasses
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import shardax as sx
from shardax.runtime import detect_launch

RANKS = str(Path(__file__).parent / "mp_bodies" / "ranks.py")
NPROC, NDEV = 2, 4


def _shards(a: jax.Array) -> list[tuple[int, tuple[tuple[int | None, int | None], ...], np.ndarray]]:
    """(device id, index as (start, stop) pairs, data) of every addressable shard."""
    return [(s.device.id, tuple((i.start, i.stop) for i in s.index), np.asarray(s.data)) for s in a.addressable_shards]


def _global(host: np.ndarray, sharding: NamedSharding) -> jax.Array:
    return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])


def world_checks(scale: float) -> dict[str, Any]:
    """Runs in every process; returns what the parent checks."""
    w = sx.world()
    grid = sx.device_grid()
    mesh = sx.grid_mesh(("x", "y"))
    n = grid.size
    # A psum across processes: device (p, j) holds (p + 1) * scale + j; summing over "x" adds the processes.
    values = np.array([(p + 1) * scale + j for p in range(grid.shape[0]) for j in range(grid.shape[1])], np.float32)
    psum_x = sx.smap(lambda v: jax.lax.psum(v, "x"), in_specs=P(sx.ALL), out_specs=P(sx.ALL), mesh=mesh, jit=True)
    summed = psum_x(_global(values, NamedSharding(mesh, P(("x", "y")))))
    # Seed 001: a psum over every device of every process (of 1, and of each device's linear rank).
    def count_and_rank_sum() -> tuple[jax.Array, jax.Array]:
        rank, _, axes = sx.rank_info()
        one = jnp.ones((), jnp.int32)
        return jax.lax.psum(one, axes), jax.lax.psum(jnp.asarray(rank, jnp.int32), axes)

    count, rank_sum = sx.smap(count_and_rank_sum, in_specs=(), out_specs=(P(sx.ALL), P(sx.ALL)), mesh=mesh)()
    # Seed 000: a diagonal matrix sharded by columns over every device, then host-replicated (sharded over "y").
    diag = np.diag(np.arange(1, n + 1, dtype=np.float32))
    a = _global(diag, NamedSharding(mesh, P(None, ("x", "y"))))
    replicated = sx.host_replicate(a, mesh, axis="x")
    return {
        "world": dataclasses.asdict(w),
        "grid_process": [[d.process_index for d in row] for row in grid],
        "grid_ids": [[d.id for d in row] for row in grid],
        "psum_x": _shards(summed), "count": _shards(count), "rank_sum": _shards(rank_sum),
        "a": _shards(a), "replicated": _shards(replicated), "replicated_spec": str(replicated.sharding.spec),
        "scale": scale, "source": detect_launch().source,
    }


def _check_world_results(results: list[dict[str, Any]], scale: float, source: str, nproc: int = NPROC,
                         ndev: int = NDEV) -> None:
    assert len(results) == nproc
    assert [r["source"] for r in results] == [source] * nproc
    n = nproc * ndev
    grid_ids = results[0]["grid_ids"]
    for rank, r in enumerate(results):
        assert r["scale"] == scale
        assert r["world"] == {"process_id": rank, "num_processes": nproc, "local_device_count": ndev,
                              "device_count": n, "num_hosts": 1, "platform": "cpu",
                              "mode": "spmd" if nproc > 1 else "single"}
        assert r["grid_process"] == [[p] * ndev for p in range(nproc)]
        assert r["grid_ids"] == grid_ids  # every process sees the same grid
        mine = grid_ids[rank]
        # psum over processes, against NumPy on the gathered inputs.
        inputs = np.array([[(p + 1) * scale + j for j in range(ndev)] for p in range(nproc)], np.float32)
        expected = np.tile(inputs.sum(axis=0), nproc)
        assert sorted(dev for dev, _, _ in r["psum_x"]) == sorted(mine)
        for _, ((start, stop),), data in r["psum_x"]:
            np.testing.assert_array_equal(data, expected[start:stop])
        for dev, _, data in r["count"]:
            assert int(data[0]) == n, dev
        for dev, _, data in r["rank_sum"]:
            assert int(data[0]) == n * (n - 1) // 2, dev
        # Seed 000: before, each device holds one column of diag(1..n); this process holds its own n/nproc.
        diag = np.diag(np.arange(1, n + 1, dtype=np.float32))
        columns = []
        for _, (rows, (c0, c1)), data in r["a"]:
            assert rows == (None, None) and c1 - c0 == 1
            np.testing.assert_array_equal(data, diag[:, c0:c1])
            columns.append(c0)
        assert sorted(columns) == list(range(rank * ndev, (rank + 1) * ndev))
        # After host replication every process holds the whole matrix, in column blocks of n / ndev over its devices.
        assert r["replicated_spec"] == str(P(None, "y"))
        blocks = []
        for _, (rows, (c0, c1)), data in r["replicated"]:
            assert rows == (None, None) and c1 - c0 == n // ndev
            np.testing.assert_array_equal(data, diag[:, c0:c1])
            blocks.append((c0, c1))
        assert sorted(blocks) == [(k * n // ndev, (k + 1) * n // ndev) for k in range(ndev)]


@pytest.mark.multiprocess
@pytest.mark.parametrize("nproc,ndev", [(NPROC, NDEV), (1, 8)], ids=["2x4", "1x8"])
def test_run_distributed_shardax_launch(nproc: int, ndev: int) -> None:
    results = sx.testing.run_distributed(world_checks, 2.5, num_processes=nproc, cpu_devices=ndev, timeout_s=240)
    _check_world_results(results, 2.5, "shardax-launch", nproc, ndev)


@pytest.mark.multiprocess
@pytest.mark.mpi
@pytest.mark.skipif(shutil.which("mpirun") is None, reason="Open MPI's mpirun is not installed")
def test_run_distributed_mpirun() -> None:
    results = sx.testing.run_distributed(world_checks, 1.0, num_processes=NPROC, cpu_devices=NDEV, timeout_s=240,
                                         launcher="mpirun")
    _check_world_results(results, 1.0, "openmpi4")


def failing_body() -> int:
    rank = sx.world().process_id
    print(f"rank {rank} before the failure", flush=True)
    if rank == 1:
        raise ValueError("boom from rank 1")
    return rank


@pytest.mark.multiprocess
def test_run_distributed_failure_shows_every_rank() -> None:
    start = time.monotonic()
    with pytest.raises(AssertionError) as exc:
        sx.testing.run_distributed(failing_body, num_processes=2, cpu_devices=1, timeout_s=120)
    message = str(exc.value)
    assert time.monotonic() - start < 60
    assert "rank 1 exited with code 1" in message
    assert "----- rank 0 output -----" in message and "----- rank 1 output -----" in message
    assert "rank 0 before the failure" in message
    rank1 = message.split("----- rank 1 output -----")[1]
    assert "ValueError: boom from rank 1" in rank1 and "Traceback" in rank1


def test_run_distributed_rejects_what_children_cannot_import() -> None:
    def nested() -> None:
        pass

    with pytest.raises(TypeError, match="module level"):
        sx.testing.run_distributed(nested)
    with pytest.raises(TypeError, match="module level"):
        sx.testing.run_distributed(lambda: None)
    with pytest.raises(TypeError, match="picklable"):
        sx.testing.run_distributed(failing_body, lambda: None)
    with pytest.raises(ValueError, match="launcher"):
        sx.testing.run_distributed(failing_body, launcher="srun")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="num_processes"):
        sx.testing.run_distributed(failing_body, num_processes=0)


def test_launch_script_captures_output() -> None:
    ok = sx.testing.launch_script(RANKS, "ok", "z", num_processes=2, cpu_devices=2, timeout_s=60)
    assert ok.returncode == 0
    lines = ok.output.splitlines()
    for rank in (0, 1):
        assert f"[{rank}] hello from rank {rank} of 2" in lines
        assert f"[{rank}] cpu devices 2 2" in lines and f"[{rank}] args z" in lines
        # Each stream on its own as well.
        assert f"[{rank}] stderr line from rank {rank}" in ok.stderr.splitlines()
        assert f"[{rank}] args z" in ok.stdout.splitlines() and "stderr line" not in ok.stdout
    failed = sx.testing.launch_script(Path(RANKS), "fail", "0", "5", num_processes=2, timeout_s=60)
    assert failed.returncode == 5
    # The failing rank's last stderr line is repeated, then the verdict ends the output.
    assert failed.output.splitlines()[-2:] == [
        "shardax launch: error on rank 0: rank 0 is failing",
        "shardax launch: rank 0 exited with code 5; stopping the other ranks: 1"]
    assert failed.stderr.splitlines()[-2:] == failed.output.splitlines()[-2:]
    module = sx.testing.launch_script("platform", "--terse", num_processes=2, timeout_s=60)
    assert module.returncode == 0 and sorted(line[:4] for line in module.output.splitlines()) == ["[0] ", "[1] "]


def test_tolerance_table() -> None:
    for kind in ("default", "linalg", "fft"):
        f16, bf16, f32, f64 = (sx.testing.tolerance(d, kind) for d in (jnp.float16, jnp.bfloat16, "float32",
                                                                          np.float64))
        assert bf16["rtol"] >= f16["rtol"] > f32["rtol"] > f64["rtol"] > 0
        assert f32["atol"] > f64["atol"] > 0
        assert sx.testing.tolerance(np.complex64, kind) == f32
        assert sx.testing.tolerance(jnp.complex128, kind) == f64
        for exact in (np.int32, jnp.uint8, bool):
            assert sx.testing.tolerance(exact, kind) == {"rtol": 0.0, "atol": 0.0}
    assert sx.testing.tolerance("float32", "linalg")["rtol"] >= sx.testing.tolerance("float32")["rtol"]
    with pytest.raises(ValueError, match="kind must be one of"):
        sx.testing.tolerance(np.float32, "spectral")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="no tolerance for dtype"):
        sx.testing.tolerance(np.dtype("U3"))
    with pytest.raises(TypeError, match="dtype must be"):
        sx.testing.tolerance(object())


def test_assert_allclose() -> None:
    x = np.linspace(1, 2, 50)
    rtol32 = sx.testing.tolerance(np.float32)["rtol"]
    # A float32 result against a float64 reference gets the float32 tolerance...
    sx.testing.assert_allclose(x.astype(np.float32), x)
    sx.testing.assert_allclose(jnp.asarray(x * (1 + rtol32 / 2), jnp.float32), x)
    with pytest.raises(AssertionError, match="float32"):
        sx.testing.assert_allclose(np.float32(x * (1 + 4 * rtol32)), x)
    # ...and float64 against float64 is much stricter.
    with pytest.raises(AssertionError, match="float64"):
        sx.testing.assert_allclose(x * (1 + rtol32 / 2), x)
    sx.testing.assert_allclose(x * (1 + rtol32 / 2), x, dtype=np.float32)
    sx.testing.assert_allclose(x * (1 + 1e-5), x, kind="linalg", dtype=np.float32)
    # Complex data, and integers exactly.
    z = x + 1j * x[::-1]
    sx.testing.assert_allclose(z.astype(np.complex64), z)
    with pytest.raises(AssertionError):
        sx.testing.assert_allclose(z.astype(np.complex64) * np.complex64(1 + 1e-3j), z)
    sx.testing.assert_allclose(np.arange(5, dtype=np.int32), np.arange(5))
    with pytest.raises(AssertionError, match="exact"):
        sx.testing.assert_allclose(np.arange(5, dtype=np.int32) + np.array([0, 0, 1, 0, 0], np.int32),
                                   np.arange(5))
    with pytest.raises(AssertionError, match="shapes differ"):
        sx.testing.assert_allclose(np.zeros(3), np.zeros((3, 1)))


def test_importing_testing_starts_no_backend() -> None:
    import subprocess

    keys = ("jax_num_cpu_devices", "jax_cpu_collectives_implementation", "jax_enable_x64", "jax_platforms")
    code = (f"import sys, jax; keys = {keys!r}; before = [getattr(jax.config, k) for k in keys]; "
            "import shardax.testing; assert not any(m.startswith('shardax.cli') for m in sys.modules), 'cli'; "
            "import shardax.cli; from jax._src import xla_bridge; "
            "assert not xla_bridge.backends_are_initialized(), 'backend started'; "
            "assert before == [getattr(jax.config, k) for k in keys], 'config changed'; print('ok')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


# ---------------------------------------------------------------------------------------------------------------
# shardax.testing.reference: each reference against an independent computation (SciPy, a loop, a shardax kernel on
# one device) and on inputs chosen to break it (periodic wrap, ties, open boundaries, empty bins).

ref = sx.testing.reference


def _clustered(n: int, dim: int, seed: int) -> np.ndarray:
    """Points in [0, 1): half in a few tight clumps (some across the periodic edge), half uniform."""
    rng = np.random.default_rng(seed)
    centres = np.concatenate([rng.random((4, dim)), np.full((1, dim), 0.995)])
    clumps = centres[rng.integers(0, len(centres), n // 2)] + 0.01 * rng.standard_normal((n // 2, dim))
    return np.mod(np.concatenate([clumps, rng.random((n - n // 2, dim))]), 1.0)


def _brute_pairs(pos: np.ndarray, radius: float, box: float | None) -> np.ndarray:
    delta = ref.minimum_image(pos[:, None, :] - pos[None, :, :], box)
    i, j = np.nonzero(np.triu(np.sum(delta**2, axis=-1) <= radius**2, k=1))
    return np.stack([i, j], axis=1)


@pytest.mark.parametrize("dim,box", [(3, 1.0), (2, 1.0), (3, None), (2, None)], ids=["3d", "2d", "3d-open", "2d-open"])
def test_reference_friend_pairs_and_labels(dim: int, box: float | None, monkeypatch) -> None:
    from scipy.sparse import coo_matrix
    from scipy.sparse.csgraph import connected_components

    pos = _clustered(1500, dim, seed=dim)
    radius = 0.6 / 1500 ** (1 / dim)
    want = _brute_pairs(pos, radius, box)
    assert len(want) > 100
    np.testing.assert_array_equal(ref.friend_pairs(pos, radius, box=box), want)  # SciPy's cKDTree
    labels = ref.fof_labels(pos, radius, box=box, min_members=5)
    components = ref.fof_components(pos, radius, box=box)
    monkeypatch.setitem(sys.modules, "scipy.spatial", None)  # the NumPy cell grid
    np.testing.assert_array_equal(ref.friend_pairs(pos, radius, box=box), want)
    np.testing.assert_array_equal(ref.fof_labels(pos, radius, box=box, min_members=5), labels)
    # Labels: smallest member of each connected component, -1 below min_members.
    n = len(pos)
    _, comp = connected_components(coo_matrix((np.ones(len(want)), tuple(want.T)), shape=(n, n)), directed=False)
    smallest = np.full(comp.max() + 1, n)
    np.minimum.at(smallest, comp, np.arange(n))
    np.testing.assert_array_equal(ref.component_labels(n, want), smallest[comp])
    sizes = np.bincount(comp)[comp]
    np.testing.assert_array_equal(labels, np.where(sizes >= 5, smallest[comp], -1))
    assert (labels >= 0).sum() > 100 and (labels == -1).sum() > 100
    # fof_components: the same partition, numbered SciPy's way.
    np.testing.assert_array_equal(smallest[components], smallest[comp])


def test_reference_fof_catalogue_against_a_loop() -> None:
    rng = np.random.default_rng(3)
    pos = _clustered(2000, 3, seed=3)
    mass, vel = rng.uniform(0.5, 2.0, 2000), rng.standard_normal((2000, 3))
    labels = ref.fof_labels(pos, 0.01, box=1.0, min_members=4)
    cat = ref.fof_catalogue(pos, labels, mass=mass, vel=vel, box=1.0)
    groups = np.unique(labels[labels >= 0])
    np.testing.assert_array_equal(cat["label"], groups)
    assert len(groups) >= 5 and cat["com"].shape == (len(groups), 3) and not cat["spanning"].any()
    straddles = False
    for g, label in enumerate(groups):
        idx = np.flatnonzero(labels == label)
        d = pos[idx] - pos[label]
        d -= np.round(d)
        straddles |= bool(np.ptp(pos[idx], axis=0).max() > 0.5)  # some group crosses the periodic edge
        m = mass[idx]
        com = pos[label] + (m[:, None] * d).sum(0) / m.sum()
        assert cat["count"][g] == len(idx)
        np.testing.assert_allclose(cat["mass"][g], m.sum(), rtol=1e-12)
        np.testing.assert_allclose(cat["com"][g], com % 1.0, rtol=1e-12)
        np.testing.assert_allclose(cat["vel"][g], (m[:, None] * vel[idx]).sum(0) / m.sum(), rtol=1e-12)
        spread = ref.minimum_image(pos[idx] - com, 1.0)
        np.testing.assert_allclose(cat["radius"][g], np.sqrt((m * (spread**2).sum(1)).sum() / m.sum()), rtol=1e-9)
    assert straddles
    # Open boundaries, default masses; a group wider than half a periodic box is flagged.
    line = np.stack([np.linspace(0.0, 0.9, 10), np.zeros(10)], axis=1)
    cat = ref.fof_catalogue(line, np.zeros(10, np.int64))
    np.testing.assert_allclose(cat["com"], [[0.45, 0.0]])
    assert cat["mass"].tolist() == [10.0] and cat["vel"].tolist() == [[0.0, 0.0]]
    assert ref.fof_catalogue(line * 2, np.zeros(10, np.int64), box=2.0)["spanning"].tolist() == [True]
    empty = ref.fof_catalogue(line, np.full(10, -1))
    assert empty["com"].shape == (0, 2) and empty["count"].shape == (0,)


def test_reference_brute_knn() -> None:
    from scipy.spatial import KDTree

    pos = _clustered(3000, 3, seed=5)
    queries = np.arange(0, 3000, 37)
    for box in (1.0, None):
        d, i = ref.brute_knn(pos, 8, queries=queries, box=box)
        want_d, want_i = KDTree(pos, boxsize=box).query(pos[queries], 8)
        np.testing.assert_allclose(d, want_d, rtol=1e-12)
        assert np.all(i[:, 0] == queries) and np.mean(i == want_i) > 0.99
    # Equal distances come by row index; the whole set when no queries are given.
    grid = np.stack(np.meshgrid(*[np.arange(4) / 4] * 2, indexing="ij"), -1).reshape(-1, 2)
    d, i = ref.brute_knn(grid, 5, box=1.0)
    assert d.shape == (16, 5) and i[0].tolist() == [0, 1, 3, 4, 12]
    np.testing.assert_allclose(d[:, 1:], 0.25)
    with pytest.raises(ValueError, match=r"k must be an int in \[1, 16\]"):
        ref.brute_knn(grid, 17)
    with pytest.raises(ValueError, match="pos must be a"):
        ref.brute_knn(np.zeros(5), 1)


@pytest.mark.parametrize("dim", [2, 3])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_reference_morton_against_shardax(dim: int, dtype: Any) -> None:
    rng = np.random.default_rng(dim)
    pos = (rng.random((4000, dim)) * 3.0 - 1.0).astype(dtype)  # outside the box too: wrapped
    pos[:10] = pos[10:20]  # equal keys: ties by ids
    pos[20] = 2.0  # exactly on a box edge
    with jax.enable_x64(dtype == np.float64):  # shardax quantises in the positions' dtype
        hi, lo = sx.particles.morton_keys(jnp.asarray(pos), box=2.0)
    keys = ref.morton_keys(pos, box=2.0)
    np.testing.assert_array_equal(keys, np.asarray(hi, np.uint64) << np.uint64(32) | np.asarray(lo, np.uint64))
    ids = rng.permutation(4000)
    order = ref.morton_order(pos, box=2.0, ids=ids)
    np.testing.assert_array_equal(order, np.lexsort((ids, keys)))
    assert np.all(np.diff(keys[order].astype(np.float64)) >= 0)
    inside = np.mod(pos, dtype(2.0))
    inside[inside >= 2.0] = 0
    np.testing.assert_array_equal(ref.morton_keys(inside, box=2.0, wrap=False), keys)
    with pytest.raises(ValueError, match="2D or 3D"):
        ref.morton_keys(np.zeros((3, 4)))


def test_reference_cic_and_power_against_shardax() -> None:
    pos = _clustered(4000, 3, seed=7).astype(np.float32)
    n, shape = len(pos), (16, 8, 16)
    mass = np.random.default_rng(7).uniform(0.5, 1.5, n)
    rho = ref.cic_paint(pos, shape, box=1.0, mass=mass)
    np.testing.assert_allclose(rho.sum(), mass.sum(), rtol=1e-12)
    part = sx.particles.Particles(jnp.asarray(pos), jnp.int32(n), mass=jnp.asarray(mass, jnp.float32))
    sx.testing.assert_allclose(sx.fields.local_paint(part, shape, box=1.0)[0], rho, kind="linalg")
    # Readout is paint's transpose: <readout(f), m> == <f, paint(m)>.
    field = np.random.default_rng(8).standard_normal(shape)
    values = ref.cic_readout(field, pos, box=1.0)
    np.testing.assert_allclose(values @ mass, np.sum(field * rho), rtol=1e-10)
    sx.testing.assert_allclose(sx.fields.local_readout(jnp.asarray(field, jnp.float32), part, box=1.0)[0][:n], values,
                               kind="linalg")
    with pytest.raises(ValueError, match="one size per axis"):
        ref.cic_paint(pos, (8, 8), box=1.0)

    cube = ref.cic_paint(pos, (16, 16, 16), box=1.0)
    delta = (cube / cube.mean() - 1).astype(np.float32)
    edges = sx.fields.bin_edges(6, (16, 16, 16), 1.0)
    for compensate in (True, False):
        k, pk, modes = sx.fields.local_power_spectrum(jnp.asarray(delta), box=1.0, bins=6, compensate=compensate)
        want_k, want_pk, want_modes = ref.power_spectrum(delta, box=1.0, edges=edges, compensate=compensate)
        np.testing.assert_array_equal(np.asarray(modes), want_modes)
        sx.testing.assert_allclose(np.asarray(k), want_k)
        sx.testing.assert_allclose(np.asarray(pk) / want_pk.max(), want_pk / want_pk.max(), dtype=np.float32,
                                   kind="fft")
    # An empty bin: its centre and no power.
    k, pk, modes = ref.power_spectrum(delta, box=1.0, edges=np.array([0.1, 0.2, 2 * np.pi * 1.2]))
    assert modes[0] == 0 and k[0] == pytest.approx(0.15) and pk[0] == 0 and modes[1] == 6


def test_reference_imports_scipy_lazily() -> None:
    import subprocess

    path = Path(sx.testing.reference.__file__)
    code = ("import importlib.util, sys; "
            f"spec = importlib.util.spec_from_file_location('reference', {str(path)!r}); "
            "module = importlib.util.module_from_spec(spec); spec.loader.exec_module(module); "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('scipy', 'jax', 'shardax')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stderr
