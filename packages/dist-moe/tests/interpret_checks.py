"""The Triton kernels under TRITON_INTERPRET=1 (CPU, float32), against float64 references.

Run by test_triton_interpret.py in a subprocess (the interpreter must be chosen before triton is
imported); prints one JSON object {check name: {"ok", "err"}}. Shapes are tiny and cover: groups
of uneven size, an empty group, one longer than a 64-row chunk, K and N tails that are not a
multiple of the tile, grid and persistent launches, TMA descriptors for both weight layouts, the
weight gradient with pointer loads and in the padded layout (one and two outputs), the padded
layout itself (gather, zero rows, padded ends), the weighted top-k sum over gathered rows
(slot_sum, with column and row tails), the fused expert MLP with top_k 2 and routing
weights, with top_k 1 and no weights (the expert-parallel case), and with the torch._grouped_mm
weight-gradient fallback.
"""
from __future__ import annotations

import dataclasses
import json
import os

os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402
import triton.runtime.interpreter as interpreter  # noqa: E402

import dist_moe  # noqa: E402
from dist_moe.kernels import configs  # noqa: E402
from dist_moe.kernels.configs import RowConfig, WeightConfig  # noqa: E402
from dist_moe.kernels.launch import (  # noqa: E402
    RowOperands,
    TileMaps,
    gather_rows,
    invert_slots,
    row_gemm,
    slot_sum,
    weight_gemm,
)
from dist_moe.kernels.row_tiles import ROW_ALIGN, padded_rows  # noqa: E402

# Integer-overflow checks of every interpreted op cost time and test nothing here.
interpreter.interpreter_builder.options = dataclasses.replace(interpreter.interpreter_builder.options,
                                                              sanitize_overflow=False)
TOL = 1e-5  # float32 kernels against float64, relative to the reference's largest entry
results: dict[str, dict] = {}


def check(name: str, got: torch.Tensor, want: torch.Tensor) -> None:
    err = (got.double() - want).abs().max().item()
    scale = max(want.abs().max().item(), 1e-30)
    results[name] = {"ok": err <= TOL * scale, "err": err, "scale": scale}


def groups(counts: list[int]) -> torch.Tensor:
    return torch.tensor(counts).cumsum(0).to(torch.int32)


def loop_reference(x: torch.Tensor, w: torch.Tensor, counts: list[int]) -> torch.Tensor:
    out, start = [], 0
    for e, c in enumerate(counts):
        out.append(x[start:start + c].double() @ w[e].double())
        start += c
    return torch.cat(out)


