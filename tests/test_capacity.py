"""sx.retry_capacity: the one retry loop for CapacityError (grows the named buffer, raises what it cannot fix)."""

from __future__ import annotations

import numpy as np
import pytest

import shardax as sx


def _kernel(needs: dict[str, int], calls: list[dict[str, int]]):
    """A stand-in kernel: raises CapacityError for the first buffer smaller than ``needs`` says."""

    def kernel(x, *, scale=1, **sizes):
        calls.append(dict(sizes))
        for name, needed in needs.items():
            if (sizes.get(name) or 0) < needed:
                raise sx.CapacityError(f"{name} too small", needed=needed, available=sizes.get(name),
                                       argument=name)
        return x * scale

    return kernel


def test_grows_each_named_buffer_until_the_call_fits() -> None:
    calls: list[dict[str, int]] = []
    result, sizes = sx.retry_capacity(_kernel({"halo_capacity": 100, "edge_capacity": 50}, calls), 3, scale=2)
    assert result == 6
    assert sizes == {"halo_capacity": 113, "edge_capacity": 57}      # needed * 1.125 + 1
    assert calls == [{}, {"halo_capacity": 113}, sizes]


def test_at_least_doubles_and_starts_from_the_given_size() -> None:
    calls: list[dict[str, int]] = []
    result, sizes = sx.retry_capacity(_kernel({"capacity": 300}, calls), 1, capacity=200, headroom=0.0)
    assert result == 1 and sizes == {"capacity": 400}                 # 2 x 200 > 300 + 1
    assert calls == [{"capacity": 200}, {"capacity": 400}]


def test_raises_what_it_cannot_fix() -> None:
    def unfixable(**_):
        raise sx.CapacityError("too many groups for the box", needed=None, argument=None)

    with pytest.raises(sx.CapacityError, match="too many groups"):
        sx.retry_capacity(unfixable)
    calls: list[dict[str, int]] = []

    def never_enough(**sizes):                   # every call needs more than it was given
        calls.append(dict(sizes))
        raise sx.CapacityError("capacity too small", needed=3 * (sizes.get("capacity") or 1), argument="capacity")

    with pytest.raises(sx.CapacityError, match="capacity too small"):
        sx.retry_capacity(never_enough, max_tries=3, headroom=0.0)
    assert calls == [{}, {"capacity": 4}, {"capacity": 13}]
    with pytest.raises(ValueError, match="max_tries"):
        sx.retry_capacity(lambda: 0, max_tries=0)
    with pytest.raises(ValueError, match="headroom"):
        sx.retry_capacity(lambda: 0, headroom=-1.0)


def test_paint_on_eight_devices_with_a_buffer_too_small() -> None:
    """A real kernel: paint's exchange overflows with capacity=4 rows on 8 devices and is redone with what it
    asked for; the field is the one-device field and every particle is painted."""
    pos = np.random.default_rng(0).random((2000, 3), dtype=np.float32)
    part8 = sx.particles.from_numpy(pos)                                # 8 devices (tests/conftest.py)
    rho, sizes = sx.retry_capacity(sx.fields.paint, part8, (8, 8, 8), box=1.0, capacity=4)
    assert set(sizes) == {"capacity"} and sizes["capacity"] > 4
    assert float(rho.sum()) == pytest.approx(2000.0, rel=1e-5)
    again = sx.fields.paint(part8, (8, 8, 8), box=1.0)                # default capacity: the same field
    np.testing.assert_allclose(np.asarray(rho), np.asarray(again), rtol=1e-5, atol=1e-5)
