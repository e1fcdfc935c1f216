"""sx.fft and sx.fields at the third scale: 2 processes x 4 CPU devices (gloo), slabs over all 8 devices and
process x device pencils.

One launch runs every check; each process compares its addressable shards with NumPy on the full data. This module
must not import conftest: the children import it by path and keep the launcher's device count.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import shardax as sx
from shardax.testing.reference import cic_paint, cic_readout, power_spectrum


def _put(host: np.ndarray, sharding: NamedSharding) -> jax.Array:
    return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])


def _max_error(y: jax.Array, reference: np.ndarray) -> float:
    """Largest error over this process's shards, relative to the reference's largest magnitude."""
    scale = float(np.max(np.abs(reference)))
    return max(float(np.max(np.abs(np.asarray(shard.data) - reference[shard.index]))) / scale
               for shard in y.addressable_shards)


def fft_checks() -> dict:
    shape = (32, 24, 16)
    rng = np.random.default_rng(0)
    a = (rng.normal(size=shape) + 1j * rng.normal(size=shape)).astype(np.complex64)
    r = rng.normal(size=shape).astype(np.float32)
    errors: dict[str, float] = {}
    specs = {}
    for label, mesh, spec in [("slab", sx.flat_mesh("d"), P("d")),
                              ("pencil", sx.grid_mesh(("hosts", "d")), P("hosts", "d"))]:
        sharding = NamedSharding(mesh, spec)
        x = _put(a, sharding)
        for layout in ("same", "transposed"):
            y = sx.fft.fftn(x, layout=layout)
            expected = np.fft.fftn(a)
            if layout == "transposed":
                expected = expected.transpose(1, 2, 0)
            errors[f"{label} fftn {layout}"] = _max_error(y, expected)
            errors[f"{label} ifftn {layout}"] = _max_error(sx.fft.ifftn(y, layout=layout), a)
            specs[f"{label} {layout}"] = (str(y.sharding.spec), y.shape)
        real = sx.fft.rfftn(_put(r, sharding))
        errors[f"{label} rfftn"] = _max_error(real, np.fft.rfftn(r))
        errors[f"{label} irfftn"] = _max_error(sx.fft.irfftn(real, s=shape), r)
        compiled = jax.jit(lambda v, mesh=mesh, spec=spec: sx.fft.fftn(v, mesh=mesh, spec=spec, layout="transposed"))
        volume = sx.comm.collective_bytes(compiled.lower(x).compile())
        plan = sx.fft.plan(shape, spec, mesh=mesh, layout="transposed")
        specs[f"{label} volume"] = (volume.ops, volume.bytes_sent, len(plan.transposes), plan.bytes_moved(8))
    errors.update(_fields_checks())
    return {"errors": errors, "specs": specs, "process": sx.world().process_id}


def _fields_checks() -> dict[str, float]:
    """CIC paint/readout and the power spectrum against NumPy (the CIC reference of tests/test_fields.py)."""
    w = sx.world()
    rng = np.random.default_rng(5)
    pos = rng.random((3000, 3)).astype(np.float32) * 10.0
    mass = rng.uniform(0.5, 1.5, 3000).astype(np.float32)
    mine = slice(w.process_id * 1500, (w.process_id + 1) * 1500)
    expected = cic_paint(pos.astype(np.float64), (16, 16, 16), box=10.0, mass=mass.astype(np.float64))
    errors = {}
    for label, mesh in [("pencil", sx.grid_mesh(("hosts", "d")))]:  # one mesh: each launch check costs seconds
        part = sx.particles.from_numpy(pos[mine], mesh=mesh, mass=mass[mine])
        rho = sx.fields.paint(part, (16, 16, 16), box=10.0)
        errors[f"{label} paint"] = _max_error(rho, expected)
        values = sx.fields.readout(rho, part, box=10.0)
        worst = 0.0
        for vshard, pshard, nshard in zip(values.addressable_shards, part.pos.addressable_shards,
                                          part.num.addressable_shards, strict=True):
            n = int(np.asarray(nshard.data)[0])
            ref = cic_readout(expected, np.asarray(pshard.data)[0, :n].astype(np.float64), box=10.0)
            worst = max(worst, float(np.max(np.abs(np.asarray(vshard.data)[0, :n] - ref))) / expected.max())
        errors[f"{label} readout"] = worst
        delta_ref = expected / expected.mean() - 1
        delta = rho / rho.mean() - 1
        edges = sx.fields.bin_edges(5, (16, 16, 16), 10.0)
        _, pk, modes = sx.fields.power_spectrum(delta, box=10.0, bins=edges, compensate=False)
        _, pk_ref, modes_ref = power_spectrum(delta_ref, box=10.0, edges=edges, compensate=False)
        errors[f"{label} modes"] = float(np.max(np.abs(np.asarray(modes) - modes_ref)))
        errors[f"{label} power"] = float(np.max(np.abs(np.asarray(pk) - pk_ref)) / pk_ref.max())
    return errors


@pytest.mark.multiprocess
def test_fft_and_fields_two_processes() -> None:
    results = sx.testing.run_distributed(fft_checks, num_processes=2, cpu_devices=4)
    assert [res["process"] for res in results] == [0, 1]
    for res in results:
        assert len(res["errors"]) == 16
        for name, err in res["errors"].items():
            assert err < 1e-5, (name, err)
        assert res["specs"]["slab same"] == ("P('d',)", (32, 24, 16))
        assert res["specs"]["slab transposed"] == ("P('d',)", (24, 16, 32))
        assert res["specs"]["pencil transposed"] == ("P('hosts', 'd')", (24, 16, 32))
        local = 32 * 24 * 16 // 8
        ops, sent, count, theory = res["specs"]["slab volume"]
        assert (ops, count) == (1, 1) and sent == theory == local * 7 // 8 * 8
        ops, sent, count, theory = res["specs"]["pencil volume"]
        assert (ops, count) == (2, 2) and sent == theory == (local * 3 // 4 + local // 2) * 8
    assert results[0]["specs"] == results[1]["specs"]
