"""quantize.linear under tensor parallelism and flexshard's fp8 all-gather, on 2 gloo ranks, against one process.

TP2 (quantize/tensor_parallel.py): each rank quantises its weight, activation and gradient shards. Bitwise
where the design makes it so: every quantised operand of a colwise or rowwise shard equals the slice of the
1-process quantisation (fp8 values and scales, so the dequantised operand), for all four recipes (tensorwise
and rowwise through the amax max-reduced over tp, blockwise and MX because their blocks fall inside the
shards); a control shows that local tensorwise scales would not. The training curves then differ from one
process only by the order of fp32 sums, so they follow it within the shared tolerances (titan_train_curves).

flexshard (quantize/gathered.py): with fp8_blockwise and fp8_all_gather, the converted Linears' weights are
gathered as e4m3 + scales in the recipe's 128 x 128 blocks, and what the forward GEMM takes is bit for bit
quantize(the whole weight); the curve follows the 1-process blockwise run.
"""
from __future__ import annotations

import json
import os
import warnings
from pathlib import Path

import torch
from titan_train_ranks import join_gloo

from titan_train import train

RECIPES = ("fp8_tensorwise", "fp8_rowwise", "fp8_blockwise", "mxfp8")
STEPS = {"training.steps": "4"}
# The Linears every recipe can convert on the debug Llama under TP2 (wk/wv: kv width 128 / 2 = 64 is not a
# multiple of fp8_blockwise's 128, so it leaves them in high precision): one process converts the same ones.
TP_MODULES = {"fp8_blockwise": "layers.*.attention.wq,layers.*.attention.wo,layers.*.feed_forward.*"}


