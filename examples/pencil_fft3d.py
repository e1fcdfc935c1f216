"""mpi4jax's hand-written pencil `fft3d` with shardax: the same transform on a 2D process grid, the JAX way.

The mpi4jax version reshapes, transposes and calls `mpi4jax.alltoall` by hand over two MPI sub-communicators, and returns the
spectrum "transposed". With shardax the array lives on a 2D mesh (`sx.grid_mesh`: processes x devices), the
transposes are `all_to_all`s inside `shard_map`, and `layout="transposed"` gives the same skip-the-last-transpose
output, stored `(k1, k2, k0)` with the input's sharding:

    shardax launch -n 2 --cpu-devices 4 examples/pencil_fft3d.py     # 2 x 4 pencils
    python examples/pencil_fft3d.py                                  # one process (its devices as 1 x n)
"""

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import shardax as sx

w = sx.initialize()
mesh = sx.grid_mesh(("x", "y"))  # mpi4jax's comms[0] x comms[1]: one row per process, one column per device
print(f"process {w.process_id}: mesh {dict(mesh.shape)}, {w.device_count} devices in {w.num_processes} process(es)")

shape = (64, 64, 64)
host = np.random.default_rng(0).standard_normal(shape).astype(np.float32)  # same data in every process
x = jax.make_array_from_callback(shape, NamedSharding(mesh, P("x", "y")), lambda index: host[index])


def fft3d(arr):
    """mpi4jax's function in the local view: this device's pencil in, its pencil of the transposed spectrum out."""
    return sx.fft.local_fftn(arr, spec=P("x", "y"), layout="transposed")


local_version = sx.smap(fft3d, in_specs=P("x", "y"), out_specs=P("x", "y"), mesh=mesh, expand=False, jit=True)
spectrum = local_version(x.astype(jnp.complex64))
global_version = sx.fft.fftn(x.astype(jnp.complex64), layout="transposed")  # the same, as one global call
plan = sx.fft.plan(shape, P("x", "y"), mesh=mesh, layout="transposed")
print(f"process {w.process_id}: output {spectrum.shape} {spectrum.sharding.spec}, {len(plan.transposes)} "
      f"all_to_all(s), {plan.bytes_moved(8) / 2**20:.2f} MiB sent per device")

reference = np.fft.fftn(host).transpose(1, 2, 0)  # what numpy gives, stored (k1, k2, k0)
scale = np.abs(reference).max()
for result in (spectrum, global_version):
    for shard in result.addressable_shards:
        err = np.abs(np.asarray(shard.data) - reference[shard.index]).max() / scale
        assert err < 1e-5, f"shard {shard.index} differs from numpy.fft.fftn by {err:.2e}"
back = sx.fft.ifftn(spectrum, layout="transposed")  # undoes it: (n0, n1, n2) split P("x", "y") again
for shard in back.addressable_shards:
    assert np.abs(np.asarray(shard.data).real - host[shard.index]).max() < 1e-4
print(f"process {w.process_id}: fft3d matches numpy.fft.fftn on every local pencil; ifftn undoes it")
