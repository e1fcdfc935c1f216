"""NumPy (and, when installed, SciPy) references for ``shardax demo``, and the comparisons that turn them into
failure messages.

Everything here works on host arrays gathered from every device, in float64, independently of the kernels it
checks: Morton keys are interleaved bit by bit, neighbours found by brute force, friends-of-friends groups by a pair
search (SciPy's ``KDTree``, else a cell grid) and a union-find, cloud-in-cell and the power spectrum by ``numpy.fft``.
A comparison returns ``""`` when it passes and a one-line reason when it does not.
"""

from __future__ import annotations

import itertools
import math
from typing import Any

import numpy as np

from ..particles import KEY_BITS_PER_DIM
from ..testing import ToleranceKind as Kind
from ..testing import tolerance


def exact(name: str, got: Any, want: Any) -> str:
    """``""`` if ``got`` equals ``want`` element for element (shapes included), else what differs."""
    got, want = np.asarray(got), np.asarray(want)
    if got.shape != want.shape:
        return f"{name}: shape {got.shape}, reference {want.shape}"
    wrong = np.flatnonzero(got.reshape(-1) != want.reshape(-1))
    if wrong.size:
        first = int(wrong[0])
        return (f"{name}: {wrong.size} of {want.size} values differ from the reference (first at flat index {first}: "
                f"{got.reshape(-1)[first]} vs {want.reshape(-1)[first]})")
    return ""


def close(name: str, got: Any, want: Any, *, dtype: Any, kind: Kind = "default") -> str:
    """``""`` if ``got`` matches ``want`` within the tolerance of ``dtype`` and ``kind`` in shardax's table
    (:func:`shardax.testing.tolerance`; NaN never matches), else how many values are off and by how much."""
    got, want = np.asarray(got), np.asarray(want)
    if got.shape != want.shape:
        return f"{name}: shape {got.shape}, reference {want.shape}"
    tol = tolerance(dtype, kind)
    off = ~np.isclose(got, want, rtol=tol["rtol"], atol=tol["atol"])
    if not off.any():
        return ""
    diff = np.where(off, np.abs(got.astype(np.complex128) - want), 0)
    worst = np.unravel_index(int(np.nanargmax(np.where(np.isnan(diff), np.inf, diff))), got.shape)
    return (f"{name}: {int(off.sum())} of {off.size} values outside rtol={tol['rtol']:g}, atol={tol['atol']:g} "
            f"({np.dtype(dtype).name}, {kind}); worst at {tuple(int(i) for i in worst)}: {got[worst]} vs "
            f"{want[worst]}")


def below(name: str, value: float, limit: float) -> str:
    """``""`` if ``value`` is finite and at most ``limit``."""
    return "" if math.isfinite(value) and value <= limit else f"{name} = {value:.3g}, limit {limit:.3g}"


def morton_order(pos: np.ndarray, ids: np.ndarray, box: float) -> np.ndarray:
    """The rows of ``pos: (n, 3)`` in z-order over the periodic box ``[0, box)``, ties by ``ids``.

    Cells are quantised as :mod:`shardax.particles` documents (``floor(x * 2**B / box)`` in the positions' dtype,
    ``B = 21`` in 3D) and bit ``i`` of axis ``k`` goes to key bit ``3 i + k``.
    """
    dim = pos.shape[1]
    bits = KEY_BITS_PER_DIM[dim]
    extent = pos.dtype.type(box)
    wrapped = np.mod(pos, extent)
    wrapped = np.where(wrapped >= extent, wrapped - extent, wrapped)
    cells = np.floor(wrapped * (pos.dtype.type(2**bits) / extent))
    cells = np.minimum(cells.astype(np.uint64), np.uint64(2**bits - 1))
    key = np.zeros(len(pos), np.uint64)
    for bit in range(bits):
        for axis in range(dim):
            digit = (cells[:, axis] >> np.uint64(bit)) & np.uint64(1)
            key |= digit << np.uint64(dim * bit + axis)
    return np.lexsort((ids, key))


def minimum_image(delta: np.ndarray, box: float | None) -> np.ndarray:
    """Separations mapped to their nearest periodic image (unchanged without a box)."""
    return delta if box is None else delta - box * np.round(delta / box)


