"""The files of ``shardax nbody``: Gadget-4-style snapshot, power spectrum CSV and FoF halo catalogue.

Units follow Gadget's cosmological convention: lengths in Mpc/h (comoving), masses in 1e10 Msun/h, velocities in km/s
with the snapshot's ``Velocities`` the peculiar velocity divided by ``sqrt(a)``. The ``Parameters`` group of each
file says so (``UnitLength_in_cm``, ``UnitMass_in_g``, ``UnitVelocity_in_cm_per_s``) and records the job's options.
"""

from __future__ import annotations

import dataclasses
import math
import os
from typing import Any

import numpy as np

SNAPSHOT_FILE = "snapshot_000.hdf5"
POWER_FILE = "power_spectrum.csv"
HALO_FILE = "fof_tab_000.hdf5"

# The critical density today, 3 H0^2 / (8 pi G), in (Msun/h) / (Mpc/h)^3.
RHO_CRIT = 2.77536627e11
# Gadget's cosmological units: Mpc/h, 1e10 Msun/h and km/s, in cgs.
UNITS = {"UnitLength_in_cm": 3.085678e24, "UnitMass_in_g": 1.989e43, "UnitVelocity_in_cm_per_s": 1e5}
MASS_UNIT = 1e10  # Msun/h

POWER_COLUMNS = ("k [h/Mpc]", "P(k) [(Mpc/h)^3]", "modes", "linear P(k) [(Mpc/h)^3]",
                 "linear P(k) of this realisation [(Mpc/h)^3]")


def omega_m(cosmo: Any) -> float:
    return float(cosmo.omega_c) + float(cosmo.omega_b)


def particle_mass(cosmo: Any, box: float, particles: int) -> float:
    """Mass of one particle in Msun/h: the mean matter density times the volume per particle."""
    return omega_m(cosmo) * RHO_CRIT * (box / particles) ** 3


def _cosmology_attrs(cosmo: Any, a: float) -> dict[str, Any]:
    om = omega_m(cosmo)
    return {"Time": a, "Redshift": 1.0 / a - 1.0, "Omega0": om, "OmegaBaryon": float(cosmo.omega_b),
            "OmegaLambda": 1.0 - om, "HubbleParam": float(cosmo.h)}


def _parameters(options: Any, cosmo: Any) -> dict[str, Any]:
    """The ``Parameters`` attributes: units and the job's options (the same at every scale of the run)."""
    params: dict[str, Any] = dict(UNITS)
    for field in dataclasses.fields(options):
        value = getattr(options, field.name)
        if field.name in ("out", "plots", "cosmology"):
            continue
        params[f"shardax_nbody_{field.name}"] = value
    for name in ("omega_c", "omega_b", "h", "n_s", "sigma8"):
        value = getattr(cosmo, name, None)
        if value is not None:
            params[f"cosmology_{name}"] = float(value)
    return params


def write_snapshot_file(path: str, rows: dict[str, np.ndarray], options: Any, cosmo: Any, a: float) -> str:
    """Write the final particles (sorted by ID) as a Gadget-4-style snapshot with ``sx.io.write_snapshot``, then add
    the cosmological ``Header`` attributes and a ``Parameters`` group; process 0 only. Returns ``path``."""
    import h5py

    from ..io import write_snapshot

    tmp = path + ".tmp"
    mass = particle_mass(cosmo, options.box, options.particles) / MASS_UNIT
    write_snapshot(tmp, rows["pos"], box=options.box, vel=rows["vel"] / math.sqrt(a),
                   ids=rows["ids"].astype(np.uint64), mass=mass)
    with h5py.File(tmp, "r+") as f:
        header = f["Header"]
        for key, value in _cosmology_attrs(cosmo, a).items():
            header.attrs[key] = value
        header.attrs["NumPart_Total_HighWord"] = np.zeros(6, np.uint32)
        header.attrs["Flag_DoublePrecision"] = 0
        params = f.create_group("Parameters")
        for key, value in _parameters(options, cosmo).items():
            params.attrs[key] = value
    os.replace(tmp, path)
    return path


def write_power_csv(path: str, k: np.ndarray, pk: np.ndarray, modes: np.ndarray, linear: np.ndarray,
                    realisation: np.ndarray) -> str:
    """``k, P(k), modes, linear P(k)`` (theory) and the linear ``P(k)`` of this run's initial field (measured,
    grown to the final time; ``nan`` beyond the particle grid's Nyquist wavenumber) with a header row naming the
    units; process 0 only. Returns ``path``."""
    with open(path + ".tmp", "w") as f:
        f.write(",".join(POWER_COLUMNS) + "\n")
        for row in zip(k, pk, modes, linear, realisation, strict=True):
            f.write(f"{row[0]:.8e},{row[1]:.8e},{int(row[2])},{row[3]:.8e},{row[4]:.8e}\n")
    os.replace(path + ".tmp", path)
    return path


def read_power_csv(path: str | os.PathLike[str]) -> dict[str, np.ndarray]:
    """The columns of a ``power_spectrum.csv``, by header name."""
    with open(path) as f:
        names = f.readline().rstrip("\n").split(",")
    data = np.loadtxt(path, delimiter=",", skiprows=1, ndmin=2)
    return {name: data[:, i] for i, name in enumerate(names)}


def write_halos(path: str, result: Any, part: Any, options: Any, a: float) -> list[str]:
    """Write the FoF groups as a Gadget-4 group catalogue with ``sx.io.write_fof_table`` (collective). Returns the
    files written."""
    from ..io import write_fof_table

    parameters = {**UNITS, "FOF_LinkingLength": options.linking_length, "FOF_GroupMinLen": options.min_members,
                  "FOF_LinkingLength_Mpc_h": options.linking_length * options.box / options.particles}
    return write_fof_table(path, result, part, box=options.box, redshift=1.0 / a - 1.0, time=a,
                           parameters=parameters)
