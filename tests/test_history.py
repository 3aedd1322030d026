"""Causes read from the run's history and the loop (issue 17 kinds 4-9): a mean over zero elements, divergence
seen from little history or with nothing non-finite, a warmup the loop already does, a NaN that recurs at the
same producer, a loss beyond float16 with every step skipped, and evidence that is true of the recorded data."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import conftest
import pandas as pd
import torch
import torch.nn.functional as F
from torch import nn

import nantrace
from nantrace._diagnose import diagnose
from nantrace._fmt import num
from nantrace._schema import FP16_SMALLEST_SUBNORMAL
from nantrace._view import RunView


# ------------------------------------------------------------------------------------------ kind 4
def _no_zero_grad_run(zero_grad: bool, tmp: Path | None = None) -> nantrace.Trace:
    """float16 autocast + GradScaler; step 0's scaled gradient overflows (outputs near 300, scale 65536), later
    batches are small. Without ``zero_grad()`` the step-0 inf stays in ``.grad``."""
    m = nn.Linear(4, 4)
    opt = torch.optim.SGD(m.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16)
    with nantrace.trace(m, scaler=scaler, optimizer=opt) as tr:
        for s in range(4):
            if zero_grad:
                opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16):
                y = m(torch.full((2, 4), 300.0 if s == 0 else 1.0))
            scaler.scale(y.float().pow(2).mean()).backward()
            scaler.step(opt)
            scaler.update()
    return tr


def test_stale_gradients_from_a_loop_without_zero_grad_say_zero_grad_not_float32(tmp_path: Path) -> None:
    tr = _no_zero_grad_run(zero_grad=False)
    assert tr.steps["skipped"].tolist() == [True] * 4
    assert tr.steps["stale_grads"].tolist() == [0.0, 2.0, 2.0, 2.0]  # weight and bias from step 1 on
    d = tr.diagnose()
    assert d.cause == "loss_scale_collapse"
    assert d.overflow is not None and (d.overflow.step, d.overflow.phase) == (0, "loss")
    assert (
        "at steps 1–3 the `.grad` of 2 parameter(s) already held inf/NaN before the backward added to it: the loop "
        "did not reset the gradients (no `zero_grad()` since), so that value stays in `.grad` and every later step "
        "is skipped"
    ) in d.evidence
    assert any(
        e.startswith("the fresh gradient arriving at the root model at step 3 was finite") for e in d.evidence
    )
    assert d.advice[0].startswith("Reset the gradients every step: `optimizer.zero_grad()`")
    assert not any(
        "Keep the root model in float32" in a or "keep the root model in float32" in a for a in d.advice
    )
    tr.save(tmp_path / "t.nantrace")
    back = nantrace.load(tmp_path / "t.nantrace")
    assert back.steps["stale_grads"].tolist() == [0.0, 2.0, 2.0, 2.0]
    assert back.diagnose().summary == d.summary


def test_the_same_loop_with_zero_grad_has_no_stale_gradients() -> None:
    tr = _no_zero_grad_run(zero_grad=True)
    assert tr.steps["stale_grads"].tolist() == [0.0, 0.0, 0.0, 0.0]
    assert tr.steps["skipped"].tolist() == [True, False, False, False]
    assert tr.diagnose().cause == "scaler_backoff"


# ------------------------------------------------------------------------------------------ kind 5
def _empty_label_run() -> nantrace.Trace:
    """Cross-entropy in float32; at step 2 every label is ignore_index: a mean over zero elements is 0/0."""
    torch.manual_seed(0)
    m = nn.Linear(4, 3)
    with nantrace.trace(m) as tr:
        for s in range(4):
            target = torch.tensor([-100, -100]) if s == 2 else torch.tensor([0, 1])
            loss = F.cross_entropy(m(torch.ones(2, 4)), target)
            loss.backward()
            tr.step(loss=loss)
    return tr


def test_a_mean_over_zero_elements_is_loss_and_not_told_to_use_float32() -> None:
    tr = _empty_label_run()
    d = tr.diagnose()
    assert d.cause == "loss"
    assert d.overflow is not None
    assert (d.overflow.step, d.overflow.phase, d.overflow.tensor, d.overflow.kind) == (
        2,
        "loss",
        "loss",
        "nan",
    )
    assert (
        "the gradient arriving at the model's outputs was exactly 0 in all 6 elements while the loss was NaN: no "
        "output element contributed to the loss, so it was a mean over zero elements (0/0)"
    ) in d.evidence
    assert d.advice[0].startswith("Guard the reduction of the batch of step 2, which selected nothing")
    assert d.advice[0].endswith("The loss already is float32: a wider dtype does not help.")
    assert not any("Compute the loss in float32" in a for a in d.advice)
    assert d.summary.endswith("at step 2: a mean over zero elements.")


def test_a_nan_loss_whose_gradient_is_not_all_zero_is_not_called_an_empty_mean() -> None:
    m = nn.Linear(4, 3)
    with nantrace.trace(m) as tr:
        for s in range(2):
            out = m(torch.ones(2, 4))
            loss = out.float().mean() * (0.0 * math.inf if s == 1 else 1.0)  # 0·inf: NaN, gradient NaN too
            loss.backward()
            tr.step(loss=loss)
    d = tr.diagnose()
    assert d.cause == "loss" and d.overflow is not None and d.overflow.step == 1
    assert not any("mean over zero elements" in e for e in d.evidence)


# ------------------------------------------------------------------------------------------ kind 6
def _sgd_run(lr: float, steps: int, *, warmup: bool = False) -> nantrace.Trace:
    """A Linear(8→8) under float16 autocast trained by SGD on fixed inputs; loss recorded with ``tr.step``."""
    m = nn.Linear(8, 8)
    with torch.no_grad():
        m.weight.copy_(torch.linspace(-0.3, 0.3, 64).reshape(8, 8))
        m.bias.zero_()
    opt = torch.optim.SGD(m.parameters(), lr=lr)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: (s + 1) / 8) if warmup else None
    x = torch.linspace(-20.0, 20.0, 32).reshape(4, 8)
    with nantrace.trace(m, optimizer=opt) as tr:
        for _ in range(steps):
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16):
                y = m(x)
            loss = (y.float() - 1).pow(2).mean()
            loss.backward()
            tr.step(loss=loss)
            opt.step()
            if sched is not None:
                sched.step()
            if not torch.isfinite(loss):
                break
    return tr


def test_divergence_seen_from_two_steps_of_loss_and_gradient_norm() -> None:
    tr = _sgd_run(0.5, 4)
    st = tr.steps
    assert math.isinf(st["loss"].iloc[2])  # the forward overflowed at step 2, after two finite steps
    d = tr.diagnose()
    assert d.cause == "divergence"
    assert d.overflow is not None and (d.overflow.step, d.overflow.phase, d.overflow.module) == (
        2,
        "forward",
        "",
    )
    l0, l1 = float(st["loss"].iloc[0]), float(st["loss"].iloc[1])
    g0, g1 = float(st["grad_norm"].iloc[0]), float(st["grad_norm"].iloc[1])
    assert l1 / l0 >= 5 and g1 / g0 >= 20
    assert f"loss {num(l0)} (step 0) → {num(l1)} (step 1): ×{num(l1 / l0)} in one step" in d.evidence
    assert f"gradient norm {num(g0)} (step 0) → {num(g1)} (step 1): ×{num(g1 / g0)} in one step" in d.evidence
    assert d.summary.startswith("The run diverged: the loss and the gradient norm jumped in one step")
    assert d.advice[0].startswith("Lower the (peak) learning rate from 0.5 (the update-to-weight ratio was ")
    assert (
        ": try 0.05, and watch the update-to-weight ratio stay near the healthy 0.001; and add a warmup."
        in (d.advice[0])
    )


def test_two_calm_steps_before_an_overflow_are_not_divergence() -> None:
    tr = _sgd_run(1e-4, 2)  # no jump at all
    assert tr.diagnose().cause == "healthy"


def test_a_warmup_the_loop_already_does_is_not_advised() -> None:
    tr = _sgd_run(2.0, 12, warmup=True)
    d = tr.diagnose()
    assert d.cause == "divergence"
    lr = tr.steps["lr"].tolist()
    assert lr[1] > lr[0]
    assert not any("add a warmup" in a for a in d.advice)
    assert "The loop already warms up (lr " in d.advice[0]
    assert d.advice[0].endswith("lower the peak learning rate or lengthen the warmup.")


def test_quiet_divergence_led_by_the_loss_while_a_norm_hides_the_activations() -> None:
    """bfloat16, nothing non-finite: the loss rose 4 → 97185 while every update moved the weights 3.5% (35× the
    healthy 1e-3), and the normalised outputs stayed flat. Built frames, as a loaded trace has them."""
    losses = [4.0, 21.0, 150.0, 700.0, 3000.0, 11000.0, 40000.0, 97185.0]
    rows = []
    for s in range(8):
        rows.append(
            {
                "step": s,
                "phase": "forward",
                "module": "ln",
                "tensor": "output",
                "absmax": 3.0,
                "dtype": "bfloat16",
            }
        )
        rows.append(
            {
                "step": s,
                "phase": "optimizer",
                "module": "fc",
                "tensor": "weight",
                "absmax": 1.035**s,
                "dtype": "float32",
            }
        )
    records = conftest.records_frame(rows)
    steps = conftest.steps_frame(
        [{"step": s, "loss": v, "lr": 0.5, "grad_norm": 10.0 * (s + 1)} for s, v in enumerate(losses)]
    )
    d = diagnose(conftest.frame_view(records, steps))
    assert d.cause == "divergence" and d.overflow is None
    assert "loss rose 4 (step 0) → 97185 (step 7) (×2.43e+04)" in d.evidence
    assert (
        "forward output absmax went 3 → 3 (×1) over steps 0–7: the recorded activations did not grow with the loss"
        in d.evidence
    )
    assert (
        d.summary
        == "The loss and the weights grow fast: the run is diverging (no overflow yet); the learning rate is too high."
    )


def _growing_rows(weight_absmax: list[float | None]) -> list[dict[str, object]]:
    """One step per entry of ``fc``'s output absmax growing 4x a step, with the given weight absmax after
    ``optimizer.step()`` (None: no update that step, no optimizer row), then a forward overflow at the next
    step."""
    rows: list[dict[str, object]] = []
    for s, w in enumerate(weight_absmax):
        rows.append(
            {"step": s, "phase": "forward", "module": "fc", "tensor": "output", "absmax": 10.0 * 4**s}
        )
        if w is not None:
            rows.append(
                {
                    "step": s,
                    "phase": "optimizer",
                    "module": "fc",
                    "tensor": "weight",
                    "absmax": w,
                    "dtype": "float32",
                }
            )
    rows.append(
        {
            "step": len(weight_absmax),
            "phase": "forward",
            "module": "fc",
            "tensor": "output",
            "absmax": 1.0,
            "n_posinf": 3,
        }
    )
    return rows


def test_a_jump_of_the_weights_is_not_called_steady_growth() -> None:
    rows = _growing_rows([1.0, 1.01, 1.02, 3000.0, 3010.0])
    steps = conftest.steps_frame([{"step": s, "loss": 2.0 * 3**s, "lr": 0.1} for s in range(6)])
    d = diagnose(conftest.frame_view(conftest.records_frame(rows), steps))
    assert d.cause == "divergence"
    assert (
        "weight absmax went 1 (step 0) → 3010 (step 4) (×3010), most of it in one jump ×2941 from step 2 to step 3"
        in d.evidence
    )
    assert not any("step after step" in a for a in d.advice)


# ------------------------------------------------------------------------------------------ kind 8
class _MaskedRatio(torch.autograd.Function):
    """forward a / (b + 1); backward divides by the count of non-zero ``b``: 0/0 when a batch has none."""

    @staticmethod
    def forward(ctx, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        ctx.save_for_backward(a, b)
        return a / (b + 1)

    @staticmethod
    def backward(ctx, g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # type: ignore[override]
        a, b = ctx.saved_tensors
        n = (b != 0).sum()
        return g * n / n, -g * a


class _Ratio(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return _MaskedRatio.apply(self.fc(x), b)


def test_a_nan_that_comes_back_at_the_same_producer_is_invalid_op_not_a_backoff() -> None:
    torch.manual_seed(0)
    m = _Ratio()
    opt = torch.optim.SGD(m.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    with nantrace.trace(m, scaler=scaler, optimizer=opt) as tr:
        for s in range(12):
            b = (
                torch.zeros(2, 4) if s % 4 == 1 else torch.ones(2, 4)
            )  # every fourth batch has nothing unmasked
            opt.zero_grad()
            scaler.scale(m(torch.ones(2, 4), b).pow(2).mean()).backward()
            scaler.step(opt)
            scaler.update()
    d = tr.diagnose()
    assert d.cause == "invalid_op"
    assert d.overflow is not None
    assert (d.overflow.step, d.overflow.phase, d.overflow.module, d.overflow.kind) == (
        1,
        "backward",
        "",
        "nan",
    )
    assert d.overflow.tensor.endswith("grad_output[0]")  # the locator names the gradient's path
    assert (
        f"the same NaN in `{d.overflow.tensor}` of the root model came back at steps 1, 5, 9, in separate runs of skipped "
        "steps, at loss scale 1024, 512, 256: a lower scale did not remove it, so it is not an overflow the "
        "GradScaler absorbs"
    ) in d.evidence
    assert not any("Nothing to fix" in a for a in d.advice)


# ------------------------------------------------------------------------------------------ loss beyond fp16
def test_a_loss_beyond_float16_with_every_step_skipped_is_not_benign() -> None:
    m = nn.Linear(4, 4)
    opt = torch.optim.SGD(m.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16)
    with nantrace.trace(m, scaler=scaler, optimizer=opt) as tr:
        for _ in range(4):
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16):
                y = m(torch.ones(2, 4))
            scaler.scale((y.float() - 17000.0).pow(2).mean()).backward()
            scaler.step(opt)
            scaler.update()
    assert tr.steps["skipped"].tolist() == [True] * 4
    lv = float(tr.steps["loss"].max())
    d = tr.diagnose()
    assert d.cause == "loss_scale_collapse"
    assert (
        f"no traced step trained: the GradScaler skipped every one from step 0 on, and the loss itself was "
        f"{num(lv)}, beyond float16's largest value 65504 (×{num(lv / 65504)}) before any scaling"
    ) in d.evidence
    assert d.advice[0].startswith(
        f"Make the loss smaller ({num(lv)}, beyond float16's 65504 before any scaling)"
    )


# ------------------------------------------------------------------------------------------ kind 9
def test_loss_nonfinite_steps_name_only_steps_whose_loss_was_not_finite() -> None:
    m = nn.Linear(4, 4)
    opt = torch.optim.SGD(m.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16)
    with nantrace.trace(m, scaler=scaler, optimizer=opt) as tr:
        for s in range(5):
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16):
                y = m(torch.full((2, 4), 300.0 if s == 0 else 1.0))
            loss = y.float().pow(2).mean()
            if s in (3, 4):
                loss = loss * (0.0 * math.inf)  # 0·inf: NaN
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
    d = tr.diagnose()
    assert d.cause == "loss"
    assert d.overflow is not None and (d.overflow.step, d.overflow.tensor) == (3, "loss")
    assert "the loss was non-finite at steps 3–4" in d.evidence
    assert not any("steps 0" in e for e in d.evidence if e.startswith("the loss was non-finite"))


def test_a_loss_gradient_in_bfloat16_without_a_scaler_says_the_loss_was_not_recorded() -> None:
    m = nn.Linear(4, 4)
    opt = torch.optim.SGD(m.parameters(), lr=1e-3)
    with nantrace.trace(m, optimizer=opt) as tr:
        for s in range(3):
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.bfloat16):
                y = m(torch.ones(2, 4))
            z = y.float() - y.float().detach() if s == 2 else y.float()  # all 0 at step 2
            z.abs().sqrt().sum().backward()  # sqrt at 0: inf derivative, times sign(0) = 0: NaN
            opt.step()
    d = tr.diagnose()
    assert d.cause == "loss"
    assert d.overflow is not None and (d.overflow.step, d.overflow.tensor, d.overflow.kind) == (
        2,
        "grad_output[0]",
        "nan",
    )
    assert "loss value at step 2: not recorded" in d.evidence
    assert d.advice[-1].startswith("The loss of step 2 was not recorded")
    assert not any("float16" in a or "65504" in a for a in d.advice)


def test_adam_evidence_says_which_grad_squares_round_to_zero() -> None:
    m = nn.Linear(4, 4).half()
    with torch.no_grad():
        m.weight.fill_(0.5)
        m.bias.zero_()
    opt = torch.optim.Adam(m.parameters(), lr=1e-3)
    with nantrace.trace(m, optimizer=opt) as tr:
        opt.zero_grad()
        x = torch.full((2, 4), 1e-3, dtype=torch.float16)
        x[0, 0] = 1.0
        (m(x).float().sum() * 1e-3).backward()
        opt.step()
    d = tr.diagnose()
    assert d.cause == "optimizer"
    r = tr.records
    g = r[(r["phase"] == "backward") & (r["tensor"] == "weight.grad")]
    gmax, gmin = float(g["absmax"].max()), float(g["absmin"].min())
    assert gmax * gmax > FP16_SMALLEST_SUBNORMAL > gmin * gmin
    assert (
        f"Adam's default eps=1e-8 rounds to 0 in float16; in float16 grad² ranges {num(gmin * gmin)}–"
        f"{num(gmax * gmax)}: the smallest ({num(gmin)}² below {num(FP16_SMALLEST_SUBNORMAL)}) rounds to 0, so "
        "sqrt(v) + eps is 0 where the gradient was small and m / 0 is inf"
    ) in d.evidence


# ------------------------------------------------------------------------------------------ kind 7 (the loop)
def test_the_gradient_norm_optimizer_step_applied_shows_the_loops_clipping() -> None:
    m = nn.Linear(4, 4)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    with nantrace.trace(m, scaler=scaler, optimizer=opt) as tr:
        for s in range(3):
            opt.zero_grad()
            scaler.scale(m(torch.full((2, 4), 10.0)).pow(2).mean()).backward()
            scaler.unscale_(opt)
            if s > 0:
                torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
            scaler.step(opt)
            scaler.update()
    st = tr.steps
    assert math.isclose(st["applied_grad_norm"].iloc[0], st["grad_norm"].iloc[0], rel_tol=1e-5)  # not clipped
    assert st["grad_norm"].iloc[1] > 1.0
    assert math.isclose(st["applied_grad_norm"].iloc[1], 1.0, rel_tol=1e-5)
    assert math.isclose(st["applied_grad_norm"].iloc[2], 1.0, rel_tol=1e-5)


def test_divergence_under_a_loop_that_clips_is_not_told_to_clip() -> None:
    rows = _growing_rows([1.5**s for s in range(5)])
    steps = conftest.steps_frame(
        [
            {"step": s, "loss": 2.0 * 3**s, "lr": 0.1, "grad_norm": 40.0 * (s + 1), "applied_grad_norm": 1.0}
            for s in range(6)
        ]
    )
    d = diagnose(conftest.frame_view(conftest.records_frame(rows), steps))
    assert d.cause == "divergence"
    assert (
        "the loop already clips the gradients: at step 5 their norm was 240 after the backward and 1 when "
        "optimizer.step() applied them"
    ) in d.evidence
    assert not any("Clip gradients" in a for a in d.advice)
    assert (
        "weight absmax went 1 (step 0) → 5.062 (step 4) (×5.062), rising in 100% of the steps" in d.evidence
    )


# ------------------------------------------------------------------------------------------ the demo
DEMO_TRACE = Path(__file__).resolve().parent / "data" / "demo_fp16.nantrace"


def test_the_demos_diagnosis_names_the_learning_rate_and_its_warmup() -> None:
    """``nantrace demo``'s trace (float16, 50 steps, Python 3.11.7, torch 2.13.0 on CPU): the attention scores
    overflow at step 27 because the learning rate warming up to 0.1 is too high for the model."""
    tr = nantrace.load(DEMO_TRACE)
    d = tr.diagnose()
    assert d.cause == "divergence"
    assert d.overflow is not None
    assert (d.overflow.step, d.overflow.phase, d.overflow.module, d.overflow.kind) == (
        27,
        "forward",
        "blocks.1.attn.scores",
        "inf",
    )
    assert (
        "weight absmax went 1.088 (step 19) → 1.086 (step 26) (×0.998): the largest |w| of any parameter grew less "
        "than ×2, while the update ratio above is each parameter's own change per step"
    ) in d.evidence
    assert d.advice[0].startswith(
        "Lower the learning rate, which was 0.042 when the run diverged (the update-to-weight ratio was 0.07574; "
        "healthy is about 0.001): try a peak of 0.0042, and watch the update-to-weight ratio stay near the healthy "
        "0.001."
    )
    assert "would give a healthy ratio" not in d.advice[0]
    assert "The loop already warms up (lr 0.028 at step 19 → 0.042 at step 26)" in d.advice[0]
    assert not any("sqrt(head_dim)" in a for a in d.advice)  # the model already scales its scores
    assert (
        "loss went 3.268 (step 19) → 3.104 (step 26) (×0.9499): the loss had not diverged yet (that takes ×2 or "
        "more, rising in half the steps); the growth is in the activations"
    ) in d.evidence


def test_the_overflow_text_of_a_mean_over_zero_elements_agrees_with_the_diagnosis() -> None:
    ov = _empty_label_run().first_overflow()
    assert ov is not None
    assert str(ov).splitlines()[1:] == [
        "At step 2 the model's outputs were finite (absmax 0.9927) but the loss was NaN (float32).",
        "The gradient arriving at the model's outputs was exactly 0 in all 6 elements: no output element "
        "contributed, so the loss was a mean over zero elements (0/0: every label `ignore_index`, an empty mask). "
        "Skip such a batch or divide by `count.clamp_min(1)`.",
    ]
    assert "Compute the loss in float32" not in str(ov)


# ------------------------------------------------------------------------------------------ new-user check 2
def _underflow_after_backoff_rows() -> tuple[list[dict[str, object]], list[dict[str, object]]]:
    """float16 with a GradScaler: steps 0-2 overflow in the backward of `norm` (skipped, scale 65536 → 16384),
    steps 3-5 train. `fc`'s two gradients are flushed every step (absmax 1e-05, below float16's smallest
    normal); `out.weight.grad` has 78% zeros but absmax 45504, which is not flushed."""
    rows: list[dict[str, object]] = []
    for s in range(6):
        if s < 3:
            rows.append(
                {"step": s, "phase": "backward", "module": "norm", "tensor": "grad_input[0]", "n_posinf": 2}
            )
        for module, tensor, absmax, zeros in (
            ("fc", "weight.grad", 1e-05, 0),
            ("fc", "bias.grad", 1e-05, 0),
            ("out", "weight.grad", 45504.0, 78),
        ):
            rows.append(
                {
                    "step": s,
                    "phase": "backward",
                    "module": module,
                    "tensor": tensor,
                    "absmax": absmax,
                    "absmin": 0.0 if zeros else absmax / 2,
                    "numel": 100,
                    "n_zero": zeros,
                }
            )
    steps = [{"step": s, "loss": 1.0, "scale": 65536.0 / 2 ** min(s, 2), "skipped": s < 3} for s in range(6)]
    return rows, steps


def test_underflow_after_skipped_overflows_does_not_say_no_inf_and_lists_only_flushed_gradients() -> None:
    rows, steps = _underflow_after_backoff_rows()
    d = diagnose(conftest.frame_view(conftest.records_frame(rows), conftest.steps_frame(steps)))
    assert d.cause == "gradient_underflow" and d.overflow is None
    assert "No inf/NaN" not in str(d)
    assert d.summary == (
        "Besides the overflows the GradScaler skipped (steps 0–2), float16 gradients flush to zero: 67% of "
        "parameter-gradient tensors lost most of their values."
    )
    assert d.evidence[0] == (
        "the trace holds inf produced at steps 0–2 (first: the backward of `norm` (Linear) `grad_input[0]`, step 0), "
        "each a step the GradScaler skipped"
    )
    assert "`fc.bias.grad`: 0% zeros, absmax 1e-05 (flushed at 6 of 6 recorded steps)" in d.evidence
    assert "`fc.weight.grad`: 0% zeros, absmax 1e-05 (flushed at 6 of 6 recorded steps)" in d.evidence
    assert not any("out.weight.grad" in e for e in d.evidence)
    assert d.advice[0].startswith(
        "The GradScaler lowered the loss scale to 16384 because of the overflows at steps 0–2: raising "
        "`init_scale` alone brings them back."
    )
    assert d.headline == (
        "67% of float16 parameter-gradient tensors flushed to zero (12 of 18), loss scale 16384–65536"
    )
    assert str(d).splitlines()[0] == f"nantrace diagnosis: gradient_underflow · {d.headline}"


def test_underflow_without_any_inf_keeps_saying_so() -> None:
    rows, steps = _underflow_after_backoff_rows()
    rows = [r for r in rows if r["module"] != "norm"]
    steps = [{**st, "scale": 1024.0, "skipped": False} for st in steps]
    d = diagnose(conftest.frame_view(conftest.records_frame(rows), conftest.steps_frame(steps)))
    assert d.cause == "gradient_underflow"
    assert d.summary.startswith("No inf/NaN, but float16 gradients flush to zero: 67% of")
    assert d.advice[0] == (
        "The loss scale (1024) is too small for these gradients: raise `init_scale` and find why the scaler lowered it."
    )
    assert (
        d.headline
        == "67% of float16 parameter-gradient tensors flushed to zero (12 of 18), loss scale 1024–1024"
    )


def _fast_update_rows(ratio: float) -> pd.DataFrame:
    """bfloat16, nothing non-finite, flat activations; each step the weight absmax grows by ``ratio``."""
    rows: list[dict[str, object]] = []
    for s in range(4):
        rows.append(
            {
                "step": s,
                "phase": "forward",
                "module": "fc",
                "tensor": "output",
                "absmax": 3.0,
                "dtype": "bfloat16",
            }
        )
        rows.append(
            {
                "step": s,
                "phase": "optimizer",
                "module": "fc",
                "tensor": "weight",
                "absmax": (1 + ratio) ** s,
                "dtype": "float32",
            }
        )
    return conftest.records_frame(rows)


def test_a_median_update_ratio_of_a_tenth_is_divergence_never_healthy() -> None:
    losses = [2.94, 1.09, 5.33, 8.22]
    steps = conftest.steps_frame([{"step": s, "loss": v, "lr": 0.4} for s, v in enumerate(losses)])
    d = diagnose(conftest.frame_view(_fast_update_rows(0.25), steps))
    assert d.cause == "divergence" and d.overflow is None
    assert d.evidence[0] == (
        "update-to-weight ratio (change of the parameters' absmax per step over their absmax, summed over the "
        "parameters) was 0.25 (median over steps 1–3), 250× the healthy 0.001; at 0.1 or more a run is diverging, "
        "not healthy"
    )
    assert "loss 2.94 (step 0), 1.09 (step 1), 5.33 (step 2), 8.22 (step 3)" in d.evidence
    assert d.summary == (
        "Each update changes the weights by a tenth of their size or more: the run is diverging (no overflow yet); "
        "the learning rate is too high."
    )
    assert d.headline == "diverging, no overflow yet: update-to-weight ratio 0.25 (healthy ≈ 0.001), lr 0.4"
    assert str(d).splitlines()[0] == f"nantrace diagnosis: divergence · {d.headline}"
    assert d.advice[0].startswith(
        "Lower the (peak) learning rate from 0.4 (the update-to-weight ratio was 0.25;"
    )


def test_a_median_update_ratio_below_a_tenth_stays_healthy_with_a_headline() -> None:
    steps = conftest.steps_frame([{"step": s, "loss": 1.0, "lr": 0.01} for s in range(4)])
    d = diagnose(conftest.frame_view(_fast_update_rows(0.05), steps))
    assert d.cause == "healthy"
    assert d.headline == "4 steps, every recorded value finite; median update-to-weight ratio 0.05"
    assert str(d).splitlines()[0] == f"nantrace diagnosis: healthy · {d.headline}"


def test_the_lr_advice_offers_the_lr_of_the_last_calm_step() -> None:
    """A warmup 0.01 → 0.4: steps 1-2 update by 0.5% (calm), later steps by 20%, then the forward overflows."""
    weights, w = [], 1.0
    for s in range(6):
        w *= 1.005 if s <= 2 else 1.2
        weights.append(w)
    rows = _growing_rows(weights)
    lrs = [0.01, 0.02, 0.03, 0.1, 0.2, 0.4, 0.4]
    steps = conftest.steps_frame([{"step": s, "loss": 2.0 * 3**s, "lr": lr} for s, lr in enumerate(lrs)])
    d = diagnose(conftest.frame_view(conftest.records_frame(rows), steps))
    assert d.cause == "divergence"
    assert d.advice[0].startswith(
        "Lower the learning rate, which was 0.4 when the run diverged (the update-to-weight ratio was 0.2; healthy "
        "is about 0.001): try a peak of 0.04 or 0.03, the lr of step 2, whose update-to-weight ratio was 0.005, and watch the update-to-weight "
        "ratio stay near the healthy 0.001."
    )


def test_a_divergence_names_the_overflow_it_led_to_not_a_step_0_backoff() -> None:
    """Step 0 is a routine backoff (skipped, then training resumes); steps 1-7 grow 2x a step; from step 8 on
    every step overflows in the backward of `fc` and is skipped."""
    rows: list[dict[str, object]] = []
    for s in range(16):
        rows.append(
            {
                "step": s,
                "phase": "forward",
                "module": "fc",
                "tensor": "output",
                "absmax": 10.0 * 2 ** min(s, 8),
            }
        )
        if s == 0 or s >= 8:
            rows.append(
                {"step": s, "phase": "backward", "module": "fc", "tensor": "weight.grad", "n_posinf": 1}
            )
        else:
            rows.append(
                {
                    "step": s,
                    "phase": "optimizer",
                    "module": "fc",
                    "tensor": "weight",
                    "absmax": 1.5**s,
                    "dtype": "float32",
                }
            )
    steps = conftest.steps_frame(
        [
            {
                "step": s,
                "loss": 2.0 * 2 ** min(s, 8),
                "lr": 0.5,
                "scale": 65536.0 / 2 ** (s >= 8) / 2 ** max(s - 8, 0),
                "skipped": s == 0 or s >= 8,
            }
            for s in range(16)
        ]
    )
    d = diagnose(conftest.frame_view(conftest.records_frame(rows), steps))
    assert d.cause == "divergence"
    assert d.overflow is not None and (d.overflow.step, d.overflow.phase, d.overflow.module) == (
        8,
        "backward",
        "fc",
    )
    assert d.summary == (
        "The run diverged: activations and weights grew until the backward of `fc` overflowed at step 8; the "
        "learning rate is too high."
    )


def _loss_fault(scales: list[float]) -> nantrace.Diagnosis:
    """The loss itself is +inf at every step (outputs finite), each step skipped at the given loss scales."""
    rows: list[dict[str, object]] = []
    for s in range(len(scales)):
        rows.append({"step": s, "phase": "forward", "module": "", "tensor": "output", "absmax": 3.0})
        rows.append(
            {
                "step": s,
                "phase": "loss",
                "module": "",
                "tensor": "loss",
                "n_posinf": 1,
                "numel": 1,
                "dtype": "float32",
            }
        )
    steps = conftest.steps_frame([{"step": s, "scale": v, "skipped": True} for s, v in enumerate(scales)])
    return diagnose(conftest.frame_view(conftest.records_frame(rows), steps))


def test_the_loss_cause_says_the_scale_falls_only_when_it_fell() -> None:
    flat = _loss_fault([65536.0])
    assert flat.cause == "loss"
    assert "GradScaler skipped 1 of 1 steps (0); loss scale 65536 → 65536" in flat.evidence
    assert not any("the scale falls" in e for e in flat.evidence)
    fell = _loss_fault([65536.0, 32768.0])
    assert fell.cause == "loss"
    assert (
        "GradScaler skipped 2 of 2 steps (0–1); loss scale 65536 → 32768 — a symptom: the scale falls because the "
        "loss itself is non-finite, not the gradients"
    ) in fell.evidence


def test_weights_read_from_the_live_model_say_what_their_last_optimizer_row_showed() -> None:
    """-1: read from the live model. With no optimizer row it says so; with one that showed another value the
    weights changed outside optimizer.step() (was 'in the initial weights, from before step 0' whatever the
    rows said, found by the new-user check)."""
    from nantrace._explain import changed_outside, weights_words

    live = [("weight", "float32", 70000.0, -1)]
    none = conftest.records_frame([])
    assert (
        weights_words("a", live, none, 3)
        == "`a.weight` absmax 70000 in the live model (no optimizer row records it)"
    )
    rows = conftest.records_frame(
        [
            {"step": 1, "phase": "optimizer", "module": "a", "tensor": "weight", "absmax": 0.25},
            {"step": 2, "phase": "optimizer", "module": "a", "tensor": "weight", "absmax": 0.5},
            {"step": 3, "phase": "optimizer", "module": "a", "tensor": "weight", "absmax": 70000.0},
        ]
    )
    assert weights_words("a", live, rows, 3) == (
        "`a.weight` absmax 70000 in the live model, where its last optimizer row (step 2) showed 0.5: it changed "
        "outside optimizer.step()"
    )
    assert changed_outside(rows, "a", live, 3) and not changed_outside(rows, "a", live, 4)
    assert (
        weights_words("a", live, rows, 4)
        == "`a.weight` absmax 70000 in the live model, as after optimizer.step() of step 3"
    )
    assert (
        weights_words("a", [("weight", "float32", 70000.0, 3)], rows, 4)
        == "`a.weight` absmax 70000 since step 3"
    )


def test_one_applied_update_that_blows_the_loss_up_under_a_scaler_is_divergence() -> None:
    """Steps 0-1 are backoffs; step 2's update is the only one applied; from step 3 on the loss is ~1e5 (x7500
    of step 0's) and every step's gradients overflow (no finite norm, skipped). Not a benign backoff: the
    update made the model blow up, and the loss never came back."""
    losses = [25.4, 4.8, 7.3, 191716.0, 204778.0, 311274.0, 265497.0, 163137.0]
    rows: list[dict[str, object]] = []
    for s in range(8):
        rows.append({"step": s, "phase": "forward", "module": "fc", "tensor": "output", "absmax": 3.0})
        if s != 2:
            rows.append(
                {"step": s, "phase": "backward", "module": "fc", "tensor": "weight.grad", "n_posinf": 1}
            )
    steps = conftest.steps_frame(
        [
            {
                "step": s,
                "loss": losses[s],
                "lr": 3.0,
                "scale": 65536.0 / 2 ** (s - (s > 2)),
                "skipped": s != 2,
                "grad_norm": 11.1 if s == 2 else math.nan,
            }
            for s in range(8)
        ]
    )
    d = diagnose(conftest.frame_view(conftest.records_frame(rows), steps))
    assert d.cause == "divergence"
    assert d.overflow is not None and (d.overflow.step, d.overflow.phase, d.overflow.module) == (
        3,
        "backward",
        "fc",
    )
    assert "loss 25.4 (step 0) → 191716 (step 3): ×7548 across 1 applied update(s), steps 0–3" in d.evidence
    assert (
        "the gradients of step 3 overflowed (no finite gradient norm) and the loss stayed at least ×5 above step "
        "0's on the 4 later step(s)" in d.evidence
    )
    assert d.evidence[0].startswith("the overflow the divergence led to at step 3: backward of `fc` (")
    assert d.summary.startswith("The run diverged: the loss jumped across one applied update until ")
    assert d.advice[0].startswith("Lower the (peak) learning rate from 3")
    # the same run whose loss comes back after the spike: one odd batch, not a divergence
    back = [*losses[:4], 20.0, 18.0, 15.0, 12.0]
    calm = conftest.steps_frame(
        [{**row, "loss": back[row["step"]]} for row in steps.to_dict("records")]  # type: ignore[index]
    )
    assert diagnose(conftest.frame_view(conftest.records_frame(rows), calm)).cause != "divergence"


def _skipped_run_view(losses: list[float], data: list[float]) -> RunView:
    """Step 0 applied, steps 1.. skipped (their gradients overflowed): ``losses`` per step, the model input's
    absmax ``data`` per step."""
    rows: list[dict[str, object]] = [
        {"step": s, "phase": "data", "module": "", "tensor": "input[0]", "absmax": a}
        for s, a in enumerate(data)
    ]
    rows += [
        {"step": s, "phase": "backward", "module": "fc", "tensor": "weight.grad", "n_posinf": 1}
        for s in range(1, len(losses))
    ]
    steps = [
        {
            "step": s,
            "loss": v,
            "skipped": s > 0,
            "grad_norm": 1.0 if s == 0 else math.inf,
            "scale": 65536.0 / 2**s,
        }
        for s, v in enumerate(losses)
    ]
    return conftest.frame_view(conftest.records_frame(rows), conftest.steps_frame(steps))


def test_a_loss_that_moves_on_unchanged_weights_is_said_to_be_moved_by_the_inputs() -> None:
    from nantrace._facts import Facts, same_weights_losses, unchanged_weights_loss_words

    run = Facts(_skipped_run_view([1.0, 4.0, 9.0, 40.0], [1.0, 2.0, 4.0, 8.0]))
    assert same_weights_losses(run, 1) == [(1, 4.0), (2, 9.0), (3, 40.0)]
    assert same_weights_losses(run, 0) == [
        (0, 1.0)
    ]  # step 0's update was applied: step 1 ran on other weights
    assert unchanged_weights_loss_words(run, 1) == (
        "the loss went 4 (step 1) → 40 (step 3) on unchanged weights (the GradScaler skipped every update in "
        "between): the inputs or the targets moved it, not the optimizer"
    )
    assert unchanged_weights_loss_words(Facts(_skipped_run_view([1.0, 4.0, 5.0, 6.0], [1.0] * 4)), 1) is None


def test_data_growth_needs_four_times_over_the_window_rising_and_three_steps() -> None:
    from nantrace._facts import Facts, data_growth_words

    words = data_growth_words(Facts(_skipped_run_view([1.0] * 4, [1.0, 2.0, 4.0, 8.0])), 3)
    assert words is not None
    assert (
        words[0]
        == "the model's inputs (phase data) grew ×8 over steps 0–3 (absmax 1 → 8), rising in 100% of the steps"
    )
    assert words[1].startswith(
        "The model's inputs grow step after step (×8 over steps 0–3): if they are not meant"
    )
    assert data_growth_words(Facts(_skipped_run_view([1.0] * 4, [1.0, 2.0, 3.0, 3.9])), 3) is None  # ×3.9
    assert (
        data_growth_words(Facts(_skipped_run_view([1.0] * 2, [1.0, 8.0])), 1) is None
    )  # two steps: no trend
    assert (
        data_growth_words(Facts(_skipped_run_view([1.0] * 5, [1.0, 8.0, 4.0, 2.0, 6.0])), 4) is None
    )  # 2 of 4 changes fall
    ids = [  # token ids double too, but they are not features: integer inputs are left out
        {
            "step": s,
            "phase": "data",
            "module": "",
            "tensor": "input[0]",
            "absmax": float(2**s),
            "dtype": "int64",
        }
        for s in range(4)
    ]
    view = conftest.frame_view(
        conftest.records_frame(ids), conftest.steps_frame([{"step": s} for s in range(4)])
    )
    assert data_growth_words(Facts(view), 3) is None


def test_a_jump_on_growing_inputs_is_not_divergence_but_names_the_inputs() -> None:
    """Step 0 applied an update, the loss jumped ×5 at step 1 and every later step was skipped: with the loss
    growing ×10 on the same weights and the inputs doubling every step, the update is not what blew up."""
    view = _skipped_run_view([1.0, 6.0, 12.0, 25.0, 60.0], [1.0, 2.0, 4.0, 8.0, 16.0])
    d = diagnose(view)
    assert d.cause == "scaler_backoff"
    assert d.summary == (
        "Loss-scale backoff while the model's inputs grow: the GradScaler skipped 4 step(s); the trace ends there."
    )
    assert d.evidence[-2:] == [
        "the loss went 6 (step 1) → 60 (step 4) on unchanged weights (the GradScaler skipped every update in "
        "between): the inputs or the targets moved it, not the optimizer",
        "the model's inputs (phase data) grew ×16 over steps 0–4 (absmax 1 → 16), rising in 100% of the steps",
    ]
    assert d.advice[0].startswith("The model's inputs grow step after step (×16 over steps 0–4)")
    assert not any(a.startswith("Nothing to fix") for a in d.advice)
    control = diagnose(_skipped_run_view([1.0, 6.0, 6.5, 7.0, 6.2], [1.0, 1.1, 1.0, 1.2, 1.1]))
    assert control.cause == "divergence"  # the same jump on steady inputs, a loss stuck above it: divergence


def test_a_divergence_while_the_inputs_grow_names_the_inputs_first() -> None:
    """The unhealthy-update-ratio divergence of ``_fast_update_rows``, with the model's input doubling every
    step: the evidence says the inputs grew and the advice leads with normalising them, before the lr."""
    data = conftest.records_frame(
        [
            {
                "step": s,
                "phase": "data",
                "module": "",
                "tensor": "input[0]",
                "absmax": 2.0**s,
                "dtype": "bfloat16",
            }
            for s in range(4)
        ]
    )
    records = pd.concat([_fast_update_rows(0.25), data], ignore_index=True)
    losses = [2.94, 1.09, 5.33, 8.22]
    steps = conftest.steps_frame([{"step": s, "loss": v, "lr": 0.4} for s, v in enumerate(losses)])
    d = diagnose(conftest.frame_view(records, steps))
    assert d.cause == "divergence"
    assert d.evidence[-1] == (
        "the model's inputs (phase data) grew ×8 over steps 0–3 (absmax 1 → 8), rising in 100% of the steps"
    )
    assert d.advice[0].startswith("The model's inputs grow step after step (×8 over steps 0–3)")
    assert d.advice[1].startswith("Lower the (peak) learning rate")


def _opening_skips_view(n_skipped: int, n_trained: int, end_scale: float) -> RunView:
    """The trace opens with ``n_skipped`` skipped steps (the scale halving from 2**60 down to ``end_scale``), then
    ``n_trained`` steps train at ``end_scale``; each skipped step's loss gradient overflowed."""
    total = n_skipped + n_trained
    rows: list[dict[str, object]] = [
        {"step": s, "phase": "loss", "module": "", "tensor": "grad_output[0]", "n_posinf": 1}
        for s in range(n_skipped)
    ]
    scales = [max(end_scale, 2.0**60 / 2**s) for s in range(total)]
    steps = [{"step": s, "loss": 1.0, "skipped": s < n_skipped, "scale": scales[s]} for s in range(total)]
    return conftest.frame_view(conftest.records_frame(rows), conftest.steps_frame(steps))


