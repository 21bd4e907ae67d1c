"""plexrl serve, driven by the unmodified Tinker SDK (``tinker``) on a real process cluster:
every supported call, the same numbers as the Python Runtime, and typed refusals of bad
input that leave other tenants' state untouched."""

from __future__ import annotations

import contextlib
import math
import os
import time
from concurrent.futures import ThreadPoolExecutor

import dask
import numpy as np
import pytest
import torch

tinker = pytest.importorskip("tinker", reason="the serve extra (tinker SDK) is not installed")
httpx = pytest.importorskip("httpx")

from distributed import Client  # noqa: E402
from tinker import types  # noqa: E402

import plexrl_dask as plexrl  # noqa: E402
from plexrl_dask.serve.app import ServerThread  # noqa: E402
from plexrl_dask.serve.service import Service  # noqa: E402
from plexrl_dask.serve.tenants import KeyRing, add_key  # noqa: E402
from tests.conftest import tiny_spec, unique  # noqa: E402

os.environ.setdefault("TINKER_TELEMETRY", "0")
BASE = "tiny-qwen"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("serve")
    checkpoint = str(root / "tiny")
    tiny_spec(seed=3).save_pretrained(checkpoint)
    keys = root / "keys.yaml"
    alice, bob = add_key(keys, "alice"), add_key(keys, "bob")
    small, single = add_key(keys, "small"), add_key(keys, "single")
    limits = "    limits: {request-bytes: 2048, requests-waiting: 2}\n"
    text = keys.read_text().replace("  small:\n", "  small:\n" + limits)
    limits = "    limits: {models: 1, samplers: 1, checkpoints: 1}\n"
    text = text.replace("  single:\n", "  single:\n" + limits)
    keys.write_text(text)
    with (
        plexrl.local_cluster(n_workers=2) as cluster,
        Client(cluster, set_as_default=False) as client,
        ServerThread(client, KeyRing.from_file(keys), {BASE: checkpoint}) as srv,
    ):
        yield srv, client, {"alice": alice, "bob": bob, "small": small, "single": single}
        close_clients(srv)


#: Every SDK client a test made, by the server it talks to: each is closed before its server
#: stops, so that none goes on sending heartbeats to a server that is gone.
CLIENTS: dict[str, list] = {}


def sdk(srv, key):
    sc = tinker.ServiceClient(base_url=srv.url, api_key=key)
    CLIENTS.setdefault(srv.url, []).append(sc)
    return sc


def close_clients(srv, finish: bool = True) -> None:
    """Close ``srv``'s SDK clients: ending their sessions (``finish``), or, for a server
    that crashed, only stopping what runs in this process (the SDK has no public call that
    stops a session's heartbeats without telling its server)."""
    for sc in CLIENTS.pop(srv.url, []):
        if finish:
            with contextlib.suppress(Exception):
                sc.close("success").result(timeout=30)
        else:
            for holder in (sc._session_holder, sc._rest_holder):
                if holder is not None:
                    holder.close()


def ce_datum(tokens, first_trained=2):
    weights = [0.0] * (first_trained - 1) + [1.0] * (len(tokens) - first_trained)
    return types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": tokens[1:], "weights": weights},
    )


def rl_datum(tokens, q, adv):
    n = len(tokens) - 1
    return types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={
            "target_tokens": tokens[1:],
            "logprobs": np.full(n, q, dtype=np.float32),
            "advantages": np.full(n, adv, dtype=np.float32),
        },
    )


A = [5, 20, 21, 22, 23, 24, 25]
B = [5, 30, 31, 32, 33]


def test_the_sdk_trains_and_samples_with_the_runtimes_numbers(server):
    srv, client, keys = server
    sc = sdk(srv, keys["alice"])
    caps = tinker.RestClient(base_url=srv.url, api_key=keys["alice"]).get_server_capabilities()
    caps = caps.result()
    assert [m.model_name for m in caps.supported_models] == [BASE]
    tc = sc.create_lora_training_client(base_model=BASE, rank=0).result()
    info = tc.get_info()
    assert info.model_data.model_name == BASE and not info.is_lora

    # the same deployment, seen through the Python Runtime of the tenant's job
    runtime = plexrl.Runtime(client, job="tinker-alice")
    [dep] = [d for d in runtime.deployments() if ":train:" in d.name]
    policy = runtime.deployment(dep.name)
    before = plexrl.result(policy.forward([plexrl.Datum(tokens=A)])).logprobs[0]

    fb = tc.forward_backward([ce_datum(A), ce_datum(B)], "cross_entropy")
    step = tc.optim_step(types.AdamParams(learning_rate=1e-2))
    out = fb.result()
    lp = [o["logprobs"].tolist() for o in out.loss_fn_outputs]
    assert [len(x) for x in lp] == [len(A) - 1, len(B) - 1]
    assert lp[0] == pytest.approx(before[1:], abs=1e-5)  # pre-step log-probs, like Runtime's
    weights = [ce_datum(x).loss_fn_inputs["weights"].tolist() for x in (A, B)]
    summed = -sum(
        w * x for ws, xs in zip(weights, lp, strict=True) for w, x in zip(ws, xs, strict=True)
    )
    assert out.metrics["loss:sum"] == pytest.approx(summed, rel=1e-4)  # a sum, not a mean
    assert step.result().metrics

    after = plexrl.result(policy.forward([plexrl.Datum(tokens=A)])).logprobs[0]
    fwd = tc.forward([ce_datum(A)], "cross_entropy").result()
    assert fwd.loss_fn_outputs[0]["logprobs"].tolist() == pytest.approx(after[1:], abs=1e-5)
    assert after != before

    # importance sampling (no clipping) and PPO (clipped ratio) with the SDK's semantics
    isr = tc.forward_backward([rl_datum(A, -2.0, 0.5)], "importance_sampling").result()
    cur = isr.loss_fn_outputs[0]["logprobs"].tolist()
    want = -sum(math.exp(x + 2.0) * 0.5 for x in cur)
    assert isr.metrics["loss:sum"] == pytest.approx(want, rel=1e-4)
    # per-token inputs that differ by position: each pairs with its own target token
    rng = np.random.default_rng(0)
    q, adv = rng.uniform(-4, -1, len(A) - 1), rng.uniform(-1, 1, len(A) - 1)
    varied = types.Datum(
        model_input=types.ModelInput.from_ints(A[:-1]),
        loss_fn_inputs={"target_tokens": A[1:], "logprobs": q.astype(np.float32),
                        "advantages": adv.astype(np.float32)},
    )  # fmt: skip
    out = tc.forward([varied], "importance_sampling").result()
    lp = out.loss_fn_outputs[0]["logprobs"].tolist()
    q, adv = q.astype(np.float32).tolist(), adv.astype(np.float32).tolist()
    want = -sum(math.exp(x - y) * a for x, y, a in zip(lp, q, adv, strict=True))
    assert out.metrics["loss:sum"] == pytest.approx(want, rel=1e-4)
    ppo = tc.forward_backward(
        [rl_datum(A, -2.0, 0.5)], "ppo", {"clip_low_threshold": 0.9, "clip_high_threshold": 1.1}
    ).result()
    want = -sum(min(math.exp(x + 2.0), 1.1) * 0.5 for x in cur)
    assert ppo.metrics["loss:sum"] == pytest.approx(want, rel=1e-4)
    # CISPO (the clipped ratio weighs the log-probability) and DRO (a quadratic penalty),
    # each scored on the varied datum, forward only, with their configs and without
    bounds = {"clip_low_threshold": 0.9, "clip_high_threshold": 1.1}
    for config, (lo, hi) in ((bounds, (0.9, 1.1)), (None, (0.8, 1.2))):
        out = tc.forward([varied], "cispo", config).result()
        lp = out.loss_fn_outputs[0]["logprobs"].tolist()
        want = -sum(
            min(max(math.exp(x - y), lo), hi) * x * a for x, y, a in zip(lp, q, adv, strict=True)
        )
        assert out.metrics["loss:sum"] == pytest.approx(want, rel=1e-4)
    for config, beta in (({"beta": 0.3}, 0.3), (None, 0.05)):
        out = tc.forward([varied], "dro", config).result()
        lp = out.loss_fn_outputs[0]["logprobs"].tolist()
        want = -sum(x * a - 0.5 * beta * (x - y) ** 2 for x, y, a in zip(lp, q, adv, strict=True))
        assert out.metrics["loss:sum"] == pytest.approx(want, rel=1e-4)
    tc.optim_step(types.AdamParams(learning_rate=1e-3)).result()

    # sampling from the policy's own replica at this step
    sampler = tc.save_weights_and_get_sampling_client().result()
    prompt = types.ModelInput.from_ints(A[:3])
    params = types.SamplingParams(max_tokens=4, temperature=1.0)
    res = sampler.sample(prompt, 3, params).result()
    assert len(res.sequences) == 3
    for seq in res.sequences:
        assert len(seq.tokens) == len(seq.logprobs) >= 1 and seq.stop_reason in ("stop", "length")
    seeded = types.SamplingParams(max_tokens=4, temperature=1.0, seed=11)
    one, two = (sampler.sample(prompt, 2, seeded).result() for _ in range(2))
    assert [s.tokens for s in one.sequences] == [s.tokens for s in two.sequences]
    scores = sampler.compute_logprobs(types.ModelInput.from_ints(A)).result()
    now = plexrl.result(policy.forward([plexrl.Datum(tokens=A)])).logprobs[0]
    assert scores[0] is None and scores[1:] == pytest.approx(now[1:], abs=1e-5)

    # named weights: a checkpoint a new sampler loads; a sampler of the base model
    path = tc.save_weights_for_sampler("step2").result().path
    assert path.startswith("tinker://") and path.endswith("/sampler_weights/step2")
    loaded = sc.create_sampling_client(model_path=path).result()
    greedy = types.SamplingParams(max_tokens=4, temperature=0.0)
    assert loaded.sample(prompt, 1, greedy).result().sequences[0].tokens == (
        sampler.sample(prompt, 1, greedy).result().sequences[0].tokens
    )
    # top-k: the one most probable token at any temperature is the greedy choice
    top1 = types.SamplingParams(max_tokens=4, temperature=1.5, top_k=1, seed=5)
    assert [s.tokens for s in sampler.sample(prompt, 3, top1).result().sequences] == [
        sampler.sample(prompt, 1, greedy).result().sequences[0].tokens
    ] * 3
    base = sc.create_sampling_client(base_model=BASE).result()
    assert len(base.sample(prompt, 1, greedy).result().sequences) == 1
    # without max_tokens: up to what the context leaves after the prompt
    unbounded = types.SamplingParams(temperature=1.0, stop=[], seed=3)
    [seq] = base.sample(prompt, 1, unbounded).result().sequences
    assert len(seq.tokens) == 64 - 3 and seq.stop_reason == "length"
    # stop token ids other than the end-of-sequence token: the first one drawn ends it
    stop_id = seq.tokens[5]
    stopped = types.SamplingParams(temperature=1.0, stop=[stop_id], seed=3)
    [short] = base.sample(prompt, 1, stopped).result().sequences
    end = seq.tokens.index(stop_id) + 1
    assert short.tokens == seq.tokens[:end] and short.stop_reason == "stop"
    state = tc.save_state("state2").result().path
    assert state.endswith("/weights/state2")
    # a new run from the saved weights (fresh optimizer), and one with the optimizer state
    saved_lp = tc.forward([ce_datum(A)], "cross_entropy").result().loss_fn_outputs[0]
    for make in (sc.create_training_client_from_state, sc.create_training_client_from_state_with_optimizer):  # fmt: skip
        other = make(state).result()
        got = other.forward([ce_datum(A)], "cross_entropy").result().loss_fn_outputs[0]
        assert got["logprobs"].tolist() == saved_lp["logprobs"].tolist()
    run = tinker.RestClient(base_url=srv.url, api_key=keys["alice"])
    assert run.get_training_run_by_tinker_path(state).result().base_model == BASE

    # a later step leaves the snapshot sampler its weights (a copy saved before the step), as
    # asynchronous recipes need; with kept-snapshots 0 it is refused, typed
    before = sampler.sample(prompt, 2, seeded).result()
    tc.forward_backward([ce_datum(A)], "cross_entropy").result()
    tc.optim_step(types.AdamParams(learning_rate=1e-3)).result()
    after = sampler.sample(prompt, 2, seeded).result()
    assert [(s.tokens, s.logprobs) for s in after.sequences] == [
        (s.tokens, s.logprobs) for s in before.sequences
    ]
    stepped = tc.save_weights_and_get_sampling_client().result()
    now = stepped.sample(prompt, 2, seeded).result()
    assert [s.logprobs for s in now.sequences] != [s.logprobs for s in before.sequences]
    with dask.config.set({"plexrl.serve.kept-snapshots": 0}):
        tc.forward_backward([ce_datum(A)], "cross_entropy").result()
        tc.optim_step(types.AdamParams(learning_rate=1e-3)).result()
    with pytest.raises(tinker.BadRequestError, match="kept-snapshots"):
        stepped.sample(prompt, 1, params).result()
    assert len(sampler.sample(prompt, 1, params).result().sequences) == 1  # (kept before)

    sc.close("success").result()
    assert not runtime.deployments()  # the session's deployments went with it


