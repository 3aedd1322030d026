"""The evidence engine (``nantrace._evidence``): each op class on a tiny float16 model whose fault is explicit
arithmetic (``rsqrt(0)``, ``log(0)``, ``x / 0``, ``0 ** -1``, a value past 65504, a finfo.min mask), with the
exact op, class, cause and headline; ``str(Overflow)`` and ``tr.diagnose()`` agree on each."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

import nantrace
from nantrace._evidence import Operand, OpEvidence, call_arity, op_evidence

H = torch.float16
ONE = torch.ones(2, 4, dtype=H)
RAMP = torch.tensor([[1.0, 3.0, 5.0, 1.0]], dtype=H)  # RAMP - 1 holds two zeros and finite values


class Body(nn.Module):
    """A hand-written module computing ``f`` (its forward is a sequence of ops)."""

    def __init__(self, f: Callable[..., torch.Tensor]) -> None:
        super().__init__()
        self.f = f

    def forward(self, *xs: torch.Tensor) -> torch.Tensor:
        return self.f(*xs)


class Net(nn.Module):
    def __init__(self, f: Callable[..., torch.Tensor]) -> None:
        super().__init__()
        self.body = Body(f)

    def forward(self, *xs: torch.Tensor) -> torch.Tensor:
        return self.body(*xs)


def _rms_eps_1e12(x: torch.Tensor) -> torch.Tensor:
    centred = x - x.mean(-1, keepdim=True)
    return x * torch.rsqrt(centred.pow(2).mean(-1, keepdim=True) + 1e-12)  # 1e-12 is 0 in float16


def _layernorm_eps_1e12(x: torch.Tensor) -> torch.Tensor:
    centred = x - x.mean(-1, keepdim=True)
    return centred / torch.sqrt((centred**2).mean(-1, keepdim=True) + 1e-12)


def _finfo_min_mask(x: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    return x + (1 - keep) * torch.finfo(torch.float16).min  # -100 + -65504 rounds to -inf


def _fully_masked_softmax(x: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    return torch.softmax(x.masked_fill(keep == 0, -math.inf), -1)


SCORES = torch.full((1, 4), -100.0, dtype=H)
KEEP = torch.tensor([[1.0, 1.0, 0.0, 0.0]], dtype=H)

# (name, f, inputs, op, raw kind, class, cause, headline)
CLASSES: list[tuple[str, Callable[..., torch.Tensor], tuple[torch.Tensor, ...], str, str, str, str, str]] = [
    (
        "rsqrt(0) from eps=1e-12",
        _rms_eps_1e12,
        (ONE,),
        "rsqrt",
        "posinf",
        "singular",
        "invalid_op",
        "step 0 forward: `body` (`rsqrt`) hit a singular point: rsqrt of 0 gave +inf (float16)",
    ),
    (
        "log(0)",
        lambda x: torch.log(x - 1),
        (RAMP,),
        "log",
        "neginf",
        "singular",
        "invalid_op",
        "step 0 forward: `body` (`log`) hit a singular point: log of 0 gave -inf (float16)",
    ),
    (
        "x / 0",
        lambda x: x / (x - 1),
        (RAMP,),
        "div",
        "posinf",
        "singular",
        "invalid_op",
        "step 0 forward: `body` (`div`) hit a singular point: x/0 gave +inf (float16)",
    ),
    (
        "pow(0, -1)",
        lambda x: (x - 1).pow(-1),
        (RAMP,),
        "pow",
        "posinf",
        "singular",
        "invalid_op",
        "step 0 forward: `body` (`pow`) hit a singular point: 0 to a negative power gave +inf (float16)",
    ),
    (
        "hand-written LayerNorm, eps=1e-12, constant row",
        _layernorm_eps_1e12,
        (torch.cat([ONE[:1], RAMP]),),
        "div",
        "nan",
        "singular",
        "invalid_op",
        "step 0 forward: `body` (`div`) hit a singular point: 0/0 gave NaN (float16)",
    ),
    (
        "an explicit 0 * inf",
        lambda x: (x - 1) * math.inf,
        (RAMP,),
        "mul",
        "nan",
        "invalid",
        "invalid_op",
        "step 0 forward: `body` (`mul`) made NaN by an invalid operation: 0·inf (float16)",
    ),
    (
        "a value past 65504",
        lambda x: x * 40000.0 * 2,
        (ONE,),
        "mul",
        "posinf",
        "overflow",
        "forward_overflow",
        "step 0 forward: `body` (`mul`) overflowed float16 (+inf)",
    ),
    (
        "cumsum over 2000 values of 40",
        lambda x: torch.cumsum(x * 40, dim=-1),
        (torch.ones(1, 2000, dtype=H),),
        "cumsum",
        "posinf",
        "reduction",
        "forward_overflow",
        "step 0 forward: `body` (`cumsum`) overflowed float16 in a reduction (+inf)",
    ),
    (
        "float32 1e5 cast to float16",
        lambda x: x.half(),
        (torch.full((2, 4), 1e5),),
        "half",
        "posinf",
        "cast",
        "forward_overflow",
        "step 0 forward: `body` (`half`) overflowed in a cast to float16 (+inf)",
    ),
    (
        "float32 1e5 cast to float16 and back",  # the call returns float32: the cast's own target is named
        lambda x: x.half().float(),
        (torch.full((2, 4), 1e5),),
        "half",
        "posinf",
        "cast",
        "forward_overflow",
        "step 0 forward: `body` (`half`) overflowed in a cast to float16 (+inf)",
    ),
    (
        "finfo.min mask added to a negative score",
        _finfo_min_mask,
        (SCORES, KEEP),
        "add",
        "neginf",
        "mask_arithmetic",
        "invalid_op",
        "step 0 forward: `body` (`add`) made -inf by mask arithmetic: finfo.min plus a negative value rounds to "
        "-inf (float16)",
    ),
    (
        "fully masked softmax row",
        _fully_masked_softmax,
        (SCORES, torch.zeros(1, 4, dtype=H)),
        "softmax",
        "nan",
        "mask_arithmetic",
        "invalid_op",
        "step 0 forward: `body` (`softmax`) made NaN by mask arithmetic: a fully masked row (float16)",
    ),
]


def _run(f: Callable[..., torch.Tensor], xs: tuple[torch.Tensor, ...]) -> nantrace.Trace:
    m = Net(f)
    with nantrace.trace(m) as tr:
        m(*xs)
    return tr


@pytest.mark.parametrize(
    ("name", "f", "xs", "op", "raw", "cls", "cause", "head"), CLASSES, ids=[c[0] for c in CLASSES]
)
def test_each_op_class_names_the_op_cause_and_headline(
    name: str, f: Any, xs: Any, op: str, raw: str, cls: str, cause: str, head: str
) -> None:
    tr = _run(f, xs)
    ov = tr.first_overflow()
    assert ov is not None and (ov.phase, ov.module, ov.op_class) == ("forward", "body", cls)
    assert tr.ops[["module", "op", "kind"]].values.tolist() == [["body", op, raw]]
    d = tr.diagnose()
    assert (d.cause, d.op_class, d.overflow) == (cause, cls, ov)
    assert str(ov).splitlines()[0] == head == d.headline
    assert str(d).splitlines()[0] == f"nantrace diagnosis: {cause} · {head}"
    assert d.to_dict()["op_class"] == cls
    if cls == "singular":  # never called an overflow
        assert "overflows above" not in str(ov) and "overflowed" not in str(d)
    if cls == "mask_arithmetic":
        assert "q·kᵀ" not in str(ov) + str(d)


def test_operand_facts_are_the_recorded_numbers() -> None:
    tr = _run(_rms_eps_1e12, (ONE,))
    ov = tr.first_overflow()
    assert ov is not None
    ev = op_evidence(tr._view(), ov)
    assert ev is not None and math.isnan(ev.operands[0].absmin)  # no non-zero |x|: every value is 0
    assert ev == OpEvidence(
        op="rsqrt",
        raw_kind="posinf",
        op_class="singular",
        dtype="float16",
        operands=(Operand("arg0", "float16", 2, 0.0, ev.operands[0].absmin, 2, 0, 0, 0, 0, 0, None, (2, 1)),),
        recorded=True,
        vanished=((1e-12, "float16"),),
        because="its operand arg0 holds 2 zero(s)",
        what="rsqrt of 0",
    )
    lines = str(ov).splitlines()
    assert "operand arg0 (float16, 2 values): absmax 0, 2 zeros" in lines
    assert "the constant 1e-12 rounds to 0 in float16 (smallest float16 subnormal 5.96e-08)" in lines
    assert any(a.startswith("The constant 1e-12 is 0 in float16") for a in tr.diagnose().advice)


def test_a_matmul_bound_beyond_the_max_is_told_to_scale_an_operand_before_the_product() -> None:
    tr = _run(lambda q, k: q @ k.transpose(-1, -2), (torch.full((1, 4, 64), 40.0, dtype=H),) * 2)
    ov = tr.first_overflow()
    assert ov is not None and ov.op_class == "overflow"
    want = (
        "In `body`: `matmul` sums 64 products of operands of absmax 40 and 40 (up to 102400 > 65504): scale an "
        "operand down *before* the product"
    )
    assert any(line.startswith(want) for line in str(ov).splitlines())
    assert any(a.startswith(want) for a in tr.diagnose().advice)


def test_a_reduction_overflow_is_never_told_to_scale_q_k() -> None:
    tr = _run(lambda x: torch.cumsum(x * 40, dim=-1), (torch.ones(1, 2000, dtype=H),))
    d = tr.diagnose()
    assert "q·kᵀ" not in str(d) + str(tr.first_overflow())
    assert d.summary == (
        "`body` (Body) overflowed float16 in its forward at step 0: a cumsum of 2000 finite values (absmax 40) "
        "exceeded 65504."
    )


@pytest.mark.parametrize(
    ("fn", "count"),
    [
        (lambda x: torch.cumsum(x * 40, dim=1), 2000),  # 4 running sums of 2000, not 8000 values
        (lambda x: (x * 40).cumsum(1), 2000),  # the dim passed positionally
        (lambda x: (x * 40).sum(dim=(0, 1)), 8000),
        (lambda x: (x * 40).sum(), 8000),
    ],
    ids=["cumsum dim=1", "cumsum positional dim", "sum over both dims", "sum of all"],
)
def test_a_reduction_counts_the_values_each_result_combines(fn: Any, count: int) -> None:
    tr = _run(fn, (torch.ones(4, 2000, dtype=H),))
    assert f"of {count} finite values (absmax 40) exceeded 65504" in tr.diagnose().summary


def test_inf_minus_inf_from_an_input_holding_inf_is_invalid() -> None:
    class Two(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.big = Body(lambda x: x * 70000)  # +inf
            self.diff = Body(lambda x: x - x)  # inf - inf = NaN

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.diff(self.big(x))

    m = Two()
    with nantrace.trace(m) as tr:
        m(ONE)
    ov = tr.first_overflow(kind="nan")
    assert ov is not None and (ov.module, ov.op_class) == ("diff", "invalid")
    assert str(ov).splitlines()[0] == (
        "step 0 forward: `diff` (`sub`) made NaN by an invalid operation: inf − inf (float16)"
    )
    first = tr.first_overflow()
    assert first is not None and (first.module, first.op_class) == ("big", "overflow")


class TwoArgs(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blk = Body(lambda a, b: a @ b.transpose(-1, -2))

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return self.blk(a, b)


def test_the_float32_snippet_calls_the_module_with_the_arity_it_was_called_with() -> None:
    m = TwoArgs()
    with nantrace.trace(m) as tr, torch.autocast("cpu", dtype=torch.float16):
        m(torch.full((1, 4, 64), 40.0), torch.full((1, 4, 64), 40.0))
    d = tr.diagnose()
    assert d.cause == "forward_overflow" and d.overflow is not None
    assert call_arity(tr._view(), d.overflow) == (2, [])
    assert (
        "Keep `blk` in float32: run it with autocast off, `with torch.autocast(device_type=..., enabled=False): "
        "y = model.blk(x0.float(), x1.float())`."
    ) in d.advice


class LongName(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.add_module("a" * 150, Body(lambda x: x * 40000.0 * 2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return getattr(self, "a" * 150)(x)


def test_headlines_fit_in_160_characters() -> None:
    m = LongName()
    with nantrace.trace(m) as tr:
        m(ONE)
    ov = tr.first_overflow()
    assert ov is not None
    assert len(str(ov).splitlines()[0]) == 160 and str(ov).splitlines()[0].endswith("…")
    assert len(str(tr.diagnose()).splitlines()[0]) == 160


def _mask_then_float32(x: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    return torch.softmax(_finfo_min_mask(x, keep).float(), -1)  # the mask add is float16, the output float32


def test_an_op_of_a_call_with_a_wider_output_is_described_in_the_dtype_it_computed_in() -> None:
    tr = _run(_mask_then_float32, (SCORES, torch.zeros(1, 4, dtype=H)))  # a fully masked row: NaN out
    ov = tr.first_overflow()
    assert ov is not None and (ov.module, ov.dtype, ov.op_class) == ("body", "float32", "mask_arithmetic")
    ev = op_evidence(tr._view(), ov)
    assert ev is not None and (ev.op, ev.dtype) == ("add", "float16")
    text = str(ov) + str(tr.diagnose())
    assert str(ov).splitlines()[0].endswith("rounds to -inf (float16)")
    code = _finfo_min_mask.__code__
    line = f"{code.co_filename}:{code.co_firstlineno + 1}"  # the drill-down names the user's line of the add
    assert (
        f"produced -inf in `add` at {line} inside its forward (float16; the call's output is float32)"
        in str(ov)
    )
    assert "±65504 (torch.finfo(float16).min" in text and "3.403e+38" not in text


def test_mask_advice_names_masked_fill_only_where_the_mask_was_added() -> None:
    added = _run(_finfo_min_mask, (SCORES, KEEP)).diagnose()
    assert added.op_class == "mask_arithmetic" and added.advice[0].startswith(
        "In `body`: apply the mask with `scores.masked_fill(mask, torch.finfo(scores.dtype).min)` rather than "
        "adding or multiplying it"
    )
    row = _run(_fully_masked_softmax, (SCORES, torch.zeros(1, 4, dtype=H))).diagnose()
    assert row.op_class == "mask_arithmetic"
    assert not any("masked_fill(mask" in a for a in row.advice)
    assert row.advice[0].startswith("Keep at least one unmasked key per row")


def _square_then_float32(x: torch.Tensor) -> torch.Tensor:
    return (x * x).float()  # 300 * 300 overflows float16; the call's output is float32


def test_an_overflow_in_a_float16_op_of_a_float32_output_call_quotes_float16s_limit() -> None:
    tr = _run(_square_then_float32, (torch.full((1, 4), 300.0, dtype=H),))
    ov = tr.first_overflow()
    d = tr.diagnose()
    assert ov is not None and (ov.dtype, ov.op_class, d.cause) == ("float32", "overflow", "forward_overflow")
    assert d.evidence[0] == (
        "`body` (Body, call 0) at step 0 turned finite inputs (absmax 300) into inf in float16, whose largest "
        "finite value is 65504"
    )
    assert "float16 overflows above 65504" in str(ov)
    assert "3.403e+38" not in str(ov) + str(d)


def test_an_autocast_linear_is_described_in_the_dtype_it_computed_in() -> None:
    """Under CPU float16 autocast a ``linear`` gets a float16 input and a float32 weight and computes in float16:
    the overflow is float16's (65504), not the widest operand's float32."""
    m = nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 16))
    with torch.no_grad():
        for lin in m:
            lin.weight.fill_(1.0)
            lin.bias.zero_()
    with nantrace.trace(m) as tr, torch.autocast("cpu", dtype=torch.float16):
        m(torch.full((2, 16), 300.0))  # 300·16 = 4800, then 4800·16 = 76800 > 65504
    ov = tr.first_overflow()
    assert ov is not None
    text = str(ov)
    assert text.splitlines()[0] == "step 0 forward: `1` (`linear`) overflowed float16 (+inf)"
    assert (
        "inside its forward (float16), from finite inputs (input absmax 4800); float16 overflows above 65504"
        in text
    )


class _MaskedMean(nn.Module):
    """Per row, the mean of the selected entries; a row that selects nothing is a mean over zero elements."""

    def forward(self, x: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        return torch.stack([x[i][keep[i]].mean(0) for i in range(x.shape[0])])


def test_a_mean_over_an_empty_selection_is_named_with_its_empty_operand_and_a_guard() -> None:
    """Row 2 selects nothing: `mean` of a 0-element tensor is 0/0. The operand facts keep the empty tensor, the
    op is a singular point named as a mean over zero elements, and the advice guards the reduction instead of
    asking to keep an argument away from 0."""

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin, self.pool = nn.Linear(3, 3), _MaskedMean()

        def forward(self, x: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
            return self.pool(self.lin(x), keep)

    keep = torch.ones(3, 4, dtype=torch.bool)
    keep[2] = False
    model = Net()
    with nantrace.trace(model) as tr:
        model(torch.randn(3, 4, 3), keep)
    ov = tr.first_overflow()
    assert ov is not None and (ov.module, ov.kind, ov.op_class) == ("pool", "nan", "singular")
    text = str(ov)
    assert text.splitlines()[0] == (
        "step 0 forward: `pool` (`mean`) hit a singular point: a mean over zero elements (0/0) gave NaN (float32)"
    )
    assert "operand arg0 (float32, 0 values)" in text
    d = tr.diagnose()
    assert d.cause == "invalid_op"
    assert d.advice[0] == (
        "In `pool`: `mean` reduced an empty selection; skip it when nothing is selected, or sum and divide by the "
        "count clamped to 1 (`x.sum(0) / n.clamp_min(1)`)."
    )
