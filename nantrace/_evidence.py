"""The one evidence engine: the facts about the op that produced an event's non-finite value and its operands,
computed from what the trace holds, and the op's *class*. Both ``str(Overflow)`` (:mod:`nantrace._explain`) and
the :class:`~nantrace.Diagnosis` (:mod:`nantrace._causes`) are written from :func:`op_evidence`, so they never
disagree. The taxonomy and each rule, with the fact it reads, are in ``docs/causes.md``.

Facts read: the op the forward replay named (``ops``) and its operand facts (``ops.operands``, recorded by
:mod:`nantrace._opfacts`: dtype, absmax, smallest non-zero ``|x|``, zeros, negatives, inf/NaN counts, values at
the dtype's max, Python constants that round to 0 in the dtype); without them, the module call's recorded
inputs and outputs (``records``) and the parameters recorded after ``optimizer.step()``.

Classes (:data:`OP_CLASSES`), decided in this order on the producing op:

1. ``cast``: a dtype cast (autocast's ``aten._to_copy`` of a weight, ``.half()``, ``.to()``) of finite values
   beyond the target dtype's max; without op facts: the call's parameters or finite inputs exceed the output
   dtype's max while being of a wider dtype.
2. ``mask_arithmetic``: an operand held ``-inf`` (a mask: the replay only reaches an operand holding a kind the
   call's inputs or a scalar brought in) and the op made a new kind from it (a fully masked row's NaN, a negated
   mask's +inf); or an operand held a value at the dtype's max (``torch.finfo(dtype).min``, a mask constant)
   and an add/sub/mul made ±inf from it.
3. ``invalid``: NaN from operands holding +inf (inf − inf, 0·inf, inf/inf).
4. ``singular``: the op's operand sits where the op is infinite or undefined: a zero denominator of a division
   or ``reciprocal``; 0 or a negative value under ``rsqrt``/``log``; a negative value under ``sqrt``; a zero
   base with a negative exponent, or a negative base with a fractional one, in ``pow``; beyond ±1 under
   ``acos``/``asin``/``atanh``/``erfinv``, ±1 under ``atanh``/``erfinv``; a zero divisor of ``fmod``. An operand
   outside the op's domain (:attr:`OpEvidence.outside_domain`) is headlined so. Without operand facts
   only the ops whose finite inputs can give the kind at their singular point alone count (``rsqrt``, ``log``
   for ±inf; ``sqrt``, ``log`` for NaN).
5. ``reduction``: a reduction (``sum``, ``mean``, ``cumsum``, ``prod``, ``norm``, ``var``, ``std``,
   ``logsumexp``...) of finite values whose result is beyond the dtype's max.
6. ``overflow``: ±inf from finite operands (and every backward inf).
7. ``invalid``: any other NaN (every backward NaN: 0·inf, inf − inf, 0/0 in a derivative).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import pandas as pd
import torch

from ._fmt import module_label, num, steps_text
from ._hooks import CAST_OP
from ._masks import lowest_masks
from ._opfacts import TARGET_OPS
from ._overflow import Overflow
from ._ranges import finite_absmax, last_optimizer_row, own_parameters, weights_beyond
from ._schema import KIND_WORDS, MASK_KIND, dtype_max
from ._view import RunView

__all__ = [
    "KEPT_DERIVATIVE_FIX",
    "NORMALISED_STEP_BOUND",
    "OP_CLASSES",
    "WEIGHTS_HELD",
    "WEIGHT_DECAY_BOUND",
    "OpEvidence",
    "Operand",
    "applied_updates",
    "backward_dtype",
    "call_arity",
    "call_input_rows",
    "class_advice",
    "discarded_op",
    "headline",
    "kept_derivative",
    "loss_advice",
    "loss_bounds",
    "masked_outputs",
    "mean_over_nothing",
    "nonfinite_words",
    "normalised_optimizer",
    "op_base",
    "op_evidence",
    "outputs_words",
    "replay_off",
    "scaled_run",
    "unreachable_update",
    "unreplayed",
    "weights_beyond_event",
    "weights_nonfinite",
    "weights_written",
    "written_facts",
    "written_words",
]

OP_CLASSES: tuple[str, ...] = ("overflow", "singular", "invalid", "cast", "reduction", "mask_arithmetic")

#: the cause of the diagnosis each class leads to in forward (backward: overflow → backward_overflow)
CLASS_CAUSE: dict[str, str] = {
    "overflow": "forward_overflow",
    "cast": "forward_overflow",
    "reduction": "forward_overflow",
    "singular": "invalid_op",
    "invalid": "invalid_op",
    "mask_arithmetic": "invalid_op",
}

_CASTS = {"to", "half", "bfloat16", "type", "_to_copy", "float16", "type_as"}
_REDUCTIONS = {
    "sum",
    "mean",
    "cumsum",
    "cumprod",
    "prod",
    "norm",
    "vector_norm",
    "linalg_vector_norm",
    "matrix_norm",
    "var",
    "std",
    "var_mean",
    "std_mean",
    "logsumexp",
    "nansum",
    "nanmean",
    "trace",
}
_HELD_INF = "its inputs held +inf"
WEIGHTS_HELD = "its own non-finite weights"  # the ``what`` of a call that computed from them
_ARITH = {"add", "sub", "mul", "rsub", "addcmul", "masked_fill", "where", "fill", "matmul"}


@dataclass(frozen=True)
class Operand:
    """One operand of the producing op as recorded: a tensor's statistics, or a Python number's ``value``."""

    name: str
    dtype: str | None = None
    numel: int = 0
    absmax: float = math.nan
    absmin: float = math.nan
    n_zero: int = 0
    n_neg: int = 0
    n_posinf: int = 0
    n_neginf: int = 0
    n_nan: int = 0
    n_at_max: int = 0
    value: float | None = None
    shape: tuple[int, ...] = ()
    param: str | None = None  # the replayed module's parameter this operand is (``weight``, ``0.bias``)
    frozen: str | None = None  # the replayed module's parameter that requires no grad
    buffer: str | None = None  # the replayed module's buffer this operand is
    int_min: int | None = None  # an integer operand (a loss's targets): its smallest and largest value
    int_max: int | None = None

    @property
    def nonfinite(self) -> bool:
        return self.posinf or self.neginf or (not self.is_scalar and self.n_nan > 0)

    @property
    def held_weight(self) -> bool:
        """A parameter (trainable or frozen) already holding NaN or +inf; its -inf may be a mask kept as a
        parameter and does not count."""
        return bool(self.param or self.frozen) and bool(self.n_nan or self.n_posinf)

    @property
    def is_scalar(self) -> bool:
        return self.value is not None

    @property
    def zeros(self) -> bool:
        return self.value == 0 if self.is_scalar else self.n_zero > 0

    @property
    def negatives(self) -> bool:
        v = self.value
        return (v is not None and v < 0) if self.is_scalar else self.n_neg > 0 or self.n_neginf > 0

    @property
    def posinf(self) -> bool:
        return self.value == math.inf if self.is_scalar else self.n_posinf > 0

    @property
    def neginf(self) -> bool:
        return self.value == -math.inf if self.is_scalar else self.n_neginf > 0

    def at_max(self, dtype: str) -> bool:
        """Holds a finite value whose ``|x|`` is ``dtype``'s largest finite value (a finfo.min mask constant)."""
        if self.is_scalar:
            v = self.value
            return v is not None and math.isfinite(v) and abs(v) == dtype_max(dtype)
        return self.n_at_max > 0

    def words(self) -> str:
        """``"arg1 (float16, 4 values): absmax 8, smallest |x| 0.5, 2 zeros, 1 negative"``."""
        if self.is_scalar:
            return f"{self.name} = {num(self.value)} (a Python number)"
        values = f"{self.numel} value{'' if self.numel == 1 else 's'}"
        if self.int_min is not None and self.int_max is not None:
            span = (
                f"every value {self.int_min}"
                if self.int_min == self.int_max
                else (f"values {self.int_min} to {self.int_max}")
            )
            return f"{self.name} ({self.dtype}, {values}): {span}"
        parts = [f"absmax {num(self.absmax)}"]
        if not math.isnan(self.absmin):
            parts.append(f"smallest non-zero |x| {num(self.absmin)}")
        for n, w in (
            (self.n_zero, "zero"),
            (self.n_neg, "negative"),
            (self.n_at_max, "at ±max"),
            (self.n_posinf, "+inf"),
            (self.n_neginf, "-inf"),
            (self.n_nan, "NaN"),
        ):
            if n:
                parts.append(f"{n} {w}{'s' if n > 1 and w in ('zero', 'negative') else ''}")
        roles = ((self.param, "parameter"), (self.frozen, "frozen parameter"), (self.buffer, "buffer"))
        own = next((f", {w} `{n}`" for n, w in roles if n), "")
        return f"{self.name} ({self.dtype}, {values}{own}): {', '.join(parts)}"


