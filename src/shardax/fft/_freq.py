"""Sample frequencies of distributed spectra: each device's share of ``fftfreq``/``rfftfreq`` along every axis."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from .._layout import Layout, manual_axis_sizes
from ..core import default_mesh
from ._plan import TRANSPOSED_PERM, unpermute


def _spacings(d: float | Sequence[float], ndim: int) -> tuple[float, ...]:
    if isinstance(d, int | float):
        return (float(d),) * ndim
    spacings = tuple(float(v) for v in d)
    if len(spacings) != ndim:
        raise ValueError(f"d must be a number or one spacing per axis ({ndim}), got {d!r}")
    return spacings


def _freqs(n: int, spacing: float, real: bool, dtype: Any) -> jax.Array:
    return (jnp.fft.rfftfreq if real else jnp.fft.fftfreq)(n, d=spacing, dtype=dtype)


def _place(freqs: jax.Array, axis: int, perm: tuple[int, ...]) -> jax.Array:
    """``freqs`` of logical ``axis`` shaped to broadcast against a block stored in physical order ``perm``."""
    position = perm.index(axis)
    return freqs.reshape([-1 if k == position else 1 for k in range(len(perm))])


def _perm(layout: Any) -> tuple[int, ...]:
    if layout not in ("same", "transposed"):
        raise ValueError(f"layout must be 'same' or 'transposed' (the spectrum stored (k1, k2, k0)), got {layout!r}")
    return TRANSPOSED_PERM if layout == "transposed" else (0, 1, 2)


def local_fftfreq(shape: Sequence[int], /, *, spec: Any = None, d: float | Sequence[float] = 1.0,
                  rfft: bool = False, layout: Literal["same", "transposed"] = "same",
                  dtype: Any = jnp.float32) -> tuple[jax.Array, ...]:
    """This device's sample frequencies of a distributed spectrum (local view), one broadcastable array per axis.

    Args:
        shape: the global shape ``(n0, n1, n2)`` of the real-space array.
        spec: the ``PartitionSpec`` of the spectrum as stored (the input's spec after ``layout="transposed"``);
            ignored outside ``smap``.
        d: sample spacing (``box / n``), one number or one per axis; frequencies are in cycles per unit of ``d``,
            as ``np.fft.fftfreq`` (multiply by ``2 pi`` for wavenumbers).
        rfft: the spectrum is a real transform's half spectrum (last axis ``n2 // 2 + 1``, ``rfftfreq``).
        layout: ``"same"`` (spectrum stored ``(k0, k1, k2)``) or ``"transposed"`` (stored ``(k1, k2, k0)``).
        dtype: float dtype of the frequencies.

    Returns:
        ``(f0, f1, f2)``: the frequencies of axes 0, 1, 2 of this device's block, each shaped to broadcast against
        the block as stored (``f0: (m0, 1, 1)`` for ``"same"``, ``(1, 1, m0)`` for ``"transposed"``).

    Example:
        >>> import shardax as sx
        >>> f0, f1, f2 = sx.fft.local_fftfreq((8, 8, 8), rfft=True)
        >>> f0.shape, f2.shape, float(f2[0, 0, -1])
        ((8, 1, 1), (1, 1, 5), 0.5)
    """
    shape = tuple(int(n) for n in shape)
    spacings = _spacings(d, len(shape))
    perm = _perm(layout)
    spectrum = (*shape[:-1], shape[-1] // 2 + 1) if rfft else shape
    stored = tuple(spectrum[a] for a in perm)
    sizes = manual_axis_sizes()
    if sizes:
        logical = unpermute(Layout.from_spec(spec, stored, sizes, "local_fftfreq: spec"), perm)
    else:
        logical = Layout(spectrum, ((),) * len(spectrum), ())
    out = []
    for dim, n in enumerate(spectrum):
        freqs = _freqs(shape[dim], spacings[dim], rfft and dim == len(shape) - 1, dtype)
        count = n // logical.parts(dim)
        if logical.parts(dim) > 1:
            freqs = lax.dynamic_slice_in_dim(freqs, lax.axis_index(logical.groups[dim]) * count, count)
        out.append(_place(freqs, dim, perm))
    return tuple(out)


def fftfreq(shape: Sequence[int], /, *, spec: Any = None, mesh: Mesh | None = None,
            d: float | Sequence[float] = 1.0, rfft: bool = False, layout: Literal["same", "transposed"] = "same",
            dtype: Any = jnp.float32) -> tuple[jax.Array, ...]:
    """Global sample frequencies of a distributed spectrum, one broadcastable array per axis, sharded like it.

    Args:
        shape: the global shape ``(n0, n1, n2)`` of the real-space array.
        spec: the spectrum's ``PartitionSpec`` as stored (default: not split).
        mesh: the mesh (default: context mesh, else :func:`shardax.flat_mesh`).
        d: sample spacing, one number or one per axis (as ``np.fft.fftfreq``).
        rfft: last axis is ``rfftfreq`` (half spectrum of a real transform).
        layout: ``"same"`` (spectrum stored ``(k0, k1, k2)``) or ``"transposed"`` (stored ``(k1, k2, k0)``).
        dtype: float dtype.

    Returns:
        ``(f0, f1, f2)``, each shaped to broadcast against the stored spectrum (``(n0, 1, 1)``, ``(1, n1, 1)``,
        ``(1, 1, m2)`` for ``"same"``) and sharded like it, so that ``(2 pi)^2 (f0^2 + f1^2 + f2^2)`` is ``|k|^2``.

    Example:
        >>> import shardax as sx
        >>> f0, f1, f2 = sx.fft.fftfreq((8, 8, 8), d=0.5, rfft=True)
        >>> f2.shape, float(f0[1, 0, 0])
        ((1, 1, 5), 0.25)
    """
    shape = tuple(int(n) for n in shape)
    spacings = _spacings(d, len(shape))
    perm = _perm(layout)
    spectrum = (*shape[:-1], shape[-1] // 2 + 1) if rfft else shape
    the_mesh = default_mesh(mesh)
    stored = Layout.from_spec(spec, tuple(spectrum[a] for a in perm), dict(the_mesh.shape), "fftfreq: spec")
    out = []
    for dim in range(len(shape)):
        real = rfft and dim == len(shape) - 1
        freqs = (np.fft.rfftfreq if real else np.fft.fftfreq)(shape[dim], spacings[dim]).astype(dtype)
        position = perm.index(dim)
        entries = [stored.entry(position) if k == position else None for k in range(len(shape))]
        out.append(jax.device_put(_place(jnp.asarray(freqs), dim, perm),
                                  NamedSharding(the_mesh, PartitionSpec(*entries))))
    return tuple(out)


def rfftfreq(shape: Sequence[int], /, *, spec: Any = None, mesh: Mesh | None = None,
             d: float | Sequence[float] = 1.0, layout: Literal["same", "transposed"] = "same",
             dtype: Any = jnp.float32) -> tuple[jax.Array, ...]:
    """:func:`fftfreq` of a real transform's half spectrum (``rfftfreq`` along the last axis).

    Example:
        >>> import shardax as sx
        >>> [f.shape for f in sx.fft.rfftfreq((8, 8, 8))]
        [(8, 1, 1), (1, 8, 1), (1, 1, 5)]
    """
    return fftfreq(shape, spec=spec, mesh=mesh, d=d, rfft=True, layout=layout, dtype=dtype)
