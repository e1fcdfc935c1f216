"""Start (or join) a multi-process run: :func:`initialize`."""

from __future__ import annotations

import dataclasses
import os
import socket
import sys
import threading
import time

import jax
from jax._src import config as jax_config
from jax._src import xla_bridge

from .._errors import DistributedSetupError
from .._transport import choose as choose_transport
from .._transport import set_transport, start_mpi
from ._env import LaunchInfo, detect
from ._world import World, world

_lock = threading.Lock()
_started: LaunchInfo | None = None


def _backend_started() -> bool:
    return xla_bridge.backends_are_initialized()


def _await_coordinator(address: str, timeout_s: float) -> float:
    """Wait until the coordinator's port (``host:port``, process 0's coordination service) accepts connections, at
    most ``timeout_s``; returns the seconds waited.

    A process whose JAX client asks before the service listens is refused, and gRPC then waits its first reconnect
    backoff, a whole second, before asking again: half of all launches on one machine took a second longer to
    start. Polling the port every few milliseconds first costs nothing when the service is up.
    """
    host, _, port = address.rpartition(":")
    start = time.monotonic()
    try:
        target = (host.strip("[]") or "127.0.0.1", int(port))
    except ValueError:
        return 0.0  # not host:port: leave it to JAX
    while True:
        try:
            with socket.create_connection(target, timeout=1.0):
                return time.monotonic() - start
        except OSError:
            if time.monotonic() - start >= timeout_s:
                return time.monotonic() - start
            time.sleep(0.005)


def _set_cpu_devices(count: int) -> None:
    current = xla_bridge.num_cpu_devices.value
    if current == count:
        return
    if _backend_started():
        have = len(jax.local_devices(backend="cpu"))
        if have == count:
            return
        raise DistributedSetupError(
            f"cpu_devices={count} was asked for, but the JAX backend already started with {have} CPU device(s): "
            "call sx.initialize(...) before any other JAX call (creating an array or listing devices starts "
            "the backend)")
    jax.config.update("jax_num_cpu_devices", count)


def _abort_on_uncaught_exception() -> None:
    """End this process at once on an uncaught exception (after printing it), like ``python -m mpi4py``.

    Otherwise the interpreter's exit runs ``jax.distributed.shutdown``, whose barrier waits (minutes) for processes
    that may be stuck in a collective this one will never join; the launcher then tears down the others at once.
    ``SHARDAX_ABORT_ON_EXCEPTION=0`` keeps Python's normal exit.
    """
    if os.environ.get("SHARDAX_ABORT_ON_EXCEPTION", "1") == "0" or getattr(sys.excepthook, "_shardax", False):
        return
    previous = sys.excepthook

    def hook(kind, value, traceback):  # type: ignore[no-untyped-def]
        previous(kind, value, traceback)
        print(f"shardax: process {jax.process_index()} ends on an uncaught {kind.__name__} (exit code 1)",
              file=sys.stderr, flush=True)
        sys.stdout.flush()
        os._exit(1)

    hook._shardax = True  # type: ignore[attr-defined]
    sys.excepthook = hook


def _coordinator_through_mpi(info: LaunchInfo) -> LaunchInfo:
    """``info`` with the coordinator address agreed through MPI, for launchers that do not say where rank 0 is
    (MPICH's Hydra): rank 0 offers a free port on its host (``127.0.0.1`` when every rank shares its node), every
    rank receives it.

    Raises:
        DistributedSetupError: mpi4py or its MPI library cannot be loaded, or MPI's world is not the launcher's.
    """
    fix = ("pip install \"shardax[mpi]\" (mpi4py, with the MPI library that started the run), or set "
           "SHARDAX_COORDINATOR_ADDRESS=HOST:PORT (a free port on the host of rank 0) in every rank")
    try:
        from mpi4py import MPI
    except Exception as err:  # ImportError, or mpi4py's RuntimeError when no MPI library loads
        raise DistributedSetupError(f"this process was started by an MPI launcher ({info.source}: rank "
                                    f"{info.process_id} of {info.num_processes}) that does not say where rank 0 "
                                    f"is; the ranks agree on it through MPI, which could not start "
                                    f"({type(err).__name__}: {err}): {fix}") from err
    comm = MPI.COMM_WORLD
    if (comm.Get_size(), comm.Get_rank()) != (info.num_processes, info.process_id):
        raise DistributedSetupError(f"the launcher says rank {info.process_id} of {info.num_processes} but mpi4py's "
                                    f"MPI says rank {comm.Get_rank()} of {comm.Get_size()}: mpi4py loads another MPI "
                                    f"library than the launcher's (MPI4PY_LIBMPI selects it); or {fix}")
    node = comm.Split_type(MPI.COMM_TYPE_SHARED)
    one_node = node.Get_size() == comm.Get_size()
    node.Free()
    offer: tuple[str | None, str] = (None, "")
    if comm.Get_rank() == 0:
        host = "127.0.0.1" if one_node else socket.gethostname()
        try:
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
                probe.bind(("127.0.0.1" if one_node else "", 0))
                offer = (f"{host}:{probe.getsockname()[1]}", "")
        except OSError as err:  # every rank must leave the broadcast, and each says why
            offer = (None, f"rank 0 could not find a free port on {host} ({err})")
    address, problem = comm.bcast(offer, root=0)
    if address is None:
        raise DistributedSetupError(f"{problem}: set SHARDAX_COORDINATOR_ADDRESS=HOST:PORT in every rank")
    return dataclasses.replace(info, coordinator_address=address)


