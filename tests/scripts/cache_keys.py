"""Launched twice on 2 processes with the same persistent compilation cache (the CLI jobs' settings): prints, per
process, how many programs came from the cache, how many missed it, and how many this process compiled itself (with
the first compilation shared, only process 0 does). tests/test_halos.py reads the lines."""

import sys

import shardax as sx
from shardax._compile_cache import share_compiled_programs, use_compilation_cache

use_compilation_cache(True)   # JAX_COMPILATION_CACHE_DIR from the test
shared = share_compiled_programs(sx.initialize())

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax._src import compiler  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

events: dict[str, int] = {"hits": 0, "misses": 0}


def _listen(name: str, **_: object) -> None:
    if name == "/jax/compilation_cache/cache_hits":
        events["hits"] += 1
    elif name == "/jax/compilation_cache/cache_misses":
        events["misses"] += 1


jax.monitoring.register_event_listener(_listen)
_compile = compiler._compile_and_write_cache   # what a process runs when it compiles a program itself


def _counting(*args: object, **kwargs: object) -> object:
    events["compiled"] = events.get("compiled", 0) + 1
    return _compile(*args, **kwargs)


compiler._compile_and_write_cache = _counting
scale = float(sys.argv[1])
f = sx.smap(lambda x: sx.comm.allreduce(x * scale), in_specs=P(sx.ALL), out_specs=P(sx.ALL), jit=True)
local = np.ones((jax.local_device_count(), 5), np.float32)
x = jax.make_array_from_process_local_data(NamedSharding(sx.flat_mesh(), P("d")), local)
total = float(np.asarray(f(x).addressable_data(0)).sum())
print(f"process {jax.process_index()}: hits {events['hits']} misses {events['misses']} "
      f"compiled {events.get('compiled', 0)} shared {shared} total {total}", flush=True)
