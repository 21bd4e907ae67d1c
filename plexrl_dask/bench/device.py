"""The GPU checks, in one run: what the device machine is lent for (docs/deploying.md, "The GPU checks").

Everything runs in this process, on ``--device`` (``cuda`` by default; ``cpu`` runs the same
code with gloo, which is how the tests keep this module working on machines without a GPU).
No Dask cluster is started: the parts measured are the backends themselves, so the machine
needs torch and transformers, and the few pure-Python packages ``plexrl_dask`` imports.

- **Budget** (``budget_fraction``): the ``"auto"`` memory budget the replica holder uses on
  this device ÷ the device's memory (0.9 on a GPU).
- **Offload and reload through the backend** (``offload_gbps``, ``reload_gbps``): a training
  replica (weights, Adam moments; ``--hidden`` × ``--layers``) is offloaded to host memory and
  reloaded with :meth:`TorchBackend.offload` / :meth:`TorchBackend.reload` (pinned host
  buffers on CUDA), ``--reps`` times, interleaved with the baseline in the same run: one
  ``copy_`` of the same number of bytes between the device and a pinned buffer allocated once
  (``plain_*_gbps``), and the same with the pinned buffer allocated per copy
  (``plain_alloc_*_gbps``: the backend allocates its host buffers per offload).
  ``offload_ratio`` / ``reload_ratio``: the backend's GB/s ÷ the plain copy's (medians).
  Where an offload's time goes beyond the plain copy, each part alone:
  ``per_tensor_offload_ratio`` (the replica's state tensors copied one by one into pinned
  buffers of their own, on the backend's copy stream, nothing released; its GB/s ÷ the plain
  copy's) and ``release_ms`` / ``release_share_of_offload`` (device copies of the same
  tensors, made untimed, dropped and handed back to the driver with
  ``torch.cuda.empty_cache()``: what an offload spent beyond its copies when it handed its
  blocks back, which it no longer does; its median time, and that ÷ the offload's).
  ``reload_bit_identical``: every parameter after the first round trip equals its value before.
  On the CPU there is nothing to move (device memory is host memory): the numbers are reported
  but say nothing about a GPU.
- **A reload beside a running request** (``overlap_*``): the holder's prefetch reloads a
  replica in its own thread while another replica's request runs. Here a thread keeps the
  default stream busy with a fixed run of matrix products (the request) while the offloaded
  replica reloads in another, ``--reps`` rounds, each arm also timed alone in the same
  rounds. ``overlap_reload_ratio``: the reload's wall time beside the products ÷ alone (near
  1 when its copies run on a stream of their own and go to the copy engines meanwhile; the
  products' whole queue when they share the default stream); ``overlap_kernels_ratio``: the
  products' time beside the reload ÷ alone. ``overlap_bit_identical``: the weights after
  those reloads equal their values before. On the CPU both share the cores: the numbers are
  reported but say nothing about a GPU.
- **FSDP2 on a group of one** (``fsdp_*``): the same model built twice from the same seed, one
  sharded with ``fully_shard`` on a one-rank process group (NCCL on CUDA, gloo on the CPU;
  :class:`~plexrl_dask.worker.groups.ProcessGroupManager`), one plain, each taking
  ``--fsdp-steps`` identical ``forward_backward`` + ``optim_step`` steps. ``fsdp_losses``
  both runs' losses, ``fsdp_max_loss_diff`` and ``fsdp_max_weight_diff`` (after the last
  step) how far apart they end, ``fsdp_step_time_ratio`` the sharded step's median time ÷ the
  plain one's. Then the sharded rank is offloaded and rebuilt on its group, as the holder does
  between requests: ``fsdp_offload_released`` (the offload let go of every parameter of the
  module, its gradients and moments with them; ``fsdp_offload_freed_bytes``: the device
  memory that freed, on CUDA), ``fsdp_rebuilt_bit_identical``, and one more step of both (its
  loss is the last of ``fsdp_losses``).
- **The vLLM backend** (``vllm_*``; ``vllm_skipped`` says why not where CUDA or the ``vllm``
  package is missing): one model (``--hidden`` × ``--layers``, bf16) as a vLLM replica and as
  a torch replica, a GRPO step's shape (16 prompts × 8 samples, ``ignore_eos``, 64 tokens)
  sampled ``--reps`` times by each, interleaved: ``vllm_tokens_per_s``,
  ``torch_tokens_per_s`` and their ratio ``vllm_to_torch_ratio``; ``vllm_repeat_identical``
  (the same request twice samples the same rows); a sleep and a wake
  (``vllm_sleep_s``, ``vllm_wake_s``, ``vllm_sleep_freed_bytes``,
  ``vllm_wake_identical``: the request after waking samples what it did before); and a
  published version of the torch replica's weights loaded into the engine
  (``vllm_load_weights_s``).
- **Batch-invariant decoding** (``row_invariant_*``; :mod:`plexrl_dask.worker.row_decode`):
  the row decoder's probe on this device (``row_invariant_cap``, ``row_invariant_exact``: on
  how many rows its products agreed with one row alone), and ``row_invariant_identical``:
  16 prompts of 4 to 19 tokens, 4 samples of up to 16 tokens each, sampled in one invariant
  request and each prompt alone, the same bits (the model ``--hidden`` × ``--layers``,
  float32; and in bf16, ``row_invariant_identical_bf16``). ``row_invariant_merged_speedup``:
  the 16 prompts one request each ÷ in one request (median of ``--reps``).
- **Adapter banks** (``bank_*``; :mod:`plexrl_dask.worker.backends.adapters`): four LoRA
  adapters (rank 8, every linear layer and the head; random ``B``) on one float32 base, saved
  to a store and loaded into a bank; 16 prompts, four per adapter, sampled in one bank request
  and each prompt alone on its adapter's own replica: ``bank_identical`` (the same bits), and
  ``bank_merged_speedup``: the four adapters' prompts as one request per adapter on its own
  replica ÷ one bank request (median of ``--reps``). Where the device's products are not
  row-invariant, the bank serves prompts one at a time and says so (``bank_row_invariant``).
- **Sampling** (``<job>_*``): ``bench.sampling``'s per-job measurement on this device: the
  job's model after its supervised warm-up, a GRPO step's 128-row request decoded as one batch
  (``to_peak_b128``) and in 64-row streams, against the replica's ``ignore_eos`` peak at its
  best batch size, and the tail bound of the request's own completion lengths. The replica
  decodes with the engine the configuration gives it on this device (``auto``: the static
  decoder with captured steps on CUDA). ``grpo_request_to_peak``: the mean of the jobs'
  ``to_peak_b128``.
- **Token agreement** (``captured_token_agreement``): on each measured job's warmed model,
  ``--rounds`` GRPO requests of the job (its prompts, group size, temperature, stop string and
  ``max_tokens``; seed = the round) sampled by the static decoder with captured steps and by
  the dynamic (eager) decoder, same seeds: the share of positions where they chose the same
  token, each row compared up to and including its first difference
  (:func:`plexrl_dask.bench.decode_rates.agreement`). ``captured_vs_static_agreement``: the
  same against the static decoder op by op (the graphs alone).
- **Decode throughput** (``decode_<shape>_*``; :mod:`plexrl_dask.bench.decode_rates`): models
  of the Qwen2.5-0.5B and -1.5B shapes (random init, bf16; ``tiny`` on the CPU or with
  ``--quick``), ``b`` prompts of 16 tokens each decoding 128 tokens (``ignore_eos``; 16 with
  ``--quick``) for ``b`` in 1, 8, 64, 256: tokens/s of the dynamic decoder (``eager``), the
  static decoder op by op (``static``) and with captured steps (``captured``), and of
  transformers' continuous batching (``hf_cb``) on the same model. The roofline
  (``decode_<shape>_roofline_tokens_per_s_b<b>``): ``b`` tokens per the time the step's bytes
  (every parameter once, each row's keys and values at its mean position) take at the
  device-to-device copy's memory traffic (``copy_gbps`` × 2: a copy reads and writes each
  byte); ``decode_<shape>_roofline_fraction_b<b>`` the captured arm's tokens/s ÷ that.
  Headlines, on the 0.5B shape: ``decode_roofline_fraction_b1`` and
  ``captured_vs_eager_tokens_ratio_b8`` (captured ÷ eager tokens/s at 8 rows).
  ``decode_<shape>_greedy_agreement``: captured against eager, greedy, on the random model
  (near-uniform logits: rounding flips choices far more often than on a trained model).

Run: ``python -m plexrl_dask.bench.device --json OUT [--quick] [--device cpu]`` (on the H200:
a few minutes; ``--quick`` shrinks every part).
"""

