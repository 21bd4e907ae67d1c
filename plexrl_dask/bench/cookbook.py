"""tinker-cookbook recipes, unmodified, against a ``plexrl serve`` (a stage of ``bench.tinker``).

The cookbook runs as its own processes, from an interpreter that has it installed (its
dependencies are not this project's): ``chat_sl`` warms a model up on arithmetic conversations
in the arithmetic environment's own format, then ``math_rl`` with ``env=arithmetic`` and
``loss_fn=importance_sampling`` trains it on from that checkpoint. Each tenant runs the two
recipes with its own key; several tenants run at once on the one server and pool. Beside each
RL run runs its control: the same recipe from the same checkpoint at learning rate 0. The
arithmetic dataset draws batch ``i`` from seed ``i``, so both see the same problems at every
step, and the difference of their rewards after step 0 is what the updates learned (the raw
reward moves with each batch's difficulty).

Flags the recipes need here: ``model_name`` is the base model's local checkpoint directory (the
cookbook loads its tokenizer from it, and the server's catalog names the model by it),
``renderer_name=role_colon`` (the renderer that works with any tokenizer), ``lora_rank=0`` (full
fine-tuning: the warm-up trains the whole model from its random initialisation, and the RL
run continues from that checkpoint), ``max_tokens=12`` (with a character tokenizer the renderer's
stop string ``"\\n\\nUser:"`` alone is 7 tokens), no saving or evaluation between steps.
``chat_sl`` runs with ``lr_schedule=constant``: a warm-up annealed to learning rate 0 (the
default linear schedule) ends where the RL run's first AdamW steps (its optimizer starts afresh)
lower the reward even when trained on the right answers, and from it RL does not beat its control.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

#: mean reward of this many steps at each end of the RL run
ENDS = 3
#: the RL step size: Adam starts afresh from the warm-up's weights (a new run from saved
#: weights), so its first steps move every parameter by about this much
RL_LR = 5e-5


def arithmetic_conversations(path: Path, n: int, seed: int = 0) -> None:
    """``n`` chat examples as the arithmetic environment asks (its few-shot turn, then
    ``What is x + y?`` for x, y in 0..100) with the right answers, as JSON lines."""
    rng = random.Random(seed)
    with open(path, "w") as f:
        for _ in range(n):
            x, y = rng.randint(0, 100), rng.randint(0, 100)
            messages = [
                {"role": "user", "content": "What is 4 + 5?"},
                {"role": "assistant", "content": "9"},
                {"role": "user", "content": f"What is {x} + {y}?"},
                {"role": "assistant", "content": str(x + y)},
            ]
            f.write(json.dumps({"messages": messages}) + "\n")


def run_tenant(
    python: str,
    url: str,
    key: str,
    model_dir: str,
    work: Path,
    examples: int,
    epochs: int,
    rl_steps: int,
) -> dict[str, Any]:
    """One tenant's warm-up (``epochs`` over ``examples`` conversations) and RL run
    (``rl_steps``); what their metrics files say."""
    work.mkdir(parents=True, exist_ok=True)
    data = work / "arith.jsonl"
    arithmetic_conversations(data, examples)
    env = {**os.environ, "TINKER_API_KEY": key, "TINKER_TELEMETRY": "0", "HF_HUB_OFFLINE": "1"}
    env.pop("PYTHONPATH", None)
    common = [
        f"model_name={model_dir}", "renderer_name=role_colon", f"base_url={url}", "lora_rank=0",
        "behavior_if_log_dir_exists=delete", "save_every=0", "eval_every=0",
    ]  # fmt: skip
    sl = [
        python, "-m", "tinker_cookbook.recipes.chat_sl.train", *common, f"dataset={data}",
        f"log_path={work / 'sl'}", "batch_size=64", "learning_rate=1e-3", "lr_schedule=constant",
        f"num_epochs={epochs}", "infrequent_eval_every=0",
    ]  # fmt: skip
    _run(sl, env, work / "sl.log")
    checkpoints = _lines(work / "sl" / "checkpoints.jsonl")

    def rl(name: str, lr: float) -> list[str]:
        return [
            python, "-m", "tinker_cookbook.recipes.math_rl.train", *common, "env=arithmetic",
            "loss_fn=importance_sampling", f"load_checkpoint_path={checkpoints[-1]['state_path']}",
            "group_size=8", "groups_per_batch=16", f"learning_rate={lr}", "max_tokens=12",
            f"max_steps={rl_steps}", f"log_path={work / name}",
        ]  # fmt: skip

    # the run, and beside it its control: the same recipe, problems and start, learning rate 0
    with ThreadPoolExecutor(2) as pool:
        runs = [
            pool.submit(_run, rl(name, lr), env, work / f"{name}.log")
            for name, lr in (("rl", RL_LR), ("control", 0.0))
        ]
        for run in runs:
            run.result()
    sl_nll = [m["train_mean_nll"] for m in _metrics(work / "sl") if "train_mean_nll" in m]
    rewards, control = (_rewards(work / name) for name in ("rl", "control"))
    gains = [r - c for r, c in zip(rewards[1:], control[1:], strict=False)]
    return {
        "sl_steps": len(sl_nll),
        "sl_nll_first": sl_nll[0] if sl_nll else None,
        "sl_nll_last": sl_nll[-1] if sl_nll else None,
        "rl_steps": len(rewards),
        "rewards": rewards,
        "control_rewards": control,
        "reward_first": _mean(rewards[:ENDS]),
        "reward_last": _mean(rewards[-ENDS:]),
        "reward_gain_vs_control": _mean(gains),
    }


def _rewards(log_path: Path) -> list[float]:
    return [m["env/all/reward/total"] for m in _metrics(log_path) if "env/all/reward/total" in m]


def _run(cmd: list[str], env: dict[str, str], log: Path) -> None:
    with open(log, "w") as out:
        rc = subprocess.run(
            cmd, env=env, stdout=out, stderr=subprocess.STDOUT, timeout=3600
        ).returncode
    if rc != 0:
        tail = log.read_text()[-2000:]
        raise RuntimeError(f"{cmd[2]} exited with {rc}; the end of {log}:\n{tail}")


def _metrics(log_path: Path) -> list[dict]:
    return _lines(log_path / "metrics.jsonl")


def _lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _mean(xs: list[float]) -> float | None:
    return sum(xs) / len(xs) if xs else None
