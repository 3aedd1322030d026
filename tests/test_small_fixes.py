"""phases= as a comma-separated string, the loss explanation without a recorded forward, and the CLI's warning
line for a folder with a missing rank."""

from __future__ import annotations

import math
import warnings
from pathlib import Path

import pytest
import torch
from conftest import records_frame
from torch import nn

import nantrace
from nantrace import cli


def test_phases_accepts_a_comma_separated_string() -> None:
    m = nn.Linear(2, 2)
    with nantrace.trace(m, phases="data, forward") as tr:
        m(torch.ones(1, 2)).sum().backward()
    assert sorted(set(tr.records["phase"].astype(str))) == ["data", "forward"]
    assert tr.options["phases"] == ["data", "forward"]
    with pytest.raises(ValueError, match=r"unknown phase\(s\) 'forwrd'"):
        nantrace.trace(m, phases="data,forwrd")
    with pytest.raises(ValueError, match=r"unknown phase\(s\) ''"):
        nantrace.trace(m, phases="data,")


def test_loss_without_a_recorded_forward_does_not_call_the_outputs_finite() -> None:
    m = nn.Linear(2, 2)
    with nantrace.trace(m) as tr:
        tr.step(loss=torch.tensor(math.nan))
    ov = tr.first_overflow()
    assert ov is not None and (ov.step, ov.phase, ov.tensor, ov.kind) == (0, "loss", "loss", "nan")
    assert "outputs were not recorded" in str(ov) and "finite" not in str(ov).split(" but ")[0]
    d = tr.diagnose()
    assert d.cause == "loss"
    assert d.summary == "The model's outputs were not recorded but the loss was non-finite at step 0."
    assert "n/a" not in d.evidence[0]


def test_report_on_a_folder_with_a_missing_rank_prints_a_clean_warning_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    m = nn.Linear(2, 2)
    with nantrace.trace(m) as tr:
        m(torch.ones(1, 2))
    folder = tmp_path / "run.nantrace"
    folder.mkdir()
    tr.save(folder / "rank-00000-of-00002.nantrace")  # rank 1's part is missing
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a raw warning would raise here
        assert cli.main(["report", str(folder)]) == cli.EXIT_OK
    err = capsys.readouterr().err.splitlines()
    assert [ln for ln in err if "warning" in ln.lower()] == [
        f"nantrace: warning: '{folder}' holds 1 of 2 rank parts; ranks [1] are missing (did they crash before "
        "Trace.save?). The merged trace covers the ranks present."
    ]


@pytest.mark.parametrize(
    ("absmax", "expected"),
    [
        (
            [1.0, 1.2, 1.5, 3000.0],
            " Its output absmax had grown every step since step 0 (1 → 3000), most of it at step 3: ×2000 in that one "
            "step against ×1.5 over the steps before.",
        ),
        ([1.0, 2.0, 4.0, 8.0], " Its output absmax had grown every step since step 0 (1 → 8)."),
        ([4.0, 2.0, 3000.0], ""),  # one rise is no climb of ≥ 2 steps
    ],
    ids=["jump", "steady", "one_rise"],
)
def test_a_climb_says_when_one_step_made_most_of_it(absmax: list[float], expected: str) -> None:
    """'grew every step' was said of a run whose last step alone multiplied the absmax by 2000 (a weight edited
    by hand between steps): the step that made most of the climb is named with its factor."""
    from nantrace._explain import _climb

    rows = [
        {"step": s, "phase": "forward", "module": "0", "tensor": "output", "absmax": a}
        for s, a in enumerate(absmax)
    ]
    assert _climb(records_frame(rows), "0", len(absmax) - 1) == expected


def _input_run(scales: list[float]) -> nantrace.Trace:
    """float16-autocast steps of Linear(4, 1) (weight 1, bias 0, SGD at lr 0) on inputs ``scale`` · 1: the output is
    4 · scale, beyond float16's 65504 above 16376."""
    model = nn.Sequential(nn.Linear(4, 1))
    with torch.no_grad():
        model[0].weight.fill_(1.0)
        model[0].bias.zero_()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    with nantrace.trace(model, optimizer=opt) as tr:
        for scale in scales:
            with torch.autocast("cpu", dtype=torch.float16):
                loss = model(torch.full((2, 4), scale)).float().mean()
            tr.step(loss=loss)
            loss.backward()
            opt.step()
            opt.zero_grad()
    return tr


def test_one_batch_out_of_range_is_a_jump_not_inputs_growing() -> None:
    """Inputs within ×1.5 over steps 0–6, then ×1e5 at step 7: one batch out of range, said as such (it was
    "the model's inputs grow step after step", from a 'rising' fraction that counted noise; found by the new-user
    check)."""
    tr = _input_run([1.0, 1.2, 1.5, 1.1, 1.4, 1.0, 1.3, 1.3e5])
    d = tr.diagnose()
    assert d.cause == "forward_overflow" and d.overflow is not None and d.overflow.step == 7
    assert (
        "the model's inputs (phase data) jumped ×1e+05 at step 7 (absmax 1.3 → 130000), after staying within ×1.5 "
        "over steps 0–6: one batch out of range, not inputs growing"
    ) in d.evidence
    assert d.advice[0] == (
        "Check the batch of step 7: its inputs' absmax is ×1e+05 the step before's (a corrupt or unnormalised "
        "sample); validate or clip inputs where they are loaded."
    )
    assert not any("grow step after step" in a for a in d.advice)
    # only inf was made: no "inf − inf or 0·inf then gives NaN"
    assert (
        "its inputs (absmax 130000) are already beyond float16's range: casting them to float16 (autocast) gives inf"
        in d.evidence
    )


def test_inputs_that_double_every_step_still_grow() -> None:
    tr = _input_run([2.0**k for k in range(15)])
    d = tr.diagnose()
    assert d.overflow is not None and d.overflow.step == 14  # 4 · 8192 = 32768 < 65504 < 4 · 16384 = 65536
    assert any(a.startswith("The model's inputs grow step after step (×") for a in d.advice)
