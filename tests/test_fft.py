"""sx.fft against numpy.fft on the gathered data, on meshes (1,)..(2,4): slabs, pencils, other splits, both layouts."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from jax.test_util import check_grads

import shardax as sx
from conftest import make_mesh
from shardax.testing import assert_allclose

SHAPES = [(32, 32, 32), (48, 40, 36), (64, 64, 16)]


def _spec(mesh: Mesh) -> P:
    """Slabs on 1D meshes, pencils on 2D meshes."""
    return P(*mesh.axis_names)


def _put(a: np.ndarray, mesh: Mesh, spec: P) -> jax.Array:
    return jax.device_put(a, NamedSharding(mesh, spec))


def _is_split(y: jax.Array, spec: P) -> bool:
    """``y`` is laid out as ``spec`` over its mesh (specs that differ only in size-1 mesh axes are equivalent)."""
    return y.sharding.is_equivalent_to(NamedSharding(y.sharding.mesh, spec), y.ndim)


def _complex(shape: tuple[int, ...], dtype, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return (rng.normal(size=shape) + 1j * rng.normal(size=shape)).astype(dtype)


def _stored(spectrum: np.ndarray, layout: str) -> np.ndarray:
    """The reference spectrum as sx.fft stores it: ``(k1, k2, k0)`` for ``layout="transposed"``."""
    return spectrum.transpose(1, 2, 0) if layout == "transposed" else spectrum


@pytest.mark.parametrize("layout", ["same", "transposed"])
def test_fftn_ifftn_match_numpy(mesh: Mesh, layout: str) -> None:
    spec = _spec(mesh)
    # Every shape on the full meshes; the awkward one on the others (keeps the module's run time modest).
    for shape in SHAPES if mesh.size == 8 else SHAPES[1:2]:
        a = _complex(shape, np.complex64)
        x = _put(a, mesh, spec)
        y = sx.fft.fftn(x, layout=layout)
        plan = sx.fft.plan(shape, spec, mesh=mesh, layout=layout)
        assert _is_split(y, spec) and _is_split(y, plan.out_spec) and y.shape == plan.out_shape
        scale = np.sqrt(a.size)
        assert_allclose(np.asarray(y) / scale, _stored(np.fft.fftn(a), layout) / scale, dtype=np.complex64,
                        kind="fft")
        z = sx.fft.ifftn(y, layout=layout)
        assert _is_split(z, spec) and z.shape == shape
        assert_allclose(np.asarray(z), a, dtype=np.complex64, kind="fft")


@pytest.mark.parametrize("mesh_shape", [(1,), (8,), (2, 4)], ids=str)
def test_complex128_and_norms(mesh_shape: tuple[int, ...]) -> None:
    mesh = make_mesh(mesh_shape)
    spec = _spec(mesh)
    with jax.enable_x64(True):
        a = _complex((48, 40, 36), np.complex128, seed=1)
        x = _put(a, mesh, spec)
        y = sx.fft.fftn(x, norm="ortho", layout="transposed")
        assert y.dtype == jnp.complex128
        assert_allclose(np.asarray(y), _stored(np.fft.fftn(a, norm="ortho"), "transposed"), kind="fft")
        assert_allclose(np.asarray(sx.fft.ifftn(y, norm="ortho", layout="transposed")), a, kind="fft")
        assert_allclose(np.asarray(sx.fft.ifftn(x, norm="forward")), np.fft.ifftn(a, norm="forward"), kind="fft")


@pytest.mark.parametrize("layout", ["same", "transposed"])
def test_rfftn_irfftn_match_numpy(mesh: Mesh, layout: str) -> None:
    # Pencils cannot split the odd n2 // 2 + 1 axis of a transposed real spectrum: split the slab over all axes.
    spec = P(mesh.axis_names) if layout == "transposed" else _spec(mesh)
    rng = np.random.default_rng(2)
    for shape in [(32, 32, 32), (48, 40, 36)] if mesh.size == 8 else [(48, 40, 36)]:
        a = rng.normal(size=shape).astype(np.float32)
        y = sx.fft.rfftn(_put(a, mesh, spec), layout=layout)
        plan = sx.fft.plan(shape, spec, mesh=mesh, kind="rfftn", layout=layout)
        assert y.shape == plan.out_shape and y.dtype == jnp.complex64 and _is_split(y, spec)
        scale = np.sqrt(a.size)
        assert_allclose(np.asarray(y) / scale, _stored(np.fft.rfftn(a), layout) / scale, dtype=np.complex64,
                        kind="fft")
        back = sx.fft.irfftn(y, layout=layout, s=shape)
        assert _is_split(back, spec) and back.dtype == jnp.float32 and back.shape == shape
        assert_allclose(np.asarray(back), a, dtype=np.complex64, kind="fft")
        half = np.fft.rfftn(a, norm="ortho").astype(np.complex64)
        assert_allclose(np.asarray(sx.fft.irfftn(_put(half, mesh, spec), s=shape, norm="ortho")),
                        np.fft.irfftn(half, s=shape, axes=(0, 1, 2), norm="ortho"), dtype=np.complex64, kind="fft")


def test_odd_last_axis_and_default_s() -> None:
    mesh = make_mesh((2, 4))
    a = np.random.default_rng(3).normal(size=(16, 16, 15)).astype(np.float32)
    y = sx.fft.rfftn(_put(a, mesh, P("x", "y")))
    assert_allclose(np.asarray(sx.fft.irfftn(y, s=(16, 16, 15))), a, dtype=np.complex64, kind="fft")
    default = sx.fft.irfftn(y)
    assert default.shape == (16, 16, 14)
    assert_allclose(np.asarray(default), np.fft.irfftn(np.fft.rfftn(a), axes=(0, 1, 2)), dtype=np.complex64, kind="fft")


@pytest.mark.parametrize("spec", [P(None, "x"), P(("x", "y")), P("y", "x"),
                                  P("x", None, "y")], ids=str)
def test_other_splits(spec: P) -> None:
    mesh = make_mesh((2, 4))
    a = _complex((32, 32, 32), np.complex64, seed=4)
    x = _put(a, mesh, spec)
    for layout in ("same", "transposed"):
        y = sx.fft.fftn(x, layout=layout)
        assert_allclose(np.asarray(y) / 181.0, _stored(np.fft.fftn(a), layout) / 181.0, dtype=np.complex64,
                        kind="fft")
        assert _is_split(y, spec)
        back = sx.fft.ifftn(y, layout=layout)
        assert _is_split(back, spec)
        assert_allclose(np.asarray(back), a, dtype=np.complex64, kind="fft")
    entries = (*spec, None, None, None)[:3]
    target = P(entries[2], entries[0], entries[1])
    y = sx.fft.fftn(x, layout=target)
    assert _is_split(y, target)
    assert_allclose(np.asarray(y) / 181.0, np.fft.fftn(a) / 181.0, dtype=np.complex64, kind="fft")
    r = np.real(a).astype(np.float32)
    real_target = P(*[e for e in entries if e is not None])  # the odd n2 // 2 + 1 axis left whole
    assert_allclose(np.asarray(sx.fft.rfftn(_put(r, mesh, spec), layout=real_target)) / 181.0,
                    np.fft.rfftn(r) / 181.0, dtype=np.complex64, kind="fft")


def test_transposed_layouts_and_plans() -> None:
    mesh = make_mesh((2, 4))
    slab = sx.fft.plan((32, 16, 8), P(("x", "y")), mesh=mesh, layout="transposed")
    assert slab.out_spec == P(("x", "y")) and slab.out_shape == (16, 8, 32) and len(slab.transposes) == 1
    assert slab.out_layout.spec == P(None, ("x", "y"))
    pencil = sx.fft.plan((32, 16, 8), P("x", "y"), mesh=mesh, layout="transposed")
    assert pencil.out_spec == P("x", "y") and pencil.out_shape == (16, 8, 32) and len(pencil.transposes) == 2
    back = sx.fft.plan((16, 8, 32), P("x", "y"), mesh=mesh, kind="ifftn", layout="transposed")
    assert back.out_spec == P("x", "y") and back.out_shape == (32, 16, 8) and len(back.transposes) == 2
    same = sx.fft.plan((32, 32, 32), P("x", "y"), mesh=mesh)
    assert same.out_spec == P("x", "y") and len(same.transposes) == 4
    real = sx.fft.plan((32, 32, 32), P("x", "y"), mesh=mesh, kind="rfftn")
    assert real.out_spec == P("x", "y") and real.out_shape == (32, 32, 17)
    explicit = sx.fft.plan((32, 32, 32), P("x", "y"), mesh=mesh, layout=P(None, "y", "x"))
    assert explicit.out_spec == P(None, "y", "x") and len(explicit.transposes) == 3


def test_bytes_moved_read_from_hlo() -> None:
    """The compiled program's all-to-all traffic equals the theoretical volume: 1 transpose (slab), 2 (pencil)."""
    shape = (32, 32, 32)
    for mesh_shape, spec, count in [((8,), P("x"), 1), ((2, 4), P("x", "y"), 2)]:
        mesh = make_mesh(mesh_shape)
        local = int(np.prod(shape)) // 8
        sizes = [mesh.shape[name] for name in spec]
        theory = sum(local * (p - 1) // p for p in sizes[::-1]) * 8
        for layout, factor in [("transposed", 1), ("same", 2)]:
            plan = sx.fft.plan(shape, spec, mesh=mesh, layout=layout)
            fn = jax.jit(lambda x, layout=layout, mesh=mesh, spec=spec: sx.fft.fftn(x, mesh=mesh, spec=spec,
                                                                                     layout=layout))
            x = _put(np.zeros(shape, np.complex64), mesh, spec)
            volume = sx.comm.collective_bytes(fn.lower(x).compile())
            assert volume.ops == count * factor
            assert volume.bytes_sent == plan.bytes_moved(8) == theory * factor


def test_grads_keep_sharding() -> None:
    mesh = make_mesh((2, 4))
    with jax.enable_x64(True):
        a = _complex((8, 8, 8), np.complex128, seed=5)
        x = _put(a, mesh, P("x", "y"))
        check_grads(lambda v: sx.fft.ifftn(sx.fft.fftn(v, layout="transposed") ** 2, layout="transposed"), (x,),
                    order=1, modes=("rev",))
        r = _put(np.real(a), mesh, P("x", "y"))
        check_grads(lambda v: sx.fft.irfftn(sx.fft.rfftn(v) ** 2, s=(8, 8, 8)), (r,), order=1, modes=("fwd",))
        loss = lambda v: jnp.sum(jnp.abs(sx.fft.fftn(v)) ** 2)  # noqa: E731
        g = jax.grad(loss)(x)
        assert _is_split(g, P("x", "y"))
        # Parseval: sum |F x|^2 = N sum |x|^2, so the gradient (of the conjugate convention) is 2 N x.
        assert_allclose(np.asarray(g), 2 * a.size * np.conj(a), kind="fft")
        _, tangent = jax.jvp(lambda v: sx.fft.fftn(v), (x,), (x,))
        assert _is_split(tangent, P("x", "y"))
        assert_allclose(np.asarray(tangent), np.fft.fftn(a), kind="fft")


def test_local_view_same_code_everywhere(mesh: Mesh) -> None:
    spec = _spec(mesh)
    a = _complex((16, 16, 16), np.complex64, seed=6)

    def body(block):
        spectrum = sx.fft.local_fftn(block, spec=spec, layout="transposed")  # stored (k1, k2, k0)
        f0, f1, f2 = sx.fft.local_fftfreq((16, 16, 16), spec=spec, d=0.5, layout="transposed")
        k2 = f0 * f0 + f1 * f1 + f2 * f2
        filtered = spectrum * (k2 < 0.3).astype(spectrum.dtype)
        return sx.fft.local_ifftn(filtered, spec=spec, layout="transposed")

    got = sx.smap(body, in_specs=spec, out_specs=spec, mesh=mesh, expand=False, jit=True)(_put(a, mesh, spec))
    single = jax.jit(body)(jnp.asarray(a))  # outside any mesh: the same function on one device
    f = np.fft.fftfreq(16, 0.5)
    k2 = f[:, None, None] ** 2 + f[None, :, None] ** 2 + f[None, None, :] ** 2
    expected = np.fft.ifftn(np.fft.fftn(a) * (k2 < 0.3))
    assert_allclose(np.asarray(got), expected, dtype=np.complex64, kind="fft")
    assert_allclose(np.asarray(single), expected, dtype=np.complex64, kind="fft")


def test_fftfreq_global(mesh: Mesh) -> None:
    spec = _spec(mesh)
    f0, f1, f2 = sx.fft.fftfreq((16, 24, 32), spec=spec, mesh=mesh, d=(0.5, 1.0, 2.0), rfft=True)
    np.testing.assert_allclose(np.asarray(f0).ravel(), np.fft.fftfreq(16, 0.5))
    np.testing.assert_allclose(np.asarray(f1).ravel(), np.fft.fftfreq(24, 1.0))
    np.testing.assert_allclose(np.asarray(f2).ravel(), np.fft.rfftfreq(32, 2.0))
    assert f0.shape == (16, 1, 1) and f2.shape == (1, 1, 17)
    r2 = sx.fft.rfftfreq((16, 24, 32), spec=spec, mesh=mesh, d=(0.5, 1.0, 2.0))[2]
    np.testing.assert_array_equal(np.asarray(r2), np.asarray(f2))
    assert _is_split(f0, P(spec[0]))
    t0, t1, _ = sx.fft.fftfreq((16, 24, 32), spec=spec, mesh=mesh, layout="transposed")
    assert t0.shape == (1, 1, 16) and t1.shape == (24, 1, 1) and _is_split(t1, P(spec[0]))
    np.testing.assert_allclose(np.asarray(t1).ravel(), np.fft.fftfreq(24))


def test_jit_needs_spec_and_uses_it() -> None:
    mesh = make_mesh((8,))
    x = _put(_complex((16, 16, 16), np.complex64), mesh, P("x"))
    with pytest.raises(ValueError, match="pass spec="):
        jax.jit(lambda v: sx.fft.fftn(v))(x)
    y = jax.jit(lambda v: sx.fft.fftn(v, mesh=mesh, spec=P("x")))(x)
    assert_allclose(np.asarray(y) / 64.0, np.fft.fftn(np.asarray(x)) / 64.0, dtype=np.complex64, kind="fft")
    single = sx.fft.fftn(np.asarray(x))
    assert_allclose(np.asarray(single) / 64.0, np.fft.fftn(np.asarray(x)) / 64.0, dtype=np.complex64, kind="fft")


def test_bad_input() -> None:
    mesh = make_mesh((8,))
    with pytest.raises(ValueError, match="does not evenly divide 12"):
        sx.fft.fftn(np.zeros((12, 16, 16), np.complex64), mesh=mesh, spec=P("x"))
    with pytest.raises(ValueError, match="no sequence of all_to_all"):
        sx.fft.fftn(_put(np.zeros((16, 12, 12), np.complex64), mesh, P("x")))
    with pytest.raises(ValueError, match="axis 2 has 9 points"):
        sx.fft.rfftn(_put(np.zeros((16, 16, 16), np.float32), mesh, P(None, None, "x")))
    with pytest.raises(ValueError, match="axis 2 has 9 points"):
        sx.fft.rfftn(_put(np.zeros((16, 16, 16), np.float32), make_mesh((2, 4)), P("x", "y")), layout="transposed")
    with pytest.raises(ValueError, match="same mesh axes"):
        sx.fft.fftn(_put(np.zeros((16, 16, 16), np.complex64), mesh, P("x")), layout=P())
    with pytest.raises(ValueError, match="3D arrays"):
        sx.fft.fftn(np.zeros((16, 16), np.complex64))
    with pytest.raises(TypeError, match="complex array"):
        sx.fft.ifftn(np.zeros((8, 8, 8), np.float32))
    with pytest.raises(TypeError, match="complex array"):
        sx.fft.local_irfftn(jnp.zeros((8, 8, 5), jnp.float32))
    with pytest.raises(TypeError, match="real floating"):
        sx.fft.rfftn(np.zeros((8, 8, 8), np.complex64))
    with pytest.raises(ValueError, match="norm must be"):
        sx.fft.fftn(np.zeros((8, 8, 8), np.complex64), norm="sideways")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="layout must be"):
        sx.fft.fftn(np.zeros((8, 8, 8), np.complex64), layout="pencil")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="mesh axis 'q'"):
        sx.fft.fftn(np.zeros((8, 8, 8), np.complex64), mesh=mesh, spec=P("q"))
    with pytest.raises(ValueError, match="n2 // 2 \\+ 1"):
        sx.fft.irfftn(np.zeros((8, 8, 5), np.complex64), s=(8, 8, 12))
    with pytest.raises(TypeError, match="jax.Array or numpy"):
        sx.fft.fftn([[[1.0]]])  # type: ignore[arg-type]


