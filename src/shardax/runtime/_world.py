"""The process and device world of a run: who is who, and the meshes built from it."""

from __future__ import annotations

import dataclasses
import socket
from collections.abc import Sequence
from typing import Literal

import jax
import numpy as np
from jax._src.lib import _jax
from jax.sharding import AxisType, Mesh

from .._errors import DistributedSetupError
from .._fingerprint import per_process_fields

Mode = Literal["single", "spmd", "mpmd"]


@dataclasses.dataclass(frozen=True)
class World:
    """Where this process sits in the run.

    Attributes:
        process_id: index of this process, ``0 <= process_id < num_processes``.
        num_processes: number of processes in the run.
        local_device_count: devices this process drives (the same on every process).
        device_count: devices in the whole run.
        num_hosts: distinct machines the processes run on.
        platform: ``"cpu"``, ``"gpu"`` or ``"tpu"``.
        mode: ``"single"`` (one process), ``"spmd"`` (each process drives several devices) or ``"mpmd"`` (one
            device per process).
    """

    process_id: int
    num_processes: int
    local_device_count: int
    device_count: int
    num_hosts: int
    platform: str
    mode: Mode


_hosts_cache: dict[int, int] = {}


def _count_hosts() -> int:
    """Distinct host names across processes, through the distributed key-value store (once per run)."""
    n = jax.process_count()
    if n == 1:
        return 1
    if n in _hosts_cache:
        return _hosts_cache[n]
    from jax._src import distributed

    client = distributed.global_state.client
    if client is None:  # the user started the world some other way; we cannot ask the others
        return n
    me = jax.process_index()
    client.key_value_set(f"shardax/hostname/{me}", socket.gethostname())
    names = {client.blocking_key_value_get(f"shardax/hostname/{p}", 60_000) for p in range(n)}
    _hosts_cache[n] = len(names)
    return len(names)


def validate_devices(devices: Sequence[_jax.Device]) -> None:
    """Equal local device counts and one device kind across processes, or an error naming the processes."""
    by_process: dict[int, list[_jax.Device]] = {}
    for d in devices:
        by_process.setdefault(d.process_index, []).append(d)
    counts = {p: len(ds) for p, ds in sorted(by_process.items())}
    if len(set(counts.values())) > 1:
        detail = ", ".join(f"process {p}: {c}" for p, c in counts.items())
        raise DistributedSetupError(
            f"processes drive unequal numbers of devices ({detail}); shardax needs the same local device count on "
            "every process (set CUDA_VISIBLE_DEVICES / --cpu-devices alike everywhere)")
    kinds = {p: {d.device_kind for d in ds} for p, ds in sorted(by_process.items())}
    all_kinds = set().union(*kinds.values())
    if len(all_kinds) > 1:
        detail = ", ".join(f"process {p}: {sorted(k)}" for p, k in kinds.items())
        raise DistributedSetupError(f"processes drive different device kinds ({detail}); use one kind of device")


def world() -> World:
    """The world of this run (starts the JAX backend if it has not started yet).

    Example:
        >>> import shardax as sx
        >>> w = sx.world()
        >>> w.process_id < w.num_processes
        True
    """
    devices = jax.devices()
    validate_devices(devices)
    n = jax.process_count()
    local = jax.local_device_count()
    mode: Mode = "single" if n == 1 else ("mpmd" if local == 1 else "spmd")
    return World(process_id=jax.process_index(), num_processes=n, local_device_count=local,
                 device_count=len(devices), num_hosts=_count_hosts(), platform=devices[0].platform, mode=mode)


def device_grid() -> np.ndarray:
    """All devices as an array of shape ``(num_processes, local_device_count)``, rows by process index.

    Within a row, devices are ordered by id. This is the layout of jaxmg's ``get_device_grid``.

    Example:
        >>> import shardax as sx
        >>> sx.device_grid().shape[0] == sx.world().num_processes
        True
    """
    devices = jax.devices()
    validate_devices(devices)
    by_process: dict[int, list[_jax.Device]] = {}
    for d in devices:
        by_process.setdefault(d.process_index, []).append(d)
    rows = [sorted(by_process[p], key=lambda d: d.id) for p in sorted(by_process)]
    grid = np.empty((len(rows), len(rows[0])), dtype=object)
    for i, row in enumerate(rows):
        for j, d in enumerate(row):
            grid[i, j] = d
    return grid


def flat_mesh(axis_name: str = "d") -> Mesh:
    """A 1D mesh over every device of the run, in :func:`device_grid` order (process-major).

    Example:
        >>> import shardax as sx
        >>> mesh = sx.flat_mesh()
        >>> mesh.axis_names
        ('d',)
    """
    if not isinstance(axis_name, str):
        raise TypeError(f"axis_name must be a str, got {type(axis_name).__name__}")
    return Mesh(device_grid().reshape(-1), (axis_name,), axis_types=(AxisType.Auto,))


def grid_mesh(axis_names: tuple[str, str] = ("hosts", "d")) -> Mesh:
    """The 2D mesh of :func:`device_grid`: axis 0 over processes, axis 1 over each process's devices.

    Example:
        >>> import shardax as sx
        >>> sx.grid_mesh().shape["hosts"] == sx.world().num_processes
        True
    """
    if (not isinstance(axis_names, tuple | list) or len(axis_names) != 2
            or not all(isinstance(a, str) for a in axis_names) or axis_names[0] == axis_names[1]):
        raise ValueError(f"axis_names must be two distinct str names, got {axis_names!r}")
    return Mesh(device_grid(), tuple(axis_names), axis_types=(AxisType.Auto, AxisType.Auto))


per_process_fields(World, ("process_id",))   # the same program on every process
