"""The RL job: pretrain the policy on the task's supervised examples (titan-train's trainer), then GRPO-family
RL with titan-rl's rollouts, losses and generators, data-parallel over the ranks under torchrun.

Per step: every rank generates its share of the prompts with its generator (ShardedRollouts), all ranks
gather the same global batch, compute group advantages (and DAPO's dynamic sampling) from it, update the
FSDP-sharded policy on their slices (PolicyUpdate; with training.tensor_parallel or context_parallel split
further over groups of the trainer ranks, trainer_layout.py), and hand each generator the full new weights
(export_weights) with a version bump.

With generator.ranks = G > 0 the last G ranks only generate and the others only train (disaggregated.py):
rollouts stream from the generator ranks, and after each update the trainer's full weights go to them by
broadcast on a group of their own. Every step's metrics split its time into rollout_seconds (making, or
waiting for, the rollouts), train_seconds and weight_sync_seconds.
"""
from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

import titan_models as tm
import titan_rl

from ..cli_args import check_types
from ..data import ByteTokenizer as TrainByteTokenizer
from ..model_setup import build_on_meta, model_config
from ..process_group import process_group, select_device
from .build import check_tensor_parallel, make_algorithm, make_sampling, validate
from .config import RLConfig
from .disaggregated import (
    Roles,
    generator_dtype,
    generator_seed,
    leave_together,
    make_roles,
    remote_rollouts,
    serve_generator,
)
from .episodes import make_episodes
from .policy import build_copy, build_policy, export_weights, initial_weights, share_full_state
from .pretrain import policy_model_config, pretrain
from .report import MetricsFile, RLProgress, text_plot, write_curve, write_curve_png
from .rollouts import DisaggregatedRollouts, GlobalBatch, ShardedRollouts, greedy_eval
from .trainer_layout import TrainerLayout, make_trainer_layout
from .update import PolicyUpdate


@dataclass
class RLResult:
    curve: list[dict[str, float]] = field(default_factory=list)
    """One record per RL step (as in rl_metrics.jsonl)."""
    evals: dict[int, float] = field(default_factory=dict)
    """RL step -> mean reward of greedy answers to the held-out problems (step 0: before RL)."""
    pretrain_losses: dict[int, float] = field(default_factory=dict)
    folder: Path = Path(".")
    seconds: float = 0.0


def run_rl(config: RLConfig) -> RLResult:
    """Run the RL job `config` describes (under torchrun: this process's rank of it)."""
    check_types(config)
    world = dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", "1"))
    validate(config, world_size=world)
    device = select_device(config.job.device)
    with process_group(device):
        return RLJob(config, device).run()


def _make_generator(config: RLConfig, model: torch.nn.Module, pad_id: int, *, seed: int | None = None
                    ) -> titan_rl.Generator:
    """The generator on `model` (a vLLM engine is started in this process; seed: its sampling seed, None:
    job.seed)."""
    if config.generator.kind == "vllm":  # validate() checked that vLLM is installed
        from titan_rl.vllm.generator import VLLMGenerator

        return VLLMGenerator.from_model(model, batch_invariant=config.generator.batch_invariant,
                                        seed=config.job.seed if seed is None else seed)
    return titan_rl.BuiltinGenerator(model, pad_id=pad_id)


