"""kNN benchmark: ``sx.spatial.knn`` against ``scipy.spatial.cKDTree`` (build + query, workers=-1), side by side.

Each repetition times both codes back to back on the same data, so the ratio is robust to the load of a shared
machine; medians are reported. ``--devices N`` runs ``knn.smap`` on N CPU devices of this process instead.

    python benchmarks/knn.py                        # 1e6 uniform, 1e6 clustered, k=9 and k=32, 1 device
    python benchmarks/knn.py --n 200000 --repeat 5
    python benchmarks/knn.py --devices 8 --cases uniform
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time


def parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, default=1_000_000, help="number of points")
    parser.add_argument("--cases", default="uniform,blobs,uniform-k32",
                        help="comma-separated: uniform, blobs, uniform-k32, blobs-k32, uniform-periodic")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--devices", type=int, default=1, help="CPU devices (knn.smap when > 1)")
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args()


def make_points(kind: str, n: int, seed: int):
    import numpy as np

    rng = np.random.default_rng(seed)
    if kind == "uniform":
        return rng.random((n, 3), dtype=np.float32)
    centers = rng.random((64, 3))
    sigma = rng.uniform(0.005, 0.03, 64)
    which = rng.integers(0, 64, n)
    pos = centers[which] + rng.normal(size=(n, 3)) * sigma[which, None]
    background = n // 5
    pos[:background] = rng.random((background, 3))
    return np.mod(pos, 1.0).astype(np.float32)


def main() -> None:
    args = parse()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax

    if args.devices > 1:
        jax.config.update("jax_num_cpu_devices", args.devices)
    import jax.numpy as jnp
    import numpy as np
    from scipy.spatial import cKDTree

    import shardax as sx
    from shardax.spatial import knn

    print(f"jax {jax.__version__}, {jax.device_count()} device(s), n={args.n}, python {sys.version.split()[0]}")
    print(f"{'case':<18} {'shardax s':>10} {'cKDTree s':>10} {'ratio':>6} {'compile s':>10} {'exact':>6}")
    for case in args.cases.split(","):
        kind, _, ksuffix = case.partition("-k")
        periodic = kind.endswith("-periodic")
        kind = kind.removesuffix("-periodic")
        k = int(ksuffix) if ksuffix else 9
        box = 1.0 if periodic else None
        pos = make_points(kind, args.n, args.seed)
        if args.devices > 1:
            part = sx.particles.from_numpy(pos)
            fn = knn.smap()

            def run(part=part, fn=fn, k=k, box=box):
                return jax.block_until_ready(fn(part, k, box=box))
        else:
            data = jnp.asarray(pos)
            fn = jax.jit(lambda p, k=k, box=box: knn(p, k, box=box))

            def run(data=data, fn=fn):
                return jax.block_until_ready(fn(data))

        t0 = time.perf_counter()
        res = run()
        compile_s = time.perf_counter() - t0
        ours, theirs = [], []
        for _ in range(args.repeat):
            t0 = time.perf_counter()
            res = run()
            ours.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            ref_d, ref_i = cKDTree(pos, boxsize=box).query(pos, k=k, workers=-1)
            theirs.append(time.perf_counter() - t0)
        dist = np.asarray(res.distances)
        idx = np.asarray(res.indices)
        if args.devices > 1:
            valid = np.arange(idx.shape[1])[None, :] < np.asarray(part.num)[:, None]
            order = np.argsort(np.asarray(part.ids)[valid])
            dist, idx = dist[valid][order], idx[valid][order]
        exact = bool(np.allclose(dist, ref_d, rtol=1e-5, atol=1e-6)) and float(np.mean(idx == ref_i)) > 0.9999
        t_ours, t_theirs = statistics.median(ours), statistics.median(theirs)
        print(f"{case:<18} {t_ours:>10.2f} {t_theirs:>10.2f} {t_ours / t_theirs:>6.2f} {compile_s:>10.1f} "
              f"{exact!s:>6}", flush=True)
        if args.devices > 1:
            report_ghosts(part, k, box)


def report_ghosts(part, k, box) -> None:
    """Rows each device receives from the others (the ghost layer) against the rows it holds."""
    import numpy as np
    from jax.sharding import PartitionSpec as P

    import shardax as sx
    from shardax.spatial._knn import _knn

    def ghosts(part):
        _, _, needed = _knn(part, k, box=box, query=None, reduce=None, ghost_capacity=None)
        return needed

    needed = np.asarray(sx.smap(ghosts, in_specs=(sx.ALL,), out_specs=P(sx.ALL), jit=True)(part))
    rows = np.asarray(part.num)
    dim = part.pos.shape[-1]
    per_row = 4 * dim + 4
    print(f"  ghost rows sent per device: mean {needed.mean():.0f} (max {needed.max()}) for {rows.mean():.0f} rows "
          f"per device ({needed.mean() / rows.mean():.2f} per row; {needed.mean() * per_row / 2**20:.2f} MiB of "
          f"positions and ids, plus {rows.mean() * k * 8 / 2**20:.2f} MiB of results going home)", flush=True)


if __name__ == "__main__":
    main()
