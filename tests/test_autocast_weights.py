"""float32 weights beyond float16's 65504 under fp16 autocast: the cast to float16 makes them inf.

One tiny model, ``Sequential(Linear(2, 1, bias=False))`` with weight ``[1, 1]``, loss ``-output²/2`` (so the
weight's gradient is ``-output·x``: NaN once the output is), SGD, ``GradScaler(init_scale=1)``. Step 0 (lr 0.5,
x = [1, 0], output 1) makes the weight ``[1.5, 1]``. Then either step 1 with lr 1e5 (output 1.5) makes it
``[150001.5, 1]`` (grown by the optimizer), or the weight is multiplied by 1e5 in place before step 1 (planted:
``[150000, 100000]``, no optimizer row shows it). The next forward sees x = [0, 1]: the float16 weight
``[inf, ...]`` times 0 is NaN, its gradient is NaN and the GradScaler skips that step and the ones after.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

import nantrace
from nantrace._ranges import weights_beyond

diagnose = nantrace.Trace.diagnose

FP16_MAX = float(torch.finfo(torch.float16).max)


def _run(plant: bool, last: tuple[float, float] = (0.0, 1.0)) -> nantrace.Trace:
    model = nn.Sequential(nn.Linear(2, 1, bias=False))
    with torch.no_grad():
        model[0].weight.fill_(1.0)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    scaler = torch.amp.GradScaler("cpu", init_scale=1.0)
    xs = [[1.0, 0.0], [1.0, 0.0], list(last)] if not plant else [[1.0, 0.0], [0.0, 1.0], [0.0, 1.0]]
    with nantrace.trace(model, scaler=scaler, optimizer=opt) as tr:
        for i, x in enumerate(xs):
            opt.param_groups[0]["lr"] = 1e5 if (i == 1 and not plant) else 0.5
            if plant and i == 1:
                with torch.no_grad():
                    model[0].weight.mul_(1e5)
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16):
                out = model(torch.tensor([x]))
            loss = -(out.float() ** 2).sum() / 2
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
    return tr


def test_grown_weights_recorded_by_the_optimizer() -> None:
    tr = _run(plant=False)
    r = tr.records
    w = r[(r["phase"] == "optimizer") & (r["tensor"] == "weight")]
    assert w["step"].tolist() == [0, 1]  # step 2 (NaN gradient) was skipped
    assert tr.steps["skipped"].tolist() == [False, False, True]
    assert w["absmax"].tolist() == [1.5, 150001.5]
    assert weights_beyond(r, "0", 2, "float16") == [("weight", "float32", 150001.5, 1)]
    assert weights_beyond(r, "0", 1, "float16") == []  # the forward of step 1 used the weight of step 0
    assert weights_beyond(r, "0", 2, "float32") == []  # no cast to a narrower dtype


def test_grown_weights_explained() -> None:
    tr = _run(plant=False)
    ov = tr.first_overflow()
    assert ov is not None
    assert (ov.step, ov.phase, ov.module, ov.module_type, ov.kind, str(ov.dtype)) == (
        2,
        "forward",
        "0",
        "Linear",
        "inf",
        "float16",
    )
    assert (
        str(ov).splitlines()[0]
        == "step 2 forward: `0` (`aten._to_copy`) overflowed in a cast to float16 (+inf)"
    )
    lines = str(ov).splitlines()
    assert lines[1] == (
        "At step 2, `0` (Linear, call 0) produced +inf in `aten._to_copy` inside its forward (float16), from finite "
        "inputs (input absmax 1): its float32 weights exceed float16's 65504 (`0.weight` absmax 1.5e+05 since "
        "step 1), so autocast's cast to float16 made them inf; then inf·0 or inf−inf gives NaN."
    )
    assert lines[2].startswith(
        "the producing op: `aten._to_copy` (cast: it cast float32 values of absmax 1.5e+05"
    )
    assert lines[4].startswith(
        "Lower the "
        "learning rate, add weight decay or clip gradients so the weights stay well below 65504; or keep `0` in "
        "float32 (call it inside torch.autocast(..., enabled=False) with a .float() input), or use bfloat16."
    )


def test_grown_weights_diagnosed_as_forward_overflow() -> None:
    d = diagnose(_run(plant=False))
    assert d.cause == "forward_overflow"
    assert d.overflow is not None and d.overflow.step == 2
    assert d.summary == (
        "`0` (Linear) overflowed float16 in its forward at step 2: its float32 weights exceed 65504, so "
        "autocast's cast to float16 made them inf."
    )
    assert (
        "its parameter `0.weight` (float32) has absmax 1.5e+05, beyond float16's 65504: autocast's cast of it to "
        "float16 gives inf, inf·0 or inf−inf then gives NaN; it grew past 65504 at step 1 (optimizer rows)"
    ) in d.evidence
    assert d.advice[0] == (
        "Keep the weights of `0` (`0.weight`) well below 65504: a smaller learning rate (lr was 1e+05 at step "
        "1), weight decay, or gradient clipping (`torch.nn.utils.clip_grad_norm_`, after "
        "`scaler.unscale_(optimizer)`)."
    )
    assert d.advice[1].startswith("Keep `0` in float32: run it with autocast off")
    assert d.advice[2].startswith("Or train in bfloat16")


def test_planted_weights_read_live_at_diagnose_time() -> None:
    tr = _run(plant=True)
    assert tr.steps["skipped"].tolist() == [False, True, True]
    assert weights_beyond(tr.records, "0", 1, "float16") == []  # the optimizer row of step 0 shows 1.5
    ov = tr.first_overflow()
    assert ov is not None and (ov.step, ov.module, ov.kind) == (1, "0", "inf")
    assert (
        str(ov).splitlines()[0]
        == "step 1 forward: `0` (`aten._to_copy`) overflowed in a cast to float16 (+inf)"
    )
    assert " ".join(str(ov).splitlines()[1:]).startswith(
        "At step 1, `0` (Linear, call 0) produced +inf in `aten._to_copy` inside its forward (float16), from "
        "finite inputs (input absmax 1)"
    )
    assert (
        "(`0.weight` absmax 150000 in the live model, where its last optimizer row (step 0) showed 1.5: it changed "
        "outside optimizer.step())"
    ) in " ".join(str(ov).splitlines())
    assert "Find what wrote the weights outside optimizer.step()" in str(ov)
    d = diagnose(tr)
    assert d.cause == "forward_overflow"
    assert (
        "its parameter `0.weight` (float32) has absmax 150000, beyond float16's 65504: autocast's cast of it to "
        "float16 gives inf, inf·0 or inf−inf then gives NaN; read from the live model at diagnose time (the "
        "GradScaler skipped every step from 1 on, so the optimizer did not change it after that forward); its "
        "last optimizer row (step 0) showed 1.5: it changed outside optimizer.step()"
    ) in d.evidence
    assert d.advice[0].startswith("Find what set the weights of `0` (`0.weight`) above 65504")


def test_planted_weights_loaded_trace_keeps_the_cast(tmp_path: Path) -> None:
    """A loaded trace has no live model, but the drill-down's op table says autocast's cast made the inf: it
    stays forward_overflow, as live (issue 18 item 9)."""
    tr = _run(plant=True)
    loaded = nantrace.load(tr.save(tmp_path / "t"))
    d = diagnose(loaded)
    assert (d.cause, diagnose(tr).cause) == ("forward_overflow", "forward_overflow")
    assert "the forward replay names the op: `aten._to_copy`" in d.evidence


def test_grown_weights_giving_inf() -> None:
    """x = [1, 0] at step 2: inf·1 + 1·0 = +inf, no NaN."""
    tr = _run(plant=False, last=(1.0, 0.0))
    ov = tr.first_overflow()
    assert ov is not None and (ov.step, ov.module, ov.kind) == (2, "0", "inf")
    assert (
        "its float32 weights exceed float16's 65504 (`0.weight` absmax 1.5e+05 since step 1), so autocast's cast "
        "to float16 made them inf; inf times its inputs gives +inf."
    ) in str(ov)
    d = diagnose(tr)
    assert d.cause == "forward_overflow"
    assert (
        "its parameter `0.weight` (float32) has absmax 1.5e+05, beyond float16's 65504: autocast's cast of it to "
        "float16 gives inf, and inf times the inputs gives inf; it grew past 65504 at step 1 (optimizer rows)"
    ) in d.evidence
