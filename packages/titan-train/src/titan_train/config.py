"""The typed configuration tree of a training run.

Every field is typed and has a default, so `--help` can list it and the CLI can check a value
against its type (`--section.field value`). A recipe is a Python function returning a `TrainConfig`.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Literal

if TYPE_CHECKING:  # the components' modules import torch and the parallel libraries: only when built
    import torch
    import torch.nn as nn

    from .checkpoint import RunCheckpoints
    from .metrics import MetricsWriter
    from .parallelizer import Parallelizer

# (parameter-name pattern, placement) pairs for flexshard; see ParallelismConfig.flexshard_placements.
PlacementRules = tuple[tuple[str, str], ...]


@dataclass(kw_only=True)
class JobConfig:
    folder: str = "runs/titan"
    """Where metrics.jsonl, TensorBoard events and checkpoints go."""
    seed: int = 0
    """Seeds data order and torch's RNG (the model's initial weights use model.init_seed)."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """auto: cuda when available, else cpu."""


@dataclass(kw_only=True)
class ModelConfig:
    family: str = "llama3"
    """A titan-models family (llama3, qwen3, ...)."""
    flavor: str = "debug"
    """A flavor of that family (debug, 1B, 8B, ...)."""
    num_layers: int = 0
    """Override the flavor's layer count (0 keeps it)."""
    vocab_size: int = 0
    """Override the flavor's vocabulary size (0 keeps it), e.g. to fit a byte-level tokenizer snugly."""
    attention: Literal["default", "sdpa", "flex", "eager"] = "default"
    """Attention backend; documents in a packed sequence are masked by each. Attention sinks (gpt-oss) run in
    flex or eager; sdpa runs those layers eagerly."""
    init_seed: int = 0
    """Seed of model.init_weights: the same seed gives the same weights on any parallel layout."""
    hf_path: str = ""
    """Start from a Hugging Face model folder (config.json + safetensors): the architecture comes from its
    config (family, flavor and vocab_size are then ignored) and the initial weights from its tensors."""
    moe_impl: Literal["auto", "titan", "dist_moe"] = "auto"
    """MoE layers: titan (titan-models' own) or dist_moe (dist-moe's fused grouped-GEMM layer, needed for
    expert parallelism). auto: dist_moe when parallelism.ep > 1, else titan."""
    moe_aux_loss_weight: float = 0.0
    """dist_moe only: weight of DeepSeek-V3's sequence-wise balance loss added to the objective (0: off)."""
    moe_routing: Literal["learned", "forced_balance"] = "learned"
    """learned: the router's top-k. forced_balance (dist_moe only, for measurement): tokens dealt evenly to
    the experts whatever the router says (weights still from its scores), so every expert gets the same
    load; it changes the workload, so every metrics record says `moe_routing`."""
    moe_keep_routed_input: bool = False
    """dist_moe only: each MoE layer copies its routed token rows once and keeps them for the backward (the
    gate/up GEMM reads the copy through TMA, the backward skips a second gather): 1.16-1.19x torch.compile of
    the usual MoE pipeline against 1.15-1.17x without it (DeepSeek-V3 expert shapes, two runs on one H100),
    for routed rows x dim more activation memory per MoE layer, what the usual pipeline holds."""
    mtp_layers: int = 0
    """Multi-token-prediction modules trained beside the main model (DeepSeek-V3: 1; titan-models builds
    depth 0 or 1). The MTP module predicts token i + 2 from the main model's hidden state at i and the
    embedding of token i + 1; its loss, weighted by training.mtp_loss_weight, joins the objective."""


