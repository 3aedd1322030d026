"""Diagnosis: from a recorded trace, *why* the run went non-finite, and what to change.

:func:`diagnose` returns a :class:`Diagnosis` whose ``cause`` is exactly one of :data:`CAUSES`.
:func:`fp16_readiness` lists, from an fp32 or bf16 run, the modules whose values would not fit float16.
:func:`update_ratios` gives the per-step update-to-weight ratio of each parameter.

How a cause is decided (the thresholds are the module constants below)
----------------------------------------------------------------------
The locator gives, for every step that saw a non-finite value, that step's first producer (an *event*,
``Trace.overflows()``). Events are read in time order; the first one that is not a benign scaler backoff decides.

An event is *scale-dependent* (the kind a GradScaler exists to absorb) when the scaler skipped its step and it is
in ``backward``, or in ``loss`` on the gradient arriving at the model's outputs while the loss value itself was
finite. Every other event is a *fault*, classified on the spot:

* ``data``: phase ``data`` (NaN/+inf, or a -inf that is not an attention mask, in the model inputs); or a
  forward inf made from call inputs already holding inf while a model input was a mask holding -inf: the mask's
  -inf went on into values that are not a mask (locator rule 3).
* ``divergence`` (checked before the phase rules below; needs history, so a step-0 fault never is one): at least
  :data:`DIVERGENCE_MIN_STEPS` earlier steps were recorded, and over the last :data:`DIVERGENCE_WINDOW` of them
  the forward output absmax (of the producer module for a forward event, else of the whole model) grew at least
  :data:`DIVERGENCE_GROWTH` times, rising in at least :data:`DIVERGENCE_RISING` of the step-to-step changes; and
  the training signals agree: when the loss is recorded it rose at least :data:`DIVERGENCE_LOSS_GROWTH` times
  (rising in at least half of the changes), and when parameters are recorded the median update-to-weight ratio
  was at least :data:`DIVERGENCE_UPDATE_RATIO` (10x the healthy 1e-3) or the weights' absmax grew at least
  :data:`DIVERGENCE_WEIGHT_GROWTH` times. At least one of loss or parameters must be recorded. Steps right after
  a skipped step are left out of these series (their weights did not change).
* ``loss``: phase ``loss`` (outputs finite; the loss, or the gradient it sends back, is not).
* ``forward_overflow``: phase ``forward`` and kind inf; or kind NaN made from inputs beyond the output dtype's
  range (autocast casting a float32 value above 65504 to float16); or kind NaN made from finite inputs by a
  module whose own float32 parameter is beyond the output dtype's range (autocast's cast of the weight gives
  inf, then inf·0 or inf−inf). The parameter's absmax is its latest ``optimizer`` row before the event's step;
  when none shows it, a recording Trace whose GradScaler skipped every step from the event's on (so the
  optimizer did not change the weights after that forward) reads the live parameter at diagnose time: one
  ``torch.linalg.vector_norm(p, inf)`` per parameter of that one module (a loaded trace cannot know).
* ``invalid_op``: kind NaN in ``forward`` (from inputs holding no NaN) or in ``backward`` (from finite gradients).
* ``backward_overflow``: phase ``backward``, kind inf, not absorbed by a GradScaler (no scaler, or not skipped).
* ``optimizer``: phase ``optimizer`` (finite gradients, non-finite parameters after ``optimizer.step()``).

Under torch.distributed (see ``nantrace._dist``) an event is first checked for where it came from, before the
rules above. One rank's trace (a part, or ``Trace.rank_view(r)``) holds an event with ``propagated=True`` when
the rank's own values were finite and the value arrived through the gradient reduction: ``received``, since this
rank's rows cannot say what another rank did (the merged folder names the producer). In a merged trace the same
event is passed over when the rank that produced it (the merged locator's producer of that step) did so in a
scale-dependent way (a backoff that the other rank only shared), and is ``received`` naming that rank otherwise;
when the merged locator found that the reduction itself made the value (every rank's local gradients finite),
it is ``backward_overflow`` (``invalid_op`` for NaN) with the local absmax and the reduction as evidence.

A scale-dependent event belongs to a *run* of consecutive skipped steps. The run is a *collapse* when it is at
least :data:`COLLAPSE_RUN` steps long (the scale fell 256x in a row), or the loss scale falls below 1, or at least
half the steps from its start on are skipped and either :data:`COLLAPSE_RUN` of them are or the skips come back
in at least :data:`COLLAPSE_RECURRING` separate runs while the scale fell at least 2**(COLLAPSE_RECURRING - 1)
times (the scale keeps falling; a scaler that grows and backs off in turn does not). For a collapse, or a run the trace ends in: mostly-NaN events are
``invalid_op`` (NaN does not go away with a lower scale); a collapse is ``divergence`` when the divergence rule
holds over the steps up to its last event, else ``loss_scale_collapse`` (its ``overflow`` is the run's last
event: what still overflowed at the lowest scale). Any other run is a benign backoff and the search goes on.

When the GradScaler skipped steps but the trace holds no non-finite value at all while it recorded the backward
of the whole model (``backward`` phase, no ``modules=`` filter, one process): ``scaler_backoff`` with no event
and evidence that the overflow came from outside the traced model (another model sharing the GradScaler, as in a
GAN, or parameters outside it); this model is not blamed. Otherwise, when no fault was found:
``loss_scale_collapse`` for a collapse seen only in ``steps`` (backward not recorded);
``gradient_underflow`` when the run computed in float16 and at least :data:`UNDERFLOW_FRACTION` of the
parameter-gradient tensors (embeddings excepted; every step) are flushed: their largest ``|g|`` (as recorded,
i.e. times the loss scale) is below float16's smallest normal 2⁻¹⁴, or below :data:`UNDERFLOW_SMALL_ABSMAX` with
at least :data:`UNDERFLOW_ZERO_FRACTION` of the elements exactly 0 (zeros alone are not enough: a ReLU's dead
units give exact zeros at any scale); ``divergence`` when benign backoffs were seen and the divergence rule
holds up to the last of them; ``divergence`` with no overflow yet when the output absmax grew at least
:data:`QUIET_DIVERGENCE_GROWTH` times, the loss at least :data:`QUIET_DIVERGENCE_LOSS_GROWTH` times and the
update ratio or weights agree; ``scaler_backoff`` when benign backoffs were seen; else ``healthy``.

Update-to-weight ratio
----------------------
Estimated from consecutive ``optimizer``-phase rows of the same parameter: ``|absmax_t - absmax_{t-1}| /
absmax_{t-1}`` (:func:`update_ratios`), a lower bound on ``max|Δw| / max|w|``; healthy training is about 1e-3.
Parameters are recorded only when ``optimizer=`` is given to ``nantrace.trace``. ``lr`` and ``grad_norm`` from
``steps`` are reported alongside as evidence.
"""

from __future__ import annotations

import html
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

import numpy as np
import pandas as pd

from ._locate import DType, Overflow, is_mask

if TYPE_CHECKING:
    from ._trace import Trace

__all__ = [
    "CAUSES",
    "COLLAPSE_RECURRING",
    "COLLAPSE_RUN",
    "DIVERGENCE_GROWTH",
    "DIVERGENCE_LOSS_GROWTH",
    "DIVERGENCE_MIN_STEPS",
    "DIVERGENCE_RISING",
    "DIVERGENCE_UPDATE_RATIO",
    "DIVERGENCE_WEIGHT_GROWTH",
    "DIVERGENCE_WINDOW",
    "FP16_MAX",
    "FP16_SMALLEST_NORMAL",
    "FP16_SMALLEST_SUBNORMAL",
    "HEALTHY_UPDATE_RATIO",
    "QUIET_DIVERGENCE_GROWTH",
    "QUIET_DIVERGENCE_LOSS_GROWTH",
    "READINESS_COLUMNS",
    "UNDERFLOW_FRACTION",
    "UNDERFLOW_SMALL_ABSMAX",
    "UNDERFLOW_ZERO_FRACTION",
    "Diagnosis",
    "diagnose",
    "fp16_readiness",
    "update_ratios",
]

CAUSES: tuple[str, ...] = (
    "data",
    "forward_overflow",
    "invalid_op",
    "loss",
    "backward_overflow",
    "scaler_backoff",
    "loss_scale_collapse",
    "divergence",
    "optimizer",
    "gradient_underflow",
    "healthy",
    "received",
)

FP16_MAX = 65504.0  # torch.finfo(torch.float16).max
FP16_SMALLEST_NORMAL = 2.0**-14  # 6.1035e-05, torch.finfo(torch.float16).smallest_normal
FP16_SMALLEST_SUBNORMAL = 2.0**-24  # 5.9605e-08: below half of this, a value rounds to 0 in float16

HEALTHY_UPDATE_RATIO = 1e-3  # typical max|Δw| / max|w| per step of healthy training
DIVERGENCE_MIN_STEPS = 3  # recorded steps before the overflow needed to see a trend
DIVERGENCE_WINDOW = 8  # trailing steps the trend is measured over
DIVERGENCE_GROWTH = 4.0  # output absmax growth (last / first of the window)
DIVERGENCE_RISING = 0.6  # fraction of step-to-step changes that must be increases
DIVERGENCE_LOSS_GROWTH = 2.0  # loss growth over the window
DIVERGENCE_UPDATE_RATIO = 1e-2  # median update-to-weight ratio, 10x the healthy value
DIVERGENCE_WEIGHT_GROWTH = 2.0  # weight absmax growth over the window
QUIET_DIVERGENCE_GROWTH = 100.0  # output absmax growth for a divergence that has not overflowed yet
QUIET_DIVERGENCE_LOSS_GROWTH = 10.0  # loss growth for a divergence that has not overflowed yet
COLLAPSE_RUN = 8  # consecutive skipped steps (scale fell 2**8 = 256x in a row) that are not a benign backoff
COLLAPSE_RECURRING = (
    3  # separate runs of skips that, with half the steps skipped, mean the scale keeps falling
)
UNDERFLOW_ZERO_FRACTION = (
    0.5  # with a small absmax (below), this fraction of zeros makes a gradient "flushed"
)
UNDERFLOW_SMALL_ABSMAX = 2.0**-10  # 9.8e-4: a gradient whose largest |g| is this small has its bulk subnormal
UNDERFLOW_FRACTION = 0.5  # fraction of flushed parameter-gradient tensors that makes gradient_underflow

READINESS_COLUMNS: tuple[str, ...] = (
    "module",
    "module_type",
    "phase",
    "tensor_kind",
    "dtype",
    "absmax",
    "absmin",
    "headroom_bits",
    "footroom_bits",
    "verdict",
    "step",
    "n_records",
)


