"""Disaggregated generation: generators on ranks of their own stream rollouts to the trainer, and get
its weights back after every update (titan_rl.weight_sync).

The protocol, with trainer leader L, generator ranks g_0..g_{G-1} and a staleness bound k
(`max_policy_lag`):

- Rollout batches are numbered 0, 1, ...; generator g_j makes its share of every batch (the caller's
  `produce(batch_index)`) and sends it to L point to point on the rollout group, in batch order: the
  pickled batch's length (int64 [1]), then its bytes (uint8), both by `isend`, so the generator goes on to
  the next batch without waiting for L to take this one. L receives batch i from g_0, ..., g_{G-1} in turn and broadcasts the parts over the
  trainer's group, so every trainer rank holds the same batch.
- After an update, L broadcasts the new weights on the sync group (a header [WEIGHTS, version,
  consumed], then the tensors); when it takes another batch without an update (DAPO's refills, a drop)
  it first broadcasts [GRANT, version, consumed]. `consumed` counts the batches L has taken.
- A generator makes batch i only once it has seen consumed >= i - k, and always with the newest weights
  it has received (a background thread receives them; `update_weights` waits for a running generate()).
  Between the message that allowed batch i and its consumption L takes at most k batches, each followed
  by at most one new version, so batch i is consumed at most k versions after the weights that made it:
  the bound holds by construction, however slow a generator is (k = 0 is synchronous, on-policy). The
  trainer still checks every batch's lag and drops (and counts) one over the bound.
- At the end L broadcasts [STOP]; each generator sends `None` after its last batch, and L drains each
  generator up to that `None`, so no send is left waiting.
"""
from __future__ import annotations

import pickle
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from titan_rl.generation.base import Generator
from titan_rl.rollout import RolloutBatch, StalenessStats
from titan_rl.weight_sync import STOP, WEIGHTS, WeightReceiver, WeightSender


class ObjectSend:
    """An object on its way to rank `dst` (pickled: its length, then its bytes, by isend; the buffers live
    until the sends complete)."""

    def __init__(self, obj, dst: int, group: dist.ProcessGroup) -> None:
        payload = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
        self._buffers = (torch.tensor([payload.numel()], dtype=torch.int64), payload)
        self._works = [dist.isend(buffer, dst=dst, group=group) for buffer in self._buffers]

    def done(self) -> bool:
        return all(work.is_completed() for work in self._works)

    def wait(self) -> None:
        for work in self._works:
            work.wait()


def receive_object(src: int, group: dist.ProcessGroup):
    """The next object ObjectSend sent from rank `src`."""
    size = torch.empty(1, dtype=torch.int64)
    dist.recv(size, src=src, group=group)
    payload = torch.empty(int(size), dtype=torch.uint8)
    dist.recv(payload, src=src, group=group)
    return pickle.loads(payload.numpy().tobytes())


@dataclass(kw_only=True)
class RemoteBatch:
    parts: list[RolloutBatch]       # one per generator, in generator-rank order
    dropped_samples: int            # dropped as stale since the previous batch

    @property
    def policy_version(self) -> int:
        return min(part.policy_version for part in self.parts)


class RemoteRollouts:
    """The trainer ranks' end (every trainer rank builds one; `sender` only on the leader)."""

    def __init__(self, *, generator_ranks: list[int], leader: int, max_policy_lag: int,
                 trainer_group: dist.ProcessGroup | None, rollout_group: dist.ProcessGroup,
                 sender: WeightSender | None) -> None:
        if max_policy_lag < 0:
            raise ValueError(f"max_policy_lag={max_policy_lag}; must be >= 0 (0 = synchronous, on-policy)")
        self.is_leader = dist.get_rank() == leader
        assert (sender is not None) == self.is_leader, "the leader, and only it, sends the weights"
        self.generator_ranks, self.leader, self.max_policy_lag = list(generator_ranks), leader, max_policy_lag
        self.trainer_group, self.rollout_group, self.sender = trainer_group, rollout_group, sender
        self.consumed = 0       # batches taken
        self._announced = 0     # the `consumed` the generators were last told
        self.stats = StalenessStats()
        self._closed = False
        self._finished: set[int] = set()  # generator ranks whose final `None` the leader has taken

    def publish(self, tensors: Iterable[tuple[str, torch.Tensor]], *, version: int) -> None:
        """Send new weights (full tensors in the model's state-dict order, e.g. weight_sync.full_tensors:
        every trainer rank iterates them, as their gathers are collectives) as `version`."""
        if self.sender is not None:
            self.sender.send_weights(tensors, version=version, consumed=self.consumed)
            self._announced = self.consumed
        else:
            for _ in tensors:
                pass

    def _receive(self, trainer_version: int) -> list[RolloutBatch]:
        if self._announced < self.consumed:
            self.sender.grant(version=trainer_version, consumed=self.consumed)
            self._announced = self.consumed
        parts = []
        for rank in self.generator_ranks:
            part = receive_object(rank, self.rollout_group)
            if part is None:  # its last message (a generator that failed): close() must not wait for another
                self._finished.add(rank)
                raise RuntimeError(f"generator rank {rank} stopped before the trainer did (see its error)")
            parts.append(part)
        return parts

    def get(self, trainer_version: int) -> RemoteBatch:
        """The next batch within the staleness bound (a collective of the trainer's ranks)."""
        dropped = 0
        while True:
            box = [self._receive(trainer_version) if self.is_leader else None]
            if self.trainer_group is not None and dist.get_world_size(self.trainer_group) > 1:
                dist.broadcast_object_list(box, src=self.leader, group=self.trainer_group)
            self.consumed += 1
            batch = RemoteBatch(parts=box[0], dropped_samples=0)
            lag = trainer_version - batch.policy_version
            if lag <= self.max_policy_lag:
                self.stats.lags.append(lag)
                batch.dropped_samples = dropped
                return batch
            samples = sum(len(part.samples) for part in batch.parts)
            dropped += samples
            self.stats.dropped_batches += 1
            self.stats.dropped_samples += samples

    def close(self, *, version: int) -> None:
        """Stop the generators and drain what they still send (leader); idempotent."""
        if self._closed:
            return
        self._closed = True
        if self.sender is None:
            return
        self.sender.stop(version=version, consumed=self.consumed)
        for rank in self.generator_ranks:
            if rank in self._finished:
                continue
            while receive_object(rank, self.rollout_group) is not None:
                pass
            self._finished.add(rank)


