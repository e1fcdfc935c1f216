"""Host side of the MPI transport: one call site of a collective, run by every local device's thread at once.

XLA:CPU runs the program of each local device on a thread of its own; a collective's host call (see
:mod:`shardax._mpi_prim`) is entered by all of them. They meet at a barrier, one thread (the leader) moves
what crosses processes with one MPI call on a communicator of the run, and each thread then assembles its own
result from the others' inputs (shared memory) and what MPI brought. Three barriers per call: inputs published,
MPI done, results assembled (after which XLA may free the inputs).

Everything about who sends what to whom is fixed when the program is lowered (a :class:`Plan` from the mesh and
the collective's axes), so a call does only copies, one reduction or one MPI call.
"""

from __future__ import annotations

import dataclasses
import itertools
import threading
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from ._transport import mpi_world

# Reductions MPI cannot do in these dtypes run in float32 on the host.
_WIDEN = {np.dtype("float16"), np.dtype("V2")}


@dataclasses.dataclass(frozen=True)
class Plan:
    """Where every device of a mesh sits for one collective over ``axes``.

    Attributes:
        process: ``(ndev,)`` JAX process index of each mesh position (row-major over the mesh).
        group: ``(ndev,)`` index of the position's group (the ranks that take part in one collective together).
        rank: ``(ndev,)`` rank of the position in its group.
        size: ranks per group.
        local: the positions on this process, ascending (a thread's slot is its index here).
        members: ``(ngroups, size)`` position of each rank of each group.
    """

    process: np.ndarray
    group: np.ndarray
    rank: np.ndarray
    size: int
    local: tuple[int, ...]
    members: np.ndarray

    @staticmethod
    def build(shape: Sequence[int], axis_names: Sequence[str], axes: Sequence[str], process: np.ndarray,
              me: int) -> Plan:
        coords = np.indices(tuple(shape)).reshape(len(shape), -1)
        inside = [i for i, a in enumerate(axis_names) if a in axes]
        outside = [i for i, a in enumerate(axis_names) if a not in axes]

        def linear(dims: list[int]) -> np.ndarray:
            out = np.zeros(coords.shape[1], np.int64)
            for d in dims:
                out = out * shape[d] + coords[d]
            return out

        rank, group = linear(inside), linear(outside)
        size = int(np.prod([shape[d] for d in inside], dtype=np.int64))
        members = np.zeros((int(group.max()) + 1, size), np.int64)
        members[group, rank] = np.arange(coords.shape[1])
        local = tuple(int(p) for p in np.flatnonzero(process == me))
        return Plan(np.asarray(process), group, rank, size, local, members)


class _Meeting:
    """The local threads of one call site: a reusable barrier and the slots they publish into."""

    def __init__(self, count: int):
        self.count = count
        self.barrier = threading.Barrier(count) if count > 1 else None
        self.inputs: list[Any] = [None] * count
        self.shared: dict[str, Any] = {}

    def wait(self) -> None:
        if self.barrier is not None:
            self.barrier.wait()


class Site:
    """One collective of one lowered program; called as ``site(position, *arrays)`` by each local device's thread."""

    def __init__(self, plan: Plan, body: Callable[[Site, int, Sequence[np.ndarray]], Sequence[np.ndarray]],
                 out_shapes: Sequence[tuple[int, ...]]):
        self.plan = plan
        self.body = body
        self.out_shapes = list(out_shapes)
        self.slot_of = {p: i for i, p in enumerate(plan.local)}
        self.meeting = _Meeting(len(plan.local))
        world = mpi_world()
        self.comm = world.comm
        self.mpi_rank = np.asarray(world.mpi_rank_of, np.int64)[plan.process]  # MPI rank of each position
        self.nprocs = self.comm.Get_size()
        self.cache: dict[Any, Any] = {}

    def __call__(self, position: np.ndarray, *arrays: np.ndarray) -> Sequence[np.ndarray]:
        slot = self.slot_of[int(position)]
        try:
            results = self.body(self, slot, arrays)
            return tuple(np.asarray(r).reshape(shape) for r, shape in zip(results, self.out_shapes, strict=True))
        except BaseException:
            if self.meeting.barrier is not None:
                self.meeting.barrier.abort()  # the other local threads stop waiting and fail too
            raise

    @property
    def leader(self) -> int:
        return 0


