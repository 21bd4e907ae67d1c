"""Chat prompts: rendered with the checkpoint's own chat template exactly as Hugging Face's
``apply_chat_template`` does, refused (typed) where the model has none or the messages are
malformed; the same tokens whether a backend, a task's problem or an episode tokenizes them."""

from __future__ import annotations

import pytest
from tokenizers import processors
from transformers import AutoTokenizer

import plexrl_dask as plexrl
from plexrl_dask import errors
from plexrl_dask.models.tokenizer import BOS, build_char_tokenizer, encode_prompts
from plexrl_dask.shared.checks import checked_sample
from plexrl_dask.shared.types import SamplingParams
from plexrl_dask.tasks.base import Problem
from plexrl_dask.worker.backends.torch_backend import TorchBackend

TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)
MESSAGES = [
    {"role": "system", "content": "Add."},
    {"role": "user", "content": "12+30="},
]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """A tiny checkpoint whose tokenizer adds BOS and has a chat template, and one without."""
    root = tmp_path_factory.mktemp("chat")
    spec = plexrl.ModelSpec.tiny(hidden_size=32, num_layers=1, seed=2)
    chat, plain = str(root / "chat"), str(root / "plain")
    spec.save_pretrained(plain)
    spec.save_pretrained(chat)
    tokenizer = build_char_tokenizer()
    bos = tokenizer.convert_tokens_to_ids(BOS)
    tokenizer.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", special_tokens=[(BOS, bos)]
    )
    tokenizer.chat_template = TEMPLATE
    tokenizer.save_pretrained(chat)
    return plexrl.ModelSpec(path=chat), plexrl.ModelSpec(path=plain)


def test_a_chat_renders_as_hugging_face_renders_it(checkpoints):
    chat_spec, plain_spec = checkpoints
    hf = AutoTokenizer.from_pretrained(chat_spec.path, local_files_only=True)
    want = list(
        hf.apply_chat_template(
            MESSAGES, add_generation_prompt=True, tokenize=True, return_dict=False
        )
    )
    assert hf.decode(want) == f"{BOS}system: Add.\nuser: 12+30=\nassistant:"
    backend = TorchBackend(chat_spec, "cpu", max_batch_size=4)
    chat = plexrl.Chat.of(MESSAGES)
    assert backend.tokenize([chat]) == [want]  # BOS once: the template's, not added again
    # text and token-id prompts beside it keep their own rules
    assert backend.tokenize(["7+1=", chat, [5, 6]])[::2] == [hf("7+1=")["input_ids"], [5, 6]]
    prompts, params, ids, _ = checked_sample([chat], SamplingParams(n=2, max_tokens=4, seed=1))
    out = backend.sample(backend.tokenize(prompts), params, ids)
    same = backend.sample([want], params, ids)
    assert [s.tokens for s in out[0]] == [s.tokens for s in same[0]]
    # a task's problem may be a chat; it tokenizes the same way
    assert Problem(chat, "42\n", 0).prompt == chat
    with pytest.raises(errors.NoChatTemplate):
        TorchBackend(plain_spec, "cpu", max_batch_size=4).tokenize([chat])


def test_malformed_chats_are_typed_errors():
    tokenizer = build_char_tokenizer()
    for bad in ((), (("user",),), (("", "x"),), (("user", 3),), "user: hi"):
        with pytest.raises(errors.InvalidSamplingParams):
            plexrl.Chat(bad)
    with pytest.raises(errors.InvalidSamplingParams):
        plexrl.Chat.of([{"role": "user"}])
    with pytest.raises(errors.InvalidSamplingParams):
        checked_sample([{"role": "user", "content": "hi"}], SamplingParams())
    with pytest.raises(errors.NoChatTemplate):  # (the character tokenizer has none)
        encode_prompts(tokenizer, [plexrl.Chat((("user", "hi"),))])


def test_a_worker_tokenizes_a_text_prompt_as_the_driver_configured(checkpoints, runtime):
    """The driver sets ``plexrl.sampling.special-tokens: false`` in its own process only
    (a worker process does not see it): ``sample`` carries the setting, so the worker
    prefills the ids ``Deployment.tokenize`` gives on the driver; a request may also say."""
    import dask

    from tests.conftest import unique

    chat_spec, _ = checkpoints
    dep = runtime.deploy(unique("bos"), chat_spec, role="rollout")
    params = plexrl.SamplingParams(n=1, max_tokens=2, seed=1)
    with_bos = dep.tokenize("7+1=")
    assert with_bos[0] == dep.tokenizer.convert_tokens_to_ids(BOS)
    with dask.config.set({"plexrl.sampling.special-tokens": False}):
        plain = dep.tokenize("7+1=")
        got = plexrl.result(dep.sample(["7+1="], params))
    assert plain == with_bos[1:] and list(got.prompt_tokens[0]) == plain
    asked = plexrl.SamplingParams(n=1, max_tokens=2, seed=1, special_tokens=True)
    with dask.config.set({"plexrl.sampling.special-tokens": False}):
        got = plexrl.result(dep.sample(["7+1="], asked))
    assert list(got.prompt_tokens[0]) == with_bos
    with pytest.raises(plexrl.errors.InvalidSamplingParams):
        plexrl.SamplingParams(special_tokens="yes")
