"""jz-tree's multi-GPU guide: padded particles, `uniform_particles` and `distr_zsort`, with shardax.

    python examples/particles_zsort.py                               # 1 CPU device
    JAX_NUM_CPU_DEVICES=4 python examples/particles_zsort.py         # 4 devices in one process
    shardax launch -n 2 --cpu-devices 4 examples/particles_zsort.py  # 8 devices in 2 processes

jz-tree                                          shardax
``jztree.data.PosMass(pos=, mass=, num=)``       ``sx.particles.Particles(pos=, num=, mass=, ids=)``
``jztree.data.pad_particles(part, npad)``        ``sx.particles.pad(part, npad)``
``ics.uniform_particles.smap(mesh, jit=True)``   ``uniform_particles.smap(mesh)`` (or ``sx.particles.uniform``)
``jz.tree.distr_zsort.smap(mesh, jit=True)``     ``sx.particles.zsort.smap(mesh)``
"""

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils

import shardax as sx
from shardax.particles import Particles, pad, squeeze, with_ids, zsort

sx.initialize()


@sx.distributed(out_specs=sx.ALL, static_argnames=("N", "npad"))
def uniform_particles(N, total_mass=1.0, seed=0, npad=0):
    """jz-tree's `ics.uniform_particles`: N particles per device, `npad` padding rows, ids in (device, row) order."""
    rank, ndev, _ = sx.rank_info()
    pos = jax.random.uniform(jax.random.PRNGKey(seed + rank), (N, 3), dtype=jnp.float32)
    part = Particles(pos=pos, mass=jnp.full((N,), total_mass / (N * ndev), jnp.float32), num=jnp.int32(N))
    return pad(with_ids(part), npad)


def counts(num):
    """Per-device counts on every process (`num` may span processes)."""
    return np.asarray(multihost_utils.process_allgather(num, tiled=True)).tolist()


mesh = sx.flat_mesh()
ndev = sx.world().device_count
part = uniform_particles.smap(mesh)(N=10000, npad=1000)
print(part.pos.shape, counts(part.num))

# the sort creates a temporary imbalance ...
partz = zsort.smap(mesh)(part, equalize=False)[0]
print(partz.pos.shape, counts(partz.num))

# ... which equalize=True (the default) removes: every device ends with num_total / ndev particles
parte, overflow = zsort.smap(mesh)(part)
print(parte.pos.shape, counts(parte.num))

# the same sequence as a NumPy sort of the gathered particles by Morton key (shardax's key convention)
before, after = squeeze(part), squeeze(parte)
hi, lo = jax.jit(lambda p: sx.particles.morton_keys(p))(jnp.asarray(before["pos"]))
order = np.lexsort((np.asarray(lo), np.asarray(hi)))
assert np.array_equal(after["ids"], before["ids"][order]) and np.array_equal(after["pos"], before["pos"][order])
assert after["ids"].size == 10000 * ndev and max(counts(parte.num)) - min(counts(parte.num)) <= 1
print("z-order matches NumPy")
