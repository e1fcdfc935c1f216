"""Benchmark: every shardax kernel against its reference on one GPU (or CPU with ``--quick``), in one command.

Each section runs in a fresh subprocess with its own time limit (so a hang or an out-of-memory error costs one
section, and ``peak_bytes_in_use`` starts from zero in each); a section that fails or times out is recorded with its
error and the run goes on. Every kernel is timed against its reference in the same process: the first call
(compile + run) and the median of ``--repeat`` further calls, each waited for; its result is checked against the
reference (or SciPy / NumPy on a sample where the reference is not JAX).

    PYTHONPATH=src python benchmarks/gpu.py --out gpu.json       # full sizes (at most --budget, 350 s)
    PYTHONPATH=src python benchmarks/gpu.py --quick               # tiny sizes, any backend (a smoke test)
    PYTHONPATH=src python benchmarks/gpu.py --only knn_1e6,potrs_f32

Sections (full sizes) and references:

- ``knn_1e6`` (k=9) and ``knn_1e7`` (k=30), periodic unit box: ``jax.jit(knn)`` and ``knn.smap`` on a mesh of one
  device; exactness from ``cKDTree`` on 1000 sampled queries.
- ``fof_1e6`` (b=0.2), ``fof_1e6_b07`` (b=0.7), ``fof_1e7`` (b=0.2), linking length ``b`` times the mean spacing:
  ``jax.jit(fof)`` and ``fof.smap``; labels against SciPy (``query_pairs`` + ``connected_components``, labelled by
  the smallest member index, groups below ``min_members`` unlabelled) at 1e6.
- ``paint`` (paint and readout of 1e7 particles on 256^3) against plain JAX CIC (eight ``.at[].add`` / gathers in
  one jit); ``power`` (256^3) against ``jnp.fft.rfftn`` and the same binning.
- ``potrs_f32`` (N=16384), ``potrs_f64`` (N=8192) against ``jax.scipy.linalg.cho_factor``/``cho_solve``;
  ``syevd`` (float32, N=4096) against ``jnp.linalg.eigh``; ``fftn`` (complex64 512^3) against ``jnp.fft.fftn``.
- ``zsort`` (1e7, ``jax.jit(zsort)`` and ``zsort.smap``) against a NumPy Morton argsort at 1e6.
- ``pm_forces`` (256^3 particles on a 256^3 mesh, ``sx.nbody.pm_forces``) against JaxPM 0.1.6's ``pm_forces``
  (where JaxPM and jaxdecomp import; the row says so where they do not), forces compared in the same units.

kNN and FoF at 1e7 report the device's peak memory per particle (``memory_stats()["peak_bytes_in_use"]``) after
the shardax calls. Output: a table on stdout and the JSON (``--out``, default ``gpu_results.json``): one record per
row with ``first_s``, ``median_s``, ``reference_s``, ``ratio`` (shardax / reference), ``exact`` and ``detail``;
the global rows (``.smap``, ``paint``, ``readout``) also give ``vs_jit``, their time over that of the jitted local
view on the same rows (padding rows included) giving the same outputs.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import numpy as np

# Section name -> time limit in seconds (full sizes; --quick gives every section _QUICK_LIMIT). The whole run also
# stops starting sections when --budget seconds are spent (a section gets at most what is left).
LIMITS = {
    "knn_1e6": 40, "knn_1e7": 70, "fof_1e6": 40, "fof_1e6_b07": 30, "fof_1e7": 60, "paint": 30, "power": 20,
    "potrs_f32": 25, "potrs_f64": 25, "syevd": 30, "fftn": 20, "zsort": 30,
    "pm_forces": 45,
}
_QUICK_LIMIT = 120
_BUDGET = 350.0


def _sizes(quick: bool) -> dict[str, Any]:
    if quick:
        return {"knn_1e6": 3000, "knn_1e7": 5000, "fof": 3000, "fof_1e7": 5000, "paint": 20000, "grid": 16,
                "potrs_f32": 256, "potrs_f64": 128, "syevd": 128, "fftn": 16, "zsort": 20000, "zsort_ref": 5000,
                "samples": 100, "repeat": 2, "pm": 16}
    return {"knn_1e6": 10**6, "knn_1e7": 10**7, "fof": 10**6, "fof_1e7": 10**7, "paint": 10**7, "grid": 256,
            "potrs_f32": 16384, "potrs_f64": 8192, "syevd": 4096, "fftn": 512, "zsort": 10**7, "zsort_ref": 10**6,
            "samples": 1000, "repeat": 3, "pm": 256}


# ---------------------------------------------------------------------------------------------------------------
# Helpers run inside a section's process.

def timed(fn: Callable[[], Any], repeat: int) -> tuple[float, float, Any]:
    """``(first call s, median of repeat calls s, result)``, each call waited for."""
    import jax

    start = time.perf_counter()
    out = jax.block_until_ready(fn())
    first = time.perf_counter() - start
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        out = jax.block_until_ready(fn())
        times.append(time.perf_counter() - start)
    return first, statistics.median(times), out


def _peak_bytes() -> int | None:
    import jax

    stats = jax.devices()[0].memory_stats() or {}
    return stats.get("peak_bytes_in_use")


def _row(kernel: str, case: str, first: float, median: float, reference: str | None = None,
         ref_median: float | None = None, exact: bool | None = None, detail: str = "", **extra: Any
         ) -> dict[str, Any]:
    ratio = median / ref_median if ref_median else None
    return {"kernel": kernel, "case": case, "first_s": first, "median_s": median, "reference": reference,
            "reference_s": ref_median, "ratio": ratio, "exact": exact, "detail": detail, **extra}


def _one_device_mesh() -> Any:
    import jax
    from jax.sharding import Mesh

    return Mesh(np.array(jax.devices()[:1]), ("d",))


def _local_view(part: Any) -> Any:
    """The one device's particles as the global ``part`` holds them (its padding rows too), for the jitted local
    view the global function is compared with."""
    import shardax as sx

    return sx.particles.Particles(pos=part.pos[0], num=part.num[0])


def _uniform(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).random((n, 3), dtype=np.float32)


# ---------------------------------------------------------------------------------------------------------------
# Sections: each returns its rows.

def _knn(n: int, k: int, sizes: dict[str, Any]) -> list[dict[str, Any]]:
    import jax
    import jax.numpy as jnp
    from scipy.spatial import cKDTree  # pyright: ignore[reportAttributeAccessIssue]

    import shardax as sx

    repeat = sizes["repeat"]
    host = _uniform(n)
    mesh = _one_device_mesh()
    part = sx.particles.from_numpy(host, mesh=mesh)
    local_part = _local_view(part)
    local = jax.jit(lambda p: sx.spatial.knn(p, k, box=1.0))
    first, median, res = timed(lambda: local(local_part), repeat)
    peak_local = _peak_bytes()
    glob = sx.spatial.knn.smap(mesh)
    g_first, g_median, g_res = timed(lambda: glob(part, k, box=1.0), repeat)
    peak = _peak_bytes()
    sample = np.random.default_rng(1).choice(n, sizes["samples"], replace=False)
    tree = cKDTree(host.astype(np.float64), boxsize=1.0, balanced_tree=False, compact_nodes=False)  # builds faster
    ref_d, ref_i = tree.query(host[sample].astype(np.float64), k)
    rows = []
    for case, (f, m, r) in {"jax.jit(knn)": (first, median, res), "knn.smap": (g_first, g_median, g_res)}.items():
        dist = np.asarray(jnp.asarray(r.distances).reshape(-1, k)[sample])  # only the sample leaves the device
        idx = np.asarray(jnp.asarray(r.indices).reshape(-1, k)[sample])
        err = float(np.max(np.abs(dist - ref_d)))
        # Indices may differ only between neighbours at equal float32 distances.
        same = float(np.mean(idx == ref_i))
        exact = err <= 1e-5 * max(1.0, float(np.max(ref_d))) and same >= 0.999
        rows.append(_row("knn", f"{n:.0e} k={k} {case}", f, m, "cKDTree (sample)", None, exact,
                         f"max |d - d_ref| {err:.2e}, same indices {same:.4f}", vs_jit=m / median))
    for row, p in zip(rows, (peak_local, peak), strict=True):
        row["peak_bytes_per_particle"] = None if p is None else p / n
    return rows


def _fof_reference(host: np.ndarray, ll: float, min_members: int) -> np.ndarray:
    from shardax.cli._bench_cases import scipy_fof

    comp = scipy_fof(host.astype(np.float64), ll)
    n = len(host)
    smallest = np.full(comp.max() + 1, n, np.int64)
    np.minimum.at(smallest, comp, np.arange(n))
    count = np.bincount(comp)
    return np.where(count[comp] >= min_members, smallest[comp], -1)


def _fof(n: int, b: float, sizes: dict[str, Any], check: bool) -> list[dict[str, Any]]:
    import jax

    import shardax as sx

    repeat = sizes["repeat"]
    host = _uniform(n, seed=2)
    ll = b / n ** (1 / 3)
    min_members = 20 if n >= 10**5 else 2
    mesh = _one_device_mesh()
    part = sx.particles.from_numpy(host, mesh=mesh)
    local_part = _local_view(part)
    local = jax.jit(lambda p: sx.spatial.fof(p, ll, box=1.0, min_members=min_members))
    first, median, res = timed(lambda: local(local_part), repeat)
    peak_local = _peak_bytes()
    glob = sx.spatial.fof.smap(mesh)
    g_first, g_median, g_res = timed(lambda: glob(part, ll, box=1.0, min_members=min_members), repeat)
    peak = _peak_bytes()
    results = {"jax.jit(fof)": (first, median, np.asarray(res.labels)[:n], peak_local),
               "fof.smap": (g_first, g_median, np.asarray(g_res.labels).reshape(-1)[:n], peak)}
    ref = None
    ref_s = None
    if check:
        start = time.perf_counter()
        ref = _fof_reference(host, ll, min_members)
        ref_s = time.perf_counter() - start
    rows = []
    for case, (f, m, got, p) in results.items():
        exact = None if ref is None else bool(np.array_equal(got, ref))
        groups = int(np.sum(np.unique(got) >= 0))
        detail = f"{groups} groups" + ("" if ref is None else f", {int(np.sum(got != ref))} labels differ")
        rows.append(_row("fof", f"{n:.0e} b={b} {case}", f, m, None if ref is None else "scipy (1 run)", ref_s,
                         exact, detail, peak_bytes_per_particle=None if p is None else p / n, vs_jit=m / median))
    return rows


def _cic_corners(pos: Any, shape: tuple[int, int, int]) -> list[tuple[Any, Any]]:
    """The eight ``(index (n, 3), weight (n,))`` corners of plain JAX CIC in a unit periodic box."""
    import jax.numpy as jnp

    scaled = pos * jnp.asarray(shape, jnp.float32)
    lower = jnp.floor(scaled)
    frac = scaled - lower
    lower = lower.astype(jnp.int32)
    corners = []
    for c in np.ndindex(2, 2, 2):
        on = jnp.asarray(c, bool)[None, :]
        weight = jnp.prod(jnp.where(on, frac, 1 - frac), axis=1)
        index = (lower + jnp.asarray(c, jnp.int32)[None, :]) % jnp.asarray(shape, jnp.int32)[None, :]
        corners.append((index, weight))
    return corners


def _paint(sizes: dict[str, Any]) -> list[dict[str, Any]]:
    import jax
    import jax.numpy as jnp

    import shardax as sx

    n, g, repeat = sizes["paint"], sizes["grid"], sizes["repeat"]
    shape = (g, g, g)
    host = _uniform(n, seed=3)
    mesh = _one_device_mesh()
    part = sx.particles.from_numpy(host, mesh=mesh, capacity_factor=1.0)
    pos = jax.device_put(host)

    @jax.jit
    def plain_paint(pos: jax.Array) -> jax.Array:
        rho = jnp.zeros(shape, jnp.float32)
        for index, weight in _cic_corners(pos, shape):
            rho = rho.at[index[:, 0], index[:, 1], index[:, 2]].add(weight)
        return rho

    @jax.jit
    def plain_readout(field: jax.Array, pos: jax.Array) -> jax.Array:
        out = jnp.zeros(pos.shape[:1], field.dtype)
        for index, weight in _cic_corners(pos, shape):
            out = out + field[index[:, 0], index[:, 1], index[:, 2]] * weight
        return out

    first, median, rho = timed(lambda: sx.fields.paint(part, shape, box=1.0), repeat)
    _, ref_median, ref = timed(lambda: plain_paint(pos), repeat)
    # The jitted local view on the same device: what the global function may cost at most 1.1x of.
    local_part = sx.particles.Particles(pos=pos, num=jnp.int32(n))
    local_paint = jax.jit(lambda p: sx.fields.local_paint(p, shape, box=1.0)[0])
    _, local_median, _ = timed(lambda: local_paint(local_part), repeat)
    err = float(jnp.max(jnp.abs(jnp.asarray(rho) - ref)) / jnp.max(ref))
    rows = [_row("paint", f"{n:.0e} -> {g}^3", first, median, "jit .at[].add", ref_median, err < 1e-4,
                 f"max rel diff {err:.1e}", vs_jit=median / local_median)]
    field = rho
    r_first, r_median, values = timed(lambda: sx.fields.readout(field, part, box=1.0), repeat)
    field_local = jax.device_put(np.asarray(field))
    _, ref_median, ref = timed(lambda: plain_readout(field_local, pos), repeat)
    local_readout = jax.jit(lambda f, p: sx.fields.local_readout(f, p, box=1.0)[0])
    _, local_median, _ = timed(lambda: local_readout(field_local, local_part), repeat)
    err = float(jnp.max(jnp.abs(jnp.asarray(values).reshape(-1)[:n] - ref)) / jnp.max(jnp.abs(ref)))
    rows.append(_row("readout", f"{n:.0e} <- {g}^3", r_first, r_median, "jit gather CIC", ref_median, err < 1e-5,
                     f"max rel diff {err:.1e}", vs_jit=r_median / local_median))
    return rows


def _power(sizes: dict[str, Any]) -> list[dict[str, Any]]:
    import math

    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import shardax as sx

    g, repeat, bins = sizes["grid"], sizes["repeat"], 32
    mesh = _one_device_mesh()
    host = np.random.default_rng(4).standard_normal((g, g, g)).astype(np.float32)
    field = jax.device_put(host, NamedSharding(mesh, P("d")))
    edges = jnp.asarray(sx.fields.bin_edges(bins, (g, g, g), 1.0), jnp.float32)

    @jax.jit
    def plain(x: jax.Array) -> tuple[jax.Array, jax.Array]:
        power = jnp.abs(jnp.fft.rfftn(x)) ** 2
        k = [2 * math.pi * jnp.fft.fftfreq(g, 1 / g), 2 * math.pi * jnp.fft.fftfreq(g, 1 / g),
             2 * math.pi * jnp.fft.rfftfreq(g, 1 / g)]
        kx, ky, kz = jnp.meshgrid(*k, indexing="ij")
        kmag = jnp.sqrt(kx**2 + ky**2 + kz**2)
        h = 1.0 / g
        window = (jnp.sinc(kx * h / (2 * math.pi)) * jnp.sinc(ky * h / (2 * math.pi))
                  * jnp.sinc(kz * h / (2 * math.pi))) ** 4
        j = jnp.arange(g // 2 + 1)[None, None, :]
        weight = jnp.where(kmag > 0, jnp.where((j > 0) & (2 * j != g), 2, 1), 0).astype(jnp.float32)
        index = jnp.clip(jnp.digitize(kmag, edges) - 1, -1, bins)
        index = jnp.where((index >= 0) & (index < bins), index, bins).reshape(-1)
        modes = jax.ops.segment_sum(weight.reshape(-1), index, bins + 1)[:bins]
        psum = jax.ops.segment_sum((weight * power / window).reshape(-1), index, bins + 1)[:bins]
        return psum / jnp.maximum(modes, 1) / float(g) ** 6, modes  # V |delta_k|^2 / N^2 with V = 1

    first, median, (_, pk, modes) = timed(lambda: sx.fields.power_spectrum(field, box=1.0, bins=bins), repeat)
    x_local = jax.device_put(host)
    _, ref_median, (ref_pk, ref_modes) = timed(lambda: plain(x_local), repeat)
    err = float(jnp.max(jnp.abs(pk - ref_pk) / jnp.maximum(ref_pk, 1e-30)))
    exact = err < 1e-3 and bool(jnp.all(modes == ref_modes))
    return [_row("power_spectrum", f"{g}^3, {bins} bins", first, median, "jit rfftn + binning", ref_median, exact,
                 f"max rel diff {err:.1e}")]


def _potrs(n: int, dtype: str, sizes: dict[str, Any]) -> list[dict[str, Any]]:
    import jax

    if dtype == "float64":
        jax.config.update("jax_enable_x64", True)
    import jax.numpy as jnp
    import jax.scipy.linalg as jsl

    import shardax as sx

    repeat = sizes["repeat"]
    make = jax.jit(lambda key: (lambda m: m @ m.T / n + jnp.eye(n, dtype=dtype))(
        jax.random.normal(key, (n, n), dtype)))
    a = make(jax.random.key(0))
    b = jax.random.normal(jax.random.key(1), (n,), dtype)
    ref_fn = jax.jit(lambda a, b: jsl.cho_solve(jsl.cho_factor(a, lower=True), b))
    first, median, x = timed(lambda: sx.linalg.potrs(a, b), repeat)
    _, ref_median, ref = timed(lambda: ref_fn(a, b), repeat)
    residual = float(jnp.linalg.norm(jnp.matmul(a, x, precision="highest") - b) / jnp.linalg.norm(b))
    diff = float(jnp.max(jnp.abs(x - ref)) / jnp.max(jnp.abs(ref)))
    # float32 products on a GPU may run in TF32 (XLA's default precision there): 1e-3-level differences.
    tol = 1e-2 if dtype == "float32" else 1e-10
    return [_row("potrs", f"{dtype} N={n}", first, median, "cho_factor + cho_solve", ref_median,
                 residual < tol and diff < tol, f"residual {residual:.1e}, max rel diff to ref {diff:.1e}")]


def _syevd(sizes: dict[str, Any]) -> list[dict[str, Any]]:
    import jax
    import jax.numpy as jnp

    import shardax as sx

    n, repeat = sizes["syevd"], sizes["repeat"]
    m = jax.random.normal(jax.random.key(0), (n, n), jnp.float32)
    a = (m + m.T) / 2
    ref_fn = jax.jit(jnp.linalg.eigh)
    first, median, (w, _) = timed(lambda: sx.linalg.syevd(a), repeat)
    _, ref_median, (ref_w, _) = timed(lambda: ref_fn(a), repeat)
    err = float(jnp.max(jnp.abs(w - ref_w)) / jnp.max(jnp.abs(ref_w)))
    return [_row("syevd", f"float32 N={n}", first, median, "jnp.linalg.eigh", ref_median, err < 1e-4,
                 f"max rel eigenvalue diff {err:.1e}")]


def _fftn(sizes: dict[str, Any]) -> list[dict[str, Any]]:
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import shardax as sx

    g, repeat = sizes["fftn"], sizes["repeat"]
    mesh = _one_device_mesh()
    make = jax.jit(lambda key: jax.random.normal(key, (g, g, g), jnp.complex64),
                   out_shardings=NamedSharding(mesh, P("d")))
    x = make(jax.random.key(0))
    ref_fn = jax.jit(jnp.fft.fftn)
    first, median, out = timed(lambda: sx.fft.fftn(x), repeat)
    _, ref_median, ref = timed(lambda: ref_fn(x), repeat)
    err = float(jnp.max(jnp.abs(out - ref)) / jnp.max(jnp.abs(ref)))
    return [_row("fftn", f"complex64 {g}^3", first, median, "jnp.fft.fftn", ref_median, err < 1e-5,
                 f"max rel diff {err:.1e}")]


def _zsort_rows(n: int, sizes: dict[str, Any], check: bool) -> list[dict[str, Any]]:
    import jax

    import shardax as sx
    from shardax.cli._bench_cases import numpy_zsort

    repeat = sizes["repeat"]
    host = _uniform(n, seed=5)
    mesh = _one_device_mesh()
    part = sx.particles.from_numpy(host, mesh=mesh)
    local_part = _local_view(part)
    local = jax.jit(lambda p: sx.particles.zsort(p, box=1.0))
    glob = sx.particles.zsort.smap(mesh)
    first, median, (out, _) = timed(lambda: local(local_part), repeat)
    g_first, g_median, (g_out, _) = timed(lambda: glob(part, box=1.0), repeat)
    reference = ref_s = exact = None
    detail = ""
    if check:
        ids, mass = np.arange(n), np.ones(n, np.float32)
        _, ref_s, (ref_pos, _, _) = timed(lambda: numpy_zsort(host, ids, mass), repeat)
        same = [np.array_equal(np.asarray(p).reshape(-1, 3)[:n], ref_pos) for p in (out.pos, g_out.pos)]
        reference, exact = "NumPy Morton argsort", all(same)
        detail = f"positions in the NumPy order: jit {same[0]}, smap {same[1]}"
    return [_row("zsort", f"{n:.0e} jax.jit(zsort)", first, median, reference, ref_s, exact, detail),
            _row("zsort", f"{n:.0e} zsort.smap", g_first, g_median, reference, ref_s, exact, detail,
                 vs_jit=g_median / median)]


def _pm_forces(sizes: dict[str, Any]) -> list[dict[str, Any]]:
    """One PM force evaluation of n^3 particles on an n^3 mesh: ``sx.nbody.pm_forces`` against JaxPM's."""
    import jax
    import jax.numpy as jnp

    import shardax as sx

    n, repeat = sizes["pm"], sizes["repeat"]
    box = 2.0 * n
    mesh = _one_device_mesh()
    cosmo = sx.nbody.Cosmology()
    part = jax.block_until_ready(sx.nbody.lpt(cosmo, sx.nbody.white_noise(n, mesh=mesh), box=box, a=0.5, mesh=mesh))
    first, median, forces = timed(lambda: sx.nbody.pm_forces(part, box=box, mesh_per_side=n), repeat)
    try:
        from jaxpm.pm import pm_forces as jaxpm_pm_forces
    except Exception as err:  # JaxPM (and jaxdecomp) are not part of a GPU image: the row says so
        return [_row("pm_forces", f"{n}^3 on {n}^3", first, median, None, None, None,
                     f"JaxPM not importable: {type(err).__name__}: {err}")]
    flat = sx.particles.squeeze(part)
    order = np.argsort(flat["ids"])
    grid_pos = jnp.asarray(flat["pos"][order].reshape(n, n, n, 3) * (n / box))
    ref_fn = jax.jit(lambda x: jaxpm_pm_forces(x, mesh_shape=(n, n, n)))
    _, ref_median, ref = timed(lambda: ref_fn(grid_pos), repeat)
    # Same Poisson problem and gradient stencil; JaxPM's forces are in cells, shardax's in Mpc/h (box / n per cell).
    got = np.asarray(forces).reshape(-1, 3)[: n**3][order]
    want = np.asarray(ref).reshape(-1, 3) * (box / n)
    err = float(np.max(np.abs(got - want)) / np.max(np.abs(want)))
    return [_row("pm_forces", f"{n}^3 on {n}^3", first, median, "JaxPM pm_forces", ref_median, err < 1e-3,
                 f"max |F - F_JaxPM| / max |F_JaxPM| {err:.1e}")]


