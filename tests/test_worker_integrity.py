"""What a replica keeps when a request goes wrong, and what its caches may hand back: each
test is a defect found in review, kept fixed."""

from __future__ import annotations

import pytest
import torch

from plexrl_dask import errors
from plexrl_dask.models.spec import ModelSpec
from plexrl_dask.shared.checks import checked_weights
from plexrl_dask.shared.types import (
    AdamWParams,
    CrossEntropy,
    Datum,
    SamplingParams,
    Streams,
    TurnPrompt,
)
from plexrl_dask.state_store.store import StateStore
from plexrl_dask.worker.backends import TorchBackend
from plexrl_dask.worker.replica_checkpoint import StoreCheckpoint


def trained(seed: int = 1) -> TorchBackend:
    backend = TorchBackend(ModelSpec.tiny(seed=seed), "cpu", max_batch_size=4)
    backend.forward_backward([Datum(tokens=[5, 6, 7, 8, 9])], CrossEntropy())
    backend.optim_step(AdamWParams(lr=1e-2))
    return backend


def test_a_prefix_prefilled_in_other_turns_is_not_a_hit():
    """The same tokens prefilled in other turns are other forwards (their last bits differ):
    a prompt finds only a prefix prefilled with its own turn ends, so a hit samples exactly
    what a miss does."""
    spec = ModelSpec.tiny(hidden_size=128, num_layers=2, num_heads=4, num_kv_heads=2, seed=3)
    tokens = [(i * 7 + 3) % 60 + 5 for i in range(40)]
    params = SamplingParams(n=1, max_tokens=12, temperature=1.0, seed=11)
    streams = Streams(1, 1, invariant=False)
    whole = TurnPrompt(tokens, (40,))
    fresh = TorchBackend(spec, "cpu", max_batch_size=8)
    miss = fresh.sample([whole], params, [0], streams)[0][0]
    warm = TorchBackend(spec, "cpu", max_batch_size=8)
    warm.sample([TurnPrompt(tokens, (1, 17, 40))], params, [5], streams)
    again = warm.sample([whole], params, [0], streams)[0][0]
    assert warm.prefix_cache.stats()["hits"] == 0  # (other turns: prefilled anew)
    assert (again.tokens, again.logprobs) == (miss.tokens, miss.logprobs)
    hit = warm.sample([whole], params, [0], streams)[0][0]
    assert warm.prefix_cache.stats()["hits"] == 1
    assert (hit.tokens, hit.logprobs) == (miss.tokens, miss.logprobs)


def test_a_failed_load_state_keeps_the_optimizer(tmp_path):
    """A store read that fails (every object damaged) changes nothing: weights and
    optimizer moments stay as they were."""
    backend = trained()
    store = StateStore(tmp_path / "store", create=True, durable=True)
    backend.save_state(StoreCheckpoint(store, "m", None))
    for obj in (tmp_path / "store" / "objects").glob("*/*"):
        data = bytearray(obj.read_bytes())
        data[0] ^= 0xFF
        obj.write_bytes(bytes(data))
    weights = {n: p.detach().clone() for n, p in backend.model.named_parameters()}
    moments = len(backend.optimizer.state)
    for optimizer in (True, False):
        with pytest.raises(errors.PlexRLError):
            backend.load_state(StoreCheckpoint(store, "m", backend.version), optimizer=optimizer)
        assert backend.optimizer is not None and len(backend.optimizer.state) == moments
        assert all(torch.equal(weights[n], p) for n, p in backend.model.named_parameters())


def test_weights_that_are_not_finite_in_the_parameters_dtype_are_refused():
    backend = trained()
    params = dict(backend.model.named_parameters())
    name = next(iter(params))
    before = params[name].detach().clone()
    for bad in (
        torch.full(params[name].shape, 1e39, dtype=torch.float64),  # (inf once float32)
        torch.zeros(params[name].shape).to_sparse(),
        torch.empty(params[name].shape, device="meta"),
    ):
        with pytest.raises(errors.WeightsMismatch):
            backend.set_weights(checked_weights({name: bad}), strict=False)
        assert torch.equal(params[name], before)
    backend.set_weights({name: torch.ones(params[name].shape, dtype=torch.float64)}, strict=False)
    assert params[name].eq(1.0).all()


