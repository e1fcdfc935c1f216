"""Every public kernel lowers for CUDA on this CPU-only machine, with the GPU tuning, and without host callbacks.

``jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",))`` runs JAX's CUDA lowering rules without a GPU: what
would fail to compile for a GPU (an unsupported op, a lowering missing on the platform) fails here, and the text
shows which custom calls the GPU program would make. The host sort (``shardax._hostsort``) lowers to a Python callback
on CPU only; on a GPU it must be ``lax.sort``. Every global function is lowered on one device and on a mesh of 8
(the CPU devices stand in for GPUs), with ``SHARDAX_TUNING=gpu`` so the GPU presets of the static sizes are traced.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import shardax as sx
from shardax._hostsort import HOST_MIN

_CUSTOM_CALL = re.compile(r"custom_call @([\w.]+)")
_COLLECTIVE = re.compile(r"stablehlo\.(all_to_all|collective_permute|all_gather|all_reduce|reduce_scatter)")


def _custom_calls(lowered: Any) -> set[str]:
    return set(_CUSTOM_CALL.findall(lowered.as_text()))


def _cuda_program(fn: Callable[..., Any], *args: Any) -> tuple[set[str], Counter[str]]:
    """The custom calls and the collectives (by kind) of ``fn``'s program lowered for CUDA; fails if it has a host
    callback."""
    text = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    calls = set(_CUSTOM_CALL.findall(text))
    callbacks = sorted(c for c in calls if "callback" in c)
    assert not callbacks, f"host callbacks in the CUDA lowering: {callbacks}"
    return calls, Counter(_COLLECTIVE.findall(text))


def _cuda_calls(fn: Callable[..., Any], *args: Any) -> set[str]:
    return _cuda_program(fn, *args)[0]


def _collectives(fn: Callable[..., Any], *args: Any) -> Counter[str]:
    return _cuda_program(fn, *args)[1]


def _exchanges_only_on_a_mesh(mesh: Mesh, collectives: Counter[str], name: str) -> None:
    """On one device a kernel's program has no collective at all; on several its particles travel (all_to_all)."""
    if mesh.size == 1:
        assert not collectives, f"{name} on one device runs collectives: {dict(collectives)}"
    else:
        assert collectives["all_to_all"] > 0, f"{name} on {mesh.size} devices moves no rows: {dict(collectives)}"


