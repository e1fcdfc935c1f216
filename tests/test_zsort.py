"""zsort against a NumPy reference sort of the gathered data, at 1 device, on every mesh, and on 2 processes x 4.

The reference: ``shardax.testing.reference.morton_keys`` (uint64, NumPy) over the same box, then a stable sort of
the particles in global input order (device, then row). The distributed result must be the same sequence, field by
field, with counts equal to ``N // ndev`` (+1 for the first ``N % ndev`` devices) when equalised. This module does not
import conftest: the multi-process children import it by path and must keep the launcher's device count.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import shardax as sx
from shardax.particles import Particles, conservation, domain, ids_checksum_numpy, squeeze, zsort
from shardax.testing import reference

N = 509  # not divisible by any device count > 1: equalised counts differ by one


# ---------------------------------------------------------------- NumPy reference


def ref_wrap(pos: np.ndarray, box: float) -> np.ndarray:
    rel = np.mod(pos, pos.dtype.type(box))
    return np.where(rel >= box, rel - pos.dtype.type(box), rel).astype(pos.dtype)


def check_sorted(inp: dict[str, np.ndarray], out: dict[str, np.ndarray], box: float | None) -> None:
    """``out`` (squeezed zsort result) is ``inp`` (squeezed input) in stable Morton order, field by field."""
    order = np.argsort(reference.morton_keys(inp["pos"], box=box), kind="stable")
    assert set(out) == set(inp)
    for name in inp:
        expected = inp[name][order]
        if name == "pos" and box is not None:
            expected = ref_wrap(expected, box)
        np.testing.assert_array_equal(out[name], expected, err_msg=f"field {name}")


def equal_counts(total: int, ndev: int) -> np.ndarray:
    return np.array([total // ndev + (r < total % ndev) for r in range(ndev)])


# ---------------------------------------------------------------- inputs


def cases(rng: np.random.Generator, ndev: int) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Named (positions (N, 3) float32, per-device counts) pairs: N particles in global input order."""
    even = equal_counts(N, ndev)
    uneven = rng.multinomial(N, np.ones(ndev) / ndev)
    blobs = (rng.integers(0, 4, N)[:, None] * 0.25 + 0.1 + 0.01 * rng.standard_normal((N, 3))) % 1.0
    grid = rng.integers(0, 5, (N, 3)) / 4.0  # duplicates, and coordinates exactly 0 and 1 (the box boundary)
    one_device = np.zeros(ndev, np.int64)
    one_device[-1] = N
    return {
        "uniform": (rng.random((N, 3)), even),
        "blobs": (blobs, uneven),
        "one_point": (np.full((N, 3), 0.3), even),
        "on_last_device": (rng.random((N, 3)), one_device),
        "duplicates_boundary": (grid, uneven),
    }


def layout(mesh: Mesh, pos: np.ndarray, counts: np.ndarray, cap: int) -> Particles:
    """Global Particles with ``counts[r]`` consecutive rows on device r (works across processes)."""
    ndev = mesh.devices.size
    sharding = NamedSharding(mesh, P(tuple(mesh.axis_names)))
    n = len(pos)
    rng = np.random.default_rng(7)
    fields = {"pos": pos.astype(np.float32), "ids": np.arange(n, dtype=np.int32),
              "mass": rng.random(n).astype(np.float32), "vel": rng.standard_normal((n, 3)).astype(np.float32)}
    starts = np.concatenate([[0], np.cumsum(counts)])

    def put(a: np.ndarray) -> jax.Array:
        full = np.zeros((ndev, cap, *a.shape[1:]), a.dtype)
        for r in range(ndev):
            full[r, : counts[r]] = a[starts[r]: starts[r + 1]]
        return jax.make_array_from_callback(full.shape, sharding, lambda idx: full[idx])

    num = np.asarray(counts, np.int32)
    return Particles(num=jax.make_array_from_callback(num.shape, sharding, lambda idx: num[idx]),
                     **{k: put(v) for k, v in fields.items()})


# ---------------------------------------------------------------- the checks, shared by every scale


def make_mesh(shape: tuple[int, ...]) -> Mesh:
    """Like conftest.make_mesh (not imported: see the module docstring)."""
    return Mesh(np.array(jax.devices()[: int(np.prod(shape))]).reshape(shape), ("x", "y")[: len(shape)])


