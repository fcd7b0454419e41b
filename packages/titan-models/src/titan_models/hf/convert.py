"""`from_hf` / `to_hf`: Hugging Face model folders <-> titan models."""
from __future__ import annotations

import dataclasses
import json
import warnings
from pathlib import Path
from typing import Any

import torch
from torch import nn

from titan_models import registry
from titan_models.hf.converter import Converter, Reshaped, Rows, check_field_types, source_name
from titan_models.hf.names import NoHFName
from titan_models.hf.safetensors_io import SafetensorsFolder, write_safetensors

DEFAULT_MAX_SHARD_BYTES = 5 * 2**30

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def converter_for(hf: dict[str, Any]) -> Converter:
    """The converter for a Hugging Face config dict (by its `architectures`): its `config_from_hf`,
    `config_to_hf` and `hf_names(config, titan_name)` map configs and tensor names both ways."""
    architectures = hf.get("architectures") or []
    for family in registry.families():
        if family.hf is not None and any(arch in family.hf_architectures for arch in architectures):
            return family.hf
    supported = sorted(a for family in registry.families() for a in family.hf_architectures)
    raise ValueError(f"config.json field architectures={architectures} is not supported; supported: {supported}")


def _converter_for_config(config: Any) -> Converter:
    family = registry.family_of(config)
    if family.hf is None:
        raise ValueError(f"model family {family.name!r} has no Hugging Face converter")
    return family.hf


def _checkpoint_dtype(hf: dict[str, Any]) -> torch.dtype:
    name = hf.get("dtype") or hf.get("torch_dtype") or "float32"
    if name not in _DTYPES:
        raise ValueError(f"config.json field dtype={name!r} is not supported; supported: {sorted(_DTYPES)}")
    return _DTYPES[name]


def _load_plan(converter: Converter, config: Any, model: nn.Module) -> dict[str, list[str]]:
    """titan state name -> HF tensors that hold it (stacked when several; none = zero)."""
    plan = {}
    for name in model.state_dict(keep_vars=True):
        if config.tie_embeddings and name == "output.weight":
            continue
        plan[name] = converter.hf_names(config, name)
    return plan


def _read_folder(folder: Path) -> tuple[Any, Converter, SafetensorsFolder]:
    path = folder / "config.json"
    if not path.exists():
        raise ValueError(f"{folder} has no config.json")
    try:
        hf = json.loads(path.read_text(encoding="utf-8"))
    except ValueError as e:
        raise ValueError(f"{path} is not valid JSON ({e})") from None
    check_field_types(hf, str(path))
    converter = converter_for(hf)
    files = SafetensorsFolder(folder)
    try:
        config = converter.config_from_hf(hf, files.names())
    except KeyError as e:  # a field the converter reads with hf[...]
        raise ValueError(f"{path} has no field {e.args[0]!r}, which {type(converter).__name__} needs") from None
    return dataclasses.replace(config, dtype=_checkpoint_dtype(hf)), converter, files


def read_config(path: str | Path) -> Any:
    """The titan config of a Hugging Face folder (its config.json and tensor names), without reading
    any weight: e.g. to build the model on meta and parallelize it before loading."""
    return _read_folder(Path(path))[0]


def from_hf(path: str | Path, *, dtype: torch.dtype | None = None, device: str | torch.device | None = None
            ) -> nn.Module:
    """Load a Hugging Face folder (config.json + model.safetensors or shards with an index).

    dtype defaults to the one config.json names (float32 if none), device to CPU. Raises
    ValueError for an unsupported architecture or setting, and for missing, unexpected or
    mis-shaped tensors (naming them) before any weight is read.
    """
    folder = Path(path)
    config, converter, files = _read_folder(folder)
    if dtype is not None:
        config = dataclasses.replace(config, dtype=dtype)
    with torch.device("meta"):
        model = config.build()
    params = model.state_dict(keep_vars=True)
    present = files.names()
    plan = _located(_load_plan(converter, config, model), converter.checkpoint_prefixes(present))
    # tensors in a layout of the converter's own (gpt-oss's fused, interleaved, MXFP4 experts)
    layouts = {name: layout for name in plan
               if (layout := converter.disk_layout(config, name, tuple(params[name].shape), present)) is not None}

    _check_names(folder, config, converter, plan, layouts, present)
    _check_planned_shapes(folder, config, plan, layouts, params, files)

    model.to_empty(device=device or "cpu")
    model.init_buffers()  # RoPE frequencies; expert bias zero unless the checkpoint holds it
    _copy_weights(model.state_dict(keep_vars=True), converter, config, plan, layouts, files, present)
    return model