@pytest.fixture(autouse=True)
def _gpu_tuning(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SHARDAX_TUNING", "gpu")


@pytest.fixture(params=[1, 8], ids=lambda n: f"{n}dev")
def mesh(request: pytest.FixtureRequest) -> Mesh:
    return Mesh(np.array(jax.devices()[: request.param]), ("d",))


def _particles(mesh: Mesh, n: int = 512) -> Any:
    return sx.particles.from_numpy(np.random.default_rng(0).random((n, 3), dtype=np.float32), mesh=mesh)


def test_the_check_sees_the_host_sort() -> None:
    """The CPU lowering of FoF on enough rows has the host sort's callback: the CUDA check looks for the right name."""
    mesh = Mesh(np.array(jax.devices()[:1]), ("d",))
    part = _particles(mesh, 2 * HOST_MIN)
    traced = jax.jit(lambda p: sx.spatial.fof.smap(mesh)(p, 0.01, box=1.0, tuning="cpu")).trace(part)
    assert any("callback" in c for c in _custom_calls(traced.lower()))
    assert not any("callback" in c for c in _custom_calls(traced.lower(lowering_platforms=("cuda",))))


def test_particle_kernels(mesh: Mesh) -> None:
    part = _particles(mesh)
    kernels = {"zsort.smap": lambda p: sx.particles.zsort.smap(mesh)(p, box=1.0),
               "knn.smap": lambda p: sx.spatial.knn.smap(mesh)(p, 4, box=1.0, tuning="gpu"),
               "knn.smap union": lambda p: sx.spatial.knn.smap(mesh)(
                   p, 4, box=1.0, tuning=sx.spatial.KnnTuning(preset="gpu", select="union")),
               "fof.smap": lambda p: sx.spatial.fof.smap(mesh)(p, 0.05, box=1.0, min_members=2, tuning="gpu")}
    for name, fn in kernels.items():
        _exchanges_only_on_a_mesh(mesh, _collectives(fn, part), name)
    assert not _collectives(lambda: sx.particles.uniform.smap(mesh)(64 * mesh.size))  # each device draws its own


def test_fields(mesh: Mesh) -> None:
    part = _particles(mesh)
    shape = (8, 8, 8)
    field = jax.device_put(jnp.zeros(shape, jnp.float32), NamedSharding(mesh, P("d")))
    paint = _collectives(lambda p: sx.fields.paint(p, shape, box=1.0, mesh=mesh), part)
    readout = _collectives(lambda f, p: sx.fields.readout(f, p, box=1.0, mesh=mesh, spec=P("d")), field, part)
    for name, collectives in (("paint", paint), ("readout", readout)):
        _exchanges_only_on_a_mesh(mesh, collectives, name)
        # The halo planes between neighbouring slabs: a shift, only on a mesh.
        assert (collectives["collective_permute"] > 0) == (mesh.size > 1), (name, dict(collectives))
    power = _collectives(lambda f: sx.fields.power_spectrum(f, box=1.0, bins=4, mesh=mesh, spec=P("d")), field)
    assert power["all_reduce"] > 0 and (power["all_to_all"] > 0) == (mesh.size > 1), dict(power)


def test_ffts(mesh: Mesh) -> None:
    x = jax.device_put(jnp.zeros((8, 8, 8), jnp.float32), NamedSharding(mesh, P("d")))
    z = x.astype(jnp.complex64)
    spec = {"mesh": mesh, "spec": P("d")}
    calls, collectives = _cuda_program(lambda z: sx.fft.fftn(z, **spec), z)
    assert calls == set()  # XLA's own FFT op, no library call
    _exchanges_only_on_a_mesh(mesh, collectives, "fftn")
    _cuda_calls(lambda z: sx.fft.ifftn(z, **spec), z)
    _cuda_calls(lambda x: sx.fft.rfftn(x, **spec), x)
    half = jax.device_put(jnp.zeros((8, 8, 5), jnp.complex64), NamedSharding(mesh, P("d")))
    _cuda_calls(lambda h: sx.fft.irfftn(h, **spec), half)


def test_linalg(mesh: Mesh) -> None:
    n = 64
    a = jax.device_put(2 * jnp.eye(n, dtype=jnp.float32), NamedSharding(mesh, P(None, "d")))
    b = jnp.ones((n,), jnp.float32)
    collectives = _collectives(lambda a, b: sx.linalg.potrs(a, b, mesh=mesh, tuning="gpu"), a, b)
    assert collectives["all_reduce"] > 0 and not collectives["all_to_all"], dict(collectives)
    _cuda_calls(lambda a: sx.linalg.potrf(a, mesh=mesh, tuning="gpu"), a)
    _cuda_calls(lambda a: sx.linalg.potri(a, mesh=mesh, tuning="gpu"), a)
    _cuda_calls(lambda a: sx.linalg.syevd(a, mesh=mesh), a)


def test_collectives(mesh: Mesh) -> None:
    def body(x: jax.Array) -> tuple[jax.Array, ...]:
        size = sx.rank_info().size
        rows = jnp.tile(x, (size, 1))
        counts = jnp.full((size,), 4, jnp.int32)
        data, _, _ = sx.comm.alltoallv(rows, counts, capacity=4 * size, tuning="gpu")
        ladder, _, _ = sx.comm.alltoallv(rows, counts, capacity=4 * size, chunk=sx.comm.chunk_ladder(4 * size))
        moved, _, _ = sx.comm.exchange({"pos": x}, jnp.full((4,), size - 1, jnp.int32), num=3, capacity=4 * size,
                                       tuning="gpu")
        return (sx.comm.allreduce(x), sx.comm.allreduce(x, "max"), sx.comm.allgather(x), sx.comm.alltoall(rows.reshape(size, 4, 3)),
                sx.comm.bcast(x), sx.comm.gather(x), sx.comm.scatter(rows.reshape(size, 4, 3)), sx.comm.reduce(x), sx.comm.scan(x),
                sx.comm.shift(x), sx.comm.sendrecv(x, [(0, size - 1)]), sx.comm.barrier(), data, ladder,
                moved["pos"])

    mapped = sx.smap(body, in_specs=P(sx.ALL), out_specs=P(sx.ALL), mesh=mesh)
    collectives = _collectives(mapped, jnp.ones((mesh.size, 4, 3), jnp.float32))
    if mesh.size > 1:
        assert {"all_to_all", "all_gather", "all_reduce", "collective_permute"} <= set(collectives), dict(collectives)


def test_gpu_presets_take_fewer_steps() -> None:
    """The GPU presets of the static sizes: larger linalg tiles, one exchange round for balanced traffic."""
    from shardax._exchange import default_chunk
    from shardax.linalg._layout import default_tile

    assert [default_tile(n, 1, "gpu") for n in (16384, 8192, 2048)] == [512, 512, 256]
    assert [default_tile(n, 1, "cpu") for n in (16384, 8192, 2048)] == [256, 256, 128]
    assert default_tile(8192, 1) == 512  # SHARDAX_TUNING=gpu (this file's fixture) is the default's preset
    assert default_chunk(8000, 8, "gpu") == 1250 and default_chunk(8000, 8, "cpu") == 157
    with pytest.raises(ValueError, match="tuning must be one of"):
        default_tile(8192, 1, "tpu")
    with pytest.raises(ValueError, match="tile must be a positive int"):
        sx.linalg.LinalgTuning(tile=0)
