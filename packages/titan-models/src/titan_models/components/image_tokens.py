"""Checks shared by the image-text models whose image tokens take the images in order, sample by sample."""
from __future__ import annotations

import torch


def check_image_tokens(is_image: torch.Tensor, image_grid_thw: torch.Tensor, merge: int) -> None:
    """ValueError naming the sample unless the images, taken in order, fill each sample's image tokens whole."""
    need = [int(t * h * w) // merge**2 for t, h, w in image_grid_thw.tolist()]
    image = 0
    for sample, have in enumerate(is_image.sum(-1).tolist()):
        start = image
        while have > 0 and image < len(need):
            have -= need[image]
            image += 1
        if have > 0:
            raise ValueError(f"sample {sample} has more image tokens than images: images {start}..{len(need) - 1} "
                             f"make {sum(need[start:])} tokens, it holds {int(is_image[sample].sum())}")
        if have < 0:
            raise ValueError(f"sample {sample} holds {int(is_image[sample].sum())} image tokens, which do not end "
                             f"at an image boundary: images {start}..{image - 1} need {sum(need[start:image])}")
    if image != len(need):
        raise ValueError(f"image_grid_thw lists {len(need)} images but the samples' image tokens hold {image}")


def embed_with_images(model: torch.nn.Module, tokens: torch.Tensor, pixel_values: torch.Tensor,
                      image_grid_thw: torch.Tensor, *, merge: int) -> torch.Tensor:
    """Embeddings [b, s, dim] of a Transformer with a vision tower (`model.visual`) whose image tokens take
    the tower's features in order (Kimi K2.x, Muse Glimmer): image and video placeholders embedded as
    token 0, then replaced; the model's embedding norm, if any, before the replacement."""
    if model.tok_embeddings is None:
        raise ValueError("images go to the first pipeline stage (the one holding tok_embeddings)")
    cfg = model.config
    is_image = tokens == cfg.image_token_id
    check_image_tokens(is_image, image_grid_thw, merge)
    image_tokens = model.visual(pixel_values, image_grid_thw)
    h = model.tok_embeddings(tokens.masked_fill(is_image | (tokens == cfg.video_token_id), 0))
    if model.embedding_norm is not None:
        h = model.embedding_norm(h)
    return h.masked_scatter(is_image[..., None], image_tokens.to(h.dtype))
