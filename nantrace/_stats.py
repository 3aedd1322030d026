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
  one min/max pass (``torch.aminmax``; ``amin`` and ``amax`` for large float32/float64 tensors): NaN propagates into min/max and ±inf shows as an extreme, so a finite result proves
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


#: From this many elements on, a float32/float64 tensor's min and max are two reductions (``amin``, ``amax``)
#: instead of one ``aminmax``: on CPU (torch 2.13) ``aminmax`` of these dtypes costs ~1.6× the two passes
#: together (524288 float32 elements: 88 µs against 55 µs, one thread); below it, one call is cheaper. For float16
#: and bfloat16 ``aminmax`` is the faster of the two at every size. Same values either way: all three
#: propagate NaN and return ±inf as extremes.
SPLIT_MINMAX_ELEMENTS = 1 << 15
_SPLIT_DTYPES = (torch.float32, torch.float64)


def _min_max(x: torch.Tensor) -> tuple[float, float]:
    """``(min, max)`` of ``x`` as Python floats (NaN when ``x`` holds one), by the cheaper reduction."""
    if x.dtype in _SPLIT_DTYPES and x.numel() >= SPLIT_MINMAX_ELEMENTS:
        return float(x.amin()), float(x.amax())
    lo, hi = torch.aminmax(x)
    return float(lo), float(hi)


def _finite(v: float) -> bool:
    return not (math.isinf(v) or math.isnan(v))


def stats_host(t: torch.Tensor) -> tuple[float, ...]:
    """Statistics of a CPU tensor ``t`` as 8 Python floats, same order and meaning as :func:`stats_device`.

    Reads values on the host (free for CPU tensors) to skip work. One min/max pass (:func:`_min_max`) gives
    min/max and proves the tensor free of inf/NaN (tensors holding them fall back to :func:`stats_device`). A
    tensor of one sign with no zero needs nothing more. A tensor of both signs gets its smallest ``|x|`` from two
    integer reductions over its bits, with no temporary (:func:`_least_magnitude`); only a tensor holding a
    zero takes one ``|x|`` pass read as unsigned integers for the zero count and the smallest non-zero ``|x|``
    (:func:`_zeros_and_absmin`).
    """
    if t.element_size() == 1 and t.numel() > CHUNK_ELEMENTS:  # float8: widen chunk by chunk, not all at once
        return tuple(stats_device(t).tolist())
    x = _work_view(t)
    lo, hi = _min_max(x)
    if not (_finite(lo) and _finite(hi)):
        return tuple(stats_device(x).tolist())
    absmax = max(abs(lo), abs(hi))
    if lo > 0 or hi < 0:  # one sign, no zeros
        return (lo, hi, absmax, lo if lo > 0 else -hi, 0.0, 0.0, 0.0, 0.0)
    if lo < 0 < hi:
        least = _least_magnitude(x)
        if least:  # no ±0: it is the smallest non-zero |x|
            return (lo, hi, absmax, _float_of_bits(least, x.dtype), 0.0, 0.0, 0.0, 0.0)
    n_zero, absmin = 0, _INF
    for c in _chunks(x):  # |x| one chunk at a time: the temporary stays a chunk, not the tensor
        z, m = _zeros_and_absmin(torch.abs(c))
        n_zero += z
        if not math.isnan(m):
            absmin = min(absmin, m)
    return (lo, hi, absmax, _NAN if absmin == _INF else absmin, 0.0, 0.0, 0.0, float(n_zero))


def _least_magnitude(x: torch.Tensor) -> int:
    """For a finite CPU tensor holding both signs: the bit pattern (sign bit cleared) of its value nearest zero,
    from one or two ``min`` reductions over its bits and no temporary; 0 when it holds ``+0.0`` or ``-0.0`` (or
    its bits cannot be read in place), where the caller takes the ``|x|`` path.

    An IEEE float's bits are a sign bit above the magnitude bits, and the magnitude bits order like ``|x|``.
    Read as unsigned integers, every value with the sign bit clear is below every value with it set, so the
    minimum is the non-negative value nearest zero (``+0.0``: 0). Read as signed integers, the values with the
    sign bit set are the negative ones, ordered by their magnitude bits, so the minimum is the negative value
    nearest zero (``-0.0``: magnitude 0). The unsigned pass comes first (the zeros of ReLU, dropout and masks
    are mostly ``+0.0``); the signed one is skipped when it found a zero.
    """
    size = x.element_size()
    try:
        signed = x.view(_INT[size]).numpy()
    except (RuntimeError, TypeError):  # bits numpy cannot read (a negative-bit view): the caller's |x| path
        return 0
    pos = int(signed.view(_UINT[size]).min())
    if pos == 0:
        return 0
    return min(pos, int(signed.min()) & _MAGNITUDE[size])


def _float_of_bits(bits: int, dtype: torch.dtype) -> float:
    """The value of a non-negative bit pattern of ``dtype`` as a Python float."""
    if dtype == torch.bfloat16:  # bfloat16 is the top half of a float32
        return float(np.array([bits << 16], dtype=np.uint32).view(np.float32)[0])
    return float(np.array([bits], dtype=_UINT[torch.finfo(dtype).bits // 8]).view(_FLOAT_OF_BITS[dtype])[0])


_UINT = {2: np.uint16, 4: np.uint32, 8: np.uint64}
_INT = {2: torch.int16, 4: torch.int32, 8: torch.int64}
_FLOAT_OF_BITS = {torch.float16: np.float16, torch.float32: np.float32, torch.float64: np.float64}
_MAGNITUDE = {2: (1 << 15) - 1, 4: (1 << 31) - 1, 8: (1 << 63) - 1}  # every bit but the sign bit


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
    return n_zero, _float_of_bits(int(u.min()) + 1, a.dtype)


def is_clean_host(t: torch.Tensor) -> bool:
    """One min/max pass (:func:`_min_max`) over a CPU tensor: True when it holds no NaN or ±inf (NaN propagates into min/max
    and ±inf shows as an extreme)."""
    lo, hi = _min_max(_work_view(t))
    return _finite(lo) and _finite(hi)


# ---------------------------------------------------------------------------------------------- op-level rule
_NO_KINDS: frozenset[str] = frozenset()


def tensor_kinds(t: torch.Tensor) -> frozenset[str]:
    """Non-finite kinds (``"nan"``, ``"posinf"``, ``"neginf"``) held by a describable tensor, read on the host
    (one min/max pass when it is clean: NaN propagates into min/max and ±inf shows as an extreme; ~20× cheaper
    than ``isfinite(x).all()``). Not for hooks on an accelerator: it synchronises."""
    x = _work_view(t)
    lo, hi = _min_max(x)
    if _finite(lo) and _finite(hi):
        return _NO_KINDS
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
