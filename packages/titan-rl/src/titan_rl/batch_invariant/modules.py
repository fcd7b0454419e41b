"""Drop-in modules computing with the batch-invariant ops; they hold the original parameters
(the same Parameter objects), so weight tying, optimizers and checkpoints are unaffected."""
from __future__ import annotations

import torch
from torch import nn

from titan_rl.batch_invariant import ops


class BatchInvariantLinear(nn.Module):
    def __init__(self, old: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = old.in_features, old.out_features
        self.weight = old.weight
        self.bias = old.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = ops.matmul(x, self.weight)
        return out if self.bias is None else out + self.bias

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


class BatchInvariantRMSNorm(nn.Module):
    def __init__(self, old: nn.Module) -> None:
        super().__init__()
        self.weight = old.weight
        self.eps = old.eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.rms_norm(x, self.weight, self.eps)


class BatchInvariantFeedForward(nn.Module):
    """SwiGLU w2(silu(w1 x) * w3 x) with silu as x / (1 + exp(-x)) (see torch_ops: torch's silu
    kernel rounds its tail elements differently from its vector body)."""

    def __init__(self, old: nn.Module) -> None:
        super().__init__()
        self.w1, self.w2, self.w3 = (BatchInvariantLinear(getattr(old, n)) for n in ("w1", "w2", "w3"))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(ops.silu(self.w1(x)) * self.w3(x))


class BatchInvariantAttention(nn.Module):
    """Inner attention (`inner(q, k, v, *, context, sinks=None)`): causal over the sequence (within
    `sliding_window` when set), attention sinks when given, fixed reduction order.
    Packed documents (context.document_ids) are not supported in this mode."""

    def __init__(self, *, scale: float, sliding_window: int | None = None) -> None:
        super().__init__()
        self.scale = scale
        self.sliding_window = sliding_window

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, context=None,
                sinks: torch.Tensor | None = None) -> torch.Tensor:
        if context is not None and getattr(context, "document_ids", None) is not None:
            raise ValueError("batch-invariant attention does not support packed documents (context.document_ids); "
                             "pad sequences instead")
        b, s = q.shape[:2]
        positions = torch.arange(s, device=q.device).expand(b, s)
        return ops.attention(q, k, v, q_positions=positions, scale=self.scale, window=self.sliding_window,
                             sinks=sinks)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, q_positions: torch.Tensor,
               kv_len: torch.Tensor, sinks: torch.Tensor | None = None) -> torch.Tensor:
        """Over a KV cache: k, v [b, L, hkv, d] with slot j = position j (used by the generator)."""
        return ops.attention(q, k, v, q_positions=q_positions, scale=self.scale, kv_len=kv_len,
                             window=self.sliding_window, sinks=sinks)

    def extra_repr(self) -> str:
        window = "" if self.sliding_window is None else f", sliding_window={self.sliding_window}"
        return f"scale={self.scale:.6g}{window}"
