"""shard_map extensions: ``ALL``, static arguments, the expanding convention and ``.smap`` constructors."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import Any

import jax
import numpy as np
from jax.core import Tracer
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from .._compile import compile_ahead
from .._guard import last_call
from .._watchdog import watch
from ..runtime import flat_mesh
from ._guarded import Guarded


class _AllAxes:
    """Marker for "every mesh axis" in a PartitionSpec entry or as a whole spec (also spelled ``-1``)."""

    _instance: _AllAxes | None = None

    def __new__(cls) -> _AllAxes:
        if cls._instance is None:
            cls._instance = super().__new__(cls)
        return cls._instance

    def __repr__(self) -> str:
        return "ALL"

    def __reduce__(self):
        return (_AllAxes, ())


ALL = _AllAxes()


def _is_all(entry: Any) -> bool:
    return entry is ALL or (isinstance(entry, int) and not isinstance(entry, bool) and entry == -1)


def _is_spec(x: Any) -> bool:
    return x is None or isinstance(x, PartitionSpec) or _is_all(x)


def _is_spec_value(x: Any) -> bool:
    """A spec in a full (broadcast) spec tree, where ``None`` is an empty subtree (a ``None`` field), not a spec."""
    return isinstance(x, PartitionSpec) or _is_all(x)


def resolve_spec(spec: Any, mesh: Mesh, where: str) -> PartitionSpec:
    """``spec`` with ``ALL``/``-1`` replaced by every axis of ``mesh``; unknown axis names are an error."""
    axes = tuple(mesh.axis_names)
    if _is_all(spec):
        return PartitionSpec(axes)
    if not isinstance(spec, PartitionSpec):
        raise TypeError(f"{where}: expected a PartitionSpec, sx.ALL or None, got {spec!r}")
    entries = []
    used: set[str] = set()
    for entry in spec:
        if _is_all(entry):
            entry = axes
        if entry is None or entry is PartitionSpec.UNCONSTRAINED:
            entries.append(entry)
            continue
        if isinstance(entry, str):
            names: tuple = (entry,)
        elif isinstance(entry, tuple | list) and all(isinstance(n, str) for n in entry):
            names = tuple(entry)
        else:
            raise TypeError(f"{where}: spec {spec} has entry {entry!r}; entries must be None, a mesh axis name, a "
                            "tuple of names, or sx.ALL / -1")
        for name in names:
            if name not in axes:
                raise ValueError(f"{where}: spec {spec} names mesh axis {name!r}, but the mesh has axes {axes}")
            if name in used:
                raise ValueError(f"{where}: spec {spec} uses mesh axis {name!r} for two dimensions; each mesh axis "
                                 "may split at most one dimension")
            used.add(name)
        entries.append(entry)
    return PartitionSpec(*entries)


def _spec_axes(entry: Any) -> tuple[str, ...]:
    if entry is None:
        return ()
    return (entry,) if isinstance(entry, str) else tuple(entry)


def _context_mesh() -> Mesh | None:
    from jax._src import mesh as mesh_lib

    try:
        mesh = jax.sharding.get_mesh()
    except ValueError:  # inside jit, where get_mesh refuses; jax.set_mesh's concrete mesh is still set
        mesh = mesh_lib.get_concrete_mesh()
    if isinstance(mesh, Mesh) and not mesh.empty:
        return mesh

    legacy = mesh_lib.thread_resources.env.physical_mesh
    if isinstance(legacy, Mesh) and not legacy.empty:
        return legacy
    return None


def default_mesh(mesh: Mesh | None) -> Mesh:
    """``mesh``, else the context mesh (``jax.set_mesh`` / ``with mesh:``), else :func:`shardax.flat_mesh`."""
    if mesh is None:
        return _context_mesh() or flat_mesh()
    if not isinstance(mesh, Mesh):
        raise TypeError(f"mesh must be a jax.sharding.Mesh or None, got {type(mesh).__name__}")
    return mesh


def _positional(f: Callable, signature: inspect.Signature) -> Callable:
    """``f`` taking its keyword-only parameters positionally, after the others, in signature order."""
    params = list(signature.parameters.values())
    n_pos = sum(p.kind is not p.KEYWORD_ONLY for p in params)
    kw_names = [p.name for p in params if p.kind is p.KEYWORD_ONLY]

    @functools.wraps(f)
    def call(*args: Any) -> Any:
        return f(*args[:n_pos], **dict(zip(kw_names, args[n_pos:], strict=False)))  # absent: defaults

    return call


def _broadcast_specs(specs: Any, tree: Any, where: str) -> Any:
    """Specs as a full tree matching ``tree`` (``specs`` is a prefix of it)."""
    try:
        return jax.tree.map(lambda s, sub: jax.tree.map(lambda _: PartitionSpec() if s is None else s, sub),
                            specs, tree, is_leaf=_is_spec)
    except ValueError as err:
        raise ValueError(f"{where} does not match the structure of the value: {err}") from None


def _check_leaf(x: Any, spec: PartitionSpec, mesh: Mesh, where: str, expand: bool) -> None:
    shape = np.shape(x)
    if len(spec) > len(shape):
        raise ValueError(f"{where} has shape {shape} (rank {len(shape)}) but its spec {spec} has {len(spec)} "
                         "entries; a spec may not be longer than the array's rank")
    for dim, entry in enumerate(spec):
        axes = _spec_axes(entry)
        if not axes:
            continue
        parts = int(np.prod([mesh.shape[a] for a in axes]))
        if expand and dim == 0:
            if shape[0] != parts:
                raise ValueError(
                    f"{where} has shape {shape}; with expand=True its leading axis must be the number of shards "
                    f"along {axes} ({parts}), one row per device. Pass expand=False for plain shard_map tiling, "
                    "or reshape it to (ndev, n, ...).")
        elif shape[dim] % parts:
            raise ValueError(f"{where} maps array axis {dim} (of size {shape[dim]}) to mesh axes {axes} (of size "
                             f"{parts}), but {parts} does not evenly divide {shape[dim]}")


def _squeeze_leading(spec: PartitionSpec) -> Callable[[jax.Array], jax.Array]:
    if spec and spec[0] is not None:
        return lambda a: a.reshape(a.shape[1:])
    return lambda a: a


def _expand_leading(spec: PartitionSpec) -> Callable[[jax.Array], jax.Array]:
    if spec and spec[0] is not None:
        return lambda a: jax.numpy.reshape(a, (1, *jax.numpy.shape(a)))
    return lambda a: a


def smap(f: Callable, /, *, in_specs: Any, out_specs: Any, mesh: Mesh | None = None, expand: bool = True,
         jit: bool = False, donate_argnums: int | tuple[int, ...] = (), name: str | None = None) -> Callable:
    """``jax.shard_map`` with the conveniences of MPI-style particle codes.

    On top of ``jax.shard_map``:

    - ``sx.ALL`` (or ``-1``) in a spec, or as a whole spec, means every mesh axis, so code never hard-codes axis names;
    - ``mesh=None`` takes the context mesh (``jax.set_mesh``), else :func:`shardax.flat_mesh`; a mesh with
      explicit axes (``jax.make_mesh``'s default) works as well: each input is moved to its spec first;
    - ``None`` as a top-level entry of ``in_specs`` marks a static (non-array, hashable) argument;
    - with ``expand=True`` an input sharded along its leading axis, of global shape ``(ndev, n, ...)``, arrives in
      ``f`` as ``(n, ...)``, and every output sharded along its leading axis (scalars included) leaves with a
      leading ``ndev`` axis: jz-tree's expanding shard_map;
    - ``jit=True`` returns a jitted function (one compilation per set of static values), and ``donate_argnums``
      hands the buffers of those arguments to it (as in ``jax.jit``): outputs of the same shape and sharding reuse
      them, which saves a copy of the data per device, and the donated arrays cannot be used after the call.

    Args:
        f: the local-view function.
        in_specs: one spec per positional argument (a tuple), or a single spec for every argument; each may be a
            pytree prefix of its argument. ``None`` marks a static argument.
        out_specs: a pytree prefix of ``f``'s output.
        mesh: the mesh; default as above.
        expand: the expanding convention above (``False`` gives plain ``shard_map`` tiling).
        jit: wrap the result in ``jax.jit``.
        donate_argnums: positional argument(s) whose buffers the jitted call may reuse (needs ``jit=True``; not a
            static argument).
        name: how the program guard's and the watchdog's messages name the function (e.g. ``"knn.smap"``);
            default: the public shardax function called, else ``f``'s qualified name.

    Returns:
        The global function, taking the same arguments as ``f`` (keyword arguments are bound by ``f``'s signature).

    Example:
        >>> import jax, jax.numpy as jnp, shardax as sx
        >>> from jax.sharding import PartitionSpec as P
        >>> def f(seed):
        ...     rank, ndev, axes = sx.rank_info()
        ...     pos = jax.random.uniform(jax.random.key(seed + rank), (100, 3))
        ...     loc = jnp.sum(pos ** 2)
        ...     return pos, loc, sx.comm.allreduce(loc)
        >>> pos, loc, total = sx.smap(f, in_specs=(None,), out_specs=(P(sx.ALL), P(sx.ALL), P()), jit=True)(0)
        >>> pos.shape == (sx.world().device_count, 100, 3) and loc.shape == (sx.world().device_count,)
        True
    """
    if not callable(f):
        raise TypeError(f"smap needs a callable, got {type(f).__name__}")
    if not isinstance(expand, bool) or not isinstance(jit, bool):
        raise TypeError(f"expand and jit must be bool, got expand={expand!r}, jit={jit!r}")
    donate = (donate_argnums,) if isinstance(donate_argnums, int) else donate_argnums
    if not isinstance(donate, tuple) or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0
                                                 for i in donate):
        raise TypeError(f"donate_argnums must be a non-negative int or a tuple of them, got {donate_argnums!r}")
    if donate and not jit:
        raise ValueError("donate_argnums needs jit=True (only a jitted call can reuse the donated buffers)")
    if name is not None and not isinstance(name, str):
        raise TypeError(f"name must be a str or None, got {type(name).__name__}")
    try:
        signature: inspect.Signature | None = inspect.signature(f)
    except (TypeError, ValueError):
        signature = None
    params = list(signature.parameters) if signature is not None else []
    fname = getattr(f, "__name__", repr(f))

    def arg_name(i: int) -> str:
        return f"argument {params[i]!r} of {fname}" if i < len(params) else f"argument {i} of {fname}"

    guard = Guarded(f, name, params, arg_name)
    if signature is not None and any(p.kind is p.KEYWORD_ONLY for p in signature.parameters.values()):
        f = _positional(f, signature)
    cache: dict[Hashable, Callable] = {}

    def bind(args: tuple, kwargs: dict) -> tuple:
        if not kwargs:
            return args
        if signature is None:
            raise TypeError(f"{fname}: keyword arguments need a function with an inspectable signature")
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        return tuple(bound.arguments.values())

    @functools.wraps(f)
    def global_fn(*args: Any, **kwargs: Any) -> Any:
        args = bind(args, kwargs)
        the_mesh = default_mesh(mesh)
        specs = _per_argument(in_specs, len(args), fname)
        static = tuple(i for i, s in enumerate(specs) if s is None)
        key = _cache_key(the_mesh, args, static, arg_name)
        dyn_idx = tuple(i for i in range(len(args)) if i not in static)
        dyn_specs = tuple(_full_specs(args[i], specs[i], the_mesh, expand, arg_name(i)) for i in dyn_idx)
        fn = cache.get(key)
        if fn is None:
            fn = _build(f, the_mesh, args, static, dyn_specs, out_specs, expand, fname)
            if jit:
                fn = _jit(fn, donate, dyn_idx, the_mesh, f"donate_argnums={donate_argnums!r}", fname)
            cache[key] = fn
        dyn_args = tuple(args[i] for i in dyn_idx)
        leaves = jax.tree.leaves(dyn_args)
        traced = any(isinstance(leaf, Tracer) for leaf in leaves)
        guard.check(key, args, static, leaves, the_mesh, traced=traced)
        if traced:
            return fn(*dyn_args)  # inside an outer jit (checked as it is traced): the outer call is what runs
        out = fn(*dyn_args)
        number, description = last_call()
        watch(number, description, out)
        return out

    return global_fn


def _per_argument(in_specs: Any, n_args: int, fname: str) -> tuple:
    """One spec (or ``None``: static) per positional argument."""
    if isinstance(in_specs, tuple | list) and not isinstance(in_specs, PartitionSpec):
        if len(in_specs) != n_args:
            raise ValueError(f"{fname} got {n_args} argument(s) but in_specs has {len(in_specs)} entries")
        return tuple(in_specs)
    return (in_specs,) * n_args


def _cache_key(mesh: Mesh, args: tuple, static: tuple[int, ...], arg_name: Callable[[int], str]) -> Hashable:
    """What fixes the built function: the mesh, the static values, and the array arguments' pytree structures (the
    built function bakes in the specs broadcast over them: a particle set with or without mass needs its own)."""
    static_vals = tuple(args[i] for i in static)
    structure = tuple(jax.tree.structure(args[i]) for i in range(len(args)) if i not in static)
    key = (mesh, static, static_vals, structure)
    try:
        hash(key)
    except TypeError:
        bad = [arg_name(i) for i, v in zip(static, static_vals, strict=True) if not isinstance(v, Hashable)]
        raise TypeError(f"{', '.join(bad)} is marked static (in_spec None) but is not hashable; pass arrays "
                        "with a PartitionSpec instead") from None
    return key


def _full_specs(arg: Any, spec: Any, mesh: Mesh, expand: bool, where: str) -> Any:
    """``spec`` broadcast over ``arg``'s pytree and resolved on ``mesh``, each leaf checked against its spec."""
    full = _broadcast_specs(spec, arg, f"in_specs for {where}")
    full = jax.tree.map(lambda s: _resolve_or_replicated(s, mesh, f"in_specs for {where}"), full,
                        is_leaf=_is_spec_value)
    leaves = jax.tree.leaves(arg)
    spec_leaves = jax.tree.leaves(full, is_leaf=lambda s: isinstance(s, PartitionSpec))
    for j, (leaf, sp) in enumerate(zip(leaves, spec_leaves, strict=True)):
        _check_leaf(leaf, sp, mesh, where if len(leaves) == 1 else f"leaf {j} of {where}", expand)
    return full


def _jit(fn: Callable, donate: tuple[int, ...], dyn_idx: tuple[int, ...], mesh: Mesh, donate_text: str,
         fname: str) -> Callable:
    for i in donate:
        if i not in dyn_idx:
            raise ValueError(f"{donate_text}: {i} is not a positional array argument of {fname} (static ones "
                             "cannot be donated)")
    jitted = jax.jit(fn, donate_argnums=tuple(dyn_idx.index(i) for i in donate))
    # Several CPU devices of this process: compiled with operations kept whole (see runtime._compile).
    return compile_ahead(jitted, mesh.devices.flat)


def _build(f: Callable, mesh: Mesh, args: tuple, static: tuple[int, ...], dyn_specs: tuple, out_specs: Any,
           expand: bool, name: str) -> Callable:
    static_vals = {i: args[i] for i in static}
    n_args = len(args)
    is_pspec = lambda x: isinstance(x, PartitionSpec)  # noqa: E731

    def body(*dyn: Any) -> Any:
        if expand:
            dyn = tuple(jax.tree.map(lambda sp, a: _squeeze_leading(sp)(a), s, d, is_leaf=is_pspec)
                        for s, d in zip(dyn_specs, dyn, strict=True))
        it = iter(dyn)
        out = f(*[static_vals[i] if i in static_vals else next(it) for i in range(n_args)])
        if expand:
            specs = _broadcast_specs(out_specs, out, f"out_specs of {name}")
            specs = jax.tree.map(lambda s: _resolve_or_replicated(s, mesh, f"out_specs of {name}"), specs,
                                 is_leaf=_is_spec_value)
            out = jax.tree.map(lambda sp, a: _expand_leading(sp)(a), specs, out, is_leaf=is_pspec)
        return out

    resolved_out = jax.tree.map(lambda s: _resolve_or_replicated(s, mesh, f"out_specs of {name}"), out_specs,
                                is_leaf=_is_spec)
    mapped = jax.shard_map(body, mesh=mesh, in_specs=dyn_specs, out_specs=resolved_out)
    mapped.__name__ = f"smap({name})"  # type: ignore[attr-defined]
    if AxisType.Explicit not in mesh.axis_types:
        return mapped
    # On a mesh with explicit axes (``jax.make_mesh``'s default) shard_map does not reshard its inputs: an array
    # replicated or laid out otherwise would fail deep in JAX. Move each to its in_spec first, as jit does for
    # automatic axes.
    shardings = tuple(jax.tree.map(lambda sp: NamedSharding(mesh, sp), spec, is_leaf=is_pspec) for spec in dyn_specs)

    def to_spec(sharding: NamedSharding, a: Any) -> Any:
        if isinstance(a, Tracer):
            return jax.sharding.reshard(a, sharding)
        return jax.device_put(a, sharding)

    @functools.wraps(mapped)
    def resharded(*dyn: Any) -> Any:
        dyn = tuple(jax.tree.map(to_spec, sh, d, is_leaf=lambda x: isinstance(x, NamedSharding))
                    for sh, d in zip(shardings, dyn, strict=True))
        return mapped(*dyn)

    return resharded


def _resolve_or_replicated(spec: Any, mesh: Mesh, where: str) -> PartitionSpec:
    return resolve_spec(PartitionSpec() if spec is None else spec, mesh, where)


def distributed(f: Callable | None = None, /, *, in_specs: Mapping[str, Any] | None = None, out_specs: Any = ALL,
                static_argnames: Sequence[str] = (), expand: bool = True) -> Any:
    """Attach ``f.smap(mesh=None, jit=True)``, which returns the global (shard-mapped) version of ``f``.

    ``f`` itself is left untouched: it stays the local-view function, callable on one device without a mesh or
    inside another ``smap``.

    Args:
        f: the local-view function (or use ``@distributed(...)`` as a decorator factory).
        in_specs: specs by parameter name. Parameters not named are static Python values if listed in
            ``static_argnames`` or not array-like, else replicated arrays (``P()``).
        out_specs: a pytree prefix of ``f``'s output (default: every output sharded over all axes).
        static_argnames: parameters that are always static (must be hashable; a new value recompiles).
        expand: the expanding convention of :func:`smap`.

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
                                 static_argnames=static_argnames, expand=expand)
    if not callable(f):
        raise TypeError(f"distributed needs a callable, got {type(f).__name__}")
    named = dict(in_specs or {})
    static_names = tuple(static_argnames)
    signature = inspect.signature(f)
    params = list(signature.parameters)
    for key in (*named, *static_names):
        if key not in params:
            raise ValueError(f"{f.__name__} has no parameter {key!r} (parameters: {params})")
    overlap = set(named) & set(static_names)
    if overlap:
        raise ValueError(f"parameters {sorted(overlap)} are both in in_specs and static_argnames")

    constructed: dict[Hashable, Callable] = {}

    def constructor(mesh: Mesh | None = None, *, jit: bool = True) -> Callable:
        if (mesh, jit) in constructed:  # one global function (and its compilations) per mesh
            return constructed[(mesh, jit)]
        cache: dict[Hashable, Callable] = {}

        @functools.wraps(f)
        def call(*args: Any, **kwargs: Any) -> Any:
            bound = signature.bind(*args, **kwargs)
            bound.apply_defaults()
            values = dict(bound.arguments)
            specs = []
            for p in params:
                if p in named:
                    specs.append(named[p])
                elif p in static_names or not _is_array_like(values[p]):
                    specs.append(None)
                else:
                    specs.append(PartitionSpec())
            key = tuple(s is None for s in specs)
            fn = cache.get(key)
            if fn is None:
                fn = smap(f, in_specs=tuple(specs), out_specs=out_specs, mesh=mesh, expand=expand, jit=jit)
                cache[key] = fn
            return fn(*(values[p] for p in params))

        constructed[(mesh, jit)] = call
        return call

    f.smap = constructor  # type: ignore[attr-defined]
    return f


def _is_array_like(value: Any) -> bool:
    leaves = jax.tree.leaves(value)
    return bool(leaves) and all(isinstance(x, jax.Array | np.ndarray | np.generic) for x in leaves)
