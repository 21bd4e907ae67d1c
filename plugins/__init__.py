"""PlexRL's Dask plugins (installed as ``plexrl_dask.plugins``).

Use as a preload on an existing scheduler::

    dask scheduler --preload plexrl_dask.plugins

The scheduler also gets the PlexRL dashboard pages and JSON routes (:mod:`plexrl_dask.dashboard`).
The scheduler plugin then registers the worker plugin on every worker, so workers need no
preload; they only need ``plexrl_dask`` installed and the GPU resource advertised
(``dask worker ... --resources GPU=1``).
"""

from __future__ import annotations

from typing import Any

from distributed import Scheduler

from plexrl_dask import dashboard
from plexrl_dask.dashboard.state import PlexRLDashboardPlugin
from plexrl_dask.plugins.scheduler import PlexRLSchedulerPlugin
from plexrl_dask.plugins.worker import PlexRLWorkerPlugin

# A scheduler imports its preloads before it builds its dashboard: listing the dashboard's route
# module now is what adds the PlexRL pages to it (plexrl_dask.dashboard.routes).
dashboard.enable()


def dask_setup(server: Any) -> None:
    """Preload hook: install the scheduler plugin and the dashboard's plugin on a scheduler
    (ignored on workers, which get their plugin from the scheduler)."""
    if isinstance(server, Scheduler):
        server.add_plugin(PlexRLSchedulerPlugin())
        server.add_plugin(PlexRLDashboardPlugin())


__all__ = ["PlexRLSchedulerPlugin", "PlexRLWorkerPlugin", "dask_setup"]
