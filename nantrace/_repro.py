"""Capture the call that produced the first non-finite value, save it, and rebuild it in isolation.

``nantrace.trace(model, capture=...)`` gives the recorder a :class:`Capture`. For each call of a watched module
its forward pre-hook keeps a copy (``detach().clone()``) of the call's inputs; the forward hook checks whether
the output holds a non-finite kind (NaN, +inf, -inf) that the inputs did not. The first such call is kept, as a
:class:`CapturedCall` (inputs, a copy of the module's ``state_dict`` right after the call, its dtype and the
autocast state); every other copy is dropped when its call returns, and once a call is kept nothing more is
copied. Reading the kinds is a device sync per watched call on an accelerator: capture is a debugging mode.

With named modules (``capture="gate"``) the latest clean call of a named module is kept too, and frozen at the
end of the first step that recorded a non-finite value (:meth:`Capture.end_step`): a fault that shows only in
backward then still has a call to reproduce. Each copy notes its inputs' ``requires_grad`` and the module's
parameters' flags, so the rebuilt call runs its backward as the traced one did.

:meth:`nantrace.Overflow.save_repro` writes the kept call to a file when it is that overflow's own event (else it
raises, naming both); :meth:`nantrace.Trace.save_repro` writes whatever was kept. :func:`load_repro` rebuilds it
as a :class:`Repro` whose :meth:`Repro.run` runs the module alone on the saved inputs, and
``nantrace.hunt(repro.run)`` (or ``hunt(lambda: repro.run().sum().backward())``) drills into it.

File format (``torch.save`` of a dict, version :data:`REPRO_FORMAT`): plain fields (module name, class path,
step, dtype, autocast state), the ``state_dict`` tensors, and two pickles made with ``torch.save``: the module
object (its class is imported back by its path, so it must be importable: not defined in ``__main__`` or inside
a function) and the call's ``(args, kwargs)``. The outer dict is read with ``weights_only=True``; the two
pickles need ``weights_only=False`` (they rebuild arbitrary classes), so load reproducers you trust only, as
with any pickled model.
"""

from __future__ import annotations

import copy
import importlib
import io
import os
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_leaves

from ._hooks import _clone_tree, flatten
from ._locate import KINDS, mask_named
from ._stats import describable, tensor_kinds

__all__ = ["REPRO_FORMAT", "Capture", "CapturedCall", "Repro", "load_repro", "save_repro"]

REPRO_FORMAT = 1
# The module of every live Repro and its name in the traced model: nantrace.hunt names modules from it.
REPRO_NAMES: weakref.WeakKeyDictionary[nn.Module, str] = weakref.WeakKeyDictionary()


def _kinds(t: torch.Tensor, *, output_path: str | None = None) -> frozenset[str]:
    found = tensor_kinds(t)
    if output_path is not None and found == {"neginf"}:  # an additive mask made by the module is not a fault
        x = t.detach()
        if mask_named(output_path) or bool(((x == 0) | torch.isneginf(x)).all()):
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


def _import_class(module: str, qualname: str) -> Any:
    obj: Any = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


