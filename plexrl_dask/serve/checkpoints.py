"""Saved checkpoints of ``plexrl serve``'s tenants: what the REST API lists, describes and
deletes, and weights exported in Hugging Face / PEFT format behind signed download URLs.

- A **checkpoint** is a ``tinker://<run>/<kind>/<name>`` path of one tenant: ``weights`` (a
  training checkpoint: parameters and optimizer state) and ``sampler_weights`` are versions in
  the cluster's state store (what ``save_state`` returned); ``external_weights`` is a directory
  on the server's disk (``plexrl.serve.export-dir``) that other tools load as they are.
- An **export** of a full fine-tuning model is what ``AutoModelForCausalLM.from_pretrained``
  loads: ``model.safetensors`` (the parameters by their Hugging Face names, tied weights once),
  ``config.json`` and the base's tokenizer files. A LoRA model's is what
  ``PeftModel.from_pretrained(base, directory)`` loads: ``adapter_model.safetensors`` (PEFT's
  names, without the adapter's name) and ``adapter_config.json`` (rank, alpha, target modules,
  the base's directory).
- **Download URLs** are signed, as a bucket's presigned URLs are: an HMAC of the file's path and
  the URL's expiry under a key of this server process, so they need no API key, name one file
  each, and stop working at their expiry or when the server restarts.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import hmac
import json
import math
import os
import secrets
import shutil
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any
from urllib.parse import quote

from plexrl_dask.errors import (
    CheckpointError,
    InvalidTinkerRequest,
    TenantLimitExceeded,
    Unauthenticated,
    UnknownObject,
)

#: a tinker:// path's segment -> the checkpoint type the REST API names it
KINDS = {"weights": "training", "sampler_weights": "sampler", "external_weights": "external"}
#: the longest page a list call returns
MAX_PAGE = 1000


def _now() -> str:
    return datetime.now(UTC).isoformat()


def parse_path(path: Any) -> tuple[str, str, str]:
    """``(run id, kind segment, name)`` of a ``tinker://<run>/<kind>/<name>`` path;
    :class:`InvalidTinkerRequest` for anything else."""
    if not isinstance(path, str) or not path.startswith("tinker://"):
        raise InvalidTinkerRequest(f"a checkpoint path is tinker://<run>/<kind>/<name>: {path!r}")
    parts = path[len("tinker://") :].split("/")
    if len(parts) != 3 or not all(parts) or parts[1] not in KINDS:
        raise InvalidTinkerRequest(
            f"a checkpoint path is tinker://<run>/<kind>/<name>, kind one of {sorted(KINDS)}: "
            f"{path!r}"
        )
    return parts[0], parts[1], parts[2]


@dataclass(frozen=True)
class Checkpoint:
    """One saved checkpoint of ``tenant`` (see the module docstring). ``saved``: what
    ``save_state`` returned, or for an export ``{"format": "external", "dir", "files"}``."""

    path: str
    tenant: str
    base: str
    saved: dict
    lora: dict | None = None
    created: str = field(default_factory=_now)
    size_bytes: int | None = None
    expires_at: str | None = None

    @property
    def run_id(self) -> str:
        return parse_path(self.path)[0]

    @property
    def checkpoint_id(self) -> str:
        """``<kind>/<name>``, as the REST API's routes name it."""
        _, kind, name = parse_path(self.path)
        return f"{kind}/{name}"

    @property
    def kind(self) -> str:
        return KINDS[parse_path(self.path)[1]]

    @property
    def external(self) -> bool:
        return self.kind == "external"

    def expired(self, now: float | None = None) -> bool:
        if self.expires_at is None:
            return False
        at = datetime.fromisoformat(self.expires_at).timestamp()
        return (time.time() if now is None else now) >= at

    def describe(self) -> dict[str, Any]:
        """The REST API's ``Checkpoint`` object."""
        return {
            "checkpoint_id": self.checkpoint_id,
            "checkpoint_type": self.kind,
            "time": self.created,
            "tinker_path": self.path,
            "size_bytes": self.size_bytes,
            "public": False,
            "expires_at": self.expires_at,
        }


