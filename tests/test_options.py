"""Options of nantrace.trace that trade detail for speed: every=N, phases=, drill=."""

from __future__ import annotations

import torch
from torch import nn

import nantrace


def _blowup_model() -> nn.Sequential:
    m = nn.Sequential(nn.Linear(2, 2, bias=False), nn.ReLU(), nn.Linear(2, 1, bias=False))
    with torch.no_grad():
        m[0].weight.fill_(1.0)
        m[2].weight.fill_(1.0)
    return m.half()


def test_every_n_records_full_steps_and_only_nonfinite_rows_between() -> None:
    m = _blowup_model()
    with nantrace.trace(m, every=3) as tr:
        for step in range(7):
            scale = 20000.0 if step == 4 else 1.0  # step 4: 2*20000=40000 then 80000 -> inf in m[2]
            with torch.no_grad():
                m(torch.full((1, 2), scale, dtype=torch.float16))
    rec = tr.records
    per_step = rec.groupby("step", observed=True).size().to_dict()
    full = per_step[0]
    assert full == 8  # data input, 3 modules × (input, output), root output
    # step 4: m[2].output and root output hold inf, and the drilled m[2]'s (clean) input is kept (issue 18.6)
    assert per_step == {0: full, 3: full, 4: 3, 6: full}
    light = rec[rec["step"] == 4]
    assert light[["module", "tensor", "n_posinf"]].values.tolist() == [
        ["2", "output", 1],
        ["2", "input[0]", 0],
        ["", "output", 1],
    ]
    assert sorted(tr.steps["step"].tolist()) == list(range(7))
    ov = tr.first_overflow()
    assert ov is not None and (ov.step, ov.phase, ov.module, ov.kind) == (4, "forward", "2", "inf")
    assert tr.options["every"] == 3


def test_phases_subset_records_only_those_phases() -> None:
    m = _blowup_model()
    with nantrace.trace(m, phases=["forward"]) as tr:
        m(torch.ones(1, 2, dtype=torch.float16)).float().sum().backward()
    assert set(tr.records["phase"].astype(str)) == {"forward"}
    assert len(tr.records) == 7  # 3 modules × (input, output) and the root output


def test_filter_that_hides_a_submodule_says_so_in_the_explanation() -> None:
    m = _blowup_model()
    with nantrace.trace(m, modules="0") as tr, torch.no_grad():
        m(torch.full((1, 2), 20000.0, dtype=torch.float16))  # m[2] overflows, but only m[0] is traced
    ov = tr.first_overflow()
    assert ov is not None and (ov.module, ov.phase) == ("", "forward")
    assert "an untraced submodule inside the reported one may be the real producer" in str(ov)
    with nantrace.trace(m, modules="2") as tr2, torch.no_grad():
        m(torch.full((1, 2), 20000.0, dtype=torch.float16))
    ov2 = tr2.first_overflow()
    assert ov2 is not None and ov2.module == "2" and "untraced" not in str(ov2)


def test_gradient_overflow_at_the_outputs_from_the_loss_scale_says_so() -> None:
    model = nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**20)
    with nantrace.trace(model, scaler=scaler, optimizer=opt) as tr:
        with torch.autocast("cpu", dtype=torch.float16):
            out = model(torch.ones(1, 2))
        scaler.scale(out.float().sum()).backward()  # d(loss)/d(out) = 2**20 > 65504 in float16
        scaler.step(opt)
        scaler.update()
    ov = tr.first_overflow()
    assert ov is not None and (ov.phase, ov.tensor, ov.kind) == ("loss", "grad_output[0]", "inf")
    assert "multiplied by the loss scale 1048576" in str(ov)
    assert tr.steps["skipped"].tolist() == [True]
