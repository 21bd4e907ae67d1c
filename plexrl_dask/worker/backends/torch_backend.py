"""The torch backend: one replica of a Hugging Face causal LM on one device.

It implements both backend interfaces (training and rollout) with plain torch and transformers:
batched scoring, gradient accumulation, AdamW, KV-cached batched sampling with per-sample seeded
randomness, weights by canonical name, and offload/reload between device and host memory.

Offload keeps ``Parameter`` objects (and so weight tying and the optimizer's references) and
swaps their storage: on CUDA the state is copied into pinned host buffers and the device memory is
freed; on the CPU, device and host memory are the same RAM, so offload only hands the tensors to
the host side (no copy) and the budget accounting is what changes. Either way the reloaded replica
continues bit-identically.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import torch

from plexrl_dask.errors import (
    CheckpointError,
    EmptyBatch,
    InvalidOptimizerParams,
    NonFiniteGradient,
    NonFiniteLoss,
    OpNotSupported,
    PlexRLError,
    TokenOutOfVocabulary,
    WeightsMismatch,
)
from plexrl_dask.models.spec import ModelSpec
from plexrl_dask.models.tokenizer import encode_prompts, end_of_sequence_ids, token_pieces
from plexrl_dask.shared.checks import checked_temperature, checked_top
from plexrl_dask.shared.types import (
    AdamWParams,
    Datum,
    ForwardBackwardResult,
    ForwardResult,
    Loss,
    PolicyGradient,
    SampledSequence,
    SamplingParams,
    Streams,
    as_batch,
    check_tokens,
)
from plexrl_dask.worker import replica_checkpoint
from plexrl_dask.worker.backends.base import check_weights
from plexrl_dask.worker.decode import StreamDecoder
from plexrl_dask.worker.decode_step import DecodeStep
from plexrl_dask.worker.device import copy_stream, local_nbytes, used_by_default_stream
from plexrl_dask.worker.groups import portable_error
from plexrl_dask.worker.losses import compute_loss, per_datum, top_per_datum
from plexrl_dask.worker.optimizer import new_adamw, norm_parameter_names, set_hyperparameters
from plexrl_dask.worker.prefix_cache import PrefixCache, prefix_cache_bytes
from plexrl_dask.worker.replica_checkpoint import StoreCheckpoint
from plexrl_dask.worker.row_decode import RowDecoder
from plexrl_dask.worker.static_decode import engine_for

logger = logging.getLogger(__name__)


class TorchBackend:
    """A replica of ``spec`` on ``device`` (see the module docstring)."""

    #: Offload hands the holder its host state to keep in the node's tiers (``stash``).
    stashes = True

    def __init__(
        self,
        spec: ModelSpec,
        device: str | torch.device,
        max_batch_size: int = 64,
        model: torch.nn.Module | None = None,
        tokenizer: Any = None,
    ):
        """``model``/``tokenizer``: already built for ``spec`` (a copy gathered from a sharded
        deployment, :mod:`plexrl_dask.worker.backends.fsdp`); default: built from ``spec``."""
        self.spec = spec
        self.device = torch.device(device)
        self.max_batch_size = int(max_batch_size)
        self.tokenizer = spec.build_tokenizer() if tokenizer is None else tokenizer
        self.model = self._build_model() if model is None else model
        cfg = self.model.config
        self.vocab_size = int(cfg.vocab_size)
        self.max_positions = int(cfg.max_position_embeddings)
        self.eos_token_id = self.tokenizer.eos_token_id
        # (as Hugging Face's generate ends a completion: an instruct checkpoint lists its
        # end-of-turn token in its generation config, not as the tokenizer's EOS)
        self.eos_token_ids = end_of_sequence_ids(self.tokenizer, self.model)
        self.pad_token_id = (
            self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        )
        self.forward_params = frozenset(inspect.signature(self.model.forward).parameters)
        # The KV-cache argument: ``cache`` in recent transformers, ``past_key_values`` before.
        self.cache_kw = "cache" if "cache" in self.forward_params else "past_key_values"
        self._pieces = token_pieces(self.tokenizer)
        self._ending: dict[frozenset[str], frozenset[int]] = {}  # tokens_ending's answers
        # Decode steps computed from the modules' weights where the architecture allows
        # (plexrl_dask.worker.decode_step); None: through the HF forward.
        self.decode_step = DecodeStep.for_model(self.model)
        self._adapter_step: DecodeStep | None = None  # (row_step's, for LoRA adapters)
        # The static-shape decoder (plexrl_dask.worker.static_decode), where configured.
        self.static = engine_for(self)
        # Multi-turn prompts' keys and values (plexrl_dask.worker.prefix_cache): only where the
        # decode step prefills them (its forwards are the canonical ones a hit stands for).
        size = prefix_cache_bytes(self.device)
        self.prefix_cache = PrefixCache(size) if size and self.decode_step is not None else None
        #: Set by the holder: ``room(bytes)`` makes room for that many more bytes in the
        #: worker's budget (offloading other replicas) and says whether they fit.
        self.room: Callable[[int], bool] | None = None
        self.optimizer: torch.optim.AdamW | None = None
        self.version = 0
        self.pending_backward = 0
        self.stepping = False  # inside optimizer.step() (a failure there leaves it half done)
        # Offloaded state: a host dict, or a stash handle (see offload()); None while resident.
        self._host: Any = None

    def _build_model(self) -> torch.nn.Module:
        """The spec's model, on this replica's device."""
        return self.spec.build_model(self.device)

    # --- validation ------------------------------------------------------------------------

    def _check_tokens(
        self, seqs: Sequence[Sequence[int]], extra: int = 0, what: str = "sequence"
    ) -> None:
        check_tokens(seqs, self.vocab_size, self.max_positions, extra, what)

    # --- hooks that multi-rank backends override ------------------------------------------

    def _agree(self, ok: bool) -> bool:
        """Whether every rank of the request saw ``ok`` (one rank here: ``ok`` itself)."""
        return ok

    def _gather_object(self, obj: Any) -> list[Any]:
        """Every rank's ``obj``, in rank order (one rank here)."""
        return [obj]

    def _checked(self, check: Any) -> Any:
        """Run a step that may raise a typed error, and fail on every rank together if it
        failed on any (a lone failing rank would leave the others waiting in a collective).
        Every rank then raises the lowest failing rank's error, so the request fails with
        one error whichever rank's task fails first. Returns ``check()``.

        Typed errors, value errors and OS errors (a checkpoint path one node cannot write)
        are agreed on; each leaves every rank's state as it was."""
        error: Exception | None = None
        result = None
        try:
            result = check()
        except (PlexRLError, ValueError, OSError) as e:
            error = e
        if not self._agree(error is None):
            errors = self._gather_object(None if error is None else portable_error(error))
            first = next(e for e in errors if e is not None)
            if first is error:  # (one rank: its own error)
                raise error
            raise first from error
        return result

    def _reshard(self) -> None:
        """Put parameters back in their sharded form (FSDP); nothing to do unsharded."""

    def _backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def _full(self, p: torch.Tensor) -> torch.Tensor:
        """The whole (unsharded) value of parameter ``p``."""
        return p.detach()

    def _assign(self, p: torch.Tensor, value: torch.Tensor) -> None:
        """Write the whole value ``value`` into parameter ``p`` (its shard, if sharded)."""
        p.copy_(value)

    # --- scoring and training --------------------------------------------------------------

    def _logprobs(
        self, batch: tuple[Datum, ...], temperature: float, top: int = 0
    ) -> tuple[torch.Tensor, torch.Tensor] | tuple[torch.Tensor, torch.Tensor, Any]:
        """(B, L-1) log-probabilities of each predicted token and the validity mask; with
        ``top``, also the (B, L-1, top) log-probabilities and ids of each position's most
        probable tokens."""
        width = max(len(d.tokens) for d in batch)
        ids = torch.full((len(batch), width), self.pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for i, d in enumerate(batch):
            ids[i, : len(d.tokens)] = torch.tensor(d.tokens, dtype=torch.long)
            mask[i, : len(d.tokens)] = 1
        ids, mask = ids.to(self.device), mask.to(self.device)
        logits = self.model(input_ids=ids, attention_mask=mask, use_cache=False).logits
        logits = logits[:, :-1].float()
        if temperature != 1.0:
            logits = logits / temperature
        every = torch.log_softmax(logits, dim=-1)
        logp = every.gather(-1, ids[:, 1:, None])[..., 0]
        valid = mask[:, 1:].to(logp.dtype)
        if top:
            return logp * valid, valid, every.topk(min(top, every.shape[-1]), dim=-1)
        return logp * valid, valid

    def forward(
        self, batch: Sequence[Datum], temperature: float = 1.0, top: int = 0
    ) -> ForwardResult:
        """Per-token log-probabilities of each datum under the current weights (and with
        ``top``, each position's ``top`` most probable tokens: :class:`ForwardResult`)."""
        batch = as_batch(batch)
        temperature = checked_temperature(temperature)
        top = self._checked(lambda: checked_top(top))
        self._checked(lambda: self._check_tokens([d.tokens for d in batch]))
        self.model.eval()
        with torch.inference_mode():
            if not top:
                logp, _ = self._logprobs(batch, temperature)
                return ForwardResult(logprobs=per_datum(logp, batch))
            logp, _, (values, ids) = self._logprobs(batch, temperature, top)
        return ForwardResult(logprobs=per_datum(logp, batch), top=top_per_datum(values, ids, batch))

    def forward_backward(
        self, batch: Sequence[Datum], loss: Loss, logprobs: bool = False
    ) -> dict[str, float] | ForwardBackwardResult:
        """Accumulate the gradient of ``loss`` over ``batch`` (until :meth:`optim_step`);
        its metrics, or with ``logprobs`` a :class:`ForwardBackwardResult` that also has each
        datum's per-token log-probabilities (those the gradient was taken at).

        A NaN/inf loss raises :class:`NonFiniteLoss` before ``backward``, so nothing is
        accumulated and the replica stays usable."""
        batch = as_batch(batch)
        self._checked(lambda: self._check_tokens([d.tokens for d in batch]))
        self.model.train()
        temperature = loss.temperature if isinstance(loss, PolicyGradient) else 1.0
        logp, valid = self._logprobs(batch, temperature)
        computed: list[Any] = []
        # Agreed: a loss error on one rank's part (a field missing there) fails every rank.
        self._checked(lambda: computed.extend(compute_loss(loss, batch, logp, valid)))
        value, metrics = computed
        if not self._agree(bool(torch.isfinite(value))):
            raise NonFiniteLoss(
                f"the loss is {float(value.detach())} (on this rank); no gradient was accumulated. "
                "Check the advantages, old/ref logprobs and weights of this batch for NaN/inf or "
                "extreme values"
            )
        self._backward(value)
        self.pending_backward += 1
        if not logprobs:
            return metrics
        return ForwardBackwardResult(metrics=metrics, logprobs=per_datum(logp, batch))

    def train_step(
        self, batch: Sequence[Datum], loss: Loss, params: AdamWParams
    ) -> dict[str, dict[str, float]]:
        """:meth:`forward_backward` then :meth:`optim_step` (one request's work): the same
        arithmetic as the two calls, both results by op."""
        return {
            "forward_backward": self.forward_backward(batch, loss),
            "optim_step": self.optim_step(params),
        }

    def optim_step(self, params: AdamWParams) -> dict[str, float]:
        """One AdamW step on the accumulated gradient (clipped to ``params.grad_clip``)."""
        trainable = [p for p in self.model.parameters() if p.requires_grad]
        if self.pending_backward == 0 or all(p.grad is None for p in trainable):
            raise InvalidOptimizerParams("no gradient accumulated: call forward_backward first")
        grads = [p.grad for p in trainable if p.grad is not None]
        norm = torch.nn.utils.get_total_norm(grads)
        if hasattr(norm, "full_tensor"):  # sharded gradients: the global norm
            norm = norm.full_tensor()
        if not torch.isfinite(norm):
            self.model.zero_grad(set_to_none=True)
            self.pending_backward = 0
            raise NonFiniteGradient(
                f"the accumulated gradient norm is {float(norm)}; it was discarded and the "
                "parameters were not updated"
            )
        if params.grad_clip is not None:
            # torch's clip_grad_norm_ rule, applied with a Python float so it works on sharded
            # (DTensor) gradients too.
            coef = params.grad_clip / (float(norm) + 1e-6)
            if coef < 1.0:
                for g in grads:
                    g.mul_(coef)
        if self.optimizer is None:
            self.optimizer = new_adamw(self.model.named_parameters(), norm_parameter_names(self.model))
        set_hyperparameters(self.optimizer, params)
        self.stepping = True  # (until the step is whole: see after_out_of_memory)
        self.optimizer.step()
        self.stepping = False
        self.optimizer.zero_grad(set_to_none=True)
        self.pending_backward = 0
        self.version += 1
        return {"grad_norm": float(norm), "lr": params.lr, "version": float(self.version)}

    # --- sampling --------------------------------------------------------------------------

    def tokenize(
        self, prompts: Sequence[str | Sequence[int]], special_tokens: bool | None = None
    ) -> list[list[int]]:
        """Prompts as token ids (strings encoded with the deployment's tokenizer, as
        :func:`encode_prompts` does)."""
        return encode_prompts(self.tokenizer, prompts, special_tokens)

    def sample(
        self,
        prompts: Sequence[Sequence[int]],
        params: SamplingParams,
        prompt_ids: Sequence[int],
        streams: Streams | None = None,
    ) -> list[list[SampledSequence]]:
        """``params.n`` completions per prompt. Rows (prompt, sample), in that order, are cut
        into streams of ``streams.rows`` (default: ``plexrl.sampling.*``), each decoded with
        continuous batching, ``max_batch_size`` rows at a time
        (:mod:`plexrl_dask.worker.decode`). With ``streams.invariant`` each prompt samples
        what it would alone: where :meth:`row_step` has a step and no prompt has turns,
        every row is decoded as if alone (:mod:`plexrl_dask.worker.row_decode`); elsewhere
        each prompt's rows are a stream of their own."""
        turns = [getattr(p, "turns", None) for p in prompts]
        prompts = [list(p) for p in prompts]
        self._check_sample(prompts, params, prompt_ids)
        streams = Streams.from_config() if streams is None else streams
        # Turn prompts go through the prefix cache where there is one and this module has a
        # decode step to prefill them (the static engine prefills in batches; a sharded
        # rank's cache serves its gathered copies, not its own module: see
        # plexrl_dask.worker.prefix_cache); elsewhere they are plain.
        turned = (
            self.prefix_cache is not None
            and self.decode_step is not None
            and any(t is not None for t in turns)
        )
        rows = [(i, j) for i in range(len(prompts)) for j in range(params.n)]
        out: list[list[SampledSequence | None]] = [[None] * params.n for _ in prompts]
        self.model.eval()
        with torch.inference_mode():
            step = self.row_step() if streams.invariant and not turned else None
            decoder = None
            if step is not None:
                try:
                    decoder = RowDecoder(self, step, prompts, rows, params, prompt_ids)
                except OpNotSupported:  # (no row-invariant products here: per prompt below)
                    decoder = None
            if decoder is not None:
                # every row as if alone: any batching gives the same bits (row_decode.py)
                done = decoder.run()
                return [done[i * params.n : (i + 1) * params.n] for i in range(len(prompts))]
            if streams.invariant:
                # No row-invariant decoder here: each prompt's rows are a stream of their own,
                # which is what the prompt would sample alone in a request of its own.
                streams = Streams(params.n, streams.refill_min_rows, invariant=True)
            for start in range(0, len(rows), streams.rows):
                chunk = rows[start : start + streams.rows]
                longest = max(len(prompts[i]) for i, _ in chunk)
                if (
                    not turned
                    and self.static is not None
                    and self.static.fits(self.max_batch_size, longest, params.max_tokens)
                ):
                    # Room first (others offloaded); the decoder is the configured one
                    # whatever room there is: it decides the sampled bits.
                    self._make_room_for(
                        self.static.extra_bytes(self.max_batch_size, longest, params.max_tokens)
                    )
                    done = self.static.decode(
                        self, prompts, chunk, params, prompt_ids, streams.refill_min_rows
                    )
                else:
                    done = StreamDecoder(
                        self,
                        prompts,
                        chunk,
                        params,
                        prompt_ids,
                        streams.refill_min_rows,
                        turns=turns if turned else None,
                    ).run()
                for (i, j), seq in zip(chunk, done, strict=True):
                    out[i][j] = seq
        return [list(group) for group in out]  # type: ignore[arg-type]

    def _check_sample(
        self, prompts: list[list[int]], params: SamplingParams, prompt_ids: Sequence[int]
    ) -> None:
        """A sample request's checks against this model: every token in the vocabulary, room
        for ``max_tokens`` after each prompt, one id per prompt."""
        self._check_tokens(prompts, extra=params.max_tokens, what="prompt")
        beyond = [t for t in params.stop_token_ids if t >= self.vocab_size]
        if beyond:
            raise TokenOutOfVocabulary(
                f"stop token id {beyond[0]} is outside this model's vocabulary [0, {self.vocab_size})"
            )
        if len(prompt_ids) != len(prompts):
            raise EmptyBatch(f"{len(prompt_ids)} prompt ids for {len(prompts)} prompts")

    def tokens_ending(self, chars: Iterable[str]) -> frozenset[int] | None:
        """The token ids whose text holds one of ``chars``, plus every id the tokenizer has no
        text for (those are decoded, so they are never ruled out); None when the tokenizer does
        not decode by concatenation (then no token is ruled out)."""
        if self._pieces is None:
            return None
        key = frozenset(chars)
        known = self._ending.get(key)
        if known is None:  # a pass over the vocabulary: once per set of stop strings
            held = {i for i, piece in enumerate(self._pieces) if any(c in piece for c in key)}
            beyond = range(len(self._pieces), max(len(self._pieces), self.vocab_size))
            known = self._ending[key] = frozenset(held.union(beyond))
        return known

    def text(self, tokens: Sequence[int]) -> str:
        """The text of ``tokens``, special tokens skipped (``decode(tokens,
        skip_special_tokens=True)``). When the tokenizer decodes by concatenation it is the
        tokens' pieces joined, without a decode call: sampling asks for it per row and step
        (stop strings) and per completion, and the call cost ~30 % of a countdown request's
        decode time in the first case and ~10 % of a short-answer request's in the second."""
        pieces = self._pieces
        if pieces is not None and (not tokens or max(tokens) < len(pieces)):
            return "".join([pieces[t] for t in tokens])
        return self.tokenizer.decode(list(tokens), skip_special_tokens=True)

    def stopped_by_string(self, tokens: list[int], stops: tuple[str, ...], longest: int) -> bool:
        """Whether the text of ``tokens`` ends in a way that contains one of ``stops``
        (``longest``: the longest stop's length in characters, an upper bound in tokens)."""
        tail = self.text(tokens[-longest:])
        return any(s in tail for s in stops)

    # --- weights ---------------------------------------------------------------------------

    def _weights(self) -> dict[str, torch.nn.Parameter]:
        """The parameters that are this replica's weights, by canonical name (a LoRA
        replica's: its adapter's)."""
        return dict(self.model.named_parameters())

    def _checkpointed(self) -> Any:
        """What checkpoints and published weights hold (its ``named_parameters()``)."""
        return self.model

    def _dcp_refused(self) -> PlexRLError | None:
        """Why this replica cannot use DCP directories, if it cannot."""
        return None

    def get_weights(self, names: Sequence[str] | None = None) -> dict[str, torch.Tensor]:
        """Host copies of the parameters by canonical name (tied weights appear once)."""
        params = self._weights()
        if names is not None:
            missing = sorted(set(names) - set(params))
            if missing:
                raise WeightsMismatch(f"no parameters named {missing[:5]} in this model")
            params = {n: params[n] for n in names}
        return {n: self._full(p).to("cpu", copy=True) for n, p in params.items()}

    def set_weights(
        self, weights: Mapping[str, torch.Tensor], version: int | None = None, strict: bool = True
    ) -> None:
        """Copy ``weights`` into the parameters. Everything is checked before anything is
        written, so a mismatch leaves the replica unchanged."""
        params = self._weights()
        check_weights(params, weights, strict)
        with torch.no_grad():
            for n, t in weights.items():
                self._assign(params[n], t.to(self.device, params[n].dtype))
        if version is not None:
            self.version = int(version)

    # --- checkpoints -----------------------------------------------------------------------

    def _distributed(self) -> bool:
        return False

    def save_state(
        self,
        path: str | StoreCheckpoint,
        publish_id: str = "solo",
        open_writer: Callable[[int, int], Any] | None = None,
    ) -> dict[str, Any]:
        """Write parameters and optimizer state (see :mod:`..checkpoint`): to a store version
        (``path`` a :class:`StoreCheckpoint`; every rank of one save passes the same
        ``publish_id``; ``open_writer(version, nbytes)`` opens this rank's writer, e.g. with room
        reserved on the node's tier) or as DCP to the directory ``path``."""
        meta = {
            "version": self.version,
            "model": self.spec.name,
            "world_size": self._world(),
            "architecture": replica_checkpoint.architecture(self._checkpointed()),
        }
        if isinstance(path, str):
            refused = self._dcp_refused()
            if refused is not None:
                raise refused
            replica_checkpoint.save(
                self.model, self.optimizer, path, meta, self._distributed(), self._rank() == 0
            )
            return {"path": path, "version": self.version, "format": "dcp"}
        return self._publish(path, publish_id, open_writer, self.optimizer)

    def publish_weights(
        self,
        target: StoreCheckpoint,
        publish_id: str = "solo",
        open_writer: Callable[[int, int], Any] | None = None,
    ) -> dict[str, Any]:
        """Publish the parameters (no optimizer state) as version ``target.version`` of a
        store, each rank its own shard regions; the weight version is in the metadata. What
        :meth:`load_weights` of another deployment reads (weight sync through the store)."""
        return self._publish(target, publish_id, open_writer, None)

    def _publish(
        self,
        target: StoreCheckpoint,
        publish_id: str,
        open_writer: Callable[[int, int], Any] | None,
        optimizer: Any,
    ) -> dict[str, Any]:
        self._reshard()
        version = self.version if target.version is None else int(target.version)
        nbytes = sum(
            local_nbytes(t)
            for k, t in self._state_tensors().items()
            if k.startswith("param/") or (optimizer is not None and k.startswith("optim/"))
        )
        # A node tier is local to its node: ranks on other nodes than rank 0's send their
        # shards to rank 0, which writes them into its node's tier beside its own (one shard
        # in flight at a time: nothing is gathered whole).
        nodes = self._gather_object(None if target.node is None else target.node.node_id)
        home = [r for r, n in enumerate(nodes) if n == nodes[0]]
        away = [r for r in range(len(nodes)) if r not in home]

        def write() -> None:
            entries = replica_checkpoint.state_entries(
                self._checkpointed(), optimizer, self._rank()
            )
            if self._rank() in away:
                replica_checkpoint.send_entries(entries, dst=0)
                return
            if open_writer is None:
                opened = target.store.writer(target.model, version, publish_id)
            else:
                # Rank 0 also writes the away ranks' shards (FSDP shards are of one size).
                opened = open_writer(
                    version, nbytes * (1 + (len(away) if self._rank() == 0 else 0))
                )
            with opened as writer:
                for entry in entries:
                    entry.write(writer)
                if self._rank() == 0:
                    for src in away:
                        for entry in replica_checkpoint.recv_entries(src, self.device):
                            entry.write(writer)

        self._checked(write)
        meta = {
            "version": self.version,
            "model": self.spec.name,
            "world_size": self._world(),
            "format": replica_checkpoint.STORE_FORMAT,
            "has_optimizer": optimizer is not None,
            "architecture": replica_checkpoint.architecture(self._checkpointed()),
        }

        def commit() -> None:
            if self._rank() == 0:  # every rank's part is closed: all passed the agreement
                target.commit(version, publish_id, len(home), meta)

        self._checked(commit)
        return {
            "path": str(target.store.root),
            "model": target.model,
            "version": version,
            "format": "store",
        }

    def load_weights(self, source: StoreCheckpoint) -> int:
        """Overwrite the parameters with a published version (reading only this rank's
        regions; the optimizer state is kept, as with :meth:`set_weights`); returns the
        weights' version."""
        stored: dict[str, Any] = {}

        def check() -> None:
            try:
                stored["version"], stored["meta"] = replica_checkpoint.store_meta(
                    self._checkpointed(), source
                )
            except CheckpointError as e:  # another model's weights: the set_weights error
                raise WeightsMismatch(f"published weights do not fit this model: {e}") from None

        self._checked(check)
        replica_checkpoint.read_state(
            self._checkpointed(), None, source, stored["version"], self._agreed()
        )
        self.version = int(stored["meta"]["version"])
        return self.version

    def _agreed(self) -> Any:
        """What a multi-rank read agrees through (``_checked``); None on one rank."""
        return self._checked if self._world() > 1 else None

    def load_state(self, path: str | StoreCheckpoint, optimizer: bool = True) -> int:
        """Replace parameters (and optimizer state, if saved and ``optimizer``) with the
        checkpoint at ``path`` (a DCP directory or a :class:`StoreCheckpoint`), from any world
        size; pending gradients are dropped. Without ``optimizer`` the optimizer starts afresh
        (a new run from saved weights). Returns the restored version."""
        meta: dict[str, Any] = {}
        stored: dict[str, int] = {}

        def check() -> None:
            if isinstance(path, str):
                refused = self._dcp_refused()
                if refused is not None:
                    raise refused
                meta.update(replica_checkpoint.read_meta(path))
                replica_checkpoint.check_compatible(self.model, path)
                replica_checkpoint.check_architecture(self._checkpointed(), meta, repr(path))
            else:
                stored["version"], found = replica_checkpoint.store_meta(self._checkpointed(), path)
                meta.update(found)

        self._checked(check)
        meta["has_optimizer"] = bool(meta["has_optimizer"]) and optimizer is True
        # Without saved moments, the old state's do not belong to the restored one; either
        # way the optimizer in use changes only once the read succeeded.
        restored = None
        if meta["has_optimizer"]:
            restored = self.optimizer
            if restored is None:
                restored = new_adamw(self.model.named_parameters(), norm_parameter_names(self.model))
        if isinstance(path, str):
            replica_checkpoint.load(self.model, restored, path, self._assign)
        else:
            replica_checkpoint.read_state(
                self._checkpointed(), restored, path, stored["version"], self._agreed()
            )
        self.optimizer = restored
        self.model.zero_grad(set_to_none=True)
        self.pending_backward = 0
        self.version = int(meta["version"])
        return self.version

    def _world(self) -> int:
        return 1

    def _rank(self) -> int:
        return 0

    # --- residency -------------------------------------------------------------------------

    def _state_tensors(self) -> dict[str, torch.Tensor]:
        """Every tensor of the replica's state, by a stable name."""
        out: dict[str, torch.Tensor] = {}
        for n, p in self.model.named_parameters():
            out[f"param/{n}"] = p.data
            if p.grad is not None:
                out[f"grad/{n}"] = p.grad
        for n, buf in self.model.named_buffers():
            out[f"buffer/{n}"] = buf
        if self.optimizer is not None:
            names = {id(p): n for n, p in self.model.named_parameters()}
            for p, state in self.optimizer.state.items():
                # (a module left mid-forward by a failed collective holds other Parameter
                # objects than the optimizer: count what it can see)
                name = names.get(id(p), f"unbound-{id(p)}")
                for k, v in state.items():
                    if isinstance(v, torch.Tensor):
                        out[f"optim/{name}/{k}"] = v
        return out

    def state_bytes(self) -> int:
        """Device bytes the replica holds (its state, and while resident the static decoder's
        cache, the prefix cache and the decode step's weight layout), or the offloaded
        state's bytes."""
        if self._host is not None:
            return int(self._host["bytes"])  # type: ignore[arg-type]
        cache = 0 if self.static is None else self.static.nbytes()
        cache += 0 if self.prefix_cache is None else self.prefix_cache.nbytes()
        cache += 0 if self.decode_step is None else self.decode_step.nbytes()
        return cache + sum(local_nbytes(t) for t in self._state_tensors().values())

    def after_out_of_memory(self, training: bool) -> bool:
        """A request of this replica ran out of device memory part-way: hand the allocator's
        cached blocks back, and after a training request drop the gradients it may have
        accumulated in part (the pending step's with them: they cannot be told apart).
        Returns whether the replica's state is whole: not if it ran out inside the optimizer's
        step, which updates parameters and moments group by group, in place."""
        whole = not self.stepping
        self.stepping = False
        if training:
            self.model.zero_grad(set_to_none=True)
            self.pending_backward = 0
        self.release_decoders()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        return whole

    def _make_room_for(self, extra: int) -> None:
        """Have the holder make room for ``extra`` more device bytes (offloading others)
        before they are allocated. What does not fit is allocated anyway: which decoder runs
        decides the sampled bits, so memory pressure never chooses it."""
        if extra > 0 and self.room is not None:
            self.room(extra)

    def release_decoders(self) -> None:
        """Drop what the decoders keep beside the weights (the decode step's fused layout,
        the static engine's cache, the prefix cache): an offload's first step, and what a
        holder short of room takes from an idle replica before it offloads one."""
        if self.decode_step is not None:
            self.decode_step.release()
        self._adapter_step = None
        if self.static is not None:
            self.static.release()
        self.forget_prefixes()

    def row_step(self) -> DecodeStep | None:
        """The decode step the batch-invariant decoder runs on: the replica's own, else, for
        a model with LoRA adapters, one that adds them (built for the module tree the replica
        holds now); None where there is none."""
        if self.decode_step is not None or self.model is None or self.spec.lora is None:
            return self.decode_step
        step = self._adapter_step
        if step is None or step.model is not self.model:
            step = self._adapter_step = DecodeStep.for_model(self.model, adapters=True)
        return step

    def forget_prefixes(self) -> None:
        """Empty the prefix cache (the weights changed: its keys and values are stale)."""
        if self.prefix_cache is not None:
            self.prefix_cache.clear()

    @property
    def resident(self) -> bool:
        return self._host is None

    def _to_host(self, t: torch.Tensor) -> torch.Tensor:
        if t.device.type == "cpu":
            return t  # device memory is host memory: hand it over without a copy
        host = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=True)
        host.copy_(t, non_blocking=True)
        return host

    def offload(
        self, stash: Callable[[dict[str, Any]], Any] | None = None, stored: Any = None
    ) -> None:
        """Move every state tensor to host memory and release the device copies.

        ``stash``: takes the host state (a dict of tensors and plain values) and returns what
        to keep instead, e.g. a handle on a copy in the node's state store
        (:mod:`plexrl_dask.worker.offload`); anything with ``load()`` and ``["bytes"]``. It
        runs before the device copies are released, so a stash that fails leaves the
        replica resident and intact. ``stored``: such a handle on a copy of exactly the
        current state (a rollout replica swapped out unchanged since its last offload); then
        nothing is copied to the host, the device copies are released and ``stored`` kept."""
        if self._host is not None:
            return
        self.release_decoders()
        params = dict(self.model.named_parameters())
        # Optimizer state that lives on the device (Adam's "step" stays on the CPU on CUDA).
        device_optim: dict[str, list[str]] = {}
        if self.optimizer is not None:
            for n, p in params.items():
                st = self.optimizer.state.get(p)
                if st:
                    device_optim[n] = [
                        k
                        for k, v in st.items()
                        if isinstance(v, torch.Tensor) and v.device.type == self.device.type
                    ]
        if stored is not None:
            kept = stored
        else:
            nbytes = self.state_bytes()
            with copy_stream(self.device):
                host: dict[str, Any] = {
                    "params": {n: self._to_host(p.data) for n, p in params.items()},
                    "grads": {
                        n: self._to_host(p.grad) for n, p in params.items() if p.grad is not None
                    },
                    "buffers": {n: self._to_host(b) for n, b in self.model.named_buffers()},
                    "optim": {
                        n: {k: self._to_host(self.optimizer.state[params[n]][k]) for k in keys}  # type: ignore[union-attr]
                        for n, keys in device_optim.items()
                    },
                    "bytes": nbytes,
                }
            kept = host if stash is None else stash(host)
        for p in params.values():
            p.data = torch.empty(0, dtype=p.dtype, device=self.device)
            p.grad = None
        for mod in self.model.modules():
            for bname in list(mod._buffers):
                if mod._buffers[bname] is not None:
                    mod._buffers[bname] = torch.empty(
                        0, dtype=mod._buffers[bname].dtype, device=self.device
                    )
        for n, keys in device_optim.items():
            st = self.optimizer.state[params[n]]  # type: ignore[union-attr]
            for k in keys:
                st[k] = None  # type: ignore[assignment]
        self._host = kept
        # The freed device blocks stay in torch's cache, not handed back to the driver: this
        # worker's next reload or another replica reuses them, where handing them back
        # (empty_cache) took a fifth of an offload's time on an H200 (bench.device's
        # release_share_of_offload; the offload without it is not yet measured there). A
        # backend whose engine runs in another process (vLLM) empties the cache itself
        # before it needs the memory.

    def _host_state(self) -> dict[str, Any]:
        """The offloaded state as host tensors (read back from its stash if stashed)."""
        if hasattr(self._host, "load"):
            return self._host.load(pin_memory=self.device.type == "cuda")  # type: ignore[union-attr]
        return self._host  # type: ignore[return-value]

    def reload(self) -> None:
        """Bring offloaded state back onto the device (bit-identical)."""
        if self._host is None:
            return
        host = self._host_state()
        params = dict(self.model.named_parameters())
        # (not after the default stream's work: this is what lets a prefetch overlap the
        # running request's kernels)
        with copy_stream(self.device, after_default=False):
            for n, p in params.items():
                p.data = host["params"][n].to(self.device, non_blocking=True)  # type: ignore[index]
                g = host["grads"].get(n)  # type: ignore[union-attr]
                p.grad = None if g is None else g.to(self.device, non_blocking=True)
            buffers = host["buffers"]
            for mod_name, mod in self.model.named_modules():
                for bname in list(mod._buffers):
                    full = f"{mod_name}.{bname}" if mod_name else bname
                    if full in buffers:  # type: ignore[operator]
                        mod._buffers[bname] = buffers[full].to(self.device, non_blocking=True)  # type: ignore[index]
            if self.optimizer is not None:
                for n, st in host["optim"].items():  # type: ignore[union-attr]
                    target = self.optimizer.state[params[n]]
                    for k, v in st.items():
                        target[k] = v.to(self.device, non_blocking=True)
        used_by_default_stream(self._state_tensors().values(), self.device)
        self._host = None

    # Rollout-engine names for the same transitions (vLLM: sleep(level=1) / wake_up()).
    def sleep(self) -> None:
        self.offload()

    def wake(self) -> None:
        self.reload()
