"""Benchmark: the cost of every kernel's global wrapper on one device, against ``jax.jit`` of its local view.

On a mesh of one device a global function (``paint``, ``readout``, ``power_spectrum``, ``zsort.smap``,
``knn.smap`` (k = 9), ``fof.smap`` (b = 0.2 mean spacings), ``fftn``, ``potrs``; all with a periodic box 1) should
do no more than its local view: no exchange, no count of destinations, no extra passes. ``nbody.lpt`` (2LPT on the
``--grid`` particle grid) is timed against ``jax.jit`` of the same global call, and the ``eager local`` rows call
the local views of FoF, zsort and kNN outside any ``jit``: none of them may run operation by operation. Both run
in the same process on the same device, timed round-robin (``--repeat`` calls after a warm-up, each call's result
waited for); the table gives the fastest call of each and their ratio (target: at most 1.1), and the ratio of the
medians.

``--profile FILE`` also runs each global function under ``cProfile`` and writes where its host time goes: on a
GPU the device's work of a global function and of its local view is the same, and what differs is on the host.

The ``overhead`` rows time the wrapper alone: ``sx.smap``, an ``sx.distributed`` function's ``.smap`` and
``conservation.smap`` on a few rows, each timing ``--calls`` calls in a loop, against ``jax.jit`` of the same local
function; their last column is the wrapper's added cost per call in microseconds.

    python benchmarks/wrappers.py                           # moderate sizes on the default backend
    python benchmarks/wrappers.py --particles 10000000 --grid 256 --linalg 8192   # GPU sizes
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any


def _parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--particles", type=int, default=1_000_000, help="particles of paint/readout/zsort/knn/fof")
    parser.add_argument("--grid", type=int, default=64, help="grid points per axis of paint/readout/power/fftn")
    parser.add_argument("--linalg", type=int, default=1024, help="matrix order of potrs (float32)")
    parser.add_argument("--repeat", type=int, default=7, help="timed calls of each (default 7)")
    parser.add_argument("--calls", type=int, default=200, help="calls per timing of the overhead rows (default 200)")
    parser.add_argument("--only", default="", help="comma-separated kernels to run (default: all)")
    parser.add_argument("--profile", default=None, metavar="FILE",
                        help="also run each global function --calls times under cProfile and write where the host "
                             "time goes (top functions by own and by cumulative time) to FILE")
    return parser.parse_args()


def _interleaved(pairs: dict[str, tuple[Callable[[], Any], Callable[[], Any]]], repeat: int
                 ) -> dict[str, tuple[list[float], list[float]]]:
    """Seconds of every call of each ``(global, local)`` pair, every function timed once per round."""
    import jax

    for fns in pairs.values():
        for fn in fns:
            jax.block_until_ready(fn())
    times: dict[str, tuple[list[float], list[float]]] = {name: ([], []) for name in pairs}
    for _ in range(repeat):
        for name, fns in pairs.items():
            for fn, out in zip(fns, times[name], strict=True):
                start = time.perf_counter()
                jax.block_until_ready(fn())
                out.append(time.perf_counter() - start)
    return times


def _cases(args: argparse.Namespace) -> dict[str, tuple[Callable[[], Any], Callable[[], Any]]]:
    """The requested ``(global, local)`` pairs: kernels built only when one is asked for."""
    import jax
    import numpy as np
    from jax.sharding import Mesh

    only = [name for name in args.only.split(",") if name]
    mesh = Mesh(np.array([jax.devices()[0]]), ("d",))
    cases = {} if only and all(name in _OVERHEAD for name in only) else _kernel_cases(args)
    cases.update(_overhead_cases(mesh, args.calls))
    return {name: fns for name, fns in cases.items() if not only or name in only}


def _kernel_cases(args: argparse.Namespace) -> dict[str, tuple[Callable[[], Any], Callable[[], Any]]]:
    """Every kernel's global function and its local view, on one device."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    import shardax as sx
    from shardax.linalg._layout import BlockCyclic
    from shardax.linalg._potrs import solve_local

    device = jax.devices()[0]
    mesh = Mesh(np.array([device]), ("d",))
    rng = np.random.default_rng(0)
    n, g = args.particles, args.grid
    shape = (g, g, g)
    host = rng.random((n, 3), dtype=np.float32)
    part = sx.particles.from_numpy(host, mesh=mesh)
    # The local view gets the device's rows as the global one holds them (padding rows included).
    local = sx.particles.Particles(pos=jax.device_put(np.asarray(part.pos)[0], device),
                                   num=jax.device_put(np.asarray(part.num)[0], device))
    rho = sx.fields.paint(part, shape, box=1.0, mesh=mesh)
    rho_local = jax.device_put(np.asarray(rho), device)
    delta = rho / jnp.mean(rho) - 1
    delta_local = rho_local / jnp.mean(rho_local) - 1
    field = jax.device_put(rng.standard_normal(shape).astype(np.complex64), NamedSharding(mesh, P("d")))
    field_local = jax.device_put(np.asarray(field), device)
    m = args.linalg
    base = rng.standard_normal((m, m)).astype(np.float32) / np.sqrt(m)
    a_host = (base @ base.T + 2 * np.eye(m, dtype=np.float32)).astype(np.float32)
    a = jax.device_put(a_host, NamedSharding(mesh, P()))
    b = jax.device_put(np.ones((m,), np.float32), NamedSharding(mesh, P()))
    layout = BlockCyclic.create(m, None, 1)
    a_cyclic = jax.device_put(np.pad(a_host, ((0, layout.padded - m),) * 2) + np.diag(
        (np.arange(layout.padded) >= m).astype(np.float32)), device)
    b_local = jax.device_put(np.pad(np.ones((m, 1), np.float32), ((0, layout.padded - m), (0, 0))), device)

    local_paint = jax.jit(lambda p: sx.fields.local_paint(p, shape, box=1.0)[0])
    local_readout = jax.jit(lambda f, p: sx.fields.local_readout(f, p, box=1.0)[0])
    local_power = jax.jit(lambda d: sx.fields.local_power_spectrum(d, box=1.0, bins=16))
    local_zsort = jax.jit(lambda p: sx.particles.zsort(p))
    local_fft = jax.jit(sx.fft.local_fftn)
    local_solve = jax.jit(lambda a, b: solve_local(a, b, layout, False))
    global_zsort = sx.particles.zsort.smap(mesh)
    linking_length = 0.2 / n ** (1 / 3)  # b = 0.2 mean spacings
    local_knn = jax.jit(lambda p: sx.spatial.knn(p, 9, box=1.0))
    local_fof = jax.jit(lambda p: sx.spatial.fof(p, linking_length, box=1.0))
    global_knn, global_fof = sx.spatial.knn.smap(mesh), sx.spatial.fof.smap(mesh)
    cosmo = sx.nbody.Cosmology()
    noise = sx.nbody.white_noise(g, mesh=mesh)
    jitted_lpt = jax.jit(lambda w: sx.nbody.lpt(cosmo, w, box=100.0 * g, a=0.1, mesh=mesh))
    return {
        "paint": (lambda: sx.fields.paint(part, shape, box=1.0), lambda: local_paint(local)),
        "readout": (lambda: sx.fields.readout(rho, part, box=1.0), lambda: local_readout(rho_local, local)),
        "power_spectrum": (lambda: sx.fields.power_spectrum(delta, box=1.0, bins=16),
                           lambda: local_power(delta_local)),
        "zsort.smap": (lambda: global_zsort(part), lambda: local_zsort(local)),
        "knn.smap": (lambda: global_knn(part, 9, box=1.0), lambda: local_knn(local)),
        "fof.smap": (lambda: global_fof(part, linking_length, box=1.0), lambda: local_fof(local)),
        "fftn": (lambda: sx.fft.fftn(field), lambda: local_fft(field_local)),
        "potrs": (lambda: sx.linalg.potrs(a, b), lambda: local_solve(a_cyclic, b_local)),
        "nbody.lpt": (lambda: sx.nbody.lpt(cosmo, noise, box=100.0 * g, a=0.1, mesh=mesh),
                      lambda: jitted_lpt(noise)),
        "fof (eager local)": (lambda: sx.spatial.fof(local, linking_length, box=1.0), lambda: local_fof(local)),
        "zsort (eager local)": (lambda: sx.particles.zsort(local), lambda: local_zsort(local)),
        "knn (eager local)": (lambda: sx.spatial.knn(local, 9, box=1.0), lambda: local_knn(local)),
    }


