"""What ``nantrace.watch`` adds to the answers: which step was recorded by a replay, and what the sentinel saw
on a step whose replay did not reproduce the fault (pure functions over a :class:`~nantrace._view.RunView`).

The sentinel's notes are in ``view.meta.options["watch"]["sentinel"]`` (saved with the trace): per flagged
step, where it first saw a non-finite value (``phase``, ``module``, ``tensor``, ``kind``, the tensor's
``dtype``: ``""`` for the GradScaler's found-inf) and how the step was recorded. Without ``watch`` every
function here returns the plain answer unchanged.

A watched step records no ranges: the rules that read activation, gradient and weight ranges over steps
(divergence; float16 gradient underflow and a divergence with no overflow yet, on a healthy run) read only the
steps recorded in full. When watched steps lie before the diagnosed event (or, for a healthy run, anywhere),
:func:`diagnose` says so in its evidence, with how many steps those rules could read, instead of implying that
they were judged on every step. The facts every watched step does record (loss, loss scale, skipped, lr,
gradient norm, ``stale_grads``) are read as under ``trace``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pandas as pd

from . import _diagnose, _explain
from ._diagnosis import DIVERGENCE_MIN_STEPS, Diagnosis
from ._evidence import WEIGHTS_HELD, op_evidence
from ._fmt import steps_text
from ._overflow import Overflow
from ._schema import wanted_kinds
from ._view import RunView

__all__ = ["diagnose", "first_overflow", "overflows", "unreproduced"]

# causes for which the divergence rule was tried and did not hold (data is decided before it; a collapse with
# stale gradients by the stale rule, see _unjudged)
_AFTER_DIVERGENCE = frozenset(
    {
        "forward_overflow",
        "invalid_op",
        "loss",
        "backward_overflow",
        "optimizer",
        "loss_scale_collapse",
        "scaler_backoff",
    }
)

_CAUSE_OF_PHASE = {
    "data": "data",
    "forward": "forward_overflow",
    "loss": "loss",
    "backward": "backward_overflow",
    "optimizer": "optimizer",
}


def _notes(view: RunView) -> dict[str, dict[str, Any]]:
    watch = view.meta.options.get("watch") if isinstance(view.meta.options, dict) else None
    return dict(watch.get("sentinel") or {}) if isinstance(watch, dict) else {}


def _replay_advice(note: dict[str, Any]) -> str:
    """What would let watch's replay reproduce the step, from what its note says made it differ."""
    if note.get("no_forward"):
        return (
            "Pass nantrace.watch() the module the loop calls (or call the watched model), or trace the step "
            "with nantrace.trace(): watch replays only calls of the model it watches."
        )
    if note.get("recorded") == "not_replayed":
        return (
            "Trace the step on every rank (nantrace.trace()): watch does not replay a model holding FSDP or DDP "
            "modules."
        )
    fixes = []
    if note.get("inputs_changed"):
        fixes.append("do not change the model's inputs in place after its forward")
    if note.get("weights_changed"):
        fixes.append("write the weights only outside the step (not between its micro-steps)")
    if fixes:
        return f"For watch to replay the step: {' and '.join(fixes)}."
    if note.get("replay_failed"):
        return "For watch to replay the step: let the forward and its hooks run twice for one step."
    return (
        "For watch to replay the step: keep the forward free of Python state that changes per call (a counter, a "
        "flag set by the loop) and use deterministic kernels (torch.use_deterministic_algorithms(True))."
    )


def _written_what(note: dict[str, Any]) -> str:
    both = note.get("inputs_changed") and note.get("weights_changed")
    return (
        "inputs and weights were" if both else "inputs were" if note.get("inputs_changed") else "weights were"
    )


def overflows(
    view: RunView, kind: str | None = None, *, per_rank: bool = False, messages: bool = True
) -> pd.DataFrame:
    """:func:`nantrace._explain.overflows`, with the row of each step whose replay did not reproduce the fault
    replaced by what the sentinel saw there (:func:`unreproduced`): the replay's rows of such a step are not
    its producer.

    Raises:
        ValueError: ``kind`` is not None, ``"inf"`` or ``"nan"``.
    """
    df = _explain.overflows(view, kind, per_rank=per_rank, messages=messages)
    missed = unreproduced(view, kind)
    if not missed:
        return df
    steps = {o.step for o in missed}
    kept = df[~df["step"].isin(steps)] if len(df) else df
    extra = pd.DataFrame([{**o.to_dict(), "message": o.message} for o in missed], columns=df.columns)
    out = pd.concat([kept, extra.astype(df.dtypes.to_dict())] if len(kept) else [extra], ignore_index=True)
    return out.sort_values(["step", "rank"], kind="stable").reset_index(drop=True)


