"""DeepSeek-V3: multi-head latent attention, leading dense layers then MoE layers (sigmoid
group-limited routing with the aux-loss-free bias, shared experts, routed scaling), YaRN RoPE,
and an optional multi-token-prediction (MTP) module."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import ClassVar

import torch
from torch import nn

from titan_models.components.attention import AttentionBackend
from titan_models.components.ffn import FeedForwardConfig
from titan_models.components.mla import MLAConfig
from titan_models.components.moe import MoEConfig
from titan_models.components.norms import NormConfig, RMSNormConfig
from titan_models.components.rope import RopeConfig, YarnRopeScaling
from titan_models.context import AttentionContext
from titan_models.model_config import LatentAttentionHeads, ModelConfigBase
from titan_models.models.transformer import Transformer, TransformerBlock, default_dtype
from titan_models.parallel_plan import ParallelPlan, decoder_plan


@dataclass(kw_only=True)
class DeepSeekV3Config(LatentAttentionHeads, ModelConfigBase):
    family: ClassVar[str] = "deepseek_v3"

    vocab_size: int
    dim: int
    num_layers: int
    num_heads: int
    ffn_dim: int  # the leading dense layers' hidden width
    first_k_dense: int  # layers 0 .. first_k_dense-1 are dense, the rest MoE
    moe: MoEConfig
    q_lora_rank: int | None
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    norm: NormConfig = field(default_factory=lambda: RMSNormConfig(eps=1e-6))
    rope_theta: float = 10000.0
    rope_scaling: YarnRopeScaling | None = None
    rope_interleave: bool = True  # the layout of DeepSeek's released weights
    max_seq_len: int = 163840
    mtp: bool = False  # one multi-token-prediction module (DeepSeek-V3 trains with one)
    tie_embeddings: bool = False
    attention: AttentionBackend = "sdpa"
    dtype: torch.dtype = torch.float32

    def is_moe_layer(self, i: int) -> bool:
        return i >= self.first_k_dense

    def with_num_layers(self, n: int) -> DeepSeekV3Config:
        return dataclasses.replace(self, num_layers=n, first_k_dense=min(self.first_k_dense, n))

    def mla(self) -> MLAConfig:
        scale = self.rope_scaling.softmax_scale_factor() if self.rope_scaling is not None else 1.0
        return self.latent_attention(rope_interleave=self.rope_interleave, softmax_scale_factor=scale)

    def _block(self, i: int) -> TransformerBlock:
        mlp = ({"moe": self.moe.build(self.dim)} if self.is_moe_layer(i)
               else {"feed_forward": FeedForwardConfig(hidden_dim=self.ffn_dim).build(self.dim)})
        return TransformerBlock(attention=self.mla().build(self.dim), attention_norm=self.norm.build(self.dim),
                                ffn_norm=self.norm.build(self.dim), **mlp)

    def build(self) -> "DeepSeekV3Transformer":
        rope = RopeConfig(dim=self.qk_rope_head_dim, theta=self.rope_theta, scaling=self.rope_scaling,
                          interleaved=self.rope_interleave)
        with default_dtype(self.dtype):
            blocks = [self._block(i) for i in range(self.num_layers)]
            model = self._transformer(config=self, vocab_size=self.vocab_size, dim=self.dim, blocks=blocks,
                                      norm=self.norm.build(self.dim), rope=rope.build(),
                                      tie_embeddings=self.tie_embeddings, parallel_plan=self.parallel_plan())
            if self.mtp:
                model.mtp = MultiTokenPrediction(dim=self.dim, norm=self.norm,
                                                 block=self._block(max(self.num_layers, self.first_k_dense)))
        return model

    def _transformer(self, **kwargs) -> "DeepSeekV3Transformer":
        """The model class around the blocks (Kimi K2.x adds its vision tower here)."""
        return DeepSeekV3Transformer(**kwargs)

    def parallel_plan(self) -> ParallelPlan:
        # the latent projections and norms see the gathered sequence whole on every tp rank
        mla = {"wkv_a": "replicate_whole", "kv_norm": "replicate_whole", "wkv_b": "colwise", "wo": "rowwise"}
        mla |= ({"wq_a": "replicate_whole", "q_norm": "replicate_whole", "wq_b": "colwise"} if self.q_lora_rank
                else {"wq": "colwise"})
        plan = decoder_plan(num_layers=self.num_layers, attention=mla, dense=self.first_k_dense > 0,
                            moe=self.first_k_dense < self.num_layers or self.mtp,
                            shared_experts=self.moe.num_shared_experts > 0)
        if not self.mtp:
            return plan
        # the MTP block is split like the others and lives on the last pipeline stage
        tp = dict(plan.tensor_parallel)
        tp |= {k.replace("layers.*.", "mtp.layer.", 1): v for k, v in plan.tensor_parallel.items()
               if k.startswith("layers.*.") and ".feed_forward." not in k}  # the MTP block is a MoE block
        tp |= {"mtp.enorm": "sequence_parallel", "mtp.hnorm": "sequence_parallel", "mtp.norm": "sequence_parallel",
               "mtp.eh_proj": "replicate"}
        return ParallelPlan(tensor_parallel=tp, experts=plan.experts + ("mtp.layer.moe.experts",),
                            moe=plan.moe + ("mtp.layer.moe",), pipeline_cut_points=plan.pipeline_cut_points,
                            activation_checkpoint_unit=plan.activation_checkpoint_unit)


class MultiTokenPrediction(nn.Module):
    """DeepSeek-V3's MTP module (depth 1): from the main model's final hidden state at i and the
    embedding of token i+1, predict token i+2.

        h' = block(eh_proj([enorm(embed(t[i+1])) ; hnorm(h[i])]))      -> output(norm(h'))

    It shares the embedding table and output projection with the main model (they are not its
    parameters). The concatenation order and the use of the final-normed main hidden state follow
    the released DeepSeek-V3 weights as inference engines (vLLM) apply them.
    """

    def __init__(self, *, dim: int, norm: NormConfig, block: TransformerBlock):
        super().__init__()
        self.enorm = norm.build(dim)
        self.hnorm = norm.build(dim)
        self.eh_proj = nn.Linear(2 * dim, dim, bias=False)
        self.layer = block
        self.norm = norm.build(dim)

    def forward(self, hidden: torch.Tensor, next_embeddings: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                *, context: AttentionContext | None = None) -> torch.Tensor:
        h = self.eh_proj(torch.cat([self.enorm(next_embeddings), self.hnorm(hidden)], dim=-1))
        return self.norm(self.layer(h, rope, context=context))


class DeepSeekV3Transformer(Transformer):
    """A Transformer with an optional `mtp` module; `forward` is the main model only."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.mtp: MultiTokenPrediction | None = None

    def forward_with_mtp(self, tokens: torch.Tensor, *, positions: torch.Tensor | None = None,
                         context: AttentionContext | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(logits [b, s, vocab], mtp_logits [b, s, vocab]) where mtp_logits[:, i] predicts tokens[:, i + 2].

        Only positions i < s - 2 have a target: a trainer adds
        `lambda * cross_entropy(mtp_logits[:, :-2], tokens[:, 2:])` to the main next-token loss
        (DeepSeek-V3 used lambda = 0.3, then 0.1). With packed documents, also mask positions whose
        token i + 2 lies in another document. The MTP input at the last position pairs h[s-1] with
        the embedding of tokens[:, 0] (a wrap-around filler): it has no target and, attention being
        causal, affects no other position. Keeping length s lets the same positions and attention
        context (document masks) serve both passes.
        """
        next_embeddings = self.tok_embeddings(tokens.roll(-1, dims=1))
        hidden, mtp_hidden = self.hidden_states_with_mtp(tokens, next_embeddings, positions=positions, context=context)
        return self.output(hidden), self.output(mtp_hidden)

    def hidden_states_with_mtp(self, tokens: torch.Tensor, next_embeddings: torch.Tensor, *,
                               positions: torch.Tensor | None = None, context: AttentionContext | None = None
                               ) -> tuple[torch.Tensor, torch.Tensor]:
        """(final normed hidden states [b, s, dim], the MTP module's [b, s, dim]) without the output projection
        (for chunked losses); next_embeddings [b, s, dim]: the embedding of token i + 1 at position i."""
        if self.mtp is None:
            raise ValueError("this model was built without an MTP module (DeepSeekV3Config.mtp=False)")
        hidden, rope = self._trunk(tokens, positions, context)
        return hidden, self.mtp(hidden, next_embeddings.to(hidden.dtype), rope, context=context)
