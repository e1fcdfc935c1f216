"""NumPy references for the field tests (CIC paint and readout, binned power spectrum); no tests here.

Kept free of conftest so that the multi-process test bodies can import it.
"""

from __future__ import annotations

import itertools

import numpy as np


def cic_numpy(pos: np.ndarray, mass: np.ndarray, shape: tuple[int, ...], box: float) -> np.ndarray:
    """Plain CIC: grid point i at i * box / n, periodic."""
    scaled = pos / (box / np.asarray(shape))
    lower = np.floor(scaled).astype(np.int64)
    frac = scaled - lower
    rho = np.zeros(shape)
    for corner in itertools.product((0, 1), repeat=3):
        weight = np.prod([frac[:, d] if c else 1 - frac[:, d] for d, c in enumerate(corner)], axis=0)
        index = tuple((lower[:, d] + c) % shape[d] for d, c in enumerate(corner))
        np.add.at(rho, index, mass * weight)
    return rho


def readout_numpy(field: np.ndarray, pos: np.ndarray, box: float) -> np.ndarray:
    shape = field.shape
    scaled = pos / (box / np.asarray(shape))
    lower = np.floor(scaled).astype(np.int64)
    frac = scaled - lower
    out = np.zeros(len(pos))
    for corner in itertools.product((0, 1), repeat=3):
        weight = np.prod([frac[:, d] if c else 1 - frac[:, d] for d, c in enumerate(corner)], axis=0)
        out += field[tuple((lower[:, d] + c) % shape[d] for d, c in enumerate(corner))] * weight
    return out


def binned_numpy(delta: np.ndarray, box: float, edges: np.ndarray) -> tuple[np.ndarray, ...]:
    """Binned |delta_k|^2 V / N^2 over the half spectrum (conjugate partners counted), zero mode left out."""
    n = delta.shape[0]
    spectrum = np.abs(np.fft.rfftn(delta)) ** 2 * box**3 / n**6
    k = 2 * np.pi * np.sqrt(np.fft.fftfreq(n, box / n)[:, None, None] ** 2
                            + np.fft.fftfreq(n, box / n)[None, :, None] ** 2
                            + np.fft.rfftfreq(n, box / n)[None, None, :] ** 2)
    j = np.arange(n // 2 + 1)[None, None, :]
    weight = np.where((j > 0) & (2 * j != n), 2, 1) * (k > 0)
    weight = np.broadcast_to(weight, k.shape)
    index = np.digitize(k, edges) - 1
    ok = (index >= 0) & (index < len(edges) - 1) & (weight > 0)
    modes = np.bincount(index[ok], weight[ok], len(edges) - 1)
    pk = np.bincount(index[ok], (weight * spectrum)[ok], len(edges) - 1) / np.maximum(modes, 1)
    kmean = np.bincount(index[ok], (weight * k)[ok], len(edges) - 1) / np.maximum(modes, 1)
    return kmean, pk, modes.astype(np.int64)
