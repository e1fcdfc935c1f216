"""Argument checking and mesh resolution shared by the global ``sx.linalg`` functions."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.core import Tracer
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from ..core import default_mesh
from ._layout import PRESETS, user_sharding

SUPPORTED_DTYPES = (jnp.float32, jnp.float64, jnp.complex64, jnp.complex128)


def check_matrix(a: Any, name: str = "a") -> Any:
    """``a`` if it is a square 2D floating or complex array; TypeError/ValueError otherwise."""
    if not hasattr(a, "shape") or not hasattr(a, "dtype"):
        raise TypeError(f"{name} must be a jax.Array or numpy array, got {type(a).__name__}")
    if len(a.shape) != 2 or a.shape[0] != a.shape[1]:
        raise ValueError(f"{name} must be a square (N, N) matrix, got shape {tuple(a.shape)}")
    if a.shape[0] == 0:
        raise ValueError(f"{name} is empty (shape {tuple(a.shape)}); N must be at least 1")
    check_dtype(a.dtype, name)
    return a


def check_dtype(dtype: Any, name: str) -> None:
    if np.dtype(dtype) not in [np.dtype(d) for d in SUPPORTED_DTYPES]:
        raise TypeError(f"{name} has dtype {np.dtype(dtype)}; sx.linalg supports float32, float64, complex64 and "
                        f"complex128 (float64/complex128 need jax_enable_x64): cast it, e.g. {name}.astype("
                        "jnp.float32)")


def check_rhs(b: Any, a: Any) -> Any:
    """``b`` if it is a vector ``(N,)`` or matrix ``(N, K)`` of ``a``'s dtype."""
    if not hasattr(b, "shape") or not hasattr(b, "dtype"):
        raise TypeError(f"b must be a jax.Array or numpy array, got {type(b).__name__}")
    n = a.shape[0]
    if len(b.shape) not in (1, 2) or b.shape[0] != n:
        raise ValueError(f"b must have shape ({n},) or ({n}, K) to match a of shape {tuple(a.shape)}, got "
                         f"{tuple(b.shape)}")
    if len(b.shape) == 2 and b.shape[1] == 0:
        raise ValueError(f"b has no right-hand sides (shape {tuple(b.shape)})")
    if np.dtype(b.dtype) != np.dtype(a.dtype):
        raise TypeError(f"b has dtype {np.dtype(b.dtype)} but a has {np.dtype(a.dtype)}; cast b with "
                        f"b.astype(a.dtype)")
    return b


def check_tile(tile: Any, t_a: Any = None, *, suggest: int = PRESETS["cpu"].tile) -> int | None:
    """The block size from ``tile`` or jaxmg's ``T_A`` (positive ints; they must agree when both are given), or
    ``None`` when neither is given (the layout then picks its default); ``suggest`` is the value the error
    proposes."""
    if t_a is not None and tile is not None and t_a != tile:
        raise ValueError(f"T_A={t_a!r} and tile={tile!r} disagree; pass only one of them")
    value = tile if tile is not None else t_a
    if value is None:
        return None
    name = "tile" if tile is not None else "T_A"
    if not isinstance(value, int | np.integer) or isinstance(value, bool):
        raise TypeError(f"{name} must be a positive int (the block size), got {value!r}")
    if value < 1:
        raise ValueError(f"{name} must be a positive int (the block size), got {value}; try {suggest}")
    return int(value)


def check_grid(grid: Any, nproc: int) -> int:
    """The process rows of ``grid``: ``None`` (the 1D column layout, 1 row) or a pair ``(rows, cols)`` of positive
    ints whose product is the number of devices ``nproc``."""
    if grid is None:
        return 1
    if not isinstance(grid, tuple | list) or len(grid) != 2 or \
            not all(isinstance(g, int | np.integer) and not isinstance(g, bool) for g in grid):
        raise TypeError(f"grid must be None or a pair (rows, cols) of ints, got {grid!r}")
    rows, cols = (int(g) for g in grid)
    if rows < 1 or cols < 1 or rows * cols != nproc:
        raise ValueError(f"grid={tuple(grid)!r} must be positive and multiply to the mesh's {nproc} devices, e.g. "
                         f"{_square_grid(nproc)}")
    return rows


def _square_grid(nproc: int) -> tuple[int, int]:
    rows = max(r for r in range(1, int(nproc ** 0.5) + 1) if nproc % r == 0)
    return rows, nproc // rows


def check_flag(value: Any, name: str) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be True or False, got {value!r}")
    return value


def resolve_mesh(mesh: Mesh | None, a: Any) -> Mesh:
    """``mesh``, else the mesh ``a`` is sharded on, else the context mesh or ``shardax.flat_mesh``."""
    if mesh is not None:
        return default_mesh(mesh)
    sharding = None if isinstance(a, Tracer) else getattr(a, "sharding", None)
    if isinstance(sharding, NamedSharding) and isinstance(sharding.mesh, Mesh):
        return sharding.mesh
    return default_mesh(None)