@dataclass(frozen=True)
class OpEvidence:
    """The facts about an event's producing op and its class.

    Attributes:
        op: the op's name (``"rsqrt"``, ``"matmul"``, ``"aten._to_copy"``), or None when not recorded.
        raw_kind: ``"posinf"``, ``"neginf"`` or ``"nan"``: what the op (or the call) made.
        op_class: one of :data:`OP_CLASSES`.
        dtype: the dtype the value was made in.
        operands: the op's operands as recorded (empty when not recorded).
        recorded: whether operand facts were recorded.
        vanished: ``(value, dtype)`` of Python constants that round to 0 in the dtype (eps=1e-12 in float16).
        because: the fact that decided the class, as a clause ("its operand arg0 holds 2 zeros").
        what: a short name of the arithmetic (``"rsqrt of 0"``, ``"0·inf"``, ``"inf − inf"``), or ``""``.
        hook: the user's forward (pre-)hook the op ran inside, as words (``forward hook `scale` on `0```), or
            None (it ran in a ``forward``).
        unreplayed: why the trace replayed no forward call (``trace(drill=False)``, statistics on the sync-free
            path), so no op could be named, and how to name it; ``""`` when it could replay.
    """

    op: str | None
    raw_kind: str
    op_class: str
    dtype: str
    operands: tuple[Operand, ...] = ()
    recorded: bool = False
    vanished: tuple[tuple[float, str], ...] = ()
    because: str = ""
    what: str = ""
    hook: str | None = None
    unreplayed: str = ""

    @property
    def outside_domain(self) -> bool:
        """A ``singular`` op whose operand lay outside the op's domain (sqrt or log of a negative value, acos
        beyond ±1, a fractional power of a negative base): undefined there, not infinite."""
        return self.op_class == "singular" and self.what.endswith(_OUTSIDE_DOMAIN)

    @property
    def cause(self) -> str:
        """The diagnosis cause this class leads to (forward; a backward inf is ``backward_overflow``)."""
        return CLASS_CAUSE[self.op_class]

    def fact_lines(self) -> list[str]:
        """Sentences of evidence, each true of the recorded data."""
        lines: list[str] = []
        if self.op is None:
            lines.append("the producing op was not recorded (the forward replay runs on CPU tensors only)")
        else:
            label = "outside its domain" if self.outside_domain else self.op_class
            lines.append(f"the producing op: `{self.op}` ({label}: {self.because})")
            if self.hook is not None:
                lines.append(f"`{self.op}` ran inside the {self.hook}, not in a module's forward")
            if self.recorded:
                lines += [f"operand {o.words()}" for o in self.operands]
            else:
                lines.append("its operands were not recorded")
        for v, d in self.vanished:
            lines.append(f"the constant {v:g} rounds to 0 in {d} (smallest {d} subnormal {num(_tiny(d))})")
        return lines


def _tiny(dtype: str) -> float:
    dt = getattr(torch, dtype, None)
    if not isinstance(dt, torch.dtype) or not dt.is_floating_point:
        return math.nan
    fi = torch.finfo(dt)
    return float(fi.smallest_normal) * float(fi.eps)  # the smallest subnormal: 2**-24 for float16


def op_base(op: str) -> str:
    """``"__truediv__"`` → ``"div"``, ``"rsqrt_"`` → ``"rsqrt"``, ``"__iadd__"`` → ``"add"``, ``"__rtruediv__"``
    → ``"rdiv"``."""
    name = op.split(".")[-1]
    dunder = name.startswith("__") and name.endswith("__")
    name = name.strip("_")
    if dunder and name.startswith("i") and name[1:] in ("add", "sub", "mul", "truediv", "div", "pow"):
        name = name[1:]
    if (
        dunder
        and name.startswith("r")
        and name[1:] in ("add", "sub", "mul", "truediv", "div", "pow", "matmul")
    ):
        name = "r" + name[1:]
    name = {
        "truediv": "div",
        "true_divide": "div",
        "divide": "div",
        "floor_divide": "div",
        "rtruediv": "rdiv",
        "radd": "add",
        "rmul": "mul",
        "subtract": "sub",
        "multiply": "mul",
        "rmatmul": "matmul",
        "mm": "matmul",
        "bmm": "matmul",
        "linear": "matmul",
        "einsum": "matmul",
        "reciprocal": "reciprocal",
        "float_power": "pow",
    }.get(name, name)
    return name


# ---------------------------------------------------------------------------------------------- row lookups
def _rank_rows(df: pd.DataFrame, ov: Overflow, many: bool) -> pd.DataFrame:
    if many and "rank" in df.columns and len(df):
        return df[df["rank"].to_numpy() == ov.rank]
    return df


def _many(view: RunView) -> bool:
    return len(view.meta.ranks) > 1


def _call_ops(view: RunView, ov: Overflow, reaches: bool) -> pd.DataFrame | None:
    """The drill-down rows of the event's module call whose ``reaches`` is ``reaches`` (a trace recorded before
    the column existed only named values that reached the call's output)."""
    o = _rank_rows(view.ops, ov, _many(view))
    if not len(o) or "op" not in o.columns:
        return None
    o = o[o["kind"].astype(str).to_numpy() != MASK_KIND]  # an intended mask value names no producing op
    if "reaches" in o.columns:
        o = o[o["reaches"].to_numpy(dtype=bool) == reaches]
    elif not reaches:
        return None
    m = (
        (o["step"].to_numpy() == ov.step)
        & (o["micro_step"].to_numpy() == ov.micro_step)
        & (o["module"].astype(str).to_numpy() == ov.module)
        & (o["call"].to_numpy() == ov.call)
    )
    return o[m]


#: A backward NaN of a call for which the drill-down named no forward value that the forward discarded: either
#: such a value went unseen or a derivative at a finite value the forward kept (sqrt or a norm at 0) made it.
#: One sentence (``{when}``: when the forward is replayed) and its fix, for the explanation and the diagnosis.
_KEPT_DERIVATIVE = (
    "no forward op is named whose non-finite value the forward discarded ({when}), so the NaN comes from one of "
    "these kinds: a value a `torch.where`/mask discarded in forward (log or log1p at 0, x/0) whose derivative is "
    "still taken, or a derivative that is infinite at a finite value the forward kept, times a zero (sqrt or a "
    "norm at 0: the derivative of sqrt(s) is 1/(2·sqrt(s)), inf at s = 0, and inf·0 = NaN; x**p with 0 < p < 1 "
    "at 0; acos or asin at ±1), or an intermediate of the backward beyond its dtype's max (inf − inf)"
)


def kept_derivative(view: RunView) -> str:
    """The sentence of a backward NaN from a kept derivative for this run: when it replayed no forward call
    (:func:`unreplayed`) it says so, else that the forward is replayed only when its statistics point to one."""
    when = unreplayed(view) or "the forward is replayed only when its recorded statistics point to one"
    return _KEPT_DERIVATIVE.format(when=when)


KEPT_DERIVATIVE_FIX = (
    "Make the argument safe *before* the op: for a discarded value, `torch.where(keep, f(torch.where(keep, x, "
    "1.0)), 0.0)`; for a kept one, `(s + eps).sqrt()` for `s.sqrt()`, `F.normalize(x, eps=1e-6)` or "
    "`(x.pow(2).sum(-1) + eps).sqrt()` for `x.norm(dim=-1)`, `x.clamp_min(eps) ** p` for a fractional power. "
    "`nantrace.hunt` on this step names the op."
)


#: A bound on one update's change of a weight, in learning rates, for optimizers whose per-element step does not
#: scale with the gradient (in float32 or wider arithmetic): Adam's |m̂/√v̂| stays below (1-β1)/√(1-β2) ≈ 3.2 at
#: the default betas (31.6 with β1 = 0, β2 = 0.999), Adamax's step is at most lr/(1-β1^t), Lion's is ±lr.
NORMALISED_STEP_BOUND = 32.0
#: Decoupled weight decay shrinks a weight by lr·wd·|w| per update; wd ≤ 1 covers the usual 0.01–0.1.
WEIGHT_DECAY_BOUND = 1.0
#: The largest momentum buffer an SGD update can carry, in gradients: ``Σ μ^k |g| ≤ |g| / (1 − μ)`` at μ ≤ 0.99.
SGD_MOMENTUM_BOUND = 100.0


def normalised_optimizer(name: str) -> bool:
    """The optimizer class ``name`` (``Trace.options["optimizer"]``) takes steps bounded by its learning rate
    (:data:`NORMALISED_STEP_BOUND`): the Adam family and Lion."""
    low = name.lower()
    return "adam" in low or low.startswith("lion")


def applied_updates(steps: pd.DataFrame, after: int, upto: int) -> tuple[int, float]:
    """``(n, lr)``: how many of the steps in ``(after, upto]`` applied their update (the GradScaler did not skip
    it) and their largest recorded learning rate (NaN when none, or one is not finite or not recorded)."""
    if not len(steps) or "lr" not in steps.columns:
        return 0, math.nan
    st = steps["step"].to_numpy()
    between = steps[(st > after) & (st <= upto)]
    skipped = between["skipped"].tolist() if "skipped" in between.columns else [None] * len(between)
    applied = between[[not (v is not None and not pd.isna(v) and bool(v)) for v in skipped]]
    lrs = applied["lr"].to_numpy(dtype=np.float64)
    ok = bool(len(lrs)) and bool(np.isfinite(lrs).all())
    return len(applied), float(lrs.max()) if ok else math.nan


