"""The facts the diagnosis rules read, computed once from a run view: :class:`Facts` (per-step lookups, skip
runs, series of absmax, loss and weights), the update-to-weight ratio, trends and the divergence rule."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import pandas as pd

from ._diagnosis import (
    CLIP_OBSERVED_FRACTION,
    COLLAPSE_RECURRING,
    COLLAPSE_RUN,
    DIVERGENCE_GROWTH,
    DIVERGENCE_JUMP_GRAD_NORM,
    DIVERGENCE_JUMP_LOSS,
    DIVERGENCE_JUMP_UPDATE_RATIO,
    DIVERGENCE_LOSS_GROWTH,
    DIVERGENCE_MIN_STEPS,
    DIVERGENCE_RISING,
    DIVERGENCE_UPDATE_RATIO,
    DIVERGENCE_WEIGHT_GROWTH,
    DIVERGENCE_WINDOW,
    HEALTHY_UPDATE_RATIO,
    QUIET_DIVERGENCE_GROWTH,
    UNHEALTHY_UPDATE_RATIO,
)
from ._evidence import NORMALISED_STEP_BOUND, WEIGHT_DECAY_BOUND, applied_updates, normalised_optimizer
from ._explain import first_after, overflows
from ._fmt import module_label, num, steps_text
from ._masks import is_mask
from ._overflow import Overflow
from ._schema import MASK_KIND, DType
from ._view import RunView

__all__ = [
    "DivergenceFacts",
    "Facts",
    "Trend",
    "as_float",
    "data_growth",
    "data_growth_words",
    "data_jump",
    "divergence",
    "fast_updates",
    "overflow_from_row",
    "ratio_per_step",
    "trend",
    "unchanged_weights_loss_words",
    "update_ratios",
    "without_written",
    "written_outside",
]


# ---------------------------------------------------------------------------------------------- the run
class Facts:
    """A run view's tables with the string views and per-step lookups the rules use."""

    def __init__(self, view: RunView) -> None:
        self.view = view
        self.records: pd.DataFrame = view.records
        self.steps: pd.DataFrame = view.steps
        self.ops: pd.DataFrame = view.ops
        self.options: dict[str, Any] = dict(view.meta.options)
        # the live model's handle (None when loaded or gone): only weights_beyond_of reads it
        self.model = view.model
        # the producers only: a rule reads their fields; the diagnosis's own event gets its message at the end
        self.events: list[Overflow] = [
            overflow_from_row(r) for r in overflows(view, messages=False).to_dict("records")
        ]
        r = self.records
        self.phase = r["phase"].astype(str).to_numpy()
        self.module = r["module"].astype(str).to_numpy()
        self.tensor = r["tensor"].astype(str).to_numpy().astype(str)
        self._starts: dict[str, np.ndarray] = {}
        self.step = r["step"].to_numpy().astype(np.int64)
        self.absmax = r["absmax"].to_numpy(dtype=np.float64)
        self.nonfinite = (
            (r["n_nan"].to_numpy() > 0) | (r["n_posinf"].to_numpy() > 0) | (r["n_neginf"].to_numpy() > 0)
        ) & ~is_mask(r)
        self.is_output = self.starts("output") if len(r) else np.zeros(0, bool)
        st = self.steps.sort_values("step") if len(self.steps) else self.steps
        self.step_ids: list[int] = [int(s) for s in st["step"].tolist()] if len(st) else []
        self.skipped: dict[int, bool | None] = {}
        self.scale: dict[int, float] = {}
        self.next_scale: dict[int, float] = {}
        self.loss: dict[int, float] = {}
        self.lr: dict[int, float] = {}
        self.grad_norm: dict[int, float] = {}
        self.stale: dict[int, float] = {}  # parameters whose .grad held inf/NaN before the step's backward
        self.applied_norm: dict[int, float] = {}  # grad norm when optimizer.step() ran (after any clipping)
        if len(st):
            for row in st.to_dict("records"):
                s = int(row["step"])
                sk = row["skipped"]
                self.skipped[s] = None if sk is None or pd.isna(sk) else bool(sk)
                self.scale[s] = as_float(row["scale"])
                self.next_scale[s] = as_float(row["next_scale"])
                self.loss[s] = as_float(row["loss"])
                self.lr[s] = as_float(row["lr"])
                self.grad_norm[s] = as_float(row["grad_norm"])
                self.stale[s] = as_float(row.get("stale_grads"))
                self.applied_norm[s] = as_float(row.get("applied_grad_norm"))
        loss_rows = (self.phase == "loss") & self.starts("loss")
        self._loss_seen = set(self.step[loss_rows].tolist())
        self._loss_bad = set(self.step[loss_rows & self.nonfinite].tolist())
        micro = self.records["micro_step"].to_numpy() if len(self.records) else np.zeros(0, dtype=np.int64)
        self._loss_seen_micro = set(
            zip(self.step[loss_rows].tolist(), micro[loss_rows].tolist(), strict=True)
        )
        bad = loss_rows & self.nonfinite
        self._loss_bad_micro = set(zip(self.step[bad].tolist(), micro[bad].tolist(), strict=True))
        self._later: dict[tuple[int, int], Overflow | None] = {}
        self._written: pd.DataFrame | None = None
        self._runs: dict[int, list[int]] = {}
        current: list[int] = []
        for s in self.step_ids:
            if self.skipped.get(s) is True:
                current.append(s)
                self._runs[s] = current
            else:
                current = []

    # --- small queries
    def starts(self, prefix: str) -> np.ndarray:
        """Rows whose tensor path starts with ``prefix`` (cached)."""
        hit = self._starts.get(prefix)
        if hit is None:
            hit = np.char.startswith(self.tensor, prefix) if len(self.tensor) else np.zeros(0, dtype=bool)
            self._starts[prefix] = hit
        return hit

    def whole_backward(self) -> bool:
        """The trace recorded the backward of the whole model (``backward`` phase, no ``modules=`` filter), so
        a non-finite gradient of it could not have gone unrecorded."""
        phases = self.options.get("phases")
        return (phases is None or "backward" in phases) and self.options.get("modules") is None

    def has_scaler(self) -> bool:
        return any(v is not None for v in self.skipped.values()) or any(
            not math.isnan(v) for v in self.scale.values()
        )

    def written(self) -> pd.DataFrame:
        """The parameters written outside ``optimizer.step()`` (:func:`written_outside`), computed once."""
        if self._written is None:
            self._written = written_outside(
                self.records, self.steps, str(self.options.get("optimizer") or "")
            )
        return self._written

    def stale_steps(self, steps: Sequence[int]) -> list[int]:
        """Those of ``steps`` at which some parameter's ``.grad`` already held inf/NaN before the step's backward
        added to it (recorded per step; an old trace without the column has none)."""
        return [s for s in steps if self.stale.get(s, math.nan) > 0]

    def clipping(self) -> tuple[int, float, float] | None:
        """The loop's own gradient clipping, observed: the last step whose gradients' norm at
        ``optimizer.step()`` was below :data:`CLIP_OBSERVED_FRACTION` of the (unscaled) norm the backward made,
        as ``(step, norm from the backward, norm applied)``; ``None`` when no step shows it."""
        hits = [
            (s, self.grad_norm[s], a)
            for s, a in self.applied_norm.items()
            if math.isfinite(a)
            and math.isfinite(self.grad_norm.get(s, math.nan))
            and a < CLIP_OBSERVED_FRACTION * self.grad_norm[s]
        ]
        return hits[-1] if hits else None

    def skipped_steps(self) -> list[int]:
        return [s for s in self.step_ids if self.skipped.get(s) is True]

    def skip_run(self, step: int) -> list[int]:
        """The consecutive skipped steps around ``step`` (in ``steps`` order); ``[step]`` if it was not skipped."""
        return self._runs.get(step, [step])

    def scale_range(self, steps: Sequence[int]) -> tuple[float, float]:
        """(scale used by the first of ``steps``, scale after the last of them: its ``next_scale``)."""
        used = [self.scale.get(s, math.nan) for s in steps]
        after = [self.next_scale.get(s, math.nan) for s in steps]
        first = next((v for v in used if not math.isnan(v)), math.nan)
        last = next((v for v in reversed(after) if not math.isnan(v)), math.nan)
        if math.isnan(last):
            last = next((v for v in reversed(used) if not math.isnan(v)), math.nan)
        return first, last

    def resumed_after(self, step: int) -> bool:
        return any(self.skipped.get(s) is False for s in self.step_ids if s > step)

    def scale_below_one(self, run: list[int]) -> bool:
        """A loss scale (before or after ``update()``) of a step of ``run`` fell below 1."""
        scales = [self.scale.get(s, math.nan) for s in run] + [self.next_scale.get(s, math.nan) for s in run]
        return any(v < 1 for v in scales if not math.isnan(v))

    def calibrating(self, run: list[int]) -> bool:
        """The run of skips opens the trace and ends with training resumed at a scale of at least 1: the
        GradScaler walking down from an ``init_scale`` too high for these gradients, however long it took."""
        if not run or not self.step_ids or run[0] != self.step_ids[0] or not self.resumed_after(run[-1]):
            return False
        return not self.scale_below_one(run)

    def is_collapse(self, run: list[int]) -> bool:
        if self.scale_below_one(run):
            return True
        if self.calibrating(run):
            return False
        if len(run) >= COLLAPSE_RUN:
            return True
        # steps from the run's start up to the first fault a lower scale cannot remove: skips caused by that
        # fault (e.g. a forward overflow every step) say nothing about the scale
        limit = self.first_fault_step()
        later = [s for s in self.step_ids if run[0] <= s < limit]
        n_skip = sum(1 for s in later if self.skipped.get(s) is True)
        if 2 * n_skip < len(later):
            return False
        if n_skip >= COLLAPSE_RUN:
            return True
        n_runs = len({self._runs[s][0] for s in later if s in self._runs})
        first, last = self.scale_range(later)
        fell = not (math.isnan(first) or math.isnan(last)) and last <= first / 2 ** (COLLAPSE_RECURRING - 1)
        return n_runs >= COLLAPSE_RECURRING and fell

    def first_fault_step(self) -> float:
        """Step of the first event that is not scale-dependent, a later micro-step's included (``inf`` when
        there is none)."""
        for ev in self.events:
            if not self.scale_dependent(ev):
                return ev.step
            if self.later_fault(ev) is not None:
                return ev.step
        return math.inf

    def fresh_steps(self) -> set[int]:
        """Steps whose weights differ from the step before: the first step, and every step after one the scaler
        did not skip (a skipped step leaves the weights, hence the next step's activations, unchanged)."""
        ids = self.step_ids
        return {s for i, s in enumerate(ids) if i == 0 or self.skipped.get(ids[i - 1]) is not True}

    def loss_nonfinite_steps(self) -> list[int]:
        """Steps whose recorded loss value (a ``loss`` row) held inf or NaN; steps without a loss row are not
        among them (their loss was not recorded)."""
        return sorted(self._loss_bad)

    def loss_finite(self, step: int, micro_step: int | None = None) -> bool:
        """The loss of ``step`` (of its micro-step ``micro_step`` when given and recorded) was finite."""
        if micro_step is not None and (step, micro_step) in self._loss_seen_micro:
            return (step, micro_step) not in self._loss_bad_micro
        if step in self._loss_seen:
            return step not in self._loss_bad
        return not math.isinf(self.loss.get(step, math.nan))

    def scale_dependent(self, ev: Overflow) -> bool:
        """The scaler skipped this step and the event is one a lower loss scale can remove (a gradient at the
        model's outputs counts when the loss of its own micro-step was finite)."""
        if self.skipped.get(ev.step) is not True:  # also None: no scaler
            return False
        if ev.phase == "backward":
            return True
        return (
            ev.phase == "loss"
            and not ev.tensor.startswith("loss")
            and self.loss_finite(ev.step, ev.micro_step)
        )

    def later_fault(self, ev: Overflow) -> Overflow | None:
        """For a scale-dependent event, the first event of a later micro-step of its step when that one is not
        scale-dependent (a NaN loss or a forward fault after a backoff in micro-step 0), else None."""
        if not self.scale_dependent(ev):
            return None
        key = (ev.step, ev.micro_step)
        if key not in self._later:
            nxt = first_after(self.view, ev.step, ev.micro_step)
            while nxt is not None and self.scale_dependent(nxt):
                nxt = first_after(self.view, nxt.step, nxt.micro_step)
            self._later[key] = nxt
        return self._later[key]

    def output_series(self, module: str | None, before: int) -> pd.Series:
        """Per-step max finite absmax of forward outputs (of ``module``, or of every module), steps < before."""
        m = (self.phase == "forward") & self.is_output & (self.step < before) & np.isfinite(self.absmax)
        if module is not None:
            m &= self.module == module
        if not m.any():
            return pd.Series(dtype=np.float64)
        return pd.Series(self.absmax[m]).groupby(self.step[m]).max().sort_index()

    def data_series(self, until: int) -> pd.Series:
        """Per-step max finite absmax of the model's floating-point inputs (phase ``data``; token ids and other
        integer inputs and masks left out), steps <= until."""
        m = self._inputs((self.phase == "data") & (self.step <= until))
        if not m.any():
            return pd.Series(dtype=np.float64)
        return pd.Series(self.absmax[m]).groupby(self.step[m]).max().sort_index()

    def _inputs(self, m: np.ndarray) -> np.ndarray:
        """The rows of ``m`` that are floating model inputs with a finite non-zero absmax, masks left out."""
        m = m & np.isfinite(self.absmax)
        if m.any():
            floating = self.records["dtype"].astype(str).str.startswith(("float", "bfloat")).to_numpy()
            m &= floating & ~is_mask(self.records) & (self.absmax > 0)
        return m

    def data_series_micro(self, step: int, micro: int) -> pd.Series:
        """Like :meth:`data_series`, per root forward: indexed by ``(step, micro_step)`` in time order, every
        micro-step up to and including ``(step, micro)``."""
        if not len(self.records):
            return pd.Series(dtype=np.float64)
        ms = self.records["micro_step"].to_numpy()
        m = self._inputs(
            (self.phase == "data") & ((self.step < step) | ((self.step == step) & (ms <= micro)))
        )
        if not m.any():
            return pd.Series(dtype=np.float64)
        key = pd.MultiIndex.from_arrays([self.step[m], ms[m]], names=["step", "micro_step"])
        return pd.Series(self.absmax[m], index=key).groupby(level=[0, 1]).max().sort_index()

    def weight_series(self, before: int) -> pd.Series:
        m = (self.phase == "optimizer") & (self.step < before) & np.isfinite(self.absmax)
        if not m.any():
            return pd.Series(dtype=np.float64)
        return pd.Series(self.absmax[m]).groupby(self.step[m]).max().sort_index()

    def rows_of(
        self, step: int, phase: str | Sequence[str], module: str | None = None, prefix: str | None = None
    ) -> pd.DataFrame:
        phases = [phase] if isinstance(phase, str) else list(phase)
        m = (self.step == step) & np.isin(self.phase, phases)
        if module is not None:
            m &= self.module == module
        if prefix is not None:
            m &= self.starts(prefix)
        return self.records[m]

    def op_of(self, ev: Overflow, kind: str | None = None) -> str | None:
        """The torch op the forward replay found inside the event's module call, if any."""
        o = self.ops
        if not len(o) or "op" not in o.columns:
            return None
        m = (
            (o["step"].to_numpy() == ev.step)
            & (o["micro_step"].to_numpy() == ev.micro_step)
            & (o["module"].astype(str).to_numpy() == ev.module)
            & (o["call"].to_numpy() == ev.call)
        )
        if kind is not None:
            m &= o["kind"].astype(str).to_numpy() == kind
        else:  # an intended mask value (MASK_KIND) names no producing op
            m &= o["kind"].astype(str).to_numpy() != MASK_KIND
        hit = o[m]
        return str(hit["op"].iloc[0]) if len(hit) else None

    def autocast(self) -> bool:
        """True when forward outputs were float16/bfloat16 while the inputs or the parameters (their gradients
        or optimizer-phase values) were float32: the signature of ``torch.autocast``. Token-id inputs are
        integers and not recorded, so the parameters decide for language models."""
        dt = self.records["dtype"].astype(str).to_numpy()
        tensors = self.records["tensor"].astype(str).to_numpy()
        half = ["float16", "bfloat16"]
        fwd_half = bool(np.isin(dt[(self.phase == "forward") & self.is_output], half).any())
        data_wide = bool((dt[self.phase == "data"] == "float32").any())
        params = (self.phase == "optimizer") | np.char.endswith(tensors.astype(str), ".grad")
        params_wide = bool((dt[params] == "float32").any())
        return fwd_half and (data_wide or params_wide)