def _wide_range(rows: int, cols: int, seed: int) -> torch.Tensor:
    """Values over ~16 binades, the quadrants a row or column split makes 2^3 / 2^5 apart, so that tensor, row
    and block amaxes all differ between the shards."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols, generator=g) * torch.exp2(torch.randint(-8, 8, (rows, cols), generator=g).float())
    x[: rows // 2] *= 2.0 ** 3
    x[:, : cols // 2] *= 2.0 ** -5
    return x


def _operand_checks(rank: int, world: int) -> dict[str, bool]:
    """For each recipe, style and sharded operand: is this rank's quantised shard (dequantised: fp8 value x
    scale, exact) the slice of the whole operand's quantisation, bit for bit?"""
    import torch.distributed as dist

    from titan_train.quantize import RECIPES as ALL
    from titan_train.quantize import quantize
    from titan_train.quantize.quantized_matmul import ScaleGroups, _quantize
    from titan_train.quantize.tensor_parallel import SHARDED_OPERANDS, spanning_operands

    group = dist.group.WORLD
    whole = _wide_range(256, 512, seed=7)  # an operand [rows, reduction]
    out = {}
    for name in RECIPES:
        recipe = ALL[name]
        for style, operands in SHARDED_OPERANDS.items():
            groups = ScaleGroups(group=group, operands=spanning_operands(recipe, style))
            for operand, dim in operands.items():
                rows, cols = whole.shape
                piece = (slice(rank * rows // world, (rank + 1) * rows // world), slice(None)) if dim == "rows" \
                    else (slice(None), slice(rank * cols // world, (rank + 1) * cols // world))
                want = quantize(whole, getattr(recipe, operand)).dequantize()[piece]
                got = _quantize(whole[piece], recipe, operand, groups).dequantize()
                out[f"{name}/{style}/{operand}"] = torch.equal(got, want)
    # control: tensorwise scales taken on the shard alone are not the 1-process ones
    tensorwise = ALL["fp8_tensorwise"].weight
    mine = slice(rank * 256, (rank + 1) * 256)
    local = quantize(whole[:, mine], tensorwise).dequantize()
    out["control: local tensorwise"] = torch.equal(local, quantize(whole, tensorwise).dequantize()[:, mine])
    return out


def tp_worker(rank: int, world: int, init_method: str, configs: list, folder: str) -> None:
    import torch.distributed as dist

    join_gloo(rank, world, init_method)
    try:
        checks = _operand_checks(rank, world)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the left-in-high-precision notices
            for config in configs:
                train(config)
        if rank == 0:
            Path(folder, "operands.json").write_text(json.dumps(checks))
    finally:
        dist.destroy_process_group()
    os._exit(0)


def _job(jobs, folder: Path, recipe: str, **extra: str):
    modules = {"quantize.modules": TP_MODULES[recipe]} if recipe in TP_MODULES else {}
    return jobs.tiny(folder, **STEPS, **{"quantize.linear": recipe}, **modules, **extra)


def test_tp2_quantises_shards_as_one_process_and_follows_its_curves(tmp_path, jobs, cli):
    """TP2 on 2 gloo ranks, each recipe: the bitwise operand checks (module docstring), then 4 training steps
    within the shared tolerances of the 1-process run of the same recipe. Each 1-process run departs from the
    unquantised one by more than those tolerances, so following it is not following fp32. One spawn for all
    four recipes (~60 s on the shared 2-core machine: 9 short runs, 4 of them on 2 ranks, and the ranks'
    start-up; one parallel test per recipe would cost ~70 s each)."""
    from titan_train_curves import tolerance
    from titan_train_ranks import file_rendezvous, spawn_ranks

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        single = {r: train(_job(jobs, tmp_path / f"one_{r}", r)).losses for r in RECIPES}
    fp32 = train(jobs.tiny(tmp_path / "fp32", **STEPS)).losses
    configs = [_job(jobs, tmp_path / f"tp_{r}", r, **{"parallelism.tp": "2"}) for r in RECIPES]
    spawn_ranks(tp_worker, 2, (2, file_rendezvous(tmp_path), configs, str(tmp_path)))
    checks = json.loads((tmp_path / "operands.json").read_text())
    control = checks.pop("control: local tensorwise")
    assert all(checks.values()), [k for k, ok in checks.items() if not ok]
    assert len(checks) == 4 * 8 and not control
    for recipe, config in zip(RECIPES, configs):
        curve = cli.losses(Path(config.job.folder))
        jobs.assert_follows(curve, single[recipe])
        assert max(abs(single[recipe][s] - fp32[s]) / fp32[s] - tolerance(s) for s in fp32) > 0, (recipe, single, fp32)


def flexshard_worker(rank: int, world: int, init_method: str, config, folder: str) -> None:
    """The trainer's flexshard model: each converted Linear's first forward records what the GEMM took as W
    (the gathered e4m3 + scales) next to quantize(the whole weight), taken from the weights before any step
    through flexshard.full_tensor (an fp32 gather, independent of the fp8 one); then the run's curve."""
    import torch.distributed as dist

    import flexshard
    from titan_train.quantize import QuantizedLinear, quantize
    from titan_train.quantize.gathered import gathered_weight
    from titan_train.trainer import Trainer

    join_gloo(rank, world, init_method)
    try:
        trainer = Trainer(config, torch.device("cpu"))
        linears = {n: m for n, m in trainer.model.named_modules() if isinstance(m, QuantizedLinear)}
        whole = {n: flexshard.full_tensor(m.weight) for n, m in linears.items()}
        checks: dict[str, bool] = {}

        def record(name):
            def hook(module, args):
                if name in checks:
                    return
                got = gathered_weight(module.weight, module.recipe)
                want = quantize(whole[name].to(module.weight.dtype), module.recipe.weight)
                same_bytes = got is not None and torch.equal(got.data.view(torch.uint8), want.data.view(torch.uint8))
                checks[name] = same_bytes and torch.equal(got.scale, want.scale)
            return hook
        for name, module in linears.items():
            module.register_forward_pre_hook(record(name))
        trainer.run()
        if rank == 0:
            Path(folder, "gathered.json").write_text(json.dumps(checks))
    finally:
        dist.destroy_process_group()
    os._exit(0)


def test_flexshard_fp8_gather_feeds_the_blockwise_gemm(tmp_path, jobs, cli):
    """dp_shard 2, fsdp_impl flexshard, fp8_all_gather, fp8_blockwise: every converted Linear (the 7 of each of
    the 2 blocks) took its forward weight from the gather, bit for bit quantize(whole weight), and the loss
    curve follows the 1-process blockwise run (~45-85 s on the shared machine: one 2-rank run with its
    start-up, one single-process run)."""
    from titan_train_ranks import file_rendezvous, spawn_ranks

    single = train(jobs.tiny(tmp_path / "one", **STEPS, **{"quantize.linear": "fp8_blockwise"})).losses
    config = jobs.tiny(tmp_path / "flex", **STEPS, **{"quantize.linear": "fp8_blockwise", "parallelism.dp_shard": "2",
                                                      "parallelism.fsdp_impl": "flexshard",
                                                      "parallelism.fp8_all_gather": "true"})
    spawn_ranks(flexshard_worker, 2, (2, file_rendezvous(tmp_path), config, str(tmp_path)))
    checks = json.loads((tmp_path / "gathered.json").read_text())
    assert len(checks) == 2 * 7 and all(checks.values()), checks
    jobs.assert_follows(cli.losses(tmp_path / "flex"), single)
