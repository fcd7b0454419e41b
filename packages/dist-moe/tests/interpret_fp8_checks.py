"""The fp8 Triton kernels under TRITON_INTERPRET=1 (CPU), against float64 quantise-dequantise-matmul.

Run by test_triton_interpret_fp8.py in a subprocess (the interpreter must be chosen before triton
is imported); prints one JSON object {check name: {"ok", "err", "scale"}}. The interpreter loads
float8 tensors and multiplies them exactly (tl.dot of e4m3 x e5m2 included), so these check the
kernels' indexing, masks, scale layouts and the chunk padding of the weight gradient; float32
inputs make the fp8 values exactly the reference's. Tiles are 16x32x32 (row kernel) and 16x32x32
(weight kernel): groups of 5, 0, 130, 1, 0 and 20 rows leave partial row tiles, partial 128-row
chunks and empty experts; rowwise also runs with K and N that are not multiples of a tile. The
quantisation kernels (kernels/fp8_quantize.py) run too, and are compared bit for bit with torch's.
"""
from __future__ import annotations

import dataclasses
import json
import os
import sys
from pathlib import Path

os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402
import triton.runtime.interpreter as interpreter  # noqa: E402

import dist_moe  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
from dist_moe_fp8_reference import reference  # noqa: E402

interpreter.interpreter_builder.options = dataclasses.replace(interpreter.interpreter_builder.options,
                                                              sanitize_overflow=False)
TOL = 1e-5
COUNTS = [5, 0, 130, 1, 0, 20]
results: dict[str, dict] = {}


def check(name: str, got: torch.Tensor, want: torch.Tensor) -> None:
    err = (got.double() - want).abs().max().item()
    scale = max(want.abs().max().item(), 1e-30)
    results[name] = {"ok": bool(err <= TOL * scale), "err": err, "scale": scale}


def case(name: str, granularity: str, grad_format: str, k: int, n: int) -> None:
    gen = torch.Generator().manual_seed(0)
    rows = sum(COUNTS)
    x = (torch.randn(rows, k, generator=gen) * torch.logspace(-2, 2, rows).reshape(-1, 1)).requires_grad_()
    stored = torch.randn(len(COUNTS), n, k, generator=gen).requires_grad_()  # Linear-style [E, N, K]
    grad = torch.randn(rows, n, generator=gen)
    offsets = torch.tensor(COUNTS).cumsum(0).to(torch.int32)
    recipe = dist_moe.Fp8Recipe(granularity=granularity, grad_format=grad_format)
    out = dist_moe.grouped_mm_fp8(x, stored.transpose(1, 2), offsets, recipe=recipe, backend="triton")
    out.backward(grad)
    want_out, want_dx, want_dw = reference(x.detach(), stored.detach().transpose(1, 2), grad, COUNTS,
                                           granularity, grad_format)
    check(f"{name}_forward", out, want_out)
    check(f"{name}_grad_x", x.grad, want_dx)
    check(f"{name}_grad_w", stored.grad.transpose(1, 2), want_dw)


def _bits_up_to_zero_sign(q: torch.Tensor) -> torch.Tensor:
    """The fp8 bit patterns with -0 read as +0: triton < 3.7's interpreter rounds tiny negative values to +0
    where torch (and the GPU's cvt) give -0 (the H200 image has triton 3.6). Every other bit must match."""
    bits = q.view(torch.uint8)
    return torch.where(bits == 0x80, torch.zeros_like(bits), bits)


def quantizer_checks() -> None:
    """The Triton quantiser bit for bit against the torch ops (themselves checked against float64
    rounding in test_grouped_mm_fp8.py), every block shape the GEMMs use, both output layouts."""
    from dist_moe.fp8_quant import quantize_blocks

    gen = torch.Generator().manual_seed(2)
    t = torch.randn(2, 256, 192, generator=gen) * torch.logspace(-4, 3, 256).reshape(1, -1, 1)
    t[0, 5] = 0
    ok, worst = True, 0
    for dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        for blocks in ((1, 192), (1, 64), (128, 64), (256, 1), (128, 1), (256, 192)):
            for rows_contiguous in (False, True):
                q_t, s_t = quantize_blocks(t, *blocks, dtype, "torch")
                q_k, s_k = quantize_blocks(t, *blocks, dtype, "triton", rows_contiguous)
                bits_t, bits_k = _bits_up_to_zero_sign(q_t), _bits_up_to_zero_sign(q_k)
                same = torch.equal(bits_t, bits_k) and torch.equal(s_t, s_k)
                worst = max(worst, int((bits_t != bits_k).sum()))
                ok &= same and (q_k.stride(-2) == 1) == rows_contiguous
    results["quantize_bitwise_triton_vs_torch"] = {"ok": bool(ok), "err": worst, "scale": 0}


def main() -> None:
    quantizer_checks()
    case("rowwise_e4m3", "rowwise", "e4m3", k=256, n=128)
    case("rowwise_e5m2_tails", "rowwise", "e5m2", k=200, n=72)
    case("blockwise_e4m3", "blockwise", "e4m3", k=256, n=128)
    case("blockwise_e5m2", "blockwise", "e5m2", k=128, n=256)
    print(json.dumps(results))


if __name__ == "__main__":
    main()
