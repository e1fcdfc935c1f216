"""The cases of ``shardax bench``: each kernel timed back to back with its anchor, and the worker that runs them.

A worker is one process (or one rank of a launched run) with a fixed number of CPU devices: the parent
(:mod:`shardax.cli._bench`) writes a plan, starts ``python -m shardax.cli._bench_worker PLAN`` with the device count
it wants, and reads back one JSON line per timing that rank 0 appends to the plan's result file. The NumPy/SciPy
anchors are :mod:`shardax.testing.reference`'s; the scripts in ``benchmarks/`` time the same ones.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal

import numpy as np

from ..testing import reference

Versus = Literal["anchor", "1 device"]


@dataclasses.dataclass(frozen=True)
class Target:
    """A goal from docs/benchmarks.md: ``shardax time / reference time <= limit``.

    Attributes:
        limit: the largest ratio that meets the goal.
        versus: the reference: the anchor of the same run, or shardax itself on one device (same size).
        text: the goal as the docs state it.
    """

    limit: float
    versus: Versus
    text: str


@dataclasses.dataclass(frozen=True)
class Kernel:
    """One benchmarked kernel.

    Attributes:
        name: the name ``--only`` takes.
        anchors: short name -> what the anchor is, one entry per reference the kernel is timed against.
        size_format: how a size reads in the table (``"{:,} pts"``).
        quick_sizes: sizes of ``--quick``, ascending; the last one is used for the device sweep.
        full_sizes: sizes of a full run, ascending.
        targets: anchor short name -> goal at one device (and on every device count when ``scaling`` is None).
        scaling: goal on more than one device, against shardax on one device; None: ``targets`` applies.
        min_devices: fewest devices the kernel means something on.
        needs: modules the anchors import (a missing one turns the rows into skipped rows).
        device_anchors: the anchors on an accelerator (GPU) backend, where the reference is the jitted JAX
            equivalent on the same device; empty: the CPU anchors everywhere.
        device_targets: the goals against ``device_anchors``.
        docs_size: the size at which docs/benchmarks.md states the kernel's figures and its targets: rows at
            other sizes report their ratio without a verdict (fixed per-call costs weigh more on small inputs, so
            a ratio at 65k points says nothing about the target at 1e6).
    """

    name: str
    anchors: Mapping[str, str]
    size_format: str
    quick_sizes: tuple[int, ...]
    full_sizes: tuple[int, ...]
    targets: Mapping[str, Target]
    scaling: Target | None = None
    min_devices: int = 1
    needs: tuple[str, ...] = ()
    device_anchors: Mapping[str, str] = dataclasses.field(default_factory=dict)
    device_targets: Mapping[str, Target] = dataclasses.field(default_factory=dict)
    docs_size: int | None = None

    def sizes(self, quick: bool, docs: bool = False) -> tuple[int, ...]:
        if docs and self.docs_size is not None:
            return (self.docs_size,)
        return self.quick_sizes if quick else self.full_sizes

    def on(self, backend: str) -> Kernel:
        """This kernel as benchmarked on ``backend`` (``"cpu"`` or ``"gpu"``): the device anchors on a GPU."""
        if backend == "cpu" or not self.device_anchors:
            return self
        return dataclasses.replace(self, anchors=self.device_anchors, targets=self.device_targets, needs=(),
                                   device_anchors={}, device_targets={})


_SCALING = Target(1.5, "1 device", "<= 1.5x 1 dev")
_NO_SLOWER = Target(1.0, "anchor", "<= 1.0x")

KERNELS: dict[str, Kernel] = {k.name: k for k in (
    Kernel("allreduce", {"lax.psum": "jax.lax.psum in jax.shard_map (what allreduce wraps)",
                         "mpi4jax": "mpi4jax.allreduce under mpirun -n 2, one device per process"},
           "{:,} f32/dev", (1 << 16, 1 << 18), (1 << 16, 1 << 18, 1 << 20),
           {"mpi4jax": _NO_SLOWER}, min_devices=2, docs_size=1 << 20),
    Kernel("alltoallv", {"all_to_all": "tiled lax.all_to_all of the same bytes (16 f32 per row)"},
           "{:,} rows/dev", (1 << 12, 1 << 14), (1 << 13, 1 << 15, 1 << 17),
           {"all_to_all": Target(1.5, "anchor", "<= 1.5x")}, min_devices=2, docs_size=1 << 15),
    Kernel("zsort", {"NumPy": "NumPy Morton keys (21 bits/axis) + argsort + gather of pos, ids, mass"},
           "{:,} pts", (1 << 15, 1 << 17), (100_000, 300_000, 1_000_000), {"NumPy": _NO_SLOWER}, _SCALING,
           device_anchors={"jnp.argsort": "the same Morton keys + jnp.argsort + gather in one jit (uint64)"},
           device_targets={"jnp.argsort": _NO_SLOWER}, docs_size=1_000_000),
    Kernel("knn", {"cKDTree": "scipy cKDTree build + query(k=9, workers=-1)"},
           "{:,} pts", (1 << 14, 1 << 16), (100_000, 300_000, 1_000_000), {"cKDTree": _NO_SLOWER}, _SCALING,
           needs=("scipy",),
           device_anchors={"brute force": "jit: squared distances to every point in query blocks + lax.top_k"},
           device_targets={"brute force": _NO_SLOWER}, docs_size=1_000_000),
    Kernel("fof", {"scipy FoF": "cKDTree.query_pairs + csgraph.connected_components, b=0.2, periodic"},
           "{:,} pts", (1 << 14, 1 << 16), (100_000, 300_000, 1_000_000), {"scipy FoF": _NO_SLOWER}, _SCALING,
           needs=("scipy",), docs_size=1_000_000),
    Kernel("potrs", {"cho_solve": "scipy cho_factor + cho_solve, float64, 1 right-hand side"},
           "N={}", (512, 1024), (1024, 2048, 4096),
           {"cho_solve": Target(1 / 0.7, "anchor", ">= 0.7x GFLOP/s")}, needs=("scipy",),
           device_anchors={"jax cho_solve": "jax.scipy.linalg cho_factor + cho_solve in one jit, float64"},
           device_targets={"jax cho_solve": Target(1 / 0.7, "anchor", ">= 0.7x GFLOP/s")}, docs_size=4096),
    Kernel("syevd", {"eigh": "scipy.linalg.eigh, float64"},
           "N={}", (128, 256), (256, 512, 1024), {"eigh": Target(3.0, "anchor", "<= 3x")}, needs=("scipy",),
           device_anchors={"jnp eigh": "jnp.linalg.eigh in jit, float64"},
           device_targets={"jnp eigh": Target(3.0, "anchor", "<= 3x")}, docs_size=2048),
    Kernel("fftn", {"jnp.fft": "jnp.fft.fftn on one device (jit)",
                    "jaxdecomp": "jaxdecomp pfft3d(backend='JAX') on the same slab mesh"},
           "{}^3 c64", (32, 64), (64, 128, 256),
           {"jnp.fft": Target(1.5, "anchor", "<= 1.5x"), "jaxdecomp": _NO_SLOWER}, docs_size=256),
)}




def kernels(backend: str) -> dict[str, Kernel]:
    """The benchmarked kernels with the anchors of ``backend`` (``"cpu"``: NumPy/SciPy; ``"gpu"``: jitted JAX)."""
    return {name: kernel.on(backend) for name, kernel in KERNELS.items()}


# ---------------------------------------------------------------------------------------------------------------
# Anchors: NumPy/SciPy ones built on shardax.testing.reference, and their JAX equivalents for accelerators; the
# scripts in benchmarks/ time the same ones.

def numpy_zsort(pos: np.ndarray, ids: np.ndarray, mass: np.ndarray) -> tuple[np.ndarray, ...]:
    """The NumPy z-sort of points in the box [0, 1): 21-bit-per-axis Morton keys
    (:func:`shardax.testing.reference.morton_keys`), argsort, gather."""
    order = np.argsort(reference.morton_keys(pos, box=1.0, wrap=False))
    return pos[order], ids[order], mass[order]


def jax_zsort(pos: Any, ids: Any, mass: Any) -> tuple[Any, ...]:
    """:func:`numpy_zsort` in JAX (jit it under ``jax.enable_x64``: the keys are uint64)."""
    import jax.numpy as jnp

    cells = jnp.minimum(jnp.floor(pos * jnp.float32(2**21)).astype(jnp.uint64), jnp.uint64(2**21 - 1))
    key = jnp.zeros(pos.shape[:1], jnp.uint64)
    for k in range(3):
        x = cells[:, k]
        for shift, mask in ((32, 0x1F00000000FFFF), (16, 0x1F0000FF0000FF), (8, 0x100F00F00F00F00F),
                            (4, 0x10C30C30C30C30C3), (2, 0x1249249249249249)):
            x = (x | (x << jnp.uint64(shift))) & jnp.uint64(mask)
        key = key | (x << jnp.uint64(k))
    order = jnp.argsort(key)
    return pos[order], ids[order], mass[order]


def jax_brute_knn(pos: Any, k: int) -> tuple[Any, Any]:
    """Exact k nearest neighbours by brute force (jit it): squared distances of query blocks to every point, top k."""
    import jax
    import jax.numpy as jnp

    n = pos.shape[0]
    block = max(1, min(n, 2**28 // n))  # a block's distances take at most 1 GiB (float32)
    padded = jnp.pad(pos, ((0, -n % block), (0, 0)))
    norms = jnp.sum(pos * pos, axis=1)

    def one(q: Any) -> tuple[Any, Any]:
        d2 = jnp.sum(q * q, axis=1)[:, None] + norms[None, :] - 2 * q @ pos.T
        neg, idx = jax.lax.top_k(-d2, k)
        return -neg, idx

    d2, idx = jax.lax.map(one, padded.reshape(-1, block, pos.shape[1]))
    return d2.reshape(-1, k)[:n], idx.reshape(-1, k)[:n]


def scipy_fof(pos: np.ndarray, linking_length: float, box: float = 1.0) -> np.ndarray:
    """Friends-of-friends component ids in a periodic box by SciPy (:func:`shardax.testing.reference.fof_components`)."""
    return reference.fof_components(pos, linking_length, box=box)


def time_rounds(fns: Mapping[str, Callable[[], Any]], repeat: int) -> tuple[dict[str, float], dict[str, list[float]]]:
    """Time each function ``repeat`` times, round-robin, so that load changes on a shared machine hit all alike.

    Returns:
        ``(first, times)``: the seconds of each function's first (warm-up, compiling) call, and its timed calls.
    """
    import jax

    first: dict[str, float] = {}
    for name, fn in fns.items():
        start = time.perf_counter()
        jax.block_until_ready(fn())
        first[name] = time.perf_counter() - start
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeat):
        for name, fn in fns.items():
            start = time.perf_counter()
            jax.block_until_ready(fn())
            times[name].append(time.perf_counter() - start)
    return first, times


def time_lead_rounds(lead: Callable[[], Any] | None, everyone: Callable[[], Any], repeat: int, tag: str
                     ) -> tuple[list[float], list[float]]:
    """Time ``lead`` on process 0 alone and ``everyone`` on all processes, round-robin, after one warm-up call of
    each (call it on every process; ``lead`` is ``None`` off process 0).

    Each round process 0 times ``lead`` while the other processes wait at a barrier of the coordination service (a
    blocking call, which leaves the cores to process 0), then every process times ``everyone``: e.g. a 1-device
    baseline and the same work on all devices of a multi-process run, whose ratio is then measured under one load.
    ``tag`` names the barriers (one tag per use in a run).

    Returns:
        ``(lead_times, everyone_times)`` in seconds (``lead_times`` is empty off process 0).
    """
    import jax

    from .._guard import coordinator_client

    client = coordinator_client() if jax.process_count() > 1 else None
    fns = {"lead": lead, "everyone": everyone}
    for fn in fns.values():
        if fn is not None:
            jax.block_until_ready(fn())
    times: dict[str, list[float]] = {name: [] for name in fns}
    for i in range(repeat):
        for name, fn in fns.items():
            if name == "everyone" and client is not None:
                client.wait_at_barrier(f"shardax/benchmark/{tag}/{i}", 3_600_000)
            if fn is not None:
                start = time.perf_counter()
                jax.block_until_ready(fn())
                times[name].append(time.perf_counter() - start)
    return times["lead"], times["everyone"]


# ---------------------------------------------------------------------------------------------------------------
# The cases, run in a worker: each returns one timing per anchor.

@dataclasses.dataclass(frozen=True)
class Timing:
    """The raw timings of one kernel against one anchor (seconds)."""

    kernel: str
    anchor: str
    size: int
    shardax_s: list[float]
    anchor_s: list[float]
    first_call_s: float
    extra: dict[str, float] = dataclasses.field(default_factory=dict)


class Context:
    """The worker's world: a flat mesh of every device, and whether this rank times the anchors (rank 0 only)."""

    def __init__(self, repeat: int, devices: int | None = None):
        import jax
        from jax.sharding import Mesh

        from ..runtime import flat_mesh, world

        self.repeat = repeat
        self.world = world()
        self.backend = "cpu" if jax.default_backend() == "cpu" else "gpu"
        # CPU workers are started with exactly their devices; on an accelerator the first ``devices`` of one process.
        use = self.backend == "gpu" and devices is not None and self.world.num_processes == 1
        if use and devices > len(jax.devices()):  # type: ignore[operator]
            raise ValueError(f"--devices asks for {devices} devices but this process has {len(jax.devices())} "
                             f"{jax.default_backend()} device(s)")
        self.mesh = Mesh(np.array(jax.devices()[:devices]), ("d",)) if use else flat_mesh()
        self.axis = self.mesh.axis_names[0]
        self.devices = self.mesh.devices.ravel()
        self.main = jax.process_index() == 0

    def put(self, host: np.ndarray, spec: Any, mesh: Any = None) -> Any:
        """The global array ``host`` (the same on every process) with sharding ``spec`` on ``mesh`` (default: flat)."""
        import jax
        from jax.sharding import NamedSharding

        return jax.make_array_from_callback(host.shape, NamedSharding(mesh or self.mesh, spec), lambda i: host[i])

    def particles(self, pos: np.ndarray, mass: np.ndarray | None = None) -> Any:
        """Global particles: every process passes its own contiguous share of the rows."""
        from ..particles import from_numpy

        rows = np.array_split(np.arange(len(pos)), self.world.num_processes)[self.world.process_id]
        if mass is None:
            return from_numpy(pos[rows], mesh=self.mesh)
        return from_numpy(pos[rows], mesh=self.mesh, mass=mass[rows])

    def time(self, kernel: str, size: int, shardax: Callable[[], Any], anchors: Mapping[str, Callable[[], Any]],
             *, collective: Sequence[str] = (), flops: float | None = None, setup_s: float = 0.0) -> list[Timing]:
        """Time ``shardax`` and each anchor in the same rounds; one :class:`Timing` per anchor.

        Host anchors (NumPy, SciPy, one device) run on rank 0 only, while the other ranks wait in shardax's next
        collective; the anchors named in ``collective`` span every process, so every rank runs them.
        ``setup_s``: seconds of earlier calls of ``shardax`` (capacity retries), counted in its first call.
        """
        fns = {"shardax": shardax, **{k: f for k, f in anchors.items() if self.main or k in collective}}
        first, times = time_rounds(fns, self.repeat)
        out = []
        for name in anchors:
            theirs = times.get(name, [])
            extra = {}
            if flops is not None and theirs:
                extra = {"shardax_gflops": flops / float(np.median(times["shardax"])) / 1e9,
                         "anchor_gflops": flops / float(np.median(theirs)) / 1e9}
            out.append(Timing(kernel, name, size, times["shardax"], theirs, setup_s + first["shardax"], extra))
        return out


