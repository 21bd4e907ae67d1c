"""Multi-rank training deployments (FSDP2 over gloo) on a real process cluster."""

from __future__ import annotations

import math
import time

import dask
import pytest
import torch

import plexrl_dask as plexrl
from plexrl_dask import errors, protocol
from plexrl_dask.bench.weight_sync import rank_probe
from plexrl_dask.shared.checks import rank_shares
from plexrl_dask.state_store.keys import model_key
from plexrl_dask.worker.backends import TorchBackend
from tests.conftest import tiny_spec, unique

STEPS = 3


def batch_for(dep_or_backend, n: int = 6) -> list[plexrl.Datum]:
    tok = (
        dep_or_backend.tokenize
        if hasattr(dep_or_backend, "info")
        else (lambda s: dep_or_backend.tokenize([s])[0])
    )
    return [plexrl.Datum(tokens=tok(f"{i}+{i * 3}={4 * i}")) for i in range(n)]


def _clipped(logprobs, old, advantages):
    ratio = torch.exp(logprobs - old)
    loss = -torch.minimum(ratio * advantages, ratio.clamp(0.8, 1.2) * advantages).sum()
    return loss, {"custom/ratio:mean": ratio.mean(), "custom/n:sum": logprobs.sum() * 0 + 1}


def test_a_graph_loss_trains_a_two_rank_policy_as_the_built_in_loss_trains_one(runtime):
    """A traced PPO loss sent as data: on a 2-rank FSDP policy it gives the loss, metrics and
    weights of the built-in PolicyGradient on one process (ranks' sums combined)."""
    spec = tiny_spec(seed=22)
    dep = runtime.deploy(unique("graph-fsdp"), spec, world_size=2)
    loss = plexrl.trace_loss(_clipped, {"logprobs": 1, "old": 1, "advantages": 1})
    data = []
    for i, d in enumerate(batch_for(dep, 6)):
        n = len(d.tokens)
        old = [0.0] + [-1.0 - 0.1 * ((i + j) % 7) for j in range(n - 1)]
        adv = [0.0] + [(-1.0) ** (i + j) * 0.5 for j in range(n - 1)]
        data.append(plexrl.Datum(d.tokens, old_logprobs=old, advantages=adv,
                                 inputs={"old": old, "advantages": adv}))  # fmt: skip
    torch.set_num_threads(1)
    ref = TorchBackend(spec, "cpu")
    opt = plexrl.AdamWParams(lr=1e-3)
    got, _ = plexrl.result([dep.forward_backward(data, loss), dep.optim_step(opt)])
    ratios = [
        sum(math.exp(x - y) for x, y in zip(lp[1:], d.old_logprobs[1:], strict=True))
        / (len(d.tokens) - 1)
        for lp, d in zip(ref.forward(data).logprobs, data, strict=True)
    ]
    want = ref.forward_backward(data, plexrl.PolicyGradient(normalizer=1.0))
    ref.optim_step(opt)
    assert got["loss"] == pytest.approx(want["loss"], rel=1e-5)
    assert got["custom/n:sum"] == len(data)
    assert got["custom/ratio:mean"] == pytest.approx(sum(ratios) / len(data), rel=1e-5)
    weights, expected = plexrl.result(dep.get_weights()).tensors, ref.get_weights()
    assert max(float((weights[n] - expected[n]).abs().max()) for n in expected) <= 1e-5


def test_two_rank_fsdp_equals_one_process_on_the_combined_batch(runtime):
    spec = tiny_spec(seed=21)
    dep = runtime.deploy(unique("fsdp"), spec, world_size=2)
    assert len(set(dep.info.workers)) == 2
    data = batch_for(dep)
    opt = plexrl.AdamWParams(lr=1e-3, grad_clip=1.0)
    torch.set_num_threads(1)
    ref = TorchBackend(spec, "cpu")
    for _ in range(STEPS):
        got_fb, got_opt = plexrl.result([dep.forward_backward(data), dep.optim_step(opt)])
        want_fb = ref.forward_backward(data, plexrl.CrossEntropy())
        want_opt = ref.optim_step(opt)
        assert got_fb["loss"] == pytest.approx(want_fb["loss"], abs=1e-6)
        assert got_fb["num_tokens"] == want_fb["num_tokens"]
        assert got_opt["grad_norm"] == pytest.approx(want_opt["grad_norm"], rel=1e-5)
    got = plexrl.result(dep.get_weights())
    want = ref.get_weights()
    assert got.version == STEPS and got.tensors.keys() == want.keys()
    diff = max(float((got.tensors[n] - want[n]).abs().max()) for n in want)
    assert diff <= 1e-6
    # Scoring is split over the ranks and reassembled in order (the top tokens too).
    topped = plexrl.result(dep.forward(data, top=2))
    want_top = ref.forward(data, top=2).top
    assert len(topped.top) == len(want_top)
    for (got_ids, got_lp), (want_ids, want_lp) in zip(topped.top, want_top, strict=True):
        assert got_ids.shape == want_ids.shape
        torch.testing.assert_close(
            torch.from_numpy(got_lp[1:]), torch.from_numpy(want_lp[1:]), atol=1e-5, rtol=0
        )
        clear = want_lp[1:, 0] - want_lp[1:, 1] > 1e-4  # (no tie to round either way)
        assert (got_ids[1:, 0][clear] == want_ids[1:, 0][clear]).all()
    scored = topped.logprobs
    expected = ref.forward(data).logprobs
    assert len(scored) == len(data)
    assert (
        max(
            abs(a - b)
            for x, y in zip(scored, expected, strict=True)
            for a, b in zip(x, y, strict=True)
        )
        < 1e-5
    )


