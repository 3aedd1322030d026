"""The forward drill-down: replay one module call at op level to name the torch op that made a non-finite value.

A replay re-runs a module call on copies of its inputs and buffers with autograd off and the CPU RNG state forked
(:func:`replay_call`); the user's tensors, buffers and RNG state are not touched. It is used on the host path
(CPU tensors) only, where reading a value costs no device synchronisation.

* :class:`FirstNonfinite` stops at the first ``__torch_function__`` op that *produced* a kind (NaN, +inf, -inf):
  one of its outputs holds it and none of its inputs did, a non-finite scalar argument counting as an input
  (``masked_fill(m, -inf)`` does not produce its -inf). It notes the op's position in the call and the user's
  source line that ran it (:func:`user_line`).
* :class:`CastWatch` is the dispatch-level half: autocast casts a float32 weight to float16 below
  ``__torch_function__`` (``linear`` is one op there), as ``aten._to_copy``.
* :func:`reaches_output` decides whether an op's non-finite value changed what the call computed: the call is
  replayed with that op's non-finite elements replaced by finite values (0, the dtype's max, minus its max) and
  the outputs are compared. A value that a selection discards (``where``, ``masked_fill``, indexing) leaves the
  output the same whatever finite value it had; a *transient* inf that never left the call but was turned into a
  finite value (``rsqrt(inf) = 0``, ``x / inf = 0``, ``tanh(inf) = 1``) does not.

A call is replayed when its output first holds a kind, when a child's input does (its own code made it), or when
the cheap recorded signals of a finite call point to a transient inf (:class:`Suspects`: more zeros out than
in, counting for an output that is a child's output the zeros that reached that child; an input beyond the
cube root of its dtype's max, 40.3 in float16), unless an earlier replay of such a call, or of a leaf module
running the same code (:func:`leaf_key`), made no intermediate value (:class:`Made`), without which no
transient inf can exist.
"""

from __future__ import annotations

import contextlib
import inspect
import math
import os
import sys
import threading
import weakref
from collections.abc import Callable
from contextlib import ExitStack
from typing import Any

import torch
from torch.nn.modules import module as _module_hooks
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from ._opfacts import TARGET_OPS, named_operands, note_vanished, operand_facts
from ._schema import MASK_KIND
from ._stats import describable, either_sign, op_input_kinds, tensor_kinds
from ._tree import clone_tree, flatten, host_rngs_kept, plain_state, restore_plain

__all__ = [
    "CAST_OP",
    "OWN_HOOK",
    "CastWatch",
    "FirstNonfinite",
    "Found",
    "Made",
    "Substitute",
    "Suspects",
    "ZeroCounts",
    "call_key",
    "drill_call",
    "headroom_fraction",
    "leaf_key",
    "reaches_output",
    "replay_call",
    "reset_call_site",
    "set_call_site",
    "user_line",
    "user_stacklevel",
]

CAST_OP = "aten._to_copy"  # the name the drill-down gives a dtype cast it saw make a kind (autocast's casts)
_ORDER = ("posinf", "neginf", "nan")  # of several new kinds, inf is named before NaN (NaN follows from inf)
_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
_OWN_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep
_EXAMPLES_DIR = _OWN_DIR + "examples" + os.sep
# the absmax signal's bound, as a fraction of log2(dtype max): the lowest power an op of the field raises an
# activation to inside one call is the cube of tanh-GELU's ``x + 0.044715·x³`` (beyond 40.3 in float16 it
# overflows); squares (norms, variances, ``|a|²·|b|²``) are beyond it too
_REACH = 1.0 / 3


class Stop(Exception):
    """Raised inside a replay to stop it at the producing op."""


Found = tuple[str, str, int, str | None]  # (op name, kind, position of the op in the call, source line)
Hook = tuple[str, str, str | None]  # (name, kind, owning module relative to the replayed one): hook_codes()


_CALL_SITE = threading.local()  # (frame, line) of a replay of a whole root call: see set_call_site


def set_call_site(frame: Any, line: str | None) -> Any:
    """While a replay of a root call runs from ``frame`` (nantrace's own), :func:`user_line` answers ``line``,
    the user's line of the real call, when its walk reaches ``frame`` (the user's frames above it are the loop
    that triggered the replay, not the call). Returns the token for :func:`reset_call_site`."""
    token = getattr(_CALL_SITE, "v", None)
    _CALL_SITE.v = (frame, line)
    return token


def reset_call_site(token: Any) -> None:
    _CALL_SITE.v = token


def user_stacklevel() -> int:
    """The ``stacklevel`` of a warning, issued by the caller, that points at the first frame outside nantrace and
    torch (the user's line that called into them)."""
    frame, level = sys._getframe(1), 1
    while frame is not None and frame.f_code.co_filename.startswith((_OWN_DIR, _TORCH_DIR)):
        frame, level = frame.f_back, level + 1  # type: ignore[assignment]
    return level


