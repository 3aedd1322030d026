"""The hunt: run one step with every aten op checked, and name the first op that made a non-finite value.

:func:`hunt` runs a callable (typically one training step) under a ``TorchDispatchMode``, which sees every aten
op that runs, in the forward and in the backward (autograd's engine runs the backward formulas' ops through the
mode too). For each op it compares the non-finite kinds (NaN, +inf, -inf) of the op's inputs, read *before*
the op runs (so in-place ops count), with those of its outputs. The first op whose outputs hold a wanted kind
that none of its inputs held is the culprit.

Context for that op comes from three places:

* **module**: global forward pre-/post-hooks (``torch.nn.modules.module.register_module_forward_pre_hook``)
  keep a stack of the ``nn.Module`` calls in progress. Qualified names come from the root (as in
  :func:`nantrace.trace`: ``model.named_modules()`` with wrapper prefixes dropped; the root is ``""``; which
  module is the root: :func:`hunt`).
* **source line**: the innermost stack frame outside torch and nantrace (nantrace's ``examples`` count as user
  code), i.e. the line of the user's code that called the op.
* **backward ops**: a ``TorchFunctionMode`` (above autograd) tags each autograd Node that a forward torch call
  created with its module and source line (in ``Node.metadata``). In backward,
  ``torch._C._current_autograd_node()`` names the Node whose formula is running, so a backward op is reported
  with the forward module and line it belongs to. Nodes that mode never sees (a custom
  ``torch.autograd.Function``'s, made by ``apply``) get the module from the module's forward hook; the ops of
  a Python ``backward`` are reported at the line of that ``backward`` (the stack walk stops at autograd's
  engine entry). A reentrant checkpoint's forward, recomputed inside backward, is tagged there too.

Nothing here is used by :func:`nantrace.trace`; the hunt is slow by design (see :func:`hunt`).
"""

from __future__ import annotations

import inspect
import linecache
import math
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from types import FrameType
from typing import Any, cast

import torch
import torch.optim.optimizer as _optim
from torch import nn
from torch.nn.modules import module as _nn_module
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from ._fmt import module_label, num
from ._hooks import in_backward
from ._naming import module_names  # the same names as nantrace.trace()
from ._repro import REPRO_NAMES, Repro
from ._schema import DType, wanted_kinds
from ._stats import describable, either_sign, op_input_kinds, stats_device, stats_host
from ._stats import tensor_kinds as _kinds

__all__ = ["Culprit", "hunt"]

_META_KEY = "nantrace"
_WORDS = {"nan": "NaN", "posinf": "+inf", "neginf": "-inf"}
_ORDER = ("posinf", "neginf", "nan")  # inf before NaN: NaN follows from inf (inf-inf, 0*inf)
# Ops whose output is uninitialised memory: it may hold any bit pattern, NaN included, and is not a result.
# Matched on the op's base name, so every overload counts (``aten::empty.memory_format``, ``empty.out``...).
_UNINITIALISED = frozenset(
    {"aten::empty", "aten::empty_like", "aten::empty_strided", "aten::new_empty", "aten::new_empty_strided"}
)


def uninitialised(name: str) -> bool:
    """True for an ``empty``-family op (any overload): ``aten::empty.memory_format``, ``aten::new_empty``..."""
    return name.split(".", 1)[0] in _UNINITIALISED


_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
_NANTRACE_DIR = os.path.dirname(__file__) + os.sep
_EXAMPLES_DIR = os.path.join(_NANTRACE_DIR, "examples") + os.sep


