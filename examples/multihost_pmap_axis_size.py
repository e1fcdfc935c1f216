"""JAX's multihost pmap: the global axis size is the psum of ones over every participating device, and
each host passes its own shard of a globally sharded array.

    shardax launch -n 2 --cpu-devices 4 examples/multihost_pmap_axis_size.py
"""

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import shardax as sx

w = sx.initialize()
mesh = sx.flat_mesh("i")
size = sx.smap(lambda: sx.comm.allreduce(jnp.int32(1)), in_specs=(), out_specs=P(), mesh=mesh)()
print("global axis size", int(size))
assert int(size) == w.device_count

# Each host passes its local rows (leading dim = its local device count); collectives see the global array.
local = np.arange(w.local_device_count, dtype=np.float32) + w.process_id * w.local_device_count
x = jax.make_array_from_process_local_data(NamedSharding(mesh, P("i")), local)
total = sx.smap(lambda v: sx.comm.allreduce(v), in_specs=P("i"), out_specs=P("i"), mesh=mesh, expand=False)(x)
print("sum over the global axis", [float(s.data[0]) for s in total.addressable_shards])
assert all(float(s.data[0]) == sum(range(w.device_count)) for s in total.addressable_shards)
