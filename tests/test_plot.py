"""Tests for nantrace.plot: the grid numbers, the artists drawn, argument checks and PNG output."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pytest
import torch
from matplotlib.figure import Figure

from nantrace import plot

FP16_MAX = 65504.0  # torch.finfo(torch.float16).max
CATEGORICAL = ("phase", "module", "module_type", "tensor", "dtype")
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def make_records(rows: list[dict[str, Any]]) -> pd.DataFrame:
    """A records DataFrame in the nantrace schema; each row gives what differs from the defaults.

    ``seq`` defaults to the row's position within its (step, micro_step).
    """
    defaults: dict[str, Any] = {
        "micro_step": 0,
        "phase": "forward",
        "module_type": "Linear",
        "call": 0,
        "tensor": "output",
        "dtype": "torch.float16",
        "shape": "(2, 3)",
        "numel": 6,
        "absmin": None,
        "n_nan": 0,
        "n_posinf": 0,
        "n_neginf": 0,
        "n_zero": 0,
        "scale": 1.0,
    }
    full = []
    counters: dict[tuple[int, int], int] = {}
    for row in rows:
        merged = {**defaults, **row}
        key = (merged["step"], merged["micro_step"])
        merged.setdefault("seq", counters.get(key, 0))
        counters[key] = counters.get(key, 0) + 1
        if merged["absmin"] is None:
            merged["absmin"] = merged["absmax"] / 1024 if merged["absmax"] else math.nan
        merged["min"] = -merged["absmax"]
        merged["max"] = merged["absmax"]
        full.append(merged)
    frame = pd.DataFrame(full)
    for column in CATEGORICAL:
        frame[column] = frame[column].astype("category")
    for column in ("absmax", "absmin", "min", "max", "scale"):
        frame[column] = frame[column].astype("float64")
    return frame


def make_steps(scale: list[float], skipped: list[Any], loss: list[float] | None = None) -> pd.DataFrame:
    n = len(scale)
    return pd.DataFrame(
        {
            "step": np.arange(n),
            "loss": loss if loss is not None else np.linspace(3.0, 1.0, n),
            "scale": np.asarray(scale, dtype="float64"),
            "next_scale": np.nan,
            "skipped": pd.Series(skipped, dtype=object),
            "growth_tracker": 0,
            "lr": 1e-3,
            "grad_norm": 1.0,
            "n_nonfinite": 0,
        }
    )


@pytest.fixture
def records() -> pd.DataFrame:
    """Three forward modules (first seen: enc, dec, head) over steps 0..2, plus noise in other phases.

    Planted (forward phase only):
      step 0: enc max(1, 4) = 4; dec 65504 (0 bits); head 0.5
      step 1: enc max over micro-steps (2, 8) = 8; dec 1024 with 2 NaN; head absent
      step 2: enc all zero (absmax 0); dec no finite value (all +inf); head 2**-20
    """
    rows: list[dict[str, Any]] = [
        {"step": 0, "module": "enc", "tensor": "input[0]", "absmax": 1.0},
        {"step": 0, "module": "enc", "absmax": 4.0},
        {"step": 0, "module": "dec", "absmax": FP16_MAX},
        {"step": 0, "module": "head", "absmax": 0.5, "module_type": "Head"},
        {"step": 0, "module": "head", "phase": "backward", "tensor": "grad_output[0]", "absmax": 1e30},
        {"step": 1, "micro_step": 0, "module": "enc", "absmax": 2.0},
        {"step": 1, "micro_step": 0, "module": "dec", "absmax": 1024.0, "n_nan": 2},
        {"step": 1, "micro_step": 1, "module": "enc", "absmax": 8.0},
        {"step": 1, "micro_step": 1, "module": "dec", "absmax": 16.0},
        {
            "step": 1,
            "module": "enc",
            "phase": "backward",
            "tensor": "grad_input[0]",
            "absmax": 3.0,
            "n_posinf": 1,
        },
        {"step": 2, "module": "enc", "absmax": 0.0},
        {"step": 2, "module": "dec", "absmax": math.nan, "n_posinf": 6},
        {"step": 2, "module": "head", "absmax": 2.0**-20, "module_type": "Head"},
    ]
    return make_records(rows)


# --------------------------------------------------------------------------------------------
# heatmap_grid / nonfinite_grid
# --------------------------------------------------------------------------------------------


def test_heatmap_grid_headroom_exact(records: pd.DataFrame) -> None:
    grid = plot.heatmap_grid(records, value="headroom", phase="forward")
    assert list(grid.index) == ["enc", "dec", "head"]
    assert list(grid.columns) == [0, 1, 2]
    expected = pd.DataFrame(
        [
            [math.log2(FP16_MAX / 4), math.log2(FP16_MAX / 8), math.inf],
            [0.0, math.log2(FP16_MAX / 1024), math.nan],
            [math.log2(FP16_MAX / 0.5), math.nan, math.log2(FP16_MAX / 2.0**-20)],
        ],
        index=pd.Index(["enc", "dec", "head"], name="module"),
        columns=pd.Index([0, 1, 2], name="step"),
    )
    pd.testing.assert_frame_equal(grid, expected, check_exact=True)
    assert grid.loc["dec", 0] == 0.0  # absmax == fp16 max: 0 bits of headroom


def test_heatmap_grid_log2_absmax_exact(records: pd.DataFrame) -> None:
    grid = plot.heatmap_grid(records, value="log2_absmax")
    assert list(grid.loc["enc"])[:2] == [2.0, 3.0]
    assert grid.loc["enc", 2] == -math.inf  # all zero
    assert grid.loc["dec", 0] == math.log2(FP16_MAX)
    assert grid.loc["head", 2] == -20.0
    assert math.isnan(grid.to_numpy()[2, 1])  # head has no record in step 1


def test_heatmap_grid_other_phases(records: pd.DataFrame) -> None:
    backward = plot.heatmap_grid(records, phase="backward", value="log2_absmax")
    assert list(backward.index) == ["head", "enc"]
    assert backward.loc["head", 0] == math.log2(1e30)
    assert backward.loc["enc", 1] == math.log2(3.0)
    every = plot.heatmap_grid(records, phase=None, value="log2_absmax")
    both = plot.heatmap_grid(records, phase=["forward", "backward"], value="log2_absmax")
    pd.testing.assert_frame_equal(every, both)
    assert every.loc["head", 0] == math.log2(1e30)  # max over both phases
    # a float32 value above fp16's max gives negative headroom
    assert plot.heatmap_grid(records, phase="backward").loc["head", 0] == math.log2(FP16_MAX / 1e30)


def test_heatmap_grid_dtype_limit(records: pd.DataFrame) -> None:
    by_name = plot.heatmap_grid(records, dtype_limit="float16")
    for spelling in (torch.float16, "torch.float16", "fp16", "half"):
        pd.testing.assert_frame_equal(plot.heatmap_grid(records, dtype_limit=spelling), by_name)
    bf16 = plot.heatmap_grid(records, dtype_limit=torch.bfloat16)
    bf16_max = torch.finfo(torch.bfloat16).max
    assert bf16.loc["enc", 0] == math.log2(bf16_max / 4)
    assert plot.heatmap_grid(records, dtype_limit="bf16").equals(bf16)


def test_module_order_is_first_seen() -> None:
    rows = [
        {"step": 0, "module": "z", "seq": 0, "absmax": 1.0},
        {"step": 0, "module": "a", "seq": 1, "absmax": 1.0},
        {"step": 0, "module": "", "seq": 2, "absmax": 1.0},
        {"step": 1, "module": "late", "seq": 0, "absmax": 1.0},
        {"step": 1, "module": "z", "seq": 1, "absmax": 1.0},
    ]
    # shuffled rows: order comes from (step, micro_step, seq), not row order
    frame = make_records(rows).sample(frac=1.0, random_state=3)
    assert list(plot.heatmap_grid(frame).index) == ["z", "a", "", "late"]


def test_nonfinite_grid_exact(records: pd.DataFrame) -> None:
    bad = plot.nonfinite_grid(records)
    expected = pd.DataFrame(
        [[False, False, False], [False, True, True], [False, False, False]],
        index=pd.Index(["enc", "dec", "head"], name="module"),
        columns=pd.Index([0, 1, 2], name="step"),
    )
    pd.testing.assert_frame_equal(bad, expected)
    assert plot.nonfinite_grid(records, phase="backward").loc["enc", 1]
    assert list(plot.nonfinite_grid(records, phase=None).loc["enc"]) == [False, True, False]


# --------------------------------------------------------------------------------------------
# heatmap figure
# --------------------------------------------------------------------------------------------


def _by_gid(ax: Any, gid: str) -> Any:
    found = [a for a in ax.get_children() if a.get_gid() == gid]
    assert len(found) == 1, f"expected one artist with gid {gid!r}, found {len(found)}"
    return found[0]


def test_heatmap_draws_the_grid(records: pd.DataFrame) -> None:
    fig = plot.heatmap(records)
    assert isinstance(fig, Figure)
    ax = fig.axes[0]
    grid = plot.heatmap_grid(records)
    mesh = _by_gid(ax, "values")
    drawn = np.ma.getdata(mesh.get_array()).reshape(grid.shape)
    shown = np.ma.getmaskarray(mesh.get_array()).reshape(grid.shape)
    finite = np.isfinite(grid.to_numpy())
    np.testing.assert_array_equal(drawn[finite], grid.to_numpy()[finite])
    np.testing.assert_array_equal(shown, np.isnan(grid.to_numpy()))  # masked = grey "no data"
    assert drawn[0, 2] > mesh.norm.vmax  # absmax 0: infinite headroom, drawn in the top colour
    assert [t.get_text() for t in ax.get_yticklabels()] == ["enc", "dec", "head"]
    # non-finite overlay covers exactly the mask, onset markers at each run's first step
    overlay = _by_gid(ax, "nonfinite")
    bad = plot.nonfinite_grid(records).to_numpy()
    np.testing.assert_array_equal(~np.ma.getmaskarray(overlay.get_array()).reshape(bad.shape), bad)
    onsets = _by_gid(ax, "nonfinite_onsets").get_offsets()
    assert np.asarray(onsets).tolist() == [[1.0, 1.0]]  # (step 1, row "dec"); step 2 continues the run
    assert "first non-finite value at step 1 in 'dec'" in ax.get_title(loc="left")


def test_a_heatmap_with_gaps_between_recorded_steps_draws_them_as_no_record() -> None:
    # every=10: steps 0 and 10 in full, step 13's non-finite tensor on a light step; nothing else recorded
    frame = make_records(
        [
            {"step": 0, "module": "a", "absmax": 4.0},
            {"step": 10, "module": "a", "absmax": 4.0},
            {"step": 13, "module": "a", "absmax": 4.0, "n_nan": 1},
        ]
    )
    ax = plot.heatmap(frame).axes[0]
    mesh = _by_gid(ax, "values")
    # cells [-0.5, 0.5], gap, [9.5, 10.5], gap, [12.5, 13.5]: a cell is exactly its step
    assert mesh.get_coordinates()[0, :, 0].tolist() == [-0.5, 0.5, 9.5, 10.5, 12.5, 13.5]
    assert np.ma.getmaskarray(mesh.get_array()).ravel().tolist() == [False, True, False, True, False]
    overlay = _by_gid(ax, "nonfinite")
    assert (~np.ma.getmaskarray(overlay.get_array())).ravel().tolist() == [False, False, False, False, True]
    assert np.asarray(_by_gid(ax, "nonfinite_onsets").get_offsets()).tolist() == [[13.0, 0.0]]
    assert ax.get_xlim() == (-0.5, 13.5)
    # the overview's shared axis spans every step of the run (0-17), the steps after the last record grey
    heat = plot.overview(frame, make_steps([1.0] * 18, [False] * 18)).axes[0]
    assert heat.get_xlim() == (-0.5, 17.5)


def test_heatmap_colorbar_marks_fp16_max(records: pd.DataFrame) -> None:
    fig = plot.heatmap(records)
    cbar_ax = fig.axes[1]
    labels = {t.get_text(): t.get_position()[1] for t in cbar_ax.get_yticklabels()}
    (max_label,) = [text for text in labels if "65504" in text]
    assert labels[max_label] == 0.0  # 0 bits of headroom
    fig = plot.heatmap(records, value="log2_absmax")
    labels = {t.get_text(): t.get_position()[1] for t in fig.axes[1].get_yticklabels()}
    (max_label,) = [text for text in labels if "65504" in text]
    assert labels[max_label] == pytest.approx(math.log2(FP16_MAX))


def test_heatmap_above_limit_in_legend(records: pd.DataFrame) -> None:
    fig = plot.heatmap(records, phase="backward")  # 1e30 > 65504: negative headroom
    legend = fig.axes[0].get_legend()
    assert legend is not None
    assert any("above float16 max (1 cells)" in t.get_text() for t in legend.get_texts())


def test_heatmap_max_modules_keeps_riskiest_in_order(records: pd.DataFrame) -> None:
    fig = plot.heatmap(records, max_modules=2)
    ax = fig.axes[0]
    # dec has NaN; of enc (max 8) and head (max 0.5) enc has less headroom
    assert [t.get_text() for t in ax.get_yticklabels()] == ["enc", "dec"]
    assert "2 of 3: earliest NaN/inf, then least headroom" in ax.get_ylabel()


def _label_boxes(fig: Figure, ax: Any) -> list[Any]:
    """Window extents (pixels) of the y tick labels of ``ax``, top row first, after drawing ``fig``."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    canvas = FigureCanvasAgg(fig)
    canvas.draw()
    renderer = canvas.get_renderer()
    return [t.get_window_extent(renderer) for t in ax.get_yticklabels()]


