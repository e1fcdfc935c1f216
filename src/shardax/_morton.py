"""Morton (z-order) keys in 2D and 3D as two 32-bit words, without ``jax_enable_x64``.

Each coordinate is quantised to ``B`` bits (``B = 21`` in 3D, ``31`` in 2D) over a box, cell
``min(floor((x - origin) * (2**B / extent)), 2**B - 1)`` in the position's dtype, and bit ``i`` of dimension ``k``
goes to bit ``D * i + k`` of the key (dimension 0 is the least significant within each group of ``D`` bits).
The ``D * B``-bit key (63 bits in 3D, 62 in 2D) is returned as ``(hi, lo)`` uint32 words, ``key = hi * 2**32 + lo``;
the top bit of ``hi`` is always 0 for a finite position, and :data:`INVALID_KEY` (all ones) marks rows without one.

Resolution: a cell of the key grid is ``extent / 2**B`` wide (``4.8e-7`` of the box in 3D, ``4.7e-10`` in 2D), finer
than float32 resolves near the top of the box. Particles in the same cell have equal keys; sorts keep them in their
input order (ties are never broken by anything else).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.core import Tracer

from .comm import allreduce

Box = jax.Array | float | tuple[float, ...]

KEY_BITS_PER_DIM = {2: 31, 3: 21}
INVALID_KEY = 0xFFFFFFFF  # both words; sorts after every key of a finite position


class KeyBox(NamedTuple):
    """The box positions are quantised over.

    Attributes:
        origin: `(d,)` lower corner.
        extent: `(d,)` edge lengths (positive).
        periodic: whether positions are wrapped into ``[origin, origin + extent)`` (else they are clamped).
    """

    origin: jax.Array
    extent: jax.Array
    periodic: bool


def _spread_stages(dim: int, nbits: int) -> list[tuple[int, int]]:
    """Shift/mask pairs that move bit ``i`` of an ``nbits``-bit integer to bit ``dim * i``."""
    stages = []
    for level in range(max(0, (nbits - 1).bit_length() - 1), -1, -1):
        low = (1 << level) - 1
        mask = 0
        for i in range(nbits):
            mask |= 1 << (i + (dim - 1) * (i & ~low))
        stages.append(((dim - 1) << level, mask))
    return stages


def _spread(x: jax.Array, dim: int, nbits: int) -> jax.Array:
    x = x & jnp.uint32((1 << nbits) - 1)
    for shift, mask in _spread_stages(dim, nbits):
        x = (x | (x << jnp.uint32(shift))) & jnp.uint32(mask)
    return x


def _word_split(dim: int) -> list[tuple[int, int, int]]:
    """Per dimension: (bits in the low word, bits in the high word, shift of its first high bit inside ``hi``)."""
    bits = KEY_BITS_PER_DIM[dim]
    out = []
    for k in range(dim):
        n_lo = -(-(32 - k) // dim)
        out.append((n_lo, bits - n_lo, dim * n_lo + k - 32))
    return out


def interleave(cells: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Morton key words of integer cell coordinates.

    Args:
        cells: `(n, d)` uint32 cell coordinates, each below ``2**B``.

    Returns:
        ``(hi, lo)``, each `(n,)` uint32.
    """
    dim = cells.shape[1]
    hi = jnp.zeros(cells.shape[:1], jnp.uint32)
    lo = jnp.zeros(cells.shape[:1], jnp.uint32)
    for k, (n_lo, n_hi, hi_shift) in enumerate(_word_split(dim)):
        c = cells[:, k]
        lo = lo | (_spread(c, dim, n_lo) << jnp.uint32(k))
        hi = hi | (_spread(c >> jnp.uint32(n_lo), dim, n_hi) << jnp.uint32(hi_shift))
    return hi, lo


def as_vector(value: Box, dim: int, dtype: jnp.dtype, name: str) -> jax.Array:
    """``value`` (a scalar or one number per axis) as a `(dim,)` array of ``dtype``."""
    arr = jnp.asarray(value, dtype)
    if arr.ndim == 0:
        return jnp.full((dim,), arr)
    if arr.shape != (dim,):
        raise ValueError(f"{name} must be a scalar or have shape ({dim},) (one value per axis), got {arr.shape}")
    return arr


