"""Local friends-of-friends linking: every pair closer than the linking length, then connected components.

Sort. Points are ordered by the row-major key of a cell grid whose cells are at least the linking length wide (so a
point's friends lie in the ``3**d`` cells around its own) and small: about ``per_cell = 0.125`` points per cell, at
most ``table`` cells per point row. A table of the first sorted row of every cell comes from a count per cell and a
cumulative sum; the points are placed by a counting sort (:func:`sort_points`). On several devices the grid
covers one device's piece and its ghosts (:func:`piece_space`), open on the axes where the piece does not wrap the
periodic box.

Pairs. Each point's candidates are a few runs of the sorted points, read from the table: the rest of its own cell
and the next cell of its own row, and the cells ``x - 1 .. x + 1`` of the "forward" half of the neighbouring rows
(the other half finds the same pairs from the other side); a periodic row adds the cell across the box. Candidates
of all points are numbered one after another, and each step of a loop tests a fixed number of consecutive candidate
numbers (no per-block tiles, no padding), appending pairs within the linking length to a fixed-size edge list.
Dense regions simply take more steps, so every pair is found whatever the clustering; only the edge list has a
capacity.

Components. Hook-and-compress over the live edges only (the FastSV scheme): every edge lowers the parent of its
larger label to its smaller label by a scatter-min, then pointer jumping flattens the trees, until both ends of
every edge share a label. Labels converge to the smallest sorted row of each component.

Tuning. The static sizes live in a ``_fof_tuning.Tuning`` with a preset per backend: on XLA:CPU small
steps that fit a cache and the counting sort; on a GPU, where every sequential loop step costs a fixed fraction of
a millisecond whatever it holds, steps of a sizeable share of the problem (bounded by
:func:`~shardax._tuning.step_bytes`), a comparison sort whose sorted keys give the cell-start table
(no scatter-add piling onto a few cells), and the candidate runs recomputed per step instead of a table of them
(memory). Every choice gives the same pairs and labels; each kernel counts its sequential steps (``_fof_tuning.Steps``).
"""

from __future__ import annotations

import itertools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from .._nonzero import true_positions
from .._order import after
from .._wordsort import argsort_words
from ..core import vary_like
from ._fof_tuning import DEFAULT_TUNING, Tuning, step_sizes
from ._grid import Domain, Grid, cell_coords, cell_keys, cell_starts, open_domain, unwrapped_piece

# Cell keys are int32: the product of the cell counts must stay below 2**31.
_MAX_CELLS = {2: 2**15 - 1, 3: 2**10 - 1}


class Links(NamedTuple):
    """Pairs found by :func:`find_links` in sorted-row numbering."""

    first: jax.Array  # (edge_capacity,) int32, -1 past num_edges
    second: jax.Array  # (edge_capacity,) int32
    num_edges: jax.Array  # int32 pairs found (may exceed edge_capacity: overflow)
    steps: jax.Array  # int32 steps of the search loop


class LinkSpace(NamedTuple):
    """Where the link grid lies, and how distances are measured.

    ``lo (d,)`` and ``extent (d,)`` bound the grid; on the axes marked in ``wrap (d,)`` (traced bool) the grid is
    periodic (``lo = 0``, ``extent = box``; the cells at both ends are neighbours), elsewhere it is open. ``box (d,)``
    is the periodic box of the distances (minimum image on every axis), or None for open boundaries (static).
    Grid coordinates may differ from the positions whose distances are measured: a device's piece of a periodic
    box is gridded in coordinates unwrapped next to it (see :func:`piece_space`).
    """

    lo: jax.Array
    extent: jax.Array
    wrap: jax.Array
    box: jax.Array | None

    @property
    def domain(self) -> Domain:
        """The grid geometry as a :class:`_grid.Domain` (``periodic``: some axis may wrap)."""
        return Domain(self.lo, self.extent, self.box is not None)


def whole_space(pos: jax.Array, valid: jax.Array, box: jax.Array | None) -> LinkSpace:
    """The periodic ``box`` on every axis, or the bounding box of the valid rows of ``pos`` without one."""
    if box is None:
        bounds = open_domain(pos, valid)
        return LinkSpace(bounds.lo, bounds.extent, jnp.zeros(bounds.lo.shape, bool), None)
    return LinkSpace(jnp.zeros_like(box), box, jnp.ones(box.shape, bool), box)


