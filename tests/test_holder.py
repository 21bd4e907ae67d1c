"""The replica holder in-process (no Dask): budget, LRU offload/reload, residency reports."""

from __future__ import annotations

import dataclasses
import time

import pytest
import torch

from plexrl_dask import errors
from plexrl_dask.models import ModelSpec
from plexrl_dask.policy.residency import ResidencyReport
from plexrl_dask.shared.records import DeploymentInfo
from plexrl_dask.shared.types import AdamWParams, CrossEntropy, Datum
from plexrl_dask.worker.holder import ReplicaHolder

SCHEMA_KEYS = {"deployment", "version", "tier", "bytes", "load_s"}


def spec(seed: int = 0) -> ModelSpec:
    return ModelSpec.tiny(hidden_size=32, num_layers=1, seed=seed)


def make_info(name: str, seed: int = 0, uid: str | None = None, memory_bytes: int | None = None):
    s = spec(seed)
    return DeploymentInfo(
        name=name,
        uid=uid or f"uid-{name}",
        spec=s,
        role="train",
        backend="torch",
        owner="test",
        memory_bytes=s.memory_bytes("train") if memory_bytes is None else memory_bytes,
        workers=("w",),
    )


TRAIN_BYTES = spec().memory_bytes("train")


def make_holder(budget: int) -> tuple[ReplicaHolder, list[dict]]:
    events: list[dict] = []
    return ReplicaHolder("w", "cpu", budget, max_batch_size=8, report=events.append), events


def batch(k: int) -> list[Datum]:
    return [Datum(tokens=tuple(5 + (7 * k + 3 * j + i) % 90 for i in range(10))) for j in range(2)]


def fb(holder: ReplicaHolder, info: DeploymentInfo, k: int = 0) -> dict:
    return holder.run(
        info, "forward_backward", lambda b: b.forward_backward(batch(k), CrossEntropy())
    )


def step(holder: ReplicaHolder, info: DeploymentInfo) -> dict:
    return holder.run(info, "optim_step", lambda b: b.optim_step(AdamWParams(lr=1e-2)))


def weights(holder: ReplicaHolder, info: DeploymentInfo) -> dict[str, torch.Tensor]:
    return holder.run(info, "get_weights", lambda b: b.get_weights())


def resident(holder: ReplicaHolder) -> dict[str, bool]:
    return {n: r["resident"] for n, r in holder.status()["replicas"].items()}


def test_budget_of_one_alternately_offloads_the_lru_replica():
    # One trained replica (weights + grads + Adam moments) fits, two do not.
    holder, events = make_holder(int(TRAIN_BYTES * 1.05))
    a, b = make_info("a", seed=1), make_info("b", seed=2)

    fb(holder, a)
    step(holder, a)
    assert resident(holder) == {"a": True}
    order = [b, a, b, a]
    for k, current in enumerate(order, start=1):
        other = a if current is b else b
        metrics = fb(holder, current, k)
        assert metrics["loss"] > 0
        assert resident(holder) == {current.name: True, other.name: False}
        step(holder, current)
        assert resident(holder) == {current.name: True, other.name: False}
        status = holder.status()
        assert status["resident_bytes"] <= status["budget_bytes"]
        assert status["resident_bytes"] == status["replicas"][current.name]["bytes"]

    counters = {k: v for k, v in holder.status()["counters"].items() if not k.startswith("prefix_")}
    # b is loaded once, a once; every switch after b's load offloads the other and reloads.
    assert counters == {
        "loads": 2,
        "reloads": 3,
        "offloads": 4,
        "offload_failures": 0,
        "requests": 10,
        "out_of_memory": 0,
        "prefetches": 0,
        "stash_writes": 0,
    }

    tiers = [(e["deployment"], e["tier"]) for e in events]
    assert ("a", "dram") in tiers and ("b", "dram") in tiers
    assert ("a", "hbm") in tiers and ("b", "hbm") in tiers
    assert tiers.count(("a", "dram")) + tiers.count(("b", "dram")) == 4
    for e in events:
        assert set(e) >= SCHEMA_KEYS, e
        assert "worker" not in e  # Dask adds it to worker events
        assert isinstance(e["bytes"], int) and e["bytes"] > 0
        assert isinstance(e["load_s"], float) and e["load_s"] >= 0
        assert isinstance(e["version"], int)
        ResidencyReport.from_event(e)  # valid against the schema
    # An offload is reported before the other replica comes back: the first dram event of a
    # precedes the first hbm event of b.
    assert tiers.index(("a", "dram")) < tiers.index(("b", "hbm"))
    # Versions in the reports follow the optimizer steps.
    last_a = [e for e in events if e["deployment"] == "a"][-1]
    assert last_a["version"] == 3 and last_a["uid"] == "uid-a"


