"""The ``plexrl`` command.

plexrl cluster [--workers N]          start a local PlexRL cluster and keep it running
plexrl slurm GPUS [...]               start a PlexRL cluster on SLURM and keep it running
plexrl status --scheduler ADDRESS     deployments, residency and worker budgets of a cluster
plexrl config                         the effective ``plexrl`` configuration
plexrl simulate [--policy P ...] [--gpus N] [--jobs N] [--json OUT] [--png PREFIX]
                                      trace-driven simulation of placement policies
plexrl checkpoint DIR [DIR ...]       what GRPO job checkpoint directories hold
plexrl kube-spec --name N --gpus G --image I [...]
                                      a PlexRL cluster for the Dask Kubernetes operator (YAML)
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import math
import shutil
import signal
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import dask.config
import yaml
from dask.utils import parse_bytes
from rich.console import Console
from rich.table import Table

from plexrl_dask import config as _config  # noqa: F401  (registers defaults)
from plexrl_dask.errors import ConfigError, PlexRLError

logger = logging.getLogger(__name__)
console = Console()
err_console = Console(stderr=True)  # (not into a pipe: `plexrl kube-spec ... | kubectl apply -f -`)


def _int_at_least(text: str, least: int) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < least:
        raise argparse.ArgumentTypeError(f"must be >= {least}, got {value}")
    return value


def positive_int(text: str) -> int:
    """An argparse type: an integer >= 1 (else argparse's usage error, exit 2)."""
    return _int_at_least(text, 1)


def nonnegative_int(text: str) -> int:
    """An argparse type: an integer >= 0 (else argparse's usage error, exit 2)."""
    return _int_at_least(text, 0)


def env_pair(text: str) -> tuple[str, str]:
    """An argparse type: ``KEY=VALUE`` (a non-empty key of letters, digits and ``_``)."""
    key, sep, value = text.partition("=")
    if not sep or not key or not key.replace("_", "").isalnum():
        raise argparse.ArgumentTypeError(f"give KEY=VALUE, got {text!r}")
    return key, value


def positive_float(text: str) -> float:
    """An argparse type: a finite number > 0 (else argparse's usage error, exit 2)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text}")
    return value


def _byte_size(text: str) -> str:
    """A size such as ``64GB`` (kept as written: dask-jobqueue reads it)."""
    try:
        parse_bytes(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size such as 64GB") from None
    return text


def _cmd_cluster(args: argparse.Namespace) -> int:
    from plexrl_dask.cluster import local_cluster

    with local_cluster(n_workers=args.workers, dashboard_address=args.dashboard) as cluster:
        console.print(f"scheduler: [bold]{cluster.scheduler_address}[/bold]")
        console.print(f"dashboard: {cluster.dashboard_link}")
        console.print("connect with plexrl.Runtime(Client(address)); Ctrl-C stops the cluster")
        _until_stopped()
    return 0


def _terminated(*_: object) -> None:
    raise SystemExit(143)


@contextlib.contextmanager
def _terminate_exits() -> Iterator[None]:
    """Inside, SIGTERM raises ``SystemExit(143)`` as Ctrl-C raises ``KeyboardInterrupt``, so
    that what the block holds is closed (:func:`_until_stopped` may take it over); the
    handler before it, after."""
    previous = signal.signal(signal.SIGTERM, _terminated)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _until_stopped() -> None:
    """Wait for Ctrl-C or SIGTERM, then return (the caller's ``with`` closes what it runs).
    Set only once up: before, Ctrl-C interrupts the start or the wait for workers."""
    stop = threading.Event()
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    stop.wait()


def _cmd_slurm(args: argparse.Namespace) -> int:
    from plexrl_dask import slurm

    # (the site's jobqueue config first, then what the command line adds to it)
    directives = dask.config.get("jobqueue.slurm.job-extra-directives", None) or []
    scheduler = dask.config.get("jobqueue.slurm.scheduler-options", None) or {}
    site: dict[str, object] = {
        "cores": args.cores,
        "memory": args.memory,
        "walltime": args.walltime,
        "job_extra_directives": [*directives, *args.directive],
        "scheduler_options": {**scheduler, "dashboard_address": args.dashboard},
    }
    if args.scheduler_host:
        site["scheduler_options"]["host"] = args.scheduler_host  # type: ignore[index]
    if args.queue:
        site["queue"] = args.queue
    if args.account:
        site["account"] = args.account
    if args.shared_dir:
        site["shared_temp_directory"] = args.shared_dir
    with (
        _terminate_exits(),  # (SIGTERM while the jobs start: cancelled, credentials removed)
        slurm.slurm_cluster(
            args.gpus, args.rollout_backend, gpus_per_job=args.gpus_per_job, tls=args.tls, **site
        ) as cluster,
        _client_credentials(cluster, args.tls_dir) as connect,
    ):
        from distributed import Client

        with Client(cluster) as client:
            console.print(f"scheduler: [bold]{cluster.scheduler_address}[/bold]")
            console.print(f"waiting up to {args.wait:.0f}s for {args.gpus} PlexRL workers")
            reports = slurm.wait_for_plexrl_workers(client, args.gpus, args.wait, cluster)
            nodes = sorted({str(r.get("node")) for r in reports.values()})
            console.print(f"{len(reports)} workers on nodes {', '.join(nodes)}")
            console.print(f"dashboard: {cluster.dashboard_link}")
            console.print(f"connect with plexrl.Runtime({connect}); Ctrl-C stops the jobs")
            _until_stopped()
    return 0


@contextlib.contextmanager
def _client_credentials(cluster: Any, directory: str) -> Iterator[str]:
    """How a client in another process connects to ``cluster``: with TLS, through the
    credentials written under ``directory`` (removed when the cluster stops)."""
    if not cluster.scheduler_address.startswith("tls://"):
        yield "Client(address)"
        return
    from plexrl_dask.cluster import save_client_credentials

    where = cluster.scheduler_address.removeprefix("tls://").replace(":", "-")
    saved = save_client_credentials(cluster.security, Path(directory).expanduser() / where)
    try:
        yield (
            f"Client(address, security=plexrl_dask.cluster.client_security('{saved}'))"
            f" (plexrl status --tls {saved})"
        )
    finally:
        shutil.rmtree(saved, ignore_errors=True)


def _cmd_status(args: argparse.Namespace) -> int:

    from plexrl_dask.driver.runtime import Runtime

    security = None
    if args.tls:
        from plexrl_dask.cluster import client_security

        security = client_security(args.tls)
    with _client(args.scheduler, timeout=args.timeout, security=security) as client:
        status = Runtime(client, job="plexrl-status").status()
    table = Table(title="deployments")
    for col in ("name", "owner", "role", "model", "workers", "state", "modified"):
        table.add_column(col)
    for d in status["deployments"]:
        table.add_row(
            d["name"],
            d["owner"],
            d["role"],
            d["spec"]["label"] or str(d["spec"]["path"]),
            ", ".join(d["workers"]),
            d["state"],
            str(d["modified"]),
        )
    console.print(table)
    table = Table(title="residency")
    for col in ("deployment", "worker", "tier", "version", "MiB", "last transition s"):
        table.add_column(col)
    for r in status["residency"]:
        table.add_row(
            r["deployment"],
            r["worker"],
            r["tier"],
            str(r["version"]),
            f"{r['bytes'] / 2**20:.1f}",
            f"{r['load_s']:.3f}",
        )
    console.print(table)
    table = Table(title="workers")
    for col in ("worker", "device", "budget MiB"):
        table.add_column(col)
    for w, c in status["workers"].items():
        table.add_row(w, c["device"], f"{c['budget_bytes'] / 2**20:.0f}")
    console.print(table)
    return 0


def _cmd_config(args: argparse.Namespace) -> int:
    shown = dict(dask.config.get("plexrl"))
    if shown.get("operator-secret") is not None:  # (printed configs end up in logs)
        shown["operator-secret"] = "<set: not shown>"
    console.print(yaml.safe_dump({"plexrl": shown}, sort_keys=False))
    return 0


def _cmd_simulate(args: argparse.Namespace) -> int:
    import json

    from plexrl_dask.config import placement_config
    from plexrl_dask.sim.study import compare, write_plots
    from plexrl_dask.sim.workload import WorkloadSpec

    spec = WorkloadSpec.load(args.workload).scaled(args.gpus, args.jobs)
    if args.offered_load is not None:
        spec = spec.with_load(args.offered_load)
    outcomes = compare(spec, args.policy, args.seed, placement_config())
    table = Table(title=f"{spec.name}: {spec.jobs} jobs on {spec.cluster.gpus} GPUs")
    cols = ("makespan_h", "mean_jct_h", "mean_slowdown", "user_gpu_hours", "held_gpu_hours",
            "utilisation", "gpu_double_bookings", "sim_wall_s")  # fmt: skip
    table.add_column("policy")
    for c in cols:
        table.add_column(c, justify="right")
    summaries = {name: o.summary() for name, o in outcomes.items()}
    for name, s in summaries.items():
        table.add_row(name, *(f"{s[c]:.4g}" for c in cols))
    console.print(table)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"workload": spec.name, "gpus": spec.cluster.gpus, "jobs": spec.jobs,
                       "seed": args.seed, "policies": summaries}, f, indent=2)  # fmt: skip
    if args.png:
        for path in write_plots(outcomes, args.png):
            console.print(f"wrote {path}")
    return 0


def _cmd_checkpoint(args: argparse.Namespace) -> int:
    import datetime

    from plexrl_dask.errors import CheckpointError
    from plexrl_dask.rl.job_checkpoint import directory_bytes, read_checkpoint

    rc = 0
    for directory in args.directory:
        try:
            saved = read_checkpoint(directory)
        except CheckpointError as e:
            err_console.print(f"[red]{directory}: {e}[/red]")
            rc = 2
            continue
        if saved is None:
            err_console.print(f"[red]{directory}: no job checkpoint here[/red]")
            rc = 2
            continue
        size = directory_bytes(directory)
        when = datetime.datetime.fromtimestamp(saved.time).isoformat(timespec="seconds")
        rollout = "none" if saved.rollout is None else f"version {saved.rollout['version']}"
        console.print(
            f"[bold]{directory}[/bold]: job {saved.job}, {saved.steps_done} of "
            f"{saved.config.get('steps')} steps done, policy version {saved.version}, rollout "
            f"{rollout}, {1 + len(saved.kept)} checkpoint(s) kept, saved {when}, "
            f"{size / 2**20:.1f} MiB",
            soft_wrap=True,
        )
    return rc


def _cmd_kube_spec(args: argparse.Namespace) -> int:
    from plexrl_dask.cluster import save_client_credentials
    from plexrl_dask.kubernetes import kube_cluster_spec, kube_tls_secret

    def resources(cpu: str | None, memory: str | None) -> dict[str, str]:
        return {k: v for k, v in (("cpu", cpu), ("memory", memory)) if v}

    spec = kube_cluster_spec(
        args.name,
        args.gpus,
        args.image,
        gpus_per_pod=args.gpus_per_pod,
        rollout_backend=args.rollout_backend,
        worker_resources=resources(args.worker_cpu, args.worker_memory),
        scheduler_resources=resources(args.scheduler_cpu, args.scheduler_memory),
        dram_size=args.dram_size,
        shared_volume=(
            {"persistentVolumeClaim": {"claimName": args.shared_claim}}
            if args.shared_claim
            else None
        ),
        shared_path=args.shared_path,
        nvme_volume=(
            {"hostPath": {"path": args.nvme_host_path, "type": "DirectoryOrCreate"}}
            if args.nvme_host_path
            else None
        ),
        env=dict(args.env),
        idle_timeout=args.idle_timeout,
        tls_secret=None if args.no_tls else args.tls_secret or f"{args.name}-tls",
    )
    documents = [spec]
    if not args.no_tls:
        where = Path(args.tls_dir).expanduser() / f"kube-{args.name}"
        # (the certificate made before, unless a new one is asked for: a running cluster's
        # scheduler and clients keep theirs)
        known = _saved_certificate(where) if not args.new_certificate else None
        secret, security = kube_tls_secret(args.tls_secret or f"{args.name}-tls", known)
        documents.insert(0, secret)
        saved = save_client_credentials(security, where)
        err_console.print(
            f"The cluster's TLS certificate ({'the one' if known else 'a new one'} in {saved}) "
            f"is in the Secret {secret['metadata']['name']}: apply it with the cluster. "
            f"Clients: Client('tls://<the scheduler service>:8786', security="
            f"plexrl_dask.cluster.client_security('{saved}'))",
            soft_wrap=True,
        )
    # plain print: YAML for kubectl, which a console would wrap and colour
    print(yaml.safe_dump_all(documents, sort_keys=False), end="")
    return 0


def _saved_certificate(directory: Path) -> Any:
    """The ``Security`` of a certificate ``plexrl kube-spec`` saved in ``directory`` before
    (its CA, and the certificate and key every role of the cluster uses), or None.
    :class:`ConfigError` where its key is not the certificate's, its CA did not issue it, or
    it expires within 30 days: a Secret of it would not serve (``--new-certificate``)."""
    import datetime
    import ssl

    from cryptography import x509
    from cryptography.exceptions import InvalidSignature

    from plexrl_dask.cluster import client_security, one_certificate

    if not directory.is_dir():
        return None
    files = client_security(directory)
    ca, cert, key = (
        Path(f).read_text()
        for f in (files.tls_ca_file, files.tls_client_cert, files.tls_client_key)
    )
    try:
        ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER).load_cert_chain(
            files.tls_client_cert, files.tls_client_key
        )
        parsed = x509.load_pem_x509_certificate(cert.encode())
        parsed.verify_directly_issued_by(x509.load_pem_x509_certificate(ca.encode()))
    except (ssl.SSLError, InvalidSignature, ValueError, TypeError) as e:
        raise ConfigError(
            f"the certificate saved in {directory} does not hold together ({e}): make a new "
            "one with --new-certificate"
        ) from None
    soon = datetime.datetime.now(datetime.UTC) + datetime.timedelta(days=30)
    if parsed.not_valid_after_utc < soon:
        raise ConfigError(
            f"the certificate saved in {directory} expires {parsed.not_valid_after_utc:%Y-%m-%d}:"
            " make a new one with --new-certificate"
        )
    return one_certificate(ca, cert, key)


def _cmd_serve(args: argparse.Namespace) -> int:

    from plexrl_dask.serve.app import models_from_config, serve
    from plexrl_dask.serve.tenants import KeyRing

    keys = args.keys or _config.get("serve.keys-file")
    if not keys:
        raise ConfigError("plexrl serve needs a keys file: --keys FILE (plexrl serve-keys add)")
    models = models_from_config()
    for item in args.model:
        name, sep, path = item.partition("=")
        if not sep or not name or not path:
            raise ConfigError(f"--model is NAME=CHECKPOINT_DIR, got {item!r}")
        models[name] = path
    if not models:
        raise ConfigError("no base models: --model NAME=DIR or plexrl.serve.models")
    state = args.state or _config.get("serve.state-file") or f"{keys}.state.json"
    with _client(args.scheduler, timeout=args.timeout) as client:
        serve(client, KeyRing.from_file(keys), models, args.host, args.port, str(state))
    return 0


def _cmd_serve_keys(args: argparse.Namespace) -> int:
    from plexrl_dask.serve.tenants import add_key

    key = add_key(args.file, args.tenant)
    err_console.print(
        f"a new API key of tenant {args.tenant!r} (shown once; {args.file} keeps its digest):"
    )
    print(key)
    return 0


def _client(address: str, **kwargs: Any) -> Any:
    """A client of the scheduler at ``address``; :class:`ConfigError` for an address Dask
    cannot parse (its ``ValueError``)."""
    from distributed import Client

    try:
        return Client(address, **kwargs)
    except ValueError as e:
        raise ConfigError(f"--scheduler {address!r}: {e}") from e


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="plexrl", description="PlexRL on Dask")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("cluster", help="start a local PlexRL cluster and keep it running")
    p.add_argument("--workers", type=positive_int, default=None)
    p.add_argument(
        "--dashboard", default="127.0.0.1:8787", help="dashboard address (':0' for any port)"
    )
    p.set_defaults(fn=_cmd_cluster)
    p = sub.add_parser(
        "slurm", help="start a PlexRL cluster on SLURM (dask-jobqueue) and keep it running"
    )
    p.add_argument("gpus", type=positive_int, help="workers: one per GPU")
    p.add_argument("--gpus-per-job", type=positive_int, default=1)
    p.add_argument("--queue", default=None, help="the SLURM partition")
    p.add_argument("--account", default=None)
    p.add_argument("--cores", type=positive_int, default=8, help="each job's")
    p.add_argument("--memory", type=_byte_size, default="64GB", help="each job's")
    p.add_argument("--walltime", default="04:00:00")
    p.add_argument(
        "--directive",
        action="append",
        default=[],
        metavar="OPTION",
        help="another #SBATCH option of the jobs (repeatable), e.g. --directive=--constraint=a100",
    )
    p.add_argument("--rollout-backend", default="torch", choices=("torch", "vllm"))
    p.add_argument(
        "--scheduler-host", default=None, help="the address workers reach the scheduler at"
    )
    p.add_argument("--dashboard", default=":8787", help="dashboard address (':0' for any port)")
    p.add_argument(
        "--wait", type=positive_float, default=600.0, help="seconds for the workers to report"
    )
    p.add_argument(
        "--no-tls",
        dest="tls",
        action="store_false",
        help="plain TCP: only on a network no one else reaches (a Dask client runs code on the "
        "workers)",
    )
    p.add_argument(
        "--shared-dir",
        default=None,
        help="where the workers' copy of the cluster's TLS certificate is written: a directory "
        "the jobs' nodes see at the same path (default: jobqueue.slurm.shared-temp-directory, "
        "else your home)",
    )
    p.add_argument(
        "--tls-dir",
        default="~/.plexrl/tls",
        help="where the credentials of clients in other processes are written, one directory "
        "per cluster, removed when it stops",
    )
    p.set_defaults(fn=_cmd_slurm)
    p = sub.add_parser("status", help="show a cluster's deployments, residency and workers")
    p.add_argument(
        "--scheduler", required=True, help="scheduler address, e.g. tcp://127.0.0.1:8786"
    )
    p.add_argument("--timeout", type=positive_float, default=10.0)
    p.add_argument(
        "--tls", default=None, metavar="DIR", help="the client credentials `plexrl slurm` wrote"
    )
    p.set_defaults(fn=_cmd_status)
    p = sub.add_parser("config", help="print the effective plexrl configuration")
    p.set_defaults(fn=_cmd_config)
    from plexrl_dask.sim.simulator import POLICIES

    p = sub.add_parser("simulate", help="trace-driven simulation of placement policies")
    p.add_argument(
        "--policy",
        action="append",
        choices=POLICIES,
        help=f"repeatable; default: all of {POLICIES}",
    )
    p.add_argument("--gpus", type=positive_int, default=2048)
    p.add_argument("--jobs", type=positive_int, default=None, help="default: the workload's")
    p.add_argument("--workload", default="paper2048", help="built-in name or YAML path")
    p.add_argument("--offered-load", type=positive_float, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="write per-policy summaries here")
    p.add_argument("--png", default=None, help="write figures with this path prefix")
    p.set_defaults(fn=_cmd_simulate)
    p = sub.add_parser("checkpoint", help="what GRPO job checkpoint directories hold")
    p.add_argument("directory", nargs="+")
    p.set_defaults(fn=_cmd_checkpoint)
    p = sub.add_parser(
        "kube-spec", help="print a PlexRL cluster for the Dask Kubernetes operator (YAML)"
    )
    p.add_argument("--name", required=True, help="the DaskCluster's name")
    p.add_argument("--gpus", type=positive_int, required=True)
    p.add_argument("--image", required=True, help="an image with plexrl-dask installed")
    p.add_argument("--gpus-per-pod", type=positive_int, default=1)
    p.add_argument("--rollout-backend", default="torch", choices=("torch", "vllm"))
    p.add_argument("--dram-size", default="16Gi", help="each worker pod's in-memory /dev/shm")
    p.add_argument("--worker-cpu", default=None)
    p.add_argument("--worker-memory", default=None)
    p.add_argument("--scheduler-cpu", default=None)
    p.add_argument("--scheduler-memory", default=None)
    p.add_argument("--shared-claim", default=None, help="a PVC for checkpoints, on every worker")
    p.add_argument("--shared-path", default="/plexrl/shared")
    p.add_argument(
        "--nvme-host-path",
        default=None,
        help="the NVMe tier on the machine's disk (one worker pod per machine); default emptyDir",
    )
    p.add_argument(
        "--env",
        type=env_pair,
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="environment of every container, e.g. DASK_PLEXRL__REQUEST__TIMEOUT=1200s",
    )
    p.add_argument("--idle-timeout", type=nonnegative_int, default=0, help="seconds; 0: never")
    p.add_argument(
        "--no-tls",
        action="store_true",
        help="plain TCP comms (by default TLS: a Secret of a new certificate is printed first)",
    )
    p.add_argument("--tls-secret", default=None, help="the TLS Secret's name (default NAME-tls)")
    p.add_argument(
        "--new-certificate",
        action="store_true",
        help="make a new certificate even where --tls-dir holds this cluster's (a running "
        "cluster's clients and scheduler then need the new Secret)",
    )
    p.add_argument(
        "--tls-dir",
        default="~/.plexrl/tls",
        help="where a client's copy of the certificate is written (in kube-NAME)",
    )
    p.set_defaults(fn=_cmd_kube_spec)
    p = sub.add_parser("serve", help="a Tinker-compatible HTTP server on a PlexRL cluster")
    p.add_argument("--scheduler", required=True, help="scheduler address, e.g. tcp://host:8786")
    p.add_argument("--keys", default=None, help="tenants' keys file (plexrl.serve.keys-file)")
    p.add_argument(
        "--model",
        action="append",
        default=[],
        metavar="NAME=DIR",
        help="a base model: its name and local checkpoint directory (repeatable)",
    )
    p.add_argument(
        "--state",
        default=None,
        help="what outlives a restart: tenants' job secrets, checkpoints' paths (default: "
        "plexrl.serve.state-file, else KEYS.state.json)",
    )
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=nonnegative_int, default=8000)
    p.add_argument("--timeout", type=positive_float, default=30.0)
    p.set_defaults(fn=_cmd_serve)
    p = sub.add_parser("serve-keys", help="manage the API keys of plexrl serve's tenants")
    p.add_argument("action", choices=("add",))
    p.add_argument("file", help="the keys file (created if missing)")
    p.add_argument("tenant")
    p.set_defaults(fn=_cmd_serve_keys)
    args = parser.parse_args(argv)
    if args.command == "simulate" and not args.policy:
        args.policy = list(POLICIES)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        return int(args.fn(args))
    except PlexRLError as e:  # the user's input or cluster, not a bug: no traceback
        err_console.print(f"[red]plexrl {args.command}: {type(e).__name__}: {e}[/red]")
        return 2
    except OSError as e:  # e.g. no scheduler at the address given
        err_console.print(f"[red]plexrl {args.command}: {e}[/red]")
        return 2



if __name__ == "__main__":
    raise SystemExit(main())
