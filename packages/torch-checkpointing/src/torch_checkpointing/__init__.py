"""Distributed checkpointing: metadata exchanged once, async staging, atomic commit, resharding load."""

__version__ = "0.1.0"
