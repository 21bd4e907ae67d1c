"""The gangs' process groups: which group each worker holds, and where a new group meets.

A multi-rank request runs its ranks as one ``torch.distributed`` group. Forming a group costs a
rendezvous, so ranks keep theirs between requests; the scheduler hands every rank of a released
gang the group's **epoch**: unchanged while each of its workers still holds that deployment's
group of that epoch, a new one otherwise (a worker left, a rank failed, the gang moved), which
tells the ranks to form a new group (:mod:`plexrl_dask.worker.groups`).

A group that forms meets through the scheduler (:class:`Rendezvous`): its rank 0 publishes its
store's address, presenting the token its request was released with, and the other ranks wait
for that address (the ``plexrl_rendezvous_*`` handlers).
"""

from __future__ import annotations

import asyncio
import secrets
from collections import Counter
from typing import Any

from plexrl_dask import config
from plexrl_dask.errors import GroupTimeout, PermissionDenied, to_status

#: Groups whose token and address are kept (old groups' entries are never read again).
KEPT = 1024


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


class Rendezvous:
    """Where each group (a :func:`~plexrl_dask.shared.records.group_key`) meets: the token
    its rank 0 is released with and the address it publishes (see the module docstring). The
    newest :data:`KEPT` groups are kept; refusals count in ``counters``."""

    def __init__(self, counters: Counter[str]) -> None:
        self._counters = counters
        self._addresses: dict[str, str] = {}
        self._tokens: dict[str, str] = {}  # group key -> its rank 0's token
        self._events: dict[str, asyncio.Event] = {}

    def token(self, key: str) -> str:
        """The token rank 0 of group ``key`` presents to publish its address (a new one for
        a new group, the same for each rank 0 released into it)."""
        token = self._tokens.setdefault(key, secrets.token_hex(16))
        while len(self._tokens) > KEPT:  # (bounded like the addresses)
            self._tokens.pop(next(iter(self._tokens)))
        return token

    def put(self, key: str, address: str, token: str = "") -> dict[str, Any]:
        """Rank 0 of group ``key`` publishes its store's ``host:port``, presenting the token
        its request was released with (:class:`PermissionDenied` for any other: a client
        cannot point a group's ranks at an address of its own)."""
        expected = self._tokens.get(key)
        if expected is None or not secrets.compare_digest(expected, str(token)):
            self._counters["rendezvous_refused"] += 1
            return to_status(
                PermissionDenied(
                    f"only rank 0 of group {key}, running its request, publishes its address"
                )
            )
        self._addresses[key] = address
        self._events.setdefault(key, asyncio.Event()).set()
        while len(self._addresses) > KEPT:  # bounded: old groups' entries are never read again
            old = next(iter(self._addresses))
            self._addresses.pop(old)
            self._events.pop(old, None)
        return {"status": "OK"}

    async def get(self, key: str, timeout: float) -> dict[str, Any]:
        """The ``host:port`` of group ``key``'s rank 0, waiting up to ``timeout`` seconds, at
        most ``plexrl.group.timeout`` (the caller's wait is the caller's to choose, not how
        long the scheduler keeps a wait open)."""
        limit = config.get_seconds("group.timeout")
        if isinstance(timeout, bool) or not isinstance(timeout, int | float) or timeout != timeout:
            return to_status(GroupTimeout(f"a rendezvous wait is a number, got {timeout!r}"))
        timeout = min(max(0.0, float(timeout)), limit)
        if key not in self._tokens:  # (a group the scheduler released has its token first)
            return to_status(PermissionDenied(f"no group {key} was released to meet here"))
        event = self._events.setdefault(key, asyncio.Event())
        while len(self._events) > 2 * KEPT:  # (bounded like the tokens)
            self._events.pop(next(iter(self._events)))
        try:
            await asyncio.wait_for(event.wait(), timeout)
        except TimeoutError:
            return to_status(
                GroupTimeout(f"rank 0 of group {key} did not publish its address in {timeout:.0f}s")
            )
        return {"status": "OK", "address": self._addresses[key]}
