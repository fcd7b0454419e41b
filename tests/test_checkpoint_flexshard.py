"""torch-checkpointing saves and loads flexshard models: RowShard, Owned and BlockShard parameters.

flexshard's Owned and BlockShard parameters are `Shard(0)` DTensors whose local tensor is a
`flexshard.ChunkedShard` (the rank's rectangles back to back) implementing the hooks that
torch.distributed.checkpoint asks a DTensor's local tensor for. This test checks, on 2 gloo ranks
(each a fresh process running this file), with AdamW and with flexshard's Muon:

- an asynchronous save (the model trains on while it is written) and a blocking repeat save (no
  collective) load back bit for bit: parameters, optimizer state, and the losses of the following
  steps equal those of the uninterrupted run;
- the step loads into other flexshard placements (Owned -> RowShard, BlockShard -> Owned, ...) with
  the same parameters, optimizer state and subsequent losses;
- one process loads it into a plain, unsharded model and optimizer, equal to `flexshard.full_tensor`
  of the sharded ones.

Expected values never come from torch_checkpointing: they are the uninterrupted run and
flexshard.full_tensor of the trained model.
"""
from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

VOCAB, DIM, HIDDEN, SEQ = 37, 24, 40, 9
STEPS = 6  # steps 0..5; saved before step 2 (async) and before step 3 (blocking)


class TinyNet(nn.Module):
    """Odd sizes on purpose: uneven row shards, partial tiles, and empty shards on one rank."""

    def __init__(self) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(VOCAB, DIM)
        self.norm = nn.RMSNorm(DIM)
        self.w1 = nn.Linear(DIM, HIDDEN, bias=False)
        self.w2 = nn.Linear(HIDDEN, DIM, bias=True)
        self.gate = nn.Parameter(torch.ones(1, DIM))
        self.output = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens)
        h = h + self.gate * self.w2(F.silu(self.w1(self.norm(h))))
        return self.output(h)


def make_model(seed: int) -> TinyNet:
    torch.manual_seed(seed)
    model = TinyNet()
    with torch.no_grad():
        model.norm.weight.add_(0.1 * torch.randn(DIM))
        model.gate.add_(0.1 * torch.randn(1, DIM))
    return model


def make_optimizer(model: nn.Module, kind: str) -> torch.optim.Optimizer:
    if kind == "adamw":
        return torch.optim.AdamW(model.parameters(), lr=1e-2)
    from flexshard.optim import Muon

    return Muon(model.named_parameters(), lr=0.02, adamw_lr=1e-2)


# Saved placements: 2-D tiles with uneven edges (tok_embeddings: 2 rectangles per rank), whole
# matrices on one rank (the other holds nothing), a 1-row BlockShard whose single tile leaves rank 1
# empty, and uneven RowShard rows (37 = 19 + 18).
SAVE_PLACEMENTS = {
    "tok_embeddings.weight": ("block", (8, 16)),
    "w1.weight": ("owned",),
    "w2.weight": ("owned",),
    "gate": ("block", (8, 32)),
}
# Loaded into: Owned -> RowShard, BlockShard -> Owned, Owned -> BlockShard, RowShard -> BlockShard.
RESHARD_PLACEMENTS = {
    "tok_embeddings.weight": ("owned",),
    "w1.weight": ("row",),
    "w2.weight": ("block", (16, 8)),
    "gate": ("row",),
    "output.weight": ("block", (16, 8)),
}


def sharded_model(mesh, rule: dict, seed: int) -> TinyNet:
    import flexshard

    make = {"owned": lambda: flexshard.Owned(), "row": lambda: flexshard.RowShard(),
            "block": lambda block: flexshard.BlockShard(block=block)}
    placements = {name: make[kind](*args) for name, (kind, *args) in rule.items()}
    return flexshard.shard(make_model(seed), mesh, placements=placements)


def train_step(model: nn.Module, optimizer: torch.optim.Optimizer, step: int, rows: slice) -> float:
    g = torch.Generator().manual_seed(1000 + step)
    tokens = torch.randint(0, VOCAB, (4, SEQ + 1), generator=g)[rows].to(next(model.parameters()).device)
    loss = F.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss.item()


