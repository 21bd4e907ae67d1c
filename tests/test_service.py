"""The execution service end to end on a real process LocalCluster."""

from __future__ import annotations

import copy
import dataclasses
import os
import time

import dask
import pytest
import torch
from distributed import Client, Event

import plexrl_dask as plexrl
from plexrl_dask import errors
from plexrl_dask.rl import supervised_warmup
from plexrl_dask.tasks import ArithmeticTask
from tests.conftest import hold, tiny_spec, unique


def gpu_workers(client: Client) -> list[str]:
    return sorted(
        addr for addr, w in plexrl.worker_info(client).items() if w["resources"].get("GPU")
    )


def test_deploy_places_and_reports_residency(runtime):
    dep = runtime.deploy(unique("placed"), tiny_spec())
    assert dep.info.worker in gpu_workers(runtime.client)
    status = runtime.status()
    rows = [r for r in status["residency"] if r["deployment"] == dep.name]
    assert len(rows) == 1 and rows[0]["tier"] == "hbm" and rows[0]["worker"] == dep.info.worker
    assert {"deployment", "version", "tier", "bytes", "load_s"} <= rows[0].keys()
    assert rows[0]["bytes"] > 0 and rows[0]["load_s"] > 0
    holder = runtime.holder(dep.info.worker).status().result(timeout=30)
    assert holder["replicas"][dep.name]["resident"] is True


def test_sampling_reproducible_across_workers_and_batches(runtime):
    a_worker, b_worker = gpu_workers(runtime.client)[:2]
    spec = tiny_spec(seed=7)
    a = runtime.deploy(unique("samp-a"), spec, role="rollout", workers=[a_worker])
    b = runtime.deploy(unique("samp-b"), spec, role="rollout", workers=[b_worker])
    assert a.info.worker != b.info.worker
    prompts = ["1+2=", "34+56=", "7*8=", "100-1="]
    params = plexrl.SamplingParams(n=3, temperature=1.0, top_p=0.9, max_tokens=8, seed=42)
    ra, rb = plexrl.result([a.sample(prompts, params), b.sample(prompts, params)])
    assert ra == rb  # bit-identical on another worker
    # The same prompts split over two requests (their ids kept) sample the same tokens.
    first = b.sample(prompts[:1], params, prompt_ids=[0])
    rest = b.sample(prompts[1:], params, prompt_ids=[1, 2, 3])
    split = plexrl.result(first).sequences + plexrl.result(rest).sequences
    assert [[s.tokens for s in g] for g in split] == [[s.tokens for s in g] for g in ra.sequences]


def test_warmup_lowers_loss_through_the_runtime(runtime):
    dep = runtime.deploy(unique("warm"), tiny_spec(hidden_size=64))
    task = ArithmeticTask(digits=1, ops="+")
    losses = supervised_warmup(
        dep, task, steps=40, batch_size=16, optim=plexrl.AdamWParams(lr=1e-2)
    )
    assert len(losses) == 40
    assert sum(losses[-5:]) / 5 < 0.6 * sum(losses[:5]) / 5


def test_two_drivers_share_one_deployment(cluster, runtime):
    dep = runtime.deploy(unique("shared"), tiny_spec())
    data = [plexrl.Datum(tokens=dep.tokenize("12+21=33"))]
    with Client(cluster) as other_client:
        other = plexrl.Runtime(other_client, job="other-driver")
        theirs = other.deployment(dep.name)
        assert theirs.info.uid == dep.info.uid and theirs.info.owner == runtime.job
        mine_lp = plexrl.result(dep.forward(data)).logprobs
        # The same job from another client needs nothing; another job, a share.
        same_job = plexrl.Runtime(other_client, job=runtime.job).deployment(dep.name)
        assert plexrl.result(same_job.forward(data)).logprobs == mine_lp
        with pytest.raises(errors.PermissionDenied):
            plexrl.result(theirs.forward(data))
        dep.share(other.job, ops=("forward", "forward_backward", "optim_step"))
        assert plexrl.result(theirs.forward(data)).logprobs == mine_lp
        plexrl.result([theirs.forward_backward(data), theirs.optim_step()])
        # The first driver sees the second driver's update.
        assert plexrl.result(dep.forward(data)).logprobs != mine_lp
        assert plexrl.result(dep.get_weights()).version == 1


def test_client_submit_with_annotations(runtime):
    dep = runtime.deploy(unique("raw"), tiny_spec())
    data = [plexrl.Datum(tokens=dep.tokenize("5+5=10"))]
    expected = plexrl.result(dep.forward(data))
    client = runtime.client
    with dask.annotate(plexrl=dep.annotation()):
        fut = client.submit(plexrl.ops.forward, dep.name, data, pure=False)
    assert plexrl.result(fut) == expected
    # Another job's request, one that names no job, and one in this job's name without its
    # secret (or with another's) are refused.
    other = plexrl.Runtime(client, job=unique("raw-other"))
    for annotation in (
        {"job": "raw-user"},
        {},
        {"job": runtime.job},
        {"job": runtime.job, "secret": other.secret},
        {"job": other.job, "secret": other.secret},
    ):
        with dask.annotate(plexrl={"deployment": dep.name, **annotation}):
            fut = client.submit(plexrl.ops.forward, dep.name, data, pure=False)
        with pytest.raises(errors.PermissionDenied):
            plexrl.result(fut)
    # Without the annotation the op refuses rather than loading a stray replica.
    fut = client.submit(plexrl.ops.forward, dep.name, data, pure=False, resources={"GPU": 1})
    with pytest.raises(errors.NotRouted, match="dask.annotate"):
        plexrl.result(fut)
    # Plain Dask work on the same cluster is untouched.
    assert client.submit(sum, [1, 2, 3]).result(timeout=30) == 6


