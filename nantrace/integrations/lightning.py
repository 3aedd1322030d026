"""``NanTraceCallback``: trace a ``lightning.pytorch.Trainer`` run with nantrace.

Needs the ``lightning`` extra: ``pip install "nantrace[lightning]"``.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .._errors import NantraceError
from .._options import ModuleFilter
from .._trace import Trace
from ._common import (
    LOG_KEYS,
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
    import lightning.pytorch as pl
except ImportError as e:  # the extra is not installed
    raise ImportError(
        'nantrace.integrations.lightning needs lightning: pip install "nantrace[lightning]"'
    ) from e

__all__ = ["NanTraceCallback"]


class NanTraceCallback(pl.Callback):
    """A Lightning ``Callback`` that traces the ``LightningModule`` with :func:`nantrace.trace`.

    At train start it attaches to the module (or its submodule ``root``), to ``trainer.optimizers[0]``
    and to the precision plugin's GradScaler (``trainer.precision_plugin.scaler``: ``MixedPrecision`` with
    ``"16-mixed"``; bf16 and 32-bit plugins have none). Steps are optimizer steps: nantrace's step ``k`` is
    the one after which ``trainer.global_step`` is ``k + 1``. Only training batches are recorded: validation,
    logging and checkpointing between them are not.

    The model's inputs (phase ``data``) are the arguments of the traced module's ``forward``, so
    ``training_step`` must call it: ``self(x)`` for the default ``root``, or ``self.model(x)`` with
    ``root="model"``. A warning says so when a training step closes without that call.

    After each optimizer step it logs, with ``pl_module.log(..., on_step=True, on_epoch=False)`` (so to the
    Trainer's loggers every ``log_every_n_steps``, and to ``trainer.callback_metrics``):

    * ``loss_scale``: the loss scale the step's backward used (NaN without a GradScaler);
    * ``skipped``: 1 if the GradScaler skipped the step, else 0;
    * ``n_nonfinite``: how many recorded tensors of the step held NaN/±inf (attention masks not counted).

    The step's loss (``steps.loss``) is what ``backward`` gets, seen through the GradScaler's ``scale()`` or,
    without one, ``on_before_backward``: with ``accumulate_grad_batches=N``, Lightning's loss divided by ``N``.

    At train end, and when training raises (``on_exception``), it detaches and saves the trace to
    ``trace_path`` (default ``<trainer.log_dir>/trace.nantrace``; in a multi-process run every rank passes
    that same path and ``Trace.save`` writes its part into it, see README "Multi-GPU"). ``trace`` holds the :class:`~nantrace.Trace`, ``saved_path`` the file.

    Args:
        trace_path: where to save the trace; default ``<trainer.log_dir>/trace.nantrace``.
        stop_on_overflow: ``True`` stops training (``trainer.should_stop``) after the first step that held a
            non-finite value (a GradScaler backoff included), after saving the trace; an int ``N`` waits for
            ``N`` consecutive such steps. With a default-scale GradScaler (65536, which backs off in the first
            steps of most fp16 runs) pass ``N`` (e.g. 5), since ``True`` stops at that first benign backoff.
        root: qualified name of the submodule ``training_step`` calls (e.g. ``"model"``); default ``None``,
            the LightningModule itself.
        tensorboard: a directory: when the trace is saved at train end (also after a stop or an error), it
            is also written there for TensorBoard by :meth:`nantrace.Trace.to_tensorboard` (tags
            ``nantrace/...``). Needs the ``tensorboard`` extra, checked here.
        modules, phases, sync_free, drill, every: passed to :func:`nantrace.trace`.
        watch: ``False`` (default): trace every step in full. ``True``: :func:`nantrace.watch` (a nearly free
            sentinel every step, the faulty step replayed in full, a full step every 100); an int N: watch
            with a full step every N (``every`` then only shapes those); ``None``: watch, only faulty steps.

    Raises:
        ImportError: ``tensorboard`` is given but the tensorboard package is not installed.
        TypeError, ValueError: a bad argument, here (the trace options are checked as :func:`nantrace.trace`
            checks them; only whether ``modules`` matches a module waits for the model, at train start).
        NantraceError (at train start): ``root`` names no submodule, or the Trainer has no optimizer.
    """

    def __init__(
        self,
        *,
        trace_path: str | os.PathLike[str] | None = None,
        stop_on_overflow: bool | int = False,
        tensorboard: str | os.PathLike[str] | None = None,
        root: str | None = None,
        modules: ModuleFilter | None = None,
        phases: Iterable[str] | None = None,
        sync_free: bool | None = None,
        drill: bool = True,
        every: int = 1,
        watch: bool | int | None = False,
    ) -> None:
        if root is not None and not isinstance(root, str):
            raise TypeError(f"root must be a submodule's qualified name (str) or None; got {root!r:.80}")
        self._path = check_path(trace_path, "trace_path")
        self._stop_after = check_stop(stop_on_overflow)
        self._tensorboard = check_tensorboard(tensorboard)
        self._root = root
        self._watch = check_watch(watch)
        self._options = TraceOptions(
            modules=modules, phases=phases, sync_free=sync_free, drill=drill, every=every
        )
        self._session: Session | None = None
        self._warned_no_forward = False

    @property
    def trace(self) -> Trace | None:
        """The trace of the latest ``fit`` (None before the first); readable during and after it."""
        return None if self._session is None else self._session.tr

    @property
    def saved_path(self) -> Path | None:
        """The file the trace was last saved to (None until it has been saved)."""
        return None if self._session is None else self._session.saved

    # ------------------------------------------------------------------ Trainer events
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._session is not None and not self._session.closed:
            self._session.close()
        model: nn.Module = pl_module
        if self._root is not None:
            try:
                model = pl_module.get_submodule(self._root)
            except AttributeError as e:
                names = [n for n, _ in pl_module.named_children()]
                raise NantraceError(
                    f"root={self._root!r} names no submodule of {type(pl_module).__name__}; "
                    f"its children are {names}"
                ) from e
        if not trainer.optimizers:
            raise NantraceError("the Trainer has no optimizer (configure_optimizers returned none)")
        optimizer, _ = unwrap_optimizer(trainer.optimizers[0])
        scaler = getattr(trainer.precision_plugin, "scaler", None)
        if not isinstance(scaler, torch.amp.GradScaler):
            scaler = None
        log_dir = trainer.log_dir or trainer.default_root_dir  # log_dir is collective: every rank calls it
        path = self._path or Path(log_dir) / "trace.nantrace"
        self._session = Session(
            traced(self._options, model, scaler, optimizer), path, self._tensorboard, self._watch
        )
        self._warned_no_forward = False

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if self._session is not None:
            self._session.recording(True)

    def on_before_backward(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: torch.Tensor
    ) -> None:
        s = self._session
        if s is not None and s.active and s.rec.scaler is None:
            s.tr.step(loss=loss)  # with a GradScaler, its scale() records the loss itself

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        s = self._session
        if s is None or s.closed:
            return
        s.recording(False)
        rows = s.new_steps()
        if not rows:  # gradient accumulation: no optimizer step in this batch
            return
        summary = s.summary(rows)
        for key in LOG_KEYS:
            pl_module.log(key, float(summary[key]), on_step=True, on_epoch=False)
        if not self._warned_no_forward and any(r["micro_steps"] == 0 for r in rows):
            self._warned_no_forward = True
            name = type(pl_module).__name__ if self._root is None else f"{self._root!r}"
            warnings.warn(
                f"nantrace: a training step ended without a call of the traced module's forward ({name}), so "
                "its inputs (phase 'data') and step structure are not recorded. Call it in training_step "
                "(self(x)), or pass NanTraceCallback(root=...) naming the submodule training_step calls.",
                stacklevel=2,
            )
        if self._stop_after and s.should_stop(self._stop_after):
            s.save()
            trainer.should_stop = True

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.close()

    def on_exception(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException
    ) -> None:
        self.close(exception)

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self.close()

    def close(self, exc: BaseException | None = None) -> Path | None:
        """Detach from the module and save the trace (idempotent); returns the file, or None if never attached.

        ``on_train_end``, ``on_exception`` and ``teardown`` call it."""
        if self._session is None:
            return None
        return self._session.close(exc)
