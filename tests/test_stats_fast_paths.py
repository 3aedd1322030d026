"""The cheaper CPU statistics paths give exactly the statistics of the numpy reference.

``stats_host`` reads a float's bits as integers (``_stats._bits_stats``): an integer min/max (numpy's up to
``_stats.NUMPY_ELEMENTS`` elements, torch's above), for a tensor of both signs a float ``amin`` and an unsigned
minimum, and for a tensor holding a ``+0.0`` or ``-0.0`` the zero count and smallest non-zero magnitude
(``_stats._zeros_and_least``). Each case below is built so that one branch decides: the value nearest zero negative or
positive, a lone ``-0.0`` or ``+0.0``, subnormals, a NaN or inf in a large tensor, strided views, every dtype.
"""

from __future__ import annotations

import math

import pytest
import test_stats_properties
import torch

from nantrace import _stats
from nantrace._stats import stats_device, stats_host

DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
BIG = _stats.NUMPY_ELEMENTS + 17  # above the numpy threshold, not a multiple of anything


def _same(got: tuple[float, ...] | list[float], ref: list[float]) -> bool:
    return all((math.isnan(g) and math.isnan(r)) or g == r for g, r in zip(got, ref, strict=True))


def _base(n: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Values of both signs with |x| in [1, 2): no zero, nothing near zero."""
    g = torch.Generator().manual_seed(seed)
    mag = 1.0 + torch.rand(n, generator=g, dtype=torch.float64)
    sign = torch.where(torch.rand(n, generator=g) < 0.5, -1.0, 1.0).double()
    return (mag * sign).to(dtype)


def _cases(n: int, dtype: torch.dtype) -> list[tuple[str, torch.Tensor]]:
    tiny = torch.finfo(dtype).tiny  # smallest normal; tiny / 4 is subnormal
    out = []
    for name, plant in [
        ("nearest zero is negative", {7: -tiny * 8, n // 2: tiny * 16}),
        ("nearest zero is positive", {7: -tiny * 16, n // 2: tiny * 8}),
        ("a tie of the two signs", {3: -tiny * 8, n - 2: tiny * 8}),
        ("subnormal nearest zero", {5: tiny / 4, 6: -tiny / 2}),
        ("a lone -0.0", {n - 1: -0.0, 9: tiny * 4}),
        ("a lone +0.0", {0: 0.0, 9: -tiny * 4}),
        ("both zeros", {1: 0.0, 2: -0.0}),
        ("a nan", {11: math.nan}),
        ("+inf and -inf", {11: math.inf, 12: -math.inf}),
        ("the dtype's extremes", {4: torch.finfo(dtype).max, 8: -torch.finfo(dtype).max}),
    ]:
        t = _base(n, dtype, seed=len(out))
        for i, v in plant.items():
            t[i] = v
        out.append((name, t))
    for name, sign, plant in [  # one sign: the signed integer min/max decides alone
        ("positive only", 1.0, {}),
        ("negative only", -1.0, {}),
        ("positive with +0.0 (ReLU)", 1.0, {0: 0.0, n // 3: 0.0, 9: tiny / 4}),
        ("negative with -0.0", -1.0, {n - 1: -0.0, 9: -tiny * 4}),
        ("negative with +0.0", -1.0, {2: 0.0}),
        ("negative, -inf", -1.0, {4: -math.inf}),
        ("positive, nan", 1.0, {4: math.nan}),
    ]:
        t = _base(n, dtype, seed=len(out)).abs() * sign
        for i, v in plant.items():
            t[i] = v
        out.append((name, t))
    return out


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).replace("torch.", ""))
@pytest.mark.parametrize("n", [64, BIG], ids=["small", "above the numpy threshold"])
def test_fast_paths_match_the_numpy_reference(dtype: torch.dtype, n: int) -> None:
    for name, t in _cases(n, dtype):
        ref = test_stats_properties.reference(t)
        assert _same(stats_host(t), ref), (name, stats_host(t), ref)
        assert _same(stats_device(t).tolist(), ref), name
        strided = t.view(-1, 1).expand(-1, 2).t()  # stride-0 and transposed: the bits are read in place
        assert _same(stats_host(strided), test_stats_properties.reference(strided)), name


def test_the_smallest_magnitude_comes_from_the_right_sign() -> None:
    t = torch.tensor([3.0, -0.25, 0.5, -2.0])
    assert stats_host(t) == (-2.0, 3.0, 3.0, 0.25, 0.0, 0.0, 0.0, 0.0)
    t = torch.tensor([-3.0, 0.25, -0.5, 2.0])
    assert stats_host(t) == (-3.0, 2.0, 3.0, 0.25, 0.0, 0.0, 0.0, 0.0)
    t = torch.tensor([-1.0, -0.0, 2.0])  # -0.0 counts as a zero and is not the smallest non-zero |x|
    assert stats_host(t) == (-1.0, 2.0, 2.0, 1.0, 0.0, 0.0, 0.0, 1.0)
    t = torch.tensor([-1.0, 1e-45, 2.0])  # the smallest float32 subnormal
    assert stats_host(t)[3] == torch.tensor(1e-45).item()


def test_a_negative_bit_view_is_described_by_its_values() -> None:
    neg_view = getattr(torch, "_neg_view", None)
    if neg_view is None:
        pytest.skip("this torch has no torch._neg_view")
    x = torch.tensor([1.0, -2.0, 3.0, -0.5])
    view = neg_view(x)  # a lazy negation numpy cannot read in place: the |x| path takes it
    assert view.is_neg()
    assert stats_host(view) == (-3.0, 2.0, 3.0, 0.5, 0.0, 0.0, 0.0, 0.0)


def test_small_tensors_are_read_by_numpy_and_large_ones_by_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    """One integer min/max over the bits: numpy's for a tensor of at most ``NUMPY_ELEMENTS`` elements (no torch
    reduction at all), torch's ``aminmax`` on the integer view for a larger one; the same values either way."""
    calls: list[tuple[torch.dtype, int]] = []
    orig = torch.aminmax

    def counting(t: torch.Tensor, *args: object, **kwargs: object) -> object:
        calls.append((t.dtype, t.numel()))
        return orig(t, *args, **kwargs)

    monkeypatch.setattr(torch, "aminmax", counting)
    big = _base(BIG, torch.float32, seed=1).abs()  # one sign: the integer min/max is the whole statistic
    small = big[:100]
    assert _same(stats_host(small), test_stats_properties.reference(small))
    assert calls == []
    assert _same(stats_host(big), test_stats_properties.reference(big))
    assert calls == [(torch.int32, BIG)]
