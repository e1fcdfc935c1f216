"""sx.fft at the third scale: 2 processes x 4 CPU devices (gloo), slabs over all 8 devices and process x device pencils.

One launch runs every check; each process compares its addressable shards with numpy.fft on the full array. This
module must not import conftest: the children import it by path and keep the launcher's device count.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import shardax as sx


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
        volume = sx.fft.collective_bytes(compiled.lower(x).compile())
        plan = sx.fft.plan(shape, spec, mesh=mesh, layout="transposed")
        specs[f"{label} volume"] = (volume.ops, volume.bytes_sent, len(plan.transposes), plan.bytes_moved(8))
    return {"errors": errors, "specs": specs, "process": sx.world().process_id}


@pytest.mark.multiprocess
def test_fft_two_processes() -> None:
    results = sx.testing.run_distributed(fft_checks, num_processes=2, cpu_devices=4)
    assert [res["process"] for res in results] == [0, 1]
    for res in results:
        assert len(res["errors"]) == 12
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
