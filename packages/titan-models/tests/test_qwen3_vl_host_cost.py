"""Qwen3-VL's training step launches a number of operators, and makes host syncs, that do not grow with the
number of images: on the GPU the shapes task's step (128 small images) was launch-bound on per-image work
(an attention call per image and block, position and rotary tables built per image, per-token position
writes, boolean-mask indexing per DeepStack layer)."""
from __future__ import annotations

import collections

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import titan_models as tm

IMAGE_SIDE = 64  # 4 x 4 patches of 16 pixels: 4 merged tokens


class _Count(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


def _step_ops(model, rows: int) -> collections.Counter:
    cfg = model.config
    row = [cfg.vision_start_token_id] + [cfg.image_token_id] * 4 + [cfg.vision_end_token_id] + list(range(10, 20))
    tokens = torch.tensor([row] * rows)
    gen = torch.Generator().manual_seed(rows)
    patches = (IMAGE_SIDE // cfg.vision.patch_size) ** 2
    pixels = torch.randn(rows * patches, cfg.vision.patch_dim, generator=gen)
    grid_thw = torch.tensor([[1, IMAGE_SIDE // 16, IMAGE_SIDE // 16]] * rows)
    with _Count() as count:
        model(tokens, pixel_values=pixels, image_grid_thw=grid_thw).float().square().mean().backward()
    model.zero_grad(set_to_none=True)
    return count.ops


def test_operators_and_syncs_do_not_grow_with_images():
    torch.manual_seed(0)
    model = tm.flavor("qwen3_vl", "debug").build()
    model.init_weights(seed=0)
    _step_ops(model, 1)  # fills the host caches of the grid's coordinates and positions
    few, many = _step_ops(model, 2), _step_ops(model, 12)
    assert sum(many.values()) == sum(few.values()), (many - few) + (few - many)
    # .item() / .tolist() / int(tensor) and boolean indexing: each a host sync on the GPU
    for sync in ("_local_scalar_dense", "nonzero"):
        assert many[sync] == few[sync] <= 2, (sync, few[sync], many[sync])