def brute_knn(pos: np.ndarray, queries: np.ndarray, k: int, box: float | None) -> tuple[np.ndarray, np.ndarray]:
    """Exact k nearest neighbours of ``pos[queries]`` among all rows of ``pos``, by brute force in float64.

    Returns:
        ``(distances (q, k), indices (q, k))``: ascending distance, equal distances by row index.
    """
    data = np.asarray(pos, np.float64)
    out_d = np.empty((len(queries), k))
    out_i = np.empty((len(queries), k), np.int64)
    for start in range(0, len(queries), 64):
        rows = queries[start:start + 64]
        dist2 = np.sum(minimum_image(data[None, :, :] - data[rows, None, :], box) ** 2, axis=-1)
        # A margin beyond k keeps exact ties at the cut; the final order is (distance, index).
        take = min(len(data), k + 8)
        candidates = np.argpartition(dist2, take - 1, axis=1)[:, :take]
        cand_d = np.take_along_axis(dist2, candidates, axis=1)
        order = np.lexsort((candidates, cand_d), axis=1)[:, :k]
        out_i[start:start + len(rows)] = np.take_along_axis(candidates, order, axis=1)
        out_d[start:start + len(rows)] = np.sqrt(np.take_along_axis(cand_d, order, axis=1))
    return out_d, out_i


def knn_mismatch(got_d: np.ndarray, got_i: np.ndarray, want_d: np.ndarray, want_i: np.ndarray, dtype: Any) -> str:
    """Compare `(q, k)` results with a reference of ``k + 1`` columns (:func:`brute_knn`): distances within
    tolerance, and neighbour indices identical wherever the reference order is not a near tie (two distances closer
    than the float tolerance may legitimately come in either order, also across the k-th place)."""
    k = got_d.shape[1]
    message = close("knn distances", got_d, want_d[:, :k], dtype=dtype)
    if message:
        return message
    near = np.diff(want_d, axis=1) <= 8 * float(np.finfo(dtype).eps) * np.maximum(want_d[:, 1:], 1e-30)
    tied = np.zeros(want_d.shape, bool)
    tied[:, 1:] |= near
    tied[:, :-1] |= near
    clear = ~tied[:, :k]
    return exact("knn indices (rows without near ties)", got_i[clear], want_i[:, :k][clear])


def friend_pairs(pos: np.ndarray, linking_length: float, box: float) -> np.ndarray:
    """All pairs ``(i, j), i < j`` of rows closer than (or at) ``linking_length`` in the periodic box, `(p, 2)`.

    SciPy's ``KDTree.query_pairs`` when SciPy is installed, else :func:`grid_pairs`.
    """
    data = np.mod(np.asarray(pos, np.float64), box)
    try:
        from scipy.spatial import KDTree
    except ImportError:
        return grid_pairs(data, linking_length, box)
    pairs = KDTree(data, boxsize=box).query_pairs(linking_length, output_type="ndarray")
    return np.asarray(pairs, np.int64).reshape(-1, 2)