def test_bad_input_is_typed_and_touches_no_other_tenant(server):
    srv, client, keys = server
    sc = sdk(srv, keys["alice"])
    tc = sc.create_lora_training_client(base_model=BASE, rank=0).result()
    model_id = tc.model_id
    runtime = plexrl.Runtime(client, job="tinker-alice")
    policy = runtime.deployment(model_id)
    before = plexrl.result(policy.forward([plexrl.Datum(tokens=A)])).logprobs

    api = f"{srv.url}/api/v1"

    def post(path, key, **kw):
        headers = {"X-API-Key": key} if key else {}
        headers.update(kw.pop("headers", {}))
        return httpx.post(f"{api}/{path}", headers=headers, timeout=30, **kw)

    assert post("create_session", None, json={}).status_code == 401
    assert post("create_session", "tml-nobody", json={}).status_code == 401
    # another tenant's model: unknown, whether read or trained
    r = post("get_info", keys["bob"], json={"model_id": model_id})
    assert r.status_code == 404 and r.json()["error"] == "UnknownObject"
    from tinker.proto import tinker_public_pb2 as pb

    msg = pb.ForwardBackwardRequest(model_id=model_id, seq_id=99, loss_fn="cross_entropy")
    proto = {"Content-Type": "application/x-protobuf"}
    r = post("forward_backward", keys["bob"], content=msg.SerializeToString(), headers=proto)
    assert r.status_code == 404
    # malformed protobuf, an oversized body, an unknown loss, an unsupported call
    r = post("forward_backward", keys["alice"], content=b"\xff\x00garbage", headers=proto)
    assert r.status_code == 400 and r.json()["error"] == "InvalidTinkerRequest"
    r = post("forward_backward", keys["small"], content=b"x" * 4096, headers=proto)
    assert r.status_code == 413 and r.json()["error"] == "RequestTooLarge"
    # ... also sent without a length (chunked), refused as it arrives
    r = post("forward_backward", keys["small"], content=iter([b"x" * 1024] * 4), headers=proto)
    assert r.status_code == 413 and r.json()["error"] == "RequestTooLarge"
    # JSON nested past the parser's depth, metadata that is not an object or is too large
    r = post("create_session", keys["alice"], content=b"[" * 100_000)
    assert r.status_code == 400 and r.json()["error"] == "InvalidTinkerRequest"
    with pytest.raises(tinker.BadRequestError, match="UnsupportedCall"):
        tc.forward_backward([ce_datum(A)], "gspo").result()
    with pytest.raises(tinker.BadRequestError, match="dro takes loss_fn_inputs.*InvalidTinkerRequest"):
        tc.forward_backward([ce_datum(A)], "dro").result()  # (an SFT datum)
    with pytest.raises(tinker.BadRequestError, match="beta.*InvalidTinkerRequest"):
        tc.forward_backward([rl_datum(A, -2.0, 0.5)], "dro", {"beta": -1.0}).result()
    session = post("create_session", keys["alice"], json={}).json()["session_id"]
    for lora in ({"rank": -1}, {"rank": 10**6}, {"rank": 4, "train_attn": False,
                 "train_mlp": False, "train_unembed": False}):  # fmt: skip
        body = {"session_id": session, "base_model": BASE, "lora_config": lora}
        r = post("create_model", keys["alice"], json=body)
        assert r.status_code == 400 and r.json()["error"] == "InvalidTinkerRequest", r.json()
    for extra in ({"user_metadata": ["a"]}, {"user_metadata": {"k": "v" * 20_000}},
                  {"optimizer_config": "sgd"}):  # fmt: skip
        body = {"session_id": session, "base_model": BASE, "lora_config": {"rank": 0}, **extra}
        r = post("create_model", keys["alice"], json=body)
        assert r.status_code == 400 and r.json()["error"] == "InvalidTinkerRequest", r.json()
    r = post("get_audit_log", keys["alice"], json={})
    assert r.status_code == 400 and r.json()["error"] == "UnsupportedCall"
    # an export: without its seq_id, of another tenant's model, encrypted, with a bad TTL
    r = post("save_weights_external", keys["alice"], json={"model_id": model_id, "path": "x"})
    assert r.status_code == 400 and r.json()["error"] == "InvalidTinkerRequest"
    r = post("save_weights_external", keys["bob"], json={"model_id": model_id, "seq_id": 99})
    assert r.status_code == 404
    # a datum whose fields do not line up
    bad = types.Datum(
        model_input=types.ModelInput.from_ints(A[:-1]),
        loss_fn_inputs={"target_tokens": A[1:], "weights": [1.0]},
    )
    with pytest.raises(tinker.BadRequestError, match="InvalidTinkerRequest"):
        tc.forward_backward([bad], "cross_entropy").result()
    # tokens past the vocabulary: the request fails, typed, through its future
    with pytest.raises(tinker.RequestFailedError, match="TokenOutOfVocabulary"):
        tc.forward_backward([ce_datum([5, 10**6, 7])], "cross_entropy").result()

    # nothing of alice's moved, and her model still trains after all that
    assert plexrl.result(policy.forward([plexrl.Datum(tokens=A)])).logprobs == before
    tc.forward_backward([ce_datum(A)], "cross_entropy").result()
    assert tc.optim_step(types.AdamParams(learning_rate=1e-3)).result().metrics
    sc.close("success").result()


