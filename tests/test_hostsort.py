"""``shardax._hostsort.sort``: NumPy's sort in a host callback on CPU devices, bit-identical to ``lax.sort``."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from shardax import _hostsort
from shardax._hostsort import HOST_MIN, sort

DTYPES = [np.int32, np.uint32, np.int64, np.uint64]


def _values(dtype: type, n: int, rng: np.random.Generator) -> np.ndarray:
    info = np.iinfo(dtype)
    x = rng.integers(info.min, info.max, n, dtype=dtype, endpoint=True)
    x[: n // 4] = rng.choice(x[n // 4:n // 4 + 20], n // 4)  # many duplicates
    x[:4] = [info.min, info.max, 0, info.max]
    return rng.permutation(x)


def _host_calls(fn: object, *args: jax.Array) -> int:
    return jax.jit(fn).lower(*args).as_text().count("python_cpu_callback")  # type: ignore[arg-type]


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda t: np.dtype(t).name)
def test_sort_equals_numpy_and_lax(dtype: type) -> None:
    """Extremes, duplicates and negative values, eagerly, in ``jit`` and under ``vmap`` (batch axis first or last);
    the 64-bit types inside a ``jax.enable_x64`` scope, as ``argsort_keys`` uses them (the callback runs outside
    it)."""
    rng = np.random.default_rng(3)
    with jax.enable_x64(True):
        x = _values(dtype, 3 * HOST_MIN + 7, rng)
        want = np.sort(x)
        xj = jnp.asarray(x)
        assert _host_calls(sort, xj) == 1
        for got in (sort(xj), jax.jit(sort)(xj), lax.sort(xj)):
            assert got.dtype == np.dtype(dtype)
            np.testing.assert_array_equal(np.asarray(got), want)
        batch = np.stack([_values(dtype, HOST_MIN, rng) for _ in range(3)])
        np.testing.assert_array_equal(np.asarray(jax.jit(jax.vmap(sort))(jnp.asarray(batch))), np.sort(batch, axis=1))
        np.testing.assert_array_equal(np.asarray(jax.vmap(sort, 1, 1)(jnp.asarray(batch.T))),
                                      np.sort(batch, axis=1).T)


def test_small_or_other_arrays_keep_lax_sort() -> None:
    """Below ``HOST_MIN`` values, for float keys and for 2D arrays no callback is emitted."""
    small = jnp.arange(HOST_MIN - 1, dtype=jnp.int32)[::-1]
    assert _host_calls(sort, small) == 0
    np.testing.assert_array_equal(np.asarray(jax.jit(sort)(small)), np.arange(HOST_MIN - 1))
    floats = jnp.linspace(1.0, 0.0, 2 * HOST_MIN, dtype=jnp.float32)
    assert _host_calls(sort, floats) == 0
    np.testing.assert_array_equal(np.asarray(sort(floats)), np.sort(np.asarray(floats)))


def test_no_deadlock_before_a_collective_and_no_gather() -> None:
    """Inside ``shard_map`` on 8 devices, each device sorts its own rows on the host and then takes part in a
    ``psum`` (with ``jax.pure_callback``, whose arguments first go to device 0, this deadlocks). Under automatic
    sharding of several devices a callback would gather the array onto one device: ``lax.sort`` is kept there."""
    mesh = Mesh(np.array(jax.devices()[:8]), ("x",))
    rng = np.random.default_rng(5)
    x = rng.integers(-(2**31), 2**31 - 1, (8, 2 * HOST_MIN), dtype=np.int32)
    xs = jax.device_put(x, NamedSharding(mesh, P("x")))

    def body(block: jax.Array) -> tuple[jax.Array, jax.Array]:
        out = sort(block[0])
        return out[None], lax.psum(out[:1], "x")

    fn = jax.shard_map(body, mesh=mesh, in_specs=P("x"), out_specs=(P("x"), P()))
    assert _host_calls(fn, xs) == 1
    for _ in range(3):
        got, first = jax.jit(fn)(xs)
    np.testing.assert_array_equal(np.asarray(got), np.sort(x, axis=1))
    np.testing.assert_array_equal(np.asarray(first), [np.sort(x, axis=1)[:, 0].sum(dtype=np.int32)])

    flat = jax.device_put(x.reshape(-1), NamedSharding(mesh, P("x")))
    assert _host_calls(sort, flat) == 0
    np.testing.assert_array_equal(np.asarray(jax.jit(sort)(flat)), np.sort(x.reshape(-1)))


def test_threshold_is_honoured(monkeypatch: pytest.MonkeyPatch) -> None:
    """``HOST_MIN`` is read at trace time (the benchmarks switch the host path off by raising it)."""
    x = jnp.arange(2 * HOST_MIN, dtype=jnp.int32)[::-1]
    monkeypatch.setattr(_hostsort, "HOST_MIN", 1 << 40)
    assert _host_calls(sort, x) == 0


def test_environment_turns_it_off(monkeypatch: pytest.MonkeyPatch) -> None:
    """``SHARDAX_HOST_SORT=0`` keeps every sort in XLA (for ``jax.export`` and the persistent compilation cache);
    the public ``alltoallv`` groups rows with ``lax.sort`` whatever the setting, kernels ask for the host sort."""
    from shardax.comm import group_by_rank

    x = jnp.arange(2 * HOST_MIN, dtype=jnp.int32)[::-1]
    key = x % 3
    assert _host_calls(lambda k: group_by_rank(k, 3)[0], key) == 0
    assert _host_calls(lambda k: group_by_rank(k, 3, host=True)[0], key) == 1
    monkeypatch.setenv("SHARDAX_HOST_SORT", "0")
    assert _host_calls(sort, x) == 0
    assert _host_calls(lambda k: group_by_rank(k, 3, host=True)[0], key) == 0
    np.testing.assert_array_equal(np.asarray(jax.jit(sort)(x)), np.arange(2 * HOST_MIN))


def test_persistent_cache_turns_it_off_unless_forced(monkeypatch: pytest.MonkeyPatch, tmp_path: object) -> None:
    """``auto`` (the default): no callback while JAX's persistent compilation cache is on, so every program can be
    cached; ``1`` forces the host sort even then; a bad value is refused with the values it takes. (A new function
    each time: JAX reuses the trace of one it has seen, whatever the environment.)"""
    x = jnp.arange(2 * HOST_MIN, dtype=jnp.int32)[::-1]
    monkeypatch.delenv("SHARDAX_HOST_SORT", raising=False)
    assert _hostsort.host_sort_enabled() and _host_calls(lambda v: sort(v), x) == 1
    before = jax.config.jax_compilation_cache_dir  # type: ignore[attr-defined]
    jax.config.update("jax_compilation_cache_dir", str(tmp_path))
    try:
        assert not _hostsort.host_sort_enabled()
        assert _host_calls(lambda v: sort(v), x) == 0
        monkeypatch.setenv("SHARDAX_HOST_SORT", "auto")
        assert _host_calls(lambda v: sort(v), x) == 0
        monkeypatch.setenv("SHARDAX_HOST_SORT", "1")
        assert _host_calls(lambda v: sort(v), x) == 1
    finally:
        jax.config.update("jax_compilation_cache_dir", before)
    monkeypatch.setenv("SHARDAX_HOST_SORT", "sometimes")
    with pytest.raises(ValueError, match="SHARDAX_HOST_SORT='sometimes'.*'auto'.*'0'"):
        _hostsort.host_sort_enabled()


def test_lowering_for_several_platforms_keeps_lax_sort() -> None:
    """``jax.export`` for CPU and CUDA at once lowers without a callback (JAX's callbacks support one platform)."""
    from jax import export

    x = jnp.arange(2 * HOST_MIN, dtype=jnp.int32)[::-1]
    exported = export.export(jax.jit(sort), platforms=("cpu", "cuda"))(x)
    assert "python_cpu_callback" not in exported.mlir_module()
    np.testing.assert_array_equal(np.asarray(exported.call(x)), np.arange(2 * HOST_MIN))
