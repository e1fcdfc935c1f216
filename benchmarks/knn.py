"""kNN benchmark: ``sx.spatial.knn`` against ``scipy.spatial.cKDTree`` (build + query, workers=-1), side by side.

One run times, on the same points: cKDTree, ``knn.smap`` on 1 device and on 8 CPU devices of this process,
(``--processes 2``) 2 processes x 4 devices launched through ``shardax launch``, and ``jax.jit(knn)`` on a plain
array in a subprocess with a single CPU device (the single-device setting; cKDTree is timed again there). Each
repetition times the in-process codes back to back, so the ratios are robust to the load of a shared machine;
medians are reported.
Every result is checked against cKDTree (distances to float tolerance, indices equal but for ties).

    python benchmarks/knn.py --processes 2          # 1e6 uniform, 1e6 clustered, k=9 and k=32
    python benchmarks/knn.py --n 200000 --repeat 5 --cases blobs
    python benchmarks/knn.py --n 1000000 --cases uniform --devices 1 --tuning gpu   # the GPU preset on CPU

``--tuning`` picks the kernel's preset (default: the backend's); the single-device process also reports the
sequential loop steps the local search ran (first pass, adaptive passes, compacted passes, brute force): on a GPU
each step costs a fixed ~0.3 ms whatever it holds; and XLA's temporaries of the compiled call per point.

Also reports the ghost rows each device receives on 8 devices at ``n / 8`` and ``n`` points: the exchange must grow
like the surface of a device's piece of space (x4 for x8 points), not like its volume (x8).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("JAX_NUM_CPU_DEVICES", "8")


def parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, default=1_000_000, help="number of points")
    parser.add_argument("--cases", default="uniform,blobs,uniform-k32",
                        help="comma-separated: uniform, blobs, uniform-k32, blobs-k32, uniform-periodic")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--devices", default="1,8", help="device counts of this process to run knn.smap on")
    parser.add_argument("--processes", type=int, default=0, help="also run on this many processes x 4 devices")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None, help="also write the results to this JSON file")
    parser.add_argument("--tuning", choices=("cpu", "gpu"), default=None,
                        help="the kNN kernel's preset (default: the backend's)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--single", action="store_true", help=argparse.SUPPRESS)
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


def parse_case(case: str) -> tuple[str, int, float | None]:
    kind, _, ksuffix = case.partition("-k")
    periodic = kind.endswith("-periodic")
    return kind.removesuffix("-periodic"), int(ksuffix) if ksuffix else 9, 1.0 if periodic else None


def shardax_knn(pos, k: int, box: float | None, ndev: int, tuning: str | None = None):
    """A callable running ``knn.smap`` on ``ndev`` devices (all when 0), its first result, the input and the mesh."""
    import jax
    import numpy as np
    from jax.sharding import Mesh

    import shardax as sx
    from shardax.spatial import knn

    devices = jax.devices() if ndev == 0 else jax.devices()[:ndev]
    mesh = Mesh(np.array(devices), ("d",))
    me, nproc = jax.process_index(), jax.process_count()
    rows = np.array_split(np.arange(len(pos)), nproc)[me]
    part = sx.particles.from_numpy(pos[rows], mesh=mesh)
    fn = knn.smap(mesh)

    def run():
        return jax.block_until_ready(fn(part, k, box=box, tuning=tuning))

    return run, run(), part, mesh


def gathered(res, part):
    """Distances and indices of the valid rows in global input order (``ids``), as NumPy arrays."""
    import numpy as np
    from jax.experimental import multihost_utils

    def host(x):
        return np.asarray(x if x.is_fully_addressable else multihost_utils.process_allgather(x, tiled=True))

    dist, idx, num, ids = (host(x) for x in (res.distances, res.indices, part.num, part.ids))
    valid = np.arange(idx.shape[1])[None, :] < num[:, None]
    order = np.argsort(ids[valid])
    return dist[valid][order], idx[valid][order]


def exact(res, part, ref_d, ref_i) -> bool:
    import numpy as np

    dist, idx = gathered(res, part)
    return bool(np.allclose(dist, ref_d, rtol=1e-5, atol=1e-6)) and float(np.mean(idx == ref_i)) > 0.9999


def ghost_rows(part, k: int, box: float | None, mesh) -> float:
    """Mean rows each device sends to or receives from the others (the ghost layer)."""
    import numpy as np
    from jax.experimental import multihost_utils
    from jax.sharding import PartitionSpec as P

    import shardax as sx
    from shardax.spatial._knn import _knn

    def ghosts(part):
        _, flags, _ = _knn(part, k, box=box, query=None, reduce=None, ghost_capacity=None)
        return flags.ghost_needed

    needed = sx.smap(ghosts, in_specs=(sx.ALL,), out_specs=P(sx.ALL), mesh=mesh, jit=True)(part)
    if not needed.is_fully_addressable:
        needed = multihost_utils.process_allgather(needed, tiled=True)
    return float(np.mean(np.asarray(needed)))


def single_device_process(args: argparse.Namespace, case: str) -> dict:
    """``jax.jit(knn)`` on a plain array in a process with one CPU device (the issue's single-device setting),
    interleaved with cKDTree there; run as a subprocess of the main run."""
    import subprocess

    env = {**os.environ, "JAX_NUM_CPU_DEVICES": "1"}
    cmd = [sys.executable, __file__, "--single", "--n", str(args.n), "--repeat", str(args.repeat), "--cases", case,
           "--seed", str(args.seed), *tuning_args(args)]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=3000)
    lines = [x for x in out.stdout.splitlines() if x.startswith("RESULT ")]
    if out.returncode != 0 or not lines:
        raise RuntimeError(f"single-device run failed:\n{out.stdout[-2000:]}\n{out.stderr[-3000:]}")
    return json.loads(lines[0].split("RESULT ", 1)[1])


def single(args: argparse.Namespace) -> dict:
    import jax
    import jax.numpy as jnp
    from scipy.spatial import cKDTree

    from shardax.spatial import knn

    kind, k, box = parse_case(args.cases)
    pos = make_points(kind, args.n, args.seed)
    data = jnp.asarray(pos)
    fn = jax.jit(lambda p: knn(p, k, box=box, tuning=args.tuning))
    t0 = time.perf_counter()
    jax.block_until_ready(fn(data))
    first_call = time.perf_counter() - t0
    ours, theirs = [], []
    for _ in range(args.repeat):
        t0 = time.perf_counter()
        res = jax.block_until_ready(fn(data))
        ours.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        ref_d, ref_i = cKDTree(pos, boxsize=box).query(pos, k=k, workers=-1)
        theirs.append(time.perf_counter() - t0)
    import numpy as np

    ok = bool(np.allclose(np.asarray(res.distances), ref_d, rtol=1e-5, atol=1e-6)) and \
        float(np.mean(np.asarray(res.indices) == ref_i)) > 0.9999
    # XLA's temporaries of the compiled call (buffers beyond its inputs and outputs), per point.
    temp = fn.lower(data).compile().memory_analysis()
    temp_bytes = None if temp is None else temp.temp_size_in_bytes / args.n
    return {"time": statistics.median(ours), "cKDTree": statistics.median(theirs), "exact": ok,
            "first_call": first_call, "steps": loop_steps(data, k, box, args.tuning), "temp_bytes": temp_bytes}


def loop_steps(data, k: int, box: float | None, tuning: str | None) -> dict:
    """The sequential loop steps of the local search on ``data`` (its own queries), by phase."""
    import jax.numpy as jnp

    from shardax.spatial._knn_local import local_knn_steps
    from shardax.spatial._knn_tuning import resolve

    n, dim = data.shape
    ok, ids = jnp.ones((n,), bool), jnp.arange(n, dtype=jnp.int32)
    boxv = None if box is None else jnp.full((dim,), box, data.dtype)
    steps = local_knn_steps(data, ok, data, ok, ids, k=k, box=boxv, tuning=resolve(tuning, "benchmark"))[2]
    return {**{name: int(v) for name, v in steps._asdict().items()}, "total": int(steps.total)}


def tuning_args(args: argparse.Namespace) -> list[str]:
    return ["--tuning", args.tuning] if args.tuning else []


def worker(args: argparse.Namespace) -> dict:
    """Timings on all devices of this (launched) run, checked against cKDTree on process 0."""
    import jax
    from scipy.spatial import cKDTree

    import shardax as sx

    sx.initialize()
    out = {}
    for case in args.cases.split(","):
        kind, k, box = parse_case(case)
        pos = make_points(kind, args.n, args.seed)
        t0 = time.perf_counter()
        run, res, part, _ = shardax_knn(pos, k, box, 0, args.tuning)
        compile_s = time.perf_counter() - t0
        times = []
        for _ in range(args.repeat):
            t0 = time.perf_counter()
            res = run()
            times.append(time.perf_counter() - t0)
        ref_d, ref_i = cKDTree(pos, boxsize=box).query(pos, k=k, workers=-1)
        out[case] = {"time": statistics.median(times), "compile": compile_s, "exact": exact(res, part, ref_d, ref_i),
                     "devices": jax.device_count()}
    return out


def main() -> None:
    args = parse()
    if args.single:
        print("RESULT " + json.dumps(single(args)), flush=True)
        return
    if args.worker:
        result = worker(args)
        import jax

        if jax.process_index() == 0:
            print("RESULT " + json.dumps(result), flush=True)
        return
    import jax
    from scipy.spatial import cKDTree

    counts = [int(c) for c in args.devices.split(",")]
    print(f"jax {jax.__version__}, {jax.device_count()} device(s), n={args.n}, python {sys.version.split()[0]}, "
          f"tuning {args.tuning or 'backend preset'}")
    results: dict = {"n": args.n, "cases": {}}
    for case in args.cases.split(","):
        kind, k, box = parse_case(case)
        pos = make_points(kind, args.n, args.seed)
        runs, compile_s = {}, {}
        for ndev in counts:
            t0 = time.perf_counter()
            runs[ndev] = shardax_knn(pos, k, box, ndev, args.tuning)
            compile_s[ndev] = time.perf_counter() - t0
        times: dict[str, list[float]] = {"cKDTree": [], **{f"{d} dev": [] for d in counts}}
        for _ in range(args.repeat):
            t0 = time.perf_counter()
            ref_d, ref_i = cKDTree(pos, boxsize=box).query(pos, k=k, workers=-1)
            times["cKDTree"].append(time.perf_counter() - t0)
            for ndev in counts:
                t0 = time.perf_counter()
                runs[ndev][0]()
                times[f"{ndev} dev"].append(time.perf_counter() - t0)
        row = {name: statistics.median(ts) for name, ts in times.items()}
        row.update({f"exact {d} dev": exact(runs[d][1], runs[d][2], ref_d, ref_i) for d in counts})
        row.update({f"compile {d} dev": compile_s[d] for d in counts})
        if args.processes:
            from shardax.testing import launch_script

            launched = launch_script(__file__, "--worker", "--n", str(args.n), "--repeat", str(args.repeat),
                                     "--cases", case, "--seed", str(args.seed), *tuning_args(args),
                                     num_processes=args.processes,
                                     cpu_devices=4, timeout_s=3000)
            lines = [x for x in launched.output.splitlines() if "RESULT " in x]
            if launched.returncode != 0 or not lines:
                raise RuntimeError(f"multi-process run failed:\n{launched.output[-3000:]}")
            mp = json.loads(lines[0].split("RESULT ", 1)[1])[case]
            row[f"{args.processes}x4"] = mp["time"]
            row[f"exact {args.processes}x4"] = mp["exact"]
        sp = single_device_process(args, case)
        row.update({"1-device process": sp["time"], "cKDTree (1-device process)": sp["cKDTree"],
                    "exact 1-device process": sp["exact"], "first call (1-device process)": sp["first_call"],
                    "loop steps (1-device process)": sp["steps"]})
        results["cases"][case] = row
        one = row[f"{counts[0]} dev"]
        ratios = [f"1-device process / cKDTree {sp['time'] / sp['cKDTree']:.2f}x",
                  f"{counts[0]} dev / cKDTree {one / row['cKDTree']:.2f}x"]
        ratios += [f"{d} dev / {counts[0]} dev {row[f'{d} dev'] / one:.2f}x "
                   f"(/ 1-device process {row[f'{d} dev'] / sp['time']:.2f}x)" for d in counts[1:]]
        if args.processes:
            mp = row[f"{args.processes}x4"]
            ratios.append(f"{args.processes}x4 / {counts[0]} dev {mp / one:.2f}x (/ 1-device process "
                          f"{mp / sp['time']:.2f}x)")
        timings = ", ".join(f"{name} {row[name]:.2f} s" for name in times)
        mp_time = f", {args.processes}x4 {row[f'{args.processes}x4']:.2f} s" if args.processes else ""
        steps = ", ".join(f"{name} {v}" for name, v in sp["steps"].items())
        temp = "-" if sp.get("temp_bytes") is None else f"{sp['temp_bytes']:.0f} B"
        single_time = (f", 1-device process {sp['time']:.2f} s (cKDTree there {sp['cKDTree']:.2f} s; first call "
                       f"{sp['first_call']:.1f} s; loop steps: {steps}; temporaries per point {temp})")
        checks = all(v for name, v in row.items() if name.startswith("exact"))
        print(f"{case}: {timings}{mp_time}{single_time} | {'; '.join(ratios)} | exact {checks}", flush=True)
    if max(counts) > 1:
        # Surface scaling of the ghost exchange, uniform k=9, on the largest device count.
        ndev = max(counts)
        small = max(args.n // 8, 1000)
        sizes = {}
        for n in (small, args.n):
            pos = make_points("uniform", n, args.seed + 1)
            _, _, part, mesh = shardax_knn(pos, 9, None, ndev)
            sizes[n] = ghost_rows(part, 9, None, mesh)
        ratio = sizes[args.n] / max(sizes[small], 1.0)
        results["surface"] = {"n_small": small, "ghost_rows_small": sizes[small], "ghost_rows_big": sizes[args.n],
                              "ratio": ratio}
        print(f"ghost rows per device ({ndev} devices, k=9): {sizes[small]:.0f} at n={small}, {sizes[args.n]:.0f} at "
              f"n={args.n}: x{ratio:.2f} for x{args.n / small:.0f} points (surface law "
              f"x{(args.n / small) ** (2 / 3):.2f}, volume x{args.n / small:.0f}); "
              f"{16 * sizes[args.n] / 2**20:.2f} MiB of positions and ids per device", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    from shardax.runtime import restart_with_malloc_env

    # glibc's allocator as in the processes shardax launches (SHARDAX_MALLOC=system: its defaults)
    restart_with_malloc_env(sys.argv)
    main()
