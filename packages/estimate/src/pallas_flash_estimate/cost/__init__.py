"""Costing what runs: a kernel's schedule and DMAs, an op's HBM bytes, the hidden overlap."""