def test_repeated_calls_skip_the_checks_and_plan(monkeypatch: pytest.MonkeyPatch) -> None:
    """A call with the shape, dtype, sharding and options of an earlier one goes straight to its compiled function
    (the per-call checks and plan cost as much as a small transform); anything new is checked and planned."""
    from shardax.fft import _fftn

    mesh = make_mesh((2,))
    rng = np.random.default_rng(5)
    a, b = (rng.standard_normal((4, 6, 8)).astype(np.complex64) for _ in range(2))
    xa, xb = _put(a, mesh, P("x")), _put(b, mesh, P("x"))
    assert_allclose(np.asarray(sx.fft.fftn(xa)), np.fft.fftn(a))
    planned: list[str] = []
    real_plan = _fftn.make_plan
    monkeypatch.setattr(_fftn, "make_plan", lambda kind, *args: planned.append(kind) or real_plan(kind, *args))
    assert_allclose(np.asarray(sx.fft.fftn(xb)), np.fft.fftn(b))  # seen: no plan
    assert planned == []
    assert_allclose(np.asarray(sx.fft.ifftn(xb)), np.fft.ifftn(b))  # another kind: planned
    assert_allclose(np.asarray(sx.fft.fftn(xb, norm="ortho")), np.fft.fftn(b, norm="ortho"))
    assert planned == ["ifftn", "fftn"]
    with pytest.raises(ValueError, match="norm"):  # bad options are refused every time
        sx.fft.fftn(xb, norm="sideways")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="norm"):
        sx.fft.fftn(xb, norm="sideways")  # type: ignore[arg-type]
