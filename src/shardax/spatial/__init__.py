"""Spatial search on particles (``sx.spatial``): exact k nearest neighbours on cell grids.

:func:`knn` is the local-view function (one device, or the body of an ``sx.smap``); ``knn.smap`` is its global
version on ``(ndev, n, ...)`` particle arrays.
"""

from ._knn import KnnResult as KnnResult
from ._knn import knn as knn

__all__ = ["KnnResult", "knn"]
