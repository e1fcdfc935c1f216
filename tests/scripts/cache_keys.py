"""Launched twice on 2 processes with the same persistent compilation cache directory (the CLI jobs' settings).
Runs two programs: one whose two collectives are ordered by data (``after``) and one whose two are not. Prints, per
process and program, how many programs came from the cache, how many this process compiled itself, and the result.
tests/test_halos.py reads the lines: on the first run process 0 compiles both and process 1 loads the ordered one
from process 0 but compiles the unordered one itself (a read-back executable could run its collectives out of
order); on the second run both processes load the ordered one from the cache."""

import sys

import shardax as sx
from shardax._compile import _start_compiler_threads
from shardax._compile_cache import settle_compilation_cache, use_compilation_cache
from shardax._order import after

use_compilation_cache(True)   # JAX_COMPILATION_CACHE_DIR from the test
cached = settle_compilation_cache(sx.initialize())

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax._src import compiler  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

events: dict[str, int] = {"hits": 0, "compiled": 0}


def _listen(name: str, **_: object) -> None:
    if name == "/jax/compilation_cache/cache_hits":
        events["hits"] += 1


jax.monitoring.register_event_listener(_listen)
_compile = compiler.backend_compile_and_load   # what a process runs when it compiles a program itself


def _counting(*args: object, **kwargs: object) -> object:
    events["compiled"] += 1
    return _compile(*args, **kwargs)


compiler.backend_compile_and_load = _counting
_start_compiler_threads()   # (its one trivial compilation before any count)
scale = float(sys.argv[1])


def ordered(x: jax.Array) -> jax.Array:
    total = sx.comm.allreduce(x * scale)
    return total + sx.comm.allreduce(after(x, total), "max")


def unordered(x: jax.Array) -> jax.Array:
    return sx.comm.allreduce(x * scale) + sx.comm.allreduce(x, "max")


def per_process(x: jax.Array) -> jax.Array:
    """A different program on each process (a constant of its own): its key differs, and process 1 waits for an
    executable that process 0 never hands over, until the (shortened) timeout, then compiles it itself."""
    return sx.comm.allreduce(x * scale) + float(jax.process_index())


local = np.ones((jax.local_device_count(), 5), np.float32)
x = jax.make_array_from_process_local_data(NamedSharding(sx.flat_mesh(), P("d")), local)
for name, body in (("ordered", ordered), ("unordered", unordered), ("per_process", per_process)):
    events.update(hits=0, compiled=0)
    f = sx.smap(body, in_specs=P(sx.ALL), out_specs=P(sx.ALL), jit=True)
    total = float(np.asarray(f(x).addressable_data(0)).sum())
    print(f"process {jax.process_index()} {name}: hits {events['hits']} compiled {events['compiled']} "
          f"cached {cached} total {total}", flush=True)
