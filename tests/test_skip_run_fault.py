"""A fault inside a run of skipped steps: a GradScaler backoff (a loss-gradient overflow at a loss scale that was
then lowered) followed by an event that does not depend on the loss scale (a forward inf). The fault decides, as it
does when the step before it was not skipped; the backoff before it is named as one, with its true scales. A real
collapse (the same scale-dependent overflow at every skipped step while the scale keeps falling) stays
``loss_scale_collapse``."""

from __future__ import annotations

import pytest
import torch

import nantrace

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


class _Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(8, 8)
        self.act = torch.nn.ReLU()
        self.out = torch.nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.act(self.fc(x)))


def _batches(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(4, 8, generator=g), torch.randn(4, 2, generator=g)) for _ in range(n)]


def _run(
    init_scale: float,
    edit: str | None = None,
    at: int = 1,
    n: int = 10,
    loss_factor: float = 1.0,
    mode: str = "trace",
) -> nantrace.Trace:
    """A float16 autocast loop on CPU. ``edit`` at step ``at``: ``"inf"`` sets ``fc.weight[0, 0] = inf``;
    ``"mul"`` multiplies ``fc.weight`` by 1e5 (products up to ~1e6 > 65504); ``"data"`` multiplies every batch
    from step ``at`` on by 1e5 (inputs ~3e5 > 65504, cast to float16 by autocast)."""
    torch.manual_seed(0)
    model = _Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu", init_scale=init_scale)
    ctx = nantrace.trace if mode == "trace" else nantrace.watch
    with ctx(model, scaler=scaler, optimizer=opt) as tr:
        for i, (x, y) in enumerate(_batches(n)):
            if i == at and edit == "inf":
                with torch.no_grad():
                    model.fc.weight[0, 0] = float("inf")
            if i == at and edit == "mul":
                with torch.no_grad():
                    model.fc.weight.mul_(1e5)
            if i >= at and edit == "data":
                x = x * 1e5
            with torch.autocast("cpu", dtype=torch.float16):
                loss = torch.nn.functional.mse_loss(model(x).float(), y) * loss_factor
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
    return tr


_STEP0_BACKOFF = (
    "step 0 was a GradScaler backoff, not this fault: at step 0 the loss gradient arriving at the model's outputs "
    "overflowed (inf) at loss scale 1048576; the GradScaler skipped the step, and the scale was lowered to 524288 "
    "by step 1 (a forward value does not depend on the loss scale)"
)
_INF_WEIGHT_SUMMARY = (
    "`fc` computed +inf at step 1 from its own weights, which already held non-finite values: not this forward's "
    "arithmetic."
)


def _where(d: nantrace.Diagnosis) -> tuple[int, str, str, str, str]:
    ov = d.overflow
    assert ov is not None
    return ov.step, ov.phase, ov.module, ov.tensor, ov.kind


def _no_collapse_words(d: nantrace.Diagnosis) -> None:
    text = str(d)
    assert "lowest scale tried" not in text
    assert "use a mean" not in text
    assert "kept falling" not in text


@pytest.mark.parametrize("mode", ["trace", "watch"])
def test_inf_weight_after_step0_backoff(mode: str) -> None:
    tr = _run(2.0**20, "inf", mode=mode)
    ev = tr.overflows()
    assert (int(ev.step.iloc[0]), ev.phase.iloc[0], ev.tensor.iloc[0]) == (0, "loss", "grad_output[0]")
    assert set(ev.phase.iloc[1:]) == {"forward"} and list(ev.step.iloc[1:]) == list(range(1, 10))
    d = tr.diagnose()
    assert d.cause == "invalid_op"
    assert _where(d) == (1, "forward", "fc", "output", "inf")
    assert d.summary == _INF_WEIGHT_SUMMARY
    assert "`fc`'s parameter `weight` (operand arg1) held +inf when the forward read it" in d.evidence
    assert _STEP0_BACKOFF in d.evidence
    _no_collapse_words(d)


