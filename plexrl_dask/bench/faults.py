"""The fault suite: what one tenant may do to another, bad input, a flood, lost processes and
damaged bytes, each case run against a live cluster and reported as a row.

    python -m plexrl_dask.bench.faults --json OUT [--quick]

Definitions (fixed before any number was looked at):

- ``unauthorized_ops_tried`` / ``unauthorized_ops_allowed``: distinct things job B (or a
  client without the right secret) tries on job A's deployment, holders, name and the cluster's
  policy; *allowed* counts those that did not raise :class:`PermissionDenied` (a success, or
  another error: both are listed in the rows). Targets: >= 20 tried, 0 allowed.
- ``bad_inputs_tried`` / ``bad_inputs_untyped``: malformed requests (built past the driver's
  checks where it has them, so the worker's own checks answer); *untyped* counts those whose
  error is not a :class:`PlexRLError` or that succeeded. Target: 0 untyped. Afterwards the
  deployment must still train and a bystander answer as before (``bad_inputs_harmless``).
- ``flood_victim_wait_over_bound``: job A submits a burst of 500 forward requests on its
  deployment, then job B five on its own, on the same worker, all queued behind one request
  of A's that holds the worker until every one of them is in the queue. Each of B's requests' wait
  (from its arrival in the dispatcher to its release: the scheduler's decision record) over
  the share-order bound of ``policy/DISPATCH.md`` for two jobs, ``P_max + 4 k B`` (with
  lookahead, as configured by default, ``P_max + (8 k + 1) B``) (``P_max``
  the largest patience among the requests released in the window, ``B`` the longest request
  on the worker then, from the holder's timeline), the largest of the five. Target <= 1. The
  same burst under arrival-order urgency (``fair_share`` off, the baseline, same run) gives
  ``flood_victim_wait_s_arrival_order`` beside ``flood_victim_wait_s``.
- ``corrupt_chunk_detected``: a byte of a checkpoint's chunk object flipped on the node's
  tier; loading it raises :class:`CorruptState` and the deployment keeps its weights.
- ``worker_kill_restored_exact``: the worker holding a trained deployment killed (SIGKILL);
  its next request is :class:`DeploymentLost`, and restoring its checkpoint brings back
  exactly the saved weights.
- ``scheduler_restart_recovered``: a scheduler with a journal killed (SIGKILL) and started
  again with new workers: the job's deployments are back (trained: lost, then restored from
  its checkpoint exactly; untrained: rebuilt), its secret and its grants hold.
- ``soak_requests_lost``: four jobs, each from its own thread, ``--soak`` mixed requests
  (forward, sample, a training step, get_weights) on their deployments of one pool; *lost*
  counts requests that did not return their result. Target 0. ``soak_rss_growth_ratio``: the
  workers' summed resident memory after the soak over after its first tenth. Target <= 1.2.
"""

from __future__ import annotations

import copy
import logging
import os
import signal
import statistics
import tempfile
import threading
import time
from collections.abc import Callable
from typing import Any

import dask
import torch
from distributed import Client, Event

import plexrl_dask as plexrl
from plexrl_dask import errors
from plexrl_dask.bench.common import parser, report, write_json
from plexrl_dask.worker import ops

logger = logging.getLogger("plexrl_dask.bench.faults")

SPEC = {"hidden_size": 32, "num_layers": 1, "num_heads": 2, "num_kv_heads": 1}
# Requests of about 9 ms each: a burst of 500 lasts about 4 s, longer than a request's
# patience (about 2 s), as the burst it stands for did.
FLOOD_SPEC = plexrl.ModelSpec.tiny(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2)
FLOOD_ROWS = 24
FLOOD_TEXT = "12+34=46, 56+78=134, 90+12=102"

Row = dict[str, Any]


def _spec(seed: int) -> plexrl.ModelSpec:
    return plexrl.ModelSpec.tiny(**SPEC, seed=seed)


def _bypassed(value: Any, **fields: Any) -> Any:
    """``value`` with ``fields`` set past its constructor's checks (another client's code)."""
    out = copy.copy(value)
    for name, v in fields.items():
        object.__setattr__(out, name, v)
    return out


