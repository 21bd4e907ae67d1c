"""What ``plexrl serve`` keeps and does: Tinker sessions, models and samplers as PlexRL
deployments, and every long call as a promise the SDK polls.

Runs on the HTTP server's event loop (every method here is called there, so the tables need no
locks); PlexRL calls that block (deploying, undeploying) run on a thread pool, and requests
are awaited with :func:`~plexrl_dask.driver.waits.settled`, which never cancels a fetch.

- **Tenants** are PlexRL jobs (``tinker-<name>``), one :class:`~plexrl_dask.Runtime` each on the
  server's one Dask client. Every table entry records its tenant; an id of another tenant's is
  :class:`~plexrl_dask.errors.UnknownObject`, exactly as one that never existed.
- **Training models** (``create_model``) are training deployments named by their Tinker id
  (``<session>:train:<n>``) of a base model from the catalog (``plexrl.serve.models``):
  full fine-tuning (``lora_rank`` 0) or a LoRA adapter on the base (``lora_rank`` > 0; the
  adapters of one base on a worker share its weights there). Their requests carry the SDK's ``seq_id`` (1, 2, ... per
  model) and are submitted to PlexRL in that order, so the scheduler's per-deployment order is
  the SDK's; a retried ``seq_id`` gets its first request id back; a ``seq_id`` that never
  arrives is skipped after ``plexrl.serve.seq-gap-timeout``.
- **Samplers.** ``save_weights_for_sampler`` without a name makes a sampling session on the
  training deployment itself, at its current optimizer step: samples run on the policy's own
  replica, ordered with its training, with no copy of the weights; used after a later step it
  is :class:`~plexrl_dask.errors.SamplerSuperseded`. A named one saves a checkpoint (the node's
  state store); ``create_sampling_session`` on its path deploys a rollout replica that loads
  it, and on a base model name, a rollout replica of the base (one per tenant and base).
- **Adapter banks** (``plexrl.serve.adapter-bank``, on by default) change two of those: a LoRA
  model's snapshot sampler saves its adapter (weights only) and loads it into the bank of its
  base, and a base-model sampler samples the bank's base. The bank is one rollout deployment
  per base of the server's own job (``plexrl-serve-<id>``; tenants' LoRA models share their saved
  state with it for reading only), and it decodes every tenant's merged calls in one request,
  each prompt with its adapter (:mod:`plexrl_dask.worker.backends.adapters`). A snapshot in
  the bank is a copy, so it never goes stale; a model keeps its newest one and
  ``plexrl.serve.kept-snapshots`` older ones there.

:class:`Service` is this module's class and two base classes, each a part of the calls:
:class:`~plexrl_dask.serve.sampling.SamplingSessions` (making, retiring and sampling the
samplers) and :class:`~plexrl_dask.serve.saving.CheckpointCalls` (saving by name, exporting
and deleting checkpoints).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import logging
import os
import tempfile
import threading
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import numpy as np
import torch

from plexrl_dask import config
from plexrl_dask.driver.deployment import Deployment
from plexrl_dask.driver.runtime import Runtime
from plexrl_dask.driver.waits import result, settled
from plexrl_dask.errors import (
    ConfigError,
    InvalidLoss,
    InvalidTinkerRequest,
    PermissionDenied,
    PlexRLError,
    TenantBusy,
    TenantLimitExceeded,
    UnknownObject,
    UnsupportedCall,
)
from plexrl_dask.models.spec import LoraSpec, ModelSpec
from plexrl_dask.serve import wire
from plexrl_dask.serve.checkpoints import SavedCheckpoints
from plexrl_dask.serve.coalesce import SampleMerger
from plexrl_dask.serve.records import (
    JSON,
    PROTO,
    Promise,
    Reply,
    Run,
    Sampler,
    Session,
    TrainModel,
    error_body,
    json_reply,
)
from plexrl_dask.serve.sampling import SamplingSessions
from plexrl_dask.serve.saving import CheckpointCalls
from plexrl_dask.serve.snapshots import KeptSnapshots
from plexrl_dask.serve.state import ServeState
from plexrl_dask.serve.tenants import Tenant
from plexrl_dask.shared.loss_graph import GraphLoss
from plexrl_dask.shared.types import ForwardBackwardResult, ForwardResult
from plexrl_dask.worker.loss_graph import build
from plexrl_dask.worker.losses import compute_loss

logger = logging.getLogger(__name__)

#: Threads the server runs its blocking calls on (a tenant's share: plexrl.serve.tenant-threads).
THREADS = 16


class Service(SamplingSessions, CheckpointCalls):
    """The server's state and the translation of each Tinker call (see the module docstring).
    ``models``: base model name -> local checkpoint directory."""

    def __init__(
        self, client: Any, models: dict[str, str], state_file: str | os.PathLike[str] | None = None
    ) -> None:
        self.client = client
        self.state = ServeState(state_file)
        self.catalog = {name: ModelSpec(path=str(path)) for name, path in models.items()}
        self.runtimes: dict[str, Runtime] = {}
        self.banked = config.get("serve.adapter-bank")
        if not isinstance(self.banked, bool):
            raise ConfigError(f"plexrl.serve.adapter-bank is true or false, got {self.banked!r}")
        self.custom_losses = config.get("serve.custom-losses")
        if not isinstance(self.custom_losses, bool):
            raise ConfigError(
                f"plexrl.serve.custom-losses is true or false (True in an environment "
                f"variable), got {self.custom_losses!r}"
            )
        self.bank_job = self.state.server_job()  # (owns the banks; no tenant job is "plexrl-")
        self.banks: dict[str, Deployment] = {}  # base -> its adapter bank
        self.mergers: dict[str, SampleMerger] = {}  # bank name -> its calls' merger
        self._banking = asyncio.Lock()
        self._attaching: dict[str, asyncio.Lock] = {}  # job -> held while it attaches
        self.sessions: dict[str, Session] = {}
        self.models: dict[str, TrainModel] = {}
        #: model id -> tenant: models being deployed (counted against the tenant's limit)
        self.creating: dict[str, str] = {}
        self.samplers: dict[str, Sampler] = {}
        #: sampler id -> tenant: samplers being made (counted against the tenant's limit)
        self.reserved_samplers: dict[str, str] = {}
        self.sampler_lock = threading.Lock()  # (samplers are added on executor threads too)
        #: sampler id -> (tenant, why): snapshot samplers retired by a later step
        self.retired: dict[str, tuple[str, str]] = {}
        self.saved = SavedCheckpoints(self.state, _export_dir(state_file))
        self.snapshots = KeptSnapshots(self)
        self.runs = {k: Run(**v) for k, v in self.state.table("runs").items()}
        self._context: dict[str, tuple[int, int]] = {}
        self.promises: dict[str, Promise] = {}
        self.waiting: dict[str, int] = {}  # tenant -> its promises not yet finished
        self.pool = concurrent.futures.ThreadPoolExecutor(THREADS, thread_name_prefix="plexrl-serve")
        self.tenant_threads = config.count(
            "plexrl.serve.tenant-threads", config.get("serve.tenant-threads")
        )
        if not 1 <= self.tenant_threads < THREADS:
            raise ConfigError(
                f"plexrl.serve.tenant-threads is 1 to {THREADS - 1}, got {self.tenant_threads}"
            )
        self._lanes: dict[str, asyncio.Semaphore] = {}  # tenant -> its share of the threads
        self.loop: asyncio.AbstractEventLoop | None = None  # the server's, once it runs
        self.long_poll = float(config.get("serve.long-poll"))  # type: ignore[arg-type]
        self.result_ttl = float(config.get("serve.result-ttl"))  # type: ignore[arg-type]
        self.gap_timeout = float(config.get("serve.seq-gap-timeout"))  # type: ignore[arg-type]
        self.session_timeout = float(config.get("serve.session-timeout"))  # type: ignore[arg-type]

    # --- plumbing ------------------------------------------------------------------------

    async def runtime(self, tenant: Tenant) -> Runtime:
        """The tenant's job's runtime: registered, or re-attached with the secret in the state
        file; a job re-attached after a restart of this server first loses the deployments
        its last run left (:mod:`.state`)."""
        return await self._runtime_of(tenant.name, tenant.job)

    async def _runtime_of(self, key: str, job: str) -> Runtime:
        # One attach per job, whatever arrives meanwhile: a second attach would read the
        # state file's secret half-written, or undeploy the first's new deployments.
        lock = self._attaching.setdefault(key, asyncio.Lock())
        async with lock:
            if key not in self.runtimes:
                self.runtimes[key] = await self.blocking(self._attach, job)
        return self.runtimes[key]

    def _attach(self, job: str) -> Runtime:
        scheduler = str(self.client.scheduler.address)
        known = self.state.secret(scheduler, job)
        runtime = Runtime(self.client, job=job, secret=known)
        try:
            secret = runtime.attach()
        except PermissionDenied:
            if known is None:
                raise  # (another driver holds a job of this name)
            logger.warning("job %s was not known to the scheduler: registering it anew", job)
            runtime, known = Runtime(self.client, job=job), None
            secret = runtime.attach()
        self.state.set_secret(scheduler, job, secret)
        if known is not None:
            for info in runtime.deployments():
                if info.owner == job:
                    logger.info("undeploying %s, left by this server's last run", info.name)
                    runtime.undeploy(info.name)
        return runtime

    async def bank(self, base: str) -> Deployment:
        """The adapter bank of ``base`` (deployed on first use, in the server's own job)."""
        async with self._banking:  # (two first calls at once deploy it once)
            if base not in self.banks:
                runtime = await self._runtime_of(self.bank_job, self.bank_job)
                spec = self.spec(base)
                name = f"adapters:{len(self.banks)}"  # (catalog names may hold a '/')
                self.banks[base] = await self.blocking(
                    lambda: runtime.deploy(name, spec, role="rollout", backend="adapters")
                )
        return self.banks[base]

    async def blocking(self, fn: Callable[..., Any], *args: Any, tenant: str | None = None) -> Any:
        """``fn(*args)`` on the server's threads; a ``tenant``'s call waits for one of its
        ``plexrl.serve.tenant-threads`` first (its own queue, not the other tenants')."""
        if tenant is None:
            return await asyncio.get_running_loop().run_in_executor(self.pool, fn, *args)
        lane = self._lanes.setdefault(tenant, asyncio.Semaphore(self.tenant_threads))
        async with lane:
            return await asyncio.get_running_loop().run_in_executor(self.pool, fn, *args)

    def promise(self, tenant: Tenant, kind: str, work: Awaitable[Reply]) -> str:
        """Start ``work`` as a promise of ``tenant``; its request id. At the tenant's limit of
        requests waiting: :class:`TenantLimitExceeded` (the request is not started)."""
        waiting = self.waiting.get(tenant.name, 0)
        if waiting >= tenant.limits.requests_waiting:
            if asyncio.iscoroutine(work):
                work.close()
            raise TenantBusy(
                f"{waiting} requests of tenant {tenant.name!r} are waiting "
                f"(limit {tenant.limits.requests_waiting}); retrieve some results first"
            )
        request_id = f"req-{uuid.uuid4().hex}"
        task = asyncio.ensure_future(_replying(work))
        promise = Promise(request_id, tenant.name, kind, task)
        self.waiting[tenant.name] = waiting + 1

        def done(_: asyncio.Task) -> None:
            promise.done_at = time.monotonic()
            self.waiting[tenant.name] -= 1

        task.add_done_callback(done)
        self.promises[request_id] = promise
        return request_id

    async def retrieve(self, tenant: Tenant, request_id: str) -> Reply:
        """The promise's reply, waiting up to ``plexrl.serve.long-poll`` seconds; then 408
        with ``try_again`` (the SDK polls again)."""
        promise = self.promises.get(request_id)
        if promise is None or promise.tenant != tenant.name:
            raise UnknownObject(f"no request {request_id!r} (or its result has expired)")
        try:
            return await asyncio.wait_for(asyncio.shield(promise.task), self.long_poll)
        except TimeoutError:
            body = {"type": "try_again", "request_id": request_id, "queue_state": "active"}
            return 408, json_reply(body)[1], JSON

    async def expire(self) -> None:
        """Delete checkpoints past their TTL; forget finished promises older than
        ``plexrl.serve.result-ttl``; end sessions without a heartbeat for
        ``plexrl.serve.session-timeout``."""
        for checkpoint in self.saved.expired():
            logger.info("checkpoint %s has expired: deleting it", checkpoint.path)
            await self.delete(checkpoint)
        now = time.monotonic()
        for rid, p in list(self.promises.items()):
            if p.done_at is not None and now - p.done_at > self.result_ttl:
                del self.promises[rid]
        for session in list(self.sessions.values()):
            if now - session.last_seen > self.session_timeout:
                logger.warning("session %s sent no heartbeat in %.0fs: ending it",
                               session.session_id, self.session_timeout)  # fmt: skip
                await self._end(session)

    def _owned(self, table: dict[str, Any], key: str, tenant: Tenant, what: str) -> Any:
        entry = table.get(key)
        if entry is None or entry.tenant != tenant.name:
            raise UnknownObject(f"no {what} {key!r}")
        return entry

    def session(self, tenant: Tenant, session_id: str) -> Session:
        session = self._owned(self.sessions, session_id, tenant, "session")
        session.last_seen = time.monotonic()
        return session

    def model(self, tenant: Tenant, model_id: str) -> TrainModel:
        return self._owned(self.models, model_id, tenant, "model")

    def sampler(self, tenant: Tenant, sampler_id: str) -> Sampler:
        return self._owned(self.samplers, sampler_id, tenant, "sampling session")

    def context(self, base: str) -> int:
        """The base model's context length (read from its config once)."""
        return self._shape(base)[0]

    def _shape(self, base: str) -> tuple[int, int]:
        """The base model's context length and vocabulary size (read from its config once)."""
        if base not in self._context:
            cfg = self.spec(base).hf_config()
            self._context[base] = (int(cfg.max_position_embeddings), int(cfg.vocab_size))
        return self._context[base]

    def spec(self, base: str, lora: dict | None = None) -> ModelSpec:
        """The catalog's ``base`` model, or a LoRA adapter on it (``lora``: a LoraSpec's
        dict)."""
        if base not in self.catalog:
            raise UnknownObject(
                f"no base model {base!r} on this server; it serves {sorted(self.catalog)}"
            )
        spec = self.catalog[base]
        if lora is None:
            return spec
        adapter = LoraSpec.from_dict(lora)
        width = int(spec.hf_config().hidden_size)
        if adapter.rank > width:  # (no more expressive; as large as the model, or larger)
            raise InvalidTinkerRequest(
                f"lora_config.rank {adapter.rank} is past {base}'s hidden size {width}"
            )
        return dataclasses.replace(spec, lora=adapter)

    # --- sessions --------------------------------------------------------------------------

    def create_session(self, tenant: Tenant) -> str:
        session_id = f"s{uuid.uuid4().hex[:16]}"
        self.sessions[session_id] = Session(session_id, tenant.name)
        return session_id

    async def finish_session(self, tenant: Tenant, session_id: str) -> None:
        """End a session: its training models and samplers are undeployed (their saved
        checkpoints stay)."""
        await self._end(self.session(tenant, session_id))

    async def _end(self, session: Session) -> None:
        for model_id in session.models:
            model = self.models.pop(model_id, None)
            if model is not None:
                await self._undeploy(model.deployment)
        shared = {}
        for sampler_id in session.samplers:
            sampler = self.samplers.pop(sampler_id, None)
            if sampler is not None and (sampler.owned or sampler.kept is not None):
                await self.snapshots.release(sampler)
            elif (
                sampler is not None
                and sampler.model_id is None
                and sampler.deployment.info.backend != "adapters"  # (a bank is the server's)
            ):
                shared[sampler.deployment.name] = sampler.deployment
        # a base model's replica is the tenant's, shared by its sessions: it goes with the last
        in_use = {s.deployment.name for s in self.samplers.values()}
        for name, deployment in shared.items():
            if name not in in_use:
                await self._undeploy(deployment)
        self.sessions.pop(session.session_id, None)

    async def _undeploy(self, deployment: Deployment) -> None:
        try:
            await self.blocking(deployment.runtime.undeploy, deployment.name)
        except PlexRLError as e:  # (already gone: a worker left, an operator undeployed it)
            logger.warning("undeploying %s: %s", deployment.name, e)

    # --- training models -------------------------------------------------------------------

    async def create_model(self, tenant: Tenant, body: dict) -> str:
        """``create_model``: full fine-tuning of a base model (``lora_config.rank`` 0) or a
        LoRA adapter on it (every adapter of one base on a worker shares its weights)."""
        base = str(body.get("base_model"))
        lora = wire.lora_config(body.get("lora_config"))
        return await self._new_model(tenant, body, base, "create_model", None, lora)

    async def load_weights(self, tenant: Tenant, body: dict) -> str:
        """``load_weights``: a new training model from a saved checkpoint (``session_id`` and
        ``model_seq_id``; the SDK's ``create_training_client_from_state[_with_optimizer]``),
        or, with ``model_id`` and ``seq_id``, into an existing one in its order. ``optimizer``
        false: the weights only, a fresh optimizer."""
        checkpoint = self.saved.loadable(tenant.name, str(body.get("path")))
        optimizer = body.get("optimizer") is True
        if body.get("model_id") is not None:
            model = self.model(tenant, str(body.get("model_id")))
            return await self.ordered(
                tenant,
                model,
                wire.seq_id(body),
                "load_weights",
                lambda: model.deployment.load_state(checkpoint.saved, optimizer=optimizer),
                lambda _: json_reply({"path": checkpoint.path, "type": "load_weights"}),
            )
        restore = (checkpoint, optimizer)
        return await self._new_model(
            tenant, body, checkpoint.base, "load_weights", restore, checkpoint.lora
        )

    async def _new_model(
        self,
        tenant: Tenant,
        body: dict,
        base: str,
        kind: str,
        restore: tuple | None,
        lora: dict | None,
    ) -> str:
        """Deploy a training model of ``base`` (a LoRA adapter on it with ``lora``) for
        ``create_model`` or ``load_weights`` (``restore``: the checkpoint and whether its
        optimizer state comes too)."""
        session = self.session(tenant, str(body.get("session_id")))
        spec = self.spec(base, lora)
        optimizer = body.get("optimizer_config") or {}
        if not isinstance(optimizer, dict):
            raise InvalidTinkerRequest(f"optimizer_config is an object, got {optimizer!r:.80}")
        if optimizer.get("type", "adamw") != "adamw":
            raise UnsupportedCall("the optimizer is AdamW (optimizer_config type 'adamw')")
        n = wire.count(body.get("model_seq_id", 0), "model_seq_id")
        model_id = f"{session.session_id}:train:{n}"
        metadata = _metadata(body.get("user_metadata"))
        runtime = await self.runtime(tenant)
        # Checked and reserved with no await between: calls at once count each other.
        mine = sum(1 for m in self.models.values() if m.tenant == tenant.name)
        mine += sum(1 for owner in self.creating.values() if owner == tenant.name)
        if mine >= tenant.limits.models:
            raise TenantLimitExceeded(
                f"tenant {tenant.name!r} has {mine} training models (limit {tenant.limits.models})"
            )
        if model_id in self.models or model_id in self.creating:
            raise InvalidTinkerRequest(f"model {model_id!r} exists (model_seq_id reused)")

        def deploy() -> Deployment:
            deployment = runtime.deploy(model_id, spec)
            if lora is not None and self.banked:  # (its snapshots are loaded into a bank)
                deployment.share(self.bank_job, ops=("get_weights",))
            if restore is not None:
                try:
                    result(deployment.load_state(restore[0].saved, optimizer=restore[1]))
                except BaseException:
                    runtime.undeploy(deployment.name)
                    raise
            return deployment

        async def work() -> Reply:
            try:
                deployment = await self.blocking(deploy, tenant=tenant.name)
            finally:
                self.creating.pop(model_id, None)
            if session.session_id not in self.sessions:  # (it ended meanwhile: nothing is left)
                await self._undeploy(deployment)
                raise InvalidTinkerRequest(f"session {session.session_id!r} ended")
            self.models[model_id] = TrainModel(
                model_id, tenant.name, session.session_id, base, deployment, lora
            )
            self.runs[model_id] = run = Run(model_id, tenant.name, base, metadata, lora=lora)
            self._forget_old_runs(tenant.name)
            self.state.put("runs", model_id, dataclasses.asdict(run))
            session.models.append(model_id)
            out = {"model_id": model_id, "type": kind}
            if restore is not None:
                out["path"] = restore[0].path
            return json_reply(out)

        self.creating[model_id] = tenant.name
        try:
            return self.promise(tenant, kind, work())
        except BaseException:
            self.creating.pop(model_id, None)
            raise

    def run(self, tenant: Tenant, run_id: str) -> Run:
        return self._owned(self.runs, run_id, tenant, "training run")

    def get_info(self, tenant: Tenant, model_id: str) -> dict:
        model = self.model(tenant, model_id)
        return {
            "model_id": model_id,
            "model_data": {
                "arch": "qwen2",
                "model_name": model.base,
                "tokenizer_id": self.catalog[model.base].path,
            },
            "model_name": model.base,
            "is_lora": model.lora is not None,
            "lora_rank": 0 if model.lora is None else model.lora["rank"],
            "type": "get_info",
        }

    async def ordered(
        self,
        tenant: Tenant,
        model: TrainModel,
        seq_id: int,
        kind: str,
        submit: Callable[[], Any],
        reply: Callable[[Any], Reply],
    ) -> str:
        """Queue ``submit`` (it submits the PlexRL request and returns its future, or returns
        a value) as ``seq_id`` of ``model``; a promise whose reply is ``reply(result)``."""
        if seq_id in model.taken:
            if not model.taken[seq_id]:
                raise InvalidTinkerRequest(f"seq_id {seq_id} of {model.model_id} was refused")
            return model.taken[seq_id]  # (a retry of a request we have)
        if seq_id < model.next_seq:
            raise InvalidTinkerRequest(
                f"seq_id {seq_id} of {model.model_id} is past (next: {model.next_seq})"
            )
        submitted: asyncio.Future = asyncio.get_running_loop().create_future()

        async def work() -> Reply:
            value = await submitted
            if hasattr(value, "key") and hasattr(value, "client"):  # a Dask future
                value = await settled(value)
            if kind == "forward":  # (it computes the loss here: on a thread, not the loop)
                return await self.blocking(reply, value, tenant=tenant.name)
            return reply(value)

        request_id = self.promise(tenant, kind, work())
        model.taken[seq_id] = request_id
        model.waiting[seq_id] = (submit, submitted)
        await self._pump(model)
        return request_id

    def skip(self, model: TrainModel, seq_id: int) -> None:
        """Mark ``seq_id`` taken by a request refused before it was queued (the SDK moves on
        to the next one)."""
        if seq_id >= model.next_seq and seq_id not in model.taken:
            model.taken[seq_id] = ""
            model.waiting[seq_id] = (lambda: None, asyncio.get_running_loop().create_future())

    async def _pump(self, model: TrainModel) -> None:
        """Submit the model's queued requests whose turn it is, in seq_id order."""
        async with model.lock:
            while model.next_seq in model.waiting:
                submit, submitted = model.waiting.pop(model.next_seq)
                model.next_seq += 1
                try:
                    value = await self.blocking(submit, tenant=model.tenant)
                except Exception as e:  # (its promise fails; later requests go on)
                    if not submitted.done():
                        submitted.set_exception(e)
                    continue
                if not submitted.done():
                    submitted.set_result(value)
            if model.gap_check is not None:
                model.gap_check.cancel()
                model.gap_check = None
            if model.waiting:  # a seq_id is missing: do not wait for it forever
                loop = asyncio.get_running_loop()
                model.gap_check = loop.call_later(
                    self.gap_timeout, lambda: asyncio.ensure_future(self._skip_gap(model))
                )

    async def _skip_gap(self, model: TrainModel) -> None:
        if model.waiting and model.next_seq not in model.waiting:
            logger.warning(
                "%s: seq_id %d never arrived in %.0fs; going on without it",
                model.model_id,
                model.next_seq,
                self.gap_timeout,
            )
            model.next_seq = min(model.waiting)
            await self._pump(model)

    async def forward_backward(self, tenant: Tenant, body: bytes) -> str:
        model_id, seq_id, message = wire.parse_forward_backward(body)
        model = self.model(tenant, model_id)
        if model.taken.get(seq_id):
            return model.taken[seq_id]
        try:
            batch = wire.training_batch(message, lambda loss_id: self.custom_loss(model, loss_id))
        except Exception:  # (any refusal: the next seq_id must not wait for this one)
            self.skip(model, seq_id)
            raise
        dep = model.deployment
        if batch.forward_only:
            submit: Callable[[], Any] = lambda: dep.forward(batch.data)  # noqa: E731
            reply = self._forward_reply(batch)
        else:
            submit = lambda: dep.forward_backward(batch.data, batch.loss, logprobs=True)  # noqa: E731
            reply = self._backward_reply(batch)
        kind = "forward" if batch.forward_only else "forward_backward"
        return await self.ordered(tenant, model, seq_id, kind, submit, reply)

    @staticmethod
    def _backward_reply(batch: wire.TrainingBatch) -> Callable[[Any], Reply]:
        def reply(result: ForwardBackwardResult) -> Reply:
            metrics = _tinker_metrics(result.metrics)
            body = wire.forward_backward_output(result.logprobs, batch.targets, metrics)
            return 200, body, PROTO

        return reply

    @staticmethod
    def _forward_reply(batch: wire.TrainingBatch) -> Callable[[Any], Reply]:
        def reply(result: ForwardResult) -> Reply:
            # the loss at these log-probabilities, by the workers' own loss code (no gradient)

            width = max(len(d.tokens) for d in batch.data) - 1
            logp = torch.zeros(len(batch.data), width)
            valid = torch.zeros(len(batch.data), width)
            for i, lp in enumerate(result.logprobs):
                logp[i, : len(lp) - 1] = torch.tensor(lp[1:])
                valid[i, : len(lp) - 1] = 1.0
            value, metrics = compute_loss(batch.loss, batch.data, logp, valid)
            metrics = {**_tinker_metrics(metrics), "loss:sum": float(value)}
            body = wire.forward_backward_output(result.logprobs, batch.targets, metrics)
            return 200, body, PROTO

        return reply

    def custom_loss(self, model: TrainModel, loss_id: str) -> GraphLoss:
        """The custom loss ``loss_id`` of ``model``'s session (its clients made it)."""
        session = self.sessions.get(model.session_id)
        loss = None if session is None else session.losses.get(loss_id)
        if loss is None:
            raise UnknownObject(f"no custom loss {loss_id!r} in the session of {model.model_id}")
        return loss

    async def create_custom_loss(self, tenant: Tenant, body: dict) -> str:
        """``create_custom_loss``: the session's loss of a traced graph (checked against the
        allowed operations here, and again by each worker that runs it); a promise of its
        ``loss_id``. The same ``custom_loss_seq_id`` sent again gets the same id."""
        session = self.session(tenant, str(body.get("session_id")))
        if not self.custom_losses:
            raise UnsupportedCall("custom losses run in the SDK here (plexrl.serve.custom-losses)")
        n = wire.count(body.get("custom_loss_seq_id"), "custom_loss_seq_id")
        loss_id = f"{session.session_id}:loss:{n}"
        try:
            loss = GraphLoss.from_tinker(body.get("name"), body.get("inputs"), body.get("graph"))
            build(loss)  # (every name resolved through the allowed lists, now)
        except InvalidLoss as e:
            raise InvalidTinkerRequest(f"custom loss: {e}") from None
        known = session.losses.get(loss_id)
        if known is not None and known.key != loss.key:
            raise InvalidTinkerRequest(f"custom_loss_seq_id {n} is another loss's")
        limit = config.count(
            "plexrl.serve.custom-losses-per-tenant", config.get("serve.custom-losses-per-tenant")
        )
        mine = sum(len(s.losses) for s in self.sessions.values() if s.tenant == tenant.name)
        if known is None and mine >= limit:
            raise TenantLimitExceeded(
                f"tenant {tenant.name!r} has {limit} custom losses in its sessions "
                "(plexrl.serve.custom-losses-per-tenant)"
            )
        session.losses[loss_id] = loss

        async def made() -> Reply:
            return json_reply({"loss_id": loss_id, "type": "create_custom_loss"})

        return self.promise(tenant, "create_custom_loss", made())

    async def optim_step(self, tenant: Tenant, body: dict) -> str:
        model = self.model(tenant, str(body.get("model_id")))
        seq_id = wire.seq_id(body)
        try:
            params = wire.adam(body.get("adam_params") or {})
        except Exception:  # (any refusal: the next seq_id must not wait for this one)
            self.skip(model, seq_id)
            raise

        def submit() -> Any:
            self.snapshots.before_step(tenant, model)  # (their copies, saved before the step)
            model.optim_steps += 1
            return model.deployment.optim_step(params)

        def reply(metrics: dict) -> Reply:
            floats = {f"{k}:mean": float(v) for k, v in metrics.items() if _number(v)}
            return json_reply({"metrics": floats})

        return await self.ordered(tenant, model, seq_id, "optim_step", submit, reply)

    async def save_weights_for_sampler(self, tenant: Tenant, body: dict) -> str:
        model = self.model(tenant, str(body.get("model_id")))
        seq_id = wire.seq_id(body)
        name = body.get("path")
        if name is None:
            n = body.get("sampling_session_seq_id")
            if not isinstance(n, int):
                self.skip(model, seq_id)
                raise InvalidTinkerRequest("save_weights_for_sampler needs a path or a seq id")
            if model.taken.get(seq_id):
                return model.taken[seq_id]  # (a retry of a request we have)
            sampler_id = f"{model.session_id}:sample:{n}"
            # "inflight": the session follows the model's weights as it trains
            follows = body.get("kind") == "inflight"
            bank = None
            if model.lora is not None and self.banked and not follows:
                bank = await self.bank(model.base)
            try:
                self._reserve_sampler(tenant, sampler_id)
            except Exception:
                self.skip(model, seq_id)
                raise

            def submit() -> str:
                try:
                    if bank is not None:
                        return self._bank_snapshot(tenant, model, sampler_id, bank)
                    version = None if follows else model.optim_steps
                    sampler = Sampler(
                        sampler_id, tenant.name, model.base, model.deployment,
                        model_id=model.model_id, version=version,
                    )  # fmt: skip
                    self._add_sampler(tenant, sampler, model.session_id)
                    return sampler_id
                finally:
                    self._unreserve_sampler(sampler_id)  # (added, or failed)

            try:
                return await self.ordered(
                    tenant,
                    model,
                    seq_id,
                    "save_weights_for_sampler",
                    submit,
                    lambda sid: json_reply({"sampling_session_id": sid}),
                )
            except BaseException:
                self._unreserve_sampler(sampler_id)
                raise
        return await self._save(tenant, model, seq_id, "sampler_weights", body)

    def _forget_old_runs(self, tenant: str) -> None:
        """Keep a tenant's newest :data:`RUNS_KEPT` training runs, and every run with a live
        model or a saved checkpoint: the runs are kept in the state file, which is written
        whole on every change."""
        mine = [r for r in self.runs.values() if r.tenant == tenant]
        idle = [
            r.run_id
            for r in mine
            if r.run_id not in self.models and not self.saved.of_run(tenant, r.run_id)
        ]
        for run_id in idle[: max(0, len(mine) - RUNS_KEPT)]:  # (oldest first: insertion order)
            del self.runs[run_id]
            self.state.delete("runs", run_id)


#: A tenant's training runs kept without a live model or a saved checkpoint (the newest).
RUNS_KEPT = 256
#: Bytes of a training run's user_metadata (kept with the run in the state file).
METADATA_BYTES = 16 * 1024


def _metadata(raw: Any) -> dict[str, str]:
    """A run's ``user_metadata`` as strings, checked: an object of at most
    :data:`METADATA_BYTES` bytes (:class:`InvalidTinkerRequest` otherwise)."""
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise InvalidTinkerRequest(f"user_metadata is an object, got {type(raw).__name__}")
    metadata = {str(k): str(v) for k, v in raw.items()}
    size = sum(len(k) + len(v) for k, v in metadata.items())
    if size > METADATA_BYTES:
        raise InvalidTinkerRequest(
            f"user_metadata of {size} characters is past {METADATA_BYTES}: it is kept with "
            "the training run for good"
        )
    return metadata


async def _replying(work: Awaitable[Reply]) -> Reply:
    """``work``'s reply; a failure becomes the SDK's failed-request reply."""
    try:
        return await work
    except Exception as e:
        if not isinstance(e, PlexRLError):
            logger.exception("a Tinker request failed")
        return json_reply(error_body(e))


def _export_dir(state_file: str | os.PathLike[str] | None) -> str:
    """``plexrl.serve.export-dir``; else beside the state file; else a temporary directory."""
    configured = config.get("serve.export-dir")
    if configured:
        return str(configured)
    if state_file is not None:
        return f"{os.fspath(state_file)}.exports"
    return tempfile.mkdtemp(prefix="plexrl-exports-")


def _number(value: Any) -> bool:
    return isinstance(value, (int, float, np.floating, np.integer)) and not isinstance(value, bool)


def _tinker_metrics(metrics: dict[str, float]) -> dict[str, float]:
    """A PlexRL loss's metrics as Tinker's (``name:reduction``): the summed loss, the clip
    fraction of a clipped one, and a custom loss's own (already so named)."""
    out = {"loss:sum": float(metrics["loss"])}
    if "clip_fraction" in metrics:
        out["clip_fraction:mean"] = float(metrics["clip_fraction"])
    out.update((k, float(v)) for k, v in metrics.items() if k.startswith("custom/"))
    return out