def test_a_long_opening_backoff_that_ends_in_training_is_benign_and_told_its_init_scale() -> None:
    """45 skipped steps from an init_scale of 2**60 down to 32768, then 25 steps that train: the GradScaler
    calibrating, not a collapse; the advice is the scale it settled on. The same 45 skips with no step trained
    after them, or ending below a scale of 1, stay a collapse."""
    d = diagnose(_opening_skips_view(45, 25, 32768.0))
    assert d.cause == "scaler_backoff"
    assert (
        d.summary == "Benign loss-scale backoff: the GradScaler skipped 45 step(s), then training proceeded."
    )
    assert "`torch.amp.GradScaler(init_scale=32768)`" in d.advice[1]
    assert diagnose(_opening_skips_view(45, 0, 32768.0)).cause == "loss_scale_collapse"
    assert diagnose(_opening_skips_view(70, 5, 0.5)).cause == "loss_scale_collapse"


def test_a_collapse_is_described_by_its_own_run_not_by_an_earlier_short_backoff() -> None:
    """Step 0 trains, step 1 is one skipped step (`b` overflowed at 65536), step 2 trains, then steps 3–12 are all
    skipped with `clip`'s backward overflowing: the collapse is steps 3–12 and names `clip`, not the one-step
    backoff of step 1 (which counts as a collapse only by the skips that follow it)."""
    rows: list[dict[str, object]] = [
        {"step": 1, "phase": "backward", "module": "b", "tensor": "weight.grad", "n_posinf": 1}
    ]
    rows += [
        {"step": s, "phase": "backward", "module": "clip", "tensor": "grad_input[0]", "n_posinf": 1}
        for s in range(3, 13)
    ]
    scale = {0: 65536.0, 1: 65536.0, 2: 32768.0, **{s: 32768.0 / 2 ** (s - 3) for s in range(3, 13)}}
    steps = [{"step": s, "loss": 1.0, "skipped": s not in (0, 2), "scale": scale[s]} for s in range(13)]
    d = diagnose(conftest.frame_view(conftest.records_frame(rows), conftest.steps_frame(steps)))
    assert d.cause == "loss_scale_collapse"
    assert d.overflow is not None and (d.overflow.module, d.overflow.step) == ("clip", 12)
    assert (
        d.evidence[0] == "10 consecutive steps skipped by the GradScaler (steps 3–12); loss scale 32768 → 64"
    )


