"""``plexrl serve``'s checkpoint calls: saving a training model's state by name
(``save_weights``, and ``save_weights_for_sampler`` with a ``path``), exporting its weights
for other tools (``save_weights_external``), and deleting a checkpoint with what it holds.

:class:`CheckpointCalls` is part of :class:`~plexrl_dask.serve.service.Service` (a base class
of it): its methods read and write the service's tables (``models``, ``saved``) on the
server's event loop and queue their work in the model's request order
(:meth:`~plexrl_dask.serve.service.Service.ordered`), as the rest of the service does. What a
checkpoint is, and how one is kept, listed and exported: :mod:`plexrl_dask.serve.checkpoints`.
"""

from __future__ import annotations

import asyncio
import re
import uuid
from typing import Any

from plexrl_dask.driver.waits import result, run_on_workers
from plexrl_dask.errors import (
    InvalidTinkerRequest,
    PlexRLError,
    TenantLimitExceeded,
    UnsupportedCall,
)
from plexrl_dask.serve import wire
from plexrl_dask.serve.checkpoints import (
    Checkpoint,
    expiry,
    export_bytes,
    remove_export,
    write_export,
)
from plexrl_dask.serve.records import Reply, TrainModel, json_reply
from plexrl_dask.serve.tenants import Tenant
from plexrl_dask.worker import ops


