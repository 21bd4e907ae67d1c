"""Starting PlexRL on a cluster: a local one, or an existing one.

``local_cluster()`` is the embedded default (docs/deploying.md, "Local cluster"): a process ``LocalCluster`` on
127.0.0.1 whose workers advertise the GPU resource and whose scheduler preloads the PlexRL
plugins, exactly as a shared cluster would with ``dask scheduler --preload plexrl_dask.plugins``.
``install(client)`` adds the plugins to a running cluster instead. On SLURM (and other job
queues, through dask-jobqueue): :mod:`plexrl_dask.slurm`.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import dask.config
from dask.utils import parse_bytes
from distributed import Client, LocalCluster, Nanny, Security, Worker

from plexrl_dask import config
from plexrl_dask.errors import ConfigError, SchedulerNotStarted

logger = logging.getLogger(__name__)

PRELOAD = "plexrl_dask.plugins"
#: The nanny preload that gives each worker of a machine with several GPUs one of them.
GPU_NANNY = "plexrl_dask.gpu_nanny"
TRIM_ENV = "MALLOC_TRIM_THRESHOLD_"
TRIM_ENV_KEY = f"distributed.nanny.pre-spawn-environ.{TRIM_ENV}"
#: The environment variable that sets that key in a worker's config ("None": no threshold).
TRIM_CONFIG_ENV = f"DASK_DISTRIBUTED__NANNY__PRE_SPAWN_ENVIRON__{TRIM_ENV}"
CUDA_ENV = "CUDA_VISIBLE_DEVICES"
#: The cores a worker process binds its threads to (a list such as ``"3"`` or ``"4-7,12"``),
#: read by the worker plugin (:func:`plexrl_dask.worker.device.bind_cpus`); any launcher may
#: set it per worker, ``local_cluster`` does (:func:`cpus_of_worker`).
CPUS_ENV = "PLEXRL_WORKER_CPUS"
#: The model stack and the store: what workers and drivers import, and a scheduler never needs
#: (docs/architecture.md, "The scheduler stays lean"; ``bench.scheduler`` and a test check it).
MODEL_STACK = ("torch", "transformers", "tokenizers", "zarr")


def local_cluster(
    n_workers: int | None = None,
    threads_per_worker: int | None = None,
    memory_limit: str | int | None = None,
    processes: bool = True,
    dashboard_address: str | None = ":0",
    tool_workers: int | None = None,
    **kwargs: Any,
) -> LocalCluster:
    """A ``LocalCluster`` of PlexRL workers (each advertising one unit of the GPU resource).

    Defaults come from ``plexrl.local-cluster.*``. It binds to 127.0.0.1 on free ports; the
    dashboard too (``cluster.dashboard_link``).

    The workers form one node: unless ``plexrl.state.dram-path`` / ``nvme-path`` are set, the
    cluster gets its own DRAM tier (on ``/dev/shm``) and NVMe tier (in the temp dir), whose
    StateManager it stops and whose files it removes when it closes
    (``cluster.plexrl_state``: the paths).

    ``tool_workers`` (default ``plexrl.local-cluster.tool-workers``) more workers without the
    GPU resource run agentic jobs' tool calls (:mod:`plexrl_dask.tools.pool`), named
    ``tool-0``, ..., each with ``plexrl.local-cluster.tool-threads`` threads (calls at once)
    and bound to the cores ``plexrl.local-cluster.tool-cpus`` lists, if it does
    (:func:`tool_cpus`); a later ``cluster.scale(n)`` counts them among its workers.
    """
    gpu = str(config.get("worker.gpu-resource"))
    resources = {gpu: 1, **kwargs.pop("resources", {})}
    scheduler_kwargs = dict(kwargs.pop("scheduler_kwargs", {}))
    scheduler_kwargs["preload"] = [*scheduler_kwargs.get("preload", []), PRELOAD]
    # Every setting checked before anything starts (a bad one leaves no tier or process).
    limit = memory_limit if memory_limit is not None else config.get("local-cluster.memory-limit")
    try:
        limit = parse_bytes(limit) if isinstance(limit, str) else limit
    except ValueError as e:
        raise ConfigError(f"plexrl.local-cluster.memory-limit: {e}") from None
    if n_workers is None:
        n_workers = config.get("local-cluster.n-workers")
    n_workers = config.count("n_workers", n_workers)
    if tool_workers is None:
        tool_workers = config.get("local-cluster.tool-workers")
    if isinstance(tool_workers, bool) or not isinstance(tool_workers, int) or tool_workers < 0:
        raise ConfigError(f"tool_workers is a count >= 0, got {tool_workers!r}")
    tool_cores = tool_cpus(processes) if tool_workers else None
    tool_threads = config.count(
        "plexrl.local-cluster.tool-threads", config.get("local-cluster.tool-threads")
    )
    if threads_per_worker is None:
        threads_per_worker = config.get("local-cluster.threads-per-worker")
    threads_per_worker = config.count("threads_per_worker", threads_per_worker)
    # Dask sets MALLOC_TRIM_THRESHOLD_ in worker processes; an explicit threshold turns off
    # glibc's adaptive mmap threshold, so every large tensor allocation is a fresh mmap and page
    # faults: torch training ran 1.2-2x slower in such a worker (benchmarks/RESULTS.md). Nannies
    # read this when they are created, so it also holds for their restarts.
    _drop_leaked_trim_threshold()
    tiers = _private_tiers() if processes else {}
    if tiers:
        # Nannies merge this over their Dask config one top-level key deep: pass the whole
        # (current) plexrl namespace, or settings made with dask.config.set would be lost.
        kwargs["config"] = dask.config.merge(
            {"plexrl": dask.config.get("plexrl")},
            kwargs.pop("config", None) or {},
            {"plexrl": {"state": tiers}},
        )
    if processes:
        kwargs.setdefault("worker_class", PlexRLNanny)
        if kwargs["worker_class"] is PlexRLNanny:
            kwargs.setdefault("node_workers", n_workers)
    with dask.config.set({TRIM_ENV_KEY: None}):
        cluster = PlexRLLocalCluster(
            tiers,
            n_workers=n_workers,
            threads_per_worker=threads_per_worker,
            processes=processes,
            memory_limit=limit,
            resources=resources,
            host="127.0.0.1",
            dashboard_address=dashboard_address,
            scheduler_kwargs=scheduler_kwargs,
            **kwargs,
        )
        if tool_workers:
            _add_tool_workers(cluster, tool_workers, gpu, processes, tool_threads, tool_cores)
        return cluster


def _add_tool_workers(
    cluster: LocalCluster,
    count: int,
    gpu: str,
    processes: bool,
    threads: int,
    cpus: list[int] | None = None,
) -> None:
    """``count`` workers like the cluster's others but without the GPU resource (plain
    nannies: no GPU to choose), each running ``threads`` calls at once, bound to ``cpus``
    (:func:`tool_cpus`; None: floating)."""

    if threads < 1:
        cluster.close()
        raise ConfigError(f"plexrl.local-cluster.tool-threads must be >= 1, got {threads}")
    options = dict(cluster.new_spec["options"])
    options.pop("node_workers", None)  # (not GPU workers: never bound as such)
    options["nthreads"] = threads
    if cpus is not None:
        options["env"] = {**(options.get("env") or {}), CPUS_ENV: ",".join(map(str, cpus))}
    options["resources"] = {k: v for k, v in (options.get("resources") or {}).items() if k != gpu}
    for i in range(count):
        cluster.worker_spec[f"tool-{i}"] = {
            "cls": Nanny if processes else Worker,
            "options": {**options, "name": f"tool-{i}"},
        }
    try:
        cluster.sync(cluster._correct_state)
    except BaseException:
        cluster.close()
        raise


def tool_cpus(processes: bool = True) -> list[int] | None:
    """The cores ``plexrl.local-cluster.tool-cpus`` gives the local tool workers (None: they
    float). :class:`~plexrl_dask.errors.ConfigError` for a list that does not parse, cores
    this process may not use, or a cluster of threads (binding would bind the caller)."""
    listed = config.get("local-cluster.tool-cpus")
    if listed is None:
        return None
    try:
        cpus = parse_cpus(str(listed))
    except ConfigError as e:
        raise ConfigError(f"plexrl.local-cluster.tool-cpus: {e}") from e
    if not hasattr(os, "sched_getaffinity"):
        raise ConfigError("plexrl.local-cluster.tool-cpus needs Linux")
    if not set(cpus) <= os.sched_getaffinity(0):
        raise ConfigError(
            f"plexrl.local-cluster.tool-cpus {listed!r}: not among this process's cores "
            f"{sorted(os.sched_getaffinity(0))}"
        )
    if not processes:
        raise ConfigError("plexrl.local-cluster.tool-cpus binds worker processes: processes=True")
    return cpus


class PlexRLLocalCluster(LocalCluster):
    """A ``LocalCluster`` that owns the node tiers it made for its workers (see
    :func:`local_cluster`)."""

    def __init__(self, plexrl_state: dict[str, str], *args: Any, **kwargs: Any) -> None:
        self.plexrl_state = plexrl_state
        super().__init__(*args, **kwargs)

    async def _close(self) -> None:
        try:
            await super()._close()
        finally:
            if self.plexrl_state:
                _remove_tiers(self.plexrl_state)


def worker_info(client: Client) -> dict[str, dict[str, Any]]:
    """Every worker the scheduler has now: address -> its identity (name, resources, ...).

    Read from the scheduler, not from ``worker_info(client)``: a distributed
    2026 client refreshes that cached identity every few seconds *without* its workers (only
    cluster totals), so a call that reads it just after such a refresh sees none."""
    return dict(client.sync(client.scheduler.identity, n_workers=-1)["workers"])


def visible_gpus() -> list[str]:
    """The GPUs this process may hand to local workers: the entries of its own
    ``CUDA_VISIBLE_DEVICES`` when set, else every device CUDA reports; none when
    ``plexrl.worker.device`` is "cpu" or torch has no CUDA (the workers then run on the CPU,
    whatever the variable says)."""
    import torch

    if str(config.get("worker.device")) == "cpu" or not torch.cuda.is_available():
        return []
    listed = os.environ.get(CUDA_ENV)
    if listed is not None:
        return [d.strip() for d in listed.split(",") if d.strip()]
    return [str(i) for i in range(torch.cuda.device_count())]


class PlexRLNanny(Nanny):
    """The nanny of a local PlexRL worker: on a node with more than one GPU, its worker sees
    one of them, chosen by the worker's name (``local_cluster`` names them 0, 1, ...), through
    ``CUDA_VISIBLE_DEVICES``.

    Every worker holds one unit of the GPU resource and puts its replicas on the device it
    calls "cuda", so without this every worker of the node would share GPU 0 (and an NCCL
    group of two of them would hold one GPU twice). Hiding the others, as one process per GPU
    is launched elsewhere, also keeps FSDP2 and the object collectives, which use the
    current device, on the worker's GPU. A name past the GPU count wraps around (scaling a
    cluster beyond its GPUs shares them); an explicit ``env={"CUDA_VISIBLE_DEVICES": ...}``
    is left as given.

    With ``node_workers`` (the node's GPU workers, as ``local_cluster`` starts them) and
    ``plexrl.local-cluster.bind-cpus`` on, its worker's threads are bound to cores of their own
    (:func:`cpus_of_worker`, through :data:`CPUS_ENV`); an explicit ``env`` entry stands."""

    def __init__(
        self,
        *args: Any,
        env: dict[str, str] | None = None,
        node_workers: int | None = None,
        **kwargs: Any,
    ) -> None:
        gpus = visible_gpus()
        name = kwargs.get("name")
        gpu = gpu_of_worker(name, gpus)
        env = dict(env or {})
        if gpu is not None and CUDA_ENV not in env:
            env[CUDA_ENV] = gpu
            logger.info("local worker %s gets GPU %s of %s", name, gpu, gpus)
        if node_workers and CPUS_ENV not in env and config.get("local-cluster.bind-cpus"):
            cpus = cpus_of_worker(
                name, node_workers, sorted(os.sched_getaffinity(0)), _torch_threads()
            )
            if cpus is not None:
                env[CPUS_ENV] = ",".join(map(str, cpus))
        super().__init__(*args, env=env or None, **kwargs)


def _torch_threads() -> int:
    return int(config.get("worker.torch-threads"))


def cpus_of_worker(
    name: object, workers: int, cpus: Sequence[int], threads: int
) -> list[int] | None:
    """The cores of the worker called ``name`` (numbered as :func:`gpu_of_worker` reads it)
    among a node's ``workers`` GPU workers, ``cpus`` being the cores the node may use and
    ``threads`` each worker's torch threads: worker ``k`` gets ``threads`` cores of its own,
    counted from the last, and the launcher's own processes (a local cluster's driver and
    scheduler, its tool workers) float over all of them. None (leave it unbound) unless the
    workers leave at least one core to the rest, or for a name without a number or past the
    count.

    Why bind: a worker's request thread and its event loop share the GIL, which passes
    between them at every torch call; over two cores each hand-off is a cross-core wake-up,
    and the request thread is moved to whichever core the kernel picks. Why only with a core
    to spare: with every core bound, the driver and the scheduler can only take a worker's,
    and a worker's event loop can no longer run beside its requests (``bench.grpo``, in
    benchmarks/RESULTS.md: one worker bound on two cores ran the mix's steps 1.09x faster;
    two bound on two cores ran the pool 1.15x slower)."""
    index = _worker_index(name)
    if threads < 1 or workers * threads >= len(cpus) or index is None or not 0 <= index < workers:
        return None
    end = len(cpus) - index * threads
    return sorted(cpus[end - threads : end])


def parse_cpus(text: str) -> list[int]:
    """The cores of a list such as ``"3"``, ``"0-3,8"`` (what ``taskset -c`` takes).
    :class:`~plexrl_dask.errors.ConfigError` for anything else."""
    cores: set[int] = set()
    try:
        for part in text.split(","):
            first, dash, last = part.strip().partition("-")
            lo = int(first)
            hi = int(last) if dash else lo
            if lo < 0 or hi < lo:
                raise ValueError(part)
            cores.update(range(lo, hi + 1))
    except ValueError as e:
        raise ConfigError(f"{CPUS_ENV} must list cores such as '0-3,8', got {text!r}") from e
    return sorted(cores)


def gpu_of_worker(name: object, gpus: Sequence[str]) -> str | None:
    """The GPU (an entry of ``gpus``, the node's visible devices) of the worker called
    ``name``, for a node that runs one worker per GPU: worker ``k`` gets ``gpus[k % len]``,
    ``k`` being the name itself (an int, as ``local_cluster`` names them) or its last
    ``-``-separated part (``dask worker --nworkers N --name X`` names them ``X-0`` ...
    ``X-{N-1}``). None (leave the worker all of them) with fewer than two GPUs or a name
    without such a number."""
    index = _worker_index(name)
    if len(gpus) < 2 or index is None:
        return None
    return gpus[index % len(gpus)]


def _worker_index(name: object) -> int | None:
    """``k`` of a worker named ``k`` (an int) or ``X-k``; None for any other name."""
    if isinstance(name, int) and not isinstance(name, bool):
        return name
    if isinstance(name, str) and name.rpartition("-")[2].isdecimal():
        return int(name.rpartition("-")[2])
    return None


def _private_tiers() -> dict[str, str]:
    """Fresh DRAM and NVMe tier paths for one local cluster, unless configured."""
    tiers = {}
    if config.get("state.dram-path") == "auto":
        shm = Path("/dev/shm")
        base = shm if shm.is_dir() and os.access(shm, os.W_OK) else Path(tempfile.gettempdir())
        tiers["dram-path"] = str(base / f"plexrl-dram-{uuid.uuid4().hex[:12]}")
    if config.get("state.nvme-path") == "auto":
        tiers["nvme-path"] = tempfile.mkdtemp(prefix="plexrl-nvme-")
    return tiers


def _remove_tiers(tiers: dict[str, str]) -> None:
    """Stop the tiers' manager (if one runs) and delete what the cluster made."""
    from plexrl_dask.state_store.node import NodeState, StateConfig

    try:
        NodeState(StateConfig.for_tiers(tiers)).shutdown()
    except Exception:  # cleanup must not mask the close
        logger.warning("could not stop the local cluster's StateManager", exc_info=True)
    for path in tiers.values():
        shutil.rmtree(path, ignore_errors=True)


def _drop_leaked_trim_threshold() -> None:
    """Dask's nannies write their pre-spawn environment into *this* process's ``os.environ``
    before spawning, so after any other LocalCluster in this process every later worker
    inherits ``MALLOC_TRIM_THRESHOLD_`` whatever its own config says. Remove it when it holds
    exactly Dask's default (the leak), not a value someone chose."""
    leaked = dask.config.get(TRIM_ENV_KEY, default=None)
    if leaked is not None and os.environ.get(TRIM_ENV) == str(leaked):
        del os.environ[TRIM_ENV]
        logger.info("removed %s=%s left in this process by another Dask nanny", TRIM_ENV, leaked)


#: ``Security`` attributes and the Dask settings a ``dask scheduler`` / ``dask worker`` process
#: reads them from (``distributed.security.Security`` reads the same keys): what every role
#: shares, then each role's own certificate and key.
_TLS_SHARED = {
    "tls_ca_file": "DISTRIBUTED__COMM__TLS__CA_FILE",
    "tls_ciphers": "DISTRIBUTED__COMM__TLS__CIPHERS",
}
_TLS_ROLE = {
    role: {
        f"tls_{role}_cert": f"DISTRIBUTED__COMM__TLS__{role.upper()}__CERT",
        f"tls_{role}_key": f"DISTRIBUTED__COMM__TLS__{role.upper()}__KEY",
    }
    for role in ("scheduler", "worker", "client")
}
_TLS_VERSIONS = {ssl.TLSVersion.TLSv1_2: "1.2", ssl.TLSVersion.TLSv1_3: "1.3"}


def tls_environment(security: Security | None, role: str) -> dict[str, str]:
    """The environment variables that give a ``dask scheduler`` (``role="scheduler"``) or
    ``dask worker`` (``role="worker"``) process started from here the TLS settings of
    ``security`` that its role uses: the CA, ciphers and TLS versions, its role's certificate
    and key, the client role's where ``security`` has them (for clients the process opens),
    and whether encryption is required. Values are as ``Security`` holds them: file paths, or
    the PEM text itself (``Security.temporary()``), which Dask writes to a temporary file of
    its own while it builds a TLS context. Empty for None or a ``Security`` without TLS.
    The environment is readable by the same user, and inherited by the process's children."""
    if role not in ("scheduler", "worker"):
        raise ConfigError(f"role is 'scheduler' or 'worker', got {role!r}")
    if security is None or not security.tls_ca_file:
        return {}
    settings = {**_TLS_SHARED, **_TLS_ROLE[role], **_TLS_ROLE["client"]}
    env = {
        f"DASK_{name}": str(value)
        for attr, name in settings.items()
        if (value := getattr(security, attr, None))
    }
    for attr in ("tls_min_version", "tls_max_version"):
        version = getattr(security, attr, None)
        if version is not None:
            if version not in _TLS_VERSIONS:
                raise ConfigError(f"{attr} {version!r} is not one Dask's settings can name")
            env[f"DASK_DISTRIBUTED__COMM__TLS__{attr[4:].upper()}"] = _TLS_VERSIONS[version]
    env["DASK_DISTRIBUTED__COMM__REQUIRE_ENCRYPTION"] = str(bool(security.require_encryption))
    return env


#: The files :func:`save_client_credentials` writes: the CA, the client's certificate, its key.
_CREDENTIALS = {
    "tls_ca_file": "ca.pem",
    "tls_client_cert": "client.pem",
    "tls_client_key": "client-key.pem",
}


def save_client_credentials(security: Security, directory: str | os.PathLike[str]) -> Path:
    """Write what a client in another process needs to reach a cluster of ``security`` (its
    CA, and the client's certificate and key: PEM text, as ``Security.temporary()`` holds
    them, or files, copied) into ``directory``, made readable by this user only; returns it.
    Read back with :func:`client_security`. :class:`ConfigError` for a ``security`` without
    a client certificate."""
    values = {attr: getattr(security, attr, None) for attr in _CREDENTIALS}
    if not all(values.values()):
        raise ConfigError("save_client_credentials needs a Security with a CA and a client key")
    root = Path(directory).expanduser()
    root.mkdir(mode=0o700, parents=True, exist_ok=True)
    root.chmod(0o700)
    for attr, name in _CREDENTIALS.items():
        value = str(values[attr])
        text = value if "\n" in value else Path(value).read_text()
        # (each file whole or not at all: written beside, then moved into place)
        part = root / f".{name}.part"
        fd = os.open(part, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(part, root / name)
    return root


def one_certificate(ca: str, cert: str, key: str) -> Security:
    """A ``Security`` (encryption required) whose every role, scheduler, worker and client,
    presents the certificate ``cert`` with its ``key`` under the CA ``ca`` (each a file's
    path, or PEM text), as a ``Security.temporary()`` cluster's do."""
    roles = {f"tls_{role}_cert": cert for role in ("scheduler", "worker", "client")}
    roles.update({f"tls_{role}_key": key for role in ("scheduler", "worker", "client")})
    return Security(require_encryption=True, tls_ca_file=ca, **roles)


def client_security(directory: str | os.PathLike[str]) -> Security:
    """The ``Security`` a client connects with from the credentials
    :func:`save_client_credentials` wrote into ``directory`` (encryption required);
    :class:`ConfigError` where one of its files is missing."""
    root = Path(directory).expanduser()
    missing = [name for name in _CREDENTIALS.values() if not (root / name).is_file()]
    if missing:
        raise ConfigError(
            f"{root} holds no PlexRL client credentials: {', '.join(missing)} missing"
        )
    return Security(
        require_encryption=True, **{attr: str(root / name) for attr, name in _CREDENTIALS.items()}
    )


def worker_process(
    scheduler_address: str,
    state: Mapping[str, str] | None = None,
    host: str = "127.0.0.1",
    security: Security | None = None,
    **popen: Any,
) -> subprocess.Popen:
    """A ``dask worker`` process (one thread, no nanny, one unit of the GPU resource) joining
    ``scheduler_address`` from ``host``. ``state``: its ``plexrl.state.*`` settings, passed
    through its environment; its own ``dram-path``, ``nvme-path`` and ``node-id`` make it
    another node, as if on another host (how the tests and ``bench.weight_sync`` try weight
    sync between nodes on one machine). ``security``: the worker's TLS settings
    (:func:`tls_environment`) for a ``tls://`` scheduler. Output is discarded unless ``popen``
    says otherwise; the caller terminates the process."""
    env = {**os.environ, **tls_environment(security, "worker")}
    for key, value in (state or {}).items():
        env[f"DASK_PLEXRL__STATE__{key.upper().replace('-', '_')}"] = value
    popen.setdefault("stdout", subprocess.DEVNULL)
    popen.setdefault("stderr", subprocess.DEVNULL)
    return subprocess.Popen(
        [
            str(Path(sys.executable).parent / "dask"), "worker", scheduler_address,
            "--host", host, "--nthreads", "1", "--no-nanny",
            "--resources", f"{config.get('worker.gpu-resource')}=1",
        ],
        env=env,
        **popen,
    )  # fmt: skip


@contextlib.contextmanager
def scheduler_process(
    directory: str | os.PathLike[str],
    preload: bool = True,
    timeout: float = 60.0,
    security: Security | None = None,
) -> Iterator[dict[str, Any]]:
    """A ``dask scheduler`` process on free 127.0.0.1 ports, with ``--preload
    plexrl_dask.plugins`` unless ``preload`` is false (the shared-cluster path, run locally),
    writing its scheduler file into ``directory``. ``security`` with TLS: it listens on
    ``tls://`` with those settings (:func:`tls_environment`). Yields that file's contents
    (``address``, ``services`` with the dashboard's port, ...) once the scheduler serves; stops
    the process on exit. :class:`~plexrl_dask.errors.SchedulerNotStarted` when it exits first
    or does not serve within ``timeout`` seconds."""
    sched_file = Path(directory) / "scheduler.json"
    tls = tls_environment(security, "scheduler")
    argv = [
        str(Path(sys.executable).parent / "dask"), "scheduler",
        "--host", "127.0.0.1", "--port", "0", "--dashboard-address", "127.0.0.1:0",
        "--scheduler-file", str(sched_file),
        *(("--protocol", "tls") if tls else ()),
        *(("--preload", PRELOAD) if preload else ()),
    ]  # fmt: skip
    proc = subprocess.Popen(
        argv,
        cwd=directory,
        env={**os.environ, **tls},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        yield read_scheduler_file(sched_file, proc, timeout)
    finally:
        stop_process(proc)


class JournaledCluster:
    """A scheduler that can die and come back, on one machine: a ``dask scheduler --preload
    plexrl_dask.plugins`` process with a journal (``plexrl.scheduler.journal`` in
    ``directory``) on a fixed 127.0.0.1 port, and one ``dask worker`` process of ``n_workers``
    GPU workers (nannies), with the node's tiers in ``directory``. :meth:`restart` kills the
    scheduler (SIGKILL; its workers go with it, as Dask workers do) and starts both again, as
    a cluster manager would. For the fault tests and ``bench.faults``; a context manager."""

    def __init__(self, directory: str | os.PathLike[str], n_workers: int = 2) -> None:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        self.address = f"tcp://127.0.0.1:{port}"
        directory = Path(directory)
        self.tiers = {"dram-path": str(directory / "dram"), "nvme-path": str(directory / "nvme")}
        self.env = {
            **os.environ,
            "DASK_PLEXRL__SCHEDULER__JOURNAL": str(directory / "journal.sqlite"),
            "DASK_PLEXRL__STATE__DRAM_PATH": self.tiers["dram-path"],
            "DASK_PLEXRL__STATE__NVME_PATH": self.tiers["nvme-path"],
            TRIM_CONFIG_ENV: "",
        }
        dask_exe = str(Path(sys.executable).parent / "dask")
        self.argv = (
            [dask_exe, "scheduler", "--host", "127.0.0.1", "--port", str(port),
             "--no-dashboard", "--preload", PRELOAD],
            [dask_exe, "worker", self.address, "--nworkers", str(n_workers), "--nthreads", "1",
             "--no-dashboard", "--resources", f"{config.get('worker.gpu-resource')}=1",
             "--memory-limit", "4GiB"],
        )  # fmt: skip
        self.log = str(directory / "cluster.log")
        self.procs: list[subprocess.Popen] = []

    def _start(self) -> None:
        with open(self.log, "ab") as log:
            self.procs = [
                subprocess.Popen(argv, env=self.env, stdout=subprocess.DEVNULL, stderr=log)
                for argv in self.argv
            ]

    def __enter__(self) -> JournaledCluster:
        self._start()
        return self

    def restart(self, timeout: float = 60.0) -> None:
        """Kill the scheduler (its workers exit with it), then start both again."""

        os.kill(self.procs[0].pid, signal.SIGKILL)
        self.procs[0].wait(timeout=timeout)
        self.procs[1].wait(timeout=timeout)
        self._start()

    def wait(self, client: Client, n_workers: int = 2, timeout: float = 120.0) -> None:
        """Until ``client`` (which reconnects on its own) sees ``n_workers`` workers."""
        deadline = time.monotonic() + timeout
        while True:
            with contextlib.suppress(OSError):
                if len(worker_info(client)) >= n_workers:
                    return
            if time.monotonic() > deadline:
                raise SchedulerNotStarted(f"{self.address} did not serve {n_workers} workers")
            time.sleep(0.5)

    def __exit__(self, *exc: object) -> None:
        from plexrl_dask.state_store.node import NodeState, StateConfig

        for proc in reversed(self.procs):
            stop_process(proc)
        NodeState(StateConfig.for_tiers(self.tiers)).shutdown()


def read_scheduler_file(
    path: str | os.PathLike[str], proc: subprocess.Popen, timeout: float
) -> dict[str, Any]:
    """The contents of the scheduler file that ``proc`` (a ``dask scheduler`` process) writes
    at ``path`` once it serves: waited for (Dask does not write it atomically, so until it
    reads whole). :class:`~plexrl_dask.errors.SchedulerNotStarted` when the process exits
    first or ``timeout`` seconds pass."""
    deadline = time.monotonic() + timeout
    while True:
        with contextlib.suppress(FileNotFoundError, json.JSONDecodeError):
            return json.loads(Path(path).read_text())
        if proc.poll() is not None:
            raise SchedulerNotStarted(f"dask scheduler exited with {proc.returncode} on start")
        if time.monotonic() > deadline:
            raise SchedulerNotStarted(f"dask scheduler did not start within {timeout}s")
        time.sleep(0.02)


def stop_process(proc: subprocess.Popen, timeout: float = 30.0) -> None:
    """Terminate ``proc`` (a scheduler or worker process) and wait for it; kill it if it is
    still there after ``timeout`` seconds."""
    proc.terminate()
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=timeout)


def install(client: Client) -> None:
    """Install the PlexRL plugins on the cluster of ``client`` (idempotent).

    Workers need ``plexrl_dask`` importable and must advertise the GPU resource
    (``dask worker ... --resources GPU=1``) to get a replica holder.
    """
    from plexrl_dask.dashboard.state import PlexRLDashboardPlugin
    from plexrl_dask.plugins import PlexRLSchedulerPlugin

    client.register_plugin(PlexRLSchedulerPlugin())
    # The dashboard's data and JSON routes; its pages join the dashboard menu only through the
    # preload (the menu is built when the scheduler starts).
    client.register_plugin(PlexRLDashboardPlugin())
