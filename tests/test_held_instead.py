"""A forward event whose op made +inf that left its call as another kind says what the output held."""

from __future__ import annotations

import torch
from torch import nn

import nantrace


class _HandNorm(nn.Module):
    def __init__(self, shift: float) -> None:
        super().__init__()
        self.shift = shift

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mu = x.mean(-1, keepdim=True)
        var = ((x - mu) ** 2).mean(-1, keepdim=True)
        return (x - mu - self.shift) * torch.rsqrt(var)  # a constant row: var 0, rsqrt(0) = +inf


class _Net(nn.Module):
    def __init__(self, shift: float) -> None:
        super().__init__()
        self.ln = _HandNorm(shift)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ln(x)


def _first_line(shift: float) -> str:
    m = _Net(shift)
    x = torch.tensor([[1.0, 1.0, 1.0, 1.0], [1.0, 2.0, 3.0, 4.0]], dtype=torch.float16)
    with nantrace.trace(m) as tr:
        m(x)
    ov = tr.first_overflow()
    assert (ov.phase, ov.module, ov.tensor) == ("forward", "ln", "output")
    d = tr.diagnose()
    assert d.cause == "invalid_op"
    return d.evidence[0]


def test_rsqrt_inf_that_left_as_nan_is_first_seen_as_nan() -> None:
    assert _first_line(0.0) == (
        "`ln` (_HandNorm, call 0) at step 0 produced +inf, first seen as NaN in `output` (float16), from inputs "
        "holding no inf/NaN (finite absmax 4, no -inf)"
    )  # (x - mu) = 0 times +inf: the constant row's 4 outputs are NaN


def test_rsqrt_inf_that_left_as_minus_inf_is_first_seen_as_minus_inf() -> None:
    assert _first_line(1.0) == (
        "`ln` (_HandNorm, call 0) at step 0 produced +inf, first seen as -inf in `output` (float16), from "
        "inputs holding no inf/NaN (finite absmax 4, no -inf)"
    )  # (x - mu - 1) = -1 times +inf
