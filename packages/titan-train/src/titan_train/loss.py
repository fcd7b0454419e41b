"""Fused output projection + cross-entropy over token chunks: the [tokens, vocab] logits never exist whole.

For each chunk of C tokens the forward computes the logits (compute dtype), their fp32 log-softmax and
loss, and right away the gradients (softmax - one_hot) for the hidden states and the output weight;
backward only scales them. Peak extra memory is one chunk's logits, [C, vocab], instead of all of them
plus their saved softmax (at 16k tokens and a 128k vocabulary that is 1 GiB instead of 8+ GiB).
"""
from __future__ import annotations

from functools import partial
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor, Partial, Replicate

from .data import IGNORE_INDEX


def _chunk_loss_and_grad(logits: torch.Tensor, target: torch.Tensor, valid: torch.Tensor, *, acc: torch.dtype
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [C, V] -> (summed loss over valid rows in `acc`, d loss / d logits [C, V] in logits.dtype).

    Works in place on `logits.to(acc)` (the logits themselves when already `acc`, which it then
    overwrites), so eager mode holds one [C, V] buffer at a time."""
    work = logits.to(acc)
    logsumexp = torch.logsumexp(work, dim=-1)                     # [C]
    picked = work.gather(1, target[:, None]).squeeze(1)
    loss = ((logsumexp - picked) * valid).sum()
    grad = work.sub_(logsumexp[:, None]).exp_()                    # softmax
    grad[torch.arange(len(target), device=target.device), target] -= 1
    grad *= valid[:, None]
    return loss, grad.to(logits.dtype)


def _chunk_loss_and_grad_fusable(logits: torch.Tensor, target: torch.Tensor, valid: torch.Tensor, *,
                                 acc: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The same as _chunk_loss_and_grad, written without in-place updates so torch.compile fuses it into
    two passes over the logits (a row reduction, then the gradient)."""
    work = logits.to(acc)
    logsumexp = torch.logsumexp(work, dim=-1)
    picked = work.gather(1, target[:, None]).squeeze(1)
    loss = ((logsumexp - picked) * valid).sum()
    columns = torch.arange(work.shape[1], device=work.device)
    softmax = torch.exp(work - logsumexp[:, None])
    grad = torch.where(columns[None, :] == target[:, None], softmax - 1, softmax) * valid[:, None]
    return loss, grad.to(logits.dtype)


def _vocab_parallel_chunk(logits: torch.Tensor, target: torch.Tensor, valid: torch.Tensor, *, vocab_start: int,
                          group: dist.ProcessGroup, acc: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """_chunk_loss_and_grad for logits [C, V / tp] holding this rank's columns vocab_start.. of the
    vocabulary: the row maximum and the sums of exp and of the target's logit are all-reduced over `group`,
    so the loss (the whole vocabulary's) is the same on every rank; the gradient is this rank's columns."""
    work = logits.to(acc)
    local = target - vocab_start
    mine = (local >= 0) & (local < work.shape[1])                  # the target column lives on this rank
    local = torch.where(mine, local, 0)
    row_max = work.amax(dim=-1)
    dist.all_reduce(row_max, op=dist.ReduceOp.MAX, group=group)
    work.sub_(row_max[:, None])
    picked = work.gather(1, local[:, None]).squeeze(1) * mine
    sums = torch.stack([work.exp().sum(dim=-1), picked])           # [2, C]: sum of exp, shifted target logit
    dist.all_reduce(sums, group=group)
    logsumexp = sums[0].log()                                      # shifted by row_max, as `picked`
    loss = ((logsumexp - sums[1]) * valid).sum()
    grad = work.sub_(logsumexp[:, None]).exp_()                    # softmax, this rank's columns
    grad[torch.arange(len(target), device=target.device), local] -= mine.to(acc)
    grad *= valid[:, None]
    return loss, grad.to(logits.dtype)


_compiled_chunk = None


def _compiled_chunk_loss_and_grad():
    global _compiled_chunk
    if _compiled_chunk is None:
        _compiled_chunk = torch.compile(_chunk_loss_and_grad_fusable, dynamic=False)
    return _compiled_chunk


_out_dtype_products = True  # torch builds without mixed-dtype mm/addmm fall back once, then stay there


def _accumulate_product(acc: torch.Tensor | None, a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """acc + a @ b in `dtype` (just a @ b when acc is None, so no zero-filled buffer is needed). With
    low-precision a, b and an fp32 `dtype`, a CUDA GEMM accumulates into fp32 itself."""
    global _out_dtype_products
    if a.dtype == dtype:
        return torch.mm(a, b) if acc is None else acc.addmm_(a, b)
    if a.is_cuda and _out_dtype_products:
        try:  # in place (out=acc): a second [V, d] fp32 buffer per chunk would add 1 GiB at a 128k vocabulary
            return torch.mm(a, b, out_dtype=dtype) if acc is None else torch.addmm(acc, a, b, out_dtype=dtype, out=acc)
        except (RuntimeError, TypeError):
            _out_dtype_products = False
    if acc is None:
        return (a @ b).to(dtype)
    acc += a @ b
    return acc


def _compute_dtype(hidden: torch.Tensor) -> torch.dtype:
    """The dtype the products run in: autocast's when it is on (the output weight is an fp32 master copy)."""
    device_type = hidden.device.type
    if torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return hidden.dtype


def _capped_logits(raw: torch.Tensor, scale: float, softcap: float | None, acc: torch.dtype
                   ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(logits = softcap * tanh(raw * scale / softcap), or raw * scale without a cap; d logits / d raw),
    in `acc` and cast back to raw's dtype; (raw, None) for the plain head."""
    if scale == 1.0 and softcap is None:
        return raw, None
    z = raw.to(acc) * scale
    if softcap is None:
        return z.to(raw.dtype), torch.full((), scale, dtype=acc, device=raw.device)
    capped = torch.tanh(z / softcap)
    return (capped * softcap).to(raw.dtype), scale * (1 - capped * capped)


class _FusedLinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, chunk: int,
                compiled: bool, triton: bool, vocab_group: dist.ProcessGroup | None, logit_scale: float = 1.0,
                logit_softcap: float | None = None, weight_grad_in_param_dtype: bool = False) -> torch.Tensor:
        # hidden [N, d], weight [V, d], labels [N] -> summed loss over non-ignored labels (fp32 scalar).
        # vocab_group: weight is this rank's rows [V / tp, d] of a vocabulary sharded over the group; the
        # loss is then the whole vocabulary's and the hidden states' gradient this rank's partial sum.
        need_grad = ctx.needs_input_grad[0] or ctx.needs_input_grad[1]
        acc = torch.promote_types(hidden.dtype, torch.float32)  # softmax and sums: fp32 (fp64 for fp64 inputs)
        weight_acc = weight.dtype if weight_grad_in_param_dtype else acc  # the [V, d] gradient's running sum
        compute = _compute_dtype(hidden)
        # Products run explicitly in the compute dtype: an fp32 accumulation GEMM would be ~15x slower on GPUs.
        h_all, w = hidden.to(compute), weight.to(compute)
        if vocab_group is not None:
            chunk_fn = partial(_vocab_parallel_chunk, vocab_start=dist.get_rank(vocab_group) * weight.shape[0],
                               group=vocab_group, acc=acc)
        elif triton and hidden.is_cuda and acc == torch.float32:
            from .kernels.cross_entropy import cross_entropy_chunk_triton as chunk_fn
        else:
            chunk_fn = partial(_compiled_chunk_loss_and_grad() if compiled else _chunk_loss_and_grad, acc=acc)
        loss = torch.zeros((), dtype=acc, device=hidden.device)
        grad_hidden = torch.empty_like(hidden) if need_grad else None
        grad_weight = None  # [V, d] in weight_acc, summed over chunks
        with torch.autocast(hidden.device.type, enabled=False):
            for start in range(0, hidden.shape[0], chunk):
                h = h_all[start:start + chunk]                           # [C, d]
                y = labels[start:start + chunk]                          # [C]
                valid = y != IGNORE_INDEX
                logits, slope = _capped_logits(h @ w.t(), logit_scale, logit_softcap, acc)
                chunk_loss, grad = chunk_fn(logits, torch.where(valid, y, 0), valid)  # grad [C, V]
                if slope is not None:  # chain rule through the scale and the tanh cap
                    grad = (grad.to(acc) * slope).to(grad.dtype)
                loss += chunk_loss
                if need_grad:
                    grad_hidden[start:start + chunk] = grad @ w
                    grad_weight = _accumulate_product(grad_weight, grad.t(), h, weight_acc)
                # Free this chunk's [C, V] buffers now: the names would keep them alive through the next
                # chunk's product and kernel, two chunks of logits at the peak instead of one.
                del logits, grad, slope
        if grad_weight is None and need_grad:  # no tokens at all
            grad_weight = torch.zeros(weight.shape, dtype=weight_acc, device=weight.device)
        ctx.save_for_backward(grad_hidden, grad_weight)
        ctx.weight_dtype = weight.dtype
        return loss

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor):
        # Not in place: zero-bubble pipeline schedules run this backward twice (input, then weight gradients).
        grad_hidden, grad_weight = ctx.saved_tensors
        grad_hidden = grad_hidden * grad_loss.to(grad_hidden.dtype)
        # scaled and cast to the weight's dtype (bf16 under mixed_precision=bf16_params) in one pass
        grad_weight = torch.mul(grad_weight, grad_loss,
                                out=torch.empty(grad_weight.shape, dtype=ctx.weight_dtype, device=grad_weight.device))
        return grad_hidden, grad_weight, None, None, None, None, None, None, None, None


def fused_linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, *,
                               chunk: int = 4096, compiled: bool = False, triton: bool = False,
                               vocab_group: dist.ProcessGroup | None = None, logit_scale: float = 1.0,
                               logit_softcap: float | None = None, weight_grad_in_param_dtype: bool = False
                               ) -> torch.Tensor:
    """Sum over tokens of cross_entropy(hidden @ weight.T, labels), ignoring IGNORE_INDEX labels.
    With `logit_scale` / `logit_softcap` the logits are `softcap * tanh(l * scale / softcap)` (Muse's head,
    titan-models' `Transformer.logits`).

    hidden [..., d], weight [V, d], labels [...] (same leading shape as hidden). compiled: fuse each
    chunk's softmax and gradient with torch.compile (two passes over the logits instead of about six).
    triton: on CUDA, kernels/cross_entropy.py's kernel instead (one online log-sum-exp pass and one
    gradient pass, the gradient written over the logits).
    vocab_group (vocabulary parallel): `weight` is this rank's consecutive share [V / tp, d] of the
    vocabulary (rank r holds rows r V / tp ..), every rank of the group passes the same hidden states and
    labels; each chunk's row maximum and exp / target sums are all-reduced (compiled and triton do not
    apply). Returns the whole vocabulary's loss on every rank; the gradient of `hidden` is this rank's
    partial sum (sum it over the group), that of `weight` this rank's rows.
    weight_grad_in_param_dtype: sum the weight's gradient over the chunks in weight.dtype (each chunk's
    product still accumulates in fp32 inside the GEMM) instead of fp32 (training.loss_weight_grad_dtype).
    """
    if chunk < 1:
        raise ValueError(f"training.loss_chunk_size must be >= 1, got {chunk}")
    return _FusedLinearCrossEntropy.apply(hidden.reshape(-1, hidden.shape[-1]), weight, labels.reshape(-1), chunk,
                                          compiled, triton, vocab_group, logit_scale, logit_softcap,
                                          weight_grad_in_param_dtype)


class CausalLMLoss(nn.Module):
    """model + loss in one forward, so parallel wrappers (FSDP's hooks, compile) see one call.

    forward(tokens [b, s], labels [b, s], document_ids [b, s] | None, positions [b, s] | None) -> summed loss of
    this rank's tokens. positions default to arange(s); context parallelism passes the global positions of
    the tokens a rank holds.
    Under tensor parallelism the output projection is vocabulary-parallel (the plan's "output" style: the
    weight Shard(0) over tp): the sequence-sharded final hidden states are all-gathered, every tp rank
    scores the whole sequence over its share of the vocabulary, the softmax's maximum and sums are
    all-reduced, and the hidden states' partial gradients are reduce-scattered back to the sequence shards.
    The loss is then the same on every tp rank (the trainer counts it once).
    """

    def __init__(self, model: nn.Module, *, chunk: int = 4096, context_factory: Callable | None = None,
                 tp_group: dist.ProcessGroup | None = None, compiled: bool = False, triton: bool = False,
                 weight_grad_in_param_dtype: bool = False):
        """context_factory: document ids [b, s] -> the model's AttentionContext (document masking), None for
        none. tp_group: the tensor-parallel group the model is (to be) sharded over. compiled: fuse each loss
        chunk with torch.compile (compile.enabled). triton: on CUDA, the Triton loss kernel instead
        (training.fused_kernels). weight_grad_in_param_dtype: training.loss_weight_grad_dtype=param."""
        super().__init__()
        self.model = model
        self.chunk = chunk
        self.context_factory = context_factory
        self.tp_group = tp_group
        self.compiled = compiled
        self.triton = triton
        self.weight_grad_in_param_dtype = weight_grad_in_param_dtype

    def with_model(self, model: nn.Module) -> CausalLMLoss:
        """The same loss over another model (a pipeline stage's share of this one)."""
        return CausalLMLoss(model, chunk=self.chunk, context_factory=self.context_factory, tp_group=self.tp_group,
                            compiled=self.compiled, triton=self.triton,
                            weight_grad_in_param_dtype=self.weight_grad_in_param_dtype)

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor, document_ids: torch.Tensor | None = None,
                positions: torch.Tensor | None = None, *, mtp_embeddings: torch.Tensor | None = None,
                mtp_tokens: torch.Tensor | None = None, mtp_labels: torch.Tensor | None = None,
                **images: torch.Tensor) -> torch.Tensor:
        """The summed loss [], or with multi-token prediction (mtp_labels given) the sums [2]: (main, MTP).

        MTP (DeepSeek-V3, depth 1): position i's MTP input is the final hidden state at i with the
        embedding of token i + 1 (`mtp_tokens` [b, s] looked up here, or `mtp_embeddings` [b, s, d] from
        a pipeline's first stage), its target `mtp_labels` [b, s] token i + 2 (IGNORE_INDEX where that
        lies in another document or past the sequence); the output projection is the main model's.
        images: a vision-language model's pixel_values and image_grid_thw (its positions are then the
        model's own 3-D ones; not with MTP)."""
        assert not (images and mtp_labels is not None), "MTP models take no images"
        context = self.context_factory(document_ids) if self.context_factory is not None else None
        # Explicit positions: under sequence parallelism the embedding output holds only s / tp positions.
        if positions is None and not images:
            positions = torch.arange(tokens.shape[1], device=tokens.device).expand(*tokens.shape[:2])
        if mtp_labels is None:
            hidden = self.model.hidden_states(tokens, positions=positions, context=context, **images)  # [b, s, d]
            return self._output_loss(hidden, labels)
        if mtp_embeddings is None:
            mtp_embeddings = self.model.tok_embeddings(mtp_tokens)
        # the model runs its MTP module on what it reads (DeepSeek-V3: the final hidden state; V4: the streams)
        hidden, mtp_hidden = self.model.hidden_states_with_mtp(tokens, mtp_embeddings, positions=positions,
                                                               context=context)
        return torch.stack([self._output_loss(hidden, labels), self._output_loss(mtp_hidden, mtp_labels)])

    def _output_loss(self, hidden: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        weight = self.model.output.weight
        vocab_group = None
        if self.tp_group is not None:
            assert isinstance(hidden, DTensor) and isinstance(weight, DTensor), \
                "TP expects sequence-sharded hidden states and a vocabulary-sharded output weight"
            # [b, s / tp, d] Shard(1) -> [b, s, d] on every tp rank; its gradient, each rank's partial sum,
            # is reduce-scattered back to the sequence shards.
            hidden = hidden.redistribute(placements=[Replicate()]).to_local(grad_placements=[Partial()])
            weight, vocab_group = weight.to_local(), self.tp_group  # [V / tp, d]: this rank's vocabulary rows
        return fused_linear_cross_entropy(hidden, weight, labels, chunk=self.chunk, compiled=self.compiled,
                                          triton=self.triton, vocab_group=vocab_group,
                                          logit_scale=self.model.logit_scale, logit_softcap=self.model.logit_softcap,
                                          weight_grad_in_param_dtype=self.weight_grad_in_param_dtype)
