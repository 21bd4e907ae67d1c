"""Execution backends: what runs a deployment's requests on one worker's device."""

from plexrl_dask.worker.backends.base import RolloutBackend, TrainBackend
from plexrl_dask.worker.backends.torch_backend import TorchBackend
from plexrl_dask.worker.backends.vllm_backend import VLLMBackend

#: Backends by the name ``deploy(backend=...)`` takes. (The vLLM module imports ``vllm`` only
#: when a replica is built, so this registry loads everywhere.)
BACKENDS: dict[str, type] = {"torch": TorchBackend, "vllm": VLLMBackend}

__all__ = ["BACKENDS", "RolloutBackend", "TorchBackend", "TrainBackend", "VLLMBackend"]
