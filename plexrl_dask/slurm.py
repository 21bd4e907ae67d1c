"""PlexRL on SLURM (and other job queues) through dask-jobqueue (docs/deploying.md, "SLURM").

- :func:`slurm_cluster` starts a ``SLURMCluster`` whose scheduler preloads the PlexRL plugins and
  whose jobs start PlexRL workers (:func:`jobqueue_options`, also for ``PBSCluster`` and the
  others). Before submitting anything it asks SLURM whether it would take the job
  (``sbatch --test-only``): a partition or account SLURM refuses is :class:`BatchJobRefused`
  with SLURM's own words, not a job that never appears.
- :func:`wait_for_plexrl_workers` waits until the jobs' workers have joined *and* reported
  their replica holders (what placement needs), and otherwise says why not, typed: jobs still
  pending in SLURM (with SLURM's reason) or never started are :class:`WorkersNotStarted`; a
  worker that joined without the PlexRL worker plugin (or whose plugin failed to set up) is
  :class:`~plexrl_dask.errors.PluginsNotInstalled`.
- :func:`slurm_jobs` maps workers to their SLURM jobs and nodes (``squeue``), and
  :func:`cancel` cancels one job (``scancel``): how a shared cluster loses a node, by
  preemption.

Node groups follow SLURM's nodes: a worker's node is its state store's node id, which in a SLURM
job is ``$SLURMD_NODENAME`` (``plexrl.state.node-id: auto``).
"""

from __future__ import annotations

import contextlib
import os
import shlex
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import dask
from dask.utils import parse_bytes
from distributed import Client, Security

from plexrl_dask import config, protocol
from plexrl_dask.cluster import GPU_NANNY, PRELOAD, TRIM_CONFIG_ENV, worker_info
from plexrl_dask.driver.waits import run_on_workers
from plexrl_dask.errors import (
    BatchJobRefused,
    ConfigError,
    PluginsNotInstalled,
    RequestTimeout,
    WorkersNotStarted,
)
from plexrl_dask.shared.records import BACKEND_NAMES

#: How long one SLURM command (sbatch --test-only, squeue, scancel, sinfo) may take.
COMMAND_TIMEOUT_S = 30.0


def jobqueue_options(rollout_backend: str = "torch", gpus_per_job: int = 1) -> dict[str, Any]:
    """What makes a dask-jobqueue cluster (``SLURMCluster``, ``PBSCluster``, ...) a PlexRL
    cluster, as keyword arguments to give it beside the site's own (queue, account, cores,
    memory, walltime, and the directive that gives a job ``gpus_per_job`` GPUs, e.g. SLURM's
    ``job_extra_directives=["--gres=gpu:4"]``):

    - ``scheduler_options``: the scheduler, which dask-jobqueue runs in this process, preloads
      the PlexRL plugins; they register the worker plugin on every worker that joins;
    - ``processes=gpus_per_job`` and ``worker_extra_args``: one worker per GPU of the job,
      advertising the GPU resource; with several, the nanny preload :mod:`plexrl_dask.gpu_nanny`
      gives each one of the GPUs the queue made visible to the job (its
      ``CUDA_VISIBLE_DEVICES``). A job's workers share a node's tiers;
    - ``job_script_prologue``: this process's PlexRL settings, where they differ from the
      defaults (:func:`~plexrl_dask.config.shipped_settings`: what ``dask.config.set`` or a
      config file gave the driver applies to the workers too), and with a vLLM rollout
      (``rollout_backend="vllm"``), workers that may start the engines' processes
      (``distributed.worker.daemon: false``). The site's prologue goes after it, so a
      setting exported there wins."""

    if rollout_backend not in BACKEND_NAMES:
        raise ConfigError(f"rollout_backend is one of {BACKEND_NAMES}, got {rollout_backend!r}")
    config.count("gpus_per_job", gpus_per_job)
    # (Dask's MALLOC_TRIM_THRESHOLD_ turns off glibc's adaptive mmap threshold: training ran
    # 1.2-2x slower under it; None drops it from the worker's environment)
    prologue = [f"export {TRIM_CONFIG_ENV}=None"]
    prologue += [f"export {k}={shlex.quote(v)}" for k, v in config.shipped_settings().items()]
    if rollout_backend == "vllm":
        prologue.append("export DASK_DISTRIBUTED__WORKER__DAEMON=False")
    worker_args = ["--resources", f"{config.get('worker.gpu-resource')}=1"]
    if gpus_per_job > 1:
        worker_args += ["--preload-nanny", GPU_NANNY]
    return {
        "processes": gpus_per_job,
        "worker_extra_args": worker_args,
        "scheduler_options": {"preload": [PRELOAD]},
        "job_script_prologue": prologue,
    }