def test_two_gangs_over_the_same_workers_both_complete(runtime):
    a = runtime.deploy(unique("gang-a"), tiny_spec(seed=1), world_size=2)
    b = runtime.deploy(unique("gang-b"), tiny_spec(seed=2), world_size=2)
    assert set(a.info.workers) == set(b.info.workers)
    data = batch_for(a, 4)
    futures = []
    for _ in range(2):  # interleaved: each switch re-forms the workers' process group
        futures += [
            a.forward_backward(data),
            b.forward_backward(data),
            a.optim_step(),
            b.optim_step(),
        ]
    out = plexrl.result(futures, timeout=300)
    assert [m["version"] for m in out[2::4]] == [1.0, 2.0] and [
        m["version"] for m in out[3::4]
    ] == [1.0, 2.0]
    # Interleaving (and the group rebuilds it caused) changed no bit: a's weights equal those
    # of the same deployment trained alone.
    alone = runtime.deploy(unique("gang-alone"), tiny_spec(seed=1), world_size=2)
    for _ in range(2):
        plexrl.result([alone.forward_backward(data), alone.optim_step()], timeout=300)
    got, want = plexrl.result([a.get_weights(), alone.get_weights()])
    assert all(torch.equal(got.tensors[n], t) for n, t in want.tensors.items())
    status = runtime.status()
    assert status["counters"]["dispatched"] > 0


def test_group_bad_input_fails_every_rank_and_the_group_recovers(runtime):
    dep = runtime.deploy(unique("fsdp-bad"), tiny_spec(seed=4), world_size=2)
    data = batch_for(dep, 4)
    bad = data[:3] + [plexrl.Datum(tokens=[1, 10**6])]  # only rank 1's half is bad
    with pytest.raises(errors.TokenOutOfVocabulary):
        dep.forward_backward(bad)  # caught before any rank starts
    nan = [
        plexrl.Datum(tokens=d.tokens, advantages=[0.0] + [float("nan")] * (len(d.tokens) - 1))
        for d in data
    ]
    with pytest.raises(errors.NonFiniteLoss):
        plexrl.result(dep.forward_backward(nan, plexrl.PolicyGradient()), timeout=120)
    with pytest.raises(errors.InvalidBatch, match="at least 2"):
        dep.forward_backward(data[:1])
    with pytest.raises(errors.InvalidSamplingParams):
        dep.sample([])
    with pytest.raises(errors.SequenceTooLong):  # found on the ranks, agreed
        plexrl.result(dep.sample(["1+1="] * 3, plexrl.SamplingParams(max_tokens=300)))
    out = plexrl.result([dep.forward_backward(data), dep.optim_step()], timeout=120)
    assert out[1]["version"] == 1.0


def test_world_size_larger_than_the_cluster_fails_at_deploy(runtime):
    with pytest.raises(errors.DeploymentDoesNotFit, match="needs 3 workers"):
        runtime.deploy(unique("too-wide"), tiny_spec(), world_size=3)
    assert all(d.world_size <= 2 for d in runtime.deployments())


def test_checkpoint_on_two_ranks_restores_on_one_and_two(runtime, tmp_path):
    spec = tiny_spec(seed=8)
    src = runtime.deploy(unique("ckpt-src"), spec, world_size=2)
    w0, w1 = src.info.workers
    data = batch_for(src, 4)
    opt = plexrl.AdamWParams(lr=1e-3)
    for _ in range(2):
        plexrl.result([src.forward_backward(data), src.optim_step(opt)])
    path = str(tmp_path / "ckpt")
    saved = plexrl.result(src.save_state(path))
    assert saved == {"path": path, "model": model_key(src.name), "version": 2, "format": "store"}
    one = runtime.deploy(unique("ckpt-one"), spec, world_size=1)
    # Ranks swapped: each worker process re-joins a group under the other rank (a torch mesh
    # interning pitfall made exactly this load the wrong shards; see worker/groups.py).
    two = runtime.deploy(unique("ckpt-two"), spec, world_size=2, workers=[w1, w0])
    assert two.info.workers == (w1, w0)
    assert plexrl.result([one.load_state(path), two.load_state(path)]) == [2, 2]
    want = plexrl.result(src.get_weights()).tensors
    for dep in (one, two):
        got = plexrl.result(dep.get_weights())
        assert got.version == 2 and all(torch.equal(got.tensors[n], t) for n, t in want.items())
    # DCP stays as import/export: the same state through it.
    exported = plexrl.result(src.save_state(str(tmp_path / "dcp"), format="dcp"))
    assert exported["format"] == "dcp"
    assert plexrl.result(one.load_state(exported)) == 2
    got = plexrl.result(one.get_weights()).tensors
    assert all(torch.equal(got[n], t) for n, t in want.items())
    # Training continues identically (optimizer state restored too): same step on all three.
    for dep in (src, one, two):
        plexrl.result([dep.forward_backward(data), dep.optim_step(opt)])
    after = [plexrl.result(d.get_weights()).tensors for d in (src, one, two)]
    assert all(torch.equal(after[2][n], t) for n, t in after[0].items())  # same layout: exact
    assert max(float((after[1][n] - t).abs().max()) for n, t in after[0].items()) <= 1e-6


