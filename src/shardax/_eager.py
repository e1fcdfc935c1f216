"""Local views called outside any trace run as one compiled program.

Called with concrete arrays outside ``jax.jit`` and ``smap``, a local view such as ``sx.spatial.fof`` would run
operation by operation: every operation dispatched (and compiled, the first time) on its own. The local views whose
work is many small operations (FoF, the z-order sort, kNN) pass such calls to :func:`run_compiled` instead, after
their argument checks (which need the concrete values). Inside a trace they run as they are, part of the caller's
program.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from jax.core import Tracer

_ARRAY_LEAVES = (jax.Array, np.ndarray, np.generic, bool, int, float)


def is_concrete(tree: Any) -> bool:
    """Whether every leaf of ``tree`` is a concrete array or number (no tracer): a call outside any trace."""
    leaves = jax.tree.leaves(tree)
    return all(isinstance(leaf, _ARRAY_LEAVES) and not isinstance(leaf, Tracer) for leaf in leaves)


def _canonical(value: Any) -> Any:
    """A hashable stand-in for a static value: arrays and lists by their contents, tuples element by element."""
    if isinstance(value, np.ndarray | np.generic | jax.Array):
        host = np.asarray(value)
        return ("array", host.shape, host.dtype.str, host.tobytes())
    if isinstance(value, list):
        return ("list", *(_canonical(v) for v in value))
    if isinstance(value, tuple):  # NamedTuples too (their type tells two with equal fields apart)
        return (type(value).__qualname__, *(_canonical(v) for v in value))
    return value


class _Static:
    """A static value with a hash and equality over its :func:`_canonical` form (the value itself is kept)."""

    __slots__ = ("key", "value")

    def __init__(self, value: Any) -> None:
        self.value = value
        self.key = _canonical(value)

    def __hash__(self) -> int:
        return hash(self.key)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Static) and self.key == other.key


def run_compiled(fn: Callable[[Any, Any], Any], arrays: Any, static: Any) -> Any:
    """``fn(arrays, static)`` as one ``jax.jit`` program, compiled once per ``fn``, ``static`` value and argument
    shapes (``fn`` must be a module-level function, so that it is the same object from call to call).

    Args:
        fn: the computation; ``arrays`` arrive traced, ``static`` as given.
        arrays: a pytree of arrays (or numbers): the program's arguments.
        static: the options the program is specialised on (anything hashable, or arrays and lists, compared by
            content).
    """
    return _program(fn, _Static(static))(arrays)


@functools.lru_cache(maxsize=128)
def _program(fn: Callable[[Any, Any], Any], static: _Static) -> Callable[[Any], Any]:
    return jax.jit(lambda arrays: fn(arrays, static.value))
