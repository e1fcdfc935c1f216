"""The capabilities ``shardax demo`` runs, each on every process of the run and checked on process 0.

A stage runs its distributed calls through the public API on a flat mesh of every device (timed, the first call
with its compilation), gathers the results to the host of every process (collectively) and, on process 0, compares
them with the references of :mod:`shardax.testing.reference`. Every process runs the same stages in the same order
with the same shapes: the data are drawn from fixed seeds, each process passing its own slice of the particles.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from .. import comm
from .._capacity import retry_capacity
from ..core import ALL, rank_info, smap
from ..fft import fftn
from ..fields import bin_edges, paint, power_spectrum
from ..linalg import potrs, syevd
from ..particles import from_numpy, squeeze, zsort
from ..runtime import World, device_grid, flat_mesh
from ..runtime import detect_launch as detect
from ..spatial import fof, knn
from ..testing import reference as ref
from . import _demo_checks as check
from ._halos import generate
from ._selftest import run_self_test

NEIGHBOURS = 9  # the particle itself and 8 others
KNN_SAMPLE = 256  # rows checked against brute force
LINKING_B = 0.2  # linking length in mean inter-particle spacings
MIN_MEMBERS = 20
POWER_BINS = 16
RIGHT_HAND_SIDES = 4


@dataclasses.dataclass(frozen=True)
class Sizes:
    """Problem sizes of one demo run (the same on every process)."""

    particles: int
    matrix: int
    grid: int
    seed: int
    box: float = 1.0


@dataclasses.dataclass(frozen=True)
class Outcome:
    """A stage's result: its scale, the wall time of its distributed calls (the first call, compilation included,
    and a second, warm call), what it was checked against, and the failures (found on process 0 only)."""

    scale: str
    first_s: float
    warm_s: float
    reference: str
    failures: tuple[str, ...] = ()


class Context:
    """What the stages share: the world, the mesh, the sizes, the particles and the data the plots need."""

    def __init__(self, world: World, sizes: Sizes, cpu_devices: int | None) -> None:
        self.world = world
        self.sizes = sizes
        self.cpu_devices = cpu_devices
        self.lead = world.process_id == 0
        self.mesh = flat_mesh("d")
        self.pos, vel = generate(sizes.particles, sizes.box, sizes.seed)
        mine = np.array_split(np.arange(sizes.particles), world.num_processes)[world.process_id]
        # Rows are numbered by global input index (ids), which here is the row of `self.pos`.
        self.part = from_numpy(self.pos[mine], mesh=self.mesh, vel=vel[mine],
                               mass=np.ones(len(mine), np.float32), capacity_factor=1.5)
        self.valid_ids = _valid_rows(self.part.ids, self.part.num)
        self.plot_data: dict[str, Any] = {}


def gather(x: Any) -> np.ndarray:
    """A global array, whole, on every process (collective)."""
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        return np.asarray(multihost_utils.process_allgather(x, tiled=True))
    return np.asarray(x)


def _valid_rows(values: Any, num: Any) -> np.ndarray:
    """The valid rows of a global `(ndev, cap, ...)` array, in (device, row) order."""
    values, num = gather(values), gather(num)
    return values[np.arange(values.shape[1])[None, :] < num[:, None]]


def by_id(ctx: Context, values: Any) -> np.ndarray:
    """Per-row results of :attr:`Context.part` (`(ndev, cap, ...)`, rows aligned with it) in global id order."""
    rows = _valid_rows(values, ctx.part.num)
    out = np.empty_like(rows)
    out[ctx.valid_ids] = rows
    return out


def _put(mesh: Mesh, host: np.ndarray, spec: P) -> jax.Array:
    return jax.make_array_from_callback(host.shape, NamedSharding(mesh, spec), lambda index: host[index])


def _timed(fn: Callable[[], Any]) -> tuple[Any, tuple[float, float]]:
    """``fn()`` called twice: its result and the seconds of the first (compiling) and the second (warm) call."""
    seconds = []
    for _ in range(2):
        start = time.perf_counter()
        out = jax.block_until_ready(fn())
        seconds.append(time.perf_counter() - start)
    return out, (seconds[0], seconds[1])


def _failures(*messages: str) -> tuple[str, ...]:
    return tuple(m for m in messages if m)


def _collectives(values: jax.Array) -> dict[str, jax.Array]:
    """Local view: ``values (4,)`` int32 on each device through the collectives the self-test does not cover."""
    size = rank_info().size
    return {"rank": jnp.int32(rank_info().rank), "allgather": comm.allgather(values), "scan": comm.scan(values),
            "shift": comm.shift(values), "bcast": comm.bcast(values, root=size - 1),
            "max": comm.allreduce(values, op="max")}


def runtime_and_collectives(ctx: Context) -> Outcome:
    """The world as asked, the doctor's self-test (allreduce, alltoall, alltoallv) and the other collectives."""
    w, mesh = ctx.world, ctx.mesh
    ndev = mesh.size
    host = ((np.arange(ndev * 4).reshape(ndev, 4) * 37) % 101).astype(np.int32)
    fn = smap(_collectives, in_specs=P(ALL), out_specs=P(ALL), mesh=mesh, jit=True)

    self_test = run_self_test(mesh, 64 * 1024, 3)
    values = _put(mesh, host, P("d"))
    outs, times = _timed(lambda: fn(values))
    got = {name: gather(value) for name, value in outs.items()}
    scale = f"{ndev} device{'s' if ndev > 1 else ''} ({w.num_processes} x {w.local_device_count})"
    reference = "NumPy, exact"
    if not ctx.lead:
        return Outcome(scale, *times, reference)
    world_problems = []
    if detect().num_processes != w.num_processes:
        world_problems.append(f"{w.num_processes} processes joined, the launcher started {detect().num_processes}")
    if ctx.cpu_devices is not None and w.local_device_count != ctx.cpu_devices:
        world_problems.append(f"{w.local_device_count} devices per process, asked for {ctx.cpu_devices}")
    if w.device_count != w.num_processes * w.local_device_count or device_grid().shape != (
            w.num_processes, w.local_device_count):
        world_problems.append(f"device grid {device_grid().shape} does not match {w.num_processes} processes x "
                              f"{w.local_device_count} devices")
    failures = _failures(
        *world_problems,
        *(f"{r.name}: {r.error or 'wrong result'}" for r in self_test if not r.ok),
        check.exact("rank_info", got["rank"], np.arange(ndev)),
        check.exact("allgather", got["allgather"], np.broadcast_to(host, (ndev, *host.shape))),
        check.exact("scan", got["scan"], np.cumsum(host, axis=0)),
        check.exact("shift", got["shift"], np.roll(host, 1, axis=0)),
        check.exact("bcast", got["bcast"], np.broadcast_to(host[-1], host.shape)),
        check.exact("allreduce max", got["max"], np.broadcast_to(host.max(axis=0), host.shape)))
    return Outcome(scale, *times, reference, failures)