# ---------------------------------------------------------------------------------------------- reductions


def _identity(op: str, dtype: np.dtype) -> Any:
    if op == "sum":
        return 0
    if op == "prod":
        return 1
    if dtype == np.bool_:
        return op == "min"
    if np.issubdtype(dtype, np.floating):
        return -np.inf if op == "max" else np.inf
    info = np.iinfo(dtype)
    return info.min if op == "max" else info.max


_UFUNC = {"sum": np.add, "prod": np.multiply, "max": np.maximum, "min": np.minimum}


def _mpi_op(op: str) -> Any:
    from mpi4py import MPI

    return {"sum": MPI.SUM, "prod": MPI.PROD, "max": MPI.MAX, "min": MPI.MIN}[op]


def _reduce_layout(site: Site) -> tuple[list[int], dict[int, int]]:
    """Rows of the reduction buffer: the groups that span processes (the same list everywhere), then this
    process's groups that do not; and each local group's row."""
    if "rows" not in site.cache:
        plan = site.plan
        procs_of_group = [set(plan.process[m].tolist()) for m in plan.members]
        crossing = [g for g, ps in enumerate(procs_of_group) if len(ps) > 1]
        mine = sorted({int(plan.group[p]) for p in plan.local})
        rows = crossing + [g for g in mine if g not in set(crossing)]
        site.cache["rows"] = (rows, {g: i for i, g in enumerate(rows)}, len(crossing))
    rows, row_of, _ = site.cache["rows"]
    return rows, row_of


def allreduce_body(op: str) -> Callable[[Site, int, Sequence[np.ndarray]], Sequence[np.ndarray]]:
    """Every rank of a group gets the reduction of the group's inputs (``MPI_Allreduce``)."""

    def body(site: Site, slot: int, arrays: Sequence[np.ndarray]) -> Sequence[np.ndarray]:
        (x,) = arrays
        plan, meet = site.plan, site.meeting
        rows, row_of = _reduce_layout(site)
        ncross = site.cache["rows"][2]
        work = np.dtype(np.float32) if x.dtype in _WIDEN or x.dtype.name == "bfloat16" else x.dtype
        flat = np.asarray(x).reshape(-1)
        if meet.count == 1 and len(rows) == 1 and ncross == 1:  # one device per process: straight to MPI
            out = np.empty(flat.shape, work)
            site.comm.Allreduce(flat.astype(work, copy=False), out, op=_mpi_op(op))
            return (out.astype(x.dtype, copy=False).reshape(x.shape),)
        meet.inputs[slot] = flat
        if slot == site.leader:
            meet.shared["buf"] = np.empty((len(rows), flat.size), work)
        meet.wait()
        buf = meet.shared["buf"]
        lo, hi = flat.size * slot // meet.count, flat.size * (slot + 1) // meet.count
        ufunc = _UFUNC[op]
        for g, row in ((g, row_of[g]) for g in rows):
            slots = [site.slot_of[int(p)] for p in plan.members[g] if int(p) in site.slot_of]
            target = buf[row, lo:hi]
            if not slots:
                target[...] = _identity(op, work)
                continue
            np.copyto(target, meet.inputs[slots[0]][lo:hi], casting="unsafe")
            for s in slots[1:]:
                ufunc(target, meet.inputs[s][lo:hi], out=target, casting="unsafe")
        meet.wait()
        if slot == site.leader and ncross:
            from mpi4py import MPI

            site.comm.Allreduce(MPI.IN_PLACE, buf[:ncross], op=_mpi_op(op))
        meet.wait()
        out = buf[row_of[int(plan.group[plan.local[slot]])]]
        return (out.astype(x.dtype, copy=False).reshape(x.shape),)

    return body


# ---------------------------------------------------------------------------------------------- routing


