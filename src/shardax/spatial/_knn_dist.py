"""Distributed kNN: z-order sort, a bounding local pass, a ghost exchange limited to the bounds, results home.

1. ``zsort`` gives every device a compact piece of space (each row remembers its home device and row).
2. A local kNN over the device's own rows bounds each row's k-th distance from above.
3. Each device cuts its rows into at most ``chunks`` runs, the aligned blocks of the Morton grid at the finest level
   that holds its rows in that many (:func:`_aligned_runs`), and publishes each run's bounding box grown by the
   run's largest bound (an all-gather of ``(chunks, 2, d)`` per device). Runs of equal row counts would cross the
   curve's jumps: a run from the far corner of one octant into the next has a box over both.
4. Every device sends each of its rows to every other device whose grown boxes contain it (the rows any of that
   device's true neighbourhoods can reach): a surface layer, not the volume.
5. A second local kNN over own + received rows is exact; ``reduce`` runs on it, and the results travel home (or stay
   in z-order with the sorted particles, when asked).

On one device steps 2-4 are skipped: the sort and one local kNN (only used for z-order output).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from .._flags import gather_together
from .._morton import KeyBox, morton_key
from .._order import after
from .._pytree import replace_field, with_num
from .._zorder import sort_particles
from ..comm import allreduce, exchange
from ..core import rank_info
from ..particles import Particles
from ._grid import unwrapped_piece
from ._knn_local import PieceGrid, kth_distance_bound, local_knn
from ._knn_pass import positions_of
from ._knn_tuning import KnnTuning


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class _Carrier:
    """The rows that go through ``zsort``: positions, ids, home address and the user's per-particle leaves."""

    pos: jax.Array
    num: jax.Array
    ids: jax.Array
    home_rank: jax.Array
    home_row: jax.Array
    fields: tuple[jax.Array, ...]


def _inside(pos: jax.Array, lo: jax.Array, hi: jax.Array, box: jax.Array | None) -> jax.Array:
    """`(..., B)`: whether each row of `pos: (..., d)` lies in each box `[lo, hi]: (..., B, d)` (any periodic
    image)."""
    p = pos[..., None, :]
    lo, hi = (x.reshape((1,) * (p.ndim - x.ndim) + x.shape) for x in (lo, hi))
    hit = (p >= lo) & (p <= hi)
    if box is not None:
        b = box.reshape((1,) * (p.ndim - 1) + box.shape)
        hit = hit | ((p + b >= lo) & (p + b <= hi)) | ((p - b >= lo) & (p - b <= hi))
    return jnp.all(hit, axis=-1)


def _overlap(a: jax.Array, b: jax.Array, lo: jax.Array, hi: jax.Array, box: jax.Array | None) -> jax.Array:
    """`(R, B)`: whether a point of each box `[a, b]: (R, d)` may lie in each box `[lo, hi]: (B, d)` by
    :func:`_inside` (an image per axis; in floats, ``p >= a`` gives ``p + box >= a + box``: never too few)."""
    a, b, lo, hi = a[:, None, :], b[:, None, :], lo[None, :, :], hi[None, :, :]
    hit = (a <= hi) & (b >= lo)
    if box is not None:
        x = box[None, None, :]
        hit = hit | ((a + x <= hi) & (b + x >= lo)) | ((a - x <= hi) & (b - x >= lo))
    return jnp.all(hit, axis=-1)


# Remote boxes a run's rows are tested against (the grown boxes its own box meets); a run that meets more sends
# every row through the test against all boxes.
_RUN_BOXES = 48


