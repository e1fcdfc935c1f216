"""shardax.linalg."""