def page(items: Sequence[Any], limit: Any, offset: Any) -> tuple[list[Any], dict[str, int]]:
    """``items[offset : offset + limit]`` and the REST API's cursor; :class:`InvalidTinkerRequest`
    for a limit outside 1..:data:`MAX_PAGE` or a negative offset (query strings arrive as
    text)."""
    try:
        n, start = int(limit), int(offset)
    except (TypeError, ValueError):
        raise InvalidTinkerRequest(
            f"limit and offset are integers: {limit!r}, {offset!r}"
        ) from None
    if not 1 <= n <= MAX_PAGE or start < 0:
        raise InvalidTinkerRequest(f"limit is 1..{MAX_PAGE} and offset >= 0: {n}, {start}")
    return list(items[start : start + n]), {"offset": start, "limit": n, "total_count": len(items)}


def expiry(ttl_seconds: Any) -> str | None:
    """When a checkpoint saved now with ``ttl_seconds`` expires (None: never); the SDK's
    bounds, one hour to ten years."""
    if ttl_seconds is None:
        return None
    if isinstance(ttl_seconds, bool) or not isinstance(ttl_seconds, int):
        raise InvalidTinkerRequest(f"ttl_seconds is an integer, got {ttl_seconds!r}")
    if not 3600 <= ttl_seconds <= 10 * 365 * 86400:
        raise InvalidTinkerRequest(f"ttl_seconds is 3600 (an hour) to ten years: {ttl_seconds}")
    return datetime.fromtimestamp(time.time() + ttl_seconds, UTC).isoformat()


# --- exports ---------------------------------------------------------------------------------


def peft_name(name: str, adapter: str = "default") -> str:
    """PEFT's saved name of an adapter parameter named ``name`` in a model tree with the
    adapter ``adapter`` injected (``...q_proj.lora_A.default.weight`` ->
    ``base_model.model....q_proj.lora_A.weight``)."""
    for part in ("lora_A", "lora_B", "lora_embedding_A", "lora_embedding_B"):
        name = name.replace(f".{part}.{adapter}.", f".{part}.").replace(
            f".{part}.{adapter}", f".{part}"
        )
    return f"base_model.model.{name}"


def write_export(
    directory: str | os.PathLike[str],
    tensors: Mapping[str, Any],
    base_dir: str,
    lora: Mapping[str, Any] | None,
) -> list[str]:
    """Write an export of ``tensors`` (a replica's weights by canonical name: every parameter,
    or a LoRA replica's adapter) into the new directory ``directory``; the names of the files
    written. ``base_dir``: the base model's checkpoint directory (its config and tokenizer);
    ``lora``: the adapter's ``LoraSpec`` dict, None for full fine-tuning."""
    out = Path(directory)
    # Written beside its place, then renamed in: a failure leaves no half export behind.
    partial = out.with_name(f".{out.name}.partial")
    try:
        partial.mkdir(parents=True)
        files = _write_export_files(partial, tensors, base_dir, lora)
        os.rename(partial, out)
    except OSError as e:
        shutil.rmtree(partial, ignore_errors=True)
        raise CheckpointError(f"writing an export to {out}: {e}") from None
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    return files


def _write_export_files(
    out: Path, tensors: Mapping[str, Any], base_dir: str, lora: Mapping[str, Any] | None
) -> list[str]:
    """The files of an export (see :func:`write_export`) written into ``out``."""
    from safetensors.torch import save_file

    tensors = {k: v.detach().contiguous() for k, v in tensors.items()}
    if lora is not None:
        save_file(
            {peft_name(k): v for k, v in tensors.items()},
            out / "adapter_model.safetensors",
            metadata={"format": "pt"},
        )
        config = {
            "peft_type": "LORA",
            "task_type": "CAUSAL_LM",
            "base_model_name_or_path": base_dir,
            "r": int(lora["rank"]),
            "lora_alpha": float(lora["alpha"]),
            "target_modules": sorted(lora["targets"]),
            "lora_dropout": 0.0,
            "bias": "none",
            "inference_mode": True,
        }
        (out / "adapter_config.json").write_text(json.dumps(config, indent=2))
    else:
        from transformers import AutoConfig, AutoTokenizer

        save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
        AutoConfig.from_pretrained(base_dir).save_pretrained(out)
        AutoTokenizer.from_pretrained(base_dir).save_pretrained(out)
    return sorted(p.name for p in out.iterdir() if p.is_file())


