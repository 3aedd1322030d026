"""Nested containers of tensors: flattening them into named paths, and copying them; what a replayed forward may
change besides tensors, saved and restored: a module tree's plain Python attributes, Python's and NumPy's RNG
states (a leaf module)."""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import enum
import functools
import random
import types
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

__all__ = [
    "MAX_DEPTH",
    "clone_tree",
    "flatten",
    "flatten_list",
    "host_rng_states",
    "host_rngs_kept",
    "plain_state",
    "restore_plain",
    "set_host_rng_states",
]

MAX_DEPTH = 6


_PLAIN = (bool, int, float, complex, str, bytes, type(None))


def _is_plain(v: Any, depth: int = 0) -> bool:
    if isinstance(v, _PLAIN):
        return True
    if depth < 3 and isinstance(v, (tuple, list, frozenset, set)) and len(v) <= 64:
        return all(_is_plain(x, depth + 1) for x in v)
    if depth < 3 and type(v) is dict and len(v) <= 64:
        return all(_is_plain(k, depth + 1) and _is_plain(x, depth + 1) for k, x in v.items())
    return False


#: What ``nn.Module.__init__`` puts in every module's ``__dict__`` (the training flag, the tables of parameters,
#: buffers, submodules and hooks): torch's own fields, never set back by :func:`restore_plain`.
_MODULE_FIELDS = frozenset(vars(torch.nn.Module()))


def plain_state(module: torch.nn.Module) -> dict[str, dict[str, Any]]:
    """``{submodule name: {attribute: value}}`` of the plain Python attributes (numbers, strings, None, and
    small tuples/lists/sets/dicts of those) in each submodule's ``__dict__``, copied (:func:`_copied`): a call
    counter, a flag, a step count the forward reads, private ones (``self._n``) included. Parameters, buffers,
    submodules, hooks and the other fields ``nn.Module.__init__`` makes are not attributes here. What a forward
    depends on beyond its tensors, kept when the call starts so that a reproducer saved later runs the call as
    it ran."""
    out: dict[str, dict[str, Any]] = {}
    for name, m in module.named_modules():
        own = {
            k: _copied(v)
            for k, v in vars(m).items()
            if k not in _MODULE_FIELDS and not k.startswith("__") and _is_plain(v)
        }
        if own:
            out[name] = own
    return out


def _copied(v: Any) -> Any:
    """A deep copy of ``v``, or ``v`` itself when it refuses one (a subclass of a plain type with its own
    ``__deepcopy__``): setting that object back still undoes a rebinding, never raises."""
    try:
        return copy.deepcopy(v)
    except Exception:
        return v


@contextlib.contextmanager
def host_rngs_kept() -> Iterator[None]:
    """Save Python's ``random`` state and NumPy's global RNG state, and set them back on exit: a replayed
    forward that draws from them (``random.random()``, ``np.random.rand()``) leaves the user's streams where the
    real run had them (torch's own RNG is forked by the caller)."""
    states = host_rng_states()
    try:
        yield
    finally:
        set_host_rng_states(states)


def host_rng_states() -> tuple[Any, Any]:
    """Python's ``random`` state and NumPy's global RNG state, as :func:`set_host_rng_states` takes them."""
    return random.getstate(), np.random.get_state()


def set_host_rng_states(states: tuple[Any, Any]) -> None:
    """Set Python's ``random`` and NumPy's global RNG states back to ``states`` (:func:`host_rng_states`)."""
    random.setstate(states[0])
    np.random.set_state(states[1])


def restore_plain(module: torch.nn.Module, saved: dict[str, dict[str, Any]]) -> None:
    """Set the plain attributes of ``module``'s submodules back to ``saved`` (:func:`plain_state`), and remove
    plain attributes made since (a replayed forward that counted its calls or set a flag leaves no trace)."""
    now = plain_state(module)
    for name, m in module.named_modules():
        before = saved.get(name, {})
        for k in now.get(name, {}):
            if k not in before:
                delattr(m, k)
        for k, v in before.items():
            if k not in vars(m) or vars(m)[k] != v:  # an unchanged attribute keeps its own object
                setattr(m, k, v)


