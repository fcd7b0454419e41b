"""Training parity on 2 gloo ranks: RowShard against torch's fully_shard (bitwise), Owned and
BlockShard against a single-process model on the same global batch, plus buckets, collective
counts and the inference path. One launch runs every scenario; the tests below check its report."""
from __future__ import annotations

import pytest
import torch

STEPS = 3
ROWS_PER_RANK = 2


def _shard_tiny(model, mesh, **kwargs):
    import flexshard

    for layer in model.layers:
        flexshard.shard(layer, mesh, **kwargs)
    flexshard.shard(model, mesh, **kwargs)
    return model


def _local_batch(step, rank, world):
    from flexshard_testmodel import batch

    tokens, targets = batch(step, ROWS_PER_RANK * world)
    rows = slice(rank * ROWS_PER_RANK, (rank + 1) * ROWS_PER_RANK)
    return tokens[rows], targets[rows], tokens, targets


def _vs_fully_shard(rank, world, mesh):
    """Same init, same data, same AdamW: fully_shard and flexshard RowShard with bf16 compute and fp32 reduction."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    import flexshard
    from flexshard_testmodel import loss_fn, make_model

    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    ours = _shard_tiny(make_model(), mesh, mp_policy=policy)
    theirs = make_model()
    for layer in theirs.layers:
        fully_shard(layer, mesh=mesh, mp_policy=policy)
    fully_shard(theirs, mesh=mesh, mp_policy=policy)
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1) for m in (ours, theirs)]
    report = {"loss_equal": [], "param_max_diff": [], "grad_max_diff": [], "collectives": None}
    for step in range(STEPS):
        tokens, targets, _, _ = _local_batch(step, rank, world)
        counters, losses = [], []
        for model in (ours, theirs):
            with flexshard.CollectiveCounter() as counter:
                loss = loss_fn(model(tokens), targets)
                loss.backward()
            counters.append(counter)
            losses.append(loss.detach())
        report["loss_equal"].append(torch.equal(*losses))
        pairs = list(zip(ours.named_parameters(), theirs.named_parameters()))
        assert all(n1 == n2 for (n1, _), (n2, _) in pairs)
        report["grad_max_diff"].append(max((a.grad.to_local() - b.grad.to_local()).abs().max().item() if a.grad.to_local().numel() else 0.0 for (_, a), (_, b) in pairs))
        for opt in opts:
            opt.step()
            opt.zero_grad()
        report["param_max_diff"].append(max((a.to_local() - b.to_local()).abs().max().item() if a.to_local().numel() else 0.0 for (_, a), (_, b) in pairs))
        if step == STEPS - 1:  # after the first iteration, prefetching is on: counts must not change
            report["collectives"] = [c.by_op() for c in counters]
            report["flexshard_bytes"] = counters[0].bytes
            report["fully_shard_bytes"] = counters[1].bytes
    report["placements"] = sorted({str(p.placements) for p in ours.parameters()})
    report["local_shapes_equal"] = all(a.to_local().shape == b.to_local().shape for a, b in zip(ours.parameters(), theirs.parameters()))
    return report


def _vs_single_rank(rank, world, mesh, placements, buckets=None, *, tied=False, checkpointed=False, micro=1, reshard=True):
    """fp32, SGD with momentum, against one process training on the global batch.
    tied: output shares the embedding weight; checkpointed: layers under torch's checkpoint_wrapper
    (non-reentrant, applied before sharding as with fully_shard); micro: gradient accumulation over
    micro-batches before each step; reshard: reshard_after_forward."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    import flexshard
    from flexshard_testmodel import loss_fn, make_model

    ref, ours = make_model(), make_model()
    if tied:
        ref.output.weight = ref.tok_embeddings.weight
        ours.output.weight = ours.tok_embeddings.weight
    if checkpointed:
        for i, layer in enumerate(ours.layers):
            ours.layers[i] = checkpoint_wrapper(layer)
    _shard_tiny(ours, mesh, placements=placements, buckets=buckets, reshard_after_forward=reshard)
    opt = torch.optim.SGD(ours.parameters(), lr=0.1, momentum=0.9)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    errors, counts = [], []
    for step in range(STEPS):
        with flexshard.CollectiveCounter() as counter:
            for m in range(micro):
                tokens, targets, _, _ = _local_batch(step * micro + m, rank, world)
                (loss_fn(ours(tokens), targets) / micro).backward()
        counts.append(counter.by_op())
        opt.step()
        opt.zero_grad()
        all_batches = [_local_batch(step * micro + m, rank, world)[2:] for m in range(micro)]
        loss_fn(ref(torch.cat([b[0] for b in all_batches])), torch.cat([b[1] for b in all_batches])).backward()
        ref_opt.step()
        ref_opt.zero_grad()
        want = dict(ref.named_parameters())
        errors.append(max((flexshard.full_tensor(p) - want[n.replace("._checkpoint_wrapped_module", "")]).abs().max().item() for n, p in ours.named_parameters()))
    return {"errors": errors, "counts": counts, "layout": str(flexshard.layout(ours)), "n_buckets": len(flexshard.layout(ours).buckets)}


def _inference_frees(rank, world, mesh):
    import flexshard
    from flexshard_testmodel import make_model

    model = _shard_tiny(make_model(), mesh, placements={"*w*": flexshard.Owned()})
    tokens, _, _, _ = _local_batch(0, rank, world)
    with torch.no_grad():
        model(tokens)
    slots = [s for _, b in flexshard.layout(model).buckets for s in b.slots]
    return all(s.unsharded.untyped_storage().size() == 0 for s in slots)


