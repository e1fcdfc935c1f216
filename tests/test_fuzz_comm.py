"""Fuzzing of the communication layer with hypothesis: random counts, destinations (valid or not), capacities and
specs. Every case ends in a correct result, overflow reported as data, or a clear TypeError/ValueError."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from jax.sharding import PartitionSpec as P

import shardax as sx
from comm_checks import to_numpy, traffic_rows
from conftest import make_mesh

SIZE, ROWS = 4, 16
_compiled: dict = {}


def _alltoallv_fn(capacity):
    """One compiled program per capacity (hypothesis varies the data, not the shapes)."""
    key = ("alltoallv", capacity)
    if key not in _compiled:
        _compiled[key] = sx.smap(lambda x, c: sx.comm.alltoallv(x, c, capacity=capacity), in_specs=P(sx.ALL),
                                 out_specs=P(sx.ALL), mesh=make_mesh((SIZE,)), jit=True)
    return _compiled[key]


def _exchange_fn(capacity):
    key = ("exchange", capacity)
    if key not in _compiled:
        def f(ids, dest, num):
            tree, new_num, overflow = sx.comm.exchange({"pos": ids}, dest, num=num, capacity=capacity)
            return tree["pos"], new_num, overflow

        _compiled[key] = sx.smap(f, in_specs=P(sx.ALL), out_specs=P(sx.ALL), mesh=make_mesh((SIZE,)), jit=True)
    return _compiled[key]


FUZZ = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
# Properties whose programs compile once (a few capacities or ops): many cases for little time.
MANY = settings(max_examples=120, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def traffic(draw):
    counts = np.zeros((SIZE, SIZE), np.int64)
    for s in range(SIZE):
        budget = draw(st.integers(0, ROWS))
        cuts = sorted(draw(st.lists(st.integers(0, budget), min_size=SIZE - 1, max_size=SIZE - 1)))
        counts[s] = np.diff([0, *cuts, budget])
    capacity = draw(st.sampled_from([1, 5, 16, 64]))
    return counts, capacity


@MANY
@given(traffic())
def test_alltoallv_fuzz(case):
    counts, capacity = case
    rows = traffic_rows(counts, ROWS)
    data, recv, overflow = (to_numpy(a) for a in _alltoallv_fn(capacity)(rows, counts.astype(np.int32)))
    for d in range(SIZE):
        expected = [(s * 1000 + d, i) for s in range(SIZE) for i in range(counts[s, d])]
        np.testing.assert_array_equal(recv[d], counts[:, d])
        assert bool(overflow[d]) == (len(expected) > capacity)
        kept = min(len(expected), capacity)
        np.testing.assert_array_equal(data[d, :kept].reshape(-1, 2), np.array(expected[:kept]).reshape(-1, 2))
        assert not data[d, kept:].any()


@MANY
@given(st.lists(st.integers(-2, SIZE + 1), min_size=SIZE * ROWS, max_size=SIZE * ROWS),
       st.lists(st.integers(0, ROWS), min_size=SIZE, max_size=SIZE), st.sampled_from([8, 16, 32, 80]))
def test_exchange_never_loses_rows(dest, nums, capacity):
    dest = np.asarray(dest, np.int32).reshape(SIZE, ROWS)
    nums = np.asarray(nums, np.int32)
    ids = np.arange(SIZE * ROWS, dtype=np.int32).reshape(SIZE, ROWS)

    out_ids, new_num, overflow = (to_numpy(a) for a in _exchange_fn(capacity)(ids, dest, nums))
    valid = np.arange(ROWS)[None, :] < nums[:, None]
    bad = valid & ((dest < 0) | (dest >= SIZE))
    for d in range(SIZE):
        want = [ids[s, i] for s in range(SIZE) for i in range(nums[s]) if dest[s, i] == d]
        flagged = len(want) > capacity or bad[d].any()
        assert bool(overflow[d]) == flagged
        k = min(len(want), capacity)
        assert int(new_num[d]) == k
        np.testing.assert_array_equal(out_ids[d, :k], want[:k])
    if not overflow.any():
        got = np.sort(np.concatenate([out_ids[d, : new_num[d]] for d in range(SIZE)]))
        np.testing.assert_array_equal(got, np.sort(ids[valid]))


SPEC_ENTRIES = st.sampled_from([None, "x", "y", "nope", sx.ALL, -1, ("x", "y"), 3, "x"])


@FUZZ
@given(st.lists(SPEC_ENTRIES, max_size=3), st.lists(st.integers(1, 9), min_size=1, max_size=3))
def test_smap_specs_fuzz(entries, shape):
    """Random specs and shapes: either it runs (and the identity round-trips) or it is a clear Type/ValueError."""
    mesh = make_mesh((2, 2))
    x = jnp.arange(int(np.prod(shape)), dtype=jnp.float32).reshape(shape)
    spec = P(*entries)
    try:
        out = sx.smap(lambda a: a, in_specs=(spec,), out_specs=spec, mesh=mesh, expand=False)(x)
    except (TypeError, ValueError) as err:
        assert str(err), "errors must say what was wrong"
        return
    np.testing.assert_array_equal(out, x)


def _reduce_fn(op):
    key = ("allreduce", op)
    if key not in _compiled:
        def f(x):
            return sx.comm.allreduce(x, op), sx.comm.allgather(x, tiled=True)

        _compiled[key] = sx.smap(f, in_specs=P(sx.ALL), out_specs=(P(), P()), mesh=make_mesh((SIZE,)), jit=True)
    return _compiled[key]


VALUES = st.sampled_from([0.0, -0.0, 1.0, -3.5, 1e30, -1e30, 1e-30, 1e-40, float("inf"), -float("inf"), 2.0**24 + 1])


@MANY
@given(st.sampled_from(["sum", "max", "min"]), st.lists(VALUES, min_size=SIZE * 3, max_size=SIZE * 3))
def test_allreduce_allgather_fuzz(op, values):
    """allreduce (sum/max/min) and allgather of extreme float32 values against NumPy on the gathered data (XLA:CPU
    may flush subnormals to zero in arithmetic: those differ by less than the smallest normal number)."""
    x = np.asarray(values, np.float32).reshape(SIZE, 3)
    total, gathered = (np.asarray(a) for a in _reduce_fn(op)(x))
    np.testing.assert_array_equal(gathered.reshape(x.shape), x)  # moved, not computed: bit for bit
    with np.errstate(all="ignore"):
        want = {"sum": np.sum, "max": np.max, "min": np.min}[op](x.astype(np.float64), axis=0)
    np.testing.assert_allclose(total.reshape(-1), want, rtol=1e-6, atol=SIZE * np.finfo(np.float32).tiny)


LEAVES = (st.none() | st.booleans() | st.integers(-2**40, 2**40) | st.floats(allow_nan=True) | st.text(max_size=5)
          | st.builds(lambda n, v: np.full(n, v, np.float32), st.integers(0, 3), st.floats(-2, 2)))
STATIC = st.recursive(LEAVES, lambda inner: st.lists(inner, max_size=3) | st.tuples(inner, inner)
                      | st.dictionaries(st.text(max_size=3), inner, max_size=3), max_leaves=8)


def _typed(value):
    """What a program fingerprint distinguishes: types and values (NaN equal to NaN, 1 unlike 1.0 and True)."""
    if isinstance(value, np.ndarray):
        return ("ndarray", value.dtype.str, value.shape, repr(value.tolist()))
    if isinstance(value, list | tuple):
        return (type(value).__name__, tuple(_typed(v) for v in value))
    if isinstance(value, dict):
        return ("dict", tuple(sorted((repr(k), _typed(v)) for k, v in value.items())))
    return (type(value).__name__, repr(value))


@settings(max_examples=200, deadline=None, derandomize=True)
@given(STATIC, STATIC)
def test_program_fingerprint_fuzz(a, b):
    """The program guard's fingerprints: equal for equal values built separately (no ids or addresses), different
    for different ones; a function's fingerprint follows the values it captures."""
    import copy

    from shardax._fingerprint import function_items, value_item

    assert value_item("v", a) == value_item("v", copy.deepcopy(a))
    assert (value_item("v", a).digest == value_item("v", b).digest) == (_typed(a) == _typed(b))

    def capture(value):
        return lambda x: (x, value)

    same = function_items(capture(a))[1] == function_items(capture(b))[1]
    assert same == (_typed(a) == _typed(b))