def _check_importable(mod: nn.Module, name: str) -> None:
    from ._trace import NantraceError

    for sub_name, sub in mod.named_modules():
        full = ".".join(p for p in (name, sub_name) if p)
        who = f"module `{full}`" if full else "the root model"
        cls = type(sub)
        where = class_path(cls)
        if cls.__module__ == "__main__" or "<locals>" in cls.__qualname__:
            place = (
                "in __main__ (a script or notebook)" if cls.__module__ == "__main__" else "inside a function"
            )
            raise NantraceError(
                f"save_repro: {who} uses class {where}, defined {place}; a reproducer rebuilds the "
                "module by importing its class by path, which is impossible for it. Move the class to an "
                "importable .py module (and import it from there), then trace again."
            )
        try:
            ok = _import_class(cls.__module__, cls.__qualname__) is cls
        except Exception:
            ok = False
        if not ok:
            raise NantraceError(
                f"save_repro: {who} uses class {where}, which cannot be imported back by that path; "
                "define it at the top level of an importable module."
            )


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
        self.open: list[tuple[int, Any, Any, tuple[bool, ...]]] = []
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

    def pre(self, mcode: int, args: Any, kwargs: Any) -> None:
        if self.kept is not None or mcode not in self.codes:
            return
        flags = tuple(t.requires_grad for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor))
        self.open.append((mcode, _clone_tree(args), _clone_tree(kwargs), flags))

    def post(self, module: nn.Module, mcode: int, output: Any, step: int, micro: int, call: int) -> None:
        if mcode not in self.codes:
            return
        for i in range(len(self.open) - 1, -1, -1):
            if self.open[i][0] == mcode:
                _, args, kwargs, flags = self.open[i]
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
        )
        if not produced:  # named capture: keep the latest clean call, in case the fault shows in backward
            self.latest = call_
            return
        self.kept = call_
        self.latest = None
        self.open.clear()


def _skeleton(module: nn.Module, handles: list[Any]) -> nn.Module:
    """A deep copy of ``module`` without the hooks of the given ``RemovableHandle``s (nantrace's own, which
    are closures that cannot be pickled); the user's module is not touched."""
    drop: dict[int, tuple[dict[Any, Any], set[int]]] = {}
    for h in handles:
        dicts = [h.hooks_dict_ref(), *(r() for r in getattr(h, "extra_dict_ref", ()))]
        for d in dicts:
            if d is not None:
                drop.setdefault(id(d), (d, set()))[1].add(h.id)
    memo: dict[int, Any] = {}
    for d, ids in drop.values():
        kept = copy.copy(d)
        for k in ids:
            kept.pop(k, None)
        memo[id(d)] = kept
    return copy.deepcopy(module, memo)


def _pickle(obj: Any) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _event(ov: Any) -> str:
    """``"a forward overflow in `sim` (call 0) at step 5"``."""
    name = f"`{ov.module}`" if ov.module else "the root model"
    micro = f", micro-step {ov.micro_step}" if ov.micro_step else ""
    return f"a {ov.phase} overflow in {name} (call {ov.call}, `{ov.tensor}`) at step {ov.step}{micro}"


