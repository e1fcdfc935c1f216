"""shardax.cli."""
