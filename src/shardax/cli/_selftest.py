"""The collective self-test of ``shardax doctor``: each collective against the NumPy answer, timed.

Every check builds a global input from a host array that every process computes alike, runs one ``sx.comm``
collective under :func:`shardax.smap` on a flat mesh of all devices, compares each addressable shard with the NumPy
answer exactly (the values are small integers stored as float32, so sums are exact), then times the jitted call.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec


@dataclasses.dataclass(frozen=True)
class CheckResult:
    """One self-test: whether this process's shards matched, bytes moved per device, median seconds per call."""

    name: str
    ok: bool
    nbytes: int
    seconds: float
    error: str = ""


def _global(host: np.ndarray, mesh: Mesh) -> jax.Array:
    """``host`` (the same on every process) as a global array split along its leading axis over every device."""
    sharding = NamedSharding(mesh, PartitionSpec(mesh.axis_names))
    return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])


def _matches(out: jax.Array, expected: np.ndarray) -> bool:
    return all(np.array_equal(np.asarray(s.data), expected[s.index]) for s in out.addressable_shards)


def _median_seconds(fn: Callable[[], object], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _run(name: str, nbytes: int, repeats: int, body: Callable[[], tuple[bool, Callable[[], object]]]) -> CheckResult:
    try:
        ok, call = body()
        seconds = _median_seconds(call, repeats)
    except Exception as err:  # a self-test reports every failure as FAIL instead of stopping the report
        return CheckResult(name, False, nbytes, float("nan"), f"{type(err).__name__}: {err}")
    return CheckResult(name, ok, nbytes, seconds)


def check_allreduce(mesh: Mesh, nbytes: int, repeats: int) -> CheckResult:
    """``allreduce`` (sum) of ``nbytes`` of float32 per device."""
    from .. import comm
    from ..core import ALL, smap

    size, n = mesh.size, max(1, nbytes // 4)

    def body() -> tuple[bool, Callable[[], object]]:
        host = ((np.arange(size)[:, None] + np.arange(n)[None, :]) % 17).astype(np.float32)
        expected = np.broadcast_to(host.sum(axis=0), host.shape)
        fn = smap(comm.allreduce, in_specs=PartitionSpec(ALL), out_specs=PartitionSpec(ALL), mesh=mesh, jit=True)
        x = _global(host, mesh)
        return _matches(fn(x), expected), lambda: fn(x)

    return _run("allreduce", 4 * n, repeats, body)


def check_alltoall(mesh: Mesh, nbytes: int, repeats: int) -> CheckResult:
    """``alltoall`` of a ``(size, m)`` float32 block per device, ``nbytes`` in all."""
    from .. import comm
    from ..core import ALL, smap

    size = mesh.size
    m = max(1, nbytes // (4 * size))

    def body() -> tuple[bool, Callable[[], object]]:
        # host[r, d, j]: what rank r sends to rank d; rank d receives host[:, d] (row s from rank s).
        pair = np.arange(size)[:, None, None] * size + np.arange(size)[None, :, None]
        host = (pair * 8 + np.arange(m)[None, None, :] % 8).astype(np.float32)
        expected = np.ascontiguousarray(host.transpose(1, 0, 2))
        fn = smap(comm.alltoall, in_specs=PartitionSpec(ALL), out_specs=PartitionSpec(ALL), mesh=mesh, jit=True)
        x = _global(host, mesh)
        return _matches(fn(x), expected), lambda: fn(x)

    return _run("alltoall", 4 * size * m, repeats, body)


def alltoallv_problem(size: int, nbytes: int, features: int = 16) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    """Uneven traffic for ``alltoallv``: ``(send (size, L, f), counts (size, size), expected (size, cap, f), cap)``.

    ``counts[r, d]`` rows go from rank r to rank d, between half and one and a half times the mean; every row carries
    its source, destination and position so that a misplaced row cannot match.
    """
    base = max(2, nbytes // (4 * features * size))
    r, d = np.meshgrid(np.arange(size), np.arange(size), indexing="ij")
    counts = (base + ((r + 2 * d) % 3 - 1) * (base // 2)).astype(np.int32)
    length = int(counts.sum(axis=1).max())
    capacity = int(counts.sum(axis=0).max())

    def rows(src: int, dst: int) -> np.ndarray:
        j = np.arange(counts[src, dst])
        out = np.empty((len(j), features), np.float32)
        out[:, 0] = src * size + dst
        out[:, 1] = j
        out[:, 2:] = ((src + dst + j[:, None] + np.arange(features - 2)[None, :]) % 13).astype(np.float32)
        return out

    send = np.zeros((size, length, features), np.float32)
    expected = np.zeros((size, capacity, features), np.float32)
    for src in range(size):
        block = np.concatenate([rows(src, dst) for dst in range(size)])
        send[src, :len(block)] = block
    for dst in range(size):
        block = np.concatenate([rows(src, dst) for src in range(size)])
        expected[dst, :len(block)] = block
    return send, counts, expected, capacity


def check_alltoallv(mesh: Mesh, nbytes: int, repeats: int) -> CheckResult:
    """``alltoallv`` of uneven row counts (``nbytes`` per device on average), packed by source on arrival."""
    from .. import comm
    from ..core import ALL, smap

    size = mesh.size
    send, counts, expected, capacity = alltoallv_problem(size, nbytes)
    sent = int(counts.sum()) * send.shape[2] * 4 // size

    def body() -> tuple[bool, Callable[[], object]]:
        def local(x: jax.Array, c: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
            return comm.alltoallv(x, c, capacity=capacity)

        fn = smap(local, in_specs=PartitionSpec(ALL), out_specs=PartitionSpec(ALL), mesh=mesh, jit=True)
        x, c = _global(send, mesh), _global(counts, mesh)
        data, recv_counts, overflow = fn(x, c)
        ok = (_matches(data, expected) and _matches(recv_counts, np.ascontiguousarray(counts.T))
              and _matches(overflow, np.zeros(size, bool)))
        return ok, lambda: fn(x, c)

    return _run("alltoallv", sent, repeats, body)


def run_self_test(mesh: Mesh, nbytes: int, repeats: int) -> list[CheckResult]:
    """Every check on ``mesh``, results agreed across processes: a check passes only if it passed everywhere and its
    time is the slowest process's."""
    results = [check(mesh, nbytes, repeats) for check in (check_allreduce, check_alltoall, check_alltoallv)]
    if jax.process_count() == 1:
        return results
    from jax.experimental import multihost_utils

    oks = multihost_utils.process_allgather(jnp.asarray([r.ok for r in results]))
    secs = multihost_utils.process_allgather(jnp.asarray([r.seconds for r in results], jnp.float32))
    agreed = []
    for i, r in enumerate(results):
        failed = [p for p in range(oks.shape[0]) if not oks[p, i]]
        error = r.error or (f"wrong result on process(es) {', '.join(map(str, failed))}" if failed else "")
        agreed.append(dataclasses.replace(r, ok=not failed, seconds=float(np.max(secs[:, i])), error=error))
    return agreed