_OVERHEAD = ("smap overhead", "distributed overhead", "conservation overhead")


def _overhead_cases(mesh: Any, calls: int) -> dict[str, tuple[Callable[[], Any], Callable[[], Any]]]:
    """Wrappers around a trivial body, ``calls`` calls per timing: what a global wrapper adds to each call."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import PartitionSpec as P

    import shardax as sx

    def scaled(x, *, factor=2.0):
        return x * factor

    global_scaled = sx.smap(scaled, in_specs=(P(sx.ALL),), out_specs=P(sx.ALL), mesh=mesh, jit=True)
    by_name = sx.distributed(scaled, in_specs={"x": P(sx.ALL)}, out_specs=P(sx.ALL)).smap(mesh)
    local_scaled = jax.jit(scaled)
    x, x_local = jnp.ones((1, 16)), jnp.ones((16,))
    part = sx.particles.from_numpy(np.random.default_rng(0).random((16, 3), dtype=np.float32), mesh=mesh)
    local_part = jax.tree.map(lambda a: a[0], part)
    global_check = sx.particles.conservation.smap(mesh)
    local_check = jax.jit(sx.particles.conservation)

    def loop(fn: Callable[[], Any]) -> Callable[[], Any]:
        def run() -> Any:
            for _ in range(calls - 1):
                fn()
            return fn()
        return run

    return {
        "smap overhead": (loop(lambda: global_scaled(x)), loop(lambda: local_scaled(x_local))),
        "distributed overhead": (loop(lambda: by_name(x, factor=3.0)), loop(lambda: local_scaled(x_local, factor=3.0))),
        "conservation overhead": (loop(lambda: global_check(part)), loop(lambda: local_check(local_part))),
    }


def _profile(pairs: dict[str, tuple[Callable[[], Any], Callable[[], Any]]], calls: int, path: str) -> None:
    """Write cProfile's view of ``calls`` waited-for calls of each global function to ``path``."""
    import cProfile
    import io
    import pstats

    import jax

    with open(path, "w") as out:
        for name, (glob, _) in pairs.items():
            if name in _OVERHEAD:
                continue
            profile = cProfile.Profile()
            profile.enable()
            for _ in range(calls):
                jax.block_until_ready(glob())
            profile.disable()
            text = io.StringIO()
            stats = pstats.Stats(profile, stream=text)
            for key in ("tottime", "cumulative"):
                stats.sort_stats(key).print_stats(25)
            out.write(f"## {name}: {calls} calls\n{text.getvalue()}\n")


def main() -> None:
    args = _parse()
    import jax

    cases = _cases(args)
    times = _interleaved(cases, args.repeat)
    if args.profile:
        _profile(cases, args.calls, args.profile)
    device = jax.devices()[0]
    print(f"{device.device_kind} ({jax.default_backend()}), JAX {jax.__version__}: {args.particles} particles, "
          f"{args.grid}^3 grid, potrs N={args.linalg} float32; {args.repeat} calls each")
    # The fastest calls are the least disturbed by other load on a shared machine; medians are given too.
    print(f"{'kernel':<22}{'global ms':>11}{'local ms':>11}{'ratio':>8}{'median ratio':>14}{'us/call':>9}")
    for name, (glob, loc) in times.items():
        added = (f"{1e6 * (statistics.median(glob) - statistics.median(loc)) / args.calls:>9.1f}"
                 if name in _OVERHEAD else "")
        print(f"{name:<22}{1e3 * min(glob):>11.2f}{1e3 * min(loc):>11.2f}{min(glob) / min(loc):>8.2f}"
              f"{statistics.median(glob) / statistics.median(loc):>14.2f}{added}")


if __name__ == "__main__":
    main()
