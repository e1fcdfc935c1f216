"""The field references under the names the field tests import (kept free of conftest so that the multi-process
test bodies can import it); the references themselves are :mod:`shardax.testing.reference`'s.

New code imports ``shardax.testing.reference`` directly: ``cic_paint``, ``cic_readout``, ``power_spectrum``.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from shardax.testing import reference


def cic_numpy(pos: Any, mass: Any, shape: tuple[int, ...], box: float) -> np.ndarray:
    """:func:`shardax.testing.reference.cic_paint`: grid point i at i * box / n, periodic."""
    return reference.cic_paint(pos, shape, box=box, mass=mass)


def readout_numpy(field: Any, pos: Any, box: float) -> np.ndarray:
    """:func:`shardax.testing.reference.cic_readout`."""
    return reference.cic_readout(field, pos, box=box)


def binned_numpy(delta: Any, box: float, edges: Any) -> tuple[np.ndarray, ...]:
    """:func:`shardax.testing.reference.power_spectrum` without the CIC window (``compensate=False``)."""
    return reference.power_spectrum(delta, box=box, edges=edges, compensate=False)
