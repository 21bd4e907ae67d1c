"""Typed errors of PlexRL.

Every error a user can cause has its own class here, and its message says what to fix.
Errors cross process boundaries two ways: as pickled exceptions on task futures (they are
plain exception classes with a single message argument, so they pickle), and as
``{"status": "error", "error": <class name>, "message": ...}`` dicts from scheduler handlers,
turned back into the class by :func:`from_status`.
"""

from __future__ import annotations


class PlexRLError(Exception):
    """Base class of every error raised by PlexRL."""


class ConfigError(PlexRLError, ValueError):
    """A configuration value or model specification is invalid."""


class InvalidModelSpec(ConfigError):
    """A :class:`~plexrl_dask.ModelSpec` cannot be built (bad sizes, missing path, ...)."""


# --- deployments -------------------------------------------------------------------------


class DeploymentError(PlexRLError):
    """Base class of errors about deployments."""


class _NotFound(KeyError):
    """A ``KeyError`` whose message reads as written (``KeyError`` would quote it)."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


class DeploymentNotFound(DeploymentError, _NotFound):
    """No deployment of that name is registered on the scheduler."""


class DeploymentExists(DeploymentError):
    """A deployment of that name is already registered."""


class DeploymentDoesNotFit(DeploymentError):
    """No worker of the cluster has the memory budget the deployment needs."""


class NoPlexRLWorkers(DeploymentError):
    """The cluster has no worker advertising the PlexRL GPU resource with a replica holder."""


class DeploymentLost(DeploymentError):
    """The worker that held a deployment's trained state died; the state is gone."""


class BackendUnavailable(DeploymentError):
    """The deployment's backend cannot run on its worker (vLLM without CUDA or without the
    ``vllm`` package, a worker process not allowed children, ...)."""


class LifecycleError(DeploymentError):
    """A deployment was asked to move to a lifecycle state it cannot reach from its own (e.g.
    relocating a deployment that is lost)."""


class DeploymentBusy(DeploymentError):
    """The deployment has requests in flight; the action needs it idle (relocation)."""


class DeploymentRelocating(DeploymentError):
    """The deployment is moving to its job's node group: only restoring its state is allowed
    until the move completes."""


class RelocationFailed(DeploymentError):
    """A relocated deployment's state could not be restored in its new place; the message
    names the checkpoint that holds it."""


# --- requests ----------------------------------------------------------------------------


class RequestError(PlexRLError):
    """Base class of errors about one request's input."""


class InvalidBatch(RequestError, ValueError):
    """A forward / forward_backward batch is malformed."""


class EmptyBatch(InvalidBatch):
    """A batch has no sequences, or a sequence has no tokens to score."""


class TokenOutOfVocabulary(InvalidBatch):
    """A token id is negative or not below the model's vocabulary size."""


class SequenceTooLong(InvalidBatch):
    """A sequence (prompt + generated tokens) exceeds the model's maximum positions."""


class MismatchedLengths(InvalidBatch):
    """A per-token field (weights, advantages, logprobs) does not match the tokens' length."""


class InvalidSamplingParams(RequestError, ValueError):
    """Sampling parameters are out of range."""


class NoChatTemplate(InvalidSamplingParams):
    """A chat prompt (:class:`~plexrl_dask.Chat`) for a model whose tokenizer has no chat
    template: give its text or token ids instead."""


class RequestTooLarge(RequestError, ValueError):
    """A request has more rows (sequences to score or train on, prompts × samples to
    decode) than ``plexrl.quotas.max-request-rows``."""


class DeviceOutOfMemory(RequestTooLarge):
    """A request ran out of its device's memory. The replica is intact and keeps serving; a
    training request's pending gradients (of this call and the ``forward_backward`` calls
    since the last step) are dropped: send it again in smaller batches."""


class InvalidLoss(RequestError, ValueError):
    """A loss specification is invalid or lacks the inputs it needs."""


class InvalidOptimizerParams(RequestError, ValueError):
    """Optimizer hyperparameters are out of range."""


class InvalidRecipe(RequestError, ValueError):
    """A scored training request's recipe (task, GRPO config, problems, step) or the samples
    it scores do not fit together (:mod:`plexrl_dask.rl.scoring`)."""


class NonFiniteLoss(RequestError, FloatingPointError):
    """The loss is NaN or infinite; no gradient was accumulated."""


class NonFiniteGradient(RequestError, FloatingPointError):
    """The accumulated gradient is NaN or infinite; parameters were not updated."""


class WeightsMismatch(RequestError, ValueError):
    """``set_weights`` got names, shapes or dtypes that do not match the model."""


