"""Snapshot samplers that outlive their training model's next step.

``save_weights_and_get_sampling_client`` gives a sampler of the training model's weights as
they are now. The server serves it from the training replica itself, which is free while the
model does not step; Tinker's contract is that the sampler keeps those weights after the
model trains on, and asynchronous recipes rely on it (tinker-cookbook's RL loop with
``max_steps_off_policy`` samples from clients of earlier steps while the model trains).

So before an ``optim_step`` changes a model whose snapshot samplers of the current step are
still live, the server saves those weights (a weights-only ``save_state`` to the node's
store, in the model's own request order, so it runs before the step on the replica; the
adapter alone for a LoRA model) and the samplers keep it. A kept sampler's first call after the step deploys a
rollout replica of its own from that copy (as a sampler of a named checkpoint is); calls
before that, and every sampler of the model's current weights, still use the training
replica. At most ``plexrl.serve.kept-snapshots`` kept samplers per training model: past that
the oldest is retired (its calls answer :class:`~plexrl_dask.errors.SamplerSuperseded`, its
replica is undeployed and its copy dropped); 0 keeps none (every earlier snapshot is
refused after the next step).

What it costs: a synchronous RL loop makes a sampler every step and never uses the last one
again, yet each of its steps saves the weights once (Tinker saves them for every such
sampler too) and never deploys the copy. The save is a store version of the parameters
alone on the node's NVMe tier (no optimizer state): ``kept_snapshots_step_ratio`` in
``benchmarks/RESULTS.md`` is ``bench.tinker``'s SDK step with it ÷ without it.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import uuid
from typing import TYPE_CHECKING, Any

from plexrl_dask import config
from plexrl_dask.driver.deployment import Deployment
from plexrl_dask.driver.runtime import Runtime
from plexrl_dask.driver.waits import result, settled
from plexrl_dask.errors import ConfigError, PlexRLError
from plexrl_dask.models.spec import ModelSpec
from plexrl_dask.serve.records import KeptCopy, Sampler, TrainModel
from plexrl_dask.serve.tenants import Tenant

if TYPE_CHECKING:
    from plexrl_dask.serve.service import Service

logger = logging.getLogger(__name__)


def deploy_from(runtime: Runtime, name: str, spec: ModelSpec, saved: dict) -> Deployment:
    """A rollout deployment ``name`` of ``spec`` loaded from ``saved`` (a ``save_state``
    result); undeployed again if the load fails."""
    dep = runtime.deploy(name, spec, role="rollout")
    try:
        result(dep.load_state(saved))
    except BaseException:
        runtime.undeploy(dep.name)
        raise
    return dep


def kept_limit() -> int:
    """``plexrl.serve.kept-snapshots``: an int >= 0."""
    value = config.get("serve.kept-snapshots")
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ConfigError(f"plexrl.serve.kept-snapshots must be an int >= 0, got {value!r}")
    return value


def _log_save_failure(done: concurrent.futures.Future) -> None:
    if not done.cancelled() and done.exception() is not None:
        logger.warning("a snapshot's copy was not saved: %r", done.exception())


def _log_failure(done: concurrent.futures.Future) -> None:
    if not done.cancelled() and done.exception() is not None:
        logger.warning("releasing a retired snapshot sampler failed: %r", done.exception())


class KeptSnapshots:
    """The server's kept snapshot samplers (see the module docstring)."""

    def __init__(self, service: Service) -> None:
        self.service = service

    def before_step(self, tenant: Tenant, model: TrainModel) -> None:
        """Called as ``model``'s next ``optim_step`` is submitted: its live snapshot samplers
        of the current step keep a copy of the weights, saved before the step runs."""
        limit = kept_limit()
        # (a copy: this runs on an executor thread while the event loop may change the table)
        samplers = list(self.service.samplers.values())
        live = [
            s
            for s in samplers
            if s.model_id == model.model_id and s.version == model.optim_steps and s.kept is None
        ]
        if not live or limit == 0:
            return
        store_model = f"tinker-{tenant.name}-snapshot-{uuid.uuid4().hex[:12]}"
        copy = self.keep(model.deployment.save_state(model=store_model, weights_only=True), model)
        for s in live:
            s.kept = copy
        kept = sorted(
            (s for s in samplers if s.model_id == model.model_id and s.kept),
            key=lambda s: s.version or 0,
        )
        for old in kept[: max(0, len(kept) - limit)]:
            self.retire(
                old,
                f"{old.sampler_id!r} sampled {old.model_id} as of optimizer step "
                f"{old.version}; only the last {limit} such samplers are kept "
                "(plexrl.serve.kept-snapshots): save the weights by name to keep a copy",
            )

    def keep(self, saved: Any, model: TrainModel) -> KeptCopy:
        """The copy of ``model``'s weights that the ``save_state`` future ``saved`` makes,
        its result fetched as soon as it is there (called on the server's executor threads)."""
        copy = KeptCopy(saved, model.lora)
        if self.service.loop is not None:
            done = asyncio.run_coroutine_threadsafe(copy.stored(), self.service.loop)
            done.add_done_callback(_log_save_failure)
        return copy

    async def redeploy(self, tenant: Tenant, sampler: Sampler, lost: Deployment) -> bool:
        """After its own replica ``lost`` was lost with its worker: ``sampler``'s replica
        deployed again from what it was made from (its checkpoint, or its kept copy), once
        for all the calls that found it lost; whether the sampler has one of its own."""
        if not sampler.owned:
            return False
        async with sampler.lock:
            if sampler.deployment is not lost:
                return True  # (another call deployed it again)
            if sampler.model_path is not None:
                checkpoint = self.service.saved.loadable(tenant.name, sampler.model_path)
                saved, lora = checkpoint.saved, checkpoint.lora
            elif sampler.kept is not None:
                saved, lora = await sampler.kept.stored(), sampler.kept.lora
            else:
                return False
            logger.warning("%s lost its replica; deploying it again", sampler.sampler_id)
            await self.service._undeploy(lost)
            runtime = await self.service.runtime(tenant)
            spec = self.service.spec(sampler.base, lora)
            sampler.deployment = await self.service.blocking(
                deploy_from, runtime, lost.name, spec, saved, tenant=tenant.name
            )
            sampler.merger = None
        return True

    def retire(self, sampler: Sampler, why: str) -> None:
        """Take ``sampler`` out of service (its calls answer ``why``) and free what it kept."""
        self.service.samplers.pop(sampler.sampler_id, None)
        self.service.retired[sampler.sampler_id] = (sampler.tenant, why)
        # (called where requests are submitted: the server's executor threads)
        if self.service.loop is not None:
            done = asyncio.run_coroutine_threadsafe(self.release(sampler), self.service.loop)
            done.add_done_callback(_log_failure)

    async def release(self, sampler: Sampler) -> None:
        """Undeploy a kept sampler's own replica (or unload its adapter from its bank) and
        drop its stored copy."""
        if sampler.owned:
            await self.service._undeploy(sampler.deployment)
        if sampler.adapter is not None:
            try:
                await settled(sampler.deployment.drop_adapter(sampler.adapter))
            except PlexRLError as e:  # (the bank lost it already: nothing to unload)
                logger.warning("unloading adapter %s: %s", sampler.adapter, e)
        if sampler.kept is None:
            return
        try:
            saved = await sampler.kept.stored()
        except PlexRLError:
            return  # (nothing was stored)
        if any(s.kept is sampler.kept for s in list(self.service.samplers.values())):
            return  # another sampler of that step still uses the copy
        await self.service.drop_version(saved)

    async def own_replica(self, tenant: Tenant, sampler: Sampler) -> None:
        """Before a kept sampler samples after its model stepped: its own rollout replica,
        deployed from its copy once."""
        model = self.service.models.get(sampler.model_id or "")
        if sampler.adapter is not None:
            return  # a snapshot in an adapter bank: a copy already
        if sampler.kept is None or (model is not None and model.optim_steps == sampler.version):
            return  # the training replica still holds its weights
        async with sampler.lock:
            if sampler.owned:
                return
            saved, lora = await sampler.kept.stored(), sampler.kept.lora
            runtime = await self.service.runtime(tenant)
            spec = self.service.spec(sampler.base, lora)
            name = f"{sampler.sampler_id}:rollout"
            sampler.deployment = await self.service.blocking(
                deploy_from, runtime, name, spec, saved, tenant=tenant.name
            )
            sampler.owned, sampler.merger = True, None
