"""The device and the process group of one rank (torchrun's environment, or a TITAN_INIT_METHOD URL),
shared by the trainer and the RL job."""
from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Literal
from urllib.parse import urlsplit

import torch
import torch.distributed as dist

INIT_METHOD_VAR = "TITAN_INIT_METHOD"
_SCHEMES = ("env", "file", "tcp")


def select_device(kind: Literal["auto", "cpu", "cuda"]) -> torch.device:
    """auto: cuda when available, else cpu; cuda is this rank's GPU (LOCAL_RANK)."""
    if kind == "auto":
        kind = "cuda" if torch.cuda.is_available() else "cpu"
    if kind == "cuda":
        if not torch.cuda.is_available():
            raise ValueError("job.device=cuda but torch sees no CUDA device")
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    return torch.device("cpu")


def init_method_from_env(environ: dict[str, str] | None = None) -> str:
    """The init_method URL the ranks rendezvous by: TITAN_INIT_METHOD when set, else env:// (torchrun's
    MASTER_ADDR/MASTER_PORT). A file:// URL lets ranks meet through a shared file system where a free
    port is hard to agree on (or is raced for by other jobs between its pick and its bind)."""
    value = (os.environ if environ is None else environ).get(INIT_METHOD_VAR, "").strip()
    if not value:
        return "env://"
    url = urlsplit(value)
    allowed = f"{INIT_METHOD_VAR} must be env://, file:///absolute/path or tcp://host:port"
    if url.scheme not in _SCHEMES or "://" not in value:
        raise ValueError(f"{allowed}, got {value!r}")
    if url.scheme == "file" and (url.netloc or not url.path.startswith("/") or url.path.endswith("/")):
        raise ValueError(f"{allowed}; a file:// URL names a file by its absolute path, got {value!r}")
    if url.scheme == "tcp":
        try:
            port = url.port
        except ValueError:
            port = None
        if not url.hostname or port is None:
            raise ValueError(f"{allowed}; a tcp:// URL needs a host and a port, got {value!r}")
    return value


def init_process_group_from_env(backend: str) -> None:
    """dist.init_process_group(backend) by init_method_from_env(), with RANK and WORLD_SIZE from the
    environment (file:// and tcp:// need them passed; env:// reads them itself)."""
    init_method = init_method_from_env()
    if init_method == "env://":
        dist.init_process_group(backend)
        return
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        raise ValueError(f"{INIT_METHOD_VAR}={init_method} needs RANK and WORLD_SIZE set (as torchrun sets them)")
    dist.init_process_group(backend, init_method=init_method, rank=int(os.environ["RANK"]),
                            world_size=int(os.environ["WORLD_SIZE"]))


@contextlib.contextmanager
def process_group(device: torch.device) -> Iterator[None]:
    """Join the process group torchrun (or TITAN_INIT_METHOD) describes, gloo on CPU and nccl on GPU,
    unless one exists already."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    created = False
    if world > 1 and not dist.is_initialized():
        if device.type == "cuda":
            torch.cuda.set_device(device)
        init_process_group_from_env("nccl" if device.type == "cuda" else "gloo")
        created = True
    try:
        yield
    finally:
        if created:
            dist.destroy_process_group()
