"""The comparisons of ``shardax demo``: a kernel's result against its reference (:mod:`shardax.testing.reference`),
as a failure message.

A comparison returns ``""`` when it passes and a one-line reason when it does not.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

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


def knn_mismatch(got_d: np.ndarray, got_i: np.ndarray, want_d: np.ndarray, want_i: np.ndarray, dtype: Any) -> str:
    """Compare `(q, k)` results with a reference of ``k + 1`` columns (:func:`shardax.testing.reference.brute_knn`): distances within
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
