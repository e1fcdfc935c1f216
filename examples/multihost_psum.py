"""JAX's multi-host guide: a psum over every device of every process.

    shardax launch -n 2 --cpu-devices 4 examples/multihost_psum.py
    mpirun -n 2 python examples/multihost_psum.py      # Open MPI detected by sx.initialize()
"""

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

import shardax as sx

w = sx.initialize()
print("device_count", jax.device_count(), "local_device_count", jax.local_device_count())

# The guide's `jax.pmap(lambda x: jax.lax.psum(x, 'i'), axis_name='i')(xs)`, in the local view:
xs = sx.smap(lambda: sx.comm.allreduce(jnp.float32(1.0)), in_specs=(), out_specs=P(sx.ALL), jit=True)()
local = [float(s.data[0]) for s in xs.addressable_shards]
print("psum on my devices", local)
assert local == [float(w.device_count)] * w.local_device_count
