"""Every path of ``stats_host`` gives hand-computed statistics, on every size class and layout.

``stats_host`` picks its passes by size and layout: numpy's integer min/max up to ``_stats.NUMPY_ELEMENTS``
elements or for a strided tensor, torch's ``aminmax`` above it; numpy's unsigned maximum for the most negative
value up to ``_stats.TORCH_PASS_ELEMENTS`` (torch's float ``amin`` above); and for a tensor holding a zero,
the bits counted and shifted as they are when no ``-0.0`` is there, the magnitude bits otherwise, in numpy or
(contiguous chunks above ``TORCH_PASS_ELEMENTS``) in torch, chunk by chunk above ``_stats.CHUNK_ELEMENTS``.
Each case below plants a few values into a tensor of ``1.5`` and ``-2.5`` (or of one sign), so its expected
statistics are written out by hand, and is checked at a size in each class, contiguous, transposed and
expanded (a stride-0 view: every element counted twice), in float16, bfloat16, float32 and float64.
"""

from __future__ import annotations

import math
import weakref

import pytest
import torch

from nantrace import _stats
from nantrace._stats import stats_device, stats_host

INF, NAN = math.inf, math.nan
DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
SIZES = {
    "small": 64,
    "numpy, above 64 KiB": 20_001,
    "torch aminmax": _stats.NUMPY_ELEMENTS + 17,
    "torch passes": _stats.TORCH_PASS_ELEMENTS + 17,
    "chunked": _stats.CHUNK_ELEMENTS + 17,
}
MIXED, POS, NEG = (1.5, -2.5), (1.5, 2.5), (-1.5, -2.5)


SUB = 1234.5  # stands for a subnormal of the tensor's dtype: its smallest normal / 4 (a power of two)


# name: (fill, {position: value}, expected statistics); a position < 0 counts from the end
CASES: dict[str, tuple[tuple[float, float], dict[int, float], tuple[float, ...]]] = {
    "both signs, no zero": (MIXED, {9: 0.25, 10: -0.125}, (-2.5, 1.5, 2.5, 0.125, 0, 0, 0, 0)),
    "both signs, +0.0 and -0.0 (dropout)": (
        MIXED,
        {0: 0.0, 5: -0.0, 7: -0.0, -1: 0.0, 9: 0.25, 10: -0.125},
        (-2.5, 1.5, 2.5, 0.125, 0, 0, 0, 4),
    ),
    "both signs, -0.0 only": (MIXED, {3: -0.0, 9: -0.375, 11: 0.5}, (-2.5, 1.5, 2.5, 0.375, 0, 0, 0, 1)),
    "both signs, +0.0 only, nearest zero negative": (
        MIXED,
        {3: 0.0, 4: 0.0, 9: -0.375, 10: 0.5},
        (-2.5, 1.5, 2.5, 0.375, 0, 0, 0, 2),
    ),
    "both signs, +0.0 only, nearest zero positive (ReLU gradient)": (
        MIXED,
        {3: 0.0, -2: 0.0, 9: -0.375, 10: 0.25},
        (-2.5, 1.5, 2.5, 0.25, 0, 0, 0, 2),
    ),
    "negative values and +0.0, no positive value": (
        NEG,
        {3: 0.0, 9: -0.375},
        (-2.5, 0.0, 2.5, 0.375, 0, 0, 0, 1),
    ),
    "positive values and +0.0 (ReLU)": (
        POS,
        {0: 0.0, 1: 0.0, -1: 0.0, 9: 0.75},
        (0.0, 2.5, 2.5, 0.75, 0, 0, 0, 3),
    ),
    "negative values and -0.0": (NEG, {0: -0.0, -1: -0.0, 9: -0.75}, (-2.5, -0.0, 2.5, 0.75, 0, 0, 0, 2)),
    "negative values, -0.0 and +0.0": (NEG, {0: -0.0, 4: 0.0}, (-2.5, 0.0, 2.5, 1.5, 0, 0, 0, 2)),
    "positive values only": (POS, {9: 0.75}, (0.75, 2.5, 2.5, 0.75, 0, 0, 0, 0)),
    "negative values only": (NEG, {9: -0.75}, (-2.5, -0.75, 2.5, 0.75, 0, 0, 0, 0)),
    "subnormals nearest zero among zeros": (
        MIXED,
        {0: 0.0, 1: -0.0, 5: -2 * SUB, 6: SUB},  # SUB: a subnormal of the dtype (filled in by _build)
        (-2.5, 1.5, 2.5, SUB, 0, 0, 0, 2),
    ),
    "inf and NaN with zeros": (
        MIXED,
        {0: 0.0, 1: -0.0, 2: INF, 3: NAN, 4: -INF},
        (-2.5, 1.5, 2.5, 1.5, 1, 1, 1, 2),
    ),
}


