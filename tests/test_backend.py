"""The torch backend in-process: scoring, training, sampling, weights, residency, bad input."""

from __future__ import annotations

import math

import pytest
import torch

from plexrl_dask import errors
from plexrl_dask.models import ModelSpec
from plexrl_dask.shared.types import (
    AdamWParams,
    CrossEntropy,
    Datum,
    PolicyGradient,
    SamplingParams,
)
from plexrl_dask.worker.backends import RolloutBackend, TorchBackend, TrainBackend
from plexrl_dask.worker.device import local_nbytes
from tests.conftest import TINY, tiny_spec


@pytest.fixture
def backend() -> TorchBackend:
    torch.set_num_threads(1)
    return TorchBackend(tiny_spec(), "cpu", max_batch_size=64)


def toks(b: TorchBackend, text: str) -> list[int]:
    return b.tokenize([text])[0]


def test_implements_both_interfaces(backend):
    assert isinstance(backend, TrainBackend) and isinstance(backend, RolloutBackend)


def test_forward_matches_manual_log_softmax(backend):
    ids = toks(backend, "12+34=46")
    out = backend.forward([Datum(tokens=ids)]).logprobs[0]
    with torch.no_grad():
        logits = backend.model(input_ids=torch.tensor([ids])).logits[0]
    manual = torch.log_softmax(logits.float(), -1)[:-1].gather(-1, torch.tensor(ids[1:])[:, None])[
        :, 0
    ]
    assert out[0] == 0.0 and len(out) == len(ids)
    torch.testing.assert_close(torch.tensor(out[1:]), manual, atol=1e-5, rtol=0)


def test_forward_gives_each_positions_most_probable_tokens_when_asked(backend):
    short, long = toks(backend, "1+2=3"), toks(backend, "12+34=46")
    out = backend.forward([Datum(tokens=short), Datum(tokens=long)], top=3)
    assert out.logprobs == backend.forward([Datum(tokens=short), Datum(tokens=long)]).logprobs
    for ids, top in zip((short, long), out.top, strict=True):
        with torch.no_grad():
            logits = backend.model(input_ids=torch.tensor([ids])).logits[0, :-1].float()
        values, best = torch.log_softmax(logits, -1).topk(3, dim=-1)
        got_ids, got_values = top
        assert got_ids.shape == got_values.shape == (len(ids), 3)  # (padding's rows cut)
        assert (got_ids[0] == -1).all() and (got_values[0] == float("-inf")).all()
        assert got_ids.dtype.name == "int32" and got_values.dtype.name == "float32"
        assert got_ids[1:].tolist() == best.tolist()
        torch.testing.assert_close(torch.from_numpy(got_values[1:]), values)
    assert backend.forward([Datum(tokens=short)]).top is None
    for bad in (-1, 101, 2.0, True):
        with pytest.raises(errors.InvalidBatch, match="top"):
            backend.forward([Datum(tokens=short)], top=bad)


def test_padding_does_not_change_scores(backend):
    short, long = toks(backend, "1+2=3"), toks(backend, "12+34=46 and more")
    alone = backend.forward([Datum(tokens=short)]).logprobs[0]
    padded = backend.forward([Datum(tokens=short), Datum(tokens=long)]).logprobs[0]
    torch.testing.assert_close(torch.tensor(alone), torch.tensor(padded), atol=1e-5, rtol=0)


def test_cross_entropy_training_lowers_loss(backend):
    batch = [
        Datum.from_prompt_completion(toks(backend, f"{i}+{i}="), toks(backend, f"{2 * i}\n"))
        for i in range(8)
    ]
    first = backend.forward_backward(batch, CrossEntropy())["loss"]
    backend.optim_step(AdamWParams(lr=1e-2))
    for _ in range(20):
        backend.forward_backward(batch, CrossEntropy())
        backend.optim_step(AdamWParams(lr=1e-2))
    last = backend.forward_backward(batch, CrossEntropy())["loss"]
    assert last < 0.5 * first


