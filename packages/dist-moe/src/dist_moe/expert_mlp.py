"""The routed SwiGLU experts with the token gather and the combine fused into the GEMMs.

    out[t] = sum_j weights[t, j] * w2[e] @ (silu(w1[e] @ x[t]) * (w3[e] @ x[t])),  e = expert of slot (t, j)

Slots: input row t has `top_k` slots, slot s = t * top_k + j. `row_slot` [R = rows * top_k] lists
the slots sorted by expert (a stable argsort of the flattened expert ids), `offsets` [E] int32 the
cumulative end of each expert's rows in that order. Under expert parallelism the input rows are
the tokens received from other ranks, top_k is 1 and the routing weights are applied by
`combine` on the sending rank instead (weights=None).

Triton path, forward: (1) gate/up GEMM reading x[slot // top_k] inside the kernel, two
accumulators sharing each A tile, SwiGLU in the epilogue -> h [R, ffn] (gate and up kept for the
backward; with `keep_routed_input` the routed rows X = x[slot // top_k] are instead copied once into
the padded layout, read by the GEMM through TMA and reused by the backward's step (7)); (2) down
GEMM storing in expert order, then one memory-bound pass that sums each input row's top_k results
weighted, in float32 and a fixed order (deterministic; kernels/slot_sum.py); with top_k 1 the
GEMM's epilogue weights each row and stores it at its slot instead.

Backward, in the padded row layout (each expert's rows start at a multiple of 64 rows, zero rows
fill its last chunk; kernels/row_tiles.py), so every GEMM operand that is not a weight goes through
TMA and the weight gradients sum whole chunks without masks: (3) D = dOut[slot // top_k] (a gather
copy: Hopper TMA cannot gather); (4) dh = D @ w2 (a plain persistent GEMM), then one memory-bound
pass for the routing-weight gradient <dh, h>, the weight scaling and the SwiGLU backward, writing
[dgate | dup | w * h] side by side (kernels/swiglu_backward.py); (5) w2's gradient D^T (w * h); (6)
dgate @ w1 + dup @ w3 in one accumulator, stored in expert order and summed as in (2); (7) X =
x[slot // top_k] (gather copy) and the w1 and w3 gradients [dgate | dup]^T X as one GEMM writing
both. No launch reads device data on the host.
"""
from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor

from dist_moe.backend import Backend, WeightGrad, check_weight_grad, resolve_backend
from dist_moe.host_sync import read_to_host

Quantize = Literal["none", "fp8_rowwise", "fp8_blockwise"]
QUANTIZE: tuple[str, ...] = ("none", "fp8_rowwise", "fp8_blockwise")


