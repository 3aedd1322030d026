"""Compare two traced runs of the same model: where do their value ranges first part?

Typical use: the same model, data and seed traced once in float32 and once in float16 (or bf16, or before and
after a change); :func:`compare` aligns their records and names the first tensor whose range differs by more
than a tolerance, or that is finite in one run and not in the other.
"""

from __future__ import annotations

import html
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import pandas as pd

from ._fmt import num
from ._masks import is_mask

if TYPE_CHECKING:
    from ._trace import Trace

__all__ = ["DIFF_COLUMNS", "KEY_COLUMNS", "Comparison", "compare"]

KEY_COLUMNS: tuple[str, ...] = ("step", "micro_step", "phase", "module", "call", "tensor", "occurrence")
DIFF_COLUMNS: tuple[str, ...] = (
    "step",
    "micro_step",
    "phase",
    "module",
    "module_type",
    "call",
    "tensor",
    "occurrence",
    "dtype_a",
    "dtype_b",
    "absmax_a",
    "absmax_b",
    "diff_bits",
    "finite_a",
    "finite_b",
    "zero_frac_a",
    "zero_frac_b",
    "diverged",
)
_PHASE_RANK = {"data": 0, "forward": 1, "loss": 2, "backward": 3, "optimizer": 4}
DEFAULT_RTOL = 0.1


@dataclass(frozen=True, eq=False)
class Comparison:
    """The result of :func:`compare`.

    Attributes:
        diffs: every aligned record, in time order (step, micro-step, phase, execution order of run ``a``), with
            columns :data:`DIFF_COLUMNS`: the key (``step, micro_step, phase, module, call, tensor`` and
            ``occurrence``, the n-th record with that key), ``module_type``, each run's dtype, ``absmax``
            (gradients divided by the loss scale they were recorded with, so a scaled fp16 run compares with an
            unscaled fp32 run), ``diff_bits = |log2(absmax_a / absmax_b)|`` (0 when both are ≤ ``atol``, inf when
            exactly one is), ``finite_a``/``finite_b`` (no NaN/±inf other than an attention mask's -inf), the
            fraction of exact zeros in each, and ``diverged`` (``diff_bits > tol_bits`` or the finiteness
            differs).
        first: the first diverged row of ``diffs`` (a ``pandas.Series``), or ``None`` when the runs agree.
        tol_bits: the tolerance used, in bits (``log2(1 + rtol)`` when ``rtol`` was given).
        n_only_a: records of ``a`` with no counterpart in ``b`` (e.g. a module traced in one run only).
        n_only_b: records of ``b`` with no counterpart in ``a``.
    """

    diffs: pd.DataFrame
    first: pd.Series | None
    tol_bits: float
    n_only_a: int = 0
    n_only_b: int = 0

    @property
    def diverged(self) -> bool:
        """True when some aligned record diverged."""
        return self.first is not None

    @property
    def divergent(self) -> pd.DataFrame:
        """The diverged rows of :attr:`diffs`, in time order."""
        return self.diffs[self.diffs["diverged"].to_numpy(dtype=bool)]

    def _first_text(self) -> str:
        r = self.first
        if r is None:
            return (
                f"no divergence: {len(self.diffs)} aligned records agree within {self.tol_bits:.3g} bits "
                "and are finite in both runs or in neither"
            )
        mod = f"`{r['module']}`" if r["module"] else "the root model"
        how = (
            "finite in one run only"
            if bool(r["finite_a"]) != bool(r["finite_b"])
            else f"{_g(r['diff_bits'])} bits apart (tolerance {self.tol_bits:.3g})"
        )
        return (
            f"first divergence at step {r['step']}, micro-step {r['micro_step']}, {r['phase']}, {mod} "
            f"({r['module_type']}, call {r['call']}) `{r['tensor']}`: {_range(r['absmax_a'], r['finite_a'])} "
            f"(a, {r['dtype_a']}) vs {_range(r['absmax_b'], r['finite_b'])} (b, {r['dtype_b']}), {how}"
        )

    def __str__(self) -> str:
        lines = [self._first_text()]
        n = int(self.diffs["diverged"].sum()) if len(self.diffs) else 0
        lines.append(f"{n} of {len(self.diffs)} aligned records diverge")
        if self.n_only_a or self.n_only_b:
            lines.append(f"unaligned: {self.n_only_a} records only in a, {self.n_only_b} only in b")
        return "\n".join(lines)

    def __repr__(self) -> str:
        return f"<nantrace.Comparison: {self._first_text()}>"

    def _repr_html_(self) -> str:
        e = html.escape
        rows = "".join(
            "<tr>"
            + "".join(
                f"<td>{e(_cell(r[c]))}</td>"
                for c in ("step", "phase", "module", "tensor", "absmax_a", "absmax_b", "diff_bits")
            )
            + "</tr>"
            for _, r in self.divergent.head(10).iterrows()
        )
        table = (
            "<table><thead><tr><th>step</th><th>phase</th><th>module</th><th>tensor</th><th>absmax a</th>"
            f"<th>absmax b</th><th>bits</th></tr></thead><tbody>{rows}</tbody></table>"
            if rows
            else ""
        )
        body = "".join(f"<p>{e(line)}</p>" for line in str(self).split("\n"))
        return f'<div class="nantrace-comparison"><p><b>nantrace.Comparison</b></p>{body}{table}</div>'