@pytest.mark.parametrize("no_decay", ["none", "biases-and-norms"])
def test_optim_step_is_torch_adamw_at_the_requested_hyperparameters(no_decay):
    """Each step equals ``torch.optim.AdamW`` at the request's betas, eps and decay; with
    ``no_decay="biases-and-norms"`` the parameters Hugging Face's ``Trainer`` exempts from
    decay (its own rule, asked of it) get none, and the rest do."""
    import copy

    from transformers import Trainer

    torch.set_num_threads(1)
    spec = tiny_spec(seed=7)
    ours = TorchBackend(spec, "cpu")
    ref_model = copy.deepcopy(ours.model)
    params = AdamWParams(
        lr=0.05, beta1=0.8, beta2=0.95, eps=1e-4, weight_decay=0.5, grad_clip=None,
        no_decay=no_decay,
    )  # fmt: skip
    named = [(n, p) for n, p in ref_model.named_parameters() if p.requires_grad]
    decayed = set(Trainer.get_decay_parameter_names(None, ref_model))
    if no_decay == "none":
        groups = [{"params": [p for _, p in named], "weight_decay": 0.5}]
    else:
        assert {n for n, _ in named} - decayed  # (the tiny model has norms to exempt)
        groups = [
            {"params": [p for n, p in named if n in decayed], "weight_decay": 0.5},
            {"params": [p for n, p in named if n not in decayed], "weight_decay": 0.0},
        ]
    ref = torch.optim.AdamW(groups, lr=0.05, betas=(0.8, 0.95), eps=1e-4)
    batch = [
        Datum.from_prompt_completion(toks(ours, f"{i}+{i}="), toks(ours, f"{2 * i}\n"))
        for i in range(4)
    ]
    for _ in range(3):
        ours.forward_backward(batch, CrossEntropy())
        trained = (p for p in ours.model.parameters() if p.requires_grad)
        for (_, p), q in zip(named, trained, strict=True):
            p.grad = q.grad.clone()
        ours.optim_step(params)
        ref.step()
        ref.zero_grad(set_to_none=True)
    for (name, p), q in zip(ref_model.named_parameters(), ours.model.parameters(), strict=True):
        assert torch.equal(p, q), name


def test_split_batch_with_normalizer_equals_one_call():
    spec = tiny_spec()
    a, b = TorchBackend(spec, "cpu"), TorchBackend(spec, "cpu")
    data = [Datum(tokens=a.tokenize([f"{i}*{i}={i * i}"])[0]) for i in range(6)]
    total = sum(sum(d.token_weights()) for d in data)
    a.forward_backward(data, CrossEntropy())
    b.forward_backward(data[:3], CrossEntropy(normalizer=total))
    b.forward_backward(data[3:], CrossEntropy(normalizer=total))
    for (n, pa), (_, pb) in zip(
        a.model.named_parameters(), b.model.named_parameters(), strict=True
    ):
        torch.testing.assert_close(pa.grad, pb.grad, atol=1e-6, rtol=1e-5, msg=n)


def test_policy_gradient_moves_toward_positive_advantage(backend):
    prompt = toks(backend, "7+7=")
    good, bad = toks(backend, "14\n"), toks(backend, "99\n")
    data = [
        Datum.from_prompt_completion(prompt, good, advantage=1.0),
        Datum.from_prompt_completion(prompt, bad, advantage=-1.0),
    ]
    probe = [Datum.from_prompt_completion(prompt, good), Datum.from_prompt_completion(prompt, bad)]
    before = [sum(lp) for lp in backend.forward(probe).logprobs]
    for _ in range(5):
        m = backend.forward_backward(data, PolicyGradient(clip_low=0.2, clip_high=0.2))
        backend.optim_step(AdamWParams(lr=1e-2))
    after = [sum(lp) for lp in backend.forward(probe).logprobs]
    assert after[0] > before[0] and after[1] < before[1]
    assert 0.0 <= m["clip_fraction"] <= 1.0


