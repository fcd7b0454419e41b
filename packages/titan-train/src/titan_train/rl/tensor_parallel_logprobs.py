"""The RL update's per-token logprobs of a policy under tensor parallelism (titan-train's TP plan).

Every tp rank holds the same samples. The plan keeps the residual stream sequence-sharded ([b, s / tp, d]
between blocks), so the sequence is right-padded to a multiple of tp (padding after the last token changes
no earlier position under causal attention, and is dropped again). The output projection (the plan's
"output" style: vocabulary rows over the tp ranks) gives logits as a DTensor, gathered whole ([b, s, V])
on every rank; the logprobs and entropy come from them exactly as on one process, identically on every tp
rank. The policy's own forward runs (not its hidden_states), so FSDP's hooks on the root gather the
embedding, final norm and output weight.

Gradients: every tp rank computes the same loss from the same full logits, which is what DTensor's
autograd assumes of a replicated result (the gather's backward keeps each rank its own share), so each TP
shard of a parameter gets exactly the single-process gradient of its slice, with no extra factor (FSDP
then averages over the data-parallel ranks only). The logits exist whole on each rank, as on one process
(no vocabulary-parallel logprob kernel yet).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from titan_rl import logprobs_from_logits


def tp_token_logprobs_and_entropy(model: nn.Module, tokens: torch.Tensor, *, tp_mesh: DeviceMesh, pad_id: int,
                                  temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """tokens [B, S] (right-padded, the same on every tp rank) -> (logprobs [B, S-1] of tokens[:, 1:],
    differentiable; entropy [B, S-1] of each next-token distribution, detached float32), as
    `titan_rl.token_logprobs_and_entropy` on one process."""
    tp = tp_mesh.size()
    batch, seq = tokens.shape
    padded = -(-seq // tp) * tp
    inputs = torch.full((batch, padded), pad_id, dtype=tokens.dtype, device=tokens.device)
    inputs[:, :seq] = tokens
    positions = torch.arange(padded, device=tokens.device).expand(batch, -1)
    logits = model(inputs, positions=positions)  # a DTensor over tp (the plan's vocabulary-parallel output)
    assert isinstance(logits, DTensor), "TP expects the policy's output projection to be tensor-parallel"
    logits = logits.full_tensor()[:, :seq - 1]  # [B, S-1, V], the same on every tp rank
    logprobs = logprobs_from_logits(logits, tokens[:, 1:], temperature=temperature)
    with torch.no_grad():
        scaled = logits.float()
        if temperature not in (0.0, 1.0):
            scaled = scaled / temperature
        logp = F.log_softmax(scaled, dim=-1)
        entropy = -(logp.exp() * logp).sum(-1)
    return logprobs, entropy