def _check_names(folder: Path, config: Any, converter: Converter, plan: dict[str, list],
                 layouts: dict[str, dict[str, tuple[int, ...]]], present: set[str]) -> None:
    """Raise for tensors the plan needs but the folder lacks, or that it holds but nothing reads
    (unless the converter knows them as parts of a wider model: those only warn)."""
    expected = {source_name(source) for name, sources in plan.items() if name not in layouts for source in sources}
    expected |= {hf_name for layout in layouts.values() for hf_name in layout}
    missing = sorted(expected - present)
    if missing:
        raise ValueError(f"{folder}: missing tensors {missing[:10]}{' ...' if len(missing) > 10 else ''} "
                         f"({len(missing)} in all) for {type(config).__name__}")
    others = sorted(n for n in present - expected if not converter.ignorable(config, n))
    unexpected = [n for n in others if not converter.reported(config, n)]
    if unexpected:
        raise ValueError(f"{folder}: unexpected tensors {unexpected[:10]}{' ...' if len(unexpected) > 10 else ''} "
                         f"({len(unexpected)} in all) for {type(config).__name__}")
    if others:  # stacklevel 3: point at the caller of from_hf, as when this code was inline there
        warnings.warn(f"{folder}: from_hf loads the text model only; {len(others)} tensors are not loaded "
                      f"({_by_prefix(others)}): {others[:10]}{' ...' if len(others) > 10 else ''}", stacklevel=3)


def _check_planned_shapes(folder: Path, config: Any, plan: dict[str, list],
                          layouts: dict[str, dict[str, tuple[int, ...]]], params: dict[str, torch.Tensor],
                          files: SafetensorsFolder) -> None:
    """Raise for any planned tensor whose shape on disk does not fit the model's (before reading any)."""
    for name, sources in plan.items():
        if name in layouts:
            for hf_name, want in layouts[name].items():
                if files.shape(hf_name) != want:
                    raise ValueError(f"{folder}: tensor {hf_name!r} has shape {list(files.shape(hf_name))}, expected "
                                     f"{list(want)} (for {name} of {type(config).__name__})")
        else:
            _check_shapes(folder, config, name, tuple(params[name].shape), sources, files)


def _copy_weights(state: dict[str, torch.Tensor], converter: Converter, config: Any, plan: dict[str, list],
                  layouts: dict[str, dict[str, tuple[int, ...]]], files: SafetensorsFolder, present: set[str]) -> None:
    """Read each planned tensor from the folder into the (materialized) model state, in plan order."""
    fused: dict[str, torch.Tensor] = {}  # the fused HF tensor last read (its parts are planned together)
    with torch.no_grad():
        for name, sources in plan.items():
            if name in layouts:
                state[name].copy_(converter.load(config, name, files, present))
                continue
            if not sources:
                state[name].zero_()
                continue
            if len(sources) == 1 and isinstance(sources[0], Rows):
                rows = sources[0]
                if rows.hf_name not in fused:
                    fused = {rows.hf_name: files.get(rows.hf_name)}
                source = fused[rows.hf_name][list(rows.rows)]
            elif len(sources) == 1 and isinstance(sources[0], Reshaped):
                source = files.get(sources[0].hf_name).reshape(state[name].shape)
            elif len(sources) == 1:
                source = files.get(sources[0])
            else:
                source = torch.stack([files.get(n) for n in sources])
            state[name].copy_(source)


def _located(plan: dict[str, list], prefixes: dict[str, str]) -> dict[str, list]:
    """The plan with its causal-LM names moved to where the checkpoint keeps them (composite checkpoints):
    a name starting with a key of `prefixes` gets that key replaced by its value."""
    moves = {old: new for old, new in prefixes.items() if old != new}
    if not moves:
        return plan

    def move(name: str) -> str:
        for old, new in moves.items():
            if name.startswith(old):
                return new + name.removeprefix(old)
        return name

    def moved(source):
        if isinstance(source, str):
            return move(source)
        return dataclasses.replace(source, hf_name=move(source.hf_name))

    return {titan: [moved(s) for s in sources] for titan, sources in plan.items()}


def _by_prefix(names: list[str]) -> str:
    """'412 under model.visual, 19 under mtp' for a list of tensor names."""
    counts: dict[str, int] = {}
    for name in names:
        head = ".".join(name.split(".")[:2]) if name.startswith("model.") else name.split(".")[0]
        counts[head] = counts.get(head, 0) + 1
    return ", ".join(f"{n} under {head}" for head, n in counts.items())


def _check_shapes(folder: Path, config: Any, name: str, want: tuple[int, ...], sources: list,
                  files: SafetensorsFolder) -> None:
    per_tensor = want[1:] if len(sources) > 1 else want
    for source in sources:
        got = files.shape(source_name(source))
        if isinstance(source, Rows):  # rows of a fused tensor: same trailing dims, enough rows
            if got[1:] != want[1:] or len(source.rows) != want[0] or max(source.rows) >= got[0]:
                raise ValueError(f"{folder}: tensor {source.hf_name!r} has shape {list(got)}, expected "
                                 f"[{max(source.rows) + 1}+, {', '.join(map(str, want[1:]))}] with rows for "
                                 f"{name} {list(want)} of {type(config).__name__}")
        elif isinstance(source, Reshaped):  # same elements, the shape on disk
            if got != source.shape or torch.Size(got).numel() != torch.Size(want).numel():
                raise ValueError(f"{folder}: tensor {source.hf_name!r} has shape {list(got)}, expected "
                                 f"{list(source.shape)} (for {name} {list(want)} of {type(config).__name__})")
        elif got != per_tensor:
            raise ValueError(f"{folder}: tensor {source!r} has shape {list(got)}, expected "
                             f"{list(per_tensor)} (for {name} of {type(config).__name__})")


