"""The diagnosis's result type :class:`Diagnosis`, its causes, and the thresholds of the rules (documented in
:mod:`nantrace._diagnose`)."""

from __future__ import annotations

import html
from dataclasses import dataclass, field
from typing import Any

from ._overflow import Overflow

__all__ = [
    "CAUSES",
    "CLIP_OBSERVED_FRACTION",
    "COLLAPSE_RECURRING",
    "COLLAPSE_RUN",
    "DIVERGENCE_GROWTH",
    "DIVERGENCE_JUMP_GRAD_NORM",
    "DIVERGENCE_JUMP_LOSS",
    "DIVERGENCE_JUMP_UPDATE_RATIO",
    "DIVERGENCE_LOSS_GROWTH",
    "DIVERGENCE_MIN_STEPS",
    "DIVERGENCE_RISING",
    "DIVERGENCE_UPDATE_RATIO",
    "DIVERGENCE_WEIGHT_GROWTH",
    "DIVERGENCE_WINDOW",
    "HEADLINE_MAX",
    "HEALTHY_UPDATE_RATIO",
    "QUIET_DIVERGENCE_GROWTH",
    "QUIET_DIVERGENCE_LOSS_GROWTH",
    "UNDERFLOW_FRACTION",
    "UNDERFLOW_SMALL_ABSMAX",
    "UNDERFLOW_ZERO_FRACTION",
    "UNHEALTHY_UPDATE_RATIO",
    "Diagnosis",
]

CAUSES: tuple[str, ...] = (
    "data",
    "forward_overflow",
    "invalid_op",
    "loss",
    "backward_overflow",
    "scaler_backoff",
    "loss_scale_collapse",
    "divergence",
    "optimizer",
    "gradient_underflow",
    "healthy",
    "received",
)

HEADLINE_MAX = 160  # characters of the first line of str(Overflow) and str(Diagnosis)
HEALTHY_UPDATE_RATIO = 1e-3  # typical max|Δw| / max|w| per step of healthy training
DIVERGENCE_MIN_STEPS = 3  # recorded steps before the overflow needed to see a trend
DIVERGENCE_WINDOW = 8  # trailing steps the trend is measured over
DIVERGENCE_GROWTH = 4.0  # output absmax growth (last / first of the window)
DIVERGENCE_RISING = 0.6  # fraction of step-to-step changes that must be increases
DIVERGENCE_LOSS_GROWTH = 2.0  # loss growth over the window
DIVERGENCE_UPDATE_RATIO = 1e-2  # median update-to-weight ratio, 10x the healthy value
DIVERGENCE_WEIGHT_GROWTH = 2.0  # weight absmax growth over the window
DIVERGENCE_JUMP_LOSS = (
    5.0  # one-step loss growth that, with the grad norm's below, is divergence from 2 steps
)
DIVERGENCE_JUMP_GRAD_NORM = 20.0  # one-step gradient-norm growth (with the loss's above)
DIVERGENCE_JUMP_UPDATE_RATIO = (
    0.1  # update-to-weight ratio (100x healthy) that with growth is divergence early
)
UNHEALTHY_UPDATE_RATIO = 0.1  # median update-to-weight ratio (100x healthy) of a run that is never "healthy"
QUIET_DIVERGENCE_GROWTH = 100.0  # output absmax growth for a divergence that has not overflowed yet
QUIET_DIVERGENCE_LOSS_GROWTH = 10.0  # loss growth for a divergence that has not overflowed yet
CLIP_OBSERVED_FRACTION = 0.99  # applied grad norm below this fraction of the backward's: the loop clipped
COLLAPSE_RUN = 8  # consecutive skipped steps (scale fell 2**8 = 256x in a row) that are not a benign backoff
COLLAPSE_RECURRING = (
    3  # separate runs of skips that, with half the steps skipped, mean the scale keeps falling
)
UNDERFLOW_ZERO_FRACTION = (
    0.5  # with a small absmax (below), this fraction of zeros makes a gradient "flushed"
)
UNDERFLOW_SMALL_ABSMAX = 2.0**-10  # 9.8e-4: a gradient whose largest |g| is this small has its bulk subnormal
UNDERFLOW_FRACTION = 0.5  # fraction of flushed parameter-gradient tensors that makes gradient_underflow


