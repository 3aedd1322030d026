"""The locator's answer, :class:`Overflow`: where the first non-finite value was produced, and why in words."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ._repro import captured_call, save_repro
from ._schema import OVERFLOW_COLUMNS

__all__ = ["Overflow"]


@dataclass(frozen=True)
class Overflow:
    """Where the first non-finite value was produced, and why, in words.

    Attributes:
        step: optimizer step (0-based).
        micro_step: root forward call inside the step (0-based; > 0 with gradient accumulation).
        phase: ``"data"``, ``"forward"``, ``"loss"``, ``"backward"`` or ``"optimizer"``.
        module: qualified module name of the producer (``""`` is the root model).
        module_type: the producer's class name, e.g. ``"Linear"``.
        call: 0-based index of the producer's call inside the micro-step (a module reused 3 times has 0, 1, 2).
        tensor: path of the first non-finite tensor, e.g. ``"output"``, ``"grad_input[0]"``, ``"weight"``.
        kind: ``"inf"`` (+inf or -inf) or ``"nan"``.
        dtype: dtype name of that tensor, e.g. ``"float16"`` (compares equal to ``torch.float16`` too).
        message: one or two sentences explaining it, with the numbers that matter; ``str(overflow)``.
        rank: the ``torch.distributed`` rank whose trace holds it (0 without a process group); in a merged trace
            of several ranks, the rank that produced it (ordering rule: ``nantrace._locate``).
        propagated: True when this rank did not produce the value but only received it through the gradient
            reduction (it is only in ``reduced`` rows: DDP's all-reduce, FSDP's reduce-scatter).
        op_class: the class of the producing op, from the evidence engine (``nantrace._evidence``, the
            taxonomy in ``docs/causes.md``): ``"overflow"``, ``"singular"``, ``"invalid"``, ``"cast"``,
            ``"reduction"`` or ``"mask_arithmetic"`` for a forward or backward event; None for ``data``,
            ``loss`` and ``optimizer``. Not one of :meth:`to_dict`'s fields; ``Diagnosis.op_class`` is the same
            for the same event.
    """

    step: int
    micro_step: int
    phase: str
    module: str
    module_type: str
    call: int
    tensor: str
    kind: str
    dtype: str
    message: str = field(default="", compare=False, repr=False)
    rank: int = 0
    propagated: bool = False
    op_class: str | None = field(default=None, compare=False)
    # the trace's capture state (nantrace._capture.Capture) with trace(capture=...), for save_repro(); not a field
    _captured: Any = field(default=None, compare=False, repr=False)

    def __str__(self) -> str:
        return self.message

    def to_dict(self) -> dict[str, Any]:
        """The fields (without ``message``) as a plain dict."""
        return {k: getattr(self, k) for k in OVERFLOW_COLUMNS}

    def save_repro(self, path: str | os.PathLike[str]) -> Path:
        """Write a reproducer of *this* overflow's module call, captured by ``nantrace.trace(..., capture=...)``,
        to ``path`` (``~`` is expanded).

        The file holds the captured module's class path and pickled object, its ``state_dict`` right after
        the call, the call's args/kwargs (copies taken when the call started) with their ``requires_grad``,
        its dtype and the autocast state (format: ``nantrace._repro``). The write is atomic (a temporary file
        renamed over ``path``). :func:`nantrace.load_repro` rebuilds it; ``repro.run()`` reproduces the call
        in isolation and ``nantrace.hunt(repro.run)`` names the op.

        Only a forward overflow whose own call was captured can be saved here: the trace's captured call (the
        first watched call whose forward produced a non-finite value) must be this Overflow's event (same
        step, micro-step, module and call), or the call of a module enclosing it in the same step and
        micro-step (``capture="ff"`` for an overflow in ``ff.wo``: the saved call contains it). Otherwise (a scaler backoff in ``loss``, a backward overflow, an
        overflow in a module that was not watched) it raises rather than save another event; save whatever
        was captured with :meth:`nantrace.Trace.save_repro`.

        Returns:
            the path written, as a ``pathlib.Path``.

        Raises:
            NantraceError: the trace had no ``capture=`` or captured nothing (the message names the watched
                modules and where this overflow is), the captured call is not this overflow's event (the
                message names both), or the module's class (or a submodule's) cannot be imported back by its
                path (defined in ``__main__``, e.g. a notebook, or inside a function): move it to an importable
                module.
            TypeError / ValueError: ``path`` is not a path, is a directory, or its directory does not exist
                or is not writable.
        """
        return save_repro(captured_call(self._captured, self, for_overflow=True), path)
