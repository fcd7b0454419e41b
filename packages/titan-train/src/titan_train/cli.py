"""The `titan-train` command (also `python -m titan_train`, also under torchrun)."""
from __future__ import annotations

import sys
from collections.abc import Sequence

from . import command
from .cli_args import ConfigError
from .config import TrainConfig
from .recipes import DEFAULT_RECIPE, recipes

USAGE = """usage: titan-train [--recipe NAME | --recipe package.module:function] [--SECTION.FIELD VALUE ...]
                   [--list-recipes] [--print-config] [--help]
       titan-train rl ...   (the RL job: see titan-train rl --help)
       titan-train export --job.folder DIR [--step N] --out HF_DIR   (a checkpoint as a Hugging Face folder)

Trains a model. With no arguments: the main job (recipe {default}), the debug Llama 3 learning Python's
standard library on a CPU. Every field below can be overridden; values are checked against their type.
Under torchrun (torchrun --nproc-per-node N -m titan_train ...) each process is one rank.
"""


ALLOCATOR_ENV = ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF")  # torch >= 2.9 reads either


def default_cuda_allocator() -> None:
    """CUDA's caching allocator with expandable segments unless the user configured it: a step's activations
    come and go in sizes that fixed segments fragment, so a plan near the device's capacity (the remat
    planner's top budget) can fail with gigabytes reserved but unallocated. torchtitan's launcher sets the
    same. The setting is read when CUDA first allocates: set before that, or not at all."""
    import os

    import torch

    if not any(name in os.environ for name in ALLOCATOR_ENV) and not torch.cuda.is_initialized():
        os.environ["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"


def parse_args(argv: Sequence[str]) -> tuple[TrainConfig, set[str]]:
    """The trainer's config the arguments describe, and the actions asked for (help, list-recipes, print-config)."""
    return command.parse_args(argv, registry=None, config_type=TrainConfig, default=DEFAULT_RECIPE)


def main(argv: Sequence[str] | None = None) -> int:
    from_command_line = argv is None
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "rl":
        from .rl.cli import main as rl_main

        return rl_main(argv[1:], from_command_line=from_command_line)
    if argv and argv[0] == "export":
        from .export_cli import main as export_main

        return export_main(argv[1:])
    try:
        config, actions = parse_args(argv)
    except ConfigError as e:
        print(f"titan-train: error: {e}", file=sys.stderr)
        return 2
    if actions:
        return command.run_actions(config, actions, help=command.help_text(config, usage=USAGE, default=DEFAULT_RECIPE),
                                   registry=recipes())
    from .nonfinite import NonFiniteLossError
    from .trainer import train

    default_cuda_allocator()

    code = 0
    try:
        train(config)
    except NonFiniteLossError as e:
        print(f"titan-train: stopped: {e}", file=sys.stderr)
        code = 1
    except ValueError as e:  # user errors (bad degrees, paths, sizes) are ValueErrors naming the field
        print(f"titan-train: error: {e}", file=sys.stderr)
        code = 2
    return command.finish(code, from_command_line=from_command_line)
