"""Pytrees to and from HDF5: one shared file written by every process in rank order, or one file per rank + index.

Every leaf becomes a dataset named by its pytree path (``pos``, ``catalogue/count``). A global ``jax.Array`` is
written from the shards each process holds (rows of the leading axis); host arrays (NumPy, Python scalars) are
taken to be the same on every process and written once. Files are written under a temporary name and renamed when
complete, and carry a ``shardax_complete`` attribute: a write that fails midway never leaves a file that reads as
complete.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils

FORMAT = "shardax-pytree-1"
COMPLETE = "shardax_complete"


def _h5py() -> Any:
    try:
        import h5py
    except ImportError as err:  # pragma: no cover - depends on the installation
        raise ImportError("shardax.io needs h5py: pip install 'shardax[hdf5]'") from err
    return h5py


def _key_name(key: Any) -> str:
    for attr in ("name", "key", "idx"):
        if hasattr(key, attr):
            return str(getattr(key, attr))
    return str(key)


def _flatten(tree: Any) -> list[tuple[str, Any]]:
    leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    if not leaves:
        raise ValueError("write: the tree has no array leaves to write")
    out = []
    for path, leaf in leaves:
        name = "/".join(_key_name(k) for k in path) or "value"
        out.append((name, leaf))
    return out


def _sync(tag: str) -> None:
    if jax.process_count() > 1:
        multihost_utils.sync_global_devices(f"shardax.io:{tag}")


def _pieces(name: str, leaf: Any) -> list[tuple[int, np.ndarray]]:
    """This process's ``(first row, block)`` pieces of ``leaf`` (host leaves: the whole leaf, on process 0)."""
    if isinstance(leaf, jax.Array) and not leaf.is_fully_addressable:
        pieces: dict[int, np.ndarray] = {}
        for shard in leaf.addressable_shards:
            index = shard.index
            if any(sl != slice(None) and (sl.start, sl.stop) != (0, dim) for sl, dim in
                   zip(index[1:], leaf.shape[1:], strict=True)):
                raise ValueError(f"write: leaf {name!r} is sharded along a trailing axis; only the leading axis "
                                 "may be split over processes (reshard it first)")
            start = (index[0].start or 0) if leaf.ndim else 0
            pieces.setdefault(start, np.asarray(shard.data))
        return sorted(pieces.items())
    return [(0, np.asarray(leaf))] if jax.process_index() == 0 else []


@contextlib.contextmanager
def _open(path: str, mode: str) -> Iterator[Any]:
    h5py = _h5py()
    try:
        handle = h5py.File(path, mode)
    except OSError as err:
        if mode == "r" and os.path.exists(path):
            raise ValueError(f"{path} is not a readable HDF5 file (truncated or corrupt?): {err}") from err
        raise
    with handle:
        yield handle


def write(path: str | os.PathLike[str], tree: Any, *, per_rank: bool = False) -> list[str]:
    """Write a pytree of arrays to HDF5 (collective: call it on every process).

    Args:
        path: the file to write (with ``per_rank``: the index file; rank files go next to it as
            ``<path stem>.rank<p>.h5``).
        tree: a pytree of arrays: global ``jax.Array`` s (each process writes the rows it holds), NumPy arrays or
            scalars (the same on every process, written once), e.g. a :class:`shardax.particles.Particles` or a
            :class:`shardax.spatial.Catalogue` in the global view.
        per_rank: one file per process plus a small index, instead of one shared file written in rank order.

    Returns:
        The files written (the shared file, or the index followed by the rank files).

    Example:
        >>> import numpy as np, shardax as sx
        >>> files = sx.io.write("/tmp/shardax_doc.h5", {"x": np.arange(4)})
        >>> sx.io.read("/tmp/shardax_doc.h5")["x"].tolist()
        [0, 1, 2, 3]
    """
    path = os.fspath(path)
    if not isinstance(per_rank, bool):
        raise TypeError(f"per_rank must be a bool, got {per_rank!r}")
    leaves = _flatten(tree)
    shapes = {name: tuple(int(s) for s in np.shape(leaf)) for name, leaf in leaves}
    dtypes = {name: np.dtype(leaf.dtype if hasattr(leaf, "dtype") else np.asarray(leaf).dtype)
              for name, leaf in leaves}
    me, count = jax.process_index(), jax.process_count()
    if per_rank:
        return _write_per_rank(path, leaves, shapes, dtypes, me, count)
    tmp = f"{path}.partial"
    try:
        for rank in range(count):
            if rank == me:
                _write_shared_part(tmp, leaves, shapes, dtypes, first=rank == 0, last=rank == count - 1)
            _sync(f"write-{rank}")
        if me == 0:
            os.replace(tmp, path)
    except BaseException:
        if me == 0 and os.path.exists(tmp):
            os.remove(tmp)
        raise
    _sync("write-done")
    return [path]


def _write_shared_part(tmp: str, leaves: list[tuple[str, Any]], shapes: dict[str, tuple[int, ...]],
                       dtypes: dict[str, np.dtype], *, first: bool, last: bool) -> None:
    """This process's rows of the shared file (the first process creates the datasets, the last marks it done)."""
    with _open(tmp, "w" if first else "r+") as f:
        if first:
            f.attrs["format"] = FORMAT
            f.attrs[COMPLETE] = False
            for name in shapes:
                f.create_dataset(name, shape=shapes[name], dtype=dtypes[name])
        for name, leaf in leaves:
            for start, block in _pieces(name, leaf):
                if block.ndim == 0:
                    f[name][()] = block
                else:
                    f[name][start:start + block.shape[0]] = block
        if last:
            f.attrs[COMPLETE] = True


