"""A budget at or above keep-everything's predicted peak gets keep-everything (no recomputation); just under it the
plan recomputes. GiB-scale blocks, so the knapsack's rounded grid (not 1 byte) is in play. Planned bytes only."""
from __future__ import annotations

from titan_train.remat import BlockProfile, StaticMemory, peak_model, peak_plan
from titan_train.remat.measure import OpRecord
from titan_train.remat.peak import block_transient
from titan_train.remat.plan import GIB, BlockChoice, cost

MIB = 1 << 20


def _profiles(n: int) -> list[BlockProfile]:
    ops = [OpRecord("mm", 672 * MIB + 7, 10**12), OpRecord("silu", 224 * MIB + 3, 10**8),
           OpRecord("_scaled_dot_product_flash_attention_for_cpu", 65 * MIB + 1, 10**11),
           OpRecord("mul", 768 * MIB + 5, 10**8)]
    return [BlockProfile(f"layers.{i}", input_bytes=64 * MIB, ops=ops) for i in range(n)]


def test_keep_all_when_it_fits_and_recompute_just_under():
    profiles = _profiles(32)
    memory = StaticMemory(forward_bytes=int(74.8 * GIB), gradient_bytes=int(15 * GIB), gradients_persist=False,
                          loss_bytes=int(3.3 * GIB))
    grads = [int(0.41 * GIB)] * 32
    keep_all = [BlockChoice(b.path, "keep", None, *cost(b, None)) for b in profiles]
    predicted = peak_model(keep_all, grads, memory, block_transient(profiles)).total_bytes
    for budget in (predicted, predicted + GIB):
        choices, model = peak_plan(profiles, budget, memory, grads)
        assert [c.option for c in choices] == ["keep"] * 32 and model.total_bytes == predicted
    choices, model = peak_plan(profiles, predicted - 1, memory, grads)
    assert model.total_bytes <= predicted - 1 and sum(c.recomputed_flops for c in choices) > 0
    # monotone: no block could recompute less and still fit
    assert sum(c.option == "keep" for c in choices) >= 30