@dataclass(kw_only=True)
class StepConfig:
    """The `training` section: how many optimizer steps, and what each one takes and computes."""

    steps: int = 100
    """Optimizer steps to run (a resumed run continues up to this count)."""
    batch_size: int = 8
    """Global batch: sequences per optimizer step summed over data-parallel ranks and microbatches."""
    seq_len: int = 256
    """Tokens per sequence."""
    grad_accum_steps: int = 1
    """Microbatches per optimizer step on each data-parallel rank."""
    max_grad_norm: float = 1.0
    """Clip the global gradient norm to this (0 disables clipping)."""
    mixed_precision: Literal["auto", "bf16", "bf16_params", "fp32"] = "auto"
    """bf16: bf16 compute (autocast, or FSDP's policy), fp32 master weights and gradient reduction.
    bf16_params (one device, AdamW, no gradient accumulation): bf16 parameters and gradients in the model,
    fp32 master weights and moments in the optimizer; the same arithmetic as FSDP's bf16 policy, without
    autocast's per-step weight and gradient casts. auto: bf16 on cuda, fp32 on cpu."""
    loss_chunk_size: int = 8192
    """Tokens per chunk of the fused output-projection + cross-entropy (full logits never exist)."""
    loss_weight_grad_dtype: Literal["float32", "param"] = "float32"
    """The dtype the fused loss sums the output weight's gradient in over its chunks: float32, or the
    weight's own (param: bf16 under mixed_precision=bf16_params, as liger-kernel does; half the bytes of
    the [vocab, dim] buffer held through the loss and of each chunk's pass over it, one bf16 rounding a
    chunk where float32 has one at the end)."""
    gc_interval: int = 50
    """Run Python's garbage collector (young generations) every this many steps instead of automatically,
    so a collection never stalls the GPU queue mid-step (0: leave it automatic)."""
    fused_kernels: bool = True
    """On CUDA, titan-train's Triton kernels for the loss's softmax gradient and the SwiGLU backward
    (false: torch ops, fused by torch.compile where compile.enabled)."""
    mtp_loss_weight: float = 0.1
    """lambda of DeepSeek-V3's objective main + lambda * MTP loss (each a mean over its scored tokens;
    the report used 0.3, then 0.1); applies when model.mtp_layers > 0."""
    moe_bias_update_rate: float = 1e-3
    """MoE aux-loss-free balancing: after each optimizer step, expert_bias += rate * sign(mean load - load),
    with the loads counted over the step's whole global batch (0 disables)."""

    def check(self) -> None:
        for name in ("steps", "batch_size", "seq_len", "grad_accum_steps"):
            if getattr(self, name) < 1:
                raise ValueError(f"training.{name} must be >= 1, got {getattr(self, name)}")
        if not 0 <= self.mtp_loss_weight < float("inf"):
            raise ValueError(f"training.mtp_loss_weight must be a finite number >= 0, got {self.mtp_loss_weight}")
        if self.gc_interval < 0:
            raise ValueError(f"training.gc_interval must be >= 0 (0: automatic collection), got {self.gc_interval}")

    def precision(self, device: torch.device) -> str:
        """mixed_precision with auto resolved: bf16 on cuda, fp32 on cpu."""
        if self.mixed_precision != "auto":
            return self.mixed_precision
        return "bf16" if device.type == "cuda" else "fp32"


@dataclass(kw_only=True)
class OptimizerConfig:
    name: Literal["adamw", "muon"] = "adamw"
    """adamw, or muon: flexshard's Muon for hidden matrices (AdamW with `lr` for embeddings, output and
    vectors); give matrices the owned placement under flexshard so its step needs no communication."""
    lr: float = 3e-3
    """Peak learning rate (AdamW; under muon, of the parameters Muon leaves to AdamW)."""
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    weight_decay: float = 0.1
    """Decoupled weight decay, applied to matrices only (not to norms)."""
    implementation: Literal["auto", "fused", "foreach", "for-loop"] = "auto"
    """AdamW kernels. auto: fused on cuda, foreach on cpu."""
    moment_dtype: Literal["float32", "bfloat16"] = "float32"
    """AdamW's two moments under training.mixed_precision=bf16_params: bfloat16 keeps them as torch's AdamW
    does for a bf16 model (updated in fp32, stored rounded), 4 bytes a parameter less; the master weights
    stay fp32."""
    muon_lr: float = 0.02
    """muon: peak learning rate of the Muon matrices (follows the same schedule)."""
    muon_momentum: float = 0.95
    muon_ns_steps: int = 5
    """muon: Newton-Schulz iterations orthogonalising each update."""
    muon_ns_dtype: Literal["bfloat16", "float32"] = "bfloat16"
    """muon: dtype of the Newton-Schulz iterations."""
    muon_adjust_lr: Literal["spectral", "match_adamw_rms", "none"] = "spectral"
    """muon: per-matrix learning-rate scale: sqrt(max(1, rows/cols)), 0.2 sqrt(max(rows, cols)), or 1."""

    def build(self, model: nn.Module, *, device: torch.device,
              param_dtype: torch.dtype | None = None) -> torch.optim.Optimizer:
        """The optimizer over `model`'s trainable parameters (optimizers.py)."""
        from .optimizers import build_optimizer

        return build_optimizer(self, model, device=device, param_dtype=param_dtype)


