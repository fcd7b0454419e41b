"""compile.mode=graph from a run's config: the layouts it supports, and the GraphStep of the run."""
from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Callable

from ..config import TrainConfig
from .capture import GraphStep
from .optimizer_graph import GraphAdamW
from .passes import resolve_pass


def check_graph_mode(run: TrainConfig, degrees, device) -> None:
    """The layouts the captured step covers: one device, or 1-D FSDP (fully_shard), without recomputation;
    text batches, multi-token prediction included (pipeline stages, which would hold it, are refused here)."""
    for name in ("tp", "pp", "cp", "ep", "dp_replicate"):
        if getattr(degrees, name) > 1:
            raise ValueError(f"compile.mode=graph supports one device or FSDP over dp_shard only; "
                             f"parallelism.{name}={getattr(degrees, name)} needs compile.mode none/blocks/regions")
    if run.parallelism.fsdp_impl != "fully_shard" and degrees.dp > 1:
        raise ValueError("compile.mode=graph shards with parallelism.fsdp_impl=fully_shard only")
    if run.data.source == "shapes" or run.data.image_field:
        raise ValueError("compile.mode=graph captures text batches only; image-text data (data.source=shapes or "
                         "data.image_field) changes the vision tower's shapes every step: use compile.mode "
                         "none/blocks/regions")
    if run.activation_checkpoint.mode != "none":
        raise ValueError("compile.mode=graph holds the whole backward already; set activation_checkpoint.mode=none "
                         "(graph passes decide what the graph keeps)")
    if device.type == "cuda" and run.training.fused_kernels:
        raise ValueError("compile.mode=graph on CUDA needs training.fused_kernels=false: the Triton loss and SwiGLU "
                         "kernels are launched outside torch's dispatcher, so tracing cannot record them")
    if run.compile.graph_optimizer and run.optimizer.name != "adamw":
        raise ValueError(f"compile.graph_optimizer captures AdamW only; optimizer.name={run.optimizer.name} "
                         "runs eager (set compile.graph_optimizer=false)")
    if run.compile.graph_optimizer and run.training.mixed_precision == "bf16_params":
        raise ValueError("compile.graph_optimizer does not capture MasterWeightAdamW (training.mixed_precision="
                         "bf16_params: its update is a Triton kernel launched outside torch's dispatcher)")
    for spec in run.compile.graph_passes:
        resolve_pass(spec)  # unknown names fail before the model is built


def build_graph_step(run: TrainConfig, loss_module, *, folder: Path, is_main: bool,
                     autocast: Callable[[], contextlib.AbstractContextManager]) -> GraphStep:
    dump = folder / "graph" if run.compile.dump_graph and is_main else None
    return GraphStep(loss_module, passes=run.compile.graph_passes, dump_folder=dump, autocast=autocast)


def build_graph_optimizer(run: TrainConfig, optimizer, *, folder: Path, is_main: bool, device) -> GraphAdamW | None:
    """compile.graph_optimizer: the captured AdamW update (None: optimizer.step() runs eager)."""
    if not run.compile.graph_optimizer:
        return None
    dump = folder / "graph" if run.compile.dump_graph and is_main else None
    return GraphAdamW(optimizer, device=device, dump_folder=dump)
