"""Collective benchmarks: sx.comm across 2 processes through MPI and gloo (vs mpi4py and mpi4jax), and alltoallv
vs all_to_all in one process.

Run everything (launches its own processes):

    python benchmarks/comm.py                # mpirun -n 2 at 1 and 4 devices/process, then alltoallv on 8 devices
    python benchmarks/comm.py --json out.json
    python benchmarks/comm.py --local        # only alltoallv and exchange in this process (8 CPU devices, small)
    python benchmarks/comm.py --kernels 1000000   # also zsort and FoF at 2 processes x 4 devices, both transports
    python benchmarks/comm.py --mpich /opt/shardax-mpich   # the same under MPICH's mpiexec (mpi4py pointed at it)

Each `mpirun -n 2` launch measures, side by side in the same two processes: an allreduce of 1e6 float32 per device
through mpi4py, mpi4jax (if installed; with several devices per process also an allreduce of all the process's
floats on one device, the same bytes per process as sx.comm moves) and sx.comm over each transport (MPI, which sx.initialize() picks under
mpirun when mpi4py is installed, then gloo), and an alltoallv of 2 MiB per device (balanced random counts) through
sx.comm over each transport and mpi4py's Alltoallv of the same rows between the processes, and, as the floor of
any XLA program with outputs of these sizes, ``v * 2`` of the same arrays. Timings are medians.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time

import numpy as np

N_FLOATS = 1_000_000
SAME_BYTES = "mpi4jax allreduce, the process's floats (jit)"


def _interleaved_ms(cases: dict, rounds: int = 8, repeats: int = 5, warmup: int = 3) -> dict[str, float]:
    """Median ms of each case, timed in turns (``repeats`` calls of each, ``rounds`` times) so that every case
    sees the same load over the run."""
    for fn in cases.values():
        for _ in range(warmup):
            fn()
    times: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(rounds):
        for name, fn in cases.items():
            for _ in range(repeats):
                t0 = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - t0)
    return {name: float(np.median(t) * 1e3) for name, t in times.items()}


def allreduce_worker(cpu_devices: int) -> None:
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import shardax as sx
    from shardax import _transport

    w = sx.initialize(cpu_devices=cpu_devices)
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    chosen = _transport.cpu_collectives()
    cases = {}
    host = np.ones(N_FLOATS, np.float32)
    out = np.empty_like(host)
    cases["mpi4py Allreduce"] = lambda: comm.Allreduce(host, out, op=MPI.SUM)
    try:
        if MPI.Get_library_version().lstrip().startswith("MPICH"):
            raise ImportError("mpi4jax is built against the machine's Open MPI here")
        import mpi4jax

        dev = jax.local_devices()[0]
        a = jax.device_put(jnp.ones(N_FLOATS, jnp.float32), dev)
        f = jax.jit(lambda v: mpi4jax.allreduce(v, op=MPI.SUM, comm=comm))
        cases["mpi4jax allreduce (jit)"] = lambda: f(a).block_until_ready()
        if w.local_device_count > 1:
            # The same bytes per process as sx.comm moves with several devices: all the process's floats (one
            # block per device) on one device, the only layout mpi4jax has.
            whole = jax.device_put(jnp.ones(w.local_device_count * N_FLOATS, jnp.float32), dev)
            cases[SAME_BYTES] = lambda: f(whole).block_until_ready()
    except ImportError:
        pass

    # shardax: every device contributes N_FLOATS values; the sum over all devices of all processes, through each
    # transport (read when a function is traced: each gets fresh functions, traced right after the switch).
    mesh = sx.flat_mesh()
    sharding = NamedSharding(mesh, P(mesh.axis_names))
    x = jax.make_array_from_process_local_data(sharding, np.ones((w.local_device_count, N_FLOATS), np.float32))
    ragged = _alltoallv_case(sx, w, mesh)
    for transport in ("mpi", "gloo") if chosen == "mpi" else ("gloo",):
        _transport.set_transport(transport, "benchmark")
        g = sx.smap(lambda v: sx.comm.allreduce(v), in_specs=(P(sx.ALL),), out_specs=P(sx.ALL), mesh=mesh, jit=True)
        got = np.asarray(g(x).addressable_shards[0].data)
        assert np.all(got == float(w.device_count)), (got[:4], w.device_count)
        cases[f"sx.comm.allreduce ({transport})"] = lambda g=g: g(x).block_until_ready()
        fv, args = ragged()
        fv(*args).block_until_ready()
        cases[f"sx.comm.alltoallv 2 MiB/device ({transport})"] = lambda f=fv, args=args: f(*args).block_until_ready()
    _transport.set_transport(chosen, "benchmark")
    cases["mpi4py Alltoallv 2 MiB/device"] = _mpi4py_alltoallv(comm, w)
    # What any XLA program pays for a fresh output of the same size on these devices (allocation, first touch of
    # its pages, memory bandwidth): the floor under a collective whose output XLA allocates, which mpi4py's calls
    # into preallocated host buffers do not pay.
    double = sx.smap(lambda v: v * 2, in_specs=(P(sx.ALL),), out_specs=P(sx.ALL), mesh=mesh, jit=True)
    rows = ragged()[1][0]
    cases["XLA floor: v * 2 of the allreduce input"] = lambda: double(x).block_until_ready()
    cases["XLA floor: v * 2 of the alltoallv rows"] = lambda: double(rows).block_until_ready()
    results = _interleaved_ms(cases)
    if w.process_id == 0:
        print("RESULT " + json.dumps({"cpu_devices": cpu_devices, "transport": chosen, "ms": results}), flush=True)


ROWS, WIDTH = 1 << 15, 16          # 32768 rows of 16 float32: 2 MiB per device


def _counts(size: int) -> np.ndarray:
    rng = np.random.default_rng(0)
    return rng.multinomial(ROWS, [1 / size] * size, size=size).astype(np.int32)   # (src, dst), rows sum to ROWS


def _alltoallv_case(sx, w, mesh):  # type: ignore[no-untyped-def]
    """A factory of ``(jitted alltoallv, args)``: balanced random counts, 2 MiB per device (fresh per transport)."""
    import jax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    size = w.device_count
    counts = _counts(size)
    cap = int(counts.sum(0).max())
    mine = slice(w.process_id * w.local_device_count, (w.process_id + 1) * w.local_device_count)
    sharding = NamedSharding(mesh, P(mesh.axis_names))
    rows = np.random.default_rng(1).standard_normal((size, ROWS, WIDTH)).astype(np.float32)[mine]
    x = jax.make_array_from_process_local_data(sharding, rows)
    c = jax.make_array_from_process_local_data(sharding, counts[mine])

    def make():  # type: ignore[no-untyped-def]
        f = sx.smap(lambda x, c: sx.comm.alltoallv(x, c, capacity=cap)[0], in_specs=(P(sx.ALL), P(sx.ALL)),
                    out_specs=P(sx.ALL), mesh=mesh, jit=True)
        return f, (x, c)

    return make


def _mpi4py_alltoallv(comm, w):  # type: ignore[no-untyped-def]
    """The same rows between the two processes with one ``Alltoallv`` of this process's devices' rows."""
    from mpi4py import MPI

    size, m = w.device_count, w.local_device_count
    counts = _counts(size)
    mine = counts[w.process_id * m:(w.process_id + 1) * m]                            # (m, size)
    send = np.random.default_rng(2).standard_normal((m * ROWS, WIDTH)).astype(np.float32)
    per_proc = mine.reshape(m, w.num_processes, m).sum(axis=(0, 2)) * WIDTH          # floats to each process
    recv_per = counts.reshape(w.num_processes, m, w.num_processes, m)[:, :, w.process_id].sum(axis=(1, 2)) * WIDTH
    recv = np.empty(int(recv_per.sum()), np.float32)
    sd = np.concatenate([[0], np.cumsum(per_proc)[:-1]])
    rd = np.concatenate([[0], np.cumsum(recv_per)[:-1]])
    return lambda: comm.Alltoallv([send, (per_proc, sd), MPI.FLOAT], [recv, (recv_per, rd), MPI.FLOAT])


def alltoallv_bench(devices: int = 8, rows: int = 1 << 15, width: int = 16) -> dict:
    """alltoallv with balanced random counts vs a tiled all_to_all of the same bytes (one process, 8 devices)."""
    code = f"""