def piece_space(pos: jax.Array, valid: jax.Array, box: jax.Array, linking_length: jax.Array, lower: jax.Array,
                upper: jax.Array, occupied: jax.Array) -> tuple[LinkSpace, jax.Array]:
    """An open grid over one device's piece of a periodic box (with its ghosts), periodic only where it must be
    (:func:`~shardax.spatial._grid.unwrapped_piece` with the linking length as the reach).

    Returns:
        ``(space, grid_pos)``: the space (its ``box`` is the periodic box: distances stay minimum-image in the
        given positions) and the positions `(n, d)` to grid.
    """
    piece = unwrapped_piece(pos, valid, box, linking_length, lower, upper, occupied)
    return LinkSpace(piece.domain.lo, piece.domain.extent, piece.wrap, box), piece.grid_pos


class SortedPoints(NamedTuple):
    """Valid points sorted by cell key (padding last): keys `(n,)` (``table_cells`` for padding; the cell
    coordinates are read back from them, :func:`key_coords`), original rows `(n,)`, positions `(n, d)`,
    ``starts (table_cells + 1,)``: the first sorted row of each cell key (the number of valid points for keys past
    the last point), and ``rounds``: the counting sort's rounds (0 when sorted by comparison)."""

    keys: jax.Array
    rows: jax.Array
    pos: jax.Array
    starts: jax.Array
    rounds: jax.Array


