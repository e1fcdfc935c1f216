"""shardax.io."""
