"""The first true positions of a mask, without a histogram.

``jnp.nonzero(mask, size=size)`` counts every row into the bin of its running count of true entries
(``bincount(cumsum(mask))``): the rows of a long run of false entries all add to the same bin. XLA:CPU adds them one
after another at no extra cost, but a GPU serialises the adds onto that one address: a mask with few true entries
among millions of rows (FoF's groups at b = 0.2, the queries a kNN pass has left) costs about a nanosecond per row.
:func:`true_positions` instead writes each true row's index at its rank among the true rows: one running count and
one scatter with distinct targets, the same positions.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


def true_positions(mask: jax.Array, size: int, fill_value: Any) -> jax.Array:
    """The positions `(size,)` of the first ``size`` true entries of the 1-D ``mask``, in order, then ``fill_value``.

    The same values as ``jnp.nonzero(mask, size=size, fill_value=fill_value)[0]``, in JAX's default integer dtype
    like it (int32, int64 with ``jax_enable_x64``).
    """
    if mask.ndim != 1:
        raise ValueError(f"true_positions takes a 1-D mask, got shape {mask.shape}")
    dtype = jax.dtypes.canonicalize_dtype(np.int64)
    rank = jnp.cumsum(mask, dtype=jnp.int32) - 1
    slot = jnp.where(mask & (rank < size), rank, size)  # past the end: dropped
    rows = jnp.arange(mask.shape[0], dtype=dtype)
    return jnp.full((size,), fill_value, dtype).at[slot].set(rows, mode="drop")