# ---------------------------------------------------------------------------------------------- result
@dataclass
class Diagnosis:
    """Why a traced run went non-finite (or did not), with the numbers and concrete fixes.

    Attributes:
        cause: exactly one of :data:`CAUSES`: ``"data"``, ``"forward_overflow"``, ``"invalid_op"``, ``"loss"``,
            ``"backward_overflow"``, ``"scaler_backoff"``, ``"loss_scale_collapse"``, ``"divergence"``,
            ``"optimizer"``, ``"gradient_underflow"``, ``"healthy"`` or, for one rank's trace of a
            torch.distributed run whose value came through the gradient reduction, ``"received"``.
        overflow: the :class:`~nantrace.Overflow` the cause is about (the root event, which is not always the
            first overflow of the run: a benign scaler backoff before a real fault is passed over), or ``None``
            (``healthy``, ``gradient_underflow``, a divergence that has not overflowed yet).
        evidence: short sentences holding the numbers the cause was decided on.
        advice: concrete fixes for this case, naming the module, the dtype and the numbers.
        summary: one sentence saying what happened.

    ``str()`` gives the cause, summary, evidence and advice as plain text; ``_repr_html_()`` the same as HTML
    (every string escaped with ``html.escape``).

    Raises:
        ValueError: on construction, when ``cause`` is not one of :data:`CAUSES`.
    """

    cause: str
    overflow: Overflow | None
    evidence: list[str] = field(default_factory=list)
    advice: list[str] = field(default_factory=list)
    summary: str = ""

    def __post_init__(self) -> None:
        if self.cause not in CAUSES:
            raise ValueError(f"cause must be one of {CAUSES}; got {self.cause!r}")

    @property
    def ok(self) -> bool:
        """True when nothing needs fixing: ``cause`` is ``"healthy"`` or the benign ``"scaler_backoff"``."""
        return self.cause in ("healthy", "scaler_backoff")

    def __str__(self) -> str:
        lines = [f"nantrace diagnosis: {self.cause}"]
        if self.summary:
            lines.append(self.summary)
        if self.evidence:
            lines.append("evidence:")
            lines += [f"  - {e}" for e in self.evidence]
        if self.advice:
            lines.append("advice:")
            lines += [f"  - {a}" for a in self.advice]
        return "\n".join(lines)

    def __repr__(self) -> str:
        where = ""
        if self.overflow is not None:
            ov = self.overflow
            where = f", step={ov.step}, phase={ov.phase!r}, module={ov.module!r}, kind={ov.kind!r}"
        return f"Diagnosis(cause={self.cause!r}{where})"

    def _repr_html_(self) -> str:
        e = html.escape
        ev = "".join(f"<li>{e(s)}</li>" for s in self.evidence)
        ad = "".join(f"<li>{e(s)}</li>" for s in self.advice)
        parts = [
            '<div class="nantrace-diagnosis">',
            f"<p><b>nantrace diagnosis</b>: <code>{e(self.cause)}</code></p>",
        ]
        if self.summary:
            parts.append(f"<p>{e(self.summary)}</p>")
        if self.overflow is not None:
            ov = self.overflow
            parts.append(
                f"<p>step {ov.step}, micro-step {ov.micro_step}, {e(ov.phase)}, "
                f"<code>{e(ov.module or '(root)')}</code> ({e(ov.module_type)}, call {ov.call}), "
                f"<code>{e(ov.tensor)}</code>, {e(ov.kind)}, {e(str(ov.dtype))}</p>"
            )
        if ev:
            parts.append(f"<p><b>Evidence</b></p><ul>{ev}</ul>")
        if ad:
            parts.append(f"<p><b>Advice</b></p><ul>{ad}</ul>")
        parts.append("</div>")
        return "".join(parts)

    def to_dict(self) -> dict[str, Any]:
        """``cause``, ``summary``, ``evidence``, ``advice`` and the overflow's fields (or ``None``)."""
        return {
            "cause": self.cause,
            "summary": self.summary,
            "overflow": None if self.overflow is None else self.overflow.to_dict(),
            "evidence": list(self.evidence),
            "advice": list(self.advice),
        }


# ---------------------------------------------------------------------------------------------- formatting
def _g(v: float | None) -> str:
    """A number in 4 significant digits; ``n/a`` for None/NaN."""
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "n/a"
    if math.isfinite(v) and 1e4 <= abs(v) < 1e7 and v == round(v):
        return f"{v:.0f}"  # 65504, not 6.55e+04
    return f"{v:.4g}"


def _name(module: str) -> str:
    return f"`{module}`" if module else "the root model"


def _attr(module: str) -> str:
    """Python expression reaching ``module`` from ``model``: ``"layers.0.attn"`` → ``model.layers[0].attn``."""
    if not module:
        return "model"
    out = "model"
    for part in module.split("."):
        out += f"[{part}]" if part.isdigit() else (f".{part}" if part.isidentifier() else f"[{part!r}]")
    return out


def _steps_text(steps: Sequence[int]) -> str:
    s = sorted(set(steps))
    if not s:
        return "none"
    if len(s) == 1:
        return str(s[0])
    if len(s) > 1 and s[-1] - s[0] == len(s) - 1:
        return f"{s[0]}–{s[-1]}"
    shown = ", ".join(str(x) for x in s[:8])
    return shown + (f", … ({len(s)} in all)" if len(s) > 8 else "")


# ---------------------------------------------------------------------------------------------- the run
class _Run:
    """The trace's tables with the string views and per-step lookups the rules use."""

    def __init__(self, trace: Trace) -> None:
        self.records: pd.DataFrame = trace.records
        self.steps: pd.DataFrame = trace.steps
        ops = getattr(trace, "ops", None)
        self.ops: pd.DataFrame = ops if isinstance(ops, pd.DataFrame) else pd.DataFrame()
        self.options: dict[str, Any] = dict(getattr(trace, "options", {}) or {})
        # the live model of a recording Trace (None when loaded or gone): only _weights_beyond reads it
        ref = getattr(trace, "_model_ref", None)
        self.model: Any = ref() if callable(ref) and not getattr(trace, "_read_only", True) else None
        ovs = trace.overflows()
        self.events: list[Overflow] = [_overflow_from_row(r) for r in ovs.to_dict("records")]
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
        if len(st):
            for row in st.to_dict("records"):
                s = int(row["step"])
                sk = row["skipped"]
                self.skipped[s] = None if sk is None or pd.isna(sk) else bool(sk)
                self.scale[s] = _float(row["scale"])
                self.next_scale[s] = _float(row["next_scale"])
                self.loss[s] = _float(row["loss"])
                self.lr[s] = _float(row["lr"])
                self.grad_norm[s] = _float(row["grad_norm"])
        loss_rows = (self.phase == "loss") & self.starts("loss")
        self._loss_seen = set(self.step[loss_rows].tolist())
        self._loss_bad = set(self.step[loss_rows & self.nonfinite].tolist())
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

    def is_collapse(self, run: list[int]) -> bool:
        if len(run) >= COLLAPSE_RUN:
            return True
        scales = [self.scale.get(s, math.nan) for s in run] + [self.next_scale.get(s, math.nan) for s in run]
        if any(v < 1 for v in scales if not math.isnan(v)):
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
        """Step of the first event that is not scale-dependent (``inf`` when there is none)."""
        faults = [ev.step for ev in self.events if not self.scale_dependent(ev)]
        return min(faults) if faults else math.inf

    def fresh_steps(self) -> set[int]:
        """Steps whose weights differ from the step before: the first step, and every step after one the scaler
        did not skip (a skipped step leaves the weights, hence the next step's activations, unchanged)."""
        ids = self.step_ids
        return {s for i, s in enumerate(ids) if i == 0 or self.skipped.get(ids[i - 1]) is not True}

    def loss_finite(self, step: int) -> bool:
        if step in self._loss_seen:
            return step not in self._loss_bad
        return not math.isinf(self.loss.get(step, math.nan))

    def scale_dependent(self, ev: Overflow) -> bool:
        """The scaler skipped this step and the event is one a lower loss scale can remove."""
        if self.skipped.get(ev.step) is not True:  # also None: no scaler
            return False
        if ev.phase == "backward":
            return True
        return ev.phase == "loss" and not ev.tensor.startswith("loss") and self.loss_finite(ev.step)

    def output_series(self, module: str | None, before: int) -> pd.Series:
        """Per-step max finite absmax of forward outputs (of ``module``, or of every module), steps < before."""
        m = (self.phase == "forward") & self.is_output & (self.step < before) & np.isfinite(self.absmax)
        if module is not None:
            m &= self.module == module
        if not m.any():
            return pd.Series(dtype=np.float64)
        return pd.Series(self.absmax[m]).groupby(self.step[m]).max().sort_index()

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


def _float(v: Any) -> float:
    try:
        return math.nan if v is None or pd.isna(v) else float(v)
    except (TypeError, ValueError):
        return math.nan


def _overflow_from_row(r: Mapping[Any, Any]) -> Overflow:
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


def _finite_max(rows: pd.DataFrame, col: str = "absmax") -> float:
    v = rows[col].to_numpy(dtype=np.float64) if len(rows) else np.zeros(0)
    v = v[np.isfinite(v)]
    return float(v.max()) if v.size else math.nan


# ---------------------------------------------------------------------------------------------- update ratio
def update_ratios(records: pd.DataFrame) -> pd.DataFrame:
    """Per step and parameter, the update-to-weight ratio estimated from ``optimizer``-phase rows.

    ``ratio = |absmax_t - absmax_{t-1}| / absmax_{t-1}``, where ``absmax_t`` is the parameter's largest finite
    ``|w|`` after ``optimizer.step()`` of step ``t`` (a lower bound on ``max|Δw| / max|w|``; healthy training
    is about 1e-3, :data:`HEALTHY_UPDATE_RATIO`). Needs ``optimizer=`` in ``nantrace.trace``; the first
    recorded step of each parameter has no ratio.

    Args:
        records: a trace's ``records``.

    Returns:
        DataFrame ``step, module, tensor, absmax_before, absmax, ratio`` (one row per parameter and step from
        its second recording on; empty when no parameter was recorded twice).
    """
    cols = ["step", "module", "tensor", "absmax_before", "absmax", "ratio"]
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
    df["absmax_before"] = df.groupby(["module", "tensor"])["absmax"].shift(1)
    df = df.dropna(subset=["absmax_before"])
    with np.errstate(divide="ignore", invalid="ignore"):
        before = df["absmax_before"].to_numpy(dtype=np.float64)
        after = df["absmax"].to_numpy(dtype=np.float64)
        ratio = np.where(before > 0, np.abs(after - before) / before, np.nan)
    df = df.assign(ratio=ratio)
    return df[cols].sort_values(["step", "module", "tensor"]).reset_index(drop=True)


