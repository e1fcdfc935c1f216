"""Friends-of-friends against cKDTree.query_pairs + connected_components, at 1 device and on meshes of 8 CPU devices.

The third scale (2 processes x 4 devices) is in tests/test_fof_multiprocess.py, which also holds the data sets and
the SciPy references used here.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh

import shardax as sx
from conftest import collectives_ordered, make_mesh
from shardax.particles import Particles
from shardax.spatial._fof import fof, fof_steps
from shardax.spatial._fof_local import piece_space
from shardax.spatial._fof_tuning import GPU_TUNING, PRESETS, Tuning, resolve
from shardax.testing import reference
from test_fof_multiprocess import (
    MIN_MEMBERS,
    compare_catalogues,
    dense_boundaries,
    labels_by_input_index,
    mixed_periodic,
    uniform_open_2d,
)
from test_zsort import layout


def _local(data: dict, **kw) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """The local view on one device, outside any mesh."""
    pos = data["pos"]
    part = Particles(pos=jnp.asarray(pos), num=jnp.int32(len(pos)),
                     mass=None if data["mass"] is None else jnp.asarray(data["mass"]),
                     vel=None if data["vel"] is None else jnp.asarray(data["vel"]))
    res = fof(part, data["linking_length"], box=data["box"], **kw)
    assert not bool(res.overflow)
    return np.asarray(res.labels), res.catalogue.to_numpy()


def _global(data: dict, shape: tuple[int, ...], **kw) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    mesh = make_mesh(shape)
    fields = {k: data[k] for k in ("mass", "vel") if data[k] is not None}
    part = sx.particles.from_numpy(data["pos"], mesh=mesh, **fields)
    res = fof.smap(mesh)(part, data["linking_length"], box=data["box"], **kw)
    labels = labels_by_input_index(np.asarray(res.labels), np.asarray(part.ids), np.asarray(part.num),
                                   len(data["pos"]))
    return labels, res.catalogue.to_numpy()


@pytest.fixture(scope="module")
def mixed() -> tuple[dict, np.ndarray, dict[str, np.ndarray]]:
    data = mixed_periodic()
    want = reference.fof_labels(data["pos"], data["linking_length"], box=data["box"], min_members=MIN_MEMBERS)
    return data, want, reference.fof_catalogue(data["pos"], want, mass=data["mass"], vel=data["vel"], box=data["box"])


def test_mixed_periodic_one_device(mixed) -> None:
    data, want, cat = mixed
    labels, got = _local(data, min_members=MIN_MEMBERS)
    np.testing.assert_array_equal(labels, want)
    compare_catalogues(got, cat)
    # The data exercise what they are meant to: blobs, the box-crossing blob and the filament are groups.
    counts = np.bincount(want[want >= 0])
    assert (counts >= 75).sum() >= 5 and (counts >= 40).sum() >= 6
    corner = np.flatnonzero(np.all(np.minimum(data["pos"], 1 - data["pos"]) < 0.02, axis=1))
    assert len(np.unique(want[corner])) == 1 and want[corner[0]] >= 0


def test_mixed_periodic_meshes(mixed, mesh) -> None:
    data, want, cat = mixed
    with collectives_ordered():  # (a program read back from a compilation cache may then run as compiled)
        labels, got = _global(data, mesh.devices.shape, min_members=MIN_MEMBERS)
    np.testing.assert_array_equal(labels, want)
    compare_catalogues(got, cat)


@pytest.mark.parametrize("shape", [(), (8,)], ids=["local", "8"])
def test_labels_only(mixed, shape: tuple[int, ...]) -> None:
    """``catalogue=False``: the same labels as SciPy (and as with the catalogue) and no catalogue, in the local view
    and on 8 devices, where the mixed data's groups cross devices and the box edge (2 processes x 4 devices:
    tests/test_fof_multiprocess.py)."""
    data, want, _ = mixed
    if shape:
        mesh = make_mesh(shape)
        fields = {k: data[k] for k in ("mass", "vel") if data[k] is not None}
        part = sx.particles.from_numpy(data["pos"], mesh=mesh, **fields)
        with collectives_ordered():
            res = fof.smap(mesh)(part, data["linking_length"], box=data["box"], min_members=MIN_MEMBERS,
                                 catalogue=False)
        labels = labels_by_input_index(np.asarray(res.labels), np.asarray(part.ids), np.asarray(part.num),
                                       len(data["pos"]))
    else:
        part = Particles(pos=jnp.asarray(data["pos"]), num=jnp.int32(len(data["pos"])),
                         mass=jnp.asarray(data["mass"]), vel=jnp.asarray(data["vel"]))
        res = fof(part, data["linking_length"], box=data["box"], min_members=MIN_MEMBERS, catalogue=False)
        assert not bool(res.overflow)
        labels = np.asarray(res.labels)
    assert res.catalogue is None
    np.testing.assert_array_equal(labels, want)
    # Nothing was summed into a catalogue, so no catalogue row was needed.
    assert int(np.max(np.asarray(res.needed).reshape(-1, 4)[:, 2])) == 0


def test_labels_only_dense_boundaries_on_eight_devices() -> None:
    """Labels only, with most groups crossing devices (the ghost buffer grows): group sizes summed across devices
    from the pieces' counts decide membership exactly as SciPy's."""
    data = dense_boundaries()
    want = reference.fof_labels(data["pos"], data["linking_length"], box=data["box"], min_members=MIN_MEMBERS)
    mesh = make_mesh((8,))
    part = sx.particles.from_numpy(data["pos"], mesh=mesh)
    res = fof.smap(mesh)(part, data["linking_length"], box=data["box"], min_members=MIN_MEMBERS, catalogue=False)
    labels = labels_by_input_index(np.asarray(res.labels), np.asarray(part.ids), np.asarray(part.num),
                                   len(data["pos"]))
    np.testing.assert_array_equal(labels, want)
    assert res.catalogue is None and len(np.unique(want[want >= 0])) > 10


@pytest.mark.parametrize("shape", [(), (8,)], ids=["local", "8"])
def test_gpu_preset_on_cpu(mixed, shape: tuple[int, ...]) -> None:
    """The GPU preset forced on CPU (comparison sort and a cell table from its keys, runs recomputed per step, steps
    of half the rows): the same labels and catalogue as SciPy and the CPU preset, in the local view and on 8
    devices."""
    data, want, cat = mixed
    for tuning in ("gpu", GPU_TUNING, "cpu"):
        labels, got = _local(data, min_members=MIN_MEMBERS, tuning=tuning) if not shape else \
            _global(data, shape, min_members=MIN_MEMBERS, tuning=tuning)
        np.testing.assert_array_equal(labels, want)
        compare_catalogues(got, cat)
        if shape:
            break


def test_tuning_argument() -> None:
    """``tuning``: None takes the backend's preset (``SHARDAX_TUNING`` overrides), a name takes that preset, a
    ``FofTuning`` is used as given; anything else is an error naming the choices."""
    assert sx.spatial.FofTuning is Tuning and resolve(None) is PRESETS["cpu"] and resolve("gpu") is GPU_TUNING
    mine = Tuning(slots=128)
    assert resolve(mine) is mine
    part = Particles(pos=jnp.zeros((8, 3)), num=jnp.int32(8))
    with pytest.raises(ValueError, match="'cpu', 'gpu'"):
        fof(part, 0.1, tuning="tpu")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="FofTuning|Tuning"):
        fof(part, 0.1, tuning=3)  # type: ignore[arg-type]


def test_tuning_from_environment(monkeypatch) -> None:
    monkeypatch.setenv("SHARDAX_TUNING", "gpu")
    assert resolve(None) is GPU_TUNING


def test_gpu_preset_steps_at_a_million() -> None:
    """The GPU preset's loops: 1e6 uniform points, b = 0.2, periodic unit box. The link search takes at most 16
    sequential steps (each costs a fixed fraction of a millisecond on a GPU) and the components a few passes of one
    hooking step each; the CPU preset's small steps take several times more. Labels agree with SciPy."""
    n = 1_000_000
    pos = np.random.default_rng(0).random((n, 3)).astype(np.float32)
    part = Particles(pos=jnp.asarray(pos), num=jnp.int32(n))
    ll = 0.2 / n ** (1 / 3)
    steps, res = fof_steps(part, ll, box=1.0, min_members=2, tuning="gpu")
    assert steps["links"] <= 16, steps
    assert steps["sort"] == 0 and steps["hooks"] == steps["sweeps"] <= 4 and steps["jumps"] <= 8, steps
    np.testing.assert_array_equal(np.asarray(res.labels), reference.fof_labels(pos, ll, box=1.0, min_members=2))