def test_a_collapse_in_a_parameterless_backward_fed_small_gradients_is_an_inf_factor_not_a_range() -> None:
    """`clip` owns no parameters and its incoming gradient is at most 0.5 on every skipped step, yet its
    grad_input is inf down to a loss scale below 1: no product with a finite float16 value gets there, so the
    advice names an inf factor and hunt, and neither float32 nor bfloat16."""
    rows: list[dict[str, object]] = []
    for s in range(10):
        rows.append(
            {"step": s, "phase": "backward", "module": "clip", "tensor": "grad_input[0]", "n_posinf": 1}
        )
        rows.append(
            {"step": s, "phase": "backward", "module": "clip", "tensor": "grad_output[0]", "absmax": 0.5}
        )
    steps = [{"step": s, "loss": 1.0, "skipped": True, "scale": 4.0 / 2**s} for s in range(10)]
    d = diagnose(conftest.frame_view(conftest.records_frame(rows), conftest.steps_frame(steps)))
    assert d.cause == "loss_scale_collapse"
    assert d.advice[0] == (
        "`clip` has no parameters of its own and its incoming gradient's absmax was 0.5 (step 9, at most 1), so no "
        "product of it with a finite float16 value exceeds 65504: an op of its backward multiplies by inf or "
        "divides by 0 (a custom `autograd.Function`, a derivative at a singular point). A wider dtype does not "
        "remove it; find the op with nantrace.hunt(step_fn)."
    )
    assert not any("bfloat16" in a or "float32 (autocast disabled" in a for a in d.advice)