@dataclasses.dataclass(frozen=True)
class Route:
    """Unit ``j`` of position ``t``'s output comes from unit ``src_unit`` of position ``src_pos`` (-1: zeros).

    Arrays are ``(ndev, units_out)``; inputs have ``units_in`` units each, of equal byte size.
    """

    src_pos: np.ndarray
    src_unit: np.ndarray
    units_in: int


def allgather_route(plan: Plan) -> Route:
    members = plan.members[plan.group]                       # (ndev, size)
    return Route(members, np.zeros_like(members), 1)


def alltoall_route(plan: Plan) -> Route:
    members = plan.members[plan.group]
    return Route(members, np.broadcast_to(plan.rank[:, None], members.shape).copy(), plan.size)


def permute_route(plan: Plan, pairs: Sequence[tuple[int, int]]) -> Route:
    src_of = {dst: src for src, dst in pairs}
    src = np.array([[plan.members[plan.group[t], src_of[int(plan.rank[t])]] if int(plan.rank[t]) in src_of
                     else -1] for t in range(len(plan.rank))], np.int64)
    return Route(src, np.zeros_like(src), 1)


@dataclasses.dataclass
class _RoutePlan:
    send_counts: np.ndarray                 # (nprocs,) units to each MPI rank
    recv_counts: np.ndarray
    send_from: list[tuple[np.ndarray, np.ndarray]]               # per source slot: (buffer index, its unit)
    local_copy: list[list[tuple[int, np.ndarray, np.ndarray]]]   # per dst slot: (src slot, src units, dst units)
    remote: list[tuple[np.ndarray, np.ndarray]]                  # per dst slot: (recv index, dst units)
    zero: list[bool]                                             # per dst slot: some units stay zero


def _route_plan(site: Site, route: Route) -> _RoutePlan:
    plan = site.plan
    me = int(site.comm.Get_rank())
    proc = site.mpi_rank
    ndev, units_out = route.src_pos.shape
    t_idx, j_idx = np.meshgrid(np.arange(ndev), np.arange(units_out), indexing="ij")
    t_idx, j_idx = t_idx.ravel(), j_idx.ravel()
    s_idx, u_idx = route.src_pos.ravel(), route.src_unit.ravel()
    live = s_idx >= 0
    t_idx, j_idx, s_idx, u_idx = t_idx[live], j_idx[live], s_idx[live], u_idx[live]
    order = np.lexsort((j_idx, t_idx))                       # messages ordered by (dst position, dst unit)
    t_idx, j_idx, s_idx, u_idx = t_idx[order], j_idx[order], s_idx[order], u_idx[order]
    src_proc, dst_proc = proc[s_idx], proc[t_idx]
    remote = src_proc != dst_proc
    sending = remote & (src_proc == me)
    send_dst = dst_proc[sending]
    send_order = np.argsort(send_dst, kind="stable")
    send_counts = np.bincount(send_dst, minlength=site.nprocs)
    s_send, u_send = s_idx[sending][send_order], u_idx[sending][send_order]
    send_from = []
    for p in plan.local:
        sel = np.flatnonzero(s_send == p)
        send_from.append((sel, u_send[sel]))
    receiving = remote & (dst_proc == me)
    recv_src = src_proc[receiving]
    recv_order = np.argsort(recv_src, kind="stable")
    recv_counts = np.bincount(recv_src, minlength=site.nprocs)
    t_recv, j_recv = t_idx[receiving][recv_order], j_idx[receiving][recv_order]
    local_copy, remote_in, zero = [], [], []
    for p in plan.local:
        mine = ~remote & (t_idx == p)
        copies = []
        for s in np.unique(s_idx[mine]):
            sel = mine & (s_idx == s)
            copies.append((site.slot_of[int(s)], u_idx[sel], j_idx[sel]))
        local_copy.append(copies)
        sel = np.flatnonzero(t_recv == p)
        remote_in.append((sel, j_recv[sel]))
        zero.append(int(np.count_nonzero(route.src_pos[p] >= 0)) < units_out)
    return _RoutePlan(send_counts, recv_counts, send_from, local_copy, remote_in, zero)