def _start_transport(num_processes: int) -> None:
    """Choose the transport of ``sx.comm`` between processes; with MPI, start it now (``MPI_Init_thread``)."""
    transport, reason = choose_transport(num_processes)
    if transport == "mpi":
        start_mpi(num_processes)
    set_transport(transport, reason)


def initialize(coordinator_address: str | None = None, num_processes: int | None = None,
               process_id: int | None = None, *, local_device_ids: int | list[int] | None = None,
               cpu_devices: int | None = None, timeout_s: int = 300) -> World:
    """Join the multi-process run this process belongs to and return its :class:`World`.

    Sources, in order: explicit arguments; the variables ``shardax launch`` sets (``SHARDAX_*``); cluster detection
    (Slurm, Open MPI 4, Open MPI 5/PMIx, and MPICH's Hydra, whose ranks agree on rank 0's address through MPI);
    else a single process (``jax.distributed`` is not started).
    Idempotent: a second call with compatible arguments returns the same world. On CPU it keeps cross-process
    collectives on (gloo) so that ``psum`` and friends work between processes, and picks the transport of
    ``sx.comm``'s collectives between processes: MPI when an MPI launcher started the run and ``mpi4py`` is
    installed, else gloo (``SHARDAX_CPU_COLLECTIVES=gloo|mpi`` overrides; see ``docs/comm.md``).

    Args:
        coordinator_address: ``"host:port"`` of process 0's coordinator service.
        num_processes: number of processes in the run.
        process_id: this process's index.
        local_device_ids: restrict this process to these local devices (GPU per-process binding).
        cpu_devices: give each process this many CPU devices (``jax_num_cpu_devices``); must be set before the
            backend starts.
        timeout_s: how long to wait for the other processes to join. ``SHARDAX_HEARTBEAT_S`` sets how soon a
            lost peer ends the run (JAX's heartbeat timeout, default 100 s).

    Returns:
        The :class:`World` of the run.

    Raises:
        DistributedSetupError: the backend already started with incompatible settings, the processes drive unequal
            numbers or kinds of devices, or the others did not join within ``timeout_s``.

    Example:
        >>> import shardax as sx
        >>> w = sx.initialize()          # under `shardax launch`, srun or mpirun it finds the others
        >>> w.num_processes >= 1
        True
    """
    global _started
    explicit = [coordinator_address, num_processes, process_id]
    if any(v is not None for v in explicit) and num_processes != 1 and not all(v is not None for v in explicit):
        raise ValueError("pass coordinator_address, num_processes and process_id together (or none of them to "
                         f"detect them); got coordinator_address={coordinator_address!r}, "
                         f"num_processes={num_processes!r}, process_id={process_id!r}")
    if num_processes is not None:
        if num_processes == 1:
            info = LaunchInfo(None, 1, 0, "explicit", cpu_devices)
        else:
            assert process_id is not None
            if not 0 <= process_id < num_processes:
                raise ValueError(f"process_id={process_id} is outside [0, num_processes={num_processes})")
            info = LaunchInfo(coordinator_address, num_processes, process_id, "explicit", cpu_devices)
    else:
        info = detect()
        if info.num_processes > 1 and info.coordinator_address is None and _started is None:
            info = _coordinator_through_mpi(info)  # (a collective: not again once joined)
    if cpu_devices is None:
        cpu_devices = info.cpu_devices
    if cpu_devices is not None and (not isinstance(cpu_devices, int) or cpu_devices < 1):
        raise ValueError(f"cpu_devices must be a positive int, got {cpu_devices!r}")
    if not isinstance(timeout_s, int | float) or timeout_s <= 0:
        raise ValueError(f"timeout_s must be a positive number of seconds, got {timeout_s!r}")

    with _lock:
        if _started is not None:
            same = (_started.num_processes, _started.process_id) == (info.num_processes, info.process_id)
            if not same:
                raise DistributedSetupError(
                    f"shardax.initialize was already called as process {_started.process_id} of "
                    f"{_started.num_processes} (from {_started.source}); now asked for process {info.process_id} "
                    f"of {info.num_processes}")
            if cpu_devices is not None:
                _set_cpu_devices(cpu_devices)
            return world()
        if cpu_devices is not None:
            _set_cpu_devices(cpu_devices)
        if jax_config.cpu_collectives_implementation.value in (None, "", "none"):
            jax.config.update("jax_cpu_collectives_implementation", "gloo")
        from jax._src import distributed

        already = distributed.global_state.client is not None
        if info.num_processes > 1 and not already:
            if _backend_started():
                raise DistributedSetupError(
                    "the JAX backend already started in this process, so it cannot join a run of "
                    f"{info.num_processes} processes: call sx.initialize() first, before any other JAX call")
            left = timeout_s
            if info.process_id != 0 and info.coordinator_address is not None:
                left -= _await_coordinator(info.coordinator_address, timeout_s)
            try:
                heartbeat = os.environ.get("SHARDAX_HEARTBEAT_S")
                jax.distributed.initialize(info.coordinator_address, info.num_processes, info.process_id,
                                           local_device_ids=local_device_ids,
                                           initialization_timeout=max(1, int(left)),
                                           heartbeat_timeout_seconds=int(heartbeat) if heartbeat else 100)
            except Exception as err:  # jaxlib raises XlaRuntimeError/RuntimeError with the cause in the text
                raise DistributedSetupError(
                    f"process {info.process_id} of {info.num_processes} could not join the run at "
                    f"{info.coordinator_address} (from {info.source}) within {timeout_s} s: {err}") from err
        _start_transport(info.num_processes)
        _started = info
        os.environ.setdefault("SHARDAX_INITIALIZED", "1")
        if info.num_processes > 1:
            _abort_on_uncaught_exception()
        return world()
