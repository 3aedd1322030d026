"""The recording state of one trace and the tiny hook closures that feed it.

Every closure does the same three things: return at once when the trace is not recording, compute the
statistics of the tensors it was handed (:mod:`nantrace._stats`, on-device reductions), and append one row per
tensor to the store. No closure keeps a reference to an activation or gradient after it returns: statistics
are small new tensors, the forward cache holds weak references only, and tensor-hook handles are dropped at
the next step boundary.

Backward hooks are tensor hooks (``Tensor.register_hook`` on a module's output and input tensors, and
``register_post_accumulate_grad_hook`` on parameters), not ``register_full_backward_hook``, which wraps outputs
in a custom autograd function and breaks in-place ops such as ``ReLU(inplace=True)`` after a module. A hook
registered on a tensor before an in-place op fires with the gradient of the value it saw.
"""

from __future__ import annotations

import functools
import warnings
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.hooks import RemovableHandle

from ._naming import positional_names
from ._opfacts import named_operands, note_vanished, operand_facts
from ._schema import PHASE_CODE
from ._stats import describable, is_clean_host, op_input_kinds, stats_device, stats_host, tensor_kinds
from ._store import PendingStep, Store
from ._tree import clone_tree, flatten

__all__ = ["FirstNonfinite", "Recorder", "eager", "in_backward", "kinds_of_stats"]

_KIND_COLS = ((4, "nan"), (5, "posinf"), (6, "neginf"))
_CLEAN: frozenset[str] = frozenset()


def kinds_of_stats(stats: Any) -> frozenset[str] | None:
    """Non-finite kinds in a host statistics tuple; ``None`` for device statistics (not read in hooks)."""
    if isinstance(stats, torch.Tensor):
        return None
    if not (stats[4] or stats[5] or stats[6]):
        return _CLEAN
    return frozenset(k for i, k in _KIND_COLS if stats[i] > 0)


class _Stop(Exception):
    pass


class FirstNonfinite(TorchFunctionMode):
    """Replays a forward and stops at the first torch op that *produced* a kind not in ``known`` (the module
    call's input kinds): one of its outputs holds it and none of its inputs did, a non-finite scalar argument
    counting as an input (:func:`nantrace._stats.op_input_kinds`, the rule of :func:`nantrace.hunt`). So
    ``masked_fill(mask, -inf)`` does not produce its -inf, while ``softmax`` of a fully masked row produces
    NaN. ``found`` is ``(op name, kind)``; of several new kinds, inf is named before NaN (NaN follows from inf)."""

    def __init__(self, known: frozenset[str]) -> None:
        super().__init__()
        self.known = known
        self.found: tuple[str, str] | None = None
        # the producing op's operands (copies of in-place ones, taken before the op) and result, kept only until
        # the replay ends, when operand_facts() turns them into numbers
        self.operands: list[tuple[str, Any]] = []
        self.result: torch.Tensor | None = None
        self.vanished: dict[
            float, str
        ] = {}  # non-zero scalar constants that round to 0 in their tensor's dtype

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        tensors, before = op_input_kinds(
            args, kwargs
        )  # before the op runs: an in-place op overwrites its input
        name = getattr(func, "__name__", None) or str(func)
        if tensors:
            note_vanished(self.vanished, args, kwargs, tensors[0].dtype)
        inplace = (name.endswith("_") and not name.endswith("__")) or name.startswith("__i")
        snap = [t.clone() for t in tensors] if inplace else None
        out = func(*args, **kwargs)
        for _, t in flatten(out, "out"):
            if not describable(t):
                continue
            new = tensor_kinds(t) - before - self.known
            if new:
                self.found = (name, next(k for k in ("posinf", "neginf", "nan") if k in new))
                self.operands = named_operands(args, kwargs, snap)
                self.result = t
                raise _Stop
        return out


CAST_OP = "aten._to_copy"  # the name the drill-down gives a dtype cast it saw make a kind (autocast's casts)


