"""Benchmark: sampling in continuously batched streams against batch by batch, one replica.

In-process (no cluster), one torch thread, on the standard job mix's models after their
supervised warm-up (so completion lengths are the jobs' real, long-tailed ones). For each job,
every round draws new problems and a new seed and times the same request under each arm,
alternating arms (:func:`~plexrl_dask.bench.common.interleaved`):

- a GRPO step's request (``prompts_per_step`` × ``group_size`` rows, 128 in the mix):
  ``batch`` (streams of ``max_batch_size`` rows: each batch decodes to its end, the behaviour
  before streams) against ``stream-128`` (the default streams);
- a request four times larger (512 rows): ``batch`` against ``stream-512``.

Every arm shares prompt prefills (one forward per distinct prompt); that part of the change
has no switch, so it is not separated here. Results per job: tokens/s of each arm, the median
over rounds of each arm's time ÷ the ``batch`` arm's (below 1: streams are faster), and each
arm's tokens/s ÷ the replica's peak (``ignore_eos`` decoding of 64 rows of one prompt, best of
3, the same definition as ``bench.multiplex``'s peak). The rows of all arms of a round are
the same, so they sample the same tokens up to rounding: the token counts are reported too.

Run: ``python -m plexrl_dask.bench.sampling --json OUT [--quick]`` (about 10 minutes on this
2-core machine, most of it warm-up; ``--quick``: 100 warm-up steps, 4 rounds, 2 jobs).
"""

from __future__ import annotations

import logging
import statistics
import time
from typing import Any

import torch
from tqdm import tqdm

from plexrl_dask import config
from plexrl_dask.bench.common import interleaved, parser, report
from plexrl_dask.rl.catalog import standard_jobs
from plexrl_dask.rl.modes import JobSpec
from plexrl_dask.service.backends import TorchBackend
from plexrl_dask.service.decode import Streams
from plexrl_dask.service.types import AdamWParams, CrossEntropy, Datum, SamplingParams

logger = logging.getLogger(__name__)

TARGETS = {"stream_time_ratio_128": "< 1 (streams faster)"}


def warmed_backend(spec: JobSpec, steps: int, batch: int) -> TorchBackend:
    """The job's model after ``steps`` supervised steps on its task's answers (the job's
    warm-up batch size and learning rate), in-process."""
    backend = TorchBackend(spec.model, "cpu", max_batch_size=batch)
    optim = AdamWParams(lr=spec.warmup_lr)
    for step in tqdm(range(steps), desc=f"warm-up {spec.name}", leave=False):
        problems = spec.task.problems(step * spec.warmup_batch_size, spec.warmup_batch_size)
        data = [
            Datum.from_prompt_completion(*backend.tokenize([p.prompt, p.answer])) for p in problems
        ]
        backend.forward_backward(data, CrossEntropy())
        backend.optim_step(optim)
    return backend


def peak(backend: TorchBackend, prompt: list[int], max_tokens: int, batch: int) -> float:
    """Decode tokens/s of ``batch`` rows of one prompt, every row to ``max_tokens``."""
    params = SamplingParams(n=batch, max_tokens=max_tokens, seed=0, ignore_eos=True)
    best = 0.0
    for _ in range(3):
        t0 = time.perf_counter()
        out = backend.sample([prompt], params, [0], Streams(batch, batch))
        best = max(best, sum(len(s.tokens) for s in out[0]) / (time.perf_counter() - t0))
    return best


def time_arms(
    backend: TorchBackend,
    prompts: list[list[int]],
    params: SamplingParams,
    arms: dict[tuple[int, str], Streams],
    size: int,
) -> dict[str, tuple[float, int]]:
    """``(seconds, tokens)`` of the request under each arm of ``size``, arms alternating."""
    ids = list(range(len(prompts)))
    made: dict[str, int] = {}

    def call(name: str, streams: Streams) -> None:
        out = backend.sample(prompts, params, ids, streams)
        made[name] = sum(len(s.tokens) for group in out for s in group)

    mine = {name: s for (sz, name), s in arms.items() if sz == size}
    timed = interleaved({n: (lambda n=n, s=s: call(n, s)) for n, s in mine.items()}, 1)
    return {name: (ts[0], made[name]) for name, ts in timed.items()}


