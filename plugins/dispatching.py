"""The dispatch policy the scheduler plugin runs under, and its queue as that policy ranks it.

The policy core (:mod:`plexrl_dask.policy.dispatch`) decides which request runs where; this
module is the plugin's side of it: the :class:`~plexrl_dask.policy.dispatch.DispatchPolicy`
configured under ``plexrl.scheduler`` (:func:`dispatch_policy_from_config`), the one the
operator asks for instead (:func:`requested_policy`, for the ``set_policy`` handler, which
checks who asks and when), and the queue of admitted requests with each one's current ratio
and best group, as ``status`` and the dashboard show it (:func:`queue_view`). Pure functions:
the plugin (:mod:`plexrl_dask.plugins.scheduler`) holds the policy and the dispatcher.
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from typing import Any

import dask

from plexrl_dask import config
from plexrl_dask.errors import ConfigError
from plexrl_dask.plugins.requests import RequestQueue
from plexrl_dask.policy.dispatch import Dispatcher, DispatchPolicy


def dispatch_policy_from_config(
    ordering: str | None = None, choice: str | None = None
) -> DispatchPolicy:
    """The dispatch rule configured under ``plexrl.scheduler``, with ``ordering`` ("hrrs" or
    "fifo") and ``choice`` ("residency" or "blind") overriding the configured ones."""
    ordering = ordering or str(config.get("scheduler.ordering"))
    if dask.config.get("plexrl.scheduler.placement", None) is not None:
        raise ConfigError(
            "plexrl.scheduler.placement was renamed plexrl.scheduler.replica-choice "
            '("placement" is placing jobs into node groups)'
        )
    choice = choice or str(config.get("scheduler.replica-choice"))
    if ordering not in ("hrrs", "fifo"):
        raise ConfigError(f"ordering must be 'hrrs' or 'fifo', got {ordering!r}")
    lookahead = config.get("scheduler.lookahead")
    fair_share = config.get("scheduler.fair-share")
    for key, value in (("lookahead", lookahead), ("fair-share", fair_share)):
        if not isinstance(value, bool):
            raise ConfigError(f"scheduler.{key} must be true or false, got {value!r}")
    weights = config.get("scheduler.job-weights") or {}
    if not isinstance(weights, dict):
        raise ConfigError(f"scheduler.job-weights maps job -> weight, got {weights!r}")
    gang_hold = config.get_seconds("scheduler.gang-hold", positive=False)
    turn_hold = config.get_seconds("scheduler.turn-hold", positive=False)
    try:
        if ordering == "fifo":
            return DispatchPolicy.fifo(
                choice, lookahead=lookahead, gang_hold_s=gang_hold, turn_hold_s=turn_hold
            )
        return DispatchPolicy(
            setup_weight=float(config.get("scheduler.setup-weight")),
            patience_factor=float(config.get("scheduler.patience-factor")),
            patience_floor_s=config.get_seconds("scheduler.patience-floor", positive=False),
            choice=choice,
            lookahead=lookahead,
            fair_share=fair_share,
            job_weights=tuple(sorted((str(j), w) for j, w in weights.items())),
            gang_hold_s=gang_hold,
            turn_hold_s=turn_hold,
        )
    except ValueError as e:
        raise ConfigError(str(e)) from e


def requested_policy(
    *,
    ordering: str | None = None,
    choice: str | None = None,
    setup_weight: float | None = None,
    patience_factor: float | None = None,
    patience_floor_s: float | None = None,
    lookahead: bool | None = None,
    fair_share: bool | None = None,
    gang_hold_s: float | None = None,
    turn_hold_s: float | None = None,
) -> DispatchPolicy:
    """The policy the operator asks for: the configured one (:func:`dispatch_policy_from_config`
    with ``ordering`` and ``choice``) with each knob given instead of its configured value.
    ``lookahead`` and ``fair_share`` must be booleans, ``gang_hold_s`` and ``turn_hold_s``
    seconds; the HRRS knobs (``setup_weight``, ``patience_factor``, ``patience_floor_s``)
    apply only to "hrrs" ordering (asked for, else configured) and are ignored under "fifo".
    :class:`ConfigError` for a bad value."""
    switches = {"lookahead": lookahead, "fair_share": fair_share}
    for key, value in switches.items():
        if value is not None and not isinstance(value, bool):
            raise ConfigError(f"{key} must be true or false, got {value!r}")
    policy = dispatch_policy_from_config(ordering, choice)
    given: dict[str, Any] = {k: v for k, v in switches.items() if v is not None}
    for key, value in (("gang_hold_s", gang_hold_s), ("turn_hold_s", turn_hold_s)):
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ConfigError(f"{key} must be seconds, got {value!r}")
        given[key] = float(value)
    if given:
        policy = _replaced(policy, given)
    knobs = {
        "setup_weight": setup_weight,
        "patience_factor": patience_factor,
        "patience_floor_s": patience_floor_s,
    }
    if (ordering or config.get("scheduler.ordering")) == "hrrs":
        policy = _replaced(policy, {k: v for k, v in knobs.items() if v is not None})
    return policy


def _replaced(policy: DispatchPolicy, changes: dict[str, Any]) -> DispatchPolicy:
    """``policy`` with ``changes``; :class:`ConfigError` where it refuses them."""
    try:
        return dataclasses.replace(policy, **changes)
    except (ValueError, TypeError) as e:  # (a knob of the wrong type fails its comparisons)
        raise ConfigError(f"{e} (policy knobs: {changes})") from e


def queue_view(
    dispatcher: Dispatcher, requests: RequestQueue, limit: int, now: float | None = None
) -> dict[str, Any]:
    """The queue as plain data, for ``status`` and the dashboard: the first ``limit``
    admitted requests in arrival order (the longest-waiting), each with its current HRRS
    ratio and setup on its best live group (the cheapest setup, as the dispatcher ranks
    them; ``worker``: that group), plus totals: pending, admitted, busy workers (worker ->
    request running there), the requests queued behind them (lookahead; worker ->
    request), the free workers a hold keeps (worker -> seconds left and the holding jobs)
    and pending requests per deployment. Bounded by ``limit`` and the number of
    deployments, however long the queue is (it runs on the scheduler's event loop). ``now``:
    the dispatcher's clock (``time.monotonic()``), echoed in the result."""
    now = time.monotonic() if now is None else now
    # Requests of one deployment and candidate groups share their setup and best group:
    # look them up once per update (setup costs are the expensive part).
    memo: dict[tuple[str, tuple], tuple[float, tuple[str, ...]]] = {}
    rows = []
    for req in itertools.islice(dispatcher.pending(), limit):
        key = (req.deployment, req.groups)
        if key not in memo:
            memo[key] = dispatcher.best_group(req)
        setup, best = memo[key]
        wait = now - req.arrival
        ratio = dispatcher.policy.ratio(wait, req.service_s, setup) if best else 0.0
        rows.append(
            {
                "request": req.request,
                "deployment": req.deployment,
                "op": req.op,
                "job": req.job,
                "groups": [list(g) for g in req.groups],
                "worker": list(best),
                "wait_s": wait,
                "ratio": ratio,
                "service_s": req.service_s,
                "setup_s": setup,
                "urgent": dispatcher.is_urgent(req.request),
            }
        )
    return {
        "now": now,
        "pending": len(requests),
        "admitted": len(dispatcher),
        "busy": dispatcher.busy,
        "queued": dispatcher.queued,
        # free workers kept for a gang's or an agentic turn's next request, and until when
        "held": {
            w: {"for_s": max(0.0, until - now), "jobs": sorted(jobs)}
            for w, (until, jobs, _) in dispatcher.holds(now).items()
        },
        "by_deployment": requests.counts(),
        "by_job": requests.job_counts(),
        "top": rows,
    }