def _ratio_per_step(records: pd.DataFrame) -> pd.Series:
    ur = update_ratios(records)
    ur = ur[np.isfinite(ur["ratio"].to_numpy(dtype=np.float64))]
    if len(ur) == 0:
        return pd.Series(dtype=np.float64)
    return ur.groupby("step")["ratio"].median().sort_index()


# ---------------------------------------------------------------------------------------------- divergence
@dataclass
class _Trend:
    growth: float = math.nan
    rising: float = math.nan
    first_step: int = 0
    last_step: int = 0
    first: float = math.nan
    last: float = math.nan
    n: int = 0


def _trend(series: pd.Series, window: int = DIVERGENCE_WINDOW) -> _Trend:
    s = series[np.isfinite(series.to_numpy(dtype=np.float64))].tail(window)
    if len(s) < 2:
        return _Trend(n=len(s))
    v = s.to_numpy(dtype=np.float64)
    growth = v[-1] / v[0] if v[0] > 0 else math.inf if v[-1] > 0 else math.nan
    rising = float(np.mean(np.diff(v) > 0))
    return _Trend(growth, rising, int(s.index[0]), int(s.index[-1]), float(v[0]), float(v[-1]), len(s))


@dataclass
class _Divergence:
    found: bool
    evidence: list[str]
    lr: float = math.nan
    ratio: float = math.nan


def _divergence(
    run: _Run,
    before: int,
    module: str | None,
    *,
    growth_needed: float = DIVERGENCE_GROWTH,
    loss_growth_needed: float = DIVERGENCE_LOSS_GROWTH,
    quiet: bool = False,
) -> _Divergence:
    """The divergence rule (module docstring) over the steps before ``before``."""
    fresh = run.fresh_steps()
    act = run.output_series(module, before)
    act = act[act.index.isin(fresh)]
    who = _name(module) + " output" if module is not None else "forward output"
    if module is not None and len(act) < DIVERGENCE_MIN_STEPS:
        act, who = run.output_series(None, before), "forward output"
        act = act[act.index.isin(fresh)]
    if len(act) < DIVERGENCE_MIN_STEPS:
        return _Divergence(False, [])
    window = act.tail(DIVERGENCE_WINDOW)
    t = _trend(window)
    if not (t.growth >= growth_needed and t.rising >= DIVERGENCE_RISING):
        return _Divergence(False, [])
    steps = [s for s in run.step_ids if t.first_step <= s <= t.last_step and s in fresh]
    loss = pd.Series({s: run.loss.get(s, math.nan) for s in steps}, dtype=np.float64)
    loss = loss[np.isfinite(loss.to_numpy()) & (loss.to_numpy() > 0)]
    lt = _trend(loss) if len(loss) >= DIVERGENCE_MIN_STEPS else None
    ratios = _ratio_per_step(run.records)
    ratios = ratios[(ratios.index >= t.first_step) & (ratios.index <= t.last_step)]
    ratio = float(ratios.median()) if len(ratios) else math.nan
    wt = _trend(run.weight_series(before).loc[t.first_step : t.last_step])
    has_params = wt.n >= 2 or len(ratios) > 0
    params_ok = (not math.isnan(ratio) and ratio >= DIVERGENCE_UPDATE_RATIO) or (
        wt.n >= 2 and wt.growth >= DIVERGENCE_WEIGHT_GROWTH
    )
    loss_ok = lt is not None and lt.growth >= loss_growth_needed and lt.rising >= 0.5
    if lt is None and not has_params:
        return _Divergence(False, [])
    if lt is not None and not loss_ok:
        return _Divergence(False, [])
    if has_params and not params_ok:
        return _Divergence(False, [])
    if quiet and not (loss_ok and params_ok):
        return _Divergence(False, [])
    ev = [
        f"{who} absmax grew {_g(t.first)} → {_g(t.last)} (×{_g(t.growth)}) over steps "
        f"{t.first_step}–{t.last_step}, rising in {t.rising:.0%} of the steps"
    ]
    if lt is not None:
        ev.append(f"loss rose {_g(lt.first)} → {_g(lt.last)} (×{_g(lt.growth)}) over the same steps")
    if not math.isnan(ratio):
        ev.append(
            f"update-to-weight ratio (change of a parameter's absmax per step) was {_g(ratio)} (median), "
            f"healthy is about {HEALTHY_UPDATE_RATIO:g}"
        )
    if wt.n >= 2:
        ev.append(f"weight absmax grew {_g(wt.first)} → {_g(wt.last)} (×{_g(wt.growth)})")
    lrs = [run.lr.get(s, math.nan) for s in steps]
    lrs = [v for v in lrs if not math.isnan(v)]
    lr = lrs[-1] if lrs else math.nan
    if not math.isnan(lr):
        gn = [run.grad_norm.get(s, math.nan) for s in steps]
        gn = [v for v in gn if math.isfinite(v)]
        ev.append(f"learning rate {_g(lr)}" + (f", gradient norm {_g(gn[0])} → {_g(gn[-1])}" if gn else ""))
    return _Divergence(True, ev, lr, ratio)


# ---------------------------------------------------------------------------------------------- the causes
def _skips_text(run: _Run) -> str | None:
    sk = run.skipped_steps()
    if not run.has_scaler():
        return None
    first, last = run.scale_range(run.step_ids)
    rng = f"; loss scale {_g(first)} → {_g(last)}" if not math.isnan(first) else ""
    return f"GradScaler skipped {len(sk)} of {len(run.step_ids)} steps ({_steps_text(sk)}){rng}"


def _keep_fp32_advice(run: _Run, module: str, dtype: str) -> str:
    if run.autocast():
        return (
            f"Keep {_name(module)} in float32: run it with autocast off, "
            f"`with torch.autocast(device_type=..., enabled=False): y = {_attr(module)}(x.float())`."
        )
    return (
        f"Keep {_name(module)} in float32 while the rest stays {dtype}: `{_attr(module)}.float()` and cast its "
        f"input with `.float()` (and the result back with `.to(torch.{dtype})`)."
    )


def _bf16_advice() -> str:
    return (
        "Or train in bfloat16 (`torch.autocast(device_type=..., dtype=torch.bfloat16)`): it has float32's range "
        "(max 3.4e38), so no loss scaling is needed."
    )


def _data(run: _Run, ev: Overflow) -> Diagnosis:
    rows = run.rows_of(ev.step, "data", prefix=ev.tensor)
    rows = rows[rows["micro_step"].to_numpy() == ev.micro_step]
    counts = {k: int(rows[f"n_{k}"].sum()) for k in ("nan", "posinf", "neginf")} if len(rows) else {}
    what = ", ".join(
        f"{n} {k.replace('posinf', '+inf').replace('neginf', '-inf')}" for k, n in counts.items() if n
    )
    shape = str(rows["shape"].iloc[0]) if len(rows) else "?"
    arg = rows["arg"].iloc[0] if len(rows) else None
    argname = f" (argument `{arg}`)" if isinstance(arg, str) and arg else ""
    where = f"step {ev.step}" + (f", micro-step {ev.micro_step}" if ev.micro_step else "")
    evidence = [
        f"model input `{ev.tensor}`{argname}, shape {shape}, dtype {ev.dtype}, held {what or 'non-finite values'} "
        f"at {where}, before any module ran",
        f"finite part of that input: absmax {_g(_finite_max(rows))}",
    ]
    later = [e.step for e in run.events if e.phase == "data"]
    if len(later) > 1:
        evidence.append(f"the model inputs were non-finite at steps {_steps_text(later)}")
    skips = _skips_text(run)
    if skips:
        evidence.append(skips)
    advice = [
        f"Check the data loader for the batch of {where} (input `{ev.tensor}`): look for log(0), division by "
        "zero, a corrupt sample or a missing value; e.g. `assert torch.isfinite(x).all()` in the loader.",
    ]
    if counts.get("neginf"):
        advice.append(
            "-inf in an input that is not an attention mask: clamp before the log "
            "(`torch.log(x.clamp_min(1e-6))` or `torch.log1p(x)`). If it is a mask, pass it as an argument whose "
            "name contains 'mask', or make it hold only 0 and -inf."
        )
    if counts.get("nan"):
        advice.append("Replace missing values before the model (`torch.nan_to_num(x)` or drop the sample).")
    summary = f"The model input `{ev.tensor}` was already non-finite at {where}: a data fault, not the model."
    return Diagnosis("data", ev, evidence, advice, summary)


def _call_inputs(run: _Run, ev: Overflow) -> pd.DataFrame:
    """The input rows of the event's module call (the model inputs for the root)."""
    phase = "data" if ev.module == "" else "forward"
    mine = run.rows_of(ev.step, phase, module=ev.module, prefix="input")
    return mine[(mine["micro_step"].to_numpy() == ev.micro_step) & (mine["call"].to_numpy() == ev.call)]


def _input_beyond_range(run: _Run, ev: Overflow) -> bool:
    """A forward NaN whose (finite, wider-dtype) inputs exceed the output dtype's range: the cast overflowed
    (autocast casting float32 inputs above 65504 to float16 gives inf, then inf - inf or 0·inf gives NaN)."""
    limit = _dtype_max(str(ev.dtype))
    return not math.isnan(limit) and _finite_max(_call_inputs(run, ev)) > limit


def _live_absmax(run: _Run, module: str, limit: float) -> list[tuple[str, str, float, int]]:
    """The live model's own parameters of ``module`` whose finite absmax exceeds ``limit`` (dtype wider than the
    limit's), as :func:`~nantrace._report.weights_beyond` rows with step -1 (unknown). One on-device reduction
    (``torch.linalg.vector_norm(p, inf)``, no copy of the parameter) and one host read per parameter of that one
    module, at diagnose time, never in a hook."""
    import torch

    from ._trace import module_names

    m = dict(module_names(run.model)).get(module) if run.model is not None else None
    if m is None:
        return []
    out: list[tuple[str, str, float, int]] = []
    with torch.no_grad():
        for pname, p in m.named_parameters(recurse=False):
            if (
                type(p)
                not in (torch.Tensor, torch.nn.Parameter)  # a DTensor shard: a reduction may be collective
                or not p.is_floating_point()
                or p.numel() == 0
                or p.is_meta
                or _dtype_max(str(p.dtype).removeprefix("torch.")) <= limit
            ):
                continue
            a = float(torch.linalg.vector_norm(p.detach(), ord=math.inf).item())
            if math.isfinite(a) and a > limit:
                out.append((pname, str(p.dtype).removeprefix("torch."), a, -1))
    return sorted(out, key=lambda t: -t[2])


