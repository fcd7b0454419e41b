"""The MoE layer against a per-token float64 reference written here from the routing rules."""
from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from titan_models.components.moe import MoE, MoEConfig


def reference_moe(moe: MoE, x: torch.Tensor) -> torch.Tensor:
    """Token by token in float64: score, bias-steered (group-limited) selection, weighting."""
    cfg = moe.config
    w_gate = moe.router.gate.weight.double()
    w1, w2, w3 = (w.double() for w in (moe.experts.w1, moe.experts.w2, moe.experts.w3))
    out = torch.zeros(x.shape[0] * x.shape[1], x.shape[2], dtype=torch.float64)
    for t, token in enumerate(x.reshape(-1, x.shape[-1]).double()):
        logits = w_gate @ token
        scores = logits.softmax(-1) if cfg.score_func == "softmax" else logits.sigmoid()
        biased = scores + moe.expert_bias.double()
        allowed = list(range(cfg.num_experts))
        if cfg.n_group > 1:
            size = cfg.num_experts // cfg.n_group
            group_score = [sorted(biased[g * size:(g + 1) * size].tolist())[-2:] for g in range(cfg.n_group)]
            best = sorted(range(cfg.n_group), key=lambda g: -sum(group_score[g]))[: cfg.topk_group]
            allowed = [e for e in allowed if e // size in best]
        chosen = sorted(allowed, key=lambda e: -biased[e].item())[: cfg.top_k]
        weights = scores[chosen]
        if cfg.norm_topk_prob:
            weights = weights / weights.sum()
        weights = weights * cfg.route_scale
        for e, w in zip(chosen, weights):
            out[t] += w * (w2[e] @ (F.silu(w1[e] @ token) * (w3[e] @ token)))
        if moe.shared_experts is not None:
            s = moe.shared_experts
            out[t] += s.w2.weight.double() @ (F.silu(s.w1.weight.double() @ token) * (s.w3.weight.double() @ token))
    return out.view(x.shape)


def make_moe(seed=0, **fields) -> MoE:
    config = MoEConfig(**({"num_experts": 8, "top_k": 2, "expert_dim": 24} | fields))
    torch.manual_seed(seed)
    moe = config.build(16)
    with torch.no_grad():
        for p in moe.parameters():
            p.normal_(0, 0.3)
    return moe


CASES = {
    "softmax-top2": {},
    "softmax-raw-top3": {"top_k": 3, "norm_topk_prob": False},
    "sigmoid-groups-shared-scaled": {"score_func": "sigmoid", "n_group": 4, "topk_group": 2, "route_scale": 2.5,
                                     "num_shared_experts": 2},
    "sigmoid-top1": {"score_func": "sigmoid", "top_k": 1},
}


@pytest.mark.parametrize("fields", CASES.values(), ids=CASES.keys())
@pytest.mark.parametrize("implementation", ["loop", "grouped_mm"])
def test_moe_matches_float64_reference(fields, implementation):
    if implementation == "grouped_mm" and not _cpu_grouped_mm():
        pytest.skip("torch._grouped_mm has no CPU kernel in this torch")
    moe = make_moe(**fields, implementation=implementation)
    with torch.no_grad():
        moe.expert_bias.uniform_(-0.1, 0.1)
    x = torch.randn(2, 9, 16)
    with torch.no_grad():
        out = moe(x)
    expected = reference_moe(moe, x)
    assert (out.double() - expected).abs().max() < 1e-5 * expected.abs().max()
    assert moe.tokens_per_expert.sum() == x.shape[0] * x.shape[1] * moe.config.top_k


def test_expert_bias_steers_selection_but_not_weights():
    moe = make_moe(score_func="sigmoid", top_k=1, norm_topk_prob=False)
    x = torch.randn(1, 12, 16)
    with torch.no_grad():
        moe.expert_bias[3] = 10.0  # every token now picks expert 3 ...
        out = moe(x)
    assert moe.tokens_per_expert.tolist() == [0, 0, 0, 12, 0, 0, 0, 0]
    # ... weighted by its un-biased sigmoid score
    tokens = x.reshape(-1, 16)
    score = (tokens @ moe.router.gate.weight.T).sigmoid()[:, 3:4]
    e3 = F.silu(tokens @ moe.experts.w1[3].T) * (tokens @ moe.experts.w3[3].T) @ moe.experts.w2[3].T
    assert torch.allclose(out.reshape(-1, 16), score * e3, atol=1e-5)


def test_empty_experts_and_gradients_flow():
    moe = make_moe(top_k=1, norm_topk_prob=False)  # (renormalised top-1 weights are constant 1)
    with torch.no_grad():
        moe.expert_bias[5] = 10.0  # all tokens to one expert: the others get no rows
    x = torch.randn(1, 6, 16, requires_grad=True)
    moe(x).sum().backward()
    assert x.grad is not None and moe.router.gate.weight.grad.abs().sum() > 0
    assert moe.experts.w1.grad[5].abs().sum() > 0 and moe.experts.w1.grad[0].abs().sum() == 0


def test_implementations_agree_in_a_model_transform():
    import titan_models as tm

    config = tm.transforms.num_layers(2)(tm.flavor("qwen3", "debug_moe"))
    loop = tm.transforms.moe(implementation="loop")(config)
    assert loop.moe.implementation == "loop" and config.moe.implementation == "auto"
    assert dataclasses.replace(loop.moe, implementation="auto") == config.moe
    with pytest.raises(ValueError, match="unknown expert implementation"):
        tm.transforms.moe(implementation="cutlass")


def test_config_validation():
    with pytest.raises(ValueError, match="top_k"):
        MoEConfig(num_experts=4, top_k=5, expert_dim=8).build(8)
    with pytest.raises(ValueError, match="n_group"):
        MoEConfig(num_experts=6, top_k=2, expert_dim=8, n_group=4).build(8)
    with pytest.raises(ValueError, match="score_func"):
        MoEConfig(num_experts=4, top_k=2, expert_dim=8, score_func="relu").build(8)


def _cpu_grouped_mm() -> bool:
    try:
        torch._grouped_mm(torch.ones(2, 8), torch.ones(1, 8, 8), offs=torch.tensor([2], dtype=torch.int32))
        return True
    except (RuntimeError, AttributeError, NotImplementedError):
        return False


@pytest.mark.skipif(not torch.cuda.is_available(), reason="bf16 torch._grouped_mm needs a CUDA GPU")
def test_grouped_mm_matches_loop_on_gpu_bf16():
    moe = make_moe(num_experts=16, top_k=4, expert_dim=128).cuda().to(torch.bfloat16)
    x = torch.randn(4, 64, 16, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        moe.experts.implementation = "grouped_mm"
        fused = moe(x).float()
        moe.experts.implementation = "loop"
        looped = moe(x).float()
    assert (fused - looped).abs().max() <= 2e-2 * looped.abs().max()
