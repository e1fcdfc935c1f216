"""Binned power spectrum of a distributed periodic field, with cloud-in-cell window compensation and mode counts."""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, PartitionSpec

from .. import comm
from .. import fft as sxfft
from .._order import after
from .._tuning import tuning_backend
from ..core import smap
from ._grid import Grid, _box3, field_sharding


def bin_edges(bins: int | Sequence[float], shape: Sequence[int], box: Any) -> np.ndarray:
    """Wavenumber bin edges: ``bins`` linear bins from the fundamental to the Nyquist wavenumber, or given edges.

    Example:
        >>> bin_edges(4, (16, 16, 16), 2 * 3.141592653589793).round(3).tolist()
        [1.0, 2.75, 4.5, 6.25, 8.0]
    """
    if isinstance(bins, int) and not isinstance(bins, bool):
        if bins < 1:
            raise ValueError(f"bins must be a positive number of bins or increasing edges, got {bins}")
        sizes = _box3(box)
        k_fund = min(2 * math.pi / b for b in sizes)
        k_nyq = min(math.pi * n / b for n, b in zip(shape, sizes, strict=True))
        return np.linspace(k_fund, k_nyq, bins + 1)
    edges = np.asarray(bins, np.float64)
    if edges.ndim != 1 or edges.size < 2 or np.any(np.diff(edges) <= 0):
        raise ValueError(f"bins must be a positive int or at least two increasing edges, got {bins!r}")
    return edges