def computing_mesh(mesh: Mesh) -> Mesh:
    """``mesh`` with automatic axes. The layout changes around the local kernels are written in the global view,
    which a mesh with explicit axes (``jax.make_mesh``'s default) would make fail; the devices and axis names stay."""
    if AxisType.Explicit not in mesh.axis_types:
        return mesh
    return Mesh(mesh.devices, mesh.axis_names, axis_types=(AxisType.Auto,) * len(mesh.axis_names))


def explicit_avals(*xs: Any) -> bool:
    """Whether any of ``xs`` is a tracer typed on a mesh with explicit axes (inside ``jit`` under a ``jax.set_mesh``
    context of such a mesh): the call then runs under ``jax.sharding.auto_axes`` (see ``under_auto_axes``)."""
    for x in xs:
        if isinstance(x, Tracer):
            mesh = getattr(getattr(jax.typeof(x), "sharding", None), "mesh", None)
            if mesh is not None and AxisType.Explicit in getattr(mesh, "axis_types", ()):
                return True
    return False


def under_auto_axes(fn: Callable[..., Any], args: tuple, out_specs: Any) -> Any:
    """``fn(*args)`` with the explicit mesh axes made automatic around it, its outputs typed ``out_specs`` (a
    ``PartitionSpec`` or a tuple of them) on the explicit mesh again."""
    return jax.sharding.auto_axes(fn, out_sharding=out_specs)(*args)


@contextlib.contextmanager
def computing_on(mesh: Mesh, user_mesh: Mesh) -> Iterator[None]:
    """Make ``mesh`` the context mesh while the work runs on it, when it is not ``user_mesh``: its automatic-axes twin
    (a ``jax.set_mesh`` context of the explicit mesh would otherwise clash with it) or the process grid of its
    devices (``_layout.grid_mesh``, whose ``smap`` would clash with a context of the user's mesh); nothing
    otherwise."""
    if mesh is user_mesh:
        yield
        return
    try:
        context: Any = jax.set_mesh(mesh)
    except ValueError:  # inside jit: only a context mesh of the caller's needs replacing
        outer = jax.sharding.get_abstract_mesh()
        context = contextlib.nullcontext() if outer.empty else jax.sharding.use_abstract_mesh(mesh.abstract_mesh)
    with context:
        yield


def onto(x: Any, mesh: Mesh) -> Any:
    """``x`` laid out the same way on ``mesh`` when it lives on another mesh over the same devices and axes (its
    explicit-axes twin, see ``computing_mesh``); otherwise ``x`` unchanged."""
    sharding = None if isinstance(x, Tracer) else getattr(x, "sharding", None)
    if not isinstance(sharding, NamedSharding) or sharding.mesh == mesh:
        return x
    twin = sharding.mesh
    if twin.axis_names != mesh.axis_names or not np.array_equal(np.asarray(twin.devices), np.asarray(mesh.devices)):
        return x
    return jax.device_put(x, NamedSharding(mesh, sharding.spec))


def enter(x: Any, user_mesh: Mesh, mesh: Mesh) -> tuple[Any, NamedSharding | None, NamedSharding | None]:
    """``(x on mesh, its sharding there, the sharding results go back in)`` for the computing ``mesh`` of
    ``user_mesh`` (``computing_mesh``): the way back is ``x``'s own sharding on ``user_mesh`` when it has one (one
    move from the computing mesh), else its sharding on ``mesh``; ``None`` for an array on neither."""
    back = user_sharding(x, user_mesh)
    x = onto(x, mesh)
    inside = user_sharding(x, mesh)
    return x, inside, back or inside


def apply_in_specs(a: Any, b: Any, mesh: Mesh, in_specs: Any) -> tuple[Any, Any]:
    """jaxmg's ``in_specs=(spec_a, spec_b)``: place host arrays with those specs. Arrays that already carry a
    sharding keep it (the layout is read from the array), and specs naming axes that ``mesh`` does not have (jaxmg
    examples use the placeholder ``"T"``) leave the argument as it is."""
    if in_specs is None:
        return a, b
    if not isinstance(in_specs, tuple | list) or len(in_specs) != 2 or \
            not all(isinstance(s, PartitionSpec) for s in in_specs):
        raise TypeError(f"in_specs must be a pair (spec_a, spec_b) of PartitionSpecs, got {in_specs!r}")
    return _place(a, in_specs[0], mesh), _place(b, in_specs[1], mesh)


def _place(x: Any, spec: PartitionSpec, mesh: Mesh) -> Any:
    if isinstance(x, Tracer) or isinstance(getattr(x, "sharding", None), NamedSharding):
        return x
    names = [n for entry in spec if entry is not None for n in ((entry,) if isinstance(entry, str) else entry)]
    if any(n not in mesh.axis_names for n in names):
        return x
    return jax.device_put(x, NamedSharding(mesh, spec))