def test_what_a_tenant_sends_beyond_bounds_is_refused_before_anything_is_built(server):
    """num_samples past the rows quota is refused before a sequence id is made (a billion
    of them once stalled the server for every tenant); adam_params that are not an object,
    target tokens that are not whole ids, a tensor of negative shape: typed 400s, and the
    refused seq_id is skipped (the next one ran only after the 30 s gap timeout); checkpoint
    names a URL path cannot carry, or too long for the state file, are refused."""
    from tinker.proto import tinker_public_pb2 as pb

    srv, client, keys = server
    sc = sdk(srv, keys["bob"])
    tc = sc.create_lora_training_client(base_model=BASE, rank=0).result()
    api, headers = f"{srv.url}/api/v1", {"X-API-Key": keys["bob"]}

    def post(path, **kw):
        kw.setdefault("timeout", 30)
        return httpx.post(f"{api}/{path}", headers={**headers, **kw.pop("headers", {})}, **kw)

    sampler = sc.create_sampling_client(base_model=BASE).result()
    body = {
        "sampling_session_id": sampler._sampling_session_id,
        "prompt": {"chunks": [{"type": "encoded_text", "tokens": A[:3]}]},
        "sampling_params": {"max_tokens": 2},
        "num_samples": 10**9,
    }
    r = post("asample", json=body)
    assert r.status_code == 413 and r.json()["error"] == "RequestTooLarge", r.json()
    model = srv.service.models[tc.model_id]
    bad = {"model_id": tc.model_id, "seq_id": 1, "adam_params": [1e-3]}
    r = post("optim_step", json=bad)
    assert r.status_code == 400 and r.json()["error"] == "InvalidTinkerRequest", r.json()
    assert 1 in model.taken  # (skipped: seq_id 2 need not wait for it)

    def fb(seq_id, dtype, code, targets, shape=None):
        msg = pb.ForwardBackwardRequest(model_id=tc.model_id, seq_id=seq_id, loss_fn="cross_entropy")
        d = msg.data.add()
        d.model_input.add().encoded_text.tokens = np.asarray(A[:-1], "<i4").tobytes()
        for name, values, dt, c in (("target_tokens", targets, dtype, code),
                                    ("weights", [1.0] * (len(A) - 1), "<f4", pb.DTYPE_FLOAT32)):
            t = d.loss_fn_inputs[name]
            t.dtype, t.dense = c, np.asarray(values, dt).tobytes()
            t.shape.extend(shape if shape and name == "target_tokens" else [len(values)])
        return post("forward_backward", content=msg.SerializeToString(),
                    headers={"Content-Type": "application/x-protobuf"})  # fmt: skip

    nan = [float("nan")] + [float(t) for t in A[2:]]
    for seq_id, args in ((2, ("<f4", pb.DTYPE_FLOAT32, nan)),
                         (3, ("<f4", pb.DTYPE_FLOAT32, [float(t) for t in A[1:]] + [0.5])),
                         (4, ("<i8", pb.DTYPE_INT64, A[1:] * 2, [-2, -6]))):  # fmt: skip
        r = fb(seq_id, *args)
        assert r.status_code == 400 and r.json()["error"] == "InvalidTinkerRequest", r.json()
    assert {2, 3, 4} <= set(model.taken)
    # the seq_id after those runs, in order (the skipped ones hold nothing back)
    request_id = fb(5, "<i8", pb.DTYPE_INT64, A[1:]).json()["request_id"]
    for _ in range(20):
        r = post("retrieve_future", json={"request_id": request_id}, timeout=60)
        if r.status_code != 408:
            break
    assert r.status_code == 200 and model.next_seq == 6
    named = sc.create_lora_training_client(base_model=BASE, rank=0).result()
    for name in ("..", ".", "a?b", "a#b", "a%2Fb", "-x", "x" * 129, "a b"):
        with pytest.raises(tinker.BadRequestError, match="InvalidTinkerRequest"):
            named.save_state(name).result()
    assert named.save_state("step_1.final-2").result().path.endswith("/step_1.final-2")
    sc.close("success").result()


def test_requests_run_in_seq_id_order_whatever_order_they_arrive_in(server):
    """The SDK sends a call's chunks at once, the first one last: an optim_step that arrives
    before the forward_backward it follows still runs after it; a retried seq_id gets its
    first request id."""
    srv, client, keys = server
    sc = sdk(srv, keys["bob"])
    tc = sc.create_lora_training_client(base_model=BASE, rank=0).result()
    api, key = f"{srv.url}/api/v1", keys["bob"]
    headers = {"X-API-Key": key}
    from tinker.proto import tinker_public_pb2 as pb

    first = pb.ForwardBackwardRequest(model_id=tc.model_id, seq_id=1, loss_fn="cross_entropy")
    d = first.data.add()
    d.model_input.add().encoded_text.tokens = np.asarray(A[:-1], "<i4").tobytes()
    for name, values, dtype, code in (
        ("target_tokens", A[1:], "<i8", pb.DTYPE_INT64),
        ("weights", [1.0] * (len(A) - 1), "<f4", pb.DTYPE_FLOAT32),
    ):
        t = d.loss_fn_inputs[name]
        t.dtype, t.dense = code, np.asarray(values, dtype).tobytes()
        t.shape.append(len(values))
    optim = {
        "model_id": tc.model_id,
        "seq_id": 2,
        "type": "optim_step",
        "adam_params": {"learning_rate": 1e-3},
    }
    r2 = httpx.post(f"{api}/optim_step", headers=headers, json=optim, timeout=30)
    proto = {**headers, "Content-Type": "application/x-protobuf"}
    r1 = httpx.post(f"{api}/forward_backward", headers=proto, content=first.SerializeToString())
    again = httpx.post(f"{api}/forward_backward", headers=proto, content=first.SerializeToString())
    assert again.json()["request_id"] == r1.json()["request_id"]

    def result(request_id):
        for _ in range(20):
            r = httpx.post(
                f"{api}/retrieve_future",
                headers=headers,
                json={"request_id": request_id},
                timeout=60,
            )
            if r.status_code != 408:
                return r
        raise AssertionError("no result")

    step = result(r2.json()["request_id"]).json()
    assert "error" not in step and step["metrics"]  # (it had a gradient to apply)
    out = pb.ForwardBackwardOutput()
    out.ParseFromString(result(r1.json()["request_id"]).content)
    assert "loss:sum" in out.metrics
    sc.close("success").result()


