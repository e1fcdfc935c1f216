"""The mpi4jax talk's first example: `arr + rank`, allreduced inside jit, without MPI bindings.

mpi4jax version (one process per device):

    @jax.jit
    def foo(arr):
        arr = arr + rank
        arr_sum, _ = mpi4jax.allreduce(arr, op=MPI.SUM, comm=comm)
        return arr_sum

shardax runs the same local-view function on every device of every process (`rank` is the device's rank):

    shardax launch -n 2 --cpu-devices 4 examples/mpi4jax_allreduce.py
"""

import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

import shardax as sx


def foo(arr):
    rank = sx.rank_info().rank
    return sx.comm.allreduce(arr + rank)


w = sx.initialize()
result = sx.smap(foo, in_specs=P(), out_specs=P(), jit=True)(jnp.zeros((3, 3)))
if w.process_id == 0:
    print(result)
expected = sum(range(w.device_count))
assert float(result.addressable_shards[0].data[0, 0]) == expected
