"""``plexrl serve``: a Tinker-compatible front door to a PlexRL cluster.

An HTTP server (FastAPI on uvicorn) holding the cluster's Dask client, which speaks the wire
protocol of Thinking Machines' Tinker SDK (the version in :data:`~plexrl_dask.serve.wire.SDK_VERSION`),
so scripts written against ``tinker`` (and tinker-cookbook recipes) train and sample on PlexRL
deployments, multiplexed with every other job. Where each part lives:

- :mod:`.tenants`: API keys (hashed at rest) to tenants, each a PlexRL job, and their limits;
- :mod:`.wire`: the protocol's bodies to and from PlexRL's types (data, losses, sampling);
- :mod:`.service`: sessions, training models, samplers and promises, and the order of a
  model's requests (with :mod:`.sampling` and :mod:`.saving`, its sampling and checkpoint
  calls; :mod:`.checkpoints`, the saved checkpoints and exports);
- :mod:`.app`: the HTTP routes, the typed error replies, and :class:`.app.ServerThread`.

See ``docs/tinker.md``.
"""