def unreachable_update(view: RunView, ov: Overflow) -> str | None:
    """For an ``optimizer`` event of a float32/float64 parameter: the sentence saying that no update of the
    optimizer could have made it non-finite, when the trace shows so; None otherwise.

    From the parameter's absmax ``A`` after its last recorded ``optimizer.step()``, the learning rate ``lr`` and
    the ``n`` updates since: Adam-family steps move a weight by at most ``n·lr·(32 + |w|)`` (``|w|``: a
    decoupled weight decay up to 1); SGD's by ``n·lr·(100·G + |w|)``, ``G`` the largest unscaled gradient
    absmax recorded since (momentum up to 0.99). When ``A`` plus that stays below the dtype's max, the value came
    from a write outside ``optimizer.step()`` (by hand, a hook, a load) before this step's update."""
    dtype = str(ov.dtype)
    name = str(view.meta.options.get("optimizer") or "")
    adam = normalised_optimizer(name)
    if ov.phase != "optimizer" or dtype not in ("float32", "float64") or not (adam or name == "SGD"):
        return None
    r = view.records
    mine = r[(r["module"].astype(str) == ov.module)]
    rows = mine[(mine["phase"].astype(str) == "optimizer") & (mine["tensor"].astype(str) == ov.tensor)]
    prev = rows[rows["step"].to_numpy() < ov.step]
    if not len(prev):
        return None
    p = int(prev["step"].max())
    a = float(prev[prev["step"].to_numpy() == p]["absmax"].iloc[-1])
    n, lr = applied_updates(view.steps, p, ov.step)
    if not math.isfinite(a) or n == 0 or math.isnan(lr):
        return None
    if adam:
        bound = n * lr * (NORMALISED_STEP_BOUND + WEIGHT_DECAY_BOUND * a)
        how = f"{name} moves a weight by at most about {num(NORMALISED_STEP_BOUND)}·lr per update"
    else:
        g = mine[
            (mine["phase"].astype(str) == "backward") & (mine["tensor"].astype(str) == ov.tensor + ".grad")
        ]
        g = g[(g["step"].to_numpy() > p) & (g["step"].to_numpy() <= ov.step)]
        if not len(g) or int(g[["n_nan", "n_posinf", "n_neginf"]].to_numpy().sum()):
            return None
        scale = g["scale"].to_numpy(dtype=np.float64) if "scale" in g.columns else np.ones(len(g))
        scale = np.where(np.isfinite(scale) & (scale > 0), scale, 1.0)
        gmax = float(np.max(g["absmax"].to_numpy(dtype=np.float64) / scale))
        bound = n * lr * (SGD_MOMENTUM_BOUND * gmax + WEIGHT_DECAY_BOUND * a)
        how = (
            f"SGD moves a weight by at most lr·({num(SGD_MOMENTUM_BOUND)}·|g| + |w|) per update (momentum up to "
            f"0.99, weight decay up to 1; |g| ≤ {num(gmax)} unscaled)"
        )
    limit = dtype_max(dtype)
    if not a + bound < limit:
        return None
    updates = f"{n} update{'s' if n > 1 else ''}"
    return (
        f"`{ov.tensor}` had absmax {num(a)} after optimizer.step() of step {p}; {how}, so at lr {num(lr)} over "
        f"{updates} it stays below {num(a + bound)}, far from {dtype}'s {num(limit)}: optimizer.step() cannot "
        f"have made it {'NaN' if ov.kind == 'nan' else 'inf'}; it was written outside "
        "optimizer.step() (by hand, a hook, a state-dict load) before this update"
    )


def discarded_op(view: RunView, ov: Overflow) -> tuple[str, str | None] | None:
    """For a NaN made in backward: ``(op, source line)`` of the forward op of the same call whose non-finite
    value the call's output discarded (``ops.reaches`` False), which the backward then turns into NaN (0·inf,
    0/0 in its derivative); None when the drill-down named none."""
    if ov.phase != "backward" or ov.kind != "nan":
        return None
    hit = _call_ops(view, ov, reaches=False)
    if hit is None or not len(hit):
        return None
    row = hit.iloc[0]
    source = row.get("source")
    return str(row["op"]), source if isinstance(source, str) else None


def _op_row(view: RunView, ov: Overflow) -> dict[str, Any] | None:
    hit = _call_ops(view, ov, reaches=True)
    if hit is None:
        return None
    kinds = hit["kind"].astype(str).to_numpy()
    order = ("posinf", "neginf", "nan") if ov.kind == "inf" else ("nan",)
    for k in order:
        rows = hit[kinds == k]
        if len(rows):
            return dict(rows.iloc[0])
    # the op the replay found made another kind than the call's output shows first (a scalar inf times 0
    # gives NaN beside the inf): it is still the call's producing op
    return dict(hit.iloc[0]) if len(hit) and ov.kind == "inf" else None


def call_input_rows(view: RunView, ov: Overflow) -> pd.DataFrame:
    """The input rows of the event's module call (the model inputs for the root), local rows only, without finite
    additive masks (:func:`nantrace._masks.lowest_masks`)."""
    r = _rank_rows(view.records, ov, _many(view))
    phase = "data" if ov.module == "" else "forward"
    m = (
        (r["step"].to_numpy() == ov.step)
        & (r["micro_step"].to_numpy() == ov.micro_step)
        & (r["phase"].astype(str).to_numpy() == phase)
        & (r["module"].astype(str).to_numpy() == ov.module)
        & r["tensor"].astype(str).str.startswith("input").to_numpy()
    )
    if ov.module != "":
        m &= r["call"].to_numpy() == ov.call
    if "reduced" in r.columns:
        m &= ~r["reduced"].to_numpy(dtype=bool)
    rows = r[m]
    return (
        rows[~lowest_masks(rows)] if len(rows) else rows
    )  # a finfo.min mask: no value the call computed from


def handed_in(view: RunView, ov: Overflow) -> bool:
    """The event is a value first seen at an input of a module call that no recorded call enclosed: the loop
    called a submodule itself (not inside a call of the model) and handed it the value, so it was made outside
    the model (the data, or the loop's own code between module calls), not by a module's forward."""
    if ov.phase != "forward" or not ov.tensor.startswith("input") or ov.module == "":
        return False
    rows = call_input_rows(view, ov)
    rows = rows[rows["tensor"].astype(str).to_numpy() == ov.tensor] if len(rows) else rows
    if not len(rows) or not bool(pd.isna(rows["parent"]).all()):
        return False
    # the call's input itself held the value (not a child's input named by rule 2 as the enclosing call's)
    return bool(rows[["n_nan", "n_posinf", "n_neginf"]].to_numpy().sum() > 0)


def call_arity(view: RunView, ov: Overflow) -> tuple[int, list[str]]:
    """How the event's module call was called, as recorded: the number of positional tensor inputs (highest
    ``input[i]`` + 1) and the names of keyword tensor inputs (``input.<name>``), in order."""
    n, kw = 0, []
    for t in call_input_rows(view, ov)["tensor"].astype(str):
        if t.startswith("input[") and t[6:].split("]")[0].isdigit():
            n = max(n, int(t[6:].split("]")[0]) + 1)
        elif t.startswith("input."):
            name = t[6:].split(".")[0].split("[")[0]
            if name not in kw:
                kw.append(name)
        elif t == "input":
            n = max(n, 1)
    return n, kw


def weights_beyond_event(view: RunView, ov: Overflow) -> tuple[list[tuple[str, str, float, int]], bool]:
    """Own parameters of the event's module whose latest known absmax exceeds the output dtype's max (a float32
    weight above 65504 that autocast's cast to float16 makes inf), and whether they were read live.

    First the recorded ``optimizer`` rows of steps before the event (:func:`~nantrace._ranges.weights_beyond`).
    When none shows it, the live model of a recording is read, but only when the GradScaler skipped every
    traced step from the event's on and no later ``optimizer`` row of the module was recorded: then
    ``optimizer.step()`` did not change the weights after that forward inside the trace."""
    if ov.phase != "forward":
        return [], False
    inputs = call_input_rows(view, ov)
    if len(inputs) and int(inputs[["n_posinf", "n_neginf"]].to_numpy().sum()):
        return [], False  # an inf its inputs already held explains it
    records = _rank_rows(view.records, ov, _many(view))
    if "reduced" in records.columns and len(records):
        records = records[~records["reduced"].to_numpy(dtype=bool)]
    dtype = str(ov.dtype)
    rec = weights_beyond(records, ov.module, ov.step, dtype)
    if rec:
        return rec, False
    limit = dtype_max(dtype)
    steps = _rank_rows(view.steps, ov, _many(view))
    later = steps[steps["step"].to_numpy() >= ov.step] if len(steps) else steps
    if view.model is None or math.isnan(limit) or limit >= dtype_max("float32") or not len(later):
        return [], False
    if not all(v is True for v in later["skipped"].tolist()):
        return [], False
    opt = (
        (records["phase"].astype(str).to_numpy() == "optimizer")
        & (records["module"].astype(str).to_numpy() == ov.module)
        & (records["step"].to_numpy() >= ov.step)
    )
    if bool(opt.any()):
        return [], False
    return view.model.params_beyond(ov.module, limit), True


def weights_nonfinite(view: RunView, ov: Overflow) -> list[tuple[str, str, int]]:
    """Own parameters of the event's module that already held NaN/inf when its forward ran: ``(parameter, kind,
    step)`` where ``step`` is the first of the trailing ``optimizer`` rows before the event that show it
    non-finite (``optimizer.step()`` of that step wrote it), or -1 when read from the live model of a recording
    (under the condition of :func:`weights_beyond_event`: no ``optimizer.step()`` changed them after that
    forward). Empty for an event that is not a forward one, or when its inputs held inf/NaN already."""
    if ov.phase != "forward" or ov.module == "":
        return []
    inputs = call_input_rows(view, ov)
    if len(inputs) and int(inputs[["n_nan", "n_posinf", "n_neginf"]].to_numpy().sum()):
        return []
    records = _rank_rows(view.records, ov, _many(view))
    if "reduced" in records.columns and len(records):
        records = records[~records["reduced"].to_numpy(dtype=bool)]
    opt = records[
        (records["phase"].astype(str).to_numpy() == "optimizer")
        & (records["module"].astype(str).to_numpy() == ov.module)
    ]
    out: list[tuple[str, str, int]] = []
    for tensor, g in opt[opt["step"].to_numpy() < ov.step].groupby(opt["tensor"].astype(str), sort=False):
        g = g.sort_values("step")
        bad = (g["n_nan"].to_numpy() + g["n_posinf"].to_numpy() + g["n_neginf"].to_numpy()) > 0
        if not bad[-1]:
            continue
        i = len(bad) - 1
        while i > 0 and bad[i - 1]:
            i -= 1
        kind = "nan" if int(g["n_nan"].iloc[-1]) else "inf"
        out.append((str(tensor), kind, int(g["step"].iloc[i])))
    if out or view.model is None:
        return out
    steps = _rank_rows(view.steps, ov, _many(view))
    later = steps[steps["step"].to_numpy() >= ov.step] if len(steps) else steps
    changed_after = bool((opt["step"].to_numpy() >= ov.step).any())
    skipped_after = bool(len(later)) and all(v is True for v in later["skipped"].tolist())
    if changed_after or not skipped_after:
        return []
    return [(p, k, -1) for p, k in view.model.params_nonfinite(ov.module)]


