"""The engine of the variable-size exchange (``sx.comm.alltoallv`` and ``exchange``, and the kernels built on it).

XLA:CPU has no ``ragged_all_to_all``, so the portable path moves rows in fixed-size chunks: each round is one
``all_to_all`` of a ``(size, chunk, ...)`` block, ``chunk = ceil(1.25 * capacity / (8 size))``, and the number of
rounds is the largest count between two different ranks divided by ``chunk`` (every rank learns it in the count
exchange, which carries each sender's largest count along); each round scatters the rows it received straight into
place in the receive buffer. The rows a rank sends itself never enter a round: they are copied into place locally, so
traffic that mostly stays home (particles that moved a little) takes a round or two. Balanced traffic takes about
seven rounds and moves the same bytes as a tiled ``all_to_all``; skewed traffic (everything to one rank) takes up to
``6.4 size`` rounds. Memory is the receive buffer plus one round's blocks (about 60% of it), whatever the traffic.
That is the CPU preset of :class:`ExchangeTuning`; the GPU preset sizes a round for the whole share (one round, one
sequential step, for balanced traffic).

This module holds what does not depend on how blocks travel: the sizing of rounds (:func:`default_chunk`,
:func:`share_chunk`, :func:`chunk_ladder`), the rounds themselves (:func:`chunked`, written against an ``all_to_all``
of one block that the caller supplies: XLA's, or the MPI transport's in :mod:`shardax.comm`) and the one-device copy
(:func:`local_copy`). The transports, the count exchange and the gradient rule live in :mod:`shardax.comm`.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from ._tuning import resolve_tuning
from .core import axes_index, vary_over, varying

#: Rows per rank pair and round of the chunked path: one size, ``None`` for :func:`default_chunk`, or a ladder of
#: sizes (a tuple) from which each call picks at run time the smallest that moves the largest count in one round
#: (every rank knows that count, so all pick the same; see :func:`chunk_ladder`).
Chunk = int | tuple[int, ...] | None
#: An ``all_to_all`` of one ``(size, ...)`` block over the exchange's axes: row ``d`` to rank ``d``.
AllToAll = Callable[[jax.Array], jax.Array]


# ------------------------------------------------------------------------------------------------ sizing the rounds


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
        >>> from shardax.comm import ExchangeTuning
        >>> from shardax._exchange import default_chunk
        >>> default_chunk(8000, 8, "cpu"), default_chunk(8000, 8, "gpu"), default_chunk(8000, 8, ExchangeTuning(2))
        (157, 1250, 625)
    """

    rounds: int = 8

    def __post_init__(self) -> None:
        if isinstance(self.rounds, bool) or not isinstance(self.rounds, int) or self.rounds < 1:
            raise ValueError(f"ExchangeTuning.rounds must be a positive int, got {self.rounds!r}")


PRESETS = {"cpu": ExchangeTuning(rounds=8), "gpu": ExchangeTuning(rounds=1)}


def check_capacity(capacity: Any) -> int:
    """``capacity`` if it is a positive Python int (rows of a receive buffer), else a ``ValueError``."""
    if not isinstance(capacity, int) or isinstance(capacity, bool) or capacity < 1:
        raise ValueError(f"capacity must be a positive Python int (rows of the receive buffer), got {capacity!r}")
    return capacity


def check_chunk(chunk: Any) -> None:
    """A ``ValueError`` unless ``chunk`` is a :data:`Chunk`."""
    def positive(c: Any) -> bool:
        return isinstance(c, int) and not isinstance(c, bool) and c > 0

    if chunk is None or positive(chunk) or (isinstance(chunk, tuple) and chunk and all(map(positive, chunk))):
        return
    raise ValueError(f"chunk must be None, a positive int or a non-empty tuple of positive ints (rows per rank "
                     f"pair and round), got {chunk!r}")


