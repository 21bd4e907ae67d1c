"""Execution-service overhead: the runtime against the same op called in-process.

    python -m plexrl_dask.bench.service --json OUT [--quick]

Same run, same model, same inputs, both arms with one torch thread, measurements interleaved:

- ``dispatch_overhead_ratio``: median wall time of ``forward_backward`` submitted through the
  runtime and waited for (client → scheduler → worker → back) ÷ the same backend method called
  in this process; the batch is grown until the in-process call takes ≥ 100 ms (target ≤ 1.3).
- ``sample_tokens_per_s`` (through the runtime) and ``sample_tokens_per_s_direct``, and their
  ratio ``sample_throughput_ratio`` (target ≥ 0.8).
- ``request_latency_ms``: median round trip of a minimal request (context, not a target).
- ``dask_default_env_fb_ratio``: ``forward_backward`` in a worker started with Dask's default
  pre-spawn environment (``MALLOC_TRIM_THRESHOLD_=65536``) ÷ in a ``local_cluster()`` worker,
  which unsets it: why ``local_cluster()`` does so.

The cluster has one PlexRL worker, so the worker's core and the driver's core are distinct.

Worker process groups (a second, 2-worker cluster):

- ``fsdp2_vs_single_max_abs_diff``: largest parameter difference between a 2-rank FSDP2
  deployment and one process training on the combined batch, after 3 AdamW steps (≤ 1e-6).
- ``reshard_restore_exact``: a 2-rank ``save_state`` restored on 1 rank equals the original.
- ``sync_weights_s`` / ``sync_weights_large_s``: ``runtime.sync_weights`` from a 2-rank trainer
  into 2 rollout replicas, for the tiny model and for a model of ≥ 256 MB of fp32 weights
  (``sync_weights_large_bytes``).
- ``rollout_replicas_speedup``: ``sample`` wall time on 1 replica ÷ on 2 replicas, same prompts
  (2 cores: the driver and scheduler share them with the two workers).
"""

from __future__ import annotations

import logging
from functools import partial

import torch
from distributed import Client, LocalCluster

import plexrl_dask as plexrl
from plexrl_dask.bench.common import interleaved, median, parser, report, time_call
from plexrl_dask.cluster import PRELOAD
from plexrl_dask.worker.backends import TorchBackend

logger = logging.getLogger(__name__)

MIN_COMPUTE_S = 0.100


def _batch(dep_or_backend_tokenize, size: int, length: int) -> list[plexrl.Datum]:
    text = "".join(str(i % 10) for i in range(length))
    tokens = dep_or_backend_tokenize(text)
    return [plexrl.Datum(tokens=tokens[: length - (i % 4)]) for i in range(size)]


