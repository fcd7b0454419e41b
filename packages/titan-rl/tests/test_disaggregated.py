"""Disaggregated generation on 4 gloo ranks: ranks 0-1 train an FSDP2-sharded policy, ranks 2-3 generate
(RolloutServer) and stream rollouts to rank 0 (RemoteRollouts), getting the weights back by broadcast on
a sync group of their own (WeightSender / WeightReceiver).

- fp32 generators, on-policy (max_policy_lag 0), batch-invariant: after every update each generator's
  weights are bitwise the trainer's full weights (gathered independently, by get_model_state_dict), and the
  trainer's logprobs of every consumed sample are bitwise the generator's.
- bf16 generators, max_policy_lag 1, generator 3 slowed down: the weights that arrive are bitwise the bf16
  rounding of the trainer's fp32 masters (bf16 on the wire), and every consumed part was made at most one
  version before the trainer's current one (and some exactly one: generator 2 runs ahead).
- a tensor-parallel trainer layout (each weight a DTensor sharded over the 2 trainer ranks on dim 0 or 1,
  as column- and row-wise TP shard them, some unevenly): full_tensors reshards it, and the generators get
  bitwise what the same updates give on an unsharded copy.

Control (by hand): letting the generators run 3 batches further ahead than the bound allows made the
trainer drop 72 samples in the on-policy scenario and 24 in the slow one, failing both staleness tests.
"""
from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import pytest
import titan_models as tm
import torch

import titan_rl
from titan_rl import CharTokenizer, SamplingConfig, collect_rollouts
from titan_rl.envs import SingleTurn, SortingTask

TOK = CharTokenizer("0123456789sort:=\n")
TRAINERS, GENERATORS, PROMPTS, GROUP, STEPS = [0, 1], [2, 3], 4, 2, 4
SCENARIOS = {  # name: (generator dtype, max_policy_lag, seconds generator 3 sleeps per generate call)
    "fp32-sync": (torch.float32, 0, 0.0),
    "bf16-lag1-slow": (torch.bfloat16, 1, 0.3),
}