def user_line() -> str | None:
    """``path:line`` of the innermost frame outside torch and nantrace (nantrace's ``examples`` count as user
    code): the line of the user's code that called the op; None when there is none. Inside a replay of a whole
    root call (:func:`set_call_site`) the walk stops at the replay's frame with the real call's line."""
    frame = sys._getframe(1)
    stop = getattr(_CALL_SITE, "v", None)
    while frame is not None:
        if stop is not None and frame is stop[0]:
            return stop[1]
        name = os.path.abspath(frame.f_code.co_filename)
        if name.startswith(_EXAMPLES_DIR) or not (name.startswith(_TORCH_DIR) or name.startswith(_OWN_DIR)):
            return f"{frame.f_code.co_filename}:{frame.f_lineno}"
        frame = frame.f_back  # type: ignore[assignment]
    return None


def hook_codes(module: torch.nn.Module) -> dict[Any, Hook]:
    """``code object -> (hook name, kind, module)`` of the forward and forward-pre hooks that can run in a call
    of ``module`` and are not nantrace's or torch's: those of ``module`` and its submodules (``module`` is the
    submodule's name relative to ``module``, ``""`` for itself) and the global ones (``module`` None). ``kind``
    is ``"forward hook"``, ``"forward-pre hook"``, or those with ``"global "`` before. Plain functions and bound
    methods are named (``scale``, ``Steer.apply``), unwrapped (``functools.wraps``); a hook of another kind (a
    ``functools.partial``, a callable object) is left out."""
    out: dict[Any, Hook] = {}
    tables: list[tuple[Any, str, str | None]] = [
        (_module_hooks._global_forward_pre_hooks, "global forward-pre hook", None),
        (_module_hooks._global_forward_hooks, "global forward hook", None),
    ]
    for name, m in module.named_modules():
        tables += [(m._forward_pre_hooks, "forward-pre hook", name), (m._forward_hooks, "forward hook", name)]
    for table, kind, owner in tables:
        for hook in list(table.values()):
            fn = inspect.unwrap(getattr(hook, "__func__", hook))
            code = getattr(fn, "__code__", None)
            if code is None:
                continue
            path = os.path.abspath(code.co_filename)
            if path.startswith(_OWN_DIR) or path.startswith(_TORCH_DIR):
                continue
            out[code] = (
                str(getattr(fn, "__qualname__", None) or getattr(fn, "__name__", "hook")),
                kind,
                owner,
            )
    return out


def _running_hook(hooks: dict[Any, Hook]) -> Hook | None:
    """The innermost of ``hooks`` on the current stack (the op was called from inside it), or None."""
    if not hooks:
        return None
    frame = sys._getframe(2)
    while frame is not None:
        found = hooks.get(frame.f_code)
        if found is not None:
            return found
        frame = frame.f_back  # type: ignore[assignment]
    return None


class FirstNonfinite(TorchFunctionMode):
    """Replays a forward and stops at the first torch op that *produced* a kind not in ``known`` (the module
    call's input kinds): one of its outputs holds it and none of its inputs did, a non-finite scalar argument
    counting as an input (:func:`nantrace._stats.op_input_kinds`, the rule of :func:`nantrace.hunt`), or one of
    its operands is a parameter of the module (``owned``) that already held it as NaN or +inf: a weight made
    non-finite before the forward, so the call made the kind from finite inputs and this op is the first to pass
    it on (a parameter's -inf may be a mask kept as a parameter and does not count).
    ``found`` is ``(op name, kind, position, source line)``; of several new kinds, inf is named before NaN.
    ``made``: notes every floating value an op returned (:class:`Made`)."""

    def __init__(
        self, known: frozenset[str], made: Made | None = None, owned: dict[int, tuple[str, str]] | None = None
    ) -> None:
        super().__init__()
        self.known = known
        self.made = made
        self.owned = owned if owned is not None else {}  # the replay's parameters (:func:`replay_call`)
        self.hooks: dict[Any, Hook] = {}  # the call's forward hooks (:func:`hook_codes`)
        self.hook: Hook | None = None  # the one the producing op ran inside
        self.found: Found | None = None
        # the first op whose output holds -inf that only a -inf scalar argument brought in (masked_fill(m, -inf),
        # where(c, x, -inf), full(..., -inf)): an intended mask value, kept when no op produced a kind
        self.intended: Found | None = None
        self.index = 0
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
        self.index += 1
        if self.made is not None:
            self.made.op(out)
        # a parameter that already holds a kind the call's inputs did not: the op passes on what was written
        # into the weight before this forward (NaN from a NaN weight is no new kind of the op, yet the call made it)
        held: frozenset[str] = frozenset()
        for t in tensors:
            # a parameter's -inf may be a mask kept as a parameter (trainable or frozen): only NaN and +inf count
            if self.owned.get(id(t), ("",))[0] in ("param", "frozen"):
                held |= tensor_kinds(t) - {"neginf"}
        held = either_sign(held) - self.known if held else held
        for _, t in flatten(out, "out"):
            if not describable(t):
                continue
            kinds = tensor_kinds(t)
            if (
                self.intended is None
                and "neginf" in kinds & before
                and "neginf" not in self.known
                and not any("neginf" in tensor_kinds(x) for x in tensors)
            ):
                self.intended = (name, "neginf", self.index - 1, user_line())
            new = (kinds - either_sign(before) - self.known) or (kinds & held)
            if new:
                kind = next(k for k in _ORDER if k in new)
                self.found = (name, kind, self.index - 1, user_line())
                self.operands = named_operands(args, kwargs, snap, targets=name in TARGET_OPS)
                self.result = t
                self.hook = _running_hook(self.hooks)
                raise Stop
        return out