def _points(n: int) -> np.ndarray:
    return np.random.default_rng(0).random((n, 3), dtype=np.float32)


def _sized_call(call: Callable[..., Any]) -> tuple[Callable[[], Any], float]:
    """``call(**sizes)`` with the buffer sizes :func:`shardax.retry_capacity` finds by calling it, and the seconds
    those calls took (the first one compiles: it counts in the first call's time)."""
    from .._capacity import retry_capacity

    start = time.perf_counter()
    _, sizes = retry_capacity(call)
    return (lambda: call(**sizes)), time.perf_counter() - start


def _case_allreduce(ctx: Context, n: int) -> list[Timing]:
    import jax
    from jax import lax
    from jax.sharding import PartitionSpec as P

    from ..comm import allreduce
    from ..core import smap

    x = ctx.put(np.ones((len(ctx.devices), n), np.float32), P(ctx.axis))
    ours = smap(allreduce, in_specs=(P(ctx.axis),), out_specs=P(ctx.axis), mesh=ctx.mesh, jit=True)
    theirs = jax.jit(jax.shard_map(lambda v: lax.psum(v, ctx.axis), mesh=ctx.mesh, in_specs=P(ctx.axis),
                                   out_specs=P(ctx.axis)))
    return ctx.time("allreduce", n, lambda: ours(x), {"lax.psum": lambda: theirs(x)}, collective=["lax.psum"])


