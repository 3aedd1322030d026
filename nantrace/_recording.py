"""The recording session of one trace: validates the model, scaler and optimizer, attaches every hook on
enter, removes every one on exit, closes steps, and offers a small internal API to the front-ends.

:class:`Recording` is what :class:`nantrace.Trace` holds while it records. ``nantrace run`` and the framework
callbacks compose one (they never reach into the facade): :meth:`Recording.pause` / :meth:`Recording.resume`,
:meth:`Recording.bind` for a scaler or optimizer met late, :meth:`Recording.steps_since`,
:meth:`Recording.record_loss`, :attr:`Recording.loss_filter`, :meth:`Recording.run_pre_hook` and
:meth:`Recording.add_step_observer` (called after every closed step, e.g. by the live cross-rank check).
"""

from __future__ import annotations

import contextlib
import itertools
import warnings
import weakref
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pandas as pd
import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from . import _scaler
from ._capture import Capture, make_capture
from ._drill import user_stacklevel
from ._errors import NantraceError
from ._files import check_target
from ._format import MAGIC, footer, make_header
from ._hooks import Recorder, in_backward
from ._masks import FEATURES, mask_named, mask_rows
from ._naming import is_sharded, module_names, torch_builtin
from ._options import TraceOptions, compile_filter
from ._procgroup import part_target, process_group, shared_run_id
from ._samples import SampleWatch
from ._schema import PHASE_CODE, PHASES
from ._store import Store
from ._tree import flatten

__all__ = ["Recording", "StepObserver", "tracing"]

# Every module currently hooked by some active recording (weak: nantrace never keeps a model alive).
_ACTIVE: weakref.WeakKeyDictionary[nn.Module, Recording] = weakref.WeakKeyDictionary()

StepObserver = Callable[["Recording", int, int, bool], None]  # (recording, chunks before, closed step, final)


def tracing(module: nn.Module) -> Recording | None:
    """The active recording that hooks ``module``, or None."""
    return _ACTIVE.get(module)


def _chunk_mask(chunk: dict[str, Any], store: Store) -> Any:
    """The mask rule (:mod:`nantrace._masks`) on one flushed chunk of the store."""
    import numpy as np

    tnames = np.array([mask_named(v) for v in store.tensors.values] + [False], dtype=bool)
    anames = np.array([mask_named(v) for v in store.args.values] + [False], dtype=bool)
    named = tnames[chunk["tensor"]] | anames[chunk["arg"]]  # code -1 picks the trailing False
    feats = np.array([v == FEATURES for v in store.tensors.values] + [False], dtype=bool)
    phase = chunk["phase"]
    return mask_rows(
        chunk["n_nan"],
        chunk["n_posinf"],
        chunk["n_neginf"],
        chunk["n_zero"],
        chunk["numel"],
        (phase == PHASE_CODE["data"]) | (phase == PHASE_CODE["forward"]),
        named,
        (phase == PHASE_CODE["data"]) & feats[chunk["tensor"]],
    )


def _api(options: dict[str, Any]) -> str:
    """``"nantrace.watch"`` or ``"nantrace.trace"``: the function a recording with ``options`` was made by."""
    return "nantrace.watch" if "watch" in options else "nantrace.trace"


def _got(obj: Any, base: type) -> str:
    """What a wrong argument was, in words: a class of the right kind passed instead of an instance says so."""
    if isinstance(obj, type):
        if issubclass(obj, base):
            return f"the class {obj.__name__} itself, not an instance of it"
        return f"the class {obj.__name__}, which is not a {base.__name__}"
    return type(obj).__name__


