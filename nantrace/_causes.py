"""The fault causes of the diagnosis, one builder each (data, mask leak, forward overflow, invalid op, loss,
backward overflow, optimizer, divergence): each writes the evidence and advice from the facts of its event."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd

from ._diagnosis import (
    DIVERGENCE_UPDATE_RATIO,
    DIVERGENCE_WINDOW,
    HEADLINE_MAX,
    HEALTHY_UPDATE_RATIO,
    Diagnosis,
)
from ._evidence import (
    KEPT_DERIVATIVE_FIX,
    WEIGHTS_HELD,
    OpEvidence,
    call_arity,
    class_advice,
    discarded_op,
    kept_derivative,
    loss_advice,
    masked_outputs,
    mean_over_nothing,
    op_evidence,
    outputs_words,
    unreachable_update,
    weights_beyond_event,
    written_facts,
)
from ._explain import samples_words
from ._facts import DivergenceFacts, Facts, data_growth_words, ratio_per_step
from ._fmt import attr_path, module_label, num, steps_text
from ._masks import is_mask, lowest_masks
from ._overflow import Overflow
from ._ranges import finite_absmax, last_optimizer_row, own_parameters
from ._schema import FP16_SMALLEST_NORMAL, FP16_SMALLEST_SUBNORMAL, dtype_max, is_wide

__all__ = [
    "backward_overflow",
    "bf16_advice",
    "clipping_text",
    "compute_dtype",
    "data",
    "divergence_diagnosis",
    "empty_reduction",
    "forward_overflow",
    "input_beyond_range",
    "invalid_op",
    "keep_fp32_advice",
    "leaked_masks",
    "loss",
    "mask_leak",
    "optimizer",
    "producer_text",
    "skips_text",
    "weights_beyond_of",
]


# ---------------------------------------------------------------------------------------------- the causes
def skips_text(run: Facts) -> str | None:
    sk = run.skipped_steps()
    if not run.has_scaler():
        return None
    first, last = run.scale_range(run.step_ids)
    rng = f"; loss scale {num(first)} → {num(last)}" if not math.isnan(first) else ""
    return f"GradScaler skipped {len(sk)} of {len(run.step_ids)} steps ({steps_text(sk)}){rng}"


def _call_args(run: Facts, ev: Overflow | None) -> str:
    """The arguments of the float32 snippet, with the arity the module was really called with (its recorded
    tensor inputs: ``x.float()``, ``x0.float(), x1.float()``, ``mask=mask.float()``)."""
    n, kw = call_arity(run.view, ev) if ev is not None else (1, [])
    if n == 0 and not kw:
        n = 1
    pos = ["x.float()"] if n == 1 else [f"x{i}.float()" for i in range(n)]
    return ", ".join([*pos, *(f"{k}={k}.float()" for k in kw)])


def keep_fp32_advice(run: Facts, module: str, dtype: str, ev: Overflow | None = None) -> str:
    """Advice to run ``module`` in float32; ``ev`` (its event) gives the call's arity for the snippet."""
    if run.autocast():
        return (
            f"Keep {module_label(module)} in float32: run it with autocast off, "
            f"`with torch.autocast(device_type=..., enabled=False): y = {attr_path(module)}({_call_args(run, ev)})`."
        )
    return (
        f"Keep {module_label(module)} in float32 while the rest stays {dtype}: `{attr_path(module)}.float()` and cast its "
        f"input with `.float()` (and the result back with `.to(torch.{dtype})`)."
    )


def range_advice(run: Facts, module: str, dtype: str, ev: Overflow, *, backward: bool = False) -> list[str]:
    """Advice on the dtype's range: a narrow dtype (float16) gets float32 for the module, or bfloat16; a dtype
    with float32's range (bfloat16, float32, float64) gets none of those (no wider dtype helps), but the blow-up
    that reaching ~3.4e38 means."""
    if dtype_max(dtype) < dtype_max("bfloat16"):
        return [keep_fp32_advice(run, module, dtype, ev), bf16_advice()]
    what = "gradients" if backward else "values"
    fix = "clip gradients and lower the learning rate" if backward else "clamp or rescale what feeds it"
    return [
        f"{what.capitalize()} beyond {dtype}'s {num(dtype_max(dtype))} in {module_label(module)} mean a computation "
        f"that blows up (exp or pow of a large input, a growing residual, weights or {what} growing over steps), "
        f"not a dtype too narrow: {fix}, or lower the learning rate if they grew over steps."
    ]


def _input_beyond_advice(module: str, in_absmax: float, dtype: str, limit: float) -> str:
    return (
        f"The input of {module_label(module)} (absmax {num(in_absmax)}) is already beyond {dtype}'s {num(limit)} "
        "before it computes anything: rescale or normalise it where it is made (the data, or what runs before this "
        "module)."
    )


def bf16_advice() -> str:
    return (
        "Or train in bfloat16 (`torch.autocast(device_type=..., dtype=torch.bfloat16)`): it has float32's range "
        "(max 3.4e38), so no loss scaling is needed."
    )


def data(run: Facts, ev: Overflow) -> Diagnosis:
    """A model input that held the value (``phase == "data"``), or an input the loop handed to a submodule it
    called itself (:func:`nantrace._evidence.handed_in`): made outside the model either way."""
    handed = ev.phase == "forward"
    if handed:
        rows = run.rows_of(ev.step, "forward", module=ev.module, prefix=ev.tensor)
        rows = rows[rows["call"].to_numpy() == ev.call]
    else:
        rows = run.rows_of(ev.step, "data", prefix=ev.tensor)
    rows = rows[(rows["micro_step"].to_numpy() == ev.micro_step) & (rows["tensor"].astype(str) == ev.tensor)]
    counts = {k: int(rows[f"n_{k}"].sum()) for k in ("nan", "posinf", "neginf")} if len(rows) else {}
    what = ", ".join(
        f"{n} {k.replace('posinf', '+inf').replace('neginf', '-inf')}" for k, n in counts.items() if n
    )
    shape = str(rows["shape"].iloc[0]) if len(rows) else "?"
    arg = rows["arg"].iloc[0] if len(rows) else None
    argname = f" (argument `{arg}`)" if isinstance(arg, str) and arg else ""
    where = step_words(ev)
    held = f"held {what or 'non-finite values'} at {where}"
    if handed:
        name = module_label(ev.module)
        said = (
            f"input `{ev.tensor}`{argname} of {name}, shape {shape}, dtype {ev.dtype}, {held} when the call "
            f"began; the loop called {name} itself, not inside a call of the model, so the value was made "
            "outside the model (the data, or the loop's own code before the call)"
        )
    else:
        said = f"model input `{ev.tensor}`{argname}, shape {shape}, dtype {ev.dtype}, {held}, before any module ran"
    evidence = [said, f"finite part of that input: absmax {num(finite_absmax(rows))}"]
    which = "" if handed else samples_words(run.view, ev.rank, ev.step, ev.micro_step, ev.tensor)
    if which:
        evidence.append(f"the values that were not finite are in {which}")
    later = [e.step for e in run.events if e.phase == "data"]
    if len(later) > 1:
        evidence.append(f"the model inputs were non-finite at steps {steps_text(later)}")
    skips = skips_text(run)
    if skips:
        evidence.append(skips)
    loop = f" and the loop's code before it calls {module_label(ev.module)}" if handed else ""
    advice = [
        f"Check the data loader for the batch of {where} (input `{ev.tensor}`"
        + (f", {which}" if which else "")
        + f"){loop}: look for log(0), division by zero, a corrupt sample or a missing value; e.g. "
        "`assert torch.isfinite(x).all()` in the loader.",
    ]
    if counts.get("neginf"):
        advice.append(
            "-inf in an input that is not an attention mask: clamp before the log "
            "(`torch.log(x.clamp_min(1e-6))` or `torch.log1p(x)`). If it is a mask, pass it as an argument whose "
            "name contains 'mask', or make it hold only 0 (where kept) and -inf."
        )
    if counts.get("nan"):
        advice.append("Replace missing values before the model (`torch.nan_to_num(x)` or drop the sample).")
    if handed:
        summary = (
            f"`{ev.tensor}` of {module_label(ev.module)}, which the loop called itself, was already non-finite "
            f"at {where}: made outside the model, not by a module."
        )
    else:
        summary = (
            f"The model input `{ev.tensor}` was already non-finite at {where}: a data fault, not the model."
        )
    return Diagnosis("data", ev, evidence, advice, summary)


