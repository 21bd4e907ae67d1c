"""Deploy a tiny Qwen2-architecture model on a local Dask cluster, warm it up on arithmetic,
and sample from it. Every model call is a Dask future routed by the PlexRL scheduler plugin.

    python examples/quickstart.py [--steps 800] [--workers 2]
"""

import argparse
import time

from distributed import Client
from rich.console import Console
from rich.progress import Progress

import plexrl_dask as plexrl
from plexrl_dask.cli import positive_float, positive_int
from plexrl_dask.rl import evaluate, supervised_warmup
from plexrl_dask.tasks import ArithmeticTask

# Worker processes are spawned and re-import this file: everything runs under main().


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=positive_int, default=800)
    parser.add_argument("--batch-size", type=positive_int, default=64)
    parser.add_argument("--workers", type=positive_int, default=2)
    parser.add_argument("--lr", type=positive_float, default=1e-3)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    console = Console()

    task = ArithmeticTask(digits=2, ops="+", seed=args.seed)
    held_out = task.problems(10_000_000, 64)  # indices the warm-up never reaches

    with plexrl.local_cluster(n_workers=args.workers) as cluster, Client(cluster) as client:
        console.print(
            f"cluster up: {len(plexrl.worker_info(client))} workers, dashboard {cluster.dashboard_link}"
        )
        runtime = plexrl.Runtime(client, job="quickstart")
        policy = runtime.deploy(
            "policy", plexrl.ModelSpec.tiny(hidden_size=128, num_layers=2, seed=args.seed)
        )
        console.print(f"deployed {policy}")
        console.print(f"accuracy before warm-up: {evaluate(policy, task, held_out):.2f}")

        t0 = time.perf_counter()
        with Progress(console=console) as progress:
            bar = progress.add_task("warm-up (cross-entropy)", total=args.steps)

            def on_step(step: int, metrics: dict) -> None:
                progress.update(bar, advance=1, description=f"warm-up loss {metrics['loss']:.3f}")

            losses = supervised_warmup(
                policy,
                task,
                steps=args.steps,
                batch_size=args.batch_size,
                optim=plexrl.AdamWParams(lr=args.lr),
                on_step=on_step,
            )
        console.print(
            f"loss {losses[0]:.3f} -> {losses[-1]:.3f} in {time.perf_counter() - t0:.1f}s"
        )
        console.print(f"accuracy after warm-up: {evaluate(policy, task, held_out):.2f}")

        params = plexrl.SamplingParams(n=4, temperature=0.7, max_tokens=8, stop=("\n",), seed=1)
        prompts = [p.prompt for p in held_out[:4]]
        out = plexrl.result(policy.sample(prompts, params))
        for prob, group in zip(held_out[:4], out.sequences, strict=True):
            texts = ", ".join(repr(s.text) for s in group)
            console.print(f"{prob.prompt}  (answer {prob.answer.strip()})  samples: {texts}")


if __name__ == "__main__":
    main()
