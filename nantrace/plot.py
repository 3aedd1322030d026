"""Figures for nantrace records: how close each module's values come to a dtype's limits.

Every figure takes a ``Trace`` (``nantrace.trace``'s result or ``nantrace.load``'s) or the DataFrames
it holds (``tr.records``, ``tr.steps``). A Trace is recognised by duck typing (:class:`TraceLike`:
``.records`` and ``.steps`` DataFrames and ``first_overflow()``), so this module never imports the
Trace class. With a Trace the titles also name the locator's first overflow (``tr.first_overflow()``:
its producer, in any phase; an attention mask's ``-inf`` is not one), and :func:`ranges` starts at its
step when it lies in the phase drawn.

All figures are built with the object API (:class:`matplotlib.figure.Figure`), never with
``pyplot``'s global state, so they work headless (Agg) and in threads. matplotlib is imported only
when a plotting function is called; without it those functions raise :class:`ImportError`.

Units used throughout:

* ``log2_absmax``: ``log2(absmax)``, the base-2 exponent of the largest finite ``|x|`` of a tensor.
* ``headroom``: ``log2(finfo.max / absmax)`` in **bits**, i.e. how many doublings the largest
  finite ``|x|`` can still take before it overflows the limit dtype. For float16,
  ``finfo.max = torch.finfo(torch.float16).max = 65504``, so headroom is ``log2(65504 / absmax)``
  and 0 bits means "at the float16 maximum".

The dtype bands come from :func:`torch.finfo` of the limit dtype: ``max`` (float16: 65504),
``smallest_normal`` (float16: ``2**-14``) and the smallest subnormal, ``smallest_normal * eps``
(float16: ``2**-14 * 2**-10 = 2**-24``); a magnitude below the smallest subnormal rounds to zero.

Gradient records are stored as recorded, i.e. multiplied by the loss scale (``records["scale"]``),
which is what decides whether they overflow in float16; nothing here unscales them.
"""

from __future__ import annotations

import importlib
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, Protocol

import numpy as np
import pandas as pd
import torch

from ._fmt import steps_text
from ._masks import unmasked

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

__all__ = [
    "PHASES",
    "TraceLike",
    "heatmap",
    "heatmap_grid",
    "nonfinite_grid",
    "overview",
    "ranges",
    "scale_timeline",
]

#: The phases a record can belong to, in the order they happen within a step.
PHASES: tuple[str, ...] = ("data", "forward", "loss", "backward", "optimizer")

HeatmapValue = Literal["headroom", "log2_absmax"]
_VALUES: tuple[str, ...] = ("headroom", "log2_absmax")

_GRID_COLUMNS = ("step", "micro_step", "seq", "phase", "module", "absmax", "n_nan", "n_posinf", "n_neginf")
_RANGE_COLUMNS = (*_GRID_COLUMNS, "module_type", "absmin")
_STEP_COLUMNS = ("step", "loss", "scale", "skipped")

_DTYPE_ALIASES = {
    "fp16": "float16",
    "half": "float16",
    "bf16": "bfloat16",
    "fp32": "float32",
    "float": "float32",
    "fp64": "float64",
    "double": "float64",
}

# Colours chosen to be absent from the RdYlBu colour maps used for values.
_NONFINITE_COLOR = "#ff00ff"  # magenta: NaN or +-inf was seen
_NO_DATA_COLOR = "#d9d9d9"  # light grey: no record, or no finite value
_BEYOND_LIMIT_COLOR = "#000000"  # black: finite but above the limit dtype's max (a wider dtype)
_ROOT_LABEL = "<root>"
_LOSS_COLOR = "tab:blue"
_MAX_NONFINITE_MARKERS = 5000  # more onsets of NaN/inf runs than this: magenta overlay only


class _OverflowLike(Protocol):
    """What the figures read of a ``nantrace.Overflow``."""

    @property
    def step(self) -> int: ...
    @property
    def phase(self) -> str: ...
    @property
    def module(self) -> str: ...
    @property
    def tensor(self) -> str: ...
    @property
    def kind(self) -> str: ...
    @property
    def rank(self) -> int: ...


class TraceLike(Protocol):
    """What the figures read of a nantrace ``Trace``; any object with these members is accepted.

    ``records`` and ``steps`` are the DataFrames described in the README (one row per recorded
    tensor, one row per step); ``first_overflow()`` returns the locator's first producer of a
    non-finite value (with ``step``, ``phase``, ``module``, ``tensor``, ``kind``, ``rank``) or None.
    """

    @property
    def records(self) -> pd.DataFrame: ...
    @property
    def steps(self) -> pd.DataFrame: ...
    def first_overflow(self) -> _OverflowLike | None: ...


@dataclass(frozen=True)
class _TraceParts:
    """A Trace's frames, each read once (every access of ``Trace.records`` makes a copy)."""

    records: pd.DataFrame
    steps: pd.DataFrame
    trace: TraceLike

    def first_overflow(self) -> _OverflowLike | None:
        return self.trace.first_overflow()


_TRACE_MEMBERS = ("records", "steps", "first_overflow")
_ABSENT = object()


def _trace_parts(source: object, arg: str) -> _TraceParts | None:
    """``source``'s frames when it is a Trace (:class:`TraceLike`); None when it is not one at all.

    A DataFrame, or an object with none of ``records``, ``steps``, ``first_overflow``, is not a
    Trace (None: the caller checks it as a DataFrame and says what it expected).

    Raises:
        TypeError: ``source`` has some of those members but not all, ``records`` or ``steps`` is
            not a DataFrame, or ``first_overflow`` is not callable; the message names ``arg``.
    """
    if isinstance(source, pd.DataFrame):
        return None
    got = {name: getattr(source, name, _ABSENT) for name in _TRACE_MEMBERS}  # each read once: copies
    present = [name for name, value in got.items() if value is not _ABSENT]
    if not present:
        return None
    kind = type(source).__name__
    hint = "pass a nantrace Trace (.records, .steps, .first_overflow()) or the DataFrame itself"
    missing = [name for name in _TRACE_MEMBERS if name not in present]
    if missing:
        raise TypeError(f"{arg}: this {kind} has {present} but not {missing}, so it is not a Trace; {hint}")
    for name in ("records", "steps"):
        if not isinstance(got[name], pd.DataFrame):
            raise TypeError(
                f"{arg}: the {kind}'s .{name} is a {type(got[name]).__name__}, not a pandas.DataFrame; {hint}"
            )
    if not callable(got["first_overflow"]):
        raise TypeError(f"{arg}: the {kind}'s .first_overflow is not callable; {hint}")
    return _TraceParts(records=got["records"], steps=got["steps"], trace=source)  # type: ignore[arg-type]


def _frame_of(
    source: object, arg: str, columns: Sequence[str], which: Literal["records", "steps"] = "records"
) -> tuple[pd.DataFrame, _TraceParts | None]:
    """``(frame, parts)``: ``source`` checked as a DataFrame, or a Trace's ``which`` frame and its parts.

    Raises:
        TypeError: ``source`` is neither a DataFrame nor a Trace (see :func:`_trace_parts`).
        ValueError: the frame lacks one of ``columns`` or has no rows.
    """
    parts = _trace_parts(source, arg)
    if parts is None:
        frame = _check_frame(source, arg, columns)
    else:
        of = parts.records if which == "records" else parts.steps
        frame = _check_frame(of, f"the {type(parts.trace).__name__}'s {which}", columns)
    # an attention mask's -inf is intended, never drawn as a NaN/inf (the rule: nantrace._masks)
    ops = getattr(parts.trace, "ops", None) if parts is not None else None  # -inf the forward masked, too
    return (
        unmasked(frame, ops if isinstance(ops, pd.DataFrame) else None) if which == "records" else frame
    ), parts


# --------------------------------------------------------------------------------------------
# argument handling
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Limits:
    """Representable magnitudes of a floating dtype, from :func:`torch.finfo`."""

    name: str  # e.g. "float16"
    max: float  # finfo.max; float16: 65504
    smallest_normal: float  # finfo.smallest_normal; float16: 2**-14
    smallest_subnormal: float  # smallest_normal * eps; float16: 2**-24

    @property
    def log2_max(self) -> float:
        return math.log2(self.max)