def captured_call(
    capture: Capture | None, overflow: Any = None, *, for_overflow: bool = False
) -> CapturedCall:
    """The call to save, after the checks of :meth:`nantrace.Overflow.save_repro` (``for_overflow``: the call
    must be ``overflow``'s own event) and :meth:`nantrace.Trace.save_repro`.

    Raises:
        NantraceError: no capture, nothing captured, or (``for_overflow``) the captured call is another event.
    """
    from ._trace import NantraceError

    if capture is None:
        raise NantraceError(
            "save_repro: this trace has no capture (a trace loaded from a file never has one). Record with "
            "nantrace.trace(model, capture='first') (or capture='<module name>'), then call save_repro on that "
            "trace or its first_overflow()."
        )
    call = capture.call
    where = f" The first overflow is {_event(overflow)}." if overflow is not None else ""
    if call is None:
        if capture.names is None:
            raise NantraceError(
                "save_repro: capture='first' watched every traced module and no forward call produced a "
                f"non-finite value (only forward outputs are checked).{where} For a fault that appears in "
                "backward only, trace again with capture='<that module's name>' (the call of the first step "
                "that recorded a non-finite value is kept) and hunt lambda: repro.run().sum().backward(), or "
                "run the step under nantrace.hunt(step_fn)."
            )
        watched = ", ".join(f"`{n}`" if n else "the root model" for n in sorted(capture.names))
        suggest = (
            f" Trace again with capture={overflow.module!r}."
            if overflow is not None and overflow.module not in capture.names
            else ""
        )
        raise NantraceError(
            f"save_repro: capture= watched {watched}, which never produced a non-finite value in a forward "
            f"call, and no step recorded one while it was watched, so nothing was kept.{where}{suggest}"
        )
    if for_overflow and overflow is not None:
        # the event's own call, or (a named capture of an enclosing module) that module's call in the same
        # micro-step whose output held what its descendant produced
        name = call.module_name
        encloses = name == "" or str(overflow.module).startswith(name + ".")
        same = (
            bool(call.kinds)
            and overflow.phase == "forward"
            and (overflow.step, overflow.micro_step) == (call.step, call.micro_step)
            and ((overflow.module, overflow.call) == (name, call.call) or encloses)
        )
        if not same:
            what = (
                "whose forward produced " + ", ".join(call.kinds)
                if call.kinds
                else "(its forward never produced a non-finite value; kept because its step recorded one)"
            )
            if overflow.phase == "forward":
                how = f"trace again with capture={overflow.module!r} to capture this module's call."
            elif overflow.phase == "backward" and call.module_name == overflow.module:
                how = (
                    "it is this module's call, so it reproduces the forward of this backward overflow: save it "
                    'with trace.save_repro(path) and hunt lambda: repro.run().sum().backward() (kind="nan" for '
                    "a NaN)."
                )
            elif overflow.phase == "backward":
                how = (
                    f"for this backward overflow, trace again with capture={overflow.module!r} (a named capture "
                    "keeps the module's call of the first step that recorded a non-finite value), save it with "
                    "trace.save_repro(path) and hunt lambda: repro.run().sum().backward()."
                )
            else:
                how = (
                    f"a {overflow.phase} overflow is not made by a module's forward, so no module call "
                    "reproduces it"
                    + (" (a GradScaler backoff is routine)." if overflow.phase == "loss" else ".")
                )
            raise NantraceError(
                f"save_repro: this Overflow is {_event(overflow)}, but the captured call is {call.where()} "
                f"{what}: a reproducer of it would not be this event. To save the captured call anyway use "
                f"trace.save_repro(path) (the Trace's method); {how}"
            )
    return call


def save_repro(call: CapturedCall, path: str | os.PathLike[str]) -> Path:
    """Write ``call`` to ``path`` atomically (temporary file in the same directory, then ``os.replace``).

    Raises:
        NantraceError: the module was garbage-collected, or its class (or a submodule's) cannot be imported
            back by its path (defined in ``__main__`` or inside a function).
        TypeError / ValueError: ``path`` is not a path, is a directory, or its directory is missing/read-only.
    """
    from . import __version__
    from ._io import _check_target, atomic_write
    from ._trace import NantraceError

    target = _check_target(path)
    who = f"module `{call.module_name}`" if call.module_name else "the root model"
    module = call.module_ref()
    if module is None:
        raise NantraceError(
            f"save_repro: {who} ({call.module_class}) no longer exists; save the "
            "reproducer while the model is alive"
        )
    _check_importable(module, call.module_name)
    try:
        module_bytes = _pickle(_skeleton(module, call.hooks()))
        call_bytes = _pickle((call.args, call.kwargs))
    except Exception as e:
        raise NantraceError(
            f"save_repro: {who} ({call.module_class}) or its call's arguments could not "
            f"be pickled ({type(e).__name__}: {e}); a reproducer needs a picklable module and arguments"
        ) from e
    payload = {
        "format": REPRO_FORMAT,
        "nantrace": __version__,
        "torch": str(torch.__version__),
        "module_name": call.module_name,
        "module_type": call.module_type,
        "module_class": call.module_class,
        "step": call.step,
        "micro_step": call.micro_step,
        "call": call.call,
        "kinds": list(call.kinds),
        "dtype": call.dtype,
        "autocast": dict(call.autocast),
        "state_dict": call.state_dict,
        "module_pickle": module_bytes,
        "call_pickle": call_bytes,
        "input_grad": list(call.input_grad),
        "param_grad": dict(call.param_grad),
    }
    return atomic_write(target, lambda f: torch.save(payload, f))


