"""Where a kernel's time goes on a device: JAX's profiler around one warm call, summed per XLA operation.

For each case the script compiles and warms the call, traces one more call with ``jax.profiler``, and reads the
trace back with ``jax.profiler.ProfileData``: the device's busy time (the sum of its kernels), the number of
kernels launched, and the operations (``hlo_op``) that took the most time. Wall time minus busy time is what the
device spent idle: launch gaps and the host's checks of ``while`` loop conditions.

    PYTHONPATH=src python benchmarks/gpu_profile.py --out profile.json                 # full sizes, on a GPU
    PYTHONPATH=src python benchmarks/gpu_profile.py --quick                            # tiny sizes, any backend
    PYTHONPATH=src python benchmarks/gpu_profile.py --only knn_1e7 --knn-variants "block=4;block=4,per_cell=10"
                                                                        # kNN tunings side by side
    PYTHONPATH=src python benchmarks/gpu_profile.py --only knn_1e7 --hlo hlo    # and its compiled program

Cases: ``knn_1e6`` (k=9), ``knn_1e7`` (k=30), ``knn_blobs`` (1e6 points in 64 Gaussian blobs over a 20%
uniform background, k=9, as ``benchmarks/knn.py``'s), ``fof_1e7`` (b=0.2), ``fields`` (paint and readout of 1e7
particles on 256^3), each the jitted local view on one device as ``benchmarks/gpu.py`` times it; ``topk``
(``lax.top_k`` against a full sort of the same rows, the selection kNN's tiles need); ``wrappers`` (``zsort.smap``
and ``paint`` against their jitted local views at 1e6 particles). ``--no-command-buffers`` launches every kernel
on its own, so the operations inside XLA's GPU command buffers show by name. Each kNN size also times the other
selection method (``KnnTuning.select``; ``--no-other-select`` skips it); ``--knn-variants`` adds tunings, each a set of
``KnnTuning`` fields over the backend's preset (``;`` between tunings, ``,`` between fields); indices are compared
with the default's. ``wrappers`` also times ``readout``, ``knn.smap`` (k = 9) and ``fof.smap`` (b = 0.2) against
their jitted local views.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import glob
import json
import os
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import numpy as np
from gpu import timed  # benchmarks/gpu.py: first call and median of repeated calls, each waited for


def _sources(hlo: str) -> dict[str, str]:
    """Operation name -> the JAX source of it (``op_name`` metadata), from a compiled module's text; a fusion
    without metadata of its own takes its fused computation's root's."""
    import re

    defs: dict[str, str] = {}
    roots: dict[str, str] = {}
    calls: dict[str, str] = {}
    computation = None
    for line in hlo.splitlines():
        head = re.match(r"^\s*(?:ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$", line)
        if head and "=" not in line.split("{")[0]:
            computation = head.group(1)
            continue
        m = re.match(r"^\s*(ROOT\s+)?%?([\w.\-]+)\s*=", line)
        if not m:
            continue
        meta = re.search(r'op_name="([^"]*)"', line)
        where = re.search(r'source_file="([^"]*)" source_line=(\d+)', line)
        called = re.search(r"calls=%?([\w.\-]+)", line)
        if meta:
            text = meta.group(1) + (f" @ {os.path.basename(where.group(1))}:{where.group(2)}" if where else "")
            defs[m.group(2)] = text
            if m.group(1) and computation:
                roots[computation] = text
        if called:
            calls[m.group(2)] = called.group(1)
    for name, comp in calls.items():
        if name not in defs and comp in roots:
            defs[name] = roots[comp]
    return defs


def _profile(fn: Callable[[], Any], top: int, hlo: str | None = None) -> dict[str, Any]:
    """One traced call of ``fn`` (already warm): wall time, device busy time, kernels, and the top operations
    (with their JAX source where ``hlo``, the compiled module's text, names it)."""
    import jax
    from jax.profiler import ProfileData

    with tempfile.TemporaryDirectory() as tmp:
        jax.profiler.start_trace(tmp)
        start = time.perf_counter()
        jax.block_until_ready(fn())
        wall = time.perf_counter() - start
        jax.profiler.stop_trace()
        paths = glob.glob(os.path.join(tmp, "**", "*.xplane.pb"), recursive=True)
        if not paths:
            return {"wall_s": wall, "error": "no trace written"}
        data = ProfileData.from_file(paths[0])
    by_op: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0])
    busy, kernels, planes = 0.0, 0, []
    for plane in data.planes:
        device = plane.name.startswith("/device:") and "CPU" not in plane.name
        host_xla = plane.name == "/host:CPU"
        if not (device or host_xla):
            continue
        for line in plane.lines:
            # On a GPU the kernels are on the stream lines; on CPU, XLA's thunks run on the client's threads.
            if device and not line.name.startswith("Stream"):
                continue
            if host_xla and "XLAPjRtCpuClient" not in line.name:
                continue
            planes.append(f"{plane.name}:{line.name}")
            for event in line.events:
                stats = dict(event.stats)
                op = stats.get("hlo_op")
                if op is None:
                    if not device:
                        continue
                    op = event.name
                seconds = event.duration_ns * 1e-9
                entry = by_op[str(op)]
                entry[0] += seconds
                entry[1] += 1
                busy += seconds
                kernels += 1
    ranked = sorted(by_op.items(), key=lambda kv: -kv[1][0])[:top]
    source = _sources(hlo) if hlo else {}
    return {"wall_s": wall, "busy_s": busy, "kernels": kernels, "lines": sorted(set(planes))[:8],
            "top": [{"op": op, "s": s, "count": c, "source": source.get(op, "")[-160:]}
                    for op, (s, c) in ranked]}


