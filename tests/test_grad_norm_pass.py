"""``steps.grad_norm`` is taken once per backward pass, when it ends, over the gradients the step's parameter
hooks saw: of mixed dtypes, accumulated over micro-steps, before the loop clips them."""

from __future__ import annotations

import math

import torch
from torch import nn

import nantrace


class _Mixed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(3, 3).double()
        self.b = nn.Linear(3, 3)
        self.c = nn.Linear(3, 2).half()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c(self.b(self.a(x.double()).float()).half()).float()


def _reference(model: nn.Module) -> float:
    return math.sqrt(
        sum(float(p.grad.double().pow(2).sum()) for p in model.parameters() if p.grad is not None)
    )


def test_grad_norm_over_mixed_dtypes_and_micro_steps_is_the_accumulated_gradients_before_clipping() -> None:
    torch.manual_seed(0)
    model = _Mixed()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    expected = []
    with nantrace.trace(model, optimizer=opt) as tr:
        for step in range(2):
            opt.zero_grad()
            for micro in range(2):  # two backward passes accumulate into .grad
                model(torch.full((4, 3), 0.5 + step + micro)).pow(2).sum().backward()
            expected.append(_reference(model))
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-3)
            opt.step()
    got = tr.steps["grad_norm"].tolist()
    assert len(got) == 2 and all(math.isclose(g, e, rel_tol=1e-6) for g, e in zip(got, expected, strict=True))
    assert all(e > 1.0 for e in expected)  # so the clipped norm (1e-3) would show
    applied = tr.steps["applied_grad_norm"].tolist()
    assert all(math.isclose(a, 1e-3, rel_tol=1e-3) for a in applied)
