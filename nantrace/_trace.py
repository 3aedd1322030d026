"""The :class:`Trace`: validates its arguments, attaches hooks on enter, removes them on exit, and answers
questions about what it recorded."""

from __future__ import annotations

import contextlib
import dataclasses
import fnmatch
import os
import warnings
import weakref
from collections.abc import Callable, Iterable
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any

import numpy as np
import pandas as pd
import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from ._hooks import Recorder, eager
from ._locate import FEATURES, Overflow, locate, mask_named, mask_rows, overflows
from ._store import PHASES, Store, canonical_steps

if TYPE_CHECKING:
    from torch.utils.tensorboard import SummaryWriter

    from ._diagnose import Diagnosis

__all__ = ["NantraceError", "Trace", "trace"]

ModuleFilter = (
    str | type | Callable[[str, nn.Module], bool] | Iterable[str | type | Callable[[str, nn.Module], bool]]
)

# Attribute names of wrappers whose child is the real module; dropped from qualified names.
_WRAPPER_ATTRS = frozenset({"_fsdp_wrapped_module", "_checkpoint_wrapped_module", "_orig_mod"})

# Every module currently hooked by some active trace (weak: nantrace never keeps a model alive).
_ACTIVE: weakref.WeakKeyDictionary[nn.Module, Trace] = weakref.WeakKeyDictionary()


class NantraceError(ValueError):
    """nantrace's one error class for misuse that is not a plain wrong type (a ``ValueError``)."""


def _is_ddp(m: nn.Module) -> bool:
    return isinstance(m, (nn.parallel.DistributedDataParallel, nn.DataParallel))


def module_names(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """``(name, module)`` for every distinct module under ``model``, wrapper prefixes dropped.

    ``module.`` (DistributedDataParallel/DataParallel), ``_fsdp_wrapped_module.``,
    ``_checkpoint_wrapped_module.`` and ``_orig_mod.`` (``torch.compile``) are removed, so a layer has the same
    name wrapped or not. A wrapper whose child has the same name is left out: the child is the real module.
    A module reachable under several names (shared) keeps its first name.
    """
    out: list[tuple[str, nn.Module]] = []
    seen: set[int] = set()

    def walk(name: str, m: nn.Module) -> None:
        if id(m) in seen:
            return
        seen.add(id(m))
        children = list(m._modules.items())
        wrapped = [
            c
            for k, c in children
            if c is not None and (k in _WRAPPER_ATTRS or (k == "module" and _is_ddp(m)))
        ]
        if not wrapped:
            out.append((name, m))
        for k, c in children:
            if c is None:
                continue
            transparent = k in _WRAPPER_ATTRS or (k == "module" and _is_ddp(m))
            walk(name if transparent else (f"{name}.{k}" if name else k), c)

    walk("", model)
    return out


def _compile_filter(modules: ModuleFilter | None) -> Callable[[str, nn.Module], bool]:
    if modules is None:
        return lambda name, m: True
    single = isinstance(modules, (str, type, nn.Module)) or callable(modules)
    if not single and not isinstance(modules, (list, tuple, set, frozenset)):
        raise TypeError(
            f"modules= must be a name glob (str), an nn.Module subclass or instance, a callable "
            f"(name, module) -> bool, or a list of these; got {type(modules).__name__}: {modules!r:.80}"
        )
    items: list[Any] = [modules] if single else list(modules)  # type: ignore[arg-type]
    if not items:
        raise ValueError(
            "modules= is an empty collection; pass None to trace every module, or names/globs/types"
        )
    for it in items:
        ok = isinstance(it, (str, nn.Module)) or (isinstance(it, type) and issubclass(it, nn.Module))
        if not ok and (isinstance(it, type) or not callable(it)):
            raise TypeError(
                "modules= items must be name globs (str), nn.Module subclasses or instances, or callables "
                f"(name, module) -> bool; got {it!r:.80} of type {type(it).__name__}"
            )

    def keep(name: str, m: nn.Module) -> bool:
        for it in items:
            if isinstance(it, str):
                if fnmatch.fnmatchcase(name, it):
                    return True
            elif isinstance(it, nn.Module):
                if m is it:
                    return True
            elif isinstance(it, type):
                if isinstance(m, it):
                    return True
            elif it(name, m):
                return True
        return False

    return keep


def check_trace_options(
    *,
    modules: ModuleFilter | None = None,
    phases: Iterable[str] | None = None,
    sync_free: bool | None = None,
    drill: bool = True,
    every: int = 1,
    flush_every: int = 100,
    live_every: int | None = None,
) -> frozenset[str]:
    """Check the options of :func:`nantrace.trace` that do not need the model; the one place they are checked
    (``Trace.__init__`` and the framework callbacks' constructors call it). Returns the set of phases to record.

    ``modules`` is checked for its type only here (whether it matches a module needs the model).

    Raises:
        TypeError: ``phases``, ``modules``, ``drill`` or ``sync_free`` has the wrong type.
        ValueError: an unknown or empty ``phases``, an empty ``modules``, or ``every``/``flush_every``/
            ``live_every`` not an int ≥ 1.
    """
    _compile_filter(modules)
    if phases is None:
        phase_set = frozenset(PHASES)
    else:
        if isinstance(phases, str):  # "forward" or a comma-separated list, as the CLI takes it
            phases = [p.strip() for p in phases.split(",")] if "," in phases else [phases]
        if not isinstance(phases, (list, tuple, set, frozenset)):
            raise TypeError(
                f"phases= must be a phase name or a list of them, from {list(PHASES)}; got {phases!r}"
            )
        phase_set = frozenset(phases)
        unknown = sorted(repr(p) for p in phase_set - set(PHASES))
        if unknown:
            raise ValueError(f"phases= has unknown phase(s) {', '.join(unknown)}; choose from {list(PHASES)}")
        if not phase_set:
            raise ValueError(
                "phases= is empty, so nothing would be recorded; pass None to record every phase, "
                f"or some of {list(PHASES)}"
            )
    if isinstance(every, bool) or not isinstance(every, int) or every < 1:
        raise ValueError(
            f"every must be an int ≥ 1 (record full statistics every N-th step); got {every!r}. "
            "Use every=1 to record every step."
        )
    if isinstance(flush_every, bool) or not isinstance(flush_every, int) or flush_every < 1:
        raise ValueError(
            f"flush_every must be an int ≥ 1 (steps kept in memory between writes); got {flush_every!r}"
        )
    if live_every is not None and (
        isinstance(live_every, bool) or not isinstance(live_every, int) or live_every < 1
    ):
        raise ValueError(
            f"live_every must be None (off) or an int ≥ 1 (check every N-th step across ranks); "
            f"got {live_every!r}"
        )
    if not isinstance(drill, bool):
        raise TypeError(f"drill must be True or False; got {drill!r}")
    if sync_free is not None and not isinstance(sync_free, bool):
        raise TypeError(f"sync_free must be True, False or None; got {sync_free!r}")
    return phase_set


def _chunk_mask(chunk: dict[str, np.ndarray], store: Store) -> np.ndarray:
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
        (phase == PHASES.index("data")) | (phase == PHASES.index("forward")),
        named,
        (phase == PHASES.index("data")) & feats[chunk["tensor"]],
    )


