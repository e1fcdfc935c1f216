"""A two-process program that goes wrong on purpose, in the way named by argv[1] (see tests/test_reliability.py)."""

import os
import signal
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import shardax as sx

scenario = sys.argv[1]
w = sx.initialize()
me = w.process_id
mesh = sx.flat_mesh()


def step(x):
    return sx.comm.allreduce(jnp.sum(x))


f = sx.smap(step, in_specs=(P(sx.ALL),), out_specs=P(), mesh=mesh, jit=True)


def rows(n):
    local = np.ones((w.local_device_count, n), np.float32)
    return jax.make_array_from_process_local_data(NamedSharding(mesh, P("d")), local)


print("warm-up", float(f(rows(1000))), flush=True)
if scenario == "shape":
    f(rows(1500 if me == 0 else 1024)).block_until_ready()
elif scenario in ("stale", "strict"):
    f(rows(2000 if me == 0 else 1000)).block_until_ready()
elif scenario == "watchdog":
    if me == 1:
        time.sleep(300)
    f(rows(1000)).block_until_ready()
elif scenario == "die":  # argv[2]: how process 1 dies while process 0 waits in a collective
    if me == 1:
        time.sleep(1)
        cause = sys.argv[2] if len(sys.argv) > 2 else "exit"
        if cause == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        elif cause == "raise":
            raise RuntimeError("process 1 fails on purpose")
        os._exit(3)
    f(rows(1000)).block_until_ready()
    f(rows(1000)).block_until_ready()
    time.sleep(300)
print("finished", flush=True)
