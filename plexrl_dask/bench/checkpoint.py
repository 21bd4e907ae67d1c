"""Benchmark of job checkpoints (:mod:`plexrl_dask.rl.job_checkpoint`): what saving costs a
running GRPO job, and what resuming costs against redoing the steps.

A real process ``local_cluster`` of 2 workers. One GRPO job of the standard mix's ``add2``
task, on two models: the mix's own (128 wide, 2 layers) and a wider one (384 wide, 3 layers,
about 10x the parameters; ``--quick`` leaves it out), each in three modes: colocated (the
policy alone is saved), split (the rollout's weights too, the policy's bytes, which the store
keeps once) and split-async (the rollout's weights one version behind: saved in full). Each
model first gets a short supervised warm-up (``--warmup`` steps, saved once), so that its GRPO
steps train (an untrained model scores 0 on every sample, and a step without reward variance
trains nothing). A run with checkpoints also saves its initial state first. Per model and mode, in
alternating order, ``reps`` runs of ``steps`` steps each, every run on fresh deployments
restored from the warm-up:

- ``none``: no checkpoints (the baseline);
- ``every_5`` and ``every_1``: a checkpoint every 5 steps / every step, 2 kept.

Reported per model and mode: ``overhead_every_5`` and ``overhead_every_1`` (median wall time of
``run()`` with checkpoints ÷ without, same run), ``save_s`` (median time of one checkpoint: the
saves and the manifest, seen from the driver), ``checkpoint_mb`` (the directory after a run),
``resume_s`` (a job on fresh deployments restoring a checkpoint of all ``steps`` steps, which
then has nothing left to run; the better of 2) against ``redo_s`` (the median time of those
steps without checkpoints), ``trained_steps`` (of the ``steps``, those that trained) and
``records_identical`` (every run of every arm computed the same records).

Run: ``python -m plexrl_dask.bench.checkpoint --json OUT [--quick]``.
"""

from __future__ import annotations

import logging
import os
import shutil
import statistics
import tempfile
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from distributed import Client
from rich.progress import Progress

import plexrl_dask as plexrl
from plexrl_dask.bench.common import parser, report
from plexrl_dask.rl import GRPOJob, JobCheckpoints, StepRecord, supervised_warmup
from plexrl_dask.rl.catalog import standard_jobs
from plexrl_dask.rl.job_checkpoint import directory_bytes

logger = logging.getLogger(__name__)

MODELS = {
    "small": dict(hidden_size=128, num_layers=2),  # the mix's add2 model
    "wide": dict(hidden_size=384, num_layers=3, num_heads=6, num_kv_heads=2),
}
#: mode -> (has a rollout deployment, staleness)
MODES = {"colocated": (False, 0), "split": (True, 0), "split-async": (True, 1)}
ARMS = {"none": None, "every_5": 5, "every_1": 1}


def _comparable(records: list[StepRecord]) -> list[dict[str, Any]]:
    return [{k: v for k, v in asdict(r).items() if k != "wall_s"} for r in records]


def _measure(
    runtime: plexrl.Runtime,
    spec: plexrl.ModelSpec,
    split: bool,
    staleness: int,
    key: str,
    steps: int,
    reps: int,
    tmp: Path,
    warm: dict[str, Any],
    advance: Any,
) -> tuple[dict[str, Any], bool]:
    """One model and mode: every arm ``reps`` times, interleaved, then a resume."""
    base = standard_jobs(1)[0]
    config = replace(base.grpo, steps=steps, staleness=staleness)
    made = 0

    def job(checkpoints: JobCheckpoints | None) -> GRPOJob:
        nonlocal made
        made += 1
        policy = runtime.deploy(f"ck-{key}-{made}-policy", spec)
        version = int(plexrl.result(policy.load_state(warm)))
        rollout = None
        if split:
            rollout = runtime.deploy(f"ck-{key}-{made}-rollout", spec, role="rollout")
            plexrl.result(runtime.sync_weights(policy, rollout))
        plexrl.result(policy.load())  # the deployments' setup is outside the timed run
        return GRPOJob(
            base.name, runtime, base.task, policy, config, rollout=rollout,
            start_version=version, checkpoints=checkpoints,
        )  # fmt: skip

    def done(j: GRPOJob) -> None:
        for d in (j.policy, j.rollout):
            if d is not None:
                runtime.undeploy(d.name)

    walls: dict[str, list[float]] = {a: [] for a in ARMS}
    saves: list[float] = []
    want: list[dict[str, Any]] | None = None
    identical = True
    last_dir = tmp
    for rep in range(reps):
        for arm, every in ARMS.items():
            directory = tmp / f"{key}-{arm}-{rep}"
            ck = None if every is None else JobCheckpoints.at(directory, every)
            j = job(ck)
            t0 = time.perf_counter()
            got = _comparable(j.run())
            walls[arm].append(time.perf_counter() - t0)
            saves += j.checkpoint_s
            want = got if want is None else want
            identical &= got == want
            done(j)
            last_dir = directory if ck is not None else last_dir
            advance()
    none = statistics.median(walls["none"])
    out: dict[str, Any] = {
        f"overhead_{arm}_{key}": statistics.median(walls[arm]) / none
        for arm in ("every_5", "every_1")
    }
    out[f"save_s_{key}"] = statistics.median(saves)
    out[f"checkpoint_mb_{key}"] = directory_bytes(last_dir) / 2**20
    # resume: the last run's checkpoint of all its steps, restored on fresh deployments
    resumes = []
    for _ in range(2):
        j = job(JobCheckpoints.at(last_dir, 1))
        t0 = time.perf_counter()
        identical &= _comparable(j.run()) == want
        resumes.append(time.perf_counter() - t0)
        done(j)
    out[f"resume_s_{key}"] = min(resumes)
    out[f"redo_s_{key}"] = none
    assert want is not None
    out[f"trained_steps_{key}"] = sum(r["loss"] is not None for r in want)
    advance()
    logger.info("%s: %s", key, {k: round(v, 4) for k, v in out.items()})
    return out, identical


