"""An op that runs inside a user's forward or forward-pre hook is named as the hook's: the replay runs the call
with its hooks, and the drill-down says which hook (its name, kind and module) the producing op ran in, so the
advice is to fix the hook, not the module. Faults are explicit arithmetic (``x * 1e39`` past float32's max,
``0 / 0``)."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import pytest
import torch
from conftest import sgd_run
from torch import nn

import nantrace


def _scale_up(module: nn.Module, inputs: Any, output: torch.Tensor) -> torch.Tensor:
    return output * 1e39  # beyond float32's 3.4e38 for any |x| > 0.34


def _pre_scale(module: nn.Module, args: tuple[Any, ...]) -> tuple[torch.Tensor]:
    return (args[0] * 1e39,)


class Steer:
    """A hook kept as a bound method: ``apply`` multiplies by 0 and divides by 0 (0/0 = NaN)."""

    def apply(self, module: nn.Module, inputs: Any, output: torch.Tensor) -> torch.Tensor:
        return output.mul(0.0).div(0.0)


def _run(mode: str, register: Callable[[nn.Sequential], Any]) -> nantrace.Trace:
    """Two SGD steps (:func:`conftest.sgd_run`); the hook is registered before step 1 (inside the trace) and
    removed after it."""
    result: nantrace.Trace = sgd_run(mode, 2, lambda m, step: register(m) if step == 1 else None)
    return result


@pytest.mark.parametrize("mode", ["trace", "watch"])
def test_an_overflow_in_a_forward_hook_is_named_as_the_hooks(mode: str) -> None:
    tr = _run(mode, lambda m: m[0].register_forward_hook(_scale_up))
    ov = tr.first_overflow()
    assert ov is not None
    assert (ov.step, ov.phase, ov.module, ov.module_type, ov.kind) == (1, "forward", "0", "Linear", "inf")
    lines = str(ov).splitlines()
    assert lines[0] == "step 1 forward: `0` (`mul`) overflowed float32 (+inf)"
    assert " produced +inf in `mul` at " in lines[1]
    line = _scale_up.__code__.co_firstlineno + 1  # its one line of arithmetic
    assert lines[1].endswith(
        f"test_hook_ops.py:{line} inside the forward hook `_scale_up` on `0` (float32), from finite inputs (input "
        "absmax 1); float32 overflows above 3.403e+38 (torch.finfo(torch.float32).max)."
    )
    assert lines[3] == "`mul` ran inside the forward hook `_scale_up` on `0`, not in a module's forward"
    row = tr.ops.iloc[0]
    assert json.loads(row["operands"])["hook"] == {"name": "_scale_up", "kind": "forward hook", "module": ""}
    d = tr.diagnose()
    assert d.cause == "forward_overflow"
    assert d.summary == (
        "`0` (Linear) overflowed float32 at step 1 in your forward hook `_scale_up` on `0`: its `mul` exceeded "
        "3.403e+38 from finite inputs (not a module's forward)."
    )
    fix = (
        "`mul` ran in your forward hook `_scale_up` on `0`, not in a module's forward: fix the hook's arithmetic "
        "(what it scales, adds or replaces), or remove the hook to confirm that the model alone stays finite."
    )
    # neither the Linear's weights nor its range ("lower the learning rate if they grew") is the fix
    assert d.advice == [fix]
    assert lines[-1].startswith(fix)  # watch adds that it replayed the step


def test_an_overflow_in_a_childs_forward_pre_hook_is_named_on_that_child() -> None:
    """The pre-hook of `2` runs inside the root's call, between its submodules: the event is the root's (the
    value is first seen as `2`'s input), and the op is named as the pre-hook's of `2`."""
    tr = _run("trace", lambda m: m[2].register_forward_pre_hook(_pre_scale))
    ov = tr.first_overflow()
    assert ov is not None and (ov.module, ov.tensor) == ("", "input[0]")
    assert (
        str(ov).splitlines()[3]
        == "`mul` ran inside the forward-pre hook `_pre_scale` on `2`, not in a module's forward"
    )
    d = tr.diagnose()
    assert (
        "first seen at `input[0]` of a submodule: the overflow is in the forward-pre hook `_pre_scale` on `2`, which "
        "ran inside the root model's call between its submodules (every submodule output before it was finite)"
    ) in d.evidence
    assert not any(a.startswith("The op that overflows is in the root model's own forward") for a in d.advice)


def test_an_invalid_op_in_a_bound_method_hook_is_named_by_its_qualname() -> None:
    tr = _run("trace", lambda m: m[0].register_forward_hook(Steer().apply))
    d = tr.diagnose()
    assert d.cause == "invalid_op" and d.overflow is not None and d.overflow.module == "0"
    assert d.summary == (
        "`0` hit a singular point at step 1 (`div` in your forward hook `Steer.apply` on `0`: 0/0): not an "
        "overflow."
    )


def test_a_global_forward_hook_is_named_as_global() -> None:
    handles: list[Any] = []

    def register(model: nn.Sequential) -> Any:
        handles.append(torch.nn.modules.module.register_module_forward_hook(_scale_up))
        return handles[-1]

    try:
        tr = _run("trace", register)
    finally:
        for h in handles:
            h.remove()
    ov = tr.first_overflow()
    assert ov is not None and ov.module == "0"
    assert (
        str(ov).splitlines()[3]
        == "`mul` ran inside the global forward hook `_scale_up`, not in a module's forward"
    )


def test_an_op_of_the_modules_own_forward_names_no_hook() -> None:
    """The same overflow written in a forward, with a harmless hook registered: no hook is named."""

    class Big(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x * 1e39

    model = nn.Sequential(Big())
    model[0].register_forward_hook(lambda m, i, o: None)
    with nantrace.trace(model) as tr:
        model(torch.ones(2, 2))
    ov = tr.first_overflow()
    assert ov is not None
    assert "hook" not in json.loads(tr.ops.iloc[0]["operands"])
    assert (
        str(ov)
        .splitlines()[1]
        .endswith(
            "inside its forward (float32), from finite inputs (input absmax 1); "
            "float32 overflows above 3.403e+38 (torch.finfo(torch.float32).max)."
        )
    )
