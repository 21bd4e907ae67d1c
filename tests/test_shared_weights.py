"""Unmodified rollout replicas of one spec share their worker's copy of its model (one
replica holder, no Dask): counted once, sampling as a private replica does, copied on the
first request that writes their weights, released on offload."""

from __future__ import annotations

import dask
import torch

from plexrl_dask.models import ModelSpec
from plexrl_dask.shared.records import DeploymentInfo
from plexrl_dask.shared.types import Datum, SamplingParams
from plexrl_dask.worker.backends import TorchBackend
from plexrl_dask.worker.holder import ReplicaHolder

SPEC = ModelSpec.tiny(hidden_size=32, num_layers=2, seed=6)
BATCH = [Datum(tokens=(1, 5, 6, 7, 8, 9, 10)), Datum(tokens=(1, 9, 8, 7, 6))]
PARAMS = SamplingParams(n=3, max_tokens=6, seed=2)


def info(name: str, role: str = "rollout") -> DeploymentInfo:
    return DeploymentInfo(
        name=name, uid=f"uid-{name}", spec=SPEC, role=role, backend="torch", owner=f"job-{name}",
        memory_bytes=SPEC.memory_bytes(role), workers=("w",),
    )  # fmt: skip


def logprobs(holder: ReplicaHolder, dep: DeploymentInfo) -> tuple:
    return holder.run(dep, "forward", lambda b: b.forward(BATCH)).logprobs


def sample(holder: ReplicaHolder, dep: DeploymentInfo) -> list:
    out = holder.run(dep, "sample", lambda b: b.sample([[1, 5, 6]], PARAMS, [0]))
    return [(s.tokens, s.logprobs) for s in out[0]]


def test_replicas_of_one_spec_share_it_until_one_writes_its_weights():
    events: list[dict] = []
    holder = ReplicaHolder("w", "cpu", 2**30, max_batch_size=8, report=events.append)
    a, b = info("a"), info("b")
    private = TorchBackend(SPEC, "cpu", max_batch_size=8)
    want_lp = private.forward(BATCH).logprobs
    want = [(s.tokens, s.logprobs) for s in private.sample([[1, 5, 6]], PARAMS, [0])[0]]
    assert logprobs(holder, a) == logprobs(holder, b) == want_lp
    assert sample(holder, a) == sample(holder, b) == want
    status = holder.status()
    [shared] = status["bases"].values()
    assert shared["users"] == ["a", "b"]
    weights = sum(p.numel() * p.element_size() for p in private.model.parameters())
    layout = private.decode_step.nbytes()  # (the decode step's copies: one set per base too)
    assert layout > 0 and shared["bytes"] < weights + layout + 1024
    assert status["resident_bytes"] < 1.5 * weights + layout  # (once, not twice)

    def seen() -> int:  # what the scheduler's view of the worker sums to
        latest = {}
        for e in events:
            latest[e["deployment"]] = e["bytes"] if e["tier"] == "hbm" else 0
        return sum(latest.values())

    assert seen() == status["resident_bytes"]
    # a write: a gets its own weights first, b keeps the shared ones untouched
    zeroed = {n: torch.zeros_like(t) for n, t in private.get_weights().items()}
    holder.run(a, "set_weights", lambda be: be.set_weights(zeroed, version=3))
    assert logprobs(holder, a) != want_lp and logprobs(holder, b) == want_lp
    status = holder.status()
    assert [s["users"] for s in status["bases"].values()] == [["b"]]
    assert status["replicas"]["a"]["version"] == 3 and status["replicas"]["a"]["modified"]
    assert seen() == status["resident_bytes"]
    # offloaded, b lets the shared model go; back, it samples the same
    assert holder.offload("b")
    assert holder.status()["bases"] == {} and seen() == holder.status()["resident_bytes"]
    assert sample(holder, b) == want


def test_a_first_write_and_the_setting_off_build_their_own():
    holder = ReplicaHolder("w", "cpu", 2**30, max_batch_size=8)
    private = TorchBackend(SPEC, "cpu", max_batch_size=8)
    weights = private.get_weights()
    holder.run(info("c"), "set_weights", lambda b: b.set_weights(weights, version=1))
    assert holder.status()["bases"] == {}  # (its first request writes: never shared)
    with dask.config.set({"plexrl.worker.share-frozen-weights": False}):
        off = ReplicaHolder("w", "cpu", 2**30, max_batch_size=8)
    logprobs(off, info("d"))
    logprobs(off, info("e"))
    assert off.status()["bases"] == {}
    trainer = info("t", role="train")  # (training deployments are never shared)
    logprobs(holder, trainer)
    assert "t" not in str(holder.status()["bases"])
