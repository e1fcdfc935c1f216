"""The distributed side of friends-of-friends: boundary particles, label merging and group totals across devices.

After the z-order sort each device holds a compact piece of space, described by the replicated boxes of a few
runs of its rows (:func:`piece_cells`). A particle within the linking length of another device's cell boxes is sent there
as a *ghost* (only boundary particles travel; their number grows like the surface of the piece). Each device links
its own particles together with its ghosts, so every cross-device pair is seen on both sides. Labels then settle by
alternating two exchanges over the same routes (ghost to owner, owner to ghost) with a minimum over each local
component, until a global check says no label changed; these exchanges follow the fixed routes of the ghosts and
need no sorting. A group touching a boundary is summed by the device
``label % ndev`` from the pieces each device sends it; the totals go back along the reverse route.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from .._alltoallv import alltoallv_many, exchange_counts_and_max
from .._exchange import Chunk
from .._nonzero import true_positions
from .._wordsort import sort_words
from ..comm import allgather, allreduce, group_by_rank
from ..core import resolve_axes, vary_like
from ._catalogue import Partial, combine, min_image

INT_MAX = jnp.iinfo(jnp.int32).max


class Pieces(NamedTuple):
    """Every device's piece of space as a few boxes over runs of its z-sorted rows (replicated).

    ``start (size, m)`` first row and ``count (size, m)`` rows of each run (a cell of the Morton grid, so a run is
    compact in space), ``lower``/``upper (size, m, d)`` the bounding box of its particles.
    """

    start: jax.Array
    count: jax.Array
    lower: jax.Array
    upper: jax.Array


class Ghosts(NamedTuple):
    """Routes of the ghost exchange: what this device sent, and the ghosts it received.

    The send list is grouped by destination rank and the ghosts arrive grouped by owner rank, each group in the
    order it was sent, so a column travels either way along these routes without any sorting
    (:func:`send_grouped` with ``send_counts`` or ``recv_counts``), and what comes back lines up with the rows
    that went out.
    """

    send_row: jax.Array  # (h,) own row of each sent copy
    send_dest: jax.Array  # (h,) destination rank of each sent copy
    send_num: jax.Array  # copies sent
    send_counts: jax.Array  # (size,) copies sent to each rank
    pos: jax.Array  # (h, d) ghost positions
    ids: jax.Array  # (h,) ghost ids
    num: jax.Array  # ghosts received
    recv_counts: jax.Array  # (size,) ghosts received from each rank
    largest: jax.Array  # the largest count any rank sent another rank (the rounds of an exchange over these routes)
    needed: jax.Array  # rows the send or the receive side needed
    overflow: jax.Array
    steps: jax.Array  # loop steps of the selection of the rows to send


def boundary_chunk(capacity: int, size: int) -> int:
    """Rows per device pair and round for the exchanges of boundary rows: ghosts, their labels and the pieces of
    groups that cross devices.

    Their traffic goes to a few neighbouring devices in amounts that depend on the data. One size,
    ``2 * capacity / size`` rows per device pair (all of ``capacity`` on two devices), moves it in one round (each
    round is a collective: milliseconds across processes) while a round's buffers stay within about twice the
    ``capacity`` receive buffer on any number of devices; a device sending more than that to one neighbour takes a
    few rounds. A second, smaller size (a ladder, :func:`~shardax.comm.chunk_ladder`) would move fewer rows when the
    traffic is light, but every size compiles each exchange's loop once more, and the rows it would save are a small
    part of FoF's time.
    """
    return min(capacity, max(1, -(-2 * capacity // size)))


def send_grouped(columns: dict[str, jax.Array], counts: jax.Array, *, capacity: int,
                 perm: jax.Array | None = None, plan: tuple[jax.Array, jax.Array] | None = None,
                 chunk: Chunk = None) -> tuple[dict[str, jax.Array], jax.Array, jax.Array]:
    """Send rows already grouped by destination rank (``counts (size,)`` rows for each rank, in rank order; or
    row ``perm[i]`` as the ``i``-th) to their ranks.

    One ``alltoallv`` for all columns (it packs the 4- and 8-byte ones into one block per round). ``plan``:
    ``(recv_counts, largest)`` when the route is known (no count exchange). ``chunk``: rows per rank pair and round
    (default ``alltoallv``'s, sized for a sort's memory; :func:`~shardax._exchange.share_chunk` for one
    round of a whole share; :func:`boundary_chunk` for boundary traffic).
    Returns ``(columns, recv_counts, overflow)``: ``capacity`` rows grouped by source rank, each source's rows in
    the order they were sent.
    """
    names = list(columns)
    axes = resolve_axes(None)
    outs, recv_counts, overflow = alltoallv_many([columns[k] for k in names], counts, capacity, axes, "auto",
                                                 chunk, perm=perm, plan=plan)
    return dict(zip(names, outs, strict=True)), recv_counts, overflow


def exchange_columns(columns: dict[str, jax.Array], dest: jax.Array, *, num: jax.Array, size: int,
                     capacity: int, chunk: Chunk = None
                     ) -> tuple[dict[str, jax.Array], jax.Array, jax.Array, jax.Array, tuple[jax.Array, jax.Array]]:
    """Send each of the first ``num`` rows of the columns to rank ``dest[i]``.

    Returns ``(columns, recv_counts, overflow, perm, back_plan)``: as :func:`send_grouped`, the order the rows were
    sent in, and the plan of the reverse route: what comes back along it, ``send_grouped(..., recv_counts,
    plan=back_plan)`` (no count exchange), lines up with ``perm``.
    """
    rows = jnp.arange(dest.shape[0], dtype=jnp.int32)
    perm, counts = group_by_rank(jnp.where(rows < num, dest, size), size, host=True)
    recv_counts, largest = exchange_counts_and_max(counts, resolve_axes(None))
    out, _, overflow = send_grouped(columns, counts, capacity=capacity, perm=perm, plan=(recv_counts, largest),
                                    chunk=chunk)
    return out, recv_counts, overflow, perm, (counts, largest)


def piece_cells(pos: jax.Array, num: jax.Array, origin: jax.Array, extent: jax.Array,
                cells: int) -> Pieces:
    """At most ``cells`` compact runs of z-sorted rows per device, with their bounding boxes (gathered).

    Runs are the cells of the finest Morton level (at most 10) that cuts this device's rows into at most ``cells``
    runs. Two consecutive rows lie in different cells of level ``l`` when their grid coordinates at level 10 differ
    in one of the top ``l`` bits, so no key is recomputed.
    """
    n, dim = pos.shape
    levels = 10
    rows = jnp.arange(n, dtype=jnp.int32)
    valid = rows < num
    scale = jnp.asarray(float(1 << levels), pos.dtype) / extent
    grid = jnp.clip(jnp.floor((pos - origin[None, :]) * scale[None, :]), 0, (1 << levels) - 1).astype(jnp.int32)
    differ = jnp.bitwise_or.reduce(grid[1:] ^ grid[:-1], axis=1) if dim > 1 else grid[1:, 0] ^ grid[:-1, 0]
    split = lax.clz(differ) - (32 - levels)  # common leading bits of all coordinates (levels if equal)
    boundary = rows[1:] < num
    # Counts by comparison, not by a scatter-add: nearly every row falls in the last level or two (or in the
    # padding's bin), and adds piling onto one address serialise on a GPU.
    hist = jnp.sum(jnp.where(boundary, split, levels + 1)[:, None] == jnp.arange(levels, dtype=jnp.int32)[None, :],
                   axis=0, dtype=jnp.int32)
    runs_at = 1 + jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(hist)])
    level = jnp.sum(runs_at <= cells).astype(jnp.int32) - 1
    new = jnp.concatenate([jnp.zeros((1,), bool), boundary & (split < level)])
    run = jnp.where(valid, jnp.cumsum(new.astype(jnp.int32)), cells)
    # Runs are consecutive rows numbered 0, 1, ...: each run's first row writes its start (distinct addresses),
    # runs past the last start at ``num``, and a run's count is the gap to the next start.
    opens = valid & jnp.concatenate([jnp.ones((1,), bool), new[1:]])
    start = jnp.full((cells + 1,), num, jnp.int32).at[jnp.where(opens, run, cells + 1)].set(rows, mode="drop")
    count = start[1:] - start[:-1]
    start = start[:cells]
    big = jnp.asarray(jnp.inf, pos.dtype)
    lower = jax.ops.segment_min(jnp.where(valid[:, None], pos, big), run, cells + 1, indices_are_sorted=True)
    upper = jax.ops.segment_max(jnp.where(valid[:, None], pos, -big), run, cells + 1, indices_are_sorted=True)
    table = jnp.concatenate([lax.bitcast_convert_type(jnp.stack([start, count], axis=1), pos.dtype)
                             if pos.dtype.itemsize == 4 else jnp.stack([start, count], axis=1).astype(pos.dtype),
                             lower[:cells], upper[:cells]], axis=1)
    table = allgather(table)  # (size, cells, 2 + 2d): one collective
    ints = table[..., :2]
    ints = lax.bitcast_convert_type(ints, jnp.int32) if pos.dtype.itemsize == 4 else ints.astype(jnp.int32)
    return Pieces(ints[..., 0], ints[..., 1], table[..., 2:2 + dim], table[..., 2 + dim:])


def _box_gap2(centre: jax.Array, half: jax.Array, other_centre: jax.Array, other_half: jax.Array,
              box: jax.Array | None) -> jax.Array:
    """Squared gap between boxes (or points: ``half = 0``) given by centres and half-widths `(..., d)`."""
    dx = jnp.abs(min_image(centre - other_centre, box))
    gap = jnp.maximum(dx - half - other_half, 0)
    return jnp.sum(gap * gap, axis=-1)


class _Selection(NamedTuple):
    """Carry of the ghost selection: the (own cell, device, cell) pair being tested, and which own rows are near
    which device (`(size * n,)` bool)."""

    pair: jax.Array
    near: jax.Array


def exchange_ghosts(pos: jax.Array, ids: jax.Array, pieces: Pieces, linking_length: jax.Array,
                    box: jax.Array | None, rank: Any, size: int, capacity: int, chunk: int = 512) -> Ghosts:
    """Send every own particle within the linking length of another device's piece (its cell boxes) there.

    Own cells are runs of rows (the particles are in z-order), so only the pairs of an own cell and another
    device's cell within reach of it are tested, a ``chunk`` of the own cell's rows at a time: the work is the
    particles near the surface of this device's piece times the few cells across it, not every particle times
    every cell of the surface.

    ``chunk``: rows tested per loop step (``FofTuning.ghost_chunk``). Each step has a fixed overhead on XLA:CPU, so
    larger steps are cheaper up to a point, past which XLA's per-step code gets much slower (the CPU preset keeps
    away from that edge). On a GPU a step costs a fixed fraction of a millisecond whatever it holds, so its preset
    tests a cell's rows in one step.
    """
    n, dim = pos.shape
    # A little slack: sending a far particle costs a row, missing a near one would cost a link.
    reach2 = (linking_length * (1 + 1e-4)) ** 2
    occupied = pieces.count > 0  # (size, M)
    lower = jnp.where(occupied[..., None], pieces.lower, 0).astype(pos.dtype)
    upper = jnp.where(occupied[..., None], pieces.upper, 0).astype(pos.dtype)
    centre, half = 0.5 * (lower + upper), 0.5 * (upper - lower)
    cells = occupied.shape[1]
    start = jnp.where(occupied[rank], pieces.start[rank], 0)
    count = pieces.count[rank]

    # (own cell, other device, its cell) within reach of each other.
    gap2 = _box_gap2(centre[rank][:, None, None, :], half[rank][:, None, None, :], centre[None], half[None], box)
    other = jnp.arange(size, dtype=jnp.int32)[None, :, None] != rank
    pairs = (gap2 <= reach2) & occupied[rank][:, None, None] & occupied[None] & other
    num_pairs = jnp.sum(pairs, dtype=jnp.int32)
    todo = true_positions(pairs.reshape(-1), pairs.size, 0)
    todo = todo.astype(jnp.int32)
    mine, dest, theirs = todo // (size * cells), todo // cells % size, todo % cells
    steps = jnp.where(jnp.arange(pairs.size) < num_pairs, (count[mine] + chunk - 1) // chunk, 0)
    steps_end = jnp.cumsum(steps)
    lanes = jnp.arange(chunk, dtype=jnp.int32)
    pos_pad = jnp.concatenate([pos, jnp.zeros((chunk, dim), pos.dtype)])

    def test_chunk(t: jax.Array, state: _Selection) -> _Selection:
        # Step t tests a chunk of pair p, the first pair with steps_end[p] > t. Every pair takes at least one step,
        # so p moves on by at most one pair per step: carried, not searched for (a binary search per step was
        # measurable on XLA:CPU, where each loop step costs microseconds).
        p = jnp.where(t >= steps_end[state.pair], state.pair + 1, state.pair)
        m, r, k = mine[p], dest[p], theirs[p]
        first = start[m] + (t - (steps_end[p] - steps[p])) * chunk
        rows = first + lanes
        block = lax.dynamic_slice_in_dim(pos_pad, first, chunk)
        hit = _box_gap2(block, jnp.zeros_like(block), centre[r, k][None, :], half[r, k][None, :], box) <= reach2
        hit = hit & (rows < start[m] + count[m])
        return _Selection(p, state.near.at[jnp.where(hit, r * n + rows, size * n)].set(True, mode="drop"))

    selected = lax.fori_loop(0, steps_end[-1], test_chunk,
                             vary_like(_Selection(jnp.int32(0), jnp.zeros((size * n,), bool)), pos))
    near = selected.near.reshape(size, n)
    per_dest = jnp.sum(near, axis=1, dtype=jnp.int32)
    send_num = jnp.sum(per_dest)
    # The copies in (destination, row) order, in two compactions: the rows near any other device, then their copies.
    # One compaction over all ``size * n`` pairs costs several times more on XLA:CPU (a scan over every pair).
    # Past ``capacity`` rows the copies overflow anyway.
    near_rows = true_positions(jnp.any(near, axis=0), capacity, n)
    copies = jnp.take(near, near_rows, axis=1, mode="fill", fill_value=False)  # (size, capacity)
    flat = true_positions(copies.reshape(-1), capacity, 0)
    flat = flat.astype(jnp.int32)
    send_dest, send_row = flat // capacity, jnp.minimum(near_rows[flat % capacity], n - 1).astype(jnp.int32)
    # Copies past the capacity are not sent (overflow); the counts say what went to each rank.
    send_counts = jnp.clip(capacity - (jnp.cumsum(per_dest) - per_dest), 0, per_dest)
    # The routes' plan is kept: the label exchanges travel the same routes (either way) with no count exchange.
    recv_counts, largest = exchange_counts_and_max(send_counts, resolve_axes(None))
    got, _, overflow = send_grouped({"pos": pos[send_row], "ids": ids[send_row]}, send_counts, capacity=capacity,
                                    plan=(recv_counts, largest), chunk=boundary_chunk(capacity, size))
    received = jnp.sum(recv_counts)
    return Ghosts(send_row, send_dest, jnp.minimum(send_num, capacity), send_counts, got["pos"], got["ids"],
                jnp.minimum(received, capacity), recv_counts, largest, jnp.maximum(send_num, received),
                overflow | (send_num > capacity), steps_end[-1])


def segment_min_labels(labels: jax.Array, component: jax.Array) -> jax.Array:
    """Each row's label replaced by the smallest label of its component."""
    n = labels.shape[0]
    return jax.ops.segment_min(labels, component, n)[component]


