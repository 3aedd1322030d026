"""Advice for a non-finite loss from finite model outputs is decided from the outputs' recorded range: which
common loss op (a square, a sum of squares, exp, log of a softmax) leaves the dtype's range, in the outputs'
own narrow dtype and in float32; never a fixed "use log_softmax" for every loss."""

from __future__ import annotations

import torch
from conftest import records_frame
from torch import nn

import nantrace
from nantrace._evidence import loss_advice, loss_bounds


def _outs(**stats: float) -> object:
    return records_frame(
        [{"phase": "forward", "module": "", "tensor": "output", "dtype": "float16", "numel": 512, **stats}]
    )


def test_loss_bounds_name_each_op_that_leaves_float16_from_the_output_range() -> None:
    outs = _outs(min=-18.5, max=19.0, absmax=19.0)
    assert loss_bounds(outs, "float16") == [
        ("sum_squares", "a sum of squares over their 512 elements can reach 184832, beyond 65504"),
        ("exp", "exp of their largest value 19 is 1.785e+08, beyond 65504"),
        (
            "softmax",
            "their values span 37.5 (min -18.5, max 19), so a softmax probability can be below the smallest "
            "subnormal 5.96e-08 and round to 0 (log(0) = -inf)",
        ),
    ]
    assert loss_bounds(outs, "float32") == []


def test_loss_bounds_square_of_one_value_beyond_the_max_is_named_instead_of_the_sum() -> None:
    outs = _outs(min=0.5, max=300.0, absmax=300.0)
    assert [op for op, _ in loss_bounds(outs, "float16")] == ["square", "exp", "softmax"]
    assert loss_bounds(outs, "float16")[0] == (
        "square",
        "the square of their absmax 300 is 90000, beyond 65504",
    )


def test_loss_bounds_small_outputs_leave_no_dtype_and_a_non_float_dtype_gives_nothing() -> None:
    outs = _outs(min=-1.0, max=2.0, absmax=2.0)
    assert loss_bounds(outs, "float16") == []
    assert loss_bounds(outs, "int64") == []


def test_loss_advice_already_float32_loss_names_the_float16_facts_and_the_cast_before_its_first_op() -> None:
    outs = _outs(min=-18.5, max=19.0, absmax=19.0)
    assert loss_advice(outs, "float32") == [
        "The loss is float32, but in float16 a sum of squares over their 512 elements can reach 184832, beyond "
        "65504; exp of their largest value 19 is 1.785e+08, beyond 65504; their values span 37.5 (min -18.5, max "
        "19), so a softmax probability can be below the smallest subnormal 5.96e-08 and round to 0 (log(0) = "
        "-inf): cast the outputs before the loss's first op (`loss_fn(output.float(), target)`).",
        "For a classification loss, use `F.log_softmax` / `F.cross_entropy` rather than `log(softmax(...))`.",
    ]


def test_loss_advice_when_float32_overflows_too_gives_the_remedy_of_that_op_not_a_wider_dtype() -> None:
    outs = _outs(min=-1.0, max=100.0, absmax=100.0)
    assert loss_advice(outs, "float16") == [
        "Compute the loss in float32 from the model's outputs (`loss_fn(output.float(), target)`): in float16, a "
        "sum of squares over their 512 elements can reach 5120000, beyond 65504; their values span 101 (min -1, max "
        "100), so a softmax probability can be below the smallest subnormal 5.96e-08 and round to 0 (log(0) = -inf).",
        "If the loss takes their exp, even float32 overflows: exp of their largest value 100 is 2.688e+43, beyond "
        "3.403e+38; subtract the row's max before exp (`torch.logsumexp`, `F.log_softmax`).",
        "For a classification loss, use `F.log_softmax` / `F.cross_entropy` rather than `log(softmax(...))`.",
    ]


def test_loss_advice_outputs_in_range_of_every_loss_op_point_at_targets_and_the_loss_own_log() -> None:
    outs = _outs(min=-1.0, max=2.0, absmax=2.0)
    assert loss_advice(outs, "float32") == [
        "No square, sum of squares, exp or softmax of these outputs leaves float16 or float32's range: check the "
        "targets and any log or division in the loss (clamp its argument with an eps)."
    ]


