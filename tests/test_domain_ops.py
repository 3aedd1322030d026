"""Ops whose operands left the op's domain (sqrt of a negative variance, acos past 1, a fractional power of a
negative base), ops infinite at a point (atanh of ±1, fmod by 0), NaN from finite operands of any other op, and a
backward NaN whose forward discarded nothing: each is named by what the recorded operands show, with the fix that
follows from it."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import nn

import nantrace


class Fn(nn.Module):
    """A module whose forward is one function of its input (the op under test runs in it)."""

    def __init__(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        super().__init__()
        self.fn = fn

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fn(x)


def _variance_by_difference(x: torch.Tensor) -> torch.Tensor:
    """E[x²] − E[x]² of a two-column float16 input, by elementwise ops (each one rounded to float16)."""
    m = x[:, 0:1] * 0.5 + x[:, 1:2] * 0.5
    ex2 = x[:, 0:1] * x[:, 0:1] * 0.5 + x[:, 1:2] * x[:, 1:2] * 0.5
    return torch.sqrt(ex2 - m * m)


CASES = {
    # [100, 100.1875] in float16: E[x²] rounds to 10016 (or so) below E[x]², the difference is -8
    "sqrt_of_a_negative_variance": (
        _variance_by_difference,
        torch.tensor([[1.0, 3.0], [100.0, 100.1875]], dtype=torch.float16),
        "step 0 forward: `1` (`sqrt`) went outside its domain: sqrt of a negative value gave NaN (float16)",
        [
            "In `1`: `sqrt` got negative values. If its argument is a variance or a squared norm, which is never "
            "negative in exact arithmetic, the negative comes from cancellation in a difference such as E[x²] − "
            "E[x]²: compute it from deviations (`((x - x.mean()) ** 2).mean()`, `torch.var`) or in float32. "
            "Otherwise clamp it first (`x.clamp_min(0)`, with an eps inside a sqrt whose gradient you need).",
            "Not an overflow: a wider dtype helps only where it removes the cancellation.",
        ],
    ),
    "acos_past_one": (
        torch.acos,
        torch.tensor([1.001, 0.5], dtype=torch.float16),
        "step 0 forward: `1` (`acos`) went outside its domain: acos of a value beyond ±1 gave NaN (float16)",
        [
            "In `1`: `acos` is defined on [-1, 1] only, and its argument's |x| reached 1.001: clamp it first "
            "(`x.clamp(-1 + eps, 1 - eps)`; a cosine or a normalised value can round past 1).",
            "Not an overflow: a wider dtype rounds less but does not remove it without the clamp.",
        ],
    ),
    "fractional_power_of_a_negative_base": (
        lambda x: x**1.5,
        torch.tensor([-0.25, 0.5]),
        "step 0 forward: `1` (`pow`) went outside its domain: a fractional power of a negative value gave NaN "
        "(float32)",
        [
            "In `1`: a fractional power is undefined for a negative base: make the base non-negative before it "
            "(`x.clamp_min(0) ** p`, or `x.abs() ** p * x.sign()` for an odd root).",
            "Not an overflow: a wider dtype does not remove it.",
        ],
    ),
    "atanh_of_one": (
        torch.atanh,
        torch.tensor([1.0, 0.5]),
        "step 0 forward: `1` (`atanh`) hit a singular point: atanh of ±1 gave +inf (float32)",
        [
            "In `1`: `atanh` is infinite at ±1: clamp its argument inside (-1, 1) first (`x.clamp(-1 + eps, 1 - "
            "eps)`).",
            "Not an overflow: a wider dtype does not remove it, unless with an eps it can hold.",
        ],
    ),
    "fmod_by_zero": (
        lambda x: torch.fmod(x, x - 1.0),
        torch.tensor([1.0, 3.0]),
        "step 0 forward: `1` (`fmod`) hit a singular point: x mod 0 gave NaN (float32)",
        [
            "In `1`: keep the divisor of `fmod` away from 0 (`d.clamp_min(eps)`, or skip the entries where it is "
            "0).",
            "Not an overflow: a wider dtype does not remove it, unless with an eps it can hold.",
        ],
    ),
    "another_op_nan_from_finite_operands": (
        lambda x: torch.special.zeta(x, torch.ones_like(x)),  # the Hurwitz zeta needs x > 1: NaN at 0.5
        torch.tensor([0.5, 2.0]),
        "step 0 forward: `1` (`special_zeta`) made NaN by an invalid operation: NaN from finite operands (float32)",
        [
            "In `1`: `special_zeta` gave NaN from the finite operands above: keep them inside its domain (clamp "
            "them first), or compute it in float32 if an intermediate overflowed.",
        ],
    ),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_an_op_outside_its_domain_or_at_its_singular_point_is_named_with_its_own_fix(case: str) -> None:
    fn, x, head, advice = CASES[case]
    m = nn.Sequential(nn.Identity(), Fn(fn))
    with nantrace.trace(m) as tr:
        m(x)
    ov = tr.first_overflow()
    assert ov is not None and (ov.phase, ov.module, ov.tensor) == ("forward", "1", "output")
    assert str(ov).splitlines()[0] == head
    d = tr.diagnose()
    assert d.cause == "invalid_op"
    assert d.advice == advice


def test_under_a_grad_scaler_the_closing_line_says_the_loss_scale_does_not_remove_it() -> None:
    m = nn.Sequential(nn.Linear(2, 2), Fn(torch.acos))
    with torch.no_grad():
        m[0].weight.copy_(torch.eye(2))
        m[0].bias.zero_()
    opt = torch.optim.SGD(m.parameters(), lr=0.0)
    scaler = torch.amp.GradScaler("cpu", init_scale=4.0)
    with nantrace.trace(m, scaler=scaler, optimizer=opt) as tr:
        opt.zero_grad()
        loss = m(torch.tensor([[1.5, 0.5]])).sum()
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
    d = tr.diagnose()
    assert d.advice[-1] == (
        "Not an overflow: a lower loss scale does not remove it, and a wider dtype rounds less but does not remove "
        "it without the clamp."
    )


class PairDistance(nn.Module):
    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return torch.sqrt(((a - b) ** 2).sum(-1))


class TwoViews(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.enc = nn.Linear(4, 8)
        self.dist = PairDistance()

    def forward(self, x1: torch.Tensor, x2: torch.Tensor) -> torch.Tensor:
        return self.dist(self.enc(x1), self.enc(x2))


def test_a_backward_nan_with_no_discarded_op_named_gives_both_kinds_and_their_fixes() -> None:
    """Two identical views: the distance is sqrt(0) = 0 (finite), its derivative 1/(2·sqrt(0)) = inf times
    2·(a − b) = 0 is NaN in backward. No forward op was named, so the text gives both kinds it can be (a value a
    where discarded, a derivative at a kept value) with the fix of each, instead of only the where-recipe."""
    torch.manual_seed(0)
    m = TwoViews()
    opt = torch.optim.SGD(m.parameters(), lr=0.01)
    x = torch.randn(3, 4)
    with nantrace.trace(m, optimizer=opt) as tr:
        opt.zero_grad()
        loss = m(x, x.clone()).sum()
        tr.step(loss=loss)
        loss.backward()
        opt.step()
    ov = tr.first_overflow()
    assert ov is not None and (ov.phase, ov.module, ov.kind) == ("backward", "dist", "nan")
    d = tr.diagnose()
    assert d.cause == "invalid_op"
    assert d.evidence[2:] == [
        "its forward output held 3 exact zero(s) at that step",
        "No forward op is named whose non-finite value the forward discarded (the forward is replayed only when "
        "its recorded statistics point to one), so the NaN comes from one of these kinds: a value a "
        "`torch.where`/mask discarded in forward (log or log1p at 0, x/0) whose derivative is still taken, or a "
        "derivative that is infinite at a finite value the forward kept, times a zero (sqrt or a norm at 0: the "
        "derivative of sqrt(s) is 1/(2·sqrt(s)), inf at s = 0, and inf·0 = NaN; x**p with 0 < p < 1 at 0; acos or "
        "asin at ±1), or an intermediate of the backward beyond its dtype's max (inf − inf)",
    ]
    assert d.advice == [
        "In the backward of `dist`: make the argument safe *before* the op: for a discarded value, "
        "`torch.where(keep, f(torch.where(keep, x, 1.0)), 0.0)`; for a kept one, `(s + eps).sqrt()` for "
        "`s.sqrt()`, `F.normalize(x, eps=1e-6)` or `(x.pow(2).sum(-1) + eps).sqrt()` for `x.norm(dim=-1)`, "
        "`x.clamp_min(eps) ** p` for a fractional power. `nantrace.hunt` on this step names the op.",
        "`torch.autograd.detect_anomaly()` on one step names the exact backward function.",
    ]
    text = str(ov)
    assert "torch.where/mask that discards" not in text
    assert "Not an overflow: no forward op is named whose non-finite value the forward discarded" in text


class LossInside(nn.Module):
    """Computes its loss in its forward, as HF models do with ``labels``."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 5)

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        logits = self.fc(x)
        return {"loss": torch.nn.functional.cross_entropy(logits, labels), "logits": logits}


