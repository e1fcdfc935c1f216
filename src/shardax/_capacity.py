"""Calling a kernel with the buffer sizes it asks for: the one retry loop for :class:`~shardax.CapacityError`."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from ._errors import CapacityError

R = TypeVar("R")


def retry_capacity(fn: Callable[..., R], /, *args: Any, max_tries: int = 6, headroom: float = 0.125,
                   **kwargs: Any) -> tuple[R, dict[str, int]]:
    """``fn(*args, **kwargs)``, called again with larger buffers for as long as it raises a :class:`CapacityError`
    that names the argument to grow.

    Kernels with fixed-size buffers (``capacity`` of ``paint``/``zsort``/``exchange``, ``halo_capacity`` and
    ``edge_capacity`` of ``fof``, ...) raise :class:`shardax.CapacityError` instead of dropping data, with
    ``err.argument`` (the keyword to pass) and ``err.needed`` (the size that would have been enough, the maximum over
    devices). Each retry passes ``{err.argument: size}`` with ``size = max(needed * (1 + headroom), 2 * previous)``
    (at least doubling, so an estimate that keeps growing still ends), on top of ``kwargs``. Every process sees the
    same error (the sizes are global maxima), so every process retries with the same arguments.

    Args:
        fn: the function to call (a global kernel such as ``sx.fields.paint`` or ``sx.spatial.fof.smap()``).
        *args: its positional arguments.
        max_tries: calls at most (the last error is raised after that).
        headroom: relative margin added to ``err.needed``, so that a slightly different next input fits too.
        **kwargs: its keyword arguments; sizes given here are a starting point and are grown like the others.

    Returns:
        ``(result, sizes)``: the result of the first call that succeeded and the keyword sizes it used (empty when
        the first call succeeded), to pass to later calls of the same shape: ``fn(*args, **kwargs, **sizes)``.

    Raises:
        CapacityError: the error names no argument (its message says what to change), or ``max_tries`` calls all
            overflowed.
        ValueError: ``max_tries`` is below 1 or ``headroom`` negative.

    Example:
        >>> import numpy as np, shardax as sx
        >>> part = sx.particles.from_numpy(np.random.default_rng(0).random((1000, 3), dtype=np.float32))
        >>> rho, sizes = sx.retry_capacity(sx.fields.paint, part, (16, 16, 16), box=1.0, capacity=4)
        >>> float(rho.sum()), sizes["capacity"] >= 8
        (1000.0, True)
    """
    if not isinstance(max_tries, int) or max_tries < 1:
        raise ValueError(f"max_tries must be an int >= 1, got {max_tries!r}")
    if not headroom >= 0:
        raise ValueError(f"headroom must be >= 0, got {headroom!r}")
    sizes: dict[str, int] = {}
    for attempt in range(max_tries):
        try:
            return fn(*args, **{**kwargs, **sizes}), sizes
        except CapacityError as err:
            if err.argument is None or err.needed is None or attempt == max_tries - 1:
                raise
            previous = sizes.get(err.argument, kwargs.get(err.argument) or 0)
            sizes[err.argument] = max(int(err.needed * (1 + headroom)) + 1, 2 * int(previous))
    raise AssertionError("unreachable")  # pragma: no cover
