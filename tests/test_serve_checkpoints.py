"""plexrl serve's checkpoint catalog without a cluster: paths, pages, TTLs, signed URLs, the
names of an exported adapter, and the state file a deletion rewrites."""

from __future__ import annotations

import time

import pytest

from plexrl_dask.errors import InvalidTinkerRequest, Unauthenticated, UnknownObject
from plexrl_dask.serve.checkpoints import (
    Checkpoint,
    SavedCheckpoints,
    UrlSigner,
    expiry,
    exported_file,
    page,
    parse_path,
    peft_name,
)
from plexrl_dask.serve.state import ServeState


def test_paths_pages_and_ttls_are_checked():
    assert parse_path("tinker://s:train:0/weights/step-3") == ("s:train:0", "weights", "step-3")
    for bad in ("s/weights/x", "tinker://s/other/x", "tinker://s/weights", "tinker://s//x", 7):
        with pytest.raises(InvalidTinkerRequest):
            parse_path(bad)
    shown, cursor = page(list(range(5)), "2", "3")  # (query strings arrive as text)
    assert shown == [3, 4] and cursor == {"offset": 3, "limit": 2, "total_count": 5}
    for limit, offset in ((0, 0), (10_000, 0), (5, -1), ("x", 0)):
        with pytest.raises(InvalidTinkerRequest):
            page([], limit, offset)
    assert expiry(None) is None
    for bad in (60, 11 * 365 * 86400, True, "3600"):
        with pytest.raises(InvalidTinkerRequest):
            expiry(bad)


def test_signed_urls_name_one_file_until_they_expire():
    signer = UrlSigner(ttl_seconds=60, key=b"k" * 32)
    urls, _ = signer.urls("http://h:1/", "run", "external_weights/x", ["a.json", "b.json"])
    query = dict(p.split("=") for p in urls["a.json"].split("?")[1].split("&"))
    signer.check("run", "external_weights/x", "a.json", query["expires"], query["signature"])
    for args in (
        ("run", "external_weights/x", "b.json", query["expires"], query["signature"]),
        ("run", "external_weights/y", "a.json", query["expires"], query["signature"]),
        ("run", "external_weights/x", "a.json", int(query["expires"]) + 1, query["signature"]),
        ("run", "external_weights/x", "a.json", None, None),
    ):
        with pytest.raises(Unauthenticated):
            signer.check(*args)
    other = UrlSigner(ttl_seconds=60)  # (a restarted server: another key)
    with pytest.raises(Unauthenticated):
        other.check("run", "external_weights/x", "a.json", query["expires"], query["signature"])
    past = int(time.time()) - 1
    good = signer._signature("run", "external_weights/x", "a.json", past)
    with pytest.raises(Unauthenticated, match="expired"):
        signer.check("run", "external_weights/x", "a.json", past, good)


def test_peft_names_drop_the_adapter_name():
    name = "model.layers.0.self_attn.q_proj.lora_A.default.weight"
    assert peft_name(name) == "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"


def test_the_catalog_is_per_tenant_and_kept_in_the_state_file(tmp_path):
    state = tmp_path / "state.json"
    saved = SavedCheckpoints(ServeState(state), tmp_path / "exports")
    directory = tmp_path / "exports" / "tenant-alice" / "e1"
    directory.mkdir(parents=True)
    (directory / "config.json").write_text("{}")
    export = Checkpoint(
        "tinker://r/external_weights/e", "alice", "base",
        {"format": "external", "dir": str(directory), "files": ["config.json"]},
        size_bytes=2, expires_at="2000-01-01T00:00:00+00:00",
    )  # fmt: skip
    stored = Checkpoint("tinker://r/weights/w", "alice", "base", {"model": "m", "version": 1})
    saved.add(export)
    saved.add(stored)
    with pytest.raises(UnknownObject):
        saved.owned("bob", stored.path)
    with pytest.raises(InvalidTinkerRequest, match="export"):
        saved.loadable("alice", export.path)
    assert exported_file(export, "config.json") == directory / "config.json"
    with pytest.raises(UnknownObject):
        exported_file(export, "../../state.json")
    assert saved.exported_bytes("alice") == 2 and saved.exported_bytes("bob") == 0
    assert saved.expired() == [export]
    again = SavedCheckpoints(ServeState(state), tmp_path / "exports")
    assert again.owned("alice", export.path) == export
    saved.remove(export)
    assert not directory.exists()
    assert set(SavedCheckpoints(ServeState(state), tmp_path).by_path) == {stored.path}
