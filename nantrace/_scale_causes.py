"""The causes about the loss scale and the run as a whole: collapse, benign backoff, gradient underflow, an
overflow outside the traced model, healthy, and the distributed ones (received, made by the reduction)."""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import pandas as pd

from ._causes import bf16_advice, clipping_text, compute_dtype, invalid_op, producer_text, skips_text
from ._diagnosis import (
    HEADLINE_MAX,
    UNDERFLOW_FRACTION,
    UNDERFLOW_SMALL_ABSMAX,
    UNDERFLOW_ZERO_FRACTION,
    Diagnosis,
)
from ._evidence import replay_off
from ._facts import Facts, data_growth_words, unchanged_weights_loss_words, update_ratios, without_written
from ._fmt import module_label, num, steps_text
from ._overflow import Overflow
from ._ranges import finite_absmax, headroom_table, own_parameters
from ._schema import FP16_MAX, FP16_SMALLEST_NORMAL, FP16_SMALLEST_SUBNORMAL, dtype_max

__all__ = [
    "backoff",
    "collapse",
    "healthy",
    "loss_beyond_dtype",
    "outside",
    "received",
    "recurring",
    "reduction_made",
    "stale",
    "underflow",
]


def loss_beyond_dtype(run: Facts, skip_run: list[int], ev: Overflow) -> tuple[float, str] | None:
    """For a run of skips that starts at the first traced step (no step of the trace trained): the largest
    finite loss of those steps and the dtype the event was computed in, when that loss is itself beyond the
    dtype's largest finite value (the scaler would have to fall below 1 before gradients of that size fit);
    else ``None``."""
    if not run.step_ids or skip_run[0] != run.step_ids[0]:
        return None
    values = [run.loss.get(s, math.nan) for s in skip_run]
    finite = [abs(v) for v in values if math.isfinite(v)]
    dtype = compute_dtype(run, ev)
    limit = dtype_max(dtype)
    if not finite or math.isnan(limit) or max(finite) <= limit:
        return None
    return max(finite), dtype


def _lowest_scale_advice(run: Facts, ev: Overflow, gout: pd.DataFrame, at: float) -> tuple[str, bool]:
    """The advice for the event that still overflowed at the lowest scale tried, and whether it is a range
    problem (a value too large, which bfloat16's range helps) rather than an inf factor."""
    dtype = compute_dtype(run, ev)
    limit = num(dtype_max(dtype))
    if ev.phase == "loss":
        if at < 1:
            return (
                f"The gradient of the loss w.r.t. the outputs exceeds {limit} even below loss scale 1 ({num(at)}): "
                "the loss is too large (e.g. a sum over many elements); use a mean, divide it, or compute it in "
                "float32.",
                True,
            )
        return (
            f"The gradient of the loss w.r.t. the outputs still exceeded {limit} at loss scale {num(at)}. If the "
            "scale goes on falling towards 1, the loss is too large for it (e.g. a sum over many elements): use a "
            "mean, divide it, or compute it in float32.",
            True,
        )
    g = finite_absmax(gout)
    clean = len(gout) and int(gout[["n_nan", "n_posinf", "n_neginf"]].to_numpy().sum()) == 0
    if ev.phase == "backward" and clean and g <= 1.0 and not own_parameters(run.records, ev.module):
        # nothing of its own to multiply by, and what came in is at most 1
        return (
            f"{module_label(ev.module)} has no parameters of its own and its incoming gradient's absmax was "
            f"{num(g)} (step {ev.step}, at most 1), so no product of it with a finite {dtype} value exceeds "
            f"{limit}: an op of its backward multiplies by inf or divides by 0 (a custom `autograd.Function`, a "
            "derivative at a singular point). A wider dtype does not remove it; find the op with "
            "nantrace.hunt(step_fn).",
            False,
        )
    w = run.rows_of(ev.step - 1, "optimizer", module=ev.module) if ev.step > 0 else run.records.iloc[0:0]
    wtext = f" (absmax {num(finite_absmax(w))})" if len(w) else ""
    return (
        f"The gradient of {module_label(ev.module)} exceeds {limit} even at loss scale {num(at)}: keep "
        f"{module_label(ev.module)} in float32 (autocast disabled around it), and check its weights{wtext} and "
        "the loss magnitude.",
        True,
    )


