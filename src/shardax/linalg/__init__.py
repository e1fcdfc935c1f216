"""Distributed dense linear algebra: Cholesky factor, solve, inverse and Hermitian eigensolver on any mesh.

Matrices are redistributed from the user's layout (rows, columns or 2D) to a block-cyclic column layout over every
device, factored with ``lax.fori_loop`` over panels and collectives along the devices, and returned in the user's
layout. The same local-view kernels run on one device without a mesh.
"""

from ._api import potrf as potrf
from ._api import potri as potri
from ._api import potrs as potrs
from ._api import syevd as syevd
from ._layout import LinalgTuning as LinalgTuning

__all__ = ["LinalgTuning", "potrf", "potri", "potrs", "syevd"]
