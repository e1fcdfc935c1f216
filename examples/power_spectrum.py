"""Paint particles on a distributed grid (cloud-in-cell), measure the power spectrum P(k) and plot it.

Each process generates its own clustered particles (clumps on a uniform background), `sx.fields.paint` moves them to
the device that owns their slab of the grid and deposits their mass (spill-over added back by a halo exchange),
`sx.fields.power_spectrum` takes the distributed real FFT of the overdensity, divides out the CIC window and bins
|delta_k|^2. The plot goes to $SHARDAX_EXAMPLE_OUT (default: the temporary directory).

    shardax launch -n 2 --cpu-devices 4 examples/power_spectrum.py
    python examples/power_spectrum.py
"""

import os
import tempfile

import jax.numpy as jnp
import numpy as np

import shardax as sx

w = sx.initialize()
mesh = sx.flat_mesh("d")
box, grid, n_local = 500.0, (64, 64, 64), 60_000

# This process's particles: 60% in 400 Gaussian clumps of 4 box units, 40% uniform (different seed per process).
rng = np.random.default_rng(1234 + w.process_id)
centres = np.random.default_rng(99).random((400, 3)) * box  # the same clumps everywhere
clumped = centres[rng.integers(0, 400, int(0.6 * n_local))] + rng.normal(0, 4.0, (int(0.6 * n_local), 3))
pos = np.concatenate([clumped, rng.random((n_local - len(clumped), 3)) * box]) % box
part = sx.particles.from_numpy(pos.astype(np.float32), mesh=mesh)

# Clustering piles particles onto a few slabs: capacity is data, and the error says how much is needed.
capacity = None
while True:
    try:
        rho = sx.fields.paint(part, grid, box=box, capacity=capacity)
        break
    except sx.CapacityError as err:
        print(f"process {w.process_id}: {err} -> retrying")
        capacity = err.needed

total = float(jnp.sum(rho))
n_total = n_local * w.num_processes
assert abs(total - n_total) < 1e-3 * n_total, (total, n_total)
delta = rho / jnp.mean(rho) - 1
k, pk, modes = sx.fields.power_spectrum(delta, box=box, bins=20)
k, pk, modes = np.asarray(k), np.asarray(pk), np.asarray(modes)
shot = box**3 / n_total
print(f"process {w.process_id}: {n_total} particles painted on {grid} over {w.device_count} devices, mass "
      f"{total:.1f}; shot noise {shot:.1f}")
if w.process_id == 0:
    print(f"{'k [1/unit]':>12s} {'P(k)':>12s} {'modes':>8s}")
    for row in zip(k, pk, modes, strict=True):
        print(f"{row[0]:12.4f} {row[1]:12.2f} {row[2]:8d}")
    assert pk[0] > 3 * shot, "clumps should give far more large-scale power than shot noise"
    import matplotlib
    import matplotlib.ticker

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 4))
    ax.loglog(k, pk, "o-", label=f"{n_total} particles, {grid[0]}$^3$ CIC")
    ax.axhline(shot, ls="--", c="gray", label="shot noise")
    ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    ax.set_xlabel("k")
    ax.set_ylabel("P(k)")
    ax.legend()
    out = os.path.join(os.environ.get("SHARDAX_EXAMPLE_OUT", tempfile.gettempdir()), "power_spectrum.png")
    fig.savefig(out, dpi=100, bbox_inches="tight")
    print(f"plot written to {out}")
