"""The SDK's ``RestClient`` calls of ``plexrl serve``: training runs and checkpoints listed,
described and deleted, and the signed download URLs of exports (:mod:`.checkpoints`).

Each call answers at once from the server's tables (none is a promise); every lookup is
scoped to the calling tenant, and another tenant's run or checkpoint is
:class:`~plexrl_dask.errors.UnknownObject`, as one that never existed.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from plexrl_dask import config
from plexrl_dask.errors import InvalidTinkerRequest, UnknownObject
from plexrl_dask.serve import wire
from plexrl_dask.serve.checkpoints import UrlSigner, expiry, exported_file, page
from plexrl_dask.serve.tenants import Tenant

if TYPE_CHECKING:
    from plexrl_dask.serve.service import Service


class RestApi:
    """The REST calls over ``service``'s runs and checkpoints; download URLs are signed
    with a key of this process, valid for ``plexrl.serve.export-url-ttl``."""

    def __init__(self, service: Service) -> None:
        self.service = service
        self.signer = UrlSigner(config.get_seconds("serve.export-url-ttl"))

    def training_run(self, tenant: Tenant, run_id: str) -> dict:
        """A training run (a training model, while it runs and after) as the REST API
        describes it; the cookbook reads its ``user_metadata``."""
        run = self.service.run(tenant, run_id)
        saved = self.service.saved.of_run(tenant.name, run_id)

        def last(kind: str) -> dict | None:
            return next((c.describe() for c in reversed(saved) if c.kind == kind), None)

        return {
            "training_run_id": run_id,
            "base_model": run.base,
            "model_owner": tenant.name,
            "is_lora": run.lora is not None,
            "lora_rank": None if run.lora is None else run.lora["rank"],
            "corrupted": False,
            "last_request_time": run.created,
            "last_checkpoint": last("training"),
            "last_sampler_checkpoint": last("sampler"),
            "user_metadata": run.user_metadata or None,
        }

    def list_runs(self, tenant: Tenant, limit: Any, offset: Any) -> dict:
        """The tenant's training runs, newest first, a page of them."""
        runs = sorted(
            (r for r in self.service.runs.values() if r.tenant == tenant.name),
            key=lambda r: r.created,
            reverse=True,
        )
        shown, cursor = page(runs, limit, offset)
        return {"training_runs": [self.training_run(tenant, r.run_id) for r in shown],
                "cursor": cursor}  # fmt: skip

    def list_checkpoints(self, tenant: Tenant, run_id: str) -> dict:
        self.service.run(tenant, run_id)
        return {
            "checkpoints": [c.describe() for c in self.service.saved.of_run(tenant.name, run_id)]
        }

    def list_user_checkpoints(self, tenant: Tenant, limit: Any, offset: Any) -> dict:
        """The tenant's checkpoints of every run, newest first, a page of them."""
        shown, cursor = page(self.service.saved.of_tenant(tenant.name), limit, offset)
        return {"checkpoints": [c.describe() for c in shown], "cursor": cursor}

    def weights_info(self, tenant: Tenant, body: dict) -> dict:
        checkpoint = self.service.saved.owned(tenant.name, str(body.get("tinker_path")))
        lora = checkpoint.lora
        return {
            "base_model": checkpoint.base,
            "is_lora": lora is not None,
            "lora_rank": None if lora is None else lora["rank"],
            **wire.lora_flags(lora),
        }

    async def delete_checkpoint(self, tenant: Tenant, run_id: str, checkpoint_id: str) -> None:
        """Forget the checkpoint and delete what it holds: an export's files, a stored
        version on every node that has it (a sampler that loaded it keeps its weights)."""
        checkpoint = self.service.saved.owned(tenant.name, f"tinker://{run_id}/{checkpoint_id}")
        await self.service.delete(checkpoint)

    def set_ttl(self, tenant: Tenant, run_id: str, checkpoint_id: str, body: dict) -> None:
        """A checkpoint's time to live from now (``ttl_seconds``; None: it never expires)."""
        checkpoint = self.service.saved.owned(tenant.name, f"tinker://{run_id}/{checkpoint_id}")
        self.service.saved.set_expiry(checkpoint, expiry(body.get("ttl_seconds")))

    def export_urls(self, tenant: Tenant, run_id: str, checkpoint_id: str, base_url: str) -> dict:
        """Signed download URLs of an export's files (:class:`.checkpoints.UrlSigner`)."""
        checkpoint = self.service.saved.owned(tenant.name, f"tinker://{run_id}/{checkpoint_id}")
        if not checkpoint.external:
            raise InvalidTinkerRequest(f"{checkpoint.path} is not an export (external_weights/)")
        files = checkpoint.saved["files"]
        urls, expires = self.signer.urls(base_url, run_id, checkpoint_id, files)
        return {"urls": urls, "expires": expires}

    def export_file(
        self, run_id: str, checkpoint_id: str, file: str, expires: Any, signature: Any
    ) -> str:
        """The path of an export's file that a signed URL names (checked: no API key)."""
        self.signer.check(run_id, checkpoint_id, file, expires, signature)
        checkpoint = self.service.saved.by_path.get(f"tinker://{run_id}/{checkpoint_id}")
        if checkpoint is None:
            raise UnknownObject(f"no export {run_id}/{checkpoint_id} (deleted?)")
        return str(exported_file(checkpoint, file))
