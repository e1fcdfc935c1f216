"""sx.smap / sx.distributed / sx.core.attach_global / sx.rank_info: the expanding convention, ALL, static
arguments, the .smap constructors, errors.

This module must not import conftest at import time: the children of ``sx.testing.run_distributed`` import it by
path and keep the device count of the launcher.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import shardax as sx


def make_mesh(shape):
    from conftest import make_mesh as conftest_mesh

    return conftest_mesh(shape)


def _jztree_guide_f(seed):
    rank, _ndev, _axis_names = sx.rank_info()
    pos = jax.random.uniform(jax.random.key(seed + rank), (100, 3))
    loc = jnp.sum(pos**2)
    total = sx.comm.allreduce(loc)
    return pos, loc, total


def test_rank_info(mesh):
    size = mesh.devices.size
    ranks = sx.smap(lambda: sx.rank_info().rank, in_specs=(), out_specs=P(sx.ALL), mesh=mesh)()
    np.testing.assert_array_equal(ranks, np.arange(size))
    info = {}

    def f():
        r = sx.rank_info()
        info["static"] = (r.size, r.axis_names)
        return r.rank

    sx.smap(f, in_specs=(), out_specs=P(-1), mesh=mesh)()
    assert info["static"] == (size, mesh.axis_names)
    assert sx.rank_info() == sx.RankInfo(0, 1, ())


def test_expanding_smap_jztree_guide(mesh):
    size = mesh.devices.size
    f = sx.smap(_jztree_guide_f, in_specs=(None,), out_specs=(P(-1), P(-1), P()), mesh=mesh, jit=True)
    pos, loc, total = f(0)
    assert pos.shape == (size, 100, 3) and loc.shape == (size,) and total.shape == ()
    np.testing.assert_allclose(np.sum(np.asarray(pos) ** 2, axis=(1, 2)), loc, rtol=1e-5)
    np.testing.assert_allclose(total, np.sum(loc), rtol=1e-5)
    ref0 = jax.random.uniform(jax.random.key(0), (100, 3))  # rank 0 of any mesh = the one-device run
    np.testing.assert_array_equal(pos[0], ref0)
    single_pos, single_loc, single_total = _jztree_guide_f(0)    # the same function outside any mesh
    np.testing.assert_array_equal(single_pos, ref0)
    np.testing.assert_allclose(single_total, single_loc)
    # Keyword call and a second static value (recompiles, result differs).
    pos1, _, _ = f(seed=1)
    assert not np.array_equal(pos1[0], ref0)


def test_expand_roundtrip_and_plain_tiling():
    mesh = make_mesh((2, 4))
    x = jnp.arange(8 * 5 * 2, dtype=jnp.float32).reshape(8, 5, 2)
    double = sx.smap(lambda a: (a * 2, a.shape[0]), in_specs=(P(sx.ALL),), out_specs=(P(sx.ALL), P()), mesh=mesh)
    out, n = double(x)
    np.testing.assert_array_equal(out, 2 * np.asarray(x))
    assert n == 5
    tiled = sx.smap(lambda a: a + 1, in_specs=P("x", "y"), out_specs=P("x", "y"), mesh=mesh, expand=False)
    y = jnp.zeros((4, 8))
    np.testing.assert_array_equal(tiled(y), np.ones((4, 8)))
    # Partially sharded leading axis: P("x") on (2, 4) keeps 2 rows, one per x coordinate.
    part = sx.smap(lambda a: a * 3, in_specs=P("x"), out_specs=P("x"), mesh=mesh)
    np.testing.assert_array_equal(part(jnp.ones((2, 6))), 3 * np.ones((2, 6)))


def test_smap_context_mesh_and_default():
    mesh = make_mesh((4,))
    with jax.set_mesh(mesh):
        sizes = sx.smap(lambda: sx.rank_info().size, in_specs=(), out_specs=P())()
    assert sizes == 4
    assert sx.smap(lambda: sx.rank_info().size, in_specs=(), out_specs=P())() == 8   # flat_mesh() by default
    with pytest.raises(TypeError, match="mesh must be a jax.sharding.Mesh"):
        sx.smap(lambda: 1, in_specs=(), out_specs=P(), mesh="d")()  # type: ignore[arg-type]


def test_pytree_specs_and_prefixes():
    mesh = make_mesh((4,))
    tree = {"a": jnp.ones((4, 3)), "b": (jnp.zeros((4,)), jnp.full((4, 2), 2.0))}
    f = sx.smap(lambda t, s: jax.tree.map(lambda v: v * s, t), in_specs=(P(sx.ALL), P()), out_specs=P(sx.ALL),
                mesh=mesh, jit=True)
    out = f(tree, jnp.float32(2.0))
    np.testing.assert_array_equal(out["b"][1], 4 * np.ones((4, 2)))


def test_distributed_by_parameter_name():
    @sx.distributed(in_specs={"x": P(sx.ALL)}, out_specs=(P(sx.ALL), P()), static_argnames=("power",))
    def moments(x, weights, power, label="m"):
        local = jnp.sum((x * weights) ** power)
        return local, sx.comm.allreduce(local)

    mesh = make_mesh((2, 2))
    x = jnp.arange(12.0).reshape(4, 3)
    w = jnp.array([1.0, 2.0, 3.0])
    local, total = moments.smap(mesh)(x, weights=w, power=2)
    ref = np.sum((np.asarray(x) * np.asarray(w)) ** 2, axis=1)
    np.testing.assert_allclose(local, ref)
    np.testing.assert_allclose(total, ref.sum())
    # The undecorated function is still the local view.
    lone, lone_total = moments(x[0], w, 2)
    np.testing.assert_allclose(lone, ref[0])
    np.testing.assert_allclose(lone_total, ref[0])
    with pytest.raises(ValueError, match="has no parameter 'y'"):
        sx.distributed(lambda x: x, in_specs={"y": P()})


def test_errors_name_the_argument():
    mesh = make_mesh((4,))

    def g(pos, n):
        return pos

    with pytest.raises(ValueError, match=r"spec .* names mesh axis 'gpus', but the mesh has axes \('x',\)"):
        sx.smap(g, in_specs=(P("gpus"), None), out_specs=P(sx.ALL), mesh=mesh)(jnp.zeros((4, 2)), 3)
    with pytest.raises(ValueError, match=r"argument 'pos' of g has shape \(7, 2\); with expand=True its leading axis "
                                         r"must be the number of shards"):
        sx.smap(g, in_specs=(P(sx.ALL), None), out_specs=P(sx.ALL), mesh=mesh)(jnp.zeros((7, 2)), 3)
    with pytest.raises(ValueError, match=r"maps array axis 0 \(of size 7\) to mesh axes \('x',\) \(of size 4\), but 4 "
                                         "does not evenly divide 7"):
        sx.smap(g, in_specs=(P("x"), None), out_specs=P("x"), mesh=mesh, expand=False)(jnp.zeros((7, 2)), 3)
    with pytest.raises(TypeError, match="marked static .* not hashable"):
        sx.smap(g, in_specs=(P(sx.ALL), None), out_specs=P(sx.ALL), mesh=mesh, jit=True)(jnp.zeros((4, 2)), [1])
    with pytest.raises(ValueError, match="got 1 argument"):
        sx.smap(g, in_specs=(P(sx.ALL), None), out_specs=P(sx.ALL), mesh=mesh)(jnp.zeros((4, 2)))
    with pytest.raises(ValueError, match="spec P\\(None, None, None\\) has 3 entries"):
        sx.smap(g, in_specs=(P(None, None, None), None), out_specs=P(), mesh=mesh)(jnp.zeros((4, 2)), 1)


def test_pytree_with_none_fields():
    """Dataclass pytrees with None fields (Particles(vel=None)) take one spec for every array leaf."""
    mesh = make_mesh((4,))
    part = sx.particles.Particles(pos=jnp.ones((4, 5, 3)), num=jnp.full((4,), 5, jnp.int32))
    nums = sx.smap(lambda p: p.num, in_specs=(P(sx.ALL),), out_specs=P(sx.ALL), mesh=mesh)(part)
    np.testing.assert_array_equal(nums, [5, 5, 5, 5])
    out = sx.smap(lambda p: p, in_specs=(P(sx.ALL),), out_specs=P(sx.ALL), mesh=mesh, jit=True)(part)
    assert out.vel is None and out.pos.shape == (4, 5, 3)
    rep = sx.smap(lambda p: (sx.comm.allreduce(p.num), None), in_specs=(P(sx.ALL),), out_specs=None, mesh=mesh)(part)
    assert int(rep[0]) == 20 and rep[1] is None


def test_keyword_only_parameters_and_constructor_cache():
    @sx.distributed(out_specs=P(sx.ALL), static_argnames=("n",))
    def draw(n, *, seed, scale=2.0):
        return scale * jax.random.uniform(jax.random.key(seed + sx.rank_info().rank), (n,))

    mesh = make_mesh((2,))
    out = draw.smap(mesh)(3, seed=1)
    assert out.shape == (2, 3) and float(jnp.max(out)) <= 2.0
    np.testing.assert_allclose(draw.smap(mesh)(n=3, seed=1, scale=4.0), 2 * np.asarray(out), rtol=1e-6)
    assert draw.smap(mesh) is draw.smap(mesh)
    f = sx.smap(lambda x, *, k: x * k, in_specs=(P(sx.ALL), None), out_specs=P(sx.ALL), mesh=mesh)
    np.testing.assert_array_equal(f(jnp.ones((2, 2)), k=3), 3 * np.ones((2, 2)))


def test_donate_argnums():
    """Donated arguments are consumed and give the same result; bad values are rejected with the argument named."""
    mesh = make_mesh((2,))
    double = sx.smap(lambda x, k: x * k, in_specs=(P(sx.ALL), None), out_specs=P(sx.ALL), mesh=mesh, jit=True,
                     donate_argnums=0)
    x = jax.device_put(jnp.arange(8.0).reshape(2, 4), jax.sharding.NamedSharding(mesh, P(mesh.axis_names)))
    out = double(x, 3.0)
    assert x.is_deleted()
    np.testing.assert_array_equal(out, 3 * np.arange(8.0).reshape(2, 4))
    with pytest.raises(ValueError, match="donate_argnums needs jit=True"):
        sx.smap(lambda x: x, in_specs=P(sx.ALL), out_specs=P(sx.ALL), mesh=mesh, donate_argnums=0)
    with pytest.raises(TypeError, match="donate_argnums must be"):
        sx.smap(lambda x: x, in_specs=P(sx.ALL), out_specs=P(sx.ALL), mesh=mesh, jit=True, donate_argnums="x")
    static = sx.smap(lambda x, k: x * k, in_specs=(P(sx.ALL), None), out_specs=P(sx.ALL), mesh=mesh, jit=True,
                     donate_argnums=1)
    with pytest.raises(ValueError, match="static ones cannot be donated"):
        static(jnp.ones((2, 4)), 2.0)


def test_mesh_with_explicit_axes():
    """jax.make_mesh gives explicit axes by default, where shard_map does not move its inputs itself: a replicated
    input failed deep in JAX. smap moves each input to its spec, eagerly and inside jit."""
    mesh = jax.make_mesh((2, 4), ("x", "y"))
    assert jax.sharding.AxisType.Explicit in mesh.axis_types
    tiled = sx.smap(lambda a: a + sx.rank_info().rank.astype(a.dtype), in_specs=P("x", "y"), out_specs=P("x", "y"), mesh=mesh,
                    expand=False)
    ranks = np.repeat(np.repeat(np.arange(8).reshape(2, 4), 2, axis=0), 3, axis=1)
    np.testing.assert_array_equal(tiled(jnp.zeros((4, 12))), ranks)
    np.testing.assert_array_equal(jax.jit(tiled)(jnp.zeros((4, 12))), ranks)
    double = sx.smap(lambda a: a * 2, in_specs=(P(sx.ALL),), out_specs=P(sx.ALL), mesh=mesh, jit=True)
    np.testing.assert_array_equal(double(jnp.ones((8, 5))), 2 * np.ones((8, 5)))


@pytest.mark.parametrize("explicit", [False, True], ids=["auto", "explicit"])
def test_context_mesh_inside_jit(explicit: bool):
    """Under jax.set_mesh, smap without a mesh argument also works inside the caller's jit (jax.sharding.get_mesh
    refuses there)."""
    mesh = jax.make_mesh((8,), ("x",)) if explicit else make_mesh((8,))
    double = sx.smap(lambda a: a * 2, in_specs=P("x"), out_specs=P("x"), expand=False)
    with jax.set_mesh(mesh):
        out = jax.jit(double)(jnp.arange(16.0, dtype=jnp.float32))
    np.testing.assert_array_equal(out, 2 * np.arange(16.0))


def test_program_fingerprint_follows_code_and_captured_values():
    """The program guard keys on what runs: code (not names or line numbers), captured values and defaults
    (by value, no addresses), captured functions recursively, static arguments by type and value."""
    import dataclasses

    from shardax._fingerprint import function_items, value_item

    def digest(f):
        return function_items(f)[1]

    def total(x):
        return sx.comm.allreduce(x)

    def total_again(x):  # the same code elsewhere: the same program
        return sx.comm.allreduce(x)

    assert digest(total) == digest(total_again)
    assert digest(lambda x: sx.comm.allreduce(x)) != digest(lambda x: sx.comm.allreduce(x, op="max"))

    def kernel(k, box, reduce=None, tuning=None):
        def body(x):
            return x * k + box, reduce, tuning
        return body

    base = function_items(kernel(8, 1.0))[0]
    [changed] = [b for a, b in zip(base, function_items(kernel(9, 1.0))[0], strict=True) if a != b]
    assert (changed.label, changed.description) == ("k", "9")
    assert digest(kernel(8, 1.0)) != digest(kernel(8.0, 1.0)) != digest(kernel(True, 1.0))
    assert digest(kernel(8, 1.0, reduce=lambda d: d)) != digest(kernel(8, 1.0, reduce=lambda d: -d))
    labels = [i.label for i in function_items(kernel(8, 1.0, reduce=lambda d, s=2: d * s))[0]]
    assert "reduce.s (default)" in labels

    @dataclasses.dataclass(frozen=True)
    class Tuning:
        tile: int = 64

    assert digest(kernel(8, 1.0, tuning=Tuning())) == digest(kernel(8, 1.0, tuning=Tuning()))
    assert digest(kernel(8, 1.0, tuning=Tuning())) != digest(kernel(8, 1.0, tuning=Tuning(32)))
    world = sx.world()  # the same program on every process, whatever its process_id
    assert value_item("w", world) == dataclasses.replace(value_item("w", dataclasses.replace(world, process_id=7)),
                                                         description=value_item("w", world).description)
    assert value_item("a", np.zeros(1000)).description == "ndarray float64(1000,)"
    assert "0x" not in value_item("o", object()).description
    with pytest.raises(TypeError, match="name must be a str"):
        sx.smap(total, in_specs=P(sx.ALL), out_specs=P(), name=3)  # type: ignore[arg-type]


def test_guard_messages_name_the_difference():
    """What processes compare and how a difference reads (the two-process runs are in test_reliability.py)."""
    from shardax._guard import _compared, _describe_difference

    def payload(k, where="run.py:3", code="c1", shape="float32(4, 16)"):
        return {"function": "knn.smap", "where": where, "sequence": 2, "call": None, "mesh": "{'d': 4}",
                "items": [["code", code, "body at _knn.py:300"], ["k", f"d{k}", str(k)]],
                "arguments": [["argument 'x' of body", shape]]}

    assert _compared(payload(8)) == _compared(payload(8, where="other.py:9"))  # where it is called is not compared
    assert _describe_difference(payload(8), payload(9), 0, 1) == \
        "process 1 calls knn.smap with k=9, process 0 with k=8"
    assert "their code differs" in _describe_difference(payload(8), payload(8, code="c2"), 0, 1)
    assert "float32(4, 8), process 0 with float32(4, 16)" in \
        _describe_difference(payload(8), payload(8, shape="float32(4, 8)"), 0, 1)


def _row_total(x):
    """Local view: the sum of every row of every device, replicated."""
    return sx.comm.allreduce(jnp.sum(x, axis=0))


_built: list = []


def _global_row_total(mesh=None, *, jit=True, scale=1):
    """``_row_total.smap(mesh=None, *, jit=True, scale=1)``: scale times the total of a global ``(ndev, n, d)``."""
    _built.append((mesh, jit, scale))
    fn = sx.smap(_row_total, in_specs=P(sx.ALL), out_specs=P(), mesh=mesh, jit=jit)

    def call(x):
        if jnp.ndim(x) != 3:  # a host-side check of the global argument, as the kernels' wrappers do
            raise ValueError(f"_row_total.smap: x must have shape (ndev, n, d), got {jnp.shape(x)}")
        return scale * fn(x)

    return call


sx.core.attach_global(_row_total, _global_row_total)


def test_attach_global_results(mesh):
    ndev = mesh.devices.size
    x = np.random.default_rng(ndev).random((ndev, 5, 3)).astype(np.float32)
    np.testing.assert_allclose(_row_total.smap(mesh)(jnp.asarray(x)), x.sum(axis=(0, 1)), rtol=1e-5)
    np.testing.assert_allclose(_row_total.smap(mesh, scale=2)(jnp.asarray(x)), 2 * x.sum(axis=(0, 1)), rtol=1e-5)
    np.testing.assert_allclose(_row_total(jnp.asarray(x[0])), x[0].sum(axis=0), rtol=1e-5)  # still the local view
    with pytest.raises(ValueError, match=r"_row_total.smap: x must have shape \(ndev, n, d\)"):
        _row_total.smap(mesh)(jnp.asarray(x[0]))


def test_attach_global_constructor_cache_and_errors():
    mesh, other = make_mesh((3,)), make_mesh((5,))  # meshes no other test builds on: the constructors are kept
    _built.clear()
    first = _row_total.smap(mesh)
    assert _row_total.smap(mesh) is first and _row_total.smap(mesh, jit=True) is first
    assert _row_total.smap(mesh, jit=False) is not first and _row_total.smap(other) is not first
    assert _row_total.smap(mesh, scale=2) is _row_total.smap(mesh, scale=2) is not first
    assert _row_total.smap(mesh, scale=2.0) is not _row_total.smap(mesh, scale=2)  # options told apart by type
    assert _built == [(mesh, True, 1), (mesh, False, 1), (other, True, 1), (mesh, True, 2), (mesh, True, 2.0)]
    assert type(_built[-1][2]) is float
    assert _row_total.smap.__doc__ == _global_row_total.__doc__
    with pytest.raises(TypeError, match=r"_row_total.smap: jit must be a bool, got 1"):
        _row_total.smap(mesh, jit=1)
    with pytest.raises(TypeError, match=r"_row_total.smap: mesh must be a jax.sharding.Mesh or None, got str"):
        _row_total.smap("x")
    with pytest.raises(TypeError, match=r"options must be hashable"):
        _row_total.smap(mesh, scale=[2])
    with pytest.raises(TypeError, match="attach_global needs two callables"):
        sx.core.attach_global(_row_total, 3)
    with pytest.raises(TypeError, match="name must be a str"):
        sx.distributed(_row_total, name=3)


def _smap_constructors_in_two_processes() -> dict:
    """The .smap constructors at the third scale: distributed ones (particles) and attach_global's."""
    mesh = sx.flat_mesh()
    part = sx.particles.uniform.smap(mesh)(n=64, seed=5)
    kept = sx.particles.conservation.smap(mesh)(part)
    total = _row_total.smap(mesh, scale=2)(part.pos)
    return {"count": int(kept.count), "checksum": int(kept.checksum), "total": np.asarray(total),
            "pos": np.concatenate([np.asarray(s.data).reshape(-1, 3) for s in part.pos.addressable_shards])}


@pytest.mark.multiprocess
def test_smap_constructors_two_processes_by_four_devices():
    results = sx.testing.run_distributed(_smap_constructors_in_two_processes, num_processes=2, cpu_devices=4,
                                         timeout_s=600)
    everything = np.concatenate([r["pos"] for r in results])  # every device's rows, padding included
    for res in results:
        assert res["count"] == 8 * 64
        assert res["checksum"] == sx.particles.ids_checksum_numpy(np.arange(8 * 64))
        np.testing.assert_allclose(res["total"], 2 * everything.sum(axis=0), rtol=1e-4)