# ------------------------------------------------------------------------------------------ new-user check 3
def _lr_divergence_with_a_scaler() -> nantrace.Trace:
    """SGD lr=2 on a linear regression under float16 autocast with a GradScaler (init 256): the gradient at the
    outputs overflows at steps 2–5 (backoffs, step 6 trains), the weights keep growing, and the divergence
    names the overflow of step 7 (new-user check, N10)."""
    torch.manual_seed(0)
    m = nn.Linear(4, 1)
    opt = torch.optim.SGD(m.parameters(), lr=2.0)
    scaler = torch.amp.GradScaler("cpu", init_scale=256.0)
    with nantrace.trace(m, scaler=scaler, optimizer=opt) as tr:
        for step in range(30):
            g = torch.Generator().manual_seed(step)
            x = torch.randn(8, 4, generator=g) + 1.0
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16):
                loss = ((m(x).float() - x.sum(1, keepdim=True)) ** 2).mean()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
    return tr


def test_a_divergence_read_at_fresh_steps_names_them_and_the_backoffs_before_its_overflow() -> None:
    """The output absmax is read only at the steps that ran on new weights (0, 1, 2, 7): the sentence names them
    and counts the rises between them (the steps 3–6 it leaves out fell twice); the overflow it names (step 7)
    is later than first_overflow() (step 2), and a line says steps 2–5 were backoffs."""
    tr = _lr_divergence_with_a_scaler()
    ov = tr.first_overflow()
    assert ov is not None and (ov.step, ov.phase) == (2, "loss")
    d = tr.diagnose()
    assert d.cause == "divergence" and d.overflow is not None and d.overflow.step == 7
    out = tr.records[(tr.records["phase"] == "forward") & (tr.records["tensor"] == "output")]
    assert [num(v) for v in out["absmax"].iloc[:8]] == [
        "1.683",
        "149.2",
        "2318",
        "2186",
        "1984",
        "2472",
        "2044",
        "41600",
    ]
    assert d.evidence[1] == (
        "before it, steps 2–5 were GradScaler backoffs (the first is what first_overflow() names): at steps 2–3 "
        "the loss gradient arriving at the model's outputs overflowed (inf) at loss scales 256 → 128; at steps "
        "4–5 the backward of the root model (Linear) `weight.grad` overflowed (inf) at loss scales 64 → 32; the "
        "GradScaler skipped those steps and lowered the scale, and training went on at step 6"
    )
    assert d.evidence[2] == (
        "forward output absmax grew 1.683 → 41600 (×2.472e+04) over steps 0–7, read at the 4 steps that ran on "
        "new weights (0, 1, 2, 7), rising in 3 of the 3 changes between them; steps 3–6 ran on the weights of "
        "the step before them, whose update the GradScaler skipped"
    )


