"""Testing helpers: run a function or script in N local processes, and one per-dtype tolerance table.

``run_distributed`` and ``launch_script`` start their processes through :func:`shardax.runtime.launch` (or
:func:`shardax.runtime.mpirun_spec`); the children import the test function by file path.
``tolerance``/``assert_allclose`` keep every test's rtol/atol in one place. :mod:`shardax.testing.reference` holds
the plain NumPy/SciPy references that tests, ``shardax demo`` and ``shardax bench`` check the kernels against.
"""

from . import reference as reference
from ._distributed import LaunchResult as LaunchResult
from ._distributed import launch_script as launch_script
from ._distributed import run_distributed as run_distributed
from ._tolerance import Kind as ToleranceKind
from ._tolerance import assert_allclose as assert_allclose
from ._tolerance import tolerance as tolerance

__all__ = ["LaunchResult", "ToleranceKind", "assert_allclose", "launch_script", "reference", "run_distributed",
           "tolerance"]