def test_gpu_preset_memory_per_particle() -> None:
    """The GPU preset's compiled temporaries, read from XLA's memory analysis (the device's memory per particle
    beyond the positions and labels bounds how many particles a GPU holds): 1e6 uniform points, b = 0.2, compiled
    with XLA's defaults. The catalogue sums run over its rows (not one per particle), the edge list holds 3 pairs
    per point, the candidate runs of a step are read a row of cells at a time, and the buffers of the labels wait
    for the components: 147 bytes per particle at 1e6 points."""
    from conftest import USER_COMPILER_OPTIONS

    n = 1_000_000
    pos = jnp.asarray(np.random.default_rng(0).random((n, 3)).astype(np.float32))
    fn = jax.jit(lambda p: fof(p, 0.2 / n ** (1 / 3), box=1.0, min_members=20, tuning="gpu"))
    stats = fn.lower(pos).compile(compiler_options=USER_COMPILER_OPTIONS).memory_analysis()
    assert stats is not None
    per_particle = stats.temp_size_in_bytes / n
    assert per_particle <= 160, f"{per_particle:.0f} bytes of temporaries per particle"


def test_open_2d() -> None:
    data = uniform_open_2d()
    want = reference.fof_labels(data["pos"], data["linking_length"], box=None, min_members=3)
    cat = reference.fof_catalogue(data["pos"], want)
    assert len(cat["label"]) > 20
    for labels, got in (_local(data, min_members=3), _global(data, (8,), min_members=3)):
        np.testing.assert_array_equal(labels, want)
        compare_catalogues(got, cat)
        np.testing.assert_array_equal(got["mass"], got["count"].astype(np.float32))


