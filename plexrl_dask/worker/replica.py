"""One replica a holder holds (:class:`Replica`), and what a request's op does to its state.

The holder (:mod:`plexrl_dask.worker.holder`) keeps one :class:`Replica` per deployment it
holds: the backend, when it was last used, whether its state has left what its spec builds
(``modified``), the stored copy of an offloaded state (``stash``) and the last residency report
sent for it. Ops fall in three sets by what they do to that state: :data:`TRAINING_OPS` train
(one that runs out of device memory drops pending gradients), :data:`MUTATING_OPS` change it away
from what its spec builds, and :data:`CHANGING_OPS` make its stored copy stale.

Part of the worker package's face, as the holder is: the scheduler imports the holder's names,
so this module imports neither torch nor the engine (the stash types are annotations only).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from plexrl_dask.policy.residency import ResidencyReport
    from plexrl_dask.shared.records import DeploymentInfo
    from plexrl_dask.worker.offload import Stasher, StoredState

#: The ops that train: a request of one that runs out of memory drops pending gradients.
TRAINING_OPS = frozenset({"forward_backward", "train_step", "optim_step"})
#: The ops that change a replica's state away from what its spec builds.
MUTATING_OPS = frozenset({"optim_step", "train_step", "set_weights", "load_state", "load_weights"})
#: The ops after which an offload must write the state again (gradients count; an adapter
#: bank's adapters are its state, but not a change of its weights: a bank rebuilt after its
#: worker left is empty, not refused).
CHANGING_OPS = MUTATING_OPS | {"forward_backward", "load_adapter", "drop_adapter"}


def shared_bytes(backend: Any) -> int:
    """The backend's share of a model it shares with other replicas (a LoRA adapter's of its
    base, an unmodified rollout replica's of its spec's model), 0 for any other."""
    share = getattr(backend, "shared_bytes", None)
    return 0 if share is None else int(share())


def reload_bytes(backend: Any) -> int:
    """Device bytes bringing ``backend`` back takes (a shared model too, unless held)."""
    reload = getattr(backend, "reload_bytes", None)
    return backend.state_bytes() if reload is None else reload()


@dataclass
class Replica:
    """One deployment's replica on a holder, resident or offloaded (see the module docstring)."""

    info: DeploymentInfo
    backend: Any
    last_used: float
    modified: bool = False
    last_transition_s: float = 0.0
    stasher: Stasher | None = None
    stash: StoredState | None = None  # the stored copy of the state, while it is current
    tier: str = "hbm"  # last reported tier
    last_report: ResidencyReport | None = None  # the last report sent for this replica
    # Held for the whole of this replica's offload or reload: a prefetch may reload it while
    # another replica's request runs, and its own request then waits for that reload.
    transition: threading.Lock = field(default_factory=threading.Lock)

    def free_stash(self) -> None:
        """Forget the stored copy, which no longer is this replica's state (deleted in the
        background; the next offload writes the state again)."""
        if self.stash is not None:
            stale, self.stash = self.stash, None
            threading.Thread(target=stale.delete, name="plexrl-free-stash", daemon=True).start()

    def after_failure(self, op: str) -> None:
        """A request of ``op`` failed. One that changes the state may have changed it part-way
        (gradients it accumulated, then dropped): the stored copy is no longer known to be this
        state, and a reload must not bring the old one back."""
        if op in CHANGING_OPS:
            self.free_stash()

    def after_success(self, op: str) -> None:
        """A request of ``op`` ran: mark the state modified where it left what the spec builds,
        forget the prefix cache's keys of weights it replaced, and the stored copy it made
        stale."""
        if op in MUTATING_OPS:
            self.modified = True
            forget = getattr(self.backend, "forget_prefixes", None)
            if forget is not None:  # (the prefix cache holds the old weights' keys)
                forget()
        elif op == "forward_backward":
            # Pending gradients are state a rebuilt replica would not have: were its worker
            # to leave before the step, its next micro-batches would accumulate on a fresh
            # replica and the step apply part of the batch, silently. Modified, it is lost
            # instead (the job goes back to its checkpoint).
            self.modified = True
        if op in CHANGING_OPS:
            self.free_stash()

    def status(self) -> dict[str, Any]:
        """This replica's entry in the holder's ``status()``."""
        cache = getattr(self.backend, "prefix_cache", None)
        return {
            "uid": self.info.uid,
            "resident": self.backend.resident,
            "tier": self.tier,
            "stored_as": None if self.stash is None else f"{self.stash.model}/{self.stash.version}",
            "bytes": self.backend.state_bytes(),
            "version": self.backend.version,
            "modified": self.modified,
            "prefix_cache": None if cache is None else cache.stats(),
        }
