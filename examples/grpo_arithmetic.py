"""A GRPO job on two-digit addition: a short supervised warm-up, then RL from exact rewards,
with the policy training on one worker and a rollout replica sampling on the other.
With ``--kl-coef``, a KL penalty to the warmed-up weights: a reference deployment (role
"rollout": it only scores) given those weights once, never trained.

    python examples/grpo_arithmetic.py [--warmup 800] [--steps 60] [--temperature 0.7] [--seed 0]
                                       [--kl-coef 0.05]
"""

import argparse
import time

from distributed import Client
from rich.console import Console

import plexrl_dask as plexrl
from plexrl_dask.cli import positive_float, positive_int
from plexrl_dask.rl import GRPOConfig, GRPOJob, evaluate, supervised_warmup
from plexrl_dask.tasks import ArithmeticTask

# Worker processes are spawned and re-import this file: everything runs under main().


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--warmup", type=positive_int, default=800)
    parser.add_argument("--steps", type=positive_int, default=60)
    parser.add_argument("--lr", type=positive_float, default=1e-4)
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--kl-coef", type=float, default=0.0, help="KL to the warmed-up policy")
    parser.add_argument("--metrics", default="runs/grpo_arithmetic.jsonl")
    args = parser.parse_args()
    console = Console()
    task = ArithmeticTask(digits=2, ops="+", seed=args.seed)
    held_out = task.problems(10_000_000, 128)

    with plexrl.local_cluster(n_workers=2) as cluster, Client(cluster) as client:
        runtime = plexrl.Runtime(client, job="grpo-arithmetic")
        spec = plexrl.ModelSpec.tiny(hidden_size=128, num_layers=2, seed=args.seed)
        policy = runtime.deploy("policy", spec)
        t0 = time.perf_counter()
        losses = supervised_warmup(
            policy, task, steps=args.warmup, batch_size=64, optim=plexrl.AdamWParams(lr=1e-3)
        )
        console.print(
            f"warm-up: loss {losses[0]:.3f} -> {losses[-1]:.3f} ({time.perf_counter() - t0:.0f}s)"
        )
        before = evaluate(policy, task, held_out)

        rollout = runtime.deploy(
            "rollout",
            spec,
            role="rollout",
            workers=[w for w in plexrl.worker_info(client) if w != policy.info.worker],
        )
        plexrl.result(runtime.sync_weights(policy, rollout))
        reference = None
        if args.kl_coef > 0:  # the warmed-up weights, frozen: only scored, next to the rollout
            reference = runtime.deploy(
                "reference", spec, role="rollout", workers=rollout.info.workers
            )
            plexrl.result(runtime.sync_weights(policy, reference))
        config = GRPOConfig(
            steps=args.steps,
            prompts_per_step=32,
            group_size=8,
            max_tokens=8,
            lr=args.lr,
            temperature=args.temperature,
            seed=args.seed,
            kl_coef=args.kl_coef,
        )
        job = GRPOJob(
            "grpo-arithmetic",
            runtime,
            task,
            policy,
            config,
            rollout=rollout,
            reference=reference,
            metrics_path=args.metrics,
        )

        def show(r) -> None:
            console.print(
                f"step {r.step:3d}  reward {r.reward_mean:.3f}  groups {r.groups_used:2d}  loss {r.loss}  {r.wall_s:.1f}s"
            )

        t0 = time.perf_counter()
        records = job.run(on_step=show)
        after = evaluate(policy, task, held_out)
        first = sum(r.reward_mean for r in records[:5]) / len(records[:5])
        last = sum(r.reward_mean for r in records[-5:]) / len(records[-5:])
        console.print(
            f"GRPO {args.steps} steps in {time.perf_counter() - t0:.0f}s: sampled reward (mean of 5 steps) {first:.3f} -> {last:.3f}; greedy accuracy on {len(held_out)} held-out problems {before:.3f} -> {after:.3f}; metrics in {args.metrics}"
        )


if __name__ == "__main__":
    main()
