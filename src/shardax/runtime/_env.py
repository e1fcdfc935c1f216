"""Where a process learns its place in a multi-process run: the launcher's variables and cluster detection.

This module owns the environment contract between a launcher and :func:`shardax.initialize`: the names below are
written by :func:`launcher_vars` (for :func:`shardax.runtime.launch`) and read back by :func:`from_launcher`.

=============================== ========================================= ==========================================
variable                        set by                                    read by
=============================== ========================================= ==========================================
``SHARDAX_COORDINATOR_ADDRESS`` the launcher: ``127.0.0.1:<free port>``   ``initialize`` (also overrides Open MPI 5's)
``SHARDAX_NUM_PROCESSES``       the launcher: ``N``                       ``initialize``
``SHARDAX_PROCESS_ID``          the launcher: the rank                    ``initialize``
``SHARDAX_CPU_DEVICES``         the launcher, with ``cpu_devices=M``      ``initialize`` (CPU devices per process)
``JAX_NUM_CPU_DEVICES``         the launcher, with ``cpu_devices=M``      JAX itself, for code that skips ``initialize``
``SHARDAX_INITIALIZED``         ``initialize``, in a process that joined  nobody: marks a process of a run
=============================== ========================================= ==========================================

A process started by a launcher inside a run must not inherit the run's place: :data:`RUN_VARS` are removed from
the base environment of every process shardax starts.

Sources, in the order :func:`shardax.initialize` tries them: explicit arguments, the launcher's variables, Slurm,
Open MPI 4 (ORTE), Open MPI 5 (PRRTE/PMIx, which JAX's own detection misses), MPICH's Hydra (also Intel MPI's:
``PMI_RANK``/``PMI_SIZE``, which JAX does not read either), else one process.
"""

from __future__ import annotations

import dataclasses
import os
import re
import zlib
from collections.abc import Mapping

#: ``"host:port"`` of process 0's coordinator service.
ENV_COORDINATOR = "SHARDAX_COORDINATOR_ADDRESS"
#: Number of processes of the run.
ENV_NUM_PROCESSES = "SHARDAX_NUM_PROCESSES"
#: This process's index in the run (its rank).
ENV_PROCESS_ID = "SHARDAX_PROCESS_ID"
#: CPU devices per process (optional).
ENV_CPU_DEVICES = "SHARDAX_CPU_DEVICES"
#: JAX's own CPU device count, set alongside :data:`ENV_CPU_DEVICES`.
ENV_JAX_CPU_DEVICES = "JAX_NUM_CPU_DEVICES"
#: Set by :func:`shardax.initialize` in a process that joined a run.
ENV_INITIALIZED = "SHARDAX_INITIALIZED"
#: The variables that place a process in one run: never inherited by the processes of another.
RUN_VARS = (ENV_COORDINATOR, ENV_NUM_PROCESSES, ENV_PROCESS_ID, ENV_CPU_DEVICES, ENV_INITIALIZED)


def launcher_vars(*, process_id: int, num_processes: int, coordinator: str) -> dict[str, str]:
    """The variables that tell process ``process_id`` of a run where it is (read back by :func:`from_launcher`)."""
    return {ENV_COORDINATOR: coordinator, ENV_NUM_PROCESSES: str(num_processes), ENV_PROCESS_ID: str(process_id)}


def cpu_device_vars(cpu_devices: int) -> dict[str, str]:
    """The variables that give every process of a run ``cpu_devices`` CPU devices."""
    return {ENV_CPU_DEVICES: str(cpu_devices), ENV_JAX_CPU_DEVICES: str(cpu_devices)}


@dataclasses.dataclass(frozen=True)
class LaunchInfo:
    """Where this process sits in the run, and which source said so."""

    coordinator_address: str | None
    num_processes: int
    process_id: int
    source: str  # "explicit" | "shardax-launch" | "slurm" | "openmpi4" | "openmpi5" | "hydra" | "single"
    cpu_devices: int | None = None
    # None with several processes: the launcher does not say where rank 0 is, the ranks agree through MPI
    # (:func:`shardax.initialize` does it with mpi4py).


def _port_from(text: str) -> int:
    """A port in the upper ephemeral range derived from a job identifier, the same on every rank."""
    return 61440 + zlib.crc32(text.encode()) % 4096


def _int_var(env: Mapping[str, str], name: str) -> int:
    try:
        return int(env[name])
    except ValueError:
        raise ValueError(f"environment variable {name}={env[name]!r} is not an integer") from None


def from_launcher(env: Mapping[str, str]) -> LaunchInfo | None:
    if ENV_NUM_PROCESSES not in env:
        return None
    missing = [v for v in (ENV_COORDINATOR, ENV_PROCESS_ID) if v not in env]
    if missing:
        raise ValueError(f"{ENV_NUM_PROCESSES} is set but {', '.join(missing)} is not: set all three "
                         f"({ENV_COORDINATOR}, {ENV_NUM_PROCESSES}, {ENV_PROCESS_ID}) or none")
    cpu = _int_var(env, ENV_CPU_DEVICES) if env.get(ENV_CPU_DEVICES) else None
    return LaunchInfo(env[ENV_COORDINATOR], _int_var(env, ENV_NUM_PROCESSES), _int_var(env, ENV_PROCESS_ID),
                      "shardax-launch", cpu)