def _case_mpi4jax(ctx: Context, n: int) -> list[Timing]:
    """shardax's allreduce and mpi4jax's in the same processes (started by ``mpirun``), every rank timing both."""
    import jax
    import mpi4jax  # type: ignore[import-not-found]
    from jax.sharding import PartitionSpec as P
    from mpi4py import MPI  # type: ignore[import-not-found]

    from ..comm import allreduce
    from ..core import smap

    x = ctx.put(np.ones((len(ctx.devices), n), np.float32), P(ctx.axis))
    ours = smap(allreduce, in_specs=(P(ctx.axis),), out_specs=P(ctx.axis), mesh=ctx.mesh, jit=True)
    local = jax.device_put(np.ones(n, np.float32), jax.local_devices()[0])
    theirs = jax.jit(lambda v: mpi4jax.allreduce(v, op=MPI.SUM, comm=MPI.COMM_WORLD))
    first, times = time_rounds({"shardax": lambda: ours(x), "mpi4jax": lambda: theirs(local)}, ctx.repeat)
    return [Timing("allreduce", "mpi4jax", n, times["shardax"], times["mpi4jax"], first["shardax"])]


def _case_alltoallv(ctx: Context, rows: int, width: int = 16) -> list[Timing]:
    from jax import lax
    from jax.sharding import PartitionSpec as P

    from ..comm import alltoallv
    from ..core import ALL, rank_info, smap

    size = len(ctx.devices)
    rng = np.random.default_rng(0)
    counts = rng.multinomial(rows, [1 / size] * size, size=size).astype(np.int32)  # (source, destination)
    capacity = int(counts.sum(0).max())
    x = ctx.put(rng.standard_normal((size, rows, width)).astype(np.float32), P(ctx.axis))
    c = ctx.put(counts, P(ctx.axis))

    def tiled(v: Any) -> Any:
        return lax.all_to_all(v.reshape(size, -1, width), rank_info().axis_names, 0, 0, tiled=True).reshape(-1, width)

    ours = smap(lambda v, k: alltoallv(v, k, capacity=capacity)[0], in_specs=(ALL, ALL), out_specs=ALL,
                mesh=ctx.mesh, jit=True)
    theirs = smap(tiled, in_specs=(ALL,), out_specs=ALL, mesh=ctx.mesh, jit=True)
    return ctx.time("alltoallv", rows, lambda: ours(x, c), {"all_to_all": lambda: theirs(x)},
                    collective=["all_to_all"])


