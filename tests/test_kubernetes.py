"""The DaskCluster resource of a PlexRL cluster (``plexrl_dask.kubernetes``).

No Kubernetes runs here. The resource is checked as data, and its pods' commands are started as
local processes with what the operator and the kubelet would give them (the scheduler's
address and the worker's name in the environment, ``$(VAR)`` expanded in the arguments), only
the ports, hosts and the volumes' paths made local: they form a PlexRL cluster that trains,
syncs weights between its pods and samples."""

from __future__ import annotations

import base64
import contextlib
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import dask
import pytest
import yaml
from distributed import Client

import plexrl_dask as plexrl
from plexrl_dask import errors
from plexrl_dask.cli import main as plexrl_main
from plexrl_dask.cluster import client_security, read_scheduler_file, stop_process
from plexrl_dask.kubernetes import NVME_MOUNT, TLS_MOUNT, kube_cluster_spec, kube_tls_secret
from plexrl_dask.state_store.keys import derived_model
from tests.conftest import node_state, tiny_spec, unique
from tests.test_tls import train_sync_sample

WAIT_S = 120.0
ROOT = Path(__file__).resolve().parents[1]


def container(spec: dict, role: str) -> dict:
    [c] = spec["spec"][role]["spec"]["containers"]
    return c


def env_of(c: dict) -> dict[str, str]:
    return {e["name"]: e["value"] for e in c.get("env", [])}


def test_a_pod_per_gpu_and_a_pod_per_machine():
    one = kube_cluster_spec("rl", 4, "registry/plexrl:1")
    assert one["apiVersion"] == "kubernetes.dask.org/v1" and one["kind"] == "DaskCluster"
    assert one["spec"]["worker"]["replicas"] == 4
    w = container(one, "worker")
    assert w["resources"]["limits"]["nvidia.com/gpu"] == "1"
    assert "--nworkers" not in w["args"] and "--preload-nanny" not in w["args"]
    assert w["args"][:2] == ["dask", "worker"] and "$(DASK_WORKER_NAME)" in w["args"]
    assert " ".join(w["args"]).endswith("--resources GPU=1 --dashboard-address 8788")
    s = container(one, "scheduler")
    assert s["args"] == [
        "dask",
        "scheduler",
        "--host",
        "0.0.0.0",
        "--preload",
        "plexrl_dask.plugins",
    ]
    assert {p["containerPort"] for p in s["ports"]} == {8786, 8787}
    assert one["spec"]["scheduler"]["service"]["selector"]["dask.org/cluster-name"] == "rl"

    # (settings made here go to every pod, but the operator secret, and a worker pod's tiers
    # are the spec's own)
    driver = {
        "plexrl.worker.torch-threads": 2,
        "plexrl.state.nvme-path": "/here/nvme",
        "plexrl.operator-secret": "an-operator-secret-of-this-process",
    }
    with dask.config.set(driver):
        machine = kube_cluster_spec(
            "rl",
            16,
            "registry/plexrl:1",
            gpus_per_pod=8,
            rollout_backend="vllm",
            worker_resources={"cpu": "64", "memory": "1000Gi"},
            dram_size="400Gi",
            shared_volume={"persistentVolumeClaim": {"claimName": "runs"}},
            shared_path="/runs",
            env={"DASK_PLEXRL__REQUEST__TIMEOUT": "1200s"},
        )
    assert "operator-secret-of" not in yaml.safe_dump(machine)
    assert machine["spec"]["worker"]["replicas"] == 2
    w = container(machine, "worker")
    assert w["resources"]["limits"] == {"cpu": "64", "memory": "1000Gi", "nvidia.com/gpu": "8"}
    assert w["resources"]["requests"] == w["resources"]["limits"]
    args = " ".join(w["args"])
    assert "--nworkers 8 --preload-nanny plexrl_dask.gpu_nanny" in args
    # each worker's share of the pod's memory, less the in-memory /dev/shm it is charged for
    assert f"--memory-limit {600 * 2**30 // 8}" in args
    env = env_of(w)
    assert env["DASK_DISTRIBUTED__WORKER__DAEMON"] == "False"  # vLLM engines are children
    assert env["DASK_PLEXRL__STATE__NVME_PATH"] == NVME_MOUNT
    assert env["DASK_PLEXRL__STATE__DRAM_PATH"].startswith("/dev/shm/")
    assert int(env["DASK_PLEXRL__STATE__DRAM_CAPACITY"]) == int(400 * 2**30 * 0.9)
    assert env["DASK_DISTRIBUTED__NANNY__PRE_SPAWN_ENVIRON__MALLOC_TRIM_THRESHOLD_"] == "None"
    assert env["DASK_PLEXRL__REQUEST__TIMEOUT"] == "1200s"
    assert env["DASK_PLEXRL__WORKER__TORCH_THREADS"] == "2"
    assert env_of(container(machine, "scheduler")) == {
        "DASK_PLEXRL__REQUEST__TIMEOUT": "1200s",
        "DASK_PLEXRL__WORKER__TORCH_THREADS": "2",
        "DASK_PLEXRL__STATE__NVME_PATH": "'/here/nvme'",
    }
    mounts = {m["name"]: m["mountPath"] for m in w["volumeMounts"]}
    assert mounts == {
        "plexrl-dram": "/dev/shm",
        "plexrl-nvme": NVME_MOUNT,
        "plexrl-shared": "/runs",
    }
    volumes = {v["name"]: v for v in machine["spec"]["worker"]["spec"]["volumes"]}
    assert volumes["plexrl-dram"]["emptyDir"] == {"medium": "Memory", "sizeLimit": "400Gi"}
    assert volumes["plexrl-shared"]["persistentVolumeClaim"] == {"claimName": "runs"}
    # YAML without anchors: no two places share one object
    assert "&id" not in yaml.safe_dump(machine)


