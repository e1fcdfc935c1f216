"""Friends-of-friends groups as a Gadget-4 group catalogue (``fof_tab_XXX.hdf5``), the same file at every scale.

The writer gathers the members of the groups (not the other particles) from every device and process, orders the
groups by their smallest member index (their FoF label) and the members by index, and computes the group sums on
the host in float64 in that order: the file's bytes do not depend on how the run was split over processes and
devices. One file (process 0 writes it) or one file per process (``<stem>.<rank>.hdf5``, consecutive blocks of
groups, Gadget's multi-file layout with ``NumFiles``).
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils

from ._hdf5 import _h5py, _open, _sync

NTYPES = 6
_GROUP_FIELDS = ("GroupLen", "GroupMass", "GroupPos", "GroupVel", "GroupLenType", "GroupOffsetType",
                 "GroupMassType")


def _blocks(x: Any) -> dict[int, np.ndarray]:
    """This process's rows of a global ``(ndev, ...)`` array by first device row (host arrays: all, on process 0)."""
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        out: dict[int, np.ndarray] = {}
        for shard in x.addressable_shards:
            start = (shard.index[0].start or 0) if x.ndim else 0
            out.setdefault(start, np.asarray(shard.data))
        return out
    return {0: np.asarray(x)} if jax.process_index() == 0 else {}


def _local_members(labels: Any, part: Any) -> dict[str, np.ndarray]:
    """The rows of this process's devices that belong to a group: label, input index, position, velocity, mass."""
    one_device = np.ndim(labels) == 1
    fields = {"label": labels, "num": part.num, "pos": part.pos, "ids": getattr(part, "ids", None),
              "vel": getattr(part, "vel", None), "mass": getattr(part, "mass", None)}
    pieces = {name: _blocks(value) for name, value in fields.items() if value is not None}
    if "ids" not in pieces:
        raise ValueError("write_fof_table: part has no `ids` (the global input index that FoF labels refer to); "
                         "build it with sx.particles.from_numpy, which fills them")
    out: dict[str, list[np.ndarray]] = {k: [] for k in ("label", "ids", "pos", "vel", "mass")}
    for start, lab in pieces["label"].items():
        odd = [name for name, blocks in pieces.items() if start not in blocks]
        if odd:
            raise ValueError(f"write_fof_table: part.{odd[0]} is not split over the devices like the labels (no "
                             f"block starting at device row {start}); give every field of part the sharding of "
                             "part.pos (leading axis over the devices), as sx.particles.from_numpy does")
        block = {name: blocks[start] for name, blocks in pieces.items()}
        if one_device:
            block = {name: value[None] for name, value in block.items()}
        num = np.asarray(block["num"]).reshape(-1)
        for d in range(lab.shape[0] if not one_device else 1):
            rows = np.arange(block["label"].shape[1]) < num[d]
            keep = rows & (block["label"][d] >= 0)
            out["label"].append(block["label"][d][keep].astype(np.int64))
            out["ids"].append(block["ids"][d][keep].astype(np.int64))
            pos = block["pos"][d][keep]
            out["pos"].append(pos.astype(np.float64))
            out["vel"].append(block["vel"][d][keep].astype(np.float64) if "vel" in block
                              else np.zeros_like(pos, np.float64))
            out["mass"].append(block["mass"][d][keep].astype(np.float64) if "mass" in block
                               else np.ones(len(pos), np.float64))
    dim = int(np.shape(part.pos)[-1])
    empty = {"label": np.zeros(0, np.int64), "ids": np.zeros(0, np.int64), "pos": np.zeros((0, dim)),
             "vel": np.zeros((0, dim)), "mass": np.zeros(0)}
    return {k: np.concatenate(v) if v else empty[k] for k, v in out.items()}