class Trace:
    """A recording of one training run; a context manager that hooks ``model`` while inside ``with``.

    Create it with :func:`nantrace.trace`. Read it with :attr:`records`, :attr:`steps`,
    :meth:`first_overflow` and :meth:`overflows`; it stays readable after ``with`` exits, also after the loop
    raised.
    """

    # Set by ``nantrace run`` when one GradScaler serves several traced models: which losses are this model's.
    _loss_filter: Callable[[Any], bool] | None = None

    def __init__(
        self,
        model: nn.Module,
        *,
        scaler: torch.amp.GradScaler | None = None,
        optimizer: torch.optim.Optimizer | None = None,
        modules: ModuleFilter | None = None,
        phases: Iterable[str] | None = None,
        sync_free: bool | None = None,
        drill: bool = True,
        every: int = 1,
        path: str | os.PathLike[str] | None = None,
        flush_every: int = 100,
        live_every: int | None = None,
        capture: str | list[str] | tuple[str, ...] | None = None,
    ) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be a torch.nn.Module; got {type(model).__name__}: {model!r:.80}")
        if scaler is not None and not isinstance(scaler, torch.amp.GradScaler):
            raise TypeError(
                f"scaler must be a torch.amp.GradScaler (or None); got {type(scaler).__name__}. "
                "Pass the GradScaler your loop calls scale()/step()/update() on."
            )
        if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(
                f"optimizer must be a torch.optim.Optimizer (or None); got {type(optimizer).__name__}. "
                "Pass the optimizer your loop calls step() on."
            )
        phase_set = check_trace_options(
            phases=phases,
            every=every,
            sync_free=sync_free,
            drill=drill,
            flush_every=flush_every,
            live_every=live_every,
        )
        from ._dist import process_group

        self._rank, self._world_size = process_group()
        stream_path: Path | None = None
        if path is not None and self._world_size > 1:
            from ._dist import part_target

            stream_path = part_target(path, self._rank, self._world_size)
        elif path is not None:
            from ._io import _check_target

            stream_path = _check_target(path)
        keep = _compile_filter(modules)
        named = module_names(model)
        selected = [(n, m) for n, m in named if keep(n, m)]
        if modules is not None and not selected:
            raise ValueError(
                f"modules={modules!r} matched no module of {type(model).__name__}; "
                f"names look like {[n for n, _ in named[:6]]}"
            )
        from ._repro import make_capture

        self._capture, capture_option = make_capture(
            capture, [named[0][0], *(n for n, _ in selected)], lambda: self._handles
        )
        self._model_ref = weakref.ref(model)
        self._root_name, self._root = named[0]
        # the unwrapped model's class, as module names drop wrappers; the wrapper is named after it
        self._model_class = type(self._root).__qualname__
        if self._root is not model:
            self._model_class += f" (in {type(model).__qualname__})"
        self._selected = selected
        self._scaler = scaler
        self._optimizer = optimizer
        self._store = Store(self._rank)
        self._live = None
        if live_every is not None and self._world_size > 1:
            from ._dist import Live

            self._live = Live(live_every, self._rank, self._world_size)
        self._exiting = False
        self._reduced_done = False
        self._rec = Recorder(
            self._store, sync_free=bool(sync_free), record_phases=phase_set, drill=drill, every=every
        )
        self._rec.capture = self._capture
        self._stream_path = stream_path
        self._stream_records: pd.DataFrame | None = None
        if stream_path is not None:
            self._store.stream_to(stream_path, flush_every)
        self._handles: list[RemovableHandle] = []
        self._patched: list[tuple[object, str, bool, Any]] = []
        self._entered = False
        self._closed = False
        self._manual_steps = False
        self._read_only = False
        self._run_id: str | None = None
        if self._world_size > 1:  # a collective: every rank creates its trace (see nantrace._dist)
            from ._dist import shared_run_id

            self._run_id = shared_run_id()
        self.header: dict[str, Any] = {}
        self.options: dict[str, Any] = {
            "modules": None if modules is None else repr(modules),
            "phases": sorted(phase_set, key=PHASES.index),
            "sync_free": sync_free,
            "drill": drill,
            "every": every,
            "live_every": live_every,
            "capture": capture_option,
            "path": None if stream_path is None else str(stream_path),
            "scaler": type(scaler).__name__ if scaler is not None else None,
            "optimizer": type(optimizer).__name__ if optimizer is not None else None,
        }

    # ------------------------------------------------------------------ context manager
    def __enter__(self) -> Trace:
        if self._read_only:
            raise NantraceError(
                "this Trace was loaded from a file and is read-only; record with nantrace.trace()"
            )
        if self._entered:
            raise NantraceError(
                "this Trace has already been used; create a new one with nantrace.trace(model)"
            )
        for _, m in [*self._selected, (self._root_name, self._root)]:
            other = _ACTIVE.get(m)
            if other is not None:
                raise NantraceError(
                    f"{type(m).__name__} is already being traced by another active nantrace.trace(); "
                    "nested traces of the same model are not supported: exit the first one"
                )
        self._entered = True
        try:
            self._attach()
        except BaseException:
            self._detach()
            raise
        self._rec.active = True
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._rec.active = False
        self._exiting = True  # no collective (live check) from here: another rank may have raised
        try:
            if self._rec.step_open():
                self._end_step()
        finally:
            self._detach()
            self._closed = True
            if exc_type is None and not self._store.chunks and not len(self._store.step_rows):
                warnings.warn(
                    f"nantrace.trace recorded nothing: no forward call of the traced {self._model_class} and no "
                    "scaler/optimizer step happened inside `with`. Is the traced model the one the loop calls?",
                    stacklevel=2,
                )
            if self._stream_path is not None:
                from ._io import MAGIC, footer

                self._store.close_stream({MAGIC: footer(self, self._store.records())})

    def _attach(self) -> None:
        rec = self._rec
        store = self._store
        selected_ids = {id(m) for _, m in self._selected}
        mods = list(self._selected)
        if id(self._root) not in selected_ids:
            mods.insert(0, (self._root_name, self._root))
        for name, m in mods:
            mcode = store.modules.code(name)
            tcode = store.types.code(type(m).__name__)
            if self._capture is not None:
                self._capture.watch(mcode, name, type(m).__name__)
            pre, post = rec.module_hooks(
                mcode,
                tcode,
                is_root=m is self._root,
                step_each_forward=self._step_each_forward,
                on_step=self._end_step,
                training=self._training,
            )
            self._handles.append(m.register_forward_pre_hook(pre, with_kwargs=True))
            self._handles.append(m.register_forward_hook(post, with_kwargs=True, always_call=True))
            _ACTIVE[m] = self
        # parameters: gradient after accumulation, and value after optimizer.step()
        self._params: list[tuple[nn.Parameter, int, int, str]] = []
        self._sharded_params: set[int] = set()  # DTensor parameters (FSDP2): their hook sees the reduced grad
        seen: set[int] = set()
        for name, m in self._selected:
            for pname, p in m.named_parameters(recurse=False):
                if id(p) in seen:
                    continue
                seen.add(id(p))
                mcode, tcode = store.modules.code(name), store.types.code(type(m).__name__)
                self._params.append((p, mcode, tcode, pname))
                if _sharded(p):
                    self._sharded_params.add(len(self._params) - 1)
                if p.requires_grad and "backward" in rec.phases:
                    self._handles.append(
                        p.register_post_accumulate_grad_hook(
                            self._param_hook(mcode, tcode, pname, len(self._params) - 1)
                        )
                    )
        if self._optimizer is not None:
            self._handles.append(self._optimizer.register_step_post_hook(self._optimizer_hook))
        if self._world_size > 1 and "backward" in rec.phases:  # gradients after the cross-rank reduction
            if self._optimizer is not None:
                self._handles.append(self._optimizer.register_step_pre_hook(self._reduced_hook))
            if self._scaler is not None:
                self._patch(self._scaler, "unscale_", self._wrap_unscale(self._scaler.unscale_))
        if self._scaler is not None:
            self._patch(self._scaler, "scale", self._wrap_scale(self._scaler.scale))
            self._patch(self._scaler, "update", self._wrap_update(self._scaler.update))

    def _detach(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
        for h in self._rec.tensor_handles:
            h.remove()
        self._rec.tensor_handles.clear()
        for obj, attr, had, old in reversed(self._patched):
            if had:
                setattr(obj, attr, old)
            else:
                with contextlib.suppress(AttributeError):
                    delattr(obj, attr)
        self._patched.clear()
        for m in [self._root] + [m for _, m in self._selected]:
            if _ACTIVE.get(m) is self:
                del _ACTIVE[m]

    def _patch(self, obj: object, attr: str, new: Any) -> None:
        had = attr in vars(obj)
        self._patched.append((obj, attr, had, vars(obj).get(attr)))
        setattr(obj, attr, new)

    def _bind(
        self, *, scaler: torch.amp.GradScaler | None = None, optimizer: torch.optim.Optimizer | None = None
    ) -> None:
        """Attach a scaler and/or optimizer found after enter (``nantrace run`` meets them as the script runs).

        Each is bound only if the trace has none yet; step boundaries follow it from then on, as if it had been
        passed to ``trace()``. Its patches/hooks are removed on exit like the others."""
        if not self._entered or self._closed:
            raise NantraceError("Trace._bind() needs an active trace (inside `with`)")
        reduced = self._world_size > 1 and "backward" in self._rec.phases  # as in _attach
        if scaler is not None and self._scaler is None:
            self._scaler = scaler
            self.options["scaler"] = type(scaler).__name__
            if reduced:
                self._patch(scaler, "unscale_", self._wrap_unscale(scaler.unscale_))
            self._patch(scaler, "scale", self._wrap_scale(scaler.scale))
            self._patch(scaler, "update", self._wrap_update(scaler.update))
        if optimizer is not None and self._optimizer is None:
            self._optimizer = optimizer
            self.options["optimizer"] = type(optimizer).__name__
            self._handles.append(optimizer.register_step_post_hook(self._optimizer_hook))
            if reduced:
                self._handles.append(optimizer.register_step_pre_hook(self._reduced_hook))

    # ------------------------------------------------------------------ hooks owned by the Trace
    def _param_hook(self, mcode: int, tcode: int, pname: str, index: int) -> Callable[[torch.Tensor], None]:
        rec = self._rec
        path = pname + ".grad"

        sharded = index in self._sharded_params

        def hook(p: torch.Tensor) -> None:
            g = p.grad
            if not rec.active or g is None or not g.is_floating_point() or g.is_sparse:
                return
            if sharded:  # FSDP2: the reduce-scattered gradient; this rank's shard
                g = g.to_local()  # type: ignore[attr-defined]
            rec.add("backward", mcode, tcode, 0, path, g, is_grad=True, parent=-1, reduced=sharded)
            g = g.detach()
            wide = g if g.dtype in (torch.float32, torch.float64) else g.float()
            rec.pending.grad_norms[index] = torch.linalg.vector_norm(wide)

        return eager(hook)

    def _record_reduced(self) -> None:
        """Once per step, after backward: each parameter's gradient after DDP's all-reduce (``reduced=True``
        rows; ``steps.grad_norm`` then is the norm of these, what the optimizer applies)."""
        rec = self._rec
        if not rec.active or self._reduced_done:
            return
        self._reduced_done = True
        rec.cache.clear()  # the same .grad tensor now holds other values: no cached statistics
        for i, (p, mcode, tcode, pname) in enumerate(self._params):
            g = p.grad
            if i in self._sharded_params or g is None or not g.is_floating_point() or g.is_sparse:
                continue
            rec.add("backward", mcode, tcode, 0, pname + ".grad", g, is_grad=True, parent=-1, reduced=True)
            g = g.detach()
            wide = g if g.dtype in (torch.float32, torch.float64) else g.float()
            rec.pending.grad_norms[i] = torch.linalg.vector_norm(wide)

    def _reduced_hook(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        self._record_reduced()

    def _wrap_unscale(self, orig: Callable[..., Any]) -> Callable[..., Any]:
        def unscale_(optimizer: torch.optim.Optimizer) -> None:
            self._record_reduced()  # before unscaling: the rows carry the loss scale like the local ones
            orig(optimizer)

        return unscale_

    def _optimizer_hook(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        rec = self._rec
        if not rec.active:
            return
        if "optimizer" in rec.phases:
            for p, mcode, tcode, pname in self._params:
                rec.add("optimizer", mcode, tcode, 0, pname, p, is_grad=False, parent=-1)
        if optimizer.param_groups:
            lr = optimizer.param_groups[0].get("lr")
            rec.pending.lr = lr.detach().clone() if isinstance(lr, torch.Tensor) else lr
        if self._scaler is None and not self._manual_steps:
            self._end_step()

    def _wrap_scale(self, orig: Callable[..., Any]) -> Callable[..., Any]:
        def scale(outputs: Any) -> Any:
            result = orig(outputs)
            if self._rec.active and (self._loss_filter is None or self._loss_filter(outputs)):
                self._record_loss(outputs)
            return result

        return scale

    def _wrap_update(self, orig: Callable[..., Any]) -> Callable[..., Any]:
        scaler = self._scaler

        def update(new_scale: Any = None) -> None:
            rec = self._rec
            if rec.active and scaler is not None and scaler.is_enabled():
                p = rec.pending
                p.scale = _scaler_tensor(scaler, "_scale")
                found = [
                    v
                    for st in getattr(scaler, "_per_optimizer_states", {}).values()
                    for v in st.get("found_inf_per_device", {}).values()
                ]
                p.found_inf = (
                    torch.stack([f.to(found[0].device).float().sum() for f in found]).sum() if found else None
                )
            orig(new_scale)
            if rec.active:
                if scaler is not None and scaler.is_enabled():
                    rec.pending.next_scale = _scaler_tensor(scaler, "_scale")
                    rec.pending.growth_tracker = _scaler_tensor(scaler, "_growth_tracker")
                self._end_step()

        return update

    def _record_loss(self, loss: Any) -> None:
        from ._hooks import flatten

        rec = self._rec
        for path, t in flatten(loss, "loss"):
            if not t.is_floating_point() or t.numel() == 0:
                continue
            if "loss" in rec.phases:
                rec.add("loss", 0, self._store.types.code("loss"), 0, path, t, is_grad=False, parent=-1)
            rec.pending.losses.append(t.detach().float().mean())

    def _step_each_forward(self) -> bool:
        return self._scaler is None and self._optimizer is None and not self._manual_steps

    def _training(self) -> bool:
        """A training trace (it has a GradScaler or an optimizer): its no-grad root forwards are evaluation."""
        return self._scaler is not None or self._optimizer is not None

    def _end_step(self) -> None:
        pending = self._rec.pending
        if pending.lr is None and self._optimizer is not None and self._optimizer.param_groups:
            lr = self._optimizer.param_groups[0].get("lr")  # a step the scaler skipped: lr still applies
            pending.lr = lr.detach().clone() if isinstance(lr, torch.Tensor) else lr
        n_chunks, closing = len(self._store.chunks), self._rec.step
        self._rec.end_step(_chunk_mask)
        if self._capture is not None and len(self._store.step_rows) > 0:  # a named capture's fallback call
            self._capture.end_step(self._store.step_rows.cols["n_nonfinite"][-1] > 0)
        self._reduced_done = False
        if self._live is not None:
            self._live.after_step(self._store, n_chunks, closing, self._exiting)
        self._store.maybe_spill()

    @classmethod
    def _from_saved(
        cls, records: pd.DataFrame, steps: pd.DataFrame, ops: pd.DataFrame, header: dict[str, Any]
    ) -> Trace:
        tr = cls.__new__(cls)
        steps = canonical_steps(steps)
        tr._store = _FrozenStore(records, steps, ops)  # type: ignore[assignment]
        tr._model_class = str(header.get("model_class", "?"))
        tr.options = dict(header.get("options", {}))
        tr.header = dict(header)
        tr._rank = header.get("rank", 0)
        tr._world_size = int(header.get("world_size", 1) or 1)
        tr._run_id = header.get("run_id")
        tr._live = None
        tr._capture = None
        tr._read_only = True
        tr._stream_path = None
        tr._stream_records = None
        tr._entered = True
        tr._closed = True
        tr._rec = Recorder(Store(), sync_free=False, record_phases=frozenset())
        return tr

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
        from ._io import save

        return save(self, path)

    # ------------------------------------------------------------------ public API
    def step(self, loss: torch.Tensor | None = None) -> None:
        """Mark a step boundary, and/or record the loss of this step.

        With a ``scaler`` (boundary: ``scaler.update()``) or an ``optimizer`` (boundary: ``optimizer.step()``),
        this only records ``loss``. Without either, it closes the current step; once it has been called, root
        forward calls no longer start steps by themselves (gradient accumulation works).

        Args:
            loss: the step's loss tensor (any shape; its mean is the step's ``loss``), or None.

        Raises:
            NantraceError: the trace is not inside its ``with`` block.
            TypeError: ``loss`` is not a tensor or None.
        """
        if loss is not None and not isinstance(loss, torch.Tensor):
            raise TypeError(f"loss must be a torch.Tensor or None; got {type(loss).__name__}")
        if not self._rec.active:
            raise NantraceError("Trace.step() was called outside its `with nantrace.trace(...)` block")
        if loss is not None:
            self._record_loss(loss)
        if self._scaler is None and self._optimizer is None:
            self._end_step()
            if not self._manual_steps:
                # the root forwards so far were provisionally steps of their own: they form step 0
                self._manual_steps = True
                count = self._rec.step
                self._store.merge_leading_steps(count)
                self._rec.step = min(count, 1)

    @property
    def records(self) -> pd.DataFrame:
        """One row per recorded tensor (see README "records columns"); steps closed so far.

        With ``trace(path=...)``, inside ``with`` this holds the steps not yet written to the file (at most
        ``flush_every``); after exit it is the whole run, read back from the file.

        Each access returns a new copy (cheap under pandas Copy-on-Write, a deep copy with pandas 2 without it):
        changing the returned frame, also in place, never changes the trace or what its locator finds. The same
        holds for :attr:`steps` and :attr:`ops`."""
        return _served(self._records_frame())

    def _records_frame(self) -> pd.DataFrame:
        """``records`` as held (not a copy): for nantrace's own reads, which never change it."""
        if self._stream_path is not None and self._closed and not self._read_only:
            if self._stream_records is None:
                from ._io import read_records

                self._stream_records = read_records(self._stream_path)
            return self._stream_records
        return self._store.records()

    @property
    def steps(self) -> pd.DataFrame:
        """One row per closed step: ``step, loss, scale, next_scale, skipped, growth_tracker, lr, grad_norm,
        n_nonfinite`` (plus ``micro_steps, n_records``); a new copy on each access, as :attr:`records`."""
        return _served(self._store.steps())

    def _builtin(self) -> Callable[[str], bool | None] | None:
        """For the locator's hunt hint: whether the module of a reported name runs torch's own ``forward``,
        judged on the live model (``None`` for a loaded trace or a model that is gone: the class-name rule)."""
        model = None if self._read_only else self._model_ref()
        if model is None:
            return None
        from ._locate import torch_builtin

        by_name = dict(module_names(model))

        def builtin(name: str) -> bool | None:
            m = by_name.get(name)
            return None if m is None else torch_builtin(m)

        return builtin

    def _hides_submodules_of(self, module: str) -> bool:
        """True when a ``modules=`` filter left a submodule of ``module`` untraced (recording traces only)."""
        if self._read_only or self.options.get("modules") is None:
            return False
        model = self._model_ref()
        if model is None:
            return False
        traced = {n for n, _ in self._selected}
        prefix = f"{module}." if module else ""
        return any(n.startswith(prefix) and n != module and n not in traced for n, _ in module_names(model))

    @property
    def ops(self) -> pd.DataFrame:
        """Forward drill-down: ``step, micro_step, module, call, op, kind`` for each module call where a
        non-finite kind first appeared in a micro-step, naming the first torch op inside it that made it
        (found by replaying that call on CPU; empty on the ``sync_free`` path); a new copy on each access."""
        return _served(self._store.ops_frame())

    def first_overflow(self, kind: str | None = None) -> Overflow | None:
        """The producer of the first non-finite value, or ``None`` if every recorded value was finite.

        Args:
            kind: ``None`` (NaN or ±inf), ``"inf"`` (±inf only) or ``"nan"`` (NaN only).

        Raises:
            ValueError: ``kind`` is none of those.
        """
        st, ops = self._store.steps(), self._store.ops_frame()
        ov = locate(self._records_frame(), kind, st, ops, self._world_size, self._builtin())
        if ov is not None and ov.phase in ("forward", "backward") and self._hides_submodules_of(ov.module):
            note = (
                f" (Only the modules matching modules={self.options['modules']} were traced: an untraced "
                "submodule inside the reported one may be the real producer.)"
            )
            ov = dataclasses.replace(ov, message=ov.message + note)
        if ov is not None and self._capture is not None:  # for Overflow.save_repro()
            ov = dataclasses.replace(ov, _captured=self._capture, message=self._captured_hint(ov))
        return ov

    def _captured_hint(self, ov: Overflow) -> str:
        """``ov.message``, with the hunt hint's "trace again with capture=..." turned into "this trace captured
        that call" when the capture holds exactly this overflow's call."""
        from ._repro import captured_call

        again = f'; or trace again with capture="{ov.module}" and hunt the saved call: '
        if again not in ov.message:
            return ov.message
        try:
            captured_call(self._capture, ov, for_overflow=True)
        except NantraceError:
            return ov.message
        return ov.message.replace(again, "; this trace captured that call, so hunt it in isolation: ")

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
        from ._repro import captured_call, save_repro

        capture = self._capture
        first = self.first_overflow() if capture is not None and capture.call is None else None
        return save_repro(captured_call(capture, first), path)

    def overflows(self, kind: str | None = None, *, per_rank: bool = False) -> pd.DataFrame:
        """One row per step that saw a non-finite value, with that step's first producer (``Overflow`` fields
        plus ``message``). Scaler backoffs show as a few isolated steps; a persistent fault as a run of them.

        Under torch.distributed the producer is the cross-rank one (ordering rule in ``nantrace._dist``);
        ``per_rank=True`` gives one row per (step, rank) instead: each rank's own first non-finite value, with
        ``propagated=True`` where that rank only received it through the gradient reduction."""
        return overflows(
            self._records_frame(),
            kind,
            self._store.steps(),
            self._store.ops_frame(),
            self._world_size,
            per_rank,
            self._builtin(),
        )

    @property
    def rank(self) -> int | None:
        """The ``torch.distributed`` rank this trace recorded (0 without a process group); ``None`` for a trace
        merged from several ranks' parts (see :attr:`ranks`)."""
        return self._rank

    @property
    def world_size(self) -> int:
        """Number of ranks of the run (``torch.distributed.get_world_size()``; 1 without a process group)."""
        return self._world_size

    @property
    def ranks(self) -> list[int]:
        """The ranks whose rows this trace holds (``[rank]`` for one rank's trace)."""
        if self._rank is not None:
            return [self._rank]
        return [int(r) for r in self.header.get("ranks", sorted(pd.unique(self.records["rank"])))]

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
        rec, st, ops = self.records, self.steps, self.ops

        def pick(df: pd.DataFrame) -> pd.DataFrame:
            if "rank" not in df.columns or not len(df):
                return df
            return df[df["rank"].to_numpy() == rank].reset_index(drop=True)

        head = dict(self.header, rank=rank, world_size=self._world_size)
        return Trace._from_saved(pick(rec), pick(st), pick(ops), head)

    def diagnose(self) -> Diagnosis:
        """Why the run went non-finite, and what to do: a :class:`nantrace.Diagnosis` whose ``cause`` is one of
        ``"data", "forward_overflow", "invalid_op", "loss", "backward_overflow", "scaler_backoff",
        "loss_scale_collapse", "divergence", "optimizer", "gradient_underflow", "healthy"`` (or, for one rank
        of a torch.distributed run that only received the value through the gradient reduction,
        ``"received"``), with ``evidence``
        (strings holding the numbers) and ``advice`` (fixes naming the module, dtype and number)."""
        from ._diagnose import diagnose

        if len(self.ranks) > 1:
            from ._dist import diagnose_merged

            return diagnose_merged(self)
        return diagnose(self)

    def fp16_readiness(self, *, loss_scale: float | None = None) -> pd.DataFrame:
        """From an fp32 or bf16 run: which modules would overflow in fp16 (absmax above 65504 =
        torch.finfo(torch.float16).max; ``headroom_bits`` = log2(65504 / absmax)) or lose values to
        underflow (non-zero |x| below 2**-14, the smallest normal, or 2**-24, the smallest subnormal), worst
        first. ``loss_scale`` judges gradients as if scaled by it. See ``nantrace._diagnose.fp16_readiness``."""
        from ._diagnose import fp16_readiness

        return fp16_readiness(self, loss_scale=loss_scale)

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
        from ._tensorboard import write_tensorboard

        return write_tensorboard(self, logdir_or_writer, tag_prefix=tag_prefix)

    def __repr__(self) -> str:
        from ._report import trace_text

        if not hasattr(self, "_store"):
            return "<nantrace.Trace (not initialised)>"
        return trace_text(self)

    def _repr_html_(self) -> str:
        from ._report import trace_html

        return trace_html(self)


def _served(df: pd.DataFrame) -> pd.DataFrame:
    """A copy of ``df`` that the caller may change without changing ``df``: shallow under pandas Copy-on-Write
    (always on from pandas 3; ``pd.options.mode.copy_on_write = True`` in pandas 2), else deep."""
    if int(pd.__version__.split(".", 1)[0]) >= 3 or pd.get_option("mode.copy_on_write") is True:
        return df.copy(deep=False)
    return df.copy()


class _FrozenStore:
    """The tables of a loaded trace, served as they were read."""

    def __init__(self, records: pd.DataFrame, steps: pd.DataFrame, ops: pd.DataFrame) -> None:
        self._r, self._s, self._o = records, steps, ops

    def records(self) -> pd.DataFrame:
        return self._r

    def steps(self) -> pd.DataFrame:
        return self._s

    def ops_frame(self) -> pd.DataFrame:
        return self._o


def _sharded(p: torch.Tensor) -> bool:
    """True for a DTensor parameter (FSDP2 ``fully_shard``, tensor parallel): it holds this rank's shard, and
    its gradient arrives already reduced (reduce-scattered)."""
    return type(p) is not nn.Parameter and hasattr(p, "to_local") and hasattr(p, "placements")


def _scaler_tensor(scaler: torch.amp.GradScaler, attr: str) -> torch.Tensor | float | None:
    v = getattr(scaler, attr, None)
    if isinstance(v, torch.Tensor):
        return v.detach().clone().float()
    if attr == "_scale":
        return float(scaler.get_scale())
    return None


def trace(
    model: nn.Module,
    *,
    scaler: torch.amp.GradScaler | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    modules: ModuleFilter | None = None,
    phases: Iterable[str] | None = None,
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
            loss scale, skipped steps and growth tracker are recorded.
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
            (``Trace.ops``). The replay runs the module's Python ``forward`` again, so Python side effects
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
            output holds NaN/+inf/-inf that its inputs did not; an output holding only 0 and -inf, or named
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
    a folder at that path. See ``nantrace._dist`` for the cross-rank ordering rule. With ``world_size > 1``
    creating the trace is a collective: rank 0 makes a run id (a uuid) and broadcasts it
    (``torch.distributed.broadcast_object_list``), so every rank must call ``trace`` (as with the model itself);
    each part's header keeps it, and ``nantrace.load`` of the folder merges the parts of the newest run only.

    Returns:
        the :class:`Trace` (a context manager).

    Raises:
        TypeError: ``model`` is not an ``nn.Module``, ``scaler`` not a ``GradScaler``, ``optimizer`` not an
            ``Optimizer``, a ``modules`` item of another type, or ``capture`` is not a str or list of str.
        ValueError: ``modules`` is empty or matches no module, ``phases`` is empty or names an unknown
            phase, ``every`` or ``flush_every`` is not an int ≥ 1, ``live_every`` is neither None nor an
            int ≥ 1, ``path`` is a directory or in a directory that does not exist or is not writable, or
            ``capture`` names a module that is not traced.
        NantraceError (on enter): the model is already being traced.
    """
    return Trace(
        model,
        scaler=scaler,
        optimizer=optimizer,
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