@dataclass(frozen=True)
class Culprit:
    """The first aten op that produced a non-finite value, found by :func:`hunt`.

    Attributes:
        op: the aten op with its overload, e.g. ``"aten::pow.Tensor_Scalar"``, ``"aten::addmm"`` (the
            ``default`` overload is left out).
        module: qualified name of the innermost ``nn.Module`` whose forward was running (``""`` is the root);
            for a backward op, the module whose forward created the autograd Node the op belongs to (for
            gradient accumulation into a parameter, the parameter's owner). ``None`` when the op ran outside
            any module (a loss computed outside the model, ``optimizer.step()``).
        module_type: that module's class name (``"Linear"``), or ``None``.
        phase: ``"forward"`` (any op outside autograd's backward and ``optimizer.step()``, including a loss
            computed outside the model), ``"backward"`` or ``"optimizer"``.
        kind: ``"inf"`` (+inf or -inf) or ``"nan"``, as in :class:`nantrace.Overflow`.
        value: the exact kind: ``"posinf"``, ``"neginf"`` or ``"nan"``.
        dtype: dtype name of the output holding it (``"float16"``; compares equal to ``torch.float16`` too).
        source: ``"file.py:LINE"`` (file base name) of the user's code that called the op; for a backward op,
            the forward line that created its Node, except: an op run by a Python ``backward`` (a custom
            ``torch.autograd.Function``) gives the line of that ``backward`` that ran it, and gradient
            accumulation into a parameter's ``.grad`` (AccumulateGrad) gives the line that called
            ``backward()`` (CPU; ``None`` on an accelerator, whose backward runs on the engine's own thread).
            ``None`` when unknown (e.g. a Node created by a custom ``Function.apply``: its module is known,
            the forward line is not). ``source_role`` says which of these it is.
        source_role: ``"forward"`` (the op's own line, or for a backward op the forward line of its Node),
            ``"python_backward"`` (a line of a Python ``backward``) or ``"backward_call"`` (the
            ``backward()`` call).
        filename, lineno: the full path and line number behind ``source`` (``None`` when unknown).
        code: the text of that source line, stripped (``""`` when the file cannot be read).
        input_absmax: largest finite ``|x|`` over the op's floating-point tensor inputs (NaN when none).
        input_absmin: smallest finite non-zero ``|x|`` over them (NaN when none).
        input_kinds: the non-finite kinds (``"nan"``, ``"posinf"``, ``"neginf"``) the op's inputs already held
            (e.g. ``{"posinf"}`` for ``inf / inf`` = NaN); non-finite scalar arguments count.
        internal: ``True`` when the module's output did not hold the culprit's kind (the value stayed inside
            the module: "internal: output was finite", or it became another kind); ``False`` when it reached
            the output; ``None`` for backward/optimizer ops and ops outside any module.
        output_kinds: the non-finite kinds (``"nan"``, ``"posinf"``, ``"neginf"``) the module's output held
            (empty when it was finite; empty too when ``internal`` is ``None``).
        ops_checked: how many ops had been checked when the culprit ran (the culprit is number
            ``ops_checked``, counted from 1).
    """

    op: str
    module: str | None
    module_type: str | None
    phase: str
    kind: str
    value: str
    dtype: str
    source: str | None
    filename: str | None = field(default=None, repr=False)
    lineno: int | None = field(default=None, repr=False)
    code: str = field(default="", repr=False)
    input_absmax: float = field(default=math.nan, repr=False, compare=False)
    input_absmin: float = field(default=math.nan, repr=False, compare=False)
    internal: bool | None = None
    output_kinds: frozenset[str] = field(default=frozenset(), repr=False)
    ops_checked: int = field(default=0, repr=False, compare=False)
    source_role: str = field(default="forward", repr=False)
    input_kinds: frozenset[str] = field(default=frozenset(), repr=False)

    def __str__(self) -> str:
        name = module_label(self.module or "") + (f" ({self.module_type})" if self.module_type else "")
        line = f"{self.source}: `{self.code}`" if self.code else (self.source or "")
        if self.phase == "backward":
            head = (
                f"{self.op} in the backward of {name}"
                if self.module is not None
                else f"{self.op} in backward"
            )
            if line:
                head += {
                    "forward": f", for the forward line {line}",
                    "python_backward": f", run by the Python backward at {line}",
                    "backward_call": f", accumulating into a parameter's .grad in the backward() at {line}",
                }[self.source_role]
        else:
            where = f"in {name}" if self.module is not None else "outside any module"
            head = f"{self.op} {where}, {self.phase}" + (f", at {line}" if line else "")
        w = _WORDS[self.value]
        held = ", ".join(_WORDS[k] for k in _ORDER if k in self.input_kinds)
        made = (
            f": made {w} ({self.dtype}) from inputs holding no {w}"
            + (f" but {held}" if held else "")
            + f" (finite input absmax {num(self.input_absmax)}, smallest non-zero |x| {num(self.input_absmin)})."
        )
        if self.internal is True:
            if self.output_kinds:
                held = ", ".join(_WORDS[k] for k in _ORDER if k in self.output_kinds)
                tail = f" internal: the module's output held {held} instead, so the module boundary hid it."
            else:
                tail = " internal: output was finite, so the module boundary hid it."
        elif self.internal is False:
            tail = " It reached the module's output."
        else:
            tail = ""
        return head + made + tail

    def to_dict(self) -> dict[str, Any]:
        """The fields as a plain dict (``output_kinds``, ``input_kinds`` as sorted lists)."""
        out = {k: getattr(self, k) for k in self.__dataclass_fields__}
        out["dtype"] = str(self.dtype)
        out["output_kinds"] = sorted(self.output_kinds)
        out["input_kinds"] = sorted(self.input_kinds)
        return out