def _unreproduced_message(note: dict[str, Any], k: str) -> str:
    """What :func:`unreproduced` says of one flagged step whose replay is not its producer (``note``: the
    sentinel's note; ``k``: its kind): where the sentinel saw the value, and why the replay does not count."""
    changed = (
        " The step's inputs had been changed in place after its forward."
        if note.get("inputs_changed")
        else ""
    )
    if note.get("weights_changed"):
        micro = ", ".join(str(i) for i in note["weights_changed"])
        changed += (
            f" The model's parameters had been written in place after the forward of micro-step(s) {micro} "
            "(before the replay, which runs before optimizer.step()), so the replay could not compute what "
            "that forward did."
        )
    where = f"`{note['module']}`" if note["module"] else "the model"
    saw = (
        f"nantrace.watch saw {k} at step {note['step']} (micro-step {note['micro_step']}, {note['phase']}: "
        f"{note['tensor']} of {where})"
    )
    if note.get("no_forward"):
        return (
            f"{saw}, but did not replay the step: the loop did not call the watched model in it (it called "
            "submodules itself), so there was no forward to replay and its producer is unknown: this is "
            "where the sentinel detected it. Trace that step with nantrace.trace() to name the producer."
        )
    if note.get("recorded") == "not_replayed":
        return (
            f"{saw}, but did not replay the step: the model holds FSDP or DDP modules, whose forward and "
            "backward issue collectives that the other ranks would never join, so its producer is unknown: "
            "this is where the sentinel detected it. Trace that step with nantrace.trace() on every rank "
            "to name the producer."
        )
    if note.get("replay_failed"):
        return (
            f"{saw}, but replaying the step raised {note['replay_failed']} (forward or hook code that ran "
            "again), so its producer is unknown: this is where the sentinel detected it. Trace that step with "
            "nantrace.trace() to name the producer."
        )
    if note.get("replay_unused") and not (note.get("inputs_changed") or note.get("weights_changed")):
        micro = ", ".join(str(i) for i in note.get("outputs_differ", []))
        return (
            f"{saw}, but the replayed forward of micro-step(s) {micro} computed other outputs than the real "
            "one (their smallest or largest value differ): what the forward reads had changed since (a call "
            "counter or flag of a module or of the loop, a buffer the forward updates, the training flag, "
            "global Python state) or a kernel is non-deterministic, so the values its replay recorded are not "
            "this step's and are not used: its producer is unknown: this is where the sentinel detected it. "
            "Trace that step with nantrace.trace() to name the producer."
        )
    if note.get("replay_unused"):
        return (
            f"{saw}, but its {_written_what(note)} written in place after the forward, so the values its "
            f"replay recorded are not this step's and are not used: its producer is unknown: this is where "
            f"the sentinel detected it.{changed} Trace that step with nantrace.trace() to name the producer, "
            "or write those tensors only after the step."
        )
    if note.get("replay_first") and note["phase"] not in ("data", "forward"):
        return (
            f"{saw}, but the replay recorded none in the {note['phase']} phase: its first non-finite value was "
            f"in the {note['replay_first']} phase (a consequence of the real step), so the producer is "
            f"unknown: this is where the sentinel detected it.{changed} A gradient that reached the parameters "
            "from outside the replayed forward (a submodule the loop calls itself, a term of another model) or "
            "non-deterministic kernels make a replay differ; trace that step with nantrace.trace() to name "
            "the producer."
        )
    if note.get("replay_first"):
        return (
            f"{saw}, but the replayed forward held none: the replay's first non-finite value was in the "
            f"{note['replay_first']} phase (a consequence of the real step, as its loss), so the producer is "
            f"unknown: this is where the sentinel detected it.{changed} A forward that depends on Python state "
            "(a call counter, a flag set by the loop) or non-deterministic kernels make a replay differ; trace "
            "that step with nantrace.trace() to name the producer."
        )
    return (
        f"{saw}, but replaying the step recorded no non-finite value, so its producer is unknown: this is "
        f"where the sentinel detected it.{changed} Non-deterministic kernels or inputs changed after the "
        "forward make a replay differ; trace that step with nantrace.trace() to name the producer."
    )


