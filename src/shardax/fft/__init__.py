"""Distributed 3D FFTs: slab and pencil layouts, ``all_to_all`` transpose plans, ``fftn``/``ifftn``/``rfftn``/``irfftn``.

Global functions (``fftn`` ...) take sharded global arrays; ``local_*`` functions are the same transforms in the local
view, for use inside ``sx.smap`` (and on one device without a mesh). ``plan`` exposes the layout, the transposes and
the bytes each device moves. See docs/fft.md.
"""

from .._layout import Layout as Layout
from ._fftn import fftn as fftn
from ._fftn import ifftn as ifftn
from ._fftn import irfftn as irfftn
from ._fftn import local_fftn as local_fftn
from ._fftn import local_ifftn as local_ifftn
from ._fftn import local_irfftn as local_irfftn
from ._fftn import local_rfftn as local_rfftn
from ._fftn import plan as plan
from ._fftn import rfftn as rfftn
from ._freq import fftfreq as fftfreq
from ._freq import local_fftfreq as local_fftfreq
from ._freq import rfftfreq as rfftfreq
from ._plan import FFTPlan as FFTPlan
from ._plan import Transform as Transform
from ._plan import Transpose as Transpose

__all__ = [
    "FFTPlan", "Layout", "Transform", "Transpose", "fftfreq", "fftn", "ifftn",
    "irfftn", "local_fftfreq", "local_fftn", "local_ifftn", "local_irfftn", "local_rfftn", "plan", "rfftfreq", "rfftn",
]