@pytest.mark.parametrize("kept", [0, 2])
def test_a_sampler_every_step_never_reaches_the_tenants_limit(server, kept):
    """A Tinker RL loop makes a sampling client every step: the earlier steps' snapshot
    samplers are retired (still refused, typed), so a tenant's limit counts live ones only.
    With ``kept-snapshots``, the last ones keep their weights and the older are retired."""
    srv, client, keys = server
    sc = sdk(srv, keys["bob"])
    tc = sc.create_lora_training_client(base_model=BASE, rank=0).result()
    from plexrl_dask import config

    made = []
    prompt = types.ModelInput.from_ints(B[:2])
    short = types.SamplingParams(max_tokens=2)
    with dask.config.set({"plexrl.serve.kept-snapshots": kept}):
        for _ in range(int(config.get("serve.tenant-limits")["samplers"]) + 2):
            made.append(tc.save_weights_and_get_sampling_client().result())
            tc.forward_backward([ce_datum(B)], "cross_entropy").result()
            tc.optim_step(types.AdamParams(learning_rate=1e-3)).result()
    with pytest.raises(tinker.BadRequestError, match="SamplerSuperseded"):
        made[0].sample(prompt, 1, short).result()
    for old in made[len(made) - kept :] if kept else []:  # the last ones sample their copies
        assert len(old.sample(prompt, 1, short).result().sequences) == 1
    now = tc.save_weights_and_get_sampling_client().result()
    assert len(now.sample(prompt, 1, short).result().sequences) == 1
    # the retired snapshots' copies were dropped from the node's store, and the rest go with
    # the session
    assert wait_for(lambda: len(snapshot_copies(client)) <= kept), snapshot_copies(client)
    sc.close("success").result()
    assert wait_for(lambda: not snapshot_copies(client)), snapshot_copies(client)


def snapshot_copies(client) -> set[str]:
    """The kept snapshots' store models with a version on the workers' nodes."""

    def models(dask_worker=None):
        from plexrl_dask.worker.holder import holder_of

        holder = holder_of(dask_worker)
        if holder is None or holder.node is None:
            return []
        store = holder.node.store("nvme")
        return [m for m in store.models() if "-snapshot-" in m and store.versions(m)]

    return {m for found in client.run(models).values() for m in found}


def wait_for(check, timeout: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.2)
    return True


def test_a_session_without_heartbeats_ends_and_frees_the_pool(server):
    """A client that died (no heartbeat for plexrl.serve.session-timeout) leaves nothing
    deployed: its session's models are undeployed by the server's sweep."""
    srv, client, keys = server
    api, headers = f"{srv.url}/api/v1", {"X-API-Key": keys["bob"]}
    session = httpx.post(f"{api}/create_session", headers=headers, json={}, timeout=30)
    sid = session.json()["session_id"]
    body = {"session_id": sid, "model_seq_id": 0, "base_model": BASE, "lora_config": {"rank": 0}}
    rid = httpx.post(f"{api}/create_model", headers=headers, json=body, timeout=30).json()
    for _ in range(10):
        r = httpx.post(f"{api}/retrieve_future", headers=headers, json=rid, timeout=60)
        if r.status_code != 408:
            break
    model_id = r.json()["model_id"]
    runtime = plexrl.Runtime(client, job="tinker-bob")
    assert model_id in {d.name.split("@")[0] for d in runtime.deployments()}
    srv.service.sessions[sid].last_seen -= srv.service.session_timeout + 1
    srv.run(srv.service.expire())
    assert model_id not in {d.name.split("@")[0] for d in runtime.deployments()}
    r = httpx.post(f"{api}/get_info", headers=headers, json={"model_id": model_id}, timeout=30)
    assert r.status_code == 404


def test_a_new_tenants_first_calls_at_once_attach_once_and_count_each_other(server):
    """A tenant's first two ``create_model`` calls, sent at once (its limit: 1 model): its
    job is attached once (a second attach would take the first's secret for a stale one and
    undeploy its new model), and the two count against the limit together, so one model is
    made and the other call is refused, typed."""
    srv, client, keys = server
    api, headers = f"{srv.url}/api/v1", {"X-API-Key": keys["single"]}
    sid = httpx.post(f"{api}/create_session", headers=headers, json={}, timeout=30)
    sid = sid.json()["session_id"]

    def create(n):
        body = {"session_id": sid, "model_seq_id": n, "base_model": BASE, "lora_config": {"rank": 0}}
        return httpx.post(f"{api}/create_model", headers=headers, json=body, timeout=60)

    with ThreadPoolExecutor(2) as pool:
        replies = list(pool.map(create, [0, 1]))
    codes = sorted(r.status_code for r in replies)
    assert codes == [200, 403], [r.text for r in replies]
    [refused] = [r for r in replies if r.status_code == 403]
    assert refused.json()["error"] == "TenantLimitExceeded"
    [made] = [r for r in replies if r.status_code == 200]
    for _ in range(10):
        r = httpx.post(f"{api}/retrieve_future", headers=headers, json=made.json(), timeout=60)
        if r.status_code != 408:
            break
    assert r.status_code == 200, r.text
    model_id = r.json()["model_id"]
    runtime = plexrl.Runtime(client, job="tinker-single")
    mine = [d.name for d in runtime.deployments() if d.owner == "tinker-single"]
    assert [n.split("@")[0] for n in mine] == [model_id]
    assert list(srv.service.creating) == []
    httpx.post(f"{api}/sessions/{sid}/finish", headers=headers, json={}, timeout=30)


def test_a_sampler_past_the_limit_is_refused_before_its_replica_is_made(server):
    """At its limit of samplers (here 1), a tenant's next sampling session of a saved
    checkpoint is refused before a replica is deployed for it, so none is left behind; a
    retried call of the one it has answers that one; its seq id reused for another is
    refused."""
    srv, client, keys = server
    sc = sdk(srv, keys["single"])
    tc = sc.create_lora_training_client(base_model=BASE, rank=0).result()
    path = tc.save_weights_for_sampler("kept").result().path
    # its limit of saved checkpoints (1): saved again under its name is no other ...
    assert tc.save_weights_for_sampler("kept").result().path == path
    with pytest.raises(tinker.APIStatusError, match="TenantLimitExceeded"):
        tc.save_weights_for_sampler("another").result()  # ... and none past it
    api, headers = f"{srv.url}/api/v1", {"X-API-Key": keys["single"]}
    sid = httpx.post(f"{api}/create_session", headers=headers, json={}, timeout=30)
    sid = sid.json()["session_id"]
    runtime = plexrl.Runtime(client, job=unique("looker"))

    def replicas():
        return [
            d.name
            for d in runtime.deployments(every_job=True)
            if d.owner == "tinker-single" and d.name.split("@")[0].endswith(":rollout")
        ]

    def create(n, **body):
        body = {"session_id": sid, "sampling_session_seq_id": n, **body}
        return httpx.post(f"{api}/create_sampling_session", headers=headers, json=body, timeout=60)

    first = create(0, model_path=path)
    assert first.status_code == 200, first.text
    assert create(0, model_path=path).json() == first.json()  # (a retry)
    assert len(replicas()) == 1
    refused = create(1, model_path=path)
    assert refused.status_code == 403 and refused.json()["error"] == "TenantLimitExceeded"
    reused = create(0, base_model=BASE)
    assert reused.status_code == 400 and reused.json()["error"] == "InvalidTinkerRequest"
    assert len(replicas()) == 1 and srv.service.reserved_samplers == {}
    httpx.post(f"{api}/sessions/{sid}/finish", headers=headers, json={}, timeout=30)
    sc.close("success").result()
    assert replicas() == []


def test_one_tenants_blocking_calls_take_at_most_its_share_of_the_servers_threads(server):
    """A tenant whose calls block (restores, exports) holds at most
    plexrl.serve.tenant-threads of the server's threads; another tenant's call runs
    meanwhile, where without a share the first would hold all of them."""
    import asyncio
    import threading

    from plexrl_dask.serve.service import THREADS

    srv, _, _ = server
    svc = srv.service
    gate, lock, running, peak = threading.Event(), threading.Lock(), [], [0]

    def slow():
        with lock:
            running.append(1)
            peak[0] = max(peak[0], len(running))
        gate.wait(60)
        with lock:
            running.pop()
        return "hog"

    async def scenario():
        hogs = [asyncio.ensure_future(svc.blocking(slow, tenant="hog")) for _ in range(THREADS + 2)]
        await asyncio.sleep(0.5)
        try:
            other = await asyncio.wait_for(svc.blocking(lambda: "other", tenant="other"), 20)
        finally:
            gate.set()
        return other, await asyncio.gather(*hogs)

    other, hogs = srv.run(scenario(), timeout=90)
    assert other == "other" and hogs == ["hog"] * (THREADS + 2)
    assert peak[0] == svc.tenant_threads < THREADS


