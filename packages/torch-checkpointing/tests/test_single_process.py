"""One process: what a state may hold, the save/load API, retention, errors, format, HF export."""
from __future__ import annotations

import json
import math
import struct

import pytest
import safetensors.torch
import torch

import torch_checkpointing as tc


def sample_state(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {
        "model": {
            "w": torch.randn(33, 17, generator=g),
            "b16": torch.randn(5, 7, generator=g).to(torch.bfloat16),
            "i": torch.randint(-5, 5, (4,), generator=g),
            "flag": torch.tensor([True, False, True]),
            "scalar": torch.tensor(float(seed)),
            "empty": torch.empty(0, 3),
            "strided": torch.randn(6, 4, generator=g).t(),  # not contiguous
        },
        "values": {"int": seed, "float": 0.1 * seed, "nan": math.nan, "inf": -math.inf, "str": f"s{seed}",
                   "none": None, "bool": seed % 2 == 0, "bytes": bytes(range(seed, seed + 40)),
                   "tuple": (seed, 2.5, ("x", None)), "ints": [seed, seed + 1], 7: "int key",
                   "dtype": torch.bfloat16, "dtypes": (torch.float8_e4m3fn, torch.int64)},
        "nested": [[torch.full((2,), float(seed)), {"deep": [torch.arange(3) * seed, "leaf"]}], 5],
    }


def zeros_like_state(state):
    if isinstance(state, dict):
        return {k: zeros_like_state(v) for k, v in state.items()}
    if isinstance(state, list):
        return [zeros_like_state(v) for v in state]
    if isinstance(state, torch.Tensor):
        return torch.zeros_like(state)
    return {int: 0, float: 0.0, str: "", bytes: b"", bool: False, tuple: (), type(None): None,
            torch.dtype: torch.float32}[type(state)]


def assert_same(a, b, path="state"):
    if isinstance(a, dict):
        assert a.keys() == b.keys(), path
        for k in a:
            assert_same(a[k], b[k], f"{path}.{k}")
    elif isinstance(a, list):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{path}.{i}")
    elif isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and torch.equal(a, b), path
    elif isinstance(a, float) and math.isnan(a):
        assert math.isnan(b), path
    else:
        assert a == b and type(a) is type(b), (path, a, b)


@pytest.mark.parametrize("blocking", [False, True])
def test_round_trip_every_kind_of_value(tmp_path, blocking):
    saved = sample_state(3)
    with tc.Checkpointer(tmp_path) as ckpt:
        handle = ckpt.save(10, saved, blocking=blocking)
        assert handle.staged()
        handle.wait()
        assert handle.done()
        loaded = zeros_like_state(saved)
        assert ckpt.load(loaded) == 10
    assert_same(saved, loaded)


def test_async_save_keeps_the_values_of_save_time(tmp_path):
    state = {"w": torch.zeros(1000, 100)}
    with tc.Checkpointer(tmp_path) as ckpt:
        handle = ckpt.save(1, state)
        handle.wait_staged()
        state["w"].fill_(7.0)  # allowed: staging is done
        handle.wait()
        ckpt.load(state)
    assert torch.equal(state["w"], torch.zeros(1000, 100))


def test_reserve_allocates_the_staging_memory_before_the_first_save(tmp_path, monkeypatch):
    state = {"w": torch.randn(1000, 100), "v": torch.randn(300, 7).t(), "step": 1}
    slab_bytes = 64 << 10  # 400 KB of state: several slabs
    with tc.Checkpointer(tmp_path, slab_bytes=slab_bytes, block_bytes=4096) as ckpt:
        ckpt.reserve(state).result()
        allocated = []
        real_empty = torch.empty

        def counting_empty(*args, **kwargs):
            # a CPU slab is cut page-aligned from one page more (direct I/O)
            if args in ((slab_bytes,), (slab_bytes + 4096,)) and kwargs.get("dtype") == torch.uint8:
                allocated.append(args)
            return real_empty(*args, **kwargs)

        monkeypatch.setattr(torch, "empty", counting_empty)
        expected = {k: v.clone() for k, v in state.items() if isinstance(v, torch.Tensor)}
        handle = ckpt.save(1, state, manual_release=True)
        handle.order_current_stream()  # on CPU the copies ended in save(): nothing to order
        state["w"].zero_()
        handle.wait()
        assert allocated == []  # the first save staged into the reserved slabs
        ckpt.save(2, {"w": torch.randn(2000, 100), "v": state["v"], "step": 2}).wait()  # a larger state: more slabs
        assert len(allocated) > 0  # (so the counter would have seen an allocation in save 1)
        monkeypatch.undo()
        target = {"w": torch.empty(1000, 100), "v": torch.empty(7, 300), "step": 0}
        ckpt.load(target, step=1)
    assert torch.equal(target["w"], expected["w"]) and torch.equal(target["v"], expected["v"]) and target["step"] == 1


def test_an_unchanged_layout_reads_exactly_the_stored_bytes(tmp_path):
    class CountingStorage(tc.LocalStorage):
        bytes_read = 0

        def read_into(self, path, offset, out):
            CountingStorage.bytes_read += out.nbytes
            super().read_into(path, offset, out)

    state = {"a": torch.randn(300, 1000), "b": torch.randn(7).to(torch.bfloat16), "c": torch.arange(5)}
    with tc.Checkpointer(CountingStorage(tmp_path), block_bytes=4096) as ckpt:
        ckpt.save(1, state, blocking=True)
        target = {k: torch.zeros_like(v) for k, v in state.items()}
        ckpt.load(target)
    # the tensors' bytes, and the data file's safetensors header, which is checked before a load
    header = tmp_path / "step-1" / "rank-00000.safetensors"
    header_bytes = 8 + struct.unpack("<Q", header.read_bytes()[:8])[0]
    assert CountingStorage.bytes_read == sum(t.numel() * t.element_size() for t in state.values()) + header_bytes
    assert all(torch.equal(target[k], state[k]) for k in state)


def test_steps_latest_and_retention(tmp_path):
    state = {"x": torch.ones(3)}
    with tc.Checkpointer(tmp_path, keep_last=2, keep_every=5) as ckpt:
        assert ckpt.latest_step() is None and ckpt.steps() == []
        for step in range(1, 13):
            ckpt.save(step, state)
        ckpt.wait()
        assert ckpt.steps() == [5, 10, 11, 12] and ckpt.latest_step() == 12
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-10", "step-11", "step-12", "step-5"]


def test_load_of_a_given_step_and_stateful_objects(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(2, 4)).sum().backward()
    optimizer.step()
    with tc.Checkpointer(tmp_path) as ckpt:
        ckpt.save(1, {"model": model, "optim": tc.OptimizerState(model, optimizer)}, blocking=True)
        before = {k: v.clone() for k, v in model.state_dict().items()}
        exp_avg = optimizer.state[model.weight]["exp_avg"].clone()
        model(torch.randn(2, 4)).sum().backward()
        optimizer.step()
        ckpt.save(2, {"model": model}, blocking=True)

        fresh = torch.nn.Linear(4, 3)
        fresh_optimizer = torch.optim.AdamW(fresh.parameters(), lr=0.1)  # no state yet
        ckpt.load({"model": fresh, "optim": tc.OptimizerState(fresh, fresh_optimizer)}, step=1)
    for k, v in fresh.state_dict().items():
        assert torch.equal(v, before[k]), k
    assert torch.equal(fresh_optimizer.state[fresh.weight]["exp_avg"], exp_avg)


def test_parameters_that_require_grad_load_in_place(tmp_path):
    model = torch.nn.Linear(6, 5)
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    with tc.Checkpointer(tmp_path) as ckpt:
        ckpt.save(1, {"w": model.weight, "b": model.bias}, blocking=True)
        with torch.no_grad():
            model.weight.zero_(), model.bias.zero_()
        ckpt.load({"w": model.weight, "b": model.bias})
    assert torch.equal(model.weight, saved["weight"]) and torch.equal(model.bias, saved["bias"])
    assert model.weight.requires_grad and model.weight.grad_fn is None


def test_per_rank_tensor_may_change_size(tmp_path):
    with tc.Checkpointer(tmp_path, per_rank=("loader",)) as ckpt:
        ckpt.save(1, {"loader": {"buffer": torch.arange(5)}}, blocking=True)
        ckpt.save(2, {"loader": {"buffer": torch.arange(9)}}, blocking=True)
        target = {"loader": {"buffer": torch.zeros(5, dtype=torch.long)}}
        ckpt.load(target)
    assert torch.equal(target["loader"]["buffer"], torch.arange(9))  # replaced: the size changed


def test_load_casts_dtype_but_rejects_other_shapes_and_missing_keys(tmp_path):
    with tc.Checkpointer(tmp_path) as ckpt:
        ckpt.save(1, {"w": torch.arange(6.0).reshape(2, 3), "n": 1}, blocking=True)
        target = {"w": torch.zeros(2, 3, dtype=torch.float64)}
        ckpt.load(target)
        assert torch.equal(target["w"], torch.arange(6.0, dtype=torch.float64).reshape(2, 3))
        with pytest.raises(ValueError, match=r"'w' has global shape \(3, 2\) here but \(2, 3\)"):
            ckpt.load({"w": torch.zeros(3, 2)})
        with pytest.raises(ValueError, match=r"no entry for 2 state key\(s\): \['x', 'y.z'\]"):
            ckpt.load({"x": torch.zeros(1), "y": {"z": 3}, "w": torch.zeros(2, 3)})
        with pytest.raises(ValueError, match="'n' is stored per rank .* but a tensor"):
            ckpt.load({"n": torch.zeros(1)})
        with pytest.raises(ValueError, match="step 7 is not committed"):
            ckpt.load({}, step=7)


def test_user_errors_name_what_is_wrong(tmp_path):
    with pytest.raises(ValueError, match="keep_last must be a positive int"):
        tc.CheckpointerConfig(keep_last=0)
    with pytest.raises(ValueError, match="block_bytes must be a power of two"):
        tc.CheckpointerConfig(block_bytes=5000)
    with pytest.raises(TypeError, match="unknown Checkpointer settings \\['keep'\\]"):
        tc.Checkpointer(tmp_path, keep=3)
    with pytest.raises(ValueError, match="no committed step"):
        tc.Checkpointer(tmp_path).load({})
    ckpt = tc.Checkpointer(tmp_path)
    with pytest.raises(TypeError, match="'a.b' is a set"):
        ckpt.save(1, {"a": {"b": {1, 2}}})
    with pytest.raises(TypeError, match="'opt' is an optimizer"):
        ckpt.save(1, {"opt": torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=0.1)})
    from torch.distributed.tensor._shards_wrapper import LocalShardsWrapper  # implements DCP's hooks

    with pytest.raises(TypeError, match="'pieces' is a LocalShardsWrapper implementing __create_write_items__.*outside a DTensor"):
        ckpt.save(1, {"pieces": LocalShardsWrapper([torch.ones(2, 3)], [(0, 3)])})
    with pytest.raises(ValueError, match="two state entries share the path 'a.b'"):
        ckpt.save(1, {"a.b": 1, "a": {"b": 2}})
    with pytest.raises(ValueError, match="step must be a non-negative int"):
        ckpt.save(-1, {})
    ckpt.save(1, {"x": 1}, blocking=True)
    with pytest.raises(ValueError, match="step 1 was already saved"):
        ckpt.save(1, {"x": 1})
    ckpt.close()
    with pytest.raises(ValueError, match="step 1 is already committed"):
        tc.Checkpointer(tmp_path).save(1, {"x": 1})
    with pytest.raises(ValueError, match="closed"):
        ckpt.save(2, {"x": 1})


