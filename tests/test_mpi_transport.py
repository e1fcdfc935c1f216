"""The MPI transport of ``sx.comm``: every collective gives the gloo transport's results under ``mpirun``.

One ``mpirun -n 2`` launch per configuration (1 and 4 CPU devices per process under Open MPI 4, 4 under Open MPI
5, 4 under MPICH's ``mpiexec``, whose ranks find each other through MPI) runs every check twice in the same processes, through MPI and through gloo (the transport is read at trace time, so fresh functions switch it), and
compares both with NumPy references built from every rank's inputs. Two more launches check that a run whose
processes diverge still ends with a clear error: a different program (the program guard) and a rank that stops
taking part (the watchdog). Skipped, with the reason, when ``mpirun`` or ``mpi4py`` is absent. The selection rules
and the static plans are checked in one process.

This file is also the worker: ``python tests/test_mpi_transport.py {checks|diverge|stall}`` under ``mpirun``.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

MPIRUN = shutil.which("mpirun")
# Open MPI 5 from its PyPI wheel in a virtual environment of its own (.ci/cluster-setup.sh makes it).
MPIRUN5 = os.environ.get("SHARDAX_OMPI5_MPIRUN", "/opt/shardax-ompi5/bin/mpirun")
# MPICH from its PyPI wheel, likewise: Hydra's mpiexec, libmpi.so.12 (mpi4py is pointed at it) and its mpicc.
MPICH = Path(os.environ.get("SHARDAX_MPICH_PREFIX", "/opt/shardax-mpich"))
HAVE_MPI4PY = importlib.util.find_spec("mpi4py") is not None
CAN_BUILD = shutil.which("mpicc") is not None and shutil.which("gcc") is not None  # the native call builds here
needs_mpi = pytest.mark.skipif(MPIRUN is None or not HAVE_MPI4PY,
                               reason="needs Open MPI's mpirun and mpi4py (apt-get install openmpi-bin; "
                                      "pip install \"shardax[mpi]\")")


# ---------------------------------------------------------------------------------------------- in one process


def test_choose_rules() -> None:
    from shardax._transport import choose

    ompi = {"OMPI_COMM_WORLD_SIZE": "2", "JAX_PLATFORMS": "cpu"}
    assert choose(1, ompi)[0] == "gloo"
    assert choose(2, {})[0] == "gloo"
    assert choose(2, {"SHARDAX_CPU_COLLECTIVES": "gloo", **ompi})[0] == "gloo"
    if HAVE_MPI4PY:
        assert choose(2, ompi)[0] == "mpi"
        assert choose(2, {"PMIX_RANK": "0"})[0] == "mpi"
        assert choose(2, {"SHARDAX_CPU_COLLECTIVES": "mpi"})[0] == "mpi"
    with pytest.raises(ValueError, match="SHARDAX_CPU_COLLECTIVES must be 'gloo' or 'mpi'"):
        choose(2, {"SHARDAX_CPU_COLLECTIVES": "nccl"})


def test_forced_mpi_without_mpi4py_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    import shardax as sx
    from shardax import _transport

    monkeypatch.setattr(_transport, "_mpi4py_available", lambda: False)
    with pytest.raises(sx.DistributedSetupError, match=r"pip install \"shardax\[mpi\]\""):
        _transport.choose(2, {"SHARDAX_CPU_COLLECTIVES": "mpi"})
    assert _transport.choose(2, {"OMPI_COMM_WORLD_SIZE": "2"})[0] == "gloo"


def test_one_process_keeps_xla_collectives() -> None:
    import jax.numpy as jnp
    from jax.sharding import PartitionSpec as P

    import shardax as sx
    from shardax import _mpi_prim

    assert sx.runtime.cpu_collectives() == "gloo"
    seen = []

    def f() -> Any:
        seen.append(_mpi_prim.mpi_active(sx.rank_info().axis_names))
        return sx.comm.allreduce(jnp.ones(3))

    out = sx.smap(f, in_specs=(), out_specs=P())()
    assert seen == [False] and out.tolist() == [float(sx.world().device_count)] * 3


def test_plan_groups_and_ranks() -> None:
    from shardax._mpi_host import Plan

    process = np.repeat(np.arange(2), 4)                       # a (hosts=2, d=4) mesh, rows by process
    across = Plan.build((2, 4), ("hosts", "d"), ("hosts",), process, me=1)
    assert across.size == 2 and across.local == (4, 5, 6, 7)
    assert across.members.tolist() == [[0, 4], [1, 5], [2, 6], [3, 7]]
    inside = Plan.build((2, 4), ("hosts", "d"), ("d",), process, me=0)
    assert inside.members.tolist() == [[0, 1, 2, 3], [4, 5, 6, 7]] and inside.rank.tolist() == [0, 1, 2, 3] * 2
    both = Plan.build((2, 4), ("hosts", "d"), ("hosts", "d"), process, me=0)
    assert both.members.tolist() == [list(range(8))]


# ---------------------------------------------------------------------------------------------- under mpirun


def _mpirun(mode: str, devices: int, extra_env: dict[str, str] | None = None, timeout: float = 300,
            mpirun: str | None = MPIRUN) -> tuple[int, str]:
    assert mpirun is not None
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SHARDAX_", "OMPI_", "PMIX_", "SLURM_"))}
    env |= {"JAX_PLATFORMS": "cpu", "PYTHONUNBUFFERED": "1", "SHARDAX_CPU_DEVICES": str(devices)}
    env |= extra_env or {}
    names = ["JAX_PLATFORMS", "PYTHONUNBUFFERED", "SHARDAX_CPU_DEVICES", *(extra_env or {})]
    argv = [mpirun, "--allow-run-as-root", "--oversubscribe", "-n", "2"]
    if mpirun == MPIRUN:
        argv[3:3] = ["--mca", "oob_tcp_if_include", "lo"]  # keep Open MPI 4's ORTE on loopback
    if mpirun.startswith(str(MPICH)):
        # Hydra passes the whole environment; mpi4py loads MPICH's library, the native call builds with its mpicc.
        argv = [mpirun, "-n", "2"]
        env |= {"MPI4PY_LIBMPI": str(MPICH / "lib" / "libmpi.so.12"), "MPICC": str(MPICH / "bin" / "mpicc")}
        names = []
    for name in names:
        argv += ["-x", name]
    argv += [sys.executable, os.path.abspath(__file__), mode]
    proc = subprocess.Popen(argv, env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate(timeout=10)
        return -1, out
    return proc.returncode, out


def _reports(out: str) -> list[dict]:
    """Every ``REPORT {json}`` the ranks printed. mpirun forwards both ranks' output into one stream, where one
    rank's line can land in the middle of the other's: each report is read as the one JSON object after its marker."""
    decoder = json.JSONDecoder()
    reports = []
    start = out.find("REPORT ")
    while start >= 0:
        report, _ = decoder.raw_decode(out, start + len("REPORT "))
        reports.append(report)
        start = out.find("REPORT ", start + 1)
    return reports


@pytest.mark.multiprocess
@pytest.mark.mpi
@needs_mpi
@pytest.mark.parametrize(("devices", "native"), [(1, "auto"), (1, "0"), (4, "auto")],
                         ids=["1-native", "1-host", "4"])
def test_every_collective_same_through_mpi_and_gloo(devices: int, native: str) -> None:
    """With one device per process every collective over the whole run is lowered to the native MPI call (built
    with mpicc here), with 4 devices per process the allreduces, all_to_alls and alltoallvs over every device, and with
    ``SHARDAX_MPI_NATIVE=0`` none (host calls)."""
    code, out = _mpirun("checks", devices, {"SHARDAX_MPI_NATIVE": native})
    assert code == 0, f"mpirun exited with {code}:\n{out[-6000:]}"
    reports = _reports(out)
    assert sorted(r["process"] for r in reports) == [0, 1], out[-6000:]
    for r in reports:
        assert r["transport"] == "mpi", r
        assert r["failures"] == [], r
        assert r["checked"] >= 20, r
        if native == "auto" and CAN_BUILD:
            assert "native FFI call" in r["how"], r
            kinds = {"allreduce", "allgather", "alltoall", "permute", "ragged"} if devices == 1 else \
                {"allreduce", "alltoall", "ragged"}
            assert set(r["native"]) == kinds, r
        else:
            assert r["native"] == {}, r


_BUILD_PROBE = """
import json, os
from shardax import _mpi_native
try:
    print(json.dumps({"how": _mpi_native.reason(), "files": sorted(os.listdir(_mpi_native.cache_dir()))
                      if _mpi_native.cache_dir().exists() else []}))