def as_float(v: Any) -> float:
    try:
        return math.nan if v is None or pd.isna(v) else float(v)
    except (TypeError, ValueError):
        return math.nan


def overflow_from_row(r: Mapping[Any, Any]) -> Overflow:
    return Overflow(
        step=int(r["step"]),
        micro_step=int(r["micro_step"]),
        phase=str(r["phase"]),
        module=str(r["module"]),
        module_type=str(r["module_type"]),
        call=int(r["call"]),
        tensor=str(r["tensor"]),
        kind=str(r["kind"]),
        dtype=DType(str(r["dtype"])),
        message=str(r.get("message", "") or ""),
        rank=int(r.get("rank", 0) or 0),
        propagated=bool(r.get("propagated", False)),
    )


def finite_absmax(rows: pd.DataFrame, col: str = "absmax") -> float:
    v = rows[col].to_numpy(dtype=np.float64) if len(rows) else np.zeros(0)
    v = v[np.isfinite(v)]
    return float(v.max()) if v.size else math.nan


# ---------------------------------------------------------------------------------------------- update ratio
def update_ratios(records: pd.DataFrame) -> pd.DataFrame:
    """Per step and parameter, the update-to-weight ratio estimated from ``optimizer``-phase rows.

    ``ratio = |absmax_t - absmax_p| / (t - p) / absmax_p``, where ``absmax_t`` is the parameter's largest
    finite ``|w|`` after ``optimizer.step()`` of step ``t`` and ``p`` the step it was recorded before (``gap =
    t - p`` steps: 1 under full tracing, ``every`` and more on light or watched steps, so the ratio is a change
    per step whatever was recorded in between). It is a lower bound on the mean ``max|Δw| / max|w|`` of the
    steps between; healthy training is about 1e-3, :data:`HEALTHY_UPDATE_RATIO`. Needs ``optimizer=`` in
    ``nantrace.trace``; the first recorded step of each parameter has no ratio.

    Args:
        records: a trace's ``records``.

    Returns:
        DataFrame ``step, module, tensor, gap, absmax_before, absmax, ratio`` (one row per parameter and step
        from its second recording on; ``gap`` in steps, int64; empty when no parameter was recorded twice).
    """
    cols = ["step", "module", "tensor", "gap", "absmax_before", "absmax", "ratio"]
    opt = records[records["phase"].astype(str) == "optimizer"]
    if len(opt) == 0:
        return pd.DataFrame(columns=cols)
    df = pd.DataFrame(
        {
            "step": opt["step"].to_numpy().astype(np.int64),
            "module": opt["module"].astype(str).to_numpy(),
            "tensor": opt["tensor"].astype(str).to_numpy(),
            "absmax": opt["absmax"].to_numpy(dtype=np.float64),
        }
    )
    # one value per (parameter, step): the last recording of the step
    df = df.groupby(["module", "tensor", "step"], sort=True).last().reset_index()
    by = df.groupby(["module", "tensor"])
    df["absmax_before"] = by["absmax"].shift(1)
    df["gap"] = df["step"] - by["step"].shift(1)
    df = df.dropna(subset=["absmax_before"])
    df["gap"] = df["gap"].astype(np.int64)
    with np.errstate(divide="ignore", invalid="ignore"):
        before = df["absmax_before"].to_numpy(dtype=np.float64)
        after = df["absmax"].to_numpy(dtype=np.float64)
        gap = df["gap"].to_numpy(dtype=np.float64)
        ratio = np.where(before > 0, np.abs(after - before) / gap / before, np.nan)
    df = df.assign(ratio=ratio)
    return df[cols].sort_values(["step", "module", "tensor"]).reset_index(drop=True)


