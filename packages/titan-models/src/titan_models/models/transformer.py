"""The decoder-only Transformer every family builds: embeddings, a ModuleDict of pre-norm blocks,
final norm, output projection. Families differ only in the blocks their configs build."""
from __future__ import annotations

import contextlib
import math
import zlib
from typing import Any, Iterator

import torch
from torch import nn

from titan_models.components.attention import prepare_masks
from titan_models.components.rope import RotaryEmbedding
from titan_models.context import AttentionContext
from titan_models.parallel_plan import ParallelPlan


class TransformerBlock(nn.Module):
    """h = x + attention(attention_norm(x)); out = h + ffn(ffn_norm(h)), where ffn is either
    `feed_forward` (dense) or `moe`; the other attribute is None.

    Optional (Muse): `post_attention_norm` / `post_ffn_norm` normalise a branch's output before it
    joins the residual stream, and `attention_residual` / `ffn_residual` (ResidualGate) replace the
    plain sum with a learned blend `gate(residual, branch)`."""

    def __init__(self, *, attention: nn.Module, attention_norm: nn.Module, ffn_norm: nn.Module,
                 feed_forward: nn.Module | None = None, moe: nn.Module | None = None,
                 post_attention_norm: nn.Module | None = None, post_ffn_norm: nn.Module | None = None,
                 attention_residual: nn.Module | None = None, ffn_residual: nn.Module | None = None):
        super().__init__()
        assert (feed_forward is None) != (moe is None), "a block has either a dense FFN or a MoE"
        self.attention_norm = attention_norm
        self.attention = attention
        self.post_attention_norm = post_attention_norm
        self.attention_residual = attention_residual
        self.ffn_norm = ffn_norm
        self.feed_forward = feed_forward
        self.moe = moe
        self.post_ffn_norm = post_ffn_norm
        self.ffn_residual = ffn_residual

    @staticmethod
    def _join(x: torch.Tensor, branch: torch.Tensor, norm: nn.Module | None, gate: nn.Module | None) -> torch.Tensor:
        if norm is not None:
            branch = norm(branch)
        return gate(x, branch) if gate is not None else x + branch

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], *,
                context: AttentionContext | None = None) -> torch.Tensor:
        h = self._join(x, self.attention(self.attention_norm(x), rope, context=context),
                       self.post_attention_norm, self.attention_residual)
        ffn = self.moe if self.moe is not None else self.feed_forward
        return self._join(h, ffn(self.ffn_norm(h)), self.post_ffn_norm, self.ffn_residual)


