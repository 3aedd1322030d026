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
* :func:`stats_host` is for CPU tensors, where reading a value costs no device synchronisation. It reads the
  float's bits as integers: one integer min/max pass gives min/max, the smallest ``|x|`` of a tensor of one sign
  and proof that it holds no inf/NaN (their bit patterns are the largest magnitudes), so the inf/NaN counts are
  zero without counting; only a tensor holding a zero takes the passes that count them. Each pass is numpy's (one
  thread, the cheaper call) or, for large contiguous tensors, torch's (two threads). It returns a tuple of Python
  floats.

Only dense floating-point tensors with at least one element are described (:func:`describable`). float8
tensors are widened to float32 first because most reductions do not accept them.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np
import torch
from torch.utils._pytree import tree_leaves

from ._schema import N_STATS, STAT_NAMES

__all__ = [
    "CHUNK_ELEMENTS",
    "N_STATS",
    "STAT_NAMES",
    "describable",
    "either_sign",
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

    Reads values on the host (free for CPU tensors) to skip work. The float's bits are read as integers
    (:func:`_bits_stats`): one integer min/max pass gives min/max of a tensor of one sign, its smallest ``|x|``,
    and proves it free of inf/NaN; a tensor of both signs takes an unsigned maximum (or a float ``amin``) and an
    unsigned minimum more; only a tensor holding a zero (ReLU, dropout, masks) takes the passes that count them
    and find the smallest non-zero ``|x|`` (:func:`_zeros_and_least`). A tensor holding inf/NaN falls back to
    :func:`stats_device`.
    """
    kind = _KINDS.get(t.dtype)
    if kind is not None:
        x = t.detach() if t.requires_grad else t  # numpy reads a tensor outside autograd only
    elif t.element_size() == 1 and t.numel() > CHUNK_ELEMENTS:  # float8: widened a chunk at a time
        return tuple(stats_device(t).tolist())
    else:
        x = _work_view(t)
        kind = _KINDS.get(x.dtype)
    got = _bits_stats(x, kind) if kind is not None and not x.is_neg() else None
    if got is None:
        return tuple(stats_device(x).tolist())
    return got


#: The integer min/max pass over a tensor of at most this many elements is numpy's (one thread, ~1 µs a call)
#: instead of torch's ``aminmax`` (two threads, a few µs a call): below it, the call's cost is most of the
#: statistic's (measured in ``benchmarks/stats_alternatives.py``). A strided tensor is read by numpy at any size:
#: torch's ``aminmax`` over a transposed view costs several times numpy's min and max, which reduce in memory order
#: (a transposed 512×1024 float32 tensor's bits: 0.50 ms against 0.09 ms).
NUMPY_ELEMENTS = 1 << 17

#: Above this many elements, the passes torch can make (the float ``amin`` for the most negative value of a tensor
#: of both signs; per chunk, the zero count and the elementwise steps of :func:`_zeros_and_least`) run in torch,
#: on two threads. Below it, numpy's one-threaded passes cost less, in the sequence of passes a statistic makes
#: over one tensor (measured on the tensors one training step records, 2 threads).
TORCH_PASS_ELEMENTS = 1 << 19


class _Kind(NamedTuple):
    """How a float dtype's bits are read: its integer dtypes, the bit patterns that matter, and a bit pattern's
    value."""

    bits: torch.dtype  # the signed integer dtype of the same size (a torch view)
    float_np: Any  # numpy's float dtype, None for bfloat16 (numpy has none: its bits are viewed in torch)
    int_np: Any
    uint_np: Any
    inf: int  # the bit pattern of +inf: a magnitude (sign bit cleared) at or above it is inf or NaN
    sign: int  # the sign bit alone, read as a signed integer (the smallest one)
    value: Callable[[int], float]  # the value of a non-negative bit pattern (``struct``: no array made)


def _value(bits_fmt: str, float_fmt: str, shift: int = 0) -> Callable[[int], float]:
    """The value of a non-negative bit pattern, read by ``struct`` (no array made)."""
    pack, unpack = struct.Struct(bits_fmt).pack, struct.Struct(float_fmt).unpack
    if shift:  # bfloat16 is the top half of a float32
        return lambda bits: unpack(pack(bits << shift))[0]
    return lambda bits: unpack(pack(bits))[0]


_KINDS = {
    torch.float16: _Kind(
        torch.int16, np.float16, np.int16, np.uint16, 0x7C00, -(1 << 15), _value("<H", "<e")
    ),
    torch.bfloat16: _Kind(torch.int16, None, np.int16, np.uint16, 0x7F80, -(1 << 15), _value("<I", "<f", 16)),
    torch.float32: _Kind(
        torch.int32, np.float32, np.int32, np.uint32, 0x7F800000, -(1 << 31), _value("<I", "<f")
    ),
    torch.float64: _Kind(
        torch.int64, np.float64, np.int64, np.uint64, 0x7FF0000000000000, -(1 << 63), _value("<Q", "<d")
    ),
}
# the ufuncs' reductions, called directly: ``ndarray.min()`` goes through two Python-level numpy wrappers first
_np_min, _np_max = np.minimum.reduce, np.maximum.reduce
_count_nonzero = np.count_nonzero


def _bits_stats(x: torch.Tensor, kind: _Kind) -> tuple[float, ...] | None:
    """Statistics of a finite CPU tensor from its bits read as integers; None when it holds inf/NaN (or numpy
    cannot read its bits in place).

    An IEEE float's bits are a sign bit above magnitude bits that order like ``|x|``. Read as *signed* integers,
    the non-negative values keep their order and the negative ones (sign bit set) order by magnitude, below them:
    the minimum is the negative value nearest zero (``-0.0`` is the sign bit alone) or, when there is none, the
    smallest value; the maximum is the largest value or, when every sign bit is set, the most negative one. So one
    signed min/max gives everything for a tensor of one sign. A tensor of both signs also needs its most negative
    value (the *unsigned* maximum, or a float ``amin`` for a large tensor) and its non-negative value nearest
    zero (the unsigned minimum: every sign-bit-set pattern is above every other). A zero shows as a magnitude of 0
    there; :func:`_zeros_and_least` then counts them.
    """
    bits, float_np, int_np, uint_np, inf, sign, value = kind
    n = x.numel()
    try:
        a = x.numpy().view(int_np) if float_np is not None else x.view(bits).numpy()
        if n <= NUMPY_ELEMENTS or not x.is_contiguous():  # torch's strided reductions are the slower
            smin, smax = int(_np_min(a, axis=None)), int(_np_max(a, axis=None))
        else:
            lo_t, hi_t = torch.aminmax(x.view(bits))
            smin, smax = int(lo_t), int(hi_t)
    except (RuntimeError, TypeError, ValueError):  # bits numpy cannot read in place
        return None
    if smin >= 0:  # no sign bit set: every value is +0.0 or positive
        if smax >= inf:
            return None
        hi = value(smax)
        if smin > 0:
            lo = value(smin)
            return (lo, hi, hi, lo, 0.0, 0.0, 0.0, 0.0)
        lo, least_neg = 0.0, -1  # a +0.0 and no -0.0: the zeros are read on the bits as they are
        plus_only = True
    elif smax < 0:  # every sign bit set: -0.0 or negative
        big, small = smax - sign, smin - sign  # magnitude bits of the most negative and of the nearest zero
        if big >= inf:
            return None
        lo, hi = -value(big), -value(small)
        if small > 0:
            return (lo, hi, -lo, -hi, 0.0, 0.0, 0.0, 0.0)
        least_neg, plus_only = -1, False  # a -0.0: the zeros are read on the magnitude bits
    else:  # both signs
        if smax >= inf:
            return None
        u = a.view(uint_np)
        if n <= TORCH_PASS_ELEMENTS or not x.is_contiguous():
            big = int(_np_max(u, axis=None)) + sign  # the largest unsigned pattern: the most negative value
            if big >= inf:
                return None
            lo = -value(big)
        else:
            lo = float(x.amin())  # two threads
            if not lo > -_INF:  # -inf, or NaN (amin propagates it)
                return None
        hi = value(smax)
        least_neg = smin - sign  # magnitude bits of the negative value nearest zero (0: a -0.0)
        if least_neg > 0:
            pos = int(_np_min(u, axis=None))  # the non-negative value nearest zero (0: a +0.0)
            if pos > 0:
                return (lo, hi, max(-lo, hi), value(min(pos, least_neg)), 0.0, 0.0, 0.0, 0.0)
        plus_only = least_neg > 0  # a +0.0 and no -0.0, or a -0.0
    zeros, least = _zeros_and_least(x, a, kind, plus_only=plus_only)
    if least_neg > 0 and not 0 <= least < least_neg:  # the negative value nearest zero (the signed minimum)
        least = least_neg
    absmin = value(least) if least >= 0 else _NAN
    return (lo, hi, max(abs(lo), abs(hi)), absmin, 0.0, 0.0, 0.0, float(zeros))


def _zeros_and_least(x: torch.Tensor, a: np.ndarray, kind: _Kind, *, plus_only: bool) -> tuple[int, int]:
    """``(zero count, bits of the smallest non-zero positive value or magnitude)`` of a finite tensor ``x`` whose
    integer bits numpy reads as ``a``; -1 for the bits when every element is zero.

    ``plus_only``: ``x`` holds no ``-0.0``, so a zero is the pattern 0 and the bits are read as they are: the
    zero count is the elements less their non-zero count, and the smallest positive value is one more than the
    unsigned minimum of the bits minus 1 (a zero wraps to the largest pattern; a negative value stays above every
    positive one, so the bits returned are a negative value's, sign bit set, when there is no positive value:
    the caller compares them with the negative value nearest zero, its signed minimum). Otherwise the magnitude
    bits (sign bit cleared: a temporary) are counted and reduced the same way, so ``-0.0`` counts as a zero.

    Chunk by chunk (:func:`_chunks`), so a temporary is one chunk; a contiguous chunk of more than
    :data:`TORCH_PASS_ELEMENTS` elements is counted and shifted in torch (two threads), the rest in numpy (one
    thread; numpy also lays a temporary out like a strided chunk, so both are read in memory order)."""
    keep, n = -kind.sign - 1, x.numel()
    parts = [a] if n <= CHUNK_ELEMENTS else [c.numpy() for c in _chunks(x.view(kind.bits))]
    nonzero, low = 0, -1
    for c in parts:
        if c.size > TORCH_PASS_ELEMENTS and c.flags.c_contiguous:
            ct = torch.from_numpy(c)
            if plus_only:
                nonzero += int(torch.count_nonzero(ct))
                m = ct - 1
            else:
                m = torch.bitwise_and(ct, keep)
                nonzero += int(torch.count_nonzero(m))
                m.sub_(1)
            s = m.numpy()
        elif plus_only:
            nonzero += int(_count_nonzero(c))
            s = c - 1
        else:
            s = c & keep
            nonzero += int(_count_nonzero(s))
            s -= 1
        part_low = int(_np_min(s.view(kind.uint_np), axis=None))
        low = part_low if low < 0 else min(low, part_low)
    return n - nonzero, (low + 1 if nonzero else -1)


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
    (NaN from ``0 * -inf``, a NaN softmax row of a fully masked row) is. Compare an output's kinds with
    :func:`either_sign` of these (an inf of one sign explains both). Meta tensors are skipped. Call it before the op runs (an in-place op overwrites its
    input)."""
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


_INFS = frozenset({"posinf", "neginf"})


def either_sign(kinds: frozenset[str]) -> frozenset[str]:
    """``kinds`` with both signs of inf when it holds one: an inf of either sign among an op's inputs explains
    infs of both signs in its output (``x * inf`` with negative ``x``, ``-x``, ``a - inf``), so a sign flip is
    not a kind produced; NaN from ``0 * inf`` or ``inf - inf`` still is."""
    return kinds | _INFS if kinds & _INFS else kinds
