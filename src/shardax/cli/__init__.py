"""The ``shardax`` command line: ``launch``, ``doctor``, ``demo``, ``halos``, ``nbody`` and ``bench``.

``shardax.cli.launch`` is the Python form of ``shardax launch``.
"""

from ._launch import launch as launch
from ._main import SUBCOMMANDS as SUBCOMMANDS
from ._main import Subcommand as Subcommand
from ._main import main as main

__all__ = ["SUBCOMMANDS", "Subcommand", "launch", "main"]