def test_bad_checkpoints_are_refused_and_harmless(runtime, tmp_path):
    dep = runtime.deploy(unique("ckpt-bad"), tiny_spec(seed=9), world_size=2)
    before = plexrl.result(dep.get_weights()).tensors
    with pytest.raises(errors.CheckpointNotFound):
        plexrl.result(dep.load_state(str(tmp_path / "missing")))
    other = runtime.deploy(unique("ckpt-other"), tiny_spec(seed=9, hidden_size=64))
    in_store = plexrl.result(other.save_state())  # the node's NVMe tier
    with pytest.raises(errors.CheckpointIncompatible, match="shape"):
        plexrl.result(dep.load_state(in_store))
    with pytest.raises(errors.CheckpointNotFound):
        plexrl.result(dep.load_state({**in_store, "version": 99}))
    # malformed references: refused alike on both ranks, before either reads or imports
    no_path = {k: v for k, v in in_store.items() if k != "path"}
    for bad in (no_path, {**in_store, "version": "1"}, {**in_store, "model": "../x"},
                {**in_store, "source": 7}):  # fmt: skip
        with pytest.raises(errors.CheckpointError):
            plexrl.result(dep.load_state(bad), timeout=60)
    path = str(tmp_path / "other")
    plexrl.result(other.save_state(path, format="dcp"))
    with pytest.raises(errors.CheckpointIncompatible, match="shape"):
        plexrl.result(dep.load_state(path))
    (tmp_path / "other" / "plexrl.json").unlink()  # as if the writer died before the end
    with pytest.raises(errors.CheckpointIncomplete):
        plexrl.result(dep.load_state(path))
    after = plexrl.result(dep.get_weights()).tensors
    assert all(torch.equal(after[n], t) for n, t in before.items())
    plexrl.result([dep.forward_backward(batch_for(dep, 2)), dep.optim_step()])  # still trains


def test_sync_weights_from_two_ranks_into_replicas_and_mismatches(runtime):
    trainer = runtime.deploy(unique("sync-train"), tiny_spec(seed=12), world_size=2)
    rollout = runtime.deploy(unique("sync-roll"), tiny_spec(seed=13), role="rollout", replicas=2)
    data = batch_for(trainer, 4)
    plexrl.result([trainer.forward_backward(data), trainer.optim_step()])
    assert plexrl.result(runtime.sync_weights(trainer, rollout)) == 1
    want = plexrl.result(trainer.get_weights())
    assert want.version == 1 and want.tensors  # rank 0's whole tensors
    # Every replica took the weights: both score exactly like the trainer's weights.
    ref = TorchBackend(tiny_spec(seed=13), "cpu")
    ref.set_weights(want.tensors)
    probe = [plexrl.Datum(tokens=rollout.tokenize("12+3=15"))]
    expected = ref.forward(probe).logprobs
    for replica in range(2):
        with dask.annotate(plexrl=rollout.annotation(replica=replica)):
            fut = runtime.client.submit(plexrl.ops.forward, rollout.name, probe, pure=False)
        got = plexrl.result(fut).logprobs
        assert max(abs(a - b) for a, b in zip(got[0], expected[0], strict=True)) < 1e-5
    # A different architecture: typed error, the destination untouched.
    other = runtime.deploy(unique("sync-other"), tiny_spec(seed=13, hidden_size=64), role="rollout")
    before = plexrl.result(other.get_weights()).tensors
    with pytest.raises(errors.WeightsMismatch, match="shape"):
        plexrl.result(runtime.sync_weights(trainer, other))
    after = plexrl.result(other.get_weights()).tensors
    assert all(torch.equal(after[n], t) for n, t in before.items())


def test_a_loss_error_on_one_rank_fails_every_rank_and_keeps_the_state(runtime):
    dep = runtime.deploy(unique("fsdp-loss"), tiny_spec(seed=14), world_size=2)
    data = batch_for(dep, 4)
    with_adv = [
        plexrl.Datum(tokens=d.tokens, advantages=[0.0] + [1.0] * (len(d.tokens) - 1))
        for d in data[:2]
    ]
    mixed = with_adv + data[2:]  # rank 1's half has no advantages
    before = plexrl.result(dep.get_weights()).tensors
    with pytest.raises((errors.InvalidLoss, errors.InvalidBatch)):
        plexrl.result(dep.forward_backward(mixed, plexrl.PolicyGradient()), timeout=120)
    after = plexrl.result(dep.get_weights()).tensors
    assert all(torch.equal(after[n], t) for n, t in before.items())
    out = plexrl.result([dep.forward_backward(data), dep.optim_step()], timeout=120)
    assert out[1]["version"] == 1.0