def _uniform(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).random((n, 3), dtype=np.float32)


def _particles(host: np.ndarray) -> Any:
    import jax.numpy as jnp

    import shardax as sx

    return sx.particles.Particles(pos=jnp.asarray(host), num=jnp.int32(len(host)))


def _variants(spec: str) -> dict[str, dict[str, Any]]:
    """``"block=4;block=4,per_cell=10;select=union"`` as ``{"block=4": {"block": 4}, ...}`` (ints and floats where
    the value is one, else the text)."""
    def parsed(value: str) -> Any:
        if value.lstrip("-").isdigit():
            return int(value)
        try:
            return float(value)
        except ValueError:
            return value

    out: dict[str, dict[str, Any]] = {}
    for variant in filter(None, (v.strip() for v in spec.split(";"))):
        fields = {}
        for item in variant.split(","):
            name, value = (x.strip() for x in item.split("="))
            fields[name] = parsed(value)
        out[variant] = fields
    return out


def _knn_case(n: int, k: int, repeat: int, top: int, variants: str, other_select: bool,
              data: str = "uniform", hlo_out: str = "") -> dict[str, Any]:
    import jax
    import jax.numpy as jnp
    from knn import make_points  # benchmarks/knn.py's points (uniform, or 64 blobs over a uniform background)

    import shardax as sx
    from shardax.spatial import KnnTuning

    part = _particles(make_points(data, n, 0) if data != "uniform" else _uniform(n))
    out: dict[str, Any] = {}

    def run(tuning: Any) -> Callable[[], Any]:
        fn = jax.jit(lambda p: sx.spatial.knn(p, k, box=1.0, tuning=tuning))
        return lambda: fn(part)

    def hlo(tuning: Any) -> str:
        return jax.jit(lambda p: sx.spatial.knn(p, k, box=1.0, tuning=tuning)).lower(part).compile().as_text() or ""

    base = run(None)
    first, median, ref = timed(base, repeat)
    base_median = median
    text = hlo(None)
    if hlo_out:  # the compiled program, to read what each fused operation of the profile holds
        import gzip

        with gzip.open(hlo_out, "wt") as f:
            f.write(text)
    out["default"] = {"first_s": first, "median_s": median, "profile": _profile(base, top, text)}
    # The other selection method beside the backend's default (threshold on a GPU, top_k on CPU).
    default = KnnTuning(preset="cpu" if jax.default_backend() == "cpu" else "gpu")
    other = dataclasses.replace(default, select="threshold" if jax.default_backend() == "cpu" else "top_k")
    if other_select:
        first, median, res = timed(run(other), repeat)
        out[f"select={other.select}"] = {"first_s": first, "median_s": median,
                                         "same_indices": bool(jnp.all(res.indices == ref.indices))}
    print(f"  knn {n:.0e} default: {base_median * 1e3:.2f} ms", flush=True)
    for name, fields in _variants(variants).items():
        tuning = dataclasses.replace(default, **fields)
        first, median, res = timed(run(tuning), repeat)
        out[name] = {"first_s": first, "median_s": median,
                     "same_indices": bool(jnp.all(res.indices == ref.indices))}
        print(f"  knn {n:.0e} {name}: {median * 1e3:.2f} ms (first call {first:.1f} s)", flush=True)
    return out


