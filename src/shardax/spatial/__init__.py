"""Spatial search on particles (``sx.spatial``): exact k nearest neighbours and friends-of-friends groups.

:func:`knn` and :func:`fof` are local-view functions (one device, or the body of an ``sx.smap``); ``knn.smap`` and
``fof.smap`` are their global versions on ``(ndev, n, ...)`` particle arrays. :class:`Catalogue` holds FoF groups.
"""

from . import _fof_smap as _fof_smap  # attaches fof.smap (the global version)
from ._catalogue import Catalogue as Catalogue
from ._fof import FofResult as FofResult
from ._fof import fof as fof
from ._fof_tuning import Tuning as FofTuning
from ._knn import KnnResult as KnnResult
from ._knn import knn as knn
from ._knn_tuning import KnnTuning as KnnTuning

__all__ = ["Catalogue", "FofResult", "FofTuning", "KnnResult", "KnnTuning", "fof", "knn"]
