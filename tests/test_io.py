"""sx.io: pytrees to HDF5 and back (shared file and per-rank files), Gadget-style snapshots, bad files.

The multi-process writes (2 processes writing one shared file in rank order, and one file each) are checked in
tests/test_fof_multiprocess.py, in the same launch as FoF.
"""

from __future__ import annotations

import os

import h5py
import jax.numpy as jnp
import numpy as np
import pytest

import shardax as sx
from conftest import make_mesh
from shardax.particles import Particles
from shardax.spatial._catalogue import Catalogue
from shardax.testing import reference
from test_fof_multiprocess import mixed_periodic


def _particles(mesh_shape: tuple[int, ...] = (4,)) -> Particles:
    rng = np.random.default_rng(2)
    pos = rng.random((50, 3)).astype(np.float32)
    return sx.particles.from_numpy(pos, mesh=make_mesh(mesh_shape), vel=rng.standard_normal((50, 3)),
                                   mass=rng.random(50))


@pytest.mark.parametrize("per_rank", [False, True])
def test_round_trip_particles(tmp_path, per_rank: bool) -> None:
    part = _particles()
    path = str(tmp_path / "part.h5")
    files = sx.io.write(path, part, per_rank=per_rank)
    assert files[0] == path and all(os.path.exists(f) for f in files)
    assert len(files) == (2 if per_rank else 1)
    back = sx.io.read(path, like=part)
    assert isinstance(back, Particles)
    for name in ("pos", "num", "mass", "vel", "ids"):
        np.testing.assert_array_equal(getattr(back, name), np.asarray(getattr(part, name)), err_msg=name)
    flat = sx.io.read(path)
    assert set(flat) == {"pos", "num", "mass", "vel", "ids"}
    assert not [f for f in os.listdir(tmp_path) if f.endswith(".partial")]


def test_round_trip_nested_tree_and_catalogue(tmp_path) -> None:
    cat = Catalogue(num=jnp.int32(2), count=jnp.array([5, 3], jnp.int32), mass=jnp.array([5.0, 3.0]),
                    com=jnp.ones((2, 3)), vel=jnp.zeros((2, 3)), radius=jnp.array([0.1, 0.2]),
                    label=jnp.array([0, 7], jnp.int32))
    tree = {"catalogue": cat, "meta": {"box": np.float64(2.5), "step": np.arange(3)}}
    path = tmp_path / "tree.h5"
    sx.io.write(path, tree)
    back = sx.io.read(path, like=tree)
    assert isinstance(back["catalogue"], Catalogue)
    np.testing.assert_array_equal(back["catalogue"].label, [0, 7])
    assert float(back["meta"]["box"]) == 2.5
    nested = sx.io.read(path)
    np.testing.assert_array_equal(nested["catalogue"]["radius"], np.asarray(cat.radius))
    assert back["catalogue"].to_numpy()["count"].tolist() == [5, 3]


