"""jaxmg's multi-process page with shardax: the device grid, and a column-sharded matrix gathered to the
host-replicated layout a per-node solver needs.

    shardax launch -n 2 --cpu-devices 4 examples/jaxmg_host_replicate.py
"""

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import shardax as sx

w = sx.initialize()  # replaces jax.distributed.initialize("localhost:6000", num_procs, proc_id)
print(f"Rank {w.process_id}")
print(f"Local devices {w.local_device_count}")
print(f"Global devices {w.device_count}")
print(f"World size {w.num_processes} ({w.mode})")
print(f"Device grid {sx.device_grid().tolist()}")

mesh = sx.grid_mesh(("x", "y"))
A = jax.device_put(jnp.diag(jnp.arange(1, w.device_count + 1, dtype=jnp.float32)),
                   NamedSharding(mesh, P(None, ("x", "y"))))
for shard in A.addressable_shards:
    print(f"column shard on {shard.device}: nonzero {jnp.nonzero(shard.data)[0].tolist()}")

# Gather over the hosts: every process now holds all columns, split over its own devices.
A = sx.host_replicate(A, mesh, axis="x")
assert A.sharding.spec == P(None, "y")
for shard in A.addressable_shards:
    print(f"host-replicated shard on {shard.device}: shape {shard.data.shape}, "
          f"diagonal entries {sorted(float(v) for v in shard.data[shard.data != 0])}")
