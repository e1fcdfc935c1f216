"""Distributed z-order sort: a sample sort into global Morton order, optionally cut into equal pieces.

Each device keys its particles, draws stratified random samples of them, and all devices agree on ``ndev - 1``
splitters by weighted quantiles of the gathered samples. Splitters are full ``(key, rank, row)`` triples (``rank,
row`` is global input order), so duplicate keys (even every particle at one point) are split like distinct ones.
Each device sorts its own keys once and finds every row's bucket by binary search over the splitters (its sorted
rows are then grouped by bucket). The particle data then moves once:

1. only the keys go to their bucket's device (``alltoallv``), which sorts them, once (keys arrive grouped by source
   rank, each source's in its sorted order, so equal keys stay in global input order) and so knows each key's global
   position;
2. the positions go back along the reverse routes to the rows' senders, where they increase along the sender's sorted
   order, which is therefore grouped by final device as it is;
3. each sender sends every row straight to its final device and row: the bucket's device, or with ``equalize`` the
   device holding that position when the sorted sequence is cut into ``num_total / ndev`` (+-1) pieces.

Per device the sort holds the input, the output and a few int32 words per row. On one device zsort is a single local
sort.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, Literal, NamedTuple, TypeVar, overload

import jax
import jax.numpy as jnp
from jax import lax
from jax.core import Tracer
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from .._bounds import check_bounds, check_part, mapped_bounds
from .._errors import CapacityError
from .._morton import Box, KeyBox, key_box, morton_key, periodic_box, wrap
from .._pytree import check_count, check_positions, map_rows, replace_field, with_num
from .._wordsort import argsort_keys
from ..comm import allgather, allreduce
from ..comm._alltoallv import (
    _exchange_counts_and_max,
    count_by_rank,
    default_chunk,
    group_by_rank,
    share_chunk,
)
from ..core import ALL, rank_info, resolve_axes, smap
from ._domain import Domain, domain_of
from ._rows import RowLeaves, resize_rows, send_rows, take_rows

T = TypeVar("T")


class Routes(NamedTuple):
    """How the rows moved, for sending per-row results back to the rows they came from without sorting (see
    :func:`sort_particles` with ``routes=True``; several devices only).

    Sender side: ``perm (n,)`` the order the rows left in (``sent (size,)`` rows to each device, in rank order: row
    ``perm[k]`` was the ``k``-th). Receiver side: ``received (size,)`` rows that came from each device, and ``back
    (cap,)`` the held rows regrouped by sender, each sender's in the order it sent them. ``largest``: the largest
    count any device sent any device (the same everywhere). So ``send_grouped(column, received, perm=back,
    plan=(sent, largest))`` takes a column back with no count exchange, and each sender receives its rows' values
    packed by device in the order ``perm``.
    """

    perm: jax.Array
    sent: jax.Array
    received: jax.Array
    back: jax.Array
    largest: jax.Array


class Sorted(NamedTuple):
    """Everything the local zsort knows, for the global wrapper and :func:`domain`."""

    part: Any
    overflow: jax.Array
    needed: jax.Array
    nonfinite: jax.Array
    key_box: KeyBox
    worst: jax.Array  # the largest ``needed`` over all devices (the same on every device)
    routes: Routes | None = None


def check_capacity(capacity: Any, name: str = "capacity") -> int:
    if not isinstance(capacity, int) or isinstance(capacity, bool) or capacity < 1:
        raise ValueError(f"{name} must be a positive Python int (rows per device), got {capacity!r}")
    return capacity


_DIRECT_MAX_SPLITTERS = 32
# How far :func:`bucket_sort` may move a splitter to a coarser cell boundary, as a fraction of a device's share.
_SNAP = 0.04
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


def _num_samples(size: int) -> int:
    return max(16, min(2048, 128 * size, 2**20 // size))


def _less(a: tuple[jax.Array, ...], b: tuple[jax.Array, ...]) -> jax.Array:
    """Lexicographic ``a < b`` over word tuples (most significant first)."""
    out = a[-1] < b[-1]
    for x, y in zip(a[-2::-1], b[-2::-1], strict=True):
        out = (x < y) | ((x == y) & out)
    return out


def _splitters(words: tuple[jax.Array, ...], num: jax.Array, stats: jax.Array, size: int, snap: float = 0.0
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


_SNAP_SAMPLES = 64  # samples searched on either side of a splitter for a coarser boundary


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


def _destinations(words: tuple[jax.Array, ...], splitters: tuple[jax.Array, ...]) -> jax.Array:
    """`(n,)` int32: how many splitters are ``<=`` each row (direct comparisons for a few splitters, else a binary
    search over the sorted splitters)."""
    m = splitters[0].shape[0]
    if m <= _DIRECT_MAX_SPLITTERS:
        count = jnp.zeros_like(words[0], dtype=jnp.int32)
        for j in range(m):
            count = count + (~_less(words, tuple(w[j] for w in splitters))).astype(jnp.int32)
        return count
    lo = jnp.zeros_like(words[0], dtype=jnp.int32)  # like a row-varying input: the loop carry must vary over ranks too
    hi = lo + m

    def step(_: int, bounds: tuple[jax.Array, jax.Array]) -> tuple[jax.Array, jax.Array]:
        lo, hi = bounds
        mid = (lo + hi) // 2
        at = jnp.clip(mid, 0, m - 1)
        right = (mid < hi) & ~_less(words, tuple(w[at] for w in splitters))
        return jnp.where(right, mid + 1, lo), jnp.where(right, hi, mid)

    lo, _ = lax.fori_loop(0, m.bit_length() + 1, step, (lo, hi))
    return lo


def _firsts(counts: jax.Array, size: int, equalize: bool) -> jax.Array:
    """`(size,)` first global position held by each device at the end: the equal split of ``sum(counts)`` rows
    (``total // size``, plus one for the first ``total % size`` devices), or the sample-sort buckets as they are."""
    if not equalize:
        return jnp.cumsum(counts) - counts
    total = jnp.sum(counts)
    ranks = jnp.arange(size, dtype=jnp.int32)
    return ranks * (total // size) + jnp.minimum(ranks, total % size)


def _device_and_row(place: jax.Array, first: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Final device and row of global positions ``place`` (-1: none) under the split ``first``."""
    dev = jnp.sum(place[:, None] >= first[None, 1:], axis=1, dtype=jnp.int32)
    return dev, place - first[dev]


def _minus_ones(n: int, after: jax.Array) -> jax.Array:
    """`(n,)` int32 -1s computed from ``after`` (a scalar int), so that XLA cannot schedule the buffer before it
    (a constant broadcast may be placed at the start of the program and held all the way)."""
    return jnp.full((n,), -1 - (after < -1).astype(jnp.int32), jnp.int32)


def _wrapped(part: Any, kbox: KeyBox) -> Any:
    return replace_field(part, "pos", wrap(part.pos, kbox)) if kbox.periodic else part


class _Keyed(NamedTuple):
    """A device's rows keyed for the sorts: valid count and mask, key box, non-finite rows, Morton key words and
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
    # Equal keys are split by global input order, i.e. by (rank, row): one word ``rank * n + row`` while it fits in
    # an int32, else two.
    tie = (rank * n + rows,) if size * n < _ONE_WORD_TIES else (jnp.full_like(rows, rank), rows)
    return _Keyed(num, rows, valid, kbox, nonfinite, (hi, lo, *tie))


def _wrap_rows(kbox: KeyBox) -> Callable[[jax.Array], jax.Array]:
    """A row map wrapping `(..., rows, d)` positions into the periodic box as they are sent."""
    return lambda p: wrap(p.reshape(-1, p.shape[-1]), kbox).reshape(p.shape)


def sort_particles(part: Any, box: Box | None, equalize: bool, capacity: int | None, *,
                   chunk_factor: int = 1, routes: bool = False, host_sort: bool = False) -> Sorted:
    """The local-view sort behind :func:`zsort`, with what the global wrapper needs to report.

    ``chunk_factor`` multiplies the rows per rank pair and round of the three exchanges: ``zsort`` keeps the default
    (peak memory under 3x the particle data, about 11 rounds), kernels with larger working sets of their own pass 8
    (one or two rounds each: across processes every round is a collective with milliseconds of latency).
    ``routes``: also return the :class:`Routes` of the rows (on several devices; one int32 word more per row
    travels), for kernels that send per-row results back to the input rows.
    ``host_sort``: sort the keys by NumPy on CPU devices (:func:`argsort_keys` with ``host=True``: 4-15x faster,
    but 8 bytes per row more at zsort's peak memory, which stays under 3x the particle data only with XLA's sort in
    place); kernels whose own working set sets their peak pass True.
    """
    n, _ = check_positions(part, "zsort")
    cap = n if capacity is None else check_capacity(capacity)
    if not isinstance(equalize, bool):
        raise TypeError(f"equalize must be a bool, got {equalize!r}")
    rank, size, _ = rank_info()
    num, rows, valid, kbox, nonfinite, words = _keyed(part, n, box, rank, size)
    pos = jnp.asarray(part.pos)  # type: ignore[attr-defined]
    hi, lo = words[:2]
    if size == 1:
        perm = argsort_keys(hi, lo, host=host_sort)

        def reorder(a: jax.Array) -> jax.Array:
            return resize_rows(take_rows([a], perm), cap)[0]

        out = with_num(map_rows(reorder, part, n), jnp.minimum(num, cap))
        # (An all-reduce over the one device: the count is then typed as the same on every device.)
        return Sorted(_wrapped(out, kbox), num > cap, num, allreduce(nonfinite), kbox, allreduce(num))

    # The particle data moves once. Each device first sorts its own keys: its rows are then grouped by bucket (the
    # buckets are key ranges) and, in the end, by final device. Only the keys go to their bucket, where one sort
    # ranks them; each row's global position goes back to its sender, which sends the row straight to its final
    # device and row. Per device this holds the input, the output and a few int32 words per row, never a received
    # copy of the particles next to a sorted one, and no rows are regrouped after the first sort.
    rows_of = RowLeaves(part, n)
    perm = argsort_keys(hi, lo, host=host_sort)  # ties in row order, which is global index order
    # The splitters need no global offsets (ties are split by (rank, row)), so every device's count and non-finite
    # rows travel with the samples (the total and the non-finite total come from that one all-gather).
    splitters, per_device = _splitters(words, num, jnp.stack([num, nonfinite]), size)
    nonfinite = jnp.sum(per_device[:, 1])
    bucket = jnp.where(valid, _destinations(words, splitters), size)
    send = count_by_rank(bucket, size)
    # Every device's send counts, ``matrix[i, j]`` rows from device i to bucket j, in one all-gather: it gives the
    # key exchange's plan, the buckets' sizes and the plan of the way back, where a count exchange, an all-gather
    # of the bucket sizes and another count exchange would each be a collective.
    matrix = allgather(send)
    from_src = matrix[:, rank]
    # The keys travel as one (hi, lo) pair of columns per row, computed again from the positions on the way (no copy
    # of them is held during the exchange, see _KEY_ROUNDS). Received into a buffer of invalid keys, so that the
    # padding sorts last without a masked copy.
    invalid = jnp.full((cap, 2), jnp.uint32(0xFFFFFFFF) - (send[0] < 0).astype(jnp.uint32), jnp.uint32)
    chunk = chunk_factor * default_chunk(cap, size)

    def keys_of(p: jax.Array) -> jax.Array:  # (..., rows, d) positions -> (..., rows, 2) key words
        flat = p.reshape(-1, p.shape[-1])
        return jnp.stack(morton_key(flat, kbox), axis=-1).reshape(*p.shape[:-1], 2)

    (keys,), _ = send_rows([pos], send, cap, perm=perm, init=[invalid], row_maps=[keys_of],
                           chunk=max(chunk, _KEY_ROUNDS * default_chunk(cap, size)),
                           plan=(from_src, jnp.max(matrix)))
    khi, klo = keys[:, 0], keys[:, 1]
    got = jnp.sum(from_src)
    stored = jnp.minimum(got, cap)
    order = argsort_keys(khi, klo, host=host_sort)  # ties in arrival order: by source rank, then in the source's order
    received = jnp.sum(matrix, axis=0)
    counts = jnp.minimum(received, cap)
    first = _firsts(counts, size, equalize)
    bucket_start = jnp.sum(jnp.where(jnp.arange(size) < rank, counts, 0))
    at = jnp.arange(cap, dtype=jnp.int32) + (order[0] < -1).astype(jnp.int32)  # (computed after the sort)
    # Global position of each received key (its bucket's start plus its rank there); -1 for padding.
    place = _minus_ones(cap, order[0]).at[order].set(jnp.where(at < stored, bucket_start + at, -1),
                                                     unique_indices=True, wrap_negative_indices=False)
    finals = jnp.concatenate([first[1:], jnp.sum(counts, keepdims=True)]) - first  # rows each device ends with
    # Positions back along the reverse routes, into the sender's sorted order (rows past a full bucket: -1). They
    # increase along that order, so it is grouped by final device as it is. ``kept[i, j]``: rows of device i that
    # bucket j stored (each bucket fills in source order).
    kept = jnp.clip(cap - (jnp.cumsum(matrix, axis=0) - matrix), 0, matrix)
    sent_at = jnp.cumsum(send) - send
    (back,), _ = send_rows([place], kept[:, rank], n, recv_at=sent_at, init=[_minus_ones(n, place[0])],
                          chunk=max(chunk, _BACK_ROUNDS * default_chunk(cap, size)),
                          plan=(kept[rank], jnp.max(kept)))
    dev, row = _device_and_row(back, first)
    placed = (rows < num) & (back >= 0)
    final_send = count_by_rank(jnp.where(placed, dev, size), size)
    # Positions are wrapped into a periodic box on the way (no wrapped copy of the input).
    arrays = rows_of.arrays()
    pos_leaf = [a is part.pos for a in rows_of.leaves]  # type: ignore[attr-defined]
    maps = [_wrap_rows(kbox) if kbox.periodic and pos_leaf[i] else None for i in rows_of.rows]
    extra: list[jax.Array] = []
    if routes:
        # Each row takes (sender, its place in the sender's block for the receiver) along: the receiver regroups its
        # rows by sender from that alone (no sort). One word while ``size * n`` fits in an int32, else two.
        place_in_block = rows - (jnp.cumsum(final_send) - final_send)[jnp.clip(dev, 0, size - 1)]
        words = (rank * n + place_in_block,) if size * n < _ONE_WORD_TIES else (jnp.full_like(rows, rank),
                                                                                place_in_block)
        extra = [jnp.zeros((n, len(words)), jnp.int32).at[perm].set(jnp.stack(words, axis=1), unique_indices=True)]
    # With routes, the count exchange is done here so that its global largest count can be kept for the way back.
    plan = _exchange_counts_and_max(final_send, resolve_axes(None)) if routes else None
    moved, recv = send_rows(arrays + extra, final_send, cap, perm=perm, target=jnp.where(placed, row, -1),
                            row_maps=maps + [None] * len(extra), chunk=chunk, plan=plan)
    arrays = moved[:len(arrays)]
    needed = jnp.maximum(received, finals) if equalize else received  # every device's, known everywhere
    num = jnp.minimum(finals[rank], cap)
    route = None
    if plan is not None:
        code = moved[-1]
        source, at = (code[:, 0] // n, code[:, 0] % n) if code.shape[1] == 1 else (code[:, 0], code[:, 1])
        held = jnp.arange(cap, dtype=jnp.int32)
        slot = jnp.where(held < num, (jnp.cumsum(recv) - recv)[jnp.clip(source, 0, size - 1)] + at, cap)
        back = jnp.zeros((cap,), jnp.int32).at[slot].set(held, mode="drop")
        route = Routes(perm, final_send, recv, back, plan[1])
    return Sorted(rows_of.unpack(arrays, num), needed[rank] > cap, needed[rank], nonfinite, kbox, jnp.max(needed),
                  route)


def bucket_sort(part: Any, box: Box | None, capacity: int | None, *, number: bool = False,
                host_sort: bool = True) -> tuple[Sorted, jax.Array | None]:
    """Sort particles into global z-order with one exchange of the rows (local view, for kernels).

    Like :func:`sort_particles` with ``equalize=False`` and ``routes=True``, but the rows themselves go to the
    device of their key range, which then keys them again and sorts them: two all-gathers (samples, send counts)
    and one exchange of the rows, against the keys' way there and back plus a count exchange. The price is memory:
    the received rows and their sorted copy are held together (about 2x the particle data on top of the input),
    which kernels with larger working sets of their own (FoF) can afford. The result is the same order as
    :func:`sort_particles`' (ties in global input order); device counts follow the sample-sort splitters.

    Args:
        part: particle pytree (``.pos (n, d)``, ``.num``); every row leaf travels.
        box: periodic box size or ``None`` (as in :func:`sort_particles`).
        capacity: rows per device of the result (static); default ``n``.
        number: also return `(capacity,)` int32 the global input index of each held row (the rows of all devices
            numbered in (device, row) order: the devices' counts travel with the samples, so this costs no scan).
        host_sort: sort by NumPy on CPU devices (as in :func:`sort_particles`).

    Returns:
        ``(sorted, index)``: the :class:`Sorted` (with :class:`Routes` on several devices; ``None`` on one, where
        nothing moves) and the index (``None`` unless ``number``).
    """
    n, _ = check_positions(part, "zsort")
    cap = n if capacity is None else check_capacity(capacity)
    rank, size, _ = rank_info()
    num, rows, valid, kbox, nonfinite, words = _keyed(part, n, box, rank, size)
    rows_of = RowLeaves(part, n)
    arrays = rows_of.arrays()
    at_pos = next(k for k, i in enumerate(rows_of.rows) if rows_of.leaves[i] is part.pos)
    if size == 1:
        perm = argsort_keys(*words[:2], host=host_sort)
        moved = resize_rows(take_rows([*arrays, rows], perm), cap)
        moved[at_pos] = wrap(moved[at_pos], kbox)
        stored = jnp.minimum(num, cap)
        out = rows_of.unpack(moved[:-1], stored)
        return Sorted(out, num > cap, num, allreduce(nonfinite), kbox, allreduce(num)), moved[-1] if number else None
    splitters, per_device = _splitters(words, num, jnp.stack([num, nonfinite]), size, snap=_SNAP)
    # Each row's bucket; the rows are grouped by bucket in row order (a counting sort, not a sort by key): they
    # arrive grouped by source rank, each source's in row order, so a stable sort by key on arrival puts equal keys
    # in global input order.
    bucket = jnp.where(valid, _destinations(words, splitters), size)
    perm, send = group_by_rank(bucket, size, host=host_sort)
    matrix = allgather(send)  # (size, size): rows from device i to bucket j, the plan of the exchange
    from_src = matrix[:, rank]
    received = jnp.sum(matrix, axis=0)
    largest = jnp.max(matrix)
    maps: list[Any] = [None] * len(arrays)
    if kbox.periodic:
        maps[at_pos] = _wrap_rows(kbox)
    extra = []
    if number:
        offset = jnp.sum(jnp.where(jnp.arange(size) < rank, per_device[:, 0], 0))
        extra = [offset + rows]
    # A whole share per rank pair and round: balanced traffic takes one round (each round is a collective).
    moved, _ = send_rows(arrays + extra, send, cap, perm=perm, row_maps=maps + [None] * len(extra),
                         chunk=share_chunk(cap, size), plan=(from_src, largest))
    stored = jnp.minimum(received[rank], cap)
    held = jnp.arange(cap, dtype=jnp.int32)
    khi, klo = morton_key(moved[at_pos], kbox, held < stored)
    order = argsort_keys(khi, klo, host=host_sort)  # ties in arrival order; padding (invalid keys) last
    moved = take_rows(moved, order)
    # The held rows by arrival (grouped by sender, each sender's in the order it sent them): the reverse routes.
    back = jnp.zeros((cap,), jnp.int32).at[order].set(held, unique_indices=True)
    route = Routes(perm, send, from_src, back, largest)
    out = rows_of.unpack(moved[:len(arrays)], stored)
    index = moved[-1] if number else None
    return Sorted(out, received[rank] > cap, received[rank], jnp.sum(per_device[:, 1]), kbox, jnp.max(received),
                  route), index


@overload
def zsort(part: T, *, box: Box | None = None, equalize: bool = True, capacity: int | None = None,
          return_domain: Literal[False] = False, num_cells: int = 64) -> tuple[T, jax.Array]: ...


@overload
def zsort(part: T, *, box: Box | None = None, equalize: bool = True, capacity: int | None = None,
          return_domain: Literal[True], num_cells: int = 64) -> tuple[T, jax.Array, Domain]: ...


def zsort(part: T, *, box: Box | None = None, equalize: bool = True, capacity: int | None = None,
          return_domain: bool = False, num_cells: int = 64) -> tuple[T, jax.Array] | tuple[T, jax.Array, Domain]:
    """Sort particles into global Morton (z-) order across all devices (local view; ``zsort.smap`` for global).

    After the call device ``r`` holds a contiguous piece of the global order: keys ascend within each device and
    from device to device, and particles with equal keys keep their global input order (device, then row). Every
    per-particle field travels with its particle.

    Args:
        part: a particle pytree (``.pos (n, d)``, ``.num``), e.g. :class:`Particles`.
        box: periodic box size (scalar or `(d,)`): positions are wrapped into ``[0, box)`` (the returned ``pos``
            is wrapped) and keyed over that box. ``None``: keys over the global bounding box of the particles.
        equalize: rebalance so that device ``r`` holds ``num_total // ndev`` particles, plus one for the first
            ``num_total % ndev`` devices. Without it the counts follow the sample-sort splitters (within a few
            percent of even).
        capacity: rows per device of the result (static); default the input capacity ``n``.
        return_domain: also return the :class:`Domain` of the result (key ranges and bounding boxes).
        num_cells: top-level cells per device in the domain (static).

    Returns:
        ``(part, overflow)`` or ``(part, overflow, domain)``. ``overflow`` is true on a device that had to hold more
        than ``capacity`` rows at some step (rows were lost: raise ``capacity`` and call again). Rows with a NaN or
        infinite coordinate sort after every finite one (``zsort.smap`` rejects them).

    Example:
        >>> import shardax as sx
        >>> from shardax.particles import uniform, zsort
        >>> part = uniform(1000, seed=1)
        >>> zpart, overflow = zsort(part)
        >>> int(zpart.num), bool(overflow)
        (1000, False)
        >>> zpart, overflow = zsort.smap()(sx.particles.uniform.smap()(1000))   # global: (ndev, cap, 3)
    """
    check_part(part, box, "zsort")
    result = sort_particles(part, box, equalize, capacity)
    if return_domain:
        return result.part, result.overflow, domain_of(result.part, result.key_box, num_cells)
    return result.part, result.overflow


def _global_zsort(mesh: Mesh | None = None, *, jit: bool = True, donate: bool = False) -> Callable[..., Any]:
    """``zsort.smap(mesh=None, jit=True, donate=False)``: the global zsort over ``(ndev, n, ...)`` particle arrays.

    The returned function takes the same arguments as :func:`zsort` and returns the same outputs in the global view.
    It raises :class:`shardax.CapacityError` when a device would overflow (with the capacity needed) and
    ``ValueError`` for NaN or infinite positions. Called under an outer ``jax.jit`` it cannot raise: check
    ``overflow`` yourself there. The constructor is cached per ``(mesh, jit, donate)``: ``zsort.smap(mesh)(...)``
    in a loop compiles once per set of static arguments.

    ``donate=True`` (needs ``jit=True``) hands the input particles' buffers to the sort: the sorted fields are
    written into them when ``capacity`` is the input's (the default); the compiled peak memory per device drops a
    little (2.82x -> 2.80x the particle buffers on 8 devices, see docs/particles.md). The input cannot be used
    afterwards, even when the call raises (``CapacityError``, a box that does not fit the positions): keep what you
    need to retry (e.g. the host arrays you built it from).
    """
    if not isinstance(donate, bool) or not isinstance(jit, bool):
        raise TypeError(f"zsort.smap: jit and donate must be bool, got jit={jit!r}, donate={donate!r}")
    if donate and not jit:
        raise ValueError("zsort.smap: donate=True needs jit=True (only a jitted call can reuse the input buffers)")
    return _constructed(mesh, jit, donate)  # checked first: the cache would take donate=1 for donate=True


@functools.cache
def _constructed(mesh: Mesh | None, jit: bool, donate: bool) -> Callable[..., Any]:
    cache: dict[tuple, Callable[..., Any]] = {}

    def call(part: Any, *, box: Box | None = None, equalize: bool = True, capacity: int | None = None,
             return_domain: bool = False, num_cells: int = 64) -> Any:
        if getattr(part, "pos", None) is None or not hasattr(part, "num"):
            raise TypeError(f"zsort.smap: part must be a global particle pytree with .pos and .num, got "
                            f"{type(part).__name__}")
        if jnp.ndim(part.pos) != 3:
            raise ValueError(f"zsort.smap: part.pos must have shape (ndev, n, d) (e.g. from shardax.particles."
                             f"from_numpy), got {jnp.shape(part.pos)}; call zsort() for the local view")
        check_count(part.num, int(jnp.shape(part.pos)[1]), "zsort.smap")
        dtype = jnp.result_type(part.pos)
        if box is not None and not isinstance(box, Tracer) and dtype in (jnp.float32, jnp.float64):
            periodic_box(box, int(jnp.shape(part.pos)[-1]), dtype)  # clear errors before anything is traced
        static_box = box is None or isinstance(box, int | float | tuple)
        leaves, treedef = jax.tree.flatten(part)
        key = (treedef, static_box, box if static_box else None, equalize, capacity, return_domain, num_cells)
        fn = cache.get(key)
        if fn is None:
            def body(leaves: list[jax.Array], box_arg: Any) -> tuple:
                local = jax.tree.unflatten(treedef, leaves)
                result = sort_particles(local, box if static_box else box_arg, equalize, capacity)
                # Every device knows the largest need: no collective for the flags.
                cap = capacity if capacity is not None else jnp.shape(local.pos)[0]
                flags = (result.worst > cap, result.worst, result.nonfinite)
                if box is not None and jnp.issubdtype(local.pos.dtype, jnp.floating):  # checked after the call
                    flags += mapped_bounds(local.pos, local.num)
                dom = domain_of(result.part, result.key_box, num_cells) if return_domain else None
                return result.part, result.overflow, flags, dom

            fn = smap(body, in_specs=(ALL, P() if not static_box else None),
                      out_specs=(ALL, ALL, P(), P()), mesh=mesh, jit=jit, donate_argnums=(0,) if donate else (),
                      name="zsort.smap")
            cache[key] = fn
        out_part, overflow, flags, dom = fn(leaves, None if static_box else box)
        if not isinstance(flags[0], Tracer):
            any_overflow, needed, nonfinite, *span = jax.device_get(flags)  # one transfer
            if span:
                check_bounds(span[0], span[1], box, "zsort.smap")
            if int(nonfinite):
                raise ValueError(f"zsort: {int(nonfinite)} particle(s) have a NaN or infinite coordinate in part.pos; "
                                 "remove them or replace the positions before sorting")
            if int(any_overflow):
                available = capacity if capacity is not None else int(jnp.shape(part.pos)[1])  # type: ignore
                raise CapacityError(
                    f"zsort: a device needed {int(needed)} rows but capacity is {available}; pass capacity="
                    f"{int(needed) + int(needed) // 8 + 1} (or a larger capacity_factor to from_numpy)",
                    needed=int(needed), available=available, argument="capacity")
        return (out_part, overflow, dom) if return_domain else (out_part, overflow)

    return call


zsort.smap = _global_zsort  # type: ignore[attr-defined]