def test_blob_membership_and_min_members() -> None:
    """Well separated blobs are exactly the groups; every other particle is unlabelled."""
    rng = np.random.default_rng(7)
    centres = rng.random((6, 3)) * 0.8 + 0.1
    centres[:, 0] = np.linspace(0.1, 0.9, 6)
    sizes = [30, 12, 25, 8, 40, 19]
    pos = np.concatenate([c + 0.002 * rng.standard_normal((s, 3)) for c, s in zip(centres, sizes, strict=True)])
    member = np.repeat(np.arange(6), sizes)
    order = rng.permutation(len(pos))
    pos, member = pos[order].astype(np.float32), member[order]
    data = {"pos": pos, "vel": None, "mass": None, "linking_length": 0.03, "box": None}
    for labels, got in (_local(data, min_members=10), _global(data, (2, 4), min_members=10)):
        for blob, size in enumerate(sizes):
            mine = labels[member == blob]
            expect = np.flatnonzero(member == blob).min() if size >= 10 else -1
            np.testing.assert_array_equal(mine, expect)
        np.testing.assert_array_equal(np.sort(got["count"]), sorted(s for s in sizes if s >= 10))


def test_degenerate_giant_and_empty() -> None:
    rng = np.random.default_rng(3)
    giant = {"pos": rng.random((600, 3)).astype(np.float32), "vel": None, "mass": None,
             "linking_length": 0.2, "box": None}
    lonely = {"pos": (np.arange(300)[:, None] * np.array([[0.01, 0.0, 0.0]])).astype(np.float32), "vel": None,
              "mass": None, "linking_length": 0.005, "box": None}
    for data, minimum in ((giant, 20), (lonely, 2)):
        want = reference.fof_labels(data["pos"], data["linking_length"], box=None, min_members=minimum)
        for labels, got in (_local(data, min_members=minimum, edge_capacity=60000),
                            _global(data, (8,), min_members=minimum, edge_capacity=60000)):
            np.testing.assert_array_equal(labels, want)
            compare_catalogues(got, reference.fof_catalogue(data["pos"], want))
    assert (reference.fof_labels(giant["pos"], 0.2, box=None, min_members=20) == 0).all()
    assert (reference.fof_labels(lonely["pos"], 0.005, box=None, min_members=2) == -1).all()
    # No particles at all (one padding row per device): no group, every label -1. (At 2 x 4 the mixed scenario's
    # program runs on rows that are all padding: tests/test_fof_multiprocess.py.)
    mesh = make_mesh((8,))
    empty = sx.particles.from_numpy(np.zeros((0, 3), np.float32), mesh=mesh)
    res = fof.smap(mesh)(empty, 0.1, box=1.0, min_members=1)
    assert np.all(np.asarray(res.labels) == -1) and int(np.asarray(res.catalogue.num).sum()) == 0