def full_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, dict[str, torch.Tensor]]:
    """Every parameter and optimizer state tensor, whole (flexshard.full_tensor: a collective), copied:
    plain tensors such as AdamW's step count come back as themselves and change in place later."""
    import flexshard

    out = {}
    for name, p in model.named_parameters():
        entry = {"param": flexshard.full_tensor(p.detach()).clone()}
        for key, value in optimizer.state[p].items():
            is_tensor = isinstance(value, torch.Tensor)
            entry[key] = flexshard.full_tensor(value).clone() if is_tensor else torch.tensor(value)
        out[name] = entry
    return out


def differences(got: dict, want: dict) -> list[str]:
    """Names of the tensors that are not bitwise equal (or missing), wherever each lives."""
    bad = []
    for name, entry in want.items():
        for key, value in entry.items():
            other = got.get(name, {}).get(key)
            if other is None or other.dtype != value.dtype or not torch.equal(other.cpu(), value.cpu()):
                bad.append(f"{name}.{key}")
    return bad


def collectives_during(fn) -> tuple[int, int]:
    """(collectives flexshard's counter saw, advance of the default group's sequence number)."""
    import torch.distributed.distributed_c10d as c10d

    import flexshard

    group = c10d._get_default_group()
    before = group._get_sequence_number_for_group()
    with flexshard.CollectiveCounter() as counter:
        fn()
    return counter.count, group._get_sequence_number_for_group() - before


def checkpoint_state(model, optimizer, step: int) -> dict:
    import torch_checkpointing as tc

    return {"model": tc.ModelState(model), "optim": tc.OptimizerState(model, optimizer), "step": step}


# ---- what each process runs ----------------------------------------------------------------


def sharded_worker(rank: int, world: int, root: str, kind: str) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    import flexshard
    import torch_checkpointing as tc

    mesh = init_device_mesh("cpu", (world,))
    rows = slice(2 * rank, 2 * rank + 2)
    report: dict = {}
    model = sharded_model(mesh, SAVE_PLACEMENTS, seed=0)
    optimizer = make_optimizer(model, kind)
    report["chunked"] = sorted(n for n, p in model.named_parameters()
                               if isinstance(p._local_tensor, flexshard.ChunkedShard))
    report["empty_here"] = sorted(n for n, p in model.named_parameters() if p._local_tensor.numel() == 0)
    assert all(isinstance(p, DTensor) for p in model.parameters())

    ckpt = tc.Checkpointer(root)
    losses = [train_step(model, optimizer, step, rows) for step in range(2)]
    want = {2: full_state(model, optimizer)}
    handles = []
    report["collectives_first_save"] = collectives_during(
        lambda: handles.append(ckpt.save(2, checkpoint_state(model, optimizer, 2))))
    losses.append(train_step(model, optimizer, 2, rows))  # changes the state while it is written
    handles[0].wait()
    want[3] = full_state(model, optimizer)
    report["collectives_repeat_save"] = collectives_during(
        lambda: ckpt.save(3, checkpoint_state(model, optimizer, 3), blocking=True))
    losses += [train_step(model, optimizer, step, rows) for step in range(3, STEPS)]
    final = full_state(model, optimizer)
    report["losses"] = losses

    def resume(rule: dict, step: int, seed: int) -> dict:
        other = sharded_model(mesh, rule, seed=seed)
        other_opt = make_optimizer(other, kind)
        state = checkpoint_state(other, other_opt, -1)
        loaded = ckpt.load(state, step=step)
        out = {"loaded": (loaded, state["step"]), "state_diff": differences(full_state(other, other_opt), want[step])}
        out["losses"] = [train_step(other, other_opt, s, rows) for s in range(step, STEPS)]
        out["final_diff"] = differences(full_state(other, other_opt), final)
        return out

    report["resume_async"] = resume(SAVE_PLACEMENTS, 2, seed=1)
    report["resume_blocking"] = resume(SAVE_PLACEMENTS, 3, seed=2)
    report["reshard"] = resume(RESHARD_PLACEMENTS, 2, seed=3)
    ckpt.close()
    if rank == 0:
        torch.save(want[2], Path(root).parent / "expected-step-2.pt")
    return report


def single_process_worker(rank: int, world: int, root: str, kind: str) -> dict:
    import torch_checkpointing as tc

    model = make_model(seed=5)
    optimizer = make_optimizer(model, kind)
    state = checkpoint_state(model, optimizer, -1)
    with tc.Checkpointer(root) as ckpt:
        loaded = ckpt.load(state, step=2)
    want = torch.load(Path(root).parent / "expected-step-2.pt")
    got = {n: {"param": p.detach().clone(), **{k: v if isinstance(v, torch.Tensor) else torch.tensor(v)
                                                for k, v in optimizer.state[p].items()}}
           for n, p in model.named_parameters()}
    return {"loaded": (loaded, state["step"]), "state_diff": differences(got, want),
            "plain": all(type(p) is nn.Parameter and type(p.data) is torch.Tensor for p in model.parameters())}


