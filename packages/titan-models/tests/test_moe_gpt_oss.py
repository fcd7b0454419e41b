"""gpt-oss's MoE pieces (router with bias and softmax over the top-k logits, clamped SwiGLU,
expert biases) against transformers' GptOssMLP, the independent reference, in float32."""
from __future__ import annotations

import pytest
import torch
import transformers
from transformers.models.gpt_oss.modeling_gpt_oss import GptOssMLP

from titan_models.components.ffn import ClampedSwiGLU
from titan_models.components.moe import MoEConfig

DIM, FFN, E = 24, 16, 8


def _reference(top_k: int, seed: int = 0) -> GptOssMLP:
    config = transformers.GptOssConfig(hidden_size=DIM, intermediate_size=FFN, num_local_experts=E,
                                       num_experts_per_tok=top_k, num_hidden_layers=1)
    torch.manual_seed(seed)
    mlp = GptOssMLP(config)
    with torch.no_grad():
        for param in mlp.parameters():
            param.normal_(0.0, 1.0)  # large enough that the clamps at +-7 bite
    return mlp


def _titan(reference: GptOssMLP, top_k: int, implementation: str):
    config = MoEConfig(num_experts=E, top_k=top_k, expert_dim=FFN, score_func="topk_softmax", router_bias=True,
                       expert_linear_bias=True, activation=ClampedSwiGLU(), implementation=implementation)
    moe = config.build(DIM)
    ex = reference.experts
    with torch.no_grad():  # HF: gate_up_proj [E, dim, 2*ffn] used as x @ W, gate in columns ::2, up in 1::2
        moe.router.gate.weight.copy_(reference.router.weight)
        moe.router.gate.bias.copy_(reference.router.bias)
        moe.experts.w1.copy_(ex.gate_up_proj[..., ::2].transpose(1, 2))
        moe.experts.w3.copy_(ex.gate_up_proj[..., 1::2].transpose(1, 2))
        moe.experts.w1_bias.copy_(ex.gate_up_proj_bias[:, ::2])
        moe.experts.w3_bias.copy_(ex.gate_up_proj_bias[:, 1::2])
        moe.experts.w2.copy_(ex.down_proj.transpose(1, 2))
        moe.experts.w2_bias.copy_(ex.down_proj_bias)
    return moe


def _grouped_mm_on_cpu() -> bool:
    try:
        torch._grouped_mm(torch.ones(2, 8), torch.ones(1, 8, 8), offs=torch.tensor([2], dtype=torch.int32))
    except (RuntimeError, NotImplementedError):
        return False
    return True


@pytest.mark.parametrize("top_k", [1, 2, 4])
@pytest.mark.parametrize("implementation", ["loop", "grouped_mm"])
def test_gpt_oss_moe_matches_transformers(top_k, implementation):
    if implementation == "grouped_mm" and not _grouped_mm_on_cpu():
        pytest.skip("torch._grouped_mm has no CPU kernel in this torch")
    reference = _reference(top_k)
    moe = _titan(reference, top_k, implementation)
    x = torch.randn(3, 21, DIM)
    with torch.no_grad():
        want, _ = reference(x)
        got = moe(x)
        _, scores, chosen = reference.router(x.reshape(-1, DIM))
    assert ((got - want).norm() / want.norm()).item() < 1e-5
    assert moe.tokens_per_expert.sum().item() == x.shape[0] * x.shape[1] * top_k
    # the clamps were exercised: some gate pre-activations exceed the limit
    gate_up = x.reshape(-1, DIM) @ reference.experts.gate_up_proj[0] + reference.experts.gate_up_proj_bias[0]
    assert (gate_up.abs() > 7).any()
    assert torch.equal(moe.tokens_per_expert, torch.bincount(chosen.flatten(), minlength=E).to(torch.float32))


def test_clamped_swiglu_formula_and_control():
    gate = torch.tensor([-9.0, -1.0, 0.5, 8.0])
    up = torch.tensor([-8.0, 2.0, 0.5, 9.0])
    g, u = torch.tensor([-9.0, -1.0, 0.5, 7.0]), torch.tensor([-7.0, 2.0, 0.5, 7.0])
    want = (u + 1) * g * torch.sigmoid(1.702 * g)
    assert torch.allclose(ClampedSwiGLU()(gate, up), want)
    assert not torch.allclose(ClampedSwiGLU(limit=100.0)(gate, up), want)  # the clamp matters here


def test_topk_softmax_rejects_group_routing():
    with pytest.raises(ValueError, match="topk_softmax"):
        MoEConfig(num_experts=8, top_k=2, expert_dim=4, score_func="topk_softmax", n_group=2, topk_group=1).build(8)
    with pytest.raises(ValueError, match="score_func"):
        MoEConfig(num_experts=8, top_k=2, expert_dim=4, score_func="bogus").build(8)
