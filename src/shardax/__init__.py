"""shardax: HPC for JAX.

A multi-process runtime that starts and checks runs, MPI-style collectives inside ``jit``/``shard_map`` on every
backend, and distributed scientific kernels that run the same code on one CPU, many devices and many processes.

Importing shardax changes no JAX configuration and starts no backend. It does not import JAX either: each
subpackage (``sx.comm``, ``sx.spatial`` ...) and each name below is imported on its first use, so that the
processes that only launch others (``shardax launch``, ``shardax halos --processes N``) start them at once.
"""

from typing import TYPE_CHECKING

from ._capacity import retry_capacity as retry_capacity
from ._errors import CapacityError as CapacityError
from ._errors import DistributedSetupError as DistributedSetupError
from ._errors import ProgramMismatchError as ProgramMismatchError
from ._errors import ShardaxError as ShardaxError
from ._lazy import attach
from ._version import __version__ as __version__

if TYPE_CHECKING:
    from . import comm as comm
    from . import core as core
    from . import fft as fft
    from . import fields as fields
    from . import io as io
    from . import linalg as linalg
    from . import nbody as nbody
    from . import particles as particles
    from . import runtime as runtime
    from . import spatial as spatial
    from . import testing as testing
    from .core import ALL as ALL
    from .core import RankInfo as RankInfo
    from .core import distributed as distributed
    from .core import rank_info as rank_info
    from .core import smap as smap
    from .runtime import World as World
    from .runtime import device_grid as device_grid
    from .runtime import flat_mesh as flat_mesh
    from .runtime import grid_mesh as grid_mesh
    from .runtime import host_replicate as host_replicate
    from .runtime import initialize as initialize
    from .runtime import world as world

_SUBPACKAGES = ("comm", "core", "fft", "fields", "io", "linalg", "nbody", "particles", "runtime", "spatial", "testing")
__getattr__, __dir__ = attach(__name__, globals(), {
    **{name: f".{name}" for name in _SUBPACKAGES},
    **dict.fromkeys(("ALL", "RankInfo", "distributed", "rank_info", "smap"), ".core"),
    **dict.fromkeys(("World", "device_grid", "flat_mesh", "grid_mesh", "host_replicate", "initialize", "world"),
                    ".runtime"),
})

__all__ = [
    "ALL", "CapacityError", "DistributedSetupError", "ProgramMismatchError", "RankInfo", "ShardaxError", "World",
    "__version__", "comm", "device_grid", "distributed", "fft", "fields", "flat_mesh", "grid_mesh", "host_replicate",
    "initialize", "io", "linalg", "nbody", "particles", "rank_info", "retry_capacity", "smap", "spatial", "testing", "world",
]