def _destinations(zpos: jax.Array, run: jax.Array, lo: jax.Array, hi: jax.Array, boxes_lo: jax.Array,
                  boxes_hi: jax.Array, box: jax.Array | None, rank: jax.Array | int, size: int) -> jax.Array:
    """`(n, size)`: whether each row lies in a grown box `(size * chunks, d)` of each other device.

    A row can only lie in the boxes that its run's box ``[lo, hi]`` `(chunks, d)` meets, a few of the
    ``size * chunks``: each run lists those (at most ``_RUN_BOXES``, else every row takes the whole test) and its
    rows are tested against them only.
    """
    n = zpos.shape[0]
    chunks = lo.shape[0]
    owner = jnp.arange(size * chunks, dtype=jnp.int32) // chunks
    meets = _overlap(lo, hi, boxes_lo, boxes_hi, box) & (owner != rank)[None, :]
    width = min(_RUN_BOXES, size * chunks)
    listed = jax.vmap(lambda m: positions_of(m, width, size * chunks))(meets)  # (chunks, width), then a fill
    fits = jnp.max(jnp.sum(meets, axis=1)) <= width

    def listed_only() -> jax.Array:
        which = listed[run]  # (n, width)
        at = jnp.minimum(which, size * chunks - 1)
        hit = _inside(zpos, boxes_lo[at], boxes_hi[at], box) & (which < size * chunks)
        device = jnp.where(which < size * chunks, owner[at], size)
        return jnp.any(hit[:, :, None] & (device[:, :, None] == jnp.arange(size)[None, None, :]), axis=1)

    def every_box() -> jax.Array:
        return jnp.any(_inside(zpos, boxes_lo, boxes_hi, box).reshape(n, size, chunks), axis=-1)

    return lax.cond(fits, listed_only, every_box) & (jnp.arange(size) != rank)[None, :]


class Flags(NamedTuple):
    """Buffer checks of one device: the ghost buffer (``ghost_capacity``) and the z-order sort (the rows of ``part``)."""

    ghost_overflow: jax.Array
    ghost_needed: jax.Array
    sort_overflow: jax.Array
    sort_needed: jax.Array


class DistributedKnn(NamedTuple):
    distances: jax.Array
    indices: Any
    flags: Flags
    zpart: Any  # the z-sorted particles (``home=False``), else None


def default_ghost_capacity(n: int, size: int) -> int:
    """Ghost rows per device when ``ghost_capacity`` is not given: every other device's rows while that is at most
    65536, else twice the rows per device (at least 65536)."""
    return min((size - 1) * n, max(2 * n, 65536))