def test_turn_prompts_on_a_tensor_parallel_rank_sample_as_plain_prompts():
    """A sharded rank has no decode step of its own (its prefix cache serves gathered
    copies): a turn prompt samples there as the plain prompt it is."""
    from plexrl_dask.worker.backends.tp import TPBackend
    from plexrl_dask.worker.groups import GroupContext, ProcessGroupManager

    groups = ProcessGroupManager(None, "cpu")
    groups.join(GroupContext(uid="tp-turns", epoch=0, rank=0, world_size=1))
    try:
        backend = TPBackend(ModelSpec.tiny(seed=1), "cpu", groups, 4)
        params = SamplingParams(n=1, max_tokens=4, seed=3)
        plain = backend.sample([[5, 6, 7, 8]], params, [0], Streams(1, 1))[0][0]
        turned = backend.sample([TurnPrompt([5, 6, 7, 8], (2, 4))], params, [0], Streams(1, 1))
        assert turned[0][0].tokens == plain.tokens
    finally:
        groups.leave()


# --- the holder -------------------------------------------------------------------------------


def holder_info(name: str, seed: int, role: str = "rollout"):
    from plexrl_dask.shared.records import DeploymentInfo

    spec = ModelSpec.tiny(seed=seed)
    return DeploymentInfo(name=name, uid=f"u{name}", spec=spec, role=role, backend="torch",
                          owner="t", memory_bytes=spec.memory_bytes("rollout"), workers=("w",))  # fmt: skip


def test_a_request_whose_rebalancing_cannot_offload_still_returns_its_result():
    """After a training step applied, the holder's rebalancing finds a victim that cannot be
    offloaded (the node's tiers are full): the step's result still comes back (a client
    must never retry an applied step), and the victim stays resident and whole."""
    from plexrl_dask.worker.holder import ReplicaHolder

    a, b = holder_info("a", 1), holder_info("b", 2)
    size = ModelSpec.tiny(seed=1).memory_bytes("rollout")
    holder = ReplicaHolder("w", "cpu", int(3.5 * size), max_batch_size=4)
    holder.share_frozen = False
    holder.run(a, "forward", lambda be: None)
    holder.run(b, "forward", lambda be: None)

    def full(state):
        raise errors.TierFull("the node's tiers have no room (in this test)")

    holder._replicas["a"].stasher = full
    data = [Datum(tokens=tuple(range(5, 25)))]
    out = holder.run(b, "train_step", lambda be: be.train_step(data, CrossEntropy(), AdamWParams()))
    assert out and holder._replicas["b"].backend.version == 1
    assert holder.status()["replicas"]["a"]["resident"]
    assert holder.counters["offload_failures"] >= 1


def test_a_shared_rollout_replica_trains_on_weights_of_its_own():
    """A rollout replica sharing frozen weights with others gets its own copy before a
    backward too, not only before a step: the first training op works as without sharing."""
    from plexrl_dask.worker.holder import ReplicaHolder

    holder = ReplicaHolder("w", "cpu", 1 << 30, max_batch_size=4)
    holder.share_frozen = True
    info = holder_info("r", 1)
    holder.run(info, "forward", lambda be: None)
    data = [Datum(tokens=tuple(range(5, 25)))]
    out = holder.run(info, "forward_backward", lambda be: be.forward_backward(data, CrossEntropy()))
    assert out["loss"] > 0
    holder.run(info, "optim_step", lambda be: be.optim_step(AdamWParams()))
    assert holder._replicas["r"].backend.version == 1