class RLJob:
    def __init__(self, config: RLConfig, device: torch.device) -> None:
        self.config, self.device = config, device
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.world = dist.get_world_size() if dist.is_initialized() else 1
        self.folder = Path(config.job.folder)
        self.tokenizer = titan_rl.ByteTokenizer()
        # Pretraining reads its examples through titan-train's byte tokenizer: the ids must be the same.
        assert (self.tokenizer.eos_id, self.tokenizer.vocab_size) == (TrainByteTokenizer.eos_id,
                                                                     TrainByteTokenizer.vocab_size)
        self.episodes = make_episodes(config.env)
        self.algorithm = make_algorithm(config.algorithm)
        stops = tuple(tuple(self.tokenizer.encode(s)) for s in self.episodes.stop_strings)
        self.sampling = make_sampling(config.rollout, eos_id=self.tokenizer.eos_id, stop_sequences=stops)
        self.model_cfg = model_config(policy_model_config(config), vocab_needed=self.tokenizer.vocab_size)
        check_tensor_parallel(build_on_meta(self.model_cfg), config.training.tensor_parallel)

    def _say(self, text: str) -> None:
        if self.rank == 0:
            print(f"titan-train rl: {text}", flush=True)

    def run(self) -> RLResult:
        c = self.config
        began = time.perf_counter()
        if c.job.threads:
            torch.set_num_threads(c.job.threads)  # for this process, as the field's doc says
        result = RLResult(folder=self.folder)
        self._announce()
        # 1. Pretraining: the format of the task (and some of its skill), by titan-train's trainer.
        if c.pretrain.steps:
            full, pre = pretrain(c, self.episodes.demonstration, self.device)
            result.pretrain_losses = pre.losses
        else:
            full = initial_weights(self.model_cfg, seed=c.policy.init_seed)
        roles = make_roles(c.generator.ranks) if c.generator.ranks else None
        layout = make_trainer_layout(roles.trainers if roles is not None else list(range(self.world)),
                                     group=roles.trainer_group if roles is not None else None,
                                     cp=c.training.context_parallel, tp=c.training.tensor_parallel,
                                     device=self.device)  # every rank: it creates the trainers' groups
        if roles is not None and not roles.is_trainer:
            del full
            # each generator rank its own engine, sampling its own stream (as torch's seed in serve_generator)
            seed = generator_seed(c, roles.generators.index(self.rank))
            serve_generator(self, roles, lambda model: _make_generator(c, model, self.tokenizer.pad_id, seed=seed))
            leave_together()
            result.seconds = time.perf_counter() - began
            return result
        policy, generator, update, rollouts = self._build(full, roles, layout)
        del full
        t = c.training
        eval_group = roles.trainer_group if roles is not None else None

        def evaluate(step: int) -> float | None:
            nonlocal generator
            if not c.eval.problems:
                return None
            if roles is not None:  # the generators are elsewhere: a local copy of the policy answers
                generator = self._eval_generator(generator, policy, step)
            reward = greedy_eval(make_env=self.episodes.make_eval_env, generator=generator, tokenizer=self.tokenizer,
                                 problems=c.eval.problems, sampling=self.sampling, seed=c.job.seed,
                                 max_turns=self.episodes.max_turns, group=eval_group)
            result.evals[step] = reward
            return reward

        # 3. RL.
        before = evaluate(0)
        if before is not None:
            self._say(f"greedy reward on {c.eval.problems} held-out problems before RL: {before:.3f}")
        metrics_file = MetricsFile(self.folder) if self.rank == 0 else None
        progress = RLProgress(t.steps, enabled=self.rank == 0 and c.metrics.progress,
                              log_interval=c.metrics.log_interval)
        version, dropped_total, rl_began = 0, 0, time.perf_counter()
        try:
            for step in range(1, t.steps + 1):
                step_began = time.perf_counter()
                m = self._step(rollouts, update, version)
                version += 1
                sync_began = time.perf_counter()
                rollouts.publish(policy, version)
                if self.device.type == "cuda":  # the copies into the generator are asynchronous: time them whole
                    torch.cuda.synchronize(self.device)
                m["weight_sync_seconds"] = time.perf_counter() - sync_began
                dropped_total += int(m["dropped_samples"])
                m |= {"step": step, "dropped_samples_total": dropped_total,
                      "step_seconds": time.perf_counter() - step_began, "seconds": time.perf_counter() - rl_began}
                last = step == t.steps
                reward = evaluate(step) if (c.eval.interval and step % c.eval.interval == 0) or last else None
                if reward is not None:
                    m["eval_reward"] = reward
                result.curve.append(m)
                if metrics_file is not None:
                    metrics_file.write(m)
                progress.update(step, m, reward)
        finally:
            progress.close()
            rollouts.close()
            if metrics_file is not None:
                metrics_file.close()
        result.seconds = time.perf_counter() - began
        if self.rank == 0:
            self._report(result)
        if roles is not None:
            leave_together()
        return result

    def _announce(self) -> None:
        c = self.config
        n_params = tm.count_params(self.model_cfg).total
        self._say(f"{c.algorithm.name} on {c.env.task}, {c.policy.family} {c.policy.flavor} with "
                  f"{self.model_cfg.num_layers} layers ({n_params / 1e6:.1f}M parameters) on {self.device.type}, "
                  f"{self._layout()}; pretraining {c.pretrain.steps} steps, "
                  f"then {c.training.steps} RL steps of {c.rollout.prompts_per_step} prompts x "
                  f"{c.algorithm.group_size} samples; output in {self.folder}")

    def _layout(self) -> str:
        t, generators = self.config.training, self.config.generator.ranks
        trainers = self.world - generators
        split = [f"FSDP over {trainers // t.tensor_parallel}"] if trainers > t.tensor_parallel else []
        split += [f"{name} {degree}" for name, degree in (("TP", t.tensor_parallel), ("CP", t.context_parallel))
                  if degree > 1]
        shown = f" ({', '.join(split)})" if split else ""
        if not generators:
            return f"{self.world} rank(s){shown}"
        return (f"{trainers} trainer rank(s){shown} + {generators} generator rank(s) "
                f"({self.config.generator.kind}, {self.config.generator.dtype} weights)")

    def _build(self, full: dict[str, torch.Tensor], roles: Roles | None, layout: TrainerLayout):
        """The policy (sharded), each rank's generator (full weights; None on the trainer ranks of disaggregated
        generation, whose generators are elsewhere), the update and the rollouts, from the initial weights
        `full` (rank 0's)."""
        c = self.config
        torch.manual_seed(generator_seed(c, self.rank))  # rollouts sample different tokens on each rank
        invariant = c.generator.batch_invariant
        group = roles.trainer_group if roles is not None else None
        if roles is not None:
            full = share_full_state(self.model_cfg, full, group=group, src=roles.leader, device=self.device)
        policy = build_policy(self.model_cfg, full, device=self.device, batch_invariant=invariant, layout=layout)
        weights = export_weights(policy)
        generator = None
        if roles is None:
            generator_model = build_copy(self.model_cfg, weights, device=self.device, batch_invariant=invariant,
                                         dtype=generator_dtype(c, self.model_cfg.dtype))
            generator = _make_generator(c, generator_model, self.tokenizer.pad_id)
        reference = (build_copy(self.model_cfg, weights, device=self.device, batch_invariant=invariant)
                     if c.algorithm.kl_coef > 0 or c.algorithm.track_kl else None)
        del weights
        t = c.training
        optimizer = torch.optim.AdamW(policy.parameters(), lr=t.lr, betas=(t.beta1, t.beta2),
                                      weight_decay=t.weight_decay)
        update = PolicyUpdate(policy=policy, optimizer=optimizer, loss=self.algorithm.loss, minibatches=t.minibatches,
                              max_grad_norm=t.max_grad_norm, temperature=c.rollout.temperature,
                              pad_id=self.tokenizer.pad_id, reference=reference, layout=layout)
        if roles is not None:
            rollouts = DisaggregatedRollouts(remote_rollouts(c, roles, self.device))
            rollouts.publish(policy, 0)  # the generators start from the initial weights, through the same path
            return policy, generator, update, rollouts
        rollouts = ShardedRollouts(make_env=self.episodes.make_env, generator=generator,
                                   tokenizer=self.tokenizer, sampling=self.sampling,
                                   group_size=self.algorithm.group_size, groups_per_step=c.rollout.prompts_per_step,
                                   max_policy_lag=c.rollout.max_policy_lag, seed=c.job.seed,
                                   max_turns=self.episodes.max_turns)
        return policy, generator, update, rollouts

    def _eval_generator(self, generator: titan_rl.BuiltinGenerator | None, policy: torch.nn.Module,
                        version: int) -> titan_rl.BuiltinGenerator:
        """The trainer ranks' own built-in generator for greedy evaluation under disaggregated generation, made
        on first use and given the policy's current weights (a collective of the trainer ranks)."""
        weights = export_weights(policy)
        if generator is None:
            model = build_copy(self.model_cfg, weights, device=self.device,
                               batch_invariant=self.config.generator.batch_invariant,
                               dtype=generator_dtype(self.config, self.model_cfg.dtype))
            return titan_rl.BuiltinGenerator(model, pad_id=self.tokenizer.pad_id, policy_version=version)
        generator.update_weights(weights, version=version)
        return generator

    def _step(self, rollouts: ShardedRollouts | DisaggregatedRollouts, update: PolicyUpdate,
              version: int) -> dict[str, float]:
        """One RL step's rollouts, advantages and update (a collective: every rank runs it alike)."""
        algo = self.algorithm
        began = time.perf_counter()
        batch = rollouts.get(version)
        dropped = batch.dropped_samples
        rewards, advantages, keep = self._advantages(batch)
        refills = 0
        while algo.drop_uninformative_groups and not bool(keep.any()) and refills < algo.max_refill_rounds:
            refills += 1  # dynamic sampling: every group was uninformative; draw a fresh batch
            batch = rollouts.get(version)
            dropped += batch.dropped_samples
            rewards, advantages, keep = self._advantages(batch)
        rollout_seconds = time.perf_counter() - began
        train_samples, train_advantages = [], []
        for j in range(rewards.shape[0]):
            if keep[j]:
                group = batch.samples[j * algo.group_size:(j + 1) * algo.group_size]
                train_samples += group
                train_advantages += advantages[j].tolist()
        samples = batch.samples
        m = {
            "reward_mean": float(rewards.mean()), "reward_std": float(rewards.std()) if rewards.numel() > 1 else 0.0,
            "adv_std": float(advantages.std()) if advantages.numel() > 1 else 0.0,
            "adv_abs_max": float(advantages.abs().max()),
            "staleness": float(version - batch.policy_version), "dropped_samples": float(dropped),
            "filtered_groups": float((~keep).sum()), "refills": float(refills),
            "gen_tokens_per_s": batch.generated_tokens / max(batch.generation_seconds, 1e-9),
            "completion_len": sum(len(s.completion) for s in samples) / len(samples),
            "policy_version": float(version), "rollout_seconds": rollout_seconds,
            "generation_seconds": batch.generation_seconds,
        }
        began = time.perf_counter()
        if train_samples:
            m |= update(train_samples, train_advantages)
        else:
            m |= {"loss": 0.0, "kl": 0.0, "train_tokens_per_s": 0.0, "logprob_mismatch_max": 0.0,
                  "logprob_mismatch_mean": 0.0, "trained_samples": 0.0}
        m["train_seconds"] = time.perf_counter() - began
        return m

    def _advantages(self, batch: GlobalBatch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """rewards and advantages [groups, group_size], keep [groups] from the batch (samples in group order)."""
        n = self.algorithm.group_size
        groups = [s.group for s in batch.samples]
        assert groups == sorted(groups) and len(groups) % n == 0 and all(
            len(set(groups[i:i + n])) == 1 for i in range(0, len(groups), n)), "samples come whole groups, in order"
        rewards = torch.tensor([s.reward for s in batch.samples]).view(-1, n)
        advantages, keep = self.algorithm.advantages(rewards)
        return rewards, advantages, keep

    def _report(self, result: RLResult) -> None:
        c, curve = self.config, result.curve
        k = max(1, min(10, len(curve) // 4))
        first = sum(r["reward_mean"] for r in curve[:k]) / k
        last = sum(r["reward_mean"] for r in curve[-k:]) / k
        print(text_plot([r["reward_mean"] for r in curve], label="sampled reward"), flush=True)
        write_curve(self.folder / "rl_curve.csv", curve)
        write_curve_png(self.folder / "rl_metrics.jsonl", self.folder / "rl_curve.png")
        summary = {
            "reward_first_steps": first, "reward_last_steps": last, "steps_averaged": k,
            "eval_reward": {str(s): r for s, r in result.evals.items()},
            "pretrain_loss": {str(s): v for s, v in result.pretrain_losses.items()},
            "seconds": result.seconds, "ranks": self.world, "config": asdict(c),
        }
        (self.folder / "rl_summary.json").write_text(json.dumps(summary, indent=1))
        evals = sorted(result.evals.items())
        evaluated = (f"; greedy reward on {c.eval.problems} held-out problems {evals[0][1]:.3f} -> {evals[-1][1]:.3f}"
                     if len(evals) > 1 else "")
        self._say(f"done, {len(curve)} steps in {result.seconds:.0f} s: sampled reward {first:.3f} (first {k} "
                  f"steps) -> {last:.3f} (last {k}){evaluated}; curve in {self.folder / 'rl_curve.csv'} and "
                  f"rl_curve.png, every metric in {self.folder / 'rl_metrics.jsonl'}")