def test_a_tenants_idle_training_runs_beyond_the_newest_are_forgotten(server, monkeypatch):
    """Training runs are kept in the state file, written whole on every change: a tenant's
    runs without a live model or a saved checkpoint are kept only as its newest RUNS_KEPT."""
    import plexrl_dask.serve.service as service_module
    from plexrl_dask.serve.records import Run

    srv, _, _ = server
    svc = srv.service
    monkeypatch.setattr(service_module, "RUNS_KEPT", 2)
    for i in range(4):
        svc.runs[f"ghost-run-{i}"] = Run(f"ghost-run-{i}", "ghost", BASE, {})
    svc.runs["other-run"] = Run("other-run", "other-ghost", BASE, {})
    svc._forget_old_runs("ghost")
    kept = sorted(r for r in svc.runs if r.startswith("ghost-run") or r == "other-run")
    assert kept == ["ghost-run-2", "ghost-run-3", "other-run"]
    for r in ("ghost-run-2", "ghost-run-3", "other-run"):
        del svc.runs[r]


def test_a_tenants_requests_waiting_are_bounded_with_a_retryable_refusal(server):
    """Past its requests waiting (here 2: two requests queued behind a seq_id that has not
    arrived), a tenant's next request is a 429 TenantBusy, which the SDK retries; other
    tenants are not affected."""
    srv, client, keys = server
    sc = sdk(srv, keys["small"])
    tc = sc.create_lora_training_client(base_model=BASE, rank=0).result()
    api, headers = f"{srv.url}/api/v1", {"X-API-Key": keys["small"]}

    def optim(seq_id):
        body = {"model_id": tc.model_id, "seq_id": seq_id, "adam_params": {"learning_rate": 1e-3}}
        return httpx.post(f"{api}/optim_step", headers=headers, json=body, timeout=30)

    assert optim(5).status_code == 200 and optim(6).status_code == 200  # (behind seq_id 1)
    r = optim(7)
    assert r.status_code == 429 and r.json()["error"] == "TenantBusy"
    assert r.headers["retry-after"] == "1"
    bob = sdk(srv, keys["bob"])
    other = bob.create_lora_training_client(base_model=BASE, rank=0).result()
    assert other.get_info().model_data.model_name == BASE
    bob.close("success").result()
    sc.close("success").result()


def test_a_restarted_server_keeps_its_tenants_and_their_checkpoints(server, tmp_path):
    """A server that stopped without its sessions ending (a crash, a redeploy) leaves its
    tenants' deployments on the pool: started again on its state file, it re-attaches to the
    tenants' jobs (their secrets are in the file), undeploys what the last run left, and still
    knows the tinker:// paths of their saved checkpoints. Its adapter banks' job is its own
    (two servers on one cluster each have one), the same across the restart."""
    srv, client, tenants = server
    keys = tmp_path / "keys.yaml"
    key = add_key(keys, "dave")
    state, models = tmp_path / "state.json", {BASE: srv.service.catalog[BASE].path}
    observer = plexrl.Runtime(client, job="observer")

    def daves() -> set[str]:
        return {d.name for d in observer.deployments(every_job=True) if d.owner == "tinker-dave"}

    with ServerThread(client, KeyRing.from_file(keys), models, state_file=str(state)) as first:
        tc = sdk(first, key).create_lora_training_client(base_model=BASE, rank=0).result()
        tc.forward_backward([ce_datum(A)], "cross_entropy").result()
        tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
        path = tc.save_state("keep").result().path
        saved = tc.forward([ce_datum(A)], "cross_entropy").result().loss_fn_outputs[0]
        left = daves()
        assert len(left) == 1
        # two servers on the cluster, each with its base's bank in a job of its own
        prompt, short = types.ModelInput.from_ints(A[:3]), types.SamplingParams(max_tokens=2)
        for s in (srv, first):
            k = key if s is first else tenants["alice"]
            sampler = sdk(s, k).create_sampling_client(base_model=BASE).result()
            assert len(sampler.sample(prompt, 1, short).result().sequences) == 1
        bank_job = first.service.bank_job
        assert bank_job != srv.service.bank_job
    close_clients(first, finish=False)  # (as a crash leaves them: their server is gone)
    with ServerThread(client, KeyRing.from_file(keys), models, state_file=str(state)) as second:
        sc = sdk(second, key)
        again = sc.create_training_client_from_state(path).result()
        got = again.forward([ce_datum(A)], "cross_entropy").result().loss_fn_outputs[0]
        assert got["logprobs"].tolist() == saved["logprobs"].tolist()
        assert not daves() & left  # (the last run's model is gone; the new one stays)
        assert second.service.bank_job == bank_job
        sampler = sc.create_sampling_client(base_model=BASE).result()
        assert len(sampler.sample(prompt, 1, short).result().sequences) == 1
        banks = [d for d in observer.deployments(every_job=True) if d.owner == bank_job]
        assert len(banks) == 1  # (the last run's bank was undeployed)
        sc.close("success").result()
        close_clients(second)
    assert not daves()


def test_importance_sampling_raises_what_it_rewards_and_lowers_what_it_penalises(server):
    srv, client, keys = server
    sc = sdk(srv, keys["alice"])
    tc = sc.create_lora_training_client(base_model=BASE, rank=0).result()

    def total() -> float:
        out = tc.forward([ce_datum(A)], "cross_entropy").result().loss_fn_outputs[0]
        return float(sum(out["logprobs"].tolist()))

    for advantage, sign in ((1.0, 1), (-1.0, -1)):
        before = total()
        tc.forward_backward([rl_datum(A, -3.0, advantage)], "importance_sampling").result()
        tc.optim_step(types.AdamParams(learning_rate=1e-3)).result()
        assert (total() - before) * sign > 0
    sc.close("success").result()


def clipped_is(logprobs, logprob_old, advantages, scale):
    """A custom loss: importance sampling with a clipped ratio, scaled by a per-datum number."""
    ratio = torch.exp(logprobs - logprob_old).clamp(0.5, 2.0)
    loss = -(ratio * advantages).sum() * scale
    return loss, {"custom/ratio:mean": ratio.mean(), "custom/tokens:sum": logprobs.sum() * 0 + 1}


def custom_datum(tokens, q, adv, scale):
    """:func:`rl_datum`'s inputs under a custom loss's names, advantages varying by token, a
    number input, and one the loss does not read."""
    inputs = rl_datum(tokens, q, adv).loss_fn_inputs
    n = len(tokens) - 1
    return types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={
            "target_tokens": inputs["target_tokens"],
            "logprob_old": inputs["logprobs"],
            "advantages": np.linspace(-1, 1, n, dtype=np.float32) * adv,
            "scale": types.TensorData(data=[scale], dtype="float32", shape=[]),
            "unused": np.zeros(n, dtype=np.float32),  # (not read by the loss: left out)
        },
    )


