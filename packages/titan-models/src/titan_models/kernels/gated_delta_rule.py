"""`triton_chunked_delta_rule`: the chunked gated delta rule (one log decay per head) as Triton kernels,
forward and backward, with the signature of `components.gated_deltanet.chunked_delta_rule`.

The forward stores nothing but its inputs for backward: backward runs the forward's per-chunk kernels
again (Tm, W, U; each chunk's entering state S and corrections Unew), then a reverse scan over chunks and
one kernel per chunk for the input gradients. With the legend of gated_delta_rule_kernels.py, a chunk's
backward, given dO and the gradient dS' of the state leaving it:

    dUnew = P^T dO + diag(e) K dS'   (P = vis * Q K^T * D)       dY = Tm^T dUnew,  dX = diag(beta) dY
    dS    = carry dS' + (diag(r) Q)^T dO - W^T dUnew             d(I + A) = -dY Unew^T  (strict lower part)
    dQ = diag(r) dO S^T + (dP * D) K,   dK = -diag(r) dX S^T + (dP * D)^T Q + diag(e) Unew dS'^T + (Z + Z^T) K
    dV = dX,  dbeta = rowsum(dY * X) + rowsum(dA * K K^T * D)     (X = V - diag(r) K S, Z = dA * beta_i * D)
    dgc = rowsum(G) - colsum(G) + dr * r - de * e + [i = last] (sum(de * e) + dcarry * carry),
          G = dP * Q K^T * D + dA * A,  dg = reverse cumsum of dgc inside the chunk.

float32 inputs run every product as tf32x3 (three tf32 tensor-core products: near-float32 accuracy; the
sm_90 compile check showed IEEE float32 products spilling 2-70 KiB per thread). bfloat16 q, k, v: the
autograd forward runs bf16 products (float32 accumulation) and keeps W, U, the per-chunk states and Unew in
bf16 buffers, the triangular inverse in tf32, as flash-linear-attention does (bf16's error, ~1e-2
relative); backward's recompute of the forward keeps float32 buffers and tf32 products (tf32x3 for the
inverse), so gradients do not inherit the bf16 forward's rounding. The interpreter computes in float32
(bf16 operands are rounded, then multiplied in float32). Gates and the state carried through the scan are
float32 throughout; the output is stored in bf16 by the bf16 forward (as fla's), else in float32.
"""
from __future__ import annotations

import os

import torch

CHUNK = 64
GATE_CHUNKS = 16  # chunks per program of the cumulative-decay kernel
BACKENDS = ("auto", "triton", "torch")


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def triton_shapes_allow(q: torch.Tensor, v: torch.Tensor, g: torch.Tensor, chunk_size: int) -> str | None:
    """None if the kernels take these inputs, else why not."""
    dk, dv = q.shape[-1], v.shape[-1]
    if g.dim() != 3:
        return "the decay is per key channel (Kimi Delta Attention); the kernels take one per head"
    if chunk_size != CHUNK:
        return f"chunk_size is {chunk_size}; the kernels use {CHUNK}"
    for name, d in (("key", dk), ("value", dv)):
        if d < 16 or d > 256 or d & (d - 1):
            return f"{name} head dim {d} is not a power of two in [16, 256]"
    return None


