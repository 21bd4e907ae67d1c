"""LoRA adapters on a shared base, in one replica holder (no Dask): the base held once for
its adapters, adapters trained alone, offload/reload bit for bit, typed refusals."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("peft", reason="LoRA adapters need the peft package")

from plexrl_dask import errors  # noqa: E402
from plexrl_dask.models import ModelSpec  # noqa: E402
from plexrl_dask.shared.records import DeploymentInfo  # noqa: E402
from plexrl_dask.shared.types import AdamWParams, CrossEntropy, Datum, SamplingParams  # noqa: E402
from plexrl_dask.worker.holder import ReplicaHolder  # noqa: E402

BASE = ModelSpec.tiny(hidden_size=32, num_layers=2, seed=4)
BATCH = [Datum(tokens=(1, 5, 6, 7, 8, 9, 10)), Datum(tokens=(1, 9, 8, 7, 6))]


def info(name: str, spec: ModelSpec, role: str = "train") -> DeploymentInfo:
    return DeploymentInfo(
        name=name,
        uid=f"uid-{name}",
        spec=spec,
        role=role,
        backend="torch",
        owner="test",
        memory_bytes=spec.memory_bytes(role),
        workers=("w",),
    )


def train(holder: ReplicaHolder, dep: DeploymentInfo, lr: float = 1e-2) -> None:
    holder.run(dep, "forward_backward", lambda b: b.forward_backward(BATCH, CrossEntropy()))
    holder.run(dep, "optim_step", lambda b: b.optim_step(AdamWParams(lr=lr)))


def logprobs(holder: ReplicaHolder, dep: DeploymentInfo) -> tuple:
    return holder.run(dep, "forward", lambda b: b.forward(BATCH)).logprobs


def test_adapters_share_one_base_and_train_only_themselves():
    holder = ReplicaHolder("w", "cpu", 2**30, max_batch_size=8)
    base = info("base", BASE, role="rollout")
    adapters = [info(f"t{i}", BASE.with_lora(4, seed=i)) for i in range(4)]
    before = logprobs(holder, base)
    for a in adapters:
        assert logprobs(holder, a) == before  # B starts at zero: each adapter is the base
    for a in adapters[:2]:
        train(holder, a)
    status = holder.status()
    [shared] = status["bases"].values()
    # (the base's own rollout replica, unmodified, reads the same copy)
    assert shared["users"] == sorted(["base", *(a.name for a in adapters)])
    adapter_bytes = [status["replicas"][a.name]["bytes"] for a in adapters]
    # the base counted once, each adapter only its own state (trained: + gradients and moments)
    assert status["resident_bytes"] == (
        shared["bytes"] + status["replicas"]["base"]["bytes"] + sum(adapter_bytes)
    )
    assert max(adapter_bytes) <= BASE.with_lora(4).adapter_bytes("train")
    assert adapter_bytes[2:] == [4 * BASE.with_lora(4).adapter_parameters()] * 2  # weights only
    assert logprobs(holder, base) == before  # the base's weights are untouched by training
    trained = [logprobs(holder, a) for a in adapters[:2]]
    assert trained[0] != before and trained[0] != trained[1]


def test_residency_reports_count_the_base_once_over_its_adapters():
    """What the scheduler sees of a worker: each adapter's report adds its share of the base,
    so the latest reports sum to the base once plus the adapters, as adapters come and go."""
    events: list[dict] = []
    holder = ReplicaHolder("w", "cpu", 2**30, max_batch_size=8, report=events.append)
    adapters = [info(f"t{i}", BASE.with_lora(4, seed=i)) for i in range(3)]

    def seen() -> int:
        latest = {}
        for e in events:
            latest[e["deployment"]] = e["bytes"] if e["tier"] == "hbm" else 0
        return sum(latest.values())

    for k, a in enumerate(adapters, start=1):
        logprobs(holder, a)
        status = holder.status()
        assert seen() == status["resident_bytes"]
        assert len(status["bases"]) == 1 and k == len(next(iter(status["bases"].values()))["users"])
    train(holder, adapters[0])
    assert seen() == holder.status()["resident_bytes"]
    assert holder.offload("t1")
    assert seen() == holder.status()["resident_bytes"]


def test_an_adapter_offloaded_and_reloaded_continues_bit_for_bit():
    spec = BASE.with_lora(8, seed=1)
    # reference: three steps in a row
    ref = ReplicaHolder("w", "cpu", 2**30, max_batch_size=8)
    a = info("a", spec)
    for _ in range(3):
        train(ref, a)
    want = logprobs(ref, a)
    want_tokens = ref.run(
        a, "sample", lambda b: b.sample([[1, 5, 6]], SamplingParams(n=2, max_tokens=5, seed=7), [0])
    )
    # the same with both adapters offloaded between steps (a budget of one base + adapter)
    one = BASE.memory_bytes("rollout") + spec.adapter_bytes("train") + 4096
    holder = ReplicaHolder("w", "cpu", one, max_batch_size=8)
    other = info("b", ModelSpec.tiny(hidden_size=32, num_layers=2, seed=9).with_lora(8))
    for _ in range(3):
        train(holder, a)
        train(holder, other)  # (another base: a's base and adapter must go to make room)
        assert holder.status()["replicas"]["a"]["resident"] is False
        assert len(holder.status()["bases"]) == 1
    assert logprobs(holder, a) == want
    tokens = holder.run(
        a, "sample", lambda b: b.sample([[1, 5, 6]], SamplingParams(n=2, max_tokens=5, seed=7), [0])
    )
    assert [s.tokens for s in tokens[0]] == [s.tokens for s in want_tokens[0]]
    assert holder.counters["reloads"] >= 2


def test_adapter_weights_and_refusals():
    holder = ReplicaHolder("w", "cpu", 2**30, max_batch_size=8)
    a = info("a", BASE.with_lora(2, targets=("q_proj", "v_proj")))
    names = holder.run(a, "get_weights", lambda b: sorted(b.get_weights()))
    assert names and all(".lora_" in n and ("q_proj" in n or "v_proj" in n) for n in names)
    with pytest.raises(errors.InvalidModelSpec):
        BASE.with_lora(0)
    with pytest.raises(errors.InvalidModelSpec):
        BASE.with_lora(2).with_lora(2)
    with pytest.raises(errors.InvalidModelSpec):
        BASE.with_lora(2, targets=("no_such_module",)).adapter_parameters()
    with pytest.raises(errors.OpNotSupported):  # a DCP directory holds whole models
        holder.run(a, "save_state", lambda b: b.save_state("/tmp/never-written"))
    assert torch.equal(
        holder.run(a, "get_weights", lambda b: b.get_weights([names[0]])[names[0]]),
        holder.run(a, "get_weights", lambda b: b.get_weights()[names[0]]),
    )
    roundtrip = ModelSpec.from_dict(BASE.with_lora(2, alpha=8).to_dict())
    assert roundtrip == BASE.with_lora(2, alpha=8) and roundtrip.base == BASE


def test_a_lora_deployment_is_refused_where_it_cannot_share_its_base():
    from plexrl_dask.driver.runtime import Runtime

    runtime = Runtime(client=object(), job="j")  # (refused before any scheduler call)
    spec = BASE.with_lora(2)
    for kw in ({"world_size": 2}, {"role": "rollout", "tensor_parallel": 2}, {"backend": "vllm"}):
        with pytest.raises(errors.ConfigError, match="LoRA"):
            runtime.deploy("a", spec, **kw)
    with pytest.raises(errors.InvalidModelSpec):
        runtime.deploy("a", BASE.with_lora(2, targets=("nope",)))
