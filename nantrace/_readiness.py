"""fp16 readiness: from an fp32 or bf16 run, which modules would overflow or lose values in float16."""

from __future__ import annotations

import math
import re
from typing import Any

import numpy as np
import pandas as pd

from ._masks import is_mask
from ._schema import FP16_MAX, FP16_SMALLEST_NORMAL, FP16_SMALLEST_SUBNORMAL

__all__ = ["READINESS_COLUMNS", "fp16_readiness"]

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


def fp16_readiness(trace: Any, *, loss_scale: float | None = None) -> pd.DataFrame:
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
