"""Adapter banks (plexrl_dask/worker/backends/adapters.py), in-process on a real tiny Qwen2.

What it promises: one request's prompts of several LoRA adapters (and of the base) decode
together, each sampling the bits it samples alone on its own LoRA replica; the adapters
survive an offload; what the bank cannot do is refused with a typed error and changes
nothing.
"""

from __future__ import annotations

import pytest
import torch

from plexrl_dask import errors
from plexrl_dask.models.spec import LORA_TARGETS
from plexrl_dask.shared.types import SamplingParams, Streams
from plexrl_dask.state_store.store import StateStore
from plexrl_dask.worker.backends import AdapterBank, SharedBases, TorchBackend
from plexrl_dask.worker.backends.lora import LoraBackend
from plexrl_dask.worker.replica_checkpoint import StoreCheckpoint
from tests.conftest import tiny_spec
from tests.test_decode import one_thread  # noqa: F401 (autouse)

PROMPTS = ["12+3=", "4+5=", "99+1=", "7*8=", "1+1=", "60-7="]
PARAMS = SamplingParams(n=2, temperature=1.0, max_tokens=10, stop=("1", "5"), seed=3)
INVARIANT = Streams(128, 16, invariant=True)


def adapter(bases: SharedBases, seed: int, targets: tuple[str, ...]) -> LoraBackend:
    """A LoRA replica on ``bases``' base whose adapter changes the outputs (B starts at 0)."""
    spec = tiny_spec(seed=5).with_lora(4, alpha=16, targets=targets, seed=seed)
    b = LoraBackend(spec, "cpu", max_batch_size=8, bases=bases, user=f"t{seed}")
    with torch.no_grad():
        gen = torch.Generator().manual_seed(seed)
        for name, p in b.model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
    return b


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    bases = SharedBases("cpu")
    a = adapter(bases, 1, (*LORA_TARGETS, "lm_head"))
    b = adapter(bases, 2, ("q_proj", "v_proj"))  # another rank of targets: fewer modules
    store = StateStore(tmp_path_factory.mktemp("store"), create=True)
    saved = {}
    for name, replica in (("a", a), ("b", b)):
        replica.save_state(StoreCheckpoint(store, name, None))
        saved[name] = StoreCheckpoint(store, name, replica.version)
    bank = AdapterBank(tiny_spec(seed=5), "cpu", max_batch_size=8, bases=bases, user="bank")
    assert bank.load_adapter("a", a.spec, saved["a"]) == a.version
    bank.load_adapter("b", b.spec, saved["b"])
    return bank, a, b, saved


def alone(replica: TorchBackend, prompt: list[int], pid: int) -> list:
    return replica.sample([prompt], PARAMS, [pid], INVARIANT)[0]


def test_prompts_of_several_adapters_sample_as_each_does_alone(setup):
    bank, a, b, _ = setup
    assert bank.model is a.bases.acquire(bank.spec, "probe")  # one base for all of them
    a.bases.release(bank.spec, "probe")
    prompts = bank.tokenize(PROMPTS)
    keys = ["a", "b", None, "a", "b", None]
    ids = [11 * i + 1 for i in range(len(prompts))]
    together = bank.sample(prompts, PARAMS, ids, INVARIANT, adapters=keys)
    base = TorchBackend(tiny_spec(seed=5), "cpu", max_batch_size=8)
    for i, key in enumerate(keys):
        own = {"a": a, "b": b, None: base}[key]
        assert together[i] == alone(own, prompts[i], ids[i]), (i, key)
    # the adapters matter: the same prompt differs under each
    assert len({str(alone(r, prompts[0], 1)) for r in (a, b, base)}) == 3
    # any order and batch size: the same bits per prompt
    bank.max_batch_size = 3
    order = [5, 2, 0, 4, 1, 3]
    again = bank.sample(
        [prompts[i] for i in order], PARAMS, [ids[i] for i in order], INVARIANT,
        adapters=[keys[i] for i in order],
    )  # fmt: skip
    bank.max_batch_size = 8
    assert [again[order.index(i)] for i in range(6)] == together
    # scoring under an adapter is that adapter's
    datum = [a.tokenize(["12+3=4"])[0]]
    from plexrl_dask.shared.types import Datum

    batch = [Datum(tokens=datum[0])]
    assert bank.forward(batch, adapter="a") == a.forward(batch)
    assert bank.forward(batch) == base.forward(batch)


