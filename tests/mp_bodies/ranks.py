"""A JAX-free script for launcher tests: ``python ranks.py MODE [ARGS]``, run under ``shardax launch``.

Modes: ``ok [EXTRA...]`` prints its rank, environment and arguments; ``fail RANK CODE`` makes RANK exit with CODE
while the others sleep; ``kill RANK`` makes RANK kill itself with SIGKILL while the others sleep; ``sleep`` prints
``ready`` and sleeps; ``term`` is ``sleep`` that reports the SIGTERM/SIGINT it receives and exits.
"""

import os
import signal
import sys
import time

rank = int(os.environ["SHARDAX_PROCESS_ID"])
size = int(os.environ["SHARDAX_NUM_PROCESSES"])
mode, args = sys.argv[1], sys.argv[2:]


def nap() -> None:
    print(f"ready rank {rank} pid {os.getpid()}", flush=True)
    time.sleep(300)


if mode == "ok":
    print(f"hello from rank {rank} of {size}")
    print(f"coordinator {os.environ['SHARDAX_COORDINATOR_ADDRESS']}")
    print(f"cpu devices {os.environ.get('SHARDAX_CPU_DEVICES')} {os.environ.get('JAX_NUM_CPU_DEVICES')}")
    print(f"unbuffered {os.environ.get('PYTHONUNBUFFERED')}")
    print(f"args {' '.join(args)}")
    print(f"stderr line from rank {rank}", file=sys.stderr)
elif mode == "fail":
    if rank == int(args[0]):
        print(f"rank {rank} is failing", file=sys.stderr, flush=True)
        sys.exit(int(args[1]))
    nap()
elif mode == "kill":
    if rank == int(args[0]):
        os.kill(os.getpid(), signal.SIGKILL)
    nap()
elif mode == "sleep":
    nap()
elif mode == "term":
    def stop(signum: int, _frame: object) -> None:
        print(f"rank {rank} got {signal.Signals(signum).name}", flush=True)
        sys.exit(0)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    nap()
else:
    sys.exit(f"unknown mode {mode!r}")
