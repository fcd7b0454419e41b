"""Muon for matrices, AdamW for everything else, on plain or flexshard-sharded parameters.

Muon update of a matrix W with gradient G (momentum mu, Nesterov by default):
    B <- mu B + (1 - mu) G;   U <- NS5(G + mu (B - G))  (or NS5(B) without Nesterov)
    W <- W (1 - lr wd) - lr * scale(m, n) * U
Newton–Schulz needs the whole matrix. An `Owned` parameter's owner holds it whole, so it updates
alone and `step()` issues no collective; the other ranks hold nothing for it and skip it. A
row- or block-sharded matrix (fully_shard, RowShard, BlockShard) is gathered, orthogonalised on
every rank and each rank keeps its own part — the usual FSDP approach, kept for comparison.
AdamW is elementwise, so it runs on whatever elements a rank holds, with no communication.
"""
from __future__ import annotations

import fnmatch
import math
from collections.abc import Callable, Iterable

import torch
from torch.distributed.tensor import DTensor, Shard

from ..chunked import ChunkedShard
from ..full_tensor import full_tensor
from ..slot import local_flat
from .newton_schulz import newton_schulz

ADAMW_PATTERNS = ("*embed*", "output.weight", "*lm_head*")


def default_muon_rule(name: str, param: torch.Tensor) -> bool:
    """Muon for matrices (>= 2-D; leading dims of 3-D+ are a batch, e.g. stacked experts), except
    embeddings and the output head (names matching `ADAMW_PATTERNS`), which get AdamW with vectors."""
    return param.dim() >= 2 and not any(fnmatch.fnmatchcase(name, p) for p in ADAMW_PATTERNS)