def to_host(x: jax.Array) -> np.ndarray:
    """A global array on every process."""
    if x.is_fully_addressable:
        return np.asarray(x)
    return np.asarray(multihost_utils.process_allgather(x, tiled=True))


def run_cases(mesh: Mesh) -> list[str]:
    """Every input case x {(box=None, equalize), (periodic box, no equalize)}; returns the names checked."""
    ndev = mesh.devices.size
    done = []
    for name, (pos, counts) in cases(np.random.default_rng(0), ndev).items():
        part = layout(mesh, pos, counts, cap=N)
        inp = squeeze(part)
        before = conservation.smap(mesh)(part)
        for box, equalize in ((None, True), (1.0, False)):
            out, overflow = zsort.smap(mesh)(part, box=box, equalize=equalize)
            assert not to_host(overflow).any()
            check_sorted(inp, squeeze(out), box)
            num = to_host(out.num)
            assert num.sum() == N
            if equalize:
                np.testing.assert_array_equal(num, equal_counts(N, ndev), err_msg=name)
            after = conservation.smap(mesh)(out)
            assert int(after.count) == int(before.count) == N
            assert int(after.checksum) == int(before.checksum) == ids_checksum_numpy(np.arange(N))
            done.append(f"{name}/{box}/{equalize}")
    return done


def _bucket_body(part: Particles, box: float | None) -> tuple:
    """bucket_sort in the local view, and each input row's global index sent home along the sort's routes."""
    from shardax._zorder import bucket_sort
    from shardax.core import rank_info

    n = part.pos.shape[0]
    res = bucket_sort(part, box=box, capacity=n, number=True)
    assert res.index is not None
    home = jnp.full((n,), -1, jnp.int32)
    if rank_info().size > 1:
        r = res.routes
        assert r is not None
        # The held rows regrouped by sender (``back``) go back with the counts each sender sent: every sender
        # receives its rows' values packed by device in the order ``perm``.
        got, _, _ = sx.comm.alltoallv(res.index[r.back], r.received, capacity=n)
        home = home.at[jnp.where(jnp.arange(n) < jnp.sum(r.sent), r.perm, n)].set(got, mode="drop")
    return res.part, res.index, home, res.overflow


def _bucket_open(part: Particles) -> tuple:
    return _bucket_body(part, None)


def _bucket_periodic(part: Particles) -> tuple:
    return _bucket_body(part, 1.0)


def run_bucket_cases(mesh: Mesh) -> list[str]:
    """The one-exchange sort of FoF (``bucket_sort``): the same global order as zsort (ties in input order), no
    row lost, the global input index of every row, and its routes bring a column back to the input rows."""
    from shardax.core import ALL, smap

    ndev = mesh.devices.size
    done = []
    # One program per box for every case (the same shapes): named bodies, the same program on every process.
    sorts = {box: smap(body, in_specs=(ALL,), out_specs=ALL, mesh=mesh, jit=True)
             for box, body in ((None, _bucket_open), (1.0, _bucket_periodic))}
    for name, (pos, counts) in cases(np.random.default_rng(0), ndev).items():
        part = layout(mesh, pos, counts, cap=N)
        inp = squeeze(part)
        for box, fn in sorts.items():
            out, index, home, overflow = fn(part)
            assert not to_host(overflow).any(), name
            got = squeeze(out)
            check_sorted(inp, got, box)
            num = to_host(out.num)
            assert num.sum() == N, name
            # Every row numbered by its global input index (here its id), aligned with the sorted rows.
            index = to_host(index)
            np.testing.assert_array_equal(np.concatenate([index[r, : num[r]] for r in range(ndev)]), got["ids"])
            if ndev > 1:
                home = to_host(home)
                held = to_host(part.num)
                np.testing.assert_array_equal(np.concatenate([home[r, : held[r]] for r in range(ndev)]),
                                              np.arange(N), err_msg=name)
            done.append(f"bucket/{name}/{box}")
    return done


