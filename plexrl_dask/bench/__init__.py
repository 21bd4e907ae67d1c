"""Benchmarks: ``python -m plexrl_dask.bench.<name> --json OUT [--quick]``.

Every benchmark measures PlexRL against a baseline in the same run and reports ratios (these
machines are shared and noisy); absolute numbers are context.
"""
