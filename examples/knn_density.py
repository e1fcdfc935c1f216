"""jz-tree's guide: mean distance to the 8 nearest neighbours as a local density estimate, with shardax.

jz-tree's guide computes ``rmean`` with ``knn(part, k=9, result="reduce", reduce_func=...)`` inside a shard_map.
With shardax the reduction is the ``reduce=`` argument of ``sx.spatial.knn``; the same local-view function runs on
one device and, through ``knn.smap``, on every device of the run (here all CPU devices of this process, or every
process of a ``shardax launch -n 2 --cpu-devices 4 examples/knn_density.py`` run).

    python examples/knn_density.py [--n 100000]
"""

from __future__ import annotations

import argparse
import os

import jax
import jax.numpy as jnp
import numpy as np

import shardax as sx
from shardax.spatial import knn


def mean_neighbour_distance(distances: jax.Array, indices: jax.Array, part: object) -> jax.Array:
    """Average distance to the 8 nearest neighbours, the particle itself (distance 0) excluded."""
    del indices, part
    return jnp.mean(distances[:, 1:], axis=-1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, default=100_000)
    args = parser.parse_args()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    sx.initialize()

    rng = np.random.default_rng(0)
    everything = rng.random((args.n, 3), dtype=np.float32)
    mine = np.array_split(everything, jax.process_count())[jax.process_index()]

    # Global: particles spread over every device, one call, results aligned with each device's rows.
    part = sx.particles.from_numpy(mine)
    res = knn.smap()(part, 9, box=1.0, reduce=mean_neighbour_distance)
    if jax.process_count() == 1:
        rmean = np.asarray(res.indices)
        valid = np.arange(rmean.shape[1])[None, :] < np.asarray(part.num)[:, None]
        by_id = rmean[valid][np.argsort(np.asarray(part.ids)[valid])]

        # Local view on one device: the very same function.
        local = np.asarray(knn(jnp.asarray(everything), 9, box=1.0, reduce=mean_neighbour_distance).indices)
        np.testing.assert_allclose(by_id, local, rtol=1e-6)
        mean_spacing = (1.0 / args.n) ** (1 / 3)
        print(f"{sx.world().device_count} device(s), {args.n} particles: rmean = {local.mean():.6f} on average "
              f"({local.mean() / mean_spacing:.3f} mean interparticle spacings), min {local.min():.6f}, "
              f"max {local.max():.6f}; knn.smap and the one-device call agree")
    else:
        print(f"process {jax.process_index()}: rmean computed for {int(np.sum(part.num.addressable_data(0)))} "
              "particles on its first device")


if __name__ == "__main__":
    main()