def flatten(obj: Any, prefix: str, depth: int = 0) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(path, tensor)`` for every tensor nested in ``obj``.

    Tuples/lists give ``prefix[i]``, mappings (``dict``, ``OrderedDict`` subclasses such as model-output
    objects) and namedtuples/dataclasses give ``prefix.name``. Anything else is skipped. Recursion stops at
    depth 6.
    """
    if isinstance(obj, torch.Tensor):
        yield prefix, obj
        return
    if depth >= MAX_DEPTH or obj is None or isinstance(obj, (str, bytes, int, float, bool)):
        return
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # namedtuple
        for name in obj._fields:
            yield from flatten(getattr(obj, name), f"{prefix}.{name}", depth + 1)
    elif isinstance(obj, (tuple, list)):
        for i, v in enumerate(obj):
            yield from flatten(v, f"{prefix}[{i}]", depth + 1)
    elif isinstance(obj, dict):
        for k, v in obj.items():
            key = f".{k}" if isinstance(k, str) and k.isidentifier() else f"[{k!r}]"
            yield from flatten(v, prefix + key, depth + 1)
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for f in dataclasses.fields(obj):
            yield from flatten(getattr(obj, f.name, None), f"{prefix}.{f.name}", depth + 1)


_INDEXED: dict[tuple[str, int], str] = {}


def _indexed(prefix: str, i: int) -> str:
    path = _INDEXED.get((prefix, i))
    if path is None:
        path = _INDEXED[(prefix, i)] = f"{prefix}[{i}]"
    return path


def flatten_list(obj: Any, prefix: str) -> list[tuple[str, torch.Tensor]]:
    """``list(flatten(obj, prefix))``, without the generators for the common shapes of a module call's
    arguments and outputs: one tensor, an empty container, a plain tuple or list of tensors."""
    if isinstance(obj, torch.Tensor):
        return [(prefix, obj)]
    if (type(obj) is tuple or type(obj) is list or type(obj) is dict) and not obj:
        return []
    if (type(obj) is tuple or type(obj) is list) and all(isinstance(v, torch.Tensor) for v in obj):
        return [(_indexed(prefix, i), v) for i, v in enumerate(obj)]
    return list(flatten(obj, prefix))


#: Values a replay can share with the caller: immutable, or code rather than state.
_SHARED = (
    str,
    bytes,
    int,
    float,
    complex,
    type(None),
    range,
    slice,
    enum.Enum,
    torch.dtype,
    torch.device,
    torch.Size,
    torch.layout,
    torch.memory_format,
    torch.nn.Module,
    type,
    types.FunctionType,
    types.BuiltinFunctionType,
    types.MethodType,
    types.ModuleType,
    functools.partial,
)


def clone_tree(obj: Any, depth: int = 0, *, strict: bool = False) -> Any:
    """A copy of ``obj`` for a side-effect-free replay: every tensor reachable through tuples, lists, dicts and
    the attributes of other objects (a key/value cache passed to an attention call) is cloned, so running a
    module on the copy changes nothing the caller holds. Immutable values, modules, functions and classes are
    shared; so is what lies deeper than :data:`MAX_DEPTH`.

    Raises:
        TypeError: ``strict`` and some object could not be copied (``copy.copy`` failed); without ``strict``
            such an object is shared.
    """
    if isinstance(obj, torch.Tensor):
        return obj.detach().clone()
    if depth >= MAX_DEPTH or isinstance(obj, _SHARED):
        return obj
    if isinstance(obj, tuple):
        items = [clone_tree(v, depth + 1, strict=strict) for v in obj]
        if type(obj) is tuple:
            return tuple(items)
        return type(obj)(*items) if hasattr(obj, "_fields") else type(obj)(items)
    if isinstance(obj, list) and type(obj) is list:
        return [clone_tree(v, depth + 1, strict=strict) for v in obj]
    if type(obj) is dict:
        return {k: clone_tree(v, depth + 1, strict=strict) for k, v in obj.items()}
    try:
        new = copy.copy(obj)
        if isinstance(obj, dict):  # a dict subclass (a model-output object)
            for k, v in obj.items():
                dict.__setitem__(new, k, clone_tree(v, depth + 1, strict=strict))
        if isinstance(obj, list):
            new[:] = [clone_tree(v, depth + 1, strict=strict) for v in obj]
        attrs = getattr(new, "__dict__", None)
        if isinstance(attrs, dict):
            for k, v in list(attrs.items()):
                attrs[k] = clone_tree(v, depth + 1, strict=strict)
        return new
    except Exception as e:
        if strict:
            raise TypeError(f"cannot copy a {type(obj).__name__} for a replay: {e!r}") from e
        return obj
