"""A generator rank whose rollouts fail, on 2 gloo ranks (rank 0 the trainer leader, rank 1 a RolloutServer
whose second batch raises): the failure reaches both ends and both shut down in order.

- the generator's run() raises the batch's error only once its weight-receiver thread has ended (the
  trainer's STOP ends it), so its caller never destroys the process groups under a thread still inside a
  broadcast on the sync group;
- the trainer's get() raises at the generator's final `None`, and close() then returns: it does not wait
  for a second `None` from that generator (before, the drain blocked until gloo's timeout).

Control (by hand): on the previous titan_rl (run() joined the thread on its normal path only, close() drained
every generator, an assert at the early `None`) this test fails: the ranks did not finish, they were killed
at the deadline and the trainer never reported.
"""
from __future__ import annotations

import json
import os
import sys
import threading
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp

import titan_rl

DEADLINE_S = 240  # three processes' imports on a loaded 2-core machine, then well under a second of work


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Linear(4, 3)


def _batch(version: int) -> titan_rl.RolloutBatch:
    sample = titan_rl.Sample(prompt=[1, 2], completion=[3], loss_mask=[1], behavior_logprobs=torch.zeros(1),
                             reward=1.0, group=0, policy_version=version)
    return titan_rl.RolloutBatch(samples=[sample], generated_tokens=1, seconds=0.0)


class _Weights:
    """The generator's side of the weights: it only takes their version."""

    policy_version = 0

    def update_weights(self, state_dict, *, version: int) -> None:
        self.policy_version = version


def _generator(sync, rollout, folder: str) -> None:
    receiver = titan_rl.WeightReceiver(_model(), group=sync, source=0, planner=1)
    first = receiver.receive()
    weights = _Weights()

    def produce(index: int) -> titan_rl.RolloutBatch:
        if index == 1:
            raise ValueError("the second batch fails")
        return _batch(weights.policy_version)

    server = titan_rl.RolloutServer(generator=weights, receiver=receiver, produce=produce, max_policy_lag=0,
                                    leader=0, rollout_group=rollout, consumed=first.consumed)
    outcome = {}
    try:
        server.run()
    except Exception as error:  # noqa: BLE001 (reported to the test)
        outcome["raised"] = f"{type(error).__name__}: {error} / {error.__cause__!r}"
    outcome["receiver_alive"] = any(t.name == "titan-rl-weights" and t.is_alive() for t in threading.enumerate())
    Path(folder, "generator.json").write_text(json.dumps(outcome))


def _trainer(sync, rollout, folder: str) -> None:
    sender = titan_rl.WeightSender(group=sync, source=0, planner=1)
    remote = titan_rl.RemoteRollouts(generator_ranks=[1], leader=0, max_policy_lag=0, trainer_group=None,
                                     rollout_group=rollout, sender=sender)
    model = _model()
    remote.publish(model.state_dict().items(), version=0)
    outcome = {"first": remote.get(0).policy_version}
    remote.publish(model.state_dict().items(), version=1)
    try:
        remote.get(1)
    except RuntimeError as error:
        outcome["raised"] = str(error)
    remote.close(version=1)
    outcome["closed"] = True
    Path(folder, "trainer.json").write_text(json.dumps(outcome))


def _rank_main(rank: int, init_method: str, folder: str) -> None:
    import torch.distributed as dist
    from rank_runner import join_gloo

    join_gloo(rank, 2, init_method)
    try:
        sync, rollout = dist.new_group([0, 1]), dist.new_group([0, 1], backend="gloo")
        (_trainer if rank == 0 else _generator)(sync, rollout, folder)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    os._exit(0)


def test_a_failed_generator_stops_both_ends_in_order(tmp_path):
    sys.path.insert(0, str(Path(__file__).parent))  # rank_runner, for the spawned children too
    from rank_runner import _run_from_file, file_rendezvous

    context = mp.start_processes(_run_from_file, args=(__file__, _rank_main.__name__, (file_rendezvous(tmp_path), str(tmp_path))),
                                 nprocs=2, start_method="spawn", join=False)
    deadline = time.monotonic() + DEADLINE_S
    while not context.join(timeout=1):
        if time.monotonic() > deadline:
            for process in context.processes:
                process.kill()
            break
    trainer_path, generator_path = tmp_path / "trainer.json", tmp_path / "generator.json"
    assert trainer_path.exists(), "the trainer's close() did not return (it waited for a second None)"
    trainer, generator = json.loads(trainer_path.read_text()), json.loads(generator_path.read_text())
    assert trainer == {"first": 0, "raised": "generator rank 1 stopped before the trainer did (see its error)",
                       "closed": True}
    assert "the second batch fails" in generator["raised"], generator
    assert not generator["receiver_alive"], "run() raised with its weight-receiver thread still running"
