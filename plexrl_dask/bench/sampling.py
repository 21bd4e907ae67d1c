"""Benchmark: how one replica decodes a GRPO step's request (batch size, streams), in-process.

In-process (no cluster), one torch thread, on the standard job mix's models after their
supervised warm-up (so completion lengths are the jobs' real, long-tailed ones). For each job,
every round draws new problems and a new seed and times the same request under each arm,
alternating arms (:func:`~plexrl_dask.bench.common.interleaved`):

- a GRPO step's request (``prompts_per_step`` × ``group_size`` rows, 128 in the mix):
  ``b64-batch`` (batches of 64 rows, each decoded to its end: before streams),
  ``b64-stream`` (at most 64 rows at a time, finished rows' slots refilled from the request's
  other rows: the default until ``max-batch-size`` became 128) and ``b128`` (the whole
  request as one batch: the default now);
- a request four times larger (512 rows), at the configured ``max-batch-size``: ``batch``
  (batch by batch) against ``stream-512`` (one stream, refilled).

Results per job: tokens/s of each arm; the median over rounds of an arm's time ÷ its
baseline's (``b128`` ÷ ``b64-stream``; ``stream-512`` ÷ ``batch``; below 1: faster); and each
arm's tokens/s ÷ the replica's peak: ``ignore_eos`` decoding of ``b`` rows of one prompt for
the job's ``max_tokens``, best of 3 at its best ``b`` (powers of two from 8 to twice
``max-batch-size``), the same definition as ``bench.multiplex``'s. The rows of all arms of a
round are the same, so they sample the same tokens up to rounding: the token counts are
reported too.

Where a request's to-peak is lost, split in two (``tail_bound_b128``): a decode step's cost
at ``b`` rows, ``step(b)``, is measured from the peak's own requests (a ``max_tokens``-token
request less a one-token request, over ``max_tokens - 1`` steps, best of 3, at 1…128 rows,
linear in between). The tail bound is the to-peak that decoding the b128 arm's own completions
would reach if every step cost exactly ``step(rows still generating)``: its decode-step tokens
(every token but each row's first, which the prefill gives) ÷ ``Σ step(b_s)`` ÷ the best
``b / step(b)``. It is what the lengths' long tail alone allows an engine with this step-cost
curve; the rest of the gap to ``to_peak_b128`` is prefill and per-request work, compaction,
token choice and stop checks.

Run: ``python -m plexrl_dask.bench.sampling --json OUT [--quick]`` (about 12 minutes on this
2-core machine, most of it warm-up; ``--quick``: 100 warm-up steps, 4 rounds, 2 jobs).
"""

from __future__ import annotations

import logging
import statistics
import time
from dataclasses import dataclass
from typing import Any

import torch
from tqdm import tqdm

from plexrl_dask import config
from plexrl_dask.bench.common import interleaved, parser, report
from plexrl_dask.rl.catalog import standard_jobs
from plexrl_dask.rl.modes import JobSpec
from plexrl_dask.shared.types import AdamWParams, CrossEntropy, Datum, SamplingParams, Streams
from plexrl_dask.worker.backends import TorchBackend

logger = logging.getLogger(__name__)

TARGETS = {
    "batch128_time_ratio": "< 1 (a whole request per batch beats 64-row streams)",
    "stream_time_ratio_512": "< 1 (streams faster)",
}


def warmed_backend(spec: JobSpec, steps: int, batch: int, device: str = "cpu") -> TorchBackend:
    """The job's model on ``device`` after ``steps`` supervised steps on its task's answers
    (the job's warm-up batch size and learning rate), in-process."""
    backend = TorchBackend(spec.model, device, max_batch_size=batch)
    optim = AdamWParams(lr=spec.warmup_lr)
    for step in tqdm(range(steps), desc=f"warm-up {spec.name}", leave=False):
        problems = spec.task.problems(step * spec.warmup_batch_size, spec.warmup_batch_size)
        data = [
            Datum.from_prompt_completion(
                backend.tokenize([p.prompt])[0], backend.tokenize([p.answer], False)[0]
            )
            for p in problems
        ]
        backend.forward_backward(data, CrossEntropy())
        backend.optim_step(optim)
    return backend


