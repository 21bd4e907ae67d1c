"""Which process group each worker holds, so that a gang is told whether to reuse its group.

A multi-rank request runs its ranks as one ``torch.distributed`` group. Forming a group costs a
rendezvous, so ranks keep theirs between requests; the scheduler hands every rank of a released
gang the group's **epoch**: unchanged while each of its workers still holds that deployment's
group of that epoch, a new one otherwise (a worker left, a rank failed, the gang moved), which
tells the ranks to form a new group (:mod:`plexrl_dask.worker.groups`).
"""

from __future__ import annotations


class GroupEpochs:
    """Epochs of deployments' process groups and what each worker holds (see the module
    docstring). A group is a deployment incarnation ``uid`` and the index of its replica
    (each replica of a tensor-parallel rollout is a group of its own)."""

    def __init__(self) -> None:
        self._epochs: dict[tuple[str, int], int] = {}  # (uid, replica) -> epoch of its group
        self._held: dict[str, tuple[str, int, int]] = {}  # worker -> (uid, replica, epoch)

    def epoch_for(self, uid: str, workers: tuple[str, ...], replica: int = 0) -> int:
        """The epoch the gang of ``uid``'s ``replica`` on ``workers`` runs under (and record
        that they hold it)."""
        epoch = self._epochs.get((uid, replica), 0)
        if not all(self._held.get(w) == (uid, replica, epoch) for w in workers):
            epoch += 1
            self._epochs[(uid, replica)] = epoch
        for w in workers:
            self._held[w] = (uid, replica, epoch)
        return epoch

    def broken(self, uid: str) -> None:
        """A rank of ``uid`` failed: its group may be unusable, the next gang forms a new one."""
        for w in [w for w, held in self._held.items() if held[0] == uid]:
            del self._held[w]

    def forget(self, uid: str) -> None:
        """``uid`` was undeployed."""
        self.broken(uid)
        for key in [key for key in self._epochs if key[0] == uid]:
            del self._epochs[key]

    def worker_left(self, worker: str) -> None:
        self._held.pop(worker, None)
