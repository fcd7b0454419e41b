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
from titan_train.remat import BlockProfile, StaticMemory, budget_plan, peak_model, peak_plan
from titan_train.remat.measure import OpRecord
from titan_train.remat.peak import backward_floor, backward_walk, block_transient
from titan_train.remat.plan import GIB, OPTIONS, BlockChoice, cost
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


ACCUMULATE = {"training.grad_accum_steps": "2", "training.batch_size": "8"}  # the same 4-row microbatch


# 0.0358 GiB with two microbatches: the 28332032 bytes (0.02639 GiB) of weights, gradients (kept across
# microbatches) and moments + the first block's input (262144) + the last block's backward high mark: 9836544 bytes
# under every option here (held.py: its saved bytes and what its backward recomputes and holds in flight) =
# 38430720 bytes (0.035791 GiB); the first block must recompute (its backward peaks at that too, any more saved
# before the last block's does not fit), the last saves its attention (the least recomputation with that peak:
# keeping it whole would hold 8001536 more at the forward's end with the loss's buffers). (Without accumulation
# no budget gives all-recompute here: the backward's walk at the first block, holding every gradient, sets the
# floor, and the last block then has room to save.)
@pytest.mark.parametrize("budget_gib, options, overrides", [(0.0358, ["recompute", "save_attention"], ACCUMULATE),
                                                            (1.0, ["keep", "keep"], {})])
def test_budget_plan_in_the_trainer(tmp_path, jobs, plain_counts, budget_gib, options, overrides):
    trainer = tiny_trainer(jobs, tmp_path, **{"activation_checkpoint.mode": "remat",
                                              "activation_checkpoint.memory_budget_gib": str(budget_gib), **overrides})
    report = json.loads((tmp_path / "remat_plan.json").read_text())
    assert report["planned_total_bytes"] <= budget_gib * GIB
    assert [b["option"] for b in report["blocks"]] == options
    counts = backward_ops(trainer)
    # each checkpointed block's forward products again (but the last, see above), or nothing
    extra = sum(o != "keep" for o in options) * (plain_counts["forward_mm_per_block"] - 1)
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


def _budget_report(jobs, folder, budget_gib: float, **overrides) -> dict:
    tiny_trainer(jobs, folder, **{"activation_checkpoint.mode": "remat",
                                  "activation_checkpoint.memory_budget_gib": str(budget_gib), **overrides})
    return json.loads((folder / "remat_plan.json").read_text())


def test_gradients_count_in_the_forward_only_when_accumulated(tmp_path, jobs):
    """The same microbatch (4 rows) and budget: without accumulation the gradients (None through the forward)
    leave room to keep both blocks; with two microbatches they persist and a block recomputes. 0.042 GiB lies
    between the two keep-everything peaks: one microbatch's backward at the last block, 40267776 bytes (0.03750
    GiB: 21249024 of weights and moments + the output head's and final norm's gradients, 394240 (the
    embedding's comes after the blocks) + the quarter of the last block's 3147776 made by its backward's high
    mark + both kept blocks, 2 x 8001536, + the last block's backward transient as kept, 1835008, held.py), and
    two microbatches' forward end, 46563328 (0.04337 GiB: 28332032 with the gradients + 2 x 8001536 + the
    loss's buffers, 2228224)."""
    single = _budget_report(jobs, tmp_path / "one", 0.042)
    accumulated = _budget_report(jobs, tmp_path / "two", 0.042, **ACCUMULATE)
    assert not single["gradients_persist"] and accumulated["gradients_persist"]
    assert single["gradient_bytes"] == accumulated["gradient_bytes"] > 0
    assert accumulated["forward_static_bytes"] == single["forward_static_bytes"] + single["gradient_bytes"]
    assert {b["option"] for b in single["blocks"]} == {"keep"}
    assert accumulated["recomputed_flops"] > single["recomputed_flops"] == 0
    for report in (single, accumulated):
        peaks = [report[k] for k in ("forward_peak_bytes", "backward_peak_bytes", "end_of_backward_bytes")]
        assert report["planned_total_bytes"] == max(peaks) <= report["budget_bytes"]
        assert report["end_of_backward_bytes"] == (report["forward_static_bytes"]
                                                   + (0 if report["gradients_persist"] else report["gradient_bytes"]))


