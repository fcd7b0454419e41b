"""DeepSeek-V4: manifold-constrained hyper-connections around every block, attention over a shared
key=value head with sliding-window, compressed-sparse (indexer top-k) and heavily-compressed layers
(`layer_types`), hash-routed then top-k MoE layers (`mlp_layer_types`, sqrt-softplus scores, clamped
SwiGLU experts and shared expert), RoPE on the trailing dims as interleaved pairs, with its own
(YaRN-scaled) RoPE for the compressed layers, and an optional multi-token-prediction (MTP) module."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import ClassVar

import torch
from torch import nn

from titan_models.components.attention import AttentionBackend
from titan_models.components.compressed_attention import ATTENTION_KINDS, CompressedAttentionConfig
from titan_models.components.ffn import ClampedSwiGLU
from titan_models.components.hyper_connections import HyperConnection, HyperHead, merge_streams
from titan_models.components.moe import MoEConfig
from titan_models.components.norms import RMSNorm
from titan_models.components.rope import RopeConfig, RotaryEmbedding, YarnRopeScaling
from titan_models.context import AttentionContext
from titan_models.model_config import ModelConfigBase, SharedHeadDim
from titan_models.models.transformer import Transformer, default_dtype
from titan_models.parallel_plan import ParallelPlan, decoder_plan

MLP_KINDS: tuple[str, ...] = ("hash_moe", "moe")


def _default_compress_yarn() -> YarnRopeScaling:
    # the releases: 64k original context x 16, applied only to the compressed layers, cos/sin unscaled
    return YarnRopeScaling(factor=16.0, original_max_seq_len=65536, explicit_attention_factor=1.0)


@dataclass(kw_only=True)
class DeepSeekV4Config(SharedHeadDim, ModelConfigBase):
    """`layer_types[i]` in ATTENTION_KINDS, `mlp_layer_types[i]` in MLP_KINDS (None: Hugging Face's
    defaults, three heavily compressed layers then alternating sparse / heavy; three hash layers)."""

    family: ClassVar[str] = "deepseek_v4"

    vocab_size: int
    dim: int
    num_layers: int
    num_heads: int
    head_dim: int = 512
    rope_dim: int = 64  # trailing channels of each head that rotate (head_dim * partial_rotary_factor)
    q_lora_rank: int = 1024
    o_groups: int = 8
    o_lora_rank: int = 1024
    sliding_window: int = 128
    layer_types: tuple[str, ...] | None = None
    compress_rates: dict[str, int] = field(default_factory=lambda: {
        "compressed_sparse_attention": 4, "heavily_compressed_attention": 128})
    index_n_heads: int = 64
    index_head_dim: int = 128
    index_topk: int = 512
    mlp_layer_types: tuple[str, ...] | None = None
    moe: MoEConfig  # the top-k layers' routing; hash layers share its experts' shapes
    hc_mult: int = 4
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1e-6
    norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    compress_rope_theta: float = 160000.0
    compress_rope_scaling: YarnRopeScaling | None = field(default_factory=_default_compress_yarn)
    max_seq_len: int = 1048576
    mtp: bool = False  # one multi-token-prediction module (the releases ship one: num_nextn_predict_layers 1)
    tie_embeddings: bool = False
    attention: AttentionBackend = "eager"  # sinks and compressed entries: the eager path only
    dtype: torch.dtype = torch.float32

    num_kv_heads: ClassVar[int] = 1  # one shared key=value head

    @property
    def ffn_dim(self) -> int:
        return self.moe.expert_dim  # no dense layers

    @property
    def resolved_layer_types(self) -> tuple[str, ...]:
        if self.layer_types is not None:
            return tuple(self.layer_types)
        rest = ("compressed_sparse_attention" if i % 2 else "heavily_compressed_attention"
                for i in range(max(self.num_layers - 2, 0)))
        return (("heavily_compressed_attention",) * min(self.num_layers, 2) + tuple(rest))[: self.num_layers]

    @property
    def resolved_mlp_layer_types(self) -> tuple[str, ...]:
        if self.mlp_layer_types is not None:
            return tuple(self.mlp_layer_types)
        return tuple("hash_moe" if i < 3 else "moe" for i in range(self.num_layers))

    def with_num_layers(self, n: int) -> "DeepSeekV4Config":
        return dataclasses.replace(self, num_layers=n, layer_types=self.resolved_layer_types[:n],
                                   mlp_layer_types=self.resolved_mlp_layer_types[:n])

    def _validate(self) -> None:
        for name, types, allowed in (("layer_types", self.resolved_layer_types, ATTENTION_KINDS),
                                     ("mlp_layer_types", self.resolved_mlp_layer_types, MLP_KINDS)):
            if len(types) != self.num_layers:
                raise ValueError(f"{name} has {len(types)} entries; num_layers={self.num_layers} needs one per layer")
            unknown = sorted(set(types) - set(allowed))
            if unknown:
                raise ValueError(f"{name} holds unknown entries {unknown}; allowed: {list(allowed)}")
        for kind in set(self.resolved_layer_types) - {"sliding_attention"}:
            if self.compress_rates.get(kind, 0) < 1:
                raise ValueError(f"compress_rates[{kind!r}] must be an integer >= 1 (layer_types uses it), "
                                 f"got {self.compress_rates.get(kind)}")
        for name in ("hc_mult", "hc_sinkhorn_iters", "sliding_window", "index_topk", "o_groups"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")

    def attention_config(self, kind: str) -> CompressedAttentionConfig:
        return CompressedAttentionConfig(
            kind=kind, num_heads=self.num_heads, head_dim=self.head_dim, rope_dim=self.rope_dim,
            q_lora_rank=self.q_lora_rank, o_groups=self.o_groups, o_lora_rank=self.o_lora_rank,
            sliding_window=self.sliding_window, compress_rate=self.compress_rates.get(kind, 0),
            index_n_heads=self.index_n_heads, index_head_dim=self.index_head_dim, index_topk=self.index_topk,
            norm_eps=self.norm_eps)

    def moe_config(self, kind: str) -> MoEConfig:
        return dataclasses.replace(self.moe, hash_vocab_size=self.vocab_size if kind == "hash_moe" else None)

    def build(self) -> "DeepSeekV4Transformer":
        self._validate()
        main = RopeConfig(dim=self.rope_dim, theta=self.rope_theta)
        compress = RopeConfig(dim=self.rope_dim, theta=self.compress_rope_theta, scaling=self.compress_rope_scaling)
        with default_dtype(self.dtype):
            blocks = [DeepSeekV4Block(self, kind, mlp) for kind, mlp in
                      zip(self.resolved_layer_types, self.resolved_mlp_layer_types)]
            model = DeepSeekV4Transformer(config=self, vocab_size=self.vocab_size, dim=self.dim, blocks=blocks,
                                          norm=RMSNorm(self.dim, eps=self.norm_eps), rope=main.build(),
                                          compress_rope=compress.build(), tie_embeddings=self.tie_embeddings,
                                          parallel_plan=self.parallel_plan())
            if self.mtp:
                model.mtp = DeepSeekV4MultiTokenPrediction(self)
            return model

    def parallel_plan(self) -> ParallelPlan:
        """Expert parallelism for the routed experts and a pipeline cut point before every layer; no tensor
        parallelism yet. transformers' own plan replicates the shared key=value head and the compressors;
        splitting the query heads (wq_b colwise, sinks and the grouped wo_a by head group, wo_b rowwise) would
        also need the replicated projections feeding them (wq_a, wkv, compressors) to get whole-gradient
        handling the trainer's styles do not give, so any degree > 1 is refused, naming num_kv_heads=1."""
        plan = decoder_plan(num_layers=self.num_layers, attention={}, dense=False, moe=True)
        if self.mtp:
            plan = dataclasses.replace(plan, experts=plan.experts + ("mtp.layer.moe.experts",),
                                       moe=plan.moe + ("mtp.layer.moe",))
        return dataclasses.replace(plan, tensor_parallel={}, tp_divides={"num_kv_heads": 1})