@pytest.mark.parametrize("shape", [(8,), (2, 4)], ids=["8", "2x4"])
def test_without_ids_rows_are_numbered_in_device_order(shape: tuple[int, ...]) -> None:
    """Particles without ``ids`` on several devices: rows are numbered in global (device, row) order, and the labels
    go home along the sort's routes. Labels and catalogue equal the reference's, and those of the same rows given
    that numbering as ``ids``; uneven counts and an empty device."""
    mesh = make_mesh(shape)
    pos = np.random.default_rng(21).random((700, 3)).astype(np.float32)
    counts = np.array([150, 0, 90, 110, 60, 120, 100, 70], np.int32)
    laid = layout(mesh, pos, counts, 160)  # ids: the input index, consecutive rows per device
    want = reference.fof_labels(pos, 0.06, box=1.0, min_members=3)
    for part in (Particles(pos=laid.pos, num=laid.num), Particles(pos=laid.pos, num=laid.num, ids=laid.ids)):
        res = fof.smap(mesh)(part, 0.06, box=1.0, min_members=3)
        got = labels_by_input_index(np.asarray(res.labels), np.asarray(laid.ids), counts, len(pos))
        np.testing.assert_array_equal(got, want)
        compare_catalogues(res.catalogue.to_numpy(), reference.fof_catalogue(pos, want, box=1.0))
    assert len(np.unique(want[want >= 0])) > 3


