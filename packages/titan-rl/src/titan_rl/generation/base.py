"""What every generator returns and the interface the RL loop drives."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Protocol, runtime_checkable

import torch

from titan_rl.generation.sampling import SamplingConfig


@dataclass(kw_only=True)
class Completion:
    prompt: list[int]
    tokens: list[int]            # the sampled completion (stop token included)
    logprobs: torch.Tensor       # [len(tokens)] float32, the generator's log p of each sampled token
    finish_reason: Literal["stop", "length"]
    policy_version: int          # the weights version that produced it


@runtime_checkable
class Generator(Protocol):
    policy_version: int

    def generate(self, prompts: list[list[int]], sampling: SamplingConfig) -> list[Completion]: ...

    def update_weights(self, state_dict: dict[str, torch.Tensor], *, version: int) -> None: ...
