"""sx.spatial.knn against scipy's cKDTree and an exact NumPy reference, on 1 device, meshes and 2 processes."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import multihost_utils
from jax.sharding import Mesh
from scipy.spatial import cKDTree

import shardax as sx
from conftest import USER_COMPILER_OPTIONS, collectives_ordered, make_mesh
from shardax._morton import periodic_box
from shardax.spatial import KnnTuning, knn
from shardax.spatial._knn_dist import _aligned_runs
from shardax.spatial._knn_local import local_knn_steps
from shardax.spatial._knn_pass import _kept_before, smallest
from shardax.testing import reference
from shardax.testing.reference import morton_keys


def ref_knn(pos: np.ndarray, k: int, box: float | tuple | None, query: np.ndarray | None = None):
    tree = cKDTree(np.asarray(pos, np.float64), boxsize=box)
    d, i = tree.query(np.asarray(pos if query is None else query, np.float64), k=k)
    return d.reshape(len(d), k), i.reshape(len(i), k)


def check_against(res_d: np.ndarray, res_i: np.ndarray, ref_d: np.ndarray, ref_i: np.ndarray, dtype) -> None:
    """Distances equal to tolerance; indices equal wherever the reference distance is not (nearly) tied."""
    tol = 1e-5 if dtype == np.float32 else 1e-11
    np.testing.assert_allclose(res_d, ref_d, rtol=tol, atol=tol)
    padded = np.concatenate([np.full((len(ref_d), 1), -np.inf), ref_d, np.full((len(ref_d), 1), np.inf)], 1)
    gap = np.minimum(padded[:, 1:-1] - padded[:, :-2], padded[:, 2:] - padded[:, 1:-1])
    clear = gap > 4 * tol * np.maximum(ref_d, 1.0)
    assert clear.mean() > 0.9
    np.testing.assert_array_equal(res_i[clear], ref_i[clear])


def blobs(rng: np.random.Generator, n: int) -> np.ndarray:
    centers = rng.random((5, 3))
    pos = centers[rng.integers(0, 5, n)] + rng.normal(0, 0.01, (n, 3)) * rng.choice([1, 10], (n, 1))
    pos[: n // 10] = rng.random((n // 10, 3))  # a sparse background
    return pos.astype(np.float32)


@functools.cache
def jitted(k: int, box, with_query: bool = False, tuning: KnnTuning | str | None = None):
    if with_query:
        return jax.jit(lambda part, query: knn(part, k, box=box, query=query, tuning=tuning))
    return jax.jit(lambda part: knn(part, k, box=box, tuning=tuning))


CASES = {
    "uniform-open": (lambda rng: rng.random((3000, 3), dtype=np.float32), None),
    "uniform-periodic-per-axis": (lambda rng: (rng.random((3000, 3)) * [1.0, 2.0, 0.5]).astype(np.float32),
                                  (1.0, 2.0, 0.5)),
    "blobs-open": (lambda rng: blobs(rng, 3000), None),
    "uniform-2d-periodic": (lambda rng: rng.random((3000, 2), dtype=np.float32), 1.0),
}


@pytest.mark.parametrize("case", list(CASES))
def test_matches_ckdtree(case: str) -> None:
    make, box = CASES[case]
    pos = make(np.random.default_rng(1))
    res = jitted(9, box)(jnp.asarray(pos))
    ref_d, ref_i = ref_knn(pos, 9, box)
    check_against(np.asarray(res.distances), np.asarray(res.indices), ref_d, ref_i, np.float32)
    assert np.all(np.asarray(res.indices)[:, 0] == np.arange(len(pos)))


@pytest.mark.parametrize("box", [None, 6.0])
def test_lattice_ties_by_index(box: float | None) -> None:
    # Integer lattice: squared distances are exact small integers, so every tie is a true tie.
    g = np.arange(6, dtype=np.float32)
    pos = np.stack(np.meshgrid(g, g, g, indexing="ij"), -1).reshape(-1, 3)
    pos = pos[np.random.default_rng(2).permutation(len(pos))]
    res = jitted(27, box)(jnp.asarray(pos))
    ref_d, ref_i = reference.brute_knn(pos.astype(np.float64), 27, box=box)
    np.testing.assert_allclose(np.asarray(res.distances), ref_d, rtol=1e-6)
    np.testing.assert_array_equal(np.asarray(res.indices), ref_i)


def test_lattice_ties_ordered_in_several_chunks() -> None:
    # 4096 lattice points, every row tied (six neighbours at distance 1): the tie order runs in chunks of 1024 rows.
    g = np.arange(16, dtype=np.float32)
    pos = np.stack(np.meshgrid(g, g, g, indexing="ij"), -1).reshape(-1, 3)
    pos = pos[np.random.default_rng(5).permutation(len(pos))]
    ref_d, ref_i = reference.brute_knn(pos.astype(np.float64), 8, box=16.0)
    for tuning in ("cpu", "gpu"):
        res = knn(jnp.asarray(pos), 8, box=16.0, tuning=tuning)
        np.testing.assert_allclose(np.asarray(res.distances), ref_d, rtol=1e-6)
        np.testing.assert_array_equal(np.asarray(res.indices), ref_i)


def test_duplicates_boundaries_and_k_equals_n() -> None:
    rng = np.random.default_rng(3)
    pos = rng.random((30, 3)).astype(np.float32)
    pos[10:20] = pos[3]  # eleven copies of one point
    pos[20:25] = [[0.0, 0.0, 0.0], [1.0, 1.0, 1.0], [0.5, 0.0, 1.0], [0.0, 0.5, 0.5], [1.0, 0.0, 0.0]]
    part = sx.particles.Particles(pos=jnp.asarray(np.concatenate([pos, np.zeros((5, 3), np.float32)])),
                                  num=jnp.int32(30))
    for box in (None, 1.0):
        res = knn(part, 30, box=box)
        wrapped = pos % 1.0 if box else pos
        ref_d, ref_i = reference.brute_knn(wrapped.astype(np.float64), 30, box=box)
        d, i = np.asarray(res.distances), np.asarray(res.indices)
        np.testing.assert_allclose(d[:30], ref_d, rtol=1e-5, atol=1e-6)
        np.testing.assert_array_equal(i[:30, :12], ref_i[:, :12])
        assert np.all(np.sort(i[:30], axis=1) == np.arange(30))
        assert np.all(np.isinf(d[30:])) and np.all(i[30:] == -1)


def test_query_reduce_and_ids() -> None:
    rng = np.random.default_rng(4)
    pos = rng.random((3000, 3), dtype=np.float32)
    query = (rng.random((300, 3)) * 1.4 - 0.2).astype(np.float32)  # some outside the data's bounding box
    res = jitted(5, None, True)(jnp.asarray(pos), jnp.asarray(query))
    ref_d, ref_i = ref_knn(pos, 5, None, query)
    check_against(np.asarray(res.distances), np.asarray(res.indices), ref_d, ref_i, np.float32)

    ids = rng.permutation(3000).astype(np.int32) + 100
    part = sx.particles.Particles(pos=jnp.asarray(pos), num=jnp.int32(3000), ids=jnp.asarray(ids))
    res = knn(part, 9, box=(1.0, 1.0, 1.0), reduce=lambda distances, indices, part: (jnp.mean(distances[:, 1:], axis=1),
                                                                         indices, part.ids))
    rmean, indices, rows_ids = res.indices
    ref_d, ref_i = ref_knn(pos, 9, 1.0)
    np.testing.assert_allclose(np.asarray(rmean), ref_d[:, 1:].mean(axis=1), rtol=1e-5)
    np.testing.assert_array_equal(np.asarray(rows_ids), ids)
    np.testing.assert_array_equal(np.asarray(indices)[:, 0], ids)


def test_large_k() -> None:
    pos = np.random.default_rng(5).random((1500, 3), dtype=np.float32)
    res = jitted(64, 1.0)(jnp.asarray(pos))
    ref_d, ref_i = ref_knn(pos, 64, 1.0)
    check_against(np.asarray(res.distances), np.asarray(res.indices), ref_d, ref_i, np.float32)
    assert res.indices.shape == (1500, 64) and np.all(np.diff(np.asarray(res.distances), axis=1) >= 0)


def test_float64() -> None:
    with jax.enable_x64(True):
        pos = np.random.default_rng(6).random((1000, 3))
        res = knn(jnp.asarray(pos), 7, box=1.0)
        assert res.distances.dtype == jnp.float64
        ref_d, ref_i = ref_knn(pos, 7, 1.0)
        check_against(np.asarray(res.distances), np.asarray(res.indices), ref_d, ref_i, np.float64)


def test_bad_input() -> None:
    pos = jnp.asarray(np.random.default_rng(7).random((50, 3), dtype=np.float32))
    with pytest.raises(ValueError, match="k must be >= 1"):
        knn(pos, 0)
    with pytest.raises(ValueError, match="larger than the number of particle"):
        knn(pos, 51)
    part = sx.particles.Particles(pos=pos, num=jnp.int32(10))
    with pytest.raises(ValueError, match=r"larger than the number of particles \(10\)"):
        knn(part, 11)
    with pytest.raises(TypeError, match="k must be a Python int"):
        knn(pos, 2.0)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="NaN"):
        knn(pos.at[3, 1].set(jnp.nan), 3)
    with pytest.raises(ValueError, match="query has 2-dimensional"):
        knn(pos, 3, query=pos[:, :2])
    with pytest.raises(ValueError, match="knn: box must be a scalar or have 3 entries"):
        knn(pos, 3, box=(1.0, 1.0))
    with pytest.raises(ValueError, match="knn: box must be positive and finite"):
        knn(pos, 3, box=0.0)
    with pytest.raises(TypeError, match="float32 or float64"):
        knn(jnp.ones((5, 3), jnp.int32), 2)
    with pytest.raises(TypeError, match="particle pytree"):
        knn([[0.0, 0.0]], 1)
    # The global view refuses what is not a global particle pytree or (ndev, n, d) array before anything is traced.
    with pytest.raises(TypeError, match=r"knn.smap: part must be a global particle pytree with .pos and .num"):
        knn.smap(make_mesh((2,)))([[[0.0, 0.0]]], 3)
    with pytest.raises(ValueError, match=r"knn.smap: part as a plain array must have shape \(ndev, n, d\)"):
        knn.smap(make_mesh((2,)))(pos, 3)
    with pytest.raises(ValueError, match=r"knn.smap: part.pos must have shape \(ndev, n, d\).*call knn\(\) for"):
        knn.smap(make_mesh((2,)))(part, 3)


def distributed_cases(rng: np.random.Generator) -> list[tuple[np.ndarray, float | None]]:
    return [(rng.random((1200, 3), dtype=np.float32), 1.0), (blobs(rng, 1200), None)]


def to_host(x: jax.Array) -> np.ndarray:
    """A global array on every process."""
    if x.is_fully_addressable:
        return np.asarray(x)
    return np.asarray(multihost_utils.process_allgather(x, tiled=True))


def run_on_mesh(mesh: Mesh, pos: np.ndarray, box: float | None, k: int,
                tuning: KnnTuning | str | None = None) -> tuple[np.ndarray, np.ndarray]:
    """knn.smap on ``mesh`` (each process passes its share of ``pos``); results in global input order."""
    share = np.array_split(pos, jax.process_count())[jax.process_index()]
    part = sx.particles.from_numpy(share, mesh=mesh)
    res = knn.smap(mesh)(part, k, box=box, tuning=tuning)
    valid = np.arange(part.pos.shape[1])[None, :] < to_host(part.num)[:, None]
    order = np.argsort(to_host(part.ids)[valid])
    return to_host(res.distances)[valid][order], to_host(res.indices)[valid][order]


def test_mesh_matches_single_device(mesh: Mesh) -> None:
    cases = distributed_cases(np.random.default_rng(8))
    # Clustered open-box data on the largest meshes only: every extra case is one more compilation per mesh.
    for pos, box in cases if mesh.size in (4, 8) else cases[:1]:
        with collectives_ordered():  # (a program read back from a compilation cache may then run as compiled)
            d, i = run_on_mesh(mesh, pos, box, 9)
        one = jitted(9, box)(jnp.asarray(pos))
        np.testing.assert_array_equal(i, np.asarray(one.indices))
        np.testing.assert_array_equal(d, np.asarray(one.distances))


def test_ghost_capacity_overflow_raises() -> None:
    mesh = make_mesh((8,))
    part = sx.particles.from_numpy(np.random.default_rng(9).random((800, 3), dtype=np.float32), mesh=mesh)
    with pytest.raises(sx.CapacityError, match="ghost_capacity") as info:
        knn.smap(mesh)(part, 9, box=1.0, ghost_capacity=4)
    err = info.value
    assert (err.argument, err.available) == ("ghost_capacity", 4) and err.needed > 4
    # The size it asks for is enough: the retry gives the exact answer.
    d, i = (np.asarray(x) for x in knn.smap(mesh)(part, 9, box=1.0, ghost_capacity=err.needed))
    valid = np.arange(part.pos.shape[1])[None, :] < np.asarray(part.num)[:, None]
    order = np.argsort(np.asarray(part.ids)[valid])
    one = jitted(9, 1.0)(jnp.asarray(np.asarray(part.pos)[valid][order]))
    np.testing.assert_array_equal(i[valid][order], np.asarray(one.indices))
    np.testing.assert_array_equal(d[valid][order], np.asarray(one.distances))


def test_runs_are_aligned_morton_blocks() -> None:
    # The runs whose grown boxes decide the ghosts: the aligned Morton blocks of the finest level holding a
    # device's rows in at most `chunks` blocks, numbered in order (checked against NumPy's 64-bit keys).
    rng = np.random.default_rng(3)
    box = periodic_box(1.0, 3, jnp.float32)
    band = rng.random((500, 3), dtype=np.float32) * np.float32([1.0, 1.0, 0.01]) + np.float32([0, 0, 0.49])
    for pos, num, chunks in [(rng.random((700, 3), dtype=np.float32), 700, 64),  # uniform
                             (band, 480, 16),  # a thin slab across a top-level boundary, padding rows
                             (np.full((9, 3), 0.25, np.float32), 9, 4),  # one key
                             (rng.random((1, 3), dtype=np.float32), 1, 64)]:
        keys = morton_keys(pos)
        order = np.argsort(keys[:num], kind="stable")
        pos = np.concatenate([pos[:num][order], pos[num:]])
        got = np.asarray(_aligned_runs(jnp.asarray(pos), jnp.int32(num), box, chunks))
        keys = np.sort(keys[:num])
        shift = next(s for s in range(65) if len(np.unique(keys >> np.uint64(min(s, 63)))) <= chunks or s == 64)
        want = np.unique(keys >> np.uint64(shift), return_inverse=True)[1] if shift < 64 else np.zeros(num, int)
        np.testing.assert_array_equal(got[:num], want)
        assert got.max() < chunks and np.all(np.diff(got) >= 0)


def test_pieces_across_the_box_edge_and_wrapping_pieces() -> None:
    # Each device grids its piece of the periodic box, open where it need not wrap: pieces across the box edge
    # (a band around x = 0) and pieces spanning the box along x and y (a thin slab); the uniform case of
    # test_mesh_matches_single_device has bounds that reach around the box (axes wrap by reach). Integers and
    # distances as on one device.
    mesh = make_mesh((8,))
    rng = np.random.default_rng(12)
    u = rng.random((1200, 3), dtype=np.float32)
    band = np.mod(u * np.float32([0.2, 1, 1]) + np.float32([0.9, 0, 0]), np.float32(1))
    slab = u * np.float32([1, 1, 0.02]) + np.float32([0, 0, 0.3])
    for pos in (band, slab):
        d, i = run_on_mesh(mesh, pos, 1.0, 9)
        one = jitted(9, 1.0)(jnp.asarray(pos))
        np.testing.assert_array_equal(i, np.asarray(one.indices))
        np.testing.assert_array_equal(d, np.asarray(one.distances))


def zsort_ids(mesh: Mesh, pos: np.ndarray, box: float | None) -> np.ndarray:
    """The ids of ``pos`` in the global z-order ``zsort.smap`` gives on ``mesh``."""
    part = sx.particles.from_numpy(pos, mesh=mesh)
    zpart = sx.particles.zsort.smap(mesh)(part, box=box)[0]
    return np.concatenate([row[:m] for row, m in zip(to_host(zpart.ids), to_host(zpart.num), strict=True)])


def check_zorder(mesh: Mesh | None, pos: np.ndarray, box: float | None, fields: bool = True) -> np.ndarray:
    """``zorder=True`` on ``mesh`` (the local view when None): every row is the input-order result of the particle
    ``zpart.ids`` names (and, with ``fields``, a per-particle field travelled with it). Returns ``zpart.ids`` of the
    valid rows in global order."""
    extra = {"vel": np.arange(len(pos), dtype=np.float32)[:, None] * np.ones((1, 3), np.float32)} if fields else {}
    if mesh is None:
        part = sx.particles.Particles(pos=jnp.asarray(pos), num=jnp.int32(len(pos)),
                                      **{k: jnp.asarray(v) for k, v in extra.items()})
        (res, zpart), home = knn(part, 9, box=box, zorder=True), knn(part, 9, box=box)
        host = lambda x: np.asarray(x)[None]  # noqa: E731
    else:
        share = np.array_split(np.arange(len(pos)), jax.process_count())[jax.process_index()]
        part = sx.particles.from_numpy(pos[share], mesh=mesh, **{k: v[share] for k, v in extra.items()})
        (res, zpart), home = knn.smap(mesh)(part, 9, box=box, zorder=True), knn.smap(mesh)(part, 9, box=box)
        host = to_host
    valid = np.arange(host(zpart.pos).shape[1])[None, :] < host(zpart.num).reshape(-1)[:, None]
    ids = host(zpart.ids)[valid]
    np.testing.assert_array_equal(np.sort(ids), np.arange(len(pos)))  # every particle once
    if fields:
        np.testing.assert_array_equal(host(zpart.vel)[valid][:, 0], ids.astype(np.float32))
    hvalid = np.arange(host(home.indices).shape[1])[None, :] < host(part.num).reshape(-1)[:, None]
    hids = host(part.ids)[hvalid] if mesh is not None else np.arange(len(pos))
    order = np.argsort(hids)
    home_i, home_d = host(home.indices)[hvalid][order], host(home.distances)[hvalid][order]
    np.testing.assert_array_equal(host(res.indices)[valid], home_i[ids])
    np.testing.assert_array_equal(host(res.distances)[valid], home_d[ids])
    return ids


@pytest.mark.parametrize("shape", [None, (8,)], ids=["local", "8"])
def test_zorder_output(shape: tuple[int, ...] | None) -> None:
    pos = np.random.default_rng(11).random((1000, 3), dtype=np.float32)
    ids = check_zorder(None if shape is None else make_mesh(shape), pos, 1.0)
    np.testing.assert_array_equal(ids, zsort_ids(make_mesh(shape or (1,)), pos, 1.0))  # the order zsort gives


def test_zorder_bad_input() -> None:
    pos = jnp.asarray(np.random.default_rng(12).random((50, 3), dtype=np.float32))
    with pytest.raises(ValueError, match="zorder=True .* cannot be combined with query="):
        knn(pos, 3, query=pos, zorder=True)
    with pytest.raises(TypeError, match="zorder must be a bool"):
        knn(pos, 3, zorder=1)  # type: ignore[call-overload]
    res, zpart = knn(pos, 3, zorder=True)  # a plain array comes back as Particles with ids
    assert isinstance(zpart, sx.particles.Particles)
    np.testing.assert_array_equal(np.asarray(res.indices)[:, 0], np.asarray(zpart.ids))
    np.testing.assert_array_equal(np.asarray(zpart.pos), np.asarray(pos)[np.asarray(zpart.ids)])


def multiprocess_body() -> list[np.ndarray]:
    out = []
    mesh = sx.flat_mesh()
    uniform, periodic = distributed_cases(np.random.default_rng(8))[0]
    # Three programs, each compiled by both processes at once. The open box at 2 x 4 is the every-phase case (a
    # clump and exact copies in an open box, through every phase of the local search); the clustered open case with
    # the CPU preset and the GPU preset forced on CPU are checked on 8 devices of one process (tuning sizes the
    # local search only, which runs the same whatever process a device is in).
    d, i = run_on_mesh(mesh, uniform, periodic, 9, "cpu")
    out += [i, d]  # checked against one device by the caller
    out.append(check_zorder(mesh, uniform, periodic, fields=False))
    out += run_on_mesh(mesh, every_phase_points(), None, 9, SMALL_TUNING)  # checked against one device by the caller
    # No particles on any process (the uniform case's rows, all padding; its program is reused): k is refused
    # after the run, on every process, as only the devices can count the particles of every process.
    part = sx.particles.from_numpy(np.array_split(uniform, jax.process_count())[jax.process_index()], mesh=mesh)
    try:
        knn.smap(mesh)(dataclasses.replace(part, num=part.num * 0), 9, box=periodic, tuning="cpu")
        out.append(np.array("no error"))
    except ValueError as err:
        out.append(np.array(str(err)))
    return out


@pytest.mark.multiprocess
def test_two_processes() -> None:
    results = sx.testing.run_distributed(multiprocess_body, num_processes=2, cpu_devices=4, timeout_s=540)
    pos, box = distributed_cases(np.random.default_rng(8))[0]
    want = zsort_ids(make_mesh((8,)), pos, box)
    small = jitted(9, None, tuning=SMALL_TUNING)(jnp.asarray(every_phase_points()))
    one = knn(jnp.asarray(pos), 9, box=box, tuning="cpu")
    for res in results:
        assert "k=9 is larger than the number of particles (0)" in str(res[-1]), res[-1]
        res = res[:-1]
        # Every phase of the local search, on 2 processes: the integers of one device in this process.
        np.testing.assert_array_equal(res[-1], np.asarray(small.indices))
        np.testing.assert_array_equal(res[-2], np.asarray(small.distances))
        res = res[:-2]
        np.testing.assert_array_equal(res[-1], want)  # zorder=True: rows checked, the same z-order as 8 devices here
        res = res[:-1]
        # Indices and distances of the uniform periodic case.
        assert len(res) == 2
        np.testing.assert_array_equal(res[0], np.asarray(one.indices))
        np.testing.assert_array_equal(res[1], np.asarray(one.distances))
    # The same answer on both processes, and the same as in this process on one device.
    np.testing.assert_array_equal(results[0][0], results[1][0])
    np.testing.assert_array_equal(results[0][0], np.asarray(jitted(9, box)(jnp.asarray(pos)).indices))


def test_periodic_wrap_of_extreme_coordinates() -> None:
    """Coordinates near the float32 maximum in a box below 1: the wrap ``x - box * floor(x / box)`` overflowed to
    -inf (``x / box`` is inf), so these points had no finite neighbour. They wrap exactly, like np.mod.

    Eagerly such positions are refused (they do not fit the box); inside a user's jit nothing can check them, and
    the kernel wraps them."""
    big = np.finfo(np.float32).max
    pos = np.random.default_rng(0).choice([-big, -1.0, 0.0, 1.0, big], (16, 3)).astype(np.float32)
    box = np.array([1.0, 2.0, 0.5])
    with pytest.raises(ValueError, match="do not fit the periodic box"):
        knn(jnp.asarray(pos), 4, box=tuple(box))
    res = jax.jit(lambda p: knn(p, 4, box=tuple(box)))(jnp.asarray(pos))
    wrapped = np.mod(pos.astype(np.float64), box)
    delta = np.abs(wrapped[:, None] - wrapped[None])
    want = np.sort(np.sqrt((np.minimum(delta, box - delta) ** 2).sum(-1)), axis=1)[:, :4]
    assert np.all(np.isfinite(np.asarray(res.distances)))
    np.testing.assert_allclose(np.asarray(res.distances), want, atol=1e-6)


# The GPU preset (few large sequential steps) forced on CPU: the same answers as cKDTree and the same integers as the
# CPU preset, on uniform, clustered and tied data.
GPU_CASES = {
    "uniform-periodic-per-axis": CASES["uniform-periodic-per-axis"],
    "blobs-open": CASES["blobs-open"],
}


@pytest.mark.parametrize("case", list(GPU_CASES))
def test_gpu_tuning_matches_cpu_tuning(case: str) -> None:
    make, box = GPU_CASES[case]
    pos = make(np.random.default_rng(1))
    gpu = jitted(9, box, tuning="gpu")(jnp.asarray(pos))
    cpu = jitted(9, box)(jnp.asarray(pos))  # the backend's preset: CPU here (shares the compilation above)
    ref_d, ref_i = ref_knn(pos, 9, box)
    check_against(np.asarray(gpu.distances), np.asarray(gpu.indices), ref_d, ref_i, np.float32)
    np.testing.assert_array_equal(np.asarray(gpu.indices), np.asarray(cpu.indices))
    np.testing.assert_array_equal(np.asarray(gpu.distances), np.asarray(cpu.distances))


def test_gpu_tuning_lattice_ties() -> None:
    # Every distance tied many times over: most queries reach the brute force, whose GPU steps are large tiles.
    g = np.arange(6, dtype=np.float32)
    pos = np.stack(np.meshgrid(g, g, g, indexing="ij"), -1).reshape(-1, 3)
    pos = pos[np.random.default_rng(2).permutation(len(pos))]
    tuning = KnnTuning(preset="gpu", brute_queries=16, brute_tile=100)  # several chunks and tiles, a ragged last
    for box in (None, 6.0):
        res = knn(jnp.asarray(pos), 27, box=box, tuning=tuning)
        ref_d, ref_i = reference.brute_knn(pos.astype(np.float64), 27, box=box)
        np.testing.assert_allclose(np.asarray(res.distances), ref_d, rtol=1e-6)
        np.testing.assert_array_equal(np.asarray(res.indices), ref_i)


def test_threshold_selection_is_top_k() -> None:
    """The GPU preset's selection gives lax.top_k's values and positions (equal values in position order) for every
    value within a row's bound, then infinities, on rows with ties, zeros, infinities, fewer than kk finite entries
    and none. A row is `ok` exactly when it can be: its bound holds kk - 1 entries and its edge at most `width`; the
    other rows (too few within the bound, too many equal values, not exact) keep real entries in ascending order."""
    rng = np.random.default_rng(21)
    select = jax.jit(smallest, static_argnames=("kk", "select", "width"))
    top_k = jax.jit(jax.lax.top_k, static_argnames="k")
    for trial in range(18):
        kk = (1, 10, 31)[trial // 6]  # every kind of row with each kk
        x = rng.random((37, 211)).astype(np.float32) ** 2
        kind = trial % 6
        if kind == 1:
            x = np.round(x * 16) / 16  # many equal values
        elif kind == 2:
            x[rng.random(x.shape) < 0.8] = np.inf  # rows with fewer than kk finite entries
        elif kind == 3:
            x[0] = np.inf  # a row with none
        elif kind == 4:
            x[rng.random(x.shape) < 0.3] = 0
        elif kind == 5:
            x = x * np.float32(1e-30)  # tiny values (edges underflow)
        neg, want_pick = top_k(-jnp.asarray(x), k=kk)
        want = -np.asarray(neg)
        ordered = np.sort(x, axis=1)
        for slots in (kk, kk + 8, 2 * kk + 16):
            # Bounds at the (kk + 2)-th value, the largest one, the (kk - 1)-th and below it, and none (-1).
            bound = np.stack([ordered[:, min(kk + 1, 210)], ordered[:, -1], ordered[:, max(kk - 2, 0)],
                              ordered[:, max(kk - 2, 0)] * 0.99, -np.ones(37, np.float32)], axis=1)
            bound = np.where(np.isfinite(bound), bound, np.float32(3e38))[np.arange(37), rng.integers(0, 5, 37)]
            got = select(jnp.asarray(x), kk=kk, select="threshold", width=slots, bound=jnp.asarray(bound))
            values, pick, ok = (np.asarray(a) for a in (got.best, got.pick, got.ok))
            within = (x <= bound[:, None]).sum(axis=1)
            edges = bound[:, None] * np.float32(2) ** (np.arange(-15, 1, dtype=np.float32) / np.float32(4))
            edges[:, -1] = bound
            counts = (x[:, :, None] <= edges[:, None, :]).sum(axis=1)
            reached = np.where((counts >= kk).any(axis=1), counts[np.arange(37), np.argmax(counts >= kk, axis=1)],
                               within)
            np.testing.assert_array_equal(ok, (within >= kk - 1) & (reached <= slots) & (bound >= 0))
            inside = want <= bound[:, None]
            expect = np.where(inside, want, np.inf)
            np.testing.assert_array_equal(values[ok], expect[ok])
            np.testing.assert_array_equal(pick[ok[:, None] & inside], np.asarray(want_pick)[ok[:, None] & inside])
            # Every row: ascending values of real entries (or inf), read at their positions.
            assert np.all(values[:, 1:] >= values[:, :-1])
            real = np.isfinite(values)
            np.testing.assert_array_equal(np.take_along_axis(x, pick, axis=1)[real], values[real])
    # Many equal values: too many in the edge that reaches kk (dense); a row not exact is never ok.
    x = np.full((3, 100), 0.25, np.float32)
    x[1:] = rng.random((2, 100))
    got = smallest(jnp.asarray(x), 5, select="threshold", width=8, bound=jnp.ones(3), exact=jnp.asarray([True, False,
                                                                                                         True]))
    np.testing.assert_array_equal(np.asarray(got.ok), [False, False, True])
    np.testing.assert_array_equal(np.asarray(got.dense), [True, False, False])
    np.testing.assert_array_equal(np.asarray(got.best)[0], np.full(5, 0.25, np.float32))
    np.testing.assert_array_equal(np.asarray(got.best)[2], np.sort(x[2])[:5])


def test_union_selection_is_the_threshold_selection() -> None:
    """The block-level packing of `select="union"` answers every row the per-row one answers, with the same values
    and positions; a block whose rows keep more than its slots leaves them unanswered (dense), with real entries."""
    rng = np.random.default_rng(24)
    run = jax.jit(smallest, static_argnames=("kk", "select", "width"))
    for kk, width, spread in ((10, 32, 1.0), (31, 64, 1.0), (10, 32, 40.0), (10, 16, 1.0)):
        # Blocks of 8 rows sharing 300 candidates (as kNN's tiles: rows of a block see the same points).
        pts = rng.random((13, 300, 3)).astype(np.float32)
        q = (0.5 + (rng.random((13, 8, 3)) - 0.5) / spread).astype(np.float32)
        d2 = ((q[:, :, None, :] - pts[:, None, :, :]) ** 2).sum(-1).astype(np.float32)
        d2[:, :, 250:] = np.inf  # padding slots
        d2[0, :, :40] = 0.01  # a block of many equal distances
        bound = np.sort(d2, axis=2)[:, :, 3 * kk]
        exact = rng.random((13, 8)) < 0.9
        args = dict(kk=kk, width=width, bound=jnp.asarray(bound), exact=jnp.asarray(exact))
        per_row = run(jnp.asarray(d2), select="threshold", **args)
        union = run(jnp.asarray(d2), select="union", **args)
        ok, row_ok = np.asarray(union.ok), np.asarray(per_row.ok)
        assert not np.any(ok & ~row_ok)
        np.testing.assert_array_equal(np.asarray(union.best)[ok], np.asarray(per_row.best)[ok])
        np.testing.assert_array_equal(np.asarray(union.pick)[ok], np.asarray(per_row.pick)[ok])
        lost = row_ok & ~ok
        assert np.all(np.asarray(union.dense)[lost]), "a block over its slots leaves its rows dense"
        # Only the spread rows of the 64-slot blocks keep more than their block's slots.
        assert lost.any() if width == 16 else not lost.any()
        values, pick = np.asarray(union.best), np.asarray(union.pick)
        real = np.isfinite(values)
        np.testing.assert_array_equal(np.take_along_axis(d2, pick, axis=2)[real], values[real])
        assert np.all(real[~ok][:, :kk - 1]), "rows left unanswered keep real entries"
    # Whole searches: clustered open data and tied lattice points, the same integers as the CPU preset.
    make, box = CASES["blobs-open"]
    pos = make(np.random.default_rng(1))
    union = knn(jnp.asarray(pos), 9, box=box, tuning=KnnTuning(preset="gpu", select="union"))
    np.testing.assert_array_equal(np.asarray(union.indices), np.asarray(knn(jnp.asarray(pos), 9, box=box).indices))
    g = np.arange(6, dtype=np.float32)
    lattice = np.stack(np.meshgrid(g, g, g, indexing="ij"), -1).reshape(-1, 3)
    res = knn(jnp.asarray(lattice), 27, box=6.0, tuning=KnnTuning(preset="gpu", select="union", select_width=32))
    np.testing.assert_array_equal(np.asarray(res.indices), reference.brute_knn(lattice.astype(np.float64), 27, box=6.0)[1])


def test_kept_before_is_an_exclusive_prefix_sum() -> None:
    """The packing's ranks (matrix products of 0/1 values) equal NumPy's prefix sums, on short rows, rows that end
    inside a group, and full rows as long as a compacted pass's (every entry kept)."""
    rng = np.random.default_rng(23)
    count = jax.jit(_kept_before)
    for shape, p in (((4, 1), 0.5), ((3, 7), 0.5), ((37, 211), 0.3), ((9, 768), 0.05), ((2, 4608), 1.0)):
        keep = rng.random(shape) < p
        np.testing.assert_array_equal(np.asarray(count(jnp.asarray(keep))), np.cumsum(keep, axis=1) - keep)