def collapse(run: Facts, ev: Overflow | None, skip_run: list[int], then: Overflow | None = None) -> Diagnosis:
    """``ev``: the run's last scale-dependent event, the one that still overflowed at the lowest scale.
    ``then``: the event that does not depend on the loss scale which the skips went on with (``skip_run`` holds
    the steps before it)."""
    first, last = run.scale_range(skip_run)
    below = not math.isnan(last) and last < 1
    evidence = [
        f"{len(skip_run)} consecutive steps skipped by the GradScaler (steps {steps_text(skip_run)}); loss scale "
        f"{num(first)} → {num(last)}" + (" (below 1: the gradients overflow even unscaled)" if below else "")
    ]
    if len(run.skipped_steps()) != len(skip_run):
        evidence.append(str(skips_text(run)))
    advice: list[str] = []
    range_fault = True
    if ev is not None:
        in_run = [e for e in run.events if skip_run[0] <= e.step <= skip_run[-1] and run.scale_dependent(e)]
        groups: dict[str, list[int]] = {}
        for e in in_run:
            groups.setdefault(producer_text(e), []).append(e.step)
        evidence.append(
            "overflowing at each skipped step: "
            + "; ".join(
                f"{k} (step{'s' if len(set(v)) > 1 else ''} {steps_text(v)})" for k, v in groups.items()
            )
        )
        at = run.scale.get(ev.step, math.nan)
        gout = run.rows_of(ev.step, ("backward", "loss"), module=ev.module, prefix="grad_output")
        tried = [v for v in (run.scale.get(s, math.nan) for s in skip_run) if not math.isnan(v)]
        before = "" if then is None else f" before step {then.step}"
        lowest = (  # "lowest" only when it is the minimum of the run's recorded scales
            f"the lowest scale tried{before} ({num(at)}, step {ev.step})"
            if not tried or not at > min(tried)
            else f"the last recorded overflow{before} (loss scale {num(at)}, step {ev.step})"
        )
        evidence.append(
            f"at {lowest} {producer_text(ev)} still overflowed "
            f"({ev.kind}, computed in {compute_dtype(run, ev)})"
            + (
                f"; its incoming gradient absmax was {num(finite_absmax(gout))}"
                if ev.phase == "backward"
                else ""
            )
        )
        text, range_fault = _lowest_scale_advice(run, ev, gout, at)
        advice.append(text)
    if then is not None:
        evidence.append(
            f"from step {then.step} the skips went on with a {then.phase} {then.kind} (`{then.tensor}` of "
            f"{module_label(then.module)}), which does not depend on the loss scale: a separate fault, not part "
            "of this collapse"
        )
    big = loss_beyond_dtype(run, skip_run, ev) if ev is not None else None
    if big is not None:
        lv, dtype = big
        evidence.append(
            f"no traced step trained: the GradScaler skipped every one from step {skip_run[0]} on, and the loss "
            f"itself was {num(lv)}, beyond {dtype}'s largest value {num(dtype_max(dtype))} (×{num(lv / dtype_max(dtype))}) "
            "before any scaling"
        )
        advice.insert(
            0,
            f"Make the loss smaller ({num(lv)}, beyond {dtype}'s {num(dtype_max(dtype))} before any scaling): a mean "
            "instead of a sum, normalised targets, or divide it by a constant.",
        )
    moved = unchanged_weights_loss_words(run, skip_run[0])
    if moved is not None:
        evidence.append(moved)
    drift = data_growth_words(run, skip_run[-1])
    if drift is not None:
        evidence.append(drift[0])
        advice.insert(0, drift[1])
    if range_fault:  # bfloat16's range helps only a value that is too large, not an inf factor
        advice.append(bf16_advice())
    clip = run.clipping()
    if clip is not None:
        evidence.append(clipping_text(clip))
        advice.append(
            "If the scale falls below 1, the gradients are too large for float16 even unscaled: divide the loss "
            "(e.g. use a mean) or compute it in float32."
        )
    else:
        advice.append(
            "Clip gradients after `scaler.unscale_(optimizer)`; if the scale falls below 1, the gradients are too "
            "large for float16 even unscaled: divide the loss (e.g. use a mean) or compute it in float32."
        )
    summary = (
        f"The loss scale kept falling ({num(first)} → {num(last)}) over {len(skip_run)} skipped steps: the "
        "gradients overflow at every scale tried."
        if len(skip_run) > 1
        else f"The gradients overflowed at loss scale {num(first)}, the only scale tried (step {skip_run[0]}), and "
        f"the GradScaler lowered it to {num(last)}"
        + (": they overflow without loss scaling." if first <= 1 else ".")
    )
    return Diagnosis("loss_scale_collapse", ev, evidence, advice, summary)


