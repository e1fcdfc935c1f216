"""Gadget-style HDF5 snapshots: each process reads only its own slice of the particles."""

from __future__ import annotations

import math
import os
from typing import Any, NamedTuple

import jax
import numpy as np
from jax.sharding import Mesh

from .._bounds import check_bounds, check_global
from ..particles import Particles, from_numpy
from ._hdf5 import _h5py, _open


class Snapshot(NamedTuple):
    """A snapshot read by :func:`read_snapshot`.

    Attributes:
        part: global :class:`shardax.particles.Particles` (``(ndev, cap, ...)``); ``ids`` is the row of each
            particle in the file (the global input index that FoF labels refer to).
        box: `(3,)` NumPy periodic box size (``Header/BoxSize``).
        particle_ids: this process's slice of ``ParticleIDs`` (rows ``start:start + count`` of the file).
        start: first file row read by this process.
        total: number of particles in the file.
        header: the ``Header`` attributes as NumPy values.
    """

    part: Particles
    box: np.ndarray
    particle_ids: np.ndarray
    start: int
    total: int
    header: dict[str, Any]


def _blockdist(n: int, size: int, rank: int) -> tuple[int, int]:
    base, extra = divmod(n, size)
    return base + (rank < extra), rank * base + min(rank, extra)


def read_snapshot(path: str | os.PathLike[str], *, mesh: Mesh | None = None, part_type: int = 1,
                  capacity_factor: float = 1.25) -> Snapshot:
    """Read a Gadget-style HDF5 snapshot, each process reading only its contiguous slice (collective).

    Expects ``Header`` with attribute ``BoxSize`` (scalar or per axis) and ``PartType<k>/Coordinates (N, 3)``,
    optionally ``Velocities (N, 3)``, ``ParticleIDs (N,)`` and ``Masses (N,)`` (else ``Header/MassTable[k]``).

    Args:
        path: the snapshot file.
        mesh: mesh to spread the particles over (default: the context mesh, else all devices).
        part_type: which ``PartType`` group to read (1: dark matter).
        capacity_factor: headroom of the padded particle buffers, as in :func:`shardax.particles.from_numpy`.

    Returns:
        A :class:`Snapshot`.

    Raises:
        ValueError: missing groups or datasets, wrong shapes, NaN coordinates, coordinates that do not fit
            ``BoxSize`` (beyond the tolerance of ``docs/reliability.md``), a truncated or corrupt file.

    Example:
        >>> import shardax as sx
        >>> snap = sx.io.read_snapshot("snapshot_000.hdf5")  # doctest: +SKIP
        >>> res = sx.spatial.fof.smap()(snap.part, 0.2 * snap.box[0] / 128, box=tuple(snap.box))  # doctest: +SKIP
    """
    _h5py()
    path = os.fspath(path)
    if not os.path.exists(path):
        raise FileNotFoundError(f"snapshot {path} does not exist")
    group_name = f"PartType{part_type}"
    me, count = jax.process_index(), jax.process_count()
    with _open(path, "r") as f:
        if "Header" not in f or "BoxSize" not in f["Header"].attrs:
            raise ValueError(f"{path}: no Header group with a BoxSize attribute (not a Gadget-style snapshot)")
        header = {k: np.asarray(v) for k, v in f["Header"].attrs.items()}
        box = np.broadcast_to(np.asarray(header["BoxSize"], np.float64), (3,)).copy()
        if not np.all(box > 0):
            raise ValueError(f"{path}: Header/BoxSize must be positive, got {header['BoxSize']}")
        if group_name not in f or "Coordinates" not in f[group_name]:
            raise ValueError(f"{path}: no {group_name}/Coordinates dataset")
        group = f[group_name]
        coords = group["Coordinates"]
        if coords.ndim != 2 or coords.shape[1] != 3:
            raise ValueError(f"{path}: {group_name}/Coordinates must have shape (N, 3), got {coords.shape}")
        total = coords.shape[0]
        rows, start = _blockdist(total, count, me)
        sl = slice(start, start + rows)
        try:
            pos = np.asarray(coords[sl], np.float32)
            fields: dict[str, Any] = {}
            for name, key, shape in (("Velocities", "vel", (total, 3)), ("Masses", "mass", (total,)),
                                     ("ParticleIDs", None, (total,))):
                if name not in group:
                    continue
                if group[name].shape != shape:
                    raise ValueError(f"{path}: {group_name}/{name} must have shape {shape} (one row per particle "
                                     f"of Coordinates), got {group[name].shape}")
                if key is not None:
                    fields[key] = np.asarray(group[name][sl], np.float32)
            particle_ids = (np.asarray(group["ParticleIDs"][sl]) if "ParticleIDs" in group
                            else np.arange(start, start + rows))
        except OSError as err:
            raise ValueError(f"{path}: reading {group_name} failed (truncated or corrupt file?): {err}") from err
    if "mass" not in fields and "MassTable" in header and np.size(header["MassTable"]) > part_type:
        table_mass = float(np.asarray(header["MassTable"]).reshape(-1)[part_type])
        if table_mass > 0:
            fields["mass"] = np.full((rows,), table_mass, np.float32)
    if not np.all(np.isfinite(pos)):
        raise ValueError(f"{path}: {group_name}/Coordinates has NaN or infinite values")
    part = from_numpy(pos, mesh=mesh, capacity_factor=capacity_factor, **fields)
    # Collective: every process raises if any process's slice lies outside the box.
    check_global(part, tuple(box.tolist()), f"{path}: {group_name}/Coordinates against Header/BoxSize", mesh)
    return Snapshot(part, box, particle_ids, start, total, header)


