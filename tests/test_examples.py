"""The README's first command runs the main job: here at a fiftieth of its steps, as a user
runs it (a subprocess on a fresh local cluster)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run_main(out: Path, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """``examples/multiplex.py --out OUT ARGS...`` as a user runs it, whatever it returns."""
    return subprocess.run(
        [sys.executable, str(ROOT / "examples" / "multiplex.py"), "--out", str(out), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=out.parent,
    )


def main_job(out: Path, *args: str) -> subprocess.CompletedProcess:
    proc = run_main(out, *args, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def steps(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()[1:]]


def test_the_main_job_runs_end_to_end(tmp_path):
    out = tmp_path / "run"
    proc = main_job(out, "--scale", "0.02")
    # (countdown4 trains on two workers; multiply3 calls a calculator on a tool worker)
    jobs = ["add2", "countdown3", "addsub2", "countdown4", "multiply3"]
    for job in jobs:
        # Written to a pipe, not a terminal: a plain line per job as it goes, not bars.
        assert f"{job}: step 1/" in proc.stdout and "GRPO reward" in proc.stdout
        lines = (out / f"multiplexed-{job}.jsonl").read_text().splitlines()
        header = json.loads(lines[0])
        assert header["job"] == job and header["config"]["steps"] == 2
        assert [json.loads(line)["step"] for line in lines[1:]] == [0, 1]
    assert "utilisation" in proc.stdout and "makespan" in proc.stdout
    # The same jobs alone, colocated on their training groups, measured against the pool;
    # split layouts do not fit on 2 workers beside countdown4's training group of 2.
    plain = " ".join(proc.stdout.split())
    assert "× colocated, each job on its smallest training group (measured)" in plain
    assert "colocated: every job's reward and loss, step by step, the same as in the pool" in plain
    assert "split: no layout fits on 2 workers (countdown4 trains on 2" in plain
    assert [r["step"] for r in steps(out / "colocated-countdown4.jsonl")] == [0, 1]
    assert (out / "multiplex.png").read_bytes()[:4] == b"\x89PNG"
    run = json.loads((out / "run.json").read_text())
    assert [j["name"] for j in run["jobs"]] == jobs
    assert {j["rollout_backend"] for j in run["jobs"]} == {"torch"}

    # The same command again resumes every job from its checkpoint (no warm-up); here it
    # goes on for one more step, which continues the first run's steps unchanged.
    before = {job: steps(out / f"multiplexed-{job}.jsonl") for job in jobs}
    proc = main_job(out, "--scale", "0.02", "--grpo-steps", "3")
    assert "resuming add2, countdown3, addsub2, countdown4, multiply3" in proc.stdout
    assert "no isolated runs to compare with: jobs resumed" in " ".join(proc.stdout.split())
    for job in jobs:
        after = steps(out / f"multiplexed-{job}.jsonl")
        assert [r["step"] for r in after] == [0, 1, 2]
        assert after[:2] == before[job]  # restored, not redone: wall times included


def test_a_vllm_rollout_needs_rollout_replicas(tmp_path):
    proc = run_main(tmp_path / "r", "--rollout-backend", "vllm", "--rollout-replicas", "0")
    assert proc.returncode == 2 and "needs --rollout-replicas >= 1" in proc.stderr


def test_the_main_job_on_slurm_prints_its_job_script(tmp_path):
    """``--slurm GPUS --dry-run``: the SLURMCluster is built (its scheduler with the PlexRL
    plugins, in that process) and its job script printed whole; nothing is submitted."""
    proc = run_main(
        tmp_path / "r",
        "--slurm",
        "4",
        "--slurm-queue",
        "gpu",
        "--slurm-scheduler-host",
        "127.0.0.1",
        "--slurm-shared-dir",
        str(tmp_path),
        "--dry-run",
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "#SBATCH -p gpu" in proc.stdout and "#SBATCH --gres=gpu:1" in proc.stdout
    worker = [line for line in proc.stdout.splitlines() if "dask_worker" in line]
    assert len(worker) == 1 and "--resources GPU=1" in worker[0]
    # (TLS by default: the workers' certificate in the shared directory)
    assert "tls://127.0.0.1:" in worker[0] and f"--tls-key {tmp_path}/" in worker[0]

    proc = run_main(
        tmp_path / "r",
        "--slurm",
        "8",
        "--slurm-gpus-per-job",
        "4",
        "--slurm-scheduler-host",
        "127.0.0.1",
        "--slurm-shared-dir",
        str(tmp_path),
        "--dry-run",
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "#SBATCH --gres=gpu:4" in proc.stdout
    assert "--nworkers 4" in proc.stdout and "--preload-nanny plexrl_dask.gpu_nanny" in proc.stdout


def test_the_main_job_says_when_it_reaches_no_scheduler(tmp_path):
    """``--scheduler ADDRESS`` joins a running cluster (run in ``tests/test_kubernetes.py``);
    nothing listening there is a one-line error within ``--scheduler-wait``."""
    import socket

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = run_main(
        tmp_path / "r", "--scheduler", f"tcp://127.0.0.1:{port}", "--scheduler-wait", "2"
    )
    assert proc.returncode == 1 and "no scheduler reached at" in proc.stderr
    assert "Traceback" not in proc.stderr
    proc = run_main(tmp_path / "r", "--scheduler", f"tcp://127.0.0.1:{port}", "--slurm", "2")
    assert proc.returncode == 2 and "give one of them" in proc.stderr


def test_the_main_job_on_a_cluster_without_plexrl_says_so(tmp_path):
    """A running scheduler that does not preload the PlexRL plugins: a one-line error naming
    the ways to install them, not a traceback."""
    from plexrl_dask.cluster import scheduler_process

    with scheduler_process(tmp_path, preload=False) as info:
        proc = run_main(
            tmp_path / "r",
            "--scheduler",
            info["address"],
            "--workers",
            "1",
            "--jobs",
            "3",  # (countdown4 needs two workers at the default budget: its own error)
            "--scheduler-wait",
            "5",
        )
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert "PluginsNotInstalled" in proc.stderr and "Traceback" not in proc.stderr


def test_the_grpo_example_with_a_kl_term_and_the_quickstart_run(tmp_path):
    """The reference path as the docs show it: a frozen copy of the warmed-up weights, a KL
    term that is 0 at the first step (the policy is the reference) and recorded every step."""
    metrics = tmp_path / "grpo.jsonl"
    example = str(ROOT / "examples" / "grpo_arithmetic.py")
    proc = subprocess.run(
        [sys.executable, example, "--warmup", "150", "--steps", "3", "--kl-coef", "0.05",
         "--metrics", str(metrics)],
        capture_output=True, text=True, timeout=300, cwd=tmp_path,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = steps(metrics)
    assert [r["step"] for r in records] == [0, 1, 2]
    # (150 warm-up steps: some answers are right, so groups teach and steps train)
    trained = [r for r in records if r["loss"] is not None]
    assert trained and all(r["extra"]["kl"] >= 0 for r in trained)
    assert records[0]["loss"] is None or records[0]["extra"]["kl"] == 0.0
    assert "greedy accuracy" in " ".join(proc.stdout.split())
    quick = str(ROOT / "examples" / "quickstart.py")
    proc = subprocess.run(
        [sys.executable, quick, "--steps", "3"], capture_output=True, text=True, timeout=300,
        cwd=tmp_path,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