def _first_slurm_host(nodelist: str) -> str:
    """First host of a Slurm node list such as ``node[003-005,007],gpu01``."""
    match = re.match(r"([^,\[]+)(\[([^\]]+)\])?", nodelist)
    if match is None:
        raise ValueError(f"cannot parse SLURM_STEP_NODELIST={nodelist!r}")
    prefix, _, ranges = match.groups()
    if ranges is None:
        return prefix
    first = ranges.split(",")[0].split("-")[0]
    return prefix + first


def from_slurm(env: Mapping[str, str]) -> LaunchInfo | None:
    needed = ("SLURM_JOB_ID", "SLURM_STEP_NUM_TASKS", "SLURM_PROCID", "SLURM_STEP_NODELIST")
    if not all(v in env for v in needed):
        return None
    n = _int_var(env, "SLURM_STEP_NUM_TASKS")
    if n == 1:
        return LaunchInfo(None, 1, 0, "slurm")
    host = _first_slurm_host(env["SLURM_STEP_NODELIST"])
    port = _port_from("slurm" + env["SLURM_JOB_ID"] + env.get("SLURM_STEP_ID", ""))
    return LaunchInfo(f"{host}:{port}", n, _int_var(env, "SLURM_PROCID"), "slurm")


def from_openmpi4(env: Mapping[str, str]) -> LaunchInfo | None:
    uri = env.get("OMPI_MCA_orte_hnp_uri")
    if uri is None or "OMPI_COMM_WORLD_SIZE" not in env:
        return None
    n = _int_var(env, "OMPI_COMM_WORLD_SIZE")
    match = re.search(r"tcp://(.+?)[,:]|tcp6://\[(.+?)[,\]]", uri)
    if match is None:
        raise ValueError(f"cannot parse the launcher address from OMPI_MCA_orte_hnp_uri={uri!r}")
    host = next(g for g in match.groups() if g is not None)
    port = _port_from("ompi" + uri.split(";", 1)[0])
    return LaunchInfo(f"{host}:{port}", n, _int_var(env, "OMPI_COMM_WORLD_RANK"), "openmpi4")


def from_openmpi5(env: Mapping[str, str]) -> LaunchInfo | None:
    """Open MPI 5 launches through PRRTE: no ``orte_hnp_uri``, the job is named by ``PMIX_NAMESPACE``.

    The coordinator runs in rank 0. When every rank is on one node it is 127.0.0.1; otherwise it is the host of the
    ``prterun`` that started the job (named in ``PMIX_NAMESPACE``: ``prterun-HOST-PID@JOB``), where Open MPI places
    rank 0 by default. ``SHARDAX_COORDINATOR_ADDRESS`` overrides it for other placements.
    """
    if "OMPI_COMM_WORLD_SIZE" not in env or "OMPI_MCA_orte_hnp_uri" in env:
        return None
    namespace = env.get("PMIX_NAMESPACE")
    if namespace is None:
        return None
    n = _int_var(env, "OMPI_COMM_WORLD_SIZE")
    port = _port_from("ompi5" + namespace)
    if ENV_COORDINATOR in env:
        address = env[ENV_COORDINATOR]
    elif env.get("OMPI_COMM_WORLD_LOCAL_SIZE") == env["OMPI_COMM_WORLD_SIZE"]:
        address = f"127.0.0.1:{port}"
    else:
        match = re.match(r"prte?run-(.+)-\d+@", namespace)
        if match is None:
            raise ValueError(f"cannot find the launch host in PMIX_NAMESPACE={namespace!r}: set "
                             f"{ENV_COORDINATOR}=HOST:PORT to the host of rank 0")
        address = f"{match.group(1)}:{port}"
    return LaunchInfo(address, n, _int_var(env, "OMPI_COMM_WORLD_RANK"), "openmpi5")


def from_hydra(env: Mapping[str, str]) -> LaunchInfo | None:
    """MPICH's ``mpiexec`` (Hydra, also Intel MPI's) sets ``PMI_RANK`` and ``PMI_SIZE`` and nothing that names the job
    or the host of rank 0: the coordinator address is left unset for the ranks to agree on through MPI (rank 0
    offers a free port on its host), unless ``SHARDAX_COORDINATOR_ADDRESS`` gives it."""
    if "PMI_RANK" not in env or "PMI_SIZE" not in env:
        return None
    n = _int_var(env, "PMI_SIZE")
    if n == 1:
        return LaunchInfo(None, 1, 0, "hydra")
    return LaunchInfo(env.get(ENV_COORDINATOR), n, _int_var(env, "PMI_RANK"), "hydra")


def detect(env: Mapping[str, str] | None = None) -> LaunchInfo:
    """This process's place in the run from the environment alone (no explicit arguments)."""
    env = os.environ if env is None else env
    for source in (from_launcher, from_slurm, from_openmpi4, from_openmpi5, from_hydra):
        info = source(env)
        if info is not None:
            return info
    return LaunchInfo(None, 1, 0, "single")
