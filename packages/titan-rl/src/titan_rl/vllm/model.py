"""A titan-models Transformer as a vLLM model: our definition, vLLM's Attention layer for the KV cache.

vLLM calls `forward(input_ids [T], positions [T])` on the flattened tokens of all running sequences;
we run the titan model on them as one [1, T] row. Each `layers.N.attention.inner` is replaced
(titan-models `override`) by an adapter that hands q/k/v to a vLLM `Attention` layer, which writes the
paged KV cache it owns and attends per sequence. In batch-invariant mode (`TITAN_RL_BATCH_INVARIANT=1`
in the engine's environment) the dense layers run titan-rl's batch-invariant ops and the Attention
layer gets titan-rl's attention backend (vLLM's CPU cache layout and metadata, our fixed-order kernel).
Sliding windows and attention sinks (gpt-oss) go to vLLM's Attention layer; models it cannot serve
(linear attention: see titan_rl.vllm.support) are refused with a ValueError saying why.
"""
from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterable

import titan_models as tm
import torch
from torch import nn
from titan_models.hf import converter_for
from vllm.config import VllmConfig
from vllm.model_executor.layers.attention import Attention

from titan_rl.batch_invariant import batch_invariant
from titan_rl.vllm.plugin import architectures
from titan_rl.vllm.support import check_servable


def batch_invariant_requested() -> bool:
    return os.environ.get("TITAN_RL_BATCH_INVARIANT", "0") == "1"


class VLLMInnerAttention(nn.Module):
    """inner(q [1, T, hq, d], k/v [1, T, hkv, d]) -> [1, T, hq, d] through a vLLM Attention layer.

    The vLLM layer is kept out of this module's children (its scale buffers would change the inner
    attention's state signature, which `override` checks); TitanForCausalLM holds it instead."""

    def __init__(self, attn: Attention) -> None:
        super().__init__()
        object.__setattr__(self, "_attn", attn)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, context=None,
                sinks: torch.Tensor | None = None) -> torch.Tensor:
        # sinks: the vLLM layer holds the same tensor (given at construction), so they are not passed again
        b, t, hq, d = q.shape
        assert b == 1, "vLLM passes the flattened tokens of all sequences as one row"
        out = self._attn(q.reshape(t, hq * d), k.reshape(t, -1), v.reshape(t, -1))  # [T, hq * d_v]
        return out.view(1, t, hq, -1)


class TitanForCausalLM(nn.Module):
    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
        super().__init__()
        hf_config = vllm_config.model_config.hf_config
        known = architectures()
        ours = [a for a in (hf_config.architectures or []) if a in known]
        if not ours:
            raise ValueError(f"config architectures {hf_config.architectures} name no titan architecture "
                             f"({sorted(known)})")
        hf = hf_config.to_dict()
        hf["architectures"] = [known[ours[0]]]
        converter = converter_for(hf)
        config = converter.config_from_hf(hf, set())
        dtype = vllm_config.model_config.dtype
        config = dataclasses.replace(config, dtype=dtype)
        self.converter, self.titan_config = converter, config
        device = torch.get_default_device()
        with torch.device("meta"):
            model = config.build()
        model.to_empty(device=device)
        model.init_buffers()
        self.model = model
        self.invariant = batch_invariant_requested()
        check_servable(model, batch_invariant=self.invariant)
        backend = None
        if self.invariant:
            from titan_rl.vllm.attention_backend import TitanBatchInvariantBackend
            backend = TitanBatchInvariantBackend
            batch_invariant(model)
        if config.qk_head_dim != config.v_head_dim:
            raise ValueError(f"the vLLM adapter runs attention with one head width; {type(config).__name__} has "
                             f"qk_head_dim={config.qk_head_dim}, v_head_dim={config.v_head_dim}")
        head_dim = config.qk_head_dim
        self.attn_layers = nn.ModuleList()
        for i in range(config.num_layers):
            ours = model.layers[str(i)].attention
            # gpt-oss: the layer's window (the last `sliding_window` keys, as vLLM counts them) and its sink
            # logits, the parameter itself so weight updates reach vLLM's kernel
            sinks = None if getattr(ours, "sinks", None) is None else ours.sinks.weight
            attn = Attention(config.num_heads, head_dim, ours.inner.scale, num_kv_heads=config.num_kv_heads,
                             cache_config=vllm_config.cache_config, quant_config=None,
                             per_layer_sliding_window=ours.inner.sliding_window,
                             prefix=f"{prefix}model.layers.{i}.self_attn.attn", attn_backend=backend,
                             **({} if sinks is None else {"sinks": sinks}))
            self.attn_layers.append(attn)
        for i, attn in enumerate(self.attn_layers):
            tm.override(model, f"layers.{i}.attention.inner", lambda _, old, attn=attn: VLLMInnerAttention(attn))
        # HF name -> titan state name, for checkpoints; titan names load as they are (weight sync).
        # Tensors stored in another layout on disk (gpt-oss's fused, interleaved, transposed experts) are
        # gathered and converted by the converter's `load`: HF name -> the titan tensors it holds.
        self._from_hf, self._laid_out = {}, {}
        for name, tensor in model.state_dict().items():
            if config.tie_embeddings and name == "output.weight":
                continue
            layout = converter.disk_layout(config, name, tuple(tensor.shape), set())
            for hf_name in (converter.hf_names(config, name) if layout is None else layout):
                if layout is None:
                    self._from_hf[hf_name] = name
                else:
                    self._laid_out.setdefault(hf_name, []).append(name)

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.tok_embeddings(input_ids)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, intermediate_tensors=None,
                inputs_embeds: torch.Tensor | None = None, **_) -> torch.Tensor:
        tokens = (inputs_embeds if inputs_embeds is not None else input_ids)[None]
        if inputs_embeds is not None:
            raise NotImplementedError("inputs_embeds is not supported by the titan vLLM model")
        return self.model.hidden_states(tokens, positions=positions[None])[0]  # [T, dim]

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.model.output(hidden_states).float()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Accepts Hugging Face names (checkpoints) and titan names (trainer weight sync)."""
        state = self.model.state_dict()
        loaded, gathered = set(), {}
        with torch.no_grad():
            for name, tensor in weights:
                if name in self._laid_out:
                    gathered[name] = tensor
                    continue
                titan = self._from_hf.get(name, name)
                if titan not in state:
                    if self.converter.ignorable(self.titan_config, name):
                        continue
                    raise ValueError(f"load_weights: unknown tensor {name!r}")
                if tuple(tensor.shape) != tuple(state[titan].shape):
                    raise ValueError(f"load_weights: {name!r} has shape {list(tensor.shape)}, "
                                     f"expected {list(state[titan].shape)}")
                state[titan].copy_(tensor)
                loaded.add(f"model.{titan}")
            for titan in sorted({t for hf_name in gathered for t in self._laid_out[hf_name]}):
                state[titan].copy_(self.converter.load(self.titan_config, titan, gathered, set(gathered)))
                loaded.add(f"model.{titan}")
        if self.titan_config.tie_embeddings and "model.tok_embeddings.weight" in loaded:
            loaded.add("model.output.weight")
        return loaded