def _g(v: Any) -> str:
    try:
        return num(float(v))
    except (TypeError, ValueError):
        return str(v)


def _range(absmax: Any, finite: Any) -> str:
    """``absmax 70400``, ``non-finite`` (no finite value at all) or ``absmax 3 plus inf/NaN``."""
    a = float(absmax)
    if bool(finite):
        return f"absmax {_g(a)}"
    return "non-finite" if math.isnan(a) else f"absmax {_g(a)} plus inf/NaN"


def _cell(v: Any) -> str:
    return _g(v) if isinstance(v, (float, np.floating)) else str(v)


def _records(x: Any, name: str) -> pd.DataFrame:
    if isinstance(x, pd.DataFrame):
        return x
    rec = getattr(x, "records", None)
    if isinstance(rec, pd.DataFrame):
        return rec
    raise TypeError(
        f"compare(): {name} must be a nantrace.Trace or its records DataFrame; got {type(x).__name__}"
    )


def _prepare(rec: pd.DataFrame) -> pd.DataFrame:
    n = len(rec)
    scale = rec["scale"].to_numpy(dtype=np.float64) if n else np.zeros(0)
    absmax = rec["absmax"].to_numpy(dtype=np.float64) if n else np.zeros(0)
    unscaled = np.where(np.isfinite(scale) & (scale > 0), absmax / np.where(scale > 0, scale, 1.0), absmax)
    bad = (rec["n_nan"].to_numpy() + rec["n_posinf"].to_numpy() + rec["n_neginf"].to_numpy()) > 0 if n else []
    df = pd.DataFrame(
        {
            "step": rec["step"].to_numpy().astype(np.int64),
            "micro_step": rec["micro_step"].to_numpy().astype(np.int64),
            "phase": rec["phase"].astype(str).to_numpy(),
            "module": rec["module"].astype(str).to_numpy(),
            "module_type": rec["module_type"].astype(str).to_numpy(),
            "call": rec["call"].to_numpy().astype(np.int64),
            "tensor": rec["tensor"].astype(str).to_numpy(),
            "seq": rec["seq"].to_numpy().astype(np.int64),
            "dtype": rec["dtype"].astype(str).to_numpy(),
            "absmax": unscaled,
            "finite": ~(np.asarray(bad, dtype=bool) & ~is_mask(rec)),
            "zero_frac": rec["n_zero"].to_numpy(dtype=np.float64) / np.maximum(rec["numel"].to_numpy(), 1)
            if n
            else np.zeros(0),
        }
    )
    df = df.sort_values(["step", "micro_step", "seq"], kind="stable")
    df["occurrence"] = df.groupby(
        ["step", "micro_step", "phase", "module", "call", "tensor"], sort=False
    ).cumcount()
    return df