def _outcome(call: Callable[[], Any]) -> tuple[str, str]:
    """(the error's class name, or "ok"; its message, shortened)."""
    try:
        call()
    except Exception as e:  # (recorded, not raised: every case is a row)
        return type(e).__name__, str(e)[:160]
    return "ok", ""


def _resolve(call: Callable[[], Any]) -> Callable[[], Any]:
    """``call``, waiting for its result when it is a Dask future or an actor's."""
    from distributed import Future
    from distributed.actor import BaseActorFuture

    def run() -> Any:
        out = call()
        if isinstance(out, Future):
            return plexrl.result(out)
        if isinstance(out, BaseActorFuture):
            return out.result(timeout=60)
        return out

    return run


# --- one tenant against another -------------------------------------------------------------


def unauthorized(client: Client) -> list[Row]:
    """Job B (and clients without the right secret) against job A: each must be refused."""
    from plexrl_dask.driver.runtime import as_another_driver

    a = plexrl.Runtime(client, job="faults-owner")
    b = plexrl.Runtime(client, job="faults-other")
    mine = a.deploy("faults-a-policy", _spec(1))
    b_rollout = b.deploy("faults-b-rollout", _spec(1), role="rollout")
    batch = [plexrl.Datum(tokens=mine.tokenize("1+1=2"))]
    before = plexrl.result(mine.get_weights())
    saved = plexrl.result(mine.save_state())
    theirs = b.deployment(mine.name)
    holder = b.holder(mine.info.worker)
    zeros = {n: t * 0 for n, t in before.tensors.items()}

    def impostor(secret: str | None) -> plexrl.Runtime:
        return plexrl.Runtime(client, job=a.job, secret=secret)

    def raw(annotation: dict[str, Any]) -> Any:
        with dask.annotate(plexrl={"deployment": mine.name, **annotation}):
            return client.submit(ops.forward, mine.name, batch, pure=False)

    def without_cache(call: Callable[[], Any]) -> Callable[[], Any]:
        def run() -> Any:
            with as_another_driver():
                return _resolve(call)()

        return run

    cases: dict[str, Callable[[], Any]] = {
        "forward": lambda: theirs.forward(batch),
        "sample": lambda: theirs.sample(["1+1="]),
        "get_weights": lambda: theirs.get_weights(),
        "forward_backward": lambda: theirs.forward_backward(batch),
        "optim_step": lambda: theirs.optim_step(),
        "set_weights": lambda: theirs.set_weights(zeros, version=999),
        "save_state": lambda: theirs.save_state(),
        "load_state": lambda: theirs.load_state(saved),
        "sync_weights_from": lambda: b.sync_weights(theirs, b_rollout),
        "undeploy": lambda: b.undeploy(mine.name),
        "deploy_exist_ok_takeover": lambda: b.deploy(mine.name, _spec(1), exist_ok=True),
        "deploy_as_other_owner": lambda: b.deploy("faults-for-a", _spec(2), owner=a.job),
        "share_to_self": lambda: theirs.share(b.job),
        "offload": lambda: theirs.offload(),
        "relocate_handler": lambda: b._call(
            "plexrl_relocate", name=mine.name, uid=mine.info.uid, job=b.job
        ),
        "holder_drop": lambda: holder.drop(mine.name),
        "holder_offload": lambda: holder.offload(mine.name),
        "holder_hint": lambda: holder.hint(mine.name),
        "holder_prefetch": lambda: holder.prefetch(),
        "set_policy_without_operator": lambda: b.set_policy(
            operator_secret="x" * 32, patience_factor=0.0
        ),
        "impostor_undeploy": without_cache(lambda: impostor(None).undeploy(mine.name)),
        "impostor_wrong_secret_forward": without_cache(
            lambda: impostor("0" * 32).deployment(mine.name).forward(batch)
        ),
        "raw_request_without_job": lambda: raw({}),
        "raw_request_job_without_secret": lambda: raw({"job": a.job}),
        "raw_request_with_other_secret": lambda: raw({"job": a.job, "secret": b.secret}),
        "rendezvous_forged_address": lambda: b._call(
            "plexrl_rendezvous_put", key="forged", address="127.0.0.1:1", token="guess"
        ),
    }
    rows = []
    for name, call in cases.items():
        error, message = _outcome(_resolve(call))
        rows.append(
            {"case": f"unauthorized:{name}", "ok": error == "PermissionDenied", "outcome": error,
             "detail": message}
        )  # fmt: skip
    after = plexrl.result(mine.get_weights())
    intact = after.version == before.version and all(
        torch.equal(after.tensors[n], t) for n, t in before.tensors.items()
    )
    rows.append({"case": "unauthorized:owner_state_intact", "ok": intact, "outcome": str(intact)})
    return rows


