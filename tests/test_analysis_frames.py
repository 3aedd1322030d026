"""The analysis (locator, explanations, diagnosis) on built ``records`` frames: no model, no forward pass.

Each frame is a handful of rows shaped as the recorder writes them (``conftest.records_frame``), so every rule is
checked on exactly the facts it reads."""

from __future__ import annotations

import inspect
from pathlib import Path

from conftest import frame_view, records_frame, steps_frame

from nantrace import _diagnose
from nantrace._explain import first_overflow, overflows
from nantrace._locate import find
from nantrace._schema import KINDS


def _line_of(fn: object, needle: str) -> str:
    """``file:line`` of the line of ``fn``'s source that holds ``needle`` (what ``tr.ops.source`` records)."""
    lines, first = inspect.getsourcelines(fn)  # type: ignore[arg-type]
    at = next(i for i, text in enumerate(lines) if needle in text)
    return f"{inspect.getsourcefile(fn)}:{first + at}"  # type: ignore[arg-type]


def _forward_inf_rows() -> list[dict]:
    return [
        {"phase": "data", "module": "", "module_type": "Net", "tensor": "input[0]", "absmax": 2.0},
        {"phase": "forward", "module": "fc", "tensor": "input[0]", "parent": "", "absmax": 2.0},
        {
            "phase": "forward",
            "module": "fc",
            "tensor": "output",
            "parent": "",
            "n_posinf": 3,
            "absmax": 60000.0,
        },
        {"phase": "forward", "module": "", "module_type": "Net", "tensor": "output", "n_posinf": 3},
    ]


def test_a_module_output_holding_a_new_kind_is_its_producer() -> None:
    ov = first_overflow(frame_view(records_frame(_forward_inf_rows())))
    assert ov is not None
    assert ov.to_dict() == {
        "step": 0,
        "micro_step": 0,
        "phase": "forward",
        "module": "fc",
        "module_type": "Linear",
        "call": 0,
        "tensor": "output",
        "kind": "inf",
        "dtype": "float16",
        "rank": 0,
        "propagated": False,
    }
    assert str(ov).splitlines()[0] == "step 0 forward: `fc` (Linear) overflowed float16 (+inf)"
    assert " ".join(str(ov).splitlines()[1:]).startswith(
        "At step 0, `fc` (Linear, call 0) produced +inf in its `output` (float16), from finite inputs "
        "(input absmax 2); float16 overflows above 65504 (torch.finfo(torch.float16).max)."
    )


def test_first_overflow_and_overflows_give_the_same_event_the_same_message() -> None:
    view = frame_view(records_frame(_forward_inf_rows()))
    ov = first_overflow(view)
    table = overflows(view)
    assert ov is not None and table["message"].tolist() == [ov.message]


def test_a_mask_input_of_zeros_and_minus_inf_is_never_reported() -> None:
    rows = [
        {"phase": "data", "module": "", "module_type": "Net", "tensor": "input[0]"},
        {"phase": "data", "module": "", "module_type": "Net", "tensor": "input[1]", "arg": "attention_mask"}
        | {"n_neginf": 8, "n_zero": 8, "numel": 16},
        {"phase": "forward", "module": "attn", "tensor": "output", "parent": "", "n_neginf": 8, "n_zero": 8}
        | {"numel": 16},
    ]
    assert first_overflow(frame_view(records_frame(rows))) is None


def test_a_kind_first_seen_at_a_child_input_is_the_parents_own_code() -> None:
    rows = [
        {"phase": "data", "module": "", "module_type": "Net", "tensor": "input[0]"},
        {"phase": "forward", "module": "block", "module_type": "Block", "tensor": "input[0]", "parent": ""},
        {"phase": "forward", "module": "block.fc", "tensor": "input[0]", "parent": "block", "n_posinf": 1},
    ]
    ov = first_overflow(frame_view(records_frame(rows)))
    assert ov is not None and (ov.phase, ov.module, ov.module_type, ov.tensor) == (
        "forward",
        "block",
        "Block",
        "input[0]",
    )


def test_a_backward_value_seen_by_several_hooks_belongs_to_the_parameter_owner() -> None:
    rows = [
        {"phase": "data", "module": "", "module_type": "Net", "tensor": "input[0]"},
        {"phase": "loss", "module": "", "module_type": "Net", "tensor": "grad_output[0]", "scale": 1024.0},
        {"phase": "backward", "module": "fc", "tensor": "grad_input[0]", "n_posinf": 2, "event": 7},
        {"phase": "backward", "module": "fc", "tensor": "weight.grad", "n_posinf": 2, "event": 7},
    ]
    ov = first_overflow(frame_view(records_frame(rows)))
    assert ov is not None and (ov.phase, ov.module, ov.tensor, ov.kind) == (
        "backward",
        "fc",
        "weight.grad",
        "inf",
    )