def test_the_adapters_survive_an_offload(setup):
    bank, a, _, saved = setup
    bank.load_adapter("a", a.spec, saved["a"])  # (a replaced adapter keeps its own weights)
    prompts = bank.tokenize(PROMPTS[:4])
    keys = ["b", "a", "a", None]
    before = bank.sample(prompts, PARAMS, [1, 2, 3, 4], INVARIANT, adapters=keys)
    own = bank.state_bytes()
    assert own == sum(x.state_bytes() for x in bank.adapters.values()) > 0
    bank.offload()
    assert not bank.resident and bank.adapters == {} and bank.state_bytes() == own
    assert bank.reload_bytes() >= own  # (and the base, where no other replica holds it)
    bank.reload()
    assert bank.sample(prompts, PARAMS, [1, 2, 3, 4], INVARIANT, adapters=keys) == before
    assert bank.sample(prompts[1:2], PARAMS, [2], INVARIANT, adapters=["a"])[0] == alone(
        a, prompts[1], 2
    )


def test_what_a_bank_cannot_do_is_refused_and_changes_nothing(setup, tmp_path):
    bank, a, _, saved = setup
    prompts = bank.tokenize(PROMPTS[:2])
    with pytest.raises(errors.AdapterNotFound):
        bank.sample(prompts, PARAMS, [0, 1], INVARIANT, adapters=["a", "nope"])
    other = tiny_spec(seed=6).with_lora(4, seed=1)  # an adapter of another base
    with pytest.raises(errors.InvalidModelSpec):
        bank.load_adapter("c", other, saved["a"])
    with pytest.raises(errors.InvalidModelSpec):
        AdapterBank(a.spec, "cpu")  # a bank is deployed on the base's spec
    wider = tiny_spec(seed=5).with_lora(8, seed=1)  # the stored adapter is of rank 4
    with pytest.raises(errors.PlexRLError):
        bank.load_adapter("a", wider, saved["a"])
    with pytest.raises(errors.OpNotSupported):
        bank.optim_step(None)
    with pytest.raises(errors.OpNotSupported):
        bank.load_state(saved["a"])
    assert sorted(bank.adapters) == ["a", "b"]
    assert bank.drop_adapter("b") and not bank.drop_adapter("b")
    with pytest.raises(errors.AdapterNotFound):
        bank.sample(prompts, PARAMS, [0, 1], INVARIANT, adapters=["b", None])
    bank.load_adapter("b", setup[2].spec, saved["b"])


def test_without_row_invariant_products_each_prompt_samples_alone(setup, monkeypatch):
    """Where the probe finds no row-invariant products (a device whose kernels change with
    the row count), a bank serves each prompt on its adapter alone, and a replica each prompt
    as a stream of its own: still what each samples alone, merged or not."""
    from plexrl_dask.worker import row_decode

    bank, a, _, _ = setup

    def refuse(*bounds):
        raise errors.OpNotSupported("no row-invariant products (test)")

    monkeypatch.setattr(row_decode, "invariance", refuse)
    prompts = bank.tokenize(PROMPTS[:4])
    keys = ["a", None, "b", "a"]
    together = bank.sample(prompts, PARAMS, [1, 2, 3, 4], INVARIANT, adapters=keys)
    for i, key in enumerate(keys):
        alone = bank.sample([prompts[i]], PARAMS, [i + 1], INVARIANT, adapters=[key])
        assert together[i] == alone[0]
    assert together[0] == a.sample([prompts[0]], PARAMS, [1], INVARIANT)[0]
    merged = a.sample(prompts, PARAMS, [1, 2, 3, 4], INVARIANT)
    assert merged[3] == a.sample([prompts[3]], PARAMS, [4], INVARIANT)[0]
