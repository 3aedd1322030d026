"""The :class:`Trace` facade: ``nantrace.trace(...)`` returns one; while it records it holds a
:class:`~nantrace._recording.Recording`, and every question is one line handing a :class:`~nantrace._view.RunView`
to the analysis (:mod:`nantrace._explain`, :mod:`nantrace._diagnose`, ...). A loaded trace holds only a view."""

from __future__ import annotations

import os
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any

import pandas as pd
import torch
from torch import nn

from . import _io, _readiness, _report, _repro, _tensorboard, _watched
from ._errors import NantraceError
from ._format import joined_records, segments_records, streamed_records
from ._live import Live
from ._options import ModuleFilter, TraceOptions
from ._recording import Recording
from ._view import RunView, view_of
from ._watch import DEFAULT_EVERY, Watch

if TYPE_CHECKING:
    from collections.abc import Iterable

    from torch.utils.tensorboard import SummaryWriter

    from ._diagnosis import Diagnosis
    from ._overflow import Overflow

__all__ = ["Trace", "load", "served", "trace", "trace_of", "watch"]


def served(df: pd.DataFrame) -> pd.DataFrame:
    """A copy of ``df`` that the caller may change without changing ``df``: shallow under pandas Copy-on-Write
    (always on from pandas 3; ``pd.options.mode.copy_on_write = True`` in pandas 2), else deep."""
    if int(pd.__version__.split(".", 1)[0]) >= 3 or pd.get_option("mode.copy_on_write") is True:
        return df.copy(deep=False)
    return df.copy()


