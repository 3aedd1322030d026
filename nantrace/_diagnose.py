"""Diagnosis: from a recorded trace, *why* the run went non-finite, and what to change.

:func:`diagnose` returns a :class:`Diagnosis` whose ``cause`` is exactly one of :data:`CAUSES`.
:func:`fp16_readiness` lists, from an fp32 or bf16 run, the modules whose values would not fit float16.
:func:`update_ratios` gives the per-step update-to-weight ratio of each parameter.

How a cause is decided (the thresholds are the constants of ``nantrace._diagnosis``)
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
  a skipped step are left out of these series (their weights did not change). The loss need not agree when the
  activations grew at least :data:`QUIET_DIVERGENCE_GROWTH` times with a median update ratio of at least
  :data:`DIVERGENCE_UPDATE_RATIO` (the loss can stay flat while one layer's logits grow, as in attention logit
  growth). With fewer than :data:`DIVERGENCE_MIN_STEPS` steps of history it is divergence when a signal is strong
  between the last two fresh steps: the loss grew at least :data:`DIVERGENCE_JUMP_LOSS` times and the gradient
  norm at least :data:`DIVERGENCE_JUMP_GRAD_NORM` times, or the update ratio was at least
  :data:`DIVERGENCE_JUMP_UPDATE_RATIO` while the loss or the gradient norm grew :data:`DIVERGENCE_GROWTH` times.
  The advice reads the loop: no "add a warmup" when the recorded lr rose over those steps (the loop warms up), no
  "clip gradients" when ``steps.applied_grad_norm`` (the norm when ``optimizer.step()`` ran) was below
  :data:`CLIP_OBSERVED_FRACTION` of ``steps.grad_norm`` at some step (the loop clips).
* ``loss``: phase ``loss`` (outputs finite; the loss, or the gradient it sends back, is not). A NaN loss whose
  gradient at the model's outputs was recorded finite and exactly 0 in every element is a mean over zero elements
  (every label ``ignore_index``, an empty mask): the advice guards the reduction instead of a wider dtype.
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

Under torch.distributed (see ``nantrace._locate``) an event is first checked for where it came from, before the
rules above. One rank's trace (a part, or ``Trace.rank_view(r)``) holds an event with ``propagated=True`` when
the rank's own values were finite and the value arrived through the gradient reduction: ``received``, since this
rank's rows cannot say what another rank did (the merged folder names the producer). In a merged trace the same
event is passed over when the rank that produced it (the merged locator's producer of that step) did so in a
scale-dependent way (a backoff that the other rank only shared), and is ``received`` naming that rank otherwise;
when the merged locator found that the reduction itself made the value (every rank's local gradients finite),
it is ``backward_overflow`` (``invalid_op`` for NaN) with the local absmax and the reduction as evidence.

A scale-dependent event belongs to a *run* of consecutive skipped steps. The run ends before its first event that
does not depend on the loss scale (a ``data`` or ``forward`` event, a loss that is itself non-finite): a lower
scale cannot make or remove that one, so the skips from it on are its own (a fault in its own right) and say
nothing about the scale. The steps before it are judged as a run that did not end the trace: a collapse by
their own steps (its evidence names the fault that followed; "the lowest scale tried" is over those steps), else
a backoff, and the fault gets the diagnosis it gets on its own, with one more line of evidence naming the
backoff before it in its run of skips (the steps, producers and loss scales). When a step of the run has
``steps.stale_grads > 0`` (a parameter's ``.grad`` already held inf/NaN before that step's backward added to it:
the loop does not reset the gradients), it is ``loss_scale_collapse`` naming the stale ``.grad`` and
``zero_grad()``, however short the run. The run is a *collapse* when it is at
least :data:`COLLAPSE_RUN` steps long (the scale fell 256x in a row), or the loss scale falls below 1, or at least
half the steps from its start on are skipped and either :data:`COLLAPSE_RUN` of them are or the skips come back
in at least :data:`COLLAPSE_RECURRING` separate runs while the scale fell at least 2**(COLLAPSE_RECURRING - 1)
times (the scale keeps falling; a scaler that grows and backs off in turn does not), except a run that opens
the trace and ends with training resumed at a scale of at least 1, however long: the GradScaler walking down from
an ``init_scale`` too high for the gradients (a benign backoff, told the scale it settled on). A run the trace ends in that
starts at the first traced step (no step trained) while the loss itself is beyond the compute dtype's largest
value counts as a collapse. For a collapse, or a run the trace ends in: mostly-NaN events are
``invalid_op`` (NaN does not go away with a lower scale); a collapse is ``divergence`` when the divergence rule
holds over the steps up to its last event, else ``loss_scale_collapse`` (its ``overflow`` is the run's last
event: what still overflowed at the lowest scale). Any other run is a benign backoff and the search goes on,
except a NaN event whose producer (phase, module, tensor) already made NaN in an earlier, separate run at a loss
scale no lower: a lower scale did not remove it, so it is ``invalid_op`` (a NaN that recurs with one kind of
batch is a fault, not a backoff).

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
update ratio or weights agree; ``divergence`` with no overflow when the median update-to-weight ratio over the
recorded steps is at least :data:`UNHEALTHY_UPDATE_RATIO` (100x the healthy 1e-3: every step changes the weights
by a tenth of their size; such a run is never healthy, whatever the activations did); ``scaler_backoff`` when
benign backoffs were seen; else ``healthy``.

The overflow a ``divergence`` names (for a collapse or benign backoffs) is the one the growth led to: the first
scale-dependent event at or after the last step of the window the rule read, else the last one before it; a routine
backoff before the growth is not it. A ``gradient_underflow`` in a trace that holds skipped overflows says so
(no "No inf/NaN") and lists only the gradients that meet the flushed definition above.

Update-to-weight ratio
----------------------
Estimated from consecutive ``optimizer``-phase rows of the same parameter: ``|absmax_t - absmax_p| / (t - p) /
absmax_p`` for the step ``p`` it was recorded before (:func:`update_ratios`; a change per step under ``every=N``
and ``watch`` too), a lower bound on ``max|Δw| / max|w|``; healthy training is about 1e-3.
Parameters are recorded only when ``optimizer=`` is given to ``nantrace.trace``. ``lr`` and ``grad_norm`` from
``steps`` are reported alongside as evidence.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace

from . import _causes as c
from . import _scale_causes as sc
from ._diagnosis import COLLAPSE_RUN, QUIET_DIVERGENCE_GROWTH, QUIET_DIVERGENCE_LOSS_GROWTH, Diagnosis
from ._evidence import NORMALISED_STEP_BOUND, WEIGHTS_HELD, backward_bound, handed_in, headline, op_evidence
from ._explain import explained, first_overflow, overflows
from ._facts import DivergenceFacts, Facts, divergence, fast_updates, overflow_from_row
from ._fmt import num, steps_text
from ._overflow import Overflow
from ._view import RunView

__all__ = ["FAULT_RULES", "Rule", "diagnose", "diagnose_merged", "with_event_facts"]


# ---------------------------------------------------------------------------------------------- fault rules
@dataclass(frozen=True)
class Rule:
    """One cause of a fault event: ``applies(facts, event)`` decides, ``build(facts, event)`` writes it."""

    cause: str
    applies: Callable[[Facts, Overflow], bool]
    build: Callable[[Facts, Overflow], Diagnosis]


def _diverging(run: Facts, ev: Overflow) -> bool:
    """The divergence rule, except for a forward value made at an op's singular point or by mask arithmetic
    (a sqrt of a negative, a log of 0, x/0, a masked row), or computed from the module's own weights that
    already held it (written before the forward): growth is not what made those, and the text of a divergence
    would call them an overflow."""
    if ev.phase == "forward":
        oe = op_evidence(run.view, ev)
        if oe is not None and (oe.op_class in ("singular", "mask_arithmetic") or oe.what == WEIGHTS_HELD):
            return False
    return divergence(run, ev.step, ev.module if ev.phase == "forward" else None).found


def _divergence(run: Facts, ev: Overflow) -> Diagnosis:
    div = divergence(run, ev.step, ev.module if ev.phase == "forward" else None)
    # the backoff of ev's own run of skips is told by _with_backoff: only the runs before it here
    return _divergence_led_to(run, ev, div, before_run=True)


def _divergence_led_to(
    run: Facts, ev: Overflow | None, div: DivergenceFacts, before_run: bool = False
) -> Diagnosis:
    """The divergence diagnosis naming ``ev``, with a line saying what the earlier overflows were when ``ev`` is
    not the first (:func:`_earlier_backoffs`)."""
    d = c.divergence_diagnosis(run, ev, div)
    line = _earlier_backoffs(run, ev, before_run) if ev is not None else None
    return d if line is None else replace(d, evidence=[*d.evidence[:1], line, *d.evidence[1:]])


def _overflow_parts(run: Facts, before: list[Overflow]) -> list[str]:
    """One clause per producer and kind of the backoffs ``before``: the steps and the loss scales they
    overflowed at."""
    groups: dict[tuple[str, str], list[int]] = {}
    for b in before:
        at = groups.setdefault((c.producer_text(b), b.kind), [])
        if b.step not in at:
            at.append(b.step)
    parts = []
    for (producer, kind), at in groups.items():
        lo, hi = num(run.scale.get(at[0], math.nan)), num(run.scale.get(at[-1], math.nan))
        scales = f"loss scale {lo}" if len(at) == 1 else f"loss scales {lo} → {hi}"
        parts.append(
            f"at step{'s' if len(at) > 1 else ''} {steps_text(at)} {producer} overflowed ({kind}) at {scales}"
        )
    return parts


def _earlier_backoffs(run: Facts, ev: Overflow, before_run: bool) -> str | None:
    """Evidence for a divergence that names a later overflow than the trace's first: the scale-dependent
    overflows before ``ev`` (before its own run of skipped steps when ``before_run``) were GradScaler backoffs,
    with their steps, producers and loss scales, and the steps trained after them; None when there are none."""
    until = (run.skip_run(ev.step)[0], -1) if before_run else (ev.step, ev.micro_step)
    before = [b for b in run.events if (b.step, b.micro_step) < until and run.scale_dependent(b)]
    if not before:
        return None
    parts = _overflow_parts(run, before)
    steps = sorted({b.step for b in before})
    trained = [s for s in run.step_ids if steps[-1] < s < ev.step and run.skipped.get(s) is False]
    went_on = (
        f", and training went on at step{'s' if len(trained) > 1 else ''} {steps_text(trained)}"
        if trained
        else ""
    )
    many = len(steps) > 1
    first = (
        (" (the first is what first_overflow() names)" if many else " (what first_overflow() names)")
        if run.events and before[0] is run.events[0]
        else ""
    )
    lowered = all(run.next_scale.get(s, math.nan) < run.scale.get(s, math.nan) for s in steps)
    return (
        f"before it, step{'s' if many else ''} {steps_text(steps)} {'were' if many else 'was'} GradScaler "
        f"backoff{'s' if many else ''}{first}: {'; '.join(parts)}; the GradScaler skipped "
        f"{'those steps' if many else 'the step'}{' and lowered the scale' if lowered else ''}{went_on}"
    )


def _mask_leak(run: Facts, ev: Overflow) -> Diagnosis:
    return c.mask_leak(run, ev, c.leaked_masks(run, ev) or [])


def _forward_overflow(run: Facts, ev: Overflow) -> bool:
    """The evidence engine classes the producing op as an overflow, a cast or a reduction (a singular point,
    an invalid operation or mask arithmetic is ``invalid_op``)."""
    oe = op_evidence(run.view, ev) if ev.phase == "forward" else None
    return oe is not None and oe.cause == "forward_overflow"


def _backward_overflow(run: Facts, ev: Overflow) -> bool:
    """A backward inf, except one that no product of the recorded magnitudes reaches (a singular point of a
    derivative, :func:`nantrace._evidence.backward_bound`): that is ``invalid_op``."""
    return ev.phase == "backward" and ev.kind == "inf" and backward_bound(run.view, ev) is None


# The causes of an event that is not scale-dependent, in the order they are tried: the first that applies wins.
FAULT_RULES: tuple[Rule, ...] = (
    Rule("data", lambda run, ev: ev.phase == "data" or handed_in(run.view, ev), c.data),
    Rule("divergence", _diverging, _divergence),
    Rule("loss", lambda run, ev: ev.phase == "loss", c.loss),
    Rule("data", lambda run, ev: ev.phase == "forward" and c.leaked_masks(run, ev) is not None, _mask_leak),
    Rule("forward_overflow", _forward_overflow, c.forward_overflow),
    Rule("invalid_op", lambda run, ev: ev.phase == "forward", c.invalid_op),
    Rule("backward_overflow", _backward_overflow, c.backward_overflow),
    Rule("invalid_op", lambda run, ev: ev.phase == "backward", c.invalid_op),
    Rule("optimizer", lambda run, ev: True, c.optimizer),
)


def _fault(run: Facts, ev: Overflow) -> Diagnosis:
    rule = next(r for r in FAULT_RULES if r.applies(run, ev))
    return rule.build(run, ev)


def _judge_skip_run(
    run: Facts, skip_run: list[int], in_run: list[Overflow], fault: Overflow | None = None
) -> Diagnosis | None:
    """A run of skipped steps whose events a lower scale could remove: ``None`` when it is a benign backoff,
    else the diagnosis (collapse, divergence, or invalid_op for NaN that persists). ``fault``: the
    scale-independent event the skips went on with (``skip_run`` then holds only the steps before it)."""
    if in_run and run.stale_steps(skip_run):
        return sc.stale(run, in_run, skip_run)  # the loop keeps an old inf in .grad: never a backoff
    collapse = run.is_collapse(skip_run)
    if collapse and _a_later_run_collapses(run, skip_run):
        return None  # short itself, a collapse only by what follows: the later run is the one to describe
    # a run cut by a fault did not end the trace: it is a collapse by its own steps, else a backoff
    resumed = fault is not None or run.resumed_after(skip_run[-1])
    if not (collapse or not resumed) or not in_run:
        return None
    nans = [e for e in in_run if e.kind == "nan"]
    if 2 * len(nans) > len(in_run):
        return c.invalid_op(run, nans[0])
    if not collapse and sc.loss_beyond_dtype(run, skip_run, in_run[-1]) is None:
        return None  # short and at the end of the trace: a backoff still in progress
    until = math.inf if fault is None else fault.step
    dependent = [e for e in run.events if run.scale_dependent(e) and e.step < until]
    div = divergence(run, dependent[-1].step + 1, None)
    if div.found:
        return _divergence_led_to(run, _led_to(dependent, div), div)
    return sc.collapse(run, in_run[-1], skip_run, then=fault)


def _until_fault(run: Facts, step: int) -> tuple[list[int], Overflow | None]:
    """The run of skipped steps around the scale-dependent event of ``step``, cut before the first event of it
    that does not depend on the loss scale (a data or forward value, a loss that is itself non-finite), and
    that event (``None`` when there is none). A loss scale cannot make such an event, so the skips from it on
    say nothing about the scale: the steps before it are judged on their own."""
    skip_run = run.skip_run(step)
    fault = None
    for e in run.events:
        if not step <= e.step <= skip_run[-1]:
            continue
        if e.step > step and not run.scale_dependent(e):
            fault = e
            break
        later = run.later_fault(e)  # a later micro-step of e's step (gradient accumulation)
        if later is not None:
            fault = later
            break
    return ([s for s in skip_run if s < fault.step] if fault is not None else skip_run), fault


def _backoff_before(run: Facts, benign: list[Overflow], ev: Overflow) -> str | None:
    """Evidence for a fault ``ev`` inside a run of skipped steps: the scale-dependent skips of that run before
    it were a GradScaler backoff (their producers and true loss scales), not what this diagnosis names."""
    first = run.skip_run(ev.step)[0]
    before = [b for b in benign if first <= b.step and (b.step, b.micro_step) < (ev.step, ev.micro_step)]
    if not before:
        return None
    if all(b.step == ev.step for b in before):  # earlier micro-steps of the fault's own step
        b = before[0]
        return (
            f"before it, at step {b.step}, micro-step {b.micro_step}, {c.producer_text(b)} overflowed ({b.kind}) at "
            f"loss scale {num(run.scale.get(b.step, math.nan))}: a GradScaler backoff a lower scale removes, not "
            f"this fault (a {ev.phase} value of micro-step {ev.micro_step} does not depend on the loss scale)"
        )
    steps = [b.step for b in before]
    parts = _overflow_parts(run, before)
    what = "; ".join(parts)
    lowered = run.scale.get(ev.step, math.nan)
    to = "" if math.isnan(lowered) else f", and the scale was lowered to {num(lowered)} by step {ev.step}"
    independent = {
        "data": "the model's inputs do",
        "forward": "a forward value does",
        "loss": "the loss does",
    }
    return (
        f"step{'s' if len(steps) > 1 else ''} {steps_text(steps)} {'were' if len(steps) > 1 else 'was'} a "
        f"GradScaler backoff, not this fault: {what}; the GradScaler skipped the step{'s' if len(steps) > 1 else ''}"
        f"{to} ({independent.get(ev.phase, 'this value does')} not depend on the loss scale)"
    )


def _a_later_run_collapses(run: Facts, skip_run: list[int]) -> bool:
    """``skip_run`` is shorter than :data:`COLLAPSE_RUN` with every scale at least 1, and a later run of skips
    is at least :data:`COLLAPSE_RUN` long."""
    if len(skip_run) >= COLLAPSE_RUN or run.scale_below_one(skip_run):
        return False
    return any(len(run.skip_run(s)) >= COLLAPSE_RUN for s in run.skipped_steps() if s > skip_run[-1])


def _led_to(events: list[Overflow], div: DivergenceFacts) -> Overflow:
    """The overflow a divergence led to: the first of ``events`` at or after the last step of the growth window
    the rule read, else the last one before it (a scaler backoff before the growth is not what it led to)."""
    end = div.last_step if div.last_step is not None else events[-1].step
    after = [e for e in events if e.step >= end]
    return after[0] if after else events[-1]


def _recurring_nan(run: Facts, benign: list[Overflow], ev: Overflow) -> list[Overflow]:
    """Earlier benign NaN events of the same producer (phase, module, tensor) in other skip runs, each at a
    loss scale no lower than ``ev``'s: the scaler lowered the scale and the same NaN came back, so a lower
    scale does not remove it (empty when there is none)."""
    if ev.kind != "nan":
        return []
    scale = run.scale.get(ev.step, math.nan)
    first = run.skip_run(ev.step)[0]
    return [
        b
        for b in benign
        if b.kind == "nan"
        and (b.phase, b.module, b.tensor) == (ev.phase, ev.module, ev.tensor)
        and run.skip_run(b.step)[0] != first
        and not scale > run.scale.get(b.step, math.nan)
    ]


# ---------------------------------------------------------------------------------------------- entry points
def diagnose(view: RunView) -> Diagnosis:
    """Why the run of ``view`` went non-finite, or that it did not: a :class:`~nantrace.Diagnosis`.

    The rule for each cause is in this module's docstring; one rank of a merged view of several ranks is read
    as :func:`diagnose_merged` says.

    Raises:
        TypeError: ``view`` is not a :class:`~nantrace._view.RunView` (``Trace.diagnose()`` makes one).
    """
    if not isinstance(view, RunView):
        raise TypeError(
            f"diagnose() needs a run view (call Trace.diagnose(), which makes one); got {type(view).__name__}"
        )
    d = diagnose_merged(view) if len(view.meta.ranks) > 1 else _diagnose(view)
    return with_event_facts(view, d)


def with_event_facts(view: RunView, d: Diagnosis) -> Diagnosis:
    """``d`` with the op class and headline of its event, from the evidence engine (the same facts
    ``str(Overflow)`` is written from)."""
    ov = d.overflow
    if ov is None:
        return d
    local = view.rank_view(ov.rank) if len(view.meta.ranks) > 1 else view
    if not ov.message:  # an event of the rules' producers: its explanation, for this one only
        ov = explained(view, ov)
        d = replace(d, overflow=ov)
    if d.headline:
        return d
    oe = op_evidence(local, ov)
    return replace(
        d,
        overflow=replace(ov, op_class=None if oe is None else oe.op_class),
        op_class=None if oe is None else oe.op_class,
        headline=headline(ov, oe, handed=handed_in(local, ov)),
    )


def _event_verdict(
    run: Facts, i: int, ev: Overflow, producers: dict[int, Overflow], world_size: int | None
) -> Diagnosis | None:
    """The verdict a propagated event gets under torch.distributed, before the fault rules (None: go on)."""
    if not ev.propagated:
        return None
    prod = producers.get(ev.step)
    if prod is None or prod.propagated:  # one rank's trace, or a merged one that lacks the producer
        return sc.received(run, ev, None, world_size)
    if prod.rank == ev.rank and not prod.propagated:
        return sc.reduction_made(run, prod, world_size)
    if not run.scale_dependent(prod):
        return sc.received(run, ev, prod, world_size)
    return None


def _diagnose(view: RunView, merged: list[Overflow] | None = None) -> Diagnosis:
    """:func:`diagnose` of one rank's view; ``merged``: the merged trace's events (one per step, the cross-rank
    producer) when ``view`` is the rank a merged diagnosis reads."""
    run = Facts(view)
    return _with_written(run, _diagnose_run(run, merged))


def _with_written(run: Facts, d: Diagnosis) -> Diagnosis:
    """``d`` with a line for each parameter written outside ``optimizer.step()`` before its event (or in the
    run, without one) that its evidence does not already name (:func:`nantrace._facts.written_outside`)."""
    w = run.written()
    if d.overflow is not None:
        w = w[w["step"].to_numpy() <= d.overflow.step]
    if not len(w) or any("written outside" in e for e in d.evidence):
        return d
    name = str(run.options.get("optimizer") or "the optimizer")
    lines = []
    cols = ("step", "gap", "module", "tensor", "absmax_before", "absmax", "lr", "bound", "updates")
    for step, gap, module, tensor, before, after, lr, bound, n in zip(
        *(w.head(3)[col].tolist() for col in cols), strict=True
    ):
        who = f"`{module}.{tensor}`" if module else f"`{tensor}`"
        lines.append(
            f"{who} had absmax {num(float(before))} after optimizer.step() of step {int(step) - int(gap)} and "
            f"{num(float(after))} after that of step {step}: {name} moves a weight by at most about "
            f"{num(NORMALISED_STEP_BOUND)}·lr per update (lr {num(float(lr))}: {num(float(bound))} over {n} "
            "update(s)), so it was written outside optimizer.step()"
        )
    if len(w) > 3:
        lines.append(
            f"{len(w) - 3} more parameter change(s) of that size were written outside optimizer.step()"
        )
    advice = (
        "Find what writes the weights outside optimizer.step() (a manual edit, a state-dict load, a weight "
        "average): update-to-weight ratios and the steps after such a write follow from it, not from the "
        "learning rate."
    )
    return replace(d, evidence=[*d.evidence, *lines], advice=[*d.advice, advice])


def _diagnose_run(run: Facts, merged: list[Overflow] | None) -> Diagnosis:
    """The rules of :func:`diagnose` over ``run``'s events."""
    view = run.view
    world_size = view.meta.world_size
    producers = {ev.step: ev for ev in merged} if merged is not None else {}
    benign: list[Overflow] = []
    dependent = [run.scale_dependent(ev) for ev in run.events]
    judged: dict[int, Diagnosis | None] = {}  # first step of a skip run -> its verdict (None: benign)
    for i, ev in enumerate(run.events):
        verdict = _event_verdict(run, i, ev, producers, world_size)
        if verdict is not None:
            return verdict
        if not dependent[i]:
            return _with_backoff(run, _fault(run, ev), benign, ev)
        skip_run, fault = _until_fault(run, ev.step)
        if skip_run and skip_run[0] not in judged:
            lo, hi = skip_run[0], skip_run[-1]
            in_run = [e for e, d in zip(run.events, dependent, strict=True) if d and lo <= e.step <= hi]
            judged[lo] = _judge_skip_run(run, skip_run, in_run, fault)
        verdict = judged[skip_run[0]] if skip_run else None
        if verdict is not None:
            return verdict
        if fault is not None and fault.step == ev.step:  # a later micro-step of this step held the fault
            return _with_backoff(run, _fault(run, fault), [*benign, ev], fault)
        again = _recurring_nan(run, benign, ev)
        if again:
            return sc.recurring(run, [*again, ev])
        benign.append(ev)
    return _without_fault(run, benign, world_size)


