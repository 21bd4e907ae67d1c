"""The repository as a user meets it: packaging, environment.yml, the preload path."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tomllib
import urllib.request
from pathlib import Path

import pytest
import yaml

from plexrl_dask.cluster import MODEL_STACK, scheduler_process, stop_process
from plexrl_dask.dashboard import PAGES
from plexrl_dask.dashboard.routes import ROUTES

ROOT = Path(__file__).resolve().parents[1]
# conda-forge names of PyPI packages that differ
CONDA_NAMES = {"torch": "pytorch", "xxhash": "python-xxhash"}


def _split(req: str) -> tuple[str, str]:
    m = re.match(r"^([A-Za-z0-9_.\-]+)\s*(.*)$", req.strip())
    assert m, req
    return m.group(1).lower().replace("_", "-"), m.group(2).replace(" ", "")


def test_environment_yml_agrees_with_pyproject():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    env = yaml.safe_load((ROOT / "environment.yml").read_text())
    conda = dict(_split(d) for d in env["dependencies"] if isinstance(d, str))
    assert "conda-forge" in env["channels"]
    for req in project["dependencies"]:
        name, spec = _split(req)
        conda_name = CONDA_NAMES.get(name, name)
        assert conda_name in conda, f"{name} is in pyproject.toml but not in environment.yml"
        assert conda[conda_name] == spec, (
            f"{name}: pyproject {spec!r} vs environment.yml {conda[conda_name]!r}"
        )
    python = conda["python"].removeprefix(">=")
    assert project["requires-python"] == f">={python}"


def test_wheel_installs_and_imports_every_package(tmp_path):
    # Build from a copy: an in-tree build leaves build/ behind, whose stale files could leak
    # into later wheels.
    source = tmp_path / "source"
    shutil.copytree(
        ROOT,
        source,
        ignore=shutil.ignore_patterns(
            ".venv", ".git", "build", "*.egg-info", "__pycache__", ".*_cache", "bench-out"
        ),
    )
    wheels = tmp_path / "wheels"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--quiet",
            "--no-deps",
            "--no-build-isolation",
            "-w",
            str(wheels),
            str(source),
        ],
        check=True,
        timeout=300,
    )
    (wheel,) = wheels.glob("plexrl_dask-*.whl")
    target = tmp_path / "site"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--quiet",
            "--no-deps",
            "--target",
            str(target),
            str(wheel),
        ],
        check=True,
        timeout=300,
    )
    # Dependencies come from this environment's site-packages, put on PYTHONPATH: that is not a
    # site directory, so the editable install's finder (.pth) is not active and plexrl_dask can
    # only come from the wheel.
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(target), sysconfig.get_paths()["purelib"]]),
    }
    code = (
        "import json, plexrl_dask, plexrl_dask.plugins, plexrl_dask.state_store, plexrl_dask.worker.ops, "
        "plexrl_dask.bench.service, plexrl_dask.cli;"
        "from plexrl_dask.sim.workload import WorkloadSpec;"
        "from plexrl_dask.plugins import PlexRLSchedulerPlugin, dask_setup;"
        "import dask.config;"
        "print(json.dumps({'file': plexrl_dask.__file__, 'plugins': plexrl_dask.plugins.__file__,"
        " 'budget': dask.config.get('plexrl.worker.memory-budget'),"
        " 'workload': WorkloadSpec.load('paper2048').cluster.gpus}))"
    )
    out = subprocess.run(
        [sys.executable, "-S", "-c", code],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    info = json.loads(out.stdout.strip().splitlines()[-1])
    assert info["file"].startswith(str(target)) and info["plugins"].startswith(str(target))
    assert info["budget"] == "auto"  # the packaged yaml defaults were found
    assert info["workload"] == 2048  # and the simulator's committed workload
    assert not (target / "plugins").exists() and not (target / "state_store").exists()


def test_console_script_prints_config():
    out = subprocess.run(
        [sys.executable, "-m", "plexrl_dask.cli", "config"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert yaml.safe_load(out.stdout)["plexrl"]["worker"]["gpu-resource"] == "GPU"


def test_readme_opens_with_the_two_commands():
    text = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```(?:bash|sh)?\n(.*?)```", text, flags=re.S)
    assert "make demo" in blocks[0] and "make test" in blocks[0]
    assert "make test" in (ROOT / ".ci" / "run").read_text()


@pytest.mark.timeout(240)
def test_scheduler_preload_on_a_plain_dask_cluster(tmp_path):
    """`dask scheduler --preload plexrl_dask.plugins` + a plain `dask worker` with the GPU
    resource: the shared-cluster path, in real processes."""
    from distributed import Client

    import plexrl_dask as plexrl

    with scheduler_process(tmp_path) as info:
        worker = subprocess.Popen(
            [str(Path(sys.executable).parent / "dask"), "worker", info["address"],
             "--host", "127.0.0.1", "--nthreads", "1", "--resources", "GPU=1", "--no-dashboard"],
            cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        try:
            with Client(info["address"], timeout=60) as client:
                client.wait_for_workers(1, timeout=60)
                runtime = plexrl.Runtime(client, job="preload")
                dep = runtime.deploy(
                    "preloaded", plexrl.ModelSpec.tiny(hidden_size=32, num_layers=1)
                )
                out = plexrl.result(
                    dep.sample(["1+1="], plexrl.SamplingParams(n=2, max_tokens=4)), timeout=120
                )
                assert [len(s.tokens) for s in out.sequences[0]] == [4, 4]
                # a training step and a checkpoint round trip: every kind of task the jobs send
                datum = plexrl.Datum.from_prompt_completion(dep.tokenize("1+1="), dep.tokenize("2"))
                fb = dep.forward_backward([datum], plexrl.CrossEntropy())
                step = dep.optim_step(plexrl.AdamWParams(lr=1e-3))
                ckpt = plexrl.result(dep.save_state(str(tmp_path / "ckpt")), timeout=120)
                plexrl.result([fb, step, dep.load_state(ckpt)], timeout=120)
                # the holder reported from a preload-less worker
                assert runtime.status()["workers"]
                shown = subprocess.run(
                    [
                        sys.executable,
                        "-m",
                        "plexrl_dask.cli",
                        "status",
                        "--scheduler",
                        client.scheduler.address,
                    ],
                    capture_output=True,
                    text=True,
                    timeout=120,
                )
                assert shown.returncode == 0, shown.stderr
                assert "preloaded" in shown.stdout and "hbm" in shown.stdout
                # Every PlexRL page built once (a GET creates its Bokeh session on the scheduler)
                # and every JSON route served: the scheduler has done all its kinds of work.
                base = client.dashboard_link.rsplit("/", 1)[0]
                for path in (*PAGES, *(f"/{route}" for route, _, _ in ROUTES)):
                    with urllib.request.urlopen(base + path, timeout=60) as page:
                        assert page.status == 200, path
                # ...and never needed the model stack: a lean scheduler (models/spec.py says why).
                heavy = client.run_on_scheduler(
                    lambda: [m for m in MODEL_STACK if m in sys.modules]
                )
                assert heavy == []
        finally:
            stop_process(worker)


def test_bench_scheduler_footprint_probes_a_lean_preloaded_scheduler():
    """bench.scheduler's process footprint: the preloaded scheduler, probed for real."""
    from plexrl_dask.bench.scheduler import _scheduler_process

    probe = _scheduler_process(preload=True)
    assert probe["heavy_modules"] == []
    assert probe["objects"] > 0 and probe["full_gc_ms"] > 0 and probe["rss_mb"] > 0
    assert probe["start_s"] > 0


