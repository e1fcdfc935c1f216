"""Where a process learns its place in a multi-process run: launcher variables and cluster detection.

Sources, in the order :func:`shardax.initialize` tries them: explicit arguments, the variables ``shardax launch``
sets, Slurm, Open MPI 4 (ORTE), Open MPI 5 (PRRTE/PMIx, which JAX's own detection misses), else one process.
"""

from __future__ import annotations

import dataclasses
import os
import re
import zlib
from collections.abc import Mapping

# Set by `shardax launch` for every child process (and readable by any other launcher that wants to drive shardax).
ENV_COORDINATOR = "SHARDAX_COORDINATOR_ADDRESS"
ENV_NUM_PROCESSES = "SHARDAX_NUM_PROCESSES"
ENV_PROCESS_ID = "SHARDAX_PROCESS_ID"
ENV_CPU_DEVICES = "SHARDAX_CPU_DEVICES"


@dataclasses.dataclass(frozen=True)
class LaunchInfo:
    """Where this process sits in the run, and which source said so."""

    coordinator_address: str | None
    num_processes: int
    process_id: int
    source: str  # "explicit" | "shardax-launch" | "slurm" | "openmpi4" | "openmpi5" | "single"
    cpu_devices: int | None = None


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


def detect(env: Mapping[str, str] | None = None) -> LaunchInfo:
    """This process's place in the run from the environment alone (no explicit arguments)."""
    env = os.environ if env is None else env
    for source in (from_launcher, from_slurm, from_openmpi4, from_openmpi5):
        info = source(env)
        if info is not None:
            return info
    return LaunchInfo(None, 1, 0, "single")
