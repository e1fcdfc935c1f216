"""Sample frequencies of distributed spectra: each device's share of ``fftfreq``/``rfftfreq`` along every axis."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from ..core import default_mesh
from ._layout import Layout, local_layout


def _spacings(d: float | Sequence[float], ndim: int) -> tuple[float, ...]:
    if isinstance(d, int | float):
        return (float(d),) * ndim
    spacings = tuple(float(v) for v in d)
    if len(spacings) != ndim:
        raise ValueError(f"d must be a number or one spacing per axis ({ndim}), got {d!r}")
    return spacings


def _freqs(n: int, spacing: float, real: bool, dtype: Any) -> jax.Array:
    return (jnp.fft.rfftfreq if real else jnp.fft.fftfreq)(n, d=spacing, dtype=dtype)


def local_fftfreq(shape: Sequence[int], /, *, spec: Any = None, d: float | Sequence[float] = 1.0,
                  rfft: bool = False, dtype: Any = jnp.float32) -> tuple[jax.Array, ...]:
    """This device's sample frequencies of a distributed spectrum (local view), one broadcastable array per axis.

    Args:
        shape: the global shape of the real-space array ``(n0, n1, n2)``.
        spec: the split of the *spectrum* (e.g. ``sx.fft.plan(...).out_layout.spec`` after a transposed FFT);
            ignored outside ``smap``.
        d: sample spacing (``box / n``), one number or one per axis; frequencies are in cycles per unit of ``d``,
            as ``np.fft.fftfreq`` (multiply by ``2 pi`` for wavenumbers).
        rfft: the spectrum is a real transform's half spectrum (last axis ``n2 // 2 + 1``, ``rfftfreq``).
        dtype: float dtype of the frequencies.

    Returns:
        ``(f0, f1, f2)`` of shapes ``(m0, 1, 1)``, ``(1, m1, 1)``, ``(1, 1, m2)`` where ``m`` is this device's block
        of the spectrum.

    Example:
        >>> import shardax as sx
        >>> f0, f1, f2 = sx.fft.local_fftfreq((8, 8, 8), rfft=True)
        >>> f0.shape, f2.shape, float(f2[0, 0, -1])
        ((8, 1, 1), (1, 1, 5), 0.5)
    """
    shape = tuple(int(n) for n in shape)
    spacings = _spacings(d, len(shape))
    spectrum = (*shape[:-1], shape[-1] // 2 + 1) if rfft else shape
    probe = local_layout(spec, spectrum, "local_fftfreq: spec")
    parts = [probe.parts(dim) for dim in range(len(shape))]
    out = []
    for dim, n in enumerate(spectrum):
        if n % parts[dim]:
            raise ValueError(f"local_fftfreq: axis {dim} of the spectrum (size {n}) is not divisible by its mesh "
                             f"axes {probe.groups[dim]} (size {parts[dim]})")
        freqs = _freqs(shape[dim], spacings[dim], rfft and dim == len(shape) - 1, dtype)
        count = n // parts[dim]
        if parts[dim] > 1:
            freqs = lax.dynamic_slice_in_dim(freqs, lax.axis_index(probe.groups[dim]) * count, count)
        out.append(freqs.reshape([count if k == dim else 1 for k in range(len(shape))]))
    return tuple(out)


def fftfreq(shape: Sequence[int], /, *, spec: Any = None, mesh: Mesh | None = None,
            d: float | Sequence[float] = 1.0, rfft: bool = False,
            dtype: Any = jnp.float32) -> tuple[jax.Array, ...]:
    """Global sample frequencies of a distributed spectrum, one broadcastable array per axis, sharded like it.

    Args:
        shape: the global shape of the real-space array ``(n0, n1, n2)``.
        spec: the spectrum's ``PartitionSpec`` (default: not split); array axis ``i``'s entry shards ``f_i``.
        mesh: the mesh (default: context mesh, else :func:`shardax.flat_mesh`).
        d: sample spacing, one number or one per axis (as ``np.fft.fftfreq``).
        rfft: last axis is ``rfftfreq`` (half spectrum of a real transform).
        dtype: float dtype.

    Returns:
        ``(f0, f1, f2)`` of shapes ``(n0, 1, 1)``, ``(1, n1, 1)``, ``(1, 1, m2)``, so that e.g.
        ``k2 = (2 * pi) ** 2 * (f0**2 + f1**2 + f2**2)`` is the spectrum's ``|k|^2`` with its sharding.

    Example:
        >>> import shardax as sx
        >>> f0, f1, f2 = sx.fft.fftfreq((8, 8, 8), d=0.5, rfft=True)
        >>> f2.shape, float(f0[1, 0, 0])
        ((1, 1, 5), 0.25)
    """
    shape = tuple(int(n) for n in shape)
    spacings = _spacings(d, len(shape))
    spectrum = (*shape[:-1], shape[-1] // 2 + 1) if rfft else shape
    if spec is None:
        spec = PartitionSpec()
    the_mesh = default_mesh(mesh)
    lay = Layout.from_spec(spec, spectrum, dict(the_mesh.shape), "fftfreq: spec")
    out = []
    for dim in range(len(shape)):
        freqs = np.fft.rfftfreq(shape[dim], spacings[dim]) if rfft and dim == len(shape) - 1 else \
            np.fft.fftfreq(shape[dim], spacings[dim])
        freqs = freqs.astype(dtype).reshape([-1 if k == dim else 1 for k in range(len(shape))])
        entries = [lay.entry(dim) if k == dim else None for k in range(len(shape))]
        out.append(jax.device_put(freqs, NamedSharding(the_mesh, PartitionSpec(*entries))))
    return tuple(out)