def default_chunk(capacity: int, size: int, tuning: ExchangeTuning | str | None = None) -> int:
    """Rows per rank pair and round of the chunked path: the balanced share plus 25%, over the tuning's ``rounds``
    (an eighth of it on CPU, all of it on GPU; ``tuning`` as in :func:`shardax.comm.alltoallv`)."""
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
    capacity = check_capacity(capacity)
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"steps must be a positive int, got {steps!r}")
    return tuple(sorted({max(1, -(-capacity // 2**k)) for k in range(steps)}))


def chunk_sizes(chunk: Chunk, capacity: int, size: int) -> tuple[int, ...]:
    """The round sizes ``chunk`` stands for, ascending (one, or a ladder's, each at most ``capacity``)."""
    if chunk is None:
        return (default_chunk(capacity, size),)
    if isinstance(chunk, int):
        return (max(1, chunk),)
    sizes = tuple(sorted({max(1, min(int(c), capacity)) for c in chunk}))
    if not sizes:
        raise ValueError("chunk: an empty ladder of chunk sizes")
    return sizes


def exclusive_cumsum(x: jax.Array) -> jax.Array:
    """Where each block starts when blocks of ``x`` rows are laid end to end."""
    return jnp.cumsum(x) - x


# ------------------------------------------------------------------------------------------------ options and carries


class Placement(NamedTuple):
    """How rows are taken from the send arrays and put into the receive buffers (each ``None`` when unused).

    They let callers skip copies they would otherwise build:

    - ``perm``: `(n,)` int, row ``i`` of the send order is ``a[perm[i]]`` (no permuted copy of the arrays);
    - ``recv_at``: `(size,)` int, the row where each source's block starts (default packed in rank order);
    - ``init``: per array, the buffer the received rows are written into (default zeros);
    - ``target``: `(n,)` int32 aligned with the send order (with ``perm`` when it is given): the row of the
      receive buffer each sent row goes to, sent along with it; rows outside ``[0, capacity)`` are dropped;
      overrides ``recv_at``;
    - ``row_maps``: per array, ``None`` or a function applied to its rows as they are sent (e.g. wrapping positions
      into a periodic box without a wrapped copy of the whole array). It maps `(..., rows, *trailing)` to
      `(..., rows, *other)` row by row and may change the trailing shape and dtype (e.g. positions into their sort
      keys), in which case ``init`` gives the received buffers' shape and dtype.
    """

    perm: jax.Array | None = None
    recv_at: jax.Array | None = None
    init: Sequence[jax.Array] | None = None
    target: jax.Array | None = None
    row_maps: Sequence[Any] | None = None

    def row_map(self, k: int) -> Any:
        """Array ``k``'s row map, or ``None``."""
        return None if self.row_maps is None else self.row_maps[k]


#: No placement options: rows sent in order, received packed by source into zeros.
PACKED = Placement()


class Route(NamedTuple):
    """The counts of one exchange, as every round reads them (all `(size,)` int32 but ``largest``)."""

    send_counts: jax.Array  # rows I send to each rank
    send_offsets: jax.Array  # where each rank's rows start in my send order
    recv_counts: jax.Array  # rows each rank sends me
    recv_offsets: jax.Array  # where each source's rows start in my receive buffer
    largest: jax.Array  # () the largest count any rank sends another rank (or more): it fixes the number of rounds


class Rounds(NamedTuple):
    """What fixes the shapes of the rounds (static): the buffers' rows, the ranks, and which arrays travel together.

    Arrays whose received elements are 4 or 8 bytes wide (``packed``) travel together: each round packs their rows
    into the columns of one ``uint32`` block (one ``all_to_all`` per round, and no packed copy of the whole
    arrays); the others (``loose``) travel alone, one ``all_to_all`` each."""

    capacity: int
    size: int
    packed: tuple[int, ...]
    loose: tuple[int, ...]


class Lanes(NamedTuple):
    """Round ``t``'s view of the rows (``c`` lanes per rank pair): what each lane sends and where it lands."""

    sending: jax.Array  # (size, c) bool: the lane carries one of my rows
    at_send: jax.Array  # (size, c) its position in my send order
    rows: jax.Array  # (size, c) the row of the send arrays it carries (``perm`` applied)
    receiving: jax.Array  # (size, c) bool: the lane brings me a row
    dest: jax.Array  # (size * c,) the row of my buffers it lands at (``capacity``: dropped)


class Received(NamedTuple):
    """The loop carry: the receive buffers, one per array, `(capacity, ...)`."""

    buffers: tuple[jax.Array, ...]


# ---------------------------------------------------------------------------------------------------- the steps


def plan_route(send_counts: jax.Array, recv_counts: jax.Array, largest: jax.Array,
               recv_at: jax.Array | None) -> Route:
    """The offsets of the send order and of the receive buffer (packed in rank order unless ``recv_at``)."""
    send_offsets = exclusive_cumsum(send_counts)
    recv_offsets = exclusive_cumsum(recv_counts) if recv_at is None else recv_at
    return Route(send_counts, send_offsets, recv_counts, recv_offsets, largest)


def initial_buffers(arrays: Sequence[jax.Array], route: Route, capacity: int, place: Placement,
                    axes: tuple[str, ...]) -> Received:
    """The buffers the rounds write into (``place.init``, or zeros), typed as varying like a round's result."""
    init = place.init
    if init is None:
        # Zeros that depend on the counts, so that XLA cannot allocate the receive buffers long before the exchange
        # (a constant broadcast may be scheduled at the very start and held through everything before it).
        late = jnp.sum(route.recv_counts) < 0
        init = [jnp.full((capacity, *a.shape[1:]), late, a.dtype) for a in arrays]
    # The carry's manual-axis type is that of the round's result: everything it is computed from, plus the exchange.
    vary = frozenset(axes).union(*(varying(x) for x in (*arrays, route.send_counts, route.recv_counts,
                                                        route.recv_offsets)),
                                 *(varying(x) for x in (place.perm, place.target) if x is not None))
    return Received(tuple(vary_over([jnp.asarray(o) for o in init], vary)))


def group_by_width(buffers: Sequence[jax.Array], capacity: int, size: int) -> Rounds:
    """:class:`Rounds` for these receive buffers (as received, i.e. after any row map)."""
    packed = tuple(k for k, o in enumerate(buffers) if o.dtype.itemsize in (4, 8))
    loose = tuple(k for k in range(len(buffers)) if k not in packed)
    return Rounds(capacity, size, packed, loose)


def round_lanes(route: Route, place: Placement, capacity: int, t: jax.Array, lanes: jax.Array,
                me: jax.Array | int) -> Lanes:
    """Round ``t`` moves rows ``t * c .. t * c + c - 1`` of every rank pair's block (``lanes = arange(c)``) but the
    rows a rank keeps (rank ``me``'s block: :func:`own_rows` copies them)."""
    start = t * lanes.shape[0]
    peer = (jnp.arange(route.send_counts.shape[0], dtype=jnp.int32) != me)[:, None]
    sending = peer & ((start + lanes)[None, :] < route.send_counts[:, None])
    at_send = jnp.clip(route.send_offsets[:, None] + start + lanes[None, :], 0, None)
    perm = place.perm
    rows = at_send if perm is None else perm[jnp.clip(at_send, 0, max(perm.shape[0] - 1, 0))]
    receiving = peer & ((start + lanes)[None, :] < route.recv_counts[:, None])
    # Rows past the buffer (overflow) and empty lanes point at row ``capacity`` and are dropped.
    dest = jnp.where(receiving, route.recv_offsets[:, None] + start + lanes[None, :], capacity).reshape(-1)
    return Lanes(sending, at_send, rows, receiving, dest)


def to_words(x: jax.Array) -> jax.Array:
    """`(size, c, *trailing)` of 4- or 8-byte elements as `(size, c, columns)` ``uint32``."""
    return lax.bitcast_convert_type(x, jnp.uint32).reshape(*x.shape[:2], -1)


def from_words(w: jax.Array, like: jax.Array) -> jax.Array:
    """`(rows, columns)` ``uint32`` back to rows of ``like``'s trailing shape and dtype."""
    if like.dtype.itemsize == 8:
        return lax.bitcast_convert_type(w.reshape(w.shape[0], *like.shape[1:], 2), like.dtype)
    return lax.bitcast_convert_type(w.reshape(w.shape[0], *like.shape[1:]), like.dtype)


def gather_rows(arrays: Sequence[jax.Array], k: int, lanes: Lanes, place: Placement) -> jax.Array:
    """`(size, c, ...)` the rows of array ``k`` this round sends (row map applied)."""
    rows = arrays[k].at[lanes.rows].get(mode="clip", wrap_negative_indices=False)
    fn = place.row_map(k)
    return rows if fn is None else fn(rows)


def send_block(block: jax.Array, lanes: Lanes, all_to_all: AllToAll) -> jax.Array:
    """One ``all_to_all`` of a `(size, c, ...)` block, lanes that carry no row zeroed."""
    trailing = (1,) * (block.ndim - 2)
    sending = lanes.sending.reshape(lanes.sending.shape + trailing)
    return all_to_all(jnp.where(sending, block, jnp.zeros((), block.dtype)))


def packed_round(arrays: Sequence[jax.Array], outs: list[jax.Array], lanes: Lanes, place: Placement,
                 rounds: Rounds, all_to_all: AllToAll) -> Lanes:
    """Move the ``packed`` arrays' rows in one ``uint32`` block and write them into ``outs`` (in place).

    With ``place.target`` the target rows travel as the block's last column and place the rows they came with: the
    returned lanes carry those destinations (the loose arrays land there too)."""
    capacity, c = rounds.capacity, lanes.sending.shape[1]
    target_rows = []
    if place.target is not None:
        target_rows = [to_words(jnp.take(place.target.astype(jnp.int32), lanes.at_send, axis=0,
                                         mode="clip")[..., None])]
    blocks = [to_words(gather_rows(arrays, k, lanes, place)) for k in rounds.packed] + target_rows
    recv = send_block(jnp.concatenate(blocks, axis=-1) if len(blocks) > 1 else blocks[0], lanes, all_to_all)
    recv = recv.reshape(rounds.size * c, -1)
    if place.target is not None:
        at = lax.bitcast_convert_type(recv[:, -1], jnp.int32)
        at = jnp.where((at >= 0) & (at < capacity), at, capacity)
        lanes = lanes._replace(dest=jnp.where(lanes.receiving.reshape(-1), at, capacity))
        blocks = blocks[:-1]
    col = 0
    for k, block in zip(rounds.packed, blocks, strict=True):
        width = block.shape[-1]
        rows = from_words(recv[:, col:col + width], outs[k])  # the received shape (a row map may change it)
        col += width
        outs[k] = outs[k].at[lanes.dest].set(rows, mode="drop")
    return lanes


def loose_round(arrays: Sequence[jax.Array], outs: list[jax.Array], lanes: Lanes, place: Placement,
                rounds: Rounds, all_to_all: AllToAll) -> None:
    """Move each ``loose`` array's rows in a block of its own and write them into ``outs`` (in place)."""
    c = lanes.sending.shape[1]
    for k in rounds.loose:
        recv = send_block(gather_rows(arrays, k, lanes, place), lanes, all_to_all)
        outs[k] = outs[k].at[lanes.dest].set(recv.reshape(rounds.size * c, *outs[k].shape[1:]), mode="drop")


def one_round(arrays: Sequence[jax.Array], route: Route, place: Placement, rounds: Rounds, all_to_all: AllToAll,
              me: jax.Array | int, t: jax.Array, lanes: jax.Array, carry: Received) -> Received:
    """Round ``t``: every pair of different ranks' next ``c`` rows, received straight into place."""
    lane_view = round_lanes(route, place, rounds.capacity, t, lanes, me)
    outs = list(carry.buffers)
    if rounds.packed or place.target is not None:
        lane_view = packed_round(arrays, outs, lane_view, place, rounds, all_to_all)
    loose_round(arrays, outs, lane_view, place, rounds, all_to_all)  # after the destinations (``target`` sets them)
    return Received(tuple(outs))


def own_rows(arrays: Sequence[jax.Array], route: Route, place: Placement, rounds: Rounds, me: jax.Array | int,
             block: int, carry: Received) -> Received:
    """The rows a rank sends itself, copied into place in local steps of ``block`` rows (no collective: the number
    of steps is this rank's own).

    The rounds then follow the largest count between *different* ranks: traffic that mostly stays home (particles
    that moved a little since their last exchange) takes a round or two instead of ``count / c``."""
    capacity = rounds.capacity
    lanes = jnp.arange(block, dtype=jnp.int32)
    count, first, home = route.send_counts[me], route.send_offsets[me], route.recv_offsets[me]
    perm = place.perm

    def step(t: jax.Array, carry: Received) -> Received:
        j = t * block + lanes
        at_send = jnp.clip(first + j, 0, None)
        rows = at_send if perm is None else perm[jnp.clip(at_send, 0, max(perm.shape[0] - 1, 0))]
        if place.target is None:
            dest = home + j
        else:
            dest = jnp.take(place.target.astype(jnp.int32), at_send, axis=0, mode="clip")
            dest = jnp.where(dest >= 0, dest, capacity)
        dest = jnp.where(j < count, dest, capacity)
        outs = list(carry.buffers)
        for k, out in enumerate(outs):
            got = arrays[k].at[rows].get(mode="clip", wrap_negative_indices=False)
            fn = place.row_map(k)
            got = got if fn is None else fn(got)
            if got.dtype != out.dtype:  # (a row map's words, received as the buffer's type)
                got = from_words(to_words(got[None])[0], out)
            outs[k] = out.at[dest].set(got.reshape(block, *out.shape[1:]), mode="drop")
        return Received(tuple(outs))

    steps = jnp.maximum(-(-count // block), 0).astype(jnp.int32)
    return lax.fori_loop(jnp.int32(0), steps, step, carry)


def rounds_of(c: int, arrays: Sequence[jax.Array], route: Route, place: Placement, rounds: Rounds,
              all_to_all: AllToAll, me: jax.Array | int, carry: Received) -> Received:
    """As many rounds of ``c`` rows per rank pair as the largest count between ranks needs (at least one)."""
    lanes = jnp.arange(c, dtype=jnp.int32)
    count = -(-jnp.minimum(route.largest, rounds.capacity) // c)
    step = functools.partial(one_round, arrays, route, place, rounds, all_to_all, me)
    return lax.fori_loop(jnp.int32(0), jnp.maximum(count, 1).astype(jnp.int32),
                         lambda t, carry: step(t, lanes, carry), carry)


def chunked(arrays: Sequence[jax.Array], route: Route, *, capacity: int, axes: tuple[str, ...], chunk: Chunk,
            all_to_all: AllToAll, place: Placement = PACKED) -> list[jax.Array]:
    """The portable exchange: rounds of one fixed-size ``all_to_all`` each, received rows scattered into place.

    Args:
        arrays: the send arrays, `(n, ...)` each, in send order (or through ``place.perm``).
        route: the counts (:func:`plan_route`); ``route.largest`` fixes the number of rounds.
        capacity: rows of every receive buffer.
        axes: the manual axes the exchange runs over (for the buffers' manual-axis type).
        chunk: rows per rank pair and round, or a ladder of sizes (see :data:`Chunk`).
        all_to_all: the ``all_to_all`` of one `(size, ...)` block over ``axes``.
        place: optional sources and destinations (see :class:`Placement`).

    Returns:
        The receive buffers, `(capacity, ...)` each.
    """
    carry = initial_buffers(arrays, route, capacity, place, axes)
    rounds = group_by_width(carry.buffers, capacity, route.send_counts.shape[0])
    sizes = chunk_sizes(chunk, capacity, rounds.size)
    me = axes_index(axes)
    run = [functools.partial(rounds_of, c, arrays, route, place, rounds, all_to_all, me) for c in sizes]
    if len(sizes) == 1:
        carry = run[0](carry)
    else:
        # Every rank knows ``largest``, so all take the same branch: the smallest size that moves it in one round.
        pick = jnp.sum(jnp.asarray(sizes[:-1], jnp.int32) < jnp.minimum(route.largest, capacity)).astype(jnp.int32)
        carry = lax.switch(pick, run, carry)
    # The rows each rank keeps, after the rounds and outside the ladder's branches (one copy of their loop, not one
    # per size), in local steps of a quarter of the largest round's ``size * c`` rows (at most a quarter of the
    # buffer: their temporaries stay well below the receive buffers).
    block = max(1, min(rounds.size * sizes[-1], capacity) // 4)
    return list(own_rows(arrays, route, place, rounds, me, block, carry).buffers)


def local_copy(arrays: Sequence[jax.Array], count: jax.Array, capacity: int,
               place: Placement = PACKED) -> list[jax.Array]:
    """What the exchange delivers on one device: the first ``count`` rows of the send order into the receive
    buffers (at ``place.recv_at[0]`` on, or at their ``place.target`` rows), with no rounds, counts or
    collectives."""
    outs = []
    for k, a in enumerate(arrays):
        fn = place.row_map(k)
        n = a.shape[0]
        rows = jnp.arange(n, dtype=jnp.int32)
        if place.perm is None and place.target is None and place.recv_at is None and place.init is None and fn is None:
            # Rows stay where they are: pad or cut to the buffer and clear the rows past ``count``.
            kept = jnp.pad(a, [(0, max(capacity - n, 0))] + [(0, 0)] * (a.ndim - 1))[:capacity]
            live = jnp.arange(capacity) < count
            outs.append(jnp.where(live.reshape(-1, *(1,) * (a.ndim - 1)), kept, jnp.zeros((), a.dtype)))
            continue
        source = a if place.perm is None else jnp.take(a, place.perm, axis=0, mode="clip")
        source = source if fn is None else fn(source)
        if place.target is not None:
            at = place.target.astype(jnp.int32)
            at = jnp.where((at >= 0) & (at < capacity), at, capacity)
        else:
            at = rows + (0 if place.recv_at is None else place.recv_at[0].astype(jnp.int32))
        at = jnp.where(rows < count, at, capacity)
        if place.init is None:
            out = jnp.zeros((capacity, *source.shape[1:]), source.dtype)
        else:
            out = jnp.asarray(place.init[k])
        outs.append(out.at[at].set(source.astype(out.dtype), mode="drop"))
    return outs
