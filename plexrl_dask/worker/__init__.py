"""What runs in a PlexRL worker process: the replica holder and its memory budget
(:mod:`~plexrl_dask.worker.holder`), the request functions Dask runs as tasks
(:mod:`~plexrl_dask.worker.ops`), the backends (torch, FSDP2, vLLM), decoding and seeded
sampling, offload to the node's store, process groups and replica checkpoints. The Dask worker
plugin that sets a worker up is ``plugins/worker.py`` (:mod:`plexrl_dask.plugins.worker`)."""
