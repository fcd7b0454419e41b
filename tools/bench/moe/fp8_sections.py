"""One fp8 grouped expert GEMM split into its launches, each timed alone, against bf16's three GEMMs.

dist_moe.grouped_mm_fp8's forward + backward of the gate/up projection (x [R, K] @ w[e] [K, N], the
DeepSeek-V3 16B expert shape of bench_fp8_grouped.py) runs, per recipe:

    forward   quant_x, quant_w, gemm_fwd
    dgrad     quant_dy, quant_wT (rowwise: w re-quantised along N), gemm_dgrad (blockwise: with the
              fp8 copy that makes the forward's w^T blocks K-major)
    wgrad     pad (rows scattered into 128-row chunks), quant_cols (x and dy along the tokens),
              gemm_wgrad

Each piece is timed on its own (interleaved turns, medians) beside the whole step, so the table says
where an fp8 step's time goes and whether the pieces add up to it; the bf16 anchor is
torch._grouped_mm's forward, dgrad and wgrad on the same operands (dist_moe.grouped_mm where torch has
no _grouped_mm). Then a short sweep of the fp8 forward GEMM's tile configurations (the shipped
128x128x128 one first). Called by bench_fp8_grouped.py --sections.
"""
from __future__ import annotations

FP8_ROW_SWEEP = (  # (block_m, block_n, block_k, group_m, num_warps, num_stages); block_k divides 128
    (128, 128, 128, 8, 8, 4),  # shipped
    (128, 256, 128, 8, 8, 3),
    (128, 128, 128, 8, 4, 4),
    (64, 128, 128, 8, 4, 4),
    (128, 128, 64, 8, 4, 5),
    (128, 256, 64, 8, 8, 4),
)
DRY_ROW_SWEEP = ((16, 32, 32, 2, 4, 1), (32, 32, 32, 1, 4, 1))


def _operands(setup, dims: dict, counts: list[int]):
    import torch

    gen = torch.Generator().manual_seed(2)
    rows, k, n = sum(counts), dims["hidden"], 2 * dims["inter"]
    to = dict(device=setup.device, dtype=setup.dtype)
    x = torch.randn(rows, k, generator=gen).to(**to)
    w = (torch.randn(dims["experts"], k, n, generator=gen) * k ** -0.5).to(**to)
    dy = torch.randn(rows, n, generator=gen).to(**to)
    return x, w, dy


def _pieces(recipe_name: str, x, w, dy, offsets, backend: str) -> dict:
    """name -> zero-argument callable, in the order grouped_mm_fp8 runs them."""
    import torch

    from dist_moe.fp8_quant import FP8_DTYPES, quantize_blocks, quantize_token_columns, resolve_recipe
    from dist_moe.grouped_mm_fp8 import E4M3, _quantize_rows, _quantize_weight_forward, _scaled_mm

    recipe = resolve_recipe(recipe_name)
    blockwise = recipe.granularity == "blockwise"
    grad = FP8_DTYPES[recipe.grad_format]
    ends = None if backend == "triton" else offsets.tolist()
    xq, sx = _quantize_rows(x, blockwise, E4M3, backend)
    wq, sw = _quantize_weight_forward(w, blockwise, backend)
    gq, sg = _quantize_rows(dy, blockwise, grad, backend)
    if blockwise:
        wtq, swt = wq.transpose(1, 2), sw.transpose(1, 2)
    else:
        wtq_rows, swt = quantize_blocks(w, 1, w.shape[2], E4M3, backend)
        wtq, swt = wtq_rows.transpose(1, 2), swt.squeeze(2)
    chunks, xp, dyp = _pad(offsets, x, dy)
    xq_t, sxt = quantize_token_columns(xp, chunks, recipe.granularity, E4M3, backend)
    gq_t, sgt = quantize_token_columns(dyp, chunks, recipe.granularity, grad, backend)
    out_dtype = x.dtype
    pieces = {
        "quant_x": lambda: _quantize_rows(x, blockwise, E4M3, backend),
        "quant_w": lambda: _quantize_weight_forward(w, blockwise, backend),
        "gemm_fwd": lambda: _scaled_mm(xq, sx, wq, sw, offsets, blockwise, out_dtype, backend, ends),
        "quant_dy": lambda: _quantize_rows(dy, blockwise, grad, backend),
    }
    if not blockwise:
        pieces["quant_wT"] = lambda: quantize_blocks(w, 1, w.shape[2], E4M3, backend)
    pieces["gemm_dgrad"] = lambda: _scaled_mm(gq, sg, wtq, swt, offsets, blockwise, out_dtype, backend, ends)
    pieces["pad"] = lambda: _pad(offsets, x, dy)
    pieces["quant_cols"] = lambda: (quantize_token_columns(xp, chunks, recipe.granularity, E4M3, backend),
                                    quantize_token_columns(dyp, chunks, recipe.granularity, grad, backend))
    if backend == "triton":
        from dist_moe.kernels.fp8_launch import scaled_weight_gemm

        dw = torch.empty_like(w)
        pieces["gemm_wgrad"] = lambda: scaled_weight_gemm(xq_t, sxt, gq_t, sgt, chunks.ends, dw)
    return pieces


