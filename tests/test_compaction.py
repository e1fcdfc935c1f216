"""Internal GPU-shaped building blocks against the JAX / NumPy operations they replace: the first true positions of
a mask (kNN's and FoF's compactions), the folded per-axis min/max of the bounds checks, and the error flags that
travel to the host as one vector."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from shardax import _flags
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


def test_flags_travel_as_one_vector_bit_for_bit() -> None:
    """Counts, bools and floats of every width come back unchanged from one int32 vector (float64 as two words)."""
    big = np.array([np.inf, -np.inf, 1e300, -3.25, 1e-300, np.nan])
    with jax.enable_x64(True):
        words = jax.jit(lambda: _flags.pack(jnp.int32(2**31 - 1), True, jnp.array([1.5, -2.0], jnp.float32),
                                            jnp.asarray(big), jnp.array([[3, 4], [5, -6]]),
                                            jnp.array([0.5], jnp.bfloat16)))()
        assert words.dtype == jnp.int32 and words.shape == (1 + 1 + 2 + 12 + 4 + 1,)
        count, flag, f32, f64, ints, half = _flags.unpack(words, 1, 1, (2, np.float32), (6, np.float64), 4,
                                                          (1, jnp.bfloat16))
    assert count.tolist() == [2**31 - 1] and flag.tolist() == [1] and ints.tolist() == [3, 4, 5, -6]
    assert f32.dtype == np.float32 and f32.tolist() == [1.5, -2.0]
    assert f64.dtype == np.float64
    np.testing.assert_array_equal(f64, big)
    assert half.tolist() == [0.5]
    with pytest.raises(ValueError, match="words for flags"):
        _flags.unpack(words, 1, 1)
    seen: list[bool] = []
    jax.jit(lambda x: seen.append(_flags.is_traced(_flags.pack(x))) or x)(jnp.int32(1))
    assert seen == [True] and not _flags.is_traced(words)
