"""Range facts over ``records``: least headroom per module, float32 weights beyond a narrower dtype's range,
the finite absmax of a set of rows. Pure pandas/numpy, shared by the explanations, the diagnosis and the
reports."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd

from ._masks import lowest_masks, unmasked
from ._schema import FP16_MAX, dtype_max, is_wide

__all__ = [
    "finite_absmax",
    "headroom_table",
    "last_optimizer_row",
    "lowest_rank_steps",
    "own_parameters",
    "weights_beyond",
]


def own_parameters(records: pd.DataFrame, module: str) -> list[str]:
    """The names of the parameters ``module`` itself owns (not its submodules'), sorted, from the rows that
    record them: its ``optimizer`` rows (a parameter after ``optimizer.step()``) and its backward ``<name>.grad``
    rows. Empty when no such row was recorded (no parameters, or none trained and no backward traced)."""
    rows = records[records["module"].astype(str).to_numpy() == module]
    phase, tensor = rows["phase"].astype(str).to_numpy(), rows["tensor"].astype(str)
    names = set(tensor[phase == "optimizer"].tolist())
    grads = tensor[(phase == "backward") & tensor.str.endswith(".grad").to_numpy()]
    names.update(t[: -len(".grad")] for t in grads.tolist())
    return sorted(names)


def weights_beyond(
    records: pd.DataFrame, module: str, step: int, dtype: str
) -> list[tuple[str, str, float, int]]:
    """The parameters of ``module`` (its own, not its submodules') whose latest recorded value before ``step``
    does not fit ``dtype``: ``(tensor, param dtype, absmax, step it grew past)``, largest absmax first.

    Read from phase ``optimizer`` rows (parameters after ``optimizer.step()``; recorded only with
    ``optimizer=``): for each parameter its row of the latest step < ``step`` (the value the forward of ``step``
    used) counts when its finite absmax exceeds ``dtype``'s max while the parameter's own dtype is wider, i.e.
    a float32 weight above 65504 that autocast casts to float16 (the cast gives inf). The step it grew past is
    the first of the consecutive latest rows above that max. Empty for a wide ``dtype`` (float32/float64), or
    when no such row is recorded.
    """
    limit = dtype_max(dtype)
    if math.isnan(limit) or is_wide(dtype) or not len(records):
        return []
    rows = records[
        (records["phase"].astype(str) == "optimizer")
        & (records["module"].astype(str) == module)
        & (records["step"] < step)
    ]
    out: list[tuple[str, str, float, int]] = []
    for tensor, g in rows.groupby(rows["tensor"].astype(str), sort=False):
        g = g.sort_values("step")
        pdtype = str(g["dtype"].iloc[-1])
        absmax = g["absmax"].to_numpy(dtype=np.float64)
        if not (np.isfinite(absmax[-1]) and absmax[-1] > limit and dtype_max(pdtype) > limit):
            continue
        i = len(absmax) - 1
        while i > 0 and np.isfinite(absmax[i - 1]) and absmax[i - 1] > limit:
            i -= 1
        out.append((str(tensor), pdtype, float(absmax[-1]), int(g["step"].iloc[i])))
    return sorted(out, key=lambda t: -t[2])


def last_optimizer_row(records: pd.DataFrame, module: str, tensor: str, before: int) -> pd.Series | None:
    """The latest ``optimizer`` row of parameter ``tensor`` of ``module`` before step ``before`` (its value
    after that ``optimizer.step()``: ``step``, ``absmax``, the inf/NaN counts...); None when none is recorded.
    The one lookup of "what the optimizer last left in this parameter"."""
    if not len(records):
        return None
    rows = records[
        (records["phase"].astype(str).to_numpy() == "optimizer")
        & (records["module"].astype(str).to_numpy() == module)
        & (records["tensor"].astype(str).to_numpy() == tensor)
        & (records["step"].to_numpy() < before)
    ]
    if not len(rows):
        return None
    return rows.sort_values("step", kind="stable").iloc[-1]


def finite_absmax(rows: pd.DataFrame) -> float:
    v = rows["absmax"].to_numpy(dtype=np.float64)
    v = v[np.isfinite(v)]
    return float(v.max()) if v.size else math.nan


def headroom_table(
    records: pd.DataFrame, limit: float = FP16_MAX, top: int = 5, ops: pd.DataFrame | None = None
) -> pd.DataFrame:
    """Modules with the least headroom: ``log2(limit / absmax)`` bits (fp16 limit 65504), smallest first.

    Columns: ``module, module_type, absmax, headroom_bits``; over forward rows (activations; gradients carry the
    loss scale). A module that held ±inf has ``absmax = inf`` and ``headroom_bits = -inf`` (it overflowed); an
    attention mask's -inf (:mod:`nantrace._masks`) is not an overflow and does not count, nor does a finite mask
    of ``torch.finfo(dtype).min`` values (:func:`nantrace._masks.lowest_masks`), nor -inf that ``ops`` (the
    drill-down) shows was masked in the forward (``masked_fill(m, -inf)``).
    """
    rows = unmasked(records[records["phase"].astype(str) == "forward"], ops)
    if len(rows):
        rows = rows[~lowest_masks(rows)]  # a finfo.min mask's absmax is no activation's range
    if len(rows) == 0:
        return pd.DataFrame(columns=["module", "module_type", "absmax", "headroom_bits"])
    absmax = rows["absmax"].to_numpy(dtype=np.float64)
    overflowed = (rows["n_posinf"].to_numpy() + rows["n_neginf"].to_numpy()) > 0
    absmax = np.where(overflowed, np.inf, np.where(np.isfinite(absmax), absmax, np.nan))
    g = (
        pd.DataFrame(
            {
                "module": rows["module"].astype(str).to_numpy(),
                "module_type": rows["module_type"].astype(str).to_numpy(),
                "absmax": absmax,
            }
        )
        .groupby(["module", "module_type"], sort=False)["absmax"]
        .max()
        .reset_index()
        .dropna()
    )
    g = g[g["absmax"] > 0]
    with np.errstate(divide="ignore"):
        g["headroom_bits"] = np.log2(limit / g["absmax"].to_numpy())
    return g.sort_values("headroom_bits", kind="stable").head(top).reset_index(drop=True)  # ties: first seen


def lowest_rank_steps(steps: pd.DataFrame) -> tuple[pd.DataFrame, int | None]:
    """``steps`` of the lowest rank and that rank when the table holds several ranks (a merged trace: loss and
    loss scale are per rank), else ``(steps, None)``."""
    if "rank" not in steps.columns or not len(steps) or steps["rank"].nunique() < 2:
        return steps, None
    low = int(steps["rank"].min())
    return steps[steps["rank"].to_numpy() == low].reset_index(drop=True), low
