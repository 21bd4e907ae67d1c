"""What runs in a job's driver process: the client-side router (:class:`~plexrl_dask.driver.runtime.Runtime`,
:class:`~plexrl_dask.driver.deployment.Deployment`), which turns API calls into annotated Dask tasks
and holds no deployment state. Job code built on it (GRPO, deployment modes) is in
:mod:`plexrl_dask.rl`."""