def test_pipelined_steps_run_in_order(runtime):
    dep = runtime.deploy(unique("order"), tiny_spec())
    data = [plexrl.Datum(tokens=dep.tokenize("9+9=18"))]
    futs = []
    for _ in range(3):
        futs += [dep.forward_backward(data), dep.optim_step()]
    out = plexrl.result(futs)
    assert [m["version"] for m in out[1::2]] == [1.0, 2.0, 3.0]
    assert out[4]["loss"] < out[0]["loss"]


def test_requests_of_one_deployment_released_together_run_in_order(runtime):
    """Regression (found by bench.multiplex with lookahead): one decision released a
    forward_backward to a free worker and queued its optim_step behind it, and the worker got
    them in reverse (the step ran first, on no gradient). A request that takes an input holds
    the worker here, so nothing is queued behind it and both pairs pend together."""
    dep = runtime.deploy(unique("together"), tiny_spec(seed=3))
    data = [plexrl.Datum(tokens=dep.tokenize("9+9=18"))]
    gate = Event(unique("together-gate"), client=runtime.client)
    token = runtime.client.submit(str, "an input", pure=False)
    with dask.annotate(plexrl=dep.annotation(op="hold")):
        blocker = runtime.client.submit(hold, dep.name, gate.name, 120.0, token, pure=False)
    futs = []
    try:
        for _ in range(2):
            futs += [dep.forward_backward(data), dep.optim_step()]
        deadline = time.monotonic() + 60
        while runtime.status()["queue"]["admitted"] < 1:
            assert time.monotonic() < deadline, "the requests never reached the dispatcher"
            time.sleep(0.05)
    finally:
        gate.set()
    assert blocker.result(timeout=60) == dep.name
    out = plexrl.result(futs, timeout=120)
    assert [m["version"] for m in out[1::2]] == [1.0, 2.0]
    steps = [d for d in runtime.status()["decisions"] if d["request"] == futs[1].key]
    assert steps and steps[0]["behind"] == futs[0].key  # queued behind its forward_backward
    # Dask priorities tie for one-task graphs submitted close together; released tasks carry
    # their release order instead, which the worker follows among the tasks waiting on it.
    priorities = runtime.client.run_on_scheduler(
        lambda dask_scheduler, keys: [list(dask_scheduler.tasks[k].priority) for k in keys],
        keys=[f.key for f in futs],
    )
    assert priorities == sorted(priorities) and len({tuple(p) for p in priorities}) == 4


def test_sync_weights(runtime):
    trainer = runtime.deploy(unique("trainer"), tiny_spec(seed=1))
    rollout = runtime.deploy(unique("rollout"), tiny_spec(seed=2), role="rollout")
    data = [plexrl.Datum(tokens=trainer.tokenize("3*3=9"))]
    plexrl.result([trainer.forward_backward(data), trainer.optim_step()])
    assert plexrl.result(runtime.sync_weights(trainer, rollout.name)) == 1
    wt, wr = plexrl.result([trainer.get_weights(), rollout.get_weights()])
    assert wr.version == wt.version == 1
    assert all(torch.equal(wt.tensors[n], wr.tensors[n]) for n in wt.tensors)