def measure_job(spec: JobSpec, warmup: int, rounds: int, batch: int) -> dict[str, Any]:
    """Every arm of the module docstring, for one job."""
    backend = warmed_backend(spec, warmup, batch)
    g = spec.grpo
    arms = {
        (128, "batch"): Streams(batch, batch),
        (128, "stream-128"): Streams.from_config(),
        (512, "batch"): Streams(batch, batch),
        (512, "stream-512"): Streams(g.prompts_per_step * 4 * g.group_size, 16),
    }
    times: dict[tuple[int, str], list[float]] = {a: [] for a in arms}
    tokens: dict[tuple[int, str], int] = dict.fromkeys(arms, 0)
    for r in tqdm(range(rounds), desc=f"rounds {spec.name}", leave=False):
        for size in (128, 512):
            count = g.prompts_per_step * (size // 128)
            problems = spec.task.problems(1_000_000 + r * count, count)
            prompts = backend.tokenize([p.prompt for p in problems])
            params = SamplingParams(
                n=g.group_size,
                temperature=g.temperature,
                max_tokens=g.max_tokens,
                stop=(spec.task.stop,),
                seed=r,
            )
            for name, (seconds, made) in time_arms(backend, prompts, params, arms, size).items():
                times[(size, name)].append(seconds)
                tokens[(size, name)] += made
    top = peak(backend, prompts[0], g.max_tokens, batch)
    out: dict[str, Any] = {"peak_tokens_per_s": top}
    for size, arm in arms:
        rate = tokens[(size, arm)] / sum(times[(size, arm)])
        key = f"{size}_{arm}"
        out[f"tokens_per_s_{key}"] = rate
        out[f"to_peak_{key}"] = rate / top
        out[f"tokens_{key}"] = tokens[(size, arm)]
        if arm != "batch":
            base = times[(size, "batch")]
            out[f"time_ratio_{size}"] = statistics.median(
                t / b for t, b in zip(times[(size, arm)], base, strict=True)
            )
    return out


def main() -> None:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--jobs", type=int, default=4, help="jobs of the standard mix (1-5)")
    p.add_argument("--rounds", type=int, default=12, help="interleaved rounds per job")
    args = p.parse_args()
    logging.basicConfig(level=logging.WARNING)
    torch.set_num_threads(1)
    jobs = standard_jobs(2 if args.quick else args.jobs)
    rounds = 4 if args.quick else args.rounds
    batch = int(config.get("sampling.max-batch-size"))  # type: ignore[call-overload]
    per_job: dict[str, Any] = {}
    for spec in jobs:
        warmup = 100 if args.quick else spec.warmup_steps
        per_job[spec.name] = measure_job(spec, warmup, rounds, batch)
    results: dict[str, Any] = {}
    for size in (128, 512):
        ratios = [j[f"time_ratio_{size}"] for j in per_job.values()]
        results[f"stream_time_ratio_{size}"] = statistics.median(ratios)
    for name, j in per_job.items():
        results[f"{name}_time_ratio_128"] = j["time_ratio_128"]
        results[f"{name}_time_ratio_512"] = j["time_ratio_512"]
        results[f"{name}_to_peak_128_batch"] = j["to_peak_128_batch"]
        results[f"{name}_to_peak_128_stream"] = j["to_peak_128_stream-128"]
    setup = {
        "jobs": [s.name for s in jobs],
        "rounds": rounds,
        "max_batch_size": batch,
        "streams_default": vars(Streams.from_config()),
        "per_job": per_job,
    }
    report("sampling", results, TARGETS, setup, args.json)


if __name__ == "__main__":
    main()
