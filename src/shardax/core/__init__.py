"""shard_map extensions: ``ALL``, ``smap``, the ``.smap`` attribute (``distributed`` from specs by parameter name,
``attach_global`` for a global wrapper written by hand) and ``rank_info``.

Also the helpers that local-view code (and every shardax kernel) uses inside ``smap``: the manual mesh axes of
the context (:func:`manual_axes`, :func:`resolve_axes`, :func:`axes_size`, :func:`axes_index`) and manual-axis
variance for loop carries and ``cond`` branches (:func:`varying`, :func:`vary_over`, :func:`vary_like`). Outside
any ``smap`` they are the one-device identities.
"""

from ._attach import attach_global as attach_global
from ._attach import distributed as distributed
from ._rank import AxisSpec as AxisSpec
from ._rank import RankInfo as RankInfo
from ._rank import axes_index as axes_index
from ._rank import axes_size as axes_size
from ._rank import manual_axes as manual_axes
from ._rank import rank_info as rank_info
from ._rank import resolve_axes as resolve_axes
from ._smap import default_mesh as default_mesh
from ._smap import smap as smap
from ._specs import ALL as ALL
from ._specs import resolve_spec as resolve_spec
from ._vary import vary_like as vary_like
from ._vary import vary_over as vary_over
from ._vary import varying as varying

__all__ = [
    "ALL", "AxisSpec", "RankInfo", "attach_global", "axes_index", "axes_size", "default_mesh", "distributed", "manual_axes",
    "rank_info", "resolve_axes", "resolve_spec", "smap", "vary_like", "vary_over", "varying",
]
