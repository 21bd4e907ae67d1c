"""Benchmark: the Tinker front door (``plexrl serve``) against the Python Runtime.

    python -m plexrl_dask.bench.tinker --json OUT [--quick]

One local cluster (one PlexRL worker), one model (Qwen2 architecture, hidden 256, 4 layers,
saved as a local checkpoint), and ``plexrl serve`` on it as a process of its own (the CLI), as a
user runs it. Results:

- ``sdk_version``: the ``tinker`` SDK driving the server (unmodified, from PyPI).
- ``sdk_calls_ok`` / ``sdk_calls``: every supported call type, through the SDK, completed and
  returned what the protocol says (``sdk_call_results`` names each).
- ``protocol_overhead_ratio`` (target <= 1.25): median wall time of one training step through
  the SDK ÷ the same step through the Runtime, each on a training deployment of the same
  checkpoint on the same worker (the server's tenant's, and the benchmark's own job's), steps
  interleaved. A
  step: ``forward_backward`` of 8 sequences of 64 tokens (cross-entropy, summed), then
  ``optim_step``, then 8 sample requests of one prompt each, 4 samples of exactly 16 tokens
  (no stop), at once, all waited for. Through the SDK the step also makes its sampling client
  (``save_weights_and_get_sampling_client``), as a Tinker RL loop does every step, and the
  server merges the 8 calls into fewer requests (see ``sample_merge_speedup``); the Runtime
  arm sends 8 requests.
- ``cookbook_rl_steps``, ``cookbook_reward_first``, ``cookbook_reward_last``: unmodified
  tinker-cookbook recipes end to end (:mod:`plexrl_dask.bench.cookbook`): two tenants at once,
  each warming a model up with ``chat_sl`` and then training it with ``math_rl``
  (``env=arithmetic``, ``loss_fn=importance_sampling``); the RL steps each completed (the
  fewer of the two) and the mean reward of the first and of the last 3 steps (over both).
  ``cookbook_reward_gain_vs_control``: each RL run's reward minus that of its control (the same
  run at learning rate 0: the same problems at every step) over steps 1 on, averaged; above 0,
  the updates learned. The cookbook needs its own interpreter (``--cookbook-python``, or ``PLEXRL_COOKBOOK_PYTHON``);
  without one the stage is not run and ``cookbook_status`` says so.
- ``sample_merge_speedup``: a burst of ``BURST`` concurrent ``sample`` calls on a sampler of
  the base model (one prompt each, 6 to 17 tokens long, ``SAMPLES`` samples of exactly
  ``NEW`` tokens, each call its own seed), all waited for: median wall time through a server
  that sends every call as a request of its own (``plexrl.serve.sample-merge-rows: 1``) ÷
  through one that merges them (the defaults: :mod:`plexrl_dask.serve.coalesce`); both
  servers on the same cluster, arms interleaved. ``sample_merge_tokens_identical``: whether every call's tokens and log-probabilities were the
  same bits from both servers in every repetition (each row decoded as if alone).
  ``sample_merge_speedup_lora``: the same burst on the snapshot sampler of a new LoRA model
  (rank ``LORA_RANK``, the SDK's default config) of the base on each server.
  ``protocol_overhead_ratio_unmerged`` is ``protocol_overhead_ratio`` through the server that
  does not merge (its 8 sample calls are 8 requests, as in the Runtime arm);
  ``protocol_overhead_ratio_unkept`` through a third server that does not keep snapshot
  samplers' weights past a step (``plexrl.serve.kept-snapshots: 0``; by default each step's
  ``optim_step`` first saves the weights its last sampling client holds), and
  ``kept_snapshots_step_ratio`` the default server's step ÷ that one's; all four arms
  interleaved.
- ``bank_merge_speedup_tenants``: ``BANK_TENANTS`` tenants, each with a LoRA model (rank
  ``LORA_RANK``) of the base after one training step on data of its own, and its snapshot
  sampler; each sampler sends ``BURST // BANK_TENANTS`` of the burst's calls, all tenants at
  once, all waited for: median wall time through a server without adapter banks
  (``plexrl.serve.adapter-bank: false``: each tenant's calls merged on its own LoRA replica,
  one request per tenant) ÷ through the default server (the snapshots are adapters in the
  base's bank, and every tenant's calls merge into one decode:
  :mod:`plexrl_dask.worker.backends.adapters`); the same tenants' models on both servers,
  arms interleaved. ``bank_tokens_identical``: whether every call's tokens and
  log-probabilities were the same bits through both servers in every repetition.
- ``custom_loss_step_ratio``: a step of a custom loss (``forward_backward_custom`` of the
  step's 8 sequences, a clipped importance-sampling loss of their ``logprob_old`` and
  ``advantages`` inputs, then ``optim_step``), median wall time with a handle of
  ``create_custom_loss`` (the loss runs on the worker: one ``forward_backward``) ÷ with the
  same loss as a Python callable (the SDK's own path: a ``forward``, the loss on the client,
  then a ``cross_entropy`` backward weighted by its gradient); two models of the base, arms
  interleaved. ``custom_loss_matches_sdk``: whether both arms' ``loss:sum`` agreed at every
  step to a relative 1e-4.
- ``lora_tenants_resident_bytes_ratio`` (target <= 1.05): eight tenants, each with a LoRA
  model (rank ``LORA_RANK``) of the same base on the one worker, each after one training step
  (its AdamW moments exist): the bytes of the distinct tensor storages their replicas reach on
  the worker (parameters, buffers, gradients, optimizer state; a storage two replicas share
  counts once), measured there ÷ the base's parameter bytes + 8 × one adapter's state
  (weights and two AdamW moments, float32), computed from the spec of the adapter the
  server makes of the SDK's default LoRA config (attention, MLP and unembedding). Beside it
  ``lora_tenants_resident_bytes_vs_full`` divides the same bytes by eight full fine-tuning
  replicas' state (weights, gradients, moments) of the base.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import torch
from distributed import Client

import plexrl_dask as plexrl
from plexrl_dask.bench.common import interleaved, median, parser, report
from plexrl_dask.models.spec import LoraSpec
from plexrl_dask.serve.tenants import add_key
from plexrl_dask.serve.wire import lora_config

TARGETS = {
    "protocol_overhead_ratio": "<= 1.25",
    "sdk_calls_ok": "true",
    "lora_tenants_resident_bytes_ratio": "<= 1.05",
}
BASE = "bench-qwen"
SEQ, BATCH, PROMPTS, SAMPLES, NEW = 64, 8, 8, 4, 16
BURST = 32
LORA_TENANTS, LORA_RANK = 8, 8
BANK_TENANTS = 4
#: the cookbook stage's model: small enough to warm up and train on 2 cores in minutes
COOK_SPEC = plexrl.ModelSpec.tiny(
    hidden_size=128, num_layers=2, num_heads=4, num_kv_heads=2, max_positions=256, seed=1
)


def _cookbook(args: Any, url: str, keys: list[str], model: str, tmp: Path) -> dict[str, Any]:
    """The cookbook stage: its tenants at once, each in a thread of its own."""
    from concurrent.futures import ThreadPoolExecutor

    from plexrl_dask.bench.cookbook import run_tenant

    epochs, steps = (3, 12) if args.quick else (4, 24)
    with ThreadPoolExecutor(len(keys)) as pool:
        futures = {
            f"cook-{chr(97 + i)}": pool.submit(
                run_tenant,
                args.cookbook_python,
                url,
                key,
                model,
                tmp / f"cook-{i}",
                12000,
                epochs,
                steps,
            )
            for i, key in enumerate(keys)
        }
        try:
            tenants = {name: f.result() for name, f in futures.items()}
        except Exception as e:  # (reported, with the other figures, not raised)
            return {"status": f"failed: {type(e).__name__}: {e}"}
    return {"status": "ran", "tenants": tenants}


def _mean_of(rows: list[dict], key: str) -> float | None:
    values = [r[key] for r in rows if r.get(key) is not None]
    return sum(values) / len(values) if values else None


def main() -> None:
    p = parser(__doc__.splitlines()[0])
    p.add_argument(
        "--cookbook-python",
        default=os.environ.get("PLEXRL_COOKBOOK_PYTHON"),
        help="an interpreter with tinker-cookbook[math-rl] installed (its stage is skipped without)",
    )
    args = p.parse_args()
    os.environ.setdefault("TINKER_TELEMETRY", "0")
    import tinker

    reps = 5 if args.quick else 15
    spec = plexrl.ModelSpec.tiny(
        hidden_size=256, num_layers=4, num_heads=8, num_kv_heads=2, max_positions=512
    )
    cook: dict[str, Any] = {"status": "not run: no --cookbook-python"}
    with tempfile.TemporaryDirectory(prefix="plexrl-bench-tinker-") as tmp:
        checkpoint = str(Path(tmp) / "model")
        spec.save_pretrained(checkpoint)
        cook_model = str(Path(tmp) / "cook-model")
        COOK_SPEC.save_pretrained(cook_model)
        keys = Path(tmp) / "keys.yaml"
        key = add_key(keys, "bench")
        cook_keys = [add_key(keys, f"cook-{t}") for t in "ab"]
        lora_keys = [add_key(keys, f"lora-{i}") for i in range(LORA_TENANTS)]
        # the server that does not merge: its own keys and state files, its own tenant's job
        unmerged_keys = Path(tmp) / "unmerged-keys.yaml"
        unmerged_key = add_key(unmerged_keys, "bench-unmerged")
        # and one that does not keep snapshot samplers' weights past a step (serve/snapshots.py)
        unkept_keys = Path(tmp) / "unkept-keys.yaml"
        unkept_key = add_key(unkept_keys, "bench-unkept")
        # and one without adapter banks (each LoRA snapshot samples its own replica)
        bank_keys = [add_key(keys, f"bank-{i}") for i in range(BANK_TENANTS)]
        unbanked_keys = Path(tmp) / "unbanked-keys.yaml"
        unbanked = [add_key(unbanked_keys, f"unbanked-{i}") for i in range(BANK_TENANTS)]
        models = {BASE: checkpoint, cook_model: cook_model}
        with (
            plexrl.local_cluster(n_workers=1) as cluster,
            Client(cluster) as client,
            _server(cluster.scheduler_address, keys, models) as url,
            _server(
                cluster.scheduler_address,
                unmerged_keys,
                models,
                {"DASK_PLEXRL__SERVE__SAMPLE_MERGE_ROWS": "1"},
            ) as unmerged_url,
            _server(
                cluster.scheduler_address,
                unkept_keys,
                models,
                {"DASK_PLEXRL__SERVE__KEPT_SNAPSHOTS": "0"},
            ) as unkept_url,
            _server(
                cluster.scheduler_address,
                unbanked_keys,
                models,
                {"DASK_PLEXRL__SERVE__ADAPTER_BANK": "False"},
            ) as unbanked_url,
        ):
            service = tinker.ServiceClient(base_url=url, api_key=key)
            unmerged = tinker.ServiceClient(base_url=unmerged_url, api_key=unmerged_key)
            calls = _every_call(tinker, service, url, key)
            trainer = service.create_lora_training_client(base_model=BASE, rank=0).result()
            trainer_unmerged = unmerged.create_lora_training_client(
                base_model=BASE, rank=0
            ).result()
            unkept = tinker.ServiceClient(base_url=unkept_url, api_key=unkept_key)
            trainer_unkept = unkept.create_lora_training_client(base_model=BASE, rank=0).result()
            # the same model as a deployment of the benchmark's own job (the server's tenant
            # job is the server's: another driver may not act in its name)
            runtime = plexrl.Runtime(client, job="bench-runtime")
            dep = runtime.deploy("policy", plexrl.ModelSpec(path=checkpoint))
            sdk_step, runtime_step = _steps(tinker, trainer, dep)
            unmerged_step, _ = _steps(tinker, trainer_unmerged, dep)
            unkept_step, _ = _steps(tinker, trainer_unkept, dep)
            arms = {
                "sdk": sdk_step,
                "sdk_unmerged": unmerged_step,
                "sdk_unkept": unkept_step,
                "runtime": runtime_step,
            }
            for arm in arms.values():
                arm()  # (warm: first steps build caches)
            times = interleaved(arms, reps)
            custom = _custom_loss(tinker, service, reps)
            unkept.close("success").result()
            runtime.undeploy(dep.name)
            merge = _merge_burst(tinker, service, unmerged, reps)
            unmerged.close("success").result()
            service.close("success").result()
            bank = _bank_burst(tinker, (url, bank_keys), (unbanked_url, unbanked), reps)
            lora = _lora_residency(tinker, client, url, lora_keys, spec)
            if args.cookbook_python:
                cook = _cookbook(args, url, cook_keys, cook_model, Path(tmp))
    ends = [t for t in cook.get("tenants", {}).values()]
    results: dict[str, Any] = {
        "sdk_version": tinker.__version__,
        "sdk_calls_ok": all(calls.values()),
        "sdk_calls": len(calls),
        "sdk_call_results": calls,
        "protocol_overhead_ratio": median(times["sdk"]) / median(times["runtime"]),
        "protocol_overhead_ratio_unmerged": median(times["sdk_unmerged"])
        / median(times["runtime"]),
        "protocol_overhead_ratio_unkept": median(times["sdk_unkept"]) / median(times["runtime"]),
        "kept_snapshots_step_ratio": median(times["sdk"]) / median(times["sdk_unkept"]),
        **merge,
        **bank,
        **custom,
        "step_s_sdk": median(times["sdk"]),
        "step_s_sdk_unmerged": median(times["sdk_unmerged"]),
        "step_s_sdk_unkept": median(times["sdk_unkept"]),
        "step_s_runtime": median(times["runtime"]),
        "cookbook_status": cook["status"],
        "cookbook_tenants": len(ends),
        "cookbook_rl_steps": min((t["rl_steps"] for t in ends), default=None),
        "cookbook_reward_first": _mean_of(ends, "reward_first"),
        "cookbook_reward_last": _mean_of(ends, "reward_last"),
        "cookbook_reward_gain_vs_control": _mean_of(ends, "reward_gain_vs_control"),
        "cookbook": cook.get("tenants"),
        **lora,
    }
    config = {"reps": reps, "model_parameters": spec.num_parameters(), "step": {
        "forward_backward": f"{BATCH} x {SEQ} tokens", "samples": f"{PROMPTS} x {SAMPLES} x {NEW}",
        "merge_burst": f"{BURST} calls x {SAMPLES} x {NEW}"}}  # fmt: skip
    report("tinker", results, TARGETS, config, args.json)


class _server:
    """``plexrl serve`` as its own process on a free port; its URL once it answers."""

    def __init__(
        self,
        scheduler: str,
        keys: Path,
        models: dict[str, str],
        env: dict[str, str] | None = None,
    ) -> None:
        import socket

        self.env = {**os.environ, **(env or {})}

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.args = [
            sys.executable, "-m", "plexrl_dask.cli", "serve", "--scheduler", scheduler,
            "--keys", str(keys), "--port", str(self.port),
            *(f"--model={name}={path}" for name, path in models.items()),
        ]  # fmt: skip

    def __enter__(self) -> str:
        self.proc = subprocess.Popen(self.args, env=self.env)
        url = f"http://127.0.0.1:{self.port}"
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"plexrl serve exited with {self.proc.returncode}")
            try:
                if httpx.get(f"{url}/api/v1/healthz", timeout=2).status_code == 200:
                    return url
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        self.proc.kill()
        raise RuntimeError("plexrl serve did not answer in 120 s")

    def __exit__(self, *exc: object) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def _lora_residency(
    tinker: Any, client: Client, url: str, keys: list[str], base: Any
) -> dict[str, Any]:
    """The LoRA stage (module docstring): one LoRA model per key, one step each, then the
    bytes their replicas hold on the worker, measured there."""
    services = [tinker.ServiceClient(base_url=url, api_key=k) for k in keys]
    models = [
        s.create_lora_training_client(base_model=BASE, rank=LORA_RANK).result() for s in services
    ]
    _, datum = _data(tinker, 0)
    for tc in models:
        tc.forward_backward([datum], "cross_entropy").result()
        tc.optim_step(tinker.types.AdamParams(learning_rate=1e-4)).result()
    ids = {tc.model_id for tc in models}
    held = client.run(_distinct_bytes, ids)
    for s in services:
        s.close("success").result()
    measured = sum(h["bytes"] for h in held.values())
    # (the adapter the server makes of the SDK's default LoRA config: unembedding included)
    lora = dataclasses.replace(base, lora=LoraSpec.from_dict(lora_config({"rank": LORA_RANK})))
    adapter_state = lora.adapter_parameters() * 12  # float32 weights + two AdamW moments
    ideal = base.memory_bytes("rollout") + len(keys) * adapter_state
    return {
        "lora_tenants": len(keys),
        "lora_replicas_found": sum(h["replicas"] for h in held.values()),
        "lora_resident_bytes": measured,
        "lora_ideal_bytes": ideal,
        "lora_tenants_resident_bytes_ratio": measured / ideal,
        "lora_tenants_resident_bytes_vs_full": measured / (len(keys) * base.memory_bytes("train")),
    }


def _distinct_bytes(names: set[str], dask_worker: Any = None) -> dict[str, int]:
    """On a worker: the bytes of the distinct storages that the replicas named (by Tinker
    model id, without the job suffix) reach, and how many such replicas it holds."""
    import torch

    from plexrl_dask.worker.holder import holder_of

    holder = holder_of(dask_worker)
    seen: dict[int, int] = {}
    found = 0
    for name, replica in list(holder._replicas.items()):
        if name.split("@")[0] not in names or not replica.backend.resident:
            continue
        found += 1
        backend = replica.backend
        tensors = [*backend.model.parameters(), *backend.model.buffers()]
        tensors += [p.grad for p in backend.model.parameters() if p.grad is not None]
        if backend.optimizer is not None:
            for state in backend.optimizer.state.values():
                tensors += [v for v in state.values() if isinstance(v, torch.Tensor)]
        for t in tensors:
            storage = t.untyped_storage()
            seen[storage.data_ptr()] = storage.nbytes()
    return {"bytes": sum(seen.values()), "replicas": found}


def _data(tinker: Any, i: int) -> tuple[list[int], Any]:
    tokens = [5 + (i * 7 + j) % 90 for j in range(SEQ)]
    datum = tinker.types.Datum(
        model_input=tinker.types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * (SEQ - 1)},
    )
    return tokens, datum


def _steps(tinker: Any, trainer: Any, dep: Any) -> tuple[Any, Any]:
    """The same training step through the SDK and through the Runtime (module docstring)."""
    types = tinker.types
    data = [_data(tinker, i) for i in range(BATCH)]
    prompts = [tokens[:8] for tokens, _ in data[:PROMPTS]]

    def sdk() -> None:
        fb = trainer.forward_backward([d for _, d in data], "cross_entropy")
        opt = trainer.optim_step(types.AdamParams(learning_rate=1e-4))
        fb.result(), opt.result()
        sampler = trainer.save_weights_and_get_sampling_client().result()
        futures = [
            sampler.sample(
                types.ModelInput.from_ints(p),
                SAMPLES,
                types.SamplingParams(max_tokens=NEW, stop=[], seed=i),
            )
            for i, p in enumerate(prompts)
        ]
        for f in futures:
            assert all(len(s.tokens) == NEW for s in f.result().sequences)

    batch = [plexrl.Datum(tokens=tokens) for tokens, _ in data]
    loss = plexrl.CrossEntropy(normalizer=1.0)
    adam = plexrl.AdamWParams(lr=1e-4, beta2=0.95, eps=1e-12, grad_clip=None)

    def runtime() -> None:
        plexrl.result([dep.forward_backward(batch, loss, logprobs=True), dep.optim_step(adam)])
        futures = [
            dep.sample(
                [p], plexrl.SamplingParams(n=SAMPLES, max_tokens=NEW, ignore_eos=True, seed=i)
            )
            for i, p in enumerate(prompts)
        ]
        for r in plexrl.result(futures):
            assert all(len(s.tokens) == NEW for s in r.sequences[0])

    return sdk, runtime


def _clipped(
    logprobs: torch.Tensor, logprob_old: torch.Tensor, advantages: torch.Tensor
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The custom loss of `custom_loss_*` (traced by the SDK: no branching on values)."""
    ratio = torch.exp(logprobs - logprob_old).clamp(0.5, 2.0)
    return -(ratio * advantages).sum(), {"custom/ratio:mean": ratio.mean()}