def _weights_beyond(run: _Run, ev: Overflow) -> tuple[list[tuple[str, str, float, int]], bool]:
    """Own parameters of the event's module whose latest known absmax exceeds the output dtype's max (a float32
    weight above 65504 that autocast's cast to float16 makes inf), and whether they were read live.

    First the recorded ``optimizer`` rows of steps before the event (:func:`~nantrace._report.weights_beyond`).
    When none shows it, the live model of a recording Trace is read at diagnose time, but only when the
    GradScaler skipped every traced step from the event's on and no later ``optimizer`` row of the module was
    recorded: then ``optimizer.step()`` did not change the weights after that forward inside the trace (a change
    after the trace ended, or by code other than the optimizer after the event, cannot be seen)."""
    from ._report import weights_beyond

    dtype = str(ev.dtype)
    if ev.phase != "forward":
        return [], False
    inputs = _call_inputs(run, ev)
    if len(inputs) and int(inputs[["n_posinf", "n_neginf"]].to_numpy().sum()):
        return [], False  # an inf its inputs already held explains it (as the locator's explanation says)
    rec = weights_beyond(run.records, ev.module, ev.step, dtype)
    if rec:
        return rec, False
    limit = _dtype_max(dtype)
    later = [s for s in run.step_ids if s >= ev.step]
    if run.model is None or math.isnan(limit) or limit >= _dtype_max("float32") or not later:
        return [], False
    if not all(run.skipped.get(s) is True for s in later):
        return [], False
    if bool(((run.phase == "optimizer") & (run.module == ev.module) & (run.step >= ev.step)).any()):
        return [], False
    return _live_absmax(run, ev.module, limit), True


def _own_code(run: _Run, ev: Overflow) -> bool:
    """The non-finite value was made by the module's own forward code, not by a submodule: it was first seen at a
    submodule's input, or the module has recorded submodules (the locator reports a parent only when every
    submodule output before the value was finite)."""
    if ev.tensor.startswith("input"):
        return True
    prefix = ev.module + "." if ev.module else ""
    m = (
        (run.step == ev.step)
        & (run.phase == "forward")
        & run.is_output
        & np.char.startswith(run.module.astype(str), prefix)
        & (run.module != ev.module)
    )
    m &= run.records["micro_step"].to_numpy() == ev.micro_step
    return bool(m.any())


def _leaked_masks(run: _Run, ev: Overflow) -> list[str] | None:
    """For a forward inf made from call inputs that already held inf while a model input was a mask holding
    -inf: the names of those mask inputs (the mask's -inf went on beyond the mask); else ``None``."""
    if ev.kind != "inf":
        return None
    inputs = _call_inputs(run, ev)
    if not len(inputs) or int(inputs[["n_posinf", "n_neginf"]].to_numpy().sum()) == 0:
        return None
    data = run.rows_of(ev.step, "data")
    data = data[data["micro_step"].to_numpy() == ev.micro_step]
    data = data[is_mask(data)]
    if not len(data):
        return None
    names = [
        str(a) if isinstance(a, str) else str(t) for a, t in zip(data["arg"], data["tensor"], strict=True)
    ]
    return list(dict.fromkeys(names))


def _mask_leak(run: _Run, ev: Overflow, masks: list[str]) -> Diagnosis:
    shown = ", ".join(f"`{n}`" for n in masks)
    where = f"step {ev.step}" + (f", micro-step {ev.micro_step}" if ev.micro_step else "")
    evidence = [
        f"model input(s) {shown} held -inf and count as attention masks (by name, or every value 0 or -inf)",
        f"{_name(ev.module)} ({ev.module_type}, call {ev.call}) at {where} passed that -inf on into `{ev.tensor}`, "
        "which is not a mask, and it went on (an intended mask value only feeds attention scores before a "
        "softmax)",
    ]
    advice = [
        f"If {shown} is data, not a mask, find where its -inf comes from (e.g. log(0)) and clamp it; an "
        "argument named with 'mask' or 'bias' counts as an attention mask, so rename it.",
        "If it is a mask, add it only to attention scores that a softmax consumes, or use a large finite "
        "negative value (`torch.finfo(dtype).min`) instead of -inf.",
    ]
    summary = f"The -inf of the mask/bias input {shown} reached values that are not a mask at {where}."
    return Diagnosis("data", ev, evidence, advice, summary)


def _forward_overflow(run: _Run, ev: Overflow) -> Diagnosis:
    inputs = _call_inputs(run, ev)
    in_absmax = _finite_max(inputs)
    dtype = str(ev.dtype)
    limit = _dtype_max(dtype)
    own_code = _own_code(run, ev)
    op = run.op_of(ev, "posinf") or run.op_of(ev, "neginf") or run.op_of(ev, "nan")
    evidence = [
        f"{_name(ev.module)} ({ev.module_type}, call {ev.call}) at step {ev.step} turned finite inputs "
        f"(absmax {_g(in_absmax)}) into {'NaN' if ev.kind == 'nan' else 'inf'} in {dtype}, whose largest "
        f"finite value is {_g(limit)}"
    ]
    if in_absmax > limit:
        evidence.append(
            f"its inputs (absmax {_g(in_absmax)}) are already beyond {dtype}'s range: casting them to {dtype} "
            "(autocast) gives inf, and inf − inf or 0·inf then gives NaN"
        )
    if own_code:
        where = (
            f"first seen at `{ev.tensor}` of a submodule"
            if ev.tensor.startswith("input")
            else f"first seen at `{ev.tensor}` of {_name(ev.module)} itself, not of a submodule"
        )
        evidence.append(
            f"{where}: the overflow is in {_name(ev.module)}'s own forward code between its submodules (every "
            "submodule output before it was finite)"
        )
    if op:
        evidence.append(f"the forward replay names the op: `{op}`")
    beyond, live = _weights_beyond(run, ev)
    prefix = f"{ev.module}." if ev.module else ""
    made = "inf·0 or inf−inf then gives NaN" if ev.kind == "nan" else "and inf times the inputs gives inf"
    for pname, pdtype, absmax, since in beyond:
        if live:
            last = run.records[
                (run.phase == "optimizer")
                & (run.module == ev.module)
                & (run.tensor == pname)
                & (run.step < ev.step)
            ].sort_values("step")
            shown = (
                f"; its last optimizer row (step {int(last['step'].iloc[-1])}) showed "
                f"{_g(float(last['absmax'].iloc[-1]))}: it changed outside optimizer.step()"
                if len(last)
                else ""
            )
            when = (
                "read from the live model at diagnose time (the GradScaler skipped every step from "
                f"{ev.step} on, so the optimizer did not change it after that forward){shown}"
            )
        else:
            when = f"it grew past {_g(limit)} at step {since} (optimizer rows)"
        evidence.append(
            f"its parameter `{prefix}{pname}` ({pdtype}) has absmax {_g(absmax)}, beyond {dtype}'s {_g(limit)}: "
            f"autocast's cast of it to {dtype} gives inf, {made}; {when}"
        )
    prev = run.output_series(ev.module, ev.step)
    if len(prev):
        last = float(prev.iloc[-1])
        bits = math.log2(limit / last) if last > 0 and not math.isnan(limit) else math.nan
        evidence.append(
            f"its output absmax at step {int(prev.index[-1])} was {_g(last)} ({_g(bits)} bits of headroom)"
        )
    w = run.rows_of(ev.step - 1, "optimizer", module=ev.module) if ev.step > 0 else run.records.iloc[0:0]
    if len(w) and not beyond:
        evidence.append(f"its parameters' absmax after step {ev.step - 1}: {_g(_finite_max(w))}")
    skips = _skips_text(run)
    if skips:
        evidence.append(skips)
    advice = [_keep_fp32_advice(run, ev.module, dtype), _bf16_advice()]
    low = (ev.module + " " + ev.module_type).lower()
    if own_code:
        advice.insert(
            0,
            f"The op that overflows is in {_name(ev.module)}'s own forward (e.g. a residual add `x + f(x)` of "
            f"values near {_g(in_absmax)}): normalise before it (pre-norm) or compute that op in float32.",
        )
    if beyond:
        lr = run.lr.get(beyond[0][3], math.nan)
        lr_text = f" (lr was {lr:.4g} at step {beyond[0][3]})" if not math.isnan(lr) else ""
        grown = ", ".join(f"`{prefix}{t[0]}`" for t in beyond)
        advice[:0] = [
            f"Keep the weights of {_name(ev.module)} ({grown}) well below {_g(limit)}: a smaller learning rate"
            f"{lr_text}, weight decay, or gradient clipping (`torch.nn.utils.clip_grad_norm_`, after "
            "`scaler.unscale_(optimizer)`)."
            if not live
            else f"Find what set the weights of {_name(ev.module)} ({grown}) above {_g(limit)} (an in-place edit, "
            "a checkpoint) and keep them well below it: a smaller learning rate, weight decay, or gradient clipping.",
        ]
    if "attn" in low or "attention" in low:
        advice.insert(
            0,
            f"Attention scores overflow: scale q·kᵀ by 1/sqrt(head_dim) before the softmax, or use "
            f"`F.scaled_dot_product_attention`, which computes in float32 internally (inputs absmax {_g(in_absmax)}).",
        )
    elif (
        ev.module_type in ("Linear", "Conv1d", "Conv2d", "Conv3d", "Bilinear") and not own_code and not beyond
    ):
        advice.insert(
            0,
            f"{_name(ev.module)} multiplies inputs of absmax {_g(in_absmax)} into values above {_g(limit)}: "
            "rescale or normalise its input (a norm layer before it), or shrink its weights (init, weight decay).",
        )
    summary = (
        f"{_name(ev.module)} ({ev.module_type}) overflowed {dtype} in its forward at step {ev.step}: "
        f"activations exceeded {_g(limit)} from finite inputs."
    )
    if beyond:
        summary = (
            f"{_name(ev.module)} ({ev.module_type}) overflowed {dtype} in its forward at step {ev.step}: its "
            f"{beyond[0][1]} weights exceed {_g(limit)}, so autocast's cast to {dtype} made them inf."
        )
    return Diagnosis("forward_overflow", ev, evidence, advice, summary)


def _dtype_max(name: str) -> float:
    from ._report import dtype_max

    return dtype_max(name)