class CastWatch(TorchDispatchMode):
    """The dispatch-level half of the drill-down: autocast casts a float32 weight to float16 below
    ``__torch_function__`` (``linear`` is one op there), as ``aten._to_copy``. A cast whose output holds a
    kind that its input and the call's inputs (``known``) did not is the producing op: ``found`` becomes
    ``(CAST_OP, kind)`` (inf before NaN) and the replay stops. Every other aten op is passed through."""

    def __init__(self, known: frozenset[str]) -> None:
        super().__init__()
        self.known = known
        self.found: tuple[str, str] | None = None
        self.operands: list[tuple[str, Any]] = []
        self.result: torch.Tensor | None = None

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if func is torch.ops.aten._to_copy.default and args and describable(args[0]) and describable(out):
            new = tensor_kinds(out) - tensor_kinds(args[0]) - self.known
            if new:
                self.found = (CAST_OP, next(k for k in ("posinf", "neginf", "nan") if k in new))
                self.operands, self.result = [("input", args[0])], out
                raise _Stop
        return out


def in_backward() -> bool:
    """True while autograd's engine runs a backward pass (a checkpoint's recomputed forward runs there)."""
    task = getattr(torch._C, "_current_graph_task_id", None)
    return task is not None and task() != -1


def eager(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Keep ``torch.compile`` from tracing into a hook: it runs eagerly, as a graph break."""
    disable = getattr(torch.compiler, "disable", None)
    return disable(fn) if disable is not None else fn


def _version(t: torch.Tensor) -> int:
    return -1 if t.is_inference() else t._version


class Recorder:
    """Mutable recording state of one :class:`~nantrace.Trace` (step counters, call stack, caches)."""

    def __init__(
        self,
        store: Store,
        *,
        sync_free: bool,
        record_phases: frozenset[str],
        drill: bool = True,
        every: int = 1,
    ) -> None:
        self.store = store
        self.every = every
        self.light = False  # on steps between full ones (every > 1): rows only for tensors holding inf/NaN
        self.drill = drill
        self.capture: Any = None  # a nantrace._repro.Capture with trace(capture=...)
        self.seen_kinds: set[str] = set()
        self.own_code: set[tuple[int, int]] = (
            set()
        )  # (module code, call) whose own code made a kind first seen
        self.sync_free = sync_free
        self.phases = record_phases
        self.active = False
        self.step = 0
        self.micro = -1
        self.seq = 0
        self.event = 0
        self.root_depth = 0
        self.eval_depth = 0  # > 0 inside a root forward left out as evaluation (see module_hooks)
        self.stack: list[tuple[int, int, frozenset[str] | None, tuple[int, ...]]] = []
        self.calls: dict[int, int] = {}
        self.cache: dict[int, tuple[weakref.ref[torch.Tensor], int, Any, int]] = {}
        self.pending = PendingStep()
        self.tensor_handles: list[RemovableHandle] = []
        self.has_rows = False
        self.last_kinds: frozenset[str] | None = frozenset()
        self.dropped_records = 0  # records dropped because a statistic ran out of memory
        self._dtype_codes: dict[torch.dtype, int] = {}
        self._shape_codes: dict[torch.Size, int] = {}
        self._on_grad = eager(self._record_grad)

    # ------------------------------------------------------------ statistics
    def stat(self, t: torch.Tensor) -> tuple[Any, int]:
        """Statistics of ``t`` and its event id, reusing the result for a tensor already seen unchanged."""
        key = id(t)
        ver = _version(t)
        hit = self.cache.get(key)
        if hit is not None and hit[0]() is t and hit[1] == ver and ver >= 0:
            return hit[2], hit[3]
        if t.device.type == "cpu" and not self.sync_free:
            stats: Any = stats_host(t)
        else:
            stats = stats_device(t)
        self.event += 1
        if ver >= 0:
            self.cache[key] = (weakref.ref(t), ver, stats, self.event)
        return stats, self.event

    def add(
        self,
        phase: str,
        mcode: int,
        tcode: int,
        call: int,
        path: str,
        t: torch.Tensor,
        *,
        is_grad: bool,
        parent: int,
        arg: str | None = None,
        micro: int | None = None,
        reduced: bool = False,
    ) -> None:
        """Append one row for tensor ``t`` (nothing for tensors that are not :func:`describable`).

        ``reduced`` marks a parameter gradient after the cross-rank reduction. A ``DTensor`` (FSDP2, tensor
        parallel) is described by this rank's local shard, so no statistic needs a collective."""
        if type(t) is not torch.Tensor and hasattr(t, "to_local") and hasattr(t, "placements"):
            t = t.to_local()
        if not describable(t):
            return
        store = self.store
        try:
            if self.light and not self.sync_free and t.device.type == "cpu" and is_clean_host(t):
                return
            stats, event = self.stat(t)
        except (torch.OutOfMemoryError, MemoryError):
            self._dropped(t)
            return
        self.seq += 1
        meta = (
            self.step,
            max(self.micro, 0) if micro is None else micro,
            self.seq,
            PHASE_CODE[phase],
            mcode,
            tcode,
            call,
            store.tensors.code(path),
            self._dtype_code(t.dtype),
            self._shape_code(t.shape),
            t.numel(),
            int(is_grad),
            parent,
            -1 if arg is None else store.args.code(arg),
            event,
            int(reduced),
        )
        store.add(meta, stats)
        self.has_rows = True
        self.last_kinds = kinds_of_stats(stats)

    def _dropped(self, t: torch.Tensor) -> None:
        """A statistic ran out of memory: that one record is dropped (never an error in the user's step), with
        one warning per trace."""
        self.dropped_records += 1
        if self.dropped_records == 1:
            warnings.warn(
                f"nantrace: out of memory while computing the statistics of a {tuple(t.shape)} "
                f"{str(t.dtype).replace('torch.', '')} tensor on {t.device}; that record is dropped (and any "
                "later one that runs out of memory, without another warning). Free memory or record fewer "
                "phases (trace(phases=...)) to keep every record.",
                RuntimeWarning,
                stacklevel=2,
            )

    def _dtype_code(self, dtype: torch.dtype) -> int:
        code = self._dtype_codes.get(dtype)
        if code is None:
            code = self._dtype_codes[dtype] = self.store.dtypes.code(str(dtype).replace("torch.", ""))
        return code

    def _shape_code(self, shape: torch.Size) -> int:
        code = self._shape_codes.get(shape)
        if code is None:
            code = self._shape_codes[shape] = self.store.shapes.code(str(tuple(shape)))
        return code

    # ------------------------------------------------------------ step structure
    def begin_micro_step(self) -> None:
        self.micro += 1
        self.pending.micro_steps = self.micro + 1
        self.stack.clear()
        self.calls.clear()
        self.cache.clear()
        self.seen_kinds.clear()
        self.own_code.clear()

    def end_step(self, mask_rule: Any) -> None:
        """Close the open step: one host copy, a ``steps`` row, and drop this step's tensor hooks."""
        for h in self.tensor_handles:
            h.remove()
        self.tensor_handles.clear()
        self.cache.clear()
        self.store.flush(self.step, self.pending, mask_rule)
        self.pending = PendingStep()
        self.step += 1
        self.light = self.step % self.every != 0
        self.micro = -1
        self.seq = 0
        self.has_rows = False
        self.stack.clear()
        self.calls.clear()
        self.seen_kinds.clear()
        self.own_code.clear()

    def step_open(self) -> bool:
        """True when the open step has seen anything worth a ``steps`` row."""
        p = self.pending
        return self.has_rows or self.micro >= 0 or bool(p.losses) or p.scale is not None

    def replay(
        self,
        module: torch.nn.Module,
        args: Any,
        kwargs: Any,
        known: frozenset[str],
        mcode: int,
        call: int,
    ) -> None:
        """Re-run ``module`` on copies of the same inputs and of its buffers (``torch.func.functional_call``),
        with recording off, no autograd and the CPU RNG state forked, to find the first torch op that made a new
        non-finite kind, at the ``__torch_function__`` level (:class:`FirstNonfinite`) and, for dtype casts
        such as autocast's, at the dispatch level (:class:`CastWatch`, which sees the cast first). The user's
        tensors, buffers and RNG state are not touched.

        Only used on the host path (CPU tensors), only for the call where a kind first appears in a
        micro-step. Best effort: any error during the replay is swallowed and nothing is recorded.
        """
        buffers = {name: b.detach().clone() for name, b in module.named_buffers()}
        # detached parameters: autocast caches its casts of leaf parameters that require grad, and a cached
        # cast is not run again, so the replay would not see autocast cast a weight beyond the dtype's max
        buffers.update((name, p.detach()) for name, p in module.named_parameters())
        mode, cast = FirstNonfinite(known), CastWatch(known)
        self.active = False
        try:
            with torch.random.fork_rng(devices=[]), torch.no_grad():
                args_c, kwargs_c = clone_tree(args), clone_tree(kwargs)
                with mode, cast:
                    torch.func.functional_call(module, buffers, tuple(args_c), dict(kwargs_c), strict=False)
        except Exception:
            pass
        finally:
            self.active = True
        found = cast.found or mode.found
        if found is not None:
            op, kind = found
            watch = cast if cast.found else mode
            try:
                facts = operand_facts(watch.operands, watch.result, mode.vanished)
            except Exception:  # best effort, like the replay itself: the op is still named
                facts = ""
            self.store.ops.append((self.step, max(self.micro, 0), mcode, call, op, kind, facts))
        mode.operands, mode.result, cast.operands, cast.result = [], None, [], None

    def maybe_drill(
        self,
        module: torch.nn.Module,
        args: Any,
        kwargs: Any,
        out_kinds: frozenset[str] | None,
        in_kinds: frozenset[str] | None,
        versions: tuple[int, ...],
        mcode: int,
        call: int,
        where: tuple[str, int, int] | None = None,
    ) -> bool:
        """Replay the call (:meth:`replay`) when its output holds a kind first seen in the micro-step, or when a
        kind first appeared at one of its children's inputs (its own code made it), and its inputs were not
        modified in place by the call. True when it replayed. ``where`` = ``(input phase, module type code,
        parent code)``: on a light step the replayed call's inputs then get rows (:func:`_light_inputs`)."""
        own = (mcode, call) in self.own_code
        new_kind = bool(out_kinds) and not (out_kinds or frozenset()) <= self.seen_kinds
        if in_kinds is None or not self.drill or not (new_kind or own):
            return False
        now = tuple(_version(t) for _, t in [*flatten(args, "i"), *flatten(kwargs, "i")])
        if now != versions:  # inputs modified in place by the call: a replay would not be faithful
            return False
        self.replay(module, args, kwargs, in_kinds, mcode, call)
        if self.light and where is not None and where[0] in self.phases:
            items = [*flatten(args, "input"), *flatten(kwargs, "input")]
            _light_inputs(self, where[0], mcode, where[1], call, items, where[2], positional_names(module))
        return True

    # ------------------------------------------------------------ hook factories
    def grad_hook(
        self, phase: str, mcode: int, tcode: int, call: int, path: str, parent: int
    ) -> Callable[[torch.Tensor], None]:
        """The tensor hook recording one gradient: a ``functools.partial`` of one method wrapped by
        :func:`eager` once per recorder (wrapping a new closure per tensor per step cost ~5 µs each)."""
        return functools.partial(self._on_grad, phase, mcode, tcode, call, path, parent, max(self.micro, 0))

    def _record_grad(
        self,
        phase: str,
        mcode: int,
        tcode: int,
        call: int,
        path: str,
        parent: int,
        micro: int,
        grad: torch.Tensor,
    ) -> None:
        if self.active:
            self.add(phase, mcode, tcode, call, path, grad, is_grad=True, parent=parent, micro=micro)

    def watch_grads(
        self,
        phase: str,
        mcode: int,
        tcode: int,
        call: int,
        items: list[tuple[str, torch.Tensor]],
        head: str,
        parent: int,
    ) -> None:
        """Register gradient hooks on the tensors of ``items`` that will receive a gradient, named with
        ``head`` (``grad_input``/``grad_output``) in place of ``input``/``output``."""
        if phase not in self.phases or not torch.is_grad_enabled():
            return
        items = _rename(items, head)
        for path, t in items:
            if t.requires_grad and describable(t):
                h = t.register_hook(self.grad_hook(phase, mcode, tcode, call, path, parent))
                self.tensor_handles.append(h)

    def module_hooks(
        self,
        mcode: int,
        tcode: int,
        *,
        is_root: bool,
        step_each_forward: Callable[[], bool],
        on_step: Any,
        training: Callable[[], bool] = lambda: False,
    ) -> tuple[Callable[..., None], Callable[..., None]]:
        """The forward pre-hook and forward hook (both ``with_kwargs=True``) for one module.

        When ``training()`` is true (the trace has a GradScaler or an optimizer), a root forward that starts
        with autograd disabled (``torch.no_grad``/``torch.inference_mode``: evaluation) is not a micro-step:
        neither it nor any module call inside it is recorded (``eval_depth`` counts such root calls)."""
        phases = self.phases

        def pre(module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            if not self.active or in_backward():  # activation checkpointing recomputes forwards in backward
                return
            if self.eval_depth:
                self.eval_depth += is_root
                return
            if is_root and self.root_depth == 0 and not torch.is_grad_enabled() and training():
                self.eval_depth = 1
                return
            if is_root and self.root_depth == 0:
                if step_each_forward() and self.step_open():
                    on_step()
                self.begin_micro_step()
            call = self.calls.get(mcode, 0)
            self.calls[mcode] = call + 1
            if self.capture is not None:
                self.capture.pre(mcode, args, kwargs)
            parent = self.stack[-1][0] if self.stack else -1
            names = positional_names(module)
            items = list(flatten(args, "input"))
            items += list(flatten(kwargs, "input"))
            phase = "data" if is_root else "forward"
            in_kinds: frozenset[str] | None = frozenset()
            if phase in phases:
                for path, t in items:
                    self.last_kinds = frozenset()
                    self.add(
                        phase,
                        mcode,
                        tcode,
                        call,
                        path,
                        t,
                        is_grad=False,
                        parent=parent,
                        arg=_arg(path, names),
                    )
                    in_kinds = _union(in_kinds, self.last_kinds)
            else:
                in_kinds = None
            if in_kinds:
                if not is_root and self.stack and not in_kinds <= self.seen_kinds:
                    # a kind first seen at a child's input: the enclosing call's own code made it (drill it)
                    self.own_code.add(self.stack[-1][:2])
                self.seen_kinds |= in_kinds
            self.watch_grads("backward", mcode, tcode, call, items, "grad_input", parent)
            versions = tuple(_version(t) for _, t in items) if in_kinds is not None and self.drill else ()
            self.stack.append((mcode, call, in_kinds, versions))
            if is_root:
                self.root_depth += 1

        def post(module: torch.nn.Module, args: Any, kwargs: Any, output: Any) -> None:
            if not self.active or in_backward():
                return
            if self.eval_depth:
                self.eval_depth -= is_root
                return
            call = -1
            in_kinds: frozenset[str] | None = None
            versions: tuple[int, ...] = ()
            while self.stack:
                m, c, k, v = self.stack.pop()
                if m == mcode:
                    call, in_kinds, versions = c, k, v
                    break
            if is_root:
                self.root_depth = max(0, self.root_depth - 1)
            if self.capture is not None:
                self.capture.post(module, mcode, output, self.step, max(self.micro, 0), call)
            if call < 0 or output is None:
                return
            parent = self.stack[-1][0] if self.stack else -1
            items = list(flatten(output, "output"))
            if "forward" in phases:
                out_kinds: frozenset[str] | None = frozenset()
                for path, t in items:
                    self.last_kinds = frozenset()
                    self.add("forward", mcode, tcode, call, path, t, is_grad=False, parent=parent)
                    out_kinds = _union(out_kinds, self.last_kinds)
                where = ("data" if is_root else "forward", tcode, parent)
                self.maybe_drill(module, args, kwargs, out_kinds, in_kinds, versions, mcode, call, where)
                if out_kinds:
                    self.seen_kinds |= out_kinds
            phase = "loss" if is_root and self.root_depth == 0 else "backward"
            self.watch_grads(phase, mcode, tcode, call, items, "grad_output", parent)

        return eager(pre), eager(post)


def _light_inputs(
    rec: Recorder,
    phase: str,
    mcode: int,
    tcode: int,
    call: int,
    items: list[tuple[str, Any]],
    parent: int,
    names: Any,
) -> None:
    """On a light step (``every > 1``), the rows of a drilled call's inputs, clean ones too, so the producing
    call is described as on a full step (its input absmax). Only called when the inputs were not modified in
    place by the call (the drill checked their versions)."""
    rec.light = False
    try:
        for path, t in items:
            rec.add(phase, mcode, tcode, call, path, t, is_grad=False, parent=parent, arg=_arg(path, names))
    finally:
        rec.light = True


def _union(a: frozenset[str] | None, b: frozenset[str] | None) -> frozenset[str] | None:
    if a is None or b is None:
        return None
    return a | b


def _rename(items: list[tuple[str, torch.Tensor]], head: str) -> list[tuple[str, torch.Tensor]]:
    out = []
    for path, t in items:
        rest = path.split("input", 1)[1] if path.startswith("input") else path.split("output", 1)[1]
        out.append((head + (rest if rest else "[0]"), t))
    return out


def _arg(path: str, names: list[str]) -> str | None:
    """The forward parameter name behind an input path such as ``input[1]`` or ``input.mask``."""
    if path.startswith("input."):
        return path[6:].split(".")[0].split("[")[0]
    if path.startswith("input["):
        idx = path[6:].split("]")[0]
        if idx.isdigit() and int(idx) < len(names):
            return names[int(idx)]
    return None
