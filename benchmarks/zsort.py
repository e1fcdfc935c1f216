"""Benchmark: ``sx.particles.zsort`` of uniform float32 points vs NumPy, and across devices and processes.

Usage (from the repository root)::

    python benchmarks/zsort.py                 # 1 device vs NumPy, 8 devices in one process, 2 processes x 4
    python benchmarks/zsort.py --n 1000000 --repeat 7 --no-multiprocess

Figures (medians over ``--repeat`` calls after a warm-up; the single-process candidates are timed round-robin in one
run so that the shared-machine noise affects them alike; the 2x4 run is a separate launch, with its own 1-device
baseline):

- ``numpy``: Morton keys in NumPy (same quantisation, 64-bit magic-number bit spreading), ``np.argsort`` and the
  gather of every field (pos, ids, mass): the NumPy z-sort of the same particles. ``np.argsort`` alone is also given.
- ``zsort 1 device``: the local view under ``jax.jit`` (keys, packed 64-bit sort, one gather of all fields).
- ``zsort 8 devices``: ``zsort.smap`` on 8 CPU devices of this process (the same 2 cores), same total.
- ``zsort 2x4``: the same under ``shardax launch -n 2 --cpu-devices 4``, timed round-robin with ``zsort 1 device,
  same launch`` (the 1-device call on process 0 while process 1 waits at a barrier): its ratio to that is the
  one measured under one load (the separate runs' loads on this shared machine differ by up to 30%).
- ``bucket_sort 8 devices``: FoF's z-order sort (``shardax._zorder.bucket_sort``: the rows move once, to their
  bucket, and are sorted there; sample-sort counts, capacity 1.125x the share) on the same 8 devices, for the
  comparison of the two ways of moving the data (see ``shardax._zorder``).
- peak memory per device from XLA's memory analysis (arguments + outputs + temporaries, less the donated buffers
  the outputs reuse) relative to the particle buffers (``capacity x bytes per particle``), without and with
  donation of the input (``zsort.smap(mesh, donate=True)``), and of ``bucket_sort`` on 8 devices.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Callable
from typing import Any

import numpy as np


def _interleaved(fns: dict[str, Callable[[], Any]], repeat: int) -> dict[str, float]:
    """Median seconds of each function, timed round-robin so that load changes hit them alike."""
    from shardax.cli._bench_cases import time_rounds

    _, times = time_rounds(fns, repeat)
    return {name: statistics.median(t) for name, t in times.items()}


def single_process(n: int, repeat: int) -> dict[str, float]:
    import jax

    import shardax as sx
    from shardax.cli._bench_cases import numpy_zsort
    from shardax.particles import uniform, zsort

    part = jax.jit(lambda: uniform(n, box=1.0, seed=0))()
    pos, ids, mass = (np.asarray(a)[:n] for a in (part.pos, part.ids, part.mass))
    key = np.arange(n, dtype=np.uint64)[np.random.default_rng(0).permutation(n)]
    local = jax.jit(lambda p: zsort(p, box=1.0))
    fns: dict[str, Callable[[], Any]] = {
        "numpy": lambda: numpy_zsort(pos, ids, mass),
        "numpy argsort only": lambda: np.argsort(key),
        "zsort 1 device": lambda: local(part),
    }
    ndev = jax.device_count()
    if ndev > 1:
        mesh = sx.flat_mesh()
        glob = uniform.smap(mesh)(n=n // ndev, box=1.0, seed=0)
        sort = zsort.smap(mesh)
        fns[f"zsort {ndev} devices"] = lambda: sort(glob, box=1.0)
        bucket = _bucket_sort(glob, mesh)
        fns[f"bucket_sort {ndev} devices"] = lambda: bucket(jax.tree.leaves(glob))
    out = _interleaved(fns, repeat)
    out["memory ratio 1 device"] = _memory_ratio(local, part)
    out["memory ratio 1 device, donated"] = _memory_ratio(jax.jit(lambda p: zsort(p, box=1.0), donate_argnums=0),
                                                          part)
    if ndev > 1:
        leaves, treedef = jax.tree.flatten(glob)

        def body(leaves: list[jax.Array]) -> Any:
            return zsort(jax.tree.unflatten(treedef, leaves), box=1.0)

        for donate, label in (((), ""), ((0,), ", donated")):
            # What zsort.smap(mesh) and zsort.smap(mesh, donate=True) compile.
            fn = jax.jit(sx.smap(body, in_specs=(sx.ALL,), out_specs=sx.ALL, mesh=mesh), donate_argnums=donate)
            out[f"memory ratio {ndev} devices{label}"] = _memory_ratio(fn, leaves)
        out[f"memory ratio {ndev} devices, bucket_sort"] = _memory_ratio(_bucket_sort(glob, mesh), leaves)
    return out


def _bucket_sort(glob: Any, mesh: Any) -> Any:
    """FoF's one-exchange z-order sort of ``glob`` on ``mesh``, jitted, over the global leaves."""
    import jax

    import shardax as sx
    from shardax._zorder import bucket_sort

    leaves, treedef = jax.tree.flatten(glob)
    n = leaves[0].shape[1]

    def body(leaves: list[jax.Array]) -> Any:
        return bucket_sort(jax.tree.unflatten(treedef, leaves), box=1.0, capacity=n + n // 8).part

    return jax.jit(sx.smap(body, in_specs=(sx.ALL,), out_specs=sx.ALL, mesh=mesh))


def _memory_ratio(fn: Any, part: Any) -> float:
    """Peak bytes per device (arguments + outputs - donated buffers reused by outputs + temporaries) over the
    particle buffers' bytes per device."""
    import jax

    stats = fn.lower(part).compile().memory_analysis()
    leaves = jax.tree.leaves(part)
    ndev = len(leaves[0].sharding.device_set)
    data = sum(leaf.nbytes for leaf in leaves if leaf.ndim >= 1 and leaf.size > ndev) / ndev
    peak = (stats.argument_size_in_bytes + stats.output_size_in_bytes - stats.alias_size_in_bytes
            + stats.temp_size_in_bytes)
    return peak / data


def distributed_child(n: int, repeat: int, path: str) -> None:
    """The 2x4 timing, round-robin with the 1-device zsort of the same points on process 0's first device (process 1
    waits at a barrier meanwhile, see ``time_lead_rounds``): the 2x4 ratio is measured under one load."""
    import jax

    import shardax as sx
    from shardax.cli._bench_cases import time_lead_rounds
    from shardax.particles import uniform, zsort

    sx.initialize()
    mesh = sx.flat_mesh()
    glob = uniform.smap(mesh)(n=n // jax.device_count(), box=1.0, seed=0)
    sort = zsort.smap(mesh)
    one = None
    if jax.process_index() == 0:
        part = jax.jit(lambda: uniform(n, box=1.0, seed=0))()
        local = jax.jit(lambda p: zsort(p, box=1.0))
        one = lambda: local(part)  # noqa: E731
    lead_times, times = time_lead_rounds(one, lambda: sort(glob, box=1.0), repeat, "zsort")
    if jax.process_index() == 0:
        with open(path, "w") as f:
            json.dump({"zsort 1 device, same launch": statistics.median(lead_times),
                       f"zsort {jax.process_count()}x{jax.local_device_count()}": statistics.median(times)}, f)


def main() -> None:
    parser = argparse.ArgumentParser(description=str(__doc__).splitlines()[0])
    parser.add_argument("--n", type=int, default=1_000_000, help="total number of particles")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--no-multiprocess", action="store_true", help="skip the 2 processes x 4 devices run")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        distributed_child(args.n, args.repeat, args.child)
        return

    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax

    jax.config.update("jax_num_cpu_devices", 8)
    results = single_process(args.n, args.repeat)
    if not args.no_multiprocess:
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "mp.json")
            subprocess.run([sys.executable, "-m", "shardax.cli", "launch", "-n", "2", "--cpu-devices", "4",
                            __file__, "--n", str(args.n), "--repeat", str(args.repeat), "--child", path],
                           check=True)
            with open(path) as f:
                results.update(json.load(f))
    base = results["zsort 1 device"]
    print(f"zsort of {args.n:.0e} uniform float32 points (pos, ids, mass), medians of {args.repeat}")
    for name, value in results.items():
        if name.startswith("memory"):
            print(f"  {name:28s} {value:6.2f}x particle buffers")
        elif name.startswith("zsort 2x") and "zsort 1 device, same launch" in results:
            print(f"  {name:28s} {value * 1e3:8.1f} ms   {value / base:5.2f}x zsort 1 device, "
                  f"{value / results['zsort 1 device, same launch']:5.2f}x zsort 1 device of the same launch "
                  "(target <= 1.5)")
        else:
            print(f"  {name:28s} {value * 1e3:8.1f} ms   {value / base:5.2f}x zsort 1 device")
    print(f"  zsort 1 device / numpy       {base / results['numpy']:5.2f}x (target <= 1.0)")


if __name__ == "__main__":
    from shardax.runtime import restart_with_malloc_env

    # glibc's allocator as in the processes shardax launches (SHARDAX_MALLOC=system: its defaults)
    restart_with_malloc_env(sys.argv)
    main()
