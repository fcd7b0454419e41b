"""`titan-train rl`: --help lists every typed field of the RL config, overrides are checked against their
types, errors name the offending flag and the valid choices, recipes resolve by name or module:function,
and the job's own checks fail fast (before any model is built) naming the field."""
from __future__ import annotations

import dataclasses
import json
import subprocess
import sys

import pytest

from titan_train.cli import main
from titan_train.cli_args import field_types, section_types
from titan_train.rl import RL_RECIPES, RLConfig
from titan_train.rl.build import vllm_installed
from titan_train.rl.cli import parse_rl_args


def test_rl_help_lists_every_field_with_type_and_default(capsys):
    assert main(["rl", "--help"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: titan-train rl")
    for section, cls in section_types(RLConfig()).items():
        for name in field_types(cls):
            assert f"--{section}.{name} " in out, f"--{section}.{name} missing from rl --help"
    assert "--algorithm.name {grpo,dapo,gspo}  (default: 'grpo')" in out
    assert "--generator.kind {builtin,vllm}" in out and "--rollout.max_policy_lag int  (default: 0)" in out
    assert "--job.folder str  (default: 'runs/rl_sorting')" in out


def test_the_trainer_help_points_to_the_rl_command(capsys):
    assert main(["--help"]) == 0
    assert "titan-train rl" in capsys.readouterr().out


def test_rl_overrides_are_typed_and_applied():
    config, actions = parse_rl_args(["--algorithm.name", "dapo", "--rollout.max_policy_lag=2",
                                     "--generator.batch_invariant", "true", "--algorithm.clip_high", "0.3",
                                     "--algorithm.clip_low", "none", "--env.task", "countdown",
                                     "--training.lr", "1e-4"])
    assert not actions
    assert (config.algorithm.name, config.rollout.max_policy_lag, config.generator.batch_invariant) == ("dapo", 2, True)
    assert (config.algorithm.clip_high, config.algorithm.clip_low) == (0.3, None)
    assert (config.env.task, config.training.lr) == ("countdown", 1e-4)


@pytest.mark.parametrize("argv,expected", [
    (["--training.stpes", "3"],
     ["unknown field --training.stpes", "did you mean training.steps", "valid: training.steps"]),
    (["--algorithm.naem", "dapo"], ["unknown field --algorithm.naem", "did you mean algorithm.name"]),
    (["--rollouts.max_policy_lag", "1"], ["unknown section in --rollouts.max_policy_lag", "did you mean rollout"]),
    (["--algorithm.name", "ppo"], ["'ppo' is not a valid choice", "valid: grpo, dapo, gspo"]),
    (["--env.task", "sudoku"], ["'sudoku' is not a valid choice", "valid: sorting, arithmetic, countdown"]),
    (["--algorithm.group_size", "many"], ["--algorithm.group_size expects int, got 'many'"]),
    (["--generator.batch_invariant", "maybe"], ["--generator.batch_invariant expects bool"]),
    (["--recipe", "rl_sortnig"], ["unknown recipe 'rl_sortnig'", "did you mean rl_sorting", "valid: "]),
    (["--recipe", "titan_train.recipes:llama3_debug"], ["returned TrainConfig, not a RLConfig"]),
    (["--training.steps"], ["--training.steps needs a value"]),
    # The job's own checks, before anything is built:
    (["--rollout.prompts_per_step", "0"], ["rollout.prompts_per_step must be >= 1, got 0"]),
    (["--algorithm.group_size", "1"], ["algorithm: group_size=1", ">= 2 samples per prompt"]),
    (["--algorithm.tis_cap", "0.5"], ["algorithm.tis_cap=0.5: the cap must be >= 1"]),
    (["--env.min_length", "5", "--env.max_length", "3"], ["env (sorting): need 1 <= min_length <= max_length"]),
    (["--env.task", "arithmetic", "--env.ops", "/"], ["env (arithmetic): ops='/'"]),
    (["--policy.flavor", "huge"], ["unknown llama3 flavor 'huge'"]),
])
def test_rl_errors_name_the_problem_and_the_choices(capsys, argv, expected):
    assert main(["rl", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("titan-train rl: error: "), err
    for text in expected:
        assert text in err, (text, err)


@pytest.mark.skipif(vllm_installed(), reason="vLLM is installed: the error does not apply")
def test_vllm_generator_without_vllm_is_a_clear_error(capsys):
    # vLLM is not in the workspace environment (titan-rl's vLLM tests run in tools/vllm-env).
    assert main(["rl", "--generator.kind", "vllm"]) == 2
    assert "generator.kind=vllm needs vLLM, which is not installed" in capsys.readouterr().err


def test_rl_recipes_list_and_print(capsys):
    assert main(["rl", "--list-recipes"]) == 0
    out = capsys.readouterr().out
    for name in RL_RECIPES:
        assert name in out
    assert main(["rl", "--recipe", "rl_sorting_async", "--print-config", "--training.steps", "7"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["training"]["steps"] == 7 and printed["rollout"]["max_policy_lag"] == 1
    assert printed["algorithm"]["name"] == "dapo" and printed["generator"]["batch_invariant"] is True
    for name, recipe in RL_RECIPES.items():  # every recipe is a complete, well-typed config
        assert isinstance(recipe(), RLConfig), name
        assert set(dataclasses.asdict(recipe())) == set(printed)


def my_rl_recipe() -> RLConfig:
    config = RLConfig()
    config.training.steps = 3
    return config


def test_rl_recipe_from_a_module_function(capsys):
    config, _ = parse_rl_args(["--recipe", f"{__name__}:my_rl_recipe", "--training.lr", "0.01"])
    assert (config.training.steps, config.training.lr) == (3, 0.01)


def test_python_dash_m_runs_the_rl_command():
    result = subprocess.run([sys.executable, "-m", "titan_train", "rl", "--help"], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr
    assert "--rollout.prompts_per_step" in result.stdout
