"""quantize.linear in the trainer: which Linears the pass converts, a short CPU training run per recipe
against the unquantised one, and composition with compile, activation checkpointing, checkpoints and FSDP.

Loss bound. On the tiny job (fp32 on CPU, 10 AdamW steps on the stdlib text, loss 6.5 -> 4.2) every recipe
stays within 1% of the fp32 run at every step. Where that comes from: e4m3 rounds each operand with
relative error <= 2^-4 (rms ~2^-4 / sqrt(3) ~ 3.6%, independent across elements), which the GEMMs' sums over
256-768 terms average down to ~0.2% per output; what reaches the loss after 10 steps has measured <= 0.3%
(mxfp8, the coarsest). 1% leaves a 3x margin and is still far below a broken recipe (a gradient in the wrong
scale, a transposed block layout) that moves the loss by tens of percent within a few steps. The run must also
differ from fp32 (> 1e-6): the conversion really happened.
"""
from __future__ import annotations

import warnings

import pytest
import torch

import titan_models as tm
from titan_train import train
from titan_train.quantize import LinearConversion, QuantizedLinear

STEPS = {"training.steps": "10"}


def _meta(family: str) -> torch.nn.Module:
    with torch.device("meta"):
        return tm.flavor(family, "debug").build()


def test_default_selection_leaves_out_the_head_and_the_routers():
    llama = _meta("llama3")
    names = LinearConversion("fp8_rowwise").apply(llama)
    linears = [n for n, m in llama.named_modules() if isinstance(m, torch.nn.Linear)]
    assert "output" not in names and type(llama.output) is torch.nn.Linear
    assert sorted(names) == sorted(n for n in linears if n != "output") and len(names) == 4 * 7
    assert all(isinstance(llama.get_submodule(n), QuantizedLinear) for n in names)
    deepseek = _meta("deepseek_v3")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        names = LinearConversion("fp8_rowwise").apply(deepseek)
    assert not any("router" in n for n in names) and "layers.1.moe.shared_experts.w1" in names
    routers = [m for n, m in deepseek.named_modules() if "router" in n and isinstance(m, torch.nn.Linear)]
    assert routers and all(type(m) is torch.nn.Linear for m in routers)


def test_unblockable_shapes_stay_in_high_precision_with_a_warning():
    """deepseek_v3 debug: wq [192 x 256], wkv_a [80 x 256], wkv_b [256 x 64] are not 128-blockable."""
    model = _meta("deepseek_v3")
    with pytest.warns(UserWarning, match=r"layers\.0\.attention\.wkv_a \[80 x 256\]"):
        names = LinearConversion("fp8_blockwise").apply(model)
    assert type(model.layers["0"].attention.wkv_a) is torch.nn.Linear
    assert "layers.0.attention.wo" in names and "layers.0.attention.wq" not in names
    with pytest.raises(ValueError, match="wkv_a.*divisible by 128"):  # named exactly: refused
        LinearConversion("fp8_blockwise", ("layers.0.attention.wkv_a",)).apply(_meta("deepseek_v3"))


def test_patterns_select_by_name_and_bad_patterns_are_refused():
    model = _meta("llama3")
    names = LinearConversion("mxfp8", ("layers.*.feed_forward.*", "**.wo")).apply(model)
    assert sorted(names) == sorted([f"layers.{i}.feed_forward.w{j}" for i in range(4) for j in (1, 2, 3)]
                                   + [f"layers.{i}.attention.wo" for i in range(4)])
    assert type(model.layers["0"].attention.wq) is torch.nn.Linear
    with pytest.raises(ValueError, match="matches no nn.Linear"):
        LinearConversion("mxfp8", ("layers.*.mlp.*",)).apply(_meta("llama3"))
    with pytest.raises(ValueError, match="not an nn.Linear"):
        LinearConversion("mxfp8", ("layers.0.attention",)).apply(_meta("llama3"))
    with pytest.raises(ValueError, match="output head"):
        LinearConversion("mxfp8", ("output",)).apply(_meta("llama3"))
    with pytest.raises(ValueError, match="allowed none, fp8_tensorwise"):
        LinearConversion("fp4")