@contextlib.contextmanager
def slurm_cluster(
    gpus: int,
    rollout_backend: str = "torch",
    submit: bool = True,
    gpus_per_job: int = 1,
    tls: bool = True,
    **site: Any,
) -> Iterator[Any]:
    """A dask-jobqueue ``SLURMCluster`` of ``gpus / gpus_per_job`` jobs (it must divide) of
    ``gpus_per_job`` GPUs and as many PlexRL workers each (:func:`jobqueue_options`), closed
    on exit (its jobs cancelled). ``site``: the ``SLURMCluster`` arguments of your site
    (``cores``, ``memory``, ``queue``, ``account``, ``walltime``, and ``job_extra_directives``,
    by default ``["--gres=gpu:<gpus_per_job>"]``; ``cores`` and ``memory`` are the job's,
    shared by its workers). The jobs are submitted on entry, once ``sbatch --test-only`` has
    accepted the job script (:class:`BatchJobRefused` otherwise); not with ``submit=False``
    (to read ``cluster.job_script()``). Wait for the workers with
    :func:`wait_for_plexrl_workers`. Needs ``pip install plexrl-dask[jobqueue]``.

    ``tls`` (the default), unless the site passes its own ``security``: the scheduler, the
    workers and ``Client(cluster)`` speak TLS with a certificate made for this cluster
    (``Security.temporary()``), so that no one else on the cluster's network can reach the
    scheduler or the workers (a Dask client runs code on them). dask-jobqueue writes the
    workers' copy of it, readable only by you, into ``shared_temp_directory`` (a site
    argument, or ``jobqueue.slurm.shared-temp-directory``; by default your home directory),
    which the jobs' nodes must see at the same path; dask-jobqueue deletes it when the cluster
    object is collected or the process exits."""
    try:
        from dask_jobqueue import SLURMCluster
    except ImportError as e:
        raise ConfigError(
            "slurm_cluster needs dask-jobqueue: pip install plexrl-dask[jobqueue]"
        ) from e
    config.count("gpus", gpus)
    options = jobqueue_options(rollout_backend, gpus_per_job)
    if gpus % gpus_per_job:
        raise ConfigError(f"gpus ({gpus}) must be a multiple of gpus_per_job ({gpus_per_job})")
    # What the site gave, as an argument or in its jobqueue config (dask-jobqueue reads its
    # config only for an argument left out, and these are never left out here).
    given = {key: _site_setting(site, key) for key in _SITE_KEYS}
    for key in ("job_extra_directives", "worker_extra_args", "job_script_prologue"):
        if given[key] is not None:
            given[key] = config.strings(key, given[key])
    directives = list(given["job_extra_directives"] or [])
    if not any(str(d).startswith("--gres") for d in directives):
        directives.append(f"--gres=gpu:{gpus_per_job}")
    site["job_extra_directives"] = directives
    dram = _dram_capacity(site.get("memory"))
    if dram is not None:
        options["job_script_prologue"].append(f"export DASK_PLEXRL__STATE__DRAM_CAPACITY={dram}")
    for key in ("worker_extra_args", "job_script_prologue"):  # ours, then the site's
        site[key] = [*options.pop(key), *(given[key] or [])]
    scheduler = {**(given["scheduler_options"] or {})}
    preloads = scheduler.get("preload", [])
    preloads = [preloads] if isinstance(preloads, str) else list(preloads)
    scheduler["preload"] = [PRELOAD, *(p for p in preloads if p != PRELOAD)]
    options.pop("scheduler_options")
    site["scheduler_options"] = scheduler
    if tls and site.get("security") is None:
        try:
            site["security"] = Security.temporary()
        except ImportError as e:
            raise ConfigError(
                "a TLS cluster needs cryptography: pip install plexrl-dask[jobqueue] "
                "(or tls=False on a network no one else reaches)"
            ) from e
        site["shared_temp_directory"] = os.path.expanduser(
            site.get("shared_temp_directory")
            or dask.config.get("jobqueue.slurm.shared-temp-directory", None)
            or "~"
        )
    cluster = SLURMCluster(**{**options, **site})
    try:
        if submit:
            check_job_script(cluster.job_script())
            cluster.scale(jobs=gpus // gpus_per_job)
        yield cluster
    finally:
        cluster.close()


#: The ``SLURMCluster`` arguments slurm_cluster always passes, which dask-jobqueue then reads
#: from its config (``jobqueue.slurm.<key>``) no more: slurm_cluster merges that in itself.
_SITE_KEYS = (
    "job_extra_directives",
    "worker_extra_args",
    "job_script_prologue",
    "scheduler_options",
)


#: The share of a job's memory its node's DRAM tier takes where ``plexrl.state.dram-capacity`` is
#: "auto": the tier's files on /dev/shm count against the job's memory (its cgroup), where
#: "auto" alone would size it by the node's /dev/shm, half the machine.
SLURM_DRAM_SHARE = 0.25


def _dram_capacity(memory: Any) -> int | None:
    """The DRAM tier's bytes for a job of ``memory`` (None: the setting is not "auto", or the
    job states no memory)."""
    if config.get("state.dram-capacity") != "auto" or memory is None:
        return None
    try:
        return int(parse_bytes(memory) * SLURM_DRAM_SHARE)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"memory is a size such as '64GB', got {memory!r}") from e