def deepseek_v4_moe(*, num_experts: int, top_k: int, expert_dim: int, route_scale: float = 1.5,
                    swiglu_limit: float = 10.0, score_func: str = "sqrtsoftplus") -> MoEConfig:
    """DeepSeek-V4's experts: sqrt-softplus scores (renormalised, x route_scale), one shared expert of
    the routed width, clamped plain SwiGLU (`silu(min(g, L)) * clamp(u, -L, L)`) for all of them."""
    return MoEConfig(num_experts=num_experts, top_k=top_k, expert_dim=expert_dim, num_shared_experts=1,
                     score_func=score_func, route_scale=route_scale,
                     activation=ClampedSwiGLU(limit=swiglu_limit, alpha=1.0, up_shift=0.0))


class DeepSeekV4Block(nn.Module):
    """streams [b, s, hc_mult, dim] -> the same: attention then MoE, each inside a hyper-connection."""

    def __init__(self, config: DeepSeekV4Config, kind: str, mlp_kind: str):
        super().__init__()
        hc = dict(streams=config.hc_mult, sinkhorn_iters=config.hc_sinkhorn_iters, eps=config.hc_eps,
                  norm_eps=config.norm_eps)
        self.kind = kind
        self.attention_hc = HyperConnection(config.dim, **hc)
        self.attention_norm = RMSNorm(config.dim, eps=config.norm_eps)
        self.attention = config.attention_config(kind).build(config.dim)
        self.ffn_hc = HyperConnection(config.dim, **hc)
        self.ffn_norm = RMSNorm(config.dim, eps=config.norm_eps)
        self.moe = config.moe_config(mlp_kind).build(config.dim)
        self.feed_forward = None

    def forward(self, streams: torch.Tensor, ropes: dict, *, positions: torch.Tensor, token_ids: torch.Tensor | None,
                entry_rope: RotaryEmbedding, context: AttentionContext | None = None) -> torch.Tensor:
        rope = ropes["main" if self.kind == "sliding_attention" else "compress"]
        post, comb, collapsed = self.attention_hc(streams)
        out = self.attention(self.attention_norm(collapsed), rope, positions=positions, entry_rope=entry_rope,
                             context=context)
        streams = merge_streams(streams, out, post, comb)
        post, comb, collapsed = self.ffn_hc(streams)
        return merge_streams(streams, self.moe(self.ffn_norm(collapsed), token_ids=token_ids), post, comb)