def test_the_resource_is_what_the_operator_and_the_kubernetes_api_accept():
    """The fields the operator's ``DaskCluster`` schema defines (dask-kubernetes'
    ``templates.yaml``, restated here): worker ``replicas``/``metadata``/``spec`` (a PodSpec),
    scheduler ``metadata``/``spec``/``service`` (a ServiceSpec). The PodSpecs and the ServiceSpec go through the Kubernetes API's own
    models and back unchanged: a misspelt or misplaced field would be dropped, a number
    given as a string turned into one."""
    api = pytest.importorskip("kubernetes.client").ApiClient()

    def round_trip(data: dict, kind: str) -> dict:
        return api.sanitize_for_serialization(
            api.deserialize(json.dumps(data), kind, "application/json")
        )

    for kwargs in ({}, {"gpus_per_pod": 4, "rollout_backend": "vllm",
                        "shared_volume": {"persistentVolumeClaim": {"claimName": "runs"}},
                        "nvme_volume": {"hostPath": {"path": "/mnt/nvme", "type": "Directory"}},
                        "worker_resources": {"cpu": "32", "memory": "500Gi"},
                        "scheduler_resources": {"cpu": "4"}, "tls_secret": "rl-tls"}):  # fmt: skip
        spec = kube_cluster_spec("rl", 8, "registry/plexrl:1", **kwargs)
        assert set(spec) == {"apiVersion", "kind", "metadata", "spec"}
        assert set(spec["spec"]) == {"idleTimeout", "worker", "scheduler"}
        worker, scheduler = spec["spec"]["worker"], spec["spec"]["scheduler"]
        assert set(worker) <= {"replicas", "metadata", "spec"} and isinstance(
            worker["replicas"], int
        )
        assert set(scheduler) <= {"metadata", "spec", "service"}
        for pod in (worker["spec"], scheduler["spec"]):
            assert round_trip(pod, "V1PodSpec") == pod
        assert round_trip(scheduler["service"], "V1ServiceSpec") == scheduler["service"]

    secret, _ = kube_tls_secret("rl-tls")
    assert round_trip(secret, "V1Secret") == secret

    broken = kube_cluster_spec("rl", 8, "registry/plexrl:1")["spec"]["worker"]["spec"]
    broken["containers"][0]["volumeMount"] = broken["containers"][0].pop("volumeMounts")
    assert round_trip(broken, "V1PodSpec") != broken  # (the check would see it)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"name": "RL"}, "lowercase"),
        ({"name": "-rl"}, "lowercase"),
        ({"name": "1rl"}, "a letter first"),  # its Service's name must start with one
        ({"name": "r" * 38}, "lowercase"),  # its workers' Deployments' names would be too long
        ({"gpus": 0}, "gpus must be"),
        ({"gpus": True}, "gpus must be"),
        ({"gpus": 6, "gpus_per_pod": 4}, "multiple of gpus_per_pod"),
        ({"gpus_per_pod": 0}, "gpus_per_pod must be"),
        ({"rollout_backend": "sglang"}, "rollout_backend"),
        ({"image": ""}, "image"),
        ({"dram_size": "16GiB"}, "quantity"),
        ({"dram_size": "0"}, "quantity"),
        ({"dram_size": "1Ei"}, "quantity"),
        ({"idle_timeout": -1}, "idle_timeout"),
        ({"idle_timeout": True}, "idle_timeout"),
        ({"shared_path": "runs"}, "absolute"),
        ({"shared_path": "/dev/shm/runs"}, "overlaps"),
        ({"shared_path": "/plexrl"}, "overlaps"),
        ({"nvme_volume": {"name": "x", "emptyDir": {}}}, "without a name"),
        ({"shared_volume": "runs"}, "without a name"),
        ({"worker_resources": {"memory": "16Gi"}}, "must exceed its dram_size"),
        ({"worker_resources": {"memory": "lots"}}, "quantity"),
        ({"tls_secret": "RL_TLS"}, "Secret"),
        ({"tls_secret": ""}, "Secret"),
        ({"tls_secret": "rl-tls", "idle_timeout": 600}, "idle_timeout"),
    ],
)
def test_values_the_operator_or_plexrl_would_refuse_are_typed_errors(kwargs, match):
    args = {"name": "rl", "gpus": 4, "image": "registry/plexrl:1", **kwargs}
    with pytest.raises(errors.ConfigError, match=match):
        kube_cluster_spec(args.pop("name"), args.pop("gpus"), args.pop("image"), **args)


