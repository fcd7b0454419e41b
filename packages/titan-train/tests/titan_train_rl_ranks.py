"""Helpers of the RL job tests on gloo ranks: the small job, the metrics records, and a
recorder of the weights each generator rank holds and the trainer holds after every update.

Importable by name in spawned ranks (conftest.py puts this folder on sys.path); the name is package-unique.
"""
from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

from titan_train.rl import RLConfig


def small_job(folder: Path, **changes) -> RLConfig:
    """RLConfig on the CPU, writing to `folder`, without progress; changes: section__field=value."""
    config = RLConfig()
    config.job.folder = str(folder)
    config.job.device = "cpu"
    config.metrics.progress = False
    for dotted, value in changes.items():
        section, name = dotted.split("__")
        setattr(getattr(config, section), name, value)
    return config


def records(folder: Path) -> list[dict]:
    """The run's rl_metrics.jsonl, one dict per RL step."""
    return [json.loads(line) for line in (Path(folder) / "rl_metrics.jsonl").read_text().splitlines()]


def digest(state: dict[str, torch.Tensor]) -> dict[str, str]:
    """name -> sha256 of the tensor's dtype, shape and bytes (equal digests: bitwise equal tensors)."""
    out = {}
    for name, tensor in state.items():
        t = tensor.detach().cpu().contiguous()
        h = hashlib.sha256(f"{t.dtype}{tuple(t.shape)}".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
        out[name] = h.hexdigest()
    return out


@contextmanager
def recording_weights(folder: Path, *, generator_ranks: int) -> Iterator[None]:
    """In a rank process, around run_rl: write <folder>/weights_rank<r>.json, version -> digest of
    - on a generator rank: its built-in generator's whole model, as built (version 0) and after each update;
    - on trainer rank 0: the trainer's full weights (torch's get_model_state_dict over its shards, a gather
      independent of the sync's own) right after each publish. Every trainer rank joins that gather."""
    import torch.distributed as dist

    import titan_rl
    from titan_train.rl.policy import export_weights
    from titan_train.rl.rollouts import DisaggregatedRollouts

    rank, world = dist.get_rank(), dist.get_world_size()
    seen: dict[int, dict[str, str]] = {}
    path = Path(folder) / f"weights_rank{rank}.json"

    def save(version: int, state: dict[str, torch.Tensor]) -> None:
        seen[version] = digest(state)
        path.write_text(json.dumps(seen))

    if rank >= world - generator_ranks:
        init, update = titan_rl.BuiltinGenerator.__init__, titan_rl.BuiltinGenerator.update_weights

        def recorded_init(self, model, **kwargs):
            init(self, model, **kwargs)
            save(0, self.model.state_dict())

        def recorded_update(self, state_dict, *, version):
            update(self, state_dict, version=version)
            save(version, self.model.state_dict())

        titan_rl.BuiltinGenerator.__init__, titan_rl.BuiltinGenerator.update_weights = recorded_init, recorded_update
        try:
            yield
        finally:
            titan_rl.BuiltinGenerator.__init__, titan_rl.BuiltinGenerator.update_weights = init, update
        return
    publish = DisaggregatedRollouts.publish

    def recorded_publish(self, policy, version):
        publish(self, policy, version)
        full = export_weights(policy)
        if rank == 0:
            save(version, full)

    DisaggregatedRollouts.publish = recorded_publish
    try:
        yield
    finally:
        DisaggregatedRollouts.publish = publish


def load_weights(folder: Path, rank: int) -> dict[int, dict[str, str]]:
    return {int(k): v for k, v in json.loads((Path(folder) / f"weights_rank{rank}.json").read_text()).items()}