def export_bytes(directory: str | os.PathLike[str]) -> int:
    return sum(p.stat().st_size for p in Path(directory).iterdir() if p.is_file())


def remove_export(directory: str | os.PathLike[str]) -> None:
    shutil.rmtree(directory, ignore_errors=True)


class UrlSigner:
    """Signed download URLs of export files (see the module docstring)."""

    def __init__(self, ttl_seconds: float, key: bytes | None = None) -> None:
        if not math.isfinite(ttl_seconds) or ttl_seconds <= 0:
            raise InvalidTinkerRequest(f"an export URL's lifetime is > 0 s, got {ttl_seconds}")
        self.ttl = ttl_seconds
        self._key = key or secrets.token_bytes(32)

    def _signature(self, run_id: str, checkpoint_id: str, file: str, expires: int) -> str:
        message = f"{run_id}\n{checkpoint_id}\n{file}\n{expires}".encode()
        return hmac.new(self._key, message, hashlib.sha256).hexdigest()

    def urls(
        self, base_url: str, run_id: str, checkpoint_id: str, files: Sequence[str]
    ) -> tuple[dict[str, str], str]:
        """A URL per file under ``base_url`` (the server's, as the caller reached it) and
        when they expire (ISO 8601)."""
        expires = int(time.time() + self.ttl)
        root = base_url.rstrip("/")
        urls = {
            f: f"{root}/api/v1/exports/{quote(run_id, safe='')}/{quote(checkpoint_id)}/{f}"
            f"?expires={expires}&signature={self._signature(run_id, checkpoint_id, f, expires)}"
            for f in files
        }
        return urls, datetime.fromtimestamp(expires, UTC).isoformat()

    def check(
        self, run_id: str, checkpoint_id: str, file: str, expires: Any, signature: Any
    ) -> None:
        """:class:`Unauthenticated` unless ``signature`` signs this file until ``expires``
        and that is still to come."""
        try:
            at = int(expires)
        except (TypeError, ValueError):
            raise Unauthenticated("a download URL needs its expires and signature") from None
        good = self._signature(run_id, checkpoint_id, file, at)
        if not isinstance(signature, str) or not hmac.compare_digest(good, signature):
            raise Unauthenticated("this download URL's signature is not valid here")
        if time.time() >= at:
            raise Unauthenticated("this download URL has expired; ask for new ones")


def exported_file(checkpoint: Checkpoint, file: str) -> Path:
    """The file ``file`` of the export ``checkpoint``; :class:`UnknownObject` for a name that
    is not one of the files the export wrote (so no other path is ever served)."""
    if not checkpoint.external or file not in checkpoint.saved.get("files", ()):
        raise UnknownObject(f"{checkpoint.path} has no file {file!r}")
    return Path(checkpoint.saved["dir"]) / file