def test_bad_input_gives_typed_errors_and_harms_nothing(runtime):
    dep = runtime.deploy(unique("bad"), tiny_spec())
    bystander = runtime.deploy(unique("bystander"), tiny_spec(seed=3))
    good = [plexrl.Datum(tokens=dep.tokenize("1+1=2"))]
    before = plexrl.result(bystander.forward(good))

    with pytest.raises(errors.DeploymentNotFound):
        runtime.deployment("no-such-deployment")
    with pytest.raises(errors.DeploymentExists):
        runtime.deploy(dep.name, tiny_spec(seed=9))
    with pytest.raises(errors.DeploymentDoesNotFit, match="budget"):
        runtime.deploy(unique("huge"), plexrl.ModelSpec.tiny(hidden_size=2048, num_layers=24))
    with pytest.raises(errors.EmptyBatch):
        dep.forward([])
    with pytest.raises(errors.MismatchedLengths):
        plexrl.Datum(tokens=[1, 2, 3], advantages=[0.0, 1.0])
    with pytest.raises(errors.InvalidSamplingParams):
        plexrl.SamplingParams(top_p=1.5)
    with pytest.raises(errors.TokenOutOfVocabulary):
        plexrl.result(dep.forward([plexrl.Datum(tokens=[1, 10**6])]))
    with pytest.raises(errors.SequenceTooLong):
        plexrl.result(dep.sample([[5] * 60], plexrl.SamplingParams(max_tokens=16)))
    nan = plexrl.Datum(
        tokens=good[0].tokens, advantages=[0.0] + [float("nan")] * (len(good[0].tokens) - 1)
    )
    with pytest.raises(errors.NonFiniteLoss):
        plexrl.result(dep.forward_backward([nan], plexrl.PolicyGradient()))
    for bad in ([1, 2], ["1+1=", None], [[1, "2"]]):
        with pytest.raises(errors.InvalidSamplingParams, match="prompt"):
            dep.sample(bad)
    with pytest.raises(errors.NoChatTemplate):  # (a worker renders chats: this model has none)
        plexrl.result(dep.sample([plexrl.Chat((("user", "1+1="),))]))
    for size in ({"world_size": 0}, {"replicas": -1}, {"world_size": 1.5}):
        with pytest.raises(errors.ConfigError, match=next(iter(size))):
            runtime.deploy(unique("no"), tiny_spec(), **size)
    weights = plexrl.result(dep.get_weights()).tensors
    with pytest.raises(errors.WeightsMismatch, match="torch.Tensor"):
        plexrl.result(dep.set_weights({n: t.numpy() for n, t in weights.items()}))
    with pytest.raises(errors.CheckpointError, match="path"):
        dep.load_state({"model": dep.name, "version": 1})
    with pytest.raises(errors.CheckpointError, match="path"):
        dep.load_state(42)

    # The deployment still trains; the bystander is unchanged; the registry is intact.
    out = plexrl.result([dep.forward_backward(good), dep.optim_step()])
    assert out[1]["version"] == 1.0
    assert plexrl.result(bystander.forward(good)) == before
    assert {dep.name, bystander.name} <= {d.name for d in runtime.deployments()}


def test_undeploy_frees_the_replica(runtime):
    dep = runtime.deploy(unique("gone"), tiny_spec())
    runtime.undeploy(dep.name)
    with pytest.raises(errors.DeploymentNotFound):
        plexrl.result(dep.forward([plexrl.Datum(tokens=[1, 2])]))
    holder = runtime.holder(dep.info.worker).status().result(timeout=30)
    assert dep.name not in holder["replicas"]


def test_rollout_replicas_sample_exactly_like_one(runtime):
    spec = tiny_spec(seed=11)
    one = runtime.deploy(unique("rep1"), spec, role="rollout")
    two = runtime.deploy(unique("rep2"), spec, role="rollout", replicas=2)
    assert len(set(two.info.workers)) == 2
    # Prompts are split at whole sampling streams (plexrl.sampling.stream-rows, 128 rows =
    # 32 prompts x 4 samples): 40 prompts give the replicas 32 and 8.
    prompts = [f"{i}+{i % 7}=" for i in range(40)]
    params = plexrl.SamplingParams(n=4, temperature=1.0, max_tokens=6, seed=5)
    r1, r2 = plexrl.result([one.sample(prompts, params), two.sample(prompts, params)])
    assert r1 == r2  # bit-identical, log-probabilities included
    holders = [runtime.holder(w).status().result(timeout=30) for w in two.info.workers]
    assert all(h["replicas"][two.name]["resident"] for h in holders)  # both replicas worked
    # Weights set on the deployment reach every replica.
    weights = plexrl.result(one.get_weights())
    assert plexrl.result(two.set_weights(weights, version=4)) == 4
    for h in [runtime.holder(w).status().result(timeout=30) for w in two.info.workers]:
        assert h["replicas"][two.name]["version"] == 4


def slow_deployment(runtime, name: str, seed: int):
    """A deployment whose forward on the returned batch keeps its worker busy ~0.5 s, and that
    worker."""
    worker = sorted(runtime.status()["workers"])[0]
    spec = tiny_spec(
        seed=seed, hidden_size=256, num_layers=4, num_heads=4, num_kv_heads=2, max_positions=256
    )
    dep = runtime.deploy(unique(name), spec, workers=[worker])
    big = [
        plexrl.Datum(tokens=dep.tokenize("".join(str(j % 10) for j in range(200))))
        for _ in range(8)
    ]
    return dep, big, worker


@pytest.mark.parametrize("lookahead", [False, True], ids=["no-lookahead", "lookahead"])
def test_hrrs_lets_a_short_request_overtake_a_long_one(runtime, lookahead):
    slow, big, worker = slow_deployment(runtime, f"slow-{lookahead}", 30)
    fast = runtime.deploy(unique("fast"), tiny_spec(seed=31), workers=[worker])
    tiny = [plexrl.Datum(tokens=fast.tokenize("1+1=2"))]
    plexrl.result([slow.forward(big), fast.forward(tiny)])  # the plugin learns both service times
    runtime.set_policy(lookahead=lookahead)
    try:
        # With lookahead a second blocker takes the slot behind the first, so that both
        # queued requests are pending together when a decision is made for that worker.
        blockers = [slow.forward(big) for _ in range(2 if lookahead else 1)]
        queued_long, queued_short = slow.forward(big), fast.forward(tiny)
        plexrl.result([*blockers, queued_long, queued_short])
    finally:
        runtime.set_policy(lookahead=True)
    order = [d["request"] for d in runtime.status()["decisions"]]
    short_key, long_key = queued_short.key, queued_long.key  # single-task requests: id == key
    assert order.index(short_key) < order.index(long_key)
    decision = next(d for d in runtime.status()["decisions"] if d["request"] == short_key)
    assert decision["ratio"] > 1 and not decision["urgent"]


