"""The static sizes of the local kNN kernel, per backend: small CPU-cache tiles, or few large steps on a GPU.

Every sequential loop step of the kernel (a batch of query blocks in a grid pass, a tile of the brute force) costs
a fixed price on a GPU whatever it holds, so the GPU preset gives each step millions of distances: the first pass
over uniform data runs in at most 16 steps, and no step's tile exceeds the device's step budget
(:func:`shardax._tuning.step_bytes`). The CPU preset keeps tiles of about 65,536 distances, which fit a
core's caches. Both presets use the same grids and capacities, so they certify the same queries; the answers are
exact either way.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Literal, NamedTuple

from .._tuning import resolve_tuning, step_bytes

SearchMethod = Literal["scan", "scan_unrolled", "sort", "compare_all"]
SelectMethod = Literal["top_k", "threshold", "union"]

# GPU preset: sequential steps of the first pass over uniform data, and the least work a step carries.
_GPU_FIRST_STEPS = 16
_GPU_MIN_STEP_DISTANCES = 1 << 22
# Bytes of the buffers one distance of a step's tile takes (the distance, its masked copy, the candidates' gather).
_BYTES_PER_DISTANCE = 16
# CPU preset: distances per first-pass tile.
_CPU_STEP_DISTANCES = 65536


@dataclasses.dataclass(frozen=True)
class KnnTuning:
    """Static sizes of the exact kNN kernel (hashable; changing any field recompiles).

    Fields left ``None`` are derived from the dimension, ``k`` and the number of query and data rows by the rules of
    ``preset``: ``"cpu"`` keeps every tile near 65,536 distances (cache-sized), ``"gpu"`` sizes the steps so the
    first grid pass over uniform data runs in at most 16 sequential steps, each step bounded by the device's step
    budget. Sizes only decide how the work is cut: results are exact and identical for every tuning.

    Attributes:
        preset: the rules that fill the ``None`` fields.
        per_cell: data points per cell of the first grid (default ``max(4, k/2)`` in 3D, ``max(3, 0.4 k)`` else).
        block: queries per block (they share one candidate gather).
        capacity: candidate slots per block in full passes.
        batch: blocks per sequential step in full passes.
        later_capacity: candidate slots per block in the compacted later passes.
        later_batch: blocks per step in the compacted later passes.
        later_queries: queries per compacted pass (at least; ``m / 16`` when larger).
        max_passes: full passes (three times as many compacted passes) before the brute force.
        brute_queries: queries per brute-force step.
        brute_tile: data rows per brute-force step.
        search: ``jnp.searchsorted``'s method for the candidate runs in the sorted data of the later passes'
            grids (``"scan_unrolled"`` has no sequential loop; the first pass reads its runs from a table of
            cell starts).
        slot_search: ``jnp.searchsorted``'s method for the run of each candidate slot among a block's runs
            (``"compare_all"`` compares every slot with every run; ``"scan_unrolled"`` needs memory per slot only).
        select: how each query picks its ``k + 1`` nearest candidates from a tile: ``"top_k"`` (``lax.top_k`` over
            every candidate; a GPU sorts the whole row), ``"threshold"`` (one counting pass finds the edge below
            the query's margin that at least ``k + 1`` candidates reach, the candidates within it are packed into
            ``select_width`` slots, and ``lax.top_k`` runs over those; a query whose edge holds more is left for a
            later pass) or ``"union"`` (as ``"threshold"``, the candidates any query of a block keeps packed once
            per block into ``4 select_width`` slots first, so each query packs from those instead of from every
            candidate).
        select_width: slots per query of the ``"threshold"`` selection (default ``max(2 (k + 1), k + 17)``, in
            multiples of 8).

    Example:
        >>> import dataclasses, jax
        >>> from shardax.spatial import KnnTuning, knn
        >>> pos = jax.random.uniform(jax.random.key(0), (1000, 3))
        >>> wide = dataclasses.replace(KnnTuning(preset="gpu"), block=16)
        >>> bool((knn(pos, 4, box=1.0, tuning=wide).indices == knn(pos, 4, box=1.0).indices).all())
        True
    """

    preset: Literal["cpu", "gpu"] = "cpu"
    per_cell: float | None = None
    block: int = 8
    capacity: int | None = None
    batch: int | None = None
    later_capacity: int | None = None
    later_batch: int | None = None
    later_queries: int = 2048
    max_passes: int = 12
    brute_queries: int | None = None
    brute_tile: int | None = None
    search: SearchMethod | None = None
    slot_search: SearchMethod | None = None
    select: SelectMethod | None = None
    select_width: int | None = None

    def __post_init__(self) -> None:
        if self.preset not in ("cpu", "gpu"):
            raise ValueError(f"KnnTuning: preset must be 'cpu' or 'gpu', got {self.preset!r}")
        for name in ("block", "capacity", "batch", "later_capacity", "later_batch", "later_queries", "max_passes",
                     "brute_queries", "brute_tile", "select_width"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"KnnTuning: {name} must be a positive int or None, got {value!r}")
        if self.per_cell is not None and not self.per_cell > 0:
            raise ValueError(f"KnnTuning: per_cell must be positive or None, got {self.per_cell!r}")
        for name in ("search", "slot_search"):
            if getattr(self, name) not in (None, "scan", "scan_unrolled", "sort", "compare_all"):
                raise ValueError(f"KnnTuning: {name} must be None or a jnp.searchsorted method, got "
                                 f"{getattr(self, name)!r}")
        if self.select not in (None, "top_k", "threshold", "union"):
            raise ValueError(f"KnnTuning: select must be None, 'top_k', 'threshold' or 'union', got {self.select!r}")


PRESETS = {"cpu": KnnTuning(preset="cpu"), "gpu": KnnTuning(preset="gpu")}


def resolve(tuning: KnnTuning | str | None, where: str, devices: Any = None) -> KnnTuning:
    """The caller's ``tuning=`` (None, ``"cpu"``, ``"gpu"`` or a :class:`KnnTuning`) as a :class:`KnnTuning`; for
    ``None`` the preset of the backend of ``devices`` (default: the mesh being traced, else JAX's default)."""
    return resolve_tuning(tuning, PRESETS, KnnTuning, where, devices)


class Tiles(NamedTuple):
    """How one grid pass cuts its work (static): queries per block, candidate slots per block, blocks per
    sequential step, the ``jnp.searchsorted`` methods of the candidate runs and of each slot's run, how each
    query selects its nearest candidates (method and packed width), the blocks of the one step a pass of at
    most that many blocks takes instead (0: none), and whether a block also ends at an empty cell of its row (the
    scattered queries of a compacted pass)."""

    block: int
    capacity: int
    batch: int
    search: SearchMethod
    slot_search: SearchMethod
    select: SelectMethod
    select_width: int
    few_batch: int = 0
    split_gaps: bool = False


class Sizes(NamedTuple):
    """Every size of :class:`KnnTuning`, filled in for one problem (static)."""

    per_cell: float
    block: int
    capacity: int
    batch: int
    later_capacity: int
    later_batch: int
    later_queries: int
    max_passes: int
    brute_queries: int
    brute_tile: int
    search: SearchMethod
    slot_search: SearchMethod
    select: SelectMethod
    select_width: int

    @property
    def full(self) -> Tiles:
        """The tiles of the full passes (the first grid and the adapted grids)."""
        return Tiles(self.block, self.capacity, self.batch, self.search, self.slot_search, self.select,
                     self.select_width)

    @property
    def compacted(self) -> Tiles:
        """The tiles of the compacted later passes."""
        # A pass over the last few uncertified queries takes one small step instead of a large one of padding.
        few = self.later_batch // 64 if self.later_batch >= 128 else 0
        return Tiles(self.block, self.later_capacity, self.later_batch, self.search, self.slot_search, self.select,
                     self.select_width, few, split_gaps=True)


def sizes(tuning: KnnTuning, dim: int, k: int, m: int, n: int) -> Sizes:
    """The sizes ``tuning`` gives a search of ``m`` queries among ``n`` data rows in ``dim`` dimensions."""
    per_cell = tuning.per_cell or (max(4.0, 0.5 * k) if dim == 3 else max(3.0, 0.4 * k))
    block = tuning.block
    # A block's candidates: its own cells and one more on each side, in 3**(dim-1) rows; 1.6x the mean holds
    # Poisson fluctuations, so nearly every block of uniform data fits.
    need = (9 if dim == 3 else 3) * (block + 3 * per_cell)
    capacity = tuning.capacity or max(256 if dim == 3 else 96, int(1.6 * need) // 32 * 32 + 32, k + 1)
    later_capacity = tuning.later_capacity or max(6 * capacity, k + 1)
    if tuning.preset == "cpu":
        batch = max(8, _CPU_STEP_DISTANCES // (block * capacity))
        later_batch, brute_queries, brute_tile, search, slot_search = 32, 64, 2048, "scan", "compare_all"
        select: SelectMethod = "top_k"
    else:
        # Blocks of the first pass over uniform data: a block per `block` queries plus a partial one per grid row,
        # and 5% to spare.
        rows = math.ceil((max(m, 1) / per_cell) ** ((dim - 1) / dim))
        blocks = (max(m, 1) // block + rows) * 21 // 20 + 1
        most = max(step_bytes() // _BYTES_PER_DISTANCE, _GPU_MIN_STEP_DISTANCES)
        least = min(_GPU_MIN_STEP_DISTANCES // (block * capacity), blocks)
        batch = min(max(-(-blocks // _GPU_FIRST_STEPS), least, 1), max(most // (block * capacity), 1))
        # Later steps and brute-force steps carry as many distances as a first-pass step.
        distances = batch * block * capacity
        later_batch = max(distances // (block * later_capacity), 1)
        brute_queries = min(max(m, 1), 256)
        brute_tile = min(max(distances // brute_queries, 1024), max(n, 1))
        search = slot_search = "scan_unrolled"
        # A GPU's top_k sorts each whole row of candidates (~85% of the first pass at 1e6 points, k=9).
        select = "threshold"
    width = tuning.select_width or -(-max(2 * (k + 1), k + 17) // 8) * 8
    return Sizes(per_cell=per_cell, block=block, capacity=max(capacity, k + 1), batch=tuning.batch or batch,
                 later_capacity=max(later_capacity, k + 1), later_batch=tuning.later_batch or later_batch,
                 later_queries=tuning.later_queries, max_passes=tuning.max_passes,
                 brute_queries=tuning.brute_queries or brute_queries, brute_tile=tuning.brute_tile or brute_tile,
                 search=tuning.search or search, slot_search=tuning.slot_search or slot_search,
                 select=tuning.select or select, select_width=max(width, k + 1))
