"""Partition specs for ``smap``: the ``ALL`` marker, resolution on a mesh, broadcasting over pytrees, shape checks."""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, PartitionSpec


class _AllAxes:
    """Marker for "every mesh axis" in a PartitionSpec entry or as a whole spec (also spelled ``-1``)."""

    _instance: _AllAxes | None = None

    def __new__(cls) -> _AllAxes:
        if cls._instance is None:
            cls._instance = super().__new__(cls)
        return cls._instance

    def __repr__(self) -> str:
        return "ALL"

    def __reduce__(self):
        return (_AllAxes, ())


ALL = _AllAxes()


def _is_all(entry: Any) -> bool:
    """Whether ``entry`` means every mesh axis (``ALL`` or ``-1``)."""
    return entry is ALL or (isinstance(entry, int) and not isinstance(entry, bool) and entry == -1)


def is_spec(x: Any) -> bool:
    """A spec in a spec prefix tree: ``None`` (static or replicated), a ``PartitionSpec``, ``ALL`` or ``-1``."""
    return x is None or isinstance(x, PartitionSpec) or _is_all(x)


def _is_spec_value(x: Any) -> bool:
    """A spec in a full (broadcast) spec tree, where ``None`` is an empty subtree (a ``None`` field), not a spec."""
    return isinstance(x, PartitionSpec) or _is_all(x)


def is_pspec(x: Any) -> bool:
    """A resolved ``PartitionSpec`` (the leaves of a resolved spec tree)."""
    return isinstance(x, PartitionSpec)


def resolve_spec(spec: Any, mesh: Mesh, where: str) -> PartitionSpec:
    """``spec`` with ``ALL``/``-1`` replaced by every axis of ``mesh``; unknown axis names are an error."""
    axes = tuple(mesh.axis_names)
    if _is_all(spec):
        return PartitionSpec(axes)
    if not isinstance(spec, PartitionSpec):
        raise TypeError(f"{where}: expected a PartitionSpec, sx.ALL or None, got {spec!r}")
    entries = []
    used: set[str] = set()
    for entry in spec:
        if _is_all(entry):
            entry = axes
        if entry is None or entry is PartitionSpec.UNCONSTRAINED:
            entries.append(entry)
            continue
        if isinstance(entry, str):
            names: tuple = (entry,)
        elif isinstance(entry, tuple | list) and all(isinstance(n, str) for n in entry):
            names = tuple(entry)
        else:
            raise TypeError(f"{where}: spec {spec} has entry {entry!r}; entries must be None, a mesh axis name, a "
                            "tuple of names, or sx.ALL / -1")
        for name in names:
            if name not in axes:
                raise ValueError(f"{where}: spec {spec} names mesh axis {name!r}, but the mesh has axes {axes}")
            if name in used:
                raise ValueError(f"{where}: spec {spec} uses mesh axis {name!r} for two dimensions; each mesh axis "
                                 "may split at most one dimension")
            used.add(name)
        entries.append(entry)
    return PartitionSpec(*entries)


def resolve_or_replicated(spec: Any, mesh: Mesh, where: str) -> PartitionSpec:
    """:func:`resolve_spec`, with ``None`` read as replicated (``P()``)."""
    return resolve_spec(PartitionSpec() if spec is None else spec, mesh, where)


def _spec_axes(entry: Any) -> tuple[str, ...]:
    """The mesh axes of one resolved spec entry."""
    if entry is None:
        return ()
    return (entry,) if isinstance(entry, str) else tuple(entry)


def broadcast_specs(specs: Any, tree: Any, where: str) -> Any:
    """Specs as a full tree matching ``tree`` (``specs`` is a prefix of it)."""
    try:
        return jax.tree.map(lambda s, sub: jax.tree.map(lambda _: PartitionSpec() if s is None else s, sub),
                            specs, tree, is_leaf=is_spec)
    except ValueError as err:
        raise ValueError(f"{where} does not match the structure of the value: {err}") from None


def resolved_tree(specs: Any, tree: Any, mesh: Mesh, where: str) -> Any:
    """``specs`` broadcast over ``tree`` and resolved on ``mesh``: one ``PartitionSpec`` per leaf of ``tree``."""
    full = broadcast_specs(specs, tree, where)
    return jax.tree.map(lambda s: resolve_or_replicated(s, mesh, where), full, is_leaf=_is_spec_value)


def _check_leaf(x: Any, spec: PartitionSpec, mesh: Mesh, where: str, expand: bool) -> None:
    """Raise if array ``x`` cannot be split as ``spec`` says on ``mesh``."""
    shape = np.shape(x)
    if len(spec) > len(shape):
        raise ValueError(f"{where} has shape {shape} (rank {len(shape)}) but its spec {spec} has {len(spec)} "
                         "entries; a spec may not be longer than the array's rank")
    for dim, entry in enumerate(spec):
        axes = _spec_axes(entry)
        if not axes:
            continue
        parts = int(np.prod([mesh.shape[a] for a in axes]))
        if expand and dim == 0:
            if shape[0] != parts:
                raise ValueError(
                    f"{where} has shape {shape}; with expand=True its leading axis must be the number of shards "
                    f"along {axes} ({parts}), one row per device. Pass expand=False for plain shard_map tiling, "
                    "or reshape it to (ndev, n, ...).")
        elif shape[dim] % parts:
            raise ValueError(f"{where} maps array axis {dim} (of size {shape[dim]}) to mesh axes {axes} (of size "
                             f"{parts}), but {parts} does not evenly divide {shape[dim]}")


def argument_specs(arg: Any, spec: Any, mesh: Mesh, expand: bool, where: str) -> Any:
    """``spec`` broadcast over ``arg``'s pytree and resolved on ``mesh``, each leaf checked against its spec."""
    full = resolved_tree(spec, arg, mesh, f"in_specs for {where}")
    leaves = jax.tree.leaves(arg)
    spec_leaves = jax.tree.leaves(full, is_leaf=is_pspec)
    for j, (leaf, sp) in enumerate(zip(leaves, spec_leaves, strict=True)):
        _check_leaf(leaf, sp, mesh, where if len(leaves) == 1 else f"leaf {j} of {where}", expand)
    return full


def squeeze_leading(spec: PartitionSpec, a: jax.Array) -> jax.Array:
    """``a`` without its leading (device) axis if ``spec`` splits it: the expanding convention's input side."""
    return a.reshape(a.shape[1:]) if spec and spec[0] is not None else a


def expand_leading(spec: PartitionSpec, a: jax.Array) -> jax.Array:
    """``a`` with a leading axis of one if ``spec`` splits it: the expanding convention's output side."""
    return jax.numpy.reshape(a, (1, *jax.numpy.shape(a))) if spec and spec[0] is not None else a
