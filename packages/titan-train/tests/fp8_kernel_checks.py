"""The blockwise fp8 GEMM kernel under TRITON_INTERPRET=1 (CPU), run by test_quantize.py in a subprocess (the
interpreter must be chosen before triton is imported). The interpreter has no fp8 types, so operands are fp32
tensors holding e4m3 values (the quantiser's output cast to fp32), which is exact. Prints one JSON object
{check name: {"ok", "err", "bound"}}; shapes are not multiples of the kernel's tiles, so the masks are exercised."""
from __future__ import annotations

import json
import os

os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402

from titan_train.quantize.blockwise_triton import blockwise_gemm, launch  # noqa: E402
from titan_train.quantize.scaling import Blocking, quantize  # noqa: E402

results: dict[str, dict] = {}
TILE, BLOCK = Blocking(rows=1, cols=128, pad_cols=128), Blocking(rows=128, cols=128, pad_cols=128)

for name, (m, n, k, b_blocking) in {"weights_128x128": (37, 200, 256, BLOCK),
                                    "tokens_1x128": (19, 45, 384, TILE)}.items():
    g = torch.Generator().manual_seed(0)
    a = torch.randn(m, k, generator=g) * torch.exp2(torch.randint(-6, 6, (m, 1), generator=g).float())
    b = torch.randn(n, k, generator=g) * torch.exp2(torch.randint(-6, 6, (1, k), generator=g).float())
    qa, qb = quantize(a, TILE), quantize(b, b_blocking)
    got = launch(qa.data.float(), qb.data.float(), qa.scale, qb.scale, b_scale_rows=b_blocking.rows,
                 out_dtype=torch.float32)
    # float64 product of the same e4m3 values times their block scales, written out independently of the kernel
    da = qa.data.double() * qa.scale.double().repeat_interleave(128, dim=1)
    sb = qb.scale.double().repeat_interleave(128, dim=1)
    db = qb.data.double() * (sb.repeat_interleave(b_blocking.rows, dim=0)[:n])
    want = da @ db.t()
    bound = 2 * k * 2.0 ** -24 * (da.abs() @ db.abs().t())
    err = (got.double() - want).abs()
    results[name] = {"ok": bool((err <= bound + 1e-30).all()) and got.shape == (m, n),
                     "err": err.max().item(), "bound": bound.max().item()}
    if name == "weights_128x128":  # the same launch through the custom op torch.compile sees (wrap_triton)
        via_op = blockwise_gemm(qa.data.float(), qb.data.float(), qa.scale, qb.scale, b_scale_rows=128,
                                out_dtype=torch.float32)
        results["custom_op"] = {"ok": bool(torch.equal(via_op, got)), "err": (via_op - got).abs().max().item(),
                                "bound": 0.0}
print(json.dumps(results))
