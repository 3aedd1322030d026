"""Property tests: ``stats_host`` and ``stats_device`` agree exactly with a float64 numpy reference.

Random shapes (1-element included), non-contiguous views (transposes, strided slices, broadcast stride-0
expands, narrowed columns), the four floating dtypes, and values drawn to hit ±inf, NaN, subnormals, ±0 and the
dtype's max. The reference reads the tensor's actual values (bfloat16 via float32) into float64.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from nantrace._stats import N_STATS, STAT_NAMES, describable, stats_device, stats_host

DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)

SETTINGS = settings(
    max_examples=120,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


def reference(t: torch.Tensor) -> list[float]:
    """The eight statistics of ``t`` computed in float64 numpy from its values."""
    x = t.detach()
    if x.dtype == torch.bfloat16:
        x = x.float()
    a = x.numpy().astype(np.float64).ravel()
    fin = a[np.isfinite(a)]
    nan = math.nan
    mn = float(fin.min()) if fin.size else nan
    mx = float(fin.max()) if fin.size else nan
    absmax = float(np.abs(fin).max()) if fin.size else nan
    nz = np.abs(fin[fin != 0])
    absmin = float(nz.min()) if nz.size else nan
    return [
        mn,
        mx,
        absmax,
        absmin,
        float(np.isnan(a).sum()),
        float(np.isposinf(a).sum()),
        float(np.isneginf(a).sum()),
        float((a == 0).sum()),
    ]


def assert_same(got: Any, ref: list[float], t: torch.Tensor, which: str) -> None:
    vals = got.tolist() if isinstance(got, torch.Tensor) else list(got)
    assert len(vals) == N_STATS
    for name, g, r in zip(STAT_NAMES, vals, ref, strict=True):
        same = (math.isnan(g) and math.isnan(r)) or g == r
        assert same, f"{which}: {name} = {g!r}, reference {r!r} for {t.dtype} {tuple(t.shape)} {t}"


def check(t: torch.Tensor) -> None:
    assert describable(t)
    ref = reference(t)
    dev = stats_device(t)
    assert isinstance(dev, torch.Tensor) and dev.dtype == torch.float64 and dev.shape == (N_STATS,)
    assert dev.device == t.device
    assert_same(dev, ref, t, "stats_device")
    host = stats_host(t)
    assert isinstance(host, tuple) and all(isinstance(v, float) for v in host)
    assert_same(host, ref, t, "stats_host")


def specials(dtype: torch.dtype) -> list[float]:
    fi = torch.finfo(dtype)
    sub = fi.tiny * fi.eps  # the smallest subnormal
    return [
        0.0,
        -0.0,
        math.inf,
        -math.inf,
        math.nan,
        fi.max,
        -fi.max,
        fi.tiny,
        -fi.tiny,
        sub,
        -sub,
        3 * sub,
        fi.tiny - sub,  # the largest subnormal
        1.0,
        -1.0,
        fi.eps,
    ]


@st.composite
def tensors(draw: st.DrawFn, dtypes: tuple[torch.dtype, ...] = DTYPES) -> torch.Tensor:
    dtype = draw(st.sampled_from(dtypes))
    fmax = torch.finfo(dtype).max
    shape = draw(st.lists(st.integers(1, 5), min_size=0, max_size=3))
    numel = int(np.prod(shape)) if shape else 1
    mode = draw(st.sampled_from(["mixed", "finite", "special", "constant"]))
    finite = st.floats(min_value=-fmax, max_value=fmax, allow_nan=False, allow_infinity=False, width=64)
    special = st.sampled_from(specials(dtype))
    if mode == "finite":
        elem = finite
    elif mode == "special":
        elem = special
    else:
        elem = st.one_of(special, finite)
    if mode == "constant":
        values = [draw(elem)] * numel
    else:
        values = draw(st.lists(elem, min_size=numel, max_size=numel))
    t = torch.tensor(values, dtype=torch.float64).to(dtype).reshape(shape)
    view = draw(st.sampled_from(["none", "transpose", "slice", "expand", "narrow", "unsqueeze_expand"]))
    if view == "transpose" and t.dim() >= 2:
        t = t.transpose(0, -1)
    elif view == "slice" and t.dim() >= 1 and t.shape[0] >= 2:
        t = t[::2]
    elif view == "expand":
        t = t.unsqueeze(0).expand(3, *t.shape)
    elif view == "narrow" and t.dim() >= 2 and t.shape[-1] >= 2:
        t = t.narrow(-1, 1, t.shape[-1] - 1)
    elif view == "unsqueeze_expand" and t.dim() >= 1:
        t = t.unsqueeze(-1).expand(*t.shape, 2)
    return t


# ------------------------------------------------------------------------------------------------ properties


@SETTINGS
@given(tensors())
def test_stats_match_the_numpy_reference(t: torch.Tensor) -> None:
    check(t)


@SETTINGS
@given(tensors(dtypes=(torch.float16, torch.bfloat16)), st.sampled_from(["inf", "-inf", "nan"]))
def test_one_nonfinite_element_does_not_change_the_finite_statistics(t: torch.Tensor, kind: str) -> None:
    """Statistics of finite values stay meaningful when the tensor also holds inf/NaN."""
    base = t.contiguous().reshape(-1).clone()
    bad = torch.cat([base, torch.tensor([float(kind)], dtype=t.dtype)])
    check(bad)
    clean = reference(base)
    got = stats_device(bad).tolist()
    finite_clean = base[torch.isfinite(base)]
    if finite_clean.numel():  # min, max, absmax, absmin are over the finite values only
        for i in range(4):
            assert (math.isnan(got[i]) and math.isnan(clean[i])) or got[i] == clean[i]


@SETTINGS
@given(tensors(), st.integers(0, 3))
def test_host_and_device_agree_with_each_other(t: torch.Tensor, k: int) -> None:
    t = t * 1 if k == 0 else t  # a fresh contiguous copy for k == 0, the view otherwise
    dev = stats_device(t).tolist()
    host = list(stats_host(t))
    for name, d, h in zip(STAT_NAMES, dev, host, strict=True):
        assert (math.isnan(d) and math.isnan(h)) or d == h, f"{name}: device {d!r} != host {h!r} for {t}"


@SETTINGS
@given(tensors())
def test_stats_do_not_modify_or_keep_the_tensor(t: torch.Tensor) -> None:
    before = t.clone()
    version = t._version
    stats_device(t)
    stats_host(t)
    assert t._version == version
    torch.testing.assert_close(t, before, rtol=0, atol=0, equal_nan=True)


# ------------------------------------------------------------------------------------------------ edge cases


EDGE_CASES: dict[str, list[Any]] = {
    "one_zero": [0.0],
    "one_negzero": [-0.0],
    "zeros_both_signs": [0.0, -0.0, 0.0],
    "one_nan": [math.nan],
    "all_nan": [math.nan] * 5,
    "one_posinf": [math.inf],
    "one_neginf": [-math.inf],
    "both_infs": [math.inf, -math.inf, math.inf],
    "nan_and_infs": [math.nan, math.inf, -math.inf],
    "max_and_min": ["max", "-max"],
    "max_with_nan": ["max", math.nan],
    "subnormals_only": ["sub", "-sub", "3sub"],
    "zero_and_subnormal": [0.0, "sub"],
    "neg_zero_pos": [-2.0, 0.0, 3.0],
    "neg_only_with_zero": [-2.0, 0.0, -5.0],
    "pos_only_with_zero": [2.0, 0.0, 5.0],
    "neg_only": [-2.0, -0.5, -5.0],
    "pos_only": [2.0, 0.5, 5.0],
    "mixed_signs_no_zero": [-2.0, 0.25, 3.0],
    "mask_like": [0.0, -math.inf, 0.0, -math.inf],
    "zeros_and_nan": [0.0, math.nan, -0.0],
    "tiny_and_huge": ["sub", "max", -1.0],
}


def _value(v: Any, dtype: torch.dtype) -> float:
    fi = torch.finfo(dtype)
    sub = fi.tiny * fi.eps
    return {"max": fi.max, "-max": -fi.max, "sub": sub, "-sub": -sub, "3sub": 3 * sub}.get(v, v)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).replace("torch.", ""))
@pytest.mark.parametrize("case", list(EDGE_CASES))
def test_edge_cases(case: str, dtype: torch.dtype) -> None:
    vals = [_value(v, dtype) for v in EDGE_CASES[case]]
    t = torch.tensor(vals, dtype=torch.float64).to(dtype)
    check(t)
    check(t.reshape(-1, 1).expand(-1, 3).t())  # the same values, non-contiguous, repeated


def test_edge_case_expectations_spelled_out() -> None:
    """A few reference values written by hand, so the reference itself is checked."""
    nan = math.nan
    cases: list[tuple[list[float], list[float]]] = [
        ([0.0, -0.0], [0.0, 0.0, 0.0, nan, 0, 0, 0, 2]),
        ([nan, math.inf], [nan, nan, nan, nan, 1, 1, 0, 0]),
        ([-2.0, 0.0, 3.0, -math.inf], [-2.0, 3.0, 3.0, 2.0, 0, 0, 1, 1]),
        ([65504.0, -0.5, nan], [-0.5, 65504.0, 65504.0, 0.5, 1, 0, 0, 0]),
        (
            [5.960464477539063e-08, 0.0],
            [0.0, 5.960464477539063e-08, 5.960464477539063e-08, 5.960464477539063e-08, 0, 0, 0, 1],
        ),
    ]
    for vals, expect in cases:
        t = torch.tensor(vals, dtype=torch.float16)
        assert_same(reference(t), expect, t, "reference")
        check(t)


def test_describable_rejects_what_stats_cannot_describe() -> None:
    assert not describable(torch.zeros(0))
    assert not describable(torch.zeros(2, 0, 3))
    assert not describable(torch.tensor([1, 2]))
    assert not describable(torch.tensor([True]))
    assert not describable(torch.tensor([1 + 1j]))
    assert not describable(torch.eye(2).to_sparse())
    assert not describable(3.0)
    assert describable(torch.tensor(1.0)) and describable(torch.ones(1, dtype=torch.bfloat16))
