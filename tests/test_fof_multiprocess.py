"""FoF at the third scale (2 processes x 4 CPU devices), plus the data sets and SciPy references of tests/test_fof.py.

This module must not import conftest: the children of ``sx.testing.run_distributed`` import it by path and keep the
device count of the launcher. Module-level code stays free of JAX computations.
"""

from __future__ import annotations

import dataclasses
import os

import jax
import numpy as np
import pytest
from jax.experimental import multihost_utils

import shardax as sx
from shardax.spatial._fof import fof
from shardax.testing import reference

MIN_MEMBERS = 5


def mixed_periodic(seed: int = 4) -> dict:
    """Periodic 3D box: uniform background, Gaussian blobs (one across the corner of the box), a filament that
    crosses the box along x (one group over every device), and duplicated points."""
    rng = np.random.default_rng(seed)
    background = rng.random((1200, 3))
    centres = np.array([[0.3, 0.3, 0.3], [0.7, 0.2, 0.6], [0.5, 0.8, 0.4], [0.0, 0.0, 0.0]])
    blobs = np.concatenate([c + 0.008 * rng.standard_normal((80, 3)) for c in centres])
    x = np.arange(0, 1, 0.012)
    filament = np.stack([x, np.full_like(x, 0.61), np.full_like(x, 0.13)], axis=1)
    duplicates = np.repeat(np.array([[0.9, 0.45, 0.77]]), 40, axis=0)
    pos = np.concatenate([background, blobs, filament, duplicates]) % 1.0
    pos = pos[rng.permutation(len(pos))].astype(np.float32)
    vel = rng.standard_normal(pos.shape).astype(np.float32)
    mass = rng.uniform(0.5, 2.0, len(pos)).astype(np.float32)
    return {"pos": pos, "vel": vel, "mass": mass, "linking_length": 0.02, "box": 1.0}


def uniform_open_2d(seed: int = 5) -> dict:
    rng = np.random.default_rng(seed)
    pos = rng.random((1500, 2)).astype(np.float32)
    return {"pos": pos, "vel": None, "mass": None, "linking_length": 0.7 / np.sqrt(1500), "box": None}


def dense_boundaries(seed: int = 6) -> dict:
    """Uniform periodic 3D points with a linking length so long that each of 8 devices needs more ghost rows than
    the buffer ``fof.smap`` starts from (1024): the unset ``halo_capacity`` must grow."""
    rng = np.random.default_rng(seed)
    pos = rng.random((40000, 3)).astype(np.float32)
    return {"pos": pos, "vel": None, "mass": None, "linking_length": 0.7 / 40000 ** (1 / 3), "box": 1.0}


def labels_by_input_index(labels: np.ndarray, ids: np.ndarray, num: np.ndarray, total: int) -> np.ndarray:
    """Global ``(ndev, n)`` labels rearranged into input order through the particles' ``ids``."""
    out = np.full(total, -2, np.int64)
    for d in range(labels.shape[0]):
        out[ids[d, : num[d]]] = labels[d, : num[d]]
    return out


def compare_catalogues(got: dict[str, np.ndarray], want: dict[str, np.ndarray]) -> None:
    np.testing.assert_array_equal(got["label"], want["label"])
    np.testing.assert_array_equal(got["count"], want["count"])
    compact = ~want["spanning"].astype(bool)
    for name in ("mass", "com", "vel", "radius"):
        np.testing.assert_allclose(got[name][compact], want[name][compact], rtol=2e-4, atol=2e-5, err_msg=name)


def _scenarios() -> list[tuple[str, dict]]:
    """The data sets of the launch, by name."""
    return [("mixed", mixed_periodic()), ("open2d", uniform_open_2d())]


def _host(x: jax.Array) -> np.ndarray:
    if not x.is_fully_addressable:
        return np.asarray(multihost_utils.process_allgather(x, tiled=True))
    return np.asarray(x)


def _distributed_body(out_dir: str) -> dict:
    """Run every scenario on 2 processes x 4 devices; each process passes its own slice of the rows."""
    import shardax.spatial._fof_smap as fof_module

    me, nproc = sx.world().process_id, sx.world().num_processes
    results = {}
    for name, data in _scenarios():
        rows = np.array_split(np.arange(len(data["pos"])), nproc)[me]
        fields = {k: data[k][rows] for k in ("vel", "mass") if data[k] is not None}
        part = sx.particles.from_numpy(data["pos"][rows], **fields)
        # The mixed data start from a ghost buffer of 16 rows (unset halo_capacity): it must grow, to the same
        # size on both processes.
        start = fof_module._AUTO_HALO_MIN
        if name == "mixed":
            fof_module._AUTO_HALO_MIN = 16
        try:
            res = fof.smap()(part, data["linking_length"], box=data["box"], min_members=MIN_MEMBERS)
        finally:
            fof_module._AUTO_HALO_MIN = start
        flat = sx.particles.squeeze(part)
        labels = _host(res.labels)
        num = _host(part.num)
        ids = _host(part.ids)
        results[name] = {"labels": labels_by_input_index(labels, ids, num, len(data["pos"])),
                         "catalogue": res.catalogue.to_numpy(), "count": len(flat["pos"]),
                         "halo_needed": int(np.max(_host(res.needed)[:, 1]))}
        if name == "mixed":
            only = fof.smap()(part, data["linking_length"], box=data["box"], min_members=MIN_MEMBERS,
                              catalogue=False)
            results["labels_only"] = {"labels": labels_by_input_index(_host(only.labels), ids, num, len(data["pos"])),
                                      "catalogue": only.catalogue}
            shared = os.path.join(out_dir, "catalogue.h5")
            ranked = os.path.join(out_dir, "catalogue_ranked.h5")
            sx.io.write(shared, res.catalogue)
            files = sx.io.write(ranked, res.catalogue, per_rank=True)
            results["io"] = {"shared": sx.io.read(shared, like=res.catalogue),
                             "ranked": sx.io.read(ranked), "files": files}
    results["plain"] = _plain_array()
    results["refused"] = _refused_inputs()
    return results