def unreproduced(view: RunView, kind: str | None = None) -> list[Overflow]:
    """Per step whose replay recorded no non-finite value, where the sentinel saw one, as an
    :class:`Overflow` whose fields say where it was *detected* (not who produced it); step order."""
    wanted = set(wanted_kinds(kind))
    out = []
    for note in _notes(view).values():
        if note.get("recorded") not in ("not_reproduced", "not_replayed"):
            continue
        k = note["kind"]
        if (k == "nan" and "nan" not in wanted) or (k == "inf" and not wanted & {"posinf", "neginf"}):
            continue
        message = _unreproduced_message(note, k)
        out.append(
            Overflow(
                step=int(note["step"]),
                micro_step=int(note["micro_step"]),
                phase=str(note["phase"]),
                module=str(note["module"]),
                module_type=str(note["module_type"]),
                call=0,
                tensor=str(note["tensor"]),
                kind=k,
                dtype=str(note.get("dtype", "")),
                message=message,
                _captured=view.capture,  # save_repro works on it as on any Overflow of a capturing trace
            )
        )
    return sorted(out, key=lambda o: o.step)


def _replayed(view: RunView, ov: Overflow) -> Overflow:
    steps = view.steps
    if "recorded" not in steps.columns:
        return ov
    row = steps[steps["step"] == ov.step]
    if len(row) and row["recorded"].iloc[0] == "replay":
        note = f" (nantrace.watch recorded step {ov.step} in full by replaying it after its sentinel saw a non-finite value.)"
        return dataclasses.replace(ov, message=ov.message + note)
    if len(row) and row["recorded"].iloc[0] == "post_step":
        note = (
            f" (nantrace.watch recorded the parameters after optimizer.step() of step {ov.step}; the gradients it "
            "checked before the step were finite. It checks parameters only after optimizer.step(), so a write to "
            "them since the previous check (a manual edit, a state-dict load) reads the same as the step making "
            "them non-finite; nantrace.trace() records the forward that would tell them apart.)"
        )
        return dataclasses.replace(ov, message=ov.message + note)
    return ov


def first_overflow(view: RunView, kind: str | None = None) -> Overflow | None:
    """:func:`nantrace._explain.first_overflow`, saying when the answer comes from a replay; a step flagged by
    the sentinel but not reproduced by its replay, if earlier, is reported as detected there.

    Raises:
        ValueError: ``kind`` is not None, ``"inf"`` or ``"nan"``.
    """
    found = _explain.first_overflow(view, kind)
    missed = unreproduced(view, kind)
    if missed and (
        found is None or missed[0].step <= found.step
    ):  # at one step: the replay's rows are not it
        return missed[0]
    return None if found is None else _replayed(view, found)


def diagnose(view: RunView) -> Diagnosis:
    """:func:`nantrace._diagnose.diagnose`; when the first fault is one the replay did not reproduce, a
    diagnosis that says so, with what the sentinel saw."""
    result = _diagnose.diagnose(view)
    missed = unreproduced(view)
    first = result.overflow
    if missed and (first is None or missed[0].step <= first.step):
        backoff = _backoff_unreplayed(view, result, missed)
        if backoff is not None:
            return backoff
        ov = missed[0]
        note = _notes(view).get(str(ov.step), {})
        how = (
            "watch did not replay it"
            if note.get("recorded") == "not_replayed"
            else "its replay did not reproduce it"
        )
        return Diagnosis(
            # the cause its phase and kind name (NaN in forward or backward is no overflow): nothing more is known
            cause="invalid_op"
            if ov.kind == "nan" and ov.phase in ("forward", "backward")
            else _CAUSE_OF_PHASE.get(ov.phase, "data"),
            overflow=ov,
            evidence=[str(ov)],
            advice=[
                f"Re-run with nantrace.trace(..., every=1) around step {ov.step} to name the producer.",
                _replay_advice(note),
            ],
            summary=f"Step {ov.step} went non-finite ({ov.phase}), but {how}.",
        )
    if first is not None:
        ov = _replayed(view, first)
        if ov.message != first.message:
            result = dataclasses.replace(
                result, overflow=ov, evidence=[*result.evidence, ov.message[len(first.message) :].strip()]
            )
    return _unjudged(view, result)


