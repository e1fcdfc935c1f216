"""shard_map extensions: ``ALL``, ``smap``, ``distributed`` (the ``.smap`` attribute) and ``rank_info``."""

from ._rank import RankInfo as RankInfo
from ._rank import rank_info as rank_info
from ._smap import ALL as ALL
from ._smap import default_mesh as default_mesh
from ._smap import distributed as distributed
from ._smap import resolve_spec as resolve_spec
from ._smap import smap as smap

__all__ = ["ALL", "RankInfo", "default_mesh", "distributed", "rank_info", "resolve_spec", "smap"]