def test_dist_moe_layers_keep_their_converted_shared_experts(tmp_path, jobs):
    """model.moe_impl=dist_moe rebuilds each MoE layer: the pass runs after that swap, so the shared experts of
    dist-moe's layer are the converted ones (and its router is not)."""
    from titan_train.trainer import Trainer

    config = jobs.tiny(tmp_path, **{"model.family": "deepseek_v3", "model.flavor": "debug", "training.steps": "1",
                                    "model.moe_impl": "dist_moe", "quantize.linear": "fp8_rowwise"})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = Trainer(config, torch.device("cpu")).model
    moe = model.layers["1"].moe
    assert type(moe).__module__.startswith("dist_moe")
    assert isinstance(moe.shared_experts.w1, QuantizedLinear) and type(moe.router.gate) is torch.nn.Linear


def test_fp8_experts_train_like_the_unquantised_experts(tmp_path, jobs):
    """quantize.experts: dist-moe's routed experts run their grouped GEMMs in fp8 (CPU: its emulation of the
    same fp8 values). Qwen3-MoE debug, 6 steps: within 1% of the unquantised experts at every step (the bound
    of the module docstring) and different from them (the experts really were quantised)."""
    job = {"model.family": "qwen3", "model.flavor": "debug_moe", "model.moe_impl": "dist_moe", "training.steps": "6"}
    plain = train(jobs.tiny(tmp_path / "plain", **job)).losses
    fp8 = train(jobs.tiny(tmp_path / "fp8", **job, **{"quantize.experts": "fp8_rowwise"})).losses
    for step in plain:
        assert fp8[step] == pytest.approx(plain[step], rel=1e-2), (step, fp8, plain)
    assert max(abs(fp8[s] - plain[s]) for s in plain) > 1e-6
    with pytest.raises(ValueError, match="quantize.experts=fp8_rowwise runs in dist-moe's experts"):
        train(jobs.tiny(tmp_path / "titan", **{**job, "model.moe_impl": "titan", "quantize.experts": "fp8_rowwise"}))


@pytest.fixture(scope="module")
def fp32_losses(tmp_path_factory, jobs):
    return train(jobs.tiny(tmp_path_factory.mktemp("fp32"), **STEPS)).losses


@pytest.fixture(scope="module")
def rowwise_losses(tmp_path_factory, jobs):
    return train(jobs.tiny(tmp_path_factory.mktemp("rowwise"), **STEPS, **{"quantize.linear": "fp8_rowwise"})).losses


@pytest.mark.parametrize("recipe", ["fp8_tensorwise", "fp8_rowwise", "fp8_blockwise", "mxfp8"])
def test_training_loss_tracks_the_unquantised_run(recipe, fp32_losses, rowwise_losses, tmp_path, jobs):
    losses = rowwise_losses if recipe == "fp8_rowwise" else train(
        jobs.tiny(tmp_path, **STEPS, **{"quantize.linear": recipe})).losses
    assert sorted(losses) == sorted(fp32_losses)
    assert losses[10] < losses[1] - 1.5  # it learns
    gaps = {step: abs(losses[step] - ref) / ref for step, ref in fp32_losses.items()}
    assert max(gaps.values()) <= 0.01, gaps
    assert max(gaps.values()) > 1e-6, "the run equals fp32: nothing was quantised"


def test_bf16_autocast_run_tracks_the_bf16_run(tmp_path, jobs):
    steps = {"training.steps": "4", "training.mixed_precision": "bf16"}
    bf16 = train(jobs.tiny(tmp_path / "bf16", **steps)).losses
    fp8 = train(jobs.tiny(tmp_path / "fp8", **steps, **{"quantize.linear": "fp8_blockwise"})).losses
    for step, ref in bf16.items():
        assert fp8[step] == pytest.approx(ref, rel=0.01), (fp8, bf16)


def test_composes_with_activation_checkpointing(rowwise_losses, tmp_path, jobs):
    """Recomputing the blocks in backward gives the eager quantised run's losses (the same ops again)."""
    losses = train(jobs.tiny(tmp_path, **STEPS, **{"activation_checkpoint.mode": "full",
                                                   "quantize.linear": "fp8_rowwise"})).losses
    for step, ref in rowwise_losses.items():
        assert losses[step] == pytest.approx(ref, rel=1e-6), (step, losses, rowwise_losses)