@pytest.mark.parametrize("case", ["two_cells", "three_cells", "clump_capped_grid", "open_2d_clump", "periodic_2d"])
def test_search_corner_cases(case: str) -> None:
    """Small steps of the pair search against the reference: periodic axes of 2 and 3 cells (wrapped runs), a
    point with more candidates than one step, a grid capped by its cell table, more edges than one hooking chunk."""
    rng = np.random.default_rng(13 if case in ("two_cells", "three_cells") else 11)
    tiny = Tuning(slots=64, edge_chunk=16)
    gpu_shaped = tiny._replace(rank_rounds=0, run_table=False)  # the GPU preset's algorithms, small steps
    box: float | None = 1.0
    if case in ("two_cells", "three_cells"):
        # Few points, cells as wide as the linking length: 2 or 3 cells per axis.
        pos = rng.random((12, 3) if case == "two_cells" else (25, 3))
        ll, tuning = (0.4 if case == "two_cells" else 0.3), tiny
    elif case == "clump_capped_grid":
        pos = np.concatenate([0.5 + 1e-4 * rng.standard_normal((150, 3)), rng.random((300, 3))])
        ll, tuning = 0.05, tiny._replace(table=0.02)
    elif case == "open_2d_clump":
        pos = np.concatenate([0.2 + 1e-3 * rng.standard_normal((120, 2)), rng.random((400, 2))])
        ll, tuning, box = 0.03, tiny, None
    else:
        pos = rng.random((500, 2))
        ll, tuning = 0.04, tiny
    pos = pos[rng.permutation(len(pos))].astype(np.float32)
    data = {"pos": pos, "vel": None, "mass": None, "linking_length": ll, "box": box}
    want = reference.fof_labels(pos, ll, box=box, min_members=2)
    for steps in (tuning, gpu_shaped._replace(table=tuning.table)):
        labels, got = _local(data, min_members=2, tuning=steps, edge_capacity=40000)
        np.testing.assert_array_equal(labels, want)
        compare_catalogues(got, reference.fof_catalogue(pos, want, box=box))
    groups = np.bincount(want[want >= 0])
    assert (groups >= 100).any() == (case in ("clump_capped_grid", "open_2d_clump"))
    assert (groups >= 2).sum() >= 2 or (want == -1).any()


def test_open_extreme_coordinates_with_padding() -> None:
    """Coordinates of both signs near the float32 maximum, with padding rows: the bounding box's span overflowed
    to inf, the link grid got no cells, and valid points fell into the padding bucket (labelled as one group)."""
    big = np.finfo(np.float32).max
    values = np.array([-big, -big / 2, -1.0, 0.0, 0.01, 1.0, big / 3, big], np.float32)
    for seed, num in ((0, 2), (1, 9), (2, 16)):
        rng = np.random.default_rng(seed)
        pos = rng.choice(values, (16, 3)).astype(np.float32)
        if num > 2:
            pos[num - 1] = pos[0] + np.float32(0.01)  # one group, the other points alone
        pos[num:] = 0.0
        res = fof(Particles(pos=jnp.asarray(pos), num=jnp.int32(num)), 0.05, min_members=2)
        want = reference.fof_labels(pos[:num], 0.05, box=None, min_members=2)
        np.testing.assert_array_equal(np.asarray(res.labels)[:num], want)
        assert (want == -1).any() and (want >= 0).any() == (num > 2)


def test_all_duplicates() -> None:
    pos = np.full((64, 3), 0.25, np.float32)
    data = {"pos": pos, "vel": None, "mass": None, "linking_length": 0.01, "box": 1.0}
    labels, got = _global(data, (4,), min_members=2, edge_capacity=4096)
    np.testing.assert_array_equal(labels, 0)
    assert got["count"].tolist() == [64] and got["radius"][0] == 0
    np.testing.assert_allclose(got["com"][0], 0.25)


def test_plain_array_is_particles_without_fields() -> None:
    """A plain position array works wherever particles without fields do: every row is a particle, labels number
    the rows (in global (device, row) order on several devices). Local view on one device, and on 8 devices through
    ``fof.smap`` (whose mapped function calls the local view on each device's ``(n, d)`` block)."""
    data = mixed_periodic()
    pos = data["pos"][:1600]
    want = reference.fof_labels(pos, data["linking_length"], box=data["box"], min_members=MIN_MEMBERS)
    assert len(np.unique(want[want >= 0])) > 3
    res = fof(jnp.asarray(pos), data["linking_length"], box=data["box"], min_members=MIN_MEMBERS)
    np.testing.assert_array_equal(np.asarray(res.labels), want)
    as_particles = fof(Particles(pos=jnp.asarray(pos), num=jnp.int32(len(pos))), data["linking_length"],
                       box=data["box"], min_members=MIN_MEMBERS)
    np.testing.assert_array_equal(np.asarray(res.labels), np.asarray(as_particles.labels))
    np.testing.assert_array_equal(np.asarray(fof(pos, data["linking_length"], box=data["box"],
                                                 min_members=MIN_MEMBERS).labels), want)  # a NumPy array too
    mesh = make_mesh((8,))
    # Every row is a particle, so the sort needs room beyond 200 rows on some device: given here (the automatic
    # growth, which would compile a second program, is tested on its own below).
    res = fof.smap(mesh)(jnp.asarray(pos.reshape(8, 200, 3)), data["linking_length"], box=data["box"],
                         min_members=MIN_MEMBERS, sort_capacity=400)
    np.testing.assert_array_equal(np.asarray(res.labels).reshape(-1), want)
    compare_catalogues(res.catalogue.to_numpy(), reference.fof_catalogue(pos, want, box=data["box"]))