class DeepSeekV4MultiTokenPrediction(nn.Module):
    """DeepSeek-V4's MTP module (depth 1): from the main model's streams after its last block (before its
    `hc_head`) at position i and the embedding of token i + 1, predict token i + 2:

        streams' = layer(h_proj(hnorm(streams)) + e_proj(enorm(embed(t[i+1]))))   -> norm(hc_head(streams'))

    each stream normed and projected alone, the projected embedding added to every stream; `layer` is a
    sliding-window (uncompressed) attention + top-k MoE block of the main model's shapes; the module has its
    own `hc_head`. It shares the embedding table and output projection with the main model. Names and wiring
    follow DeepSeek's release (`mtp.0.{e_proj,h_proj,enorm,hnorm,norm,hc_head_*,attn.*,ffn.*}`) as inference
    engines apply it; transformers 5.20 does not build V4's MTP (it drops `mtp.*` on load)."""

    def __init__(self, config: DeepSeekV4Config):
        super().__init__()
        self.enorm = RMSNorm(config.dim, eps=config.norm_eps)
        self.hnorm = RMSNorm(config.dim, eps=config.norm_eps)
        self.e_proj = nn.Linear(config.dim, config.dim, bias=False)
        self.h_proj = nn.Linear(config.dim, config.dim, bias=False)
        self.layer = DeepSeekV4Block(config, "sliding_attention", "moe")
        self.hc_head = HyperHead(config.dim, streams=config.hc_mult, eps=config.hc_eps, norm_eps=config.norm_eps)
        self.norm = RMSNorm(config.dim, eps=config.norm_eps)

    def forward(self, streams: torch.Tensor, next_embeddings: torch.Tensor, ropes: dict, *, positions: torch.Tensor,
                entry_rope: RotaryEmbedding, context: AttentionContext | None = None) -> torch.Tensor:
        """streams [b, s, hc_mult, dim], next_embeddings [b, s, dim] -> normed hidden states [b, s, dim]."""
        h = self.h_proj(self.hnorm(streams)) + self.e_proj(self.enorm(next_embeddings)).unsqueeze(2)
        h = self.layer(h, ropes, positions=positions, token_ids=None, entry_rope=entry_rope, context=context)
        return self.norm(self.hc_head(h))


