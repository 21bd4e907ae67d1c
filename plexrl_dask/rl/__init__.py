"""RL and supervised loops written only against the public API (futures all the way)."""

from plexrl_dask.rl.grpo import GRPOConfig, GRPOJob, StepRecord, group_advantages, run_jobs
from plexrl_dask.rl.warmup import evaluate, supervised_warmup

__all__ = [
    "GRPOConfig",
    "GRPOJob",
    "StepRecord",
    "evaluate",
    "group_advantages",
    "run_jobs",
    "supervised_warmup",
]