def _case_zsort(ctx: Context, n: int) -> list[Timing]:
    from ..particles import zsort

    pos, ids, mass = _points(n), np.arange(n, dtype=np.int32), np.ones(n, np.float32)
    part = ctx.particles(pos, mass=mass)
    sort = zsort.smap(ctx.mesh)
    if ctx.backend == "cpu":
        return ctx.time("zsort", n, lambda: sort(part, box=1.0), {"NumPy": lambda: numpy_zsort(pos, ids, mass)})
    import jax

    with jax.enable_x64(True):
        device = jax.local_devices()[0]
        args = [jax.device_put(a, device) for a in (pos, ids, mass)]
        jitted = jax.jit(jax_zsort)
        return ctx.time("zsort", n, lambda: sort(part, box=1.0), {"jnp.argsort": lambda: jitted(*args)})


def _case_knn(ctx: Context, n: int, k: int = 9) -> list[Timing]:
    from ..spatial import knn

    pos = _points(n)
    part = ctx.particles(pos)
    search = knn.smap(ctx.mesh)
    ours, setup_s = _sized_call(lambda **options: search(part, k, **options))
    if ctx.backend != "cpu":
        import functools

        import jax

        one = jax.device_put(pos, jax.local_devices()[0])
        brute = jax.jit(functools.partial(jax_brute_knn, k=k))
        return ctx.time("knn", n, ours, {"brute force": lambda: brute(one)}, setup_s=setup_s)
    from scipy.spatial import cKDTree  # pyright: ignore[reportAttributeAccessIssue]

    return ctx.time("knn", n, ours, {"cKDTree": lambda: cKDTree(pos).query(pos, k=k, workers=-1)}, setup_s=setup_s)


