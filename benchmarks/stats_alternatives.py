"""Candidate replacements for ``nantrace._stats.stats_host`` (the CPU statistics path), measured against it.

Every candidate returns exactly what ``stats_host`` returns (same 8 floats; ``--check`` compares them on random
tensors with zeros, ``-0.0``, one sign only, all zeros, inf/NaN, non-contiguous, fp16/bf16/fp32/fp64). All
keep the one ``torch.aminmax`` pass, the shortcut for one-sign tensors without zeros (``lo > 0`` or ``hi < 0``:
nothing to count) and the ``|x|.amin()`` probe for mixed-sign tensors (a non-zero minimum proves there are no
zeros and *is* absmin). They differ for tensors that hold zeros (ReLU/dropout outputs and their gradients,
36 of the 177 tensors of a step of the benchmark transformer, but most of the statistics time):

* ``stats_host (commit 406951b)``: the first version (always ``count_nonzero``, ``where(|x| == 0, ...)``);
* ``stats_host (installed)``: whatever ``nantrace._stats.stats_host`` is now;
* ``int bits, torch only``: zeros counted by ``count_nonzero`` on the *integer view* of ``|x|`` (2.3x faster
  than on the float tensor here), absmin from the same integer view in place: ``bits - 1`` turns ``±0`` into
  -1, ``& 0x7FFF...`` turns that into the largest value, so ``amin() + 1`` is the bit pattern of the smallest
  non-zero ``|x|`` (IEEE floats of one sign order like their bit patterns). No bool tensors, no ``where``.
* ``int bits, numpy views``: the same arithmetic on a zero-copy numpy view of the same memory (unsigned, so
  ``bits - 1`` wraps ``0`` to the largest value), with zeros counted by ``np.count_nonzero(bits == top)``
  (SIMD compare + popcount): numpy's integer ops are 2-4x faster than torch's here. Integer views work for
  fp16/bf16 too (numpy needs no bfloat16).

``python benchmarks/stats_alternatives.py [--check] [--threads N]``: the check, then µs per call on synthetic
tensors.
"""

from __future__ import annotations

import argparse
import math
import struct
import sys
import time
from collections.abc import Callable

import numpy as np
import torch

from nantrace._stats import stats_device, stats_host

_NAN = float("nan")

# element size -> (torch signed int dtype of that size, |x| bit mask, 1, largest value; the last three as numpy
# unsigned scalars, built once: np.iinfo() and scalar construction cost microseconds per call)
_BITS: dict[int, tuple[torch.dtype, np.unsignedinteger, np.unsignedinteger, np.unsignedinteger]] = {
    size: (itype, utype(mask), utype(1), utype(np.iinfo(utype).max))
    for size, itype, utype, mask in (
        (2, torch.int16, np.uint16, 0x7FFF),
        (4, torch.int32, np.uint32, 0x7FFF_FFFF),
        (8, torch.int64, np.uint64, 0x7FFF_FFFF_FFFF_FFFF),
    )
}


def _bits_to_float(bits: int, dtype: torch.dtype) -> float:
    """The value of a float of ``dtype`` given its (non-negative) bit pattern."""
    if dtype == torch.float32:
        return struct.unpack("<f", struct.pack("<I", bits))[0]
    if dtype == torch.float64:
        return struct.unpack("<d", struct.pack("<Q", bits))[0]
    if dtype == torch.float16:
        return struct.unpack("<e", struct.pack("<H", bits))[0]
    if dtype == torch.bfloat16:
        return struct.unpack("<f", struct.pack("<I", bits << 16))[0]
    raise TypeError(dtype)


def _work_view(t: torch.Tensor) -> torch.Tensor:
    x = t.detach()
    if x.element_size() == 1:
        x = x.float()
    return x