def nonfinite_words(view: RunView, ov: Overflow, bad: list[tuple[str, str, int]]) -> str:
    """ "`weight` held NaN since optimizer.step() of step 2" for :func:`weights_nonfinite`'s rows."""
    words = []
    for pname, kind, since in bad:
        what = "NaN" if kind == "nan" else "inf"
        if since >= 0:
            words.append(f"`{pname}` held {what} since optimizer.step() of step {since}")
            continue
        last = _last_finite(view, ov, pname)
        words.append(
            f"`{pname}` held {what} in the live model"
            + (
                f", where its last optimizer row (step {last}) was finite: it was written outside optimizer.step()"
                if last is not None
                else ""
            )
        )
    return "; ".join(words)


def _param_row(view: RunView, ov: Overflow, pname: str) -> tuple[str, pd.Series | None]:
    """``(name without its owner, last optimizer row before the event)`` of parameter ``pname`` (relative to
    the event's module: ``weight``, ``0.bias``)."""
    owner, _, local = pname.rpartition(".")
    module = ".".join(p for p in (ov.module, owner) if p)
    return local, last_optimizer_row(_rank_rows(view.records, ov, _many(view)), module, local, ov.step)


def _steps_between(view: RunView, ov: Overflow, k: int) -> pd.DataFrame:
    """The ``steps`` rows after step ``k`` and before the event's step."""
    steps = _rank_rows(view.steps, ov, _many(view))
    if not len(steps):
        return steps
    at = steps["step"].to_numpy()
    return steps[(at > k) & (at < ov.step)]


def _read_words(view: RunView, ov: Overflow, held: list[Operand]) -> str:
    """ "`weight` (operand arg1) held +inf when the forward read it; its optimizer row of step 1 was finite: it
    was written outside optimizer.step() (…)" for the producing op's parameter operands that
    held inf/NaN (:class:`Operand` ``param``, relative to the event's module)."""
    words = []
    for o in held:
        pname = str(o.param or o.frozen)
        kinds = [w for n, w in ((o.n_posinf, "+inf"), (o.n_neginf, "-inf"), (o.n_nan, "NaN")) if n]
        local, last = _param_row(view, ov, pname)
        notes = [f"operand {o.name}"] if o.name != local else []
        if o.frozen:
            notes.append("frozen: requires_grad=False, so no optimizer.step() changes it")
        named = f" ({'; '.join(notes)})" if notes else ""
        text = f"`{pname}`{named} held {' and '.join(kinds)} when the forward read it"
        if last is not None:
            k = int(last["step"])
            if int(last["n_nan"] + last["n_posinf"] + last["n_neginf"]):
                since = [st for p, _, st in weights_nonfinite(view, ov) if p == pname and st >= 0]
                text += f", since optimizer.step() of step {since[0] if since else k}"
            else:
                text += f"; its optimizer row of step {k} was finite" + _finite_since(view, ov, k)
        words.append(text)
    return "; ".join(words)


def _finite_since(view: RunView, ov: Overflow, k: int) -> str:
    """The rest of "its optimizer row of step 1 was finite…": what the steps after ``k`` and before the event
    tell of optimizer.step(). A skipped step ran none; a step ``nantrace.watch`` only watched checked every
    parameter that has a gradient (every one optimizer.step() updates) after it, and its ``steps.recorded``
    stays ``watch`` only when that check found all finite. When each step between is one of those, no
    optimizer.step() made the value."""
    between = _steps_between(view, ov, k)
    skipped = [v is True for v in between["skipped"].tolist()] if len(between) else []
    recorded = (
        between["recorded"].astype(str).tolist() if "recorded" in between.columns else ["?"] * len(between)
    )
    watched = [
        st
        for st, sk, how in zip(between["step"].tolist(), skipped, recorded, strict=True)
        if not sk and how == "watch"
    ]
    if any(not sk and how != "watch" for sk, how in zip(skipped, recorded, strict=True)):
        return ""  # a step between whose optimizer.step() left no record of this parameter
    check = (
        f", and nantrace.watch's parameter check after optimizer.step() of step(s) {steps_text(watched)} found "
        "every parameter it updated finite"
        if watched
        else ""
    )
    return (
        f"{check}: it was written outside optimizer.step() (after the update of step {max([k, *watched])}, "
        "before this forward)"
    )


def weights_written(
    view: RunView, ov: Overflow, ev: OpEvidence | None
) -> list[tuple[str, int, float, float]]:
    """The producing op's finite parameter operands whose absmax, as the forward read them, differs from their
    last ``optimizer`` row when no ``optimizer.step()`` ran since that row (every step between was skipped by the
    GradScaler): ``(parameter name under the event's module, row step, absmax after that step, absmax read)``.
    Only a write outside the optimizer (a manual edit, a state-dict load, a weight average) changes a parameter
    there; both numbers are the largest finite ``|x|`` of the same tensor."""
    if ev is None or ov.phase != "forward" or not ev.recorded:
        return []
    out: list[tuple[str, int, float, float]] = []
    for o in ev.operands:
        if not o.param or o.nonfinite or math.isnan(o.absmax):
            continue
        _, last = _param_row(view, ov, o.param)
        if last is None or int(last["n_nan"] + last["n_posinf"] + last["n_neginf"]):
            continue
        k, before = int(last["step"]), float(last["absmax"])
        if not all(v is True for v in _steps_between(view, ov, k)["skipped"].tolist()):
            continue  # an optimizer.step() ran since that row
        if not math.isclose(before, o.absmax, rel_tol=1e-6):
            out.append((o.param, k, before, o.absmax))
    return out


def written_words(ev: Overflow, w: tuple[str, int, float, float]) -> str:
    """The evidence line of one :func:`weights_written` parameter."""
    name, k, before, read = w
    factor = f" (×{num(read / before)})" if before > 0 else ""
    skipped = f" (the GradScaler skipped every step after {k})" if ev.step > k + 1 else ""
    return (
        f"its parameter `{name}` had absmax {num(before)} after optimizer.step() of step {k} and {num(read)} when "
        f"this forward read it{factor}, with no optimizer.step() in between{skipped}: it was written outside the "
        "optimizer"
    )


def written_facts(view: RunView, ov: Overflow, ev: OpEvidence | None) -> tuple[list[str], str | None]:
    """``(evidence lines, advice or None)`` for :func:`weights_written`'s parameters: what they held after the
    optimizer and when read, and to find what wrote them."""
    written = weights_written(view, ov, ev)
    if not written:
        return [], None
    names = ", ".join(f"`{'.'.join(p for p in (ov.module, w[0]) if p)}`" for w in written)
    advice = (
        f"Find what wrote {names} after optimizer.step() of step {written[0][1]} and before this forward (a manual "
        "edit, a state-dict load, a weight average): the optimizer did not change it in between."
    )
    return [written_words(ov, w) for w in written], advice


def _last_finite(view: RunView, ov: Overflow, pname: str) -> int | None:
    """The step of the parameter's last optimizer row before the event, when that row was finite."""
    last = last_optimizer_row(_rank_rows(view.records, ov, _many(view)), ov.module, pname, ov.step)
    if last is None or int(last["n_nan"] + last["n_posinf"] + last["n_neginf"]):
        return None
    return int(last["step"])


# ---------------------------------------------------------------------------------------------- classes
def _operands(
    text: Any, module: str = ""
) -> tuple[tuple[Operand, ...], tuple[tuple[float, str], ...], bool, str | None, str | None]:
    """``(operands, vanished constants, recorded, the result's dtype or None, the hook in words or None)`` of
    the ``operands`` JSON of a call of ``module``."""
    if not isinstance(text, str) or not text:
        return (), (), False, None, None
    try:
        doc = json.loads(text)
    except ValueError:
        return (), (), False, None, None
    ops = []
    for d in doc.get("operands", []):
        d = dict(d)
        if "shape" in d:
            d["shape"] = tuple(int(x) for x in d["shape"])
        ops.append(Operand(**{k: v for k, v in d.items() if k in Operand.__dataclass_fields__}))
    vanished = tuple((float(v), str(dt)) for v, dt in doc.get("vanished", []))
    result = doc.get("result")
    result_dtype = str(result["dtype"]) if isinstance(result, dict) and result.get("dtype") else None
    hook = doc.get("hook")
    named = None
    if isinstance(hook, dict):
        rel = hook.get("module")
        on = "" if rel is None else f" on {module_label('.'.join(p for p in (module, str(rel)) if p))}"
        named = f"{hook.get('kind')} `{hook.get('name')}`{on}"
    return tuple(ops), vanished, True, result_dtype, named


#: Reductions whose second positional argument is the dim (``x.sum(1)``, ``torch.cumsum(x, 0)``); for the
#: norms it is the order ``p``, so only a ``dim=`` keyword counts there.
_DIM_SECOND = {"sum", "mean", "cumsum", "cumprod", "prod", "logsumexp", "nansum", "nanmean", "var", "std"}


def _values_per_result(base: str, ops: tuple[Operand, ...]) -> int:
    """How many of the input's values one element of the reduction's result combines: the product of the
    reduced dims' lengths (a cumsum's longest running sum: its dim's length), all of them without a dim; 0 when
    the input tensor was not recorded."""
    tensors = [o for o in ops if not o.is_scalar]
    if not tensors:
        return 0
    x = max(tensors, key=lambda o: o.numel)
    heads = ("dim", "arg1") if base in _DIM_SECOND else ("dim",)
    dims = [
        int(o.value) for o in ops if o.is_scalar and o.value is not None and o.name.split("[")[0] in heads
    ]
    rank = len(x.shape)
    if not dims or not rank or any(not -rank <= d < rank for d in dims):
        return x.numel
    return math.prod(x.shape[d % rank] for d in set(d % rank for d in dims))