_OP_HINTS: tuple[tuple[str, str], ...] = (
    ("div", "0/0 or x/0: add an eps to the denominator (`x / (n + 1e-6)`; `F.normalize(x, eps=...)`)"),
    ("sqrt", "sqrt/rsqrt of a negative or of 0: clamp the argument (`x.clamp_min(eps)`) or add eps inside"),
    ("log", "log of a negative value or of 0: clamp the argument (`x.clamp_min(eps)`)"),
    ("pow", "a fractional power of a negative value: clamp the base"),
    ("sub", "inf − inf: an intermediate overflowed; compute it in float32"),
    ("mul", "0·inf: an intermediate overflowed or a masked entry; compute it in float32 or mask earlier"),
)


def _invalid_op(run: _Run, ev: Overflow) -> Diagnosis:
    dtype = str(ev.dtype)
    if ev.phase == "forward":
        mine = run.rows_of(ev.step, "forward", module=ev.module)
        mine = mine[(mine["micro_step"].to_numpy() == ev.micro_step) & (mine["call"].to_numpy() == ev.call)]
        inputs = mine[mine["tensor"].astype(str).str.startswith("input")]
        if ev.module == "":
            inputs = run.rows_of(ev.step, "data")
        in_neginf = int(inputs["n_neginf"].sum()) if len(inputs) else 0
        op = run.op_of(ev, "nan")
        evidence = [
            f"{_name(ev.module)} ({ev.module_type}, call {ev.call}) at step {ev.step} produced NaN in "
            f"`{ev.tensor}` ({dtype}) from inputs holding no NaN (finite absmax {_g(_finite_max(inputs))}, "
            f"{f'{in_neginf} -inf value(s)' if in_neginf else 'no -inf'})"
        ]
        if op:
            evidence.append(f"the forward replay names the op: `{op}`")
        advice: list[str] = []
        if in_neginf:
            evidence.append("its inputs held -inf (an attention mask): a row with every key masked")
            advice.append(
                f"A fully masked softmax row in {_name(ev.module)}: softmax over all -inf is 0/0 = NaN. Keep at "
                "least one unmasked key per query, use a large finite negative (`torch.finfo(dtype).min`) instead "
                "of -inf, or zero the row after the softmax (`probs.masked_fill(all_masked, 0)`)."
            )
        hint = next((h for k, h in _OP_HINTS if op is not None and k in op.lower()), None)
        if in_neginf and op is not None and any(k in op.lower() for k in ("sub", "mul", "add", "exp")):
            hint = None  # the mask's -inf explains it
        if hint:
            advice.append(f"In {_name(ev.module)}: {hint}.")
        low = (ev.module + " " + ev.module_type).lower()
        if "norm" in low and not in_neginf:
            advice.append(
                f"{_name(ev.module)} looks like a normalisation: an all-zero row gives 0/0; pass `eps` "
                "(`F.normalize(x, eps=1e-6)`, `x * torch.rsqrt(var + eps)`)."
            )
        if not advice:
            advice.append(
                f"Find the invalid op in {_name(ev.module)}'s forward (0/0, 0·inf, inf−inf, sqrt/log of a "
                "negative): add eps to denominators and clamp arguments of sqrt/log."
            )
        summary = (
            f"{_name(ev.module)} made NaN from values holding no NaN at step {ev.step}: an invalid operation."
        )
        return Diagnosis("invalid_op", ev, evidence, advice, summary)
    gout = run.rows_of(ev.step, ("backward", "loss"), module=ev.module, prefix="grad_output")
    scale = run.scale.get(ev.step, math.nan)
    evidence = [
        f"the backward of {_name(ev.module)} ({ev.module_type}) at step {ev.step} turned finite incoming "
        f"gradients (grad_output absmax {_g(_finite_max(gout))}) into NaN in `{ev.tensor}` ({dtype})",
    ]
    if not math.isnan(scale):
        evidence.append(f"loss scale {_g(scale)}")
    fwd = run.rows_of(ev.step, "forward", module=ev.module, prefix="output")
    if len(fwd) and not bool(fwd[["n_nan", "n_posinf", "n_neginf"]].to_numpy().sum()):
        evidence.append(f"its forward at that step was finite (output absmax {_g(_finite_max(fwd))})")
    skips = _skips_text(run)
    if skips:
        evidence.append(skips)
    advice = [
        f"0·inf in the backward of {_name(ev.module)}: an op whose derivative is infinite at the values it saw "
        "(log/log1p at 0, sqrt at 0, x/0) sits under a `torch.where`/mask that discards its result; the "
        "discarded entries still send 0·inf = NaN back. Make the input safe *before* the op "
        "(`safe = torch.where(keep, p, 0.0)`; then `torch.where(keep, f(safe), 0.0)`), or clamp it away from the "
        "singular point.",
        "`torch.autograd.detect_anomaly()` on one step names the exact backward function.",
    ]
    summary = f"The backward of {_name(ev.module)} made NaN from finite gradients at step {ev.step}: an invalid operation."
    return Diagnosis("invalid_op", ev, evidence, advice, summary)


def _loss(run: _Run, ev: Overflow) -> Diagnosis:
    outs = run.rows_of(ev.step, "forward", module="", prefix="output")
    loss_rows = run.rows_of(ev.step, "loss", prefix="loss")
    loss_dtype = str(loss_rows["dtype"].iloc[0]) if len(loss_rows) else str(ev.dtype)
    which = "the loss" if ev.tensor.startswith("loss") else "the gradient arriving at the model's outputs"
    lv = run.loss.get(ev.step, math.nan)
    seen = (
        f"were finite (absmax {_g(_finite_max(outs))})"
        if len(outs)
        else "were not recorded (no traced forward in this step)"
    )
    evidence = [f"the model's outputs at step {ev.step} {seen} but {which} was {ev.kind} ({ev.dtype})"]
    if not math.isnan(lv) and not ev.tensor.startswith("loss"):
        evidence.append(f"loss value at step {ev.step}: {_g(lv)} ({loss_dtype})")
    bad = [e.step for e in run.events if e.phase == "loss"]
    if len(bad) > 1:
        evidence.append(f"the loss was non-finite at steps {_steps_text(bad)}")
    skips = _skips_text(run)
    if skips:
        evidence.append(
            skips + " — a symptom: the scale falls because the loss itself is non-finite, not the gradients"
        )
    advice = [
        "Compute the loss in float32 from the model's outputs: `F.cross_entropy(logits.float(), target)`, or "
        "`-F.log_softmax(logits.float(), -1).gather(-1, target[:, None])` instead of `-log(softmax(...))`, whose "
        f"probability underflows to 0 in {loss_dtype} (log(0) = -inf).",
    ]
    if ev.tensor.startswith("loss"):
        advice.append("Check the targets and any log/division in the loss for zeros (clamp with an eps).")
    else:
        advice.append(
            "The loss was finite but its gradient was not: a reduction such as `sum()` times the loss scale can "
            "exceed 65504 in float16; use `mean()` or cast the outputs to float32 before the loss."
        )
    summary = (
        f"The model's outputs were {'finite' if len(outs) else 'not recorded'} but {which} was non-finite at "
        f"step {ev.step}."
    )
    return Diagnosis("loss", ev, evidence, advice, summary)


def _backward_overflow(run: _Run, ev: Overflow) -> Diagnosis:
    gout = run.rows_of(ev.step, ("backward", "loss"), module=ev.module, prefix="grad_output")
    scale = run.scale.get(ev.step, math.nan)
    dtype = _compute_dtype(run, ev)
    evidence = [
        f"the backward of {_name(ev.module)} ({ev.module_type}) at step {ev.step} turned finite incoming "
        f"gradients (grad_output absmax {_g(_finite_max(gout))}) into inf in `{ev.tensor}` (computed in {dtype}, "
        f"max {_g(_dtype_max(dtype))})",
        "loss scale: " + ("none (no GradScaler)" if math.isnan(scale) else _g(scale)),
    ]
    w = run.rows_of(ev.step - 1, "optimizer", module=ev.module) if ev.step > 0 else run.records.iloc[0:0]
    if len(w):
        evidence.append(f"its parameters' absmax after step {ev.step - 1}: {_g(_finite_max(w))}")
    fwd_in = run.rows_of(ev.step, "forward", module=ev.module, prefix="input")
    if len(fwd_in):
        evidence.append(f"its forward input absmax was {_g(_finite_max(fwd_in))}")
    advice = [
        _keep_fp32_advice(run, ev.module, dtype),
        _bf16_advice(),
    ]
    if math.isnan(scale):
        advice.insert(
            0,
            f"With no GradScaler (scale 1) the gradient of {_name(ev.module)} itself exceeds "
            f"{_g(_dtype_max(dtype))}: check its weights (large weights multiply the incoming gradient), keep it "
            "in float32, or scale the loss down (`(loss / 1024).backward()`, then multiply the float32 gradients "
            "back before the optimizer step).",
        )
    else:
        advice.insert(
            0,
            f"Clip gradients after `scaler.unscale_(optimizer)` (`torch.nn.utils.clip_grad_norm_(params, 1.0)`) "
            f"and check the weights of {_name(ev.module)}: its gradient overflows at loss scale {_g(scale)}.",
        )
    summary = (
        f"The backward of {_name(ev.module)} ({ev.module_type}) overflowed {dtype} at step {ev.step}; "
        "a GradScaler did not absorb it."
    )
    return Diagnosis("backward_overflow", ev, evidence, advice, summary)


def _optimizer(run: _Run, ev: Overflow) -> Diagnosis:
    dtype = str(ev.dtype)
    pname = ev.tensor
    grads = run.rows_of(ev.step, "backward", module=ev.module, prefix=pname + ".grad")
    scale = run.scale.get(ev.step, math.nan)
    gmax = _finite_max(grads)
    if not math.isnan(scale) and scale > 0:
        gmax /= scale
    before = run.rows_of(ev.step - 1, "optimizer", module=ev.module) if ev.step > 0 else run.records.iloc[0:0]
    opt_name = str(run.options.get("optimizer") or "the optimizer")
    evidence = [
        f"gradients of {_name(ev.module)} ({ev.module_type}) at step {ev.step} were finite (`{pname}.grad` "
        f"absmax {_g(gmax)}, unscaled) but `{pname}` became {ev.kind} ({dtype}) in {opt_name}.step()",
    ]
    if len(before):
        evidence.append(f"its parameters' absmax after step {ev.step - 1}: {_g(_finite_max(before))}")
    if not math.isnan(gmax) and gmax > 0 and dtype == "float16":
        evidence.append(
            f"in float16, grad² = {_g(gmax * gmax)} (below {_g(FP16_SMALLEST_SUBNORMAL)} rounds to 0) and "
            "eps=1e-8 rounds to 0: Adam's step m / (sqrt(v) + eps) is 0/0 or x/0"
        )
    lr = run.lr.get(ev.step, math.nan)
    if not math.isnan(lr):
        evidence.append(f"learning rate {_g(lr)}")
    advice = [
        f"Keep float32 master weights: leave the model in float32 and use `torch.autocast(device_type=..., "
        f"dtype=torch.{dtype})` for the compute instead of `model.half()`.",
    ]
    if "adam" in opt_name.lower() or opt_name == "the optimizer":
        advice.insert(
            0,
            f"Raise Adam's eps to ≥1e-4 ({dtype}'s smallest normal is {_g(FP16_SMALLEST_NORMAL)}; 1e-8 rounds "
            "to 0), e.g. `torch.optim.Adam(params, eps=1e-4)`.",
        )
    summary = f"Gradients were finite but {opt_name}.step() made `{pname}` of {_name(ev.module)} non-finite in {dtype}."
    return Diagnosis("optimizer", ev, evidence, advice, summary)