def _has_params(m: nn.Module) -> bool:
    return next(iter(m.parameters()), None) is not None


def op_name(func: Any) -> str:
    """``aten::pow.Tensor_Scalar`` for an ``OpOverload`` (the ``default`` overload is left out)."""
    schema = getattr(func, "_schema", None)
    if schema is None:
        return str(func)
    over = getattr(func, "_overloadname", "") or ""
    return schema.name if over in ("", "default") else f"{schema.name}.{over}"


_BOUNDARIES: set[Any] = set()  # code objects of hunt() and Repro.run(): nothing outside them called the op


def user_frame(frame: FrameType | None) -> FrameType | None:
    """The innermost frame from ``frame`` outward whose file is outside torch and nantrace (nantrace's
    ``examples`` package counts as user code); ``None`` when the walk reaches :func:`hunt` or
    :meth:`nantrace.Repro.run` first (the op ran in torch's own code, e.g. ``hunt(nn.Linear(...), x)``)."""
    if not _BOUNDARIES:
        _BOUNDARIES.update({hunt.__code__, Repro.run.__code__})
    while frame is not None:
        if frame.f_code in _BOUNDARIES:
            return None
        if not _torch_or_own(frame.f_code.co_filename):
            return frame
        frame = frame.f_back
    return None


def _torch_or_own(fname: str) -> bool:
    own = fname.startswith(_NANTRACE_DIR) and not fname.startswith(_EXAMPLES_DIR)
    return fname.startswith(_TORCH_DIR) or own or fname.startswith("<frozen")


def backward_frames(frame: FrameType | None) -> tuple[FrameType | None, FrameType | None]:
    """For an op running in autograd's backward: (the user frame of a Python ``backward`` it ran in, e.g. a
    custom ``torch.autograd.Function``'s, else ``None``; the user frame that called ``backward()``, else
    ``None``). The engine's entry (``_engine_run_backward``) separates the two: a user frame inside it is a
    Python backward, the first one outside it called ``backward()``. On an accelerator the engine runs the
    backward on its own thread, whose stack does not reach the ``backward()`` call (``None`` then)."""
    inner: FrameType | None = None
    while frame is not None:
        code = frame.f_code
        if code.co_name == "_engine_run_backward" and code.co_filename.startswith(_TORCH_DIR):
            return inner, user_frame(frame.f_back)
        if inner is None and not _torch_or_own(code.co_filename):
            inner = frame
        frame = frame.f_back
    return inner, None


def kinds_of_tree(obj: Any) -> frozenset[str]:
    """Non-finite kinds of every describable tensor in ``obj`` (nested tuples/lists/dicts, pytree leaves)."""
    out: frozenset[str] = frozenset()
    for leaf in tree_leaves(obj):
        if isinstance(leaf, torch.Tensor) and describable(leaf) and leaf.device.type != "meta":
            out |= _kinds(leaf)
    return out