@dataclass(kw_only=True)
class LRScheduleConfig:
    kind: Literal["wsd", "cosine", "constant"] = "wsd"
    """wsd: warmup, stable, decay over the last decay_fraction of steps. cosine: warmup then cosine."""
    warmup_steps: int = 10
    decay_fraction: float = 0.2
    """wsd only: the share of steps spent decaying."""
    decay_shape: Literal["linear", "sqrt", "cosine"] = "linear"
    """wsd only: the shape of the final decay."""
    min_lr_ratio: float = 0.0
    """The final learning rate as a fraction of the peak."""

    def check(self) -> None:
        from .lr_schedule import validate

        validate(self)

    def build(self, optimizer: torch.optim.Optimizer, *, total_steps: int) -> torch.optim.lr_scheduler.LambdaLR:
        """The schedule as a LambdaLR over `optimizer` (lr_schedule.py's factor of the peak rate)."""
        import torch

        from .lr_schedule import lr_factor

        return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(step, total_steps, self))


@dataclass(kw_only=True)
class DataConfig:
    source: str = "stdlib"
    """stdlib (Python's own library sources, no download), random (uniform random tokens over the model's
    vocabulary, for benchmarks), arithmetic_chat (generated conversations, for data.chat), shapes (drawn
    coloured shapes with captions, for a vision-language model: loss on the captions), or a path: a
    text/jsonl/parquet file, a folder of them, or a Hugging Face
    dataset saved with save_to_disk."""
    format: Literal["auto", "stdlib", "text", "jsonl", "parquet", "hf_disk"] = "auto"
    """auto: from the source (stdlib, file extension, or a folder holding state.json/dataset_dict.json)."""
    text_field: str = "text"
    """The column (jsonl/parquet/hf_disk) holding each document's text."""
    split: str = "train"
    """The split of a saved Hugging Face DatasetDict."""
    tokenizer: str = "byte"
    """byte (built-in, 256 bytes + specials) or the path of a Hugging Face tokenizer.json (or its folder)."""
    document_masking: bool = True
    """Attention never crosses a document boundary inside a packed sequence."""
    shuffle: bool = True
    """Visit documents in a seeded random order (a new order each epoch)."""
    sources: tuple[tuple[str, float], ...] = ()
    """Mix several sources by weight instead of `source`: each packed row is drawn from one of them in a
    seeded order (resumable). Command line: 'a.jsonl=0.7,b.parquet=0.3' (formats detected per source)."""
    chat: bool = False
    """Chat data (supervised fine-tuning): each record's `messages_field` is a list of {role, content},
    rendered with `chat_template`; only the assistant's tokens are scored."""
    messages_field: str = "messages"
    """chat: the column (jsonl/parquet/hf_disk) holding each conversation."""
    chat_template: str = "auto"
    """chat: auto (the chat_template of tokenizer_config.json beside data.tokenizer, or the built-in one for
    the byte tokenizer), builtin, or the path of a Jinja template file."""
    image_field: str = ""
    """Image-text data for a vision-language model: the column (jsonl/hf_disk) holding each record's images
    (paths relative to data.source's folder, or a saved dataset's Image column); one record per row, loss on
    the text. Empty: text only."""
    image_placeholder: str = "<image>"
    """image_field: where each image's tokens go in the text (none in a text: its images come first)."""
    image_min_pixels: int = 65536
    """image_field: images with fewer pixels are scaled up to about this many (the processor's shortest_edge)."""
    image_max_pixels: int = 16777216
    """image_field: images with more pixels are scaled down to at most this many (longest_edge)."""

    @property
    def random(self) -> bool:
        return self.source == "random" and not self.sources

    def build_tokenizer(self) -> Any:
        """The tokenizer of a text source (None for random tokens, which need none)."""
        from .data import build_tokenizer

        return None if self.random else build_tokenizer(self.tokenizer)

    def build(self, tokenizer: Any, *, vocab_size: int, seq_len: int, seed: int, model_config: Any = None) -> Any:
        """The loader of the global token stream (every rank reads all of it and keeps its rows)."""
        from .data import MixedLoader, RandomTokenLoader, ShapesLoader

        if self.source == "shapes":
            return ShapesLoader(model_config, tokenizer, seq_len=seq_len, seed=seed)
        if self.image_field:
            return self.image_text_loader(tokenizer, model_config, seq_len=seq_len, seed=seed)
        if self.random:
            return RandomTokenLoader(vocab_size, seq_len=seq_len, seed=seed)
        if self.sources:
            loaders = [self.packed_loader(source, tokenizer, seq_len=seq_len, seed=seed + i, shuffle=self.shuffle,
                                          format="auto") for i, (source, _) in enumerate(self.sources)]
            return MixedLoader(loaders, [weight for _, weight in self.sources], seed=seed)
        return self.packed_loader(self.source, tokenizer, seq_len=seq_len, seed=seed, shuffle=self.shuffle)

    def image_text_loader(self, tokenizer: Any, model_config: Any, *, seq_len: int, seed: int) -> Any:
        from pathlib import Path

        from .data import ImageTextLoader, open_documents

        if self.sources or self.chat or self.source in ("stdlib", "random", "arithmetic_chat"):
            raise ValueError("data.image_field reads one jsonl/hf_disk data.source (not data.sources, data.chat, "
                             f"or data.source={self.source!r})")
        read = dict(format=self.format, split=self.split)
        texts = open_documents(self.source, text_field=self.text_field, **read)
        images = open_documents(self.source, text_field=self.image_field, strings=False, **read)
        root = Path(self.source) if Path(self.source).is_dir() else Path(self.source).parent
        return ImageTextLoader(model_config, tokenizer, texts, images, seq_len=seq_len, seed=seed,
                               shuffle=self.shuffle, root=root, origin=self.source,
                               placeholder=self.image_placeholder,
                               pixels=(self.image_min_pixels, self.image_max_pixels))

    def packed_loader(self, source: str, tokenizer: Any, *, seq_len: int, seed: int, shuffle: bool,
                      format: str | None = None) -> Any:
        """The packing loader of one source read as this section says (text or chat)."""
        from .data import PackedLoader, open_documents

        format = self.format if format is None else format
        field_name = self.messages_field if self.chat else self.text_field
        documents = open_documents(source, format=format, text_field=field_name, split=self.split,
                                   strings=not self.chat)
        encode = None
        if self.chat:
            from .data.chat import ChatEncoder

            encode = ChatEncoder.build(self.chat_template, tokenizer, tokenizer_spec=self.tokenizer)
            encode.check(documents, origin=source)
        return PackedLoader(documents, tokenizer, seq_len=seq_len, seed=seed, shuffle=shuffle,
                            document_masking=self.document_masking, encode=encode)

    def check(self) -> None:
        for source, weight in self.sources:
            if not weight > 0:
                raise ValueError(f"data.sources: the weight of {source!r} must be > 0, got {weight}")