def recurring(run: Facts, events: list[Overflow]) -> Diagnosis:
    """The same NaN producer in separate skip runs, each time at a loss scale no higher than before: a real
    invalid operation that recurs (e.g. every batch of one kind), not a backoff."""
    ev = events[0]
    key = (ev.phase, ev.module, ev.tensor)
    later = [e for e in run.events if e.kind == "nan" and (e.phase, e.module, e.tensor) == key]
    events = sorted({e.step: e for e in [*events, *later]}.values(), key=lambda e: e.step)
    d = invalid_op(run, ev)
    scales = ", ".join(num(run.scale.get(e.step, math.nan)) for e in events)
    steps = steps_text([e.step for e in events])
    d.evidence.append(
        f"the same NaN in `{ev.tensor}` of {module_label(ev.module)} came back at steps {steps}, in separate runs of "
        f"skipped steps, at loss scale {scales}: a lower scale did not remove it, so it is not an overflow the "
        "GradScaler absorbs"
    )
    d.summary = f"{d.summary} It came back at steps {steps} at a lower loss scale: not a benign backoff."
    return d


def stale(run: Facts, in_run: list[Overflow], skip_run: list[int]) -> Diagnosis:
    """A run of skipped steps in which parameters' ``.grad`` already held inf/NaN before the backward added to
    it: the loop does not reset the gradients, so one overflow stays in ``.grad`` and every later step is skipped
    however finite its own gradients are."""
    ev = in_run[0]
    at = run.stale_steps(skip_run)
    n = int(max(run.stale.get(s, 0.0) for s in at))
    first, last = run.scale_range(skip_run)
    fresh = [e for e in in_run if e.step in at]
    gout = (
        run.rows_of(fresh[-1].step, ("backward", "loss"), module=fresh[-1].module, prefix="grad_output")
        if fresh
        else run.records.iloc[0:0]
    )
    evidence = [
        f"first non-finite value at step {ev.step}: {producer_text(ev)} ({ev.kind}, loss scale "
        f"{num(run.scale.get(ev.step, math.nan))})",
        f"at steps {steps_text(at)} the `.grad` of {n} parameter(s) already held inf/NaN before the backward "
        "added to it: the loop did not reset the gradients (no `zero_grad()` since), so that value stays in `.grad` and every later step "
        "is skipped",
        f"{len(skip_run)} consecutive steps skipped (steps {steps_text(skip_run)}); loss scale {num(first)} → "
        f"{num(last)}",
    ]
    if len(gout) and not int(gout[["n_nan", "n_posinf", "n_neginf"]].to_numpy().sum()):
        evidence.append(
            f"the fresh gradient arriving at {module_label(fresh[-1].module)} at step {fresh[-1].step} was finite "
            f"(grad_output absmax {num(finite_absmax(gout))}): only the carried-over `.grad` is not"
        )
    advice = [
        "Reset the gradients every step: `optimizer.zero_grad()` (or `model.zero_grad()`) before the backward "
        "(with gradient accumulation, after each `optimizer.step()`/`scaler.step()`). Keeping layers in float32 "
        "or a lower loss scale does not help: the inf is already in `.grad`.",
    ]
    summary = (
        f"The gradients are never reset: the {ev.kind} of step {ev.step} stays in `.grad`, so the GradScaler skips "
        f"every step from {skip_run[0]} on and the loss scale falls ({num(first)} → {num(last)})."
    )
    return Diagnosis("loss_scale_collapse", ev, evidence, advice, summary)


