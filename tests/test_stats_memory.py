"""Bounded temporaries and out-of-memory safety of the statistics.

Large tensors are reduced chunk by chunk (``_stats.CHUNK_ELEMENTS``), on every path, so a statistic's
temporaries stay a few chunks; chunking must not change a single statistic. A statistic that runs out of memory
drops that one record with one warning and never raises into the user's step."""

from __future__ import annotations

import math
import sys
import warnings
from typing import Any

import pytest
import torch
from torch import nn

import nantrace
from nantrace import _stats
from nantrace._stats import stats_device, stats_host

INF, NAN = math.inf, math.nan


def _same(a: list[float], b: list[float]) -> bool:
    return all((math.isnan(x) and math.isnan(y)) or x == y for x, y in zip(a, b, strict=True))


def _cases() -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    base = torch.randn(10, 37, generator=g)
    zeros_head = base.clone()
    zeros_head.view(-1)[:50] = 0.0  # the first chunks hold only zeros
    relu = base.clamp(min=0)
    bad = base.clone()
    bad.view(-1)[[3, 100, 300]] = torch.tensor([NAN, INF, -INF])
    only_bad = torch.full((9, 11), NAN)
    only_bad[4, 4] = INF
    tiny = base * 1e-41  # float32 subnormals
    return [
        ("mixed", base),
        ("mixed fp16", base.half()),
        ("mixed bf16", base.bfloat16()),
        ("zeros in the first chunks", zeros_head),
        ("relu (one sign with zeros)", relu),
        ("inf and nan", bad),
        ("inf and nan fp16", bad.half()),
        ("no finite value", only_bad),
        ("all zero", torch.zeros(5, 40)),
        ("-0.0 and subnormals", torch.cat([tiny.view(-1), torch.tensor([-0.0, 0.0])])),
        ("non-contiguous", base.t()),
        ("non-contiguous 3-d, nan", bad.view(10, 37, 1).expand(10, 37, 3).transpose(0, 2)),
        ("float64", base.double()),
    ]


@pytest.mark.parametrize("case", [c for c, _ in _cases()])
def test_chunked_statistics_equal_the_unchunked_ones(case: str, monkeypatch: pytest.MonkeyPatch) -> None:
    t = dict(_cases())[case]
    whole_dev, whole_host = stats_device(t).tolist(), list(stats_host(t))
    monkeypatch.setattr(_stats, "CHUNK_ELEMENTS", 7)
    assert len(_stats._chunks(t.detach())) > 1
    assert _same(stats_device(t).tolist(), whole_dev)
    assert _same(list(stats_host(t)), whole_host)
    assert _same(whole_dev, whole_host)


def test_relu_output_expected_values_when_chunked(monkeypatch: pytest.MonkeyPatch) -> None:
    t = torch.tensor([0.0, 3.0, 0.0, 0.5, 0.0, 0.0, 2.0, 0.25, 0.0, 0.0, 0.0, 0.0])
    monkeypatch.setattr(_stats, "CHUNK_ELEMENTS", 4)  # the last chunk holds only zeros
    assert list(stats_host(t)) == [0.0, 3.0, 3.0, 0.25, 0.0, 0.0, 0.0, 8.0]
    assert stats_device(t).tolist() == [0.0, 3.0, 3.0, 0.25, 0.0, 0.0, 0.0, 8.0]


def test_chunks_cover_the_tensor_once_without_copies() -> None:
    n = _stats.CHUNK_ELEMENTS
    flat = torch.zeros(3 * n + 5)
    chunks = _stats._chunks(flat)
    assert [c.numel() for c in chunks] == [n, n, n, 5]
    assert all(c.data_ptr() == flat.data_ptr() + i * n * 4 for i, c in enumerate(chunks))
    strided = torch.zeros(4, n // 2).t()  # (n/2, 4), non-contiguous: split along dim 0
    parts = _stats._chunks(strided)
    assert [tuple(c.shape) for c in parts] == [(n // 4, 4)] * 2
    assert all(c.untyped_storage().data_ptr() == strided.untyped_storage().data_ptr() for c in parts)


@pytest.mark.parametrize("path", ["host", "device"])
def test_no_op_sees_more_than_a_chunk(path: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every op that makes a tensor-sized temporary (``|x|``, masks, ``where``) is handed at most one chunk."""
    monkeypatch.setattr(_stats, "CHUNK_ELEMENTS", 64)
    seen: list[int] = []
    for name in ("abs", "isfinite", "isnan", "where"):
        orig = getattr(torch, name)

        def spy(*args: Any, _orig: Any = orig, **kwargs: Any) -> Any:
            seen.append(max(a.numel() for a in args if isinstance(a, torch.Tensor)))
            return _orig(*args, **kwargs)

        monkeypatch.setattr(torch, name, spy)
    t = torch.randn(1000)
    t[[0, 500]] = torch.tensor([0.0, NAN])
    got = stats_host(t) if path == "host" else tuple(stats_device(t).tolist())
    assert got[4] == 1.0 and got[7] == 1.0
    assert seen and max(seen) == 64


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc1 = nn.Linear(4, 5)
        self.fc2 = nn.Linear(5, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x)))


def _step(m: _Net, x: torch.Tensor) -> torch.Tensor:
    loss = m(x).square().mean()
    loss.backward()
    return loss.detach()


@pytest.mark.parametrize("sync_free", [False, True], ids=["host", "sync_free"])
def test_out_of_memory_in_a_statistic_drops_that_record_and_warns_once(
    sync_free: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(1))
    ref_model = _Net()
    ref_loss = _step(ref_model, x)

    # the first pass of the path over this small tensor: torch.abs on the device path, the bits on the host one
    owner, op = (torch, "abs") if sync_free else (_stats, "_bits_stats")
    orig = getattr(owner, op)

    def failing(t: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        in_stats = sys._getframe(1).f_globals.get("__name__") == "nantrace._stats"  # the statistics' own call
        if in_stats and t.data_ptr() == x.data_ptr() and t.shape == x.shape:
            raise torch.OutOfMemoryError("planted: no memory for this tensor's statistics")
        return orig(t, *args, **kwargs)

    monkeypatch.setattr(owner, op, failing)
    m = _Net()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with nantrace.trace(m, sync_free=sync_free) as tr:
            loss = _step(m, x)
    oom = [w for w in caught if "out of memory" in str(w.message)]
    assert len(oom) == 1
    assert "(3, 4) float32 tensor on cpu" in str(oom[0].message)
    assert torch.equal(loss, ref_loss)  # the user's step ran and its numbers did not change
    for p, q in zip(m.parameters(), ref_model.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad)
    rec = tr.records
    inputs = rec[(rec["phase"].isin(["data", "forward"])) & (rec["tensor"] == "input[0]")]
    assert sorted(inputs["module"].astype(str)) == ["fc2"]  # root's and fc1's input (x) dropped
    out = rec[(rec["phase"] == "forward") & (rec["module"] == "fc1") & (rec["tensor"] == "output")]
    assert len(out) == 1 and out["n_nan"].iloc[0] == 0
