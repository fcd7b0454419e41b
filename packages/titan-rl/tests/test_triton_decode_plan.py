"""Batch-invariant decode on the Triton kernels: launch plans that keep a GPU busy at decode's few rows, and
decode steps that reuse one specialisation of each kernel (a changing int argument would compile anew).

The plan checks are plain Python; the launch record runs the built-in generator on the Triton kernels in
Triton's CPU interpreter (a subprocess: TRITON_INTERPRET must be set before triton is imported).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from titan_rl.batch_invariant.tiles import attention_plan, matmul_plan

H200_SMS = 132
# Llama-3 1B (dim 2048, GQA 32/8 heads of 64, FFN 8192, the RL job's 384-id vocabulary): (N, K) per Linear
LLAMA_1B = {"wq/wo": (2048, 2048), "wk/wv": (512, 2048), "w1/w3": (8192, 2048), "w2": (2048, 8192),
            "output": (384, 2048)}


def test_fp32_decode_matmuls_fill_an_h200():
    # a decode step of 8 prompts x 8 samples is M = 64 rows; the old single-program 128 x 128 tile gave
    # 64 programs for w1/w3, 16 for wq/wo/w2 (each walking all of K) and 4 for wk/wv
    programs = {}
    for name, (n, k) in LLAMA_1B.items():
        plan = matmul_plan(n, k, torch.float32)
        tiles, splits = plan.grid(64, n)
        programs[name] = tiles * splits
        assert plan.k_chunk % plan.block_k == 0 and (plan.splits - 1) * plan.k_chunk < k <= plan.splits * plan.k_chunk
    assert programs["w1/w3"] >= 2 * H200_SMS and programs["w2"] >= 2 * H200_SMS, programs
    assert programs["wq/wo"] >= H200_SMS, programs
    assert min(programs.values()) >= 48, programs


def test_plans_do_not_depend_on_the_rows():
    # everything an element's arithmetic depends on comes from (N, K, dtype); rows only set the grid and
    # the row chunks, which are whole tiles
    for dtype in (torch.float32, torch.bfloat16):
        for n, k in LLAMA_1B.values():
            plan = matmul_plan(n, k, dtype)
            for m in (1, 7, 64, 300, 9000, 70000):
                rows = plan.rows_per_launch(m, n)
                assert rows == m or rows % plan.block_m == 0
                assert plan.splits == 1 or plan.splits * rows * n <= max(1 << 26, plan.splits * plan.block_m * n)
    assert matmul_plan(2048, 2048, torch.bfloat16).splits == 1  # tensor-core tile unchanged
    # a decode step's tile (query x group head) wastes at most 12 of 16 rows in float32 with 32/8 heads
    assert attention_plan(torch.float32).block_m == 16


RECORD = textwrap.dedent('''
    import json, torch
    import titan_models as tm
    from titan_rl import BuiltinGenerator, SamplingConfig, batch_invariant
    from titan_rl.batch_invariant import ops, triton_ops as T

    ops._use_triton = lambda x: True  # the Triton kernels on CPU tensors (interpreter)
    launches = []

    def spec(v):  # what Triton specialises an argument on: ints on == 1 and divisibility by 16
        if isinstance(v, bool) or v is None or isinstance(v, str):
            return v
        if isinstance(v, int):
            return "1" if v == 1 else "D16" if v % 16 == 0 else "int"
        if isinstance(v, float):
            return "float"
        return str(v.dtype) if isinstance(v, torch.Tensor) else repr(v)

    class Recorder:
        def __init__(self, name, kernel):
            self.name, self.kernel = name, kernel

        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                key = [spec(a) for a in args] + sorted((k, spec(v)) for k, v in kwargs.items())
                launches.append({"kernel": self.name, "grid": list(grid), "key": json.dumps(key)})
                return self.kernel[grid](*args, **kwargs)
            return launch

    for name in ("_matmul_kernel", "_sum_splits_kernel", "_rms_norm_kernel", "_log_softmax_kernel",
                 "_attention_kernel"):
        setattr(T, name, Recorder(name, getattr(T, name)))
    config = tm.llama3.Llama3Config(vocab_size=64, dim=64, num_layers=2, num_heads=4, num_kv_heads=2, ffn_dim=320,
                                    max_seq_len=256, dtype=torch.float32)
    model = config.build()
    model.init_weights(seed=0)
    batch_invariant(model)
    gen = BuiltinGenerator(model)
    steps, forward = [], model.forward

    def counted(*args, **kwargs):
        steps.append(len(launches))
        return forward(*args, **kwargs)

    model.forward = counted
    gen.generate([[1, 2, 3], [4, 5, 6, 7, 8], [9] * 20], SamplingConfig(max_new_tokens=5, seed=0))
    steps.append(len(launches))
    print("RECORD" + json.dumps({"launches": launches, "steps": steps}))
''')


def test_decode_steps_reuse_one_specialisation_of_each_kernel():
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1")
    result = subprocess.run([sys.executable, "-c", RECORD], env=env, capture_output=True, text=True, timeout=600)
    line = next((x for x in result.stdout.splitlines() if x.startswith("RECORD")), None)
    assert line is not None, result.stdout + result.stderr
    record = json.loads(line[len("RECORD"):])
    launches, bounds = record["launches"], record["steps"]
    assert len(bounds) == 6  # the prefill, then 4 decode steps (the 5th token needs no forward)
    decode = [launches[bounds[i]:bounds[i + 1]] for i in range(1, len(bounds) - 1)]
    assert len({len(step) for step in decode}) == 1, [len(step) for step in decode]
    # 2 layers x (q, k, v, o, w1, w3, w2) + the output projection, each with its split-K sum when split
    assert len([x for x in decode[0] if x["kernel"] == "_matmul_kernel"]) == 15
    per_kernel = {}
    for launch in decode[0]:
        per_kernel.setdefault(launch["kernel"], []).append(launch["key"])
    for name, seen in per_kernel.items():  # every later step launches exactly what the first did
        for step in decode[1:]:
            assert [x["key"] for x in step if x["kernel"] == name] == seen, name
