"""Where a training step's peak memory goes, counted analytically: what bench.py prints as 'expected GiB'.

    python tools/bench/train_throughput/memory_model.py [--size 1.5B] [--batch 4] [--seq 4096]

The peak of a step comes at the end of the forward (the loss's chunks), when every block's saved tensors
are alive and the gradients are not yet (zero_grad sets them to None):
  states       bytes a parameter held through the forward: bf16 weights (2) and AdamW's moments (2 x 2 in
               bf16, 2 x 4 in fp32), plus fp32 master weights (4) for titan-train's bf16_params;
  activations  per token and layer, the values the backward reads, counted from the saved tensors of
               one block (titan-train: tests/test_activation_memory.py counts them through saved-tensor
               hooks on the compiled block; transformers + liger: its kernels' saved tensors);
  weight cats  titan-train's fused q/k/v and gate/up projections concatenate their weights every forward,
               and the compiled block without checkpointing keeps the concatenation for backward;
  loss         the fused loss's chunk of logits (bf16) and its output-weight gradient sum (fp32, or bf16
               with training.loss_weight_grad_dtype=param; the Triton chunk kernel writes the logits'
               gradient over them);
  other        embedding output, final norm input in fp32 (it runs outside the compiled blocks), token rows.
The allocator's own slack (~1 GiB measured) is not counted, nor the first block's backward transient (its
recomputed values and the gate|up gradient, about 1 GiB at 16k tokens on the 1.5B model), which can put the
peak of a setting with small loss buffers at the start of the backward instead.
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass

GIB = 2**30
SIZES = {  # name: (hidden, layers, heads, kv_heads, ffn, vocab), as bench.py
    "1.5B": (2048, 16, 32, 8, 8192, 128256),
    "8B": (4096, 32, 32, 8, 14336, 128256),
    "tiny": (128, 2, 4, 2, 256, 1024),
}


@dataclass(frozen=True, kw_only=True)
class Setting:
    """How a variant holds its state and activations."""

    state_bytes: int
    """Bytes a parameter during the forward (see the module docstring)."""
    activations: str
    """titan_compile, titan_compile_sac (op-level selective checkpointing compiled with the block), liger."""
    loss_chunk: int = 0
    """Tokens per chunk of titan-train's fused loss (0: liger's, whose chunks are a few hundred tokens)."""
    weight_grad_bytes: int = 4
    """Bytes a value of the fused loss's output-weight gradient sum (training.loss_weight_grad_dtype)."""


def parameters(size: str) -> int:
    d, layers, heads, kv_heads, ffn, vocab = SIZES[size]
    kv = d // heads * kv_heads
    return layers * (d * (2 * d + 2 * kv) + 3 * d * ffn + 2 * d) + 2 * vocab * d + d


def values_per_token_layer(size: str, activations: str) -> int:
    """bf16 values a token keeps per layer (fp32 row statistics left out: < 0.1%)."""
    d, _, heads, kv_heads, ffn, _ = SIZES[size]
    kv = d // heads * kv_heads
    if activations == "titan_compile":  # normed inputs, RoPE'd q and k, the q/k/v product, SwiGLU product, ...
        return 7 * d + 3 * kv + 3 * ffn
    if activations == "titan_compile_sac":  # x, q/k/v product, attention out, wo out, gate|up
        return 4 * d + 2 * kv + 2 * ffn
    if activations == "liger":  # two norm inputs and outputs, q k v, attention out twice (SDPA's, o_proj's
        return 7 * d + 2 * kv + 3 * ffn  # contiguous copy), gate, up and their product
    raise ValueError(f"unknown activation layout {activations!r}")


def breakdown(size: str, batch: int, seq: int, setting: Setting) -> dict[str, float]:
    """GiB of each part of the peak."""
    d, layers, heads, kv_heads, ffn, vocab = SIZES[size]
    kv = d // heads * kv_heads
    tokens = batch * seq
    parts = {"states": parameters(size) * setting.state_bytes,
             "activations": 2 * tokens * layers * values_per_token_layer(size, setting.activations)}
    if setting.activations == "titan_compile":
        parts["weight cats"] = 2 * layers * d * (2 * ffn + d + 2 * kv)
    if setting.loss_chunk:
        parts["loss"] = 2 * min(setting.loss_chunk, tokens) * vocab + setting.weight_grad_bytes * vocab * d
    else:  # liger: a chunk of ~512 tokens in bf16 and a bf16 weight gradient
        parts["loss"] = 2 * 512 * vocab + 2 * vocab * d
    parts["other"] = tokens * d * (2 + 4 + 2) + 3 * tokens * 8
    return {name: value / GIB for name, value in parts.items()}


VARIANTS = {  # bench.py's variants whose layout this counts
    "hf_liger": Setting(state_bytes=2 + 2 * 2, activations="liger"),
    "titan_compile": Setting(state_bytes=2 + 4 + 2 * 4, activations="titan_compile", loss_chunk=8192),
    "titan_compile_sac": Setting(state_bytes=2 + 4 + 2 * 4, activations="titan_compile_sac", loss_chunk=8192),
    "titan_compile_sac_bf16_moments": Setting(state_bytes=2 + 4 + 2 * 2, activations="titan_compile_sac",
                                              loss_chunk=8192),
    "titan_compile_lean": Setting(state_bytes=2 + 4 + 2 * 2, activations="titan_compile_sac", loss_chunk=2048,
                                  weight_grad_bytes=2),
}


def expected_gib(variant: str, size: str, batch: int, seq: int) -> float | None:
    """The counted peak of `variant` (None where this model does not count it)."""
    base = variant.removesuffix("_cudnn")
    if base not in VARIANTS:
        return None
    return sum(breakdown(size, batch, seq, VARIANTS[base]).values())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", default="1.5B", choices=sorted(SIZES))
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=4096)
    args = p.parse_args()
    print(f"{args.size} Llama ({parameters(args.size) / 1e9:.3f}B parameters), batch {args.batch} x {args.seq}; GiB")
    names = ["states", "activations", "weight cats", "loss", "other"]
    print(f"{'variant':<32}" + "".join(f"{n:>13}" for n in names) + f"{'total':>9}")
    for variant, setting in VARIANTS.items():
        parts = breakdown(args.size, args.batch, args.seq, setting)
        print(f"{variant:<32}" + "".join(f"{parts.get(n, 0.0):13.2f}" for n in names) + f"{sum(parts.values()):9.2f}")


if __name__ == "__main__":
    main()