from __future__ import annotations

import dataclasses
import functools
import gc
import logging
import statistics
import threading
import time
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from plexrl_dask import config
from plexrl_dask.bench.common import parser, report, write_json
from plexrl_dask.bench.sampling import measure_job, warmed_backend
from plexrl_dask.models.spec import ModelSpec
from plexrl_dask.rl.catalog import standard_jobs
from plexrl_dask.shared.types import AdamWParams, CrossEntropy, Datum, SamplingParams, Streams
from plexrl_dask.worker.backends import TorchBackend
from plexrl_dask.worker.backends.fsdp import FSDPBackend
from plexrl_dask.worker.device import copy_stream, default_budget
from plexrl_dask.worker.groups import GroupContext, ProcessGroupManager

if TYPE_CHECKING:
    from plexrl_dask.rl.modes import JobSpec

logger = logging.getLogger(__name__)

TARGETS = {
    "offload_ratio": ">= 0.9 (the backend's offload GB/s ÷ a plain pinned copy_'s, on a GPU)",
    "reload_ratio": ">= 0.9 (the same for reload)",
    "decode_roofline_fraction_b1": ">= 0.5 (captured, 0.5B shape, one row)",
    "captured_vs_eager_tokens_ratio_b8": ">= 3 (0.5B shape, 8 rows)",
    "grpo_request_to_peak": ">= 0.8 (the mean over the measured jobs)",
    "captured_token_agreement": ">= 0.99",
    "reload_bit_identical": "true",
    "overlap_reload_ratio": "near 1 on a GPU (the reload's copies beside a busy default stream)",
    "overlap_bit_identical": "true",
    "fsdp_max_loss_diff": "~0 (float rounding: FSDP2 on one rank computes what the plain model does)",
    "fsdp_rebuilt_bit_identical": "true",
    "fsdp_offload_released": "true",
    "vllm_repeat_identical": "true",
    "vllm_wake_identical": "true",
    "row_invariant_identical": "true",
    "bank_identical": "true",
}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(fn: Callable[[], Any], device: torch.device) -> float:
    _sync(device)
    t0 = time.perf_counter()
    fn()
    _sync(device)
    return time.perf_counter() - t0