def test_a_cross_entropy_whose_every_label_is_ignored_is_a_mean_over_no_element() -> None:
    """Step 1's labels are all -100: cross_entropy's mean is 0/0. The drill-down records its integer targets, so
    the event says so and the advice is to skip such a batch; before, 'NaN from finite operands: clamp them or
    compute in float32' (found by the new-user check on GPT-2 with every label -100)."""
    torch.manual_seed(0)
    m = LossInside()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
    with nantrace.trace(m, optimizer=opt) as tr:
        for i in range(2):
            labels = torch.full((3,), -100) if i == 1 else torch.tensor([0, 1, 2])
            opt.zero_grad()
            out = m(torch.randn(3, 4), labels)
            tr.step(loss=out["loss"])
            out["loss"].backward()
            opt.step()
    ov = tr.first_overflow()
    assert ov is not None and (ov.step, ov.phase, ov.module, ov.tensor, ov.kind) == (
        1,
        "forward",
        "",
        "output.loss",
        "nan",
    )
    lines = str(ov).splitlines()
    assert lines[0] == (
        "step 1 forward: the root model (`cross_entropy`) hit a singular point: a mean over zero elements (0/0) "
        "gave NaN (float32)"
    )
    assert (
        "the producing op: `cross_entropy` (singular: every one of its 3 targets (arg1) is ignore_index -100)"
        in lines
    )
    assert "operand arg1 (int64, 3 values): every value -100" in lines
    d = tr.diagnose()
    assert d.cause == "invalid_op"
    assert d.advice == [
        "In the root model: every target of `cross_entropy` is `ignore_index`, so its mean is over no element: "
        "skip such a batch (`if (labels != ignore_index).any()`), or take `reduction='sum'` and divide by the "
        "count of kept targets clamped to 1.",
        "Not an overflow: a wider dtype does not remove it.",
    ]