#: ops defined on [-1, 1] only: NaN beyond it (a cosine similarity rounded past 1 under ``acos``)
_UNIT_DOMAIN = ("acos", "asin", "arccos", "arcsin", "atanh", "arctanh", "erfinv", "special_erfinv")
#: the ``what`` endings of a value outside the op's domain (not a singular point: the op is undefined there)
_OUTSIDE_DOMAIN = (" of a negative value", " beyond ±1", " of a value below 1", "at or below -1")


def _all_ignored(ops: tuple[Operand, ...]) -> str | None:
    """For a loss op of :data:`~nantrace._opfacts.TARGET_OPS`: the clause saying every target equals its
    ``ignore_index`` (-100 unless given), so its mean is over no element; None otherwise."""
    given = [o.value for o in ops if o.is_scalar and o.name == "ignore_index"]
    ignore = int(given[0]) if given and given[0] is not None else -100
    for o in ops:
        if o.int_min is not None and o.int_min == o.int_max == ignore:
            return f"every one of its {o.numel} targets ({o.name}) is ignore_index {ignore}"
    return None


def _singular(base: str, kind: str, ops: tuple[Operand, ...]) -> tuple[str, str] | None:
    """(because, what) when an operand sits at the op's singular point (module docstring, rule 4)."""
    tensors = [o for o in ops if not o.is_scalar] or list(ops)
    if base in ("div", "rdiv", "reciprocal") and ops:
        den = ops[0] if base in ("rdiv", "reciprocal") else (ops[1] if len(ops) > 1 else None)
        if den is not None and den.zeros:
            num_ops = [o for o in ops if o is not den]
            zero_num = bool(num_ops) and num_ops[0].zeros
            what = "0/0" if kind == "nan" and zero_num else "x/0"
            return (
                f"its denominator {den.name} holds {'0' if den.is_scalar else f'{den.n_zero} zero(s)'}",
                what,
            )
    if base in ("fmod", "remainder") and kind == "nan" and len(ops) > 1 and ops[1].zeros:
        d = ops[1]
        return f"its divisor {d.name} holds {'0' if d.is_scalar else f'{d.n_zero} zero(s)'}", "x mod 0"
    if base in TARGET_OPS and kind == "nan":
        every = _all_ignored(ops)
        if every is not None:
            return every, "a mean over zero elements (0/0)"
    empty = bool(tensors) and tensors[0].numel == 0
    if base in ("mean", "nanmean", "var", "std", "var_mean", "std_mean") and kind == "nan" and empty:
        return f"its operand {tensors[0].name} holds no elements", "a mean over zero elements (0/0)"
    if base in ("rsqrt", "log", "log2", "log10") and tensors:
        x = tensors[0]
        if kind != "nan" and x.zeros:
            return f"its operand {x.name} holds {x.n_zero} zero(s)", f"{base} of 0"
        if kind == "nan" and x.negatives:
            return f"its operand {x.name} holds {x.n_neg} negative value(s)", f"{base} of a negative value"
    if base == "log1p" and tensors and tensors[0].negatives:
        return (
            f"its operand {tensors[0].name} holds negative values (log1p is -inf at -1)",
            "log1p at or below -1",
        )
    if base == "sqrt" and kind == "nan" and tensors and tensors[0].negatives:
        x = tensors[0]
        return f"its operand {x.name} holds {x.n_neg} negative value(s)", "sqrt of a negative value"
    if base in _UNIT_DOMAIN and tensors:
        x = tensors[0]
        if kind == "nan" and x.absmax > 1:
            return (
                f"its operand {x.name} holds values beyond ±1 (absmax {num(x.absmax)})",
                f"{base} of a value beyond ±1",
            )
        if base in ("atanh", "arctanh", "erfinv", "special_erfinv") and kind != "nan" and x.absmax == 1:
            return f"its operand {x.name} holds ±1 (absmax 1)", f"{base} of ±1"
    if base in ("acosh", "arccosh") and kind == "nan" and tensors and tensors[0].negatives:
        x = tensors[0]
        return (
            f"its operand {x.name} holds {x.n_neg} negative value(s) (acosh needs x ≥ 1)",
            f"{base} of a value below 1",
        )
    if base in ("pow", "rpow") and len(ops) >= 2:
        b, e = (ops[0], ops[1]) if base == "pow" else (ops[1], ops[0])
        if kind != "nan" and b.zeros and e.negatives:
            return f"its base {b.name} holds 0 and its exponent {e.name} is negative", "0 to a negative power"
        frac = e.is_scalar and e.value is not None and math.isfinite(e.value) and e.value != round(e.value)
        if kind == "nan" and b.negatives and (frac or not e.is_scalar):
            return (
                f"its base {b.name} holds negative values under a fractional exponent",
                "a fractional power of a negative value",  # ends like _OUTSIDE_DOMAIN's first
            )
    return None


def _classify_op(
    op: str, kind: str, dtype: str, ops: tuple[Operand, ...], recorded: bool
) -> tuple[str, str, str]:
    """(class, because, what) of a named op (module docstring)."""
    base = op_base(op)
    if op == CAST_OP or base in _CASTS:
        src = ops[0] if ops else None
        if src is not None and not src.is_scalar:
            return (
                "cast",
                f"it cast {src.dtype} values of absmax {num(src.absmax)} to {dtype}, max {num(dtype_max(dtype))}",
                f"a cast to {dtype}",
            )
        return "cast", f"a cast to {dtype} made {KIND_WORDS[kind]}", f"a cast to {dtype}"
    if recorded:
        neg = [o for o in ops if o.neginf]
        pos = [o for o in ops if o.posinf]
        if neg and not pos:
            what = "a fully masked row" if kind == "nan" else "a negated -inf mask"
            return "mask_arithmetic", f"its operand {neg[0].name} holds -inf (a mask)", what
        if pos or neg:
            o = (pos or neg)[0]
            what = {
                "add": "inf − inf",
                "sub": "inf − inf",
                "mul": "0·inf",
                "matmul": "0·inf",
                "div": "inf/inf",
            }.get(base, "an op on inf")
            return "invalid", f"its operand {o.name} holds inf", what
        big = [o for o in ops if o.at_max(dtype)]
        if big and kind != "nan" and base in _ARITH:
            return (
                "mask_arithmetic",
                f"its operand {big[0].name} holds ±{num(dtype_max(dtype))} (torch.finfo({dtype}).min, a mask constant)",
                "finfo.min plus a negative value rounds to -inf",
            )
    sing = _singular(base, kind, ops) if recorded else None
    by_name = base in ("rsqrt", "log", "log2", "log10") or (base == "sqrt" and kind == "nan")
    if sing is None and not recorded and by_name:
        sing = (
            "the only finite input at which it gives this is its singular point (operands not recorded)",
            f"{base} at its singular point",
        )
    if sing is not None:
        return "singular", sing[0], sing[1]
    if base in _REDUCTIONS and kind != "nan":
        many = _values_per_result(base, ops)
        shown = (
            f" of {many} finite values (absmax {num(max(o.absmax for o in ops if not o.is_scalar))})"
            if many
            else ""
        )
        return (
            "reduction",
            f"a {base}{shown} exceeded {num(dtype_max(dtype))}",
            f"a {base} beyond {dtype}'s max",
        )
    if kind != "nan":
        amax = [o.absmax for o in ops if not o.is_scalar and not math.isnan(o.absmax)]
        shown = f" (absmax {num(max(amax))})" if amax else ""
        return (
            "overflow",
            f"finite operands{shown} gave a result beyond {num(dtype_max(dtype))}",
            f"{base} beyond {dtype}'s max",
        )
    return "invalid", "finite operands gave NaN", "NaN from finite operands"


def _classify_call(view: RunView, ov: Overflow, kind: str, beyond: bool) -> tuple[str, str, str]:
    """(class, because, what) from the module call's recorded inputs when no op facts decide (rules 1–7)."""
    dtype = str(ov.dtype)
    if ov.phase == "backward":
        if kind == "nan":
            return (
                "invalid",
                "its backward made NaN from finite incoming gradients",
                "0·inf, inf − inf or 0/0 in a derivative",
            )
        bound = backward_bound(view, ov)
        if bound is not None:
            g, a, n, b = bound
            return (
                "singular",
                f"with no recorded parameters, its incoming gradients (absmax {num(g)}) times its recorded inputs "
                f"and outputs (absmax at most {num(a)}) summed over at most {n} elements stay below {num(b)}, far "
                f"under {backward_dtype(view, ov)}'s max, so a derivative in its backward was far beyond any value "
                "the forward saw",
                "a derivative at or near a singular point (x/0 or a tiny denominator, 1/sqrt(0), log at 0)",
            )
        return (
            "overflow",
            "its backward made inf from finite incoming gradients",
            f"a gradient beyond {dtype}'s max",
        )
    inputs = call_input_rows(view, ov)
    limit = dtype_max(dtype)
    if beyond:
        return "cast", f"its parameters exceed {dtype}'s {num(limit)}", f"a cast of its weights to {dtype}"
    in_max = finite_absmax(inputs) if len(inputs) else math.nan
    wider = [d for d in inputs["dtype"].astype(str).unique()] if len(inputs) else []
    if not math.isnan(in_max) and in_max > limit and any(dtype_max(d) > limit for d in wider):
        return (
            "cast",
            f"its finite inputs (absmax {num(in_max)}) exceed {dtype}'s {num(limit)}",
            f"a cast of its inputs to {dtype}",
        )
    pos = bool(len(inputs)) and int(inputs["n_posinf"].sum()) > 0
    neg = bool(len(inputs)) and int(inputs["n_neginf"].sum()) > 0
    bad = weights_nonfinite(view, ov) if not (pos or neg) else []
    if bad:  # the call computed from its own non-finite weights: nothing in the call made the value
        return "invalid", f"its own parameter {nonfinite_words(view, ov, bad)}", WEIGHTS_HELD
    if kind == "nan":
        if pos:
            return "invalid", _HELD_INF, "inf − inf, 0·inf or inf/inf"
        if neg:
            return "mask_arithmetic", "its inputs held -inf (a mask)", "a fully masked row"
        return (
            "invalid",
            "its inputs held no inf/NaN",
            "0/0, 0·inf or inf − inf inside the call, or a NaN written as a constant",
        )
    if neg and not pos:
        return (
            "mask_arithmetic",
            "its inputs held -inf (a mask) that went on into values that are not a mask",
            "a mask's -inf carried on",
        )
    return (
        "overflow",
        f"finite inputs (absmax {num(in_max)}) gave a value beyond {num(limit)}",
        f"a value beyond {dtype}'s max",
    )