def _alltoallv_bytes(comm: Any, send: np.ndarray, send_units: np.ndarray, recv: np.ndarray,
                     recv_units: np.ndarray, unit_bytes: int) -> None:
    from mpi4py import MPI

    scount, rcount = send_units * unit_bytes, recv_units * unit_bytes
    if max(int(scount.sum()), int(rcount.sum())) >= 2**31:
        raise ValueError("the MPI transport moves at most 2 GiB per process and call: split the collective, or set "
                         "SHARDAX_CPU_COLLECTIVES=gloo")
    sdispl = np.concatenate([[0], np.cumsum(scount)[:-1]])
    rdispl = np.concatenate([[0], np.cumsum(rcount)[:-1]])
    comm.Alltoallv([send, (scount, sdispl), MPI.BYTE], [recv, (rcount, rdispl), MPI.BYTE])


def route_body(make_route: Callable[[Plan], Route], units_out: int
               ) -> Callable[[Site, int, Sequence[np.ndarray]], Sequence[np.ndarray]]:
    """Copy units of the inputs to the outputs along a static :class:`Route` (allgather, alltoall, permutes)."""

    def body(site: Site, slot: int, arrays: Sequence[np.ndarray]) -> Sequence[np.ndarray]:
        (x,) = arrays
        meet = site.meeting
        if "route" not in site.cache:
            route = make_route(site.plan)
            site.cache["route"] = (route, _route_plan(site, route))
        route, rp = site.cache["route"]
        units = np.ascontiguousarray(x).reshape(route.units_in, -1).view(np.uint8)
        unit_bytes = units.shape[1]
        meet.inputs[slot] = units
        meet.wait()
        if slot == site.leader and (rp.send_counts.any() or rp.recv_counts.any()):
            send = np.empty((int(rp.send_counts.sum()), unit_bytes), np.uint8)
            for s, (at, unit) in enumerate(rp.send_from):
                if at.size:
                    send[at] = meet.inputs[s][unit]
            recv = np.empty((int(rp.recv_counts.sum()), unit_bytes), np.uint8)
            _alltoallv_bytes(site.comm, send, rp.send_counts, recv, rp.recv_counts, unit_bytes)
            meet.shared["recv"] = recv
        meet.wait()
        out = (np.zeros if rp.zero[slot] else np.empty)((units_out, unit_bytes), np.uint8)
        for s, src_units, dst_units in rp.local_copy[slot]:
            out[dst_units] = meet.inputs[s][src_units]
        at, dst_units = rp.remote[slot]
        if at.size:
            out[dst_units] = meet.shared["recv"][at]
        meet.wait()
        return (out.view(x.dtype).reshape(-1),)

    return body


# ---------------------------------------------------------------------------------------------- alltoallv