@pytest.mark.parametrize("preset", ["cpu", "gpu"])
def test_tied_queries_certified_without_brute_force(preset: str) -> None:
    """Queries tied at their k-th neighbour are answered by the compacted passes, which break the tie by index
    themselves: no brute force runs. Their ties are reordered among the few rows that hold one; compacted passes
    of few blocks take one small step. Results equal the exact reference and the other preset's."""
    rng = np.random.default_rng(22)
    pos = rng.random((3000, 3)).astype(np.float32)
    pos[[5, 700, 1400, 2999]] = pos[5]  # four copies: distance 0 to each other, the 3rd and 4th neighbour tied
    n, k = len(pos), 3
    ok, ids = jnp.ones(n, bool), jnp.arange(n, dtype=jnp.int32)
    ref_d, ref_i = reference.brute_knn(pos.astype(np.float64), k, box=1.0)
    other = knn(jnp.asarray(pos), k, box=1.0, tuning="gpu" if preset == "cpu" else "cpu")
    # Compacted passes of 256 blocks a step, or of 4 when no more are left.
    tuning = KnnTuning(preset=preset, later_batch=256)
    dist2, rows, steps = local_knn_steps(jnp.asarray(pos), ok, jnp.asarray(pos), ok, ids, k=k,
                                         box=jnp.ones(3, jnp.float32), tuning=tuning)
    assert int(steps.brute) == 0 and int(steps.later) >= 1, steps
    np.testing.assert_array_equal(np.asarray(rows), ref_i)
    np.testing.assert_array_equal(np.asarray(rows)[[5, 700, 1400, 2999]], [[5, 700, 1400]] * 4)
    np.testing.assert_array_equal(np.asarray(rows), np.asarray(other.indices))
    np.testing.assert_array_equal(np.sqrt(np.asarray(dist2)), np.asarray(other.distances))
    np.testing.assert_allclose(np.sqrt(np.asarray(dist2)), ref_d, rtol=1e-6, atol=1e-7)


