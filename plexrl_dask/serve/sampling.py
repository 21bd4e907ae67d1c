"""``plexrl serve``'s sampling sessions: making them (a training model's snapshot, a saved
checkpoint's replica, a base model's, or a slot in its adapter bank), retiring the ones a
training step superseded, and running their ``sample`` calls through a
:class:`~plexrl_dask.serve.coalesce.SampleMerger`.

:class:`SamplingSessions` is part of :class:`~plexrl_dask.serve.service.Service` (a base class
of it): its methods read and write the service's tables (``samplers``, ``retired``,
``sessions``, ``models``, ``mergers``) on the server's event loop, as the rest of the service
does (see :mod:`plexrl_dask.serve.service` for what a sampler is).
"""

from __future__ import annotations

import logging
import uuid
from typing import Any

from plexrl_dask.driver.deployment import Deployment
from plexrl_dask.driver.waits import settled
from plexrl_dask.errors import (
    AdapterNotFound,
    DeploymentLost,
    InvalidTinkerRequest,
    PlexRLError,
    SamplerSuperseded,
    TenantLimitExceeded,
    UnsupportedCall,
)
from plexrl_dask.serve import wire
from plexrl_dask.serve.coalesce import SampleMerger
from plexrl_dask.serve.records import (
    PROTO,
    Reply,
    Sampler,
    TrainModel,
)
from plexrl_dask.serve.snapshots import deploy_from, kept_limit
from plexrl_dask.serve.tenants import Tenant
from plexrl_dask.shared.checks import MAX_TOP_LOGPROBS
from plexrl_dask.shared.types import Datum

logger = logging.getLogger(__name__)

#: how many retired samplers are remembered (to say why one can no longer sample)
RETIRED_KEPT = 4096