def distributed_knn(part: Any, pos: jax.Array, valid: jax.Array, ids: jax.Array, k: int, box: Any,
                    boxv: jax.Array | None, reduce: Callable[..., Any] | None, ghost_capacity: int | None,
                    home: bool = True, chunks: int = 64, tuning: KnnTuning | None = None) -> DistributedKnn:
    """The kNN of every valid row of ``part`` across all devices of the context (see the module docstring).

    Returns:
        distances `(n, k)` and indices (or ``reduce``'s output) aligned with the input rows (``home``) or with the
        rows of ``zpart``, the particles in z-order (``home=False``); the buffer :class:`Flags` of this device.
    """
    rank, size, _ = rank_info()
    n = pos.shape[0]
    capacity = ghost_capacity if ghost_capacity is not None else default_ghost_capacity(n, size)
    leaves, treedef = jax.tree.flatten(part)
    num_leaf = getattr(part, "num", None)
    row_leaf = [i for i, leaf in enumerate(leaves) if leaf is not num_leaf and jnp.ndim(leaf) >= 1
                and jnp.shape(leaf)[0] == n]
    rows = jnp.arange(n, dtype=jnp.int32)
    carrier = _Carrier(pos=pos, num=jnp.sum(valid, dtype=jnp.int32), ids=ids,
                       home_rank=jnp.full((n,), rank, jnp.int32), home_row=rows,
                       fields=tuple(jnp.asarray(leaves[i]) for i in row_leaf))
    # Rows must be packed before zsort (it reads the first `num` rows); invalid rows are moved behind them.
    order = jnp.argsort(~valid, stable=True)
    carrier = jax.tree.map(lambda x: x[order] if jnp.ndim(x) >= 1 and x.shape[0] == n else x, carrier)
    zsorted = sort_particles(carrier, box=box, equalize=True)
    sorted_rows = zsorted.part
    zpos, znum, zids = sorted_rows.pos, sorted_rows.num, sorted_rows.ids
    zvalid = rows < znum
    zleaves = list(leaves)
    for i, field in zip(row_leaf, sorted_rows.fields, strict=True):
        zleaves[i] = field
    no = jnp.zeros((), bool)
    if size == 1:
        # (the neighbours' ids: local_knn answers with the labels it is given as `order`, -1 where none)
        dist2, indices = local_knn(zpos, zvalid, zpos, zvalid, zids, k=k, box=boxv, tuning=tuning)
        wanted, received, ghost_overflow = jnp.int32(0), jnp.int32(0), no
    else:
        runs = _aligned_runs(zpos, znum, zsorted.key_box, chunks)
        dist2, indices, wanted, received, ghost_overflow = _with_ghosts(zpos, zvalid, zids, k, boxv, capacity, runs,
                                                                        chunks, tuning)
    distances = jnp.sqrt(dist2)
    # The user's pytree in z-order (what ``reduce`` sees, and with ``ids`` what ``home=False`` returns).
    zpart = jax.tree.unflatten(treedef, zleaves)
    if num_leaf is not None:
        zpart = with_num(zpart, znum)
    if reduce is not None:
        indices = reduce(distances=distances, indices=indices, part=zpart)
    flags = Flags(ghost_overflow | (wanted > capacity), jnp.maximum(wanted, received), zsorted.overflow,
                  zsorted.needed)
    if not home:
        zpart = replace_field(zpart, "ids", zids) if hasattr(part, "pos") else Particles(pos=zpos, num=znum, ids=zids)
        return DistributedKnn(distances, indices, flags, zpart)

    # Home: every result row back to the device and row it came from.
    # (its counts after the search: they depend only on the sort, and would be exchanged while the devices search)
    back, _, home_overflow = exchange({"d": distances, "v": indices, "row": sorted_rows.home_row},
                                      sorted_rows.home_rank, num=after(znum, distances), capacity=n)
    target = jnp.where(jnp.arange(n) < jnp.sum(valid), back["row"], n)
    distances = jnp.full_like(distances, jnp.inf).at[target].set(back["d"], mode="drop")
    indices = jax.tree.map(lambda v: jnp.zeros_like(v).at[target].set(v, mode="drop"), back["v"])
    if reduce is None:
        indices = jnp.where(valid[:, None], indices, -1)
    # The trip home cannot overflow unless the sort lost rows (reported as a sort overflow).
    flags = flags._replace(sort_overflow=flags.sort_overflow | home_overflow)
    return DistributedKnn(distances, indices, flags, None)


def _aligned_runs(zpos: jax.Array, znum: jax.Array, kbox: KeyBox, chunks: int) -> jax.Array:
    """`(n,)` int32 run of each z-sorted row, in ``[0, chunks)``: the aligned blocks of Morton keys (``2**s`` keys
    each) at the smallest ``s`` that puts the ``znum`` valid rows into at most ``chunks`` blocks, numbered in order.

    A new block starts at a row whose key differs from the previous row's in bit ``s`` or above, so ``s`` is read
    from a histogram of the highest differing bit of neighbouring keys. Any grouping keeps the search exact (the
    boxes are those of the rows a run holds); aligned blocks keep the boxes as small as the blocks' rows.
    """
    n = zpos.shape[0]
    rows = jnp.arange(n, dtype=jnp.int32)
    hi, lo = morton_key(zpos, kbox, rows < znum)
    if n < 2:
        return jnp.zeros((n,), jnp.int32)
    hi_diff, lo_diff = hi[1:] ^ hi[:-1], lo[1:] ^ lo[:-1]
    # lax.clz(0) is 32: equal keys give -1.
    top = jnp.where(hi_diff != 0, 63 - lax.clz(hi_diff).astype(jnp.int32), 31 - lax.clz(lo_diff).astype(jnp.int32))
    top = jnp.where(rows[1:] < znum, top, -1)
    per_bit = jnp.zeros((64,), jnp.int32).at[jnp.where(top >= 0, top, 64)].add(1, mode="drop")
    starts_at_or_above = jnp.cumsum(per_bit[::-1])[::-1]  # block starts at shift s: rows whose top bit >= s
    shift = jnp.sum(1 + starts_at_or_above > chunks, dtype=jnp.int32)
    return jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(top >= shift, dtype=jnp.int32)])