@dataclass(kw_only=True)
class ParallelismConfig:
    dp_replicate: int = 1
    """Data-parallel replicas (HSDP's replicate dimension)."""
    dp_shard: int = -1
    """FSDP shard degree; -1: whatever the world size leaves after the others."""
    tp: int = 1
    """Tensor (+ sequence) parallel degree."""
    pp: int = 1
    """Pipeline parallel degree: the blocks split into stages over pp ranks (torch.distributed.pipelining)."""
    pp_schedule: Literal["1F1B", "Interleaved1F1B", "GPipe", "InterleavedZeroBubble", "ZBVZeroBubble",
                         "DualPipeV"] = "1F1B"
    """Pipeline schedule. Interleaved*: several stages per rank (smaller bubble); ZeroBubble/DualPipeV split
    the backward into input and weight gradients to fill the bubble (not with compile.enabled)."""
    pp_microbatches: int = 0
    """Microbatches each step's rows are split into for the pipeline (0: one per stage); more shrink the bubble."""
    pp_stages_per_rank: int = 0
    """Stages per pp rank (0: the schedule's own: 1, or 2 for Interleaved* and the V schedules, which need 2)."""
    pp_overlap_ep: bool = False
    """DualPipeV with ep > 1: run each paired forward/backward of two microbatches as two alternating turns, so
    one microbatch's expert all-to-alls are in flight while the other computes (pipeline_overlap.py); gradients
    are unchanged."""
    cp: int = 1
    """Context parallel degree: each sequence split over cp ranks (load-balanced causal chunks, ring attention);
    FSDP shards over dp_shard x cp."""
    ep: int = 1
    """Expert parallel degree: MoE experts split over ep ranks borrowed from dp_shard (ep must divide it); the
    experts are FSDP-sharded over the rest of data parallel. Uses model.moe_impl=dist_moe."""
    reshard_after_forward: bool = True
    """FSDP: free gathered parameters after each block's forward (ZeRO-3) instead of keeping them (ZeRO-2)."""
    fsdp_impl: Literal["fully_shard", "flexshard"] = "fully_shard"
    """Data-parallel sharding: torch's fully_shard (FSDP2), or flexshard (per-parameter placements, buckets,
    fp8 all-gather; 1-D dp_shard mesh only)."""
    flexshard_placements: PlacementRules = ()
    """flexshard: (parameter-name pattern, placement) pairs, first match wins, unmatched parameters row.
    Placements: row (dim-0 rows, fully_shard's layout), owned (whole on one rank), block:RxC (R x C tiles).
    Command line: 'layers.*.weight=owned,output.weight=block:128x128'."""
    flexshard_buckets: tuple[str, ...] = ()
    """flexshard: buckets inside each block, one all-gather each; an entry lists parameter-name patterns
    (relative to the block) joined by '|', e.g. 'attention.*|attention_norm.*'. Empty: one bucket per block."""
    fp8_all_gather: bool = False
    """flexshard: all-gather the block:RxC parameters as fp8 e4m3 with one scale per tile (about half the
    bytes of bf16); needs at least one block placement, or quantize.linear fp8_blockwise, whose converted
    Linears' weights are then placed block:128x128 (its weight blocks) and gathered in its own fp8 form, which
    the forward GEMM takes as gathered."""

    def build(self, run: TrainConfig, *, world_size: int, device: torch.device) -> Parallelizer:
        """The run's layout on `world_size` ranks (degrees checked against the rest of `run`, the mesh),
        which then builds the parallelized model (parallelizer.py)."""
        from .parallelizer import Parallelizer

        return Parallelizer(run, world_size=world_size, device=device)


