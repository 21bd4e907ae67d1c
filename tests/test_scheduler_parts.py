"""Parts of the scheduler plugin on their own: a deployment's lifecycle (the moves the scheduler
makes are the only ones a record takes), the request queue (its order and its marks), and the
gangs' group epochs, the journal, the principals."""

from __future__ import annotations

import asyncio
import sqlite3
from collections import Counter

import dask
import pytest

from plexrl_dask import errors
from plexrl_dask.models import ModelSpec
from plexrl_dask.plugins.gangs import GroupEpochs, Rendezvous
from plexrl_dask.plugins.requests import PendingRequest, RequestQueue
from plexrl_dask.shared.records import MOVES, DeploymentInfo, Lifecycle


def info(**changes) -> DeploymentInfo:
    base = dict(
        name="policy", uid="u1", spec=ModelSpec.tiny(), role="train", backend="torch",
        owner="job", memory_bytes=1, workers=("tcp://a:1",),
    )  # fmt: skip
    return DeploymentInfo(**{**base, **changes})


@pytest.mark.parametrize("start", list(Lifecycle))
@pytest.mark.parametrize("to", list(Lifecycle))
def test_a_record_makes_exactly_the_lifecycles_moves(start, to):
    record = info(state=start)
    if to in MOVES[start]:
        moved = record.moved(to, uid="u2")
        assert moved.state is to and moved.uid == "u2" and record.state is start
        # (a new uid per placement; the deploy it came from stays)
        assert moved.incarnation == record.incarnation == record.uid != "u2"
        assert DeploymentInfo.from_dict(moved.to_dict()) == moved
    else:
        with pytest.raises(errors.LifecycleError, match=f"is {start.value}"):
            record.moved(to)


def test_what_brings_a_lost_deployment_back_is_what_restores_all_of_its_state():
    """A checkpoint, for any; a published version of weights, for a torch rollout replica
    too (its weights are all its state; a sync brings it back); never for a training
    deployment (its optimizer) nor an adapter bank (its adapters)."""
    assert info().revived_by("load_state")
    assert not info().revived_by("load_weights")
    rollout = info(role="rollout")
    assert rollout.revived_by("load_weights") and not rollout.revived_by("set_weights")
    assert not info(role="rollout", backend="adapters").revived_by("load_weights")


def test_states_cross_the_wire_as_strings_and_change_only_through_moved():
    record = info(state="lost")
    assert record.state is Lifecycle.LOST and record.state == "lost"
    wire = record.to_dict()
    assert wire["state"] == "lost" and type(wire["state"]) is str
    assert DeploymentInfo.from_dict(wire) == record
    with pytest.raises(TypeError, match="moved"):
        record.with_(state="placed")
    with pytest.raises(errors.ConfigError, match="state must be one of"):
        info(state="gone")
    # Never revived straight into placement: a restore makes it unplaced, its request places it.
    with pytest.raises(errors.LifecycleError):
        record.moved(Lifecycle.PLACED)


def test_the_request_queue_keeps_submission_order_per_deployment_and_its_marks():
    q = RequestQueue()
    a = q.add(PendingRequest("a", 2, "policy", "forward_backward"))
    q.add_key("a-0", a, 0)
    assert q.add(PendingRequest("a", 2, "policy", "forward_backward")) is a  # rank 1 joins
    q.add_key("a-1", a, 1)
    b = q.add(PendingRequest("b", 1, "policy", "optim_step"))
    c = q.add(PendingRequest("c", 1, "rollout", "sample", replica=None))
    assert [r.request for r in q] == ["a", "b", "c"] and len(q) == 3 and "b" in q
    assert q.deployment("policy") == [a, b] and q.counts() == {"policy": 2, "rollout": 1}
    assert q.take_changed() == {"policy", "rollout"} and not q.has_changed()
    assert q.of_key("a-1") is a and q.request_of("a-0") == "a" and q.tracks("a-0")
    assert q.release("a") is a and q.deployment("policy") == [b]
    assert q.take_changed() == {"policy"}  # b may be admitted now
    assert q.tracks("a-0") and q.of_key("a-0") is None  # released: its tasks still run
    q.drop_key("a-0")
    assert not q.tracks("a-0")
    q.release("c")
    assert not q.has_changed()  # nothing behind it
    q.forget(b)
    assert len(q) == 0 and q.counts() == {} and q.take_changed() == {"policy"}
    assert c.order == "rollout#any" and b.order == "policy#0"


