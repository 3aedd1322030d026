"""Words and tables for people: the text/HTML reprs of a trace, and the report ``nantrace report`` and
``nantrace run`` print.

Presentation only: it reads run views and the analysis's answers and never imports the facade (the report
functions take any object with the ``Trace`` methods they call).
"""

from __future__ import annotations

import html
import math
import sys
import textwrap
from pathlib import Path
from typing import Any, TextIO

import pandas as pd

from ._explain import first_overflow
from ._fmt import num
from ._ranges import headroom_table, lowest_rank_steps
from ._view import RunView

__all__ = ["overflow_runs", "print_report", "scale_history", "summary_lines", "trace_html", "trace_text"]


def _headroom_words(absmax: float, bits: float) -> str:
    if math.isinf(absmax):
        return "overflowed (held inf)"
    return f"absmax {absmax:.4g}, {bits:+.1f} bits"


def _summary(view: RunView) -> dict[str, Any]:
    rec = view.records
    st = view.steps
    dtypes = rec["dtype"].astype(str).value_counts().to_dict() if len(rec) else {}
    # a merged trace has a row per step and rank: count each step once (skipped when any rank skipped it)
    skipped = int(st.loc[st["skipped"].fillna(False).astype(bool), "step"].nunique()) if len(st) else 0
    scaler = bool(len(st)) and bool(st["skipped"].notna().any())  # a GradScaler ran (skipped is <NA> without)
    return {
        "scaler": scaler,
        "steps": int(st["step"].nunique()) if len(st) else 0,
        "records": len(rec),
        "dtypes": dtypes,
        "skipped": skipped,
        "overflow": first_overflow(view),
        "headroom": headroom_table(rec, ops=view.ops),
    }


def trace_text(view: RunView) -> str:
    """Plain-text summary: steps, dtype mix, first overflow, least fp16 headroom."""
    s = _summary(view)
    mix = ", ".join(f"{k} {v}" for k, v in s["dtypes"].items()) or "none"
    lines = [
        f"<nantrace.Trace of {view.meta.model_class}: {s['steps']} steps, {s['records']} records"
        + (f", {s['skipped']} skipped by the scaler>" if s["scaler"] else ", no GradScaler>"),
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


def trace_html(view: RunView) -> str:
    """HTML summary for notebooks; every string is escaped, the text repr is the fallback inside <pre>."""
    s = _summary(view)
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
        f'<div class="nantrace-trace"><pre style="display:none">{e(trace_text(view))}</pre>'
        f"<p><b>nantrace.Trace</b> of <code>{e(view.meta.model_class)}</code>: {s['steps']} steps, "
        f"{s['records']} records, "
        + (f"{s['skipped']} skipped by the scaler" if s["scaler"] else "no GradScaler")
        + f"; dtypes: {mix}</p>{ov_html}{table}</div>"
    )


# ------------------------------------------------------------------------------------------- report
def scale_history(steps: pd.DataFrame) -> str:
    """'65536 (steps 0-2) → 32768 (step 3, skipped) → …' compressed runs of equal loss scale."""
    if len(steps) == 0 or steps["scale"].isna().all():
        return "no GradScaler (no loss scale recorded)"
    parts: list[str] = []
    scales = steps["scale"].tolist()
    skipped = steps["skipped"].fillna(False).tolist()
    ids = steps["step"].tolist()
    i = 0
    while i < len(scales):
        j = i
        while j + 1 < len(scales) and scales[j + 1] == scales[i]:
            j += 1
        span = f"step {ids[i]}" if i == j else f"steps {ids[i]}-{ids[j]}"
        n_skip = sum(skipped[i : j + 1])
        note = f", {n_skip} skipped" if n_skip else ""
        parts.append(f"{num(scales[i])} ({span}{note})")
        i = j + 1
    if len(parts) > 8:
        parts = [*parts[:4], f"… {len(parts) - 7} more …", *parts[-3:]]
    return " → ".join(parts)