def _fof_case(n: int, repeat: int, top: int) -> dict[str, Any]:
    import jax

    import shardax as sx

    part = _particles(_uniform(n, seed=2))
    ll = 0.2 / n ** (1 / 3)
    fn = jax.jit(lambda p: sx.spatial.fof(p, ll, box=1.0, min_members=20))
    call = lambda: fn(part)  # noqa: E731
    first, median, _ = timed(call, repeat)
    return {"default": {"first_s": first, "median_s": median,
                        "profile": _profile(call, top, fn.lower(part).compile().as_text() or "")}}


def _fields_case(n: int, g: int, repeat: int, top: int) -> dict[str, Any]:
    import jax
    import jax.numpy as jnp

    import shardax as sx

    part = _particles(_uniform(n, seed=3))
    shape = (g, g, g)
    paint = jax.jit(lambda p: sx.fields.local_paint(p, shape, box=1.0)[0])
    first, median, rho = timed(lambda: paint(part), repeat)
    out = {"paint": {"first_s": first, "median_s": median, "profile": _profile(lambda: paint(part), top)}}
    readout = jax.jit(lambda f, p: sx.fields.local_readout(f, p, box=1.0)[0])
    field = jnp.asarray(rho)
    first, median, _ = timed(lambda: readout(field, part), repeat)
    out["readout"] = {"first_s": first, "median_s": median, "profile": _profile(lambda: readout(field, part), top)}
    return out


def _wrappers_case(n: int, g: int, repeat: int, top: int) -> dict[str, Any]:
    """The global functions against their jitted local views on one device (zsort, paint): where the extra time
    of a global call goes (device busy time, kernels, idle gaps)."""
    import jax
    from jax.sharding import Mesh

    import shardax as sx

    mesh = Mesh(np.array(jax.devices()[:1]), ("d",))
    part = sx.particles.from_numpy(_uniform(n, seed=5), mesh=mesh)
    local_part = sx.particles.Particles(pos=part.pos[0], num=part.num[0])
    zsort_local = jax.jit(lambda p: sx.particles.zsort(p, box=1.0))
    zsort_global = sx.particles.zsort.smap(mesh)
    paint_local = jax.jit(lambda p: sx.fields.local_paint(p, (g, g, g), box=1.0)[0])
    readout_local = jax.jit(lambda f, p: sx.fields.local_readout(f, p, box=1.0)[0])
    rho = sx.fields.paint(part, (g, g, g), box=1.0, mesh=mesh)
    rho_local = jax.device_put(np.asarray(rho), jax.devices()[0])
    knn_local = jax.jit(lambda p: sx.spatial.knn(p, 9, box=1.0))
    knn_global = sx.spatial.knn.smap(mesh)
    ll = 0.2 / n ** (1 / 3)
    fof_local = jax.jit(lambda p: sx.spatial.fof(p, ll, box=1.0))
    fof_global = sx.spatial.fof.smap(mesh)
    calls = {"zsort jit": lambda: zsort_local(local_part), "zsort.smap": lambda: zsort_global(part, box=1.0),
             "local_paint jit": lambda: paint_local(local_part),
             "paint": lambda: sx.fields.paint(part, (g, g, g), box=1.0),
             "local_readout jit": lambda: readout_local(rho_local, local_part),
             "readout": lambda: sx.fields.readout(rho, part, box=1.0),
             "knn jit": lambda: knn_local(local_part), "knn.smap": lambda: knn_global(part, 9, box=1.0),
             "fof jit": lambda: fof_local(local_part), "fof.smap": lambda: fof_global(part, ll, box=1.0)}
    out: dict[str, Any] = {}
    for name, call in calls.items():
        first, median, _ = timed(call, repeat)
        out[name] = {"first_s": first, "median_s": median, "profile": _profile(call, top)}
    return out


