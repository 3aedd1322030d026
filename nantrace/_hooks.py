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
from torch.utils.hooks import RemovableHandle

from ._drill import (
    CAST_OP,
    OWN_HOOK,
    FirstNonfinite,
    Made,
    Suspects,
    ZeroCounts,
    call_key,
    drill_call,
    headroom_fraction,
    leaf_key,
)
from ._naming import positional_names
from ._schema import PHASE_CODE
from ._stats import describable, is_clean_host, stats_device, stats_host
from ._store import PendingStep, Store
from ._tree import flatten_list

__all__ = [
    "CAST_OP",
    "FirstNonfinite",
    "Recorder",
    "at_pass_end",
    "eager",
    "graph_task",
    "in_backward",
    "kinds_of_stats",
]

_KIND_COLS = ((4, "nan"), (5, "posinf"), (6, "neginf"))
_CLEAN: frozenset[str] = frozenset()
# per output tensor's statistics event (_note_reached): the open calls around its maker, the event of the maker's
# one tensor input and that input's zero counts (None, None: a maker the walk cannot see through)
Reached = tuple[tuple[tuple[int, int], ...], int | None, ZeroCounts | None]


def kinds_of_stats(stats: Any) -> frozenset[str] | None:
    """Non-finite kinds in a host statistics tuple; ``None`` for device statistics (not read in hooks)."""
    if isinstance(stats, torch.Tensor):
        return None
    if not (stats[4] or stats[5] or stats[6]):
        return _CLEAN
    return frozenset(k for i, k in _KIND_COLS if stats[i] > 0)


_TASK_ID = getattr(torch._C, "_current_graph_task_id", None)


def in_backward() -> bool:
    """True while autograd's engine runs a backward pass (a checkpoint's recomputed forward runs there)."""
    return graph_task() != -1


def graph_task() -> int:
    """The id of the autograd graph task (one ``.backward()`` or ``torch.autograd.grad`` call) running on this
    thread, -1 outside a backward pass."""
    return _TASK_ID() if _TASK_ID is not None else -1