def test_budget_below_weights_moments_and_gradients_is_refused(tmp_path, jobs):
    """0.023 GiB holds the weights and moments (0.0198) but not them with the gradients (0.0264), which all
    exist at the end of the backward; 0.032 holds those but not the backward at the first block under its
    cheapest option (peak.py backward_floor): the weights and moments, 21249024, the gradients made before it
    (the output head's and final norm's, 394240, and block 1's, 3147776; not the embedding's, 393216, made after
    every block), block 0's high mark (held.py: 9836544 bytes, as kept or recomputed) and the quarter of its own
    gradients made by then, 786432: 35414016 bytes, 0.03298 GiB, so 0.034 plans. With accumulation the gradients
    persist through the forward's 28332032 bytes: 0.034 does not hold them with block 0's high mark, 38168576."""
    for folder, budget, overrides, floor in (("a", "0.023", {}, 35414016), ("b", "0.032", {}, 35414016),
                                             ("c", "0.034", ACCUMULATE, 38168576)):
        with pytest.raises(ValueError, match=rf"memory_budget_gib={budget}0 does not hold the weights, gradients "
                                             r"and AdamW moments the backward ends with, 28332032 bytes .* or those "
                                             rf"at the first block's backward with its recomputation: {floor} bytes"):
            tiny_trainer(jobs, tmp_path / folder, **{"activation_checkpoint.mode": "remat",
                                                     "activation_checkpoint.memory_budget_gib": budget, **overrides})
    report = _budget_report(jobs, tmp_path / "d", 0.034)
    assert report["planned_total_bytes"] <= report["budget_bytes"] == int(0.034 * 2**30)
    assert report["recomputed_flops"] > 0


@pytest.mark.parametrize("budget", [3750, 3810, 3870, 3960, 4050, 4200])  # small: the knapsack's grid is 1 byte
@pytest.mark.parametrize("persist, late", [(False, 0), (True, 0), (False, 300)])
def test_peak_plan_is_the_cheapest_whose_walk_fits(budget, persist, late):
    """Against a brute force over every combination (ordered as the blocks are) whose peak model fits: the
    backward's walk caps each prefix of blocks, so where blocks saving more than their gradients (keep: 230
    saved, 200 of gradients) precede ones saving less, the walk's inside decides, not its ends. late: 300 of the
    700 bytes of gradients outside the blocks made after them (an embedding's), and a loss chunk freed before
    the head's gradient."""
    profiles = [_profile(f"layers.{i}", 1) for i in range(4)]
    grads = [200] * 4
    memory = StaticMemory(forward_bytes=2000 + (1500 if persist else 0), gradient_bytes=1500,
                          gradients_persist=persist, loss_bytes=50 + late, loss_chunk_bytes=late,
                          late_gradient_bytes=late)
    transient = block_transient(profiles)
    best, least, first = None, None, None
    for combo in itertools.product(OPTIONS.items(), repeat=len(profiles)):
        choices = [BlockChoice(p.path, name, ops, *cost(p, ops)) for p, (name, ops) in zip(profiles, combo)]
        total = peak_model(choices, grads, memory, transient).total_bytes
        walk0 = backward_walk(choices, grads, memory, transient)[0]
        least = total if least is None else min(least, total)
        first = walk0 if first is None else min(first, walk0)
        if total <= budget:
            flops = sum(c.recomputed_flops for c in choices)
            best = flops if best is None else min(best, flops)
    # the floor: no plan's peak below it, and it is the end of the backward or the walk at block 0 of a plan
    floor = backward_floor(profiles, memory, grads)
    assert floor <= least and floor == max(memory.end_of_backward_bytes, first)
    if best is None:  # with persisting gradients 3750 cannot hold the forward: 3500 + 80 of inputs + one block
        with pytest.raises(ValueError, match="memory_budget_gib"):
            peak_plan(profiles, budget, memory, grads)
        return
    choices, model = peak_plan(profiles, budget, memory, grads)
    assert model.total_bytes <= budget and model == peak_model(choices, grads, memory, transient)
    assert sum(c.recomputed_flops for c in choices) == best


def test_remat_errors(tmp_path, jobs):
    with pytest.raises(ValueError, match="no block matches layers.9"):
        tiny_trainer(jobs, tmp_path / "a", **{"activation_checkpoint.mode": "remat",
                                              "activation_checkpoint.save_blocks": "layers.9"})
    with pytest.raises(ValueError, match="does not hold the weights"):
        tiny_trainer(jobs, tmp_path / "b", **{"activation_checkpoint.mode": "remat",
                                              "activation_checkpoint.memory_budget_gib": "0.001"})
    with pytest.raises(ValueError, match="need activation_checkpoint.mode=remat"):
        tiny_trainer(jobs, tmp_path / "c", **{"activation_checkpoint.save_ops": "mm"})
