"""torch.distributed.checkpoint round trips on 2 gloo ranks: model and optimizer state saved from
one placement load into another placement, into fully_shard, and into plain tensors, bit for bit."""
from __future__ import annotations

import pytest
import torch

# name-pattern rules (names are relative to each shard() call)
SAVE_RULE = {"w*.weight": "owned", "gate": "block-8x16", "tok_embeddings.weight": "block-8x16", "output.weight": "owned"}
LOAD_RULE = {"w*.weight": "block-16x8", "tok_embeddings.weight": "owned"}


def _placements(rule):
    import flexshard

    make = {
        "owned": flexshard.Owned(),
        "block-8x16": flexshard.BlockShard(block=(8, 16)),
        "block-16x8": flexshard.BlockShard(block=(16, 8)),
    }
    return {pattern: make[kind] for pattern, kind in rule.items()}


def _build(mesh, rule, seed, meta=False):
    import flexshard
    from flexshard_testmodel import make_model

    if meta:
        with torch.device("meta"):
            model = make_model(seed)
    else:
        model = make_model(seed)
    for layer in model.layers:
        flexshard.shard(layer, mesh, placements=_placements(rule))
    flexshard.shard(model, mesh, placements=_placements(rule))
    if meta:
        model.to_empty(device="cpu")
    return model


def _train(model, opt, rank, steps, first=0):
    from flexshard_testmodel import batch, loss_fn

    for step in range(first, first + steps):
        tokens, targets = batch(step, 4)
        rows = slice(2 * rank, 2 * rank + 2)
        loss_fn(model(tokens[rows]), targets[rows]).backward()
        opt.step()
        opt.zero_grad()


def _full(model, opt):
    import flexshard

    params = {n: flexshard.full_tensor(p) for n, p in model.named_parameters()}
    states = {n: {k: flexshard.full_tensor(v) for k, v in opt.state[p].items() if k != "step"} for n, p in model.named_parameters()}
    return params, states


def checkpoint_worker(rank, world, path):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    import flexshard
    from flexshard_testmodel import make_model

    mesh = init_device_mesh("cpu", (world,))
    report = {}
    saved = _build(mesh, SAVE_RULE, seed=0)
    saved_opt = torch.optim.AdamW(saved.parameters(), lr=1e-2)
    _train(saved, saved_opt, rank, steps=2)
    state = {"model": get_model_state_dict(saved), "optim": get_optimizer_state_dict(saved, saved_opt)}
    report["all_dtensors"] = all(isinstance(v, DTensor) for v in state["model"].values())
    dcp.save(state, checkpoint_id=path)
    want_params, want_states = _full(saved, saved_opt)

    def load_into(model, opt):
        target = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}
        dcp.load(target, checkpoint_id=path)
        set_model_state_dict(model, target["model"])
        set_optimizer_state_dict(model, opt, target["optim"])
        params, states = _full(model, opt)
        same_params = all(torch.equal(params[n], want_params[n]) for n in want_params)
        same_states = all(torch.equal(states[n][k], want_states[n][k]) for n in want_states for k in want_states[n])
        return same_params, same_states

    # Another placement (BlockShard <-> Owned swapped), built on the meta device and materialised.
    other = _build(mesh, LOAD_RULE, seed=1, meta=True)
    other_opt = torch.optim.AdamW(other.parameters(), lr=1e-2)
    report["reshard"] = load_into(other, other_opt)
    # Training continues identically from both (same full weights, same reduced gradients).
    _train(saved, saved_opt, rank, steps=1, first=2)
    _train(other, other_opt, rank, steps=1, first=2)
    after_saved, _ = _full(saved, saved_opt)
    after_other, _ = _full(other, other_opt)
    report["continues"] = all(torch.equal(after_saved[n], after_other[n]) for n in after_saved)

    # fully_shard reads it (its Shard(0) chunks overlap several of our pieces).
    fsdp = make_model(2)
    for layer in fsdp.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(fsdp, mesh=mesh)
    fsdp_opt = torch.optim.AdamW(fsdp.parameters(), lr=1e-2)
    _train(fsdp, fsdp_opt, rank, steps=1)  # creates optimizer state to load into
    report["fully_shard"] = load_into(fsdp, fsdp_opt)

    # And back: a fully_shard checkpoint loads into Owned / BlockShard parameters.
    _train(fsdp, fsdp_opt, rank, steps=1, first=5)
    fsdp_params = {n: p.full_tensor() for n, p in fsdp.named_parameters()}
    dcp.save({"model": get_model_state_dict(fsdp)}, checkpoint_id=path + "-fsdp")
    back = _build(mesh, SAVE_RULE, seed=3)
    target = {"model": get_model_state_dict(back)}
    dcp.load(target, checkpoint_id=path + "-fsdp")
    set_model_state_dict(back, target["model"])
    report["from_fully_shard"] = all(torch.equal(flexshard.full_tensor(p), fsdp_params[n]) for n, p in back.named_parameters())

    # Plain tensors: every rank reads the whole of every parameter.
    plain = {n: torch.empty_like(t) for n, t in want_params.items()}
    dcp.load({"model": plain}, checkpoint_id=path)
    report["plain"] = all(torch.equal(plain[n], want_params[n]) for n in plain)
    return report


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    from flexshard_ranks import run_ranks

    return run_ranks(checkpoint_worker, world=2, path=str(tmp_path_factory.mktemp("dcp")))


def test_state_dict_holds_dtensors(report):
    assert all(r["all_dtensors"] for r in report)


def test_load_into_another_placement(report):
    for r in report:
        assert r["reshard"] == (True, True)  # parameters, optimizer state


def test_training_continues_identically_after_resharding(report):
    assert all(r["continues"] for r in report)


def test_fully_shard_loads_a_flexshard_checkpoint(report):
    for r in report:
        assert r["fully_shard"] == (True, True)


def test_flexshard_loads_a_fully_shard_checkpoint(report):
    assert all(r["from_fully_shard"] for r in report)


def test_plain_tensors_load_a_flexshard_checkpoint(report):
    assert all(r["plain"] for r in report)
