"""One process of :func:`shardax.testing.run_distributed`: ``python -m shardax.testing._child SPEC``.

Imports the test function's module by file path, joins the run with ``sx.initialize()``, calls the function and
pickles its result (JAX arrays turned into NumPy) to ``result_<process_id>.pkl`` next to ``SPEC``. When the
environment turns JAX's persistent compilation cache on, the processes share their first compilations
(:func:`shardax._compile_cache.settle_compilation_cache`).
"""

from __future__ import annotations

import importlib.util
import os
import pickle
import sys
from types import ModuleType
from typing import Any


def import_by_path(path: str, name: str) -> ModuleType:
    """Import the file ``path`` as module ``name`` (its directory goes first on ``sys.path``, as for a script)."""
    directory = os.path.dirname(os.path.abspath(path))
    if directory not in sys.path:
        sys.path.insert(0, directory)
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot import {path!r} as a module")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def _to_host(x: Any) -> Any:
    import jax
    import numpy as np

    if isinstance(x, jax.Array):
        if not x.is_fully_addressable:
            raise TypeError(f"the function returned a global jax.Array of shape {x.shape} that this process cannot "
                            "read whole; return NumPy data instead, e.g. [np.asarray(s.data) for s in "
                            "x.addressable_shards] or jax.experimental.multihost_utils.process_allgather(x)")
        return np.asarray(x)
    return x


def main(spec_path: str) -> None:
    with open(spec_path, "rb") as f:
        spec = pickle.load(f)
    module = import_by_path(spec["file"], spec["module"])
    fn: Any = module
    for part in spec["qualname"].split("."):
        fn = getattr(fn, part)

    import jax

    from shardax._compile_cache import settle_compilation_cache, use_compilation_cache
    from shardax.runtime import initialize

    world = initialize()
    if jax.config.jax_enable_compilation_cache and jax.config.jax_compilation_cache_dir:  # type: ignore[attr-defined]
        use_compilation_cache(True)  # the same key for a program on every process, every program cached
        settle_compilation_cache(world)
    result = jax.tree.map(_to_host, fn(*spec["args"]))
    out = os.path.join(os.path.dirname(spec_path), f"result_{world.process_id}.pkl")
    with open(out + ".tmp", "wb") as f:
        pickle.dump(result, f)
    os.replace(out + ".tmp", out)


if __name__ == "__main__":
    main(sys.argv[1])
