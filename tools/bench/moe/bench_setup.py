"""Shared pieces of the dist-moe benchmark: shapes, routings, timing, float64 checks, and a per-launch
timer for dist-moe's kernels (which launch of a layer step takes how long)."""
from __future__ import annotations

import contextlib
import sys
import time
from dataclasses import dataclass, field

BF16_RTOL = 1e-2  # bf16 output of a float32-accumulated GEMM vs float64, relative to the largest entry
LAYER_RTOL = 3e-2  # three chained bf16 GEMMs


class Setup:
    """DeepSeek-V3 expert shapes on the GPU (or tiny float32 ones on CPU for --dry-run)."""

    def __init__(self, dry_run: bool):
        import torch

        self.dry = dry_run
        self.device = torch.device("cpu" if dry_run else "cuda")
        self.dtype = torch.float32 if dry_run else torch.bfloat16
        if dry_run:
            self.rows, self.hidden, self.ffn, self.experts, self.tokens, self.top_k = 96, 32, 48, 4, 24, 4
        else:
            self.rows, self.hidden, self.ffn, self.experts, self.tokens, self.top_k = 32768, 7168, 2048, 32, 4096, 8

    def counts(self, routing: str) -> list[int]:
        """Rows per expert: uniform, or Zipf (p_e ~ 1/(e+1)) rounded to sum to `rows`."""
        e, rows = self.experts, self.rows
        if routing == "uniform":
            return [rows // e] * e
        weights = [1.0 / (i + 1) for i in range(e)]
        raw = [rows * w / sum(weights) for w in weights]
        counts = [int(r) for r in raw]
        for i in sorted(range(e), key=lambda i: raw[i] - counts[i], reverse=True)[: rows - sum(counts)]:
            counts[i] += 1
        return counts

    def offsets(self, counts):
        import torch

        return torch.tensor(counts, device=self.device).cumsum(0).to(torch.int32)

    def sync(self):
        import torch

        if self.device.type == "cuda":
            torch.cuda.synchronize()

    def time_ms(self, fn, reps: int = 10, warmup: int = 2) -> float:
        """Mean milliseconds per call over `reps` back-to-back calls (CUDA events)."""
        import torch

        if self.dry:  # interpreted kernels: one call shows the path works, timing means nothing
            reps, warmup = 1, 0
        for _ in range(warmup):
            fn()
        self.sync()
        if self.device.type != "cuda":
            t = time.perf_counter()
            for _ in range(reps):
                fn()
            return (time.perf_counter() - t) * 1e3 / reps
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(reps):
            fn()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / reps

    def peak_mib(self, fn) -> float | None:
        """MiB allocated at the peak of one call above what was allocated before it (CUDA only)."""
        import torch

        if self.device.type != "cuda":
            return None
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        fn()
        torch.cuda.synchronize()
        return (torch.cuda.max_memory_allocated() - before) / 2**20

    def interleaved_ms(self, fns: dict, rounds: int, per_block: int) -> dict:
        """{name: median ms per call}: the functions take turns, `per_block` back-to-back calls each
        per round, so clock and thermal drift fall on all of them alike. Before each block the GPU is
        held back ~25 ms, so the host has queued the block when it starts (no launch latency in it).
        Off CUDA (--dry-run) each function runs once: a check of the path, not a timing."""
        import statistics

        import torch

        if self.dry or self.device.type != "cuda":
            return {name: self.time_ms(fn, reps=1, warmup=0) for name, fn in fns.items()}
        times = {name: [] for name in fns}
        for _ in range(rounds):
            for name, fn in fns.items():
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                torch.cuda._sleep(50_000_000)
                start.record()
                for _ in range(per_block):
                    fn()
                end.record()
                torch.cuda.synchronize()
                times[name].append(start.elapsed_time(end) / per_block)
        return {name: statistics.median(v) for name, v in times.items()}

    def back_to_back_ms(self, fns: dict, rounds: int, per_block: int) -> dict:
        """{name: median ms per call} in steady state: as interleaved_ms, but with no pause and no
        synchronisation between blocks, so the GPU never idles (clocks as in sustained training).
        The host queues ahead; events alone delimit the blocks. Off CUDA: each function once."""
        import statistics

        import torch

        if self.dry or self.device.type != "cuda":
            return {name: self.time_ms(fn, reps=1, warmup=0) for name, fn in fns.items()}
        for fn in fns.values():
            fn()
        marks = []
        for _ in range(rounds):
            for name, fn in fns.items():
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                for _ in range(per_block):
                    fn()
                end.record()
                marks.append((name, start, end))
        torch.cuda.synchronize()
        times = {name: [] for name in fns}
        for name, start, end in marks:
            times[name].append(start.elapsed_time(end) / per_block)
        return {name: statistics.median(v) for name, v in times.items()}

    def host_us(self, fn, reps: int = 10) -> float | None:
        """Microseconds of host time per call (launch overhead), measured without waiting for the GPU."""
        if self.dry:
            return None
        self.sync()
        t = time.perf_counter()
        for _ in range(reps):
            fn()
        host = (time.perf_counter() - t) * 1e6 / reps
        self.sync()
        return host

    def graph_ms(self, fn, reps: int = 10) -> float | None:
        """GPU milliseconds per call replayed from a CUDA graph (no host overhead), or None."""
        import torch

        if self.dry:
            return None
        try:
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                fn()  # warm the allocator on this stream
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                fn()
            return self.time_ms(graph.replay, reps=reps)
        except Exception as err:  # a diagnostic: never fail the run over it
            print(f"  (CUDA graph timing unavailable: {type(err).__name__}: {str(err)[:120]})", flush=True)
            return None


@dataclass
class ProbeLayer:
    """The probes' operands (probe_variants.py, probe_combine.py): DeepSeek-V3 expert shapes on the
    GPU, bf16, routing with every expert receiving the same number of rows, in dispatch's order."""

    tokens: int
    top_k: int
    experts: int
    dim: int
    ffn: int
    x: object  # [tokens, dim]
    w1: object  # [E, ffn, dim]
    w3: object  # [E, ffn, dim]
    w2: object  # [E, dim, ffn]
    ids: object  # [tokens, top_k] expert of each slot
    weights: object  # [tokens, top_k] routing weights (float32)
    offsets: object  # [E] int32 cumulative row ends
    slot: object  # [rows] int32 row_slot
    flat_weights: object  # [rows] float32, indexed by slot
    maps: object  # TileMaps of offsets

    @property
    def rows(self) -> int:
        return self.tokens * self.top_k

    @classmethod
    def make(cls, tokens: int = 4096, top_k: int = 8, experts: int = 32, dim: int = 7168,
             ffn: int = 2048) -> "ProbeLayer":
        import torch

        import dist_moe
        from dist_moe.kernels.launch import TileMaps

        torch.manual_seed(0)
        dev, dt = torch.device("cuda"), torch.bfloat16
        x = torch.randn(tokens, dim, device=dev, dtype=dt)
        w1 = (torch.randn(experts, ffn, dim, device=dev) * dim**-0.5).to(dt)
        w3 = (torch.randn(experts, ffn, dim, device=dev) * dim**-0.5).to(dt)
        w2 = (torch.randn(experts, dim, ffn, device=dev) * ffn**-0.5).to(dt)
        ids = (torch.arange(tokens)[:, None] * top_k + torch.arange(top_k)[None, :]) % experts
        ids = ids[torch.randperm(tokens)].to(dev)
        weights = torch.rand(tokens, top_k, device=dev)
        sent = dist_moe.dispatch(x, ids, weights, num_experts=experts)
        offsets, slot = sent.offsets.to(torch.int32), sent.row_slot.to(torch.int32)
        return cls(tokens=tokens, top_k=top_k, experts=experts, dim=dim, ffn=ffn, x=x, w1=w1, w3=w3, w2=w2,
                   ids=ids, weights=weights, offsets=offsets, slot=slot,
                   flat_weights=weights.reshape(-1).float().contiguous(),
                   maps=TileMaps(offsets, tokens * top_k))


def rel_err(got, want) -> float:
    return ((got.double() - want).abs().max() / want.abs().max().clamp_min(1e-30)).item()


def env_info() -> dict:
    import torch

    info = {"torch": torch.__version__, "python": sys.version.split()[0]}
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError:
        info["triton"] = None
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
        info["capability"] = ".".join(map(str, torch.cuda.get_device_capability()))
    return info


def has_torch_grouped_mm() -> bool:
    import torch

    return hasattr(torch, "_grouped_mm")


@dataclass
class LaunchTimer:
    """Wraps dist-moe's launchers (row_gemm, weight_gemm, gather_rows, swiglu_backward, slot_sum) to
    time each launch of one step with CUDA events: name, configuration, milliseconds, TFLOP/s
    (GEMMs). Use it on a step after the first-call tuner has chosen (its own timing launches would be recorded too)."""

    setup: Setup
    records: list = field(default_factory=list)

    @contextlib.contextmanager
    def active(self):
        import dist_moe.kernels.launch as launch
        from dist_moe.kernels.configs import RowConfig, WeightConfig

        saved = {name: getattr(launch, name) for name in ("row_gemm", "weight_gemm", "gather_rows",
                                                          "swiglu_backward", "slot_sum")}

        def timed(fn, describe):
            def call(*args, **kwargs):
                events = self._events()
                if events:
                    events[0].record()
                result = fn(*args, **kwargs)
                if events:
                    events[1].record()
                name, flops = describe(*args, **kwargs)
                config = result.name() if isinstance(result, (RowConfig, WeightConfig)) else ""
                self.records.append((name, config, flops, events))
                return result
            return call

        launch.row_gemm = timed(saved["row_gemm"], _row_flops)
        launch.weight_gemm = timed(saved["weight_gemm"], lambda **kw: _weight_flops(self.setup.rows, **kw))
        launch.gather_rows = timed(saved["gather_rows"], lambda *args, **kwargs: ("gather rows (padded copy)", 0.0))
        launch.swiglu_backward = timed(saved["swiglu_backward"], lambda *args, **kwargs: ("SwiGLU backward pass", 0.0))
        launch.slot_sum = timed(saved["slot_sum"], lambda *args, **kwargs: ("slot_sum (top-k sum)", 0.0))
        try:
            yield self
        finally:
            for name, fn in saved.items():
                setattr(launch, name, fn)

    def _events(self):
        import torch

        if self.setup.device.type != "cuda":
            return None
        return torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)

    def results(self) -> list[dict]:
        """[{name, config, ms, tflops}] in launch order (ms None on CPU)."""
        self.setup.sync()
        out = []
        for name, config, flops, events in self.records:
            ms = events[0].elapsed_time(events[1]) if events else None
            out.append({"name": name, "config": config, "ms": ms,
                        "tflops": flops / ms / 1e9 if flops and ms else None})
        return out


