"""Layouts, placement rules, owner balancing, bucket grouping and ChunkedShard: no processes needed."""
from __future__ import annotations

import math

import pytest
import torch
from torch.distributed.checkpoint.metadata import MetadataIndex

from flexshard import BlockShard, ChunkedShard, MixedPrecision, Owned, RowShard
from flexshard.layout import assign_owners, make_layout
from flexshard.placements import resolve_placement
from flexshard.shard import _bucket_groups, _common_module


def coverage(layout) -> torch.Tensor:
    """How many ranks hold each element."""
    count = torch.zeros(layout.shape, dtype=torch.int64)
    for rects in layout.rects:
        for r in rects:
            count[r.slices] += 1
    return count


@pytest.mark.parametrize("rows", [1, 2, 5, 7, 8, 13])
@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_rowshard_is_torch_chunk(rows, world):
    layout = make_layout((rows, 3), RowShard(), world)
    full = torch.arange(rows * 3).view(rows, 3)
    chunks = torch.chunk(full, world, dim=0)
    for rank in range(world):
        want = chunks[rank] if rank < len(chunks) else full[:0]
        assert torch.equal(layout.local_from_full(full, rank).view(-1, 3), want)
    assert torch.equal(coverage(layout), torch.ones(rows, 3, dtype=torch.int64))
    assert layout.row_slot_numel == math.ceil(rows / world) * 3


@pytest.mark.parametrize("shape", [(1, 1), (5, 7), (64, 64), (70, 100), (3, 200)])
@pytest.mark.parametrize("block", [(1, 1), (8, 16), (32, 32), (128, 128)])
@pytest.mark.parametrize("world", [1, 2, 3, 4, 8])
def test_blockshard_tiles_partition_the_matrix(shape, block, world):
    layout = make_layout(shape, BlockShard(block=block), world)
    assert torch.equal(coverage(layout), torch.ones(shape, dtype=torch.int64))
    tiles = [layout.tiles(rank) for rank in range(world)]
    assert sum(tiles) == math.ceil(shape[0] / block[0]) * math.ceil(shape[1] / block[1])
    assert max(tiles) - min(tiles) <= 1  # balanced; ranks beyond the tile count hold nothing
    for rects in layout.rects:
        assert len(rects) <= 3
        for r in rects:  # tile-aligned corners, whole tiles (except at the matrix edge)
            assert r.offsets[0] % block[0] == 0 and r.offsets[1] % block[1] == 0
            assert r.sizes[0] % block[0] == 0 or r.offsets[0] + r.sizes[0] == shape[0]
            assert r.sizes[1] % block[1] == 0 or r.offsets[1] + r.sizes[1] == shape[1]


def test_round_trip_through_locals():
    full = torch.randn(70, 100)
    for placement, owner in ((RowShard(), None), (Owned(), 2), (BlockShard(block=(32, 48)), None)):
        layout = make_layout((70, 100), placement, 3, owner)
        assert torch.equal(layout.full_from_locals([layout.local_from_full(full, r) for r in range(3)]), full)
    owned = make_layout((70, 100), Owned(), 3, owner=2)
    assert [owned.local_numel(r) for r in range(3)] == [0, 0, 7000] and owned.owner() == 2


def test_owner_balancing():
    mesh = object.__new__(type("FakeMesh", (), {}))  # any weak-referenceable key
    owners = assign_owners([100, 100, 10, 300, 50], [None] * 5, 3, mesh)
    load = [sum(n for n, o in zip([100, 100, 10, 300, 50], owners) if o == r) for r in range(3)]
    assert sorted(load) == [110, 150, 300]  # largest first, each to the lightest rank
    # The next bucket on the same mesh starts from the running totals: lighter ranks first.
    assert assign_owners([100], [None], 3, mesh) == [load.index(110)]
    assert assign_owners([5, 5], [1, None], 3, mesh)[0] == 1
    with pytest.raises(ValueError, match="outside the mesh"):
        assign_owners([5], [3], 3, mesh)
    # Repeated layers of lumpy sizes: the uneven bin (four small matrices) rotates over the ranks.
    fresh = object.__new__(type("FakeMesh", (), {}))
    layer = [196, 196, 196, 65, 65, 65, 65]
    totals = [0] * 4
    for _ in range(4):
        for n, o in zip(layer, assign_owners(layer, [None] * 7, 4, fresh)):
            totals[o] += n
    assert totals == [196 * 3 + 260] * 4