def expert_mlp(
    x: Tensor, w1: Tensor, w2: Tensor, w3: Tensor, offsets: Tensor, row_slot: Tensor, *,
    top_k: int = 1, weights: Tensor | None = None, backend: Backend = "auto",
    weight_grad: WeightGrad = "triton", quantize: Quantize = "none", swiglu_limit: float | None = None,
    keep_routed_input: bool = False,
) -> Tensor:
    """x [rows, dim], w1/w3 [E, ffn, dim], w2 [E, dim, ffn] (Linear-style) -> [rows, dim].

    `swiglu_limit` L (DeepSeek-V4's clamped SwiGLU): silu(min(gate, L)) * clamp(up, -L, L); the torch
    path only (the Triton kernels' epilogue and backward do not clamp: asking for both is an error).
    See the module docstring for `row_slot`, `offsets`, `top_k` and `weights` [rows, top_k].
    `weight_grad` (Triton path): "triton" (dist-moe's kernel) or "torch_grouped_mm" (a fallback:
    torch._grouped_mm on the same padded operands; tools/bench/moe measures both).
    `quantize`: "none", or "fp8_rowwise" / "fp8_blockwise": the three expert GEMMs (forward and
    backward) by grouped_mm_fp8 with that recipe, around a gather of the routed rows, SwiGLU and
    the weighted slot sum in torch ops (not the fused bf16 kernels; `weight_grad` then unused).
    `keep_routed_input` (Triton path): copy the routed rows [R, dim] once and keep them for the
    backward, as the usual gather-then-grouped-GEMM pipeline does: the gate/up GEMM reads them through
    TMA and the backward skips its second gather, for R * dim elements more held until the backward.
    False (the default) gathers inside the gate/up GEMM and again in the backward, holding nothing extra.
    """
    check_weight_grad(weight_grad)
    if not isinstance(keep_routed_input, bool):
        raise TypeError(f"keep_routed_input must be a bool, got {type(keep_routed_input).__name__}")
    if quantize not in QUANTIZE:
        raise ValueError(f"quantize must be one of {QUANTIZE}, got {quantize!r}")
    if x.dim() != 2:
        raise ValueError(f"x must be [rows, dim], got {tuple(x.shape)}")
    rows, dim = x.shape
    if w1.dim() != 3 or w1.shape != w3.shape or w1.shape[2] != dim or w2.shape != (w1.shape[0], dim, w1.shape[1]):
        raise ValueError(f"w1/w3 must be [E, ffn, dim={dim}] and w2 [E, dim, ffn]; got {tuple(w1.shape)}, "
                         f"{tuple(w3.shape)}, {tuple(w2.shape)}")
    if top_k < 1:
        raise ValueError(f"top_k must be >= 1, got {top_k}")
    if row_slot.dim() != 1 or row_slot.shape[0] != rows * top_k:
        raise ValueError(f"row_slot must be [rows * top_k = {rows * top_k}], got {tuple(row_slot.shape)}")
    if offsets.dim() != 1 or offsets.shape[0] != w1.shape[0]:
        raise ValueError(f"offsets must be [E={w1.shape[0]}], got {tuple(offsets.shape)}")
    if weights is not None and weights.shape != (rows, top_k):
        raise ValueError(f"weights must be [rows, top_k] = {(rows, top_k)}, got {tuple(weights.shape)}")
    if not (x.dtype == w1.dtype == w2.dtype == w3.dtype) or not x.is_floating_point():
        raise TypeError(f"x and the expert weights must share one floating dtype; got {x.dtype}, {w1.dtype}, "
                        f"{w2.dtype}, {w3.dtype}")
    if swiglu_limit is not None and not swiglu_limit > 0:
        raise ValueError(f"swiglu_limit must be a positive bound or None, got {swiglu_limit}")
    if quantize != "none":
        if swiglu_limit is not None:
            raise ValueError(f"quantize={quantize!r} does not clamp the SwiGLU; swiglu_limit needs quantize='none'")
        return _fp8_expert_mlp(x, w1, w2, w3, offsets, row_slot, top_k, weights, quantize, backend)
    if resolve_backend(backend, x) == "torch":
        return _torch_expert_mlp(x, w1, w2, w3, offsets, row_slot, top_k, weights, swiglu_limit)
    if swiglu_limit is not None:
        raise ValueError("swiglu_limit (the clamped SwiGLU) runs on backend='torch' only; the Triton kernels "
                         "do not clamp")
    return _ExpertMLP.apply(x, w1, w2, w3, offsets.to(torch.int32), row_slot.to(torch.int32), weights, top_k,
                            weight_grad, keep_routed_input)


