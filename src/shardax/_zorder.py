"""The local z-order sort engine: particles into global Morton (z-) order across the devices of the context.

Shared by ``sx.particles.zsort`` and the spatial kernels: kNN sorts with :func:`sort_particles`, FoF with
:func:`bucket_sort`. Both take the same steps up to the point where data moves:

1. **key** (:func:`_keyed`): each device computes its rows' Morton keys (two uint32 words) and the tie words that
   order equal keys by global input order (rank, then row), so that duplicate keys (even every particle at one
   point) are split like distinct ones;
2. **split** (:func:`_splitters`): every device draws stratified random samples of its rows, and all devices agree
   on ``ndev - 1`` splitters ``(key, tie...)`` by weighted quantiles of the gathered samples (one all-gather, which
   also carries every device's count and non-finite rows); :func:`bucket_sort` moves each splitter to a coarse
   Morton cell boundary nearby (:func:`_snapped`), which leaves the pieces of space less surface;
3. **bucket** (:func:`_buckets`): each row's bucket (a key range) by comparisons or a binary search over the
   splitters, the rows grouped by bucket, and every device's send counts in one all-gather: the plan of every
   exchange that follows.

Then they move the data in one of two ways:

- :func:`sort_particles` (``zsort``, kNN) moves the keys first: only the keys go to their bucket's device, which
  sorts them and so knows each key's global position; the positions go back along the reverse routes to the rows'
  senders (where they increase along the sender's sorted order); each sender then sends every row straight to its
  final device and row: the bucket's device, or with ``equalize`` the device holding that position when the sorted
  sequence is cut into ``num_total / ndev`` (+-1) pieces. Per device it holds the input, the output and a few int32
  words per row (the public ``zsort`` promises a peak under 3x the particle data), at the price of three exchanges
  (keys, positions, rows).
- :func:`bucket_sort` (FoF) moves the rows once: the rows themselves go to their bucket's device, which keys them
  again and sorts them. One exchange of the rows, in as few rounds as the traffic allows, and its routes bring
  per-row results back to the input rows without a sort; but the received rows and their sorted copy are held
  together (about 2x the particle data on top of the input) and the device counts are the buckets' (no
  equalising).

Why two, not one: the public ``zsort`` and kNN need the equal counts and the memory bound of the first, which the
second cannot give (compiled peak per device on 8 devices: 2.91x the particle buffers for :func:`sort_particles`,
5.90x for :func:`bucket_sort`); FoF on the first instead (the same snapped splitters, its routes, host sorts and
eight times larger rounds) gives the same labels but ran 1.15x slower on 2 processes x 4 CPU devices and 0.97x-1.22x
on 8 devices of one process (1e5 uniform points, linking length 0.2 of the mean spacing; see docs/particles.md):
every exchange round between processes is a collective with milliseconds of latency. On one device both are one
local sort (:func:`_one_device`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from ._alltoallv import alltoallv_many
from ._exchange import default_chunk, share_chunk
from ._morton import Box, KeyBox, key_box, morton_key, wrap
from ._pytree import check_positions, is_row_leaf, with_num
from ._wordsort import argsort_keys
from .comm import allgather, allreduce, count_by_rank, group_by_rank
from .core import rank_info, resolve_axes


class Routes(NamedTuple):
    """How the rows moved in :func:`bucket_sort`, for sending per-row results back to the rows they came from
    without sorting (several devices only).

    Sender side: ``perm (n,)`` the order the rows left in (``sent (size,)`` rows to each device, in rank order: row
    ``perm[k]`` was the ``k``-th). Receiver side: ``received (size,)`` rows that came from each device, and ``back
    (cap,)`` the held rows regrouped by sender, each sender's in the order it sent them. ``largest``: the largest
    count any device sent another device (the same everywhere). So an exchange of ``column[back]`` with send counts
    ``received`` (and ``plan=(sent, largest)``: no count exchange) gives each sender its rows' values packed by
    device in the order ``perm``.
    """

    perm: jax.Array
    sent: jax.Array
    received: jax.Array
    back: jax.Array
    largest: jax.Array


class Sorted(NamedTuple):
    """A device's share of the sort, and what callers report or send back with.

    ``part``: this device's particles in z-order (row leaves of ``capacity`` rows, ``num`` the rows held);
    ``overflow``: this device needed more than ``capacity`` rows at some step (rows were lost); ``needed``: the rows
    it needed; ``nonfinite``: rows with a NaN or infinite coordinate on all devices; ``key_box``: the box the keys
    were computed over; ``worst``: the largest ``needed`` over all devices (the same on every device); ``routes``:
    the :class:`Routes` of :func:`bucket_sort` on several devices; ``index``: `(capacity,)` int32 the global input
    index of each held row (:func:`bucket_sort` with ``number``).
    """

    part: Any
    overflow: jax.Array
    needed: jax.Array
    nonfinite: jax.Array
    key_box: KeyBox
    worst: jax.Array
    routes: Routes | None = None
    index: jax.Array | None = None


def check_capacity(capacity: Any, name: str = "capacity") -> int:
    if not isinstance(capacity, int) or isinstance(capacity, bool) or capacity < 1:
        raise ValueError(f"{name} must be a positive Python int (rows per device), got {capacity!r}")
    return capacity


_DIRECT_MAX_SPLITTERS = 32
# How far :func:`bucket_sort` may move a splitter to a coarser cell boundary, as a fraction of a device's share.
_SNAP = 0.04
_SNAP_SAMPLES = 64  # samples searched on either side of a splitter for a coarser boundary
# Ties between equal keys are split by one word ``rank * n + row`` below this many rows in all, else by two.
_ONE_WORD_TIES = 2**31
# Rows per rank pair and round of the key exchange and of the positions' way back, in units of ``default_chunk``
# (the rows exchange's: about six rounds for near-balanced traffic). The keys are computed from the positions as they
# are sent, so that no copy of them is held during their exchange: rounds three times as large (two for
# near-balanced traffic) then fit under the peak set elsewhere, and across processes every round is a collective with
# milliseconds of latency. The positions' way back takes three rounds: with two (``_BACK_ROUNDS = 4``) XLA's schedule
# holds more buffers at once and the compiled peak grows from 2.82x to 2.97x the particle buffers (8 devices,
# capacity factor 1.25; 2.80x to 2.97x with the input donated).
_KEY_ROUNDS = 3
_BACK_ROUNDS = 2


# ---------------------------------------------------------------- the per-particle fields, moved together


class RowLeaves:
    """The per-particle leaves of a particle pytree (leading length ``n``, other than ``num``), and the way back."""

    def __init__(self, part: Any, n: int):
        leaves, self.treedef = jax.tree.flatten(part)
        self.leaves = leaves
        num = part.num
        self.rows = [i for i, leaf in enumerate(leaves) if leaf is not num and is_row_leaf(leaf, n)]
        self.at_pos = next(k for k, i in enumerate(self.rows) if leaves[i] is part.pos)

    def arrays(self) -> list[jax.Array]:
        """The arrays to move, in a fixed order (``pos`` at :attr:`at_pos`)."""
        return [jnp.asarray(self.leaves[i]) for i in self.rows]

    def unpack(self, arrays: list[jax.Array], num: jax.Array) -> Any:
        """The pytree rebuilt from moved ``arrays`` (same order as :meth:`arrays`) with ``num`` valid rows."""
        leaves = list(self.leaves)
        for i, a in zip(self.rows, arrays, strict=True):
            leaves[i] = a
        return with_num(jax.tree.unflatten(self.treedef, leaves), num)


def take_rows(arrays: list[jax.Array], perm: jax.Array) -> list[jax.Array]:
    """Every array's rows in the order ``perm``."""
    # Indices are never negative: no wrapped copy of ``perm``.
    return [a.at[perm].get(mode="clip", wrap_negative_indices=False) for a in arrays]


