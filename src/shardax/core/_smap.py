"""``smap``: ``jax.shard_map`` with ``ALL``, static arguments and the expanding convention, compiled once per
signature and run under the program guard and the watchdog.

A call of the global function goes through named steps: bind keyword arguments (:class:`_Local`), place the static
arguments (:func:`_layout`), key the cache (:func:`_cache_key`), build on a new key (:func:`_build`: check the
arguments against their specs, :func:`_shard_mapped`, :func:`_jit`), check a new set of shapes on a known key
(:func:`_dynamic_specs`), guard the call (:class:`Guarded`) and run it (:func:`_run`).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Hashable
from typing import Any, NamedTuple

import jax
from jax.core import Tracer
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from .._compile import compile_ahead
from .._guard import last_call
from .._watchdog import release_finished, watch
from ..runtime import flat_mesh
from ._guarded import Guarded, leaf_signature
from ._specs import (
    argument_specs,
    expand_leading,
    is_pspec,
    is_spec,
    resolve_or_replicated,
    resolved_tree,
    squeeze_leading,
)


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


def smap(f: Callable, /, *, in_specs: Any, out_specs: Any, mesh: Mesh | None = None, expand: bool = True,
         jit: bool = False, donate_argnums: int | tuple[int, ...] = (), name: str | None = None,
         compiler_options: dict[str, Any] | None = None) -> Callable:
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
        compiler_options: XLA options of the jitted program, as ``jax.jit``'s (needs ``jit=True``); options of
            XLA:CPU's compiler (``xla_cpu_*``) are dropped where the mesh holds no CPU device.

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
    donate = _check_options(f, expand=expand, jit=jit, donate_argnums=donate_argnums, name=name,
                            compiler_options=compiler_options)
    local = _Local(f)
    guard = Guarded(f, name, local.params, local.arg_name)
    layouts: dict[int, _Layout] = {}
    cache: dict[Hashable, _Program] = {}

    @functools.wraps(f)
    def global_fn(*args: Any, **kwargs: Any) -> Any:
        if kwargs:
            args = local.bind(args, kwargs)
        the_mesh = default_mesh(mesh)
        layout = layouts.get(len(args)) or layouts.setdefault(len(args), _layout(in_specs, len(args), local.name))
        key = _cache_key(the_mesh, args, layout.static, local.arg_name)
        dyn_args = tuple(args[i] for i in layout.dynamic)
        leaves = jax.tree.leaves(dyn_args)
        shapes = tuple(map(leaf_signature, leaves))
        program = cache.get(key)
        if program is None:
            program = cache[key] = _build(local, the_mesh, args, layout, out_specs=out_specs, expand=expand, jit=jit,
                                          donate=donate, donate_text=f"donate_argnums={donate_argnums!r}",
                                          compiler_options=compiler_options)
        elif shapes not in program.checked:
            _dynamic_specs(local, the_mesh, args, layout, expand=expand)  # raises on a shape the specs cannot split
        program.checked.add(shapes)
        traced = any(isinstance(leaf, Tracer) for leaf in leaves)
        guard.check(key, args, layout.static, shapes, the_mesh, traced=traced)
        return _run(program.fn, dyn_args, traced=traced)

    return global_fn


def _check_options(f: Any, *, expand: Any, jit: Any, donate_argnums: Any, name: Any,
                   compiler_options: Any) -> tuple[int, ...]:
    """Reject bad ``smap`` options with the argument named; ``donate_argnums`` as a tuple."""
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
    if compiler_options is not None:
        if not isinstance(compiler_options, dict) or not all(isinstance(k, str) for k in compiler_options):
            raise TypeError(f"compiler_options must be a dict of XLA option names to values, got {compiler_options!r}")
        if not jit:
            raise ValueError("compiler_options needs jit=True (they apply to the jitted program)")
    return donate


class _Local:
    """The local-view function as ``smap`` calls it: every argument positional, parameter names for messages."""

    def __init__(self, f: Callable) -> None:
        try:
            signature: inspect.Signature | None = inspect.signature(f)
        except (TypeError, ValueError):
            signature = None
        self.signature = signature
        self.params = list(signature.parameters) if signature is not None else []
        self.name: str = getattr(f, "__name__", repr(f))
        keyword_only = signature is not None and any(p.kind is p.KEYWORD_ONLY for p in signature.parameters.values())
        self.fn = _positional(f, signature) if signature is not None and keyword_only else f

    def arg_name(self, i: int) -> str:
        """``"argument 'pos' of f"`` for positional argument ``i``."""
        return f"argument {self.params[i]!r} of {self.name}" if i < len(self.params) else \
            f"argument {i} of {self.name}"

    def bind(self, args: tuple, kwargs: dict) -> tuple:
        """All arguments of a call with keywords as one positional tuple, defaults filled in."""
        if self.signature is None:
            raise TypeError(f"{self.name}: keyword arguments need a function with an inspectable signature")
        bound = self.signature.bind(*args, **kwargs)
        bound.apply_defaults()
        return tuple(bound.arguments.values())


def _positional(f: Callable, signature: inspect.Signature) -> Callable:
    """``f`` taking its keyword-only parameters positionally, after the others, in signature order."""
    params = list(signature.parameters.values())
    n_pos = sum(p.kind is not p.KEYWORD_ONLY for p in params)
    kw_names = [p.name for p in params if p.kind is p.KEYWORD_ONLY]

    @functools.wraps(f)
    def call(*args: Any) -> Any:
        return f(*args[:n_pos], **dict(zip(kw_names, args[n_pos:], strict=False)))  # absent: defaults

    return call


class _Layout(NamedTuple):
    """Where a call's arguments go: one spec (or ``None``: static) per positional argument, split by kind."""

    specs: tuple
    static: tuple[int, ...]
    dynamic: tuple[int, ...]


