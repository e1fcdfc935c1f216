"""A plain position array works wherever a particle pytree without fields does: zsort, domain, kNN, the CIC fields.

Local views take an `(n, d)` array, global functions an `(ndev, n, d)` one; every row is a particle (unit mass).
Results are compared with the NumPy references of :mod:`shardax.testing.reference` on one device, on 8 CPU devices
in one process and on 2 processes x 4 devices (in tests/test_zsort.py's launch, which calls :func:`global_checks`).
This module must not import conftest: the children of that launch import it and must keep the launcher's device
count.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import shardax as sx
from comm_checks import put, to_numpy
from shardax.particles import domain, zsort
from shardax.spatial import knn
from shardax.testing import reference

ROWS = 160  # per device
SHAPE = (8, 8, 8)


def _data(ndev: int) -> np.ndarray:
    return np.random.default_rng(3).random((ndev * ROWS, 3)).astype(np.float32)


def global_checks(mesh: jax.sharding.Mesh) -> dict[str, np.ndarray]:
    """The global functions on a plain ``(ndev, ROWS, 3)`` array over ``mesh``; their outputs on the host."""
    ndev = mesh.devices.size
    data = _data(ndev)
    plain = put(mesh, data.reshape(ndev, ROWS, 3))
    zpart, overflow = zsort.smap(mesh)(plain, box=1.0)
    dom = domain.smap(mesh)(zpart.pos, box=1.0)  # a plain array: every row counts, padding rows too
    neighbours = knn.smap(mesh)(plain, 4, box=1.0)
    rho = sx.fields.paint(plain, SHAPE, box=1.0, mesh=mesh, capacity=2 * ROWS)
    values = sx.fields.readout(rho, plain, box=1.0, capacity=2 * ROWS)
    return {"zpos": to_numpy(zpart.pos), "znum": to_numpy(zpart.num), "overflow": to_numpy(overflow),
            "domain_rows": np.asarray(dom.counts), "indices": to_numpy(neighbours.indices),
            "rho": to_numpy(rho), "values": to_numpy(values)}


def check_global(out: dict[str, np.ndarray], ndev: int) -> None:
    data = _data(ndev)
    n = len(data)
    assert not out["overflow"].any()
    # Every row is a particle: all n travel, in z-order (equal keys in input order), device after device.
    assert out["znum"].sum() == n
    sorted_pos = np.concatenate([rows[:num] for rows, num in zip(out["zpos"], out["znum"], strict=True)])
    np.testing.assert_array_equal(sorted_pos, data[reference.morton_order(data, ids=np.arange(n))])
    assert out["domain_rows"].sum() == out["zpos"].shape[0] * out["zpos"].shape[1]
    # Neighbour ids are global row numbers, device-major, as for a pytree without ids.
    _, want = reference.brute_knn(data, 4, box=1.0)
    np.testing.assert_array_equal(out["indices"].reshape(n, 4), want)
    np.testing.assert_allclose(out["rho"], reference.cic_paint(data, SHAPE, box=1.0), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(out["values"].reshape(n), reference.cic_readout(out["rho"], data, box=1.0),
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("ndev", [1, 8])
def test_global_functions_take_plain_arrays(ndev: int) -> None:
    mesh = jax.make_mesh((ndev,), ("d",), devices=jax.devices()[:ndev])
    out = global_checks(mesh)
    assert out["indices"].shape == (ndev, ROWS, 4) and out["values"].shape == (ndev, ROWS)  # aligned with the rows
    check_global(out, ndev)
    # zorder=True: the answers are aligned with the z-sorted rows, spare rows included, each row naming its point.
    data = _data(ndev)
    res, zpart = knn.smap(mesh)(put(mesh, data.reshape(ndev, ROWS, 3)), 4, box=1.0, zorder=True)
    num, ids, indices = np.asarray(zpart.num), np.asarray(zpart.ids), np.asarray(res.indices)
    assert num.sum() == len(data) and indices.shape[:2] == ids.shape
    _, want = reference.brute_knn(data, 4, box=1.0)
    for d in range(ndev):
        np.testing.assert_array_equal(indices[d, :num[d]], want[ids[d, :num[d]]])


def test_local_views_take_plain_arrays() -> None:
    data = _data(1)
    pos = jnp.asarray(data)
    zpart, overflow = zsort(pos, box=1.0)
    assert isinstance(zpart, sx.particles.Particles) and not bool(overflow)
    np.testing.assert_array_equal(np.asarray(zpart.pos), data[reference.morton_order(data, ids=np.arange(len(data)))])
    assert int(domain(zpart.pos, box=1.0).counts.sum()) == len(data)
    rho, needed = sx.fields.local_paint(pos, SHAPE, box=1.0)
    np.testing.assert_allclose(np.asarray(rho), reference.cic_paint(data, SHAPE, box=1.0), rtol=1e-5, atol=1e-5)
    values, _ = sx.fields.local_readout(rho, pos, box=1.0)
    np.testing.assert_allclose(np.asarray(values), reference.cic_readout(np.asarray(rho), data, box=1.0),
                               rtol=1e-5, atol=1e-5)
    both, _ = sx.fields.local_paint_readout(pos, SHAPE, lambda block: block, box=1.0)
    np.testing.assert_array_equal(np.asarray(both), np.asarray(values))
    assert int(needed) == len(data)


def test_plain_array_errors() -> None:
    """A plain array of the wrong rank or dtype is refused with the argument named and what to pass."""
    mesh = jax.make_mesh((1,), ("d",), devices=jax.devices()[:1])
    with pytest.raises(ValueError, match=r"zsort: part as a plain array must have shape .* zsort.smap"):
        zsort(jnp.zeros((1, 4, 3)))
    with pytest.raises(TypeError, match=r"zsort.smap: part must hold float32 or float64"):
        zsort.smap(mesh)(jnp.zeros((1, 4, 3), jnp.int32))
    with pytest.raises(ValueError, match=r"paint: part as a plain array must have shape \(ndev, n, d\)"):
        sx.fields.paint(jnp.zeros((4, 3)), SHAPE, box=1.0, mesh=mesh)
    with pytest.raises(ValueError, match=r"paint: positions must have shape \(ndev, n, 3\)"):
        sx.fields.paint(jnp.zeros((1, 4, 2)), SHAPE, box=1.0, mesh=mesh)
    with pytest.raises(ValueError, match=r"local_paint: part as a plain array must have shape \(n, 3\)"):
        sx.fields.local_paint(jnp.zeros((4, 2)), SHAPE, box=1.0)
