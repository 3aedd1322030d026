"""nantrace.plot takes a Trace (duck typed) as well as its DataFrames: which step, phase and overflow it shows."""

from __future__ import annotations

import ast
import math
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pandas as pd
import pytest
import torch
from torch import nn

import nantrace
from nantrace import plot

PLOT_SOURCE = Path(plot.__file__)


class Masked(nn.Module):
    """Zeroes what an additive 0/-inf mask hides: its -inf input is a mask, not an overflow."""

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return x.masked_fill(mask == float("-inf"), 0.0)


class Net(nn.Module):
    """``out(mask(lin(x), mask))`` in float16 with weights 1 (lin) and 2 (out): for ``x`` filled with v,
    lin gives 2v, the mask keeps [2v, 0] and out gives 4v, past 65504 (inf) for v > 16376."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(2, 2, bias=False)
        self.mask = Masked()
        self.out = nn.Linear(2, 2, bias=False)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return self.out(self.mask(self.lin(x), mask))


def _masked_trace(values: tuple[float, ...]) -> Any:
    """One step per call (no optimizer), ``x`` filled with each of ``values``, a 0/-inf mask every step."""
    model = Net().half()
    with torch.no_grad():
        model.lin.weight.fill_(1.0)
        model.out.weight.fill_(2.0)
    mask = torch.tensor([[0.0, float("-inf")]], dtype=torch.float16)
    with nantrace.trace(model) as tr:
        for v in values:
            model(torch.full((1, 2), v, dtype=torch.float16), mask)
    return tr


@pytest.fixture(scope="module")
def masked() -> Any:
    """Steps 0..3 with x = 1, 100, 20000, 30000: `out` overflows (4 * 20000 > 65504) first at step 2."""
    return _masked_trace((1.0, 100.0, 20000.0, 30000.0))


@pytest.fixture(scope="module")
def clean() -> Any:
    """Steps 0..2 with x = 1, 2, 3: never overflows (the mask's -inf is still recorded)."""
    return _masked_trace((1.0, 2.0, 3.0))


def _by_gid(ax: Any, gid: str) -> Any:
    (found,) = [a for a in ax.get_children() if a.get_gid() == gid]
    return found


def _second_line(title: str) -> str:
    return title.split("\n")[1]


def _notes(title: str) -> list[str]:
    """The lines of a title after its first: where the first NaN/inf and the first overflow are."""
    return title.split("\n")[1:]


# --------------------------------------------------------------------------------------------
# ranges: which step and phase it shows
# --------------------------------------------------------------------------------------------


def test_ranges_of_a_trace_shows_the_first_overflow_step(masked: Any) -> None:
    ax = plot.ranges(masked).axes[0]
    assert ax.get_title(loc="left") == (
        "Value range per module at step 2, phase forward (4 modules, 2 with NaN/inf)\n"
        "first overflow in the trace: step 2, forward, 'out' output (inf)"
    )
    labels = ax.get_yticklabels()
    assert [t.get_text() for t in labels] == ["lin (Linear)", "mask (Masked)", "out (Linear)", "<root> (Net)"]
    # `mask` and the root took the mask's -inf as input: not red (a mask is never an overflow)
    assert [t.get_color() for t in labels] == ["black", "black", "red", "red"]


def test_ranges_of_the_records_alone_passes_over_the_mask(masked: Any) -> None:
    # without the locator, the first NaN/inf in phase forward: `out`'s inf at step 2, not the mask's -inf
    ax = plot.ranges(masked.records).axes[0]
    assert (
        ax.get_title(loc="left")
        == "Value range per module at step 2, phase forward (4 modules, 2 with NaN/inf)"
    )


def test_ranges_of_a_trace_at_a_given_step_and_phase(masked: Any) -> None:
    ax = plot.ranges(masked, 1).axes[0]
    assert ax.get_title(loc="left") == (
        "Value range per module at step 1, phase forward (4 modules, 0 with NaN/inf)\n"
        "first overflow in the trace: step 2, forward, 'out' output (inf)"
    )
    # the first overflow (forward) is not in phase data, which holds only the mask's -inf: the last step
    ax = plot.ranges(masked, phase="data").axes[0]
    assert ax.get_title(loc="left").split("\n")[0] == (
        "Value range per module at step 3, phase data (1 modules, 0 with NaN/inf)"
    )
    assert [t.get_text() for t in ax.get_yticklabels()] == ["<root> (Net)"]


def test_ranges_of_a_trace_whose_first_overflow_is_in_another_phase() -> None:
    """A GradScaler's backoff (scaled gradients overflow in backward) comes first; the forward overflow later."""
    lin = nn.Linear(2, 2, bias=False)
    model = nn.Sequential(lin)
    with torch.no_grad():
        lin.weight.fill_(1.0)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**127)
    with nantrace.trace(model, scaler=scaler, optimizer=opt) as tr:
        # step 0: weight.grad = 4 * 2**127 = inf (skipped, scale halves); step 2: 2e38 + 2e38 = inf in forward
        for v in (4.0, 1.0, 2e38):
            opt.zero_grad()
            scaler.scale(model(torch.full((1, 2), v)).sum()).backward()
            scaler.step(opt)
            scaler.update()
    overflow = "first overflow in the trace: step 0, backward, '0' weight.grad (inf)"
    forward = plot.ranges(tr).axes[0].get_title(loc="left")
    assert (
        forward == f"Value range per module at step 2, phase forward (2 modules, 2 with NaN/inf)\n{overflow}"
    )
    backward = plot.ranges(tr, phase="backward").axes[0].get_title(loc="left")
    assert (
        backward
        == f"Value range per module at step 0, phase backward (1 modules, 1 with NaN/inf)\n{overflow}"
    )
    every = plot.ranges(tr, phase=None).axes[0].get_title(loc="left")
    assert every.startswith("Value range per module at step 0, all phases")
    assert _notes(plot.heatmap(tr).axes[0].get_title(loc="left")) == [
        "first non-finite value at step 2 in '0', '<root>'",
        overflow,
    ]


