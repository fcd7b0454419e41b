"""The built-in generator: batched prefill, then decode with a KV cache, on a titan-models model."""
from __future__ import annotations

import copy
import threading

import titan_models as tm
import torch
from torch import nn

from titan_rl.batch_invariant import is_batch_invariant
from titan_rl.batch_invariant.torch_ops import KEY_BLOCK
from titan_rl.generation.base import Completion
from titan_rl.generation.kv_cache import GenerationContext, install_kv_cache
from titan_rl.generation.sampling import SamplingConfig, sample_next
from titan_rl.logprobs import logprobs_from_logits


class BuiltinGenerator:
    """Generates from `model`'s own definition; its inner attentions get a KV cache (override).

    copy_model: keep a private copy of the model, so that a trainer can step the original while this
      generator runs in another thread; weights then arrive through `update_weights`. With False the
      generator shares the trainer's model (synchronous use, no weight transfer at all).
    pad_id: token fed in padded prompt positions (any valid id: padded positions are never attended).

    Vision-language models (Qwen3-VL) take images with the prompts: `generate(prompts, sampling,
    images=[(pixel_values, image_grid_thw) or None per prompt])`, each prompt holding its images' image
    tokens. Prefill runs the vision tower and the 3-D MRoPE positions; decode continues each sample's
    text positions after its prompt on all three axes. The cache slot of a token stays its index in the
    sequence (`GenerationContext.positions`), whatever its rotary position.
    """

    def __init__(self, model: nn.Module, *, copy_model: bool = False, pad_id: int = 0, policy_version: int = 0) -> None:
        self.model = copy.deepcopy(model) if copy_model else model
        if copy_model:
            self.model.requires_grad_(False)
        install_kv_cache(self.model)
        self.pad_id = pad_id
        self.policy_version = policy_version
        self._lock = threading.Lock()  # weights never change during a generate() call

    def update_weights(self, state_dict: dict[str, torch.Tensor], *, version: int) -> None:
        """Copy new weights in (names as in model.state_dict()) and take their version.

        A tied parameter (tok_embeddings.weight is output.weight) has a name per module in the state dict, as
        it does in any exported one: it is copied once, and its other names must bring the same values (a
        tied model cannot hold an untied trainer's two matrices)."""
        with self._lock, torch.no_grad():
            params = (dict(self.model.named_parameters(remove_duplicate=False))
                      | dict(self.model.named_buffers(remove_duplicate=False)))
            unknown = sorted(set(state_dict) - set(params))
            if unknown:
                raise ValueError(f"update_weights got names the model does not have: {unknown[:5]}")
            written: dict[int, str] = {}  # id of a target tensor -> the name whose value it took
            for name, value in state_dict.items():
                target = params[name]
                if id(target) in written:
                    first = written[id(target)]
                    if value is not target and not torch.equal(value, state_dict[first]):
                        raise ValueError(f"update_weights got different values for {name} and {first}, which are "
                                         "one tied parameter of the generator's model")
                    continue
                written[id(target)] = name
                if value is not target:  # a generator sharing the trainer's model gets its own tensors
                    target.copy_(value)
            self.policy_version = version

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], sampling: SamplingConfig, *,
                 images: list[tuple[torch.Tensor, torch.Tensor] | None] | None = None) -> list[Completion]:
        if not prompts or any(len(p) == 0 for p in prompts):
            raise ValueError("generate() needs at least one prompt, each with at least one token")
        if images is not None and len(images) != len(prompts):
            raise ValueError(f"generate() got {len(images)} image entries for {len(prompts)} prompts (one per "
                             "prompt: (pixel_values, image_grid_thw) or None)")
        with self._lock:
            return self._generate(prompts, sampling, images)

    def _image_inputs(self, tokens: torch.Tensor, lengths: torch.Tensor, images: list[tuple[torch.Tensor, torch.Tensor] | None] | None
                      ) -> tuple[dict[str, torch.Tensor], torch.Tensor | None, torch.Tensor | None]:
        """(the model's image keyword arguments, the prefill's rotary positions [3, b, s], each sample's
        next text position [b]); empty and None without images. Models with plain 1-D positions (Kimi K2.x,
        Muse Glimmer) take the images at prefill only; Qwen3-VL's MRoPE positions come from the image grids."""
        given = [entry for entry in images or [] if entry is not None]
        if not given:
            return {}, None, None
        config = self.model.config
        if getattr(config, "vision", None) is None:
            raise ValueError(f"generate() got images, but {type(config).__name__} has no vision tower")
        device = tokens.device
        pixel_values = torch.cat([p for p, _ in given]).to(device)
        grid = torch.cat([g for _, g in given]).to(device)
        if self.pad_id == config.image_token_id:
            raise ValueError(f"pad_id={self.pad_id} is the image token; pass another pad_id to BuiltinGenerator")
        if not hasattr(config, "mrope_sections"):
            return {"pixel_values": pixel_values, "image_grid_thw": grid}, None, None
        positions, after_padding = tm.qwen3_vl.mrope_positions(tokens, grid, image_token_id=config.image_token_id,
                                                           spatial_merge_size=config.vision.spatial_merge_size)
        # the right padding counts as text, one position per token: the prompt's next position is before it
        padding = tokens.shape[1] - lengths
        return {"pixel_values": pixel_values, "image_grid_thw": grid}, positions, after_padding - padding

    def _generate(self, prompts: list[list[int]], sampling: SamplingConfig,
                  images: list[tuple[torch.Tensor, torch.Tensor] | None] | None = None) -> list[Completion]:
        model, device = self.model, next(self.model.parameters()).device
        invariant = is_batch_invariant(model)
        rng = None
        if sampling.seed is not None:
            rng = torch.Generator(device=device)
            rng.manual_seed(sampling.seed)
        batch = len(prompts)
        lengths = torch.tensor([len(p) for p in prompts], device=device)
        longest = int(lengths.max())
        capacity = -(-(longest + sampling.max_new_tokens) // KEY_BLOCK) * KEY_BLOCK
        tokens = torch.full((batch, longest), self.pad_id, dtype=torch.long, device=device)
        for i, p in enumerate(prompts):
            tokens[i, : len(p)] = torch.tensor(p, device=device)

        # Prefill: every prompt position at once (right-padded); the next-token logits of each
        # sequence sit at its last real position. Recurrent layers (linear attention) keep their
        # state in `recurrent_states`, carried over the padding (valid_tokens) and through decode.
        positions = torch.arange(longest, device=device).expand(batch, longest)
        context = GenerationContext(positions=positions, kv_len=torch.full((batch,), longest, device=device),
                                    capacity=capacity, recurrent_states={},
                                    valid_tokens=positions < lengths[:, None])
        # Images: rotary positions are MRoPE's 3-D ones; decode resumes at each sample's next text position.
        image_inputs, rope_positions, next_text = self._image_inputs(tokens, lengths, images)
        logits = model(tokens, positions=positions if rope_positions is None else rope_positions, context=context,
                       **image_inputs)
        last_logits = logits[torch.arange(batch, device=device), lengths - 1]   # [B, V]

        out_tokens: list[list[int]] = [[] for _ in range(batch)]
        out_logprobs: list[list[torch.Tensor]] = [[] for _ in range(batch)]
        finish = ["length"] * batch
        done = [False] * batch  # host-side: reading a device tensor per row was a sync per row and step
        stops = set(sampling.stop_token_ids)
        cur_len = lengths.clone()
        for step in range(sampling.max_new_tokens):
            nxt = sample_next(last_logits, sampling, rng)
            logp = logprobs_from_logits(last_logits, nxt, temperature=sampling.temperature, batch_invariant=invariant)
            picked = nxt.tolist()  # one device-to-host copy a step
            for i in range(batch):
                if done[i]:
                    continue
                tok = picked[i]
                out_tokens[i].append(tok)
                out_logprobs[i].append(logp[i])
                if tok in stops or any(out_tokens[i][-len(s):] == list(s) for s in sampling.stop_sequences):
                    done[i] = True
                    finish[i] = "stop"
            if all(done) or step == sampling.max_new_tokens - 1:
                break
            # Decode: one token per sequence at its own position (finished ones keep going on
            # padding; their outputs are ignored).
            positions = cur_len[:, None]
            context.positions, context.kv_len, context.valid_tokens = positions, cur_len + 1, None
            context._cache.clear()
            rope = positions if next_text is None else (next_text + cur_len - lengths)[:, None]
            last_logits = model(nxt[:, None], positions=rope, context=context)[:, 0]
            cur_len = cur_len + 1
        return [
            Completion(prompt=list(prompts[i]), tokens=out_tokens[i],
                       logprobs=torch.stack(out_logprobs[i]).float().cpu(), finish_reason=finish[i],
                       policy_version=self.policy_version)
            for i in range(batch)
        ]