def _store_unwritable(on: bool) -> None:
    """(Run on one worker.) Make ``save_state`` to a path fail there as a read-only
    filesystem would, or undo it."""
    from plexrl_dask.worker import stores

    if on:
        stores.open_store_saved = stores.open_store

        def refuse(path: str, create: bool = False) -> None:
            raise PermissionError(13, "Permission denied (injected on this worker)", path)

        stores.open_store = refuse
    elif hasattr(stores, "open_store_saved"):
        stores.open_store = stores.open_store_saved


def test_a_checkpoint_path_one_rank_cannot_write_fails_every_rank_at_once(runtime, tmp_path):
    """One rank's node cannot write the path: every rank fails with a CheckpointError, at
    once (not after the group timeout in a collective), and every rank keeps its state."""
    dep = runtime.deploy(unique("ckpt-rank"), tiny_spec(seed=15), world_size=2)
    data = batch_for(dep, 4)
    plexrl.result([dep.forward_backward(data), dep.optim_step()], timeout=120)
    before = plexrl.result(dep.get_weights()).tensors
    rank1 = dep.info.workers[1]
    runtime.client.run(_store_unwritable, True, workers=[rank1])
    try:
        with (
            dask.config.set({"plexrl.group.timeout": "60s"}),
            pytest.raises(errors.CheckpointError, match="cannot write|another rank"),
        ):
            t0 = time.monotonic()
            plexrl.result(dep.save_state(str(tmp_path / "store")), timeout=120)
        assert time.monotonic() - t0 < 30  # agreed on, not timed out
    finally:
        runtime.client.run(_store_unwritable, False, workers=[rank1])
    after = plexrl.result(dep.get_weights()).tensors
    assert all(torch.equal(after[n], t) for n, t in before.items())
    # Nothing was lost: it trains on, and now saves and restores.
    plexrl.result([dep.forward_backward(data), dep.optim_step()], timeout=120)
    saved = plexrl.result(dep.save_state(str(tmp_path / "store")), timeout=120)
    assert plexrl.result(dep.load_state(saved), timeout=120) == saved["version"] == 2


def _set_budget(budget: int | None, dask_worker=None) -> int:
    """(Run on a worker.) Set its holder's memory budget (None: leave it); return the old."""
    from plexrl_dask.worker.holder import holder_of

    holder = holder_of(dask_worker)
    old = holder.budget_bytes
    if budget is not None:
        holder.budget_bytes = budget
    return old


def _holder_status(dask_worker) -> dict:
    from plexrl_dask.worker.holder import holder_of

    return holder_of(dask_worker).status()


def _set_bucket(nbytes: int) -> None:
    from plexrl_dask.worker.backends import fsdp

    fsdp.GATHER_BUCKET_BYTES = nbytes


def test_a_training_group_samples_like_a_replica_and_trains_on_bit_for_bit(runtime):
    """The hybrid engine: a 2-rank training deployment samples (each rank its share of the
    streams, on gathered weights) exactly as a rollout replica synced from it; where the
    copy fits only with the optimizer state parked on the host, training goes on bit for
    bit; where it fits not even then, a typed error and nothing changed."""
    spec = tiny_spec(seed=31)
    hybrid = runtime.deploy(unique("hybrid"), spec, world_size=2)
    plain = runtime.deploy(unique("hybrid-ref"), spec, world_size=2)
    rollout = runtime.deploy(unique("hybrid-roll"), spec, role="rollout")
    data = batch_for(hybrid, 4)
    opt = plexrl.AdamWParams(lr=1e-3)
    for dep in (hybrid, plain):
        plexrl.result([dep.forward_backward(data), dep.optim_step(opt)], timeout=120)
    assert plexrl.result(runtime.sync_weights(hybrid, rollout)) == 1
    prompts = [f"{i}+{i}=" for i in range(7)]  # streams on both ranks, unevenly
    params = plexrl.SamplingParams(n=4, max_tokens=12, seed=5)
    got = plexrl.result(hybrid.sample(prompts, params), timeout=120)
    want = plexrl.result(rollout.sample(prompts, params), timeout=120)
    assert got == want and len(got.sequences) == 7
    one = [plexrl.result(d.sample(prompts[:1], params), timeout=120) for d in (hybrid, rollout)]
    assert one[0] == one[1]  # (rank 1 had no share, and took part in the gather)
    # multi-turn prompts: the gathered copy prefills them turn by turn as the replica does
    turns = [plexrl.TurnPrompt([5, 6, 7, 8, 9], [3, 5]), plexrl.TurnPrompt([5, 6, 7], [3])]
    multi = [plexrl.result(d.sample(turns, params), timeout=120) for d in (hybrid, rollout)]
    assert multi[0] == multi[1]
    # again: each rank's prefix cache outlives its copy (hits now), the same samples
    assert plexrl.result(hybrid.sample(turns, params), timeout=120) == multi[0]
    caches = [
        r["prefix_cache"]
        for st in runtime.client.run(_holder_status, workers=list(hybrid.info.workers)).values()
        for n, r in st["replicas"].items()
        if n == hybrid.name
    ]
    assert sum(c["hits"] for c in caches) >= 2
    # gathered in many small buckets (one all-gather each), the copy is the same
    workers = list(hybrid.info.workers)
    runtime.client.run(_set_bucket, 4096, workers=workers)
    try:
        assert plexrl.result(hybrid.sample(prompts, params), timeout=120) == want
    finally:
        runtime.client.run(_set_bucket, 64 * 2**20, workers=workers)

    # A budget where the copy fits only with gradients and moments on the host: rank state
    # is weights/2 + grads/2 + 2 moments/2 = 2W, the copy W.
    weights = spec.memory_bytes("rollout")
    workers = list(hybrid.info.workers)
    budgets = runtime.client.run(_set_budget, None, workers=workers)
    plexrl.result(hybrid.forward_backward(data), timeout=120)  # a pending gradient too
    try:
        runtime.client.run(_set_budget, int(2.6 * weights), workers=workers)
        assert plexrl.result(hybrid.sample(prompts, params), timeout=120) == want
        runtime.client.run(_set_budget, int(1.2 * weights), workers=workers)
        with pytest.raises(errors.DeploymentDoesNotFit, match="even with its gradients"):
            plexrl.result(hybrid.sample(prompts, params), timeout=120)
    finally:
        for w, b in budgets.items():
            runtime.client.run(_set_budget, b, workers=[w])
    out = plexrl.result([hybrid.optim_step(opt)], timeout=120)
    plexrl.result([plain.forward_backward(data), plain.optim_step(opt)], timeout=120)
    assert out[0]["version"] == 2.0
    a, b = plexrl.result([hybrid.get_weights(), plain.get_weights()], timeout=120)
    assert all(torch.equal(a.tensors[n], t) for n, t in b.tensors.items())