def _module_names(n: int) -> list[str]:
    """``n`` module names of a decoder such as Llama's: long, and alike except for a number."""
    subs = ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.down_proj"]
    return ["model.embed_tokens"] + [f"model.layers.{i // 5}.{subs[i % 5]}" for i in range(n - 1)]


@pytest.mark.parametrize("n", [64, 200])
def test_heatmap_labels_every_module_row_readably(n: int) -> None:
    names = _module_names(n)
    rows = [
        {"step": s, "module": m, "absmax": 2.0 ** (k % 15)} for s in range(6) for k, m in enumerate(names)
    ]
    fig = plot.heatmap(make_records(rows))
    ax = fig.axes[0]
    labels = ax.get_yticklabels()
    assert [t.get_text() for t in labels] == names  # every row, by its full name
    assert list(ax.get_yticks()) == list(range(n))  # each label on its own row
    assert {t.get_fontsize() for t in labels} == {6.0}
    # the figure grew to give every row 6 pt * 1.4 of height, beside 2.6 inches for title, axis, legend
    assert fig.get_size_inches()[1] == pytest.approx(max(12.0, 2.6 + n * 6.0 * 1.4 / 72))
    boxes = _label_boxes(fig, ax)
    assert min(b.height for b in boxes) >= 6.0 * fig.dpi / 72  # drawn at 6 pt: not shrunk
    overlapping = [names[i] for i in range(n - 1) if boxes[i].y0 < boxes[i + 1].y1]
    assert overlapping == []  # top to bottom, each label ends above the next one starts


