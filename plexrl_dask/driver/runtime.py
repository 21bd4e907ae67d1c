"""The client-side router's entry point: :class:`Runtime`.

A :class:`Runtime` wraps a ``distributed.Client`` and holds no deployment state of its own: the
registry lives on the scheduler, so a second driver with its own client and its own runtime sees
the same deployments. It deploys models and hands out
:class:`~plexrl_dask.driver.deployment.Deployment` handles, whose every model call is a task the
scheduler plugin routes; it also speaks to the scheduler plugin for the job (status, policy,
placement, relocations, the timeline) and starts weight syncs between deployments.

The scheduler plugin releases a deployment's requests in arrival order (all ranks of a multi-rank
request at once), so ``forward_backward`` followed by ``optim_step`` can be pipelined without
waiting in between.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import numbers
import os
import time
import uuid
from collections.abc import Iterator, Sequence
from typing import Any

import dask
from distributed import Actor, Client, Future, get_client

from plexrl_dask import config, protocol
from plexrl_dask.driver.deployment import Deployment
from plexrl_dask.driver.waits import result, run_on_workers
from plexrl_dask.errors import (
    ConfigError,
    InvalidModelSpec,
    JobNotPlaced,
    NoPlexRLWorkers,
    PlexRLError,
    PluginsNotInstalled,
    RelocationFailed,
    RequestTimeout,
    SchedulerLost,
    raise_for_status,
)
from plexrl_dask.models.spec import ModelSpec
from plexrl_dask.policy.horizon import Phase
from plexrl_dask.shared.records import DeploymentInfo, qualified_name
from plexrl_dask.shared.timeline import RequestSpan
from plexrl_dask.sim.workload import save_trace
from plexrl_dask.state_store.keys import derived_model
from plexrl_dask.worker import ops
from plexrl_dask.worker.holder import ReplicaHolder

logger = logging.getLogger(__name__)


# (scheduler address, job) -> the job's secret, for the runtimes of this driver process: a
# second Runtime of a job in the process that registered it is the same principal.
_SECRETS: dict[tuple[str, str], str] = {}


@contextlib.contextmanager
def as_another_driver() -> Iterator[None]:
    """Within the block, runtimes act as another driver process would: they know no job
    secret but what they are given (for the fault suite and tests of reattaching)."""
    known = dict(_SECRETS)
    _SECRETS.clear()
    try:
        yield
    finally:
        _SECRETS.clear()
        _SECRETS.update(known)


@contextlib.contextmanager
def _scheduler_errors(handler: str) -> Iterator[None]:
    """A scheduler call's failures as PlexRL's typed errors."""
    try:
        yield
    except TimeoutError as e:
        raise RequestTimeout(f"the scheduler did not answer {handler} in time") from e
    except OSError as e:  # (the connection broke, or none could be made)
        raise SchedulerLost(f"the scheduler could not be reached for {handler}: {e}") from e


def _checked_status(handler: str, status: Any) -> dict[str, Any]:
    if not isinstance(status, dict):
        # A scheduler without the handler logs "No handler found" and answers None.
        raise PluginsNotInstalled(
            f"the scheduler has no {handler!r} handler: install the PlexRL plugins "
            "(plexrl_dask.local_cluster(), plexrl_dask.install(client), or "
            "`dask scheduler --preload plexrl_dask.plugins`)"
        )
    return raise_for_status(status)


class Runtime:
    """Stateless router from API calls to Dask futures (see the module docstring).

    ``job`` names the caller in every request's annotation (for scheduling, accounting and the
    dashboard); it defaults to a fresh id. The first runtime that names a job registers it with
    the scheduler and gets its secret (:attr:`secret`), which every call and request in the
    job's name presents; another driver process acts as that job only by passing ``secret``
    (a driver that reattaches), else :class:`PermissionDenied` (docs/tenancy.md).
    """

    def __init__(
        self, client: Client | None = None, job: str | None = None, secret: str | None = None
    ):
        self.client = client if client is not None else get_client()
        # A driver's steps are chains of requests and replies: its stream to the scheduler
        # should not hold a request for Dask's 10 ms after a key release (plexrl.comm).
        config.tune_batched_send(getattr(self.client, "scheduler_comm", None))
        self.job = job or f"job-{uuid.uuid4().hex[:8]}"
        self._secret = secret
        self._stored: set[str] = set()  # workers seen with a node store (sync_weights)

    @property
    def secret(self) -> str:
        """The job's secret (registering the job on first use)."""
        if self._secret is None:
            self.attach()
        assert self._secret is not None
        return self._secret

    def attach(self) -> str:
        """Register the job (a new one gets a fresh secret), or re-attach to it with the
        secret this runtime was given or this process knows; returns the secret.
        :class:`PermissionDenied` if the job is registered and that is not its secret, or if a
        secret is given for a job the scheduler does not know (it restarted without a
        journal: a runtime without a secret registers it anew)."""
        key = (str(self.client.scheduler.address), self.job)
        known = self._secret if self._secret is not None else _SECRETS.get(key)
        status = self._call(protocol.REGISTER_JOB, job=self.job, secret=known)
        self._secret = _SECRETS[key] = str(status["secret"])
        return self._secret

    def _call(
        self, handler: str, call_timeout: float | None = None, **kwargs: Any
    ) -> dict[str, Any]:
        """The scheduler's answer to ``handler(**kwargs)``, within ``call_timeout`` seconds
        (default ``plexrl.request.timeout``)."""
        rpc, kwargs = self._rpc(handler, kwargs)
        limit = config.request_timeout() if call_timeout is None else call_timeout
        with _scheduler_errors(handler):
            status = self.client.sync(rpc, **kwargs, callback_timeout=limit)
        return _checked_status(handler, status)

    def _rpc(self, handler: str, kwargs: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
        if handler in protocol.ACTS_AS_JOB:
            kwargs["secret"] = self.secret
        if self.client.status in ("closing", "closed") or self.client.scheduler is None:
            # (a Client that could not reconnect within its own ``timeout``, 30 s by default,
            # closes itself: give it one longer than a scheduler restart takes)
            raise SchedulerLost(
                f"the client is {self.client.status}: it gave up reconnecting to the scheduler "
                "(a Client closes itself past its `timeout`, distributed.comm.timeouts.connect "
                "by default); connect a new Client, with a timeout that covers a restart"
            )
        return getattr(self.client.scheduler, handler), kwargs

    def _ask(self, handler: str, **kwargs: Any) -> concurrent.futures.Future:
        """Start ``handler`` on the client's loop without waiting (:meth:`_answer` waits):
        a question asked while the job's requests run costs no wait once they are done."""
        rpc, kwargs = self._rpc(handler, kwargs)

        async def ask() -> Any:
            return await asyncio.wait_for(rpc(**kwargs), config.request_timeout())

        return asyncio.run_coroutine_threadsafe(ask(), self.client.loop.asyncio_loop)

    def _answer(self, handler: str, asked: concurrent.futures.Future) -> dict[str, Any]:
        """The answer to a question :meth:`_ask` started, checked as :meth:`_call`'s."""
        with _scheduler_errors(handler):
            # (bounded inside by the request timeout; the margin covers the loop's latency)
            status = asked.result(timeout=config.request_timeout() + 5.0)
        return _checked_status(handler, status)

    # --- deployments -------------------------------------------------------------------------

    def deploy(
        self,
        name: str,
        model: ModelSpec,
        role: str = "train",
        backend: str = "torch",
        owner: str | None = None,
        exist_ok: bool = False,
        wait: bool = True,
        workers: Sequence[str] | None = None,
        world_size: int = 1,
        replicas: int = 1,
        tensor_parallel: int = 1,
    ) -> Deployment:
        """Register deployment ``name`` of ``model`` and place it on a worker.

        Names are per-job namespaces: it is registered as ``name@job`` (the handle's
        ``.name``), so another job's ``name`` is another deployment.

        With ``wait`` (default) the replica is built on its worker before this returns, so a
        model that cannot be built there fails here (and is unregistered). With ``exist_ok``, an
        identical existing deployment is returned instead of raising ``DeploymentExists``.
        ``workers`` restricts placement to those worker addresses. ``world_size`` shards a
        training deployment over that many workers (one FSDP2 group); ``replicas`` runs that
        many data-parallel copies of a rollout deployment, each over ``tensor_parallel``
        workers as one gang (torch's tensor-parallel plan: q/k/v/gate/up split by output,
        o/down by input; it must divide the attention and key-value heads and the MLP width;
        on the CPU this is about correctness, not speed). A LoRA model
        (``spec.with_lora(rank)``) trains only its adapter; the LoRA replicas of one base on a
        worker hold the base's weights once. ``backend``: ``"torch"`` (training
        and rollout, any device) or ``"vllm"`` (rollout on CUDA workers with the ``vllm``
        package; its budget includes ``plexrl.vllm.kv-cache-memory`` and
        ``overhead-memory``) or ``"adapters"`` (an adapter bank: a rollout replica of a base
        model ``spec`` that samples many LoRA adapters' prompts in one decode, each adapter
        loaded from a stored state with :meth:`Deployment.load_adapter`).
        """
        if not isinstance(model, ModelSpec):
            raise InvalidModelSpec(
                f"model must be a plexrl_dask.ModelSpec, got {type(model).__name__}"
            )
        world_size = config.count("world_size", world_size)
        replicas = config.count("replicas", replicas)
        tensor_parallel = config.count("tensor_parallel", tensor_parallel)
        uid = uuid.uuid4().hex
        hf = model.hf_config()
        if role == "rollout" and world_size != 1:
            raise ConfigError(
                "world_size shards a training deployment; split a rollout replica over "
                "workers with tensor_parallel"
            )
        if model.lora is not None and (world_size, tensor_parallel, backend) != (1, 1, "torch"):
            raise ConfigError(
                f"{model.name}: a LoRA adapter runs on one worker with the torch backend "
                "(world_size 1, tensor_parallel 1); its replicas share the base there"
            )
        if model.lora is not None:
            model.adapter_parameters()  # (InvalidModelSpec when no module is a target)
        if tensor_parallel > 1:
            check_tensor_parallel(hf, role, backend, world_size, tensor_parallel)
            world_size = tensor_parallel  # (a rollout replica's ranks: its TP shards)
        memory_bytes = -(-model.memory_bytes(role) // world_size)  # per rank, rounded up
        if backend == "vllm":
            from plexrl_dask.worker.backends.vllm_backend import VLLMConfig

            # the engine's KV cache and overhead sit beside the weights on its GPU
            memory_bytes = VLLMConfig.from_dask_config().device_bytes(memory_bytes)
        status = self._call(
            protocol.DEPLOY,
            name=qualified_name(name, owner or self.job),
            uid=uid,
            spec=model.to_dict(),
            role=role,
            backend=backend,
            owner=owner or self.job,
            job=self.job,
            memory_bytes=memory_bytes,
            exist_ok=exist_ok,
            candidates=None if workers is None else config.strings("workers", workers),
            world_size=world_size,
            replicas=replicas,
            vocab_size=int(hf.vocab_size),
            max_positions=int(hf.max_position_embeddings),
        )
        deployment = Deployment(self, DeploymentInfo.from_dict(status["deployment"]))
        if wait and status["created"]:
            try:
                result(deployment.load())
            except BaseException:
                self._call(protocol.UNDEPLOY, name=deployment.name, uid=uid, job=self.job)
                raise
        return deployment

    def deployment(self, name: str, job: str | None = None) -> Deployment:
        """Look up an existing deployment: this job's ``name``, or ``job``'s, or the registered
        name of any job's (``name@job``, a handle's ``.name``). Names are per-job namespaces;
        another job's deployment serves this job only what its owner shared."""
        status = self._call(protocol.GET_DEPLOYMENT, name=qualified_name(name, job or self.job))
        return Deployment(self, DeploymentInfo.from_dict(status["deployment"]))

    def deployments(self, every_job: bool = False) -> list[DeploymentInfo]:
        """This job's deployments and those shared with it (``every_job``: all of them)."""
        status = self._call(protocol.LIST_DEPLOYMENTS, job=None if every_job else self.job)
        return [DeploymentInfo.from_dict(d) for d in status["deployments"]]

    def undeploy(self, name: str) -> None:
        """Unregister this job's deployment ``name`` and free its replicas
        (:class:`PermissionDenied` for another job's)."""
        self._call(protocol.UNDEPLOY, name=qualified_name(name, self.job), job=self.job)

    def wait_for_scheduler(self, timeout: float | None = None) -> dict[str, Any]:
        """Wait until the scheduler answers again (after :class:`SchedulerLost`: a scheduler
        started again, on its journal, at the address this client reconnects to); returns its
        status. :class:`SchedulerLost` if it does not within ``timeout`` seconds (default
        ``plexrl.request.timeout``)."""
        timeout = config.request_timeout() if timeout is None else config.seconds("timeout", timeout)
        deadline = time.monotonic() + timeout
        while True:
            left = max(0.1, deadline - time.monotonic())
            try:
                return self._call(protocol.STATUS, call_timeout=left)
            except (SchedulerLost, RequestTimeout, PluginsNotInstalled) as e:
                if self.client.status in ("closing", "closed"):
                    raise  # (it will not reconnect: see _rpc)
                if time.monotonic() > deadline:
                    raise SchedulerLost(
                        f"the scheduler did not come back within {timeout:.0f}s: {e}"
                    ) from e
            time.sleep(0.5)

    def status(self) -> dict[str, Any]:
        """The scheduler plugin's state: deployments, residency, worker capacity, counters."""
        return self._call(protocol.STATUS)

    def set_policy(self, operator_secret: str | None = None, **knobs: Any) -> dict[str, Any]:
        """Change the scheduler's dispatch policy while no request is pending (``ordering``,
        ``choice``, ``setup_weight``, ``patience_factor``, ``patience_floor_s``,
        ``lookahead``, ``fair_share``, ``gang_hold_s``, ``turn_hold_s``; see the ``plexrl_set_policy``
        handler), as the cluster's
        operator: ``operator_secret``, else ``plexrl.operator-secret``, else the file the
        scheduler wrote it to (readable where the scheduler runs, by the user that runs it).
        Returns the policy now in force."""
        if operator_secret is None:
            operator_secret = operator_secret_of(self)
        return self._call(protocol.SET_POLICY, operator_secret=operator_secret, **knobs)["policy"]

    def placement(self, job: str | None = None) -> dict[str, Any]:
        """The spatiotemporal placement (``plugins/placement.py``): node groups and their load,
        the queue, every decision, the recorded placement events (replay them with
        :func:`plexrl_dask.policy.spatiotemporal.replay`) and the recorded iterations of
        ``job`` (default: every job)."""
        return self._call(protocol.PLACEMENT, job=job)

    def save_trace(self, path: str | os.PathLike, job: str | None = None) -> list:
        """Write ``job``'s (default: this runtime's job) recorded iterations to ``path`` in the
        simulator's replay format (:func:`plexrl_dask.sim.workload.save_trace`); returns them."""

        job = job or self.job
        placement = self.placement(job)
        if not placement.get("enabled", True) or "traces" not in placement:
            raise JobNotPlaced("the spatiotemporal placement is off (plexrl.placement.live)")
        raw = placement["traces"].get(job)
        if not raw:
            raise JobNotPlaced(f"no recorded iterations of job {job!r} yet")
        its = [tuple(Phase(k, int(g), float(d)) for k, g, d in it) for it in raw]
        save_trace(path, its, {"job": job, "source": "live"})
        return its

    def ask_relocations(self) -> concurrent.futures.Future:
        """Start asking which of this job's deployments :meth:`relocate` would move, without
        waiting; pass the result to ``relocate(asked=...)``. A job asks while its requests
        still run, so the question is answered by the time they are done (``GRPOJob``): a
        deployment that leaves its group after the question moves at the next call."""
        return self._ask(protocol.RELOCATIONS, owner=self.job)

    def relocate(
        self, timeout: float | None = None, asked: concurrent.futures.Future | None = None
    ) -> list[dict[str, Any]]:
        """Move this job's deployments that sit outside its node group into it: those it
        made best effort while it waited for placement, or before it was micro-shifted into
        another group (``plugins/placement.py``). Call it where none of the job's requests are
        in flight (``GRPOJob`` does, between steps); a deployment with a request in flight is
        refused with :class:`DeploymentBusy` and nothing of it changes.

        A deployment with trained state is checkpointed on its node's NVMe tier, re-placed in
        the group and restored there bit for bit (imported from the old node when the group is
        on others); the checkpoint's copies are deleted once it is restored. An unmodified one
        is rebuilt from its spec by its next request, and a weights-only one (vLLM) that was
        given weights waits for its next weight load (``sync_weights``), which places it in the
        group. Returns the moves made: ``name``, ``workers`` (before), ``group``, ``restored``
        (state carried), ``needs_weights`` and, with state, the new ``workers``. Nothing to
        move costs one scheduler call, none when it was asked ahead (``asked``: what
        :meth:`ask_relocations` returned).

        If the restore fails, the deployment stays ``relocating`` (its requests are refused
        with :class:`DeploymentRelocating`) and :class:`RelocationFailed` names the checkpoint,
        which is kept: restore it with ``load_state``."""
        done = []
        status = (
            self._call(protocol.RELOCATIONS, owner=self.job)
            if asked is None
            else self._answer(protocol.RELOCATIONS, asked)
        )
        for move in status["moves"]:
            name, restored = move["name"], None
            dep = self.deployment(name)
            if move["modified"] and not dep.info.weights_only:
                # its own store model: deleting the move's copies never touches a checkpoint
                # the job saved itself
                model = derived_model("relocate", name, move["uid"][:12])
                restored = result(dep.save_state(model=model), timeout)
            self._call(
                protocol.RELOCATE, name=name, uid=move["uid"], job=self.job, checkpoint=restored
            )
            entry = {k: move[k] for k in ("name", "workers", "group")}
            entry["restored"] = restored is not None
            # a weights-only deployment (vLLM) is placed anew by its next weight load
            entry["needs_weights"] = bool(move["modified"] and dep.info.weights_only)
            if restored is not None:
                try:
                    result(dep.load_state(restored), timeout)
                except PlexRLError as e:
                    raise RelocationFailed(
                        f"{name!r} could not be restored in its node group ({e}); its state is "
                        f"checkpoint {dict(restored)}: restore it with load_state"
                    ) from e
                now = list(self.deployment(name).info.workers)
                entry["now"] = now
                # the checkpoint where it was written and where it was imported to
                run_on_workers(
                    self.client,
                    ops.drop_checkpoint,
                    restored["model"],
                    int(restored["version"]),
                    workers=sorted({restored.get("source") or now[0], *now}),
                    timeout=timeout,
                )
            logger.info("job %s relocated %s into its group: %s", self.job, name, entry)
            done.append(entry)
        return done

    def holder(self, worker: str) -> Actor:
        """The replica holder of ``worker`` as a Dask actor (``.status().result()``, ...)."""
        info = self.status()["workers"].get(worker)
        if info is None:
            raise NoPlexRLWorkers(f"{worker} has no PlexRL replica holder (yet)")
        with self.client.as_current():  # the actor handle talks through this runtime's client
            return Actor(ReplicaHolder, worker, info["holder_key"])

    def timeline(self, since: float = 0.0) -> list[RequestSpan]:
        """Every PlexRL worker's request spans that ended after ``since`` (wall-clock
        seconds), in start order (see :mod:`plexrl_dask.shared.timeline`)."""
        if isinstance(since, bool) or not isinstance(since, numbers.Real):
            raise ConfigError(f"since is wall-clock seconds, got {since!r}")
        with self.client.as_current():
            holders = {
                w: Actor(ReplicaHolder, w, info["holder_key"])
                for w, info in self.status()["workers"].items()
            }
        futures = {w: h.timeline(float(since)) for w, h in holders.items()}
        deadline = time.monotonic() + config.request_timeout()
        spans, silent = [], []
        for worker, f in futures.items():  # (one worker hung or gone leaves out its own)
            try:
                answer = f.result(timeout=max(0.0, deadline - time.monotonic()))
            except (TimeoutError, OSError) as e:
                silent.append(f"{worker} ({type(e).__name__})")
                continue
            spans.extend(RequestSpan.from_dict(d) for d in answer)
        if silent and len(silent) == len(futures):
            raise RequestTimeout(f"no worker's timeline came back: {', '.join(silent)}")
        if silent:
            logger.warning("the timeline leaves out workers that did not answer: %s", silent)
        return sorted(spans, key=lambda s: s.start)

    # --- weights between deployments ---------------------------------------------------------

    def sync_weights(self, src: Deployment | str, dst: Deployment | str) -> Future:
        """Copy ``src``'s current weights (and version) into ``dst``; the future's result is
        ``dst``'s new version. The weights never go through the client.

        This goes through the state store: ``src``'s ranks publish their shard regions to
        the DRAM tier of rank 0's node (ranks on other nodes send theirs to rank 0; tensors
        unchanged since the last sync are not rewritten), and every replica or rank of
        ``dst`` reads only what its layout holds. A ``dst`` worker on another node first
        imports the version into its own node's tiers from rank 0's worker (once per node, only
        the objects that node lacks: :mod:`plexrl_dask.state_store.peer`). Only when a worker
        has no node store does ``src``'s rank 0 gather the whole tensors for Dask to move."""
        src = self.deployment(src) if isinstance(src, str) else src
        dst = self.deployment(dst) if isinstance(dst, str) else dst
        if self._all_stored(*src.info.workers, *dst.info.workers):
            # A fresh store version per sync (µs clock: unique and increasing); the weights'
            # own version travels in the manifest.
            ref = src._submit(
                "publish_weights",
                ops.publish_weights,
                src._ranks(time.time_ns() // 1000, uuid.uuid4().hex),
            )
            return dst._every("load_weights", ops.load_weights, (ref,))
        return dst.set_weights(src.get_weights())

    def _all_stored(self, *workers: str) -> bool:
        """Whether every one of ``workers`` has a node store. Asked of the scheduler only
        for workers not yet seen with one (a worker's store lives as long as its process:
        a job syncing every step asks once, not every step)."""
        unseen = set(workers) - self._stored
        if unseen and None in self.nodes_of(*unseen):
            return False
        self._stored |= unseen
        return True

    def nodes_of(self, *workers: str) -> set[str | None]:
        """The node ids (their state store's) of ``workers``, as their holders reported them."""
        known = self.status()["workers"]
        return {known.get(w, {}).get("node") for w in workers}


def check_tensor_parallel(
    hf: Any, role: str, backend: str, world_size: int, tensor_parallel: int
) -> None:
    """Raise :class:`ConfigError` unless a ``role`` deployment can split ``hf``'s model over
    ``tensor_parallel`` ranks: a torch rollout, whose attention heads, key-value heads and
    MLP width all divide by it."""
    if role != "rollout" or backend != "torch" or world_size != 1:
        raise ConfigError(
            "tensor_parallel splits a torch rollout replica; a training deployment shards "
            f"with world_size (got role={role!r}, backend={backend!r}, world_size={world_size})"
        )
    sizes = {
        "attention heads": int(hf.num_attention_heads),
        "key-value heads": int(getattr(hf, "num_key_value_heads", None) or hf.num_attention_heads),
        "MLP width": int(hf.intermediate_size),
    }
    uneven = {what: n for what, n in sizes.items() if n % tensor_parallel}
    if uneven:
        raise ConfigError(
            f"tensor_parallel={tensor_parallel} does not divide the model's {uneven}: each "
            "rank holds whole heads"
        )


def operator_secret_of(runtime: Runtime) -> str | None:
    """The operator secret as this process can know it: ``plexrl.operator-secret``, else the
    scheduler's secret file where this process can read it (``None`` if neither)."""
    configured = dask.config.get("plexrl.operator-secret", None)
    if configured is not None:
        return str(configured)
    path = runtime.status().get("operator_secret_file")
    try:
        with open(path) as f:  # type: ignore[arg-type]
            return f.read().strip()
    except (OSError, TypeError):
        return None