def test_weights_recorded_only_at_applied_updates_say_so() -> None:
    """Step 2 is skipped (no weights written, step 3 runs on step 2's weights): the output sentence reads steps
    0, 1, 2, 4 and the weight sentence the four steps whose update was applied."""
    rows = _growing_rows([1.0, 1.5, None, 2.25, 3.5])
    steps = conftest.steps_frame(
        [{"step": s, "loss": 2.0 * 3**s, "lr": 0.1, "scale": 1024.0, "skipped": s == 2} for s in range(6)]
    )
    d = diagnose(conftest.frame_view(conftest.records_frame(rows), steps))
    assert d.cause == "divergence"
    assert (
        "`fc` output absmax grew 10 → 2560 (×256) over steps 0–4, read at the 4 steps that ran on new weights "
        "(0, 1, 2, 4), rising in 3 of the 3 changes between them; step 3 ran on the weights of the step before "
        "it, whose update the GradScaler skipped"
    ) in d.evidence
    assert (
        "weight absmax went 1 (step 0) → 3.5 (step 4) (×3.5), recorded at the 4 steps whose update was applied "
        "(0, 1, 3, 4), rising in 3 of the 3 changes between them; the GradScaler skipped the update of step 2"
    ) in d.evidence


class _TwoViews(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(4, 4), nn.Linear(4, 2)
        with torch.no_grad():
            self.fc1.weight.fill_(50.0)
            self.fc1.bias.zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x)))