def _divergence_diagnosis(run: _Run, ev: Overflow | None, div: _Divergence) -> Diagnosis:
    evidence = list(div.evidence)
    if ev is not None:
        evidence.insert(
            0,
            f"first non-finite value at step {ev.step}: {ev.phase} of {_name(ev.module)} ({ev.module_type}), "
            f"{ev.kind} in `{ev.tensor}` ({ev.dtype})",
        )
    skips = _skips_text(run)
    if skips:
        evidence.append(skips)
    advice = []
    if not math.isnan(div.lr):
        target = (
            div.lr * HEALTHY_UPDATE_RATIO / div.ratio
            if not math.isnan(div.ratio) and div.ratio > 0
            else math.nan
        )
        ratio = f" (the update ratio was {_g(div.ratio)}; healthy is about {HEALTHY_UPDATE_RATIO:g})"
        if math.isnan(div.ratio):
            ratio = ""
        advice.append(
            f"Lower the learning rate from {_g(div.lr)}{ratio}"
            + (f"; about {_g(target)} would give a healthy ratio" if not math.isnan(target) else "")
            + ", and add a warmup."
        )
    else:
        advice.append(
            f"Lower the learning rate (healthy update-to-weight ratio is about {HEALTHY_UPDATE_RATIO:g}) and add "
            "a warmup."
        )
    advice.append(
        "Clip gradients: `scaler.unscale_(optimizer)` then `torch.nn.utils.clip_grad_norm_(model.parameters(), "
        "1.0)` before `scaler.step(optimizer)` (without a scaler, just before `optimizer.step()`)."
    )
    advice.append(
        "Keeping a layer in float32 only postpones the overflow: the weights themselves are growing every step."
    )
    if ev is None:
        summary = "Activations, loss and weights grow step over step: the run is diverging (no overflow yet)."
    else:
        where = {"forward": "the forward of", "backward": "the backward of", "optimizer": "the update of"}
        what = "the loss" if ev.phase == "loss" else f"{where.get(ev.phase, '')} {_name(ev.module)}".strip()
        summary = (
            f"The run diverged: activations and weights grew step over step until {what} overflowed at step "
            f"{ev.step}; the learning rate is too high."
        )
    return Diagnosis("divergence", ev, evidence, advice, summary)


def _compute_dtype(run: _Run, ev: Overflow) -> str:
    """The dtype the overflow happened in: the event's dtype, or, for a float32 parameter gradient of a module
    run under autocast, the half dtype of that module's forward outputs (its gradient was computed in it)."""
    dtype = str(ev.dtype)
    if dtype not in ("float32", "float64"):
        return dtype
    outs = run.rows_of(ev.step, "forward", module=ev.module, prefix="output")
    half = [d for d in outs["dtype"].astype(str).unique().tolist() if d in ("float16", "bfloat16")]
    return half[0] if half else dtype


def _producer_text(e: Overflow) -> str:
    if e.phase == "loss":
        return "the loss gradient arriving at the model's outputs"
    return f"the backward of {_name(e.module)} ({e.module_type}) `{e.tensor}`"


def _collapse(run: _Run, ev: Overflow | None, skip_run: list[int]) -> Diagnosis:
    """``ev``: the run's last scale-dependent event, the one that still overflowed at the lowest scale."""
    first, last = run.scale_range(skip_run)
    below = not math.isnan(last) and last < 1
    evidence = [
        f"{len(skip_run)} consecutive steps skipped by the GradScaler (steps {_steps_text(skip_run)}); loss scale "
        f"{_g(first)} → {_g(last)}" + (" (below 1: the gradients overflow even unscaled)" if below else "")
    ]
    if len(run.skipped_steps()) != len(skip_run):
        evidence.append(str(_skips_text(run)))
    advice: list[str] = []
    if ev is not None:
        in_run = [e for e in run.events if skip_run[0] <= e.step <= skip_run[-1] and run.scale_dependent(e)]
        groups: dict[str, list[int]] = {}
        for e in in_run:
            groups.setdefault(_producer_text(e), []).append(e.step)
        evidence.append(
            "overflowing at each skipped step: "
            + "; ".join(
                f"{k} (step{'s' if len(set(v)) > 1 else ''} {_steps_text(v)})" for k, v in groups.items()
            )
        )
        at = run.scale.get(ev.step, math.nan)
        gout = run.rows_of(ev.step, ("backward", "loss"), module=ev.module, prefix="grad_output")
        evidence.append(
            f"at the lowest scale tried ({_g(at)}, step {ev.step}) {_producer_text(ev)} still overflowed "
            f"({ev.kind}, computed in {_compute_dtype(run, ev)})"
            + (
                f"; its incoming gradient absmax was {_g(_finite_max(gout))}"
                if ev.phase == "backward"
                else ""
            )
        )
        limit = _g(_dtype_max(_compute_dtype(run, ev)))
        if ev.phase == "loss":
            advice.append(
                f"The gradient of the loss w.r.t. the outputs exceeds {limit} even at a small scale: the loss is "
                "too large (e.g. a sum over many elements); use a mean, divide it, or compute it in float32."
            )
        else:
            w = (
                run.rows_of(ev.step - 1, "optimizer", module=ev.module)
                if ev.step > 0
                else run.records.iloc[0:0]
            )
            wtext = f" (absmax {_g(_finite_max(w))})" if len(w) else ""
            advice.append(
                f"The gradient of {_name(ev.module)} exceeds {limit} even at loss scale {_g(at)}: keep "
                f"{_name(ev.module)} in float32 (autocast disabled around it), and check its weights{wtext} and "
                "the loss magnitude."
            )
    advice.append(_bf16_advice())
    advice.append(
        "Clip gradients after `scaler.unscale_(optimizer)`; if the scale falls below 1, the gradients are too "
        "large for float16 even unscaled: divide the loss (e.g. use a mean) or compute it in float32."
    )
    summary = (
        f"The loss scale kept falling ({_g(first)} → {_g(last)}) over {len(skip_run)} skipped steps: the "
        "gradients overflow at every scale tried."
    )
    return Diagnosis("loss_scale_collapse", ev, evidence, advice, summary)


def _backoff(run: _Run, benign: list[Overflow]) -> Diagnosis:
    sk = run.skipped_steps()
    ev = benign[0] if benign else None
    evidence = []
    if ev is not None:
        evidence.append(
            f"step {ev.step}: the backward of {_name(ev.module)} ({ev.module_type}) overflowed ({ev.kind} in "
            f"`{ev.tensor}`) at loss scale {_g(run.scale.get(ev.step, math.nan))}"
        )
    skips = _skips_text(run)
    if skips:
        evidence.append(skips)
    last = sk[-1] if sk else -1
    n_after = sum(1 for s in run.step_ids if s > last and run.skipped.get(s) is False)
    if n_after:
        evidence.append(f"then {n_after} steps trained without a skip")
    else:
        evidence.append(
            "the trace ended while the scaler was still backing off; trace more steps to confirm it settles"
        )
    settled = [run.scale[s] for s in run.step_ids if s > last and not math.isnan(run.scale.get(s, math.nan))]
    advice = [
        "Nothing to fix: GradScaler skips a step and halves the scale when the scaled gradients overflow."
    ]
    if settled:
        advice.append(
            f"To avoid the skipped steps, start at the scale it settled on: "
            f"`torch.amp.GradScaler(init_scale={settled[0]:g})`."
        )
    summary = f"Benign loss-scale backoff: the GradScaler skipped {len(sk)} step(s)" + (
        ", then training proceeded." if n_after else "; the trace ends there."
    )
    return Diagnosis("scaler_backoff", ev, evidence, advice, summary)


def _underflow(run: _Run) -> Diagnosis | None:
    r = run.records
    if len(r) == 0:
        return None
    dt = r["dtype"].astype(str).to_numpy()
    if not bool(((dt == "float16") & np.isin(run.phase, ["forward", "backward", "loss"])).any()):
        return None
    mtype = r["module_type"].astype(str).to_numpy()
    grads = (run.phase == "backward") & np.char.endswith(run.tensor, ".grad")
    grads &= np.char.find(np.char.lower(mtype.astype(str)), "embedding") < 0
    grads &= ~run.nonfinite
    if not grads.any():
        return None
    g = r[grads]
    numel = g["numel"].to_numpy(dtype=np.float64)
    zeros = g["n_zero"].to_numpy(dtype=np.float64)
    absmax = g["absmax"].to_numpy(dtype=np.float64)
    zero_frac = zeros / np.maximum(numel, 1)
    amax = np.nan_to_num(absmax, nan=0.0)
    # Zeros alone prove nothing (a ReLU's dead units give exact zeros at any scale); zeros are flushed values
    # only when the tensor's largest value is itself close to float16's subnormal range.
    flushed = (amax < FP16_SMALLEST_NORMAL) | (
        (zero_frac >= UNDERFLOW_ZERO_FRACTION) & (amax < UNDERFLOW_SMALL_ABSMAX)
    )
    frac = float(flushed.mean())
    if frac < UNDERFLOW_FRACTION:
        return None
    names = (g["module"].astype(str) + "." + g["tensor"].astype(str).str.removesuffix(".grad")).to_numpy()
    worst = (
        pd.DataFrame({"name": names, "zero": zero_frac, "absmax": absmax})
        .groupby("name")
        .agg({"zero": "mean", "absmax": "max"})
    )
    worst = worst.sort_values(["zero", "absmax"], ascending=[False, True])
    scales = [v for v in run.scale.values() if not math.isnan(v)]
    scale_text = (
        "no GradScaler (loss scale 1)" if not scales else f"loss scale {_g(min(scales))}–{_g(max(scales))}"
    )
    evidence = [
        f"{frac:.0%} of the parameter-gradient tensors ({int(flushed.sum())} of {len(flushed)} over "
        f"{len(set(g['step'].tolist()))} steps) were flushed: largest |g| below float16's smallest normal "
        f"{_g(FP16_SMALLEST_NORMAL)} (every value subnormal or 0), or below {_g(UNDERFLOW_SMALL_ABSMAX)} with "
        f"≥{UNDERFLOW_ZERO_FRACTION:.0%} zeros",
        f"overall {zeros.sum() / max(numel.sum(), 1):.0%} of parameter-gradient elements were exactly 0",
        scale_text,
    ]
    for name, row in list(worst.iterrows())[:3]:
        evidence.append(f"`{name}.grad`: {row['zero']:.0%} zeros, absmax {_g(float(row['absmax']))}")
    fp16_grads = r[(run.phase == "backward") & (dt == "float16")]
    if len(fp16_grads):
        evidence.append(f"largest float16 gradient anywhere: {_g(_finite_max(fp16_grads))}")
    advice = []
    if not scales:
        advice.append(
            "Use a GradScaler: `scaler = torch.amp.GradScaler()`, `scaler.scale(loss).backward()`, "
            "`scaler.step(optimizer)`, `scaler.update()` — it multiplies the loss (default 65536) so small "
            "gradients stay above float16's subnormal limit 6e-08."
        )
    else:
        advice.append(
            f"The loss scale ({_g(min(scales))}) is too small for these gradients: raise `init_scale` and find why "
            "the scaler lowered it (an earlier overflow)."
        )
    advice.append(_bf16_advice())
    advice.append(
        "Or keep float32 gradients (autocast rather than `model.half()`), and check the loss is not tiny."
    )
    summary = (
        f"No inf/NaN, but float16 gradients flush to zero: {frac:.0%} of parameter-gradient tensors lost most "
        "of their values."
    )
    return Diagnosis("gradient_underflow", None, evidence, advice, summary)


