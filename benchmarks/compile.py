"""Benchmark: the first call of each kernel on 8 CPU devices in one process, and where its time goes.

Each kernel (``zsort.smap``, ``knn.smap`` (k = 9), ``fof.smap`` (b = 0.2 mean spacings; ``fof-labels``: with
``catalogue=False``), ``paint``, ``fftn``,
``potrs``) runs in a fresh process with 8 CPU devices (``--devices``), on the global function a user calls. For its
first call the table gives the wall time, and the seconds JAX spent tracing (jaxpr), lowering (jaxpr to StableHLO)
and compiling (XLA) summed over every program that call compiled (JAX's own ``/jax/core/compile/*`` duration
events, the same phases as ``jax.jit(f).trace`` / ``.lower`` / ``.compile``), the number of programs, then the
second call (steady state). The programs XLA compiled are counted after optimisation (their HLO text, read after the
timed calls): instructions, ``while`` loops, and unrolled copies (computations whose text, names aside, repeats
another's). To look at them, dump them: ``XLA_FLAGS=--xla_dump_to=DIR python benchmarks/compile.py --worker fof``
(a dump slows the compilation down: on CPU it writes the LLVM IR of every kernel too).

    python benchmarks/compile.py                         # every kernel, 1e6 particles, 128^3 fftn, potrs N=2048
    python benchmarks/compile.py --only fof,knn --json /tmp/compile.json
    SHARDAX_HOST_SORT=0 python benchmarks/compile.py     # the cacheable path (no host-sort callback)

Target: every first call at most 15 s.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

KERNELS = ("zsort", "knn", "fof", "fof-labels", "paint", "fftn", "potrs")
_EVENTS = {"/jax/core/compile/jaxpr_trace_duration": "trace_s",
           "/jax/core/compile/jaxpr_to_mlir_module_duration": "lower_s",
           "/jax/core/compile/backend_compile_duration": "compile_s"}


def _parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--particles", type=int, default=1_000_000, help="particles of zsort/knn/fof/paint")
    parser.add_argument("--grid", type=int, default=128, help="grid points per axis of paint and fftn")
    parser.add_argument("--linalg", type=int, default=2048, help="matrix order of potrs (float32)")
    parser.add_argument("--devices", type=int, default=8, help="CPU devices of the process (default 8)")
    parser.add_argument("--only", default="", help="comma-separated kernels (default: all)")
    parser.add_argument("--json", default="", help="write the results to this JSON file")
    parser.add_argument("--worker", default="", help=argparse.SUPPRESS)
    return parser.parse_args()


def _call(kernel: str, args: argparse.Namespace) -> Any:
    """The kernel's global call on ``args``' sizes, inputs made (and placed) before the clock starts."""
    import jax
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import shardax as sx

    mesh = sx.flat_mesh()
    rng = np.random.default_rng(0)
    n, g = args.particles, args.grid
    if kernel in ("zsort", "knn", "fof", "fof-labels", "paint"):
        part = sx.particles.from_numpy(rng.random((n, 3), dtype=np.float32), mesh=mesh)
        jax.block_until_ready(part)
        if kernel == "zsort":
            fn = sx.particles.zsort.smap(mesh)
            return lambda: fn(part, box=1.0)
        if kernel == "knn":
            fn = sx.spatial.knn.smap(mesh)
            return lambda: fn(part, 9, box=1.0)
        if kernel in ("fof", "fof-labels"):
            fn = sx.spatial.fof.smap(mesh)
            linking_length = 0.2 / n ** (1 / 3)
            catalogue = kernel == "fof"  # fof-labels: labels only (catalogue=False)
            return lambda: fn(part, linking_length, box=1.0, catalogue=catalogue)
        return lambda: sx.fields.paint(part, (g, g, g), box=1.0, mesh=mesh)
    if kernel == "fftn":
        field = jax.device_put(rng.standard_normal((g, g, g)).astype(np.complex64), NamedSharding(mesh, P("d")))
        return lambda: sx.fft.fftn(field)
    m = args.linalg
    base = rng.standard_normal((m, m)).astype(np.float32) / np.sqrt(m)
    a = jax.device_put(base @ base.T + 2 * np.eye(m, dtype=np.float32), NamedSharding(mesh, P("d", None)))
    b = jax.device_put(np.ones((m,), np.float32), NamedSharding(mesh, P()))
    return lambda: sx.linalg.potrs(a, b)


def _program_stats(texts: list[str]) -> dict[str, int]:
    """Counts over XLA's optimised programs (HLO text): programs, instructions, while loops, unrolled copies."""
    instructions = whiles = copies = 0
    for text in texts:
        bodies: Counter[str] = Counter()
        for block in re.split(r"\n(?=\S)", text):
            lines = [line for line in block.splitlines()[1:] if line.strip() and line.strip() != "}"]
            instructions += len(lines)
            whiles += sum(" while(" in line for line in lines)
            if len(lines) >= 8:  # small helpers (reducers, comparators) legitimately repeat
                bodies[re.sub(r"[%\w.-]+(?=[ =,)])|\.\d+", "_", "\n".join(lines))] += 1
        copies += sum(count - 1 for count in bodies.values())
    return {"programs": len(texts), "instructions": instructions, "whiles": whiles, "copies": copies}


