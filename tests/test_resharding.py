"""Zero-redundancy resharding on a real (tiny, Qwen2-style) Hugging Face model: state written
by one layout (FSDP dim-0 shards, tensor-parallel column/row shards) is read by another, each
reader fetching only its slice, and the model computes exactly what the full tensors compute.

Tensor-parallel layout (Megatron's, as torch's ``ColwiseParallel``/``RowwiseParallel`` apply
it to ``nn.Linear`` weights ``[out, in]``): q/k/v, gate and up projections are split by output
rows (dim 0), o and down projections by input columns (dim 1); everything else is replicated.
"""

from __future__ import annotations

import pytest
import torch

from plexrl_dask.state_store.keys import ROW_AND_COLUMN_SPLITS, ROW_SPLITS
from plexrl_dask.state_store.store import StateStore
from plexrl_dask.worker.replica_checkpoint import split_dims
from tests.conftest import tiny_spec

WAYS = 2
ROWWISE = ("o_proj.weight", "down_proj.weight")
COLWISE = ("q_proj.weight", "k_proj.weight", "v_proj.weight", "gate_proj.weight", "up_proj.weight")
KB = 1024


def tp_dim(name: str) -> int | None:
    if name.endswith(ROWWISE):
        return 1
    if name.endswith(COLWISE):
        return 0
    return None


