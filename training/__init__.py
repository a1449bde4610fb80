"""Training: steps, loop, optimizer, sharding, checkpoints and metrics."""
