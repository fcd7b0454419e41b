"""The Triton batch-invariant kernels.

On CPU they run in Triton's interpreter (TRITON_INTERPRET=1, in a subprocess since the variable must
be set before triton is imported; float32 only). The interpreter computes tl.dot with numpy, whose
result for a row depends on the row's position inside the tile, so there the matmul check keeps each
row at its position and varies everything else (other rows' values, the number of rows); on a GPU the
full randomised-composition check runs.
"""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

INTERPRETER_CHECK = textwrap.dedent('''
    import torch
    from titan_rl.batch_invariant import triton_ops as T
    torch.manual_seed(0)
    x, w = torch.randn(10, 96), torch.randn(80, 96)
    out = T.matmul(x, w)
    assert (out.double() - x.double() @ w.double().T).abs().max() < 1e-4
    bigger = torch.randn(130, 96)
    bigger[:10] = x
    assert torch.equal(T.matmul(bigger, w)[:10], out)       # more rows, other values: same bits
    # float32 splits a long K (here 5 chunks of 256, the last ragged) and adds the partials in chunk order
    from titan_rl.batch_invariant import tiles
    xs, ws = torch.randn(130, 1100), torch.randn(80, 1100)
    assert tiles.matmul_plan(80, 1100, torch.float32).splits == 5
    split = T.matmul(xs, ws)
    assert (split.double() - xs.double() @ ws.double().T).abs().max() < 1e-3
    assert torch.equal(T.matmul(torch.cat([xs[:70], torch.randn(3, 1100)]), ws)[:70], split[:70])
    tiles.WORKSPACE_ELEMENTS = 5 * 80 * 64                  # 64 rows a launch: three launches, same bits
    assert tiles.matmul_plan(80, 1100, torch.float32).rows_per_launch(130, 80) == 64
    assert torch.equal(T.matmul(xs, ws), split)
    wn = torch.rand(96) + 0.5
    ref = (x.double() / torch.sqrt(x.double().pow(2).mean(-1, keepdim=True) + 1e-5)) * wn.double()
    norm = T.rms_norm(x, wn, 1e-5)
    assert (norm.double() - ref).abs().max() < 1e-5
    assert all(torch.equal(T.rms_norm(x[i:i + 1], wn, 1e-5)[0], norm[i]) for i in range(10))
    z = torch.randn(6, 2500) * 3
    lsm = T.log_softmax(z)
    assert (lsm.double() - torch.log_softmax(z.double(), -1)).abs().max() < 1e-5
    assert all(torch.equal(T.log_softmax(z[i:i + 1])[0], lsm[i]) for i in range(6))
    q, k, v = torch.randn(2, 70, 4, 32), torch.randn(2, 70, 2, 32), torch.randn(2, 70, 2, 32)
    pos = torch.arange(70).expand(2, 70)
    g = 2
    s = torch.einsum("bshd,blhd->bhsl", q.double(), k.double().repeat_interleave(g, 2)) * 0.2
    s = s.masked_fill(torch.arange(70)[None, None, None] > pos[:, None, :, None], float("-inf"))
    ref = torch.einsum("bhsl,blhd->bshd", s.softmax(-1), v.double().repeat_interleave(g, 2))
    att = T.attention(q, k, v, q_positions=pos, scale=0.2)
    assert (att.double() - ref).abs().max() < 1e-5
    # decode: query 64 alone over a longer cache (slots past kv_len masked). Query 64's rows (query x head of
    # the kv head's group) start a tile in the prefill too: the interpreter's numpy dot can round a row
    # by its position in the tile, which a GPU's dot does not (the GPU tests check any position).
    ck, cv = torch.zeros(1, 150, 2, 32), torch.zeros(1, 150, 2, 32)
    ck[:, :70], cv[:, :70] = k[:1], v[:1]
    one = T.attention(q[:1, 64:65], ck, cv, q_positions=pos[:1, 64:65], scale=0.2, kv_len=torch.tensor([65]))
    assert torch.equal(one[0, 0], att[0, 64])
    # gradients (torch backward on the saved inputs) match the torch implementation's
    from titan_rl.batch_invariant import torch_ops as C
    grads = []
    for attend in (T.attention, C.attention):
        qq = q.clone().requires_grad_()
        attend(qq, k, v, q_positions=pos, scale=0.2).pow(2).sum().backward()
        grads.append(qq.grad)
    assert torch.allclose(grads[0], grads[1], atol=1e-4)
    # sliding window (crossing the 64-key blocks) and sinks, prefill then decode at the last position
    sinks = torch.randn(4) * 2
    w = 20
    hide = (torch.arange(70)[None, None, None] > pos[:, None, :, None]) | \
        (pos[:, None, :, None] - torch.arange(70)[None, None, None] >= w)
    s = torch.einsum("bshd,blhd->bhsl", q.double(), k.double().repeat_interleave(g, 2)) * 0.2
    e = s.masked_fill(hide, float("-inf")).exp()
    ref = torch.einsum("bhsl,blhd->bshd", e / (e.sum(-1, keepdim=True) + sinks.double().exp()[None, :, None, None]),
                       v.double().repeat_interleave(g, 2))
    att = T.attention(q, k, v, q_positions=pos, scale=0.2, window=w, sinks=sinks)
    assert (att.double() - ref).abs().max() < 1e-5
    one = T.attention(q[:1, 64:65], ck, cv, q_positions=pos[:1, 64:65], scale=0.2, kv_len=torch.tensor([65]),
                      window=w, sinks=sinks)
    assert torch.equal(one[0, 0], att[0, 64])
    print("TRITON-INTERPRETER-OK")
''')