@dataclass(kw_only=True)
class CheckpointConfig:
    interval: int = 0
    """Save every this many steps (0: never save)."""
    keep_last: int = 2
    """Keep this many most recent checkpoints (0 keeps all)."""
    resume: bool = True
    """Resume from the newest checkpoint in <job.folder>/checkpoints when there is one."""
    async_save: bool = True
    """Write checkpoints in the background while training goes on."""
    initial_load: str = ""
    """Initial model weights only (no optimizer or data state): a titan-train job folder or its checkpoints
    folder (the newest committed step), or a Hugging Face folder (config.json + safetensors) of the same
    architecture. A resumed run then loads its own checkpoint over them. '' keeps model.* (init_seed, hf_path)."""
    load_step: int = 0
    """Resume from this committed step instead of the newest (0: the newest; it must be committed)."""
    exclude: tuple[str, ...] = ()
    """Checkpoint entries a resume does not load (patterns over model, optimizer, scheduler, data, rng,
    step), e.g. 'optimizer,scheduler' to continue with a fresh optimizer."""
    export_hf_at_end: bool = False
    """After the last step write the model (LoRA merged) as a Hugging Face folder into <job.folder>/hf."""

    def check(self) -> None:
        if self.interval < 0 or self.keep_last < 0:
            raise ValueError("checkpoint.interval and checkpoint.keep_last must be >= 0")
        if self.load_step < 0:
            raise ValueError(f"checkpoint.load_step must be >= 0 (0: the newest), got {self.load_step}")
        if self.load_step and not self.resume:
            raise ValueError(f"checkpoint.load_step={self.load_step} resumes from that step: "
                             "set checkpoint.resume true")
        from .checkpoint import check_exclude

        check_exclude(self.exclude)

    def build(self, folder: Path, *, adapt: Callable[[dict], dict] | None = None,
              trainable_only: bool = False) -> RunCheckpoints | None:
        """The run's checkpoints in `folder` (None when neither saving nor resuming). trainable_only: save the
        model's trainable parameters only (LoRA adapters; the frozen base comes from the run's initial weights)."""
        if self.interval == 0 and not self.resume:
            return None
        from .checkpoint import RunCheckpoints  # torch-checkpointing is only needed when checkpointing

        return RunCheckpoints(folder, keep_last=self.keep_last, async_save=self.async_save, adapt=adapt,
                              exclude=self.exclude, trainable_only=trainable_only)


