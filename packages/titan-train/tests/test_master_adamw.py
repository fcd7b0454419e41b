"""MasterWeightAdamW and training.mixed_precision=bf16_params: torch's AdamW arithmetic on the fp32 masters,
state that survives a checkpoint in fp32, a resumed run equal to the uninterrupted one, clear refusals."""
from __future__ import annotations

import pytest
import torch

from titan_train import train
from titan_train.master_adamw import MasterWeightAdamW

HP = {"lr": 1e-2, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}


def _params(seed: int) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(*shape, generator=g)) for shape in ((7, 5), (11,), (3, 4, 2))]


def test_fp32_params_follow_torch_adamw():
    ours, theirs = _params(0), _params(0)
    mine = MasterWeightAdamW(ours, param_dtype=torch.float32, **HP)
    reference = torch.optim.AdamW(theirs, foreach=False, **HP)
    g = torch.Generator().manual_seed(1)
    for _ in range(5):
        for a, b in zip(ours, theirs):
            a.grad = torch.randn(a.shape, generator=g)
            b.grad = a.grad.clone()
        mine.step()
        reference.step()
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(mine.state[a]["master"], b.detach(), rtol=1e-6, atol=1e-7)


def test_bf16_params_are_the_rounded_masters_and_the_state_reloads_in_fp32():
    params = _params(2)
    initial = [p.detach().clone() for p in params]
    optimizer = MasterWeightAdamW(params, **HP)
    assert all(p.dtype == torch.bfloat16 for p in params)
    assert all(torch.equal(optimizer.state[p]["master"], x) for p, x in zip(params, initial))  # no rounding
    for p in params:
        p.grad = torch.randn(p.shape).bfloat16()
    optimizer.step()
    for p in params:
        master = optimizer.state[p]["master"]
        assert master.dtype == torch.float32 and torch.equal(p.detach(), master.bfloat16())
    saved = optimizer.state_dict()
    fresh_params = _params(3)
    fresh = MasterWeightAdamW(fresh_params, **HP)
    fresh.load_state_dict(saved)
    for p, q in zip(params, fresh_params):
        for key in ("master", "exp_avg", "exp_avg_sq"):
            assert fresh.state[q][key].dtype == torch.float32  # torch's load would have rounded to bf16
            assert torch.equal(fresh.state[q][key], optimizer.state[p][key])
        assert int(fresh.state[q]["step"]) == 1
    with pytest.raises(TypeError, match="fp32 parameters"):
        MasterWeightAdamW([torch.nn.Parameter(torch.zeros(3, dtype=torch.bfloat16))], **HP)


def _bf16(x: torch.Tensor) -> torch.Tensor:
    """x rounded to the nearest bf16 (ties to even), back in x's dtype."""
    return x.to(torch.bfloat16).to(x.dtype)