def test_inf_weight_same_as_when_step0_trained() -> None:
    """The diagnosis the fault gets on its own: init_scale=1, so step 0 trained and was not skipped."""
    alone = _run(1.0, "inf").diagnose()
    after = _run(2.0**20, "inf").diagnose()
    assert (after.cause, _where(after), after.summary) == (alone.cause, _where(alone), alone.summary)
    assert not any("GradScaler backoff" in e for e in alone.evidence)


def test_weight_factor_after_step0_backoff() -> None:
    d = _run(2.0**20, "mul").diagnose()
    assert d.cause == "forward_overflow"
    assert _where(d) == (1, "forward", "fc", "output", "inf")
    assert d.summary == (
        "`fc` (Linear) overflowed float16 in its forward at step 1: activations exceeded 65504 from finite inputs."
    )
    assert d.evidence[-1] == _STEP0_BACKOFF
    _no_collapse_words(d)


def test_data_factor_after_step0_backoff() -> None:
    d = _run(2.0**20, "data").diagnose()
    assert d.cause == "forward_overflow"
    assert _where(d) == (1, "forward", "fc", "output", "inf")
    assert d.summary == (
        "`fc` (Linear) overflowed float16 in its forward at step 1: it cast float32 values of absmax 3.331e+05 to "
        "float16, max 65504."
    )
    assert d.evidence[-1] == _STEP0_BACKOFF
    _no_collapse_words(d)


def test_two_step_backoff_before_fault() -> None:
    """init_scale 2**24: steps 0 and 1 overflow the loss gradient (a backoff), then the weight goes inf at 2."""
    tr = _run(2.0**24, "inf", at=2)
    d = tr.diagnose()
    assert d.cause == "invalid_op"
    assert _where(d) == (2, "forward", "fc", "output", "inf")
    assert d.evidence[-1] == (
        "steps 0–1 were a GradScaler backoff, not this fault: at steps 0–1 the loss gradient arriving at the "
        "model's outputs overflowed (inf) at loss scales 1.678e+07 → 8388608; the GradScaler skipped the steps, "
        "and the scale was lowered to 4194304 by step 2 (a forward value does not depend on the loss scale)"
    )
    _no_collapse_words(d)


def test_real_collapse_is_still_a_collapse() -> None:
    """Control: the loss ×1e6 makes the loss gradient overflow at every scale from 65536 down to 128."""
    tr = _run(2.0**16, loss_factor=1e6)
    assert set(tr.overflows().phase) == {"loss"} and bool(tr.steps.skipped.all())
    d = tr.diagnose()
    assert d.cause == "loss_scale_collapse"
    assert _where(d) == (9, "loss", "", "grad_output[0]", "inf")
    assert d.summary == (
        "The loss scale kept falling (65536 → 64) over 10 skipped steps: the gradients overflow at every scale tried."
    )
    assert d.evidence[:3] == [
        "10 consecutive steps skipped by the GradScaler (steps 0–9); loss scale 65536 → 64",
        "overflowing at each skipped step: the loss gradient arriving at the model's outputs (steps 0–9)",
        "at the lowest scale tried (128, step 9) the loss gradient arriving at the model's outputs still overflowed "
        "(inf, computed in float16)",
    ]
    assert not any("GradScaler backoff" in e or "separate fault" in e for e in d.evidence)


def test_collapse_then_fault_stays_the_collapse() -> None:
    """A collapse of its own (10 skips, scale 65536 → 64), then a weight set to inf at step 10: the collapse came
    first and is the diagnosis; its lowest scale is over its own steps, and the later fault is named apart."""
    d = _run(2.0**16, "inf", at=10, n=12, loss_factor=1e6).diagnose()
    assert d.cause == "loss_scale_collapse"
    assert _where(d) == (9, "loss", "", "grad_output[0]", "inf")
    assert (
        d.evidence[0] == "10 consecutive steps skipped by the GradScaler (steps 0–9); loss scale 65536 → 64"
    )
    assert (
        "at the lowest scale tried before step 10 (128, step 9) the loss gradient arriving at the model's outputs "
        "still overflowed (inf, computed in float16)"
    ) in d.evidence
    assert (
        "from step 10 the skips went on with a forward inf (`output` of `fc`), which does not depend on the loss "
        "scale: a separate fault, not part of this collapse"
    ) in d.evidence


