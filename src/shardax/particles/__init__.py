"""Particles and distributed z-order domain decomposition (``sx.particles``).

The data model every particle kernel stands on: the :class:`Particles` pytree (or any pytree with ``.pos`` and
``.num``), host conversion (:func:`from_numpy`, :func:`squeeze`), initial conditions (:func:`uniform`,
:func:`gaussian_blobs`), Morton keys without ``jax_enable_x64`` (:func:`morton_keys`), the distributed sample sort
into global z-order (:func:`zsort`) with the resulting :class:`Domain`, and conservation checks.
"""

from .._morton import KEY_BITS_PER_DIM as KEY_BITS_PER_DIM
from .._morton import morton_keys as morton_keys
from .._pytree import pad as pad
from ._checks import Conservation as Conservation
from ._checks import conservation as conservation
from ._checks import ids_checksum_numpy as ids_checksum_numpy
from ._domain import Domain as Domain
from ._domain import domain as domain
from ._host import from_numpy as from_numpy
from ._host import squeeze as squeeze
from ._ics import gaussian_blobs as gaussian_blobs
from ._ics import uniform as uniform
from ._particles import Particles as Particles
from ._particles import with_ids as with_ids
from ._zsort import zsort as zsort

__all__ = [
    "KEY_BITS_PER_DIM", "Conservation", "Domain", "Particles", "conservation", "domain", "from_numpy",
    "gaussian_blobs", "ids_checksum_numpy", "morton_keys", "pad", "squeeze", "uniform", "with_ids", "zsort",
]