def main() -> None:
    args = parser(__doc__.splitlines()[0]).parse_args()
    reps = 5 if args.quick else 15
    torch.set_num_threads(1)
    spec = plexrl.ModelSpec.tiny(
        hidden_size=256, num_layers=4, num_heads=8, num_kv_heads=2, max_positions=512
    )
    direct = TorchBackend(spec, "cpu")
    tokenize = lambda s: direct.tokenize([s])[0]  # noqa: E731

    # Grow the batch until one in-process forward_backward takes >= 100 ms.
    size, length = 4, 128
    while True:
        batch = _batch(tokenize, size, length)
        t = median(
            [
                time_call(partial(direct.forward_backward, batch, plexrl.CrossEntropy()))
                for _ in range(3)
            ]
        )
        if t >= MIN_COMPUTE_S or size >= 256:
            break
        size *= 2
    direct.model.zero_grad(set_to_none=True)

    prompts = [f"{i}+{i * 7}=" for i in range(16 if args.quick else 32)]
    sampling = plexrl.SamplingParams(n=4, temperature=1.0, max_tokens=32, seed=0)
    ids = list(range(len(prompts)))

    with plexrl.local_cluster(n_workers=1) as cluster, Client(cluster) as client:
        runtime = plexrl.Runtime(client, job="bench-service")
        dep = runtime.deploy("bench-model", spec)
        plexrl.result(dep.forward_backward(batch))  # warm both arms
        direct.forward_backward(batch, plexrl.CrossEntropy())

        fb = interleaved(
            {
                "runtime": lambda: plexrl.result(dep.forward_backward(batch)),
                "direct": lambda: direct.forward_backward(batch, plexrl.CrossEntropy()),
            },
            reps,
        )
        n_tokens = {}

        def via_runtime() -> None:
            n_tokens["runtime"] = plexrl.result(dep.sample(prompts, sampling)).num_tokens()

        def in_process() -> None:
            groups = direct.sample(direct.tokenize(prompts), sampling, ids)
            n_tokens["direct"] = sum(len(s.tokens) for g in groups for s in g)

        smp = interleaved({"runtime": via_runtime, "direct": in_process}, max(3, reps // 2))
        tiny = [plexrl.Datum(tokens=[1, 5])]
        lat = interleaved({"runtime": lambda: plexrl.result(dep.forward(tiny))}, reps * 4)

    # The same request on a worker with Dask's default pre-spawn environment.
    with (
        LocalCluster(
            n_workers=1,
            threads_per_worker=1,
            host="127.0.0.1",
            dashboard_address=":0",
            resources={"GPU": 1},
            scheduler_kwargs={"preload": [PRELOAD]},
        ) as cluster,
        Client(cluster) as client,
    ):
        dep = plexrl.Runtime(client, job="bench-service").deploy("bench-model", spec)
        plexrl.result(dep.forward_backward(batch))
        trim = interleaved({"runtime": lambda: plexrl.result(dep.forward_backward(batch))}, reps)

    groups = _groups(args.quick)

    fb_runtime, fb_direct = median(fb["runtime"]), median(fb["direct"])
    tps_runtime = n_tokens["runtime"] / median(smp["runtime"])
    tps_direct = n_tokens["direct"] / median(smp["direct"])
    results = {
        "dispatch_overhead_ratio": fb_runtime / fb_direct,
        "forward_backward_runtime_s": fb_runtime,
        "forward_backward_direct_s": fb_direct,
        "sample_tokens_per_s": tps_runtime,
        "sample_tokens_per_s_direct": tps_direct,
        "sample_throughput_ratio": tps_runtime / tps_direct,
        "request_latency_ms": 1000 * median(lat["runtime"]),
        "dask_default_env_fb_ratio": median(trim["runtime"]) / fb_runtime,
        **groups,
    }
    config = {
        "model": spec.name,
        "parameters": spec.num_parameters(),
        "batch_sequences": size,
        "sequence_tokens": length,
        "sample_prompts": len(prompts),
        "sampling": {"n": sampling.n, "max_tokens": sampling.max_tokens},
        "sampled_tokens": n_tokens,
        "repetitions": reps,
    }
    targets = {
        "dispatch_overhead_ratio": "<= 1.3",
        "sample_throughput_ratio": ">= 0.8",
        "fsdp2_vs_single_max_abs_diff": "<= 1e-6",
        "reshard_restore_exact": "true",
    }
    report("service", results, targets, config, args.json)


def _sync_s(
    runtime: plexrl.Runtime, spec: plexrl.ModelSpec, name: str, reps: int
) -> tuple[float, int]:
    """Median seconds of sync_weights from a 2-rank trainer into 2 rollout replicas."""
    trainer = runtime.deploy(f"{name}-train", spec, world_size=2)
    rollout = runtime.deploy(f"{name}-rollout", spec, role="rollout", replicas=2)
    nbytes = plexrl.result(trainer.get_weights()).nbytes()
    times = [
        time_call(lambda: plexrl.result(runtime.sync_weights(trainer, rollout)))
        for _ in range(reps)
    ]
    runtime.undeploy(trainer.name)
    runtime.undeploy(rollout.name)
    return median(times), nbytes


def _groups(quick: bool) -> dict:
    """The worker-process-group metrics (see the module docstring)."""
    import tempfile

    spec = plexrl.ModelSpec.tiny(hidden_size=64, num_layers=2, seed=5)
    # ~72M parameters: 290 MB of fp32 weights.
    large = plexrl.ModelSpec.tiny(
        hidden_size=1024, num_layers=5, num_heads=8, num_kv_heads=2, seed=6
    )
    opt = plexrl.AdamWParams(lr=1e-3)
    with plexrl.local_cluster(n_workers=2) as cluster, Client(cluster) as client:
        runtime = plexrl.Runtime(client, job="bench-groups")
        dep = runtime.deploy("fsdp", spec, world_size=2)
        data = [plexrl.Datum(tokens=dep.tokenize(f"{i}+{i * 7}={8 * i}")) for i in range(8)]
        ref = TorchBackend(spec, "cpu")
        for _ in range(3):
            plexrl.result([dep.forward_backward(data), dep.optim_step(opt)])
            ref.forward_backward(data, plexrl.CrossEntropy())
            ref.optim_step(opt)
        got = plexrl.result(dep.get_weights()).tensors
        want = ref.get_weights()
        fsdp_diff = max(float((got[n] - t).abs().max()) for n, t in want.items())

        with tempfile.TemporaryDirectory() as tmp:
            plexrl.result(dep.save_state(f"{tmp}/ckpt"))
            one = runtime.deploy("restored", spec)
            plexrl.result(one.load_state(f"{tmp}/ckpt"))
            back = plexrl.result(one.get_weights()).tensors
        exact = all(torch.equal(back[n], t) for n, t in got.items())

        sync_tiny, _ = _sync_s(runtime, spec, "sync-tiny", 3 if quick else 7)
        sync_large, large_bytes = _sync_s(runtime, large, "sync-large", 2 if quick else 3)

        prompts = [f"{i}*{i % 9}=" for i in range(64 if quick else 128)]
        sampling = plexrl.SamplingParams(n=4, max_tokens=24, seed=2)
        r1 = runtime.deploy("replicas-1", spec, role="rollout")
        r2 = runtime.deploy("replicas-2", spec, role="rollout", replicas=2)
        plexrl.result([r1.sample(prompts[:4], sampling), r2.sample(prompts, sampling)])  # warm
        times = interleaved(
            {
                "one": lambda: plexrl.result(r1.sample(prompts, sampling)),
                "two": lambda: plexrl.result(r2.sample(prompts, sampling)),
            },
            3 if quick else 5,
        )
    return {
        "fsdp2_vs_single_max_abs_diff": fsdp_diff,
        "reshard_restore_exact": exact,
        "sync_weights_s": sync_tiny,
        "sync_weights_large_s": sync_large,
        "sync_weights_large_bytes": large_bytes,
        "rollout_replicas_speedup": median(times["one"]) / median(times["two"]),
    }


if __name__ == "__main__":
    main()
