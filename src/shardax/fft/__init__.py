"""shardax.fft."""