def key_coords(keys: jax.Array, grid: Grid) -> jax.Array:
    """Cell coordinates `(k, d)` of row-major cell keys `(k,)`, the inverse of
    :func:`~shardax.spatial._grid.cell_keys` (a padding key past the grid gets coordinates inside it)."""
    dim = grid.cells.shape[0]
    axes = [(keys // grid.stride[axis]) % grid.cells[axis] for axis in range(dim - 1)]
    axes.append(jnp.minimum(keys // grid.stride[dim - 1], grid.cells[dim - 1] - 1))
    return jnp.stack(axes, axis=-1)


def link_grid(space: LinkSpace, num: jax.Array, linking_length: jax.Array, per_cell: float, max_cells: int,
              volume: jax.Array | None = None) -> Grid:
    """A grid of about ``per_cell`` points per cell, cells wider than the linking length, at most ``max_cells`` cells
    (static: the size of the cell-start table of :func:`find_links`).

    ``volume`` is the volume the ``num`` points occupy (default: the whole space); a device holding a small piece
    of a periodic axis sizes its cells by its own piece while the grid still spans the box there.
    """
    dim = space.extent.shape[0]
    ext = jnp.maximum(space.extent, jnp.max(space.extent) * 1e-6).astype(jnp.float32)
    whole = jnp.prod(ext)
    volume = whole if volume is None else jnp.clip(volume.astype(jnp.float32), 1e-30, whole)
    side = (volume * per_cell / jnp.maximum(num, 1).astype(jnp.float32)) ** (1.0 / dim)
    side = jnp.maximum(side, (whole / max_cells) ** (1.0 / dim))
    # Wider than the linking length by a few rounding errors of the cell assignment: friends are never two cells
    # apart.
    reach = jnp.abs(space.lo) + space.extent
    slack = 16 * jnp.finfo(space.extent.dtype).eps * jnp.max(reach)
    side = jnp.maximum(side, (linking_length * (1 + 2.0**-12) + slack).astype(jnp.float32))
    cells = jnp.clip(jnp.floor(ext / side), 1, _MAX_CELLS[dim]).astype(jnp.int32)

    # Rounding may leave a few cells too many: shrink the longest axis until the table holds them all.
    def too_many(c: jax.Array) -> jax.Array:
        return jnp.prod(c) > max_cells

    def shrink(c: jax.Array) -> jax.Array:
        longest = jnp.argmax(c)
        return c.at[longest].set(jnp.maximum(c[longest] - 1, 1))

    cells = lax.while_loop(too_many, shrink, cells)
    stride = jnp.concatenate([jnp.ones((1,), jnp.int32), jnp.cumprod(cells)[:-1]])
    return Grid(cells, space.extent / cells.astype(space.extent.dtype), stride)


def _cumsum(x: jax.Array, width: int = 128) -> jax.Array:
    """Inclusive cumulative sum of a long 1-D array, by rows of ``width`` (faster than one flat scan on CPU)."""
    n = x.shape[0]
    rows = -(-n // width)
    y = jnp.pad(x, (0, rows * width - n)).reshape(rows, width)
    within = jnp.cumsum(y, axis=1)
    before = jnp.cumsum(within[:, -1]) - within[:, -1]
    return (within + before[:, None]).reshape(-1)[:n]


class _Deal(NamedTuple):
    """Carry of the counting sort's rounds: the round, the rank within its cell of each point of the remainder,
    which of them still wait, and the winning ticket of each cell."""

    round: jax.Array
    rank: jax.Array
    left: jax.Array
    top: jax.Array


def sort_points(pos: jax.Array, valid: jax.Array, space: LinkSpace, grid: Grid, table_cells: int,
                rounds: int = DEFAULT_TUNING.rank_rounds, grid_pos: jax.Array | None = None) -> SortedPoints:
    """Valid rows of ``pos`` sorted by cell key (order within a cell unspecified), on a grid of at most
    ``table_cells`` cells. Cells are those of ``grid_pos`` (default ``pos``): the positions unwrapped for the grid
    (:func:`piece_space`), while ``pos`` keeps the coordinates the distances are measured in.

    A counting sort: a point goes to the first row of its cell plus its rank within the cell. Ranks are dealt out
    in rounds (each round, the largest row still waiting in each cell takes the next rank), a round per point of
    the fullest cell. With more than ``rounds`` points in a cell, or more than a quarter of the points sharing
    cells, a comparison sort takes over. (XLA's CPU sort of keys with a payload is several times slower than these
    rounds for the fraction of a point per cell of a link grid.) ``rounds = 0`` always sorts by comparison, and
    the cell-start table comes from the sorted keys instead of a count per cell: no loop, and no scatter-add that
    piles onto the cells of a clump (or the padding's key), which serialises on a GPU.
    """
    n = pos.shape[0]
    idx = jnp.arange(n, dtype=jnp.int32)
    coords = cell_coords(pos if grid_pos is None else grid_pos, space.domain, grid)
    keys = jnp.where(valid, cell_keys(coords, grid), table_cells)

    def comparison() -> jax.Array:  # stable by key (keys are non-negative), one packed sort
        return argsort_words(keys)

    if rounds < 1:
        rows = comparison()
        sorted_keys = keys[rows]
        starts = cell_starts(sorted_keys, table_cells, jnp.sum(valid, dtype=jnp.int32))
        return SortedPoints(sorted_keys, rows, pos[rows], starts, jnp.int32(0))

    # Padding rows are not counted (their key's count is never read): no scatter onto one address.
    counts = jnp.zeros((table_cells + 1,), jnp.int32).at[jnp.where(valid, keys, table_cells + 1)].add(1, mode="drop")
    starts = _cumsum(counts) - counts  # exclusive: starts[table_cells] = number of valid points

    # Round 0 over all points; most points are alone in their cell (or the largest row of it), so the later
    # rounds deal with a compacted remainder of at most `spare` points. Tickets of round r exceed every ticket of
    # earlier rounds, so the table of winners is never cleared.
    top = jnp.full((table_cells + 1,), -1, jnp.int32).at[jnp.where(valid, keys, table_cells + 1)].max(idx,
                                                                                                        mode="drop")
    remaining = valid & (top[keys] != idx)
    spare = min(n, n // 4 + 1024)
    sub = true_positions(remaining, spare, n)
    sub = sub.astype(jnp.int32)
    sub_keys = jnp.where(sub < n, keys[jnp.minimum(sub, n - 1)], table_cells)
    rounds = min(rounds, (2**31 - 1) // max(n, 1) - 1)

    def waiting(state: _Deal) -> jax.Array:
        return (state.round < rounds) & jnp.any(state.left)

    def deal(state: _Deal) -> _Deal:
        ticket = state.round * n + sub
        top = state.top.at[jnp.where(state.left, sub_keys, table_cells + 1)].max(ticket, mode="drop")
        won = state.left & (top[sub_keys] == ticket)
        return _Deal(state.round + 1, jnp.where(won, state.round, state.rank), state.left & ~won, top)

    dealt = lax.while_loop(waiting, deal, _Deal(jnp.int32(1), vary_like(jnp.zeros((spare,), jnp.int32), pos),
                                                sub < n, top))
    rank = jnp.zeros((n,), jnp.int32).at[sub].set(dealt.rank, mode="drop")
    fallback = (jnp.sum(remaining, dtype=jnp.int32) > spare) | jnp.any(dealt.left)

    def counting() -> jax.Array:
        # Padding rows (key table_cells) take the rows after the valid ones, in row order.
        at = jnp.where(valid, starts[keys] + rank, starts[table_cells] + idx - jnp.cumsum(valid))
        return jnp.zeros((n,), jnp.int32).at[at].set(idx)

    rows = lax.cond(fallback, comparison, counting)
    return SortedPoints(keys[rows], rows, pos[rows], starts, dealt.round - 1)


def dist2(a: jax.Array, b: jax.Array, box: jax.Array | None) -> jax.Array:
    """Squared distances `(..., A, B)` between `a: (..., A, d)` and `b: (..., B, d)` (minimum image in a periodic
    ``box (d,)``)."""
    total = None
    for axis in range(a.shape[-1]):
        dx = a[..., :, None, axis] - b[..., None, :, axis]
        if box is not None:
            dx = dx - box[axis] * jnp.round(dx * (1 / box[axis]))
        square = jnp.maximum(dx * dx, 0)   # rounded on its own, never fused into the sum (see _knn_pass.pair_dist2)
        total = square if total is None else total + square
    assert total is not None
    return total


def _forward_rows(dim: int) -> list[tuple[int, ...]]:
    """Row offsets searched from each block: its own row, then half of the neighbouring rows."""
    others = [o for o in itertools.product((-1, 0, 1), repeat=dim - 1) if any(o)]
    forward = [o for o in others if o[::-1] > tuple(0 for _ in o)]
    return [tuple(0 for _ in range(dim - 1)), *forward]


def _runs(coords: jax.Array, idx: jax.Array, num: jax.Array, starts: jax.Array, grid: Grid,
          space: LinkSpace) -> tuple[jax.Array, jax.Array]:
    """Start and length `(k, R)` of the ``R`` runs of forward candidates of the sorted points ``idx (k,)`` (cell
    coordinates ``coords (k, d)``) in every row of :func:`_forward_rows`: the runs of :func:`_row_runs`, each row's
    run then its run across the box."""
    runs = _row_runs(coords, idx, num, starts, grid, space)
    if len(runs) == 1:
        return runs[0]
    return (jnp.stack([run[0] for run in runs], axis=2).reshape(len(idx), -1),
            jnp.stack([run[1] for run in runs], axis=2).reshape(len(idx), -1))


def _row_runs(coords: jax.Array, idx: jax.Array, num: jax.Array, starts: jax.Array, grid: Grid,
              space: LinkSpace, rows: tuple[int, ...] | None = None) -> list[tuple[jax.Array, jax.Array]]:
    """Start and length `(k, rows)` of the forward candidates of the sorted points ``idx (k,)`` (cell coordinates
    ``coords (k, d)``) in the rows of :func:`_forward_rows` numbered ``rows`` (default: all): the run in each row,
    then (a space that may wrap) its run across the box.

    Own row: the points after this one in its own cell and the next cell (and, periodic, cell 0 after the last
    cell). Forward rows (half of the neighbouring rows): cells ``x - 1 .. x + 1`` of the row (periodic: the cell
    on the other side of the box as a second run). Every pair closer than a cell width is in exactly one point's
    runs, except on axes of two cells, where the two neighbours coincide (a pair found twice does not matter).
    Wrapping is per axis (``space.wrap``, traced): a space that may wrap (``space.box``) has the same runs whatever
    mix of open and periodic axes it has, so one compiled search serves them all. All rows are computed at once
    (`(k, rows)` arrays: a few wide operations, not a few per row, which keeps the program small); the runs come
    apart, so that a caller taking them one by one never needs them stacked in memory.
    """
    periodic = space.box is not None
    every = _forward_rows(coords.shape[1])  # the own row first
    chosen = range(len(every)) if rows is None else rows
    offsets = np.array([every[r] for r in chosen], np.int32).reshape(len(chosen), -1)  # (rows, d - 1)
    own = np.array([r == 0 for r in chosen])[None]  # (1, rows)
    cx = coords[:, :1]
    gx = grid.cells[0]
    live = (idx < num)[:, None]
    wrap_ok = space.wrap[0] & (gx >= 3)
    cells = grid.cells[None, None, 1:]
    c = coords[:, None, 1:] + offsets[None]  # (k, rows, d - 1)
    if periodic:
        # On an axis of one cell every offset is the row itself, which offset 0 already covers.
        wraps = space.wrap[None, None, 1:]
        fine = jnp.where(wraps, (cells >= 2) | (offsets == 0)[None], (c >= 0) & (c < cells))
        c = jnp.where(wraps, jnp.mod(c, cells), c)
    else:
        fine = (c >= 0) & (c < cells)
    # The own row alone is always in the grid; its `fine` is a constant, which XLA would reduce point by point while
    # compiling (seconds at a million points).
    ok = jnp.all(fine, axis=-1) if offsets.any() else jnp.ones(c.shape[:2], bool)
    base = jnp.sum(c * grid.stride[None, None, 1:], axis=-1)  # (k, rows)
    hi = starts[base + jnp.minimum(cx + 1, gx - 1) + 1]
    lo = jnp.where(own, idx[:, None] + 1, starts[base + jnp.maximum(cx - 1, 0)])
    main = (lo, jnp.where(ok & live, jnp.maximum(hi - lo, 0), 0))
    # The cell across the box: after the last cell of the own row; before the first or after the last of the others.
    across = jnp.where(own, cx == gx - 1, (cx == 0) | (cx == gx - 1))
    wrap_cell = base + jnp.where(own | (cx != 0), 0, gx - 1)
    wrap_lo = starts[wrap_cell]
    wrap_len = jnp.where(ok & live & wrap_ok & across, jnp.maximum(starts[wrap_cell + 1] - wrap_lo, 0), 0)
    if not periodic:  # (no axis wraps: the own row's run across the box is always empty)
        return [main]
    return [main, (wrap_lo, wrap_len)]  # each row's run, then its run across the box (the order of the edges found)


class _Search(NamedTuple):
    """Carry of the link search: the first candidate number of the next step and the first point with candidates
    from it on, the edge list so far (both ends), pairs found, steps taken."""

    slot: jax.Array
    point: jax.Array
    first: jax.Array
    second: jax.Array
    count: jax.Array
    steps: jax.Array


def find_links(points: SortedPoints, num: jax.Array, linking_length: jax.Array, space: LinkSpace, grid: Grid, *,
               edge_capacity: int, tuning: Tuning = DEFAULT_TUNING) -> Links:
    """All pairs of the first ``num`` sorted points closer than (or at) the linking length, each pair at least once.

    Every point's forward candidates (:func:`_runs`) are numbered one after another over all points; a step tests
    the next ``slots`` candidate numbers (:func:`step_sizes`) and appends its pairs to the edge list. A slot finds
    its point by a scatter of the window's point starts and a cumulative sum, and its run by comparing with the
    point's cumulative run lengths (from a table of every point's runs with ``tuning.run_table``, else recomputed
    for the step's points); the first point of the next step is counted from the window, not searched for. Work is
    proportional to the number of candidates whatever the clustering, and a step is a fixed set of wide
    operations (no loop inside the loop).

    Args:
        points: points sorted on ``grid`` (:func:`sort_points`).
        num: number of valid points.
        linking_length: scalar linking length (at most the cell width of ``grid``).
        space: the space of ``grid``.
        grid: a grid from :func:`link_grid`.
        edge_capacity: length of the edge list (static).
        tuning: static sizes of the search.

    Returns:
        :class:`Links` in sorted-row numbering; ``num_edges > edge_capacity`` means pairs were lost.
    """
    n = points.pos.shape[0]
    slots, _ = step_sizes(tuning, n)
    ll2 = (linking_length * linking_length).astype(points.pos.dtype)
    idx = jnp.arange(n, dtype=jnp.int32)
    num_rows = len(_forward_rows(points.pos.shape[1]))
    if tuning.run_table:
        run_start, run_len = _runs(key_coords(points.keys, grid), idx, num, points.starts, grid, space)
        total = jnp.sum(run_len, axis=1)
        num_runs = run_len.shape[1]
        # j = shift[point, run] + candidate number within the point
        run_end = jnp.cumsum(run_len, axis=1)
        lookup = jnp.concatenate([run_end, run_start - (run_end - run_len)], axis=1)
    else:
        # Only each point's number of candidates, a row of cells at a time: each row's table lookups wait for the
        # last row's sum (``after``), so XLA holds one row's buffers at a time, not (n, R) of them.
        total, keys = jnp.zeros((n,), jnp.int32), points.keys
        for r in range(num_rows):
            for _, length in _row_runs(key_coords(keys, grid), idx, num, points.starts, grid, space, rows=(r,)):
                total = total + length[:, 0]
            keys = after(keys, total)
    point_begin = jnp.cumsum(total) - total  # (n,) first candidate number of each point
    # Candidate numbers are int32: with 2**31 candidates or more (a clump of ~65000 points within a few cells),
    # search nothing and report an edge count no capacity can hold.
    too_many = jnp.sum(total.astype(jnp.float32)) >= 2.0**31 * 0.999
    num_slots = jnp.where(too_many, 0, point_begin[-1] + total[-1])
    window = jnp.arange(slots, dtype=jnp.int32)

    def candidate(qi: jax.Array, k: jax.Array) -> jax.Array:
        """`(slots,)` sorted row of the ``k``-th forward candidate of each slot's point ``qi``."""
        if tuning.run_table:
            row = lookup[qi]
            which = jnp.minimum(jnp.sum(k[:, None] >= row[:, :num_runs], axis=1, dtype=jnp.int32), num_runs - 1)
            return jnp.take_along_axis(row[:, num_runs:], which[:, None], axis=1)[:, 0] + k
        # The runs of the step's points, a row of cells at a time (elementwise, no (slots, R) buffers; each row's
        # lookups after the last row's, as for the totals).
        before = jnp.zeros_like(k)
        found = jnp.zeros_like(k)
        for r in range(num_rows):
            # The coordinates are read back from the keys in every row: held through the rows instead, they cost
            # 4 bytes per particle more (GPU preset, 1e6 points), for a gather and a few integer divisions saved.
            for start, length in _row_runs(key_coords(points.keys[qi], grid), qi, num, points.starts, grid, space,
                                           rows=(r,)):
                found = jnp.where((k >= before) & (k < before + length[:, 0]), start[:, 0] + (k - before), found)
                before = before + length[:, 0]
            qi = after(qi, found)
        return found

    def cond(state: _Search) -> jax.Array:
        return state.slot < num_slots

    def step(state: _Search) -> _Search:
        slot0, p0, count = state.slot, state.point, state.count
        # p0 is the first point with candidates from slot0 on (or an earlier one without any). This step covers
        # the candidates of points p0 .. p0 + slots - 1 from slot0 on, at most `slots` of them.
        at = p0 + jnp.arange(slots + 1, dtype=jnp.int32)
        mine = jnp.where(at < n, point_begin[jnp.minimum(at, n - 1)], num_slots)
        stop = jnp.minimum(slot0 + slots, mine[-1])
        starting = jnp.where(mine[:-1] < stop, jnp.maximum(mine[:-1] - slot0, 0), slots)
        marks = jnp.zeros((slots,), jnp.int32).at[starting].add(1, mode="drop")
        qi = jnp.minimum(p0 + jnp.cumsum(marks) - 1, n - 1)
        s = slot0 + window
        live = s < stop
        cj = jnp.where(live, candidate(qi, s - point_begin[qi]), 0)
        d2 = dist2(points.pos[qi][:, None, :], points.pos[cj][:, None, :], space.box)[:, 0, 0]
        hit = live & (d2 <= ll2)
        at = jnp.where(hit, count + jnp.cumsum(hit.astype(jnp.int32)) - 1, edge_capacity)
        first = state.first.at[at].set(qi, mode="drop")
        second = state.second.at[at].set(cj, mode="drop")
        # Points of the window whose candidates all lie before `stop` (point ends are the next points' starts).
        done = jnp.sum(mine[1:] <= stop, dtype=jnp.int32)
        return _Search(stop, p0 + done, first, second, count + jnp.sum(hit, dtype=jnp.int32), state.steps + 1)

    init = vary_like(_Search(jnp.int32(0), jnp.int32(0), jnp.full((edge_capacity,), -1, jnp.int32),
                             jnp.full((edge_capacity,), -1, jnp.int32), jnp.int32(0), jnp.int32(0)), points.pos)
    found = lax.while_loop(cond, step, init)
    return Links(found.first, found.second, jnp.where(too_many, jnp.iinfo(jnp.int32).max, found.count),
                 found.steps)


class _Hooks(NamedTuple):
    """Carry of a hooking pass: the parents, and whether an edge still joined two roots."""

    parent: jax.Array
    changed: jax.Array


class _Sweep(NamedTuple):
    """Carry of the hook-and-compress passes: the parents, whether the last pass hooked anything, and the steps
    ``(3,)`` (passes, hooking steps, pointer-jumping steps)."""

    parent: jax.Array
    changed: jax.Array
    steps: jax.Array


def components(links: Links, n: int, chunk: int = DEFAULT_TUNING.edge_chunk) -> tuple[jax.Array, jax.Array]:
    """Smallest node of each node's connected component, `(n,)` int32 (nodes are ``0..n-1``), and the loop steps
    ``(3,)`` int32: passes, hooking steps and pointer-jumping steps.

    Hook and compress: a pass over the live edges, ``chunk`` at a time, lowers the parent of the larger of each edge's
    two parents to the smaller (a scatter-min), then pointer jumping flattens the trees; passes repeat until a pass
    finds both ends of every edge under one root. Parents only ever decrease and stay in their component, so the
    root of each component is its smallest node.
    """
    capacity = links.first.shape[0]
    chunk = max(1, min(chunk, capacity))
    count = jnp.minimum(links.num_edges, capacity)
    num_chunks = (count + chunk - 1) // chunk
    offsets = jnp.arange(chunk, dtype=jnp.int32)

    def compress(parent: jax.Array) -> tuple[jax.Array, jax.Array]:
        return lax.while_loop(lambda s: jnp.any(s[0][s[0]] != s[0]), lambda s: (s[0][s[0]], s[1] + 1),
                              (parent, vary_like(jnp.int32(0), parent)))

    def hook(c: jax.Array, state: _Hooks) -> _Hooks:
        parent = state.parent
        at = jnp.minimum(c * chunk, capacity - chunk)
        a = lax.dynamic_slice(links.first, (at,), (chunk,))
        b = lax.dynamic_slice(links.second, (at,), (chunk,))
        live = at + offsets < count
        a, b = jnp.where(live, a, 0), jnp.where(live, b, 0)
        pa, pb = parent[a], parent[b]
        differ = pa != pb
        parent = parent.at[jnp.where(differ, jnp.maximum(pa, pb), n)].min(jnp.minimum(pa, pb), mode="drop")
        return _Hooks(parent, state.changed | jnp.any(differ))

    def sweep(state: _Sweep) -> _Sweep:
        hooked = lax.fori_loop(0, num_chunks, hook, _Hooks(state.parent, vary_like(jnp.zeros((), bool), state.parent)))
        parent, jumps = compress(hooked.parent)
        return _Sweep(parent, hooked.changed, state.steps + jnp.stack([jnp.int32(1), num_chunks, jumps]))

    parent = vary_like(jnp.arange(n, dtype=jnp.int32), links.first)
    init = _Sweep(parent, vary_like(jnp.ones((), bool), parent), vary_like(jnp.zeros((3,), jnp.int32), parent))
    done = lax.while_loop(lambda s: s.changed, sweep, init)
    return done.parent, done.steps