def bad_inputs(client: Client) -> list[Row]:
    """Malformed requests on a job's own deployment: each must be a typed error, harmlessly."""
    rt = plexrl.Runtime(client, job="faults-bad-input")
    dep = rt.deploy("faults-bad", _spec(3))
    bystander = rt.deploy("faults-bystander", _spec(4))
    good = [plexrl.Datum(tokens=dep.tokenize("1+1=2"))] * 2
    before = plexrl.result(dep.get_weights())
    seen = plexrl.result(bystander.forward(good))
    nan_weights = {n: t * float("nan") for n, t in before.tensors.items()}
    raw = {
        "sample_top_p_2": ("sample", ops.sample, (["1+1="], _bypassed(plexrl.SamplingParams(), top_p=2.0))),
        "sample_n_0": ("sample", ops.sample, (["1+1="], _bypassed(plexrl.SamplingParams(), n=0))),
        "sample_negative_temperature": (
            "sample", ops.sample, (["1+1="], _bypassed(plexrl.SamplingParams(), temperature=-1)),
        ),
        "sample_n_million": ("sample", ops.sample, (["1+1="], plexrl.SamplingParams(n=10**6))),
        "sample_prompt_not_a_list": ("sample", ops.sample, ("1+1=", plexrl.SamplingParams())),
        "sample_params_a_dict": ("sample", ops.sample, (["1+1="], {"n": 2})),
        "forward_temperature_nan": ("forward", ops.forward, (good, float("nan"))),
        "forward_strings": ("forward", ops.forward, (["1+1=2"], 1.0)),
        "optim_negative_lr": (
            "optim_step", ops.optim_step, (_bypassed(plexrl.AdamWParams(), lr=-1.0),),
        ),
        "optim_params_a_dict": ("optim_step", ops.optim_step, ({"lr": 1e-3},)),
        "loss_bad_clip": (
            "forward_backward", ops.forward_backward,
            (good, _bypassed(plexrl.PolicyGradient(), clip_low=5.0)),
        ),
        "loss_a_string": ("forward_backward", ops.forward_backward, (good, "cross-entropy")),
        "datum_one_token": (
            "forward_backward", ops.forward_backward,
            ([_bypassed(good[0], tokens=(1,))], plexrl.CrossEntropy()),
        ),
        "set_weights_nan": ("set_weights", ops.set_weights, (nan_weights, 7, True)),
        "set_weights_a_list": ("set_weights", ops.set_weights, ([1, 2], None, True)),
    }  # fmt: skip
    cases: dict[str, Callable[[], Any]] = {
        name: (lambda op=op, fn=fn, args=args: dep._submit(op, fn, [args]))
        for name, (op, fn, args) in raw.items()
    }
    cases.update(
        {
            "token_out_of_vocabulary": lambda: dep.forward([plexrl.Datum(tokens=[1, 10**6])]),
            "prompt_too_long": lambda: dep.sample([[5] * 4096], plexrl.SamplingParams()),
            "empty_batch": lambda: dep.forward([]),
            "load_state_not_a_checkpoint": lambda: dep.load_state(42),
            "load_state_missing_dcp": lambda: dep.load_state("/nonexistent/plexrl-ckpt"),
            "deploy_world_size_0": lambda: rt.deploy("faults-no", _spec(5), world_size=0),
            "deploy_name_with_slash": lambda: rt.deploy("faults/slash", _spec(5)),
            "deploy_not_a_spec": lambda: rt.deploy("faults-no", {"name": "x"}),  # type: ignore[arg-type]
            "deployment_unknown": lambda: rt.deployment("faults-no-such"),
        }
    )
    rows = []
    for name, call in cases.items():
        error, message = _outcome(_resolve(call))
        typed = error != "ok" and isinstance(getattr(errors, error, None), type)
        rows.append({"case": f"bad_input:{name}", "ok": typed, "outcome": error, "detail": message})
    out = plexrl.result([dep.forward_backward(good), dep.optim_step()])
    harmless = (
        out[1]["version"] == before.version + 1 and plexrl.result(bystander.forward(good)) == seen
    )
    rows.append({"case": "bad_input:harmless", "ok": harmless, "outcome": str(harmless)})
    return rows


