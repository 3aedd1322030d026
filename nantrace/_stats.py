"""Pure functions: one tensor in, its eight range statistics out.

The statistics of a tensor ``x`` are, in this order (:data:`STAT_NAMES`):

``min, max``
    smallest and largest *finite* value (NaN when ``x`` holds no finite value);
``absmax``
    largest finite ``|x|``;
``absmin``
    smallest finite non-zero ``|x|`` (NaN when there is none);
``n_nan, n_posinf, n_neginf, n_zero``
    counts of NaN, +inf, -inf and zero elements (``-0.0`` counts as zero).

Two implementations give the same numbers:

* :func:`stats_device` never reads a value on the host. It is a fixed sequence of on-device reductions whose
  result is one float64 tensor of shape ``(8,)`` on ``x.device``; it is what hooks use on an accelerator, so the
  host never waits for the device (no ``.item()``, ``bool(tensor)`` or branching on values).
* :func:`stats_host` is for CPU tensors, where reading a value costs no device synchronisation. It starts with
  one ``torch.aminmax`` pass: NaN propagates into min/max and ±inf shows as an extreme, so a finite result proves
  the tensor clean and the inf/NaN counts are zero without counting. It returns a tuple of Python floats.

Only dense floating-point tensors with at least one element are described (:func:`describable`). float8
tensors are widened to float32 first because most reductions do not accept them.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch
from torch.utils._pytree import tree_leaves

from ._schema import N_STATS, STAT_NAMES

__all__ = [
    "CHUNK_ELEMENTS",
    "N_STATS",
    "STAT_NAMES",
    "describable",
    "is_clean_host",
    "op_input_kinds",
    "scalar_kinds",
    "stats_device",
    "stats_host",
    "tensor_kinds",
]


_INF = float("inf")
_NAN = float("nan")


def describable(t: object) -> bool:
    """True for a dense (strided) floating-point tensor with at least one element.

    Integer, bool, complex, sparse, quantized and zero-size tensors are not described (they cannot hold inf/NaN,
    or have no range to speak of).
    """
    return (
        isinstance(t, torch.Tensor)
        and t.layout == torch.strided
        and t.is_floating_point()
        and not t.is_quantized
        and t.numel() > 0
    )


def _work_view(t: torch.Tensor) -> torch.Tensor:
    """A detached view (or float32 copy for float8 types) to reduce over."""
    x = t.detach()
    if x.element_size() == 1:  # float8 variants: widen, reductions do not take them
        x = x.float()
    return x


#: Elements reduced at once. Larger tensors are reduced chunk by chunk, so the temporaries of a statistic (bool
#: masks, ``where`` copies, ``|x|``) stay a few chunk sizes (~8 MiB) instead of several times the tensor.
CHUNK_ELEMENTS = 1 << 20


def _chunks(x: torch.Tensor) -> list[torch.Tensor]:
    """Views of ``x`` with about :data:`CHUNK_ELEMENTS` elements each that together cover it once.

    A contiguous tensor is split flat; a non-contiguous one along dim 0 (a view, never a copy), so a chunk is
    at most one dim-0 slice when a slice is larger than a chunk."""
    n = x.numel()
    if n <= CHUNK_ELEMENTS:
        return [x]
    if x.is_contiguous():
        return list(x.view(-1).split(CHUNK_ELEMENTS))
    rows = max(1, CHUNK_ELEMENTS // max(1, n // x.shape[0]))
    return list(x.split(rows, dim=0))


def _partial(
    x: torch.Tensor, scratch: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]
) -> torch.Tensor:
    """Device-side partial statistics of one chunk: float64 ``[finite min, finite max, finite non-zero absmin,
    n_finite, n_nan, n_posinf, n_neginf, n_zero]``, +inf/-inf for a min/max over no value. They combine across
    chunks exactly: min, max, min, then sums.

    Every elementwise result is written into ``scratch`` (two buffers of ``x``'s dtype, two bool buffers, at
    least ``x.numel()`` elements each), reused across chunks, so the chunks allocate nothing tensor-sized."""
    n = x.numel()
    v, a, f, g = (b[:n].view(x.shape) for b in scratch)
    inf = torch.full((), _INF, dtype=x.dtype, device=x.device)
    torch.abs(x, out=a)
    torch.lt(a, inf, out=f)  # finite: NaN and ±inf are not below +inf
    fmin = torch.where(f, x, inf, out=v).amin()
    fmax = torch.where(f, x, -inf, out=v).amax()
    torch.logical_and(torch.ne(a, 0, out=g), f, out=g)
    absmin = torch.where(g, a, inf, out=v).amin()
    n_finite = torch.count_nonzero(f)
    n_nan = torch.count_nonzero(torch.ne(x, x, out=g))
    n_posinf = torch.count_nonzero(torch.eq(x, inf, out=g))
    n_neginf = torch.count_nonzero(torch.eq(x, -inf, out=g))
    n_zero = torch.count_nonzero(torch.eq(a, 0, out=g))
    counts = torch.stack([n_finite, n_nan, n_posinf, n_neginf, n_zero])
    return torch.cat([torch.stack([fmin, fmax, absmin]).double(), counts.double()])


def stats_device(t: torch.Tensor) -> torch.Tensor:
    """Statistics of ``t`` as a float64 tensor of shape ``(8,)`` on ``t.device``, with no host synchronisation.

    A tensor of more than :data:`CHUNK_ELEMENTS` elements is reduced chunk by chunk (:func:`_chunks`; the
    number of chunks follows from the shape, never from values), so the temporaries stay a few chunk sizes.

    Args:
        t: a tensor for which :func:`describable` is true; any shape; float16, bfloat16, float32, float64 or a
            float8 type.

    Returns:
        ``torch.float64`` tensor ``[min, max, absmax, absmin, n_nan, n_posinf, n_neginf, n_zero]`` (the counts
        are exact integers up to 2**53 elements).
    """
    chunks = [_work_view(c) for c in _chunks(t.detach())]
    size = max(c.numel() for c in chunks)
    dtype, device = chunks[0].dtype, chunks[0].device
    scratch = (
        torch.empty(size, dtype=dtype, device=device),
        torch.empty(size, dtype=dtype, device=device),
        torch.empty(size, dtype=torch.bool, device=device),
        torch.empty(size, dtype=torch.bool, device=device),
    )
    parts = [_partial(c, scratch) for c in chunks]
    if len(parts) == 1:
        p = parts[0]
    else:
        m = torch.stack(parts)
        p = torch.cat([torch.stack([m[:, 0].amin(), m[:, 1].amax(), m[:, 2].amin()]), m[:, 3:].sum(0)])
    nan64 = torch.full((), _NAN, dtype=torch.float64, device=p.device)
    no_finite = p[3] == 0
    fmin64 = torch.where(no_finite, nan64, p[0])
    fmax64 = torch.where(no_finite, nan64, p[1])
    absmax64 = torch.maximum(fmin64.abs(), fmax64.abs())
    absmin64 = torch.where(torch.isinf(p[2]), nan64, p[2])
    return torch.cat([torch.stack([fmin64, fmax64, absmax64, absmin64]), p[4:]])


def _finite(v: float) -> bool:
    return not (math.isinf(v) or math.isnan(v))


def stats_host(t: torch.Tensor) -> tuple[float, ...]:
    """Statistics of a CPU tensor ``t`` as 8 Python floats, same order and meaning as :func:`stats_device`.

    Reads values on the host (free for CPU tensors) to skip work. One ``aminmax`` pass gives min/max and proves
    the tensor free of inf/NaN (tensors holding them fall back to :func:`stats_device`). A tensor of one sign
    with no zero needs nothing more; otherwise one ``|x|`` pass read as unsigned integers gives the zero count
    and the smallest non-zero ``|x|`` (:func:`_zeros_and_absmin`).
    """
    if t.element_size() == 1 and t.numel() > CHUNK_ELEMENTS:  # float8: widen chunk by chunk, not all at once
        return tuple(stats_device(t).tolist())
    x = _work_view(t)
    lo_t, hi_t = torch.aminmax(x)
    lo, hi = float(lo_t), float(hi_t)
    if not (_finite(lo) and _finite(hi)):
        return tuple(stats_device(x).tolist())
    absmax = max(abs(lo), abs(hi))
    if lo > 0 or hi < 0:  # one sign, no zeros
        return (lo, hi, absmax, lo if lo > 0 else -hi, 0.0, 0.0, 0.0, 0.0)
    n_zero, absmin = 0, _INF
    for c in _chunks(x):  # |x| one chunk at a time: the temporary stays a chunk, not the tensor
        a = torch.abs(c)
        if lo < 0 < hi:  # mixed signs: zeros are rare outside ReLU/dropout outputs, so look for them first
            smallest = float(a.amin())
            if smallest > 0:
                absmin = min(absmin, smallest)
                continue
        z, m = _zeros_and_absmin(a)
        del a
        n_zero += z
        if not math.isnan(m):
            absmin = min(absmin, m)
    return (lo, hi, absmax, _NAN if absmin == _INF else absmin, 0.0, 0.0, 0.0, float(n_zero))


_UINT = {2: np.uint16, 4: np.uint32, 8: np.uint64}
_INT = {2: torch.int16, 4: torch.int32, 8: torch.int64}
_FLOAT_OF_BITS = {torch.float16: np.float16, torch.float32: np.float32, torch.float64: np.float64}


def _zeros_and_absmin(a: torch.Tensor) -> tuple[int, float]:
    """Zero count and smallest non-zero value of ``a = |x|`` (a finite CPU tensor, modified in place).

    ``|x|`` has its sign bit clear, so its bit pattern read as an unsigned integer orders like its value.
    Subtracting 1 (in place, on the temporary) sends zeros to the largest integer and keeps every other
    value's order, so the minimum plus 1 is the bit pattern of the smallest non-zero ``|x|``.
    """
    a = a.contiguous().reshape(-1)
    u = a.view(_INT[a.element_size()]).numpy().view(_UINT[a.element_size()])
    n_zero = int(u.size - np.count_nonzero(u))
    if n_zero == u.size:
        return n_zero, _NAN
    u -= 1
    bits = np.array([u.min() + 1], dtype=u.dtype)
    if a.dtype == torch.bfloat16:  # bfloat16 is the top half of a float32
        return n_zero, float(np.array([int(bits[0]) << 16], dtype=np.uint32).view(np.float32)[0])
    return n_zero, float(bits.view(_FLOAT_OF_BITS[a.dtype])[0])


def is_clean_host(t: torch.Tensor) -> bool:
    """One ``aminmax`` pass over a CPU tensor: True when it holds no NaN or ±inf (NaN propagates into min/max
    and ±inf shows as an extreme)."""
    lo, hi = torch.aminmax(_work_view(t))
    return _finite(float(lo)) and _finite(float(hi))


# ---------------------------------------------------------------------------------------------- op-level rule
def tensor_kinds(t: torch.Tensor) -> frozenset[str]:
    """Non-finite kinds (``"nan"``, ``"posinf"``, ``"neginf"``) held by a describable tensor, read on the host
    (one ``isfinite`` pass when it is clean). Not for hooks on an accelerator: it synchronises."""
    x = _work_view(t)
    if bool(torch.isfinite(x).all()):
        return frozenset()
    out = []
    if bool(torch.isnan(x).any()):
        out.append("nan")
    if bool(torch.isposinf(x).any()):
        out.append("posinf")
    if bool(torch.isneginf(x).any()):
        out.append("neginf")
    return frozenset(out)


def scalar_kinds(v: object) -> frozenset[str]:
    """The non-finite kind of a Python scalar argument (``float("-inf")`` gives ``{"neginf"}``), else empty."""
    if isinstance(v, float) and not math.isfinite(v):
        return frozenset({"nan" if math.isnan(v) else ("posinf" if v > 0 else "neginf")})
    return frozenset()


def op_input_kinds(args: Any, kwargs: Any) -> tuple[list[torch.Tensor], frozenset[str]]:
    """The op-level "produced" rule, shared by :func:`nantrace.hunt` and the forward replay of
    :func:`nantrace.trace`: an op *produced* a kind when one of its outputs holds it and this set does not.

    Returns the describable tensors among an op's arguments (nested in tuples/lists/dicts) and the non-finite
    kinds its inputs already hold: those of those tensors, and those of its non-finite Python scalar arguments.
    A scalar ``-inf`` (``masked_fill(mask, -inf)``, ``where(c, x, -inf)``, ``torch.full(..., -inf)``,
    ``x * -inf``) is an intended value, so an output holding -inf from it is not produced; a kind beyond it
    (NaN from ``0 * -inf``, a NaN softmax row of a fully masked row) is. Meta tensors are skipped. Call it
    before the op runs (an in-place op overwrites its input)."""
    tensors: list[torch.Tensor] = []
    before: frozenset[str] = frozenset()
    for leaf in tree_leaves((args, kwargs)):
        if isinstance(leaf, torch.Tensor):
            if describable(leaf) and leaf.device.type != "meta":
                tensors.append(leaf)
                before |= tensor_kinds(leaf)
        else:
            before |= scalar_kinds(leaf)
    return tensors, before