def test_ranges_of_a_trace_without_overflow_shows_the_last_step(clean: Any) -> None:
    ax = plot.ranges(clean).axes[0]
    assert ax.get_title(loc="left") == (
        "Value range per module at step 2, phase forward (4 modules, 0 with NaN/inf)\n"
        "no overflow: the locator found no NaN/inf produced in this trace"
    )


# --------------------------------------------------------------------------------------------
# the other figures
# --------------------------------------------------------------------------------------------


def test_heatmap_of_a_trace_names_the_locators_first_overflow(masked: Any) -> None:
    ax = plot.heatmap(masked).axes[0]
    assert _notes(ax.get_title(loc="left")) == [
        "first non-finite value at step 2 in 'out', '<root>'",  # the magenta: never the mask's -inf
        "first overflow in the trace: step 2, forward, 'out' output (inf)",
    ]
    assert [t.get_text() for t in ax.get_yticklabels()] == ["lin", "mask", "out", "<root>"]
    from_records = plot.heatmap(masked.records).axes[0]
    assert _notes(from_records.get_title(loc="left")) == [
        "first non-finite value at step 2 in 'out', '<root>'"
    ]


def test_heatmap_of_a_trace_without_overflow_says_so(clean: Any) -> None:
    title = plot.heatmap(clean).axes[0].get_title(loc="left")
    # the mask's -inf of every step is no magenta cell
    assert _notes(title) == ["no overflow: the locator found no NaN/inf produced in this trace"]
    assert not plot.nonfinite_grid(clean).to_numpy().any()


def test_grids_of_a_trace_are_those_of_its_records(masked: Any) -> None:
    grid = plot.heatmap_grid(masked, value="log2_absmax")
    pd.testing.assert_frame_equal(grid, plot.heatmap_grid(masked.records, value="log2_absmax"))
    assert list(grid.index) == ["lin", "mask", "out", ""]
    # out: 4v at v = 1, 100; from step 2 its output is inf and its largest finite |x| is its input 2v
    assert list(grid.loc["out"]) == [2.0, math.log2(400.0), math.log2(40000.0), math.log2(60000.0)]
    bad = plot.nonfinite_grid(masked)
    pd.testing.assert_frame_equal(bad, plot.nonfinite_grid(masked.records))
    assert list(bad.loc["out"]) == [False, False, True, True]
    assert list(bad.loc["mask"]) == [False, False, False, False]  # its input is the mask: never NaN/inf