def _check_objects(model: Any, scaler: Any, optimizer: Any) -> None:
    if not isinstance(model, nn.Module):
        shown = repr(model)
        said = f": {shown}" if len(shown) <= 80 and "\n" not in shown else ""  # no repr cut off mid-word
        got = _got(model, nn.Module) if isinstance(model, type) else f"{type(model).__name__}{said}"
        raise TypeError(
            f"model must be a torch.nn.Module; got {got}. Pass the model object your loop calls (e.g. model = Net())."
        )
    if scaler is not None and not isinstance(scaler, torch.amp.GradScaler):
        swapped = (
            " It is an optimizer: pass it as optimizer=opt (by position, the scaler comes first: model, scaler, "
            "optimizer)."
            if isinstance(scaler, torch.optim.Optimizer)
            else ""
        )
        raise TypeError(
            f"scaler must be a torch.amp.GradScaler (or None); got {_got(scaler, torch.amp.GradScaler)}."
            f"{swapped} Pass the GradScaler object your loop calls scale()/step()/update() on (e.g. scaler = "
            "torch.amp.GradScaler('cuda'))."
        )
    if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
        swapped = (
            " It is a GradScaler: pass it as scaler=scaler (by position, the scaler comes first: model, scaler, "
            "optimizer)."
            if isinstance(optimizer, torch.amp.GradScaler)
            else ""
        )
        raise TypeError(
            f"optimizer must be a torch.optim.Optimizer (or None); got {_got(optimizer, torch.optim.Optimizer)}."
            f"{swapped} Pass the optimizer object your loop calls step() on (e.g. opt = "
            "torch.optim.AdamW(model.parameters()))."
        )
    if optimizer is not None:
        held = [p for g in optimizer.param_groups for p in g.get("params", [])]
        mine = {id(p) for p in model.parameters()}
        if held and not any(id(p) in mine for p in held):
            warnings.warn(
                f"nantrace: the optimizer ({type(optimizer).__name__}) holds none of the traced "
                f"{type(model).__name__}'s parameters, so its step() updates another model: the `optimizer` "
                "rows, lr and step boundaries are this optimizer's. Pass the optimizer that steps this model "
                "(e.g. torch.optim.AdamW(model.parameters())).",
                stacklevel=user_stacklevel(),
            )