def _two_views_run(make: Any) -> nantrace.Trace:
    """The model called on two views before one backward of (z1 − z2)²·1e-6 (new-user check, N14b): the biases
    cancel in z1 − z2, so both bias gradients are exactly 0 at every step; fc1's weight gradient is subnormal at
    step 0 only."""
    torch.manual_seed(0)
    m = _TwoViews()
    opt = torch.optim.SGD(m.fc2.parameters(), lr=1e-4)
    scaler = torch.amp.GradScaler("cpu", init_scale=16.0)
    g = torch.Generator().manual_seed(1)
    with make(m, scaler=scaler, optimizer=opt) as tr:
        for step in range(3):
            x = torch.rand(2, 4, generator=g) * 2 + 1
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16):
                z1, z2 = m(x), m(x * (100.0 if step == 1 else 1.1))
                loss = ((z1.float() - z2.float()) ** 2).mean() * 1e-6
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
    return tr


def test_bias_gradients_that_cancel_exactly_are_not_called_flushed() -> None:
    """Every product of fc1's / fc2's non-zero incoming gradient and input is far above float16's smallest
    subnormal, so their all-zero bias gradients are exact zeros: left out, 1 of the 6 other tensors is flushed,
    and the run is healthy (before, 7 of 12 with both biases 'flushed at 3 of 3 recorded steps')."""
    tr = _two_views_run(nantrace.trace)
    assert tr.diagnose().cause == "healthy"
    watched = _two_views_run(
        nantrace.watch
    ).diagnose()  # step 0 in full: fc1's subnormal weight gradient, 1 of 2
    assert watched.cause == "gradient_underflow"
    assert watched.evidence[1] == "overall 20% of parameter-gradient elements were exactly 0"
    assert watched.evidence[4] == (
        "left out as exactly 0, not flushed: `fc1.bias.grad`, `fc2.bias.grad` (2 all-zero tensors): every product "
        "of a non-zero value of the gradient arriving at their module and of its input is at least float16's "
        "smallest subnormal 5.96e-08, so none rounds to 0; their zeros are sums that cancel"
    )
    assert not any("bias.grad`: " in e for e in watched.evidence)