def use_triton(backend: str, q: torch.Tensor, v: torch.Tensor, g: torch.Tensor, chunk_size: int) -> bool:
    """Whether `backend` ('auto', 'triton' or 'torch') runs the Triton kernels for these inputs. 'auto'
    takes them for CUDA tensors the kernels fit; 'triton' raises ValueError where they cannot run
    (CPU tensors outside TRITON_INTERPRET=1, triton missing, shapes they do not take)."""
    if backend not in BACKENDS:
        raise ValueError(f"delta_rule_backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "torch":
        return False
    import importlib.util

    problem = triton_shapes_allow(q, v, g, chunk_size)
    if problem is None and importlib.util.find_spec("triton") is None:
        problem = "the triton package is not installed"
    if problem is None and not q.is_cuda and not interpreting():
        problem = "the tensors are not on a CUDA device (TRITON_INTERPRET=1 runs the kernels on CPU)"
    if backend == "auto":
        return problem is None
    if problem is not None:
        raise ValueError(f"delta_rule_backend='triton' cannot run here: {problem}")
    return True


def triton_chunked_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                              beta: torch.Tensor, *, segments: torch.Tensor | None = None,
                              initial_state: torch.Tensor | None = None, bf16_forward: bool = True,
                              qk_l2norm: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """q, k [b, s, h, dk] (normalised, q scaled; or raw with qk_l2norm), v [b, s, h, dv], g, beta [b, s, h],
    segments [b, s] or None, initial_state [b, h, dk, dv] or None. Returns (out [b, s, h, dv], final state
    [b, h, dk, dv] float32), differentiable in q, k, v, g, beta and initial_state. out is bfloat16 for bf16
    q, k, v (the bf16 forward's, as flash-linear-attention's; half the bytes written and read by the next
    op), else float32. bf16_forward=False: bf16 inputs' forward keeps float32 buffers and tf32 products as
    backward's recompute does (slower, ~4x less rounding; out float32). qk_l2norm: the op L2-normalises q
    and k itself (`components.gated_deltanet.l2_normalize`'s definition) and scales q by dk^-1/2, in one
    Triton launch (kernels/qk_l2_norm.py; fla's use_qk_l2norm_in_kernel)."""
    assert g.dim() == 3, "one log decay per head"
    if interpreting():
        from titan_models.kernels.triton_interpreter import backport_scalar_index

        backport_scalar_index()
    return _DeltaRule.apply(q, k, v, g, beta, segments, initial_state, bf16_forward, qk_l2norm)


def _operand_dtype(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.dtype:
    """The kernels' q, k, v dtype: bf16 when all three are, else float32."""
    return torch.bfloat16 if all(t.dtype == torch.bfloat16 for t in (q, k, v)) else torch.float32


def _normalised(q, k, v, qk_l2norm: bool):
    if not qk_l2norm:
        return q, k
    from titan_models.kernels.qk_l2_norm import l2_norm_qk

    return l2_norm_qk(q.contiguous(), k.contiguous(), _operand_dtype(q, k, v))


class _DeltaRule(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, g, beta, segments, initial_state, bf16_forward, qk_l2norm):
        inputs = _Inputs(*_normalised(q, k, v, qk_l2norm), v, g, beta, segments, initial_state, bf16_forward)
        out, final, _ = inputs.forward(with_output=True)
        saved = inputs.tensors()
        if qk_l2norm:  # the raw q, k (backward normalises them again): no extra buffers kept
            saved = (q.contiguous(), k.contiguous(), *saved[2:])
        ctx.save_for_backward(*saved)
        ctx.has_segments, ctx.has_init, ctx.qk_l2norm = segments is not None, initial_state is not None, qk_l2norm
        ctx.dtypes = (q.dtype, k.dtype, v.dtype, g.dtype, beta.dtype)
        return out, final

    @staticmethod
    def backward(ctx, d_out, d_final):
        q, k, v, g, beta, seg, init = ctx.saved_tensors
        inputs = _Inputs(*_normalised(q, k, v, ctx.qk_l2norm), v, g, beta, seg if ctx.has_segments else None,
                         init if ctx.has_init else None)
        dq, dk, dv, dg, dbeta, dinit = inputs.backward(d_out, d_final)
        if ctx.qk_l2norm:
            from titan_models.kernels.qk_l2_norm import l2_norm_qk_backward

            dq, dk = l2_norm_qk_backward(q, k, dq, dk)
        grads = [t.to(dtype) for t, dtype in zip((dq, dk, dv, dg, dbeta), ctx.dtypes)]
        return *grads, None, (dinit if ctx.has_init else None), None, None


class _Inputs:
    """The kernels' operands: q, k, v in one dtype (bf16 when all three are, else float32), g and beta
    float32, segments int32, all contiguous; the launches of forward and backward."""

    def __init__(self, q, k, v, g, beta, segments, initial_state, bf16_forward=True):
        dtype = _operand_dtype(q, k, v)
        self.bf16_forward = bf16_forward
        self.q, self.k, self.v = (t.to(dtype).contiguous() for t in (q, k, v))
        self.g, self.beta = (t.float().contiguous() for t in (g, beta))
        self.seg = None if segments is None else segments.to(torch.int32).contiguous()
        self.init = None if initial_state is None else initial_state.float().contiguous()
        self.precision = "tf32x3" if dtype == torch.float32 else "tf32"
        self.B, self.T, self.H, self.K = q.shape
        self.V = v.shape[-1]
        self.N = -(-self.T // CHUNK)
        if self.N > 65535:  # the output kernels' grid axis 1 (CUDA's limit), as fla's
            raise ValueError(f"sequence {self.T} exceeds the kernels' {65535 * CHUNK} tokens per row")
        self.Tp = self.N * CHUNK
        self.BK, self.BV = min(64, self.K), min(64, self.V)

    def tensors(self):
        empty = self.q.new_empty(0)
        return (self.q, self.k, self.v, self.g, self.beta, empty if self.seg is None else self.seg,
                empty if self.init is None else self.init)

    def _common(self):
        return dict(T=self.T, H=self.H, Tp=self.Tp, K=self.K, C=CHUNK, HAS_SEG=self.seg is not None,
                    PREC=self.precision)

    def _buffer(self, width, dtype=torch.float32):
        return torch.empty(self.B, self.H, self.Tp, width, device=self.q.device, dtype=dtype)

    def _scan_block(self) -> int:
        """The scan's V block: 32 (twice the programs) unless B*H*V/64 programs already fill the GPU twice."""
        sms = torch.cuda.get_device_properties(self.q.device).multi_processor_count if self.q.is_cuda else 1
        return min(self.V, 64 if self.B * self.H * (self.V // 64) >= 2 * sms else 32)

    def forward(self, *, with_output: bool):
        """with_output (the autograd forward): bf16 inputs run bf16 products and bf16 W, U, S, Unew buffers
        and output (half the bytes) and Tm is not stored; without (backward's recompute) every buffer is
        float32 and Tm is stored, the products as the class docstring says."""
        from titan_models.kernels import gated_delta_rule_kernels as kern

        self.gc = torch.empty(self.B * self.H, self.Tp, device=self.q.device, dtype=torch.float32)
        kern.gates_kernel[(-(-self.N // GATE_CHUNKS), self.B * self.H)](
            self.g, self.gc, self.T, self.H, self.Tp, self.N, C=CHUNK, CB=GATE_CHUNKS, num_warps=4)
        low = with_output and self.q.dtype == torch.bfloat16 and self.bf16_forward
        ops = ("bf16_emulated" if interpreting() else "bf16") if low else "f32"
        buf = torch.bfloat16 if low else torch.float32
        prec = dict(OPS=ops)
        seg = self.q if self.seg is None else self.seg  # an unread placeholder without segments
        tm = self.q.new_empty(0, dtype=torch.float32) if with_output else self._buffer(CHUNK)
        w, u, unew = self._buffer(self.K, buf), self._buffer(self.V, buf), self._buffer(self.V, buf)
        kern.prepare_kernel[(self.N, self.B * self.H)](
            self.k, self.v, self.gc, self.beta, seg, tm, w, u, V=self.V, INV_PREC="tf32" if low else "tf32x3",
            STORE_TM=not with_output, **prec, **self._common())
        states = torch.empty(self.B * self.H, self.N, self.K, self.V, device=self.q.device, dtype=buf)
        final = torch.empty(self.B, self.H, self.K, self.V, device=self.q.device, dtype=torch.float32)
        scan_bv = self._scan_block()
        kern.state_forward_kernel[(self.B * self.H, self.V // scan_bv)](
            self.k, self.gc, self.beta, seg, w, u, self.q if self.init is None else self.init, states, unew, final,
            N=self.N, V=self.V, BV=scan_bv, HAS_INIT=self.init is not None, **prec, **self._common())
        out = None
        if with_output:
            out = torch.empty(self.B, self.T, self.H, self.V, device=self.q.device, dtype=buf)
            kern.output_kernel[(self.V // self.BV, self.N, self.B * self.H)](
                self.q, self.k, self.gc, self.beta, seg, states, unew, out, N=self.N, V=self.V, BV=self.BV,
                **prec, **self._common())
        return out, final, (tm, w, states, unew)

    def backward(self, d_out, d_final):
        from titan_models.kernels import gated_delta_rule_kernels as kern

        _, _, (tm, w, states, unew) = self.forward(with_output=False)
        seg = self.q if self.seg is None else self.seg
        d_out = (torch.zeros(self.B, self.T, self.H, self.V, device=self.q.device) if d_out is None
                 else d_out.float().contiguous())
        dstates, dlocal, dunew = torch.empty_like(states), self._buffer(self.V), self._buffer(self.V)
        dinit = torch.empty(self.B, self.H, self.K, self.V, device=self.q.device, dtype=torch.float32)
        kern.output_backward_kernel[(self.V // self.BV, self.N, self.B * self.H)](
            self.q, self.k, self.gc, self.beta, seg, d_out, dlocal, V=self.V, BV=self.BV, **self._common())
        kern.state_backward_kernel[(self.B * self.H, self.V // self.BV)](
            self.q, self.k, self.gc, self.beta, seg, w, d_out,
            d_out if d_final is None else d_final.float().contiguous(), dlocal, dstates, dunew, dinit,
            N=self.N, V=self.V, BV=self.BV, HAS_DFINAL=d_final is not None, **self._common())
        dq, dk = (torch.empty(self.B, self.T, self.H, self.K, device=self.q.device) for _ in range(2))
        dy = torch.empty(self.B, self.T, self.H, self.V, device=self.q.device)
        dbeta = torch.empty(self.B, self.T, self.H, device=self.q.device)
        dpairs, dsystem = self._buffer(CHUNK), self._buffer(CHUNK)
        dgc_pairs = torch.empty(self.B, self.H, self.Tp, device=self.q.device)
        kern.chunk_pairs_backward_kernel[(self.N, self.B * self.H)](
            self.q, self.k, self.v, self.gc, self.beta, seg, tm, unew, dunew, d_out, dy, dpairs, dsystem,
            dbeta, dgc_pairs, V=self.V, BV=self.BV, **self._common())
        blocks = self.K // self.BK
        dgc_blocks, dbeta_blocks = (torch.empty(blocks, self.B, self.H, self.Tp, device=self.q.device)
                                    for _ in range(2))
        dlast = torch.empty(blocks, self.B, self.H, self.N, device=self.q.device)
        kern.chunk_qk_backward_kernel[(self.N, self.B * self.H, blocks)](
            self.q, self.k, self.gc, self.beta, seg, states, dstates, unew, d_out, dy, dpairs, dsystem, dq, dk,
            dgc_blocks, dlast, dbeta_blocks, N=self.N, V=self.V, BK=self.BK, BV=self.BV, **self._common())
        dbeta = dbeta + dbeta_blocks.sum(0)[:, :, :self.T].transpose(1, 2)
        dv = dy * self.beta[..., None]
        return dq, dk, dv, self._decay_grad(dgc_pairs + dgc_blocks.sum(0), dlast.sum(0)), dbeta, dinit

    def _decay_grad(self, dgc: torch.Tensor, dlast: torch.Tensor) -> torch.Tensor:
        """dg [B, T, H] from the gradient of the in-chunk cumulative decay dgc [B, H, Tp] and of each
        chunk's last cumulative decay dlast [B, H, N]: gc = cumsum(g) inside a chunk, so dg is dgc's
        reverse cumsum there."""
        dgc = dgc.view(self.B, self.H, self.N, CHUNK).clone()
        dgc[..., -1] += dlast
        dg = dgc.flip(-1).cumsum(-1).flip(-1)
        return dg.reshape(self.B, self.H, self.Tp)[:, :, :self.T].transpose(1, 2)
