"""Initial conditions in the local view: layout-independent white noise, the linear field and 1LPT/2LPT.

Every function here runs inside ``sx.smap`` over the run's mesh (one device included) and works on this device's
block of the particle grid, split like the FFT's input (slabs or pencils, the last axis whole).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.extend.random import threefry_2x32

from .. import fft
from .._order import after
from ._setup import Setup

PowerFn = Callable[[jax.Array], jax.Array]


def block_start(setup: Setup, n: int) -> tuple[jax.Array | int, jax.Array | int]:
    """Global index of this device's first row along axes 0 and 1 of an ``n^3`` grid."""
    layout = setup.layout(n)
    starts: list[jax.Array | int] = []
    for dim in (0, 1):
        group = layout.groups[dim]
        starts.append(lax.axis_index(group) * layout.local_shape[dim] if group else 0)
    return starts[0], starts[1]


def local_white_noise(setup: Setup, seed: jax.Array, dtype: Any) -> jax.Array:
    """This device's block of unit Gaussian white noise on the ``n^3`` particle grid.

    Counter-based: the value at global grid point ``g = (i n + j) n + k`` is the Box-Muller transform of the two
    32-bit words of Threefry-2x32 (``seed`` as key) applied to the counter ``(g, 0)``, so the field depends on the
    seed and the global index only, not on the devices or their layout.
    """
    n = setup.n
    b0, b1, b2 = setup.layout(n).local_shape
    s0, s1 = block_start(setup, n)
    i = (jnp.asarray(s0, jnp.uint32) + jnp.arange(b0, dtype=jnp.uint32))[:, None, None]
    j = (jnp.asarray(s1, jnp.uint32) + jnp.arange(b1, dtype=jnp.uint32))[None, :, None]
    k = jnp.arange(b2, dtype=jnp.uint32)[None, None, :]
    index = ((i * jnp.uint32(n) + j) * jnp.uint32(n) + k).reshape(-1)
    key = jnp.stack([seed.astype(jnp.uint32), jnp.uint32(0x9E3779B9)])
    bits = threefry_2x32(key, jnp.concatenate([index, jnp.zeros_like(index)]))
    # 24-bit uniforms in (0, 1): exact in float32, never 0 (log) or 1.
    u1, u2 = ((jnp.right_shift(b, jnp.uint32(8)).astype(dtype) + 0.5) * (2.0**-24)
              for b in (bits[: index.size], bits[index.size:]))
    normal = jnp.sqrt(-2 * jnp.log(u1)) * jnp.cos(2 * math.pi * u2)
    return normal.reshape(b0, b1, b2)


def times_i(x: jax.Array, g: jax.Array) -> jax.Array:
    """``1j * g * x`` for complex ``x`` and real ``g`` without implicit promotion."""
    gx = g.astype(x.real.dtype)
    return lax.complex(-x.imag * gx, x.real * gx)


def scaled(x: jax.Array, g: jax.Array) -> jax.Array:
    """``g * x`` for complex ``x`` and real ``g``."""
    return x * g.astype(x.dtype)


class Kernels:
    """Wavenumbers (h/Mpc) of this device's block of an ``n^3`` half spectrum stored as ``setup.fft_layout`` says, with the
    gradient and inverse Laplacian kernels of ``setup``."""

    def __init__(self, setup: Setup, n: int, dtype: Any) -> None:
        freqs = fft.local_fftfreq((n, n, n), spec=setup.spec, d=setup.box / n, rfft=True, layout=setup.fft_layout,
                                  dtype=dtype)
        self.k = [2 * math.pi * f for f in freqs]
        self.k2 = self.k[0] ** 2 + self.k[1] ** 2 + self.k[2] ** 2
        spacing = setup.box / n
        if setup.gradient == "fd4":
            self.grad = [(8 * jnp.sin(k * spacing) - jnp.sin(2 * k * spacing)) / (6 * spacing) for k in self.k]
        else:
            self.grad = list(self.k)
        nonzero = self.k2 > 0
        self.inv_laplace = jnp.where(nonzero, -1 / jnp.where(nonzero, self.k2, 1), 0)
        self.spacing = spacing

    def cic_window(self) -> jax.Array:
        """The cloud-in-cell assignment window ``prod_i sinc^2(k_i h / 2 pi)``."""
        w = jnp.ones_like(self.k2)
        for k in self.k:
            w = w * jnp.sinc(k * self.spacing / (2 * math.pi)) ** 2
        return w


