"""Tenants of ``plexrl serve`` and their API keys.

A tenant is a name, its limits and the SHA-256 digests of its API keys; the keys themselves are
never stored (a key is 32 random bytes, so a fast digest is enough: nothing to guess). The keys
file is YAML::

    tenants:
      alice:
        keys: [<sha256 hex of the key>, ...]
        limits: {models: 4}          # optional: overrides plexrl.serve.tenant-limits

``plexrl serve-keys add FILE TENANT`` makes a key (``tml-`` and 43 url-safe characters: the
Tinker SDK refuses keys without the ``tml-`` prefix), adds its digest and prints the key once.
Each tenant is its own PlexRL job (``tinker-<name>``): the scheduler keeps one tenant's
deployments and requests from every other key, and a tenant never gets a Dask client.
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import os
import re
import secrets
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import dask.utils
import yaml

from plexrl_dask import config
from plexrl_dask.errors import ConfigError, Unauthenticated

KEY_PREFIX = "tml-"
_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")


@dataclass(frozen=True)
class TenantLimits:
    """What one tenant may hold at once: training ``models``, sampling sessions
    (``samplers``), requests submitted and not yet finished (``requests_waiting``), the
    bytes of one request body (``request_bytes``), the bytes of all its exported weights
    on the server's disk (``export_bytes``: ``save_weights_external``), and its saved
    checkpoints in the cluster's tiers (``checkpoints``: ``save_weights``,
    ``save_weights_for_sampler`` by name; one saved again under its name is not another)."""

    models: int
    samplers: int
    requests_waiting: int
    request_bytes: int
    export_bytes: int
    checkpoints: int

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any]) -> TenantLimits:
        merged = {**dict(config.get("serve.tenant-limits")), **dict(values)}  # type: ignore[call-overload]
        known = {f.name.replace("_", "-") for f in dataclasses.fields(cls)}
        if set(merged) - known:
            raise ConfigError(
                f"unknown tenant limits {sorted(set(merged) - known)}: {sorted(known)}"
            )
        out = {}
        for key in known:
            value = merged[key]
            if key in ("request-bytes", "export-bytes") and isinstance(value, str):
                value = dask.utils.parse_bytes(value)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"tenant limit {key} must be an integer >= 1, got {value!r}")
            out[key.replace("-", "_")] = value
        return cls(**out)


@dataclass(frozen=True)
class Tenant:
    name: str
    limits: TenantLimits

    @property
    def job(self) -> str:
        """The PlexRL job this tenant's deployments and requests belong to."""
        return f"tinker-{self.name}"


def digest(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


class KeyRing:
    """API keys (by digest) to tenants."""

    def __init__(self, tenants: Mapping[str, tuple[TenantLimits, list[str]]]) -> None:
        self._by_digest: dict[str, Tenant] = {}
        for name, (limits, digests) in tenants.items():
            if not _NAME.match(name):
                raise ConfigError(f"a tenant name is 1-64 of [A-Za-z0-9_.-], got {name!r}")
            for d in digests:
                if not re.fullmatch(r"[0-9a-f]{64}", str(d)):
                    raise ConfigError(f"tenant {name!r}: a key digest is 64 hex digits: {d!r}")
                if d in self._by_digest:
                    raise ConfigError(f"one key digest is listed for two tenants: {d[:12]}...")
                self._by_digest[d] = Tenant(name, limits)

    @classmethod
    def from_file(cls, path: str | os.PathLike[str]) -> KeyRing:
        """The tenants of a keys file (see the module docstring); :class:`ConfigError` if it
        does not parse."""
        try:
            data = yaml.safe_load(Path(path).read_text()) or {}
        except (OSError, yaml.YAMLError) as e:
            raise ConfigError(f"cannot read the keys file {path}: {e}") from e
        tenants = data.get("tenants") if isinstance(data, dict) else None
        if not isinstance(tenants, dict):
            raise ConfigError(f"the keys file {path} has no 'tenants' mapping")
        parsed = {}
        for name, entry in tenants.items():
            if not isinstance(entry, dict) or not isinstance(entry.get("keys", []), list):
                raise ConfigError(
                    f"tenant {name!r} in {path}: expected {{keys: [...], limits: ...}}"
                )
            limits = TenantLimits.from_mapping(entry.get("limits") or {})
            parsed[str(name)] = (limits, [str(k) for k in entry.get("keys", [])])
        return cls(parsed)

    def tenant(self, key: str | None) -> Tenant:
        """The tenant holding ``key``; :class:`Unauthenticated` for none or an unknown one."""
        if not key:
            raise Unauthenticated("no API key: send it in the X-API-Key header (TINKER_API_KEY)")
        wanted = digest(key)
        for d, tenant in self._by_digest.items():
            if hmac.compare_digest(d, wanted):
                return tenant
        raise Unauthenticated("this API key belongs to no tenant of this server")

    def tenants(self) -> list[str]:
        return sorted({t.name for t in self._by_digest.values()})


def add_key(path: str | os.PathLike[str], tenant: str) -> str:
    """Make a new API key for ``tenant`` (created if new) in the keys file at ``path``
    (created if missing), store its digest, and return the key (shown once)."""
    if not _NAME.match(tenant):
        raise ConfigError(f"a tenant name is 1-64 of [A-Za-z0-9_.-], got {tenant!r}")
    p = Path(path)
    data = yaml.safe_load(p.read_text()) if p.exists() else None
    data = data if isinstance(data, dict) else {}
    tenants = data.setdefault("tenants", {})
    entry = tenants.setdefault(tenant, {})
    key = KEY_PREFIX + secrets.token_urlsafe(32)
    entry.setdefault("keys", []).append(digest(key))
    # written whole, then renamed: a server reading it never sees half a file
    fd, tmp = tempfile.mkstemp(dir=p.parent if str(p.parent) else ".", prefix=".keys-")
    with os.fdopen(fd, "w") as f:
        yaml.safe_dump(data, f, sort_keys=True)
    os.chmod(tmp, 0o600)
    os.replace(tmp, p)
    KeyRing.from_file(p)  # (still valid)
    return key