def test_two_fresh_replicas_fit_without_offloading():
    holder, events = make_holder(4 * TRAIN_BYTES)
    a, b = make_info("a", seed=1), make_info("b", seed=2)
    fb(holder, a)
    fb(holder, b)
    assert resident(holder) == {"a": True, "b": True}
    assert holder.status()["counters"]["offloads"] == 0
    assert all(e["tier"] == "hbm" for e in events)


def test_deployment_larger_than_budget_does_not_fit():
    holder, events = make_holder(TRAIN_BYTES)
    small = make_info("small", seed=1)
    fb(holder, small)
    big = make_info("big", memory_bytes=TRAIN_BYTES + 1)
    with pytest.raises(errors.DeploymentDoesNotFit) as info:
        holder.run(big, "load", lambda b: b.version)
    assert "'big'" in str(info.value) and "MiB" in str(info.value)
    # Nothing was loaded, and nothing was offloaded to make room for it.
    assert resident(holder) == {"small": True}
    assert holder.status()["counters"]["offloads"] == 0
    assert all(e["deployment"] == "small" for e in events)


def test_same_name_new_uid_drops_the_old_replica():
    holder, events = make_holder(4 * TRAIN_BYTES)
    old = make_info("policy", uid="uid-1")
    fresh = {n: p.detach().clone() for n, p in spec().build_model("cpu").named_parameters()}
    fb(holder, old)
    step(holder, old)
    trained = weights(holder, old)
    assert any(not torch.equal(trained[n], fresh[n]) for n in fresh)

    new = make_info("policy", uid="uid-2")
    got = weights(holder, new)
    assert got.keys() == fresh.keys()
    assert all(torch.equal(got[n], fresh[n]) for n in fresh)
    status = holder.status()
    assert status["replicas"]["policy"]["uid"] == "uid-2"
    assert status["replicas"]["policy"]["version"] == 0
    assert status["replicas"]["policy"]["modified"] is False
    assert status["counters"]["loads"] == 2
    absent = [e for e in events if e["tier"] == "absent"]
    assert len(absent) == 1 and absent[0]["uid"] == "uid-1" and absent[0]["deployment"] == "policy"
    assert events[-1]["uid"] == "uid-2"


def test_training_is_bit_identical_across_offload_and_reload():
    small, small_events = make_holder(int(TRAIN_BYTES * 1.05))
    big, _ = make_holder(16 * TRAIN_BYTES)
    a, b = make_info("a", seed=3), make_info("b", seed=4)
    for holder in (small, big):
        # Interleaved so that replicas are offloaded with gradients pending and with
        # optimizer state.
        for k in range(3):
            fb(holder, a, k)
            fb(holder, b, k)
            step(holder, a)
            fb(holder, a, k + 10)
            step(holder, b)
            step(holder, a)
    assert small.status()["counters"]["offloads"] >= 4
    assert big.status()["counters"]["offloads"] == 0
    assert any(e["tier"] == "dram" for e in small_events)
    for info in (a, b):
        ws, wb = weights(small, info), weights(big, info)
        assert ws.keys() == wb.keys()
        for n in ws:
            assert torch.equal(ws[n], wb[n]), (info.name, n)
        versions = {h.status()["replicas"][info.name]["version"] for h in (small, big)}
        assert versions == ({6} if info is a else {3})
    # And the next loss is the same too (gradients/optimizer state restored, not just weights).
    assert fb(small, a, 99)["loss"] == fb(big, a, 99)["loss"]


def test_drop_reports_absent_and_frees():
    holder, events = make_holder(4 * TRAIN_BYTES)
    a = make_info("a")
    fb(holder, a)
    assert holder.names() == ["a"]
    assert holder.drop("a") is True
    assert events[-1]["tier"] == "absent" and events[-1]["deployment"] == "a"
    assert events[-1]["load_s"] == 0.0
    assert holder.names() == [] and holder.status()["resident_bytes"] == 0
    assert holder.drop("a") is False
    assert sum(e["tier"] == "absent" for e in events) == 1