def test_heatmap_label_fonts_and_height_for_few_modules(records: pd.DataFrame) -> None:
    fig = plot.heatmap(records)
    assert {t.get_fontsize() for t in fig.axes[0].get_yticklabels()} == {8.0}
    assert fig.get_size_inches()[1] == 4.0  # 2.2 + 0.16 * 3 rows, at least 4 inches


def test_heatmap_on_a_small_given_axes_thins_labels_keeping_the_first_nonfinite() -> None:
    rows = [
        {"step": s, "module": f"blocks.{m}.mlp", "absmax": 2.0 ** (m % 20), "n_nan": int(m == 77 and s == 2)}
        for s in range(30)
        for m in range(200)
    ]
    fig = Figure(figsize=(8.0, 4.0))
    plot.heatmap(make_records(rows), ax=fig.add_subplot())
    labels = [t.get_text() for t in fig.axes[0].get_yticklabels()]
    assert 10 <= len(labels) < 200  # the axes' size is the caller's: thinned to fit
    assert labels[0] == "blocks.0.mlp"
    assert "blocks.77.mlp" in labels


def test_heatmap_height_stops_at_its_maximum_and_then_thins() -> None:
    n = 2600  # 2.6 + 2600 * 6 * 1.4 / 72 = 305.9 inches > MAX_HEATMAP_HEIGHT_IN
    rows = [{"step": 0, "module": f"m{k}", "absmax": 1.0} for k in range(n)]
    fig = plot.heatmap(make_records(rows), max_modules=None)
    assert plot.MAX_HEATMAP_HEIGHT_IN == 300.0
    assert fig.get_size_inches()[1] == 300.0
    assert 1000 < len(fig.axes[0].get_yticklabels()) < n


