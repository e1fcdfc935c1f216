"""The static description of a particle-mesh run (grids, split, options) and the checks of its arguments."""

from __future__ import annotations

import dataclasses
import itertools
import math
import operator
from collections.abc import Callable, Sequence
from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from ..fft import Layout

Gradient = Literal["fd4", "spectral"]


@dataclasses.dataclass(frozen=True)
class Setup:
    """Particle grid ``n^3``, force mesh ``nm^3`` over a periodic ``box`` (Mpc/h), both split by ``spec`` over
    ``mesh``; hashable (it keys the compiled programs: changing a field recompiles)."""

    n: int
    nm: int
    box: float
    mesh: Mesh
    spec: PartitionSpec
    order: int = 2
    gradient: Gradient = "fd4"
    deconvolve: bool = False
    capacity: int = 0

    @property
    def axis_sizes(self) -> dict[str, int]:
        return dict(self.mesh.shape)

    def layout(self, n: int) -> Layout:
        return Layout.from_spec(self.spec, (n, n, n), self.axis_sizes, "spec")

    @property
    def fft_layout(self) -> Literal["same", "transposed"]:
        """How spectra are stored: ``(k1, k2, k0)`` for slabs (one transpose saved), ``(k0, k1, k2)`` for pencils
        (whose half axis ``n // 2 + 1`` cannot be split)."""
        return "transposed" if len(self.mesh.axis_names) == 1 else "same"

    @property
    def mesh_offset(self) -> float:
        """Where the force mesh's nodes sit, in mesh cells below the particles' Lagrangian grid: ``1/2`` for a mesh
        twice as fine (the painted unperturbed lattice is then uniform: no comb at the mesh's Nyquist frequency),
        else 0."""
        return 0.5 if self.nm == 2 * self.n else 0.0

    @property
    def local_count(self) -> int:
        """Particles per device."""
        return math.prod(self.layout(self.n).local_shape)

    @property
    def ndev(self) -> int:
        return self.mesh.devices.size

    def sharding(self) -> NamedSharding:
        return NamedSharding(self.mesh, self.spec)


def _side(value: Any, name: str, fix: str) -> int:
    if isinstance(value, bool):
        raise TypeError(f"{name} must be an int (a power of two), got {value!r}")
    try:
        n = operator.index(value)
    except TypeError:
        raise TypeError(f"{name} must be an int (a power of two), got {type(value).__name__}") from None
    if n < 2 or n & (n - 1):
        raise ValueError(f"{name} must be a power of two >= 2 (the FFT grid side), got {n}; {fix}")
    return n


def check_box(box: Any, where: str) -> float:
    if isinstance(box, bool) or not isinstance(box, int | float | np.floating | np.integer):
        raise TypeError(f"{where}: box must be a number (the periodic box side in Mpc/h), got {type(box).__name__}")
    if not (math.isfinite(float(box)) and float(box) > 0):
        raise ValueError(f"{where}: box must be a positive finite number (Mpc/h), got {box!r}")
    return float(box)


def default_spec(mesh: Mesh, where: str) -> PartitionSpec:
    """Slabs over a 1D mesh, pencils over a 2D mesh."""
    if not isinstance(mesh, Mesh):
        raise TypeError(f"{where}: mesh must be a jax.sharding.Mesh or None, got {type(mesh).__name__}")
    if len(mesh.axis_names) > 2:
        raise ValueError(f"{where}: mesh must have 1 axis (slabs) or 2 axes (pencils), got axes {mesh.axis_names}; "
                         "use sx.flat_mesh() or sx.grid_mesh()")
    return PartitionSpec(*mesh.axis_names)


