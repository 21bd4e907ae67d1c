"""RL and supervised loops written only against the public API (futures all the way)."""

from plexrl_dask.rl.warmup import evaluate, supervised_warmup

__all__ = ["evaluate", "supervised_warmup"]
