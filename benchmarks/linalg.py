"""Distributed dense linear algebra benchmark: sx.linalg side by side with SciPy (LAPACK) on the same cores.

``potrs`` (Cholesky factorisation + solve) on N CPU devices in one process against ``scipy.linalg.cho_factor +
cho_solve``, ``syevd`` against ``scipy.linalg.eigh`` and ``potri`` (f64) against LAPACK ``potrf + potri``. Every
variant runs in the same process in interleaved rounds (robust to noise on a shared machine); the table gives
medians, GFLOP/s (``N^3/3 + 2 N^2 K`` for potrs) and the ratio to SciPy. A communication/compute split comes from
timing the same program's collectives alone (the column-block all-reduces of ``potrf`` as a loop of all-reduces of
the same sizes) and from the factorisation on one device. ``potrs`` and ``potri`` also run on a 2D process grid
(``--grid``, default the squarest grid of the devices: 2x2 on 4), reported beside the default 1D layout.

    python benchmarks/linalg.py                    # potrs N=4096, 8192 f32+f64, syevd N=2048, potri N=4096, 4 devices
    python benchmarks/linalg.py --potrs 2048 --syevd 512 --potri 1024 --repeats 3
    python benchmarks/linalg.py --potrs 4096 --dtypes float64 --syevd --potri --grid 4x2 --devices 8
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable

os.environ.setdefault("JAX_PLATFORMS", "cpu")


def _parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--potrs", type=int, nargs="*", default=[4096, 8192], help="potrs sizes (default 4096 8192)")
    parser.add_argument("--syevd", type=int, nargs="*", default=[2048], help="syevd sizes (default 2048)")
    parser.add_argument("--potri", type=int, nargs="*", default=[4096],
                        help="potri sizes, float64, vs LAPACK potrf + potri (default 4096; no target, reported)")
    parser.add_argument("--dtypes", nargs="*", default=["float32", "float64"], help="potrs dtypes")
    parser.add_argument("--devices", type=int, default=4, help="CPU devices in this process (default 4)")
    parser.add_argument("--tile", type=int, default=None,
                        help="block size (default: the library's, 256, 128 or 64 by N and devices)")
    parser.add_argument("--nrhs", type=int, default=1, help="right-hand sides (default 1)")
    parser.add_argument("--grid", default="auto",
                        help="2D process grid for the extra potrs/potri variant: RxC, 'auto' (the squarest with more "
                             "than one row: 2x2 on 4 devices) or 'none'")
    parser.add_argument("--repeats", type=int, default=3, help="timed rounds (default 3)")
    parser.add_argument("--json", help="also write the results to this JSON file")
    return parser.parse_args()


def _rounds(variants: dict[str, Callable[[], object]], repeats: int) -> dict[str, float]:
    """Median seconds of each variant, timed in interleaved rounds after one warm-up call each."""
    for fn in variants.values():
        fn()
    times: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(repeats):
        for name, fn in variants.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(ts) for name, ts in times.items()}


def _grid(spec: str, devices: int) -> tuple[int, int] | None:
    if spec == "none":
        return None
    if spec == "auto":
        rows = max(r for r in range(1, int(devices ** 0.5) + 1) if devices % r == 0)
        return (rows, devices // rows) if rows > 1 else None
    rows, cols = (int(v) for v in spec.lower().split("x"))
    return rows, cols


def main() -> None:
    args = _parse()
    grid = _grid(args.grid, args.devices)
    import jax

    jax.config.update("jax_num_cpu_devices", args.devices)
    jax.config.update("jax_enable_x64", True)
    import jax.numpy as jnp
    import numpy as np
    import scipy.linalg as sl
    from jax import lax
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    import shardax as sx
    from shardax.core import vary_like
    from shardax.linalg._layout import BlockCyclic

    mesh = Mesh(np.array(jax.devices()[: args.devices]), ("d",))
    one = Mesh(np.array(jax.devices()[:1]), ("d",))
    rows: list[dict] = []

    def block(x):
        return jax.block_until_ready(x)

    for n in args.potrs:
        for dtype in args.dtypes:
            rng = np.random.default_rng(0)
            m = rng.standard_normal((n, n)).astype(dtype)
            a = m @ m.T / n + np.eye(n, dtype=dtype)
            b = rng.standard_normal((n, args.nrhs)).astype(dtype)
            ad = jax.device_put(a, NamedSharding(mesh, P(None, "d")))
            bd = jax.device_put(b, NamedSharding(mesh, P()))
            a1 = jax.device_put(a, NamedSharding(one, P()))
            b1 = jax.device_put(b, NamedSharding(one, P()))
            layout = BlockCyclic.create(n, args.tile, args.devices)
            tile = layout.tile  # the block size the library uses for this call (args.tile or its default)
            panel = jnp.zeros((args.devices * n, tile), dtype)

            # The factorisation's collectives alone: one all-reduce of the panel per step (upper bound: full height).
            @jax.jit
            def comm_only(panel, steps=layout.blocks):
                def body(p):
                    return lax.fori_loop(0, steps, lambda k, q: vary_like(lax.psum(q, "d") * 0.5, q), p)
                return jax.shard_map(body, mesh=mesh, in_specs=P("d"), out_specs=P("d"))(panel)

            variants = {
                "scipy": lambda a=a, b=b: sl.cho_solve(sl.cho_factor(a, lower=True), b),
                "shardax": lambda ad=ad, bd=bd: block(sx.linalg.potrs(ad, bd, tile=args.tile)),
                "shardax-1dev": lambda a1=a1, b1=b1: block(sx.linalg.potrs(a1, b1, tile=args.tile)),
                "collectives": lambda panel=panel: block(comm_only(panel)),
            }
            if grid:
                variants["grid"] = lambda ad=ad, bd=bd: block(sx.linalg.potrs(ad, bd, tile=args.tile, grid=grid))
            t = _rounds(variants, args.repeats)
            x = np.asarray(sx.linalg.potrs(ad, bd, tile=args.tile))
            residual = float(np.linalg.norm(a @ x - b) / (np.linalg.norm(a) * np.linalg.norm(x)))
            flops = n**3 / 3 + 2 * n**2 * args.nrhs
            rows.append({"op": "potrs", "n": n, "dtype": dtype, "devices": args.devices, "tile": tile,
                         "scipy_s": t["scipy"], "shardax_s": t["shardax"], "shardax_1dev_s": t["shardax-1dev"],
                         "collectives_s": t["collectives"], "scipy_gflops": flops / t["scipy"] / 1e9,
                         "shardax_gflops": flops / t["shardax"] / 1e9, "ratio": t["scipy"] / t["shardax"],
                         "residual": residual})
            if grid:
                rows[-1].update({"grid": f"{grid[0]}x{grid[1]}", "grid_s": t["grid"],
                                 "grid_ratio": t["scipy"] / t["grid"]})
            print(json.dumps(rows[-1]), flush=True)

    for n in args.potri:
        rng = np.random.default_rng(2)
        m = rng.standard_normal((n, n))
        a = m @ m.T / n + np.eye(n)
        ad = jax.device_put(a, NamedSharding(mesh, P(None, "d")))
        a1 = jax.device_put(a, NamedSharding(one, P()))

        def lapack_inverse(a=a):
            factor, _ = sl.lapack.dpotrf(a, lower=1)
            inverse, _ = sl.lapack.dpotri(factor, lower=1)
            return inverse  # lower triangle only, as LAPACK returns it

        variants = {
            "scipy": lapack_inverse,
            "shardax": lambda ad=ad: block(sx.linalg.potri(ad, tile=args.tile)),
            "shardax-1dev": lambda a1=a1: block(sx.linalg.potri(a1, tile=args.tile)),
        }
        if grid:
            variants["grid"] = lambda ad=ad: block(sx.linalg.potri(ad, tile=args.tile, grid=grid))
        t = _rounds(variants, args.repeats)
        inverse = np.asarray(sx.linalg.potri(ad, tile=args.tile))
        residual = float(np.linalg.norm(a @ inverse - np.eye(n)) / (np.linalg.norm(a) * np.linalg.norm(inverse)))
        rows.append({"op": "potri", "n": n, "dtype": "float64", "devices": args.devices,
                     "tile": BlockCyclic.create(n, args.tile, args.devices).tile, "scipy_s": t["scipy"],
                     "shardax_s": t["shardax"], "shardax_1dev_s": t["shardax-1dev"],
                     "ratio": t["shardax"] / t["scipy"], "residual": residual})
        if grid:
            rows[-1].update({"grid": f"{grid[0]}x{grid[1]}", "grid_s": t["grid"],
                             "grid_ratio": t["grid"] / t["scipy"]})
        print(json.dumps(rows[-1]), flush=True)

    for n in args.syevd:
        rng = np.random.default_rng(1)
        m = rng.standard_normal((n, n))
        a = (m + m.T) / 2
        ad = jax.device_put(a, NamedSharding(mesh, P(None, "d")))
        a1 = jax.device_put(a, NamedSharding(one, P()))
        variants = {
            "scipy": lambda a=a: sl.eigh(a),
            "shardax": lambda ad=ad: block(sx.linalg.syevd(ad)),
            "shardax-1dev": lambda a1=a1: block(sx.linalg.syevd(a1)),
        }
        t = _rounds(variants, args.repeats)
        w, v = sx.linalg.syevd(ad)
        w, v = np.asarray(w), np.asarray(v)
        residual = float(np.linalg.norm(a @ v - v * w) / np.linalg.norm(a))
        rows.append({"op": "syevd", "n": n, "dtype": "float64", "devices": args.devices, "scipy_s": t["scipy"],
                     "shardax_s": t["shardax"], "shardax_1dev_s": t["shardax-1dev"],
                     "ratio": t["shardax"] / t["scipy"], "residual": residual})
        print(json.dumps(rows[-1]), flush=True)

    print()
    print(f"{'op':6} {'N':>5} {'dtype':8} {'tile':>4} {'scipy s':>8} {'sx s':>8} {'sx 1dev s':>9} {'comm s':>7} "
          f"{'scipy GF/s':>10} {'sx GF/s':>8} {'ratio':>6} {'grid':>5} {'grid s':>7} {'g ratio':>7}")
    for r in rows:
        print(f"{r['op']:6} {r['n']:5d} {r['dtype']:8} {r.get('tile', '-'):>4} {r['scipy_s']:8.3f} {r['shardax_s']:8.3f} "
              f"{r['shardax_1dev_s']:9.3f} {r.get('collectives_s', float('nan')):7.3f} "
              f"{r.get('scipy_gflops', float('nan')):10.1f} {r.get('shardax_gflops', float('nan')):8.1f} "
              f"{r['ratio']:6.2f} {r.get('grid', '-'):>5} {r.get('grid_s', float('nan')):7.3f} "
              f"{r.get('grid_ratio', float('nan')):7.2f}")
    print("ratio: potrs = shardax GFLOP/s / scipy GFLOP/s (target >= 0.7); syevd = shardax time / scipy time "
          "(target <= 3); potri = shardax time / LAPACK potrf + potri time (no target); grid: the same on the 2D "
          "process grid")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    from shardax.runtime import restart_with_malloc_env

    # glibc's allocator as in the processes shardax launches (SHARDAX_MALLOC=system: its defaults)
    restart_with_malloc_env(sys.argv)
    main()
