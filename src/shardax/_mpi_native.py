"""The MPI transport's native call: an XLA FFI handler (``_mpi_native.c``) built on first use and loaded here.

The collective runs inside XLA's program, straight between XLA's buffers, with no Python in the call. Where every
process holds one device of the group (``mpirun -n N`` with one CPU device each, the setup of mpi4jax), each device's
thread makes one ``MPI_Allreduce`` or ``MPI_Alltoallv``. With several devices per process, allreduce, all_to_all and
alltoallv over every device meet at a barrier of the call site and one thread makes the MPI call for the process
(see ``_mpi_native.c``). Other collectives of such meshes keep the host calls of :mod:`shardax._mpi_host`.

The handler is compiled once per machine and MPI library with the compiler wrapper mpi4py was built with
(``mpi4py.get_config()["mpicc"]``, else the vendor's ``mpicc.openmpi``/``mpicc.mpich``, else ``mpicc`` on the
``PATH``; ``$MPICC`` overrides) against the XLA FFI
headers jaxlib ships, into ``$XDG_CACHE_HOME/shardax/mpi`` (``~/.cache/shardax/mpi``). Nothing to install: when no
compiler is found, or it fails, the transport keeps its host calls and ``shardax doctor`` says why.
``SHARDAX_MPI_NATIVE=0`` turns the native call off, ``=1`` makes a failed build an error.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path
from typing import Any

ENV = "SHARDAX_MPI_NATIVE"
TARGET = "shardax_mpi_collective"
_SOURCE = Path(__file__).with_name("_mpi_native.c")
_LOCK = threading.Lock()
_state: dict[str, Any] = {}


def _mode() -> str:
    value = os.environ.get(ENV, "auto").strip().lower()
    if value not in ("auto", "0", "1"):
        raise ValueError(f"{ENV}={value!r}: use 'auto' (the default: native where it builds), '1' (native, a failed "
                         "build is an error) or '0' (host calls)")
    return value


def _compiler() -> str | None:
    """``$MPICC``, else the wrapper mpi4py was built with, else the vendor's own wrapper where several MPIs are
    installed side by side (Debian's ``mpicc.openmpi``/``mpicc.mpich``), else ``mpicc``."""
    if os.environ.get("MPICC"):
        return os.environ["MPICC"]
    try:
        import mpi4py
        from mpi4py import MPI

        configured = mpi4py.get_config().get("mpicc")
        vendor = "mpich" if MPI.Get_library_version().lstrip().upper().startswith("MPICH") else "openmpi"
    except Exception:  # any failure to read mpi4py's config: fall back to the PATH
        configured, vendor = None, "openmpi"
    for candidate in (configured, f"mpicc.{vendor}", "mpicc"):
        if candidate and shutil.which(candidate.split()[0]):
            return candidate
    return None


def cache_dir() -> Path:
    """Where the built handler is kept: ``$XDG_CACHE_HOME/shardax/mpi``, else ``~/.cache/shardax/mpi``."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "shardax" / "mpi"


def _build() -> Path:
    """The shared library, compiled unless this source, compiler and MPI library already built one."""
    import jax.ffi
    from mpi4py import MPI

    compiler = _compiler()
    if compiler is None:
        raise RuntimeError("no MPI compiler wrapper (mpicc) found: install your MPI's development files (e.g. "
                           "libopenmpi-dev) or set MPICC")
    include = jax.ffi.include_dir()
    header = Path(include, "xla", "ffi", "api", "c_api.h").read_bytes()
    key = hashlib.sha256(b"\0".join([_SOURCE.read_bytes(), header, compiler.encode(),
                                     MPI.Get_library_version().encode()])).hexdigest()[:16]
    target = cache_dir() / f"shardax_mpi_{key}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    cmd = [*compiler.split(), "-O2", "-std=c11", "-shared", "-fPIC", f"-I{include}", str(_SOURCE), "-o", tmp]
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if done.returncode:
        os.unlink(tmp)
        raise RuntimeError(f"{' '.join(cmd)} failed: {done.stderr.strip()[-500:]}")
    os.replace(tmp, target)  # atomic: processes building at once each install a whole file
    return target


def load() -> ctypes.CDLL | None:
    """The handler's library, built and registered with XLA on the first call; ``None`` where it is off or cannot
    be had (:func:`reason` says why)."""
    with _LOCK:
        if "lib" in _state:
            return _state["lib"]
        _state["lib"] = None
        mode = _mode()
        if mode == "0":
            _state["reason"] = f"host calls ({ENV}=0)"
            return None
        try:
            path = _build()
            lib = ctypes.CDLL(str(path))
            lib.shardax_mpi_set_comm.argtypes = [ctypes.c_int, ctypes.c_int64]
            lib.shardax_mpi_comm_size.argtypes = [ctypes.c_int]
            lib.shardax_mpi_library_version.argtypes = [ctypes.c_char_p, ctypes.c_int]
            _same_library(lib)
            import jax.ffi

            jax.ffi.register_ffi_target(TARGET, jax.ffi.pycapsule(lib.shardax_mpi_collective), platform="cpu")
        except Exception as err:
            if mode == "1":
                raise RuntimeError(f"{ENV}=1 but the MPI transport's native call is not available: {err}") from err
            _state["reason"] = f"host calls (the native call did not build: {err})"
            return None
        _state["lib"], _state["path"] = lib, path
        _state["reason"] = f"native FFI call ({path})"
        _state["comms"] = {}
        return lib


def _same_library(lib: ctypes.CDLL) -> None:
    """Refuse a handler bound to another MPI library than mpi4py's (two MPIs installed side by side)."""
    from mpi4py import MPI

    text = ctypes.create_string_buffer(8192)
    if lib.shardax_mpi_library_version(text, len(text)):
        raise RuntimeError("MPI_Get_library_version failed in the native call's library")
    ours = text.value.decode(errors="replace").strip("\0 \n")
    theirs = MPI.Get_library_version().strip("\0 \n")  # (Open MPI's string ends with its NUL)
    if ours.split("\n")[0] != theirs.split("\n")[0]:
        raise RuntimeError(f"the native call was built for {ours[:60]!r} but mpi4py runs {theirs[:60]!r}: set MPICC "
                           "to the compiler wrapper of mpi4py's MPI")


def reason() -> str:
    """How one-device-per-process collectives cross processes, and why (for ``shardax doctor``)."""
    load()
    return str(_state.get("reason", ""))


def comm_index(comm: Any) -> int:
    """The handler's index of the mpi4py communicator ``comm`` (registered on first use)."""
    from mpi4py import MPI

    lib = load()
    assert lib is not None
    comms: dict[int, int] = _state["comms"]
    handle = int(MPI._handleof(comm))  # pyright: ignore[reportAttributeAccessIssue]
    if handle not in comms:
        index = len(comms)
        signed = handle - (1 << 64) if handle >= 1 << 63 else handle
        if lib.shardax_mpi_set_comm(index, signed):
            raise RuntimeError("the MPI transport's native call holds 64 communicators at most")
        if lib.shardax_mpi_comm_size(index) != comm.Get_size():
            raise RuntimeError("the native call's MPI does not read mpi4py's communicator: set SHARDAX_MPI_NATIVE=0")
        comms[handle] = index
    return comms[handle]
