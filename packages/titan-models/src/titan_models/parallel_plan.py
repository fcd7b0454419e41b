"""Parallelism declared as data: the model says what may be split, a trainer decides how.

Patterns are module paths relative to the model with `*` standing for one path component (as in
`override`). Tensor-parallel styles, in words a trainer maps onto its library:

- "colwise": shard the Linear's output features (heads or hidden units) across ranks.
- "rowwise": shard the input features; the partial outputs are summed (or reduce-scattered).
- "embedding": shard the embedding table over the vocabulary; lookups are summed.
- "output": colwise over the vocabulary for the output projection (a loss may stay sharded).
- "sequence_parallel": a norm applied to activations sharded along the sequence dimension.
- "replicate": keep the parameters whole on every rank (small projections, per-head norms) applied to
  each rank's own heads or tokens: their gradients are summed over the ranks.
- "replicate_whole": keep the parameters whole on every rank, applied to activations every rank holds
  whole (MLA's latent projections of the gathered sequence): each rank's gradient is already the whole one.
- "headwise": shard every parameter of the module along dim 0 with no communication: per-head or
  per-channel parameters of a module whose projections are colwise (Gated DeltaNet's short convs and
  decay gate), so each rank keeps those of its own heads.

Attention reshapes with an inferred head count, so colwise q/k/v shards run unchanged with
num_heads / tp local heads.
"""
from __future__ import annotations

from dataclasses import dataclass, field

TP_STYLES: tuple[str, ...] = ("colwise", "rowwise", "embedding", "output", "sequence_parallel", "replicate",
                              "replicate_whole", "headwise")


@dataclass(kw_only=True, frozen=True)
class ParallelPlan:
    # module pattern -> tensor-parallel style (one of TP_STYLES)
    tensor_parallel: dict[str, str] = field(default_factory=dict)
    # modules holding routed experts (each a `GroupedExperts`: w1/w3 [E, ffn, dim], w2 [E, dim, ffn]);
    # the MoE modules around them are what an expert-parallel library overrides
    experts: tuple[str, ...] = ()
    moe: tuple[str, ...] = ()
    # a pipeline stage may start before any of these modules (in model order); the first stage
    # keeps `tok_embeddings`, the last keeps `norm` and `output` (and `mtp` where present)
    pipeline_cut_points: tuple[str, ...] = ()
    # the unit one activation checkpoint wraps
    activation_checkpoint_unit: str = "layers.*"
    # config field -> value a tensor-parallel degree must divide (the head counts the colwise splits cut)
    tp_divides: dict[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for pattern, style in self.tensor_parallel.items():
            if style not in TP_STYLES:
                raise ValueError(f"tensor-parallel style {style!r} for {pattern!r} is not one of {TP_STYLES}")

    def check_tensor_parallel(self, tp: int) -> None:
        """ValueError naming the first field `tp` does not divide (e.g. linear_num_key_heads=16 at tp=3)."""
        for name, value in self.tp_divides.items():
            if value % tp:
                raise ValueError(f"tensor parallel degree {tp} does not divide the model's {name}={value}")


GQA_ATTENTION = {"wq": "colwise", "wk": "colwise", "wv": "colwise", "wo": "rowwise"}
QK_NORM = {"q_norm": "replicate", "k_norm": "replicate"}
# Gated DeltaNet beside GQA (wq/wk/wv/wo shared with GQA_ATTENTION): value heads (wv, wz, wb, wa and
# the per-head convs/decay) split with their key heads, the gated output norm is per head dim.
GATED_DELTANET = {"wz": "colwise", "wb": "colwise", "wa": "colwise", "q_conv": "headwise", "k_conv": "headwise",
                  "v_conv": "headwise", "decay": "headwise", "norm": "replicate"}


def decoder_plan(*, num_layers: int, attention: dict[str, str], dense: bool = True, moe: bool = False,
                 shared_experts: bool = False) -> ParallelPlan:
    """The plan of a Transformer: `attention` maps the attention's projections (relative names) to
    styles; `dense` adds the dense blocks' feed_forward, `moe` the MoE blocks' router and routed
    experts, `shared_experts` their shared experts (patterns may match only some layers)."""
    tp = {"tok_embeddings": "embedding", "norm": "sequence_parallel", "output": "output",
          "layers.*.attention_norm": "sequence_parallel", "layers.*.ffn_norm": "sequence_parallel"}
    tp |= {f"layers.*.attention.{name}": style for name, style in attention.items()}
    if dense:
        tp |= {"layers.*.feed_forward.w1": "colwise", "layers.*.feed_forward.w3": "colwise",
               "layers.*.feed_forward.w2": "rowwise"}
    if moe:
        tp["layers.*.moe.router.gate"] = "replicate"
    if moe and shared_experts:
        tp |= {"layers.*.moe.shared_experts.w1": "colwise", "layers.*.moe.shared_experts.w3": "colwise",
               "layers.*.moe.shared_experts.w2": "rowwise"}
    return ParallelPlan(tensor_parallel=tp,
                        experts=("layers.*.moe.experts",) if moe else (),
                        moe=("layers.*.moe",) if moe else (),
                        pipeline_cut_points=tuple(f"layers.{i}" for i in range(1, num_layers)))