def test_offload_reload_continues_bit_identically():
    spec = tiny_spec()
    a, b = TorchBackend(spec, "cpu"), TorchBackend(spec, "cpu")
    data = [Datum(tokens=a.tokenize([f"{i}-{i}=0"])[0]) for i in range(4)]
    for backend in (a, b):
        backend.forward_backward(data, CrossEntropy())
        backend.optim_step(AdamWParams(lr=1e-2))
        backend.forward_backward(data, CrossEntropy())  # pending gradients survive offload too
    size = a.state_bytes()  # (every named state tensor: weights, moments, pending gradients)
    assert size == sum(local_nbytes(t) for t in a._state_tensors().values())
    assert any(n.startswith("grad/") for n in a._state_tensors())
    assert any(n.startswith("optim/") for n in a._state_tensors())
    a.offload()
    assert not a.resident and a.state_bytes() == size
    assert all(p.numel() == 0 for p in a.model.parameters())  # device copies released
    a.reload()
    for backend in (a, b):
        backend.optim_step(AdamWParams(lr=1e-2))
        backend.forward_backward(data, CrossEntropy())
        backend.optim_step(AdamWParams(lr=1e-2))
    wa, wb = a.get_weights(), b.get_weights()
    assert all(torch.equal(wa[n], wb[n]) for n in wb)


def test_sampling_is_seeded_per_prompt_and_sample(backend):
    params = SamplingParams(n=3, temperature=1.0, max_tokens=8, seed=11)
    prompts = [toks(backend, "1+1="), toks(backend, "23+45="), toks(backend, "9*9=")]
    full = backend.sample(prompts, params, [0, 1, 2])
    again = backend.sample(prompts, params, [0, 1, 2])
    assert full == again  # bit-identical for the same request
    # Same prompt id alone, or in batches of other sizes: same tokens.
    alone = backend.sample([prompts[1]], params, [1])
    assert [s.tokens for s in alone[0]] == [s.tokens for s in full[1]]
    backend.max_batch_size = 2
    chunked = backend.sample(prompts, params, [0, 1, 2])
    for g_full, g_chunk in zip(full, chunked, strict=True):
        assert [s.tokens for s in g_full] == [s.tokens for s in g_chunk]
        for s_full, s_chunk in zip(g_full, g_chunk, strict=True):
            assert (
                max(abs(x - y) for x, y in zip(s_full.logprobs, s_chunk.logprobs, strict=True))
                < 1e-4
            )
    # Different seeds or prompt ids give different samples.
    other = backend.sample(
        prompts, SamplingParams(n=3, temperature=1.0, max_tokens=8, seed=12), [0, 1, 2]
    )
    assert [s.tokens for g in other for s in g] != [s.tokens for g in full for s in g]


def test_greedy_sampling_matches_forward(backend):
    prompt = toks(backend, "5+5=")
    out = backend.sample([prompt], SamplingParams(temperature=0.0, max_tokens=6), [0])[0][0]
    scored = backend.forward([Datum(tokens=prompt + list(out.tokens))]).logprobs[0][len(prompt) :]
    torch.testing.assert_close(torch.tensor(out.logprobs), torch.tensor(scored), atol=1e-4, rtol=0)
    with torch.no_grad():
        logits = backend.model(input_ids=torch.tensor([prompt])).logits[0, -1]
    assert out.tokens[0] == int(logits.argmax())


def test_stop_strings_and_eos(backend):
    # Teach the model to answer "7\n" then check the stop string truncates at the newline.
    prompt = toks(backend, "3+4=")
    data = [Datum.from_prompt_completion(prompt, toks(backend, "7\nxyz"))]
    for _ in range(60):
        backend.forward_backward(data, CrossEntropy())
        backend.optim_step(AdamWParams(lr=2e-2))
    out = backend.sample(
        [prompt], SamplingParams(temperature=0.0, max_tokens=10, stop=("\n",)), [0]
    )[0][0]
    assert out.text == "7\n" and out.finish_reason == "stop"
    out = backend.sample([prompt], SamplingParams(temperature=0.0, max_tokens=10), [0])[0][0]
    assert out.text.startswith("7\nxyz") and len(out.tokens) == 10 and out.finish_reason == "length"


