"""The optimisation half of an RL step on a data-parallel policy: titan-rl's loss, globally normalised.

Every rank holds the same global list of samples (ShardedRollouts gathers them). The list is cut into
`minibatches` global minibatches; each rank trains on its contiguous slice of each. titan_rl's
`policy_loss` averages over what it is given (the rank's slice), while the step must average over the
whole minibatch, whatever the number of ranks: so each rank's loss is scaled by

    world * (its sequences / the minibatch's sequences)    (sequence-mean aggregation: GRPO, GSPO)
    world * (its tokens    / the minibatch's tokens)       (token-mean aggregation: DAPO)

and FSDP's gradient average over the ranks (a division by world) turns the sum into the global mean. world
counts data-parallel ranks: the cp or tp ranks that share a slice (trainer_layout.py) count once.
On one process the scale is exactly 1 and the step is `titan_rl.RLLoop.train_on_batch`'s, which the
tests check bitwise. A rank whose slice is empty still runs a forward and backward (scaled by 0),
because FSDP's all-gathers and reduce-scatters are collectives every rank must join.
"""
from __future__ import annotations

import math
import time

import torch
import torch.distributed as dist
from torch import nn

from titan_rl import PolicyLossConfig, Sample, TrainBatch, policy_loss, token_logprobs, token_logprobs_and_entropy

from ..grad_norm import clip_by_total_norm
from .context_parallel_logprobs import cp_token_logprobs_and_entropy
from .tensor_parallel_logprobs import tp_token_logprobs_and_entropy
from .trainer_layout import TrainerLayout

# token means over the rank's slice (policy_loss's, and the policy's entropy); combined over ranks weighted by tokens.
TOKEN_MEAN_METRICS = ("clip_frac", "ratio_mean", "tis_weight_mean", "tis_truncated_frac", "kl", "entropy")