def resize_rows(arrays: list[jax.Array], capacity: int) -> list[jax.Array]:
    """Every array truncated or zero-padded to ``capacity`` rows."""
    out = []
    for a in arrays:
        n = a.shape[0]
        if capacity <= n:
            out.append(a[:capacity])
        else:
            out.append(jnp.concatenate([a, jnp.zeros((capacity - n, *a.shape[1:]), a.dtype)]))
    return out


def send_rows(arrays: list[jax.Array], send_counts: jax.Array, capacity: int, *, chunk: int,
              perm: jax.Array | None = None, recv_at: jax.Array | None = None, init: list[jax.Array] | None = None,
              target: jax.Array | None = None, row_maps: list[Any] | None = None,
              plan: tuple[jax.Array, jax.Array] | None = None) -> tuple[list[jax.Array], jax.Array]:
    """``alltoallv`` of every array with the same ``send_counts``: one count exchange (none with ``plan``), and one
    ``all_to_all`` per round for all 4- and 8-byte arrays together, packed a round at a time into one uint32 block
    (no packed copy of the particle data); returns the arrays and the rows received from each rank (`(size,)`).

    ``chunk``: rows per rank pair and round. ``perm``: send ``a[perm]`` without building it. ``recv_at``: `(size,)`
    row where each source's block starts (default packed in rank order). ``init``: the buffers received rows are
    written into (default zeros). ``target``: `(n,)` int32 row of the receiver each sent row goes to (aligned with
    the send order; rows outside ``[0, capacity)`` are dropped), instead of blocks packed by source. ``row_maps``:
    per array, ``None`` or an elementwise function applied to its rows on the way. ``plan``: ``(recv_counts,
    largest)`` when the caller already knows them (the rows each rank sends me, and the largest count any rank
    sends another rank, or more).
    """
    outs, recv, _ = alltoallv_many(arrays, send_counts, capacity, resolve_axes(None), "auto", chunk, perm=perm,
                                    recv_at=recv_at, init=init, target=target, row_maps=row_maps, plan=plan)
    return outs, recv