def _limits(dtype_limit: object) -> _Limits:
    """Resolve ``dtype_limit`` (a floating :class:`torch.dtype` or its name) to its limits.

    Accepted names: ``"float16"``, ``"torch.float16"``, ``"bfloat16"``, ... and the aliases
    ``fp16``/``half``, ``bf16``, ``fp32``/``float``, ``fp64``/``double``.

    Raises:
        TypeError: ``dtype_limit`` is neither a :class:`torch.dtype` nor a str.
        ValueError: it names no torch dtype, or a dtype that is not floating point.
    """
    if isinstance(dtype_limit, torch.dtype):
        dtype = dtype_limit
    elif isinstance(dtype_limit, str):
        name = dtype_limit.strip().lower().removeprefix("torch.")
        name = _DTYPE_ALIASES.get(name, name)
        found = getattr(torch, name, None)
        if not isinstance(found, torch.dtype):
            raise ValueError(
                f"dtype_limit={dtype_limit!r} is not a torch dtype name; use e.g. 'float16' or torch.float16"
            )
        dtype = found
    else:
        raise TypeError(
            f"dtype_limit must be a torch.dtype or a dtype name such as 'float16', "
            f"got {type(dtype_limit).__name__} {dtype_limit!r}"
        )
    if not dtype.is_floating_point:
        raise ValueError(f"dtype_limit={dtype_limit!r} is not a floating point dtype")
    info = torch.finfo(dtype)
    return _Limits(
        name=str(dtype).removeprefix("torch."),
        max=float(info.max),
        smallest_normal=float(info.smallest_normal),
        smallest_subnormal=float(info.smallest_normal) * float(info.eps),
    )


def _check_frame(frame: object, arg: str, columns: Sequence[str]) -> pd.DataFrame:
    """Check that ``frame`` is a non-empty DataFrame holding ``columns``.

    Raises:
        TypeError: ``frame`` is not a :class:`pandas.DataFrame`.
        ValueError: it lacks one of ``columns`` or has no rows.
    """
    if not isinstance(frame, pd.DataFrame):
        raise TypeError(f"{arg} must be a pandas.DataFrame or a Trace, got {type(frame).__name__}")
    missing = [c for c in columns if c not in frame.columns]
    if missing:
        raise ValueError(f"{arg} is missing required column(s) {missing}; it has {list(frame.columns)}")
    if frame.empty:
        raise ValueError(f"{arg} has no rows")
    return frame


def _parse_phase(phase: object) -> tuple[str, ...] | None:
    """Normalise ``phase`` (one phase, a sequence of phases, or None for all) to a tuple or None.

    Raises:
        TypeError: ``phase`` is not a str, a sequence of str, or None.
        ValueError: a phase is not one of :data:`PHASES`, or the sequence is empty.
    """
    if phase is None:
        return None
    if isinstance(phase, str):
        phases: tuple[object, ...] = (phase,)
    elif isinstance(phase, Sequence):
        phases = tuple(phase)
        if not phases:
            raise ValueError("phase must not be an empty sequence; use None for all phases")
    else:
        raise TypeError(
            f"phase must be a str, a sequence of str or None, got {type(phase).__name__} {phase!r}"
        )
    for p in phases:
        if p not in PHASES:
            raise ValueError(f"phase={phase!r}: {p!r} is not one of {list(PHASES)} (or None for all)")
    return tuple(str(p) for p in phases)


def _select_phase(records: pd.DataFrame, phase: object) -> pd.DataFrame:
    """Rows of ``records`` in ``phase``; raise ValueError when there are none."""
    phases = _parse_phase(phase)
    if phases is None:
        return records
    selected = records[records["phase"].isin(phases)]
    if selected.empty:
        present = sorted(records["phase"].astype(str).unique())
        raise ValueError(f"records has no rows with phase={phase!r}; phases present: {present}")
    return selected


def _check_value(value: object) -> str:
    if value not in _VALUES:
        raise ValueError(f"value must be one of {list(_VALUES)}, got {value!r}")
    return str(value)


def _check_max_modules(max_modules: object) -> int | None:
    if max_modules is None:
        return None
    if isinstance(max_modules, bool) or not isinstance(max_modules, (int, np.integer)):
        raise TypeError(f"max_modules must be a positive int or None, got {type(max_modules).__name__}")
    if max_modules < 1:
        raise ValueError(f"max_modules must be >= 1, got {max_modules!r}")
    return int(max_modules)


def _import_matplotlib() -> None:
    """Import the matplotlib modules used here, with an install hint when it is missing.

    Raises:
        ImportError: matplotlib is not installed.
    """
    try:
        importlib.import_module("matplotlib.figure")
    except ImportError as exc:
        raise ImportError(
            'nantrace.plot needs matplotlib; install it with: pip install "nantrace[plot]"'
        ) from exc


def _figure_and_ax(ax: object, figsize: tuple[float, float]) -> tuple[Figure, Axes]:
    """Return ``(figure, axes)``: a new constrained-layout Figure when ``ax`` is None.

    Raises:
        TypeError: ``ax`` is neither None nor a :class:`matplotlib.axes.Axes`.
    """
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

    if ax is None:
        fig = Figure(figsize=figsize, layout="constrained")
        return fig, fig.add_subplot()
    if not isinstance(ax, Axes):
        raise TypeError(f"ax must be a matplotlib.axes.Axes or None, got {type(ax).__name__}")
    root: Any = ax.figure
    while not isinstance(root, Figure):  # a SubFigure: walk up to the Figure that owns it
        root = root.figure
    return root, ax


def _module_label(name: str) -> str:
    return name if name else _ROOT_LABEL


def _log2_ticks(lo_exp: int, hi_exp: int, max_ticks: int = 14) -> list[int]:
    """Integer exponents from ``lo_exp`` to ``hi_exp`` at a stride of 1, 2, 4, 8, ... bits."""
    stride = 1
    while (hi_exp - lo_exp) // stride + 1 > max_ticks:
        stride *= 2
    start = math.ceil(lo_exp / stride) * stride
    return list(range(start, hi_exp + 1, stride))


def _thinned(n: int, max_labels: int) -> list[int]:
    """Indices ``0, k, 2k, ... < n`` with the smallest stride ``k`` giving at most ``max_labels``."""
    stride = max(1, math.ceil(n / max(1, max_labels)))
    return list(range(0, n, stride))


def _spaced_labels(n: int, max_labels: int, first: Sequence[int], extra: Sequence[int]) -> list[int]:
    """Rows to label: ``first``, then an evenly thinned set, then ``extra``, never two too close.

    Rows are taken in that priority and a row is skipped when a taken one lies closer than the
    thinning stride, so labels cannot overlap.
    """
    stride = max(1, math.ceil(n / max(1, max_labels)))
    taken: list[int] = []
    for row in [*first, *_thinned(n, max_labels), *extra]:
        if all(abs(row - other) >= stride for other in taken):
            taken.append(row)
    return sorted(taken)


def _label_slots(fig: Figure, ax: Axes, fontsize: float, vertical: bool = True) -> int:
    """How many tick labels of ``fontsize`` points fit along the axes without overlapping."""
    width_in, height_in = fig.get_size_inches()
    pos = ax.get_position()
    # Before constrained layout has run, ax.get_position() is the full subplot slot: take ~75 %.
    length_in = (pos.height * height_in if vertical else pos.width * width_in) * 0.75
    return max(2, int(length_in * 72 / (fontsize * 1.35)))


# --------------------------------------------------------------------------------------------
# heatmap
# --------------------------------------------------------------------------------------------

_ROW_LINE = 1.4  # row height / label font size at which neighbouring labels do not touch
_HEATMAP_CHROME_IN = 2.6  # figure height beside the rows: title, x axis, legend, margins (inches)
#: The tallest heatmap figure (inches) this module makes to label every row: at 6 pt ~2500 rows; at
#: savefig's dpi up to 200 it stays below Agg's limit of 65536 pixels.
MAX_HEATMAP_HEIGHT_IN = 300.0


def _row_fontsize(n_rows: int) -> float:
    """Font size (points) of the module labels of a heatmap with ``n_rows`` rows."""
    return 8.0 if n_rows <= 30 else 6.0


def _rows_height(n_rows: int) -> float:
    """Figure height (inches) that gives each of ``n_rows`` rows room for its own label."""
    return _HEATMAP_CHROME_IN + n_rows * _row_fontsize(n_rows) * _ROW_LINE / 72


def _heatmap_height(n_rows: int, lo: float, hi: float) -> tuple[float, bool]:
    """``(height, label_all)``: the heatmap's height in inches, and whether every row gets a label.

    The height is ``2.2 + 0.16 * n_rows`` clipped to ``lo .. hi``, raised to what labelling every row
    needs, at most :data:`MAX_HEATMAP_HEIGHT_IN` (past that the labels are thinned).
    """
    need = _rows_height(n_rows)
    base = float(np.clip(2.2 + 0.16 * n_rows, lo, hi))
    return min(max(base, need), MAX_HEATMAP_HEIGHT_IN), need <= MAX_HEATMAP_HEIGHT_IN


def _module_codes(module: pd.Series) -> tuple[np.ndarray, list[str]]:
    """Integer codes of the module names and the name of each code (categorical codes, no copies).

    Raises:
        ValueError: a module name is missing (NaN/None).
    """
    categorical = module if isinstance(module.dtype, pd.CategoricalDtype) else module.astype("category")
    codes = categorical.cat.codes.to_numpy()
    if codes.size and codes.min() < 0:
        raise ValueError("records['module'] has missing values; the root module is named ''")
    return codes, [str(name) for name in categorical.cat.categories]


