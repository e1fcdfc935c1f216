"""Friends-of-friends tuning: the static sizes and algorithm choices of its kernels, a preset per backend.

On XLA:CPU small steps that fit a cache and the counting sort; on a GPU, where every sequential loop step costs a
fixed fraction of a millisecond whatever it holds, steps of a sizeable share of the problem (bounded by
:func:`~shardax._tuning.step_bytes`), a comparison sort whose sorted keys give the cell-start table, and the
candidate runs recomputed per step instead of a table of them. Every choice gives the same labels. :class:`Steps`
counts what the loops did.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import jax

from .._tuning import resolve_tuning, step_bytes


class Tuning(NamedTuple):
    """Static sizes and algorithm choices of friends-of-friends (``sx.spatial.FofTuning``; changing them recompiles).

    Every setting gives the same labels; they trade steps, memory and time. ``fof(..., tuning=None)`` takes the
    preset of the backend (:data:`PRESETS`: ``"cpu"`` on XLA:CPU, ``"gpu"`` elsewhere, ``SHARDAX_TUNING``
    overrides), ``"cpu"`` / ``"gpu"`` name a preset, and a ``Tuning`` of your own is used as given (start from a
    preset with ``_replace``).

    Attributes:
        per_cell: points per cell of the link grid when the linking length allows cells that small.
        table: cells of the cell-start table per point row (bounds the cell count).
        slots: candidate pairs tested per step of the link search, at most.
        edge_chunk: edges hooked per step of the component search, at most.
        rank_rounds: counting sort: most points per cell before a comparison sort takes over; 0 always sorts by
            comparison and reads the cell-start table off the sorted keys (no scatter-add into crowded cells).
        step_rows: when positive, ``slots`` and ``edge_chunk`` are also at most this many per point row of the
            problem (a step's buffers then scale with the problem, not with the device).
        run_table: keep every point's candidate runs in a table (fast on CPU) instead of recomputing the runs
            of each step's points (about 280 bytes per point less in a periodic 3D box).
        ghost_chunk: own rows tested per step of the ghost selection (several devices).
        edges_per_row: the default edge list's pairs per point row (``edge_capacity`` left unset; ``fof.smap``
            grows the list by itself when the pairs do not fit).

    Example:
        >>> import shardax as sx
        >>> sx.spatial.FofTuning().slots, sx.spatial.FofTuning()._replace(slots=1 << 20).slots
        (65536, 1048576)
    """

    per_cell: float = 0.125
    table: float = 8.0
    slots: int = 65536
    edge_chunk: int = 65536
    rank_rounds: int = 16
    step_rows: float = 0.0
    run_table: bool = True
    ghost_chunk: int = 512
    edges_per_row: float = 8.0


# The CPU preset's link grid: a table of 8 cells per point row, about 1/8 point per cell at the mean density. Halos
# are far denser than the mean and each point tests the points of 14 cells, so cells of half the volume of a 4-cell
# table's halve a clustered search's candidates, while a table this size costs nothing measurable on uniform points
# (docs/fof.md, "Algorithm"). The GPU preset keeps 4 cells per row: its memory per particle has a budget.
DEFAULT_TUNING = Tuning()
# A step of the GPU preset holds half as many candidates as the problem has rows (1e6 uniform points at b = 0.2:
# ~3.4 candidates per point, 7 steps) and as many edges (the components: one hooking step per pass), within the
# device's step budget (``step_bytes``: 33M slots on an 80 GB device); a ghost step tests a whole cell of a piece.
# Its edge list holds 3 pairs per point row, 24 bytes per particle (8 on CPU: 64 bytes): uniform points have 0.02
# pairs per point at b = 0.2 and 0.7 at b = 0.7, the clustered particles of `shardax halos` (43% in halos) 2.
GPU_TUNING = Tuning(per_cell=0.25, table=4.0, slots=1 << 24, edge_chunk=1 << 24, rank_rounds=0, step_rows=0.5,
                    run_table=False, ghost_chunk=1 << 14, edges_per_row=3.0)
PRESETS = {"cpu": DEFAULT_TUNING, "gpu": GPU_TUNING}

# Bytes of the buffers of one candidate slot in a step of the link search (point, run, candidate, distance, hit,
# and the runs recomputed for its point), and of one edge in a hooking step.
_SLOT_BYTES = 160
_EDGE_BYTES = 48


def resolve(tuning: Tuning | str | None, where: str = "fof", devices: Any = None) -> Tuning:
    """The :class:`Tuning` a call runs with: ``tuning`` itself, a named preset, or for ``None`` the preset of the
    backend of ``devices`` (default: the mesh being traced, else JAX's default backend)."""
    return resolve_tuning(tuning, PRESETS, Tuning, where, devices)


def step_sizes(tuning: Tuning, rows: int) -> tuple[int, int]:
    """``(slots, edge_chunk)`` of a problem of ``rows`` point rows: the tuning's, within the step memory budget
    (:func:`~shardax._tuning.step_bytes`) and, with ``step_rows``, within ``step_rows * rows``."""
    budget = step_bytes()
    slots = min(tuning.slots, max(budget // _SLOT_BYTES, 1024))
    edges = min(tuning.edge_chunk, max(budget // _EDGE_BYTES, 1024))
    if tuning.step_rows > 0:
        per_problem = max(math.ceil(tuning.step_rows * rows), 4096)
        slots, edges = min(slots, per_problem), min(edges, per_problem)
    return max(slots, 1), max(edges, 1)


class Steps(NamedTuple):
    """Sequential loop steps of one call on one device (int32 scalars; diagnostics, see ``_fof.fof_steps``)."""

    sort: jax.Array  # rounds of the counting sort (0: sorted by comparison)
    links: jax.Array  # steps of the link search
    sweeps: jax.Array  # hook-and-compress passes of the components
    hooks: jax.Array  # hooking steps, all passes
    jumps: jax.Array  # pointer-jumping steps, all passes
    ghosts: jax.Array  # steps of the ghost selection (0 on one device)
    merges: jax.Array  # rounds of the label merge across devices (0 on one device)