def zsort_stage(ctx: Context) -> Outcome:
    """Distributed Morton sort with equalising: the global sequence and the balance."""
    (zpart, overflow), times = _timed(lambda: zsort.smap(ctx.mesh)(ctx.part, box=ctx.sizes.box))
    dense = squeeze(zpart)
    counts, overflow = gather(zpart.num), gather(overflow)
    scale = f"{ctx.sizes.particles} particles"
    reference = "NumPy Morton argsort"
    if not ctx.lead:
        return Outcome(scale, *times, reference)
    order = ref.morton_order(ctx.pos, box=ctx.sizes.box, ids=np.arange(len(ctx.pos)))
    balance = int(counts.max() - counts.min())
    return Outcome(scale, *times, reference, _failures(
        check.exact("z-ordered ids", dense["ids"], order),
        check.exact("z-ordered positions", dense["pos"], ctx.pos[order]),
        "" if balance <= 1 else f"per-device counts differ by {balance} (equalize promises at most 1)",
        "" if not overflow.any() else "zsort reported an overflow"))


def _density_and_neighbours(distances: jax.Array, indices: jax.Array, part: Any, *, total: int,
                            volume: float) -> dict[str, jax.Array]:
    """kNN density in units of the mean, ``(k - 1) / (4/3 pi r_k^3)`` over ``total / volume``; indices kept."""
    del part
    radius = distances[:, -1]
    density = (NEIGHBOURS - 1) / (4 / 3 * math.pi * radius**3) / (total / volume)
    return {"density": density, "neighbours": indices}


def knn_density(ctx: Context) -> Outcome:
    """k nearest neighbours with a ``reduce=`` density estimate, against brute force on a sample of rows."""
    n, box = ctx.sizes.particles, ctx.sizes.box
    reduce = functools.partial(_density_and_neighbours, total=n, volume=box**3)
    search = knn.smap(ctx.mesh)  # one constructor: each knn.smap(...) compiles anew
    res, times = _timed(lambda: search(ctx.part, NEIGHBOURS, box=box, reduce=reduce))
    distances = by_id(ctx, res.distances)
    density = by_id(ctx, res.indices["density"])
    neighbours = by_id(ctx, res.indices["neighbours"])
    ctx.plot_data["density"] = density
    scale = f"{n} particles, k={NEIGHBOURS}"
    reference = f"brute force, {min(KNN_SAMPLE, n)} rows"
    if not ctx.lead:
        return Outcome(scale, *times, reference)
    sample = np.sort(np.random.default_rng(ctx.sizes.seed).choice(n, min(KNN_SAMPLE, n), replace=False))
    want_d, want_i = ref.brute_knn(ctx.pos, min(NEIGHBOURS + 1, n), queries=sample, box=box)
    want_density = (NEIGHBOURS - 1) / (4 / 3 * math.pi * want_d[:, NEIGHBOURS - 1] ** 3) / (n / box**3)
    return Outcome(scale, *times, reference, _failures(
        check.knn_mismatch(distances[sample], neighbours[sample], want_d, want_i, np.float32),
        check.close("density", density[sample], want_density, dtype=np.float32)))