def local_power_spectrum(delta: jax.Array, *, box: Any, bins: int | Sequence[float], spec: Any = None,
                         compensate: bool = True) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Binned power spectrum of a distributed real field (local view); every device gets the full result.

    ``P(k) = V |delta_k|^2 / N^2`` with ``delta_k = sum_x delta(x) exp(-i k x)`` (``N`` grid points, ``V`` the
    box volume), averaged over the modes whose ``|k|`` falls in each bin; the zero mode is left out. Modes of the
    half spectrum stand for their conjugate partners too (counted twice).

    Args:
        delta: this device's block of the field (usually the overdensity ``rho / mean(rho) - 1``).
        box: periodic box size, one number or three.
        bins: number of linear bins from the fundamental to the Nyquist wavenumber, or bin edges (in ``2 pi / box``
            units of the box, i.e. physical wavenumbers).
        spec: the field's split over mesh axes; ignored outside ``smap``.
        compensate: divide by the cloud-in-cell window ``prod_i sinc^4(k_i h_i / 2)`` (fields from ``paint``).

    Returns:
        ``(k, pk, modes)``: mean ``|k|`` of the modes in each bin (bin centre if empty), the power and the int32
        number of modes, each `(nbins,)`.

    Example:
        >>> import jax, shardax as sx
        >>> delta = jax.random.normal(jax.random.key(0), (16, 16, 16))
        >>> k, pk, modes = sx.fields.local_power_spectrum(delta, box=100.0, bins=4, compensate=False)
        >>> k.shape, int(modes.sum()) <= 16 ** 3
        ((4,), True)
    """
    if not jnp.issubdtype(jnp.result_type(delta), jnp.floating):
        raise TypeError(f"power_spectrum takes a real field, got dtype {jnp.result_type(delta)}")
    grid = Grid.from_block(np.shape(delta), spec, box, "local_power_spectrum")
    shape = grid.shape
    edges = bin_edges(bins, shape, box)
    the_spec = grid.layout.spec if grid.layout.axis_sizes else None
    spectrum = sxfft.local_rfftn(delta, spec=the_spec)
    dtype = jnp.result_type(delta)
    spacing = [b / n for b, n in zip(grid.box, shape, strict=True)]
    freqs = sxfft.local_fftfreq(shape, spec=the_spec, d=spacing, rfft=True, dtype=dtype)
    ks = [2 * math.pi * f for f in freqs]
    kmag = jnp.sqrt(ks[0] ** 2 + ks[1] ** 2 + ks[2] ** 2)
    power = jnp.abs(spectrum) ** 2
    if compensate:
        window = jnp.ones_like(kmag)
        for k, h in zip(ks, spacing, strict=True):
            window = window * jnp.sinc(k * h / (2 * math.pi)) ** 4  # jnp.sinc(x) = sin(pi x) / (pi x)
        power = power / window
    # The last axis of the half spectrum is whole on every device: its planes 0 < j < n2 / 2 stand for two modes.
    j = jnp.arange(shape[2] // 2 + 1).reshape(1, 1, -1)
    twice = (j > 0) & (2 * j != shape[2])
    weight = jnp.where(kmag > 0, jnp.where(twice, 2, 1), 0).astype(jnp.int32)
    weight = jnp.broadcast_to(weight, kmag.shape)
    index = jnp.digitize(kmag, jnp.asarray(edges, dtype)) - 1
    index = jnp.where((index >= 0) & (index < len(edges) - 1) & (weight > 0), index, len(edges) - 1)
    nbins = len(edges) - 1
    flat = index.reshape(-1)
    weight = weight.reshape(-1)
    fweight = weight.astype(dtype)
    modes, psum, ksum = _bin_sums(flat, nbins, weight, fweight * power.reshape(-1), fweight * kmag.reshape(-1))
    # The sums over the devices in order: the power's after the transform, the mode counts after them (they do not
    # depend on the transform, and collectives that do not depend on each other could run in different orders on
    # different devices of a program read back from a compilation cache).
    psum, ksum = comm.allreduce(jnp.stack([psum, ksum]))
    modes = comm.allreduce(after(modes, psum))
    volume = math.prod(grid.box)
    cells = math.prod(shape)
    safe = jnp.maximum(modes, 1).astype(dtype)
    centres = jnp.asarray(0.5 * (edges[1:] + edges[:-1]), dtype)
    k_mean = jnp.where(modes > 0, ksum / safe, centres)
    pk = jnp.where(modes > 0, psum / safe * (volume / cells**2), 0)
    return k_mean, pk.astype(dtype), modes


# Up to this many bins the GPU path sums every bin in one fused compare-and-sum pass over the modes.
_COMPARE_BINS = 128


def _bin_sums(index: jax.Array, nbins: int, *values: jax.Array) -> list[jax.Array]:
    """Per-bin sums `(nbins,)` of each of ``values`` (`(m,)`) over the modes whose ``index`` is the bin (``nbins``:
    none).

    XLA:CPU adds the modes into their bins one after another (``segment_sum``). A GPU would serialise millions of
    atomic adds onto a few dozen addresses, so there every bin compares itself with every mode in one fused pass
    (up to :data:`_COMPARE_BINS` bins).
    """
    if tuning_backend() == "cpu" or nbins > _COMPARE_BINS:
        return [jax.ops.segment_sum(v, index, nbins + 1)[:nbins] for v in values]
    hit = index[:, None] == jnp.arange(nbins, dtype=index.dtype)[None, :]
    return [jnp.sum(jnp.where(hit, v[:, None], jnp.zeros((), v.dtype)), axis=0, dtype=v.dtype) for v in values]


@functools.lru_cache(maxsize=64)
def _power_fn(mesh: Mesh, spec: PartitionSpec, box: Any, bins: Any, compensate: bool, backend: str) -> Any:
    """The mapped kernel; ``backend`` (the tuning preset, read at trace time) keys the cache: one trace per preset."""
    def body(delta: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        return local_power_spectrum(delta, box=box, bins=bins, spec=spec, compensate=compensate)
    out = PartitionSpec()
    return smap(body, in_specs=(spec,), out_specs=(out, out, out), mesh=mesh, expand=False, jit=True)


def power_spectrum(field: jax.Array, *, box: Any, bins: int | Sequence[float], mesh: Mesh | None = None,
                   spec: Any = None, compensate: bool = True) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Binned power spectrum ``(k, pk, modes)`` of a distributed real 3D field.

    Args:
        field: global real field `(n0, n1, n2)`, usually the overdensity ``rho / rho.mean() - 1`` of a painted
            field, sharded as slabs or pencils (its sharding gives the mesh and spec unless passed).
        box: periodic box size, one number or three.
        bins: number of linear bins from the fundamental to the Nyquist wavenumber, or bin edges.
        mesh: the mesh (default: the field's).
        spec: the field's ``PartitionSpec`` (default: the field's own).
        compensate: divide by the squared cloud-in-cell window (for fields from :func:`paint`).

    Returns:
        ``(k, pk, modes)``, each `(nbins,)` and replicated: mean ``|k|`` per bin, ``P(k)`` in units of volume and
        the int32 mode count (identical at every scale).

    Example:
        >>> import jax, jax.numpy as jnp, shardax as sx
        >>> from jax.sharding import NamedSharding, PartitionSpec as P
        >>> mesh = sx.flat_mesh("d")
        >>> delta = jax.device_put(jnp.zeros((16, 16, 16)), NamedSharding(mesh, P("d")))
        >>> k, pk, modes = sx.fields.power_spectrum(delta, box=100.0, bins=4)
        >>> float(pk.max())
        0.0
    """
    if not isinstance(field, jax.Array | np.ndarray):
        raise TypeError(f"power_spectrum takes a jax.Array or numpy array, got {type(field).__name__}")
    if np.ndim(field) != 3:
        raise ValueError(f"power_spectrum takes a 3D field, got shape {np.shape(field)}")
    the_mesh, the_spec = field_sharding(field, mesh, spec, "power_spectrum")
    box_key = box if isinstance(box, int | float) else tuple(box)
    bins_key = bins if isinstance(bins, int) else tuple(float(b) for b in bins)
    backend = tuning_backend(the_mesh.devices)
    return _power_fn(the_mesh, the_spec, box_key, bins_key, bool(compensate), backend)(field)