def test_bad_plain_array() -> None:
    """Errors for a plain array name ``part`` and say what to pass."""
    with pytest.raises(ValueError, match=r"part as a plain array must have shape \(n, 2\) or \(n, 3\)"):
        fof(jnp.zeros((8, 4)), 0.1)
    with pytest.raises(ValueError, match="part as a plain array .* fof.smap"):
        fof(jnp.zeros((2, 8, 3)), 0.1)
    with pytest.raises(TypeError, match="part must hold float32 or float64 positions"):
        fof(jnp.zeros((8, 3), jnp.int32), 0.1)
    with pytest.raises(TypeError, match="part must be a particle pytree .* or an \\(n, d\\) array"):
        fof([[0.0, 0.0, 0.0]] * 8, 0.1)
    with pytest.raises(ValueError, match=r"fof.smap: part as a plain array must have shape \(ndev, n, d\).*call fof\(\)"):
        fof.smap(make_mesh((2,)))(jnp.zeros((8, 3)), 0.1)
    with pytest.raises(TypeError, match=r"fof.smap: part must be a global particle pytree .* or an \(ndev, n, d\)"):
        fof.smap(make_mesh((2,)))([[[0.0, 0.0, 0.0]]], 0.1)


def test_bad_input() -> None:
    part = Particles(pos=jnp.zeros((8, 3)), num=jnp.int32(8))
    with pytest.raises(ValueError, match="linking_length must be positive"):
        fof(part, 0.0)
    with pytest.raises(ValueError, match="linking_length must be positive"):
        fof(part, -1.0)
    with pytest.raises(ValueError, match="larger than half the periodic box"):
        fof(part, 0.6, box=1.0)
    with pytest.raises(ValueError, match="min_members"):
        fof(part, 0.1, min_members=0)
    with pytest.raises(ValueError, match="shape"):
        fof(Particles(pos=jnp.zeros((8, 4)), num=jnp.int32(8)), 0.1)
    with pytest.raises(TypeError, match="linking_length"):
        fof(part, jnp.ones(2))
    with pytest.raises(ValueError, match="box must be a scalar or have 3"):
        fof(part, 0.1, box=(1.0, 1.0))
    with pytest.raises(TypeError, match="fof: catalogue must be True or False"):
        fof(part, 0.1, catalogue="labels")
    nan = Particles(pos=jnp.zeros((8, 3)).at[3, 1].set(jnp.nan), num=jnp.int32(8))
    with pytest.raises(ValueError, match="NaN"):
        fof(nan, 0.1)
    mesh = make_mesh((2,))
    good = sx.particles.from_numpy(np.random.default_rng(0).random((40, 3)).astype(np.float32), mesh=mesh)
    bad = Particles(pos=good.pos.at[1, 2, 0].set(jnp.nan), num=good.num, ids=good.ids)
    with pytest.raises(ValueError, match="NaN"):
        fof.smap(mesh)(bad, 0.1)
    with pytest.raises(ValueError, match=r"fof.smap: part.pos must have shape \(ndev, n, d\)"):
        fof.smap(mesh)(part, 0.1)
    with pytest.raises(TypeError, match="fof.smap: catalogue must be True or False"):
        fof.smap(mesh)(good, 0.1, catalogue=None)


