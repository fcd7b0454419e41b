"""The built-in generator with images (Qwen3-VL: prefill through the vision tower and MRoPE; Kimi K2.x and
Muse Glimmer: the tower at prefill, plain positions), then decode; every generated token's log-probability
equals the full forward over prompt + completion with the images."""
from __future__ import annotations

import pytest
import titan_models as tm
import torch

from titan_rl import BuiltinGenerator, SamplingConfig


def _model():
    config = tm.transforms.num_layers(2)(tm.flavor("qwen3_vl", "debug"))
    with torch.device("meta"):
        model = config.build()
    model.to_empty(device="cpu")
    model.init_weights(seed=0)
    with torch.no_grad():  # larger logits than init's, so that greedy choices are clear-cut
        model.output.weight.mul_(30)
    return model


def _prompt(config, grids, gen):
    tokens = []
    for _, h, w in grids:
        tokens += torch.randint(0, 1000, (3,), generator=gen).tolist()
        tokens += [config.vision_start_token_id] + [config.image_token_id] * (h * w // 4) + [config.vision_end_token_id]
    grid = torch.tensor(grids)
    return tokens + [5, 6], (torch.randn(int(grid.prod(-1).sum()), config.vision.patch_dim, generator=gen), grid)


def test_generation_with_images_equals_the_full_forward():
    model = _model()
    config = model.config
    gen = torch.Generator().manual_seed(0)
    (p0, i0), (p2, i2) = _prompt(config, [(1, 4, 6)], gen), _prompt(config, [(1, 2, 2), (1, 6, 4)], gen)
    p1 = torch.randint(0, 1000, (9,), generator=gen).tolist()  # a text-only prompt in the same batch
    prompts, images = [p0, p1, p2], [i0, None, i2]
    out = BuiltinGenerator(model).generate(prompts, SamplingConfig(max_new_tokens=6, temperature=0.0), images=images)
    for prompt, image, completion in zip(prompts, images, out):
        seq = torch.tensor([prompt + completion.tokens])
        kwargs = {} if image is None else {"pixel_values": image[0], "image_grid_thw": image[1]}
        with torch.no_grad():
            logits = model(seq, **kwargs)[0, len(prompt) - 1:-1]
        assert completion.tokens == logits.argmax(-1).tolist()
        want = logits.log_softmax(-1).gather(-1, torch.tensor(completion.tokens)[:, None])[:, 0]
        assert torch.allclose(completion.logprobs, want, atol=1e-4), (completion.logprobs, want)
    # control: the images steer the completion (generating without them changes the log-probabilities)
    blind = BuiltinGenerator(model).generate([p0], SamplingConfig(max_new_tokens=6, temperature=0.0))
    assert not torch.allclose(blind[0].logprobs, out[0].logprobs, atol=1e-2)


def test_images_need_one_entry_per_prompt_and_a_vision_model(tiny_llama):
    with pytest.raises(ValueError, match="2 image entries for 1 prompts"):
        BuiltinGenerator(_model()).generate([[1, 2]], SamplingConfig(max_new_tokens=1), images=[None, None])
    with pytest.raises(ValueError, match="has no vision tower"):
        BuiltinGenerator(tiny_llama()).generate([[1, 2]], SamplingConfig(max_new_tokens=1),
                                                images=[(torch.zeros(4, 8), torch.tensor([[1, 2, 2]]))])


def _one_d_model(family: str, flavor: str):
    config = tm.transforms.num_layers(2)(tm.flavor(family, flavor))
    with torch.device("meta"):
        model = config.build()
    model.to_empty(device="cpu")
    model.init_weights(seed=0)
    with torch.no_grad():
        model.output.weight.mul_(30)
    return model


@pytest.mark.parametrize("family,flavor,markers", [("kimi_k25", "debug", True), ("muse_glimmer", "debug_vision", False)])
def test_generation_with_images_equals_the_full_forward_for_1d_positions(family, flavor, markers):
    model = _one_d_model(family, flavor)
    config, vision = model.config, model.config.vision
    gen = torch.Generator().manual_seed(0)
    patch_width = vision.patch_dim if hasattr(vision, "patch_dim") else 3 * vision.patch_size ** 2
    prompts, images = [], []
    for grids in ([(1, 4, 4)], [(1, 4, 8), (1, 8, 4)]):
        tokens = []
        for _, h, w in grids:
            image = [config.image_token_id] * (h * w // 4)
            if markers:
                image = [config.vision_start_token_id] + image + [config.vision_end_token_id]
            tokens += torch.randint(1, 1000, (3,), generator=gen).tolist() + image
        grid = torch.tensor(grids)
        prompts.append(tokens + [5, 6])
        images.append((torch.randn(int(grid.prod(-1).sum()), patch_width, generator=gen), grid))
    prompts.append(torch.randint(1, 1000, (70,), generator=gen).tolist())  # text only, longer than the others
    images.append(None)
    out = BuiltinGenerator(model).generate(prompts, SamplingConfig(max_new_tokens=6, temperature=0.0), images=images)
    for prompt, image, completion in zip(prompts, images, out):
        kwargs = {} if image is None else {"pixel_values": image[0], "image_grid_thw": image[1]}
        with torch.no_grad():
            logits = model(torch.tensor([prompt + completion.tokens]), **kwargs)[0, len(prompt) - 1:-1]
        assert completion.tokens == logits.argmax(-1).tolist()
        want = logits.log_softmax(-1).gather(-1, torch.tensor(completion.tokens)[:, None])[:, 0]
        assert torch.allclose(completion.logprobs, want, atol=1e-4), (completion.logprobs, want)
    # control: the images reach the logits (the prompt's last position, with and without them)
    with torch.no_grad():
        seen = model(torch.tensor([prompts[0]]), pixel_values=images[0][0], image_grid_thw=images[0][1])[0, -1]
        blind = model(torch.tensor([prompts[0]]))[0, -1]
    assert ((seen - blind).norm() / blind.norm()).item() > 1e-2
