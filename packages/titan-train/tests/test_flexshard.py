"""flexshard in place of fully_shard: per-parameter placements and buckets from the recipe, on 2 gloo ranks,
follow the single-process loss curve; fp8 all-gathers stay close to it; wrong choices are errors.

Tolerance (exact placements): relative 1e-4 per step over 10 steps for the loss and the gradient norm,
as test_parallel.py argues (the largest difference seen is 3e-7). fp8: the block-placed weights are
gathered as e4m3 (3 mantissa bits, one scale per tile), so every forward and backward sees weights off by
up to 2^-4 of their tile's largest entry; the loss moves by ~1e-3 relative (largest seen 1.3e-3), held to
1e-2, and it must differ from the exact curve (the quantized gather really ran).
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from titan_train import train
from titan_train.cli import main, parse_args
from titan_train.cli_args import ConfigError
from titan_train.sharding_impl import check_sharding_choices, parse_placements, placement_rule

STEPS = 10
PLACEMENTS = ("layers.*.attention.w*.weight=owned,layers.*.feed_forward.w*.weight=block:64x64,"
              "output.weight=block:128x64")


def curve(folder: Path) -> dict[int, tuple[float, float]]:
    records = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: (r["loss"], r["grad_norm"]) for r in records}


@pytest.fixture(scope="module")
def reference(tmp_path_factory, jobs):
    folder = tmp_path_factory.mktemp("single")
    result = train(jobs.tiny(folder, **{"training.steps": str(STEPS), "job.device": "cpu"}))
    assert result.losses[STEPS] < result.losses[1] - 1.0, f"the tiny job should learn: {result.losses}"
    return curve(folder)


FP8_STEPS = 6
TWO_RANKS = {  # id -> job of each flexshard run on 2 ranks, both in one spawn
    "flexshard": {"training.steps": str(STEPS), "job.device": "cpu", "parallelism.dp_shard": "2",
                  "parallelism.fsdp_impl": "flexshard", "parallelism.flexshard_placements": PLACEMENTS,
                  "parallelism.flexshard_buckets": "attention.*|attention_norm.*,feed_forward.*",
                  "checkpoint.interval": str(STEPS)},
    "fp8": {"training.steps": str(FP8_STEPS), "job.device": "cpu", "parallelism.dp_shard": "2",
            "parallelism.fsdp_impl": "flexshard", "parallelism.flexshard_placements": "layers.*.w*.weight=block:64x64",
            "parallelism.fp8_all_gather": "true"},
}


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory, jobs):
    """id -> job folder of each of TWO_RANKS, trained in one spawn of 2 gloo ranks."""
    root = tmp_path_factory.mktemp("two_ranks")
    return jobs.folders_on_ranks(root, TWO_RANKS, 2)


def test_flexshard_in_place_of_fully_shard(reference, two_ranks):
    folder = two_ranks["flexshard"]
    got = curve(folder)
    for step in range(1, STEPS + 1):
        assert got[step][0] == pytest.approx(reference[step][0], rel=1e-4), ("loss", step, got, reference)
        assert got[step][1] == pytest.approx(reference[step][1], rel=1e-4), ("grad_norm", step, got, reference)
    # The placements took effect: the checkpoint records who holds which piece.
    tensors = json.loads((folder / "checkpoints" / f"step-{STEPS}" / "metadata.json").read_text())["tensors"]
    owned = tensors["model.layers.0.attention.wq.weight"]["chunks"]
    assert len(owned) == 1 and owned[0]["shape"] == [256, 256]  # whole, on one rank
    tiles = tensors["model.output.weight"]["chunks"]  # [384, 256] in 128 x 64 tiles: 3 x 4, 6 per rank
    assert sorted(c["rank"] for c in tiles) == [0, 0, 1, 1] and all(c["shape"][0] % 128 == 0 for c in tiles)
    norm = tensors["model.layers.0.attention_norm.weight"]["chunks"]
    assert [c["shape"] for c in norm] == [[128], [128]]  # unmatched: rows


def test_fp8_all_gather_stays_close(tmp_path, jobs, two_ranks):
    steps = FP8_STEPS
    folder = two_ranks["fp8"]
    exact = train(jobs.tiny(tmp_path / "single", **{"training.steps": str(steps), "job.device": "cpu"})).losses
    got = {step: loss for step, (loss, _) in curve(folder).items()}
    assert got == pytest.approx(exact, rel=1e-2)
    assert any(abs(got[s] - exact[s]) > 1e-5 * exact[s] for s in exact), "fp8 gathers changed nothing"


def test_placements_and_buckets_from_the_command_line():
    config, _ = parse_args(["--parallelism.fsdp_impl", "flexshard", "--parallelism.flexshard_placements",
                            "layers.*.weight=owned, output.weight=block:128x64", "--parallelism.flexshard_buckets",
                            "attention.*|attention_norm.*,feed_forward.*"])
    assert config.parallelism.flexshard_placements == (("layers.*.weight", "owned"), ("output.weight", "block:128x64"))
    assert config.parallelism.flexshard_buckets == ("attention.*|attention_norm.*", "feed_forward.*")
    with pytest.raises(ConfigError, match="expects items of the form str=str"):
        parse_args(["--parallelism.flexshard_placements", "layers.*.weight"])


@pytest.mark.parametrize("overrides,degrees,message", [
    ({"parallelism.flexshard_placements": "output.weight=owned"}, {},
     "applies to fsdp_impl=flexshard, not fully_shard"),
    ({"parallelism.fsdp_impl": "flexshard", "parallelism.flexshard_placements": "*=blocks:8x8"}, {},
     "'*' has placement 'blocks:8x8'; allowed: row, owned, block:RxC"),
    ({"parallelism.fsdp_impl": "flexshard", "parallelism.fp8_all_gather": "true"}, {},
     "fp8_all_gather quantizes block placements only"),
    ({"parallelism.fsdp_impl": "flexshard"}, {"tp": 2}, "parallelism.tp=2 needs fsdp_impl=fully_shard"),
    ({"parallelism.fsdp_impl": "flexshard"}, {"dp_replicate": 2}, "parallelism.dp_replicate=2 needs fsdp_impl"),
    ({"optimizer.name": "muon"}, {"ep": 2}, "optimizer.name=muon needs whole or row-sharded matrices"),
])
def test_sharding_choices_that_cannot_run_are_errors(overrides, degrees, message):
    config, _ = parse_args([p for k, v in overrides.items() for p in (f"--{k}", v)])
    with pytest.raises(ValueError, match=re.escape(message)):
        check_sharding_choices(config, **{"dp_replicate": 1, "tp": 1, "ep": 1, **degrees})


def test_block_placement_of_a_vector_is_an_error(capsys):
    # Checked when the model is sharded (parameter shapes are known then); one process shards nothing,
    # so ask the placement rule directly.
    import torch

    rule = placement_rule(parse_placements((("layers.*", "block:8x8"),), fp8=False), "layers.0.")
    with pytest.raises(ValueError, match="layers.0.attention_norm.weight .1-D. a block placement"):
        rule("attention_norm.weight", torch.empty(16))
    assert rule("attention.wq.weight", torch.empty(16, 16)) is not None
    assert main(["--parallelism.flexshard_placements", "x=row", "--checkpoint.resume", "false"]) == 2
    assert "applies to fsdp_impl=flexshard" in capsys.readouterr().err
