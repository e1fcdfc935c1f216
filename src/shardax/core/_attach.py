"""The ``.smap`` attribute: the one way a local-view function gets the constructor of its global version.

:func:`attach_global` attaches a constructor ``f.smap(mesh=None, *, jit=True)`` built by any function (the global
wrappers written by hand, with host-side checks); :func:`distributed` builds one from specs by parameter name.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import Any, TypeVar

import jax
import numpy as np
from jax.sharding import Mesh, PartitionSpec

from ._smap import smap
from ._specs import ALL

F = TypeVar("F", bound=Callable[..., Any])
_ARRAY_TYPES = (jax.Array, np.ndarray, np.generic)


def attach_global(local: F, build: Callable[..., Callable[..., Any]]) -> F:
    """Give the local-view function ``local`` the constructor ``local.smap`` of its global version.

    ``local.smap(mesh=None, *, jit=True, **options)`` returns ``build(mesh, jit=jit, **options)``, made once per
    ``(mesh, jit, options)`` and kept: ``local.smap(mesh)(...)`` in a loop builds (and compiles) once. ``build`` is
    where a global wrapper written by hand lives (host-side checks of the global arguments, an :func:`smap` of a body
    around ``local``, overflow flags turned into :class:`shardax.CapacityError`); its docstring and signature become
    ``local.smap``'s. ``local`` itself is left untouched: it stays the local view, callable on one device without a
    mesh or inside another ``smap``. :func:`distributed` is this with ``build`` made from specs.

    Args:
        local: the local-view function.
        build: ``build(mesh, *, jit, **options) -> global function``; ``mesh`` is a ``jax.sharding.Mesh`` or
            ``None`` (the context mesh, else :func:`shardax.flat_mesh`, when the global function is called).
            Options are keyword arguments with hashable values (e.g. zsort's ``donate``); they are told apart by
            type and value, so ``donate=1`` does not find what ``donate=True`` built.

    Returns:
        ``local``, with the attribute ``smap``.

    Example:
        >>> import jax.numpy as jnp, shardax as sx
        >>> from jax.sharding import PartitionSpec as P
        >>> def total(x):  # local view: this device's rows
        ...     return sx.comm.allreduce(jnp.sum(x))
        >>> def global_total(mesh=None, *, jit=True):
        ...     '''``total.smap(mesh=None, *, jit=True)``: :func:`total` of a global ``(ndev, n)`` array.'''
        ...     fn = sx.smap(total, in_specs=P(sx.ALL), out_specs=P(), mesh=mesh, jit=jit)
        ...     def call(x):
        ...         if jnp.ndim(x) != 2:  # a host-side check of the global argument
        ...             raise ValueError(f"total.smap: x must have shape (ndev, n), got {jnp.shape(x)}")
        ...         return fn(x)
        ...     return call
        >>> total = sx.core.attach_global(total, global_total)
        >>> ndev = sx.world().device_count
        >>> int(total.smap()(jnp.ones((ndev, 4)))) == 4 * ndev and total.smap() is total.smap()
        True
    """
    if not callable(local) or not callable(build):
        raise TypeError(f"attach_global needs two callables (the local function and the builder of its global "
                        f"version), got {type(local).__name__} and {type(build).__name__}")
    where = f"{getattr(local, '__name__', 'f')}.smap"
    constructed: dict[Hashable, Callable[..., Any]] = {}

    @functools.wraps(build)
    def constructor(mesh: Mesh | None = None, *, jit: bool = True, **options: Any) -> Callable[..., Any]:
        key = _constructor_key(mesh, jit, options)
        try:
            built = constructed.get(key)
        except TypeError:  # an unhashable option: the checks below say which
            built = None
        if built is None:
            _check_constructor_arguments(mesh, jit, options, where)
            built = constructed[key] = build(mesh, jit=jit, **options)
        return built

    constructor.__name__ = "smap"
    constructor.__qualname__ = f"{getattr(local, '__qualname__', where[:-5])}.smap"
    local.smap = constructor  # type: ignore[attr-defined]
    return local


def _constructor_key(mesh: Any, jit: Any, options: dict[str, Any]) -> tuple:
    """What a ``.smap`` constructor's result depends on; values told apart by type (``jit=1`` is not ``True``)."""
    if not options:
        return (mesh, type(jit), jit)
    return (mesh, type(jit), jit, *((k, type(v), v) for k, v in sorted(options.items())))


def _check_constructor_arguments(mesh: Any, jit: Any, options: dict[str, Any], where: str) -> None:
    """Raise, naming the argument, for a ``.smap`` constructor's bad ``mesh``, ``jit`` or options."""
    if mesh is not None and not isinstance(mesh, Mesh):
        raise TypeError(f"{where}: mesh must be a jax.sharding.Mesh or None, got {type(mesh).__name__}")
    if not isinstance(jit, bool):
        raise TypeError(f"{where}: jit must be a bool, got {jit!r}")
    try:
        hash(_constructor_key(mesh, jit, options))
    except TypeError:
        raise TypeError(f"{where}: options must be hashable, got {options!r}") from None


def distributed(f: Callable | None = None, /, *, in_specs: Mapping[str, Any] | None = None, out_specs: Any = ALL,
                static_argnames: Sequence[str] = (), expand: bool = True, name: str | None = None) -> Any:
    """Attach ``f.smap(mesh=None, *, jit=True)``, which returns the global (shard-mapped) version of ``f``.

    ``f`` itself is left untouched: it stays the local-view function, callable on one device without a mesh or
    inside another ``smap``. The global function takes ``f``'s arguments, by position or by name (keyword-only
    parameters included), and is built by :func:`attach_global` (one per ``(mesh, jit)``) around :func:`smap` (one
    compilation per set of static values and argument structures).

    Args:
        f: the local-view function (or use ``@distributed(...)`` as a decorator factory).
        in_specs: specs by parameter name (each a pytree prefix of its argument). Parameters not named are static
            Python values if listed in ``static_argnames`` or not array-like, else replicated arrays (``P()``).
        out_specs: a pytree prefix of ``f``'s output (default: every output sharded over all axes).
        static_argnames: parameters that are always static (must be hashable; a new value recompiles).
        expand: the expanding convention of :func:`smap`.
        name: how the program guard's and the watchdog's messages name the function (as in :func:`smap`).

    Returns:
        ``f``, with the attribute ``smap``.

    Example:
        >>> import jax, jax.numpy as jnp, shardax as sx
        >>> from jax.sharding import PartitionSpec as P
        >>> @sx.distributed(out_specs=(P(sx.ALL), P()), static_argnames=("n",))
        ... def draw(n, seed):
        ...     x = jax.random.normal(jax.random.key(seed + sx.rank_info().rank), (n,))
        ...     return x, sx.comm.allreduce(jnp.sum(x))
        >>> x, total = draw.smap()(n=16, seed=0)
        >>> x.shape == (sx.world().device_count, 16)
        True
    """
    if f is None:
        return functools.partial(distributed, in_specs=in_specs, out_specs=out_specs,
                                 static_argnames=static_argnames, expand=expand, name=name)
    if not callable(f):
        raise TypeError(f"distributed needs a callable, got {type(f).__name__}")
    if name is not None and not isinstance(name, str):
        raise TypeError(f"distributed: name must be a str or None, got {type(name).__name__}")
    named, static_names = _by_name(f, in_specs, static_argnames)

    def build(mesh: Mesh | None = None, *, jit: bool = True) -> Callable[..., Any]:
        """The global version of the local-view function, on ``mesh`` (default: the context mesh, else
        :func:`shardax.flat_mesh`), jitted unless ``jit=False``."""
        return _global_by_name(f, named, static_names, mesh=mesh, jit=jit, out_specs=out_specs, expand=expand,
                               name=name)

    return attach_global(f, build)


def _by_name(f: Callable, in_specs: Mapping[str, Any] | None, static_argnames: Sequence[str]
             ) -> tuple[dict[str, Any], tuple[str, ...]]:
    """``in_specs`` and ``static_argnames`` checked against ``f``'s parameters."""
    named = dict(in_specs or {})
    static_names = tuple(static_argnames)
    params = list(inspect.signature(f).parameters)
    for key in (*named, *static_names):
        if key not in params:
            raise ValueError(f"{f.__name__} has no parameter {key!r} (parameters: {params})")
    overlap = set(named) & set(static_names)
    if overlap:
        raise ValueError(f"parameters {sorted(overlap)} are both in in_specs and static_argnames")
    return named, static_names


def _global_by_name(f: Callable, named: dict[str, Any], static_names: tuple[str, ...], *, mesh: Mesh | None,
                    jit: bool, out_specs: Any, expand: bool, name: str | None) -> Callable[..., Any]:
    """The global function of ``f``: each call's arguments bound by name, given their specs, passed to ``smap``."""
    signature = inspect.signature(f)
    params = list(signature.parameters)
    cache: dict[Hashable, Callable[..., Any]] = {}

    @functools.wraps(f)
    def call(*args: Any, **kwargs: Any) -> Any:
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        values = [bound.arguments[p] for p in params]
        specs = tuple(named[p] if p in named else None if p in static_names or not _is_array_like(v)
                      else PartitionSpec() for p, v in zip(params, values, strict=True))
        key = tuple(s is None for s in specs)  # the specs follow from which arguments are static
        fn = cache.get(key)
        if fn is None:
            fn = cache[key] = smap(f, in_specs=specs, out_specs=out_specs, mesh=mesh, expand=expand, jit=jit,
                                   name=name)
        return fn(*values)

    return call


def _is_array_like(value: Any) -> bool:
    """Whether every leaf of ``value`` is an array (a replicated argument, not a static one)."""
    leaves = jax.tree.leaves(value)
    return bool(leaves) and all(isinstance(x, _ARRAY_TYPES) for x in leaves)