def test_compiles_in_one_graph_with_the_eager_numbers():
    """torch.compile(fullgraph=True) traces a converted block (the autograd.Function, its recipe and the
    quantisation) without a graph break; aot_eager runs the traced forward and backward with eager's values.
    (The trainer's compile.mode=blocks also compiles its loss with inductor, a C++ build per test on CPU: this
    checks the tracing on the block alone, with the blockwise recipe: ~15 s of tracing on this CPU.)"""
    recipe = "fp8_blockwise"
    torch._dynamo.reset()
    block = tm.flavor("llama3", "debug").build().layers["0"].feed_forward
    LinearConversion(recipe, ("w1", "w2", "w3")).apply(block)
    x = torch.randn(2, 40, 256, requires_grad=True)
    eager_y = block(x)
    eager_grads = torch.autograd.grad(eager_y.square().sum(), [x, block.w1.weight, block.w2.weight])
    compiled = torch.compile(block, backend="aot_eager", fullgraph=True)
    y = compiled(x)
    grads = torch.autograd.grad(y.square().sum(), [x, block.w1.weight, block.w2.weight])
    torch.testing.assert_close(y, eager_y, rtol=1e-6, atol=1e-7)
    for got, want in zip(grads, eager_grads):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)


def _cpu_rowwise_scaled_mm_available() -> bool:
    """Whether this torch's CPU torch._scaled_mm takes one scale per row (2.14's does; 2.11's, the H200's, takes
    one per tensor only, as test_quantize.py's layout test found)."""
    a = torch.zeros(16, 16).to(torch.float8_e4m3fn)
    try:
        torch._scaled_mm(a, a.t(), scale_a=torch.ones(16, 1), scale_b=torch.ones(1, 16), out_dtype=torch.bfloat16)
    except (RuntimeError, NotImplementedError):
        return False
    return True


_NEEDS_CPU_ROWWISE = pytest.mark.skipif(not _cpu_rowwise_scaled_mm_available(),
                                        reason="this torch's CPU torch._scaled_mm takes per-tensor scales only")


