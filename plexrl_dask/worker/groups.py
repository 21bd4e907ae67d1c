"""Worker process groups: the ``torch.distributed`` group of a multi-rank deployment.

A worker process has one default process group at a time, so it belongs to one multi-rank
deployment's group at a time. The scheduler plugin stamps every rank task of a gang with the
group's *epoch*: the same epoch as the last request when every rank's worker still holds that
group, a new one when any of them ran another group in between (or is new). A rank whose worker
holds another (deployment, epoch) tears its group down and joins the new one; since every rank of
the gang got the same epoch, they all rebuild together.

Rendezvous: rank 0 opens a ``TCPStore`` on a free port of its own host and publishes
``host:port`` through the scheduler plugin (``plexrl_rendezvous_put``, with the token the
scheduler released its request with: no one else may publish for the group); the other ranks read it
(``plexrl_rendezvous_get``, bounded by the group timeout). A group of one meets no one: it opens
a store of its own and needs no scheduler (``bench.device`` shards a model that way). Backend:
gloo on the CPU, NCCL on CUDA.
"""

from __future__ import annotations

import datetime
import logging
import pickle
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from distributed.comm.addressing import get_address_host
from distributed.utils import sync
from torch.distributed.device_mesh import init_device_mesh

from plexrl_dask import config, protocol
from plexrl_dask.errors import GroupTimeout, InvalidBatch, raise_for_status
from plexrl_dask.shared.records import group_key

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class GroupContext:
    """Which group a rank task belongs to: deployment incarnation, epoch, rank, size, replica."""

    uid: str
    epoch: int
    rank: int
    world_size: int
    #: Which replica's group (a tensor-parallel rollout has one group per replica).
    replica: int = 0
    #: What rank 0 presents to publish the group's address (the scheduler gave it to the
    #: request's rank 0 only: no one else can point the group's ranks elsewhere).
    token: str = field(default="", compare=False, repr=False)

    @property
    def key(self) -> str:
        return group_key(self.uid, self.replica, self.epoch)


def indexed(device: torch.device) -> torch.device:
    """``device`` with its index: an accelerator without one (``"cuda"``) is the current one.
    ``init_process_group`` binds NCCL to a ``device_id`` and refuses one without an index."""
    if device.type == "cpu" or device.index is not None:
        return device
    return torch.device(device.type, torch.cuda.current_device())


def group_timeout() -> float:
    return config.get_seconds("group.timeout")


class ProcessGroupManager:
    """Owns this worker process's default process group (see the module docstring)."""

    def __init__(self, worker: Any, device: str):
        """``worker``: the Dask worker whose scheduler relays the rendezvous (None is allowed
        for groups of one, which need none)."""
        self.worker = worker
        self.device = torch.device(device)
        self.current: GroupContext | None = None
        self._store: Any = None
        self.mesh: Any = None

    def holds(self, ctx: GroupContext) -> bool:
        return self.current is not None and self.current.key == ctx.key

    def owner(self) -> str | None:
        """The deployment uid whose group this process holds, if any."""
        return self.current.uid if self.current is not None else None

    def join(self, ctx: GroupContext) -> Any:
        """Tear down any other group, join ``ctx``'s group and return its 1-D device mesh."""
        if self.holds(ctx):
            return self.mesh
        self.leave()
        timeout = group_timeout()
        td = datetime.timedelta(seconds=timeout)
        if ctx.world_size == 1:
            # A group of one has no peer to meet: a store of its own, nothing published.
            store = dist.TCPStore("127.0.0.1", 0, 1, True, td, wait_for_workers=False)
        else:
            store = self._rendezvous(ctx, timeout, td)
        backend = "nccl" if self.device.type == "cuda" else "gloo"
        try:
            dist.init_process_group(
                backend,
                store=dist.PrefixStore(ctx.key, store),
                rank=ctx.rank,
                world_size=ctx.world_size,
                timeout=td,
                **({"device_id": indexed(self.device)} if self.device.type == "cuda" else {}),
            )
        except RuntimeError as e:
            raise GroupTimeout(f"process group {ctx.key} did not form: {e}") from e

        self._store = store
        self.current = ctx
        # A mesh name unique to this group: torch interns equal meshes, and a mesh equal to an
        # earlier group's (same shape, device, names) came back with that group's coordinate
        # for this process, i.e. its old rank (torch 2.13; reproduced with two processes).
        name = "plexrl_" + "".join(c if c.isalnum() else "_" for c in ctx.key)
        self.mesh = init_device_mesh(self.device.type, (ctx.world_size,), mesh_dim_names=(name,))
        logger.info(
            "joined group %s as rank %d/%d (%s)", ctx.key, ctx.rank, ctx.world_size, backend
        )
        return self.mesh

    def _rendezvous(self, ctx: GroupContext, timeout: float, td: datetime.timedelta) -> Any:
        """The group's ``TCPStore``: rank 0 opens it and publishes its address through the
        scheduler; the other ranks read the address and connect."""

        if self.worker is None:
            raise GroupTimeout(f"group {ctx.key} of {ctx.world_size} needs a Dask worker to meet")
        host = get_address_host(self.worker.address)
        rpc = self.worker.scheduler
        if ctx.rank == 0:
            store = dist.TCPStore(host, 0, ctx.world_size, True, td, wait_for_workers=False)
            raise_for_status(
                sync(
                    self.worker.loop,
                    getattr(rpc, protocol.RENDEZVOUS_PUT),
                    key=ctx.key,
                    address=f"{host}:{store.port}",
                    token=ctx.token,
                    callback_timeout=timeout,
                )
            )
        else:
            status = sync(
                self.worker.loop,
                getattr(rpc, protocol.RENDEZVOUS_GET),
                key=ctx.key,
                timeout=timeout,
                callback_timeout=timeout + 5,
            )
            address = raise_for_status(status)["address"]
            master, port = address.rsplit(":", 1)
            try:
                store = dist.TCPStore(master, int(port), ctx.world_size, False, td)
            except RuntimeError as e:
                raise GroupTimeout(
                    f"rank {ctx.rank} could not reach rank 0 at {address}: {e}"
                ) from e
        return store

    def leave(self) -> None:
        if self.current is None:
            return
        try:
            dist.destroy_process_group()
        finally:
            logger.info("left group %s", self.current.key)
            self.current, self.mesh, self._store = None, None, None

    def all_ok(self, ok: bool) -> bool:
        """True iff ``ok`` holds on every rank (one tiny all-reduce)."""
        flag = torch.tensor([1.0 if ok else 0.0], device=self.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
        return bool(flag.item() == 1.0)


def portable_error(error: Exception) -> Exception:
    """``error`` if it pickles (to travel to the other ranks), else a typed stand-in."""
    try:
        pickle.loads(pickle.dumps(error))
        return error
    except Exception:
        return InvalidBatch(f"another rank's part of this request failed: {error!r}")