def gpu_worker(rank: int, world: int, root: str, kind: str) -> dict:
    """One GPU: staging from and loading into CUDA pieces of ChunkedShard parameters (side stream,
    pinned slabs), the model training on right after save() returns; then a CPU plain model loads it."""
    from torch.distributed.device_mesh import init_device_mesh

    import torch_checkpointing as tc

    mesh = init_device_mesh("cuda", (world,))
    rows = slice(2 * rank, 2 * rank + 2)
    model = sharded_model(mesh, SAVE_PLACEMENTS, seed=0)
    optimizer = make_optimizer(model, kind)
    ckpt = tc.Checkpointer(root)
    for step in range(2):
        train_step(model, optimizer, step, rows)
    want = full_state(model, optimizer)
    handle = ckpt.save(2, checkpoint_state(model, optimizer, 2))
    train_step(model, optimizer, 2, rows)  # queued after the staging copies on the current stream
    handle.wait()
    other = sharded_model(mesh, SAVE_PLACEMENTS, seed=1)
    other_opt = make_optimizer(other, kind)
    report = {"on_gpu": all(p._local_tensor.device.type == "cuda" for p in other.parameters())}
    ckpt.load(checkpoint_state(other, other_opt, -1), step=2)
    report["state_diff"] = differences(full_state(other, other_opt), want)
    plain = make_model(seed=5)
    plain_opt = make_optimizer(plain, kind)
    ckpt.load(checkpoint_state(plain, plain_opt, -1), step=2)
    got = {n: {"param": p.detach(), **plain_opt.state[p]} for n, p in plain.named_parameters()}
    report["plain_diff"] = differences(got, want)
    ckpt.close()
    return report


# ---- launching ranks -----------------------------------------------------------------------


def file_rendezvous(folder: Path) -> str:
    """A file:// init_method naming a file in `folder` that no run used yet.

    A file, not a port picked free and bound later: under pytest -n 15 another test's ranks (often gloo's
    own ephemeral ports) could take that port between the pick and rank 0's bind. A FileStore file must
    not exist before init, so every run needs a new name."""
    return f"file://{folder.resolve() / f'rendezvous-{uuid.uuid4().hex}'}"


def run_ranks(worker: str, world: int, workdir: Path, backend: str = "gloo", **kwargs) -> list[dict]:
    """`worker(rank, world, **kwargs)` on `world` ranks (gloo; "cpu:gloo,cuda:nccl": one GPU per rank),
    each a fresh process running this file."""
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / "kwargs.pkl").write_bytes(pickle.dumps(kwargs))
    init_method = file_rendezvous(workdir)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    procs = [
        subprocess.Popen([sys.executable, __file__, worker, str(rank), str(world), init_method, str(workdir), backend],
                         env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for rank in range(world)
    ]
    outputs = []
    try:
        for p in procs:
            outputs.append(p.communicate(timeout=300)[0])
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
        pytest.fail(f"{worker} on {world} ranks did not finish within 300 s")
    failed = [r for r, p in enumerate(procs) if p.returncode != 0 or not (workdir / f"result-{r}.pkl").exists()]
    if failed:
        detail = "\n".join(
            f"--- rank {r} ---\n" + ((workdir / f"error-{r}.txt").read_text() if (workdir / f"error-{r}.txt").exists()
                                    else outputs[r][-4000:]) for r in failed)
        pytest.fail(f"{worker} failed on ranks {failed}:\n{detail}", pytrace=False)
    return [pickle.loads((workdir / f"result-{r}.pkl").read_bytes()) for r in range(world)]


def _rank_main() -> None:
    import traceback

    import torch.distributed as dist

    worker, rank, world = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    init_method, workdir, backend = sys.argv[4], Path(sys.argv[5]), sys.argv[6]
    torch.set_num_threads(1)
    code = 0
    try:
        if "nccl" in backend:
            torch.cuda.set_device(rank)
        dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world)
        result = globals()[worker](rank, world, **pickle.loads((workdir / "kwargs.pkl").read_bytes()))
        dist.barrier()
        (workdir / f"result-{rank}.pkl").write_bytes(pickle.dumps(result))
    except BaseException:
        (workdir / f"error-{rank}.txt").write_text(traceback.format_exc())
        code = 1
    finally:
        if code == 0:
            dist.destroy_process_group()
        os._exit(code)  # torch sometimes aborts at interpreter exit otherwise