def test_undeploy_fails_queued_requests_instead_of_stranding_them(runtime):
    slow, big, worker = slow_deployment(runtime, "busy", 32)
    doomed = runtime.deploy(unique("doomed"), tiny_spec(seed=33), workers=[worker])
    blocker = slow.forward(big)
    queued = doomed.forward([plexrl.Datum(tokens=[1, 5, 6])])
    runtime.undeploy(doomed.name)
    with pytest.raises(errors.DeploymentNotFound):
        plexrl.result(queued, timeout=120)
    plexrl.result(blocker, timeout=120)
    assert plexrl.result(slow.forward(big[:1]), timeout=120)  # the worker is not stuck


def test_fifo_ordering_runs_requests_in_arrival_order(runtime):
    slow, big, worker = slow_deployment(runtime, "slow-fifo", 34)
    fast = runtime.deploy(unique("fast-fifo"), tiny_spec(seed=35), workers=[worker])
    tiny = [plexrl.Datum(tokens=fast.tokenize("1+1=2"))]
    plexrl.result([slow.forward(big), fast.forward(tiny)])
    with pytest.raises(errors.ConfigError):
        runtime.set_policy(ordering="lifo")
    assert runtime.set_policy(ordering="fifo")["patience_factor"] == 0
    try:
        blocker, queued_long, queued_short = (
            slow.forward(big),
            slow.forward(big),
            fast.forward(tiny),
        )
        plexrl.result([blocker, queued_long, queued_short])
    finally:
        restored = runtime.set_policy(ordering="hrrs")
    assert restored["patience_factor"] > 0
    order = [d["request"] for d in runtime.status()["decisions"]]
    assert order.index(queued_long.key) < order.index(queued_short.key)


def test_the_policy_cannot_change_while_requests_wait(runtime):
    slow, big, _ = slow_deployment(runtime, "slow-busy", 36)
    # Three: two wait behind the first, so the queue is still busy a moment after we see it.
    running = [slow.forward(big) for _ in range(3)]
    deadline = time.monotonic() + 60
    while not runtime.status()["queue"]["pending"]:
        assert time.monotonic() < deadline, "nothing was queued behind the running request"
        time.sleep(0.01)
    with pytest.raises(errors.SchedulerBusy):
        runtime.set_policy(ordering="fifo")
    plexrl.result(running)
    assert runtime.status()["policy"]["patience_factor"] > 0  # unchanged


def _bypassed(value, **fields):
    """``value`` with ``fields`` set past its constructor's checks, as an unpickled object
    from a client with other code arrives on a worker."""
    out = copy.copy(value)
    for name, v in fields.items():
        object.__setattr__(out, name, v)
    return out


def _smuggled_graph() -> plexrl.GraphLoss:
    """A graph loss whose one call is ``builtins.eval``, made around its constructor."""
    loss = plexrl.trace_loss(lambda logprobs: (torch.exp(logprobs), {}), {"logprobs": 1})
    first, call, out = loss.nodes
    evil = dataclasses.replace(call, target="builtins.eval", args=("print('escaped')",))
    return _bypassed(loss, nodes=(first, evil, out))