class Muon(torch.optim.Optimizer):
    """`Muon(model.named_parameters(), lr=0.02, ...)`; plain tensors work too (the rule then sees name '')."""

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
        *,
        lr: float = 0.02,
        momentum: float = 0.95,
        nesterov: bool = True,
        ns_steps: int = 5,
        ns_dtype: torch.dtype = torch.bfloat16,
        weight_decay: float = 0.0,
        adjust_lr: str | None = "spectral",
        adamw_lr: float = 3e-4,
        adamw_betas: tuple[float, float] = (0.9, 0.95),
        adamw_eps: float = 1e-8,
        adamw_weight_decay: float = 0.0,
        use_muon: Callable[[str, torch.Tensor], bool] = default_muon_rule,
    ) -> None:
        if adjust_lr not in (None, "spectral", "match_adamw_rms"):
            raise ValueError(f"adjust_lr must be None, 'spectral' or 'match_adamw_rms', got {adjust_lr!r}")
        if ns_dtype not in (torch.bfloat16, torch.float32, torch.float64):
            raise ValueError(f"ns_dtype must be bfloat16, float32 or float64, got {ns_dtype}")
        if not 0.0 <= momentum < 1.0:
            raise ValueError(f"momentum must be in [0, 1), got {momentum}")
        muon, adamw = [], []
        for item in params:
            name, p = item if isinstance(item, tuple) else ("", item)
            if not isinstance(p, torch.Tensor):
                raise TypeError(f"Muon takes tensors or (name, tensor) pairs, got {type(p).__name__}")
            (muon if use_muon(name, p) else adamw).append(p)
        groups = []
        if muon:
            groups.append(dict(params=muon, use_muon=True, lr=lr, weight_decay=weight_decay))
        if adamw:
            groups.append(dict(params=adamw, use_muon=False, lr=adamw_lr, weight_decay=adamw_weight_decay))
        if not groups:
            raise ValueError("Muon got no parameters")
        defaults = dict(
            momentum=momentum, nesterov=nesterov, ns_steps=ns_steps, ns_dtype=ns_dtype, adjust_lr=adjust_lr,
            betas=adamw_betas, eps=adamw_eps,
        )
        super().__init__(groups, defaults)

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                if group["use_muon"]:
                    self._muon_update(p, group)
                else:
                    self._adamw_update(p, group)
        return loss

    def _muon_update(self, p: torch.Tensor, group: dict) -> None:
        state = self.state[p]
        if "momentum_buffer" not in state:
            state["momentum_buffer"] = torch.zeros_like(p)
        grad, buf, weight = local_flat(p.grad), local_flat(state["momentum_buffer"]), local_flat(p)
        mu = group["momentum"]
        buf.lerp_(grad, 1 - mu)
        update = grad.lerp(buf, mu) if group["nesterov"] else buf
        orth = self._orthogonalise(p, update, group)
        if orth is None:
            return  # an Owned matrix held by another rank
        m, n = p.shape[-2], p.shape[-1]
        scale = {None: 1.0, "spectral": max(1.0, m / n) ** 0.5, "match_adamw_rms": 0.2 * math.sqrt(max(m, n))}[group["adjust_lr"]]
        weight.mul_(1 - group["lr"] * group["weight_decay"])
        weight.add_(orth.to(weight.dtype), alpha=-group["lr"] * scale)

    def _orthogonalise(self, p: torch.Tensor, update: torch.Tensor, group: dict) -> torch.Tensor | None:
        """NS5 of this rank's elements of the update, flat; None if this rank holds none of `p`."""
        ns = lambda x: newton_schulz(x, steps=group["ns_steps"], dtype=group["ns_dtype"]).reshape(-1)  # noqa: E731
        if not isinstance(p, DTensor):
            return ns(update.view(p.shape))
        local = p._local_tensor
        if isinstance(local, ChunkedShard):
            rects = local._layout.rects[local._rank]
            if not rects:
                return None
            if len(rects) == 1 and rects[0].sizes == tuple(p.shape):
                return ns(update.view(p.shape))  # Owned: the whole matrix is here
            layout = local._layout
            whole = full_tensor(DTensor.from_local(ChunkedShard(update, layout, local._rank), p.device_mesh, [Shard(0)], run_check=False, shape=p.shape, stride=p.stride()))
            return layout.local_from_full(newton_schulz(whole, steps=group["ns_steps"], dtype=group["ns_dtype"]), local._rank)
        if p.device_mesh.ndim != 1 or tuple(p.placements) != (Shard(0),):
            raise ValueError(f"Muon handles Shard(0) DTensors on a 1-D mesh, got placements {p.placements}")
        # The FSDP approach: gather the whole update, orthogonalise it on every rank, keep our rows.
        whole = DTensor.from_local(update.view(local.shape), p.device_mesh, [Shard(0)], run_check=False, shape=p.shape, stride=p.stride()).full_tensor()
        chunks = torch.chunk(newton_schulz(whole, steps=group["ns_steps"], dtype=group["ns_dtype"]), p.device_mesh.size(), dim=0)
        rank = p.device_mesh.get_local_rank()
        return chunks[rank].reshape(-1) if rank < len(chunks) else update.new_empty(0)

    def _adamw_update(self, p: torch.Tensor, group: dict) -> None:
        state = self.state[p]
        if "step" not in state:
            state["step"] = torch.tensor(0.0)
            state["exp_avg"] = torch.zeros_like(p)
            state["exp_avg_sq"] = torch.zeros_like(p)
        state["step"] += 1
        t = state["step"].item()
        (beta1, beta2), lr, eps = group["betas"], group["lr"], group["eps"]
        grad, weight = local_flat(p.grad), local_flat(p)
        exp_avg, exp_avg_sq = local_flat(state["exp_avg"]), local_flat(state["exp_avg_sq"])
        weight.mul_(1 - lr * group["weight_decay"])
        exp_avg.lerp_(grad, 1 - beta1)
        exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        denom = (exp_avg_sq.sqrt() / math.sqrt(1 - beta2**t)).add_(eps)
        weight.addcdiv_(exp_avg, denom, value=-lr / (1 - beta1**t))
