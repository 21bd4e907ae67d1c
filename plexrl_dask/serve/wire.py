"""The Tinker wire format, translated to and from PlexRL's types.

Bodies follow the SDK this server pins (``tinker`` 0.38; its own generated protobuf module,
``tinker.proto.tinker_public_pb2``, reads and writes the protobuf ones): ``forward_backward``
requests arrive as protobuf, its results and sampling results leave as protobuf, everything else
is JSON. What this module checks is the protocol; the worker checks the tokens again (range,
length) when it runs them.

Alignment: a Tinker datum is ``model_input`` (N tokens) and per-position ``loss_fn_inputs``
(``target_tokens[i]`` is predicted from the first ``i + 1`` inputs). A PlexRL
:class:`~plexrl_dask.Datum` is one sequence whose per-token fields sit on the predicted token.
The targets must be the inputs shifted by one (what every Tinker recipe sends); the datum is then
``model_input + [target_tokens[-1]]`` with each field moved one place right. Losses sum over
tokens, as Tinker's do (``normalizer=1``).
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from plexrl_dask.errors import InvalidModelSpec, InvalidTinkerRequest, UnsupportedCall
from plexrl_dask.models.spec import LoraSpec
from plexrl_dask.shared.checks import check_rows
from plexrl_dask.shared.loss_graph import GraphLoss
from plexrl_dask.shared.types import (
    AdamWParams,
    CrossEntropy,
    Datum,
    Loss,
    PolicyGradient,
    SampleResult,
    SamplingParams,
)

try:  # (the serve extra: pip install 'plexrl-dask[serve]')
    from tinker.proto import tinker_public_pb2 as pb
except ImportError:  # pragma: no cover - checked by serve.app.create_app
    pb = None

#: The Tinker SDK version whose wire contract this module implements.
SDK_VERSION = "0.38.0"
LOSSES = ("cross_entropy", "importance_sampling", "ppo", "cispo", "dro", "custom")
#: Each loss's inputs (besides ``target_tokens``) and the keys its config may have, with
#: their defaults (Tinker documents none for cispo and dro: ours are ppo's bounds, and the
#: beta its documentation shows).
_INPUTS = {
    "cross_entropy": ("weights",),
    "importance_sampling": ("logprobs", "advantages"),
    "ppo": ("logprobs", "advantages"),
    "cispo": ("logprobs", "advantages"),
    "dro": ("logprobs", "advantages"),
}
_BOUNDS = {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}
_CONFIG = {"ppo": _BOUNDS, "cispo": _BOUNDS, "dro": {"beta": 0.05}}
_DTYPES = {1: np.dtype("<f4"), 2: np.dtype("<i8"), 3: np.dtype("<i4")}


@dataclass(frozen=True)
class TrainingBatch:
    """A decoded ``forward_backward`` request (one chunk of the SDK's call)."""

    forward_only: bool
    data: tuple[Datum, ...]
    #: per datum, how many target positions it has (N: the length of its model_input)
    targets: tuple[int, ...]
    loss: Loss


def parse_forward_backward(body: bytes) -> tuple[str, int, Any]:
    """``(model_id, seq_id, message)`` of a protobuf ``ForwardBackwardRequest``;
    :class:`InvalidTinkerRequest` if it does not parse."""
    message = pb.ForwardBackwardRequest()
    try:
        message.ParseFromString(body)
    except Exception as e:  # (protobuf's DecodeError, or worse on garbage)
        raise InvalidTinkerRequest(
            f"the forward_backward body is not a protobuf request: {e}"
        ) from None
    if not message.model_id:
        raise InvalidTinkerRequest("a forward_backward request names its model_id")
    return message.model_id, int(message.seq_id), message


def training_batch(
    message: Any, custom_loss: Callable[[str], GraphLoss] | None = None
) -> TrainingBatch:
    """The PlexRL data and loss of a parsed ``ForwardBackwardRequest``; ``custom_loss``
    gives the custom loss of a ``loss_id`` (``loss_fn`` ``custom``: a loss the session made
    with ``create_custom_loss``)."""
    loss_fn = message.loss_fn
    if loss_fn not in LOSSES or (loss_fn == "custom" and custom_loss is None):
        raise UnsupportedCall(f"loss_fn {loss_fn!r} is not supported here; supported: {LOSSES}")
    config: dict[str, Any] = {k: v for k, v in message.loss_fn_config.items()}
    for key, value in message.loss_fn_config_v2.items():
        text = value.WhichOneof("value") == "text"
        if text != (loss_fn == "custom" and key == "loss_id"):
            raise InvalidTinkerRequest(
                f"loss_fn_config {key!r} must be {'a string' if not text else 'a number'}"
            )
        config[key] = value.text if text else value.number
    if loss_fn == "custom":
        if set(config) != {"loss_id"}:
            raise InvalidTinkerRequest("a custom loss's loss_fn_config is {'loss_id': ...}")
        loss: Loss = custom_loss(str(config["loss_id"]))  # type: ignore[misc]
    else:
        loss = _loss(loss_fn, config)
    if not message.data:
        raise InvalidTinkerRequest("a forward_backward request has at least one datum")
    data, targets = [], []
    for i, datum in enumerate(message.data):
        d, n = _datum(i, datum, loss_fn, loss)
        data.append(d)
        targets.append(n)
    return TrainingBatch(bool(message.forward_only), tuple(data), tuple(targets), loss)


def _loss(loss_fn: str, config: Mapping[str, float]) -> Loss:
    allowed = _CONFIG.get(loss_fn, {})
    unknown = set(config) - set(allowed)
    if unknown:
        raise InvalidTinkerRequest(
            f"loss_fn_config keys {sorted(unknown)} are not used by {loss_fn!r} "
            f"(it takes {sorted(allowed) or 'none'})"
        )
    if loss_fn == "cross_entropy":
        return CrossEntropy(normalizer=1.0)
    if loss_fn == "importance_sampling":
        return PolicyGradient(clip=False, normalizer=1.0)
    if loss_fn == "dro":
        beta = float(config.get("beta", allowed["beta"]))
        if not (math.isfinite(beta) and beta >= 0):
            raise InvalidTinkerRequest(f"dro's beta must be finite and >= 0, got {beta}")
        return PolicyGradient(objective="dro", dro_beta=beta, normalizer=1.0)
    low = float(config.get("clip_low_threshold", allowed["clip_low_threshold"]))
    high = float(config.get("clip_high_threshold", allowed["clip_high_threshold"]))
    if not (0.0 < low <= 1.0 <= high and math.isfinite(high)):
        raise InvalidTinkerRequest(
            f"{loss_fn}'s ratio bounds need 0 < clip_low_threshold <= 1 <= "
            f"clip_high_threshold, got {low}, {high}"
        )
    return PolicyGradient(
        objective=loss_fn, clip_low=1.0 - low, clip_high=high - 1.0, normalizer=1.0
    )


def _datum(i: int, datum: Any, loss_fn: str, loss: Loss) -> tuple[Datum, int]:
    tokens: list[int] = []
    for chunk in datum.model_input:
        kind = chunk.WhichOneof("chunk")
        if kind != "encoded_text":
            raise UnsupportedCall(f"datum {i}: {kind} chunks are not supported (text only)")
        tokens.extend(_array(chunk.encoded_text.tokens, np.dtype("<i4"), f"datum {i} tokens"))
    inputs = {k: tensor(v, f"datum {i} {k}") for k, v in datum.loss_fn_inputs.items()}
    scalars: dict[str, float] = {}
    if isinstance(loss, GraphLoss):
        # (what a custom loss does not read may be there, as the SDK allows: it is left out)
        wanted: tuple[str, ...] = ("target_tokens", *loss.input_names)
        inputs = {k: v for k, v in inputs.items() if k in wanted}
        for name, rank in loss.inputs[1:]:
            if rank == 0 and name in inputs:
                if inputs[name].size != 1 or len(datum.loss_fn_inputs[name].shape) != 0:
                    raise InvalidTinkerRequest(f"datum {i}: {name} is a number (rank 0)")
                scalars[name] = float(inputs.pop(name).reshape(()))
    else:
        wanted = ("target_tokens", *_INPUTS[loss_fn])
    missing = [k for k in wanted if k not in inputs and k not in scalars]
    extra = sorted(set(inputs) - set(wanted))
    if missing or extra:
        raise InvalidTinkerRequest(
            f"datum {i}: {loss_fn} takes loss_fn_inputs {list(wanted)}; "
            f"missing {missing}, not used {extra}"
        )
    n = len(tokens)
    for key, values in inputs.items():
        if values.ndim != 1 or len(values) != n:
            raise InvalidTinkerRequest(
                f"datum {i}: {key} has shape {list(values.shape)}; it needs one entry per "
                f"model_input token ({n})"
            )
    if n < 1:
        raise InvalidTinkerRequest(f"datum {i}: model_input is empty")
    target = inputs["target_tokens"]
    if target.dtype.kind not in "iu" and not (
        np.isfinite(target).all() and (target == np.round(target)).all()
    ):
        raise InvalidTinkerRequest(f"datum {i}: target_tokens are whole token ids")
    targets = [int(t) for t in target]
    if targets[:-1] != tokens[1:]:
        raise UnsupportedCall(
            f"datum {i}: target_tokens must be model_input shifted by one (the next token "
            "of each position); other targets are not supported"
        )

    def shifted(key: str) -> tuple[float, ...]:
        values = inputs[key].astype(np.float64)
        if not np.isfinite(values).all():
            raise InvalidTinkerRequest(f"datum {i}: {key} has NaN or infinite values")
        return (0.0, *values.tolist())

    fields: dict[str, Any] = {}
    if isinstance(loss, GraphLoss):
        if not all(math.isfinite(v) for v in scalars.values()):
            raise InvalidTinkerRequest(f"datum {i}: a number input is NaN or infinite")
        named = {k: shifted(k) for k in inputs if k != "target_tokens"}
        fields["inputs"] = {**named, **scalars}
    elif loss_fn == "cross_entropy":
        fields["weights"] = shifted("weights")
    else:
        fields["old_logprobs"] = shifted("logprobs")
        fields["advantages"] = shifted("advantages")
    return Datum(tokens=(*tokens, targets[-1]), **fields), n


def tensor(message: Any, what: str) -> np.ndarray:
    """A dense numpy array of a protobuf ``Tensor`` (float32, int64 or int32)."""
    if message.WhichOneof("encoding") != "dense":
        raise UnsupportedCall(f"{what}: only dense tensors are supported (1-D loss inputs)")
    dtype = _DTYPES.get(int(message.dtype))
    if dtype is None:
        raise InvalidTinkerRequest(f"{what}: unsupported dtype {message.dtype}")
    values = _array(message.dense, dtype, what)
    shape = list(message.shape) or [len(values)]
    if any(d < 0 for d in shape) or math.prod(shape) != len(values):
        raise InvalidTinkerRequest(f"{what}: shape {shape} but {len(values)} values")
    return values.reshape(shape)


def _array(raw: bytes, dtype: np.dtype, what: str) -> np.ndarray:
    if len(raw) % dtype.itemsize:
        raise InvalidTinkerRequest(f"{what}: {len(raw)} bytes is not a whole number of {dtype}")
    return np.frombuffer(raw, dtype=dtype)


# --- results ---------------------------------------------------------------------------------


def forward_backward_output(
    per_datum: Sequence[Sequence[float]], targets: Sequence[int], metrics: Mapping[str, float]
) -> bytes:
    """A protobuf ``ForwardBackwardOutput``: each datum's target log-probabilities
    (``per_datum``: PlexRL's, aligned with its tokens, entry 0 unused) and the metrics (keys
    ``name:reduction``, as the SDK combines chunks by the reduction)."""
    out = pb.ForwardBackwardOutput()
    out.loss_fn_output_type = "ArrayRecord"
    for key, value in metrics.items():
        out.metrics[key] = float(value)
    record = out.loss_fn_outputs.add()
    record.num_datums = len(per_datum)
    rows = [
        np.asarray(lp[1 : n + 1], dtype="<f4") for lp, n in zip(per_datum, targets, strict=True)
    ]
    field = record.fields["logprobs"]
    field.dtype = pb.DTYPE_FLOAT32
    field.data = b"".join(r.tobytes() for r in rows)
    field.offsets = np.cumsum([0] + [r.nbytes for r in rows]).astype("<i8").tobytes()
    return out.SerializeToString()


#: What the SDK reads as "no token here" in a top-k matrix.
_TOP_EMPTY = (0, -99999.0)


def sample_output(
    result: SampleResult,
    prompt_logprobs: Sequence[float] | None = None,
    prompt_top: tuple[np.ndarray, np.ndarray] | None = None,
    k: int = 0,
    skip: int = 1,
) -> bytes:
    """A protobuf ``SampleResponse`` of a one-prompt :class:`SampleResult`;
    ``prompt_logprobs`` (one per prompt token, NaN for the first) and ``prompt_top`` (the
    prompt's ``ForwardResult.top``: its tokens' ``k`` most probable, whose first ``skip``
    rows are sent empty) when asked for; ``k`` without ``prompt_top``: a one-token prompt's
    empty row."""
    out = pb.SampleResponse()
    for seq in result.sequences[0]:
        s = out.sequences.add()
        s.stop_reason = (
            pb.STOP_REASON_STOP if seq.finish_reason == "stop" else pb.STOP_REASON_LENGTH
        )
        s.tokens = np.asarray(seq.tokens, dtype="<i4").tobytes()
        s.logprobs = np.asarray(seq.logprobs, dtype="<f4").tobytes()
    if prompt_logprobs is not None:
        out.prompt_logprobs = np.asarray(prompt_logprobs, dtype="<f4").tobytes()
    if k:
        ids, values = prompt_top if prompt_top is not None else (np.zeros((1, 0)),) * 2
        n, got = ids.shape[0], ids.shape[1]
        # (k columns: fewer where the vocabulary is smaller; the first rows empty)
        token_ids = np.full((n, k), _TOP_EMPTY[0], dtype="<i4")
        logprobs = np.full((n, k), _TOP_EMPTY[1], dtype="<f4")
        token_ids[skip:, :got], logprobs[skip:, :got] = ids[skip:], values[skip:]
        top = out.topk_prompt_logprobs
        top.k, top.length = k, n
        top.token_ids, top.logprobs = token_ids.tobytes(), logprobs.tobytes()
    return out.SerializeToString()


# --- JSON bodies ---------------------------------------------------------------------------


def adam(params: Mapping[str, Any]) -> AdamWParams:
    """PlexRL's AdamW of a Tinker ``adam_params`` object (``grad_clip_norm`` 0: no clipping)."""
    if not isinstance(params, Mapping):
        raise InvalidTinkerRequest(f"adam_params is an object, got {type(params).__name__}")
    try:
        clip = float(params.get("grad_clip_norm", 0.0))
        return AdamWParams(
            lr=float(params["learning_rate"]),
            beta1=float(params.get("beta1", 0.9)),
            beta2=float(params.get("beta2", 0.95)),
            eps=float(params.get("eps", 1e-12)),
            weight_decay=float(params.get("weight_decay", 0.0)),
            grad_clip=None if clip == 0.0 else clip,
        )
    except (KeyError, TypeError, ValueError, OverflowError) as e:
        raise InvalidTinkerRequest(f"adam_params: {e!r}") from e


def count(value: Any, what: str) -> int:
    """``value``, a request's field ``what``, as an integer >= 0; else
    :class:`~plexrl_dask.errors.InvalidTinkerRequest`."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise InvalidTinkerRequest(f"{what} is an integer >= 0, got {value!r}")
    return value


def seq_id(body: Mapping[str, Any]) -> int:
    """A training model's request's ``seq_id`` (1, 2, ... per model, the SDK's order); else
    :class:`~plexrl_dask.errors.InvalidTinkerRequest`."""
    value = body.get("seq_id")
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise InvalidTinkerRequest(f"seq_id is an integer >= 1, got {value!r}")
    return value


def prompt_tokens(prompt: Any) -> list[int]:
    """The tokens of a JSON ``ModelInput`` (text chunks only)."""
    chunks = prompt.get("chunks") if isinstance(prompt, dict) else None
    if not isinstance(chunks, list) or not chunks:
        raise InvalidTinkerRequest("prompt is a ModelInput: {'chunks': [...]} with one or more")
    tokens: list[int] = []
    for chunk in chunks:
        if not isinstance(chunk, dict) or chunk.get("type", "encoded_text") != "encoded_text":
            raise UnsupportedCall("only encoded_text prompt chunks are supported (text only)")
        values = chunk.get("tokens")
        if not isinstance(values, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) for t in values
        ):
            raise InvalidTinkerRequest("an encoded_text chunk's tokens are a list of integers")
        tokens.extend(values)
    if not tokens:
        raise InvalidTinkerRequest("the prompt has no tokens")
    return tokens


def sampling_params(
    params: Any, num_samples: Any, eos_token_id: int | None, default_seed: int, room: int
) -> SamplingParams:
    """PlexRL's :class:`SamplingParams` of a Tinker ``sampling_params`` object. Stops: absent
    is the end-of-sequence token; strings are stop strings; token ids are the tokens that stop
    (the end-of-sequence token only if listed); ``[]`` decodes past the end-of-sequence token.
    Without ``max_tokens``, up to ``room`` (what the model's context leaves after the
    prompt)."""
    if not isinstance(params, dict):
        raise InvalidTinkerRequest("sampling_params is an object")
    top_k = params.get("top_k", -1)
    if top_k is None or top_k in (-1, 0):
        top_k = 0  # (Tinker's "no limit" is -1)
    elif isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 0:
        raise InvalidTinkerRequest(f"top_k is -1 (no limit) or an int >= 1, got {top_k!r}")
    stop = params.get("stop")
    strings: tuple[str, ...] = ()
    ids: tuple[int, ...] = ()
    ignore_eos = False
    if isinstance(stop, str):
        strings = (stop,)
    elif isinstance(stop, list) and stop and all(isinstance(s, str) for s in stop):
        strings = tuple(stop)
    elif isinstance(stop, list) and stop and all(_token_id(s) for s in stop):
        # the tokens that stop, instead of the end-of-sequence token unless it is one of them
        ids, ignore_eos = tuple(stop), eos_token_id not in stop
    elif stop == []:
        ignore_eos = True
    elif stop is not None:
        raise InvalidTinkerRequest(f"stop is a string, a list of strings or of token ids: {stop!r}")
    seed = params.get("seed")
    max_tokens = params.get("max_tokens")
    try:
        sampling = SamplingParams(
            n=num_samples,
            temperature=float(params.get("temperature", 1.0)),
            top_p=float(params.get("top_p", 1.0)),
            top_k=top_k,
            max_tokens=max_tokens if max_tokens is not None else max(1, room),
            stop=strings,
            seed=default_seed if seed is None else seed,
            ignore_eos=ignore_eos,
            stop_token_ids=ids,
        )
    except (TypeError, ValueError) as e:
        raise InvalidTinkerRequest(f"sampling_params: {e}") from e
    # (before a sequence id is made per sample: the worker would refuse it only later)
    check_rows(sampling.n, "a sample's num_samples")
    return sampling


def _token_id(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def derived_seed(*parts: object) -> int:
    """A seed in [0, 2**63) that is a pure function of ``parts`` (a sampling session and a
    request's seq_id): every request samples its own tokens, the same ones on a rerun."""
    digest = hashlib.sha256("/".join(map(str, parts)).encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


#: Tinker's LoRA config flags and the Qwen2/Llama modules each adapts
_LORA_MODULES = {
    "train_attn": ("q_proj", "k_proj", "v_proj", "o_proj"),
    "train_mlp": ("gate_proj", "up_proj", "down_proj"),
    "train_unembed": ("lm_head",),
}


def lora_flags(lora: dict[str, Any] | None) -> dict[str, bool | None]:
    """Tinker's LoRA flags of a ``LoraSpec`` dict (each true when the adapter wraps any of
    its modules; all None for full fine-tuning)."""
    targets = set(() if lora is None else lora["targets"])
    return {
        flag: None if lora is None else bool(targets & set(modules))
        for flag, modules in _LORA_MODULES.items()
    }


def lora_config(value: Any) -> dict[str, Any] | None:
    """A Tinker ``lora_config`` as a :class:`~plexrl_dask.models.spec.LoraSpec`'s dict, or
    None for rank 0 (full fine-tuning). Its flags choose the adapted modules (attention, MLP,
    unembedding: all by default); alpha is 32; an absent seed is 0, so a run is reproducible."""

    if value is None:
        return None
    if not isinstance(value, dict):
        raise InvalidTinkerRequest("lora_config is an object")
    rank = value.get("rank", 0)
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 0:
        raise InvalidTinkerRequest(f"lora_config.rank is an integer >= 0, got {rank!r}")
    if rank == 0:
        return None
    targets = tuple(
        m for flag, modules in _LORA_MODULES.items() if value.get(flag, True) for m in modules
    )
    seed = value.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise InvalidTinkerRequest(f"lora_config.seed is an integer, got {seed!r}")
    try:
        return LoraSpec(rank, 32.0, targets, 0 if seed is None else seed % 2**32).to_dict()
    except InvalidModelSpec as e:
        raise InvalidTinkerRequest(f"lora_config: {e}") from None