def _zeros_absmin_numpy(x: torch.Tensor, nonneg: bool) -> tuple[int, float]:
    """``(n_zero, smallest non-zero |x|)`` of a finite CPU tensor holding zeros, from a numpy view of its bits.

    ``nonneg``: ``x`` is a temporary ``|x|`` (no sign bits, may be modified in place)."""
    itype, mask, one, top = _BITS[x.element_size()]
    a = x.view(itype).numpy().view(mask.dtype)  # zero-copy, any strides
    if nonneg:
        a -= one  # in place: x is our own |x| temporary
        b = a
    else:
        b = a & mask  # |x| bits; -0.0 -> 0
        b -= one
    n_zero = int(np.count_nonzero(b == top))
    if n_zero == b.size:
        return n_zero, _NAN
    return n_zero, _bits_to_float(int(b.min()) + 1, x.dtype)


def _zeros_absmin_torch(x: torch.Tensor, nonneg: bool) -> tuple[int, float]:
    """The same with torch ops on a signed integer view: zeros -> -1 -> mask."""
    itype, umask, _, _ = _BITS[x.element_size()]
    mask = int(umask)
    b = x.view(itype) if nonneg else x.view(itype).bitwise_and(mask)
    n_zero = b.numel() - int(torch.count_nonzero(b))
    if n_zero == b.numel():
        return n_zero, _NAN
    b.sub_(1)
    b.bitwise_and_(mask)
    return n_zero, _bits_to_float(int(b.amin()) + 1, x.dtype)


def _make(zeros_absmin: Callable[[torch.Tensor, bool], tuple[int, float]]) -> Callable[..., tuple]:
    def stats(t: torch.Tensor) -> tuple[float, ...]:
        x = _work_view(t)
        lo_t, hi_t = torch.aminmax(x)
        lo, hi = float(lo_t), float(hi_t)
        if math.isinf(lo) or math.isinf(hi) or lo != lo or hi != hi:
            return tuple(stats_device(x).tolist())
        absmax = max(abs(lo), abs(hi))
        if lo > 0:  # no zero can exist: nothing to count
            return (lo, hi, absmax, lo, 0.0, 0.0, 0.0, 0.0)
        if hi < 0:
            return (lo, hi, absmax, -hi, 0.0, 0.0, 0.0, 0.0)
        if lo == 0 and hi == 0:
            return (lo, hi, 0.0, _NAN, 0.0, 0.0, 0.0, float(x.numel()))
        if lo < 0 < hi:
            ax = x.abs()
            m = float(ax.amin())
            if m > 0:  # the smallest |x| is not zero: no zeros, and it is absmin
                return (lo, hi, absmax, m, 0.0, 0.0, 0.0, 0.0)
            n_zero, absmin = zeros_absmin(ax, True)
        else:  # one sign with zeros (ReLU output, or its negative)
            n_zero, absmin = zeros_absmin(x, False)
        return (lo, hi, absmax, absmin, 0.0, 0.0, 0.0, float(n_zero))

    return stats


def stats_host_406951b(t: torch.Tensor) -> tuple[float, ...]:
    """``stats_host`` as first committed (406951b), kept for comparison."""
    x = _work_view(t)
    lo_t, hi_t = torch.aminmax(x)
    lo, hi = float(lo_t), float(hi_t)
    if math.isinf(lo) or math.isinf(hi) or lo != lo or hi != hi:
        return tuple(stats_device(x).tolist())
    numel = x.numel()
    n_zero = numel - int(torch.count_nonzero(x))
    absmax = max(abs(lo), abs(hi))
    if n_zero == 0:
        if lo > 0:
            absmin = lo
        elif hi < 0:
            absmin = -hi
        else:
            absmin = float(x.abs().amin())
    elif n_zero == numel:
        absmin = _NAN
    elif lo >= 0:
        absmin = float(torch.where(x == 0, hi_t, x).amin())
    elif hi <= 0:
        absmin = -float(torch.where(x == 0, lo_t, x).amax())
    else:
        ax = x.abs()
        absmin = float(torch.where(ax == 0, absmax, ax).amin())
    return (lo, hi, absmax, absmin, 0.0, 0.0, 0.0, float(n_zero))


