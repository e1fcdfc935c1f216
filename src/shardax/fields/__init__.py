"""Distributed periodic fields: cloud-in-cell painting and readout of particles, and the binned power spectrum.

Global functions (``paint``, ``readout``, ``power_spectrum``) take global particles and sharded fields; the
``local_*`` functions are the same kernels in the local view, for use inside ``sx.smap`` (and on one device without a
mesh). See docs/fft.md.
"""

from ._paint import local_paint as local_paint
from ._paint import local_paint_readout as local_paint_readout
from ._paint import local_readout as local_readout
from ._paint import paint as paint
from ._paint import readout as readout
from ._power import bin_edges as bin_edges
from ._power import local_power_spectrum as local_power_spectrum
from ._power import power_spectrum as power_spectrum

__all__ = ["bin_edges", "local_paint", "local_paint_readout", "local_power_spectrum", "local_readout", "paint", "power_spectrum", "readout"]