def test_an_all_zero_gradient_the_trace_cannot_prove_exact_is_not_said_to_be_flushed() -> None:
    """`fc`'s incoming gradient was not recorded: its all-zero gradients may be exact or flushed, and the line
    says so instead of 'flushed'."""
    rows = [
        {
            "step": s,
            "phase": "backward",
            "module": "fc",
            "tensor": t,
            "absmax": 0.0,
            "absmin": math.nan,
            "numel": 8,
            "n_zero": 8,
            "dtype": "float16",
        }
        for s in range(2)
        for t in ("weight.grad", "bias.grad")
    ]
    steps = [{"step": s, "loss": 1.0, "scale": 1024.0, "skipped": False} for s in range(2)]
    d = diagnose(conftest.frame_view(conftest.records_frame(rows), conftest.steps_frame(steps)))
    assert d.cause == "gradient_underflow"
    assert (
        "`fc.bias.grad`: all zeros at 2 of 2 recorded steps (exactly 0, or flushed below float16's smallest "
        "subnormal 5.96e-08: the trace cannot tell which)"
    ) in d.evidence
    assert not any("(flushed at" in e for e in d.evidence)


def test_one_micro_batch_out_of_range_under_accumulation_is_named_as_that_batch() -> None:
    """Three micro-steps per step; micro-step 2 of step 1 feeds inputs of 2000 (the others 1..3): the overflow
    of `0` follows from that one batch, which the evidence and the first advice name by step and micro-step
    (before, no sentence said so: a per-step series needs earlier steps, and this step's others were fine)."""
    model = nn.Sequential(nn.Linear(2, 2, bias=False)).half()
    with torch.no_grad():
        model[0].weight.fill_(30.0)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    with nantrace.trace(model, optimizer=opt) as tr:
        for step in range(2):
            opt.zero_grad()
            for micro in range(3):
                x = torch.full((1, 2), float(micro + 1), dtype=torch.float16)
                if (step, micro) == (1, 2):
                    x = torch.full((1, 2), 2000.0, dtype=torch.float16)
                loss = model(x).float().sum()
                loss.backward()
            opt.step()
    ov = tr.first_overflow()
    assert ov is not None and (ov.step, ov.micro_step, ov.phase, ov.module) == (1, 2, "forward", "0")
    d = tr.diagnose()
    assert d.cause == "forward_overflow"
    assert (
        "the model's inputs (phase data) at step 1, micro-step 2 had absmax 2000, ×666.7 the largest of the 5 root "
        "forwards before it (3; they stayed within ×3): one batch out of range"
    ) in d.evidence
    assert d.advice[0] == (
        "Check the batch of step 1, micro-step 2: its inputs' absmax is ×666.7 that of the 5 before it (a corrupt "
        "or unnormalised sample); validate or clip inputs where they are loaded."
    )


