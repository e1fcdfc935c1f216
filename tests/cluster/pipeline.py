"""The pipeline that multi-host runs compare: collectives, zsort, knn, fof, potrs, fftn on a flat mesh of every device.

:func:`run_pipeline` works in any world (one process with 8 devices, 2 processes x 4 on loopback, 2 network
namespaces x 4) and returns host NumPy arrays, identical on every process, that depend only on the data and the total
number of devices: integer results must match exactly across worlds, float results to the dtype's tolerance.

As a script it is one process of a run that its caller placed (``SHARDAX_*`` variables, or srun/mpirun): it calls
``sx.initialize()``, runs the pipeline once (``"cold"``, compiling), then ``--phases`` phases of ``--repeats`` more
runs (``"warm"``; before each phase after the first the caller changes the network, e.g. turns faults on), and
process 0 writes every result and the timings to ``--out`` (``.npz``); with ``--out-others``, every other process
writes its own results there too.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any

import numpy as np

N_PARTICLES = 512
K_NEIGHBOURS = 6
LINKING_LENGTH = 0.06
SOLVE_N = 48
FFT_SHAPE = (16, 8, 8)


def _gather(x: Any) -> np.ndarray:
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.process_allgather(x, tiled=True))


def _put(mesh: Any, host: np.ndarray, spec: Any) -> Any:
    import jax
    from jax.sharding import NamedSharding

    return jax.make_array_from_callback(host.shape, NamedSharding(mesh, spec), lambda idx: host[idx])


class Pipeline:
    """The stages, traced once per mesh (so warm calls only run); ``pipeline()`` returns host arrays by name."""

    def __init__(self, mesh: Any = None) -> None:
        import jax.numpy as jnp

        import shardax as sx

        self.mesh = sx.flat_mesh() if mesh is None else mesh
        self.axis = self.mesh.axis_names[0]
        ndev = self.mesh.size

        def comm_body(v: Any) -> tuple:
            rank = sx.rank_info().rank
            return (sx.comm.allreduce(v), sx.comm.allreduce(v, op="max"), sx.comm.allgather(v), sx.comm.alltoall(v),
                    sx.comm.shift(v), sx.comm.scan(v), sx.comm.bcast(v, root=ndev - 1),
                    sx.comm.allreduce(jnp.float32(rank + 1) * jnp.ones((256,), jnp.float32)))

        # the local view through sx.smap, on plain arrays (the rows stay aligned with the sorted particles)
        def knn_body(pos: Any, num: Any, ids: Any) -> Any:
            return sx.spatial.knn(sx.particles.Particles(pos, num, ids=ids), K_NEIGHBOURS, box=1.0)

        self.comm = sx.smap(comm_body, in_specs=sx.ALL, out_specs=sx.ALL, mesh=self.mesh, jit=True)
        self.zsort = sx.particles.zsort.smap(self.mesh)
        self.knn = sx.smap(knn_body, in_specs=sx.ALL, out_specs=sx.ALL, mesh=self.mesh, jit=True)
        self.fof = sx.spatial.fof.smap(self.mesh)
        self.timings: dict[str, float] = {}

    def collectives(self) -> dict[str, np.ndarray]:
        from jax.sharding import PartitionSpec as P

        ndev = self.mesh.size
        data = (np.arange(ndev * ndev * 3, dtype=np.int32).reshape(ndev, ndev, 3) * 7) % 101
        outs = self.comm(_put(self.mesh, data, P(self.axis)))
        names = ("allreduce", "allmax", "allgather", "alltoall", "shift", "scan", "bcast", "allreduce_f32")
        return {f"comm_{n}": _gather(o) for n, o in zip(names, outs, strict=True)} | {"comm_input": data}

    def particles(self) -> dict[str, np.ndarray]:
        import jax

        import shardax as sx

        everything = np.random.default_rng(2026).random((N_PARTICLES, 3)).astype(np.float32)
        bounds = np.linspace(0, N_PARTICLES, jax.process_count() + 1).astype(int)
        pid = jax.process_index()
        part = sx.particles.from_numpy(everything[bounds[pid]:bounds[pid + 1]], mesh=self.mesh,
                                       capacity_factor=2.0)
        sorted_part, _ = self.zsort(part, box=1.0)
        dense = sx.particles.squeeze(sorted_part)
        out = {"particles_input": everything, "zsort_ids": dense["ids"], "zsort_pos": dense["pos"]}
        num = _gather(sorted_part.num)
        valid = np.arange(sorted_part.pos.shape[1])[None, :] < num[:, None]
        order = np.argsort(_gather(sorted_part.ids)[valid])
        res = self.knn(sorted_part.pos, sorted_part.num, sorted_part.ids)
        out["knn_indices"] = _gather(res.indices)[valid][order]
        out["knn_distances"] = _gather(res.distances)[valid][order]
        labels = self.fof(sorted_part, LINKING_LENGTH, box=1.0, min_members=5).labels
        out["fof_labels"] = _gather(labels)[valid][order]
        return out

    def dense(self) -> dict[str, np.ndarray]:
        from jax.sharding import PartitionSpec as P

        import shardax as sx

        rng = np.random.default_rng(7)
        m = rng.standard_normal((SOLVE_N, SOLVE_N)).astype(np.float32)
        a = m @ m.T / SOLVE_N + np.eye(SOLVE_N, dtype=np.float32)
        b = rng.standard_normal((SOLVE_N, 3)).astype(np.float32)
        x = sx.linalg.potrs(_put(self.mesh, a, P(self.axis, None)), _put(self.mesh, b, P(self.axis, None)), tile=8,
                            mesh=self.mesh)
        field = (rng.standard_normal(FFT_SHAPE) + 1j * rng.standard_normal(FFT_SHAPE)).astype(np.complex64)
        spectrum = sx.fft.fftn(_put(self.mesh, field, P(self.axis)), mesh=self.mesh)
        return {"potrs_a": a, "potrs_b": b, "potrs_x": _gather(x), "fft_input": field, "fftn": _gather(spectrum)}

    def __call__(self) -> dict[str, np.ndarray]:
        out: dict[str, np.ndarray] = {"num_devices": np.asarray(self.mesh.size, np.int32)}
        for stage in (self.collectives, self.particles, self.dense):
            start = time.perf_counter()
            out |= stage()
            self.timings[stage.__name__] = time.perf_counter() - start
        return out


def run_pipeline(mesh: Any = None) -> dict[str, np.ndarray]:
    """Every stage once on ``mesh`` (default: a flat mesh of every device)."""
    return Pipeline(mesh)()


def _wait_for(path: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} did not appear within {timeout_s} s")
        time.sleep(0.05)


def _same(first: dict[str, np.ndarray], again: dict[str, np.ndarray]) -> None:
    for name, value in first.items():
        if np.issubdtype(value.dtype, np.inexact):
            ok = np.allclose(value, again[name], rtol=1e-5, atol=1e-6)
        else:
            ok = np.array_equal(value, again[name])
        if not ok:
            raise AssertionError(f"stage result {name} changed between two calls of the same program")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="one process of the multi-host pipeline run")
    parser.add_argument("--out", required=True, help=".npz written by process 0 (results and timings)")
    parser.add_argument("--out-others", default=None,
                        help="with {process} in it: the .npz where each other process writes its own results")
    parser.add_argument("--repeats", type=int, default=0, help="warm runs per phase after the first (cold) run")
    parser.add_argument("--phases", type=int, default=1, help="phases of warm runs (e.g. clean, then with faults)")
    parser.add_argument("--sync-dir", default=None,
                        help="before phase i > 0, process 0 creates phase{i}.ready here and every process waits "
                             "for phase{i}.go (the caller changes the network in between)")
    args = parser.parse_args(argv)
    if args.phases > 1 and args.sync_dir is None:
        parser.error("--phases > 1 needs --sync-dir")

    import shardax as sx

    world = sx.initialize()
    pipeline = Pipeline()
    start = time.perf_counter()
    result = pipeline()
    cold = time.perf_counter() - start
    warm = np.zeros((args.phases, args.repeats))
    stages = {name: np.zeros((args.phases, args.repeats)) for name in pipeline.timings}
    for phase in range(args.phases):
        if phase > 0:
            assert args.sync_dir is not None
            if world.process_id == 0:
                with open(os.path.join(args.sync_dir, f"phase{phase}.ready"), "w") as f:
                    f.write("ready\n")
            _wait_for(os.path.join(args.sync_dir, f"phase{phase}.go"), 120.0)
        for i in range(args.repeats):
            start = time.perf_counter()
            _same(result, pipeline())
            warm[phase, i] = time.perf_counter() - start
            for name, seconds in pipeline.timings.items():
                stages[name][phase, i] = seconds
    medians = ", ".join(f"{np.median(w):.3f}" for w in warm) if args.repeats else "-"
    print(f"process {world.process_id} of {world.num_processes}: {world.device_count} devices, cold {cold:.2f} s, "
          f"warm median per phase {medians} s", flush=True)
    if world.process_id == 0:
        payload: dict[str, Any] = {f"time_{name}": value for name, value in stages.items()}
        payload |= result | {"cold_s": np.float64(cold), "warm_s": warm,
                             "num_processes": np.int32(world.num_processes), "mode": np.array(world.mode)}
        np.savez(args.out, **payload)
    elif args.out_others is not None:
        np.savez(args.out_others.format(process=world.process_id), **result)
    # the watchdog's monitor thread can restart the backend while the interpreter exits (reported to the lead)
    sx.runtime.configure_watchdog(0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