def given_box_values(box: Any, dtype: Any, type_error: str) -> np.ndarray | None:
    """The values of a user's ``box`` in ``dtype``, for checks on what was given (``None`` for a tracer: inside
    ``jit`` even a jnp copy of a Python number is a tracer, so wrappers check before tracing).

    Raises:
        TypeError: with the message ``type_error`` when ``box`` is not numeric.
    """
    if isinstance(box, Tracer):
        return None
    try:
        with np.errstate(over="ignore", under="ignore"):
            return np.asarray(box, np.float64).astype(np.dtype(dtype))
    except (TypeError, ValueError):
        raise TypeError(type_error) from None


def check_box(box: Any, dim: int, dtype: Any, *, where: str = "", optional: bool = True,
              extent: tuple[float, float] | None = None) -> None:
    """Raise the errors of :func:`box_vector` for a user's ``box`` on the host, without device work (wrappers call it
    before tracing: on a GPU every eager array operation is a launch and a wait).

    Args:
        box: a positive number, one per axis, or (``optional``) ``None`` for no box.
        dim: the number of axes.
        dtype: the positions' dtype: the box must be positive and finite in it.
        where: the messages' prefix (``"knn: "``).
        optional: whether ``None`` means "no box" (else it is refused).
        extent: the ``(low, high)`` sizes the caller's arithmetic takes (kNN's squared distances), if bounded.
    """
    if box is None and optional:
        return
    kinds = "None, a positive number" if optional else "a positive number"
    if isinstance(box, bool) or not isinstance(box, int | float | tuple | list | jax.Array | np.ndarray | np.generic):
        raise TypeError(f"{where}box must be {kinds} or a sequence of {dim} numbers, got {type(box).__name__}")
    values = given_box_values(box, dtype, f"{where}box must be {kinds} or a sequence of {dim} numbers, got {box!r}")
    shape = np.shape(box)
    if shape not in ((), (dim,)):
        raise ValueError(f"{where}box must be a scalar or have {dim} entries (one per axis), got shape {shape}")
    if values is None:
        return
    name = np.dtype(dtype).name
    if not np.all(np.isfinite(values) & (values >= np.finfo(values.dtype).tiny)):
        raise ValueError(f"{where}box must be positive and finite in {name} (the periodic box size per axis; XLA "
                         f"flushes subnormal numbers to zero), got {box!r}")
    if extent is not None and not np.all((values >= extent[0]) & (values <= extent[1])):
        raise ValueError(f"{where}box {box!r} is out of range for {name}: squared distances need {extent[0]:.3g} <= "
                         f"box <= {extent[1]:.3g}; rescale the positions or use float64")


def box_vector(box: Any, dim: int, dtype: Any) -> jax.Array | None:
    """``box`` as a `(dim,)` array of ``dtype`` (``None`` without a box), after :func:`check_box`."""
    check_box(box, dim, dtype)
    return None if box is None else as_vector(box, dim, dtype, "box")


def periodic_box(box: Box, dim: int, dtype: jnp.dtype) -> KeyBox:
    """The :class:`KeyBox` of a periodic box ``[0, box)`` (scalar or per-axis size)."""
    check_box(box, dim, dtype, optional=False)
    extent = as_vector(box, dim, dtype, "box")
    return KeyBox(jnp.zeros((dim,), dtype), extent, True)


def wrap(pos: jax.Array, box: KeyBox) -> jax.Array:
    """Positions wrapped into ``[origin, origin + extent)`` (periodic boxes only; others are returned as is)."""
    if not box.periodic:
        return pos
    origin, extent = box.origin[None, :], box.extent[None, :]
    rel = jnp.mod(pos - origin, extent)
    rel = jnp.where(rel >= extent, rel - extent, rel)  # mod can round up to extent
    return origin + rel