def backoff(run: Facts, benign: list[Overflow]) -> Diagnosis:
    sk = run.skipped_steps()
    ev = benign[0] if benign else None
    evidence = []
    if ev is not None:
        evidence.append(
            f"step {ev.step}: the backward of {module_label(ev.module)} ({ev.module_type}) overflowed ({ev.kind} in "
            f"`{ev.tensor}`) at loss scale {num(run.scale.get(ev.step, math.nan))}"
        )
    skips = skips_text(run)
    if skips:
        evidence.append(skips)
    last = sk[-1] if sk else -1
    n_after = sum(1 for s in run.step_ids if s > last and run.skipped.get(s) is False)
    if n_after:
        evidence.append(f"then {n_after} step{'' if n_after == 1 else 's'} trained without a skip")
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
    tail = f"the GradScaler skipped {len(sk)} step(s)" + (
        ", then training proceeded." if n_after else "; the trace ends there."
    )
    summary = f"Benign loss-scale backoff: {tail}"
    moved = unchanged_weights_loss_words(run, run.skip_run(sk[-1])[0]) if sk else None
    if moved is not None:
        evidence.append(moved)
    drift = data_growth_words(run, max(run.step_ids, default=0))
    if drift is not None:  # not benign: what the model is fed keeps growing
        evidence.append(drift[0])
        advice = [
            drift[1],
            "The skipped steps are the GradScaler reacting to it; a lower scale does not stop it.",
        ]
        summary = f"Loss-scale backoff while the model's inputs grow: {tail}"
    return Diagnosis("scaler_backoff", ev, evidence, advice, summary)


def underflow(run: Facts) -> Diagnosis | None:
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
    all_zeros, all_numel = zeros.sum(), numel.sum()  # the overall share, before any row is left out
    exact = zeros >= numel  # only an all-zero gradient can be proven exactly 0
    if exact.any():
        exact[exact] = _exact_zeros(run, g[exact])
    if exact.any():  # proven exactly 0 (cancellation), not flushed: out of the verdict
        keep = ~exact
        exact_names = (
            g["module"].astype(str) + "." + g["tensor"].astype(str).str.removesuffix(".grad")
        ).to_numpy()[exact]
        g, numel, zeros, absmax = g[keep], numel[keep], zeros[keep], absmax[keep]
        zero_frac, flushed = zero_frac[keep], flushed[keep]
        if not len(g):
            return None
    frac = float(flushed.mean())
    if frac < UNDERFLOW_FRACTION:
        return None
    names = (g["module"].astype(str) + "." + g["tensor"].astype(str).str.removesuffix(".grad")).to_numpy()
    scales = [v for v in run.scale.values() if not math.isnan(v)]
    scale_text = (
        "no GradScaler (loss scale 1)" if not scales else f"loss scale {num(min(scales))}–{num(max(scales))}"
    )
    evidence = [
        f"{frac:.0%} of the parameter-gradient tensors ({int(flushed.sum())} of {len(flushed)} over "
        f"{len(set(g['step'].tolist()))} steps) were flushed: largest |g| below float16's smallest normal "
        f"{num(FP16_SMALLEST_NORMAL)} (every value subnormal or 0), or below {num(UNDERFLOW_SMALL_ABSMAX)} with "
        f"≥{UNDERFLOW_ZERO_FRACTION:.0%} zeros",
        f"overall {all_zeros / max(all_numel, 1):.0%} of parameter-gradient elements were exactly 0",
        scale_text,
    ]
    evidence += _flushed_lines(names, zero_frac, absmax, flushed)
    if exact.any():
        evidence.append(_exact_words(exact_names, int(exact.sum())))
    fp16_grads = r[(run.phase == "backward") & (dt == "float16")]
    if len(fp16_grads):
        evidence.append(f"largest float16 gradient anywhere: {num(finite_absmax(fp16_grads))}")
    produced = run.events
    if produced:
        kinds = " and ".join(sorted({"NaN" if e.kind == "nan" else "inf" for e in produced}))
        evidence.insert(
            0,
            f"the trace holds {kinds} produced at steps {steps_text([e.step for e in produced])} (first: "
            f"{producer_text(produced[0])}, step {produced[0].step}), each a step the GradScaler skipped",
        )
    advice = _underflow_advice(scales, produced)
    lost = f"{frac:.0%} of parameter-gradient tensors lost most of their values."
    summary = (
        f"Besides the overflows the GradScaler skipped (steps {steps_text([e.step for e in produced])}), float16 "
        f"gradients flush to zero: {lost}"
        if produced
        else f"No inf/NaN, but float16 gradients flush to zero: {lost}"
    )
    headline = (
        f"{frac:.0%} of float16 parameter-gradient tensors flushed to zero ({int(flushed.sum())} of "
        f"{len(flushed)}), {scale_text}"
    )
    return Diagnosis("gradient_underflow", None, evidence, advice, summary, headline=headline[:HEADLINE_MAX])