def test_the_worker_checks_what_it_runs_whatever_the_driver_checked(runtime):
    from plexrl_dask.worker import ops

    dep = runtime.deploy(unique("checked"), tiny_spec())
    good = [plexrl.Datum(tokens=dep.tokenize("1+1=2"))] * 2
    before = plexrl.result(dep.get_weights())
    # Straight to the worker (``_submit`` skips every check the driver makes).
    raw = {
        errors.InvalidSamplingParams: [
            ("sample", ops.sample, (["1+1="], _bypassed(plexrl.SamplingParams(), top_p=2.0))),
            ("sample", ops.sample, (["1+1="], _bypassed(plexrl.SamplingParams(), n=0))),
            ("sample", ops.sample, (["1+1="], _bypassed(plexrl.SamplingParams(), temperature=-1))),
            ("sample", ops.sample, ("1+1=", plexrl.SamplingParams())),
            ("sample", ops.sample, ([None], plexrl.SamplingParams())),
            ("sample", ops.sample, (["1+1="], {"n": 2})),
            ("forward", ops.forward, (good, 0.0)),
            ("forward", ops.forward, (good, float("nan"))),
        ],
        errors.RequestTooLarge: [
            ("sample", ops.sample, (["1+1="], plexrl.SamplingParams(n=10**6))),
        ],
        errors.InvalidOptimizerParams: [
            ("optim_step", ops.optim_step, (_bypassed(plexrl.AdamWParams(), lr=-1.0),)),
            ("optim_step", ops.optim_step, ({"lr": 1e-3},)),
        ],
        errors.InvalidLoss: [
            (
                "forward_backward",
                ops.forward_backward,
                (good, _bypassed(plexrl.PolicyGradient(), clip_low=5.0)),
            ),
            ("forward_backward", ops.forward_backward, (good, "cross-entropy")),
            ("forward_backward", ops.forward_backward, (good, _smuggled_graph())),
        ],
        errors.EmptyBatch: [
            ("forward", ops.forward, (["1+1=2"], 1.0)),
            (
                "forward_backward",
                ops.forward_backward,
                ([_bypassed(good[0], tokens=(1,))], plexrl.CrossEntropy()),
            ),
        ],
        errors.WeightsMismatch: [
            (
                "set_weights",
                ops.set_weights,
                ({n: t * float("nan") for n, t in before.tensors.items()}, 7, True),
            ),
            ("set_weights", ops.set_weights, ([1, 2], None, True)),
        ],
    }
    for error, requests in raw.items():
        for op, fn, args in requests:
            with pytest.raises(error):
                plexrl.result(dep._submit(op, fn, [args]))
    # The driver refuses what it can see before anything is submitted.
    with pytest.raises(errors.RequestTooLarge, match="max-request-rows"):
        dep.sample(["1+1="], plexrl.SamplingParams(n=10**6))
    with pytest.raises(errors.InvalidSamplingParams, match="temperature"):
        dep.forward(good, temperature=0)

    # Nothing was written and nothing is left waiting: the deployment trains as before.
    after = plexrl.result(dep.get_weights())
    assert after.version == before.version
    assert all(torch.equal(after.tensors[n], t) for n, t in before.tensors.items())
    out = plexrl.result([dep.forward_backward(good), dep.optim_step()])
    assert out[1]["version"] == before.version + 1


def test_a_stale_handle_never_reaches_a_later_deployment_of_its_name(runtime):
    name = unique("reborn")
    old = runtime.deploy(name, tiny_spec(seed=1))
    batch = [plexrl.Datum(tokens=old.tokenize("1+1=2"))] * 2
    plexrl.result(old.forward(batch))
    runtime.undeploy(name)
    new = runtime.deploy(name, tiny_spec(seed=2))
    assert new.info.incarnation != old.info.incarnation
    before = plexrl.result(new.get_weights())
    for request in (
        lambda: old.forward(batch),
        lambda: old.forward_backward(batch),
        lambda: old.set_weights({n: t * 0 for n, t in before.tensors.items()}, version=999),
    ):
        with pytest.raises(errors.DeploymentNotFound, match="undeployed"):
            plexrl.result(request())
    after = plexrl.result(new.get_weights())
    assert after.version == before.version
    assert all(torch.equal(after.tensors[n], t) for n, t in before.tensors.items())
    # A fresh lookup addresses the new one; the incarnation survives its lifecycle moves.
    again = runtime.deployment(name)
    assert again.info.incarnation == new.info.incarnation
    assert plexrl.result(again.forward(batch)) == plexrl.result(new.forward(batch))


def test_names_that_sanitise_alike_or_overflow_keep_their_own_state(runtime):
    tag = unique("n")
    deps = [
        runtime.deploy(name, tiny_spec(seed=seed))
        for seed, name in enumerate((f"x N {tag}", f"x-N-{tag}", "p" * 241 + tag))
    ]
    saved = plexrl.result([d.save_state() for d in deps])
    assert len({s["model"] for s in saved}) == 3
    before = plexrl.result([d.get_weights() for d in deps])
    batch = [plexrl.Datum(tokens=deps[0].tokenize("1+1=2"))] * 2
    for d in deps:  # each moves on, then goes back to its own checkpoint
        plexrl.result([d.forward_backward(batch), d.optim_step(plexrl.AdamWParams(lr=0.1))])
    plexrl.result([d.load_state(s) for d, s in zip(deps, saved, strict=True)])
    for d, b in zip(deps, before, strict=True):
        got = plexrl.result(d.get_weights())
        assert all(torch.equal(got.tensors[n], t) for n, t in b.tensors.items()), d.name


def test_a_weights_only_save_loads_into_a_rollout_replica(runtime):
    """``save_state(weights_only=True)``: the parameters without the optimizer state (what a
    sampler of them needs; plexrl serve's kept snapshots), loadable by a rollout replica."""
    policy = runtime.deploy(unique("wo-policy"), tiny_spec(seed=31))
    batch = [plexrl.Datum(tokens=policy.tokenize("1+1=2"))] * 2
    plexrl.result([policy.forward_backward(batch), policy.optim_step(plexrl.AdamWParams(lr=0.1))])
    full, light = plexrl.result(
        [policy.save_state(), policy.save_state(model=unique("wo"), weights_only=True)]
    )
    rollout = runtime.deploy(unique("wo-rollout"), tiny_spec(seed=32), role="rollout")
    plexrl.result(rollout.load_state(light))
    want, got = plexrl.result([policy.get_weights(), rollout.get_weights()])
    assert all(torch.equal(got.tensors[n], t) for n, t in want.tensors.items())
    # (parameters alone: a store version only, not a DCP export)
    with pytest.raises(errors.CheckpointError):
        policy.save_state("/tmp", format="dcp", weights_only=True)
    assert full["model"] != light["model"]


