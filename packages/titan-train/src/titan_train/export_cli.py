"""`titan-train export --job.folder DIR [--step N] --out HF_DIR`."""
from __future__ import annotations

import sys
from collections.abc import Sequence

USAGE = """usage: titan-train export --job.folder DIR [--step N] --out HF_DIR

Writes checkpoint step N (default: the newest) of the run in DIR as a Hugging Face folder that
transformers loads (config.json, safetensors + index, tokenizer files); LoRA adapters are merged.
The job folder is only read.
"""


def parse(argv: Sequence[str]) -> dict[str, str] | None:
    """{'job.folder', 'out', 'step'} from the arguments, None for --help; ValueError naming a bad one."""
    args, values = list(argv), {"step": "0"}
    while args:
        flag = args.pop(0)
        if flag in ("-h", "--help"):
            return None
        name, eq, value = flag.removeprefix("--").partition("=")
        if not flag.startswith("--") or name not in ("job.folder", "out", "step"):
            raise ValueError(f"export: unexpected argument {flag!r}; options: --job.folder DIR, --step N, --out HF_DIR")
        if not eq:
            if not args:
                raise ValueError(f"export: --{name} needs a value")
            value = args.pop(0)
        values[name] = value
    for needed in ("job.folder", "out"):
        if needed not in values:
            raise ValueError(f"export: --{needed} is required")
    if not values["step"].isdigit():
        raise ValueError(f"export: --step expects a step number, got {values['step']!r}")
    return values


def main(argv: Sequence[str]) -> int:
    try:
        values = parse(argv)
        if values is None:
            print(USAGE)
            return 0
        from .export import export_job

        out = export_job(values["job.folder"], values["out"], step=int(values["step"]))
    except ValueError as e:
        print(f"titan-train: error: {e}", file=sys.stderr)
        return 2
    print(f"titan-train: exported {values['job.folder']} to {out}")
    return 0