def tiny_policy(dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    config = tm.llama3.Llama3Config(vocab_size=TOK.vocab_size, dim=64, num_layers=2, num_heads=1, num_kv_heads=1,
                                    ffn_dim=192, max_seq_len=128, dtype=dtype)
    with torch.device("meta"):
        model = config.build()
    model.to_empty(device="cpu")
    model.init_weights(seed=0)
    titan_rl.batch_invariant(model)
    return model


class Recording:
    """A generator that keeps a copy of its model's weights at every version it receives (and can be slowed)."""

    def __init__(self, inner: titan_rl.BuiltinGenerator, delay: float) -> None:
        self.inner, self.delay, self.snapshots = inner, delay, {}

    @property
    def policy_version(self) -> int:
        return self.inner.policy_version

    def generate(self, prompts, sampling):
        time.sleep(self.delay)
        return self.inner.generate(prompts, sampling)

    def update_weights(self, state_dict, *, version):
        self.inner.update_weights(state_dict, version=version)
        self.snapshots[version] = {k: v.clone() for k, v in self.inner.model.state_dict().items()}


def _generator_rank(rank, groups, dtype, lag, delay, folder, name):
    sync, rollout = groups["sync"], groups["rollout"]
    model = tiny_policy().to(dtype).requires_grad_(False)
    receiver = titan_rl.WeightReceiver(model, group=sync, source=0, planner=GENERATORS[0], bucket_bytes=20_000)
    first = receiver.receive()
    generator = Recording(titan_rl.BuiltinGenerator(model, pad_id=TOK.pad_id), delay if rank == 3 else 0.0)
    generator.update_weights(first.weights, version=first.version)
    torch.manual_seed(rank)
    share, j = PROMPTS // len(GENERATORS), GENERATORS.index(rank)
    sampling = SamplingConfig(max_new_tokens=4, stop_token_ids=(TOK.eos_id,))

    def produce(index: int) -> titan_rl.RolloutBatch:
        first_group = index * PROMPTS + j * share
        return collect_rollouts(make_env=lambda: SingleTurn(SortingTask(min_length=3, max_length=3)),
                                seeds=list(range(first_group, first_group + share)), group_size=GROUP,
                                generator=generator, tokenizer=TOK, sampling=sampling, first_group=first_group)

    stats = titan_rl.RolloutServer(generator=generator, receiver=receiver, produce=produce, max_policy_lag=lag,
                                   leader=0, rollout_group=rollout, consumed=first.consumed).run()
    torch.save({"snapshots": generator.snapshots, "batches": stats.batches}, os.path.join(folder, f"{name}-gen{rank}.pt"))


def _trainer_rank(rank, groups, lag, folder, name):
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    policy = tiny_policy()
    mesh = DeviceMesh.from_group(groups["trainer"], "cpu", mesh_dim_names=("dp_shard",))
    for block in policy.layers.values():
        fully_shard(block, mesh=mesh)
    fully_shard(policy, mesh=mesh)
    optimizer = torch.optim.AdamW(policy.parameters(), lr=1e-2)
    sender = titan_rl.WeightSender(group=groups["sync"], source=0, planner=GENERATORS[0]) if rank == 0 else None
    remote = titan_rl.RemoteRollouts(generator_ranks=GENERATORS, leader=0, max_policy_lag=lag,
                                     trainer_group=groups["trainer"], rollout_group=groups["rollout"], sender=sender)
    full = lambda: get_model_state_dict(policy, options=StateDictOptions(full_state_dict=True))  # noqa: E731
    trainer_weights = {0: full()}
    remote.publish(titan_rl.full_tensors(policy), version=0)
    lags, mismatches = [], []
    for version in range(STEPS):
        batch = remote.get(version)
        lags.append([version - part.policy_version for part in batch.parts])
        samples = [s for part in batch.parts for s in part.samples]
        tb = titan_rl.TrainBatch.from_samples(samples, [1.0] * len(samples), pad_id=TOK.pad_id, device="cpu")
        with torch.no_grad():
            logp = titan_rl.token_logprobs(policy, tb.tokens)
        mismatches.append(float(((logp - tb.behavior_logprobs).abs() * tb.mask).max()))
        mine = slice(rank * len(samples) // 2, (rank + 1) * len(samples) // 2)
        loss = -(titan_rl.token_logprobs(policy, tb.tokens[mine]) * tb.mask[mine]).sum() / tb.mask[mine].sum()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        remote.publish(titan_rl.full_tensors(policy), version=version + 1)
        trainer_weights[version + 1] = full()
    remote.close(version=STEPS)
    if rank == 0:
        torch.save({"weights": trainer_weights, "lags": lags, "mismatches": mismatches,
                    "dropped": remote.stats.dropped_samples}, os.path.join(folder, f"{name}-trainer.pt"))
    dist.barrier(group=groups["trainer"])


def _tp_layout(rank, groups, folder):
    """Weights sharded over the trainer ranks on dim 0 or 1, updated in place twice, sent after each."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import Shard, distribute_tensor

    if rank not in TRAINERS:
        model = tiny_policy().requires_grad_(False)
        receiver = titan_rl.WeightReceiver(model, group=groups["sync"], source=0, planner=GENERATORS[0],
                                           bucket_bytes=50_000)
        received = {}
        while (message := receiver.receive()).kind == titan_rl.weight_sync.WEIGHTS:
            received[message.version] = message.weights
        torch.save(received, os.path.join(folder, f"tp-gen{rank}.pt"))
        return
    policy, reference = tiny_policy(), tiny_policy()
    mesh = DeviceMesh.from_group(groups["trainer"], "cpu", mesh_dim_names=("tp",))
    for module_name, module in policy.named_modules():
        for name, param in list(module.named_parameters(recurse=False)):
            rowwise = param.dim() == 2 and module_name.endswith(("wo", "w2"))
            module.register_parameter(name, torch.nn.Parameter(
                distribute_tensor(param.detach(), mesh, [Shard(1 if rowwise else 0)]), requires_grad=False))
    assert all(isinstance(p, torch.distributed.tensor.DTensor) for p in policy.parameters())
    sender = titan_rl.WeightSender(group=groups["sync"], source=0, planner=GENERATORS[0]) if rank == 0 else None
    expected = {}
    for version in range(3):
        if version:
            with torch.no_grad():
                for model in (policy, reference):
                    for p in model.parameters():
                        p.mul_(1.5).add_(1e-3)
        stream = titan_rl.full_tensors(policy)
        if sender is not None:
            sender.send_weights(stream, version=version, consumed=0)
        else:
            for _ in stream:
                pass
        expected[version] = {k: v.clone() for k, v in reference.state_dict().items()}
    if sender is not None:
        sender.stop(version=2, consumed=0)
        torch.save(expected, os.path.join(folder, "tp-trainer.pt"))
    dist.barrier(group=groups["trainer"])


def _rank_main(rank: int, world: int, init_method: str, folder: str) -> None:
    import torch.distributed as dist
    from rank_runner import join_gloo

    torch.set_num_threads(1)
    join_gloo(rank, world, init_method)
    try:
        for name, (dtype, lag, delay) in SCENARIOS.items():
            groups = {"trainer": dist.new_group(TRAINERS), "sync": dist.new_group([0, *GENERATORS]),
                      "rollout": dist.new_group([0, *GENERATORS])}  # every rank creates every group, in order
            if rank in TRAINERS:
                _trainer_rank(rank, groups, lag, folder, name)
            else:
                _generator_rank(rank, groups, dtype, lag, delay, folder, name)
            dist.barrier()
        _tp_layout(rank, {"trainer": dist.new_group(TRAINERS), "sync": dist.new_group([0, *GENERATORS])}, folder)
    finally:
        dist.destroy_process_group()
    os._exit(0)  # torch sometimes aborts at interpreter exit after gloo


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory):
    folder = tmp_path_factory.mktemp("disaggregated")
    sys.path.insert(0, str(Path(__file__).parent))  # rank_runner, for the spawned children too
    from rank_runner import file_rendezvous, spawn_ranks

    spawn_ranks(_rank_main, 4, (4, file_rendezvous(folder), str(folder)))
    return folder


def _load(folder, name):
    trainer = torch.load(folder / f"{name}-trainer.pt")
    generators = [torch.load(folder / f"{name}-gen{rank}.pt") for rank in GENERATORS]
    return trainer, generators


def test_generators_hold_the_trainers_full_weights_bitwise_after_every_update(four_ranks):
    trainer, generators = _load(four_ranks, "fp32-sync")
    weights = trainer["weights"]
    assert sorted(weights) == list(range(STEPS + 1))
    assert not torch.equal(weights[0]["output.weight"], weights[STEPS]["output.weight"])  # the updates moved them
    for gen in generators:
        assert sorted(gen["snapshots"]) == list(range(STEPS + 1))
        for version, state in gen["snapshots"].items():
            assert state.keys() == weights[version].keys()
            for name, tensor in state.items():
                assert tensor.dtype == torch.float32 and torch.equal(tensor, weights[version][name]), (version, name)


def test_batch_invariant_trainer_and_generator_logprobs_agree_bitwise(four_ranks):
    trainer, _ = _load(four_ranks, "fp32-sync")
    assert trainer["lags"] == [[0, 0]] * STEPS  # on-policy: every part made with the trainer's current weights
    assert trainer["dropped"] == 0  # because the generators waited for each update, not by dropping
    assert trainer["mismatches"] == [0.0] * STEPS


def test_bf16_generators_get_the_bf16_rounding_of_the_fp32_masters(four_ranks):
    trainer, generators = _load(four_ranks, "bf16-lag1-slow")
    weights = trainer["weights"]
    for gen in generators:
        for version, state in gen["snapshots"].items():
            for name, tensor in state.items():
                master = weights[version][name]
                assert master.dtype == torch.float32 and tensor.dtype == torch.bfloat16
                assert torch.equal(tensor, master.to(torch.bfloat16)), (version, name)
    # The masters are not bf16-representable, so what was compared is a rounding, not a copy.
    master = weights[STEPS]["layers.0.attention.wq.weight"]
    assert not torch.equal(master.to(torch.bfloat16).float(), master)


def test_staleness_bound_holds_under_a_slow_generator(four_ranks):
    trainer, generators = _load(four_ranks, "bf16-lag1-slow")
    lags = [lag for step in trainer["lags"] for lag in step]
    assert max(lags) == 1 and min(lags) >= 0, trainer["lags"]  # within the bound, and the bound was used
    assert trainer["dropped"] == 0  # the generators waited instead of making batches the trainer must drop
    # The fast generator made batches ahead of the trainer (drained at the end); the slow one did not get ahead.
    assert generators[0]["batches"] >= STEPS and generators[1]["batches"] >= STEPS


def test_a_tensor_parallel_trainer_layout_reaches_the_generators_whole(four_ranks):
    expected = torch.load(four_ranks / "tp-trainer.pt")
    for rank in GENERATORS:
        received = torch.load(four_ranks / f"tp-gen{rank}.pt")
        assert sorted(received) == [0, 1, 2]
        for version, state in received.items():
            assert state.keys() == expected[version].keys()
            for name, tensor in state.items():
                assert torch.equal(tensor, expected[version][name]), (version, name)
