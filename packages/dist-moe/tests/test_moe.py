"""The MoE module: the documented parameter names and shapes, numerics against a dense float64
reference layer, the auxiliary loss reaching the router, the buffers, and host reads."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import dist_moe

DEEPSEEK_LIKE = dict(dim=16, num_experts=8, top_k=3, expert_dim=12, num_shared_experts=2, score_func="sigmoid",
                     n_group=4, topk_group=2, route_scale=2.5)
QWEN_LIKE = dict(dim=16, num_experts=6, top_k=2, expert_dim=10)
QWEN3_NEXT_LIKE = dict(dim=16, num_experts=6, top_k=2, expert_dim=10, shared_expert_dim=14, shared_expert_gate=True)
# a hash-routed layer of DeepSeek-V4: sqrt-softplus scores, one shared expert, SwiGLU clamped at 0.05 (the
# tiny weights' gate/up values reach ~0.1, so the clamp bites; the test checks it does)
DEEPSEEK_V4_HASH = dict(dim=16, num_experts=8, top_k=2, expert_dim=12, num_shared_experts=1, score_func="sqrtsoftplus",
                        route_scale=1.5, hash_vocab_size=50, swiglu_limit=0.05)
DEEPSEEK_V4_TOPK = {**DEEPSEEK_V4_HASH, "hash_vocab_size": None}
# Muse Spark's layer: scaled sigmoid router, experts at a pooled width 12 between projections, a zero-centred
# norm on the pooled tokens and an input-scaled one on each expert's output (weights randomised in the test)
SPARK_LIKE = dict(dim=16, num_experts=6, top_k=2, expert_dim=10, score_func="sigmoid", router_logit_scale=0.4,
                  expert_pool_dim=12, pre_expert_norm_eps=1e-5, post_expert_norm_eps=1e-8)


def _rms(x, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def clamped_swiglu(gate, up, limit):
    if limit is None:
        return F.silu(gate) * up
    return gate.clamp(max=limit) * torch.sigmoid(gate.clamp(max=limit)) * up.clamp(min=-limit, max=limit)


def dense_reference(moe, x, token_ids=None):
    """Every token through every expert, masked by its routing weights (float64; shares no code
    with the layer except the routing rule, which test_routing checks on its own)."""
    cfg = moe.config
    tokens = x.reshape(-1, cfg.dim).double()
    p = {k: v.double() for k, v in moe.named_parameters()}
    hashed = None if token_ids is None else moe.tid2eid[token_ids.reshape(-1)]
    routing = dist_moe.route(cfg.router_logit_scale * (tokens @ p["router.gate.weight"].T), top_k=cfg.top_k,
                             score_func=cfg.score_func,
                             n_group=cfg.n_group, topk_group=cfg.topk_group, norm_topk_prob=cfg.norm_topk_prob,
                             route_scale=cfg.route_scale, bias=moe.expert_bias, hashed=hashed)
    mask = torch.zeros(tokens.shape[0], cfg.num_experts, dtype=torch.float64)
    mask.scatter_(1, routing.expert_ids, routing.weights.double())
    pooled = tokens
    if cfg.expert_pool_dim is not None:
        pooled = tokens @ p["pre_expert_proj.weight"].T
        if cfg.pre_expert_norm_eps is not None:
            pooled = _rms(pooled, cfg.pre_expert_norm_eps) * (1 + p["pre_expert_norm.weight"])
    routed = torch.zeros_like(pooled)
    for e in range(cfg.num_experts):
        h = clamped_swiglu(pooled @ p["experts.w1"][e].T, pooled @ p["experts.w3"][e].T, cfg.swiglu_limit)
        y = h @ p["experts.w2"][e].T
        if cfg.post_expert_norm_eps is not None:
            y = _rms(y * (1 + p["post_expert_norm.weight"]), cfg.post_expert_norm_eps)
        routed += mask[:, e:e + 1] * y
    out = routed if cfg.expert_pool_dim is None else routed @ p["post_expert_proj.weight"].T
    if moe.shared_experts is not None:
        h = clamped_swiglu(tokens @ p["shared_experts.w1.weight"].T, tokens @ p["shared_experts.w3.weight"].T,
                           cfg.swiglu_limit)
        gate = torch.sigmoid(tokens @ p["shared_gate.weight"].T) if moe.shared_gate is not None else 1.0
        out += gate * (h @ p["shared_experts.w2.weight"].T)
    return out.view(x.shape)


def test_parameter_names_and_shapes_follow_the_conventions():
    moe = dist_moe.MoEConfig(**DEEPSEEK_LIKE).build()
    shapes = {k: tuple(v.shape) for k, v in moe.state_dict().items()}
    assert shapes == {
        "router.gate.weight": (8, 16),
        "experts.w1": (8, 12, 16), "experts.w2": (8, 16, 12), "experts.w3": (8, 12, 16),
        "shared_experts.w1.weight": (24, 16), "shared_experts.w2.weight": (16, 24),
        "shared_experts.w3.weight": (24, 16),
        "expert_bias": (8,),
    }
    assert dict(moe.named_buffers())["tokens_per_expert"].shape == (8,)  # not persistent
    assert "shared_experts" not in dict(dist_moe.MoEConfig(**QWEN_LIKE).build().named_modules())


@pytest.mark.parametrize("fields", [DEEPSEEK_LIKE, QWEN_LIKE, QWEN3_NEXT_LIKE, DEEPSEEK_V4_HASH, DEEPSEEK_V4_TOPK,
                                    SPARK_LIKE],
                         ids=["deepseek_like", "qwen_like", "qwen3_next_like", "deepseek_v4_hash", "deepseek_v4_topk",
                              "muse_spark_like"])
def test_forward_and_gradients_match_a_dense_reference(fields):
    torch.manual_seed(0)
    moe = dist_moe.MoEConfig(**fields).build().double()
    with torch.no_grad():
        moe.expert_bias.copy_(0.1 * torch.randn(moe.config.num_experts))
        for norm in (moe.pre_expert_norm, moe.post_expert_norm):
            if norm is not None:  # zero after init: move them so they matter
                norm.weight.copy_(0.3 * torch.randn_like(norm.weight))
    x = torch.randn(2, 9, 16, dtype=torch.float64, requires_grad=True)
    token_ids = torch.randint(0, 50, (2, 9)) if moe.tid2eid is not None else None
    if token_ids is not None:  # distinct experts per row, not the default table
        moe.tid2eid.copy_(torch.stack([torch.randperm(8)[:2] for _ in range(50)]))
    out = moe(x, token_ids=token_ids)
    grad = torch.randn_like(out)
    out.backward(grad)
    got = {"out": out.detach(), "x": x.grad} | {k: v.grad for k, v in moe.named_parameters()}

    moe.zero_grad()
    x_ref = x.detach().clone().requires_grad_()
    params = dict(moe.named_parameters())
    want_out = dense_reference(moe, x_ref, token_ids)
    want_out.backward(grad)
    want = {"out": want_out.detach(), "x": x_ref.grad} | {k: v.grad for k, v in params.items()}
    for name in got:
        # Routing runs in float32 (as in titan-models), which bounds the agreement.
        torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-7, msg=name)


def test_swiglu_limit_and_hash_table_change_the_layer():
    """Controls for the deepseek_v4 cases above: the clamp bites, and the hash table, not the router, picks."""
    torch.manual_seed(0)
    moe = dist_moe.MoEConfig(**DEEPSEEK_V4_HASH).build().double()
    x, token_ids = torch.randn(2, 9, 16, dtype=torch.float64), torch.randint(0, 50, (2, 9))
    unclamped = dist_moe.MoEConfig(**{**DEEPSEEK_V4_HASH, "swiglu_limit": None}).build().double()
    unclamped.load_state_dict(moe.state_dict())
    assert (moe(x, token_ids=token_ids) - unclamped(x, token_ids=token_ids)).abs().max() > 1e-4
    moe(x, token_ids=token_ids)
    table_loads = torch.zeros(8).index_add_(0, moe.tid2eid[token_ids.reshape(-1)].reshape(-1), torch.ones(36))
    assert torch.equal(moe.tokens_per_expert, table_loads)
    with pytest.raises(ValueError, match="needs the token ids"):
        moe(x)


def test_autocast_runs_the_experts_in_its_dtype_with_fp32_gradients():
    torch.manual_seed(0)
    moe = dist_moe.MoEConfig(**QWEN_LIKE).build()
    x = torch.randn(2, 9, 16)
    want = dense_reference(moe, x)
    seen = []
    original = dist_moe.moe.expert_mlp

    def spy(routed, w1, *args, **kwargs):
        seen.append((routed.dtype, w1.dtype))
        return original(routed, w1, *args, **kwargs)

    dist_moe.moe.expert_mlp = spy
    try:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = moe(x)
    finally:
        dist_moe.moe.expert_mlp = original
    (out.float() * torch.randn(out.shape)).sum().backward()  # an fp32 gradient reaches the bf16 experts
    assert seen == [(torch.bfloat16, torch.bfloat16)]
    assert moe.experts.w1.grad.dtype == torch.float32  # the fp32 master weights get their gradients
    torch.testing.assert_close(out.double(), want, rtol=3e-2, atol=3e-2)


def test_tokens_per_expert_and_bias_update():
    torch.manual_seed(0)
    moe = dist_moe.MoEConfig(**QWEN_LIKE).build()
    moe(torch.randn(1, 20, 16))
    counts = moe.tokens_per_expert
    assert counts.dtype == torch.float32 and counts.sum().item() == 20 * 2
    before = moe.expert_bias.clone()
    dist_moe.update_expert_bias(moe.expert_bias, counts, rate=1e-3)
    assert torch.equal(torch.sign(moe.expert_bias - before), torch.sign(counts.mean() - counts))


def test_aux_loss_adds_its_gradient_without_changing_the_output():
    torch.manual_seed(0)
    moe = dist_moe.MoEConfig(**QWEN_LIKE, aux_loss_alpha=0.5).build().train()
    plain = dist_moe.MoEConfig(**QWEN_LIKE).build()
    plain.load_state_dict(moe.state_dict())
    x = torch.randn(2, 7, 16)
    out, plain_out = moe(x), plain(x)
    out.sum().backward()
    plain_out.sum().backward()
    torch.testing.assert_close(out, plain_out)
    # The aux loss's own gradient, computed directly from its definition's inputs.
    gate = plain.router.gate.weight.detach().clone().requires_grad_()
    routing = dist_moe.route(x.reshape(-1, 16) @ gate.T, top_k=2)
    aux = dist_moe.sequence_balance_loss(routing.scores.view(2, 7, -1), routing.expert_ids.view(2, 7, -1),
                                         alpha=0.5)
    aux.backward()
    assert gate.grad.abs().max() > 0
    assert moe.aux_loss.item() == pytest.approx(aux.item())
    torch.testing.assert_close(moe.router.gate.weight.grad, plain.router.gate.weight.grad + gate.grad,
                               rtol=1e-5, atol=1e-7)


def test_local_layer_reads_the_host_once_on_the_torch_path_and_never_in_backward():
    moe = dist_moe.MoEConfig(**QWEN_LIKE).build()
    with dist_moe.count_host_syncs() as forward:
        out = moe(torch.randn(1, 5, 16))
    with dist_moe.count_host_syncs() as backward:
        out.sum().backward()
    assert forward.reasons == ["expert_mlp: per-expert row ends (torch path)"]
    assert backward.count == 0


def test_config_like_copies_routing_fields_by_name():
    class Other:  # e.g. titan-models' MoEConfig
        num_experts, top_k, expert_dim, num_shared_experts = 8, 2, 32, 1
        score_func, n_group, topk_group, norm_topk_prob, route_scale = "sigmoid", 2, 1, False, 1.5
        implementation = "auto"  # not a field here: ignored

    cfg = dist_moe.MoEConfig.like(Other(), dim=64, backend="torch")
    assert (cfg.dim, cfg.num_experts, cfg.score_func, cfg.n_group, cfg.route_scale, cfg.backend) == (
        64, 8, "sigmoid", 2, 1.5, "torch")


@pytest.mark.parametrize("change, message", [
    (dict(top_k=9), "top_k"), (dict(expert_dim=0), "expert_dim"), (dict(backend="cuda"), "backend"),
    (dict(aux_loss_alpha=-1.0), "aux_loss_alpha"), (dict(hash_vocab_size=0), "hash_vocab_size"),
    (dict(swiglu_limit=0.0), "swiglu_limit"), (dict(swiglu_limit=7.0, backend="triton"), "swiglu_limit"),
    (dict(score_func="relu"), "score_func"), (dict(expert_pool_dim=0), "expert_pool_dim"),
    (dict(pre_expert_norm_eps=1e-5), "pre_expert_norm_eps"),
])
def test_config_errors_are_named(change, message):
    with pytest.raises(ValueError, match=message):
        dist_moe.MoEConfig(**{**QWEN_LIKE, **change})


def test_keep_routed_input_must_be_a_bool():
    with pytest.raises(TypeError, match="keep_routed_input must be a bool"):
        dist_moe.MoEConfig(**QWEN_LIKE, keep_routed_input=1)


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (Triton kernels)")


@cuda
def test_triton_layer_matches_torch_layer_on_gpu_without_host_syncs(assert_no_host_sync):
    torch.manual_seed(0)
    fields = dict(DEEPSEEK_LIKE, dim=256, expert_dim=128)
    ref = dist_moe.MoEConfig(**fields, backend="torch").build().cuda()
    moe = dist_moe.MoEConfig(**fields, backend="triton").build().cuda()
    moe.load_state_dict(ref.state_dict())
    x = torch.randn(4, 64, 256, device="cuda")
    torch.testing.assert_close(moe(x), ref(x), rtol=2e-4, atol=2e-5)  # float32: tf32 off by default
    moe(x).sum().backward()  # compile (and tune) every kernel once
    assert_no_host_sync(lambda: moe(x).sum().backward())
