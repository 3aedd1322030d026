"""Live and loaded agree (issue 18 item 9): every scenario of the test suite's case files is run with its
traces captured, then each trace is saved and loaded back, and the loaded trace must answer exactly as the live
one: ``first_overflow()`` (every kind: fields and message), ``overflows()`` and ``diagnose().to_dict()``.

The scenarios are the test functions themselves (CASES C01-C14 in ``test_cases.py``, the diagnosis scenarios
of ``test_diagnose.py``, the locator facts of ``test_locator_facts.py``, and those of ``test_watch.py`` and
``test_why.py`` that take no fixture): whatever trace they build, through ``nantrace.trace`` or
``nantrace.watch``, is compared."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pandas as pd
import pytest
import test_cases
import test_diagnose
import test_locator_facts
import test_watch
import test_why
import torch
from torch import nn

import nantrace

SOURCES = (test_cases, test_diagnose, test_locator_facts, test_watch, test_why)
NO_TRACE = {  # scenarios over built frames or the other tests' tables: they run no trace
    "test_diagnose.test_every_cause_is_covered_above",
    "test_why.test_grad_norm_never_recorded_says_so",
    "test_why.test_grad_norm_recorded_once_is_not_a_trend",
    "test_why.test_grad_norm_trend_quotes_first_and_last_values_with_their_steps",
}
# scenarios whose answer rests on a fact only the live model holds (a weight written outside optimizer.step(),
# read at diagnose time): a loaded trace has no model to read, so it answers without that fact
LIVE_ONLY = {
    "test_diagnose.test_a_nan_written_into_a_norm_weight_between_steps_is_named_from_the_live_model",
}


def _scenarios() -> list[Any]:
    """Every test function of the case files that takes no argument and is not parametrized."""
    out = []
    for mod in SOURCES:
        for name, fn in sorted(vars(mod).items()):
            if not name.startswith("test_") or not callable(fn) or getattr(fn, "pytestmark", None):
                continue
            if inspect.signature(fn).parameters or f"{mod.__name__}.{name}" in NO_TRACE | LIVE_ONLY:
                continue
            out.append(pytest.param(fn, id=f"{mod.__name__}.{name}"))
    return out


def _answers(tr: nantrace.Trace) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for kind in (None, "inf", "nan"):
        ov = tr.first_overflow(kind)
        out[f"first_overflow({kind})"] = None if ov is None else (ov, str(ov), ov.to_dict())
    out["diagnose"] = tr.diagnose().to_dict()
    return out


def _captured(monkeypatch: pytest.MonkeyPatch) -> list[nantrace.Trace]:
    traces: list[nantrace.Trace] = []
    for name in ("trace", "watch"):
        made: Callable[..., nantrace.Trace] = getattr(nantrace, name)

        def keep(*args: Any, _made: Callable[..., nantrace.Trace] = made, **kwargs: Any) -> nantrace.Trace:
            tr = _made(*args, **kwargs)
            traces.append(tr)
            return tr

        monkeypatch.setattr(nantrace, name, keep)
    return traces


@pytest.mark.parametrize("scenario", _scenarios())
def test_a_loaded_trace_answers_as_the_live_one(
    scenario: Callable[[], None], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    traces = _captured(monkeypatch)
    scenario()
    monkeypatch.undo()
    compared = 0
    for i, tr in enumerate(traces):
        if tr._recording is None or not tr._recording.entered or not len(tr.steps):
            continue  # a trace the scenario built but never ran (an argument check)
        live = _answers(tr)
        live_ovs = tr.overflows()
        back = nantrace.load(tr.save(tmp_path / f"t{i}.nantrace"))
        loaded = _answers(back)
        for key in live:
            assert loaded[key] == live[key], key
        pd.testing.assert_frame_equal(back.overflows(), live_ovs)
        compared += 1
    assert compared, "the scenario ran no trace"


class RMSNorm(nn.Module):
    """Hand-written, with the name of a torch layer (``torch.nn.RMSNorm``): not torch's own forward."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True))


def test_which_modules_run_torchs_own_forward_is_saved(tmp_path: Path) -> None:
    model = nn.Sequential(nn.Linear(2, 2), RMSNorm())
    with nantrace.trace(model) as tr:
        model(torch.ones(1, 2))
    back = nantrace.load(tr.save(tmp_path / "t.nantrace"))
    assert back.header["builtin_modules"] == ["", "0"]  # the Sequential root and the Linear; not `1`


class Block(nn.Module):
    """``inner``, a Linear(2→2) with weights 1000, of an input 100: 2e5, past float16's 65504."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Linear(2, 2, bias=False)
        with torch.no_grad():
            self.inner.weight.fill_(1000.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x)


def test_what_a_modules_filter_left_out_is_saved(tmp_path: Path) -> None:
    model = nn.Sequential(Block()).half()
    with nantrace.trace(model, modules=["0"]) as tr:
        model(torch.full((1, 2), 100.0, dtype=torch.float16))
    ov = tr.first_overflow()
    assert ov is not None and (ov.module, ov.tensor, ov.kind) == ("0", "output", "inf")
    assert str(ov).splitlines()[-1] == (
        "(Only the modules matching modules=['0'] were traced: an untraced submodule inside the reported one "
        "may be the real producer.)"
    )
    back = nantrace.load(tr.save(tmp_path / "t.nantrace"))
    assert back.header["untraced_modules"] == ["0.inner"]
    assert str(back.first_overflow()) == str(ov)
