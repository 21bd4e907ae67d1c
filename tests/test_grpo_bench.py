"""``bench.grpo``'s harness: its in-process arm computes what the runtime computes, and its
round-trip counter counts the driver's calls to the scheduler."""

from __future__ import annotations

import torch

from plexrl_dask.bench.grpo import InProcessDeployment, in_process_run, runtime_run
from plexrl_dask.rl import GRPOConfig
from plexrl_dask.rl.modes import JobSpec
from tests.conftest import tiny_spec
from tests.test_grpo import FirstCharIsDigit


def test_the_in_process_arm_repeats_the_runtime_and_round_trips_are_counted(client):
    """Four steps of a job that trains every step: the same records (rewards, lengths,
    losses, grad norms, versions) in the driver's process and through the runtime, and per
    steady-state step the counter sees one fetch (the scored training's result: the samples
    stay on the worker), the placement question and the dashboard report, with the
    submission (each step is one ``sample_train`` request) a one-way message."""
    torch.set_num_threads(1)
    spec = JobSpec(
        "bench-grpo-test",
        FirstCharIsDigit(),
        tiny_spec(seed=21),
        GRPOConfig(steps=4, prompts_per_step=4, group_size=4, max_tokens=5, lr=1e-2, seed=5),
    )
    weights = InProcessDeployment(spec.model).backend.get_weights()
    _, via_runtime, trips = runtime_run(client, spec, weights, 4)
    _, in_process = in_process_run(spec, weights, 4)

    assert [r.version for r in via_runtime] == [1, 2, 3, 4]  # (every step trained)
    compared = ("reward_mean", "completion_lengths", "loss", "grad_norm", "version", "extra")
    for a, b in zip(via_runtime, in_process, strict=True):
        assert [getattr(a, k) for k in compared] == [getattr(b, k) for k in compared]

    total, calls, messages = trips.per_step(0, 2)  # (steps 1 and 2)
    assert calls["plexrl_relocations"] == 1 and calls["log_event"] == 1
    assert calls["gather"] == 1  # the scores and metrics; never the samples
    assert total == sum(calls.values()) <= 4
    assert messages["update-graph"] >= 1  # the next step's sample_train
