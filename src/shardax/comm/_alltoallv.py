"""Variable-size exchange: ``alltoallv`` and ``exchange`` (rows to destination ranks), on every backend.

XLA:CPU has no ``ragged_all_to_all``, so the portable path moves rows in fixed-size chunks: each round is one
``all_to_all`` of a ``(size, chunk, ...)`` buffer, ``chunk = ceil(1.25 * capacity / (8 size))``, and the number of rounds
is the largest per-pair count over all ranks divided by ``chunk`` (every rank learns it in the count exchange,
which carries each sender's largest count along); each round scatters
the rows it received straight into place in the receive buffer. Balanced traffic takes about seven rounds and moves
the same bytes as a tiled ``all_to_all``; skewed traffic (everything to one rank) takes up to ``6.4 size`` rounds.
Memory is the receive buffer plus one round's blocks (about 60% of it), whatever the traffic. That is the CPU
preset of :class:`ExchangeTuning`; the GPU preset sizes a round for the whole share (one round, one sequential step,
for balanced traffic). On GPUs ``impl="auto"`` uses ``lax.ragged_all_to_all`` instead.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from typing import Any, Literal

import jax
import jax.numpy as jnp
from jax import lax

from .._hostsort import sort
from .._tuning import resolve_tuning, tuning_backend
from ..core import AxisSpec, axes_size, resolve_axes, vary_over, varying
from . import _mpi_prim as mpi

Impl = Literal["auto", "chunked", "ragged"]
#: Rows per rank pair and round of the chunked path: one size, ``None`` for :func:`default_chunk`, or a ladder of
#: sizes (a tuple) from which each call picks at run time the smallest that moves the largest count in one round
#: (every rank knows that count, so all pick the same; see :func:`chunk_ladder`).
Chunk = int | tuple[int, ...] | None
#: Up to this many ranks :func:`count_by_rank` compares every row with every rank in one fused pass; beyond, it sorts.
COMPARE_RANKS = 16


def _exclusive_cumsum(x: jax.Array) -> jax.Array:
    return jnp.cumsum(x) - x


def _check_capacity(capacity: Any) -> int:
    if not isinstance(capacity, int) or isinstance(capacity, bool) or capacity < 1:
        raise ValueError(f"capacity must be a positive Python int (rows of the receive buffer), got {capacity!r}")
    return capacity


def _exchange_counts(send_counts: jax.Array, axes: tuple[str, ...]) -> jax.Array:
    """Row ``j`` of ``send_counts`` (`(size,)` or `(size, k)`: one or ``k`` words per peer) to rank ``j``; returns
    what every rank sent me, in the same shape (one ``all_to_all`` however many words travel)."""
    if not axes:
        return send_counts
    words = send_counts.reshape(send_counts.shape[0], -1)
    if mpi.mpi_active(axes):
        return mpi.alltoall(words, axes).reshape(send_counts.shape)
    return lax.all_to_all(words, axes, 0, 0, tiled=True).reshape(send_counts.shape)


def _exchange_counts_and_max(send_counts: jax.Array, axes: tuple[str, ...]) -> tuple[jax.Array, jax.Array]:
    """``(recv_counts, largest)``: the rows each rank sends me, and the largest count any rank sends any rank.

    One ``all_to_all``: every rank sends each peer its count for that peer and its own largest count, so the
    global maximum (which fixes the number of chunked rounds) costs no separate ``pmax`` (across processes every
    collective costs milliseconds of latency, whatever its size).
    """
    largest = jnp.max(send_counts, initial=0)
    got = _exchange_counts(jnp.stack([send_counts, jnp.broadcast_to(largest, send_counts.shape)], axis=1), axes)
    return got[:, 0], jnp.max(got[:, 1])


def _use_ragged(impl: Impl) -> bool:
    if impl not in ("auto", "chunked", "ragged"):
        raise ValueError(f"impl must be 'auto', 'chunked' or 'ragged', got {impl!r}")
    backend = jax.default_backend()
    if impl == "ragged":
        if backend == "cpu":
            raise ValueError("impl='ragged' needs a GPU or TPU backend (XLA:CPU does not implement "
                             "ragged_all_to_all): use impl='auto' or impl='chunked'")
        return True
    return impl == "auto" and backend in ("gpu", "cuda", "rocm")


@dataclasses.dataclass(frozen=True)
class ExchangeTuning:
    """Static sizes of the chunked exchange (changing them recompiles).

    Attributes:
        rounds: rounds that near-balanced traffic takes with the default chunk (``1.25 capacity / (rounds size)``
            rows per rank pair and round). On CPU 8: a round's buffers (the send and receive blocks and the per-peer
            pieces XLA:CPU splits them into: four blocks of the round's size) stay near 60% of the receive buffer
            instead of five times it. On GPU 1: every round is a sequential step (its launches and the loop's
            check), and device memory holds a whole share.

    Example:
        >>> import shardax as sx
        >>> from shardax.comm import ExchangeTuning
        >>> from shardax.comm._alltoallv import default_chunk
        >>> default_chunk(8000, 8, "cpu"), default_chunk(8000, 8, "gpu"), default_chunk(8000, 8, ExchangeTuning(2))
        (157, 1250, 625)
    """

    rounds: int = 8

    def __post_init__(self) -> None:
        if isinstance(self.rounds, bool) or not isinstance(self.rounds, int) or self.rounds < 1:
            raise ValueError(f"ExchangeTuning.rounds must be a positive int, got {self.rounds!r}")


PRESETS = {"cpu": ExchangeTuning(rounds=8), "gpu": ExchangeTuning(rounds=1)}


def default_chunk(capacity: int, size: int, tuning: ExchangeTuning | str | None = None) -> int:
    """Rows per rank pair and round of the chunked path: the balanced share plus 25%, over the tuning's ``rounds``
    (an eighth of it on CPU, all of it on GPU; ``tuning`` as in :func:`alltoallv`)."""
    rounds = resolve_tuning(tuning, PRESETS, ExchangeTuning, "alltoallv").rounds
    return max(1, -(-5 * capacity // (4 * rounds * size)))


def share_chunk(capacity: int, size: int) -> int:
    """Rows per rank pair and round when a whole ``capacity / size`` share travels in one round.

    For traffic spread evenly over all ranks, such as a sort's rows or their results going home: the default chunk
    (an eighth of the share, sized for the memory of a sort) would take many rounds, each one collective
    (milliseconds of latency across processes). With a whole share, even traffic takes one round; a round's
    buffers, ``size * chunk`` rows, stay about the size of the ``capacity`` receive buffer. (Traffic to a few
    neighbours, in amounts that depend on the data, is better served by a :func:`chunk_ladder`: one round of a
    whole share could take ``size`` rounds there.)
    """
    return max(1, -(-capacity // size))


def _chunked(arrays: Sequence[jax.Array], send_counts: jax.Array, recv_counts: jax.Array, capacity: int,
             axes: tuple[str, ...], size: int, chunk: Chunk, perm: jax.Array | None,
             recv_at: jax.Array | None, init: Sequence[jax.Array] | None, target: jax.Array | None,
             row_maps: Sequence[Any] | None, largest: jax.Array) -> list[jax.Array]:
    """The portable path: rounds of one fixed-size ``all_to_all`` each, received rows scattered into place.

    Optional (``None`` when unused), for callers that would otherwise materialise copies: ``perm`` (row ``i`` of the send order is
    ``a[perm[i]]``), ``recv_at`` (`(size,)` row where each source's block starts; default packed in rank order),
    ``init`` (the buffers the received rows are written into; default zeros) and ``target`` (`(n,)` int32 aligned
    with the send order, i.e. with ``perm`` when it is given: the row of the receive buffer each sent row goes to,
    sent along with it; rows outside ``[0, capacity)`` are dropped; overrides ``recv_at``). ``row_maps``: per array,
    ``None`` or a function applied to its rows as they are sent (e.g. wrapping positions into a periodic box without
    a wrapped copy of the whole array); it maps `(..., rows, *trailing)` to `(..., rows, *other)` row by row and may
    change the trailing shape and dtype (e.g. positions into their sort keys), in which case ``init`` gives the
    received buffers' shape and dtype. ``largest``: the largest send count over all ranks (from
    :func:`_exchange_counts_and_max`); it fixes the number of rounds. ``chunk``: rows per rank pair and round, or a
    ladder of sizes (see :data:`Chunk`).
    """
    send_offsets = _exclusive_cumsum(send_counts)
    recv_offsets = _exclusive_cumsum(recv_counts) if recv_at is None else recv_at
    if init is None:
        # Zeros that depend on the counts, so that XLA cannot allocate the receive buffers long before the exchange
        # (a constant broadcast may be scheduled at the very start and held through everything before it).
        late = jnp.sum(recv_counts) < 0
        init = [jnp.full((capacity, *a.shape[1:]), late, a.dtype) for a in arrays]
    # The carry's manual-axis type is that of the round's result: everything it is computed from, plus the exchange.
    vary = frozenset(axes).union(*(varying(x) for x in (*arrays, send_counts, recv_counts, recv_offsets)),
                                 *(varying(x) for x in (perm, target) if x is not None))
    outs = vary_over([jnp.asarray(o) for o in init], vary)

    # Arrays of 4- and 8-byte elements travel together: each round packs their rows into the columns of one uint32
    # block (one all_to_all per round, and no packed copy of the whole arrays); other widths travel alone.
    packed = [k for k, o in enumerate(outs) if o.dtype.itemsize in (4, 8)]  # as received (after any row map)
    loose = [k for k in range(len(arrays)) if k not in packed]

    def words(x: jax.Array) -> jax.Array:  # (..., rows, *trailing) -> (..., rows, columns) uint32
        lead = x.shape[:2]
        return lax.bitcast_convert_type(x, jnp.uint32).reshape(*lead, -1)

    def unwords(w: jax.Array, like: jax.Array) -> jax.Array:
        if like.dtype.itemsize == 8:
            return lax.bitcast_convert_type(w.reshape(w.shape[0], *like.shape[1:], 2), like.dtype)
        return lax.bitcast_convert_type(w.reshape(w.shape[0], *like.shape[1:]), like.dtype)

    def exchange_block(buf: jax.Array) -> jax.Array:
        if axes and mpi.mpi_active(axes):
            return mpi.alltoall(buf, axes)
        return lax.all_to_all(buf, axes, 0, 0, tiled=True) if axes else buf

    def gather(k: int, idx: jax.Array) -> jax.Array:
        rows = arrays[k].at[idx].get(mode="clip", wrap_negative_indices=False)
        fn = None if row_maps is None else row_maps[k]
        return rows if fn is None else fn(rows)

    def rounds_of(c: int, outs: list[jax.Array]) -> list[jax.Array]:
        lanes = jnp.arange(c, dtype=jnp.int32)
        rounds = -(-jnp.minimum(largest, capacity) // c)
        return lax.fori_loop(jnp.int32(0), jnp.maximum(rounds, 1).astype(jnp.int32),
                             lambda t, outs: one_round(c, lanes, t, outs), outs)

    def one_round(c: int, lanes: jax.Array, t: jax.Array, outs: list[jax.Array]) -> list[jax.Array]:
        start = t * c
        ok = (start + lanes)[None, :] < send_counts[:, None]  # (size, c)
        at_send = jnp.clip(send_offsets[:, None] + start + lanes[None, :], 0, None)  # position in the send order
        idx = at_send if perm is None else perm[jnp.clip(at_send, 0, max(perm.shape[0] - 1, 0))]
        got = (start + lanes)[None, :] < recv_counts[:, None]
        # Rows past the buffer (overflow) and empty lanes point at row ``capacity`` and are dropped.
        dest = jnp.where(got, recv_offsets[:, None] + start + lanes[None, :], capacity).reshape(-1)
        new = list(outs)

        def send(rows: jax.Array) -> jax.Array:
            trailing = (1,) * (rows.ndim - 2)
            return exchange_block(jnp.where(ok.reshape(ok.shape + trailing), rows, jnp.zeros((), rows.dtype)))

        if target is not None:
            # The target rows travel as the last column of the packed block and place the rows they came with.
            rows_at = words(jnp.take(target.astype(jnp.int32), at_send, axis=0, mode="clip")[..., None])
            blocks = [words(gather(k, idx)) for k in packed] + [rows_at]
            recv = send(jnp.concatenate(blocks, axis=-1) if len(blocks) > 1 else blocks[0]).reshape(size * c, -1)
            at = lax.bitcast_convert_type(recv[:, -1], jnp.int32)
            at = jnp.where((at >= 0) & (at < capacity), at, capacity)
            dest = jnp.where(got.reshape(-1), at, capacity)
            blocks = blocks[:-1]
        elif packed:
            blocks = [words(gather(k, idx)) for k in packed]
            recv = send(jnp.concatenate(blocks, axis=-1) if len(blocks) > 1 else blocks[0])
            recv = recv.reshape(size * c, -1)
        if packed:
            col = 0
            for k, block in zip(packed, blocks, strict=True):
                width = block.shape[-1]
                rows = unwords(recv[:, col:col + width], outs[k])  # the received shape (a row map may change it)
                col += width
                new[k] = outs[k].at[dest].set(rows, mode="drop")
        for k in loose:
            recv = send(gather(k, idx))  # after ``dest`` (which ``target`` may set)
            new[k] = outs[k].at[dest].set(recv.reshape(size * c, *outs[k].shape[1:]), mode="drop")
        return new

    sizes = _chunk_sizes(chunk, capacity, size)
    if len(sizes) == 1:
        return rounds_of(sizes[0], outs)
    # Every rank knows ``largest``, so all take the same branch: the smallest size that moves it in one round.
    pick = jnp.sum(jnp.asarray(sizes[:-1], jnp.int32) < jnp.minimum(largest, capacity)).astype(jnp.int32)
    return lax.switch(pick, [functools.partial(rounds_of, c) for c in sizes], outs)


def _check_chunk(chunk: Any) -> None:
    def positive(c: Any) -> bool:
        return isinstance(c, int) and not isinstance(c, bool) and c > 0

    if chunk is None or positive(chunk) or (isinstance(chunk, tuple) and chunk and all(map(positive, chunk))):
        return
    raise ValueError(f"chunk must be None, a positive int or a non-empty tuple of positive ints (rows per rank "
                     f"pair and round), got {chunk!r}")


def _chunk_sizes(chunk: Chunk, capacity: int, size: int) -> tuple[int, ...]:
    if chunk is None:
        return (default_chunk(capacity, size),)
    if isinstance(chunk, int):
        return (max(1, chunk),)
    sizes = tuple(sorted({max(1, min(int(c), capacity)) for c in chunk}))
    if not sizes:
        raise ValueError("chunk: an empty ladder of chunk sizes")
    return sizes


def chunk_ladder(capacity: int, steps: int = 4) -> tuple[int, ...]:
    """Rows per rank pair and round for exchanges whose largest count varies widely at run time: ``capacity``,
    halved ``steps - 1`` times (e.g. ``capacity / 8 ... capacity``).

    Passed as ``chunk``, the exchange picks at run time the smallest size that holds the largest count in one
    round: one collective whatever the traffic, and at most twice the rows that traffic needs (above
    ``capacity / 2**(steps - 1)``). For boundary exchanges (ghosts and their labels), whose largest pair count is
    a fraction of the buffer that depends on the data; each size compiles a loop of its own.

    Example:
        >>> import shardax as sx
        >>> sx.comm.chunk_ladder(1000)
        (125, 250, 500, 1000)
        >>> # inside smap: sx.comm.alltoallv(rows, counts, capacity=1000, chunk=sx.comm.chunk_ladder(1000))
    """
    capacity = _check_capacity(capacity)
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"steps must be a positive int, got {steps!r}")
    return tuple(sorted({max(1, -(-capacity // 2**k)) for k in range(steps)}))


def ragged_plan(send_counts: jax.Array, recv_counts: jax.Array, capacity: int, axes: tuple[str, ...],
                recv_at: jax.Array | None = None) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """Arguments of ``lax.ragged_all_to_all`` for a receive buffer of ``capacity`` rows.

    Returns ``(input_offsets, send_sizes, output_offsets, recv_sizes)``, each ``(size,)`` int32: where my block for
    peer ``j`` starts in my rows, how many of its rows fit at ``j``, where it goes in ``j``'s buffer, and how many rows
    I take from ``j``. Blocks are packed in rank order unless ``recv_at`` (`(size,)`, where each source's block
    starts) says otherwise. Rows that would not fit are neither sent nor received (the caller reports overflow).
    """
    recv_offsets = (_exclusive_cumsum(recv_counts) if recv_at is None else recv_at).astype(jnp.int32)
    recv_sizes = jnp.clip(capacity - recv_offsets, 0, recv_counts).astype(jnp.int32)
    # Each receiver tells each sender how much fits and where in its buffer the block goes (one all_to_all).
    told = _exchange_counts(jnp.stack([recv_sizes, recv_offsets], axis=1), axes)
    send_sizes, output_offsets = told[:, 0], told[:, 1]
    input_offsets = _exclusive_cumsum(send_counts).astype(jnp.int32)
    return input_offsets, send_sizes, output_offsets, recv_sizes


def _ragged(arrays: Sequence[jax.Array], send_counts: jax.Array, recv_counts: jax.Array, capacity: int,
            axes: tuple[str, ...], perm: jax.Array | None = None, recv_at: jax.Array | None = None,
            init: Sequence[jax.Array] | None = None) -> list[jax.Array]:
    input_offsets, send_sizes, output_offsets, recv_sizes = ragged_plan(send_counts, recv_counts, capacity, axes,
                                                                        recv_at)
    outs = []
    for k, a in enumerate(arrays):
        out = jnp.zeros((capacity, *a.shape[1:]), a.dtype) if init is None else init[k]
        source = a if perm is None else jnp.take(a, perm, axis=0, mode="clip")
        outs.append(lax.ragged_all_to_all(source, out, input_offsets, send_sizes, output_offsets, recv_sizes,
                                          axis_name=axes))
    return outs


def count_by_rank(key: jax.Array, size: int) -> jax.Array:
    """`(size,)` int32 number of entries of ``key`` (`(n,)` int) equal to each rank ``0 .. size - 1`` (others are
    not counted).

    On GPUs no scatter-add: a histogram of many rows into a few bins piles every add onto the same addresses, which
    GPUs serialise (10^7 rows into one bin take far longer than a sort of them). Up to :data:`COMPARE_RANKS` ranks,
    one fused compare-and-sum pass over the rows; beyond, a sort of the keys and a binary search for each rank's
    first row. XLA:CPU adds the rows one after another (no contention) and would hold the compared `(n, size)`
    block in memory, so the CPU preset (:func:`shardax.runtime.tuning_backend`) keeps the scatter-add.

    Example:
        >>> import jax.numpy as jnp
        >>> from shardax.comm._alltoallv import count_by_rank
        >>> count_by_rank(jnp.array([2, 0, 2, 5, 2]), 3).tolist()
        [1, 0, 3]
    """
    key = key.astype(jnp.int32)
    if tuning_backend() == "cpu":
        return jnp.zeros((size + 1,), jnp.int32).at[jnp.where((key >= 0) & (key < size), key, size)].add(1)[:size]
    if size <= COMPARE_RANKS:
        ranks = jnp.arange(size, dtype=jnp.int32)
        return jnp.sum(key[:, None] == ranks[None, :], axis=0, dtype=jnp.int32)
    return _sorted_counts(lax.sort(key), size, 1)


def _sorted_counts(words: jax.Array, size: int, n: int) -> jax.Array:
    """Rows of each rank in ascending ``words`` whose rank is ``word // n`` (words ``>= size * n`` not counted).

    A binary search per rank: a loop of ``log2(len(words))`` small steps on CPU; on GPUs, where each loop step is
    a launch, one fused compare-and-sum pass for a few ranks, a sort of the queries into the words for many."""
    method = "scan" if tuning_backend() == "cpu" else "compare_all" if size < COMPARE_RANKS else "sort"
    bounds = jnp.searchsorted(words, jnp.arange(size + 1, dtype=words.dtype) * n, side="left", method=method)
    return jnp.diff(bounds).astype(jnp.int32)


def group_by_rank(key: jax.Array, size: int, *, host: bool = False) -> tuple[jax.Array, jax.Array]:
    """``(perm, counts)``: rows grouped by ``key`` (`(n,)` int in ``[0, size]``, ``size`` for rows not sent), each
    group in row order, and the rows for each of the ``size`` ranks.

    One sort of a single int32 word ``key * n + row`` (XLA:CPU sorts one operand several times faster than a key
    with a payload); a stable argsort when that word would overflow. The counts come from the sorted keys (a
    binary search per rank, no histogram). ``host``: sort by NumPy on CPU devices (:mod:`shardax._hostsort`;
    kernels pass it, the public ``alltoallv`` keeps programs free of host callbacks).
    """
    n = key.shape[0]
    if (size + 1) * n < 2**31:
        word = key.astype(jnp.int32) * n + jnp.arange(n, dtype=jnp.int32)
        ordered = sort(word) if host else lax.sort(word)
        return ordered % n, _sorted_counts(ordered, size, n)
    perm = jnp.argsort(key, stable=True).astype(jnp.int32)
    return perm, _sorted_counts(key.astype(jnp.int32)[perm], size, 1)


def _local_copy(arrays: Sequence[jax.Array], count: jax.Array, capacity: int, perm: jax.Array | None,
                recv_at: jax.Array | None, init: Sequence[jax.Array] | None, target: jax.Array | None,
                row_maps: Sequence[Any] | None) -> list[jax.Array]:
    """What the exchange delivers on one device: the first ``count`` rows of the send order into the receive
    buffers (at ``recv_at[0]`` on, or at their ``target`` rows), with no rounds, counts or collectives."""
    outs = []
    for k, a in enumerate(arrays):
        fn = None if row_maps is None else row_maps[k]
        n = a.shape[0]
        rows = jnp.arange(n, dtype=jnp.int32)
        if perm is None and target is None and recv_at is None and init is None and fn is None:
            # Rows stay where they are: pad or cut to the buffer and clear the rows past ``count``.
            kept = jnp.pad(a, [(0, max(capacity - n, 0))] + [(0, 0)] * (a.ndim - 1))[:capacity]
            live = jnp.arange(capacity) < count
            outs.append(jnp.where(live.reshape(-1, *(1,) * (a.ndim - 1)), kept, jnp.zeros((), a.dtype)))
            continue
        source = a if perm is None else jnp.take(a, perm, axis=0, mode="clip")
        source = source if fn is None else fn(source)
        if target is not None:
            at = target.astype(jnp.int32)
            at = jnp.where((at >= 0) & (at < capacity), at, capacity)
        else:
            at = rows + (0 if recv_at is None else recv_at[0].astype(jnp.int32))
        at = jnp.where(rows < count, at, capacity)
        out = jnp.zeros((capacity, *source.shape[1:]), source.dtype) if init is None else jnp.asarray(init[k])
        outs.append(out.at[at].set(source.astype(out.dtype), mode="drop"))
    return outs


def alltoallv_many(arrays: Sequence[jax.Array], send_counts: jax.Array, capacity: int, axes: tuple[str, ...],
                    impl: Impl, chunk: Chunk, *, perm: jax.Array | None = None, recv_at: jax.Array | None = None,
                    init: Sequence[jax.Array] | None = None, target: jax.Array | None = None,
                    row_maps: Sequence[Any] | None = None, plan: tuple[jax.Array, jax.Array] | None = None
                    ) -> tuple[list[jax.Array], jax.Array, jax.Array]:
    """``alltoallv`` of several arrays with one count exchange; ``perm``, ``recv_at``, ``init``, ``target`` and
    ``row_maps`` as in :func:`_chunked` (they let callers skip a permuted copy of the rows, receive into a prepared
    buffer, place every row at its own row of the receiver, or transform rows on the way). ``plan``: the
    ``(recv_counts, largest)`` of :func:`_exchange_counts_and_max` when the caller already knows them (a route
    travelled before, either way): no count exchange then."""
    size = axes_size(axes)
    send_counts = jnp.maximum(jnp.asarray(send_counts, jnp.int32), 0)
    if send_counts.shape != (size,):
        raise ValueError(f"send_counts must have shape ({size},) (one count per rank), got {send_counts.shape}")
    if size == 1:  # nothing travels: no count exchange, no rounds
        if axes:
            _use_ragged(impl)  # (checks the argument)
        recv_counts = send_counts
        overflow = send_counts[0] + (0 if recv_at is None else recv_at[0]) > capacity
        outs = _local_copy(arrays, send_counts[0], capacity, perm, recv_at, init, target, row_maps)
        return vary_over(outs, axes), recv_counts, overflow
    if any(_inexact(a) for a in arrays) or any(_inexact(a) for a in init or ()):
        # Float rows get a gradient rule (the chunked rounds move them as uint32 words, which autodiff sees as
        # constants): see :mod:`shardax.comm._alltoallv_ad`.
        from . import _alltoallv_ad as ad

        return ad.differentiable(arrays, send_counts, capacity, axes, impl, chunk, perm=perm, recv_at=recv_at,
                                 init=init, target=target, row_maps=row_maps, plan=plan)
    return alltoallv_raw(arrays, send_counts, capacity, axes, impl, chunk, perm=perm, recv_at=recv_at, init=init,
                         target=target, row_maps=row_maps, plan=plan)


def _inexact(a: Any) -> bool:
    return jnp.issubdtype(jnp.result_type(a), jnp.inexact)


def alltoallv_raw(arrays: Sequence[jax.Array], send_counts: jax.Array, capacity: int, axes: tuple[str, ...],
                  impl: Impl, chunk: Chunk, *, perm: jax.Array | None = None, recv_at: jax.Array | None = None,
                  init: Sequence[jax.Array] | None = None, target: jax.Array | None = None,
                  row_maps: Sequence[Any] | None = None, plan: tuple[jax.Array, jax.Array] | None = None
                  ) -> tuple[list[jax.Array], jax.Array, jax.Array]:
    """:func:`alltoallv_many` on two or more ranks, without a gradient rule (``send_counts`` checked, int32)."""
    size = axes_size(axes)
    if plan is None and recv_at is None and init is None and target is None and mpi.mpi_active(axes):
        return _mpi_packed(arrays, send_counts, capacity, axes, perm, row_maps)
    recv_counts, largest = _exchange_counts_and_max(send_counts, axes) if plan is None else plan
    if recv_at is None:
        overflow = jnp.sum(recv_counts) > capacity
    else:
        overflow = jnp.any(recv_at + recv_counts > capacity)
    if axes and _use_ragged(impl) and row_maps is not None:
        arrays = [a if fn is None else fn(a) for a, fn in zip(arrays, row_maps, strict=True)]
        row_maps = None
    if axes and _use_ragged(impl) and target is not None:
        # Packed by source first, then every row scattered to its target row.
        packed = _ragged(arrays, send_counts, recv_counts, capacity, axes, perm)
        (at,) = _ragged([target.astype(jnp.int32)], send_counts, recv_counts, capacity, axes)  # in send order
        live = jnp.arange(capacity, dtype=jnp.int32) < jnp.sum(recv_counts)
        at = jnp.where(live & (at >= 0) & (at < capacity), at, capacity)
        outs = [(jnp.zeros((capacity, *a.shape[1:]), a.dtype) if init is None else init[k]).at[at].set(p, mode="drop")
                for k, (a, p) in enumerate(zip(arrays, packed, strict=True))]
    elif axes and _use_ragged(impl):
        outs = _ragged(arrays, send_counts, recv_counts, capacity, axes, perm, recv_at, init)
    else:
        outs = _chunked(arrays, send_counts, recv_counts, capacity, axes, size, chunk, perm, recv_at, init, target,
                        row_maps, largest)
    return outs, recv_counts, overflow


def _to_bytes(a: jax.Array) -> jax.Array:
    if a.dtype == jnp.bool_:
        a = a.astype(jnp.uint8)
    b = lax.bitcast_convert_type(a, jnp.uint8)
    return b.reshape(a.shape[0], -1)


def _from_bytes(b: jax.Array, like: jax.Array) -> jax.Array:
    shape = (b.shape[0], *like.shape[1:])
    if like.dtype == jnp.bool_:
        return b.reshape(shape) != 0
    if like.dtype.itemsize == 1:
        return lax.bitcast_convert_type(b.reshape(shape), like.dtype)
    return lax.bitcast_convert_type(b.reshape(*shape, like.dtype.itemsize), like.dtype)


def _mpi_packed(arrays: Sequence[jax.Array], send_counts: jax.Array, capacity: int, axes: tuple[str, ...],
                perm: jax.Array | None, row_maps: Sequence[Any] | None
                ) -> tuple[list[jax.Array], jax.Array, jax.Array]:
    """The MPI transport's ``alltoallv``: every array's rows as bytes side by side, one ``MPI_Alltoallv``."""
    if row_maps is not None:
        arrays = [a if fn is None else fn(a) for a, fn in zip(arrays, row_maps, strict=True)]
    if perm is not None:
        arrays = [jnp.take(a, perm, axis=0, mode="clip") for a in arrays]
    if len(arrays) == 1:  # the host call moves any dtype as bytes itself
        data, recv_counts = mpi.ragged(arrays[0], send_counts, capacity, axes)
        return [data], recv_counts, jnp.sum(recv_counts) > capacity
    columns = [_to_bytes(a) for a in arrays]
    widths = [c.shape[1] for c in columns]
    data, recv_counts = mpi.ragged(jnp.concatenate(columns, axis=1) if len(columns) > 1 else columns[0],
                                   send_counts, capacity, axes)
    outs, col = [], 0
    for a, width in zip(arrays, widths, strict=True):
        outs.append(_from_bytes(data[:, col:col + width], a))
        col += width
    return outs, recv_counts, jnp.sum(recv_counts) > capacity


def alltoallv(x: jax.Array, send_counts: jax.Array, *, capacity: int, axis: AxisSpec = None,
              impl: Impl = "auto", chunk: Chunk = None, tuning: ExchangeTuning | str | None = None
              ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Variable-size all-to-all (``MPI_Alltoallv``) with a fixed-size receive buffer.

    Args:
        x: ``(n, ...)`` rows grouped by destination: the first ``send_counts[0]`` rows go to rank 0, the next
            ``send_counts[1]`` to rank 1, and so on; rows past ``sum(send_counts)`` are ignored.
        send_counts: ``(size,)`` int rows for each rank.
        capacity: rows of the receive buffer (static).
        axis: the mesh axes to exchange over (default: all manual axes).
        impl: ``"auto"`` (``ragged_all_to_all`` on GPU, chunked ``all_to_all`` elsewhere), ``"chunked"`` or
            ``"ragged"``.
        chunk: rows per rank pair and round of the chunked path (default :func:`default_chunk`:
            ``ceil(1.25 * capacity / (8 size))`` on CPU, ``ceil(1.25 * capacity / size)`` on GPU), or a tuple of
            sizes from which each call picks at run time the smallest that moves the largest count in one round
            (e.g. :func:`chunk_ladder`: one collective for traffic whose size varies; each size compiles a loop of
            its own).
        tuning: the default chunk's preset: ``None`` for the backend's (``SHARDAX_TUNING`` overrides), ``"cpu"``,
            ``"gpu"`` or an :class:`ExchangeTuning`.

    Returns:
        ``(data, recv_counts, overflow)``: ``data (capacity, ...)`` holds the received rows packed and grouped by
        source rank in rank order (zeros after them); ``recv_counts (size,)`` int32 rows received from each rank
        (even when they did not all fit); ``overflow`` is true on a rank that received more than ``capacity`` rows
        (the rows past ``capacity`` were not stored: raise ``capacity`` and call again).

    Differentiable in ``x`` (floating dtypes; reverse mode): the gradient is the reverse exchange, each received
    row's cotangent back to the row it came from; rows that did not fit get zero.

    Example:
        >>> import jax.numpy as jnp, shardax as sx
        >>> from jax.sharding import PartitionSpec as P
        >>> def f():
        ...     rank, size, _ = sx.rank_info()
        ...     counts = jnp.full((size,), 2, jnp.int32)            # two rows for every rank
        ...     rows = jnp.full((2 * size,), rank, jnp.int32)
        ...     return sx.comm.alltoallv(rows, counts, capacity=2 * size)
        >>> data, recv, overflow = sx.smap(f, in_specs=(), out_specs=P(sx.ALL))()
        >>> bool(overflow.any())
        False
    """
    capacity = _check_capacity(capacity)
    _check_chunk(chunk)
    axes = resolve_axes(axis)
    x = jnp.asarray(x)
    if x.ndim == 0:
        raise ValueError("alltoallv needs x with a leading row dimension, got a scalar")
    if chunk is None:
        chunk = default_chunk(capacity, axes_size(axes), tuning)
    outs, recv_counts, overflow = alltoallv_many([x], send_counts, capacity, axes, impl, chunk)
    return outs[0], recv_counts, overflow


