"""What a user reads: losses that were not recorded, Python-float losses, the warning that says why."""

from __future__ import annotations

import math
import warnings
from pathlib import Path
from typing import Any

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


@pytest.mark.parametrize("make", [nantrace.trace, nantrace.watch], ids=["trace", "watch"])
def test_a_step_closed_by_an_exception_does_not_warn_that_it_ended_at_optimizer_step(make: Any) -> None:
    """The loop raised before optimizer.step(): the exit of `with` closes the step, and no warning says that
    optimizer.step() ended it (found by the new-user check)."""
    model = TwoLinear()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(KeyboardInterrupt), make(model, optimizer=opt) as tr:
            opt.zero_grad()
            model(torch.ones(1, 4)).sum().backward()
            raise KeyboardInterrupt
    assert list(tr.steps["step"]) == [0]


def test_no_warning_when_the_loop_gives_its_loss() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        tr = _sgd_run(loss_as="tensor")
    assert not any(line.startswith("loss: not recorded") for line in summary_lines(tr))


def _data_fault(*, sync_free: bool | None, bad_rows: tuple[int, ...], batch: int = 16) -> nantrace.Trace:
    torch.manual_seed(0)
    model = TwoLinear()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    with nantrace.trace(model, optimizer=opt, sync_free=sync_free) as tr:
        for step in range(2):
            x = torch.ones(batch, 4)
            if step == 1:
                for i in bad_rows:
                    x[i, i % 4] = float("nan")
            opt.zero_grad()
            loss = model(x).sum()
            loss.backward()
            tr.step(loss=loss)
            opt.step()
    return tr


@pytest.mark.parametrize("sync_free", [None, True])
def test_a_data_fault_names_the_samples_along_the_batch_dimension(
    sync_free: bool | None, tmp_path: Path
) -> None:
    tr = _data_fault(sync_free=sync_free, bad_rows=(3, 7))
    ov = tr.first_overflow()
    assert ov is not None and (ov.step, ov.phase, ov.tensor, ov.kind) == (1, "data", "input[0]", "nan")
    assert str(ov).endswith(
        "Check the data loader for this batch (step 1); look at samples 3, 7 of the batch (index along dim 0)."
    )
    d = tr.diagnose()
    assert d.cause == "data"
    assert (
        "the values that were not finite are in samples 3, 7 of the batch (index along dim 0)" in d.evidence
    )
    back = nantrace.load(tr.save(tmp_path / "t.nantrace"))
    assert str(back.first_overflow()) == str(ov) and back.diagnose().to_dict() == d.to_dict()


def test_many_bad_samples_show_the_first_eight_and_the_count() -> None:
    tr = _data_fault(sync_free=None, bad_rows=tuple(range(0, 20, 2)), batch=32)
    assert str(tr.first_overflow()).endswith(
        "look at samples 0, 2, 4, 6, 8, 10, 12, 14, … (10 in all) of the batch (index along dim 0)."
    )


def test_out_of_memory_in_the_sample_flags_never_reaches_the_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    from nantrace import _samples

    def no_memory(t: torch.Tensor) -> torch.Tensor:
        raise torch.OutOfMemoryError("planted")

    monkeypatch.setattr(_samples, "bad_samples", no_memory)
    tr = _data_fault(sync_free=True, bad_rows=(3,))
    ov = tr.first_overflow()
    assert ov is not None and (ov.step, ov.phase, ov.kind) == (1, "data", "nan")
    assert str(ov).endswith("e.g. log(0), division by zero or a corrupt sample.")  # the samples are unknown


def test_a_parent_that_is_a_file_is_named_as_such(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("x")
    tr = _sgd_run(loss_as="tensor")
    with pytest.raises(ValueError) as info:
        tr.save(tmp_path / "notes.txt" / "run.nantrace")
    assert str(info.value) == (
        f"path '{tmp_path / 'notes.txt' / 'run.nantrace'}': '{tmp_path / 'notes.txt'}' is a file, not a directory"
    )


def test_headroom_evidence_says_exceeds_rather_than_negative_bits() -> None:
    from conftest import ScaledLinear

    model = ScaledLinear(10000.0)  # float32: 80000 fits, but exceeds float16's 65504
    with nantrace.trace(model) as tr:
        model(torch.ones(2, 8))
    d = tr.diagnose()
    assert d.cause == "healthy"
    assert d.evidence[1] == (
        "least float16 headroom: `fc` (Linear), absmax 80000, exceeds float16's 65504 by 0.3 bits (×1.221): "
        "it would overflow in float16"
    )
