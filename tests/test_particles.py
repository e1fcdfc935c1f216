"""sx.particles building blocks: the pytree, padding, host conversion, ids, initial conditions, Morton keys, checks."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh

import shardax as sx
from conftest import make_mesh
from shardax.particles import (
    Particles,
    conservation,
    from_numpy,
    gaussian_blobs,
    ids_checksum_numpy,
    morton_keys,
    pad,
    squeeze,
    uniform,
    with_ids,
)
from shardax.testing import reference
from test_zsort import ref_wrap


def test_particles_pytree_and_pad() -> None:
    part = Particles(pos=jnp.ones((5, 3)), num=jnp.int32(4), mass=jnp.full((5,), 2.0))
    leaves, treedef = jax.tree.flatten(part)
    assert len(leaves) == 3 and jax.tree.unflatten(treedef, leaves) == part
    with pytest.raises(dataclasses.FrozenInstanceError):
        part.num = jnp.int32(3)  # type: ignore[misc]
    padded = jax.jit(lambda p: pad(p, 3))(part)
    assert padded.pos.shape == (8, 3) and padded.mass.shape == (8,) and int(padded.num) == 4
    np.testing.assert_array_equal(np.asarray(padded.pos[5:]), 0.0)
    np.testing.assert_array_equal(np.asarray(padded.pos[:5]), 1.0)
    assert pad(part, 0) is part
    duck = {"pos": jnp.ones((2, 3)), "num": jnp.int32(2), "box": jnp.float32(1.0)}
    with pytest.raises(TypeError, match=".pos and .num"):
        pad(duck, 1)
    with pytest.raises(ValueError, match="extra must be a non-negative"):
        pad(part, -1)


def test_from_numpy_squeeze_roundtrip(mesh: Mesh) -> None:
    rng = np.random.default_rng(0)
    n = 37
    pos = rng.random((n, 3))  # float64 becomes float32 without x64
    vel = rng.standard_normal((n, 3)).astype(np.float32)
    part = from_numpy(pos, mesh=mesh, capacity_factor=1.5, vel=vel, mass=2.0)
    ndev = mesh.devices.size
    cap = max(int(np.ceil(1.5 * n / ndev)), -(-n // ndev))
    assert part.pos.shape == (ndev, cap, 3) and part.pos.dtype == jnp.float32
    assert part.num.shape == (ndev,) and int(part.num.sum()) == n
    assert int(part.num.max()) - int(part.num.min()) <= 1
    out = squeeze(part)
    assert set(out) == {"pos", "vel", "mass", "ids"}
    np.testing.assert_array_equal(out["pos"], pos.astype(np.float32))
    np.testing.assert_array_equal(out["vel"], vel)
    np.testing.assert_array_equal(out["mass"], np.full(n, 2.0, np.float32))
    np.testing.assert_array_equal(out["ids"], np.arange(n))
    # with_ids numbers rows in the same (device, row) order as squeeze
    fn = sx.smap(lambda leaves: with_ids(jax.tree.unflatten(jax.tree.structure(part), leaves)).ids,
                 in_specs=(sx.ALL,), out_specs=sx.ALL, mesh=mesh)
    ids = np.asarray(fn(jax.tree.leaves(part)))
    num = np.asarray(part.num)
    np.testing.assert_array_equal(np.concatenate([ids[r, : num[r]] for r in range(ndev)]), np.arange(n))
    assert np.all(np.concatenate([ids[r, num[r]:] for r in range(ndev)]) == -1)


def test_from_numpy_errors() -> None:
    mesh = make_mesh((2,))
    pos = np.zeros((4, 3), np.float32)
    bad = pos.copy()
    bad[2, 1] = np.inf
    with pytest.raises(ValueError, match="NaN or infinite.*row 2"):
        from_numpy(bad, mesh=mesh)
    for dtype in (np.int32, np.float16, np.bool_):  # one dtype policy with the kernels: cast, never silently
        with pytest.raises(TypeError, match=f"float32 or float64 array, got dtype {np.dtype(dtype).name}.*astype"):
            from_numpy(np.zeros((4, 3), dtype), mesh=mesh)
    with pytest.raises(TypeError, match="vel must be a float32 or float64 array"):
        from_numpy(pos, mesh=mesh, vel=np.zeros((4, 3), np.float16))
    with pytest.raises(ValueError, match=r"shape \(n, 2\) or \(n, 3\)"):
        from_numpy(np.zeros((4, 4), np.float32), mesh=mesh)
    with pytest.raises(TypeError, match="unexpected field 'charge'"):
        from_numpy(pos, mesh=mesh, charge=np.zeros(4))
    with pytest.raises(ValueError, match=r"vel must have shape \(4, 3\)"):
        from_numpy(pos, mesh=mesh, vel=np.zeros((3, 3), np.float32))
    with pytest.raises(TypeError, match="ids must be an integer"):
        from_numpy(pos, mesh=mesh, ids=np.zeros(4, np.float32))
    with pytest.raises(ValueError, match="capacity_factor"):
        from_numpy(pos, mesh=mesh, capacity_factor=0.5)
    with pytest.raises(TypeError, match="squeeze needs"):
        squeeze({"pos": pos})


@pytest.mark.parametrize("shape", [(1,), (8,), (2, 4)])
def test_empty_sets_give_empty_results(shape: tuple[int, ...]) -> None:
    """No particles at all (every device padding only): every kernel returns a valid empty result."""
    mesh = make_mesh(shape)
    part = from_numpy(np.zeros((0, 3), np.float32), mesh=mesh)
    assert int(part.num.sum()) == 0 and part.pos.shape[1] >= 1
    res = sx.spatial.fof.smap(mesh)(part, 0.1, box=1.0, min_members=1)
    assert np.all(np.asarray(res.labels) == -1) and int(np.asarray(res.catalogue.count).sum()) == 0
    zpart, overflow = sx.particles.zsort.smap(mesh)(part, box=1.0)
    assert int(zpart.num.sum()) == 0 and not np.any(np.asarray(overflow))
    rho = sx.fields.paint(part, (8, 8, 8), box=1.0, mesh=mesh)
    assert float(np.abs(np.asarray(rho)).sum()) == 0.0
    assert not np.asarray(sx.fields.readout(rho, part, box=1.0)).any()
    with pytest.raises(ValueError, match=r"k=1 is larger than the number of particles \(0\)"):
        sx.spatial.knn.smap(mesh)(part, 1, box=1.0)
    assert squeeze(part)["pos"].shape == (0, 3)


def test_squeeze_local_view() -> None:
    part = Particles(pos=jnp.arange(12.0).reshape(4, 3), num=jnp.int32(3))
    np.testing.assert_array_equal(squeeze(part)["pos"], np.arange(9.0).reshape(3, 3))


def test_uniform() -> None:
    part = jax.jit(lambda: uniform(100, box=(1.0, 2.0, 4.0), seed=3, capacity=120))()
    assert part.pos.shape == (120, 3) and int(part.num) == 100
    pos = np.asarray(part.pos)[:100]
    assert np.all(pos >= 0) and np.all(pos < np.array([1.0, 2.0, 4.0], np.float32))
    assert pos[:, 2].max() > 2.0  # uses the whole box
    np.testing.assert_array_equal(np.asarray(part.ids), np.r_[np.arange(100), np.full(20, -1)])
    np.testing.assert_allclose(float(jnp.sum(part.mass)), 1.0, rtol=1e-5)
    glob = uniform.smap(make_mesh((4,)))(n=50, dim=2, seed=3)
    assert glob.pos.shape == (4, 63, 2) and glob.num.tolist() == [50] * 4
    pos = np.asarray(glob.pos)[:, :50]
    assert not np.array_equal(pos[0], pos[1])  # every device draws its own particles
    np.testing.assert_array_equal(squeeze(glob)["ids"], np.arange(200))
    with pytest.raises(ValueError, match="capacity must be a Python int >= n"):
        uniform(10, capacity=5)
    with pytest.raises(ValueError, match="dim must be 2 or 3"):
        uniform(10, dim=4)
    with pytest.raises(TypeError, match="float64 needs jax_enable_x64"):
        uniform(10, dtype=jnp.float64)


def test_gaussian_blobs_membership() -> None:
    centers = np.array([[0.1, 0.1, 0.1], [0.5, 0.5, 0.5], [0.95, 0.5, 0.02]], np.float32)
    mesh = make_mesh((2,))
    part, clump = gaussian_blobs.smap(mesh)(n=300, centers=jnp.asarray(centers), sigma=0.01, background=0.1)
    out = squeeze(part)
    num = np.asarray(part.num)
    labels = np.concatenate([np.asarray(clump)[r, : num[r]] for r in range(2)])
    assert len(labels) == 600 and np.sum(labels == -1) == 60
    member = labels >= 0
    np.testing.assert_array_equal(labels[member], out["ids"][member] % 3)
    delta = out["pos"][member] - centers[labels[member]]
    delta -= np.round(delta)  # periodic distance in the unit box
    assert np.abs(delta).max() < 0.06 and np.abs(delta).max() > 0.02
    assert np.all((out["pos"] >= 0) & (out["pos"] < 1))
    with pytest.raises(ValueError, match="centers must have shape"):
        gaussian_blobs(10, centers=jnp.zeros((3,)), sigma=0.1)
    with pytest.raises(ValueError, match="sigma must be a scalar or have shape"):
        gaussian_blobs(10, centers=jnp.zeros((2, 3)), sigma=jnp.ones(3))


@pytest.mark.parametrize("dim", [2, 3])
@pytest.mark.parametrize("box", [None, 1.0])
def test_morton_keys_match_numpy(dim: int, box: float | None) -> None:
    rng = np.random.default_rng(dim)
    pos = np.concatenate([rng.random((500, dim)), [[0.0] * dim, [1.0] * dim, [0.5] * dim], -0.25 + rng.random((5, dim))])
    pos = pos.astype(np.float32)
    hi, lo = jax.jit(lambda p: morton_keys(p, box=box))(jnp.asarray(pos))
    got = np.asarray(hi).astype(np.uint64) << np.uint64(32) | np.asarray(lo).astype(np.uint64)
    np.testing.assert_array_equal(got, reference.morton_keys(pos, box=box))
    assert int(np.asarray(hi).max()) < 2**31  # the top bit is free: invalid keys sort last
    if box is not None:
        wrapped = ref_wrap(pos, box)
        assert reference.morton_keys(wrapped, box=box)[-8] == got[-8] and got[-7] == 0  # a point on the face wraps to 0


def test_morton_keys_invalid_rows_and_order() -> None:
    pos = jnp.array([[0.5, 0.5, 0.5], [jnp.nan, 0.0, 0.0], [0.1, 0.1, 0.1], [0.2, 0.2, 0.2]], jnp.float32)
    hi, lo = morton_keys(pos, box=1.0, num=3)
    assert [int(h) for h in hi[1:2]] == [2**32 - 1] and int(lo[3]) == 2**32 - 1 and int(hi[3]) == 2**32 - 1
    assert (int(hi[2]), int(lo[2])) < (int(hi[0]), int(lo[0]))
    with pytest.raises(ValueError, match=r"shape \(n, 2\) or \(n, 3\)"):
        morton_keys(jnp.zeros((3, 1)))
    with pytest.raises(TypeError, match="floating-point"):
        morton_keys(jnp.zeros((3, 3), jnp.int32))
    assert not jax.config.read("jax_enable_x64")  # the 64-bit sort is scoped, never global


def test_conservation_detects_loss_and_duplicates() -> None:
    mesh = make_mesh((4,))
    part = from_numpy(np.random.default_rng(1).random((40, 3)), mesh=mesh)
    ref = conservation.smap(mesh)(part)
    assert int(ref.count) == 40 and int(ref.checksum) == ids_checksum_numpy(np.arange(40))
    lost = dataclasses.replace(part, num=part.num - jnp.array([1, 0, 0, 0], jnp.int32))
    assert int(conservation.smap(mesh)(lost).count) == 39
    ids = np.asarray(part.ids).copy()
    ids[1, 0] = ids[0, 0]  # a duplicated id in place of another
    dup = dataclasses.replace(part, ids=jnp.asarray(ids))
    assert int(conservation.smap(mesh)(dup).checksum) != int(ref.checksum)
    with pytest.raises(TypeError, match="with_ids"):
        conservation(Particles(pos=jnp.zeros((2, 3)), num=jnp.int32(2)))


def test_count_outside_capacity_is_refused() -> None:
    """A concrete ``num`` outside ``[0, n]`` is a clear ValueError in the local and global views; under jit the
    count is traced and kernels clip it (documented)."""
    pos = np.random.default_rng(3).random((16, 3), dtype=np.float32)
    for num in (-1, 17):
        part = sx.particles.Particles(pos=jnp.asarray(pos), num=jnp.int32(num))
        with pytest.raises(ValueError, match=rf"zsort: part.num must count valid rows, between 0 and the capacity "
                                             rf"16 .* got {num}"):
            sx.particles.zsort(part)
        with pytest.raises(ValueError, match=rf"knn: part.num .* got {num}"):
            sx.spatial.knn(part, 3)
        with pytest.raises(ValueError, match=rf"fof: part.num .* got {num}"):
            sx.spatial.fof(part, 0.1)
    # Traced: clipped to [0, n], as the one-device kernels document.
    clipped = jax.jit(lambda num: sx.particles.zsort(sx.particles.Particles(pos=jnp.asarray(pos), num=num)))(
        jnp.int32(17))
    assert int(clipped[0].num) == 16
    mesh = make_mesh((8,))
    good = sx.particles.from_numpy(np.concatenate([pos, pos]), mesh=mesh)
    n = good.pos.shape[1]
    bad = dataclasses.replace(good, num=jax.device_put(np.full(8, n + 1, np.int32), good.num.sharding))
    for call, where in ((lambda p: sx.particles.zsort.smap(mesh)(p), "zsort.smap"),
                        (lambda p: sx.spatial.knn.smap(mesh)(p, 3), "knn.smap"),
                        (lambda p: sx.spatial.fof.smap(mesh)(p, 0.1), "fof.smap"),
                        (lambda p: sx.fields.paint(p, (8, 8, 8), box=1.0, mesh=mesh), "paint")):
        with pytest.raises(ValueError, match=rf"{where}: part.num .* capacity {n} .* got {n + 1}"):
            call(bad)