def test_heatmap_draws_on_given_axes(records: pd.DataFrame) -> None:
    fig = Figure()
    ax = fig.add_subplot()
    assert plot.heatmap(records, ax=ax) is fig
    subfigures = Figure().subfigures(1, 2)
    assert isinstance(subfigures, np.ndarray)
    sub = subfigures[1]
    sub_ax = sub.add_subplot()
    assert plot.heatmap(records, ax=sub_ax) is sub.figure


# --------------------------------------------------------------------------------------------
# scale_timeline
# --------------------------------------------------------------------------------------------


def test_scale_timeline_marks_skipped_steps() -> None:
    scale = [2.0**16, 2.0**16, 2.0**15, 2.0**15, 2.0**14, 2.0**14]
    steps = make_steps(scale, [False, True, None, True, np.nan, False])
    fig = plot.scale_timeline(steps)
    ax = fig.axes[0]
    assert ax.get_yscale() == "log"
    marks = _by_gid(ax, "skipped")
    assert marks.get_xdata().tolist() == [1.0, 3.0]
    assert marks.get_ydata().tolist() == [2.0**16, 2.0**15]
    assert marks.get_marker() == "x"
    assert _by_gid(ax, "scale").get_ydata().tolist() == scale
    loss_ax = fig.axes[1]  # twin axis
    assert _by_gid(loss_ax, "loss").get_ydata().tolist() == steps["loss"].tolist()