# ---------------------------------------------------------------- step 1: keys


class _Keyed(NamedTuple):
    """A device's rows keyed for the sort: valid count and mask, key box, non-finite rows, Morton key words and
    the tie words that order equal keys by global input order."""

    num: jax.Array
    rows: jax.Array
    valid: jax.Array
    kbox: KeyBox
    nonfinite: jax.Array
    words: tuple[jax.Array, ...]  # (key hi, key lo, tie...)


def _keyed(part: Any, n: int, box: Box | None, rank: Any, size: int) -> _Keyed:
    num = jnp.clip(jnp.asarray(part.num, jnp.int32), 0, n)
    rows = jnp.arange(n, dtype=jnp.int32)
    valid = rows < num
    pos = jnp.asarray(part.pos)
    kbox = key_box(pos, valid, box)
    # Positions are wrapped into a periodic box after they moved (the keys wrap on the fly), so that no wrapped copy
    # of the input positions is held during the sort.
    nonfinite = jnp.sum(valid & ~jnp.all(jnp.isfinite(pos), axis=1)).astype(jnp.int32)
    hi, lo = morton_key(pos, kbox, valid)
    tie = (rank * n + rows,) if size * n < _ONE_WORD_TIES else (jnp.full_like(rows, rank), rows)
    return _Keyed(num, rows, valid, kbox, nonfinite, (hi, lo, *tie))


def _wrap_rows(kbox: KeyBox) -> Callable[[jax.Array], jax.Array]:
    """A row map wrapping `(..., rows, d)` positions into the periodic box as they are sent."""
    return lambda p: wrap(p.reshape(-1, p.shape[-1]), kbox).reshape(p.shape)


def _one_device(rows_of: RowLeaves, keyed: _Keyed, cap: int, *, number: bool, host_sort: bool) -> Sorted:
    """The whole sort on one device: one local sort of the keys and one gather of every field."""
    perm = argsort_keys(*keyed.words[:2], host=host_sort)
    moved = resize_rows(take_rows(rows_of.arrays(), perm), cap)
    moved[rows_of.at_pos] = wrap(moved[rows_of.at_pos], keyed.kbox)
    num = keyed.num
    # (All-reduces over the one device: the counts are then typed as the same on every device.)
    return Sorted(rows_of.unpack(moved, jnp.minimum(num, cap)), num > cap, num, allreduce(keyed.nonfinite),
                  keyed.kbox, allreduce(num), index=resize_rows([perm], cap)[0] if number else None)


# ---------------------------------------------------------------- step 2: splitters