def allgather_rows(arrays: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Concatenate every process's rows of each array, in process order (collective; the row counts may differ)."""
    if jax.process_count() == 1:
        return arrays
    n = len(next(iter(arrays.values())))
    counts = np.asarray(multihost_utils.process_allgather(np.array([n], np.int32))).reshape(-1)
    width = max(int(counts.max()), 1)
    out = {}
    for name, arr in arrays.items():
        raw = np.ascontiguousarray(arr).reshape(n, -1).view(np.uint8)  # bytes: JAX would narrow 64-bit types
        padded = np.zeros((width, raw.shape[1]), np.uint8)
        padded[:n] = raw
        gathered = np.asarray(multihost_utils.process_allgather(padded))
        rows = np.concatenate([gathered[p, : counts[p]] for p in range(len(counts))])
        out[name] = np.ascontiguousarray(rows).view(arr.dtype).reshape(-1, *arr.shape[1:])
    return out


def _box_values(box: Any, dim: int) -> np.ndarray | None:
    if box is None:
        return None
    values = np.broadcast_to(np.asarray(box, np.float64), (dim,)) if np.ndim(box) == 0 else np.asarray(box, float)
    if values.shape != (dim,) or not np.all(np.isfinite(values) & (values > 0)):
        raise ValueError(f"box must be None (open boundaries), a positive number or {dim} positive numbers, got "
                         f"{box!r}")
    return values


def group_table(members: dict[str, np.ndarray], box: np.ndarray | None, part_type: int) -> dict[str, np.ndarray]:
    """Gadget-4 ``Group/*`` datasets and the member indices in group order, from gathered members (host, float64).

    Groups are ordered by label (their smallest member index), members by index; sums run in that order.
    """
    order = np.lexsort((members["ids"], members["label"]))
    label = members["label"][order]
    ids = members["ids"][order]
    pos, vel, mass = members["pos"][order], members["vel"][order], members["mass"][order]
    _, first, length = np.unique(label, return_index=True, return_counts=True)
    dim = pos.shape[1]
    group = np.repeat(np.arange(len(first)), length)
    # Offsets from the first member (the smallest index), at minimum image in a periodic box.
    delta = pos - pos[first][group] if len(pos) else pos
    if box is not None:
        delta -= box * np.round(delta / box)
    total = np.add.reduceat(mass, first) if len(first) else np.zeros(0)
    safe = np.where(total > 0, total, 1.0)
    com = pos[first] + (np.add.reduceat(mass[:, None] * delta, first) if len(first) else np.zeros((0, dim))) / \
        safe[:, None]
    if box is not None:
        com = np.mod(com, box)
        com[com >= box] = 0.0
    mean_vel = (np.add.reduceat(mass[:, None] * vel, first) if len(first) else np.zeros((0, dim))) / safe[:, None]
    ngroups = len(first)
    len_type = np.zeros((ngroups, NTYPES), np.int32)
    len_type[:, part_type] = length
    offset_type = np.zeros((ngroups, NTYPES), np.int64)
    offset_type[:, part_type] = np.cumsum(length) - length
    mass_type = np.zeros((ngroups, NTYPES), np.float32)
    mass_type[:, part_type] = total
    return {"GroupLen": length.astype(np.int32), "GroupMass": total.astype(np.float32),
            "GroupPos": com.astype(np.float32), "GroupVel": mean_vel.astype(np.float32), "GroupLenType": len_type,
            "GroupOffsetType": offset_type, "GroupMassType": mass_type, "members": ids}


def _check_options(redshift: Any, time: Any, part_type: Any, per_rank: Any) -> float:
    if not isinstance(per_rank, bool):
        raise TypeError(f"per_rank must be a bool, got {per_rank!r}")
    if isinstance(part_type, bool) or not isinstance(part_type, int) or not 0 <= part_type < NTYPES:
        raise ValueError(f"part_type must be an int in 0..{NTYPES - 1} (the Gadget particle type), got "
                         f"{part_type!r}")
    if isinstance(redshift, bool) or not isinstance(redshift, int | float | np.number) or \
            not (math.isfinite(redshift) and redshift > -1):
        raise ValueError(f"redshift must be a finite number > -1, got {redshift!r}")
    if time is None:
        return 1.0 / (1.0 + float(redshift))
    if isinstance(time, bool) or not isinstance(time, int | float | np.number) or not math.isfinite(time):
        raise ValueError(f"time must be a finite number (the scale factor in a comoving run), got {time!r}")
    return float(time)


def _file_name(path: str, rank: int) -> str:
    stem = path[:-5] if path.endswith(".hdf5") else path[:-3] if path.endswith(".h5") else path
    return f"{stem}.{rank}.hdf5"


def write_fof_table(path: str | os.PathLike[str], result: Any, part: Any, *, box: Any, redshift: float = 0.0,
                    time: float | None = None, particle_ids: np.ndarray | None = None, part_type: int = 1,
                    parameters: Mapping[str, Any] | None = None, per_rank: bool = False) -> list[str]:
    """Write friends-of-friends groups as a Gadget-4 group catalogue (``fof_tab_XXX.hdf5``; collective).

    The file holds ``Header`` attributes (``Ngroups_ThisFile``, ``Ngroups_Total``, ``Nids_ThisFile``,
    ``Nids_Total``, ``Nsubhalos_ThisFile``/``_Total`` = 0, ``NumFiles``, ``BoxSize``, ``Redshift``, ``Time``), the
    ``Group`` datasets ``GroupLen (G,)``, ``GroupMass (G,)``, ``GroupPos (G, 3)`` (periodic centre of mass, in
    ``[0, box)``), ``GroupVel (G, 3)`` (mass-weighted mean velocity), ``GroupLenType (G, 6)``,
    ``GroupOffsetType (G, 6)`` (first member of each group in ``IDs/ID``) and ``GroupMassType (G, 6)``, and the
    member IDs in group order as ``IDs/ID (Nids,)``. Groups are ordered by their smallest member index (their FoF
    label), members by index; the sums run on the host in float64 in that order, so the file is the same byte for
    byte whatever the number of processes and devices. Gadget's float32 output precision.

    Args:
        path: the file to write. With ``per_rank``: the name the files are derived from, ``<stem>.<rank>.hdf5``.
        result: the :class:`shardax.spatial.FofResult` of ``sx.spatial.fof.smap()(part, ...)`` (or its ``labels``),
            global `(ndev, n)` labels (a local-view `(n,)` result works on one device).
        part: the particles FoF ran on (global ``(ndev, n, ...)``): ``pos``, ``num`` and ``ids`` (the global input
            index), optionally ``vel`` (else zeros) and ``mass`` (else 1 per particle).
        box: periodic box size (scalar or per axis; ``BoxSize``), or None for open boundaries (``BoxSize`` 0).
        redshift: ``Header/Redshift``.
        time: ``Header/Time`` (default the scale factor ``1 / (1 + redshift)``).
        particle_ids: optional `(N,)` host array of the IDs to write for input index ``0..N-1`` (e.g. a snapshot's
            ``ParticleIDs``), the same on every process; default the input index itself.
        part_type: the Gadget particle type the members are counted under in ``GroupLenType`` (1: dark matter).
        parameters: optional scalars stored as attributes of a ``Parameters`` group (e.g. the linking length).
        per_rank: one file per process (process ``p`` writes the ``p``-th block of consecutive groups, with global
            ``GroupOffsetType``, and ``NumFiles`` = the process count) instead of one file written by process 0.

    Returns:
        The files written.

    Raises:
        TypeError: ``per_rank`` not a bool.
        ValueError: a bad ``box``, ``redshift``, ``time`` or ``part_type``; ``part`` without ``ids``;
            ``particle_ids`` shorter than the largest member index.

    Example:
        >>> import h5py, numpy as np, shardax as sx
        >>> pos = np.random.default_rng(0).random((2000, 3)).astype(np.float32)
        >>> part = sx.particles.from_numpy(pos)
        >>> res = sx.spatial.fof.smap()(part, 0.05, box=1.0, min_members=5)
        >>> files = sx.io.write_fof_table("/tmp/fof_tab_000.hdf5", res, part, box=1.0)
        >>> with h5py.File(files[0]) as f:
        ...     sizes, ids = f["Group/GroupLen"][:], f["IDs/ID"][:]
        >>> int(sizes.sum()) == len(ids)
        True
    """
    path = os.fspath(path)
    time_value = _check_options(redshift, time, part_type, per_rank)
    labels = getattr(result, "labels", result)
    dim = int(np.shape(part.pos)[-1])
    box_values = _box_values(box, dim)
    members = allgather_rows(_local_members(labels, part))
    table = group_table(members, box_values, part_type)
    ids = table.pop("members")
    if particle_ids is not None:
        lookup = np.asarray(particle_ids).reshape(-1)
        if len(ids) and int(ids.max()) >= len(lookup):
            raise ValueError(f"particle_ids has {len(lookup)} entries but a group member has input index "
                             f"{int(ids.max())}; pass the IDs of all particles, indexed by input index")
        ids = lookup[ids]
    ids = ids.astype(np.uint64)
    me, count = jax.process_index(), jax.process_count()
    header = {"Ngroups_Total": len(table["GroupLen"]), "Nids_Total": len(ids), "Nsubhalos_Total": 0,
              "NumFiles": count if per_rank else 1, "Time": time_value, "Redshift": float(redshift),
              "BoxSize": 0.0 if box_values is None else
              float(box_values[0]) if np.all(box_values == box_values[0]) else box_values}
    if not per_rank:
        if me == 0:
            _write_file(path, table, ids, header, parameters, np.arange(len(ids)))
        _sync("fof-table")
        return [path]
    split = np.array_split(np.arange(len(table["GroupLen"])), count)[me]
    rows = {k: v[split] for k, v in table.items()}
    first = int(table["GroupOffsetType"][split[0], part_type]) if len(split) else 0
    id_rows = np.arange(first, first + int(rows["GroupLen"].sum()))
    _write_file(_file_name(path, me), rows, ids, header, parameters, id_rows)
    _sync("fof-table-ranks")
    return [_file_name(path, r) for r in range(count)]


def _write_file(path: str, table: dict[str, np.ndarray], ids: np.ndarray, header: dict[str, Any],
                parameters: Mapping[str, Any] | None, id_rows: np.ndarray) -> None:
    h5py = _h5py()
    tmp = path + ".partial"
    with h5py.File(tmp, "w") as f:
        attrs = f.create_group("Header").attrs
        attrs["Ngroups_ThisFile"] = np.uint64(len(table["GroupLen"]))
        attrs["Nsubhalos_ThisFile"] = np.uint64(0)
        attrs["Nids_ThisFile"] = np.uint64(len(id_rows))
        for name in ("Ngroups_Total", "Nsubhalos_Total", "Nids_Total"):
            attrs[name] = np.uint64(header[name])
        attrs["NumFiles"] = np.int32(header["NumFiles"])
        for name in ("Time", "Redshift", "BoxSize"):
            attrs[name] = np.float64(header[name]) if np.ndim(header[name]) == 0 else header[name]
        group = f.create_group("Group")
        for name in _GROUP_FIELDS:
            group.create_dataset(name, data=table[name])
        f.create_group("Subhalo")
        f.create_group("IDs").create_dataset("ID", data=ids[id_rows])
        if parameters:
            params = f.create_group("Parameters").attrs
            for key, value in parameters.items():
                params[key] = value
    os.replace(tmp, path)


def read_fof_table(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Read a group catalogue written by :func:`write_fof_table` (one file, or all files of a per-rank set).

    Args:
        path: the file; for a per-rank set, the ``path`` given to the writer or any one of its files.

    Returns:
        ``{"Header": {attributes}, "Group": {name: (G, ...) array}, "IDs": (Nids,) array, "Parameters": {...}}``,
        the files of a set concatenated in file order (``*_ThisFile`` counts are then the totals).

    Raises:
        FileNotFoundError: no such file or set.
        ValueError: a file of the set is missing or its counts do not add up.

    Example:
        >>> table = sx.io.read_fof_table("halos_out/fof_tab_000.hdf5")  # doctest: +SKIP
        >>> table["Group"]["GroupLen"][:3], table["IDs"][:5]  # doctest: +SKIP
    """
    path = os.fspath(path)
    files = [path]
    if not os.path.exists(path):
        first = _file_name(path, 0)
        if not os.path.exists(first):
            raise FileNotFoundError(f"{path} does not exist (nor the first file {first} of a per-rank set)")
        files = [first]
    with _open(files[0], "r") as f:
        if "Header" not in f or "Group" not in f:
            raise ValueError(f"{files[0]} is not a group catalogue (no Header or Group)")
        header = {k: np.asarray(v)[()] for k, v in f["Header"].attrs.items()}
    numfiles = int(header["NumFiles"])
    if numfiles > 1:
        base = files[0].rsplit(".", 2)[0]
        files = [f"{base}.{r}.hdf5" for r in range(numfiles)]
    groups: dict[str, list[np.ndarray]] = {name: [] for name in _GROUP_FIELDS}
    ids: list[np.ndarray] = []
    parameters: dict[str, Any] = {}
    for file in files:
        if not os.path.exists(file):
            raise ValueError(f"{file}, file of a {numfiles}-file group catalogue, is missing")
        with _open(file, "r") as f:
            for name in _GROUP_FIELDS:
                groups[name].append(np.asarray(f["Group"][name][()]))
            ids.append(np.asarray(f["IDs"]["ID"][()]))
            if "Parameters" in f:
                parameters = {k: np.asarray(v)[()] for k, v in f["Parameters"].attrs.items()}
    out_groups = {name: np.concatenate(parts) for name, parts in groups.items()}
    out_ids = np.concatenate(ids)
    if len(out_groups["GroupLen"]) != int(header["Ngroups_Total"]) or len(out_ids) != int(header["Nids_Total"]):
        raise ValueError(f"{path}: the files hold {len(out_groups['GroupLen'])} groups and {len(out_ids)} IDs, the "
                         f"header says {int(header['Ngroups_Total'])} and {int(header['Nids_Total'])}")
    header["Ngroups_ThisFile"], header["Nids_ThisFile"] = header["Ngroups_Total"], header["Nids_Total"]
    return {"Header": header, "Group": out_groups, "IDs": out_ids, "Parameters": parameters}