class PolicyUpdate:
    def __init__(self, *, policy: nn.Module, optimizer: torch.optim.Optimizer, loss: PolicyLossConfig,
                 minibatches: int = 1, max_grad_norm: float = 1.0, temperature: float = 1.0, pad_id: int,
                 reference: nn.Module | None = None, layout: TrainerLayout | None = None) -> None:
        """temperature: the sampling temperature (logprobs are of softmax(logits / T); 0 (greedy) means 1).
        reference: the frozen policy of the KL term (needed when loss.kl_coef > 0); given with kl_coef 0, the KL
          to it is measured ("kl") but not trained on.
        layout: how the trainer ranks split the policy (trainer_layout.py; None: data parallel over all ranks).
          The cp ranks of a context-parallel group take the same samples and split each sequence
          (context_parallel_logprobs.py); the tp ranks of a tensor-parallel group take the same samples and
          split each layer (tensor_parallel_logprobs.py)."""
        if loss.kl_coef > 0 and reference is None:
            raise ValueError("loss.kl_coef > 0 needs a reference model")
        self.policy, self.optimizer, self.loss, self.reference = policy, optimizer, loss, reference
        self.minibatches, self.max_grad_norm, self.pad_id = minibatches, max_grad_norm, pad_id
        self.temperature = temperature if temperature > 0 else 1.0
        self.device = next(policy.parameters()).device
        world = dist.get_world_size() if dist.is_initialized() else 1
        if layout is None:
            layout = TrainerLayout(ranks=list(range(world)), group=None, mesh=None, cp_group=None, tp_group=None)
        self.group = layout.group
        self.world = len(layout.ranks)
        self.cp_group = layout.cp_group
        self.tp_mesh = layout.mesh["tp"] if layout.tp > 1 else None
        # ranks holding the same samples (a cp or tp group) count once in the token-mean metrics
        self.replicas = layout.replicas
        self.dp_rank, self.dp_world = layout.dp_rank, layout.dp_world

    def _logprobs(self, model: nn.Module, batch: TrainBatch | None) -> torch.Tensor:
        tokens = batch.tokens if batch is not None else torch.full(
            (1, 2), self.pad_id, dtype=torch.long, device=self.device)  # an empty slice: join the collectives
        if model is self.policy and (self.cp_group is not None or self.tp_mesh is not None):
            return self._split_logprobs_and_entropy(tokens)[0]  # the KL reference is a whole, unsplit copy
        return token_logprobs(model, tokens, temperature=self.temperature)

    def _split_logprobs_and_entropy(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The policy's logprobs and entropy of whole sequences, computed split over the cp or tp ranks."""
        if self.cp_group is not None:
            return cp_token_logprobs_and_entropy(self.policy, tokens, group=self.cp_group, pad_id=self.pad_id,
                                                 temperature=self.temperature)
        if self.tp_mesh is not None:
            return tp_token_logprobs_and_entropy(self.policy, tokens, tp_mesh=self.tp_mesh, pad_id=self.pad_id,
                                                 temperature=self.temperature)
        return token_logprobs_and_entropy(self.policy, tokens, temperature=self.temperature)

    def _clip(self) -> float:
        return float(clip_by_total_norm(list(self.policy.parameters()), self.max_grad_norm))

    def __call__(self, samples: list[Sample], advantages: list[float]) -> dict[str, float]:
        """One update on the global `samples` (with their advantages); the same call on every rank."""
        if len(samples) != len(advantages):
            raise ValueError(f"{len(samples)} samples but {len(advantages)} advantages")
        start = time.perf_counter()
        slices = self._slices(samples, advantages)
        with torch.no_grad():  # PPO's "old" policy: the batch's start (one update per batch: the current one)
            olds = [self._logprobs(self.policy, b) if self.minibatches > 1 else None for _, b, _ in slices]
            refs = [self._logprobs(self.reference, b) if self.reference is not None and b is not None else None
                    for _, b, _ in slices]

        totals: dict[str, float] = {}
        mismatch_max = torch.zeros((), device=self.device)
        mismatch = torch.zeros(2, device=self.device)  # (sum |old - behavior| over tokens, tokens)
        trained_tokens = 0
        for (tokens, batch, scale), old, ref in zip(slices, olds, refs):
            self.optimizer.zero_grad(set_to_none=True)
            if batch is None:
                logp = self._logprobs(self.policy, batch)
            else:
                logp, entropy = self._split_logprobs_and_entropy(batch.tokens)
            # what each rank adds to this minibatch's global values: loss, token-mean metrics (x tokens)
            contribution = torch.zeros(1 + len(TOKEN_MEAN_METRICS), device=self.device)
            if batch is None:
                (logp.sum() * 0.0).backward()
            else:
                old = logp.detach() if old is None else old
                with torch.no_grad():
                    diff = (old - batch.behavior_logprobs).abs() * batch.mask
                    mismatch_max = torch.maximum(mismatch_max, diff.max())
                    mismatch += torch.stack([diff.sum(), batch.mask.sum()])
                out = policy_loss(self.loss, logprobs=logp, advantages=batch.advantages, mask=batch.mask,
                                  old_logprobs=old, behavior_logprobs=batch.behavior_logprobs, ref_logprobs=ref)
                out.metrics["entropy"] = float((entropy * batch.mask).sum() / batch.mask.sum().clamp_min(1))
                (out.loss * scale).backward()
                local_tokens = float(batch.mask.sum())
                contribution[0] = out.loss.detach() * scale / self.world
                for j, name in enumerate(TOKEN_MEAN_METRICS):  # the cp / tp ranks of a group add the same value
                    contribution[1 + j] = out.metrics.get(name, 0.0) * local_tokens / max(tokens, 1) / self.replicas
                trained_tokens += batch.tokens.numel() // self.replicas
            grad_norm = self._clip()
            self.optimizer.step()
            if self.world > 1:
                dist.all_reduce(contribution, group=self.group)
            totals["loss"] = totals.get("loss", 0.0) + float(contribution[0])
            totals["grad_norm"] = totals.get("grad_norm", 0.0) + grad_norm
            for j, name in enumerate(TOKEN_MEAN_METRICS):
                totals[name] = totals.get(name, 0.0) + float(contribution[1 + j])
        self.optimizer.zero_grad(set_to_none=True)
        return self._metrics(totals, len(slices), mismatch_max, mismatch, trained_tokens, start, len(samples))

    def _slices(self, samples: list[Sample], advantages: list[float]) -> list[tuple[int, TrainBatch | None, float]]:
        """Per minibatch: (its tokens, this rank's TrainBatch or None, this rank's loss scale)."""
        token_mean = self.loss.aggregation == "token_mean"
        parts = [p for p in torch.arange(len(samples)).tensor_split(self.minibatches) if len(p)]
        slices = []
        for part in parts:
            mine = part.tensor_split(self.dp_world)[self.dp_rank].tolist()
            tokens = sum(sum(samples[i].loss_mask) for i in part.tolist())
            batch = (TrainBatch.from_samples([samples[i] for i in mine], [advantages[i] for i in mine],
                                             pad_id=self.pad_id, device=self.device) if mine else None)
            local = sum(sum(samples[i].loss_mask) for i in mine) if token_mean else len(mine)
            # FSDP averages over the dp_shard ranks, cp ones included: with cp, each rank's gradient is cp x its
            # share's (context_parallel_logprobs.py); tp ranks are not in FSDP's mesh and get their shards'
            # gradients whole (tensor_parallel_logprobs.py): so the data-parallel world is what the scale counts
            scale = self.dp_world * local / (tokens if token_mean else len(part))
            slices.append((tokens, batch, scale))
        return slices

    def _metrics(self, totals: dict[str, float], minibatches: int, mismatch_max: torch.Tensor,
                 mismatch: torch.Tensor, trained_tokens: int, start: float, samples: int) -> dict[str, float]:
        """The update's metrics: minibatch means, and the behaviour mismatch and throughput over all ranks."""
        counts = torch.tensor([float(trained_tokens)], device=self.device)
        if self.world > 1:
            dist.all_reduce(mismatch_max, op=dist.ReduceOp.MAX, group=self.group)
            dist.all_reduce(mismatch, group=self.group)
            dist.all_reduce(counts, group=self.group)
        seconds = time.perf_counter() - start
        metrics = {k: v / max(minibatches, 1) for k, v in totals.items()}
        metrics |= {"logprob_mismatch_max": float(mismatch_max),
                    "logprob_mismatch_mean": float(mismatch[0] / mismatch[1].clamp_min(1)),
                    "train_tokens_per_s": float(counts[0]) / max(seconds, 1e-9),
                    "trained_samples": float(samples)}
        if self.loss.tis_cap is None:  # reported as 0 by the fixed-size reduction above, but not measured
            del metrics["tis_weight_mean"], metrics["tis_truncated_frac"]
        assert all(math.isfinite(v) for v in metrics.values()), metrics
        return metrics
