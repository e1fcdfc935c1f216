"""Programs over several CPU devices of a process are compiled with operations kept whole
(``shardax._compile``): the rule, the affinity it sets and restores, that XLA reads it, and that ``smap``
uses it once per program and argument shapes."""

from __future__ import annotations

import os
import platform
import threading
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import shardax as sx
from conftest import compilations
from shardax import _compile
from shardax._compile import limited_cpus, split_cpus

linux_two_cpus = pytest.mark.skipif(platform.system() != "Linux" or len(os.sched_getaffinity(0)) < 2,
                                    reason="needs Linux and at least 2 CPUs")


def _cpu(process: int = 0) -> SimpleNamespace:
    return SimpleNamespace(platform="cpu", process_index=process)


def test_split_rule(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_compile, "_allowed_cpus", lambda: set(range(16)))
    eight = [_cpu() for _ in range(8)]
    assert split_cpus(eight, {}) == 2  # 16 CPUs over 8 local devices
    assert split_cpus([_cpu() for _ in range(32)], {}) == 1
    assert split_cpus(eight[:1], {}) is None  # one device: XLA's own split
    assert split_cpus(eight[:1] + [_cpu(1) for _ in range(7)], {}) is None  # one of them in this process
    assert split_cpus([_cpu(p) for p in (0, 0, 1, 1)], {}) == 8  # two of them in this process
    assert split_cpus(eight, {"SHARDAX_CPU_SPLIT": "system"}) is None
    assert split_cpus(eight, {"SHARDAX_CPU_SPLIT": "3"}) == 3
    assert split_cpus(eight, {"SHARDAX_CPU_SPLIT": "64"}) is None  # every CPU: nothing to restrict
    assert split_cpus([SimpleNamespace(platform="gpu", process_index=0)] * 8, {}) is None
    for bad in ("0", "-1", "many"):
        with pytest.raises(ValueError, match="SHARDAX_CPU_SPLIT"):
            split_cpus(eight, {"SHARDAX_CPU_SPLIT": bad})


@linux_two_cpus
def test_limited_cpus_restores_every_thread() -> None:
    allowed = os.sched_getaffinity(0)
    stop = threading.Event()
    seen: dict[str, set[int]] = {}

    def worker(name: str) -> None:
        seen[name + " start"] = set(os.sched_getaffinity(0))
        stop.wait()
        seen[name + " end"] = set(os.sched_getaffinity(0))

    before = threading.Thread(target=worker, args=("before",))
    before.start()
    with limited_cpus(1):
        mine = os.sched_getaffinity(0)
        assert len(mine) == 1 and mine <= allowed
        masks = [os.sched_getaffinity(int(t)) for t in os.listdir("/proc/self/task")]
        assert all(len(m) == 1 for m in masks)
        assert len(set().union(*masks)) == min(len(allowed), len(masks))  # threads in turn over every CPU
        inside = threading.Thread(target=worker, args=("inside",))
        inside.start()
    assert os.sched_getaffinity(0) == allowed
    stop.set()
    before.join()
    inside.join()
    assert seen["before end"] == allowed  # restored
    assert seen["inside start"] == mine and seen["inside end"] == allowed  # started inside: the process's CPUs
    with limited_cpus(len(allowed)):  # every CPU: nothing to restrict
        assert os.sched_getaffinity(0) == allowed
    with limited_cpus(1):  # nested (a kernel compiled inside a user's limited_cpus): no deadlock, outer restored
        outer = os.sched_getaffinity(0)
        with limited_cpus(1):
            assert os.sched_getaffinity(0) == outer
        assert os.sched_getaffinity(0) == outer
    assert os.sched_getaffinity(0) == allowed
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="count"), limited_cpus(bad):  # type: ignore[arg-type]
            pass


_FIRST_COMPILE_INSIDE = """
import json, os
import jax, jax.numpy as jnp
from shardax.runtime import limited_cpus

def tasks():
    return {int(t) for t in os.listdir("/proc/self/task")}

before = tasks()
with limited_cpus(1):  # the process's first compilation: XLA starts its code generation threads now
    jax.jit(lambda x: [jnp.sin(x * k) + k for k in range(40)]).lower(jnp.ones(1000)).compile()
    print(json.dumps(sorted({c for t in tasks() - before for c in os.sched_getaffinity(t)})))
"""


@linux_two_cpus
def test_code_generation_threads_started_inside_limited_cpus_use_every_cpu() -> None:
    # A thread starts with its starter's CPUs: XLA's code generation threads, started by the first compilation of a
    # process inside limited_cpus, all shared the compiling thread's one CPU, and every compilation of the process
    # ran on one core (FoF's first call on 8 devices 11.3 s, 8.2 s with them spread).
    import json
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", _FIRST_COMPILE_INSIDE], capture_output=True, text=True, timeout=120,
                          check=True, env={**os.environ, "JAX_PLATFORMS": "cpu"})
    cpus = json.loads(done.stdout.strip().splitlines()[-1])
    assert len(cpus) >= 2, f"the threads XLA started inside limited_cpus(1) run on CPUs {cpus} only"


