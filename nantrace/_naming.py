"""Module naming: qualified names with wrapper prefixes dropped, and whether a module runs torch's own
``forward`` (a leaf module)."""

from __future__ import annotations

import inspect
from typing import Any

from torch import nn

__all__ = ["WRAPPER_ATTRS", "is_sharded", "module_names", "positional_names", "torch_builtin"]

# Attribute names of wrappers whose child is the real module; dropped from qualified names.
WRAPPER_ATTRS = frozenset({"_fsdp_wrapped_module", "_checkpoint_wrapped_module", "_orig_mod"})


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
        children = [(k, c) for k, c in m._modules.items() if c is not None]
        transparent = {k for k, _ in children if k in WRAPPER_ATTRS or (k == "module" and _is_ddp(m))}
        if not transparent:
            out.append((name, m))
        for k, c in children:
            walk(name if k in transparent else (f"{name}.{k}" if name else k), c)

    walk("", model)
    return out


def torch_builtin(module: Any) -> bool:
    """True when ``module``'s class runs torch's own ``forward`` (``type(module).forward`` is defined in a
    ``torch.*`` module): ``nn.Linear`` and ``class MyLinear(nn.Linear): pass`` are, a hand-written class named
    ``Linear`` or ``LayerNorm`` is not."""
    fwd = getattr(type(module), "forward", None)
    return str(getattr(fwd, "__module__", "") or "").split(".", 1)[0] == "torch"


def is_sharded(p: Any) -> bool:
    """True for a DTensor (FSDP2 ``fully_shard``, tensor parallel): it holds this rank's shard."""
    return type(p) is not nn.Parameter and hasattr(p, "to_local") and hasattr(p, "placements")


_SIG_CACHE: dict[Any, list[str]] = {}


def positional_names(module: nn.Module) -> list[str]:
    """Names of the positional parameters of ``module.forward`` (cached per function)."""
    fn = getattr(type(module), "forward", None)
    names = _SIG_CACHE.get(fn)
    if names is None:
        try:
            params = inspect.signature(module.forward).parameters.values()
            names = [
                p.name
                for p in params
                if p.kind in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
            ]
        except (TypeError, ValueError):
            names = []
        _SIG_CACHE[fn] = names
    return names