def _layout(in_specs: Any, n_args: int, fname: str) -> _Layout:
    """The :class:`_Layout` of a call with ``n_args`` positional arguments."""
    if isinstance(in_specs, tuple | list) and not isinstance(in_specs, PartitionSpec):
        if len(in_specs) != n_args:
            raise ValueError(f"{fname} got {n_args} argument(s) but in_specs has {len(in_specs)} entries")
        specs = tuple(in_specs)
    else:
        specs = (in_specs,) * n_args
    static = tuple(i for i, s in enumerate(specs) if s is None)
    return _Layout(specs, static, tuple(i for i in range(n_args) if i not in static))


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


class _Program(NamedTuple):
    """The global function of one cache key, and the argument shapes already checked against its specs."""

    fn: Callable
    checked: set


def _build(local: _Local, mesh: Mesh, args: tuple, layout: _Layout, *, out_specs: Any, expand: bool, jit: bool,
           donate: tuple[int, ...], donate_text: str, compiler_options: dict[str, Any] | None) -> _Program:
    """The :class:`_Program` of a new cache key: arguments checked against their specs, shard-mapped, jitted."""
    dyn_specs = _dynamic_specs(local, mesh, args, layout, expand=expand)
    fn = _shard_mapped(local, mesh, static_values={i: args[i] for i in layout.static}, n_args=len(args),
                       in_specs=dyn_specs, out_specs=out_specs, expand=expand)
    if jit:
        fn = _jit(fn, mesh, donate=donate, dynamic=layout.dynamic, donate_text=donate_text, fname=local.name,
                  compiler_options=compiler_options)
    return _Program(fn, set())


def _dynamic_specs(local: _Local, mesh: Mesh, args: tuple, layout: _Layout, *, expand: bool) -> tuple:
    """The array arguments' specs, broadcast over each pytree and resolved on ``mesh``, each leaf checked."""
    return tuple(argument_specs(args[i], layout.specs[i], mesh, expand, local.arg_name(i)) for i in layout.dynamic)


def _shard_mapped(local: _Local, mesh: Mesh, *, static_values: dict[int, Any], n_args: int, in_specs: tuple,
                  out_specs: Any, expand: bool) -> Callable:
    """``jax.shard_map`` of the local function over the array arguments, the static values put back in place."""
    name = local.name
    where = f"out_specs of {name}"

    def body(*dyn: Any) -> Any:
        if expand:
            dyn = tuple(jax.tree.map(squeeze_leading, s, d, is_leaf=is_pspec) for s, d in zip(in_specs, dyn, strict=True))
        it = iter(dyn)
        out = local.fn(*[static_values[i] if i in static_values else next(it) for i in range(n_args)])
        if expand:
            out = jax.tree.map(expand_leading, resolved_tree(out_specs, out, mesh, where), out, is_leaf=is_pspec)
        return out

    resolved_out = jax.tree.map(lambda s: resolve_or_replicated(s, mesh, where), out_specs, is_leaf=is_spec)
    mapped = jax.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=resolved_out)
    mapped.__name__ = f"smap({name})"  # type: ignore[attr-defined]
    if AxisType.Explicit in mesh.axis_types:
        return _resharding(mapped, mesh, in_specs)
    return mapped


def _resharding(mapped: Callable, mesh: Mesh, in_specs: tuple) -> Callable:
    """``mapped`` moving each input to its in_spec first, on a mesh with explicit axes (``jax.make_mesh``'s default):
    there shard_map does not reshard its inputs, and an array replicated or laid out otherwise would fail deep in JAX
    (jit does it for automatic axes)."""
    shardings = tuple(jax.tree.map(lambda sp: NamedSharding(mesh, sp), spec, is_leaf=is_pspec) for spec in in_specs)

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


def _jit(fn: Callable, mesh: Mesh, *, donate: tuple[int, ...], dynamic: tuple[int, ...], donate_text: str,
         fname: str, compiler_options: dict[str, Any] | None) -> Callable:
    """``jax.jit`` of ``fn`` with the donated arguments numbered among the array ones, compiled for ``mesh``."""
    for i in donate:
        if i not in dynamic:
            raise ValueError(f"{donate_text}: {i} is not a positional array argument of {fname} (static ones "
                             "cannot be donated)")
    if compiler_options and not any(d.platform == "cpu" for d in mesh.devices.flat):
        compiler_options = {k: v for k, v in compiler_options.items() if not k.startswith("xla_cpu_")}
    jitted = jax.jit(fn, donate_argnums=tuple(dynamic.index(i) for i in donate), compiler_options=compiler_options or None)
    # Several CPU devices of this process: compiled with operations kept whole (see shardax._compile).
    return compile_ahead(jitted, mesh.devices.flat)


def _run(fn: Callable, dyn_args: tuple, *, traced: bool) -> Any:
    """Call the global function; outside an outer jit, hand the call's result to the watchdog."""
    if not traced:
        release_finished()
    out = fn(*dyn_args)
    if traced:  # inside an outer jit (guarded as it is traced): the outer call is what runs
        return out
    number, description = last_call()
    watch(number, description, out)
    return out
