"""``python -m shardax.cli._bench_worker PLAN``: one worker process of ``shardax bench`` (see ``_bench_cases.worker``).

A module of its own that nothing imports: ``shardax.cli`` imports ``_bench_cases``, and running an imported module
as ``__main__`` would load it a second time (with a RuntimeWarning).
"""

import os
import sys

from .._compile_cache import use_compilation_cache
from ._bench_cases import worker

if os.environ.get("JAX_ENABLE_COMPILATION_CACHE") == "true":
    use_compilation_cache(True)  # the directory shardax bench chose, with the same keys on every process
sys.exit(worker(sys.argv[1]))
