"""The operand facts of the op the forward replay names (``Trace.ops``'s ``operands`` column): pure functions
from the producing op's operands and result to a small JSON text, computed once, after the replay, on the host
path only (the replay runs only there).

The JSON object holds:

* ``operands``: one entry per operand, in argument order. A tensor gives ``name`` (``arg0``, ``arg1``,
  ``arg0[1]`` for a tensor inside a list argument, or the keyword), ``dtype``, ``numel``, ``shape``, ``absmax`` and
  ``absmin`` (over the finite values; ``absmin`` is the smallest non-zero ``|x|``), ``n_zero``, ``n_neg``
  (finite values below 0), ``n_posinf``, ``n_neginf``, ``n_nan`` and ``n_at_max`` (finite values whose ``|x|``
  equals the dtype's largest finite value, e.g. a ``torch.finfo(float16).min`` mask constant), and, when the
  tensor is a parameter or buffer of the replayed module, its name relative to that module (``weight``,
  ``0.bias``) under ``param`` (a parameter that requires grad), ``frozen`` (one that does not) or ``buffer``.
  A Python number gives ``name`` and ``value``.
* ``result``: the same statistics of the op's first output holding the new kind.
* ``hook``: present when the op ran inside a user's forward or forward-pre hook (of the replayed module, of one
  of its submodules, or a global one) rather than in a ``forward``: ``{"name": "scale", "kind": "forward hook",
  "module": "0"}`` (``module``: relative to the replayed module, ``""`` for itself, null for a global hook).
  Plain functions and bound methods are named (``Steer.apply``); a hook that is a callable object or a
  ``functools.partial`` is not.
* ``vanished``: ``[value, dtype]`` for each non-zero Python constant that an op of the replay, up to the
  producing one, combined with a tensor of a dtype in which the constant rounds to 0 (``eps=1e-12`` in
  float16, whose smallest subnormal is 6e-8).

An in-place op's operands are copies taken before it ran (the op overwrites its first operand).
"""

from __future__ import annotations

import json
import math
from typing import Any

import torch

__all__ = ["TARGET_OPS", "int_facts", "named_operands", "note_vanished", "operand_facts", "tensor_facts"]


def tensor_facts(t: torch.Tensor) -> dict[str, Any]:
    """The statistics of one tensor (see the module docstring), read on the host: not for hooks on a device."""
    x = t.detach()
    if x.element_size() == 1:
        x = x.float()
    x = x.reshape(-1)
    fin = torch.isfinite(x)
    a = x.abs()
    finite_abs = a[fin]
    nonzero = finite_abs[finite_abs > 0]
    big = float(torch.finfo(t.dtype).max)
    return {
        "dtype": str(t.dtype).removeprefix("torch."),
        "numel": int(x.numel()),
        "shape": [int(d) for d in t.shape],
        "absmax": float(finite_abs.max()) if finite_abs.numel() else math.nan,
        "absmin": float(nonzero.min()) if nonzero.numel() else math.nan,
        "n_zero": int((x == 0).sum()),
        "n_neg": int(((x < 0) & fin).sum()),
        "n_posinf": int(torch.isposinf(x).sum()),
        "n_neginf": int(torch.isneginf(x).sum()),
        "n_nan": int(torch.isnan(x).sum()),
        "n_at_max": int((finite_abs == big).sum()),
    }


def _is_number(v: object) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


#: Ops whose integer operand (the targets) decides a NaN: every target equal to ``ignore_index`` is a mean over
#: no element. Their integer tensors are operands too (:func:`int_facts`).
TARGET_OPS = frozenset({"cross_entropy", "nll_loss"})


def int_facts(t: torch.Tensor) -> dict[str, Any]:
    """``dtype, numel, shape`` and the smallest and largest value of an integer tensor (targets)."""
    x = t.detach().reshape(-1)
    lo, hi = (int(x.min()), int(x.max())) if x.numel() else (0, -1)
    return {
        "dtype": str(t.dtype).removeprefix("torch."),
        "numel": int(x.numel()),
        "shape": list(t.shape),
        "int_min": lo,
        "int_max": hi,
    }