@dataclass(kw_only=True)
class ServerStats:
    batches: int = 0
    """Batches made and sent."""
    versions: list[int] = field(default_factory=list)
    """The weights version of each batch sent."""
    weight_updates: int = 0
    receive_seconds: float = 0.0
    """Time the receiver thread spent receiving and loading weights."""
    wait_seconds: float = 0.0
    """Time the generator waited for the trainer's permission (the staleness bound) to make a batch."""


class RolloutServer:
    """A generator rank's end: makes rollout batches and sends them to the trainer leader while a
    background thread receives new weights into `generator` (see the module's protocol).

    produce(batch_index): this generator's share of that batch, with `generator`'s current weights.
    consumed: the trainer's count from the message that brought the initial weights.
    """

    def __init__(self, *, generator: Generator, receiver: WeightReceiver, produce: Callable[[int], RolloutBatch],
                 max_policy_lag: int, leader: int, rollout_group: dist.ProcessGroup, consumed: int) -> None:
        self.generator, self.receiver, self.produce = generator, receiver, produce
        self.max_policy_lag, self.leader, self.rollout_group = max_policy_lag, leader, rollout_group
        self.stats = ServerStats()
        self._consumed, self._stopped, self._failure = consumed, False, None
        self._changed = threading.Condition()

    def _receive_loop(self) -> None:
        try:
            while True:
                began = time.perf_counter()
                message = self.receiver.receive()
                if message.kind == WEIGHTS:
                    self.generator.update_weights(message.weights, version=message.version)
                    self.stats.weight_updates += 1
                self.stats.receive_seconds += time.perf_counter() - began
                with self._changed:
                    self._consumed = message.consumed
                    self._stopped = message.kind == STOP
                    self._changed.notify_all()
                if message.kind == STOP:
                    return
        except BaseException as exc:  # surfaced by run()
            with self._changed:
                self._failure, self._stopped = exc, True
                self._changed.notify_all()

    def run(self) -> ServerStats:
        """Serve until the trainer stops (the STOP message). Returns, or raises, only once the receiver
        thread has ended: a thread left inside a broadcast on the sync group while the caller goes on to
        destroy the process groups (and exit) would use gloo state that is being freed."""
        thread = threading.Thread(target=self._receive_loop, name="titan-rl-weights", daemon=True)
        thread.start()
        try:
            self._serve()
        finally:
            # after a failure here, the trainer takes the None that _serve sent last, stops (STOP), and that
            # message ends the thread; a failed thread has ended already
            thread.join()
        if self._failure is not None:
            raise RuntimeError("receiving weights failed") from self._failure
        return self.stats

    def _serve(self) -> None:
        index, sends = 0, []
        try:
            while True:
                began = time.perf_counter()
                with self._changed:
                    self._changed.wait_for(lambda: self._stopped or index <= self._consumed + self.max_policy_lag)
                    stopped = self._stopped
                self.stats.wait_seconds += time.perf_counter() - began
                if stopped:
                    break
                batch = self.produce(index)
                sends = [s for s in sends if not s.done()] + [ObjectSend(batch, self.leader, self.rollout_group)]
                self.stats.batches += 1
                self.stats.versions.append(batch.policy_version)
                index += 1
        finally:  # also after a failure: the trainer then stops at the None instead of waiting forever
            sends.append(ObjectSend(None, self.leader, self.rollout_group))
            for send in sends:
                send.wait()