def _row_flops(ops, config=None):
    from dist_moe.kernels.launch import EPILOGUE_SCATTER, EPILOGUE_STORE, EPILOGUE_SWIGLU

    e, k, n = ops.b.shape
    if ops.a2 is not None:  # two K halves in one accumulator
        return "dx = dgate @ w1 + dup @ w3", 2.0 * ops.num_rows * n * (k + ops.a2.shape[1])
    products = 2 if ops.b2 is not None else 1  # gate and up
    name = {EPILOGUE_SWIGLU: "gate/up + SwiGLU", EPILOGUE_SCATTER: "down + weight, scatter"}.get(
        ops.epilogue, "grouped GEMM")
    if ops.epilogue == EPILOGUE_STORE and ops.padded_a:
        name = "dh = dOut @ w2"
    elif ops.epilogue == EPILOGUE_STORE and ops.slot is not None:
        name = "down (expert order)"
    return name, 2.0 * ops.num_rows * n * k * products


def _weight_flops(real_rows, *, p, q, ends, outs, padded=False, config=None):
    """FLOPs of the real rows (a padded operand's zero rows are not counted)."""
    kp, nq = p.shape[1], q.shape[1]
    name = f"weight grad {kp}x{nq}" + (" (2 outputs)" if len(outs) == 2 else "")
    return name, 2.0 * min(p.shape[0], real_rows) * kp * nq
