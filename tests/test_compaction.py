"""Internal GPU-shaped building blocks against the JAX / NumPy operations they replace: the first true positions of
a mask (kNN's and FoF's compactions) and the folded per-axis min/max of the bounds checks."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from shardax._bounds import _per_axis
from shardax._nonzero import true_positions


@pytest.mark.parametrize(("n", "p"), [(1, 1.0), (7, 0.5), (1000, 0.0), (1000, 0.01), (1000, 1.0)])
def test_true_positions_equal_nonzero(n: int, p: float) -> None:
    mask = jnp.asarray(np.random.default_rng(n).random(n) < p)
    for size, fill in ((1, 0), (n // 2 + 1, n), (n + 5, -1)):
        want = jnp.nonzero(mask, size=size, fill_value=fill)[0]
        got = true_positions(mask, size, fill)
        assert got.dtype == want.dtype and got.shape == (size,)
        np.testing.assert_array_equal(got, want)


def test_true_positions_dtype_follows_x64_and_rejects_2d() -> None:
    mask = jnp.asarray(np.arange(40) % 3 == 0)
    with jax.enable_x64(True):
        got, want = true_positions(mask, 20, 3), jnp.nonzero(mask, size=20, fill_value=3)[0]
        assert got.dtype == want.dtype == jnp.int64
        np.testing.assert_array_equal(got, want)
    with pytest.raises(ValueError, match="1-D mask"):
        true_positions(mask.reshape(5, 8), 4, 0)


@pytest.mark.parametrize("rows", [1, 96, 1000])
def test_folded_min_max_equal_numpy(rows: int) -> None:
    x = np.random.default_rng(rows).standard_normal((rows, 3)).astype(np.float32)
    np.testing.assert_array_equal(_per_axis(jnp.asarray(x), jnp.min), x.min(axis=0))
    np.testing.assert_array_equal(_per_axis(jnp.asarray(x), jnp.max), x.max(axis=0))
    stacked = np.stack([x, x + 1])  # (devices, rows, d): every row of every device
    np.testing.assert_array_equal(_per_axis(jnp.asarray(stacked), jnp.max), stacked.reshape(-1, 3).max(axis=0))
