"""pytest setup for torch-checkpointing: one thread (the machine is shared), helpers importable."""
from __future__ import annotations

import sys
from pathlib import Path

import torch

# pytest runs with --import-mode=importlib, which does not put test folders on sys.path; the
# helper module has a package-specific name so it cannot shadow another package's helpers.
sys.path.insert(0, str(Path(__file__).parent))
torch.set_num_threads(1)