def _capture_executables() -> list[Any]:
    """Every executable XLA compiles from now on, appended to the returned list (JAX's compile step wrapped)."""
    from jax._src import compiler

    captured: list[Any] = []
    compile_and_load = compiler.backend_compile_and_load

    def capturing(*args: Any, **kwargs: Any) -> Any:
        executable = compile_and_load(*args, **kwargs)
        captured.append(executable)
        return executable

    compiler.backend_compile_and_load = capturing
    return captured


def _worker(kernel: str, args: argparse.Namespace) -> None:
    import jax
    import jax.monitoring

    jax.config.update("jax_num_cpu_devices", args.devices)
    phases = dict.fromkeys(_EVENTS.values(), 0.0)

    def listen(event: str, seconds: float, **_: Any) -> None:
        if event in _EVENTS:
            phases[_EVENTS[event]] += seconds

    fn = _call(kernel, args)
    executables = _capture_executables()
    jax.monitoring.register_event_duration_secs_listener(listen)
    start = time.perf_counter()
    jax.block_until_ready(fn())
    first = time.perf_counter() - start
    first_phases = dict(phases)
    start = time.perf_counter()
    jax.block_until_ready(fn())
    second = time.perf_counter() - start
    texts = [module.to_string() for exe in executables for module in exe.hlo_modules()]
    print(json.dumps({"kernel": kernel, "first_s": first, "second_s": second, **first_phases,
                      "recompile_s": phases["compile_s"] - first_phases["compile_s"], **_program_stats(texts)}))


def _run(kernel: str, args: argparse.Namespace) -> dict[str, Any]:
    env = dict(os.environ, JAX_ENABLE_COMPILATION_CACHE="false")  # every program compiled, none read back
    cmd = [sys.executable, __file__, "--worker", kernel, "--particles", str(args.particles), "--grid",
           str(args.grid), "--linalg", str(args.linalg), "--devices", str(args.devices)]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    if done.returncode:
        return {"kernel": kernel, "error": done.stderr.strip().splitlines()[-1:]}
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    args = _parse()
    if args.worker:
        _worker(args.worker, args)
        return
    only = [name for name in args.only.split(",") if name] or list(KERNELS)
    unknown = sorted(set(only) - set(KERNELS))
    if unknown:
        raise SystemExit(f"--only: unknown kernel(s) {unknown}; choose from {', '.join(KERNELS)}")
    import jax

    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(f"{args.devices} CPU devices in one process, JAX {jax.__version__}: {args.particles} particles, "
          f"{args.grid}^3 grid, potrs N={args.linalg}; SHARDAX_HOST_SORT={os.environ.get('SHARDAX_HOST_SORT', '1')}"
          f"; load {load:.2f}")
    print(f"{'kernel':<8}{'first s':>9}{'trace':>8}{'lower':>8}{'compile':>9}{'progs':>7}{'instrs':>9}{'whiles':>8}"
          f"{'copies':>8}{'second s':>10}")
    results = []
    for kernel in only:
        res = _run(kernel, args)
        results.append(res)
        if "error" in res:
            print(f"{kernel:<8} failed: {res['error']}")
            continue
        print(f"{kernel:<8}{res['first_s']:>9.2f}{res['trace_s']:>8.2f}{res['lower_s']:>8.2f}{res['compile_s']:>9.2f}"
              f"{res['programs']:>7}{res['instructions']:>9}{res['whiles']:>8}{res['copies']:>8}"
              f"{res['second_s']:>10.3f}", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "load": load, "results": results}, indent=1))


if __name__ == "__main__":
    main()