import json, time, numpy as np, jax, jax.numpy as jnp
jax.config.update("jax_num_cpu_devices", {devices})
import shardax as sx
from jax.sharding import PartitionSpec as P
from jax import lax
sys_path = None
size, rows, width = {devices}, {rows}, {width}
mesh = sx.flat_mesh()
rng = np.random.default_rng(0)
counts = rng.multinomial(rows, [1 / size] * size, size=size).astype(np.int32)     # (src, dst), each row sums to rows
cap = int(counts.sum(0).max())
x = jnp.asarray(rng.standard_normal((size, rows, width)).astype(np.float32))
c = jnp.asarray(counts)
def v(x, c):
    return sx.comm.alltoallv(x, c, capacity=cap)[0]
def t(x):
    return lax.all_to_all(x.reshape(size, -1, width), sx.rank_info().axis_names, 0, 0, tiled=True).reshape(-1, width)
fv = sx.smap(v, in_specs=(P(sx.ALL), P(sx.ALL)), out_specs=P(sx.ALL), mesh=mesh, jit=True)
ft = sx.smap(t, in_specs=(P(sx.ALL),), out_specs=P(sx.ALL), mesh=mesh, jit=True)
def med(f, *a):
    for _ in range(3): f(*a).block_until_ready()
    ts = []
    for _ in range(20):
        t0 = time.perf_counter(); f(*a).block_until_ready(); ts.append(time.perf_counter() - t0)
    return float(np.median(ts) * 1e3)