def test_a_custom_loss_runs_on_the_workers_in_one_request_as_the_sdk_runs_it(server):
    """``create_custom_loss`` uploads a traced loss; ``forward_backward_custom`` with its
    handle is then one request, computing what the SDK's own two-request path computes (a
    forward, then cross_entropy weighted by the gradient): the same loss, metrics and
    weights after a step. A graph past the allowed operations, a loss of another session or
    tenant, or data without its inputs is refused, typed."""
    srv, client, keys = server
    sc = sdk(srv, keys["alice"])
    ranks = {"logprobs": 1, "logprob_old": 1, "advantages": 1, "scale": 0}
    handle = sc.create_custom_loss(clipped_is, ranks).result()
    assert handle.loss_id is not None  # (uploaded: the server said it runs them)
    server_side = sc.create_lora_training_client(base_model=BASE, rank=0).result()
    client_side = sc.create_lora_training_client(base_model=BASE, rank=0).result()
    data = [custom_datum(A, -2.0, 0.7, 1.5), custom_datum(B, -3.5, -0.4, 0.5)]

    def in_the_sdk(data, logprobs):  # (a callable: the SDK's forward + backward path)
        total, ratio, tokens = 0.0, 0.0, 0.0
        for d, lp in zip(data, logprobs, strict=True):
            ins = {k: d.loss_fn_inputs[k].to_torch() for k in ("logprob_old", "advantages")}
            loss, m = clipped_is(lp, ins["logprob_old"], ins["advantages"],
                                 d.loss_fn_inputs["scale"].to_torch().reshape(()))  # fmt: skip
            total, ratio, tokens = total + loss, ratio + m["custom/ratio:mean"].item(), tokens + 1
        return total, {"custom/ratio:mean": ratio / len(data), "custom/tokens:sum": tokens}

    scored = server_side.forward(data, "custom", {"loss_id": handle.loss_id}).result()
    requests = srv.service.promises.keys()
    before = set(requests)
    got = server_side.forward_backward_custom(data, handle).result()
    # (forward alone: the same loss, computed by the server from the workers' log-probs)
    assert scored.metrics["loss:sum"] == pytest.approx(got.metrics["loss:sum"], rel=1e-5)
    assert scored.metrics["custom/tokens:sum"] == 2.0
    assert len(set(requests) - before) == 1  # one request, no forward pass first
    want = client_side.forward_backward_custom(data, in_the_sdk).result()
    for key in ("loss:sum", "custom/ratio:mean", "custom/tokens:sum"):
        assert got.metrics[key] == pytest.approx(want.metrics[key], rel=1e-5), key
    assert got.metrics["custom/tokens:sum"] == 2.0
    for a, b in zip(got.loss_fn_outputs, want.loss_fn_outputs, strict=True):
        assert a["logprobs"].tolist() == pytest.approx(b["logprobs"].tolist(), abs=1e-6)
    for tc in (server_side, client_side):
        tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    after = [tc.forward([ce_datum(A)], "cross_entropy").result().loss_fn_outputs[0]
             for tc in (server_side, client_side)]  # fmt: skip
    assert after[0]["logprobs"].tolist() == pytest.approx(after[1]["logprobs"].tolist(), abs=1e-5)

    # refusals: typed, and the model trains on afterwards
    with pytest.raises(tinker.BadRequestError, match="scale"):
        server_side.forward_backward(
            [rl_datum(A, -2.0, 0.5)], "custom", {"loss_id": handle.loss_id}
        ).result()
    session = sc.holder.get_session_id()
    hostile = {
        "session_id": session, "custom_loss_seq_id": 99, "name": "escape",
        "inputs": [{"name": "logprobs", "rank": 1}],
        "graph": {"format": 1, "nodes": [
            {"op": "placeholder", "name": "logprobs", "target": "logprobs"},
            {"op": "call_function", "name": "x", "target": "builtins.exec",
             "args": ["import os; os.system('touch /tmp/escaped')"]},
            {"op": "output", "name": "output", "target": "output",
             "args": [{"tuple": [{"ref": "x"}, {"dict": {}}]}]},
        ]},
    }  # fmt: skip
    reply = httpx.post(f"{srv.url}/api/v1/create_custom_loss", json=hostile,
                       headers={"X-API-Key": keys["alice"]}, timeout=30)  # fmt: skip
    assert reply.status_code == 400 and "builtins.exec" in reply.json()["detail"]
    huge = {**hostile, "name": "x" * (2 << 20)}  # (a graph's body is at most custom-loss-bytes)
    reply = httpx.post(f"{srv.url}/api/v1/create_custom_loss", json=huge,
                       headers={"X-API-Key": keys["alice"]}, timeout=30)  # fmt: skip
    assert reply.status_code == 413
    bob = sdk(srv, keys["bob"]).create_lora_training_client(base_model=BASE, rank=0).result()
    with pytest.raises(tinker.NotFoundError):
        bob.forward_backward(data, "custom", {"loss_id": handle.loss_id}).result()
    again = server_side.forward_backward_custom(data, handle).result()
    assert again.metrics["custom/tokens:sum"] == 2.0
    sc.close("success").result()
    # a setting that is not a boolean (an environment variable's "true") stops the server
    with (
        dask.config.set({"plexrl.serve.custom-losses": "true"}),
        pytest.raises(plexrl.errors.ConfigError, match="custom-losses"),
    ):
        Service(client, {BASE: "unused"})


def test_concurrent_samples_are_merged_and_each_samples_what_it_would_alone(server):
    """A burst of one sampler's calls goes to its replica as a few requests, not one each; each
    call's tokens are what it samples alone, and a bad call among them fails alone."""
    srv, client, keys = server
    sc = sdk(srv, keys["bob"])
    base = sc.create_sampling_client(base_model=BASE).result()
    prompts = [types.ModelInput.from_ints(A[: 2 + i % 5]) for i in range(12)]
    params = [
        types.SamplingParams(max_tokens=6, temperature=1.0, stop=[], seed=100 + i)
        for i in range(12)
    ]
    bad = types.ModelInput.from_ints([A[0], 10**6])  # past the vocabulary
    [sampler] = [s for s in srv.service.samplers.values() if s.tenant == "bob"]
    merger = srv.service._merger(sampler)  # (the base's bank's: other tests' calls too)
    calls, requests = merger.calls, merger.requests
    burst = [base.sample(prompts[i], 2, params[i]) for i in range(6)]
    failing = base.sample(bad, 2, params[0])
    burst += [base.sample(prompts[i], 2, params[i]) for i in range(6, 12)]
    merged = [f.result().sequences for f in burst]
    with pytest.raises(tinker.RequestFailedError, match="TokenOutOfVocabulary"):
        failing.result()
    assert merger.calls - calls == 13 and merger.requests - requests < 13
    for i in range(12):  # one at a time: the same bits
        alone = base.sample(prompts[i], 2, params[i]).result().sequences
        assert [(s.tokens, s.logprobs) for s in merged[i]] == [
            (s.tokens, s.logprobs) for s in alone
        ]
    # a sampler of a server that sends each call alone: a request per call, the same bits
    calls, requests = merger.calls, merger.requests
    with dask.config.set({"plexrl.serve.sample-merge-rows": 1}):
        single = sc.create_sampling_client(base_model=BASE).result()
        burst = [single.sample(prompts[i], 2, params[i]) for i in range(12)]
        each = [f.result().sequences for f in burst]
    [one] = [s for s in srv.service.samplers.values() if s.tenant == "bob" and s is not sampler]
    single = srv.service._merger(one)  # (the bank's: every base sampler's calls)
    assert single.calls - calls == single.requests - requests == 12
    assert [[s.tokens for s in g] for g in each] == [[s.tokens for s in g] for g in merged]
    sc.close("success").result()


def test_two_tenants_lora_snapshots_sample_together_in_their_base_bank(server):
    """Two tenants' LoRA snapshot samplers are adapters in their base's bank: their concurrent
    calls go as few requests (one decode for both tenants), each call sampling the bits it
    samples alone; a snapshot keeps its weights after its model's next step (a copy); an
    adapter the bank lost is loaded again from its saved state on the next call."""
    pytest.importorskip("peft", reason="LoRA adapters need the peft package")
    srv, client, keys = server
    services = {t: sdk(srv, keys[t]) for t in ("alice", "bob")}
    models = {
        t: sc.create_lora_training_client(base_model=BASE, rank=4).result()
        for t, sc in services.items()
    }
    for i, tc in enumerate(models.values()):
        tc.forward_backward([ce_datum(A), ce_datum(B)], "cross_entropy").result()
        tc.optim_step(types.AdamParams(learning_rate=1e-2 * (i + 1))).result()
    samplers = {t: tc.save_weights_and_get_sampling_client().result() for t, tc in models.items()}
    mine = [s for s in srv.service.samplers.values() if s.adapter is not None]
    assert {s.tenant for s in mine} >= {"alice", "bob"}
    assert len({s.deployment.name for s in mine}) == 1  # one bank for the base
    merger = srv.service._merger(mine[0])
    calls, requests = merger.calls, merger.requests
    prompts = [types.ModelInput.from_ints(A[: 2 + i % 4]) for i in range(8)]
    params = [types.SamplingParams(max_tokens=5, temperature=1.0, seed=7 + i) for i in range(8)]
    burst = [
        (t, i, samplers[t].sample(prompts[i], 2, params[i]))
        for i in range(8)
        for t in ("alice", "bob")
    ]
    together = {(t, i): f.result().sequences for t, i, f in burst}
    assert merger.calls - calls == 16 and merger.requests - requests < 16
    for (t, i), seqs in together.items():
        alone = samplers[t].sample(prompts[i], 2, params[i]).result().sequences
        assert [(s.tokens, s.logprobs) for s in seqs] == [(s.tokens, s.logprobs) for s in alone]
    assert together[("alice", 0)] != together[("bob", 0)]  # each its own adapter
    # a later step leaves the snapshot its weights: it is a copy in the bank
    tc = models["alice"]
    tc.forward_backward([ce_datum(A)], "cross_entropy").result()
    tc.optim_step(types.AdamParams(learning_rate=1e-1)).result()
    again = samplers["alice"].sample(prompts[0], 2, params[0]).result().sequences
    assert [s.tokens for s in again] == [s.tokens for s in together[("alice", 0)]]
    # the bank loses bob's adapter (as with its worker): the next call loads it again
    [bobs] = [s for s in mine if s.tenant == "bob"]
    assert plexrl.result(bobs.deployment.drop_adapter(bobs.adapter)) is True
    back = samplers["bob"].sample(prompts[1], 2, params[1]).result().sequences
    assert [s.tokens for s in back] == [s.tokens for s in together[("bob", 1)]]
    for sc in services.values():
        sc.close("success").result()