def to_hf(model: nn.Module, path: str | Path, *, max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES) -> None:
    """Write `model` as a Hugging Face folder transformers loads: config.json and safetensors
    (sharded with an index beyond `max_shard_bytes`). Sharded (DTensor) parameters are gathered,
    so call it on every rank of their mesh."""
    config = model.config
    converter = _converter_for_config(config)
    if model.tok_embeddings is None or model.output is None or model.norm is None or \
            len(model.layers) != config.num_layers:
        raise ValueError("to_hf needs the whole model; this one is a pipeline stage (modules were removed)")
    hf_config = converter.config_to_hf(config)
    hf_config["dtype"] = str(next(model.parameters()).dtype).removeprefix("torch.")  # as stored, even after .to()
    entries = []
    fused_parts: dict[str, list[tuple[tuple[int, ...], torch.Tensor]]] = {}
    own_layout: dict[str, dict[str, torch.Tensor]] = {}  # HF name -> titan tensors in the converter's layout
    for name, tensor in model.state_dict().items():
        if config.tie_embeddings and name == "output.weight":
            continue
        try:
            hf_names = converter.hf_names(config, name)
        except NoHFName:
            raise ValueError(f"{name} has no place in Hugging Face {hf_config['architectures'][0]}") from None
        if tensor.is_meta:
            raise ValueError(f"{name} is on the meta device; initialise or load the model before to_hf")
        tensor = _full(tensor).detach()
        if not hf_names:
            if tensor.any():
                warnings.warn(f"{name} is not stored by Hugging Face {hf_config['architectures'][0]}; "
                              "its nonzero values are dropped", stacklevel=2)
            continue
        if converter.disk_layout(config, name, tuple(tensor.shape), set()) is not None:
            (hf_name,) = hf_names
            if hf_name not in own_layout:
                entries.append(hf_name)  # its place in the file order, resolved below
            own_layout.setdefault(hf_name, {})[name] = tensor
        elif len(hf_names) == 1 and isinstance(hf_names[0], Rows):
            fused_parts.setdefault(hf_names[0].hf_name, []).append((hf_names[0].rows, tensor))
        elif len(hf_names) == 1 and isinstance(hf_names[0], Reshaped):
            shape = hf_names[0].shape
            entries.append((hf_names[0].hf_name, shape, tensor.dtype,
                            lambda t=tensor, shape=shape: t.cpu().reshape(shape).contiguous()))
        elif len(hf_names) == 1:
            entries.append((hf_names[0], tuple(tensor.shape), tensor.dtype, lambda t=tensor: t.cpu().contiguous()))
        else:
            for e, hf_name in enumerate(hf_names):
                entries.append((hf_name, tuple(tensor.shape[1:]), tensor.dtype, lambda t=tensor, e=e: t[e].cpu().clone()))
    entries = [_own_layout_entry(converter, config, e, own_layout[e]) if isinstance(e, str) else e for e in entries]
    for hf_name, parts in fused_parts.items():
        entries.append(_fused_entry(hf_name, parts))
    for hf_name, tensor in converter.extra_tensors(model):
        tensor = _full(tensor).detach()
        entries.append((hf_name, tuple(tensor.shape), tensor.dtype, lambda t=tensor: t.cpu().clone()))
    prefix = converter.written_text_prefix(config)  # a composite architecture's decoder lives elsewhere
    if prefix != "model.":
        entries = [(prefix + name.removeprefix("model.") if name.startswith("model.") else name, *rest)
                   for name, *rest in entries]
    folder = Path(path)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(hf_config, indent=2) + "\n")
    write_safetensors(folder, entries, max_shard_bytes=max_shard_bytes)


def _fused_entry(hf_name: str, parts: list[tuple[tuple[int, ...], torch.Tensor]]):
    """One safetensors entry assembling the titan tensors that are rows of `hf_name`."""
    rows = sorted(r for part_rows, _ in parts for r in part_rows)
    assert rows == list(range(len(rows))), f"the parts of {hf_name} do not partition its rows"
    first = parts[0][1]
    shape = (len(rows), *first.shape[1:])

    def make() -> torch.Tensor:
        out = torch.empty(shape, dtype=first.dtype)
        for part_rows, tensor in parts:
            out[list(part_rows)] = tensor.cpu()
        return out

    return hf_name, shape, first.dtype, make


def _own_layout_entry(converter: Converter, config: Any, hf_name: str, parts: dict[str, torch.Tensor]) -> tuple:
    """The write entry of HF tensor `hf_name`, made by the converter from the titan tensors `parts`."""
    name, tensor = next(iter(parts.items()))
    shape = converter.disk_layout(config, name, tuple(tensor.shape), set())[hf_name]
    return (hf_name, shape, tensor.dtype, lambda: converter.to_hf_tensor(config, hf_name, parts).cpu().contiguous())


def _full(tensor: torch.Tensor) -> torch.Tensor:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # torch built without distributed
        return tensor
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor
