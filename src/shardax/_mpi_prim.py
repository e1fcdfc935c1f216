"""The MPI transport's JAX side: one primitive, lowered to the native MPI call or to a host call.

Inside ``smap`` on a multi-process CPU run with the MPI transport (see :func:`mpi_active`), each ``sx.comm``
collective binds :data:`mpi_collective_p` instead of a ``jax.lax`` collective. The lowering reads the concrete mesh
of the program, fixes who sends what to whom (a :class:`~shardax._mpi_host.Plan`) and emits, with side effects, the
XLA FFI call of :mod:`shardax._mpi_native` where it applies (:func:`_native_attrs`), else XLA's Python host call into
:mod:`shardax._mpi_host`, once per device. The result types follow ``jax.lax``: reductions and gathers are invariant
over the collective's axes, permutations vary over them.
"""

from __future__ import annotations

import collections
import itertools
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax._src import callback as jax_callback
from jax._src import core as jax_core
from jax._src import sharding_impls
from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir

from . import _mpi_host as host
from . import _mpi_native
from ._transport import cpu_collectives, mpi_world
from .core import manual_axes, vary_over

mpi_collective_p = Primitive("shardax_mpi_collective")
mpi_collective_p.multiple_results = True
native_lowerings: collections.Counter[str] = collections.Counter()  # collectives lowered to the native call, by kind


def mpi_active(axes: tuple[str, ...]) -> bool:
    """Whether a collective over ``axes`` here goes through the MPI transport (checked at trace time)."""
    if not axes or cpu_collectives() != "mpi" or jax.process_count() == 1:
        return False
    mesh = jax.sharding.get_abstract_mesh()
    if set(manual_axes()) != set(mesh.axis_names):  # host calls need every mesh axis manual
        return False
    return jax.devices()[0].platform == "cpu"


def _with_vma(aval: Any, shape: tuple[int, ...], dtype: Any, vma: frozenset[str]) -> Any:
    mat = getattr(aval, "mat", None)
    if mat is None:
        return jax_core.ShapedArray(shape, dtype)
    return aval.update(shape=shape, dtype=dtype, manual_axis_type=mat.update(varying=vma))


def _out_avals(x: Any, *, kind: str, axes: tuple[str, ...], size: int, capacity: int | None, **_: Any) -> list[Any]:
    vma = frozenset(getattr(getattr(x, "mat", None), "varying", ()))
    if kind == "allreduce":
        return [_with_vma(x, x.shape, x.dtype, vma - set(axes))]
    if kind == "allgather":
        return [_with_vma(x, (size, *x.shape), x.dtype, vma - set(axes))]
    if kind in ("alltoall", "permute"):
        return [_with_vma(x, x.shape, x.dtype, vma | set(axes))]
    assert kind == "ragged" and capacity is not None
    return [_with_vma(x, (capacity, *x.shape[1:]), x.dtype, vma | set(axes)),
            _with_vma(x, (size,), np.dtype(np.int32), vma | set(axes))]


def _abstract_eval(position: Any, x: Any, *rest: Any, **params: Any) -> list[Any]:
    del position, rest
    return _out_avals(x, **params)


mpi_collective_p.def_abstract_eval(_abstract_eval)


def _body(kind: str, op: str | None, pairs: tuple[tuple[int, int], ...] | None, capacity: int | None,
          size: int) -> Any:
    if kind == "allreduce":
        assert op is not None
        return host.allreduce_body(op)
    if kind == "allgather":
        return host.route_body(host.allgather_route, size)
    if kind == "alltoall":
        return host.route_body(host.alltoall_route, size)
    if kind == "permute":
        assert pairs is not None
        return host.route_body(lambda plan: host.permute_route(plan, pairs), 1)
    assert capacity is not None
    return host.ragged_body(capacity)