def test_gpu_tuning_brute_force_small_chunk() -> None:
    """Eight queries on a point with more copies than any pass has candidate slots are answered by the brute
    force, which takes its small chunk (one tile of the data) instead of a whole chunk of 256 queries."""
    rng = np.random.default_rng(22)
    data = rng.random((5000, 3)).astype(np.float32)
    data[3000:] = 0.8  # 2000 copies of one point: no grid can split them, every candidate run overflows
    query = (0.6 * rng.random((1000, 3))).astype(np.float32)  # far from it, but for:
    on_copies = [3, 200, 400, 600, 800, 900, 950, 999]
    query[on_copies] = 0.8
    n, m, k = len(data), len(query), 3
    # Tiles of 1000 rows: a whole chunk would scan 5 tiles, the small chunk of 8 scans one.
    tuning = KnnTuning(preset="gpu", brute_tile=1000, later_batch=256)
    dist2, rows, steps = local_knn_steps(jnp.asarray(data), jnp.ones(n, bool), jnp.asarray(query), jnp.ones(m, bool),
                                         jnp.arange(n, dtype=jnp.int32), k=k, box=jnp.ones(3, jnp.float32),
                                         tuning=tuning)
    assert int(steps.brute) == 2, steps  # one chunk, one tile
    dx = query[:, None, :].astype(np.float64) - data[None, :, :]
    d2 = np.sum((dx - np.round(dx)) ** 2, axis=-1)
    ref_i = np.lexsort((np.broadcast_to(np.arange(n), d2.shape), d2), axis=-1)[:, :k]
    np.testing.assert_array_equal(np.asarray(rows), ref_i)
    np.testing.assert_array_equal(np.asarray(rows)[on_copies], [[3000, 3001, 3002]] * 8)
    np.testing.assert_allclose(np.asarray(dist2), np.take_along_axis(d2, ref_i, axis=1), rtol=1e-5, atol=1e-12)
    cpu = knn(jnp.asarray(data), k, box=1.0, query=jnp.asarray(query), tuning="cpu")
    np.testing.assert_array_equal(np.asarray(rows), np.asarray(cpu.indices))


