"""Issue 17 kind 3: transient infs inside a module call, which never reach a module boundary.

The output is finite (``tanh(inf) = 1`` in a tanh-GELU), or silently zero (``rsqrt(inf) = 0`` in an RMSNorm
without a float32 upcast, ``x / inf = 0`` in a cosine similarity or a cumsum-normalised sequence). The drill-down
replays such a call at op level when the recorded statistics point to it (more zeros out than in, or an input
beyond the square root of its dtype's max) and names the op that made the inf, with its source line, as the
producer, when the inf changed what the call computed. A value that a selection discards is not a forward
fault; the backward NaN it makes names the forward op."""

from __future__ import annotations

import math
from pathlib import Path

import pandas as pd
import torch
from torch import nn

import nantrace


def _line(cls: type, offset: int = 1) -> str:
    """``path:line`` of the ``offset``-th line of ``cls.forward`` (the line holding the op)."""
    code = cls.forward.__code__  # type: ignore[attr-defined]
    return f"{code.co_filename}:{code.co_firstlineno + offset}"


class TanhGELU(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return 0.5 * x * (1.0 + torch.tanh(0.7978845608 * (x + 0.044715 * torch.pow(x, 3))))


class RMSNorm(nn.Module):
    """No float32 upcast: ``x²`` of 300 is 90000 > 65504, so the mean is inf and ``rsqrt(inf) = 0``."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


class Cosine(nn.Module):
    """``a·b / sqrt(|a|²·|b|²)``: |a|² = 8·200² = 320000 > 65504 is inf, so the similarity is a silent 0."""

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return (a * b).sum(-1) / torch.sqrt((a * a).sum(-1) * (b * b).sum(-1))


class CumNorm(nn.Module):
    """``x / cumsum(x)`` over a sequence of 30000s: the running sum passes 65504 at the third position."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x / torch.cumsum(x, dim=1)


class Discard(nn.Module):
    """``where(p < 0.5, log(0.5 - p) ... )``: log of 0 where p = 0.5 is -inf in an entry that ``where``
    discards, so the output is the same whatever finite value it had; its backward is 0·inf = NaN."""

    def forward(self, p: torch.Tensor) -> torch.Tensor:
        y = torch.log(0.5 - p)
        return torch.where(p < 0.5, y, torch.zeros_like(y))


class Wrap(nn.Module):
    """An identity Linear ``fc`` (weights the identity, bias 0), then the module under test as ``inner`` (on
    ``h`` and ``h / 100`` when ``pair``)."""

    def __init__(self, inner: nn.Module, pair: bool = False) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.inner = inner
        self.pair = pair
        with torch.no_grad():
            self.fc.weight.copy_(torch.eye(8))
            self.fc.bias.zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        return self.inner(h, h * 0.01) if self.pair else self.inner(h)


def _run(inner: nn.Module, x: torch.Tensor, *, pair: bool = False) -> tuple[nantrace.Trace, torch.Tensor]:
    m = Wrap(inner, pair).half()
    with nantrace.trace(m) as tr:
        out = m(x)
        out.float().sum().backward()
    return tr, out.detach()


def _where(ov: nantrace.Overflow | None) -> tuple | None:
    return None if ov is None else (ov.step, ov.phase, ov.module, ov.call, ov.tensor, ov.kind)


def _ops(tr: nantrace.Trace) -> list[list]:
    return tr.ops[["module", "call", "op", "kind", "source", "reaches"]].values.tolist()


def _full(value: float, rows: int = 2) -> torch.Tensor:
    return torch.full((rows, 8), value, dtype=torch.float16)


def test_tanh_gelu_pow_inf_saturated_by_tanh_is_the_producer() -> None:
    """x = 300: x³ is inf, tanh(inf) = 1, the output is a finite 300 (the input beyond sqrt(65504) = 256 is
    the recorded signal); the backward's 3·x² = inf times tanh's zero gradient is NaN. The producer is the
    forward `pow`, kind inf, at its line."""
    tr, out = _run(TanhGELU(), _full(300.0))
    assert bool(torch.isfinite(out).all()) and float(out.max()) == 300.0
    rec = tr.records
    bwd = rec[(rec["phase"] == "backward") & (rec["module"] == "inner") & (rec["tensor"] == "grad_input[0]")]
    assert int(bwd["n_nan"].iloc[0]) == 16  # without the drill-down this would be the first non-finite value
    ov = tr.first_overflow()
    assert _where(ov) == (0, "forward", "inner", 0, "output", "inf")
    assert _ops(tr) == [["inner", 0, "pow", "posinf", _line(TanhGELU), True]]
    assert (
        f"produced +inf in `pow` at {_line(TanhGELU)} inside its forward (float16), from finite inputs (input absmax 300)"
        in str(ov)
    )


def test_rmsnorm_without_upcast_silent_zero_is_the_producer() -> None:
    """Row 0 of 300s: x² = 90000 is inf, rsqrt(inf) = 0, the row is silently 0 (8 zeros out, none in)."""
    x = _full(300.0)
    x[1] = 1.0
    tr, out = _run(RMSNorm(), x)
    assert float(out[0].abs().max()) == 0.0 and float(out[1].min()) == 1.0
    assert _where(tr.first_overflow()) == (0, "forward", "inner", 0, "output", "inf")
    assert _ops(tr) == [["inner", 0, "pow", "posinf", _line(RMSNorm, 1), True]]
    assert tr.first_overflow(kind="nan") is None  # the backward of rsqrt's saturated zero stays finite here


def test_cosine_similarity_squared_norms_overflow_is_the_producer() -> None:
    """a = h = 200, b = h/100: a·b = 3200, |a|² = 320000 is inf (the `sum`), the similarity a silent 0."""
    tr, out = _run(Cosine(), _full(200.0), pair=True)
    assert out.tolist() == [0.0, 0.0]
    assert _where(tr.first_overflow()) == (0, "forward", "inner", 0, "output", "inf")
    assert _ops(tr) == [["inner", 0, "sum", "posinf", _line(Cosine, 1), True]]


def test_cumsum_over_a_long_sequence_is_the_producer() -> None:
    """30000 · 3 = 90000 > 65504 at the third position: x / inf = 0 from there on (6 zeros in a row of 8)."""
    tr, out = _run(CumNorm(), _full(30000.0, rows=1))
    assert int((out == 0).sum()) == 6
    assert _where(tr.first_overflow()) == (0, "forward", "inner", 0, "output", "inf")
    assert _ops(tr) == [["inner", 0, "cumsum", "posinf", _line(CumNorm, 1), True]]


def test_a_discarded_value_is_not_a_forward_fault_its_backward_nan_names_the_op() -> None:
    """log(0) = -inf where p = 0.5, discarded by `where`: the replays with 0, 65504 and -65504 in its place give
    the same output, so ``reaches`` is False, and the fault is the backward NaN (0·inf) of `inner`."""
    m = Wrap(Discard()).half()
    p = torch.tensor([[0.1, 0.2, 0.5, 0.3, 0.1, 0.1, 0.1, 0.1]], dtype=torch.float16)
    with nantrace.trace(m) as tr:
        m(p).float().sum().backward()
    assert _ops(tr) == [["inner", 0, "log", "neginf", _line(Discard, 1), False]]
    ov = tr.first_overflow()
    assert _where(ov) == (0, "backward", "inner", 0, "grad_input[0]", "nan")
    assert "made by `log`" in str(ov)


def test_healthy_calls_with_large_inputs_and_relu_zeros_name_nothing() -> None:
    """Inputs of 300 through an identity Linear and a ReLU (half its outputs 0): the signals fire, the replays
    find no inf, so nothing is reported and the ops table stays empty."""
    m = nn.Sequential(nn.Linear(8, 8), nn.ReLU()).half()
    with torch.no_grad():
        m[0].weight.copy_(torch.eye(8))
        m[0].bias.zero_()
    x = torch.full((2, 8), 300.0, dtype=torch.float16)
    x[:, ::2] = -300.0
    with nantrace.trace(m) as tr:
        m(x).float().sum().backward()
    assert tr.first_overflow() is None
    assert len(tr.ops) == 0


def test_a_transient_producer_is_the_same_after_save_and_load(tmp_path: Path) -> None:
    tr, _ = _run(RMSNorm(), _full(300.0))
    tr.save(tmp_path / "t.parquet")
    back = nantrace.load(tmp_path / "t.parquet")
    pd.testing.assert_frame_equal(
        back.ops.reset_index(drop=True), tr.ops.reset_index(drop=True), check_dtype=False
    )
    assert str(back.first_overflow()) == str(tr.first_overflow())
    assert not math.isnan(float(back.records["absmax"].max()))
