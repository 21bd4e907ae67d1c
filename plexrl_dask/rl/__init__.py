"""RL and supervised loops written only against the public API (futures all the way), the
deployment modes they run in and the ledger that compares the modes."""

from plexrl_dask.rl.grpo import GRPOJob, StepRecord, run_jobs
from plexrl_dask.rl.job_checkpoint import JobCheckpoint, JobCheckpoints, read_checkpoint
from plexrl_dask.rl.ledger import JobWindow, ModeLedger
from plexrl_dask.rl.modes import JobSpec, Layout, ModeRun, layouts, run_mode
from plexrl_dask.rl.objective import GRPOConfig, group_advantages, group_data, lr_at
from plexrl_dask.rl.warmup import evaluate, supervised_warmup, warm_start

__all__ = [
    "GRPOConfig",
    "GRPOJob",
    "JobCheckpoint",
    "JobCheckpoints",
    "JobSpec",
    "JobWindow",
    "Layout",
    "ModeLedger",
    "ModeRun",
    "StepRecord",
    "evaluate",
    "group_advantages",
    "group_data",
    "layouts",
    "lr_at",
    "read_checkpoint",
    "run_jobs",
    "run_mode",
    "supervised_warmup",
    "warm_start",
]