def step_seconds(backend: TorchBackend, prompt: list[int], max_tokens: int) -> dict[int, float]:
    """Seconds of one decode step at ``b`` rows of one prompt (``b``: 1, 2, 4 … 128), from the
    peak's kind of request: ``max_tokens`` tokens per row less one token per row, best of 3
    each, over the ``max_tokens - 1`` steps between them."""
    if max_tokens < 2:
        raise ValueError(f"a step's cost needs max_tokens >= 2, got {max_tokens}")
    out: dict[int, float] = {}
    b = 1
    while b <= backend.max_batch_size:
        best: dict[int, float] = {}
        for tokens in (max_tokens, 1):
            params = SamplingParams(n=b, max_tokens=tokens, seed=0, ignore_eos=True)
            for _ in range(3):
                t0 = time.perf_counter()
                backend.sample([prompt], params, [0], Streams.from_config())
                spent = time.perf_counter() - t0
                best[tokens] = min(best.get(tokens, spent), spent)
        out[b] = max(best[max_tokens] - best[1], 1e-9) / (max_tokens - 1)
        b *= 2
    return out


def tail_bound(lengths: list[list[int]], step: dict[int, float]) -> float:
    """The to-peak of decoding requests whose rows end at ``lengths`` (one list per request)
    if a step at ``b`` live rows cost ``step[b]`` (interpolated linearly between measured
    sizes), against the best ``b / step[b]`` (see the module docstring); NaN when no row
    needed a decode step."""
    sizes = sorted(step)

    def cost(rows: int) -> float:
        below = max(s for s in sizes if s <= rows)
        above = min((s for s in sizes if s >= rows), default=below)
        if above == below:
            return step[below] * rows / below  # past the largest size: batches of it
        share = (rows - below) / (above - below)
        return step[below] + share * (step[above] - step[below])

    tokens = seconds = 0.0
    for request in lengths:
        tokens += sum(n - 1 for n in request)
        for s in range(1, max(request)):
            seconds += cost(sum(n > s for n in request))
    if seconds == 0:
        return float("nan")  # every row ended at its first token: no decode step to bound
    best = max(b / t for b, t in step.items())
    return tokens / seconds / best


def peak(backend: TorchBackend, prompt: list[int], max_tokens: int) -> dict[int, float]:
    """Decode tokens/s of ``b`` rows of one prompt, every row to ``max_tokens``, best of 3,
    for ``b`` the powers of two from 8 to twice the backend's ``max_batch_size``."""
    out: dict[int, float] = {}
    b = 8
    while b <= 2 * backend.max_batch_size:
        params = SamplingParams(n=b, max_tokens=max_tokens, seed=0, ignore_eos=True)
        best = 0.0
        for _ in range(3):
            t0 = time.perf_counter()
            got = backend.sample([prompt], params, [0], Streams.from_config())
            best = max(best, sum(len(s.tokens) for s in got[0]) / (time.perf_counter() - t0))
        out[b] = best
        b *= 2
    return out


@dataclass(frozen=True)
class Arm:
    """How a request is decoded: at most ``batch`` rows at a time, in ``streams``."""

    batch: int
    streams: Streams


def time_arms(
    backend: TorchBackend,
    prompts: list[list[int]],
    params: SamplingParams,
    arms: dict[str, Arm],
) -> dict[str, tuple[float, list[int]]]:
    """``(seconds, completion lengths)`` of the request under each arm, arms alternating."""
    ids = list(range(len(prompts)))
    made: dict[str, list[int]] = {}
    configured = backend.max_batch_size

    def call(name: str, arm: Arm) -> None:
        backend.max_batch_size = arm.batch  # read by each stream's decoder as it starts
        try:
            out = backend.sample(prompts, params, ids, arm.streams)
        finally:
            backend.max_batch_size = configured
        made[name] = [len(s.tokens) for group in out for s in group]

    timed = interleaved({n: (lambda n=n, a=a: call(n, a)) for n, a in arms.items()}, 1)
    return {name: (ts[0], made[name]) for name, ts in timed.items()}


