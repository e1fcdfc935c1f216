"""Moving all per-particle fields of a particle pytree together: its row leaves, gathered, exchanged, put back.

A particle pytree usually has several fields (positions, ids, masses, velocities). They are exchanged together:
one count exchange for all of them, and each round of the exchange packs the rows of every 32- and 64-bit field
into the columns of one uint32 block, so one ``all_to_all`` per round moves them all (fields of other widths, such
as bool or int8, travel as separate blocks). Only a round's rows are ever packed, never whole arrays, so moving the
fields costs no packed copy of the particle data.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from .._pytree import is_row_leaf, with_num
from ..comm._alltoallv import alltoallv_many
from ..core import resolve_axes


class RowLeaves:
    """The per-particle leaves of a particle pytree (leading length ``n``, other than ``num``), and the way back."""

    def __init__(self, part: Any, n: int):
        leaves, self.treedef = jax.tree.flatten(part)
        self.leaves = leaves
        num = part.num
        self.rows = [i for i, leaf in enumerate(leaves) if leaf is not num and is_row_leaf(leaf, n)]

    def arrays(self) -> list[jax.Array]:
        """The arrays to move, in a fixed order."""
        return [jnp.asarray(self.leaves[i]) for i in self.rows]

    def unpack(self, arrays: list[jax.Array], num: jax.Array) -> Any:
        """The pytree rebuilt from moved ``arrays`` (same order as :meth:`arrays`) with ``num`` valid rows."""
        leaves = list(self.leaves)
        for i, a in zip(self.rows, arrays, strict=True):
            leaves[i] = a
        return with_num(jax.tree.unflatten(self.treedef, leaves), num)


def take_rows(arrays: list[jax.Array], perm: jax.Array) -> list[jax.Array]:
    """Every array's rows in the order ``perm``."""
    # Indices are never negative: no wrapped copy of ``perm``.
    return [a.at[perm].get(mode="clip", wrap_negative_indices=False) for a in arrays]


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


def send_rows(arrays: list[jax.Array], send_counts: jax.Array, capacity: int, *, perm: jax.Array | None = None,
              recv_at: jax.Array | None = None, init: list[jax.Array] | None = None,
              target: jax.Array | None = None, row_maps: list[Any] | None = None, chunk: int | None = None,
              plan: tuple[jax.Array, jax.Array] | None = None) -> tuple[list[jax.Array], jax.Array]:
    """``alltoallv`` of every array with the same ``send_counts`` (one count exchange, and one ``all_to_all`` per
    round for all 4- and 8-byte arrays together); returns the arrays and the rows received from each rank
    (`(size,)` int32).

    ``perm``: send ``a[perm]`` without building it. ``recv_at``: `(size,)` row where each source's block starts
    (default packed in rank order). ``init``: the buffers received rows are written into (default zeros).
    ``target``: `(n,)` int32 row of the receiver each sent row goes to (aligned with the send order, i.e. with
    ``perm`` when given; sent along; rows outside ``[0, capacity)`` are dropped), instead of blocks packed by source. ``row_maps``: per array, ``None``
    or an elementwise function applied to its rows on the way. ``chunk``: rows per rank pair and round (default
    :func:`shardax.comm._alltoallv.default_chunk`). ``plan``: ``(recv_counts, largest)`` when the caller already knows
    them (the rows each rank sends me, and the largest count any rank sends any rank): no count exchange then.
    """
    outs, recv, _ = alltoallv_many(arrays, send_counts, capacity, resolve_axes(None), "auto", chunk, perm=perm,
                                    recv_at=recv_at, init=init, target=target, row_maps=row_maps, plan=plan)
    return outs, recv