def _lowering(ctx: Any, position: Any, *operands: Any, kind: str, axes: tuple[str, ...], size: int,
              op: str | None, pairs: tuple[tuple[int, int], ...] | None, capacity: int | None) -> Any:
    axis_context = ctx.module_context.axis_context
    mesh: Any = getattr(axis_context, "mesh", None)
    if not isinstance(axis_context, sharding_impls.SPMDAxisContext) or getattr(mesh, "devices", None) is None:
        raise NotImplementedError("the MPI transport runs sx.comm collectives inside smap/shard_map over a concrete "
                                  "mesh; set SHARDAX_CPU_COLLECTIVES=gloo for other programs")
    devices = np.asarray(mesh.devices)
    process = np.array([d.process_index for d in devices.ravel()], np.int64)
    counts = np.bincount(process, minlength=jax.process_count())
    if counts.min() != counts.max():
        raise NotImplementedError(f"the MPI transport needs a mesh with as many devices on every process (this one "
                                  f"has {counts.tolist()} by process): use such a mesh (sx.flat_mesh(), "
                                  "sx.grid_mesh()) or set SHARDAX_CPU_COLLECTIVES=gloo")
    plan = host.Plan.build(devices.shape, mesh.axis_names, axes, process, jax.process_index())
    native = _native_attrs(kind, op, pairs, plan, ctx.avals_in[1].dtype)
    if native is not None:  # the devices' threads call MPI themselves, between XLA's buffers
        native_lowerings[kind] += 1
        lowering = jax.ffi.ffi_lowering(_mpi_native.TARGET, has_side_effect=True)
        if native["kind"] >= 3:  # several devices per process: the mesh position tells each thread its slot
            return lowering(ctx, position, *operands, **native)
        return lowering(ctx.replace(avals_in=ctx.avals_in[1:]), *operands, **native)
    site = host.Site(plan, _body(kind, op, pairs, capacity, size), [tuple(a.shape) for a in ctx.avals_out])
    sharding = jax_callback._callback_op_sharding(axis_context, None, ctx.avals_out)
    result, _, _ = jax_callback.emit_python_callback(
        ctx, site, None, [position, *operands], ctx.avals_in, ctx.avals_out, has_side_effect=True,
        returns_token=False, sharding=sharding)
    return result


mlir.register_lowering(mpi_collective_p, _lowering, platform="cpu", cacheable=False)

_OPS = {"sum": 0, "prod": 1, "max": 2, "min": 3}
_MAX_LOCAL = 64                  # devices per process the native call's sites hold (MAX_LOCAL in _mpi_native.c)
_SITES = itertools.count()       # call sites of the native call with several devices per process
_KINDS = {"allreduce": 0, "ragged": 1, "allgather": 2, "alltoall": 2, "permute": 2}
_REDUCIBLE = {np.dtype(t) for t in ("int8", "uint8", "int16", "uint16", "int32", "uint32", "int64", "uint64",
                                    "float32", "float64", "complex64", "complex128")}
_MOVABLE = _REDUCIBLE | {np.dtype(np.bool_), np.dtype(np.float16), np.dtype(jnp.bfloat16)}  # whole bytes per element


def _native_attrs(kind: str, op: str | None, pairs: tuple[tuple[int, int], ...] | None, plan: host.Plan,
                  dtype: Any) -> dict[str, Any] | None:
    """The native call's attributes for this collective, or ``None`` where it keeps the host call: a group smaller
    than the run, elements of less than a byte (float8, int4), a reduction MPI does not do in this dtype (or complex
    max/min), gathers and permutations with several devices on this process, or no native call (see
    :mod:`shardax._mpi_native`)."""
    world = mpi_world()
    mpi_rank = np.asarray(world.mpi_rank_of, np.int64)[plan.process]    # MPI rank of each mesh position
    nprocs = world.comm.Get_size()
    if len(set(mpi_rank.tolist())) != nprocs or plan.members.shape[0] != 1 or np.dtype(dtype) not in _MOVABLE:
        return None
    if len(plan.local) > 1:
        return _native_local_attrs(kind, op, plan, dtype, mpi_rank, world)
    if len(plan.local) != 1 or plan.members.shape != (1, nprocs):
        return None
    if kind == "allreduce" and (np.dtype(dtype) not in _REDUCIBLE or (
            np.issubdtype(dtype, np.complexfloating) and op in ("max", "min"))):
        return None
    if _mpi_native.load() is None:
        return None
    attrs: dict[str, Any] = {"comm": np.int64(_mpi_native.comm_index(world.comm)), "kind": np.int64(_KINDS[kind])}
    if kind == "allreduce":
        assert op is not None
        return {**attrs, "op": np.int64(_OPS[op])}
    if kind == "ragged":
        return {**attrs, "ranks": mpi_rank[plan.members[0]].astype(np.int64)}
    route = {"allgather": host.allgather_route, "alltoall": host.alltoall_route,
             "permute": lambda p: host.permute_route(p, pairs or ())}[kind](plan)
    table = _unit_route(route, mpi_rank, plan.local[0], nprocs)
    if table is None:
        return None
    return {**attrs, "route": table, "units": np.int64(route.units_in),
            "zero": np.int64(bool((route.src_pos[plan.local[0]] < 0).any()))}