def test_a_job_cannot_touch_another_jobs_deployment_unless_shared(client):
    a = plexrl.Runtime(client, job=unique("job-a"))
    b = plexrl.Runtime(client, job=unique("job-b"))
    mine = a.deploy(unique("a-policy"), tiny_spec(seed=21))
    batch = [plexrl.Datum(tokens=mine.tokenize("1+1=2"))] * 2
    before = plexrl.result(mine.get_weights())
    saved = plexrl.result(mine.save_state())
    theirs = b.deployment(mine.name)  # A's deployment, addressed by job B
    for request in (
        lambda: theirs.forward(batch),
        lambda: theirs.sample(["1+1="]),
        lambda: theirs.get_weights(),
        lambda: theirs.forward_backward(batch),
        lambda: theirs.optim_step(),
        lambda: theirs.set_weights({n: t * 0 for n, t in before.tensors.items()}, version=999),
        lambda: theirs.save_state(),
        lambda: theirs.load_state(saved),
    ):
        with pytest.raises(errors.PermissionDenied, match=b.job):
            plexrl.result(request())
    for change in (
        lambda: b.undeploy(mine.name),
        lambda: b.deploy(mine.name, tiny_spec(seed=21), exist_ok=True),
        lambda: b.deploy(unique("for-a"), tiny_spec(), owner=a.job),
        lambda: theirs.share(b.job),
    ):
        with pytest.raises(errors.PermissionDenied):
            change()
    assert mine.name not in {d.name for d in b.deployments()}
    after = plexrl.result(mine.get_weights())
    assert after.version == before.version
    assert all(torch.equal(after.tensors[n], t) for n, t in before.tensors.items())

    # Shared for reading: B scores and samples, and still cannot train it.
    assert mine.share(b.job) == sorted(["forward", "get_weights", "load", "sample"])
    assert plexrl.result(theirs.forward(batch)) == plexrl.result(mine.forward(batch))
    assert plexrl.result(theirs.sample(["1+1="])).sequences
    assert mine.name in {d.name for d in b.deployments()}
    with pytest.raises(errors.PermissionDenied):
        plexrl.result(theirs.forward_backward(batch))
    with pytest.raises(errors.ConfigError, match="unknown ops"):
        mine.share(b.job, ops=("drop_everything",))
    assert mine.share(b.job, ops=()) == []  # revoked
    with pytest.raises(errors.PermissionDenied):
        plexrl.result(theirs.forward(batch))
    # A trains on; what B's refused requests did is nothing.
    out = plexrl.result([mine.forward_backward(batch), mine.optim_step()])
    assert out[1]["version"] == before.version + 1


def test_deployment_names_are_per_job_namespaces(client):
    """Jobs A and B each deploy "policy": two deployments, each job's name finds its own; A's
    is addressed from B by its registered name or job, and serves B only what A shared."""
    a = plexrl.Runtime(client, job=unique("ns-a"))
    b = plexrl.Runtime(client, job=unique("ns-b"))
    name = unique("policy")
    mine, theirs = a.deploy(name, tiny_spec(seed=23)), b.deploy(name, tiny_spec(seed=24))
    assert (mine.name, theirs.name) == (f"{name}@{a.job}", f"{name}@{b.job}")
    batch = [plexrl.Datum(tokens=mine.tokenize("5+5=10"))]
    outs = plexrl.result([mine.forward(batch), theirs.forward(batch)])
    assert outs[0] != outs[1]  # (different seeds: different models)
    assert a.deployment(name).name == mine.name and b.deployment(name).name == theirs.name
    assert b.deployment(name, job=a.job).name == b.deployment(mine.name).name == mine.name
    with pytest.raises(errors.PermissionDenied):
        plexrl.result(b.deployment(name, job=a.job).forward(batch))
    mine.share(b.job, ops=("forward",))
    assert plexrl.result(b.deployment(mine.name).forward(batch)) == outs[0]
    b.undeploy(name)  # B's own; A's is untouched
    assert plexrl.result(mine.forward(batch)) == outs[0]
    with pytest.raises(errors.DeploymentNotFound):
        b.deployment(name)
    # Around the runtime: an unqualified name is refused, another job's namespace too.
    fields = {"uid": "u", "spec": tiny_spec().to_dict(), "role": "train", "backend": "torch",
              "owner": b.job, "job": b.job, "memory_bytes": 1, "exist_ok": False,
              "candidates": None}  # fmt: skip
    with pytest.raises(errors.ConfigError, match="<name>@<job>"):
        b._call("plexrl_deploy", name=unique("bare"), **fields)
    with pytest.raises(errors.PermissionDenied, match="namespace"):
        b._call("plexrl_deploy", name=f"{unique('into')}@{a.job}", **fields)
    with pytest.raises(errors.ConfigError, match="'@'"):
        plexrl.Runtime(client, job="has@sign").deploy(unique("x"), tiny_spec())