def _rank_file(path: str, rank: int) -> str:
    stem = path[:-3] if path.endswith(".h5") else path
    return f"{stem}.rank{rank}.h5"


def _write_per_rank(path: str, leaves: list[tuple[str, Any]], shapes: dict[str, tuple[int, ...]],
                    dtypes: dict[str, np.dtype], me: int, count: int) -> list[str]:
    mine = _rank_file(path, me)
    with _open(mine + ".partial", "w") as f:
        f.attrs["format"] = FORMAT
        f.attrs["rank"] = me
        for name, leaf in leaves:
            pieces = _pieces(name, leaf)
            if not shapes[name]:
                if pieces:
                    f.create_dataset(name, data=pieces[0][1])
                continue
            blocks = [b for _, b in pieces]
            starts = [s for s, _ in pieces]
            data = np.concatenate(blocks) if blocks else np.zeros((0, *shapes[name][1:]), dtypes[name])
            f.create_dataset(name, data=data)
            f[name].attrs["starts"] = np.asarray(starts, np.int64)
            f[name].attrs["lengths"] = np.asarray([b.shape[0] for b in blocks], np.int64)
        f.attrs[COMPLETE] = True
    os.replace(mine + ".partial", mine)
    _sync("write-rank-files")
    files = [_rank_file(path, r) for r in range(count)]
    if me == 0:
        with _open(path + ".partial", "w") as f:
            f.attrs["format"] = FORMAT
            f.attrs["per_rank"] = True
            f.attrs["files"] = np.asarray([os.path.basename(x) for x in files], dtype=object)
            for name in shapes:
                f.create_dataset(name, shape=(0,), dtype=dtypes[name])
                f[name].attrs["shape"] = np.asarray(shapes[name], np.int64)
            f.attrs[COMPLETE] = True
        os.replace(path + ".partial", path)
    _sync("write-index")
    return [path, *files]


def _check_complete(f: Any, path: str) -> None:
    if f.attrs.get("format") != FORMAT:
        raise ValueError(f"{path} was not written by shardax.io.write (no '{FORMAT}' format attribute)")
    if not bool(f.attrs.get(COMPLETE, False)):
        raise ValueError(f"{path} is incomplete: the write that made it did not finish; write it again")


def _names(f: Any) -> list[str]:
    out: list[str] = []
    f.visititems(lambda name, obj: out.append(name) if hasattr(obj, "shape") else None)
    return out


def _nest(flat: dict[str, np.ndarray]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, value in flat.items():
        node = out
        *parents, last = name.split("/")
        for p in parents:
            node = node.setdefault(p, {})
        node[last] = value
    return out


def read(path: str | os.PathLike[str], *, like: Any = None) -> Any:
    """Read a file written by :func:`write` (the shared file or the index of per-rank files) into host arrays.

    Args:
        path: the file :func:`write` was given.
        like: optional pytree of the written structure (e.g. the tree that was written): the result then has the
            same structure, with NumPy leaves. Without it, a nested ``dict`` keyed by the pytree path.

    Returns:
        The pytree with NumPy arrays of the global shapes.

    Raises:
        ValueError: the file is missing pieces, truncated, corrupt, was never completed, or does not match ``like``.
    """
    path = os.fspath(path)
    if not os.path.exists(path):
        raise FileNotFoundError(f"{path} does not exist")
    flat: dict[str, np.ndarray] = {}
    with _open(path, "r") as f:
        _check_complete(f, path)
        if bool(f.attrs.get("per_rank", False)):
            files = [os.path.join(os.path.dirname(path), str(x.decode() if isinstance(x, bytes) else x))
                     for x in f.attrs["files"]]
            shapes = {name: tuple(int(s) for s in f[name].attrs["shape"]) for name in _names(f)}
            dtypes = {name: f[name].dtype for name in shapes}
            flat = _read_rank_files(files, shapes, dtypes)
        else:
            for name in _names(f):
                flat[name] = np.asarray(f[name][()])
    if like is None:
        return _nest(flat)
    names = [name for name, _ in _flatten(like)]
    missing = [n for n in names if n not in flat]
    if missing or len(names) != len(flat):
        raise ValueError(f"{path} holds {sorted(flat)}, which does not match the structure of `like` ({names})")
    return jax.tree.unflatten(jax.tree.structure(like), [flat[n] for n in names])


def _read_rank_files(files: list[str], shapes: dict[str, tuple[int, ...]],
                     dtypes: dict[str, np.dtype]) -> dict[str, np.ndarray]:
    out = {name: np.zeros(shape, dtypes[name]) for name, shape in shapes.items()}
    filled = {name: 0 for name in shapes}
    for file in files:
        if not os.path.exists(file):
            raise ValueError(f"rank file {file} listed in the index is missing")
        with _open(file, "r") as f:
            _check_complete(f, file)
            for name, shape in shapes.items():
                if not shape:
                    if name in f:
                        out[name] = np.asarray(f[name][()])
                        filled[name] = 1
                    continue
                if name not in f:
                    raise ValueError(f"rank file {file} has no dataset {name!r}")
                data = np.asarray(f[name][()])
                at = 0
                for start, length in zip(f[name].attrs["starts"], f[name].attrs["lengths"], strict=True):
                    if start + length > shape[0] or data.shape[1:] != shape[1:]:
                        raise ValueError(f"{file}: dataset {name!r} rows {start}:{start + length} of shape "
                                         f"{data.shape} do not fit the global shape {shape}")
                    out[name][start:start + length] = data[at:at + length]
                    at += int(length)
                    filled[name] += int(length)
    for name, shape in shapes.items():
        expected = shape[0] if shape else 1
        if filled[name] != expected:
            raise ValueError(f"dataset {name!r}: the rank files hold {filled[name]} of {expected} rows")
    return out
