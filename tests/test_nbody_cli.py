"""``shardax nbody``: the same files on 1 device, on 8 devices in one process and on 2 processes x 4 devices;
the snapshot, P(k) and halos checked against NumPy/SciPy references on the written particles; bad options."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import h5py
import numpy as np
import pytest
from jax.sharding import Mesh

import shardax as sx
from conftest import make_mesh
from shardax.cli._nbody import run_cli
from shardax.cli._nbody_files import POWER_COLUMNS, RHO_CRIT, read_power_csv
from shardax.cli._nbody_job import NbodyOptions, run_job
from shardax.testing import reference

# Small enough to compile and run quickly, big enough for a few dozen halos of 10 or more particles.
OPTIONS = NbodyOptions(particles=32, box=128.0, steps=4, z_start=9.0, seed=3, min_members=10, plots=False)
LAYOUTS = ("one_device", "devices_8", "processes_2x4")


def _cli_args(options: NbodyOptions, out: Path) -> list[str]:
    return ["--particles", str(options.particles), "--box", repr(options.box), "--steps", str(options.steps),
            "--z-start", repr(options.z_start), "--seed", str(options.seed), "--min-members",
            str(options.min_members), "--out", str(out)]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The job's output folder at each layout (the launched one with plots and the CLI's progress output)."""
    root = tmp_path_factory.mktemp("nbody")
    outs = {name: root / name for name in LAYOUTS}
    for name, mesh in (("one_device", make_mesh((1,))), ("devices_8", make_mesh((8,)))):
        run_job(dataclasses.replace(OPTIONS, out=str(outs[name])), mesh=mesh, show=False)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SHARDAX_", "JAX_NUM_CPU"))}
    # The job's own cache settings, in an empty directory of this run (off on several CPU devices: all compile).
    env["JAX_COMPILATION_CACHE_DIR"] = str(root / "jax_cache")
    proc = subprocess.run([sys.executable, "-m", "shardax.cli", "nbody", *_cli_args(OPTIONS, outs["processes_2x4"]),
                           "--processes", "2", "--cpu-devices", "4", "--plain"],
                          env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (root / "processes_2x4.log").write_text(proc.stdout)
    return outs


def _snapshot(path: Path) -> tuple[dict, dict, dict]:
    with h5py.File(path / "snapshot_000.hdf5", "r") as f:
        header = {k: np.asarray(v) for k, v in f["Header"].attrs.items()}
        params = {k: np.asarray(v) for k, v in f["Parameters"].attrs.items()}
        data = {k: f["PartType1"][k][:] for k in ("Coordinates", "Velocities", "ParticleIDs")}
    return header, params, data


def _halos(path: Path) -> tuple[dict, dict]:
    with h5py.File(path / "fof_tab_000.hdf5", "r") as f:
        header = {k: np.asarray(v) for k, v in f["Header"].attrs.items()}
        data = {k: f["Group"][k][:] for k in f["Group"]}
        data["IDs"] = f["IDs/ID"][:]
    return header, data


def _periodic_difference(a: np.ndarray, b: np.ndarray, box: float) -> np.ndarray:
    d = np.abs(a.astype(np.float64) - b)
    return np.minimum(d, box - d)


def test_snapshot_header_and_particles(runs: dict[str, Path]) -> None:
    n, box = OPTIONS.particles, OPTIONS.box
    header, params, data = _snapshot(runs["one_device"])
    cosmo = sx.nbody.Cosmology()
    assert float(header["BoxSize"]) == box
    assert float(header["Redshift"]) == pytest.approx(0.0, abs=1e-12) and float(header["Time"]) == pytest.approx(1.0)
    np.testing.assert_array_equal(header["NumPart_Total"], [0, n**3, 0, 0, 0, 0])
    np.testing.assert_array_equal(header["NumPart_ThisFile"], [0, n**3, 0, 0, 0, 0])
    omega_m = cosmo.omega_c + cosmo.omega_b
    assert float(header["Omega0"]) == pytest.approx(omega_m)
    assert float(header["OmegaLambda"]) == pytest.approx(1 - omega_m)
    assert float(header["HubbleParam"]) == pytest.approx(cosmo.h)
    # MassTable in Gadget's 1e10 Msun/h: the mean matter density times the volume per particle.
    assert float(header["MassTable"][1]) * 1e10 == pytest.approx(omega_m * RHO_CRIT * (box / n) ** 3, rel=1e-6)
    assert float(params["UnitLength_in_cm"]) == pytest.approx(3.085678e24)
    assert int(params["shardax_nbody_seed"]) == OPTIONS.seed
    # Ordered by ID, the Lagrangian grid index.
    np.testing.assert_array_equal(data["ParticleIDs"], np.arange(n**3))
    assert data["Coordinates"].dtype == np.float32 and data["Coordinates"].shape == (n**3, 3)
    assert data["Coordinates"].min() >= 0 and data["Coordinates"].max() < box
    # Particles have moved off their grid by a few Mpc/h (rms), not by a box.
    ids = data["ParticleIDs"]
    grid = np.stack([ids // n**2, (ids // n) % n, ids % n], axis=1) * (box / n)
    rms = np.sqrt(np.mean(_periodic_difference(data["Coordinates"], grid, box) ** 2))
    assert 1.0 < rms < box / 8
    speed = np.sqrt(np.mean(data["Velocities"].astype(np.float64) ** 2))
    assert 50 < speed < 2000  # km/s


def test_files_identical_whatever_the_layout(runs: dict[str, Path]) -> None:
    box = OPTIONS.box
    h0, p0, d0 = _snapshot(runs["one_device"])
    g0, t0 = _halos(runs["one_device"])
    pk0 = read_power_csv(runs["one_device"] / "power_spectrum.csv")
    for name in LAYOUTS[1:]:
        h, p, d = _snapshot(runs[name])
        assert h.keys() == h0.keys() and p.keys() == p0.keys()
        for key in h0:
            np.testing.assert_array_equal(h[key], h0[key], err_msg=f"{name}: Header/{key}")
        for key in p0:
            np.testing.assert_array_equal(p[key], p0[key], err_msg=f"{name}: Parameters/{key}")
        np.testing.assert_array_equal(d["ParticleIDs"], d0["ParticleIDs"])
        # float32 round-off of a different summation order, grown a little by the steps
        assert _periodic_difference(d["Coordinates"], d0["Coordinates"], box).max() < 2e-3
        np.testing.assert_allclose(d["Velocities"], d0["Velocities"], atol=0.05, rtol=1e-4)
        pk = read_power_csv(runs[name] / "power_spectrum.csv")
        np.testing.assert_array_equal(pk["modes"], pk0["modes"])
        np.testing.assert_allclose(pk["k [h/Mpc]"], pk0["k [h/Mpc]"], rtol=1e-5)
        np.testing.assert_allclose(pk["P(k) [(Mpc/h)^3]"], pk0["P(k) [(Mpc/h)^3]"], rtol=1e-4)
        np.testing.assert_allclose(pk["linear P(k) [(Mpc/h)^3]"], pk0["linear P(k) [(Mpc/h)^3]"], rtol=1e-4)
        np.testing.assert_allclose(pk[POWER_COLUMNS[4]], pk0[POWER_COLUMNS[4]], rtol=1e-4)
        g, t = _halos(runs[name])
        for key in ("Ngroups_Total", "Nids_Total", "BoxSize", "Redshift", "Time"):
            np.testing.assert_array_equal(g[key], g0[key], err_msg=f"{name}: fof Header/{key}")
        for key in ("GroupLen", "GroupLenType", "GroupOffsetType", "IDs"):
            np.testing.assert_array_equal(t[key], t0[key], err_msg=f"{name}: {key}")
        np.testing.assert_allclose(t["GroupMass"], t0["GroupMass"], rtol=1e-6)
        assert _periodic_difference(t["GroupPos"], t0["GroupPos"], box).max() < 2e-3


def _power_numpy(pos: np.ndarray, box: float, cells: int, edges: np.ndarray) -> tuple[np.ndarray, ...]:
    """CIC-compensated, binned P(k) of particles, by the NumPy references."""
    rho = reference.cic_paint(pos, (cells,) * 3, box=box)
    return reference.power_spectrum(rho / rho.mean() - 1, box=box, edges=edges)


def test_power_spectrum_csv(runs: dict[str, Path]) -> None:
    path = runs["processes_2x4"] / "power_spectrum.csv"
    assert path.read_text().splitlines()[0] == ",".join(POWER_COLUMNS)
    got = read_power_csv(path)
    _, _, data = _snapshot(runs["processes_2x4"])
    cells = OPTIONS.particles * OPTIONS.mesh_factor
    edges = sx.fields.bin_edges(cells // 2 - 1, (cells,) * 3, OPTIONS.box)
    k, pk, modes = _power_numpy(data["Coordinates"], OPTIONS.box, cells, edges)
    np.testing.assert_array_equal(got["modes"], modes)
    np.testing.assert_allclose(got["k [h/Mpc]"], k, rtol=1e-5)
    np.testing.assert_allclose(got["P(k) [(Mpc/h)^3]"], pk, rtol=2e-3)
    linear = np.asarray(sx.nbody.linear_power(sx.nbody.Cosmology(), got["k [h/Mpc]"], a=1.0))
    np.testing.assert_allclose(got["linear P(k) [(Mpc/h)^3]"], linear, rtol=1e-5)
    # Large scales grew as linear theory says (up to the cosmic variance of so few modes).
    large = got["k [h/Mpc]"] < 0.15
    ratio = np.sum(got["modes"][large] * got["P(k) [(Mpc/h)^3]"][large]) / \
        np.sum(got["modes"][large] * got["linear P(k) [(Mpc/h)^3]"][large])
    assert 0.6 < ratio < 1.6
    # Against the run's own initial field (no cosmic variance), the largest scale grew as D(a)^2.
    growth = got["P(k) [(Mpc/h)^3]"][0] / got[POWER_COLUMNS[4]][0]
    assert abs(growth - 1) < 0.05, growth
    noise = sx.nbody.white_noise(OPTIONS.particles, seed=OPTIONS.seed, mesh=make_mesh((1,)))
    field = np.asarray(sx.nbody.linear_field(noise, box=OPTIONS.box, cosmo=sx.nbody.Cosmology(),
                                             mesh=make_mesh((1,))), np.float64)
    _, initial, _ = reference.power_spectrum(field, box=OPTIONS.box, edges=edges, compensate=False)
    np.testing.assert_allclose(got[POWER_COLUMNS[4]], initial, rtol=1e-3)


def test_halo_catalogue_matches_scipy(runs: dict[str, Path]) -> None:
    n, box = OPTIONS.particles, OPTIONS.box
    _, _, data = _snapshot(runs["processes_2x4"])
    header, table = _halos(runs["processes_2x4"])
    labels = reference.fof_labels(data["Coordinates"], OPTIONS.linking_length * box / n, box=box,
                                  min_members=OPTIONS.min_members)
    groups, sizes = np.unique(labels[labels >= 0], return_counts=True)
    assert len(groups) >= 5
    assert int(header["Ngroups_Total"]) == len(groups)
    np.testing.assert_array_equal(table["GroupLen"], sizes)  # groups ordered by smallest member ID, as the labels
    members = np.concatenate([np.flatnonzero(labels == g) for g in groups])
    np.testing.assert_array_equal(table["IDs"], data["ParticleIDs"][members])
    with h5py.File(runs["processes_2x4"] / "snapshot_000.hdf5", "r") as f:
        particle_mass = float(f["Header"].attrs["MassTable"][1])
    np.testing.assert_allclose(table["GroupMass"], sizes * particle_mass, rtol=1e-5)


def test_progress_and_plots(runs: dict[str, Path]) -> None:
    log = (runs["processes_2x4"].parent / "processes_2x4.log").read_text()
    assert "2 process(es) x 4 CPU device(s), 8 in the mesh" in log
    for step in ("[1/5] particle-mesh N-body", "[2/5] friends-of-friends", "[5/5] plots"):
        assert step in log, log
    assert "compiled" in log and "P(k) / linear" in log and "linear growth" in log and "halos (>= 10)" in log
    for name in ("power_spectrum.png", "density_slice.png", "halo_mass_function.png"):
        assert (runs["processes_2x4"] / name).stat().st_size > 10_000
    assert not (runs["one_device"] / "power_spectrum.png").exists()  # plots=False


@pytest.mark.parametrize("args, message", [
    (["--particles", "48"], "--particles must be a power of two"),
    (["--steps", "0"], "--steps must be a positive integer"),
    (["--particles", "2048"], "--particles must be a power of two from 4 to 1024"),
    (["--z-start", "-1"], "--z-start must be a redshift in (0, 999]"),
    (["--box", "0"], "--box must be a positive length"),
    (["--mesh-factor", "0"], "--mesh-factor must be a positive integer"),
    (["--sigma8", "nan"], "--sigma8 must lie in"),
    (["--particles", "4", "--processes", "2", "--cpu-devices", "4"], "must divide over the 8 devices"),
    (["--order", "3"], "invalid choice"),
])
def test_bad_options(args: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        run_cli(args)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_library_refusal_is_a_clear_error(tmp_path: Path) -> None:
    mesh = Mesh(np.array(sx.flat_mesh().devices).reshape(-1)[:8], ("d",))
    with pytest.raises(ValueError, match="8|divid"):
        run_job(dataclasses.replace(OPTIONS, particles=4, out=str(tmp_path)), mesh=mesh, show=False)

