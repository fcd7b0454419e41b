"""What a compiled Llama block keeps for backward, counted through saved-tensor hooks (which see the
tensors a compiled graph saves): op-level selective checkpointing compiled with the block (the checkpoint
traced into the graph, compile_regions.py) keeps only the block input, the q/k/v, attention and output
projections and the gate/up product, 4.5 d + 2 ffn values a token (d = model width), recomputes no
matmul, and the losses and gradients are those of the block without it. Control: compiled alone the same
block keeps over 1.4x that (normed inputs, RoPE'd q and k, the SwiGLU product, the concatenated weights).

aot_eager_decomp_partition runs inductor's min-cut partitioner with eager kernels: the same saved set as
inductor on a GPU without generating code (on a GPU, tools/bench/train_throughput measures the peak)."""
from __future__ import annotations

import pytest
import torch

from titan_models.models.llama3.model import Llama3Config
from titan_train.compile_regions import apply_compile_regions
from titan_train.config import ActivationCheckpointConfig, CompileConfig
from titan_train.kernels.swiglu import use_fused_swiglu
from titan_train.parallelize import apply_activation_checkpointing

DIM, FFN, SEQ = 256, 1024, 256  # the 1.5B bench Llama's proportions: ffn 4 d, 4:1 query:key heads, head dim 64


def _block_run(selective: bool, fused: bool) -> tuple[int, torch.Tensor, list[torch.Tensor], int]:
    """(bytes a token the block saves for backward, output, gradients, matmuls run in backward)."""
    torch.manual_seed(0)
    config = Llama3Config(vocab_size=512, dim=DIM, num_layers=1, num_heads=4, num_kv_heads=1, ffn_dim=FFN,
                          head_dim=64, max_seq_len=1024)
    model = config.build().to(torch.bfloat16)
    if fused:  # the GPU path's SwiGLU autograd function (its backward in torch ops on CPU)
        use_fused_swiglu(model)
    if selective:
        apply_activation_checkpointing(model, ActivationCheckpointConfig(mode="selective", selective="ops"))
    apply_compile_regions(model, CompileConfig(enabled=True, backend="aot_eager_decomp_partition"))
    x = torch.randn(2, SEQ, DIM, dtype=torch.bfloat16, requires_grad=True)
    rope = tuple(t.to(torch.bfloat16) for t in model.rope(torch.arange(SEQ)[None]))
    shared = {t.untyped_storage().data_ptr() for t in [*model.parameters(), *rope]}
    storages: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storages.setdefault(t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = model.layers["0"](x, rope)
    saved = sum(n for ptr, n in storages.items() if ptr not in shared)
    with torch.profiler.profile() as prof:
        out.float().square().sum().backward()
    matmuls = sum(e.count for e in prof.key_averages() if e.key in ("aten::mm", "aten::addmm", "aten::bmm"))
    grads = [x.grad, *(p.grad for p in model.parameters() if p.grad is not None)]
    return saved // (2 * SEQ), out.detach(), grads, matmuls


@pytest.mark.parametrize("fused", [False, True], ids=["torch-swiglu", "fused-swiglu"])
def test_compiled_selective_checkpointing_keeps_the_planned_tensors_and_recomputes_no_matmul(fused):
    saved_sac, out_sac, grads_sac, mm_sac = _block_run(selective=True, fused=fused)
    saved_plain, out_plain, grads_plain, mm_plain = _block_run(selective=False, fused=fused)
    planned = (DIM + 3 * DIM // 2 + DIM + DIM + 2 * FFN) * 2  # x, qkv, attention out, wo out, gate|up (bf16)
    small = 2 * 4 + 4 * 4  # per token: two RMSNorm rstd and the attention log-sum-exp of 4 heads (fp32)
    assert planned <= saved_sac <= planned + small, (saved_sac, planned)
    assert saved_plain > 1.4 * saved_sac, (saved_plain, saved_sac)  # control: what compile alone keeps
    assert mm_sac == mm_plain, (mm_sac, mm_plain)  # no matmul recomputed
    torch.testing.assert_close(out_sac, out_plain, rtol=0, atol=0)
    for a, b in zip(grads_sac, grads_plain):  # recomputation repeats the same bf16 ops
        torch.testing.assert_close(a, b, rtol=1e-2, atol=1e-2)
