"""Collectives for the local view (inside ``smap``), MPI-style, on any mesh and backend.

``axis=None`` means every manual mesh axis of the context; outside any ``smap`` each collective is the identity of a
one-rank world.
"""

from .._exchange import ExchangeTuning as ExchangeTuning
from .._exchange import chunk_ladder as chunk_ladder
from ._alltoallv import alltoallv as alltoallv
from ._alltoallv import exchange as exchange
from ._collectives import allgather as allgather
from ._collectives import allreduce as allreduce
from ._collectives import alltoall as alltoall
from ._collectives import barrier as barrier
from ._collectives import bcast as bcast
from ._collectives import gather as gather
from ._collectives import reduce as reduce
from ._collectives import scan as scan
from ._collectives import scatter as scatter
from ._collectives import sendrecv as sendrecv
from ._collectives import shift as shift
from ._grouping import count_by_rank as count_by_rank
from ._grouping import group_by_rank as group_by_rank
from ._halo import halo_exchange as halo_exchange
from ._volume import CollectiveVolume as CollectiveVolume
from ._volume import collective_bytes as collective_bytes

__all__ = ["CollectiveVolume", "ExchangeTuning", "allgather", "allreduce", "alltoall", "alltoallv", "barrier", "bcast",
           "chunk_ladder", "collective_bytes", "count_by_rank", "exchange", "gather", "group_by_rank", "halo_exchange",
           "reduce", "scan", "scatter", "sendrecv", "shift"]
