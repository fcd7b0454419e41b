"""Disaggregated generation (generator.ranks = G > 0): the world's first ranks train, its last G generate.

Each group has its own layout: the trainer ranks split the policy over their own groups (FSDP, with tensor
or context parallelism: trainer_layout.py); each
generator rank holds the whole model in the generator's dtype (data-parallel generators, TP1) and its own
engine (the built-in generator, or a vLLM engine started by that rank's process, never the trainer's).
Three process groups, made by every rank in the same order:

    trainer   the trainer ranks: FSDP, the loss's reductions, the rollout batch broadcast (and within
              them the tp / cp / dp groups of trainer_layout.py, which the generator ranks create too)
    sync      trainer leader (rank 0) + generator ranks: the weights, broadcast from the leader
              (titan_rl.weight_sync: header, then the tensors in the generators' dtype)
    rollout   trainer leader + generator ranks (gloo): rollout batches, point to point to the leader
              (titan_rl.remote_rollouts describes the protocol and the staleness bound)

Pretraining runs before the split, on all ranks. A generator rank receives the initial weights (version
0), builds its generator on them, then serves (`serve_generator`) until the trainer stops it.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

import titan_rl

from .config import RLConfig
from .policy import build_copy
from .rollouts import rollout_share

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclass(kw_only=True)
class Roles:
    trainers: list[int]
    generators: list[int]
    trainer_group: dist.ProcessGroup
    sync_group: dist.ProcessGroup
    rollout_group: dist.ProcessGroup

    @property
    def leader(self) -> int:
        return self.trainers[0]

    @property
    def is_trainer(self) -> bool:
        return dist.get_rank() in self.trainers


def make_roles(generator_ranks: int) -> Roles:
    """The split of the world and its groups (a collective: every rank calls it)."""
    world = dist.get_world_size()
    trainers, generators = list(range(world - generator_ranks)), list(range(world - generator_ranks, world))
    trainer_group = dist.new_group(trainers)
    sync_group = dist.new_group([trainers[0], *generators])
    rollout_group = dist.new_group([trainers[0], *generators], backend="gloo")  # pickled batches, on the CPU
    return Roles(trainers=trainers, generators=generators, trainer_group=trainer_group, sync_group=sync_group,
                 rollout_group=rollout_group)


def generator_dtype(config: RLConfig, policy_dtype: torch.dtype) -> torch.dtype:
    return policy_dtype if config.generator.dtype == "auto" else DTYPES[config.generator.dtype]


def generator_seed(config: RLConfig, index: int) -> int:
    """The sampling seed of generator `index` (as rank `index`'s in a colocated run, RLJob._build)."""
    return config.job.seed * 1000 + index


def serve_generator(job, roles: Roles, make_generator) -> titan_rl.remote_rollouts.ServerStats:
    """A generator rank's whole run: receive the initial weights, build the generator, serve rollouts.

    job: the RLJob (config, device, model config, task, tokenizer, sampling); make_generator(model) builds
    the generator (builtin or vLLM) on the model holding the initial weights."""
    c = job.config
    model = build_copy(job.model_cfg, None, device=job.device, batch_invariant=c.generator.batch_invariant,
                       dtype=generator_dtype(c, job.model_cfg.dtype))
    receiver = titan_rl.WeightReceiver(model, group=roles.sync_group, source=roles.leader, planner=roles.generators[0])
    first = receiver.receive()
    assert first.kind == titan_rl.weight_sync.WEIGHTS, "the trainer starts by sending the initial weights"
    with torch.no_grad():
        model.load_state_dict(first.weights)
    index = roles.generators.index(dist.get_rank())
    # each generator samples its own tokens, from a stream set by its index among the generators (not by the
    # number of trainer ranks before it): generator j samples as rank j of a colocated run would
    torch.manual_seed(generator_seed(c, index))
    generator = make_generator(model)
    generator.policy_version = first.version

    def produce(batch_index: int) -> titan_rl.RolloutBatch:
        return rollout_share(batch_index=batch_index, rank=index, world=len(roles.generators),
                             make_env=job.episodes.make_env, generator=generator, tokenizer=job.tokenizer,
                             sampling=job.sampling, group_size=job.algorithm.group_size,
                             groups_per_step=c.rollout.prompts_per_step, seed=c.job.seed,
                             max_turns=job.episodes.max_turns)

    server = titan_rl.RolloutServer(generator=generator, receiver=receiver, produce=produce,
                                    max_policy_lag=c.rollout.max_policy_lag, leader=roles.leader,
                                    rollout_group=roles.rollout_group, consumed=first.consumed)
    return server.run()


def leave_together() -> None:
    """The end of a disaggregated run, on every rank of the world (trainers and generators): a barrier, so
    that no rank returns (and goes on to destroy its process groups and exit) before every rank is past its
    last message. Without it they leave one by one: trainer rank 1 as soon as the last weight gather is
    done, while the leader still broadcasts that update to the generators, stops them and drains their
    rollouts, and each generator rank once its last send is taken; the first to exit closes its gloo
    connections while the others still communicate or tear down theirs."""
    dist.barrier()


def remote_rollouts(config: RLConfig, roles: Roles, device: torch.device) -> titan_rl.RemoteRollouts:
    """The trainer ranks' end of the rollout stream and weight sync (the leader's sender is built here)."""
    sender = None
    if dist.get_rank() == roles.leader:
        sender = titan_rl.WeightSender(group=roles.sync_group, source=roles.leader, planner=roles.generators[0],
                                       device=device)
    return titan_rl.RemoteRollouts(generator_ranks=roles.generators, leader=roles.leader,
                                   max_policy_lag=config.rollout.max_policy_lag, trainer_group=roles.trainer_group,
                                   rollout_group=roles.rollout_group, sender=sender)