def written_outside(records: pd.DataFrame, steps: pd.DataFrame, optimizer: str) -> pd.DataFrame:
    """The parameters whose absmax changed between two ``optimizer`` rows by more than the optimizer's updates in
    between can move a weight: written outside ``optimizer.step()`` (a manual edit, a state-dict load, a weight
    average). Only for an optimizer of :func:`normalised_optimizer`: its updates are bounded by
    ``n · lr · (NORMALISED_STEP_BOUND + WEIGHT_DECAY_BOUND · |w|)`` over the ``n`` updates the steps between
    applied (the ones the GradScaler did not skip), ``lr`` their largest recorded learning rate.

    Returns:
        DataFrame ``step, module, tensor, gap, absmax_before, absmax, bound, updates, lr`` (empty when none, or
        when the optimizer or the learning rate is not known).
    """
    cols = ["step", "module", "tensor", "gap", "absmax_before", "absmax", "bound", "updates", "lr"]
    ur = update_ratios(records)
    if not normalised_optimizer(optimizer) or not len(ur) or not len(steps) or "lr" not in steps.columns:
        return pd.DataFrame(columns=cols)
    # the updates and their largest lr per distinct (step, gap): a few per step, not one per parameter
    windows = {
        (int(step), int(gap)): applied_updates(steps, int(step) - int(gap), int(step))
        for step, gap in set(zip(ur["step"].tolist(), ur["gap"].tolist(), strict=True))
    }
    keys = list(zip(ur["step"].tolist(), ur["gap"].tolist(), strict=True))
    n = np.array([windows[(int(a), int(b))][0] for a, b in keys], dtype=np.float64)
    top = np.array([windows[(int(a), int(b))][1] for a, b in keys], dtype=np.float64)
    before = ur["absmax_before"].to_numpy(dtype=np.float64)
    after = ur["absmax"].to_numpy(dtype=np.float64)
    bound = n * top * (NORMALISED_STEP_BOUND + WEIGHT_DECAY_BOUND * before)
    with np.errstate(invalid="ignore"):
        hit = (n > 0) & np.isfinite(bound) & (np.abs(after - before) > bound)
    out = ur[hit][["step", "module", "tensor", "gap", "absmax_before", "absmax"]].copy()
    out["bound"], out["updates"], out["lr"] = bound[hit], n[hit].astype(np.int64), top[hit]
    return out.reset_index(drop=True)[cols]


