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
