"""Execution backends: what runs a deployment's requests on one worker's device."""

from plexrl_dask.worker.backends.adapters import AdapterBank
from plexrl_dask.worker.backends.base import RolloutBackend, TrainBackend
from plexrl_dask.worker.backends.fsdp import FSDPBackend
from plexrl_dask.worker.backends.lora import LoraBackend
from plexrl_dask.worker.backends.shared import SharedBases, SharedWeightsBackend
from plexrl_dask.worker.backends.torch_backend import TorchBackend
from plexrl_dask.worker.backends.tp import TPBackend
from plexrl_dask.worker.backends.vllm_backend import VLLMBackend

#: Backends by the name ``deploy(backend=...)`` takes, for one rank. (The vLLM module imports
#: ``vllm`` only when a replica is built, so this registry loads everywhere.) Several ranks of a
#: deployment run FSDP2 shards (training) or tensor-parallel slices (rollout); LoRA adapters
#: run on their worker's shared copy of their base, and so do adapter banks ("adapters").
BACKENDS: dict[str, type] = {"torch": TorchBackend, "vllm": VLLMBackend}

__all__ = [
    "BACKENDS",
    "AdapterBank",
    "FSDPBackend",
    "LoraBackend",
    "RolloutBackend",
    "SharedBases",
    "SharedWeightsBackend",
    "TPBackend",
    "TorchBackend",
    "TrainBackend",
    "VLLMBackend",
]
