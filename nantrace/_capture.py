"""Capture, for ``trace(capture=...)``: the recording side of reproducers (see :mod:`nantrace._repro`).

For each call of a watched module its forward pre-hook keeps a copy (``detach().clone()``) of the call's inputs;
the forward hook checks whether the output holds a non-finite kind (NaN, +inf, -inf) that the inputs did not.
The first such call is kept, as a :class:`CapturedCall` (inputs, a copy of the module's ``state_dict`` right
after the call, its dtype and the autocast state); every other copy is dropped when its call returns, and once a
call is kept nothing more is copied. Reading the kinds is a device sync per watched call on an accelerator:
capture is a debugging mode.

With named modules (``capture="gate"``) the latest clean call of a named module is kept too, and frozen at the
end of the first step that recorded a non-finite value (:meth:`Capture.end_step`): a fault that shows only in
backward then still has a call to reproduce. Each copy notes its inputs' ``requires_grad`` and the module's
parameters' flags, so the rebuilt call runs its backward as the traced one did.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_leaves

from ._masks import mask_named
from ._schema import KINDS
from ._stats import describable, tensor_kinds
from ._tree import clone_tree, flatten, plain_state

__all__ = ["Capture", "CapturedCall", "class_path", "make_capture"]


def _kinds(t: torch.Tensor, *, output_path: str | None = None) -> frozenset[str]:
    found = tensor_kinds(t)
    if output_path is not None and found == {"neginf"}:  # an additive mask made by the module is not a fault
        x = t.detach()
        if mask_named(output_path) or bool(((x == 0) | torch.isneginf(x)).all() & (x == 0).any()):
            return frozenset()
    return found


def _tree_kinds(obj: Any, prefix: str, *, output: bool) -> frozenset[str]:
    out: frozenset[str] = frozenset()
    for path, t in flatten(obj, prefix):
        if describable(t) and t.device.type != "meta":
            out |= _kinds(t, output_path=path if output else None)
    return out


def class_path(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


@dataclass
class CapturedCall:
    """One module call kept by ``trace(capture=...)``: what a reproducer needs (held in memory by the Trace)."""

    module_name: str
    module_type: str
    module_class: str
    module_ref: weakref.ref[nn.Module]
    args: Any
    kwargs: Any
    state_dict: dict[str, torch.Tensor]
    dtype: str
    autocast: dict[str, Any]
    step: int
    micro_step: int
    call: int
    kinds: tuple[str, ...]
    hooks: Callable[[], list[Any]] = field(repr=False, default=list)
    # the module's (and its submodules') plain Python attributes when the call started
    # (:func:`nantrace._tree.plain_state`)
    attributes: dict[str, dict[str, Any]] = field(default_factory=dict)
    # requires_grad of each tensor of (args, kwargs), in pytree leaf order, and of each named parameter
    input_grad: tuple[bool, ...] = ()
    param_grad: dict[str, bool] = field(default_factory=dict)

    def where(self) -> str:
        """``"`sim` call 0 at step 5"`` (micro-step added when > 0)."""
        name = f"`{self.module_name}`" if self.module_name else "the root model"
        micro = f", micro-step {self.micro_step}" if self.micro_step else ""
        return f"{name} call {self.call} at step {self.step}{micro}"


def _device_type(module: nn.Module, args: Any, kwargs: Any) -> str:
    for _, t in [*flatten(args, "i"), *flatten(kwargs, "i")]:
        return t.device.type
    for t in [*module.parameters(), *module.buffers()]:
        return t.device.type
    return "cpu"


def _module_dtype(module: nn.Module, args: Any) -> str:
    for t in [*module.parameters(), *module.buffers(), *(t for _, t in flatten(args, "i"))]:
        if t.is_floating_point():
            return str(t.dtype).removeprefix("torch.")
    return "float32"


class Capture:
    """The capture state of one Trace: which module codes to watch, the open calls' input copies, the kept call.

    ``watch_all`` (``capture="first"``) watches every hooked module; otherwise only codes added with
    :meth:`watch`."""

    def __init__(self, names: frozenset[str] | None, hooks: Callable[[], list[Any]]) -> None:
        self.names = names  # None: every module ("first")
        self.codes: dict[int, tuple[str, str]] = {}
        self.open: list[tuple[int, Any, Any, tuple[bool, ...], dict[str, dict[str, Any]]]] = []
        self.kept: CapturedCall | None = None
        # named capture only: the latest clean call of a named module, frozen at the end of the first step that
        # recorded a non-finite value (for a fault that shows in backward only)
        self.latest: CapturedCall | None = None
        self.frozen = False
        self.hooks = hooks

    @property
    def call(self) -> CapturedCall | None:
        """The call a reproducer saves: the first watched call whose forward produced a non-finite value, else
        (named capture) the latest call of a named module in the first step that recorded one."""
        if self.kept is not None:
            return self.kept
        return self.latest if self.frozen else None

    def end_step(self, nonfinite: bool) -> None:
        """Called at each step boundary; ``nonfinite``: the step recorded a non-finite value."""
        if nonfinite and self.latest is not None:
            self.frozen = True

    def watch(self, mcode: int, name: str, mtype: str) -> None:
        if self.names is None or name in self.names:
            self.codes[mcode] = (name, mtype)

    def pre(self, module: nn.Module, mcode: int, args: Any, kwargs: Any) -> None:
        if self.kept is not None or mcode not in self.codes:
            return
        flags = tuple(t.requires_grad for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor))
        self.open.append((mcode, clone_tree(args), clone_tree(kwargs), flags, plain_state(module)))

    def post(self, module: nn.Module, mcode: int, output: Any, step: int, micro: int, call: int) -> None:
        if mcode not in self.codes:
            return
        for i in range(len(self.open) - 1, -1, -1):
            if self.open[i][0] == mcode:
                _, args, kwargs, flags, attributes = self.open[i]
                del self.open[i:]
                break
        else:
            return
        if self.kept is not None or output is None:
            return
        produced = _tree_kinds(output, "output", output=True) - _tree_kinds(
            (args, kwargs), "input", output=False
        )
        if not produced and (self.names is None or self.frozen):
            return
        name, mtype = self.codes[mcode]
        device_type = _device_type(module, args, kwargs)
        call_ = CapturedCall(
            module_name=name,
            module_type=mtype,
            module_class=class_path(type(module)),
            module_ref=weakref.ref(module),
            args=args,
            kwargs=kwargs,
            state_dict={k: v.detach().clone() for k, v in module.state_dict().items()},
            dtype=_module_dtype(module, args),
            autocast={
                "device_type": device_type,
                "enabled": torch.is_autocast_enabled(device_type),
                "dtype": str(torch.get_autocast_dtype(device_type)).removeprefix("torch."),
            },
            step=step,
            micro_step=micro,
            call=call,
            kinds=tuple(k for k in KINDS if k in produced),
            hooks=self.hooks,
            input_grad=flags,
            param_grad={n: p.requires_grad for n, p in module.named_parameters()},
            attributes=attributes,
        )
        if not produced:  # named capture: keep the latest clean call, in case the fault shows in backward
            self.latest = call_
            return
        self.kept = call_
        self.latest = None
        self.open.clear()


def make_capture(
    capture: Any, names: list[str], hooks: Callable[[], list[Any]]
) -> tuple[Capture | None, str | list[str] | None]:
    """Validate ``trace(capture=...)`` against the traced module ``names``; the :class:`Capture` (or ``None``)
    and the option as recorded in ``Trace.options``.

    Raises:
        TypeError: ``capture`` is not None, a str or a list/tuple of str.
        ValueError: a name is not a traced module, or the list is empty.
    """
    if capture is None:
        return None, None
    if capture == "first":
        return Capture(None, hooks), "first"
    items = [capture] if isinstance(capture, str) else capture
    if not isinstance(items, (list, tuple)) or not all(isinstance(n, str) for n in items):
        raise TypeError(
            f"capture= must be None, 'first', a traced module's qualified name or a list of names; got "
            f"{type(capture).__name__}: {capture!r:.80}"
        )
    if not items:
        raise ValueError("capture= is an empty list; pass None (no capture), 'first' or module names")
    names = list(dict.fromkeys(names))
    known = set(names)
    unknown = [n for n in items if n not in known]
    if unknown:
        raise ValueError(
            f"capture= names {unknown[0]!r}, which is not a traced module; use 'first' or one of the qualified "
            f"names of model.named_modules() that are traced ('' is the root model), e.g. {names[:6]}"
        )
    return Capture(frozenset(items), hooks), list(items)
