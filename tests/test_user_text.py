"""What a user reads: losses that were not recorded, Python-float losses, the warning that says why."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from conftest import TwoLinear

import nantrace
from nantrace._report import summary_lines


def _sgd_run(*, loss_as: str | None, steps: int = 2) -> nantrace.Trace:
    torch.manual_seed(0)
    model = TwoLinear()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with nantrace.trace(model, optimizer=opt) as tr:
        for _ in range(steps):
            opt.zero_grad()
            loss = model(torch.ones(3, 4)).pow(2).mean()
            loss.backward()
            if loss_as == "float":
                tr.step(loss=loss.item())
            elif loss_as == "tensor":
                tr.step(loss=loss)
            opt.step()
    return tr


def test_a_python_float_loss_is_recorded_as_the_steps_loss() -> None:
    as_float = _sgd_run(loss_as="float").steps["loss"].tolist()
    as_tensor = _sgd_run(loss_as="tensor").steps["loss"].tolist()
    assert as_float == pytest.approx(as_tensor, rel=1e-6) and all(math.isfinite(v) for v in as_float)


def test_optimizer_without_scaler_and_no_loss_warns_once_and_reports_not_recorded() -> None:
    with pytest.warns(UserWarning) as caught:
        tr = _sgd_run(loss_as=None, steps=3)
    mine = [w for w in caught if "without a loss" in str(w.message)]
    assert [w.filename for w in mine] == [__file__]  # it points at the loop's own line
    texts = [str(w.message) for w in mine]
    assert texts == [
        "nantrace: step 0 ended at optimizer.step() without a loss: with an optimizer and no GradScaler nantrace "
        "cannot see the loss, so steps.loss is NaN (not recorded). Call tr.step(loss=loss) before "
        "optimizer.step() to record it."
    ]
    assert "loss: not recorded (no scaler.scale(loss) or tr.step(loss=...) was seen)" in summary_lines(tr)
    assert repr(tr).splitlines()[0] == "<nantrace.Trace of TwoLinear: 3 steps, 66 records, no GradScaler>"


def test_no_warning_when_the_loop_gives_its_loss() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        tr = _sgd_run(loss_as="tensor")
    assert not any(line.startswith("loss: not recorded") for line in summary_lines(tr))