def compare(
    a: Trace | pd.DataFrame,
    b: Trace | pd.DataFrame,
    rtol: float | None = None,
    *,
    tol_bits: float | None = None,
    atol: float = 0.0,
) -> Comparison:
    """Align the records of two runs and find where their value ranges first diverge.

    Records are aligned on ``(step, micro_step, phase, module, call, tensor)`` plus ``occurrence`` (the n-th
    record with that key, in execution order), so both runs must trace the same model with the same loop. The
    range of a record is its ``absmax`` (largest finite ``|x|``; gradients are divided by the loss scale they
    were recorded with). A record *diverges* when ``|log2(absmax_a / absmax_b)| > tol_bits``, or when it is
    finite in one run and not in the other (an attention mask's -inf does not count as non-finite). The first
    divergence is the earliest diverged record in time order: step, micro-step, phase (data, forward, loss,
    backward, optimizer), then execution order.

    Example: ``compare(fp32_trace, fp16_trace)`` names the first layer whose fp16 range departs from fp32's
    (typically the layer that overflows, or a gradient that underflows to 0).

    Args:
        a, b: the two runs, as :class:`~nantrace.Trace` objects or their ``records`` DataFrames.
        rtol: relative tolerance on ``absmax``: values within a factor ``1 + rtol`` agree (``tol_bits =
            log2(1 + rtol)``). Default (neither ``rtol`` nor ``tol_bits`` given): 0.1, i.e. 0.1375 bits.
        tol_bits: the tolerance directly in bits (``1.0`` = a factor of 2). Give ``rtol`` or ``tol_bits``, not both.
        atol: absmax values both at most ``atol`` agree (0 bits apart), e.g. to ignore tiny gradients; default 0.

    Returns:
        a :class:`Comparison` (``.first``, ``.diffs``, ``.divergent``, ``.diverged``).

    Raises:
        TypeError: ``a`` or ``b`` is neither a Trace nor a DataFrame.
        ValueError: both ``rtol`` and ``tol_bits`` are given, either is negative or not finite, or ``atol`` is
            negative.
    """
    if rtol is not None and tol_bits is not None:
        raise ValueError("give rtol or tol_bits, not both (tol_bits = log2(1 + rtol))")
    for name, v in (("rtol", rtol), ("tol_bits", tol_bits), ("atol", atol)):
        if v is not None and (
            isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0
        ):
            raise ValueError(f"{name} must be a finite number ≥ 0; got {v!r}")
    if tol_bits is None:
        tol_bits = math.log2(1.0 + (DEFAULT_RTOL if rtol is None else float(rtol)))
    ra, rb = _records(a, "a"), _records(b, "b")
    pa, pb = _prepare(ra), _prepare(rb)
    keys = list(KEY_COLUMNS)
    m = pa.merge(pb, on=keys, how="outer", suffixes=("_a", "_b"), indicator=True)
    both = m[m["_merge"] == "both"].copy()
    n_only_a = int((m["_merge"] == "left_only").sum())
    n_only_b = int((m["_merge"] == "right_only").sum())
    xa = both["absmax_a"].to_numpy(dtype=np.float64)
    xb = both["absmax_b"].to_numpy(dtype=np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        small_a = np.nan_to_num(xa, nan=0.0) <= atol
        small_b = np.nan_to_num(xb, nan=0.0) <= atol
        bits = np.abs(np.log2(xa / xb))
    bits = np.where(small_a & small_b, 0.0, np.where(small_a ^ small_b, np.inf, bits))
    bits = np.where(np.isnan(xa) & np.isnan(xb), 0.0, bits)
    bits = np.where(np.isnan(bits), np.inf, bits)
    fa = both["finite_a"].to_numpy(dtype=bool)
    fb = both["finite_b"].to_numpy(dtype=bool)
    # a tensor that is non-finite in both runs: its finite part is not comparable, the fault is shared
    diverged = (fa != fb) | ((bits > tol_bits) & fa & fb)
    out = pd.DataFrame(
        {
            "step": both["step"].to_numpy(dtype=np.int64),
            "micro_step": both["micro_step"].to_numpy(dtype=np.int64),
            "phase": both["phase"].to_numpy(),
            "module": both["module"].to_numpy(),
            "module_type": both["module_type_a"].to_numpy(),
            "call": both["call"].to_numpy(dtype=np.int64),
            "tensor": both["tensor"].to_numpy(),
            "occurrence": both["occurrence"].to_numpy(dtype=np.int64),
            "dtype_a": both["dtype_a"].to_numpy(),
            "dtype_b": both["dtype_b"].to_numpy(),
            "absmax_a": xa,
            "absmax_b": xb,
            "diff_bits": bits,
            "finite_a": fa,
            "finite_b": fb,
            "zero_frac_a": both["zero_frac_a"].to_numpy(dtype=np.float64),
            "zero_frac_b": both["zero_frac_b"].to_numpy(dtype=np.float64),
            "diverged": diverged,
            "_rank": both["phase"].map(_PHASE_RANK).to_numpy(),
            "_seq": both["seq_a"].to_numpy(dtype=np.float64),
        }
    )
    out = out.sort_values(["step", "micro_step", "_rank", "_seq"], kind="stable")
    out = out[list(DIFF_COLUMNS)].reset_index(drop=True)
    hit = out[out["diverged"].to_numpy(dtype=bool)]
    first = hit.iloc[0] if len(hit) else None
    return Comparison(out, first, float(tol_bits), n_only_a, n_only_b)