def check_domain(mesh: Mesh) -> Any:
    """The Domain describes the sorted result: counts, key ranges, boxes and top-level cells."""
    rng = np.random.default_rng(3)
    ndev = mesh.devices.size
    part = layout(mesh, rng.random((N, 3)), equal_counts(N, ndev), cap=N)
    out, _, dom = zsort.smap(mesh)(part, box=1.0, return_domain=True, num_cells=8)
    pos = to_host(out.pos)
    num = to_host(out.num)
    counts = to_host(dom.counts)
    np.testing.assert_array_equal(counts, num)
    np.testing.assert_array_equal(to_host(dom.offsets), np.cumsum(num) - num)
    first, last = to_host(dom.first_key), to_host(dom.last_key)
    lower, upper = to_host(dom.lower), to_host(dom.upper)
    start, count = to_host(dom.cell_start), to_host(dom.cell_count)
    clo, chi = to_host(dom.cell_lower), to_host(dom.cell_upper)
    assert dom.periodic
    for r in range(ndev):
        keys = reference.morton_keys(pos[r, : num[r]], box=1.0)
        assert np.all(np.diff(keys.astype(np.float64)) >= 0)
        assert (int(first[r, 0]) << 32 | int(first[r, 1])) == int(keys[0])
        assert (int(last[r, 0]) << 32 | int(last[r, 1])) == int(keys[-1])
        np.testing.assert_array_equal(lower[r], pos[r, : num[r]].min(0))
        np.testing.assert_array_equal(upper[r], pos[r, : num[r]].max(0))
        assert count[r].sum() == num[r] and 1 <= (count[r] > 0).sum() <= 8
        for c in np.flatnonzero(count[r]):
            rows = pos[r, start[r, c]: start[r, c] + count[r, c]]
            np.testing.assert_array_equal(clo[r, c], rows.min(0))
            np.testing.assert_array_equal(chi[r, c], rows.max(0))
        if r + 1 < ndev:
            assert (int(last[r, 0]), int(last[r, 1])) <= (int(first[r + 1, 0]), int(first[r + 1, 1]))
    again = sx.particles.domain.smap(mesh)(out, box=1.0, num_cells=8)  # the same, from the sorted particles
    for mine, theirs in zip(jax.tree.leaves(again), jax.tree.leaves(dom), strict=True):
        np.testing.assert_array_equal(to_host(mine), to_host(theirs))
    return dom


