"""Facts of a step's boundary: an interrupted step keeps its true loss scale and an unscaled grad norm
(issue 18 item 7)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import nantrace

SCALE = 2.0**15


class Interrupt(Exception):
    """Stands for the loop stopping by an exception of its own."""


class FailingSGD(torch.optim.SGD):
    """SGD whose ``step()`` raises ``error`` from its ``fail_at``-th call on (an out-of-memory error in the
    optimizer: its state is allocated on the first step)."""

    def __init__(self, params: Any, error: BaseException | None, fail_at: int) -> None:
        super().__init__(params, lr=0.0)
        self.error, self.fail_at, self.calls = error, fail_at, 0

    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        self.calls += 1
        if self.error is not None and self.calls > self.fail_at:
            raise self.error
        return super().step(closure)


def _one_linear() -> nn.Sequential:
    """Linear(2→1), weights 1, no bias: for x = [3, 4] and loss = output.sum(), weight.grad = [3, 4], norm 5."""
    lin = nn.Linear(2, 1, bias=False)
    with torch.no_grad():
        lin.weight.fill_(1.0)
    return nn.Sequential(lin)


@pytest.mark.parametrize(
    "where",
    ["loop_raises", "ctrl_c", "oom_in_optimizer"],
)
def test_an_interrupted_step_keeps_its_loss_scale_and_an_unscaled_grad_norm(where: str) -> None:
    model = _one_linear()
    error: BaseException = {
        "loop_raises": Interrupt("stop"),
        "ctrl_c": KeyboardInterrupt(),
        "oom_in_optimizer": torch.OutOfMemoryError("CUDA out of memory (raised by the test)"),
    }[where]
    opt = FailingSGD(model.parameters(), error if where == "oom_in_optimizer" else None, fail_at=1)
    scaler = torch.amp.GradScaler("cpu", init_scale=SCALE)
    x = torch.tensor([[3.0, 4.0]])
    with pytest.raises(type(error)), nantrace.trace(model, scaler=scaler, optimizer=opt) as tr:
        for i in range(2):
            opt.zero_grad()
            scaler.scale(model(x).sum()).backward()
            if i == 1 and where != "oom_in_optimizer":
                raise error  # after backward, before scaler.step()/update()
            scaler.step(opt)
            scaler.update()
    st = tr.steps
    assert st["step"].tolist() == [0, 1]
    assert st["scale"].tolist() == [SCALE, SCALE]
    assert st["grad_norm"].tolist() == [5.0, 5.0]  # unscaled: not 5 * 32768
    assert st["skipped"].isna().tolist() == [False, True]  # step 1 never reached update(): not known
    r = tr.records
    grads = r[(r["phase"] == "backward") & (r["step"] == 1)]
    assert grads["tensor"].tolist() == ["grad_output[0]", "weight.grad"]
    assert grads["scale"].tolist() == [SCALE, SCALE]
    assert grads["absmax"].tolist() == [SCALE, 4 * SCALE]  # recorded as scaled, and said so by `scale`


def test_a_disabled_scaler_records_no_scale() -> None:
    model = _one_linear()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    with nantrace.trace(model, scaler=scaler, optimizer=opt) as tr:
        scaler.scale(model(torch.tensor([[3.0, 4.0]])).sum()).backward()
    assert tr.steps["scale"].isna().tolist() == [True]
    assert tr.steps["grad_norm"].tolist() == [5.0]
    assert tr.records["scale"].tolist() == [1.0] * len(tr.records)


# ------------------------------------------------------------------ grad_norm and the norm the optimizer applied


def test_grad_norm_is_before_clipping_and_applied_grad_norm_after() -> None:
    """Issue 18 item 10: ``grad_norm`` is the unscaled norm before clipping (5 for weight.grad = [3, 4]);
    ``applied_grad_norm`` is what optimizer.step() applied: 5 unclipped, 5 / (5 + 1e-6) after
    clip_grad_norm_(max_norm=1) (torch divides by the norm plus 1e-6)."""
    model = _one_linear()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    scaler = torch.amp.GradScaler("cpu", init_scale=SCALE)
    with nantrace.trace(model, scaler=scaler, optimizer=opt) as tr:
        for clip in (False, True):
            opt.zero_grad()
            scaler.scale(model(torch.tensor([[3.0, 4.0]])).sum()).backward()
            if clip:
                scaler.unscale_(opt)
                torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)
            scaler.step(opt)
            scaler.update()
    st = tr.steps
    assert st["grad_norm"].tolist() == [5.0, 5.0]
    assert st["applied_grad_norm"].tolist() == [5.0, pytest.approx(5.0 / (5.0 + 1e-6), rel=1e-6)]


def test_unchanged_gradients_reuse_grad_norm_and_changed_ones_are_read_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Without a GradScaler, clipping or anything else writing to ``.grad`` after backward, the gradients
    optimizer.step() applies are the ones whose norms the backward pass's end took: ``applied_grad_norm`` is
    ``grad_norm`` with no second pass over every gradient. Clipped in place (their version moved), they are read
    again when optimizer.step() starts."""
    passes: list[int] = []
    orig = torch._foreach_norm

    def counting(tensors: Any, *args: Any, **kwargs: Any) -> Any:
        passes.append(len(tensors))
        return orig(tensors, *args, **kwargs)

    monkeypatch.setattr(torch, "_foreach_norm", counting)
    model = _one_linear()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    with nantrace.trace(model, optimizer=opt) as tr:
        for clip in (False, True, False):
            opt.zero_grad()
            loss = model(torch.tensor([[3.0, 4.0]])).sum()
            tr.step(loss=loss)
            loss.backward()
            if clip:
                torch.nn.utils.clip_grad_value_(model.parameters(), 1.0)  # [3, 4] -> [1, 1], in place
            opt.step()
    st = tr.steps
    assert st["grad_norm"].tolist() == [5.0, 5.0, 5.0]
    assert st["applied_grad_norm"].tolist() == [5.0, pytest.approx(2**0.5, rel=1e-7), 5.0]
    # one fused norm per backward pass (grad_norm, taken when the pass ends), and only the clipped step's
    # gradients read a second time, when optimizer.step() starts
    assert passes == [1, 1, 1, 1]