def without_written(ur: pd.DataFrame, written: pd.DataFrame | None) -> pd.DataFrame:
    """The rows of :func:`update_ratios` except those of the parameters ``written`` outside ``optimizer.step()``
    at their step (:func:`written_outside`): what they changed is not an update."""
    if written is None or not len(written) or not len(ur):
        return ur
    gone = set(
        zip(written["step"].tolist(), written["module"].tolist(), written["tensor"].tolist(), strict=True)
    )
    keys = zip(ur["step"].tolist(), ur["module"].tolist(), ur["tensor"].tolist(), strict=True)
    return ur[np.array([k not in gone for k in keys], dtype=bool)]


def ratio_per_step(records: pd.DataFrame, written: pd.DataFrame | None = None) -> pd.Series:
    """The median update-to-weight ratio per step (:func:`update_ratios`), leaving out the parameters
    ``written`` outside ``optimizer.step()`` (:func:`written_outside`) at their step."""
    ur = without_written(update_ratios(records), written)
    ur = ur[np.isfinite(ur["ratio"].to_numpy(dtype=np.float64))]
    if len(ur) == 0:
        return pd.Series(dtype=np.float64)
    return ur.groupby("step")["ratio"].median().sort_index()


# ---------------------------------------------------------------------------------------------- divergence
@dataclass
class Trend:
    growth: float = math.nan
    rising: float = math.nan
    first_step: int = 0
    last_step: int = 0
    first: float = math.nan
    last: float = math.nan
    n: int = 0
    steps: tuple[int, ...] = ()  # the steps the trend was read at
    n_rising: int = 0  # how many of its step-to-step changes rose


def trend(series: pd.Series, window: int = DIVERGENCE_WINDOW) -> Trend:
    s = series[np.isfinite(series.to_numpy(dtype=np.float64))].tail(window)
    if len(s) < 2:
        return Trend(n=len(s))
    v = s.to_numpy(dtype=np.float64)
    growth = v[-1] / v[0] if v[0] > 0 else math.inf if v[-1] > 0 else math.nan
    up = int(np.sum(np.diff(v) > 0))
    steps = tuple(int(i) for i in s.index)
    return Trend(growth, up / (len(v) - 1), steps[0], steps[-1], float(v[0]), float(v[-1]), len(s), steps, up)


