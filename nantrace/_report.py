"""Words and tables for people: the locator's explanation, and the text/HTML reprs of a trace."""

from __future__ import annotations

import html
import math
from typing import TYPE_CHECKING, Any

import numpy as np
import pandas as pd
import torch

if TYPE_CHECKING:
    from ._trace import Trace

__all__ = ["dtype_max", "explain", "headroom_table", "trace_html", "trace_text", "weights_beyond"]

FP16_MAX = float(torch.finfo(torch.float16).max)  # 65504


def dtype_max(name: str) -> float:
    """Largest finite value of the dtype called ``name`` (``"float16"`` → 65504 = torch.finfo(float16).max)."""
    dt = getattr(torch, str(name).removeprefix("torch."), None)
    if isinstance(dt, torch.dtype) and dt.is_floating_point:
        return float(torch.finfo(dt).max)
    return math.nan


_MATMUL_TYPES = ("Linear", "Conv1d", "Conv2d", "Conv3d", "Bilinear", "LazyLinear")


def _wide(dtype: str) -> bool:
    """True for float32/float64 (a range of at least float32's): moving to float32 cannot help."""
    m = dtype_max(dtype)
    return not math.isnan(m) and m >= float(torch.finfo(torch.float32).max)


def _g(v: float) -> str:
    return "n/a" if v is None or (isinstance(v, float) and math.isnan(v)) else f"{v:.4g}"


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
    if math.isnan(limit) or _wide(dtype) or not len(records):
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


def weights_words(module: str, beyond: list[tuple[str, str, float, int]]) -> str:
    """ "`0.weight` absmax 5.887e+06 since step 2; `0.bias` …" for :func:`weights_beyond`'s rows."""
    prefix = f"{module}." if module else ""
    return "; ".join(f"`{prefix}{t}` absmax {_g(a)} since step {s}" for t, _, a, s in beyond)


def _finite_absmax(rows: pd.DataFrame) -> float:
    v = rows["absmax"].to_numpy(dtype=np.float64)
    v = v[np.isfinite(v)]
    return float(v.max()) if v.size else math.nan


def _mask_inputs(step_df: pd.DataFrame, micro: int) -> str:
    """The model inputs of micro-step ``micro`` that are masks holding -inf (rule 3), as "`name`, `name`"."""
    from ._locate import is_mask

    data = step_df[(step_df["micro_step"] == micro) & (step_df["phase"].astype(str) == "data")]
    rows = data[is_mask(data)]
    names = [
        str(a) if isinstance(a, str) else str(t) for a, t in zip(rows["arg"], rows["tensor"], strict=True)
    ]
    return ", ".join(f"`{n}`" for n in dict.fromkeys(names))


def _reach(step_df: pd.DataFrame, micro: int) -> str:
    out = step_df[
        (step_df["micro_step"] == micro)
        & (step_df["phase"].astype(str) == "forward")
        & (step_df["module"].astype(str) == "")
        & step_df["tensor"].astype(str).str.startswith("output")
    ]
    return (
        "reached the model's output"
        if _has(out, "posinf") or _has(out, "neginf")
        else "went on past the mask"
    )


def _has(rows: pd.DataFrame, kind: str) -> bool:
    return bool((rows[f"n_{kind}"].to_numpy() > 0).any()) if len(rows) else False


def _climb(records: pd.DataFrame, module: str, step: int) -> str:
    """'its output absmax grew every step since step S (a → b)' when the trace shows a climb of ≥ 2 steps."""
    rows = records[
        (records["module"].astype(str) == module)
        & (records["phase"].astype(str) == "forward")
        & records["tensor"].astype(str).str.startswith("output")
        & (records["step"] <= step)
    ]
    if len(rows) == 0:
        return ""
    per_step = rows.groupby("step", observed=True)["absmax"].max().sort_index()
    per_step = per_step[np.isfinite(per_step.to_numpy())]
    vals = per_step.to_numpy()
    if len(vals) < 3:
        return ""
    i = len(vals) - 1
    while i > 0 and vals[i - 1] < vals[i]:
        i -= 1
    if len(vals) - 1 - i < 2:
        return ""
    s0 = int(per_step.index[i])
    return f" Its output absmax had grown every step since step {s0} ({_g(vals[i])} → {_g(vals[-1])})."