def ragged_body(capacity: int) -> Callable[[Site, int, Sequence[np.ndarray]], Sequence[np.ndarray]]:
    """``MPI_Alltoallv`` of rows: ``(x (n, ...), send_counts (size,))`` -> ``(data (capacity, ...), recv_counts)``;
    rows arrive packed, grouped by source rank in rank order, zeros after; rows past ``capacity`` are dropped."""

    def body(site: Site, slot: int, arrays: Sequence[np.ndarray]) -> Sequence[np.ndarray]:
        x, counts = arrays
        plan, meet = site.plan, site.meeting
        size = plan.size
        rows = np.ascontiguousarray(x).reshape(x.shape[0], -1).view(np.uint8)
        row_bytes = rows.shape[1]
        counts = np.clip(np.asarray(counts, np.int64), 0, None)
        ends = np.minimum(np.cumsum(counts), x.shape[0])      # rows past n are not there to send
        counts = np.diff(np.concatenate([[0], ends]))
        meet.inputs[slot] = (rows, counts, ends - counts)
        meet.wait()
        if slot == site.leader:
            local = np.stack([meet.inputs[s][1] for s in range(meet.count)])     # (M, size)
            every = np.empty((site.nprocs, *local.shape), np.int64)             # by MPI rank
            site.comm.Allgather(local, every)
            ndev = len(plan.process)
            table = np.zeros((ndev, size), np.int64)
            for pos in range(ndev):
                r = int(site.mpi_rank[pos])
                table[pos] = every[r][_slot_on(site, pos)]
            meet.shared["table"] = table
            me = int(site.comm.Get_rank())
            send_parts: list[tuple[int, int, int]] = []
            send_counts = np.zeros(site.nprocs, np.int64)
            recv_counts = np.zeros(site.nprocs, np.int64)
            recv_at: dict[tuple[int, int], int] = {}
            # Messages from process p to q: for each destination position t on q (ascending), the rows of each
            # source position s on p in rank order of s.
            dst_positions = sorted(range(ndev), key=lambda t: (int(site.mpi_rank[t]), t))
            offset_by_src = np.zeros(site.nprocs, np.int64)
            for t in dst_positions:
                q, g, rt = int(site.mpi_rank[t]), int(plan.group[t]), int(plan.rank[t])
                for r in range(size):
                    s = int(plan.members[g, r])
                    p = int(site.mpi_rank[s])
                    if p == q or table[s, rt] == 0:
                        continue
                    if p == me:
                        starts = meet.inputs[site.slot_of[s]][2]
                        send_parts.append((site.slot_of[s], int(starts[rt]), int(starts[rt] + table[s, rt])))
                        send_counts[q] += table[s, rt]
                    if q == me:
                        recv_counts[p] += table[s, rt]
            # Receive offsets: messages from each source process p laid out in MPI rank order.
            start_of = np.concatenate([[0], np.cumsum(recv_counts)[:-1]])
            for t in dst_positions:
                q, g, rt = int(site.mpi_rank[t]), int(plan.group[t]), int(plan.rank[t])
                if q != me:
                    continue
                for r in range(size):
                    s = int(plan.members[g, r])
                    p = int(site.mpi_rank[s])
                    if p == q or table[s, rt] == 0:
                        continue
                    recv_at[(t, r)] = int(start_of[p] + offset_by_src[p])
                    offset_by_src[p] += table[s, rt]
            send = _joined(meet.inputs, send_parts, row_bytes)
            recv = np.empty((int(recv_counts.sum()), row_bytes), np.uint8)
            if send_counts.any() or recv_counts.any():
                _alltoallv_bytes(site.comm, send, send_counts, recv, recv_counts, row_bytes)
            meet.shared["recv"], meet.shared["recv_at"] = recv, recv_at
        meet.wait()
        table, recv, recv_at = meet.shared["table"], meet.shared["recv"], meet.shared["recv_at"]
        t = plan.local[slot]
        g, rt = int(plan.group[t]), int(plan.rank[t])
        got = np.array([table[int(plan.members[g, r]), rt] for r in range(size)], np.int64)
        out = np.empty((capacity, row_bytes), np.uint8)
        at = 0
        for r in range(size):
            n = int(min(got[r], capacity - at))
            if n <= 0:
                continue
            s = int(plan.members[g, r])
            if s in site.slot_of:
                rows_s, _, starts = meet.inputs[site.slot_of[s]]
                out[at:at + n] = rows_s[starts[rt]:starts[rt] + n]
            else:
                k = recv_at[(t, r)]
                out[at:at + n] = recv[k:k + n]
            at += n
        out[at:] = 0
        meet.wait()
        return out.view(x.dtype).reshape((capacity, *x.shape[1:])), got.astype(np.int32)

    return body


def _joined(inputs: Sequence[Any], parts: Sequence[tuple[int, int, int]], row_bytes: int) -> np.ndarray:
    """Rows ``start:stop`` of input ``slot`` for each ``(slot, start, stop)``, one after another: a view when they
    follow each other in one input (one device per process), else a copy."""
    if not parts:
        return np.empty((0, row_bytes), np.uint8)
    slot = parts[0][0]
    if all(p[0] == slot for p in parts) and all(b[1] == a[2] for a, b in itertools.pairwise(parts)):
        return inputs[slot][0][parts[0][1]:parts[-1][2]]
    return np.concatenate([inputs[s][0][start:stop] for s, start, stop in parts])


def _slot_on(site: Site, pos: int) -> int:
    """Slot of mesh position ``pos`` on its own process (its index among that process's positions)."""
    same = np.flatnonzero(site.plan.process == site.plan.process[pos])
    return int(np.searchsorted(same, pos))