def _custom_loss(tinker: Any, service: Any, reps: int) -> dict[str, Any]:
    """``custom_loss_*`` (module docstring)."""
    types = tinker.types
    handle = service.create_custom_loss(
        _clipped, {"logprobs": 1, "logprob_old": 1, "advantages": 1}
    ).result()
    data = []
    for i in range(BATCH):
        _, datum = _data(tinker, i)
        # (arrays: the SDK turns lists into tensors only under the keys it knows)
        inputs = {
            "logprob_old": np.full(SEQ - 1, -4.0, dtype=np.float32),
            "advantages": np.full(SEQ - 1, (-1.0) ** i, dtype=np.float32),
        }
        data.append(types.Datum(model_input=datum.model_input, loss_fn_inputs={
            "target_tokens": datum.loss_fn_inputs["target_tokens"], **inputs}))  # fmt: skip

    def in_the_sdk(data: list, logprobs: list) -> tuple[Any, dict[str, float]]:
        total, ratio = 0.0, 0.0
        for d, lp in zip(data, logprobs, strict=True):
            ins = [d.loss_fn_inputs[k].to_torch() for k in ("logprob_old", "advantages")]
            loss, metrics = _clipped(lp, *ins)
            total, ratio = total + loss, ratio + float(metrics["custom/ratio:mean"])
        return total, {"custom/ratio:mean": ratio / len(data)}

    losses: dict[str, list[float]] = {"server": [], "sdk": []}

    def step(trainer: Any, loss: Any, arm: str) -> None:
        fb = trainer.forward_backward_custom(data, loss)
        opt = trainer.optim_step(types.AdamParams(learning_rate=1e-4))
        losses[arm].append(fb.result().metrics["loss:sum"])
        opt.result()

    server = service.create_lora_training_client(base_model=BASE, rank=0).result()
    sdk = service.create_lora_training_client(base_model=BASE, rank=0).result()
    arms = {
        "server": lambda: step(server, handle, "server"),
        "sdk": lambda: step(sdk, in_the_sdk, "sdk"),
    }
    for arm in arms.values():
        arm()  # (warm)
    times = interleaved(arms, reps)
    pairs = zip(losses["server"], losses["sdk"], strict=True)
    return {
        "custom_loss_step_ratio": median(times["server"]) / median(times["sdk"]),
        "custom_loss_matches_sdk": all(abs(a - b) <= 1e-4 * max(1.0, abs(b)) for a, b in pairs),
        "custom_loss_step_s_server": median(times["server"]),
        "custom_loss_step_s_sdk": median(times["sdk"]),
    }


