"""jaxmg's multi-host recipe, run to the end on any backend: 2 processes x 4 CPU devices, a diagonal matrix
sharded by columns over every device, replicated across hosts with ``sx.host_replicate``, then ``potrs`` on the 2D
mesh with jaxmg's positional call. jaxmg needs cuSOLVERMg on one node; ``sx.linalg.potrs`` runs the distributed
Cholesky in JAX collectives, so it also works across processes, on CPU and on GPU.

    shardax launch -n 2 --cpu-devices 4 examples/jaxmg_potrs_two_hosts.py
"""

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import shardax as sx

w = sx.initialize()  # replaces jax.distributed.initialize("localhost:6000", num_procs, proc_id)
print(f"Rank {w.process_id}, local devices {w.local_device_count}, global devices {w.device_count}")
print(f"Device grid {sx.device_grid().tolist()}")

mesh2d = sx.grid_mesh(("x", "y"))
ndev = w.device_count
A = jax.device_put(jnp.diag(jnp.arange(1, ndev + 1, dtype=jnp.float32)), NamedSharding(mesh2d, P(None, ("x", "y"))))

# Gather over the hosts: every process holds all columns, split over its own devices (jaxmg's P(None, "y")).
A = sx.host_replicate(A, mesh2d, axis="x")
for shard in A.addressable_shards:
    print(f"host-replicated shard on {shard.device}: shape {shard.data.shape}")

b = jax.device_put(jnp.ones((ndev, 1), dtype=jnp.float32), NamedSharding(mesh2d, P()))
out = sx.linalg.potrs(A, b, 256, mesh2d, (P(None, "T"), P(None, None)))  # jaxmg: potrs(A, b, T_A, mesh, in_specs)
x = np.asarray(out.addressable_data(0))[:, 0]
expected = 1.0 / np.arange(1, ndev + 1)
print(f"x = {[round(float(v), 4) for v in x]}")
assert np.allclose(x, expected, rtol=1e-5), (x, expected)

x, logdet, status = sx.linalg.potrs(A, b, T_A=256, mesh=mesh2d, return_logdet=True, return_status=True)
print(f"logdet {float(logdet):.4f} (expected {np.log(np.arange(1, ndev + 1)).sum():.4f}), status {int(status)}")
assert int(status) == 0