def parity_worker(rank, world):
    from torch.distributed.device_mesh import init_device_mesh

    import flexshard

    mesh = init_device_mesh("cpu", (world,))
    def block(name, p):  # gate [1, 24] is a single (4, 32) tile: rank 1 holds none of it
        if p.dim() != 2:
            return flexshard.Owned()
        return flexshard.BlockShard(block=(4, 32) if name.endswith("gate") else (8, 16))

    return {
        "fully_shard": _vs_fully_shard(rank, world, mesh),
        "owned": _vs_single_rank(rank, world, mesh, flexshard.Owned()),
        "block": _vs_single_rank(rank, world, mesh, block),
        "buckets": _vs_single_rank(rank, world, mesh, None, buckets=[["wqkv.*", "attention_norm.*"], "w1.*", "tok_embeddings.*"]),
        "sized": _vs_single_rank(rank, world, mesh, flexshard.Owned(), buckets=4096),
        "checkpointed": _vs_single_rank(rank, world, mesh, block, buckets=[["*w1*", "*w2*"]], checkpointed=True),
        "tied": _vs_single_rank(rank, world, mesh, flexshard.Owned(), tied=True),
        "accumulate": _vs_single_rank(rank, world, mesh, block, micro=2),
        "keep_gathered": _vs_single_rank(rank, world, mesh, flexshard.Owned(), reshard=False),
        "inference_frees": _inference_frees(rank, world, mesh),
    }


@pytest.fixture(scope="module")
def report():
    from flexshard_ranks import run_ranks

    return run_ranks(parity_worker, world=2)


def test_rowshard_matches_fully_shard_bitwise(report):
    """Same padded dim-0 layout, same bf16 casts, same fp32 AVG reduce-scatter over 2 ranks (a sum
    of two numbers does not depend on order): every loss, gradient and parameter agrees exactly."""
    for r in report:
        fs = r["fully_shard"]
        assert fs["placements"] == ["(Shard(dim=0),)"]
        assert fs["local_shapes_equal"]
        assert fs["loss_equal"] == [True] * STEPS
        assert fs["grad_max_diff"] == [0.0] * STEPS
        assert fs["param_max_diff"] == [0.0] * STEPS


def test_rowshard_issues_the_same_collectives_as_fully_shard(report):
    fs = report[0]["fully_shard"]
    ours, theirs = fs["collectives"]
    # 3 buckets (root, 2 layers): 3 all-gathers in forward, 2 again in backward (the root keeps its
    # parameters), 3 reduce-scatters.
    assert ours == {"_allgather_base_": 5, "_reduce_scatter_base_": 3}
    assert sum(theirs.values()) == 8
    assert fs["flexshard_bytes"] <= fs["fully_shard_bytes"] * 1.05  # alignment padding only


@pytest.mark.parametrize(
    "scenario", ["owned", "block", "buckets", "sized", "checkpointed", "tied", "accumulate", "keep_gathered"]
)
def test_matches_single_rank_training(report, scenario):
    """fp32 everywhere; the only difference from one process is that the batch gradient is the
    average of two half-batch gradients (different summation order), i.e. float32 rounding that
    SGD carries forward linearly: 1e-6 absolute on O(1) weights after 3 steps is ~10 ulps."""
    for r in report:
        assert max(r[scenario]["errors"]) < 1e-6, r[scenario]["errors"]


def test_buckets_give_one_all_gather_and_one_reduce_scatter_each(report):
    for r in report:
        b = r["buckets"]
        # root: [tok_embeddings] + [norm, output]; each layer: [wqkv, attention_norm], [w1], [rest]
        assert b["n_buckets"] == 2 + 2 * 3
        counts = b["counts"][-1]
        assert counts["_reduce_scatter_base_"] == b["n_buckets"]
        assert counts["_allgather_base_"] == b["n_buckets"] + 2 * 3  # layers gather again in backward


def test_size_buckets_and_layout_print(report):
    r = report[0]["sized"]
    assert r["n_buckets"] > 3  # 4 KiB caps split the layers
    text = r["layout"]
    assert text.startswith(f"flexshard layout: {r['n_buckets']} buckets over 2 ranks")
    assert "layers.0.wqkv.weight" in text and "Owned(rank=" in text


def test_blockshard_has_uneven_and_empty_shards(report):
    text = report[0]["block"]["layout"]
    gate = next(line for line in text.splitlines() if "layers.0.gate" in line)
    assert gate.split()[-2:] == ["24", "0"]  # one tile, on rank 0
    wqkv = next(line for line in text.splitlines() if "layers.0.wqkv.weight" in line)
    assert wqkv.split()[-2:] == ["896", "832"]  # [72, 24] in (8, 16) tiles: 9 x 2 tiles, edge tiles narrower


def test_collectives_with_checkpointing_accumulation_and_keeping(report):
    r = report[0]
    # 5 buckets (2 per layer, 1 root). Recomputation under activation checkpointing reuses the
    # parameters gathered for backward: 5 gathers in forward + 4 in backward, as without checkpointing.
    assert r["checkpointed"]["counts"][-1] == {"_allgather_base_": 9, "_reduce_scatter_base_": 5}
    per_step = r["owned"]["counts"][-1]
    assert r["accumulate"]["counts"][-1] == {k: 2 * v for k, v in r["block"]["counts"][-1].items()}  # per micro-batch
    assert r["keep_gathered"]["counts"][-1] == {"_allgather_base_": 3, "_reduce_scatter_base_": 3}
    assert per_step == {"_allgather_base_": 5, "_reduce_scatter_base_": 3}


def test_inference_frees_gathered_parameters(report):
    assert all(r["inference_frees"] for r in report)