class SamplingSessions:
    """The sampling half of :class:`~plexrl_dask.serve.service.Service` (see the module
    docstring)."""

    def _bank_snapshot(
        self, tenant: Tenant, model: TrainModel, sampler_id: str, bank: Deployment
    ) -> str:
        """A snapshot sampler of LoRA ``model`` on ``bank``: its adapter saved (weights only,
        in the model's request order) and loaded into the bank; the model's bank snapshots
        beyond the newest and ``kept-snapshots`` older ones are retired."""
        sampler = Sampler(
            sampler_id,
            tenant.name,
            model.base,
            bank,
            model_id=model.model_id,
            version=model.optim_steps,
            adapter=sampler_id,
        )
        self._add_sampler(tenant, sampler, model.session_id)  # (reserved before it was queued)
        store_model = f"tinker-{tenant.name}-snapshot-{uuid.uuid4().hex[:12]}"
        saved = model.deployment.save_state(model=store_model, weights_only=True)
        sampler.kept = self.snapshots.keep(saved, model)
        sampler.loading = bank.load_adapter(sampler_id, model.deployment.info.spec, saved)
        limit = kept_limit()
        mine = [
            s
            for s in list(self.samplers.values())
            if s.model_id == model.model_id and s.adapter is not None
        ]
        for old in mine[: max(0, len(mine) - 1 - limit)]:
            self.snapshots.retire(
                old,
                f"{old.sampler_id!r} sampled {old.model_id} as of optimizer step "
                f"{old.version}; only the newest snapshot and the last {limit} before it are "
                "kept (plexrl.serve.kept-snapshots): save the weights by name to keep a copy",
            )
        return sampler_id

    def _reserve_sampler(self, tenant: Tenant, sampler_id: str) -> None:
        """Hold ``sampler_id`` for ``tenant`` before anything is deployed or queued for it:
        refused if the id is taken (:class:`InvalidTinkerRequest`: its seq id reused) or the
        tenant is at its limit of samplers, counting those being made
        (:class:`TenantLimitExceeded`). A training model's snapshot samplers of earlier
        steps are retired first (a Tinker RL loop makes one every step; they can no longer
        sample and do not count); using one later is still :class:`SamplerSuperseded`.
        Release with :meth:`_add_sampler` or :meth:`_unreserve_sampler`."""
        with self.sampler_lock:  # (also taken on the executor's threads)
            for old in list(self.samplers.values()):
                why = self._superseded(old) if old.tenant == tenant.name else None
                if why is not None:
                    del self.samplers[old.sampler_id]
                    self.retired[old.sampler_id] = (tenant.name, why)
            while len(self.retired) > RETIRED_KEPT:
                del self.retired[next(iter(self.retired))]
            if sampler_id in self.samplers or sampler_id in self.reserved_samplers:
                raise InvalidTinkerRequest(f"sampling session {sampler_id!r} exists (seq id reused)")
            mine = sum(1 for s in self.samplers.values() if s.tenant == tenant.name)
            mine += sum(1 for owner in self.reserved_samplers.values() if owner == tenant.name)
            if mine >= tenant.limits.samplers:
                raise TenantLimitExceeded(
                    f"tenant {tenant.name!r} has {mine} sampling sessions (limit "
                    f"{tenant.limits.samplers}); end a session to free them"
                )
            self.reserved_samplers[sampler_id] = tenant.name

    def _unreserve_sampler(self, sampler_id: str) -> None:
        with self.sampler_lock:
            self.reserved_samplers.pop(sampler_id, None)

    def _add_sampler(self, tenant: Tenant, sampler: Sampler, session_id: str) -> None:
        """Register ``sampler``, reserved with :meth:`_reserve_sampler`, in its session;
        :class:`InvalidTinkerRequest` (and nothing registered) if the session ended
        meanwhile: what the caller made for it is the caller's to release."""
        with self.sampler_lock:
            self.reserved_samplers.pop(sampler.sampler_id, None)
            session = self.sessions.get(session_id)
            if session is None:
                raise InvalidTinkerRequest(f"session {session_id!r} ended")
            self.samplers[sampler.sampler_id] = sampler
            session.samplers.append(sampler.sampler_id)

    def _superseded(self, sampler: Sampler) -> str | None:
        """Why ``sampler`` can no longer sample (None: it can)."""
        if sampler.model_id is None or sampler.version is None or sampler.kept is not None:
            return None
        model = self.models.get(sampler.model_id)
        if model is None:
            return f"the training model of {sampler.sampler_id!r} has ended"
        if model.optim_steps == sampler.version:
            return None
        return (
            f"{sampler.sampler_id!r} samples {sampler.model_id} as of optimizer step "
            f"{sampler.version}; it has taken {model.optim_steps}. Save the weights for the "
            "sampler again, or save them by name to keep a copy to sample (a server with "
            "plexrl.serve.kept-snapshots > 0 keeps the last snapshot samplers' weights)"
        )

    # --- sampling --------------------------------------------------------------------------

    async def create_sampling_session(self, tenant: Tenant, body: dict) -> str:
        session = self.session(tenant, str(body.get("session_id")))
        n = wire.count(body.get("sampling_session_seq_id", 0), "sampling_session_seq_id")
        sampler_id = f"{session.session_id}:sample:{n}"
        path = body.get("model_path")
        path = None if path is None else str(path)
        base = None if path is not None else str(body.get("base_model"))
        made = self.samplers.get(sampler_id)
        if (
            made is not None
            and made.tenant == tenant.name
            and made.model_id is None
            and made.model_path == path
            and (path is not None or made.base == base)
        ):
            return sampler_id  # (a retry of a call that made it)
        runtime = await self.runtime(tenant)
        self._reserve_sampler(tenant, sampler_id)
        try:
            sampler = await self._make_sampler(tenant, runtime, sampler_id, path, base)
        except BaseException:
            self._unreserve_sampler(sampler_id)
            raise
        try:
            self._add_sampler(tenant, sampler, session.session_id)
        except InvalidTinkerRequest:
            if sampler.owned:  # (the session ended while its replica was made)
                await self.snapshots.release(sampler)
            raise
        return sampler_id

    async def _make_sampler(
        self, tenant: Tenant, runtime: Any, sampler_id: str, path: str | None, base: str | None
    ) -> Sampler:
        """The sampler ``create_sampling_session`` asks for: a replica of the saved
        checkpoint ``path`` of its own, else a slot of ``base``'s (its bank, or the tenant's
        replica of it)."""
        if path is not None:
            checkpoint = self.saved.loadable(tenant.name, path)
            spec = self.spec(checkpoint.base, checkpoint.lora)
            deployment = await self.blocking(
                deploy_from, runtime, f"{sampler_id}:rollout", spec, checkpoint.saved,
                tenant=tenant.name,
            )  # fmt: skip
            return Sampler(
                sampler_id, tenant.name, checkpoint.base, deployment, model_path=path, owned=True
            )
        assert base is not None
        spec = self.spec(base)
        if self.banked:
            deployment = await self.bank(base)
        else:
            deployment = await self.blocking(
                lambda: runtime.deploy(f"base:{base}", spec, role="rollout", exist_ok=True),
                tenant=tenant.name,
            )
        return Sampler(sampler_id, tenant.name, base, deployment)

    def describe_sampler(self, tenant: Tenant, sampler_id: str) -> dict:
        s = self.sampler(tenant, sampler_id)
        out = {"sampler_id": sampler_id, "base_model": s.base}
        if s.model_path is not None:
            out["model_path"] = s.model_path
        return out

    def sample(self, tenant: Tenant, body: dict) -> tuple[str, list[str]]:
        """Start a sample request; its request id and the ids of its sequences."""
        sampler_id = str(body.get("sampling_session_id"))
        retired = self.retired.get(sampler_id)
        if retired is not None and retired[0] == tenant.name:
            raise SamplerSuperseded(retired[1])
        sampler = self.sampler(tenant, sampler_id)
        why = self._superseded(sampler)
        if why is not None:
            raise SamplerSuperseded(why)
        for flag in ("topk_sample_logprobs", "prompt_alt_tokens_k"):
            if body.get(flag):
                raise UnsupportedCall(f"{flag} is not supported")
        top = body.get("topk_prompt_logprobs") or 0
        if isinstance(top, bool) or not isinstance(top, int) or not 0 <= top <= MAX_TOP_LOGPROBS:
            raise InvalidTinkerRequest(
                f"topk_prompt_logprobs is an int in [0, {MAX_TOP_LOGPROBS}], got {top!r}"
            )
        last_n = body.get("prompt_logprobs_last_n")
        tokens = wire.prompt_tokens(body.get("prompt"))
        if last_n is not None and (
            isinstance(last_n, bool) or not isinstance(last_n, int) or not 1 <= last_n < len(tokens)
        ):
            raise InvalidTinkerRequest(
                f"prompt_logprobs_last_n is an int in [1, {len(tokens) - 1}] (the prompt's "
                f"positions after the first), got {last_n!r}"
            )
        if body.get("target_prompt_logprobs") is not None or body.get("record_stability_info"):
            raise UnsupportedCall(
                "target_prompt_logprobs and record_stability_info are not supported"
            )
        seed = wire.derived_seed(tenant.name, sampler.sampler_id, body.get("seq_id"))
        eos = sampler.deployment.tokenizer.eos_token_id
        room = self.context(sampler.base) - len(tokens)
        params = wire.sampling_params(
            body.get("sampling_params"), body.get("num_samples", 1), eos, seed, room
        )
        want_prompt = bool(body.get("prompt_logprobs"))
        # A call the worker will refuse goes alone, so that it fails no other call.
        vocab = self._shape(sampler.base)[1]
        fits = room >= params.max_tokens and all(0 <= t < vocab for t in tokens)

        async def work() -> Reply:
            # (a snapshot kept past its model's step samples from its own copy)
            await self.snapshots.own_replica(tenant, sampler)
            dep = sampler.deployment
            if sampler.loading is not None:  # (its adapter's load into the bank)
                try:
                    await settled(sampler.loading)
                except PlexRLError:  # (lost with a worker, or the save it loads: again)
                    if not await self._reload_adapter(sampler):
                        raise
                sampler.loading = None  # (loaded: a bank that loses it raises AdapterNotFound)
            merger = self._merger(sampler)
            sampled = merger.sample(
                tokens, params, merge=fits, adapter=sampler.adapter, tenant=tenant.name
            )
            def score() -> Any:
                if (want_prompt or top) and len(tokens) > 1:
                    return dep.forward([Datum(tokens=tokens)], adapter=sampler.adapter, top=top)
                return None

            scored = score()
            try:
                result = await sampled
            except AdapterNotFound:
                if not await self._reload_adapter(sampler):
                    raise
                scored = score()  # (that one failed as the sample did)
                result = await merger.sample(
                    tokens, params, merge=fits, adapter=sampler.adapter, tenant=tenant.name
                )
            except DeploymentLost:  # (its own replica, with its worker: deployed again)
                if not await self.snapshots.redeploy(tenant, sampler, dep):
                    raise
                dep, merger = sampler.deployment, self._merger(sampler)
                scored = score()
                result = await merger.sample(
                    tokens, params, merge=fits, adapter=sampler.adapter, tenant=tenant.name
                )
            scores = await settled(scored) if scored is not None else None
            # (with prompt_logprobs_last_n, the positions before the last n are left empty)
            skip = len(tokens) - last_n if last_n is not None else 1
            prompt_lp = None
            if want_prompt:
                lp = scores.logprobs[0] if scores is not None else (0.0,)
                prompt_lp = [float("nan")] * skip + list(lp[skip:])
            prompt_top = scores.top[0] if scores is not None and top else None
            body = await self.blocking(  # (a long prompt's top k: off the event loop)
                wire.sample_output, result, prompt_lp, prompt_top, top, skip
            )
            return 200, body, PROTO

        request_id = self.promise(tenant, "sample", work())
        return request_id, [f"{request_id}:{i}" for i in range(params.n)]

    def _merger(self, sampler: Sampler) -> SampleMerger:
        """The merger of ``sampler``'s calls: its own, or its bank's (every sampler's there)."""
        dep = sampler.deployment
        if dep.info.backend == "adapters":
            if dep.name not in self.mergers:
                self.mergers[dep.name] = SampleMerger(dep)
            return self.mergers[dep.name]
        if sampler.merger is None:
            sampler.merger = SampleMerger(dep)
        return sampler.merger

    async def _reload_adapter(self, sampler: Sampler) -> bool:
        """Load a bank snapshot's adapter again from its saved state (the bank lost it with
        its worker); whether it could."""
        if sampler.adapter is None or sampler.kept is None:
            return False
        async with sampler.lock:
            saved = await sampler.kept.stored()
            spec = self.spec(sampler.base, sampler.kept.lora)
            logger.warning("reloading adapter %s into %s", sampler.adapter, sampler.deployment.name)
            key = sampler.adapter
            sampler.loading = await self.blocking(
                lambda: sampler.deployment.load_adapter(key, spec, saved)
            )
            await settled(sampler.loading)
            sampler.loading = None
        return True