def step_words(ev: Overflow) -> str:
    """``"step 3"``, or ``"step 3, micro-step 1"`` for a micro-step after the first."""
    return f"step {ev.step}" + (f", micro-step {ev.micro_step}" if ev.micro_step else "")


def call_inputs(run: Facts, ev: Overflow) -> pd.DataFrame:
    """The input rows of the event's module call (the model inputs for the root), without finite additive masks
    (:func:`nantrace._masks.lowest_masks`: a ``finfo.min`` mask's absmax is no value the call computed from)."""
    phase = "data" if ev.module == "" else "forward"
    mine = run.rows_of(ev.step, phase, module=ev.module, prefix="input")
    mine = mine[(mine["micro_step"].to_numpy() == ev.micro_step) & (mine["call"].to_numpy() == ev.call)]
    return mine[~lowest_masks(mine)] if len(mine) else mine


_KIND_NAMES = {"nan": "NaN", "posinf": "+inf", "neginf": "-inf"}


def _held_instead(run: Facts, ev: Overflow, raw_kind: str) -> str | None:
    """For a forward event whose op made ``raw_kind`` inside the call, what the call's ``ev.tensor`` row held
    instead when it holds no value of that kind (``"NaN"``, ``"-inf"``, ``"NaN and -inf"``: the op's +inf
    became them before leaving the call); None when that row holds the op's kind or is not recorded."""
    rows = run.rows_of(ev.step, "forward", module=ev.module, prefix=ev.tensor)
    rows = rows[
        (rows["micro_step"].to_numpy() == ev.micro_step)
        & (rows["call"].to_numpy() == ev.call)
        & (rows["tensor"].astype(str).to_numpy() == ev.tensor)
    ]
    if len(rows) != 1 or int(rows[f"n_{raw_kind}"].iloc[0]) > 0:
        return None
    held = [name for k, name in _KIND_NAMES.items() if int(rows[f"n_{k}"].iloc[0]) > 0]
    return " and ".join(held) if held else None


def _seen_at(run: Facts, ev: Overflow) -> str | None:
    """For a forward event first seen at a submodule's input (the module's own code made it), that submodule's
    name: the first non-finite forward row of the micro-step with the event's tensor path under the module."""
    if ev.phase != "forward" or not ev.tensor.startswith("input"):
        return None
    rows = run.rows_of(ev.step, "forward")
    rows = rows[(rows["micro_step"].to_numpy() == ev.micro_step) & (rows["tensor"].astype(str) == ev.tensor)]
    rows = rows[(rows[["n_nan", "n_posinf", "n_neginf"]].to_numpy().sum(axis=1) > 0)]
    if ev.module:
        rows = rows[rows["module"].astype(str).str.startswith(f"{ev.module}.")]
    return str(rows["module"].iloc[0]) if len(rows) else None


def input_beyond_range(run: Facts, ev: Overflow) -> bool:
    """A forward NaN whose (finite, wider-dtype) inputs exceed the output dtype's range: the cast overflowed
    (autocast casting float32 inputs above 65504 to float16 gives inf, then inf - inf or 0·inf gives NaN)."""
    limit = dtype_max(str(ev.dtype))
    return not math.isnan(limit) and finite_absmax(call_inputs(run, ev)) > limit


def weights_beyond_of(run: Facts, ev: Overflow) -> tuple[list[tuple[str, str, float, int]], bool]:
    """Own parameters of the event's module beyond the output dtype's range, and whether they were read live
    (:func:`nantrace._evidence.weights_beyond_event`, the one rule)."""
    return weights_beyond_event(run.view, ev)


def own_code_of(run: Facts, ev: Overflow) -> bool:
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


def leaked_masks(run: Facts, ev: Overflow) -> list[str] | None:
    """For a forward inf made from call inputs that already held inf while a model input was a mask holding
    -inf: the names of those mask inputs (the mask's -inf went on beyond the mask); else ``None``."""
    if ev.kind != "inf":
        return None
    inputs = call_inputs(run, ev)
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


