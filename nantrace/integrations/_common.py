"""What the framework callbacks share: checking their options, and one traced run (:class:`Session`) that
enters the :class:`~nantrace.Trace`, pauses it between training steps, reads the steps it has closed, and
saves it.

Nothing here imports a training framework.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from typing import Any

import torch

from .._errors import NantraceError
from .._options import TraceOptions
from .._recording import Recording
from .._trace import Trace, trace_of
from .._watch import DEFAULT_EVERY, Watch

__all__ = [
    "LOG_KEYS",
    "Session",
    "TraceOptions",
    "check_path",
    "check_stop",
    "check_tensorboard",
    "check_watch",
    "traced",
    "unwrap_optimizer",
]

# The columns each callback adds to its framework's logs, in this order.
LOG_KEYS = ("loss_scale", "skipped", "n_nonfinite")


def traced(
    options: TraceOptions,
    model: torch.nn.Module,
    scaler: torch.amp.GradScaler | None,
    optimizer: torch.optim.Optimizer | None,
) -> Recording:
    """A recording of ``model`` with the callback's trace options (not entered yet)."""
    return Recording(model, scaler=scaler, optimizer=optimizer, options=options)


def check_watch(watch: bool | int | None) -> int | bool | None:
    """A callback's ``watch=``: ``False`` (trace every step), ``True`` (``nantrace.watch`` with its default
    ``every``), an int N ≥ 1 (``nantrace.watch(every=N)``) or ``None`` (watch, no periodic full step).

    Raises:
        ValueError: anything else.
    """
    if watch is False:
        return False
    if watch is True:
        return DEFAULT_EVERY
    if watch is None or (isinstance(watch, int) and watch >= 1):
        return watch
    raise ValueError(
        "watch must be False (trace every step), True (nantrace.watch, a full step every "
        f"{DEFAULT_EVERY}), an int ≥ 1 (a full step every N) or None (only faulty steps); got {watch!r}"
    )


def check_stop(stop_on_overflow: bool | int) -> int:
    """``stop_on_overflow`` as a count of consecutive overflowing steps (0: never stop)."""
    if isinstance(stop_on_overflow, bool):
        return int(stop_on_overflow)
    if isinstance(stop_on_overflow, int) and stop_on_overflow >= 1:
        return stop_on_overflow
    raise ValueError(
        "stop_on_overflow must be True, False, or an int ≥ 1 (stop after that many consecutive steps with a "
        f"non-finite value); got {stop_on_overflow!r}"
    )


def check_path(value: str | os.PathLike[str] | None, name: str) -> Path | None:
    """``value`` as a ``Path`` (None stays None); a TypeError naming ``name`` otherwise."""
    if value is None:
        return None
    if not isinstance(value, (str, os.PathLike)):
        raise TypeError(
            f"{name} must be a str, an os.PathLike or None; got {type(value).__name__}: {value!r:.80}"
        )
    return Path(value)


def check_tensorboard(logdir: str | os.PathLike[str] | None) -> Path | None:
    """``tensorboard=`` as a ``Path``; checked when the callback is made, not after the run, so that a
    missing ``tensorboard`` package fails before training instead of at its end.

    Raises:
        TypeError: ``logdir`` is not a str, os.PathLike or None.
        ImportError: the ``tensorboard`` package is not installed.
    """
    path = check_path(logdir, "tensorboard")
    if path is not None and importlib.util.find_spec("tensorboard") is None:
        from .._tensorboard import MISSING_TENSORBOARD

        raise ImportError(MISSING_TENSORBOARD)
    return path


