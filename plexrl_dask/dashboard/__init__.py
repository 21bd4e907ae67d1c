"""The PlexRL pages of the Dask dashboard (Bokeh) and their JSON routes.

Four pages, added to the scheduler's dashboard (its "More…" menu and ``/individual-plots.json``,
which the JupyterLab Dask extension reads):

- ``/individual-plexrl-timeline`` — per worker, a live Gantt of requests coloured by job
  (setup hatched, idle as gaps and per-worker idle fraction);
- ``/individual-plexrl-residency`` — deployment × worker tiers, bytes per tier per node, dedup;
- ``/individual-plexrl-queue`` — the top pending requests with their HRRS ratios, totals,
  and the reasons of the most recent decisions;
- ``/individual-plexrl-jobs`` — per job: steps, rewards, GPU-seconds charged, share of the
  pool, isolated cost estimate.

How they get there: :func:`enable` (called when ``plexrl_dask.plugins``, the scheduler
preload, is imported) lists :mod:`plexrl_dask.dashboard.routes` in
``distributed.scheduler.http.routes``; the scheduler imports it before it builds its dashboard,
which adds the pages (see that module). The data comes from the dashboard scheduler plugin
(:mod:`plexrl_dask.dashboard.state`); the Bokeh components are in
:mod:`plexrl_dask.dashboard.components`. Importing this package does not import Bokeh.
"""

from __future__ import annotations

import dask.config

ROUTES_MODULE = "plexrl_dask.dashboard.routes"
ROUTES_KEY = "distributed.scheduler.http.routes"

#: Page URL -> (component class name in plexrl_dask.dashboard.components, title).
PAGES = {
    "/individual-plexrl-timeline": ("TimelinePage", "PlexRL: Timeline"),
    "/individual-plexrl-residency": ("ResidencyPage", "PlexRL: Residency"),
    "/individual-plexrl-queue": ("QueuePage", "PlexRL: Queue"),
    "/individual-plexrl-jobs": ("JobsPage", "PlexRL: Jobs"),
}


def enable() -> None:
    """Make schedulers created from now on in this process serve the PlexRL pages and JSON
    routes (idempotent): lists the routes module in ``distributed.scheduler.http.routes``."""
    current = list(dask.config.get(ROUTES_KEY, default=None) or [])
    if ROUTES_MODULE not in current:
        dask.config.set({ROUTES_KEY: [*current, ROUTES_MODULE]})


def register_pages() -> None:
    """Insert the pages into ``distributed.dashboard.scheduler.applications`` (imports Bokeh).
    Schedulers whose dashboard is built afterwards list them; idempotent."""
    from distributed.dashboard.scheduler import applications

    from plexrl_dask.dashboard.components import page_doc

    for url, (cls, title) in PAGES.items():
        if url not in applications:
            applications[url] = page_doc(cls, title)


__all__ = ["PAGES", "enable", "register_pages"]