def _site_setting(site: dict[str, Any], key: str) -> Any:
    """``site``'s ``key``, else the site's dask-jobqueue config of it (None: neither)."""
    if site.get(key) is not None:
        return site[key]
    return dask.config.get(f"jobqueue.slurm.{key.replace('_', '-')}", None)


def _slurm(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    """A SLURM command, bounded by :data:`COMMAND_TIMEOUT_S`; :class:`ConfigError` where SLURM's
    commands are not installed, :class:`WorkersNotStarted` where one does not answer."""
    if shutil.which(args[0]) is None:
        raise ConfigError(f"{args[0]} is not on PATH: is SLURM installed here?")
    try:
        return subprocess.run(
            list(args), input=stdin, capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S
        )
    except subprocess.TimeoutExpired as e:
        raise WorkersNotStarted(
            f"{' '.join(args)} did not answer within {COMMAND_TIMEOUT_S:.0f}s: is slurmctld up?"
        ) from e


def _message(proc: subprocess.CompletedProcess[str]) -> str:
    """SLURM's own words from a failed command, on one line."""
    text = (proc.stderr or proc.stdout or f"exit code {proc.returncode}").strip()
    return " ".join(line.strip() for line in text.splitlines() if line.strip())


def check_job_script(script: str) -> None:
    """Ask SLURM whether it would run ``script`` (``sbatch --test-only``: nothing is
    submitted); :class:`BatchJobRefused` with SLURM's message when it would not (a partition
    or account it refuses, a time or resource request over a limit)."""
    with tempfile.NamedTemporaryFile("w", suffix=".sh", delete=False) as f:
        f.write(script)
    try:
        proc = _slurm("sbatch", "--test-only", f.name)
    finally:
        os.unlink(f.name)
    if proc.returncode != 0:
        raise BatchJobRefused(f"SLURM refuses the worker jobs: {_message(proc)}")


@dataclass(frozen=True)
class SlurmJob:
    """One SLURM job as ``squeue`` reports it."""

    job_id: str
    state: str  # PENDING, RUNNING, ...
    reason: str  # why it pends ("None" when running)
    nodes: str  # where it runs ("" while pending)


def slurm_jobs(job_ids: list[str]) -> dict[str, SlurmJob]:
    """``squeue``'s view of ``job_ids`` (jobs it no longer knows are left out)."""
    if not job_ids:
        return {}
    proc = _slurm("squeue", "-h", "-j", ",".join(job_ids), "-o", "%i|%T|%r|%N")
    jobs = {}
    for line in proc.stdout.splitlines():
        parts = line.strip().split("|")
        if len(parts) == 4:
            jobs[parts[0]] = SlurmJob(*parts)
    return jobs


def cancel(job_id: str) -> None:
    """``scancel`` one job: SIGTERM to its processes, SIGKILL after SLURM's ``KillWait``, the
    way SLURM preempts a job (``PreemptMode=CANCEL``). Its workers' state is gone with them."""
    proc = _slurm("scancel", str(job_id))
    if proc.returncode != 0:
        raise ConfigError(f"scancel {job_id}: {_message(proc)}")


def slurm_nodes() -> list[str]:
    """The nodes SLURM reports (``sinfo -N``), sorted."""
    proc = _slurm("sinfo", "-h", "-N", "-o", "%N")
    if proc.returncode != 0:
        raise ConfigError(f"sinfo: {_message(proc)}")
    return sorted(set(proc.stdout.split()))


def slurm_version() -> str:
    """``sinfo --version``'s answer, e.g. ``slurm-wlm 22.05.8``."""
    return _slurm("sinfo", "--version").stdout.strip()


def job_ids(cluster: Any) -> dict[str, str]:
    """The SLURM job id of each of the cluster's jobs, by the job's name (what dask-jobqueue
    names its workers: the job's name, with ``-<i>`` per worker for several per job)."""
    return {
        name: str(job.job_id)
        for name, job in list(cluster.workers.items())
        if getattr(job, "job_id", None)
    }


def job_of_worker(cluster: Any, client: Client, worker: str) -> str:
    """The SLURM job id of the job that started ``worker`` (an address)."""
    name = str(worker_info(client)[worker]["name"])
    ids = job_ids(cluster)
    for job, job_id in ids.items():
        if name == job or name.startswith(f"{job}-"):
            return job_id
    raise ConfigError(f"worker {worker} ({name}) is not one of the cluster's jobs {sorted(ids)}")


def _plugins(dask_worker: Any) -> list[str]:
    return sorted(dask_worker.plugins)


def wait_for_plexrl_workers(
    client: Client, n: int, timeout: float, cluster: Any | None = None
) -> dict[str, dict[str, Any]]:
    """Until ``n`` PlexRL workers have joined and reported their replica holders; returns the
    reports by worker (``node``, ``budget_bytes``, ...). Past ``timeout`` seconds, a typed error
    naming the cause: :class:`~plexrl_dask.errors.PluginsNotInstalled` for workers that joined
    without a holder (no PlexRL worker plugin, or the GPU resource missing), else
    :class:`WorkersNotStarted` with the jobs' SLURM states and reasons (``cluster``: the
    ``SLURMCluster``, to name them)."""
    deadline = time.monotonic() + timeout
    while True:
        status = _status(client)
        reported = dict(status.get("workers", {}))
        if len(reported) >= n:
            return reported
        if time.monotonic() > deadline:
            break
        time.sleep(0.5)
    joined = worker_info(client)
    silent = sorted(set(joined) - set(reported))
    failed = {w: e for w, e in status.get("holder_errors", {}).items() if w in silent}
    if failed:
        raise PluginsNotInstalled(
            f"{len(failed)} worker(s) joined but their replica holders failed: "
            + "; ".join(f"{w}: {e}" for w, e in sorted(failed.items()))
        )
    if silent:
        try:
            plugins = run_on_workers(client, _plugins, workers=silent, timeout=COMMAND_TIMEOUT_S)
        except RequestTimeout as e:
            raise WorkersNotStarted(
                f"{len(reported)} of {n} PlexRL workers within {timeout:.0f}s; {len(silent)} "
                f"joined without a replica holder and not all answered: {e}"
            ) from e
        without = {w: p for w, p in plugins.items() if "plexrl-worker" not in p}
        resource = str(config.get("worker.gpu-resource"))
        no_gpu = [w for w in silent if not joined[w].get("resources", {}).get(resource)]
        if without or no_gpu:
            what = [f"{w} has no PlexRL worker plugin (plugins: {p})" for w, p in without.items()]
            what += [f"{w} does not advertise the {resource} resource" for w in no_gpu]
            raise PluginsNotInstalled(
                f"{len(silent)} worker(s) joined without a PlexRL replica holder: "
                + "; ".join(what)
            )
    states = ""
    if cluster is not None:
        ids = job_ids(cluster)
        seen = slurm_jobs(list(ids.values()))
        states = "; jobs: " + ", ".join(
            f"{i} {seen[i].state} ({seen[i].reason})" if i in seen else f"{i} gone"
            for i in ids.values()
        )
    raise WorkersNotStarted(
        f"{len(reported)} of {n} PlexRL workers within {timeout:.0f}s "
        f"({len(joined)} joined){states}"
    )


def _status(client: Client) -> dict[str, Any]:
    """The scheduler plugin's status (workers' holder reports, holders that failed)."""
    status = client.sync(
        getattr(client.scheduler, protocol.STATUS), callback_timeout=COMMAND_TIMEOUT_S
    )
    if not isinstance(status, dict):  # a scheduler without the handler answers None
        raise PluginsNotInstalled(
            "the scheduler has no PlexRL plugins: its scheduler_options must preload "
            f"{PRELOAD} (slurm_cluster does)"
        )
    return status


def one_machine_site(directory: str | os.PathLike[str]) -> dict[str, Any]:
    """The ``SLURMCluster`` site arguments for a SLURM cluster whose nodes all run on this
    machine (``tools/slurm-local``: the tests, ``bench.slurm``): scheduler and workers on
    127.0.0.1 with free ports, each node's tiers in its own directories under ``directory``
    (on separate machines each node has its own /dev/shm and disk; made here), job logs and
    the workers' TLS certificate there too."""
    root = Path(directory)
    tier = root / "tiers"
    tier.mkdir(parents=True, exist_ok=True)  # (the workers make their own tiers inside)
    return {
        "cores": 1,
        "memory": "2GB",
        "walltime": "00:20:00",
        "scheduler_options": {"host": "127.0.0.1", "dashboard_address": "127.0.0.1:0"},
        "worker_extra_args": ["--host", "127.0.0.1"],
        "job_script_prologue": [
            f"export DASK_PLEXRL__STATE__DRAM_PATH={tier}/dram-$SLURMD_NODENAME",
            f"export DASK_PLEXRL__STATE__NVME_PATH={tier}/nvme-$SLURMD_NODENAME",
        ],
        "log_directory": str(root / "logs"),
        "shared_temp_directory": str(root),
    }


def environment_problem() -> str | None:
    """Why SLURM cannot be used from here (None if it can): no SLURM commands, or no
    controller answering ``sinfo`` (``SLURM_CONF`` names the configuration)."""
    if shutil.which("sbatch") is None or shutil.which("sinfo") is None:
        return "SLURM's commands (sbatch, sinfo) are not installed: see tools/slurm-local"
    try:
        proc = subprocess.run(
            ["sinfo", "-h", "-o", "%t"], capture_output=True, text=True, timeout=10
        )
    except subprocess.TimeoutExpired:
        return "sinfo did not answer within 10s"
    if proc.returncode != 0:
        return f"no SLURM controller answers: {_message(proc)} (tools/slurm-local start)"
    if "idle" not in proc.stdout and "mix" not in proc.stdout:
        return f"no SLURM node is idle: {proc.stdout.split()}"
    return None
