"""Friends-of-friends benchmark: shardax vs cKDTree.query_pairs + connected_components (and pyfof if installed).

Side by side in one run (robust to a shared machine): float32 points in the periodic unit box (uniform, or with
``--data clustered`` the particles ``shardax halos`` generates: half in halos), linking lengths b = 0.2 and 0.7 of
the mean spacing, on one device, on 8 devices of this process, and (``--processes 2``) on 2 processes x 4 devices
launched through ``shardax launch``. Also reports the boundary particles each device exchanges at two sizes: they
grow like the surface of a device's piece (``N**(2/3)``), not like its volume.

    python benchmarks/fof.py --n 1000000 --repeat 3 --processes 2
    python benchmarks/fof.py --n 1000000 --repeat 3 --tuning gpu     # the GPU preset's kernels, here on CPU
    python benchmarks/fof.py --n 1000000 --repeat 3 --data clustered --b 0.2

``--tuning`` picks the FofTuning preset (default: the backend's); the sequential loop steps of the 1-device call
(``fof_steps``: link search, component passes, hooking and pointer-jumping steps) and its compiled temporaries per
particle (XLA's memory analysis: the buffers beyond its inputs and outputs) are printed with each row.

Medians of ``--repeat`` timed calls after one warm-up (compilation) call; the 1-device and 8-device calls are timed
round-robin, so that their ratio is measured under one load; the 2x4 launch is a separate run, which times the
1-device call (on process 0, the other process waiting at a barrier) round-robin with the 2x4 one for its ratio.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

os.environ.setdefault("JAX_NUM_CPU_DEVICES", "8")

import numpy as np

from shardax.cli._bench_cases import scipy_fof, time_rounds


def points(n: int, data: str, seed: int) -> np.ndarray:
    """``(n, 3)`` float32 points in the periodic unit box: ``uniform``, or ``clustered`` (``shardax halos``'s
    generated particles: half in Gaussian halos of 20-5000 members, half uniform)."""
    if data == "clustered":
        from shardax.cli._halos import generate

        return generate(n, 1.0, seed)[0]
    return np.random.default_rng(seed).random((n, 3)).astype(np.float32)


def _median_time(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return float(np.median(times))


def shardax_fof(pos: np.ndarray, linking_length: float, ndev: int, tuning: str | None = None):
    """A timed callable running ``fof.smap`` on ``ndev`` devices (all of them when ``ndev`` is 0), and its result."""
    import jax
    from jax.sharding import Mesh

    import shardax as sx
    from shardax.spatial._fof import fof

    devices = jax.devices() if ndev == 0 else jax.devices()[:ndev]
    mesh = Mesh(np.array(devices), ("d",))
    me, nproc = jax.process_index(), jax.process_count()
    rows = np.array_split(np.arange(len(pos)), nproc)[me]
    part = sx.particles.from_numpy(pos[rows], mesh=mesh)
    res, sizes = sx.retry_capacity(fof.smap(mesh), part, linking_length, box=1.0, min_members=2, tuning=tuning)
    options = {"tuning": tuning, **sizes}

    def run():
        out = fof.smap(mesh)(part, linking_length, box=1.0, min_members=2, **options)
        jax.block_until_ready(out.labels)
        return out

    return run, res


def _ghost_rows(res) -> float:
    from jax.experimental import multihost_utils

    needed = res.needed
    if not needed.is_fully_addressable:
        needed = multihost_utils.process_allgather(needed, tiled=True)
    return float(np.mean(np.asarray(needed)[:, 1]))


def single_device_fof(pos: np.ndarray, linking_length: float, tuning: str | None = None):
    """A callable running the local-view ``fof`` under ``jax.jit`` on this process's first device, on the rows
    ``from_numpy`` would build for one device (capacity ``ceil(1.25 n)``, ``ids`` the input order)."""
    import math

    import jax
    import jax.numpy as jnp

    from shardax.particles import Particles, pad
    from shardax.spatial._fof import fof

    n = len(pos)
    part = pad(Particles(pos=jnp.asarray(pos), num=jnp.int32(n), ids=jnp.arange(n, dtype=jnp.int32)),
               math.ceil(1.25 * n) - n)
    fn = jax.jit(lambda p: fof(p, linking_length, box=1.0, min_members=2, tuning=tuning))
    return lambda: fn(part).labels


def step_counts(pos: np.ndarray, linking_length: float, tuning: str | None = None) -> dict[str, int]:
    """The sequential loop steps of the 1-device call (``fof_steps``; 0 entries left out)."""
    import jax.numpy as jnp

    from shardax.particles import Particles
    from shardax.spatial._fof import fof_steps

    part = Particles(pos=jnp.asarray(pos), num=jnp.int32(len(pos)))
    steps, _ = fof_steps(part, linking_length, box=1.0, min_members=2, tuning=tuning)
    return {name: count for name, count in steps.items() if count}


def temporaries(pos: np.ndarray, linking_length: float, tuning: str | None = None,
                catalogue: bool = True) -> float | None:
    """XLA's temporaries of the compiled 1-device call (buffers beyond its inputs and outputs), bytes per point
    (``catalogue=False``: of the labels-only call)."""
    import jax
    import jax.numpy as jnp

    from shardax.spatial._fof import fof

    fn = jax.jit(lambda p: fof(p, linking_length, box=1.0, min_members=2, tuning=tuning, catalogue=catalogue))
    stats = fn.lower(jnp.asarray(pos)).compile().memory_analysis()
    return None if stats is None else stats.temp_size_in_bytes / len(pos)


def worker(n: int, repeat: int, bs: list[float], tuning: str | None = None, data: str = "uniform") -> dict:
    """Timings on all devices of this run (used on its own by the multi-process launch), round-robin with the
    1-device call on process 0 (the other processes wait at a barrier meanwhile, see ``time_lead_rounds``): the ratio
    of the two is measured under one load."""
    import jax

    import shardax as sx
    from shardax.cli._bench_cases import time_lead_rounds

    sx.initialize()
    pos = points(n, data, 0)
    out = {}
    for b in bs:
        ll = b / n ** (1 / 3)
        run, res = shardax_fof(pos, ll, 0, tuning)
        one = single_device_fof(pos, ll, tuning) if jax.process_index() == 0 else None
        lead_times, times = time_lead_rounds(one, run, repeat, f"fof-b{b}")
        out[f"b={b}"] = {"time": float(np.median(times)), "ghost_rows": _ghost_rows(res),
                         "devices": jax.device_count(),
                         "one_device": float(np.median(lead_times)) if lead_times else None}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, default=1_000_000)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--b", default="0.2,0.7", help="linking lengths in mean spacings (comma separated)")
    parser.add_argument("--processes", type=int, default=0, help="also run on this many processes x 4 devices")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--json", default=None, help="also write the results to this JSON file")
    parser.add_argument("--tuning", choices=("cpu", "gpu"), default=None,
                        help="FofTuning preset of every call (default: the backend's)")
    parser.add_argument("--data", choices=("uniform", "clustered"), default="uniform",
                        help="uniform points, or shardax halos's clustered particles (default uniform)")
    ns = parser.parse_args()
    bs = [float(b) for b in ns.b.split(",")]
    if ns.worker:
        result = worker(ns.n, ns.repeat, bs, ns.tuning, ns.data)
        import jax

        if jax.process_index() == 0:
            print("RESULT " + json.dumps(result), flush=True)
        return

    import jax

    pos = points(ns.n, ns.data, 0)
    results: dict = {"n": ns.n, "data": ns.data, "cases": {}}
    for b in bs:
        ll = b / ns.n ** (1 / 3)
        case: dict = {}
        reference = scipy_fof(pos.astype(np.float64), ll)
        case["scipy"] = _median_time(lambda ll=ll: scipy_fof(pos.astype(np.float64), ll), ns.repeat)
        try:
            import pyfof

            case["pyfof"] = _median_time(lambda ll=ll: pyfof.friends_of_friends(pos.astype(np.float64), ll),
                                         ns.repeat)
        except ImportError:
            pass
        runs = {}
        for ndev in (1, 8):
            run, res = shardax_fof(pos, ll, ndev, ns.tuning)
            groups = int((np.bincount(reference) >= 2).sum())
            runs[f"shardax {ndev} dev"] = run
            case[f"ghost rows/dev {ndev}"] = _ghost_rows(res)
            got = int(np.asarray(res.catalogue.num).sum())
            if got != groups:
                raise AssertionError(f"b={b}, {ndev} devices: {got} groups, the reference has {groups}")
        # Round-robin (after a warm-up call of each): load changes on the shared machine hit both alike.
        _, times = time_rounds(runs, ns.repeat)
        case.update({name: float(np.median(t)) for name, t in times.items()})
        if ns.processes:
            from shardax.testing import launch_script

            extra = ["--data", ns.data] + (["--tuning", ns.tuning] if ns.tuning else [])
            launched = launch_script(__file__, "--worker", "--n", str(ns.n), "--repeat", str(ns.repeat), "--b",
                                     str(b), *extra, num_processes=ns.processes, cpu_devices=4, timeout_s=3000)
            lines = [x for x in launched.output.splitlines() if "RESULT " in x]
            if launched.returncode != 0 or not lines:
                raise RuntimeError(f"multi-process run failed:\n{launched.output[-3000:]}")
            mp = json.loads(lines[0].split("RESULT ", 1)[1])[f"b={b}"]
            case[f"shardax {ns.processes}x4"] = mp["time"]
            case[f"shardax 1 dev, {ns.processes}x4 launch"] = mp["one_device"]
            case[f"ghost rows/dev {ns.processes}x4"] = mp["ghost_rows"]
        steps = step_counts(pos, ll, ns.tuning)
        case["steps"] = steps
        temp = temporaries(pos, ll, ns.tuning)
        labels_temp = temporaries(pos, ll, ns.tuning, catalogue=False)
        case["temp_bytes"], case["labels_only_temp_bytes"] = temp, labels_temp
        results["cases"][f"b={b}"] = case
        single = case["shardax 1 dev"]
        timed = {k: v for k, v in case.items() if k not in ("steps", "temp_bytes", "labels_only_temp_bytes")}
        print(f"b={b}: " + ", ".join(f"{k} {v:.3f}{'' if 'ghost' in k else ' s'}" for k, v in timed.items())
              + f" | 1 dev / scipy = {single / case['scipy']:.2f}x, 8 dev / 1 dev = "
              f"{case['shardax 8 dev'] / single:.2f}x"
              + (f", {ns.processes}x4 / 1 dev of its launch = "
                 f"{case[f'shardax {ns.processes}x4'] / case[f'shardax 1 dev, {ns.processes}x4 launch']:.2f}x"
                 if ns.processes else "")
              + f" | 1-device loop steps: {steps}"
              + ("" if temp is None else f", temporaries {temp:.0f} B per point")
              + ("" if labels_temp is None else f" ({labels_temp:.0f} B labels only)"), flush=True)
    # Surface scaling of the exchange: ghost rows per device at n / 8 and n, on 8 devices.
    small = max(ns.n // 8, 1000)
    pos_small = points(small, ns.data, 1)
    _, res_small = shardax_fof(pos_small, 0.2 / small ** (1 / 3), 8, ns.tuning)
    _, res_big = shardax_fof(pos, 0.2 / ns.n ** (1 / 3), 8, ns.tuning)
    g_small, g_big = _ghost_rows(res_small), _ghost_rows(res_big)
    ratio = g_big / max(g_small, 1)
    results["surface"] = {"n_small": small, "ghost_rows_small": g_small, "ghost_rows_big": g_big, "ratio": ratio,
                          "volume_ratio": ns.n / small, "surface_ratio": (ns.n / small) ** (2 / 3)}
    print(f"ghost rows per device (8 devices, b=0.2): {g_small:.0f} at n={small}, {g_big:.0f} at n={ns.n}: "
          f"x{ratio:.2f} for x{ns.n / small:.0f} particles (surface law x{(ns.n / small) ** (2 / 3):.2f}); "
          f"{24 * g_big / 2**20:.2f} MiB per device per exchange of positions", flush=True)
    print(f"devices: {jax.device_count()} ({jax.devices()[0].platform})")
    if ns.json:
        with open(ns.json, "w") as f:
            json.dump(results, f, indent=1)
    sys.stdout.flush()


if __name__ == "__main__":
    from shardax.runtime import restart_with_malloc_env

    # glibc's allocator as in the processes shardax launches (SHARDAX_MALLOC=system: its defaults)
    restart_with_malloc_env(sys.argv)
    main()