def explain(
    records: pd.DataFrame,
    step_df: pd.DataFrame,
    row: pd.Series,
    fields: dict[str, Any],
    raw_kind: str,
    steps: pd.DataFrame | None,
    op: str | None = None,
) -> str:
    """One or two sentences on an :class:`~nantrace.Overflow`, with the numbers that matter."""
    step, micro, phase = fields["step"], fields["micro_step"], fields["phase"]
    module, mtype, call = fields["module"], fields["module_type"], fields["call"]
    tensor, dtype = fields["tensor"], str(fields["dtype"])
    what = {"nan": "NaN", "posinf": "+inf", "neginf": "-inf"}[raw_kind]
    where = f"step {step}" + (f", micro-step {micro}" if micro else "")
    name = f"`{module}`" if module else "the root model"
    dmax = dtype_max(dtype)
    limit = f"{dtype} overflows above {dmax:.6g} (torch.finfo(torch.{dtype}).max)"
    same_call = step_df[(step_df["micro_step"] == micro) & (step_df["call"] == call)]
    if phase == "data":
        n = int(row[f"n_{raw_kind}"])
        return (
            f"At {where} the model input `{tensor}` already held {n} {what} value(s) before any module ran: a data "
            f"fault, not the model. Check the data loader for this batch ({where}); "
            "e.g. log(0), division by zero or a corrupt sample."
        )
    if phase == "forward":
        mine = same_call[same_call["module"].astype(str) == module]
        inputs = mine[mine["tensor"].astype(str).str.startswith("input")]
        if module == "":
            inputs = step_df[(step_df["micro_step"] == micro) & (step_df["phase"].astype(str) == "data")]
        in_absmax = _g(_finite_absmax(inputs))
        own_code = str(row["module"]) != module
        if own_code:
            at = (
                f"its own forward code, between its submodules (first seen at `{row['tensor']}` of "
                f"`{row['module']}`; every submodule output before it was finite)"
            )
        elif op is not None:
            at = f"`{op}` inside its forward ({dtype})"
        else:
            at = f"its `{tensor}` ({dtype})"
        head = f"At {where}, {name} ({mtype}, call {call}) produced {what} in {at}"
        inputs_had_inf = _has(inputs, "posinf") or _has(inputs, "neginf")
        beyond = weights_beyond(records, module, step, dtype) if not inputs_had_inf else []
        if beyond:  # float32 weights above the output dtype's max: autocast's cast to it made them inf
            pdt = beyond[0][1]
            made = (
                "then inf·0 or inf−inf gives NaN"
                if raw_kind == "nan"
                else f"inf times its inputs gives {what}"
            )
            return (
                f"{head}, from finite inputs (input absmax {in_absmax}): its {pdt} weights exceed {dtype}'s "
                f"{dmax:.6g} ({weights_words(module, beyond)}), so autocast's cast to {dtype} made them inf; "
                f"{made}. Lower the learning rate, add weight decay or clip gradients so the weights stay well "
                f"below {dmax:.6g}; or keep {name} in float32 (call it inside torch.autocast(..., enabled=False) "
                "with a .float() input), or use bfloat16."
            )
        if raw_kind == "nan":
            if inputs_had_inf:
                cause = "from inputs holding inf but no NaN: inf−inf, 0·inf or inf/inf (e.g. normalising an overflowed row)"
            elif mtype in _MATMUL_TYPES and not own_code and not _wide(dtype):
                cause = (
                    f"from inputs holding no inf/NaN: for a {mtype} that points to non-finite weights, not to an "
                    f"op such as 0/0; under autocast a float32 weight above {dmax:.6g} becomes inf when cast to "
                    f"{dtype} (no optimizer row before step {step} shows one: check the absmax of {name}'s "
                    "weights, diagnose() reads it from a live trace)"
                )
            else:
                cause = "from inputs holding no inf/NaN: an invalid operation such as 0/0, sqrt/log of a negative, or a fully masked softmax row"
            return f"{head}, {cause}. Finite input absmax {in_absmax}."
        if inputs_had_inf:  # the -inf of a mask/bias input went on into values that are not a mask
            masks = _mask_inputs(step_df, micro)
            src = f"the -inf of the mask/bias input(s) {masks}" if masks else "an inf its inputs already held"
            return (
                f"{head}, from {src} (finite input absmax {in_absmax}): it {_reach(step_df, micro)}, so it "
                "is not an intended mask value that a softmax consumes but a fault. A mask's -inf belongs only in "
                "attention scores before a softmax; for other additive terms use a large finite negative value "
                "(torch.finfo(dtype).min). If that input is data, not a mask, rename it (names containing "
                "'mask' or 'bias' count as masks)."
            )
        climb = _climb(records, module, step)
        if _wide(dtype):  # float32/float64 already: a wider dtype is no cure
            advice = (
                f"Values beyond the {dtype} range mean a computation that blows up (exp or pow of a large "
                f"input, a growing residual or weight): clamp or rescale what feeds {name}, or lower the "
                "learning rate if it grew over steps."
            )
        else:
            advice = (
                f"Keep {name} in float32 (under autocast: call it inside torch.autocast(..., enabled=False) with "
                "a .float() input; in a .half() model: .float() it and its input), rescale what feeds it, or use "
                "bfloat16."
            )
        return f"{head}, from finite inputs (input absmax {in_absmax}); {limit}.{climb} {advice}"
    if phase == "loss":
        outs = step_df[
            (step_df["micro_step"] == micro)
            & (step_df["phase"].astype(str) == "forward")
            & (step_df["module"].astype(str) == "")
            & step_df["tensor"].astype(str).str.startswith("output")
        ]
        which = (
            "the loss" if str(tensor).startswith("loss") else "the gradient arriving at the model's outputs"
        )
        seen = (
            f"the model's outputs were finite (absmax {_g(_finite_absmax(outs))})"
            if len(outs)
            else "the model's outputs were not recorded (no traced forward in this step)"
        )
        head = f"At {where} {seen} but {which} was {what} ({dtype})."
        scale = float(row["scale"]) if "scale" in row else 1.0
        if not str(tensor).startswith("loss") and scale != 1.0:
            losses = step_df[
                (step_df["phase"].astype(str) == "loss")
                & step_df["tensor"].astype(str).str.startswith("loss")
            ]
            loss_ok = len(losses) == 0 or int(losses[["n_nan", "n_posinf", "n_neginf"]].to_numpy().sum()) == 0
            if loss_ok:
                return (
                    f"{head} The loss itself was finite: the gradient overflowed because it is multiplied by the loss "
                    f"scale {scale:g}. A GradScaler skips such a step and lowers the scale; if it keeps happening, "
                    "start from a lower init_scale or reduce the loss (e.g. a mean instead of a sum)."
                )
        return (
            f"{head} Compute the loss in float32 (e.g. F.cross_entropy(logits.float(), y)) and use log_softmax "
            "rather than log(softmax(...))."
        )
    if phase == "backward":
        gout = step_df[
            (step_df["micro_step"] == micro)
            & (step_df["phase"].astype(str).isin(["backward", "loss"]))
            & (step_df["module"].astype(str) == module)
            & step_df["tensor"].astype(str).str.startswith("grad_output")
        ]
        scale = float(row["scale"]) if "scale" in row else 1.0
        scaled = f", loss scale {scale:g}" if scale != 1.0 else ""
        if raw_kind == "nan":
            tail = (
                " Not an overflow (a lower loss scale does not remove it): an op whose derivative is infinite at "
                "the values it saw (log/log1p or sqrt at 0, x/0) under a torch.where/mask that discards its "
                "result still sends 0·inf = NaN back. Make its input safe before the op, or clamp it away from "
                "the singular point."
            )
        elif scale != 1.0:
            tail = " A GradScaler skips such a step and lowers the scale; only a persistent run of them is a fault."
        elif _wide(dtype):
            tail = f" Clip or rescale the gradients that flow into {name} (or the loss)."
        else:
            tail = f" Keep {name} in float32 or clip/rescale what flows into it."
        gdtypes = [str(d) for d in gout["dtype"].astype(str).unique()]
        narrow = min(gdtypes, key=dtype_max) if gdtypes else dtype
        if (
            dtype_max(narrow) < dmax
        ):  # e.g. a float32 weight.grad computed from float16 gradients under autocast
            limit = (
                f"computed from {narrow} gradients, which overflow above {dtype_max(narrow):.6g} "
                f"(torch.finfo(torch.{narrow}).max)"
            )
        if (
            raw_kind == "nan"
        ):  # 0·inf, inf−inf, 0/0, sqrt/log of a negative: the dtype's range is not the cause
            return (
                f"At {where}, the backward of {name} ({mtype}) turned finite incoming gradients (grad_output "
                f"absmax {_g(_finite_absmax(gout))}{scaled}) into NaN in `{tensor}` ({dtype}): an invalid "
                f"operation in its backward (0·inf, inf−inf, 0/0, sqrt/log of a negative).{tail}"
            )
        return (
            f"At {where}, the backward of {name} ({mtype}) turned finite incoming gradients (grad_output absmax "
            f"{_g(_finite_absmax(gout))}{scaled}) into {what} in `{tensor}` ({dtype}; {limit}).{tail}"
        )
    tiny = float(torch.finfo(getattr(torch, dtype)).smallest_normal) if not math.isnan(dmax) else math.nan
    return (
        f"At {where}, gradients were finite but optimizer.step() made `{tensor}` of {name} ({mtype}) {what} "
        f"({dtype}). In {dtype} small optimizer constants such as Adam's eps=1e-8 and squared gradients round to 0 "
        f"(smallest normal {_g(tiny)}): keep float32 master weights, or raise eps to ≥1e-4."
    )