def test_weights_roundtrip_and_mismatch(backend):
    other = TorchBackend(tiny_spec(seed=3), "cpu")
    w = other.get_weights()
    assert "lm_head.weight" not in w or "model.embed_tokens.weight" not in w  # tied: listed once
    backend.set_weights(w, version=7)
    assert backend.version == 7
    assert all(torch.equal(backend.get_weights()[n], t) for n, t in w.items())
    before = backend.get_weights()
    bad = dict(w)
    name = next(iter(bad))
    bad[name] = torch.zeros(3, 3)
    with pytest.raises(errors.WeightsMismatch, match="shape"):
        backend.set_weights(bad)
    with pytest.raises(errors.WeightsMismatch, match="unknown"):
        backend.set_weights({**w, "not.a.param": torch.zeros(1)})
    with pytest.raises(errors.WeightsMismatch, match="missing"):
        backend.set_weights({name: w[name]})
    backend.set_weights({name: w[name]}, strict=False)
    after = backend.get_weights()
    assert all(torch.equal(before[n], after[n]) for n in before)  # failed calls changed nothing


def test_bad_input_is_typed_and_harmless(backend):
    good = Datum(tokens=toks(backend, "1+1=2"))
    with pytest.raises(errors.TokenOutOfVocabulary, match="vocabulary"):
        backend.forward([Datum(tokens=[1, backend.vocab_size])])
    with pytest.raises(errors.TokenOutOfVocabulary):
        backend.sample([[-1, 3]], SamplingParams(), [0])
    with pytest.raises(errors.SequenceTooLong, match="positions"):
        backend.forward([Datum(tokens=[5] * (TINY["max_positions"] + 1))])
    with pytest.raises(errors.SequenceTooLong, match="max_tokens"):
        backend.sample([[5] * 60], SamplingParams(max_tokens=10), [0])
    with pytest.raises(errors.EmptyBatch):
        backend.forward([])
    with pytest.raises(errors.EmptyBatch):
        backend.sample([[]], SamplingParams(), [0])
    nan = Datum(tokens=good.tokens, advantages=[0.0] + [math.nan] * (len(good.tokens) - 1))
    with pytest.raises(errors.NonFiniteLoss):
        backend.forward_backward([nan], PolicyGradient())
    assert all(p.grad is None for p in backend.model.parameters())  # nothing accumulated
    with pytest.raises(errors.InvalidOptimizerParams, match="forward_backward first"):
        backend.optim_step(AdamWParams())
    # Still usable afterwards.
    backend.forward_backward([good], CrossEntropy())
    assert backend.optim_step(AdamWParams())["version"] == 1.0


def test_non_finite_gradient_is_discarded(backend):
    data = [Datum(tokens=toks(backend, "2+2=4"))]
    backend.forward_backward(data, CrossEntropy())
    before = backend.get_weights()
    next(backend.model.parameters()).grad[0, 0] = math.inf
    with pytest.raises(errors.NonFiniteGradient):
        backend.optim_step(AdamWParams())
    after = backend.get_weights()
    assert all(torch.equal(before[n], after[n]) for n in before)
    backend.forward_backward(data, CrossEntropy())
    backend.optim_step(AdamWParams())  # recovers


def test_tokenize_encodes_strings_in_one_call_and_keeps_token_lists(backend):
    """Strings are encoded together, token lists pass through, and the order is the
    caller's: the same ids as encoding each string on its own."""
    prompts = ["12+3=", [5, 6, 7], "9-4=", "", [1]]
    one_by_one = [
        list(backend.tokenizer(p, add_special_tokens=False)["input_ids"])
        if isinstance(p, str)
        else p
        for p in prompts
    ]
    assert backend.tokenize(prompts) == one_by_one
    assert backend.tokenize([[4, 2]]) == [[4, 2]] and backend.tokenize([]) == []


def test_local_checkpoint_loads_like_the_tiny_model(tmp_path):
    spec = tiny_spec(seed=5)
    path_spec = spec.save_pretrained(str(tmp_path / "ckpt"))
    a, b = TorchBackend(spec, "cpu"), TorchBackend(path_spec, "cpu")
    wa, wb = a.get_weights(), b.get_weights()
    assert wa.keys() == wb.keys() and all(torch.equal(wa[n], wb[n]) for n in wa)
    prompt = a.tokenize(["12+3="])[0]
    assert prompt == b.tokenize(["12+3="])[0]
    params = SamplingParams(n=2, max_tokens=5, seed=1)
    assert a.sample([prompt], params, [0]) == b.sample([prompt], params, [0])


