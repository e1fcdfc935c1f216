"""shardax.spatial."""