def region(shape: tuple[int, ...], dim: int, rank: int, ways: int = WAYS) -> tuple[slice, ...]:
    """``rank``'s part of ``dim`` by the torch.chunk convention (FSDP2's and DTensor's)."""
    n = shape[dim]
    size = -(-n // ways)
    start = min(rank * size, n)
    out = [slice(None)] * len(shape)
    out[dim] = slice(start, min(start + size, n))
    return tuple(out)


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    # Chunks of 4 KiB: every tensor spans several chunks, so slices really pick chunks.
    return tiny_spec(seed=5, hidden_size=64, num_heads=4, num_kv_heads=2).build_model("cpu")


@pytest.fixture
def store(tmp_path):
    return StateStore(tmp_path / "store", create=True, durable=False, chunk_bytes=4 * KB)


def publish(
    store: StateStore,
    model_name: str,
    full: dict[str, torch.Tensor],
    layout: str,
    dims: dict[str, tuple[int, ...]],
) -> None:
    """Publish ``full`` as WAYS writers of ``layout`` ("fsdp" or "tp") would: each writes only
    its own regions (replicated tensors: rank 0), with the model's chunk-grid hints ``dims``."""
    for rank in range(WAYS):
        with store.writer(model_name, 0, "pub") as w:
            for name, t in full.items():
                dim = (
                    0 if layout == "fsdp" and t.dim() else tp_dim(name) if layout == "tp" else None
                )
                split = dims.get(name, ROW_SPLITS)
                if dim is None:
                    if rank == 0:
                        w.write(name, t, split_dims=split)
                    continue
                r = region(tuple(t.shape), dim, rank)
                w.write(name, t[r].clone(), r, tuple(t.shape), split)
    store.commit(model_name, 0, "pub", expected_parts=WAYS)


def read_layout(
    store: StateStore, model_name: str, full: dict[str, torch.Tensor], layout: str, rank: int
) -> tuple[dict, dict[str, int]]:
    """What ``rank`` of ``layout`` reads, and the bytes it fetched from the store per tensor."""
    out, fetched = {}, {}
    for name, t in full.items():
        dim = 0 if layout == "fsdp" and t.dim() else tp_dim(name) if layout == "tp" else None
        r = None if dim is None else region(tuple(t.shape), dim, rank)
        before = store.stats.bytes_read
        out[name] = store.read(model_name, 0, name, r)
        fetched[name] = store.stats.bytes_read - before
    return out, fetched


def test_the_models_tensor_parallel_plan_names_the_column_split_weights(model):
    # Hugging Face's own plan for the architecture, not a list of ours.
    assert split_dims(model) == {
        n: ROW_AND_COLUMN_SPLITS for n, _ in model.named_parameters() if n.endswith(ROWWISE)
    }


def tp_mlp(parts: list[dict[str, torch.Tensor]], prefix: str, x: torch.Tensor) -> torch.Tensor:
    """The SwiGLU MLP computed as WAYS tensor-parallel ranks would: each its own gate/up rows
    and down columns; the partial outputs summed (the all-reduce)."""
    out = 0
    for p in parts:
        gate = x @ p[f"{prefix}.gate_proj.weight"].T
        up = x @ p[f"{prefix}.up_proj.weight"].T
        out = out + (torch.nn.functional.silu(gate) * up) @ p[f"{prefix}.down_proj.weight"].T
    return out


@pytest.mark.parametrize("writer,reader", [("fsdp", "tp"), ("tp", "fsdp")])
def test_one_layout_writes_another_reads_its_slices_exactly(model, store, writer, reader):
    full = {n: p.detach().clone() for n, p in model.named_parameters()}
    publish(store, "m", full, writer, split_dims(model))
    parts = []
    for rank in range(WAYS):
        got, fetched = read_layout(store, "m", full, reader, rank)
        parts.append(got)
        for name, t in full.items():
            dim = 0 if reader == "fsdp" and t.dim() else tp_dim(name) if reader == "tp" else None
            r = None if dim is None else region(tuple(t.shape), dim, rank)
            want = t if r is None else t[r]
            assert torch.equal(got[name], want), (name, rank)
            # Exactly its own slice was fetched, by rows or (the row-parallel weights) by
            # columns, except for tensors of one chunk (a few hundred bytes), fetched whole.
            if t.numel() * t.element_size() > 4 * KB:
                assert fetched[name] == want.numel() * want.element_size(), (name, fetched)
    # Reassembled by the reader's own rule, every tensor is the full one.
    for name, t in full.items():
        dim = 0 if reader == "fsdp" and t.dim() else tp_dim(name) if reader == "tp" else None
        whole = parts[0][name] if dim is None else torch.cat([p[name] for p in parts], dim)
        assert torch.equal(whole, t), name


def test_tensor_parallel_slices_from_an_fsdp_checkpoint_compute_the_full_mlp(model, store):
    full = {n: p.detach().clone() for n, p in model.named_parameters()}
    publish(store, "m", full, "fsdp", split_dims(model))
    parts = [read_layout(store, "m", full, "tp", rank)[0] for rank in range(WAYS)]
    x = torch.randn(3, 5, model.config.hidden_size, generator=torch.Generator().manual_seed(1))
    for i, layer in enumerate(model.model.layers):
        with torch.no_grad():
            want = layer.mlp(x)
        got = tp_mlp(parts, f"model.layers.{i}.mlp", x)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)  # summation order only
    # ...and the same model rebuilt from the TP slices (reassembled) is the same model.
    rebuilt = tiny_spec(seed=99, hidden_size=64, num_heads=4, num_kv_heads=2).build_model("cpu")
    with torch.no_grad():
        for name, p in rebuilt.named_parameters():
            dim = tp_dim(name)
            p.copy_(parts[0][name] if dim is None else torch.cat([q[name] for q in parts], dim))
    ids = torch.randint(
        0, model.config.vocab_size, (2, 7), generator=torch.Generator().manual_seed(2)
    )
    with torch.no_grad():
        assert torch.equal(rebuilt(ids).logits, model(ids).logits)


def test_a_column_read_of_a_tensor_chunked_by_rows_is_exact_and_fetches_whole_rows(store):
    # A reader may cut any tensor any way; only the grid's split dims read exactly their slice.
    t = torch.randn(64, 48, generator=torch.Generator().manual_seed(3))
    store.publish("m", 0, {"w": t})  # default grid: whole rows (4 KiB target: 16-row chunks)
    assert store.manifest("m", 0).tensors["w"].chunks == (16, 48)
    before = store.stats.bytes_read
    assert torch.equal(store.read("m", 0, "w", (slice(None), slice(24, 48))), t[:, 24:])
    assert store.stats.bytes_read - before == t.numel() * 4  # every row, whole
    store.publish("m", 1, {"w": t}, split_dims={"w": ROW_AND_COLUMN_SPLITS})
    assert store.manifest("m", 1).tensors["w"].chunks == (32, 24)
    before = store.stats.bytes_read
    assert torch.equal(store.read("m", 1, "w", (slice(None), slice(24, 48))), t[:, 24:])
    assert store.stats.bytes_read - before == t.numel() * 2  # its half only