mv = jax.jit(fv).lower(x, c).compile().memory_analysis()
mt = jax.jit(ft).lower(x).compile().memory_analysis()
pairs = []
for _ in range(5):
    pairs.append((med(fv, x, c), med(ft, x)))
tv = float(np.median([p[0] for p in pairs])); tt = float(np.median([p[1] for p in pairs]))
print("RESULT " + json.dumps(dict(alltoallv_ms=tv, all_to_all_ms=tt, ratio=tv / tt,
      alltoallv_temp_bytes=mv.temp_size_in_bytes, all_to_all_temp_bytes=mt.temp_size_in_bytes,
      data_bytes_per_device=rows * width * 4, capacity=cap)))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=900,
                         env={**os.environ, "JAX_PLATFORMS": "cpu"})
    line = [ln for ln in out.stdout.splitlines() if ln.startswith("RESULT ")]
    if not line:
        raise RuntimeError(out.stdout + out.stderr)
    return json.loads(line[0][7:])


def local_bench(devices: int = 8, rows: int = 4096, width: int = 16, rounds: int = 8) -> dict[str, float]:
    """Median ms of ``sx.comm.alltoallv`` (balanced and all-to-one counts, ``rows`` float32 rows of ``width`` per
    device) and ``sx.comm.exchange`` (``rows`` particles with float32 positions and int32 ids to random ranks), in
    this process on ``devices`` CPU devices (set before JAX starts). Small sizes: the rounds' fixed costs show."""
    import jax

    jax.config.update("jax_num_cpu_devices", devices)
    import jax.numpy as jnp
    from jax.sharding import PartitionSpec as P

    import shardax as sx

    mesh = sx.flat_mesh()
    size = devices
    rng = np.random.default_rng(0)
    balanced = rng.multinomial(rows, [1 / size] * size, size=size).astype(np.int32)
    skewed = np.zeros((size, size), np.int32)
    skewed[:, 0] = rows // size
    x = jnp.asarray(rng.standard_normal((size, rows, width)).astype(np.float32))
    pos = jnp.asarray(rng.random((size, rows, 3)).astype(np.float32))
    ids = jnp.asarray(np.arange(size * rows, dtype=np.int32).reshape(size, rows))
    dest = jnp.asarray(rng.integers(0, size, (size, rows)).astype(np.int32))
    cases = {}
    for name, counts in (("balanced", balanced), ("all to rank 0", skewed)):
        cap = int(counts.sum(0).max())
        f = sx.smap(lambda x, c, cap=cap: sx.comm.alltoallv(x, c, capacity=cap)[0], in_specs=(P(sx.ALL), P(sx.ALL)),
                    out_specs=P(sx.ALL), mesh=mesh, jit=True)
        c = jnp.asarray(counts)
        cases[f"alltoallv {name}"] = lambda f=f, c=c: f(x, c).block_until_ready()
    g = sx.smap(lambda p, i, d: sx.comm.exchange({"pos": p, "ids": i}, d, num=rows, capacity=2 * rows)[0],
                in_specs=(P(sx.ALL),) * 3, out_specs=P(sx.ALL), mesh=mesh, jit=True)
    cases["exchange"] = lambda: jax.block_until_ready(g(pos, ids, dest))
    return _interleaved_ms(cases, rounds=rounds)