def test_triton_kernels_in_the_interpreter():
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1")
    result = subprocess.run([sys.executable, "-c", INTERPRETER_CHECK], env=env, capture_output=True, text=True, timeout=600)
    assert "TRITON-INTERPRETER-OK" in result.stdout, result.stdout + result.stderr


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="Triton kernels run compiled on a CUDA GPU only")


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_ops_are_batch_invariant_on_gpu(dtype):
    import random

    from titan_rl.batch_invariant import triton_ops as T
    torch.manual_seed(0)
    dev = "cuda"
    w = torch.randn(1536, 512, device=dev).to(dtype)
    x = torch.randn(300, 512, device=dev).to(dtype)
    wn = (torch.rand(512, device=dev) + 0.5).to(dtype)
    z = (torch.randn(40, 32000, device=dev) * 3).to(dtype)
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    ref = x.double() @ w.double().T
    assert ((T.matmul(x, w).double() - ref).abs().max() / ref.abs().max()) < tol
    singles = {i: (T.matmul(x[i:i + 1], w)[0], T.rms_norm(x[i:i + 1], wn, 1e-5)[0]) for i in range(0, 300, 7)}
    lsm_single = [T.log_softmax(z[i:i + 1])[0] for i in range(40)]
    rng = random.Random(0)
    for _ in range(10):
        idx = rng.sample(sorted(singles), rng.randint(1, len(singles)))
        batch = torch.cat([x[idx], torch.randn(rng.randint(0, 200), 512, device=dev).to(dtype)])
        mm, nm = T.matmul(batch, w), T.rms_norm(batch, wn, 1e-5)
        for r, i in enumerate(idx):
            assert torch.equal(mm[r], singles[i][0]) and torch.equal(nm[r], singles[i][1])
        rows = rng.sample(range(40), rng.randint(1, 40))
        ls = T.log_softmax(z[rows])
        assert all(torch.equal(ls[r], lsm_single[i]) for r, i in enumerate(rows))


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("family", ["llama3", "gpt_oss", "qwen3_moe", "deepseek_v3"])
def test_generator_and_trainer_agree_bitwise_on_gpu(dtype, family):
    import random

    import titan_models as tm

    from titan_rl import BuiltinGenerator, SamplingConfig, batch_invariant, token_logprobs
    if family == "llama3":
        config = tm.llama3.Llama3Config(vocab_size=2048, dim=256, num_layers=2, num_heads=4, num_kv_heads=2,
                                        ffn_dim=768, max_seq_len=1024, dtype=dtype)
    elif family == "gpt_oss":  # sinks, a 32-key window (prompts reach 200 tokens) and the MoE
        config = tm.gpt_oss.GptOssConfig(vocab_size=2048, dim=256, num_layers=2, num_heads=4, num_kv_heads=2,
                                         head_dim=64, moe=tm.gpt_oss.gpt_oss_moe(num_experts=8, top_k=2, expert_dim=128),
                                         sliding_window=32, max_seq_len=1024, dtype=dtype)
    else:  # the MoE debug policies (DeepSeek-V3: MLA, a dense layer, then group-limited sigmoid routing)
        flavor = tm.flavor("qwen3", "debug_moe") if family == "qwen3_moe" else tm.flavor("deepseek_v3", "debug")
        config = tm.transforms.compose(tm.transforms.num_layers(2), tm.transforms.dtype(dtype))(flavor)
    with torch.device("meta"):
        model = config.build()
    model.to_empty(device="cuda")
    model.init_weights(seed=0)
    batch_invariant(model)
    gen = BuiltinGenerator(model)
    rng = random.Random(0)
    prompts = [[rng.randrange(2048) for _ in range(n)] for n in (1, 17, 64, 65, 200)]
    comps = gen.generate(prompts, SamplingConfig(max_new_tokens=16, seed=0))
    for _ in range(3):
        order = rng.sample(range(len(prompts)), rng.randint(1, len(prompts)))
        seqs = [comps[i].prompt + comps[i].tokens for i in order]
        S = max(map(len, seqs)) + rng.randint(0, 30)
        tokens = torch.zeros(len(seqs), S, dtype=torch.long, device="cuda")
        for r, s in enumerate(seqs):
            tokens[r, :len(s)] = torch.tensor(s)
        with torch.no_grad():
            lp = token_logprobs(model, tokens).cpu()
        for r, i in enumerate(order):
            P, C = len(comps[i].prompt), len(comps[i].tokens)
            assert torch.equal(lp[r, P - 1:P - 1 + C], comps[i].logprobs)