def _keys(node: object, out: set[str]) -> set[str]:
    if isinstance(node, dict):
        for key, value in node.items():
            out.add(key)
            _keys(value, out)
    elif isinstance(node, list):
        for value in node:
            _keys(value, out)
    return out


def test_results_dashboard_names_what_its_json_records():
    """Every metric a row of benchmarks/RESULTS.md names is a key of the JSON its command
    writes (under ``results``; a dotted name a path into it), and the command's benchmark
    exists: a renamed result cannot leave the dashboard quoting a key no run writes. A row
    computed from a run's ledgers says "not in its JSON" and is exempt."""
    rows = [
        r for r in (ROOT / "benchmarks/RESULTS.md").read_text().splitlines() if r.startswith("| `")
    ]
    checked = 0
    for row in rows:
        cells = row.split("|")
        command = re.search(
            r"-m (plexrl_dask\.bench\.\w+) .*--json (benchmarks/\S+\.json)", cells[-2]
        )
        if command is None or "not in its JSON" in cells[1]:
            continue
        module, path = command.groups()
        assert (ROOT / module.replace(".", "/")).with_suffix(".py").is_file(), row
        data = json.loads((ROOT / path).read_text())
        results = data.get("results", data)
        known = _keys(results, set())
        for name in re.findall(r"`([a-z][a-z0-9_.]*)`", cells[1].split("(")[0]):
            node = results
            for part in name.split("."):
                node = node.get(part) if isinstance(node, dict) else None
            assert node is not None or name in known, f"{name} is not in {path}: {row[:120]}"
            checked += 1
    assert checked >= 100, checked