stats_bits_torch = _make(_zeros_absmin_torch)
stats_bits_numpy = _make(_zeros_absmin_numpy)

CANDIDATES: dict[str, Callable[[torch.Tensor], tuple[float, ...]]] = {
    "stats_host (commit 406951b)": stats_host_406951b,
    "stats_host (installed)": stats_host,
    "int bits, torch only": stats_bits_torch,
    "int bits, numpy views": stats_bits_numpy,
}


def _same(a: tuple[float, ...], b: tuple[float, ...]) -> bool:
    return all((x == y) or (x != x and y != y) for x, y in zip(a, b, strict=True))


def check(n: int = 300) -> int:
    """Equality of every candidate with ``stats_host`` on random edge-case tensors; returns #mismatches."""
    g = torch.Generator().manual_seed(1)
    bad = 0
    for i in range(n):
        dtype = (torch.float32, torch.float16, torch.bfloat16, torch.float64)[i % 4]
        shape = [(7,), (33, 5), (4, 8, 16), (1,)][i // 4 % 4]
        x = torch.randn(shape, generator=g).to(dtype) * 10 ** float(torch.randint(-6, 6, (), generator=g))
        kind = i // 16 % 8
        if kind == 1:
            x = x.abs()
        elif kind == 2:
            x = -x.abs()
        elif kind == 3:
            x[x.abs() < x.abs().median()] = 0
        elif kind == 4:
            x = x.relu()
        elif kind == 5:
            x.zero_()
            x.view(-1)[0] = -0.0
        elif kind == 6:
            x[x.abs() < x.abs().median()] = -0.0
        elif kind == 7:
            x.view(-1)[0] = float("inf")
        if x.dim() == 2 and i % 3 == 0:
            x = x.t()  # non-contiguous
        ref = stats_host(x)
        for name, f in CANDIDATES.items():
            got = f(x)
            if not _same(ref, got):
                bad += 1
                print(f"MISMATCH {name} dtype={dtype} shape={tuple(x.shape)} kind={kind}: {got} != {ref}")
    return bad


def time_us(f: Callable[[torch.Tensor], object], x: torch.Tensor, reps: int = 25) -> float:
    """Best-of-``reps`` µs of one call (best-of is robust to other processes on the machine)."""
    f(x)
    best = math.inf
    for _ in range(reps):
        t0 = time.perf_counter()
        f(x)
        best = min(best, time.perf_counter() - t0)
    return best * 1e6


def synthetic_table(dtypes: tuple[torch.dtype, ...] = (torch.float32, torch.float16)) -> str:
    shapes = {"256": (256,), "256x256": (256, 256), "8x64x256": (8, 64, 256), "8x64x1024": (8, 64, 1024)}
    kinds: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
        "mixed, no zeros": lambda x: x,
        "mixed, 4% zeros": lambda x: x.masked_fill(x.abs() < 0.05, 0),
        "ReLU output": torch.relu,
        "positive": torch.abs,
    }
    lines = [
        "| dtype | tensor | shape | " + " | ".join(CANDIDATES) + " |",
        "| --- | --- | --- | " + " | ".join("---:" for _ in CANDIDATES) + " |",
    ]
    for dtype in dtypes:
        for kname, kf in kinds.items():
            for sname, shape in shapes.items():
                x = kf(torch.randn(shape, generator=torch.Generator().manual_seed(0))).to(dtype)
                x = x + 0.5 if kname == "positive" else x
                cells = [f"{time_us(f, x):.1f}" for f in CANDIDATES.values()]
                lines.append(f"| {str(dtype)[6:]} | {kname} | {sname} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="stats_host candidates: equality check and µs per call")
    p.add_argument("--check", action="store_true", help="only the equality check")
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    bad = check()
    print(f"equality check: {bad} mismatches")
    if bad or args.check:
        return 1 if bad else 0
    print(f"\nµs per call (best of 25), torch {torch.__version__}, {args.threads} threads\n")
    print(synthetic_table())
    return 0


if __name__ == "__main__":
    sys.exit(main())