def _allocated(device: torch.device) -> int:
    """Bytes the caching allocator has handed out on ``device`` (0 off CUDA)."""
    return torch.cuda.memory_allocated(device) if device.type == "cuda" else 0


def _version(v: Any) -> str:
    # a tuple in recent torch, one packed int before
    return ".".join(str(x) for x in v) if isinstance(v, tuple) else str(v)


def device_info(device: torch.device) -> dict[str, Any]:
    """What the checks ran on."""
    import transformers

    # (the device image's versions are not this machine's: the decode step reads
    # transformers' module internals)
    info: dict[str, Any] = {
        "device": str(device),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
    }
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info.update(
            name=props.name,
            memory_bytes=int(props.total_memory),
            cuda=torch.version.cuda,
            nccl=_version(torch.cuda.nccl.version()),
        )
    return info


def _batch(backend: TorchBackend, rows: int) -> list[Datum]:
    texts = [(f"{i}+{i + 7}=", f"{2 * i + 7}") for i in range(rows)]
    return [
        Datum.from_prompt_completion(backend.tokenize([p])[0], backend.tokenize([c], False)[0])
        for p, c in texts
    ]


def check_budget(device: torch.device) -> dict[str, Any]:
    """The holder's ``"auto"`` budget on ``device`` against the device's memory."""
    budget = default_budget(str(device))
    out: dict[str, Any] = {"budget_bytes": budget}
    if device.type == "cuda":
        out["budget_fraction"] = budget / torch.cuda.get_device_properties(device).total_memory
    return out


def check_offload(spec: ModelSpec, device: torch.device, reps: int) -> dict[str, Any]:
    """The backend's offload/reload against plain pinned copies of the same bytes (see the
    module docstring), ``reps`` rounds, arms alternating."""
    backend = TorchBackend(spec, device)
    backend.forward_backward(_batch(backend, 8), CrossEntropy())
    backend.optim_step(AdamWParams(lr=1e-4))  # Adam's moments exist: a training replica
    nbytes = backend.state_bytes()
    before = backend.get_weights()
    flat = torch.empty(nbytes, dtype=torch.uint8, device=device)
    pinned = device.type == "cuda"
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned)
    arms = ["offload", "reload"]
    arms += [f"plain{kind}_{way}" for kind in ("", "_alloc") for way in ("offload", "reload")]
    arms += ["per_tensor_offload", "release"]
    times: dict[str, list[float]] = {k: [] for k in arms}
    identical = None
    for r in range(reps):
        times["offload"].append(_timed(backend.offload, device))
        times["reload"].append(_timed(backend.reload, device))
        if r == 0:
            after = backend.get_weights()
            identical = all(torch.equal(before[n], after[n]) for n in before)
        times["plain_offload"].append(_timed(lambda: host.copy_(flat, non_blocking=True), device))
        times["plain_reload"].append(_timed(lambda: flat.copy_(host, non_blocking=True), device))

        def alloc_offload() -> None:
            fresh = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned)
            fresh.copy_(flat, non_blocking=True)

        def alloc_reload() -> None:
            fresh = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned)
            flat.copy_(fresh, non_blocking=True)

        times["plain_alloc_offload"].append(_timed(alloc_offload, device))
        times["plain_alloc_reload"].append(_timed(alloc_reload, device))

        # The offload's two costs that the plain copy lacks, apart: the state's tensors
        # copied one by one into pinned buffers of their own (on its copy stream, nothing
        # released), and the release of as many device blocks: device copies of the same
        # tensors, made untimed, dropped and handed back to the driver.
        def per_tensor_offload() -> None:
            with copy_stream(device):
                kept = [backend._to_host(t) for t in backend._state_tensors().values()]
            del kept

        times["per_tensor_offload"].append(_timed(per_tensor_offload, device))
        scratch = [[torch.empty_like(t) for t in backend._state_tensors().values()]]

        def release(scratch: list[list[torch.Tensor]] = scratch) -> None:
            scratch.pop()
            if device.type == "cuda":
                torch.cuda.empty_cache()

        times["release"].append(_timed(release, device))
    gbps = {
        f"{k}_gbps": nbytes / statistics.median(v) / 1e9 for k, v in times.items() if k != "release"
    }
    return {
        "state_bytes": nbytes,
        **gbps,
        "offload_ratio": gbps["offload_gbps"] / gbps["plain_offload_gbps"],
        "reload_ratio": gbps["reload_gbps"] / gbps["plain_reload_gbps"],
        "per_tensor_offload_ratio": gbps["per_tensor_offload_gbps"] / gbps["plain_offload_gbps"],
        "release_ms": 1000 * statistics.median(times["release"]),
        "release_share_of_offload": statistics.median(times["release"])
        / statistics.median(times["offload"]),
        "reload_bit_identical": identical,
    }