def test_the_format_is_readable_without_this_library(tmp_path):
    state = {"model": {"w": torch.randn(4, 5), "h": torch.randn(3).half()}, "step": 12, "blob": b"abc"}
    with tc.Checkpointer(tmp_path) as ckpt:
        ckpt.save(12, state, blocking=True)
    step_dir = tmp_path / "step-12"
    assert json.loads((step_dir / "commit.json").read_text())["step"] == 12
    metadata = json.loads((step_dir / "metadata.json").read_text())
    chunk = metadata["tensors"]["model.w"]["chunks"][0]
    record = json.loads((step_dir / metadata["records"][chunk["rank"]]).read_text())
    tensors = safetensors.torch.load_file(step_dir / record["file"])  # the safetensors library itself
    assert torch.equal(tensors[chunk["name"]], state["model"]["w"])
    assert torch.equal(tensors["model.h"], state["model"]["h"])
    assert bytes(tensors["blob"].tolist()) == b"abc" and record["values"]["step"] == {"value": 12}
    raw = (step_dir / record["file"]).read_bytes()  # and by hand: offsets in the record are absolute
    start, end = record["stored"]["model.w"]["data_offsets"]
    assert raw[start:end] == state["model"]["w"].numpy().tobytes()
    assert (8 + struct.unpack("<Q", raw[:8])[0]) % 4096 == 0  # data starts page-aligned