def _underflow_advice(scales: list[float], produced: list[Overflow]) -> list[str]:
    """The underflow verdict's advice: a GradScaler when there is none, else what lowered its scale."""
    advice: list[str] = []
    if not scales:
        advice.append(
            "Use a GradScaler: `scaler = torch.amp.GradScaler()`, `scaler.scale(loss).backward()`, "
            "`scaler.step(optimizer)`, `scaler.update()` — it multiplies the loss (default 65536) so small "
            "gradients stay above float16's subnormal limit 6e-08."
        )
    elif produced:
        advice.append(
            f"The GradScaler lowered the loss scale to {num(min(scales))} because of the overflows at steps "
            f"{steps_text([e.step for e in produced])}: raising `init_scale` alone brings them back. Remove their "
            f"cause first ({producer_text(produced[0])}: keep it in float32 or normalise its input), so the "
            "scaler can keep a scale high enough for the small gradients."
        )
    else:
        advice.append(
            f"The loss scale ({num(min(scales))}) is too small for these gradients: raise `init_scale` and find why "
            "the scaler lowered it."
        )
    advice.append(bf16_advice())
    advice.append(
        "Or keep float32 gradients (autocast rather than `model.half()`), and check the loss is not tiny."
    )
    return advice


def _exact_words(names: np.ndarray, n: int) -> str:
    """The evidence line naming the all-zero gradients proven exact (:func:`_exact_zeros`)."""
    left = sorted(set(names.tolist()))
    shown = ", ".join(f"`{x}.grad`" for x in left[:3]) + (
        f" and {len(left) - 3} more" if len(left) > 3 else ""
    )
    return (
        f"left out as exactly 0, not flushed: {shown} ({n} all-zero tensors): every product of "
        "a non-zero value of the gradient arriving at their module and of its input is at least float16's "
        f"smallest subnormal {num(FP16_SMALLEST_SUBNORMAL)}, so none rounds to 0; their zeros are sums that "
        "cancel"
    )


def _exact_zeros(run: Facts, g: pd.DataFrame) -> np.ndarray:
    """Per parameter-gradient row of ``g``: its zeros are proven exact, not flushed. Its module is a leaf (no
    recorded module inside it, so its parameters' gradients are sums of products of the gradient arriving at
    its output and of its input, or of that gradient alone), and at that step the smallest non-zero |value| of
    the gradient arriving at it (``grad_output``) times the smallest non-zero |value| of its input is at least
    float16's smallest subnormal: no product rounds to 0, and a sum of non-zero float16 values is 0 only when
    they cancel. False where a row it needs was not recorded or holds inf/NaN."""
    r = run.records
    modules = set(r["module"].astype(str).tolist())
    out = np.zeros(len(g), dtype=bool)
    for i, (step, module) in enumerate(
        zip(g["step"].tolist(), g["module"].astype(str).tolist(), strict=True)
    ):
        if any(m != module and m.startswith(f"{module}." if module else "") for m in modules):
            continue  # a composite module: its parameters' gradients pass through ops inside it
        at = (run.step == int(step)) & (run.module == module) & ~run.nonfinite
        grad = r[at & (run.phase == "backward") & run.starts("grad_output")]
        inp = r[at & (run.phase == "forward") & run.starts("input")]
        gmin = float(grad["absmin"].min()) if len(grad) else math.nan
        xmin = float(inp["absmin"].min()) if len(inp) else math.nan
        out[i] = bool(gmin * xmin >= FP16_SMALLEST_SUBNORMAL)
    return out