def named_operands(
    args: Any, kwargs: Any, snapshots: list[torch.Tensor] | None, *, targets: bool = False
) -> list[tuple[str, Any]]:
    """``(name, tensor or number)`` for an op's floating tensors and Python numbers, in argument order; the
    tensors of an in-place op replaced, in order, by ``snapshots`` (copies taken before it ran). ``targets``:
    integer tensors too (an op of :data:`TARGET_OPS`)."""
    out: list[tuple[str, Any]] = []

    def add(name: str, v: Any) -> None:
        if isinstance(v, torch.Tensor):
            usable = v.layout == torch.strided and v.device.type != "meta"
            # a floating tensor, an empty one too (a mean over it is 0/0); an op's targets
            if usable and (
                v.is_floating_point() or (targets and not v.is_complex() and v.dtype != torch.bool)
            ):
                out.append((name, v))
        elif _is_number(v):
            out.append((name, v))
        elif isinstance(v, (list, tuple)):
            for j, w in enumerate(v):
                add(f"{name}[{j}]", w)

    for i, a in enumerate(args):
        add(f"arg{i}", a)
    for k, v in (kwargs or {}).items():
        add(str(k), v)
    if snapshots:
        it = iter(snapshots)
        out = [(n, next(it, v)) if isinstance(v, torch.Tensor) else (n, v) for n, v in out]
    return out


_HALF = (torch.float16, torch.bfloat16)


def _half_tiny(dtype: torch.dtype) -> float:
    fi = torch.finfo(dtype)
    return float(fi.smallest_normal) * float(fi.eps) / 2  # half the smallest subnormal


def note_vanished(seen: dict[float, str], args: Any, kwargs: Any, dtype: torch.dtype) -> None:
    """Add to ``seen`` every non-zero finite Python float among ``args``/``kwargs`` (top level) that rounds to 0
    in ``dtype`` (a half dtype): the constant is 0 in the arithmetic the op does."""
    if dtype not in _HALF:
        return
    for v in [*args, *(kwargs or {}).values()]:
        small = isinstance(v, float) and v != 0 and math.isfinite(v) and v not in seen
        # no tensor is made here (the replay's dispatch-level cast watch would see it): a value rounds to 0
        # when it is at most half the dtype's smallest subnormal (round half to even)
        if small and abs(v) <= _half_tiny(dtype):
            seen[v] = str(dtype).removeprefix("torch.")


def operand_facts(
    operands: list[tuple[str, Any]],
    result: torch.Tensor | None,
    vanished: dict[float, str],
    owned: dict[int, tuple[str, str]] | None = None,
    hook: tuple[str, str, str | None] | None = None,
) -> str:
    """The JSON text of the ``operands`` column (module docstring). ``owned``: ``id(tensor) -> (field, name)``
    for the replayed module's parameters and buffers (:func:`nantrace._drill.replay_call`); an operand that is
    one of them gets ``field: name``. ``hook``: ``(name, kind, module)`` of the forward (pre-)hook the op ran
    inside (:func:`nantrace._drill.hook_codes`)."""
    ops: list[dict[str, Any]] = []
    for name, v in operands:
        if isinstance(v, torch.Tensor):
            entry = {"name": name, **(tensor_facts(v) if v.is_floating_point() else int_facts(v))}
            if owned and id(v) in owned:
                entry.update([owned[id(v)]])
            ops.append(entry)
        else:
            ops.append({"name": name, "value": float(v)})
    doc: dict[str, Any] = {
        "operands": ops,
        "result": tensor_facts(result) if result is not None else None,
        "vanished": [[v, d] for v, d in vanished.items()],
    }
    if hook is not None:
        doc["hook"] = {"name": hook[0], "kind": hook[1], "module": hook[2]}
    return json.dumps(doc)