def _backoff_unreplayed(view: RunView, result: Diagnosis, missed: list[Overflow]) -> Diagnosis | None:
    """The rules' benign-backoff verdict (``result``) when every step whose replay did not reproduce its values
    (``missed``) is one the GradScaler skipped and where the sentinel first saw the value in the gradients
    (phase ``loss`` or ``backward``): that is what a backoff is, read from the ``steps`` table and the sentinel,
    whatever made the values. None otherwise (the unreproduced step is reported as such)."""
    if result.cause != "scaler_backoff":
        return None
    skipped = {int(st) for st, k in zip(view.steps["step"], view.steps["skipped"], strict=True) if k == 1}
    if not all(o.phase in ("loss", "backward") and o.step in skipped for o in missed):
        return None
    line = (
        f"nantrace.watch's replays of step(s) {steps_text([o.step for o in missed])} did not reproduce them "
        "(their producers are unknown), but on each the sentinel saw the inf/NaN first in the gradients and "
        "the GradScaler skipped the step: read from the skipped steps and the loss scale, recorded on every step"
    )
    return dataclasses.replace(result, evidence=[*result.evidence, line])


def _unjudged(view: RunView, result: Diagnosis) -> Diagnosis:
    """``result`` with what the rules reading ranges over steps could not read on watched steps, said in its
    evidence and advice (see the module docstring); unchanged when no such step is before its event."""
    steps = view.steps
    if "recorded" not in steps.columns or not len(steps):
        return result
    ov = result.overflow
    healthy = result.cause == "healthy"
    if not healthy and (ov is None or result.cause not in _AFTER_DIVERGENCE):
        return result
    if result.cause == "loss_scale_collapse" and bool((steps["stale_grads"] > 0).any()):
        return result  # the stale-gradient rule decided, before any divergence rule
    oe = op_evidence(view, ov) if ov is not None and ov.phase == "forward" else None
    if oe is not None and (oe.what == WEIGHTS_HELD or oe.op_class in ("singular", "mask_arithmetic")):
        return result  # its weights held the value, or an op's singular point or a mask made it: not growth
    before = steps if ov is None else steps[steps["step"] < ov.step]
    watched = int((before["recorded"].astype(str) == "watch").sum())
    if not watched:
        return result
    full = len(before) - watched
    if healthy:
        judged = (
            f"were judged from the {full} step(s) recorded in full only"
            if full
            else "could not be judged: no step was recorded in full"
        )
        line = (
            f"nantrace.watch recorded no activation, gradient or weight ranges on the {watched} watched step(s): "
            "a divergence with no overflow yet (activations, loss and weights growing) and float16 gradient "
            f"underflow (gradients flushed to zero) {judged}"
        )
        # the last line counts the watched steps (the healthy verdict's own caveat): this one goes before it
        return dataclasses.replace(result, evidence=[*result.evidence[:-1], line, *result.evidence[-1:]])
    assert ov is not None
    read = (
        f"judged from the {full} step(s) before it recorded in full only"
        if full >= DIVERGENCE_MIN_STEPS
        else "not known (only the jumps of the loss and the gradient norm, recorded on every step, were read)"
    )
    line = (
        f"{watched} of the {len(before)} step(s) before step {ov.step} were only watched (nantrace.watch records "
        f"no activation or weight ranges on them): whether activations and weights grew towards this event "
        f"(a diverging run) is {read}"
    )
    advice = (
        f"Before changing dtypes, record the steps before step {ov.step} in full (nantrace.trace(), or "
        "nantrace.watch(..., every=1)) to see whether activations and weights grew towards it: a diverging "
        "run needs a lower learning rate, not a wider dtype."
    )
    return dataclasses.replace(result, evidence=[*result.evidence, line], advice=[*result.advice, advice])
