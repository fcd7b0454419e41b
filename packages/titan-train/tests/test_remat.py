"""activation_checkpoint.mode=remat: the ops the plan recomputes are recomputed (counted in backward),
losses stay bit for bit eager's (fp32 recomputation repeats the same ops), and a budget plan is the
cheapest that fits (against a brute force) and respects the budget in planned bytes."""
from __future__ import annotations

import itertools
import json
from collections import Counter

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from titan_train import train
from titan_train.remat import BlockProfile, budget_plan
from titan_train.remat.measure import OpRecord
from titan_train.remat.plan import GIB, OPTIONS, cost
from titan_train.trainer import Trainer


class BackwardOps(TorchDispatchMode):
    """Counts the aten ops run inside autograd's backward (recomputation happens there)."""

    def __init__(self):
        super().__init__()
        self.counts: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if torch._C._current_autograd_node() is not None:
            self.counts[func._overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


def backward_ops(trainer: Trainer) -> Counter[str]:
    batch = trainer.loader.next_batch(trainer.config.training.batch_size)
    counter = BackwardOps()
    with counter:
        trainer.loss_module(batch.tokens, batch.labels, batch.document_ids).backward()
    return counter.counts


def forward_mm_per_block(trainer: Trainer) -> int:
    """mm calls inside layers.0's forward, counted in eager (hooks mark the block's window)."""
    block, inside, calls = trainer.model.layers["0"], [False], [0]

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            calls[0] += inside[0] and func is torch.ops.aten.mm.default
            return func(*args, **(kwargs or {}))

    handles = [block.register_forward_pre_hook(lambda *_: inside.__setitem__(0, True)),
               block.register_forward_hook(lambda *_: inside.__setitem__(0, False))]
    batch = trainer.loader.next_batch(trainer.config.training.batch_size)
    with torch.no_grad(), Count():
        trainer.loss_module(batch.tokens, batch.labels, batch.document_ids)
    for h in handles:
        h.remove()
    return calls[0]


def tiny_trainer(jobs, folder, **overrides) -> Trainer:
    return Trainer(jobs.tiny(folder, **{"training.steps": "3", **overrides}), torch.device("cpu"))


@pytest.fixture(scope="module")
def plain_counts(tmp_path_factory, jobs):
    trainer = tiny_trainer(jobs, tmp_path_factory.mktemp("plain"))
    counts = backward_ops(trainer)
    counts["forward_mm_per_block"] = forward_mm_per_block(trainer)
    assert counts["forward_mm_per_block"] >= 3
    return counts


def test_explicit_save_ops_recompute_the_rest(tmp_path, jobs, plain_counts):
    remat = {"activation_checkpoint.mode": "remat",
             "activation_checkpoint.save_ops": "mm,_scaled_dot_product_flash_attention_for_cpu"}
    counts = backward_ops(tiny_trainer(jobs, tmp_path / "count", **remat))
    assert plain_counts["silu"] == 0 and counts["silu"] == 2  # each block's SwiGLU activation recomputed
    assert counts["rsqrt"] == plain_counts["rsqrt"] + 4  # both RMSNorms of both blocks
    assert counts["mm"] == plain_counts["mm"]  # products saved, not recomputed
    eager = train(jobs.tiny(tmp_path / "eager", **{"training.steps": "3"})).losses
    assert train(jobs.tiny(tmp_path / "remat", **{"training.steps": "3", **remat})).losses == eager


def test_save_blocks_keep_whole_blocks(tmp_path, jobs, plain_counts):
    trainer = tiny_trainer(jobs, tmp_path, **{"activation_checkpoint.mode": "remat",
                                              "activation_checkpoint.save_blocks": "layers.1"})
    counts = backward_ops(trainer)
    # layers.0 recomputed, layers.1 not; torch's checkpoint stops recomputing once backward has every tensor
    # it saved, so the block's last product (w2, whose output nothing saves) is not run again
    assert counts["mm"] == plain_counts["mm"] + plain_counts["forward_mm_per_block"] - 1
    assert [b["option"] for b in trainer.parallelizer.remat_plan["blocks"]] == ["explicit", "keep"]


# 0.02704 GiB: the 0.0264 GiB of weights, gradients and moments + room for the two blocks' inputs only
@pytest.mark.parametrize("budget_gib, option", [(0.02704, "recompute"), (1.0, "keep")])
def test_budget_plan_in_the_trainer(tmp_path, jobs, plain_counts, budget_gib, option):
    trainer = tiny_trainer(jobs, tmp_path, **{"activation_checkpoint.mode": "remat",
                                              "activation_checkpoint.memory_budget_gib": str(budget_gib)})
    report = json.loads((tmp_path / "remat_plan.json").read_text())
    assert report["planned_total_bytes"] <= budget_gib * GIB
    assert {b["option"] for b in report["blocks"]} == {option}
    counts = backward_ops(trainer)
    # every block's forward products again (but the last, see above), or nothing
    extra = 2 * (plain_counts["forward_mm_per_block"] - 1) if option == "recompute" else 0
    assert counts["mm"] == plain_counts["mm"] + extra


def _profile(path: str, scale: int) -> BlockProfile:
    ops = [OpRecord("mm", 100 * scale, 1000 * scale), OpRecord("silu", 40 * scale, 10 * scale),
           OpRecord("_scaled_dot_product_flash_attention_for_cpu", 30 * scale, 500 * scale),
           OpRecord("mul", 60 * scale, 5 * scale)]
    return BlockProfile(path, input_bytes=20 * scale, ops=ops)


@pytest.mark.parametrize("budget", [80, 150, 300, 420, 700, 1000])
def test_budget_plan_is_the_cheapest_that_fits(budget):
    profiles = [_profile("layers.0", 1), _profile("layers.1", 2), _profile("layers.2", 1)]
    best = None
    for combo in itertools.product(OPTIONS.values(), repeat=len(profiles)):  # brute force reference
        costs = [cost(p, ops) for p, ops in zip(profiles, combo)]
        if sum(b for b, _ in costs) <= budget:
            flops = sum(f for _, f in costs)
            best = flops if best is None else min(best, flops)
    if best is None:
        with pytest.raises(ValueError, match="recomputing every block still saves"):
            budget_plan(profiles, budget)
        return
    plan = budget_plan(profiles, budget)
    assert sum(c.saved_bytes for c in plan) <= budget
    assert sum(c.recomputed_flops for c in plan) == best


def test_remat_errors(tmp_path, jobs):
    with pytest.raises(ValueError, match="no block matches layers.9"):
        tiny_trainer(jobs, tmp_path / "a", **{"activation_checkpoint.mode": "remat",
                                              "activation_checkpoint.save_blocks": "layers.9"})
    with pytest.raises(ValueError, match="does not hold the weights"):
        tiny_trainer(jobs, tmp_path / "b", **{"activation_checkpoint.mode": "remat",
                                              "activation_checkpoint.memory_budget_gib": "0.001"})
    with pytest.raises(ValueError, match="need activation_checkpoint.mode=remat"):
        tiny_trainer(jobs, tmp_path / "c", **{"activation_checkpoint.save_ops": "mm"})
