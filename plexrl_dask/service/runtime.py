"""The client-side router: ``Runtime`` and ``Deployment``.

A :class:`Runtime` wraps a ``distributed.Client`` and holds no deployment state of its own: the
registry lives on the scheduler, so a second driver with its own client and its own runtime sees
the same deployments. Every model call on a :class:`Deployment` is submitted as a task of
:mod:`plexrl_dask.ops` inside ``dask.annotate(plexrl={...})`` and returns a
``distributed.Future`` at once; the scheduler plugin routes it to the deployment's worker.

Requests of one deployment run in submission order (one GPU slot per worker, priorities stamped
at submission), so ``forward_backward`` followed by ``optim_step`` can be pipelined without
waiting in between.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

import dask
from distributed import Actor, Client, Future, get_client, wait

from plexrl_dask import config, ops
from plexrl_dask.errors import (
    InvalidLoss,
    InvalidModelSpec,
    InvalidOptimizerParams,
    InvalidSamplingParams,
    NoPlexRLWorkers,
    PlexRLError,
    RequestTimeout,
    raise_for_status,
)
from plexrl_dask.models.spec import ModelSpec
from plexrl_dask.service.holder import ReplicaHolder
from plexrl_dask.service.registry import DeploymentInfo
from plexrl_dask.service.types import (
    AdamWParams,
    CrossEntropy,
    Datum,
    Loss,
    NamedWeights,
    PolicyGradient,
    SamplingParams,
    as_batch,
)

logger = logging.getLogger(__name__)

_sequence_lock = threading.Lock()
_last_sequence = 0


def _submission_sequence() -> int:
    """A strictly increasing stamp (wall-clock microseconds) for each submitted request.

    Dask orders tasks by ``(-user_priority, generation, ...)`` and only bumps ``generation``
    every ``fifo_timeout``, so two requests submitted back to back could otherwise run in either
    order. Passing ``priority=-stamp`` makes every worker run PlexRL requests in submission
    order, across drivers too (up to their clock skew).
    """
    global _last_sequence
    with _sequence_lock:
        _last_sequence = max(time.time_ns() // 1000, _last_sequence + 1)
        return _last_sequence


def result(futures: Any, timeout: float | None = None) -> Any:
    """Wait for a future (or a list of them) with a timeout and return the result(s).

    Raises :class:`RequestTimeout` after ``timeout`` seconds (default
    ``plexrl.request.timeout``); a failed request raises its own (typed) error.
    """
    timeout = config.request_timeout() if timeout is None else timeout
    many = isinstance(futures, (list, tuple))
    items = list(futures) if many else [futures]
    try:
        wait(items, timeout=timeout)
    except TimeoutError as e:
        raise RequestTimeout(
            f"{sum(not f.done() for f in items)} PlexRL request(s) did not finish within "
            f"{timeout:.0f}s (plexrl.request.timeout)"
        ) from e
    values = [f.result() for f in items]
    return values if many else values[0]


class Runtime:
    """Stateless router from API calls to Dask futures (see the module docstring).

    ``job`` names the caller in every request's annotation (for scheduling, accounting and the
    dashboard); it defaults to a fresh id.
    """

    def __init__(self, client: Client | None = None, job: str | None = None):
        self.client = client if client is not None else get_client()
        self.job = job or f"job-{uuid.uuid4().hex[:8]}"

    def _call(self, handler: str, **kwargs: Any) -> dict[str, Any]:
        rpc = getattr(self.client.scheduler, handler)
        try:
            status = self.client.sync(rpc, **kwargs, callback_timeout=config.request_timeout())
        except TimeoutError as e:
            raise RequestTimeout(f"the scheduler did not answer {handler} in time") from e
        except (KeyError, AttributeError) as e:
            raise PlexRLError(
                f"the scheduler has no {handler!r} handler: install the PlexRL plugins "
                "(plexrl_dask.local_cluster(), plexrl_dask.install(client), or "
                "`dask scheduler --preload plexrl_dask.plugins`)"
            ) from e
        return raise_for_status(status)

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
    ) -> Deployment:
        """Register deployment ``name`` of ``model`` and place it on a worker.

        With ``wait`` (default) the replica is built on its worker before this returns, so a
        model that cannot be built there fails here (and is unregistered). With ``exist_ok``, an
        identical existing deployment is returned instead of raising ``DeploymentExists``.
        ``workers`` restricts placement to those worker addresses.
        """
        if not isinstance(model, ModelSpec):
            raise InvalidModelSpec(f"model must be a plexrl_dask.ModelSpec, got {type(model).__name__}")
        uid = uuid.uuid4().hex
        status = self._call(
            "plexrl_deploy",
            name=name,
            uid=uid,
            spec=model.to_dict(),
            role=role,
            backend=backend,
            owner=owner or self.job,
            memory_bytes=model.memory_bytes(role),
            exist_ok=exist_ok,
            candidates=None if workers is None else list(workers),
        )
        deployment = Deployment(self, DeploymentInfo.from_dict(status["deployment"]))
        if wait and status["created"]:
            try:
                result(deployment.load())
            except BaseException:
                self._call("plexrl_undeploy", name=name, uid=uid)
                raise
        return deployment

    def deployment(self, name: str) -> Deployment:
        """Look up an existing deployment by name (any job's)."""
        status = self._call("plexrl_get_deployment", name=name)
        return Deployment(self, DeploymentInfo.from_dict(status["deployment"]))

    def deployments(self) -> list[DeploymentInfo]:
        status = self._call("plexrl_list_deployments")
        return [DeploymentInfo.from_dict(d) for d in status["deployments"]]

    def undeploy(self, name: str) -> None:
        """Unregister ``name`` and free its replicas."""
        self._call("plexrl_undeploy", name=name)

    def status(self) -> dict[str, Any]:
        """The scheduler plugin's state: deployments, residency, worker capacity, counters."""
        return self._call("plexrl_status")

    def holder(self, worker: str) -> Actor:
        """The replica holder of ``worker`` as a Dask actor (``.status().result()``, ...)."""
        info = self.status()["workers"].get(worker)
        if info is None:
            raise NoPlexRLWorkers(f"{worker} has no PlexRL replica holder (yet)")
        return Actor(ReplicaHolder, worker, info["holder_key"])

    # --- weights between deployments ---------------------------------------------------------

    def sync_weights(self, src: Deployment | str, dst: Deployment | str) -> Future:
        """Copy ``src``'s current weights (and version) into ``dst``; the future's result is
        ``dst``'s new version. The weights move worker to worker, never through the client."""
        src = self.deployment(src) if isinstance(src, str) else src
        dst = self.deployment(dst) if isinstance(dst, str) else dst
        return dst.set_weights(src.get_weights())


class Deployment:
    """A handle on a registered deployment; every model call returns a ``Future``."""

    def __init__(self, runtime: Runtime, info: DeploymentInfo):
        self.runtime = runtime
        self.info = info
        self._tokenizer: Any = None

    @property
    def tokenizer(self) -> Any:
        """The deployment's tokenizer, built locally from its spec (on the driver)."""
        if self._tokenizer is None:
            self._tokenizer = self.info.spec.build_tokenizer()
        return self._tokenizer

    def tokenize(self, text: str) -> list[int]:
        """Token ids of ``text`` (no special tokens), as the replicas tokenize prompts."""
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    @property
    def name(self) -> str:
        return self.info.name

    def __repr__(self) -> str:
        return f"<Deployment {self.name!r} {self.info.role} {self.info.spec.name} on {list(self.info.workers)}>"

    def _submit(self, op: str, fn: Any, *args: Any, **kwargs: Any) -> Future:
        annotation = {"job": self.runtime.job, "deployment": self.name, "op": op, "ranks": 1}
        with dask.annotate(plexrl=annotation):
            return self.runtime.client.submit(
                fn,
                self.name,
                *args,
                key=f"plexrl-{op}-{self.name}-{uuid.uuid4().hex}",
                pure=False,
                priority=-_submission_sequence(),
                **kwargs,
            )

    def load(self) -> Future:
        """Make the replica resident on its worker; the result describes it."""
        return self._submit("load", ops.load)

    def forward(self, batch: Sequence[Datum] | Datum, temperature: float = 1.0) -> Future:
        """Future of a :class:`ForwardResult`: per-token log-probabilities."""
        return self._submit("forward", ops.forward, as_batch(batch), temperature)

    def forward_backward(self, batch: Sequence[Datum] | Datum, loss: Loss = CrossEntropy()) -> Future:
        """Future of the loss metrics; gradients accumulate until :meth:`optim_step`."""
        if not isinstance(loss, (CrossEntropy, PolicyGradient)):
            raise InvalidLoss(f"loss must be CrossEntropy or PolicyGradient, got {type(loss).__name__}")
        return self._submit("forward_backward", ops.forward_backward, as_batch(batch), loss)

    def optim_step(self, params: AdamWParams = AdamWParams()) -> Future:
        """Future of the step metrics (grad norm, new version)."""
        if not isinstance(params, AdamWParams):
            raise InvalidOptimizerParams(f"params must be AdamWParams, got {type(params).__name__}")
        return self._submit("optim_step", ops.optim_step, params)

    def sample(
        self,
        prompts: Sequence[str | Sequence[int]],
        params: SamplingParams = SamplingParams(),
        prompt_ids: Sequence[int] | None = None,
    ) -> Future:
        """Future of a :class:`SampleResult` (``params.n`` completions per prompt)."""
        if not isinstance(params, SamplingParams):
            raise InvalidSamplingParams(f"params must be SamplingParams, got {type(params).__name__}")
        if isinstance(prompts, str) or not prompts:
            raise InvalidSamplingParams("prompts must be a non-empty list of strings or token lists")
        if prompt_ids is not None and len(prompt_ids) != len(prompts):
            raise InvalidSamplingParams(f"{len(prompt_ids)} prompt_ids for {len(prompts)} prompts")
        return self._submit("sample", ops.sample, list(prompts), params, prompt_ids)

    def get_weights(self, names: Sequence[str] | None = None) -> Future:
        """Future of :class:`NamedWeights` (host tensors by canonical name + version)."""
        return self._submit("get_weights", ops.get_weights, names)

    def set_weights(
        self,
        weights: NamedWeights | Mapping[str, Any] | Future,
        version: int | None = None,
        strict: bool = True,
    ) -> Future:
        """Future of the new version. ``weights`` may be a future (e.g. another deployment's
        ``get_weights()``): Dask then moves the tensors between workers directly."""
        return self._submit("set_weights", ops.set_weights, weights, version, strict)