except RuntimeError as err:
    print(json.dumps({"error": str(err)}))
"""


@pytest.mark.mpi
@needs_mpi
def test_native_call_builds_in_a_fresh_cache_or_says_why_not(tmp_path: Path) -> None:
    """The handler is compiled into an empty cache directory on first use; a compiler that fails leaves host calls
    with the reason, or, with SHARDAX_MPI_NATIVE=1, an error naming the setting."""
    def probe(**env: str) -> dict:
        run_env = {k: v for k, v in os.environ.items() if not k.startswith(("SHARDAX_", "MPICC"))}
        run_env |= {"XDG_CACHE_HOME": str(tmp_path / env.pop("cache", "ok")), "JAX_PLATFORMS": "cpu", **env}
        done = subprocess.run([sys.executable, "-c", _BUILD_PROBE], env=run_env, capture_output=True, text=True,
                              timeout=120, check=True)
        return json.loads(done.stdout.strip().splitlines()[-1])

    if CAN_BUILD:
        built = probe()
        assert built["how"].startswith("native FFI call"), built
        assert len(built["files"]) == 1 and built["files"][0].endswith(".so"), built
    broken = probe(MPICC="false", cache="broken")
    assert broken["how"].startswith("host calls (the native call did not build"), broken
    assert broken["files"] == [], broken
    assert "SHARDAX_MPI_NATIVE=1" in probe(MPICC="false", cache="strict", SHARDAX_MPI_NATIVE="1")["error"]
    assert probe(SHARDAX_MPI_NATIVE="0", cache="off")["how"] == "host calls (SHARDAX_MPI_NATIVE=0)"


@pytest.mark.multiprocess
@pytest.mark.mpi
@pytest.mark.skipif(not HAVE_MPI4PY or not os.access(MPIRUN5, os.X_OK),
                    reason=f"needs mpi4py and Open MPI 5's mpirun at {MPIRUN5} (bash .ci/cluster-setup.sh, or set "
                           "SHARDAX_OMPI5_MPIRUN)")
def test_every_collective_same_through_mpi_and_gloo_open_mpi_5() -> None:
    code, out = _mpirun("checks", 4, mpirun=MPIRUN5)
    assert code == 0, f"mpirun exited with {code}:\n{out[-6000:]}"
    reports = _reports(out)
    assert sorted(r["process"] for r in reports) == [0, 1], out[-6000:]
    assert all(r["transport"] == "mpi" and r["failures"] == [] for r in reports), reports


@pytest.mark.multiprocess
@pytest.mark.mpi
@pytest.mark.skipif(not HAVE_MPI4PY or not os.access(MPICH / "bin" / "mpiexec", os.X_OK),
                    reason=f"needs mpi4py and MPICH's mpiexec in {MPICH} (bash .ci/cluster-setup.sh, or set "
                           "SHARDAX_MPICH_PREFIX)")
def test_every_collective_same_through_mpi_and_gloo_mpich() -> None:
    """MPICH's Hydra names no job and no host of rank 0: ``sx.initialize`` finds the run from ``PMI_RANK`` and
    ``PMI_SIZE`` and the ranks agree on the coordinator through MPI; the native call is built with MPICH's mpicc
    (another MPI ABI: integer handles, not pointers) and carries the collectives over every device."""
    code, out = _mpirun("checks", 4, mpirun=str(MPICH / "bin" / "mpiexec"))
    assert code == 0, f"mpiexec exited with {code}:\n{out[-6000:]}"
    reports = _reports(out)
    assert sorted(r["process"] for r in reports) == [0, 1], out[-6000:]
    for r in reports:
        assert r["transport"] == "mpi" and r["failures"] == [] and r["checked"] >= 20, r
        assert r["source"] == "hydra" and r["library"].startswith("MPICH"), r
        assert "native FFI call" in r["how"] and set(r["native"]) == {"allreduce", "alltoall", "ragged"}, r


@pytest.mark.multiprocess
@pytest.mark.mpi
@needs_mpi
def test_diverged_program_ends_the_run_with_a_clear_error() -> None:
    code, out = _mpirun("diverge", 2, {"SHARDAX_GUARD_TIMEOUT": "60"})
    assert code != 0, out[-4000:]
    assert "ProgramMismatchError" in out, out[-4000:]


@pytest.mark.multiprocess
@pytest.mark.mpi
@needs_mpi
def test_stalled_rank_ends_the_run_through_the_watchdog() -> None:
    code, out = _mpirun("stall", 2, {"SHARDAX_WATCHDOG_S": "8", "SHARDAX_GUARD": "off"}, timeout=240)
    assert code != 0, out[-4000:]
    assert "watchdog" in out.lower(), out[-4000:]


# ---------------------------------------------------------------------------------------------- the worker


def _checks(sx: Any) -> dict[str, list[np.ndarray]]:
    """Every collective on the flat mesh and on the (hosts, d) mesh; the values of this process's devices."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import PartitionSpec as P

    flat, grid = sx.flat_mesh(), sx.grid_mesh()
    out: dict[str, list[np.ndarray]] = {}

    def run(name: str, f: Any, mesh: Any = flat, args: tuple[Any, ...] = (), in_specs: Any = ()) -> None:
        result = sx.smap(f, in_specs=in_specs, out_specs=P(sx.ALL), mesh=mesh, jit=True)(*args)
        for k, leaf in enumerate(jax.tree.leaves(result)):
            out[f"{name}/{k}"] = [np.asarray(s.data) for s in sorted(leaf.addressable_shards,
                                                                    key=lambda s: s.index[0].start or 0)]

    def values(r: Any) -> Any:
        return (jnp.arange(6, dtype=jnp.float32) + 1) * (r + 1)

    run("allreduce", lambda: (*(sx.comm.allreduce(values(sx.rank_info().rank), op) for op in ("sum", "max", "min")),
                              sx.comm.allreduce(1 + sx.rank_info().rank % 2, "prod")))
    run("allreduce_int", lambda: sx.comm.allreduce(jnp.arange(5, dtype=jnp.int32) * sx.rank_info().rank))
    run("allgather", lambda: (sx.comm.allgather(sx.rank_info().rank),
                              sx.comm.allgather(values(sx.rank_info().rank)[:2], tiled=True)))
    run("alltoall", lambda: sx.comm.alltoall(sx.rank_info().rank * 100 + jnp.arange(sx.rank_info().size)))
    run("bcast", lambda: sx.comm.bcast(values(sx.rank_info().rank), root=sx.rank_info().size - 1))
    run("reduce", lambda: sx.comm.reduce(values(sx.rank_info().rank), "max", root=1 % sx.rank_info().size))
    run("gather", lambda: sx.comm.gather(sx.rank_info().rank * 3, root=0))
    run("scatter", lambda: sx.comm.scatter(jnp.arange(2 * sx.rank_info().size).reshape(-1, 2)
                                           + 100 * sx.rank_info().rank, root=0))
    run("scan", lambda: (sx.comm.scan(sx.rank_info().rank + 1), sx.comm.scan(sx.rank_info().rank + 1,
                                                                              inclusive=False)))
    run("shift", lambda: (sx.comm.shift(values(sx.rank_info().rank)),
                          sx.comm.shift(sx.rank_info().rank, -2, periodic=False),
                          sx.comm.sendrecv(sx.rank_info().rank + 10, [(0, sx.rank_info().size - 1)])))
    run("barrier", lambda: sx.comm.barrier())

    def batched() -> Any:
        rank, size, _ = sx.rank_info()
        rows = jnp.stack([values(rank), values(rank) * 2])                        # a batch of two
        table = (rank * 100 + jnp.arange(2 * size).reshape(2, size)).astype(jnp.int32)
        return (jax.vmap(sx.comm.allreduce)(rows), jax.vmap(sx.comm.allgather)(rows[:, :2]),
                jax.vmap(sx.comm.alltoall)(table), jax.vmap(sx.comm.shift)(rows))

    run("vmap", batched)

    def ragged(capacity: int) -> Any:
        def f() -> Any:
            rank, size, _ = sx.rank_info()
            counts = (rank + jnp.arange(size, dtype=jnp.int32)) % 3
            ends = jnp.cumsum(counts)
            row = jnp.arange(3 * size, dtype=jnp.int32)
            dest = jnp.searchsorted(ends, row, side="right")
            x = jnp.stack([rank * 1000 + dest * 10 + row, row], axis=1).astype(jnp.float32)
            return sx.comm.alltoallv(x, counts, capacity=capacity)
        return f

    size = sx.world().device_count
    run("alltoallv", ragged(3 * size))
    run("alltoallv_overflow", ragged(2))

    def exchange() -> Any:
        rank, size, _ = sx.rank_info()
        n = 6
        dest = (jnp.arange(n, dtype=jnp.int32) * 7 + rank * 3) % size
        tree = {"pos": jnp.stack([jnp.arange(n, dtype=jnp.float32) + 10 * rank] * 3, axis=1),
                "ids": jnp.arange(n, dtype=jnp.int32) + 100 * rank, "flag": jnp.arange(n) % 2 == 0}
        return sx.comm.exchange(tree, dest, num=n - 1, capacity=n * 2)

    run("exchange", exchange)

    def rounds() -> Any:  # the chunked path (several all_to_all rounds in a loop), taken when init is given
        from shardax._alltoallv import alltoallv_many

        rank, size, axes = sx.rank_info()
        counts = (rank + jnp.arange(size, dtype=jnp.int32)) % 3
        x = jnp.arange(3 * size, dtype=jnp.float32) + 100 * rank
        init = [jnp.full((3 * size,), -1.0, jnp.float32)]
        return alltoallv_many([x], counts, 3 * size, axes, "chunked", 1, init=init)

    run("alltoallv_rounds", rounds)

    def zsorted() -> Any:
        part, overflow = sx.particles.zsort(sx.particles.uniform(256, seed=3))
        return part.pos, part.num, overflow

    run("zsort", zsorted)
    run("grid_hosts", lambda: (sx.comm.allreduce(values(sx.rank_info().rank), axis="hosts"),
                               sx.comm.alltoall(jnp.arange(2) + 10 * sx.rank_info("hosts").rank, axis="hosts"),
                               sx.comm.shift(sx.rank_info("hosts").rank, axis="hosts")), mesh=grid)
    run("grid_d", lambda: (sx.comm.allreduce(values(sx.rank_info().rank), axis="d"),
                           sx.comm.allgather(sx.rank_info().rank, axis="d")), mesh=grid)

    def grad(x: Any) -> Any:
        return jax.grad(lambda y: jnp.sum(sx.comm.allreduce(y) ** 2) + jnp.sum(sx.comm.shift(y) * y))(x)

    x = jax.make_array_from_process_local_data(
        jax.sharding.NamedSharding(flat, P(flat.axis_names)),
        np.arange(sx.world().local_device_count * 4, dtype=np.float32).reshape(-1, 4)
        + 8 * jax.process_index())
    run("grad", grad, args=(x,), in_specs=(P(sx.ALL),))
    return out


