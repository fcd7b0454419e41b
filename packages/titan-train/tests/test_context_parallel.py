"""Context parallelism on gloo ranks follows the single-process loss curve of the same job, alone and with
FSDP, tensor parallel and pipeline parallel; the checks of the sequence layout.

The tiny job packs documents (data.document_masking is on), so the ring attention's document mask is
exercised too. Tolerance: relative 1e-4 per step over 10 steps in fp32, as in test_parallel.py: the
ranks start from the same weights and batches, and attention merged block by block with log-sum-exp
(plus gradients summed around the ring and over dp_shard x cp by FSDP) changes only the order of float
sums (largest seen: 5e-7). A wrong mask, a block merged with the wrong weight, dK/dV returned to the wrong
rank or positions of the wrong chunk move the loss by 1e-2 or more within a few steps.
"""
from __future__ import annotations

import pytest

from titan_train import train
from titan_train.context_parallel import check_context_parallel

STEPS = {"training.steps": "10"}


def test_sequence_layout_checks():
    check_context_parallel(cp=2, tp=2, seq_len=64)
    with pytest.raises(ValueError, match="divisible by 2 \\* parallelism.cp = 6"):
        check_context_parallel(cp=3, tp=1, seq_len=64)
    with pytest.raises(ValueError, match="seq_len / parallelism.cp = 32 must be divisible by parallelism.tp = 3"):
        check_context_parallel(cp=2, tp=3, seq_len=64)


@pytest.fixture(scope="module")
def reference(tmp_path_factory, jobs):
    return train(jobs.tiny(tmp_path_factory.mktemp("single"), **STEPS)).losses


@pytest.mark.parametrize("nproc,layout", [
    (2, {"parallelism.cp": "2"}),
    (4, {"parallelism.cp": "2", "parallelism.dp_shard": "2"}),
    (4, {"parallelism.cp": "2", "parallelism.tp": "2"}),
    (4, {"parallelism.cp": "2", "parallelism.pp": "2"}),
], ids=["cp2", "cp2xfsdp2", "cp2xtp2", "cp2xpp2"])
def test_context_parallel_follows_single_process(reference, tmp_path, jobs, nproc, layout):
    curve = jobs.on_ranks(jobs.tiny(tmp_path, **{**STEPS, **layout}), nproc)
    assert sorted(curve) == sorted(reference)
    for step, loss in reference.items():
        assert curve[step] == pytest.approx(loss, rel=1e-4), (step, curve, reference)