def check_overflow(mesh: Mesh) -> None:
    """Too small a capacity raises CapacityError saying what is needed; the local view reports it as data."""
    ndev = mesh.devices.size
    counts = np.zeros(ndev, np.int64)
    counts[0] = N
    part = layout(mesh, np.random.default_rng(1).random((N, 3)), counts, cap=N)
    with pytest.raises(sx.CapacityError, match="capacity") as info:
        zsort.smap(mesh)(part, capacity=N // ndev - 1 if ndev > 1 else N - 1)
    needed, available = info.value.needed, info.value.available
    assert info.value.argument == "capacity" and needed is not None and available is not None
    assert needed > available


# ---------------------------------------------------------------- tests on one process


def test_zsort_single_device_local_view() -> None:
    """Outside any mesh the local function sorts one device's particles; padding rows stay behind."""
    rng = np.random.default_rng(5)
    pos = rng.random((200, 3)).astype(np.float32)
    part = Particles(pos=jnp.asarray(np.concatenate([pos, np.zeros((56, 3), np.float32)])), num=jnp.int32(200),
                     ids=jnp.arange(256, dtype=jnp.int32))
    out, overflow = jax.jit(lambda p: zsort(p, box=None))(part)
    assert not bool(overflow) and int(out.num) == 200
    order = np.argsort(reference.morton_keys(pos, box=None), kind="stable")
    np.testing.assert_array_equal(np.asarray(out.pos)[:200], pos[order])
    np.testing.assert_array_equal(np.asarray(out.ids)[:200], order)
    small, overflow = jax.jit(lambda p: zsort(p, capacity=100))(part)
    assert bool(overflow) and small.pos.shape == (100, 3)
    # domain() of the sorted particles is the domain zsort returns
    out, _, dom = jax.jit(lambda p: zsort(p, return_domain=True, num_cells=4))(part)
    again = jax.jit(lambda p: domain(p, num_cells=4))(out)
    for a, b in zip(jax.tree.leaves(dom), jax.tree.leaves(again), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert int(dom.cell_count.sum()) == 200 and dom.cell_level.shape == (1,) and not dom.periodic


def test_zsort_matches_numpy(mesh: Mesh) -> None:
    done = run_cases(mesh)
    assert len(done) == 10


@pytest.mark.parametrize("shape", [(1,), (8,), (2, 4)], ids=lambda s: "x".join(map(str, s)))
def test_bucket_sort_matches_numpy(shape: tuple[int, ...]) -> None:
    # (The 2-device ring: FoF sorts with it in tests/test_fof.py's meshes.)
    assert len(run_bucket_cases(make_mesh(shape))) == 10


@pytest.mark.parametrize("shape", [(1,), (8,), (2, 2)], ids=str)
def test_zsort_domain(shape: tuple[int, ...]) -> None:
    dom = check_domain(make_mesh(shape))
    assert int(np.sum(np.asarray(dom.cell_count))) == N  # every particle in exactly one top-level cell


@pytest.mark.parametrize("shape", [(1,), (8,)], ids=str)
def test_zsort_domain_gpu_preset(shape: tuple[int, ...], monkeypatch: pytest.MonkeyPatch) -> None:
    """The GPU preset's cell statistics (compare-and-sum counts, segmented min/max scans) give the CPU preset's
    Domain, field for field, and pass the same checks."""
    mesh = make_mesh(shape)
    cpu = check_domain(mesh)
    monkeypatch.setenv("SHARDAX_TUNING", "gpu")
    gpu = check_domain(mesh)
    for name in ("counts", "first_key", "last_key", "lower", "upper", "cell_level", "cell_start", "cell_count",
                 "cell_lower", "cell_upper"):
        np.testing.assert_array_equal(to_host(getattr(gpu, name)), to_host(getattr(cpu, name)), err_msg=name)


@pytest.mark.parametrize("shape", [(1,), (2, 4)], ids=str)
def test_zsort_overflow_raises(shape: tuple[int, ...]) -> None:
    check_overflow(make_mesh(shape))


def test_zsort_fallback_paths(monkeypatch: pytest.MonkeyPatch) -> None:
    """The paths for many rows per device (two LSD passes instead of MSD + refinement), many devices (binary
    search over the splitters) and many rows in all (ties split by two words), on 3 devices."""
    from shardax import _wordsort, _zorder

    monkeypatch.setattr(_wordsort, "_MSD_MAX_BITS", 0)
    monkeypatch.setattr(_zorder, "_DIRECT_MAX_SPLITTERS", 0)
    monkeypatch.setattr(_zorder, "_ONE_WORD_TIES", 0)
    mesh = Mesh(np.array(jax.devices()[5:8]), ("x",))  # a mesh no other test compiles for
    pos, counts = cases(np.random.default_rng(4), 3)["duplicates_boundary"]
    part = layout(mesh, pos, counts, cap=N)
    out, _ = zsort.smap(mesh)(part)
    check_sorted(squeeze(part), squeeze(out), None)
    np.testing.assert_array_equal(to_host(out.num), equal_counts(N, 3))


@pytest.mark.parametrize("host", [True, False], ids=["host", "xla"])
@pytest.mark.parametrize("case", ["distinct", "duplicates", "padding", "prefix_ties"])
def test_argsort_keys_is_numpys_stable_argsort(case: str, host: bool) -> None:
    """The packed 64-bit argsort equals NumPy's stable argsort: distinct keys, many equal keys, a third of the rows
    padding (the invalid key: ties that the first pass already orders, so the refining pass is skipped), and keys
    sharing the first pass's prefix with differing low bits, with padding (only the refining pass orders them: a
    test that never refines fails here). Both sorts: NumPy's on the host and XLA's in place."""
    from shardax._wordsort import _index_bits, argsort_keys

    rng = np.random.default_rng(11)
    n = 6000
    key = rng.integers(0, np.iinfo(np.uint64).max, n, dtype=np.uint64, endpoint=True)
    if case == "duplicates":
        key = rng.choice(key[:40], n)
    if case in ("padding", "prefix_ties"):
        if case == "prefix_ties":  # 50 prefixes, each shared by ~100 rows in random order of their low bits
            low = rng.integers(0, 1 << _index_bits(n), n, dtype=np.uint64)  # below the first pass's prefix
            key = (rng.integers(0, 50, n, dtype=np.uint64) << np.uint64(40)) | low
        key[rng.random(n) < 0.3] = np.iinfo(np.uint64).max
    hi = (key >> np.uint64(32)).astype(np.uint32)
    lo = (key & np.uint64(0xFFFFFFFF)).astype(np.uint32)
    fn = jax.jit(functools.partial(argsort_keys, host=host))
    assert ("python_cpu_callback" in fn.lower(jnp.asarray(hi), jnp.asarray(lo)).as_text()) == host
    got = np.asarray(fn(jnp.asarray(hi), jnp.asarray(lo)))
    np.testing.assert_array_equal(got, np.argsort(key, kind="stable"))


@pytest.mark.parametrize("host", [True, False], ids=["host", "xla"])
def test_argsort_words_is_numpys_stable_argsort(host: bool) -> None:
    """The one-word argsort (cell keys, labels) equals NumPy's stable argsort: uint32 keys with the top bit set and
    many ties, and non-negative int32 keys."""
    from shardax._wordsort import argsort_words

    rng = np.random.default_rng(12)
    words = rng.choice(rng.integers(0, 2**32, 50, dtype=np.uint64).astype(np.uint32), 6000)
    labels = rng.integers(0, 2**31 - 1, 6000, dtype=np.int32, endpoint=True)
    labels[rng.random(6000) < 0.3] = 2**31 - 1
    from shardax._wordsort import sort_words

    fn = jax.jit(functools.partial(argsort_words, host=host))
    both = jax.jit(functools.partial(sort_words, host=host))
    for key in (words, labels):
        np.testing.assert_array_equal(np.asarray(fn(jnp.asarray(key))), np.argsort(key, kind="stable"))
        sorted_key, perm = both(jnp.asarray(key))
        assert sorted_key.dtype == key.dtype
        np.testing.assert_array_equal(np.asarray(sorted_key), np.sort(key))
        np.testing.assert_array_equal(np.asarray(perm), np.argsort(key, kind="stable"))


def test_zsort_donate_and_peak_memory() -> None:
    """``zsort.smap(mesh, donate=True)`` gives the same result and consumes its input; the peak memory per device
    (XLA's compile-time memory analysis of the program users get, so deterministic) stays within bounds on 8
    devices."""
    from conftest import USER_COMPILER_OPTIONS
    from shardax.particles import uniform

    mesh = Mesh(np.array(jax.devices()), ("x",))
    ref, _ = zsort.smap(mesh)(uniform.smap(mesh)(n=65536, box=1.0, seed=3), box=1.0)
    again = uniform.smap(mesh)(n=65536, box=1.0, seed=3)
    out, overflow = zsort.smap(mesh, donate=True)(again, box=1.0)
    assert again.pos.is_deleted() and not bool(np.any(to_host(overflow)))
    for a, b in zip(jax.tree.leaves(ref), jax.tree.leaves(out), strict=True):
        np.testing.assert_array_equal(to_host(a), to_host(b))
    with pytest.raises(ValueError, match="donate=True needs jit=True"):
        zsort.smap(mesh, jit=False, donate=True)
    with pytest.raises(TypeError, match="donate must be bool"):
        zsort.smap(mesh, donate="yes")
    with pytest.raises(TypeError, match="donate must be bool"):
        zsort.smap(mesh, donate=1)  # equal to True as a cache key: checked before the cache

    leaves, treedef = jax.tree.flatten(again)
    data = sum(leaf.nbytes for leaf in jax.tree.leaves(ref) if leaf.ndim >= 2) / len(jax.devices())  # per device

    def peak(donate: tuple[int, ...]) -> float:
        body = lambda leaves: zsort(jax.tree.unflatten(treedef, leaves), box=1.0)  # noqa: E731
        fn = jax.jit(sx.smap(body, in_specs=(sx.ALL,), out_specs=sx.ALL, mesh=mesh), donate_argnums=donate)
        stats = fn.lower(leaves).compile(compiler_options=USER_COMPILER_OPTIONS).memory_analysis()
        assert stats is not None
        return (stats.argument_size_in_bytes + stats.output_size_in_bytes - stats.alias_size_in_bytes
                + stats.temp_size_in_bytes) / data

    # The target: at most 3x the particle buffers. Inputs 1x, outputs 1x, and the keys, permutations and one
    # exchange round's blocks (the particle data moves once, straight into the output: 7.7x when it was received
    # whole and then sorted, 3.9x when it moved twice).
    plain, donated = peak(()), peak((0,))
    print(f"peak per device / particle buffers: {plain:.2f}x, donated {donated:.2f}x")
    assert plain <= 3.0, plain
    assert donated <= 3.0, donated


class Tagged(NamedTuple):
    pos: jax.Array
    num: jax.Array
    tag: jax.Array  # int8: moved outside the packed uint32 matrix
    charge: jax.Array
    scalar: jax.Array  # not per-particle: must stay as it is


def test_zsort_duck_typed_pytree() -> None:
    mesh = Mesh(np.array(jax.devices()[:4]), ("x",))
    rng = np.random.default_rng(2)
    n, cap = 100, 160
    pos = rng.random((4, cap, 2)).astype(np.float32)
    tag = rng.integers(-100, 100, (4, cap)).astype(np.int8)
    charge = rng.standard_normal((4, cap, 2, 2)).astype(np.float32)
    part = Tagged(jnp.asarray(pos), jnp.full((4,), n, jnp.int32), jnp.asarray(tag), jnp.asarray(charge),
                  jnp.arange(4, dtype=jnp.float32))
    out, _ = zsort.smap(mesh)(part, box=(1.0, 2.0))
    assert isinstance(out, Tagged)
    np.testing.assert_array_equal(np.asarray(out.scalar), np.arange(4))
    flat = {k: np.concatenate([np.asarray(v)[r, :n] for r in range(4)]) for k, v in
            (("pos", pos), ("tag", tag), ("charge", charge))}
    keys = reference.morton_keys(flat["pos"] / np.array([1.0, 2.0], np.float32), box=1.0)
    order = np.argsort(keys, kind="stable")
    res = squeeze(out)
    np.testing.assert_array_equal(res["tag"], flat["tag"][order])
    np.testing.assert_array_equal(res["charge"], flat["charge"][order])


def test_zsort_bad_input() -> None:
    mesh = Mesh(np.array(jax.devices()[:2]), ("x",))
    good = layout(mesh, np.random.default_rng(0).random((40, 3)), np.array([20, 20]), cap=32)
    bad = np.asarray(good.pos).copy()
    bad[1, 3, 0] = np.nan
    with pytest.raises(ValueError, match="NaN or infinite"):
        zsort.smap(mesh)(dataclasses.replace(good, pos=jnp.asarray(bad)))
    with pytest.raises(ValueError, match=r"shape \(n, 2\) or \(n, 3\)"):
        zsort(dataclasses.replace(good, pos=good.pos[0, :, :1], num=good.num[0]))
    with pytest.raises(TypeError, match="floating-point"):
        zsort(Particles(pos=jnp.zeros((4, 3), jnp.int32), num=jnp.int32(4)))
    with pytest.raises(TypeError, match=".pos and .num"):
        zsort({"x": jnp.zeros((4, 3))})
    with pytest.raises(ValueError, match="capacity must be a positive"):
        zsort(Particles(pos=jnp.zeros((4, 3)), num=jnp.int32(4)), capacity=0)
    with pytest.raises(ValueError, match="box must be positive"):
        zsort(Particles(pos=jnp.zeros((4, 3)), num=jnp.int32(4)), box=-1.0)


# ---------------------------------------------------------------- 2 processes x 4 devices


def multiprocess_body() -> dict:
    mesh = sx.flat_mesh()
    grid = sx.grid_mesh()
    done = run_cases(grid) + run_bucket_cases(mesh)
    check_domain(mesh)
    check_overflow(mesh)
    # from_numpy with unequal counts per process, ids in process order, zsort and squeeze across processes
    pid = jax.process_index()
    rng = np.random.default_rng(11)
    everything = rng.random((300, 3)).astype(np.float32)
    mine = everything[:100] if pid == 0 else everything[100:]
    part = sx.particles.from_numpy(mine, mesh=mesh)
    out, _ = zsort.smap(mesh)(part, box=1.0)
    check_sorted({"pos": everything, "ids": np.arange(300, dtype=np.int32)}, squeeze(out), 1.0)
    # The global kernels on a plain position array share this launch (tests/test_plain_arrays.py).
    from test_plain_arrays import global_checks

    return {"done": done, "num": to_host(out.num), "plain": global_checks(mesh)}


@pytest.mark.multiprocess
def test_zsort_two_processes() -> None:
    from test_plain_arrays import check_global

    results = sx.testing.run_distributed(multiprocess_body, num_processes=2, cpu_devices=4)
    for res in results:
        assert len(res["done"]) == 20
        np.testing.assert_array_equal(res["num"], equal_counts(300, 8))
        check_global(res["plain"], 8)
