"""HDF5 input and output (``sx.io``; needs ``pip install 'shardax[hdf5]'``).

:func:`write` and :func:`read` move pytrees of global arrays to and from one shared file (written by every process
in rank order) or one file per rank plus an index; :func:`read_snapshot` reads Gadget-style snapshots with each
process reading only its slice; :func:`write_fof_table` writes friends-of-friends groups as a Gadget-4 group
catalogue (``fof_tab_XXX.hdf5``), the same file at every scale, and :func:`read_fof_table` reads it back. h5py is
imported on first use, not on ``import shardax``.
"""

from ._fof_table import read_fof_table as read_fof_table
from ._fof_table import write_fof_table as write_fof_table
from ._hdf5 import read as read
from ._hdf5 import write as write
from ._snapshot import Snapshot as Snapshot
from ._snapshot import read_snapshot as read_snapshot
from ._snapshot import write_snapshot as write_snapshot

__all__ = ["Snapshot", "read", "read_fof_table", "read_snapshot", "write", "write_fof_table", "write_snapshot"]
