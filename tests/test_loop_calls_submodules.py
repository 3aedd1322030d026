"""A loop that calls the traced model's submodules itself, never the model: what the loop hands a submodule is
made outside the model, and watch, whose sentinel sits on the model's own forward, says it cannot replay."""

from __future__ import annotations

import warnings
from typing import Any

import torch
import torch.nn as nn

import nantrace


def _run(make: Any, poison: bool = True) -> tuple[nantrace.Trace, list[tuple[str, str]]]:
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
    return tr, [(str(w.message), w.filename) for w in caught]


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
    said = [w for w, _ in caught if "without a call of the model it watches" in w]
    assert [f for w, f in caught if "without a call of the model it watches" in w] == [
        __file__
    ]  # the loop's line
    assert said == [
        "nantrace.watch: step 0 ended without a call of the model it watches (Sequential): the sentinel checks "
        "that model's inputs and outputs, so a loop that calls its submodules itself is seen only through the "
        "loss it gives tr.step(), its gradients and parameters, and a step that goes non-finite cannot be "
        "replayed. Pass watch() the module the loop calls, or use nantrace.trace()"
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


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.a(x) * torch.tensor([float("inf"), 1.0, 1.0, 1.0]))  # its own code makes +inf


def test_a_submodules_own_code_between_its_children_is_its_fault_when_the_loop_calls_it() -> None:
    torch.manual_seed(0)
    m = nn.Sequential(_Block(), nn.Linear(4, 1))
    with nantrace.trace(m) as tr:
        loss = m[1](m[0](torch.randn(2, 4))).sum()
        loss.backward()
        tr.step(loss=loss)
    ov = tr.first_overflow()
    assert ov is not None and (ov.phase, ov.module, ov.module_type, ov.tensor) == (
        "forward", "0", "_Block", "input[0]",
    )  # fmt: skip
    assert "produced +inf in its own forward code, between its submodules" in str(ov)
    assert tr.diagnose().cause == "forward_overflow"


def test_a_submodule_the_loop_calls_before_the_model_is_call_0_and_inside_it_call_1() -> None:
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1))
    opt = torch.optim.SGD(m.parameters(), lr=0.01)
    with nantrace.trace(m, optimizer=opt) as tr:
        for s in range(2):
            aux_in = torch.randn(2, 4)
            if s == 1:
                aux_in[0, 0] = float("inf")
            aux = m[0](aux_in).sum()  # the loop's own call, before the model's
            loss = m(torch.randn(2, 4)).sum() + aux
            loss.backward()
            tr.step(loss=loss)
            opt.step()
            opt.zero_grad()
    r = tr.records
    ins = r[(r["step"] == 1) & (r["module"] == "0") & (r["tensor"] == "input[0]")]
    assert ins["call"].tolist() == [0, 1] and ins["parent"].isna().tolist() == [True, False]
    ov = tr.first_overflow()
    assert ov is not None and (ov.step, ov.module, ov.call, ov.tensor) == (1, "0", 0, "input[0]")
    assert tr.diagnose().cause == "data"


def test_an_evaluation_that_calls_submodules_under_no_grad_is_not_recorded_in_a_training_trace() -> None:
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1))
    opt = torch.optim.SGD(m.parameters(), lr=0.01)
    with nantrace.trace(m, optimizer=opt) as tr:
        for _ in range(3):
            loss = m(torch.randn(2, 4)).sum()
            loss.backward()
            tr.step(loss=loss)
            opt.step()
            opt.zero_grad()
            with torch.no_grad():  # an evaluation pass on a NaN batch, calling the submodules itself
                m[1](m[0](torch.full((2, 4), float("nan"))))
    assert tr.first_overflow() is None
    assert tr.steps["step"].tolist() == [0, 1, 2]
    assert len(tr.records[tr.records["step"] == 1]) == len(tr.records[tr.records["step"] == 0])