def make_setup(*, n: Any, nm: Any, box: Any, mesh: Mesh, order: Any = 2, gradient: Any = "fd4",
               deconvolve: Any = False, capacity: Any = None, where: str) -> Setup:
    """A checked :class:`Setup`: power-of-two grids that divide over the mesh, a known order and gradient."""
    n = _side(n, "particles_per_side", "e.g. 32, 64 or 128")
    nm = _side(nm, "mesh_per_side", "e.g. equal to particles_per_side or twice it")
    box = check_box(box, where)
    spec = default_spec(mesh, where)
    sizes = dict(mesh.shape)
    for name, side in (("particles_per_side", n), ("mesh_per_side", nm)):
        for axis_name, parts in sizes.items():
            if side % parts:
                raise ValueError(f"{where}: {name}={side} does not divide over mesh axis {axis_name!r} of "
                                 f"{parts} devices; use a mesh whose axis sizes divide {side} (powers of two)")
    if order not in (1, 2):
        raise ValueError(f"{where}: order must be 1 (Zel'dovich) or 2 (2LPT), got {order!r}")
    if gradient not in ("fd4", "spectral"):
        raise ValueError(f"{where}: gradient must be 'fd4' (4th-order finite difference) or 'spectral' (i k), got "
                         f"{gradient!r}")
    if not isinstance(deconvolve, bool):
        raise TypeError(f"{where}: deconvolve must be a bool, got {type(deconvolve).__name__}")
    if n**3 >= 2**31:
        raise ValueError(f"{where}: particles_per_side={n} gives more than 2**31 particles (int32 ids)")
    setup = Setup(n=n, nm=nm, box=box, mesh=mesh, spec=spec, order=order, gradient=gradient,
                  deconvolve=deconvolve)
    local = setup.local_count
    if capacity is None:
        capacity = local + max(local // 2, 64)
    if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < local:
        raise ValueError(f"{where}: capacity must be an int >= {local} (the particles per device), got {capacity!r}")
    return dataclasses.replace(setup, capacity=capacity)


def power_table(power: Any, where: str) -> tuple[np.ndarray, np.ndarray]:
    """``(log k, P)`` of a ``(k, P)`` table: finite, positive increasing ``k``, non-negative ``P``."""
    try:
        k, pk = (np.asarray(v, np.float64) for v in power)
    except (TypeError, ValueError):
        raise TypeError(f"{where}: power must be a Cosmology-free callable P(k) or a (k, P) pair of 1D arrays, got "
                        f"{type(power).__name__}") from None
    if k.ndim != 1 or k.shape != pk.shape or k.size < 2:
        raise ValueError(f"{where}: the power table (k, P) must be two 1D arrays of the same length >= 2, got shapes "
                         f"{k.shape} and {pk.shape}")
    bad = ~(np.isfinite(k) & np.isfinite(pk))
    if bad.any():
        raise ValueError(f"{where}: the power table (k, P) has {int(bad.sum())} NaN or infinite value(s) (first at "
                         f"index {int(np.argmax(bad))}); remove or fix them")
    if (k <= 0).any() or (np.diff(k) <= 0).any():
        raise ValueError(f"{where}: the power table's k must be positive and strictly increasing (h/Mpc)")
    if (pk < 0).any():
        raise ValueError(f"{where}: the power table's P(k) must be non-negative ((Mpc/h)^3)")
    return np.log(k), pk


def power_source(power: Any, where: str) -> Callable[..., Any] | tuple[np.ndarray, np.ndarray] | None:
    """``None`` (the cosmology's linear power), a callable of ``|k|`` or a checked table."""
    if power is None or callable(power):
        return power
    return power_table(power, where)


def scale_factors(a_start: Any, a_end: Any, steps: Any, snapshots: Sequence[Any], where: str
                  ) -> tuple[np.ndarray, np.ndarray]:
    """The step boundaries (``steps`` equal steps in ``a`` with the snapshot times inserted) and, per step, the
    snapshot slot its end state fills (``len(snapshots)``: none)."""
    if isinstance(steps, bool) or not isinstance(steps, int | np.integer):
        raise TypeError(f"{where}: steps must be an int, got {type(steps).__name__}")
    if steps < 1:
        raise ValueError(f"{where}: steps must be >= 1 (the number of kick-drift-kick steps), got {steps}")
    try:
        a0, a1 = float(a_start), float(a_end)
        snaps = [float(s) for s in snapshots]
    except (TypeError, ValueError):
        raise TypeError(f"{where}: a_start, a_end and snapshots must be numbers (scale factors)") from None
    if not (1e-3 <= a0 < a1 <= 1.0):
        raise ValueError(f"{where}: scale factors must satisfy 1e-3 <= a_start < a_end <= 1, got a_start={a0}, "
                         f"a_end={a1}")
    if any(b <= a for a, b in itertools.pairwise(snaps)):
        raise ValueError(f"{where}: snapshots must be strictly increasing scale factors, got {snaps}")
    if snaps and not (a0 < snaps[0] and snaps[-1] <= a1):
        raise ValueError(f"{where}: snapshots must lie in (a_start, a_end] = ({a0}, {a1}], got {snaps}")
    grid = np.linspace(a0, a1, int(steps) + 1)
    close = [s for s in snaps if np.min(np.abs(grid - s)) > 1e-9]  # a snapshot on a step boundary adds no step
    times = np.unique(np.concatenate([grid, np.asarray(close, np.float64)]))
    slots = np.full(len(times) - 1, len(snaps), np.int32)
    for slot, s in enumerate(snaps):
        slots[int(np.argmin(np.abs(times[1:] - s)))] = slot
    return times, slots


def check_noise(noise: Any, setup: Setup, where: str) -> jax.Array:
    shape = (setup.n,) * 3
    if not isinstance(noise, jax.Array | np.ndarray):
        raise TypeError(f"{where}: noise must be an array {shape} (e.g. from sx.nbody.white_noise), got "
                        f"{type(noise).__name__}")
    if np.shape(noise) != shape:
        raise ValueError(f"{where}: noise must have shape {shape} (particles_per_side cubed), got {np.shape(noise)}")
    if jnp.result_type(noise) not in (jnp.float32, jnp.float64):
        raise TypeError(f"{where}: noise must be float32 or float64, got {jnp.result_type(noise)}")
    return jnp.asarray(noise)