def _amp_run(loss_fn: object, weight_scale: float) -> nantrace.Trace:
    torch.manual_seed(0)
    m = nn.Linear(4, 8)
    with torch.no_grad():
        m.weight.mul_(weight_scale)
    sc = torch.amp.GradScaler("cpu")
    opt = torch.optim.SGD(m.parameters(), lr=0.0)
    with nantrace.trace(m, scaler=sc, optimizer=opt) as tr:
        for _ in range(2):
            x = torch.randn(64, 4)
            with torch.autocast("cpu", dtype=torch.float16):
                loss = loss_fn(m(x))  # type: ignore[operator]
            sc.scale(loss).backward()
            sc.step(opt)
            sc.update()
            opt.zero_grad()
    return tr


def test_a_float16_sum_of_squares_loss_is_told_its_sum_overflows_not_to_use_log_softmax() -> None:
    tr = _amp_run(lambda o: (o * o).sum(), 60.0)
    d = tr.diagnose()
    assert d.cause == "loss"
    outs = tr.records.query("phase == 'forward' and module == '' and step == 0 and tensor == 'output'")
    a, n = float(outs["absmax"].iloc[0]), int(outs["numel"].iloc[0])
    assert n == 512 and n * a * a > 65504 > a * a
    first = d.advice[0]
    assert first.startswith(
        "Compute the loss in float32 from the model's outputs (`loss_fn(output.float(), target)`): in float16, a "
        "sum of squares over their 512 elements can reach "
    )
    assert "softmax" not in first and "log_softmax" not in " ".join(d.advice[:1])
    ov = tr.first_overflow()
    assert ov is not None and str(ov).splitlines()[1].endswith(first)


def test_a_float32_log_of_zero_loss_is_not_told_to_compute_in_float32() -> None:
    tr = _amp_run(lambda o: torch.log(o.float() - o.float()).mean(), 1.0)
    d = tr.diagnose()
    assert d.cause == "loss"
    assert d.overflow is not None and (d.overflow.kind, d.overflow.dtype) == ("inf", "float32")
    assert d.advice == [
        "No square, sum of squares, exp or softmax of these outputs leaves float16 or float32's range: check the "
        "targets and any log or division in the loss (clamp its argument with an eps)."
    ]


def test_a_float16_loss_whose_own_arithmetic_overflows_is_told_to_compute_in_float32() -> None:
    """The outputs are small (no square or exp of them leaves float16), but the loss scales them by 30 before
    squaring: the inf is the loss's own float16 arithmetic. Steps 0–1 were skipped for a scaled gradient while
    the loss was finite, so the skips are not called a symptom of a non-finite loss."""
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(4, 64), nn.LayerNorm(64), nn.Linear(64, 64))
    x, y = torch.randn(64, 4), torch.zeros(64, 64, dtype=torch.float16)
    sc = torch.amp.GradScaler("cpu")
    opt = torch.optim.SGD(m.parameters(), lr=1e-6)
    with nantrace.trace(m, scaler=sc, optimizer=opt) as tr:
        for s in range(4):
            with torch.autocast("cpu", dtype=torch.float16):
                loss = ((m(x) * (1.0 if s < 2 else 30.0) - y) ** 2).sum()
            sc.scale(loss).backward()
            sc.step(opt)
            sc.update()
            opt.zero_grad()
    assert [bool(torch.isfinite(torch.tensor(v))) for v in tr.steps["loss"].tolist()] == [
        True,
        True,
        False,
        False,
    ]
    d = tr.diagnose()
    assert d.cause == "loss"
    assert d.advice[0] == (
        "The loss is float16 and non-finite from finite outputs: an op of the loss itself (a scale, a product, a "
        "sum with the targets) went beyond float16's 65504. Compute it in float32 from the outputs "
        "(`loss_fn(output.float(), target.float())`) and check the targets."
    )
    assert not any("symptom" in e for e in d.evidence)


def test_a_nan_loss_is_told_its_own_causes_first_and_overflow_bounds_only_as_a_way_to_inf_minus_inf() -> None:
    """The bounds are about inf; a NaN loss (the loop multiplied it by NaN, a 0/0) comes first from the loss's
    own arithmetic (found by the new-user check: a NaN loss was told to cast its float16 outputs)."""
    outs = _outs(min=-18.5, max=19.0, absmax=19.0)
    got = loss_advice(outs, "float32", "nan")
    assert got[0] == (
        "A NaN loss from finite outputs is made by the loss's own arithmetic or what it is given: 0/0, 0·inf, the "
        "log or sqrt of a negative, a NaN in the targets or in a factor the loop multiplies the loss by; check those "
        "first."
    )
    assert got[1:] == [
        "If an op of the loss overflowed first (inf − inf is NaN): " + a
        for a in loss_advice(outs, "float32", "inf")
    ]