def kernels_worker(n: int) -> None:
    """zsort and FoF (b = 0.2) of ``n`` uniform points at 2 processes x 4 devices through each transport, and on one
    device of process 0 (the other process waits), timed in turns; the FoF labels must agree bit for bit."""
    import jax

    import shardax as sx
    from shardax import _transport

    w = sx.initialize(cpu_devices=4)
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    pos = np.random.default_rng(0).random((n, 3), dtype=np.float32)
    ll = 0.2 / n ** (1 / 3)
    mesh = sx.flat_mesh()
    part = sx.particles.from_numpy(pos[np.array_split(np.arange(n), w.num_processes)[w.process_id]], mesh=mesh)
    cases, labels = {}, {}
    chosen = _transport.cpu_collectives()
    for transport in ("mpi", "gloo"):
        # Fresh global functions (``.smap(mesh)`` would hand back the first transport's program): the transport is
        # read when a program is traced.
        _transport.set_transport(transport, "benchmark")
        z = sx.smap(lambda p: sx.particles.zsort(p, box=1.0), in_specs=(sx.ALL,), out_specs=sx.ALL, mesh=mesh,
                    jit=True)
        f = sx.smap(lambda p: sx.spatial.fof(p, ll, box=1.0).labels, in_specs=(sx.ALL,), out_specs=sx.ALL,
                    mesh=mesh, jit=True)
        labels[transport] = np.concatenate([np.asarray(s.data).ravel() for s in sorted(
            f(part).addressable_shards, key=lambda s: s.index[0].start or 0)])
        cases[f"zsort 2x4 ({transport})"] = lambda z=z: jax.block_until_ready(z(part))
        cases[f"fof 2x4 ({transport})"] = lambda f=f: jax.block_until_ready(f(part))
    _transport.set_transport(chosen, "benchmark")
    same = bool(np.array_equal(labels["mpi"], labels["gloo"]))
    if w.process_id == 0:  # the local views under jax.jit on this process's first device (no collective)
        import math

        import jax.numpy as jnp

        part1 = sx.particles.pad(sx.particles.Particles(pos=jnp.asarray(pos), num=jnp.int32(n),
                                                         ids=jnp.arange(n, dtype=jnp.int32)), math.ceil(1.25 * n) - n)
        z1 = jax.jit(lambda p: sx.particles.zsort(p, box=1.0))
        f1 = jax.jit(lambda p: sx.spatial.fof(p, ll, box=1.0).labels)
        cases["zsort 1 device"] = lambda: jax.block_until_ready(z1(part1))
        cases["fof 1 device"] = lambda: jax.block_until_ready(f1(part1))
    else:  # process 1 waits while process 0 times its one-device calls
        cases["zsort 1 device"] = cases["fof 1 device"] = lambda: None

    def fenced(fn):  # type: ignore[no-untyped-def]
        def call() -> None:
            comm.Barrier()
            fn()
        return call

    results = _interleaved_ms({k: fenced(v) for k, v in cases.items()}, rounds=3, repeats=3, warmup=1)
    if w.process_id == 0:
        print("RESULT " + json.dumps({"n": n, "labels_same": same, "ms": results}), flush=True)


MPICH_PREFIX: str | None = None  # --mpich: launch with that MPICH's mpiexec instead of Open MPI's mpirun


def _mpirun_worker(*worker_args: str) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SHARDAX_")}
    env["JAX_PLATFORMS"] = "cpu"
    if MPICH_PREFIX:
        # Hydra passes the whole environment; mpi4py loads this MPICH, the native call builds with its mpicc.
        env |= {"MPI4PY_LIBMPI": os.path.join(MPICH_PREFIX, "lib", "libmpi.so.12"),
                "MPICC": os.path.join(MPICH_PREFIX, "bin", "mpicc")}
        cmd = [os.path.join(MPICH_PREFIX, "bin", "mpiexec"), "-n", "2", sys.executable, __file__, *worker_args]
    else:
        mpirun = shutil.which("mpirun")
        if mpirun is None:
            raise RuntimeError("mpirun not found: apt-get install openmpi-bin")
        cmd = [mpirun, "--allow-run-as-root", "--oversubscribe", "-n", "2", "-x", "JAX_PLATFORMS", sys.executable,
               __file__, *worker_args]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=1800, env=env)
    line = [ln for ln in out.stdout.splitlines() if ln.startswith("RESULT ")]
    if out.returncode or not line:
        raise RuntimeError(f"worker {worker_args} failed ({out.returncode}):\n{out.stdout}\n{out.stderr}")
    return json.loads(line[0][7:])


