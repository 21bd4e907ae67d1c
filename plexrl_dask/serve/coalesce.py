"""A sampler's concurrent ``sample`` calls merged into one PlexRL request.

Recipes sample many prompts at once as many one-prompt calls (tinker-cookbook's RL loop sends
a batch's groups together, each ``sample(prompt, num_samples=group_size)``). One request per
call decodes a handful of rows at a time, one call after another on the sampler's replica;
one request for all of them decodes them in one batch. Merging is safe for the results only
because the merged request decodes every row as if alone (``Deployment.sample(...,
invariant=True)``, :mod:`plexrl_dask.worker.row_decode`): a call's tokens are the same bits
whichever calls it was merged with, so they stay a pure function of the call (its prompt,
parameters and seed) however requests arrive.

**How calls are merged.** Calls with equal sampling parameters (all but the seed) join one
batch. A batch is sent after ``plexrl.serve.sample-merge-window`` (the calls of a burst arrive
over a few milliseconds) or at once when it reaches ``sample-merge-rows`` rows; while a
merged request of the sampler is in flight, calls wait for it to end and go together in the
next (the replica would queue them anyway). A call's seed becomes its prompt's id, so each
call keeps its own randomness (row keys are a hash of seed, prompt id and sample index:
:mod:`plexrl_dask.worker.sampling`); every request of a sampler, merged or not, is sent this
way.

**Adapter banks.** On an adapter bank (:mod:`plexrl_dask.worker.backends.adapters`) one
merger takes the calls of every sampler there, every tenant's: each call names its adapter
(or the base), and one request decodes them all, each prompt still sampling its own bits.

**Tenants share fairly.** At most ``IN_FLIGHT`` merged requests of one parameter set are in
flight; calls that arrive meanwhile wait in the server, and each next batch (at most
``sample-merge-rows`` rows) takes their calls round-robin over tenants, each tenant's in its
order. A tenant that floods a bank fills the batches only where no other tenant has a call
waiting: another tenant's call leaves in the next batch built after it arrives
(:attr:`SampleMerger.waited` counts the batches each tenant's calls waited, at most; 0 is
the next one).

**Failures stay the call's own.** A call the worker will refuse (a token past the vocabulary,
a prompt with no room for ``max_tokens``) is sent alone, so its typed error is its own; and if
a merged request fails anyway (an adapter unloaded meanwhile), each of its calls is sent
again alone and gets its own answer: one tenant's call never fails another's.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from dataclasses import dataclass, field
from typing import Any

from plexrl_dask import config
from plexrl_dask.driver.deployment import Deployment
from plexrl_dask.driver.waits import settled
from plexrl_dask.shared.types import SampleResult, SamplingParams

logger = logging.getLogger(__name__)


#: Merged requests of one parameter set in flight at once: one decoding, one queued behind it
#: on the worker (so the worker never waits on the server); the calls that arrive meanwhile
#: wait here, where the next batch is chosen fairly among tenants.
IN_FLIGHT = 2


@dataclass
class _Call:
    tokens: list[int]
    seed: int
    reply: asyncio.Future
    adapter: str | None = None
    tenant: str = ""
    arrived: int = 0  # merged batches sent before it arrived


@dataclass
class _Batch:
    calls: list[_Call] = field(default_factory=list)
    timer: asyncio.TimerHandle | None = None


def merge_settings() -> tuple[float, int]:
    """``plexrl.serve.sample-merge-window`` (seconds) and ``sample-merge-rows``;
    :class:`ConfigError` unless the window is >= 0 and the rows >= 1."""
    return (
        config.get_seconds("serve.sample-merge-window", positive=False),
        config.count("plexrl.serve.sample-merge-rows", config.get("serve.sample-merge-rows")),
    )


class SampleMerger:
    """Merges one sampler's calls (see the module docstring). Use from the server's event
    loop; :attr:`calls` and :attr:`requests` count what it received and sent."""

    def __init__(self, deployment: Deployment) -> None:
        #: per tenant, the most merged requests sent between one of its calls' arrival and
        #: the request that took it (0: the first sent after it arrived)
        self.waited: dict[str, int] = {}
        self.sent = 0  # merged batches sent
        self.deployment = deployment
        self.bank = deployment.info.backend == "adapters"
        self.window, self.max_rows = merge_settings()
        self._open: dict[SamplingParams, _Batch] = {}
        self._in_flight: dict[SamplingParams, int] = {}
        self._tasks: set[asyncio.Task] = set()
        self.calls = 0
        self.requests = 0

    def sample(
        self,
        tokens: list[int],
        params: SamplingParams,
        merge: bool = True,
        adapter: str | None = None,
        tenant: str = "",
    ) -> asyncio.Future:
        """A future of the call's :class:`SampleResult` (one prompt, ``params.n``
        completions). ``merge`` False: a request of its own, sent at once (a call the worker
        is expected to refuse). ``adapter``: on an adapter bank, the adapter the call samples
        with (None: the base); ``tenant``: whose call it is (batches are fair among them)."""
        loop = asyncio.get_running_loop()
        self.window, self.max_rows = merge_settings()  # (as configured now)
        key = dataclasses.replace(params, seed=0)
        reply = loop.create_future()
        call = _Call(list(tokens), params.seed, reply, adapter, tenant, self.sent)
        self.calls += 1
        if not merge:
            self._spawn(self._request(key, [call]))
            return reply
        batch = self._open.setdefault(key, _Batch())
        batch.calls.append(call)
        if len(batch.calls) * key.n >= self.max_rows:
            self._send(key)
        elif batch.timer is None and not self._in_flight.get(key):
            batch.timer = loop.call_later(self.window, self._send, key)
        return reply

    def _send(self, key: SamplingParams) -> None:
        """Send the next batch of ``key``'s waiting calls, unless ``IN_FLIGHT`` merged
        requests of it are in flight (the end of one sends it then)."""
        batch = self._open.get(key)
        if batch is None or not batch.calls or self._in_flight.get(key, 0) >= IN_FLIGHT:
            return
        if batch.timer is not None:
            batch.timer.cancel()
            batch.timer = None
        chosen, rest = _fair(batch.calls, max(1, self.max_rows // key.n))
        if rest:
            batch.calls = rest
        else:
            del self._open[key]
        for c in chosen:
            self.waited[c.tenant] = max(self.waited.get(c.tenant, 0), self.sent - c.arrived)
        self.sent += 1
        self._in_flight[key] = self._in_flight.get(key, 0) + 1
        self._spawn(self._run(key, chosen))

    def _spawn(self, work: Any) -> None:
        task = asyncio.ensure_future(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _run(self, key: SamplingParams, calls: list[_Call]) -> None:
        try:
            await self._request(key, calls)
        finally:
            self._in_flight[key] -= 1
            if not self._in_flight[key]:
                del self._in_flight[key]
            if key in self._open:
                self._send(key)  # the calls that waited for this request

    async def _request(self, key: SamplingParams, calls: list[_Call]) -> None:
        self.requests += 1
        try:
            adapters = [c.adapter for c in calls] if self.bank else None
            future = self.deployment.sample(
                [c.tokens for c in calls],
                key,
                [c.seed for c in calls],
                invariant=True,
                adapters=adapters,
            )
            result = await settled(future)
        except Exception as e:
            if len(calls) == 1:
                if not calls[0].reply.done():
                    calls[0].reply.set_exception(e)
                return
            logger.debug("a merged sample of %d calls failed (%s): each alone", len(calls), e)
            await asyncio.gather(*(self._request(key, [c]) for c in calls))
            return
        for c, group in zip(calls, result.sequences, strict=True):
            if not c.reply.done():
                c.reply.set_result(
                    SampleResult(prompt_tokens=(tuple(c.tokens),), sequences=(group,))
                )


def _fair(calls: list[_Call], most: int) -> tuple[list[_Call], list[_Call]]:
    """At most ``most`` of ``calls``, taken round-robin over their tenants (each tenant's in
    its order), and the rest in their order."""
    queues: dict[str, list[_Call]] = {}
    for c in calls:
        queues.setdefault(c.tenant, []).append(c)
    chosen: list[_Call] = []
    depth = 0
    while len(chosen) < most and any(len(q) > depth for q in queues.values()):
        for q in queues.values():
            if len(q) > depth and len(chosen) < most:
                chosen.append(q[depth])
        depth += 1
    taken = {id(c) for c in chosen}
    return chosen, [c for c in calls if id(c) not in taken]
