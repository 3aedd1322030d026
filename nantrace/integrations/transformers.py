"""``NanTraceCallback``: trace a ``transformers.Trainer`` run with nantrace.

Needs the ``transformers`` extra: ``pip install "nantrace[transformers]"`` (transformers and accelerate).
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from types import TracebackType
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from .._errors import NantraceError
from .._options import ModuleFilter
from .._trace import Trace
from ._common import (
    Session,
    TraceOptions,
    check_path,
    check_stop,
    check_tensorboard,
    check_watch,
    traced,
    unwrap_optimizer,
)

try:
    from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments
except ImportError as e:  # the extra is not installed
    raise ImportError(
        'nantrace.integrations.transformers needs transformers: pip install "nantrace[transformers]"'
    ) from e

__all__ = ["NanTraceCallback"]


def _model_loss(output: Any) -> torch.Tensor | None:
    """The ``loss`` a transformers model returns (``ModelOutput.loss`` / ``output["loss"]``), if any."""
    loss = output.get("loss") if isinstance(output, Mapping) else getattr(output, "loss", None)
    if isinstance(loss, torch.Tensor) and loss.is_floating_point() and loss.numel() > 0:
        return loss
    return None


class NanTraceCallback(TrainerCallback):
    """A ``transformers.TrainerCallback`` that traces the Trainer's model with :func:`nantrace.trace`.

    At train begin it attaches to the Trainer's model, to the ``torch.optim.Optimizer`` inside accelerate's
    ``AcceleratedOptimizer`` (the wrapper has no step hooks of its own) and to the wrapper's GradScaler
    (``fp16=True`` on an accelerator). Steps are the Trainer's optimizer steps: nantrace's step ``k`` is the
    Trainer's ``global_step`` ``k + 1``. Only training steps are recorded: evaluation, logging and
    checkpointing between steps are not.

    To every training log (the ``logs`` dict the Trainer hands ``on_log``, and its entry in
    ``state.log_history``) it adds, over the steps since the previous log:

    * ``loss_scale``: the loss scale the last step's backward used (NaN without a GradScaler);
    * ``skipped``: how many steps the GradScaler skipped (0 without one);
    * ``n_nonfinite``: how many recorded tensors held NaN/±inf (attention masks not counted);
    * ``loss_unfiltered``: the Trainer's ``loss`` as it would be without ``logging_nan_inf_filter``: equal to
      ``loss`` when every ``loss`` the model returned since the previous log was finite, else NaN (or ±inf).
      Only when the model returns a loss (``output.loss``). With ``logging_nan_inf_filter=True`` (the default)
      the Trainer's ``loss`` replaces a non-finite loss by the average of earlier ones, so a NaN run logs a
      finite ``loss``; these columns show the truth.

    Callbacks passed to ``Trainer(callbacks=...)`` run after the Trainer's ``report_to`` loggers, so those
    loggers do not receive the added columns; the console, ``state.log_history`` and later callbacks do, and
    ``tensorboard=`` writes the whole trace to TensorBoard.

    At train end it detaches and saves the trace to ``trace_path`` (default
    ``<args.output_dir>/trace.nantrace``; in a multi-process run every rank passes that same path and
    ``Trace.save`` writes its part into it, see README "Multi-GPU").
    ``trace`` holds the :class:`~nantrace.Trace`, ``saved_path`` the file.

    If ``trainer.train()`` raises, the Trainer calls no callback, so the hooks stay attached until
    :meth:`close`, the callback's ``with`` block exits, or the next ``train()``, each of which detaches and
    saves the steps recorded so far. ``with callback: trainer.train()`` cleans up on any exception.

    Args:
        trace_path: where to save the trace; default ``<args.output_dir>/trace.nantrace``.
        stop_on_overflow: ``True`` stops training after the first step that held a non-finite value (NaN or
            ±inf anywhere in it, a GradScaler backoff included), after saving the trace and logging that step;
            an int ``N`` waits for ``N`` consecutive such steps, so a GradScaler can back off first. With a
            default-scale GradScaler (65536, which backs off in the first steps of most fp16 runs) pass ``N``
            (e.g. 5), since ``True`` stops at that first benign backoff.
        tensorboard: a directory: when the trace is saved at train end (also after a stop, or by
            :meth:`close` after an error), it is also written there for TensorBoard by
            :meth:`nantrace.Trace.to_tensorboard` (tags ``nantrace/...``). Needs the ``tensorboard`` extra,
            checked here.
        modules, phases, sync_free, drill, every: passed to :func:`nantrace.trace`.
        watch: ``False`` (default): trace every step in full. ``True``: :func:`nantrace.watch` (a nearly free
            sentinel every step, the faulty step replayed in full, a full step every 100); an int N: watch
            with a full step every N (``every`` then only shapes those); ``None``: watch, only faulty steps.

    Raises:
        ImportError: ``tensorboard`` is given but the tensorboard package is not installed.
        TypeError, ValueError: a bad argument, here (the trace options are checked as :func:`nantrace.trace`
            checks them; only whether ``modules`` matches a module waits for the model, at train begin).
        NantraceError (at train begin): the Trainer's optimizer holds no ``torch.optim.Optimizer``.
    """

    def __init__(
        self,
        *,
        trace_path: str | os.PathLike[str] | None = None,
        stop_on_overflow: bool | int = False,
        tensorboard: str | os.PathLike[str] | None = None,
        modules: ModuleFilter | None = None,
        phases: Iterable[str] | None = None,
        sync_free: bool | None = None,
        drill: bool = True,
        every: int = 1,
        watch: bool | int | None = False,
    ) -> None:
        self._path = check_path(trace_path, "trace_path")
        self._stop_after = check_stop(stop_on_overflow)
        self._tensorboard = check_tensorboard(tensorboard)
        self._watch = check_watch(watch)
        self._options = TraceOptions(
            modules=modules, phases=phases, sync_free=sync_free, drill=drill, every=every
        )
        self._session: Session | None = None
        self._loss_hook: RemovableHandle | None = None
        self._loss_sum: torch.Tensor | None = None

    @property
    def trace(self) -> Trace | None:
        """The trace of the latest ``train()`` (None before the first); readable during and after it."""
        return None if self._session is None else self._session.tr

    @property
    def saved_path(self) -> Path | None:
        """The file the trace was last saved to (None until it has been saved)."""
        return None if self._session is None else self._session.saved

    # ------------------------------------------------------------------ Trainer events
    def on_train_begin(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        model: nn.Module | None = None,
        optimizer: Any = None,
        **kwargs: Any,
    ) -> None:
        if self._session is not None and not self._session.closed:
            self.close()  # left attached by a train() that raised
        if not isinstance(model, nn.Module):
            raise NantraceError(
                f"the Trainer handed NanTraceCallback no model at train begin (got {model!r})"
            )
        if optimizer is None:
            raise NantraceError(
                "the Trainer handed NanTraceCallback no optimizer at train begin; this transformers version "
                "creates it later, which nantrace does not support"
            )
        opt, scaler = unwrap_optimizer(optimizer)
        out_dir = Path(args.output_dir or "trainer_output")  # TrainingArguments' own default
        path = self._path or out_dir / "trace.nantrace"
        rec = traced(self._options, model, scaler, opt)
        self._loss_sum = None
        self._session = Session(rec, path, self._tensorboard, self._watch)
        try:
            self._loss_hook = model.register_forward_hook(self._capture_loss)
        except BaseException as e:
            self._session.close(e)
            raise

    def on_step_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kw: Any
    ) -> None:
        if self._session is not None:
            self._session.recording(True)

    def on_step_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kw: Any
    ) -> None:
        s = self._session
        if s is None or s.closed:
            return
        s.recording(False)
        if self._stop_after and s.should_stop(self._stop_after):
            s.save()
            control.should_log = True  # so the overflowing step reaches the logs before training stops
            control.should_training_stop = True

    def on_log(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        logs: dict[str, float] | None = None,
        **kwargs: Any,
    ) -> None:
        s = self._session
        if s is None or logs is None or "loss" not in logs:  # only training logs carry "loss"
            return
        rows = s.new_steps()
        if not rows:
            return
        added = s.summary(rows)
        if self._loss_sum is not None:  # one device read per log, as the Trainer's own loss
            total = self._loss_sum.item()
            added["loss_unfiltered"] = logs["loss"] if math.isfinite(total) else total
            self._loss_sum = None
        history = state.log_history
        # Trainer.log appended a copy of logs (plus "step") to log_history before calling on_log
        if (
            history
            and history[-1].get("step") == state.global_step
            and all(history[-1].get(k) is v for k, v in logs.items())
        ):
            history[-1].update(added)
        logs.update(added)

    def on_train_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kw: Any
    ) -> None:
        self.close()

    # ------------------------------------------------------------------ cleanup
    def close(self, exc: BaseException | None = None) -> Path | None:
        """Detach from the model and save the trace (idempotent); returns the file, or None if never attached.

        ``on_train_end`` calls it. Call it yourself after a ``trainer.train()`` that raised, or use
        ``with callback: trainer.train()``.
        """
        if self._loss_hook is not None:
            self._loss_hook.remove()
            self._loss_hook = None
        if self._session is None:
            return None
        return self._session.close(exc)

    def __enter__(self) -> NanTraceCallback:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close(exc)

    # ------------------------------------------------------------------ hooks
    def _capture_loss(self, module: nn.Module, args: Any, output: Any) -> None:
        s = self._session
        if s is None or not s.active or (s.watch is not None and s.watch.replaying):
            return  # a watch replay runs the forward again: its loss is the step's, recorded by the replay
        loss = _model_loss(output)
        if loss is None:
            return
        value = loss.detach().float().sum()  # only whether it stays finite is read, at the next log
        self._loss_sum = value if self._loss_sum is None else self._loss_sum + value
        if s.rec.scaler is None:
            s.tr.step(loss=loss)  # a GradScaler's scale() records the loss itself
