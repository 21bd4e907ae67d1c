"""A nanny preload that gives each PlexRL worker of a machine with several GPUs one of them.

A PlexRL worker holds one unit of the GPU resource and puts its replicas on the device it calls
"cuda", so a machine (a Kubernetes pod, a batch job) with N GPUs runs N workers, each seeing
only its own GPU through ``CUDA_VISIBLE_DEVICES``::

    dask worker SCHEDULER --nworkers N --name X --nthreads 1 --resources GPU=1 \\
        --preload-nanny plexrl_dask.gpu_nanny

The nannies are named ``X-0`` ... ``X-{N-1}``; nanny ``X-k`` starts its worker with the k-th
visible GPU (:func:`plexrl_dask.cluster.gpu_of_worker`, the rule ``local_cluster`` uses). It
sets nothing with fewer than two GPUs, for a name without a number (and warns: each such
worker would use the first GPU), or where ``distributed.nanny.environ`` already sets
``CUDA_VISIBLE_DEVICES``. It imports torch in the nanny's process to count the GPUs (the
CUDA driver, not a context on any GPU).
"""

from __future__ import annotations

import logging
from typing import Any

logger = logging.getLogger(__name__)


def dask_setup(nanny: Any) -> None:
    """Runs in the nanny before it starts its worker process (Dask's nanny preload hook)."""
    from plexrl_dask.cluster import CUDA_ENV, gpu_of_worker, visible_gpus

    if CUDA_ENV in nanny.env:
        return  # the site's own choice stands
    gpus = visible_gpus()
    gpu = gpu_of_worker(nanny.name, gpus)
    if gpu is not None:
        nanny.env[CUDA_ENV] = gpu
        logger.info("worker %s gets GPU %s of %s", nanny.name, gpu, gpus)
    elif len(gpus) > 1:
        logger.warning(
            "worker %r sees all of GPUs %s: its name has no number (dask worker --nworkers N "
            "--name X names them X-0 ... X-{N-1}), so every such worker uses the first",
            nanny.name,
            gpus,
        )