def _pad(offsets, x, dy):
    """The weight gradient's padding as grouped_mm_fp8 runs it: one chunk layout, both operands scattered."""
    from dist_moe.fp8_quant import padded_chunks

    chunks = padded_chunks(offsets, x.shape[0])
    return chunks, chunks.scatter(x), chunks.scatter(dy)


def _whole_step(recipe_name: str, x, w, dy, offsets, backend: str):
    import dist_moe

    xg, wg = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()

    def step():
        xg.grad = wg.grad = None
        dist_moe.grouped_mm_fp8(xg, wg, offsets, recipe=recipe_name, backend=backend).backward(dy)
    return step


def _bf16_pieces(x, w, dy, offsets, backend: str) -> dict:
    import torch

    import dist_moe

    if not (hasattr(torch, "_grouped_mm") and x.device.type == "cuda"):
        return {"bf16_fwd": lambda: dist_moe.grouped_mm(x, w, offsets, backend=backend),
                "bf16_dgrad": lambda: dist_moe.grouped_mm(dy, w.transpose(1, 2), offsets, backend=backend)}
    fns = {"bf16_fwd": lambda: torch._grouped_mm(x, w, offs=offsets),
           "bf16_dgrad": lambda: torch._grouped_mm(dy, w.transpose(1, 2), offs=offsets),
           "bf16_wgrad": lambda: torch._grouped_mm(x.t(), dy, offs=offsets)}
    for name, fn in list(fns.items()):
        try:
            fn()
        except Exception as exc:  # an anchor only: a layout this torch refuses is reported
            print(f"  {name}: torch._grouped_mm refused ({type(exc).__name__}: {str(exc)[:120]})")
            del fns[name]
    return fns


def _row_sweep(setup, x, w, offsets, backend: str, rounds: int) -> dict:
    if backend != "triton":  # the tiles are the Triton kernel's
        return {}
    import torch

    from dist_moe.grouped_mm_fp8 import E4M3, _quantize_rows, _quantize_weight_forward
    from dist_moe.kernels.fp8_launch import Fp8RowConfig, scaled_row_gemm

    xq, sx = _quantize_rows(x, False, E4M3, backend)
    wq, sw = _quantize_weight_forward(w, False, backend)
    out = torch.empty(x.shape[0], w.shape[2], device=x.device, dtype=x.dtype)
    fns = {}
    for bm, bn, bk, gm, warps, stages in (DRY_ROW_SWEEP if setup.dry else FP8_ROW_SWEEP):
        config = Fp8RowConfig(block_m=bm, block_n=bn, block_k=bk, group_m=gm, num_warps=warps, num_stages=stages)

        def run(config=config):
            scaled_row_gemm(xq, sx, wq, sw, offsets, out, blockwise=False, config=config)
        try:
            run()
        except Exception as exc:  # a config the GPU refuses (shared memory, registers) is reported, not fatal
            print(f"  sweep {bm}x{bn}x{bk} w{warps} s{stages}: refused ({type(exc).__name__}: {str(exc)[:120]})")
            continue
        fns[f"{bm}x{bn}x{bk} g{gm} w{warps} s{stages}"] = run
    return setup.interleaved_ms(fns, rounds=rounds, per_block=10)


def fp8_sections(setup, dims: dict, counts: list[int], rounds: int, backend: str) -> dict:
    """{recipe: {piece: ms}, "bf16": {...}, "sweep": {...}, "gemm_tflop": ...}, printed as it goes."""
    x, w, dy = _operands(setup, dims, counts)
    offsets = setup.offsets(counts)
    gemm_tflop = 2 * x.shape[0] * x.shape[1] * w.shape[2] / 1e12
    result = {"gemm_tflop": gemm_tflop, "rows": x.shape[0], "k": x.shape[1], "n": w.shape[2]}
    bf16 = setup.interleaved_ms(_bf16_pieces(x, w, dy, offsets, backend), rounds=rounds, per_block=10)
    result["bf16"] = bf16
    print(f"\nfp8 sections: x [{x.shape[0]}, {x.shape[1]}] @ w [{w.shape[0]}, {x.shape[1]}, {w.shape[2]}] "
          f"({gemm_tflop:.3f} TFLOP a GEMM); bf16: " + ", ".join(f"{k} {v:.3f} ms" for k, v in bf16.items()))
    for recipe in ("rowwise", "blockwise"):
        fns = _pieces(recipe, x, w, dy, offsets, backend)
        fns["whole_step"] = _whole_step(recipe, x, w, dy, offsets, backend)
        ms = setup.interleaved_ms(fns, rounds=rounds, per_block=10)
        result[recipe] = ms
        parts = sum(v for k, v in ms.items() if k != "whole_step")
        print(f"  {recipe}: whole step {ms['whole_step']:.3f} ms, pieces sum {parts:.3f} ms, bf16's three "
              f"GEMMs {sum(bf16.values()):.3f} ms")
        for name, t in ms.items():
            rate = f"{gemm_tflop / (t / 1e3):7.1f} TFLOP/s" if name.startswith("gemm") else ""
            print(f"    {name:12s} {t:8.3f} ms  {100 * t / ms['whole_step']:5.1f}%  {rate}")
    result["sweep"] = _row_sweep(setup, x, w, offsets, backend, rounds)
    for name, t in result["sweep"].items():
        print(f"  fp8 rowwise forward GEMM {name:24s} {t:8.3f} ms {gemm_tflop / (t / 1e3):7.1f} TFLOP/s")
    return result