def local_linear_modes(setup: Setup, noise: jax.Array, power: PowerFn) -> tuple[jax.Array, Kernels]:
    """This device's block of the linear density contrast's half spectrum (stored as ``setup.fft_layout`` says):
    ``rfftn(noise) * sqrt(P(k) n^3 / V)``, zero mode removed."""
    n = setup.n
    modes = fft.local_rfftn(noise, spec=setup.spec, layout=setup.fft_layout)
    kernels = Kernels(setup, n, noise.dtype)
    kmag = jnp.sqrt(kernels.k2)
    pk = jnp.where(kernels.k2 > 0, power(kmag), 0).astype(noise.dtype)
    amplitude = jnp.sqrt(jnp.maximum(pk, 0) * (n**3 / setup.box**3))
    return scaled(modes, amplitude), kernels


def _irfftn(setup: Setup, modes: jax.Array, n: int, deps: Any = ()) -> jax.Array:
    """The inverse transform of ``modes``, its collectives after those that made ``deps``: transforms that do not
    depend on each other could run their collectives in different orders on different devices of a program read
    back from a compilation cache."""
    return fft.local_irfftn(after(modes, deps), spec=setup.spec, layout=setup.fft_layout, s=(n, n, n))


def local_lpt_fields(setup: Setup, noise: jax.Array, power: PowerFn) -> tuple[jax.Array, jax.Array | None]:
    """First- and second-order displacement fields at ``D1 = 1``, `(n_local, 3)` each (``None`` for order 1).

    ``s1 = -grad phi1`` with ``laplace phi1 = delta_L``; ``s2 = grad phi2`` with ``laplace phi2 =
    sum_{i<j} (phi1_ii phi1_jj - phi1_ij^2)``, so that ``x = q + D1 s1 + D2 s2`` with ``D2 ~ -3/7 D1^2``.
    """
    n = setup.n
    delta_k, kern = local_linear_modes(setup, noise, power)
    phi = scaled(delta_k, kern.inv_laplace)
    done: list[jax.Array] = []  # every transform so far (each one's collectives follow the last one's)
    for g in kern.grad:
        done.append(_irfftn(setup, times_i(phi, -g), n, done[-1:]))
    s1 = jnp.stack([c.reshape(-1) for c in done], axis=1)
    if setup.order == 1:
        return s1, None
    hessian = {}
    for i in range(3):
        for j in range(i, 3):
            hessian[i, j] = _irfftn(setup, scaled(phi, -kern.grad[i] * kern.grad[j]), n, done[-1:])
            done.append(hessian[i, j])
    source = (hessian[0, 0] * hessian[1, 1] + hessian[0, 0] * hessian[2, 2] + hessian[1, 1] * hessian[2, 2]
              - hessian[0, 1] ** 2 - hessian[0, 2] ** 2 - hessian[1, 2] ** 2)
    phi2 = scaled(fft.local_rfftn(source, spec=setup.spec, layout=setup.fft_layout), kern.inv_laplace)
    second: list[jax.Array] = []
    for g in kern.grad:
        second.append(_irfftn(setup, times_i(phi2, g), n, second[-1:]))
    s2 = jnp.stack([c.reshape(-1) for c in second], axis=1)
    return s1, s2


def lagrangian(setup: Setup, dtype: Any) -> tuple[jax.Array, jax.Array]:
    """Unperturbed positions `(n_local, 3)` (Mpc/h) and int32 ids ``i n^2 + j n + k`` of this device's particles."""
    n = setup.n
    b0, b1, b2 = setup.layout(n).local_shape
    s0, s1 = block_start(setup, n)
    i = (s0 + jnp.arange(b0, dtype=jnp.int32))[:, None, None]
    j = (s1 + jnp.arange(b1, dtype=jnp.int32))[None, :, None]
    k = jnp.arange(b2, dtype=jnp.int32)[None, None, :]
    shape = (b0, b1, b2)
    index = [jnp.broadcast_to(v, shape).reshape(-1) for v in (i, j, k)]
    ids = index[0] * (n * n) + index[1] * n + index[2]
    q = jnp.stack(index, axis=1).astype(dtype) * jnp.asarray(setup.box / n, dtype)
    return q, ids