def test_incomplete_truncated_and_mismatched_files(tmp_path) -> None:
    part = _particles((2,))
    good = str(tmp_path / "good.h5")
    sx.io.write(good, part)
    data = (tmp_path / "good.h5").read_bytes()
    truncated = tmp_path / "truncated.h5"
    truncated.write_bytes(data[: len(data) // 3])
    with pytest.raises(ValueError, match="truncated or corrupt"):
        sx.io.read(truncated)
    garbage = tmp_path / "garbage.h5"
    garbage.write_bytes(b"not an hdf5 file at all" * 10)
    with pytest.raises(ValueError, match="truncated or corrupt"):
        sx.io.read(garbage)
    # A write that stopped midway: the complete flag was never set.
    unfinished = str(tmp_path / "unfinished.h5")
    with h5py.File(unfinished, "w") as f:
        f.attrs["format"] = "shardax-pytree-1"
        f.attrs["shardax_complete"] = False
        f.create_dataset("pos", data=np.zeros((2, 3)))
    with pytest.raises(ValueError, match="incomplete"):
        sx.io.read(unfinished)
    with h5py.File(tmp_path / "foreign.h5", "w") as f:
        f.create_dataset("x", data=np.zeros(3))
    with pytest.raises(ValueError, match="not written by shardax"):
        sx.io.read(tmp_path / "foreign.h5")
    with pytest.raises(ValueError, match="does not match the structure"):
        sx.io.read(good, like={"pos": 1})
    with pytest.raises(FileNotFoundError):
        sx.io.read(tmp_path / "missing.h5")
    # Per-rank: a missing rank file is an error, not a silently short array.
    ranked = str(tmp_path / "ranked.h5")
    files = sx.io.write(ranked, part, per_rank=True)
    os.remove(files[1])
    with pytest.raises(ValueError, match="missing"):
        sx.io.read(ranked)


def test_failed_write_leaves_no_complete_file(tmp_path) -> None:
    class Boom:
        def __array__(self, dtype=None, copy=None):
            raise RuntimeError("disk full")

        shape = (3,)
        dtype = np.dtype(np.float32)

    path = tmp_path / "out.h5"
    with pytest.raises(ValueError, match="no array leaves"):
        sx.io.write(path, {})
    with pytest.raises(RuntimeError, match="disk full"):
        sx.io.write(path, {"a": np.arange(3.0), "z": Boom()})
    assert not path.exists() and not os.listdir(tmp_path)


def test_snapshot_round_trip_and_slices(tmp_path) -> None:
    rng = np.random.default_rng(9)
    pos = rng.random((300, 3)) * 50.0
    vel = rng.standard_normal((300, 3))
    path = tmp_path / "snap.hdf5"
    sx.io.write_snapshot(path, pos, box=50.0, vel=vel, mass=0.25)
    snap = sx.io.read_snapshot(path, mesh=make_mesh((4,)))
    assert snap.total == 300 and snap.start == 0
    np.testing.assert_array_equal(snap.box, [50.0, 50.0, 50.0])
    flat = sx.particles.squeeze(snap.part)
    np.testing.assert_allclose(flat["pos"], pos.astype(np.float32))
    np.testing.assert_allclose(flat["vel"], vel.astype(np.float32))
    np.testing.assert_array_equal(flat["ids"], np.arange(300))
    np.testing.assert_allclose(flat["mass"], 0.25)
    np.testing.assert_array_equal(snap.particle_ids, np.arange(1, 301))


def test_write_snapshot_enforces_its_contract(tmp_path) -> None:
    """Coordinates in [0, box) (drifted ones wrapped), float32/float64, no NaN: a box that does not match the data
    is an error, not a file that lies."""
    path = tmp_path / "snap.hdf5"
    pos = np.random.default_rng(1).random((50, 3)) * 420.0
    with pytest.raises(ValueError, match=r"periodic box 210.0: on axis \d they span \[.*\] \(extent"):
        sx.io.write_snapshot(path, pos, box=210.0)
    bad = pos.copy()
    bad[3, 0] = np.nan
    with pytest.raises(ValueError, match="1 row.* NaN or infinite coordinates .first: row 3"):
        sx.io.write_snapshot(path, bad, box=420.0)
    with pytest.raises(TypeError, match="float32 or float64.*float16"):
        sx.io.write_snapshot(path, pos.astype(np.float16), box=420.0)
    with pytest.raises(TypeError, match="int64"):
        sx.io.write_snapshot(path, pos.astype(np.int64), box=420.0)
    for box in (0.0, -1.0, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="box must be a positive finite number"):
            sx.io.write_snapshot(path, pos, box=box)
    drifted = pos.copy()
    drifted[0] = [-1.0, 420.5, 419.999999999]  # a little outside: written wrapped into [0, 420)
    sx.io.write_snapshot(path, drifted, box=420.0)
    with h5py.File(path, "r") as f:
        coords = f["PartType1/Coordinates"][...]
    assert coords.dtype == np.float32 and np.all((coords >= 0) & (coords < 420.0))
    np.testing.assert_allclose(coords[0], [419.0, 0.5, 0.0], atol=1e-4)
    sx.io.write_snapshot(path, np.zeros((0, 3)), box=1.0)
    assert sx.io.read_snapshot(path).total == 0


def test_bad_snapshots(tmp_path) -> None:
    with pytest.raises(FileNotFoundError):
        sx.io.read_snapshot(tmp_path / "none.hdf5")
    no_header = tmp_path / "no_header.hdf5"
    with h5py.File(no_header, "w") as f:
        f.create_dataset("PartType1/Coordinates", data=np.zeros((4, 3)))
    with pytest.raises(ValueError, match="BoxSize"):
        sx.io.read_snapshot(no_header)
    wrong = tmp_path / "wrong.hdf5"
    sx.io.write_snapshot(wrong, np.zeros((4, 3)), box=1.0)
    with h5py.File(wrong, "r+") as f:
        del f["PartType1/Velocities"]
        f.create_dataset("PartType1/Velocities", data=np.zeros((3, 3)))
    with pytest.raises(ValueError, match="Velocities must have shape"):
        sx.io.read_snapshot(wrong)
    flat = tmp_path / "flat.hdf5"
    sx.io.write_snapshot(flat, np.zeros((4, 3)), box=1.0)
    with h5py.File(flat, "r+") as f:
        del f["PartType1/Coordinates"]
        f.create_dataset("PartType1/Coordinates", data=np.zeros((4, 2)))
    with pytest.raises(ValueError, match=r"shape \(N, 3\)"):
        sx.io.read_snapshot(flat)
    nan = tmp_path / "nan.hdf5"
    sx.io.write_snapshot(nan, np.zeros((4, 3)), box=1.0)
    with h5py.File(nan, "r+") as f:
        f["PartType1/Coordinates"][1] = np.nan
    with pytest.raises(ValueError, match="NaN"):
        sx.io.read_snapshot(nan)
    other_box = tmp_path / "other_box.hdf5"  # a catalogue in a 420 box labelled 210
    sx.io.write_snapshot(other_box, np.random.default_rng(0).random((40, 3)) * 210.0, box=210.0)
    with h5py.File(other_box, "r+") as f:
        f["PartType1/Coordinates"][...] = 2 * f["PartType1/Coordinates"][...]
    with pytest.raises(ValueError, match=r"do not fit the periodic box \(210.0, 210.0, 210.0\)"):
        sx.io.read_snapshot(other_box)
    cut = tmp_path / "cut.hdf5"
    sx.io.write_snapshot(cut, np.zeros((2000, 3)), box=1.0)
    data = cut.read_bytes()
    cut.write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match="truncated or corrupt"):
        sx.io.read_snapshot(cut)


def fof_table_reference(data: dict, min_members: int) -> dict[str, np.ndarray]:
    """What a group catalogue of ``data`` must hold, from SciPy's connected components on all the particles."""
    labels = reference.fof_labels(data["pos"], data["linking_length"], box=data["box"], min_members=min_members)
    cat = reference.fof_catalogue(data["pos"], labels, mass=data["mass"], vel=data["vel"], box=data["box"])
    members = np.flatnonzero(labels >= 0)
    members = members[np.lexsort((members, labels[members]))]
    return {"GroupLen": cat["count"], "GroupMass": cat["mass"], "GroupPos": cat["com"], "GroupVel": cat["vel"],
            "spanning": cat["spanning"], "IDs": members}


def check_fof_table(table: dict, want: dict) -> None:
    group = table["Group"]
    np.testing.assert_array_equal(group["GroupLen"], want["GroupLen"])
    np.testing.assert_array_equal(table["IDs"], want["IDs"])
    np.testing.assert_array_equal(group["GroupOffsetType"][:, 1], np.cumsum(want["GroupLen"]) - want["GroupLen"])
    np.testing.assert_array_equal(group["GroupLenType"][:, 1], want["GroupLen"])
    assert not group["GroupLenType"][:, [0, 2, 3, 4, 5]].any()
    compact = ~want["spanning"].astype(bool)
    for name in ("GroupMass", "GroupPos", "GroupVel"):
        np.testing.assert_allclose(group[name][compact], want[name][compact], rtol=1e-5, atol=1e-5, err_msg=name)
    header = table["Header"]
    assert int(header["Ngroups_Total"]) == len(want["GroupLen"]) and int(header["Nids_Total"]) == len(want["IDs"])


def assert_same_table(a: dict, b: dict) -> None:
    assert set(a["Header"]) == set(b["Header"])
    for key in a["Header"]:
        np.testing.assert_array_equal(a["Header"][key], b["Header"][key], err_msg=key)
    for name in a["Group"]:
        np.testing.assert_array_equal(a["Group"][name], b["Group"][name], err_msg=name)
    np.testing.assert_array_equal(a["IDs"], b["IDs"])


def test_fof_table_is_scipy_and_the_same_file_at_every_scale(tmp_path) -> None:
    """Gadget-4 layout; one device, 8 devices and the local view give the same content (floats included); the
    per-rank set of one process is the same table; h5py reads it back as docs/fof.md shows."""
    data = mixed_periodic()
    want = fof_table_reference(data, 5)
    assert len(want["GroupLen"]) > 3
    tables = []
    for shape in ((1,), (8,)):
        part = sx.particles.from_numpy(data["pos"], mesh=make_mesh(shape), vel=data["vel"], mass=data["mass"])
        res = sx.spatial.fof.smap(mesh=make_mesh(shape))(part, data["linking_length"], box=1.0, min_members=5)
        path = tmp_path / f"fof_tab_{len(tables):03d}.hdf5"
        assert sx.io.write_fof_table(path, res, part, box=1.0, redshift=1.5,
                                     parameters={"LinkingLength": 0.02}) == [str(path)]
        tables.append(sx.io.read_fof_table(path))
        ranked = sx.io.write_fof_table(tmp_path / "ranked.hdf5", res.labels, part, box=1.0, redshift=1.5,
                                       per_rank=True)
        assert ranked == [str(tmp_path / "ranked.0.hdf5")]
        assert_same_table(sx.io.read_fof_table(tmp_path / "ranked.hdf5"), tables[-1])
    local = Particles(pos=jnp.asarray(data["pos"]), num=jnp.int32(len(data["pos"])),
                      ids=jnp.arange(len(data["pos"]), dtype=jnp.int32), vel=jnp.asarray(data["vel"]),
                      mass=jnp.asarray(data["mass"]))
    res = sx.spatial.fof(local, data["linking_length"], box=1.0, min_members=5)
    sx.io.write_fof_table(tmp_path / "local.hdf5", res, local, box=1.0, redshift=1.5)
    assert_same_table(sx.io.read_fof_table(tmp_path / "local.hdf5"), tables[0])
    for table in tables:
        check_fof_table(table, want)
        assert_same_table(table, tables[0])
        assert table["Parameters"]["LinkingLength"] == 0.02
    with h5py.File(tmp_path / "fof_tab_000.hdf5", "r") as f:
        header = dict(f["Header"].attrs)
        sizes, offsets, ids = f["Group/GroupLen"][:], f["Group/GroupOffsetType"][:, 1], f["IDs/ID"][:]
    assert header["NumFiles"] == 1 and header["BoxSize"] == 1.0 and header["Redshift"] == 1.5
    assert header["Time"] == pytest.approx(0.4) and header["Nsubhalos_Total"] == 0
    first = ids[offsets[0]: offsets[0] + sizes[0]]
    np.testing.assert_array_equal(first, want["IDs"][: want["GroupLen"][0]])


def test_fof_table_ids_and_bad_arguments(tmp_path) -> None:
    data = mixed_periodic()
    part = sx.particles.from_numpy(data["pos"], mesh=make_mesh((2,)))
    res = sx.spatial.fof.smap(mesh=make_mesh((2,)))(part, data["linking_length"], box=1.0, min_members=5)
    snapshot_ids = 1000 + 3 * np.arange(len(data["pos"]), dtype=np.uint64)
    sx.io.write_fof_table(tmp_path / "ids.hdf5", res, part, box=1.0, particle_ids=snapshot_ids)
    table = sx.io.read_fof_table(tmp_path / "ids.hdf5")
    np.testing.assert_array_equal(table["IDs"], snapshot_ids[fof_table_reference(data, 5)["IDs"]])
    np.testing.assert_array_equal(table["Group"]["GroupMass"], table["Group"]["GroupLen"])  # no masses: 1 each
    with pytest.raises(TypeError, match="per_rank must be a bool"):
        sx.io.write_fof_table(tmp_path / "x.hdf5", res, part, box=1.0, per_rank="yes")
    with pytest.raises(ValueError, match="box must be None"):
        sx.io.write_fof_table(tmp_path / "x.hdf5", res, part, box=-1.0)
    with pytest.raises(ValueError, match="redshift must be"):
        sx.io.write_fof_table(tmp_path / "x.hdf5", res, part, box=1.0, redshift=-2.0)
    with pytest.raises(ValueError, match="part_type must be"):
        sx.io.write_fof_table(tmp_path / "x.hdf5", res, part, box=1.0, part_type=6)
    with pytest.raises(ValueError, match="particle_ids has 3 entries"):
        sx.io.write_fof_table(tmp_path / "x.hdf5", res, part, box=1.0, particle_ids=np.arange(3))
    with pytest.raises(ValueError, match="part has no `ids`"):
        sx.io.write_fof_table(tmp_path / "x.hdf5", res, Particles(pos=part.pos, num=part.num), box=1.0)
    with pytest.raises(FileNotFoundError):
        sx.io.read_fof_table(tmp_path / "none.hdf5")
    assert not list(tmp_path.glob("x*"))


def test_fof_table_refuses_fields_split_unlike_the_labels(monkeypatch) -> None:
    """On several processes each field is read by device block: a field split otherwise is named in the error."""
    from shardax.io import _fof_table

    blocks = {"label": {0: np.zeros((1, 4), np.int32)}, "num": {0: np.array([4])}, "pos": {0: np.zeros((1, 4, 3))},
              "ids": {0: np.zeros((1, 4), np.int32)}, "mass": {2: np.ones((1, 4))}}
    values = iter(blocks.values())
    monkeypatch.setattr(_fof_table, "_blocks", lambda x: next(values))
    part = Particles(pos=jnp.zeros((1, 4, 3)), num=jnp.array([4]), ids=jnp.zeros((1, 4), jnp.int32),
                     mass=jnp.ones((1, 4)))
    with pytest.raises(ValueError, match=r"part.mass is not split over the devices like the labels"):
        _fof_table._local_members(jnp.zeros((1, 4), jnp.int32), part)