class DeepSeekV4Transformer(Transformer):
    """Transformer whose residual is `hc_mult` streams: the embedding is copied into each, the blocks
    mix them, `hc_head` collapses them before the final norm. A pipeline stage without embeddings takes
    streams [b, s, hc_mult, dim] (hash layers then need `token_ids=`). With `mtp` (a module the config
    builds), `hidden_states_with_mtp` / `forward_with_mtp` also run the MTP module; `forward` is the main
    model only."""

    def __init__(self, *, compress_rope: RotaryEmbedding, **kwargs):
        super().__init__(**kwargs)
        config = self.config
        self.compress_rope = compress_rope
        self.hc_head: HyperHead | None = HyperHead(config.dim, streams=config.hc_mult, eps=config.hc_eps,
                                                   norm_eps=config.norm_eps)
        self.mtp: DeepSeekV4MultiTokenPrediction | None = None

    def pipeline_stage(self, layer_names: tuple[str, ...], *, first: bool, last: bool) -> "DeepSeekV4Transformer":
        stage = super().pipeline_stage(layer_names, first=first, last=last)
        stage.compress_rope = self.compress_rope
        stage.hc_head = self.hc_head if last else None
        stage.mtp = None  # a pipeline's last stage takes it (titan-train's pipeline hands it over)
        return stage

    def _trunk(self, tokens: torch.Tensor, positions: torch.Tensor | None, context: AttentionContext | None,
               token_ids: torch.Tensor | None = None):
        h, ropes, _ = self._streams(tokens, positions, context, token_ids)
        if self.norm is None:
            return h, ropes["main"]
        return self.norm(self.hc_head(h)), ropes["main"]

    def hidden_states_with_mtp(self, tokens: torch.Tensor, next_embeddings: torch.Tensor, *,
                               positions: torch.Tensor | None = None, context: AttentionContext | None = None
                               ) -> tuple[torch.Tensor, torch.Tensor]:
        """(final normed hidden states [b, s, dim], the MTP module's [b, s, dim]); next_embeddings [b, s, dim]
        hold the embedding of token i + 1 at position i (see DeepSeekV3Transformer.forward_with_mtp for the
        targets and the wrap-around filler at the last position)."""
        if self.mtp is None:
            raise ValueError("this model was built without an MTP module (DeepSeekV4Config.mtp=False)")
        streams, ropes, positions = self._streams(tokens, positions, context)
        hidden = self.norm(self.hc_head(streams))
        mtp_hidden = self.mtp(streams, next_embeddings.to(streams.dtype), ropes, positions=positions,
                              entry_rope=self.compress_rope, context=context)
        return hidden, mtp_hidden

    def forward_with_mtp(self, tokens: torch.Tensor, *, positions: torch.Tensor | None = None,
                         context: AttentionContext | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(logits [b, s, vocab], mtp_logits [b, s, vocab]) where mtp_logits[:, i] predicts tokens[:, i + 2]."""
        next_embeddings = self.tok_embeddings(tokens.roll(-1, dims=1))
        hidden, mtp_hidden = self.hidden_states_with_mtp(tokens, next_embeddings, positions=positions, context=context)
        return self.output(hidden), self.output(mtp_hidden)

    def _streams(self, tokens: torch.Tensor, positions: torch.Tensor | None, context: AttentionContext | None,
                 token_ids: torch.Tensor | None = None) -> tuple[torch.Tensor, dict, torch.Tensor]:
        """(the streams after the last block, the main and compress RoPE tables, the positions used)."""
        if self.tok_embeddings is not None:
            token_ids = tokens
            h = self.tok_embeddings(tokens).unsqueeze(2).expand(-1, -1, self.config.hc_mult, -1).contiguous()
        else:
            h = tokens
        if positions is None:
            batch, seq = h.shape[:2]
            positions = torch.arange(seq, device=h.device).expand(batch, seq)
        ropes = {"main": self.rope(positions), "compress": self.compress_rope(positions)}
        for block in self.layers.values():
            h = block(h, ropes, positions=positions, token_ids=token_ids, entry_rope=self.compress_rope,
                      context=context)
        return h, ropes, positions