@dataclass(kw_only=True)
class MetricsConfig:
    log_interval: int = 1
    """Write metrics (and print a progress line when not on a terminal) every this many steps."""
    tensorboard: bool = True
    """Write TensorBoard event files beside metrics.jsonl."""
    progress: bool = True
    """Show the progress bar on rank 0."""
    wandb: bool = False
    """Also log to Weights & Biases (pip install 'titan-train[wandb]'); WANDB_MODE=offline needs no network."""
    wandb_project: str = "titan-train"
    """wandb: the project the run is logged under."""
    wandb_mode: Literal["auto", "online", "offline", "disabled"] = "auto"
    """wandb: auto takes WANDB_MODE from the environment (online when unset); offline writes <job.folder>/wandb."""
    plot: bool = True
    """At the end of the run write <job.folder>/metrics.png: loss (and eval loss) and throughput per step."""

    def check(self) -> None:
        if self.log_interval < 1:
            raise ValueError(f"metrics.log_interval must be >= 1, got {self.log_interval}")

    def build(self, folder: Path, *, start_step: int, run_config: dict | None = None) -> MetricsWriter:
        from .metrics import MetricsWriter

        sinks = []
        if self.wandb:
            from .tracking import WandbSink

            sinks.append(WandbSink(folder, project=self.wandb_project, mode=self.wandb_mode, config=run_config))
        return MetricsWriter(folder, tensorboard=self.tensorboard, start_step=start_step, sinks=sinks)


@dataclass(kw_only=True)
class ValidationConfig:
    source: str = ""
    """Held-out data in the formats of data.source (read with data.tokenizer, and as chat data under
    data.chat); '' turns validation off."""
    format: Literal["auto", "stdlib", "text", "jsonl", "parquet", "hf_disk"] = "auto"
    """As data.format, for validation.source."""
    interval: int = 0
    """Evaluate every this many steps, and after the last step (0: after the last step only)."""
    steps: int = 4
    """Batches (training.batch_size x training.seq_len) per evaluation: the same first ones every time."""

    def check(self) -> None:
        if self.interval < 0 or self.steps < 1:
            raise ValueError(f"validation.interval must be >= 0 and validation.steps >= 1, got "
                             f"{self.interval} and {self.steps}")

    def build(self, data: DataConfig, tokenizer: Any, *, seq_len: int, batch_size: int, seed: int) -> Any:
        """The run's Validator (validation.py), None when validation.source is ''."""
        if not self.source:
            return None
        from .validation import Validator

        # In file order (a bad source or record fails here, before training); rewound for every evaluation.
        loader = data.packed_loader(self.source, tokenizer, seq_len=seq_len, seed=seed, shuffle=False,
                                    format=self.format)
        return Validator(loader, interval=self.interval, steps=self.steps, batch_size=batch_size)


@dataclass(kw_only=True)
class LoRAConfig:
    targets: tuple[str, ...] = ()
    """LoRA adapters on the Linears whose names match these patterns (titan_models.override's: '*' within
    one name component), e.g. 'layers.*.attention.wq,layers.*.attention.wv'; the rest of the model is frozen
    and only the adapters are trained and checkpointed. Empty: no LoRA."""
    rank: int = 8
    """Rank r of each adapter: W x + (alpha / r) B A x with A [r, in], B [out, r] (B starts at zero)."""
    alpha: float = 16.0
    dropout: float = 0.0
    """Dropout on the adapter's input (training only)."""

    def check(self) -> None:
        if self.targets and (self.rank < 1 or not 0.0 <= self.dropout < 1.0):
            raise ValueError(f"lora.rank must be >= 1 and lora.dropout in [0, 1), got {self.rank} and {self.dropout}")

    def build(self, *, seed: int) -> Any:
        """The adapters to apply (lora.py's LoRA), None when no targets are given."""
        if not self.targets:
            return None
        from .lora import LoRA

        return LoRA(self.targets, rank=self.rank, alpha=self.alpha, dropout=self.dropout, seed=seed)


@dataclass(kw_only=True)
class ProfilingConfig:
    steps: tuple[int, ...] = ()
    """Record these steps with torch.profiler (e.g. '5,6') into <job.folder>/profile/trace_rank<R>.json
    (Chrome/Perfetto) and print where their time went: compute, communication, idle."""
    memory_snapshot: bool = False
    """CUDA: record allocations over the profiled steps (or the first 3 steps) and write torch's memory
    snapshot <job.folder>/profile/memory_snapshot_rank<R>.pickle (open it in pytorch.org/memory_viz)."""

    def check(self) -> None:
        if any(step < 1 for step in self.steps):
            raise ValueError(f"profiling.steps must be >= 1, got {self.steps}")

    def build(self, folder: Path, *, rank: int, device: torch.device) -> Any:
        from .profiling import StepProfiler

        return StepProfiler(folder / "profile", steps=self.steps, memory_snapshot=self.memory_snapshot, rank=rank,
                            device=device)


