"""Two processes that call each distributed function with one static argument changed on process 1: every call
must end in ProgramMismatchError on both processes (see tests/test_reliability.py). Prints one line per case:
``case <name>: mismatch after <s> s: <message>`` or ``case <name>: NO ERROR``."""

import sys
import time

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import shardax as sx

w = sx.initialize()
me = w.process_id
mesh = sx.flat_mesh()
one = me == 1  # the process that changes something


def global_array(values: np.ndarray, spec: P) -> jax.Array:
    return jax.make_array_from_callback(values.shape, NamedSharding(mesh, spec), lambda index: values[index])


rng = np.random.default_rng(0)
pos = rng.random((400, 3)).astype(np.float32)
part = sx.particles.from_numpy(np.array_split(pos, w.num_processes)[me], mesh=mesh)
field = global_array(rng.random((8, 8, 8)).astype(np.float32), P("d"))
spd = rng.random((8, 8)).astype(np.float32)
spd = global_array(spd @ spd.T + 8 * np.eye(8, dtype=np.float32), P(None, "d"))
rhs = global_array(np.ones(8, np.float32), P())



def total(x):
    return sx.comm.allreduce(x)


def total_again(x):
    return sx.comm.allreduce(x)


cases = {
    # Two lambdas on one line of code: only their code tells them apart.
    "lambda": lambda: sx.smap((lambda x: sx.comm.allreduce(x, op="max")) if one else (lambda x: sx.comm.allreduce(x)),
                              in_specs=P(sx.ALL), out_specs=P(), mesh=mesh, jit=True)(
        global_array(np.arange(4, dtype=np.float32), P("d"))),
    # The same function written twice (same code, same values) is the same program: no error.
    "same": lambda: sx.smap(total_again if one else total, in_specs=P(sx.ALL), out_specs=P(), mesh=mesh, jit=True)(
        global_array(np.arange(4, dtype=np.float32), P("d"))),
    "zsort": lambda: sx.particles.zsort.smap(mesh)(part, box=1.0, equalize=not one),
    "knn": lambda: sx.spatial.knn.smap(mesh)(part, 9 if one else 8, box=1.0),
    "fof": lambda: sx.spatial.fof.smap(mesh)(part, 0.06 if one else 0.05, box=1.0, min_members=2),
    "paint": lambda: sx.fields.paint(part, (8, 8, 8), box=1.0, capacity=300 if one else None),
    "readout": lambda: sx.fields.readout(field, part, box=1.0, capacity=300 if one else None),
    "power_spectrum": lambda: sx.fields.power_spectrum(field, box=1.0, bins=5 if one else 4),
    "fftn": lambda: sx.fft.fftn(field, norm="ortho" if one else "backward"),
    "potrs": lambda: sx.linalg.potrs(spd, rhs, tile=2, return_logdet=one),
}
for name in sys.argv[1:] or cases:
    start = time.monotonic()
    try:
        jax.block_until_ready(cases[name]())
        print(f"case {name}: NO ERROR", flush=True)
    except sx.ProgramMismatchError as err:
        print(f"case {name}: mismatch after {time.monotonic() - start:.1f} s: {err}", flush=True)
print("finished", flush=True)
