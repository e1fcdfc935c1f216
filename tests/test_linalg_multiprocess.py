"""sx.linalg at the third scale: 2 processes x 4 CPU devices (gloo), on the flat mesh and the hosts x devices grid.

One launch runs every check; each process compares its addressable shards with NumPy/SciPy on the full matrix. This
module must not import conftest: the children import it by path and keep the launcher's device count.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.linalg as sl
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import shardax as sx


def _put(host: np.ndarray, sharding: NamedSharding) -> jax.Array:
    return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])


def _error(y: jax.Array, reference: np.ndarray) -> float:
    """Largest error over this process's shards, relative to the reference's largest magnitude."""
    scale = float(np.max(np.abs(reference)))
    return max(float(np.max(np.abs(np.asarray(shard.data) - reference[shard.index]))) / scale
               for shard in y.addressable_shards)


def _replicated(x: jax.Array, mesh) -> np.ndarray:
    return np.asarray(jax.jit(lambda v: v, out_shardings=NamedSharding(mesh, P()))(x).addressable_data(0))


def linalg_checks() -> dict:
    n = 61
    rng = np.random.default_rng(0)
    m = rng.standard_normal((n, n))
    a = (m @ m.T / n + np.eye(n)).astype(np.float32)
    b = rng.standard_normal((n, 2)).astype(np.float32)
    x_ref, l_ref, inv_ref = sl.cho_solve(sl.cho_factor(a), b), np.linalg.cholesky(a), np.linalg.inv(a)
    sym = ((m + m.T) / 2).astype(np.float32)
    w_ref = np.linalg.eigvalsh(sym)
    grid = sx.grid_mesh(("hosts", "d"))
    flat = sx.flat_mesh("d")
    errors: dict[str, float] = {}
    statuses: dict[str, int] = {}
    # n = 61 does not split over the mesh: pad to 64 for the sharded input, solve the leading 61 x 61 block.
    a64 = np.eye(64, dtype=np.float32)
    a64[:n, :n] = a
    # The last two: 2D process grids whose process columns span both processes (the all-to-all and the row
    # broadcasts go over gloo).
    for label, mesh, spec, process_grid in [("rows", flat, P("d", None), None), ("cols", flat, P(None, "d"), None),
                                            ("2d", grid, P("hosts", "d"), None),
                                            ("host-cols", grid, P(None, "d"), None),
                                            ("grid-2x4", grid, P("hosts", "d"), (2, 4)),
                                            ("grid-4x2", flat, P("d", None), (4, 2))]:
        ad = _put(a64, NamedSharding(mesh, spec))
        bd = _put(np.pad(b, ((0, 3), (0, 0))), NamedSharding(mesh, P()))
        x, logdet, status = sx.linalg.potrs(ad, bd, tile=5, return_logdet=True, return_status=True,
                                            grid=process_grid)
        errors[f"potrs-{label}"] = float(np.max(np.abs(_replicated(x, mesh)[:n] - x_ref)))
        errors[f"logdet-{label}"] = abs(float(_replicated(logdet, mesh)) - float(np.linalg.slogdet(a)[1]))
        statuses[f"potrs-{label}"] = int(_replicated(status, mesh))
        factor = sx.linalg.potrf(ad, tile=5, grid=process_grid)
        errors[f"potrf-{label}"] = _error(factor, np.pad(l_ref, ((0, 3), (0, 3))) + np.diag([0.0] * n + [1.0] * 3))
        if label in ("rows", "grid-2x4"):  # potri shares potrf's layouts (checked above): one flat, one grid
            inverse = sx.linalg.potri(ad, tile=5, grid=process_grid)
            errors[f"potri-{label}"] = _error(inverse, np.pad(inv_ref, ((0, 3), (0, 3)))
                                              + np.diag([0.0] * n + [1.0] * 3))
    bad = a.copy()
    bad[29, 29] = -1.0
    _, status = sx.linalg.potrs(bad, b, tile=4, mesh=grid, return_status=True)
    statuses["not-spd"] = int(_replicated(status, grid))
    _, status = sx.linalg.potrf(bad, tile=4, mesh=grid, return_status=True, grid=(2, 4))
    statuses["not-spd-grid"] = int(_replicated(status, grid))
    w, v, status = sx.linalg.syevd(_put(sym, NamedSharding(grid, P())), mesh=grid, tile=5, return_status=True)
    w = _replicated(w, grid)
    v = _replicated(v, grid)
    errors["syevd-w"] = float(np.max(np.abs(w - w_ref)))
    errors["syevd-residual"] = float(np.max(np.abs(sym @ v - v * w)))
    statuses["syevd"] = int(_replicated(status, grid))
    # jaxmg's multi-host recipe: columns over every device, replicated across hosts, jaxmg's positional call.
    ndev = jax.device_count()
    diag = jax.device_put(jnp.diag(jnp.arange(1, ndev + 1, dtype=jnp.float32)), NamedSharding(grid, P(None, ("hosts", "d"))))
    diag = sx.host_replicate(diag, grid, axis="hosts")
    ones = _put(np.ones((ndev, 1), np.float32), NamedSharding(grid, P()))
    out = sx.linalg.potrs(diag, ones, 256, grid, (P(None, "T"), P(None, None)))
    errors["jaxmg"] = float(np.max(np.abs(_replicated(out, grid)[:, 0] - 1 / np.arange(1, ndev + 1))))
    # The same on a mesh from jax.make_mesh, whose axes are explicit by default.
    explicit = jax.make_mesh((2, ndev // 2), ("hosts", "d"))
    diag = jax.device_put(jnp.diag(jnp.arange(1, ndev + 1, dtype=jnp.float32)),
                          NamedSharding(explicit, P(None, ("hosts", "d"))))
    diag = sx.host_replicate(diag, explicit, axis="hosts")
    out = sx.linalg.potrs(diag, np.ones((ndev, 1), np.float32), 256, explicit, (P(None, "T"), P(None, None)))
    errors["jaxmg-explicit"] = float(np.max(np.abs(np.asarray(out.addressable_data(0))[:, 0]
                                                   - 1 / np.arange(1, ndev + 1))))
    return {"errors": errors, "statuses": statuses}


@pytest.mark.multiprocess
def test_linalg_two_processes():
    results = sx.testing.run_distributed(linalg_checks, num_processes=2, cpu_devices=4, timeout_s=600)
    assert len(results) == 2
    for result in results:
        assert {"potri-rows", "potri-grid-2x4", "syevd-w", "jaxmg"} <= set(result["errors"]), sorted(result["errors"])
        for name, error in result["errors"].items():
            assert error < 2e-4, (name, error)
        labels = ("rows", "cols", "2d", "host-cols", "grid-2x4", "grid-4x2")
        assert result["statuses"] == {**{f"potrs-{k}": 0 for k in labels}, "not-spd": 30, "not-spd-grid": 30,
                                      "syevd": 0}