def test_bf16_moments_follow_a_float64_adamw_that_rounds_its_moments():
    """optimizer.moment_dtype=bfloat16: each step is AdamW in (at least) fp32 from the bf16-stored moments; the
    update uses the new moments before they are rounded to nearest bf16 for storage (as torch's fused AdamW
    does for bf16 moments); the master is fp32. Reference: the same recurrence in float64."""
    params = _params(4)
    initial = [p.detach().double() for p in params]
    optimizer = MasterWeightAdamW(params, moment_dtype=torch.bfloat16, **HP)
    lr, (beta1, beta2), eps, wd = HP["lr"], HP["betas"], HP["eps"], HP["weight_decay"]
    master = [x.clone() for x in initial]
    m, v = [torch.zeros_like(x) for x in initial], [torch.zeros_like(x) for x in initial]
    g = torch.Generator().manual_seed(5)
    for step in range(1, 7):
        for i, p in enumerate(params):
            p.grad = torch.randn(p.shape, generator=g).bfloat16()
            grad = p.grad.double()
            master[i] = master[i] * (1 - lr * wd)
            new_m = m[i] + (1 - beta1) * (grad - m[i])
            new_v = beta2 * v[i] + (1 - beta2) * grad * grad
            master[i] = master[i] - lr / (1 - beta1**step) * new_m / (new_v.sqrt() / (1 - beta2**step) ** 0.5 + eps)
            m[i], v[i] = _bf16(new_m), _bf16(new_v)
        optimizer.step()
    for i, p in enumerate(params):
        state = optimizer.state[p]
        assert state["exp_avg"].dtype == state["exp_avg_sq"].dtype == torch.bfloat16
        assert state["master"].dtype == torch.float32
        # fp32 against float64 can land on the other side of a bf16 rounding boundary: one bf16 step at most
        torch.testing.assert_close(state["exp_avg"].double(), m[i], rtol=2**-7, atol=1e-30)
        torch.testing.assert_close(state["exp_avg_sq"].double(), v[i], rtol=2**-7, atol=1e-30)
        torch.testing.assert_close(state["master"].double(), master[i], rtol=1e-5, atol=1e-6)
    # control: the fp32-moment optimizer on the same gradients ends elsewhere (the option has an effect)
    fp32_params = _params(4)
    fp32 = MasterWeightAdamW(fp32_params, **HP)
    g = torch.Generator().manual_seed(5)
    for _ in range(6):
        for p in fp32_params:
            p.grad = torch.randn(p.shape, generator=g).bfloat16()
        fp32.step()
    assert not torch.equal(fp32.state[fp32_params[0]]["exp_avg"].bfloat16(), optimizer.state[params[0]]["exp_avg"]) \
        or not torch.equal(fp32.state[fp32_params[0]]["master"], optimizer.state[params[0]]["master"])


def test_bf16_moments_reload_as_bf16_and_fp32_checkpoints_load_into_them():
    params = _params(6)
    optimizer = MasterWeightAdamW(params, moment_dtype=torch.bfloat16, **HP)
    for p in params:
        p.grad = torch.randn(p.shape).bfloat16()
    optimizer.step()
    fresh_params = _params(7)
    fresh = MasterWeightAdamW(fresh_params, moment_dtype=torch.bfloat16, **HP)
    fresh.load_state_dict(optimizer.state_dict())
    for p, q in zip(params, fresh_params):
        assert fresh.state[q]["master"].dtype == torch.float32
        for key in ("exp_avg", "exp_avg_sq"):
            assert fresh.state[q][key].dtype == torch.bfloat16
            assert torch.equal(fresh.state[q][key], optimizer.state[p][key])
    fp32 = MasterWeightAdamW(_params(8), **HP)  # a run saved with fp32 moments resumes with bf16 ones
    fresh.load_state_dict(fp32.state_dict())
    assert all(fresh.state[q]["exp_avg_sq"].dtype == torch.bfloat16 for q in fresh_params)
    with pytest.raises(TypeError, match="float32 or bfloat16"):
        MasterWeightAdamW(_params(9), moment_dtype=torch.float16, **HP)


def test_bf16_moments_train_and_need_bf16_params(tmp_path, jobs):
    job = {"training.mixed_precision": "bf16_params", "optimizer.moment_dtype": "bfloat16", "training.steps": "6"}
    assert train(jobs.tiny(tmp_path / "run", **job)).losses[6] < train(jobs.tiny(tmp_path / "run0", **{
        "training.mixed_precision": "bf16_params", "training.steps": "1"})).losses[1]
    with pytest.raises(ValueError, match="optimizer.moment_dtype=bfloat16 applies to .*bf16_params"):
        train(jobs.tiny(tmp_path / "bad", **{"optimizer.moment_dtype": "bfloat16", "training.mixed_precision": "bf16"}))


def test_bf16_params_run_resumes_exactly(tmp_path, jobs):
    job = {"training.mixed_precision": "bf16_params", "lr_schedule.kind": "constant", "checkpoint.interval": "3",
           "checkpoint.resume": "true"}
    whole = train(jobs.tiny(tmp_path / "whole", **job, **{"training.steps": "6"})).losses
    folder = tmp_path / "resumed"
    train(jobs.tiny(folder, **job, **{"training.steps": "3"}))
    resumed = train(jobs.tiny(folder, **job, **{"training.steps": "6"}))
    assert resumed.start_step == 3
    assert [resumed.losses[s] for s in (4, 5, 6)] == [whole[s] for s in (4, 5, 6)]  # bitwise
    assert whole[6] < whole[1]


