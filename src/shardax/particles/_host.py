"""Host <-> device: build global particle arrays from each process's NumPy rows, and bring them back dense."""

from __future__ import annotations

import math
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from ..core import default_mesh
from ._particles import Particles

_FIELDS = ("mass", "vel", "ids")


def _blockdist(n: int, size: int, rank: int) -> tuple[int, int]:
    """``(count, start)`` of block ``rank`` when ``n`` rows are split as evenly as possible over ``size`` blocks."""
    base, extra = divmod(n, size)
    return base + (rank < extra), rank * base + min(rank, extra)


def _float_dtype(arr: np.ndarray, name: str) -> np.ndarray:
    """``arr`` if float32 (or float64 with ``jax_enable_x64``), float64 as float32 otherwise; any other dtype is a
    ``TypeError`` (float16 too: its 11-bit mantissa cannot place particles in a box, so it is never cast silently)."""
    if arr.dtype not in (np.float32, np.float64):
        raise TypeError(f"{name} must be a float32 or float64 array, got dtype {arr.dtype}; cast it with "
                        f"{name}.astype(np.float32)")
    if arr.dtype == np.float64 and not jax.config.read("jax_enable_x64"):
        return arr.astype(np.float32)
    return arr


def _check_fields(pos: np.ndarray, fields: dict[str, Any]) -> dict[str, np.ndarray]:
    n, d = pos.shape
    out: dict[str, np.ndarray] = {}
    for name, value in fields.items():
        if name not in _FIELDS:
            raise TypeError(f"from_numpy got an unexpected field {name!r}; Particles fields are {_FIELDS}")
        if value is None:
            continue
        arr = np.asarray(value)
        if name == "mass":
            arr = _float_dtype(np.broadcast_to(arr, (n,)) if arr.ndim == 0 else arr, "mass")
            expected: tuple[int, ...] = (n,)
        elif name == "vel":
            arr = _float_dtype(arr, "vel")
            expected = (n, d)
        else:
            if not np.issubdtype(arr.dtype, np.integer):
                raise TypeError(f"ids must be an integer array, got dtype {arr.dtype}")
            arr = arr.astype(np.int32)
            expected = (n,)
        if arr.shape != expected:
            raise ValueError(f"{name} must have shape {expected} (one row per row of pos), got {arr.shape}")
        out[name] = arr
    return out


