"""The command line: --help lists every typed field, overrides are type-checked, errors name the
offending flag and list the valid choices, recipes resolve by name or module:function."""
from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys

import pytest

from titan_train import TrainConfig, load_recipe
from titan_train.cli import default_cuda_allocator, main, parse_args
from titan_train.cli_args import ConfigError, apply_override, check_types, describe_fields, field_types, section_types

REQUIRED_FLAGS = ["--training.steps", "--training.batch_size", "--training.seq_len", "--job.folder",
                  "--parallelism.dp_replicate", "--parallelism.dp_shard", "--parallelism.tp", "--parallelism.pp",
                  "--parallelism.cp", "--parallelism.ep", "--checkpoint.interval"]


def test_help_lists_every_field_with_type_and_default(capsys):
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    config = TrainConfig()
    for section, cls in section_types(config).items():
        for name in field_types(cls):
            assert f"--{section}.{name} " in out, f"--{section}.{name} missing from --help"
    for flag in REQUIRED_FLAGS:
        assert flag in out
    assert "--training.steps int  (default: 100)" in out  # the default of the default recipe
    assert "--lr_schedule.kind {wsd,cosine,constant}" in out


def test_overrides_are_typed_and_applied():
    config, actions = parse_args(["--training.steps", "7", "--optimizer.lr=0.01", "--data.shuffle", "false",
                                  "--lr_schedule.kind", "cosine", "--parallelism.dp_shard", "-1"])
    assert not actions
    assert (config.training.steps, config.optimizer.lr, config.data.shuffle) == (7, 0.01, False)
    assert config.lr_schedule.kind == "cosine" and config.parallelism.dp_shard == -1


@pytest.mark.parametrize("argv,expected", [
    (["--training.stpes", "3"],
     ["unknown field --training.stpes", "did you mean training.steps", "valid: training.steps"]),
    (["--trainin.steps", "3"], ["unknown section in --trainin.steps", "did you mean training", "valid: "]),
    (["--training.steps", "three"], ["--training.steps expects int, got 'three'"]),
    (["--optimizer.lr", "fast"], ["--optimizer.lr expects float, got 'fast'"]),
    (["--data.shuffle", "maybe"], ["--data.shuffle expects bool"]),
    (["--lr_schedule.kind", "cos"],
     ["'cos' is not a valid choice", "did you mean cosine", "valid: wsd, cosine, constant"]),
    (["--recipe", "llama3_debgu"], ["unknown recipe 'llama3_debgu'", "did you mean llama3_debug", "valid: "]),
    (["--recipe", "no_such_module_xyz:fn"], ["cannot import module 'no_such_module_xyz'"]),
    (["--recipe", "titan_train.recipes:nope"], ["has no function 'nope'", "valid: "]),
    (["--training.steps"], ["--training.steps needs a value"]),
    (["stray"], ["unexpected argument 'stray'"]),
])
def test_errors_name_the_problem_and_the_choices(capsys, argv, expected):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("titan-train: error: ")
    for text in expected:
        assert text in err, (text, err)


def test_degrees_that_do_not_fit_are_errors(capsys):
    assert main(["--parallelism.pp", "2", "--checkpoint.resume", "false"]) == 2  # one process, pp 2
    assert "world size 1 is not divisible by dp_replicate * tp * pp * cp = 2" in capsys.readouterr().err
    assert main(["--parallelism.tp", "2", "--checkpoint.resume", "false"]) == 2  # one process, tp 2
    assert "world size 1 is not divisible by dp_replicate * tp * pp * cp = 2" in capsys.readouterr().err
    assert main(["--parallelism.dp_shard", "2", "--checkpoint.resume", "false"]) == 2
    assert "dp_shard=2 x cp=1 x tp=1 = 2, but the world size is 1" in capsys.readouterr().err
    assert main(["--training.batch_size", "0", "--checkpoint.resume", "false"]) == 2
    assert "training.batch_size must be >= 1" in capsys.readouterr().err


def my_recipe() -> TrainConfig:
    config = load_recipe("llama3_debug")
    config.training.steps = 3
    return config