def test_scale_timeline_sorts_steps_and_marks_nonfinite_loss() -> None:
    steps = make_steps([8.0, 4.0, 4.0], [True, False, False], loss=[1.0, math.nan, math.inf]).iloc[::-1]
    fig = plot.scale_timeline(steps)
    assert _by_gid(fig.axes[0], "skipped").get_xdata().tolist() == [0.0]
    assert _by_gid(fig.axes[1], "nonfinite_loss").get_xdata().tolist() == [1.0, 2.0]


def test_scale_timeline_without_scaler() -> None:
    steps = make_steps([math.nan] * 4, [None] * 4)
    fig = plot.scale_timeline(steps)
    assert len(fig.axes) == 1  # no twin axis
    ax = fig.axes[0]
    assert not [a for a in ax.get_children() if a.get_gid() in ("scale", "skipped")]
    assert _by_gid(ax, "loss").get_ydata().tolist() == steps["loss"].tolist()
    assert any("no GradScaler" in t.get_text() for t in ax.texts)


# --------------------------------------------------------------------------------------------
# ranges
# --------------------------------------------------------------------------------------------


def _bars(ax: Any) -> list[tuple[float, float, float]]:
    """(y, left, right) of each range bar."""
    out = []
    for patch in ax.patches:
        if patch.get_gid() == "range":
            out.append(
                (patch.get_y() + patch.get_height() / 2, patch.get_x(), patch.get_x() + patch.get_width())
            )
    return sorted(out)


def test_ranges_default_step_is_first_nonfinite(records: pd.DataFrame) -> None:
    fig = plot.ranges(records)
    ax = fig.axes[0]
    assert "at step 1," in ax.get_title(loc="left")
    # enc: absmin = min(2, 8) / 1024, absmax 8; dec: 16 / 1024 .. 1024 (NaN: red); head absent
    assert _bars(ax) == [(0.0, 2.0 / 1024, 8.0), (1.0, 16.0 / 1024, 1024.0)]
    labels = ax.get_yticklabels()
    assert [t.get_text() for t in labels] == ["enc (Linear)", "dec (Linear)"]
    assert [t.get_color() for t in labels] == ["black", "red"]
    assert np.asarray(_by_gid(ax, "nonfinite_modules").get_offsets())[:, 1].tolist() == [1.0]
    assert any(t.get_text() == "NaN 2" for t in ax.texts)


def test_ranges_default_step_without_nonfinite_is_last() -> None:
    frame = make_records([{"step": s, "module": "m", "absmax": 2.0**s} for s in range(4)])
    assert "at step 3," in plot.ranges(frame).axes[0].get_title(loc="left")