def _native_local_attrs(kind: str, op: str | None, plan: host.Plan, dtype: Any, mpi_rank: np.ndarray,
                        world: Any) -> dict[str, Any] | None:
    """Attributes of the native call with several devices per process (allreduce, alltoallv and all_to_all over a
    group of every device), or ``None``."""
    if kind not in ("allreduce", "ragged", "alltoall") or len(plan.local) > _MAX_LOCAL:
        return None
    if kind == "allreduce" and (np.dtype(dtype) not in _REDUCIBLE or np.issubdtype(dtype, np.complexfloating)):
        return None
    if _mpi_native.load() is None:
        return None
    attrs: dict[str, Any] = {"comm": np.int64(_mpi_native.comm_index(world.comm)), "site": np.int64(next(_SITES)),
                             "local": np.asarray(plan.local, np.int64)}
    if kind == "allreduce":
        assert op is not None
        return {**attrs, "kind": np.int64(3), "op": np.int64(_OPS[op])}
    process = plan.process
    slots = np.array([int(np.sum(process[:p] == process[p])) for p in range(len(process))], np.int64)
    attrs |= {"kind": np.int64(4), "procs": mpi_rank.astype(np.int64), "slots": slots,
              "members": plan.members[0].astype(np.int64)}
    return {**attrs, "fixed": np.int64(1)} if kind == "alltoall" else attrs  # (size, ...) blocks: one per rank


def _unit_route(route: host.Route, mpi_rank: np.ndarray, me: int, nprocs: int) -> np.ndarray | None:
    """``route`` for position ``me`` as ``MPI_Alltoallv``'s four arrays (send counts, send offsets, receive counts,
    receive offsets, in units, by MPI rank), or ``None`` when a peer's units are not one run on both sides."""
    out = np.zeros((4, nprocs), np.int64)

    def runs(units_from: np.ndarray, units_to: np.ndarray) -> tuple[int, int, int] | None:
        if units_from.size == 0:
            return 0, 0, 0
        steps = np.arange(units_from.size)
        if (units_from != units_from[0] + steps).any() or (units_to != units_to[0] + steps).any():
            return None
        return int(units_from.size), int(units_from[0]), int(units_to[0])

    for p in range(route.src_pos.shape[0]):
        to_p = np.flatnonzero(route.src_pos[p] == me)      # what position p takes from me
        from_p = np.flatnonzero(route.src_pos[me] == p)    # what I take from position p
        sent, taken = runs(route.src_unit[p][to_p], to_p), runs(route.src_unit[me][from_p], from_p)
        if sent is None or taken is None:
            return None
        out[:, mpi_rank[p]] = sent[0], sent[1], taken[0], taken[2]
    return out.reshape(-1)


def _bind(kind: str, arrays: Sequence[jax.Array], axes: tuple[str, ...], size: int, *, op: str | None = None,
          pairs: tuple[tuple[int, int], ...] | None = None, capacity: int | None = None) -> list[jax.Array]:
    everything = tuple(jax.sharding.get_abstract_mesh().axis_names)
    position = lax.axis_index(everything)
    return mpi_collective_p.bind(position, *arrays, kind=kind, axes=axes, size=size, op=op, pairs=pairs,
                                 capacity=capacity)


# ---------------------------------------------------------------------------------------------- autodiff


def _jvp(primals: Sequence[Any], tangents: Sequence[Any], **params: Any) -> tuple[list[Any], list[Any]]:
    position, *xs = primals
    out = mpi_collective_p.bind(position, *xs, **params)
    linear = params["kind"] in ("allgather", "alltoall", "permute") or (
        params["kind"] == "allreduce" and params["op"] == "sum")
    if not linear:
        raise NotImplementedError(f"sx.comm through the MPI transport differentiates sums, gathers and permutations "
                                  f"only, not {params['kind']} with op={params['op']!r}")
    t = ad.instantiate_zeros(tangents[1])
    return out, mpi_collective_p.bind(position, t, **params)