def _outside(run: _Run) -> Diagnosis:
    """The GradScaler skipped steps but the whole model's backward, recorded, stayed finite: the overflow the
    scaler found was in gradients this trace does not hold."""
    sk = run.skipped_steps()
    evidence = [
        f"no value recorded in this model's forward, loss or backward held inf/NaN, at the skipped steps "
        f"{_steps_text(sk)} or any other (the backward of every module and parameter was traced)",
        "so the non-finite gradients the scaler found were outside the traced model: another model sharing "
        "the GradScaler (e.g. a GAN's discriminator), or parameters the optimizer steps that are not in it",
    ]
    skips = _skips_text(run)
    if skips:
        evidence.append(skips)
    advice = [
        "Nothing to fix in this model. Trace the other model stepped with the same GradScaler (`nantrace run` "
        "traces each model a script calls), or give each model its own GradScaler, and diagnose that trace.",
    ]
    summary = (
        f"The GradScaler skipped {len(sk)} step(s), but this model's gradients stayed finite: the overflow came "
        "from outside the traced model (e.g. another model sharing the GradScaler)."
    )
    return Diagnosis("scaler_backoff", None, evidence, advice, summary)


def _healthy(run: _Run) -> Diagnosis:
    from ._report import headroom_table

    evidence = [f"{len(run.step_ids)} steps, {len(run.records)} records, no inf/NaN produced"]
    skips = _skips_text(run)
    if skips:
        evidence.append(skips)
    hr = headroom_table(run.records, top=1)
    if len(hr):
        r = hr.iloc[0]
        evidence.append(
            f"least float16 headroom: {_name(str(r['module']))} ({r['module_type']}), absmax {_g(float(r['absmax']))}, "
            f"{float(r['headroom_bits']):+.1f} bits below 65504"
        )
    ur = update_ratios(run.records)["ratio"].to_numpy(dtype=np.float64)
    ur = ur[np.isfinite(ur)]
    if ur.size:
        evidence.append(
            f"update-to-weight ratio (change of a parameter's absmax per step): median {_g(float(np.median(ur)))}, "
            f"max {_g(float(ur.max()))}"
        )
    return Diagnosis(
        "healthy",
        None,
        evidence,
        [],
        "Healthy: every recorded value was finite and nothing points to a fault.",
    )


# ---------------------------------------------------------------------------------------------- entry point
def _fault(run: _Run, ev: Overflow) -> Diagnosis:
    if ev.phase == "data":
        return _data(run, ev)
    div = _divergence(run, ev.step, ev.module if ev.phase == "forward" else None)
    if div.found:
        return _divergence_diagnosis(run, ev, div)
    if ev.phase == "loss":
        return _loss(run, ev)
    if ev.phase == "forward":
        masks = _leaked_masks(run, ev)
        if masks is not None:
            return _mask_leak(run, ev, masks)
        if ev.kind == "inf" or _input_beyond_range(run, ev) or _weights_beyond(run, ev)[0]:
            return _forward_overflow(run, ev)
        return _invalid_op(run, ev)
    if ev.phase == "backward":
        return _backward_overflow(run, ev) if ev.kind == "inf" else _invalid_op(run, ev)
    return _optimizer(run, ev)


def _judge_skip_run(run: _Run, skip_run: list[int], in_run: list[Overflow]) -> Diagnosis | None:
    """A run of skipped steps whose events a lower scale could remove: ``None`` when it is a benign backoff,
    else the diagnosis (collapse, divergence, or invalid_op for NaN that persists)."""
    collapse = run.is_collapse(skip_run)
    resumed = run.resumed_after(skip_run[-1])
    if not (collapse or not resumed) or not in_run:
        return None
    nans = [e for e in in_run if e.kind == "nan"]
    if 2 * len(nans) > len(in_run):
        return _invalid_op(run, nans[0])
    if not collapse:
        return None  # short and at the end of the trace: a backoff still in progress
    last = max(e.step for e in run.events if run.scale_dependent(e))
    div = _divergence(run, last + 1, None)
    if div.found:
        return _divergence_diagnosis(run, in_run[0], div)
    return _collapse(run, in_run[-1], skip_run)


def _received(run: _Run, ev: Overflow, producer: Overflow | None, world_size: int | None) -> Diagnosis:
    """``ev`` is only in this rank's reduced gradients: another rank (``producer`` when known) produced it."""
    of = f" of {world_size}" if world_size else ""
    local = run.records
    if "reduced" in local.columns:
        local = local[~local["reduced"].to_numpy(dtype=bool)]
    lrows = local[(local["step"].to_numpy() == ev.step)]
    evidence = [
        f"rank {ev.rank}{of}: every local value at step {ev.step} was finite (largest local absmax "
        f"{_g(_finite_max(lrows))}), but `{ev.tensor}` of {_name(ev.module)} held {ev.kind} after the gradient "
        "reduction (DDP all-reduce / FSDP reduce-scatter): received from another rank, not produced here"
    ]
    if run.skipped.get(ev.step) is True:
        evidence.append(
            f"the GradScaler skipped step {ev.step} (loss scale {_g(run.scale.get(ev.step, math.nan))}) on the "
            "reduced gradients; whether that was a benign backoff depends on what the producing rank did"
        )
    if producer is not None:
        where = "the model inputs" if producer.phase == "data" else _name(producer.module)
        evidence.append(
            f"the merged trace names rank {producer.rank} as the producer: {producer.phase}, {where}, "
            f"{producer.kind} in `{producer.tensor}`"
        )
        advice = [f"Diagnose the producing rank: `tr.rank_view({producer.rank}).diagnose()`."]
        summary = (
            f"Rank {ev.rank} received {ev.kind} at step {ev.step} through the gradient reduction; rank "
            f"{producer.rank} produced it."
        )
    else:
        advice = [
            "Load the folder all ranks saved to (`nantrace.load(folder)`, or `nantrace report FOLDER`; for a "
            "`rank_view`, the merged trace itself): the merged trace names the rank that produced it and "
            "diagnoses that rank."
        ]
        summary = (
            f"Rank {ev.rank} received {ev.kind} at step {ev.step} through the gradient reduction from another "
            "rank; this rank's trace alone cannot say what produced it."
        )
    return Diagnosis("received", ev, evidence, advice, summary)


def _reduction_made(run: _Run, ev: Overflow, world_size: int | None) -> Diagnosis:
    """Every rank's local gradients were finite; the reduced ``ev.tensor`` was not: the reduction made it."""
    ev = replace(ev, propagated=False)
    r = run.records
    local = r[
        (r["step"].to_numpy() == ev.step) & (run.phase == "backward") & np.char.endswith(run.tensor, ".grad")
    ]
    if "reduced" in local.columns:
        local = local[~local["reduced"].to_numpy(dtype=bool)]
    same = local[(local["module"].astype(str) == ev.module) & (local["tensor"].astype(str) == ev.tensor)]
    scale = run.scale.get(ev.step, math.nan)
    scaled = f", still multiplied by the loss scale {_g(scale)}" if scale > 1 else ""  # NaN: no GradScaler
    evidence = [
        f"at step {ev.step} every rank's local gradients were finite; on rank {ev.rank} the local `{ev.tensor}` of "
        f"{_name(ev.module)} had absmax {_g(_finite_max(same))} (largest local parameter gradient "
        f"{_g(_finite_max(local))}{scaled})",
        f"after the gradient reduction `{ev.tensor}` held {ev.kind} ({ev.dtype}): the reduction itself produced "
        "it, not a rank's forward or backward",
        f"float16 overflows above {_g(FP16_MAX)}: a communication hook that casts gradients to float16 before the "
        "all-reduce (DDP's `fp16_compress_hook`) turns a larger gradient into inf",
    ]
    if world_size:
        evidence.append(f"world size {world_size}")
    advice = [
        "Use bfloat16 compression (`bf16_compress_hook`: float32's range, max 3.4e38) or no compression hook, "
        "so the reduction keeps the gradients' range.",
        f"Or keep float16 compression but scale the gradients down before the cast (divide by the world size "
        f"before casting, not after), so that no gradient exceeds {_g(FP16_MAX)}"
        + (
            f"; with a GradScaler they are reduced still scaled ({_g(scale)}): a lower `init_scale` also helps."
            if scale > 1
            else "."
        ),
    ]
    summary = (
        f"The gradient reduction overflowed at step {ev.step}: every rank's local gradients were finite, the "
        f"reduced `{ev.tensor}` of {_name(ev.module)} was {ev.kind} (e.g. float16 gradient compression)."
    )
    cause = "backward_overflow" if ev.kind == "inf" else "invalid_op"
    return Diagnosis(cause, ev, evidence, advice, summary)