def test_across_ranks_the_producer_is_the_rank_whose_own_rows_hold_it() -> None:
    rows = [
        {"rank": 0, "phase": "data", "module": "", "module_type": "Net", "tensor": "input[0]"},
        {
            "rank": 0,
            "phase": "backward",
            "module": "fc",
            "tensor": "weight.grad",
            "reduced": True,
            "n_nan": 4,
        },
        {"rank": 1, "phase": "data", "module": "", "module_type": "Net", "tensor": "input[0]", "n_nan": 1},
        {
            "rank": 1,
            "phase": "backward",
            "module": "fc",
            "tensor": "weight.grad",
            "reduced": True,
            "n_nan": 4,
        },
    ]
    records = records_frame(rows)
    view = frame_view(records, world_size=2, ranks=[0, 1])
    ov = first_overflow(view)
    assert ov is not None and (ov.rank, ov.phase, ov.tensor, ov.kind, ov.propagated) == (
        1,
        "data",
        "input[0]",
        "nan",
        False,
    )
    assert (
        ov.message.splitlines()[0]
        == "step 0 data: model input `input[0]` held NaN before any module ran (float16)"
    )
    assert " ".join(ov.message.splitlines()[1:]).startswith(
        "Rank 1 of 2 produced it. At step 0 the model input `input[0]` already held 1 NaN"
    )
    assert ov.message.endswith(
        "Rank 0 only received it through the gradient reduction (propagated, not produced)."
    )
    per = overflows(view, per_rank=True)
    assert per[["rank", "phase", "propagated"]].values.tolist() == [[0, "backward", True], [1, "data", False]]
    assert _diagnose.diagnose(view).cause == "data"


def test_a_value_only_the_reduction_holds_was_made_by_the_reduction() -> None:
    rows = [
        {"rank": r, "phase": p, "module": m, "module_type": t, "tensor": n, "reduced": red, "n_posinf": k}
        for r in (0, 1)
        for p, m, t, n, red, k in (
            ("data", "", "Net", "input[0]", False, 0),
            ("backward", "fc", "Linear", "weight.grad", False, 0),
            ("backward", "fc", "Linear", "weight.grad", True, 2),
        )
    ]
    (found,) = find(records_frame(rows), KINDS, None, world_size=2, first_only=True)
    assert (found.how, found.event.rank, found.receivers) == ("reduction", 0, (0, 1))
    ov = first_overflow(frame_view(records_frame(rows), world_size=2, ranks=[0, 1]))
    assert ov is not None and (ov.rank, ov.propagated) == (0, False)
    assert "the reduction itself produced it" in ov.message


def test_diagnosis_of_built_frames_reads_the_steps_table() -> None:
    rows = _forward_inf_rows()
    steps = steps_frame([{"step": 0, "loss": 2.5, "scale": 65536.0, "next_scale": 65536.0, "skipped": False}])
    d = _diagnose.diagnose(frame_view(records_frame(rows), steps))
    assert d.cause == "forward_overflow" and d.overflow is not None and d.overflow.module == "fc"
    assert d.evidence[0] == (
        "`fc` (Linear, call 0) at step 0 turned finite inputs (absmax 2) into inf in float16, whose largest finite "
        "value is 65504"
    )


def test_a_live_trace_its_loaded_copy_and_its_rank_view_give_the_same_answers(tmp_path: Path) -> None:
    import torch
    from conftest import ScaledLinear

    import nantrace

    model = ScaledLinear(10000.0).half()  # 8 · 10000 · 1 = 80000 > 65504: +inf in the forward
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    with nantrace.trace(model, optimizer=opt) as tr:
        for _ in range(2):
            opt.zero_grad()
            model(torch.ones(2, 8, dtype=torch.float16)).float().sum().backward()
            opt.step()
    back = nantrace.load(tr.save(tmp_path / "run.nantrace"))
    one = back.rank_view(0)
    for other in (back, one):
        assert str(other.first_overflow()) == str(tr.first_overflow())
        assert other.first_overflow() == tr.first_overflow()
        assert other.overflows().equals(tr.overflows())
        assert other.diagnose().to_dict() == tr.diagnose().to_dict()
    ov = tr.first_overflow()
    assert ov is not None and (ov.phase, ov.module, ov.kind) == ("forward", "fc", "inf")


def test_an_op_found_by_the_drill_down_is_reported_at_the_output_that_holds_its_kind() -> None:
    import pandas as pd

    rows = [
        {"phase": "data", "module": "", "module_type": "Net", "tensor": "input[0]"},
        {"phase": "forward", "module": "", "module_type": "Net", "tensor": "output[0]"},
        {"phase": "forward", "module": "", "module_type": "Net", "tensor": "output[1]", "n_posinf": 2},
    ]
    view = frame_view(records_frame(rows))
    ops = pd.DataFrame([{"step": 0, "micro_step": 0, "module": "", "call": 0, "op": "exp", "kind": "posinf"}])
    view = view.__class__(view.records, view.steps, ops, view.meta)
    ov = first_overflow(view)
    assert ov is not None and (ov.tensor, ov.kind) == ("output[1]", "inf")
    assert "produced +inf in `exp` inside its forward (float16)" in str(ov)


def test_a_kind_made_between_children_is_drilled_to_the_enclosing_calls_op() -> None:
    import torch
    from torch import nn

    import nantrace

    class Between(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.b((self.a(x) * 0) * float("inf"))  # 0·inf between the children: NaN

    m = Between()
    with nantrace.trace(m) as tr:
        m(torch.ones(2, 4))
    assert tr.ops[["module", "call", "op", "kind"]].values.tolist() == [["", 0, "mul", "nan"]]
    ov = tr.first_overflow()
    assert ov is not None and (ov.phase, ov.module, ov.tensor, ov.kind) == ("forward", "", "input[0]", "nan")
    assert str(ov).splitlines()[0] == (
        "step 0 forward: the root model (`mul`) made NaN by an invalid operation: 0·inf (float32)"
    )
    assert " ".join(str(ov).splitlines()[1:]).startswith(
        "At step 0, the root model (Between, call 0) produced NaN in `mul` at "
        f"{_line_of(Between.forward, '* 0) * float')} in its own forward code, between its "
        "submodules (first seen at `input[0]` of `b`"
    )