def test_a_tensor_parallel_rollout_scores_and_samples_like_one_worker(runtime):
    """tensor_parallel=2: one replica over both workers, its weights synced from a 2-rank
    FSDP trainer; scores equal one worker's to rounding, tokens agree where rounding does not
    flip a choice; bad layouts and training ops are typed errors."""
    # (hidden 128: its projections are over the store's 16 KiB split threshold, so a rank's
    # slice is its own chunks; a smaller tensor is one chunk, fetched whole by every rank)
    spec = tiny_spec(seed=41, num_kv_heads=2, hidden_size=128)
    trainer = runtime.deploy(unique("tp-train"), spec, world_size=2)
    data = batch_for(trainer, 4)
    plexrl.result([trainer.forward_backward(data), trainer.optim_step()], timeout=120)
    tp = runtime.deploy(unique("tp"), spec, role="rollout", tensor_parallel=2)
    one = runtime.deploy(unique("tp-one"), spec, role="rollout")
    assert tp.info.world_size == 2 and len(set(tp.info.workers)) == 2

    def held(name, dask_worker=None):
        from plexrl_dask.worker.holder import holder_of

        replica = holder_of(dask_worker)._replicas.get(name)
        return None if replica is None else replica.backend.state_bytes()

    ranks = list(tp.info.workers)
    starts = runtime.client.run(rank_probe, True, tp.name, workers=ranks)
    assert plexrl.result(runtime.sync_weights(trainer, tp)) == 1
    ends = runtime.client.run(rank_probe, False, tp.name, workers=ranks)
    assert plexrl.result(runtime.sync_weights(trainer, one)) == 1
    # (synced, each holds weights of its own: an unmodified one would share its spec's)
    split = runtime.client.run(held, tp.name, workers=ranks)
    whole = runtime.client.run(held, one.name, workers=list(one.info.workers))
    # Each rank holds half of every split projection (embeddings and norms stay whole), and
    # read from the store its own slices, not the whole tensors (the store's own counters).
    assert all(b < 0.75 * next(iter(whole.values())) for b in split.values())
    for w, e in ends.items():
        assert 0 < e["read"] - starts[w]["read"] <= 1.05 * e["slice"], (starts, ends)
        # ...and allocated for it at most its slice: the store's count of the buffers its
        # reads made (none where the parameters are read straight into place). (The Python
        # allocation traced on the worker meanwhile, bench.weight_sync's other measure, is
        # about 1 MB a sync whatever the slice, 10 MB in a worker's first, which imports:
        # the measure of a 126 MB model, not of this one's 0.6 MB slices.)
        assert e["peak"] <= 1.05 * e["slice"], ends
    got, want = plexrl.result([tp.forward(data), one.forward(data)], timeout=120)
    diff = max(
        abs(a - b)
        for x, y in zip(got.logprobs, want.logprobs, strict=True)
        for a, b in zip(x, y, strict=True)
    )
    assert len(got.logprobs) == len(data) and diff < 1e-5
    prompts = [f"{i}+{i}=" for i in range(5)]
    params = plexrl.SamplingParams(n=4, max_tokens=10, seed=3)
    a, b = plexrl.result([tp.sample(prompts, params), one.sample(prompts, params)], timeout=120)
    pairs = [
        (x, y)
        for ga, gb in zip(a.sequences, b.sequences, strict=True)
        for x, y in zip(ga, gb, strict=True)
    ]
    assert len(pairs) == 20
    same = sum(x.tokens == y.tokens for x, y in pairs)
    assert same >= 18  # (measured in bench.weight_sync: tp_token_agreement)
    for x, y in pairs:
        if x.tokens == y.tokens:
            assert max(abs(p - q) for p, q in zip(x.logprobs, y.logprobs, strict=True)) < 1e-4

    with pytest.raises(errors.ConfigError, match="does not divide"):
        runtime.deploy(unique("tp-3"), spec, role="rollout", tensor_parallel=3)
    with pytest.raises(errors.ConfigError, match="world_size"):
        runtime.deploy(unique("tp-train2"), spec, tensor_parallel=2)
    with pytest.raises(errors.ConfigError, match="tensor_parallel"):
        runtime.deploy(unique("tp-ws"), spec, role="rollout", world_size=2)
    with pytest.raises(errors.DeploymentDoesNotFit):
        runtime.deploy(unique("tp-wide"), spec, role="rollout", tensor_parallel=2, replicas=2)
    with pytest.raises(errors.OpNotSupported):
        plexrl.result(tp.forward_backward(data), timeout=120)
    with pytest.raises(errors.OpNotSupported, match="train_step"):
        plexrl.result(tp.train_step(data), timeout=120)
    assert plexrl.result(tp.forward(data), timeout=120) == got  # still serves
    # Offloaded to host memory (both ranks) and rebuilt on its group by the next request:
    # the same scores and the same tokens, bit for bit.
    offloaded = tp.offload()
    assert set(offloaded) == set(ranks) and all(offloaded.values()), offloaded
    assert runtime.client.run(held, tp.name, workers=ranks) == split  # (host bytes counted)
    again = plexrl.result(tp.sample(prompts, params), timeout=120)
    assert [[x.tokens for x in g] for g in again.sequences] == [
        [x.tokens for x in g] for g in a.sequences
    ]
    assert plexrl.result(tp.forward(data), timeout=120) == got
    # A sync into a tensor-parallel replica of another architecture: a typed error, before
    # any rank took anything; both ranks keep their weights (they score as before).
    wide = runtime.deploy(
        unique("tp-other"), tiny_spec(seed=41, num_kv_heads=2, hidden_size=64),
        role="rollout", tensor_parallel=2,
    )  # fmt: skip
    probe = [plexrl.Datum(tokens=wide.tokenize("12+3=15"))]
    before = plexrl.result(wide.forward(probe), timeout=120)
    with pytest.raises(errors.WeightsMismatch, match="shape"):
        plexrl.result(runtime.sync_weights(trainer, wide), timeout=120)
    assert plexrl.result(wide.forward(probe), timeout=120) == before
    assert plexrl.result(tp.forward(data), timeout=120) == got


