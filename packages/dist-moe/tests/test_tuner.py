"""The first-call tuner: candidates take turns, the fastest is kept, failing ones are skipped."""
from __future__ import annotations

import pytest
import torch

from dist_moe.kernels import configs
from dist_moe.kernels.configs import RowConfig

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (the tuner times with CUDA events)")


def test_tuning_off_takes_the_first_candidate(monkeypatch):
    monkeypatch.setenv("DIST_MOE_AUTOTUNE", "0")
    first, second = RowConfig(block_m=64), RowConfig(block_m=128)
    launched = []
    assert configs.choose(("tuner test", "off"), [first, second], launched.append) is first
    assert launched == []  # nothing is run to choose
    configs._chosen.pop(("tuner test", "off"))


@cuda
def test_tuner_alternates_and_keeps_the_fastest_on_gpu(monkeypatch):
    monkeypatch.setenv("DIST_MOE_AUTOTUNE", "1")
    slow, broken, fast = RowConfig(block_m=64), RowConfig(block_m=32), RowConfig(block_m=128)
    order = []

    def launch(config):
        if config is broken:
            raise RuntimeError("out of shared memory")
        order.append(config)
        torch.cuda._sleep(4_000_000 if config is slow else 1_000_000)  # GPU cycles: slow is 4x longer

    key = ("tuner test", "alternate")
    try:
        assert configs.choose(key, [slow, broken, fast], launch) is fast
        switches = sum(a is not b for a, b in zip(order, order[1:]))
        # Blocks in turns: at least one switch per block after the first, not one long run each.
        assert switches >= 2 * configs.TUNE_ROUNDS - 1, switches
        order.clear()
        assert configs.choose(key, [slow, broken, fast], launch) is fast  # chosen once per key
        assert order == []
    finally:
        configs._chosen.pop(key, None)