@pytest.mark.parametrize("recipe", ["fp8_tensorwise", pytest.param("fp8_rowwise", marks=_NEEDS_CPU_ROWWISE), "mxfp8"])
def test_compiled_gemms_stay_the_kernels_eager_runs(recipe):
    """The class of the compiled-GPU bug (below): traced as aten ops (torch._scaled_mm, MX's dequantise + mm),
    the fp8 GEMMs were Inductor's to lower again (its own Triton scaled-mm templates, fusion of the fp8 casts
    into the GEMM's producers), so compiled training did not run the kernels the GPU GEMM tests check. Each
    GEMM of the forward and of the backward must reach the compiler as one opaque titan_train op, never as a
    matmul it could rewrite; and the compiled run (the GPU path, backend "kernels", on CPU) equals eager bit
    for bit. Control (run by hand): with the two GEMMs as plain functions, as before, both graphs hold
    aten._scaled_mm / aten.mm and the check fails. ~7 s per recipe (aot_eager tracing)."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    from titan_train.quantize import RECIPES, quantized_linear

    graphs = []

    def record(gm, example_inputs):
        graphs.append({str(n.target) for n in gm.graph.nodes if n.op == "call_function"})
        return make_boxed_func(gm.forward)

    torch._dynamo.reset()
    g = torch.Generator().manual_seed(3)
    x = torch.randn(64, 256, generator=g, requires_grad=True)
    w = (torch.randn(128, 256, generator=g) * 0.05).requires_grad_()

    def f(x, w):
        return quantized_linear(x, w, RECIPES[recipe], out_dtype=torch.float32, backend="kernels")
    eager = f(x, w)
    eager_grads = torch.autograd.grad(eager.square().sum(), [x, w])
    compiled = torch.compile(f, backend=aot_autograd(fw_compiler=record, bw_compiler=record), fullgraph=True)
    y = compiled(x, w)
    grads = torch.autograd.grad(y.square().sum(), [x, w])
    assert len(graphs) == 2  # forward, backward
    ops = ("titan_train.fp8_scaled_mm", "titan_train.mx_dequantized_mm")
    for targets in graphs:
        assert not any(t.startswith(("aten._scaled_mm", "aten.mm", "aten.addmm", "aten.bmm")) for t in targets), targets
        assert sum(t.startswith(ops) for t in targets) >= 1, targets
    assert torch.equal(y, eager) and all(torch.equal(a, b) for a, b in zip(grads, eager_grads))


@pytest.mark.parametrize(("recipe", "reuse", "passes"), [("fp8_tensorwise", True, 5), ("fp8_tensorwise", False, 10),
                                                       ("fp8_rowwise", True, 10)],
                         ids=["tensorwise", "tensorwise-control", "rowwise"])
def test_compiled_linears_on_one_input_make_the_fewest_amax_passes(recipe, reuse, passes, monkeypatch):
    """Two Linears on one input (wq/wk/wv, w1/w3), traced and partitioned as Inductor does (min-cut, whose CSE
    merges the shared input's quantisation): each amax is a read of a whole matrix. Tensorwise needs five (x, W1,
    W2 in the forward; dy1, dy2 in the backward: x^T, W^T and dy^T reuse their exponents); rowwise ten (x, W1,
    W2; dy1, dy2, dy1^T, dy2^T, W1^T, W2^T and one x^T: a column's scale is no row's). Control: without the reuse
    tensorwise makes rowwise's ten. ~3 s each (aot tracing)."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.partitioners import min_cut_rematerialization_partition

    import titan_train.quantize.quantized_matmul as qm
    from titan_train.quantize import RECIPES, quantized_linear

    if not reuse:
        monkeypatch.setattr(qm, "_reused_exponent", lambda *args: None)
    amaxes = []

    def record(gm, example_inputs):
        amaxes.append(sum(str(n.target) == "aten.amax.default" for n in gm.graph.nodes))
        return make_boxed_func(gm.forward)

    torch._dynamo.reset()
    w1, w2 = (torch.randn(128, 64, requires_grad=True) for _ in range(2))

    def f(x):
        r = RECIPES[recipe]
        return quantized_linear(x, w1, r, out_dtype=torch.float32) * quantized_linear(x, w2, r, out_dtype=torch.float32)
    backend = aot_autograd(fw_compiler=record, bw_compiler=record, partition_fn=min_cut_rematerialization_partition)
    torch.compile(f, backend=backend, fullgraph=True)(torch.randn(32, 64, requires_grad=True)).sum().backward()
    assert len(amaxes) == 2 and sum(amaxes) == passes, amaxes


@_NEEDS_CPU_ROWWISE
@pytest.mark.parametrize("policy_knows_the_op", [True, False], ids=["policy", "control"])
def test_selective_checkpointing_keeps_the_fp8_gemm_output(policy_knows_the_op, monkeypatch):
    """Op-level selective checkpointing (parallelize._op_sac_policy) saves the fp8 GEMMs, now custom ops, as it
    saves matmuls: the backward runs the input and weight gradient GEMMs and does not recompute the forward's
    (counted below the checkpoint's own dispatch mode). Control: a policy that does not list the op recomputes
    it (3 GEMMs)."""
    from functools import partial

    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts

    from titan_train import parallelize
    from titan_train.quantize import RECIPES, quantized_linear

    class CountGemms(TorchDispatchMode):
        calls = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            CountGemms.calls += str(func).startswith("titan_train.fp8_scaled_mm")
            return func(*args, **(kwargs or {}))

    policy = parallelize._op_sac_policy()
    if not policy_knows_the_op:
        from torch.utils.checkpoint import CheckpointPolicy

        full_policy = policy
        policy = lambda ctx, op, *a, **k: (CheckpointPolicy.PREFER_RECOMPUTE  # noqa: E731
                                           if str(op).startswith("titan_train") else full_policy(ctx, op, *a, **k))
    x = torch.randn(32, 128, requires_grad=True)
    w = (torch.randn(64, 128) * 0.05).requires_grad_()
    y = checkpoint(lambda x, w: quantized_linear(x, w, RECIPES["fp8_rowwise"], out_dtype=torch.float32,
                                                 backend="kernels"),
                   x, w, use_reentrant=False, context_fn=partial(create_selective_checkpoint_contexts, policy))
    with CountGemms():
        y.square().sum().backward()
    assert CountGemms.calls == (2 if policy_knows_the_op else 3)