# --- a flood ----------------------------------------------------------------------------------


def _hold(gate: str, timeout: float) -> bool:
    """A routed request that keeps its worker until the distributed Event ``gate`` is set."""
    if not Event(gate).wait(timeout=timeout):
        raise TimeoutError(f"gate {gate} stayed closed for {timeout}s")
    return True


def flood(client: Client, n_burst: int, fair_share: bool) -> dict[str, Any]:
    """Job A's burst of ``n_burst`` forwards, then job B's five, on one worker (see the
    module docstring); B's waits and their ratio to the share-order bound."""
    tag = "fair" if fair_share else "arrival"
    admin = plexrl.Runtime(client, job="faults-admin")
    admin.set_policy(fair_share=fair_share)
    a = plexrl.Runtime(client, job=f"faults-flood-{tag}")
    b = plexrl.Runtime(client, job=f"faults-victim-{tag}")
    worker = sorted(admin.status()["workers"])[0]
    dep_a = a.deploy(f"faults-flood-a-{tag}", FLOOD_SPEC, workers=[worker])
    dep_b = b.deploy(f"faults-flood-b-{tag}", FLOOD_SPEC, workers=[worker])
    batch = [plexrl.Datum(tokens=dep_a.tokenize(FLOOD_TEXT))] * FLOOD_ROWS
    plexrl.result([dep_a.forward(batch), dep_b.forward(batch)])  # both built and resident
    since = time.time()
    # The worker held by one of A's requests while the burst and B's five queue up behind it,
    # so that every run starts from the same queue (the client's submission pace aside).
    gate = Event(f"faults-gate-{tag}-{time.monotonic_ns()}", client=client)
    with dask.annotate(plexrl=dep_a.annotation(op="hold")):
        blocker = client.submit(_hold, gate.name, 600.0, pure=False)
    burst = [dep_a.forward(batch) for _ in range(n_burst)]
    victims = [dep_b.forward(batch) for _ in range(5)]
    deadline = time.monotonic() + 300

    def queued() -> int:  # (with lookahead, one of them is released behind the blocker)
        queue = admin.status()["queue"]
        return queue["pending"] + len(queue["queued"])

    while queued() < n_burst + 5:
        if time.monotonic() > deadline:
            raise errors.RequestTimeout("the burst did not queue up behind the blocker")
        time.sleep(0.1)
    gate.set()
    released = time.perf_counter()
    plexrl.result([blocker, *burst, *victims], timeout=600)
    burst_s = time.perf_counter() - released
    policy = admin.status()["policy"]

    def decisions(dask_scheduler: Any) -> list[dict[str, Any]]:
        return list(dask_scheduler.plugins["plexrl"].decisions)  # (status shows the last 50)

    made = client.run_on_scheduler(decisions)
    keys = {f.key for f in victims}
    mine = [d for d in made if d["request"] in keys]
    window = [d for d in made if d["request"] in keys | {f.key for f in burst}]
    spans = [s for s in admin.timeline(since) if s.worker == worker]
    longest = max(s.seconds for s in spans)

    def patience(d: dict[str, Any]) -> float:
        return (
            policy["patience_factor"] * (d["service_s"] + d["setup_s"]) + policy["patience_floor_s"]
        )

    p_max = max(patience(d) for d in window)
    waits = [d["wait_s"] for d in sorted(mine, key=lambda d: d["tag"])]
    # n <= 4k requests ahead (two jobs of weight 1); with lookahead, (2n + 1) B
    blocking = [(8 * k + 1 if policy["lookahead"] else 4 * k) for k in range(1, len(waits) + 1)]
    ratios = [w / (p_max + n * longest) for n, w in zip(blocking, waits, strict=True)]
    for dep, rt in ((dep_a, a), (dep_b, b)):
        rt.undeploy(dep.name)
    return {
        "waits": waits,
        "over_bound": max(ratios) if len(waits) == 5 else float("inf"),
        "decisions_seen": len(mine),
        "p_max_s": p_max,
        "longest_s": longest,
        "burst_s": burst_s,  # from the worker's release to the last of the 505 done
    }