class CheckpointError(RequestError):
    """Base class of checkpoint (save_state / load_state) errors."""


class CheckpointNotFound(CheckpointError, FileNotFoundError):
    """No checkpoint at that path."""


class CheckpointIncomplete(CheckpointError):
    """The checkpoint was not finished (its writer died or is still writing)."""


class CheckpointIncompatible(CheckpointError):
    """The checkpoint holds a different model (parameter names or shapes differ)."""


class CheckpointCorrupt(CheckpointError):
    """A checkpoint's files differ from what was written (a DCP export's digests): refused
    before any of it is read."""


class EngineFailed(RequestError):
    """A rollout engine (vLLM) failed a call or did not finish it in time; the replica's
    engine was stopped, so the deployment must be deployed again."""


class OpNotSupported(RequestError):
    """The deployment's role or layout does not offer this operation."""


class AdapterNotFound(RequestError, _NotFound):
    """A request named a LoRA adapter its adapter bank does not hold (never loaded, dropped,
    or lost with the bank's worker: load it again from its stored version)."""


class RankLost(PlexRLError):
    """A rank of a multi-rank request lost its worker or failed; the whole request failed."""


class GroupTimeout(PlexRLError, TimeoutError):
    """The ranks of a worker process group did not meet (rendezvous or collective) in time."""


class RequestTimeout(PlexRLError, TimeoutError):
    """A request did not finish within the configured timeout."""


class StateStoreError(PlexRLError):
    """The state store refused or failed an operation; stored versions are left intact."""


class NotAStore(StateStoreError):
    """A path that is not a PlexRL state store (and was not asked to become one)."""


class InvalidStateKey(StateStoreError, ValueError):
    """A model, version or tensor name (or dtype) the store cannot use."""


class VersionNotFound(StateStoreError, _NotFound):
    """No published version of that model (and number) in the store."""


class TensorNotFound(StateStoreError, _NotFound):
    """The version has no tensor of that name."""


class StateMismatch(StateStoreError, ValueError):
    """A tensor's shape, dtype or region does not match what is stored or expected."""


class CorruptState(StateStoreError):
    """Stored bytes do not match their content digest: never returned as weights."""


class TierFull(StateStoreError):
    """A tier has no room for the bytes to be written (nothing already stored was touched)."""


class VersionConflict(StateStoreError):
    """A version was published with other content than the one being published now."""


class PublishIncomplete(StateStoreError):
    """A publish lacks parts or chunks: the version did not become visible."""


class StoreBusy(StateStoreError, TimeoutError):
    """A store's collection lock stayed taken past its bound (nothing was changed)."""


class TierNotPrivate(StateStoreError):
    """A node tier's directory belongs to another user: its files would be theirs to read
    and change, so this user's StateManager does not use it."""


class TierInUse(StateStoreError):
    """A tier path is owned by another node's StateManager (its lease is live): two nodes must
    never share one NVMe tier, whose placement and eviction assume a single owner."""


class ManagerUnavailable(StateStoreError):
    """The node's StateManager could not be reached or started within its timeout."""


# --- placement (spatiotemporal policy, simulator) ---------------------------------------


class PlacementError(PlexRLError):
    """Base class of errors of the spatiotemporal placement and the simulator."""


class InvalidTrace(PlacementError, ValueError):
    """A demand trace, horizon or workload specification is malformed."""


class ReservationConflict(PlacementError):
    """A reservation does not fit its node group in every slot: nothing was reserved."""


class JobNotPlaced(PlacementError, _NotFound):
    """The placement policy has no job of that name (or it is not in the needed state)."""


class JobDoesNotFit(PlacementError):
    """A job needs more GPUs at once than the whole cluster has: it can never run."""


class PermissionDenied(PlexRLError):
    """A job asked for something that is another job's: a request or a change to a deployment
    it does not own and was not shared with it (``Deployment.share``)."""


class QuotaExceeded(PlexRLError):
    """A job asked for more than its share of the cluster (``plexrl.quotas.*``): deployments,
    or requests waiting at once. What it already has is untouched."""


class PluginsNotInstalled(PlexRLError):
    """The scheduler has no PlexRL handlers: the plugins were never installed on it."""


class SchedulerBusy(PlexRLError):
    """A change that needs an idle PlexRL queue (e.g. the dispatch policy) while requests wait."""


class BatchJobRefused(PlexRLError):
    """The batch system (SLURM) refuses the worker jobs: an unknown partition or account, a
    request over a limit; the message is the batch system's."""