def test_capacity_error_names_the_argument() -> None:
    mesh = make_mesh((2,))
    pos = np.random.default_rng(1).random((400, 3)).astype(np.float32)
    part = sx.particles.from_numpy(pos, mesh=mesh)
    with pytest.raises(sx.CapacityError, match="edge_capacity") as err:
        fof.smap(mesh)(part, 0.3, min_members=2, edge_capacity=16)
    assert err.value.argument == "edge_capacity" and err.value.needed > 16
    res = fof.smap(mesh)(part, 0.3, min_members=2, edge_capacity=err.value.needed)
    want = reference.fof_labels(pos, 0.3, box=None, min_members=2)
    got = labels_by_input_index(np.asarray(res.labels), np.asarray(part.ids), np.asarray(part.num), len(pos))
    np.testing.assert_array_equal(got, want)


def test_halo_capacity_overflow_then_retry_on_eight_devices() -> None:
    """Too few ghost rows: an error naming halo_capacity with what a device needed; that size gives exact labels
    (with a linking length this large, particles near corners go to several devices)."""
    mesh = make_mesh((8,))
    pos = np.random.default_rng(5).random((4000, 3)).astype(np.float32)
    part = sx.particles.from_numpy(pos, mesh=mesh)
    with pytest.raises(sx.CapacityError, match="halo_capacity") as err:
        fof.smap(mesh)(part, 0.08, box=1.0, min_members=2, halo_capacity=16)
    assert err.value.argument == "halo_capacity" and err.value.needed > 16
    res = fof.smap(mesh)(part, 0.08, box=1.0, min_members=2, halo_capacity=err.value.needed)
    assert int(np.max(np.asarray(res.needed)[:, 1])) <= err.value.needed
    want = reference.fof_labels(pos, 0.08, box=1.0, min_members=2)
    got = labels_by_input_index(np.asarray(res.labels), np.asarray(part.ids), np.asarray(part.num), len(pos))
    np.testing.assert_array_equal(got, want)


def test_full_rows_and_sort_capacity_on_eight_devices() -> None:
    """Particles filling every row (capacity_factor 1): the sort's pieces differ from the share by a few percent, so
    fof.smap grows its rows after the sort by itself and the labels stay exact; a sort_capacity passed too small
    raises naming it."""
    mesh = make_mesh((8,))
    pos = np.random.default_rng(8).random((8000, 3)).astype(np.float32)
    part = sx.particles.from_numpy(pos, mesh=mesh, capacity_factor=1.0)
    assert part.pos.shape[1] == 1000
    res = fof.smap(mesh)(part, 0.05, box=1.0, min_members=2)
    want = reference.fof_labels(pos, 0.05, box=1.0, min_members=2)
    got = labels_by_input_index(np.asarray(res.labels), np.asarray(part.ids), np.asarray(part.num), len(pos))
    np.testing.assert_array_equal(got, want)
    with pytest.raises(sx.CapacityError, match="sort_capacity") as err:
        fof.smap(mesh)(part, 0.05, box=1.0, min_members=2, sort_capacity=900)
    assert err.value.argument == "sort_capacity" and err.value.needed > 900 and err.value.available == 900


