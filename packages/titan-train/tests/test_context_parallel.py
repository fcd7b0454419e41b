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


LAYOUTS = {  # id -> (ranks, parallelism)
    "cp2": (2, {"parallelism.cp": "2"}),
    "cp2xfsdp2": (4, {"parallelism.cp": "2", "parallelism.dp_shard": "2"}),
    "cp2xtp2": (4, {"parallelism.cp": "2", "parallelism.tp": "2"}),
    "cp2xpp2": (4, {"parallelism.cp": "2", "parallelism.pp": "2"}),
}


@pytest.fixture(scope="module")
def curves(tmp_path_factory, jobs) -> dict[str, dict[int, float]]:
    """id -> loss curve of each of LAYOUTS; the runs of one rank count in one spawn."""
    root, curves = tmp_path_factory.mktemp("layouts"), {}
    for nproc in (2, 4):
        names = [name for name, (n, _) in LAYOUTS.items() if n == nproc]
        configs = [jobs.tiny(root / name, **{**STEPS, **LAYOUTS[name][1]}) for name in names]
        curves.update(zip(names, jobs.each_on_ranks(configs, nproc)))
    return curves


@pytest.mark.parametrize("name", LAYOUTS)
def test_context_parallel_follows_single_process(reference, curves, name):
    curve = curves[name]
    assert sorted(curve) == sorted(reference)
    for step, loss in reference.items():
        assert curve[step] == pytest.approx(loss, rel=1e-4), (step, curve, reference)