def grouped_mm_checks() -> None:
    gen = torch.Generator().manual_seed(0)
    counts = [5, 0, 19, 17, 70]  # uneven, one empty, tails against 16-row tiles; 70 > one 64-row chunk
    rows, k, n = sum(counts), 40, 36  # K and N tails against 16 and 32
    x = torch.randn(rows, k, generator=gen)
    linear_w = torch.randn(len(counts), n, k, generator=gen)  # stored [E, N, K]
    offsets = groups(counts)
    want = loop_reference(x, linear_w.transpose(1, 2), counts)
    variants = {
        "grid": RowConfig(block_m=16, block_n=16, block_k=16, group_m=2, num_warps=4, num_stages=1),
        "persistent": RowConfig(block_m=16, block_n=32, block_k=32, group_m=1, num_warps=4, num_stages=1,
                                persistent=True, flatten=True),
        "tma": RowConfig(block_m=16, block_n=16, block_k=16, group_m=3, num_warps=4, num_stages=1, tma=True),
    }
    for name, config in variants.items():
        out = torch.full((rows, n), float("nan"))
        row_gemm(RowOperands(a=x, b=linear_w.transpose(1, 2), offsets=offsets, out=out, num_rows=rows), config)
        check(f"row_gemm_k_contiguous_weights_{name}", out, want)
    # Row-major weights [E, K, N] (the input-gradient layout); TMA needs K to be whole tiles.
    w_rows = torch.randn(len(counts), 48, n, generator=gen)
    x48 = torch.randn(rows, 48, generator=gen)
    want48 = loop_reference(x48, w_rows, counts)
    for name, config in variants.items():
        out = torch.full((rows, n), float("nan"))
        row_gemm(RowOperands(a=x48, b=w_rows, offsets=offsets, out=out, num_rows=rows), config)
        check(f"row_gemm_n_contiguous_weights_{name}", out, want48)
    # Weight gradient: pointer loads with masked tails (written in a transposed layout), and the
    # padded layout through TMA descriptors, one output or split in two; grid and persistent launches.
    dy = torch.randn(rows, n, generator=gen)
    want_dw, start = [], 0
    for c in counts:
        want_dw.append(x[start:start + c].double().T @ dy[start:start + c].double())
        start += c
    want_dw = torch.stack(want_dw)  # [E, k, n]
    maps = TileMaps(offsets, rows)
    identity = torch.arange(rows, dtype=torch.int32)
    x_padded, dy_padded = gather_rows(x, identity, 1, maps), gather_rows(dy, identity, 1, maps)
    import dist_moe.kernels.launch as launch

    specialized = []  # whether each warp-specialized launch ran its own kernel (not the fallback)
    real_specialized = launch._launch_weight_specialized

    def recording_specialized(*args):
        specialized.append(real_specialized(*args))
        return specialized[-1]

    launch._launch_weight_specialized = recording_specialized
    for name, config in {"16": WeightConfig(block_k=16, block_n=16, block_r=16, group_k=2, num_stages=1),
                         "32": WeightConfig(block_k=32, block_n=16, block_r=32, group_k=1, num_stages=1,
                                            persistent=True),
                         # K 40 = 5 tiles of 8 rows, so the outputs take TMA stores (N 36 clipped at 16-wide tiles)
                         "tma_store": WeightConfig(block_k=8, block_n=16, block_r=16, group_k=2, num_stages=1,
                                                   persistent=True, store_tma=True),
                         # weight_gemm_specialized.py on the padded layout (the pointer case falls back)
                         "warp_specialized": WeightConfig(block_k=8, block_n=16, block_r=16, group_k=2,
                                                          num_warps=4, num_stages=1, persistent=True,
                                                          store_tma=True, warp_specialize=True)}.items():
        dw = torch.full_like(linear_w, float("nan"))  # [E, N, K]; the kernel writes [E, K, N] views
        weight_gemm(p=x, q=dy, ends=offsets, outs=(dw.transpose(1, 2),), config=config)
        check(f"weight_gemm_pointer_{name}", dw.transpose(1, 2), want_dw)
        dw = torch.full((len(counts), k, n), float("nan"))
        weight_gemm(p=x_padded, q=dy_padded, ends=maps.padded_ends(), outs=(dw,), padded=True, config=config)
        check(f"weight_gemm_padded_tma_{name}", dw, want_dw)
        top, bottom = (torch.full((len(counts), 16, n), float("nan")) for _ in range(2))
        weight_gemm(p=x_padded[:, :32], q=dy_padded, ends=maps.padded_ends(), outs=(top, bottom), padded=True,
                    config=dataclasses.replace(config, block_k=16))
        check(f"weight_gemm_padded_split_{name}", torch.cat([top, bottom], dim=1), want_dw[:, :32])
    launch._launch_weight_specialized = real_specialized
    # The pointer case falls back to the flattened kernel; the padded one and the split one run it.
    check("weight_gemm_specialized_kernel_ran", torch.tensor(specialized, dtype=torch.float64),
          torch.tensor([0.0, 1.0, 1.0]))
    # The padded layout itself: row r of expert e at r + shift, zero rows up to a whole chunk.
    slot = torch.randperm(rows * 2, generator=gen)[:rows].to(torch.int32)  # any slots, top_k 2
    tokens = torch.randn(rows, k, generator=gen)
    got = gather_rows(tokens, slot, 2, maps)
    want_rows, chunks = [], []
    start = 0
    for c in counts:
        padded = -(-c // ROW_ALIGN) * ROW_ALIGN
        block = torch.zeros(padded, k, dtype=torch.float64)
        block[:c] = tokens[slot[start:start + c].long() // 2].double()
        want_rows.append(block)
        chunks.append(padded)
        start += c
    used = sum(chunks)
    check("gather_rows_padded_layout", got[:used], torch.cat(want_rows))
    check("padded_ends", maps.padded_ends(), torch.tensor(chunks).cumsum(0).double())
    # The public function: forward and both gradients through autograd.
    xg, wg = x.clone().requires_grad_(), linear_w.clone().requires_grad_()
    out = dist_moe.grouped_mm(xg, wg.transpose(1, 2), offsets, backend="triton")
    out.backward(dy)
    xr, wr = x.double().requires_grad_(), linear_w.double().requires_grad_()
    loop_reference(xr, wr.transpose(1, 2), counts).backward(dy.double())
    check("grouped_mm_forward", out, want)
    check("grouped_mm_grad_x", xg.grad, xr.grad)
    check("grouped_mm_grad_w", wg.grad, wr.grad)


def slot_sum_checks() -> None:
    """out[t] = sum_j w[t, j] * y[pos[t, j]] with pos the inverse of a random expert order."""
    gen = torch.Generator().manual_seed(2)
    rows, top_k, cols = 13, 3, 300  # row tail against 4-row blocks, column tail against 128
    slot = torch.randperm(rows * top_k, generator=gen).to(torch.int32)  # routed row r holds slot[r]
    y = torch.randn(rows * top_k, cols, generator=gen)
    weight = torch.rand(rows * top_k, generator=gen)
    pos = invert_slots(slot)
    check("invert_slots", pos[slot.long()], torch.arange(rows * top_k).double())
    by_slot = torch.empty_like(y, dtype=torch.float64)
    by_slot[slot.long()] = y.double()  # row of slot s
    want = (by_slot * weight.double()[:, None]).view(rows, top_k, cols).sum(dim=1)
    check("slot_sum_weighted", slot_sum(y, pos, top_k, weight, block_t=4, block_c=128), want)
    check("slot_sum_unweighted", slot_sum(y, pos, top_k, block_t=4, block_c=128),
          by_slot.view(rows, top_k, cols).sum(dim=1))


def expert_mlp_reference(x, w1, w2, w3, expert_ids, weights):
    """Per token, per choice, straight from the definition (float64)."""
    outs = []
    for t in range(x.shape[0]):
        acc = torch.zeros(x.shape[1], dtype=torch.float64)
        for j in range(expert_ids.shape[1]):
            e = int(expert_ids[t, j])
            h = torch.nn.functional.silu(w1[e] @ x[t]) * (w3[e] @ x[t])
            acc = acc + (weights[t, j] if weights is not None else 1.0) * (w2[e] @ h)
        outs.append(acc)
    return torch.stack(outs)


def expert_mlp_case(name: str, rows: int, top_k: int, with_weights: bool, dim: int = 24, ffn: int = 40,
                    weight_grad: str = "triton", frozen_weights: bool = False, keep_routed_input: bool = False) -> None:
    gen = torch.Generator().manual_seed(1)
    num_experts = 5
    ids = torch.stack([torch.randperm(num_experts - 1, generator=gen)[:top_k] for _ in range(rows)])
    ids[ids == 2] = 3  # experts 2 and 4 receive nothing; expert 3 gets more
    flat = ids.flatten()
    row_slot = flat.argsort(stable=True)
    offsets = torch.bincount(flat, minlength=num_experts).cumsum(0).to(torch.int32)
    params = {
        "x": torch.randn(rows, dim, generator=gen),
        "w1": 0.3 * torch.randn(num_experts, ffn, dim, generator=gen),
        "w2": 0.3 * torch.randn(num_experts, dim, ffn, generator=gen),
        "w3": 0.3 * torch.randn(num_experts, ffn, dim, generator=gen),
    }
    if with_weights:
        params["weights"] = torch.rand(rows, top_k, generator=gen)
    grad = torch.randn(rows, dim, generator=gen)
    mine = {k: v.clone().requires_grad_(not (frozen_weights and k == "weights")) for k, v in params.items()}
    saved_rows = []  # rows of every saved tensor as wide as x: x itself, or the kept routed rows

    def pack(t):
        if t.dim() == 2 and t.shape[1] == dim:
            saved_rows.append(t.shape[0])
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = dist_moe.expert_mlp(mine["x"], mine["w1"], mine["w2"], mine["w3"], offsets, row_slot, top_k=top_k,
                                  weights=mine.get("weights"), backend="triton", weight_grad=weight_grad,
                                  keep_routed_input=keep_routed_input)
    out.backward(grad)
    # Kept: the copy, every routed row in the padded layout; otherwise x itself.
    want_rows = padded_rows(rows * top_k, num_experts) if keep_routed_input else rows
    results[f"{name}_saves"] = {"ok": saved_rows == [want_rows], "err": 0.0, "scale": 0.0, "saved_rows": saved_rows}
    ref = {k: v.double().requires_grad_() for k, v in params.items()}
    want = expert_mlp_reference(ref["x"], ref["w1"], ref["w2"], ref["w3"], ids, ref.get("weights"))
    want.backward(grad.double())
    check(f"{name}_forward", out, want.detach())
    for key in params:
        if mine[key].requires_grad:
            check(f"{name}_grad_{key}", mine[key].grad, ref[key].grad)


def main() -> None:
    grouped_mm_checks()
    slot_sum_checks()
    expert_mlp_case("expert_mlp_top2_weighted", rows=11, top_k=2, with_weights=True)
    expert_mlp_case("expert_mlp_top1_unweighted", rows=9, top_k=1, with_weights=False)
    # The routed rows copied once, read by the gate/up GEMM from the padded layout, reused in the backward.
    expert_mlp_case("expert_mlp_top2_keep_routed", rows=11, top_k=2, with_weights=True, keep_routed_input=True)
    expert_mlp_case("expert_mlp_top1_keep_routed", rows=9, top_k=1, with_weights=False, keep_routed_input=True)
    # Routing weights that need no gradient still scale the expert gradients.
    expert_mlp_case("expert_mlp_top2_frozen_weights", rows=11, top_k=2, with_weights=True, frozen_weights=True)
    # The fallback option: weight gradients by torch._grouped_mm on the same padded operands.
    expert_mlp_case("expert_mlp_top2_torch_weight_grad", rows=11, top_k=2, with_weights=True,
                    weight_grad="torch_grouped_mm")
    # The fused kernels again with TMA weight descriptors and persistent launches.
    def tma_persistent(role, device, dtype=None):
        return [RowConfig(block_m=16, block_n=16, block_k=16, group_m=2,
                          num_warps=4, num_stages=1, persistent=True, tma=True)]

    configs.row_candidates = tma_persistent
    configs._chosen.clear()
    import dist_moe.kernels.launch as launch

    launch.row_candidates = configs.row_candidates
    # Whole tiles, so every weight operand (both layouts) can go through a descriptor.
    expert_mlp_case("expert_mlp_top2_tma_persistent", rows=11, top_k=2, with_weights=True, dim=32, ffn=48)
    # ... and the kept routed rows through an A descriptor too (the dual_tma role).
    expert_mlp_case("expert_mlp_top2_tma_persistent_keep_routed", rows=11, top_k=2, with_weights=True, dim=32,
                    ffn=48, keep_routed_input=True)
    print(json.dumps(results))


if __name__ == "__main__":
    main()