class WorkersNotStarted(PlexRLError, TimeoutError):
    """The workers a cluster asked for did not join within the wait (their jobs pend, or
    never started); the message names the jobs' states."""


class SchedulerNotStarted(PlexRLError):
    """A ``dask scheduler`` process (:func:`plexrl_dask.cluster.scheduler_process`) exited or
    did not serve within its timeout."""


class JobStopped(PlexRLError):
    """A job was asked to stop (:meth:`GRPOJob.stop`: its driver was interrupted, or
    ``run_jobs`` timed out) and stopped between two steps; its last checkpoint, if it has
    checkpoints, stands."""


class InvalidJobReport(PlexRLError, ValueError):
    """A job's per-step report (``plexrl-job`` event, :mod:`plexrl_dask.dashboard.jobs`) is
    malformed: a missing or mistyped field, a negative step, a non-finite reward."""


class InvalidDashboardQuery(PlexRLError, ValueError):
    """A query parameter of a PlexRL dashboard JSON route is malformed (answered with 400)."""


class BrowserUnavailable(PlexRLError):
    """The headless browser the dashboard tests and benchmark drive (Chromium, its driver,
    selenium) is not installed."""


_BY_NAME: dict[str, type[PlexRLError]] = {}


def _collect(cls: type[PlexRLError]) -> None:
    _BY_NAME[cls.__name__] = cls
    for sub in cls.__subclasses__():
        _collect(sub)


_collect(PlexRLError)


def to_status(exc: PlexRLError) -> dict[str, str]:
    """Encode a PlexRL error as a handler status dict."""
    return {"status": "error", "error": type(exc).__name__, "message": str(exc)}


def from_status(status: dict) -> PlexRLError:
    """Decode a handler status dict produced by :func:`to_status` into the error."""
    cls = _BY_NAME.get(status.get("error", ""), PlexRLError)
    return cls(status.get("message", "unknown PlexRL error"))


def raise_for_status(status: dict) -> dict:
    """Return ``status`` if it is OK, else raise the error it carries."""
    if status.get("status") != "OK":
        raise from_status(status)
    return status


class SchedulerLost(PlexRLError):
    """The scheduler went away (its process died or restarted) while this driver waited on
    it: requests in flight were cancelled. A scheduler started again on its journal
    (``plexrl.scheduler.journal``) has the deployments again; ``runtime.wait_for_scheduler()``
    waits for it, and a ``GRPOJob`` with checkpoints goes back to its last one by itself."""


class ToolError(PlexRLError):
    """A tool call of an agentic episode failed: it did not parse, its program failed or ran
    past a limit, or the worker running it died. An episode turns it into the turn's
    observation (``<out>error: ...</out>``) and goes on."""


class InvalidToolCall(ToolError, ValueError):
    """A tool call names no known tool, or its input is not what the tool takes."""


class ToolLimitExceeded(ToolError):
    """A tool ran past its wall-clock time, CPU time, memory or output limit."""


class ToolWorkerLost(ToolError):
    """The worker running a tool call died or left before the call returned."""


class NotRouted(RequestError):
    """A PlexRL op ran as a task that the PlexRL scheduler plugin did not route."""


# --- the Tinker front door (plexrl serve) --------------------------------------------------


class ServeError(PlexRLError):
    """Base class of the errors of ``plexrl serve``, the Tinker-compatible HTTP server."""


class Unauthenticated(ServeError):
    """A call to ``plexrl serve`` without an API key, or with one that no tenant holds."""


class UnknownObject(ServeError, _NotFound):
    """A session, model, sampler, request or checkpoint id that this tenant does not have
    (another tenant's looks the same: unknown)."""


class InvalidTinkerRequest(ServeError, ValueError):
    """A Tinker request whose body does not parse or does not follow the protocol (a
    malformed protobuf, a missing field, tensors of the wrong shape)."""


class UnsupportedCall(ServeError):
    """A Tinker call, loss or option that ``plexrl serve`` does not implement (yet); the
    message names what it does support."""


class TenantLimitExceeded(QuotaExceeded, ServeError):
    """A tenant of ``plexrl serve`` asked past its limits (models, requests waiting at once,
    bytes of one request); what it already has is untouched."""


class TenantBusy(TenantLimitExceeded):
    """A tenant of ``plexrl serve`` has as many requests waiting as its limit allows: retry
    once some have finished (HTTP 429, which the Tinker SDK retries by itself)."""


class SamplerSuperseded(ServeError):
    """A sampling session made from a training model's current weights was used after that
    model took a later optimizer step (its weights are no longer the session's)."""


_collect(PlexRLError)
