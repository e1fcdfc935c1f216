"""``python -m shardax.cli ...`` is the ``shardax`` command."""

import sys

from . import main

sys.exit(main())
