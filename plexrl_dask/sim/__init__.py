"""Simulators that drive the policy core with simulated time (no Dask, no torch)."""