def _input_range(tensors: list[torch.Tensor]) -> tuple[float, float]:
    absmax, absmin = math.nan, math.nan
    for t in tensors:
        s = stats_host(t) if t.is_cpu else tuple(stats_device(t).tolist())
        if not math.isnan(s[2]):
            absmax = s[2] if math.isnan(absmax) else max(absmax, s[2])
        if not math.isnan(s[3]):
            absmin = s[3] if math.isnan(absmin) else min(absmin, s[3])
    return absmax, absmin


@dataclass
class _Found:
    op: str
    module: str | None
    module_type: str | None
    phase: str
    value: str
    dtype: str
    filename: str | None
    lineno: int | None
    absmax: float
    absmin: float
    index: int
    watch: tuple[int, int] | None  # (id of the module, depth in the call stack) whose output to check
    internal: bool | None = None
    output_kinds: frozenset[str] = frozenset()
    role: str = "forward"
    input_kinds: frozenset[str] = frozenset()


class _Hunter:
    """The state of one hunt: module stack, names, the modes and global hooks, and the culprit."""

    def __init__(self, wanted: tuple[str, ...], fn: Any = None) -> None:
        self.wanted = frozenset(wanted)
        self.stack: list[tuple[nn.Module, str, str]] = []
        self.names: dict[int, str] = {}
        self.param_owner: dict[int, tuple[str, str]] = {}
        self.found: _Found | None = None
        self.n_ops = 0
        self.in_optimizer = 0
        self.rooted = False  # the naming root has been called
        self.outside: dict[int, str] = {}  # names of modules outside the root's tree (<ClassName>...)
        self.fn: Any = fn
        self.first_top: str | None = None  # the first top-level module's name when it was not the root
        self.bw_modes: list[tuple[int, int, TorchFunctionMode]] = []  # (module id, depth, mode) in backward

    # ------------------------------------------------------------ module context
    def _name(self, m: nn.Module) -> str:
        name = self.names.get(id(m))
        if name is not None:
            return name

        # The root is the module passed as fn, else the first module *with parameters* called while no other
        # module runs (the rule of `nantrace run`); a Repro's module keeps its name in the traced model. Any
        # other module called outside the root's tree (a parameter-free preprocessing module before the model,
        # a loss module after it) is <ClassName>, and a later root renames those of its own tree.
        repro = REPRO_NAMES.get(m)
        root = not self.rooted and (
            repro is not None
            or m is self.fn
            or (not isinstance(self.fn, nn.Module) and not self.stack and _has_params(m))
        )
        if not root:
            name = self.outside.get(id(m))
            if name is not None:
                return name
            if not self.stack and self.first_top is None:
                self.first_top = f"<{type(m).__name__}>"
        base = (repro or "") if root else f"<{type(m).__name__}>"
        self.rooted = self.rooted or root
        for n, sub in module_names(m):
            full = ".".join(p for p in (base, n) if p)
            if root:
                self.names[id(sub)] = full
            else:
                self.outside.setdefault(id(sub), full)
            for p in sub.parameters(recurse=False):
                if root:
                    self.param_owner[id(p)] = (full, type(sub).__name__)
                else:
                    self.param_owner.setdefault(id(p), (full, type(sub).__name__))
        return self.names.get(id(m)) or self.outside.get(id(m), base)

    def pre(self, module: nn.Module, args: Any) -> None:
        self.stack.append((module, self._name(module), type(module).__name__))
        if (
            self.found is None
            and in_backward()
            and torch.is_grad_enabled()
            and not torch._C._is_torch_function_mode_enabled()
        ):
            # a forward recomputed inside backward (reentrant checkpoint): autograd's engine runs it without
            # the torch-function mode stack, so tag its Nodes with a mode entered for this module call
            mode = _TagMode(self)
            mode.__enter__()
            self.bw_modes.append((id(module), len(self.stack) - 1, mode))

    def post(self, module: nn.Module, args: Any, output: Any) -> None:
        for i in range(len(self.stack) - 1, -1, -1):
            if self.stack[i][0] is module:
                found = self.found
                if found is None and torch.is_grad_enabled():
                    _, name, mtype = self.stack[i]
                    self._tag_nodes(output, args, (name, mtype, None, None))
                if found is not None and found.watch == (id(module), i):
                    found.output_kinds = kinds_of_tree(output)
                    found.internal = found.value not in found.output_kinds
                    found.watch = None
                del self.stack[i:]
                self.exit_modes(i)
                return

    def exit_modes(self, depth: int = 0) -> None:
        """Exit the tag modes entered by :meth:`pre` for module calls at ``depth`` or deeper."""
        while self.bw_modes and self.bw_modes[-1][1] >= depth:
            self.bw_modes.pop()[2].__exit__(None, None, None)

    def context(self) -> tuple[str | None, str | None]:
        if not self.stack:
            return None, None
        _, name, mtype = self.stack[-1]
        return name, mtype

    # ------------------------------------------------------------ ops
    def check(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if self.found is not None or getattr(func, "is_view", False):
            return func(*args, **kwargs)
        name = op_name(func)
        if uninitialised(name):
            return func(*args, **kwargs)
        self.n_ops += 1
        # a non-finite scalar argument (masked_fill(-inf), full(-inf)) is intended, not produced
        tensors, before = op_input_kinds(args, kwargs)
        # an in-place/out= op overwrites an input: take the input range (for the report) before it runs
        mutable = getattr(getattr(func, "_schema", None), "is_mutable", False)
        ranged = _input_range(tensors) if mutable else None
        out = func(*args, **kwargs)
        for leaf in tree_leaves(out):
            if not (isinstance(leaf, torch.Tensor) and describable(leaf) and leaf.device.type != "meta"):
                continue
            new = (_kinds(leaf) & self.wanted) - either_sign(before)  # a sign flip of an inf is not made
            if new:
                value = next(k for k in _ORDER if k in new)
                self._record(name, value, leaf.dtype, ranged or _input_range(tensors), before)
                break
        return out

    def _record(
        self, op: str, value: str, dtype: torch.dtype, ranged: tuple[float, float], before: frozenset[str]
    ) -> None:
        node = torch._C._current_autograd_node()
        filename: str | None = None
        lineno: int | None = None
        watch: tuple[int, int] | None = None
        role = "forward"
        if node is not None or in_backward():
            phase = "backward"
            module, mtype = None, None
            meta = getattr(node, "metadata", None) if node is not None else None
            info = meta.get(_META_KEY) if isinstance(meta, dict) else None
            python_bw, caller = backward_frames(sys._getframe(1))
            if info is not None:
                module, mtype, filename, lineno = info
            elif node is not None and hasattr(node, "variable"):  # AccumulateGrad: a parameter's .grad
                module, mtype = self.param_owner.get(id(node.variable), (None, None))
                if caller is not None:
                    filename, lineno, role = caller.f_code.co_filename, caller.f_lineno, "backward_call"
            if python_bw is not None:  # a custom autograd.Function's backward: the line that ran the op
                filename, lineno, role = python_bw.f_code.co_filename, python_bw.f_lineno, "python_backward"
        else:
            phase = "optimizer" if self.in_optimizer else "forward"
            module, mtype = self.context()
            frame = user_frame(sys._getframe(1))
            if frame is not None:
                filename, lineno = frame.f_code.co_filename, frame.f_lineno
            if module is not None and phase == "forward":
                watch = (id(self.stack[-1][0]), len(self.stack) - 1)
        absmax, absmin = ranged
        self.found = _Found(
            op, module, mtype, phase, value, str(dtype).removeprefix("torch."), filename, lineno, absmax,
            absmin, self.n_ops, watch, role=role, input_kinds=before,
        )  # fmt: skip

    def tag(self, out: Any, args: Any, kwargs: Any) -> None:
        """Tag the autograd Nodes a forward torch call created with (module, type, file, line). Also in
        backward: a reentrant checkpoint (``use_reentrant=True``) recomputes its forward there with grad on,
        and the backward then runs through those new Nodes. Nodes already tagged are left as they are."""
        if self.found is not None:
            return
        if not any(isinstance(t, torch.Tensor) and t.grad_fn is not None for t in tree_leaves(out)):
            return
        module, mtype = self.context()
        frame = user_frame(sys._getframe(2))
        info = (module, mtype, *((frame.f_code.co_filename, frame.f_lineno) if frame else (None, None)))
        self._tag_nodes(out, (args, kwargs), info)

    def _tag_nodes(self, out: Any, inputs: Any, info: tuple[Any, ...]) -> None:
        """Tag the untagged Nodes reachable from ``out``'s ``grad_fn`` (stopping at ``inputs``' own and at
        parameters' AccumulateGrad) with ``info``. The module post-hook calls it too, with the module and no
        line, for Nodes the torch-function mode never saw (a custom ``autograd.Function``'s ``apply``)."""
        starts = [
            t.grad_fn for t in tree_leaves(out) if isinstance(t, torch.Tensor) and t.grad_fn is not None
        ]
        if not starts:
            return
        stop = {
            id(t.grad_fn)
            for t in tree_leaves(inputs)
            if isinstance(t, torch.Tensor) and t.grad_fn is not None
        }
        todo: list[Any] = list(starts)
        while todo:
            node = todo.pop()
            if node is None or id(node) in stop or hasattr(node, "variable"):
                continue
            meta = cast("dict[str, Any]", node.metadata)
            if _META_KEY in meta:
                continue
            meta[_META_KEY] = info
            todo.extend(n for n, _ in node.next_functions)

    def result(self) -> Culprit | None:
        f = self.found
        if f is None:
            return None
        code = linecache.getline(f.filename, f.lineno).strip() if f.filename and f.lineno else ""
        module = f.module
        top = self.first_top
        if not self.rooted and top is not None and module is not None and module.split(".", 1)[0] == top:
            module = module[len(top) + 1 :]  # no module with parameters ran: the first one called is the root
        return Culprit(
            op=f.op,
            module=module,
            module_type=f.module_type,
            phase=f.phase,
            kind="nan" if f.value == "nan" else "inf",
            value=f.value,
            dtype=DType(f.dtype),
            source=f"{os.path.basename(f.filename)}:{f.lineno}" if f.filename and f.lineno else None,
            filename=f.filename,
            lineno=f.lineno,
            code=code,
            input_absmax=f.absmax,
            input_absmin=f.absmin,
            internal=f.internal,
            output_kinds=f.output_kinds,
            ops_checked=f.index,
            source_role=f.role if f.filename and f.lineno else "forward",
            input_kinds=f.input_kinds,
        )


class _OpMode(TorchDispatchMode):
    def __init__(self, hunter: _Hunter) -> None:
        super().__init__()
        self.hunter = hunter

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        with torch._C.DisableTorchFunction():
            return self.hunter.check(func, tuple(args), dict(kwargs or {}))


class _TagMode(TorchFunctionMode):
    def __init__(self, hunter: _Hunter) -> None:
        super().__init__()
        self.hunter = hunter

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if torch.is_grad_enabled():
            self.hunter.tag(out, args, kwargs)
        return out


def hunt(fn: Callable[..., Any], *args: Any, kind: str | None = None, **kwargs: Any) -> Culprit | None:
    """Run ``fn(*args, **kwargs)`` once with every aten op checked; return the first op that produced a
    non-finite value, or ``None``.

    An op *produced* a kind (NaN, +inf, -inf) when one of its outputs holds it and none of its floating-point
    tensor inputs held it before the op ran (in-place ops included) — the locator's rule, applied to aten ops
    instead of module calls. So it finds overflows that never reach a module boundary (a variance that
    overflows to inf inside a hand-written LayerNorm whose output is then finite zeros, an ``exp`` branch
    that ``torch.where`` discards) and ops of the backward pass. Not counted as produced:

    * a non-finite *scalar* argument (``masked_fill(mask, -inf)``, ``torch.full(..., -inf)``,
      ``where(c, x, -inf)``): an intended mask value;
    * outputs of view ops (they cannot hold what their base did not) and of ``empty``-family ops (uninitialised
      memory).

    ``fn`` is any callable: a training step (forward, loss, ``backward()``, ``optimizer.step()``), a forward
    call, or :meth:`nantrace.Repro.run`. It runs to the end and its return value is discarded; an exception
    from it propagates unchanged after the hunt's modes and hooks are removed. Modules are discovered as they
    are called, and named as :func:`nantrace.trace` names them: qualified names under the *root*, which is
    ``""``. The root is ``fn`` itself when it is an ``nn.Module``, else the first module with parameters called
    while no other module runs (the rule of ``nantrace run``), so a parameter-free module called before the
    model (``x = pre(x)``) does not rename it. A module outside the root's tree (that preprocessing module, a
    loss module) is named ``<ClassName>`` (its submodules ``<ClassName>.sub``); when no module with
    parameters runs at all, the first one called is the root. A :class:`nantrace.Repro`'s module keeps its name
    in the traced model (also in ``hunt(lambda: repro.run().sum().backward())``).

    Cost: slow by design, for one step. Every op's tensor inputs and outputs get an ``isfinite`` pass read on
    the host (a device sync per op on an accelerator) and every op goes through Python twice (a dispatch mode
    and a torch-function mode): about 0.3 ms per op on CPU, 6-14x an untraced training step of a small
    transformer (BENCHMARKS.md "Hunt"); on a GPU the per-op syncs make it relatively slower still. Locate the
    step and module with :func:`nantrace.trace` first, and hunt that one step or a saved reproducer.

    Args:
        fn: the callable to run.
        *args, **kwargs: passed to ``fn`` (a keyword named ``kind`` cannot be passed through: wrap ``fn`` in a
            lambda).
        kind: ``None`` (NaN or ±inf), ``"inf"`` (±inf only) or ``"nan"`` (NaN only), as in
            :meth:`nantrace.Trace.first_overflow`. With ``"nan"``, an op turning inf into NaN is the culprit.

    Returns:
        a :class:`Culprit`, or ``None`` when no op produced a wanted kind.

    Raises:
        TypeError: ``fn`` is not callable (e.g. the result of a call was passed), or is a generator or
            ``async`` function (calling it would run none of its body).
        ValueError: ``kind`` is not ``None``, ``"inf"`` or ``"nan"``.
    """
    if not callable(fn):
        raise TypeError(
            f"hunt(fn, ...): fn must be a callable (e.g. a function running one training step); got "
            f"{type(fn).__name__}: {fn!r:.80}. This is usually the result of a call, hunt(step(x)): pass the "
            "function and its arguments instead, hunt(step, x), or a lambda: hunt(lambda: step(x))."
        )
    target = inspect.unwrap(fn) if inspect.isfunction(fn) or inspect.ismethod(fn) else fn
    if (
        inspect.isgeneratorfunction(target)
        or inspect.isasyncgenfunction(target)
        or inspect.iscoroutinefunction(target)
    ):
        what = (
            "a coroutine (async) function" if inspect.iscoroutinefunction(target) else "a generator function"
        )
        raise TypeError(
            f"hunt(fn, ...): fn {getattr(fn, '__qualname__', fn)!r} is {what}: calling it only creates "
            f"{'a coroutine' if 'async' in what else 'a generator'} and runs none of its body, so nothing "
            "would be checked. Pass a plain function that runs the step (e.g. lambda: list(gen()) or "
            "lambda: asyncio.run(coro_fn()))."
        )
    wanted = wanted_kinds(kind)
    hunter = _Hunter(wanted, fn)
    handles = []
    try:
        handles.append(_nn_module.register_module_forward_pre_hook(hunter.pre))
        handles.append(_nn_module.register_module_forward_hook(hunter.post, always_call=True))
        handles.append(_optim.register_optimizer_step_pre_hook(_optimizer_enter(hunter)))
        handles.append(_optim.register_optimizer_step_post_hook(_optimizer_exit(hunter)))
        with _TagMode(hunter), _OpMode(hunter):
            fn(*args, **kwargs)
    finally:
        hunter.exit_modes()
        for h in handles:
            h.remove()
    return hunter.result()


def _optimizer_enter(hunter: _Hunter) -> Callable[..., None]:
    def hook(opt: Any, args: Any, kwargs: Any) -> None:
        hunter.in_optimizer += 1

    return hook


def _optimizer_exit(hunter: _Hunter) -> Callable[..., None]:
    def hook(opt: Any, args: Any, kwargs: Any) -> None:
        hunter.in_optimizer = max(0, hunter.in_optimizer - 1)

    return hook