def test_missing_checkpoint_path_is_a_clear_error(tmp_path):
    spec = ModelSpec(path=str(tmp_path / "nothing-here"))
    with pytest.raises(errors.InvalidModelSpec, match="config.json"):
        spec.memory_bytes("train")


def test_stop_strings_are_checked_on_token_pieces_exactly_as_on_decoded_text(backend):
    """The character tokenizer decodes by concatenation, so stop strings are found on token
    pieces without a decode per row and step; the pieces must be the decoded text, special
    tokens dropped, for every sequence."""
    import random

    from plexrl_dask.models.tokenizer import token_pieces

    pieces = backend._pieces
    assert pieces is not None and len(pieces) == backend.vocab_size
    rng = random.Random(0)
    for _ in range(300):
        ids = [rng.randrange(backend.vocab_size) for _ in range(rng.randint(1, 12))]
        assert backend.text(ids) == backend.tokenizer.decode(ids, skip_special_tokens=True)
    assert backend.text([]) == ""
    # Sampling with a stop string stops where the decoded text first contains it.
    params = SamplingParams(n=6, temperature=1.0, max_tokens=12, stop=("1", "+"), seed=4)
    out = backend.sample([toks(backend, "3+4=")], params, [0])[0]
    for s in out:
        cut = [
            backend.tokenizer.decode(s.tokens[:k], skip_special_tokens=True)
            for k in range(1, len(s.tokens) + 1)
        ]
        hits = [k for k, text in enumerate(cut) if "1" in text or "+" in text]
        assert s.text == cut[-1]  # the completion's text, joined from pieces, is its decode
        assert (s.finish_reason == "stop") == bool(hits) or s.tokens[-1] == backend.eos_token_id
        if hits:
            assert hits[0] == len(s.tokens) - 1
    # A tokenizer that does not decode by concatenation is decoded instead.
    from tokenizers import decoders

    other = ModelSpec.tiny(**TINY).build_tokenizer()
    other.backend_tokenizer.decoder = decoders.WordPiece()
    assert token_pieces(other) is None
    backend._pieces = None  # such a backend's texts are the tokenizer's decode
    try:
        ids = [5, 6, backend.eos_token_id, 7]
        assert backend.text(ids) == backend.tokenizer.decode(ids, skip_special_tokens=True)
    finally:
        backend._pieces = pieces