def _row_count(tree: Any) -> int:
    pos = getattr(tree, "pos", None)
    if pos is not None:
        return int(jnp.shape(pos)[0])
    leaves = jax.tree.leaves(tree)
    if not leaves or jnp.ndim(leaves[0]) == 0:
        raise ValueError("exchange needs a pytree with a `.pos` field or whose first leaf has a leading row axis")
    return int(jnp.shape(leaves[0])[0])


def _with_num(tree: Any, num: jax.Array) -> Any:
    if not hasattr(tree, "num"):
        return tree
    if dataclasses.is_dataclass(tree) and not isinstance(tree, type):
        return dataclasses.replace(tree, num=num)
    replace = getattr(tree, "_replace", None)  # namedtuple
    return replace(num=num) if replace is not None else tree


def exchange(tree: Any, dest: jax.Array, *, num: jax.Array | int, capacity: int, axis: AxisSpec = None,
             impl: Impl = "auto", tuning: ExchangeTuning | str | None = None) -> tuple[Any, jax.Array, jax.Array]:
    """Send each of the first ``num`` rows of a particle pytree to rank ``dest[i]``.

    Every leaf whose leading length equals the row count (that of ``tree.pos``, or of the first leaf) travels with
    its row; other leaves are returned unchanged. Rows arrive packed, grouped by source rank in rank order, each
    source's rows in their original order (the result is deterministic). A ``.num`` field of ``tree`` (dataclass or
    namedtuple) is replaced by the new count.

    Args:
        tree: a pytree such as :class:`shardax.particles.Particles` (rows ``(n, ...)``).
        dest: ``(n,)`` int destination rank of each row (rows ``>= num`` are ignored).
        num: number of valid rows.
        capacity: rows of every travelling leaf after the exchange (static).
        axis: the mesh axes to exchange over.
        impl: as in :func:`alltoallv`.
        tuning: as in :func:`alltoallv`.

    Returns:
        ``(tree, num, overflow)``: leaves with leading length ``capacity``; ``num`` int32 rows now held (at most
        ``capacity``); ``overflow`` true on a rank that received more than ``capacity`` rows, or that was asked to
        send a valid row to a rank outside ``[0, size)`` (such rows are not sent).

    Differentiable in the floating leaves (reverse mode): the gradient is the reverse exchange, each row's
    cotangent back to the row it came from; rows not sent or not stored get zero, integer leaves none.

    Example:
        >>> import jax.numpy as jnp, shardax as sx
        >>> from jax.sharding import PartitionSpec as P
        >>> def f():
        ...     rank, size, _ = sx.rank_info()
        ...     pos = jnp.full((4, 3), rank, jnp.float32)
        ...     dest = jnp.zeros((4,), jnp.int32)                     # everything to rank 0
        ...     return sx.comm.exchange({"pos": pos}, dest, num=4, capacity=4 * size)
        >>> tree, num, overflow = sx.smap(f, in_specs=(), out_specs=P(sx.ALL))()
        >>> int(num[0]) == 4 * sx.world().device_count
        True
    """
    capacity = _check_capacity(capacity)
    axes = resolve_axes(axis)
    size = axes_size(axes)
    n = _row_count(tree)
    dest = jnp.asarray(dest)
    if dest.shape != (n,):
        raise ValueError(f"dest must have shape ({n},) (one rank per row of the tree), got {dest.shape}")
    if not jnp.issubdtype(dest.dtype, jnp.integer):
        raise TypeError(f"dest must be an integer array of ranks, got dtype {dest.dtype}")
    num = jnp.minimum(jnp.asarray(num, jnp.int32), n)
    rows = jnp.arange(n, dtype=jnp.int32)
    valid = rows < num
    dest = dest.astype(jnp.int32)
    bad = valid & ((dest < 0) | (dest >= size))
    leaves, treedef = jax.tree.flatten(tree)
    moving = [i for i, leaf in enumerate(leaves) if jnp.ndim(leaf) >= 1 and jnp.shape(leaf)[0] == n]
    arrays = [jnp.asarray(leaves[i]) for i in moving]
    if size == 1:  # the rows stay: drop the invalid ones and close the gaps (no sort, no collective)
        if axes:
            _use_ragged(impl)  # (checks the argument)
        keep = valid & ~bad
        recv_counts = jnp.sum(keep, dtype=jnp.int32)[None]
        at = jnp.where(keep, jnp.cumsum(keep, dtype=jnp.int32) - 1, capacity)
        outs = vary_over([jnp.zeros((capacity, *a.shape[1:]), a.dtype).at[at].set(a, mode="drop") for a in arrays],
                         axes)
        overflow = recv_counts[0] > capacity
    else:
        order, send_counts = group_by_rank(jnp.where(valid & ~bad, dest, size), size)
        outs, recv_counts, overflow = alltoallv_many(arrays, send_counts, capacity, axes, impl,
                                                     default_chunk(capacity, size, tuning), perm=order)
    new_leaves = list(leaves)
    for i, out in zip(moving, outs, strict=True):
        new_leaves[i] = out
    new_num = jnp.minimum(jnp.sum(recv_counts), capacity).astype(jnp.int32)
    overflow = overflow | jnp.any(bad)
    out_tree = _with_num(jax.tree.unflatten(treedef, new_leaves), new_num)
    return out_tree, new_num, overflow
