"""Float64 references for titan_train.quantize, written from the formats' definitions, not from the code.

e4m3 (OCP FP8 E4M3, "fn"): 1 sign, 4 exponent (bias 7), 3 mantissa bits; normals 2^-6 .. 448, subnormals
multiples of 2^-9; no infinities. e5m2: 5 exponent (bias 15), 2 mantissa bits; normals 2^-14 .. 57344,
subnormals multiples of 2^-16. Casts round to nearest, ties to even; the quantisers saturate (clamp to the
largest finite value).
"""
from __future__ import annotations

import math

import torch

FORMATS = {"e4m3": (3, -6, 448.0), "e5m2": (2, -14, 57344.0)}  # mantissa bits, min normal exponent, max


def round_fp8(v: float, fmt: str) -> float:
    """v rounded to the nearest `fmt` value (ties to even), saturating at +-max."""
    mbits, emin, fmax = FORMATS[fmt]
    if v == 0:
        return 0.0
    a = abs(v)
    exponent = max(math.frexp(a)[1] - 1, emin)  # floor(log2 a), at least the subnormal binade's
    ulp = 2.0 ** (exponent - mbits)
    q = round(a / ulp) * ulp  # Python's round: ties to even; a / ulp is exact (ulp a power of two)
    return math.copysign(min(q, fmax), v)


def amax_exponent(amax: float, fmax: float) -> int:
    """The largest p with amax * 2^p <= fmax, in [-127, 127] (0 for an all-zero block)."""
    if amax == 0:
        return 0
    p = math.floor(math.log2(fmax / amax))
    while amax * 2.0 ** (p + 1) <= fmax:
        p += 1
    while amax * 2.0 ** p > fmax:
        p -= 1
    return max(-127, min(127, p))


def mx_scale_exponent(amax: float) -> int:
    """OCP MX v1.0 section 6.3: X = 2^(floor(log2(amax)) - emax_elem), emax_elem = 8 for E4M3; clamped to
    e8m0's exponents [-127, 127]; an all-zero block takes the smallest."""
    if amax == 0:
        return -127
    shared = math.floor(math.log2(amax))
    if 2.0 ** shared > amax:  # log2 rounded up at a binade's edge
        shared -= 1
    elif 2.0 ** (shared + 1) <= amax:
        shared += 1
    return max(-127, min(127, shared - 8))


def quantize_reference(x: torch.Tensor, rows: int, cols: int, fmt: str = "e4m3", rule: str = "amax"):
    """(dequantised values [R, C] float64, fp8 values [R, C] float64, scale per element [R, C]) of x [R, C]
    cut into rows x cols blocks (0: the whole dimension), each element by the definitions above."""
    x = x.double()
    R, C = x.shape
    br, bc = rows or R, cols or C
    fmax = FORMATS[fmt][2]
    values, scales = torch.zeros(R, C, dtype=torch.float64), torch.zeros(R, C, dtype=torch.float64)
    for r0 in range(0, R, br):
        for c0 in range(0, C, bc):
            block = x[r0:r0 + br, c0:c0 + bc]
            amax = block.abs().max().item()
            if rule == "mx":
                scale = 2.0 ** mx_scale_exponent(amax)
            else:
                scale = 2.0 ** -amax_exponent(amax, fmax)
            q = [[round_fp8(v / scale, fmt) for v in row] for row in block.tolist()]
            values[r0:r0 + br, c0:c0 + bc] = torch.tensor(q, dtype=torch.float64)
            scales[r0:r0 + br, c0:c0 + bc] = scale
    return values * scales, values, scales
