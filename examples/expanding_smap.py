"""jz-tree's multi-GPU guide: the expanding shard_map and the `.smap` constructor, with shardax.

    python examples/expanding_smap.py                               # 1 CPU device
    shardax launch -n 2 --cpu-devices 4 examples/expanding_smap.py  # 8 devices in 2 processes
"""

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

import shardax as sx

sx.initialize()


def f(seed):
    rank, ndev, axis_names = sx.rank_info()
    print("rank info:", rank, ndev, axis_names)
    pos = jax.random.uniform(jax.random.key(seed + rank), (10000, 3))
    loc = jnp.sum(pos**2)
    total = sx.comm.allreduce(loc)
    print("inside", jax.typeof(pos), jax.typeof(loc), jax.typeof(total))
    return pos, loc, total


# jz.jax_ext.expanding_shard_map(f, out_specs=(P(-1), P(-1), P()), in_specs=P(), mesh=mesh)
f_smapped = sx.smap(f, in_specs=(None,), out_specs=(P(-1), P(-1), P()), jit=True)
pos, loc, total = f_smapped(0)
print("outside", pos.shape, loc.shape, total.shape)

# f.smap = jz.jax_ext.shard_map_constructor(f, out_specs=(P(-1), P(-1), P()), in_specs=P())
f = sx.distributed(f, out_specs=(P(-1), P(-1), P()), static_argnames=("seed",))
pos, loc, total = f.smap(jit=True)(seed=0)
print("outside", pos.shape, loc.shape, total.shape)
ndev = sx.world().device_count
assert pos.shape == (ndev, 10000, 3) and loc.shape == (ndev,) and total.shape == ()