def backward_bound(view: RunView, ov: Overflow) -> tuple[float, float, int, float] | None:
    """``(g, a, n, g·a·n)`` for a backward inf of a module call that owns no recorded parameter, when that
    bound is below the backward dtype's max; else None. ``g``: the finite absmax of the gradients arriving at
    the call (``grad_output``); ``a``: the largest finite absmax of its recorded forward inputs and outputs (at
    least 1); ``n``: the most elements of one of them (a bound on how many terms one gradient element sums).
    A backward that multiplies incoming gradients by values of the size the forward saw and sums them cannot
    pass ``g·a·n``: an inf beyond it comes from a derivative far larger than the values the forward saw, at or
    near a singular point (x/0, a tiny denominator, 1/sqrt(0)), not from values growing too large."""
    if ov.phase != "backward" or ov.kind != "inf":
        return None
    r = _rank_rows(view.records, ov, _many(view))
    mine = r[
        (r["step"].to_numpy() == ov.step)
        & (r["micro_step"].to_numpy() == ov.micro_step)
        & (r["module"].astype(str).to_numpy() == ov.module)
        & (r["call"].to_numpy() == ov.call)
    ]
    if own_parameters(r, ov.module) or not len(mine):
        return None
    phase, tensor = mine["phase"].astype(str), mine["tensor"].astype(str)
    gout = mine[phase.isin(["backward", "loss"]).to_numpy() & tensor.str.startswith("grad_output").to_numpy()]
    fwd = mine[phase.isin(["data", "forward"]).to_numpy()]
    if not len(gout) or not len(fwd) or int(gout[["n_nan", "n_posinf", "n_neginf"]].to_numpy().sum()):
        return None
    if int(fwd[["n_nan", "n_posinf", "n_neginf"]].to_numpy().sum()):
        return None  # a non-finite forward value: its own derivative can be what made it
    g, a = finite_absmax(gout), max(finite_absmax(fwd), 1.0)
    n = int(fwd["numel"].max())
    bound = g * a * n
    limit = dtype_max(backward_dtype(view, ov))
    return (g, a, n, bound) if math.isfinite(bound) and bound < limit else None


def backward_dtype(view: RunView, ov: Overflow) -> str:
    """The dtype a backward value was computed in: the event's dtype, or the narrower dtype of the gradients
    arriving at the module (a float32 ``weight.grad`` computed from float16 gradients under autocast)."""
    r = _rank_rows(view.records, ov, _many(view))
    m = (
        (r["step"].to_numpy() == ov.step)
        & (r["micro_step"].to_numpy() == ov.micro_step)
        & r["phase"].astype(str).isin(["backward", "loss"]).to_numpy()
        & (r["module"].astype(str).to_numpy() == ov.module)
        & r["tensor"].astype(str).str.startswith("grad_output").to_numpy()
    )
    dtypes = [str(d) for d in r[m]["dtype"].astype(str).unique()]
    narrow = min(dtypes, key=dtype_max) if dtypes else str(ov.dtype)
    return narrow if dtype_max(narrow) < dtype_max(str(ov.dtype)) else str(ov.dtype)


def _event_kind(view: RunView, ov: Overflow) -> str:
    if ov.kind == "nan":
        return "nan"
    r = _rank_rows(view.records, ov, _many(view))
    m = (
        (r["step"].to_numpy() == ov.step)
        & (r["micro_step"].to_numpy() == ov.micro_step)
        & (r["phase"].astype(str).to_numpy() == ov.phase)
        & (r["module"].astype(str).to_numpy() == ov.module)
        & (r["tensor"].astype(str).to_numpy() == ov.tensor)
    )
    rows = r[m]
    if len(rows) and int(rows["n_posinf"].sum()) == 0 and int(rows["n_neginf"].sum()) > 0:
        return "neginf"
    return "posinf"


def mean_over_nothing(grad_rows: pd.DataFrame) -> int | None:
    """For a NaN loss: the number of output elements when the gradient arriving at the model's outputs
    (``grad_rows``: that micro-step's ``loss``-phase ``grad_output`` rows) was recorded finite and exactly 0 in
    every element, so no output element contributed and the loss was a mean over zero elements (0/0: every label
    ``ignore_index``, an empty mask); else ``None``."""
    if not len(grad_rows):
        return None
    numel = int(grad_rows["numel"].sum())
    bad = int(grad_rows[["n_nan", "n_posinf", "n_neginf"]].to_numpy().sum())
    return numel if numel > 0 and bad == 0 and int(grad_rows["n_zero"].sum()) == numel else None


def loss_bounds(outs: pd.DataFrame, dtype: str) -> list[tuple[str, str]]:
    """Which common loss op of the model's recorded outputs leaves ``dtype``'s range, from their statistics alone.

    ``outs``: the root module's ``output`` rows of the step (``min``, ``max``, ``absmax``, ``numel``). Returns
    ``(op, fact)`` pairs, each fact a sentence true of those rows: ``"square"`` (one square of the absmax passes
    the dtype's max) or ``"sum_squares"`` (the sum of squares over all their elements can), ``"exp"`` (exp of the
    largest value passes it) and ``"softmax"`` (the values span more than ``-ln`` of the smallest subnormal, so a
    softmax probability can round to 0 and ``log(softmax)`` be ``-inf``). Empty when none does, or when
    ``dtype`` is not a floating dtype.
    """
    limit, tiny = dtype_max(dtype), _tiny(dtype)
    if not len(outs) or math.isnan(limit) or math.isnan(tiny):
        return []
    mx = outs["max"].to_numpy(dtype="float64")
    mn = outs["min"].to_numpy(dtype="float64")
    hi = float(mx[np.isfinite(mx)].max()) if np.isfinite(mx).any() else math.nan
    lo = float(mn[np.isfinite(mn)].min()) if np.isfinite(mn).any() else math.nan
    a, n = finite_absmax(outs), int(outs["numel"].sum())
    found: list[tuple[str, str]] = []
    if a * a > limit:
        found.append(("square", f"the square of their absmax {num(a)} is {num(a * a)}, beyond {num(limit)}"))
    elif n * a * a > limit:
        found.append(
            (
                "sum_squares",
                f"a sum of squares over their {n} elements can reach {num(n * a * a)}, beyond {num(limit)}",
            )
        )
    if hi > math.log(limit):
        big = num(math.exp(hi)) if hi < 709 else "inf"
        found.append(("exp", f"exp of their largest value {num(hi)} is {big}, beyond {num(limit)}"))
    if hi - lo > -math.log(tiny):
        found.append(
            (
                "softmax",
                f"their values span {num(hi - lo)} (min {num(lo)}, max {num(hi)}), so a softmax probability can be "
                f"below the smallest subnormal {num(tiny)} and round to 0 (log(0) = -inf)",
            )
        )
    return found


_LOSS_IF = {
    "square": "squares them",
    "sum_squares": "sums their squares",
    "exp": "takes their exp",
    "softmax": "takes log(softmax(...)) of them",
}
_LOSS_REMEDY = {
    "square": "compute the squared error in float32 or scale the outputs and targets down",
    "sum_squares": "reduce with `mean()` rather than `sum()`",
    "exp": "subtract the row's max before exp (`torch.logsumexp`, `F.log_softmax`)",
    "softmax": "use `F.log_softmax` / `F.cross_entropy` rather than `log(softmax(...))`",
}


def masked_outputs(outs: pd.DataFrame) -> int:
    """How many -inf values the model's output rows ``outs`` hold when that is their only non-finite kind (a
    mask the locator did not report: masked logits); 0 otherwise."""
    if not len(outs) or int(outs[["n_nan", "n_posinf"]].to_numpy().sum()):
        return 0
    return int(outs["n_neginf"].sum())


def outputs_words(outs: pd.DataFrame) -> str:
    """``"were finite (absmax 2.5)"``, or for masked outputs ``"held only a mask's -inf (12 values; finite absmax
    2.5)"``, of the model's output rows ``outs``."""
    n = masked_outputs(outs)
    if n:
        return f"held only a mask's -inf ({n} values; finite absmax {num(finite_absmax(outs))})"
    return f"were finite (absmax {num(finite_absmax(outs))})"


#: The first advice for a NaN loss from finite outputs when some overflow bound also holds.
NAN_LOSS = (
    "A NaN loss from finite outputs is made by the loss's own arithmetic or what it is given: 0/0, 0·inf, the log "
    "or sqrt of a negative, a NaN in the targets or in a factor the loop multiplies the loss by; check those first."
)

#: The first advice for a non-finite loss from outputs holding a mask's -inf.
MASKED_LOSS = (
    "The model's outputs hold -inf where they are masked ({n} values): a loss that weighs every output, such as "
    "cross-entropy with `label_smoothing`, a KL divergence p·(log p − log q) or a sum of log-probabilities, "
    "multiplies that -inf by a non-zero weight (inf) or by 0 (NaN). Leave the masked entries out of the loss: "
    "spread label smoothing over the allowed entries only, and sum p·log q where p > 0 (`torch.xlogy`, "
    "`F.kl_div`); a finite stand-in for -inf (`torch.finfo(dtype).min`) keeps the loss finite but huge. If the "
    "model masks nothing there, the -inf is a log of an exact 0 (a softmax that saturated, `log(softmax(x))` "
    "written by hand): `torch.log_softmax` stays finite."
)


