"""Process and device world: initialize, World, meshes, host replication, program guard, watchdog and the
CPUs XLA:CPU compiles for."""

from ._backend import TuningBackend as TuningBackend
from ._backend import tuning_backend as tuning_backend
from ._compile import limited_cpus as limited_cpus
from ._env import LaunchInfo as LaunchInfo
from ._env import detect as detect_launch
from ._guard import configure_guard as configure_guard
from ._initialize import initialize as initialize
from ._replicate import host_replicate as host_replicate
from ._watchdog import configure_watchdog as configure_watchdog
from ._world import World as World
from ._world import device_grid as device_grid
from ._world import flat_mesh as flat_mesh
from ._world import grid_mesh as grid_mesh
from ._world import world as world

__all__ = ["LaunchInfo", "TuningBackend", "World", "configure_guard", "configure_watchdog", "detect_launch", "device_grid",
           "flat_mesh", "grid_mesh", "host_replicate", "initialize", "limited_cpus", "tuning_backend",
           "world"]