class _Planted:
    """Unpickling this writes a file: what a planted DCP ``.metadata`` could do."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def _train_step(b: TorchBackend) -> None:
    data = [Datum(tokens=toks(b, "1+2=3"))]
    b.forward_backward(data, CrossEntropy())
    b.optim_step(AdamWParams(lr=1e-2))


def test_a_dcp_import_checks_its_files_before_unpickling_anything(tmp_path):
    """DCP's metadata is a pickle: an export carries the digest of every file, and an import
    refuses a changed, added or missing file, and a directory others may write, before DCP
    reads a byte; the loaded state is untouched."""
    import os
    import pickle

    src, dst = TorchBackend(tiny_spec(), "cpu"), TorchBackend(tiny_spec(seed=5), "cpu")
    _train_step(src)
    path = str(tmp_path / "export")
    assert src.save_state(path)["format"] == "dcp"
    before = {n: t.clone() for n, t in dst.get_weights().items()}
    marker = str(tmp_path / "pwned")
    metadata = tmp_path / "export" / ".metadata"
    original = metadata.read_bytes()
    metadata.write_bytes(pickle.dumps(_Planted(marker)))
    with pytest.raises(errors.CheckpointCorrupt, match="changed since the export"):
        dst.load_state(path)
    assert not os.path.exists(marker)  # never unpickled
    metadata.write_bytes(original)
    data_file = next(p for p in sorted((tmp_path / "export").iterdir()) if p.suffix == ".distcp")
    blob = bytearray(data_file.read_bytes())
    blob[len(blob) // 2] ^= 0xFF
    data_file.write_bytes(bytes(blob))
    with pytest.raises(errors.CheckpointCorrupt, match=data_file.name):
        dst.load_state(path)
    blob[len(blob) // 2] ^= 0xFF
    data_file.write_bytes(bytes(blob))
    (tmp_path / "export" / "extra.distcp").write_bytes(b"x")
    with pytest.raises(errors.CheckpointCorrupt, match="added"):
        dst.load_state(path)
    (tmp_path / "export" / "extra.distcp").unlink()
    os.chmod(path, 0o777)
    with pytest.raises(errors.PermissionDenied, match="writable by others"):
        dst.load_state(path)
    os.chmod(path, 0o755)
    (tmp_path / "export" / "plexrl.json").write_text("{not json")
    with pytest.raises(errors.CheckpointCorrupt, match="JSON"):
        dst.load_state(path)
    after = dst.get_weights()
    assert all(torch.equal(after[n], t) for n, t in before.items())
    src.save_state(path)  # exported again: it loads, bit for bit
    assert dst.load_state(path) == src.version
    want = src.get_weights()
    assert all(torch.equal(dst.get_weights()[n], t) for n, t in want.items())


def test_a_store_checkpoint_loads_without_unpickling(tmp_path, monkeypatch):
    """Store checkpoints are JSON and raw bytes: with every unpickler refusing, one loads."""
    import pickle

    from plexrl_dask.state_store.store import StateStore
    from plexrl_dask.worker.replica_checkpoint import StoreCheckpoint

    src, dst = TorchBackend(tiny_spec(), "cpu"), TorchBackend(tiny_spec(seed=5), "cpu")
    _train_step(src)
    store = StateStore(tmp_path / "store", create=True, durable=True)
    src.save_state(StoreCheckpoint(store, "policy", src.version))

    def refuse(*args, **kwargs):
        raise AssertionError("a store checkpoint was unpickled")

    for name in ("load", "loads", "Unpickler"):
        monkeypatch.setattr(pickle, name, refuse)
    monkeypatch.setattr(torch, "load", refuse)
    assert dst.load_state(StoreCheckpoint(StateStore(tmp_path / "store"), "policy")) == 1
    want = src.get_weights()
    assert all(torch.equal(dst.get_weights()[n], t) for n, t in want.items())


def test_string_prompts_are_tokenized_as_hugging_face_does_with_the_checkpoints_bos(tmp_path):
    """A checkpoint whose tokenizer's post-processor adds BOS: prompts get it, as
    ``AutoTokenizer`` gives it; completions and ``plexrl.sampling.special-tokens: false`` do
    not."""
    import dask
    from tokenizers import processors
    from transformers import AutoTokenizer

    from plexrl_dask.models.tokenizer import BOS, build_char_tokenizer

    path = tmp_path / "with-bos"
    spec = tiny_spec(seed=6).save_pretrained(str(path))
    tokenizer = build_char_tokenizer()
    bos = tokenizer.convert_tokens_to_ids(BOS)
    tokenizer.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", special_tokens=[(BOS, bos)]
    )
    tokenizer.save_pretrained(str(path))
    hf = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    want = hf("12+3=")["input_ids"]
    assert want[0] == bos and len(want) == 6

    backend = TorchBackend(spec, "cpu")
    assert backend.tokenize(["12+3="]) == [want]
    assert backend.tokenize(["3\n"], special_tokens=False) == [
        hf("3\n", add_special_tokens=False)["input_ids"]
    ]
    params = SamplingParams(n=2, max_tokens=4, seed=2)
    assert backend.sample(backend.tokenize(["12+3="]), params, [0]) == backend.sample(
        [want], params, [0]
    )
    with dask.config.set({"plexrl.sampling.special-tokens": False}):
        assert backend.tokenize(["12+3="]) == [want[1:]]
    with (
        dask.config.set({"plexrl.sampling.special-tokens": "yes"}),
        pytest.raises(errors.ConfigError),
    ):
        backend.tokenize(["12+3="])


def test_the_exempt_parameters_are_hugging_faces_where_norms_are_not_named_norm():
    """``no_decay="biases-and-norms"`` exempts what Hugging Face's ``Trainer`` does, norms
    found by type: GPT-2 names its ``ln_1``, ``ln_2``, ``ln_f``, which no name rule finds."""
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer

    from plexrl_dask.worker.optimizer import EXEMPT, new_adamw, norm_parameter_names

    config = GPT2Config(n_layer=2, n_embd=16, n_head=2, vocab_size=64, n_positions=32)
    model = GPT2LMHeadModel(config)
    optimizer = new_adamw(model.named_parameters(), norm_parameter_names(model))
    exempt = {id(p) for g in optimizer.param_groups if g[EXEMPT] for p in g["params"]}
    ours = {n for n, p in model.named_parameters() if id(p) in exempt}
    decayed = set(Trainer.get_decay_parameter_names(None, model))
    assert "transformer.ln_f.weight" in ours
    assert ours == {n for n, _ in model.named_parameters()} - decayed


def test_a_policy_gradient_is_taken_at_the_temperature_its_completions_were_sampled_at():
    """The log-probabilities a policy-gradient step differentiates are those of
    ``softmax(logits / temperature)``, as ``forward`` scores them at that temperature."""
    from plexrl_dask.rl.objective import GRPOConfig
    from plexrl_dask.shared.types import PolicyGradient

    b = TorchBackend(tiny_spec(seed=4), "cpu")
    batch = [
        Datum.from_prompt_completion(toks(b, f"{i}+{i}="), toks(b, f"{2 * i}\n"), advantage=1.0)
        for i in range(3)
    ]
    scored = b.forward(batch, temperature=0.7).logprobs
    out = b.forward_backward(batch, PolicyGradient(temperature=0.7), logprobs=True)
    for got, want in zip(out.logprobs, scored, strict=True):
        assert got == pytest.approx(want, abs=1e-6)
    assert out.logprobs != b.forward(batch).logprobs  # (not at temperature 1)
    assert GRPOConfig(temperature=0.7).loss(3).temperature == 0.7
    assert GRPOConfig(temperature=0.0).loss(3).temperature == 1.0  # (greedy: the logits')
    with pytest.raises(errors.InvalidLoss):
        PolicyGradient(temperature=0.0)


def test_sampling_ends_at_the_generation_configs_end_of_turn_token_as_hugging_face(tmp_path):
    """An instruct checkpoint lists its end-of-turn token in ``generation_config.json``, not as
    the tokenizer's EOS: Hugging Face's generate stops there, and so does a replica."""
    from transformers import AutoModelForCausalLM, GenerationConfig

    spec = tiny_spec(seed=3)
    greedy = SamplingParams(n=1, temperature=0.0, max_tokens=6)
    plain = TorchBackend(spec, "cpu")
    prompt = toks(plain, "12+3=")
    first = plain.sample([prompt], greedy, [0])[0][0].tokens[0]
    path = tmp_path / "ckpt"
    spec.save_pretrained(str(path))
    GenerationConfig(eos_token_id=[2, first]).save_pretrained(str(path))
    checkpoint = ModelSpec(path=str(path))
    out = TorchBackend(checkpoint, "cpu").sample([prompt], greedy, [0])[0][0]
    assert out.tokens == (first,)
    model = AutoModelForCausalLM.from_pretrained(str(path), local_files_only=True)
    ids = torch.tensor([prompt])
    hf = model.generate(ids, max_new_tokens=6, do_sample=False)[0, ids.shape[1] :]
    assert hf.tolist() == [first]


def test_a_checkpoint_missing_a_weight_or_its_tokenizer_is_refused(tmp_path):
    """Hugging Face would initialise a missing weight at random, apart on every worker (no
    seed): replicas of one spec would differ. A directory without tokenizer files gave a
    tokenizer of one token, and every prompt tokenized to nothing."""
    from safetensors.torch import load_file, save_file

    path = tmp_path / "ckpt"
    tiny_spec(seed=3).save_pretrained(str(path))
    weights = load_file(str(path / "model.safetensors"))
    dropped = next(k for k in weights if "mlp.down_proj" in k)
    save_file({k: v for k, v in weights.items() if k != dropped}, str(path / "model.safetensors"),
              metadata={"format": "pt"})  # fmt: skip
    with pytest.raises(errors.InvalidModelSpec, match="no weights for"):
        ModelSpec(path=str(path)).build_model()
    bare = tmp_path / "bare"
    tiny_spec(seed=3).save_pretrained(str(bare))
    for f in bare.glob("tokenizer*"):
        f.unlink()
    with pytest.raises(errors.InvalidModelSpec):
        ModelSpec(path=str(bare)).build_tokenizer()