def _case_fof(ctx: Context, n: int, b: float = 0.2) -> list[Timing]:
    from ..spatial import fof

    pos = _points(n)
    linking_length = b / n ** (1 / 3)
    part = ctx.particles(pos)
    groups = fof.smap(ctx.mesh)
    ours, setup_s = _sized_call(
        lambda **options: groups(part, linking_length, box=1.0, min_members=2, **options).labels)
    return ctx.time("fof", n, ours, {"scipy FoF": lambda: scipy_fof(pos.astype(np.float64), linking_length)},
                    setup_s=setup_s)


def _case_potrs(ctx: Context, n: int) -> list[Timing]:
    import jax
    from jax.sharding import PartitionSpec as P

    from ..linalg import potrs

    rng = np.random.default_rng(0)
    m = rng.standard_normal((n, n))
    a = m @ m.T / n + np.eye(n)
    b = rng.standard_normal((n, 1))
    with jax.enable_x64(True):
        ad, bd = ctx.put(a, P(None, ctx.axis)), ctx.put(b, P())
        if ctx.backend == "cpu":
            import scipy.linalg as sl

            anchors = {"cho_solve": lambda: sl.cho_solve(sl.cho_factor(a, lower=True), b)}
        else:
            import jax.scipy.linalg as jsl

            device = jax.local_devices()[0]
            one_a, one_b = jax.device_put(a, device), jax.device_put(b, device)
            solve = jax.jit(lambda a, b: jsl.cho_solve(jsl.cho_factor(a, lower=True), b))
            anchors = {"jax cho_solve": lambda: solve(one_a, one_b)}
        return ctx.time("potrs", n, lambda: potrs(ad, bd), anchors, flops=n**3 / 3 + 2 * n**2)


