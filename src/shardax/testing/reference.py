"""Plain NumPy/SciPy references for shardax's kernels: what tests, ``shardax demo`` and ``shardax bench`` check
their results against.

Every function works on host arrays (gathered from every device, in global input order), in float64 where it
computes distances or sums, and independently of the kernel it checks: Morton keys by the classic shift-and-mask bit
spreading, neighbours by brute force with the minimum-image convention, friends-of-friends groups by a pair search
and connected components, cloud-in-cell painting and the binned power spectrum with ``numpy.fft``.

SciPy is a test/benchmark dependency, not one of shardax's: this module imports NumPy only, and SciPy inside the
functions that use it. :func:`fof_components` needs SciPy; :func:`friend_pairs` (and so :func:`fof_labels`) uses
SciPy's ``cKDTree`` when it is installed and a NumPy cell grid otherwise; everything else is NumPy alone.

Example:
    >>> import numpy as np
    >>> from shardax.testing import reference
    >>> pos = np.random.default_rng(0).random((500, 3))
    >>> distances, indices = reference.brute_knn(pos, 4, box=1.0)
    >>> bool(np.all(indices[:, 0] == np.arange(500))), distances.shape
    (True, (500, 4))
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

__all__ = ["brute_knn", "cic_paint", "cic_readout", "component_labels", "fof_catalogue", "fof_components",
           "fof_labels", "friend_pairs", "minimum_image", "morton_keys", "morton_order", "power_spectrum"]

Box = float | Sequence[float] | np.ndarray

# Bits per axis of a Morton key (as shardax.particles.KEY_BITS_PER_DIM documents), and the shift/mask stages that
# move bit i of such a coordinate to bit D * i of a 64-bit word.
_KEY_BITS = {2: 31, 3: 21}
_SPREAD = {
    2: ((16, 0x0000FFFF0000FFFF), (8, 0x00FF00FF00FF00FF), (4, 0x0F0F0F0F0F0F0F0F), (2, 0x3333333333333333),
        (1, 0x5555555555555555)),
    3: ((32, 0x1F00000000FFFF), (16, 0x1F0000FF0000FF), (8, 0x100F00F00F00F00F), (4, 0x10C30C30C30C30C3),
        (2, 0x1249249249249249)),
}


def _positions(pos: Any, name: str = "pos") -> np.ndarray:
    array = np.asarray(pos)
    if array.ndim != 2 or array.shape[1] < 1:
        raise ValueError(f"{name} must be a (n, d) array of positions, got shape {array.shape}")
    return array


def _box(box: Box, dim: int) -> np.ndarray:
    """``box`` as a `(d,)` float64 array of positive edge lengths."""
    edges = np.broadcast_to(np.asarray(box, np.float64), (dim,))
    if not np.all(edges > 0):
        raise ValueError(f"box must be positive (one number or one per axis), got {box!r}")
    return edges


def minimum_image(delta: Any, box: Box | None) -> np.ndarray:
    """Separations mapped to their nearest periodic image: ``delta - box * round(delta / box)``.

    Args:
        delta: `(..., d)` separations.
        box: periodic box size (one number or one per axis); None: open boundaries, ``delta`` unchanged.

    Returns:
        `(..., d)`, each component in ``[-box/2, box/2]``.

    Example:
        >>> float(minimum_image(np.array([0.9]), 1.0)[0])
        -0.09999999999999998
    """
    delta = np.asarray(delta)
    if box is None:
        return delta
    edges = np.asarray(box, np.float64)
    return delta - edges * np.round(delta / edges)


def brute_knn(pos: Any, k: int, *, queries: Any = None, box: Box | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Exact k nearest neighbours by brute force in float64 (every query against every row).

    Args:
        pos: `(n, d)` positions; neighbours are row indices into it.
        k: neighbours per query (at most ``n``); a query row is its own first neighbour at distance 0.
        queries: `(q,)` row indices to search for (default: every row).
        box: periodic box size (minimum image), one number or one per axis; None: open boundaries.

    Returns:
        ``(distances (q, k), indices (q, k))``: Euclidean distances ascending, equal distances by row index.

    Example:
        >>> pos = np.array([[0.0], [0.9], [0.3]])
        >>> d, i = brute_knn(pos, 2, box=1.0)
        >>> i.tolist()
        [[0, 1], [1, 0], [2, 0]]
    """
    data = _positions(pos).astype(np.float64)
    n = len(data)
    if not isinstance(k, int | np.integer) or not 1 <= k <= n:
        raise ValueError(f"k must be an int in [1, {n}] (the number of rows), got {k!r}")
    rows_all = np.arange(n) if queries is None else np.asarray(queries, np.int64).reshape(-1)
    out_d = np.empty((len(rows_all), k))
    out_i = np.empty((len(rows_all), k), np.int64)
    block = max(1, min(256, 2**22 // n))  # a block's separations stay near 100 MB
    take = min(n, k + 8)  # a margin beyond k keeps exact ties at the cut; the final order is (distance, index)
    for start in range(0, len(rows_all), block):
        rows = rows_all[start:start + block]
        dist2 = np.sum(minimum_image(data[None, :, :] - data[rows, None, :], box) ** 2, axis=-1)
        candidates = np.argpartition(dist2, take - 1, axis=1)[:, :take]
        cand_d = np.take_along_axis(dist2, candidates, axis=1)
        order = np.lexsort((candidates, cand_d), axis=1)[:, :k]
        picked = np.take_along_axis(candidates, order, axis=1)
        # Rows with more rows tied at the k-th distance than the margin holds: the whole row, in (distance, index).
        kth = np.take_along_axis(cand_d, order[:, -1:], axis=1)
        crowded = np.flatnonzero(np.sum(dist2 <= kth, axis=1) > take)
        if crowded.size:
            everything = np.broadcast_to(np.arange(n), (crowded.size, n))
            picked[crowded] = np.lexsort((everything, dist2[crowded]), axis=1)[:, :k]
        out_i[start:start + len(rows)] = picked
        out_d[start:start + len(rows)] = np.sqrt(np.take_along_axis(dist2, picked, axis=1))
    return out_d, out_i


def morton_keys(pos: Any, *, box: float | None = 1.0, wrap: bool = True) -> np.ndarray:
    """Morton (z-order) keys of 2D or 3D positions, as :mod:`shardax.particles` defines them.

    Each coordinate is quantised over ``[0, box)`` to ``B`` bits (``B = 21`` in 3D, ``31`` in 2D), cell
    ``min(floor(x * (2**B / box)), 2**B - 1)`` computed in the positions' dtype, and bit ``i`` of axis ``k`` goes to
    bit ``D * i + k`` of the key. Without a box, as ``zsort(box=None)``: over the bounding box of ``pos``, cell
    ``floor((x - lo) * (2**B / (hi - lo)))`` per axis (an axis where all rows agree has extent 1).

    Args:
        pos: `(n, 2)` or `(n, 3)` positions.
        box: the periodic box edge, or None for the bounding box of ``pos``.
        wrap: map positions into ``[0, box)`` first; False: they are already there (saves two passes over
            ``pos``; positions outside are clamped to the edge cells).

    Returns:
        `(n,)` uint64 keys.

    Example:
        >>> keys = morton_keys(np.array([[0.0, 0.0, 0.0], [0.5, 0.0, 0.0], [0.0, 0.5, 0.0]], np.float32))
        >>> keys.tolist() == [0, 1 << 60, 1 << 61]  # bit 20 of x and of y: key bits 60 and 61
        True
    """
    pos = _positions(pos)
    dim = pos.shape[1]
    if dim not in _KEY_BITS:
        raise ValueError(f"morton_keys takes 2D or 3D positions, got shape {pos.shape}")
    bits = _KEY_BITS[dim]
    if box is None:
        lo, hi = pos.min(axis=0), pos.max(axis=0)
        extent = np.where(hi > lo, hi - lo, 1).astype(pos.dtype)
        pos = pos - lo
    else:
        extent = pos.dtype.type(box)
        if wrap:
            pos = np.mod(pos, extent)
            pos = np.where(pos >= extent, pos - extent, pos)  # float rounding can land a tiny negative on the edge
    # (2**31 - 1 has no float32: clamp the top cell in integers)
    cells = np.clip(np.floor(pos * (pos.dtype.type(2**bits) / extent)), 0, 2**bits).astype(np.uint64)
    cells = np.minimum(cells, np.uint64(2**bits - 1))
    key = np.zeros(len(pos), np.uint64)
    for axis in range(dim):
        x = cells[:, axis]
        for shift, mask in _SPREAD[dim]:
            x = (x | (x << np.uint64(shift))) & np.uint64(mask)
        key |= x << np.uint64(axis)
    return key


def morton_order(pos: Any, *, box: float = 1.0, ids: Any = None) -> np.ndarray:
    """The permutation that puts rows in z-order (:func:`morton_keys`), equal keys by ``ids``.

    Args:
        pos: `(n, 2)` or `(n, 3)` positions (wrapped into the periodic box ``[0, box)``).
        box: the periodic box edge.
        ids: `(n,)` tie-breakers (``shardax.particles.zsort`` keeps equal keys in input order: pass the input
            index); None: equal keys in any order (a plain ``argsort``, the fastest).

    Returns:
        `(n,)` int64 row indices.

    Example:
        >>> pos = np.array([[0.6, 0.6, 0.6], [0.1, 0.1, 0.1], [0.6, 0.1, 0.1]])
        >>> morton_order(pos, ids=np.arange(3)).tolist()
        [1, 2, 0]
    """
    keys = morton_keys(pos, box=box)
    return np.argsort(keys) if ids is None else np.lexsort((np.asarray(ids), keys))


def friend_pairs(pos: Any, linking_length: float, *, box: Box | None = None) -> np.ndarray:
    """Every pair of rows closer than or at ``linking_length`` (minimum image in a periodic box).

    SciPy's ``cKDTree.query_pairs`` when SciPy is installed, else a NumPy cell grid (rows binned in cells at least
    ``linking_length`` wide, the neighbouring cells searched for every row); both give the same pairs.

    Args:
        pos: `(n, d)` positions.
        linking_length: the largest separation of a pair.
        box: periodic box size, one number or one per axis; None: open boundaries.

    Returns:
        `(p, 2)` int64 row indices ``(i, j)`` with ``i < j``, sorted.

    Example:
        >>> friend_pairs(np.array([[0.05, 0.5], [0.95, 0.5], [0.5, 0.5]]), 0.15, box=1.0).tolist()
        [[0, 1]]
    """
    data = _positions(pos).astype(np.float64)
    edges = None if box is None else _box(box, data.shape[1])
    if edges is not None:
        data = np.mod(data, edges)
        data = np.where(data >= edges, data - edges, data)
    try:
        from scipy.spatial import cKDTree  # pyright: ignore[reportAttributeAccessIssue]
    except ImportError:
        return _grid_pairs(data, float(linking_length), edges)
    pairs = cKDTree(data, boxsize=edges).query_pairs(linking_length, output_type="ndarray")
    return np.unique(np.asarray(pairs, np.int64).reshape(-1, 2), axis=0)


def _grid_pairs(pos: np.ndarray, radius: float, box: np.ndarray | None) -> np.ndarray:
    """:func:`friend_pairs` in NumPy alone (``pos`` already in ``[0, box)`` when periodic)."""
    n, dim = pos.shape
    if n == 0:
        return np.zeros((0, 2), np.int64)
    origin = np.zeros(dim) if box is not None else pos.min(axis=0)
    extent = box if box is not None else np.maximum(pos.max(axis=0) - origin, radius)
    per_axis = np.clip((extent // radius).astype(np.int64), 1, 128)
    cell = np.minimum(((pos - origin) // (extent / per_axis)).astype(np.int64), per_axis - 1)
    flat = np.asarray(np.ravel_multi_index(tuple(cell.T), tuple(per_axis)))
    order = np.argsort(flat, kind="stable")
    sorted_cells = flat[order]
    found = []
    for offset in itertools.product((-1, 0, 1), repeat=dim):
        near = cell + np.asarray(offset)
        if box is not None:
            near %= per_axis
            inside = np.ones(n, bool)
        else:
            inside = np.all((near >= 0) & (near < per_axis), axis=1)
            near = np.clip(near, 0, per_axis - 1)
        target = np.ravel_multi_index(tuple(near.T), tuple(per_axis))
        first = np.searchsorted(sorted_cells, target, "left")
        counts = np.where(inside, np.searchsorted(sorted_cells, target, "right") - first, 0)
        left = np.repeat(np.arange(n), counts)
        within = np.arange(int(counts.sum())) - np.repeat(np.cumsum(counts) - counts, counts)
        right = order[np.repeat(first, counts) + within]
        keep = left < right
        left, right = left[keep], right[keep]
        dist2 = np.sum(minimum_image(pos[left] - pos[right], box) ** 2, axis=1)
        found.append(np.stack([left, right], axis=1)[dist2 <= radius * radius])
    # With fewer than three cells per axis two offsets can name the same cell.
    return np.unique(np.concatenate(found), axis=0)


def component_labels(n: int, pairs: Any) -> np.ndarray:
    """Connected components of ``n`` nodes linked by ``pairs``, each node labelled by the smallest node of its
    component (a union-find in NumPy: hooking onto the smaller root, then full path compression).

    Args:
        n: number of nodes.
        pairs: `(p, 2)` node indices.

    Returns:
        `(n,)` int64 labels.

    Example:
        >>> component_labels(5, np.array([[3, 1], [4, 3]])).tolist()
        [0, 1, 2, 1, 1]
    """
    parent = np.arange(n)
    pairs = np.asarray(pairs, np.int64).reshape(-1, 2)
    left, right = pairs[:, 0], pairs[:, 1]
    while True:
        a, b = parent[left], parent[right]
        differ = a != b
        if not differ.any():
            return parent
        np.minimum.at(parent, np.maximum(a, b)[differ], np.minimum(a, b)[differ])
        while True:
            jumped = parent[parent]
            if np.array_equal(jumped, parent):
                break
            parent = jumped


def fof_labels(pos: Any, linking_length: float, *, box: Box | None = None, min_members: int = 1) -> np.ndarray:
    """Friends-of-friends labels as :func:`shardax.spatial.fof` defines them: a group's label is the smallest row
    index among its members; rows of groups smaller than ``min_members`` get -1.

    :func:`friend_pairs` (SciPy's ``cKDTree`` or the NumPy grid) then :func:`component_labels`.

    Args:
        pos: `(n, d)` positions, rows in global input order.
        linking_length: the linking length (absolute, not in units of the mean separation).
        box: periodic box size, one number or one per axis; None: open boundaries.
        min_members: the smallest group that keeps its label.

    Returns:
        `(n,)` int64 labels.

    Example:
        >>> pos = np.array([[0.0, 0.0], [0.95, 0.0], [0.5, 0.5], [0.5, 0.55], [0.5, 0.6]])
        >>> fof_labels(pos, 0.06, box=1.0, min_members=3).tolist()
        [-1, -1, 2, 2, 2]
    """
    n = len(_positions(pos))
    labels = component_labels(n, friend_pairs(pos, linking_length, box=box))
    sizes = np.bincount(labels, minlength=n)
    return np.where(sizes[labels] >= min_members, labels, -1)


def fof_components(pos: Any, linking_length: float, *, box: Box | None = None) -> np.ndarray:
    """Friends-of-friends components by SciPy alone: ``cKDTree.query_pairs`` and
    ``scipy.sparse.csgraph.connected_components`` (the anchor ``shardax bench`` times FoF against).

    Needs SciPy. Unlike :func:`fof_labels`, components are numbered ``0, 1, ...`` in SciPy's order, with no
    ``min_members`` cut.

    Args:
        pos: `(n, d)` positions, in ``[0, box)`` when periodic.
        linking_length: the linking length.
        box: periodic box size, one number or one per axis; None: open boundaries.

    Returns:
        `(n,)` int32 component ids.

    Example:
        >>> fof_components(np.array([[0.05], [0.95], [0.5]]), 0.15, box=1.0).tolist()
        [0, 0, 1]
    """
    from scipy.sparse import coo_matrix
    from scipy.sparse.csgraph import connected_components
    from scipy.spatial import cKDTree  # pyright: ignore[reportAttributeAccessIssue]

    pairs = cKDTree(pos, boxsize=box).query_pairs(linking_length, output_type="ndarray")
    n = len(pos)
    graph = coo_matrix((np.ones(len(pairs), np.int8), (pairs[:, 0], pairs[:, 1])), shape=(n, n))
    return connected_components(graph, directed=False)[1]


def fof_catalogue(pos: Any, labels: Any, *, mass: Any = None, vel: Any = None,
                  box: Box | None = None) -> dict[str, np.ndarray]:
    """The catalogue of labelled groups, as :class:`shardax.spatial.Catalogue` defines it, in float64.

    Each group's members are unwrapped next to the member it is labelled by (minimum image), so ``com`` is
    periodic-aware for groups narrower than half the box.

    Args:
        pos: `(n, d)` positions.
        labels: `(n,)` labels as :func:`fof_labels` gives them: a group's label is one of its rows, -1 for none.
        mass: `(n,)` masses (default: 1 each).
        vel: `(n, d)` velocities (default: 0).
        box: periodic box size, one number or one per axis; None: open boundaries.

    Returns:
        One row per group in ascending label order: ``count`` `(g,)`, ``mass`` `(g,)`, ``com`` `(g, d)` (wrapped
        into the box), ``vel`` `(g, d)` (mass-weighted mean), ``radius`` `(g,)` (root mean square distance to
        ``com``, mass-weighted), ``label`` `(g,)`, and ``spanning`` `(g,)`: groups wider than half the box along
        some axis, whose centre is not well defined.

    Example:
        >>> pos = np.array([[0.98, 0.5], [0.02, 0.5], [0.5, 0.5]])
        >>> cat = fof_catalogue(pos, np.array([0, 0, -1]), box=1.0)
        >>> cat["count"].tolist(), np.round(cat["com"], 6).tolist()
        ([2], [[0.0, 0.5]])
    """
    pos = _positions(pos).astype(np.float64)
    labels = np.asarray(labels, np.int64)
    dim = pos.shape[1]
    members = np.flatnonzero(labels >= 0)
    groups, member_of = np.unique(labels[members], return_inverse=True)
    count = np.bincount(member_of, minlength=len(groups))
    m = np.ones(len(members)) if mass is None else np.asarray(mass, np.float64)[members]
    v = np.zeros((len(members), dim)) if vel is None else np.asarray(vel, np.float64)[members]
    total = np.bincount(member_of, m, len(groups))

    def mean(values: np.ndarray) -> np.ndarray:  # mass-weighted, per group, per axis
        sums = [np.bincount(member_of, m * values[:, a], len(groups)) for a in range(dim)]
        return np.stack(sums, axis=1) / total[:, None]

    offset = minimum_image(pos[members] - pos[groups][member_of], box)
    centre = mean(offset)
    com = pos[groups] + centre
    if box is not None:
        com = np.mod(com, _box(box, dim))
    spread = offset - centre[member_of]
    radius = np.sqrt(np.bincount(member_of, m * np.sum(spread**2, axis=1), len(groups)) / total)
    spanning = np.zeros(len(groups), bool)
    if box is not None and len(members):
        order = np.argsort(member_of, kind="stable")
        starts = np.flatnonzero(np.r_[True, np.diff(member_of[order]) != 0])
        width = np.maximum.reduceat(offset[order], starts) - np.minimum.reduceat(offset[order], starts)
        spanning = np.any(width > 0.5 * _box(box, dim), axis=1)
    return {"count": count, "mass": total, "com": com, "vel": mean(v), "radius": radius,
            "label": groups, "spanning": spanning}


def _cic_corners(pos: np.ndarray, shape: tuple[int, ...], box: float) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """Per corner of the cell around each row: ``(flat grid index (n,), weight (n,))``."""
    scaled = np.asarray(pos, np.float64) * (np.asarray(shape) / box)
    base = np.floor(scaled).astype(np.int64)
    frac = scaled - base
    for corner in itertools.product((0, 1), repeat=len(shape)):
        upper = np.asarray(corner, bool)
        weight = np.prod(np.where(upper, frac, 1.0 - frac), axis=1)
        yield np.asarray(np.ravel_multi_index(tuple(((base + upper) % np.asarray(shape)).T), shape)), weight


def _check_grid(pos: np.ndarray, shape: tuple[int, ...], box: float) -> None:
    if pos.shape[1] != len(shape):
        raise ValueError(f"positions of {pos.shape[1]} dimensions on a grid of shape {shape}: give one size per axis")
    if not box > 0:
        raise ValueError(f"box must be positive, got {box!r}")


def cic_paint(pos: Any, shape: Sequence[int], *, box: float, mass: Any = None) -> np.ndarray:
    """Cloud-in-cell mass on a periodic grid whose point ``i`` sits at ``i * box / n`` (float64), as
    :func:`shardax.fields.paint` paints it.

    Args:
        pos: `(n, d)` positions (any real values: the grid is periodic).
        shape: the grid, `d` sizes.
        box: the periodic box edge (the same along every axis).
        mass: `(n,)` masses (default: 1 each).

    Returns:
        ``shape`` float64 field whose sum is the total mass.

    Example:
        >>> cic_paint(np.array([[0.25, 0.0, 0.0]]), (2, 2, 2), box=1.0)[:, 0, 0].tolist()
        [0.5, 0.5]
    """
    pos = _positions(pos)
    shape = tuple(int(s) for s in shape)
    _check_grid(pos, shape, box)
    weights = np.ones(len(pos)) if mass is None else np.asarray(mass, np.float64)
    field = np.zeros(math.prod(shape))
    for index, weight in _cic_corners(pos, shape, box):
        field += np.bincount(index, weight * weights, minlength=field.size)
    return field.reshape(shape)


def cic_readout(field: Any, pos: Any, *, box: float) -> np.ndarray:
    """Cloud-in-cell interpolation of a periodic grid at ``pos`` (the transpose of :func:`cic_paint`), as
    :func:`shardax.fields.readout` computes it.

    Args:
        field: the grid, `(n0, ..., nd-1)`.
        pos: `(n, d)` positions.
        box: the periodic box edge.

    Returns:
        `(n,)` float64 values.

    Example:
        >>> cic_readout(np.arange(8.0).reshape(2, 2, 2), np.array([[0.25, 0.0, 0.0]]), box=1.0).tolist()
        [2.0]
    """
    grid = np.asarray(field, np.float64)
    pos = _positions(pos)
    _check_grid(pos, grid.shape, box)
    out = np.zeros(len(pos))
    for index, weight in _cic_corners(pos, grid.shape, box):
        out += grid.reshape(-1)[index] * weight
    return out


def power_spectrum(delta: Any, *, box: float, edges: Any, compensate: bool = True
                   ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The binned power spectrum of a real 3D field, as :func:`shardax.fields.power_spectrum` defines it.

    ``P = V |delta_k|^2 / N^2`` over the half spectrum of ``numpy.fft.rfftn`` (planes other than the zero and
    Nyquist ones counted twice, for their conjugate partners), the zero mode left out, averaged in the bins.

    Args:
        delta: `(n0, n1, n2)` real field (usually the overdensity of a painted field).
        box: the periodic box edge (the same along every axis).
        edges: `(nbins + 1,)` ascending bin edges in wavenumber (``shardax.fields.bin_edges`` gives shardax's).
        compensate: divide by the squared cloud-in-cell window (for fields painted with CIC).

    Returns:
        ``(k, pk, modes)``, each `(nbins,)`: mean ``|k|`` of the modes in the bin (its centre if empty), the power
        (0 if empty) and the int64 mode count.

    Example:
        >>> delta = np.cos(2 * np.pi * np.arange(8) / 8)[:, None, None] * np.ones((8, 8, 8))
        >>> k, pk, modes = power_spectrum(delta, box=8.0, edges=np.array([0.5, 1.0]), compensate=False)
        >>> round(float(k[0]), 4), int(modes[0]), round(float(pk[0]), 3)
        (0.7854, 6, 42.667)
    """
    field = np.asarray(delta, np.float64)
    if field.ndim != 3:
        raise ValueError(f"power_spectrum takes a 3D field, got shape {field.shape}")
    edges = np.asarray(edges, np.float64)
    waves = [2 * np.pi * np.fft.fftfreq(field.shape[0], box / field.shape[0]),
             2 * np.pi * np.fft.fftfreq(field.shape[1], box / field.shape[1]),
             2 * np.pi * np.fft.rfftfreq(field.shape[2], box / field.shape[2])]
    kx, ky, kz = np.meshgrid(*waves, indexing="ij")
    kmag = np.sqrt(kx**2 + ky**2 + kz**2)
    power = np.abs(np.fft.rfftn(field)) ** 2
    if compensate:
        spacing = [box / n for n in field.shape]
        window = np.ones_like(kmag)
        for wave, h in zip((kx, ky, kz), spacing, strict=True):
            window *= np.sinc(wave * h / (2 * np.pi)) ** 4
        power /= window
    plane = np.arange(kmag.shape[2])
    weight = np.where((plane > 0) & (2 * plane != field.shape[2]), 2, 1)[None, None, :] * (kmag > 0)
    which = np.digitize(kmag, edges) - 1
    nbins = len(edges) - 1
    used = (which >= 0) & (which < nbins) & (weight > 0)
    modes = np.bincount(which[used], weight[used], nbins)
    safe = np.maximum(modes, 1)
    pk = np.bincount(which[used], (weight * power)[used], nbins) / safe * box**3 / field.size**2
    kmean = np.bincount(which[used], (weight * kmag)[used], nbins) / safe
    centres = 0.5 * (edges[1:] + edges[:-1])
    return np.where(modes > 0, kmean, centres), np.where(modes > 0, pk, 0.0), modes.astype(np.int64)