def test_a_jobs_stored_state_loads_into_another_jobs_deployment_only_if_shared(client):
    """Checkpoints and published weights record the deployment whose state they are: job B
    cannot load job A's checkpoint into its own deployment until A shares get_weights."""
    a = plexrl.Runtime(client, job=unique("store-a"))
    b = plexrl.Runtime(client, job=unique("store-b"))
    spec = tiny_spec(seed=25)
    mine, theirs = a.deploy(unique("trained"), spec), b.deploy(unique("copy"), spec)
    batch = [plexrl.Datum(tokens=mine.tokenize("6+6=12"))]
    plexrl.result([mine.forward_backward(batch), mine.optim_step()])
    saved = plexrl.result(mine.save_state())
    before = plexrl.result(theirs.get_weights())
    with pytest.raises(errors.PermissionDenied, match="get_weights"):
        plexrl.result(theirs.load_state(saved))
    after = plexrl.result(theirs.get_weights())
    assert all(torch.equal(after.tensors[n], t) for n, t in before.tensors.items())
    mine.share(b.job, ops=("get_weights",))
    assert plexrl.result(theirs.load_state(saved)) == 1
    want = plexrl.result(mine.get_weights()).tensors
    got = plexrl.result(theirs.get_weights()).tensors
    assert all(torch.equal(got[n], t) for n, t in want.items())
    # A's own second deployment loads A's checkpoint without any grant.
    again = a.deploy(unique("again"), spec)
    assert plexrl.result(again.load_state(saved)) == 1


def test_a_job_is_a_principal_and_only_the_operator_changes_the_policy(client):
    """A job's secret: another driver naming the job acts in its name only with it; the
    holder actor serves reads only; an owner offloads its own deployment; set_policy needs the
    operator secret."""
    from plexrl_dask.driver.runtime import as_another_driver

    a = plexrl.Runtime(client, job=unique("principal"))
    dep = a.deploy(unique("principal-policy"), tiny_spec(seed=22))
    batch = [plexrl.Datum(tokens=dep.tokenize("2+2=4"))]
    expected = plexrl.result(dep.forward(batch))
    # Another driver process (no secret cached) naming job A: refused, until it presents it.
    with as_another_driver():
        impostor = plexrl.Runtime(client, job=a.job)
        with pytest.raises(errors.PermissionDenied, match="another driver"):
            impostor.undeploy(dep.name)
        with pytest.raises(errors.PermissionDenied):
            wrong = plexrl.Runtime(client, job=a.job, secret="0" * 32)
            plexrl.result(wrong.deployment(dep.name).forward(batch))
        reattached = plexrl.Runtime(client, job=a.job, secret=a.secret)
        assert plexrl.result(reattached.deployment(dep.name).forward(batch)) == expected
    assert a.job in a.status()["jobs_registered"]

    # The holder actor: reads yes; running, dropping, offloading, hinting no.
    holder = a.holder(dep.info.worker)
    assert dep.name in holder.names().result(timeout=30)
    for call in (
        lambda: holder.drop(dep.name),
        lambda: holder.offload(dep.name),
        lambda: holder.hint(dep.name),
        lambda: holder.prefetch(),
    ):
        with pytest.raises(errors.PermissionDenied, match="worker's own"):
            call().result(timeout=30)
    assert plexrl.result(dep.forward(batch)) == expected  # still there
    # Its owner offloads it (its next request reloads it); another job may not.
    other = plexrl.Runtime(client, job=unique("not-owner"))
    with pytest.raises(errors.PermissionDenied):
        other.deployment(dep.name).offload()
    assert dep.offload() == {dep.info.worker: True}
    replica = holder.status().result(timeout=30)["replicas"][dep.name]
    assert replica["resident"] is False
    assert plexrl.result(dep.forward(batch)) == expected

    # Cluster-wide policy: the operator only.
    with pytest.raises(errors.PermissionDenied, match="operator"):
        a.set_policy(operator_secret="x" * 32, patience_factor=0.0)
    not_the_schedulers = dask.config.set({"plexrl.operator-secret": "y" * 32})
    with not_the_schedulers, pytest.raises(errors.PermissionDenied, match="operator"):
        a.set_policy(patience_factor=0.0)
    path = a.status()["operator_secret_file"]
    assert os.stat(path).st_mode & 0o777 == 0o600
    policy = a.set_policy(fair_share=False)  # the secret from the file, as the operator
    assert policy["fair_share"] is False
    assert a.set_policy(fair_share=True)["fair_share"] is True


