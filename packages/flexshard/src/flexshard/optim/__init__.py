"""Optimizers for flexshard parameters."""

from .muon import Muon, default_muon_rule
from .newton_schulz import newton_schulz, newton_schulz_flops

__all__ = ["Muon", "default_muon_rule", "newton_schulz", "newton_schulz_flops"]