def test_a_gang_keeps_its_group_until_a_worker_or_a_rank_breaks_it():
    g = GroupEpochs()
    pair = ("tcp://a:1", "tcp://b:1")
    assert g.epoch_for("u1", pair) == 1  # first: a new group
    assert g.epoch_for("u1", pair) == 1  # the same workers still hold it
    assert g.epoch_for("u2", pair) == 1  # another deployment's gang takes the workers ...
    assert g.epoch_for("u1", pair) == 2  # ... so u1's next gang forms its group again
    g.worker_left("tcp://a:1")
    assert g.epoch_for("u1", pair) == 3
    g.broken("u1")  # a rank failed
    assert g.epoch_for("u1", pair) == 4
    g.forget("u1")  # undeployed: a later incarnation of the name has another uid anyway
    assert g.epoch_for("u1", pair) == 1
    # Each replica of a tensor-parallel rollout is a group of its own, on its own workers.
    other = ("tcp://c:1", "tcp://d:1")
    assert g.epoch_for("u3", pair, 0) == 1 and g.epoch_for("u3", other, 1) == 1
    assert g.epoch_for("u3", pair, 0) == 1 and g.epoch_for("u3", other, 1) == 1
    g.forget("u3")
    assert g.epoch_for("u3", other, 1) == 1 and g.epoch_for("u3", other, 0) == 1


def test_a_rendezvous_takes_only_rank_0s_token_and_bounds_every_wait():
    """Rank 0 publishes with its token (any other is refused and counted); a waiting rank is
    woken by the publish; a wait asked longer than ``plexrl.group.timeout`` or not a number
    ends within that timeout, typed, and leaves the rendezvous working; a group the
    scheduler never released is refused at once."""

    async def scenario():
        counters = Counter()
        rv = Rendezvous(counters)
        token = rv.token("g1")
        assert rv.token("g1") == token
        refused = rv.put("g1", "10.0.0.1:1", "not-it")
        assert refused["status"] == "error" and counters["rendezvous_refused"] == 1
        waiting = asyncio.ensure_future(rv.get("g1", 30))
        await asyncio.sleep(0)
        assert rv.put("g1", "10.0.0.1:1", token) == {"status": "OK"}
        assert (await waiting)["address"] == "10.0.0.1:1"
        rv.token("slow")  # (released; its rank 0 never publishes)
        with dask.config.set({"plexrl.group.timeout": "0.2s"}):
            loop = asyncio.get_running_loop()
            t0 = loop.time()
            late = await rv.get("slow", 1e9)
            assert late["error"] == "GroupTimeout" and loop.time() - t0 < 5
            for bad in (None, "soon", True, float("nan")):
                assert (await rv.get("slow", bad))["status"] == "error"
        # a group never released: refused at once (no wait is kept for it)
        assert (await rv.get("never", 30))["error"] == "PermissionDenied"
        assert "never" not in rv._events
        assert (await rv.get("g1", 1))["address"] == "10.0.0.1:1"

    asyncio.run(scenario())