def test_scale_timeline_and_overview_of_a_trace(masked: Any) -> None:
    fig = plot.scale_timeline(masked)
    assert [t.get_text() for t in fig.axes[0].texts] == [
        "no GradScaler: the loss scale is NaN in every step, so only the loss is shown"
    ]
    assert _by_gid(fig.axes[0], "loss").get_xdata().tolist() == [0.0, 1.0, 2.0, 3.0]
    fig = plot.overview(masked)
    assert (
        _notes(fig.axes[0].get_title(loc="left"))[1]
        == "first overflow in the trace: step 2, forward, 'out' output (inf)"
    )
    assert [t.get_text() for t in fig.axes[0].get_yticklabels()] == ["lin", "mask", "out", "<root>"]


def test_scale_timeline_of_a_trace_with_a_scaler() -> None:
    model = nn.Linear(2, 1, bias=False)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16)
    with nantrace.trace(model, scaler=scaler, optimizer=opt) as tr:
        for v in (1.0, 1e36, 1.0):  # 1e36 * 2**16 overflows float32 in backward: skipped, scale halves
            opt.zero_grad()
            scaler.scale(model(torch.full((1, 2), v)).sum()).backward()
            scaler.step(opt)
            scaler.update()
    ax = plot.scale_timeline(tr).axes[0]
    assert _by_gid(ax, "scale").get_ydata().tolist() == [2.0**16, 2.0**16, 2.0**15]
    assert _by_gid(ax, "skipped").get_xdata().tolist() == [1.0]


# --------------------------------------------------------------------------------------------
# duck typing, and what is refused
# --------------------------------------------------------------------------------------------


class FakeTrace:
    """Not a nantrace Trace: only the three members the plots read."""

    def __init__(self, records: pd.DataFrame, steps: pd.DataFrame, overflow: Any) -> None:
        self.records, self.steps, self._overflow = records, steps, overflow

    def first_overflow(self) -> Any:
        return self._overflow


def _overflow(**fields: Any) -> SimpleNamespace:
    base = {"step": 1, "phase": "forward", "module": "mask", "tensor": "output", "kind": "nan", "rank": 0}
    return SimpleNamespace(**{**base, **fields})


def test_any_object_with_records_steps_and_first_overflow_is_a_trace(masked: Any) -> None:
    fake = FakeTrace(masked.records, masked.steps, _overflow(step=3))
    ax = plot.ranges(fake).axes[0]
    assert ax.get_title(loc="left") == (
        "Value range per module at step 3, phase forward (4 modules, 2 with NaN/inf)\n"
        "first overflow in the trace: step 3, forward, 'mask' output (nan)"
    )
    fake = FakeTrace(
        masked.records, masked.steps, _overflow(step=0, phase="data", module="", tensor="input[0]")
    )
    assert _notes(plot.heatmap(fake).axes[0].get_title(loc="left"))[1] == (
        "first overflow in the trace: step 0, data, the model's input[0] (nan)"
    )


def test_a_merged_trace_names_the_rank_that_produced_the_overflow(masked: Any) -> None:
    records = pd.concat([masked.records.assign(rank=0), masked.records.assign(rank=1)], ignore_index=True)
    fake = FakeTrace(records, masked.steps, _overflow(step=2, module="out", kind="inf", rank=1))
    assert _second_line(plot.ranges(fake).axes[0].get_title(loc="left")) == (
        "first overflow in the trace: step 2, forward, 'out' output (inf), produced by rank 1 (ranks 0, 1 merged)"
    )


def test_the_first_overflow_step_must_have_records_in_the_phase(masked: Any) -> None:
    fake = FakeTrace(masked.records, masked.steps, _overflow(step=9))
    with pytest.raises(ValueError) as info:
        plot.ranges(fake)
    assert str(info.value) == (
        "step=9 (the first overflow's step) has no records in phase forward; steps present: 0–3; "
        "pass another step or phase"
    )