def span_words(run: Facts, t: Trend, read: str = "recorded") -> tuple[str, str]:
    """``(where, rising)`` words for the trend ``t`` of a per-step series over steps ``t.first_step``–
    ``t.last_step``: ``""`` and ``"rising in 100% of the steps"`` when it was read at every recorded step from
    its first to its last; else the steps it was read at (``"read at the 4 steps that ran on new weights (0–2,
    7)"``), its rises counted over the changes between them, and why the other steps are left out. ``read``:
    ``"fresh"`` for a series read only at the steps that ran on new weights (a step after one the GradScaler
    skipped runs on that step's weights), ``"applied"`` for one recorded only where an update was applied
    (weights after ``optimizer.step()``), ``"recorded"`` otherwise."""
    steps, first, last = list(t.steps), t.first_step, t.last_step
    between = [s for s in run.step_ids if first <= s <= last]
    if steps == between:
        return "", f"rising in {t.rising:.0%} of the steps"
    seen = set(steps)
    left = [i for i, s in enumerate(between) if s not in seen]
    rising = f"rising in {t.n_rising} of the {len(steps) - 1} changes between them"
    if read == "fresh":
        reused = [between[i] for i in left if i and run.skipped.get(between[i - 1]) is True]
        if reused:
            return (
                f"read at the {len(steps)} steps that ran on new weights ({steps_text(steps)})",
                f"{rising}; step{'s' if len(reused) > 1 else ''} {steps_text(reused)} ran on the weights of the "
                f"step before {'them' if len(reused) > 1 else 'it'}, whose update the GradScaler skipped",
            )
    if read == "applied":
        skipped = [between[i] for i in left if run.skipped.get(between[i]) is True]
        if skipped:
            return (
                f"recorded at the {len(steps)} steps whose update was applied ({steps_text(steps)})",
                f"{rising}; the GradScaler skipped the update{'s' if len(skipped) > 1 else ''} of "
                f"step{'s' if len(skipped) > 1 else ''} {steps_text(skipped)}",
            )
    return f"recorded at the {len(steps)} steps {steps_text(steps)}", rising


@dataclass
class DivergenceFacts:
    found: bool
    evidence: list[str]
    lr: float = math.nan
    ratio: float = math.nan
    warmup: tuple[int, float, int, float] | None = None  # (first step, lr, last step, lr) of a rising lr
    weights_steady: bool = False  # the weights grew at least DIVERGENCE_WEIGHT_GROWTH times, not in one jump
    grew: str = "activations and weights grew"  # what the summary says grew
    last_step: int | None = None  # the last step of the window the rule read


def data_growth(run: Facts, step: int) -> Trend | None:
    """The model's inputs growing up to ``step``: their per-step absmax (:meth:`Facts.data_series`) over the
    trailing :data:`DIVERGENCE_WINDOW` recorded steps grew at least :data:`DIVERGENCE_GROWTH` times, rising in
    at least :data:`DIVERGENCE_RISING` of the changes, over at least :data:`DIVERGENCE_MIN_STEPS` steps (the
    thresholds activations are held to); None otherwise."""
    return _growth(run.data_series(step))


def _growth(series: pd.Series) -> Trend | None:
    """:func:`data_growth` of the inputs' per-step absmax ``series``."""
    t = trend(series)
    if t.n < DIVERGENCE_MIN_STEPS or not (t.growth >= DIVERGENCE_GROWTH and t.rising >= DIVERGENCE_RISING):
        return None
    if data_jump(series) is not None:
        return None  # one step made it: a batch out of range, not inputs growing step after step
    return t


def data_jump(
    series: pd.Series, window: int = DIVERGENCE_WINDOW
) -> tuple[int, float, float, tuple[int, int], float] | None:
    """``(step, factor, spread, (first, last) step of the spread, value before)`` when the last value of
    ``series`` (the inputs' per-step absmax) is at least
    :data:`DIVERGENCE_GROWTH` times the one before and that one step's factor exceeds the whole spread (max /
    min) of the trailing values before it: one batch out of range, not a climb. None otherwise."""
    s = series[np.isfinite(series.to_numpy(dtype=np.float64))].tail(window)
    v = s.to_numpy(dtype=np.float64)
    if len(v) < 3 or v[-2] <= 0 or v[:-1].min() <= 0:
        return None
    factor, spread = v[-1] / v[-2], v[:-1].max() / v[:-1].min()
    if factor < DIVERGENCE_GROWTH or factor <= spread:
        return None
    return int(s.index[-1]), float(factor), float(spread), (int(s.index[0]), int(s.index[-2])), float(v[-2])


def micro_jump_words(run: Facts, step: int, micro: int) -> tuple[str, str] | None:
    """``(evidence, advice)`` when the inputs of micro-step ``micro`` of ``step`` (gradient accumulation, a model
    called more than once per step) are at least :data:`DIVERGENCE_GROWTH` times those of every root forward
    before it and that factor exceeds their whole spread (:func:`data_jump` over root forwards), else None.
    Only for a run with several micro-steps in a step: otherwise it is :func:`data_growth_words`' per-step
    jump."""
    series = run.data_series_micro(step, micro)
    if len(series) < 3 or series.index[-1] != (step, micro):
        return None
    if series.index.get_level_values(1).max() == 0:
        return None
    v = series.to_numpy(dtype=np.float64)
    before = v[:-1][-DIVERGENCE_WINDOW:]
    factor, spread = v[-1] / before.max(), before.max() / before.min()
    if factor < DIVERGENCE_GROWTH or factor <= spread:
        return None
    where = f"step {step}, micro-step {micro}"
    n = len(before)
    return (
        f"the model's inputs (phase data) at {where} had absmax {num(v[-1])}, ×{num(factor)} the largest of the "
        f"{n} root forwards before it ({num(before.max())}; they stayed within ×{num(spread)}): one batch out "
        "of range",
        f"Check the batch of {where}: its inputs' absmax is ×{num(factor)} that of the {n} before it (a corrupt or "
        "unnormalised sample); validate or clip inputs where they are loaded.",
    )