def test_bf16_params_follows_autocast_bf16(tmp_path, jobs):
    common = {"training.steps": "10"}
    params = train(jobs.tiny(tmp_path / "params", **common, **{"training.mixed_precision": "bf16_params"})).losses
    autocast = train(jobs.tiny(tmp_path / "autocast", **common, **{"training.mixed_precision": "bf16"})).losses
    for step in autocast:  # both round every product to bf16, in slightly different places
        assert params[step] == pytest.approx(autocast[step], rel=2e-2)
    assert params[10] < params[1] - 1.0


@pytest.mark.parametrize("override,match", [
    ({"training.grad_accum_steps": "2"}, "grad_accum_steps=1"),
    ({"optimizer.name": "muon"}, "optimizer.name=adamw"),
])
def test_bf16_params_refuses_what_it_cannot_do(tmp_path, jobs, override, match):
    with pytest.raises(ValueError, match=match):
        train(jobs.tiny(tmp_path, **{"training.mixed_precision": "bf16_params"}, **override))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (the compiled Triton AdamW kernel)")
def test_triton_step_matches_the_torch_step_on_gpu():
    from titan_train.kernels.adamw import adamw_master_step

    torch.manual_seed(0)
    numel = 3_000_001
    initial = [torch.randn(numel, device="cuda"), torch.randn(numel, device="cuda") * 0.1,
               torch.rand(numel, device="cuda") * 1e-3]  # master, exp_avg, exp_avg_sq
    states = {name: [t.clone() for t in initial] for name in ("triton", "torch")}
    grad = torch.randn(numel, device="cuda").bfloat16()
    params = {name: torch.empty(numel, device="cuda", dtype=torch.bfloat16) for name in states}
    for name, use_triton in (("triton", True), ("torch", False)):
        adamw_master_step(params[name], grad, *states[name], step=7, lr=3e-4, beta1=0.9, beta2=0.95, eps=1e-8,
                          weight_decay=0.1, use_triton=use_triton)
    for a, b in zip(states["triton"], states["torch"]):  # the same fp32 arithmetic up to fma contraction
        torch.testing.assert_close(a, b, rtol=1e-6, atol=5e-7)
    mismatched = (params["triton"] != params["torch"]).sum().item()
    assert mismatched <= numel * 1e-4  # bf16 roundings of masters that differ in the last fp32 bit


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (the compiled Triton AdamW kernel)")
def test_triton_step_with_bf16_moments_rounds_like_the_torch_step_on_gpu():
    """The compiled kernel stores the moments rounded to nearest even (Triton's CPU interpreter truncates, so
    only the GPU can check this): against the torch path, which rounds with torch's cast."""
    from titan_train.kernels.adamw import adamw_master_step

    torch.manual_seed(0)
    numel = 3_000_001
    initial = [torch.randn(numel, device="cuda"), (torch.randn(numel, device="cuda") * 0.1).bfloat16(),
               (torch.rand(numel, device="cuda") * 1e-3).bfloat16()]  # master, exp_avg, exp_avg_sq
    states = {name: [t.clone() for t in initial] for name in ("triton", "torch")}
    grad = torch.randn(numel, device="cuda").bfloat16()
    for name, use_triton in (("triton", True), ("torch", False)):
        param = torch.empty(numel, device="cuda", dtype=torch.bfloat16)
        adamw_master_step(param, grad, *states[name], step=7, lr=3e-4, beta1=0.9, beta2=0.95, eps=1e-8,
                          weight_decay=0.1, use_triton=use_triton)
    torch.testing.assert_close(states["triton"][0], states["torch"][0], rtol=1e-6, atol=5e-7)
    for a, b in zip(states["triton"][1:], states["torch"][1:]):
        assert a.dtype == torch.bfloat16
        assert (a != b).sum().item() <= numel * 1e-4  # fp32 results a last bit apart may round apart
