"""Process and device world: initialize, World, meshes, host replication."""

from ._env import LaunchInfo as LaunchInfo
from ._env import detect as detect_launch
from ._initialize import initialize as initialize
from ._replicate import host_replicate as host_replicate
from ._world import World as World
from ._world import device_grid as device_grid
from ._world import flat_mesh as flat_mesh
from ._world import grid_mesh as grid_mesh
from ._world import world as world

__all__ = ["LaunchInfo", "World", "detect_launch", "device_grid", "flat_mesh", "grid_mesh", "host_replicate",
           "initialize", "world"]