def test_the_replica_choice_setting_and_its_old_name():
    import dask

    from plexrl_dask.plugins.dispatching import dispatch_policy_from_config

    assert dispatch_policy_from_config().choice == "residency"
    assert dispatch_policy_from_config("fifo", "blind").choice == "blind"
    bad = {"plexrl.scheduler.replica-choice": "nearest"}
    with dask.config.set(bad), pytest.raises(errors.ConfigError, match="choice must be"):
        dispatch_policy_from_config()
    # The old name is refused by name, not silently ignored.
    old = {"plexrl.scheduler.placement": "blind"}
    with dask.config.set(old), pytest.raises(errors.ConfigError, match="replica-choice"):
        dispatch_policy_from_config()


def test_the_scheduler_side_imports_no_model_stack():
    """What a scheduler loads (the preload, the plugin and its parts, the policy core, the wire
    names, and what it unpickles: the request functions, the worker plugin and what the holder
    actor is made by) imports neither torch, transformers nor Zarr: in a fresh interpreter. The
    worker's engine loads only when one of its modules is first used."""
    import subprocess
    import sys

    code = (
        "import sys, pickle\n"
        "import plexrl_dask.plugins, plexrl_dask.plugins.scheduler, plexrl_dask.protocol\n"
        "import plexrl_dask.policy.dispatch, plexrl_dask.policy.spatiotemporal\n"
        "from plexrl_dask.worker import ops, holder\n"
        "from plexrl_dask.plugins.worker import PlexRLWorkerPlugin, new_replica_holder\n"
        "pickle.loads(pickle.dumps([ops.sample, ops.save_state, ops.combine, new_replica_holder]))\n"
        "print([m for m in ('torch', 'transformers', 'zarr') if m in sys.modules])\n"
        "import plexrl_dask.worker as engine\n"
        "engine.stores\n"
        "print([m for m in ('torch', 'zarr') if m in sys.modules])\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["[]", "['torch',", "'zarr']"]


def test_accounting_starts_a_queued_task_when_the_one_ahead_ends_and_counts_per_job():
    from plexrl_dask.plugins.accounting import RequestAccounting

    a = RequestAccounting()
    a.released("k1", 10.0, "policy", "forward_backward", "w", "job", behind=False)
    a.released("k2", 10.0, "policy", "optim_step", "w", "job", behind=True)  # queued behind k1
    a.dispatched("job", 0.5)
    assert a.busy() and a.queued_behind == {"w": "k2"}
    first = a.ended("k1", succeeded=True, now=12.0)
    assert first.t0 == 10.0 and first.worker == "w" and first.op == "forward_backward"
    assert a.started["k2"].t0 == 12.0 and not a.busy()  # k2 starts when k1 ends
    assert a.ended("k2", succeeded=False, now=13.0).t0 == 12.0
    assert a.ended("never-released", succeeded=True, now=14.0) is None
    assert dict(a.job_counters["job"]) == {
        "dispatched": 1, "wait_s": 0.5, "completed": 1, "busy_s": 2.0, "failed": 1
    }  # fmt: skip
    a.released("k3", 15.0, "policy", "sample", "w", "job", behind=False)
    a.worker_left("w")
    assert a.started == {} and a.queued_behind == {}


def test_the_queue_counts_each_jobs_pending_requests():
    q = RequestQueue()
    for i, job in enumerate(["a", "a", "b"]):
        q.add(PendingRequest(f"r{i}", 1, "d", "sample", 0, job))
    q.add(PendingRequest("r0", 1, "d", "sample", 0, "a"))  # another rank of r0: not counted
    assert (q.of_job("a"), q.of_job("b"), q.of_job("c")) == (2, 1, 0)
    q.release("r0")
    q.forget(q.get("r2"))
    q.forget(PendingRequest("gone", 1, "d", "sample", 0, "a"))  # never queued: no change
    assert q.job_counts() == {"a": 1}


def test_the_access_rule_knows_every_request_op():
    from plexrl_dask.shared.access import OPS, READ_OPS
    from plexrl_dask.worker import ops

    # (helpers, not requests; train_scored is a train_step request: the same rule)
    routed = set(ops.__all__) - {"as_batch", "combine", "train_scored"}
    assert routed == OPS and set(READ_OPS) <= OPS


# --- the journal and the principals ----------------------------------------------------------


def test_the_journal_writes_each_change_once_and_restores_what_decodes(tmp_path):
    import os

    from plexrl_dask.plugins.journal import Journal, JournaledMap

    path = tmp_path / "journal.sqlite"
    journal = Journal(path)
    assert os.stat(path).st_mode & 0o777 == 0o600
    writes = []
    put = journal.put
    journal.put = lambda *a: (writes.append(a[1]), put(*a))  # type: ignore[method-assign]
    records: JournaledMap[DeploymentInfo] = JournaledMap(
        journal, "deployment", DeploymentInfo.to_dict
    )
    records["policy"] = info()
    records["policy"] = info()  # unchanged: no write
    records["policy"] = info().with_(modified=True)
    records["gone"] = info(name="gone")
    del records["gone"]
    assert writes == ["policy", "policy", "gone"]
    journal.put("deployment", "garbled", {"name": "x"})  # not a record: dropped on restore
    journal.close()

    again = Journal(path)
    restored: JournaledMap[DeploymentInfo] = JournaledMap(
        again, "deployment", DeploymentInfo.to_dict
    )
    assert restored.restore(DeploymentInfo.from_dict) == ["policy"]
    assert restored["policy"].modified and "garbled" not in again.load("deployment")
    with pytest.raises(errors.ConfigError):
        Journal(tmp_path / "no-such-dir" / "journal.sqlite")


def test_a_journal_refuses_what_is_not_json_and_survives_a_failing_disk(tmp_path, caplog):
    """A value that cannot be journaled is refused, typed, with the map unchanged; a journal
    that cannot write leaves the change made in memory and says so (the scheduler keeps
    going), and writes it with the next write that succeeds."""
    from plexrl_dask.plugins.journal import Journal, JournaledMap

    journal = Journal(tmp_path / "journal.sqlite")
    m = JournaledMap(journal, "things", lambda v: v)
    m["a"] = {"x": 1}
    with pytest.raises(errors.ConfigError, match="JSON"):
        m["b"] = {"x": b"bytes"}
    assert dict(m) == {"a": {"x": 1}} and journal.load("things") == {"a": {"x": 1}}
    db = journal._db
    journal._db = sqlite3.connect(":memory:")  # (a journal whose writes fail: no table)
    m["c"] = {"x": 3}
    del m["a"]
    assert dict(m) == {"c": {"x": 3}} and m.unwritten == {"a", "c"}
    assert "will not outlive a restart" in caplog.text
    journal._db = db  # (the disk is back) ...
    m["d"] = {"x": 4}  # ... and the next write catches up with what failed
    assert m.unwritten == set()
    assert journal.load("things") == {"c": {"x": 3}, "d": {"x": 4}}


def test_principals_register_reattach_and_refuse():
    from plexrl_dask.shared.access import Principals

    store: dict[str, str] = {}
    p = Principals("o" * 32, store)
    secret = p.register("a")
    assert p.register("a", secret) == secret and list(store) == ["a"]
    assert secret not in store["a"]  # only its digest is kept
    for job, given in (("a", None), ("a", "x" * 32), ("nobody", secret)):
        with pytest.raises(errors.PermissionDenied):
            p.verify(job, given)
    with pytest.raises(errors.PermissionDenied):
        p.register("a")  # another driver, no secret
    with pytest.raises(errors.PermissionDenied, match="restarted"):
        p.register("new", secret)
    p.verify("a", secret)
    p.check_operator("o" * 32, "x")
    with pytest.raises(errors.PermissionDenied, match="operator"):
        p.check_operator(secret, "change the policy")
    assert Principals("o" * 32, store).jobs() == ["a"]  # (a restored store)
    with pytest.raises(errors.ConfigError):
        Principals("short")