def measure_job(
    spec: JobSpec,
    warmup: int,
    rounds: int,
    batch: int,
    device: str = "cpu",
    backend: TorchBackend | None = None,
) -> dict[str, Any]:
    """Every arm of the module docstring, for one job (``batch``: the configured
    ``max-batch-size``), on ``device`` (``bench.device`` runs it on a GPU); ``backend``: the
    job's replica already warmed up (default: warmed up here, ``warmup`` steps)."""
    if backend is None:
        backend = warmed_backend(spec, warmup, batch, device)
    g = spec.grpo
    rows = g.prompts_per_step * g.group_size
    arms = {
        1: {
            "b64-batch": Arm(64, Streams(64, 64)),
            "b64-stream": Arm(64, Streams(max(rows, 128), 16)),
            "b128": Arm(128, Streams(max(rows, 256), 16)),
        },
        4: {
            "batch": Arm(batch, Streams(batch, batch)),
            "stream-512": Arm(batch, Streams(4 * rows, 16)),
        },
    }
    times: dict[tuple[int, str], list[float]] = {(k, a): [] for k in arms for a in arms[k]}
    tokens: dict[tuple[int, str], int] = dict.fromkeys(times, 0)
    lengths: list[list[int]] = []  # the b128 arm's completion lengths, per round
    # Round -1 is not timed: what a replica does once (a static decoder records its steps as
    # CUDA graphs the first time it meets a batch and length) is not part of a request.
    for r in tqdm(range(-1, rounds), desc=f"rounds {spec.name}", leave=False):
        for k, mine in arms.items():
            count = g.prompts_per_step * k
            problems = spec.task.problems(1_000_000 + r * count, count)
            prompts = backend.tokenize([p.prompt for p in problems])
            params = SamplingParams(
                n=g.group_size,
                temperature=g.temperature,
                max_tokens=g.max_tokens,
                stop=(spec.task.stop,),
                seed=r if r >= 0 else rounds,
            )
            for name, (seconds, made) in time_arms(backend, prompts, params, mine).items():
                if r < 0:
                    continue
                times[(k, name)].append(seconds)
                tokens[(k, name)] += sum(made)
                if (k, name) == (1, "b128"):
                    lengths.append(made)
    by_batch = peak(backend, prompts[0], g.max_tokens)
    top = max(by_batch.values())
    step = step_seconds(backend, prompts[0], g.max_tokens)
    out: dict[str, Any] = {
        "peak_tokens_per_s": top,
        "peak_by_batch_size": by_batch,
        "step_seconds": step,
        "tail_bound_b128": tail_bound(lengths, step),
    }
    for k, arm in times:
        rate = tokens[(k, arm)] / sum(times[(k, arm)])
        key = f"{k * rows}_{arm}"
        out[f"tokens_per_s_{key}"] = rate
        out[f"to_peak_{key}"] = rate / top
        out[f"tokens_{key}"] = tokens[(k, arm)]

    def ratio(k: int, arm: str, base: str) -> float:
        pairs = zip(times[(k, arm)], times[(k, base)], strict=True)
        return statistics.median(t / b for t, b in pairs)

    out["batch128_time_ratio"] = ratio(1, "b128", "b64-stream")
    out["stream64_time_ratio"] = ratio(1, "b64-stream", "b64-batch")
    out["stream_time_ratio_512"] = ratio(4, "stream-512", "batch")
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
    for key in ("batch128_time_ratio", "stream64_time_ratio", "stream_time_ratio_512"):
        results[key] = statistics.median(j[key] for j in per_job.values())
    for spec in jobs:
        j, rows = per_job[spec.name], spec.grpo.prompts_per_step * spec.grpo.group_size
        results[f"{spec.name}_batch128_time_ratio"] = j["batch128_time_ratio"]
        for arm in ("b64-batch", "b64-stream", "b128"):
            results[f"{spec.name}_to_peak_{arm}"] = j[f"to_peak_{rows}_{arm}"]
        results[f"{spec.name}_tail_bound_b128"] = j["tail_bound_b128"]
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
