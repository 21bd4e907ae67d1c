"""PlexRL on Dask: many RL-for-LLM jobs multiplexed onto one shared pool of model replicas.

The user-facing surface::

    import plexrl_dask as plexrl
    cluster = plexrl.local_cluster()
    client = Client(cluster)
    runtime = plexrl.Runtime(client, job="my-job")
    policy = runtime.deploy("policy", plexrl.ModelSpec.tiny())
    out = policy.sample(["12+34="], plexrl.SamplingParams(n=4)).result()
"""

from importlib import import_module
from typing import Any

from plexrl_dask import config as _config  # noqa: F401  (registers the dask.config defaults)
from plexrl_dask import errors

# The public names, imported on first use: a process that needs one part (the node's
# StateManager needs only the state store) does not pay for importing the whole stack.
_LAZY = {
    "ops": "plexrl_dask.worker.ops",
    "install": "plexrl_dask.cluster",
    "local_cluster": "plexrl_dask.cluster",
    "worker_info": "plexrl_dask.cluster",
    "slurm_cluster": "plexrl_dask.slurm",
    "kube_cluster_spec": "plexrl_dask.kubernetes",
    "ModelSpec": "plexrl_dask.models",
    "Deployment": "plexrl_dask.driver.deployment",
    "Runtime": "plexrl_dask.driver.runtime",
    "result": "plexrl_dask.driver.waits",
    "AdamWParams": "plexrl_dask.shared.types",
    "Chat": "plexrl_dask.shared.types",
    "CrossEntropy": "plexrl_dask.shared.types",
    "Datum": "plexrl_dask.shared.types",
    "ForwardBackwardResult": "plexrl_dask.shared.types",
    "ForwardResult": "plexrl_dask.shared.types",
    "GraphLoss": "plexrl_dask.shared.loss_graph",
    "NamedWeights": "plexrl_dask.shared.types",
    "PolicyGradient": "plexrl_dask.shared.types",
    "SampledSequence": "plexrl_dask.shared.types",
    "SampleResult": "plexrl_dask.shared.types",
    "SamplingParams": "plexrl_dask.shared.types",
    "TurnPrompt": "plexrl_dask.shared.types",
    "trace_loss": "plexrl_dask.driver.loss_trace",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'plexrl_dask' has no attribute {name!r}")
    value = import_module(module) if name == "ops" else getattr(import_module(module), name)
    globals()[name] = value
    return value


__version__ = "0.1.0"

__all__ = [
    "AdamWParams",
    "Chat",
    "CrossEntropy",
    "Datum",
    "Deployment",
    "ForwardBackwardResult",
    "ForwardResult",
    "GraphLoss",
    "ModelSpec",
    "NamedWeights",
    "PolicyGradient",
    "Runtime",
    "SampleResult",
    "SampledSequence",
    "SamplingParams",
    "TurnPrompt",
    "errors",
    "install",
    "kube_cluster_spec",
    "local_cluster",
    "ops",
    "result",
    "slurm_cluster",
    "trace_loss",
    "worker_info",
]