# --- lost processes and damaged bytes ---------------------------------------------------------


def _trained(client: Client, name: str, seed: int) -> tuple[Any, dict[str, Any], Any]:
    """Job ``name``'s deployment ``name`` after one training step, its checkpoint (on the
    node's NVMe tier) and its weights then."""
    dep = plexrl.Runtime(client, job=name).deploy(name, _spec(seed))
    batch = [plexrl.Datum(tokens=dep.tokenize("2+2=4"))]
    plexrl.result([dep.forward_backward(batch), dep.optim_step()])
    saved = plexrl.result(dep.save_state())
    return dep, saved, plexrl.result(dep.get_weights())


def corrupt_chunk(client: Client) -> Row:
    """A flipped byte in a stored checkpoint's chunk object: CorruptState, weights kept."""
    dep, saved, before = _trained(client, "faults-corrupt", 8)
    damaged = _damage_an_object(saved["path"])
    error, message = _outcome(_resolve(lambda: dep.load_state(saved)))
    after = plexrl.result(dep.get_weights())
    kept = all(torch.equal(after.tensors[n], t) for n, t in before.tensors.items())
    ok = bool(damaged) and error == "CorruptState" and kept
    return {"case": "corrupt_chunk", "ok": ok, "outcome": error, "detail": message}


