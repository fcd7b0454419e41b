"""TITAN_INIT_METHOD: how the trainer's ranks rendezvous when not by torchrun's env:// variables."""
from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from titan_train_ranks import file_rendezvous, spawn_ranks

from titan_train.process_group import init_method_from_env


@pytest.mark.parametrize("value", ["", "  ", "env://"])
def test_unset_or_env_is_torchruns_env_rendezvous(value):
    assert init_method_from_env({"TITAN_INIT_METHOD": value}) == "env://"
    assert init_method_from_env({}) == "env://"


@pytest.mark.parametrize("value", ["file:///shared/fs/rdzv", "tcp://10.0.0.1:29500", "tcp://node-3:1234"])
def test_file_and_tcp_urls_pass_through(value):
    assert init_method_from_env({"TITAN_INIT_METHOD": value}) == value


@pytest.mark.parametrize("value", [
    "/shared/fs/rdzv",  # a bare path: no scheme
    "file://shared/fs/rdzv",  # "shared" read as a host: the path would be relative
    "file:///shared/fs/",  # a folder, not a file
    "file:relative",
    "tcp://10.0.0.1",  # no port
    "tcp://10.0.0.1:port",
    "tcp://:29500",  # no host
    "http://10.0.0.1:29500",
    "nccl://x",
])
def test_malformed_value_raises_value_error_naming_what_is_allowed(value):
    with pytest.raises(ValueError, match="TITAN_INIT_METHOD must be env://, file:///absolute/path or tcp://"):
        init_method_from_env({"TITAN_INIT_METHOD": value})


def _sum_rank(rank: int, world: int, init_method: str, out: str) -> None:
    import torch.distributed as dist

    from titan_train.process_group import process_group

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), TITAN_INIT_METHOD=init_method)
    os.environ.pop("MASTER_PORT", None)  # env:// could not work: only the file can bring the ranks together
    with process_group(torch.device("cpu")):  # what train() and run_rl() join by
        total = torch.tensor([rank + 1.0])
        dist.all_reduce(total)
        Path(out, f"rank{rank}.txt").write_text(f"{dist.get_world_size()} {total.item()}")
    os._exit(0)  # torch sometimes aborts at interpreter exit after gloo


def test_ranks_meet_through_a_file_rendezvous(tmp_path):
    init_method = file_rendezvous(tmp_path)
    assert not Path(init_method.removeprefix("file://")).exists()  # a FileStore file must be new
    spawn_ranks(_sum_rank, 3, (3, init_method, str(tmp_path)))
    assert [(tmp_path / f"rank{r}.txt").read_text() for r in range(3)] == ["3 6.0"] * 3