def at_pass_end(fn: Callable[[], None]) -> bool:
    """Have autograd's engine call ``fn`` when the running backward pass ends (after its last gradient, before
    ``.backward()`` returns). False when that cannot be done (not inside a backward pass)."""
    engine = getattr(torch.autograd.Variable, "_execution_engine", None)
    if engine is None or graph_task() == -1:
        return False
    try:
        engine.queue_callback(fn)
    except RuntimeError:
        return False
    return True


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
        self.device_stats = False  # a statistic was computed on the sync-free (on-device) path
        self.capture: Any = None  # a nantrace._repro.Capture with trace(capture=...)
        self.seen_kinds: set[str] = set()
        self.own_code: set[tuple[int, int]] = (
            set()
        )  # (module code, call) whose own code made a kind first seen
        self.suspects = Suspects()  # the cheap signals of a transient inf in a finite call
        # the modules whose calls are recorded (their outputs are boundaries the drill-down can vouch for)
        self.recorded: weakref.WeakSet[torch.nn.Module] = weakref.WeakSet()
        self.covered: set[tuple[int, int]] = set()  # open calls around a call that named a transient value
        # output tensor's event id -> Reached, for the finite calls checked in the micro-step (_note_reached)
        self.reached: dict[int, Reached] = {}
        self.sync_free = sync_free
        self.phases = record_phases
        self.active = False
        self.step = 0
        self.micro = -1
        self.seq = 0
        self.event = 0
        self.root_depth = 0
        self.eval_depth = 0  # > 0 inside a root forward left out as evaluation (see module_hooks)
        self.eval_code = -1  # the module code of the outermost call that eval_depth counts
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
        self._on_grads = eager(self._record_grads)
        # id(tensor) -> [weak reference, version, the first hook's targets, the last hook's targets, the last
        # hook's id] of the tensor hooks registered in the step (one hook, one list, unless a user hook came between)
        self.grad_targets: dict[int, list[Any]] = {}

    # ------------------------------------------------------------ statistics
    def stat(self, t: torch.Tensor) -> tuple[Any, int]:
        """Statistics of ``t`` and its event id, reusing the result for a tensor already seen unchanged."""
        key = id(t)
        ver = _version(t)
        hit = self.cache.get(key)
        if hit is not None and hit[0]() is t and hit[1] == ver and ver >= 0:
            return hit[2], hit[3]
        return self._computed(t, key, ver)

    def _computed(self, t: torch.Tensor, key: int, ver: int) -> tuple[Any, int]:
        """:meth:`stat` of a tensor not in the cache (``key``: its id, ``ver``: its version, -1 for an inference
        tensor, which is not cached)."""
        if not self.sync_free and t.is_cpu:
            stats: Any = stats_host(t)
        else:
            stats = stats_device(t)
            self.device_stats = True  # no host statistics: no drill-down signal (diagnose says so)
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
        parallel) is described by this rank's local shard, so no statistic needs a collective. The hot path of
        every hook: the checks of :func:`describable` and the cache of :meth:`stat` are written out here."""
        if type(t) is not torch.Tensor and hasattr(t, "to_local") and hasattr(t, "placements"):
            t = t.to_local()
        numel = t.numel() if isinstance(t, torch.Tensor) else 0
        if not (numel and t.is_floating_point() and t.layout == torch.strided and not t.is_quantized):
            return
        try:
            if self.light and not self.sync_free and t.is_cpu and is_clean_host(t):
                return
            key = id(t)
            ver = -1 if t.is_inference() else t._version
            hit = self.cache.get(key)
            if hit is not None and ver >= 0 and hit[1] == ver and hit[0]() is t:
                stats, event = hit[2], hit[3]
            else:
                stats, event = self._computed(t, key, ver)
        except (torch.OutOfMemoryError, MemoryError):
            _dropped(self, t)
            return
        self.seq += 1
        store = self.store
        dtype = self._dtype_codes.get(t.dtype)
        shape = self._shape_codes.get(t.shape)
        store.pending_meta.extend(
            (
                self.step,
                (self.micro if self.micro > 0 else 0) if micro is None else micro,
                self.seq,
                PHASE_CODE[phase],
                mcode,
                tcode,
                call,
                store.tensors.code(path),
                self._dtype_code(t.dtype) if dtype is None else dtype,
                self._shape_code(t.shape) if shape is None else shape,
                numel,
                int(is_grad),
                parent,
                -1 if arg is None else store.args.code(arg),
                event,
                int(reduced),
            )
        )
        store.pending_stats.append(stats)
        self.has_rows = True
        if type(stats) is tuple:
            self.last_kinds = _CLEAN if not (stats[4] or stats[5] or stats[6]) else kinds_of_stats(stats)
        else:
            self.last_kinds = None  # device statistics: not read in hooks

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
        """A root forward begins a micro-step. The step's first keeps what module calls the loop made before it
        (recorded as micro-step 0 too): their call indices and the kinds they saw go on, so a submodule the
        loop called itself and the same submodule inside the root forward are calls 0 and 1."""
        first = self.micro < 0
        self.micro += 1
        self.pending.micro_steps = self.micro + 1
        self.stack.clear()
        self.cache.clear()
        self.reached.clear()
        if first:  # end_step cleared the rest
            return
        self.calls.clear()
        self.seen_kinds.clear()
        self.own_code.clear()
        self.covered.clear()

    def end_step(self, mask_rule: Any) -> None:
        """Close the open step: one host copy, a ``steps`` row, and drop this step's tensor hooks."""
        for h in self.tensor_handles:
            h.remove()
        self.tensor_handles.clear()
        self.grad_targets.clear()
        self.cache.clear()
        self.reached.clear()
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
        *,
        transient: bool = False,
        micro: int | None = None,
        key: Any = None,
        leaf: Any = None,
    ) -> bool:
        """Replay the call on copies of its inputs and buffers with recording off (:func:`nantrace._drill.drill_call`,
        host path only; best effort) and add an ``ops`` row for the op that made a new kind, with the user's
        source line and ``reaches`` (``transient``: the output was finite). True when an op was named. ``key``
        (:func:`nantrace._drill.call_key`): what the replay showed about intermediate values is learned for it
        (:meth:`nantrace._drill.Suspects.learn`), and for ``leaf`` (:func:`nantrace._drill.leaf_key`: every leaf
        module running the same code)."""
        made = Made(self.recorded.__contains__) if key is not None or leaf is not None else None
        self.active = False
        try:
            found = drill_call(module, args, kwargs, known, transient=transient, made=made)
        finally:
            self.active = True
        if made is not None:
            self.suspects.learn(key, made, leaf)
        if found is None:
            return False
        op, kind, facts, line, reaches = found
        micro = max(self.micro, 0) if micro is None else micro
        self.store.ops.append((self.step, micro, mcode, call, op, kind, facts, line, reaches))
        return True

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
        where: tuple[str, int, int, Any] | None = None,
    ) -> bool:
        """Replay the call (:meth:`replay`) when its inputs were not modified in place by it and its output holds a
        kind first seen in the micro-step, or a child's input did (its own code made it), or its output is finite
        but the recorded signals point to a transient inf (:class:`~nantrace._drill.Suspects`). True when it
        replayed for a kind. ``where`` = ``(input phase, module type code, parent code, output)``: on a light
        step the replayed call's inputs get rows (:func:`_light_inputs`)."""
        own = (mcode, call) in self.own_code
        new_kind = bool(out_kinds) and not (out_kinds or frozenset()) <= self.seen_kinds
        if in_kinds is None or not self.drill:
            return False
        ins = flatten_list(args, "input") + flatten_list(kwargs, "input")
        if not (new_kind or own):  # a finite call: replayed only when the signals point to a transient inf
            if where is not None and not out_kinds and (mcode, call) not in self.covered:
                _finite_call(self, module, args, kwargs, ins, in_kinds, versions, (mcode, call), where[3])
            return False
        if not _same(ins, versions):  # inputs modified in place by the call: a replay would not be faithful
            return False
        key, leaf = call_key(mcode, module, args, kwargs), leaf_key(module, args, kwargs)
        self.replay(module, args, kwargs, in_kinds, mcode, call, key=key, leaf=leaf)
        if self.light and where is not None and where[0] in self.phases:
            _light_inputs(self, where[0], mcode, where[1], call, ins, where[2], positional_names(module))
        return True

    # ------------------------------------------------------------ hook factories
    def _record_grads(self, targets: list[tuple[Any, ...]], grad: torch.Tensor) -> None:
        """A tensor's hook: a row per target (the calls that saw it as output or input, in the order they
        registered), the statistics computed once (:meth:`stat` caches them)."""
        if self.active:
            for phase, mcode, tcode, call, path, parent, micro in targets:
                self.add(phase, mcode, tcode, call, path, grad, is_grad=True, parent=parent, micro=micro)

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
        neither it nor any module call inside it is recorded (``eval_depth`` counts such root calls). So is a
        call of a submodule that the loop makes itself (no call open around it) with autograd disabled."""
        phases = self.phases

        def pre(module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            if not self.active or in_backward():  # activation checkpointing recomputes forwards in backward
                return
            if self.eval_depth:
                self.eval_depth += mcode == self.eval_code
                return
            if not self.stack and self.root_depth == 0 and not torch.is_grad_enabled() and training():
                self.eval_depth, self.eval_code = 1, mcode  # the root, or a submodule the loop calls itself
                return
            if is_root and self.root_depth == 0:
                if step_each_forward() and self.step_open():
                    on_step()
                self.begin_micro_step()
            call = self.calls.get(mcode, 0)
            self.calls[mcode] = call + 1
            if self.capture is not None:
                self.capture.pre(module, mcode, args, kwargs)
            parent = self.stack[-1][0] if self.stack else -1
            names = positional_names(module)
            items = flatten_list(args, "input")
            if kwargs:
                items = items + flatten_list(kwargs, "input")
            phase = "data" if is_root else "forward"
            in_kinds: frozenset[str] | None = frozenset()
            if phase in phases:
                for path, t in items:
                    self.last_kinds = _CLEAN
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
            _watch_grads(self, "backward", mcode, tcode, call, items, "grad_input", parent)
            versions = tuple(_version(t) for _, t in items) if in_kinds is not None and self.drill else ()
            self.stack.append((mcode, call, in_kinds, versions))
            if is_root:
                self.root_depth += 1

        def post(module: torch.nn.Module, args: Any, kwargs: Any, output: Any) -> None:
            if not self.active or in_backward():
                return
            if self.eval_depth:
                self.eval_depth -= mcode == self.eval_code
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
            items = flatten_list(output, "output")
            if "forward" in phases:
                out_kinds: frozenset[str] | None = frozenset()
                for path, t in items:
                    self.last_kinds = _CLEAN
                    self.add("forward", mcode, tcode, call, path, t, is_grad=False, parent=parent)
                    out_kinds = _union(out_kinds, self.last_kinds)
                where = ("data" if is_root else "forward", tcode, parent, output)
                self.maybe_drill(module, args, kwargs, out_kinds, in_kinds, versions, mcode, call, where)
                if out_kinds:
                    self.seen_kinds |= out_kinds
            phase = "loss" if is_root and self.root_depth == 0 else "backward"
            _watch_grads(self, phase, mcode, tcode, call, items, "grad_output", parent)

        return _own(eager(pre)), _own(eager(post))


def _watch_grads(
    rec: Recorder,
    phase: str,
    mcode: int,
    tcode: int,
    call: int,
    items: list[tuple[str, torch.Tensor]],
    head: str,
    parent: int,
) -> None:
    """Record the gradients of the tensors of ``items`` that will receive one, named with ``head``
    (``grad_input``/``grad_output``) in place of ``input``/``output``. One tensor hook per tensor: one call's
    output that is the next call's input gets a second target on the first's hook, when it is unchanged since
    (same version: an in-place op gives it a new gradient function). Tensor hooks run in the order they were
    registered, so when a hook of the user's was registered on the tensor after nantrace's last one (it may
    change the gradient), the targets are split: a consumer's ``grad_input`` stays on the first hook (the
    gradient its backward made, before the user's hooks) and a producer's ``grad_output`` moves to a new hook
    registered after the user's (the gradient that reached the producer). A consumer's new hook on a tensor
    that already has the user's hooks runs before them (:func:`_run_first`). The hook is a
    ``functools.partial`` of one method wrapped by :func:`eager` once per recorder (a new wrapper per tensor
    cost ~5 µs)."""
    if phase == "loss":  # the root forward's end: the user's hooks on watched tensors are all registered
        _settle_grads(rec)
    if phase not in rec.phases or not torch.is_grad_enabled():
        return
    micro = max(rec.micro, 0)
    for path, t in _rename(items, head):
        if not (t.requires_grad and describable(t)):
            continue
        target = (phase, mcode, tcode, call, path, parent, micro)
        hit = rec.grad_targets.get(id(t))
        if hit is None or hit[0]() is not t or hit[1] != t._version:
            targets = [target]
            h = t.register_hook(functools.partial(rec._on_grads, targets))
            rec.tensor_handles.append(h)
            if head == "grad_input":
                _run_first(t, h.id)
            rec.grad_targets[id(t)] = [weakref.ref(t), t._version, targets, targets, h.id]
            continue
        if head == "grad_output":
            _after_user_hooks(rec, t, hit, target)
        else:
            hit[2].append(target)


def _finite_call(
    rec: Recorder,
    module: torch.nn.Module,
    args: Any,
    kwargs: Any,
    ins: list[tuple[str, Any]],
    in_kinds: frozenset[str],
    versions: tuple[int, ...],
    at: tuple[int, int],
    out: Any,
) -> None:
    """A finite call ``at`` = ``(module code, call)`` with output ``out``: replayed (:meth:`Recorder.replay`,
    ``transient``) when a signal is at a new high (:meth:`nantrace._drill.Suspects.check`), its inputs were left
    unchanged, and no earlier replay under its call key or leaf key showed it cannot hide a transient inf
    (:meth:`nantrace._drill.Suspects.skips`).

    Runs after every finite call of a full step, so each tensor's cached statistics are looked up once
    (:func:`_hit`) and the signals (zero fractions of the outputs and inputs, the inputs' headroom) and the
    upstream note (:func:`_note_reached`) are read from those lookups."""
    mcode, call = at
    cache = rec.cache
    unchanged = _same(ins, versions)
    in_hits = [(t, _hit(cache, t)) for _, t in ins if describable(t)]
    out_hits = [(t, _hit(cache, t)) for _, t in flatten_list(out, "o") if describable(t)]
    in_host = _host_only(in_hits)
    out_zeros = _zero_fraction(_host_only(out_hits), rec.reached, at)
    signal = rec.suspects.check(mcode, out_zeros, _zero_fraction(in_host), headroom_fraction(in_host))
    if rec.stack:
        _note_reached(rec.reached, out_hits, in_hits if unchanged else [], tuple(k[:2] for k in rec.stack))
    if not (signal and unchanged):
        return
    cached = functools.partial(_cached, cache)
    key, leaf = call_key(mcode, module, args, kwargs), leaf_key(module, args, kwargs)
    # no child output recorded in the micro-step held a kind beyond the call's inputs', none was dropped
    children = rec.seen_kinds <= in_kinds and rec.dropped_records == 0
    if rec.suspects.skips(key, out, cached, children, leaf):
        return  # an earlier replay of such a call made no intermediate value: nothing to name
    if rec.replay(module, args, kwargs, in_kinds, mcode, call, transient=True, key=key, leaf=leaf):
        rec.covered.update(k[:2] for k in rec.stack)  # the calls around it see the same value


#: A cache entry of :class:`Recorder` (weak reference, version, statistics, event id) for a tensor.
_Hit = tuple[Any, int, Any, int]


def _hit(cache: dict[int, Any], t: torch.Tensor) -> _Hit | None:
    """The cache entry of the statistics the step computed for ``t`` while unchanged, or None."""
    hit = cache.get(id(t))
    if hit is None or hit[0]() is not t or hit[1] != _version(t):
        return None
    return hit


def _host_only(hits: list[tuple[torch.Tensor, _Hit | None]]) -> list[tuple[torch.Tensor, _Hit]] | None:
    """``hits`` when every tensor has host statistics (a tuple), else None (one not recorded, or still a device
    tensor)."""
    for _, h in hits:
        if h is None or isinstance(h[2], torch.Tensor):
            return None
    return hits  # type: ignore[return-value]


def _zero_fraction(
    hits: list[tuple[torch.Tensor, _Hit]] | None,
    reached: dict[int, Reached] | None = None,
    at: tuple[int, int] = (-1, -1),
) -> float | None:
    """The fraction of zero elements over the tensors of ``hits`` (index 7 of their statistics is ``n_zero``);
    None when a statistic is missing or there is no element. With ``reached``, an output that is, unchanged, the
    output of a call made inside ``at`` counts what reached that call instead (:func:`_upstream`)."""
    if hits is None:
        return None
    zeros = total = 0
    for t, h in hits:
        counts = _upstream(reached, at, h[3]) if reached is not None else None
        if counts is None:
            counts = (int(h[2][7]), t.numel())
        zeros += counts[0]
        total += counts[1]
    return zeros / total if total else None


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


def _own(hook: Callable[..., None]) -> Callable[..., None]:
    """Mark one of nantrace's module hooks: they return at once during a replay, so the leaf keys
    (:func:`nantrace._drill.leaf_key`) of instances that differ only in them are the same."""
    setattr(hook, OWN_HOOK, True)
    return hook


def _dropped(rec: Recorder, t: torch.Tensor) -> None:
    """A statistic ran out of memory: that one record is dropped (never an error in the user's step), with
    one warning per trace."""
    rec.dropped_records += 1
    if rec.dropped_records == 1:
        warnings.warn(
            f"nantrace: out of memory while computing the statistics of a {tuple(t.shape)} "
            f"{str(t.dtype).replace('torch.', '')} tensor on {t.device}; that record is dropped (and any "
            "later one that runs out of memory, without another warning). Free memory or record fewer "
            "phases (trace(phases=...)) to keep every record.",
            RuntimeWarning,
            stacklevel=2,
        )


def _settle_grads(rec: Recorder) -> None:
    """At the end of a root forward: a hook the user registered on a watched tensor after nantrace's last
    one (after the tensor's consumers ran) runs before the producer's row is taken, so that row moves to a
    hook registered after it (:func:`_after_user_hooks`)."""
    for hit in rec.grad_targets.values():
        t = hit[0]()
        if t is not None and hit[1] == t._version:
            _after_user_hooks(rec, t, hit)


def _after_user_hooks(
    rec: Recorder, t: torch.Tensor, hit: list[Any], new: tuple[Any, ...] | None = None
) -> None:
    """Add the producer's ``grad_output`` target ``new`` (if any) to the last of nantrace's hooks on ``t``
    (``hit``: its :attr:`Recorder.grad_targets` entry). When a hook of the user's was registered after that one,
    the producers' targets move to a new hook registered after the user's, which sees the gradient the user's
    hooks returned; consumers' targets stay where they are (their backward made the gradient the first hook
    sees)."""
    if _last_hook(t) == hit[4]:
        if new is not None:
            hit[3].append(new)
        return
    last = hit[3]
    moved = [x for x in last if x[4].startswith("grad_output")] + ([new] if new is not None else [])
    if not moved:
        return
    last[:] = [x for x in last if not x[4].startswith("grad_output")]
    h = t.register_hook(functools.partial(rec._on_grads, moved))
    rec.tensor_handles.append(h)
    hit[3], hit[4] = moved, h.id


def _run_first(t: torch.Tensor, hid: int) -> None:
    """Move nantrace's tensor hook ``hid`` before the hooks already registered on ``t`` (the user's, registered
    before the consumer ran, e.g. on an intermediate the root's code passes to a submodule): a consumer's
    ``grad_input`` row is the gradient its backward made, not what the user's hooks return. Tensor hooks run in
    the order of ``t._backward_hooks``; nantrace's return None, so the user's still see the same gradient, and
    every handle removes its own entry as before."""
    hooks = getattr(t, "_backward_hooks", None)
    if not hooks or len(hooks) < 2 or next(iter(hooks)) == hid:
        return
    items = list(hooks.items())
    hooks.clear()  # re-inserted (not move_to_end): autograd walks the dict's own order
    hooks[hid] = dict(items)[hid]
    hooks.update((k, v) for k, v in items if k != hid)


def _last_hook(t: torch.Tensor) -> int | None:
    """The id of the last tensor hook registered on ``t`` (None when it has none or torch keeps them elsewhere)."""
    hooks = getattr(t, "_backward_hooks", None)
    return next(reversed(hooks), None) if hooks else None


def _cached(cache: dict[int, Any], t: torch.Tensor) -> Any:
    """The statistics the step computed for ``t`` while unchanged (the Recorder's cache), or None."""
    hit = _hit(cache, t)
    return hit[2] if hit is not None else None


def _upstream(reached: dict[int, Reached], call: tuple[int, int], event: int | None) -> ZeroCounts | None:
    """For the output tensor of ``call`` whose statistics have the id ``event``, when it is, unchanged, the
    output of a call made inside ``call`` (:func:`_note_reached`): walk back through such calls, each to its one
    tensor input, while that input is itself the output of such a call, and return the zero counts of the value
    reached (the zeros that reached the chain: made by ``call``'s own code or in its inputs). None (the output's
    own zeros count, as without the walk) when it is no such output or the walk meets a call it cannot see
    through."""
    counts = None
    while event is not None:
        hit = reached.get(event)
        if hit is None or call not in hit[0]:  # a value no call inside ``call`` made: the walk ends
            break
        if hit[1] is None or hit[1] >= event:  # an opaque inner call (events only go back)
            return None
        event, counts = hit[1], hit[2]
    return counts


def _note_reached(
    reached: dict[int, Reached],
    outs: list[tuple[torch.Tensor, _Hit | None]],
    ins: list[tuple[torch.Tensor, _Hit | None]],
    around: tuple[tuple[int, int], ...],
) -> None:
    """Note, for each output tensor of a finite call (``outs``: its describable outputs and their cache entries,
    :func:`_hit`), the calls ``around`` it and, when the call has exactly one tensor input (``ins``, likewise;
    empty when the call changed an input in place), that input with its zero counts, by the event ids of their
    statistics, so nothing is kept alive and the walk of :func:`_upstream` can pass through tensors freed since.
    Otherwise the call is opaque to the walk: counted over several inputs, zeros made upstream would be diluted
    by the other inputs' elements."""
    before: int | None = None
    counts: ZeroCounts | None = None
    hit = ins[0][1] if len(ins) == 1 else None
    if hit is not None and not isinstance(hit[2], torch.Tensor):
        before, counts = hit[3], (int(hit[2][7]), ins[0][0].numel())
    for _, h in outs:
        if h is not None and h[3] != before:
            reached[h[3]] = (around, before, counts)


def _same(items: list[tuple[str, torch.Tensor]], versions: tuple[int, ...]) -> bool:
    """The tensors of ``items`` still have the ``versions`` they had when the call began (no in-place change)."""
    return tuple(_version(t) for _, t in items) == versions


def _union(a: frozenset[str] | None, b: frozenset[str] | None) -> frozenset[str] | None:
    if a is None or b is None:
        return None
    return a | b


_RENAMED: dict[tuple[str, str], str] = {}


def _rename(items: list[tuple[str, torch.Tensor]], head: str) -> list[tuple[str, torch.Tensor]]:
    out = []
    for path, t in items:
        name = _RENAMED.get((path, head))
        if name is None:
            rest = path.split("input", 1)[1] if path.startswith("input") else path.split("output", 1)[1]
            name = _RENAMED[(path, head)] = head + (rest if rest else "[0]")
        out.append((name, t))
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
