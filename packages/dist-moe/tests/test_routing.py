"""Routing against per-token reference implementations written from the DeepSeek-V3 / Qwen3 rules."""
from __future__ import annotations

import math

import pytest
import torch

import dist_moe


def reference_route(logits, *, top_k, score_func, n_group, topk_group, norm, scale, bias):
    """One token at a time, with Python sorting: an independent statement of the rule."""
    weights, ids = [], []
    for row in logits.double():
        if score_func == "sqrtsoftplus":
            scores = torch.log1p(row.exp()).sqrt()
        else:
            scores = row.softmax(-1) if score_func == "softmax" else row.sigmoid()
        choice = (scores + bias.double()).tolist()
        per_group = len(choice) // n_group
        if n_group > 1:
            group_score = [sum(sorted(choice[g * per_group:(g + 1) * per_group], reverse=True)[:2])
                           for g in range(n_group)]
            kept = sorted(range(n_group), key=lambda g: -group_score[g])[:topk_group]
            allowed = [e for e in range(len(choice)) if e // per_group in kept]
        else:
            allowed = list(range(len(choice)))
        chosen = sorted(allowed, key=lambda e: -choice[e])[:top_k]
        w = scores[chosen]
        if norm:
            w = w / w.sum()
        weights.append(w * scale)
        ids.append(chosen)
    return torch.stack(weights), torch.tensor(ids)


@pytest.mark.parametrize("kind", ["qwen3_softmax", "deepseek_sigmoid_groups", "softmax_unnormalised_scaled",
                                  "deepseek_v4_sqrtsoftplus"])
def test_route_matches_reference(kind):
    gen = torch.Generator().manual_seed(0)
    num_experts = 16
    args = {
        "qwen3_softmax": dict(top_k=4, score_func="softmax", n_group=1, topk_group=1, norm=True, scale=1.0),
        "deepseek_sigmoid_groups": dict(top_k=4, score_func="sigmoid", n_group=4, topk_group=2, norm=True, scale=2.5),
        "softmax_unnormalised_scaled": dict(top_k=3, score_func="softmax", n_group=1, topk_group=1, norm=False,
                                            scale=0.5),
        "deepseek_v4_sqrtsoftplus": dict(top_k=6, score_func="sqrtsoftplus", n_group=1, topk_group=1, norm=True,
                                         scale=1.5),
    }[kind]
    logits = torch.randn(64, num_experts, generator=gen)
    bias = 0.05 * torch.randn(num_experts, generator=gen)
    got = dist_moe.route(logits, top_k=args["top_k"], score_func=args["score_func"], n_group=args["n_group"],
                         topk_group=args["topk_group"], norm_topk_prob=args["norm"], route_scale=args["scale"],
                         bias=bias)
    want_w, want_ids = reference_route(logits, bias=bias, **args)
    # Compare as sets per token (the order of the k choices is not part of the contract).
    got_ids, order = got.expert_ids.sort(dim=1)
    want_ids, want_order = want_ids.sort(dim=1)
    assert torch.equal(got_ids, want_ids)
    torch.testing.assert_close(got.weights.gather(1, order).double(), want_w.gather(1, want_order),
                               rtol=1e-6, atol=1e-7)


def test_hash_routing_takes_the_table_experts_weighted_by_their_scores():
    """DeepSeek-V4's hash layers: the experts are tid2eid[token id] whatever the logits and the bias say; the
    weights are those experts' sqrt-softplus scores, renormalised and scaled."""
    gen = torch.Generator().manual_seed(1)
    vocab, num_experts, top_k = 30, 8, 2
    tid2eid = torch.stack([torch.randperm(num_experts, generator=gen)[:top_k] for _ in range(vocab)])
    token_ids = torch.randint(0, vocab, (3, 7), generator=gen)
    logits = torch.randn(21, num_experts, generator=gen)
    hashed = dist_moe.hash_experts(tid2eid, token_ids)
    got = dist_moe.route(logits, top_k=top_k, score_func="sqrtsoftplus", route_scale=1.5, hashed=hashed,
                         bias=torch.full((num_experts,), 100.0).index_fill_(0, torch.tensor([0]), -100.0))
    for t, token in enumerate(token_ids.reshape(-1).tolist()):
        experts = tid2eid[token].tolist()
        assert got.expert_ids[t].tolist() == experts
        scores = [math.sqrt(math.log1p(math.exp(logits[t, e].item()))) for e in experts]
        want = [1.5 * s / sum(scores) for s in scores]
        assert got.weights[t].tolist() == pytest.approx(want, rel=1e-6)
    with pytest.raises(ValueError, match="hashed experts must be"):
        dist_moe.route(logits, top_k=3, hashed=hashed)


def test_bias_steers_selection_but_not_weights():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    plain = dist_moe.route(logits, top_k=1, score_func="sigmoid", norm_topk_prob=False)
    biased = dist_moe.route(logits, top_k=1, score_func="sigmoid", norm_topk_prob=False,
                            bias=torch.tensor([0.0, 0.0, 0.0, 5.0]))
    assert plain.expert_ids.item() == 0 and biased.expert_ids.item() == 3
    assert biased.weights.item() == pytest.approx(torch.sigmoid(torch.tensor(-1.0)).item())


def test_tokens_per_expert_counts_every_choice():
    ids = torch.tensor([[0, 3], [3, 1], [3, 0]])
    assert dist_moe.tokens_per_expert(ids, 5).tolist() == [2, 1, 0, 3, 0]


def test_bias_update_moves_toward_balance():
    bias = torch.zeros(4)
    dist_moe.update_expert_bias(bias, torch.tensor([10.0, 2.0, 4.0, 0.0]), rate=0.1)  # mean 4
    assert bias.tolist() == pytest.approx([-0.1, 0.1, 0.0, 0.1])


def test_sequence_balance_loss_matches_the_formula():
    gen = torch.Generator().manual_seed(0)
    b, s, e, k, alpha = 3, 7, 6, 2, 0.01
    scores = torch.rand(b, s, e, generator=gen)
    ids = torch.stack([torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(s)]) for _ in range(b)])
    want = 0.0
    for i in range(b):
        f = [e / (k * s) * sum(int(j in ids[i, t].tolist()) for t in range(s)) for j in range(e)]
        p = [(scores[i, :, j] / scores[i].sum(-1)).mean().item() for j in range(e)]
        want += alpha * sum(fj * pj for fj, pj in zip(f, p))
    got = dist_moe.sequence_balance_loss(scores, ids, alpha=alpha)
    assert got.item() == pytest.approx(want / b, rel=1e-5)