def _damage_an_object(store_path: str) -> str | None:
    """Flip a byte in the largest chunk object under ``store_path``; its path."""
    objects = [
        os.path.join(root, n)
        for root, _, names in os.walk(store_path)
        for n in names
        if os.sep + "objects" + os.sep in os.path.join(root, n)
    ]
    if not objects:
        return None
    victim = max(objects, key=os.path.getsize)
    os.chmod(victim, 0o600)
    with open(victim, "r+b") as f:
        f.seek(os.path.getsize(victim) // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0xFF]))
    return victim


def worker_kill(client: Client) -> Row:
    """The worker of a trained deployment SIGKILLed: DeploymentLost, then its checkpoint
    restores exactly the saved weights."""
    dep, saved, want = _trained(client, "faults-kill", 9)
    batch = [plexrl.Datum(tokens=dep.tokenize("3+3=6"))]
    worker = dep.info.worker
    pid = client.run(os.getpid, workers=[worker])[worker]
    os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 60
    while worker in plexrl.worker_info(client) and time.monotonic() < deadline:
        time.sleep(0.2)
    client.wait_for_workers(2, timeout=120)  # the nanny starts it again
    lost, _ = _outcome(_resolve(lambda: dep.forward(batch)))
    plexrl.result(dep.load_state(saved))
    got = plexrl.result(dep.get_weights())
    exact = all(torch.equal(got.tensors[n], t) for n, t in want.tensors.items())
    return {
        "case": "worker_kill",
        "ok": lost == "DeploymentLost" and exact,
        "outcome": lost,
        "detail": f"restored exactly: {exact}",
    }


def scheduler_restart(directory: str) -> Row:
    """A journaled scheduler SIGKILLed and started again (see the module docstring)."""
    from plexrl_dask.cluster import JournaledCluster

    with (
        JournaledCluster(directory) as cluster,
        Client(cluster.address, timeout=60, set_as_default=False) as client,
    ):
        cluster.wait(client)
        a = plexrl.Runtime(client, job="faults-restart-a")
        b = plexrl.Runtime(client, job="faults-restart-b")
        trained = a.deploy("faults-trained", _spec(10))
        frozen = a.deploy("faults-frozen", _spec(11), role="rollout")
        batch = [plexrl.Datum(tokens=trained.tokenize("4+4=8"))]
        plexrl.result([trained.forward_backward(batch), trained.optim_step()])
        saved = plexrl.result(trained.save_state())
        want = plexrl.result(trained.get_weights())
        frozen_out = plexrl.result(frozen.forward(batch))
        trained.share(b.job, ops=("forward",))
        t0 = time.perf_counter()
        cluster.restart()
        cluster.wait(client)
        states = {d.name: d.state.value for d in a.deployments()}
        lost, _ = _outcome(_resolve(lambda: trained.forward(batch)))
        plexrl.result(trained.load_state(saved))
        got = plexrl.result(trained.get_weights())
        exact = all(torch.equal(got.tensors[n], t) for n, t in want.tensors.items())
        rebuilt = plexrl.result(frozen.forward(batch)) == frozen_out
        shared = plexrl.result(b.deployment(trained.name).forward(batch)) == plexrl.result(
            trained.forward(batch)
        )
        seconds = time.perf_counter() - t0
    ok = (
        states == {trained.name: "lost", frozen.name: "unplaced"}
        and lost == "DeploymentLost"
        and exact
        and rebuilt
        and shared
    )
    return {
        "case": "scheduler_restart",
        "ok": ok,
        "outcome": str(states),
        "detail": f"exact {exact}, rebuilt {rebuilt}, grant {shared}, {seconds:.1f}s to serve",
    }


# --- a soak -------------------------------------------------------------------------------------


def soak(client: Client, n_requests: int) -> dict[str, Any]:
    """Four jobs x ``n_requests`` mixed requests, each job from its own thread."""
    lost: list[str] = []
    done = [0]
    lock = threading.Lock()
    rss: list[float] = []

    def worker_rss() -> float:
        import psutil

        return float(psutil.Process().memory_info().rss)

    def job(i: int) -> None:
        rt = plexrl.Runtime(client, job=f"faults-soak-{i}")
        dep = rt.deploy(f"faults-soak-{i}", _spec(20 + i))
        batch = [plexrl.Datum(tokens=dep.tokenize(f"{i}+{i}={2 * i}"))] * 2
        kinds = [
            lambda: dep.forward(batch),
            lambda: dep.sample(["1+2="], plexrl.SamplingParams(max_tokens=4, seed=i)),
            lambda: [dep.forward_backward(batch), dep.optim_step()],
            lambda: dep.get_weights(),
        ]
        for k in range(n_requests):
            try:
                out = kinds[k % len(kinds)]()
                plexrl.result(out, timeout=300)
            except Exception as e:  # (counted: a lost request is the measurement)
                with lock:
                    lost.append(f"{rt.job}#{k}: {type(e).__name__}: {e}"[:200])
            with lock:
                done[0] += 1
                if done[0] == max(1, 4 * n_requests // 10):
                    rss.append(sum(client.run(worker_rss).values()))

    threads = [threading.Thread(target=job, args=(i,), daemon=True) for i in range(4)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=1800)
    rss.append(sum(client.run(worker_rss).values()))
    return {
        "lost": lost,
        "requests": 4 * n_requests,
        "rss_growth_ratio": rss[-1] / rss[0] if len(rss) == 2 else float("nan"),
        "seconds": time.perf_counter() - t0,
    }


def main() -> None:
    args = parser(__doc__.splitlines()[0]).parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    burst = 500
    n_soak = 50 if args.quick else 200
    rows: list[Row] = []
    results: dict[str, Any] = {}
    config = {
        "burst": burst,
        "soak_requests_per_job": n_soak,
        "spec": SPEC,
        "flood_spec": FLOOD_SPEC.to_dict(),
        "flood_rows": FLOOD_ROWS,
    }
    t0 = time.perf_counter()
    with dask.config.set({"plexrl.scheduler.decisions-kept": 4 * burst}):
        cluster = plexrl.local_cluster(n_workers=2)
    with cluster, Client(cluster, set_as_default=False) as client:
        for name, case in (("unauthorized", unauthorized), ("bad inputs", bad_inputs)):
            rows += case(client)
            logger.info("%s done (%.0fs)", name, time.perf_counter() - t0)
        fair = flood(client, burst, fair_share=True)
        arrival = flood(client, burst, fair_share=False)
        plexrl.Runtime(client, job="faults-admin").set_policy(fair_share=True)
        rows.append(
            {"case": "flood", "ok": fair["over_bound"] <= 1.0, "outcome": fair["over_bound"],
             "detail": f"waits {fair['waits']}; arrival order {arrival['waits']}"}
        )  # fmt: skip
        logger.info("flood done (%.0fs)", time.perf_counter() - t0)
        rows.append(corrupt_chunk(client))
        rows.append(worker_kill(client))
        logger.info("corrupt chunk, worker kill done (%.0fs)", time.perf_counter() - t0)
        soaked = soak(client, n_soak)
        logger.info("soak done (%.0fs)", time.perf_counter() - t0)
        write_json(
            "faults", {"rows": rows}, {}, config, args.json
        )  # (partial, if what follows fails)
    with tempfile.TemporaryDirectory(prefix="plexrl-faults-") as directory:
        rows.append(scheduler_restart(directory))
    logger.info("scheduler restart done (%.0fs)", time.perf_counter() - t0)

    unauthorized_rows = [r for r in rows if r["case"].startswith("unauthorized:")]
    bad_rows = [r for r in rows if r["case"].startswith("bad_input:")]
    results.update(
        {
            "unauthorized_ops_tried": len(unauthorized_rows) - 1,
            "unauthorized_ops_allowed": sum(
                not r["ok"]
                for r in unauthorized_rows
                if r["case"] != "unauthorized:owner_state_intact"
            ),
            "unauthorized_owner_state_intact": unauthorized_rows[-1]["ok"],
            "bad_inputs_tried": len(bad_rows) - 1,
            "bad_inputs_untyped": sum(
                not r["ok"] for r in bad_rows if r["case"] != "bad_input:harmless"
            ),
            "bad_inputs_harmless": bad_rows[-1]["ok"],
            "flood_victim_wait_over_bound": fair["over_bound"],
            "flood_victim_wait_s": max(fair["waits"], default=float("nan")),
            "flood_victim_wait_s_arrival_order": max(arrival["waits"], default=float("nan")),
            "flood_victim_wait_ratio_fair_vs_arrival": (
                statistics.fmean(fair["waits"]) / statistics.fmean(arrival["waits"])
                if fair["waits"] and arrival["waits"]
                else float("nan")
            ),
            "scheduler_restart_recovered": next(
                r for r in rows if r["case"] == "scheduler_restart"
            )["ok"],
            "worker_kill_restored_exact": next(r for r in rows if r["case"] == "worker_kill")["ok"],
            "corrupt_chunk_detected": next(r for r in rows if r["case"] == "corrupt_chunk")["ok"],
            "soak_requests": soaked["requests"],
            "soak_requests_lost": len(soaked["lost"]),
            "soak_rss_growth_ratio": soaked["rss_growth_ratio"],
            "seconds": time.perf_counter() - t0,
            "rows": rows,
            "flood": {"share_order": fair, "arrival_order": arrival},
            "soak_lost": soaked["lost"][:20],
        }
    )
    targets = {
        "unauthorized_ops_tried": ">= 20",
        "unauthorized_ops_allowed": "0",
        "bad_inputs_untyped": "0",
        "flood_victim_wait_over_bound": "<= 1",
        "scheduler_restart_recovered": "true",
        "worker_kill_restored_exact": "true",
        "corrupt_chunk_detected": "true",
        "soak_requests_lost": "0",
        "soak_rss_growth_ratio": "<= 1.2",
    }
    report(
        "faults",
        {k: v for k, v in results.items() if not isinstance(v, list | dict)},
        targets,
        config,
        None,
    )
    write_json("faults", results, targets, config, args.json)


if __name__ == "__main__":
    main()
