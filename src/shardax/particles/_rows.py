"""Moving all per-particle fields at once: pack them into one uint32 matrix, permute or exchange it, unpack.

A particle pytree usually has several fields (positions, ids, masses, velocities). Gathering or exchanging them one by
one costs one gather (or one ``alltoallv``, with its count exchange) per field; packing every 32- and 64-bit field
into the columns of a single ``(n, C)`` uint32 matrix makes it one. Fields of other widths (bool, int8, float16) are
moved as separate arrays.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from ..comm import alltoallv
from ._particles import is_row_leaf, with_num


class RowPack:
    """The per-particle leaves of a particle pytree, as one uint32 matrix plus the leaves that do not fit in it.
    """

    def __init__(self, part: Any, n: int):
        leaves, self.treedef = jax.tree.flatten(part)
        self.leaves = leaves
        num = part.num
        self.rows = [i for i, leaf in enumerate(leaves) if leaf is not num and is_row_leaf(leaf, n)]
        self.packed: list[int] = []
        self.loose: list[int] = []
        self.columns: list[tuple[int, int]] = []
        arrays = []
        col = 0
        for i in self.rows:
            a = jnp.asarray(leaves[i])
            if a.dtype.itemsize in (4, 8):
                words = lax.bitcast_convert_type(a, jnp.uint32).reshape(n, -1)
                self.packed.append(i)
                self.columns.append((col, col + words.shape[1]))
                col += words.shape[1]
                arrays.append(words)
            else:
                self.loose.append(i)
        self.matrix = jnp.concatenate(arrays, axis=1) if arrays else None
        self.extra = [jnp.asarray(leaves[i]) for i in self.loose]

    def arrays(self) -> list[jax.Array]:
        """The arrays to move: the packed matrix (if any) and the loose leaves."""
        return ([] if self.matrix is None else [self.matrix]) + self.extra

    def unpack(self, arrays: list[jax.Array], num: jax.Array) -> Any:
        """The pytree rebuilt from moved ``arrays`` (same order as :meth:`arrays`) with ``num`` valid rows."""
        leaves = list(self.leaves)
        it = iter(arrays)
        if self.matrix is not None:
            matrix = next(it)
            m = matrix.shape[0]
            for i, (start, stop) in zip(self.packed, self.columns, strict=True):
                old = jnp.asarray(leaves[i])
                words = matrix[:, start:stop]
                if old.dtype.itemsize == 8:
                    words = words.reshape(m, *old.shape[1:], 2)
                else:
                    words = words.reshape(m, *old.shape[1:])
                leaves[i] = lax.bitcast_convert_type(words, old.dtype)
        for i in self.loose:
            leaves[i] = next(it)
        return with_num(jax.tree.unflatten(self.treedef, leaves), num)


def take_rows(arrays: list[jax.Array], perm: jax.Array) -> list[jax.Array]:
    """Every array's rows in the order ``perm``."""
    return [jnp.take(a, perm, axis=0, mode="clip") for a in arrays]


def resize_rows(arrays: list[jax.Array], capacity: int) -> list[jax.Array]:
    """Every array truncated or zero-padded to ``capacity`` rows."""
    out = []
    for a in arrays:
        n = a.shape[0]
        if capacity <= n:
            out.append(a[:capacity])
        else:
            out.append(jnp.concatenate([a, jnp.zeros((capacity - n, *a.shape[1:]), a.dtype)]))
    return out


def send_rows(arrays: list[jax.Array], send_counts: jax.Array, capacity: int
              ) -> tuple[list[jax.Array], jax.Array]:
    """``alltoallv`` of every array with the same ``send_counts``; returns the arrays and the rows received from
    each rank (`(size,)` int32)."""
    outs = []
    recv = jnp.zeros(send_counts.shape, jnp.int32)
    for a in arrays:
        data, recv, _ = alltoallv(a, send_counts, capacity=capacity)
        outs.append(data)
    return outs, recv