def loss_advice(outs: pd.DataFrame, loss_dtype: str, kind: str = "inf") -> list[str]:
    """Advice for a non-finite loss from finite model outputs, from :func:`loss_bounds` in the outputs' own
    narrow dtype (float16, bfloat16) and in float32. ``loss_dtype``: the recorded loss tensor's dtype, or
    ``"not recorded"``. Returns sentences; when no bound holds, one pointing at the targets and the loss's own
    log/division."""
    dtypes = outs["dtype"].astype(str).unique().tolist() if len(outs) else []
    narrow = next((d for d in dtypes if d in ("float16", "bfloat16")), None)
    wide = loss_dtype if loss_dtype in ("float32", "float64") else "float32"
    in_narrow = loss_bounds(outs, narrow) if narrow else []
    in_wide = loss_bounds(outs, wide)
    advice: list[str] = []
    wide_ops = {op for op, _ in in_wide}
    only = [(op, f) for op, f in in_narrow if op not in wide_ops]  # what float32 would not suffer
    if only:
        facts = "; ".join(f for _, f in only)
        if loss_dtype == narrow or loss_dtype == "not recorded":
            advice.append(
                f"Compute the loss in float32 from the model's outputs (`loss_fn(output.float(), target)`): in "
                f"{narrow}, {facts}."
            )
        else:
            advice.append(
                f"The loss is {loss_dtype}, but in {narrow} {facts}: cast the outputs before the loss's first op "
                "(`loss_fn(output.float(), target)`)."
            )
    for op, fact in in_wide:
        flows = "underflows" if op == "softmax" else "overflows"
        advice.append(f"If the loss {_LOSS_IF[op]}, even {wide} {flows}: {fact}; {_LOSS_REMEDY[op]}.")
    if "softmax" in {op for op, _ in only}:
        advice.append(f"For a classification loss, {_LOSS_REMEDY['softmax']}.")
    if not advice and loss_dtype in ("float16", "bfloat16"):  # the loss's own ops ran in the narrow dtype
        made = (
            f"an op of the loss itself (a scale, a product, a sum with the targets) went beyond {loss_dtype}'s "
            f"{num(dtype_max(loss_dtype))}"
            if kind != "nan"
            else f"an op of the loss itself made NaN in {loss_dtype} (inf − inf after an overflow, 0/0, a log or "
            "sqrt of a negative)"
        )
        advice.append(
            f"The loss is {loss_dtype} and non-finite from finite outputs: {made}. Compute it in float32 from the "
            "outputs (`loss_fn(output.float(), target.float())`) and check the targets."
        )
    if kind == "nan" and advice:  # the bounds are overflows: they make NaN only through a later inf − inf
        advice = [
            NAN_LOSS,
            *(f"If an op of the loss overflowed first (inf − inf is NaN): {a}" for a in advice),
        ]
    if masked_outputs(outs):
        advice.insert(0, MASKED_LOSS.format(n=masked_outputs(outs)))
    if not advice:
        where = f"{narrow} or {wide}" if narrow else wide
        advice.append(
            f"No square, sum of squares, exp or softmax of these outputs leaves {where}'s range: check the targets "
            "and any log or division in the loss (clamp its argument with an eps)."
        )
    return advice


def _op_dtype(op: str, ops: tuple[Operand, ...], event_dtype: str, result_dtype: str | None = None) -> str:
    """The dtype the op computed in: its result's dtype when recorded (autocast runs a ``linear`` of a float16
    input and a float32 weight in float16; a cast's target; type promotion's widest dtype), which is not the
    call's output dtype when the call casts afterwards (``softmax(s.float())``, ``x.half().float()``).
    Without the result: a cast's target is the event's dtype, any other op's the widest floating dtype of its
    tensor operands."""
    if result_dtype is not None:
        return result_dtype
    if op == CAST_OP or op_base(op) in _CASTS:
        return event_dtype
    floats = [o.dtype for o in ops if o.dtype is not None and not math.isnan(dtype_max(o.dtype))]
    return max(floats, key=dtype_max) if floats else event_dtype


def op_evidence(view: RunView, ov: Overflow) -> OpEvidence | None:
    """The facts and class of the op that produced ``ov`` (a ``forward`` or ``backward`` event); None for the
    other phases (no op of the model made the value)."""
    if ov.phase not in ("forward", "backward") or handed_in(view, ov):
        return None
    dtype = str(ov.dtype) if ov.phase == "forward" else backward_dtype(view, ov)
    row = _op_row(view, ov) if ov.phase == "forward" else None
    beyond = bool(weights_beyond_event(view, ov)[0]) if ov.phase == "forward" else False
    if row is not None:
        kind = str(row["kind"])
        ops, vanished, recorded, result_dtype, hook = _operands(row.get("operands"), ov.module)
        dtype = _op_dtype(str(row["op"]), ops, dtype, result_dtype)
        held = [o for o in ops if o.held_weight]
        if beyond and str(row["op"]) != CAST_OP:
            cls, because, what = _classify_call(view, ov, kind, beyond)
        elif held and ov.phase == "forward":  # it computed from its own weights: nothing in the call made it
            cls, because, what = "invalid", f"its own parameter {_read_words(view, ov, held)}", WEIGHTS_HELD
        else:
            cls, because, what = _classify_op(str(row["op"]), kind, dtype, ops, recorded)
        return OpEvidence(str(row["op"]), kind, cls, dtype, ops, recorded, vanished, because, what, hook)
    kind = _event_kind(view, ov)
    cls, because, what = _classify_call(view, ov, kind, beyond)
    return OpEvidence(None, kind, cls, dtype, (), False, (), because, what, unreplayed=_unreplayed_op(view))


def replay_off(options: dict[str, Any]) -> str | None:
    """Why a trace with these options (``Trace.options``) replayed no module call: ``"drill"``
    (``drill=False``), ``"sync_free"`` (statistics computed on the sync-free path: no host statistics, no
    replay), or None when it could replay."""
    if options.get("drill") is False:
        return "drill"
    if options.get("device_stats") or options.get("sync_free"):
        return "sync_free"
    return None


def unreplayed(view: RunView) -> str:
    """Why the trace replayed no forward call (:func:`replay_off`), as words (``""`` when it could): without a
    replay no op is named, whatever made the value."""
    return _UNREPLAYED.get(replay_off(view.meta.options) or "", ("", ""))[0]


def _unreplayed_op(view: RunView) -> str:
    """:func:`unreplayed` with the way to name the op: the default drill-down, or ``nantrace.hunt``."""
    why, how = _UNREPLAYED.get(replay_off(view.meta.options) or "", ("", ""))
    return f"{why}; {how}" if why else ""


#: :func:`replay_off`'s reasons in words, each with the way to have the op named.
_UNREPLAYED = {
    "drill": (
        "the trace ran with drill=False, so no forward call was replayed",
        "trace again with the default drill=True, whose replay names the op",
    ),
    "sync_free": (
        "statistics were computed on the sync-free path, where no forward call is replayed",
        "nantrace.hunt(step_fn) on this step names the op",
    ),
}


_VERBS = {
    "overflow": "overflowed {dtype} ({kind})",
    "reduction": "overflowed {dtype} in a reduction ({kind})",
    "cast": "overflowed in a cast to {dtype} ({kind})",
    "singular": "hit a singular point: {what} gave {kind} ({dtype})",
    "invalid": "made {kind} by an invalid operation: {what} ({dtype})",
    "mask_arithmetic": "made {kind} by mask arithmetic: {what} ({dtype})",
}
_DOMAIN_VERB = "went outside its domain: {what} gave {kind} ({dtype})"


def headline(ov: Overflow, ev: OpEvidence | None, limit: int = 160, handed: bool = False) -> str:
    """One line of at most ``limit`` characters: who, what, where ("step 28 forward: `blocks.1.attn.scores`
    (matmul) overflowed float16 (+inf)"). ``handed``: the value was handed in by the loop (:func:`handed_in`)."""
    where = f"step {ov.step}" + (f", micro-step {ov.micro_step}" if ov.micro_step else "") + f" {ov.phase}"
    if ev is None:
        words = "NaN" if ov.kind == "nan" else "inf"
        if ov.phase == "data":
            line = f"{where}: model input `{ov.tensor}` held {words} before any module ran ({ov.dtype})"
        elif ov.phase == "loss":
            which = "the loss" if ov.tensor.startswith("loss") else "the gradient at the model's outputs"
            line = f"{where}: {which} (`{ov.tensor}`) was {words} ({ov.dtype})"
        elif ov.phase == "optimizer":
            line = f"{where}: optimizer.step() made `{ov.tensor}` of {module_label(ov.module)} {words} ({ov.dtype})"
        elif handed:
            line = f"{where}: `{ov.tensor}` the loop handed to {module_label(ov.module)} held {words} ({ov.dtype})"
        else:
            line = f"{where}: {module_label(ov.module)} `{ov.tensor}` held {words} ({ov.dtype})"
        return _fit(line, limit)
    verb = _DOMAIN_VERB if ev.outside_domain else _VERBS[ev.op_class]
    what = verb.format(dtype=ev.dtype, kind=KIND_WORDS[ev.raw_kind], what=ev.what)
    if ev.what == WEIGHTS_HELD:
        what = f"computed {KIND_WORDS[ev.raw_kind]} from its own non-finite weights ({ev.dtype})"
    op = f" (`{ev.op}`)" if ev.op is not None else f" ({ov.module_type})"
    who = "the backward of " if ov.phase == "backward" else ""
    return _fit(f"{where}: {who}{module_label(ov.module)}{op} {what}", limit)


def _fit(line: str, limit: int) -> str:
    return line if len(line) <= limit else line[: limit - 1] + "…"


def _arg_absmax(ev: OpEvidence) -> float:
    """The absmax of the op's first tensor operand (NaN when none was recorded)."""
    t = [o for o in ev.operands if not o.is_scalar]
    return t[0].absmax if t else math.nan