def _merge_burst(tinker: Any, merged: Any, unmerged: Any, reps: int) -> dict[str, Any]:
    """``sample_merge_*`` (module docstring): the burst through both servers, interleaved, on
    samplers of the base model and of a LoRA model of it."""
    types = tinker.types
    prompts = [
        types.ModelInput.from_ints([5 + (i * 11 + j) % 90 for j in range(6 + i % 12)])
        for i in range(BURST)
    ]
    params = [types.SamplingParams(max_tokens=NEW, stop=[], seed=1000 + i) for i in range(BURST)]

    def lora_sampler(service: Any) -> Any:
        trainer = service.create_lora_training_client(base_model=BASE, rank=LORA_RANK).result()
        return trainer.save_weights_and_get_sampling_client().result()

    samplers = {
        "merged": [merged.create_sampling_client(base_model=BASE).result()],
        "unmerged": [unmerged.create_sampling_client(base_model=BASE).result()],
        "lora_merged": [lora_sampler(merged)],
        "lora_unmerged": [lora_sampler(unmerged)],
    }
    times, outs = _bursts(samplers, prompts, params, reps)
    out: dict[str, Any] = {}
    same = True
    for kind in ("", "lora_"):
        first = outs[f"{kind}merged"][0]
        same = same and all(o == first for k in ("merged", "unmerged") for o in outs[kind + k])
        out[f"sample_merge_speedup{'_lora' if kind else ''}"] = median(
            times[f"{kind}unmerged"]
        ) / median(times[f"{kind}merged"])
        out[f"sample_merge_burst_s{'_lora' if kind else ''}"] = median(times[f"{kind}merged"])
        out[f"sample_merge_burst_s_unmerged{'_lora' if kind else ''}"] = median(
            times[f"{kind}unmerged"]
        )
    out["sample_merge_tokens_identical"] = same
    return out


