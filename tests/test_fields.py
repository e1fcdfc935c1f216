"""sx.fields against NumPy references on the gathered data, on meshes (1,)..(2,4): CIC paint/readout, power spectrum."""

from __future__ import annotations

import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import shardax as sx
from conftest import collectives_ordered, make_mesh
from shardax.comm import count_by_rank
from shardax.comm._grouping import COMPARE_RANKS
from shardax.testing import assert_allclose
from shardax.testing.reference import cic_paint, cic_readout, power_spectrum


def _particles(mesh: Mesh, n: int = 2000, seed: int = 0) -> tuple[sx.particles.Particles, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    pos = rng.random((n, 3)).astype(np.float32)
    pos[:5] = [[0.0, 0.0, 0.0], [0.99999, 0.99999, 0.99999], [0.5, 0.5, 0.5], [0.25, 0.999, 0.0], [0.9999, 0.0, 0.5]]
    mass = rng.uniform(0.5, 1.5, n).astype(np.float32)
    return sx.particles.from_numpy(pos, mesh=mesh, mass=mass), pos, mass


@pytest.mark.parametrize("mesh_shape", [(1,), (8,), (2, 2), (2, 4)], ids=str)
def test_paint_matches_numpy_and_conserves_mass(mesh_shape: tuple[int, ...]) -> None:
    mesh = make_mesh(mesh_shape)
    part, _, mass = _particles(mesh)
    with collectives_ordered():  # (a program read back from a compilation cache may then run as compiled)
        rho = sx.fields.paint(part, (16, 16, 16), box=1.0)
        values = sx.fields.readout(rho, part, box=1.0)
    assert rho.shape == (16, 16, 16) and rho.dtype == jnp.float32
    assert rho.sharding.is_equivalent_to(NamedSharding(mesh, P(*mesh.axis_names)), 3)
    rows = sx.particles.squeeze(part)
    expected = cic_paint(rows["pos"].astype(np.float64), (16, 16, 16), box=1.0, mass=rows["mass"].astype(np.float64))
    assert_allclose(np.asarray(rho), expected, dtype=np.float32)
    np.testing.assert_allclose(float(jnp.sum(rho, dtype=jnp.float32)), mass.sum(dtype=np.float64), rtol=1e-5)

    assert values.shape == part.pos.shape[:2]
    num = np.asarray(part.num)
    got = np.concatenate([np.asarray(values)[d, :num[d]] for d in range(len(num))])
    assert_allclose(got, cic_readout(expected, rows["pos"].astype(np.float64), box=1.0), dtype=np.float32)
    assert np.all(np.asarray(values)[np.arange(values.shape[1])[None, :] >= num[:, None]] == 0)


@pytest.mark.parametrize("mesh_shape", [(1,), (2, 4)], ids=str)
def test_readout_of_stacked_components(mesh_shape: tuple[int, ...]) -> None:
    """Trailing axes of the field are components read in one trip: each the same bits as its own readout."""
    mesh = make_mesh(mesh_shape)
    part, _, _ = _particles(mesh, seed=2)
    rho = sx.fields.paint(part, (16, 16, 16), box=1.0)
    fields = jnp.stack([rho, jnp.sqrt(rho), -rho], axis=-1)
    values = sx.fields.readout(fields, part, box=1.0)
    assert values.shape == (*part.pos.shape[:2], 3)
    for c in range(3):
        np.testing.assert_array_equal(np.asarray(values[..., c]), np.asarray(sx.fields.readout(fields[..., c], part,
                                                                                                 box=1.0)))
    with pytest.raises(ValueError, match="3D block"):
        sx.fields.local_readout(jnp.zeros((4, 4)), sx.particles.Particles(pos=jnp.zeros((2, 3)), num=jnp.int32(2)),
                                box=1.0)


def test_other_field_splits_and_boxes() -> None:
    mesh = make_mesh((2, 4))
    part, _, _ = _particles(mesh, n=1500, seed=1)
    rows = sx.particles.squeeze(part)
    box = (2.0, 1.0, 4.0)
    scaled = rows["pos"].astype(np.float64) * np.asarray(box)
    part = sx.particles.Particles(pos=part.pos * jnp.asarray(box, jnp.float32)[None, None, :], num=part.num,
                                  mass=part.mass)
    for spec in (P(("x", "y")), P("y", None, "x")):
        rho = sx.fields.paint(part, (16, 8, 16), box=box, spec=spec)
        assert rho.sharding.is_equivalent_to(NamedSharding(mesh, spec), 3)
        reference = np.zeros((16, 8, 16))
        h = np.asarray(box) / np.asarray((16, 8, 16))
        reference += cic_paint(scaled / h / np.asarray((16, 8, 16)), (16, 8, 16), box=1.0, mass=rows["mass"].astype(np.float64))
        assert_allclose(np.asarray(rho), reference, dtype=np.float32)


def test_local_view_without_mesh() -> None:
    rng = np.random.default_rng(3)
    pos = rng.random((300, 3)).astype(np.float32)
    part = sx.particles.Particles(pos=jnp.asarray(pos), num=jnp.int32(250))
    rho, needed = jax.jit(lambda p: sx.fields.local_paint(p, (8, 8, 8), box=1.0))(part)
    assert int(needed) == 250
    assert_allclose(np.asarray(rho), cic_paint(pos[:250].astype(np.float64), (8, 8, 8), box=1.0, mass=np.ones(250)),
                    dtype=np.float32)
    values, _ = jax.jit(lambda f, p: sx.fields.local_readout(f, p, box=1.0))(rho, part)
    assert_allclose(np.asarray(values)[:250], cic_readout(np.asarray(rho, np.float64), pos[:250], box=1.0),
                    dtype=np.float32)


def _gaussian_field(n: int, box: float, seed: int) -> tuple[np.ndarray, Callable[[np.ndarray], np.ndarray]]:
    """A Gaussian random field with P(k) = 2000 (k / 0.1)^-1.5 (in box units), and that P."""
    def power(k):
        return 2000.0 * (np.maximum(k, 1e-12) / 0.1) ** -1.5

    rng = np.random.default_rng(seed)
    white = np.fft.rfftn(rng.standard_normal((n, n, n))) / math.sqrt(n**3)
    k = 2 * np.pi * np.sqrt(np.fft.fftfreq(n, box / n)[:, None, None] ** 2
                            + np.fft.fftfreq(n, box / n)[None, :, None] ** 2
                            + np.fft.rfftfreq(n, box / n)[None, None, :] ** 2)
    amplitude = np.sqrt(power(k) * n**6 / box**3)
    amplitude[0, 0, 0] = 0
    return np.fft.irfftn(white * amplitude, s=(n, n, n), axes=(0, 1, 2)), power


def test_power_spectrum_recovers_gaussian_field(mesh: Mesh) -> None:
    n, box = 32, 200.0
    delta, power = _gaussian_field(n, box, seed=7)
    field = jax.device_put(delta.astype(np.float32), NamedSharding(mesh, P(*mesh.axis_names)))
    with collectives_ordered():  # (a program read back from a compilation cache may then run as compiled)
        k, pk, modes = sx.fields.power_spectrum(field, box=box, bins=8, compensate=False)
    edges = sx.fields.bin_edges(8, (n, n, n), box)
    k_ref, pk_ref, modes_ref = power_spectrum(delta, box=box, edges=edges, compensate=False)
    np.testing.assert_array_equal(np.asarray(modes), modes_ref)  # integer results identical at every scale
    assert_allclose(np.asarray(k), k_ref, dtype=np.float32)
    assert_allclose(np.asarray(pk) / pk_ref.max(), pk_ref / pk_ref.max(), dtype=np.float32)
    # Within sample variance of the input P(k): relative error of a bin ~ sqrt(2 / modes).
    theory = power(np.asarray(k, np.float64))
    sigma = np.sqrt(2.0 / np.asarray(modes))
    assert np.all(np.abs(np.asarray(pk) / theory - 1) < 5 * sigma + 0.05), (np.asarray(pk) / theory, sigma)


def test_painted_uniform_particles_have_shot_noise_power() -> None:
    """Paint, overdensity, CIC-compensated P(k): Poisson particles give ~ V / N at low k (end-to-end check)."""
    mesh = make_mesh((8,))
    n_part, box = 20000, 100.0
    pos = np.random.default_rng(11).random((n_part, 3)).astype(np.float32) * box
    part = sx.particles.from_numpy(pos, mesh=mesh)
    rho = sx.fields.paint(part, (32, 32, 32), box=box)
    delta = rho / jnp.mean(rho) - 1
    _, pk, modes = sx.fields.power_spectrum(delta, box=box, bins=6)
    shot = box**3 / n_part
    low = np.asarray(pk)[:3] / shot
    assert np.all(np.abs(low - 1) < 5 * np.sqrt(2.0 / np.asarray(modes)[:3]) + 0.05), low


def test_bad_input() -> None:
    mesh = make_mesh((8,))
    part, _, _ = _particles(mesh, n=400)
    with pytest.raises(sx.CapacityError, match="capacity="):
        sx.fields.paint(part, (16, 16, 16), box=1.0, capacity=10)
    with pytest.raises(ValueError, match="does not evenly divide"):
        sx.fields.paint(part, (12, 16, 16), box=1.0)
    with pytest.raises(ValueError, match="every mesh axis"):
        sx.fields.paint(sx.particles.from_numpy(np.zeros((8, 3), np.float32), mesh=make_mesh((2, 4))),
                        (16, 16, 16), box=1.0, spec=P("x"))
    with pytest.raises(ValueError, match="positive"):
        sx.fields.paint(part, (16, 16, 16), box=-1.0)
    with pytest.raises(ValueError, match="3 columns"):
        sx.fields.local_paint(sx.particles.Particles(pos=jnp.zeros((4, 2)), num=jnp.int32(4)), (8, 8, 8), box=1.0)
    with pytest.raises(TypeError, match="real field"):
        sx.fields.local_power_spectrum(jnp.zeros((8, 8, 8), jnp.complex64), box=1.0, bins=4)
    with pytest.raises(ValueError, match="increasing edges"):
        sx.fields.bin_edges([0.3, 0.1], (8, 8, 8), 1.0)


def test_one_device_paint_runs_no_exchange() -> None:
    """On a mesh of one device the global paint and readout keep the rows in place: no sort, no collective rounds."""
    mesh = make_mesh((1,))
    part = sx.particles.from_numpy(np.random.default_rng(3).random((300, 3)), mesh=mesh)
    for fn in (lambda p: sx.fields.paint(p, (8, 8, 8), box=1.0, mesh=mesh),
               lambda p: sx.fields.readout(jnp.ones((8, 8, 8)), p, box=1.0, mesh=mesh, spec=P("x"))):
        text = jax.jit(fn).trace(part).lower().as_text()
        assert "stablehlo.sort" not in text and "all_to_all" not in text and "while" not in text


@pytest.mark.parametrize("backend", ["cpu", "gpu"])
@pytest.mark.parametrize("size", [3, COMPARE_RANKS + 5])
def test_count_by_rank_matches_bincount(size: int, backend: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SHARDAX_TUNING", backend)  # the GPU preset counts without a scatter-add
    key = np.random.default_rng(size).integers(-2, size + 3, 1000)
    expected = np.bincount(key[(key >= 0) & (key < size)], minlength=size)
    np.testing.assert_array_equal(count_by_rank(jnp.asarray(key, jnp.int32), size), expected)


def test_exchange_on_one_device_drops_bad_destinations() -> None:
    """Rows sent to a rank outside the mesh are dropped and the rest close up, as on several devices."""
    mesh = make_mesh((1,))
    dest = jnp.array([[0, 3, 0, -1, 0, 0]], jnp.int32)
    pos = jnp.arange(6.0)[None]

    def body(pos: jax.Array, dest: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        tree, num, overflow = sx.comm.exchange({"pos": pos[0]}, dest[0], num=5, capacity=4)
        return tree["pos"][None], num[None], overflow[None]

    moved, num, overflow = sx.smap(body, in_specs=(P("x"), P("x")), out_specs=P("x"), mesh=mesh,
                                      expand=False)(pos, dest)
    np.testing.assert_array_equal(moved[0], [0.0, 2.0, 4.0, 0.0])
    assert int(num[0]) == 3 and bool(overflow[0])  # a bad destination is reported as overflow


@pytest.mark.parametrize("backend", ["cpu", "gpu"])
def test_group_by_rank_counts_from_the_sort(backend: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from shardax.comm import group_by_rank

    monkeypatch.setenv("SHARDAX_TUNING", backend)
    for size in (3, COMPARE_RANKS + 5):
        key = np.random.default_rng(size).integers(0, size + 1, 500)  # ``size``: not sent
        perm, counts = group_by_rank(jnp.asarray(key, jnp.int32), size)
        np.testing.assert_array_equal(counts, np.bincount(key, minlength=size + 1)[:size])
        np.testing.assert_array_equal(perm, np.argsort(key, kind="stable"))


def test_power_spectrum_gpu_binning_matches_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """The GPU preset's compare-and-sum binning gives the CPU preset's segment sums (up to summation order)."""
    delta = jax.random.normal(jax.random.key(7), (16, 16, 16))
    results = {}
    for backend in ("cpu", "gpu"):
        monkeypatch.setenv("SHARDAX_TUNING", backend)
        results[backend] = sx.fields.local_power_spectrum(delta, box=50.0, bins=6)
    for cpu, gpu in zip(results["cpu"], results["gpu"], strict=True):
        assert_allclose(gpu, cpu)
    np.testing.assert_array_equal(results["gpu"][2], results["cpu"][2])  # mode counts exactly


@pytest.mark.parametrize("ndev", [1, 8])
def test_non_finite_positions_are_counted(ndev: int) -> None:
    """The kernels' own checks: valid rows with NaN or infinite coordinates are refused with their count (in
    ``paint`` and ``readout``), and the box is checked on the finite rows first."""
    mesh = make_mesh((ndev,))
    pos = np.random.default_rng(2).random((64, 3)).astype(np.float32)
    part = sx.particles.from_numpy(pos, mesh=mesh)
    rho = sx.fields.paint(part, (8, 8, 8), box=1.0)

    def with_rows(first: float, last: float) -> sx.particles.Particles:
        """``part`` with coordinate 1 of a valid row of the first device and 0 of one of the last replaced."""
        held = np.asarray(part.pos).copy()
        held[0, 3, 1], held[-1, 2, 0] = first, last
        return sx.particles.Particles(pos=jax.device_put(held, part.pos.sharding), num=part.num)

    for bad in (np.nan, np.inf, -np.inf):
        with pytest.raises(ValueError, match="2 particle.s. have NaN or infinite"):
            sx.fields.paint(with_rows(bad, bad), (8, 8, 8), box=1.0)
        with pytest.raises(ValueError, match="2 particle.s. have NaN or infinite"):
            sx.fields.readout(rho, with_rows(bad, bad), box=1.0)
    with pytest.raises(ValueError, match="do not fit the periodic box"):  # a finite row far outside: reported first
        sx.fields.paint(with_rows(np.nan, 7.0), (8, 8, 8), box=1.0)


@pytest.mark.parametrize("mesh_shape", [(1,), (8,)], ids=str)
def test_nan_in_padding_rows_reaches_no_field(mesh_shape: tuple[int, ...]) -> None:
    """Padding rows are not particles: NaN there changes neither the painted field nor the read values (NaN x 0 mass
    used to give a NaN field)."""
    mesh = make_mesh(mesh_shape)
    part, _, _ = _particles(mesh, n=500)
    rows = np.arange(part.pos.shape[1])[None, :] >= np.asarray(part.num)[:, None]
    assert rows.any()
    dirty = sx.particles.Particles(pos=jnp.where(jnp.asarray(rows)[..., None], jnp.nan, part.pos), num=part.num,
                                   mass=part.mass, ids=part.ids)
    dirty = jax.device_put(dirty, jax.tree.map(lambda a: a.sharding, part))
    clean_rho = sx.fields.paint(part, (8, 8, 8), box=1.0)
    rho = sx.fields.paint(dirty, (8, 8, 8), box=1.0)
    assert np.all(np.isfinite(np.asarray(rho)))
    np.testing.assert_array_equal(np.asarray(rho), np.asarray(clean_rho))
    values = sx.fields.readout(rho, dirty, box=1.0)
    np.testing.assert_array_equal(np.asarray(values), np.asarray(sx.fields.readout(rho, part, box=1.0)))


def test_paint_gradient_is_the_readout() -> None:
    """The global paint is differentiable: d/d mass_i of sum(rho * w) is w read out at particle i (CIC is linear in
    the masses, and readout is its transpose). Its checks (bounds, counts) are not differentiated."""
    mesh = make_mesh((1,))
    part, pos, _ = _particles(mesh, n=300)
    w = jnp.asarray(np.random.default_rng(1).random((8, 8, 8)), jnp.float32)

    def loss(mass: jax.Array) -> jax.Array:
        rho = sx.fields.paint(sx.particles.Particles(pos=part.pos, num=part.num, mass=mass, ids=part.ids), (8, 8, 8),
                              box=1.0)
        return jnp.sum(rho * w)

    grad = np.asarray(jax.grad(loss)(part.mass))[0, :300]
    assert_allclose(grad, cic_readout(np.asarray(w, np.float64), pos.astype(np.float64), box=1.0), dtype=np.float32)


@pytest.mark.parametrize("mesh_shape", [(1,), (8,), (2, 4)], ids=str)
def test_paint_readout_in_one_trip_is_paint_then_readout(mesh_shape: tuple[int, ...]) -> None:
    """``local_paint_readout`` (particles there once, values back once by the same route) gives the bits of
    ``local_paint``, the same ``solve`` and ``local_readout``, with a ``solve`` that calls the distributed FFT; the
    gradients in the positions agree too. Particles that cross devices, padding rows and masses included."""
    mesh = make_mesh(mesh_shape)
    part, _, _ = _particles(mesh, n=3000, seed=4)
    spec = P(*mesh.axis_names)
    shape = (16, 16, 16)

    def solve(rho: jax.Array) -> jax.Array:
        smooth = sx.fft.local_irfftn(sx.fft.local_rfftn(rho, spec=spec) * 0.5, spec=spec, s=shape)
        return jnp.stack([rho, smooth, rho * rho], axis=-1)

    def one_trip(pos: jax.Array, num: jax.Array, mass: jax.Array) -> tuple[jax.Array, jax.Array]:
        local = sx.particles.Particles(pos=pos[0], num=num[0], mass=mass[0])
        values, needed = sx.fields.local_paint_readout(local, shape, solve, box=1.0, spec=spec)
        return values[None], needed[None]

    def three_trips(pos: jax.Array, num: jax.Array, mass: jax.Array) -> tuple[jax.Array, jax.Array]:
        local = sx.particles.Particles(pos=pos[0], num=num[0], mass=mass[0])
        rho, needed = sx.fields.local_paint(local, shape, box=1.0, spec=spec)
        values, got = sx.fields.local_readout(solve(rho), local, box=1.0, spec=spec)
        return values[None], jnp.maximum(needed, got)[None]

    def mapped(fn: Callable) -> Callable:
        return sx.smap(fn, in_specs=(P(sx.ALL),) * 3, out_specs=(P(sx.ALL), P(sx.ALL)), mesh=mesh, expand=False,
                       jit=True)

    args = (part.pos, part.num, part.mass)
    got, want = mapped(one_trip)(*args), mapped(three_trips)(*args)
    for a, b in zip(got, want, strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert np.asarray(got[0]).shape == (*part.pos.shape[:2], 3)
    assert np.all(np.asarray(got[0])[np.arange(part.pos.shape[1])[None, :] >= np.asarray(part.num)[:, None]] == 0)

    def loss(fn: Callable) -> Callable:
        return lambda pos: jnp.sum(mapped(fn)(pos, part.num, part.mass)[0] ** 2)

    assert_allclose(np.asarray(jax.grad(loss(one_trip))(part.pos)), np.asarray(jax.grad(loss(three_trips))(part.pos)),
                    dtype=np.float32)

    bad = sx.particles.Particles(pos=jnp.zeros((4, 3)), num=jnp.int32(4))
    with pytest.raises(ValueError, match="solve must return this device's block"):
        sx.fields.local_paint_readout(bad, (8, 8, 8), lambda rho: rho[:4], box=1.0)