def _matmul_advice(ev: OpEvidence, name: str) -> list[str]:
    """For a matmul of two recorded tensors whose operand sizes alone bound the product beyond the dtype's max
    (absmax a × absmax b × inner dimension K): scale an operand before the product."""
    t = [o for o in ev.operands if not o.is_scalar and o.shape]
    if len(t) < 2 or math.isnan(t[0].absmax) or math.isnan(t[1].absmax):
        return []
    k = t[0].shape[-1]
    bound = t[0].absmax * t[1].absmax * k
    limit = dtype_max(ev.dtype)
    if not bound > limit:
        return []
    wider = (
        ", or compute the product in float32 (`torch.matmul(a.float(), b.float())`)"
        if limit < dtype_max("bfloat16")  # float32 holds what float16 cannot; nothing holds more than ~3.4e38
        else ""
    )
    return [
        f"In {name}: `{ev.op}` sums {k} products of operands of absmax {num(t[0].absmax)} and {num(t[1].absmax)} "
        f"(up to {num(bound)} > {num(limit)}): scale an operand down *before* the product (for attention "
        f"scores, q by 1/sqrt(head_dim) before q·kᵀ, when it is not already){wider}."
    ]


def scaled_run(view: RunView) -> bool:
    """The run recorded a loss scale (a GradScaler): advice may then say what a lower scale does."""
    steps = view.steps
    return bool(len(steps)) and "scale" in steps.columns and bool(steps["scale"].notna().any())


def _not_overflow(scaled: bool, dtype_helps: str) -> str:
    """The closing line of a singular or invalid op's advice: what the loss scale (only in a run with one) and
    a wider dtype do."""
    scale = "a lower loss scale does not remove it, and " if scaled else ""
    return f"Not an overflow: {scale}{dtype_helps}."


def _singular_advice(ev: OpEvidence, name: str, base: str, scaled: bool) -> list[str]:
    """The fixes for an op at its singular point or outside its domain, from the op and its operands."""
    out: list[str] = []
    for v, d in ev.vanished:
        out.append(
            f"The constant {v:g} is 0 in {d}: use an eps {d} can hold (at least {num(_tiny(d))}; e.g. 1e-5), "
            "or compute this op in float32."
        )
    op = f"`{ev.op}`" if ev.op else "the op"
    if base in ("div", "rdiv", "reciprocal"):
        out.append(f"In {name}: keep the denominator away from 0: `x / (d + eps)` or `d.clamp_min(eps)`.")
    elif base in ("fmod", "remainder"):
        out.append(
            f"In {name}: keep the divisor of {op} away from 0 (`d.clamp_min(eps)`, or skip the entries where it "
            "is 0)."
        )
    elif ev.what.endswith(" of ±1"):
        out.append(
            f"In {name}: {op} is infinite at ±1: clamp its argument inside (-1, 1) first "
            "(`x.clamp(-1 + eps, 1 - eps)`)."
        )
    elif base in ("pow", "rpow") and ev.what == "a fractional power of a negative value":
        out.append(
            f"In {name}: a fractional power is undefined for a negative base: make the base non-negative "
            "before it (`x.clamp_min(0) ** p`, or `x.abs() ** p * x.sign()` for an odd root)."
        )
        out.append(_not_overflow(scaled, "a wider dtype does not remove it"))
        return out
    elif base in ("pow", "rpow"):
        out.append(
            f"In {name}: clamp the base away from 0 before a negative power (`x.clamp_min(eps) ** p`)."
        )
    elif ev.what == "a mean over zero elements (0/0)" and base in TARGET_OPS:
        out.append(
            f"In {name}: every target of `{ev.op}` is `ignore_index`, so its mean is over no element: skip such "
            "a batch (`if (labels != ignore_index).any()`), or take `reduction='sum'` and divide by the count of "
            "kept targets clamped to 1."
        )
        out.append(_not_overflow(scaled, "a wider dtype does not remove it"))
        return out
    elif ev.what == "a mean over zero elements (0/0)":
        out.append(
            f"In {name}: `{ev.op}` reduced an empty selection; skip it when nothing is selected, or sum and "
            "divide by the count clamped to 1 (`x.sum(0) / n.clamp_min(1)`)."
        )
        out.append(_not_overflow(scaled, "a wider dtype does not remove it"))
        return out
    elif ev.what.endswith(" beyond ±1"):
        rounds = (
            "; a cosine or a normalised value can round past 1"
            if base in ("acos", "asin", "arccos", "arcsin")
            else ""
        )
        out.append(
            f"In {name}: {op} is defined on [-1, 1] only, and its argument's |x| reached {num(_arg_absmax(ev))}: "
            f"clamp it first (`x.clamp(-1 + eps, 1 - eps)`{rounds})."
        )
        out.append(
            _not_overflow(scaled, "a wider dtype rounds less but does not remove it without the clamp")
        )
        return out
    elif ev.what.endswith(" of a negative value") and base in ("sqrt", "rsqrt"):
        out.append(
            f"In {name}: {op} got negative values. If its argument is a variance or a squared norm, which is "
            "never negative in exact arithmetic, the negative comes from cancellation in a difference such as "
            "E[x²] − E[x]²: compute it from deviations (`((x - x.mean()) ** 2).mean()`, `torch.var`) or in "
            "float32. Otherwise clamp it first (`x.clamp_min(0)`, with an eps inside a sqrt whose gradient "
            "you need)."
        )
        out.append(_not_overflow(scaled, "a wider dtype helps only where it removes the cancellation"))
        return out
    elif ev.outside_domain:
        out.append(
            f"In {name}: the argument of {op} left its domain ({ev.what}): clamp it into the domain first "
            "(`x.clamp_min(eps)` for a log), or find what put it there."
        )
        out.append(_not_overflow(scaled, "a wider dtype does not remove it"))
        return out
    else:
        out.append(
            f"In {name}: keep the argument of {op} away from 0 and negatives (`x.clamp_min(eps)`, or add eps inside)."
        )
    out.append(_not_overflow(scaled, "a wider dtype does not remove it, unless with an eps it can hold"))
    return out


def class_advice(ev: OpEvidence, module: str, *, scaled: bool = False) -> list[str]:
    """The fixes that follow from the class and the operands (none for ``overflow``/``cast``: the caller's
    advice on dtypes and weights applies there); ``scaled``: the run has a loss scale (:func:`scaled_run`)."""
    name, base = module_label(module), op_base(ev.op) if ev.op else ""
    out: list[str] = []
    if ev.hook is not None:
        out.append(
            f"`{ev.op}` ran in your {ev.hook}, not in a module's forward: fix the hook's arithmetic (what "
            "it scales, adds or replaces), or remove the hook to confirm that the model alone stays finite."
        )
    if ev.op_class == "singular":
        out += _singular_advice(ev, name, base, scaled)
    elif ev.op_class == "invalid" and ev.what == WEIGHTS_HELD:
        frozen = any(o.frozen and o.held_weight for o in ev.operands)
        writers = (
            "a manual edit, a state-dict load"
            if frozen
            else "an optimizer step whose own fault came first, a manual edit, a state-dict load"
        )
        out.append(
            f"The weights of {name} were already non-finite when its forward read them: the fault is what wrote "
            f"them ({writers}), not this forward. Restore them from a checkpoint and fix that writer."
        )
    elif ev.op_class == "invalid":
        infs = [o for o in ev.operands if o.posinf or o.neginf]
        held_inf = bool(infs) or ev.because == _HELD_INF
        if infs and all(o.is_scalar for o in infs):  # the inf is a number written in the code, made nowhere
            out.append(
                f"In {name}: `{ev.op}` is given an inf written in the code (a Python number), and "
                f"{ev.what or 'arithmetic with it'} is NaN: use a large finite value (`torch.finfo(dtype).max`, "
                "`.min` for -inf) or select with `torch.where` instead of computing with inf."
            )
        elif held_inf:
            out.append(
                f"In {name}: an operand already held inf ({ev.what}); find where that inf was made and compute it "
                "in float32, or mask/clamp before this op."
            )
        elif ev.op is not None:
            out.append(
                f"In {name}: `{ev.op}` gave NaN from the finite operands above: keep them inside its domain (clamp "
                "them first), or compute it in float32 if an intermediate overflowed."
            )
        elif ev.unreplayed:
            out.append(
                f"Find the invalid op in {name}'s forward or its forward hooks (0/0, 0·inf, inf − inf, sqrt/log of a "
                "negative, or a NaN written as a constant): add eps to denominators and clamp arguments of sqrt/log. "
                f"No op is named because {ev.unreplayed}."
            )
        else:
            out.append(
                f"Find the invalid op in {name}'s forward or its forward hooks (0/0, 0·inf, inf − inf, sqrt/log of a "
                "negative): add eps to denominators and clamp arguments of sqrt/log. The forward replay names an op "
                "that makes NaN from finite operands; it names none for a NaN written as a constant (`x[i] = "
                "float('nan')`, `fill_(nan)`), so look for one of those if no op is named."
            )
    elif ev.op_class == "mask_arithmetic":
        if base in _ARITH - {"masked_fill", "where", "fill"}:  # the mask was added or multiplied in
            out.append(
                f"In {name}: apply the mask with `scores.masked_fill(mask, torch.finfo(scores.dtype).min)` rather than "
                "adding or multiplying it (finfo.min plus a negative value rounds to -inf; 0·(-inf) is NaN)."
            )
        out.append(
            "Keep at least one unmasked key per row, or zero fully masked rows after the softmax "
            "(`probs.masked_fill(all_masked, 0)`)."
        )
    elif ev.op_class == "overflow" and base == "matmul":
        out += _matmul_advice(ev, name)
    elif ev.op_class == "reduction":
        op = base or "reduction"
        out.append(
            f"In {name}: compute the {op} in float32 (`x.float().{op}(...)`, then cast back), or reduce fewer or "
            "smaller values (a mean instead of a sum, rescale first)."
        )
    return out