def _stored(folder, step: int) -> dict[str, tuple]:
    """name -> (dtype, shape) of every tensor rank 0 wrote in checkpoint `step`."""
    from concurrent.futures import ThreadPoolExecutor

    from torch_checkpointing import LocalStorage
    from torch_checkpointing.reader import StepReader

    with ThreadPoolExecutor(1) as pool:
        reader = StepReader(LocalStorage(str(folder / "checkpoints")), step, verify=False, io_pool=pool, world_size=1)
        entries = [reader.stored(0, name) for name in reader.record(0)["stored"]]
        return {entry.name: (entry.dtype, entry.shape) for entry in entries}


def test_checkpoints_hold_the_same_entries_as_an_unquantised_run(tmp_path, jobs):
    save = {"training.steps": "2", "checkpoint.interval": "2", "checkpoint.async_save": "false"}
    train(jobs.tiny(tmp_path / "plain", **save))
    train(jobs.tiny(tmp_path / "fp8", **save, **{"quantize.linear": "fp8_blockwise"}))
    plain, fp8 = _stored(tmp_path / "plain", 2), _stored(tmp_path / "fp8", 2)
    assert plain == fp8 and any("feed_forward.w1" in name for name in fp8)
    assert not any(dtype in (torch.float8_e4m3fn, torch.float8_e5m2) for dtype, _ in fp8.values())


FSDP_JOB = {"training.steps": "4", "quantize.linear": "fp8_rowwise"}


@pytest.fixture(scope="module")
def rowwise_4_steps(tmp_path_factory, jobs):
    losses = train(jobs.tiny(tmp_path_factory.mktemp("rowwise4"), **FSDP_JOB)).losses
    unquantised = train(jobs.tiny(tmp_path_factory.mktemp("fp32_4"), **{**FSDP_JOB, "quantize.linear": "none"})).losses
    # control: the tolerance below tells a quantised run from an unconverted one
    assert max(abs(losses[s] - unquantised[s]) / unquantised[s] for s in losses) > 3e-4, (losses, unquantised)
    return losses


TWO_RANK_LAYOUTS = {"fully_shard": {"parallelism.dp_shard": "2", "parallelism.fsdp_impl": "fully_shard"},
                    "flexshard": {"parallelism.dp_shard": "2", "parallelism.fsdp_impl": "flexshard"},
                    "pp2": {"parallelism.pp": "2"}}


@pytest.fixture(scope="module")
def two_rank_curves(tmp_path_factory, jobs) -> dict[str, dict[int, float]]:
    """layout id -> loss curve of FSDP_JOB on 2 gloo ranks, the three runs in one spawn (start-up, not the 4
    steps, is most of each run's cost)."""
    root = tmp_path_factory.mktemp("two_ranks")
    configs = [jobs.tiny(root / name, **FSDP_JOB, **layout) for name, layout in TWO_RANK_LAYOUTS.items()]
    return dict(zip(TWO_RANK_LAYOUTS, jobs.each_on_ranks(configs, 2)))


@pytest.mark.parametrize("layout", TWO_RANK_LAYOUTS)
def test_parallel_runs_on_two_ranks_follow_the_single_process_run(layout, rowwise_4_steps, two_rank_curves):
    """FSDP: rank-sharded weights are gathered whole before each quantised GEMM, so the two-rank run is the
    one-process run up to the order of gradient sums (fp32, ~1e-7), which a quantisation step can turn into an
    e4m3 rounding flip of a few elements: 1e-4 relative over 4 steps still separates that from a wrong gradient
    or an unconverted model (the fixture checks the quantised run departs from fp32 by more; the loss falls by ~2).
    PP2: each rank converts the Linears of its own stages (the pass runs on the rank's part of the model)."""
    curve = two_rank_curves[layout]
    assert sorted(curve) == sorted(rowwise_4_steps)
    for step, ref in rowwise_4_steps.items():
        assert curve[step] == pytest.approx(ref, rel=1e-4), (step, curve, rowwise_4_steps)