def _build(n: int, dtype: torch.dtype, case: str) -> tuple[torch.Tensor, tuple[float, ...]]:
    fill, plant, expected = CASES[case]
    sub = torch.finfo(dtype).tiny / 4
    t = torch.tensor(fill, dtype=torch.float64).repeat(n // 2 + 1)[:n]
    for i, v in plant.items():
        t[i] = v if abs(v) != 2 * SUB and v != SUB else math.copysign(abs(v) / SUB * sub, v)
    return t.to(dtype), tuple(sub if e == SUB else e for e in expected)


def _same(got: tuple[float, ...], expected: tuple[float, ...]) -> bool:
    return len(got) == 8 and all(
        (math.isnan(g) and math.isnan(e)) or g == e for g, e in zip(got, expected, strict=True)
    )


def _layouts(
    t: torch.Tensor, expected: tuple[float, ...]
) -> list[tuple[str, torch.Tensor, tuple[float, ...]]]:
    n = t.numel()
    twice = (*expected[:4], *(2 * c for c in expected[4:]))
    out = [("contiguous", t, expected)]
    if n % 4 == 0 or n > 64:
        rows = next(r for r in (4, 3, 2, 1) if n % r == 0)
        out.append(("transposed", t.view(rows, n // rows).t(), expected))
    out.append(("expanded", t.view(1, n).expand(2, n), twice))
    return out


@pytest.mark.parametrize("size", list(SIZES), ids=list(SIZES))
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).replace("torch.", ""))
def test_hand_computed_statistics_on_every_path(size: str, dtype: torch.dtype) -> None:
    n = SIZES[size]
    for case in CASES:
        t, expected = _build(n, dtype, case)
        for layout, v, exp in _layouts(t, expected):
            got = stats_host(v)
            assert _same(got, exp), (case, layout, got, exp)
            assert all(isinstance(g, float) for g in got)
            if size in ("small", "torch aminmax"):  # the device path agrees (a few sizes: it is slower)
                assert _same(tuple(stats_device(v).tolist()), exp), (case, layout)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).replace("torch.", ""))
def test_every_path_on_small_tensors_with_thresholds_lowered(
    dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The torch passes and the chunking, exercised on tensors of 101 elements: thresholds of a few elements."""
    monkeypatch.setattr(_stats, "NUMPY_ELEMENTS", 8)
    monkeypatch.setattr(_stats, "TORCH_PASS_ELEMENTS", 16)
    monkeypatch.setattr(_stats, "CHUNK_ELEMENTS", 32)
    for case in CASES:
        t, expected = _build(101, dtype, case)
        for layout, v, exp in _layouts(t, expected):
            assert _same(stats_host(v), exp), (case, layout)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).replace("torch.", ""))
def test_one_element_and_zero_dim(dtype: torch.dtype) -> None:
    for v, expected in [
        (0.0, (0.0, 0.0, 0.0, NAN, 0, 0, 0, 1)),
        (-0.0, (-0.0, -0.0, 0.0, NAN, 0, 0, 0, 1)),
        (-3.0, (-3.0, -3.0, 3.0, 3.0, 0, 0, 0, 0)),
        (0.5, (0.5, 0.5, 0.5, 0.5, 0, 0, 0, 0)),
        (NAN, (NAN, NAN, NAN, NAN, 1, 0, 0, 0)),
        (-INF, (NAN, NAN, NAN, NAN, 0, 0, 1, 0)),
    ]:
        for t in (torch.tensor(v, dtype=dtype), torch.tensor([v], dtype=dtype)):
            assert _same(stats_host(t), expected), (v, t.shape)


@pytest.mark.parametrize("n", [SIZES["small"], SIZES["chunked"]], ids=["small", "chunked"])
def test_all_zero_tensors(n: int) -> None:
    for dtype in DTYPES:
        plus, minus = torch.zeros(n, dtype=dtype), torch.full((n,), -0.0, dtype=dtype)
        both = plus.clone()
        both[::3] = -0.0
        assert _same(stats_host(plus), (0.0, 0.0, 0.0, NAN, 0, 0, 0, n))
        assert _same(stats_host(minus), (-0.0, -0.0, 0.0, NAN, 0, 0, 0, n))
        assert _same(stats_host(both), (-0.0, 0.0, 0.0, NAN, 0, 0, 0, n))
        assert math.copysign(1.0, stats_host(minus)[1]) == -1.0  # the largest value of -0.0 only is -0.0


def test_a_tensor_that_requires_grad_and_a_float8_tensor() -> None:
    t, expected = _build(300, torch.float32, "both signs, +0.0 and -0.0 (dropout)")
    leaf = t.clone().requires_grad_()
    assert _same(stats_host(leaf), expected)
    assert _same(stats_host(leaf * 1), expected)  # a non-leaf in a graph
    f8 = getattr(torch, "float8_e4m3fn", None)
    if f8 is not None:
        assert _same(stats_host(t.to(f8)), expected)  # widened to float32 first


def test_no_reference_to_the_tensor_is_kept() -> None:
    for case in ("both signs, +0.0 and -0.0 (dropout)", "positive values and +0.0 (ReLU)"):
        for n in (SIZES["small"], SIZES["torch passes"]):
            t, _ = _build(n, torch.float32, case)
            ref = weakref.ref(t)
            stats_host(t)
            stats_host(t.t() if t.dim() == 2 else t.view(1, -1).expand(2, -1))
            del t
            assert ref() is None, (case, n)