def _zsort(sizes: dict[str, Any]) -> list[dict[str, Any]]:
    return _zsort_rows(sizes["zsort_ref"], sizes, True) + _zsort_rows(sizes["zsort"], sizes, False)


SECTIONS: dict[str, Callable[[dict[str, Any]], list[dict[str, Any]]]] = {
    "knn_1e6": lambda s: _knn(s["knn_1e6"], 9, s),
    "knn_1e7": lambda s: _knn(s["knn_1e7"], 30, s),
    "fof_1e6": lambda s: _fof(s["fof"], 0.2, s, check=True),
    "fof_1e6_b07": lambda s: _fof(s["fof"], 0.7, s, check=True),
    "fof_1e7": lambda s: _fof(s["fof_1e7"], 0.2, s, check=False),
    "paint": _paint,
    "power": _power,
    "pm_forces": _pm_forces,
    "potrs_f32": lambda s: _potrs(s["potrs_f32"], "float32", s),
    "potrs_f64": lambda s: _potrs(s["potrs_f64"], "float64", s),
    "syevd": _syevd,
    "fftn": _fftn,
    "zsort": _zsort,
}


def run_section(name: str, quick: bool) -> list[dict[str, Any]]:
    """The rows of one section, run in this process (``main`` runs each in a subprocess of its own)."""
    import jax

    rows = SECTIONS[name](_sizes(quick))
    device = jax.devices()[0]
    for row in rows:
        row.update(section=name, backend=jax.default_backend(), device=device.device_kind, jax=jax.__version__)
    return rows