def _with_backoff(run: Facts, d: Diagnosis, benign: list[Overflow], ev: Overflow) -> Diagnosis:
    """``d`` (the diagnosis of fault ``ev``) with the backoff of its own run of skips before it, when any."""
    line = _backoff_before(run, benign, ev)
    return d if line is None else replace(d, evidence=[*d.evidence, line])


def _without_fault(run: Facts, benign: list[Overflow], world_size: int | None) -> Diagnosis:
    """The verdict when no event was a fault (module docstring, last paragraph)."""
    if not run.events and run.skipped_steps() and (world_size or 1) == 1 and run.whole_backward():
        return sc.outside(run)
    seen: set[int] = set()  # runs of skips that left no record (backward not traced)
    for s in run.skipped_steps():
        if s in seen:
            continue
        skip_run = run.skip_run(s)
        seen.update(skip_run)
        if run.is_collapse(skip_run):
            return sc.collapse(run, None, skip_run)
    under = sc.underflow(run)
    if under is not None:
        return under
    if benign:
        div = divergence(run, benign[-1].step + 1, None)
        if div.found:  # backoffs that keep coming back while everything grows
            return _divergence_led_to(run, _led_to(benign, div), div)
    last = run.step_ids[-1] + 1 if run.step_ids else 0
    quiet = divergence(
        run,
        last,
        None,
        growth_needed=QUIET_DIVERGENCE_GROWTH,
        loss_growth_needed=QUIET_DIVERGENCE_LOSS_GROWTH,
        quiet=True,
    )
    if quiet.found:
        return c.divergence_diagnosis(run, None, quiet)
    fast = fast_updates(run)
    if fast is not None:  # updates this large are never healthy, whatever the activations did
        return c.divergence_diagnosis(run, None, fast)
    if benign or run.skipped_steps():
        return sc.backoff(run, benign)
    return sc.healthy(run)


def diagnose_merged(view: RunView) -> Diagnosis:
    """The diagnosis of the rank that produced the first non-finite value of a merged view (rank 0 of a healthy
    run), with the rank named in its summary and evidence. The merged events tell it which of that rank's
    received values the reduction itself made, and which rank produced the others."""
    ov = first_overflow(view)
    rank = ov.rank if ov is not None else min(view.meta.ranks)
    merged = [overflow_from_row(r) for r in overflows(view, messages=False).to_dict("records")]
    d = _diagnose(view.rank_view(rank), merged)
    evidence = [f"rank {rank} of {view.meta.world_size}: the diagnosis reads this rank's trace", *d.evidence]
    overflow = replace(d.overflow, rank=rank) if d.overflow is not None else None
    summary = f"Rank {rank}: {d.summary}" if d.summary else d.summary
    return replace(d, overflow=overflow, evidence=evidence, summary=summary)