def from_numpy(pos: np.ndarray, *, mesh: Mesh | None = None, capacity_factor: float = 1.25,
               **fields: Any) -> Particles:
    """Global padded :class:`Particles` from each process's own NumPy rows.

    Call it on every process (collectively). Process ``p`` passes its ``n_p`` rows (counts may differ); they are
    spread evenly over that process's devices of ``mesh``, in mesh order. Every device gets the same capacity
    ``cap = max(ceil(capacity_factor * N / ndev), largest device count)``, ``N`` the total.

    Args:
        pos: `(n_p, d)` float32 or float64 positions of this process's particles, ``d`` in {2, 3} (``n_p`` may be
            0); float64 becomes float32 unless ``jax_enable_x64`` is on, other dtypes (float16, ints) raise
            ``TypeError``. NaN or infinite values are rejected.
        mesh: the mesh (default: the context mesh, else :func:`shardax.flat_mesh`); the particle axis is sharded
            over all its axes.
        capacity_factor: headroom of the padded buffers (>= 1); zsort needs some (1.25 is plenty).
        **fields: optional ``mass`` (`(n_p,)` or a scalar), ``vel`` (`(n_p, d)`), ``ids`` (`(n_p,)` int). Without
            ``ids``, particles are numbered by global input index: process order, then row order.

    Returns:
        :class:`Particles` with fields of shape ``(ndev, cap, ...)`` and ``num (ndev,)``, sharded over ``mesh``.

    Example:
        >>> import numpy as np, shardax as sx
        >>> part = sx.particles.from_numpy(np.random.default_rng(0).random((100, 3)))
        >>> part.pos.shape[0] == sx.world().device_count, int(part.num.sum())
        (True, 100)
    """
    mesh = default_mesh(mesh)
    pos = np.asarray(pos)
    if pos.ndim != 2 or pos.shape[1] not in (2, 3):
        raise ValueError(f"pos must have shape (n, 2) or (n, 3) (this process's rows), got {pos.shape}")
    pos = _float_dtype(pos, "pos")
    bad = ~np.all(np.isfinite(pos), axis=1)
    if bad.any():
        raise ValueError(f"pos has {int(bad.sum())} row(s) with NaN or infinite coordinates (first: row "
                         f"{int(np.argmax(bad))}); remove or fix them")
    if isinstance(capacity_factor, bool) or not isinstance(capacity_factor, int | float) or capacity_factor < 1:
        raise ValueError(f"capacity_factor must be a number >= 1, got {capacity_factor!r}")
    arrays = {"pos": pos, **_check_fields(pos, fields)}

    devices = list(mesh.devices.flat)
    ndev = len(devices)
    me = jax.process_index()
    counts = np.array([pos.shape[0]], np.int64)
    if jax.process_count() > 1:
        counts = np.asarray(multihost_utils.process_allgather(counts)).reshape(-1)
    owners = [dev.process_index for dev in devices]
    per_device = np.zeros(ndev, np.int64)
    for p in sorted(set(owners)):
        mine = [i for i, o in enumerate(owners) if o == p]
        for j, i in enumerate(mine):
            per_device[i] = _blockdist(int(counts[p]), len(mine), j)[0]
    total = int(counts.sum())
    if total >= 2**31:
        raise ValueError(f"{total} particles do not fit int32 ids and counts")
    cap = max(1, math.ceil(capacity_factor * total / ndev), int(per_device.max(initial=0)))
    offset = int(counts[:me].sum())
    if "ids" not in arrays:
        arrays["ids"] = np.arange(offset, offset + pos.shape[0], dtype=np.int32)

    local = [i for i, o in enumerate(owners) if o == me]
    sharding = NamedSharding(mesh, P(tuple(mesh.axis_names)))
    out = {}
    for name, arr in arrays.items():
        blocks = []
        for j, i in enumerate(local):
            count, start = _blockdist(arr.shape[0], len(local), j)
            block = np.zeros((1, cap, *arr.shape[1:]), arr.dtype)
            block[0, :count] = arr[start:start + count]
            blocks.append(jax.device_put(block, devices[i]))
        out[name] = jax.make_array_from_single_device_arrays((ndev, cap, *arr.shape[1:]), sharding, blocks)
    nums = [jax.device_put(per_device[i:i + 1].astype(np.int32), devices[i]) for i in local]
    num = jax.make_array_from_single_device_arrays((ndev,), sharding, nums)
    return Particles(pos=out["pos"], num=num, mass=out.get("mass"), vel=out.get("vel"), ids=out["ids"])


def _to_host(x: Any) -> np.ndarray:
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        return np.asarray(multihost_utils.process_allgather(x, tiled=True))
    return np.asarray(x)


def _name(path: tuple) -> str:
    parts = []
    for key in path:
        for attr in ("name", "key", "idx"):
            if hasattr(key, attr):
                parts.append(str(getattr(key, attr)))
                break
        else:
            parts.append(str(key))
    return ".".join(parts)


def squeeze(part: Any) -> dict[str, np.ndarray]:
    """Dense host arrays of the valid rows of a global particle pytree, in global (device, then row) order.

    Every process gets the full arrays (collective in multi-process runs). A local-view set (``num`` a scalar) is
    treated as one device.

    Args:
        part: particle pytree with fields ``(ndev, cap, ...)`` and ``num (ndev,)`` (e.g. from :func:`from_numpy`
            or a ``.smap`` function).

    Returns:
        ``{name: array}`` for every per-particle field (``"pos"``, ``"ids"``, ...; nested names joined by ``.``),
        each of shape ``(sum(num), ...)``.

    Example:
        >>> import numpy as np, shardax as sx
        >>> pos = np.random.default_rng(0).random((10, 3)).astype(np.float32)
        >>> out = sx.particles.squeeze(sx.particles.from_numpy(pos))
        >>> bool(np.array_equal(out["pos"], pos)), out["ids"].tolist() == list(range(10))
        (True, True)
    """
    if getattr(part, "pos", None) is None or not hasattr(part, "num"):
        raise TypeError(f"squeeze needs a particle pytree with .pos and .num, got {type(part).__name__}")
    num = _to_host(part.num).astype(np.int64)
    local = num.ndim == 0
    num = num.reshape(-1)
    lead = tuple(np.shape(part.pos)[: 1 if local else 2])
    out = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(part)[0]:
        if leaf is part.num or tuple(np.shape(leaf)[: len(lead)]) != lead or np.ndim(leaf) <= len(lead) - 1:
            continue
        arr = _to_host(leaf)
        if local:
            arr = arr[None]
        out[_name(path)] = np.concatenate([arr[r, : num[r]] for r in range(num.shape[0])])
    return out