class _OutOfMemoryOnMove(torch.Tensor):
    """A tensor whose copy to the device runs out of device memory (a GPU's failure,
    raised here on the CPU)."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if func is torch.Tensor.to:
            raise torch.OutOfMemoryError("out of device memory (raised by the test)")
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **(kwargs or {}))


def test_running_out_of_memory_part_way_through_set_weights_drops_the_replica():
    """``set_weights`` writes tensor by tensor: out of memory part-way leaves a mix of old
    and new weights, so the replica is dropped as lost (never reported intact)."""
    from plexrl_dask.worker.holder import ReplicaHolder

    holder = ReplicaHolder("w", "cpu", 1 << 30, max_batch_size=4)
    holder.share_frozen = False
    info = holder_info("r", 1)
    weights = holder.run(info, "get_weights", lambda be: be.get_weights())
    new = {n: torch.zeros_like(t) for n, t in weights.items()}
    late = list(new)[3]
    new[late] = new[late].as_subclass(_OutOfMemoryOnMove)
    with pytest.raises(errors.DeploymentLost, match="half updated"):
        holder.run(info, "set_weights", lambda be: be.set_weights(new, version=7))
    assert "r" not in holder.status()["replicas"]


def test_prompt_ids_past_64_bits_are_refused_before_they_seed_anything():
    from plexrl_dask.shared.checks import checked_sample

    with pytest.raises(errors.InvalidSamplingParams, match="64 bits"):
        checked_sample([[5, 6]], SamplingParams(), [2**63])
    checked_sample([[5, 6]], SamplingParams(), [2**63 - 1])


def test_a_decode_steps_weight_layout_counts_in_the_replica_and_goes_under_pressure():
    """The decode step's fused, transposed weight copies are device memory the replica
    holds: counted in its bytes after a sample, and dropped (not the replica) by a holder
    short of room."""
    from plexrl_dask.worker.holder import ReplicaHolder

    backend = TorchBackend(ModelSpec.tiny(seed=1), "cpu", max_batch_size=4)
    before = backend.state_bytes()
    backend.sample([[5, 6, 7]], SamplingParams(max_tokens=3), [0], Streams(1, 1))
    layout = backend.decode_step.nbytes()
    assert layout > 0 and backend.state_bytes() == before + layout
    backend.release_decoders()
    assert backend.state_bytes() == before

    a, b = holder_info("a", 1), holder_info("b", 2)
    size = ModelSpec.tiny(seed=1).memory_bytes("rollout")
    # (room for both replicas and one layout, about a replica's size on these tiny models)
    holder = ReplicaHolder("w", "cpu", int(2 * size + 1.2 * layout), max_batch_size=4)
    holder.share_frozen = False
    sample = lambda be: be.sample([[5, 6, 7]], SamplingParams(max_tokens=3), [0], Streams(1, 1))  # noqa: E731
    holder.run(a, "sample", sample)
    holder.run(b, "sample", sample)  # (a's layout gives way to b's: both stay resident)
    assert holder._replicas["a"].backend.decode_step.nbytes() == 0
    replicas = holder.status()["replicas"]
    assert replicas["a"]["resident"] and replicas["b"]["resident"]
    assert holder._resident_bytes() <= holder.budget_bytes


def test_a_static_cache_is_made_room_for_and_memory_never_picks_the_decoder():
    """Before the static decoder allocates its cache (every slot at the stream's longest
    length), the holder makes room for it (an idle replica is offloaded); the configured
    decoder runs whatever room there is, since it decides the sampled bits."""
    import dask

    from plexrl_dask.worker.holder import ReplicaHolder

    params = SamplingParams(n=2, max_tokens=100, seed=5)

    def sample(backend):
        return backend.sample([[5, 6, 7]], params, [0], Streams(2, 1))[0]

    with dask.config.set({"plexrl.sampling.engine": "static"}):
        size = ModelSpec.tiny(seed=1).memory_bytes("rollout")
        probe = TorchBackend(ModelSpec.tiny(seed=1), "cpu", max_batch_size=16)
        probe.sample([[5, 6, 7]], SamplingParams(max_tokens=2), [0], Streams(1, 1))
        layout = probe.decode_step.nbytes()  # (the replica's own, beside its weights)
        holder = ReplicaHolder("w", "cpu", int(2.2 * size) + layout, max_batch_size=16)
        holder.share_frozen = False
        idle, busy = holder_info("idle", 2), holder_info("r", 1)
        holder.run(idle, "forward", lambda be: None)
        tight = holder.run(busy, "sample", sample)
        assert holder._replicas["r"].backend.static.nbytes() > 0  # (the configured decoder)
        assert not holder.status()["replicas"]["idle"]["resident"]  # (room made for it)
        roomy = ReplicaHolder("w", "cpu", 1 << 30, max_batch_size=16)
        roomy.share_frozen = False
        static = roomy.run(busy, "sample", sample)
    assert [(s.tokens, s.logprobs) for s in tight] == [(s.tokens, s.logprobs) for s in static]