def _partitioned(compiled_text: str) -> int:
    """Operations XLA:CPU split into 2 parts (the split it sizes by the compiling thread's CPUs on 2 CPUs)."""
    return compiled_text.count('"outer_dimension_partitions":["2"]')


@linux_two_cpus
def test_xla_reads_the_cpus_at_compile_time() -> None:
    # What the mechanism rests on: XLA:CPU sizes its split of large operations by the CPUs the compiler may use.
    x = jnp.ones((1 << 20,), jnp.float32)
    whole = jax.jit(lambda v: jnp.sin(v) * 2 + 1).lower(x).compile().as_text()
    with limited_cpus(1):
        kept = jax.jit(lambda v: jnp.cos(v) * 2 + 1).lower(x).compile().as_text()
    if len(os.sched_getaffinity(0)) == 2:
        assert _partitioned(whole) >= 1
    assert '"outer_dimension_partitions"' not in kept or _partitioned(kept) == 0


def test_smap_and_fft_compile_once_per_shapes_with_the_rule(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []
    real = _compile.compile_for_devices

    def spy(jitted, args, devices):  # type: ignore[no-untyped-def]
        devices = list(devices)
        calls.append(len(devices))
        return real(jitted, args, devices)

    monkeypatch.setattr(_compile, "compile_for_devices", spy)
    mesh = sx.flat_mesh()
    ndev = mesh.devices.size

    traced_on: list[set[int]] = []

    def body(x: jax.Array) -> jax.Array:
        if hasattr(os, "sched_getaffinity"):
            traced_on.append(set(os.sched_getaffinity(0)))
        return sx.comm.allreduce(jnp.sum(jnp.sin(x) ** 2))

    f = sx.smap(body, in_specs=(P(sx.ALL),), out_specs=P(), mesh=mesh, jit=True)
    for n in (1000, 1000, 2000):
        x = np.linspace(0, 1, ndev * n, dtype=np.float32).reshape(ndev, n)
        np.testing.assert_allclose(float(f(jnp.asarray(x))), float(np.sum(np.sin(x) ** 2)), rtol=1e-4)
    assert calls == [ndev, ndev]  # the first call of each shape
    # Traced with every CPU: only XLA's compilation is limited (pinned, the main threads of all processes on a
    # machine would trace on one CPU).
    if hasattr(os, "sched_getaffinity"):
        assert len(traced_on) >= 2 and all(cpus == set(os.sched_getaffinity(0)) for cpus in traced_on), traced_on
    g = sx.smap(body, in_specs=(P(sx.ALL),), out_specs=P(), mesh=mesh)  # not jitted: nothing compiled ahead
    g(jnp.ones((ndev, 10), jnp.float32))
    assert calls == [ndev, ndev]
    jax.jit(f)(jnp.ones((ndev, 10), jnp.float32))  # under an outer jit: the outer program is what compiles
    assert calls == [ndev, ndev]

    # The global FFTs jit an smap of their own: the same rule.
    cube = np.random.default_rng(0).standard_normal((ndev, 8, 8)).astype(np.complex64)
    x = jax.device_put(cube, NamedSharding(mesh, P(mesh.axis_names[0])))
    for _ in range(2):
        np.testing.assert_allclose(np.asarray(sx.fft.fftn(x)), np.fft.fftn(cube), rtol=1e-4, atol=1e-4)
    assert calls == [ndev, ndev, ndev]


def test_tuning_follows_the_devices_a_kernel_runs_on(monkeypatch: pytest.MonkeyPatch) -> None:
    """The preset is that of the mesh's devices (passed, or the mesh being traced), not JAX's default backend: with
    a default backend that says "gpu", CPU devices still get the CPU preset, and the reverse."""
    from shardax._tuning import resolve_tuning, step_bytes, tuning_backend
    from shardax.spatial._knn_tuning import PRESETS, KnnTuning

    monkeypatch.delenv("SHARDAX_TUNING", raising=False)
    gpus = [SimpleNamespace(platform="gpu", process_index=0, memory_stats=lambda: {"bytes_limit": 80 << 30})]
    assert tuning_backend(gpus) == "gpu"
    assert resolve_tuning(None, PRESETS, KnnTuning, "knn", gpus) is PRESETS["gpu"]
    assert step_bytes(gpus) == (80 << 30) // 16
    mesh = sx.flat_mesh()
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    assert tuning_backend() == "gpu"  # nothing else to go by
    assert tuning_backend(mesh.devices) == "cpu"
    assert resolve_tuning(None, PRESETS, KnnTuning, "knn", mesh.devices) is PRESETS["cpu"]
    seen: list[str] = []

    def body(x: jax.Array) -> jax.Array:
        seen.append(tuning_backend())  # inside the map: the traced mesh's platform
        return x

    sx.smap(body, in_specs=(P(sx.ALL),), out_specs=P(sx.ALL), mesh=mesh)(jnp.ones((mesh.devices.size, 2)))
    assert seen == ["cpu"]
    monkeypatch.setenv("SHARDAX_TUNING", "gpu")  # the override still wins
    assert tuning_backend(mesh.devices) == "gpu"


def test_particle_kernels_take_the_per_op_emitters_unless_told_otherwise() -> None:
    rule = _compile.particle_compiler_options
    per_op = {"xla_cpu_use_fusion_emitters": False}
    assert rule({}) == per_op and rule({"SHARDAX_CPU_EMITTERS": "per-op"}) == per_op
    assert rule({"SHARDAX_CPU_EMITTERS": "fusion"}) is None
    assert rule({"XLA_FLAGS": "--xla_cpu_use_fusion_emitters=true"}) is None  # the user's flag decides
    with pytest.raises(ValueError, match="SHARDAX_CPU_EMITTERS='fast'.*'per-op'.*'fusion'"):
        rule({"SHARDAX_CPU_EMITTERS": "fast"})


def test_smap_hands_compiler_options_to_xla() -> None:
    x = jnp.arange(32.0).reshape(8, 4)
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:8]), ("x",))

    def double(v: jax.Array) -> jax.Array:
        return v * 2

    def mapped(options: object, jit: bool = True):
        return sx.smap(double, in_specs=(P(sx.ALL),), out_specs=P(sx.ALL), mesh=mesh, jit=jit,
                       compiler_options=options)  # type: ignore[arg-type]

    np.testing.assert_array_equal(mapped({"xla_cpu_use_fusion_emitters": False})(x), 2 * np.asarray(x))
    with pytest.raises(Exception, match="xla_no_such_option"):  # it reaches XLA, which names what it does not know
        mapped({"xla_no_such_option": True})(x)
    with pytest.raises(TypeError, match="compiler_options must be a dict"):
        mapped([("xla_cpu_use_fusion_emitters", False)])
    with pytest.raises(ValueError, match="compiler_options needs jit=True"):
        mapped({"xla_cpu_use_fusion_emitters": False}, jit=False)