class Repro:
    """A module call rebuilt from a reproducer file (:func:`nantrace.load_repro`).

    Attributes:
        module: the rebuilt ``nn.Module`` with the ``state_dict`` it had right after the captured call (its
            ``training`` flag as it was).
        module_name: its qualified name in the traced model (``""`` is the root).
        module_type, module_class: class name and import path (``"pkg.mod.Class"``).
        args, kwargs: the call's inputs as they were when the call started (``detach().clone()`` copies).
        dtype: the module's floating-point dtype name (``"float16"``).
        autocast: ``{"device_type": "cpu", "enabled": bool, "dtype": "float16"}`` at the time of the call.
        step, micro_step, call: where the call happened in the traced run.
        kinds: the non-finite kinds the call produced (``"nan"``, ``"posinf"``, ``"neginf"``); empty for a
            call kept by a named capture whose forward was clean (the fault showed in backward).
        input_grad: ``requires_grad`` of each tensor of ``(args, kwargs)`` in the traced call, in pytree leaf
            order (``torch.utils._pytree.tree_leaves``): :meth:`run` sets it on its copies.
        last_args, last_kwargs: the copies the latest :meth:`run` passed to the module (``None`` before the
            first run): after ``repro.run().sum().backward()``, ``repro.last_args[0].grad`` is the input
            gradient.
    """

    def __init__(self, payload: dict[str, Any], module: nn.Module, args: Any, kwargs: Any) -> None:
        self.module = module
        self.module_name: str = payload["module_name"]
        self.module_type: str = payload["module_type"]
        self.module_class: str = payload["module_class"]
        self.args: tuple[Any, ...] = tuple(args)
        self.kwargs: dict[str, Any] = dict(kwargs)
        self.dtype: str = payload["dtype"]
        self.autocast: dict[str, Any] = dict(payload["autocast"])
        self.step: int = int(payload["step"])
        self.micro_step: int = int(payload["micro_step"])
        self.call: int = int(payload["call"])
        self.kinds: tuple[str, ...] = tuple(payload["kinds"])
        self.input_grad: tuple[bool, ...] = tuple(bool(v) for v in payload.get("input_grad", ()))
        self.last_args: tuple[Any, ...] | None = None
        self.last_kwargs: dict[str, Any] | None = None
        REPRO_NAMES[module] = self.module_name  # nantrace.hunt names its modules as in the traced model

    def run(self) -> Any:
        """Run the module once on fresh copies of the saved inputs, under the saved autocast state, and return
        its output.

        The copies are leaf tensors with the ``requires_grad`` the traced call's inputs had (an activation
        that required grad does again), and the module's parameters have the ``requires_grad`` they had in the
        traced model. So, under the current grad mode, ``repro.run().sum().backward()`` runs the backward,
        input gradients included (``repro.last_args[i].grad``), and
        ``nantrace.hunt(lambda: repro.run().sum().backward(), kind="nan")`` finds a backward fault. Random ops
        (dropout) draw new random numbers."""
        ac = self.autocast
        dtype = getattr(torch, str(ac["dtype"]))
        args, kwargs = _clone_tree(self.args), _clone_tree(self.kwargs)
        tensors = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        for t, flag in zip(tensors, self.input_grad, strict=False):
            if flag and (t.is_floating_point() or t.is_complex()):
                t.requires_grad_(True)
        self.last_args, self.last_kwargs = args, kwargs
        with torch.autocast(str(ac["device_type"]), dtype=dtype, enabled=bool(ac["enabled"])):
            return self.module(*args, **kwargs)

    def __repr__(self) -> str:
        name = f"`{self.module_name}`" if self.module_name else "the root model"
        kinds = (
            "produced " + ", ".join(self.kinds) if self.kinds else "forward clean (kept for a backward fault)"
        )
        ac = self.autocast
        amp = f"autocast {ac['device_type']} {ac['dtype']}" if ac["enabled"] else "no autocast"
        return (
            f"<nantrace.Repro {name} ({self.module_class}), step {self.step}, micro-step {self.micro_step}, "
            f"call {self.call}: {kinds}; {self.dtype}, {amp}>"
        )