def summary_lines(tr: Any) -> list[str]:
    every = tr.steps
    st, low = lowest_rank_steps(every)  # a merged trace: each step once; loss and scale of the lowest rank
    of_rank = "" if low is None else f" (rank {low})"
    lines = [f"steps: {every['step'].nunique() if len(every) else 0}, records: {len(tr.records)}"]
    if len(st):
        skipped = sorted(set(every.loc[every["skipped"].fillna(False).astype(bool), "step"].tolist()))
        lines.append(f"loss scale{of_rank}: {scale_history(st)}")
        lines.append(
            f"skipped steps ({len(skipped)}): {', '.join(map(str, skipped[:30]))}{' …' if len(skipped) > 30 else ''}"
            if skipped
            else "skipped steps: none"
        )
        loss = st["loss"].to_numpy()
        finite = [v for v in loss if math.isfinite(v)]
        if finite:
            lines.append(f"loss{of_rank}: first {loss[0]:.4g}, last {loss[-1]:.4g}, min {min(finite):.4g}")
        elif not any(math.isinf(v) for v in loss):  # NaN in steps.loss means no loss was seen in that step
            lines.append(f"loss{of_rank}: not recorded (no scaler.scale(loss) or tr.step(loss=...) was seen)")
        else:
            lines.append(f"loss{of_rank}: never finite (first {loss[0]:.4g}, last {loss[-1]:.4g})")
    return lines


def overflow_runs(ovs: pd.DataFrame) -> list[str]:
    """Consecutive steps with the same first producer, one line each: 'steps 28-49  forward  `m` output inf'."""
    lines: list[str] = []
    rows = [tuple(r) for r in ovs[["step", "phase", "module", "tensor", "kind"]].itertuples(index=False)]
    i = 0
    while i < len(rows):
        j = i
        while j + 1 < len(rows) and rows[j + 1][1:] == rows[i][1:] and rows[j + 1][0] == rows[j][0] + 1:
            j += 1
        span = f"step {rows[i][0]}" if i == j else f"steps {rows[i][0]}-{rows[j][0]}"
        _, phase, module, tensor, kind = rows[i]
        lines.append(f"  {span:<13} {phase:<9} `{module}` {tensor} {kind}")
        i = j + 1
    return lines


def _diagnosis_text(tr: Any) -> str | None:
    diagnose = getattr(tr, "diagnose", None)
    if diagnose is None:
        return None
    return str(diagnose())


def print_report(tr: Any, path: Path | None, file: TextIO | None = None) -> Any:
    """Print the report of ``tr`` (saved at ``path``, if known) to ``file`` (default stdout): summary, first
    overflow, steps with a non-finite value by first producer, and the diagnosis. Returns the first overflow."""
    out = sys.stdout if file is None else file
    ov = tr.first_overflow()
    if path is not None:
        print(f"trace: {path}", file=out)
    if tr.header:
        print(
            f"model: {tr.header.get('model_class')}, nantrace {tr.header.get('nantrace')}, "
            f"torch {tr.header.get('torch')}",
            file=out,
        )
    else:
        print(f"model: {tr.model_class}", file=out)
    world, ranks = getattr(tr, "world_size", 1), getattr(tr, "ranks", [0])
    summary_of = tr
    if world > 1 and len(ranks) > 1:
        shown = ov.rank if ov is not None else ranks[0]
        print(
            f"ranks: {', '.join(map(str, ranks))} of world size {world} (merged); summary of rank {shown}",
            file=out,
        )
        summary_of = tr.rank_view(shown)
    elif world > 1:
        print(f"rank: {ranks[0]} of world size {world} (this rank's part only)", file=out)
    for line in summary_lines(summary_of):
        print(line, file=out)
    print(file=out)
    if ov is None:
        print("first overflow: none: every recorded value was finite.", file=out)
    else:
        who = f"rank {ov.rank}, " if world > 1 else ""
        got = " (received through the gradient reduction, not produced here)" if ov.propagated else ""
        print(
            f"first overflow: {who}step {ov.step}, {ov.phase}, module `{ov.module}` ({ov.module_type}), "
            f"{ov.kind}{got}",
            file=out,
        )
        print(textwrap.indent(str(ov), "  "), file=out)  # every line of the explanation under the heading
        ovs = tr.overflows(messages=False)  # the runs of producers only: no explanation of every step
        if len(ovs) > 1:
            print(f"\nsteps with a non-finite value ({len(ovs)}), by first producer:", file=out)
            print("\n".join(overflow_runs(ovs)), file=out)
    diag = _diagnosis_text(tr)
    if diag:
        print(f"\n{diag}", file=out)
    return ov