def test_only_a_groups_rank_0_publishes_its_address(runtime):
    """A client that writes addresses for a group's rendezvous keys (every epoch it could
    guess) is refused; the group forms and trains as before."""
    dep = runtime.deploy(unique("rdv"), tiny_spec(seed=8), world_size=2, wait=False)
    for epoch in range(4):
        for token in ("", "guess"):
            with pytest.raises(errors.PermissionDenied, match="rank 0"):
                runtime._call(
                    protocol.RENDEZVOUS_PUT,
                    key=f"{dep.info.uid}:{epoch}",
                    address="127.0.0.1:9",
                    token=token,
                )
    data = [plexrl.Datum(tokens=dep.tokenize(f"{i}+{i}={2 * i}")) for i in range(4)]
    out = plexrl.result([dep.forward_backward(data), dep.optim_step()], timeout=120)
    assert out[1]["version"] == 1.0


def test_a_train_step_is_forward_backward_then_optim_step_in_one_request(runtime):
    """Fused, on two ranks and on one: the same results and weights bit for bit as the two
    requests, one span per rank per step; bad input typed before anything runs."""
    spec = tiny_spec(seed=23)
    loss = plexrl.PolicyGradient()
    opt = plexrl.AdamWParams(lr=1e-3, grad_clip=1.0)
    for world in (2, 1):
        fused = runtime.deploy(unique("fused"), spec, world_size=world)
        split = runtime.deploy(unique("split"), spec, world_size=world)
        data = [
            plexrl.Datum(d.tokens, advantages=tuple(0.5 - i * 0.2 for _ in d.tokens))
            for i, d in enumerate(batch_for(fused))
        ]
        t0 = time.time()
        for _ in range(2):
            got = plexrl.result(fused.train_step(data, loss, opt), timeout=120)
            fb, step = plexrl.result([split.forward_backward(data, loss), split.optim_step(opt)])
            assert got == {"forward_backward": fb, "optim_step": step}
        a, b = plexrl.result([fused.get_weights(), split.get_weights()], timeout=120)
        assert a.version == b.version == 2
        assert all(torch.equal(a.tensors[n], b.tensors[n]) for n in b.tensors)
        spans = [s for s in runtime.timeline(since=t0) if s.deployment == fused.name]
        ops = [s.op for s in spans]
        assert ops.count("train_step") == 2 * world
        assert not {"forward_backward", "optim_step"} & set(ops)
        with pytest.raises(errors.InvalidOptimizerParams):
            fused.train_step(data, loss, {"lr": 1})
        with pytest.raises(errors.InvalidLoss):
            fused.train_step(data, "pg")
        with pytest.raises(errors.InvalidBatch):
            fused.train_step([plexrl.Datum(tokens=(1, 10**6))], loss)
        # the worker checks too, whatever the client did: every rank fails, nothing changes
        bad = plexrl.AdamWParams(lr=1e-3, grad_clip=1.0)
        object.__setattr__(bad, "lr", float("nan"))
        with pytest.raises(errors.InvalidOptimizerParams):
            plexrl.result(
                fused._submit(
                    "train_step",
                    plexrl_ops().train_step,
                    [(p, loss, bad) for p in rank_shares(tuple(data), fused.info.world_size)],
                ),
                timeout=120,
            )
        assert torch.equal(
            plexrl.result(fused.get_weights()).tensors[next(iter(b.tensors))],
            b.tensors[next(iter(b.tensors))],
        )
        for d in (fused, split):
            runtime.undeploy(d.name)