class SavedCheckpoints:
    """Every tenant's checkpoints by path, kept in the server's state file (``state``: a
    :class:`~plexrl_dask.serve.state.ServeState`), and the directory exports are written
    under."""

    def __init__(self, state: Any, export_dir: str | os.PathLike[str]) -> None:
        self.state = state
        self.export_dir = Path(export_dir)
        self.by_path = {k: Checkpoint(**v) for k, v in state.table("checkpoints").items()}
        # Exports are written on the server's threads: each reserves its bytes against its
        # tenant's limit first, until it is added (or fails), so that two exports at once
        # cannot both pass the limit.
        self._lock = threading.Lock()
        self._exporting: collections.Counter[str] = collections.Counter()

    def add(self, checkpoint: Checkpoint, reserved: int = 0) -> None:
        """Keep ``checkpoint``; ``reserved``: the bytes :meth:`reserve_export` reserved for
        it, which its own size now counts instead."""
        with self._lock:
            self.by_path[checkpoint.path] = checkpoint
            self._exporting[checkpoint.tenant] -= reserved
        self.state.put("checkpoints", checkpoint.path, dataclasses.asdict(checkpoint))

    def reserve_export(self, tenant: str, nbytes: int, limit: int, replaces: str) -> None:
        """Reserve ``nbytes`` of ``tenant``'s ``limit`` of exports for one about to be written
        (replacing the export at path ``replaces``, if any, once it is added); give them back
        with :meth:`release_export` if it is not added. :class:`TenantLimitExceeded` when
        they do not fit beside its exports and those being written."""
        with self._lock:
            replaced = self.by_path.get(replaces)
            used = self._exported_locked(tenant) + self._exporting[tenant]
            used -= (replaced.size_bytes or 0) if replaced is not None else 0
            if used + nbytes > limit:
                raise TenantLimitExceeded(
                    f"tenant {tenant!r}: exporting {nbytes} bytes would pass its {limit} bytes "
                    f"of exports ({used} used or being written); delete some"
                )
            self._exporting[tenant] += nbytes

    def release_export(self, tenant: str, nbytes: int) -> None:
        with self._lock:
            self._exporting[tenant] -= nbytes

    def set_expiry(self, checkpoint: Checkpoint, expires_at: str | None) -> Checkpoint:
        """``checkpoint`` from now on expiring at ``expires_at`` (None: never)."""
        changed = dataclasses.replace(checkpoint, expires_at=expires_at)
        self.add(changed)
        return changed

    def owned(self, tenant: str, path: str) -> Checkpoint:
        """``tenant``'s checkpoint at ``path``; :class:`UnknownObject` for any other (another
        tenant's included)."""
        checkpoint = self.by_path.get(path)
        if checkpoint is None or checkpoint.tenant != tenant:
            raise UnknownObject(f"no checkpoint {path!r}")
        return checkpoint

    def loadable(self, tenant: str, path: str) -> Checkpoint:
        """``tenant``'s checkpoint at ``path`` that a model or sampler can load (not an
        export: those are for other tools)."""
        checkpoint = self.owned(tenant, path)
        if checkpoint.external:
            raise InvalidTinkerRequest(
                f"{path} is an export for other tools (Hugging Face / PEFT files); load a "
                "weights/ or sampler_weights/ checkpoint"
            )
        return checkpoint

    def of_run(self, tenant: str, run_id: str) -> list[Checkpoint]:
        """``tenant``'s checkpoints of the training run ``run_id``, oldest first."""
        mine = [c for c in self.by_path.values() if c.tenant == tenant and c.run_id == run_id]
        return sorted(mine, key=lambda c: c.created)

    def of_tenant(self, tenant: str) -> list[Checkpoint]:
        """``tenant``'s checkpoints, newest first."""
        mine = [c for c in self.by_path.values() if c.tenant == tenant]
        return sorted(mine, key=lambda c: c.created, reverse=True)

    def exported_bytes(self, tenant: str) -> int:
        with self._lock:
            return self._exported_locked(tenant)

    def _exported_locked(self, tenant: str) -> int:
        return sum(
            c.size_bytes or 0 for c in self.by_path.values() if c.tenant == tenant and c.external
        )

    def export_dir_of(self, tenant: str) -> Path:
        """A new directory for one of ``tenant``'s exports (not created; ``tenant-<name>``: one
        path component whatever the name, ``..`` included)."""
        return self.export_dir / f"tenant-{tenant}" / secrets.token_hex(8)

    def remove(self, checkpoint: Checkpoint) -> None:
        """Forget ``checkpoint`` and delete an export's files (a stored version is the
        caller's to drop from the cluster's stores)."""
        with self._lock:
            self.by_path.pop(checkpoint.path, None)
        self.state.delete("checkpoints", checkpoint.path)
        if checkpoint.external:
            remove_export(checkpoint.saved["dir"])

    def expired(self) -> list[Checkpoint]:
        now = time.time()
        return [c for c in self.by_path.values() if c.expired(now)]