# (module-path pattern, compile options) pairs; see CompileConfig.regions.
RegionRules = tuple[tuple[str, str], ...]


@dataclass(kw_only=True)
class CompileConfig:
    mode: Literal["none", "blocks", "regions", "graph"] = "none"
    """none: eager. blocks: torch.compile each transformer block (and the loss's chunks). regions:
    torch.compile the modules `regions` selects, each with its own options. graph: trace the whole step
    (forward, loss, backward) into one FX graph once and run that graph each step (graph passes apply)."""
    enabled: bool = False
    """Alias of mode=blocks (kept for older recipes)."""
    regions: RegionRules = ()
    """mode=regions: (module-path pattern, options) pairs; `*` stands for one path component; options are a
    torch.compile mode (default, reduce-overhead, max-autotune, max-autotune-no-cudagraphs) followed by
    optional /fullgraph and /dynamic or /static. A pattern matching no module is an error.
    Command line: 'layers.*.attention=default,layers.*.feed_forward=max-autotune/fullgraph'."""
    backend: str = "inductor"
    """torch.compile backend of blocks and regions (inductor; aot_eager or eager to debug)."""
    dump_graph: bool = False
    """mode=graph: write the step's graph (readable code, and node counts per op) to <job.folder>/graph/."""
    graph_passes: tuple[str, ...] = ("remove_detach", "eliminate_dead_code")
    """mode=graph: graph passes applied in order after capture, each a registered name (see
    titan_train.graph.graph_passes()) or package.module:function taking and returning a GraphModule."""
    graph_optimizer: bool = False
    """mode=graph: capture the AdamW update too, as a second graph run right after the step's (lr and step
    counts are its tensor inputs, so one graph serves every step); bitwise equal to eager. Fused AdamW, or
    foreach/for-loop on CPU; Muon and training.mixed_precision=bf16_params are refused."""

    @property
    def effective_mode(self) -> str:
        """mode with the `enabled` alias resolved."""
        return "blocks" if self.enabled and self.mode == "none" else self.mode

    @property
    def uses_torch_compile(self) -> bool:
        """torch.compile is applied to parts of the model (blocks or regions); the loss's chunks then too."""
        return self.effective_mode in ("blocks", "regions")

    def check(self) -> None:
        if self.enabled and self.mode not in ("none", "blocks"):
            raise ValueError(f"compile.enabled=true is an alias of compile.mode=blocks; it conflicts with "
                             f"compile.mode={self.mode} (drop compile.enabled)")
        if self.effective_mode == "regions" and not self.regions:
            raise ValueError("compile.mode=regions needs compile.regions, e.g. 'layers.*.attention=default'")
        if self.regions and self.effective_mode != "regions":
            raise ValueError(f"compile.regions is set but compile.mode={self.effective_mode}; use compile.mode=regions")
        if self.graph_optimizer and self.effective_mode != "graph":
            raise ValueError("compile.graph_optimizer=true needs compile.mode=graph, got "
                             f"compile.mode={self.effective_mode}")


@dataclass(kw_only=True)
class ActivationCheckpointConfig:
    mode: Literal["none", "full", "selective", "remat"] = "none"
    """full: recompute every block in backward. selective: see `selective`. remat: per-op and per-block
    choices, given (save_ops, save_blocks) or planned under memory_budget_gib; the plan is printed and
    written to <job.folder>/remat_plan.json."""
    save_ops: tuple[str, ...] = ()
    """remat: aten op names whose outputs every checkpointed block keeps (e.g. 'mm,addmm'); the rest is
    recomputed in backward (empty: recompute the whole block)."""
    save_blocks: tuple[str, ...] = ()
    """remat: block-path patterns (e.g. 'layers.0,layers.1') kept whole: nothing in them is recomputed."""
    memory_budget_gib: float = 0.0
    """remat: plan what to save so parameters, gradients, AdamW moments and the saved activations of one
    microbatch fit this many GiB per rank with the least recomputation (0: use save_ops/save_blocks)."""
    selective: Literal["ops", "layers"] = "ops"
    """ops: keep matmul and attention outputs, recompute the cheap elementwise ops between them.
    layers: recompute one block in `every`."""
    every: int = 2
    """selective=layers: checkpoint one block in this many."""

    def check(self) -> None:
        if self.memory_budget_gib < 0:
            raise ValueError(f"activation_checkpoint.memory_budget_gib must be >= 0, got {self.memory_budget_gib}")
        explicit = bool(self.save_ops or self.save_blocks)
        if self.mode != "remat" and (explicit or self.memory_budget_gib):
            raise ValueError("activation_checkpoint.save_ops/save_blocks/memory_budget_gib need "
                             "activation_checkpoint.mode=remat")
        if explicit and self.memory_budget_gib:
            raise ValueError("activation_checkpoint: give either memory_budget_gib (planned) or save_ops/"
                             "save_blocks (explicit), not both")