def data_growth_words(run: Facts, step: int, micro: int | None = None) -> tuple[str, str] | None:
    """``(evidence, advice)`` when the model's inputs grew up to ``step`` (:func:`data_growth`), or jumped at
    its last recorded step (:func:`data_jump`), or (``micro`` given) at that micro-step
    (:func:`micro_jump_words`), else None."""
    if micro is not None:
        got = micro_jump_words(run, step, micro)
        if got is not None:
            return got
    series = run.data_series(step)
    jump = data_jump(series)
    if jump is not None and trend(series).n >= DIVERGENCE_MIN_STEPS:
        at, factor, spread, (first, last), prev = jump
        return (
            f"the model's inputs (phase data) jumped ×{num(factor)} at step {at} (absmax {num(prev)} → "
            f"{num(prev * factor)}), after staying within ×{num(spread)} over steps {first}–{last}: one batch "
            "out of range, not inputs growing",
            f"Check the batch of step {at}: its inputs' absmax is ×{num(factor)} the step before's (a corrupt or "
            "unnormalised sample); validate or clip inputs where they are loaded.",
        )
    t = _growth(series)
    if t is None:
        return None
    where, rose = span_words(run, t)
    grew = f"×{num(t.growth)} over steps {t.first_step}–{t.last_step}"
    return (
        f"the model's inputs (phase data) grew {grew} (absmax {num(t.first)} → {num(t.last)})"
        + (f", {where}" if where else "")
        + f", {rose}",
        f"The model's inputs grow step after step ({grew}): if they are not meant to, normalise them where they "
        "are made (divide by a running mean and std, or clip them); what the model computes from them grows "
        "with them.",
    )


def unchanged_weights_loss_words(run: Facts, step: int) -> str | None:
    """Evidence that something other than the weights moved the loss: over ``step`` and the steps after it that
    the GradScaler skipped (no update applied, the same weights), the loss changed at least
    :data:`DIVERGENCE_LOSS_GROWTH` times; None otherwise."""
    same = same_weights_losses(run, step)
    if len(same) < 2:
        return None
    lo, hi = min(v for _, v in same), max(v for _, v in same)
    if hi < DIVERGENCE_LOSS_GROWTH * lo:
        return None
    (a, first), (b, last) = same[0], same[-1]
    return (
        f"the loss went {num(first)} (step {a}) → {num(last)} (step {b}) on unchanged weights (the GradScaler "
        f"skipped every update in between): the inputs or the targets moved it, not the optimizer"
    )


def series_of(values: Mapping[int, float], steps: Sequence[int]) -> pd.Series:
    """The finite, positive values of ``values`` at ``steps``, indexed by step."""
    s = pd.Series({st: values.get(st, math.nan) for st in steps}, dtype=np.float64)
    return s[np.isfinite(s.to_numpy()) & (s.to_numpy() > 0)]


def last_lr(run: Facts, steps: Sequence[int]) -> tuple[float, int | None]:
    """The last finite, positive learning rate recorded at ``steps`` and its step; ``(nan, None)`` when none."""
    lrs = series_of(run.lr, steps)
    return (float(lrs.iloc[-1]), int(lrs.index[-1])) if len(lrs) else (math.nan, None)


def largest_jump(series: pd.Series) -> tuple[float, int, int]:
    """The largest one-step growth factor of ``series`` and the two steps it is between."""
    v = series.to_numpy(dtype=np.float64)
    if v.size < 2:
        return math.nan, 0, 0
    with np.errstate(divide="ignore", invalid="ignore"):
        f = v[1:] / v[:-1]
    i = int(np.nanargmax(f)) if np.isfinite(f).any() else 0
    return float(f[i]), int(series.index[i]), int(series.index[i + 1])


def warmup_of(run: Facts, steps: Sequence[int]) -> tuple[int, float, int, float] | None:
    """The learning rate's recorded rise over ``steps`` (a warmup the loop already does), or ``None`` when it did
    not rise in at least :data:`DIVERGENCE_RISING` of the step-to-step changes."""
    lr = series_of(run.lr, steps)
    if len(lr) < 2:
        return None
    v = lr.to_numpy(dtype=np.float64)
    if not (v[-1] > v[0] and float(np.mean(np.diff(v) > 0)) >= DIVERGENCE_RISING):
        return None
    return int(lr.index[0]), float(v[0]), int(lr.index[-1]), float(v[-1])


def short_divergence(run: Facts, before: int) -> DivergenceFacts | None:
    """Divergence seen from as few as two steps (too little history for the trend rule) when a signal is
    strong: between the last two fresh steps the loss grew at least :data:`DIVERGENCE_JUMP_LOSS` times and the
    gradient norm at least :data:`DIVERGENCE_JUMP_GRAD_NORM` times, or the update-to-weight ratio of the last
    step was at least :data:`DIVERGENCE_JUMP_UPDATE_RATIO` while the loss or the gradient norm grew at least
    :data:`DIVERGENCE_GROWTH` times."""
    steps = [s for s in run.step_ids if s < before and s in run.fresh_steps()][-DIVERGENCE_WINDOW:]
    if len(steps) < 2:
        return None
    loss, gn = series_of(run.loss, steps), series_of(run.grad_norm, steps)
    lj = loss.iloc[-1] / loss.iloc[-2] if len(loss) >= 2 else math.nan
    gj = gn.iloc[-1] / gn.iloc[-2] if len(gn) >= 2 else math.nan
    ratios = ratio_per_step(run.records, run.written())
    ratios = ratios[(ratios.index >= steps[0]) & (ratios.index < before)]
    ratio = float(ratios.iloc[-1]) if len(ratios) else math.nan
    # the gradients of the step after the jump overflowed (its norm is not finite) and the loss never came back
    # below the jump on any later recorded step: the update made the model blow up, not one odd batch
    later = _stuck_after(run, int(loss.index[-1]), float(loss.iloc[-2]), before) if len(loss) >= 2 else 0
    stuck = later > 0
    jump = lj >= DIVERGENCE_JUMP_LOSS and (gj >= DIVERGENCE_JUMP_GRAD_NORM or stuck)
    w = run.written()
    if jump and len(loss) >= 2 and bool(((w["step"] > loss.index[-2]) & (w["step"] <= loss.index[-1])).any()):
        jump = False  # a weight written outside optimizer.step() between them: the jump is not the lr's
    fast = ratio >= DIVERGENCE_JUMP_UPDATE_RATIO and (lj >= DIVERGENCE_GROWTH or gj >= DIVERGENCE_GROWTH)
    if not (jump or fast):
        return None
    ev: list[str] = []
    if len(loss) >= 2:
        a, b = int(loss.index[-2]), int(loss.index[-1])
        applied = applied_between(run, loss)
        span = "in one step" if b == a + 1 else f"across {applied} applied update(s), steps {a}–{b}"
        ev.append(
            f"loss {num(loss.iloc[-2])} (step {a}) → {num(loss.iloc[-1])} (step {b}): ×{num(lj)} {span}"
        )
        if stuck:
            ev.append(
                f"the gradients of step {b} overflowed (no finite gradient norm) and the loss stayed at least "
                f"×{num(DIVERGENCE_JUMP_LOSS)} above step {a}'s on the {later} later step(s)"
            )
    if len(gn) >= 2:
        ev.append(
            f"gradient norm {num(gn.iloc[-2])} (step {gn.index[-2]}) → {num(gn.iloc[-1])} (step {gn.index[-1]}): "
            f"×{num(gj)} in one step"
        )
    if not math.isnan(ratio):
        ev.append(
            f"update-to-weight ratio at step {int(ratios.index[-1])}: {num(ratio)} ({num(ratio / HEALTHY_UPDATE_RATIO)}× "
            f"the healthy {HEALTHY_UPDATE_RATIO:g})"
        )
    lr, lr_step = last_lr(run, steps)
    if lr_step is not None:
        ev.append(f"learning rate {num(lr)} at step {lr_step}")
    grew = " and ".join(
        w
        for w, ok in (("the loss", len(loss) >= 2 and lj > 1), ("the gradient norm", len(gn) >= 2 and gj > 1))
        if ok
    )
    if len(loss) < 2 or int(loss.index[-1]) == int(loss.index[-2]) + 1:
        jumped = " jumped in one step"
    else:  # steps the GradScaler skipped lie between: say how many updates the jump took
        jumped = " jumped across one applied update" if applied == 1 else " jumped"
    return DivergenceFacts(
        True,
        ev,
        lr,
        ratio,
        warmup_of(run, steps),
        grew=(grew or "the updates") + jumped,
        last_step=steps[-1],
    )