def _case_syevd(ctx: Context, n: int) -> list[Timing]:
    import jax
    from jax.sharding import PartitionSpec as P

    from ..linalg import syevd

    m = np.random.default_rng(1).standard_normal((n, n))
    a = (m + m.T) / 2
    with jax.enable_x64(True):
        ad = ctx.put(a, P(None, ctx.axis))
        if ctx.backend == "cpu":
            import scipy.linalg as sl

            return ctx.time("syevd", n, lambda: syevd(ad), {"eigh": lambda: sl.eigh(a)})
        one = jax.device_put(a, jax.local_devices()[0])
        eigh = jax.jit(jax.numpy.linalg.eigh)
        return ctx.time("syevd", n, lambda: syevd(ad), {"jnp eigh": lambda: eigh(one)})


def _case_fftn(ctx: Context, n: int) -> list[Timing]:
    import importlib.util

    import jax
    import jax.numpy as jnp
    from jax.sharding import Mesh
    from jax.sharding import PartitionSpec as P

    from ..fft import fftn

    host = (np.random.default_rng(0).standard_normal((n, n, n)) + 1j).astype(np.complex64)
    slab = Mesh(ctx.devices.reshape(-1, 1), ("x", "y"))
    x = ctx.put(host, P("x"), slab)
    ours = jax.jit(lambda v: fftn(v, mesh=slab, spec=P("x"), layout="transposed"))
    one = jax.device_put(host, jax.local_devices()[0])
    single = jax.jit(jnp.fft.fftn)
    anchors: dict[str, Callable[[], Any]] = {"jnp.fft": lambda: single(one)}
    if len(ctx.devices) > 1 and importlib.util.find_spec("jaxdecomp") is not None:
        import jaxdecomp  # type: ignore[import-not-found]

        decomp_mesh = Mesh(ctx.devices.reshape(-1, 1), ("z", "y"))
        xd = ctx.put(host, P("z", "y"), decomp_mesh)
        decomp = jax.jit(lambda v: jaxdecomp.fft.pfft3d(v, backend="JAX"))  # pyright: ignore[reportAttributeAccessIssue]
        anchors["jaxdecomp"] = lambda: decomp(xd)
    return ctx.time("fftn", n, lambda: ours(x), anchors, collective=["jaxdecomp"])


