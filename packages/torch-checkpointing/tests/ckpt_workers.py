"""What each spawned rank does in the distributed tests, and the references they check against.

Expected values never come from torch_checkpointing: global tensors are generated from a seed,
local shards come from torch's distribute_tensor (or, for strided shards, from the documented
right-to-left sharding rule), and collectives are counted by the process group's own sequence number
as well as by wrapping every torch.distributed collective function.
"""
from __future__ import annotations

import threading
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.placement_types import Partial, _StridedShard

import torch_checkpointing as tc

COLLECTIVES = [
    "all_gather_object", "all_gather", "all_gather_into_tensor", "all_reduce", "broadcast", "broadcast_object_list",
    "barrier", "monitored_barrier", "gather", "gather_object", "scatter", "scatter_object_list", "reduce",
    "reduce_scatter", "reduce_scatter_tensor", "all_to_all", "all_to_all_single", "send", "recv", "isend",
    "irecv", "batch_isend_irecv",
]


class CollectiveCounter:
    """Counts collectives while active: calls to torch.distributed's functions (from any thread) and
    the default group's sequence number, which every collective on it advances."""

    def __init__(self) -> None:
        self.calls: dict[str, int] = {}
        self._lock = threading.Lock()

    def __enter__(self) -> CollectiveCounter:
        self._saved = {}
        for name in COLLECTIVES:
            original = getattr(c10d, name)
            self._saved[name] = original

            def counted(*args, __name=name, __original=original, **kwargs):
                with self._lock:
                    self.calls[__name] = self.calls.get(__name, 0) + 1
                return __original(*args, **kwargs)

            setattr(c10d, name, counted)
            setattr(dist, name, counted)
        self._seq0 = c10d._get_default_group()._get_sequence_number_for_group()
        return self

    def __exit__(self, *exc) -> None:
        self.sequence = c10d._get_default_group()._get_sequence_number_for_group() - self._seq0
        for name, original in self._saved.items():
            setattr(c10d, name, original)
            setattr(dist, name, original)

    @property
    def total(self) -> int:
        return sum(self.calls.values())


class CountingStorage(tc.LocalStorage):
    """Local storage that counts the bytes of tensor data read (records and metadata aside)."""

    def __init__(self, root):
        super().__init__(root, fsync=False)
        self.bytes_read = 0

    def read_into(self, path, offset, out):
        self.bytes_read += out.nbytes
        super().read_into(path, offset, out)


class FailingStorage(tc.LocalStorage):
    """Local storage whose data writes fail on one rank for one step (a full disk, say)."""

    def __init__(self, root, *, fail_rank: int, fail_step: int, rank: int):
        super().__init__(root, fsync=False)
        self.fail = f"step-{fail_step}/" if rank == fail_rank else None

    def open_sink(self, path):
        if self.fail and self.fail in path:
            raise OSError(28, "No space left on device (injected)")
        return super().open_sink(path)


# ---- the reference state -----------------------------------------------------------------------

