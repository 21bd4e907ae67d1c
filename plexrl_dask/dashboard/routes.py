"""The JSON routes of the PlexRL dashboard, and the hook that adds the pages.

This module is listed in ``distributed.scheduler.http.routes`` by
:func:`plexrl_dask.dashboard.enable` (which the ``plexrl_dask.plugins`` preload calls on
import). A scheduler reads its route modules' ``routes`` while it is being constructed, after
its preloads and *before* it builds its Bokeh dashboard; so that read (:func:`__getattr__`) is
the moment to insert the pages into ``distributed.dashboard.scheduler.applications``, where
they appear in the "More…" menu and in ``/individual-plots.json``. Only a scheduler that shows
a dashboard has imported ``distributed.dashboard.scheduler`` by then, so Bokeh is never
imported for nothing.

Routes (each a GET returning the dashboard plugin's view as JSON, see
:mod:`plexrl_dask.dashboard.state`):

- ``/plexrl/timeline.json?limit=N`` — spans of the Timeline window (newest N), per-worker
  busy/setup/idle, what runs now;
- ``/plexrl/residency.json`` — deployment × worker cells, bytes per tier per node, dedup;
- ``/plexrl/queue.json?limit=N`` — the top N pending requests, totals, recent decisions;
- ``/plexrl/jobs.json`` — per job: steps, rewards, charges, share, isolated estimate.

A scheduler without the dashboard plugin answers 404; a malformed ``limit`` 400
(:class:`~plexrl_dask.errors.InvalidDashboardQuery`).
"""

from __future__ import annotations

import json
import logging
import sys
from typing import Any

from distributed.http.utils import RequestHandler

from plexrl_dask.dashboard.state import PlexRLDashboardPlugin, dashboard_of, finite
from plexrl_dask.errors import InvalidDashboardQuery

logger = logging.getLogger(__name__)

#: Largest ``limit`` a route accepts.
MAX_LIMIT = 100_000


class _ViewHandler(RequestHandler):
    """GET: the dashboard plugin's view as JSON (subclasses pick the view)."""

    takes_limit = False

    def view(self, plugin: PlexRLDashboardPlugin, limit: int | None) -> dict[str, Any]:
        raise NotImplementedError

    def get(self) -> None:
        self.set_header("Content-Type", "application/json")
        plugin = dashboard_of(self.server)
        if plugin is None:
            self.set_status(404)
            self.write(
                json.dumps(
                    {
                        "error": "NotInstalled",
                        "message": "the PlexRL dashboard plugin is not installed on this "
                        "scheduler (preload plexrl_dask.plugins, or plexrl_dask.install(client))",
                    }
                )
            )
            return
        try:
            limit = self._limit()
        except InvalidDashboardQuery as e:
            self.set_status(400)
            self.write(json.dumps({"error": type(e).__name__, "message": str(e)}))
            return
        self.write(json.dumps(finite(self.view(plugin, limit)), allow_nan=False))

    def _limit(self) -> int | None:
        raw = self.get_query_argument("limit", None)
        if raw is None:
            return None
        if not self.takes_limit:
            raise InvalidDashboardQuery(f"{self.request.path} takes no limit")
        try:
            limit = int(raw)
        except ValueError:
            raise InvalidDashboardQuery(f"limit must be an integer, got {raw!r}") from None
        if not 1 <= limit <= MAX_LIMIT:
            raise InvalidDashboardQuery(f"limit must be in [1, {MAX_LIMIT}], got {limit}")
        return limit


class TimelineJSON(_ViewHandler):
    takes_limit = True

    def view(self, plugin: PlexRLDashboardPlugin, limit: int | None) -> dict[str, Any]:
        return plugin.timeline_view(limit=limit)


class ResidencyJSON(_ViewHandler):
    def view(self, plugin: PlexRLDashboardPlugin, limit: int | None) -> dict[str, Any]:
        return plugin.residency_view()


class QueueJSON(_ViewHandler):
    takes_limit = True

    def view(self, plugin: PlexRLDashboardPlugin, limit: int | None) -> dict[str, Any]:
        return plugin.queue_view(limit=limit)


class JobsJSON(_ViewHandler):
    def view(self, plugin: PlexRLDashboardPlugin, limit: int | None) -> dict[str, Any]:
        return plugin.jobs_view()


#: The routes (served as ``routes``, see :func:`__getattr__`).
ROUTES: list[tuple[str, type, dict[str, Any]]] = [
    ("plexrl/timeline.json", TimelineJSON, {}),
    ("plexrl/residency.json", ResidencyJSON, {}),
    ("plexrl/queue.json", QueueJSON, {}),
    ("plexrl/jobs.json", JobsJSON, {}),
]


def _routed(router: Any) -> bool:
    """Whether a tornado router (recursively) already serves one of these handlers."""
    for rule in getattr(router, "rules", ()):
        target = rule.target
        if isinstance(target, type) and issubclass(target, _ViewHandler):
            return True
        if _routed(target):
            return True
    return False


def add_routes(scheduler: Any) -> bool:
    """Serve the JSON routes on a running scheduler that did not get them at construction
    (``install(client)`` without the preload); returns whether they were added. Without the
    preload the pages themselves cannot join the dashboard menu (it is built once)."""
    app = getattr(scheduler, "http_application", None)
    if app is None or _routed(app.default_router):
        return False
    app.add_handlers(
        r".*",
        [(f"/{url}", cls, {**kwargs, "dask_server": scheduler}) for url, cls, kwargs in ROUTES],
    )
    logger.info("added the PlexRL dashboard JSON routes at runtime (no preload)")
    return True


def __getattr__(name: str) -> Any:
    """``routes``, which distributed's ``get_handlers`` reads from every module listed in
    ``distributed.scheduler.http.routes`` each time it constructs a scheduler: after the
    scheduler's preloads, before its dashboard. So this is where the pages join the dashboard
    (each time: a plain attribute would be read once per process, and this module may have
    been imported before any dashboard existed)."""
    if name == "routes":
        if "distributed.dashboard.scheduler" in sys.modules:  # this scheduler has a dashboard
            from plexrl_dask.dashboard import register_pages

            register_pages()
        return ROUTES
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
