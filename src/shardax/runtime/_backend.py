"""Which backend a kernel shapes its static sizes for, and how much device memory a step may use.

Kernels keep their tile and loop sizes in a frozen ``Tuning`` chosen at trace time: small tiles that fit a CPU cache
on XLA:CPU, large steps that fill the device on a GPU (where every sequential loop step costs a fixed ~0.3 ms of
launches and host checks whatever it holds). Every kernel takes ``tuning=`` to override the choice: a ``Tuning`` of
its own, or ``"cpu"`` / ``"gpu"`` for that backend's preset (tests force the GPU preset on CPU with it).
``SHARDAX_TUNING=cpu|gpu`` sets the preset for every kernel of a process whose call does not name one.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any, Literal

import jax

TuningBackend = Literal["cpu", "gpu"]

# What a loop step may allocate when the device does not report its memory (XLA:CPU, or a GPU preset forced on CPU).
_DEFAULT_STEP_BYTES = 1 << 30
# Share of a device's memory one loop step's buffers may take: the rest holds the inputs, outputs and XLA's buffers.
_STEP_SHARE = 16


def tuning_backend(devices: Sequence[Any] | None = None) -> TuningBackend:
    """The preset a kernel uses: ``SHARDAX_TUNING`` if set, else ``"cpu"`` on CPU devices and ``"gpu"`` elsewhere.

    Args:
        devices: the devices the kernel runs on (default: JAX's default backend).

    Example:
        >>> import shardax as sx
        >>> sx.runtime.tuning_backend()
        'cpu'
    """
    forced = os.environ.get("SHARDAX_TUNING", "")
    if forced:
        if forced not in ("cpu", "gpu"):
            raise ValueError(f"SHARDAX_TUNING must be 'cpu' or 'gpu', got {forced!r}")
        return forced  # type: ignore[return-value]
    platform = devices[0].platform if devices else jax.default_backend()
    return "cpu" if platform == "cpu" else "gpu"


def resolve_tuning(tuning: Any, presets: dict[str, Any], kind: type, where: str) -> Any:
    """The ``Tuning`` a kernel runs with: ``tuning`` itself, a named preset, or the backend's preset for ``None``.

    Args:
        tuning: the caller's ``tuning=`` argument: ``None``, ``"cpu"``, ``"gpu"`` or an instance of ``kind``.
        presets: the kernel's preset for each backend, by name.
        kind: the kernel's ``Tuning`` class.
        where: the kernel's name, for the error message.
    """
    if tuning is None:
        return presets[tuning_backend()]
    if isinstance(tuning, str):
        if tuning not in presets:
            raise ValueError(f"{where}: tuning must be one of {sorted(presets)} or a {kind.__name__}, got {tuning!r}")
        return presets[tuning]
    if not isinstance(tuning, kind):
        raise TypeError(f"{where}: tuning must be None, 'cpu', 'gpu' or a {kind.__qualname__}, got "
                        f"{type(tuning).__name__}")
    return tuning


def step_bytes(devices: Sequence[Any] | None = None) -> int:
    """Bytes one sequential loop step's buffers may take on ``devices`` (a share of the device's memory)."""
    device = devices[0] if devices else jax.local_devices()[0]
    try:
        stats = device.memory_stats()
    except Exception:  # backends without memory statistics
        stats = None
    limit = (stats or {}).get("bytes_limit")
    if not limit:
        return _DEFAULT_STEP_BYTES
    return max(int(limit) // _STEP_SHARE, 64 << 20)
