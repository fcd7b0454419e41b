"""A block checkpointed whole (remat/wrap.py checkpoint_whole: activation_checkpoint.mode=full, selective
layers, remat's recompute option) saves only its input when compiled, also with the fused SwiGLU's custom
autograd.Function inside. torch 2.11's plain checkpoint left that Function's ops untagged and its partitioner
saved the SwiGLU output beside the input (pytorch/pytorch#177396; on the H200 an 8B block saved 4.3x the bytes
it saves without it): the control below shows it there, on the torch that has the bug."""
from __future__ import annotations

import pytest
import torch
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

import titan_models
from titan_train.kernels.swiglu import use_fused_swiglu
from titan_train.remat.saved import COMPILED_BACKEND
from titan_train.remat.wrap import checkpoint_whole

ROWS, SEQ = 2, 80
TORCH = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2])


def _block(fused: bool):
    torch.manual_seed(0)
    cfg = titan_models.transforms.num_layers(1)(titan_models.flavor("llama3", "debug"))
    model = cfg.build()
    if fused:
        assert use_fused_swiglu(model) == ["layers.0.feed_forward"]
    h = torch.randn(ROWS, SEQ, cfg.dim)
    rope = tuple(model.rope(torch.arange(SEQ).expand(ROWS, SEQ)))
    return model.layers["0"], h, rope


def _saved_and_grads(block, wrapped, h, rope) -> tuple[list[tuple[int, ...]], list[torch.Tensor]]:
    """The shapes of what the compiled `wrapped` saves for its backward (parameters apart, and the CPU generator's
    uint8 state that torch 2.11 saves for a checkpointed region), and the gradients."""
    params = {p.untyped_storage().data_ptr() for p in block.parameters()}
    compiled = torch.compile(wrapped, backend=COMPILED_BACKEND)
    saved: list[tuple[int, ...]] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.untyped_storage().data_ptr() not in params and t.dtype != torch.uint8:
            saved.append(tuple(t.shape))
        return t

    x = h.clone().requires_grad_(True)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = compiled(x, rope)
    out.pow(2).sum().backward()
    grads = [x.grad, *(p.grad.clone() for p in block.parameters())]
    block.zero_grad(set_to_none=True)
    return saved, grads


@pytest.mark.parametrize("fused", [False, True])
def test_block_checkpointed_whole_saves_only_its_input(fused):
    torch._dynamo.reset()
    block, h, rope = _block(fused)
    saved, grads = _saved_and_grads(block, checkpoint_whole(block), h, rope)
    assert sorted(saved) == sorted([tuple(h.shape), *(tuple(r.shape) for r in rope)])  # the input and RoPE
    x = h.clone().requires_grad_(True)
    block(x, rope).pow(2).sum().backward()  # the block eager, nothing recomputed
    want = [x.grad, *(p.grad for p in block.parameters())]
    for got, ref in zip(grads, want, strict=True):
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


def test_plain_checkpoint_saved_the_fused_swiglu_output_on_torch_2_11():
    """The control: torch's plain checkpoint around the fused block, compiled. Before the fix reached torch
    (2.11, the H200 image's), it saves the [rows, seq, ffn] SwiGLU output too; after it, as checkpoint_whole."""
    torch._dynamo.reset()
    block, h, rope = _block(True)
    saved, _ = _saved_and_grads(block, checkpoint_wrapper(block, preserve_rng_state=False), h, rope)
    ffn_out = (ROWS, SEQ, block.feed_forward.w2.in_features)
    if TORCH < (2, 12):
        assert ffn_out in saved, saved
    else:
        assert ffn_out not in saved and tuple(h.shape) in saved, saved