def test_ranges_bands_are_fp16(records: pd.DataFrame) -> None:
    ax = plot.ranges(records, 0).axes[0]
    spans = {p.get_gid(): p for p in ax.patches if str(p.get_gid()).startswith("band:")}
    assert set(spans) == {"band:to 0", "band:subnormal", "band:normal", "band:inf"}

    def x_extent(patch: Any) -> tuple[float, float]:
        xs = patch.get_transform().transform(patch.get_path().vertices)[:, 0]
        lo, hi = ax.transData.inverted().transform([[xs.min(), 0], [xs.max(), 0]])[:, 0]
        return float(lo), float(hi)

    assert x_extent(spans["band:subnormal"]) == pytest.approx((2.0**-24, 2.0**-14))
    assert x_extent(spans["band:normal"]) == pytest.approx((2.0**-14, FP16_MAX))
    assert x_extent(spans["band:inf"])[0] == pytest.approx(FP16_MAX)
    assert ax.get_xscale() == "log"


def test_ranges_explicit_step_and_all_zero_module(records: pd.DataFrame) -> None:
    ax = plot.ranges(records, step=2).axes[0]
    # enc is all zero (no bar), dec has no finite value (no bar, marked), head 2**-30 .. 2**-20
    assert _bars(ax) == [(2.0, 2.0**-30, 2.0**-20)]
    assert np.asarray(_by_gid(ax, "nonfinite_modules").get_offsets())[:, 1].tolist() == [1.0]


# --------------------------------------------------------------------------------------------
# overview and PNG output
# --------------------------------------------------------------------------------------------


def test_overview_combines_heatmap_and_timeline(records: pd.DataFrame) -> None:
    steps = make_steps([4.0, 2.0, 2.0], [True, False, False])
    fig = plot.overview(records, steps)
    heat_ax = fig.axes[0]
    assert _by_gid(heat_ax, "values") is not None
    time_ax = next(ax for ax in fig.axes if any(a.get_gid() == "skipped" for a in ax.get_children()))
    assert time_ax.get_shared_x_axes().joined(heat_ax, time_ax)


def test_every_figure_saves_as_png(records: pd.DataFrame, tmp_path: Path) -> None:
    steps = make_steps([4.0, 2.0, 2.0], [True, False, False])
    figures = {
        "heatmap": plot.heatmap(records),
        "heatmap_log2": plot.heatmap(records, value="log2_absmax", phase=None),
        "timeline": plot.scale_timeline(steps),
        "timeline_noscaler": plot.scale_timeline(make_steps([math.nan] * 3, [None] * 3)),
        "ranges": plot.ranges(records),
        "overview": plot.overview(records, steps),
    }
    for name, fig in figures.items():
        path = tmp_path / f"{name}.png"
        fig.savefig(path, dpi=60)
        assert path.read_bytes()[:8] == PNG_MAGIC, name


def test_plotting_is_lazy_and_headless() -> None:
    code = (
        "import sys\n"
        "import nantrace.plot as p\n"
        "assert 'matplotlib' not in sys.modules, 'matplotlib imported at module import'\n"
        "import pandas as pd\n"
        "r = pd.DataFrame({'step': [0], 'micro_step': [0], 'seq': [0], 'phase': ['forward'],\n"
        "    'module': ['m'], 'module_type': ['Linear'], 'absmax': [1.0], 'absmin': [0.5],\n"
        "    'n_nan': [0], 'n_posinf': [0], 'n_neginf': [0]})\n"
        "p.heatmap(r); p.ranges(r)\n"
        "assert 'matplotlib.pyplot' not in sys.modules, 'pyplot was imported'\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr


def test_missing_matplotlib_raises_with_install_hint(
    records: pd.DataFrame, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    with pytest.raises(ImportError, match=r'pip install "nantrace\[plot\]"'):
        plot.heatmap(records)
    with pytest.raises(ImportError, match="nantrace"):
        plot.scale_timeline(make_steps([1.0], [False]))


# --------------------------------------------------------------------------------------------
# argument checks
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "error", "words"),
    [
        ({"value": "bits"}, ValueError, ["value", "'bits'"]),
        ({"phase": "fwd"}, ValueError, ["phase", "'fwd'"]),
        ({"phase": ["forward", "back"]}, ValueError, ["phase", "'back'"]),
        ({"phase": []}, ValueError, ["phase"]),
        ({"phase": 3}, TypeError, ["phase", "3"]),
        ({"phase": "optimizer"}, ValueError, ["phase='optimizer'", "no rows"]),
        ({"dtype_limit": "float17"}, ValueError, ["dtype_limit", "'float17'"]),
        ({"dtype_limit": torch.int8}, ValueError, ["dtype_limit", "torch.int8", "floating"]),
        ({"dtype_limit": "int32"}, ValueError, ["dtype_limit", "'int32'"]),
        ({"dtype_limit": 16}, TypeError, ["dtype_limit", "16"]),
        ({"max_modules": 0}, ValueError, ["max_modules", "0"]),
        ({"max_modules": 2.5}, TypeError, ["max_modules", "float"]),
        ({"max_modules": True}, TypeError, ["max_modules", "bool"]),
        ({"ax": "left"}, TypeError, ["ax", "str"]),
    ],
)
def test_heatmap_rejects_bad_arguments(
    records: pd.DataFrame, kwargs: dict[str, Any], error: type[Exception], words: list[str]
) -> None:
    with pytest.raises(error) as info:
        plot.heatmap(records, **kwargs)
    for word in words:
        assert word in str(info.value)