def _references(out: dict[str, list[np.ndarray]], size: int, local: list[int]) -> list[str]:
    """Compare a few results with NumPy references built from every rank's inputs; return what differs."""
    vals = np.stack([(np.arange(6, dtype=np.float32) + 1) * (r + 1) for r in range(size)])
    failures = []

    def expect(key: str, want_of_rank: Any) -> None:
        for j, r in enumerate(local):
            got = out[key][j].reshape(np.shape(want_of_rank(r)))
            if not np.array_equal(got, want_of_rank(r)):
                failures.append(f"{key} rank {r}: {got.ravel()[:8]} != {np.ravel(want_of_rank(r))[:8]}")

    expect("allreduce/0", lambda r: vals.sum(0))
    expect("allreduce/1", lambda r: vals.max(0))
    expect("allreduce/3", lambda r: np.prod(1 + np.arange(size) % 2))
    expect("allgather/0", lambda r: np.arange(size))
    expect("alltoall/0", lambda r: np.arange(size) * 100 + r)
    expect("bcast/0", lambda r: vals[size - 1])
    expect("scatter/0", lambda r: np.arange(2 * size).reshape(-1, 2)[r])
    expect("scan/1", lambda r: np.arange(1, size + 1)[:r].sum())
    expect("shift/0", lambda r: vals[(r - 1) % size])
    counts = np.array([[(s + d) % 3 for d in range(size)] for s in range(size)])
    expect("alltoallv/1", lambda r: counts[:, r])
    return failures