def _torch_expert_mlp(x, w1, w2, w3, offsets, row_slot, top_k, weights, swiglu_limit=None) -> Tensor:
    """Reference path (plain autograd): gather, one SwiGLU MLP per expert, weighted slot sum."""
    ends = read_to_host(offsets, "expert_mlp: per-expert row ends (torch path)")
    rows, dim = x.shape
    row_slot = row_slot.long()
    if any(b < a for a, b in zip([0, *ends], ends)) or (ends and ends[-1] != row_slot.shape[0]):
        raise ValueError(f"offsets must be non-decreasing and end at R={row_slot.shape[0]}; got {ends}")
    routed = x.index_select(0, row_slot // top_k)  # [R, dim], sorted by expert
    outs, start = [], 0
    for e, end in enumerate(ends):  # empty experts too, so every weight gets a (zero) gradient
        xe = routed[start:end]
        gate, up = xe @ w1[e].T, xe @ w3[e].T
        if swiglu_limit is not None:
            gate, up = gate.clamp(max=swiglu_limit), up.clamp(-swiglu_limit, swiglu_limit)
        outs.append((F.silu(gate) * up) @ w2[e].T)
        start = end
    y = torch.cat(outs) if outs else routed.new_zeros(0, dim)  # [R, dim]
    return _weighted_slot_sum(y, row_slot, rows, top_k, weights)


def _fp8_expert_mlp(x, w1, w2, w3, offsets, row_slot, top_k, weights, quantize, backend) -> Tensor:
    """The experts with fp8 GEMMs (grouped_mm_fp8, autograd through torch ops around them)."""
    from dist_moe.grouped_mm_fp8 import grouped_mm_fp8

    rows = x.shape[0]
    row_slot = row_slot.long()
    routed = x.index_select(0, row_slot // top_k)  # [R, dim], sorted by expert
    gate = grouped_mm_fp8(routed, w1.transpose(1, 2), offsets, recipe=quantize, backend=backend)
    up = grouped_mm_fp8(routed, w3.transpose(1, 2), offsets, recipe=quantize, backend=backend)
    y = grouped_mm_fp8(F.silu(gate) * up, w2.transpose(1, 2), offsets, recipe=quantize, backend=backend)
    return _weighted_slot_sum(y, row_slot, rows, top_k, weights)


def _weighted_slot_sum(y: Tensor, row_slot: Tensor, rows: int, top_k: int, weights: Tensor | None) -> Tensor:
    """[rows, dim]: each input row's top_k results (y in expert order), weighted in float32."""
    dim = y.shape[1]
    if weights is not None:
        wide = torch.promote_types(y.dtype, torch.float32)  # weight in float32 (float64 stays float64)
        y = (y.to(wide) * weights.reshape(-1).to(wide)[row_slot].unsqueeze(1)).to(y.dtype)
    slots = torch.zeros_like(y).index_copy(0, row_slot, y)  # row r -> slot row_slot[r]
    return slots.view(rows, top_k, dim).sum(dim=1)


def _combine(ops, pos: Tensor | None, top_k: int, flat_weights: Tensor | None = None) -> Tensor:
    """A GEMM over the routed rows whose result goes back to the input rows, weighted and summed.

    top_k 1: the GEMM's epilogue scales each row and stores it at its slot (the rows come back in
    input order). Otherwise the GEMM stores in expert order and one memory-bound pass sums each
    input row's top_k results in float32, weighted (slot_sum.py): on the H200 the scattered stores
    cost the down GEMM 0.23 ms of 1.47, more than the pass (0.13 ms, 4.1 TB/s).
    `ops.out` [R, dim] is the GEMM's output buffer.
    """
    from dist_moe.kernels.launch import EPILOGUE_SCATTER, row_gemm, slot_sum

    if top_k == 1:
        ops.epilogue, ops.weight = EPILOGUE_SCATTER, flat_weights
        row_gemm(ops)
        return ops.out
    row_gemm(ops)
    return slot_sum(ops.out, pos, top_k, flat_weights)


class _ExpertMLP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w1, w2, w3, offsets, slot, weights, top_k, weight_grad, keep_routed_input):
        from dist_moe.kernels.launch import (
            EPILOGUE_SWIGLU,
            RowOperands,
            TileMaps,
            gather_rows,
            invert_slots,
            row_gemm,
        )

        dim = x.shape[1]
        num_routed, ffn = slot.shape[0], w1.shape[1]
        maps = TileMaps(offsets, num_routed)  # row-tile tables shared by the two GEMMs
        save = any(ctx.needs_input_grad[i] for i in (0, 1, 2, 3, 6))
        flat_weights = weights.reshape(-1).float().contiguous() if weights is not None else None
        if save:  # [R, 3 * ffn]: gate | up | h, the backward's [dgate | dup | w h] layout
            acts = x.new_empty(num_routed, 3 * ffn)
            gate, up, h = acts[:, :ffn], acts[:, ffn:2 * ffn], acts[:, 2 * ffn:]
        else:
            gate = up = None
            h = x.new_empty(num_routed, ffn)
        # A: x gathered inside the kernel, or the routed rows copied once ([padded rows, dim], via TMA)
        routed = gather_rows(x, slot, top_k, maps) if keep_routed_input else None
        row_gemm(RowOperands(a=x if routed is None else routed, b=w1.transpose(1, 2), b2=w3.transpose(1, 2),
                             offsets=offsets, out=h, out2=gate, out3=up, num_rows=num_routed, slot=slot, top_k=top_k,
                             gather_a=routed is None, padded_a=routed is not None, epilogue=EPILOGUE_SWIGLU,
                             save_preact=save, maps=maps))
        pos = invert_slots(slot) if top_k > 1 else None
        out = _combine(RowOperands(a=h, b=w2.transpose(1, 2), offsets=offsets, out=x.new_empty(num_routed, dim),
                                   num_rows=num_routed, slot=slot, maps=maps), pos, top_k, flat_weights)
        ctx.top_k, ctx.weight_grad = top_k, weight_grad
        ctx.weights_shape = None if weights is None else (weights.shape, weights.dtype)
        if save:  # the backward reads x only through its routed rows: keep one of the two
            ctx.routed_kept = routed is not None
            ctx.save_for_backward(x if routed is None else routed, w1, w2, w3, offsets, slot, pos, flat_weights,
                                  gate, up, h)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        from dist_moe.kernels.launch import (
            RowOperands,
            TileMaps,
            gather_rows,
            row_gemm,
            swiglu_backward,
            weight_gemm,
        )

        x, w1, w2, w3, offsets, slot, pos, flat_weights, gate, up, h = ctx.saved_tensors
        routed_x = x if ctx.routed_kept else None  # [padded rows, dim], or x itself [rows, dim]
        top_k = ctx.top_k
        # The incoming gradient may be wider than the forward's output (an fp32 combine downstream):
        # the kernels take their operands in one dtype, the forward's.
        grad_out = grad_out.to(x.dtype).contiguous()
        dim = x.shape[1]
        num_routed, ffn = slot.shape[0], w1.shape[1]
        need_x, need_w1, need_w2, need_w3 = ctx.needs_input_grad[:4]
        need_weights = ctx.needs_input_grad[6]
        maps = TileMaps(offsets, num_routed)

        dx = dw1 = dw2 = dw3 = dweights = None
        d_out = gather_rows(grad_out, slot, top_k, maps)  # [padded rows, dim]
        # [padded rows, 3 * ffn]: dgate | dup | w * h, written by the SwiGLU-backward pass.
        grads = x.new_empty(maps.padded_rows, 3 * ffn)
        dgate, dup, hw = grads[:, :ffn], grads[:, ffn:2 * ffn], grads[:, 2 * ffn:]
        dh = x.new_empty(num_routed, ffn)  # dOut[token] @ W2^T, in expert order
        row_gemm(RowOperands(a=d_out, b=w2, offsets=offsets, out=dh, num_rows=num_routed, padded_a=True, maps=maps))
        flat_dweights = torch.empty(num_routed, device=x.device, dtype=torch.float32) if need_weights else None
        swiglu_backward(dh, (gate, up, h), (dgate, dup, hw), slot, maps, flat_weights, flat_dweights)
        del dh
        if need_weights:
            shape, dtype = ctx.weights_shape
            dweights = flat_dweights.view(shape).to(dtype)
        if need_w2:  # [E, dim, ffn] = D^T (w h)
            dw2 = _weight_grads(d_out, hw, maps.padded_ends(), [w2.shape[1]], ctx.weight_grad, weight_gemm)[0]
        del d_out
        if need_x:
            dx = _combine(RowOperands(a=dgate, a2=dup, b=w1, b2=w3, offsets=offsets, out=x.new_empty(num_routed, dim),
                                      num_rows=num_routed, slot=slot, padded_a=True, maps=maps), pos, top_k)
        if need_w1 or need_w3:
            if routed_x is None:
                routed_x = gather_rows(x, slot, top_k, maps)  # [padded rows, dim]
            # [E, ffn, dim] each: dgate^T X and dup^T X, one GEMM over [dgate | dup]
            dw1, dw3 = _weight_grads(grads[:, :2 * ffn], routed_x, maps.padded_ends(), [ffn, ffn],
                                     ctx.weight_grad, weight_gemm)
        return dx, dw1 if need_w1 else None, dw2, dw3 if need_w3 else None, None, None, dweights, None, None, None


def _weight_grads(p: Tensor, q: Tensor, padded_ends: Tensor, widths: list[int], how: str,
                  weight_gemm) -> list[Tensor]:
    """Contiguous [E, width, NQ] gradients, one per consecutive column block of P [padded rows, sum
    of widths]: out[e] = P_e^T Q_e over each expert's padded rows (zero rows in the padding)."""
    num_experts, nq = padded_ends.shape[0], q.shape[1]
    if how == "torch_grouped_mm":  # the fallback; groups are whole 64-row chunks, as its kernels like
        outs, start = [], 0
        for width in widths:
            block = p[:, start:start + width]
            try:
                outs.append(torch._grouped_mm(block.t(), q, offs=padded_ends))
            except RuntimeError:  # a build that wants the transposed operand compact
                outs.append(torch._grouped_mm(block.t().contiguous(), q, offs=padded_ends))
            start += width
        return outs
    outs = [q.new_empty(num_experts, width, nq) for width in widths]
    weight_gemm(p=p, q=q, ends=padded_ends, outs=tuple(outs), padded=True)
    return outs