class OnlyRecords:
    def __init__(self, records: pd.DataFrame) -> None:
        self.records = records


def test_half_a_trace_is_refused_by_name(masked: Any) -> None:
    with pytest.raises(TypeError) as info:
        plot.heatmap(OnlyRecords(masked.records))  # type: ignore[arg-type]
    assert str(info.value) == (
        "records: this OnlyRecords has ['records'] but not ['steps', 'first_overflow'], so it is not a Trace; "
        "pass a nantrace Trace (.records, .steps, .first_overflow()) or the DataFrame itself"
    )
    fake = FakeTrace(masked.records, [1, 2], None)  # type: ignore[arg-type]
    with pytest.raises(TypeError) as info:
        plot.scale_timeline(fake)
    assert str(info.value) == (
        "steps: the FakeTrace's .steps is a list, not a pandas.DataFrame; "
        "pass a nantrace Trace (.records, .steps, .first_overflow()) or the DataFrame itself"
    )


def test_a_trace_with_empty_frames_says_whose_frame(masked: Any) -> None:
    fake = FakeTrace(masked.records.iloc[:0], masked.steps, None)
    with pytest.raises(ValueError, match=r"^the FakeTrace's records has no rows$"):
        plot.heatmap(fake)
    fake = FakeTrace(masked.records, masked.steps.iloc[:0], None)
    with pytest.raises(ValueError, match=r"^the FakeTrace's steps has no rows$"):
        plot.overview(fake)


def test_overview_takes_a_trace_or_both_frames(masked: Any) -> None:
    fig = plot.overview(masked.records, masked.steps)
    assert _notes(fig.axes[0].get_title(loc="left")) == [
        "first non-finite value at step 2 in 'out', '<root>'"
    ]
    with pytest.raises(TypeError) as info:
        plot.overview(masked, masked.steps)
    assert str(info.value) == (
        "overview(tr, steps): steps must not be given with a Trace, which holds its own; "
        "call overview(tr), or overview(records, steps) with both DataFrames"
    )
    with pytest.raises(TypeError) as info:
        plot.overview(masked.records)
    assert str(info.value) == (
        "overview(records, steps): steps is required with a records DataFrame; "
        "pass tr.steps as well, or the Trace alone: overview(tr)"
    )


def test_every_public_figure_takes_a_trace(masked: Any, tmp_path: Path) -> None:
    figures = {
        "heatmap": plot.heatmap(masked),
        "scale": plot.scale_timeline(masked),
        "ranges": plot.ranges(masked),
        "overview": plot.overview(masked),
    }
    for name, fig in figures.items():
        fig.savefig(tmp_path / f"{name}.png", dpi=50)
        assert (tmp_path / f"{name}.png").read_bytes()[:4] == b"\x89PNG", name
    assert isinstance(plot.heatmap_grid(masked), pd.DataFrame)
    assert plot.nonfinite_grid(masked).to_numpy().dtype == np.bool_


def test_plot_never_imports_the_trace_facade() -> None:
    """Layering: presentation (plot) does not import the facade (nantrace._trace)."""
    tree = ast.parse(PLOT_SOURCE.read_text())
    imported: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            imported.append("." * node.level + (node.module or ""))
            imported.extend(f"{'.' * node.level}{node.module or ''}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Import):
            imported.extend(a.name for a in node.names)
    assert imported, "no imports found: the check would pass vacuously"
    assert [name for name in imported if "_trace" in name or name.endswith(".Trace")] == []


def test_a_step_missing_from_a_trace_with_gaps_lists_the_steps_it_has(masked: Any) -> None:
    records = masked.records[masked.records["step"].isin([0, 2, 3])]
    with pytest.raises(ValueError) as info:
        plot.ranges(FakeTrace(records, masked.steps, None), step=1)
    assert (
        str(info.value)
        == "step=1 has no records in phase forward; steps present: 0, 2, 3; pass another step or phase"
    )