class Transformer(nn.Module):
    """`model(tokens [b, s]) -> logits [b, s, vocab]` (see docs/conventions.md).

    For pipeline stages `tok_embeddings`, `norm` and `output` may be set to None: a stage without
    embeddings takes hidden states [b, s, dim] in place of tokens, one without `output` returns
    hidden states.
    """

    def __init__(self, *, config: Any, vocab_size: int, dim: int, blocks: list[TransformerBlock],
                 norm: nn.Module, rope: RotaryEmbedding, tie_embeddings: bool, parallel_plan: ParallelPlan,
                 embedding_norm: nn.Module | None = None, logit_scale: float = 1.0,
                 logit_softcap: float | None = None):
        """embedding_norm: applied to the looked-up embeddings (Muse). The logits are
        `logit_softcap * tanh(output(h) * logit_scale / logit_softcap)` when `logit_softcap` is set,
        else `output(h) * logit_scale` (Muse: `output_multiplier`, `final_logit_softcapping`)."""
        super().__init__()
        if logit_softcap is not None and logit_softcap <= 0:
            raise ValueError(f"logit_softcap must be positive or None, got {logit_softcap}")
        self.config = config
        self.embedding_norm = embedding_norm
        self.logit_scale, self.logit_softcap = logit_scale, logit_softcap
        self.parallel_plan = parallel_plan
        self.tie_embeddings = tie_embeddings
        self.tok_embeddings: nn.Embedding | None = nn.Embedding(vocab_size, dim)
        self.rope = rope
        self.layers = nn.ModuleDict({str(i): block for i, block in enumerate(blocks)})
        self.norm: nn.Module | None = norm
        self.output: nn.Linear | None = nn.Linear(dim, vocab_size, bias=False)
        self._tie()

    def _tie(self) -> None:
        if self.tie_embeddings and self.tok_embeddings is not None and self.output is not None:
            self.output.weight = self.tok_embeddings.weight

    # --- forward -----------------------------------------------------------------------------

    def _trunk(self, tokens: torch.Tensor, positions: torch.Tensor | None, context: AttentionContext | None
               ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """(hidden states after the last block and final norm, the RoPE cos/sin used)."""
        if self.tok_embeddings is not None:
            h = self.tok_embeddings(tokens)
            if self.embedding_norm is not None:
                h = self.embedding_norm(h)
        else:
            h = tokens
        return self._blocks(h, positions, context)

    def _blocks(self, h: torch.Tensor, positions: torch.Tensor | None, context: AttentionContext | None
                ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """The blocks and final norm over embeddings h [b, s, dim] (and the RoPE cos/sin used)."""
        if positions is None:
            batch, seq = h.shape[:2]
            positions = torch.arange(seq, device=h.device).expand(batch, seq)
        # apply_rotary casts cos/sin to the activations' dtype: cast once here, not in every block.
        rope = tuple(t.to(h.dtype) for t in self.rope(positions))
        prepare_masks(self.layers, h.shape[0], h.shape[1], h.device, context)
        for block in self.layers.values():
            h = block(h, rope, context=context)
        return (self.norm(h) if self.norm is not None else h), rope

    def hidden_states(self, tokens: torch.Tensor, *, positions: torch.Tensor | None = None,
                      context: AttentionContext | None = None) -> torch.Tensor:
        """Final normed hidden states [b, s, dim], without the output projection (for chunked losses)."""
        return self._trunk(tokens, positions, context)[0]

    def forward(self, tokens: torch.Tensor, *, positions: torch.Tensor | None = None,
                context: AttentionContext | None = None) -> torch.Tensor:
        h = self.hidden_states(tokens, positions=positions, context=context)
        return self.logits(self.output(h)) if self.output is not None else h

    def logits(self, raw: torch.Tensor) -> torch.Tensor:
        """The output projection's result `raw` scaled and soft-capped as the model defines (identity for most)."""
        if self.logit_scale != 1.0:
            raw = raw * self.logit_scale
        if self.logit_softcap is not None:
            raw = torch.tanh(raw / self.logit_softcap) * self.logit_softcap
        return raw

    def pipeline_stage(self, layer_names: tuple[str, ...], *, first: bool, last: bool) -> "Transformer":
        """A model of the same type over some of this one's modules (shared, not copied): `layer_names`,
        the embedding when `first`, the final norm and output when `last` (the others None). Other modules
        (DeepSeek-V3's MTP) are left out; a subclass whose forward needs more adds it."""
        stage = type(self).__new__(type(self))  # a fresh module (own hooks and state), not a copy
        nn.Module.__init__(stage)
        stage.config, stage.parallel_plan, stage.tie_embeddings = self.config, self.parallel_plan, False
        stage.tok_embeddings = self.tok_embeddings if first else None
        stage.embedding_norm = self.embedding_norm if first else None
        stage.logit_scale, stage.logit_softcap = self.logit_scale, self.logit_softcap
        stage.rope = self.rope
        stage.layers = nn.ModuleDict({name: self.layers[name] for name in layer_names})
        stage.norm = self.norm if last else None
        stage.output = self.output if last else None
        return stage

    # --- initialisation and device moves ------------------------------------------------------

    def _apply(self, fn, recurse: bool = True):
        # Keep float32 buffers (RoPE frequencies, expert bias) in float32 under model.to(bf16);
        # recompute them after a meta -> device move (to_empty leaves garbage, and checkpoints do
        # not hold RoPE frequencies); restore weight tying, which that move also breaks.
        fp32 = {(mod, name): buf for mod, name, buf in self._fp32_buffers()}
        result = super()._apply(fn, recurse)
        for (mod, name), old in fp32.items():
            new = mod._buffers[name]
            if new is not None and new.dtype != torch.float32:
                mod._buffers[name] = (torch.empty_like(old, device=new.device) if old.is_meta
                                      else old.to(device=new.device))
        for mod, name in {(mod, name) for (mod, name), old in fp32.items() if old.is_meta}:
            if not mod._buffers[name].is_meta and hasattr(mod, "reset_buffers"):
                mod.reset_buffers()
        self._tie()
        return result

    def _fp32_buffers(self) -> Iterator[tuple[nn.Module, str, torch.Tensor]]:
        for mod in self.modules():
            for name, buf in mod._buffers.items():
                if buf is not None and buf.dtype == torch.float32 and name in _FP32_BUFFERS:
                    yield mod, name, buf

    @torch.no_grad()
    def init_weights(self, *, seed: int = 0) -> None:
        """Initialise every parameter and buffer, deterministically for a given seed.

        Each parameter draws from its own generator seeded by (seed, its name), so the values do
        not depend on which other modules exist: a pipeline stage holding layers 8..15 gets the
        same weights as the full model. Scheme: projection biases zero; embeddings N(0, 1) (N(0, dim^-1/2)
        when tied); output N(0, dim^-1/2); norms ones (zero-centred norms zeros; biases zero); a module's own
        `init_parameter(name, param, generator)` where it returns True (Gated DeltaNet's decay); projections that write into the residual
        stream (wo, w2) N(0, 0.02 / sqrt(2 * num_layers)); every other matrix N(0, 0.02); normals
        truncated at 3 std.
        """
        dim = self.config.dim
        depth_std = 0.02 / math.sqrt(2 * max(1, self.config.num_layers))
        for name, param in self.named_parameters():
            owner, _, pname = name.rpartition(".")
            leaf = owner.rpartition(".")[2]  # e.g. "attention_norm", "wo", "experts"
            module = self.get_submodule(owner)
            generator = torch.Generator(device=param.device)
            generator.manual_seed(zlib.crc32(f"{seed}:{name}".encode()))
            if hasattr(module, "init_parameter"):  # a module with its own scheme for some parameters
                if module.init_parameter(pname, param, generator):
                    continue
            if pname == "bias" or pname.endswith("_bias"):  # projection biases (gpt-oss) start at zero
                param.zero_()
                continue
            if leaf.endswith("norm") or leaf in _NORM_LEAVES:
                if name.endswith("bias"):
                    param.zero_()
                else:
                    param.fill_(getattr(module, "init_value", 1.0))  # zero-centred norms start at 0
                continue
            if name.startswith("tok_embeddings"):
                std = dim**-0.5 if self.tie_embeddings else 1.0
            elif name.startswith("output"):
                std = dim**-0.5
            elif leaf in ("wo", "w2") or pname == "w2":
                std = depth_std
            else:
                std = 0.02
            nn.init.trunc_normal_(param, mean=0.0, std=std, a=-3 * std, b=3 * std, generator=generator)
        self.init_buffers()

    @torch.no_grad()
    def init_buffers(self) -> None:
        """Recompute derived buffers (RoPE frequencies) and zero the others (expert bias, counts)."""
        for module in self.modules():
            reset = getattr(module, "reset_buffers", None)
            if reset is not None:
                reset()


# Buffers kept in float32 whatever dtype the parameters get.
_FP32_BUFFERS = ("inv_freq", "expert_bias", "tokens_per_expert")
# Norm modules whose attribute name does not end in "norm" (MTP's embedding/hidden norms).
_NORM_LEAVES = ("enorm", "hnorm")


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype):
    """Build parameters directly in `dtype` (buffers that need float32 ask for it explicitly)."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)
