"""PlexRL on Kubernetes: the ``DaskCluster`` resource of the Dask Kubernetes operator.

:func:`kube_cluster_spec` builds the custom resource (``apiVersion: kubernetes.dask.org/v1``)
of a PlexRL cluster: a scheduler pod that preloads the PlexRL plugins and a worker group of
pods with GPUs, one PlexRL worker per GPU. Apply it with ``kubectl apply -f`` (``plexrl
kube-spec`` prints it as YAML) or hand it to dask-kubernetes: ``KubeCluster(
custom_cluster_spec=kube_cluster_spec(...))``. The operator makes each worker pod through a
Deployment of its own and gives its container ``DASK_SCHEDULER_ADDRESS`` (the scheduler's
service) and ``DASK_WORKER_NAME`` (that Deployment's name, kept by a pod that replaces
another), which the commands below use.

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
  :mod:`plexrl_dask.gpu_nanny`, which gives each worker one of the pod's GPUs. Each worker's
  Dask memory limit is its share of the pod's memory less the DRAM tier's room, which the
  same cgroup is charged for. **A cluster of such pods has a fixed size:** the operator
  scales down by retiring *workers* and deleting the Deployments named after them, which
  exist only for pods of one worker (``gpus_per_pod=1``), so do not scale or autoscale it.
- **A shared volume** (``shared_volume`` mounted at ``shared_path``, e.g. a ReadWriteMany
  claim) for job checkpoint directories, which the driver and the workers must both reach.

**TLS** (``tls_secret``). Whoever reaches a Dask scheduler can run code on its workers, so on
a cluster others share the comms should be TLS: :func:`kube_tls_secret` makes a Kubernetes
``Secret`` of a certificate made for the cluster (``Security.temporary()``), the spec mounts
it read-only at :data:`TLS_MOUNT` in every pod, the scheduler listens on ``tls://`` only and
every process requires encryption; the workers join ``tls://<name>-scheduler:8786`` (the
operator's own ``DASK_SCHEDULER_ADDRESS`` says ``tcp://``). A client needs the same
certificate: ``plexrl kube-spec`` (TLS by default) writes the client's copy under
``--tls-dir`` and prints the ``Secret`` before the cluster. The operator manages a cluster
over the scheduler's comms, without the certificate: a TLS cluster has no idle timeout and is
not scaled through the operator (make a new one of another size).

The image must hold this package and its dependencies (and vLLM for ``rollout_backend=
"vllm"``); a driver run in a pod (``examples/multiplex.py --scheduler``) needs the repository's
``examples/`` too. ``tests/test_kubernetes.py`` starts the resource's scheduler and worker commands as
local processes, environments included, and runs PlexRL on them; no Kubernetes cluster was
available to apply it to.
"""

from __future__ import annotations

import base64
import re
from collections.abc import Mapping
from typing import Any

from dask.utils import parse_bytes
from distributed.security import Security

from plexrl_dask import config
from plexrl_dask.cluster import (
    GPU_NANNY,
    PRELOAD,
    TRIM_CONFIG_ENV,
    one_certificate,
    tls_environment,
)
from plexrl_dask.errors import ConfigError
from plexrl_dask.shared.records import BACKEND_NAMES

API_VERSION = "kubernetes.dask.org/v1"
#: The ports the operator's scheduler service targets by name.
SCHEDULER_PORT, DASHBOARD_PORT, WORKER_DASHBOARD_PORT = 8786, 8787, 8788
#: Where a worker pod mounts its NVMe tier.
NVME_MOUNT = "/plexrl/nvme"
#: Where every pod mounts the cluster's TLS secret (its keys are the files' names).
TLS_MOUNT = "/plexrl/tls"
TLS_FILES = {"ca": "ca.crt", "cert": "tls.crt", "key": "tls.key"}
#: The operator names the scheduler's Service "<name>-scheduler" (a DNS-1035 label: a letter
#: first) and each worker's Deployment "<name>-default-worker-<10 hex digits>" (26 more
#: characters; a label holds 63).
_NAME = re.compile(r"^[a-z]([-a-z0-9]{0,35}[a-z0-9])?$")
#: A Kubernetes quantity of bytes, e.g. "16Gi" (not "16GiB"), up to peta.
_QUANTITY = re.compile(r"^[0-9]+(\.[0-9]+)?(Ki|Mi|Gi|Ti|Pi|k|M|G|T|P)?$")
#: The DRAM tier's directory inside the pod's /dev/shm (stated, not derived from the user name:
#: an image may run as a user id without a name).
DRAM_PATH = "/dev/shm/plexrl-dram"
#: Of the in-memory /dev/shm, the share the DRAM tier may fill (the rest: torch's own shared
#: memory, and a margin before the kubelet evicts a pod over its volume's size limit).
DRAM_SHARE = 0.9