def _first_seen(selected: pd.DataFrame, codes: np.ndarray) -> np.ndarray:
    """Module codes in first-seen order: by (step, micro_step, seq) of each module's first record."""
    step = selected["step"].to_numpy(dtype="int64")
    # only rows in each module's first step can hold its first record: sort just those
    first_step = np.full(int(codes.max()) + 1 if codes.size else 0, np.iinfo(np.int64).max)
    np.minimum.at(first_step, codes, step)
    rows = np.nonzero(step == first_step[codes])[0]
    order = rows[
        np.lexsort(
            (
                selected["seq"].to_numpy(dtype="int64")[rows],
                selected["micro_step"].to_numpy(dtype="int64")[rows],
                step[rows],
            )
        )
    ]
    present, first = np.unique(codes[order], return_index=True)
    return present[np.argsort(first)]


def _module_order(selected: pd.DataFrame) -> list[str]:
    """Module names in first-seen order: by (step, micro_step, seq) of their first record."""
    codes, names = _module_codes(selected["module"])
    return [names[c] for c in _first_seen(selected, codes)]


def _grids(records: object, phase: object) -> tuple[pd.DataFrame, pd.DataFrame]:
    """``(absmax, nonfinite)`` module x step grids of the records in ``phase``.

    ``absmax`` holds the max absmax over every tensor and micro-step of that (module, step) (NaN
    where there was no record or no finite value); ``nonfinite`` is True where any of those
    tensors had ``n_nan + n_posinf + n_neginf > 0``.
    """
    frame, _ = _frame_of(records, "records", _GRID_COLUMNS)
    selected = _select_phase(frame, phase)
    codes, names = _module_codes(selected["module"])
    ordered = _first_seen(selected, codes)
    row_of_code = np.full(len(names), -1, dtype="int64")
    row_of_code[ordered] = np.arange(ordered.size)
    steps, column = np.unique(selected["step"].to_numpy(dtype="int64"), return_inverse=True)
    cell = row_of_code[codes] * steps.size + column.reshape(-1)
    shape = (ordered.size, steps.size)

    # max per cell, skipping NaN: -inf stands for "nothing finite yet" (absmax itself is >= 0)
    values = selected["absmax"].to_numpy(dtype="float64")
    absmax = np.full(shape[0] * shape[1], -np.inf)
    np.maximum.at(absmax, cell, np.where(np.isnan(values), -np.inf, values))
    absmax[np.isneginf(absmax)] = np.nan
    n_bad = (
        selected["n_nan"].to_numpy(dtype="int64")
        + selected["n_posinf"].to_numpy(dtype="int64")
        + selected["n_neginf"].to_numpy(dtype="int64")
    )
    bad = np.zeros(shape[0] * shape[1], dtype=bool)
    bad[cell[n_bad > 0]] = True

    index = pd.Index([names[c] for c in ordered], name="module")
    columns = pd.Index(steps, name="step")
    return (
        pd.DataFrame(absmax.reshape(shape), index=index, columns=columns),
        pd.DataFrame(bad.reshape(shape), index=index, columns=columns),
    )


def heatmap_grid(
    records: pd.DataFrame | TraceLike,
    *,
    value: HeatmapValue = "headroom",
    phase: str | Sequence[str] | None = "forward",
    dtype_limit: torch.dtype | str = "float16",
) -> pd.DataFrame:
    """The module x step matrix drawn by :func:`heatmap`.

    For each (module, step) this takes ``absmax`` = the max ``absmax`` over all of that module's
    tensors (inputs, outputs, gradients, parameters) and micro-steps in the chosen phase(s), then:

    * ``value="headroom"``: ``log2(finfo.max / absmax)`` in bits, ``finfo = torch.finfo(dtype_limit)``;
      for float16 ``log2(65504 / absmax)``. 0 bits = at the float16 maximum, negative = above it
      (possible for float32 tensors), ``+inf`` where ``absmax == 0``.
    * ``value="log2_absmax"``: ``log2(absmax)`` (float16 overflows above ``log2(65504) ~ 16``);
      ``-inf`` where ``absmax == 0``.

    Args:
        records: the nantrace records DataFrame, or a Trace (its ``records`` are used).
        value: ``"headroom"`` or ``"log2_absmax"``.
        phase: one of :data:`PHASES`, a sequence of them, or None for all phases.
        dtype_limit: the dtype whose ``finfo.max`` defines headroom (ignored for ``log2_absmax``).

    Returns:
        float64 DataFrame, index ``module`` (qualified names, root ``""``) in first-seen order
        (by step, micro_step, seq), columns ``step`` ascending. NaN where the module has no
        record in that step, or no finite value (see :func:`nonfinite_grid` for the latter).

    Raises:
        TypeError: ``records`` is neither a DataFrame nor a Trace, ``phase`` or ``dtype_limit`` has a
            wrong type.
        ValueError: a required column is missing, there are no rows (in ``phase``), or ``value``,
            ``phase`` or ``dtype_limit`` is not a recognised value.
    """
    kind = _check_value(value)
    limits = _limits(dtype_limit)
    absmax, _ = _grids(records, phase)
    return _transform(absmax, kind, limits)


def _transform(absmax: pd.DataFrame, kind: str, limits: _Limits) -> pd.DataFrame:
    """``log2(limits.max / absmax)`` (headroom, bits) or ``log2(absmax)``, elementwise."""
    data = absmax.to_numpy(dtype="float64")
    with np.errstate(divide="ignore"):
        out = np.log2(limits.max / data) if kind == "headroom" else np.log2(data)
    return pd.DataFrame(out, index=absmax.index, columns=absmax.columns)


def nonfinite_grid(
    records: pd.DataFrame | TraceLike,
    *,
    phase: str | Sequence[str] | None = "forward",
) -> pd.DataFrame:
    """Module x step bool matrix: True where any tensor of the module held NaN or +-inf.

    A cell is True when some record of that (module, step) in ``phase`` has
    ``n_nan + n_posinf + n_neginf > 0``. Same index and columns as :func:`heatmap_grid` with the
    same ``phase``; False where there is no record. ``records`` is the records DataFrame or a
    Trace (its ``records`` are used).

    Raises:
        TypeError: ``records`` is neither a DataFrame nor a Trace, or ``phase`` has a wrong type.
        ValueError: a required column is missing, there are no rows (in ``phase``), or ``phase``
            is not one of :data:`PHASES`.
    """
    _, bad = _grids(records, phase)
    return bad


def _phase_label(phase: object) -> str:
    phases = _parse_phase(phase)
    return "all phases" if phases is None else "phase " + "+".join(phases)


def _keep_riskiest(values: pd.DataFrame, bad: pd.DataFrame, value: str, max_modules: int) -> list[int]:
    """Row positions of the ``max_modules`` modules most at risk, in their original order.

    Rank: modules by the first step with a NaN/inf (earliest first; these point at the origin of a
    divergence), then the others by their largest ``log2_absmax`` (least headroom).
    """
    data = values.to_numpy(dtype="float64")
    risk = -data if value == "headroom" else data
    worst = np.where(np.isnan(risk), -np.inf, risk).max(axis=1)
    mask = bad.to_numpy(dtype=bool)
    first_bad = np.where(mask.any(axis=1), mask.argmax(axis=1), mask.shape[1])
    # lexsort sorts by the last key first: earliest non-finite step, then the largest risk
    ranked = np.lexsort((-worst, first_bad))
    return sorted(int(i) for i in ranked[:max_modules])


def _first_nonfinite(bad: pd.DataFrame) -> tuple[int, str] | None:
    """``(step, modules)`` of the first step with a NaN/inf; ``modules`` names up to two of them."""
    mask = bad.to_numpy(dtype=bool)
    columns = np.nonzero(mask.any(axis=0))[0]
    if not columns.size:
        return None
    col = int(columns[0])
    names = [f"'{_module_label(str(bad.index[int(r)]))}'" for r in np.nonzero(mask[:, col])[0]]
    text = ", ".join(names[:2]) + (f" and {len(names) - 2} more" if len(names) > 2 else "")
    return int(bad.columns[col]), text


def _ranks_note(records: object) -> str:
    """For records of several ranks (a merged trace, whose cells are the max over ranks): which rank produced
    the first overflow, by the cross-rank locator (``nantrace._locate``); ``""`` for one rank."""
    if (
        not isinstance(records, pd.DataFrame)
        or "rank" not in records.columns
        or records["rank"].nunique() < 2
    ):
        return ""
    from ._locate import find
    from ._schema import KINDS

    try:
        found = find(records, KINDS, None, world_size=None, first_only=True)
    except (KeyError, ValueError, TypeError):  # a frame without the locator's columns
        return ""
    ov = found[0].event if found else None
    ranks = ", ".join(str(int(r)) for r in sorted(records["rank"].unique()))
    if ov is None:
        return f" (ranks {ranks} merged)"
    f = ov.fields
    where = "the model inputs" if f["phase"] == "data" else f"'{_module_label(str(f['module']))}'"
    return f" (ranks {ranks} merged);\nrank {ov.rank} produced the first overflow: step {f['step']}, {f['phase']}, {where}"