def test_gpu_tuning_on_eight_devices() -> None:
    mesh = make_mesh((8,))
    for pos, box in distributed_cases(np.random.default_rng(8)):
        d, i = run_on_mesh(mesh, pos, box, 9, "gpu")
        one = jitted(9, box)(jnp.asarray(pos))  # the CPU preset on one device
        np.testing.assert_array_equal(i, np.asarray(one.indices))
        np.testing.assert_array_equal(d, np.asarray(one.distances))


def test_gpu_tuning_steps_at_a_million() -> None:
    """The GPU preset's point: few sequential steps. 1e6 uniform points, k=9, periodic: the first grid pass runs
    in at most 16 steps (every step on a GPU costs ~0.3 ms whatever it holds), and the results are exact."""
    n, k = 1_000_000, 9
    pos = np.random.default_rng(13).random((n, 3), dtype=np.float32)
    ok, ids = jnp.ones(n, bool), jnp.arange(n, dtype=jnp.int32)
    # Compiled as a user's program is (XLA's default emitters and level): at this size the run, not the compilation,
    # takes the time, and the tests' compile-fast options make it slower (tests/conftest.py).
    run = jax.jit(functools.partial(local_knn_steps, k=k, tuning=KnnTuning(preset="gpu")))
    args = (jnp.asarray(pos), ok, jnp.asarray(pos), ok, ids)
    box = jnp.ones(3, jnp.float32)
    dist2, rows, steps = run.lower(*args, box=box).compile(compiler_options=USER_COMPILER_OPTIONS)(*args, box=box)
    assert int(steps.first) <= 16, steps
    assert int(steps.adapt) == 0 and int(steps.total) <= 64, steps
    sample = np.random.default_rng(14).choice(n, 20_000, replace=False)
    ref_d, ref_i = cKDTree(pos.astype(np.float64), boxsize=1.0).query(pos[sample].astype(np.float64), k=k)
    check_against(np.sqrt(np.asarray(dist2))[sample], np.asarray(rows)[sample], ref_d, ref_i, np.float32)