#: A Secret's name: a DNS-1123 subdomain.
_SECRET = re.compile(r"^[a-z0-9]([-.a-z0-9]{0,251}[a-z0-9])?$")


def _tls_environment() -> dict[str, str]:
    """Every pod's Dask TLS settings: the mounted secret's files for each role (scheduler,
    worker, and the client each process opens), encryption required."""
    security = one_certificate(*(f"{TLS_MOUNT}/{TLS_FILES[f]}" for f in ("ca", "cert", "key")))
    return {**tls_environment(security, "scheduler"), **tls_environment(security, "worker")}


def kube_tls_secret(name: str, security: Security | None = None) -> tuple[dict[str, Any], Security]:
    """The ``Secret`` manifest ``name`` (type ``kubernetes.io/tls``: ``tls.crt``, ``tls.key``
    and ``ca.crt``) of a certificate for a cluster, and the ``Security`` a client connects
    with (write it for another process with
    :func:`~plexrl_dask.cluster.save_client_credentials`). ``security``: one whose CA,
    certificate and key are PEM text (default: a new ``Security.temporary()``, a
    self-signed certificate that is its own CA)."""
    if not isinstance(name, str) or not _SECRET.match(name):
        raise ConfigError(f"a Secret's name is a DNS subdomain, got {name!r}")
    security = security or Security.temporary()
    pem = {
        TLS_FILES["ca"]: security.tls_ca_file,
        TLS_FILES["cert"]: security.tls_scheduler_cert,
        TLS_FILES["key"]: security.tls_scheduler_key,
    }
    if not all(isinstance(v, str) and "-----BEGIN" in v for v in pem.values()):
        raise ConfigError("kube_tls_secret needs a Security holding PEM text (its CA, cert, key)")
    data = {k: base64.b64encode(v.encode()).decode() for k, v in pem.items()}
    manifest = {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {"name": name, "labels": {"app.kubernetes.io/part-of": "plexrl"}},
        "type": "kubernetes.io/tls",
        "data": data,
    }
    return manifest, security


