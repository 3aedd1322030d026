"""A loop that calls the traced model's submodules itself, never the model: what the loop hands a submodule is
made outside the model, and watch, whose sentinel sits on the model's own forward, says it cannot replay."""

from __future__ import annotations

import warnings
from typing import Any

import torch
import torch.nn as nn

import nantrace


def _run(make: Any, poison: bool = True) -> tuple[nantrace.Trace, list[str]]:
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1))
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    with warnings.catch_warnings(record=True) as caught, make(m, optimizer=opt) as tr:
        warnings.simplefilter("always")
        for s in range(3):
            x = torch.randn(2, 4)
            h = m[0](x)
            if s == 1 and poison:
                h = h * torch.tensor([float("inf"), 1.0, 1.0, 1.0])  # the loop's own code makes +inf
            loss = m[1](h).sum()
            loss.backward()
            tr.step(loss=loss)
            opt.step()
            opt.zero_grad()
    return tr, [str(w.message) for w in caught]


def _watch(m: nn.Module, **kw: Any) -> Any:
    return nantrace.watch(m, every=None, **kw)


def test_a_value_the_loop_hands_to_a_submodule_is_made_outside_the_model() -> None:
    tr, _ = _run(nantrace.trace)
    ov = tr.first_overflow()
    assert ov is not None
    assert (ov.step, ov.micro_step, ov.phase, ov.module, ov.call, ov.tensor, ov.kind) == (
        1, 0, "forward", "1", 0, "input[0]", "inf",
    )  # fmt: skip
    assert str(ov).splitlines()[0] == "step 1 forward: `input[0]` the loop handed to `1` held inf (float32)"
    assert (
        "At step 1 the loop called `1` itself, not inside a call of the model, and its `input[0]` already held 1 "
        "+inf value(s) when the call began: the value was made outside the model" in str(ov)
    )
    d = tr.diagnose()
    assert d.cause == "data"
    assert d.summary == (
        "`input[0]` of `1`, which the loop called itself, was already non-finite at step 1: made outside the "
        "model, not by a module."
    )
    assert d.evidence[0].startswith(
        "input `input[0]` (argument `input`) of `1`, shape (2, 4), dtype float32, held 1 +inf"
    )


def test_a_value_made_inside_a_submodule_the_loop_calls_is_still_that_submodules() -> None:
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1))
    with nantrace.trace(m) as tr:
        with torch.no_grad():
            m[1].weight.fill_(3e38)  # finite weights whose products overflow float32
        loss = m[1](m[0](torch.ones(2, 4))).sum()
        loss.backward()
        tr.step(loss=loss)
    ov = tr.first_overflow()
    assert ov is not None and (ov.phase, ov.module, ov.tensor) == ("forward", "1", "output")
    assert tr.diagnose().cause == "forward_overflow"


def test_watch_warns_once_when_the_loop_never_calls_the_watched_model() -> None:
    _, caught = _run(_watch, poison=False)
    said = [w for w in caught if "without a call of the model it watches" in w]
    assert said == [
        "nantrace.watch: step 0 ended without a call of the model it watches (Sequential): the sentinel checks "
        "that model's inputs and outputs, so a loop that calls its submodules itself is seen only through its "
        "gradients and parameters, and a step that goes non-finite cannot be replayed. Pass watch() the module "
        "the loop calls, or use nantrace.trace()"
    ]


def test_watch_says_it_did_not_replay_a_step_without_a_forward_of_the_watched_model() -> None:
    tr, _ = _run(_watch)
    assert tr.steps["recorded"].tolist() == ["watch", "not_replayed", "not_replayed"]
    assert tr.options["watch"]["sentinel"]["1"]["no_forward"] is True
    ov = tr.first_overflow()
    assert ov is not None and ov.step == 1
    assert (
        "but did not replay the step: the loop did not call the watched model in it (it called submodules "
        "itself), so there was no forward to replay and its producer is unknown" in str(ov)
    )
    d = tr.diagnose()
    assert d.summary == f"Step 1 went non-finite ({ov.phase}), but watch did not replay it."
    assert d.advice[1] == (
        "Pass nantrace.watch() the module the loop calls (or call the watched model), or trace the step with "
        "nantrace.trace(): watch replays only calls of the model it watches."
    )