def grid_pairs(pos: np.ndarray, radius: float, box: float) -> np.ndarray:
    """:func:`friend_pairs` in NumPy alone: rows binned in cells at least ``radius`` wide, neighbouring cells
    searched for every row (``pos`` already in ``[0, box)``)."""
    n, dim = pos.shape
    per_axis = max(1, min(int(box // radius), 128))
    width = box / per_axis
    cell = np.minimum((pos // width).astype(np.int64), per_axis - 1)
    flat = np.asarray(np.ravel_multi_index(tuple(cell.T), (per_axis,) * dim))
    order = np.argsort(flat, kind="stable")
    sorted_cells = flat[order]
    found = []
    for offset in itertools.product((-1, 0, 1), repeat=dim):
        near = np.ravel_multi_index(tuple(((cell + np.asarray(offset)) % per_axis).T), (per_axis,) * dim)
        first = np.searchsorted(sorted_cells, near, "left")
        counts = np.searchsorted(sorted_cells, near, "right") - first
        left = np.repeat(np.arange(n), counts)
        within = np.arange(int(counts.sum())) - np.repeat(np.cumsum(counts) - counts, counts)
        right = order[np.repeat(first, counts) + within]
        keep = left < right
        left, right = left[keep], right[keep]
        dist2 = np.sum(minimum_image(pos[left] - pos[right], box) ** 2, axis=1)
        found.append(np.stack([left, right], axis=1)[dist2 <= radius * radius])
    # With fewer than three cells per axis two offsets can name the same cell.
    return np.unique(np.concatenate(found), axis=0)


def component_labels(n: int, pairs: np.ndarray) -> np.ndarray:
    """Connected components of ``n`` nodes linked by ``pairs``, each labelled by its smallest node (union-find with
    hooking onto the smaller root and full path compression)."""
    parent = np.arange(n)
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


def fof_labels(pos: np.ndarray, linking_length: float, box: float, min_members: int) -> np.ndarray:
    """Friends-of-friends labels of rows numbered ``0..n-1``: the smallest member, -1 in groups below
    ``min_members``."""
    labels = component_labels(len(pos), friend_pairs(pos, linking_length, box))
    sizes = np.bincount(labels, minlength=len(pos))
    return np.where(sizes[labels] >= min_members, labels, -1)


def group_centres(pos: np.ndarray, labels: np.ndarray, box: float) -> np.ndarray:
    """Centre of each labelled group of equal-mass rows, in label order: members unwrapped next to the member the
    group is labelled by (minimum image), averaged, wrapped into the box. `(groups, d)`."""
    members = labels >= 0
    groups, member_of = np.unique(labels[members], return_inverse=True)
    offsets = minimum_image(pos[members].astype(np.float64) - pos[labels[members]], box)
    counts = np.bincount(member_of, minlength=len(groups))
    sums = np.stack([np.bincount(member_of, offsets[:, axis], len(groups)) for axis in range(pos.shape[1])], axis=1)
    return np.mod(pos[groups] + sums / np.maximum(counts, 1)[:, None], box)


def cic_paint(pos: np.ndarray, mass: np.ndarray, shape: tuple[int, int, int], box: float) -> np.ndarray:
    """Cloud-in-cell mass on a periodic grid whose point ``i`` sits at ``i * box / n`` (float64)."""
    scaled = np.asarray(pos, np.float64) * (np.asarray(shape) / box)
    base = np.floor(scaled).astype(np.int64)
    frac = scaled - base
    field = np.zeros(math.prod(shape))
    for corner in itertools.product((0, 1), repeat=3):
        upper = np.asarray(corner, bool)
        weight = np.prod(np.where(upper, frac, 1.0 - frac), axis=1)
        index = np.ravel_multi_index(tuple(((base + upper) % np.asarray(shape)).T), shape)
        field += np.bincount(index, weight * mass, minlength=field.size)
    return field.reshape(shape)


def power_spectrum(delta: np.ndarray, box: float, edges: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(k, pk, modes)`` of a cubic real field as :func:`shardax.fields.power_spectrum` defines them: ``P = V
    |delta_k|^2 / N^2`` over the half spectrum (inner planes counted twice), CIC window divided out, zero mode left
    out, averaged in the bins ``edges``."""
    n = delta.shape[0]
    spacing = box / n
    full = 2 * np.pi * np.fft.fftfreq(n, spacing)
    half = 2 * np.pi * np.fft.rfftfreq(n, spacing)
    kx, ky, kz = np.meshgrid(full, full, half, indexing="ij")
    kmag = np.sqrt(kx**2 + ky**2 + kz**2)
    window = (np.sinc(kx * spacing / (2 * np.pi)) * np.sinc(ky * spacing / (2 * np.pi))
              * np.sinc(kz * spacing / (2 * np.pi))) ** 4
    power = np.abs(np.fft.rfftn(np.asarray(delta, np.float64))) ** 2 / window
    plane = np.arange(n // 2 + 1)
    weight = np.where((plane > 0) & (2 * plane != n), 2, 1)[None, None, :] * (kmag > 0)
    which = np.digitize(kmag, edges) - 1
    used = (which >= 0) & (which < len(edges) - 1) & (weight > 0)
    nbins = len(edges) - 1
    modes = np.bincount(which[used], weight[used], nbins)
    safe = np.maximum(modes, 1)
    pk = np.bincount(which[used], (weight * power)[used], nbins) / safe * box**3 / delta.size**2
    kmean = np.bincount(which[used], (weight * kmag)[used], nbins) / safe
    centres = 0.5 * (edges[1:] + edges[:-1])
    return np.where(modes > 0, kmean, centres), np.where(modes > 0, pk, 0.0), modes.astype(np.int64)
