"""The combine of the fused expert MLP in its variants, timed alone (H200, DeepSeek-V3 shapes).

    PYTHONPATH=$(ls -d packages/*/src | paste -sd:) python tools/bench/moe/probe_combine.py

The GEMMs whose rows go back to the tokens (the forward's down projection, the backward's input
gradient) either scatter each row to its slot from the epilogue and leave the top-k sum to torch,
or store in expert order and let slot_sum gather and sum (slot_sum's block shapes too). Also dh =
dOut @ w2 (plain, padded A) in the launch styles. The variants take turns (bench_setup's
interleaved_ms, medians of 7 rounds), so clock drift falls on all alike; each prints its speed
against the first variant (the anchor: the shipped or the old way) and its output's difference
from the first variant's.
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=7)
    args = p.parse_args()

    import torch

    from bench_setup import ProbeLayer, Setup, rel_err
    from dist_moe.kernels.configs import RowConfig
    from dist_moe.kernels.launch import (
        EPILOGUE_SCATTER,
        RowOperands,
        gather_rows,
        invert_slots,
        row_gemm,
        slot_sum,
    )

    layer = ProbeLayer.make()
    dev, dt = torch.device("cuda"), torch.bfloat16
    tokens, top_k, dim, ffn, rows = layer.tokens, layer.top_k, layer.dim, layer.ffn, layer.rows
    x, w1, w2 = layer.x, layer.w1, layer.w2
    offsets, slot, flat_w, maps = layer.offsets, layer.slot, layer.flat_weights, layer.maps
    pos = invert_slots(slot)
    setup = Setup(dry_run=False)

    def compare(title: str, variants: dict, flops: float = 0.0, moved: float = 0.0) -> None:
        """variants: name -> fn returning the output. Each runs once (checked against the first),
        then they take turns in blocks of 5 calls (medians over the rounds)."""
        print(f"-- {title}", flush=True)
        ref, ok, diffs = None, {}, {}
        for name, fn in variants.items():
            try:
                out = fn()
                ref = out.clone() if ref is None else ref
                ok[name], diffs[name] = fn, rel_err(out, ref)
            except Exception as err:
                print(f"  {name:58s} failed: {type(err).__name__}: {str(err)[:160]}", flush=True)
        times = setup.interleaved_ms(ok, rounds=args.rounds, per_block=5)
        anchor = next(iter(times.values()), None)  # the first variant, timed in the same turns
        for name, ms in times.items():
            rate = f"{flops / ms / 1e9:6.0f} TFLOP/s" if flops else f"{moved / ms / 1e6:6.0f} GB/s"
            print(f"  {name:58s} {ms:7.3f} ms {rate}  x{anchor / ms:.3f} vs first  diff {diffs[name]:.1e}",
                  flush=True)

    base = dict(block_m=128, block_n=256, block_k=64, num_warps=8, tma=True)
    flat = RowConfig(**base, num_stages=3, persistent=True, flatten=True)
    persistent = RowConfig(**base, num_stages=3, persistent=True)
    grid = RowConfig(**base, num_stages=3)
    grid4 = RowConfig(**base, num_stages=4)

    # ---- forward down projection + combine
    h = torch.randn(rows, ffn, device=dev, dtype=dt)
    y = x.new_empty(rows, dim)

    def down(config, scatter: bool, combine: bool = True):
        """The down GEMM (its output scattered to the slots, or in expert order), then the sum if `combine`."""
        ops = RowOperands(a=h, b=w2.transpose(1, 2), offsets=offsets, out=y, num_rows=rows, slot=slot, maps=maps)
        if scatter:
            ops.epilogue, ops.weight = EPILOGUE_SCATTER, flat_w
        if not combine:
            return lambda: (row_gemm(ops, config), y)[1]
        if scatter:
            return lambda: (row_gemm(ops, config), y.view(tokens, top_k, dim).sum(dim=1))[1]
        return lambda: (row_gemm(ops, config), slot_sum(y, pos, top_k, flat_w))[1]

    down_flops = 2.0 * rows * dim * ffn
    compare("forward down + combine (GEMM and sum)", {
        "scatter epilogue + torch sum, " + flat.name(): down(flat, True),
        **{"expert order + slot_sum, " + c.name(): down(c, False) for c in (flat, persistent, grid, grid4)},
    }, flops=down_flops)
    compare("forward down GEMM alone", {
        "scatter epilogue, " + flat.name(): down(flat, True, combine=False),
        **{"store, " + c.name(): down(c, False, combine=False) for c in (flat, persistent, grid, grid4)},
    }, flops=down_flops)

    moved = (rows + tokens) * dim * 2
    ident = torch.arange(rows, device=dev, dtype=torch.int32)
    sums = {"torch sum over top_k": lambda: y.view(tokens, top_k, dim).sum(dim=1)}
    for bt, bc, warps in ((16, 256, 4), (32, 256, 8), (8, 512, 4), (16, 512, 8), (32, 128, 4), (64, 128, 8),
                          (8, 1024, 8), (4, 1024, 4)):
        sums[f"slot_sum (unweighted) block_t {bt} block_c {bc} warps {warps}"] = (
            lambda bt=bt, bc=bc, warps=warps: slot_sum(y, ident, top_k, block_t=bt, block_c=bc, num_warps=warps))
    compare("the sum alone (identity positions: same bytes as torch's sum)", sums, moved=moved)
    gathered = {"slot_sum weighted, shipped blocks": lambda: slot_sum(y, pos, top_k, flat_w)}
    for bt, bc, warps in ((32, 256, 8), (8, 512, 4), (16, 512, 8)):
        gathered[f"slot_sum weighted block_t {bt} block_c {bc} warps {warps}"] = (
            lambda bt=bt, bc=bc, warps=warps: slot_sum(y, pos, top_k, flat_w, block_t=bt, block_c=bc,
                                                       num_warps=warps))
    compare("the sum with the real positions (gathering rows)", gathered, moved=moved)

    # ---- backward input gradient: dgate @ w1 + dup @ w3, then the sum
    grads = torch.randn(maps.padded_rows, 3 * ffn, device=dev, dtype=dt)
    dgate, dup = grads[:, :ffn], grads[:, ffn:2 * ffn]
    dx_rows = x.new_empty(rows, dim)

    def dx(config, scatter: bool):
        ops = RowOperands(a=dgate, a2=dup, b=w1, b2=w1, offsets=offsets, out=dx_rows, num_rows=rows, slot=slot,
                          padded_a=True, maps=maps)
        if scatter:
            ops.epilogue = EPILOGUE_SCATTER
            return lambda: (row_gemm(ops, config), dx_rows.view(tokens, top_k, dim).sum(dim=1))[1]
        return lambda: (row_gemm(ops, config), slot_sum(dx_rows, pos, top_k))[1]

    compare("backward dx + combine", {
        "scatter epilogue + torch sum, " + flat.name(): dx(flat, True),
        "expert order + slot_sum, " + flat.name(): dx(flat, False),
        "expert order + slot_sum, " + persistent.name(): dx(persistent, False),
        "expert order + slot_sum, " + grid.name(): dx(grid, False),
    }, flops=2.0 * rows * dim * 2 * ffn)

    # ---- backward dh = dOut @ w2 (plain, padded A)
    d_out = gather_rows(torch.randn(tokens, dim, device=dev, dtype=dt), slot, top_k, maps)
    dh = x.new_empty(rows, ffn)

    def dh_gemm(config):
        ops = RowOperands(a=d_out, b=w2, offsets=offsets, out=dh, num_rows=rows, padded_a=True, maps=maps)
        return lambda: (row_gemm(ops, config), dh)[1]

    compare("backward dh = dOut @ w2", {config.name(): dh_gemm(config) for config in
                                        (flat, persistent, grid, grid4)},
            flops=2.0 * rows * dim * ffn)


if __name__ == "__main__":
    main()