def test_placement_rules():
    w, v = torch.empty(4, 4), torch.empty(4)
    assert resolve_placement(None, "a", w) == RowShard()
    assert resolve_placement(Owned(), "a", w) == Owned()
    rule = {"*.wq.*": Owned(rank=1), "*": BlockShard(block=(2, 2))}
    assert resolve_placement(rule, "layers.0.wq.weight", w) == Owned(rank=1)
    assert resolve_placement(rule, "layers.0.wk.weight", w) == BlockShard(block=(2, 2))
    assert resolve_placement({"x": Owned()}, "y", w) == RowShard()  # unmatched: RowShard
    assert resolve_placement(lambda n, p: None, "y", w) == RowShard()
    with pytest.raises(ValueError, match="2-D"):
        resolve_placement(rule, "norm.weight", v)
    with pytest.raises(ValueError, match="scalar"):
        resolve_placement(RowShard(), "temperature", torch.empty(()))
    with pytest.raises(TypeError, match="RowShard, Owned or BlockShard"):
        resolve_placement(lambda n, p: "rows", "y", w)
    with pytest.raises(TypeError, match="placements must be"):
        resolve_placement(3, "y", w)
    with pytest.raises(ValueError, match="two positive ints"):
        BlockShard(block=(0, 4))
    with pytest.raises(ValueError, match="fp8_e4m3"):
        BlockShard(block=(4, 4), quantize="int8")


def test_bucket_grouping():
    names = ["a.w", "a.b", "b.w", "c.w"]
    assert _bucket_groups(names, [8] * 4, None) == [[0, 1, 2, 3]]
    assert _bucket_groups(names, [8, 8, 20, 8], 16) == [[0, 1], [2], [3]]
    assert _bucket_groups(names, [8] * 4, ["b.*", ["c.*", "a.b"], "zzz.*"]) == [[2], [1, 3], [0]]
    with pytest.raises(TypeError, match="buckets must be"):
        _bucket_groups(names, [8] * 4, "a.*")
    with pytest.raises(ValueError, match="positive"):
        _bucket_groups(names, [8] * 4, 0)
    assert _common_module(["layers.0.attention", "layers.0.attention.wq", "layers.0.attention"]) == "layers.0.attention"
    assert _common_module(["layers.0.ffn", "layers.0.attention"]) == "layers.0"
    assert _common_module(["", "norm"]) == ""


def test_mixed_precision_accepts_torch_policy():
    from torch.distributed.fsdp import MixedPrecisionPolicy

    mp = MixedPrecision.coerce(MixedPrecisionPolicy(param_dtype=torch.bfloat16))
    assert mp.param_dtype == torch.bfloat16 and mp.reduce_dtype == torch.bfloat16  # torch's meaning of None
    assert MixedPrecision().reduce_dtype == torch.float32
    with pytest.raises(TypeError, match="mp_policy"):
        MixedPrecision.coerce("bf16")


def test_chunked_shard_keeps_its_layout_through_optimizer_math():
    layout = make_layout((6, 4), BlockShard(block=(2, 3)), 2)
    full = torch.randn(6, 4)
    a = ChunkedShard(layout.local_from_full(full, 1), layout, 1)
    b = torch.zeros_like(a)
    assert isinstance(b, ChunkedShard) and b._layout is layout and b.shape == a.shape
    b.add_(a).mul_(2)
    assert torch.equal(b._data, 2 * a._data)
    outs = torch._foreach_sqrt([b.abs()])
    assert isinstance(outs[0], ChunkedShard)
    assert isinstance(a.to(torch.float64), ChunkedShard)
    assert not isinstance(a.sum(), ChunkedShard)
    # The checkpoint protocol: chunks at their true offsets, views that write through.
    chunks = a.__create_chunk_list__()
    assert [tuple(c.offsets) for c in chunks] == [r.offsets for r in layout.rects[1]]
    items = a.__create_write_items__("w", a)
    assert [tuple(i.tensor_data.size) for i in items] == [(6, 4)] * len(chunks)
    view = a.__get_tensor_shard__(MetadataIndex("w", chunks[0].offsets))
    rect = layout.rects[1][0]
    assert torch.equal(view, full[rect.slices])
    view.fill_(7.0)
    assert (a._data[: rect.numel] == 7.0).all()