def applied_between(run: Facts, loss: pd.Series) -> int:
    """How many steps the optimizer applied between the last two steps of ``loss`` (not skipped by a scaler)."""
    a, b = int(loss.index[-2]), int(loss.index[-1])
    return sum(1 for st in run.step_ids if a <= st < b and run.skipped.get(st) is not True)


def _stuck_after(run: Facts, step: int, before_jump: float, before: int) -> int:
    """How many later recorded losses (before ``before``) there are when the gradient norm of ``step`` is not
    finite (its gradients overflowed, so the GradScaler skipped it) and every one of them stays at least
    :data:`DIVERGENCE_JUMP_LOSS` times ``before_jump``; 0 otherwise."""
    if math.isfinite(run.grad_norm.get(step, math.nan)) or not before_jump > 0:
        return 0
    later = [run.loss.get(st, math.nan) for st in run.step_ids if step < st < before]
    later = [v for v in later if math.isfinite(v)]
    if not (later and all(v >= DIVERGENCE_JUMP_LOSS * before_jump for v in later)):
        return 0
    same = [v for _, v in same_weights_losses(run, step)]
    if len(same) >= 2 and max(same) >= DIVERGENCE_JUMP_LOSS * min(same):
        return 0  # the loss moves as much with the weights unchanged: the inputs drive it, not the update
    return len(later)


def same_weights_losses(run: Facts, step: int) -> list[tuple[int, float]]:
    """``(step, loss)`` of the finite, positive losses of ``step`` and of the steps after it that ran on the same
    weights: while the GradScaler skips ``step`` and the steps after it, no update changes the weights."""
    ids = [st for st in run.step_ids if st >= step]
    out: list[tuple[int, float]] = []
    for i, st in enumerate(ids):
        v = run.loss.get(st, math.nan)
        if math.isfinite(v) and v > 0:
            out.append((st, v))
        if run.skipped.get(st) is not True or (i + 1 < len(ids) and ids[i + 1] != st + 1):
            break  # an update was applied after st (or steps are missing): later losses ran on other weights
    return out


def _weights_words(run: Facts, before: int, t: Trend, wt: Trend) -> tuple[bool, str]:
    """``(steady, evidence)`` of the divergence rule's weights: whether the largest weight grew at least
    :data:`DIVERGENCE_WEIGHT_GROWTH` times and not in one jump, and the sentence ("" without two recorded
    steps)."""
    steady = wt.n >= 2 and wt.growth >= DIVERGENCE_WEIGHT_GROWTH
    if wt.n < 2:
        return steady, ""
    ws = run.weight_series(before).loc[t.first_step : t.last_step]
    jump, a, b = largest_jump(ws)
    shape = ""
    if steady and jump * jump >= wt.growth:  # one step holds at least half of the growth (in log terms)
        steady = False
        shape = f", most of it in one jump ×{num(jump)} from step {a} to step {b}"
    elif steady:
        where, rose = span_words(run, wt, "applied")
        shape = f", {where}, {rose}" if where else f", {rose}"
    else:  # beside a fast update ratio: the ratio is per parameter, this is the largest |w| of any
        shape = (
            f": the largest |w| of any parameter grew less than ×{DIVERGENCE_WEIGHT_GROWTH:g}, while the update "
            "ratio above is each parameter's own change per step"
        )
    return steady, (
        f"weight absmax went {num(wt.first)} (step {wt.first_step}) → {num(wt.last)} (step {wt.last_step}) "
        f"(×{num(wt.growth)}){shape}"
    )


