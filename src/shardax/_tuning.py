"""Which backend a kernel shapes its static sizes for, and how much device memory a step may use.

Kernels keep their tile and loop sizes in a frozen ``Tuning`` chosen at trace time: small tiles that fit a CPU cache
on XLA:CPU, large steps that fill the device on a GPU (where every sequential loop step costs a fixed ~0.3 ms of
launches and host checks whatever it holds). Every kernel takes ``tuning=`` to override the choice: a ``Tuning`` of
its own, or ``"cpu"`` / ``"gpu"`` for that backend's preset (tests force the GPU preset on CPU with it).
``SHARDAX_TUNING=cpu|gpu`` sets the preset for every kernel of a process whose call does not name one.

The backend is that of the devices the kernel runs on: the ``devices`` a global wrapper passes (its mesh's), else,
while a ``shard_map`` / ``smap`` body is traced, the platform of that mesh's devices, else JAX's default backend.
A process with a GPU can thus run a kernel on a mesh of its CPU devices with the CPU preset, and the reverse.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import Any, Literal

import jax

TuningBackend = Literal["cpu", "gpu"]

# What a loop step may allocate when the device does not report its memory (XLA:CPU, or a GPU preset forced on CPU).
_DEFAULT_STEP_BYTES = 1 << 30
# Share of a device's memory one loop step's buffers may take: the rest holds the inputs, outputs and XLA's buffers.
_STEP_SHARE = 16


def _devices(devices: Iterable[Any] | None) -> list[Any]:
    return [] if devices is None else list(getattr(devices, "flat", devices))


def _context_platform() -> str | None:
    """The platform of the mesh whose ``shard_map`` body is being traced (JAX's abstract mesh), if any."""
    try:
        device = jax.sharding.get_abstract_mesh().abstract_device
    except Exception:  # no mesh in context, or a JAX whose abstract mesh has no device
        return None
    return getattr(device, "platform", None) or None


def device_platform(devices: Iterable[Any] | None = None) -> str:
    """The platform of ``devices`` (their first), else of the mesh being traced, else JAX's default backend."""
    listed = _devices(devices)
    if listed:
        return listed[0].platform
    return _context_platform() or jax.default_backend()


def tuning_backend(devices: Iterable[Any] | None = None) -> TuningBackend:
    """The preset a kernel uses: ``SHARDAX_TUNING`` if set, else ``"cpu"`` on CPU devices and ``"gpu"`` elsewhere.

    Args:
        devices: the devices the kernel runs on (e.g. ``mesh.devices``). Default: the devices of the mesh whose
            ``shard_map`` body is being traced, else JAX's default backend.

    Example:
        >>> import jax
        >>> import shardax as sx
        >>> sx.runtime.tuning_backend(jax.devices("cpu"))
        'cpu'
    """
    forced = os.environ.get("SHARDAX_TUNING", "")
    if forced:
        if forced not in ("cpu", "gpu"):
            raise ValueError(f"SHARDAX_TUNING must be 'cpu' or 'gpu', got {forced!r}")
        return forced  # type: ignore[return-value]
    return "cpu" if device_platform(devices) == "cpu" else "gpu"


def resolve_tuning(tuning: Any, presets: dict[str, Any], kind: type, where: str,
                   devices: Iterable[Any] | None = None) -> Any:
    """The ``Tuning`` a kernel runs with: ``tuning`` itself, a named preset, or the backend's preset for ``None``.

    Args:
        tuning: the caller's ``tuning=`` argument: ``None``, ``"cpu"``, ``"gpu"`` or an instance of ``kind``.
        presets: the kernel's preset for each backend, by name.
        kind: the kernel's ``Tuning`` class.
        where: the kernel's name, for the error message.
        devices: the devices the kernel runs on (see :func:`tuning_backend`).
    """
    if tuning is None:
        return presets[tuning_backend(devices)]
    if isinstance(tuning, str):
        if tuning not in presets:
            raise ValueError(f"{where}: tuning must be one of {sorted(presets)} or a {kind.__name__}, got {tuning!r}")
        return presets[tuning]
    if not isinstance(tuning, kind):
        raise TypeError(f"{where}: tuning must be None, 'cpu', 'gpu' or a {kind.__qualname__}, got "
                        f"{type(tuning).__name__}")
    return tuning


def step_bytes(devices: Iterable[Any] | None = None) -> int:
    """Bytes one sequential loop step's buffers may take on ``devices`` (a share of the device's memory; default:
    a local device of the platform :func:`device_platform` names)."""
    listed = _devices(devices)
    try:
        device = listed[0] if listed else jax.local_devices(backend=device_platform())[0]
        stats = device.memory_stats()
    except Exception:  # backends without memory statistics, or no local device of that platform
        stats = None
    limit = (stats or {}).get("bytes_limit")
    if not limit:
        return _DEFAULT_STEP_BYTES
    return max(int(limit) // _STEP_SHARE, 64 << 20)
