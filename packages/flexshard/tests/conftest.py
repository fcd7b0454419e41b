"""Puts this folder on sys.path: test files import flexshard_testmodel.py and flexshard_ranks.py by name
(pytest's importlib mode does not), as the rank workers do."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from flexshard_ranks import run_ranks  # noqa: E402


@pytest.fixture
def ranks():
    return run_ranks