def fof_and_catalogue(ctx: Context) -> Outcome:
    """Friends-of-friends labels of every particle and the catalogue of groups, against a union-find."""
    n, box = ctx.sizes.particles, ctx.sizes.box
    linking_length = LINKING_B * box / n ** (1 / 3)
    result, times = _timed(lambda: retry_capacity(fof.smap(), ctx.part, linking_length, box=(box,) * 3,
                                                  min_members=MIN_MEMBERS)[0])
    catalogue = result.catalogue.to_numpy()
    labels = by_id(ctx, result.labels)
    ctx.plot_data["halo_mass"] = catalogue["mass"]
    scale = f"{n}, b={LINKING_B}: {len(catalogue['count'])} halos"
    reference = f"union-find ({'SciPy KDTree' if _have_scipy() else 'NumPy grid'})"
    if not ctx.lead:
        return Outcome(scale, *times, reference)
    want = ref.fof_labels(ctx.pos, linking_length, box=box, min_members=MIN_MEMBERS)
    groups, counts = np.unique(want[want >= 0], return_counts=True)
    com = ref.fof_catalogue(ctx.pos, want, box=box)["com"]
    com_error = (float(np.abs(ref.minimum_image(catalogue["com"] - com, box)).max(initial=0.0))
                 if catalogue["com"].shape == com.shape else math.inf)
    return Outcome(scale, *times, reference, _failures(
        check.exact("labels", labels, want),
        check.exact("catalogue labels", catalogue["label"], groups),
        check.exact("catalogue counts", catalogue["count"], counts),
        check.close("catalogue masses", catalogue["mass"], counts.astype(np.float64), dtype=np.float32),
        check.below("catalogue centre of mass error / box", com_error / box, 1e-5)))


def _have_scipy() -> bool:
    try:
        import scipy.spatial  # noqa: F401
    except ImportError:
        return False
    return True


def _spd_matrix(n: int, seed: int) -> np.ndarray:
    """A well-conditioned symmetric positive definite float32 matrix (eigenvalues in about [1, 5])."""
    m = np.random.default_rng(seed).standard_normal((n, n))
    return (m @ m.T / n + np.eye(n)).astype(np.float32)


def potrs_stage(ctx: Context) -> Outcome:
    """Cholesky solve of a row-sharded SPD matrix, against ``numpy.linalg.solve`` in float64."""
    size, tile = ctx.sizes.matrix, _tile(ctx.sizes.matrix, ctx.mesh.size)
    a = _spd_matrix(size, ctx.sizes.seed + 1)
    b = np.random.default_rng(ctx.sizes.seed + 2).standard_normal((size, RIGHT_HAND_SIDES)).astype(np.float32)
    a_global, b_global = _put(ctx.mesh, a, P("d", None)), _put(ctx.mesh, b, P("d", None))
    (x, status), times = _timed(lambda: potrs(a_global, b_global, tile=tile, mesh=ctx.mesh, return_status=True))
    x, status = gather(x), int(gather(status))
    scale = f"N={size}, {RIGHT_HAND_SIDES} rhs, f32"
    reference = "linalg.solve f64"
    if not ctx.lead:
        return Outcome(scale, *times, reference)
    a64 = a.astype(np.float64)
    residual = float(np.linalg.norm(a64 @ x - b) / (np.linalg.norm(a64) * np.linalg.norm(x)))
    return Outcome(scale, *times, reference, _failures(
        "" if status == 0 else f"status {status} (not positive definite?)",
        check.close("x", x, np.linalg.solve(a64, b.astype(np.float64)), kind="linalg", dtype=np.float32),
        check.below("relative residual", residual, 1e-5)))