def _step_columns(steps: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(x edges, column -> index into steps or -1)``: one cell a step wide at each recorded step
    (``[s - 0.5, s + 0.5]``), and one column of "no record" over each gap between recorded steps, so a cell
    never stands for a step that was not recorded (``every=10``: steps 1-9 are no record, not step 0's value)."""
    edges, index = [float(steps[0]) - 0.5], []
    for i, s in enumerate(steps.tolist()):
        if s - 0.5 > edges[-1]:  # steps between the previous recorded one and this one: no record
            edges.append(s - 0.5)
            index.append(-1)
        edges.append(s + 0.5)
        index.append(i)
    return np.asarray(edges), np.asarray(index)


def _special_levels(value: str, limits: _Limits) -> list[tuple[float, str]]:
    """Colour-bar levels of the dtype's max, smallest normal and smallest subnormal."""
    marks = [
        (limits.max, f"max {limits.max:g}"),
        (limits.smallest_normal, f"min normal 2^{round(math.log2(limits.smallest_normal))}"),
        (limits.smallest_subnormal, f"min subnormal 2^{round(math.log2(limits.smallest_subnormal))}"),
    ]
    if value == "headroom":
        return [(math.log2(limits.max / m), text) for m, text in marks]
    return [(math.log2(m), text) for m, text in marks]


@dataclass(frozen=True)
class _HeatmapRows:
    """The module x step grids one heatmap draws, after ``max_modules`` picked its rows."""

    values: pd.DataFrame  # headroom (bits) or log2 absmax of each drawn (module, step)
    bad: pd.DataFrame  # True where a NaN/inf was counted; same index and columns as values
    n_total: int  # modules in the phase before max_modules dropped any
    first_bad: tuple[int, str] | None  # (step, modules) of the first NaN/inf over all modules


def _heatmap_rows(
    records: object, value: str, phase: object, limits: _Limits, max_modules: int | None
) -> _HeatmapRows:
    """The grids of :func:`heatmap_grid` and :func:`nonfinite_grid`, cut to ``max_modules`` rows."""
    absmax, bad = _grids(records, phase)
    values = _transform(absmax, value, limits)
    n_total = len(values.index)
    first_bad = _first_nonfinite(bad)
    if max_modules is not None and n_total > max_modules:
        keep = _keep_riskiest(values, bad, value, max_modules)
        values, bad = values.iloc[keep], bad.iloc[keep]
    return _HeatmapRows(values=values, bad=bad, n_total=n_total, first_bad=first_bad)


@dataclass(frozen=True)
class _ColourScale:
    """How the cell values map to colours: the colour map, its range and the values as drawn."""

    cmap: Any  # a matplotlib Colormap with the "no data", "under" and "over" colours set
    vmin: float
    vmax: float
    shown: np.ndarray  # the cell values, +-inf replaced by a value just outside [vmin, vmax]
    n_beyond: int  # cells above the limit dtype's max that the NaN/inf overlay does not hide


def _colour_scale(data: np.ndarray, mask: np.ndarray, value: str, limits: _Limits) -> _ColourScale:
    """The colour scale of the cells ``data`` (headroom bits or log2 absmax); ``mask``: NaN/inf seen.

    The colour range ends at the limit dtype's max (0 bits of headroom, log2(max) of log2_absmax);
    values beyond it (only possible for tensors wider than the limit dtype) get one "over the
    limit" colour, the colour bar's extension.
    """
    import matplotlib

    finite = data[np.isfinite(data)]
    if value == "headroom":
        vmin = 0.0
        vmax = max(float(finite.max()) if finite.size else 0.0, 1.0)
        cmap = matplotlib.colormaps["RdYlBu"]  # red = little headroom
        cmap = cmap.with_extremes(bad=_NO_DATA_COLOR, under=_BEYOND_LIMIT_COLOR, over=cmap(1.0))
        shown = np.where(np.isposinf(data), vmax + 1.0, data)  # absmax == 0: most headroom
        beyond_cells = shown < vmin
    else:
        vmax = limits.log2_max
        vmin = min(float(finite.min()) if finite.size else vmax, vmax - 1.0)
        cmap = matplotlib.colormaps["RdYlBu_r"]  # red = large values
        cmap = cmap.with_extremes(bad=_NO_DATA_COLOR, over=_BEYOND_LIMIT_COLOR, under=cmap(0.0))
        shown = np.where(np.isneginf(data), vmin - 1.0, data)  # absmax == 0: smallest value
        beyond_cells = shown > vmax
    n_beyond = int(np.count_nonzero(beyond_cells & ~mask))  # those not hidden under the NaN/inf overlay
    return _ColourScale(cmap=cmap, vmin=vmin, vmax=vmax, shown=shown, n_beyond=n_beyond)


def _draw_nonfinite(
    ax: Axes, x_edges: np.ndarray, y_edges: np.ndarray, mask: np.ndarray, steps: np.ndarray
) -> None:
    """Overlay the cells of ``mask`` (NaN/inf seen) in magenta, with an x at each run's first step.

    The x keeps a single bad cell visible when cells are smaller than a pixel; with more than
    :data:`_MAX_NONFINITE_MARKERS` runs only the overlay is drawn.
    """
    from matplotlib.colors import ListedColormap

    overlay = ax.pcolormesh(
        x_edges,
        y_edges,
        np.ma.masked_where(~mask, np.ones(mask.shape)),
        cmap=ListedColormap([_NONFINITE_COLOR]),
        vmin=0,
        vmax=2,
        shading="flat",
        rasterized=True,
    )
    overlay.set_gid("nonfinite")
    onset = mask & ~np.pad(mask, ((0, 0), (1, 0)))[:, :-1]
    rows, cols = np.nonzero(onset)
    if rows.size <= _MAX_NONFINITE_MARKERS:
        ax.scatter(
            steps[cols],
            rows,
            marker="x",
            s=30.0 if mask.size <= 5000 else 16.0,
            c="black",
            linewidths=1.0,
            zorder=3,
            gid="nonfinite_onsets",
        )


def _draw_cells(ax: Axes, rows: _HeatmapRows, scale: _ColourScale) -> Any:
    """Draw the value cells and the NaN/inf overlay of ``rows``; return the value mesh."""
    n_rows = len(rows.values.index)
    recorded = rows.values.columns.to_numpy(dtype="float64")
    x_edges, index = _step_columns(recorded)
    gap = index < 0
    shown = np.where(gap[None, :], np.nan, scale.shown[:, np.maximum(index, 0)])
    mask = rows.bad.to_numpy(dtype=bool)[:, np.maximum(index, 0)] & ~gap[None, :]
    steps = np.where(gap, np.nan, recorded[np.maximum(index, 0)])
    y_edges = np.arange(n_rows + 1) - 0.5
    mesh = ax.pcolormesh(
        x_edges,
        y_edges,
        np.ma.masked_invalid(shown),
        cmap=scale.cmap,
        vmin=scale.vmin,
        vmax=scale.vmax,
        shading="flat",
        rasterized=True,
    )
    mesh.set_gid("values")
    if mask.any():
        _draw_nonfinite(ax, x_edges, y_edges, mask, steps)
    ax.set_xlim(x_edges[0], x_edges[-1])
    ax.set_ylim(n_rows - 0.5, -0.5)  # first-seen module on top
    return mesh


def _label_heatmap_axes(fig: Figure, ax: Axes, rows: _HeatmapRows, label_all: bool) -> None:
    """Module names on the y axis, axis labels.

    With ``label_all`` (the figure was sized for it) every row is named; else the names are
    thinned to fit the axes, keeping the first NaN/inf module.
    """
    from matplotlib.ticker import MaxNLocator

    n_rows = len(rows.values.index)
    mask = rows.bad.to_numpy(dtype=bool)
    fontsize = _row_fontsize(n_rows)
    if label_all:
        rows_shown = list(range(n_rows))
    else:
        # label the module of the first NaN/inf even when thinning would skip it
        bad_cols = np.nonzero(mask.any(axis=0))[0]
        first_bad_rows = np.nonzero(mask[:, bad_cols[0]])[0][:1].tolist() if bad_cols.size else []
        slots = _label_slots(fig, ax, fontsize)
        rows_shown = _spaced_labels(n_rows, slots, first=first_bad_rows, extra=[])
    names = [_module_label(str(rows.values.index[i])) for i in rows_shown]
    ax.set_yticks(rows_shown, names, fontsize=fontsize)
    ax.tick_params(axis="y", length=2)
    ax.xaxis.set_major_locator(MaxNLocator(nbins=12, integer=True))
    ax.set_xlabel("optimizer step", loc="left")  # the legend sits below the axes on the right
    if n_rows == rows.n_total:
        ax.set_ylabel(f"module, first-seen order ({n_rows} modules)")
    else:
        ax.set_ylabel(
            f"module, first-seen order\n{n_rows} of {rows.n_total}: earliest NaN/inf, then least headroom"
        )


def _overflow_line(ov: _OverflowLike, records: pd.DataFrame) -> str:
    """One line naming the locator's first overflow ``ov`` (and its rank, for a merged trace)."""
    where = f"the model's {ov.tensor}" if ov.phase == "data" else f"'{_module_label(ov.module)}' {ov.tensor}"
    line = f"first overflow in the trace: step {ov.step}, {ov.phase}, {where} ({ov.kind})"
    if "rank" in records.columns and records["rank"].nunique() > 1:
        ranks = ", ".join(str(int(r)) for r in sorted(records["rank"].unique()))
        line += f", produced by rank {ov.rank} (ranks {ranks} merged)"
    return line


_NO_OVERFLOW = "no overflow: the locator found no NaN/inf produced in this trace"


def _nonfinite_note(records: pd.DataFrame, rows: _HeatmapRows, parts: _TraceParts | None) -> str:
    """The heatmap title's lines on where the first NaN/inf is ("" when there is nothing to say).

    First the first (step, module) with a NaN/inf in the drawn phase (what the magenta shows; with
    the ranks note for records of several ranks). For a Trace, then the locator's first overflow in
    the whole trace, in any phase, which names its producer (or that it found none). An attention mask's
    ``-inf`` is never magenta (:func:`nantrace._masks.unmasked`).
    """
    lines = []
    if rows.first_bad is not None:
        step, modules = rows.first_bad
        ranks = _ranks_note(records) if parts is None else ""
        lines.append(f"first non-finite value at step {step} in {modules}{ranks}")
    if parts is not None:
        ov = parts.first_overflow()
        if ov is not None:
            lines.append(_overflow_line(ov, records))
        elif rows.first_bad is not None:
            lines.append(f"{_NO_OVERFLOW} (magenta cells: NaN/inf it does not count as produced)")
        else:
            lines.append(_NO_OVERFLOW)
    return "".join("\n" + line for line in lines)


def _heatmap_title(value: str, limits: _Limits, phase: object, note: str) -> str:
    """What the cells show and the phase, then ``note`` (where the first NaN/inf is)."""
    if value == "headroom":
        what = f"Headroom to {limits.name} max {limits.max:g}: log2({limits.max:g} / max|x|) [bits]"
    else:
        what = f"log2(max |x|) per module  ({limits.name} overflows above log2({limits.max:g}) = {limits.log2_max:.2f})"
    return f"{what}, {_phase_label(phase)}{note}"


def _heatmap_legend(fig: Figure, ax: Axes, limits: _Limits, n_beyond: int) -> None:
    """The legend of the special colours, below the axes on the right, beside the x label.

    It hangs a fixed 24 points below the axes (clear of the x tick labels), whatever their height.
    """
    from matplotlib.patches import Patch
    from matplotlib.transforms import offset_copy

    handles = [
        Patch(facecolor=_NONFINITE_COLOR, edgecolor="black", label="NaN/inf seen (x: first step of a run)"),
        Patch(facecolor=_NO_DATA_COLOR, edgecolor="black", label="no record / no finite value"),
    ]
    if n_beyond:
        handles.append(
            Patch(facecolor=_BEYOND_LIMIT_COLOR, label=f"above {limits.name} max ({n_beyond} cells)")
        )
    ax.legend(
        handles=handles,
        loc="upper right",
        bbox_to_anchor=(1.0, 0.0),
        bbox_transform=offset_copy(ax.transAxes, fig=fig, y=-24.0, units="points"),
        ncols=len(handles),
        fontsize=7,
        frameon=False,
        borderaxespad=0.2,
    )


def _draw_heatmap(
    fig: Figure,
    ax: Axes,
    records: pd.DataFrame,
    value: str,
    phase: object,
    limits: _Limits,
    max_modules: int | None,
    parts: _TraceParts | None,
    label_all: bool,
) -> tuple[Any, list[tuple[float, str]], str]:
    """Draw the heatmap of the checked ``records`` (those of ``parts`` for a Trace) on ``ax``, every row
    labelled when ``label_all``; return the value mesh, the colour-bar levels and its ``extend``."""
    rows = _heatmap_rows(records, value, phase, limits, max_modules)
    data = rows.values.to_numpy(dtype="float64")
    scale = _colour_scale(data, rows.bad.to_numpy(dtype=bool), value, limits)
    mesh = _draw_cells(ax, rows, scale)
    _label_heatmap_axes(fig, ax, rows, label_all)
    note = _nonfinite_note(records, rows, parts)
    ax.set_title(_heatmap_title(value, limits, phase, note), fontsize=10, loc="left")
    _heatmap_legend(fig, ax, limits, scale.n_beyond)
    extend = "neither" if not scale.n_beyond else ("min" if value == "headroom" else "max")
    return mesh, _special_levels(value, limits), extend


def _add_colorbar(
    fig: Figure, ax: Axes, mesh: Any, levels: list[tuple[float, str]], extend: str, label: str
) -> Any:
    """A colour bar for ``mesh`` whose ticks include the dtype's max/min-normal/min-subnormal levels."""
    from matplotlib.ticker import MaxNLocator

    cbar = fig.colorbar(mesh, ax=ax, fraction=0.04, pad=0.01, aspect=30, extend=extend, extendfrac=0.03)
    vmin, vmax = mesh.norm.vmin, mesh.norm.vmax
    inside = [(v, text) for v, text in levels if vmin <= v <= vmax]
    regular = [float(t) for t in MaxNLocator(nbins=8).tick_values(vmin, vmax) if vmin <= t <= vmax]
    # drop regular ticks that would collide with a labelled level
    gap = (vmax - vmin) / 25
    regular = [t for t in regular if all(abs(t - v) > gap for v, _ in inside)]
    ticks = regular + [v for v, _ in inside]
    labels = [f"{t:g}" for t in regular] + [f"{v:.0f}  ({text})" for v, text in inside]
    cbar.set_ticks(ticks, labels=labels, fontsize=7)
    for v, _ in inside:
        cbar.ax.axhline(v, color="black", linewidth=1.2)
    cbar.set_label(label, fontsize=8)
    return cbar


def heatmap(
    records: pd.DataFrame | TraceLike,
    *,
    value: HeatmapValue = "headroom",
    phase: str | Sequence[str] | None = "forward",
    dtype_limit: torch.dtype | str = "float16",
    max_modules: int | None = 200,
    ax: Axes | None = None,
) -> Figure:
    """Module x step heatmap of headroom (bits) or log2 absmax; NaN/inf cells in magenta.

    Each cell is one (module, step) of :func:`heatmap_grid`: the max absmax over that module's
    tensors and micro-steps in ``phase``, shown as headroom ``log2(finfo.max / absmax)`` bits
    (float16: ``log2(65504 / absmax)``; 0 bits = at ``torch.finfo(torch.float16).max = 65504``) or
    as ``log2(absmax)``. Red means close to overflow. Cells where a NaN or +-inf was counted are
    magenta, and an x marks the first step of each run of them in a module (omitted when there
    are more than 5000 runs), so that a single bad cell stays visible when cells are smaller than
    a pixel. Grey cells have no record or no finite value; black cells hold finite values above
    the limit dtype's max (tensors of a wider dtype, e.g. float32 with ``|x| > 65504``). The
    colour bar marks the dtype's max (0 bits of headroom, ``log2(65504) ~ 16``), its smallest
    normal (float16 ``2**-14``) and smallest subnormal (``2**-24``) where they fall in range.

    Modules run top to bottom in first-seen order, and every row is labelled with its module name:
    the new Figure is made tall enough (8 pt labels up to 30 rows, then 6 pt, ~0.12 inch a row)
    up to :data:`MAX_HEATMAP_HEIGHT_IN` inches (~2500 rows); past that, and on an ``ax`` you pass
    (whose size is yours), the labels are thinned to fit, keeping the first NaN/inf module.

    The title says where the first NaN/inf is: the first step with one in ``phase`` and its
    modules; for a Trace also the locator's first overflow in the whole trace
    (``tr.first_overflow()``: step, phase, producing module, tensor, kind), which ignores an
    attention mask's ``-inf`` and may lie in a phase not drawn (a GradScaler's backoff in backward).

    Args:
        records: the nantrace records DataFrame, or a Trace (its ``records`` are drawn).
        value: ``"headroom"`` (bits) or ``"log2_absmax"``.
        phase: one of :data:`PHASES`, a sequence of them, or None for all phases.
        dtype_limit: dtype whose limits are used, a :class:`torch.dtype` or a name (``"float16"``).
        max_modules: draw at most this many modules: first those with a NaN/inf, earliest first,
            then those with the least headroom; kept in first-seen order. None draws all.
        ax: axes to draw on; None makes a new Figure.

    Returns:
        The Figure holding the heatmap and its colour bar.

    Raises:
        ImportError: matplotlib is not installed.
        TypeError: an argument has the wrong type (``records`` neither a DataFrame nor a Trace,
            ``phase``, ``dtype_limit``, ``max_modules``, ``ax``); the message names it.
        ValueError: an argument has a bad value, ``records`` lacks a column or has no rows in ``phase``.
    """
    kind = _check_value(value)
    limits = _limits(dtype_limit)
    cap = _check_max_modules(max_modules)
    _parse_phase(phase)
    frame, parts = _frame_of(records, "records", _GRID_COLUMNS)
    _import_matplotlib()
    n_modules = frame["module"].nunique()
    rows = min(n_modules, cap) if cap is not None else n_modules
    height, fits = _heatmap_height(rows, 4.0, 12.0)
    label_all = fits and ax is None  # a Figure of our own, sized for every label
    fig, ax = _figure_and_ax(ax, figsize=(12.0, height))
    mesh, levels, extend = _draw_heatmap(fig, ax, frame, kind, phase, limits, cap, parts, label_all)
    label = "headroom [bits]" if kind == "headroom" else "log2(max |x|)"
    _add_colorbar(fig, ax, mesh, levels, extend, label)
    return fig


# --------------------------------------------------------------------------------------------
# loss-scale timeline
# --------------------------------------------------------------------------------------------


def _skipped_mask(skipped: pd.Series) -> np.ndarray:
    """True where ``skipped`` is True; False for False, None and NaN."""
    return skipped.eq(True).fillna(False).to_numpy(dtype=bool)


def _pow2_formatter() -> Any:
    from matplotlib.ticker import FuncFormatter

    def fmt(v: float, _pos: object) -> str:
        if v <= 0 or not math.isfinite(v):
            return ""
        e = math.log2(v)
        return f"$2^{{{round(e)}}}$" if abs(e - round(e)) < 1e-9 else ""

    return FuncFormatter(fmt)


def _timeline_frames(steps: pd.DataFrame) -> tuple[pd.DataFrame, list[tuple[int, pd.DataFrame]]]:
    """``(frame, per_rank)``: the rows whose scale and skips are drawn, and each rank's rows.

    ``per_rank`` is empty for one rank. For a merged trace the loss differs per rank (one line each),
    while the loss scale and the skipped steps are those of the lowest rank (every rank's scaler
    sees the same reduced gradients), so ``frame`` is the lowest rank's rows. Rows are by step.
    """
    frame = steps.sort_values("step", kind="stable")
    per_rank: list[tuple[int, pd.DataFrame]] = []
    if "rank" in frame.columns and frame["rank"].nunique() > 1:
        per_rank = [(int(r), frame[frame["rank"].to_numpy() == r]) for r in sorted(frame["rank"].unique())]
        frame = per_rank[0][1]
    return frame, per_rank


def _draw_scale(ax: Axes, x: np.ndarray, scale: np.ndarray, skipped: np.ndarray, handles: list[Any]) -> Axes:
    """The loss scale as a step line on a log2 axis, skipped steps as red x; return the loss's twin axis."""
    (line,) = ax.plot(x, scale, drawstyle="steps-post", color="black", linewidth=1.2, label="loss scale")
    line.set_gid("scale")
    handles.append(line)
    (marks,) = ax.plot(
        x[skipped],
        scale[skipped],
        linestyle="none",
        marker="x",
        markersize=7,
        markeredgewidth=1.6,
        color="red",
        zorder=5,
        label=f"skipped optimizer step ({int(skipped.sum())})",
    )
    marks.set_gid("skipped")
    handles.append(marks)
    ax.set_yscale("log", base=2)
    ax.yaxis.set_major_formatter(_pow2_formatter())
    ax.set_ylabel("loss scale (log2 axis)")
    loss_ax = ax.twinx()
    loss_ax.set_ylabel("loss", color=_LOSS_COLOR)
    loss_ax.tick_params(axis="y", colors=_LOSS_COLOR)
    return loss_ax


def _note_no_scaler(ax: Axes) -> None:
    """Say on ``ax`` that without a GradScaler only the loss is drawn."""
    ax.set_ylabel("loss")
    ax.text(
        0.01,
        0.97,
        "no GradScaler: the loss scale is NaN in every step, so only the loss is shown",
        transform=ax.transAxes,
        va="top",
        fontsize=8,
        color="dimgray",
    )


def _draw_losses(
    loss_ax: Axes,
    x: np.ndarray,
    loss: np.ndarray,
    per_rank: list[tuple[int, pd.DataFrame]],
    handles: list[Any],
) -> None:
    """The loss of ``x`` (the lowest rank's, for a merged trace), one line per further rank, and
    orange triangles along the top edge where the loss is not finite."""
    (loss_line,) = loss_ax.plot(
        x,
        loss,
        color=_LOSS_COLOR,
        linewidth=1.0,
        alpha=0.85,
        label=f"loss, rank {per_rank[0][0]}" if per_rank else "loss",
    )
    loss_line.set_gid("loss")
    handles.append(loss_line)
    for i, (rank, part) in enumerate(per_rank[1:]):
        (other,) = loss_ax.plot(
            part["step"].to_numpy(dtype="float64"),
            pd.to_numeric(part["loss"], errors="coerce").to_numpy(dtype="float64"),
            color=f"C{(i + 1) % 10}",
            linewidth=1.0,
            alpha=0.85,
            label=f"loss, rank {rank}",
        )
        other.set_gid(f"loss_rank{rank}")
        handles.append(other)
    bad_loss = ~np.isfinite(loss)
    if bad_loss.any():
        # a NaN/inf loss cannot be placed on the y axis: mark it along the top edge instead
        (bad_marks,) = loss_ax.plot(
            x[bad_loss],
            np.full(int(bad_loss.sum()), 0.98),
            linestyle="none",
            marker="v",
            markersize=5,
            color="darkorange",
            transform=loss_ax.get_xaxis_transform(),
            label=f"loss not finite ({int(bad_loss.sum())})",
        )
        bad_marks.set_gid("nonfinite_loss")
        handles.append(bad_marks)


def _draw_scale_timeline(ax: Axes, steps: pd.DataFrame) -> None:
    """Draw :func:`scale_timeline` of the checked ``steps`` frame on ``ax``."""
    from matplotlib.ticker import MaxNLocator

    frame, per_rank = _timeline_frames(steps)
    x = frame["step"].to_numpy(dtype="float64")
    scale = pd.to_numeric(frame["scale"], errors="coerce").to_numpy(dtype="float64")
    loss = pd.to_numeric(frame["loss"], errors="coerce").to_numpy(dtype="float64")
    handles: list[Any] = []
    if np.isfinite(scale).any():
        loss_ax = _draw_scale(ax, x, scale, _skipped_mask(frame["skipped"]), handles)
    else:
        loss_ax = ax
        _note_no_scaler(ax)
    _draw_losses(loss_ax, x, loss, per_rank, handles)
    ax.xaxis.set_major_locator(MaxNLocator(nbins=12, integer=True))
    ax.set_xlabel("optimizer step")
    title = "Loss scale and loss per optimizer step"
    if per_rank:
        title = f"Loss scale (rank {per_rank[0][0]}, the same on every rank) and loss of each rank per optimizer step"
    ax.set_title(title, fontsize=10, loc="left")
    ax.legend(
        handles=handles,
        loc="lower right",
        bbox_to_anchor=(1.0, 1.0),
        ncols=len(handles),
        fontsize=7,
        frameon=False,
        borderaxespad=0.2,
    )


def scale_timeline(steps: pd.DataFrame | TraceLike, ax: Axes | None = None) -> Figure:
    """Loss scale per step on a log2 axis, skipped steps as red x, and the loss on a twin axis.

    The loss scale is drawn as a step line (``steps["scale"]``, the scale used in that step's
    backward); steps where ``steps["skipped"]`` is True (the GradScaler found inf/NaN gradients and
    skipped the optimizer step) are red x markers at that step's scale. The loss is drawn on a
    second y axis; non-finite losses are orange triangles along the top edge. Without a GradScaler
    (``scale`` NaN in every row) only the loss is drawn, with a note saying so.

    Args:
        steps: the nantrace steps DataFrame (columns ``step, loss, scale, skipped`` are used), or
            a Trace (its ``steps`` are drawn).
        ax: axes to draw on; None makes a new Figure.

    Returns:
        The Figure holding the timeline.

    Raises:
        ImportError: matplotlib is not installed.
        TypeError: ``steps`` is neither a DataFrame nor a Trace, or ``ax`` is not an Axes.
        ValueError: ``steps`` lacks one of those columns or has no rows.
    """
    frame, _ = _frame_of(steps, "steps", _STEP_COLUMNS, which="steps")
    _import_matplotlib()
    fig, ax = _figure_and_ax(ax, figsize=(12.0, 3.6))
    _draw_scale_timeline(ax, frame)
    return fig


# --------------------------------------------------------------------------------------------
# per-module ranges for one step
# --------------------------------------------------------------------------------------------


def _default_step(selected: pd.DataFrame) -> int:
    """The first step with a NaN/inf in ``selected``, else its last step."""
    n_bad = selected["n_nan"] + selected["n_posinf"] + selected["n_neginf"]
    bad_steps = selected.loc[n_bad > 0, "step"]
    return int(bad_steps.min()) if not bad_steps.empty else int(selected["step"].max())


def _module_ranges(selected: pd.DataFrame) -> pd.DataFrame:
    """One row per module (first-seen order): absmin, absmax, module_type and non-finite counts."""
    module = selected["module"].astype(str).rename("module")
    grouped = selected.assign(module=module, module_type=selected["module_type"].astype(str)).groupby(
        "module", sort=False
    )
    table = grouped.agg(
        module_type=("module_type", "first"),
        absmin=("absmin", "min"),
        absmax=("absmax", "max"),
        n_nan=("n_nan", "sum"),
        n_posinf=("n_posinf", "sum"),
        n_neginf=("n_neginf", "sum"),
    )
    return table.reindex(_module_order(selected))


def _draw_bands(ax: Axes, limits: _Limits, left: float, right: float) -> None:
    """Shade the rounds-to-0, subnormal, normal and overflow bands of ``limits`` on a log2 x axis."""
    sub = f"$2^{{{round(math.log2(limits.smallest_subnormal))}}}$"
    normal = f"$2^{{{round(math.log2(limits.smallest_normal))}}}$"
    top = f"{limits.max:g}"
    bands = [
        (left, limits.smallest_subnormal, "#bdbdbd", f"to 0 (< {sub})"),
        (limits.smallest_subnormal, limits.smallest_normal, "#fdd49e", f"subnormal ({sub} .. {normal})"),
        (limits.smallest_normal, limits.max, "#d9f0d3", f"normal ({normal} .. {top})"),
        (limits.max, right, "#fcbba1", f"inf (> {top})"),
    ]
    label_tf = ax.get_xaxis_transform()
    for lo, hi, color, text in bands:
        if hi <= lo:
            continue
        span = ax.axvspan(lo, hi, color=color, alpha=0.55, zorder=0, linewidth=0)
        span.set_gid("band:" + text.split(" (")[0])  # "band:to 0", "band:subnormal", ...
        # the outer bands can be narrow: anchor their labels at the axes edge instead of centring
        if lo == left:
            x, ha = lo, "left"
        elif hi == right:
            x, ha = hi, "right"
        else:
            x, ha = math.sqrt(lo * hi), "center"
        ax.text(x, 1.005, text, transform=label_tf, ha=ha, va="bottom", fontsize=7, color="dimgray")
    for edge in (limits.smallest_subnormal, limits.smallest_normal, limits.max):
        ax.axvline(edge, color="dimgray", linewidth=0.8, linestyle="--", zorder=1)


def _check_step(step: object) -> int | None:
    """``step`` as an int, or None.

    Raises:
        TypeError: ``step`` is neither an int nor None (a bool is not an int here).
    """
    if step is not None and (isinstance(step, bool) or not isinstance(step, (int, np.integer))):
        raise TypeError(f"step must be an int or None, got {type(step).__name__} {step!r}")
    return None if step is None else int(step)


def _records_at(selected: pd.DataFrame, step: int, phase: object, why: str = "") -> pd.DataFrame:
    """The rows of ``selected`` (records in ``phase``) at ``step``; ``why`` says how it was chosen.

    Raises:
        ValueError: there are none; the message lists the steps present.
    """
    at_step = selected[selected["step"] == step]
    if at_step.empty:
        raise ValueError(
            f"step={step!r}{why} has no records in {_phase_label(phase)}; steps present: "
            f"{steps_text(sorted({int(s) for s in selected['step'].unique()}))}; pass another step or phase"
        )
    return at_step


def _ranges_step(
    selected: pd.DataFrame, step: int | None, phase: object, ov: _OverflowLike | None, is_trace: bool
) -> tuple[int, pd.DataFrame]:
    """``(step, rows)``: the step :func:`ranges` shows and the records of ``selected`` at it.

    An explicit ``step`` wins. Else, for a Trace, the step of the locator's first overflow ``ov``
    when it is in ``phase`` (the last step when the trace has none); otherwise (records, or a
    Trace whose first overflow is in another phase, e.g. a GradScaler's routine backoff in
    backward) the first step with a NaN/inf in ``selected``, else the last.

    Raises:
        ValueError: that step has no records in ``phase``.
    """
    if step is not None:
        return step, _records_at(selected, step, phase)
    phases = _parse_phase(phase)
    if is_trace and ov is not None and (phases is None or ov.phase in phases):
        return ov.step, _records_at(selected, ov.step, phase, " (the first overflow's step)")
    step = int(selected["step"].max()) if is_trace and ov is None else _default_step(selected)
    return step, _records_at(selected, step, phase)


@dataclass(frozen=True)
class _RangeRows:
    """The per-module columns of :func:`_module_ranges` as arrays, one entry per bar row."""

    absmin: np.ndarray
    absmax: np.ndarray
    n_nan: np.ndarray
    n_posinf: np.ndarray
    n_neginf: np.ndarray

    @property
    def bad(self) -> np.ndarray:
        """True where a NaN or +-inf was counted."""
        return (self.n_nan + self.n_posinf + self.n_neginf) > 0

    @classmethod
    def of(cls, table: pd.DataFrame) -> _RangeRows:
        return cls(
            absmin=table["absmin"].to_numpy(dtype="float64"),
            absmax=table["absmax"].to_numpy(dtype="float64"),
            n_nan=table["n_nan"].to_numpy(dtype="int64"),
            n_posinf=table["n_posinf"].to_numpy(dtype="int64"),
            n_neginf=table["n_neginf"].to_numpy(dtype="int64"),
        )


def _range_xlim(rows: _RangeRows, limits: _Limits) -> tuple[float, float]:
    """The x range: every positive ``|x|`` and the dtype's bands, with room for the band labels."""
    positive = np.concatenate([rows.absmin[rows.absmin > 0], rows.absmax[rows.absmax > 0]])
    # margins of 6 and 5 bits beyond the smallest subnormal and the max leave room for band labels
    left = min(limits.smallest_subnormal / 2**6, float(positive.min()) / 2 if positive.size else math.inf)
    right = max(limits.max * 2**5, float(positive.max()) * 2 if positive.size else 0.0)
    return left, right


def _draw_range_bars(ax: Axes, rows: _RangeRows) -> None:
    """One bar per row from absmin to absmax (red where a NaN/inf was counted), with end ticks."""
    n = rows.absmax.size
    y = np.arange(n)
    drawable = np.isfinite(rows.absmin) & np.isfinite(rows.absmax) & (rows.absmax > 0)
    lo = np.where(drawable, rows.absmin, np.nan)
    hi = np.where(drawable, rows.absmax, np.nan)
    colors = np.where(rows.bad, "tab:red", "tab:blue")
    height = 0.7 if n <= 60 else 0.9
    bars = ax.barh(
        y[drawable], (hi - lo)[drawable], left=lo[drawable], height=height, color=colors[drawable], zorder=2
    )
    for patch in bars:
        patch.set_gid("range")
    # a bar with absmin == absmax has no width on screen: end ticks keep it visible
    tick_size = 40 if n <= 60 else 10
    ax.scatter(lo[drawable], y[drawable], marker="|", s=tick_size, c=colors[drawable], zorder=3)
    ax.scatter(hi[drawable], y[drawable], marker="|", s=tick_size, c=colors[drawable], zorder=3)


def _mark_edge_rows(ax: Axes, rows: _RangeRows) -> None:
    """A red x at the right edge of rows with a NaN/inf (with their counts, up to 60 rows) and a
    grey dot at the left edge of all-zero rows."""
    n = rows.absmax.size
    y = np.arange(n)
    bad = rows.bad
    edge_tf = ax.get_yaxis_transform()
    if bad.any():
        ax.scatter(
            np.full(int(bad.sum()), 0.985),
            y[bad],
            marker="x",
            s=40 if n <= 60 else 12,
            c="red",
            linewidths=1.5,
            transform=edge_tf,
            zorder=4,
            gid="nonfinite_modules",
            clip_on=False,
        )
    if bad.any() and n <= 60:
        for row in np.nonzero(bad)[0]:
            counts = (("NaN", rows.n_nan[row]), ("+inf", rows.n_posinf[row]), ("-inf", rows.n_neginf[row]))
            ax.text(
                0.97,
                float(row),
                ", ".join(f"{k} {int(c)}" for k, c in counts if c),
                transform=edge_tf,
                ha="right",
                va="center",
                fontsize=7,
                color="darkred",
                bbox={"facecolor": "white", "alpha": 0.7, "edgecolor": "none", "pad": 1.0},
            )
    zero = (rows.absmax == 0) & ~bad
    if zero.any():
        ax.scatter(
            np.full(int(zero.sum()), 0.01),
            y[zero],
            marker="o",
            s=15,
            c="dimgray",
            transform=edge_tf,
            zorder=4,
        )


def _label_range_rows(fig: Figure, ax: Axes, table: pd.DataFrame, bad: np.ndarray) -> None:
    """``module (type)`` labels, thinned to fit but keeping NaN/inf modules, those in red."""
    n = len(table)
    fontsize = 8.0 if n <= 40 else 6.0
    bad_rows = np.nonzero(bad)[0].tolist()
    shown = _spaced_labels(n, _label_slots(fig, ax, fontsize), first=bad_rows[:1], extra=bad_rows[1:])
    labels = [f"{_module_label(str(table.index[i]))} ({table['module_type'].iloc[i]})" for i in shown]
    ax.set_yticks(shown, labels, fontsize=fontsize)
    for tick_label, i in zip(ax.get_yticklabels(), shown, strict=True):
        if bad[i]:
            tick_label.set_color("red")
    ax.set_ylim(n - 0.5, -0.5)


def _draw_ranges(fig: Figure, ax: Axes, table: pd.DataFrame, limits: _Limits) -> None:
    """Draw the bands, bars, edge marks, axes and row labels of the per-module ``table``."""
    from matplotlib.ticker import NullLocator

    rows = _RangeRows.of(table)
    left, right = _range_xlim(rows, limits)
    ax.set_xscale("log", base=2)
    ax.set_xlim(left, right)
    _draw_bands(ax, limits, left, right)
    _draw_range_bars(ax, rows)
    _mark_edge_rows(ax, rows)
    lo_exp, hi_exp = math.ceil(math.log2(left)), math.floor(math.log2(right))
    ax.set_xticks([2.0**e for e in _log2_ticks(lo_exp, hi_exp)])
    ax.xaxis.set_major_formatter(_pow2_formatter())
    ax.xaxis.set_minor_locator(NullLocator())
    _label_range_rows(fig, ax, table, rows.bad)
    ax.set_xlabel(
        f"|x| (log2 axis): bar from smallest non-zero |x| to largest finite |x|; bands of {limits.name}"
    )


def ranges(
    records: pd.DataFrame | TraceLike,
    step: int | None = None,
    *,
    phase: str | Sequence[str] | None = "forward",
    dtype_limit: torch.dtype | str = "float16",
    ax: Axes | None = None,
) -> Figure:
    """Per-module value range at one step against the dtype's subnormal/normal/overflow bands.

    Each module gets a horizontal bar from its smallest non-zero ``|x|`` (min ``absmin``) to its
    largest finite ``|x|`` (max ``absmax``) over its tensors and micro-steps in ``phase``, on a
    log2 x axis. Shaded vertical bands come from ``torch.finfo(dtype_limit)``; for float16:
    below ``2**-24`` (smallest subnormal) values round to 0, ``2**-24 .. 2**-14`` is subnormal
    (reduced precision), ``2**-14 .. 65504`` is normal, and above 65504
    (``torch.finfo(torch.float16).max``) values overflow to inf. Modules where a NaN or +-inf was
    counted get a red bar, a red label and a red x at the right edge; all-zero modules get a grey
    dot at the left edge. Given a Trace, the title's second line names the locator's first
    overflow in the trace (step, phase, module, tensor, kind; in any phase), or says there is none.

    Args:
        records: the nantrace records DataFrame, or a Trace (its ``records`` are drawn).
        step: the step to show. None picks, for a Trace, the step of its first overflow
            (``tr.first_overflow().step``) when that overflow is in ``phase``, and the last step
            when the trace has none; otherwise (records, or a first overflow in another phase,
            such as a GradScaler's routine backoff in backward) the first step with a NaN/inf in
            ``phase``, else the last.
        phase: one of :data:`PHASES`, a sequence of them, or None for all phases.
        dtype_limit: dtype whose bands are drawn, a :class:`torch.dtype` or a name (``"float16"``).
        ax: axes to draw on; None makes a new Figure.

    Returns:
        The Figure holding the chart.

    Raises:
        ImportError: matplotlib is not installed.
        TypeError: an argument has the wrong type (``records`` neither a DataFrame nor a Trace,
            ``step``, ``phase``, ``dtype_limit``, ``ax``); the message names it.
        ValueError: ``step`` (given, or the first overflow's) has no records in ``phase``, another
            argument has a bad value, or ``records`` lacks a column or has no rows in ``phase``.
    """
    limits = _limits(dtype_limit)
    step = _check_step(step)
    _parse_phase(phase)
    frame, parts = _frame_of(records, "records", _RANGE_COLUMNS)
    selected = _select_phase(frame, phase)
    ov = parts.first_overflow() if parts is not None else None
    step, at_step = _ranges_step(selected, step, phase, ov, parts is not None)
    _import_matplotlib()
    table = _module_ranges(at_step)
    n = len(table)
    fig, ax = _figure_and_ax(ax, figsize=(11.0, float(np.clip(1.8 + 0.2 * n, 3.5, 14.0))))
    _draw_ranges(fig, ax, table, limits)
    n_bad_modules = int(_RangeRows.of(table).bad.sum())
    title = (
        f"Value range per module at step {step}, {_phase_label(phase)} "
        f"({n} modules, {n_bad_modules} with NaN/inf)"
    )
    if parts is not None:
        title += "\n" + (_NO_OVERFLOW if ov is None else _overflow_line(ov, frame))
    ax.set_title(title, fontsize=10, loc="left", pad=18)
    return fig


# --------------------------------------------------------------------------------------------
# overview
# --------------------------------------------------------------------------------------------


def _overview_frames(records: object, steps: object) -> tuple[pd.DataFrame, pd.DataFrame, _TraceParts | None]:
    """``(records, steps, parts)`` of :func:`overview`'s two ways of being called.

    Raises:
        TypeError: a Trace with ``steps`` as well, records without ``steps``, or a wrong type.
        ValueError: a frame lacks a column or has no rows.
    """
    frame, parts = _frame_of(records, "records", _GRID_COLUMNS)
    if parts is None:
        if steps is None:
            raise TypeError(
                "overview(records, steps): steps is required with a records DataFrame; "
                "pass tr.steps as well, or the Trace alone: overview(tr)"
            )
        return frame, _check_frame(steps, "steps", _STEP_COLUMNS), None
    if steps is not None:
        raise TypeError(
            "overview(tr, steps): steps must not be given with a Trace, which holds its own; "
            "call overview(tr), or overview(records, steps) with both DataFrames"
        )
    step_frame = _check_frame(parts.steps, f"the {type(parts.trace).__name__}'s steps", _STEP_COLUMNS)
    return frame, step_frame, parts


def overview(
    records: pd.DataFrame | TraceLike,
    steps: pd.DataFrame | None = None,
    *,
    value: HeatmapValue = "headroom",
    phase: str | Sequence[str] | None = "forward",
    dtype_limit: torch.dtype | str = "float16",
    max_modules: int | None = 200,
) -> Figure:
    """One Figure: :func:`heatmap` on top and :func:`scale_timeline` below, sharing the step axis.

    Call it as ``overview(tr)`` with a Trace, or ``overview(records, steps)`` with its DataFrames.
    Units and arguments are those of :func:`heatmap` (headroom in bits against
    ``torch.finfo(dtype_limit).max``, 65504 for float16; every module row labelled) and
    :func:`scale_timeline`.

    Returns:
        The combined Figure (e.g. for ``fig.savefig("nantrace.png")``).

    Raises:
        ImportError: matplotlib is not installed.
        TypeError: ``records`` is neither a DataFrame nor a Trace, ``steps`` is missing with a
            records DataFrame, given with a Trace, or not a DataFrame, or another argument has the
            wrong type; the message names it.
        ValueError: as for :func:`heatmap` and :func:`scale_timeline`.
    """
    kind = _check_value(value)
    limits = _limits(dtype_limit)
    cap = _check_max_modules(max_modules)
    _parse_phase(phase)
    frame, step_frame, parts = _overview_frames(records, steps)
    _import_matplotlib()
    from matplotlib.figure import Figure

    n_modules = frame["module"].nunique()
    rows = min(n_modules, cap) if cap is not None else n_modules
    heat_h, label_all = _heatmap_height(rows, 3.5, 10.0)
    fig = Figure(figsize=(13.0, heat_h + 3.2), layout="constrained")
    heat_ax, time_ax = fig.subplots(2, 1, sharex=True, height_ratios=[heat_h, 3.0])
    mesh, levels, extend = _draw_heatmap(fig, heat_ax, frame, kind, phase, limits, cap, parts, label_all)
    label = "headroom [bits]" if kind == "headroom" else "log2(max |x|)"
    _add_colorbar(fig, heat_ax, mesh, levels, extend, label)
    _draw_scale_timeline(time_ax, step_frame)
    if len(step_frame):  # the shared axis spans every step of the run, recorded or not
        lo, hi = heat_ax.get_xlim()
        first, last = float(step_frame["step"].min()), float(step_frame["step"].max())
        heat_ax.set_xlim(min(lo, first - 0.5), max(hi, last + 0.5))
        heat_ax.set_facecolor(_NO_DATA_COLOR)  # the steps past the last record: no record
    heat_ax.set_xlabel("")
    heat_ax.tick_params(axis="x", labelbottom=True)
    return fig