def diagnose(trace: Trace) -> Diagnosis:
    """Why the traced run went non-finite, or that it did not: a :class:`Diagnosis`.

    Works on a live or a loaded trace (it reads ``records``, ``steps``, ``ops`` and ``overflows()``). The rule
    for each cause is in this module's docstring; the thresholds are module constants.

    Args:
        trace: a :class:`~nantrace.Trace` (any object with ``records``, ``steps`` and ``overflows()``).

    Returns:
        a :class:`Diagnosis` whose ``cause`` is one of :data:`CAUSES`.

    Raises:
        TypeError: ``trace`` has no ``records``/``steps``/``overflows()``.
    """
    for attr in ("records", "steps", "overflows"):
        if not hasattr(trace, attr):
            raise TypeError(
                f"diagnose() needs a nantrace.Trace (records, steps, overflows()); got {type(trace).__name__}"
            )
    return _diagnose(trace)


def _diagnose(trace: Trace, merged: list[Overflow] | None = None) -> Diagnosis:
    """:func:`diagnose`; ``merged``: the merged trace's events (one per step, the cross-rank producer) when
    ``trace`` is the rank view of the rank a merged diagnosis reads."""
    run = _Run(trace)
    world_size = getattr(trace, "world_size", None)
    producers = {ev.step: ev for ev in merged} if merged is not None else {}
    benign: list[Overflow] = []
    dependent = [run.scale_dependent(ev) for ev in run.events]
    judged: dict[int, Diagnosis | None] = {}  # first step of a skip run -> its verdict (None: benign)
    for i, ev in enumerate(run.events):
        if ev.propagated:
            prod = producers.get(ev.step)
            if prod is None or prod.propagated:  # one rank's trace, or a merged one that lacks the producer
                return _received(run, ev, None, world_size)
            if prod.rank == ev.rank and not prod.propagated:
                return _reduction_made(run, prod, world_size)
            if not run.scale_dependent(prod):
                return _received(run, ev, prod, world_size)
        if not dependent[i]:
            return _fault(run, ev)
        skip_run = run.skip_run(ev.step)
        if skip_run[0] not in judged:
            lo, hi = skip_run[0], skip_run[-1]
            in_run = [e for e, d in zip(run.events, dependent, strict=True) if d and lo <= e.step <= hi]
            judged[lo] = _judge_skip_run(run, skip_run, in_run)
        verdict = judged[skip_run[0]]
        if verdict is not None:
            return verdict
        benign.append(ev)
    if not run.events and run.skipped_steps() and (world_size or 1) == 1 and run.whole_backward():
        return _outside(run)
    # no fault among the events: runs of skips that left no record (backward not traced)
    seen: set[int] = set()
    for s in run.skipped_steps():
        if s in seen:
            continue
        skip_run = run.skip_run(s)
        seen.update(skip_run)
        if run.is_collapse(skip_run):
            return _collapse(run, None, skip_run)
    under = _underflow(run)
    if under is not None:
        return under
    if benign:
        div = _divergence(run, benign[-1].step + 1, None)
        if div.found:  # backoffs that keep coming back while everything grows
            return _divergence_diagnosis(run, benign[0], div)
    last = run.step_ids[-1] + 1 if run.step_ids else 0
    quiet = _divergence(
        run,
        last,
        None,
        growth_needed=QUIET_DIVERGENCE_GROWTH,
        loss_growth_needed=QUIET_DIVERGENCE_LOSS_GROWTH,
        quiet=True,
    )
    if quiet.found:
        return _divergence_diagnosis(run, None, quiet)
    if benign or run.skipped_steps():
        return _backoff(run, benign)
    return _healthy(run)


# ---------------------------------------------------------------------------------------------- fp16 readiness
_KIND_RE = re.compile(r"^(grad_input|grad_output|input|output|loss)")


def _tensor_kind(phase: str, tensor: str) -> str:
    if phase == "optimizer":
        return "param"
    if tensor.endswith(".grad"):
        return "param_grad"
    m = _KIND_RE.match(tensor)
    if m:
        return m.group(1)
    return re.split(r"[\[.]", tensor, maxsplit=1)[0] or tensor


_VERDICT_RANK = {"nonfinite": 0, "overflow": 1, "underflow": 2, "subnormal": 3, "ok": 4}


def fp16_readiness(trace: Trace | pd.DataFrame, *, loss_scale: float | None = None) -> pd.DataFrame:
    """Which modules would overflow or lose values in float16, from an fp32 or bf16 run, worst first.

    Rows are grouped by ``module, module_type, phase, tensor_kind`` over all steps and calls. ``tensor_kind`` is
    ``input``, ``output``, ``grad_input``, ``grad_output``, ``param_grad`` (``weight.grad``), ``param``
    (parameters after ``optimizer.step()``) or ``loss``. Attention-mask -inf (see the locator) is ignored.

    Columns:
        ``absmax`` / ``absmin``: largest finite and smallest non-zero ``|x|`` (``inf`` absmax when the run itself
        held ±inf there); ``headroom_bits = log2(65504 / absmax)`` (negative: overflows float16);
        ``footroom_bits = log2(absmax / 2**-14)`` (negative: even the largest value is a float16 subnormal);
        ``verdict``: ``"nonfinite"`` (already NaN in this run), ``"overflow"`` (absmax > 65504),
        ``"underflow"`` (some non-zero ``|x|`` < 2⁻²⁴ ≈ 5.96e-8 would round to 0; every value does when
        ``footroom_bits < -10``), ``"subnormal"`` (some ``|x|`` < 2⁻¹⁴ ≈ 6.1e-5 would lose precision) or ``"ok"``;
        ``step``: the step where ``absmax`` was reached; ``n_records``; ``dtype``: the recorded dtype(s).

    Sorted by verdict (in the order above), then overflow rows by ``headroom_bits``, underflow/subnormal rows by
    ``footroom_bits`` and ok rows by ``headroom_bits``, smallest first.

    Args:
        trace: a :class:`~nantrace.Trace`, or its ``records`` DataFrame.
        loss_scale: judge gradients as they would be under this loss scale (e.g. 65536, a default GradScaler):
            each gradient is divided by the scale it was recorded with and multiplied by this. ``None`` (default):
            gradients as recorded.

    Returns:
        DataFrame with columns :data:`READINESS_COLUMNS` (empty when nothing was recorded).

    Raises:
        TypeError: ``trace`` is neither a Trace nor a DataFrame.
        ValueError: ``loss_scale`` is not a positive finite number.
    """
    if isinstance(trace, pd.DataFrame):
        records = trace
    elif hasattr(trace, "records"):
        records = trace.records
    else:
        raise TypeError(f"fp16_readiness() needs a nantrace.Trace or its records; got {type(trace).__name__}")
    if loss_scale is not None and (
        isinstance(loss_scale, bool)
        or not isinstance(loss_scale, (int, float))
        or not math.isfinite(loss_scale)
        or loss_scale <= 0
    ):
        raise ValueError(f"loss_scale must be a positive finite number or None; got {loss_scale!r}")
    if len(records) == 0:
        return pd.DataFrame(columns=list(READINESS_COLUMNS))
    phase = records["phase"].astype(str).to_numpy()
    tensor = records["tensor"].astype(str).to_numpy()
    kind_of = {(p, t): _tensor_kind(p, t) for p, t in set(zip(phase.tolist(), tensor.tolist(), strict=True))}
    kinds = np.array(
        [kind_of[(p, t)] for p, t in zip(phase.tolist(), tensor.tolist(), strict=True)], dtype=object
    )
    absmax = records["absmax"].to_numpy(dtype=np.float64).copy()
    absmin = records["absmin"].to_numpy(dtype=np.float64).copy()
    if loss_scale is not None:
        is_grad = np.isin(kinds, ["grad_input", "grad_output", "param_grad"]) | (
            (phase == "loss") & (kinds != "loss")
        )
        rec_scale = records["scale"].to_numpy(dtype=np.float64)
        factor = np.where(
            is_grad & (rec_scale > 0), loss_scale / np.where(rec_scale > 0, rec_scale, 1.0), 1.0
        )
        absmax *= factor
        absmin *= factor
    mask = is_mask(records)
    infs = ((records["n_posinf"].to_numpy() + records["n_neginf"].to_numpy()) > 0) & ~mask
    nans = records["n_nan"].to_numpy() > 0
    absmax_eff = np.where(infs, np.inf, absmax)
    df = pd.DataFrame(
        {
            "module": records["module"].astype(str).to_numpy(),
            "module_type": records["module_type"].astype(str).to_numpy(),
            "phase": phase,
            "tensor_kind": kinds.astype(str),
            "dtype": records["dtype"].astype(str).to_numpy(),
            "absmax": absmax_eff,
            "absmin": absmin,
            "nan": nans,
            "step": records["step"].to_numpy().astype(np.int64),
        }
    )
    keys = ["module", "module_type", "phase", "tensor_kind"]
    grouped = df.groupby(keys, sort=False)
    am = df["absmax"].fillna(-1.0)
    idx = am.groupby([df[k] for k in keys], sort=False).idxmax()
    out = grouped.agg(
        dtype=("dtype", lambda s: ",".join(sorted(set(s)))),
        absmax=("absmax", "max"),
        absmin=("absmin", "min"),
        nan=("nan", "any"),
        n_records=("step", "size"),
    ).reset_index()
    out["step"] = df.loc[idx.to_numpy(), "step"].to_numpy()
    a = out["absmax"].to_numpy(dtype=np.float64)
    lo = out["absmin"].to_numpy(dtype=np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        out["headroom_bits"] = np.where(a > 0, np.log2(FP16_MAX / a), np.inf)
        out["footroom_bits"] = np.where(a > 0, np.log2(a / FP16_SMALLEST_NORMAL), -np.inf)
    verdict = np.full(len(out), "ok", dtype=object)
    verdict[np.nan_to_num(lo, nan=np.inf) < FP16_SMALLEST_NORMAL] = "subnormal"
    verdict[np.nan_to_num(lo, nan=np.inf) < FP16_SMALLEST_SUBNORMAL] = "underflow"
    verdict[a > FP16_MAX] = "overflow"
    verdict[out["nan"].to_numpy(dtype=bool)] = "nonfinite"
    out["verdict"] = verdict.astype(str)
    rank = out["verdict"].map(_VERDICT_RANK).to_numpy()
    key = np.where(
        np.isin(out["verdict"].to_numpy(), ["underflow", "subnormal"]),
        out["footroom_bits"].to_numpy(dtype=np.float64),
        out["headroom_bits"].to_numpy(dtype=np.float64),
    )
    out = out.assign(_rank=rank, _key=key).sort_values(["_rank", "_key"], kind="stable")
    out["step"] = out["step"].astype(np.int64)
    out["n_records"] = out["n_records"].astype(np.int64)
    return out[list(READINESS_COLUMNS)].reset_index(drop=True)
