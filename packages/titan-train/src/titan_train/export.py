"""`titan-train export`: a checkpoint of a job folder as a Hugging Face folder (safetensors + index,
config.json, tokenizer files) that transformers loads; LoRA adapters are merged into their Linears.

Reads only: the checkpoints are opened for loading, nothing in the job folder is written. The model is
rebuilt on the CPU in one process from the run's saved config (train_config.json), whatever layout saved it.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
import torch.nn as nn

import titan_models as tm

from .config import TrainConfig
from .data.tokenizer import ByteTokenizer
from .lora import merge
from .model_setup import build_on_meta, materialize, model_config
from .saved_config import load_config

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                   "tokenizer.model", "vocab.json", "merges.txt", "generation_config.json")


def committed_steps(job_folder: Path) -> list[int]:
    from torch_checkpointing import Checkpointer

    folder = job_folder / "checkpoints"
    if not folder.is_dir():
        return []
    with Checkpointer(str(folder)) as checkpointer:
        return checkpointer.steps()


def export_job(job_folder: str | Path, out: str | Path, *, step: int = 0) -> Path:
    """Write step `step` (0: the newest) of the run in `job_folder` to the Hugging Face folder `out`."""
    job_folder, out = Path(job_folder), Path(out)
    config = load_config(job_folder)
    steps = committed_steps(job_folder)
    if not steps:
        raise ValueError(f"export: {job_folder / 'checkpoints'} holds no committed checkpoint "
                         "(train with --checkpoint.interval N)")
    if step and step not in steps:
        raise ValueError(f"export: step {step} is not a committed checkpoint of {job_folder}; committed steps: "
                         f"{', '.join(map(str, steps))}")
    if out.exists() and any(out.iterdir()):
        raise ValueError(f"export: --out {out} exists and is not empty; give a new folder")
    model = load_model(config, job_folder, step or steps[-1])
    write_hf(merge(model), out, config)
    return out


def load_model(config: TrainConfig, job_folder: Path, step: int) -> nn.Module:
    """The run's whole model on the CPU (fp32) with the weights of checkpoint `step`."""
    from torch_checkpointing import Checkpointer, ModelState

    from .checkpoint import RunCheckpoints
    from .initial_weights import load_initial_weights

    tokenizer = config.data.build_tokenizer()
    model_cfg = model_config(config.model, vocab_needed=0 if tokenizer is None else tokenizer.vocab_size)
    adapters = config.lora.build(seed=config.model.init_seed)
    model = build_on_meta(model_cfg)
    if adapters is not None:
        adapters.apply(model)
    # The initial weights matter where the checkpoint holds the adapters only (LoRA's frozen base).
    materialize(model, model_cfg, device=torch.device("cpu"), seed=config.model.init_seed, distributed=False,
                hf_path=config.model.hf_path, adapters=adapters)
    if config.checkpoint.initial_load:
        load_initial_weights(model, config.checkpoint.initial_load)
    options = RunCheckpoints.model_options_for(trainable_only=adapters is not None)
    with Checkpointer(str(job_folder / "checkpoints")) as checkpointer:
        checkpointer.load({"model": ModelState(model, options=options)}, step)
    return model


def write_hf(model: nn.Module, out: Path, config: TrainConfig) -> None:
    """config.json + safetensors (+ index) + the tokenizer's files in `out` (all ranks' weights, one process)."""
    tm.to_hf(model, out)
    index = out / "model.safetensors.index.json"
    if not index.exists():  # one file: an index naming it, as sharded exports have
        header = _safetensors_header(out / "model.safetensors")
        tensors = {name: entry for name, entry in header.items() if name != "__metadata__"}
        total = sum(end - start for entry in tensors.values() for start, end in [entry["data_offsets"]])
        index.write_text(json.dumps({"metadata": {"total_size": total},
                                     "weight_map": {name: "model.safetensors" for name in sorted(tensors)}},
                                    indent=2) + "\n")
    write_tokenizer(config.data.tokenizer, out, chat=config.data.chat)


def _safetensors_header(path: Path) -> dict:
    """The JSON header of a safetensors file (an 8-byte little-endian length, then the header)."""
    with open(path, "rb") as f:
        length = int.from_bytes(f.read(8), "little")
        return json.loads(f.read(length))


def write_tokenizer(spec: str, out: Path, *, chat: bool) -> None:
    if spec == "byte":
        ByteTokenizer().save_hf(out, chat_template=chat)
        return
    folder = Path(spec)
    folder = folder if folder.is_dir() else folder.parent
    for name in TOKENIZER_FILES:
        if (folder / name).is_file():
            shutil.copy2(folder / name, out / name)


def export_trained(model: nn.Module, config: TrainConfig, out: Path) -> None:
    """checkpoint.export_hf_at_end: the run's in-memory model (sharded or not) to `out`; every rank calls it
    (the full weights are gathered onto rank 0, which writes)."""
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if dist.is_initialized() and dist.get_rank() != 0:
        return
    tokenizer = config.data.build_tokenizer()
    model_cfg = model_config(config.model, vocab_needed=0 if tokenizer is None else tokenizer.vocab_size)
    whole = build_on_meta(model_cfg)
    adapters = config.lora.build(seed=config.model.init_seed)
    if adapters is not None:
        adapters.apply(whole)
    whole.to_empty(device="cpu")
    whole.init_buffers()
    whole.load_state_dict({k: v.float() if v.is_floating_point() else v for k, v in full.items()})
    write_hf(merge(whole), out, config)