def _bank_burst(
    tinker: Any, banked: tuple[str, list[str]], unbanked: tuple[str, list[str]], reps: int
) -> dict[str, Any]:
    """``bank_merge_speedup_tenants`` (module docstring): the tenants' bursts through the
    server with adapter banks and through the one without, interleaved."""
    types = tinker.types
    per = BURST // BANK_TENANTS
    prompts = [
        types.ModelInput.from_ints([5 + (i * 7 + j) % 90 for j in range(6 + i % 12)])
        for i in range(per)
    ]
    params = [types.SamplingParams(max_tokens=NEW, stop=[], seed=2000 + i) for i in range(per)]

    def tenants(url: str, keys: list[str]) -> tuple[list[Any], list[Any]]:
        services = [tinker.ServiceClient(base_url=url, api_key=k) for k in keys]
        samplers = []
        for i, service in enumerate(services):
            trainer = service.create_lora_training_client(base_model=BASE, rank=LORA_RANK).result()
            _, datum = _data(tinker, i)  # (each tenant its own data: its own adapter)
            trainer.forward_backward([datum], "cross_entropy").result()
            trainer.optim_step(types.AdamParams(learning_rate=1e-2)).result()
            samplers.append(trainer.save_weights_and_get_sampling_client().result())
        return services, samplers

    arms_of = {"banked": tenants(*banked), "unbanked": tenants(*unbanked)}
    times, outs = _bursts({k: v[1] for k, v in arms_of.items()}, prompts, params, reps)
    for services, _ in arms_of.values():
        for service in services:
            service.close("success").result()
    first = outs["banked"][0]
    return {
        "bank_merge_speedup_tenants": median(times["unbanked"]) / median(times["banked"]),
        "bank_burst_s": median(times["banked"]),
        "bank_burst_s_unbanked": median(times["unbanked"]),
        "bank_tokens_identical": all(o == first for runs in outs.values() for o in runs),
        "bank_tenants": BANK_TENANTS,
    }


