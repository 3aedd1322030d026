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
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_leaves

from ._capture import Capture, CapturedCall, class_path
from ._errors import NantraceError
from ._files import atomic_write, check_target
from ._tree import clone_tree, restore_plain

__all__ = ["REPRO_FORMAT", "REPRO_NAMES", "Repro", "captured_call", "load_repro", "save_repro"]

REPRO_FORMAT = 1
# The module of every live Repro and its name in the traced model: nantrace.hunt names modules from it.
REPRO_NAMES: weakref.WeakKeyDictionary[nn.Module, str] = weakref.WeakKeyDictionary()


def _import_class(module: str, qualname: str) -> Any:
    obj: Any = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


def _check_importable(mod: nn.Module, name: str) -> None:
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
    from ._version import __version__

    target = check_target(path)
    who = f"module `{call.module_name}`" if call.module_name else "the root model"
    module = call.module_ref()
    if module is None:
        raise NantraceError(
            f"save_repro: {who} ({call.module_class}) no longer exists; save the "
            "reproducer while the model is alive"
        )
    _check_importable(module, call.module_name)
    try:
        skeleton = _skeleton(module, call.hooks())
        restore_plain(skeleton, call.attributes)  # the plain attributes as they were when the call started
        module_bytes = _pickle(skeleton)
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
            ``training`` flag as it was), and the plain Python attributes (numbers, strings, flags, small
            containers of those) it and its submodules had when the call started: a call counter or a flag the
            forward reads is as the traced call saw it, not as it was when the reproducer was saved.
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
        args, kwargs = clone_tree(self.args), clone_tree(self.kwargs)
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
