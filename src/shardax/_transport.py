"""Which transport carries ``sx.comm``'s collectives between CPU processes: XLA's gloo, or MPI.

``gloo`` is XLA:CPU's own: every collective of a multi-process CPU program goes over TCP, even between the devices
of one process. ``mpi`` is shardax's: ``sx.comm`` collectives of a multi-process CPU program run as host calls
that meet the process's other devices in shared memory and cross processes with the MPI library that ``mpi4py``
loads (``pip install "shardax[mpi]"``). XLA keeps gloo configured either way (a program whose devices span
processes needs it to run at all), and collectives written with ``jax.lax`` directly still use it.

The choice is made once, by :func:`shardax.initialize`:

- ``SHARDAX_CPU_COLLECTIVES=gloo|mpi`` forces it (``mpi`` without ``mpi4py`` is an error);
- else ``mpi`` when the process was started by an MPI launcher (Open MPI's ``mpirun``, MPICH's Hydra, Slurm's
  ``srun`` with PMI/PMIx), the run has several processes, JAX runs on CPU and ``mpi4py`` imports;
- else ``gloo`` (one process, ``shardax launch``, GPUs, or no ``mpi4py``).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Literal

from ._errors import DistributedSetupError

Transport = Literal["gloo", "mpi"]
ENV_CPU_COLLECTIVES = "SHARDAX_CPU_COLLECTIVES"
# Set in every rank by the MPI launchers shardax knows (Open MPI 4/5, MPICH/Hydra and Intel MPI, Slurm's PMI/PMIx).
_MPI_LAUNCHER_VARS = ("OMPI_COMM_WORLD_SIZE", "PMIX_RANK", "PMI_RANK", "PMI_SIZE", "MPI_LOCALNRANKS")

_chosen: Transport = "gloo"
_reason = "default (shardax.initialize was not called)"


def started_by_mpi(env: Mapping[str, str] | None = None) -> bool:
    """Whether this process was started by an MPI launcher (its rank variables are set)."""
    env = os.environ if env is None else env
    return any(name in env for name in _MPI_LAUNCHER_VARS)


def _mpi4py_available() -> bool:
    import importlib.util

    return importlib.util.find_spec("mpi4py") is not None


def _cpu_platform() -> bool:
    """Whether JAX will run on CPU (asked before the backend starts: the platforms setting, then what is installed)."""
    import jax

    platforms = (getattr(jax.config, "jax_platforms", None) or os.environ.get("JAX_PLATFORMS", "")).lower()
    if platforms:
        return platforms.split(",")[0].strip() == "cpu"
    import importlib.util

    return not any(importlib.util.find_spec(p) is not None for p in ("jax_cuda12_plugin", "jax_cuda13_plugin",
                                                                       "jax_rocm60_plugin", "jax_rocm7_plugin"))


def choose(num_processes: int, env: Mapping[str, str] | None = None) -> tuple[Transport, str]:
    """``(transport, reason)`` for a run of ``num_processes`` processes: the override, or the automatic rule."""
    env = os.environ if env is None else env
    forced = env.get(ENV_CPU_COLLECTIVES, "").strip().lower()
    if forced:
        if forced not in ("gloo", "mpi"):
            raise ValueError(f"{ENV_CPU_COLLECTIVES} must be 'gloo' or 'mpi', got {env[ENV_CPU_COLLECTIVES]!r}")
        if forced == "mpi" and not _mpi4py_available():
            raise DistributedSetupError(f"{ENV_CPU_COLLECTIVES}=mpi needs mpi4py: pip install \"shardax[mpi]\" (with an "
                                        "MPI library installed), or unset the variable to use gloo")
        return forced, f"{ENV_CPU_COLLECTIVES}={forced}"  # type: ignore[return-value]
    if num_processes <= 1:
        return "gloo", "one process (nothing crosses processes)"
    if not started_by_mpi(env):
        return "gloo", "not started by an MPI launcher"
    if not _cpu_platform():
        return "gloo", "not on CPU (GPUs use NCCL)"
    if not _mpi4py_available():
        return "gloo", "started by an MPI launcher, but mpi4py is not installed (pip install \"shardax[mpi]\")"
    return "mpi", "started by an MPI launcher on CPU, mpi4py installed"


def set_transport(transport: Transport, reason: str) -> None:
    """Record the transport of this process (called by :func:`shardax.initialize`)."""
    global _chosen, _reason
    _chosen, _reason = transport, reason


def cpu_collectives() -> Transport:
    """The transport of ``sx.comm`` collectives between CPU processes in this process: ``"gloo"`` or ``"mpi"``.

    Example:
        >>> import shardax as sx
        >>> sx.runtime.cpu_collectives() in ("gloo", "mpi")
        True
    """
    return _chosen


def transport_reason() -> str:
    """Why :func:`cpu_collectives` says what it says (for ``shardax doctor``)."""
    return _reason


class MpiWorld:
    """The MPI side of a run: a communicator of its own, and the MPI rank of each JAX process."""

    def __init__(self, comm, mpi_rank_of: tuple[int, ...]):  # type: ignore[no-untyped-def]
        self.comm = comm
        self.mpi_rank_of = mpi_rank_of


_mpi: MpiWorld | None = None


def start_mpi(num_processes: int) -> MpiWorld:
    """Start MPI (thread level ``MPI_THREAD_MULTIPLE``) and map JAX process indices to MPI ranks; idempotent.

    Raises:
        DistributedSetupError: mpi4py or its MPI library cannot be loaded, the MPI world does not have
            ``num_processes`` ranks, or the library gives less than ``MPI_THREAD_SERIALIZED``.
    """
    global _mpi
    if _mpi is not None:
        return _mpi
    import jax

    try:
        from mpi4py import MPI
    except Exception as err:  # ImportError, or mpi4py's RuntimeError when no MPI library loads
        raise DistributedSetupError(f"the MPI transport could not start ({type(err).__name__}: {err}): install an "
                                    "MPI library and mpi4py (pip install \"shardax[mpi]\"), or set "
                                    f"{ENV_CPU_COLLECTIVES}=gloo") from err
    world = MPI.COMM_WORLD
    if world.Get_size() != num_processes:
        raise DistributedSetupError(f"the MPI world has {world.Get_size()} rank(s) but the run has {num_processes} "
                                    f"processes: start every process with the same MPI launcher, or set "
                                    f"{ENV_CPU_COLLECTIVES}=gloo")
    if MPI.Query_thread() < MPI.THREAD_SERIALIZED:
        raise DistributedSetupError(f"the MPI library gives thread level {MPI.Query_thread()}; shardax calls MPI from "
                                    f"XLA's threads and needs MPI_THREAD_SERIALIZED or more: set "
                                    f"{ENV_CPU_COLLECTIVES}=gloo")
    comm = world.Dup()
    mine = jax.process_index() if num_processes > 1 else 0
    pairs = comm.allgather((mine, comm.Get_rank()))
    ranks = [0] * num_processes
    for process, rank in pairs:
        ranks[process] = rank
    _mpi = MpiWorld(comm, tuple(ranks))
    return _mpi


def mpi_world() -> MpiWorld:
    """The :class:`MpiWorld` of this process (the MPI transport must have been started by ``initialize``)."""
    if _mpi is None:
        raise DistributedSetupError("the MPI transport is not started: call sx.initialize() under an MPI launcher "
                                    f"(or with {ENV_CPU_COLLECTIVES}=mpi) first")
    return _mpi
