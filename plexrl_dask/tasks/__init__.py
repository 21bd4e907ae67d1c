"""Procedural verifiable tasks: generated problems with exact, programmatic verifiers."""

from plexrl_dask.tasks.arithmetic import ArithmeticTask
from plexrl_dask.tasks.base import Problem, Task
from plexrl_dask.tasks.countdown import CountdownTask
from plexrl_dask.tasks.rewards import RewardTerm, WeightedRewards, score

__all__ = [
    "ArithmeticTask",
    "CountdownTask",
    "Problem",
    "RewardTerm",
    "Task",
    "WeightedRewards",
    "score",
]
