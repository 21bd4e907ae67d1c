"""Procedural verifiable tasks: generated problems with exact, programmatic verifiers."""

from plexrl_dask.tasks.arithmetic import ArithmeticTask, Problem

__all__ = ["ArithmeticTask", "Problem"]