def test_plexrl_kube_spec_prints_the_resource_as_yaml(capsys, tmp_path):
    # by default with TLS: the Secret first, a client's copy of its certificate written
    assert plexrl_main(["kube-spec", "--name", "rl", "--gpus", "2", "--image", "img:1",
                        "--tls-dir", str(tmp_path / "tls")]) == 0  # fmt: skip
    shown = capsys.readouterr()
    secret, spec = yaml.safe_load_all(shown.out)
    assert secret["kind"] == "Secret" and secret["metadata"]["name"] == "rl-tls"
    assert spec == kube_cluster_spec("rl", 2, "img:1", tls_secret="rl-tls")
    saved = tmp_path / "tls" / "kube-rl"
    assert str(saved) in shown.err.replace("\n", "")
    ca = client_security(saved).tls_ca_file
    assert Path(ca).read_text().encode() == base64.b64decode(secret["data"]["ca.crt"])
    assert oct(saved.stat().st_mode & 0o777) == "0o700"
    # run again: the same certificate (a running cluster's clients keep working); a new one
    # only when asked for
    args = ["kube-spec", "--name", "rl", "--gpus", "2", "--image", "img:1",
            "--tls-dir", str(tmp_path / "tls")]  # fmt: skip
    assert plexrl_main(args) == 0
    again, _ = yaml.safe_load_all(capsys.readouterr().out)
    assert again == secret
    assert plexrl_main([*args, "--new-certificate"]) == 0
    rotated, _ = yaml.safe_load_all(capsys.readouterr().out)
    assert rotated["data"]["ca.crt"] != secret["data"]["ca.crt"]
    assert Path(client_security(saved).tls_ca_file).read_text().encode() == base64.b64decode(
        rotated["data"]["ca.crt"]
    )
    # a saved key that is not its certificate's (another run's) is refused, not published
    other = tmp_path / "other"
    assert plexrl_main([*args[:-1], str(other)]) == 0
    capsys.readouterr()
    (saved / "client-key.pem").write_text((other / "kube-rl" / "client-key.pem").read_text())
    assert plexrl_main(args) == 2
    shown = capsys.readouterr()
    assert "--new-certificate" in shown.err and not shown.out

    assert plexrl_main(
        ["kube-spec", "--name", "rl", "--gpus", "8", "--gpus-per-pod", "4", "--image", "img:1",
         "--worker-memory", "256Gi", "--shared-claim", "runs", "--no-tls"]
    ) == 0  # fmt: skip
    printed = yaml.safe_load(capsys.readouterr().out)
    assert printed == kube_cluster_spec(
        "rl",
        8,
        "img:1",
        gpus_per_pod=4,
        worker_resources={"memory": "256Gi"},
        shared_volume={"persistentVolumeClaim": {"claimName": "runs"}},
    )
    assert plexrl_main(
        ["kube-spec", "--name", "rl", "--gpus", "2", "--image", "img:1", "--idle-timeout", "600",
         "--nvme-host-path", "/mnt/nvme/plexrl", "--env", "DASK_PLEXRL__REQUEST__TIMEOUT=1200s",
         "--env", "HF_HOME=/plexrl/shared/hf", "--no-tls"]
    ) == 0  # fmt: skip
    assert yaml.safe_load(capsys.readouterr().out) == kube_cluster_spec(
        "rl",
        2,
        "img:1",
        idle_timeout=600,
        nvme_volume={"hostPath": {"path": "/mnt/nvme/plexrl", "type": "DirectoryOrCreate"}},
        env={"DASK_PLEXRL__REQUEST__TIMEOUT": "1200s", "HF_HOME": "/plexrl/shared/hf"},
    )
    with pytest.raises(SystemExit) as info:  # argparse's usage error
        plexrl_main(["kube-spec", "--name", "rl", "--gpus", "2", "--image", "i", "--env", "X"])
    assert info.value.code == 2 and "KEY=VALUE" in capsys.readouterr().err
    assert plexrl_main(["kube-spec", "--name", "rl", "--gpus", "6", "--gpus-per-pod", "4",
                        "--image", "img:1", "--no-tls"]) == 2  # fmt: skip
    shown = capsys.readouterr()
    assert "multiple of gpus_per_pod" in shown.err and not shown.out  # nothing for kubectl


