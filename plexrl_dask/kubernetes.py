"""PlexRL on Kubernetes: the ``DaskCluster`` resource of the Dask Kubernetes operator.

:func:`kube_cluster_spec` builds the custom resource (``apiVersion: kubernetes.dask.org/v1``)
of a PlexRL cluster: a scheduler pod that preloads the PlexRL plugins and a worker group of
pods with GPUs, one PlexRL worker per GPU. Apply it with ``kubectl apply -f`` (``plexrl
kube-spec`` prints it as YAML) or hand it to dask-kubernetes: ``KubeCluster(
custom_cluster_spec=kube_cluster_spec(...))``. The operator gives every worker container
``DASK_SCHEDULER_ADDRESS`` (the scheduler's service) and ``DASK_WORKER_NAME`` (its pod), which
the commands below use.

What a pod is to PlexRL:

- **One node of the state store.** A pod's workers share its DRAM tier (``/dev/shm``, an
  in-memory ``emptyDir`` of ``dram_size``, which counts against the pod's memory limit: a
  container's own is 64 MiB) and its NVMe tier (an ``emptyDir`` on the machine's disk unless
  ``nvme_volume`` names another volume, which must then be the pod's alone). Pods do not
  share tiers, even on one machine: the tier's manager is reached through an abstract Unix
  socket, which lives in the pod's network namespace. So a pod of ``gpus_per_pod`` GPUs (a
  whole machine) keeps offloaded replicas and weight versions in one place for all its GPUs,
  and weights reach another pod worker to worker, through Dask's comms.
- **``gpus_per_pod`` workers.** ``dask worker --nworkers N`` with the nanny preload
  :mod:`plexrl_dask.gpu_nanny`, which gives each worker one of the pod's GPUs.
- **A shared volume** (``shared_volume`` mounted at ``shared_path``, e.g. a ReadWriteMany
  claim) for job checkpoint directories, which the driver and the workers must both reach.

The image must hold this package and its dependencies (and vLLM for ``rollout_backend=
"vllm"``). ``tests/test_kubernetes.py`` starts the resource's scheduler and worker commands as
local processes, environments included, and runs PlexRL on them; no Kubernetes cluster was
available to apply it to.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from dask.utils import parse_bytes

from plexrl_dask import config
from plexrl_dask.cluster import PRELOAD
from plexrl_dask.errors import ConfigError

API_VERSION = "kubernetes.dask.org/v1"
GPU_NANNY = "plexrl_dask.gpu_nanny"
#: The ports the operator's scheduler service targets by name.
SCHEDULER_PORT, DASHBOARD_PORT, WORKER_DASHBOARD_PORT = 8786, 8787, 8788
#: Where a worker pod mounts its NVMe tier.
NVME_MOUNT = "/plexrl/nvme"
#: The operator prefixes service and pod names with the cluster's name (a DNS-1123 label of
#: at most 63 characters, the longest suffix being "-scheduler" and a worker group's).
_NAME = re.compile(r"^[a-z0-9]([-a-z0-9]{0,38}[a-z0-9])?$")
#: A Kubernetes quantity of bytes, e.g. "16Gi" (not "16GiB").
_QUANTITY = re.compile(r"^[0-9]+(\.[0-9]+)?(Ki|Mi|Gi|Ti|Pi|Ei|k|M|G|T|P|E)?$")
#: Of the in-memory /dev/shm, the share the DRAM tier may fill (the rest: torch's own shared
#: memory, and a margin before the kubelet evicts a pod over its volume's size limit).
DRAM_SHARE = 0.9


def _env(values: Mapping[str, str]) -> list[dict[str, str]]:
    return [{"name": k, "value": str(v)} for k, v in values.items()]


def kube_cluster_spec(
    name: str,
    gpus: int,
    image: str,
    *,
    gpus_per_pod: int = 1,
    rollout_backend: str = "torch",
    worker_resources: Mapping[str, str] | None = None,
    scheduler_resources: Mapping[str, str] | None = None,
    dram_size: str = "16Gi",
    nvme_volume: Mapping[str, Any] | None = None,
    shared_volume: Mapping[str, Any] | None = None,
    shared_path: str = "/plexrl/shared",
    env: Mapping[str, str] | None = None,
    gpu_resource: str = "nvidia.com/gpu",
    idle_timeout: int = 0,
) -> dict[str, Any]:
    """The ``DaskCluster`` resource of a PlexRL cluster of ``gpus`` GPUs (module docstring).

    - ``name``: the cluster's name (lowercase letters, digits and ``-``, at most 40).
    - ``gpus``, ``gpus_per_pod``: ``gpus / gpus_per_pod`` worker pods (it must divide), each
      asking for ``gpus_per_pod`` of ``gpu_resource`` and running that many workers.
    - ``image``: the scheduler's and the workers' container image.
    - ``rollout_backend``: "vllm" lets the workers start the engines' processes
      (``distributed.worker.daemon: false``).
    - ``worker_resources``, ``scheduler_resources``: the containers' other requests and
      limits (e.g. ``{"cpu": "16", "memory": "128Gi"}``), set as both.
    - ``dram_size``: the in-memory ``/dev/shm`` of a worker pod, the DRAM tier's room.
    - ``nvme_volume``, ``shared_volume``: pod volume sources (e.g. ``{"hostPath": {"path":
      "/mnt/nvme/plexrl"}}``, ``{"persistentVolumeClaim": {"claimName": "runs"}}``); the
      NVMe tier defaults to an ``emptyDir``, the shared volume to none.
    - ``env``: more environment for every container (e.g. ``DASK_PLEXRL__...`` settings).
    - ``idle_timeout``: seconds after which the operator removes an idle cluster (0: never).

    :class:`~plexrl_dask.errors.ConfigError` for a value the operator or PlexRL would refuse.
    """
    from plexrl_dask.service.registry import BACKEND_NAMES

    if not isinstance(name, str) or not _NAME.match(name):
        raise ConfigError(
            f"name must be 1-40 lowercase letters, digits or '-', not at an end: {name!r}"
        )
    for label, value in (("gpus", gpus), ("gpus_per_pod", gpus_per_pod)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(f"{label} must be an integer >= 1, got {value!r}")
    if gpus % gpus_per_pod:
        raise ConfigError(f"gpus ({gpus}) must be a multiple of gpus_per_pod ({gpus_per_pod})")
    if rollout_backend not in BACKEND_NAMES:
        raise ConfigError(f"rollout_backend is one of {BACKEND_NAMES}, got {rollout_backend!r}")
    if not isinstance(image, str) or not image:
        raise ConfigError(f"image must name a container image, got {image!r}")
    if not isinstance(idle_timeout, int) or idle_timeout < 0:
        raise ConfigError(f"idle_timeout must be an integer >= 0, got {idle_timeout!r}")
    if not isinstance(dram_size, str) or not _QUANTITY.match(dram_size):
        raise ConfigError(f"dram_size must be a Kubernetes quantity like '16Gi', got {dram_size!r}")
    if not shared_path.startswith("/"):
        raise ConfigError(f"shared_path must be absolute, got {shared_path!r}")

    common = dict(env or {})
    worker_env = {
        "DASK_PLEXRL__STATE__NVME_PATH": NVME_MOUNT,
        # (stated, not "auto": a memory-backed emptyDir may report the machine's memory)
        "DASK_PLEXRL__STATE__DRAM_CAPACITY": str(int(parse_bytes(dram_size) * DRAM_SHARE)),
        **common,
    }
    if rollout_backend == "vllm":
        worker_env["DASK_DISTRIBUTED__WORKER__DAEMON"] = "False"
    worker_args = [
        "dask", "worker",
        "--name", "$(DASK_WORKER_NAME)",
        "--nthreads", "1",
        "--resources", f"{config.get('worker.gpu-resource')}=1",
    ]  # fmt: skip
    ports = []
    if gpus_per_pod == 1:
        worker_args += ["--dashboard-address", str(WORKER_DASHBOARD_PORT)]
        ports = [
            {"name": "http-dashboard", "containerPort": WORKER_DASHBOARD_PORT, "protocol": "TCP"}
        ]
    else:  # several workers: each its own dashboard port, and its own GPU
        worker_args += ["--nworkers", str(gpus_per_pod), "--preload-nanny", GPU_NANNY]
    limits = {**(worker_resources or {}), gpu_resource: str(gpus_per_pod)}
    mounts = [
        {"name": "plexrl-dram", "mountPath": "/dev/shm"},
        {"name": "plexrl-nvme", "mountPath": NVME_MOUNT},
    ]
    volumes = [
        {"name": "plexrl-dram", "emptyDir": {"medium": "Memory", "sizeLimit": dram_size}},
        {"name": "plexrl-nvme", **dict(nvme_volume or {"emptyDir": {}})},
    ]
    if shared_volume is not None:
        mounts.append({"name": "plexrl-shared", "mountPath": shared_path})
        volumes.append({"name": "plexrl-shared", **dict(shared_volume)})
    worker = {
        "replicas": gpus // gpus_per_pod,
        "spec": {
            "containers": [
                {
                    "name": "worker",
                    "image": image,
                    "args": worker_args,
                    "env": _env(worker_env),
                    "resources": {"limits": limits, "requests": dict(limits)},
                    "ports": ports,
                    "volumeMounts": mounts,
                }
            ],
            "volumes": volumes,
        },
    }
    sched_limits = dict(scheduler_resources or {})

    def probe(**timing: int) -> dict[str, Any]:
        return {"httpGet": {"port": "http-dashboard", "path": "/health"}, **timing}

    scheduler = {
        "spec": {
            "containers": [
                {
                    "name": "scheduler",
                    "image": image,
                    "args": ["dask", "scheduler", "--host", "0.0.0.0", "--preload", PRELOAD],
                    "env": _env(common),
                    "resources": {"limits": sched_limits, "requests": dict(sched_limits)},
                    "ports": [
                        {"name": "tcp-comm", "containerPort": SCHEDULER_PORT, "protocol": "TCP"},
                        {
                            "name": "http-dashboard",
                            "containerPort": DASHBOARD_PORT,
                            "protocol": "TCP",
                        },
                    ],
                    "readinessProbe": probe(periodSeconds=1, timeoutSeconds=300),
                    "livenessProbe": probe(initialDelaySeconds=15, periodSeconds=20),
                }
            ]
        },
        "service": {
            "type": "ClusterIP",
            "selector": {"dask.org/cluster-name": name, "dask.org/component": "scheduler"},
            "ports": [
                {
                    "name": "tcp-comm",
                    "protocol": "TCP",
                    "port": SCHEDULER_PORT,
                    "targetPort": "tcp-comm",
                },
                {
                    "name": "http-dashboard",
                    "protocol": "TCP",
                    "port": DASHBOARD_PORT,
                    "targetPort": "http-dashboard",
                },
            ],  # fmt: skip
        },
    }
    return {
        "apiVersion": API_VERSION,
        "kind": "DaskCluster",
        "metadata": {"name": name, "labels": {"app.kubernetes.io/part-of": "plexrl"}},
        "spec": {"idleTimeout": idle_timeout, "worker": worker, "scheduler": scheduler},
    }