def check_overlap(spec: ModelSpec, device: torch.device, reps: int) -> dict[str, Any]:
    """A reload in one thread while another keeps the default stream busy (see the module
    docstring), ``reps`` rounds; each round times the products alone, the reload alone and
    both at once."""
    backend = TorchBackend(spec, device)
    backend.forward_backward(_batch(backend, 8), CrossEntropy())
    backend.optim_step(AdamWParams(lr=1e-4))
    before = backend.get_weights()
    side = 4096 if device.type == "cuda" else 256
    a = torch.randn(side, side, device=device)
    count = 200 if device.type == "cuda" else 20

    def kernels() -> None:
        out = a
        for _ in range(count):
            out = torch.mm(a, out).tanh_()  # bounded values, a queue of dependent products
        _sync(device)

    def wall(fn: Callable[[], Any]) -> float:
        # No device-wide synchronize around the reload: it returns once its own copies are
        # done, and one here would wait for the products in the other thread too.
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0

    kernels()  # warm (cuBLAS handles, the allocator)
    times: dict[str, list[float]] = {
        "kernels": [],
        "reload": [],
        "kernels_beside": [],
        "reload_beside": [],
    }

    failed: list[BaseException] = []

    def kernels_beside() -> None:
        try:
            times["kernels_beside"].append(wall(kernels))
        except BaseException as e:  # (raised again below, not lost with the thread)
            failed.append(e)

    for _ in range(reps):
        times["kernels"].append(wall(kernels))
        backend.offload()
        times["reload"].append(wall(backend.reload))
        backend.offload()
        busy = threading.Thread(target=kernels_beside, name="busy-default-stream")
        busy.start()
        time.sleep(0.001)  # the products are queued first
        times["reload_beside"].append(wall(backend.reload))
        busy.join()
        if failed:
            raise failed[0]
    after = backend.get_weights()
    med = {k: statistics.median(v) for k, v in times.items()}
    return {
        "overlap_reload_s": med["reload"],
        "overlap_kernels_s": med["kernels"],
        "overlap_reload_ratio": med["reload_beside"] / med["reload"],
        "overlap_kernels_ratio": med["kernels_beside"] / med["kernels"],
        "overlap_bit_identical": all(torch.equal(before[n], after[n]) for n in before),
    }


