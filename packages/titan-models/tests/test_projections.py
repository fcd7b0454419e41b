"""Fused projections: one matmul over concatenated weights gives the separate projections' values and
gradients, and anything that is not a plain Linear is called as itself."""
from __future__ import annotations

import torch
from torch import nn

from titan_models.components.projections import project


def test_fused_projection_matches_separate_linears_values_and_gradients():
    torch.manual_seed(0)
    x = torch.randn(3, 5, 16, dtype=torch.float64, requires_grad=True)
    linears = [nn.Linear(16, n, bias=False).double() for n in (16, 4, 4)]
    fused = project(x, *linears)
    grads_out = [torch.randn_like(t) for t in fused]
    torch.autograd.backward(fused, grads_out)
    fused_grads = [m.weight.grad.clone() for m in linears] + [x.grad.clone()]
    for m in linears:
        m.weight.grad = None
    x.grad = None
    separate = [m(x) for m in linears]
    torch.autograd.backward(separate, grads_out)
    for a, b in zip(fused, separate):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    for a, b in zip(fused_grads, [m.weight.grad for m in linears] + [x.grad]):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_replaced_projections_are_called_as_themselves():
    calls = []

    class Wrapped(nn.Module):  # e.g. an override such as a LoRA or batch-invariant linear
        def __init__(self):
            super().__init__()
            self.inner = nn.Linear(8, 8, bias=False)

        def forward(self, x):
            calls.append(1)
            return self.inner(x)

    x = torch.randn(2, 8)
    plain, wrapped = nn.Linear(8, 8, bias=False), Wrapped()
    out = project(x, plain, wrapped)
    assert calls == [1]
    torch.testing.assert_close(out[0], plain(x))
