"""The `titan-train` command (also `python -m titan_train`, also under torchrun)."""
from __future__ import annotations

import dataclasses
import json
import os
import sys
from collections.abc import Sequence

from .config import TrainConfig
from .overrides import ConfigError, apply_override, check_types, describe_fields
from .recipes import DEFAULT_RECIPE, load_recipe, recipes

USAGE = """usage: titan-train [--recipe NAME | --recipe package.module:function] [--SECTION.FIELD VALUE ...]
                   [--list-recipes] [--print-config] [--help]
       titan-train rl ...   (the RL job: see titan-train rl --help)

Trains a model. With no arguments: the main job (recipe {default}), the debug Llama 3 learning Python's
standard library on a CPU. Every field below can be overridden; values are checked against their type.
Under torchrun (torchrun --nproc-per-node N -m titan_train ...) each process is one rank.
"""


def parse_args(argv: Sequence[str], *, registry: dict | None = None, config_type: type = TrainConfig,
               default: str = DEFAULT_RECIPE) -> tuple[TrainConfig, set[str]]:
    """The config the arguments describe, and the actions asked for (help, list-recipes, print-config).
    registry / config_type / default: another command's recipes (titan-train rl), default the trainer's."""
    args = list(argv)
    actions: set[str] = set()
    recipe = default
    overrides: list[tuple[str, str]] = []
    i = 0
    while i < len(args):
        arg = args[i]
        if arg in ("-h", "--help"):
            actions.add("help")
        elif arg == "--list-recipes":
            actions.add("list-recipes")
        elif arg == "--print-config":
            actions.add("print-config")
        elif arg.startswith("--"):
            name, eq, value = arg[2:].partition("=")
            if not eq:
                if i + 1 >= len(args) or (args[i + 1].startswith("--") and name != "recipe"):
                    raise ConfigError(f"--{name} needs a value")
                i += 1
                value = args[i]
            if name == "recipe":
                recipe = value
            else:
                overrides.append((name, value))
        else:
            raise ConfigError(f"unexpected argument {arg!r}: options are --SECTION.FIELD VALUE (see --help)")
        i += 1
    config = load_recipe(recipe, registry=registry, config_type=config_type)
    check_types(config)
    for name, value in overrides:
        apply_override(config, name, value)
    return config, actions


def help_text(config: TrainConfig, *, usage: str = USAGE, default: str = DEFAULT_RECIPE) -> str:
    lines = [usage.format(default=default), "options (type, default from the chosen recipe):"]
    for flag, tp, default, doc in describe_fields(config):
        lines.append(f"  {flag} {tp}  (default: {default})")
        if doc:
            lines.append(f"      {doc}")
    return "\n".join(lines)


def run_actions(config, actions: set[str], *, help: str, registry: dict[str, str]) -> int:
    """--help, --list-recipes or --print-config (in that order of precedence): print, exit code 0."""
    if "help" in actions:
        print(help)
    elif "list-recipes" in actions:
        for name, summary in registry.items():
            print(f"{name:20s} {summary}")
    else:
        print(json.dumps(dataclasses.asdict(config), indent=2))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    from_command_line = argv is None
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "rl":
        from .rl.cli import main as rl_main

        return rl_main(argv[1:], from_command_line=from_command_line)
    try:
        config, actions = parse_args(argv)
    except ConfigError as e:
        print(f"titan-train: error: {e}", file=sys.stderr)
        return 2
    if actions:
        return run_actions(config, actions, help=help_text(config), registry=recipes())
    from .trainer import NonFiniteLossError, train

    code = 0
    try:
        train(config)
    except NonFiniteLossError as e:
        print(f"titan-train: stopped: {e}", file=sys.stderr)
        code = 1
    except ValueError as e:  # user errors (bad degrees, paths, sizes) are ValueErrors naming the field
        print(f"titan-train: error: {e}", file=sys.stderr)
        code = 2
    return finish(code, from_command_line=from_command_line)


def finish(code: int, *, from_command_line: bool) -> int:
    """The exit code of a command that ran a job (also `titan-train rl`'s)."""
    if from_command_line and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        # A torchrun rank: everything is written and the process group is gone; skip interpreter
        # teardown, where torch's distributed backends sometimes abort and torchrun reports a failure.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code