# ---------------------------------------------------------------------------------------------- result
@dataclass
class Diagnosis:
    """Why a traced run went non-finite (or did not), with the numbers and concrete fixes.

    Attributes:
        cause: exactly one of :data:`CAUSES`: ``"data"``, ``"forward_overflow"``, ``"invalid_op"``, ``"loss"``,
            ``"backward_overflow"``, ``"scaler_backoff"``, ``"loss_scale_collapse"``, ``"divergence"``,
            ``"optimizer"``, ``"gradient_underflow"``, ``"healthy"`` or, for one rank's trace of a
            torch.distributed run whose value came through the gradient reduction, ``"received"``.
        overflow: the :class:`~nantrace.Overflow` the cause is about (the root event, which is not always the
            first overflow of the run: a benign scaler backoff before a real fault is passed over), or ``None``
            (``healthy``, ``gradient_underflow``, a divergence that has not overflowed yet).
        evidence: short sentences holding the numbers the cause was decided on.
        advice: concrete fixes for this case, naming the module, the dtype and the numbers.
        summary: one sentence saying what happened.
        op_class: the class of the producing op of ``overflow`` (``"overflow"``, ``"singular"``, ``"invalid"``,
            ``"cast"``, ``"reduction"``, ``"mask_arithmetic"``; the taxonomy is in ``docs/causes.md``), from the
            same evidence engine as ``str(overflow)``: ``Overflow.op_class`` of the same event is the same.
            None when there is no event or its phase is ``data``, ``loss`` or ``optimizer``.
        headline: one line of at most 160 characters: who, what, where ("step 28 forward: `blocks.1.attn.scores`
            (`matmul`) overflowed float16 (+inf)"); for ``healthy``, ``gradient_underflow``, a divergence
            that has not overflowed yet and skips from outside the traced model, the facts it was decided on;
            ``""`` for other causes without an event.

    ``str()`` opens with one line of at most 160 characters (``nantrace diagnosis: <cause>`` and the headline),
    then the summary, evidence and advice as short lines; ``_repr_html_()`` the same as HTML
    (every string escaped with ``html.escape``).

    Raises:
        ValueError: on construction, when ``cause`` is not one of :data:`CAUSES`.
    """

    cause: str
    overflow: Overflow | None
    evidence: list[str] = field(default_factory=list)
    advice: list[str] = field(default_factory=list)
    summary: str = ""
    op_class: str | None = None
    headline: str = ""

    def __post_init__(self) -> None:
        if self.cause not in CAUSES:
            raise ValueError(f"cause must be one of {CAUSES}; got {self.cause!r}")

    @property
    def ok(self) -> bool:
        """True when nothing needs fixing: ``cause`` is ``"healthy"`` or the benign ``"scaler_backoff"``."""
        return self.cause in ("healthy", "scaler_backoff")

    def __str__(self) -> str:
        first = f"nantrace diagnosis: {self.cause}" + (f" · {self.headline}" if self.headline else "")
        lines = [first if len(first) <= HEADLINE_MAX else first[: HEADLINE_MAX - 1] + "…"]
        if self.summary:
            lines.append(self.summary)
        if self.evidence:
            lines.append("evidence:")
            lines += [f"  - {e}" for e in self.evidence]
        if self.advice:
            lines.append("advice:")
            lines += [f"  - {a}" for a in self.advice]
        return "\n".join(lines)

    def __repr__(self) -> str:
        where = ""
        if self.overflow is not None:
            ov = self.overflow
            where = f", step={ov.step}, phase={ov.phase!r}, module={ov.module!r}, kind={ov.kind!r}"
        return f"Diagnosis(cause={self.cause!r}{where})"

    def _repr_html_(self) -> str:
        e = html.escape
        ev = "".join(f"<li>{e(s)}</li>" for s in self.evidence)
        ad = "".join(f"<li>{e(s)}</li>" for s in self.advice)
        parts = [
            '<div class="nantrace-diagnosis">',
            f"<p><b>nantrace diagnosis</b>: <code>{e(self.cause)}</code>"
            + (f" · {e(self.headline)}" if self.headline else "")
            + "</p>",
        ]
        if self.summary:
            parts.append(f"<p>{e(self.summary)}</p>")
        if self.overflow is not None:
            ov = self.overflow
            parts.append(
                f"<p>step {ov.step}, micro-step {ov.micro_step}, {e(ov.phase)}, "
                f"<code>{e(ov.module or '(root)')}</code> ({e(ov.module_type)}, call {ov.call}), "
                f"<code>{e(ov.tensor)}</code>, {e(ov.kind)}, {e(str(ov.dtype))}</p>"
            )
        if ev:
            parts.append(f"<p><b>Evidence</b></p><ul>{ev}</ul>")
        if ad:
            parts.append(f"<p><b>Advice</b></p><ul>{ad}</ul>")
        parts.append("</div>")
        return "".join(parts)

    def to_dict(self) -> dict[str, Any]:
        """``cause``, ``op_class``, ``headline``, ``summary``, ``evidence``, ``advice`` and the overflow's fields
        (or ``None``)."""
        return {
            "cause": self.cause,
            "op_class": self.op_class,
            "headline": self.headline,
            "summary": self.summary,
            "overflow": None if self.overflow is None else self.overflow.to_dict(),
            "evidence": list(self.evidence),
            "advice": list(self.advice),
        }