def test_the_benchmark_script_runs_on_cpu(tmp_path):
    """tools/bench/fp8/bench.py on the tiny flavor (its GPU figures come from the H200 run): it trains each
    variant and prints the markdown table (~30 s: a fresh process building two Trainers), profiling one more step
    (on CPU the trace holds no device kernels: the breakdown's categories are there, at zero)."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[3]
    env = dict(os.environ, OMP_NUM_THREADS="1", OUT=str(tmp_path))
    out = subprocess.run([sys.executable, str(root / "tools/bench/fp8/bench.py"), "--device", "cpu", "--flavors",
                          "tiny", "--variants", "bf16,fp8_blockwise", "--compile", "false", "--steps", "2",
                          "--profile-steps", "1"],
                         env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "| fp8_blockwise |" in out.stdout and "| bf16 |" in out.stdout
    results = json.loads((tmp_path / "fp8_bench.json").read_text())["results"]["tiny"]
    assert set(results["fp8_blockwise"]["profile"]["per_step_ms"]) >= {"fp8_gemm", "quantize_cast_amax", "optimizer"}


# The compiled-GPU bug, measured on the H200 (torch 2.11, 2026-12-01): with compiled blocks and bf16_params the
# tensorwise, rowwise and MX recipes started at bf16's loss (6.442) but learnt far slower (step 4: 5.67 vs 3.68).
# Its cause was the same-dtype .to ending their GEMMs (quantize/gemm.py::_in_dtype; with that fixed this test
# passed for all four recipes on the H200). The GEMMs are now custom ops as well, so compiled blocks run eager's
# kernels (test_compiled_gemms_stay_the_kernels_eager_runs); the two together are not yet run on a GPU.
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (the fp8 kernels in training)")
@pytest.mark.parametrize("recipe", ["fp8_tensorwise", "fp8_rowwise", "fp8_blockwise", "mxfp8"])
def test_gpu_compiled_training_tracks_bf16(recipe, tmp_path, jobs):
    """On the GPU kernels, bf16 parameters and compiled blocks: 10 steps within 2% of the bf16 run (bf16's own
    rounding, 2^-9 per operation, comes on top of the CPU bound above). Under torch 2.11 the tensorwise, rowwise
    and MX recipes once learned only through their unconverted modules (step 4: 5.67 vs 3.68): their GEMMs
    ended in a same-dtype .to, whose gradients dynamo zeroed (quantize/gemm.py::_in_dtype)."""
    job = {"job.device": "cuda", "training.steps": "10", "training.mixed_precision": "bf16_params",
           "compile.mode": "blocks"}
    bf16 = train(jobs.tiny(tmp_path / "bf16", **job)).losses
    torch._dynamo.reset()
    fp8 = train(jobs.tiny(tmp_path / "fp8", **job, **{"quantize.linear": recipe})).losses
    for step, ref in bf16.items():
        assert fp8[step] == pytest.approx(ref, rel=0.02), (step, fp8, bf16)
    assert fp8[10] < fp8[1] - 1.5


def test_fast_accum_reaches_the_forward_gemm_only():
    """quantize.fast_accum (CLI) sets the scaled_mm recipes' forward GEMM to torch._scaled_mm's use_fast_accum:
    in the traced graphs the forward's titan_train.fp8_scaled_mm takes True, the backward's two take False (their
    sums feed the weights); a recipe with its own GEMM refuses the option. ~3 s (aot tracing)."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    from titan_train.cli import parse_args
    from titan_train.quantize import quantized_linear

    config, _ = parse_args(["--quantize.linear", "fp8_tensorwise", "--quantize.fast_accum", "true"])
    recipe = config.quantize.build().recipe
    assert recipe.forward_fast_accum and recipe.name == "fp8_tensorwise"
    with pytest.raises(ValueError, match="fast_accum"):
        LinearConversion("fp8_blockwise", fast_accum=True)
    flags = []

    def record(gm, example_inputs):
        flags.append([n.args[5] for n in gm.graph.nodes if str(n.target) == "titan_train.fp8_scaled_mm.default"])
        return make_boxed_func(gm.forward)

    torch._dynamo.reset()
    w = torch.randn(128, 64, requires_grad=True)

    def f(x):
        return quantized_linear(x, w, recipe, out_dtype=torch.float32, backend="kernels")
    torch.compile(f, backend=aot_autograd(fw_compiler=record, bw_compiler=record), fullgraph=True)(
        torch.randn(32, 64, requires_grad=True)).sum().backward()
    assert flags == [[True], [False, False]], flags