class Made:
    """Whether a replay made an *intermediate* floating value: one that is not a module call's output.

    Used as one of :func:`replay_call`'s modes, next to a :class:`FirstNonfinite` holding it: every describable
    tensor an op returns is noted (a weak reference and its version counter, nothing kept alive), and global
    module forward (pre-)hooks, registered for the replay only, mark each noted value that is, unchanged (same
    object, same version), a value the trace records: ``2`` for the replayed call's own output, ``1`` for the
    output or a positional input of a module called inside it whose calls the trace records (``recorded``). A
    value still unmarked when the call that ran its op returns is an intermediate (``intermediate`` becomes True
    and noting stops). When the replayed call returns with no intermediate, ``plain`` is ``"own"`` (every value
    an op made is the call's output: a ReLU, a dropout, a Linear, an Identity) or ``"children"`` (some are a
    child call's output or input: a Sequential of those, a residual block whose sum goes into its ReLU).
    ``plain`` stays None when the replay stopped early or made an intermediate. An in-place op makes a new value
    (its version changed): ``h.mul_(c); h.tanh_()`` leaves the product an intermediate."""

    def __init__(self, recorded: Callable[[torch.nn.Module], bool] = lambda m: True) -> None:
        self.recorded = recorded  # whether a module's calls have their outputs recorded (only those count)
        self.order: list[list[Any]] = []  # [weak reference, version, mark] per value, in op order
        self.by_id: dict[int, list[list[Any]]] = {}
        self.starts: list[int] = []  # len(order) when each open module call began
        self.intermediate = False
        self.plain: str | None = None
        self.handles: list[Any] = []
        self.thread = threading.get_ident()  # module calls of other threads during the replay are not its own

    def op(self, out: Any) -> None:
        """Note the describable tensors of one op's output (called by :class:`FirstNonfinite`)."""
        if self.intermediate:
            return
        with torch._C.DisableTorchFunction():  # no tensor attribute read here is an op of the replay
            for _, t in flatten(out, "out"):
                if describable(t):
                    if (
                        t.is_inference()
                    ):  # no version counter (inference_mode): in-place changes cannot be told
                        self.intermediate = True  # apart, so the call is never passed over
                        self.order, self.by_id = [], {}
                        return
                    entry = [weakref.ref(t), t._version, 0]
                    self.order.append(entry)
                    self.by_id.setdefault(id(t), []).append(entry)

    def _pre(self, module: torch.nn.Module, args: Any) -> None:
        if threading.get_ident() != self.thread:
            return
        if self.starts and not self.intermediate and self.recorded(module):
            self._mark(args, 1)  # a recorded child's positional inputs are recorded values too
        self.starts.append(len(self.order))

    def _mark(self, tensors: Any, mark: int) -> None:
        with torch._C.DisableTorchFunction():
            for _, t in flatten(tensors, "t"):
                for entry in self.by_id.get(id(t), ()):
                    if entry[0]() is t and not t.is_inference() and entry[1] == t._version:
                        entry[2] = max(entry[2], mark)

    def _post(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        if not self.starts or threading.get_ident() != self.thread:
            return
        start = self.starts.pop()
        if self.intermediate:
            return
        mark = 1 if self.starts else 2
        if mark == 2 or self.recorded(module):  # an unrecorded child's output is no recorded value
            self._mark(output, mark)
        if any(entry[2] == 0 for entry in self.order[start:]):
            self.intermediate = True
            self.order, self.by_id = [], {}
        elif not self.starts:
            self.plain = "children" if any(entry[2] == 1 for entry in self.order) else "own"

    def __enter__(self) -> Made:
        self.thread = threading.get_ident()
        self.handles = [
            _module_hooks.register_module_forward_pre_hook(self._pre),
            _module_hooks.register_module_forward_hook(self._post),
        ]
        return self

    def __exit__(self, *exc: object) -> None:
        for h in self.handles:
            h.remove()
        self.handles = []
        self.order, self.by_id, self.starts = [], {}, []


class CastWatch(TorchDispatchMode):
    """The dispatch-level half of the drill-down: autocast casts a float32 weight to float16 below
    ``__torch_function__`` (``linear`` is one op there), as ``aten._to_copy``. A cast whose output holds a
    kind that its input and the call's inputs (``known``) did not is the producing op: ``found`` becomes
    ``(CAST_OP, kind, -1, None)`` (inf before NaN) and the replay stops. Every other aten op is passed through."""

    def __init__(self, known: frozenset[str]) -> None:
        super().__init__()
        self.known = known
        self.found: Found | None = None
        self.operands: list[tuple[str, Any]] = []
        self.result: torch.Tensor | None = None

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if func is torch.ops.aten._to_copy.default and args and describable(args[0]) and describable(out):
            new = tensor_kinds(out) - tensor_kinds(args[0]) - self.known
            if new:
                self.found = (CAST_OP, next(k for k in _ORDER if k in new), -1, None)
                self.operands, self.result = [("input", args[0])], out
                raise Stop
        return out


class Substitute(TorchFunctionMode):
    """Replays a forward with the non-finite elements of the output of op number ``at`` (the position
    :class:`FirstNonfinite` counted) replaced by ``times`` × the output dtype's max (0, the max, minus it)."""

    def __init__(self, at: int, times: float) -> None:
        super().__init__()
        self.at = at
        self.times = times
        self.index = 0

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        self.index += 1
        if self.index - 1 != self.at or not (isinstance(out, torch.Tensor) and describable(out)):
            return out
        value = self.times * float(torch.finfo(out.dtype).max)
        return torch.where(torch.isfinite(out), out, torch.full_like(out, value))


# (module, class name) of the wrappers whose forward issues collectives: FSDP2, FSDP1, DDP (its buffer broadcast)
_COLLECTIVE_WRAPPERS = (
    ("torch.distributed.fsdp", "FSDPModule"),
    ("torch.distributed.fsdp", "FullyShardedDataParallel"),
    ("torch.nn.parallel", "DistributedDataParallel"),
)


def issues_collectives(module: torch.nn.Module) -> bool:
    """Whether running ``module`` may issue a collective in a process group of several ranks: it is, or holds, an
    FSDP (1 or 2) or DDP module. A replay runs on one rank only, so its collective would wait for ranks that never
    join it. Only classes already imported are looked for (no FSDP module exists before its package is)."""
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return False
    kinds = tuple(
        c
        for c in (getattr(sys.modules.get(m), name, None) for m, name in _COLLECTIVE_WRAPPERS)
        if isinstance(c, type)
    )
    return bool(kinds) and any(isinstance(m, kinds) for m in module.modules())


class NoCollectives(TorchFunctionMode):
    """Stops a replay at a ``torch.distributed`` function (a collective of a tensor-parallel layer): it would wait
    for ranks that do not replay. Used only in a process group of several ranks."""

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if str(getattr(func, "__module__", "") or "").startswith("torch.distributed"):
            raise Stop
        return func(*args, **(kwargs or {}))


def replay_call(
    module: torch.nn.Module,
    args: Any,
    kwargs: Any,
    *modes: Any,
    owned: dict[int, tuple[str, str]] | None = None,
) -> Any:
    """Run ``module`` on copies of ``args``/``kwargs`` and of its buffers (``torch.func.functional_call``) under
    ``modes``, with autograd off, the CPU RNG state forked (Python's and NumPy's too) and the plain Python
    attributes of its submodules set back afterwards (:func:`nantrace._tree.restore_plain`: a call counter is
    not moved on by the replay); the call's output, or None when a mode stopped it or it raised (best effort: a
    replay never raises). In a process group of several ranks a call that may
    issue a collective is not replayed (:func:`issues_collectives`, :class:`NoCollectives`): the other ranks
    would never join it. ``owned``, when given, is filled before the modes run with ``id(tensor) -> (field,
    name)`` for the tensors the replay's module reads as its parameters and buffers (their names in
    ``named_parameters()``/``named_buffers()``): ``field`` is ``"param"`` for a parameter that requires grad,
    ``"frozen"`` for one that does not (a frozen weight, or a mask kept as a parameter), ``"buffer"``."""
    if issues_collectives(module):
        return None
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        modes = (NoCollectives(), *modes)
    buffers = {name: b.detach().clone() for name, b in module.named_buffers()}
    # detached parameters: autocast caches its casts of leaf parameters that require grad, and a cached
    # cast is not run again, so the replay would not see autocast cast a weight beyond the dtype's max
    buffers.update((name, p.detach()) for name, p in module.named_parameters())
    if owned is not None:
        params = dict(module.named_parameters())
        for n, t in buffers.items():
            p = params.get(n)
            owned[id(t)] = ("buffer" if p is None else "param" if p.requires_grad else "frozen", n)
    attributes = plain_state(module)  # a forward that counts its calls must not count the replay
    try:
        with torch.random.fork_rng(devices=[]), host_rngs_kept(), torch.no_grad():
            args_c, kwargs_c = clone_tree(args, strict=True), clone_tree(kwargs, strict=True)
            with ExitStack() as stack:
                for m in modes:
                    stack.enter_context(m)
                return torch.func.functional_call(
                    module, buffers, tuple(args_c), dict(kwargs_c), strict=False
                )
    except Exception:
        return None
    finally:
        with contextlib.suppress(Exception):  # an attribute that refuses to be set back: never raised
            restore_plain(module, attributes)


def _same(a: Any, b: Any) -> bool:
    ta = [t for _, t in flatten(a, "o") if describable(t)]
    tb = [t for _, t in flatten(b, "o") if describable(t)]
    if len(ta) != len(tb):
        return False
    for x, y in zip(ta, tb, strict=True):
        if x.shape != y.shape or not bool(((x == y) | (torch.isnan(x) & torch.isnan(y))).all()):
            return False
    return True


def reaches_output(module: torch.nn.Module, args: Any, kwargs: Any, at: int) -> bool:
    """True when the non-finite value made by op number ``at`` of the call changes the call's output: replayed
    with that op's non-finite elements set to 0, to its dtype's max and to minus its max, some output differs
    from the call's own. False when every replay gives the same output (a selection discarded the value) or
    when the call cannot be replayed."""
    base = replay_call(module, args, kwargs)
    if base is None:
        return False
    for times in (0.0, 1.0, -1.0):
        other = replay_call(module, args, kwargs, Substitute(at, times))
        if other is not None and not _same(base, other):
            return True
    return False


def _host_stats(
    items: list[tuple[str, Any]], stats_of: Callable[[Any], Any]
) -> list[tuple[torch.Tensor, Any]] | None:
    """``(tensor, host statistics)`` of the describable tensors of ``items``; None when any statistic is missing
    (not recorded, or still a device tensor)."""
    out = []
    for _, t in items:
        if not describable(t):
            continue
        s = stats_of(t)
        if s is None or isinstance(s, torch.Tensor):
            return None
        out.append((t, s))
    return out


_LOG2_MAX: dict[torch.dtype, float] = {}


def headroom_fraction(hits: list[tuple[torch.Tensor, Any]] | None) -> float | None:
    """The largest ``log2(absmax) / log2(dtype max)`` over the tensors of ``hits`` (``(tensor, cache entry)``,
    the entry's index 2 its host statistics, whose index 2 is ``absmax``): above 1/2 squaring the tensor
    overflows its dtype, above 1/3 cubing it does. None when ``hits`` is None (a statistic is missing)."""
    if hits is None:
        return None
    best = 0.0
    for t, hit in hits:
        absmax = float(hit[2][2])
        if absmax > 1.0 and math.isfinite(absmax):
            top = _LOG2_MAX.get(t.dtype)
            if top is None:
                top = _LOG2_MAX[t.dtype] = math.log2(float(torch.finfo(t.dtype).max))
            best = max(best, math.log2(absmax) / top)
    return best


def drill_call(
    module: torch.nn.Module,
    args: Any,
    kwargs: Any,
    known: frozenset[str],
    *,
    transient: bool = False,
    made: Made | None = None,
) -> tuple[str, str, str, str | None, bool] | None:
    """``(op, kind, operand facts, source line, reaches)`` of the first op of the call that made a kind not in
    ``known`` (:class:`FirstNonfinite`, with :class:`CastWatch` for dtype casts), or None. The operand facts are
    the JSON text of :func:`nantrace._opfacts.operand_facts` (``""`` when they could not be read). ``transient``:
    the call's output was finite, so ``reaches`` says whether the op's value changed it
    (:func:`reaches_output`); else it is True. ``made``: notes whether the replay made an intermediate value
    (:class:`Made`, read by :meth:`Suspects.learn`)."""
    owned: dict[int, tuple[str, str]] = {}
    mode, cast = FirstNonfinite(known, made, owned), CastWatch(known)
    with contextlib.suppress(Exception):  # best effort: without them the op is named, not its hook
        mode.hooks = hook_codes(module)
    # autocast's casts are the only ops CastWatch looks for, and the drill-down runs on CPU tensors only: without
    # CPU autocast the dispatch-level mode is left out (it costs Python on every aten op of the replay)
    modes = [mode, *([made] if made is not None else [])]
    replay_call(
        module, args, kwargs, *modes, *([cast] if torch.is_autocast_enabled("cpu") else []), owned=owned
    )
    found = cast.found or mode.found
    if found is None:
        if transient or mode.intended is None:
            return None
        # the output's -inf came only from -inf scalars: an intended mask value (locator rule 3), not produced
        op, _, _, line = mode.intended
        return op, MASK_KIND, "", line, True
    op, kind, at, line = found
    watch = cast if cast.found else mode
    try:
        facts = operand_facts(
            watch.operands, watch.result, mode.vanished, owned, mode.hook if watch is mode else None
        )
    except Exception:  # best effort, like the replay itself: the op is still named
        facts = ""
    # nothing of the replay is kept once its facts are numbers
    mode.operands, mode.result, cast.operands, cast.result = [], None, [], None
    reaches = reaches_output(module, args, kwargs, at) if transient and at >= 0 else True
    return op, kind, facts, line, reaches


class Suspects:
    """The cheap signals that a finite module call may hide a transient inf, read from the statistics already
    computed (none where they were not recorded). Each signal counts only at a new high for the module, so a
    module is replayed a few times in a run, not at every step:

    * its output holds a larger fraction of zeros than its inputs (the silent zeros of ``rsqrt(inf) = 0``,
      ``x / inf = 0``, ``exp(-inf) = 0``);
    * an input's absmax is beyond the cube root of its dtype's max (40.3 in float16): cubing it, as
      tanh-GELU's ``pow(x, 3)`` does, overflows inside the call, as squaring it beyond 256 does (a norm, a
      variance, ``|a|²·|b|²``), and the backward of such an op (``3·x²`` times a saturated zero gradient) can
      make NaN. After a replay the module waits for its input's absmax to double (in float16) before the next.

    A signal is passed over (:meth:`skips`) for a call of a module whose earlier replay, with the same inputs'
    structure (:func:`call_key`), made no intermediate floating value (:class:`Made`): every value an op of the
    call made was the call's own output (``"own"``: a ReLU, a dropout, a GELU, a Linear, an Identity), or the
    output or input of a module it called (``"children"``: a Sequential of such, a residual block). A transient
    inf is a value an op made that the call turned finite, so it needs an intermediate: the drill-down names an
    op whose output holds a kind its inputs did not, and here every op output is a recorded value. ``"own"``
    holds when the call's output is finite (the transient path's premise); ``"children"`` also needs every kind recorded in the
    micro-step to be one of the call's input kinds (no child output held a kind that a replay would call new).
    The rule assumes a module runs the same ops for calls with the same key (input paths, shapes, dtypes,
    requires_grad, scalar arguments, training mode, grad mode); a key whose replay ever made an intermediate is
    never passed over. Under CPU autocast nothing is passed over (a cast inside one op is an intermediate that
    :class:`CastWatch` names).

    What a replay learned is shared by the *leaf* modules that run the same code (:func:`leaf_key`: no child
    module, the same class, plain attributes, parameter and buffer structure, hooks, training and grad mode and
    input structure), so of twelve identical dropouts one is replayed: a verdict is stored under the call's own
    key and its leaf key, a call is passed over when either holds a plain verdict and neither was ever mixed.
    Containers keep per-instance keys (their children may differ). A leaf passed over this way still had its own
    signal at a new high (``zero_high`` and ``reach_high`` stay per module) and a finite output.

    The zeros signal of a call whose output tensor *is* (same object, same version) the output of a call made
    inside it counts what reached that inner call, not the output's zeros (``upstream``, kept by the recorder
    per micro-step as statistics event ids, no tensor): the replay names an op whose output holds a kind its
    inputs did not, and zeros made by an inner call are judged at that call, by its own signal. The walk goes
    back from the output through each inner call to its one tensor input while that input is itself such an
    output (a Sequential of Linear, ReLU, Dropout reaches its own input: no signal), and stops at a value the
    call's own code made (``h · rsqrt(sum(h²))`` before a Dropout: its zeros are the signal) or at its input. An
    inner call with several tensor inputs, one that changed its input in place, one not recorded or one whose
    output was not finite ends the walk at its output (its own zeros count, as without the rule): counted over
    several inputs, zeros made upstream would be diluted by the other inputs' elements. The absmax signal is
    unchanged."""

    def __init__(self) -> None:
        self.zero_high: dict[int, float] = {}  # per module: the largest fraction of zeros its outputs held
        self.reach_high: dict[int, float] = {}  # per module: the largest log2(input absmax) / log2(dtype max)
        self.plain: dict[Any, str] = {}  # call key -> "own" / "children": a replay made no intermediate value
        self.mixed: set[Any] = set()  # call keys whose replay made an intermediate value: never passed over

    def check(self, mcode: int, out_zeros: float | None, in_zeros: float | None, reach: float | None) -> bool:
        """True when a signal is at a new high for module ``mcode``: ``out_zeros``, the fraction of zeros its
        outputs held (for an output that is, unchanged, a child call's output, what reached that child);
        ``in_zeros``, that of its inputs; ``reach``, the inputs' :func:`headroom_fraction`. None: not known (a
        statistic not recorded, or not on the host)."""
        zeros_high = self.zero_high.get(mcode, 0.0)
        hit = (
            out_zeros is not None and in_zeros is not None and out_zeros > in_zeros and out_zeros > zeros_high
        )
        if out_zeros is not None:
            self.zero_high[mcode] = max(zeros_high, out_zeros)
        if reach is not None and reach > self.reach_high.get(mcode, _REACH):
            # the next replay of this module waits for its input absmax to double again (1/16 of float16's
            # 16 exponent bits of range), so a steadily growing activation costs a replay per doubling only
            self.reach_high[mcode] = reach + 1.0 / 16
            hit = True
        return hit

    def skips(
        self,
        key: Any,
        output: Any,
        stats_of: Callable[[Any], Any],
        children_clean: bool,
        leaf: Any = None,
    ) -> bool:
        """True when a call with ``key`` (or with the ``leaf`` key, :func:`leaf_key`: another leaf module running
        the same code) cannot hide a transient inf: an earlier replay with that key made no intermediate value
        and neither key was ever seen with one, the call's outputs have host statistics (their finiteness was
        read, not assumed), and, for ``"children"``, ``children_clean``: no kind was recorded in the micro-step
        beyond the call's input kinds and no record was dropped."""
        keys = [k for k in (key, leaf) if k is not None]
        if not keys or any(k in self.mixed for k in keys):
            return False
        plain = next((self.plain[k] for k in keys if k in self.plain), None)
        if plain is None or (plain == "children" and not children_clean):
            return False
        return _host_stats(list(flatten(output, "o")), stats_of) is not None

    def learn(self, key: Any, made: Made, leaf: Any = None) -> None:
        """Remember what the replay of a call with ``key`` (and ``leaf``, :func:`leaf_key`) showed
        (:class:`Made`): an intermediate value marks the keys for good; a replay that ran to its end without one
        makes them plain."""
        for k in (key, leaf):
            if k is None:
                continue
            if made.intermediate:
                self.mixed.add(k)
                self.plain.pop(k, None)
            elif made.plain is not None and k not in self.mixed:
                self.plain[k] = made.plain


_SCALARS = (bool, int, float, str, type(None))


def call_key(mcode: int, module: torch.nn.Module, args: Any, kwargs: Any) -> tuple[Any, ...] | None:
    """What a module's ops are assumed to depend on, for :meth:`Suspects.skips`: the module, its training mode,
    the grad mode, each input tensor's path, shape, dtype and requires_grad, and the scalar arguments (a
    non-scalar, non-tensor argument by its type). None under CPU autocast (never passed over)."""
    if torch.is_autocast_enabled("cpu"):
        return None
    try:
        tensors = tuple(
            (path, t.shape, t.dtype, t.requires_grad)
            for path, t in [*flatten(args, "input"), *flatten(kwargs, "input")]
        )
        key = (mcode, module.training, torch.is_grad_enabled(), tensors, _scalar_args(args, kwargs))
        hash(key)
    except Exception:  # best effort: a call without a key is never passed over
        return None
    return key


def _scalar_args(args: Any, kwargs: Any) -> tuple[Any, ...]:
    """The non-tensor arguments of a call: scalars by value, anything else by its type."""
    named = [*enumerate(args), *sorted(kwargs.items())]
    return tuple(
        (k, v if isinstance(v, _SCALARS) else type(v)) for k, v in named if not isinstance(v, torch.Tensor)
    )


OWN_HOOK = "_nantrace_recording_hook"  # set on nantrace's own module hooks: they return at once in a replay

# nn.Module's own bookkeeping in a module's __dict__, handled one by one in leaf_key: the parameter and buffer
# tables by structure, the forward and backward hook tables by what each hook runs, the child table must be
# empty; what only state_dict/load_state_dict read is left out (it changes no op of a forward). An attribute a
# newer torch adds that is not named here falls to the general rule (scalars by value, others by identity).
_STRUCTURE = frozenset({"_parameters", "_buffers"})
_HOOK_TABLES = (
    ("_forward_pre_hooks", ("_forward_pre_hooks_with_kwargs",)),
    ("_forward_hooks", ("_forward_hooks_with_kwargs", "_forward_hooks_always_called")),
    ("_backward_pre_hooks", ()),
    ("_backward_hooks", ()),
)
_HOOK_STATE = frozenset(name for table, flags in _HOOK_TABLES for name in (table, *flags))
_NOT_FORWARD = frozenset(
    {
        "_non_persistent_buffers_set",
        "_state_dict_hooks",
        "_state_dict_pre_hooks",
        "_load_state_dict_pre_hooks",
        "_load_state_dict_post_hooks",
    }
)
_VALUES = (bool, int, float, complex, str, bytes, type(None), torch.dtype, torch.device, torch.layout)


class _Ident:
    """An attribute compared by identity and held weakly: equal only to another ``_Ident`` of the same live
    object (an object that died, and a new one that got its id, are not equal)."""

    __slots__ = ("oid", "ref")

    def __init__(self, obj: Any) -> None:
        self.oid = id(obj)
        self.ref = weakref.ref(obj)  # TypeError for an object without weak references: no key

    def __hash__(self) -> int:
        return self.oid

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, _Ident) or other.oid != self.oid:
            return False
        obj = self.ref()
        return obj is not None and obj is other.ref()