def test_modified_after_gradients_an_optim_step_and_set_weights():
    holder, events = make_holder(4 * TRAIN_BYTES)
    a, b = make_info("a", seed=1), make_info("b", seed=2)
    weights(holder, a)
    weights(holder, b)
    assert holder.status()["replicas"]["a"]["modified"] is False
    assert holder.status()["replicas"]["b"]["modified"] is False
    assert not any(e["modified"] for e in events)

    fb(holder, a)  # pending gradients: state a replica rebuilt from its spec would not have
    assert holder.status()["replicas"]["a"]["modified"] is True
    assert events[-1]["deployment"] == "a" and events[-1]["modified"] is True
    step(holder, a)
    assert holder.status()["replicas"]["a"]["modified"] is True

    source = weights(holder, a)
    holder.run(b, "set_weights", lambda be: be.set_weights(source, version=7))
    status = holder.status()["replicas"]["b"]
    assert status["modified"] is True and status["version"] == 7
    assert events[-1]["deployment"] == "b" and events[-1]["modified"] is True
    assert events[-1]["version"] == 7
    assert all(torch.equal(weights(holder, b)[n], source[n]) for n in source)


def test_failed_request_leaves_the_holder_usable():
    holder, _ = make_holder(4 * TRAIN_BYTES)
    a = make_info("a")
    with pytest.raises(errors.TokenOutOfVocabulary):
        holder.run(a, "forward", lambda b: b.forward([Datum(tokens=(1, 10_000))]))
    assert holder.status()["replicas"]["a"]["modified"] is False
    out = holder.run(a, "forward", lambda b: b.forward([Datum(tokens=(1, 5, 6))]))
    assert len(out.logprobs[0]) == 3
    assert holder.status()["counters"]["requests"] == 2


def test_a_request_out_of_device_memory_is_typed_and_leaves_the_replica_training():
    """A request that runs out of device memory part-way (here, after its backward) is
    refused DeviceOutOfMemory; the replica keeps serving, with the gradients it left dropped:
    its next step is the step of a replica that never saw the failed one."""
    holder, _ = make_holder(TRAIN_BYTES * 4)
    a, b = make_info("a", seed=1), make_info("b", seed=1)

    def fails(backend):
        backend.forward_backward(batch(0), CrossEntropy())  # gradients accumulated, then:
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    fb(holder, a, 3)  # (a pending step, dropped with the failed request's gradients)
    with pytest.raises(errors.DeviceOutOfMemory, match="pending gradients were dropped"):
        holder.run(a, "forward_backward", fails)
    with pytest.raises(errors.DeviceOutOfMemory) as sampling:
        holder.run(a, "sample", lambda backend: (_ for _ in ()).throw(torch.OutOfMemoryError()))
    assert "gradients" not in str(sampling.value)
    assert holder.status()["counters"]["out_of_memory"] == 2
    for info in (a, b):
        fb(holder, info, 1)
        step(holder, info)
    wa, wb = weights(holder, a), weights(holder, b)
    assert all(torch.equal(wa[n], wb[n]) for n in wa)


def test_out_of_device_memory_inside_the_optimizer_step_drops_the_replica_as_lost():
    """AdamW updates parameters and moments group by group, in place: a step that runs out
    of memory part-way leaves them half updated, so the replica is dropped as lost, not
    said intact."""
    holder, _ = make_holder(TRAIN_BYTES * 4)
    a = make_info("a", seed=1)
    fb(holder, a)
    step(holder, a)  # (its optimizer exists)
    fb(holder, a, 1)

    def half_step(backend):
        def oom():
            raise torch.OutOfMemoryError("CUDA out of memory")

        backend.optimizer.step = oom
        return backend.optim_step(AdamWParams(lr=1e-2))

    with pytest.raises(errors.DeploymentLost, match="half updated"):
        holder.run(a, "optim_step", half_step)
    assert holder.names() == []