def test_sequence_balance_loss_over_split_sequences_sums_to_the_whole_loss(tmp_path):
    """Two gloo ranks each holding half of every sequence (sequence parallelism), group=WORLD: their counts are
    summed, each returns its tokens' share; the shares sum to the loss of the whole sequences computed in one
    piece, and each rank's gradient is the whole loss's gradient on its tokens. Without the group the
    halves' losses average to another value (the control)."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    from dist_moe_rank_report import file_rendezvous

    init_method = file_rendezvous(tmp_path)
    worker = Path(__file__).with_name("balance_loss_worker.py")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    procs = [subprocess.Popen([sys.executable, str(worker), str(rank), "2", init_method, str(tmp_path)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT) for rank in range(2)]
    logs = [p.communicate(timeout=300)[0].decode(errors="replace") for p in procs]
    reports = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(2)]
    for report, log in zip(reports, logs):
        assert "error" not in report, f"{report['error']}\n{log}"
        assert report["summed_shares"] == pytest.approx(report["whole"], rel=1e-6)
        assert report["grad_max_error"] <= 1e-6 * report["grad_max"], report
    # the control: each half's loss taken as if it were whole sequences, averaged, is another value
    assert (reports[0]["alone"] + reports[1]["alone"]) / 2 != pytest.approx(reports[0]["whole"], rel=1e-3)


def test_balanced_routing_gives_alpha():
    # Uniform scores and a perfectly even choice: f_i = 1, P_i = 1/E, loss = alpha.
    scores = torch.full((1, 4, 4), 0.5)
    ids = torch.tensor([[[0, 1], [2, 3], [0, 1], [2, 3]]])
    assert dist_moe.sequence_balance_loss(scores, ids, alpha=0.3).item() == pytest.approx(0.3)


@pytest.mark.parametrize("kwargs, message", [
    (dict(top_k=0), "top_k"),
    (dict(top_k=2, score_func="relu"), "score_func"),
    (dict(top_k=2, n_group=3), "n_group"),
    (dict(top_k=2, n_group=4, topk_group=5), "topk_group"),
    (dict(top_k=5, n_group=4, topk_group=1), "top_k=5 exceeds"),
])
def test_bad_routing_arguments_are_named(kwargs, message):
    with pytest.raises(ValueError, match=message):
        dist_moe.route(torch.randn(2, 8), **kwargs)


def test_forced_balance_deals_every_expert_the_same_load_with_the_routers_weights():
    torch.manual_seed(0)
    logits = torch.randn(30, 8)
    learned = dist_moe.route(logits, top_k=2, score_func="sigmoid", route_scale=2.5)
    forced = dist_moe.forced_balance(learned, norm_topk_prob=True, route_scale=2.5)
    assert dist_moe.tokens_per_expert(forced.expert_ids, 8).tolist() == [60 // 8 + (e < 60 % 8) for e in range(8)]
    assert all(len(set(row)) == 2 for row in forced.expert_ids.tolist())  # a token's two experts differ
    chosen = logits.sigmoid().gather(1, forced.expert_ids)
    torch.testing.assert_close(forced.weights, 2.5 * chosen / chosen.sum(-1, keepdim=True))
    assert not torch.equal(forced.expert_ids, learned.expert_ids)  # the router's choice is overridden
