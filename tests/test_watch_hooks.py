"""A watched step runs without nantrace's hooks on the modules below the root and on the parameters (PyTorch's
fast call path, no hook of nantrace's in autograd); a full step and a replay have them back, each at its place
among the user's hooks."""

from __future__ import annotations

import math
from typing import Any

import torch
from conftest import TwoLinear

import nantrace


def _names(table: Any, users: dict[int, str]) -> list[str]:
    return [users.get(id(fn), "nantrace") for fn in (table or {}).values()]


def test_a_watched_step_has_no_nantrace_hook_below_the_root_and_a_full_step_has_them_back_in_order() -> None:
    torch.manual_seed(0)
    model = TwoLinear()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)

    def before(m: Any, a: Any) -> None:
        return None

    def after(m: Any, a: Any) -> None:
        return None

    def p_before(p: Any) -> None:
        return None

    def p_after(p: Any) -> None:
        return None

    users = {id(f): f.__name__ for f in (before, after, p_before, p_after)}
    model.fc1.register_forward_pre_hook(before)
    model.fc1.weight.register_post_accumulate_grad_hook(p_before)
    seen = []

    def look() -> None:
        seen.append(
            (
                _names(model.fc1._forward_pre_hooks, users),
                _names(model.fc1.weight._post_accumulate_grad_hooks, users),
                len(model.fc2._forward_hooks),
                len(model.fc2.weight._backward_hooks or {}),
            )
        )

    with nantrace.watch(model, optimizer=opt, every=2) as tr:
        for step in range(3):
            look()
            opt.zero_grad()
            model(torch.ones(3, 4)).pow(2).mean().backward()
            opt.step()
            if step == 1:  # registered while nantrace's hooks were out of their tables
                model.fc1.register_forward_pre_hook(after)
                model.fc1.weight.register_post_accumulate_grad_hook(p_after)
    assert seen == [
        (["before", "nantrace"], ["p_before", "nantrace"], 1, 1),  # step 0: full
        (["before"], ["p_before"], 0, 0),  # step 1: watched
        (["before", "nantrace", "after"], ["p_before", "nantrace", "p_after"], 1, 1),  # step 2: full
    ]
    assert tr.steps["recorded"].tolist() == ["full", "watch", "full"]
    fc1 = tr.records[(tr.records["module"] == "fc1") & (tr.records["tensor"] == "output")]
    assert fc1["step"].tolist() == [0, 2]
    assert _names(model.fc1._forward_pre_hooks, users) == ["before", "after"]
    assert _names(model.fc1.weight._post_accumulate_grad_hooks, users) == ["p_before", "p_after"]
    assert len(model.fc2._forward_hooks) == 0 and len(model.fc2.weight._backward_hooks or {}) == 0


def test_a_replayed_step_records_through_the_hooks_put_back_and_takes_them_out_again() -> None:
    torch.manual_seed(0)
    model = TwoLinear()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    counts = []  # nantrace forward hooks on fc1 before each step and after the last
    with nantrace.watch(model, optimizer=opt, every=None) as tr:
        for step in range(3):
            counts.append(len(model.fc1._forward_hooks))
            opt.zero_grad()
            x = torch.full((3, 4), float("nan") if step == 2 else 1.0)
            model(x).pow(2).mean().backward()
            opt.step()
        counts.append(len(model.fc1._forward_hooks))  # after the replay of step 2
    assert counts == [
        0,
        0,
        0,
        0,
    ]  # every step watched: nantrace's hooks out of the tables, after the replay too
    assert tr.steps["recorded"].tolist() == ["watch", "watch", "replay"]
    ov = tr.first_overflow()
    assert ov is not None and (ov.step, ov.phase, ov.module, ov.tensor, ov.kind) == (
        2,
        "data",
        "",
        "input[0]",
        "nan",
    )
    step2 = tr.records[tr.records["step"] == 2]
    assert sorted(set(step2["module"])) == ["", "act", "fc1", "fc2"]  # the replay recorded every module


class _SetAfterStep(torch.optim.SGD):
    """SGD whose step then writes ``values`` into the first weight's first elements (a stand-in for an update
    that leaves them so)."""

    def __init__(self, params: Any, values: list[float]) -> None:
        super().__init__(params, lr=0.0)
        self.values = values

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        out = super().step(closure)
        w = self.param_groups[0]["params"][0]
        w.view(-1)[: len(self.values)] = torch.tensor(self.values)
        return out


def _post_step(values: list[float]) -> nantrace.Trace:
    torch.manual_seed(0)
    model = TwoLinear()
    opt = _SetAfterStep(model.parameters(), values)
    with nantrace.watch(model, optimizer=opt, every=None) as tr:
        opt.zero_grad()
        model(torch.ones(3, 4)).pow(2).mean().backward()
        opt.step()
    return tr


def test_a_parameter_sum_that_overflows_float32_from_finite_values_is_no_optimizer_fault() -> None:
    tr = _post_step([3e38, 3e38])  # the float32 sum of fc1.weight is inf, every element is finite
    assert tr.first_overflow() is None
    assert tr.steps["recorded"].tolist() == ["watch"]


def test_the_post_step_check_names_a_parameter_that_holds_minus_inf_and_nan_as_inf() -> None:
    tr = _post_step([-math.inf, math.nan])  # its sum is NaN; the elements hold -inf, which comes first
    ov = tr.first_overflow()
    assert ov is not None
    assert (ov.step, ov.phase, ov.module, ov.tensor, ov.kind) == (0, "optimizer", "fc1", "weight", "inf")
    note = tr.options["watch"]["sentinel"]["0"]
    assert (note["phase"], note["module"], note["tensor"], note["kind"], note["value"]) == (
        "optimizer",
        "fc1",
        "weight",
        "inf",
        "-inf",
    )
