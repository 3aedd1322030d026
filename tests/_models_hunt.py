"""Tiny models for the hunt and reproducer tests, at module level so a reproducer can rebuild them by class path.

Each forward writes the arithmetic out by hand (CPU LayerNorm/softmax compute in float32 internally and would
not overflow); the tests find the exact line numbers with :func:`line_of`.
"""

from __future__ import annotations

import inspect

import torch
from torch import nn


def line_of(obj: object, text: str) -> int:
    """The line number (in its file) of the first source line of ``obj`` that contains ``text``."""
    lines, start = inspect.getsourcelines(obj)  # type: ignore[arg-type]
    hits = [start + i for i, line in enumerate(lines) if text in line]
    assert len(hits) == 1, (text, hits)
    return hits[0]


class HandLayerNorm(nn.Module):
    """LayerNorm written out: in float16 ``(x - mean) ** 2`` overflows for |x - mean| > 256, the variance is
    inf and the output is 0 (finite): the module boundary shows nothing."""

    def __init__(self, d: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(d))
        self.bias = nn.Parameter(torch.zeros(d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mean = x.mean(-1, keepdim=True)
        var = ((x - mean) ** 2).mean(-1, keepdim=True)
        return (x - mean) / torch.sqrt(var + self.eps) * self.weight + self.bias


class NormNet(nn.Module):
    """``proj`` (identity-ish Linear) then ``norm`` (:class:`HandLayerNorm`)."""

    def __init__(self, d: int = 4) -> None:
        super().__init__()
        self.proj = nn.Linear(d, d)
        self.norm = HandLayerNorm(d)
        with torch.no_grad():
            self.proj.weight.copy_(torch.eye(d))
            self.proj.bias.zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.proj(x))


class CosineSimilarity(nn.Module):
    """cos(a, b) from products and sums: ``|a|² = sum(a * a)`` overflows float16 long before ``a · b`` does,
    so a large ``a`` gives ``a·b / inf = 0``."""

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        dot = (a * b).sum(-1)
        na = (a * a).sum(-1).sqrt()
        nb = (b * b).sum(-1).sqrt()
        return dot / (na * nb)


class SimNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.sim = CosineSimilarity()

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return self.sim(a, b)


class ExpGate(nn.Module):
    """``where(x < 10, exp(x), x)``: the discarded branch is inf where x is large; the forward is finite, the
    backward is ``0 · inf = NaN`` in exp's gradient."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.where(x < 10, torch.exp(x), x)


class GateNet(nn.Module):
    def __init__(self, d: int = 4) -> None:
        super().__init__()
        self.fc = nn.Linear(d, d)
        self.gate = ExpGate()
        with torch.no_grad():
            self.fc.weight.copy_(torch.eye(d))
            self.fc.bias.zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.gate(self.fc(x))


def t5_model(half: bool = True) -> nn.Module:
    """CASES C01 (``tests/test_cases.py``): ``ff.wo`` has weights 1.0, so inputs of 1100 give ≈7e4 (inf in
    float16); ``norm`` (hand-written RMSNorm) turns that inf into NaN."""
    from test_cases import C01Model

    m = C01Model()
    with torch.no_grad():
        m.ff.wi.weight.fill_(1 / 16)
        m.ff.wi.bias.zero_()
        m.ff.wo.weight.fill_(1.0)
        m.ff.wo.bias.zero_()
    return m.half() if half else m


class Healthy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.norm = HandLayerNorm(4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(torch.relu(self.fc(x)))


class ZeroDivGrad(torch.autograd.Function):
    """Forward ``2x``; a hand-written backward that divides by ``x - x`` (0): +inf for a positive gradient."""

    @staticmethod
    def forward(ctx: torch.autograd.function.FunctionCtx, x: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x)
        return x * 2

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, g: torch.Tensor) -> torch.Tensor:
        (x,) = ctx.saved_tensors  # type: ignore[attr-defined]
        return g / (x - x)


class FnMod(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ZeroDivGrad.apply(x)  # type: ignore[no-any-return]


class FnNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.f = FnMod()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.f(self.lin(x))


class SqrtGate(nn.Module):
    """``where(x > 0, sqrt(x), 0)``: finite forward; at x = 0 sqrt's gradient is 1/0 = inf and where sends it
    a 0, so the backward is 0/0 = NaN (float32 too)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.where(x > 0, torch.sqrt(x), torch.zeros_like(x))


class CheckpointNet(nn.Module):
    """An identity Linear, then :class:`SqrtGate` under activation checkpointing."""

    def __init__(self, reentrant: bool) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.g = SqrtGate()
        self.reentrant = reentrant
        with torch.no_grad():
            self.lin.weight.copy_(torch.eye(4))
            self.lin.bias.zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torch.utils.checkpoint import checkpoint

        h = torch.relu(self.lin(x))
        return checkpoint(self.g, h, use_reentrant=self.reentrant)  # type: ignore[no-any-return]


class SqrtNet(nn.Module):
    """An identity Linear, then :class:`SqrtGate` (float32: a backward NaN that is no overflow)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.g = SqrtGate()
        with torch.no_grad():
            self.lin.weight.copy_(torch.eye(4))
            self.lin.bias.zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.g(self.lin(x))


class Boom(nn.Module):
    """``x * 1000``: parameter-free; in float16 inputs of 100 give 1e5 = inf."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * 1000.0


class FirstSecond(nn.Module):
    """A submodule literally named ``first`` (an identity Linear, clean) and ``second`` (:class:`Boom`)."""

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(2, 2)
        self.second = Boom()
        with torch.no_grad():
            self.first.weight.copy_(torch.eye(2))
            self.first.bias.zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.second(self.first(x))