def test_records_checks(records: pd.DataFrame) -> None:
    with pytest.raises(TypeError, match=r"^records must be a pandas\.DataFrame or a Trace, got list$"):
        plot.heatmap_grid([1, 2])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"records is missing required column\(s\) \['absmax'\]"):
        plot.heatmap(records.drop(columns="absmax"))
    with pytest.raises(ValueError, match="records has no rows"):
        plot.nonfinite_grid(records.iloc[:0])
    with pytest.raises(ValueError, match=r"column\(s\) \['absmin'\]"):
        plot.ranges(records.drop(columns="absmin"))
    with pytest.raises(TypeError, match=r"records must be a pandas\.DataFrame"):
        plot.overview(None, make_steps([1.0], [False]))  # type: ignore[arg-type]


def test_steps_checks(records: pd.DataFrame) -> None:
    with pytest.raises(TypeError, match=r"^steps must be a pandas\.DataFrame or a Trace, got dict$"):
        plot.scale_timeline({"step": [0]})  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"steps is missing required column\(s\) \['skipped'\]"):
        plot.scale_timeline(make_steps([1.0], [False]).drop(columns="skipped"))
    with pytest.raises(ValueError, match="steps has no rows"):
        plot.overview(records, make_steps([1.0], [False]).iloc[:0])
    with pytest.raises(TypeError, match=r"ax must be a matplotlib\.axes\.Axes or None, got int"):
        plot.scale_timeline(make_steps([1.0], [False]), ax=1)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("step", "error", "words"),
    [
        ("1", TypeError, ["step", "'1'"]),
        (True, TypeError, ["step", "True"]),
        (1.0, TypeError, ["step", "1.0"]),
        (7, ValueError, ["step=7", "steps present: 0–2;"]),
    ],
)
def test_ranges_rejects_bad_step(
    records: pd.DataFrame, step: Any, error: type[Exception], words: list[str]
) -> None:
    with pytest.raises(error) as info:
        plot.ranges(records, step)
    for word in words:
        assert word in str(info.value)


def test_ranges_step_missing_in_phase(records: pd.DataFrame) -> None:
    with pytest.raises(ValueError, match="step=2 has no records in phase backward"):
        plot.ranges(records, 2, phase="backward")


def test_range_labels_are_thinned_but_name_the_first_nonfinite_module() -> None:
    rows = [
        {
            "step": s,
            "module": f"blocks.{m}",
            "absmax": 1.0,
            "n_nan": int(m >= 150 and s >= 3) + int(m == 77 and s == 2),
        }
        for s in range(5)
        for m in range(200)
    ]
    frame = make_records(rows)
    heat_labels = [t.get_text() for t in plot.heatmap(frame).axes[0].get_yticklabels()]
    assert heat_labels == [f"blocks.{m}" for m in range(200)]  # the heatmap names every row
    ax = plot.ranges(frame, 4).axes[0]
    ticks = ax.get_yticks()
    assert 10 <= len(ticks) < 200
    assert np.diff(ticks).min() >= np.diff(ticks).max() / 2  # evenly spaced, no crowded red labels
    assert "blocks.150 (Linear)" in [t.get_text() for t in ax.get_yticklabels()]
