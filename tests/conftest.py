"""Test configuration: 8 CPU devices in this process and strict numerics (set before the JAX backend starts)."""

from __future__ import annotations

import contextlib
import gc
import os
from collections.abc import Iterator

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# The tests check results on small inputs and spend most of their time compiling. Two XLA:CPU options cut that,
# without changing any result the tests check: LLVM's lowest optimisation level (about a quarter faster) and XLA's
# older per-op emitters instead of its fusion emitters (FoF's 8-device program: 10.2 s -> 4.4 s of compilation).
# Inherited by the processes the tests launch. Benchmarks and users keep XLA's defaults (USER_COMPILER_OPTIONS, for
# tests that measure a compiled program); an XLA_FLAGS that sets either option itself is kept. (The older emitters
# fuse a product into the next sum as a fused multiply-add in some programs and not others; kNN's and FoF's
# distances round each square on its own, so they stay bit-identical at every scale with either emitter.)
_TEST_XLA_FLAGS = {"xla_backend_optimization_level": "0", "xla_cpu_use_fusion_emitters": "false"}
for _flag, _value in _TEST_XLA_FLAGS.items():
    if _flag not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --{_flag}={_value}".strip()
# XLA's defaults, for ``lowered.compile(compiler_options=USER_COMPILER_OPTIONS)`` in tests that measure a program.
USER_COMPILER_OPTIONS = {"xla_backend_optimization_level": 3, "xla_cpu_use_fusion_emitters": True}

import jax  # noqa: E402  (after the flags above)

# Tracing creates many short-lived Python objects, and a worker holds many long-lived ones (compiled programs, their
# caches): with the default thresholds the collector walks them every few hundred allocations. Rarer collections
# cut about 4% of the CPU time of compile-heavy tests (tests/test_fof.py); memory is still freed per module below.
gc.set_threshold(100_000, 50, 1000)

jax.config.update("jax_num_cpu_devices", 8)
jax.config.update("jax_numpy_dtype_promotion", "strict")
jax.config.update("jax_numpy_rank_promotion", "raise")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
from jax.sharding import Mesh  # noqa: E402

# Mesh shapes every distributed feature is checked on: one device, the smallest ring, all 8 devices in 1D, and a 2D
# mesh with unequal axes (which catches a swapped axis a square mesh would hide). 4-device and 2x2 meshes found
# nothing these four do not, and cost a third of the suite's compile time.
MESH_SHAPES = [(1,), (2,), (8,), (2, 4)]


@contextlib.contextmanager
def compilations() -> Iterator[list[str]]:
    """While inside, every program XLA compiles in this process (JAX's backend-compile events) is appended to the
    yielded list (clear it between the calls you count)."""
    events: list[str] = []

    def listen(event: str, _seconds: float, **_: object) -> None:
        if event == "/jax/core/compile/backend_compile_duration":
            events.append(event)

    jax.monitoring.register_event_duration_secs_listener(listen)
    try:
        yield events
    finally:
        jax.monitoring.unregister_event_duration_listener(listen)


@contextlib.contextmanager
def collectives_ordered() -> Iterator[list[str]]:
    """While inside, the optimized program of everything XLA compiles in this process is collected; on exit every
    program over more than one device must order each pair of its collectives by data (shardax._order: a program
    read back from a compilation cache could otherwise run them in different orders on different devices and
    hang). Yields the list of programs checked."""
    from jax._src import compiler

    from shardax._order import unordered_collectives

    texts: list[str] = []
    original = compiler.compile_or_get_cached

    def spy(backend: object, computation: object, devices: object, *args: object, **kwargs: object) -> object:
        executable = original(backend, computation, devices, *args, **kwargs)
        if np.size(devices) > 1:  # (one device: nothing to wait for)
            texts.append(executable.hlo_modules()[0].to_string())  # type: ignore[attr-defined]
        return executable

    compiler.compile_or_get_cached = spy
    try:
        yield texts
    finally:
        compiler.compile_or_get_cached = original
    for text in texts:
        pairs = list(unordered_collectives(text))
        assert not pairs, f"{text.splitlines()[0][:60]}: collectives not ordered by data: {pairs[:5]}"


def make_mesh(shape: tuple[int, ...]) -> Mesh:
    """A mesh over the first prod(shape) local CPU devices, axes named x, y (Auto axis types)."""
    n = int(np.prod(shape))
    names = ("x", "y", "z")[: len(shape)]
    return Mesh(np.array(jax.devices()[:n]).reshape(shape), names)


@pytest.fixture(params=MESH_SHAPES, ids=lambda s: "x".join(map(str, s)))
def mesh(request: pytest.FixtureRequest) -> Mesh:
    return make_mesh(request.param)


# Every compiled XLA:CPU executable holds ~24 memory mappings until its jit cache entry goes. One pytest worker
# runs hundreds of tests and compiles thousands of executables: past vm.max_map_count (65530 by default) the next
# compile's mmap fails and XLA aborts the worker. Cached executables are dropped after every module, and after any
# test that leaves the process holding more than _MAX_MAPPINGS mappings.
_MAX_MAPPINGS = 20_000


def _mapping_count() -> int:
    try:
        with open("/proc/self/maps", "rb") as f:
            return sum(1 for _ in f)
    except OSError:  # not Linux
        return 0


def _drop_compiled_code() -> None:
    jax.clear_caches()
    gc.collect()


@pytest.fixture(autouse=True, scope="module")
def _drop_compiled_code_per_module():
    yield
    _drop_compiled_code()


@pytest.fixture(autouse=True)
def _bound_memory_mappings():
    yield
    if _mapping_count() > _MAX_MAPPINGS:
        _drop_compiled_code()


# The CLI jobs turn JAX's persistent compilation cache on for their process (and export it to the processes they
# start). A job run in a pytest worker must not leave it on for the tests that follow: with the cache on, the host
# sort switches itself off and every compiled program is written to disk.
_CACHE_OPTIONS = ("jax_compilation_cache_dir", "jax_enable_compilation_cache",
                  "jax_persistent_cache_min_compile_time_secs", "jax_persistent_cache_min_entry_size_bytes")
_CACHE_ENV = ("JAX_COMPILATION_CACHE_DIR", "JAX_ENABLE_COMPILATION_CACHE",
              "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES")


@pytest.fixture(autouse=True)
def _restore_compilation_cache():
    options = {name: getattr(jax.config, name) for name in _CACHE_OPTIONS}
    env = {name: os.environ.get(name) for name in _CACHE_ENV}
    yield
    changed = [name for name, value in options.items() if getattr(jax.config, name) != value]
    for name in changed:
        jax.config.update(name, options[name])
    if changed:
        from jax._src import compilation_cache  # JAX decides once whether the cache is used: ask it again

        compilation_cache.reset_cache()
    for name, value in env.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


# Scheduling (pytest-xdist, ``--dist loadfile``): a worker takes one test file at a time, in collection order. The
# files that take longest go first, so that no worker is left alone with a long one at the end; xdist's own
# reordering (by number of tests, off in pyproject.toml) put one-test files of two to three minutes (launches of
# 2 processes x 4 devices) last. Longest first, by their time in a full run on 2 cores; the rest keep their order.
_LONGEST_FIRST = ("test_knn", "test_fof", "test_linalg", "test_nbody", "test_zsort", "test_fof_multiprocess",
                  "test_pipeline", "test_docstrings", "test_mpi_transport", "test_halos", "test_comm_grad",
                  "test_clusters_netns", "test_multiprocess", "test_linalg_multiprocess", "test_examples")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    rank = {name: i for i, name in enumerate(_LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.stem, len(rank)))