def global_tensors(step: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return {
        "w": torch.randn(10, 6, generator=g),                      # uneven over 4 ranks: 3, 3, 3, 1 rows
        "v": torch.randn(7, 5, generator=g),
        "r": torch.randn(5, generator=g),
        "s": torch.randn(9, 4, generator=g).to(torch.bfloat16),   # strided shard: two boxes per rank
        "t": torch.randn(9, 3, generator=g),                       # FSDP2 + TP style strided shard
        "big": torch.randn(512, 64, generator=g),
        "bias": torch.randn(6, generator=g),
        "exp_avg": torch.randn(10, 6, generator=g).to(torch.float64),
        "n0": torch.randint(0, 100, (2, 3), generator=g),
    }


def strided_local(full: torch.Tensor, split_factor: int, num_chunks: int, index: int) -> torch.Tensor:
    """_StridedShard(0, split_factor) on its own mesh dim, by the documented rule: cut the tensor into
    split_factor pieces, chunk each over the mesh dim, and concatenate the index-th chunks."""
    return torch.cat([piece.chunk(num_chunks)[index] if index < len(piece.chunk(num_chunks)) else piece[:0]
                      for piece in full.chunk(split_factor)])


def fsdp_tp_local(full: torch.Tensor, dp: int, tp: int, dp_i: int, tp_i: int) -> torch.Tensor:
    """[_StridedShard(0, sf=tp), Shard(0)] on a (dp, tp) mesh: TP shards rows first, FSDP shards TP's shard."""
    return full.chunk(tp)[tp_i].chunk(dp)[dp_i]


def layout_a(rank: int, world_size: int) -> dict:
    """Four ranks: 1-D and 2-D meshes, uneven, replicated and strided placements."""
    assert world_size == 4
    mesh1, mesh2 = init_device_mesh("cpu", (4,)), init_device_mesh("cpu", (2, 2))
    dp_i, tp_i = mesh2.get_coordinate()
    return {
        "w": (mesh1, [Shard(0)]), "v": (mesh2, [Shard(0), Shard(1)]), "r": (mesh2, [Replicate(), Shard(0)]),
        "s": (mesh1, [_StridedShard(0, split_factor=2)], lambda full: strided_local(full, 2, 4, rank)),
        "t": (mesh2, [_StridedShard(0, split_factor=2), Shard(0)], lambda full: fsdp_tp_local(full, 2, 2, dp_i, tp_i)),
        "big": (mesh1, [Shard(1)]), "exp_avg": (mesh1, [Shard(0)]),
    }


def layout_b(rank: int, world_size: int) -> dict:
    """Two ranks, every tensor placed differently from layout A."""
    assert world_size == 2
    mesh = init_device_mesh("cpu", (2,))
    return {
        "w": (mesh, [Shard(1)]), "v": (mesh, [Replicate()]), "r": (mesh, [Shard(0)]), "s": (mesh, [Shard(1)]),
        "t": (mesh, [Shard(0)]), "big": (mesh, [Shard(0)]), "exp_avg": (mesh, [Shard(1)]),
    }


def make_dtensor(full: torch.Tensor, spec: tuple) -> DTensor:
    mesh, placements = spec[0], spec[1]
    if len(spec) == 3:  # strided: build the local shard by the reference rule
        local = spec[2](full).clone()
        return DTensor.from_local(local, mesh, placements, shape=full.shape, stride=full.stride(), run_check=False)
    return distribute_tensor(full, mesh, placements)


def build_state(layout: dict, step: int, rank: int, *, zeros: bool = False) -> dict:
    g = global_tensors(step)
    if zeros:
        g = {k: torch.zeros_like(v) for k, v in g.items()}
    dt = {name: make_dtensor(g[name], layout[name]) for name in ("w", "v", "r", "s", "t", "big")}
    return {
        "model": {**dt, "bias": g["bias"].clone()},
        "optim": {
            "state": {"w": {"exp_avg": make_dtensor(g["exp_avg"], layout["exp_avg"]), "step": torch.tensor(float(0 if zeros else step))}},
            "param_groups": [{"lr": 0.0 if zeros else 1e-3, "betas": (0.0, 0.0) if zeros else (0.9, 0.95), "params": ["w"], "foreach": None}],
        },
        "rng": torch.zeros(4, dtype=torch.uint8) if zeros else torch.tensor([rank, step, 7, 9], dtype=torch.uint8),
        "data": {"pos": -1 if zeros else 100 * step + rank, "blob": b"" if zeros else bytes([rank, step]) * 3},
        "step": -1 if zeros else step,
        "nested": [[g["n0"].clone(), {"k": "" if zeros else "v"}], 0 if zeros else 3, [0.0, 0.0] if zeros else [1.5, float("inf")]],
    }


def check_dtensors(state: dict, layout: dict, step: int) -> None:
    """Every local shard equals the reference shard of the step's global tensors."""
    g = global_tensors(step)
    for name in ("w", "v", "r", "s", "t", "big"):
        if name in state["model"]:
            expected = make_dtensor(g[name], layout[name])._local_tensor
            got = state["model"][name]._local_tensor
            assert torch.equal(got, expected), f"{name}: {got} != {expected}"
    if "optim" in state:
        got = state["optim"]["state"]["w"]["exp_avg"]._local_tensor
        assert torch.equal(got, make_dtensor(g["exp_avg"], layout["exp_avg"])._local_tensor), "exp_avg"


def check_common(state: dict, step: int) -> None:
    g = global_tensors(step)
    assert torch.equal(state["model"]["bias"], g["bias"])
    assert state["optim"]["state"]["w"]["step"].item() == float(step)
    assert state["optim"]["param_groups"] == [{"lr": 1e-3, "betas": (0.9, 0.95), "params": ["w"], "foreach": None}]
    assert state["step"] == step
    assert torch.equal(state["nested"][0][0], g["n0"]) and state["nested"][0][1] == {"k": "v"}
    assert state["nested"][1] == 3 and state["nested"][2] == [1.5, float("inf")]


# ---- scenarios -----------------------------------------------------------------------------------

def save_on_four(rank: int, world_size: int, root: str) -> None:
    """Steps 1-3 on 4 ranks: one exchange on the first save, no collective afterwards (also not
    when the layout changes at step 3), then a same-layout load of step 2."""
    layout = layout_a(rank, world_size)
    ckpt = tc.Checkpointer(root, per_rank=("rng",), block_bytes=4096)  # small blocks: partial reads show
    states = {step: build_state(layout, step, rank) for step in (1, 2, 3)}  # distribute_tensor communicates
    states[3]["model"]["extra"] = torch.full((3,), 3.0)  # a new entry and a new placement: the layout changes
    states[3]["model"]["v"] = make_dtensor(global_tensors(3)["v"], (layout["v"][0], [Replicate(), Replicate()]))
    with CollectiveCounter() as first:
        ckpt.save(1, states[1]).wait()
    # gather_object (an all_gather of sizes, a gather of payloads) and broadcast_object_list of the
    # verdict (sizes, then payload): four collectives on the group, on the first save only
    assert first.calls == {"gather_object": 1, "all_gather": 1, "gather": 1, "broadcast_object_list": 1, "broadcast": 2}, first.calls
    assert first.sequence == 4, first.sequence
    with CollectiveCounter() as repeat:
        ckpt.save(2, states[2]).wait()
        ckpt.save(3, states[3]).wait()
    assert repeat.calls == {} and repeat.sequence == 0, (repeat.calls, repeat.sequence)
    assert ckpt.steps() == [1, 2, 3]
    partial = DTensor.from_local(torch.ones(2), layout["w"][0], [Partial()], run_check=False)
    for bad, message in (({"p": partial}, "Partial placement"), ({"rng": states[1]["model"]["w"]}, "cannot be per_rank")):
        try:
            ckpt.save(9, bad)
            raise AssertionError(f"saved {bad}")
        except ValueError as e:
            assert message in str(e), e
    target = build_state(layout, 2, rank, zeros=True)
    assert ckpt.load(target, step=2) == 2
    check_dtensors(target, layout, 2)
    check_common(target, 2)
    assert target["data"] == {"pos": 200 + rank, "blob": bytes([rank, 2]) * 3}
    assert target["rng"].tolist() == [rank, 2, 7, 9]
    ckpt.close()


def load_on_two(rank: int, world_size: int, root: str, failing_root: str, hf_root: str) -> None:
    """Step 2 (saved on 4 ranks) into other placements on 2; partial reads; a per-rank value that
    cannot be resharded; then a save on 2 ranks (step 4) for the 1-rank test, and a rank failing."""
    layout = layout_b(rank, world_size)
    ckpt = tc.Checkpointer(root, per_rank=("rng",))
    target = build_state(layout, 2, rank, zeros=True)
    del target["rng"], target["data"]
    ckpt.load(target, step=2)
    check_dtensors(target, layout, 2)
    check_common(target, 2)
    step3 = {"model": {"extra": torch.zeros(3), "v": make_dtensor(torch.zeros(7, 5), layout["v"])}}
    ckpt.load(step3)  # latest: step 3, whose layout changed without an exchange
    assert torch.equal(step3["model"]["extra"], torch.full((3,), 3.0))
    assert torch.equal(step3["model"]["v"]._local_tensor, global_tensors(3)["v"])
    try:
        ckpt.load({"data": {"pos": 0}}, step=2)
        raise AssertionError("a per-rank value that differs between ranks loaded on another world size")
    except ValueError as e:
        assert "data.pos" in str(e) and "differs" in str(e), e
    # `big` was saved as 4 column shards; each rank now wants half of the rows: it reads those rows
    # of every chunk (widened to 4 KiB checksum blocks), not the whole tensor.
    counting = CountingStorage(root)
    reader = tc.Checkpointer(counting)
    big = {"model": {"big": make_dtensor(torch.zeros(512, 64), layout["big"])}}
    reader.load(big, step=2)
    assert torch.equal(big["model"]["big"]._local_tensor, global_tensors(2)["big"].chunk(2)[rank])
    share = 512 * 64 * 4 // 2
    assert share <= counting.bytes_read <= share + 4 * 2 * 4096, counting.bytes_read
    reader.close()
    ckpt.save(4, build_state(layout, 4, rank), blocking=True)
    # The Hugging Face export is shared out: each rank writes its files, rank 0 the index at the end.
    written = ckpt.export_hf(hf_root, step=4, max_shard_bytes=64 << 10)  # `big` (128 KiB) alone in a file
    assert bool(written) and ("model.safetensors.index.json" in written) == (rank == 0), written
    ckpt.close()
    # A rank that cannot write fails the step everywhere, and the next save commits normally.
    failing = tc.Checkpointer(FailingStorage(failing_root, fail_rank=1, fail_step=1, rank=rank))
    handle = failing.save(1, {"x": torch.ones(2)})
    try:
        handle.wait()
        raise AssertionError("a step committed although rank 1 could not write")
    except tc.CommitError as e:
        # rank 1 sees its own OSError, or (when rank 0 already recorded the failure) the CommitError
        # raised from it: which one depends on who gets there first
        assert "rank(s) [1]" in str(e), e
        assert rank == 0 or "injected" in str(e.__cause__), (rank, e.__cause__)
    except OSError as e:
        assert rank == 1 and "injected" in str(e), e
    failing.save(2, {"x": torch.ones(2)}).wait()
    assert failing.steps() == [2]
    failing.close()
    disagreements(rank, failing_root + "-disagree")


def disagreements(rank: int, root: str) -> None:
    """Ranks whose states do not fit together: at the first save every rank raises the same error;
    later (a layout changed on one rank only) the step fails instead of committing, and nobody hangs."""
    ckpt = tc.Checkpointer(root)
    try:
        ckpt.save(1, {"a": torch.ones(2)} if rank == 0 else {"b": torch.ones(2)})
        raise AssertionError("ranks with different entries saved")
    except ValueError as e:
        assert "do not fit together" in str(e) and "only on rank 0: ['a']" in str(e), e
    mesh = init_device_mesh("cpu", (2,))
    ckpt.save(2, {"a": distribute_tensor(torch.arange(4.0), mesh, [Shard(0)])}).wait()
    changed = {"a": distribute_tensor(torch.arange(4.0), mesh, [Shard(0)])}
    if rank == 1:
        changed["extra"] = torch.ones(1)  # only here: no collective could have agreed on this
    try:
        ckpt.save(3, changed).wait()
        raise AssertionError("a step whose ranks disagree was committed")
    except tc.CommitError as e:
        assert "different state entries" in str(e), e
    ckpt.save(4, {"a": distribute_tensor(torch.arange(4.0), mesh, [Shard(0)])}).wait()
    assert ckpt.steps()[-1] == 4 and 3 not in ckpt.steps()
    ckpt.close()


def fsdp2_train(model: torch.nn.Module, optimizer: torch.optim.Optimizer, steps: range) -> None:
    for i in steps:
        batch = torch.randn(4, 8, generator=torch.Generator().manual_seed(i))
        model(batch).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()


def fsdp2_model(world_size: int):
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    mesh = init_device_mesh("cpu", (world_size,))
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def fsdp2_resume(rank: int, world_size: int, root: str, out: str) -> None:
    """An FSDP2 trainer saves through the adapters; a fresh trainer resumes bitwise; the full
    parameters go to `out` for the single-process check."""
    model, optimizer = fsdp2_model(world_size)
    ckpt = tc.Checkpointer(root, keep_last=2)
    state = {"model": tc.ModelState(model), "optim": tc.OptimizerState(model, optimizer), "step": 0}
    fsdp2_train(model, optimizer, range(0, 2))
    ckpt.save(2, {**state, "step": 2}).wait()
    fsdp2_train(model, optimizer, range(2, 3))
    with CollectiveCounter() as repeat:
        handle = ckpt.save(3, {**state, "step": 3})
        handle.wait_staged()
        fsdp2_train(model, optimizer, range(3, 4))  # the state changes while step 3 is written
        handle.wait()
    assert repeat.calls.keys() <= {"all_reduce", "reduce_scatter_tensor", "all_gather_into_tensor"}, repeat.calls
    with CollectiveCounter() as saves_only:
        ckpt.save(4, {**state, "step": 4}).wait()
    assert saves_only.calls == {} and saves_only.sequence == 0, (saves_only.calls, saves_only.sequence)
    ckpt.wait()  # on rank 0 this includes the retention policy's deletion of step 2
    assert ckpt.steps() == [3, 4] if rank == 0 else ckpt.steps()[-2:] == [3, 4]

    fresh_model, fresh_optimizer = fsdp2_model(world_size)
    resumed = {"model": tc.ModelState(fresh_model), "optim": tc.OptimizerState(fresh_model, fresh_optimizer), "step": 0}
    assert ckpt.load(resumed, step=3) == 3 and resumed["step"] == 3
    fsdp2_train(fresh_model, fresh_optimizer, range(3, 4))  # both have now done steps 0-3
    for (name, a), (_, b) in zip(model.named_parameters(), fresh_model.named_parameters()):
        assert torch.equal(a._local_tensor, b._local_tensor), name
    a_state = optimizer.state_dict()["state"]
    for key, value in fresh_optimizer.state_dict()["state"].items():
        for k, v in value.items():
            ref = a_state[key][k]
            v, ref = (v._local_tensor, ref._local_tensor) if isinstance(v, DTensor) else (v, ref)
            assert torch.equal(v, ref), (key, k)
    full = {name: p.full_tensor() for name, p in model.named_parameters()}
    if rank == 0:
        torch.save(full, out)
    ckpt.close()


# ---- local tensors that describe their own pieces (DCP's checkpoint hooks) -----------------------

def hook_tensors(step: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return {"d": torch.randn(6, 16, generator=g), "e": torch.randn(5, 8, generator=g)}


def column_pieces(full: torch.Tensor, columns: list[tuple[int, int]], mesh, *, transposed: int | None = None) -> DTensor:
    """A DTensor whose local tensor is torch's LocalShardsWrapper (the hooks' implementation TorchRec
    uses) holding the given column ranges of `full`: layouts placements cannot express. Piece number
    `transposed` is stored as a non-contiguous view."""
    from torch.distributed.tensor._shards_wrapper import LocalShardsWrapper

    pieces = []
    for i, (lo, hi) in enumerate(columns):
        piece = full[:, lo:hi].clone()
        pieces.append(piece.t().contiguous().t() if i == transposed else piece)
    local = LocalShardsWrapper(pieces, [(0, lo) for lo, _ in columns])
    return DTensor.from_local(local, mesh, [Shard(1)], run_check=False, shape=full.shape, stride=full.stride())


def hook_layout(rank: int, mesh, full: dict[str, torch.Tensor], *, swapped: bool) -> dict[str, DTensor]:
    """d: interleaved 4-column blocks (rank r: blocks r and r+2, or 1-r and 3-r when swapped);
    e: all of it on rank 0 in two uneven pieces, nothing on rank 1."""
    blocks = (1 - rank, 3 - rank) if swapped else (rank, rank + 2)
    return {
        "d": column_pieces(full["d"], [(4 * b, 4 * b + 4) for b in blocks], mesh, transposed=1),
        "e": column_pieces(full["e"], [(0, 3), (3, 8)] if rank == 0 else [], mesh),
    }


def hooks_round_trip(rank: int, world_size: int, root: str) -> None:
    """Save DTensors whose local tensors name their own pieces (asynchronously, changing them right
    after staging), save again without any collective, and load into other layouts: the same hooks
    with the blocks swapped between ranks, and plain Shard(0) DTensors."""
    mesh = init_device_mesh("cpu", (world_size,))
    ckpt = tc.Checkpointer(root)
    # LocalShardsWrapper always reports float32, so bf16 pieces contradict their DTensor's dtype.
    # Only rank 0 holds pieces of "e" and finds out; it raises its error, and rank 1, instead of
    # waiting forever in the layout exchange, raises one naming rank 0 and the error.
    wrong = hook_layout(rank, mesh, {**hook_tensors(1), "e": hook_tensors(1)["e"].bfloat16()}, swapped=False)
    try:
        ckpt.save(1, wrong)
        raise AssertionError("a piece of the wrong dtype was saved")
    except ValueError as e:
        assert "DTensor 'e': its local tensor returned a torch.bfloat16[5, 3] piece on cpu" in str(e), e
        assert str(e).startswith("DTensor 'e'" if rank == 0 else "the state cannot be saved on every rank: rank 0: ValueError"), e
    state = hook_layout(rank, mesh, hook_tensors(1), swapped=False)
    handle = ckpt.save(1, state)
    handle.wait_staged()
    for value in state.values():
        for piece in value._local_tensor.local_shards():
            piece.fill_(-1)  # the saved step keeps the values of save time
    handle.wait()
    state = hook_layout(rank, mesh, hook_tensors(2), swapped=False)
    with CollectiveCounter() as counter:
        ckpt.save(2, state, blocking=True)
    assert counter.calls == {} and counter.sequence == 0, (counter.calls, counter.sequence)

    zeros = {k: torch.zeros_like(v) for k, v in hook_tensors(1).items()}
    target = hook_layout(rank, mesh, zeros, swapped=True)
    assert ckpt.load(target, step=1) == 1
    expected = hook_layout(rank, mesh, hook_tensors(1), swapped=True)
    for name in target:
        got, want = target[name]._local_tensor.local_shards(), expected[name]._local_tensor.local_shards()
        assert len(got) == len(want) and all(torch.equal(a, b) for a, b in zip(got, want)), name
    rows = {k: distribute_tensor(v, mesh, [Shard(0)]) for k, v in zeros.items()}
    assert ckpt.load(rows, step=2) == 2
    for name, value in rows.items():
        assert torch.equal(value._local_tensor, hook_tensors(2)[name].chunk(world_size)[rank]), name
    # Only the pieces differ from step 2's layout (same shapes, placements, local shapes): still a
    # new layout, published through the storage without a collective.
    with CollectiveCounter() as counter:
        ckpt.save(3, hook_layout(rank, mesh, hook_tensors(3), swapped=True), blocking=True)
    assert counter.calls == {} and counter.sequence == 0, (counter.calls, counter.sequence)
    ckpt.close()


def damage_and_failure_on_two(rank: int, world_size: int, root: str) -> None:
    """Damage only rank 1 reads (its shard of step 2): both ranks fall back to step 1 together. Then
    rank 1 cannot write step 3: the per-step poll stops both ranks and the folder is removed. Then a
    damaged record that only rank 1 checks: both fall back again."""
    import time
    import warnings

    mesh = init_device_mesh("cpu", (world_size,))
    full = {step: torch.arange(64 * 8, dtype=torch.float32).reshape(64, 8) * step for step in (1, 2, 3)}
    ckpt = tc.Checkpointer(FailingStorage(root, fail_rank=1, fail_step=3, rank=rank))
    for step in (1, 2):
        ckpt.save(step, {"w": distribute_tensor(full[step], mesh, [Shard(0)]), "step": step}).wait()
    ckpt.close()
    dist.barrier()
    ckpt = tc.Checkpointer(FailingStorage(root, fail_rank=1, fail_step=3, rank=rank))  # the next run
    if rank == 0:  # a flipped bit in the tensor bytes of rank 1's file: rank 0 never reads them
        data = Path(root, "step-2", "rank-00001.safetensors")
        raw = bytearray(data.read_bytes())
        raw[-7] ^= 4
        data.write_bytes(bytes(raw))
    dist.barrier()
    target = {"w": distribute_tensor(torch.zeros(64, 8), mesh, [Shard(0)]), "step": 0}
    with warnings.catch_warnings(record=True) as warned:
        warnings.simplefilter("always")
        assert ckpt.load(target) == 1, "the ranks did not agree to skip the damaged step"
    assert torch.equal(target["w"].full_tensor(), full[1]) and target["step"] == 1
    if rank == 0:
        assert any("rank-00001.safetensors" in str(w.message) and "damaged-step-2" in str(w.message) for w in warned), warned
    assert ckpt.steps() == [1]

    ckpt.save(2, {"w": distribute_tensor(full[2], mesh, [Shard(0)]), "step": 2}).wait()
    ckpt.save(3, {"w": distribute_tensor(full[3], mesh, [Shard(0)]), "step": 3})  # fails on rank 1
    deadline = time.monotonic() + 60
    try:
        while time.monotonic() < deadline:
            ckpt.raise_if_failed()  # the trainer's per-step poll
            time.sleep(0.005)
        raise AssertionError("the failed save was not reported")
    except tc.CommitError as e:
        assert "step 3" in str(e) and ("rank(s) [1]" in str(e) if rank == 0 else "injected" in str(e)), e
    dist.barrier()
    assert not Path(root, ".tmp-step-3").exists() and ckpt.steps() == [1, 2]
    ckpt.close()

    # A flipped bit in rank 1's record of step 2, which only rank 1 checks (each rank checks its share
    # of the records) and only rank 1 reads: again both ranks fall back together.
    if rank == 0:
        record = next(Path(root, "step-2").glob("rank-00001.*.json"))
        raw = bytearray(record.read_bytes())
        raw[len(raw) // 3] ^= 1
        record.write_bytes(bytes(raw))
    dist.barrier()
    with tc.Checkpointer(root) as ckpt, warnings.catch_warnings(record=True) as warned:
        warnings.simplefilter("always")
        assert ckpt.load(target) == 1, "the ranks did not agree to skip the step with a damaged record"
    assert torch.equal(target["w"].full_tensor(), full[1])
    if rank == 0:
        assert any(record.name in str(w.message) for w in warned), warned


def _reserve_state(rank: int, mesh, step: int, rows: int) -> dict:
    g = torch.Generator().manual_seed(step)
    w, r = torch.randn(rows, 6, generator=g), torch.randn(5, generator=g)
    return {"model": {"w": distribute_tensor(w, mesh, [Shard(0)]), "r": distribute_tensor(r, mesh, [Replicate()]),
                      "bias": torch.full((3,), float(step))},
            "rng": torch.tensor([rank, step], dtype=torch.uint8), "step": step}


def reserve_on_two(rank: int, world_size: int, root: str) -> None:
    """Two runs of the same saves, `unreserved` then `reserved` (reserve() held back until after the
    first save was called, so that save waits for it); step 2's state is larger (more slabs) and has a
    new entry. reserve() runs the first-save exchange; the saves after it run no collective."""
    import torch_checkpointing.staging as staging

    mesh = init_device_mesh("cpu", (world_size,))
    states = {1: _reserve_state(rank, mesh, 1, 10), 2: _reserve_state(rank, mesh, 2, 4000)}
    states[2]["model"]["extra"] = torch.arange(4.0)
    expected = {step: _reserve_state(rank, mesh, step, rows) for step, rows in ((1, 10), (2, 4000))}
    release, real_take = threading.Event(), staging.HostPool.take

    def held_back_take(pool, *args, **kwargs):
        if kwargs.get("touch"):  # reserve()'s allocation, on its background thread
            assert release.wait(30)
        return real_take(pool, *args, **kwargs)

    staging.HostPool.take = held_back_take
    exchange = {"gather_object": 1, "all_gather": 1, "gather": 1, "broadcast_object_list": 1, "broadcast": 2}
    for name in ("unreserved", "reserved"):
        ckpt = tc.Checkpointer(f"{root}/{name}", per_rank=("rng",), slab_bytes=16 << 10, block_bytes=4096)
        with CollectiveCounter() as before:
            if name == "reserved":
                reservation = ckpt.reserve(states[1])
                assert not reservation.done()
                threading.Timer(0.3, release.set).start()
        with CollectiveCounter() as saving:
            ckpt.save(1, states[1], manual_release=True).order_current_stream()
            if name == "reserved":
                assert reservation.done()
            local = states[1]["model"]["w"]._local_tensor
            kept = local.clone()
            local.mul_(-1.0)  # after the save returned: not in the checkpoint
            local.copy_(kept)  # (the same values for the second run)
            ckpt.save(2, states[2]).wait()
        if name == "reserved":
            assert before.calls == exchange and saving.calls == {} and saving.sequence == 0, (before.calls, saving.calls)
        else:
            assert before.calls == {} and saving.calls == exchange, saving.calls
        for step in (1, 2):
            target = _reserve_state(rank, mesh, step, 10 if step == 1 else 4000)
            for t in (target["model"]["w"]._local_tensor, target["model"]["r"]._local_tensor, target["model"]["bias"]):
                t.zero_()
            if step == 2:
                target["model"]["extra"] = torch.zeros(4)
            target["rng"].zero_()
            assert ckpt.load(target, step=step) == step
            want = expected[step]
            for key in ("w", "r"):
                assert torch.equal(target["model"][key]._local_tensor, want["model"][key]._local_tensor), (name, step, key)
            assert torch.equal(target["model"]["bias"], want["model"]["bias"])
            assert target["rng"].tolist() == [rank, step] and target["step"] == step
            if step == 2:
                assert torch.equal(target["model"]["extra"], torch.arange(4.0))
        ckpt.close()