class CheckpointCalls:
    """The checkpoint calls of :class:`~plexrl_dask.serve.service.Service` (see the module
    docstring)."""

    async def save_weights(self, tenant: Tenant, body: dict) -> str:
        model = self.model(tenant, str(body.get("model_id")))
        return await self._save(tenant, model, wire.seq_id(body), "weights", body)

    async def _save(
        self, tenant: Tenant, model: TrainModel, seq_id: int, kind: str, body: dict
    ) -> str:
        """A named checkpoint (``body``'s ``path``, and ``ttl_seconds``: when it is deleted);
        one saved again under its name replaces the first, whose stored version is dropped."""
        try:
            path = _checkpoint_path(model, kind, body.get("path"))
            expires_at = expiry(body.get("ttl_seconds"))
        except PlexRLError:
            self.skip(model, seq_id)
            raise
        store_model = f"tinker-{tenant.name}-{uuid.uuid4().hex[:12]}"
        try:
            self._check_checkpoints(tenant, path)  # (early; again when it is kept)
        except PlexRLError:
            self.skip(model, seq_id)
            raise

        def reply(saved: dict) -> Reply:
            replaced = self.saved.by_path.get(path)
            try:
                self._check_checkpoints(tenant, path)
            except PlexRLError:
                asyncio.ensure_future(self.drop_version(dict(saved)))  # (nothing is kept)
                raise
            self.saved.add(Checkpoint(path, tenant.name, model.base, dict(saved), model.lora,
                                      expires_at=expires_at))  # fmt: skip
            if replaced is not None:
                asyncio.ensure_future(self._drop_stored(replaced))
            return json_reply({"path": path})

        return await self.ordered(
            tenant,
            model,
            seq_id,
            f"save_{kind}",
            lambda: model.deployment.save_state(model=store_model),
            reply,
        )

    def _check_checkpoints(self, tenant: Tenant, path: str) -> None:
        """:class:`TenantLimitExceeded` if a checkpoint saved at ``path`` would be one past
        the tenant's ``checkpoints`` (one saved again under its name replaces the first)."""
        if path in self.saved.by_path:
            return
        mine = sum(1 for c in self.saved.of_tenant(tenant.name) if not c.external)
        if mine >= tenant.limits.checkpoints:
            raise TenantLimitExceeded(
                f"tenant {tenant.name!r} has {mine} saved checkpoints (limit "
                f"{tenant.limits.checkpoints}); delete some, or save again under a name"
            )

    async def save_weights_external(self, tenant: Tenant, body: dict) -> str:
        """Export the model's weights for other tools (:mod:`.checkpoints`): the weights
        come to this server, which writes them under ``plexrl.serve.export-dir`` within the
        tenant's ``export-bytes``; a second export of one name replaces the first."""
        model = self.model(tenant, str(body.get("model_id")))
        seq_id = wire.seq_id(body)
        try:
            path = _checkpoint_path(model, "external_weights", body.get("path"))
            if body.get("age_encryption_recipients"):
                raise UnsupportedCall(
                    "encrypted exports (age_encryption_recipients) are not supported"
                )
            expires_at = expiry(body.get("ttl_seconds"))
        except PlexRLError:
            self.skip(model, seq_id)
            raise

        reserved: list[int] = []  # (the bytes this export reserved, until it is added)

        def submit() -> Checkpoint:
            weights = result(model.deployment.get_weights())
            # (the replaced export, if any, goes once this one is written)
            nbytes = weights.nbytes()
            self.saved.reserve_export(tenant.name, nbytes, tenant.limits.export_bytes, path)
            reserved.append(nbytes)
            try:
                directory = self.saved.export_dir_of(tenant.name)
                base_dir = self.catalog[model.base].path
                files = write_export(directory, weights.tensors, base_dir, model.lora)
                saved = {"format": "external", "dir": str(directory), "files": files}
                size = export_bytes(directory)
            except BaseException:
                self.saved.release_export(tenant.name, reserved.pop())
                raise
            return Checkpoint(path, tenant.name, model.base, saved, model.lora, size_bytes=size,
                              expires_at=expires_at)  # fmt: skip

        def reply(checkpoint: Checkpoint) -> Reply:
            replaced = self.saved.by_path.get(path)
            self.saved.add(checkpoint, reserved=reserved.pop() if reserved else 0)
            if replaced is not None:
                remove_export(replaced.saved["dir"])
            body = {"path": path, "size_bytes": checkpoint.size_bytes}
            return json_reply({**body, "type": "save_weights_external"})

        return await self.ordered(tenant, model, seq_id, "save_weights_external", submit, reply)

    async def delete(self, checkpoint: Checkpoint) -> None:
        """Forget ``checkpoint`` and delete what it holds: an export's files, a stored
        version on every node that has it (a sampler that loaded it keeps its weights)."""
        self.saved.remove(checkpoint)
        await self._drop_stored(checkpoint)

    async def _drop_stored(self, checkpoint: Checkpoint) -> None:
        """Drop ``checkpoint``'s version from every node's tiers (an export has none)."""
        stored = checkpoint.saved
        if not checkpoint.external and stored.get("format") == "store" and "model" in stored:
            await self.drop_version(stored)

    async def drop_version(self, stored: dict) -> None:
        """Drop a ``save_state`` result's version from every node's tiers."""
        await self.blocking(
            lambda: run_on_workers(
                self.client, ops.drop_checkpoint, stored["model"], int(stored["version"])
            )
        )


#: A checkpoint's name: what a URL path carries as it is (the SDK does not escape it: a '?',
#: '#', '%' or a name of dots would save a checkpoint that no delete or TTL call can name),
#: and short (every tenant's names are in the state file each change rewrites).
CHECKPOINT_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.:+=-]{0,127}")


def _checkpoint_path(model: TrainModel, kind: str, name: Any) -> str:
    """The ``tinker://<model>/<kind>/<name>`` path of a checkpoint named ``name``;
    :class:`InvalidTinkerRequest` unless ``name`` matches :data:`CHECKPOINT_NAME`."""
    if not isinstance(name, str) or not CHECKPOINT_NAME.fullmatch(name):
        shown = repr(name) if len(repr(name)) <= 80 else repr(name)[:77] + "..."
        raise InvalidTinkerRequest(
            "a checkpoint name is 1 to 128 letters, digits and '_.:+=-', not starting with "
            f"'.', ':', '+', '=' or '-': {shown}"
        )
    return f"tinker://{model.model_id}/{kind}/{name}"