def test_a_tenant_flooding_the_bank_does_not_hold_back_anothers_call(server):
    """Every tenant's base samplers merge into one bank's requests; a flood of one tenant's
    calls waits in the server (two merged requests in flight), and the next batch takes the
    other tenant's call first: it leaves in the first batch built after it arrived."""
    srv, client, keys = server
    alice, bob = sdk(srv, keys["alice"]), sdk(srv, keys["bob"])
    flooding = alice.create_sampling_client(base_model=BASE).result()
    victim = bob.create_sampling_client(base_model=BASE).result()
    merger = srv.service._merger(srv.service.samplers[flooding._sampling_session_id])
    short = types.SamplingParams(max_tokens=6, temperature=1.0, stop=[], seed=3)
    prompt = types.ModelInput.from_ints(A[:4])
    with dask.config.set({"plexrl.serve.sample-merge-rows": 2}):
        before = merger.calls
        flood = [flooding.sample(prompt, 1, short) for _ in range(120)]
        assert wait_for(lambda: merger.calls - before >= 120)  # (all of them at the server)
        merger.waited.clear()
        waiting = sum(len(b.calls) for b in merger._open.values())
        mine = victim.sample(prompt, 1, short)
        assert len(mine.result().sequences) == 1
        assert all(len(f.result().sequences) == 1 for f in flood)
    assert waiting > 10  # (the flood was still waiting when bob's call came)
    assert merger.waited["bob"] == 0 < merger.waited["alice"]
    for sc in (alice, bob):
        sc.close("success").result()


def test_lora_tenants_share_their_base_and_train_only_their_adapters(server, tmp_path):
    """Two tenants' LoRA models (``rank`` > 0) on one base: each worker holds the base once
    for every adapter it has, training moves only the adapter (the base's samples keep their
    log-probabilities), a saved adapter comes back as a LoRA model with its weights, and an
    exported one loads with PEFT."""
    pytest.importorskip("peft", reason="LoRA adapters need the peft package")
    from plexrl_dask.worker.holder import holder_of

    srv, client, keys = server
    services = {t: sdk(srv, keys[t]) for t in ("alice", "bob")}
    models = {
        t: sc.create_lora_training_client(base_model=BASE, rank=4).result()
        for t, sc in services.items()
    }
    info = models["alice"].get_info()
    assert info.is_lora and info.lora_rank == 4
    base = services["alice"].create_sampling_client(base_model=BASE).result()
    prompt = types.ModelInput.from_ints(A)
    before = base.compute_logprobs(prompt).result()
    for tc in models.values():
        tc.forward_backward([ce_datum(A), ce_datum(B)], "cross_entropy").result()
        tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    assert base.compute_logprobs(prompt).result() == before
    trained = models["alice"].save_weights_and_get_sampling_client().result()
    assert trained.compute_logprobs(prompt).result()[1:] != before[1:]

    def held(dask_worker) -> dict:
        status = holder_of(dask_worker).status()
        return {"bases": status["bases"], "replicas": status["replicas"]}

    ids = {tc.model_id for tc in models.values()}
    found = set()
    for status in client.run(held).values():
        adapters = {n for n in status["replicas"] if n.split("@")[0] in ids}
        found |= adapters
        if adapters:
            [shared] = status["bases"].values()  # one base on the worker, for all of them
            assert adapters <= set(shared["users"])
            resident = {n for n, r in status["replicas"].items() if r["resident"]}
            # (an adapter bank's adapters use the base as "<bank>|<adapter>")
            assert {u.split("|")[0] for u in shared["users"]} <= resident
            assert all(status["replicas"][n]["bytes"] < shared["bytes"] for n in adapters)
    assert len(found) == 2

    path = models["bob"].save_state("adapter").result().path
    saved = models["bob"].forward([ce_datum(A)], "cross_entropy").result().loss_fn_outputs[0]
    again = services["bob"].create_training_client_from_state(path).result()
    assert again.get_info().is_lora
    got = again.forward([ce_datum(A)], "cross_entropy").result().loss_fn_outputs[0]
    assert got["logprobs"].tolist() == saved["logprobs"].tolist()

    # exported in PEFT's format, the adapter loads on the base and scores as the model does
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    export = models["bob"].save_weights_external("peft").result().path
    rest = tinker.RestClient(base_url=srv.url, api_key=keys["bob"])
    assert rest.get_weights_info_by_tinker_path(export).result().lora_rank == 4
    urls = rest.get_external_weights_urls(export).result().urls
    assert set(urls) == {"adapter_model.safetensors", "adapter_config.json"}
    base_model = AutoModelForCausalLM.from_pretrained(srv.service.catalog[BASE].path)
    peft = PeftModel.from_pretrained(base_model, _download(urls, tmp_path / "peft"))
    assert np.allclose(_hf_logprobs(peft, A), saved["logprobs"].tolist(), atol=1e-5)
    for sc in services.values():
        sc.close("success").result()


def test_a_sampler_gives_each_prompt_positions_most_probable_tokens(server):
    """``topk_prompt_logprobs``: at each prompt position after the first, the k most probable
    tokens and their log-probabilities, as the checkpoint's own model gives them, on a base
    sampler and a LoRA snapshot's (its adapter's); ``prompt_logprobs_last_n`` keeps the last
    n positions."""
    from transformers import AutoModelForCausalLM

    srv, client, keys = server
    sc = sdk(srv, keys["bob"])
    base = sc.create_sampling_client(base_model=BASE).result()
    prompt, greedy = types.ModelInput.from_ints(A), types.SamplingParams(max_tokens=2, seed=1)
    res = base.sample(prompt, 1, greedy, include_prompt_logprobs=True,
                      topk_prompt_logprobs=4).result()  # fmt: skip
    model = AutoModelForCausalLM.from_pretrained(srv.service.catalog[BASE].path)
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([A])).logits[0, :-1].float()
    values, ids = torch.log_softmax(logits, -1).topk(4, dim=-1)
    top = res.topk_prompt_logprobs
    assert len(top) == len(A) and top[0] is None
    for pos, pairs in enumerate(top[1:]):
        assert [t for t, _ in pairs] == ids[pos].tolist()
        assert [v for _, v in pairs] == pytest.approx(values[pos].tolist(), abs=1e-5)
    assert res.prompt_logprobs[1:] == pytest.approx(_hf_logprobs(model, A), abs=1e-5)
    last = base.sample(prompt, 1, greedy, include_prompt_logprobs=True, topk_prompt_logprobs=2,
                       prompt_logprobs_last_n=3).result()  # fmt: skip
    assert last.prompt_logprobs[:-3] == [None] * (len(A) - 3)
    assert last.prompt_logprobs[-3:] == pytest.approx(res.prompt_logprobs[-3:], abs=1e-6)
    assert last.topk_prompt_logprobs[:-3] == [None] * (len(A) - 3)
    for whole, kept in zip(top[-3:], last.topk_prompt_logprobs[-3:], strict=True):
        assert [t for t, _ in kept] == [t for t, _ in whole[:2]]
        assert [v for _, v in kept] == pytest.approx([v for _, v in whole[:2]], abs=1e-6)

    # a LoRA model's snapshot: its adapter's tokens (one step away from the base's)
    lora = sc.create_lora_training_client(base_model=BASE, rank=4).result()
    lora.forward_backward([ce_datum(A)], "cross_entropy").result()
    lora.optim_step(types.AdamParams(learning_rate=5e-2)).result()
    snap = lora.save_weights_and_get_sampling_client().result()
    got = snap.sample(prompt, 1, greedy, include_prompt_logprobs=True,
                      topk_prompt_logprobs=4).result()  # fmt: skip
    scored = lora.forward([ce_datum(A)], "cross_entropy").result().loss_fn_outputs[0]
    assert got.prompt_logprobs[1:] == pytest.approx(scored["logprobs"].tolist(), abs=1e-5)
    for lp, pairs in zip(got.prompt_logprobs[1:], got.topk_prompt_logprobs[1:], strict=True):
        assert pairs[0][1] >= lp - 1e-6 and [v for _, v in pairs] == sorted(
            (v for _, v in pairs), reverse=True
        )
    assert got.topk_prompt_logprobs != top
    with pytest.raises(tinker.BadRequestError, match="topk_prompt_logprobs"):
        base.sample(prompt, 1, greedy, topk_prompt_logprobs=101).result()
    with pytest.raises((tinker.BadRequestError, ValueError), match="prompt_logprobs_last_n"):
        base.sample(prompt, 1, greedy, include_prompt_logprobs=True,
                    prompt_logprobs_last_n=len(A)).result()  # fmt: skip
    sc.close("success").result()


