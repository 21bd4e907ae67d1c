"""PlexRL on Dask: many RL-for-LLM jobs multiplexed onto one shared pool of model replicas.

The user-facing surface::

    import plexrl_dask as plexrl
    cluster = plexrl.local_cluster()
    client = Client(cluster)
    runtime = plexrl.Runtime(client, job="my-job")
    policy = runtime.deploy("policy", plexrl.ModelSpec.tiny())
    out = policy.sample(["12+34="], plexrl.SamplingParams(n=4)).result()
"""

from plexrl_dask import config as _config  # noqa: F401  (registers the dask.config defaults)
from plexrl_dask import errors, ops
from plexrl_dask.cluster import install, local_cluster
from plexrl_dask.models import ModelSpec
from plexrl_dask.service.runtime import Deployment, Runtime, result
from plexrl_dask.service.types import (
    AdamWParams,
    CrossEntropy,
    Datum,
    ForwardResult,
    NamedWeights,
    PolicyGradient,
    SampledSequence,
    SampleResult,
    SamplingParams,
)

__version__ = "0.1.0"

__all__ = [
    "AdamWParams",
    "CrossEntropy",
    "Datum",
    "Deployment",
    "ForwardResult",
    "ModelSpec",
    "NamedWeights",
    "PolicyGradient",
    "Runtime",
    "SampleResult",
    "SampledSequence",
    "SamplingParams",
    "errors",
    "install",
    "local_cluster",
    "ops",
    "result",
]
