"""float64 references for the fp8 grouped GEMMs, written from the formats' definitions (not from
dist_moe.fp8_quant): the e4m3 / e5m2 value grids built from their bit layouts, round to nearest
with ties to the even code, block scales amax / max rounded to float32, and per-expert loops.
"""
from __future__ import annotations

import torch

BLOCK = 128
# (exponent bits, mantissa bits, bias, largest finite value) of OCP FP8 E4M3 ("fn": no infinities,
# only S.1111.111 is NaN) and E5M2 (IEEE-like: exponent 31 holds inf/NaN).
FORMATS = {"e4m3": (4, 3, 7, 448.0), "e5m2": (5, 2, 15, 57344.0)}


def grid(fmt: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(finite non-negative values, ascending, float64; their codes) of the format."""
    ebits, mbits, bias, top = FORMATS[fmt]
    values, codes = [], []
    for code in range(1 << (ebits + mbits)):
        exponent, mantissa = code >> mbits, code & ((1 << mbits) - 1)
        if exponent == 0:
            value = mantissa / (1 << mbits) * 2.0 ** (1 - bias)
        else:
            value = (1 + mantissa / (1 << mbits)) * 2.0 ** (exponent - bias)
        if value <= top:
            values.append(value)
            codes.append(code)
    return torch.tensor(values, dtype=torch.float64), torch.tensor(codes)


def round_to_format(v: torch.Tensor, fmt: str) -> torch.Tensor:
    """float64 v (|v| <= max) rounded to the nearest value of the format, ties to the even code."""
    values, codes = grid(fmt)
    mag = v.abs().clamp(max=values[-1].item()).contiguous()
    hi = torch.searchsorted(values, mag).clamp(max=len(values) - 1)
    lo = (hi - 1).clamp(min=0)
    d_lo, d_hi = mag - values[lo], values[hi] - mag
    pick_hi = (d_hi < d_lo) | ((d_hi == d_lo) & (codes[hi] % 2 == 0))
    return torch.where(pick_hi, values[hi], values[lo]) * v.sign()


def block_scales(t: torch.Tensor, block_rows: int, block_cols: int, fmt: str) -> torch.Tensor:
    """[R / br, C / bc] float32-representable scales amax / max of a 2-D tensor's blocks."""
    rows, cols = t.shape
    amax = t.double().abs().reshape(rows // block_rows, block_rows, cols // block_cols, block_cols).amax(dim=(1, 3))
    return (amax.clamp(min=1e-12) / FORMATS[fmt][3]).float().double()


def quotient(t: torch.Tensor, wide_scale: torch.Tensor) -> torch.Tensor:
    """t / scale as the float32 quantiser sees it: the float64 quotient of the two float32 values
    rounded to float32 (equal to IEEE float32 division: 53 >= 2 * 24 + 2 bits, so the double
    rounding is exact). It matters: a float32 quotient can land on an fp8 midpoint the exact one
    misses, and then rounds to the even neighbour."""
    return (t.float().double() / wide_scale).float().double()


def fake_quant(t: torch.Tensor, block_rows: int, block_cols: int, fmt: str) -> torch.Tensor:
    """float64 quantise-dequantise of a 2-D tensor in blocks."""
    scale = block_scales(t, block_rows, block_cols, fmt)
    wide = scale.repeat_interleave(block_rows, 0).repeat_interleave(block_cols, 1)
    return round_to_format(quotient(t, wide), fmt) * wide


def fake_quant_token_chunks(t: torch.Tensor, per_expert: bool, fmt: str) -> torch.Tensor:
    """One expert's rows [rows, C] along the tokens: per column over all rows (rowwise) or per
    column of each 128-row chunk from the expert's first row (blockwise; the last chunk partial)."""
    out = torch.empty_like(t, dtype=torch.float64)
    step = max(t.shape[0], 1) if per_expert else BLOCK
    for r0 in range(0, t.shape[0], step):
        chunk = t[r0:r0 + step]
        out[r0:r0 + step] = fake_quant(chunk, chunk.shape[0], 1, fmt)
    return out


def reference(x, w, grad, counts, granularity: str, grad_fmt: str = "e4m3"):
    """float64 (out, dx, dw) of quantise-dequantise-matmul per expert for a recipe; w [E, K, N]."""
    blockwise = granularity == "blockwise"
    k, n = w.shape[1], w.shape[2]
    outs, dxs, dws, start = [], [], [], 0
    for e, c in enumerate(counts):
        xe, ge, we = x[start:start + c].double(), grad[start:start + c].double(), w[e].double()
        # forward: x per row / 1x128 along K; w[e] per output column / 128x128
        xq = fake_quant(xe, 1, BLOCK if blockwise else k, "e4m3")
        wq = fake_quant(we, BLOCK, BLOCK, "e4m3") if blockwise else fake_quant(we, k, 1, "e4m3")
        outs.append(xq @ wq)
        # dgrad: dOut per row / 1x128 along N; w[e]^T re-quantised along N (rowwise) or the same blocks
        gq = fake_quant(ge, 1, BLOCK if blockwise else n, grad_fmt)
        wtq = wq if blockwise else fake_quant(we, 1, n, "e4m3")
        dxs.append(gq @ wtq.T)
        # wgrad: both along the expert's tokens
        dws.append(fake_quant_token_chunks(xe, not blockwise, "e4m3").T
                   @ fake_quant_token_chunks(ge, not blockwise, grad_fmt))
        start += c
    return torch.cat(outs), torch.cat(dxs), torch.stack(dws)


def exact(x, w, grad, counts):
    """float64 (out, dx, dw) without quantisation."""
    outs, dxs, dws, start = [], [], [], 0
    for e, c in enumerate(counts):
        xe, ge, we = x[start:start + c].double(), grad[start:start + c].double(), w[e].double()
        outs.append(xe @ we)
        dxs.append(ge @ we.T)
        dws.append(xe.T @ ge)
        start += c
    return torch.cat(outs), torch.cat(dxs), torch.stack(dws)


def rounding_bound(a: torch.Tensor, b: torch.Tensor, mbits_a: int, mbits_b: int) -> torch.Tensor:
    """Elementwise bound on |fake_quant(a) @ fake_quant(b) - a @ b| for any scaling blocks: a value
    rounded to m mantissa bits moves by at most 2^-(m+1) of itself when normal, and by at most half
    the smallest subnormal step (2^-10 or 2^-17 of the block's scale, <= 2^-18 of the block's amax,
    bounded here by the tensor's amax) otherwise."""
    ua, ub = 2.0 ** -(mbits_a + 1), 2.0 ** -(mbits_b + 1)
    da = ua * a.abs() + 2.0 ** -18 * a.abs().amax(dim=(0, 1), keepdim=True)
    db = ub * b.abs() + 2.0 ** -18 * b.abs().amax(dim=(0, 1), keepdim=True)
    return da @ (b.abs() + db) + a.abs() @ db
