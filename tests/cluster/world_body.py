"""One process under a cluster launcher (srun, mpirun): ``sx.initialize()`` with no arguments, then a collective.

Prints one line ``WORLD {json}`` with the detected source, the world, the launcher variables it saw and the result
of an allreduce over every device (each device contributes its global index + 1), so the caller can check the
detection and the run against what the launcher was asked for.
"""

from __future__ import annotations

import json
import os
import re
import sys

import numpy as np

SEEN = ("SLURM_JOB_ID", "SLURM_PROCID", "SLURM_STEP_NUM_TASKS", "SLURM_STEP_NODELIST", "OMPI_COMM_WORLD_SIZE",
        "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE", "OMPI_MCA_orte_hnp_uri", "PMIX_NAMESPACE",
        "PMIX_RANK", "JAX_NUM_CPU_DEVICES")


def reports(output: str) -> list[dict]:
    """The ``WORLD`` reports in a launcher's output, by process id."""
    # mpirun merges the ranks' streams, so several reports (or other text) can share one line: decode every one.
    decoder = json.JSONDecoder()
    found = [decoder.raw_decode(output, m.end())[0] for m in re.finditer(r"WORLD (?=\{)", output)]
    return sorted(found, key=lambda r: r["process_id"])


def check(found: list[dict], *, processes: int, devices: int, source: str, output: str) -> None:
    """Every process reported, detected ``source``, and the allreduce over every device is right."""
    assert [r["process_id"] for r in found] == list(range(processes)), f"missing reports in:\n{output[-4000:]}"
    total = processes * devices
    for r in found:
        assert r["source"] == source, r
        assert (r["num_processes"], r["local_device_count"], r["device_count"]) == (processes, devices, total), r
        assert r["mode"] == ("mpmd" if devices == 1 else "spmd"), r
        assert r["allreduce"] == total * (total + 1) // 2, r


def main() -> int:
    import jax
    from jax.sharding import NamedSharding, PartitionSpec

    import shardax as sx

    source = sx.runtime.detect_launch().source
    world = sx.initialize()
    mesh = sx.flat_mesh()
    host = np.arange(1, mesh.size + 1, dtype=np.int32).reshape(mesh.size, 1)
    x = jax.make_array_from_callback(host.shape, NamedSharding(mesh, PartitionSpec(mesh.axis_names[0])),
                                     lambda idx: host[idx])
    total = sx.smap(lambda v: sx.comm.allreduce(v), in_specs=sx.ALL, out_specs=sx.ALL, mesh=mesh, jit=True)(x)
    report = {"source": source, "process_id": world.process_id, "num_processes": world.num_processes,
              "local_device_count": world.local_device_count, "device_count": world.device_count,
              "mode": world.mode, "allreduce": int(np.asarray(total.addressable_shards[0].data).ravel()[0]),
              "env": {k: os.environ[k] for k in SEEN if k in os.environ}}
    sys.stdout.write("WORLD " + json.dumps(report) + "\n")  # one write: the newline cannot be separated from it
    sys.stdout.flush()
    # the watchdog's monitor thread can restart the backend while the interpreter exits (reported to the lead)
    sx.runtime.configure_watchdog(0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
