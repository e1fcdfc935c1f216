"""shardax.particles."""