def test_actor_offload_capacity_and_names():
    holder, events = make_holder(4 * TRAIN_BYTES)
    assert holder.capacity() == {"budget_bytes": 4 * TRAIN_BYTES, "device": "cpu", "node": None}
    assert holder.offload("nothing") is False
    a = make_info("a")
    before = weights(holder, a)
    assert holder.offload("a") is True
    assert events[-1]["tier"] == "dram"
    assert resident(holder) == {"a": False}
    assert holder.status()["resident_bytes"] == 0
    assert holder.offload("a") is False  # already offloaded
    after = weights(holder, a)  # reloads
    assert resident(holder) == {"a": True}
    assert all(torch.equal(before[n], after[n]) for n in before)
    assert holder.status()["counters"]["reloads"] == 1


def test_a_prefetch_never_offloads_the_replica_a_request_starts_on():
    """Regression (found by the multiplexed benchmark with lookahead): a prefetch chose its
    victims, the idle ``a`` among them, and offloaded them one by one; a request of ``a`` that
    started in between ran on a replica the prefetch then offloaded (an optimizer step saw no
    gradient). A request now marks its replica running under the lock victims are chosen
    under, and brings it back if a prefetch took it first."""
    import threading

    big = ModelSpec.tiny(hidden_size=32, num_layers=2, seed=3)
    holder, _ = make_holder(150_000)  # room for x and a (75 kB each), or for c (137 kB)
    x, a = make_info("x", seed=1, memory_bytes=75_000), make_info("a", seed=2, memory_bytes=75_000)
    c = dataclasses.replace(make_info("c", memory_bytes=140_000), spec=big)
    for info in (c, x, a):  # c loaded first, then offloaded to make room for x and a
        weights(holder, info)
    assert resident(holder) == {"c": False, "x": True, "a": True}

    offloading, go = threading.Event(), threading.Event()
    original = holder._offload

    def slow_offload(replica):
        if replica.info.name == "x" and not offloading.is_set():
            offloading.set()
            assert go.wait(10)
        original(replica)

    holder._offload = slow_offload
    holder.hint("c", c.uid)  # the prefetch thread: victims x, then a, for c's 137 kB
    assert offloading.wait(10)
    seen: list[bool] = []

    def call(backend):
        seen.append(backend.resident)
        time.sleep(0.3)  # (with the old code, the prefetch offloaded a meanwhile)
        seen.append(backend.resident)
        return backend.get_weights()

    request = threading.Thread(target=lambda: holder.run(a, "get_weights", call))
    request.start()
    time.sleep(0.1)
    go.set()
    request.join(30)
    assert not request.is_alive() and seen == [True, True]
    assert resident(holder)["a"]


def test_a_span_records_the_cpu_time_of_the_requests_own_thread():
    holder, _ = make_holder(10 * TRAIN_BYTES)
    info = make_info("a")
    fb(holder, info)  # loads the replica: setup, not run time

    def spin(seconds: float) -> None:
        until = time.thread_time() + seconds
        while time.thread_time() < until:
            pass

    holder.run(info, "forward", lambda b: spin(0.2))
    holder.run(info, "forward", lambda b: time.sleep(0.2))  # waits: no CPU
    busy, waiting = holder.spans.since(0)[-2:]
    assert busy.cpu_s >= 0.2 and busy.cpu_s <= busy.run_seconds + 0.01
    assert waiting.run_seconds >= 0.2 and waiting.cpu_s < 0.05


def test_a_request_that_changes_nothing_sends_no_residency_report():
    holder, events = make_holder(10 * TRAIN_BYTES)
    info = make_info("a")
    fb(holder, info)  # the load, then the report that the replica grew (its gradients)
    assert len(events) == 2 and events[1]["bytes"] > events[0]["bytes"]
    n = len(events)
    for _ in range(3):  # the same state each time: nothing to tell the scheduler
        holder.run(info, "forward", lambda b: b.forward(batch(0)))
    assert len(events) == n
    step(holder, info)  # a new version: reported
    assert len(events) == n + 1 and events[-1]["version"] == events[n - 1]["version"] + 1
    holder.run(info, "forward", lambda b: b.forward(batch(0)))
    assert len(events) == n + 1
    holder.offload("a")  # a transition is always reported
    assert events[-1]["tier"] != "hbm"


