"""`titan-train rl` (also `python -m titan_train rl`, also under torchrun): the RL job's command line, on
the trainer's machinery (recipes, typed `--section.field value` overrides, the same errors)."""
from __future__ import annotations

import sys
from collections.abc import Sequence

from ..cli_args import ConfigError
from ..command import finish, help_text, parse_args, run_actions
from ..recipes import recipes
from .config import RLConfig
from .recipes import DEFAULT_RL_RECIPE, RL_RECIPES

USAGE = """usage: titan-train rl [--recipe NAME | --recipe package.module:function] [--SECTION.FIELD VALUE ...]
                      [--list-recipes] [--print-config] [--help]

RL post-training. With no arguments: the main RL job (recipe {default}): a tiny Llama is pretrained on a
synthetic task by titan-train's trainer, then improves its reward under GRPO (titan-rl), on a CPU in a few
minutes; the reward curve is printed and saved to <job.folder>/rl_curve.csv and rl_metrics.jsonl.
Under torchrun (torchrun --nproc-per-node N -m titan_train rl ...) the policy is FSDP-sharded over the
ranks and each rank generates its share of the rollouts.
"""


def parse_rl_args(argv: Sequence[str]) -> tuple[RLConfig, set[str]]:
    return parse_args(argv, registry=RL_RECIPES, config_type=RLConfig, default=DEFAULT_RL_RECIPE)


def main(argv: Sequence[str], *, from_command_line: bool = False) -> int:
    try:
        config, actions = parse_rl_args(argv)
    except ConfigError as e:
        print(f"titan-train rl: error: {e}", file=sys.stderr)
        return 2
    if actions:
        return run_actions(config, actions, help=help_text(config, usage=USAGE, default=DEFAULT_RL_RECIPE),
                           registry=recipes(RL_RECIPES))
    from .job import run_rl

    code = 0
    try:
        run_rl(config)
    except ValueError as e:  # user errors (sizes, divisibility, a missing vLLM) name the field
        print(f"titan-train rl: error: {e}", file=sys.stderr)
        code = 2
    return finish(code, from_command_line=from_command_line)