class Session:
    """One traced training run of a callback.

    Enters the recording at once (hooks attached) but leaves it paused: the callback resumes it for the
    duration of each training step (:meth:`recording`), so evaluation, logging and checkpointing between
    steps are not recorded into the trace. :attr:`tr` is the :class:`~nantrace.Trace` the user reads.
    """

    def __init__(
        self, rec: Recording, path: Path, tensorboard: Path | None = None, watch: int | bool | None = False
    ) -> None:
        self.rec = rec
        # with watch (see check_watch): the sentinel every step, a faulty step replayed (nantrace.watch)
        self.watch = None if watch is False else Watch(rec, watch)
        self.tr: Trace = trace_of(rec, self.watch)
        self.path = path
        self.tensorboard = tensorboard
        self.saved: Path | None = None
        self.closed = False
        self._logged = 0  # steps rows already summarised into a log
        self._checked = 0  # steps rows already looked at by should_stop()
        self._bad_run = 0  # consecutive steps with a non-finite value, up to the last checked one
        if self.watch is not None:
            self.watch.enter()
            self.watch.pause()
        else:
            rec.enter()
            rec.pause()

    def recording(self, on: bool) -> None:
        """Record (True) or ignore (False) what the hooks see, until the next call; no-op once closed."""
        if self.closed:
            return
        if self.watch is not None:
            self.watch.resume() if on else self.watch.pause()
        elif on:
            self.rec.resume()
        else:
            self.rec.pause()

    @property
    def active(self) -> bool:
        if self.watch is not None:
            return not self.closed and self.watch.live
        return not self.closed and self.rec.active

    def _rows(self, start: int) -> list[dict[str, Any]]:
        return self.rec.steps_since(start)

    def new_steps(self) -> list[dict[str, Any]]:
        """The ``steps`` rows (as dicts) closed since the previous call."""
        rows = self._rows(self._logged)
        self._logged += len(rows)
        return rows

    @staticmethod
    def summary(rows: list[dict[str, Any]]) -> dict[str, float | int]:
        """:data:`LOG_KEYS` over ``rows`` (at least one ``steps`` row).

        ``loss_scale`` is the loss scale the last step's backward used (NaN without a GradScaler),
        ``skipped`` the number of steps the GradScaler skipped (0 without one), ``n_nonfinite`` the sum of
        their ``n_nonfinite`` (rows holding NaN/±inf, attention masks not counted).
        """
        return {
            "loss_scale": float(rows[-1]["scale"]),
            "skipped": sum(1 for r in rows if r["skipped"]),
            "n_nonfinite": sum(int(r["n_nonfinite"]) for r in rows),
        }

    def should_stop(self, after: int) -> bool:
        """True when the last ``after`` closed steps (``after`` ≥ 1) each held a non-finite value."""
        for r in self._rows(self._checked):
            self._bad_run = self._bad_run + 1 if r["n_nonfinite"] > 0 else 0
            self._checked += 1
        return self._bad_run >= after

    def save(self) -> Path:
        """Save the steps closed so far to :attr:`path` (its directory is created), atomically."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.saved = self.tr.save(self.path)
        return self.saved

    def close(self, exc: BaseException | None = None) -> Path | None:
        """Exit the trace (every hook removed, the open step closed), save it, then write it to TensorBoard
        when :attr:`tensorboard` is set; idempotent."""
        if self.closed:
            return self.saved  # None if saving failed the first time (that error was raised then)
        self.closed = True
        try:
            if self.watch is not None:
                self.watch.resume()  # the open step is checked (and replayed) before the recording exits
                self.watch.exit(failed=exc is not None)
            else:
                self.rec.exit(failed=exc is not None)
        finally:
            self.save()
        if self.tensorboard is not None:
            self.tr.to_tensorboard(self.tensorboard)
        return self.path


def unwrap_optimizer(optimizer: Any) -> tuple[torch.optim.Optimizer, torch.amp.GradScaler | None]:
    """The ``torch.optim.Optimizer`` inside a framework's optimizer wrapper, and the wrapper's GradScaler.

    accelerate's ``AcceleratedOptimizer`` (what ``transformers.Trainer`` hands callbacks) and Lightning's
    ``LightningOptimizer`` hold the real optimizer as ``.optimizer`` (``._optimizer``) and run its ``step()``;
    hooks registered on the wrapper itself never run, so the one inside is traced. accelerate's wrapper
    also holds the GradScaler it steps with as ``.scaler``.

    Raises:
        NantraceError: no ``torch.optim.Optimizer`` is found inside (e.g. DeepSpeed's own optimizers).
    """
    scaler = getattr(optimizer, "scaler", None)
    inner = optimizer
    for _ in range(8):
        nested = next(
            (getattr(inner, a) for a in ("optimizer", "_optimizer") if getattr(inner, a, None) is not None),
            None,
        )
        if nested is None:
            break
        inner = nested
    if not isinstance(inner, torch.optim.Optimizer):
        raise NantraceError(
            f"the trainer's optimizer {type(optimizer).__name__} holds a {type(inner).__name__}, not a "
            "torch.optim.Optimizer; nantrace's callbacks trace torch optimizers only (not e.g. DeepSpeed's). "
            "Trace such a run with nantrace.trace(model) in a custom loop instead."
        )
    return inner, scaler if isinstance(scaler, torch.amp.GradScaler) else None