def test_a_hint_starts_a_prefetch_thread_only_when_there_is_something_to_reload(monkeypatch):
    """Hints arrive on the worker's event loop about once per request; a thread per hint
    blocked the loop while it started and then took the GIL from the running request. Only a
    hint naming a replica held here offloaded, of the hinted incarnation, starts one."""
    import threading

    from plexrl_dask.worker import holder as holder_module

    started: list[str] = []

    class Recording(threading.Thread):
        def start(self) -> None:
            started.append(self.name)
            super().start()

    monkeypatch.setattr(holder_module.threading, "Thread", Recording)
    holder, _ = make_holder(100_000)  # room for one of x and a (75 kB each)
    x, a = make_info("x", seed=1, memory_bytes=75_000), make_info("a", seed=2, memory_bytes=75_000)
    weights(holder, x)
    holder.hint("x", x.uid)  # resident
    holder.hint("nobody", "u")  # not held here
    holder.hint("x", "another-incarnation")
    holder.hint(None)
    assert started == []
    weights(holder, a)  # x offloaded to make room
    assert resident(holder) == {"x": False, "a": True}
    started.clear()
    holder.hint("x", x.uid)
    assert started == ["plexrl-prefetch"]


def test_a_holder_short_of_room_shrinks_a_prefix_cache_before_it_offloads_a_replica():
    """Multi-turn conversations grow a rollout replica's prefix cache past what the budget
    leaves beside another resident replica: the holder evicts cached prompts (the least
    recently used) rather than offload the other replica, stays within its budget, and the
    conversations sample the bits they sample with room for every prompt."""
    import dask

    from plexrl_dask.shared.types import SamplingParams, Streams, TurnPrompt

    def rollout(name: str, seed: int) -> DeploymentInfo:
        declared = spec(seed).memory_bytes("rollout")
        return dataclasses.replace(
            make_info(name, seed=seed), role="rollout", memory_bytes=declared
        )

    def converse(holder: ReplicaHolder, info: DeploymentInfo) -> list:
        prompts = [TurnPrompt(p, [len(p)]) for p in ([5, 6, 7], [8, 9], [10, 11, 12, 13])]
        out = []
        for t in range(3):
            params = SamplingParams(n=1, temperature=1.0, max_tokens=5, seed=3 + t)
            got = holder.run(
                info,
                "sample",
                lambda b, ps=prompts, sp=params: b.sample(ps, sp, [0, 1, 2], Streams(3, 1)),
            )
            out.append([(g[0].tokens, g[0].logprobs) for g in got])
            prompts = [p.then([*g[0].tokens, 40, 41]) for p, g in zip(prompts, got, strict=True)]
        return out

    a, b = rollout("a", 1), rollout("b", 2)
    with dask.config.set({"plexrl.sampling.prefix-cache-bytes": 1 << 20}):
        roomy, _ = make_holder(64 * TRAIN_BYTES)
        roomy.run(b, "load", lambda x: x.state_bytes())
        want = converse(roomy, a)
        status = roomy.status()
        cached = status["replicas"]["a"]["prefix_cache"]["bytes"]
        assert cached > 0 and status["replicas"]["a"]["bytes"] >= cached  # (counted)
        budget = status["resident_bytes"] - cached // 2
        tight, _ = make_holder(budget)
        tight.run(b, "load", lambda x: x.state_bytes())
        got = converse(tight, a)
    status = tight.status()
    assert got == want
    assert resident(tight) == {"a": True, "b": True} and status["counters"]["offloads"] == 0
    assert status["resident_bytes"] <= budget
    assert 0 < status["replicas"]["a"]["prefix_cache"]["bytes"] <= cached // 2


def test_room_for_a_growing_replica_offloads_others_or_says_it_does_not_fit():
    """What an adapter loaded into a bank asks of its holder: room beside the replica it
    grows, made by offloading the others; False where even that is not enough."""
    holder, _ = make_holder(int(TRAIN_BYTES * 2.5))
    a, b = make_info("a", seed=1), make_info("b", seed=2)
    fb(holder, a)
    fb(holder, b)
    assert resident(holder) == {"a": True, "b": True}
    used = sum(r["bytes"] for r in holder.status()["replicas"].values() if r["resident"])
    assert holder.room_for(holder.budget_bytes - used + 1, keep="b")  # (a must go)
    assert resident(holder) == {"a": False, "b": True}
    assert not holder.room_for(TRAIN_BYTES * 3, keep="b")
    assert resident(holder)["b"]