CASES: dict[str, Callable[[Context, int], list[Timing]]] = {
    "allreduce": _case_allreduce, "mpi4jax": _case_mpi4jax, "alltoallv": _case_alltoallv, "zsort": _case_zsort,
    "knn": _case_knn, "fof": _case_fof, "potrs": _case_potrs, "syevd": _case_syevd, "fftn": _case_fftn,
}


def _short(seconds: Sequence[float]) -> str:
    if not seconds:
        return "-"
    t = float(np.median(seconds))
    return f"{t * 1e3:.1f} ms" if t < 1 else f"{t:.2f} s"


def worker(plan_path: str) -> int:
    """Run the cases of a plan on this process's devices; rank 0 appends one JSON line per timing to the result.

    The plan (JSON) holds ``cases`` (``[case, size]`` pairs, a case being a kernel name or ``"mpi4jax"``),
    ``repeat``, ``cpu_devices`` (``None`` on an accelerator), ``devices`` (per process) and ``result`` (the path of the JSON-lines file). Each record names its ``case``. A
    failing case is written as ``{"case", "kernel", "size", "error"}`` and the next one runs; on
    several processes the error ends the run instead (the other ranks would wait for it in a collective).
    """
    from .._compile_cache import settle_compilation_cache
    from ..runtime import initialize

    with open(plan_path) as f:
        plan = json.load(f)
    settle_compilation_cache(initialize(cpu_devices=plan["cpu_devices"]))  # (shares first compilations across ranks)
    ctx = Context(plan["repeat"], plan.get("devices"))
    for case, size in plan["cases"]:
        try:
            timings = CASES[case](ctx, size)
        except Exception as err:
            if ctx.world.num_processes > 1:
                raise
            first_line = (str(err).splitlines() or [""])[0][:300]
            records: list[dict[str, Any]] = [{"kernel": case, "size": size,
                                              "error": f"{type(err).__name__}: {first_line}"}]
        else:
            records = [dataclasses.asdict(t) for t in timings]
        for r in records:
            r["case"] = case
        if not ctx.main:
            continue
        with open(plan["result"], "a") as f:
            f.writelines(json.dumps(r) + "\n" for r in records)
        for r in records:
            line = r.get("error") or f"shardax {_short(r['shardax_s'])}, {r['anchor']} {_short(r['anchor_s'])}"
            sys.stdout.write(f"bench: {case} {size}: {line}\n")
            sys.stdout.flush()
    return 0

