"""The README's first command runs the main job: here at a fiftieth of its steps, as a user
runs it (a subprocess on a fresh local cluster)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_main_job_runs_end_to_end(tmp_path):
    out = tmp_path / "run"
    proc = subprocess.run(
        [
            sys.executable,
            str(ROOT / "examples" / "multiplex.py"),
            "--scale",
            "0.02",
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    jobs = ["add2", "countdown3", "addsub2"]
    for job in jobs:
        assert job in proc.stdout
        lines = (out / f"multiplexed-{job}.jsonl").read_text().splitlines()
        header = json.loads(lines[0])
        assert header["job"] == job and header["config"]["steps"] == 2
        assert [json.loads(line)["step"] for line in lines[1:]] == [0, 1]
    assert "utilisation" in proc.stdout and "makespan" in proc.stdout
    assert (out / "multiplex.png").read_bytes()[:4] == b"\x89PNG"
    run = json.loads((out / "run.json").read_text())
    assert [j["name"] for j in run["jobs"]] == jobs
