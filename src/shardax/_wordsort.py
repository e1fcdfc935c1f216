"""Stable argsort of 64-bit keys given as two uint32 words, built on single-operand 64-bit sorts.

XLA:CPU sorts one array of a builtin type with ``std::sort`` and a native comparison, but sorts several arrays
(keys plus an index payload) through a compiled comparator called once per comparison: 4-5x slower (1e6 keys:
~60 ms vs ~250-350 ms). So the row index is packed into the low bits of one uint64 together with the top bits of the
key, and that single array is sorted. A scoped ``jax.enable_x64`` gives the uint64 type inside this function only;
inputs and outputs are 32-bit and the global configuration is untouched.

With ``b`` index bits (``2**b >= n``) the first pass orders rows by the top ``64 - b`` key bits. Rows whose top bits
tie but whose low bits differ (rare for distinct positions) are refined by a second pass over ``(group start, low b
key bits, position)``, run only when such rows exist (``b <= 21``, ``n <= 2**21``). Rows whose whole keys are equal
(duplicates, and the padding rows, which all carry the invalid key) are already in row order after the first pass.
Larger arrays use two LSD passes.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import lax

from ._hostsort import sort as _host_sort

_MSD_MAX_BITS = 21


def _index_bits(n: int) -> int:
    return max(1, (n - 1).bit_length())


def argsort_keys(hi: jax.Array, lo: jax.Array, *, host: bool = True) -> jax.Array:
    """Stable argsort of the 64-bit keys ``hi * 2**32 + lo``.

    Args:
        hi: `(n,)` uint32 high words.
        lo: `(n,)` uint32 low words.
        host: on CPU devices, sort by NumPy (:mod:`shardax._hostsort`, 4-15x faster than XLA:CPU); it holds the
            sorted words next to the unsorted ones, 8 bytes per row more than XLA's sort in place, so ``False``
            keeps XLA's sort where that matters for the peak memory.

    Returns:
        `(n,)` int32 permutation: ``key[perm]`` is ascending, equal keys keep their input order.
    """
    n = hi.shape[0]
    if n <= 1:
        return jnp.arange(n, dtype=jnp.int32)
    bits = _index_bits(n)
    with jax.enable_x64(True):
        sort = _host_sort if host else lax.sort
        if bits <= _MSD_MAX_BITS:
            return _msd(hi, lo, n, bits, sort)
        return _lsd(hi, lo, n, bits, sort)


def sort_words(key: jax.Array, *, host: bool = True) -> tuple[jax.Array, jax.Array]:
    """Stable sort of 32-bit keys with their permutation: :func:`argsort_keys` of ``(key, 0)`` in one packed sort
    (``key`` in the top 32 bits, the row below it), without the refining pass that a zero low word never needs. The
    sorted keys are read off the packed words (no gather).

    Args:
        key: `(n,)` uint32, or int32 whose values are non-negative (their unsigned order is their order).
        host: as in :func:`argsort_keys`.

    Returns:
        ``(sorted_key, perm)``: `(n,)` ``key[perm]`` (``key``'s dtype) and the `(n,)` int32 permutation; equal keys
        keep their input order.

    Example:
        >>> import jax.numpy as jnp
        >>> [a.tolist() for a in sort_words(jnp.array([3, 1, 3, 0], jnp.int32))]
        [[0, 1, 3, 3], [3, 1, 0, 2]]
    """
    n = key.shape[0]
    if n <= 1:
        return key, jnp.arange(n, dtype=jnp.int32)
    with jax.enable_x64(True):
        packed = key.astype(jnp.uint32).astype(jnp.uint64) << jnp.uint64(32) | lax.iota(jnp.uint64, n)
        packed = (_host_sort if host else lax.sort)(packed)
        return ((packed >> jnp.uint64(32)).astype(jnp.uint32).astype(key.dtype),
                (packed & _low(32)).astype(jnp.int32))


def argsort_words(key: jax.Array, *, host: bool = True) -> jax.Array:
    """The permutation of :func:`sort_words`: `(n,)` int32, ``key[perm]`` ascending, ties in input order.

    Example:
        >>> import jax.numpy as jnp
        >>> argsort_words(jnp.array([3, 1, 3, 0], jnp.int32)).tolist()
        [3, 1, 0, 2]
    """
    return sort_words(key, host=host)[1]


def _low(bits: int) -> jax.Array:
    return jnp.uint64((1 << bits) - 1)


def _key(hi: jax.Array, lo: jax.Array) -> jax.Array:
    return (hi.astype(jnp.uint64) << jnp.uint64(32)) | lo.astype(jnp.uint64)


def _index(packed: jax.Array, bits: int) -> jax.Array:
    return (packed & _low(bits)).astype(jnp.int32)


def _msd(hi: jax.Array, lo: jax.Array, n: int, bits: int, sort: Callable[[jax.Array], jax.Array]) -> jax.Array:
    shift = jnp.uint64(bits)
    first = sort((_key(hi, lo) >> shift) << shift | lax.iota(jnp.uint64, n))
    perm = _index(first, bits)
    same = (first[1:] >> shift) == (first[:-1] >> shift)
    rest = lo[perm] & jnp.uint32((1 << bits) - 1)  # the key bits below the first pass's prefix
    # Rows of one prefix are in row order after the first pass, which is already right where their whole keys are
    # equal too (the padding rows, which all carry the invalid key, and duplicate positions): refine only when two
    # neighbours of one prefix differ in the low bits.
    unsorted = same & (rest[1:] != rest[:-1])

    def refine(perm: jax.Array) -> jax.Array:
        rows = lax.iota(jnp.int32, n)
        start = lax.cummax(jnp.where(jnp.concatenate([jnp.ones((1,), bool), ~same]), rows, 0))
        second = sort(start.astype(jnp.uint64) << jnp.uint64(2 * bits) | rest.astype(jnp.uint64) << shift
                      | lax.iota(jnp.uint64, n))
        return perm[_index(second, bits)]

    return lax.cond(jnp.any(unsorted), refine, lambda p: p, perm)


def _lsd(hi: jax.Array, lo: jax.Array, n: int, bits: int, sort: Callable[[jax.Array], jax.Array]) -> jax.Array:
    low_bits = 64 - bits
    shift = jnp.uint64(bits)
    key = _key(hi, lo)
    first = sort((key & _low(low_bits)) << shift | lax.iota(jnp.uint64, n))
    perm = _index(first, bits)
    high = key[perm] >> jnp.uint64(low_bits)
    second = sort(high << shift | lax.iota(jnp.uint64, n))
    return perm[_index(second, bits)]