def check_fsdp(spec: ModelSpec, device: torch.device, steps: int) -> dict[str, Any]:
    """FSDP2 on a one-rank group against the plain model, step by step (module docstring)."""
    groups = ProcessGroupManager(None, str(device))
    groups.join(GroupContext(uid="device-check", epoch=0, rank=0, world_size=1))
    try:
        sharded = FSDPBackend(spec, device, groups)
        plain = TorchBackend(spec, device)
        batch = _batch(plain, 16)
        optim = AdamWParams(lr=1e-3)
        losses: dict[str, list[float]] = {"fsdp": [], "plain": []}
        seconds: dict[str, list[float]] = {"fsdp": [], "plain": []}

        def both() -> None:
            for name, backend in (("fsdp", sharded), ("plain", plain)):
                got: dict[str, float] = {}

                def step(backend: TorchBackend = backend, got: dict[str, float] = got) -> None:
                    got.update(backend.forward_backward(batch, CrossEntropy()))
                    backend.optim_step(optim)

                seconds[name].append(_timed(step, device))
                losses[name].append(float(got["loss"]))

        for _ in range(steps):
            both()
        a, b = sharded.get_weights(), plain.get_weights()
        weight_diff = max(float((a[n] - b[n]).abs().max()) for n in b)
        # The rank's offload (pinned host shards on CUDA) and its rebuild on the group, as
        # the holder does between requests; then one more step of both. The offload must
        # free the module's parameters, gradients and moments: nothing else may hold them.
        held = [weakref.ref(p) for p in sharded.model.parameters()]
        allocated = _allocated(device)
        sharded.offload()
        gc.collect()
        released = not any(r() is not None for r in held)
        freed = allocated - _allocated(device)
        sharded = sharded.rebuilt(groups)
        back = sharded.get_weights()
        rebuilt_identical = all(torch.equal(a[n], back[n]) for n in a)
        both()
    finally:
        groups.leave()
    return {
        "fsdp_backend": "nccl" if device.type == "cuda" else "gloo",
        "fsdp_losses": losses,
        "fsdp_max_loss_diff": max(
            abs(x - y) for x, y in zip(losses["fsdp"], losses["plain"], strict=True)
        ),
        "fsdp_max_weight_diff": weight_diff,
        "fsdp_rebuilt_bit_identical": rebuilt_identical,
        "fsdp_offload_released": released,
        "fsdp_offload_freed_bytes": freed if device.type == "cuda" else None,
        "fsdp_step_time_ratio": statistics.median(seconds["fsdp"][1:] or seconds["fsdp"])
        / statistics.median(seconds["plain"][1:] or seconds["plain"]),
    }


def check_row_invariance(spec: ModelSpec, device: torch.device, reps: int) -> dict[str, Any]:
    """``row_invariant_*`` (module docstring)."""
    out: dict[str, Any] = {}
    params = SamplingParams(n=4, temperature=1.0, max_tokens=16, seed=5)
    streams = Streams(128, 16, invariant=True)
    prompts = [[3 + (i * 7 + j) % 90 for j in range(4 + i)] for i in range(16)]
    ids = list(range(16))
    backends = {}
    for dtype, suffix in (("bfloat16", "_bf16"), ("float32", "")):
        b = backends[dtype] = TorchBackend(dataclasses.replace(spec, dtype=dtype), device)
        together = b.sample(prompts, params, ids, streams)
        alone = [b.sample([p], params, [i], streams)[0] for i, p in enumerate(prompts)]
        out[f"row_invariant_identical{suffix}"] = alone == together
    backend = backends["float32"]
    rows = _probe(backend)  # (None: each prompt then decodes as a stream of its own)
    out["row_invariant_cap"] = 0 if rows is None else rows.cap
    out["row_invariant_exact"] = None if rows is None else rows.exact

    def one_each() -> None:
        for i, p in enumerate(prompts):
            backend.sample([p], params, [i], streams)

    def merged() -> None:
        backend.sample(prompts, params, ids, streams)

    times: dict[str, list[float]] = {"alone": [], "merged": []}
    for _ in range(reps):
        times["alone"].append(_timed(one_each, device))
        times["merged"].append(_timed(merged, device))
    alone_s, merged_s = statistics.median(times["alone"]), statistics.median(times["merged"])
    out["row_invariant_merged_speedup"] = alone_s / merged_s
    return out


def check_adapter_bank(spec: ModelSpec, device: torch.device, reps: int) -> dict[str, Any]:
    """``bank_*`` (module docstring)."""
    import tempfile

    from plexrl_dask.models.spec import LORA_TARGETS
    from plexrl_dask.state_store.store import StateStore
    from plexrl_dask.worker.backends import AdapterBank, LoraBackend, SharedBases
    from plexrl_dask.worker.replica_checkpoint import StoreCheckpoint

    base = dataclasses.replace(spec, dtype="float32")
    bases = SharedBases(device)
    params = SamplingParams(n=4, temperature=1.0, max_tokens=16, seed=5)
    streams = Streams(128, 16, invariant=True)
    prompts = [[3 + (i * 7 + j) % 90 for j in range(4 + i)] for i in range(16)]
    ids = list(range(16))
    keys = [f"t{i % 4}" for i in range(16)]
    with tempfile.TemporaryDirectory(prefix="plexrl-bank-") as tmp:
        store = StateStore(tmp, create=True)
        bank = AdapterBank(base, device, bases=bases, user="bank")
        replicas = {}
        for t in range(4):
            lora = base.with_lora(8, alpha=16, targets=(*LORA_TARGETS, "lm_head"), seed=t)
            r = replicas[f"t{t}"] = LoraBackend(lora, device, bases=bases, user=f"t{t}")
            with torch.no_grad():
                for name, p in r.model.named_parameters():
                    if "lora_B" in name:
                        p.normal_(0, 0.05, generator=torch.Generator(p.device).manual_seed(t))
            r.save_state(StoreCheckpoint(store, f"t{t}", None))
            bank.load_adapter(f"t{t}", lora, StoreCheckpoint(store, f"t{t}", r.version))
        together = bank.sample(prompts, params, ids, streams, adapters=keys)
        alone = [
            replicas[k].sample([p], params, [i], streams)[0]
            for i, (p, k) in enumerate(zip(prompts, keys, strict=True))
        ]
        out: dict[str, Any] = {"bank_identical": alone == together}
        out["bank_row_invariant"] = _probe(bank) is not None

        def per_adapter() -> None:
            for k, r in replicas.items():
                mine = [i for i in ids if keys[i] == k]
                r.sample([prompts[i] for i in mine], params, mine, streams)

        def banked() -> None:
            bank.sample(prompts, params, ids, streams, adapters=keys)

        times: dict[str, list[float]] = {"own": [], "bank": []}
        for _ in range(reps):
            times["own"].append(_timed(per_adapter, device))
            times["bank"].append(_timed(banked, device))
        out["bank_merged_speedup"] = statistics.median(times["own"]) / statistics.median(
            times["bank"]
        )
        bank.close()
        for r in replicas.values():
            r.close()
    return out