def test_applied_grad_norm_without_scaler_and_for_a_skipped_step() -> None:
    model = _one_linear()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    with nantrace.trace(model, optimizer=opt) as tr:
        opt.zero_grad()
        loss = model(torch.tensor([[3.0, 4.0]])).sum()
        tr.step(loss=loss)
        loss.backward()
        torch.nn.utils.clip_grad_value_(model.parameters(), 1.0)  # [3, 4] -> [1, 1]
        opt.step()
    assert tr.steps["grad_norm"].tolist() == [5.0]
    assert tr.steps["applied_grad_norm"].tolist() == [pytest.approx(2**0.5, rel=1e-7)]
    # a step the GradScaler skipped never reached optimizer.step(): nothing was applied, not known
    model = _one_linear()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**127)  # 4 * 2**127 overflows float32: skipped
    with nantrace.trace(model, scaler=scaler, optimizer=opt) as tr:
        scaler.scale(model(torch.tensor([[3.0, 4.0]])).sum()).backward()
        scaler.step(opt)
        scaler.update()
    assert tr.steps["skipped"].tolist() == [True]
    assert tr.steps["applied_grad_norm"].isna().tolist() == [True]


def test_applied_grad_norm_of_float16_gradients_past_65504_is_finite() -> None:
    """Pure float16 parameters: gradients [40000, 40000] have norm 56568.5 (finite in float16) but the sum of
    squares is not; the norm is accumulated in float32: 40000 * sqrt(2), not inf."""
    lin = nn.Linear(2, 1, bias=False).half()
    model = nn.Sequential(lin)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    with nantrace.trace(model, optimizer=opt) as tr:
        loss = model(torch.full((1, 2), 40000.0, dtype=torch.float16)).sum()
        tr.step(loss=loss)
        loss.backward()
        opt.step()
    assert tr.steps["applied_grad_norm"].tolist() == [pytest.approx(40000 * 2**0.5, rel=1e-6)]


def test_applied_grad_norm_of_float64_and_float16_parameters_together() -> None:
    """weight.grad [3, 4] in float64 and a float16 bias's gradient 12 (norm sqrt(25 + 144) = 13)."""
    lin64 = nn.Linear(2, 1, bias=False).double()
    with torch.no_grad():
        lin64.weight.fill_(1.0)
    bias = nn.Parameter(torch.zeros(1, dtype=torch.float16))
    model = nn.Sequential(lin64)
    model.register_parameter("b", bias)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    with nantrace.trace(model, optimizer=opt) as tr:
        loss = model(torch.tensor([[3.0, 4.0]], dtype=torch.float64)).sum() + 12 * bias.float().sum()
        tr.step(loss=loss)
        loss.backward()
        opt.step()
    assert tr.steps["applied_grad_norm"].tolist() == [13.0]