def _quantity(label: str, value: object) -> int:
    """Bytes of a Kubernetes quantity (ConfigError unless a positive one)."""
    if not isinstance(value, str) or not _QUANTITY.match(value) or parse_bytes(value) <= 0:
        raise ConfigError(f"{label} must be a Kubernetes quantity like '16Gi', got {value!r}")
    return parse_bytes(value)


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
    tls_secret: str | None = None,
) -> dict[str, Any]:
    """The ``DaskCluster`` resource of a PlexRL cluster of ``gpus`` GPUs (module docstring).

    - ``name``: the cluster's name (lowercase letters, digits and ``-``, a letter first, at
      most 37).
    - ``gpus``, ``gpus_per_pod``: ``gpus / gpus_per_pod`` worker pods (it must divide), each
      asking for ``gpus_per_pod`` of ``gpu_resource`` and running that many workers.
    - ``image``: the scheduler's and the workers' container image.
    - ``rollout_backend``: "vllm" lets the workers start the engines' processes
      (``distributed.worker.daemon: false``).
    - ``worker_resources``, ``scheduler_resources``: the containers' other requests and
      limits (e.g. ``{"cpu": "16", "memory": "128Gi"}``), set as both.
    - ``dram_size``: the in-memory ``/dev/shm`` of a worker pod, the DRAM tier's room.
    - ``nvme_volume``, ``shared_volume``: pod volume sources. The NVMe tier's must be the
      pod's alone (a ``hostPath`` such as ``{"hostPath": {"path": "/mnt/nvme/plexrl"}}`` only
      where one worker pod runs per machine; by default an ``emptyDir``); the shared one is
      mounted on every worker pod (e.g. ``{"persistentVolumeClaim": {"claimName": "runs"}}``
      of a ReadWriteMany claim; by default none).
    - ``env``: more environment for every container (e.g. ``DASK_PLEXRL__...`` settings).
      Every container also gets this process's PlexRL settings that differ from the defaults
      (:func:`~plexrl_dask.config.shipped_settings`; not the operator secret: give the
      scheduler pod that from a Kubernetes ``Secret`` through ``env``'s valueFrom or its
      image); a worker pod's tier paths and DRAM capacity are the spec's own.
    - ``idle_timeout``: seconds after which the operator removes an idle cluster (0: never).
    - ``tls_secret``: the name of a ``Secret`` of the cluster's certificate
      (:func:`kube_tls_secret`): every pod's comms are then TLS only (module docstring).
      None: plain TCP, for a network no one else reaches.

    :class:`~plexrl_dask.errors.ConfigError` for a value the operator or PlexRL would refuse.
    """

    if not isinstance(name, str) or not _NAME.match(name):
        raise ConfigError(
            "name must be 1-37 lowercase letters, digits or '-', a letter first and no '-' "
            f"last: {name!r}"
        )
    config.count("gpus", gpus)
    config.count("gpus_per_pod", gpus_per_pod)
    if gpus % gpus_per_pod:
        raise ConfigError(f"gpus ({gpus}) must be a multiple of gpus_per_pod ({gpus_per_pod})")
    if rollout_backend not in BACKEND_NAMES:
        raise ConfigError(f"rollout_backend is one of {BACKEND_NAMES}, got {rollout_backend!r}")
    if not isinstance(image, str) or not image:
        raise ConfigError(f"image must name a container image, got {image!r}")
    if isinstance(idle_timeout, bool) or not isinstance(idle_timeout, int) or idle_timeout < 0:
        raise ConfigError(f"idle_timeout must be an integer >= 0, got {idle_timeout!r}")
    dram_bytes = _quantity("dram_size", dram_size)
    if not isinstance(shared_path, str) or not shared_path.startswith("/"):
        raise ConfigError(f"shared_path must be an absolute path, got {shared_path!r}")
    if any(
        shared_path == p or shared_path.startswith(p + "/") or p.startswith(shared_path + "/")
        for p in ("/dev/shm", NVME_MOUNT)
    ):
        raise ConfigError(f"shared_path {shared_path!r} overlaps the tiers' mounts")
    for label, volume in (("nvme_volume", nvme_volume), ("shared_volume", shared_volume)):
        if volume is not None and (not isinstance(volume, Mapping) or "name" in volume):
            raise ConfigError(f"{label} is a pod volume's source, without a name: {volume!r}")
    if tls_secret is not None and not (isinstance(tls_secret, str) and _SECRET.match(tls_secret)):
        raise ConfigError(f"tls_secret must name a Kubernetes Secret, got {tls_secret!r}")
    if tls_secret is not None and idle_timeout:
        # (the operator asks the scheduler whether it is idle over its comms, without the
        # certificate)
        raise ConfigError("idle_timeout needs plain comms: the operator cannot reach a TLS one")
    memory_limit = None
    if worker_resources and "memory" in worker_resources:
        room = _quantity("worker_resources['memory']", worker_resources["memory"]) - dram_bytes
        if room <= 0:
            raise ConfigError(
                f"a worker pod's memory ({worker_resources['memory']}) must exceed its "
                f"dram_size ({dram_size}), which the pod's memory limit includes"
            )
        memory_limit = room // gpus_per_pod

    # (this process's PlexRL settings, where they differ from the defaults; ``env`` wins)
    common = {**config.shipped_settings(), **(env or {})}
    tls = {} if tls_secret is None else _tls_environment()
    worker_env = {
        **common,
        **tls,
        "DASK_PLEXRL__STATE__DRAM_PATH": DRAM_PATH,
        # (stated, not "auto": a memory-backed emptyDir may report the machine's memory)
        "DASK_PLEXRL__STATE__DRAM_CAPACITY": str(int(dram_bytes * DRAM_SHARE)),
        "DASK_PLEXRL__STATE__NVME_PATH": NVME_MOUNT,
        # (Dask's MALLOC_TRIM_THRESHOLD_ turns off glibc's adaptive mmap threshold: training
        # ran 1.2-2x slower under it; None drops it from the worker's environment)
        TRIM_CONFIG_ENV: "None",
        **(env or {}),
    }
    if rollout_backend == "vllm":
        worker_env["DASK_DISTRIBUTED__WORKER__DAEMON"] = "False"
    # (with TLS, the scheduler's service by a tls:// address: the operator's says tcp://)
    address = () if tls_secret is None else (f"tls://{name}-scheduler:{SCHEDULER_PORT}",)
    worker_args = [
        "dask", "worker", *address,
        "--name", "$(DASK_WORKER_NAME)",
        "--nthreads", "1",
        "--resources", f"{config.get('worker.gpu-resource')}=1",
        *(("--memory-limit", str(memory_limit)) if memory_limit is not None else ()),
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
    tls_mounts, tls_volumes = [], []
    if tls_secret is not None:
        tls_mounts = [{"name": "plexrl-tls", "mountPath": TLS_MOUNT, "readOnly": True}]
        # (0444: any user the image runs as reads it; the pod is the boundary)
        secret = {"secretName": tls_secret, "defaultMode": 0o444}
        tls_volumes = [{"name": "plexrl-tls", "secret": secret}]
        mounts += tls_mounts
        volumes += tls_volumes
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
                    "args": [
                        "dask", "scheduler", "--host", "0.0.0.0", "--preload", PRELOAD,
                        *(() if tls_secret is None else ("--protocol", "tls")),
                    ],  # fmt: skip
                    "env": _env({**common, **tls}),
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
                    **({"volumeMounts": tls_mounts} if tls_mounts else {}),
                }
            ],
            **({"volumes": tls_volumes} if tls_volumes else {}),
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
