"""Test configuration: 8 CPU devices in this process and strict numerics (set before the JAX backend starts)."""

from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax

jax.config.update("jax_num_cpu_devices", 8)
jax.config.update("jax_numpy_dtype_promotion", "strict")
jax.config.update("jax_numpy_rank_promotion", "raise")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
from jax.sharding import Mesh  # noqa: E402

# Mesh shapes every distributed feature is checked on (see STYLE.md).
MESH_SHAPES = [(1,), (2,), (4,), (8,), (2, 2), (2, 4)]


def make_mesh(shape: tuple[int, ...]) -> Mesh:
    """A mesh over the first prod(shape) local CPU devices, axes named x, y (Auto axis types)."""
    n = int(np.prod(shape))
    names = ("x", "y", "z")[: len(shape)]
    return Mesh(np.array(jax.devices()[:n]).reshape(shape), names)


@pytest.fixture(params=MESH_SHAPES, ids=lambda s: "x".join(map(str, s)))
def mesh(request: pytest.FixtureRequest) -> Mesh:
    return make_mesh(request.param)