def test_a_job_is_held_to_its_quotas_and_others_are_not(runtime, client):
    dep = runtime.deploy(unique("quota"), tiny_spec(seed=4))
    data = [plexrl.Datum(tokens=dep.tokenize("2+2=4"))]
    other = plexrl.Runtime(client, job=unique("other-job"))
    with dask.config.set({"plexrl.quotas.max-deployments-per-job": 1}):
        with pytest.raises(errors.QuotaExceeded, match="max-deployments-per-job"):
            runtime.deploy(unique("quota-2"), tiny_spec(seed=5))
        # (its own quota; on the other worker, which the blocker below leaves free)
        free = [w for w in gpu_workers(client) if w != dep.info.worker]
        theirs = other.deploy(unique("other-1"), tiny_spec(seed=4), workers=free)
    # Device bytes: the job's deployments as deployed, summed over ranks and replicas.
    need = tiny_spec(seed=5).memory_bytes("rollout")
    with dask.config.set({"plexrl.quotas.max-device-bytes-per-job": dep.info.memory_bytes + need}):
        with pytest.raises(errors.QuotaExceeded, match="max-device-bytes-per-job"):
            runtime.deploy(unique("quota-3"), tiny_spec(seed=5), role="rollout", replicas=2)
        fits = runtime.deploy(unique("quota-4"), tiny_spec(seed=5), role="rollout")
        runtime.undeploy(fits.name)
    gate = Event(unique("quota-gate"), client=client)
    with dask.annotate(plexrl=dep.annotation(op="hold")):
        blocker = client.submit(hold, dep.name, gate.name, 120.0, pure=False)
    try:
        deadline = time.monotonic() + 90
        while runtime.status()["queue"]["by_job"].get(runtime.job):  # until the blocker runs
            assert time.monotonic() < deadline, "the blocker never started"
            time.sleep(0.05)
        with dask.config.set({"plexrl.quotas.max-queued-requests-per-job": 3}):
            futs = [dep.forward(data) for _ in range(6)]
            # At most 3 wait in the scheduler (and one may be queued on the blocked worker,
            # behind the blocker): at least 2 are refused, at once, on the free worker.
            while sum(f.status == "error" for f in futs) < 2:
                assert time.monotonic() < deadline, [f.status for f in futs]
                time.sleep(0.05)
            refused = [f for f in futs if f.status == "error"]
            waiting = [f for f in futs if f not in refused]
            assert len(waiting) >= 3
            for fut in refused:
                with pytest.raises(errors.QuotaExceeded, match=runtime.job):
                    plexrl.result(fut, timeout=60)
            # another job's request is not behind this job's quota
            assert plexrl.result(theirs.forward(data), timeout=60) == plexrl.result(
                theirs.forward(data), timeout=60
            )
    finally:
        gate.set()
    assert blocker.result(timeout=60) == dep.name
    served = plexrl.result(waiting, timeout=120)
    assert all(out == served[0] for out in served)
    assert plexrl.result(dep.forward(data), timeout=60) == served[0]


def test_an_adapter_bank_samples_several_jobs_adapters_in_one_request(client):
    """A bank (``backend="adapters"``) of a third job loads two jobs' LoRA policies from their
    saved states (each shared for reading) and samples both in one request, each prompt the
    bits its own policy samples; a job that did not share is refused, and so is a training
    request on the bank."""
    from plexrl_dask.models.spec import LORA_TARGETS

    base = tiny_spec(seed=41)
    server = plexrl.Runtime(client, job=unique("bank-owner"))
    tenants = [plexrl.Runtime(client, job=unique(f"bank-t{i}")) for i in range(2)]
    policies, saved = [], []
    for i, rt in enumerate(tenants):
        spec = base.with_lora(4, alpha=16, targets=(*LORA_TARGETS, "lm_head"), seed=i)
        p = rt.deploy(unique("bank-policy"), spec)
        batch = [plexrl.Datum(tokens=p.tokenize(f"{i}+1={i + 1}"))] * 2
        plexrl.result([p.forward_backward(batch), p.optim_step(plexrl.AdamWParams(lr=0.5))])
        saved.append(plexrl.result(p.save_state(weights_only=True)))
        policies.append(p)
    bank = server.deploy(unique("bank"), base, role="rollout", backend="adapters")
    with pytest.raises(errors.PermissionDenied):  # not shared yet
        plexrl.result(bank.load_adapter("t0", policies[0].info.spec, saved[0]))
    for p in policies:
        p.share(server.job, ops=("get_weights",))
    plexrl.result(
        [bank.load_adapter(f"t{i}", p.info.spec, saved[i]) for i, p in enumerate(policies)]
    )
    params = plexrl.SamplingParams(n=2, max_tokens=8, temperature=1.0, seed=4)
    prompts = ["1+2=", "3+4=", "5+6=", "7+8="]
    keys = ["t0", "t1", None, "t1"]
    got = plexrl.result(bank.sample(prompts, params, [1, 2, 3, 4], invariant=True, adapters=keys))
    plain = server.deploy(unique("bank-base"), base, role="rollout")
    for i, key in enumerate(keys):
        own = plain if key is None else policies[int(key[1])]
        alone = plexrl.result(own.sample([prompts[i]], params, [i + 1], invariant=True))
        assert got.sequences[i] == alone.sequences[0], (i, key)
    with pytest.raises(errors.AdapterNotFound):
        plexrl.result(bank.sample(prompts[:1], params, adapters=["t9"]))
    with pytest.raises(errors.OpNotSupported):
        plexrl.result(bank.forward_backward([plexrl.Datum(tokens=bank.tokenize("1+1=2"))]))
    with pytest.raises(errors.OpNotSupported):  # adapters on a replica that is no bank
        plexrl.result(plain.sample(prompts[:1], params, adapters=[None]))
    assert plexrl.result(bank.drop_adapter("t0")) is True
    for rt in (server, *tenants):
        for info in rt.deployments():
            if info.owner == rt.job:
                rt.undeploy(info.name)
