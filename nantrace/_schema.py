"""The trace's vocabulary, in one place: phases and their order, non-finite kinds and their words, the column
tuples of ``records``, ``steps`` and ``Overflow``, and the limits of the floating-point dtypes.

A leaf module: it imports nothing of nantrace, and every other module takes these names from here.
"""

from __future__ import annotations

import math

import torch

__all__ = [
    "FP16_MAX",
    "FP16_SMALLEST_NORMAL",
    "FP16_SMALLEST_SUBNORMAL",
    "KINDS",
    "KIND_WORDS",
    "MASK_KIND",
    "META_COLUMNS",
    "N_STATS",
    "OVERFLOW_COLUMNS",
    "PHASES",
    "PHASE_CODE",
    "PHASE_RANK",
    "RECORDED",
    "RECORD_COLUMNS",
    "STAT_NAMES",
    "STEP_COLUMNS",
    "DType",
    "dtype_max",
    "is_wide",
    "wanted_kinds",
]

# The pipeline of one training step, in time order.
PHASES: tuple[str, ...] = ("data", "forward", "loss", "backward", "optimizer")
PHASE_CODE: dict[str, int] = {p: i for i, p in enumerate(PHASES)}
PHASE_RANK = PHASE_CODE  # the order the locator walks a step in

# Non-finite kinds as the statistics count them (``n_nan``, ``n_posinf``, ``n_neginf``), and their words.
KINDS: tuple[str, ...] = ("nan", "posinf", "neginf")
KIND_WORDS: dict[str, str] = {"nan": "NaN", "posinf": "+inf", "neginf": "-inf"}
#: The ``ops.kind`` of a module call whose output's -inf was made only by ops taking a -inf scalar
#: (``masked_fill(m, -inf)``, ``where(c, x, -inf)``, ``full(..., -inf)``; ``op`` names the first): an intended
#: mask value, which the locator does not report (rule 3).
MASK_KIND = "mask"

STAT_NAMES: tuple[str, ...] = ("min", "max", "absmax", "absmin", "n_nan", "n_posinf", "n_neginf", "n_zero")
N_STATS = len(STAT_NAMES)

RECORD_COLUMNS: tuple[str, ...] = (
    "step",
    "micro_step",
    "seq",
    "phase",
    "module",
    "module_type",
    "call",
    "tensor",
    "dtype",
    "shape",
    "numel",
    *STAT_NAMES,
    "scale",
    # extensions of the design contract (extra columns, same meanings for the rest):
    "parent",  # enclosing module of the call that recorded this tensor ("" = root; None for the root itself)
    "arg",  # the forward parameter name an input tensor was passed as, when known
    "event",  # rows sharing one tensor value (an output that is also the next module's input) share this id
    "rank",  # torch.distributed rank that recorded the row (0 without a process group)
    "reduced",  # a parameter gradient after the cross-rank reduction (DDP all-reduce, FSDP reduce-scatter)
)

STEP_COLUMNS: tuple[str, ...] = (
    "step",
    "loss",
    "scale",
    "next_scale",
    "skipped",
    "growth_tracker",
    "lr",
    "grad_norm",
    "n_nonfinite",
    "micro_steps",
    "n_records",
    "rank",  # extension: torch.distributed rank (0 without a process group)
    "recorded",  # extension: how the step was recorded, one of RECORDED
    "applied_grad_norm",  # extension: L2 norm of the gradients optimizer.step() applied (after clipping)
    "stale_grads",  # extension: parameters whose .grad already held inf/NaN when this step's backward reached
    # them (a loop that never calls zero_grad()); NaN when no parameter gradient was hooked this step
)

# How a step was recorded: "full" (every hook), "watch" (nantrace.watch's sentinel only), "replay" (the sentinel
# saw a non-finite value and the step was replayed in full), "not_reproduced" (it was, but the replay recorded
# no non-finite value), "post_step" (only the parameters after optimizer.step(), which made the value),
# "not_replayed" (the sentinel saw one, but the model issues collectives (FSDP, DDP) that a replay on one rank
# would wait on forever: nothing recorded).
RECORDED: tuple[str, ...] = ("full", "watch", "replay", "not_reproduced", "post_step", "not_replayed")

# one row of hook metadata: the identifying columns of RECORD_COLUMNS (up to numel), then internal fields
META_COLUMNS: tuple[str, ...] = (
    *RECORD_COLUMNS[: RECORD_COLUMNS.index("numel") + 1],
    "is_grad",
    "parent",
    "arg",
    "event",
    "reduced",
)

OVERFLOW_COLUMNS: tuple[str, ...] = (
    "step",
    "micro_step",
    "phase",
    "module",
    "module_type",
    "call",
    "tensor",
    "kind",
    "dtype",
    "rank",
    "propagated",
)

FP16_MAX = float(torch.finfo(torch.float16).max)  # 65504
FP16_SMALLEST_NORMAL = float(torch.finfo(torch.float16).smallest_normal)  # 2**-14 = 6.1035e-05
FP16_SMALLEST_SUBNORMAL = 2.0**-24  # 5.9605e-08: below half of this, a value rounds to 0 in float16


def wanted_kinds(kind: str | None) -> tuple[str, ...]:
    """The raw kinds a ``kind=`` argument selects: ``None`` every kind, ``"nan"``, or ``"inf"`` (±inf).

    Raises:
        ValueError: ``kind`` is none of ``None``, ``"inf"``, ``"nan"``.
    """
    if kind is None:
        return KINDS
    if kind == "nan":
        return ("nan",)
    if kind == "inf":
        return ("posinf", "neginf")
    raise ValueError(f"kind must be None, 'inf' or 'nan'; got {kind!r}")


def dtype_max(name: str) -> float:
    """Largest finite value of the dtype called ``name`` (``"float16"`` → 65504 = torch.finfo(float16).max);
    NaN for a name that is not a floating-point dtype."""
    dt = getattr(torch, str(name).removeprefix("torch."), None)
    if isinstance(dt, torch.dtype) and dt.is_floating_point:
        return float(torch.finfo(dt).max)
    return math.nan


def is_wide(name: str) -> bool:
    """True for float32/float64 (a range of at least float32's): moving to float32 cannot help."""
    m = dtype_max(name)
    return not math.isnan(m) and m >= float(torch.finfo(torch.float32).max)


class DType(str):
    """A dtype name (``"float16"``) that also compares equal to ``torch.float16`` and ``"torch.float16"``."""

    def __eq__(self, other: object) -> bool:
        if isinstance(other, torch.dtype):
            return str(other) == "torch." + str(self)
        if isinstance(other, str):
            return str.__eq__(self, other.removeprefix("torch."))
        return NotImplemented

    def __ne__(self, other: object) -> bool:
        eq = self.__eq__(other)
        return eq if eq is NotImplemented else not eq

    __hash__ = str.__hash__