def headroom_table(records: pd.DataFrame, limit: float = FP16_MAX, top: int = 5) -> pd.DataFrame:
    """Modules with the least headroom: ``log2(limit / absmax)`` bits (fp16 limit 65504), smallest first.

    Columns: ``module, module_type, absmax, headroom_bits``; over forward rows (activations; gradients carry the
    loss scale). A module that held ±inf has ``absmax = inf`` and ``headroom_bits = -inf`` (it overflowed).
    """
    rows = records[records["phase"].astype(str) == "forward"]
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
    return g.sort_values("headroom_bits").head(top).reset_index(drop=True)


def _headroom_words(absmax: float, bits: float) -> str:
    if math.isinf(absmax):
        return "overflowed (held inf)"
    return f"absmax {absmax:.4g}, {bits:+.1f} bits"


def lowest_rank_steps(steps: pd.DataFrame) -> tuple[pd.DataFrame, int | None]:
    """``steps`` of the lowest rank and that rank when the table holds several ranks (a merged trace: loss and
    loss scale are per rank), else ``(steps, None)``."""
    if "rank" not in steps.columns or not len(steps) or steps["rank"].nunique() < 2:
        return steps, None
    low = int(steps["rank"].min())
    return steps[steps["rank"].to_numpy() == low].reset_index(drop=True), low


