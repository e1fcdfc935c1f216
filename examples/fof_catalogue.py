"""jz-tree's multi-GPU guide, distributed friends-of-friends: catalogues written per rank, largest printed.

    python examples/fof_catalogue.py                               # 1 CPU device
    JAX_NUM_CPU_DEVICES=4 python examples/fof_catalogue.py         # 4 devices in one process
    shardax launch -n 2 --cpu-devices 4 examples/fof_catalogue.py  # 8 devices in 2 processes

jz-tree                                              shardax
``jz.fof.fof_and_catalogue(part, rlink=rlink)``      ``sx.spatial.fof(part, rlink)`` (``fof.smap()`` for global)
``jz.data.FofCatalogue`` / ``squeeze_catalogue``     ``Catalogue`` / ``Catalogue.to_numpy()``
``np.savez(f"fof_catalogue_rank_{rank}.npz", ...)``  ``sx.io.write(path, catalogue, per_rank=True)`` (HDF5)

The groups are checked on the gathered particles against SciPy (``shardax.testing.reference.fof_components``:
cKDTree.query_pairs + connected_components).
"""

import os
import sys
import tempfile

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils

import shardax as sx
from shardax.particles import Particles, pad, squeeze, with_ids

sx.initialize()
N = int(sys.argv[1]) if len(sys.argv) > 1 else 20000  # particles per device (the guide: 250000)


@sx.distributed(out_specs=sx.ALL, static_argnames=("N", "npad"))
def uniform_particles(N, total_mass=1.0, seed=0, npad=0):
    """jz-tree's `ics.uniform_particles`: N particles per device, `npad` padding rows, ids in (device, row) order."""
    rank, ndev, _ = sx.rank_info()
    pos = jax.random.uniform(jax.random.PRNGKey(seed + rank), (N, 3), dtype=jnp.float32)
    part = Particles(pos=pos, mass=jnp.full((N,), total_mass / (N * ndev), jnp.float32), num=jnp.int32(N))
    return pad(with_ids(part), npad)


mesh = sx.flat_mesh()
ndev = sx.world().device_count
part = uniform_particles.smap(mesh)(N=N, npad=N // 2)
rlink = 0.7 * np.cbrt(1.0 / (N * ndev))
result = sx.spatial.fof.smap(mesh)(part, float(rlink), min_members=20)

# Every process writes its own file (its devices' rows of the catalogue) plus, on process 0, the index.
out_dir = os.environ.get("SHARDAX_EXAMPLE_OUT") or tempfile.gettempdir()
path = os.path.join(out_dir, f"fof_catalogue_{ndev}dev.h5")
files = sx.io.write(path, result.catalogue, per_rank=True)
cata = sx.io.read(path)
if sx.world().process_id == 0:
    print("files:", ", ".join(os.path.basename(f) for f in files))
    for rank in range(ndev):
        count = cata["count"][rank, : cata["num"][rank]]
        print("rank", rank, "ngr", len(count), "largest ten:", np.sort(count)[::-1][:10])

# The same groups as SciPy on the gathered particles.
flat = squeeze(part)
sizes = np.bincount(sx.testing.reference.fof_components(flat["pos"].astype(np.float64), rlink))
want = np.sort(sizes[sizes >= 20])
got = np.sort(result.catalogue.to_numpy()["count"])
assert np.array_equal(got, want), (got[-10:], want[-10:])
labels = np.asarray(multihost_utils.process_allgather(result.labels, tiled=True))
assert int((labels >= 0).sum()) == int(want.sum())
print(f"{len(got)} groups of >= 20 members, largest {got[-1] if len(got) else 0}: matches SciPy")
