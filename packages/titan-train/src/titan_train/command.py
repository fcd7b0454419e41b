"""What `titan-train` and `titan-train rl` share: arguments to a config (a recipe chosen at run time, then
typed overrides), --help / --list-recipes / --print-config, and the exit of a command that ran a job."""
from __future__ import annotations

import dataclasses
import json
import os
import sys
from collections.abc import Sequence

from .cli_args import ConfigError, apply_override, check_types, describe_fields
from .recipes import load_recipe


def parse_args(argv: Sequence[str], *, registry: dict | None, config_type: type, default: str):
    """The config the arguments describe, and the actions asked for (help, list-recipes, print-config).
    registry / config_type / default: the command's recipes (None: the trainer's), config class, default recipe."""
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


def help_text(config, *, usage: str, default: str) -> str:
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


def finish(code: int, *, from_command_line: bool) -> int:
    """The exit code of a command that ran a job (also `titan-train rl`'s)."""
    if from_command_line and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        # A torchrun rank: everything is written and the process group is gone; skip interpreter
        # teardown, where torch's distributed backends sometimes abort and torchrun reports a failure.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code