def test_recipe_from_a_module_function_then_overrides(capsys):
    config, _ = parse_args(["--recipe", f"{__name__}:my_recipe", "--training.seq_len", "32"])
    assert (config.training.steps, config.training.seq_len) == (3, 32)
    assert main(["--print-config", "--training.batch_size", "2"]) == 0
    printed = json.loads(capsys.readouterr().out)
    expected = {**dataclasses.asdict(load_recipe("llama3_debug")),
                "training": {**dataclasses.asdict(load_recipe("llama3_debug").training), "batch_size": 2}}
    assert printed == json.loads(json.dumps(expected))  # tuple fields print as JSON lists


def test_python_dash_m_lists_recipes():
    out = subprocess.run([sys.executable, "-m", "titan_train", "--list-recipes"], capture_output=True, text=True,
                         check=True, timeout=120).stdout
    assert "llama3_debug" in out and "llama3_1b" in out


def test_recipe_from_a_file_in_the_working_directory(tmp_path, monkeypatch):
    (tmp_path / "team_recipes_xyz.py").write_text(
        "import titan_train as tt\n\ndef short():\n    c = tt.load_recipe('llama3_debug')\n"
        "    c.training.steps = 2\n    return c\n\ndef wrong():\n    return 42\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    config, _ = parse_args(["--recipe", "team_recipes_xyz:short"])
    assert config.training.steps == 2
    with pytest.raises(ValueError, match="returned int, not a TrainConfig"):
        parse_args(["--recipe", "team_recipes_xyz:wrong"])


@dataclasses.dataclass(kw_only=True)
class _Experts:
    num_experts: int = 8
    """Routed experts per MoE layer."""


@dataclasses.dataclass(kw_only=True)
class _Model:
    flavor: str = "debug"
    moe: _Experts = dataclasses.field(default_factory=_Experts)


@dataclasses.dataclass(kw_only=True)
class _Tree:
    model: _Model = dataclasses.field(default_factory=_Model)


def test_sections_nest_to_any_depth():
    """A dataclass-typed field is a section: flags, type checks, suggestions and help reach through it."""
    tree = _Tree()
    apply_override(tree, "model.moe.num_experts", "4")
    assert tree.model.moe.num_experts == 4
    with pytest.raises(ConfigError, match=r"unknown field --model.moe.num_expert \(did you mean model.moe.num_experts"):
        apply_override(tree, "model.moe.num_expert", "4")
    with pytest.raises(ConfigError, match="--model.moe.num_experts expects int"):
        apply_override(tree, "model.moe.num_experts", "four")
    with pytest.raises(ConfigError, match="model.flavor is a str field, not a section"):
        apply_override(tree, "model.flavor.size", "1")
    with pytest.raises(ConfigError, match="valid: model.moe.num_experts"):
        apply_override(tree, "model.moe", "1")
    assert ("--model.moe.num_experts", "int", "4", "Routed experts per MoE layer.") in describe_fields(tree)
    tree.model.moe.num_experts = "4"
    with pytest.raises(ConfigError, match="model.moe.num_experts = '4' does not fit int"):
        check_types(tree)


def test_cuda_allocator_defaults_to_expandable_segments_and_keeps_the_users_setting(monkeypatch):
    for name in ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr("torch.cuda.is_initialized", lambda: False)
    default_cuda_allocator()
    assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"
    for name in ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF"):  # the user's, under either name, stays
        monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
        monkeypatch.setenv(name, "backend:cudaMallocAsync")
        default_cuda_allocator()
        assert os.environ[name] == "backend:cudaMallocAsync"
        assert name == "PYTORCH_CUDA_ALLOC_CONF" or "PYTORCH_CUDA_ALLOC_CONF" not in os.environ
        monkeypatch.delenv(name)
    monkeypatch.setattr("torch.cuda.is_initialized", lambda: True)  # too late: CUDA read it already
    default_cuda_allocator()
    assert "PYTORCH_CUDA_ALLOC_CONF" not in os.environ