class Recording:
    """Hooks on one model (and its scaler and optimizer) feeding one :class:`~nantrace._store.Store`.

    Raises (on construction):
        TypeError / ValueError: as :func:`nantrace.trace` documents (wrong model/scaler/optimizer types, a
            ``modules=`` that matches nothing, an unusable ``path``, a ``capture=`` of an untraced module).
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        scaler: torch.amp.GradScaler | None,
        optimizer: torch.optim.Optimizer | None,
        options: TraceOptions,
    ) -> None:
        _check_objects(model, scaler, optimizer)
        self.rank, self.world_size = process_group()
        self.stream_path = self._stream_target(options.path)
        keep = compile_filter(options.modules)
        named = module_names(model)
        self.selected = [(n, m) for n, m in named if keep(n, m)]
        chosen = {n for n, _ in self.selected}
        # what a modules= filter left out: the explanations say so, live and loaded
        self.untraced_modules = frozenset(n for n, _ in named[1:] if n not in chosen)
        if options.modules is not None and not self.selected:
            raise ValueError(
                f"modules={options.modules!r} matched no module of {type(model).__name__}; "
                f"names look like {[n for n, _ in named[:6]]}"
            )
        self.handles: list[RemovableHandle] = []
        self.model_handles: list[RemovableHandle] = []
        self.suspended: _Suspended | None = None  # the hooks of model_handles while taken out
        self.hook_tails: list[tuple[OrderedDict[int, Any], frozenset[int]]] = []
        self.capture: Capture | None
        self.capture, capture_option = make_capture(
            options.capture, [named[0][0], *(n for n, _ in self.selected)], lambda: self.handles
        )
        self.model_ref = weakref.ref(model)
        self.root_name, self.root = named[0]
        # which traced modules run torch's own forward: a fact the explanations read, saved with the trace
        self.builtin_modules = frozenset(
            n for n, m in [(self.root_name, self.root), *self.selected] if torch_builtin(m)
        )
        # the unwrapped model's class, as module names drop wrappers; the wrapper is named after it
        self.model_class = type(self.root).__qualname__
        if self.root is not model:
            self.model_class += f" (in {type(model).__qualname__})"
        self.scaler = scaler
        self.optimizer = optimizer
        self.store = Store(self.rank)
        self.rec = Recorder(
            self.store,
            sync_free=bool(options.sync_free),
            record_phases=options.phase_set,
            drill=options.drill,
            every=options.every,
        )
        self.rec.capture = self.capture
        self.samples = SampleWatch(bool(options.sync_free), self.rank)
        if self.stream_path is not None:
            self.store.stream_to(self.stream_path, options.flush_every, self._stream_meta)
        self.patched: list[tuple[object, str, bool, Any]] = []
        self.observers: list[StepObserver] = []
        self.entered = False
        self.closed = False
        self.exiting = False
        self.manual_steps = False
        self.reduced_done = False
        self.warned_no_loss = False
        # set by ``nantrace run`` when one GradScaler serves several traced models: which losses are this model's
        self.loss_filter: Callable[[Any], bool] | None = None
        # a collective when world_size > 1: every rank creates its recording (see nantrace._procgroup)
        self.run_id: str | None = shared_run_id() if self.world_size > 1 else None
        self.options: dict[str, Any] = {
            "modules": None if options.modules is None else repr(options.modules),
            "phases": sorted(options.phase_set, key=PHASES.index),
            "sync_free": options.sync_free,
            "drill": options.drill,
            "every": options.every,
            "live_every": options.live_every,
            "capture": capture_option,
            "path": None if self.stream_path is None else str(self.stream_path),
            "scaler": type(scaler).__name__ if scaler is not None else None,
            "optimizer": type(optimizer).__name__ if optimizer is not None else None,
        }
        self.params: list[tuple[nn.Parameter, int, int, str]] = []
        self.sharded_params: set[int] = set()  # DTensor parameters (FSDP2): their hook sees the reduced grad

    def _stream_target(self, path: Any) -> Path | None:
        if path is None:
            return None
        if self.world_size > 1:
            return part_target(path, self.rank, self.world_size)
        return check_target(path)

    # ------------------------------------------------------------------ the small internal API
    @property
    def active(self) -> bool:
        """True while the hooks record (inside ``with`` and not paused)."""
        return self.rec.active

    def pause(self) -> None:
        """Stop recording what the hooks see (they stay attached) until :meth:`resume`."""
        if not self.closed:
            self.rec.active = False

    def resume(self) -> None:
        """Record again after :meth:`pause`; no-op once closed."""
        if not self.closed and self.entered:
            self.rec.active = True

    def steps_since(self, start: int) -> list[dict[str, Any]]:
        """The ``steps`` rows (as dicts) closed from index ``start`` on."""
        return self.store.step_rows.since(start)

    def n_steps(self) -> int:
        """Number of steps closed so far (streamed or not)."""
        return len(self.store.step_rows)

    def add_step_observer(self, observer: StepObserver) -> None:
        """Call ``observer(recording, chunks_before, closed_step, final)`` after every closed step."""
        self.observers.append(observer)

    def run_pre_hook(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """Run this recording's forward pre-hook of ``module`` by hand (hooks registered inside a module call do
        not run for that call: ``nantrace run`` attaches during the root's first call)."""
        pre = next(
            (module._forward_pre_hooks[h.id] for h in self.handles if h.id in module._forward_pre_hooks), None
        )
        if pre is not None:
            pre(module, args, kwargs)

    def bind(
        self, *, scaler: torch.amp.GradScaler | None = None, optimizer: torch.optim.Optimizer | None = None
    ) -> None:
        """Attach a scaler and/or optimizer found after enter (``nantrace run`` meets them as the script runs).

        Each is bound only if the recording has none yet; step boundaries follow it from then on, as if it had
        been passed to ``trace()``. Its patches/hooks are removed on exit like the others.

        Raises:
            NantraceError: the recording is not active (not entered, or closed).
        """
        if not self.entered or self.closed:
            raise NantraceError("Recording.bind() needs an active trace (inside `with`)")
        if scaler is not None and self.scaler is None:
            self.scaler = scaler
            self.options["scaler"] = type(scaler).__name__
            _scaler.attach_scaler(self, scaler)
        if optimizer is not None and self.optimizer is None:
            self.optimizer = optimizer
            self.options["optimizer"] = type(optimizer).__name__
            _scaler.attach_optimizer(self, optimizer)

    def record_loss(self, loss: Any) -> None:
        """Record ``loss`` (a tensor or a container of them) as this step's loss (phase ``loss``)."""
        rec = self.rec
        for path, t in flatten(loss, "loss"):
            if not t.is_floating_point() or t.numel() == 0:
                continue
            if "loss" in rec.phases:
                rec.add("loss", 0, self.store.types.code("loss"), 0, path, t, is_grad=False, parent=-1)
            rec.pending.losses.append(t.detach().float().mean())

    def step(self, loss: torch.Tensor | float | None) -> None:
        """``Trace.step``: record ``loss``; without scaler and optimizer, close the step.

        Raises:
            TypeError: ``loss`` is not a tensor, a Python number or None.
            NantraceError: not recording (outside ``with``).
        """
        if isinstance(loss, (int, float)) and not isinstance(loss, bool):
            loss = torch.tensor(float(loss))  # a loss already read with .item()
        if loss is not None and not isinstance(loss, torch.Tensor):
            raise TypeError(
                f"loss must be a torch.Tensor, a Python float or None; got {type(loss).__name__}: {loss!r:.80}"
            )
        if not self.rec.active:
            raise NantraceError("Trace.step() was called outside its `with nantrace.trace(...)` block")
        if loss is not None:
            self.record_loss(loss)
        if self.scaler is None and self.optimizer is None:
            self.end_step()
            if not self.manual_steps:
                # the root forwards so far were provisionally steps of their own: they form step 0
                self.manual_steps = True
                count = self.rec.step
                self.store.merge_leading_steps(count)
                self.samples.merge_leading_steps(count)
                self.rec.step = min(count, 1)

    # ------------------------------------------------------------------ enter / exit
    def enter(self) -> None:
        """Attach every hook and start recording.

        Raises:
            NantraceError: used twice, or the model is already hooked by another active trace.
        """
        if self.entered:
            raise NantraceError(
                f"this Trace has already been used; create a new one with {_api(self.options)}(model)"
            )
        for _, m in [*self.selected, (self.root_name, self.root)]:
            if _ACTIVE.get(m) is not None:
                raise NantraceError(
                    f"{type(m).__name__} is already being traced by another active nantrace.trace() or "
                    "nantrace.watch(); nested traces of the same model are not supported: exit the first one"
                )
        self.entered = True
        try:
            self._attach()
        except BaseException:
            self._detach()
            raise
        self.rec.active = True

    def exit(self, failed: bool) -> None:
        """Close the open step, remove every hook and patch, and complete a streamed file (also after an
        exception: ``failed``)."""
        self.rec.active = False
        self.exiting = True  # no collective (live check) from here: another rank may have raised
        try:
            if self.rec.step_open():
                self.end_step()
        finally:
            self._detach()
            self.closed = True
            if not failed and not self.store.chunks and not len(self.store.step_rows):
                warnings.warn(
                    f"{_api(self.options)} recorded nothing: no forward call of the traced {self.model_class} and no "
                    "scaler/optimizer step happened inside `with`. Is the traced model the one the loop calls?",
                    stacklevel=user_stacklevel(),
                )
            if self.stream_path is not None:
                self._close_stream()

    @property
    def bad_samples(self) -> list[tuple[int, int, int, str, int, tuple[int, ...]]]:
        """The model inputs that held inf/NaN so far: ``(rank, step, micro_step, tensor, n_bad, first indices)``."""
        return self.samples.rows

    def _stream_meta(self, dtypes: list[str], steps: Any, ops: Any) -> dict[bytes, bytes]:
        """The nantrace metadata of a streamed file or segment holding ``steps``/``ops`` rows."""
        head = make_header(self, pd.DataFrame({"dtype": dtypes}))
        return {MAGIC: footer(head, steps, ops)}

    def _close_stream(self) -> None:
        """Complete the streamed file; a write that failed is reported here (a warning), never raised."""
        store = self.store
        written = store.close_stream()
        if written and store.stream_error is None and not store.stream_lost_steps:
            return
        lost = f"; {store.stream_lost_steps} step(s) were dropped from memory while the writes failed" * bool(
            store.stream_lost_steps
        )
        where = (
            f"it is complete now after earlier write errors (last: {store.stream_error})"
            if written
            else f"it could not be completed ({store.stream_error}); nantrace.load({str(self.stream_path)!r}) "
            "reads the flushed segments, and the steps never written are only in this process (Trace.save "
            "them to another disk)"
        )
        warnings.warn(f"nantrace: the streamed trace {str(self.stream_path)!r}: {where}{lost}.", stacklevel=4)

    def _attach(self) -> None:
        rec, store = self.rec, self.store
        selected_ids = {id(m) for _, m in self.selected}
        mods = list(self.selected)
        if id(self.root) not in selected_ids:
            mods.insert(0, (self.root_name, self.root))
        for name, m in mods:
            mcode = store.modules.code(name)
            tcode = store.types.code(type(m).__name__)
            if self.capture is not None:
                self.capture.watch(mcode, name, type(m).__name__)
            pre, post = rec.module_hooks(
                mcode,
                tcode,
                is_root=m is self.root,
                step_each_forward=self.step_each_forward,
                on_step=self.end_step,
                training=self.training,
            )
            hooks = [
                m.register_forward_pre_hook(pre, with_kwargs=True),
                m.register_forward_hook(post, with_kwargs=True, always_call=True),
            ]
            self.handles += hooks
            if m is not self.root:  # the root's tables run the step boundaries: never suspended
                self.model_handles += hooks
            _ACTIVE[m] = self
            rec.recorded.add(m)  # the drill-down vouches only for outputs the trace records
        self.handles.append(self.root.register_forward_pre_hook(self._look_at_samples, with_kwargs=True))
        ours = {h.id for h in self.handles}
        self.hook_tails = [
            (d, frozenset(ours & d.keys()))
            for _, m in mods
            if m is not self.root  # the root's tables also hold watch's hooks, which keep their place
            for d in (m._forward_pre_hooks, m._forward_hooks)
            if isinstance(d, OrderedDict) and ours & d.keys()
        ]
        self.handles.append(self.root.register_forward_pre_hook(self._hooks_last, prepend=True))
        _hook_parameters(self)
        if self.optimizer is not None:
            _scaler.attach_optimizer(self, self.optimizer)
        if self.scaler is not None:
            _scaler.attach_scaler(self, self.scaler)

    def _hooks_last(self, module: nn.Module, args: tuple[Any, ...]) -> None:
        """Root pre-hook, first of all: :func:`keep_last` on this recording's forward (pre-)hooks."""
        keep_last(self.hook_tails)

    def _look_at_samples(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """After the recorder's root pre-hook: the per-sample flags of a recorded micro-step's model inputs."""
        r = self.rec
        if r.active and not r.eval_depth and r.root_depth == 1 and "data" in r.phases and not in_backward():
            try:
                self.samples.look(r.step, max(r.micro, 0), args, kwargs, r.pending.samples)
            except (torch.OutOfMemoryError, MemoryError):  # a passive observer: the flags are only lost
                self.samples.pending.clear()
                del r.pending.samples[:]

    def suspend_hooks(self) -> None:
        """Take the hooks below the root out of their tables (:class:`_Suspended`) until :meth:`resume_hooks`."""
        if self.suspended is None and self.model_handles:
            self.suspended = _Suspended.take(self.model_handles)

    def resume_hooks(self) -> None:
        """Put back, each at its place, the hooks :meth:`suspend_hooks` took out."""
        suspended, self.suspended = self.suspended, None
        if suspended is not None:
            suspended.put_back()

    def _detach(self) -> None:
        self.suspended = None  # taken out already: nothing to remove
        for h in self.handles:
            h.remove()
        self.handles.clear()
        self.model_handles.clear()
        self.hook_tails.clear()
        for h in self.rec.tensor_handles:
            h.remove()
        self.rec.tensor_handles.clear()
        self.rec.grad_targets.clear()
        for obj, attr, had, old in reversed(self.patched):
            if had:
                setattr(obj, attr, old)
            else:
                with contextlib.suppress(AttributeError):
                    delattr(obj, attr)
        self.patched.clear()
        for m in [self.root] + [m for _, m in self.selected]:
            if _ACTIVE.get(m) is self:
                del _ACTIVE[m]

    def patch(self, obj: object, attr: str, new: Any) -> None:
        """Set ``obj.attr = new`` until exit, when the instance attribute is restored (or removed)."""
        had = attr in vars(obj)
        self.patched.append((obj, attr, had, vars(obj).get(attr)))
        setattr(obj, attr, new)

    # ------------------------------------------------------------------ step structure
    def step_each_forward(self) -> bool:
        return self.scaler is None and self.optimizer is None and not self.manual_steps

    def training(self) -> bool:
        """A training trace (it has a GradScaler or an optimizer): its no-grad root forwards are evaluation."""
        return self.scaler is not None or self.optimizer is not None

    def _warn_no_loss(self) -> None:
        """Once per recording: an optimizer without a GradScaler closed a step in which no loss was seen."""
        if (
            self.warned_no_loss
            or self.exiting  # the step is closed by the exit of `with`, not by optimizer.step()
            or self.scaler is not None
            or self.optimizer is None
            or self.rec.pending.losses
        ):
            return
        self.warned_no_loss = True
        warnings.warn(
            f"nantrace: step {self.rec.step} ended at optimizer.step() without a loss: with an optimizer and no "
            "GradScaler nantrace cannot see the loss, so steps.loss is NaN (not recorded). Call "
            "tr.step(loss=loss) before optimizer.step() to record it.",
            stacklevel=user_stacklevel(),
        )

    def end_step(self) -> None:
        """Close the open step: one host copy, a ``steps`` row; then the observers."""
        self._warn_no_loss()
        pending = self.rec.pending
        if pending.lr is None and self.optimizer is not None and self.optimizer.param_groups:
            pending.lr = _scaler.current_lr(self.optimizer)  # a step the scaler skipped: lr still applies
        n_chunks, closing = len(self.store.chunks), self.rec.step
        if self.rec.device_stats:
            self.options["device_stats"] = True  # read by diagnose(): no transient inf could be looked for
        self.rec.end_step(_chunk_mask)
        bad = len(self.store.step_rows) > 0 and self.store.step_rows.cols["n_nonfinite"][-1] > 0
        self.samples.end_step(self.store.samples_host)
        if self.capture is not None and len(self.store.step_rows) > 0:  # a named capture's fallback call
            self.capture.end_step(bool(bad))
        self.reduced_done = False
        for observer in self.observers:
            observer(self, n_chunks, closing, self.exiting)
        self.store.maybe_spill()


def _hook_parameters(r: Recording) -> None:
    """Note every parameter of the traced modules once (``r.params``) and, when backward is recorded, hook it:
    its gradient after accumulation, and whether its ``.grad`` already held inf/NaN (the value after
    ``optimizer.step()`` is recorded by the optimizer hook)."""
    store, seen = r.store, set()
    for name, m in r.selected:
        for pname, p in m.named_parameters(recurse=False):
            if id(p) in seen:
                continue
            seen.add(id(p))
            mcode, tcode = store.modules.code(name), store.types.code(type(m).__name__)
            r.params.append((p, mcode, tcode, pname))
            index = len(r.params) - 1
            if is_sharded(p):
                r.sharded_params.add(index)
            if p.requires_grad and "backward" in r.rec.phases:
                hook = _scaler.param_hook(r, mcode, tcode, pname, index)
                hooks = [
                    p.register_post_accumulate_grad_hook(hook),
                    p.register_hook(_scaler.stale_hook(r, p, index)),
                ]
                r.handles += hooks
                r.model_handles += hooks


class _Suspended:
    """A recording's hooks of the traced modules below the root and of the parameters, taken out of their hook
    tables, with each table's order then, so that steps nothing is recorded on run without them
    (``nantrace.watch``'s watched steps: a module with no hook left takes PyTorch's fast call path, and autograd
    calls no hook of nantrace's on a parameter). The root's hooks, which see the step boundaries, and the
    optimizer and GradScaler hooks stay. The handles stay valid; :meth:`put_back` puts every hook back where it
    was (hooks the user registered meanwhile come after them, as if nantrace's had stayed)."""

    def __init__(self) -> None:
        self.tables: list[tuple[dict[int, Any], list[int]]] = []  # (table, its keys in order when taken)
        self.taken: list[tuple[dict[int, Any], int, Any]] = []

    @staticmethod
    def take(handles: list[RemovableHandle]) -> _Suspended:
        """Take each handle's entry out of its hook table. A table's companions (a module's ``with_kwargs`` and
        ``always_call`` flags) keep theirs: PyTorch reads them only for the hooks it runs, so a hook taken out
        while its table is being run (from a snapshot) is still called the way it was registered."""
        out = _Suspended()
        seen: set[int] = set()
        for h in handles:
            table = h.hooks_dict_ref()
            if table is None or h.id not in table:
                continue
            if id(table) not in seen:
                seen.add(id(table))
                out.tables.append((table, list(table)))
            out.taken.append((table, h.id, table.pop(h.id)))
        return out

    def put_back(self) -> None:
        """Every entry back, then each table in its order when taken; entries added since go last, in the
        order they were added."""
        for table, hid, fn in self.taken:
            table[hid] = fn
        for table, order in self.tables:
            place = {k: i for i, k in enumerate(order)}
            items = list(table.items())
            ordered = sorted((kv for kv in items if kv[0] in place), key=lambda kv: place[kv[0]])
            ordered += [kv for kv in items if kv[0] not in place]
            if [k for k, _ in ordered] != [k for k, _ in items]:
                table.clear()  # the same table object: autograd and the module keep reading it
                table.update(ordered)


def keep_last(tails: list[tuple[OrderedDict[int, Any], frozenset[int]]]) -> None:
    """Keep a recording's forward (pre-)hooks the last ones of every traced module, in their own order
    (``tails``: each hook table with the recording's ids in it), so that a hook the user registered after the
    trace started (which may change a module's inputs or output) runs before them and what it did is recorded
    as that module's. Running last changes nothing of the user's: the recording's hooks return None."""
    for d, ours in tails:
        if len(d) == len(ours) or ours.issuperset(itertools.islice(reversed(d), len(ours))):
            continue
        try:
            for hid in [k for k in d if k in ours]:
                d.move_to_end(hid)
        except (KeyError, RuntimeError):  # a hook table changed under it: leave the order as it is
            continue