def _warm(runtime: plexrl.Runtime, spec: plexrl.ModelSpec, steps: int, path: Path) -> Any:
    """The model after ``steps`` supervised steps on the job's task, saved at ``path``."""
    base = standard_jobs(1)[0]
    policy = runtime.deploy(f"ck-warm-{path.name}", spec)
    try:
        supervised_warmup(
            policy, base.task, steps, batch_size=64, optim=plexrl.AdamWParams(lr=base.warmup_lr)
        )
        return plexrl.result(policy.save_state(str(path)))
    finally:
        runtime.undeploy(policy.name)


def run(steps: int, reps: int, warmup: int, models: list[str]) -> dict[str, Any]:
    results: dict[str, Any] = {}
    identical = True
    tmp = Path(tempfile.mkdtemp(prefix="plexrl-bench-ckpt-"))
    try:
        with (
            plexrl.local_cluster(n_workers=2) as cluster,
            Client(cluster, set_as_default=False) as client,
            Progress() as progress,
        ):
            runtime = plexrl.Runtime(client, job="bench-checkpoint")
            total = len(models) * len(MODES) * (reps * len(ARMS) + 1)
            bar = progress.add_task("checkpoint runs", total=total)
            for size in models:
                spec = plexrl.ModelSpec.tiny(**MODELS[size], seed=11)
                t0 = time.perf_counter()
                warm = _warm(runtime, spec, warmup, tmp / f"warm-{size}")
                logger.info(
                    "%s: warm-up of %d steps in %.0fs", size, warmup, time.perf_counter() - t0
                )
                for mode, (split, staleness) in MODES.items():
                    out, same = _measure(
                        runtime, spec, split, staleness, f"{size}_{mode}", steps, reps, tmp, warm,
                        lambda: progress.advance(bar),
                    )  # fmt: skip
                    results |= out
                    identical &= same
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    results["records_identical"] = identical
    return results


def main() -> None:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=None, help="GRPO steps per run (default 10)")
    p.add_argument("--reps", type=int, default=None, help="runs per arm (default 3)")
    p.add_argument("--warmup", type=int, default=200, help="supervised steps before GRPO")
    p.add_argument(
        "--models", default=None, help=f"of {','.join(MODELS)} (default: all; --quick: small)"
    )
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    logging.getLogger("distributed").setLevel(logging.WARNING)
    steps = args.steps or (5 if args.quick else 10)
    reps = args.reps or (1 if args.quick else 3)
    models = (args.models or ("small" if args.quick else ",".join(MODELS))).split(",")
    if not set(models) <= set(MODELS):
        p.error(f"--models: choose from {', '.join(MODELS)}")
    results = run(steps, reps, args.warmup, models)
    report(
        "checkpoint",
        results,
        {"records_identical": "true"},
        {"steps": steps, "reps": reps, "warmup": args.warmup}
        | {"models": {m: MODELS[m] for m in models}}
        | {"cpus": os.cpu_count()},
        args.json,
    )


if __name__ == "__main__":
    main()