def mask_leak(run: Facts, ev: Overflow, masks: list[str]) -> Diagnosis:
    shown = ", ".join(f"`{n}`" for n in masks)
    where = step_words(ev)
    evidence = [
        f"model input(s) {shown} held -inf and count as attention masks (by name, or every value 0 or -inf)",
        f"{module_label(ev.module)} ({ev.module_type}, call {ev.call}) at {where} passed that -inf on into `{ev.tensor}`, "
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


def _weights_evidence(
    run: Facts, ev: Overflow, beyond: list[tuple[str, str, float, int]], live: bool
) -> list[str]:
    """One sentence per parameter of the event's module beyond the output dtype's range."""
    dtype = str(ev.dtype)
    limit = dtype_max(dtype)
    prefix = f"{ev.module}." if ev.module else ""
    evidence: list[str] = []
    out = run.records[
        (run.phase == "forward") & (run.module == ev.module) & run.is_output & (run.step == ev.step)
    ]
    nan_out = ev.kind == "nan" or bool(len(out) and out["n_nan"].sum() > 0 and out["n_posinf"].sum() == 0)
    made = "inf·0 or inf−inf then gives NaN" if nan_out else "and inf times the inputs gives inf"
    for pname, pdtype, absmax, since in beyond:
        if live:
            last = last_optimizer_row(run.records, ev.module, pname, ev.step)
            shown = (
                f"; its last optimizer row (step {int(last['step'])}) showed {num(float(last['absmax']))}: it "
                "changed outside optimizer.step()"
                if last is not None
                else ""
            )
            when = (
                "read from the live model at diagnose time (the GradScaler skipped every step from "
                f"{ev.step} on, so the optimizer did not change it after that forward){shown}"
            )
        else:
            when = (
                f"it grew past {num(limit)} at step {since} (optimizer rows)"
                if since >= 0
                else f"it was already past {num(limit)} in the initial weights, from before step 0 (optimizer rows)"
            )
        evidence.append(
            f"its parameter `{prefix}{pname}` ({pdtype}) has absmax {num(absmax)}, beyond {dtype}'s {num(limit)}: "
            f"autocast's cast of it to {dtype} gives inf, {made}; {when}"
        )
    return evidence


def _transient(run: Facts, ev: Overflow, op: str | None) -> list[str]:
    """Evidence for an inf that an op made inside a call whose recorded output stayed finite (a transient the
    drill-down found and judged to change the call's output): that the output was finite, and whether anything
    else of the step was recorded non-finite. Empty for any other event."""
    if not op or ev.tensor.startswith("input"):
        return []
    out = run.rows_of(ev.step, "forward", module=ev.module, prefix="output")
    out = out[(out["micro_step"].to_numpy() == ev.micro_step) & (out["call"].to_numpy() == ev.call)]
    if not len(out) or int(out[["n_nan", "n_posinf", "n_neginf"]].to_numpy().sum()):
        return []
    lines = [
        f"its output stayed finite (absmax {num(finite_absmax(out))}): the inf of `{op}` did not leave the call, "
        "but the output depends on it (a replay with a finite value in its place computes another output)"
    ]
    rows = run.records[run.step == ev.step]
    bad = int(rows[["n_nan", "n_posinf", "n_neginf"]].to_numpy().sum()) if len(rows) else 0
    if bad == 0:
        skipped = run.skipped.get(ev.step)
        lines.append(
            f"no tensor recorded at step {ev.step} held inf/NaN"
            + (" and the GradScaler did not skip it" if skipped is False else "")
            + ": so far it only changed values, it broke no step"
        )
    return lines


def _forward_summary(
    ev: Overflow,
    dtype: str,
    oe: OpEvidence | None,
    transient_op: str | None,
    beyond: list[tuple[str, str, float, int]],
) -> str:
    """The summary of a forward overflow: an op of a forward hook on the module, activations beyond the dtype, a
    transient op's inf inside the call, a reduction's or cast's reason, or weights beyond the dtype."""
    limit = dtype_max(dtype)
    who = f"{module_label(ev.module)} ({ev.module_type}) overflowed {dtype}"
    if oe is not None and oe.hook is not None:
        return (
            f"{who} at step {ev.step} in your {oe.hook}: its `{oe.op}` exceeded {num(limit)} from finite "
            "inputs (not a module's forward)."
        )
    if beyond:
        return (
            f"{who} in its forward at step {ev.step}: its {beyond[0][1]} weights exceed {num(limit)}, so "
            f"autocast's cast to {dtype} made them inf."
        )
    if oe is not None and oe.op_class in ("reduction", "cast"):
        return f"{who} in its forward at step {ev.step}: {oe.because}."
    if transient_op:
        return (
            f"{who} inside its forward at step {ev.step}: `{transient_op}` exceeded {num(limit)} from finite "
            "inputs; the call's output stayed finite."
        )
    return f"{who} in its forward at step {ev.step}: activations exceeded {num(limit)} from finite inputs."


def _own_code_line(ev: Overflow, hook: str | None) -> str:
    """The evidence of an overflow first seen between a module's submodules (its own forward code, or a hook
    that ran inside its call)."""
    where = (
        f"first seen at `{ev.tensor}` of a submodule"
        if ev.tensor.startswith("input")
        else f"first seen at `{ev.tensor}` of {module_label(ev.module)} itself, not of a submodule"
    )
    code = (
        f"the {hook}, which ran inside {module_label(ev.module)}'s call"
        if hook is not None
        else f"{module_label(ev.module)}'s own forward code"
    )
    return f"{where}: the overflow is in {code} between its submodules (every submodule output before it was finite)"


def _beyond_advice(
    run: Facts, ev: Overflow, beyond: list[tuple[str, str, float, int]], live: bool, limit: float
) -> str:
    """The advice for weights beyond the dtype's max: keep them below it (read from optimizer rows), or find
    what set them (read from the live model)."""
    prefix = f"{ev.module}." if ev.module else ""
    grown = ", ".join(f"`{prefix}{t[0]}`" for t in beyond)
    if live:
        return (
            f"Find what set the weights of {module_label(ev.module)} ({grown}) above {num(limit)} (an in-place edit, "
            "a checkpoint) and keep them well below it: a smaller learning rate, weight decay, or gradient clipping."
        )
    lr = run.lr.get(beyond[0][3], math.nan)
    lr_text = f" (lr was {lr:.4g} at step {beyond[0][3]})" if not math.isnan(lr) else ""
    return (
        f"Keep the weights of {module_label(ev.module)} ({grown}) well below {num(limit)}: a smaller learning rate"
        f"{lr_text}, weight decay, or gradient clipping (`torch.nn.utils.clip_grad_norm_`, after "
        "`scaler.unscale_(optimizer)`)."
    )


def forward_overflow(run: Facts, ev: Overflow) -> Diagnosis:
    inputs = call_inputs(run, ev)
    in_absmax = finite_absmax(inputs)
    oe = op_evidence(run.view, ev)
    # the dtype the producing op computed in (a float16 op inside a call whose output is float32)
    dtype = oe.dtype if oe is not None and oe.op is not None else str(ev.dtype)
    limit = dtype_max(dtype)
    own_code = own_code_of(run, ev)
    op = run.op_of(ev, "posinf") or run.op_of(ev, "neginf") or run.op_of(ev, "nan")
    from_what = (
        f"finite inputs (absmax {num(in_absmax)})"
        if not math.isnan(in_absmax)
        else "inputs with no recorded floating-point tensor (token ids, indices)"
    )
    evidence = [
        f"{module_label(ev.module)} ({ev.module_type}, call {ev.call}) at {step_words(ev)} turned {from_what} "
        f"into {'NaN' if ev.kind == 'nan' else 'inf'} in {dtype}, whose largest finite value is {num(limit)}"
    ]
    if in_absmax > limit:
        evidence.append(
            f"its inputs (absmax {num(in_absmax)}) are already beyond {dtype}'s range: casting them to {dtype} "
            "(autocast) gives inf" + (", and inf − inf or 0·inf then gives NaN" if ev.kind == "nan" else "")
        )
    hook = oe.hook if oe is not None else None
    if own_code:
        evidence.append(_own_code_line(ev, hook))
    if op:
        evidence.append(f"the forward replay names the op: `{op}`")
        if oe is not None and oe.op is not None:
            evidence += oe.fact_lines()[1:]
    transient = _transient(run, ev, op)
    evidence += transient
    beyond, live = weights_beyond_of(run, ev)
    # weights beyond the dtype say themselves where they were changed
    written, find_writer = written_facts(run.view, ev, oe) if not beyond else ([], None)
    evidence += written
    prefix = f"{ev.module}." if ev.module else ""
    evidence += _weights_evidence(run, ev, beyond, live)
    prev = run.output_series(ev.module, ev.step)
    if len(prev):
        last = float(prev.iloc[-1])
        bits = math.log2(limit / last) if last > 0 and not math.isnan(limit) else math.nan
        evidence.append(
            f"its output absmax at step {int(prev.index[-1])} was {num(last)} ({num(bits)} bits of headroom)"
        )
    w = run.rows_of(ev.step - 1, "optimizer", module=ev.module) if ev.step > 0 else run.records.iloc[0:0]
    if len(w) and not beyond:
        evidence.append(f"its parameters' absmax after step {ev.step - 1}: {num(finite_absmax(w))}")
    skips = skips_text(run)
    if skips:
        evidence.append(skips)
    # an op of the user's hook: fixing the hook is the advice (class_advice, below), not the module's range
    advice = range_advice(run, ev.module, dtype, ev) if hook is None else []
    drift = data_growth_words(run, ev.step, ev.micro_step)
    if drift is not None:
        evidence.append(drift[0])
    if own_code and hook is None:
        which = (
            f"`{op}`"
            if op
            else f"e.g. a residual add `x + f(x)` of values near {num(in_absmax)}"
            if not math.isnan(in_absmax)
            else "an op between its submodules"
        )
        advice.insert(
            0,
            f"The op that overflows is in {module_label(ev.module)}'s own forward ({which}): normalise before it "
            "(pre-norm) or compute that op in float32.",
        )
    if beyond:
        advice.insert(0, _beyond_advice(run, ev, beyond, live, limit))
    if oe is not None and class_advice(oe, ev.module, scaled=run.has_scaler()):
        advice[:0] = class_advice(oe, ev.module, scaled=run.has_scaler())
    elif in_absmax > limit and not own_code and not beyond:  # its input was beyond the dtype before it ran
        advice.insert(0, _input_beyond_advice(ev.module, in_absmax, dtype, limit))
    elif not own_code and not beyond and (params := own_parameters(run.records, ev.module)):
        owned = ", ".join(f"`{prefix}{p}`" for p in params)
        advice.insert(
            0,
            f"{module_label(ev.module)} turns inputs of absmax {num(in_absmax)} into values above {num(limit)} with "
            f"its own parameters ({owned}): rescale or normalise its input (a norm layer before it), or shrink its "
            "weights (init, weight decay).",
        )
    if drift is not None:
        advice.insert(0, drift[1])
    if find_writer is not None:
        advice.insert(0, find_writer)
    summary = _forward_summary(ev, dtype, oe, op if transient else None, beyond)
    return Diagnosis("forward_overflow", ev, evidence, advice, summary)


def invalid_op(run: Facts, ev: Overflow) -> Diagnosis:
    """A singular point, an invalid operation or mask arithmetic (the op classes of the evidence engine that
    no loss scale or wider range removes), in forward or in backward."""
    if ev.phase == "forward":
        return _invalid_forward(run, ev)
    return _invalid_backward(run, ev)


_CLASS_SUMMARY = {
    "singular": "hit a singular point",
    "invalid": "made NaN by an invalid operation",
    "mask_arithmetic": "made a non-finite value by mask arithmetic",
}


def _summary_verb(oe: OpEvidence) -> str:
    if oe.outside_domain:
        return "went outside an op's domain"
    return _CLASS_SUMMARY.get(oe.op_class, "made a non-finite value")


def _invalid_forward(run: Facts, ev: Overflow) -> Diagnosis:
    dtype = str(ev.dtype)
    inputs = call_inputs(run, ev)
    in_neginf = int(inputs["n_neginf"].sum()) if len(inputs) else 0
    oe = op_evidence(run.view, ev)
    assert oe is not None
    what = _KIND_NAMES[oe.raw_kind]
    held = "NaN" if oe.raw_kind == "nan" else "inf/NaN"
    where = step_words(ev)
    seen = _seen_at(run, ev)
    shown = _held_instead(run, ev, oe.raw_kind) if seen is None else None
    first = f" as {shown}" if shown is not None else ""
    evidence = [
        f"{module_label(ev.module)} ({ev.module_type}, call {ev.call}) at {where} produced {what}, first seen{first} "
        f"in `{ev.tensor}`{f' of `{seen}`' if seen is not None else ''} ({dtype}), from inputs holding no {held} "
        + (
            f"(finite absmax {num(finite_absmax(inputs))}, {f'{in_neginf} -inf value(s)' if in_neginf else 'no -inf'})"
            if len(inputs)
            else "(no recorded floating-point input: token ids, indices)"
        )
    ]
    if oe.op is not None:
        evidence.append(f"the forward replay names the op: `{oe.op}`")
    evidence += oe.fact_lines()[1:] if oe.op is not None else [f"{oe.op_class}: {oe.because}"]
    if oe.op is not None and oe.what == WEIGHTS_HELD:
        evidence.append(oe.because.replace("its own parameter", f"{module_label(ev.module)}'s parameter", 1))
    advice: list[str] = []
    if in_neginf and oe.raw_kind == "nan":
        evidence.append("its inputs held -inf (an attention mask): a row with every key masked")
        advice.append(
            f"A fully masked softmax row in {module_label(ev.module)}: softmax over all -inf is 0/0 = NaN. Keep at "
            "least one unmasked key per query, use a large finite negative (`torch.finfo(dtype).min`) instead "
            "of -inf, or zero the row after the softmax (`probs.masked_fill(all_masked, 0)`)."
        )
    else:
        advice += class_advice(oe, ev.module, scaled=run.has_scaler())
    if not advice:
        advice.append(
            f"Find the invalid op in {module_label(ev.module)}'s forward or its forward hooks (0/0, 0·inf, inf−inf, "
            "sqrt/log of a negative, or a NaN written as a constant: `x[i] = float('nan')`): add eps to "
            "denominators and clamp arguments of sqrt/log."
        )
    in_hook = f" in your {oe.hook}" if oe.hook is not None else ""
    op = f" (`{oe.op}`{in_hook}: {oe.what})" if oe.op is not None else f" ({oe.what})"
    summary = f"{module_label(ev.module)} {_summary_verb(oe)} at step {ev.step}{op}: not an overflow."
    if oe.what == WEIGHTS_HELD:
        summary = (
            f"{module_label(ev.module)} computed {what} at step {ev.step} from its own weights, which already "
            "held non-finite values: not this forward's arithmetic."
        )
    return Diagnosis("invalid_op", ev, evidence, advice, summary)


def _singular_backward(run: Facts, ev: Overflow) -> Diagnosis:
    """A backward inf that no product of the recorded magnitudes reaches (:func:`backward_bound`)."""
    oe = op_evidence(run.view, ev)
    assert oe is not None
    name = module_label(ev.module)
    evidence = [
        f"the backward of {name} ({ev.module_type}) at {step_words(ev)} made +inf in `{ev.tensor}` "
        f"({oe.dtype}): {oe.because}",
    ]
    fwd = run.rows_of(ev.step, "forward", module=ev.module, prefix="input")
    zeros = int(fwd["n_zero"].sum()) if len(fwd) else 0
    if zeros:
        evidence.append(f"its forward input held {zeros} exact zero(s) at that step")
    skips = skips_text(run)
    if skips:
        evidence.append(skips)
    advice = [
        f"In the backward of {name}: a derivative at or near a singular point at the values it saw (x/0 or a tiny "
        "denominator in a hand-written backward, 1/sqrt(0), log at 0): clamp the forward input away from that "
        "point (`x.clamp_min(eps)`) or add eps to the denominator. A loss scale, clipping or a wider dtype does not "
        "remove it.",
        "`torch.autograd.detect_anomaly()` on one step names the exact backward function.",
    ]
    summary = (
        f"The backward of {name} made +inf from finite gradients at step {ev.step}: a derivative at or near a "
        "singular point, not values growing too large."
    )
    return Diagnosis("invalid_op", ev, evidence, advice, summary)


def _invalid_backward(run: Facts, ev: Overflow) -> Diagnosis:
    if ev.kind == "inf":
        return _singular_backward(run, ev)
    dtype = str(ev.dtype)
    gout = run.rows_of(ev.step, ("backward", "loss"), module=ev.module, prefix="grad_output")
    scale = run.scale.get(ev.step, math.nan)
    evidence = [
        f"the backward of {module_label(ev.module)} ({ev.module_type}) at {step_words(ev)} turned finite incoming "
        f"gradients (grad_output absmax {num(finite_absmax(gout))}) into NaN in `{ev.tensor}` ({dtype})",
    ]
    if not math.isnan(scale):
        evidence.append(f"loss scale {num(scale)}")
    fwd = run.rows_of(ev.step, "forward", module=ev.module, prefix="output")
    if len(fwd) and not bool(fwd[["n_nan", "n_posinf", "n_neginf"]].to_numpy().sum()):
        evidence.append(f"its forward at that step was finite (output absmax {num(finite_absmax(fwd))})")
    gone = discarded_op(run.view, ev)
    if gone is not None:
        at = f" at {gone[1]}" if gone[1] else ""
        evidence.append(
            f"its forward held a non-finite value made by `{gone[0]}`{at} that the forward discarded (the output "
            f"is the same whatever finite value it had); the backward still goes through `{gone[0]}`"
        )
    skips = skips_text(run)
    if skips:
        evidence.append(skips)
    if gone is None:
        zeros = int(fwd["n_zero"].sum()) if len(fwd) else 0
        if zeros:
            evidence.append(f"its forward output held {zeros} exact zero(s) at that step")
        kept = kept_derivative(run.view)
        evidence.append(kept[0].upper() + kept[1:])
        return Diagnosis(
            "invalid_op",
            ev,
            evidence,
            [
                f"In the backward of {module_label(ev.module)}: {KEPT_DERIVATIVE_FIX[0].lower()}{KEPT_DERIVATIVE_FIX[1:]}",
                "`torch.autograd.detect_anomaly()` on one step names the exact backward function.",
            ],
            f"The backward of {module_label(ev.module)} made NaN from finite gradients at step {ev.step}: an "
            "invalid operation.",
        )
    advice = [
        f"In the backward of {module_label(ev.module)}: an op whose derivative is not finite at the values it saw "
        "(inf for log/log1p or sqrt at 0 and x/0, NaN for sqrt/log of a negative) sits under a `torch.where`/mask "
        "that discards its result; the discarded entries still send 0·inf or 0·NaN = NaN back. Make the input safe "
        "*before* the op "
        "(`safe = torch.where(keep, p, 0.0)`; then `torch.where(keep, f(safe), 0.0)`), or clamp it away from the "
        "singular point.",
        "`torch.autograd.detect_anomaly()` on one step names the exact backward function.",
    ]
    summary = f"The backward of {module_label(ev.module)} made NaN from finite gradients at step {ev.step}: an invalid operation."
    return Diagnosis("invalid_op", ev, evidence, advice, summary)


def empty_reduction(run: Facts, ev: Overflow) -> int | None:
    """A NaN loss whose gradient arriving at the model's outputs was recorded finite and exactly 0 in every
    element: no output element contributed to the loss, so it is a mean over zero elements (0/0; every label
    ``ignore_index``, an empty mask). Returns the number of output elements, else ``None``."""
    if ev.kind != "nan" or not ev.tensor.startswith("loss"):
        return None
    g = run.rows_of(ev.step, "loss", prefix="grad_output")
    return mean_over_nothing(g[g["micro_step"].to_numpy() == ev.micro_step])


def _loss_gradient_advice(run: Facts, ev: Overflow, lv: float, held: str | None) -> str:
    """Advice for a loss whose gradient at the model's outputs was not finite: the loss finite (``lv``), or
    recorded non-finite (``held``: its kind, e.g. ``"NaN"``), or not recorded."""
    dtype = str(ev.dtype)
    scale = run.scale.get(ev.step, math.nan)
    if held is not None:
        head = f"The loss was {held} and so was the gradient it sent back to the model's outputs"
    elif math.isnan(lv):
        head = (
            f"The loss of step {ev.step} was not recorded (pass it through `scaler.scale(loss)` or "
            "`tr.step(loss=loss)`), but the gradient it sent back was not finite"
        )
    else:
        head = f"The loss was finite ({num(lv)}) but its gradient at the model's outputs was not"
    if ev.kind == "nan":
        return (
            f"{head}: an op in the loss has an infinite or undefined derivative at the values it saw (sqrt or "
            "log at 0, x/0); clamp its argument away from that point."
        )
    scaled = f" times the loss scale {num(scale)}" if not math.isnan(scale) else ""
    return (
        f"{head}: a gradient{scaled} beyond {dtype}'s {num(dtype_max(dtype))} (e.g. from a `sum()` over many "
        f"elements); use `mean()` or cast the outputs to float32 before the loss."
    )


def _loss_kind(loss_rows: pd.DataFrame, micro: int) -> str | None:
    """``"NaN"``, ``"+inf"`` or ``"-inf"`` when the recorded loss of micro-step ``micro`` held that (the first of
    NaN, +inf, -inf it held); None when no loss was recorded there or it was finite."""
    rows = loss_rows[loss_rows["micro_step"].to_numpy() == micro] if len(loss_rows) else loss_rows
    for kind, word in _KIND_NAMES.items():
        if len(rows) and int(rows[f"n_{kind}"].sum()):
            return word
    return None


def loss(run: Facts, ev: Overflow) -> Diagnosis:
    outs = run.rows_of(ev.step, "forward", module="", prefix="output")
    if "micro_step" in outs.columns and (outs["micro_step"].to_numpy() == ev.micro_step).any():
        outs = outs[outs["micro_step"].to_numpy() == ev.micro_step]  # the event's own micro-step's outputs
    loss_rows = run.rows_of(ev.step, "loss", prefix="loss")
    loss_dtype = str(loss_rows["dtype"].iloc[0]) if len(loss_rows) else "not recorded"
    which = "the loss" if ev.tensor.startswith("loss") else "the gradient arriving at the model's outputs"
    lv = run.loss.get(ev.step, math.nan)
    seen = outputs_words(outs) if len(outs) else "were not recorded (no traced forward in this step)"
    evidence = [f"the model's outputs at step {ev.step} {seen} but {which} was {ev.kind} ({ev.dtype})"]
    held = _loss_kind(loss_rows, ev.micro_step) if math.isnan(lv) else None
    if not ev.tensor.startswith("loss"):
        value = f"{num(lv)} ({loss_dtype})" if not math.isnan(lv) else "not recorded"
        if held is not None:  # recorded, and not finite: steps.loss is NaN for either
            value = f"{held} ({loss_dtype}), recorded after the backward that sent the gradient"
        evidence.append(f"loss value at step {ev.step}: {value}")
    bad = run.loss_nonfinite_steps()
    if len(bad) > 1:
        evidence.append(f"the loss was non-finite at steps {steps_text(bad)}")
    bad_grad = [e.step for e in run.events if e.phase == "loss" and not e.tensor.startswith("loss")]
    if len(bad_grad) > 1:
        evidence.append(
            f"the gradient arriving at the model's outputs was non-finite at steps {steps_text(bad_grad)}"
        )
    empty = empty_reduction(run, ev)
    if empty is not None:
        evidence.append(
            f"the gradient arriving at the model's outputs was exactly 0 in all {empty} elements while the loss "
            "was NaN: no output element contributed to the loss, so it was a mean over zero elements (0/0)"
        )
    skips = skips_text(run)
    if skips:
        first, last = run.scale_range(run.step_ids)
        symptom = last < first and all(
            not math.isfinite(run.loss.get(st, math.nan)) for st in run.skipped_steps()
        )
        evidence.append(
            skips + " — a symptom: the scale falls because the loss itself is non-finite, not the gradients"
            if symptom
            else skips
        )
    advice: list[str] = []
    if empty is not None:
        advice.append(
            f"Guard the reduction of the batch of step {ev.step}, which selected nothing (every label equal to "
            "`ignore_index`, an empty mask): skip the batch when `(target != ignore_index).sum() == 0`, or divide "
            "by `count.clamp_min(1)` (`(per_element * mask).sum() / mask.sum().clamp_min(1)`)."
            + (
                " The loss already is float32: a wider dtype does not help."
                if loss_dtype == "float32"
                else ""
            )
        )
    elif ev.tensor.startswith("loss"):
        advice += loss_advice(outs, loss_dtype, ev.kind)
    if not ev.tensor.startswith("loss"):
        advice.append(_loss_gradient_advice(run, ev, lv, held))
    shown = "held only a mask's -inf" if masked_outputs(outs) else "were finite"
    summary = (
        f"The model's outputs {shown if len(outs) else 'were not recorded'} but {which} was non-finite at "
        f"step {ev.step}" + (": a mean over zero elements." if empty is not None else ".")
    )
    return Diagnosis("loss", ev, evidence, advice, summary)


def backward_overflow(run: Facts, ev: Overflow) -> Diagnosis:
    gout = run.rows_of(ev.step, ("backward", "loss"), module=ev.module, prefix="grad_output")
    scale = run.scale.get(ev.step, math.nan)
    dtype = compute_dtype(run, ev)
    evidence = [
        f"the backward of {module_label(ev.module)} ({ev.module_type}) at {step_words(ev)} turned finite incoming "
        f"gradients (grad_output absmax {num(finite_absmax(gout))}) into inf in `{ev.tensor}` (computed in {dtype}, "
        f"max {num(dtype_max(dtype))})",
        "loss scale: " + ("none (no GradScaler)" if math.isnan(scale) else num(scale)),
    ]
    w = run.rows_of(ev.step - 1, "optimizer", module=ev.module) if ev.step > 0 else run.records.iloc[0:0]
    if len(w):
        evidence.append(f"its parameters' absmax after step {ev.step - 1}: {num(finite_absmax(w))}")
    fwd_in = run.rows_of(ev.step, "forward", module=ev.module, prefix="input")
    if len(fwd_in):
        evidence.append(f"its forward input absmax was {num(finite_absmax(fwd_in))}")
    param_grad = ev.tensor.endswith(".grad")
    calls = run.rows_of(ev.step, "forward", module=ev.module, prefix="output")
    calls = calls[calls["micro_step"].to_numpy() == ev.micro_step] if len(calls) else calls
    n_calls = int(calls["call"].nunique()) if len(calls) else 0
    if param_grad and n_calls > 1:  # autograd sums every use's share before it reaches .grad
        evidence.append(
            f"{module_label(ev.module)} ran {n_calls} times in this micro-step: `{ev.tensor}` is the sum of the "
            "shares of those calls, so the overflow can be their sum, not one call's product"
        )
    # a parameter's gradient is the incoming gradient times the forward input; an input's is it times the weights
    factor = (
        "large inputs or incoming gradients multiply into it"
        if param_grad
        else "large weights multiply the incoming gradient"
    )
    advice = range_advice(run, ev.module, dtype, ev, backward=True)
    if math.isnan(scale):
        advice.insert(
            0,
            f"With no GradScaler (scale 1) the gradient of {module_label(ev.module)} itself exceeds "
            f"{num(dtype_max(dtype))}: check {'its inputs' if param_grad else 'its weights'} ({factor}), keep it "
            "in float32, or scale the loss down (`(loss / 1024).backward()`, then multiply the float32 gradients "
            "back before the optimizer step).",
        )
    else:
        advice.insert(
            0,
            f"Clip gradients after `scaler.unscale_(optimizer)` (`torch.nn.utils.clip_grad_norm_(params, 1.0)`) "
            f"and check the {'inputs' if param_grad else 'weights'} of {module_label(ev.module)}: its gradient "
            f"overflows at loss scale {num(scale)}.",
        )
    summary = (
        f"The backward of {module_label(ev.module)} ({ev.module_type}) overflowed {dtype} at {step_words(ev)}; "
        + (
            "with no GradScaler, nothing skipped the step."
            if math.isnan(scale)
            else "a GradScaler did not absorb it."
        )
    )
    return Diagnosis("backward_overflow", ev, evidence, advice, summary)


def optimizer(run: Facts, ev: Overflow) -> Diagnosis:
    dtype = str(ev.dtype)
    pname = ev.tensor
    grads = run.rows_of(ev.step, "backward", module=ev.module, prefix=pname + ".grad")
    scale = run.scale.get(ev.step, math.nan)
    gmax = finite_absmax(grads)
    if not math.isnan(scale) and scale > 0:
        gmax /= scale
    before = run.rows_of(ev.step - 1, "optimizer", module=ev.module) if ev.step > 0 else run.records.iloc[0:0]
    opt_name = str(run.options.get("optimizer") or "the optimizer")
    evidence = [
        f"gradients of {module_label(ev.module)} ({ev.module_type}) at step {ev.step} were finite (`{pname}.grad` "
        f"absmax {num(gmax)}, unscaled) but `{pname}` became {ev.kind} ({dtype}) in {opt_name}.step()",
    ]
    if len(before):
        evidence.append(f"its parameters' absmax after step {ev.step - 1}: {num(finite_absmax(before))}")
    adam = "adam" in opt_name.lower() or opt_name == "the optimizer"
    if not math.isnan(gmax) and gmax > 0 and dtype == "float16" and adam:
        mins = grads["absmin"].to_numpy(dtype=np.float64)
        mins = mins[np.isfinite(mins) & (mins > 0)]
        gmin = float(mins.min()) if mins.size else math.nan
        if not math.isnan(scale) and scale > 0:
            gmin /= scale
        zeros = (int(grads["n_zero"].sum()), int(grads["numel"].sum()), f"{pname}.grad")
        evidence.append(
            "Adam's default eps=1e-8 rounds to 0 in float16; " + _adam_square_text(gmax, gmin, zeros)
        )
    lr = run.lr.get(ev.step, math.nan)
    if not math.isnan(lr):
        evidence.append(f"learning rate {num(lr)}")
    if not math.isnan(lr) and not math.isfinite(lr):
        advice = [
            f"Set a finite learning rate: it was {num(lr)} at step {ev.step} (check what set it: a scheduler, a config)."
        ]
    elif is_wide(
        dtype
    ):  # in float32 neither eps nor grad² rounds to 0: the optimizer's own arithmetic did it
        advice = [
            f"In {dtype} a finite gradient becomes non-finite only in {opt_name}.step()'s own arithmetic: an update "
            f"beyond {num(dtype_max(dtype))} or an invalid operation (0/0, a division by a state that is 0). Check "
            "the learning rate and the optimizer's hyper-parameters, and a custom optimizer's step()."
        ]
    else:
        advice = [
            f"Keep float32 master weights: leave the model in float32 and use `torch.autocast(device_type=..., "
            f"dtype=torch.{dtype})` for the compute instead of `model.half()`.",
        ]
    if not is_wide(dtype) and math.isfinite(lr if not math.isnan(lr) else 0.0) and adam:
        advice.insert(
            0,
            f"Raise Adam's eps to ≥1e-4 ({dtype}'s smallest normal is {num(FP16_SMALLEST_NORMAL)}; 1e-8 rounds "
            "to 0), e.g. `torch.optim.Adam(params, eps=1e-4)`.",
        )
    summary = f"Gradients were finite but {opt_name}.step() made `{pname}` of {module_label(ev.module)} non-finite in {dtype}."
    written = unreachable_update(run.view, ev)
    if written is not None:  # the update cannot reach the value: what wrote the weight did
        evidence[0] = evidence[0].replace(f"became {ev.kind} ({dtype}) in", f"was {ev.kind} ({dtype}) after")
        evidence.insert(1, written)
        advice = [
            f"Find what writes `{pname}` of {module_label(ev.module)} outside {opt_name}.step() (a manual edit, a "
            "hook, a state-dict load, a weight average) after the last update and before this one; the learning "
            "rate is not the cause."
        ]
        summary = (
            f"`{pname}` of {module_label(ev.module)} was non-finite after {opt_name}.step() at step {ev.step}, but "
            "no update of it can reach that value: it was written outside optimizer.step()."
        )
    return Diagnosis("optimizer", ev, evidence, advice, summary)


def _adam_square_text(gmax: float, gmin: float, zeros: tuple[int, int, str] = (0, 0, "")) -> str:
    """What float16 does to Adam's grad² (its second moment) at the largest and smallest non-zero |grad|;
    ``zeros``: (values exactly 0, values, the gradient's name), whose grad² is 0 whatever the dtype."""
    tiny = FP16_SMALLEST_SUBNORMAL
    n0, n, name = zeros
    if n0:
        zero = (
            f"; {n0} of {n} values of `{name}` are exactly 0: their grad² and first moment are 0, and with eps 0 "
            "Adam's step there is 0/0 = NaN"
        )
        return (
            _adam_square_text(gmax, gmin).replace("(every value above", "(every non-zero value above") + zero
        )
    if gmax * gmax < tiny:
        return (
            f"in float16 even the largest grad² ({num(gmax)}² = {num(gmax * gmax)}) is below {num(tiny)} and rounds to "
            "0: Adam's step m / (sqrt(v) + eps) is 0/0 or x/0"
        )
    if not math.isnan(gmin) and gmin > 0 and gmin * gmin < tiny:
        return (
            f"in float16 grad² ranges {num(gmin * gmin)}–{num(gmax * gmax)}: the smallest ({num(gmin)}² below "
            f"{num(tiny)}) rounds to 0, so sqrt(v) + eps is 0 where the gradient was small and m / 0 is inf"
        )
    return f"in float16 grad² ranges {num(gmin * gmin)}–{num(gmax * gmax)} (every value above {num(tiny)})"


def clipping_text(clip: tuple[int, float, float]) -> str:
    """The loop's own clipping, as observed at one step."""
    step, before, after = clip
    return (
        f"the loop already clips the gradients: at step {step} their norm was {num(before)} after the backward and "
        f"{num(after)} when optimizer.step() applied them"
    )


def _calm_lr(run: Facts, lr: float) -> tuple[int, float, float] | None:
    """The last recorded step with a learning rate below ``lr`` whose update-to-weight ratio was below
    :data:`DIVERGENCE_UPDATE_RATIO` (near healthy): ``(step, its lr, its ratio)``, or ``None``."""
    ratios = ratio_per_step(run.records, run.written())
    calm = [
        (int(st), run.lr[int(st)], float(r))
        for st, r in zip(ratios.index.tolist(), ratios.tolist(), strict=True)
        if r < DIVERGENCE_UPDATE_RATIO and run.lr.get(int(st), math.nan) < lr
    ]
    return calm[-1] if calm else None


def _lr_advice(run: Facts, div: DivergenceFacts) -> str:
    """Lower the (peak) learning rate with a recipe that needs no estimate: a tenth of it, or the lr of the last
    step whose updates were near healthy; a warmup only when the recorded lr did not already rise."""
    watch = f"and watch the update-to-weight ratio stay near the healthy {HEALTHY_UPDATE_RATIO:g}"
    ratio = (
        f" (the update-to-weight ratio was {num(div.ratio)}; healthy is about {HEALTHY_UPDATE_RATIO:g})"
        if not math.isnan(div.ratio) and div.ratio > 0
        else ""
    )
    if math.isnan(div.lr):
        text = f"Lower the (peak) learning rate (not recorded): try a tenth of it, {watch}"
    else:
        calm = _calm_lr(run, div.lr)
        back = (
            f" or {num(calm[1])}, the lr of step {calm[0]}, whose update-to-weight ratio was {num(calm[2])}"
            if calm is not None
            else ""
        )
        text = (
            f"Lower the learning rate, which was {num(div.lr)} when the run diverged{ratio}: try a peak of "
            f"{num(div.lr / 10)}{back}, {watch}"
            if div.warmup is not None  # the peak is not reached yet: the lr quoted is where it diverged
            else f"Lower the (peak) learning rate from {num(div.lr)}{ratio}: try {num(div.lr / 10)}{back}, {watch}"
        )
    if div.warmup is not None:
        a, lr_a, b, lr_b = div.warmup
        return (
            text
            + f". The loop already warms up (lr {num(lr_a)} at step {a} → {num(lr_b)} at step {b}), and the "
            "run diverged during the rise: lower the peak learning rate or lengthen the warmup."
        )
    return text + "; and add a warmup."


def _no_gradient(run: Facts, step: int | None) -> int | None:
    """How many of the recorded steps before ``step`` (the trailing divergence window) have a gradient norm,
    when every one of them is exactly 0 (at least 2); None otherwise."""
    if step is None:
        return None
    norms = [run.grad_norm[s] for s in sorted(run.grad_norm) if s < step][-DIVERGENCE_WINDOW:]
    norms = [v for v in norms if not math.isnan(v)]
    return len(norms) if len(norms) >= 2 and all(v == 0.0 for v in norms) else None


def divergence_diagnosis(run: Facts, ev: Overflow | None, div: DivergenceFacts) -> Diagnosis:
    evidence = list(div.evidence)
    if ev is not None:
        # earlier events were backoffs the GradScaler absorbed: this one is what the divergence led to
        first = not run.events or run.events[0].step >= ev.step
        what = "first non-finite value" if first else "the overflow the divergence led to"
        evidence.insert(
            0,
            f"{what} at step {ev.step}: {ev.phase} of {module_label(ev.module)} ({ev.module_type}), "
            f"{ev.kind} in `{ev.tensor}` ({ev.dtype})",
        )
    skips = skips_text(run)
    if skips:
        evidence.append(skips)
    advice = [_lr_advice(run, div)]
    clip = run.clipping()
    still = _no_gradient(run, ev.step if ev is not None else div.last_step)
    if still is not None:  # the weights grew with no gradient: the optimizer's own update grew them
        evidence.append(
            f"the gradient norm was exactly 0 at each of the {still} recorded step(s) before: the updates that grew "
            "the weights did not come from gradients"
        )
        advice.append(
            "Clipping gradients cannot help: they were 0. With no gradient, only the optimizer's own terms change "
            "the weights: weight decay (SGD: w ← w·(1 − lr·weight_decay), which grows |w| when lr·weight_decay > 2), "
            "momentum or state carried from earlier steps; check the optimizer's weight_decay and lr."
        )
    elif clip is not None:
        evidence.append(clipping_text(clip))
    elif run.has_scaler():
        advice.append(
            "Clip gradients: `scaler.unscale_(optimizer)` then `torch.nn.utils.clip_grad_norm_(model.parameters(), "
            "1.0)` before `scaler.step(optimizer)`."
        )
    else:
        advice.append(
            "Clip gradients: `torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)` just before `optimizer.step()`."
        )
    grows = (
        "the weights themselves grow step after step"
        if div.weights_steady
        else "each update changes the weights too much for the activations to stay in range"
    )
    wide = compute_dtype(run, ev) if ev is not None else None
    if wide in ("float32", "float64"):
        advice.append(f"A wider dtype does not help: {wide} itself overflowed, and {grows}.")
    else:
        advice.append(f"Keeping a layer in float32 only postpones the overflow: {grows}.")
    drift = data_growth_words(run, ev.step if ev is not None else max(run.step_ids, default=0))
    if drift is not None:  # the inputs grew too: what the learning rate does not explain
        evidence.append(drift[0])
        advice.insert(0, drift[1])
    if ev is None:
        summary = (
            f"{div.grew[0].upper() + div.grew[1:]}: the run is diverging (no overflow yet); the learning rate is "
            "too high."
        )
        ratio = (
            "not recorded"
            if math.isnan(div.ratio)
            else f"{num(div.ratio)} (healthy ≈ {HEALTHY_UPDATE_RATIO:g})"
        )
        lr = "not recorded" if math.isnan(div.lr) else num(div.lr)
        line = f"diverging, no overflow yet: update-to-weight ratio {ratio}, lr {lr}"
        short = line if len(line) <= HEADLINE_MAX else line[: HEADLINE_MAX - 1] + "…"
        return Diagnosis("divergence", None, evidence, advice, summary, headline=short)
    else:
        where = {"forward": "the forward of", "backward": "the backward of", "optimizer": "the update of"}
        what = (
            "the loss"
            if ev.phase == "loss"
            else f"{where.get(ev.phase, '')} {module_label(ev.module)}".strip()
        )
        summary = (
            f"The run diverged: {div.grew} until {what} overflowed at step {ev.step}; the learning rate is too "
            "high."
        )
    return Diagnosis("divergence", ev, evidence, advice, summary)


def compute_dtype(run: Facts, ev: Overflow) -> str:
    """The dtype the overflow happened in: the event's dtype, or, for a float32 parameter gradient of a module
    run under autocast, the half dtype of that module's forward outputs (its gradient was computed in it)."""
    dtype = str(ev.dtype)
    if dtype not in ("float32", "float64"):
        return dtype
    outs = run.rows_of(ev.step, "forward", module=ev.module, prefix="output")
    half = [d for d in outs["dtype"].astype(str).unique().tolist() if d in ("float16", "bfloat16")]
    return half[0] if half else dtype


def producer_text(e: Overflow) -> str:
    if e.phase == "loss":
        return "the loss gradient arriving at the model's outputs"
    return f"the backward of {module_label(e.module)} ({e.module_type}) `{e.tensor}`"
