"""The program guard's view of one ``smap`` function: its fingerprint and the signatures it has been called with."""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh

from .._fingerprint import function_items, value_item
from .._guard import Details, Program, call_site, guard_call


def describe_arg(value: Any) -> str:
    """``float32(4, 1024)``, or ``{.pos: float32(4, 100, 3), ...}`` for a pytree."""
    leaves = jax.tree_util.tree_leaves_with_path(value)
    parts = []
    for path, leaf in leaves:
        dtype = getattr(leaf, "dtype", None)
        dtype = np.dtype(dtype).name if dtype is not None else type(leaf).__name__
        where = jax.tree_util.keystr(path)
        parts.append(f"{where + ': ' if where else ''}{dtype}{tuple(np.shape(leaf))}")
    if len(parts) == 1 and not jax.tree_util.keystr(leaves[0][0]):
        return parts[0]
    return "{" + ", ".join(parts) + "}"


def leaf_signature(leaf: Any) -> tuple:
    """``(shape, dtype)`` of an array leaf, ``(shape, type name)`` of a Python scalar."""
    try:
        return leaf.shape, leaf.dtype
    except AttributeError:  # a Python scalar
        return np.shape(leaf), type(leaf).__name__


class Guarded:
    """Checks each new signature of one smap function with the other processes (:mod:`shardax._guard`).

    Args:
        f: the user's function, as written (its fingerprint is what the processes compare).
        name: how messages name it; ``None``: the public shardax function the user called, else ``f``'s qualified
            name.
        param_names: names of ``f``'s positional parameters, for static arguments and array descriptions.
        arg_name: ``i -> "argument 'x' of step"``.
    """

    def __init__(self, f: Callable[..., Any], name: str | None, param_names: Sequence[str],
                 arg_name: Callable[[int], str]):
        self._f = f
        self._name = name
        self._qualname = f"{getattr(f, '__module__', '?')}.{getattr(f, '__qualname__', repr(f))}"
        self._params = tuple(param_names)
        self._arg_name = arg_name
        self._programs: dict[Hashable, Program] = {}

    def check(self, key: Hashable, args: tuple, static: tuple[int, ...], shapes: tuple, mesh: Mesh, *,
              traced: bool) -> None:
        """Guard one call: ``key`` is smap's cache key (mesh, static values, structure), ``shapes`` the
        :func:`leaf_signature` of each array leaf (they complete the signature). Steady state: two dictionary
        lookups."""
        _, digest = function_items(self._f)
        program_key = (digest, key, shapes)
        program = self._programs.get(program_key)
        if program is None:
            program = self._programs[program_key] = self._program(program_key, args, static, mesh)
        guard_call(program, traced=traced)

    def _program(self, key: Hashable, args: tuple, static: tuple[int, ...], mesh: Mesh) -> Program:
        # Described now, once per signature: the Program must not keep the arrays alive.
        arguments = tuple((self._arg_name(i), describe_arg(args[i])) for i in range(len(args)) if i not in static)
        statics = tuple((self._params[i] if i < len(self._params) else f"argument {i}", args[i]) for i in static)
        mesh_text = f"{dict(mesh.shape)}"
        shown = self._name or self._qualname

        def details() -> Details:
            entry, where = call_site()
            items = function_items(self._f)[0] + tuple(value_item(label, v) for label, v in statics)
            return Details(self._name or entry or self._qualname, where, items, arguments, mesh_text)

        return Program(key, f"{shown}({', '.join(f'{n} {d}' for n, d in arguments)})", details)