def write_snapshot(path: str | os.PathLike[str], pos: np.ndarray, *, box: float, vel: np.ndarray | None = None,
                   ids: np.ndarray | None = None, mass: float = 1.0) -> None:
    """Write a minimal Gadget-style HDF5 snapshot from host arrays (one process; for tests and examples).

    Args:
        path: the file to write.
        pos: `(N, 3)` float32 or float64 coordinates in ``[0, box)``; coordinates that drifted out by up to a
            quarter box (see ``docs/reliability.md``) are written wrapped into it. Written as float32.
        box: box size (positive, finite).
        vel: `(N, 3)` velocities (default zeros).
        ids: `(N,)` particle IDs (default ``1..N``).
        mass: particle mass (``Header/MassTable[1]``).

    Raises:
        TypeError: ``pos`` not float32/float64.
        ValueError: wrong shapes, a bad ``box``, NaN or infinite coordinates, coordinates outside the box.

    Example:
        >>> import numpy as np, shardax as sx
        >>> sx.io.write_snapshot("snap.hdf5", np.random.default_rng(0).random((8, 3)), box=1.0)  # doctest: +SKIP
    """
    h5py = _h5py()
    pos = np.asarray(pos)
    if pos.ndim != 2 or pos.shape[1] != 3:
        raise ValueError(f"pos must have shape (N, 3), got {pos.shape}")
    if pos.dtype not in (np.float32, np.float64):
        raise TypeError(f"pos must be a float32 or float64 array, got dtype {pos.dtype}; cast it with "
                        "pos.astype(np.float32)")
    if isinstance(box, bool) or not isinstance(box, int | float | np.integer | np.floating) or \
            not (math.isfinite(box) and box > 0):
        raise ValueError(f"box must be a positive finite number, got {box!r}")
    bad = ~np.all(np.isfinite(pos), axis=1)
    if bad.any():
        raise ValueError(f"pos has {int(bad.sum())} row(s) with NaN or infinite coordinates (first: row "
                         f"{int(np.argmax(bad))}); remove or fix them")
    n = pos.shape[0]
    if n:
        check_bounds(pos.min(axis=0), pos.max(axis=0), float(box), "write_snapshot")
    coords = np.mod(pos, box).astype(np.float32)
    coords[coords >= np.float32(box)] = 0  # values just below box that round up to it in float32
    vel = np.zeros_like(coords) if vel is None else np.asarray(vel)
    ids = np.arange(1, n + 1, dtype=np.uint64) if ids is None else np.asarray(ids)
    tmp = os.fspath(path) + ".partial"
    with h5py.File(tmp, "w") as f:
        header = f.create_group("Header")
        header.attrs["BoxSize"] = float(box)
        header.attrs["NumPart_ThisFile"] = np.array([0, n, 0, 0, 0, 0], np.uint32)
        header.attrs["NumPart_Total"] = np.array([0, n, 0, 0, 0, 0], np.uint32)
        header.attrs["MassTable"] = np.array([0, mass, 0, 0, 0, 0], np.float64)
        header.attrs["NumFilesPerSnapshot"] = 1
        group = f.create_group("PartType1")
        group.create_dataset("Coordinates", data=coords)
        group.create_dataset("Velocities", data=vel.astype(np.float32))
        group.create_dataset("ParticleIDs", data=ids)
    os.replace(tmp, path)