def _hf_logprobs(model, tokens):
    """Log-probabilities of ``tokens[1:]`` under a Hugging Face model (what the SDK's
    ``forward`` returns for ``ce_datum(tokens)``)."""
    import torch

    with torch.no_grad():
        logits = model(input_ids=torch.tensor([tokens[:-1]])).logits[0].float()
    lp = torch.log_softmax(logits, dim=-1)
    return [float(lp[i, t]) for i, t in enumerate(tokens[1:])]


def stored_on_nodes(client, saved) -> bool:
    """Whether any worker's node holds ``saved``'s store version (a ``save_state`` result)."""
    model, version = saved["model"], int(saved["version"])

    def locate(dask_worker=None):
        from plexrl_dask.worker.holder import holder_of

        holder = holder_of(dask_worker)
        return holder is not None and holder.node is not None and (
            holder.node.locate(model, version) is not None
        )

    return any(client.run(locate).values())


def wait_until(condition, timeout: float = 30.0) -> bool:
    """Whether ``condition()`` held within ``timeout`` seconds (polled)."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


def _download(urls, directory):
    directory.mkdir()
    for name, url in urls.items():
        got = httpx.get(url, timeout=30)
        assert got.status_code == 200, (name, got.text)
        (directory / name).write_bytes(got.content)
    return directory


def test_checkpoints_are_listed_exported_for_hugging_face_and_deleted(server, tmp_path):
    """The SDK's RestClient: a run's checkpoints listed, described and paged; an export
    (``save_weights_external``) downloaded through its signed URLs loads with
    ``AutoModelForCausalLM`` and scores as the model does; a deleted checkpoint is gone
    from the list and cannot be loaded; none of it reaches another tenant."""
    from transformers import AutoModelForCausalLM

    srv, client, keys = server
    sc = sdk(srv, keys["alice"])
    rest = tinker.RestClient(base_url=srv.url, api_key=keys["alice"])
    tc = sc.create_lora_training_client(base_model=BASE, rank=0).result()
    tc.forward_backward([ce_datum(A)], "cross_entropy").result()
    tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    state = tc.save_state("state").result().path
    sampler = tc.save_weights_for_sampler("sampler").result().path
    export = tc.save_weights_external("hf").result().path
    assert export == f"tinker://{tc.model_id}/external_weights/hf"

    listed = {c.tinker_path: c for c in rest.list_checkpoints(tc.model_id).result().checkpoints}
    assert set(listed) == {state, sampler, export}
    assert [listed[p].checkpoint_type for p in (state, sampler, export)] == [
        "training",
        "sampler",
        "external",
    ]
    assert listed[export].size_bytes > 0
    run = rest.get_training_run(tc.model_id).result()
    assert run.last_checkpoint.tinker_path == state
    assert run.last_sampler_checkpoint.tinker_path == sampler
    assert tc.model_id in {
        r.training_run_id for r in rest.list_training_runs().result().training_runs
    }
    first = rest.list_user_checkpoints(limit=2).result()
    assert len(first.checkpoints) == 2 and first.cursor.total_count >= 3
    assert first.checkpoints[0].tinker_path == export  # (newest first)
    info = rest.get_weights_info_by_tinker_path(state).result()
    assert info.base_model == BASE and not info.is_lora
    # a TTL set and cleared; a name saved again replaces its checkpoint
    rest.set_checkpoint_ttl_from_tinker_path(state, 7200).result()
    [c] = [
        c for c in rest.list_checkpoints(tc.model_id).result().checkpoints if c.tinker_path == state
    ]
    assert c.expires_at is not None
    rest.set_checkpoint_ttl_from_tinker_path(state, None).result()
    first = srv.service.saved.by_path[state].saved
    assert stored_on_nodes(client, first)
    assert tc.save_state("state").result().path == state
    second = srv.service.saved.by_path[state].saved
    assert wait_until(lambda: not stored_on_nodes(client, first))  # (replaced: dropped)
    again = [
        c for c in rest.list_checkpoints(tc.model_id).result().checkpoints if c.tinker_path == state
    ]
    assert len(again) == 1 and again[0].expires_at is None and again[0].time >= c.time

    urls = rest.get_external_weights_urls(export).result().urls
    assert {"model.safetensors", "config.json", "tokenizer.json"} <= set(urls)
    model = AutoModelForCausalLM.from_pretrained(_download(urls, tmp_path / "hf"))
    mine = tc.forward([ce_datum(A)], "cross_entropy").result().loss_fn_outputs[0]
    assert np.allclose(_hf_logprobs(model, A), mine["logprobs"].tolist(), atol=1e-5)
    url = urls["config.json"]
    assert httpx.get(url.replace("signature=", "signature=0")).status_code == 401
    assert httpx.get(url.replace("config.json?", "../keys.yaml?")).status_code in (401, 404)

    bob = tinker.RestClient(base_url=srv.url, api_key=keys["bob"])
    with pytest.raises(tinker.NotFoundError):
        bob.list_checkpoints(tc.model_id).result()
    with pytest.raises(tinker.NotFoundError):
        bob.delete_checkpoint_from_tinker_path(state).result()
    assert not any(c.tinker_path == state for c in bob.list_user_checkpoints().result().checkpoints)

    rest.delete_checkpoint_from_tinker_path(state).result()
    assert not stored_on_nodes(client, second)  # (deleted: its stored version too)
    rest.delete_checkpoint_from_tinker_path(export).result()
    left = {c.tinker_path for c in rest.list_checkpoints(tc.model_id).result().checkpoints}
    assert left == {sampler}
    assert httpx.get(url).status_code == 404
    with pytest.raises(tinker.APIStatusError):
        sc.create_training_client_from_state(state).result()
    # exports refused before anything runs: encrypted, a TTL out of bounds, a bad name
    for extra, error in (
        ({"age_encryption_recipients": ["age1x"]}, "UnsupportedCall"),
        ({"ttl_seconds": 60}, "InvalidTinkerRequest"),
        ({"path": "a/b"}, "InvalidTinkerRequest"),
    ):
        body = {"model_id": tc.model_id, "path": "x", "seq_id": 10**6, **extra}
        r = httpx.post(f"{srv.url}/api/v1/save_weights_external", json=body, timeout=30,
                       headers={"X-API-Key": keys["alice"]})  # fmt: skip
        assert r.status_code == 400 and r.json()["error"] == error, r.json()
    sc.close("success").result()


def test_samplers_of_saved_weights_come_back_after_their_workers_restart(server):
    """(Last in this module: it restarts the cluster's workers.) A sampler of a saved
    checkpoint and a LoRA snapshot in the bank sample the same tokens after every worker was
    restarted (their replicas and the bank's adapters gone with them): the checkpoint's
    replica is deployed again from the checkpoint, the adapter loaded again from the
    snapshot's stored copy, fetched as soon as it was saved (the save's future would have
    run it again on the training replica, lost too)."""
    srv, client, keys = server
    sc = sdk(srv, keys["alice"])
    full = sc.create_lora_training_client(base_model=BASE, rank=0).result()
    full.forward_backward([ce_datum(A)], "cross_entropy").result()
    full.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    path = full.save_weights_for_sampler("restart").result().path
    samplers = {"path": sc.create_sampling_client(model_path=path).result()}
    if _has_peft():
        lora = sc.create_lora_training_client(base_model=BASE, rank=4).result()
        lora.forward_backward([ce_datum(A)], "cross_entropy").result()
        lora.optim_step(types.AdamParams(learning_rate=1e-2)).result()
        samplers["snapshot"] = lora.save_weights_and_get_sampling_client().result()
    prompt = types.ModelInput.from_ints(A[:3])
    params = types.SamplingParams(max_tokens=4, temperature=1.0, seed=11)

    def tokens(s):
        return [q.tokens for q in s.sample(prompt, 2, params).result(timeout=120).sequences]

    before = {name: tokens(s) for name, s in samplers.items()}
    kept = [s.kept for s in srv.service.samplers.values() if s.kept is not None]
    assert all(isinstance(k.saved, dict) for k in kept)  # (fetched: no future left to rerun)
    workers = list(client.scheduler_info()["workers"])
    client.restart_workers(workers, timeout=120)
    assert wait_for(lambda: len(client.scheduler_info()["workers"]) == len(workers), 120)
    assert {name: tokens(s) for name, s in samplers.items()} == before
    sc.close("success").result()


def _has_peft() -> bool:
    try:
        import peft  # noqa: F401
    except ImportError:
        return False
    return True