def expand(arg: str, env: dict[str, str]) -> str:
    """The kubelet's ``$(VAR)`` expansion of a container argument."""
    return re.sub(r"\$\((\w+)\)", lambda m: env.get(m.group(1), m.group(0)), arg)


def start(c: dict, env: dict[str, str], log: Path, *local: str) -> subprocess.Popen:
    """Run container ``c``'s command here: its environment plus ``env``, its arguments
    expanded, ``local`` arguments after them (the last of a repeated option wins); its output
    into ``log`` (kept in the test's temporary directory)."""
    full = {**os.environ, **env_of(c), **env}
    argv = [expand(a, full) for a in c["args"]]
    assert argv[0] == "dask"
    argv[0] = str(Path(sys.executable).parent / "dask")
    with open(log, "wb") as out:
        return subprocess.Popen([*argv, *local], env=full, stdout=out, stderr=subprocess.STDOUT)


def test_the_resources_pods_form_a_plexrl_cluster(tmp_path):
    """Two worker pods of two GPUs' workers each: a trainer with a rank in each pod, rollout
    replicas in both, weights published in one pod's tiers and imported by the other's."""
    spec = kube_cluster_spec("rl", 4, "registry/plexrl:1", gpus_per_pod=2, dram_size="1Gi")
    sched_file = tmp_path / "scheduler.json"
    procs = [
        start(
            container(spec, "scheduler"),
            {},
            tmp_path / "scheduler.log",
            "--host", "127.0.0.1", "--port", "0", "--dashboard-address", "127.0.0.1:0",
            "--scheduler-file", str(sched_file),
        )
    ]  # fmt: skip
    pods = ("rl-default-worker-0a1b2c", "rl-default-worker-3d4e5f")
    tiers = {pod: {"dram-path": tmp_path / pod / "dram", "nvme-path": tmp_path / pod / "nvme"}
             for pod in pods}  # fmt: skip
    try:
        address = read_scheduler_file(sched_file, procs[0], WAIT_S)["address"]
        for pod in pods:
            local_mounts = {  # the pod's volumes, and its host name as the node's name
                "DASK_PLEXRL__STATE__DRAM_PATH": str(tiers[pod]["dram-path"]),
                "DASK_PLEXRL__STATE__NVME_PATH": str(tiers[pod]["nvme-path"]),
                "DASK_PLEXRL__STATE__NODE_ID": pod,
            }
            operator = {"DASK_SCHEDULER_ADDRESS": address, "DASK_WORKER_NAME": pod}
            procs.append(
                start(
                    container(spec, "worker"),
                    {**operator, **local_mounts},
                    tmp_path / f"{pod}.log",
                    "--host",
                    "127.0.0.1",
                )
            )
        with Client(address, set_as_default=False, timeout=60) as client:
            client.wait_for_workers(4, timeout=WAIT_S)
            names = sorted(w["name"] for w in plexrl.worker_info(client).values())
            assert names == sorted(f"{pod}-{k}" for pod in pods for k in (0, 1))
            runtime = plexrl.Runtime(client, job=unique("kube"))
            deadline = time.monotonic() + WAIT_S
            while True:  # each holder registers its node (pod) as it starts
                by_node: dict[str, list[str]] = {}
                for w, info in runtime.status()["workers"].items():
                    by_node.setdefault(info.get("node"), []).append(w)
                if sorted(map(len, by_node.values())) == [2, 2] and set(by_node) == set(pods):
                    break
                assert time.monotonic() < deadline, f"pods never registered: {by_node}"
                time.sleep(0.5)
            a, b = (sorted(by_node[pod]) for pod in pods)
            trainer = runtime.deploy(
                unique("kube-train"), tiny_spec(seed=51), world_size=2, workers=[a[0], b[0]]
            )
            rolls = [
                runtime.deploy(unique("kube-roll"), tiny_spec(seed=52), role="rollout", workers=[w])
                for w in (a[1], b[1])
            ]
            train_sync_sample(runtime, trainer, rolls)
            # the newest version of the trainer's weights in each pod's DRAM tier, the same
            # one (where it was published, the one before it may stay too: a load may be queued)
            model = derived_model("weights", trainer.name)
            stored = []
            for pod in pods:
                with contextlib.closing(node_state(tiers[pod])) as node:
                    stored.append(node.store("dram").versions(model))
            assert stored[0] and stored[1] and stored[0][-1] == stored[1][-1], stored
            assert all(len(v) <= 2 for v in stored), stored

            # The main job, from a driver outside the pods (as from a pod of its own).
            out = tmp_path / "run"
            proc = subprocess.run(
                [sys.executable, str(ROOT / "examples" / "multiplex.py"), "--out", str(out),
                 "--scheduler", address, "--workers", "4", "--jobs", "2", "--scale", "0.02"],
                capture_output=True, text=True, timeout=600, cwd=tmp_path,
            )  # fmt: skip
            assert proc.returncode == 0, proc.stderr[-3000:]
            assert "cluster: 4 workers" in proc.stdout
            for job in ("add2", "countdown3"):
                lines = (out / f"multiplexed-{job}.jsonl").read_text().splitlines()
                assert [json.loads(line)["step"] for line in lines[1:]] == [0, 1]
    finally:
        for proc in reversed(procs):
            with contextlib.suppress(Exception):
                stop_process(proc, timeout=60)
        for pod in pods:  # the pods' managers outlive their workers
            with contextlib.suppress(Exception):
                node_state(tiers[pod]).shutdown()


