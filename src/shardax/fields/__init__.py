"""shardax.fields."""