def _transpose(cts: Sequence[Any], position: Any, x: Any, *, kind: str, axes: tuple[str, ...], size: int,
               op: str | None, pairs: tuple[tuple[int, int], ...] | None, capacity: int | None) -> list[Any]:
    del x, op, capacity
    (ct,) = cts
    ct = ad.instantiate_zeros(ct)
    if kind == "allreduce":  # invariant result: each rank's input got the whole cotangent
        grad = vary_over(ct, axes)
    elif kind == "allgather":
        grad = vary_over(ct, axes)[lax.axis_index(axes)]
    elif kind == "alltoall":
        (grad,) = _bind("alltoall", [ct], axes, size)
    else:
        assert pairs is not None
        (grad,) = _bind("permute", [ct], axes, size, pairs=tuple((d, s) for s, d in pairs))
    return [None, grad]


ad.primitive_jvps[mpi_collective_p] = _jvp
ad.primitive_transposes[mpi_collective_p] = _transpose


def _batch(args: Sequence[Any], dims: Sequence[Any], **params: Any) -> tuple[list[Any], list[Any]]:
    """``vmap`` inside ``smap``: elementwise kinds keep the batch axis, gathers push it one place right, and
    ``alltoall`` moves it behind the rank axis."""
    position, x, *rest = args
    if isinstance(dims[0], int) or rest:
        raise NotImplementedError("sx.comm.alltoallv/exchange through the MPI transport do not batch under vmap")
    kind, dim = params["kind"], dims[1]
    if kind == "alltoall":
        moved = jnp.moveaxis(x, dim, 1)
        (out,) = mpi_collective_p.bind(position, moved, **params)
        return [out], [1]
    (out,) = mpi_collective_p.bind(position, x, **params)
    return [out], [dim + 1 if kind == "allgather" else dim]


batching.primitive_batchers[mpi_collective_p] = _batch


# ---------------------------------------------------------------------------------------------- collectives


def _size(axes: tuple[str, ...]) -> int:
    shape = jax.sharding.get_abstract_mesh().shape
    return int(np.prod([shape[a] for a in axes]))


def allreduce(x: jax.Array, op: str, axes: tuple[str, ...]) -> jax.Array:
    """``MPI_Allreduce`` over ``axes`` (``op`` in sum/max/min/prod); the result is invariant over ``axes``."""
    x = vary_over(jnp.asarray(x), axes)
    if x.dtype == jnp.bool_:
        return allreduce(x.astype(jnp.int32), op, axes).astype(jnp.bool_)
    (out,) = _bind("allreduce", [x], axes, _size(axes), op=op)
    return out


def allgather(x: jax.Array, axes: tuple[str, ...], *, tiled: bool = False) -> jax.Array:
    """``MPI_Allgather`` stacked by rank (``(size, *x.shape)``), or concatenated along axis 0 with ``tiled``."""
    x = vary_over(jnp.asarray(x), axes)
    (out,) = _bind("allgather", [x], axes, _size(axes))
    return out.reshape(-1, *x.shape[1:]) if tiled else out


def alltoall(x: jax.Array, axes: tuple[str, ...]) -> jax.Array:
    """Row ``d`` of ``x`` (leading dimension = size) to rank ``d``; row ``s`` of the result from rank ``s``."""
    x = vary_over(jnp.asarray(x), axes)
    (out,) = _bind("alltoall", [x], axes, _size(axes))
    return out


def permute(x: jax.Array, axes: tuple[str, ...], pairs: Sequence[tuple[int, int]]) -> jax.Array:
    """``lax.ppermute``: rank ``dst`` receives rank ``src``'s ``x`` for each ``(src, dst)``; others get zeros."""
    x = vary_over(jnp.asarray(x), axes)
    (out,) = _bind("permute", [x], axes, _size(axes), pairs=tuple((int(s), int(d)) for s, d in pairs))
    return out


def ragged(x: jax.Array, send_counts: jax.Array, capacity: int, axes: tuple[str, ...]
           ) -> tuple[jax.Array, jax.Array]:
    """``MPI_Alltoallv`` of rows into ``capacity`` rows (packed by source rank, zeros after): ``(data,
    recv_counts)``."""
    x, send_counts = vary_over((jnp.asarray(x), jnp.asarray(send_counts, jnp.int32)), axes)
    data, recv_counts = _bind("ragged", [x, send_counts], axes, _size(axes), capacity=capacity)
    return data, recv_counts
