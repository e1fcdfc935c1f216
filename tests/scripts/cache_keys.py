"""Launched twice on 2 processes with the same persistent compilation cache directory (the CLI jobs' settings):
prints, per process, how many programs came from the cache, how many missed it, and whether the cache stayed on
(not on CPU runs of several devices). tests/test_halos.py reads the lines."""

import sys

import shardax as sx
from shardax._compile_cache import settle_compilation_cache, use_compilation_cache

use_compilation_cache(True)   # JAX_COMPILATION_CACHE_DIR from the test
cached = settle_compilation_cache(sx.initialize())

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

events: dict[str, int] = {"hits": 0, "misses": 0}


def _listen(name: str, **_: object) -> None:
    if name == "/jax/compilation_cache/cache_hits":
        events["hits"] += 1
    elif name == "/jax/compilation_cache/cache_misses":
        events["misses"] += 1


jax.monitoring.register_event_listener(_listen)
scale = float(sys.argv[1])
f = sx.smap(lambda x: sx.comm.allreduce(x * scale), in_specs=P(sx.ALL), out_specs=P(sx.ALL), jit=True)
local = np.ones((jax.local_device_count(), 5), np.float32)
x = jax.make_array_from_process_local_data(NamedSharding(sx.flat_mesh(), P("d")), local)
total = float(np.asarray(f(x).addressable_data(0)).sum())
print(f"process {jax.process_index()}: hits {events['hits']} misses {events['misses']} "
      f"cached {cached} total {total}", flush=True)