@dataclass(kw_only=True)
class QuantizeConfig:
    linear: Literal["none", "fp8_tensorwise", "fp8_rowwise", "fp8_blockwise", "mxfp8"] = "none"
    """Low-precision matmuls of the selected Linears (forward and both backward GEMMs; master weights and
    gradients keep their dtype). fp8_tensorwise: e4m3 x/W, e5m2 gradients, one scale per tensor. fp8_rowwise:
    e4m3, a scale per row/column. fp8_blockwise: e4m3, DeepSeek-V3's 1x128 activation and 128x128 weight
    blocks. mxfp8: OCP MX, e4m3 in 1x32 blocks with e8m0 scales (bf16 GEMM on dequantised operands before
    sm_100). See quantize/recipes.py."""
    modules: tuple[str, ...] = ()
    """Linears to convert, by name pattern ('*' within one name component, '**' across), e.g.
    'layers.*.feed_forward.*'. Empty: every nn.Linear except the output head and MoE routers. A selected
    Linear whose shape the recipe cannot block stays in high precision with a warning (an error if named exactly)."""
    backend: Literal["auto", "emulated"] = "auto"
    """auto: fp8 kernels on CUDA (torch._scaled_mm, Triton), quantise-dequantise-fp32 matmul on CPU. emulated:
    the CPU path everywhere (a numerics reference)."""
    fast_accum: bool = False
    """fp8_tensorwise / fp8_rowwise: the forward GEMM with torch._scaled_mm's use_fast_accum (Hopper: no
    periodic fp32 promotion of the tensor cores' accumulator; faster, less accurate: torchao's default for its
    output GEMM). The backward's GEMMs always promote. Refused with the other recipes."""
    experts: Literal["none", "fp8_rowwise", "fp8_blockwise"] = "none"
    """The routed experts' grouped GEMMs (forward and backward) in fp8 by dist-moe's grouped_mm_fp8
    (model.moe_impl=dist_moe): rowwise, or blockwise (expert and model widths multiples of 128)."""

    def build(self) -> Any:
        """The conversion pass over the model's Linears (quantize/convert.py), None for linear=none."""
        if self.linear == "none":
            return None
        from .quantize import LinearConversion

        return LinearConversion(self.linear, self.modules, backend=self.backend, fast_accum=self.fast_accum)


@dataclass(kw_only=True)
class TrainConfig:
    """The whole configuration of a `titan-train` run (what a recipe returns), one section per field."""

    job: JobConfig = field(default_factory=JobConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    training: StepConfig = field(default_factory=StepConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    lr_schedule: LRScheduleConfig = field(default_factory=LRScheduleConfig)
    data: DataConfig = field(default_factory=DataConfig)
    parallelism: ParallelismConfig = field(default_factory=ParallelismConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    compile: CompileConfig = field(default_factory=CompileConfig)
    activation_checkpoint: ActivationCheckpointConfig = field(default_factory=ActivationCheckpointConfig)
    validation: ValidationConfig = field(default_factory=ValidationConfig)
    lora: LoRAConfig = field(default_factory=LoRAConfig)
    profiling: ProfilingConfig = field(default_factory=ProfilingConfig)
    quantize: QuantizeConfig = field(default_factory=QuantizeConfig)

    def check(self) -> None:
        """The checks of each section that need nothing but the section (the layout's come with
        parallelism.build)."""
        self.training.check()
        self.lr_schedule.check()
        self.checkpoint.check()
        self.metrics.check()
        self.data.check()
        self.validation.check()
        self.lora.check()
        self.profiling.check()
        self.compile.check()
        self.activation_checkpoint.check()