def test_tuning_argument() -> None:
    pos = jnp.asarray(np.random.default_rng(15).random((200, 3), dtype=np.float32))
    assert sx.spatial.KnnTuning is KnnTuning
    with pytest.raises(ValueError, match="tuning must be one of"):
        knn(pos, 3, tuning="tpu")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="KnnTuning"):
        knn(pos, 3, tuning=3)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="block must be a positive int"):
        KnnTuning(block=0)
    with pytest.raises(ValueError, match="search must be"):
        KnnTuning(search="binary")  # type: ignore[arg-type]
    small = KnnTuning(preset="gpu", batch=1, later_batch=1)  # one block per step: many steps, the same answer
    np.testing.assert_array_equal(np.asarray(knn(pos, 3, tuning=small).indices),
                                  np.asarray(knn(pos, 3, tuning="cpu").indices))


# A tuning small enough that 600 points go through every phase of the local search: candidate runs of 160 slots
# overflow in the clump (one adaptive full pass on a refined grid), three compacted passes take 37 queries each
# (13 exact copies of one point among them: their k-th and (k+1)-th distances are tied, which a compacted pass
# breaks by index), and what they leave is answered by brute force in chunks of 8 queries against tiles of 64 rows
# (600 rows: 10 tiles, the last one ragged).
SMALL_TUNING = KnnTuning(capacity=160, later_queries=8, max_passes=1, brute_queries=8, brute_tile=64)