def plexrl_ops():
    from plexrl_dask.worker import ops

    return ops


def test_gangs_holding_their_workers_run_every_request_to_the_end(runtime):
    """plexrl.scheduler.gang-hold through the operator's set_policy (typed errors for bad
    values): a 2-rank job's train steps and another job's requests on one of its workers
    all complete with holds on (the hold's rule: tests/test_dispatch.py)."""
    with pytest.raises(errors.ConfigError):
        runtime.set_policy(gang_hold_s=-1.0)
    with pytest.raises(errors.ConfigError):
        runtime.set_policy(gang_hold_s="long")
    assert runtime.set_policy(gang_hold_s=0.5)["gang_hold_s"] == 0.5
    try:
        gang = runtime.deploy(unique("held"), tiny_spec(seed=25), world_size=2)
        other = plexrl.Runtime(runtime.client, job=unique("other"))
        single = other.deploy(unique("beside"), tiny_spec(seed=26), workers=[gang.info.workers[1]])
        data = batch_for(gang)
        steps, reads = [], []
        for _ in range(4):
            steps.append(gang.train_step(data))
            reads += [single.forward(data) for _ in range(3)]
        done = plexrl.result([*steps, *reads], timeout=120)
        assert [d["optim_step"]["version"] for d in done[:4]] == [1, 2, 3, 4]
        assert all(len(r.logprobs) == len(data) for r in done[4:])
    finally:
        assert runtime.set_policy(gang_hold_s=0.0)["gang_hold_s"] == 0.0


def test_a_malformed_weights_reference_is_refused_typed():
    """What ``load_weights`` reads is checked where it runs, whatever sent it."""
    from plexrl_dask.worker.stores import checked_reference

    good = {"path": "/x", "model": "weights.p", "version": 3, "node": "n", "source": "tcp://a"}
    assert checked_reference(good) == ("weights.p", 3)
    for bad in ([1], {"version": 3}, {**good, "version": -1}, {**good, "version": True},
                {**good, "model": "a/b"}, {**good, "source": 5}):  # fmt: skip
        with pytest.raises(errors.WeightsMismatch):
            checked_reference(bad)


def test_a_two_rank_policy_trains_on_a_single_sequence(runtime):
    """A step with fewer sequences than ranks (one GRPO group taught, say): the rank past
    the batch trains on a zero-weight filler, and the step equals one worker's."""
    data = [plexrl.Datum.from_prompt_completion([5, 6, 7], [8, 9], advantage=0.5)]
    loss, params = plexrl.PolicyGradient(), plexrl.AdamWParams(lr=1e-2)
    sharded = runtime.deploy(unique("two"), tiny_spec(seed=31), world_size=2)
    single = runtime.deploy(unique("one"), tiny_spec(seed=31))
    got = plexrl.result(sharded.train_step(data, loss, params))
    want = plexrl.result(single.train_step(data, loss, params))
    assert math.isclose(got["forward_backward"]["loss"], want["forward_backward"]["loss"],
                        rel_tol=1e-5)  # fmt: skip
    scored = plexrl.result(sharded.forward(data, top=2))  # (one sequence on two ranks too)
    expected = plexrl.result(single.forward(data, top=2))
    assert len(scored.logprobs) == len(scored.top) == 1
    after = scored.logprobs[0]
    assert max(abs(a - b) for a, b in zip(after, expected.logprobs[0], strict=True)) < 1e-4