def _worker(mode: str) -> None:
    import shardax as sx

    sx.initialize(cpu_devices=int(os.environ["SHARDAX_CPU_DEVICES"]))
    import jax

    from shardax import _transport

    transport = _transport.cpu_collectives()
    if mode == "diverge":
        import jax.numpy as jnp
        from jax.sharding import PartitionSpec as P

        scale = 1.0 + jax.process_index()          # a captured value differs: a different program
        sx.smap(lambda: sx.comm.allreduce(jnp.ones(3) * scale), in_specs=(), out_specs=P(), jit=True)()
        return
    if mode == "stall":
        import time

        import jax.numpy as jnp
        from jax.sharding import PartitionSpec as P

        f = sx.smap(lambda: sx.comm.allreduce(jnp.ones(3)), in_specs=(), out_specs=P(), jit=True)
        f().block_until_ready()
        if jax.process_index() == 1:
            time.sleep(600)                         # rank 1 stops taking part
        f().block_until_ready()
        return
    from shardax import _mpi_prim

    traced: list[bool] = []                          # each trace-time decision: MPI or XLA
    decide = _mpi_prim.mpi_active

    def counting(axes: tuple[str, ...]) -> bool:
        traced.append(decide(axes))
        return traced[-1]

    _mpi_prim.mpi_active = counting  # type: ignore[assignment]
    through_mpi = _checks(sx)
    mpi_traced = list(traced)
    _transport.set_transport("gloo", "test: the same checks through gloo")
    through_gloo = _checks(sx)
    gloo_traced = traced[len(mpi_traced):]
    failures = []
    for key, got in through_mpi.items():
        want = through_gloo[key]
        same = len(got) == len(want) and all(a.dtype == b.dtype and np.array_equal(a, b)
                                             for a, b in zip(got, want, strict=True))
        if not same:
            failures.append(f"{key}: mpi {[a.ravel()[:6] for a in got]} != gloo {[b.ravel()[:6] for b in want]}")
    w = sx.world()
    local = [jax.process_index() * w.local_device_count + j for j in range(w.local_device_count)]
    failures += _references(through_mpi, w.device_count, local)
    if not (mpi_traced and all(mpi_traced)) or not gloo_traced or any(gloo_traced):
        failures.append(f"the transports were not both traced: mpi {mpi_traced}, gloo {gloo_traced}")
    from mpi4py import MPI

    from shardax import _mpi_native
    from shardax.runtime import _initialize

    report = {"process": jax.process_index(), "transport": transport, "checked": len(through_mpi),
              "failures": failures, "native": dict(_mpi_prim.native_lowerings), "how": _mpi_native.reason(),
              "source": getattr(_initialize._started, "source", None), "library": MPI.Get_library_version().strip()}
    print("REPORT " + json.dumps(report), flush=True)


if __name__ == "__main__":
    _worker(sys.argv[1])
