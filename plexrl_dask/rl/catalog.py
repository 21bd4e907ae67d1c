"""The standard job mix: RLVR jobs of different tasks, seeds and model sizes.

The main job (``examples/multiplex.py``) and the multiplexing benchmark draw from this list, so
both measure the same jobs. Each job is one :class:`~plexrl_dask.rl.modes.JobSpec`; ``scale``
shrinks steps and warm-up for quick runs and tests without changing anything else.

The mix is chosen for variety, not for flattering numbers: short fixed-format answers
(arithmetic, a few tokens) beside countdown's worked steps, whose lengths vary with the
problem (see :mod:`plexrl_dask.tasks.countdown`), and models from 64 to 128 wide.
"""

from __future__ import annotations

from dataclasses import replace

from plexrl_dask.errors import ConfigError
from plexrl_dask.models.spec import ModelSpec
from plexrl_dask.rl.modes import JobSpec
from plexrl_dask.rl.objective import GRPOConfig
from plexrl_dask.tasks.agentic import MultiplyTask, ProgramTask
from plexrl_dask.tasks.arithmetic import ArithmeticTask
from plexrl_dask.tasks.countdown import CountdownTask

# Shared by every job: 60 steps of 16 prompts x 8 samples; sampling at 0.7, where the
# warmed-up tiny models' rewards rose in the first measurements (benchmarks/RESULTS.md).
_GRPO = GRPOConfig(steps=60, prompts_per_step=16, group_size=8, temperature=0.7, lr=1e-4)


#: The workers' memory budget the mix is run at (``bench.multiplex``, ``make demo``):
#: countdown4's training (weights, gradients, AdamW moments and the activations of its
#: 128-sequence step: 267 MiB by :mod:`plexrl_dask.rl.sizing`) is 1.39x it: it must shard
#: over two workers, colocated or pooled, as a 7B model's fp32 AdamW training (112 GB of state
#: before any activation) shards over two 80 GB devices. The ratio is a 7B job's; its cause
#: is not: of countdown4's 267 MiB, 255 are the activations of its whole step (its state is
#: 11.5 MiB), where a 7B job's excess is its state. A trainer could instead cut this step into
#: micro-batches on one worker; the job trains its step whole, as it does in every layout, so
#: that memory forces the same group everywhere. Every other job fits one (countdown3: 110 MiB).
STANDARD_BUDGET = "192MiB"


def standard_jobs(count: int = 4, scale: float = 1.0) -> list[JobSpec]:
    """The first ``count`` jobs of the mix; ``scale`` multiplies GRPO steps and warm-up
    steps (at least 2 and 10)."""
    jobs = [
        JobSpec(
            "add2",
            ArithmeticTask(digits=2, ops="+", seed=11),
            ModelSpec.tiny(hidden_size=128, num_layers=2, seed=11),
            replace(_GRPO, max_tokens=8, seed=11),
            warmup_steps=500,
        ),
        JobSpec(
            "countdown3",
            CountdownTask(count=3, max_value=9, max_result=100, seed=12),
            ModelSpec.tiny(hidden_size=128, num_layers=2, seed=12),
            replace(_GRPO, max_tokens=24, seed=12),
            warmup_steps=500,
        ),
        JobSpec(
            "addsub2",
            ArithmeticTask(digits=2, ops="+-", seed=13),
            ModelSpec.tiny(hidden_size=96, num_layers=2, seed=13),
            replace(_GRPO, max_tokens=8, seed=13),
            # Two operations halve each one's warm-up data: after 500 steps greedy answers
            # were right 6 % of the time, most groups of 8 had no right sample to learn from,
            # and GRPO stayed flat (sampled reward 0.055 -> 0.072 over 60 steps); after 1500,
            # 0.49 -> 0.62 (in-process runs of this job; a 128-wide model at 500 did not help).
            warmup_steps=1500,
        ),
        JobSpec(
            "countdown4",
            CountdownTask(count=4, max_value=12, seed=14),
            ModelSpec.tiny(hidden_size=128, num_layers=3, seed=14),
            replace(_GRPO, max_tokens=40, seed=14),
            # Four numbers to combine: after 500 warm-up steps it solved about 5 % and GRPO
            # moved it little (0.064 -> 0.086 in-process); after 1000, 0.14 -> 0.23.
            warmup_steps=1000,
        ),
        JobSpec(
            "add3",
            ArithmeticTask(digits=3, ops="+", seed=15),
            ModelSpec.tiny(hidden_size=64, num_layers=2, seed=15),
            replace(_GRPO, max_tokens=10, seed=15),
            warmup_steps=500,
        ),
    ]
    if not 1 <= count <= len(jobs):
        raise ConfigError(f"the standard mix has 1..{len(jobs)} jobs, asked for {count}")
    return _scaled(jobs[:count], scale)


def agentic_jobs(scale: float = 1.0) -> list[JobSpec]:
    """The agentic mix (``bench.agentic``): two agentic jobs, one calling the calculator and
    one the Python sandbox (:mod:`plexrl_dask.tasks.agentic`), beside two single-turn jobs of
    the standard mix; ``scale`` as in :func:`standard_jobs`. Smaller steps than the standard
    mix (8 prompts x 8 samples): every sandbox call is a process of its own on these 2 cores."""
    grpo = replace(_GRPO, steps=24, prompts_per_step=8, group_size=8, temperature=1.0)
    jobs = [
        JobSpec(
            "multiply3",
            # (2 or 3 factors: an episode of 2 or 3 model turns, each call on the last output)
            MultiplyTask(digits=3, seed=21, factors=(2, 3)),
            ModelSpec.tiny(hidden_size=64, num_layers=2, seed=21),
            replace(grpo, max_tokens=24, seed=21, lr=3e-4, prompts_per_step=16),
            # With 2 factors only, warmed up 400 steps it started at 0.956, where nearly every
            # group of 8 is all right: GRPO had almost nothing to learn from (0.956 -> 0.856
            # in-process); from 300 steps 0.58 -> 0.72. With 2-3 factors, 300 steps left it
            # at 0 (no group scored apart). From 800 its copies of a product into the next
            # call fail on some problems and not others: a step's reward is mostly which
            # problems it drew. At 8 prompts a step its held-out accuracy on 3 factors stayed
            # at 0.64 over 24 steps, moved -0.04..+0.08 over 48 (four seeds), and fell at a
            # higher lr (0.37 at 6e-4). At 16 (calculator calls are cheap), 24 steps took it
            # to 0.67..0.75 over five seeds, 2 factors unchanged, the sampled reward's first
            # and last 5 steps 0.71..0.73 -> 0.77..0.78 (in-process).
            warmup_steps=800,
            warmup_lr=3e-3,
        ),
        JobSpec(
            "program",
            ProgramTask(seed=22),
            ModelSpec.tiny(hidden_size=96, num_layers=2, seed=22),
            replace(grpo, max_tokens=48, seed=22, lr=3e-4),
            warmup_steps=500,
            warmup_lr=3e-3,
        ),
        *(replace(j, grpo=replace(j.grpo, steps=24, prompts_per_step=8)) for j in standard_jobs(2)),
    ]
    return _scaled(jobs, scale)


def _scaled(jobs: list[JobSpec], scale: float) -> list[JobSpec]:
    if scale <= 0:
        raise ConfigError(f"scale must be > 0, got {scale}")
    return [
        replace(
            j,
            grpo=replace(j.grpo, steps=max(2, round(j.grpo.steps * scale))),
            warmup_steps=max(10, round(j.warmup_steps * scale)),
        )
        for j in jobs
    ]