def _corrupt_last_chunk(model: str, version: int, tensor: str, dask_worker=None) -> list[str]:
    """Flip a byte of ``tensor``'s last chunk (the last rank's rows) in each of the node's
    tiers that holds the version (a read may be served by either)."""
    from plexrl_dask.worker.holder import holder_of

    done = []
    for tier in ("dram", "nvme"):
        store = holder_of(dask_worker).node.store(tier)
        if version not in store.versions(model):
            continue
        entry = store.manifest(model, version).tensors[tensor]
        path = store.objects.path(entry.chunk_digests[sorted(entry.chunk_digests)[-1]])
        raw = bytearray(path.read_bytes())
        raw[0] ^= 0xFF
        path.write_bytes(bytes(raw))
        done.append(tier)
    return done


def test_a_load_one_rank_cannot_read_changes_no_rank(runtime):
    """A checkpoint whose chunk of rank 1's rows is corrupt: ``load_state`` fails typed on
    both ranks and neither took any of it (rank 0 once loaded its half: a model of two
    versions, and rank 0's optimizer of the checkpoint's). The ranks agree on their reads
    before any copies into place."""
    spec = tiny_spec(seed=5, hidden_size=128, num_heads=4, num_kv_heads=2)
    dep = runtime.deploy(unique("half"), spec, world_size=2)
    data = batch_for(dep, 4)
    step = [dep.forward_backward(data), dep.optim_step(plexrl.AdamWParams(lr=1e-2))]
    plexrl.result(step)
    saved = plexrl.result(dep.save_state())
    plexrl.result([dep.forward_backward(data), dep.optim_step(plexrl.AdamWParams(lr=1e-2))])
    before = plexrl.result(dep.get_weights()).tensors
    tensor = "model/model.layers.0.self_attn.q_proj.weight"
    corrupted = runtime.client.run(
        _corrupt_last_chunk, saved["model"], saved["version"], tensor, workers=[saved["source"]]
    )
    assert corrupted[saved["source"]], corrupted
    # (the corrupt chunk's own error on every rank: before, the rank that read it and the
    # others raised different ones, and the request's was whichever failed first)
    with pytest.raises(errors.CorruptState, match="q_proj.weight"):
        plexrl.result(dep.load_state(saved), timeout=120)
    after = plexrl.result(dep.get_weights()).tensors
    assert all(torch.equal(after[n], t) for n, t in before.items())
    plexrl.result([dep.forward_backward(data), dep.optim_step()])  # (it trains on)


def test_weights_of_another_architecture_of_the_same_shapes_are_refused(runtime):
    """4 heads of 32 and 8 heads of 16 have the same weight shapes in a 128-wide layer: a sync
    between them was accepted, and the replica then read the weights under the wrong heads.
    The architecture is recorded with published weights and checked on load. (Counts given
    as numpy integers are counts.)"""
    import numpy as np

    trainer = runtime.deploy(
        unique("arch-a"), tiny_spec(seed=5, hidden_size=128, num_heads=4, num_kv_heads=2),
        world_size=np.int64(2),
    )  # fmt: skip
    other = runtime.deploy(
        unique("arch-b"), tiny_spec(seed=5, hidden_size=128, num_heads=8, num_kv_heads=4),
        role="rollout", replicas=np.int64(1),
    )  # fmt: skip
    before = plexrl.result(other.get_weights()).tensors
    with pytest.raises(errors.WeightsMismatch, match="num_attention_heads 4"):
        plexrl.result(runtime.sync_weights(trainer, other))
    after = plexrl.result(other.get_weights()).tensors
    assert all(torch.equal(after[n], t) for n, t in before.items())
    with pytest.raises(errors.CheckpointIncompatible, match="architecture"):
        plexrl.result(other.load_state(plexrl.result(trainer.save_state())))



class _RewardNotYet:
    """A task whose reward raises what torch's collectives raise too (a RuntimeError)."""

    stop: str = "\n"

    def problems(self, start: int, count: int) -> list:
        from plexrl_dask.tasks import Problem

        return [Problem(prompt=f"{i}=", answer="1\n", index=i) for i in range(start, start + count)]

    def reward(self, problem, completion: str) -> float:
        raise NotImplementedError("not written yet")


def test_a_reward_that_raises_on_a_sharded_policys_workers_leaves_the_policy_as_it_was(runtime):
    """Scored on the worker, in the training request of a 2-rank policy: the reward's
    NotImplementedError (a RuntimeError) was taken for a failed collective, and both ranks
    dropped the policy's trained state. It is the task's error, typed, on both ranks."""
    from plexrl_dask.rl import GRPOConfig, GRPOJob

    policy = runtime.deploy(unique("reward-raises"), tiny_spec(seed=31), world_size=2)
    plexrl.result([policy.forward_backward(batch_for(policy, 2)), policy.optim_step()])
    before = plexrl.result(policy.get_weights()).tensors
    config = GRPOConfig(steps=1, prompts_per_step=2, group_size=2, max_tokens=4)
    with pytest.raises(errors.ConfigError, match="_RewardNotYet's reward of problem"):
        GRPOJob(unique("reward-raises"), runtime, _RewardNotYet(), policy, config).run()
    after = plexrl.result(policy.get_weights()).tensors
    assert all(torch.equal(after[n], t) for n, t in before.items())
    plexrl.result([policy.forward_backward(batch_for(policy, 2)), policy.optim_step()])
