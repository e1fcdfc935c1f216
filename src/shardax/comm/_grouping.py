"""Counting and grouping rows by destination rank: how a send buffer for :func:`~shardax.comm.alltoallv` is built.

An ``MPI_Alltoallv`` sends rows grouped by destination, with one count per destination. :func:`count_by_rank` gives
the counts; :func:`group_by_rank` gives the counts and the permutation that packs the rows in that order (each
group in row order, so the exchange is deterministic). Both are local (no communication) and work on any backend.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from .._hostsort import sort
from .._tuning import tuning_backend

#: Up to this many ranks :func:`count_by_rank` compares every row with every rank in one fused pass; beyond, it sorts.
COMPARE_RANKS = 16


def _check_key(key: Any, size: Any, where: str) -> jax.Array:
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise ValueError(f"{where}: size must be a positive Python int (the number of ranks), got {size!r}")
    key = jnp.asarray(key)
    if key.ndim != 1:
        raise ValueError(f"{where}: key must have shape (n,) (one destination rank per row), got shape {key.shape}")
    if not jnp.issubdtype(key.dtype, jnp.integer):
        raise TypeError(f"{where}: key must be an integer array of ranks, got dtype {key.dtype}; cast it with "
                        f"key.astype(jnp.int32)")
    return key


def count_by_rank(key: jax.Array, size: int) -> jax.Array:
    """How many rows go to each rank: the ``send_counts`` of an :func:`~shardax.comm.alltoallv`.

    Args:
        key: `(n,)` int destination rank of each row; entries outside ``[0, size)`` are not counted (mark rows
            that stay with ``size``).
        size: the number of ranks (a Python int).

    Returns:
        `(size,)` int32: entry ``r`` is the number of entries of ``key`` equal to ``r``.

    On GPUs no scatter-add: a histogram of many rows into a few bins piles every add onto the same addresses, which
    GPUs serialise (10^7 rows into one bin take far longer than a sort of them). Up to :data:`COMPARE_RANKS` ranks,
    one fused compare-and-sum pass over the rows; beyond, a sort of the keys and a binary search for each rank's
    first row. XLA:CPU adds the rows one after another (no contention) and would hold the compared `(n, size)`
    block in memory, so the CPU preset (:func:`shardax.runtime.tuning_backend`) keeps the scatter-add.

    Example:
        >>> import jax.numpy as jnp, shardax as sx
        >>> sx.comm.count_by_rank(jnp.array([2, 0, 2, 5, 2]), 3).tolist()
        [1, 0, 3]
    """
    key = _check_key(key, size, "count_by_rank").astype(jnp.int32)
    if tuning_backend() == "cpu":
        return jnp.zeros((size + 1,), jnp.int32).at[jnp.where((key >= 0) & (key < size), key, size)].add(1)[:size]
    if size <= COMPARE_RANKS:
        ranks = jnp.arange(size, dtype=jnp.int32)
        return jnp.sum(key[:, None] == ranks[None, :], axis=0, dtype=jnp.int32)
    return _sorted_counts(lax.sort(key), size, 1)


def _sorted_counts(words: jax.Array, size: int, n: int) -> jax.Array:
    """Rows of each rank in ascending ``words`` whose rank is ``word // n`` (words ``>= size * n`` not counted).

    A binary search per rank: a loop of ``log2(len(words))`` small steps on CPU; on GPUs, where each loop step is
    a launch, one fused compare-and-sum pass for a few ranks, a sort of the queries into the words for many."""
    method = "scan" if tuning_backend() == "cpu" else "compare_all" if size < COMPARE_RANKS else "sort"
    bounds = jnp.searchsorted(words, jnp.arange(size + 1, dtype=words.dtype) * n, side="left", method=method)
    return jnp.diff(bounds).astype(jnp.int32)


def group_by_rank(key: jax.Array, size: int, *, host: bool = False) -> tuple[jax.Array, jax.Array]:
    """The permutation that packs rows by destination rank, and the rows for each rank: an alltoallv's send buffer.

    Args:
        key: `(n,)` int destination rank of each row, in ``[0, size]``: ``size`` marks a row that is not sent (it
            goes after all groups and is not counted).
        size: the number of ranks (a Python int).
        host: sort with NumPy in a host callback on CPU devices (faster for large ``n``; the program then holds a
            host callback). Results are the same bits either way.

    Returns:
        ``(perm, counts)``: ``perm`` `(n,)` int32, ``x[perm]`` holds the rows for rank 0, then those for rank 1, and
        so on (each group in row order), then the rows not sent; ``counts`` `(size,)` int32 rows for each rank.
        ``x[perm]`` and ``counts`` are the arguments :func:`~shardax.comm.alltoallv` takes.

    One sort of a single int32 word ``key * n + row`` (XLA:CPU sorts one operand several times faster than a key
    with a payload); a stable argsort when that word would overflow. The counts come from the sorted keys (a
    binary search per rank, no histogram).

    Example:
        >>> import jax.numpy as jnp, shardax as sx
        >>> perm, counts = sx.comm.group_by_rank(jnp.array([1, 0, 2, 1, 0]), 2)   # the row of key 2 is not sent
        >>> perm.tolist(), counts.tolist()
        ([1, 4, 0, 3, 2], [2, 2])
        >>> # inside smap: sx.comm.alltoallv(x[perm], counts, capacity=...)
    """
    key = _check_key(key, size, "group_by_rank")
    n = key.shape[0]
    if (size + 1) * n < 2**31:
        word = key.astype(jnp.int32) * n + jnp.arange(n, dtype=jnp.int32)
        ordered = sort(word) if host else lax.sort(word)
        return ordered % n, _sorted_counts(ordered, size, n)
    perm = jnp.argsort(key, stable=True).astype(jnp.int32)
    return perm, _sorted_counts(key.astype(jnp.int32)[perm], size, 1)