def _num_samples(size: int) -> int:
    return max(16, min(2048, 128 * size, 2**20 // size))


def _less(a: tuple[jax.Array, ...], b: tuple[jax.Array, ...]) -> jax.Array:
    """Lexicographic ``a < b`` over word tuples (most significant first)."""
    out = a[-1] < b[-1]
    for x, y in zip(a[-2::-1], b[-2::-1], strict=True):
        out = (x < y) | ((x == y) & out)
    return out


def _splitters(words: tuple[jax.Array, ...], num: jax.Array, stats: jax.Array, size: int, *, snap: float = 0.0
               ) -> tuple[tuple[jax.Array, ...], jax.Array]:
    """``size - 1`` splitters (words of ``(key hi, key lo, tie...)``) cutting the global order evenly, and every
    device's ``stats``.

    Every device contributes ``s`` stratified random samples of its rows (one per stratum of ``num / s`` rows, from
    a fixed seed), each standing for ``num / s`` particles; splitter ``j`` is the first sample in global order at
    which the cumulative weight reaches ``j * total / size``. A device then receives about ``total / size``
    particles, within a few ``total / sqrt(s * size)``; the exact counts are known before anything moves.

    ``stats``: `(k,)` int32 of this device whose first word is ``num``; they travel with the samples (one
    all-gather for both: across processes each collective costs milliseconds of latency whatever its size) and come
    back as `(size, k)`, row ``r`` from device ``r``.

    ``snap``: move each splitter, within ``snap`` of a device's share (by the samples' estimate), to the coarsest
    cell boundary of the Morton grid there (see :func:`_snapped`): the pieces of space are then unions of large
    cells, with less surface than an exact split whose boundaries cut thin slivers off the neighbouring cells.
    """
    s = _num_samples(size)
    u = jax.random.uniform(jax.random.fold_in(jax.random.key(0), rank_info().rank), (s,))
    at = jnp.floor((jnp.arange(s, dtype=jnp.float32) + u) * (num.astype(jnp.float32) / s)).astype(jnp.int32)
    at = jnp.clip(at, 0, jnp.maximum(num - 1, 0))
    has = num > 0
    samples = [jnp.where(has, w[at], jnp.asarray(jnp.iinfo(w.dtype).max, w.dtype)) for w in words]
    samples.append(jnp.where(has, jnp.full((s,), num.astype(jnp.float32) / s), 0.0))
    columns = [lax.bitcast_convert_type(w, jnp.uint32) for w in samples]
    columns += [jnp.broadcast_to(lax.bitcast_convert_type(x, jnp.uint32), (s,)) for x in stats]
    packed = allgather(jnp.stack(columns, axis=1), tiled=True)
    nw = len(words)
    per_device = lax.bitcast_convert_type(packed[::s, nw + 1:], jnp.int32)
    gathered = [lax.bitcast_convert_type(packed[:, i], w.dtype) for i, w in enumerate(samples[:-1])]
    weight = lax.bitcast_convert_type(packed[:, nw], jnp.float32)
    # Stable by key: equal keys stay in gathered (rank, row) order, which is global index order.
    order = argsort_keys(gathered[0], gathered[1])
    gathered = [w[order] for w in gathered]
    weight = weight[order]
    total = jnp.sum(per_device[:, 0])
    targets = total.astype(jnp.float32) * jnp.arange(1, size, dtype=jnp.float32) / size
    pick = jnp.clip(jnp.searchsorted(jnp.cumsum(weight), targets, side="left"), 0, s * size - 1)
    picked = tuple(w[pick] for w in gathered)
    if snap > 0:
        picked = _snapped(gathered, weight, pick, targets, snap * total.astype(jnp.float32) / size, picked)
    return picked, per_device


def _snapped(gathered: list[jax.Array], weight: jax.Array, pick: jax.Array, targets: jax.Array,
             tolerance: jax.Array, picked: tuple[jax.Array, ...]) -> tuple[jax.Array, ...]:
    """Splitters moved to the coarsest Morton cell boundary between two consecutive samples near them.

    Between sorted samples ``a < b`` the coarsest boundary is ``b`` with its bits below the highest bit in which
    ``a`` and ``b`` differ cleared; it splits off every key of that cell. Among the sample gaps within
    ``_SNAP_SAMPLES`` samples of each splitter whose estimated rank (the weight of the samples before it) lies
    within ``tolerance`` of the target, the one with the coarsest boundary wins (the nearest on ties). The new
    splitter is that key with zero tie words (the cell's first key, so the whole cell goes up). Where no gap
    has a boundary (equal keys), the splitter stays as it was.
    """
    hi, lo = gathered[0], gathered[1]
    total = hi.shape[0]
    before = jnp.cumsum(weight) - weight  # estimated rows below each sample
    offsets = jnp.arange(-_SNAP_SAMPLES, _SNAP_SAMPLES + 1, dtype=jnp.int32)
    at = jnp.clip(pick[:, None] + offsets[None, :], 1, total - 1)  # (splitters, window): the gap below sample ``at``
    xhi, xlo = hi[at] ^ hi[at - 1], lo[at] ^ lo[at - 1]
    bits = jnp.where(xhi != 0, 64 - lax.clz(xhi), jnp.where(xlo != 0, 32 - lax.clz(xlo), 0)).astype(jnp.int32)
    near = jnp.abs(before[at] - targets[:, None]) <= tolerance
    score = jnp.where(near & (bits > 0), bits * (4 * _SNAP_SAMPLES) - jnp.abs(offsets)[None, :], -1)
    best = jnp.argmax(score, axis=1)
    chosen = jnp.take_along_axis(at, best[:, None], axis=1)[:, 0]
    keep = jnp.max(score, axis=1) < 0
    clear = jnp.take_along_axis(bits, best[:, None], axis=1)[:, 0] - 1  # bits of the key below the boundary
    ones = jnp.uint32(0xFFFFFFFF)
    hi_mask = jnp.where(clear >= 32, ones << jnp.clip(clear - 32, 0, 31).astype(jnp.uint32), ones)
    hi_mask = jnp.where(clear >= 64, jnp.uint32(0), hi_mask)
    lo_mask = jnp.where(clear >= 32, jnp.uint32(0), ones << jnp.clip(clear, 0, 31).astype(jnp.uint32))
    snapped = (hi[chosen] & hi_mask, lo[chosen] & lo_mask, *(jnp.zeros_like(w[chosen]) for w in gathered[2:]))
    return tuple(jnp.where(keep, p, q) for p, q in zip(picked, snapped, strict=True))


# ---------------------------------------------------------------- step 3: buckets


class _Search(NamedTuple):
    """The binary search's carry: each row's count of splitters ``<=`` it lies in ``[lo, hi]``."""

    lo: jax.Array
    hi: jax.Array


def _destinations(words: tuple[jax.Array, ...], splitters: tuple[jax.Array, ...]) -> jax.Array:
    """`(n,)` int32: how many splitters are ``<=`` each row (direct comparisons for a few splitters, else a binary
    search over the sorted splitters)."""
    m = splitters[0].shape[0]
    if m <= _DIRECT_MAX_SPLITTERS:
        count = jnp.zeros_like(words[0], dtype=jnp.int32)
        for j in range(m):
            count = count + (~_less(words, tuple(w[j] for w in splitters))).astype(jnp.int32)
        return count

    def step(_: int, s: _Search) -> _Search:
        mid = (s.lo + s.hi) // 2
        at = jnp.clip(mid, 0, m - 1)
        right = (mid < s.hi) & ~_less(words, tuple(w[at] for w in splitters))
        return _Search(jnp.where(right, mid + 1, s.lo), jnp.where(right, s.hi, mid))

    lo = jnp.zeros_like(words[0], dtype=jnp.int32)  # like a row-varying input: the loop carry must vary over ranks too
    return lax.fori_loop(0, m.bit_length() + 1, step, _Search(lo, lo + m)).lo


class _Buckets(NamedTuple):
    """Where a device's rows go (several devices), known before anything moves."""

    perm: jax.Array  # (n,) the rows in the order they leave, grouped by bucket
    send: jax.Array  # (size,) rows for each bucket
    matrix: jax.Array  # (size, size) every device's send counts: rows from device i to bucket j
    counts: jax.Array  # (size,) valid rows each device held before the sort
    nonfinite: jax.Array  # rows with a NaN or infinite coordinate on all devices


def _buckets(keyed: _Keyed, size: int, *, by_key: bool, snap: float, host_sort: bool) -> _Buckets:
    """Steps 2 and 3: the splitters, each row's bucket, the rows grouped by bucket, every device's send counts.

    ``by_key``: group the rows by a sort of their keys (each bucket's rows then leave in key order, and each key's
    global position increases along the send order); else by a counting sort of the buckets, each bucket's rows in
    row order. The splitters need no global offsets (ties are split by (rank, row)), so every device's count and
    non-finite rows travel with the samples; every device's send counts in one more all-gather give the plans of
    the exchanges that follow, where count exchanges would each be a collective.
    """
    hi, lo = keyed.words[:2]
    perm = argsort_keys(hi, lo, host=host_sort) if by_key else None  # ties in row order: global index order
    splitters, per_device = _splitters(keyed.words, keyed.num, jnp.stack([keyed.num, keyed.nonfinite]), size,
                                       snap=snap)
    bucket = jnp.where(keyed.valid, _destinations(keyed.words, splitters), size)
    if perm is None:
        perm, send = group_by_rank(bucket, size, host=host_sort)
    else:
        send = count_by_rank(bucket, size)
    return _Buckets(perm, send, allgather(send), per_device[:, 0], jnp.sum(per_device[:, 1]))


# ---------------------------------------------------------------- keys first: sort_particles


def sort_particles(part: Any, *, box: Box | None, equalize: bool, capacity: int | None = None) -> Sorted:
    """Sort particles into global z-order, moving the keys first (local view; the sort behind ``zsort`` and kNN).

    Per device it holds the input, the output and a few int32 words per row (see the module docstring).

    Args:
        part: particle pytree (``.pos (n, d)``, ``.num``); every row leaf travels (the first ``num`` rows are the
            particles).
        box: periodic box size (positions are wrapped, keys over the box) or ``None`` (keys over the global
            bounding box).
        equalize: device ``r`` ends with ``num_total // ndev`` rows, plus one for the first ``num_total % ndev``;
            else the counts of the sample-sort buckets.
        capacity: rows per device of the result (static); default ``n``.

    Returns:
        The :class:`Sorted` share of this device (no routes, no index).
    """
    n, _ = check_positions(part, "zsort")
    cap = n if capacity is None else check_capacity(capacity)
    if not isinstance(equalize, bool):
        raise TypeError(f"equalize must be a bool, got {equalize!r}")
    rank, size, _ = rank_info()
    keyed = _keyed(part, n, box, rank, size)
    rows_of = RowLeaves(part, n)
    if size == 1:
        return _one_device(rows_of, keyed, cap, number=False, host_sort=False)
    buckets = _buckets(keyed, size, by_key=True, snap=0.0, host_sort=False)
    place = _rank_keys(jnp.asarray(part.pos), keyed.kbox, buckets, rank, size, cap)
    back = _places_home(place, buckets, rank, n, cap)
    split = _split(buckets.matrix, size, cap, equalize)
    moved = _rows_to_places(rows_of, keyed, buckets.perm, back, split.first, size, cap)
    needed = split.needed[rank]
    return Sorted(rows_of.unpack(moved, jnp.minimum(split.finals[rank], cap)), needed > cap, needed,
                  buckets.nonfinite, keyed.kbox, jnp.max(split.needed))


def _rank_keys(pos: jax.Array, kbox: KeyBox, buckets: _Buckets, rank: Any, size: int, cap: int) -> jax.Array:
    """`(cap,)` int32 global position of each key this device's bucket receives (-1 for padding): the keys travel
    to their bucket and are sorted there.

    Keys arrive grouped by source rank, each source's in its sorted order, so equal keys stay in global input order.
    They travel as one (hi, lo) pair of columns per row, computed from the positions on the way (no copy of them is
    held during the exchange, see ``_KEY_ROUNDS``), received into a buffer of invalid keys so that the padding
    sorts last without a masked copy."""
    send, matrix = buckets.send, buckets.matrix
    from_src = matrix[:, rank]
    invalid = jnp.full((cap, 2), jnp.uint32(0xFFFFFFFF) - (send[0] < 0).astype(jnp.uint32), jnp.uint32)

    def keys_of(p: jax.Array) -> jax.Array:  # (..., rows, d) positions -> (..., rows, 2) key words
        flat = p.reshape(-1, p.shape[-1])
        return jnp.stack(morton_key(flat, kbox), axis=-1).reshape(*p.shape[:-1], 2)

    (keys,), _ = send_rows([pos], send, cap, perm=buckets.perm, init=[invalid], row_maps=[keys_of],
                           chunk=_KEY_ROUNDS * default_chunk(cap, size), plan=(from_src, jnp.max(matrix)))
    stored = jnp.minimum(jnp.sum(from_src), cap)
    # Ties in arrival order: by source rank, then in the source's order. XLA's sort, in place: the host sort would
    # hold its sorted copy next to the keys and lift zsort's peak over 3x the particle buffers.
    order = argsort_keys(keys[:, 0], keys[:, 1], host=False)
    counts = jnp.minimum(jnp.sum(matrix, axis=0), cap)
    bucket_start = jnp.sum(jnp.where(jnp.arange(size) < rank, counts, 0))
    at = jnp.arange(cap, dtype=jnp.int32) + (order[0] < -1).astype(jnp.int32)  # (computed after the sort)
    return _minus_ones(cap, order[0]).at[order].set(jnp.where(at < stored, bucket_start + at, -1),
                                                    unique_indices=True, wrap_negative_indices=False)


def _places_home(place: jax.Array, buckets: _Buckets, rank: Any, n: int, cap: int) -> jax.Array:
    """`(n,)` int32 global position of each row in this device's send order (-1: past a full bucket), back along
    the reverse routes of the keys. They increase along that order, which is therefore grouped by final device."""
    matrix, size = buckets.matrix, buckets.matrix.shape[0]
    # ``kept[i, j]``: rows of device i that bucket j stored (each bucket fills in source order).
    kept = jnp.clip(cap - (jnp.cumsum(matrix, axis=0) - matrix), 0, matrix)
    sent_at = jnp.cumsum(buckets.send) - buckets.send
    (back,), _ = send_rows([place], kept[:, rank], n, recv_at=sent_at, init=[_minus_ones(n, place[0])],
                           chunk=_BACK_ROUNDS * default_chunk(cap, size), plan=(kept[rank], jnp.max(kept)))
    return back


class _Split(NamedTuple):
    """The final cut of the sorted sequence (replicated)."""

    first: jax.Array  # (size,) first global position each device ends with
    finals: jax.Array  # (size,) rows each device ends with
    needed: jax.Array  # (size,) rows each device needs at some step


def _split(matrix: jax.Array, size: int, cap: int, equalize: bool) -> _Split:
    """Where the sorted sequence is cut: the equal split of the stored rows (``total // size``, plus one for the
    first ``total % size`` devices), or the sample-sort buckets as they are."""
    received = jnp.sum(matrix, axis=0)
    counts = jnp.minimum(received, cap)
    if equalize:
        total = jnp.sum(counts)
        ranks = jnp.arange(size, dtype=jnp.int32)
        first = ranks * (total // size) + jnp.minimum(ranks, total % size)
    else:
        first = jnp.cumsum(counts) - counts
    finals = jnp.concatenate([first[1:], jnp.sum(counts, keepdims=True)]) - first
    return _Split(first, finals, jnp.maximum(received, finals) if equalize else received)


def _rows_to_places(rows_of: RowLeaves, keyed: _Keyed, perm: jax.Array, back: jax.Array, first: jax.Array,
                    size: int, cap: int) -> list[jax.Array]:
    """Every row straight to its final device and row, in the send order ``perm`` (positions wrapped into a
    periodic box on the way: no wrapped copy of the input)."""
    dev = jnp.sum(back[:, None] >= first[None, 1:], axis=1, dtype=jnp.int32)
    placed = (keyed.rows < keyed.num) & (back >= 0)
    final_send = count_by_rank(jnp.where(placed, dev, size), size)
    maps: list[Any] = [None] * len(rows_of.rows)
    if keyed.kbox.periodic:
        maps[rows_of.at_pos] = _wrap_rows(keyed.kbox)
    moved, _ = send_rows(rows_of.arrays(), final_send, cap, perm=perm, target=jnp.where(placed, back - first[dev], -1),
                         row_maps=maps, chunk=default_chunk(cap, size))
    return moved


def _minus_ones(n: int, after: jax.Array) -> jax.Array:
    """`(n,)` int32 -1s computed from ``after`` (a scalar int), so that XLA cannot schedule the buffer before it
    (a constant broadcast may be placed at the start of the program and held all the way)."""
    return jnp.full((n,), -1 - (after < -1).astype(jnp.int32), jnp.int32)


# ---------------------------------------------------------------- rows once: bucket_sort


def bucket_sort(part: Any, *, box: Box | None, capacity: int | None = None, number: bool = False,
                host_sort: bool = True) -> Sorted:
    """Sort particles into global z-order with one exchange of the rows (local view; FoF's sort).

    The same order as :func:`sort_particles` (ties in global input order); device counts follow the sample-sort
    splitters, moved to coarse cell boundaries (within a few percent of even). The rows go to the device of their
    key range, which keys them again and sorts them: two all-gathers (samples, send counts) and one exchange of the
    rows, whose :class:`Routes` bring per-row results back. The received rows and their sorted copy are held
    together (about 2x the particle data on top of the input).

    Args:
        part: particle pytree (``.pos (n, d)``, ``.num``); every row leaf travels.
        box: periodic box size or ``None`` (as in :func:`sort_particles`).
        capacity: rows per device of the result (static); default ``n``.
        number: also return in ``index`` the global input index of each held row (the rows of all devices
            numbered in (device, row) order: the devices' counts travel with the samples, so this costs no scan).
        host_sort: sort by NumPy on CPU devices (:func:`shardax._wordsort.argsort_keys` with ``host=True``).

    Returns:
        The :class:`Sorted` share of this device, with :class:`Routes` on several devices (``None`` on one, where
        nothing moves).
    """
    n, _ = check_positions(part, "zsort")
    cap = n if capacity is None else check_capacity(capacity)
    rank, size, _ = rank_info()
    keyed = _keyed(part, n, box, rank, size)
    rows_of = RowLeaves(part, n)
    if size == 1:
        return _one_device(rows_of, keyed, cap, number=number, host_sort=host_sort)
    buckets = _buckets(keyed, size, by_key=False, snap=_SNAP, host_sort=host_sort)
    from_src = buckets.matrix[:, rank]
    received = jnp.sum(buckets.matrix, axis=0)
    largest = jnp.max(jnp.where(jnp.eye(size, dtype=bool), 0, buckets.matrix))  # (the rows a rank keeps stay home)
    maps: list[Any] = [None] * len(rows_of.rows)
    if keyed.kbox.periodic:
        maps[rows_of.at_pos] = _wrap_rows(keyed.kbox)
    extra = []
    if number:
        extra = [jnp.sum(jnp.where(jnp.arange(size) < rank, buckets.counts, 0)) + keyed.rows]
    # A whole share per rank pair and round: balanced traffic takes one round (each round is a collective).
    moved, _ = send_rows(rows_of.arrays() + extra, buckets.send, cap, perm=buckets.perm,
                         row_maps=maps + [None] * len(extra), chunk=share_chunk(cap, size), plan=(from_src, largest))
    stored = jnp.minimum(received[rank], cap)
    moved, back = _sort_received(moved, rows_of.at_pos, keyed.kbox, stored, host_sort)
    routes = Routes(buckets.perm, buckets.send, from_src, back, largest)
    return Sorted(rows_of.unpack(moved[:len(rows_of.rows)], stored), received[rank] > cap, received[rank],
                  buckets.nonfinite, keyed.kbox, jnp.max(received), routes, moved[-1] if number else None)


def _sort_received(moved: list[jax.Array], at_pos: int, kbox: KeyBox, stored: jax.Array, host_sort: bool
                   ) -> tuple[list[jax.Array], jax.Array]:
    """The received rows sorted by key (ties in arrival order: by sender, each sender's in row order, which is
    global input order; padding last), and `(cap,)` the held rows by arrival: the reverse routes."""
    cap = moved[0].shape[0]
    held = jnp.arange(cap, dtype=jnp.int32)
    order = argsort_keys(*morton_key(moved[at_pos], kbox, held < stored), host=host_sort)
    back = jnp.zeros((cap,), jnp.int32).at[order].set(held, unique_indices=True)
    return take_rows(moved, order), back