def _with_ghosts(zpos: jax.Array, zvalid: jax.Array, zids: jax.Array, k: int, boxv: jax.Array | None,
                 capacity: int, run: jax.Array, chunks: int, tuning: KnnTuning | None
                 ) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array, jax.Array]:
    """Steps 2-5 on z-sorted rows cut into ``run`` s: bound, exchange the ghost layer, exact kNN over own + ghost
    rows."""
    rank, size, _ = rank_info()
    n, dim = zpos.shape

    big = jnp.asarray(jnp.inf, zpos.dtype)
    lo = jax.ops.segment_min(jnp.where(zvalid[:, None], zpos, big), run, num_segments=chunks)
    hi = jax.ops.segment_max(jnp.where(zvalid[:, None], zpos, -big), run, num_segments=chunks)
    occupied = hi[:, 0] >= lo[:, 0]
    # Bounding pass on own rows only: the true k-th distance is at most this one. (Any grid gives a bound; in a
    # periodic box, one over this device's piece rather than the whole box, whose cells would hold size-fold more.)
    own = None if boxv is None else _piece(zpos, zvalid, n, boxv, jnp.zeros((), zpos.dtype), lo, hi, occupied)
    radius = jnp.sqrt(kth_distance_bound(zpos, zvalid, k=k, box=boxv, tuning=tuning, piece=own))
    grow = jax.ops.segment_max(jnp.where(zvalid, radius, -big), run, num_segments=chunks)
    boxes_lo, boxes_hi = (b.reshape(size * chunks, dim) for b in gather_together([lo - grow[:, None],
                                                                                   hi + grow[:, None]]))
    to = _destinations(zpos, run, lo, hi, boxes_lo, boxes_hi, boxv, rank, size) & zvalid[:, None]

    pairs = to.T.reshape(-1)
    wanted = jnp.sum(pairs, dtype=jnp.int32)
    received = allreduce(jnp.sum(to, axis=0, dtype=jnp.int32))[rank]
    picked = positions_of(pairs, capacity, size * n)
    src = picked % n
    # (the exchange after that count: collectives that do not depend on each other could run in different orders)
    ghosts, ghost_num, ghost_overflow = exchange({"pos": zpos[src], "ids": zids[src]}, picked // n,
                                                 num=after(jnp.minimum(wanted, capacity), received),
                                                 capacity=capacity)
    all_pos = jnp.concatenate([zpos, ghosts["pos"]])
    all_valid = jnp.concatenate([zvalid, jnp.arange(capacity) < ghost_num])
    all_ids = jnp.concatenate([zids, jnp.where(all_valid[n:], ghosts["ids"], jnp.iinfo(jnp.int32).max)])
    # Every query's neighbours lie within its run's bound, in the run's grown box: the grid covers those boxes.
    piece = None if boxv is None else _piece(all_pos, all_valid, n, boxv, jnp.max(jnp.where(occupied, grow, 0)),
                                             lo - grow[:, None], hi + grow[:, None], occupied)
    dist2, indices = local_knn(all_pos, all_valid, zpos, zvalid, all_ids, k=k, box=boxv, tuning=tuning, piece=piece)
    return dist2, indices, wanted, received, ghost_overflow


def _piece(pos: jax.Array, valid: jax.Array, queries: int, box: jax.Array, reach: jax.Array,
           lower: jax.Array, upper: jax.Array, occupied: jax.Array) -> PieceGrid:
    """The grid over this device's piece of the periodic box: data ``pos`` (its first ``queries`` rows are the
    queries), every neighbour searched for within ``reach``, the piece inside the boxes ``[lower, upper]``."""
    piece = unwrapped_piece(pos, valid, box, reach, lower, upper, occupied)
    return PieceGrid(piece.domain.lo, piece.domain.extent, piece.wrap, piece.grid_pos,
                     piece.grid_pos[:queries])