def load_repro(path: str | os.PathLike[str], *, map_location: Any = None) -> Repro:
    """Rebuild a reproducer written by :meth:`nantrace.Overflow.save_repro` or :meth:`nantrace.Trace.save_repro`.

    The module's class is imported by its saved path and the object unpickled (``torch.load`` with
    ``weights_only=False``: load files you trust only); then the captured ``state_dict`` is loaded into it.

    Args:
        path: the reproducer file (``~`` is expanded).
        map_location: passed to ``torch.load`` (e.g. ``"cpu"`` to rebuild a GPU capture on a CPU machine).

    Returns:
        a :class:`Repro`; ``repro.run()`` reproduces the call, ``nantrace.hunt(repro.run)`` names the op.

    Raises:
        FileNotFoundError: ``path`` does not exist.
        NantraceError: ``path`` is not a nantrace reproducer (a nantrace trace file is named as such: read
            it with :func:`nantrace.load`), has another format version, or the module's class cannot be
            imported by its saved path.
    """
    from ._trace import NantraceError

    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"path must be a str or os.PathLike; got {type(path).__name__}: {path!r:.80}")
    p = Path(path).expanduser()
    if not p.exists():
        raise FileNotFoundError(f"no such reproducer file: {str(p)!r}")
    if p.is_dir():
        raise NantraceError(
            f"{str(p)!r} is a directory, not a nantrace reproducer (a nantrace trace folder of a distributed "
            "run loads with nantrace.load)"
        )
    with open(p, "rb") as f:
        magic = f.read(4)
    if magic == b"PAR1":
        raise NantraceError(
            f"{str(p)!r} is a nantrace trace (a parquet file), not a reproducer: read it with "
            "nantrace.load(path). A reproducer is written by Overflow.save_repro(path) or Trace.save_repro(path)."
        )
    if magic[:2] != b"PK":  # torch.save writes a zip archive
        raise NantraceError(
            f"{str(p)!r} is not a nantrace reproducer (not a torch.save file); write one with "
            "Overflow.save_repro(path) or Trace.save_repro(path) on a trace recorded with capture=..."
        )
    try:
        payload = torch.load(p, map_location=map_location, weights_only=True)
        fmt = payload["format"]
        cls_path = str(payload["module_class"])
    except Exception as e:
        raise NantraceError(
            f"{str(p)!r} is not a nantrace reproducer (a torch.save file without its fields; "
            f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}); write one with "
            "Overflow.save_repro(path) or Trace.save_repro(path)"
        ) from None
    if fmt != REPRO_FORMAT:
        raise NantraceError(
            f"{str(p)!r} is reproducer format {fmt} (nantrace {payload.get('nantrace')}); this nantrace reads "
            f"format {REPRO_FORMAT}"
        )
    try:
        module = torch.load(
            io.BytesIO(payload["module_pickle"]), map_location=map_location, weights_only=False
        )
    except (ImportError, AttributeError) as e:
        raise NantraceError(
            f"{str(p)!r}: cannot rebuild "
            + (f"module `{payload['module_name']}`" if payload["module_name"] else "the root model")
            + f": its class {cls_path} (or a "
            f"submodule's class) cannot be imported ({type(e).__name__}: {e}). Make the module that defines it "
            f"importable (install the package or add its directory to sys.path) and load again."
        ) from None
    if not isinstance(module, nn.Module):
        raise NantraceError(f"{str(p)!r}: the saved module is a {type(module).__name__}, not an nn.Module")
    module.load_state_dict(payload["state_dict"])
    for name, param in module.named_parameters():
        flag = payload.get("param_grad", {}).get(name)
        if flag is not None:
            param.requires_grad_(bool(flag))
    args, kwargs = torch.load(
        io.BytesIO(payload["call_pickle"]), map_location=map_location, weights_only=False
    )
    return Repro(payload, module, args, kwargs)


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