def test_a_tls_resources_pods_take_only_clients_of_its_certificate(tmp_path):
    """With ``tls_secret`` every pod mounts the Secret and speaks TLS only: the pods' commands,
    the Secret's files where the kubelet would mount them, form a cluster that a client of
    the certificate trains and samples on, and that a plain or another certificate's client
    cannot reach."""
    secret, security = kube_tls_secret("rl-tls")
    spec = kube_cluster_spec("rl", 1, "registry/plexrl:1", tls_secret="rl-tls")
    for role in ("scheduler", "worker"):
        pod = spec["spec"][role]["spec"]
        [volume] = [v for v in pod["volumes"] if v["name"] == "plexrl-tls"]
        assert volume["secret"]["secretName"] == "rl-tls"
        [mount] = [m for m in container(spec, role)["volumeMounts"] if m["name"] == "plexrl-tls"]
        assert mount == {"name": "plexrl-tls", "mountPath": TLS_MOUNT, "readOnly": True}
        env = env_of(container(spec, role))
        assert env["DASK_DISTRIBUTED__COMM__REQUIRE_ENCRYPTION"] == "True"
        assert env["DASK_DISTRIBUTED__COMM__TLS__CA_FILE"] == f"{TLS_MOUNT}/ca.crt"
    assert container(spec, "scheduler")["args"][-2:] == ["--protocol", "tls"]
    assert "tls://rl-scheduler:8786" in container(spec, "worker")["args"]

    mounted = tmp_path / "tls"  # (the kubelet's mount of the Secret)
    mounted.mkdir()
    for key, value in secret["data"].items():
        (mounted / key).write_bytes(base64.b64decode(value))
        (mounted / key).chmod(0o400)
    local = {k: v.replace(TLS_MOUNT, str(mounted)) for k, v in env_of(container(spec, "worker")).items()
             if k.startswith("DASK_DISTRIBUTED__COMM__")}  # fmt: skip
    sched_file = tmp_path / "scheduler.json"
    procs = [
        start(container(spec, "scheduler"), local, tmp_path / "scheduler.log",
              "--host", "127.0.0.1", "--port", "0", "--dashboard-address", "127.0.0.1:0",
              "--scheduler-file", str(sched_file))
    ]  # fmt: skip
    pod = "rl-default-worker-0a1b2c"
    tiers = {"dram-path": tmp_path / "dram", "nvme-path": tmp_path / "nvme"}
    try:
        address = read_scheduler_file(sched_file, procs[0], WAIT_S)["address"]
        assert address.startswith("tls://")
        worker = dict(container(spec, "worker"))
        worker["args"] = [address if a == "tls://rl-scheduler:8786" else a for a in worker["args"]]
        env = {
            **local,
            "DASK_WORKER_NAME": pod,
            "DASK_SCHEDULER_ADDRESS": "tcp://" + address.removeprefix("tls://"),  # (the operator's)
            "DASK_PLEXRL__STATE__DRAM_PATH": str(tiers["dram-path"]),
            "DASK_PLEXRL__STATE__NVME_PATH": str(tiers["nvme-path"]),
            "DASK_PLEXRL__STATE__NODE_ID": pod,
        }
        procs.append(start(worker, env, tmp_path / "worker.log", "--host", "127.0.0.1"))
        with Client(address, security=security, set_as_default=False, timeout=60) as client:
            client.wait_for_workers(1, timeout=WAIT_S)
            assert all(w.startswith("tls://") for w in client.scheduler_info()["workers"])
            runtime = plexrl.Runtime(client, job=unique("kube-tls"))
            trainer = runtime.deploy(unique("kube-tls-train"), tiny_spec(seed=53))
            roll = runtime.deploy(unique("kube-tls-roll"), tiny_spec(seed=53), role="rollout")
            train_sync_sample(runtime, trainer, [roll])
        plain = "tcp://" + address.removeprefix("tls://")
        with pytest.raises(OSError):
            Client(plain, set_as_default=False, timeout=5)
        with pytest.raises(OSError):  # a certificate the cluster's CA did not sign
            Client(address, security=type(security).temporary(), set_as_default=False, timeout=5)
    finally:
        for proc in reversed(procs):
            with contextlib.suppress(Exception):
                stop_process(proc, timeout=60)
        with contextlib.suppress(Exception):
            node_state(tiers).shutdown()
