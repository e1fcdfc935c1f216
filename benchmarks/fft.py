"""Distributed 3D FFT benchmark: sx.fft.fftn side by side with jnp.fft.fftn (one device and XLA SPMD) and jaxdecomp.

Every variant runs in the same process on the same CPU devices, in interleaved rounds (robust to noise on a shared
machine); the table gives the median wall time of one forward transform, its ratio to single-device
``jnp.fft.fftn`` and the bytes each device sends per transform, read from the compiled program's all-to-alls.

    python benchmarks/fft.py                    # 256^3 complex64 on 8 CPU devices
    python benchmarks/fft.py --n 128 --repeats 5
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable

os.environ.setdefault("JAX_PLATFORMS", "cpu")


def _parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=256, help="grid size per axis (default 256)")
    parser.add_argument("--devices", type=int, default=8, help="CPU devices in this process (default 8)")
    parser.add_argument("--repeats", type=int, default=7, help="timed rounds (default 7)")
    parser.add_argument("--dtype", default="complex64", choices=["complex64", "complex128"])
    return parser.parse_args()


def main() -> None:
    args = _parse()
    import jax

    jax.config.update("jax_num_cpu_devices", args.devices)
    if args.dtype == "complex128":
        jax.config.update("jax_enable_x64", True)
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    import shardax as sx

    n, ndev = args.n, args.devices
    shape = (n, n, n)
    dtype = np.dtype(args.dtype)
    host = (np.random.default_rng(0).standard_normal(shape) + 1j).astype(dtype)
    devices = np.array(jax.devices()[:ndev])
    slab = Mesh(devices.reshape(ndev, 1), ("x", "y"))
    rows = 2 if ndev % 2 == 0 and ndev > 2 else 1
    pencil = Mesh(devices.reshape(ndev // rows, rows), ("x", "y"))

    cases: list[tuple[str, Callable, jax.Array, int]] = []

    def add(name: str, fn: Callable, x: jax.Array, expected_bytes: int = 0) -> None:
        cases.append((name, jax.jit(fn), x, expected_bytes))

    add("jnp.fft.fftn, 1 device", jnp.fft.fftn, jax.device_put(host, devices[0]))
    x_slab = jax.device_put(host, NamedSharding(slab, P("x")))
    x_pencil = jax.device_put(host, NamedSharding(pencil, P("x", "y")))
    add(f"jnp.fft.fftn, XLA SPMD P(x) {ndev}x1", jnp.fft.fftn, x_slab)
    for label, mesh, spec, x in [(f"slab {ndev}x1", slab, P("x"), x_slab),
                                 (f"pencil {ndev // rows}x{rows}", pencil, P("x", "y"), x_pencil)]:
        for layout in ("transposed", "same"):
            plan = sx.fft.plan(shape, spec, mesh=mesh, layout=layout)
            add(f"sx.fft.fftn {label} {layout}",
                lambda v, mesh=mesh, spec=spec, layout=layout: sx.fft.fftn(v, mesh=mesh, spec=spec, layout=layout),
                x, plan.bytes_moved(dtype.itemsize))
    try:
        import jaxdecomp
    except ImportError:
        print("jaxdecomp not installed (pip install jaxdecomp packaging): skipped")
    else:
        for label, grid in [(f"{ndev}x1", (ndev, 1)), (f"{ndev // rows}x{rows}", (ndev // rows, rows))]:
            mesh = Mesh(devices.reshape(grid), ("z", "y"))
            x = jax.device_put(host, NamedSharding(mesh, P("z", "y")))
            add(f"jaxdecomp pfft3d(JAX) {label}", lambda v: jaxdecomp.fft.pfft3d(v, backend="JAX"), x)

    reference = np.asarray(cases[0][1](cases[0][2]))
    volumes = {}
    for name, fn, x, _ in cases:
        volumes[name] = sx.comm.collective_bytes(fn.lower(x).compile())
        out = fn(x)
        if "jaxdecomp" not in name and "transposed" not in name:
            err = float(np.max(np.abs(np.asarray(out) - reference)) / np.max(np.abs(reference)))
            if err > 1e-4:
                raise AssertionError(f"{name}: relative error {err:.2e} against jnp.fft.fftn")
        jax.block_until_ready(fn(x))
    times: dict[str, list[float]] = {name: [] for name, *_ in cases}
    for _ in range(args.repeats):
        for name, fn, x, _ in cases:
            start = time.perf_counter()
            jax.block_until_ready(fn(x))
            times[name].append(time.perf_counter() - start)

    base = statistics.median(times[cases[0][0]])
    print(f"\n3D FFT {n}^3 {dtype.name}, {ndev} CPU devices in one process, median of {args.repeats} rounds")
    print(f"{'variant':44s} {'median ms':>10s} {'vs 1 dev':>9s} {'a2a ops':>8s} {'MiB sent/dev':>13s} "
          f"{'theory MiB':>11s}")
    for name, _, _, expected in cases:
        med = statistics.median(times[name])
        vol = volumes[name]
        theory = f"{expected / 2**20:11.2f}" if expected else f"{'':11s}"
        print(f"{name:44s} {med * 1e3:10.1f} {med / base:9.2f} {vol.ops:8d} {vol.bytes_sent / 2**20:13.2f} "
              f"{theory}")
    jd = [statistics.median(times[name]) for name, *_ in cases if name.startswith("jaxdecomp")]
    best = min(statistics.median(times[name]) for name, *_ in cases if name.startswith("sx.fft"))
    if jd:
        print(f"best sx.fft / best jaxdecomp: {best / min(jd):.2f}")
    print(f"best sx.fft / jnp.fft.fftn 1 device: {best / base:.2f}")


if __name__ == "__main__":
    from shardax.runtime import restart_with_malloc_env

    # glibc's allocator as in the processes shardax launches (SHARDAX_MALLOC=system: its defaults)
    restart_with_malloc_env(sys.argv)
    main()
