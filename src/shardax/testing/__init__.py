"""Testing helpers: run a function or script in N local processes, and one per-dtype tolerance table.

``run_distributed`` starts ``shardax launch`` (or Open MPI's ``mpirun``) children that import the test function by
file path; ``tolerance``/``assert_allclose`` keep every test's rtol/atol in one place.
"""

from ._distributed import LaunchResult as LaunchResult
from ._distributed import launch_script as launch_script
from ._distributed import run_distributed as run_distributed
from ._tolerance import assert_allclose as assert_allclose
from ._tolerance import tolerance as tolerance

__all__ = ["LaunchResult", "assert_allclose", "launch_script", "run_distributed", "tolerance"]