class _Merge(NamedTuple):
    """Carry of the label merge: labels of own rows then ghosts, whether a round changed any label anywhere, and
    the rounds so far."""

    labels: jax.Array
    changed: jax.Array
    rounds: jax.Array


def merge_labels(labels: jax.Array, component: jax.Array, ghosts: Ghosts, n: int,
                 capacity: int) -> tuple[jax.Array, jax.Array]:
    """Settle labels across devices: `(n + h,)` labels of own rows then ghosts, minimum over each global group, and
    the number of rounds it took.

    Each round sends the ghosts' labels back to their owners and the owners' labels out to their ghosts, along the
    fixed routes of the ghost exchange (no sorting), with a minimum over each local component after each.
    """
    ghost_valid = jnp.arange(capacity, dtype=jnp.int32) < ghosts.num
    sent = jnp.arange(capacity, dtype=jnp.int32) < ghosts.send_num
    chunk = boundary_chunk(capacity, ghosts.send_counts.shape[0])

    def round_trip(state: _Merge) -> _Merge:
        labels = state.labels
        back, _, _ = send_grouped({"label": labels[n:]}, ghosts.recv_counts, capacity=capacity,
                                  plan=(ghosts.send_counts, ghosts.largest), chunk=chunk)
        own = labels[:n].at[jnp.where(sent, ghosts.send_row, n)].min(back["label"], mode="drop")
        labels = segment_min_labels(jnp.concatenate([own, labels[n:]]), component)
        fwd, _, _ = send_grouped({"label": labels[:n][ghosts.send_row]}, ghosts.send_counts, capacity=capacity,
                                 plan=(ghosts.recv_counts, ghosts.largest), chunk=chunk)
        ghost_labels = jnp.where(ghost_valid, jnp.minimum(labels[n:], fwd["label"]), INT_MAX)
        labels = segment_min_labels(jnp.concatenate([labels[:n], ghost_labels]), component)
        changed = allreduce(jnp.any(labels != state.labels).astype(jnp.int32), "max")
        return _Merge(labels, changed, state.rounds + 1)

    done = lax.while_loop(lambda s: s.changed > 0, round_trip, _Merge(labels, jnp.int32(1), jnp.int32(0)))
    return done.labels, done.rounds


