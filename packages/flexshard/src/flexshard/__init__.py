"""Data-parallel sharding with per-parameter placements, buckets, distributed Muon and blockwise-quantized all-gathers."""

__version__ = "0.1.0"