class Trace:
    """A recording of one training run; a context manager that hooks ``model`` while inside ``with``.

    Create it with :func:`nantrace.trace`. Read it with :attr:`records`, :attr:`steps`,
    :meth:`first_overflow` and :meth:`overflows`; it stays readable after ``with`` exits, also after the loop
    raised.
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        scaler: torch.amp.GradScaler | None = None,
        optimizer: torch.optim.Optimizer | None = None,
        **options: Any,
    ) -> None:
        unknown = sorted(set(options) - set(TraceOptions.names()))
        if unknown:
            raise TypeError(
                f"nantrace.trace() got unknown option(s) {unknown}; the options are {list(TraceOptions.names())}"
            )
        opts = TraceOptions(**options)
        self._recording: Recording | None = Recording(model, scaler=scaler, optimizer=optimizer, options=opts)
        if self._recording.stream_path is not None:  # a streamed trace ends by replacing the file at path
            _io.refuse_non_trace(self._recording.stream_path, "trace(path=...)")
        self._loaded: RunView | None = None
        self._live: Live | None = None
        self._streamed: pd.DataFrame | None = None
        self._flushed: tuple[int, pd.DataFrame] | None = (
            None  # (segments read, their records) while streaming
        )
        self._watch: Watch | None = None
        rec = self._recording
        if opts.live_every is not None and rec.world_size > 1:
            self._live = Live(opts.live_every, rec.rank, rec.world_size)
            rec.add_step_observer(self._live)

    @classmethod
    def _of_view(cls, view: RunView) -> Trace:
        tr = cls.__new__(cls)
        tr._recording, tr._loaded, tr._live, tr._streamed = None, view, None, None
        tr._flushed = None
        tr._watch = None
        return tr

    def _view(self) -> RunView:
        """The run view every question is answered from (the recording's closed steps, or the loaded tables)."""
        if self._loaded is not None:
            return self._loaded
        rec = self._recording
        assert rec is not None
        if rec.stream_path is not None and rec.closed:  # the whole run, read back from the streamed file
            if self._streamed is None:
                self._streamed = streamed_records(rec.stream_path, rec.store.records())
            return view_of(rec, self._streamed)
        segs = list(getattr(rec.store, "stream_segments", ()))
        if rec.stream_path is not None and segs:  # still streaming: the segments written so far, then memory
            if self._flushed is None or self._flushed[0] != len(segs):
                self._flushed = (len(segs), segments_records(segs))  # read again only when a segment is added
            return view_of(rec, joined_records(self._flushed[1], rec.store.records()))
        return view_of(rec)

    # ------------------------------------------------------------------ context manager
    def __enter__(self) -> Trace:
        if self._recording is None:
            raise NantraceError(
                "this Trace was loaded from a file and is read-only; record with nantrace.trace()"
            )
        if self._watch is not None:
            self._watch.enter()
        else:
            self._recording.enter()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self._watch is not None:
            self._watch.exit(failed=exc_type is not None)
        elif self._recording is not None:
            self._recording.exit(failed=exc_type is not None)

    # ------------------------------------------------------------------ recording
    def step(self, loss: torch.Tensor | float | None = None) -> None:
        """Mark a step boundary, and/or record the loss of this step.

        With a ``scaler`` (boundary: ``scaler.update()``) or an ``optimizer`` (boundary: ``optimizer.step()``),
        this only records ``loss``. Without either, it closes the current step; once it has been called, root
        forward calls no longer start steps by themselves (gradient accumulation works).

        Args:
            loss: the step's loss tensor (any shape; its mean is the step's ``loss``), a Python float (a loss
                already read with ``.item()``), or None.

        Raises:
            NantraceError: the trace is not inside its ``with`` block.
            TypeError: ``loss`` is not a tensor, a Python number or None.
        """
        if self._recording is None:
            raise NantraceError("Trace.step() was called outside its `with nantrace.trace(...)` block")
        if self._watch is not None:
            self._watch.step(loss)
        else:
            self._recording.step(loss)

    def save(self, path: str | os.PathLike[str]) -> Path:
        """Write the trace to ``path`` (``~`` is expanded) as one parquet file (pyarrow), atomically.

        The file holds ``records`` as the table, and ``steps``, ``ops`` and a header (format version, nantrace,
        torch and python versions, model class, dtypes, the arguments of ``trace``) as metadata. The write goes
        to a temporary file in the same directory that is renamed over ``path``, so an interrupted save leaves
        no half-written file. Steps still open inside ``with`` are not included.

        Under ``torch.distributed`` with ``world_size > 1`` every rank calls ``save`` with the same ``path``:
        ``path`` becomes a folder and this rank writes ``rank-RRRRR-of-WWWWW.nantrace`` in it (the same atomic
        write), never touching the other ranks' parts. ``nantrace.load(path)`` merges them.

        Returns:
            the path written, as a ``pathlib.Path``.

        Raises:
            TypeError: ``path`` is not a str or path-like.
            ValueError: ``path`` is a directory, or its directory does not exist or is not writable; under
                torch.distributed: ``path`` is an existing file, or a folder holding parts of another world size.
        """
        return _io.save_view(self._view(), path, recording=self._recording is not None)

    def save_repro(self, path: str | os.PathLike[str]) -> Path:
        """Write a reproducer of the module call captured by ``nantrace.trace(..., capture=...)`` to ``path``
        (``~`` is expanded), whatever event it is.

        The captured call is the first watched call whose forward produced a non-finite value; with named
        modules (``capture="gate"``) and no such call, the latest call of a named module in the first step
        that recorded a non-finite value (a fault that shows in backward only: hunt it with
        ``nantrace.hunt(lambda: repro.run().sum().backward(), kind="nan")``). ``load_repro(path)`` tells which
        (``module_name``, ``step``, ``call``, ``kinds``, empty for the second kind). Unlike
        :meth:`Overflow.save_repro` it does not check that the call is the trace's first overflow. File
        format and atomic write as in :meth:`Overflow.save_repro`.

        Returns:
            the path written, as a ``pathlib.Path``.

        Raises:
            NantraceError: the trace had no ``capture=`` (a loaded trace never has one) or nothing was kept
                (the message names the watched modules and where the first overflow is), or the module's class
                cannot be imported back by its path.
            TypeError / ValueError: ``path`` is not a path, is a directory, or its directory does not exist
                or is not writable.
        """
        capture = self._recording.capture if self._recording is not None else None
        first = self.first_overflow() if capture is not None and capture.call is None else None
        return _repro.save_repro(_repro.captured_call(capture, first), path)

    # ------------------------------------------------------------------ tables
    @property
    def records(self) -> pd.DataFrame:
        """One row per recorded tensor (see README "records columns"); steps closed so far.

        With ``trace(path=...)`` it is the whole run too: inside ``with`` the steps already written (read back
        from the flushed segments, again only when one is added) followed by those still in memory (at most
        ``flush_every``), after exit the file; :meth:`first_overflow`, :meth:`overflows` and :meth:`diagnose`
        see the same steps.

        Each access returns a new copy (cheap under pandas Copy-on-Write, a deep copy with pandas 2 without it):
        changing the returned frame, also in place, never changes the trace or what its locator finds. The same
        holds for :attr:`steps` and :attr:`ops`."""
        return served(self._view().records)

    @property
    def steps(self) -> pd.DataFrame:
        """One row per closed step: ``step, loss, scale, next_scale, skipped, growth_tracker, lr, grad_norm,
        n_nonfinite`` (plus ``micro_steps, n_records``); a new copy on each access, as :attr:`records`."""
        return served(self._view().steps)

    @property
    def ops(self) -> pd.DataFrame:
        """Forward drill-down: ``step, micro_step, module, call, op, kind, operands, source, reaches`` for each
        module call where a non-finite kind first appeared in a micro-step, or whose finite output the recorded
        statistics showed may hide a transient inf (more zeros out than in, an input beyond the cube root of
        its dtype's max), naming the first torch op inside it that made the kind (found by replaying that call
        on CPU; empty on the ``sync_free`` path). ``operands`` holds that op's operand facts (JSON text),
        ``source`` the user's ``path:line`` that ran it (None when not known, e.g. autocast's cast), and
        ``reaches`` is False when the call's output was the same whatever finite value the op's non-finite
        elements had (a selection discarded them: not a forward fault). ``kind`` ``"mask"``: the call's output
        held -inf that only ops taking a -inf scalar made (``op`` names the first: ``masked_fill(m, -inf)``,
        ``where(c, x, -inf)``), an intended mask value that the locator does not report. A new copy on each
        access."""
        return served(self._view().ops)

    @property
    def options(self) -> dict[str, Any]:
        """The arguments of ``trace`` as recorded (a loaded trace: as saved)."""
        return self._view().meta.options

    @property
    def header(self) -> dict[str, Any]:
        """A loaded trace's file header (versions, model class, dtypes, options, rank, run id); ``{}`` while
        recording."""
        return self._view().meta.header

    @property
    def model_class(self) -> str:
        """The traced model's class name (``"GPT"``, or ``"GPT (in DistributedDataParallel)"``)."""
        return self._view().meta.model_class

    # ------------------------------------------------------------------ analysis: one line each
    def first_overflow(self, kind: str | None = None) -> Overflow | None:
        """The producer of the first non-finite value, or ``None`` if every recorded value was finite.

        Args:
            kind: ``None`` (NaN or ±inf), ``"inf"`` (±inf only) or ``"nan"`` (NaN only).

        Raises:
            ValueError: ``kind`` is none of those.
        """
        return _watched.first_overflow(self._view(), kind)

    def overflows(
        self, kind: str | None = None, *, per_rank: bool = False, messages: bool = True
    ) -> pd.DataFrame:
        """One row per step that saw a non-finite value, with that step's first producer (``Overflow`` fields
        plus ``message``). Scaler backoffs show as a few isolated steps; a persistent fault as a run of them.

        Under torch.distributed the producer is the cross-rank one (ordering rule in ``nantrace._locate``);
        ``per_rank=True`` gives one row per (step, rank) instead: each rank's own first non-finite value, with
        ``propagated=True`` where that rank only received it through the gradient reduction.
        ``messages=False`` leaves ``message`` empty: every step's explanation reads the
        run's history (about 0.1-0.2 s a step on 2 CPU cores), so for a long run whose every later step holds
        NaN, the producers alone come back in seconds instead of minutes.

        Raises:
            ValueError: ``kind`` is not None, ``"inf"`` or ``"nan"``.
            TypeError: ``per_rank`` or ``messages`` is not a bool.
        """
        for name, v in (("per_rank", per_rank), ("messages", messages)):
            if not isinstance(v, bool):
                raise TypeError(f"{name} must be True or False; got {type(v).__name__}: {v!r:.80}")
        return _watched.overflows(self._view(), kind, per_rank=per_rank, messages=messages)

    def diagnose(self) -> Diagnosis:
        """Why the run went non-finite, and what to do: a :class:`nantrace.Diagnosis` whose ``cause`` is one of
        ``"data", "forward_overflow", "invalid_op", "loss", "backward_overflow", "scaler_backoff",
        "loss_scale_collapse", "divergence", "optimizer", "gradient_underflow", "healthy"`` (or, for one rank
        of a torch.distributed run that only received the value through the gradient reduction,
        ``"received"``), with ``evidence``
        (strings holding the numbers) and ``advice`` (fixes naming the module, dtype and number)."""
        return _watched.diagnose(self._view())

    def fp16_readiness(self, *, loss_scale: float | None = None) -> pd.DataFrame:
        """From an fp32 or bf16 run: which modules would overflow in fp16 (absmax above 65504 =
        torch.finfo(torch.float16).max; ``headroom_bits`` = log2(65504 / absmax)) or lose values to
        underflow (non-zero |x| below 2**-14, the smallest normal, or 2**-24, the smallest subnormal), worst
        first. ``loss_scale`` judges gradients as if scaled by it. See ``nantrace._diagnose.fp16_readiness``."""
        return _readiness.fp16_readiness(self._view().records, loss_scale=loss_scale)

    def to_tensorboard(
        self, logdir_or_writer: str | os.PathLike[str] | SummaryWriter, *, tag_prefix: str = "nantrace"
    ) -> Path | None:
        """Write per-step scalars (``loss``, ``loss_scale``, ``skipped``, ``grad_norm``, ``n_nonfinite``) and
        per-module ``absmax/<module>`` and ``headroom_bits/<module>`` (log2(65504 / absmax) of the forward
        outputs) to TensorBoard, with ``tag_prefix/`` in front of every tag and nantrace's step as
        ``global_step``. A NaN/±inf value is written as it is plus a marker series ``nonfinite/<tag>`` that is
        1.0 at that step (0.0 elsewhere), because TensorBoard's charts do not draw non-finite points; for a
        module, ``nonfinite/absmax/<module>`` is 1.0 where its outputs held NaN/±inf while ``absmax/<module>``
        is +inf for ±inf and the finite absmax otherwise (NaN elements never raise it), and ``headroom_bits``
        is −inf where absmax is +inf. Each call adds a new event file: exporting twice into one directory shows
        every point twice. Every tag is listed in ``nantrace._tensorboard``.

        Args:
            logdir_or_writer: a directory (created if needed; a new event file is written and closed there), or
                an open ``torch.utils.tensorboard.SummaryWriter``, which is flushed and left open.
            tag_prefix: the first part of every tag.

        Returns:
            the log directory written to, or ``None`` for a writer that does not tell its directory.

        Raises:
            ImportError: the ``tensorboard`` package is missing (``pip install "nantrace[tensorboard]"``).
            TypeError: ``logdir_or_writer`` is neither a path nor a writer.
            ValueError: ``tag_prefix`` is empty or has a leading/trailing ``/``, or the directory cannot be
                created.
        """
        return _tensorboard.write_tensorboard(self._view(), logdir_or_writer, tag_prefix=tag_prefix)

    # ------------------------------------------------------------------ ranks
    @property
    def rank(self) -> int | None:
        """The ``torch.distributed`` rank this trace recorded (0 without a process group); ``None`` for a trace
        merged from several ranks' parts (see :attr:`ranks`)."""
        return self._view().meta.rank

    @property
    def world_size(self) -> int:
        """Number of ranks of the run (``torch.distributed.get_world_size()``; 1 without a process group)."""
        return self._view().meta.world_size

    @property
    def ranks(self) -> list[int]:
        """The ranks whose rows this trace holds (``[rank]`` for one rank's trace)."""
        return list(self._view().meta.ranks)

    @property
    def live_reports(self) -> list[str]:
        """The lines of the live check (``live_every=``) so far; rank 0 also printed them to stderr."""
        return list(self._live.reports) if self._live is not None else []

    def rank_view(self, rank: int) -> Trace:
        """The rows of one rank of a merged trace, as a read-only trace of its own.

        Raises:
            ValueError: ``rank`` is not one of :attr:`ranks`.
        """
        if isinstance(rank, bool) or not isinstance(rank, int) or rank not in self.ranks:
            raise ValueError(f"rank must be one of this trace's ranks {self.ranks}; got {rank!r}")
        return Trace._of_view(self._view().rank_view(rank))

    # ------------------------------------------------------------------ reprs
    def __repr__(self) -> str:
        if not hasattr(self, "_loaded"):
            return "<nantrace.Trace (not initialised)>"
        return _report.trace_text(self._view())

    def _repr_html_(self) -> str:
        return _report.trace_html(self._view())


def trace_of(recording: Recording, watch: Watch | None = None) -> Trace:
    """A :class:`Trace` around a recording that a front-end (``nantrace run``, a callback) made and drives
    (with the :class:`~nantrace._watch.Watch` that drives it, if any: ``Trace.step`` then goes through it)."""
    tr = Trace.__new__(Trace)
    tr._recording, tr._loaded, tr._live, tr._streamed = recording, None, None, None
    tr._flushed = None
    tr._watch = watch
    return tr


def trace(
    model: nn.Module,
    scaler: torch.amp.GradScaler | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    modules: ModuleFilter | None = None,
    phases: Iterable[str] | str | None = None,
    sync_free: bool | None = None,
    drill: bool = True,
    every: int = 1,
    path: str | os.PathLike[str] | None = None,
    flush_every: int = 100,
    live_every: int | None = None,
    capture: str | list[str] | tuple[str, ...] | None = None,
) -> Trace:
    """Record the range and inf/NaN counts of every activation and gradient of ``model``.

    Use as ``with nantrace.trace(model, scaler=scaler, optimizer=opt) as tr:`` around the unchanged training
    loop. Hooks are attached on enter and every one is removed on exit, also when the loop raises (the
    exception propagates unchanged); the trace stays readable afterwards.

    Steps: the boundary is ``scaler.update()``, else ``optimizer.step()``, else ``Trace.step()``, else each call
    of ``model`` (a root forward). Each root forward inside a step is one micro-step. With a ``scaler`` or an
    ``optimizer`` (a training trace), a root forward that starts with autograd disabled (``torch.no_grad()``,
    ``torch.inference_mode()``: evaluation) is not a micro-step and nothing inside it is recorded, since it
    cannot contribute gradients to the step; trace evaluation separately with ``nantrace.trace(model)``. A root
    wrapped whole in reentrant activation checkpointing also runs under no_grad and is left out that way (use
    ``use_reentrant=False``). Without scaler or optimizer every root forward is recorded and starts a step.

    Args:
        model: the ``nn.Module`` to trace. Wrapper prefixes (DDP ``module.``, FSDP, checkpoint wrappers,
            ``torch.compile``'s ``_orig_mod.``) are dropped from module names.
        scaler: the ``torch.amp.GradScaler`` the loop uses; its ``update()`` then marks step boundaries, and the
            loss scale, skipped steps and growth tracker are recorded. ``scaler`` and ``optimizer`` may be
            passed by position (``trace(model, scaler, optimizer)``); every option after them is keyword-only.
        optimizer: the ``torch.optim.Optimizer``; parameters are recorded after each ``step()``, which marks the
            step boundary when there is no scaler.
        modules: which submodules to hook: a name glob (``"encoder.*"``), an ``nn.Module`` subclass, a callable
            ``(name, module) -> bool``, or a list of these. Default: all. The root always records its inputs
            (phase ``data``) and outputs.
        phases: which of ``"data", "forward", "loss", "backward", "optimizer"`` to record (default: all): a
            list of names, one name, or a comma-separated string (``"data,forward"``, as the CLI takes it).
        sync_free: compute statistics with on-device reductions only, read once per step (the accelerator
            path), also for CPU tensors. Default ``None``: on-device for accelerator tensors, a faster path
            that branches on values for CPU tensors (where reading a value costs no device sync).
        drill: on the CPU path, when a module call's output first holds a kind of non-finite value (NaN,
            +inf, -inf) in a micro-step, replay that call once on copies of its inputs and buffers, with
            autograd off and the RNG state forked, to name the first torch op inside it that made the value
            (``Trace.ops``); a finite call is replayed too when its recorded statistics point to a transient
            inf (at most once per new high of the signal per module, and then up to three more times to
            tell whether the value reached the output). The replay runs the module's Python ``forward`` again, so Python side effects
            in it (counters, caches) happen twice for that one call; pass ``False`` to turn it off.
        every: record full statistics on every N-th step (steps 0, N, 2N, …). On the steps between, each
            tensor costs one ``torch.aminmax`` pass and gets a row only if it holds inf/NaN, so the locator
            still finds the first producer on any step (CPU path; on the ``sync_free`` path every step is
            recorded in full). Default 1.
        path: stream the trace to this parquet file as it is recorded, for long runs: every ``flush_every``
            finished steps are appended to the file and dropped from memory; on exit (also after an
            exception) the file is completed with the ``steps``/``ops`` tables and header and moved into
            place. ``nantrace.load(path)`` reads the whole run back.
        flush_every: steps kept in memory between writes when streaming (default 100).
        live_every: under torch.distributed, every N-th step boundary run one ``all_gather`` of 7 int64 per
            rank so that rank 0 prints which rank produced the first non-finite value since the last check
            (``nantrace: rank 3 produced +inf in `layers.7.mlp.fc2` at step 120 (forward)``, on stderr). A
            collective: every rank must pass the same step boundaries. Default ``None``: off. Without a process
            group (or with one rank) it does nothing.
        capture: keep a copy of the inputs of the first module call that produced a non-finite value (its
            output holds NaN/+inf/-inf that its inputs did not; an output holding only 0 and -inf (one 0 at least), or named
            ``mask``/``bias``, is a mask), for :meth:`Overflow.save_repro` and :func:`nantrace.load_repro`.
            ``"first"`` (the string) watches every traced module, and is not a module name: a module literally
            named ``first`` is captured with the list ``["first"]``. A qualified module name (or a list of
            them) watches only those. ``None`` (default): off. Cost: each watched call's inputs are copied
            (``detach().clone()``, with their ``requires_grad`` noted) in its forward pre-hook and the copy is
            dropped when the call returns clean; the forward hook reads whether the output holds a new kind,
            which is a device sync per watched call on an accelerator (this mode is not sync-free). Once one
            call is kept (with a copy of the module's ``state_dict`` right after it, its dtype and the autocast
            state) nothing more is copied. Only forward outputs are checked; for a fault that appears in
            backward only, name the module: with named modules the latest clean call (inputs and a
            ``state_dict`` copy per call) is kept too, and frozen at the end of the first step that recorded a
            non-finite value, so :meth:`Trace.save_repro` can save it and
            ``nantrace.hunt(lambda: repro.run().sum().backward(), kind="nan")`` names the backward op.

    Under an initialised ``torch.distributed`` process group each rank records its own trace (``rank`` in
    ``records``, ``steps`` and ``Overflow``), with ``world_size > 1`` also the parameter gradients after the
    cross-rank reduction (``reduced=True`` rows); ``path=`` and ``Trace.save`` then write this rank's part into
    a folder at that path. See ``nantrace._locate`` for the cross-rank ordering rule. With ``world_size > 1``
    creating the trace is a collective: rank 0 makes a run id (a uuid) and broadcasts it
    (``torch.distributed.broadcast_object_list``), so every rank must call ``trace`` (as with the model itself);
    each part's header keeps it, and ``nantrace.load`` of the folder merges the parts of the newest run only.

    Returns:
        the :class:`Trace` (a context manager).

    Raises:
        TypeError: ``model`` is not an ``nn.Module``, ``scaler`` not a ``GradScaler``, ``optimizer`` not an
            ``Optimizer`` (a class passed instead of an instance is named as such), a ``modules`` item of
            another type, ``every`` is not an int, or ``capture`` is not a str or list of str.
        ValueError: ``modules`` is empty or matches no module, ``phases`` is empty or names an unknown
            phase, ``every`` is below 1, ``flush_every`` is not an int ≥ 1, ``live_every`` is neither None nor an
            int ≥ 1, ``path`` is a directory or in a directory that does not exist or is not writable, or
            ``capture`` names a module that is not traced.
        NantraceError (on enter): the model is already being traced.
    """
    options = TraceOptions(
        modules=modules,
        phases=phases,
        sync_free=sync_free,
        drill=drill,
        every=every,
        path=path,
        flush_every=flush_every,
        live_every=live_every,
        capture=capture,
    )
    return Trace(model, scaler=scaler, optimizer=optimizer, **vars(options))


def watch(
    model: nn.Module,
    scaler: torch.amp.GradScaler | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    every: int | None = DEFAULT_EVERY,
    **options: Any,
) -> Trace:
    """Leave-on mode: a nearly free sentinel on every step; the step that goes non-finite is replayed and
    recorded in full; every ``every``-th step is recorded in full for range history. The same :class:`Trace`.

    Use it like :func:`trace`: ``with nantrace.watch(model, scaler=scaler, optimizer=opt) as tr:`` around the
    unchanged loop. Steps, micro-steps and phases mean what they mean there, and ``tr.first_overflow()`` gives
    the same answer as ``nantrace.trace`` would on the same run.

    Every step, the sentinel checks the root's inputs and outputs, the loss, the gradients arriving at the
    outputs (one ``torch.aminmax`` per tensor: NaN and ±inf show in it), the gradients before
    ``optimizer.step()`` (one fused ``torch._foreach_norm``, beside the GradScaler's found-inf) and the
    parameters after it. Its
    flags stay device tensors, read once before ``optimizer.step()`` and once at the step boundary (never
    inside a hook). ``steps`` gets a row per step (loss, scale, skipped, lr, growth tracker, grad norm).

    When a flag is non-finite, every micro-step of that step is replayed with full recording before
    ``optimizer.step()`` runs: the root forward on the same inputs, with the RNG state (CPU and CUDA),
    autocast state and grad mode it had, then the backward from the gradients that reached the outputs in the
    real step, in the real order. ``.grad`` of every parameter, the module buffers (BatchNorm running
    statistics) and the RNG states are restored afterwards, and the optimizer and scaler are not touched, so the
    run continues bit for bit as without nantrace. A non-finite parameter after ``optimizer.step()`` is recorded
    as that step's ``optimizer`` rows. ``steps.recorded`` says how each step was recorded: ``"full"``,
    ``"watch"`` (sentinel only), ``"replay"``, ``"post_step"``, ``"not_reproduced"`` (the replay recorded
    no non-finite value: non-deterministic kernels, or inputs changed in place after the forward) or
    ``"not_replayed"`` (in a process group of several ranks the model holds FSDP or DDP modules, whose
    collectives a replay on one rank would wait on forever); for the last two ``first_overflow()`` and
    ``diagnose()`` report where the sentinel detected it, and say so.

    Memory: until each step ends, watch holds references to the root's inputs of every micro-step (no copy;
    the user's own tensors) and the gradients that arrived at the root's outputs (for a language model, the
    logits' gradient: batch × sequence × vocabulary elements in the logits' dtype, per micro-step), plus the
    CPU RNG state (about 5 KB) per micro-step.

    Args:
        model, scaler, optimizer: as :func:`trace`.
        every: record a full step on steps 0, N, 2N, … (default 100: about 1/100 of full tracing's extra cost
            on top of the sentinel's); ``None``: only the steps that go non-finite.
        **options: the other options of :func:`trace` (``modules``, ``phases``, ``sync_free``, ``drill``,
            ``path``, ``flush_every``, ``live_every``, ``capture``); they apply to the steps recorded in full.

    Returns:
        the :class:`Trace` (a context manager).

    Raises:
        TypeError / ValueError: as :func:`trace` (an unknown option is a TypeError naming ``nantrace.watch()``);
            ``every`` is neither None nor an int (TypeError) or is below 1 (ValueError).
        NantraceError (on enter): the model is already being traced.
    """
    if every is not None and (isinstance(every, bool) or not isinstance(every, int) or every < 1):
        wrong_type = isinstance(every, bool) or not isinstance(every, int)
        raise (TypeError if wrong_type else ValueError)(
            f"every must be None (no periodic full step) or an int ≥ 1 (a full step every N steps); got {every!r}. "
            f"Pass e.g. every={DEFAULT_EVERY} (the default), or every=None for only the replayed steps."
        )
    unknown = sorted(set(options) - set(TraceOptions.names()))
    if unknown:
        raise TypeError(
            f"nantrace.watch() got unknown option(s) {unknown}; the options are "
            f"{['every', *(n for n in TraceOptions.names() if n != 'every')]}"
        )
    tr = Trace(model, scaler=scaler, optimizer=optimizer, **options)
    assert tr._recording is not None
    tr._watch = Watch(tr._recording, every)
    return tr


def load(path: str | os.PathLike[str]) -> Trace:
    """Read a trace written by :meth:`Trace.save` as a read-only :class:`~nantrace.Trace`.

    Its ``records``, ``steps``, ``ops``, ``first_overflow()``, ``overflows()`` and reprs equal the original's.

    A folder that the ranks of a ``torch.distributed`` run saved into (same ``path`` on every rank) loads as one
    trace merged from all rank parts: every row keeps its ``rank``, and the locator works across ranks. Only the
    parts of the newest run (by their header's ``run_id`` and ``saved_at``) are merged: parts left over from
    another run in the folder are ignored with a ``UserWarning`` naming them, and ranks missing from the newest
    run give another ``UserWarning``.

    Raises:
        FileNotFoundError: ``path`` does not exist.
        NantraceError: ``path`` is not a trace (a nantrace reproducer is named as such: rebuild it with
            :func:`nantrace.load_repro`), or comes from an incompatible format version; a folder without
            rank parts, or with parts of several world sizes.
    """
    return Trace._of_view(_io.load_view(path))
