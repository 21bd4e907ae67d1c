"""Configuration: the ``plexrl`` namespace of ``dask.config`` and typed views of it.

Defaults live in ``plexrl.yaml`` next to this module and are merged into ``dask.config`` on
import, so every process that imports ``plexrl_dask`` (client, scheduler, workers) sees the
same defaults, and users override them the usual Dask ways.
"""

from __future__ import annotations

import ast
import math
import numbers
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

import dask.config
import yaml
from dask.utils import parse_bytes, parse_timedelta

from plexrl_dask.errors import ConfigError

if TYPE_CHECKING:
    from plexrl_dask.policy.spatiotemporal import PlacementConfig

_DEFAULTS_PATH = os.path.join(os.path.dirname(__file__), "plexrl.yaml")

with open(_DEFAULTS_PATH) as _f:
    _defaults = yaml.safe_load(_f)

dask.config.update_defaults(_defaults)


def get(key: str) -> object:
    """Return ``plexrl.<key>`` from ``dask.config``."""
    return dask.config.get(f"plexrl.{key}")


def count(label: str, value: object) -> int:
    """``value`` as an int if it is an integer >= 1 (any integral type but a bool: a numpy
    integer too), else :class:`ConfigError` naming ``label``: how many workers, GPUs, ranks
    or replicas a caller asked for."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise ConfigError(f"{label} must be an integer >= 1, got {value!r}")
    return int(value)


def strings(label: str, value: object) -> list[str]:
    """``value`` as a list of strings: one string is a list of one (never split into its
    characters), a list or tuple of strings is itself; else :class:`ConfigError` naming
    ``label``: worker addresses, ops, a batch system's directive lines."""
    if isinstance(value, str):
        return [value]
    if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):
        raise ConfigError(f"{label} is a string or a list of strings, got {value!r:.80}")
    return list(value)


def seconds(label: str, value: object) -> float:
    """``value`` as float seconds if it is a finite number > 0 (not a bool), else
    :class:`ConfigError` naming ``label``: a timeout a caller passed."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not (
        math.isfinite(value) and value > 0
    ):
        raise ConfigError(f"{label} must be a finite number of seconds > 0, got {value!r}")
    return float(value)


def get_bytes(key: str) -> int:
    """Return ``plexrl.<key>`` as a byte count (an integer or a size such as ``"64MiB"``);
    :class:`ConfigError` unless it is a byte size >= 0."""
    value = get(key)
    try:
        parsed = int(parse_bytes(value)) if isinstance(value, str) else value
    except ValueError as e:
        raise ConfigError(f"plexrl.{key}: {e}") from None
    if isinstance(parsed, bool) or not isinstance(parsed, int) or parsed < 0:
        raise ConfigError(f"plexrl.{key} must be a byte size >= 0, got {value!r}")
    return parsed


def get_seconds(key: str, *, positive: bool = True) -> float:
    """Return ``plexrl.<key>`` parsed as a duration in seconds (a number of seconds or a
    string such as ``"2s"`` or ``"100ms"``).

    Raises :class:`ConfigError` for a missing (null) or unparsable value, and for one that is
    not finite, negative, or (with ``positive``, the default) zero: every duration here bounds
    a wait or sets an interval, and "no timeout" is not a setting this runtime offers."""
    raw = get(key)
    try:
        if raw is None:
            raise TypeError("null")
        value = float(parse_timedelta(raw, default="s"))
    except (TypeError, ValueError, KeyError) as e:
        raise ConfigError(f"plexrl.{key} must be a duration such as '30s', got {raw!r}") from e
    if not math.isfinite(value) or value < 0 or (positive and value == 0):
        bound = "> 0" if positive else ">= 0"
        raise ConfigError(f"plexrl.{key} must be a finite duration {bound}, got {raw!r}")
    return value


@dataclass(frozen=True)
class WorkerConfig:
    """How a PlexRL worker process runs its replicas (``plexrl.worker.*``)."""

    torch_threads: int
    device: str
    memory_budget: int | None  # None: decided from the device ("auto")
    gpu_resource: str
    timeline_length: int = 10_000
    profile_interval_s: float | None = None  # None: Dask's own

    def __post_init__(self) -> None:
        if self.profile_interval_s is not None and not self.profile_interval_s > 0:
            raise ConfigError(
                f"plexrl.worker.profile-interval must be > 0 or null, got {self.profile_interval_s}"
            )

    @classmethod
    def from_dask_config(cls) -> WorkerConfig:
        """The worker's settings, each checked (:class:`ConfigError` naming the key): read
        where the worker starts, so that a wrong one is said there, not deep in a request."""
        budget = get("worker.memory-budget")
        profile = get("worker.profile-interval")
        resource = get("worker.gpu-resource")
        if not isinstance(resource, str) or not resource:
            raise ConfigError(f"plexrl.worker.gpu-resource is a resource name, got {resource!r}")
        return cls(
            torch_threads=count("plexrl.worker.torch-threads", get("worker.torch-threads")),
            device=str(get("worker.device")),
            memory_budget=None if budget in (None, "auto") else get_bytes("worker.memory-budget"),
            gpu_resource=resource,
            timeline_length=count("plexrl.worker.timeline-length", get("worker.timeline-length")),
            profile_interval_s=None if profile is None else get_seconds("worker.profile-interval"),
        )


@dataclass(frozen=True)
class DashboardConfig:
    """Bounds and intervals of the PlexRL dashboard pages (``plexrl.dashboard.*``)."""

    update_interval_s: float
    queue_rows: int
    decisions_shown: int
    timeline_window_s: float
    spans_kept: int
    timeline_batch: int
    idle_lanes_per_update: int
    span_poll_interval_s: float
    node_poll_interval_s: float
    poll_timeout_s: float
    residency_cells: int
    jobs_shown: int
    steps_kept: int
    curves_per_update: int = 4

    def __post_init__(self) -> None:
        for name, value in vars(self).items():
            if not value > 0:
                raise ConfigError(
                    f"plexrl.dashboard.{name.replace('_', '-')} must be > 0, got {value!r}"
                )

    @classmethod
    def from_dask_config(cls) -> DashboardConfig:
        try:
            return cls(
                update_interval_s=get_seconds("dashboard.update-interval"),
                queue_rows=int(get("dashboard.queue-rows")),
                decisions_shown=int(get("dashboard.decisions-shown")),
                timeline_window_s=get_seconds("dashboard.timeline-window"),
                spans_kept=int(get("dashboard.spans-kept")),
                timeline_batch=int(get("dashboard.timeline-batch")),
                idle_lanes_per_update=int(get("dashboard.idle-lanes-per-update")),
                span_poll_interval_s=get_seconds("dashboard.span-poll-interval"),
                node_poll_interval_s=get_seconds("dashboard.node-poll-interval"),
                poll_timeout_s=get_seconds("dashboard.poll-timeout"),
                residency_cells=int(get("dashboard.residency-cells")),
                jobs_shown=int(get("dashboard.jobs-shown")),
                steps_kept=int(get("dashboard.steps-kept")),
                curves_per_update=int(get("dashboard.curves-per-update")),
            )
        except (TypeError, ValueError, KeyError) as e:
            if isinstance(e, ConfigError):
                raise
            raise ConfigError(f"invalid plexrl.dashboard setting: {e}") from e


def request_timeout() -> float:
    """Seconds any client-side wait on a PlexRL request may take before it fails."""
    return get_seconds("request.timeout")


def batch_interval() -> float | None:
    """``plexrl.comm.batch-interval`` in seconds: the interval PlexRL sets on Dask's batched
    streams (see :func:`tune_batched_send`); None (null) leaves Dask's."""
    return (
        None
        if get("comm.batch-interval") is None
        else get_seconds("comm.batch-interval", positive=False)
    )


