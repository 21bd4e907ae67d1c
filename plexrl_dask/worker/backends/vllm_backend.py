"""The vLLM backend: a rollout replica served by vLLM's offline engine on one GPU.

``deploy(name, spec, role="rollout", backend="vllm")`` puts it behind the same holder, scheduler
and runtime as the torch backend. What it does, against vLLM's public API (written for vLLM
0.34; see ``benchmarks/RESULTS.md`` for where it has run):

- **Engine.** One ``vllm.LLM`` per replica, built from the spec's checkpoint directory (a tiny
  spec is written out as one first, :meth:`ModelSpec.save_pretrained`), with sleep mode on,
  ``logprobs_mode="processed_logprobs"`` (log-probabilities of the distribution sampled from),
  a fixed KV cache (``plexrl.vllm.kv-cache-memory``: engines of several deployments share one
  GPU's budget), a memory request of exactly the replica's budget (``gpu_memory_utilization``
  = :meth:`state_bytes` ÷ the GPU's memory: vLLM refuses to start unless that much is free),
  the longest context that KV cache holds (``max_model_len=-1``) and at most
  ``max_batch_size`` sequences at a time. vLLM's engine core runs in a process of its own
  (forced: ``VLLM_ENABLE_V1_MULTIPROCESSING=1``), so every replica's device memory, and its
  sleep, is its own (in one process, vLLM's sleep-mode allocator is shared, and sleeping one
  engine would offload them all); the Dask worker process must therefore be allowed children.
- **Every engine call is bounded** (``plexrl.vllm.call-timeout``; vLLM's own ``timeout`` is not
  enforced by its single-GPU executor, and its client waits for the engine without one): a
  call runs on a daemon thread and is waited for with that timeout. A call that times out
  (:class:`RequestTimeout`) or fails (:class:`EngineFailed`; vLLM refusing a request's input
  is :class:`InvalidSamplingParams` instead) may leave the engine half-way through a weight
  load or a sleep, so the engine is stopped: the replica answers :class:`EngineFailed`, holds
  no device memory, and must be undeployed and deployed again. Starting the engine is bounded
  by vLLM's own start-up timeout (``VLLM_ENGINE_READY_TIMEOUT_S``); a failed start is
  :class:`BackendUnavailable`.
- **Sampling.** Each (prompt, sample) row is one vLLM request with ``n=1`` and a seed derived
  from ``(seed, prompt id, sample index)`` (:func:`row_seeds`, the same hash the torch backend
  keys its draws with), so a row's randomness never depends on the worker, the batch or how a
  request was split. With ``plexrl.vllm.batch-invariant`` (the default) vLLM's batch-invariant
  kernels make the row's logits independent of its batch too. Rows are not bit-identical to
  the torch backend's: the engines draw differently from the same seed, and compute with other
  kernels. ``top_p < 1`` or ``top_k > 0`` is refused: vLLM's processed log-probabilities are then those of the
  truncated distribution, where this project's contract (:class:`SampledSequence`) is the
  distribution before truncation, which the GRPO importance ratio relies on.
- **Weights.** A published version is loaded by the engine process itself, straight from the
  node's store tier (``collective_rpc`` with a function of this module and the store's path,
  the model and the version; vLLM's worker ``reload_weights`` takes checkpoint-format names and
  fuses q/k/v and gate/up as it does at load time; names the model does not have are refused
  before, as vLLM's loader would fail on them inside the engine); ``set_weights`` sends the
  tensors as one safetensors blob to a function that hands them to the same ``reload_weights``
  (vLLM's message encoding would deliver raw tensors as lists), and takes every parameter or
  none (vLLM rebuilds each layer it is given from zeros, so part of a fused layer would zero
  the rest of it). Either way the
  prefix cache is reset, since it holds keys and values computed with the old weights.
  ``get_weights`` is refused: vLLM holds the weights in its fused layout, and the canonical ones
  are in the trainer deployment and the store.
- **Residency.** ``offload`` is ``sleep(level=1)``: vLLM copies the weights to pinned host
  memory of its engine process and frees the GPU's; ``reload`` is ``wake_up()``. That host copy
  is the engine's own (kept after waking too), so the node's tiers (deduplication, eviction to
  NVMe, their accounting) do not hold a vLLM replica's offloaded weights (``stashes`` is
  False). A sleeping engine still holds its process's CUDA context on the GPU.
- **Temperatures** outside vLLM's range (above 2, or below 0.01 but not 0, which it would
  silently raise to 0.01) are refused, since the log-probabilities would not be at the
  requested temperature.

Only rollout: the training ops raise :class:`OpNotSupported`. It needs CUDA and the ``vllm``
package on the worker, and raises :class:`BackendUnavailable` (which fails the deploy) where
either is missing. Tests: ``tests/test_gpu.py`` (skipped without both) and the pure parts in
``tests/test_vllm_backend.py``.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import shutil
import tempfile
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from dask.utils import parse_bytes

from plexrl_dask import config
from plexrl_dask.errors import (
    BackendUnavailable,
    CheckpointError,
    ConfigError,
    EmptyBatch,
    EngineFailed,
    InvalidSamplingParams,
    OpNotSupported,
    RequestError,
    RequestTimeout,
    WeightsMismatch,
)
from plexrl_dask.models.build import hf
from plexrl_dask.models.spec import ModelSpec
from plexrl_dask.models.tokenizer import encode_prompts
from plexrl_dask.shared.types import SampledSequence, SamplingParams, Streams, check_tokens
from plexrl_dask.worker import replica_checkpoint
from plexrl_dask.worker.backends.base import NotATrainer, check_weights
from plexrl_dask.worker.replica_checkpoint import StoreCheckpoint
from plexrl_dask.worker.sampling import row_keys

logger = logging.getLogger(__name__)

#: What a deployment whose engine was stopped needs (same name: a new incarnation).
RECOVER = "undeploy it (runtime.undeploy(name)) and deploy it again"


@dataclass(frozen=True)
class VLLMConfig:
    """How a vLLM replica runs (``plexrl.vllm.*``). A deployment's budget is computed from the
    deploying client's configuration and the replica's from its worker's: keep them equal."""

    kv_cache_bytes: int
    overhead_bytes: int
    enforce_eager: bool
    batch_invariant: bool
    call_timeout_s: float

    def __post_init__(self) -> None:
        if self.kv_cache_bytes <= 0 or self.overhead_bytes < 0:
            raise ConfigError(
                "plexrl.vllm.kv-cache-memory must be > 0 and plexrl.vllm.overhead-memory >= 0, "
                f"got {self.kv_cache_bytes} and {self.overhead_bytes} bytes"
            )
        for name in ("enforce_eager", "batch_invariant"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(
                    f"plexrl.vllm.{name.replace('_', '-')} must be true or false, "
                    f"got {getattr(self, name)!r}"
                )

    @classmethod
    def from_dask_config(cls) -> VLLMConfig:
        try:
            return cls(
                kv_cache_bytes=int(parse_bytes(config.get("vllm.kv-cache-memory"))),
                overhead_bytes=int(parse_bytes(config.get("vllm.overhead-memory"))),
                enforce_eager=config.get("vllm.enforce-eager"),  # type: ignore[arg-type]
                batch_invariant=config.get("vllm.batch-invariant"),  # type: ignore[arg-type]
                call_timeout_s=config.get_seconds("vllm.call-timeout"),
            )
        except (TypeError, ValueError) as e:
            if isinstance(e, ConfigError):
                raise
            raise ConfigError(f"invalid plexrl.vllm setting: {e}") from e

    def device_bytes(self, weight_bytes: int) -> int:
        """Device memory one replica holds while awake: weights, KV cache and overhead."""
        return int(weight_bytes) + self.kv_cache_bytes + self.overhead_bytes


def unavailable_reason(device: str | torch.device) -> str | None:
    """Why a vLLM replica cannot run on ``device`` in this process, or None if it can."""
    if torch.device(device).type != "cuda":
        return f"vLLM runs on CUDA devices only; this worker's device is {device}"
    try:
        import vllm  # noqa: F401
    except ImportError as e:
        return f"the vllm package is not importable on this worker ({e})"
    if multiprocessing.current_process().daemon:
        return (
            "vLLM starts its engine in a child process, and this worker's process is daemonic "
            "(daemonic processes may not have children): run the workers with "
            "`distributed.worker.daemon: false`"
        )
    return None


def row_seeds(seed: int, prompt_ids: Sequence[int], n: int) -> list[list[int]]:
    """The vLLM seed of each (prompt, sample) row: ``seeds[i][j]`` for sample ``j`` of prompt
    ``i``. The torch backend's row hash (:func:`~plexrl_dask.worker.sampling.row_keys`) of
    ``(seed, prompt id, sample index)``, cut to 63 bits: a pure function of the row, so a row
    draws the same randomness on any worker and in any split of its request."""
    pids = np.repeat(np.asarray(prompt_ids, dtype=np.int64), n).astype(np.uint64)
    sids = np.tile(np.arange(n, dtype=np.uint64), len(prompt_ids))
    keys = row_keys(int(seed), pids, sids) >> np.uint64(1)
    flat = [int(k) for k in keys]
    return [flat[i * n : (i + 1) * n] for i in range(len(prompt_ids))]


def to_sequence(
    token_ids: Sequence[int],
    logprobs: Sequence[Mapping[int, Any]] | None,
    finish_reason: str | None,
    text: Callable[[Sequence[int]], str],
) -> SampledSequence:
    """One of vLLM's completions (its token ids, per-position log-probability dicts keyed by
    token id with ``.logprob`` values, and finish reason) as a :class:`SampledSequence`; the
    text is ``text(tokens)``, as the torch backend decodes it. :class:`RequestError` for a
    completion vLLM aborted or returned without the sampled tokens' log-probabilities."""
    tokens = tuple(int(t) for t in token_ids)
    if finish_reason not in ("stop", "length"):
        raise RequestError(
            f"vLLM ended a completion with {finish_reason!r} after {len(tokens)} tokens"
        )
    if logprobs is None or len(logprobs) != len(tokens):
        raise RequestError(
            f"vLLM returned {0 if logprobs is None else len(logprobs)} log-probabilities for "
            f"{len(tokens)} tokens"
        )
    values = []
    for t, position in zip(tokens, logprobs, strict=True):
        entry = position.get(t)
        if entry is None:
            raise RequestError(f"vLLM returned no log-probability for the sampled token {t}")
        values.append(float(getattr(entry, "logprob", entry)))
    return SampledSequence(tokens, tuple(values), text(tokens), finish_reason)


# --- run inside vLLM's engine process (collective_rpc: the first argument is its worker) ----


def _reload_from_store(worker: Any, root: str, model: str, version: int) -> int:
    """Read every parameter of version ``version`` of ``model`` from the store at ``root``
    and hand them to the worker's model by canonical name. Returns how many."""
    from plexrl_dask.state_store.store import StateStore

    store = StateStore(root)
    keys = [k for k in store.manifest(model, version).tensors if k.startswith("model/")]
    tensors = store.read_many(model, version, dict.fromkeys(keys))
    worker.reload_weights(
        weights_iterator=((k.removeprefix("model/"), t) for k, t in tensors.items()),
        is_checkpoint_format=True,
    )
    return len(keys)


def _reload_from_bytes(worker: Any, blob: bytes) -> int:
    """Hand the tensors of a safetensors ``blob`` to the worker's model by canonical name."""
    from safetensors.torch import load

    tensors = load(blob)
    worker.reload_weights(weights_iterator=iter(tensors.items()), is_checkpoint_format=True)
    return len(tensors)


class VLLMBackend(NotATrainer):
    """A rollout replica of ``spec`` served by vLLM on ``device`` (see the module docstring)."""

    #: The holder keeps an offloaded replica's state in the node's tiers only for backends
    #: that hand it their host state; vLLM keeps its own host copy while asleep.
    stashes = False

    def __init__(self, spec: ModelSpec, device: str | torch.device, max_batch_size: int = 64):
        reason = unavailable_reason(device)
        if reason is not None:
            raise BackendUnavailable(f"cannot run a vLLM replica of {spec.name}: {reason}")
        self.spec = spec
        self.device = torch.device(device)
        if self.device.index not in (None, 0):
            raise BackendUnavailable(
                f"vLLM runs on the worker's first visible GPU; {self.device} is not it (run one "
                "worker per GPU, each seeing its own)"
            )
        self.max_batch_size = int(max_batch_size)
        self.cfg = VLLMConfig.from_dask_config()
        self.tokenizer = spec.build_tokenizer()
        # Canonical parameter names and shapes, without memory: what published weights and
        # set_weights are checked against before anything reaches the engine.
        with torch.device("meta"):
            self._reference = hf("AutoModelForCausalLM").from_config(spec.hf_config())
        self.vocab_size = int(self._reference.config.vocab_size)
        self._weight_bytes = spec.memory_bytes("rollout")
        total = torch.cuda.get_device_properties(self.device).total_memory
        if self.state_bytes() > total:
            raise BackendUnavailable(
                f"a vLLM replica of {spec.name} needs {self.state_bytes() / 2**30:.1f} GiB "
                f"(weights, plexrl.vllm.kv-cache-memory and overhead-memory), more than the "
                f"GPU's {total / 2**30:.1f} GiB"
            )
        self._failed: str | None = None  # why the engine was stopped, once it was
        self._tmpdir: str | None = None
        try:
            path = spec.path
            if path is None:  # a config-built model: vLLM loads checkpoints, so write one
                self._tmpdir = tempfile.mkdtemp(prefix="plexrl-vllm-")
                path = spec.save_pretrained(self._tmpdir).path
            # Read by vLLM when it starts, here and in the engine process it spawns (which
            # inherits the environment), so each is set every time. Functions sent to the
            # engine process (a weight load reading the store there) travel pickled, which
            # vLLM allows only when told; the pickles go only between this worker and the
            # engine process it started.
            os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"
            os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
            os.environ["VLLM_BATCH_INVARIANT"] = "1" if self.cfg.batch_invariant else "0"
            from vllm import LLM

            torch.cuda.empty_cache()  # (the engine process needs driver memory: see reload)
            try:
                self.llm = LLM(
                    model=path,
                    tokenizer=path,
                    dtype=spec.dtype,
                    seed=0,
                    max_model_len=-1,  # the longest the KV cache holds, up to the model's
                    max_num_seqs=self.max_batch_size,
                    kv_cache_memory_bytes=self.cfg.kv_cache_bytes,
                    gpu_memory_utilization=min(1.0, self.state_bytes() / total),
                    enable_sleep_mode=True,
                    enforce_eager=self.cfg.enforce_eager,
                    logprobs_mode="processed_logprobs",
                )
            except Exception as e:  # (vLLM's own: RuntimeError, ValueError, TimeoutError)
                raise BackendUnavailable(
                    f"vLLM could not start an engine for {spec.name} ({type(e).__name__}: "
                    f"{e}); it needs {self.state_bytes() / 2**30:.1f} GiB of the GPU free "
                    "(weights, plexrl.vllm.kv-cache-memory, plexrl.vllm.overhead-memory): free "
                    "GPU memory or lower those, and see the worker's log for vLLM's reason"
                ) from e
        except BaseException:
            self.close()
            raise
        self.max_positions = int(self.llm.llm_engine.model_config.max_model_len)
        self.version = 0
        self._asleep = False
        self._host: Any = None  # the holder's view of an offloaded replica: None while resident

    # --- what the holder asks ------------------------------------------------------------

    def state_bytes(self) -> int:
        if self._failed is not None:
            return 0  # its engine is gone: it holds nothing, and must not be made room for
        return self.cfg.device_bytes(self._weight_bytes)

    @property
    def resident(self) -> bool:
        return not self._asleep

    def _checked(self, check: Callable[[], Any]) -> Any:
        """One rank: run ``check`` (the multi-rank hook of :class:`TorchBackend`)."""
        return check()

    def close(self) -> None:
        """Stop the engine process and free its GPU memory (the holder drops the replica)."""
        engine = getattr(getattr(self, "llm", None), "llm_engine", None)
        core = getattr(engine, "engine_core", None)
        if core is not None:
            try:
                core.shutdown()
            except Exception:
                logger.warning(
                    "vLLM engine of %s did not shut down cleanly", self.spec.name, exc_info=True
                )
        if self._tmpdir is not None:
            shutil.rmtree(self._tmpdir, ignore_errors=True)
            self._tmpdir = None

    def _call(self, what: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """``fn(*args, **kwargs)``, an engine call, within ``plexrl.vllm.call-timeout``, on a
        daemon thread of its own (vLLM's client waits for its engine without a timeout, so a
        call that never returns must not hold the process at exit). vLLM refusing a
        ``generate``'s input (``ValueError``) leaves the engine as it was; a timeout or any
        other failure stops it (see the module docstring)."""
        if self._failed is not None:
            raise EngineFailed(self._failed)
        outcome: dict[str, Any] = {}

        def run() -> None:
            try:
                outcome["result"] = fn(*args, **kwargs)
            except BaseException as e:  # noqa: BLE001 (handed to the caller below)
                outcome["error"] = e

        thread = threading.Thread(target=run, name=f"plexrl-vllm-{what}", daemon=True)
        thread.start()
        thread.join(self.cfg.call_timeout_s)
        if thread.is_alive():
            self._stop(f"{what} did not finish in {self.cfg.call_timeout_s:.0f} s")
            raise RequestTimeout(
                f"the vLLM engine of {self.spec.name}: {what} did not finish in "
                f"{self.cfg.call_timeout_s:.0f} s (plexrl.vllm.call-timeout); the engine was "
                f"stopped: {RECOVER}"
            )
        error = outcome.get("error")
        if error is None:
            return outcome.get("result")
        if isinstance(error, ValueError) and what == "generate":
            raise InvalidSamplingParams(f"vLLM refused the request: {error}") from error
        self._stop(f"{what} failed: {type(error).__name__}: {error}")
        raise EngineFailed(
            f"the vLLM engine of {self.spec.name} failed {what} ({type(error).__name__}: "
            f"{error}); it was stopped: {RECOVER}"
        ) from error

    def _stop(self, why: str) -> None:
        self._failed = f"the vLLM engine of {self.spec.name} was stopped ({why}): {RECOVER}"
        logger.error("%s", self._failed)
        self.close()

    # --- residency -----------------------------------------------------------------------

    def offload(self, stash: Any = None, stored: Any = None) -> None:
        """``sleep(level=1)``: weights to the engine's host memory, KV cache discarded.
        ``stash``/``stored`` are ignored (see :attr:`stashes`)."""
        if self._asleep:
            return
        if self._failed is not None:  # nothing left to move (and no other request may fail
            self._asleep = True  # on making room for this one)
            self._host = {"bytes": 0}
            return
        self._call("sleep", self.llm.sleep, level=1)
        self._asleep = True
        self._host = {"bytes": self.state_bytes()}

    def reload(self) -> None:
        """``wake_up()``: weights back on the GPU, bit-identical, and a fresh KV cache."""
        if not self._asleep:
            return
        # The engine runs in a process of its own: memory this worker's torch allocator keeps
        # cached (what offloaded torch replicas left) must go back to the driver for it.
        torch.cuda.empty_cache()
        self._call("wake_up", self.llm.wake_up)
        self._asleep = False
        self._host = None

    def sleep(self) -> None:
        self.offload()

    def wake(self) -> None:
        self.reload()

    # --- sampling ------------------------------------------------------------------------

    def tokenize(
        self, prompts: Sequence[str | Sequence[int]], special_tokens: bool | None = None
    ) -> list[list[int]]:
        """Prompts as token ids (strings encoded with the deployment's tokenizer, as
        :func:`encode_prompts` does)."""
        return encode_prompts(self.tokenizer, prompts, special_tokens)

    def text(self, tokens: Sequence[int]) -> str:
        return self.tokenizer.decode(list(tokens), skip_special_tokens=True)

    def sample(
        self,
        prompts: Sequence[Sequence[int]],
        params: SamplingParams,
        prompt_ids: Sequence[int],
        streams: Streams | None = None,
    ) -> list[list[SampledSequence]]:
        """``params.n`` completions per prompt, every row a seeded vLLM request (the engine
        batches them continuously; ``streams`` does not apply, ``streams.invariant`` included:
        a row's bits depend on what vLLM's scheduler batches it with, unless vLLM's own
        batch-invariant mode is on)."""
        from vllm import SamplingParams as VLLMSamplingParams
        from vllm.inputs import TokensPrompt

        prompts = [list(p) for p in prompts]
        check_tokens(prompts, self.vocab_size, self.max_positions, params.max_tokens, "prompt")
        if len(prompt_ids) != len(prompts):
            raise EmptyBatch(f"{len(prompt_ids)} prompt ids for {len(prompts)} prompts")
        if params.truncated:
            raise InvalidSamplingParams(
                f"the vLLM backend samples with top_p = 1 and top_k = 0 only (got "
                f"{params.top_p}, {params.top_k}): its "
                "log-probabilities would be those of the truncated distribution, not of the "
                "distribution before truncation that the loss expects"
            )
        t = params.temperature
        if t > 2.0 or 0.0 < t < 0.01:
            raise InvalidSamplingParams(
                f"the vLLM backend samples at temperature 0 or in [0.01, 2] (got {t}): vLLM "
                "refuses higher ones and raises lower ones to 0.01"
            )
        seeds = row_seeds(params.seed, prompt_ids, params.n)
        inputs, row_params = [], []
        for i, prompt in enumerate(prompts):
            for j in range(params.n):
                inputs.append(TokensPrompt(prompt_token_ids=prompt))
                row_params.append(
                    VLLMSamplingParams(
                        n=1,
                        temperature=params.temperature,
                        top_p=1.0,
                        max_tokens=params.max_tokens,
                        stop=list(params.stop) or None,
                        include_stop_str_in_output=True,
                        ignore_eos=params.ignore_eos,
                        stop_token_ids=list(params.stop_token_ids) or None,
                        seed=seeds[i][j],
                        logprobs=0,  # the sampled token's only
                    )
                )
        outputs = self._call("generate", self.llm.generate, inputs, row_params, use_tqdm=False)
        rows = iter(outputs)
        result = []
        for _ in prompts:
            group = []
            for _ in range(params.n):
                out = next(rows).outputs[0]
                group.append(to_sequence(out.token_ids, out.logprobs, out.finish_reason, self.text))
            result.append(group)
        return result

    # --- weights -------------------------------------------------------------------------

    def load_weights(self, source: StoreCheckpoint) -> int:
        """Load a published version into the engine (read by the engine process from the
        store; checked against this model's names and shapes first, so a mismatch leaves the
        replica unchanged). Returns the weights' version."""
        try:
            version, meta = replica_checkpoint.store_meta(self._reference, source)
        except CheckpointError as e:
            raise WeightsMismatch(f"published weights do not fit this model: {e}") from None
        names = {n for n, _ in self._reference.named_parameters()}
        stored = source.store.manifest(source.model, version).tensors
        extra = sorted(k[6:] for k in stored if k.startswith("model/") and k[6:] not in names)
        if extra:  # (vLLM's loader would fail on them inside the engine, stopping it)
            raise WeightsMismatch(
                f"published weights do not fit this model: it has no parameters {extra[:5]}"
            )
        self._engine_rpc(
            "a weight load",
            _reload_from_store,
            root=str(source.store.root),
            model=source.model,
            version=version,
        )
        self.version = int(meta["version"])
        return self.version

    def set_weights(
        self, weights: Mapping[str, torch.Tensor], version: int | None = None, strict: bool = True
    ) -> None:
        """Overwrite parameters by canonical name (checked first, as the torch backend does)."""
        params = dict(self._reference.named_parameters())
        if not strict and set(weights) != set(params):
            raise WeightsMismatch(
                "a vLLM replica takes every parameter or none: vLLM rebuilds each layer it is "
                "given from zeros, so part of a fused layer (q_proj of qkv_proj) would zero the "
                f"rest; {len(set(params) - set(weights))} missing, "
                f"{len(set(weights) - set(params))} unknown"
            )
        check_weights(params, weights, strict=True)
        from safetensors.torch import save

        blob = save({n: t.detach().to("cpu").contiguous() for n, t in weights.items()})
        self._engine_rpc("a weight update", _reload_from_bytes, blob=blob)
        if version is not None:
            self.version = int(version)

    def get_weights(self, names: Sequence[str] | None = None) -> dict[str, torch.Tensor]:
        raise OpNotSupported(
            "a vLLM replica holds its weights in vLLM's fused layout; read the canonical "
            "weights from the training deployment or the published store version"
        )

    def _engine_rpc(self, what: str, fn: Callable[..., Any], **kwargs: Any) -> None:
        """Run ``fn(worker, **kwargs)`` in the engine process, then drop the prefix cache
        (its keys and values were computed with the weights before)."""
        if self._asleep:
            self.reload()  # (the holder makes a replica resident first; kept safe here)
        self._call(what, self.llm.collective_rpc, fn, kwargs=kwargs)
        self._call("reset_prefix_cache", self.llm.reset_prefix_cache)

    # --- not a trainer (NotATrainer), nor a scorer -----------------------------------------

    trainer_hint = (
        "it runs on a training deployment; a vLLM deployment only samples and loads weights "
        "(deploy the policy with backend='torch' for training)"
    )

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise self._not_a_trainer("forward")

    def publish_weights(self, *args: Any, **kwargs: Any) -> Any:
        raise self._not_a_trainer("publish_weights")

    def _rank(self) -> int:
        return 0

    def _world(self) -> int:
        return 1

    def load_state(self, *args: Any, **kwargs: Any) -> Any:
        raise self._not_a_trainer("load_state")
