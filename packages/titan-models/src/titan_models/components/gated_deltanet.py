"""Gated DeltaNet (Yang, Kautz and Hatamizadeh, arXiv 2412.06464): linear attention whose state is
updated by the gated delta rule, as Qwen3-Next and Qwen3.5 use it.

Per value head, with a state S [key_dim, value_dim] and for each token t:

    S <- exp(g_t) * S                                  decay gate g_t = -exp(A_log) * softplus(a_t + dt_bias)
    S <- S + k_t (beta_t * (v_t - S^T k_t))^T          delta rule, beta_t = sigmoid(b_t)
    o_t = S^T q_t

q and k come L2-normalised (q also scaled by key_dim^-1/2) from a short causal depthwise conv
(kernel `conv_kernel`, SiLU) over [q | k | v]. The output passes a gated RMSNorm (`norm(o) * silu(z)`)
and `wo`. Key heads are shared by `num_value_heads / num_key_heads` consecutive value heads (GQA-like).

Kimi Delta Attention (Kimi Linear, arXiv 2510.26692) is this layer with three options: a decay per key
channel (`decay_per_channel`: g_t [Hv, dk], S <- diag(exp(g_t)) S), the decay input and the output gate
as low-rank projections (`gate_rank`), and a sigmoid-gated output norm (`output_gate="sigmoid"`).

Two forms compute the same recurrence: `chunked_delta_rule` (chunks of `chunk_size` tokens solved in
parallel with a triangular solve, then a scan over chunks; training and prefill) and
`recurrent_delta_rule` (token by token; decode). Both run in float32. On CUDA the chunked one runs as
Triton kernels (titan_models/kernels/gated_delta_rule.py, forward and backward, same signature) where
they fit, as `GatedDeltaNetConfig.delta_rule_backend` chooses; bf16 projections give them bf16 q, k, v
(state and gates stay float32).

Packed documents: `context.document_ids` [b, s] splits rows into documents (a new document starts
wherever the id changes from the previous token). The conv never reads across a boundary and the
recurrent state restarts from zero at each one, so a document gives what it gives alone.

Decode state: set `context.recurrent_states` to a dict (kept across calls) and each layer reads its
`GatedDeltaNetState` from `recurrent_states[layer]` (absent: zeros) and writes its final state back.
The state after a call is the state after the row's last token (of its last document);
`context.valid_tokens` [b, s] (False = right padding) makes it the state after the last valid token.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from titan_models.components.norms import GatedRMSNorm
from titan_models.components.projections import project
from titan_models.context import AttentionContext
from titan_models.kernels.gated_delta_rule import BACKENDS as DELTA_RULE_BACKENDS
from titan_models.kernels.gated_delta_rule import triton_chunked_delta_rule, use_triton


@dataclass(kw_only=True, frozen=True)
class GatedDeltaNetConfig:
    num_key_heads: int
    num_value_heads: int  # a multiple of num_key_heads
    key_head_dim: int
    value_head_dim: int
    conv_kernel: int = 4
    norm_eps: float = 1e-6
    chunk_size: int = 64
    # Kimi Delta Attention's variations (arXiv 2510.26692): one decay per key channel of each head instead of
    # one per head; the decay input and the output gate as low-rank projections dim -> gate_rank -> width
    # (None: one full-rank projection each); the output norm gated by sigmoid instead of silu.
    decay_per_channel: bool = False
    gate_rank: int | None = None
    output_gate: str = "silu"
    # Who runs the chunked delta rule: "auto" (the Triton kernels for CUDA tensors they fit: one decay per
    # head, chunk_size 64, head dims powers of two in [16, 256]; the torch form otherwise), "triton" (always,
    # ValueError where they cannot run) or "torch" (always the torch form).
    delta_rule_backend: str = "auto"

    def build(self, dim: int) -> "GatedDeltaNet":
        if self.num_key_heads < 1 or self.num_value_heads % self.num_key_heads:
            raise ValueError(f"num_value_heads ({self.num_value_heads}) must be a multiple of num_key_heads "
                             f"({self.num_key_heads})")
        if self.conv_kernel < 1 or self.chunk_size < 1:
            raise ValueError(f"conv_kernel ({self.conv_kernel}) and chunk_size ({self.chunk_size}) must be >= 1")
        if self.gate_rank is not None and self.gate_rank < 1:
            raise ValueError(f"gate_rank ({self.gate_rank}) must be >= 1 or None (full rank)")
        if self.output_gate not in ("silu", "sigmoid"):
            raise ValueError(f"output_gate {self.output_gate!r} is not supported; supported: ['silu', 'sigmoid']")
        if self.delta_rule_backend not in DELTA_RULE_BACKENDS:
            raise ValueError(f"delta_rule_backend {self.delta_rule_backend!r} is not supported; supported: "
                             f"{list(DELTA_RULE_BACKENDS)}")
        return GatedDeltaNet(dim, self)


@dataclass
class GatedDeltaNetState:
    """One layer's decode state for a batch, what a generator carries from one call to the next.

    conv: [b, conv_kernel - 1, channels], the last inputs of the short conv (channels [q | k | v] of
    this rank's heads; zeros before a document's first token). recurrent: [b, Hv, key_dim, value_dim]
    float32, the delta-rule state S."""

    conv: torch.Tensor
    recurrent: torch.Tensor


class ShortConv(nn.Module):
    """A depthwise causal conv + SiLU over `channels` (weight in nn.Conv1d's layout [channels, 1, kernel]);
    `conv(x, history, segments, lengths)` is `causal_conv` with this weight. Split per head under tensor
    parallelism (its channels are whole heads of q, k or v)."""

    def __init__(self, channels: int, kernel: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(channels, 1, kernel))

    def forward(self, x: torch.Tensor, history: torch.Tensor | None, segments: torch.Tensor | None,
                lengths: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        return causal_conv(x, self.weight, history, segments, lengths)

    def init_parameter(self, name: str, param: torch.Tensor, generator: torch.Generator) -> bool:
        bound = 1 / math.sqrt(param.shape[-1])  # nn.Conv1d's default scale (fan_in = kernel)
        param.uniform_(-bound, bound, generator=generator)
        return True


class DecayGate(nn.Module):
    """g = -exp(A_log) * softplus(a + dt_bias), in float32 (log of the per-token decay): one per value head
    (`channels` 1, a [.., H] -> g [.., H]) or per key channel of each head (`channels` dk, a [.., H*dk] ->
    g [.., H, dk], Kimi Delta Attention). A_log [H], dt_bias [H*channels], head-major."""

    def __init__(self, num_heads: int, channels: int = 1):
        super().__init__()
        self.per_channel = channels > 1
        self.A_log = nn.Parameter(torch.empty(num_heads))
        self.dt_bias = nn.Parameter(torch.empty(num_heads * channels))

    def init_parameter(self, name: str, param: torch.Tensor, generator: torch.Generator) -> bool:
        if name == "A_log":  # A uniform in [1, 16] as Mamba-2 / Gated DeltaNet initialise it
            param.copy_(torch.empty_like(param).uniform_(1.0, 16.0, generator=generator).log())
        else:
            param.fill_(1.0)
        return True

    def forward(self, a: torch.Tensor) -> torch.Tensor:
        dtype = torch.promote_types(a.dtype, torch.float32)
        heads = self.A_log.shape[0]  # local heads under tensor parallelism
        x = (a.to(dtype) + self.dt_bias.to(dtype)).unflatten(-1, (heads, -1))  # [.., H, channels]
        g = -self.A_log.to(dtype).exp()[:, None] * F.softplus(x)
        return g if self.per_channel else g[..., 0]


class LowRankProjection(nn.Module):
    """`up(down(x))`: dim -> rank -> out without a nonlinearity (Kimi Delta Attention's decay input and
    output gate). Under tensor parallelism `down` is replicated and `up` split by heads."""

    def __init__(self, dim: int, rank: int, out_features: int):
        super().__init__()
        self.down = nn.Linear(dim, rank, bias=False)
        self.up = nn.Linear(rank, out_features, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.up(self.down(x))


def document_segments(context: AttentionContext | None) -> torch.Tensor | None:
    """[b, s] int64 segment index per token (0 for the first document of a row, +1 at each id
    change), or None without document ids. Cached on the context (shared by every layer)."""
    if context is None or context.document_ids is None:
        return None
    ids = context.document_ids

    def build() -> torch.Tensor:
        starts = torch.zeros_like(ids, dtype=torch.int64)
        starts[:, 1:] = (ids[:, 1:] != ids[:, :-1]).long()
        return starts.cumsum(dim=1)

    return context.cached(("delta_rule_segments", ids.shape, ids.device), build)


def causal_conv(x: torch.Tensor, weight: torch.Tensor, history: torch.Tensor | None,
                segments: torch.Tensor | None, lengths: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """Depthwise causal conv + SiLU. x [b, s, c], weight [c, 1, K], history [b, K-1, c] (the inputs
    before x, or None for zeros). Taps never cross a segment boundary. Returns (out [b, s, c], the
    new history [b, K-1, c]: the inputs before token `lengths[b]` of each row, the end by default)."""
    batch, seq, channels = x.shape
    kernel = weight.shape[-1]
    if history is None:
        history = x.new_zeros(batch, kernel - 1, channels)
    padded = torch.cat([history.to(x.dtype), x], dim=1)  # [b, K-1+s, c]
    taps = weight[:, 0, :].to(x.dtype)  # [c, K]; tap K-1 multiplies the current token
    if segments is not None:  # history belongs to the row's first segment (0)
        seg = F.pad(segments, (kernel - 1, 0), value=0)
    out = torch.zeros_like(x)
    for back in range(kernel):  # token t reads t - back
        start = kernel - 1 - back
        term = padded[:, start:start + seq] * taps[:, kernel - 1 - back]
        if segments is not None and back:
            term = term * (seg[:, start:start + seq] == segments)[..., None].to(x.dtype)
        out = out + term
    if lengths is None:
        new_history = padded[:, seq:]
        last_seg = None if segments is None else seg[:, seq:]
    else:  # right padding: the K-1 inputs before each row's first padded token
        index = lengths[:, None] + torch.arange(kernel - 1, device=x.device)  # [b, K-1] in padded coordinates
        new_history = padded.gather(1, index[..., None].expand(-1, -1, channels))
        last_seg = None if segments is None else seg.gather(1, index)
    if segments is not None and kernel > 1:  # keep only the inputs of the segment that goes on
        current = segments[:, -1:] if lengths is None else segments.gather(1, (lengths[:, None] - 1).clamp(min=0))
        new_history = new_history * (last_seg == current)[..., None].to(x.dtype)
    return F.silu(out), new_history


def recurrent_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                         *, segments: torch.Tensor | None = None, initial_state: torch.Tensor | None = None
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """The gated delta rule token by token. q, k [b, s, h, dk] (normalised, q scaled), v [b, s, h, dv],
    g [b, s, h] (one log decay per head) or [b, s, h, dk] (per key channel, Kimi Delta Attention),
    beta [b, s, h]; segments [b, s] or None; initial_state [b, h, dk, dv] or None (zeros).
    Returns (out [b, s, h, dv], final state [b, h, dk, dv]), both float32 (float64 for float64 inputs)."""
    batch, seq, heads, dk = k.shape
    dtype = _compute_dtype(v)
    q, k, v, g, beta = (t.to(dtype) for t in (q, k, v, g, beta))
    decay = (g if g.dim() == 4 else g[..., None]).exp()[..., None]  # [b, s, h, dk or 1, 1]
    state = (torch.zeros(batch, heads, dk, v.shape[-1], device=v.device, dtype=dtype) if initial_state is None
             else initial_state.to(dtype))
    out = torch.empty_like(v)
    for t in range(seq):
        if segments is not None and t > 0:
            keep = (segments[:, t] == segments[:, t - 1]).to(dtype)[:, None, None, None]
            state = state * keep
        state = state * decay[:, t]
        predicted = torch.einsum("bhk,bhkv->bhv", k[:, t], state)
        update = beta[:, t, :, None] * (v[:, t] - predicted)
        state = state + k[:, t, :, :, None] * update[:, :, None, :]
        out[:, t] = torch.einsum("bhk,bhkv->bhv", q[:, t], state)
    return out, state


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    """float32, or float64 for float64 inputs (reference runs)."""
    return torch.promote_types(x.dtype, torch.float32)


def _to_chunks(x: torch.Tensor, chunk: int, pad: int) -> torch.Tensor:
    """[b, s, h, ...] -> [b, h, n, chunk, ...], zero-padded at the end."""
    x = x.transpose(1, 2)
    x = F.pad(x, (0, 0, 0, pad)) if x.dim() == 4 else F.pad(x, (0, pad))
    return x.reshape(x.shape[0], x.shape[1], -1, chunk, *x.shape[3:])


def chunked_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                       *, segments: torch.Tensor | None = None, initial_state: torch.Tensor | None = None,
                       chunk_size: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """The same recurrence as `recurrent_delta_rule` (same arguments), chunk by chunk.

    Within a chunk (cumulative log decay c_i per channel d, D_ij = exp(c_i - c_j) for j <= i in i's segment,
    else 0), the delta-rule corrections u solve (I + strict_lower(beta_i sum_d k_id k_jd D_ijd)) u =
    beta (v - (R_i * k_i) S0), where R_i = exp(c_i) if token i still sees the incoming state S0 (no boundary
    since the chunk began) else 0; then o = (R q) S0 + (sum_d q_id k_jd D_ijd) u and the outgoing state is
    exp(c_last) S0 (if the last token sees S0) + sum_j (D_last,j * k_j) u_j^T. With one decay per head
    (Gated DeltaNet) D_ij is a scalar and the pair sums are matmuls; per channel (Kimi Delta Attention)
    they are formed chunk by chunk ([b, h, C, C, dk] at a time).
    """
    batch, seq, heads, dk = k.shape
    dv = v.shape[-1]
    pad = (-seq) % chunk_size
    dtype = _compute_dtype(v)
    g = g if g.dim() == 4 else g[..., None]  # [b, s, h, D]: D = 1 (per head) or dk (per channel)
    q, k, v, g, beta = (_to_chunks(t.to(dtype), chunk_size, pad) for t in (q, k, v, g, beta))  # [b, h, n, C, ...]
    chunks = q.shape[2]
    if segments is None:
        segments = torch.zeros(batch, seq, dtype=torch.int64, device=q.device)
    # Padding joins the last segment: zero k, v, beta and g leave the state unchanged there.
    seg = F.pad(segments[:, None].float(), (0, pad), mode="replicate")[:, 0].long()
    seg = seg.view(batch, 1, chunks, chunk_size)  # [b, 1, n, C], broadcast over heads
    seg_before = torch.cat([seg[:, :, :1, :1], seg[:, :, :-1, -1:]], dim=2)  # segment of the state entering
    sees_state = (seg == seg_before)[..., None]  # [b, 1, n, C, 1]
    causal = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=q.device).tril()
    visible = (seg[..., :, None] == seg[..., None, :]) & causal  # [b, 1, n, C, C]

    log_decay = g.cumsum(dim=-2)  # [b, h, n, C, D]
    state_read = log_decay.exp() * sees_state  # R_i
    to_end = (log_decay[..., -1:, :] - log_decay).exp() * (seg == seg[..., -1:])[..., None]  # D_last,j
    state_carry = log_decay[..., -1, :].exp() * sees_state[..., -1, :]  # [b, h, n, D]

    system = _decayed_pairs(beta[..., None] * k, k, log_decay, visible)  # only its strict lower part is used
    solve = lambda rhs: torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True)  # noqa: E731
    corrections = solve(beta[..., None] * v)  # u before the incoming state's share
    state_keys = solve(beta[..., None] * state_read * k)  # u = corrections - state_keys @ S0
    scores = _decayed_pairs(q, k, log_decay, visible)
    q_state = q * state_read
    k_end = k * to_end

    state = (torch.zeros(batch, heads, dk, dv, device=q.device, dtype=dtype) if initial_state is None
             else initial_state.to(dtype))
    out = torch.empty_like(corrections)
    for c in range(chunks):
        u = corrections[:, :, c] - state_keys[:, :, c] @ state
        out[:, :, c] = q_state[:, :, c] @ state + scores[:, :, c] @ u
        state = state * state_carry[:, :, c, :, None] + k_end[:, :, c].transpose(-1, -2) @ u
    out = out.reshape(batch, heads, chunks * chunk_size, dv)[:, :, :seq].transpose(1, 2)
    return out, state


def _decayed_pairs(a: torch.Tensor, b: torch.Tensor, log_decay: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
    """sum_d a_id b_jd exp(c_id - c_jd) where j is visible from i, else 0: a, b [b, h, n, C, dk], log_decay c
    [b, h, n, C, D] (D = 1: one decay per head; D = dk: per channel), visible [b, 1, n, C, C]. Per channel,
    exp(c_i - c_j) <= 1 for j <= i is formed explicitly (factoring it as exp(c_i) exp(-c_j) overflows)."""
    if log_decay.shape[-1] == 1:
        c = log_decay[..., 0]
        pair = (c[..., :, None] - c[..., None, :]).masked_fill(~visible, float("-inf")).exp()
        return (a @ b.transpose(-1, -2)) * pair
    out = a.new_empty(*a.shape[:-1], a.shape[-2])
    for n in range(a.shape[2]):  # one chunk at a time bounds the [b, h, C, C, dk] decay tensor
        c = log_decay[:, :, n]
        pair = (c[..., :, None, :] - c[..., None, :, :]).masked_fill(~visible[:, :, n, ..., None], float("-inf"))
        out[:, :, n] = torch.einsum("bhid,bhjd,bhijd->bhij", a[:, :, n], b[:, :, n], pair.exp())
    return out


def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum(x^2) + eps) over the last dim, in float32 or wider (flash-linear-attention's definition)."""
    x = x.to(_compute_dtype(x))
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


class GatedDeltaNet(nn.Module):
    """`gdn(x [b, s, dim], rope, *, context) -> [b, s, dim]` (rope is ignored: no positions here).

    Projections wq, wk [dim, Hk*dk], wv, wz [dim, Hv*dv], wb [dim, Hv], wa [dim, Hv] (per-channel decay:
    [dim, Hv*dk]), wz and wa low-rank `LowRankProjection`s when `gate_rank` is set (read by one GEMM when
    fusable), their convs q_conv/k_conv/v_conv, the decay gate, the gated output norm and wo. Head
    counts are inferred from the projections' outputs, so a tensor-parallel shard holding
    Hk/tp key and Hv/tp value heads runs unchanged.
    """

    def __init__(self, dim: int, config: GatedDeltaNetConfig):
        super().__init__()
        self.config = config
        key_dim = config.num_key_heads * config.key_head_dim
        value_dim = config.num_value_heads * config.value_head_dim
        decay_channels = config.key_head_dim if config.decay_per_channel else 1
        self.heads_per_key = config.num_value_heads // config.num_key_heads
        self.wq = nn.Linear(dim, key_dim, bias=False)
        self.wk = nn.Linear(dim, key_dim, bias=False)
        self.wv = nn.Linear(dim, value_dim, bias=False)
        self.wz = self._gate_projection(dim, value_dim)  # output gate
        self.wb = nn.Linear(dim, config.num_value_heads, bias=False)  # beta logits
        self.wa = self._gate_projection(dim, config.num_value_heads * decay_channels)  # decay input
        self.q_conv = ShortConv(key_dim, config.conv_kernel)
        self.k_conv = ShortConv(key_dim, config.conv_kernel)
        self.v_conv = ShortConv(value_dim, config.conv_kernel)
        self.decay = DecayGate(config.num_value_heads, decay_channels)
        self.norm = GatedRMSNorm(config.value_head_dim, eps=config.norm_eps, activation=config.output_gate)
        self.wo = nn.Linear(value_dim, dim, bias=False)

    def _gate_projection(self, dim: int, out_features: int) -> nn.Module:
        rank = self.config.gate_rank
        return nn.Linear(dim, out_features, bias=False) if rank is None else LowRankProjection(dim, rank, out_features)

    def _projections(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """(q, k, v, z, b, a) of x, the input-side matmuls as one GEMM when fusable."""
        if self.config.gate_rank is None:
            return project(x, self.wq, self.wk, self.wv, self.wz, self.wb, self.wa)
        q, k, v, b, z_low, a_low = project(x, self.wq, self.wk, self.wv, self.wb, self.wz.down, self.wa.down)
        return q, k, v, self.wz.up(z_low), b, self.wa.up(a_low)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None = None, *,
                context: AttentionContext | None = None) -> torch.Tensor:
        states = None if context is None else context.recurrent_states
        state = None if states is None else states.get(self)
        valid = None if context is None else context.valid_tokens
        out, new_state = self.mix(x, state=state, segments=document_segments(context), valid=valid)
        if states is not None:
            states[self] = new_state
        return out

    def mix(self, x: torch.Tensor, *, state: GatedDeltaNetState | None = None, segments: torch.Tensor | None = None,
            valid: torch.Tensor | None = None) -> tuple[torch.Tensor, GatedDeltaNetState]:
        """The layer on x [b, s, dim] from `state` (None: a fresh start); returns (out, the state after
        each row's last token). `valid` [b, s] bool marks right padding (False): padded tokens neither
        decay nor update the state, and the conv history ends at the last valid token."""
        cfg = self.config
        batch, seq, _ = x.shape
        q, k, v, z, b, a = self._projections(x)
        lengths = None if valid is None else valid.sum(dim=1)
        histories = [None] * 3 if state is None else state.conv.split([q.shape[-1], k.shape[-1], v.shape[-1]], -1)
        convs = [conv(t, h, segments, lengths) for conv, t, h in zip((self.q_conv, self.k_conv, self.v_conv),
                                                                      (q, k, v), histories)]
        (q, q_hist), (k, k_hist), (v, v_hist) = convs
        history = torch.cat([q_hist, k_hist, v_hist], dim=-1)  # [b, K-1, q | k | v channels]
        q = q.reshape(batch, seq, -1, cfg.key_head_dim)
        k = k.reshape(batch, seq, -1, cfg.key_head_dim)
        v = v.reshape(batch, seq, -1, cfg.value_head_dim)
        if self.heads_per_key > 1:  # value heads h*r .. h*r + r-1 read key head h
            q, k = (t.repeat_interleave(self.heads_per_key, dim=2) for t in (q, k))
        g, beta = self.decay(a), b.to(_compute_dtype(b)).sigmoid()  # [b, s, Hv]
        if valid is not None:  # padding: no decay (g = 0) and no update (beta = 0)
            g = g * valid.view(*valid.shape, *[1] * (g.dim() - 2))
            beta = beta * valid[..., None]
        initial = None if state is None else state.recurrent
        # The delta rule stays in float32 under autocast too (its triangular solve and state products
        # lose too much in bf16); the projections around it follow autocast.
        with torch.autocast(x.device.type, enabled=False):
            if seq > 1 and use_triton(cfg.delta_rule_backend, q, v, g, cfg.chunk_size):
                # bf16 projections (autocast): tensor-core products in the kernels (the forward's in bf16, as
                # flash-linear-attention's; backward's recompute in tf32); q and k are normalised (float32,
                # stored in the kernels' dtype) by one Triton launch inside the op
                if v.dtype == torch.bfloat16:
                    q, k = q.to(v.dtype), k.to(v.dtype)
                out, final = triton_chunked_delta_rule(q, k, v, g, beta, segments=segments, initial_state=initial,
                                                       qk_l2norm=True)
            else:
                q = l2_normalize(q) * cfg.key_head_dim**-0.5
                k = l2_normalize(k)
                if seq == 1:
                    out, final = recurrent_delta_rule(q, k, v, g, beta, segments=segments, initial_state=initial)
                else:
                    out, final = chunked_delta_rule(q, k, v, g, beta, segments=segments, initial_state=initial,
                                                    chunk_size=cfg.chunk_size)
        out = self.norm(out.to(x.dtype), z.reshape(batch, seq, -1, cfg.value_head_dim))
        return self.wo(out.reshape(batch, seq, -1)), GatedDeltaNetState(conv=history, recurrent=final)

    @property
    def delta_rule_dims(self) -> tuple[int, int, int, int]:
        """(value heads, key dim, value dim, chunk size), for FLOP counting (accounting.py)."""
        cfg = self.config
        return cfg.num_value_heads, cfg.key_head_dim, cfg.value_head_dim, cfg.chunk_size