def tune_batched_send(stream: object, interval: float | None = None) -> bool:
    """Set a Dask ``BatchedSend``'s interval to ``interval`` (default :func:`batch_interval`);
    False where there is none to set (null, or no such stream). A ``BatchedSend`` reads
    ``interval`` before each send, so this takes effect on a running stream."""
    interval = batch_interval() if interval is None else interval
    if interval is None or not isinstance(getattr(stream, "interval", None), (int, float)):
        return False
    stream.interval = interval  # type: ignore[attr-defined]
    return True


def placement_config() -> PlacementConfig:
    """The spatiotemporal placement's configuration (``plexrl.placement.*``)."""
    from plexrl_dask.policy.spatiotemporal import PlacementConfig

    try:
        return PlacementConfig(
            slots=int(get("placement.slots")),
            reserve_quantile=float(get("placement.reserve-quantile")),
            profile_iterations=int(get("placement.profile-iterations")),
            group_nodes=int(get("placement.group-nodes")),
            packing=str(get("placement.packing")),
            max_padding=float(get("placement.max-padding")),
            max_skips=int(get("placement.max-skips")),
            late_tolerance=float(get("placement.late-tolerance")),
            horizon_periods=int(get("placement.horizon-periods")),
            group_peaks=float(get("placement.group-peaks")),
            reuse_traces=bool(get("placement.reuse-traces")),
        )
    except (TypeError, ValueError, KeyError) as e:
        if isinstance(e, ConfigError):
            raise
        raise ConfigError(f"invalid plexrl.placement setting: {e}") from e


#: Settings that :func:`shipped_settings` never ships: the operator's secret (a job script or a
#: pod spec is no place for it: give the scheduler its own), the node id of the machine that
#: set it, the scheduler's journal (a path on the driver's machine), and the front door's and
#: the local cluster's, read only in the process that set them.
NOT_SHIPPED = ("operator-secret", "state.node-id", "scheduler.journal", "serve", "local-cluster")


def shipped_settings() -> dict[str, str]:
    """The environment that gives a process started elsewhere (a SLURM job's workers, a
    Kubernetes pod) this process's PlexRL settings: a ``DASK_PLEXRL__...`` variable for each
    ``plexrl.*`` setting that differs from PlexRL's defaults, except :data:`NOT_SHIPPED`.
    A setting whose default is a non-empty mapping is shipped key by key, any other whole.
    Values are Python literals (``repr``), which Dask reads back with ``ast.literal_eval``:
    a string stays a string, ``None`` stays null; :class:`ConfigError` names a setting whose
    value would not come back as it is (a path object, an infinity). Keys are compared in
    their hyphenated form: a setting made by a ``DASK_PLEXRL__...`` variable keeps its
    underscores in Dask's config."""
    env: dict[str, str] = {}

    def walk(value: object, default: object, path: tuple[str, ...]) -> None:
        if ".".join(path) in NOT_SHIPPED:
            return
        if isinstance(value, dict) and isinstance(default, dict) and default:
            for key in value:
                name = str(key).replace("_", "-")
                walk(value[key], default.get(name, _ABSENT), (*path, name))
        elif value != default:
            text = repr(value)
            try:
                same = ast.literal_eval(text) == value
            except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
                same = False
            if not same:
                raise ConfigError(
                    f"plexrl.{'.'.join(path)} = {text:.80} cannot be given to workers started "
                    "elsewhere: use a plain number, string, bool, list or mapping"
                )
            name = "__".join(p.upper().replace("-", "_") for p in ("plexrl", *path))
            env[f"DASK_{name}"] = text

    walk(dask.config.get("plexrl"), _defaults["plexrl"], ())
    return env


_ABSENT = object()