def run_allreduce(cpu_devices: int) -> dict:
    return _mpirun_worker("--worker", str(cpu_devices))


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "Collective benchmarks").splitlines()[0])
    parser.add_argument("--worker", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--json", help="write the results to this file")
    parser.add_argument("--local", action="store_true",
                        help="only alltoallv and exchange in this process on 8 CPU devices, at small sizes")
    parser.add_argument("--rows", type=int, default=4096, help="rows per device of --local (default 4096)")
    parser.add_argument("--kernels", type=int, default=0, metavar="N",
                        help="also time zsort and FoF of N points at 2 processes x 4 devices through each transport "
                             "(and on one device)")
    parser.add_argument("--kernels-worker", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--mpich", metavar="PREFIX", help="launch with PREFIX/bin/mpiexec (MPICH's Hydra; e.g. the "
                        "`mpich` wheel's venv) instead of Open MPI's mpirun; mpi4jax is skipped there")
    args = parser.parse_args()
    global MPICH_PREFIX
    MPICH_PREFIX = args.mpich
    if args.worker is not None:
        allreduce_worker(args.worker)
        return
    if args.kernels_worker is not None:
        kernels_worker(args.kernels_worker)
        return
    if args.local:
        ms = local_bench(rows=args.rows)
        print(f"8 CPU devices, {args.rows} rows per device (median ms)")
        for name, t in ms.items():
            print(f"  {name:<28s} {t:8.3f}")
        if args.json:
            with open(args.json, "w") as f:
                json.dump(ms, f, indent=2)
        return
    report: dict = {"allreduce": [], "alltoallv": None}
    for m in (1, 4):
        res = run_allreduce(m)
        report["allreduce"].append(res)
        ms = res["ms"]
        ref = ms.get("mpi4jax allreduce (jit)")
        ref_v = ms.get("mpi4py Alltoallv 2 MiB/device")
        print(f"\n2 processes, {m} CPU device(s) per process, transport chosen: {res['transport']} (median ms); "
              f"allreduce of {N_FLOATS:.0e} float32 per device")
        same = ms.get(SAME_BYTES)
        for name, t in ms.items():
            base, label = (ref_v, "mpi4py Alltoallv") if "lltoallv" in name else (ref, "mpi4jax")
            ratio = f"  {t / base:5.2f}x {label}" if base else ""
            if same and name.startswith("sx.comm.allreduce"):
                ratio += f", {t / same:5.2f}x mpi4jax with the same bytes per process"
            print(f"  {name:<46s} {t:8.2f}{ratio}")
    if args.kernels:
        res = _mpirun_worker("--kernels-worker", str(args.kernels))
        report["kernels"] = res
        ms = res["ms"]
        print(f"\nzsort and FoF (b=0.2) of {args.kernels} uniform points, 2 processes x 4 CPU devices (median ms; "
              f"FoF labels identical through both transports: {res['labels_same']})")
        for kernel in ("zsort", "fof"):
            one = ms[f"{kernel} 1 device"]
            for transport in ("mpi", "gloo"):
                t = ms[f"{kernel} 2x4 ({transport})"]
                print(f"  {kernel + ' 2x4 (' + transport + ')':<42s} {t:8.1f}  {t / one:5.2f}x one device "
                      f"({one:.1f} ms)")
    a2a = alltoallv_bench()
    report["alltoallv"] = a2a
    print("\nalltoallv vs tiled all_to_all, 8 devices, 32768 rows x 16 float32 per device (median ms)")
    print(f"  alltoallv {a2a['alltoallv_ms']:.2f}  all_to_all {a2a['all_to_all_ms']:.2f}  ratio {a2a['ratio']:.2f}x; "
          f"temporaries {a2a['alltoallv_temp_bytes'] / a2a['data_bytes_per_device']:.2f}x vs "
          f"{a2a['all_to_all_temp_bytes'] / a2a['data_bytes_per_device']:.2f}x the data per device")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    from shardax.runtime import restart_with_malloc_env

    # glibc's allocator as in the processes shardax launches (SHARDAX_MALLOC=system: its defaults)
    restart_with_malloc_env(sys.argv)
    main()