def _tile(n: int, ndev: int) -> int:
    """A block size that gives every device at least two blocks."""
    return max(8, min(256, n // (2 * ndev)))


def syevd_stage(ctx: Context) -> Outcome:
    """Hermitian eigensolver on a row-sharded matrix, against ``numpy.linalg.eigh`` in float64."""
    size = ctx.sizes.matrix
    a = _spd_matrix(size, ctx.sizes.seed + 3)
    a_global = _put(ctx.mesh, a, P("d", None))
    (w, v, status), times = _timed(lambda: syevd(a_global, mesh=ctx.mesh, return_status=True))
    w, v, status = gather(w), gather(v).astype(np.float64), int(gather(status))
    scale = f"N={size}, f32"
    reference = "linalg.eigh f64"
    if not ctx.lead:
        return Outcome(scale, *times, reference)
    a64 = a.astype(np.float64)
    norm = float(np.linalg.norm(a64))
    residual = float(np.linalg.norm(a64 @ v - v * w[None, :]) / norm)
    orthogonality = float(np.linalg.norm(v.T @ v - np.eye(size)) / math.sqrt(size))
    return Outcome(scale, *times, reference, _failures(
        "" if status == 0 else f"status {status} (Jacobi did not converge)",
        check.close("eigenvalues", w, np.linalg.eigvalsh(a64), kind="linalg", dtype=np.float32),
        check.below("||A V - V W|| / ||A||", residual, 1e-4),
        check.below("||V^T V - I|| / sqrt(N)", orthogonality, 1e-4)))


def fftn_stage(ctx: Context) -> Outcome:
    """3D complex FFT of a slab-sharded array, against ``numpy.fft.fftn`` in complex128."""
    n = ctx.sizes.grid
    rng = np.random.default_rng(ctx.sizes.seed + 4)
    x = (rng.standard_normal((n, n, n)) + 1j * rng.standard_normal((n, n, n))).astype(np.complex64)
    x_global = _put(ctx.mesh, x, P("d"))
    spectrum, times = _timed(lambda: fftn(x_global, mesh=ctx.mesh, norm="ortho"))
    got = gather(spectrum)
    scale = f"{n}^3 complex64"
    reference = "numpy.fft.fftn"
    if not ctx.lead:
        return Outcome(scale, *times, reference)
    want = np.fft.fftn(x.astype(np.complex128), norm="ortho")
    return Outcome(scale, *times, reference, _failures(check.close("fftn", got, want, kind="fft", dtype=np.complex64)))


def power_stage(ctx: Context) -> Outcome:
    """CIC paint of the particles and the binned power spectrum of the overdensity, against NumPy."""
    n, box = ctx.sizes.grid, ctx.sizes.box
    shape = (n, n, n)

    def run() -> tuple[jax.Array, jax.Array, tuple[jax.Array, jax.Array, jax.Array]]:
        rho = retry_capacity(paint, ctx.part, shape, box=box, mesh=ctx.mesh)[0]
        delta = rho / jnp.mean(rho) - 1
        return rho, delta, power_spectrum(delta, box=box, bins=POWER_BINS)

    (rho, delta, (k, pk, modes)), times = _timed(run)
    rho, delta, k, pk, modes = (gather(x) for x in (rho, delta, k, pk, modes))
    scale = f"{ctx.sizes.particles} on {n}^3"
    reference = "NumPy CIC + rfftn"
    if not ctx.lead:
        return Outcome(scale, *times, reference)
    want_k, want_pk, want_modes = ref.power_spectrum(delta, box=box, edges=bin_edges(POWER_BINS, shape, box))
    ctx.plot_data["power"] = (k, pk, want_pk, box**3 / ctx.sizes.particles, n)
    want_rho = ref.cic_paint(ctx.pos, shape, box=box)
    peak = float(np.max(want_pk)) or 1.0
    return Outcome(scale, *times, reference, _failures(
        check.close("painted mass", np.sum(rho, dtype=np.float64), float(len(ctx.pos)), dtype=np.float32),
        check.close("painted field", rho, want_rho, kind="linalg", dtype=np.float32),
        check.exact("modes per bin", modes, want_modes),
        check.close("k per bin", k, want_k, dtype=np.float32),
        check.close("P(k) / max P", pk / peak, want_pk / peak, kind="fft", dtype=np.float32)))


# What each stage's first call compiles (shown while it runs).
COMPILES = {"zsort": "the z-order sort", "knn density": "k nearest neighbours",
            "fof + catalogue": "friends-of-friends", "potrs": "the Cholesky solve", "syevd": "the eigensolver",
            "fftn": "the FFT", "paint + power spectrum": "CIC paint and the power spectrum"}

STAGES: tuple[tuple[str, Callable[[Context], Outcome]], ...] = (
    ("runtime + collectives", runtime_and_collectives),
    ("zsort", zsort_stage),
    ("knn density", knn_density),
    ("fof + catalogue", fof_and_catalogue),
    ("potrs", potrs_stage),
    ("syevd", syevd_stage),
    ("fftn", fftn_stage),
    ("paint + power spectrum", power_stage),
)
