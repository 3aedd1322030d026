"""The locator's words: :class:`~nantrace.Overflow` objects, each with an explanation written from the facts of
its event (the rows of its step, the run's history, and the live model's handle where there is one).

:func:`first_overflow` and :func:`overflows` are the only way events become ``Overflow`` s, so the two give the
same event the same message.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np
import pandas as pd
import torch

from ._errors import NantraceError
from ._evidence import (
    KEPT_DERIVATIVE_FIX,
    WEIGHTS_HELD,
    OpEvidence,
    class_advice,
    handed_in,
    headline,
    kept_derivative,
    loss_advice,
    mean_over_nothing,
    op_evidence,
    outputs_words,
    scaled_run,
    unreachable_update,
    weights_beyond_event,
    written_facts,
)
from ._fmt import module_label, num
from ._hooks import CAST_OP
from ._locate import Event, Finding, find
from ._masks import is_mask, lowest_masks
from ._overflow import Overflow
from ._ranges import finite_absmax, last_optimizer_row, own_parameters
from ._repro import captured_call
from ._schema import KIND_WORDS, OVERFLOW_COLUMNS, dtype_max, is_wide, wanted_kinds
from ._view import RunView

__all__ = [
    "changed_outside",
    "explained",
    "first_overflow",
    "overflows",
    "samples_words",
    "weights_words",
]


def weights_words(
    module: str, beyond: list[tuple[str, str, float, int]], records: pd.DataFrame, step: int
) -> str:
    """ "`0.weight` absmax 5.887e+06 since step 2; `0.bias` …" for :func:`~nantrace._ranges.weights_beyond`'s rows
    (``records``, ``step``: the event's, for a value read from the live model: what its last optimizer row said)."""
    prefix = f"{module}." if module else ""
    return "; ".join(
        f"`{prefix}{t}` absmax {num(a)} " + _since(records, module, t, a, s, step) for t, _, a, s in beyond
    )


def _since(records: pd.DataFrame, module: str, tensor: str, absmax: float, since: int, step: int) -> str:
    if since >= 0:
        return f"since step {since}"
    last = last_optimizer_row(records, module, tensor, step)
    if last is None:
        return "in the live model (no optimizer row records it)"
    at, shown = int(last["step"]), float(last["absmax"])
    if shown == absmax:
        return f"in the live model, as after optimizer.step() of step {at}"
    return (
        f"in the live model, where its last optimizer row (step {at}) showed {num(shown)}: it changed "
        "outside optimizer.step()"
    )


def changed_outside(
    records: pd.DataFrame, module: str, beyond: list[tuple[str, str, float, int]], step: int
) -> bool:
    """True when a live-model value of ``beyond`` differs from its last optimizer row: written outside
    ``optimizer.step()`` (a manual edit, a state-dict load)."""
    for t, _, a, s in beyond:
        last = last_optimizer_row(records, module, t, step) if s < 0 else None
        if last is not None and float(last["absmax"]) != a:
            return True
    return False


def _has(rows: pd.DataFrame, kind: str) -> bool:
    return bool((rows[f"n_{kind}"].to_numpy() > 0).any()) if len(rows) else False


def _where(ev: Event) -> str:
    step, micro = ev.fields["step"], ev.fields["micro_step"]
    return f"step {step}" + (f", micro-step {micro}" if micro else "")


# ---------------------------------------------------------------------------------------------- per phase
def samples_words(view: RunView, rank: int, step: int, micro: int, tensor: str) -> str:
    """``"samples 3 and 7 of the batch (2 of 16 along dim 0)"`` for a model input that held inf/NaN, from the
    recorded per-sample flags (:mod:`nantrace._samples`); ``""`` when they were not recorded."""
    for r, s, m, p, n, first in view.meta.bad_samples:
        if (r, s, m, p) == (rank, step, micro, tensor) and n:
            shown = ", ".join(map(str, first))
            more = f", … ({n} in all)" if n > len(first) else ""
            return f"sample{'s' if n > 1 else ''} {shown}{more} of the batch (index along dim 0)"
    return ""


def _data(view: RunView, ev: Event) -> str:
    n = int(ev.row[f"n_{ev.raw_kind}"])
    where = _where(ev)
    f = ev.fields
    which = samples_words(view, ev.rank, int(f["step"]), int(f["micro_step"]), str(f["tensor"]))
    look = f"look at {which}" if which else "e.g. log(0), division by zero or a corrupt sample"
    return (
        f"At {where} the model input `{f['tensor']}` already held {n} {KIND_WORDS[ev.raw_kind]} value(s) "
        f"before any module ran: a data fault, not the model. Check the data loader for this batch ({where}); "
        f"{look}."
    )


def _handed(view: RunView, ev: Event) -> str:
    """For a value the loop handed to a submodule it called itself (:func:`handed_in`)."""
    n = int(ev.row[f"n_{ev.raw_kind}"])
    f = ev.fields
    where, name = _where(ev), module_label(str(f["module"]))
    return (
        f"At {where} the loop called {name} itself, not inside a call of the model, and its `{f['tensor']}` "
        f"already held {n} {KIND_WORDS[ev.raw_kind]} value(s) when the call began: the value was made outside the "
        f"model (the data, or the loop's own code before this call), not by a module. Check the batch of {where} "
        "and what the loop computes before it calls this module."
    )


def _mask_inputs(step_df: pd.DataFrame, micro: int) -> str:
    """The model inputs of micro-step ``micro`` that are masks holding -inf (rule 3), as "`name`, `name`"."""
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
    inf = _has(out, "posinf") or _has(out, "neginf")
    return "reached the model's output" if inf else "went on past the mask"


def _climb(records: pd.DataFrame, module: str, step: int) -> str:
    """'its output absmax grew every step since step S (a → b)' when the trace shows a climb of ≥ 2 steps, and
    which step made most of it when its one factor exceeds that of all the earlier steps of the climb together
    (a jump, not a steady climb)."""
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
    text = f" Its output absmax had grown every step since step {s0} ({num(vals[i])} → {num(vals[-1])})"
    last, before = vals[-1] / vals[-2], vals[-2] / vals[i]
    if vals[i] > 0 and last > before:  # one step made more of the climb than all the others together
        text += (
            f", most of it at step {int(per_step.index[-1])}: ×{num(last)} in that one step against ×{num(before)} "
            "over the steps before"
        )
    return text + "."


def _only_nan_out(ev: Event) -> bool:
    """The op made inf, and the call's output holds it only as the NaN it turned into (inf·0, inf−inf)."""
    row = ev.row
    return ev.raw_kind != "nan" and int(row["n_nan"]) > 0 and int(row[f"n_{ev.raw_kind}"]) == 0


def _forward_inputs(ev: Event) -> pd.DataFrame:
    step_df, micro, call, module = (
        ev.step_rows,
        ev.fields["micro_step"],
        ev.fields["call"],
        ev.fields["module"],
    )
    if module == "":
        mine = step_df[(step_df["micro_step"] == micro) & (step_df["phase"].astype(str) == "data")]
    else:
        mine = step_df[
            (step_df["micro_step"] == micro)
            & (step_df["call"] == call)
            & (step_df["module"].astype(str) == module)
        ]
        mine = mine[mine["tensor"].astype(str).str.startswith("input")]
    return mine[~lowest_masks(mine)] if len(mine) else mine  # a finfo.min mask is no value it computed from


def _forward_head(ev: Event, op_dtype: str | None = None, hook: str | None = None) -> tuple[str, bool]:
    """The opening sentence; ``op_dtype`` is the dtype the producing op computed in, when the evidence knows it;
    ``hook``: the module's forward hook the op ran inside."""
    f, row = ev.fields, ev.row
    own_code = str(row["module"]) != f["module"]
    if own_code:
        line = f" at {ev.source}" if ev.op is not None and ev.source else ""
        by = f"`{ev.op}`{line} in " if ev.op is not None else ""
        code = f"the {hook}" if hook is not None else "its own forward code"
        at = (
            f"{by}{code}, between its submodules (first seen at `{row['tensor']}` of "
            f"`{row['module']}`; every submodule output before it was finite)"
        )
    elif ev.op is not None:
        made_in = op_dtype or str(f["dtype"])
        out = "" if made_in == str(f["dtype"]) else f"; the call's output is {f['dtype']}"
        line = f" at {ev.source}" if ev.source else ""
        inside = f"the {hook}" if hook is not None else "its forward"
        at = f"`{ev.op}`{line} inside {inside} ({made_in}{out})"
    else:
        at = f"its `{f['tensor']}` ({f['dtype']})"
    who = module_label(str(f["module"]))
    return (
        f"At {_where(ev)}, {who} ({f['module_type']}, call {f['call']}) produced {KIND_WORDS[ev.raw_kind]} in {at}",
        own_code,
    )


def _forward_nan_cause(view: RunView, ev: Event, inputs_had_inf: bool, own_code: bool) -> str:
    dtype, module = str(ev.fields["dtype"]), str(ev.fields["module"])
    if inputs_had_inf:
        return "from inputs holding inf but no NaN: inf−inf, 0·inf or inf/inf (e.g. normalising an overflowed row)"
    known = view.meta.builtin_modules
    params = own_parameters(view.records, module) if known is not None and module in known else []
    if params and not own_code and not is_wide(dtype):
        prefix = f"{module}." if module else ""
        owned = ", ".join(f"`{prefix}{p}`" for p in params)
        return (
            f"from inputs holding no inf/NaN: a torch.nn layer with no code of its own and its own parameters "
            f"({owned}) points to non-finite weights, not to an op such as 0/0; under autocast a float32 weight above {num(dtype_max(dtype))} becomes inf when cast "
            f"to {dtype} (no optimizer row before step {ev.fields['step']} shows one: check the absmax of "
            f"{module_label(str(ev.fields['module']))}'s weights, diagnose() reads it from a live trace)"
        )
    return "from inputs holding no inf/NaN: an invalid operation such as 0/0, sqrt/log of a negative, or a fully masked softmax row"


def _forward(view: RunView, ev: Event) -> str:
    """The headline, then one line of what the call did, then the evidence and advice of the op's class."""
    f = ev.fields
    ov = Overflow(**f)
    oe = op_evidence(view, ov)
    assert oe is not None
    lines = [headline(ov, oe), *_forward_body(view, ev, oe)]
    return "\n".join(lines)


def _forward_body(view: RunView, ev: Event, oe: OpEvidence) -> list[str]:
    f = ev.fields
    step, micro, module = int(f["step"]), int(f["micro_step"]), str(f["module"])
    dtype = oe.dtype if oe.op is not None else str(f["dtype"])  # the dtype the producing op computed in
    name, dmax, what = module_label(module), dtype_max(dtype), KIND_WORDS[ev.raw_kind]
    inputs = _forward_inputs(ev)
    in_absmax = num(finite_absmax(inputs))
    # from finite inputs (input absmax 1.5); token ids are not recorded (no floating-point input, no absmax)
    finite_in = (
        f"finite inputs (input absmax {in_absmax})"
        if len(inputs)
        else "inputs with no recorded floating-point tensor (token ids, indices)"
    )
    head, own_code = _forward_head(ev, oe.dtype if oe.op is not None else None, oe.hook)
    inputs_had_inf = _has(inputs, "posinf") or _has(inputs, "neginf")
    beyond = weights_beyond_event(view, Overflow(**f))[0]
    facts = oe.fact_lines() if oe.op is not None else []
    if beyond:  # float32 weights above the output dtype's max: autocast's cast to it made them inf
        made = (
            "then inf·0 or inf−inf gives NaN"
            if ev.raw_kind == "nan" or _only_nan_out(ev)
            else f"inf times its inputs gives {what}"
        )
        words = weights_words(module, beyond, view.records, step)
        fix = (
            "Find what wrote the weights outside optimizer.step() (a manual edit, a state-dict load, a weight "
            "average) and keep them"
            if changed_outside(view.records, module, beyond, step)
            else "Lower the learning rate, add weight decay or clip gradients so the weights stay"
        )
        return [
            f"{head}, from {finite_in}: its {beyond[0][1]} weights exceed {dtype}'s "
            f"{num(dmax)} ({words}), so autocast's cast to {dtype} made them inf; {made}.",
            *facts,
            f"{fix} well below {num(dmax)}; or keep {name} in float32 (call it inside torch.autocast(..., "
            "enabled=False) with a .float() input), or use bfloat16.",
        ]
    if oe.what == WEIGHTS_HELD:  # it computed from its own weights, which already held the value
        return [
            f"{head}, from {finite_in}: {oe.because.replace('its own parameter', 'its parameter', 1)}.",
            *facts[1:],  # the operand lines (the first names the op, said above)
            *class_advice(oe, module, scaled=scaled_run(view)),
        ]
    leak = inputs_had_inf and ev.raw_kind != "nan"  # the -inf of a mask/bias input went on into values
    if oe.op_class in ("singular", "invalid", "mask_arithmetic") and oe.op is not None and not leak:
        return [
            f"{head}, from inputs of finite absmax {in_absmax}: {oe.what}.",
            *facts,
            *class_advice(oe, module, scaled=scaled_run(view)),
        ]
    if ev.raw_kind == "nan":
        cause = _forward_nan_cause(view, ev, inputs_had_inf, own_code)
        fixes = class_advice(oe, module, scaled=scaled_run(view))
        return [f"{head}, {cause}.", f"Finite input absmax {in_absmax}.", *facts, *fixes]
    if leak:  # the -inf of a mask/bias input went on into values that are not a mask
        masks = _mask_inputs(ev.step_rows, micro)
        src = f"the -inf of the mask/bias input(s) {masks}" if masks else "an inf its inputs already held"
        return [
            f"{head}, from {src} (finite input absmax {in_absmax}): it {_reach(ev.step_rows, micro)}, so it "
            "is not an intended mask value that a softmax consumes but a fault.",
            *facts,
            "A mask's -inf belongs only in attention scores before a softmax; for other additive terms use a large "
            "finite negative value (torch.finfo(dtype).min). If that input is data, not a mask, rename it (names "
            "containing 'mask' or 'bias' count as masks).",
        ]
    limit = f"{dtype} overflows above {num(dmax)} (torch.finfo(torch.{dtype}).max)"
    climb = _climb(_local(view), module, step)
    # a reduction's or a matmul's own fix, from its operands
    extra = class_advice(oe, module, scaled=scaled_run(view))
    if oe.op_class == "reduction" or oe.hook is not None:  # a hook's op: fixing the hook is the advice
        advice = extra
    elif dtype_max(dtype) >= dtype_max(
        "bfloat16"
    ):  # float32's range already (bfloat16 too): no wider dtype cures
        advice = [
            f"Values beyond the {dtype} range mean a computation that blows up (exp or pow of a large "
            f"input, a growing residual or weight): clamp or rescale what feeds {name}, or lower the "
            "learning rate if it grew over steps."
        ]
    else:
        advice = [
            f"Keep {name} in float32 (under autocast: call it inside torch.autocast(..., enabled=False) with "
            "a .float() input; in a .half() model: .float() it and its input), rescale what feeds it, or use "
            "bfloat16."
        ]
    if oe.op_class != "reduction" and oe.hook is None:
        advice = [*extra, *advice]
    written, find_writer = written_facts(view, Overflow(**f), oe)
    lines = [f"{w[0].upper()}{w[1:]}." for w in written]
    if find_writer is not None:
        advice.insert(0, find_writer)
    return [
        f"{head}, from {finite_in}; {limit}.{climb}",
        *facts,
        *lines,
        *advice,
    ]


def _loss(ev: Event) -> str:
    f, step_df = ev.fields, ev.step_rows
    micro, tensor = f["micro_step"], str(f["tensor"])
    outs = step_df[
        (step_df["micro_step"] == micro)
        & (step_df["phase"].astype(str) == "forward")
        & (step_df["module"].astype(str) == "")
        & step_df["tensor"].astype(str).str.startswith("output")
    ]
    which = "the loss" if tensor.startswith("loss") else "the gradient arriving at the model's outputs"
    seen = (
        f"the model's outputs {outputs_words(outs)}"
        if len(outs)
        else "the model's outputs were not recorded (no traced forward in this step)"
    )
    head = f"At {_where(ev)} {seen} but {which} was {KIND_WORDS[ev.raw_kind]} ({f['dtype']})."
    scale = float(ev.row["scale"]) if "scale" in ev.row else 1.0
    if not tensor.startswith("loss") and scale != 1.0:
        losses = step_df[
            (step_df["phase"].astype(str) == "loss") & step_df["tensor"].astype(str).str.startswith("loss")
        ]
        loss_ok = len(losses) == 0 or int(losses[["n_nan", "n_posinf", "n_neginf"]].to_numpy().sum()) == 0
        if loss_ok:
            return (
                f"{head} The loss itself was finite: the gradient overflowed because it is multiplied by the loss "
                f"scale {num(scale)}. A GradScaler skips such a step and lowers the scale; if it keeps happening, "
                "start from a lower init_scale or reduce the loss (e.g. a mean instead of a sum)."
            )
    if tensor.startswith("loss") and ev.raw_kind == "nan":
        grads = step_df[
            (step_df["micro_step"] == micro)
            & (step_df["phase"].astype(str) == "loss")
            & step_df["tensor"].astype(str).str.startswith("grad_output")
        ]
        n = mean_over_nothing(grads)
        if n is not None:
            return (
                f"{head}\nThe gradient arriving at the model's outputs was exactly 0 in all {n} elements: no output "
                "element contributed, so the loss was a mean over zero elements (0/0: every label `ignore_index`, "
                "an empty mask). Skip such a batch or divide by `count.clamp_min(1)`."
            )
    if not tensor.startswith("loss"):
        return f"{head} Check the targets and any log, division or empty reduction in the loss."
    return f"{head} {loss_advice(outs, str(f['dtype']), 'nan' if ev.raw_kind == 'nan' else 'inf')[0]}"


def _backward_tail(view: RunView, ev: Event, scale: float, name: str) -> str:
    if ev.raw_kind == "nan":
        scaled = " (a lower loss scale does not remove it)" if scale != 1.0 and not math.isnan(scale) else ""
        if ev.op is None:  # no forward value was discarded: a derivative at a value the forward kept
            return f" Not an overflow{scaled}: {kept_derivative(view)}. {KEPT_DERIVATIVE_FIX}"
        return (
            f" Not an overflow{scaled}: an op whose derivative is not finite at "
            "the values it saw (inf for log/log1p or sqrt at 0 and x/0, NaN for sqrt/log of a negative) under a "
            "torch.where/mask that discards its result still sends 0·inf or 0·NaN = NaN back. Make its input safe "
            "before the op, or clamp it away from the singular point."
        )
    if scale != 1.0:
        return (
            " A GradScaler skips such a step and lowers the scale; only a persistent run of them is a fault."
        )
    if is_wide(str(ev.fields["dtype"])):
        return f" Clip or rescale the gradients that flow into {name} (or the loss)."
    return f" Keep {name} in float32 or clip/rescale what flows into it."


def _discarded(ev: Event) -> str:
    """For a backward NaN: the forward op whose non-finite value the call's output discarded (``ops.reaches``
    False), named by the locator as the event's op; one line, or "" when there is none."""
    if ev.op is None:
        return ""
    line = f" at {ev.source}" if ev.source else ""
    return (
        f"\nIts forward held a non-finite value made by `{ev.op}`{line} that the forward discarded (the output is "
        f"the same whatever finite value it had); the backward still goes through `{ev.op}`, whose derivative "
        "there is not finite, and the zero gradient the discarding sends back times it is NaN."
    )


def _carried_grad(view: RunView, ev: Event) -> str | None:
    """The explanation of a ``.grad`` that already held the value before this step's backward added to it, or
    None. It needs the step's ``stale_grads`` count above 0 (some ``.grad`` held inf/NaN when the backward
    began) and finite incoming gradients of the module; the ``.grad`` of the same parameter recorded at an
    earlier step holding the kind names when it came in."""
    f = ev.fields
    tensor, step, module = str(f["tensor"]), int(f["step"]), str(f["module"])
    steps = view.steps
    if not tensor.endswith(".grad") or "stale_grads" not in steps.columns:
        return None
    here = steps[steps["step"].to_numpy() == step]
    if not len(here) or not float(here["stale_grads"].iloc[0]) > 0:
        return None
    step_df = ev.step_rows
    gout = step_df[
        (step_df["micro_step"] == f["micro_step"])
        & (step_df["phase"].astype(str).isin(["backward", "loss"]))
        & (step_df["module"].astype(str) == module)
        & step_df["tensor"].astype(str).str.startswith("grad_output")
    ]
    if not len(gout) or int(gout[["n_nan", "n_posinf", "n_neginf"]].to_numpy().sum()):
        return None
    rec = view.records
    col = "n_nan" if ev.raw_kind == "nan" else f"n_{ev.raw_kind}"
    earlier = rec[
        (rec["step"].to_numpy() < step)
        & (rec["phase"].astype(str).to_numpy() == "backward")
        & (rec["module"].astype(str).to_numpy() == module)
        & (rec["tensor"].astype(str).to_numpy() == tensor)
        & (rec[col].to_numpy() > 0)
    ]
    n = int(float(here["stale_grads"].iloc[0]))
    name, what = module_label(module), KIND_WORDS[ev.raw_kind]
    since = f" It held {what} at step {int(earlier['step'].max())} already." if len(earlier) else ""
    return (
        f"step {step} backward: `{tensor}` of {name} already held {what} before this step's backward ({f['dtype']})\n"
        f"At {_where(ev)}, the `.grad` of {n} parameter(s) already held inf/NaN when the backward began "
        f"(steps.stale_grads), and the gradients arriving at {name} were finite (grad_output absmax "
        f"{num(finite_absmax(gout))}): this backward added finite values to a `.grad` that was not reset, it did "
        f"not make the {what}.{since}\n"
        "Reset the gradients every step: `optimizer.zero_grad()` resets only the optimizer's own parameters, "
        "`model.zero_grad()` every parameter of the model; and find the step that first made the value: "
        "tr.first_overflow()."
    )


def _backward(view: RunView, ev: Event) -> str:
    carried = _carried_grad(view, ev)
    if carried is not None:
        return carried
    ov = Overflow(**ev.fields)
    oe = op_evidence(view, ov)
    if oe is not None and oe.op_class == "singular":  # a derivative infinite by itself (backward_bound)
        return headline(ov, oe) + "\n" + _singular_backward(view, ev, oe)
    return headline(ov, oe) + "\n" + _backward_body(view, ev)


def _singular_backward(view: RunView, ev: Event, oe: OpEvidence) -> str:
    """A backward inf that no product of the recorded magnitudes reaches (:func:`backward_bound`)."""
    f = ev.fields
    name = module_label(str(f["module"]))
    return (
        f"At {_where(ev)}, the backward of {name} ({f['module_type']}) made {KIND_WORDS[ev.raw_kind]} in "
        f"`{f['tensor']}` ({oe.dtype}): {oe.because}: {oe.what}, not values growing too large. Clamp the forward "
        f"input of {name} away from that point (`x.clamp_min(eps)`) or add eps to the denominator in its "
        "backward; a loss scale or a wider dtype does not remove it."
    )


def _backward_body(view: RunView, ev: Event) -> str:
    f, step_df = ev.fields, ev.step_rows
    module, dtype, tensor = str(f["module"]), str(f["dtype"]), f["tensor"]
    name, dmax = module_label(module), dtype_max(dtype)
    gout = step_df[
        (step_df["micro_step"] == f["micro_step"])
        & (step_df["phase"].astype(str).isin(["backward", "loss"]))
        & (step_df["module"].astype(str) == module)
        & step_df["tensor"].astype(str).str.startswith("grad_output")
    ]
    scale = float(ev.row["scale"]) if "scale" in ev.row else 1.0
    scaled = f", loss scale {num(scale)}" if scale != 1.0 else ""
    tail = _backward_tail(view, ev, scale, name)
    limit = f"{dtype} overflows above {num(dmax)} (torch.finfo(torch.{dtype}).max)"
    gdtypes = [str(d) for d in gout["dtype"].astype(str).unique()]
    narrow = min(gdtypes, key=dtype_max) if gdtypes else dtype
    if dtype_max(narrow) < dmax:  # e.g. a float32 weight.grad computed from float16 gradients under autocast
        limit = (
            f"computed from {narrow} gradients, which overflow above {num(dtype_max(narrow))} "
            f"(torch.finfo(torch.{narrow}).max)"
        )
    incoming = f"finite incoming gradients (grad_output absmax {num(finite_absmax(gout))}{scaled})"
    if (
        ev.raw_kind == "nan"
    ):  # 0·inf, inf−inf, 0/0, sqrt/log of a negative: the dtype's range is not the cause
        return (
            f"At {_where(ev)}, the backward of {name} ({f['module_type']}) turned {incoming} into NaN in "
            f"`{tensor}` ({dtype}): an invalid operation in its backward (0·inf, inf−inf, 0/0, sqrt/log of a "
            f"negative).{_discarded(ev)}\n{tail.strip()}"
        )
    return (
        f"At {_where(ev)}, the backward of {name} ({f['module_type']}) turned {incoming} into "
        f"{KIND_WORDS[ev.raw_kind]} in `{tensor}` ({dtype}; {limit}).\n{tail.strip()}"
    )


def _optimizer(view: RunView, ev: Event) -> str:
    f = ev.fields
    dtype = str(f["dtype"])
    dmax = dtype_max(dtype)
    head = (
        f"At {_where(ev)}, gradients were finite but optimizer.step() made `{f['tensor']}` of "
        f"{module_label(str(f['module']))} ({f['module_type']}) {KIND_WORDS[ev.raw_kind]} ({dtype})."
    )
    if math.isnan(dmax):
        return head
    lr = step_lr(view, int(f["step"]))
    if not math.isnan(lr) and not math.isfinite(lr):
        return f"{head} The learning rate was {num(lr)} at this step: set a finite one (check what set it)."
    written = unreachable_update(view, Overflow(**f))
    if written is not None:
        return (
            f"At {_where(ev)}, gradients were finite and `{f['tensor']}` of {module_label(str(f['module']))} "
            f"({f['module_type']}) was {KIND_WORDS[ev.raw_kind]} ({dtype}) after optimizer.step(). But {written}."
        )
    if is_wide(dtype):  # eps and grad² do not round to 0 here: the optimizer's own arithmetic overflowed
        shown = f" (learning rate {num(lr)})" if not math.isnan(lr) else ""
        return (
            f"{head} In {dtype} a finite gradient becomes non-finite only in the optimizer's own arithmetic: an "
            f"update beyond {num(dmax)}{shown} or an invalid operation in step() (0/0, a division by a zero "
            "state): check the learning rate and the optimizer's hyper-parameters, and a custom optimizer's step()."
        )
    tiny = float(torch.finfo(getattr(torch, dtype)).smallest_normal)
    name = view.meta.options.get("optimizer")
    adam = "adam" in str(name or "adam").lower()
    # no eps and no squared gradients in its update: what the weights held says how far they were
    if not adam:
        prev = last_optimizer_row(_local(view), str(f["module"]), str(f["tensor"]), int(f["step"]))
        held = (
            f"`{f['tensor']}` had absmax {num(float(prev['absmax']))} after step {int(prev['step'])}, "
            if prev is not None and math.isfinite(float(prev["absmax"]))
            else ""
        )
        shown = f"learning rate {num(lr)}" if not math.isnan(lr) else "learning rate not recorded"
        return (
            f"{head} {name}.step() has no eps or squared gradients that round to 0: its update went beyond "
            f"{dtype}'s {num(dmax)} ({held}{shown}) or made an invalid operation: check the learning rate and "
            "weight decay (with no gradient, SGD's w·(1 − lr·weight_decay) grows |w| when lr·weight_decay > 2)."
        )
    consts = "Adam's eps=1e-8 and squared gradients"
    return (
        f"{head} In {dtype} small optimizer constants such as {consts} round to 0 (smallest normal {num(tiny)}): "
        "keep float32 master weights, or raise eps to ≥1e-4."
    )


def step_lr(view: RunView, step: int) -> float:
    """The learning rate recorded for ``step`` (NaN when not recorded)."""
    steps = view.steps
    if "lr" not in steps.columns or not len(steps):
        return math.nan
    row = steps[steps["step"].to_numpy() == step]
    return float(row["lr"].iloc[0]) if len(row) else math.nan


def _local(view: RunView) -> pd.DataFrame:
    r = view.records
    if "reduced" in r.columns and bool(r["reduced"].to_numpy(dtype=bool).any()):
        return r[~r["reduced"].to_numpy(dtype=bool)]
    return r


def _explain_event(view: RunView, ev: Event) -> str:
    """One or two sentences on one rank's event, with the numbers that matter."""
    phase = ev.fields["phase"]
    if phase in ("data", "loss", "optimizer"):
        head = headline(Overflow(**ev.fields), None) + "\n"
    if phase == "data":
        return head + _data(view, ev)
    if phase == "forward":
        local = view if len(view.meta.ranks) == 1 else view.rank_view(ev.rank)
        ov = Overflow(**ev.fields)
        if handed_in(local, ov):
            return headline(ov, None, handed=True) + "\n" + _handed(view, ev)
        return _forward(local, ev)
    if phase == "loss":
        return head + _loss(ev)
    if phase == "backward":
        return _backward(view, ev)
    return head + _optimizer(view, ev)


# ---------------------------------------------------------------------------------------------- notes
def hunt_hint(view: RunView, ev: Event) -> str:
    """A sentence pointing to ``nantrace.hunt`` when module hooks cannot name the op, else ``""``.

    Rule (forward and backward overflows only), any of:

    * *internal*: the forward drill-down named an op whose kind is not the kind at the module's output (e.g. a
      ``matmul`` inf that the module returned as NaN);
    * *container*: at least one traced submodule ran inside the module in this step, so its own code between
      them holds ops that module hooks cannot tell apart;
    * *hand-written*: the module's class does not run torch's own ``forward``, so its forward (and backward)
      is the user's own sequence of ops. With the live model that is judged by where ``type(m).forward`` is
      defined, so a subclass ``class MyLinear(nn.Linear): pass`` is built-in and a hand-written class named
      ``Linear`` is not. Without it (a loaded trace, a model gone) by the class name: ``module_type`` is
      not a name of a ``torch.nn`` module class.

    So only a built-in ``torch.nn`` leaf layer (``Linear``, ``Conv2d``, ``Embedding``...) whose output held the
    kind its op made is reported without the hint: the layer is the answer. Nor does a forward event whose op
    and source line the replay named get it, *internal* or not: hunt would name the same op and line.
    """
    f = ev.fields
    phase, module = f["phase"], str(f["module"])
    if phase not in ("forward", "backward"):
        return ""
    prefix = f"{module}." if module else ""
    names = ev.step_rows["module"].astype(str).unique()
    n_sub = sum(1 for n in names if n != module and n.startswith(prefix))
    internal = phase == "forward" and ev.op is not None and int(ev.row[f"n_{ev.raw_kind}"]) == 0
    internal = internal and ev.op != CAST_OP  # autocast's cast of a weight: the layer is the answer
    if phase == "forward" and ev.op is not None and ev.source:
        return ""  # the replay already named the op and its source line: hunt would name the same
    mtype = str(f["module_type"])
    known = view.meta.builtin_modules  # recorded while the model lived, saved with the trace
    is_builtin = (module in known) if known is not None else None
    if is_builtin is None and view.model is not None:
        is_builtin = view.model.builtin(module)
    if is_builtin is None:  # a file written before builtin_modules was recorded: judged by the class name
        layer = getattr(torch.nn, mtype, None)
        is_builtin = isinstance(layer, type) and issubclass(layer, torch.nn.Module)
    if not internal and n_sub == 0 and is_builtin:
        return ""
    name = module_label(module)
    if internal:
        why = (
            f"the {KIND_WORDS[ev.raw_kind]} was made inside {name} by `{ev.op}` and never reached its output"
        )
    elif n_sub:
        why = f"{name} has {n_sub} traced submodule(s), and the ops of its own code between them are not seen one by one"
    else:
        why = f"{name} is hand-written code ({mtype}), a sequence of ops"
    if phase == "forward":
        how = (
            f'; or trace again with capture="{module}" and hunt the saved call: ov.save_repro(path), then '
            "nantrace.hunt(nantrace.load_repro(path).run)"
        )
        if _captured_this(view, f):
            how = (
                "; this trace captured that call, so hunt it in isolation: ov.save_repro(path), then "
                "nantrace.hunt(nantrace.load_repro(path).run)"
            )
    else:
        how = ": it names the backward op and the forward line it belongs to"
    also = ' (kind="nan" for the op that made the NaN itself)' if f["kind"] == "nan" else ""
    return (
        f" To name the exact op and source line ({why}), run this step under nantrace.hunt(step_fn){also}, "
        f"which is slow: every op is checked{how}."
    )


def _captured_this(view: RunView, fields: dict[str, Any]) -> bool:
    """The recording's capture holds exactly this overflow's call (so ``Overflow.save_repro`` saves it)."""
    if view.capture is None:
        return False
    try:
        captured_call(view.capture, Overflow(**fields), for_overflow=True)
    except NantraceError:
        return False
    return True


def _filter_note(view: RunView, fields: dict[str, Any]) -> str:
    if fields["phase"] not in ("forward", "backward"):
        return ""
    hides = view.meta.hides_submodules_of(str(fields["module"]))  # recorded, saved with the trace
    if hides is None and view.model is not None:
        hides = view.model.hides_submodules_of(str(fields["module"]))
    if not hides:
        return ""
    return (
        f" (Only the modules matching modules={view.meta.options['modules']} were traced: an untraced "
        "submodule inside the reported one may be the real producer.)"
    )


def _received_text(ev: Event, world_size: int | None) -> str:
    f = ev.fields
    of = f" of {world_size}" if world_size else ""
    return (
        f"At step {f['step']}, rank {ev.rank}{of} computed finite local gradients, but `{f['tensor']}` of "
        f"{module_label(str(f['module']))} held {KIND_WORDS[ev.raw_kind]} after the gradient reduction (DDP "
        f"all-reduce / FSDP reduce-scatter): rank {ev.rank} received it and did not produce it. Load the parts of "
        "every rank (nantrace.load on the path all ranks saved to) to name the rank that produced it."
    )


def _reduction_text(ev: Event, holders: tuple[int, ...]) -> str:
    f = ev.fields
    return (
        f"At step {f['step']} every rank's local gradients were finite, but `{f['tensor']}` of "
        f"{module_label(str(f['module']))} held {KIND_WORDS[ev.raw_kind]} after the gradient reduction on "
        f"rank{'s' if len(holders) > 1 else ''} {', '.join(map(str, holders))}: the reduction itself produced it "
        "(e.g. a communication hook that compresses gradients to float16, whose max is 65504). Reduce in "
        "float32 or scale gradients down first."
    )


def _message(view: RunView, found: Finding, per_rank: bool) -> str:
    ev = found.event
    if found.how == "reduction":
        return _reduction_text(ev, found.receivers)
    if ev.received:
        return _received_text(ev, view.meta.world_size)
    text = _explain_event(view, ev)
    if found.n_ranks == 1 and not ev.step_rows["reduced"].to_numpy(dtype=bool).any():
        text += _line(hunt_hint(view, ev))
    text += _line(_filter_note(view, ev.fields))
    if per_rank or found.n_ranks == 1:
        return text
    head, _, body = text.partition("\n")
    note = f"Rank {ev.rank} of {view.meta.world_size or found.n_ranks} produced it."
    got = found.receivers
    tail = ""
    if got:
        tail = (
            f"Rank{'s' if len(got) > 1 else ''} {', '.join(map(str, got))} only received it through the gradient "
            "reduction (propagated, not produced)."
        )
    return "\n".join(x for x in (head, note, body, tail) if x)


def _line(text: str) -> str:
    """``text`` as a line of its own (``""`` stays ``""``)."""
    return "\n" + text.strip() if text.strip() else ""


def _overflow(view: RunView, found: Finding, per_rank: bool, messages: bool = True) -> Overflow:
    ev = found.event
    if not messages:  # the locator's fields only (what the rules of the diagnosis and the report's runs read)
        return Overflow(
            **ev.fields,
            rank=ev.rank,
            propagated=ev.received and found.how != "reduction",
            _captured=view.capture,
        )
    local = view if len(view.meta.ranks) == 1 else view.rank_view(ev.rank)
    oe = op_evidence(local, Overflow(**ev.fields, rank=ev.rank))
    return Overflow(
        **ev.fields,
        message=_message(view, found, per_rank),
        op_class=None if oe is None else oe.op_class,
        rank=ev.rank,
        propagated=ev.received and found.how != "reduction",
        _captured=view.capture,
    )


# ---------------------------------------------------------------------------------------------- entry points
def first_overflow(view: RunView, kind: str | None = None) -> Overflow | None:
    """The producer of the first non-finite value of ``view``, or None if every recorded value was finite.

    Raises:
        ValueError: ``kind`` is not None, ``"inf"`` or ``"nan"``.
    """
    found = find(view.records, wanted_kinds(kind), view.ops, world_size=view.meta.world_size, first_only=True)
    return _overflow(view, found[0], False) if found else None


def explained(view: RunView, ov: Overflow) -> Overflow:
    """``ov``, an event of ``overflows(view, messages=False)`` (or of one rank's view of a merged ``view``),
    with the message and op class :func:`overflows` gives it: the locator again over its step's rows only, in
    ``view`` and then in the rank's own view, and the explanation of the finding that is ``ov``. ``ov``
    unchanged when it has a message already or no finding of its step is it."""
    if ov.message:
        return ov
    views = [view] if len(view.meta.ranks) == 1 else [view, view.rank_view(ov.rank)]
    same = (*OVERFLOW_COLUMNS[:8], "rank", "propagated")
    for v in views:
        r = v.records
        step_rows = r[r["step"].to_numpy() == ov.step]
        for f in find(step_rows, wanted_kinds(None), v.ops, world_size=v.meta.world_size, first_only=False):
            full = _overflow(v, f, False)
            if all(getattr(full, k) == getattr(ov, k) for k in same):
                return dataclasses.replace(ov, message=full.message, op_class=full.op_class)
    return ov


def first_after(view: RunView, step: int, micro_step: int) -> Overflow | None:
    """The first producer of ``step`` in its micro-steps after ``micro_step`` (the locator over those rows
    only), or None; on one rank's trace only (None for a merged one). Under gradient accumulation a step's
    first event can hide a second fault of a later micro-step (a backoff in micro-step 0, a NaN loss in 1)."""
    if len(view.meta.ranks) > 1:
        return None
    r = view.records
    sub = r[(r["step"].to_numpy() == step) & (r["micro_step"].to_numpy() > micro_step)]
    if not len(sub):
        return None
    found = find(sub, wanted_kinds(None), view.ops, world_size=view.meta.world_size, first_only=True)
    return _overflow(view, found[0], False) if found else None


def overflows(
    view: RunView, kind: str | None = None, *, per_rank: bool = False, messages: bool = True
) -> pd.DataFrame:
    """One row per step that saw a non-finite value: that step's first producer (columns of :class:`Overflow`
    plus ``message``). ``per_rank=True``: one row per (step, rank) instead, each rank's own first non-finite
    value (``propagated`` where the rank only received it through the gradient reduction). ``messages=False``:
    the producers only, ``message`` empty (an explanation reads the run's history for each step: about 0.1 s
    per step on 2 CPU cores).

    Raises:
        ValueError: ``kind`` is not None, ``"inf"`` or ``"nan"``.
    """
    found = find(
        view.records,
        wanted_kinds(kind),
        view.ops,
        world_size=view.meta.world_size,
        first_only=False,
        per_rank=per_rank,
    )
    rows = [_overflow(view, f, per_rank, messages) for f in found]
    cols = [*OVERFLOW_COLUMNS, "message"]
    df = pd.DataFrame([{**o.to_dict(), "message": o.message} for o in rows], columns=cols)
    if len(df):
        ints = ["step", "micro_step", "call", "rank"]
        df[ints] = df[ints].astype("int64")
        df["propagated"] = df["propagated"].astype(bool)
    return df