def every_phase_points() -> np.ndarray:
    """600 points: uniform, a clump of 120 (sigma 0.003) and 13 copies of one point (rows 120-131 and 200)."""
    rng = np.random.default_rng(16)
    pos = rng.random((600, 3))
    pos[:120] = 0.5 + rng.normal(0, 0.003, (120, 3))
    pos[120:132] = pos[200]
    return pos.astype(np.float32)


@pytest.mark.parametrize("box", [None, 1.0], ids=["open", "periodic"])
def test_small_tuning_reaches_every_phase(box: float | None) -> None:
    pos = every_phase_points()
    n, k = len(pos), 9
    ok, ids = jnp.ones(n, bool), jnp.arange(n, dtype=jnp.int32)
    boxv = None if box is None else jnp.full((3,), box, jnp.float32)
    dist2, rows, steps = local_knn_steps(jnp.asarray(pos), ok, jnp.asarray(pos), ok, ids, k=k, box=boxv,
                                         tuning=SMALL_TUNING)
    # Every phase ran: adaptive full passes, compacted passes, and the brute force in several chunks of 10 tiles.
    tiles = -(-n // SMALL_TUNING.brute_tile)
    chunks, rest = divmod(int(steps.brute), 1 + tiles)
    assert int(steps.adapt) > 0 and int(steps.later) > 0, steps
    assert rest == 0 and 2 <= chunks < n // SMALL_TUNING.brute_queries, steps
    distances, indices = np.sqrt(np.asarray(dist2)), np.asarray(rows)
    # NumPy brute force with ties by index (cKDTree may pick another of the copies for a tied last column).
    ref_d, ref_i = reference.brute_knn(pos.astype(np.float64), k, box=box)
    check_against(distances, indices, ref_d, ref_i, np.float32)
    # The tied copies: distance 0 to each other, ordered by index.
    copies = np.r_[120:132, 200]
    np.testing.assert_array_equal(indices[copies], np.broadcast_to(copies[:k], (len(copies), k)))
    assert np.all(distances[copies] == 0)
    # The same integers and distances as the backend's preset: a tuning only decides how the work is cut.
    preset = jitted(k, box)(jnp.asarray(pos))
    np.testing.assert_array_equal(indices, np.asarray(preset.indices))
    np.testing.assert_array_equal(distances, np.asarray(preset.distances))


def test_small_tuning_on_eight_devices() -> None:
    pos = every_phase_points()
    d, i = run_on_mesh(make_mesh((8,)), pos, None, 9, SMALL_TUNING)
    one = jitted(9, None, tuning=SMALL_TUNING)(jnp.asarray(pos))
    np.testing.assert_array_equal(i, np.asarray(one.indices))
    np.testing.assert_array_equal(d, np.asarray(one.distances))
    ref_d, ref_i = reference.brute_knn(pos.astype(np.float64), 9, box=None)
    check_against(d, i, ref_d, ref_i, np.float32)
