"""Determinism matrix: the whole pipeline (zsort, knn, fof, potrs, fftn) on 1 device, 8 devices in one process and
2 processes x 4 devices gives identical integer results and float results within tolerance."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
from jax.sharding import Mesh

import shardax as sx

sys.path.insert(0, str(Path(__file__).parent / "cluster"))
from pipeline import run_pipeline

INTEGER = ("zsort_ids", "knn_indices", "fof_labels")
FLOAT = ("zsort_pos", "knn_distances", "potrs_x", "fftn")


def pipeline_in_world() -> dict:
    return run_pipeline(sx.flat_mesh())


def _mesh(n: int) -> Mesh:
    import jax

    return Mesh(np.array(jax.devices()[:n]), ("d",))


@pytest.mark.multiprocess
def test_same_results_at_every_scale():
    one = run_pipeline(_mesh(1))
    eight = run_pipeline(_mesh(8))
    two_by_four = sx.testing.run_distributed(pipeline_in_world, num_processes=2, cpu_devices=4, timeout_s=900)
    assert all(not key.startswith("skipped_") for key in one), [k for k in one if k.startswith("skipped_")]
    for label, other in (("8 devices", eight), ("2 processes x 4", two_by_four[0]), ("process 1", two_by_four[1])):
        for key in INTEGER:
            np.testing.assert_array_equal(other[key], one[key], err_msg=f"{key}: {label} vs 1 device")
        for key in FLOAT:
            try:
                sx.testing.assert_allclose(other[key], one[key], kind="linalg" if key == "potrs_x" else "default")
            except AssertionError as err:
                raise AssertionError(f"{key}: {label} vs 1 device\n{err}") from None
    assert len(np.unique(one["fof_labels"])) > 2, "the pipeline's FoF finds groups"