def _flushed_lines(
    names: np.ndarray, zero_frac: np.ndarray, absmax: np.ndarray, flushed: np.ndarray
) -> list[str]:
    """Up to three parameter gradients that were flushed (only rows meeting the rule), most zeros first."""
    df = pd.DataFrame({"name": names, "zero": zero_frac, "absmax": absmax, "flushed": flushed})
    total = df.groupby("name")["flushed"].size()
    worst = (
        df[df["flushed"]]
        .groupby("name")
        .agg(zero=("zero", "mean"), absmax=("absmax", "max"), n=("flushed", "size"))
    )
    worst = worst.sort_values(["zero", "absmax"], ascending=[False, True])
    lines = []
    seen = dict(zip(total.index.astype(str).tolist(), total.tolist(), strict=True))
    for name, row in list(worst.iterrows())[:3]:
        if row["zero"] >= 1.0 and float(row["absmax"]) == 0.0:
            lines.append(
                f"`{name}.grad`: all zeros at {int(row['n'])} of {int(seen[str(name)])} recorded steps (exactly 0, "
                f"or flushed below float16's smallest subnormal {num(FP16_SMALLEST_SUBNORMAL)}: the trace cannot "
                "tell which)"
            )
            continue
        lines.append(
            f"`{name}.grad`: {row['zero']:.0%} zeros, absmax {num(float(row['absmax']))} (flushed at "
            f"{int(row['n'])} of {int(seen[str(name)])} recorded steps)"
        )
    return lines


def outside(run: Facts) -> Diagnosis:
    """The GradScaler skipped steps but the whole model's backward, recorded, stayed finite: the overflow the
    scaler found was in gradients this trace does not hold."""
    sk = run.skipped_steps()
    evidence = [
        f"no value recorded in this model's forward, loss or backward held inf/NaN, at the skipped steps "
        f"{steps_text(sk)} or any other (the backward of every module and parameter was traced)",
        "so the non-finite gradients the scaler found were outside the traced model: another model sharing "
        "the GradScaler (e.g. a GAN's discriminator), or parameters the optimizer steps that are not in it",
    ]
    skips = skips_text(run)
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
    head = f"GradScaler skipped step(s) {steps_text(sk)}; this model's traced gradients stayed finite"
    return Diagnosis("scaler_backoff", None, evidence, advice, summary, headline=head[:HEADLINE_MAX])


def _transient_blind(run: Facts) -> str | None:
    """Why the trace could not look for a transient inf (a finite call with an inf inside) on some steps, from
    its options: the drill-down off, statistics on the sync-free path (no host statistics, no replay), or light
    steps (``every`` > 1: only tensors holding inf/NaN get a row, so no signal is read). None when it could."""
    o = run.options
    off = replay_off(o)
    if off == "drill":
        return "drill=False: no finite module call was replayed, so a transient inf inside one is not seen"
    if off == "sync_free":
        return (
            "statistics were computed on the sync-free path (on-device reductions): the drill-down replays no "
            "module call there, so a transient inf inside one is not seen"
        )
    every = o.get("every")
    steps = [int(s) for s in run.steps["step"].tolist()] if "step" in run.steps.columns else []
    if isinstance(every, int) and every > 1:
        light = sum(1 for s in steps if s % every)
        if light:
            return (
                f"{light} of {len(steps)} steps were light (every={every}: only tensors holding inf/NaN get a "
                "row), so no signal of a transient inf inside a module was read on them"
            )
    return None


def healthy(run: Facts) -> Diagnosis:
    evidence = [f"{len(run.step_ids)} steps, {len(run.records)} records, no inf/NaN produced"]
    skips = skips_text(run)
    if skips:
        evidence.append(skips)
    hr = headroom_table(run.records, top=1, ops=run.ops)
    if len(hr):
        r = hr.iloc[0]
        bits, absmax = float(r["headroom_bits"]), float(r["absmax"])
        room = (
            f"headroom {bits:.1f} bits below float16's 65504"
            if bits >= 0
            else f"exceeds float16's 65504 by {-bits:.1f} bits (×{num(absmax / FP16_MAX)}): it would overflow in float16"
        )
        evidence.append(
            f"least float16 headroom: {module_label(str(r['module']))} ({r['module_type']}), absmax {num(absmax)}, {room}"
        )
    ur = without_written(update_ratios(run.records), run.written())["ratio"].to_numpy(dtype=np.float64)
    ur = ur[np.isfinite(ur)]
    head = f"{len(run.step_ids)} steps, every recorded value finite"
    if ur.size:
        evidence.append(
            f"update-to-weight ratio (change of a parameter's absmax per step): median {num(float(np.median(ur)))}, "
            f"max {num(float(ur.max()))}"
        )
        head += f"; median update-to-weight ratio {num(float(np.median(ur)))}"
    summary = "Healthy: every recorded value was finite and nothing points to a fault."
    st = run.steps
    watched = (
        int((st["recorded"].astype(str) == "watch").sum()) if "recorded" in st.columns and len(st) else 0
    )
    blind = _transient_blind(run)
    if blind:
        evidence.append(blind)
        summary = (
            "Healthy as far as recorded: every recorded value was finite, but a transient inf inside a module "
            "(turned finite by its own code, e.g. tanh(inf) = 1) could not be looked for on every step."
        )
    if watched:
        # nantrace.watch: those steps' sentinel saw the model's inputs, outputs, loss, gradients and parameters only
        evidence.append(
            f"{watched} of {len(st)} steps were only watched (nantrace.watch's sentinel: model inputs, outputs, "
            "loss, gradients, parameters); a value that went non-finite and back to finite inside the model on "
            "those steps is not seen"
        )
        summary = (
            f"Healthy as far as recorded: every recorded value was finite; {watched} of {len(st)} steps were only "
            "watched, so a transient inf inside the model on those steps would not show."
        )
    return Diagnosis("healthy", None, evidence, [], summary, headline=head[:HEADLINE_MAX])


