"""Parameter counts and training FLOPs per token.

Training FLOPs per token = 6 * N + 6 * seq_len * sum over softmax-attention layers of heads * (qk_head_dim +
v_head_dim) + the linear-attention layers' term below:

- N counts the parameters a token multiplies with: every matrix except the input embedding (a
  lookup), routed experts scaled by top_k / num_experts, the output projection included (tied or
  not). 6 = 2 (multiply-add) * 3 (forward, and backward for activations and for weights).
- The second term is attention's score and value matmuls (q.k over seq_len keys and p.v), again
  * 2 * 3, not halved for causality (the convention of PaLM's MFU and torchtitan; it is 12 * L * H
  * head_dim * seq_len when qk and v head dims are equal). A sliding-window layer (gpt-oss) sees
  min(seq_len, window) keys per query in place of seq_len; sinks add no matmul. DeepSeek-V4's layers
  count their window plus the compressed entries they read (seq_len / rate, at most index_topk for
  sparse layers); the compressors' pooling and the indexer's scores are not counted.
- Linear-attention layers (Gated DeltaNet) have no seq_len term: their chunked form costs, per
  token and value head, C * (3 * dk + 2 * dv) + 3 * dk * dv multiply-adds (chunk C: the k.k^T and
  q.k^T scores and the two triangular solves within the chunk, the score-weighted values, and three
  products with the dk x dv state), again * 2 * 3 and not halved for triangularity. The short conv,
  gates and norms are elementwise and not counted.
- The MTP module (DeepSeek-V3) is excluded unless `include_mtp` (then its active parameters and a
  second pass through the shared output projection are added).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from titan_models.components.moe import MoE


@dataclass(kw_only=True, frozen=True)
class ParamCount:
    total: int  # every parameter of the module (tied weights once), MTP included
    active: int  # parameters one token uses in the main model: experts scaled by top_k / E, MTP excluded
    embedding: int  # the input embedding table
    mtp: int  # parameters of the multi-token-prediction module (it shares embedding and output)

    @property
    def main(self) -> int:
        """Parameters of the main model (what published sizes count)."""
        return self.total - self.mtp


def _as_model(model_or_config: Any) -> nn.Module:
    if isinstance(model_or_config, nn.Module):
        return model_or_config
    with torch.device("meta"):
        return model_or_config.build()


def _inactive_expert_params(module: nn.Module) -> int:
    inactive = 0
    for sub in module.modules():
        if isinstance(sub, MoE):
            experts = sum(p.numel() for p in sub.experts.parameters())
            inactive += experts - experts * sub.config.top_k // sub.config.num_experts
    return inactive


def count_params(model_or_config: Any) -> ParamCount:
    """Count a model's parameters (a config is built on the meta device first, allocating nothing)."""
    model = _as_model(model_or_config)
    total = sum(p.numel() for p in model.parameters())
    mtp_module = getattr(model, "mtp", None)
    mtp = sum(p.numel() for p in mtp_module.parameters()) if mtp_module is not None else 0
    inactive = _inactive_expert_params(model) - (_inactive_expert_params(mtp_module) if mtp_module is not None else 0)
    embedding = model.tok_embeddings.weight.numel() if model.tok_embeddings is not None else 0
    return ParamCount(total=total, active=total - mtp - inactive, embedding=embedding, mtp=mtp)


def flops_per_token(model_or_config: Any, seq_len: int, *, include_mtp: bool = False) -> int:
    """Training FLOPs per token at `seq_len` (formula in this module's docstring)."""
    model = _as_model(model_or_config)
    counts = count_params(model)
    matmul_params = counts.active - counts.embedding
    if model.tok_embeddings is not None and model.output is not None and model.output.weight is model.tok_embeddings.weight:
        matmul_params += counts.embedding  # the tied table is also the output projection
    attention = 0
    for name, module in model.named_modules():
        if not include_mtp and name.startswith("mtp."):
            continue
        dims = getattr(module, "score_dims", None)
        if dims is not None:
            heads, qk_dim, v_dim = dims
            window = getattr(module, "sliding_window", None)
            keys = seq_len if window is None else min(seq_len, window)
            if hasattr(module, "keys_per_query"):  # DeepSeek-V4: the window plus the compressed entries read
                keys = module.keys_per_query(seq_len)
            attention += 6 * keys * heads * (qk_dim + v_dim)
        linear = getattr(module, "delta_rule_dims", None)
        if linear is not None:
            heads, dk, dv, chunk = linear
            attention += 6 * heads * (chunk * (3 * dk + 2 * dv) + 3 * dk * dv)
    mtp_module = getattr(model, "mtp", None)
    if include_mtp and mtp_module is not None:
        # the MTP block's active parameters, plus a second pass through the shared output projection
        matmul_params += counts.mtp - _inactive_expert_params(mtp_module) + model.output.weight.numel()
    return 6 * matmul_params + attention