def _accumulated(mode: str, at: tuple[int, int], fault: str) -> nantrace.Trace:
    """Four steps of two micro-steps (``loss / 2`` each) from ``init_scale=2**24``: every micro-step 0 overflows
    the loss gradient (a backoff). At micro-step ``at``: ``fault="nan"`` multiplies the loss by NaN,
    ``fault="weight"`` sets `fc.weight[0, 0]` to +inf before the forward."""
    torch.manual_seed(0)
    m = _Net()
    opt = torch.optim.SGD(m.parameters(), lr=0.01)
    sc = torch.amp.GradScaler("cpu", init_scale=2.0**24)
    data = _batches(8)
    ctx = nantrace.trace if mode == "trace" else nantrace.watch
    with ctx(m, scaler=sc, optimizer=opt) as tr:
        for step in range(4):
            opt.zero_grad()
            for micro in range(2):
                x, y = data[2 * step + micro]
                if (step, micro) == at and fault == "weight":
                    with torch.no_grad():
                        m.fc.weight[0, 0] = float("inf")
                with torch.autocast("cpu", dtype=torch.float16):
                    loss = torch.nn.functional.mse_loss(m(x).float(), y)
                if (step, micro) == at and fault == "nan":
                    loss = loss * float("nan")
                sc.scale(loss / 2).backward()
            sc.step(opt)
            sc.update()
    return tr


@pytest.mark.parametrize("mode", ["trace", "watch"])
def test_a_nan_loss_in_micro_step_1_is_not_hidden_by_micro_step_0s_backoff(mode: str) -> None:
    """The step's first event is micro-step 0's loss-gradient overflow (its own loss finite: scale-dependent);
    micro-step 1's NaN loss is the fault (it was diagnosed as 'the loss of step 0 was not recorded' from the
    gradient of micro-step 0, and the NaN loss appeared nowhere; found by the new-user check)."""
    tr = _accumulated(mode, (0, 1), "nan")
    d = tr.diagnose()
    assert d.cause == "loss" and d.overflow is not None
    # the outputs' absmax is the event's micro-step's, in the diagnosis as in first_overflow()
    outs = tr.records.query(
        "step == 0 and micro_step == 1 and phase == 'forward' and module == '' and tensor == 'output'"
    )
    absmax = nantrace._fmt.num(float(outs["absmax"].max()))
    assert (
        d.evidence[0]
        == f"the model's outputs at step 0 were finite (absmax {absmax}) but the loss was nan (float32)"
    )
    assert (d.overflow.step, d.overflow.micro_step, d.overflow.phase, d.overflow.tensor, d.overflow.kind) == (
        0,
        1,
        "loss",
        "loss",
        "nan",
    )
    assert (
        "before it, at step 0, micro-step 0, the loss gradient arriving at the model's outputs overflowed (inf) at "
        "loss scale 1.678e+07: a GradScaler backoff a lower scale removes, not this fault (a loss value of "
        "micro-step 1 does not depend on the loss scale)"
    ) in d.evidence


def test_an_inf_weight_in_a_later_micro_step_after_backoffs_is_the_fault() -> None:
    """Backoffs at steps 0–1 and in micro-step 0 of step 2, then the weight read as +inf in micro-step 1 of
    step 2: the diagnosis names it (it was a loss diagnosis of step 2's micro-step 0)."""
    d = _accumulated("trace", (2, 1), "weight").diagnose()
    assert d.cause == "invalid_op" and d.overflow is not None
    assert (d.overflow.step, d.overflow.micro_step, d.overflow.module) == (2, 1, "fc")
    assert d.summary == (
        "`fc` computed +inf at step 2 from its own weights, which already held non-finite values: not this "
        "forward's arithmetic."
    )
