"""The distributed side of friends-of-friends: boundary particles, label merging and group totals across devices.

After the z-order sort each device holds a compact piece of space, described by the replicated cell boxes of
:class:`shardax.particles.Domain`. A particle within the linking length of another device's cell boxes is sent there
as a *ghost* (only boundary particles travel; their number grows like the surface of the piece). Each device links
its own particles together with its ghosts, so every cross-device pair is seen on both sides. Labels then settle by
alternating two exchanges over the same routes (ghost to owner, owner to ghost) with a minimum over each local
component, until a global check says no label changed. A group touching a boundary is summed by the device
``label % ndev`` from the pieces each device sends it; the totals go back along the reverse route.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from ..comm import allreduce, alltoall, exchange
from ..core._vary import vary_like
from ..particles import Domain
from ._catalogue import Partial, combine, min_image

INT_MAX = jnp.iinfo(jnp.int32).max


class Halo(NamedTuple):
    """Routes of the ghost exchange: what this device sent, and the ghosts it received."""

    send_row: jax.Array  # (h,) own row of each sent copy
    send_dest: jax.Array  # (h,) destination rank of each sent copy
    send_num: jax.Array  # copies sent
    pos: jax.Array  # (h, d) ghost positions
    ids: jax.Array  # (h,) ghost ids
    src_row: jax.Array  # (h,) row of each ghost on its owner
    src_rank: jax.Array  # (h,) owner rank of each ghost
    num: jax.Array  # ghosts received
    needed: jax.Array  # rows the send or the receive side needed
    overflow: jax.Array


def exchange_columns(columns: dict[str, jax.Array], dest: jax.Array, *, num: jax.Array,
                     capacity: int) -> tuple[dict[str, jax.Array], jax.Array, jax.Array]:
    """:func:`shardax.comm.exchange` of several per-row arrays packed into one (fewer collectives to compile).

    Arrays of 32-bit dtypes travel as the columns of one int32 array (bit-exact); otherwise they travel as they are.
    """
    names = list(columns)
    arrays = [columns[k] for k in names]
    if not all(jnp.dtype(a.dtype).itemsize == 4 for a in arrays):
        return exchange(columns, dest, num=num, capacity=capacity)
    n = arrays[0].shape[0]
    packed = jnp.concatenate([lax.bitcast_convert_type(a, jnp.int32).reshape(n, -1) for a in arrays], axis=1)
    got, got_num, overflow = exchange({"packed": packed}, dest, num=num, capacity=capacity)
    out, at = {}, 0
    for name, a in zip(names, arrays, strict=True):
        width = 1 if a.ndim == 1 else a.shape[1]
        col = got["packed"][:, at:at + width].reshape((capacity, *a.shape[1:]))
        out[name] = lax.bitcast_convert_type(col, a.dtype)
        at += width
    return out, got_num, overflow


def _box_gap2(centre: jax.Array, half: jax.Array, other_centre: jax.Array, other_half: jax.Array,
              box: jax.Array | None) -> jax.Array:
    """Squared gap between boxes (or points: ``half = 0``) given by centres and half-widths `(..., d)`."""
    dx = jnp.abs(min_image(centre - other_centre, box))
    gap = jnp.maximum(dx - half - other_half, 0)
    return jnp.sum(gap * gap, axis=-1)


def exchange_ghosts(pos: jax.Array, ids: jax.Array, num: jax.Array, domain: Domain, linking_length: jax.Array,
                    box: jax.Array | None, rank: Any, size: int, capacity: int) -> Halo:
    """Send every own particle within the linking length of another device's cells to that device.

    Only the other devices' cells within reach of one of this device's own cells are tested against the particles
    (the few cells along the surface of this device's piece), one cell at a time.
    """
    n = pos.shape[0]
    valid = jnp.arange(n, dtype=jnp.int32) < num
    # A little slack: sending a far particle costs a row, missing a near one would cost a link.
    reach2 = (linking_length * (1 + 1e-4)) ** 2
    occupied = domain.cell_count > 0  # (size, M)
    lower = jnp.where(occupied[..., None], domain.cell_lower, 0).astype(pos.dtype)
    upper = jnp.where(occupied[..., None], domain.cell_upper, 0).astype(pos.dtype)
    centre, half = 0.5 * (lower + upper), 0.5 * (upper - lower)
    cells = occupied.shape[1]
    mine = jnp.arange(size, dtype=jnp.int32)[:, None] == rank

    def touches(m: jax.Array, hit: jax.Array) -> jax.Array:
        gap2 = _box_gap2(centre, half, centre[rank, m][None, None, :], half[rank, m][None, None, :], box)
        return hit | (occupied[rank, m] & (gap2 <= reach2))

    relevant = lax.fori_loop(0, cells, touches, vary_like(jnp.zeros(occupied.shape, bool), pos))
    relevant = relevant & occupied & ~mine
    (todo,) = jnp.nonzero(relevant.reshape(-1), size=size * cells, fill_value=0)
    todo = todo.astype(jnp.int32)

    def test_cell(i: jax.Array, near: jax.Array) -> jax.Array:
        r, m = todo[i] // cells, todo[i] % cells
        hit = _box_gap2(pos, jnp.zeros_like(pos), centre[r, m][None, :], half[r, m][None, :], box) <= reach2
        row = lax.dynamic_index_in_dim(near, r, keepdims=False) | (valid & hit)
        return lax.dynamic_update_index_in_dim(near, row, r, 0)

    near = lax.fori_loop(0, jnp.sum(relevant, dtype=jnp.int32), test_cell,
                         vary_like(jnp.zeros((size, n), bool), pos))
    per_dest = jnp.sum(near, axis=1, dtype=jnp.int32)
    send_num = jnp.sum(per_dest)
    (flat,) = jnp.nonzero(near.reshape(-1), size=capacity, fill_value=0)
    flat = flat.astype(jnp.int32)
    send_dest, send_row = flat // n, flat % n
    tree = {"pos": pos[send_row], "ids": ids[send_row], "row": send_row,
            "rank": jnp.full((capacity,), rank, jnp.int32)}
    got, got_num, overflow = exchange_columns(tree, send_dest, num=jnp.minimum(send_num, capacity),
                                              capacity=capacity)
    received = jnp.sum(alltoall(per_dest))
    return Halo(send_row, send_dest, jnp.minimum(send_num, capacity), got["pos"], got["ids"], got["row"],
                got["rank"], got_num, jnp.maximum(send_num, received), overflow | (send_num > capacity))


def segment_min_labels(labels: jax.Array, component: jax.Array) -> jax.Array:
    """Each row's label replaced by the smallest label of its component."""
    n = labels.shape[0]
    return jax.ops.segment_min(labels, component, n)[component]


def merge_labels(labels: jax.Array, component: jax.Array, halo: Halo, n: int, capacity: int) -> jax.Array:
    """Settle labels across devices: `(n + h,)` labels of own rows then ghosts, minimum over each global group."""
    ghost_valid = jnp.arange(capacity, dtype=jnp.int32) < halo.num

    def step(state: tuple[jax.Array, jax.Array]) -> tuple[jax.Array, jax.Array]:
        labels, _ = state
        old = labels
        back, back_num, _ = exchange_columns({"row": halo.src_row, "label": labels[n:]}, halo.src_rank,
                                             num=halo.num, capacity=capacity)
        live = jnp.arange(capacity, dtype=jnp.int32) < back_num
        own = labels[:n].at[jnp.where(live, back["row"], n)].min(back["label"], mode="drop")
        labels = segment_min_labels(jnp.concatenate([own, labels[n:]]), component)
        fwd, _, _ = exchange_columns({"label": labels[:n][halo.send_row]}, halo.send_dest, num=halo.send_num,
                                     capacity=capacity)
        ghosts = jnp.where(ghost_valid, jnp.minimum(labels[n:], fwd["label"]), INT_MAX)
        labels = segment_min_labels(jnp.concatenate([labels[:n], ghosts]), component)
        changed = allreduce(jnp.any(labels != old).astype(jnp.int32), "max")
        return labels, changed

    labels, _ = lax.while_loop(lambda s: s[1] > 0, step, (labels, jnp.int32(1)))
    return labels


def boundary_totals(parts: Partial, label: jax.Array, boundary: jax.Array, rank: Any, size: int, capacity: int,
                    box: jax.Array | None) -> tuple[jax.Array, Partial, jax.Array, jax.Array, jax.Array, jax.Array]:
    """Totals of the groups that cross devices, summed on device ``label % size``.

    Args:
        parts: per-component sums of this device's own members (`(N,)` rows).
        label: `(N,)` settled label of each component.
        boundary: `(N,)` components that hold own members and ghosts (pieces of groups crossing devices).
        rank: this device's rank.
        size: number of devices.
        capacity: rows of the exchanges (static).
        box: periodic box or None.

    Returns:
        ``(count, home, home_label, home_first, needed, overflow)``: ``count (N,)`` the total member count of each
        boundary component's group (0 elsewhere); ``home`` the combined sums of the groups this device is home to
        (`(capacity,)` rows, valid where ``home_first``), with ``home_label``; rows needed and an overflow flag.
    """
    big = label.shape[0]
    send_num = jnp.sum(boundary, dtype=jnp.int32)
    (sel,) = jnp.nonzero(boundary, size=capacity, fill_value=0)
    sel = sel.astype(jnp.int32)
    dest = label[sel] % size
    tree = {"label": label[sel], "src": sel, "rank": jnp.full((capacity,), rank, jnp.int32),
            **{f"p_{k}": v[sel] for k, v in parts._asdict().items()}}
    got, got_num, overflow = exchange_columns(tree, dest, num=jnp.minimum(send_num, capacity), capacity=capacity)
    per_dest = jnp.zeros((size,), jnp.int32).at[jnp.where(boundary, label % size, size)].add(1, mode="drop")
    received = jnp.sum(alltoall(per_dest))
    valid = jnp.arange(capacity, dtype=jnp.int32) < got_num
    got_label = jnp.where(valid, got["label"], INT_MAX)
    order = jnp.argsort(got_label, stable=True)
    sorted_label = got_label[order]
    new = jnp.concatenate([jnp.ones((1,), bool), sorted_label[1:] != sorted_label[:-1]])
    segment = jnp.cumsum(new.astype(jnp.int32)) - 1
    pieces = Partial(*(got[f"p_{k}"][order] for k in Partial._fields))
    home = combine(pieces, segment, valid[order], capacity, box)
    home_first = jnp.arange(capacity) < jnp.sum(new & valid[order])
    home_label = jnp.full((capacity,), INT_MAX, jnp.int32).at[segment].min(sorted_label)
    # Totals back to the senders of the pieces, along the reverse route.
    total = jnp.zeros((capacity,), jnp.int32).at[order].set(home.count[segment])
    back, back_num, back_overflow = exchange_columns({"src": got["src"], "count": total}, got["rank"],
                                                     num=got_num, capacity=capacity)
    live = jnp.arange(capacity, dtype=jnp.int32) < back_num
    count = jnp.zeros((big,), jnp.int32).at[jnp.where(live, back["src"], big)].set(back["count"], mode="drop")
    needed = jnp.maximum(send_num, received)
    return count, home, home_label, home_first, needed, overflow | back_overflow | (send_num > capacity)