def test_local_views_called_eagerly_run_as_one_program() -> None:
    """``fof``, ``zsort`` and ``knn`` called outside any trace run as one compiled program (after their checks on
    the concrete arguments), not one dispatch per operation: eagerly, FoF compiled 172 small programs on its first
    call and ran 33x slower than ``jax.jit(fof)`` on every call, kNN with ``zorder=True`` 74. The checks of the
    positions against the box are one program too (FoF's first call: 18 programs with them run eagerly, now 9).
    Their results are the jitted local view's."""
    pos = jnp.asarray(np.random.default_rng(3).random((2000, 3), dtype=np.float32))
    part = sx.particles.Particles(pos=pos, num=jnp.int32(1990))
    ided = sx.particles.with_ids(part)
    calls = {"fof": (lambda: sx.spatial.fof(part, 0.05, box=1.0, min_members=2),
                     jax.jit(lambda p: sx.spatial.fof(p, 0.05, box=1.0, min_members=2))),
             "zsort": (lambda: sx.particles.zsort(part, box=1.0, return_domain=True),
                       jax.jit(lambda p: sx.particles.zsort(p, box=1.0, return_domain=True))),
             "knn": (lambda: sx.spatial.knn(part, 5, box=1.0), jax.jit(lambda p: sx.spatial.knn(p, 5, box=1.0))),
             "knn zorder": (lambda: sx.spatial.knn(ided, 5, box=1.0, zorder=True),
                            jax.jit(lambda p: sx.spatial.knn(ided, 5, box=1.0, zorder=True)))}
    with compilations() as compiles:
        for name, (eager, _) in calls.items():
            for attempt, most in (("first", 12), ("second", 0)):
                compiles.clear()
                jax.block_until_ready(eager())
                assert len(compiles) <= most, f"{name}, {attempt} call: {len(compiles)} programs compiled"
    for name, (eager, jitted) in calls.items():
        for got, want in zip(jax.tree.leaves(eager()), jax.tree.leaves(jitted(part)), strict=True):
            np.testing.assert_array_equal(np.asarray(got), np.asarray(want), err_msg=name)
