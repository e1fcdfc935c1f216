"""``.smap`` constructors for local-view functions with keyword-only parameters.

``sx.distributed`` passes every parameter positionally to the local function, which keyword-only parameters (the
style of this package's public functions) do not accept; this constructor binds them by name instead.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Hashable
from typing import Any

import jax
from jax.sharding import Mesh

from ..core import smap


def attach_smap(f: Callable[..., Any], *, arrays: dict[str, Any], out_specs: Any) -> None:
    """Give ``f`` a ``.smap(mesh=None, *, jit=True)`` constructor of its global version.

    Args:
        f: the local-view function. Constructors are cached per ``(mesh, jit)``, so that calling
            ``f.smap(mesh)(...)`` in a loop compiles once.
        arrays: specs of the parameters that are arrays, by name; every other parameter is static (hashable), and a
            parameter in ``arrays`` given a Python scalar or ``None`` is static too.
        out_specs: specs of ``f``'s outputs.
    """
    signature = inspect.signature(f)
    names = list(signature.parameters)
    positional = signature.replace(parameters=[p.replace(kind=p.POSITIONAL_ONLY, default=p.empty)
                                               for p in signature.parameters.values()])

    @functools.cache
    def constructor(mesh: Mesh | None = None, *, jit: bool = True) -> Callable[..., Any]:
        cache: dict[Hashable, Callable[..., Any]] = {}

        @functools.wraps(f)
        def call(*args: Any, **kwargs: Any) -> Any:
            bound = signature.bind(*args, **kwargs)
            bound.apply_defaults()
            values = [bound.arguments[k] for k in names]
            static = tuple(k not in arrays or v is None or isinstance(v, int | float) for k, v in
                           zip(names, values, strict=True))
            # Array arguments travel as flat leaf lists: smap's spec broadcasting would give a None field of a
            # pytree (an absent optional field) a spec of its own.
            flat = [None if s else jax.tree.flatten(v) for v, s in zip(values, static, strict=True)]
            key = (static, tuple(v if t is None else t[1] for v, t in zip(values, flat, strict=True)))
            fn = cache.get(key)
            if fn is None:
                treedefs = [None if t is None else t[1] for t in flat]

                def body(*vals: Any) -> Any:
                    vals = tuple(v if t is None else jax.tree.unflatten(t, v)
                                 for v, t in zip(vals, treedefs, strict=True))
                    return f(**dict(zip(names, vals, strict=True)))

                # f's parameter names, so that the program guard names a static argument that differs ("n=1000").
                body.__signature__ = positional  # type: ignore[attr-defined]
                specs = tuple(None if s else arrays[k] for k, s in zip(names, static, strict=True))
                fn = smap(body, in_specs=specs, out_specs=out_specs, mesh=mesh, jit=jit, name=f"{f.__name__}.smap")
                cache[key] = fn
            return fn(*(v if t is None else t[0] for v, t in zip(values, flat, strict=True)))

        return call

    f.smap = constructor  # type: ignore[attr-defined]
