"""One process of a run whose network fails: allreduce in a loop until the caller takes a link down.

Process 0 creates ``--ready-file`` after the first few calls succeed; the caller then cuts a host off. The run must
end by itself (the watchdog, set to ``--watchdog-s`` once warm) with a report naming the process it lost, and never
print ``loop finished`` (which would read as a complete run). The loop is bounded by ``--max-s``.
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--ready-file", required=True)
    parser.add_argument("--max-s", type=float, default=120.0)
    parser.add_argument("--watchdog-s", type=float, default=8.0, help="watchdog limit once the run is warm")
    args = parser.parse_args(argv)

    import jax
    from jax.sharding import NamedSharding, PartitionSpec

    import shardax as sx

    world = sx.initialize()
    mesh = sx.flat_mesh()
    total = sx.smap(lambda v: sx.comm.allreduce(v), in_specs=sx.ALL, out_specs=sx.ALL, mesh=mesh, jit=True)
    host = np.ones((mesh.size, 1024), np.float32)
    ones = jax.make_array_from_callback(host.shape, NamedSharding(mesh, PartitionSpec(mesh.axis_names[0])),
                                        lambda idx: host[idx])
    end = time.monotonic() + args.max_s
    calls = 0
    while time.monotonic() < end:
        got = np.asarray(total(ones).addressable_shards[0].data)  # blocks: a lost peer hangs here
        if not np.all(got == mesh.size):
            raise AssertionError(f"allreduce gave {got.ravel()[:4]}, expected {mesh.size}")
        calls += 1
        if calls == 3:
            # set only now, so that a peer still compiling its first call does not fire it
            sx.runtime.configure_watchdog(args.watchdog_s)
            if world.process_id == 0:
                with open(args.ready_file, "w") as f:
                    f.write("ready\n")
        time.sleep(0.05)
    print(f"process {world.process_id}: loop finished after {calls} calls", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