def _edited_bias_run(make: object = nantrace.trace) -> nantrace.Trace:
    """AdamW at lr 1e-3 under fp16 autocast; before step 1 the loop sets one bias entry to 1000 (a Tanh after it
    saturates, so nothing in the run is non-finite)."""
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 1))
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu", init_scale=256.0)
    g = torch.Generator().manual_seed(0)
    xs = [torch.randn(4, 16, generator=g) for _ in range(3)]
    with make(m, scaler=scaler, optimizer=opt) as tr:  # type: ignore[operator]
        for i, x in enumerate(xs):
            if i == 1:
                with torch.no_grad():
                    m[2].bias[3] = 1000.0
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16):
                loss = m(x).float().pow(2).mean()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
    return tr


def test_a_weight_written_between_adam_steps_is_named_and_not_taken_for_fast_updates() -> None:
    """AdamW moves a weight by at most ~32·lr per update: a bias going 0.25 → 1000 across one update at lr 1e-3
    was written outside optimizer.step(). Its change is left out of the update-to-weight ratio (before: 'ratio
    337.1, the learning rate is too high', a divergence verdict on a run with no inf/NaN; found by the new-user
    check) and the diagnosis names the write."""
    tr = _edited_bias_run()
    assert tr.first_overflow() is None
    d = tr.diagnose()
    assert d.cause == "healthy"
    before = float(
        tr.records.query("phase == 'optimizer' and module == '2' and tensor == 'bias' and step == 0")[
            "absmax"
        ].iloc[0]
    )
    assert (
        f"`2.bias` had absmax {num(before)} after optimizer.step() of step 0 and 1000 after that of step 1: AdamW "
        "moves a weight by at most about 32·lr per update (lr 0.001: "
        f"{num(1e-3 * (32 + before))} over 1 update(s)), so it was written outside optimizer.step()"
    ) in d.evidence
    assert d.advice[-1] == (
        "Find what writes the weights outside optimizer.step() (a manual edit, a state-dict load, a weight "
        "average): update-to-weight ratios and the steps after such a write follow from it, not from the learning "
        "rate."
    )
    ratio_line = next(e for e in d.evidence if e.startswith("update-to-weight ratio"))
    top = float(ratio_line.rsplit("max ", 1)[1])
    assert top < 0.1  # the write (×4000) is not an update


def test_an_sgd_run_claims_no_write_it_cannot_bound() -> None:
    """SGD's step scales with the gradient: no bound, so no parameter is said to be written outside."""
    from nantrace._facts import written_outside

    tr = _edited_bias_run()
    assert len(written_outside(tr.records, tr.steps, "AdamW")) == 1
    assert len(written_outside(tr.records, tr.steps, "SGD")) == 0