def boundary_totals(parts: Partial | jax.Array, label: jax.Array, boundary: jax.Array, rank: Any, size: int,
                    capacity: int, box: jax.Array | None
                    ) -> tuple[jax.Array, Partial | None, jax.Array, jax.Array, jax.Array, jax.Array]:
    """Totals of the groups that cross devices, summed on device ``label % size``.

    Args:
        parts: per-component sums of this device's own members (`(N,)` rows), or only their `(N,)` member counts
            (labels only: ``home`` is then None).
        label: `(N,)` settled label of each component.
        boundary: `(N,)` components that hold own members and ghosts (pieces of groups crossing devices).
        rank: this device's rank.
        size: number of devices.
        capacity: rows of the exchanges (static).
        box: periodic box or None.

    Returns:
        ``(count, home, home_label, home_first, needed, overflow)``: ``count (N,)`` the total member count of each
        boundary component's group (0 elsewhere); ``home`` the combined sums of the groups this device is home to
        (`(capacity,)` rows, valid where ``home_first``; None when ``parts`` holds only counts), with
        ``home_label``; rows needed and an overflow flag.
    """
    big = label.shape[0]
    send_num = jnp.sum(boundary, dtype=jnp.int32)
    sel = true_positions(boundary, capacity, 0)
    sel = sel.astype(jnp.int32)
    sums = isinstance(parts, Partial)  # else only the member counts travel
    fields = parts._asdict() if sums else {"count": parts}
    tree = {"label": label[sel], **{f"p_{k}": v[sel] for k, v in fields.items()}}
    got, recv_counts, overflow, perm, back_plan = exchange_columns(
        tree, label[sel] % size, num=jnp.minimum(send_num, capacity), size=size, capacity=capacity,
        chunk=boundary_chunk(capacity, size))
    received = jnp.sum(recv_counts)
    got_num = jnp.minimum(received, capacity)
    valid = jnp.arange(capacity, dtype=jnp.int32) < got_num
    got_label = jnp.where(valid, got["label"], INT_MAX)
    sorted_label, order = sort_words(got_label)  # labels >= 0
    new = jnp.concatenate([jnp.ones((1,), bool), sorted_label[1:] != sorted_label[:-1]])
    segment = jnp.cumsum(new.astype(jnp.int32)) - 1
    if sums:
        pieces = Partial(*(got[f"p_{k}"][order] for k in Partial._fields))
        home: Partial | None = combine(pieces, segment, valid[order], capacity, box)
        home_count = home.count
    else:
        home = None
        home_count = jax.ops.segment_sum(jnp.where(valid[order], got["p_count"][order], 0), segment, capacity)
    home_first = jnp.arange(capacity) < jnp.sum(new & valid[order])
    home_label = jnp.full((capacity,), INT_MAX, jnp.int32).at[segment].min(sorted_label)
    # Totals back to the senders of the pieces along the reverse route: they arrive in the order sent (``perm``).
    total = jnp.zeros((capacity,), jnp.int32).at[order].set(home_count[segment])
    back, _, back_overflow = send_grouped({"count": total}, recv_counts, capacity=capacity, plan=back_plan,
                                          chunk=boundary_chunk(capacity, size))
    live = jnp.arange(capacity, dtype=jnp.int32) < jnp.minimum(send_num, capacity)
    count = jnp.zeros((big,), jnp.int32).at[jnp.where(live, sel[perm], big)].set(back["count"], mode="drop")
    needed = jnp.maximum(send_num, received)
    return count, home, home_label, home_first, needed, overflow | back_overflow | (send_num > capacity)
