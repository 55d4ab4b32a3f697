"""Sharding over a device mesh: where parameters and state live, the per-rank step map, and
expert placement."""
