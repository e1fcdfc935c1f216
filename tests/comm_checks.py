"""Checks of every sx.comm collective against NumPy on the gathered data, for any mesh.

Each ``check_*`` takes a mesh, runs the collective inside ``sx.smap`` on it and asserts against a NumPy reference
computed from the global inputs. The same functions run in-process (tests/test_comm.py, meshes (1,) ... (2, 4)) and
in 2 processes x 4 devices (one launch runs them all).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import shardax as sx


def to_numpy(x: jax.Array) -> np.ndarray:
    if getattr(x, "is_fully_addressable", True):
        return np.asarray(x)
    return np.asarray(multihost_utils.process_allgather(x, tiled=True))


def put(mesh: Mesh, a: np.ndarray, spec: P | None = None) -> jax.Array:
    """A global array with value ``a`` sharded on ``mesh`` (default: leading axis over every device; works across
    processes)."""
    spec = sx.core.resolve_spec(P(sx.ALL) if spec is None else spec, mesh, "put")
    sharding = NamedSharding(mesh, spec)
    return jax.make_array_from_callback(a.shape, sharding, lambda idx: a[idx])


def per_rank(mesh: Mesh, seed: int, shape: tuple[int, ...], dtype=np.float32) -> np.ndarray:
    rng = np.random.default_rng(seed)
    size = mesh.devices.size
    if np.issubdtype(dtype, np.integer):
        return rng.integers(-50, 50, (size, *shape)).astype(dtype)
    return rng.standard_normal((size, *shape)).astype(dtype)


def run(mesh: Mesh, f, *args, out_specs=None):
    out_specs = P(sx.ALL) if out_specs is None else out_specs
    specs = tuple(P(sx.ALL) for _ in args)
    return sx.smap(f, in_specs=specs, out_specs=out_specs, mesh=mesh, jit=True)(*[put(mesh, a) for a in args])


def sub_axis(mesh: Mesh) -> str:
    return mesh.axis_names[-1]


def check_allreduce(mesh: Mesh) -> None:
    xs = per_rank(mesh, 0, (5, 3))
    for op, ref in (("sum", xs.sum(0)), ("max", xs.max(0)), ("min", xs.min(0)), ("prod", xs.prod(0))):
        out = to_numpy(run(mesh, lambda x, op=op: sx.comm.allreduce(x, op), xs))
        for r in range(len(xs)):
            np.testing.assert_allclose(out[r], ref, rtol=1e-5, atol=1e-6, err_msg=f"allreduce {op} rank {r}")
    # Over one axis of a 2D mesh: each group along the last axis reduces separately.
    ints = per_rank(mesh, 1, (4,), np.int32)
    out = to_numpy(run(mesh, lambda x: sx.comm.allreduce(x, axis=sub_axis(mesh)), ints))
    groups = ints.reshape(*mesh.devices.shape, 4).sum(axis=-2, keepdims=True)
    ref = np.broadcast_to(groups, (*mesh.devices.shape, 4)).reshape(-1, 4)
    np.testing.assert_array_equal(out, ref)


def check_allgather(mesh: Mesh) -> None:
    xs = per_rank(mesh, 2, (3, 2))
    out = to_numpy(run(mesh, lambda x: sx.comm.allgather(x), xs))
    for r in range(len(xs)):
        np.testing.assert_array_equal(out[r], xs)
    tiled = to_numpy(run(mesh, lambda x: sx.comm.allgather(x, tiled=True), xs))
    for r in range(len(xs)):
        np.testing.assert_array_equal(tiled[r], xs.reshape(-1, 2))
    # Replicated output type-checks (allgather is invariant).
    rep = to_numpy(run(mesh, lambda x: sx.comm.allgather(x), xs, out_specs=P()))
    np.testing.assert_array_equal(rep, xs)


def check_alltoall(mesh: Mesh) -> None:
    size = mesh.devices.size
    xs = per_rank(mesh, 3, (size, 2), np.int32)
    out = to_numpy(run(mesh, lambda x: sx.comm.alltoall(x), xs))
    np.testing.assert_array_equal(out, np.swapaxes(xs, 0, 1))


def check_bcast_gather_scatter_reduce(mesh: Mesh) -> None:
    size = mesh.devices.size
    root = size - 1
    xs = per_rank(mesh, 4, (3,))
    out = to_numpy(run(mesh, lambda x: sx.comm.bcast(x, root=root), xs))
    np.testing.assert_array_equal(out, np.broadcast_to(xs[root], xs.shape))
    out = to_numpy(run(mesh, lambda x: sx.comm.gather(x, root=root), xs))
    ref = np.zeros((size, size, 3), np.float32)
    ref[root] = xs
    np.testing.assert_array_equal(out, ref)
    ys = per_rank(mesh, 5, (size, 2))
    out = to_numpy(run(mesh, lambda y: sx.comm.scatter(y, root=root), ys))
    np.testing.assert_array_equal(out, ys[root])
    out = to_numpy(run(mesh, lambda x: sx.comm.reduce(x, "max", root=0), xs))
    ref = np.zeros_like(xs)
    ref[0] = xs.max(0)
    np.testing.assert_array_equal(out, ref)
    flags = (per_rank(mesh, 6, (2,), np.int32) > 0)
    out = to_numpy(run(mesh, lambda b: sx.comm.bcast(b, root=0), flags))
    np.testing.assert_array_equal(out, np.broadcast_to(flags[0], flags.shape))


def check_scan(mesh: Mesh) -> None:
    xs = per_rank(mesh, 7, (2,), np.int32)
    out = to_numpy(run(mesh, lambda x: sx.comm.scan(x), xs))
    np.testing.assert_array_equal(out, np.cumsum(xs, axis=0))
    out = to_numpy(run(mesh, lambda x: sx.comm.scan(x, inclusive=False), xs))
    np.testing.assert_array_equal(out, np.cumsum(xs, axis=0) - xs)
    out = to_numpy(run(mesh, lambda x: sx.comm.scan(x, "max"), xs))
    np.testing.assert_array_equal(out, np.maximum.accumulate(xs, axis=0))
    out = to_numpy(run(mesh, lambda x: sx.comm.scan(x, "min", inclusive=False), xs))
    ref = np.concatenate([np.full((1, 2), np.iinfo(np.int32).max, np.int32),
                          np.minimum.accumulate(xs, axis=0)[:-1]])
    np.testing.assert_array_equal(out, ref)


def check_shift_sendrecv_barrier(mesh: Mesh) -> None:
    size = mesh.devices.size
    xs = per_rank(mesh, 8, (3,))
    for offset in (1, -2, size + 1):
        out = to_numpy(run(mesh, lambda x, o=offset: sx.comm.shift(x, o), xs))
        np.testing.assert_array_equal(out, np.roll(xs, offset, axis=0), err_msg=f"shift {offset}")
        out = to_numpy(run(mesh, lambda x, o=offset: sx.comm.shift(x, o, periodic=False), xs))
        ref = np.zeros_like(xs)
        for r in range(size):
            if 0 <= r - offset < size:
                ref[r] = xs[r - offset]
        np.testing.assert_array_equal(out, ref, err_msg=f"non-periodic shift {offset}")
    pairs = [(s, (s * 3 + 1) % size) for s in range(size)] if size % 3 else [(s, size - 1 - s) for s in range(size)]
    out = to_numpy(run(mesh, lambda x: sx.comm.sendrecv(x, pairs), xs))
    ref = np.zeros_like(xs)
    for s, d in pairs:
        ref[d] = xs[s]
    np.testing.assert_array_equal(out, ref)
    out = to_numpy(run(mesh, lambda x: x + sx.comm.barrier().astype(jnp.float32), xs))
    np.testing.assert_array_equal(out, xs)


def traffic_rows(counts: np.ndarray, n: int) -> np.ndarray:
    """``(size, n, 2)`` send rows for ``counts[s, d]`` rows from rank s to rank d, each encoding (s * 1000 + d, i)."""
    size = len(counts)
    rows = np.zeros((size, n, 2), np.int32)
    for s in range(size):
        k = 0
        for d in range(size):
            for i in range(counts[s, d]):
                rows[s, k] = (s * 1000 + d, i)
                k += 1
    return rows


def _alltoallv_case(mesh: Mesh, counts: np.ndarray, capacity: int, chunk: int | tuple[int, ...] | None = None) -> None:
    """counts[s, d] rows from rank s to rank d; row values encode (source, destination, index)."""
    size = mesh.devices.size
    rows = traffic_rows(counts, int(max(counts.sum(1).max(), 1)))
    data, recv, overflow = run(
        mesh, lambda x, c: sx.comm.alltoallv(x, c, capacity=capacity, chunk=chunk), rows, counts.astype(np.int32))
    data, recv, overflow = to_numpy(data), to_numpy(recv), to_numpy(overflow)
    for d in range(size):
        np.testing.assert_array_equal(recv[d], counts[:, d], err_msg=f"recv_counts on rank {d}")
        expected = [(s * 1000 + d, i) for s in range(size) for i in range(counts[s, d])]
        total = len(expected)
        assert bool(overflow[d]) == (total > capacity), f"overflow flag on rank {d}: {total} rows, cap {capacity}"
        kept = min(total, capacity)
        if kept:
            np.testing.assert_array_equal(data[d, :kept], np.array(expected[:kept], np.int32).reshape(-1, 2))
        np.testing.assert_array_equal(data[d, kept:], 0)


def check_alltoallv(mesh: Mesh) -> None:
    size = mesh.devices.size
    rng = np.random.default_rng(9)
    uneven = rng.integers(0, 6, (size, size))
    uneven[0, :] = 0                      # a rank that sends nothing
    uneven[:, size - 1] = 0               # a rank that receives nothing
    cap = int(uneven.sum(0).max()) + 1
    _alltoallv_case(mesh, uneven, cap)
    _alltoallv_case(mesh, uneven, cap, chunk=1)           # many rounds
    _alltoallv_case(mesh, uneven, cap, chunk=(1, 2, 3))   # a ladder: one round of 3 rows when the largest count fits
    _alltoallv_case(mesh, uneven, cap, chunk=(1, 2))      # a ladder too short for one round: rounds of its largest
    one = np.zeros((size, size), np.int64)
    one[:, 0] = 3                          # everything to rank 0
    _alltoallv_case(mesh, one, 3 * size)
    _alltoallv_case(mesh, one, 3 * size, chunk=sx.comm.chunk_ladder(3 * size))
    _alltoallv_case(mesh, one, max(3 * size - 2, 1))      # overflow on rank 0 only
    _alltoallv_case(mesh, np.zeros((size, size), np.int64), 4)
    # Traffic that mostly stays home: the rows a rank keeps are copied locally (several steps of a few rows with
    # chunk=2), the rounds follow the other counts; then more kept rows than the buffer holds.
    home = rng.integers(0, 3, (size, size))
    np.fill_diagonal(home, 37)
    _alltoallv_case(mesh, home, int(home.sum(0).max()), chunk=2)
    _alltoallv_case(mesh, home, int(home.sum(0).max()))
    _alltoallv_case(mesh, home, 30, chunk=2)              # overflow inside the kept block on every rank
    _grouped_case(mesh)


def _grouped_case(mesh: Mesh, n: int = 11) -> None:
    """A send buffer built by ``group_by_rank`` (rows with key ``size`` stay), its counts checked against
    ``count_by_rank`` and NumPy, then sent: every rank receives its rows grouped by source, in row order."""
    size = mesh.devices.size
    rng = np.random.default_rng(12)
    keys = rng.integers(0, size + 1, (size, n)).astype(np.int32)      # size: the row is not sent
    rows = (np.arange(size)[:, None] * 100 + np.arange(n)[None, :]).astype(np.int32)
    capacity = size * n

    def f(key, x):
        perm, counts = sx.comm.group_by_rank(key, size)
        host_perm, host_counts = sx.comm.group_by_rank(key, size, host=True)
        data, recv, _ = sx.comm.alltoallv(x[perm], counts, capacity=capacity)
        return perm, counts, host_perm, host_counts, sx.comm.count_by_rank(key, size), data, recv

    perm, counts, host_perm, host_counts, counted, data, recv = (to_numpy(o) for o in run(mesh, f, keys, rows))
    for r in range(size):
        np.testing.assert_array_equal(perm[r], np.argsort(keys[r], kind="stable"), err_msg=f"perm on rank {r}")
        ref = np.bincount(keys[r], minlength=size + 1)[:size]
        for name, got in (("group_by_rank", counts), ("group_by_rank(host=True)", host_counts),
                          ("count_by_rank", counted)):
            np.testing.assert_array_equal(got[r], ref, err_msg=f"{name} counts on rank {r}")
        np.testing.assert_array_equal(host_perm[r], perm[r])
        expected = [rows[s, i] for s in range(size) for i in range(n) if keys[s, i] == r]
        np.testing.assert_array_equal(recv[r], [(keys[s] == r).sum() for s in range(size)])
        np.testing.assert_array_equal(data[r, :len(expected)], expected)
        np.testing.assert_array_equal(data[r, len(expected):], 0)


@dataclasses.dataclass(frozen=True)
class _Parts:
    pos: jax.Array
    ids: jax.Array
    num: jax.Array
    tag: jax.Array  # a leaf that does not travel (its leading length differs)


jax.tree_util.register_dataclass(_Parts, data_fields=["pos", "ids", "num", "tag"], meta_fields=[])


def check_exchange(mesh: Mesh) -> None:
    size = mesh.devices.size
    n = 12
    rng = np.random.default_rng(10)
    nums = rng.integers(0, n + 1, size).astype(np.int32)
    nums[0] = n
    dest = rng.integers(0, size, (size, n)).astype(np.int32)
    ids = (np.arange(size)[:, None] * 100 + np.arange(n)[None, :]).astype(np.int32)
    pos = rng.standard_normal((size, n, 3)).astype(np.float32)
    tags = np.arange(size * 2, dtype=np.float32).reshape(size, 2)
    capacity = 2 * n

    def f(pos, ids, num, tag, dest):
        tree, new_num, overflow = sx.comm.exchange(_Parts(pos, ids, num, tag), dest, num=num, capacity=capacity)
        return tree.pos, tree.ids, tree.num, tree.tag, new_num, overflow

    out = [to_numpy(o) for o in run(mesh, f, pos, ids, nums, tags, dest)]
    opos, oids, onum, otag, new_num, overflow = out
    np.testing.assert_array_equal(onum, new_num)
    np.testing.assert_array_equal(otag, tags)
    got_ids = []
    for d in range(size):
        expected = [(s, i) for s in range(size) for i in range(nums[s]) if dest[s, i] == d]
        assert bool(overflow[d]) == (len(expected) > capacity)
        k = min(len(expected), capacity)
        assert int(new_num[d]) == k
        np.testing.assert_array_equal(oids[d, :k], [ids[s, i] for s, i in expected[:k]])
        np.testing.assert_array_equal(opos[d, :k], np.array([pos[s, i] for s, i in expected[:k]]).reshape(k, 3))
        got_ids.extend(oids[d, :k].tolist())
    if not overflow.any():
        want = sorted(ids[s, i] for s in range(size) for i in range(nums[s]))
        assert sorted(got_ids) == want, "exchange lost or duplicated rows"


def check_halo_exchange(mesh: Mesh) -> None:
    names = mesh.axis_names
    shape = mesh.devices.shape
    local = (4, 3, 2)
    dims = len(names)
    glob_shape = tuple(local[i] * (shape[i] if i < dims else 1) for i in range(3))
    field = np.arange(np.prod(glob_shape), dtype=np.float32).reshape(glob_shape)
    spec = P(*names)
    axes = tuple(names)
    for periodic in (True, False):
        f = sx.smap(lambda a, p=periodic: sx.comm.halo_exchange(a, 1, axes=axes, periodic=p), in_specs=(spec,),
                    out_specs=spec, mesh=mesh, expand=False, jit=True)
        out = to_numpy(f(put(mesh, field, spec)))
        pad = [(1, 1) if i < dims else (0, 0) for i in range(3)]
        padded = np.pad(field, pad, mode="wrap" if periodic else "constant")
        grown = tuple(local[i] + 2 if i < dims else local[i] for i in range(3))
        for idx in np.ndindex(*shape):
            lo = [idx[i] * local[i] if i < dims else 0 for i in range(3)]
            ref = padded[tuple(slice(lo[i], lo[i] + grown[i]) for i in range(3))]
            blk = out[tuple(slice(idx[i] * grown[i], (idx[i] + 1) * grown[i]) if i < dims else slice(None)
                            for i in range(3))]
            np.testing.assert_array_equal(blk, ref, err_msg=f"block {idx} periodic={periodic}")
    # One dimension split over every axis at once (a tuple of axes).
    size = mesh.devices.size
    line = np.arange(3.0 * size, dtype=np.float32)
    f = sx.smap(lambda a: sx.comm.halo_exchange(a, 1, axes=(tuple(names),)), in_specs=(P(tuple(names)),),
                out_specs=P(tuple(names)), mesh=mesh, expand=False, jit=True)
    out = to_numpy(f(put(mesh, line, P(tuple(names))))).reshape(size, 5)
    padded = np.pad(line, 1, mode="wrap")
    for r in range(size):
        np.testing.assert_array_equal(out[r], padded[3 * r: 3 * r + 5])


def check_grads(mesh: Mesh) -> None:
    size = mesh.devices.size
    xs = per_rank(mesh, 11, (size, 2))
    w = np.arange(1, size + 1, dtype=np.float32)

    def loss(x):
        def local(x, w):
            rank = sx.rank_info().rank
            a = sx.comm.allreduce(x * w[rank])
            g = sx.comm.allgather(x)
            t = sx.comm.alltoall(x)
            s = sx.comm.shift(x, 1)
            return (jnp.sum(a * a) + jnp.sum(g) * 0.5 + jnp.sum(t * t) + jnp.sum(s * w[rank]))[None]

        out = sx.smap(local, in_specs=(P(sx.ALL), P()), out_specs=P(sx.ALL), mesh=mesh, expand=True)(x, w)
        return jnp.sum(out)

    x = put(mesh, xs)
    grad = to_numpy(jax.jit(jax.grad(loss))(x))
    # NumPy reference: loss = sum_r [ |A|^2 + 0.5 sum(all x) + sum_d x[d, r]^2 ... ]
    a = np.einsum("r,r...->...", w, xs)
    ref = np.zeros_like(xs)
    for r in range(size):
        ref[r] += size * 2 * a * w[r]                       # every rank holds A = sum_r w_r x_r
        ref[r] += 0.5 * size                                 # every rank sums the gathered x
        ref[r] += 2 * xs[r]                                  # alltoall is a permutation: sum of squares
        ref[r] += w[(r + 1) % size]                          # shift: x_r goes to rank r+1, weighted there
    np.testing.assert_allclose(grad, ref, rtol=1e-4, atol=1e-4)


CHECKS = [check_allreduce, check_allgather, check_alltoall, check_bcast_gather_scatter_reduce, check_scan,
          check_shift_sendrecv_barrier, check_alltoallv, check_exchange, check_halo_exchange, check_grads]


def run_all_in_world() -> list[str]:
    """Every check on the meshes of the current (possibly multi-process) world: flat and process x device grid."""
    done = []
    for mesh in (sx.flat_mesh("x"), sx.grid_mesh(("x", "y"))):
        for check in CHECKS:
            check(mesh)
            done.append(f"{check.__name__}{tuple(mesh.devices.shape)}")
    return done
