"""Execution backends: what runs a deployment's requests on one worker's device."""

from plexrl_dask.service.backends.base import RolloutBackend, TrainBackend
from plexrl_dask.service.backends.torch_backend import TorchBackend

BACKENDS: dict[str, type] = {"torch": TorchBackend}

__all__ = ["BACKENDS", "RolloutBackend", "TorchBackend", "TrainBackend"]