def _probe(backend: TorchBackend) -> Any:
    """The row decoder's probe of ``backend``'s step on this device (its ``ProductRows``);
    None where it has no step or found no row-invariant products."""
    from plexrl_dask.errors import OpNotSupported
    from plexrl_dask.worker.row_decode import invariance

    step = backend.row_step()
    if step is None:
        return None
    try:
        return invariance(step.bind(64))
    except OpNotSupported:
        return None


def check_vllm(spec: ModelSpec, device: torch.device, reps: int) -> dict[str, Any]:
    from plexrl_dask.worker.backends.vllm_backend import VLLMBackend, unavailable_reason

    reason = unavailable_reason(device)
    if reason is not None:
        return {"vllm_skipped": reason}
    import tempfile

    from plexrl_dask.shared.types import SamplingParams
    from plexrl_dask.state_store.store import StateStore
    from plexrl_dask.worker.replica_checkpoint import StoreCheckpoint

    spec = dataclasses.replace(spec, dtype="bfloat16")
    engine = VLLMBackend(spec, device, max_batch_size=128)
    try:
        torch_replica = TorchBackend(spec, device, max_batch_size=128)
        prompts = torch_replica.tokenize([f"{i}+{2 * i}=" for i in range(16)])
        ids = list(range(len(prompts)))
        params = SamplingParams(n=8, max_tokens=64, ignore_eos=True, seed=0)
        times: dict[str, list[float]] = {"vllm": [], "torch": []}
        tokens: dict[str, int] = {}
        outs = []
        for _ in range(reps):
            for name, backend in (("vllm", engine), ("torch", torch_replica)):
                t0 = time.perf_counter()
                out = backend.sample(prompts, params, ids)
                _sync(device)
                times[name].append(time.perf_counter() - t0)
                tokens[name] = sum(len(s.tokens) for g in out for s in g)
                if name == "vllm":
                    outs.append(out)
        rate = {n: tokens[n] / statistics.median(t) for n, t in times.items()}
        free = torch.cuda.mem_get_info(device)[0]
        t0 = time.perf_counter()
        engine.offload()
        sleep_s = time.perf_counter() - t0
        freed = torch.cuda.mem_get_info(device)[0] - free
        t0 = time.perf_counter()
        engine.reload()
        wake_s = time.perf_counter() - t0
        woken = engine.sample(prompts, params, ids)
        with tempfile.TemporaryDirectory() as tmp:
            store = StateStore(tmp, create=True)
            torch_replica.publish_weights(StoreCheckpoint(store, "policy", 1))
            t0 = time.perf_counter()
            engine.load_weights(StoreCheckpoint(store, "policy", 1))
            load_s = time.perf_counter() - t0
    finally:
        engine.close()
    return {
        "vllm_tokens_per_s": rate["vllm"],
        "torch_tokens_per_s": rate["torch"],
        "vllm_to_torch_ratio": rate["vllm"] / rate["torch"],
        "vllm_repeat_identical": all(o == outs[0] for o in outs),
        "vllm_sleep_s": sleep_s,
        "vllm_sleep_freed_bytes": int(freed),
        "vllm_wake_s": wake_s,
        "vllm_wake_identical": woken == outs[0],
        "vllm_load_weights_s": load_s,
    }