def _plain(value: Any, depth: int = 0) -> Any:
    """A hashable stand-in for one attribute value: scalars (and dtypes, devices) by type and value, tuples and
    lists of such by their items, anything else by identity (:class:`_Ident`; raises when it has no weak
    references)."""
    if isinstance(value, _VALUES):
        return (type(value), value)
    if isinstance(value, (tuple, list)) and depth < 4:
        return (type(value), tuple(_plain(v, depth + 1) for v in value))
    return _Ident(value)


def _hook_code(hook: Any) -> Any:
    """What one hook runs: nantrace's own recording hooks (``OWN_HOOK``, they return at once during a replay) as
    one marker; a function by its code object and the values it closed over (:func:`_plain`); a bound method by
    its function's code and its object's identity; anything else by identity."""
    if getattr(hook, OWN_HOOK, False):
        return OWN_HOOK
    for _ in range(8):  # functools.wraps chains (torch.compiler.disable's wrapper)
        inner = getattr(hook, "__wrapped__", None)
        if inner is None:
            break
        hook = inner
    func = getattr(hook, "__func__", None)
    if func is not None:  # a bound method
        return (_hook_code(func), _Ident(hook.__self__))
    code = getattr(hook, "__code__", None)
    if code is None:
        return _Ident(hook)
    cells = tuple(_plain(c.cell_contents) for c in (hook.__closure__ or ()))
    defaults = tuple(_plain(d) for d in (hook.__defaults__ or ()))
    return (code, cells, defaults)


