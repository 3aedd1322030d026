"""Causes read from the run's history and the loop (issue 17 kinds 4-9): a mean over zero elements, divergence
seen from little history or with nothing non-finite, a warmup the loop already does, a NaN that recurs at the
same producer, a loss beyond float16 with every step skipped, and evidence that is true of the recorded data."""

from __future__ import annotations

import math
from pathlib import Path

import conftest
import torch
import torch.nn.functional as F
from torch import nn

import nantrace
from nantrace._diagnose import diagnose
from nantrace._fmt import num
from nantrace._schema import FP16_SMALLEST_SUBNORMAL


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
    assert d.advice[0].startswith("Lower the learning rate from 0.5")


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


def _growing_rows(weight_absmax: list[float]) -> list[dict[str, object]]:
    """Five steps of ``fc``'s output absmax growing 4x a step with the given weight absmax, then a forward
    overflow at step 5."""
    rows: list[dict[str, object]] = []
    for s, w in enumerate(weight_absmax):
        rows.append(
            {"step": s, "phase": "forward", "module": "fc", "tensor": "output", "absmax": 10.0 * 4**s}
        )
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
        {"step": 5, "phase": "forward", "module": "fc", "tensor": "output", "absmax": 1.0, "n_posinf": 3}
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
    assert d.advice[0].startswith("Lower the learning rate from 0.042 (the update ratio was 0.07574")
    assert "The loop already warms up (lr 0.028 at step 19 → 0.042 at step 26)" in d.advice[0]
    assert not any("sqrt(head_dim)" in a for a in d.advice)  # the model already scales its scores
    assert (
        "loss went 3.268 (step 19) → 3.104 (step 26) (×0.9499): it had not risen yet, the growth is in the "
        "activations"
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
