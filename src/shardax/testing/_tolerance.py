"""One per-dtype tolerance table for every shardax test, and the ``assert_allclose`` that uses it."""

from __future__ import annotations

from typing import Any, Literal

import numpy as np

Kind = Literal["default", "linalg", "fft"]

# (rtol, atol) per real dtype and kind of computation; complex dtypes use their component's row. "default" covers
# element-wise maths and reductions whose order differs between device counts; "linalg" covers factorisations and
# solves of well-conditioned matrices (error grows with the condition number: tests must pick well-conditioned
# inputs); "fft" covers transforms of O(1) data, whose rounding error is relative to the norm of the whole array.
_TABLE: dict[str, dict[str, tuple[float, float]]] = {
    "default": {"float16": (1e-3, 1e-3), "bfloat16": (1e-2, 1e-2), "float32": (1e-5, 1e-6),
                "float64": (1e-12, 1e-14)},
    "linalg": {"float16": (1e-2, 1e-2), "bfloat16": (5e-2, 5e-2), "float32": (1e-4, 1e-5),
               "float64": (1e-10, 1e-12)},
    "fft": {"float16": (1e-2, 1e-2), "bfloat16": (5e-2, 5e-2), "float32": (1e-4, 1e-4),
            "float64": (1e-10, 1e-10)},
}
_COMPONENT = {"complex64": "float32", "complex128": "float64"}


def _dtype(dtype: Any) -> np.dtype:
    try:
        return np.dtype(dtype)
    except TypeError:
        raise TypeError(f"dtype must be a NumPy/JAX dtype (e.g. jnp.float32, 'float64'), got {dtype!r}") from None


def _pair(dtype: np.dtype, kind: str) -> tuple[float, float]:
    if kind not in _TABLE:
        raise ValueError(f"kind must be one of {sorted(_TABLE)}, got {kind!r}")
    if dtype.kind in "biu":
        return (0.0, 0.0)
    name = _COMPONENT.get(dtype.name, dtype.name)
    if name not in _TABLE[kind]:
        known = sorted({*_TABLE[kind], *_COMPONENT})
        raise ValueError(f"no tolerance for dtype {dtype.name}; known: {known} and integer/bool dtypes (exact)")
    return _TABLE[kind][name]


def tolerance(dtype: Any, kind: Kind = "default") -> dict[str, float]:
    """The ``rtol``/``atol`` shardax tests use for ``dtype`` and ``kind`` of computation.

    Integer and boolean dtypes are exact (``rtol = atol = 0``): shardax gives identical integer results at every
    scale. Complex dtypes use the tolerance of their real component.

    Args:
        dtype: a NumPy or JAX dtype (``jnp.float32``, ``np.complex128``, ``"bfloat16"``, ...).
        kind: ``"default"`` (element-wise maths and reductions), ``"linalg"`` (factorisations and solves of
            well-conditioned matrices) or ``"fft"`` (transforms of O(1) data).

    Returns:
        ``{"rtol": ..., "atol": ...}``, ready for ``np.testing.assert_allclose(..., **tolerance(dtype))``.

    Example:
        >>> import shardax as sx
        >>> sx.testing.tolerance("float32")
        {'rtol': 1e-05, 'atol': 1e-06}
        >>> sx.testing.tolerance("int32")
        {'rtol': 0.0, 'atol': 0.0}
    """
    rtol, atol = _pair(_dtype(dtype), kind)
    return {"rtol": rtol, "atol": atol}


def assert_allclose(actual: Any, desired: Any, *, dtype: Any = None, kind: Kind = "default") -> None:
    """Assert ``actual`` equals ``desired`` within :func:`tolerance` (exactly for integer and bool data).

    Args:
        actual: the computed array (NumPy, JAX fully addressable array, or array-like).
        desired: the reference, of the same shape.
        dtype: the dtype whose tolerance applies; default: the looser of ``actual``'s and ``desired``'s (a float32
            result checked against a float64 NumPy reference gets the float32 tolerance).
        kind: the kind of computation, as in :func:`tolerance`.

    Raises:
        AssertionError: shapes differ, or values differ beyond the tolerance (the message gives the tolerance used).

    Example:
        >>> import numpy as np, shardax as sx
        >>> sx.testing.assert_allclose(np.float32([1.0, 2.0]), np.float64([1.0, 2.0 + 1e-7]))
    """
    a, d = np.asarray(actual), np.asarray(desired)
    if a.shape != d.shape:
        raise AssertionError(f"shapes differ: actual {a.shape}, desired {d.shape}")
    if dtype is not None:
        rtol, atol = _pair(_dtype(dtype), kind)
        name = _dtype(dtype).name
    else:
        pairs = {x.dtype.name: _pair(x.dtype, kind) for x in (a, d)}
        name = max(pairs, key=lambda k: pairs[k])
        rtol, atol = pairs[name]
    if rtol == 0 and atol == 0 and a.dtype.kind in "biu" and d.dtype.kind in "biu":
        np.testing.assert_array_equal(a, d, err_msg=f"exact comparison ({name})")
        return
    wide = np.complex128 if np.iscomplexobj(a) or np.iscomplexobj(d) else np.float64
    np.testing.assert_allclose(a.astype(wide), d.astype(wide), rtol=rtol, atol=atol,
                               err_msg=f"tolerance of {name} ({kind}): rtol={rtol}, atol={atol}")