def _bursts(
    arms: dict[str, list[Any]], prompts: list[Any], params: list[Any], reps: int
) -> tuple[dict[str, list[float]], dict[str, list[Any]]]:
    """Each arm's burst (every prompt to each of its samplers, all at once, all waited for)
    after one to warm up, arms interleaved: their times, and every call's tokens and
    log-probabilities per burst."""
    outs: dict[str, list[Any]] = {name: [] for name in arms}

    def burst(name: str) -> Callable[[], None]:
        def run() -> None:
            futures = [
                s.sample(p, SAMPLES, q)
                for p, q in zip(prompts, params, strict=True)
                for s in arms[name]
            ]
            got = [[(x.tokens, x.logprobs) for x in f.result().sequences] for f in futures]
            assert all(len(t) == NEW for g in got for t, _ in g)
            outs[name].append(got)

        return run

    runs = {name: burst(name) for name in arms}
    for run in runs.values():
        run()  # (warm)
    return interleaved(runs, reps), outs


def _every_call(tinker: Any, service: Any, url: str, key: str) -> dict[str, bool]:
    """Each supported call type through the SDK: did it complete as the protocol says."""
    types = tinker.types
    out: dict[str, bool] = {}

    def check(name: str, fn: Any) -> Any:
        try:
            value = fn()
            out[name] = True
            return value
        except Exception as e:  # (recorded, not raised: the benchmark reports every call)
            print(f"{name}: {type(e).__name__}: {e}", file=sys.stderr)
            out[name] = False
            return None

    rest = tinker.RestClient(base_url=url, api_key=key)
    check("get_server_capabilities", lambda: rest.get_server_capabilities().result())
    tc = check(
        "create_model",
        lambda: service.create_lora_training_client(base_model=BASE, rank=0).result(),
    )
    if tc is None:
        return out
    tokens, datum = _data(tinker, 0)
    n = SEQ - 1
    rl = types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={
            "target_tokens": tokens[1:],
            "logprobs": [-3.0] * n,
            "advantages": [0.1] * n,
        },
    )
    check("get_info", lambda: tc.get_info().model_data.model_name == BASE or 1 / 0)
    check(
        "forward_backward:cross_entropy",
        lambda: tc.forward_backward([datum], "cross_entropy").result(),
    )
    check(
        "forward_backward:importance_sampling",
        lambda: tc.forward_backward([rl], "importance_sampling").result(),
    )
    check("forward_backward:ppo", lambda: tc.forward_backward([rl], "ppo").result())
    check("forward", lambda: tc.forward([datum], "cross_entropy").result())
    check("optim_step", lambda: tc.optim_step(types.AdamParams(learning_rate=1e-4)).result())
    sampler = check(
        "save_weights_for_sampler", lambda: tc.save_weights_and_get_sampling_client().result()
    )
    prompt = types.ModelInput.from_ints(tokens[:8])
    params = types.SamplingParams(max_tokens=8)
    if sampler is not None:
        check("sample", lambda: sampler.sample(prompt, 2, params).result().sequences[1])
        check("compute_logprobs", lambda: sampler.compute_logprobs(prompt).result()[1])
    path = check(
        "save_weights_for_sampler:named", lambda: tc.save_weights_for_sampler("b1").result().path
    )
    check("save_state", lambda: tc.save_state("b1").result().path)
    if path is not None:
        check(
            "create_sampling_client:path",
            lambda: (
                service.create_sampling_client(model_path=path)
                .result()
                .sample(prompt, 1, params)
                .result()
            ),
        )
    check("create_sampling_client:base", lambda: service.create_sampling_client(base_model=BASE).result().sample(prompt, 1, params).result())  # fmt: skip
    return out


if __name__ == "__main__":
    main()