def test_unset_buffers_grow_and_are_remembered_on_eight_devices(monkeypatch) -> None:
    """With ``halo_capacity`` unset, a device needing more ghost rows than the starting 1024 makes ``fof.smap`` run
    again with a larger buffer (exact labels, no error); the next call starts from the grown size (no further
    compilation). A given size is never grown (the test above)."""
    import shardax.spatial._fof_smap as fof_module

    data = dense_boundaries()
    pos = data["pos"]
    mesh = Mesh(make_mesh((8,)).devices, ("grow",))  # a mesh of its own: a fresh constructor and cache
    part = sx.particles.from_numpy(pos, mesh=mesh)
    built = []
    original = fof_module.smap
    monkeypatch.setattr(fof_module, "smap", lambda *a, **k: built.append(1) or original(*a, **k))
    res = fof.smap(mesh)(part, data["linking_length"], box=1.0, min_members=5)
    assert int(np.max(np.asarray(res.needed)[:, 1])) > 1024 and len(built) == 2
    want = reference.fof_labels(pos, data["linking_length"], box=1.0, min_members=5)
    got = labels_by_input_index(np.asarray(res.labels), np.asarray(part.ids), np.asarray(part.num), len(pos))
    np.testing.assert_array_equal(got, want)
    again = fof.smap(mesh)(part, data["linking_length"], box=1.0, min_members=5)
    assert len(built) == 2
    np.testing.assert_array_equal(np.asarray(again.labels), np.asarray(res.labels))


def test_piece_space_unwraps_a_piece_across_the_box_edge() -> None:
    """A piece touching both ends of the box on x is gridded open there (unwrapped), periodic on y (full span)."""
    rng = np.random.default_rng(11)
    pos = rng.random((400, 2)).astype(np.float32)
    pos[:, 0] = np.where(pos[:, 0] < 0.5, pos[:, 0] * 0.1, 1 - pos[:, 0] * 0.1)  # x in [0, .05) and (.9, .95]
    box = jnp.ones((2,), jnp.float32)
    valid = jnp.ones((400,), bool)
    lower = jnp.array([[0.95, 0.0], [0.0, 0.0]], jnp.float32)
    upper = jnp.array([[1.0, 1.0], [0.05, 1.0]], jnp.float32)
    space, grid_pos = piece_space(jnp.asarray(pos), valid, box, jnp.float32(0.01), lower, upper,
                                  jnp.ones((2,), bool))
    assert np.asarray(space.wrap).tolist() == [False, True]
    assert float(space.extent[0]) < 0.16  # not the whole box
    np.testing.assert_allclose(np.asarray(grid_pos)[:, 0] % 1.0, pos[:, 0], atol=1e-6)


def _wrapped_clusters(dim: int, seed: int) -> dict:
    """Clustered periodic data whose blobs and filaments cross the box faces (pieces that wrap on some axes)."""
    rng = np.random.default_rng(seed)
    centres = np.concatenate([rng.random((6, dim)), np.zeros((1, dim)), np.full((1, dim), 0.999)])
    blobs = np.concatenate([c + 0.01 * rng.standard_normal((120, dim)) for c in centres])
    t = rng.random(300)
    filament = np.stack([t] + [0.98 + 0.004 * rng.standard_normal(300) for _ in range(dim - 1)], axis=1)
    pos = np.concatenate([blobs, filament, rng.random((600, dim))]) % 1.0
    return {"pos": pos.astype(np.float32), "vel": None, "mass": None,
            "linking_length": 0.012 if dim == 3 else 0.008, "box": 1.0}


@pytest.mark.parametrize(("dim", "shapes"), [(2, ((2,), (8,))), (3, ((2, 4),))])
def test_pieces_wrapping_the_box(dim: int, shapes: tuple[tuple[int, ...], ...]) -> None:
    """Local grids over pieces that wrap the periodic box on some axes, at several device counts, clustered data
    (each mesh compiles its own program: two meshes in 2D, the unequal 2D mesh in 3D)."""
    data = _wrapped_clusters(dim, 20 + dim)
    want = reference.fof_labels(data["pos"], data["linking_length"], box=data["box"], min_members=5)
    assert (np.bincount(want[want >= 0]) >= 100).sum() >= 3
    labels, _ = _local(data, min_members=5)
    np.testing.assert_array_equal(labels, want)
    for shape in shapes:
        labels, got = _global(data, shape, min_members=5)
        np.testing.assert_array_equal(labels, want)
        np.testing.assert_array_equal(got["label"], np.unique(want[want >= 0]))
