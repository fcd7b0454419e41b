"""Data-parallel sharding with per-parameter placements, buckets, distributed Muon and blockwise-quantized all-gathers."""

__version__ = "0.1.0"

from . import optim
from .chunked import ChunkedShard
from .comm_counter import CollectiveCall, CollectiveCounter
from .full_tensor import full_tensor
from .mixed_precision import MixedPrecision
from .placements import BlockShard, Owned, RowShard
from .quantize import GatheredFP8, dequantize_blockwise, gathered_fp8, quantize_blockwise
from .report import ShardLayout, layout
from .shard import shard

__all__ = [
    "BlockShard",
    "ChunkedShard",
    "CollectiveCall",
    "CollectiveCounter",
    "GatheredFP8",
    "MixedPrecision",
    "Owned",
    "RowShard",
    "ShardLayout",
    "dequantize_blockwise",
    "full_tensor",
    "gathered_fp8",
    "layout",
    "optim",
    "quantize_blockwise",
    "shard",
]