def divergence(
    run: Facts,
    before: int,
    module: str | None,
    *,
    growth_needed: float = DIVERGENCE_GROWTH,
    loss_growth_needed: float = DIVERGENCE_LOSS_GROWTH,
    quiet: bool = False,
) -> DivergenceFacts:
    """The divergence rule (module docstring of :mod:`nantrace._diagnose`) over the steps before ``before``."""
    fresh = run.fresh_steps()
    act = run.output_series(module, before)
    act = act[act.index.isin(fresh)]
    who = module_label(module) + " output" if module is not None else "forward output"
    if module is not None and len(act) < DIVERGENCE_MIN_STEPS:
        act, who = run.output_series(None, before), "forward output"
        act = act[act.index.isin(fresh)]
    if len(act) < DIVERGENCE_MIN_STEPS:
        short = None if quiet else short_divergence(run, before)
        return short if short is not None else DivergenceFacts(False, [])
    t = trend(act.tail(DIVERGENCE_WINDOW))
    act_ok = t.growth >= growth_needed and t.rising >= DIVERGENCE_RISING
    steps = [s for s in run.step_ids if t.first_step <= s <= t.last_step and s in fresh]
    loss = series_of(run.loss, steps)
    lt = trend(loss) if len(loss) >= DIVERGENCE_MIN_STEPS else None
    ratios = ratio_per_step(run.records, run.written())
    ratios = ratios[(ratios.index >= t.first_step) & (ratios.index <= t.last_step)]
    ratio = float(ratios.median()) if len(ratios) else math.nan
    wt = trend(run.weight_series(before).loc[t.first_step : t.last_step])
    has_params = wt.n >= 2 or len(ratios) > 0
    fast = not math.isnan(ratio) and ratio >= DIVERGENCE_UPDATE_RATIO
    params_ok = fast or (wt.n >= 2 and wt.growth >= DIVERGENCE_WEIGHT_GROWTH)
    loss_ok = lt is not None and lt.growth >= loss_growth_needed and lt.rising >= 0.5
    # the loss alone, far beyond the quiet threshold, with fast updates (a norm before the output hides the
    # activations' growth from the outputs recorded)
    loss_led = quiet and fast and lt is not None and lt.growth >= QUIET_DIVERGENCE_GROWTH and lt.rising >= 0.5
    # activations far beyond the trend threshold with fast updates while the loss has not risen yet
    act_led = not quiet and fast and t.growth >= QUIET_DIVERGENCE_GROWTH and t.rising >= DIVERGENCE_RISING
    if not (act_ok or loss_led):
        return DivergenceFacts(False, [])
    if lt is None and not has_params:
        return DivergenceFacts(False, [])
    if lt is not None and not loss_ok and not act_led:
        return DivergenceFacts(False, [])
    if has_params and not params_ok:
        return DivergenceFacts(False, [])
    if quiet and not (loss_ok and params_ok):
        return DivergenceFacts(False, [])
    where, rose = span_words(run, t, "fresh")
    over = f"over steps {t.first_step}–{t.last_step}" + (f", {where}" if where else "")
    ev = [
        f"{who} absmax grew {num(t.first)} → {num(t.last)} (×{num(t.growth)}) {over}, {rose}"
        if act_ok
        else f"{who} absmax went {num(t.first)} → {num(t.last)} (×{num(t.growth)}) {over}: the recorded "
        "activations did not grow with the loss"
    ]
    if lt is not None:
        verb = "rose" if lt.last > lt.first else "went"
        ev.append(
            f"loss {verb} {num(lt.first)} (step {lt.first_step}) → {num(lt.last)} (step {lt.last_step}) "
            f"(×{num(lt.growth)})"
            + (
                ""
                if loss_ok
                else f": the loss had not diverged yet (that takes ×{num(loss_growth_needed)} or more, rising in "
                "half the steps); the growth is in the activations"
            )
        )
    if not math.isnan(ratio):
        ev.append(
            f"update-to-weight ratio (change of a parameter's absmax per step) was {num(ratio)} (median), "
            f"{num(ratio / HEALTHY_UPDATE_RATIO)}× the healthy {HEALTHY_UPDATE_RATIO:g}"
        )
    steady, line = _weights_words(run, before, t, wt)
    if line:
        ev.append(line)
    lr, lr_step = last_lr(run, steps)
    if lr_step is not None:
        ev.append(f"learning rate {num(lr)}" + grad_norm_text(run.grad_norm, steps))
    if quiet:
        grew = "the loss and the weights grow fast"
    elif loss_ok or lt is None:
        grew = "activations and weights grew"
    else:
        grew = "activations grew with fast weight updates (the loss had not diverged yet)"
    return DivergenceFacts(True, ev, lr, ratio, warmup_of(run, steps), steady, grew, t.last_step)


def fast_updates(run: Facts) -> DivergenceFacts | None:
    """Divergence read from the updates alone: the median update-to-weight ratio over the recorded steps is at
    least :data:`UNHEALTHY_UPDATE_RATIO` (100x the healthy 1e-3: each step changes the weights by a tenth of their
    size or more), whatever the activations did; ``None`` when it is lower or parameters were not recorded."""
    ur = without_written(update_ratios(run.records), run.written())
    ur = ur[np.isfinite(ur["ratio"].to_numpy(dtype=np.float64))]
    if not len(ur):
        return None
    # weighted by size: a parameter that starts near 0 (a zero-initialised bias) has a large ratio of its own
    change = ((ur["absmax"] - ur["absmax_before"]).abs() / ur["gap"]).groupby(ur["step"]).sum()
    size = ur["absmax_before"].groupby(ur["step"]).sum()
    ratios = (change / size).sort_index()
    ratio = float(ratios.median())
    if not ratio >= UNHEALTHY_UPDATE_RATIO:
        return None
    first, last = int(ratios.index[0]), int(ratios.index[-1])
    span = f"step {first}" if first == last else f"steps {first}–{last}"
    ev = [
        f"update-to-weight ratio (change of the parameters' absmax per step over their absmax, summed over the "
        f"parameters) was {num(ratio)} (median over {span}), {num(ratio / HEALTHY_UPDATE_RATIO)}× the healthy "
        f"{HEALTHY_UPDATE_RATIO:g}; at {UNHEALTHY_UPDATE_RATIO:g} or more a run is diverging, not healthy"
    ]
    steps = [s for s in run.step_ids if s <= last]
    loss = series_of(run.loss, steps)
    if len(loss) >= 2:
        tail = loss.tail(DIVERGENCE_WINDOW)
        shown = ", ".join(
            f"{num(float(v))} (step {int(k)})"
            for k, v in zip(tail.index.tolist(), tail.tolist(), strict=True)
        )
        ev.append(f"loss {shown}")
    else:
        ev.append("loss not recorded")
    lr, lr_step = last_lr(run, steps)
    ev.append(f"learning rate {num(lr)}" if lr_step is not None else "learning rate not recorded")
    grew = "each update changes the weights by a tenth of their size or more"
    return DivergenceFacts(True, ev, lr, ratio, warmup_of(run, steps), grew=grew, last_step=last)


def grad_norm_text(grad_norm: Mapping[int, float], steps: Sequence[int]) -> str:
    """Describe the recorded gradient norm over ``steps`` with the steps its values come from.

    Quotes the first and last finite recorded values with their step ids, one value when only one step
    has it, and ", gradient norm not recorded" when none does, so the text never repeats one value as a
    trend (issue 17 item 9).
    """
    gn = [(s, float(grad_norm[s])) for s in steps if s in grad_norm and math.isfinite(float(grad_norm[s]))]
    if not gn:
        return ", gradient norm not recorded"
    if len(gn) == 1:
        return f", gradient norm {num(gn[0][1])} at step {gn[0][0]} (recorded once)"
    return f", gradient norm {num(gn[0][1])} (step {gn[0][0]}) → {num(gn[-1][1])} (step {gn[-1][0]})"