def check_decode(
    shape: str,
    device: torch.device,
    batches: list[int],
    max_tokens: int,
    reps: int,
    hf_cb: bool = True,
) -> dict[str, Any]:
    """Decode tokens/s of every arm against the roofline, for one model shape (module
    docstring, "Decode throughput")."""
    from plexrl_dask.bench import decode_rates
    from plexrl_dask.bench.hf_batching import hf_continuous_batching_rate

    backend = decode_rates.build(shape, device, max_batch_size=max(batches))
    prompt_len = 16
    got = decode_rates.rates(
        backend,
        batches,
        prompt_len,
        max_tokens,
        reps,
        hf_cb=hf_continuous_batching_rate if hf_cb else None,
    )
    traffic = 2 * decode_rates.copy_rate(device)
    out: dict[str, Any] = {"copy_gbps": traffic / 2e9}
    if "capture_error" in got:
        out[f"decode_{shape}_capture_error"] = got.pop("capture_error")[0]
    for arm, by_batch in got.items():
        for b, rate in by_batch.items():
            out[f"decode_{shape}_{arm}_tokens_per_s_b{b}"] = rate
    for b in batches:
        mean_columns = prompt_len + (max_tokens + 1) / 2
        roof = b * traffic / decode_rates.step_bytes(backend.model, b, mean_columns)
        out[f"decode_{shape}_roofline_tokens_per_s_b{b}"] = roof
        out[f"decode_{shape}_roofline_fraction_b{b}"] = got["captured"][b] / roof
        out[f"decode_{shape}_captured_vs_eager_b{b}"] = got["captured"][b] / got["eager"][b]
        if hf_cb:
            out[f"decode_{shape}_captured_vs_hf_cb_b{b}"] = got["captured"][b] / got["hf_cb"][b]
    if device.type == "cuda":
        for b in (1, 8):
            if b in batches:
                try:  # (a diagnosis: its failure must not cost the section's numbers)
                    anatomy = decode_rates.step_anatomy(backend, b, prompt_len, max_tokens)
                except Exception as e:  # noqa: BLE001
                    out[f"decode_{shape}_anatomy_b{b}_error"] = f"{type(e).__name__}: {e}"
                    continue
                out[f"decode_{shape}_anatomy_b{b}"] = anatomy
                out[f"decode_{shape}_replay_share_b{b}"] = (
                    anatomy["replay_us"] * 1e-6 * got["captured"][b] / b
                )
    greedy = SamplingParams(n=1, temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    agree = decode_rates.engine_agreement(
        backend, [(decode_rates.prompts_for(8, prompt_len), greedy)]
    )
    out[f"decode_{shape}_greedy_agreement"] = agree["captured_vs_eager"]
    return out


def check_agreement(backend: TorchBackend, job: JobSpec, rounds: int) -> dict[str, float]:
    """The captured static decoder against the eager and op-by-op ones on ``job``'s GRPO
    requests (module docstring, "Token agreement"): ``(equal, compared)`` positions, summed
    over ``rounds`` requests, per comparison."""
    from plexrl_dask.bench import decode_rates

    g = job.grpo
    requests = []
    for r in range(rounds):
        problems = job.task.problems(2_000_000 + r * g.prompts_per_step, g.prompts_per_step)
        params = SamplingParams(
            n=g.group_size,
            temperature=g.temperature,
            max_tokens=g.max_tokens,
            stop=(job.task.stop,),
            seed=r,
        )
        requests.append((backend.tokenize([p.prompt for p in problems]), params))
    return decode_rates.engine_agreement(backend, requests)


def main() -> None:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda", help="cuda (the device machine) or cpu")
    p.add_argument("--hidden", type=int, default=None, help="offload/FSDP model width")
    p.add_argument("--layers", type=int, default=None, help="offload/FSDP model depth")
    p.add_argument("--reps", type=int, default=None, help="offload rounds")
    p.add_argument("--fsdp-steps", type=int, default=None)
    p.add_argument("--jobs", type=int, default=None, help="jobs of the mix to sample (0: none)")
    p.add_argument("--rounds", type=int, default=None, help="sampling rounds per job")
    p.add_argument(
        "--shapes", default=None, help="decode model shapes, comma-separated (0.5b,1.5b,tiny)"
    )
    p.add_argument("--decode-reps", type=int, default=None, help="decode repetitions per arm")
    p.add_argument(
        "--no-hf-cb", action="store_true", help="skip transformers' continuous batching arm"
    )
    args = p.parse_args()
    logging.basicConfig(level=logging.WARNING)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: this machine has no CUDA device (use --device cpu)")
    if device.type == "cpu":
        torch.set_num_threads(1)  # as a PlexRL worker runs
    big = device.type == "cuda" and not args.quick
    hidden = args.hidden or (1024 if big else 64)
    layers = args.layers or (12 if big else 2)
    spec = ModelSpec.tiny(hidden_size=hidden, num_layers=layers, num_heads=8, num_kv_heads=4)
    reps = args.reps or (2 if args.quick else 7)
    steps = args.fsdp_steps or (2 if args.quick else 5)
    jobs = standard_jobs(4)[: (1 if args.quick else 2) if args.jobs is None else args.jobs]
    rounds = args.rounds or (2 if args.quick else 8)
    if args.shapes is not None:
        shapes = [x for x in args.shapes.split(",") if x]
    else:
        shapes = ["0.5b", "1.5b"] if big else ["tiny"]
    decode_batches = [1, 8, 64, 256] if big else [1, 8]
    decode_tokens = 128 if big else 16
    decode_reps = 3 if big else 1

    batch = int(config.get("sampling.max-batch-size"))  # type: ignore[call-overload]
    results: dict[str, Any] = {}
    per_job: dict[str, Any] = {}
    setup = {
        **device_info(device),
        "model": {"hidden": hidden, "layers": layers, "parameters": spec.num_parameters()},
        "reps": reps,
        "fsdp_steps": steps,
        "jobs": [j.name for j in jobs],
        "rounds": rounds,
        "per_job": per_job,
    }

    def section(name: str, fn: Callable[[], dict[str, Any]]) -> None:
        # A device run is rare and short: a failing check must not cost the others' numbers.
        # Its error is recorded, and the JSON is rewritten after every section.
        t0 = time.perf_counter()
        try:
            results.update(fn())
        except Exception as e:  # noqa: BLE001 (recorded, and the run goes on)
            logger.exception("device check %s failed", name)
            results[f"{name}_error"] = f"{type(e).__name__}: {e}"
        logger.warning("device check %s: %.1f s", name, time.perf_counter() - t0)
        write_json("device", results, TARGETS, setup, args.json)

    agreement: dict[str, list[float]] = {"captured_vs_eager": [], "captured_vs_static": []}
    positions: list[float] = []

    def job_section(job: JobSpec) -> dict[str, Any]:
        warmup = 30 if args.quick else job.warmup_steps
        backend = warmed_backend(job, warmup, batch, str(device))
        agree = check_agreement(backend, job, rounds)
        for k in agreement:
            agreement[k].append(agree[k] * agree["positions"])
        positions.append(agree["positions"])
        j = per_job[job.name] = measure_job(job, warmup, rounds, batch, str(device), backend)
        rows = job.grpo.prompts_per_step * job.grpo.group_size
        return {
            f"{job.name}_peak_tokens_per_s": j["peak_tokens_per_s"],
            f"{job.name}_to_peak_b128": j[f"to_peak_{rows}_b128"],
            f"{job.name}_tail_bound_b128": j["tail_bound_b128"],
            f"{job.name}_batch128_time_ratio": j["batch128_time_ratio"],
            f"{job.name}_captured_token_agreement": agree["captured_vs_eager"],
            # (the sums over the jobs so far: the last job's section leaves the totals)
            "captured_token_agreement": sum(agreement["captured_vs_eager"]) / sum(positions),
            "captured_vs_static_agreement": sum(agreement["captured_vs_static"]) / sum(positions),
            "grpo_request_to_peak": statistics.mean(
                per_job[k][f"to_peak_{rows}_b128"] for k in per_job
            ),
        }

    section("budget", lambda: check_budget(device))
    section("offload", lambda: check_offload(spec, device, reps))
    section("overlap", lambda: check_overlap(spec, device, reps))
    section("fsdp", lambda: check_fsdp(spec, device, steps))
    section("vllm", lambda: check_vllm(spec, device, reps))
    section("row_invariant", lambda: check_row_invariance(spec, device, reps))
    section("adapter_bank", lambda: check_adapter_bank(spec, device, reps))

    def decode_section(shape: str) -> None:
        section(
            f"decode_{shape}",
            functools.partial(
                check_decode,
                shape,
                device,
                decode_batches,
                decode_tokens,
                args.decode_reps or decode_reps,
                not args.no_hf_cb,
            ),
        )

    # (the headline shape first, the jobs next, the larger shape last: a run cut short by
    # its time limit keeps what matters most)
    for shape in shapes[:1]:
        decode_section(shape)
    for job in jobs:
        section(job.name, functools.partial(job_section, job))
    for shape in shapes[1:]:
        decode_section(shape)
    if shapes:
        head = "0.5b" if "0.5b" in shapes else shapes[0]
        results["decode_roofline_fraction_b1"] = results.get(f"decode_{head}_roofline_fraction_b1")
        results["captured_vs_eager_tokens_ratio_b8"] = results.get(
            f"decode_{head}_captured_vs_eager_b8"
        )
    report("device", results, TARGETS, setup, args.json)
    if any(k.endswith("_error") for k in results):
        raise SystemExit(1)


if __name__ == "__main__":
    main()