# ---------------------------------------------------------------------------------------------------------------
# The driver.

def _save_log(logs: str | None, name: str, stdout: Any, stderr: Any) -> None:
    if logs is None:
        return
    os.makedirs(logs, exist_ok=True)
    text = [x.decode(errors="replace") if isinstance(x, bytes) else (x or "") for x in (stdout, stderr)]
    with open(os.path.join(logs, f"{name}.log"), "w") as f:
        f.write(text[0] + "\n--- stderr ---\n" + text[1])


def _child(name: str, quick: bool, limit: float, logs: str | None = None
           ) -> tuple[list[dict[str, Any]], str | None, float]:
    """Run one section in a subprocess: ``(rows, error or None, seconds)``; its output goes to ``logs/name.log``."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "rows.json")
        cmd = [sys.executable, os.path.abspath(__file__), "--section", name, "--rows", out] + (
            ["--quick"] if quick else [])
        start = time.perf_counter()
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=limit, check=False)
        except subprocess.TimeoutExpired as err:
            _save_log(logs, name, err.stdout, err.stderr)
            return [], f"timed out after {limit:.0f} s", time.perf_counter() - start
        seconds = time.perf_counter() - start
        _save_log(logs, name, proc.stdout, proc.stderr)
        if proc.returncode != 0 or not os.path.exists(out):
            tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
            return [], f"exit {proc.returncode}: {' | '.join(tail)}", seconds
        with open(out) as f:
            return json.load(f), None, seconds


def _fmt(x: Any, scale: float = 1e3, digits: int = 2) -> str:
    return "-" if x is None else f"{scale * x:.{digits}f}"


def _print_table(records: list[dict[str, Any]]) -> None:
    print(f"{'kernel':<15}{'case':<30}{'first s':>9}{'ms':>10}{'ref ms':>10}{'ratio':>7}{'vs jit':>7}  "
          f"{'exact':<6}{'B/part':>8}  detail")
    for r in records:
        if "error" in r:
            print(f"{r['section']:<45}  FAILED: {r['error']}")
            continue
        peak = r.get("peak_bytes_per_particle")
        print(f"{r['kernel']:<15}{r['case']:<30}{r['first_s']:>9.2f}{_fmt(r['median_s']):>10}"
              f"{_fmt(r['reference_s']):>10}{_fmt(r['ratio'], 1):>7}{_fmt(r.get('vs_jit'), 1):>7}  {r['exact']!s:<6}"
              f"{'-' if peak is None else f'{peak:.0f}':>8}  {r['detail']}")


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--out", default="gpu_results.json", help="JSON results (default gpu_results.json)")
    parser.add_argument("--quick", action="store_true", help="tiny sizes (a smoke test on any backend)")
    parser.add_argument("--only", default="", help="comma-separated sections (default: all): " + ", ".join(SECTIONS))
    parser.add_argument("--limit-scale", type=float, default=1.0, help="multiply every section's time limit")
    parser.add_argument("--budget", type=float, default=None,
                        help=f"seconds for the whole run (default {_BUDGET:.0f}, none with --quick): sections past "
                             "it are recorded as skipped")
    parser.add_argument("--logs", default=None, help="folder for each section's output (default: not kept)")
    parser.add_argument("--section", help=argparse.SUPPRESS)
    parser.add_argument("--rows", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.section:  # a section's own process
        rows = run_section(args.section, args.quick)
        with open(args.rows, "w") as f:
            json.dump(rows, f)
        return 0
    names = [n for n in args.only.split(",") if n] or list(SECTIONS)
    unknown = [n for n in names if n not in SECTIONS]
    if unknown:
        parser.error(f"unknown sections {unknown}; choose from {list(SECTIONS)}")
    budget = args.budget if args.budget is not None else (float("inf") if args.quick else _BUDGET)
    records: list[dict[str, Any]] = []
    started = time.perf_counter()
    for name in names:
        left = budget - (time.perf_counter() - started)
        if left < 5:
            records.append({"section": name, "error": f"skipped: the run's budget of {budget:.0f} s is spent",
                            "seconds": 0.0})
            continue
        limit = min((_QUICK_LIMIT if args.quick else LIMITS[name]) * args.limit_scale, left)
        rows, error, seconds = _child(name, args.quick, limit, args.logs)
        if error is not None:
            records.append({"section": name, "error": error, "seconds": seconds})
        for row in rows:
            row["seconds"] = seconds
        records.extend(rows)
        print(f"[{time.perf_counter() - started:6.1f} s] {name}: {error or f'{len(rows)} rows'} ({seconds:.1f} s)",
              flush=True)
        _write(args.out, records, started, args.quick)  # after every section: a run cut short keeps what it has
    _write(args.out, records, started, args.quick)
    _print_table(records)
    print(f"wrote {args.out}")
    return 0


def _write(path: str, records: list[dict[str, Any]], started: float, quick: bool) -> None:
    meta: dict[str, Any] = {"python": platform.python_version(), "quick": quick,
                            "seconds": time.perf_counter() - started, "command": " ".join(sys.argv),
                            "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())}
    # What the sections ran on, as they reported it (this process starts no JAX backend).
    described = next((r for r in records if "device" in r), {})
    meta.update({key: described.get(key) for key in ("backend", "device", "jax")})
    with open(path, "w") as f:
        json.dump({"meta": meta, "results": records}, f, indent=1)


if __name__ == "__main__":
    sys.exit(main())