def test_leftovers_of_an_unfinished_run_are_removed_on_the_first_save(tmp_path):
    with tc.Checkpointer(tmp_path) as ckpt:
        ckpt.save(1, {"x": 1}, blocking=True)
    (tmp_path / ".tmp-step-2").mkdir()
    (tmp_path / ".tmp-step-2" / "rank-00000.safetensors").write_bytes(b"partial")
    (tmp_path / "step-3").mkdir()  # renamed, but the commit record never written
    with tc.Checkpointer(tmp_path) as ckpt:
        assert ckpt.steps() == [1]
        ckpt.load({"x": 0})  # reading leaves them alone
        assert (tmp_path / ".tmp-step-2").exists()
        ckpt.save(4, {"x": 4}, blocking=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-1", "step-4"]


def test_hf_export_writes_an_index_and_shards(tmp_path):
    g = torch.Generator().manual_seed(0)
    model = {f"layers.{i}.w": torch.randn(16, 8, generator=g) for i in range(5)}
    model["norm"] = torch.randn(8, generator=g)
    model["steps"] = torch.arange(4)
    with tc.Checkpointer(tmp_path / "ckpt") as ckpt:
        ckpt.save(1, {"model": model, "optim": {"m": torch.ones(2)}}, blocking=True)
        written = ckpt.export_hf(
            tmp_path / "hf", prefix="model.", dtype=torch.bfloat16, max_shard_bytes=600,  # two 256-byte tensors a file
            rename=lambda name: None if name == "norm" else f"model.{name}",
        )
    index = json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) == 3 and sorted(written) == sorted(files + ["model.safetensors.index.json"])
    loaded = {}
    for f in files:
        loaded.update(safetensors.torch.load_file(tmp_path / "hf" / f))
    assert loaded.keys() == index["weight_map"].keys() == {f"model.{k}" for k in model if k != "norm"}
    for name, value in model.items():
        if name != "norm":
            expected = value.to(torch.bfloat16) if value.is_floating_point() else value
            assert torch.equal(loaded[f"model.{name}"], expected), name
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in loaded.values())