PLAIN_ROWS = 1600


def _plain_array() -> np.ndarray:
    """Labels of a plain ``(ndev, n, 3)`` position array (every row a particle) spread over both processes, found
    with the GPU preset forced on CPU (one program for both: each adds a compilation at this scale). The z-order
    sort of these rows needs 207 rows on a device (every row of a plain array is a particle): it is given room,
    so that the program compiles once rather than again for a grown sort buffer."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = sx.flat_mesh()
    blocks = mixed_periodic()["pos"][:PLAIN_ROWS].reshape(mesh.size, -1, 3)
    pos = jax.make_array_from_callback(blocks.shape, NamedSharding(mesh, P(mesh.axis_names)), lambda i: blocks[i])
    data = mixed_periodic()
    res = fof.smap(mesh)(pos, data["linking_length"], box=data["box"], min_members=MIN_MEMBERS, tuning="gpu",
                         sort_capacity=2 * blocks.shape[1])
    return _host(res.labels).reshape(-1)


def _refused_inputs() -> dict:
    """Inputs the kernels answer with an error or an empty result, at this scale: data made in a box twice the one
    passed (every process raises the same ValueError), and no particles at all on any process (FoF: the mixed
    scenario's program on rows that are all padding; z-order sort and paint: no rows at all)."""
    me, nproc = sx.world().process_id, sx.world().num_processes
    data = mixed_periodic()
    rows = np.array_split(np.arange(len(data["pos"])), nproc)[me]
    # The mixed scenario's fields and rows: its compiled program (and grown ghost buffer) is reused.
    wide = sx.particles.from_numpy(2.0 * data["pos"][rows], vel=data["vel"][rows], mass=data["mass"][rows])
    out = {}
    try:
        fof.smap()(wide, data["linking_length"], box=data["box"], min_members=MIN_MEMBERS)
        out["box"] = "no error"
    except ValueError as err:
        out["box"] = str(err)
    # No particles on any device, in the rows of the mixed scenario (its program is reused).
    part = sx.particles.from_numpy(data["pos"][rows], vel=data["vel"][rows], mass=data["mass"][rows])
    none = dataclasses.replace(part, num=part.num * 0)
    res = fof.smap()(none, data["linking_length"], box=data["box"], min_members=MIN_MEMBERS)
    out["empty_labels"] = _host(res.labels)
    out["empty_groups"] = int(_host(res.catalogue.num).sum())
    empty = sx.particles.from_numpy(np.zeros((0, 3), np.float32))
    zpart, _ = sx.particles.zsort.smap()(empty, box=1.0)
    out["empty_zsort"] = int(_host(zpart.num).sum())
    rho = sx.fields.paint(empty, (8, 8, 8), box=1.0)
    out["empty_field"] = float(np.abs(_host(rho)).sum())
    return out


@pytest.mark.multiprocess
def test_fof_two_processes(tmp_path) -> None:
    results = sx.testing.run_distributed(_distributed_body, str(tmp_path), num_processes=2, cpu_devices=4)
    for name, data in _scenarios():
        want = reference.fof_labels(data["pos"], data["linking_length"], box=data["box"], min_members=MIN_MEMBERS)
        cat = reference.fof_catalogue(data["pos"], want, mass=data["mass"], vel=data["vel"], box=data["box"])
        for res in results:
            np.testing.assert_array_equal(res[name]["labels"], want)
            compare_catalogues(res[name]["catalogue"], cat)
        assert len(np.unique(want[want >= 0])) > 3, name
    # Labels only (catalogue=False) on the mixed data: the same labels, no catalogue.
    data = mixed_periodic()
    want = reference.fof_labels(data["pos"], data["linking_length"], box=data["box"], min_members=MIN_MEMBERS)
    for res in results:
        np.testing.assert_array_equal(res["labels_only"]["labels"], want)
        assert res["labels_only"]["catalogue"] is None
    plain = reference.fof_labels(data["pos"][:PLAIN_ROWS], data["linking_length"], box=data["box"], min_members=MIN_MEMBERS)
    for res in results:
        np.testing.assert_array_equal(res["plain"], plain)
        refused = res["refused"]
        assert "do not fit the periodic box 1.0" in refused["box"], refused["box"]
        assert np.all(refused["empty_labels"] == -1) and refused["empty_groups"] == 0
        assert refused["empty_zsort"] == 0 and refused["empty_field"] == 0.0
    # The ghost buffer grew past where it started, identically on both processes.
    assert results[0]["mixed"]["halo_needed"] == results[1]["mixed"]["halo_needed"] > 16
    # Catalogue files: the shared file and the per-rank files hold the same global arrays.
    io0, io1 = results[0]["io"], results[1]["io"]
    assert len(io0["files"]) == 3 and io0["files"] == io1["files"]
    shared, ranked = io0["shared"], io0["ranked"]
    np.testing.assert_array_equal(np.asarray(shared.label), ranked["label"])
    np.testing.assert_array_equal(np.asarray(shared.num), ranked["num"])
    rows = [np.asarray(shared.label)[d, : int(shared.num[d])] for d in range(8)]
    np.testing.assert_array_equal(np.sort(np.concatenate(rows)), results[0]["mixed"]["catalogue"]["label"])