def _topk_case(rows: int, quick: bool, repeat: int) -> dict[str, Any]:
    """``lax.top_k`` of k smallest against a full sort, on the tile shapes kNN uses (k+1 of ~k*27 candidates)."""
    import jax
    import jax.numpy as jnp
    from jax import lax

    out: dict[str, Any] = {}
    for kk, width in ((10, 320), (31, 800), (17, 448)):
        x = jax.random.uniform(jax.random.key(kk), (rows, width), jnp.float32)
        fns = {
            "top_k": jax.jit(lambda v, kk=kk: lax.top_k(-v, kk)),
            "sort_iota": jax.jit(lambda v, kk=kk: tuple(
                a[:, :kk] for a in lax.sort((v, lax.broadcasted_iota(jnp.int32, v.shape, 1)), dimension=1,
                                            num_keys=1))),
            "dist_only": jax.jit(lambda v: jnp.min(v, axis=1)),
        }
        for name, fn in fns.items():
            _, median, _ = timed(lambda fn=fn, x=x: fn(x), repeat)
            out[f"k={kk} of {width}, {name}"] = median
            print(f"  topk rows={rows} k={kk} width={width} {name}: {median * 1e3:.2f} ms", flush=True)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--out", default="profile.json")
    parser.add_argument("--quick", action="store_true", help="tiny sizes")
    parser.add_argument("--only", default="",
                        help="comma-separated: knn_1e6, knn_1e7, knn_blobs, fof_1e7, fields, topk, wrappers")
    parser.add_argument("--knn-variants", nargs="?", const="block=4;block=4,per_cell=10", default="",
                        help="also time these kNN tunings: KnnTuning fields over the preset, ';' between tunings, "
                             "',' between fields (default when given alone: 'block=4;block=4,per_cell=10')")
    parser.add_argument("--no-other-select", action="store_true",
                        help="do not time kNN with the other selection method")
    parser.add_argument("--top", type=int, default=15, help="operations listed per case")
    parser.add_argument("--hlo", default="", help="write each kNN case's compiled program to DIR/CASE.hlo.gz")
    parser.add_argument("--no-command-buffers", action="store_true",
                        help="launch every kernel on its own (XLA's GPU command buffers hide the operations)")
    args = parser.parse_args()
    if args.no_command_buffers:
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_gpu_enable_command_buffer=").strip()
    big = 5000 if args.quick else 10**7
    small = 3000 if args.quick else 10**6
    repeat = 2 if args.quick else 3
    if args.hlo:
        os.makedirs(args.hlo, exist_ok=True)

    def hlo_path(case: str) -> str:
        return os.path.join(args.hlo, f"{case}.hlo.gz") if args.hlo else ""

    cases: dict[str, Callable[[], dict[str, Any]]] = {
        "knn_1e6": lambda: _knn_case(small, 9, repeat, args.top, args.knn_variants, not args.no_other_select,
                                     hlo_out=hlo_path("knn_1e6")),
        "knn_1e7": lambda: _knn_case(big, 30, repeat, args.top, args.knn_variants, not args.no_other_select,
                                     hlo_out=hlo_path("knn_1e7")),
        "knn_blobs": lambda: _knn_case(small, 9, repeat, args.top, args.knn_variants, not args.no_other_select,
                                       data="blobs", hlo_out=hlo_path("knn_blobs")),
        "fof_1e7": lambda: _fof_case(big, repeat, args.top),
        "fields": lambda: _fields_case(big, 16 if args.quick else 256, repeat, args.top),
        "topk": lambda: _topk_case(2000 if args.quick else 10**6, args.quick, repeat),
        "wrappers": lambda: _wrappers_case(small, 16 if args.quick else 256, repeat, args.top),
    }
    names = [n for n in args.only.split(",") if n] or list(cases)
    import jax

    results: dict[str, Any] = {"backend": jax.default_backend(), "device": jax.devices()[0].device_kind,
                               "jax": jax.__version__}
    for name in names:
        start = time.perf_counter()
        try:
            results[name] = cases[name]()
        except Exception as err:
            results[name] = {"error": f"{type(err).__name__}: {str(err)[:500]}"}
        print(f"[{name}] {time.perf_counter() - start:.1f} s", flush=True)
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)
    for name in names:
        for sub, rec in results[name].items() if isinstance(results[name], dict) else ():
            if isinstance(rec, dict) and "profile" in rec:
                p = rec["profile"]
                print(f"{name}/{sub}: median {rec['median_s'] * 1e3:.2f} ms, traced wall {p['wall_s'] * 1e3:.2f} ms, "
                      f"busy {p.get('busy_s', 0) * 1e3:.2f} ms, kernels {p.get('kernels')}")
                for t in p.get("top", [])[:10]:
                    print(f"    {t['s'] * 1e3:8.3f} ms x{t['count']:<5} {t['op'][:40]:<40} {t['source'][-90:]}")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
