"""Records every PlexRL process shares and sends over the wire: requests and results
(:mod:`~plexrl_dask.shared.types`), deployment records and their lifecycle
(:mod:`~plexrl_dask.shared.records`), request spans (:mod:`~plexrl_dask.shared.timeline`). The
names they travel under are :mod:`plexrl_dask.protocol`. Nothing here imports torch: the
scheduler loads these."""