def _tensor_table(table: dict[str, Any]) -> tuple[Any, ...]:
    """Parameters or buffers by structure: name, type, shape, dtype, device, layout, requires_grad."""
    return tuple(
        (name, None)
        if t is None
        else (name, type(t), tuple(t.shape), t.dtype, t.device, t.layout, t.requires_grad)
        for name, t in table.items()
    )


def _hooks_of(state: dict[str, Any]) -> tuple[Any, ...]:
    """Each hook table of a module, in order, as what each hook runs and its flags (with kwargs, always
    called)."""
    out = []
    for table, flags in _HOOK_TABLES:
        hooks = state.get(table) or {}
        marks = [state.get(f) or {} for f in flags]
        out.append(tuple((_hook_code(h), *(hid in m for m in marks)) for hid, h in hooks.items()))
    return tuple(out)


def leaf_key(module: torch.nn.Module, args: Any, kwargs: Any) -> tuple[Any, ...] | None:
    """The key :class:`Suspects` shares between instances of a leaf module that run the same code: what a
    replay of one of them learned (:class:`Made`) holds for all. A leaf (no child module) of the same class, with
    the same plain attributes (``p``, ``eps``, ``inplace``: scalars and tuples of them by value, any other
    attribute by identity), the same parameter and buffer structure (names, types, shapes, dtypes, devices,
    requires_grad), the same forward and backward hooks (by what they run), training mode, grad mode and input
    structure (each tensor's path, shape, strides, dtype, device, requires_grad, and the scalar arguments) runs
    the same ops as another. None (nothing shared) for a container, a module with its own ``forward`` in its
    ``__dict__``, under CPU autocast, or when an attribute cannot be compared (no weak reference)."""
    if torch.is_autocast_enabled("cpu"):
        return None
    try:
        state = module.__dict__
        if state.get("_modules") or "forward" in state:
            return None
        attrs = tuple(
            (name, _plain(value))
            for name, value in sorted(state.items())
            if name not in _STRUCTURE
            and name not in _HOOK_STATE
            and name not in _NOT_FORWARD
            and name != "_modules"
        )
        tensors = tuple(
            (path, t.shape, t.stride(), t.dtype, t.device, t.requires_grad)
            for path, t in [*flatten(args, "input"), *flatten(kwargs, "input")]
        )
        key = (
            "leaf",
            type(module),
            attrs,
            _tensor_table(state.get("_parameters") or {}),
            _tensor_table(state.get("_buffers") or {}),
            _hooks_of(state),
            module.training,
            torch.is_grad_enabled(),
            tensors,
            _scalar_args(args, kwargs),
        )
        hash(key)
    except Exception:  # best effort: a call without a leaf key shares nothing
        return None
    return key


ZeroCounts = tuple[int, int]  # (zero elements, elements) over some tensors