def received(run: Facts, ev: Overflow, producer: Overflow | None, world_size: int | None) -> Diagnosis:
    """``ev`` is only in this rank's reduced gradients: another rank (``producer`` when known) produced it."""
    of = f" of {world_size}" if world_size else ""
    local = run.records
    if "reduced" in local.columns:
        local = local[~local["reduced"].to_numpy(dtype=bool)]
    lrows = local[(local["step"].to_numpy() == ev.step)]
    evidence = [
        f"rank {ev.rank}{of}: every local value at step {ev.step} was finite (largest local absmax "
        f"{num(finite_absmax(lrows))}), but `{ev.tensor}` of {module_label(ev.module)} held {ev.kind} after the gradient "
        "reduction (DDP all-reduce / FSDP reduce-scatter): received from another rank, not produced here"
    ]
    if run.skipped.get(ev.step) is True:
        evidence.append(
            f"the GradScaler skipped step {ev.step} (loss scale {num(run.scale.get(ev.step, math.nan))}) on the "
            "reduced gradients; whether that was a benign backoff depends on what the producing rank did"
        )
    if producer is not None:
        where = "the model inputs" if producer.phase == "data" else module_label(producer.module)
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


def reduction_made(run: Facts, ev: Overflow, world_size: int | None) -> Diagnosis:
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
    scaled = f", still multiplied by the loss scale {num(scale)}" if scale > 1 else ""  # NaN: no GradScaler
    evidence = [
        f"at step {ev.step} every rank's local gradients were finite; on rank {ev.rank} the local `{ev.tensor}` of "
        f"{module_label(ev.module)} had absmax {num(finite_absmax(same))} (largest local parameter gradient "
        f"{num(finite_absmax(local))}{scaled})",
        f"after the gradient reduction `{ev.tensor}` held {ev.kind} ({ev.dtype}): the reduction itself produced "
        "it, not a rank's forward or backward",
        f"float16 overflows above {num(FP16_MAX)}: a communication hook that casts gradients to float16 before the "
        "all-reduce (DDP's `fp16_compress_hook`) turns a larger gradient into inf",
    ]
    if world_size:
        evidence.append(f"world size {world_size}")
    advice = [
        "Use bfloat16 compression (`bf16_compress_hook`: float32's range, max 3.4e38) or no compression hook, "
        "so the reduction keeps the gradients' range.",
        f"Or keep float16 compression but scale the gradients down before the cast (divide by the world size "
        f"before casting, not after), so that no gradient exceeds {num(FP16_MAX)}"
        + (
            f"; with a GradScaler they are reduced still scaled ({num(scale)}): a lower `init_scale` also helps."
            if scale > 1
            else "."
        ),
    ]
    summary = (
        f"The gradient reduction overflowed at step {ev.step}: every rank's local gradients were finite, the "
        f"reduced `{ev.tensor}` of {module_label(ev.module)} was {ev.kind} (e.g. float16 gradient compression)."
    )
    cause = "backward_overflow" if ev.kind == "inf" else "invalid_op"
    return Diagnosis(cause, ev, evidence, advice, summary)
