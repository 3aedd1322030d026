"""A long run whose every step after the fault holds NaN: the first producer is found from its own step, and
the diagnosis and the report read the later steps' producers without explaining each one."""

from __future__ import annotations

import io
from typing import Any

import pytest
import torch
from torch import nn

import nantrace
import nantrace._locate as locate
from nantrace._report import print_report


def _run(steps: int = 30) -> nantrace.Trace:
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    opt = torch.optim.Adam(m.parameters(), 1e-2)
    with nantrace.trace(m, optimizer=opt) as tr:
        for s in range(steps):
            x = torch.randn(4, 4)
            if s == 3:
                x[0, 0] = float("nan")  # Adam carries it into every weight: every later step holds NaN
            opt.zero_grad()
            loss = m(x).pow(2).mean()
            loss.backward()
            tr.step(loss=loss)
            opt.step()
    return tr


@pytest.fixture(scope="module")
def long_run() -> nantrace.Trace:
    return _run()


def test_first_overflow_reads_only_the_steps_up_to_the_first_event(
    long_run: nantrace.Trace, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen: list[int] = []
    real = locate._step_event

    def counting(rows: Any, step: int, *a: Any) -> Any:
        seen.append(step)
        return real(rows, step, *a)

    monkeypatch.setattr(locate, "_step_event", counting)
    ov = long_run.first_overflow()
    assert ov is not None and (ov.step, ov.phase, ov.tensor, ov.kind) == (3, "data", "input[0]", "nan")
    assert seen == [3]
    seen.clear()
    assert len(long_run.overflows(messages=False)) == 27 and seen == list(range(3, 30))


def test_overflows_without_messages_are_the_same_producers(long_run: nantrace.Trace) -> None:
    full, bare = long_run.overflows(), long_run.overflows(messages=False)
    cols = ["step", "micro_step", "phase", "module", "module_type", "call", "tensor", "kind", "rank"]
    assert bare[cols].equals(full[cols])
    assert (bare["message"] == "").all() and (full["message"] != "").all()
    with pytest.raises(TypeError, match="messages must be True or False; got str: 'no'"):
        long_run.overflows(messages="no")  # type: ignore[arg-type]


def test_the_diagnosis_explains_its_own_event_and_the_report_summarises_the_runs(
    long_run: nantrace.Trace,
) -> None:
    d = long_run.diagnose()
    assert d.cause == "data" and d.overflow is not None
    assert d.overflow.message == long_run.first_overflow().message != ""
    out = io.StringIO()
    print_report(long_run, None, out)
    text = out.getvalue()
    assert "steps with a non-finite value (27), by first producer:" in text
    assert "  step 3        data      `` input[0] nan" in text