def _summary(tr: Trace) -> dict[str, Any]:
    rec = tr.records
    st = tr.steps
    dtypes = rec["dtype"].astype(str).value_counts().to_dict() if len(rec) else {}
    # a merged trace has a row per step and rank: count each step once (skipped when any rank skipped it)
    skipped = int(st.loc[st["skipped"].fillna(False).astype(bool), "step"].nunique()) if len(st) else 0
    return {
        "steps": int(st["step"].nunique()) if len(st) else 0,
        "records": len(rec),
        "dtypes": dtypes,
        "skipped": skipped,
        "overflow": tr.first_overflow(),
        "headroom": headroom_table(rec),
    }


def trace_text(tr: Trace) -> str:
    """Plain-text summary: steps, dtype mix, first overflow, least fp16 headroom."""
    s = _summary(tr)
    mix = ", ".join(f"{k} {v}" for k, v in s["dtypes"].items()) or "none"
    lines = [
        f"<nantrace.Trace of {tr._model_class}: {s['steps']} steps, {s['records']} records, "
        f"{s['skipped']} skipped by the scaler>",
        f"dtypes: {mix}",
        f"first overflow: {s['overflow'] if s['overflow'] is not None else 'none (every recorded value finite)'}",
    ]
    hr = s["headroom"]
    if len(hr):
        lines.append("least fp16 headroom (bits = log2(65504 / absmax)):")
        for r in hr.itertuples():
            lines.append(
                f"  {r.module or '(root)'} ({r.module_type}): {_headroom_words(r.absmax, r.headroom_bits)}"
            )
    return "\n".join(lines)


def trace_html(tr: Trace) -> str:
    """HTML summary for notebooks; every string is escaped, the text repr is the fallback inside <pre>."""
    s = _summary(tr)
    e = html.escape
    ov = s["overflow"]
    mix = ", ".join(f"{e(str(k))} {v}" for k, v in s["dtypes"].items()) or "none"
    rows = "".join(
        f"<tr><td>{e(r.module or '(root)')}</td><td>{e(r.module_type)}</td>"
        f"<td>{'inf' if math.isinf(r.absmax) else f'{r.absmax:.4g}'}</td>"
        f"<td>{'overflowed' if math.isinf(r.absmax) else f'{r.headroom_bits:+.1f}'}</td></tr>"
        for r in s["headroom"].itertuples()
    )
    ov_html = (
        "<p><b>No overflow</b>: every recorded value was finite.</p>"
        if ov is None
        else (
            f"<p><b>First overflow</b>: step {ov.step}, micro-step {ov.micro_step}, {e(ov.phase)}, "
            f"<code>{e(ov.module or '(root)')}</code> ({e(ov.module_type)}, call {ov.call}), "
            f"<code>{e(ov.tensor)}</code>, {e(ov.kind)}, {e(str(ov.dtype))}</p><p>{e(str(ov))}</p>"
        )
    )
    table = (
        "<table><thead><tr><th>module</th><th>type</th><th>absmax</th><th>fp16 headroom (bits)</th></tr></thead>"
        f"<tbody>{rows}</tbody></table>"
        if rows
        else ""
    )
    return (
        f'<div class="nantrace-trace"><pre style="display:none">{e(trace_text(tr))}</pre>'
        f"<p><b>nantrace.Trace</b> of <code>{e(tr._model_class)}</code>: {s['steps']} steps, "
        f"{s['records']} records, {s['skipped']} skipped by the scaler; dtypes: {mix}</p>{ov_html}{table}</div>"
    )