# ---- the tests -----------------------------------------------------------------------------


@pytest.fixture(scope="module", params=["adamw", "muon"])
def run(request, tmp_path_factory):
    kind = request.param
    tmp = tmp_path_factory.mktemp(f"ckpt-flexshard-{kind}")
    root = tmp / "ckpt"
    sharded = run_ranks("sharded_worker", 2, tmp / "two", root=str(root), kind=kind)
    single = run_ranks("single_process_worker", 1, tmp / "one", root=str(root), kind=kind)[0]
    return {"root": root, "sharded": sharded, "single": single}


def test_model_exercises_chunked_shards_and_empty_ranks(run):
    r0, r1 = run["sharded"]
    assert r0["chunked"] == r1["chunked"] == ["gate", "tok_embeddings.weight", "w1.weight", "w2.weight"]
    assert "gate" in r1["empty_here"]
    # each Owned matrix is empty on exactly one rank
    assert sorted(n for r in (r0, r1) for n in r["empty_here"] if n.startswith("w")) == ["w1.weight", "w2.weight"]


def test_checkpoint_stores_each_rectangle_once(run):
    metadata = json.loads((run["root"] / "step-2" / "metadata.json").read_text())
    tensors = metadata["tensors"]
    assert tensors["model.tok_embeddings.weight"]["shape"] == [VOCAB, DIM]
    # 37 x 24 in 8 x 16 tiles: rank 0 holds tile rows 0-1 and a head of row 2, rank 1 the rest
    emb = sorted((c["rank"], tuple(c["offset"]), tuple(c["shape"]))
                 for c in tensors["model.tok_embeddings.weight"]["chunks"])
    assert emb == [(0, (0, 0), (16, 24)), (0, (16, 0), (8, 16)), (1, (16, 16), (8, 8)), (1, (24, 0), (13, 24))]
    for name in ("model.w1.weight", "model.w2.weight"):  # Owned: one chunk, the whole matrix
        (chunk,) = tensors[name]["chunks"]
        assert chunk["offset"] == [0, 0] and chunk["shape"] == tensors[name]["shape"]
    for name, entry in tensors.items():
        assert sum(torch.Size(c["shape"]).numel() for c in entry["chunks"]) == torch.Size(entry["shape"]).numel(), name


def test_repeat_save_runs_no_collective(run):
    for r in run["sharded"]:
        assert r["collectives_first_save"][0] > 0  # the counters see the one-time layout exchange
        assert r["collectives_repeat_save"] == (0, 0)


@pytest.mark.parametrize("case", ["resume_async", "resume_blocking"])
def test_resume_is_bitwise(run, case):
    for r in run["sharded"]:
        resumed = r[case]
        step = resumed["loaded"][0]
        assert resumed["loaded"] == (step, step)
        assert resumed["state_diff"] == []
        assert resumed["losses"] == r["losses"][step:]
        assert resumed["final_diff"] == []


def test_reshard_into_other_placements_is_bitwise(run):
    for r in run["sharded"]:
        resharded = r["reshard"]
        assert resharded["loaded"] == (2, 2)
        assert resharded["state_diff"] == []
        assert resharded["losses"] == r["losses"][2:]
        assert resharded["final_diff"] == []


def test_single_process_loads_into_a_plain_model(run):
    single = run["single"]
    assert single["plain"] and single["loaded"] == (2, 2)
    assert single["state_diff"] == []


@pytest.mark.skipif(not torch.cuda.is_available(), reason="staging from and loading into CUDA pieces needs a GPU")
@pytest.mark.parametrize("kind", ["adamw", "muon"])
def test_gpu_pieces_stage_and_load(tmp_path, kind):
    (report,) = run_ranks("gpu_worker", 1, tmp_path / "one", backend="cpu:gloo,cuda:nccl",
                          root=str(tmp_path / "ckpt"), kind=kind)
    assert report["on_gpu"]
    assert report["state_diff"] == [] and report["plain_diff"] == []


if __name__ == "__main__":
    _rank_main()
