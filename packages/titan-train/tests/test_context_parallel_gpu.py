"""On GPUs: ring attention's bf16 products against SDPA on one GPU, and CP2 (alone and with FSDP) under the
real command on nccl against one GPU in fp32. Skipped without CUDA (or with fewer GPUs than ranks)."""
from __future__ import annotations

import json

import pytest
import torch
import torch.distributed as dist

import titan_models as tm
from titan_models.components.attention import SDPAttention
from titan_train import train
from titan_train.context_parallel import RingAttention

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

GPU = {"job.device": "cuda", "training.steps": "20", "training.seq_len": "512", "training.batch_size": "8",
       "model.num_layers": "4"}


def test_ring_attention_on_one_gpu_matches_sdpa(tmp_path):
    """One cp rank (no exchange): the block math with bf16 products and fp32 statistics, against SDPA in fp32.

    Tolerance 3e-2 absolute plus 3e-2 relative: bf16 keeps 8 mantissa bits (4e-3 per rounding), and the
    gradients of early keys sum contributions of up to 1024 queries; a wrong mask or merge is off by O(1)."""
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("nccl", store=store, rank=0, world_size=1)
    try:
        g = torch.Generator(device="cuda").manual_seed(0)
        b, s, hq, hkv, d = 2, 1024, 8, 2, 64
        q, k, v, dout = (torch.randn(b, s, h, d, device="cuda", generator=g) for h in (hq, hkv, hkv, hq))
        docs = torch.zeros(b, s, dtype=torch.long, device="cuda")
        docs[0, 300:], docs[0, 700:] = 1, 2
        results = []
        for inner, dtype in ((SDPAttention(scale=d**-0.5), torch.float32),
                             (RingAttention(scale=d**-0.5, group=dist.group.WORLD), torch.bfloat16)):
            leaves = [t.detach().to(dtype).requires_grad_() for t in (q, k, v)]  # fresh leaves per dtype
            out = inner(*leaves, context=tm.AttentionContext(document_ids=docs))
            out.backward(dout.to(dtype))
            results.append([out.float(), *(t.grad.float() for t in leaves)])
        for name, want, got in zip(("out", "dq", "dk", "dv"), *results):
            torch.testing.assert_close(got, want, atol=3e-2, rtol=3e-2, msg=lambda m: f"{name}: {m}")
    finally:
        dist.destroy_process_group()


def _curve(folder) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in map(json.loads, (folder / "metrics.jsonl").read_text().splitlines())}


@pytest.mark.parametrize("nproc,layout", [
    (2, {"parallelism.cp": "2"}),
    (4, {"parallelism.cp": "2", "parallelism.dp_shard": "2"}),
], ids=["cp2", "cp2xfsdp2"])
def test_gpu_context_parallel_over_nccl_follows_one_gpu(tmp_path, jobs, cli, nproc, layout):
    """bf16 (FSDP's param dtype, or autocast) over nccl against one GPU in fp32; bf16 has 8 mantissa bits,
    so per-step losses agree to a few percent over 20 steps (the bound of test_gpu.py)."""
    if torch.cuda.device_count() < nproc:
        pytest.skip(f"needs {nproc} CUDA GPUs (context parallelism over nccl)")
    fp32 = train(jobs.tiny(tmp_path / "fp32", **GPU, **{"training.mixed_precision": "fp32"})).losses
    folder = tmp_path / "cp"
    args = {**GPU, **layout, "training.mixed_precision": "bf16", "job.folder": str(folder),
            "metrics.tensorboard": "false", "metrics.progress": "false", "checkpoint.resume": "false"}
    cli.run([*cli.TINY, *(p for key, value in args.items() for p in (f"--{key}", value))], nproc=nproc)
    got = _curve(folder)
    assert got[20] < got[1] - 1.0
    for step, loss in fp32.items():
        assert got[step] == pytest.approx(loss, rel=5e-2), (step, got, fp32)