def morton_key(pos: jax.Array, box: KeyBox, valid: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """Morton key words of positions in ``box``.

    Positions outside a non-periodic box are clamped to its faces; in a periodic box they are wrapped. Rows that are
    not ``valid`` and rows with a non-finite coordinate get :data:`INVALID_KEY` in both words.

    Args:
        pos: `(n, d)` float positions, ``d`` in {2, 3}.
        box: the quantisation box.
        valid: `(n,)` bool, default all rows.

    Returns:
        ``(hi, lo)``, each `(n,)` uint32.

    """
    dim = pos.shape[1]
    bits = KEY_BITS_PER_DIM[dim]
    scale = float(1 << bits)
    # Capped: for extents below 2**B / max (about 6e-33 in float32) the ratio overflows and 0 * inf would be NaN.
    cells_per_length = jnp.minimum(jnp.asarray(scale, pos.dtype) / box.extent, jnp.finfo(pos.dtype).max)
    f = jnp.clip(jnp.floor((wrap(pos, box) - box.origin[None, :]) * cells_per_length[None, :]), 0, scale)
    cells = jnp.minimum(f.astype(jnp.uint32), jnp.uint32((1 << bits) - 1))
    hi, lo = interleave(cells)
    ok = jnp.all(jnp.isfinite(pos), axis=1)
    if valid is not None:
        ok = ok & valid
    invalid = jnp.uint32(INVALID_KEY)
    return jnp.where(ok, hi, invalid), jnp.where(ok, lo, invalid)


def data_box(pos: jax.Array, valid: jax.Array) -> KeyBox:
    """The (non-periodic) bounding box of the valid rows of ``pos`` over every device of the context.

    A degenerate axis (all particles at one coordinate, or no particles) gets extent 1, so keys stay defined.
    """
    finite = valid & jnp.all(jnp.isfinite(pos), axis=1)
    big = jnp.asarray(jnp.inf, pos.dtype)
    # One all-reduce for both corners: the upper one travels negated.
    lo_and_minus_hi = allreduce(jnp.concatenate([jnp.min(jnp.where(finite[:, None], pos, big), axis=0),
                                                 -jnp.max(jnp.where(finite[:, None], pos, -big), axis=0)]), "min")
    d = pos.shape[1]
    lo, hi = lo_and_minus_hi[:d], -lo_and_minus_hi[d:]
    lo = jnp.where(jnp.isfinite(lo), lo, 0)
    extent = jnp.where(hi > lo, hi - lo, 1)
    return KeyBox(lo, extent.astype(pos.dtype), False)


def key_box(pos: jax.Array, valid: jax.Array, box: Box | None) -> KeyBox:
    """The periodic box ``[0, box)``, or with ``box=None`` the global bounding box of the valid particles."""
    if box is None:
        return data_box(pos, valid)
    return periodic_box(box, pos.shape[1], pos.dtype)


def morton_keys(pos: jax.Array, *, box: Box | None = None, num: jax.Array | int | None = None
                ) -> tuple[jax.Array, jax.Array]:
    """Morton (z-order) keys of positions, as two uint32 words (local view; no ``jax_enable_x64`` needed).

    The key of a position is ``hi * 2**32 + lo``; order rows by ``(hi, lo)`` (e.g. ``np.lexsort((lo, hi))``) to
    get z-order. Coordinates are quantised to 21 bits per axis in 3D (63-bit keys) and 31 bits in 2D (62-bit keys)
    over the box; bit ``i`` of axis ``k`` is key bit ``d * i + k``.

    Args:
        pos: `(n, d)` float positions, ``d`` in {2, 3}.
        box: periodic box size (scalar or `(d,)`): positions are wrapped into ``[0, box)``. ``None``: the bounding
            box of the valid positions over all devices of the context (clamped, not periodic).
        num: number of valid rows (default all); the other rows, and rows with a NaN or infinite coordinate, get
            the invalid key ``(2**32 - 1, 2**32 - 1)``, which sorts after every valid key.

    Returns:
        ``(hi, lo)``, each `(n,)` uint32.

    Example:
        >>> import jax.numpy as jnp
        >>> from shardax.particles import morton_keys
        >>> hi, lo = morton_keys(jnp.array([[0.0, 0.0, 0.0], [0.99, 0.99, 0.99]]), box=1.0)
        >>> int(hi[0]), int(lo[0]), int(hi[1]) > 0
        (0, 0, True)
    """
    pos = jnp.asarray(pos)
    if pos.ndim != 2 or pos.shape[1] not in KEY_BITS_PER_DIM:
        raise ValueError(f"pos must have shape (n, 2) or (n, 3), got {pos.shape}")
    if pos.dtype not in (jnp.float32, jnp.float64):
        raise TypeError(f"pos must be a floating-point array of float32 or float64 (the key grid has 2**21 cells per "
                        f"axis), got dtype {pos.dtype}; cast it with pos.astype(jnp.float32)")
    rows = jnp.arange(pos.shape[0], dtype=jnp.int32)
    valid = rows < (pos.shape[0] if num is None else jnp.asarray(num, jnp.int32))
    return morton_key(pos, key_box(pos, valid, box), valid)
