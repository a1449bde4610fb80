"""Flax linen modules of the zoo: no data, no optimizer, no I/O."""
