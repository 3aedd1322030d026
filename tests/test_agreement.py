"""``str(Overflow)`` and ``tr.diagnose()`` never contradict each other: every scenario of the suite's fault zoo
(the CASES of ``test_cases.py``, the diagnosis cases of ``test_diagnose.py`` and the op classes of
``test_evidence.py``) is run again with every Trace it makes collected, and on each Trace the op class, the
headline and the cause class named by both agree."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import pytest
import test_cases
import test_diagnose
import test_evidence

import nantrace
from nantrace._diagnosis import HEADLINE_MAX
from nantrace._evidence import CLASS_CAUSE


def _scenarios() -> list[tuple[str, Callable[[], None]]]:
    out = []
    for mod in (test_cases, test_diagnose):
        for name, fn in inspect.getmembers(mod, inspect.isfunction):
            if (
                name.startswith("test_")
                and fn.__module__ == mod.__name__
                and not inspect.signature(fn).parameters
            ):
                out.append((f"{mod.__name__}.{name}", fn))
    for case in test_evidence.CLASSES:
        out.append((f"test_evidence[{case[0]}]", lambda c=case: test_evidence._run(c[1], c[2]) and None))
    return out


SCENARIOS = _scenarios()


def _check(tr: nantrace.Trace) -> int:
    """Assert the agreement on one Trace; 1 when it held an event whose op was classed, else 0."""
    ov = tr.first_overflow()
    d = tr.diagnose()
    assert len(str(d).splitlines()[0]) <= HEADLINE_MAX
    if ov is None:
        return 0
    assert len(str(ov).splitlines()[0]) <= HEADLINE_MAX
    if d.overflow != ov:  # the diagnosis is about another event (a benign backoff passed over)
        return 0
    assert d.op_class == ov.op_class
    assert d.headline == str(ov).splitlines()[0]
    if ov.phase == "forward" and d.cause in ("forward_overflow", "invalid_op"):
        assert ov.op_class is not None and d.cause == CLASS_CAUSE[ov.op_class]
    if ov.op_class in ("singular", "invalid", "mask_arithmetic"):  # neither text calls it an overflow
        assert "overflowed" not in str(ov).splitlines()[0] and "overflowed" not in d.summary
    return int(ov.op_class is not None)


@pytest.mark.parametrize(("name", "scenario"), SCENARIOS, ids=[s[0] for s in SCENARIOS])
def test_overflow_text_and_diagnosis_agree(
    name: str, scenario: Callable[[], None], monkeypatch: pytest.MonkeyPatch
) -> None:
    made: list[nantrace.Trace] = []
    real_trace, real_watch = nantrace.trace, nantrace.watch

    def trace(*a: Any, **k: Any) -> nantrace.Trace:
        tr = real_trace(*a, **k)
        made.append(tr)
        return tr

    def watch(*a: Any, **k: Any) -> nantrace.Trace:
        tr = real_watch(*a, **k)
        made.append(tr)
        return tr

    monkeypatch.setattr(nantrace, "trace", trace)
    monkeypatch.setattr(nantrace, "watch", watch)
    scenario()
    monkeypatch.undo()
    for tr in made:
        _check(tr)


def test_the_zoo_holds_every_op_class() -> None:
    assert {c[5] for c in test_evidence.CLASSES} == set(CLASS_CAUSE)
    assert len(SCENARIOS) >= 30
