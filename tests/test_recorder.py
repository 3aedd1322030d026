"""The recorder: what ``nantrace.trace`` writes into ``records`` and ``steps``, checked against values computed
independently in the test (numpy statistics, autograd without tracing, the GradScaler's own state).

Every rule of DESIGN.md's recorder part has a test with the exact expected value. Models are tiny and built for
one rule each; fp16 models stay tiny because CPU fp16 matmul is slow.
"""

from __future__ import annotations

import collections
import copy
import dataclasses
import gc
import math
import warnings
import weakref
from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np
import pandas as pd
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

import nantrace

RECORD_COLUMNS = [
    "step",
    "micro_step",
    "seq",
    "phase",
    "module",
    "module_type",
    "call",
    "tensor",
    "dtype",
    "shape",
    "numel",
    "min",
    "max",
    "absmax",
    "absmin",
    "n_nan",
    "n_posinf",
    "n_neginf",
    "n_zero",
    "scale",
]
STEP_COLUMNS = [
    "step",
    "loss",
    "scale",
    "next_scale",
    "skipped",
    "growth_tracker",
    "lr",
    "grad_norm",
    "n_nonfinite",
]
STAT_FIELDS = ["min", "max", "absmax", "absmin", "n_nan", "n_posinf", "n_neginf", "n_zero"]
INF = math.inf
NAN = math.nan
F16_MAX = 65504.0
F16_SUB = 2.0**-24  # smallest fp16 subnormal


# ------------------------------------------------------------------------------------------------ helpers
def np_stats(t: torch.Tensor) -> dict[str, float]:
    """Reference statistics in numpy: min/max/absmax over finite values, absmin = smallest non-zero finite |x|."""
    a = t.detach().to(torch.float64).numpy().ravel()  # every float dtype widens to float64 exactly
    fin = a[np.isfinite(a)]
    nonzero = np.abs(fin[fin != 0])
    return {
        "min": float(fin.min()) if fin.size else NAN,
        "max": float(fin.max()) if fin.size else NAN,
        "absmax": float(np.abs(fin).max()) if fin.size else NAN,
        "absmin": float(nonzero.min()) if nonzero.size else NAN,
        "n_nan": int(np.isnan(a).sum()),
        "n_posinf": int(np.isposinf(a).sum()),
        "n_neginf": int(np.isneginf(a).sum()),
        "n_zero": int((a == 0).sum()),
    }


def _same(a: float, b: float) -> bool:
    return (math.isnan(a) and math.isnan(b)) or a == b


def assert_stats(row: pd.Series, t: torch.Tensor, what: str = "") -> None:
    """``row`` (one record) describes tensor ``t`` exactly: dtype, shape, numel and the eight statistics."""
    ref = np_stats(t)
    got = {k: row[k] for k in STAT_FIELDS}
    bad = {k: (got[k], ref[k]) for k in STAT_FIELDS if not _same(float(got[k]), float(ref[k]))}
    assert not bad, f"{what} {row['tensor']}: (recorded, expected) {bad}"
    assert row["dtype"] == str(t.dtype).removeprefix("torch.")
    assert row["shape"] == str(tuple(t.shape))
    assert int(row["numel"]) == t.numel()


def one(df: pd.DataFrame, **where: Any) -> pd.Series:
    """The single row of ``df`` matching ``where`` (column == value)."""
    sel = select(df, **where)
    assert len(sel) == 1, f"expected one row for {where}, got {len(sel)}:\n{sel}"
    return sel.iloc[0]


def select(df: pd.DataFrame, **where: Any) -> pd.DataFrame:
    mask = np.ones(len(df), dtype=bool)
    for k, v in where.items():
        mask &= (df[k] == v).to_numpy(dtype=bool)
    return df[mask]


def paths(df: pd.DataFrame, **where: Any) -> list[str]:
    return [str(t) for t in select(df, **where)["tensor"]]


def bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bytes of ``t``: equal bits, NaN included."""
    return t.detach().reshape(-1).contiguous().view(torch.uint8)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(bits(a), bits(b))


def grad(t: torch.Tensor) -> torch.Tensor:
    """``t.grad``, which must exist."""
    assert t.grad is not None
    return t.grad


def pairs(df: pd.DataFrame) -> list[tuple[int, int]]:
    return [(int(s), int(m)) for s, m in zip(df["step"], df["micro_step"], strict=True)]


# ------------------------------------------------------------------------------------------------ 1. columns
class TwoLayer(nn.Module):
    def __init__(self, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.fc1 = nn.Linear(3, 4, dtype=dtype)
        self.act = nn.ReLU()
        self.fc2 = nn.Linear(4, 2, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


def _train(
    model: nn.Module,
    xs: list[torch.Tensor],
    opt: torch.optim.Optimizer,
    scaler: torch.amp.GradScaler | None = None,
) -> list[torch.Tensor]:
    losses = []
    for x in xs:
        loss = model(x).pow(2).mean()
        losses.append(loss.detach())
        if scaler is None:
            loss.backward()
            opt.step()
        else:
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
        opt.zero_grad()
    return losses


def test_records_and_steps_columns_in_design_order() -> None:
    torch.manual_seed(0)
    m = TwoLayer()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=4.0)
    with nantrace.trace(m, scaler=scaler, optimizer=opt) as tr:
        _train(m, [torch.randn(5, 3), torch.randn(5, 3)], opt, scaler)
    rec, steps = tr.records, tr.steps
    assert list(rec.columns[: len(RECORD_COLUMNS)]) == RECORD_COLUMNS
    assert list(steps.columns[: len(STEP_COLUMNS)]) == STEP_COLUMNS
    for col in ("phase", "module", "tensor"):
        assert isinstance(rec[col].dtype, pd.CategoricalDtype), col
    assert set(rec["phase"].unique()) == {"data", "forward", "loss", "backward", "optimizer"}
    for col in ("step", "micro_step", "seq", "call", "numel", "n_nan", "n_posinf", "n_neginf", "n_zero"):
        assert pd.api.types.is_integer_dtype(rec[col].dtype), col
    for col in ("min", "max", "absmax", "absmin", "scale"):
        assert pd.api.types.is_float_dtype(rec[col].dtype), col
    assert pd.api.types.is_bool_dtype(steps["skipped"].dtype)
    assert steps["step"].tolist() == [0, 1]
    # seq is the execution order inside a step: 1..n without gaps or repeats
    for _, g in rec.groupby("step", observed=True):
        assert sorted(g["seq"].tolist()) == list(range(1, len(g) + 1))
        assert g["seq"].is_monotonic_increasing


INT64_RECORD_COLUMNS = [
    "step",
    "micro_step",
    "seq",
    "call",
    "numel",
    "n_nan",
    "n_posinf",
    "n_neginf",
    "n_zero",
]


def test_integer_columns_are_int64_live_and_loaded(tmp_path: Any) -> None:
    """Users' arithmetic on records must not wrap: every integer column is int64 (the store keeps small ints)."""
    m = TwoLayer()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    with nantrace.trace(m, optimizer=opt) as tr:
        for _ in range(2):
            m(torch.ones(2, 3)).sum().backward()
            opt.step()
    loaded = nantrace.load(tr.save(tmp_path / "t.nantrace"))
    for t in (tr, loaded):
        rec, steps = t.records, t.steps
        for col in [*INT64_RECORD_COLUMNS, "event", "rank"]:
            assert rec[col].dtype == np.dtype("int64"), col
        for col in ("step", "n_nonfinite", "micro_steps", "n_records", "rank"):
            assert steps[col].dtype == np.dtype("int64"), col
        assert int((rec["seq"] * 10).max()) == 10 * int(rec["seq"].max())
        assert (rec["step"] + 1000).tolist()[-1] == 1001
        assert (steps["step"] + 2**40).tolist() == [2**40, 2**40 + 1]


def test_empty_trace_has_the_columns_and_warns() -> None:
    m = TwoLayer()
    with (
        pytest.warns(UserWarning, match="recorded nothing: no forward call of the traced TwoLayer"),
        nantrace.trace(m) as tr,
    ):
        pass
    assert list(tr.records.columns[: len(RECORD_COLUMNS)]) == RECORD_COLUMNS
    assert list(tr.steps.columns[: len(STEP_COLUMNS)]) == STEP_COLUMNS
    assert len(tr.records) == 0 and len(tr.steps) == 0
    assert tr.first_overflow() is None


@pytest.mark.parametrize("make", [nantrace.trace, nantrace.watch], ids=["trace", "watch"])
def test_an_empty_run_names_the_function_it_ran_under_at_the_users_line(make: Any) -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with make(TwoLayer()):
            pass
    said = [(str(w.message), w.filename) for w in caught]
    assert said == [
        (
            f"nantrace.{make.__name__} recorded nothing: no forward call of the traced TwoLayer and no "
            "scaler/optimizer step happened inside `with`. Is the traced model the one the loop calls?",
            __file__,
        )
    ]


# ------------------------------------------------------------------------------------------------ 2. statistics
def _planted() -> list[torch.Tensor]:
    f16, bf16, f32, f64 = torch.float16, torch.bfloat16, torch.float32, torch.float64
    big = torch.linspace(-3.0, 5.0, 997, dtype=f16)
    big[17], big[500], big[800], big[900] = INF, NAN, -F16_MAX, F16_SUB
    return [
        # every kind at once, fp16 extremes and subnormals, -0.0
        torch.tensor(
            [INF, -INF, NAN, 0.0, -0.0, F16_SUB, -3 * F16_SUB, F16_MAX, -F16_MAX, 1.5, -3.0], dtype=f16
        ),
        torch.tensor([[INF, NAN], [0.0, -0.0], [1e-40, -3e38], [2.5, NAN]], dtype=bf16),  # bf16 subnormal
        torch.tensor([-INF, 1e-45, -2e-45, 3.4e38, NAN, NAN, 0.0], dtype=f32),  # fp32 subnormals
        torch.tensor([5e-324, -1.7e308, INF, 0.0], dtype=f64),
        # finite tensors (the host path's branches)
        torch.tensor([2.0, 3.0, 0.5], dtype=f16),  # positive, no zero
        torch.tensor([-2.0, -0.25, -7.0], dtype=f32),  # negative, no zero
        torch.tensor([-2.0, 0.125, 3.0], dtype=f32),  # mixed, no zero
        torch.tensor([0.0, 0.0, 4.0, 0.5], dtype=f32),  # zeros and positives
        torch.tensor([-0.0, -4.0, -0.5, 0.0], dtype=f16),  # zeros and negatives
        torch.tensor([0.0, -1.0, 0.25, -0.0, 6.0], dtype=f64),  # zeros, both signs
        torch.tensor([F16_SUB, 0.0, -F16_SUB * 2], dtype=f16),  # only subnormals and zero
        torch.tensor([0.0, -0.0], dtype=f32),  # only zeros: absmin NaN
        torch.tensor([-0.0], dtype=f16),
        torch.tensor([[7.0]], dtype=bf16),
        # no finite value at all: min/max/absmax/absmin NaN
        torch.tensor([NAN, NAN, NAN], dtype=f16),
        torch.tensor([INF, -INF, INF], dtype=f32),
        torch.tensor([NAN, -INF], dtype=bf16),
        # inf with zeros and finite values, one sign each
        torch.tensor([0.0, 3.0, INF], dtype=f32),
        torch.tensor([-INF, -5.0, -0.0], dtype=f16),
        # non-contiguous view, and a larger fp16 tensor
        torch.tensor([[1.0, -INF, 3.0], [0.0, 2.0, -6.0]], dtype=f32).t(),
        big,
    ]


class Emit(nn.Module):
    """Returns the tensors it was built with, untouched."""

    def __init__(self, tensors: list[torch.Tensor]) -> None:
        super().__init__()
        self.tensors = tensors

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return tuple(self.tensors)


class PlantModel(nn.Module):
    def __init__(self, tensors: list[torch.Tensor]) -> None:
        super().__init__()
        self.src = Emit(tensors)

    def forward(self, *xs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return self.src(xs[0])


@pytest.mark.parametrize("sync_free", [None, False, True], ids=["default", "host", "sync_free"])
def test_statistics_of_planted_tensors_match_numpy(sync_free: bool | None) -> None:
    planted = _planted()
    m = PlantModel(planted)
    with nantrace.trace(m, sync_free=sync_free) as tr:
        m(*planted)
    rec = tr.records
    for i, t in enumerate(planted):
        assert_stats(one(rec, phase="data", module="", tensor=f"input[{i}]"), t, "data")
        assert_stats(one(rec, phase="forward", module="src", tensor=f"output[{i}]"), t, "forward")
        assert_stats(one(rec, phase="forward", module="", tensor=f"output[{i}]"), t, "root output")
    assert (rec["scale"] == 1.0).all()


@pytest.mark.parametrize("sync_free", [None, True], ids=["default", "sync_free"])
def test_statistics_of_a_planted_gradient(sync_free: bool | None) -> None:
    class Id(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(6, 6, bias=False)
            with torch.no_grad():
                self.lin.weight.copy_(torch.eye(6))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.lin(x)

    m = Id()
    g = torch.tensor([[INF, -0.0, 1e-45, NAN, -3.0, 0.0]])
    with nantrace.trace(m, sync_free=sync_free) as tr:
        m(torch.ones(1, 6)).backward(g)
    rec = tr.records
    assert_stats(one(rec, phase="loss", module="", tensor="grad_output[0]"), g)
    assert_stats(one(rec, phase="backward", module="lin", tensor="grad_output[0]"), g)
    assert_stats(one(rec, phase="backward", module="lin", tensor="weight.grad"), grad(m.lin.weight))


_float_lists = st.lists(st.floats(width=32, allow_nan=True, allow_infinity=True), min_size=1, max_size=24)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(values=_float_lists, half=st.booleans(), sync_free=st.booleans())
def test_statistics_property(values: list[float], half: bool, sync_free: bool) -> None:
    t = torch.tensor(values, dtype=torch.float16 if half else torch.float32)
    m = PlantModel([t])
    with nantrace.trace(m, sync_free=sync_free) as tr:
        m(t)
    assert_stats(one(tr.records, phase="data", tensor="input[0]"), t)
    assert_stats(one(tr.records, phase="forward", module="src", tensor="output[0]"), t)


# ------------------------------------------------------------------------------------------------ 3. data phase, output paths
class DataModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(2, 2)

    def forward(
        self,
        x: torch.Tensor,
        idx: torch.Tensor,
        flag: torch.Tensor,
        n: int,
        name: str,
        extra: list[torch.Tensor],
        mask: torch.Tensor | None = None,
        ids: torch.Tensor | None = None,
        scale: float = 1.0,
    ) -> torch.Tensor:
        return self.fc(x)


def test_data_phase_records_every_floating_root_input() -> None:
    m = DataModel()
    x = torch.tensor([[1.0, -2.0]])
    mask = torch.tensor([0.0, -INF])
    e0 = torch.tensor([3.0, 0.0], dtype=torch.float16)
    with nantrace.trace(m) as tr:
        m(
            x,
            torch.arange(3),
            torch.ones(2, dtype=torch.bool),
            4,
            "name",
            [e0, torch.ones(2, dtype=torch.int32), "s"],
            mask=mask,
            ids=torch.arange(2),
            scale=2.0,
        )
    rec = tr.records
    data = select(rec, phase="data")
    assert sorted(paths(data)) == sorted(["input[0]", "input[5][0]", "input.mask"])
    assert set(data["module"]) == {""}
    assert set(data["module_type"]) == {"DataModel"}
    assert_stats(one(data, tensor="input[0]"), x)
    assert_stats(one(data, tensor="input.mask"), mask)
    assert_stats(one(data, tensor="input[5][0]"), e0)
    # the data rows come first in the step
    assert data["seq"].max() < select(rec, phase="forward")["seq"].min()


class OutDict(collections.OrderedDict):  # like transformers' ModelOutput
    pass


@dataclasses.dataclass
class OutDC:
    logits: torch.Tensor
    n: int = 3
    name: str = "s"
    extra: object = None


class OutNT(NamedTuple):
    logits: torch.Tensor
    ids: torch.Tensor


class Outputs(nn.Module):
    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind

    def forward(self, x: torch.Tensor) -> Any:
        y = x * 2
        if self.kind == "tuple":
            return (None, y, 3, "s")
        if self.kind == "odict":
            o = OutDict()
            o["loss"] = None
            o["logits"] = y
            return o
        if self.kind == "dict":
            return {"logits": y, "n": 3, "ids": torch.arange(2), "name": "s"}
        if self.kind == "dataclass":
            return OutDC(y)
        if self.kind == "namedtuple":
            return OutNT(y, torch.arange(2))
        if self.kind == "nested":
            return [y, {"k": (None, y + 1)}]
        if self.kind == "none":
            return None
        if self.kind == "int":
            return 7
        raise AssertionError(self.kind)


def _pick(out: Any, kind: str) -> torch.Tensor:
    return {
        "tuple": lambda: out[1],
        "odict": lambda: out["logits"],
        "dict": lambda: out["logits"],
        "dataclass": lambda: out.logits,
        "namedtuple": lambda: out.logits,
        "nested": lambda: out[1]["k"][1],
    }[kind]()


class OutModel(nn.Module):
    def __init__(self, kind: str) -> None:
        super().__init__()
        self.lin = nn.Linear(2, 2)
        self.out = Outputs(kind)

    def forward(self, x: torch.Tensor) -> Any:
        return self.out(self.lin(x))


@pytest.mark.parametrize(
    ("kind", "expected"),
    [
        ("tuple", ["output[1]"]),
        ("odict", ["output.logits"]),
        ("dict", ["output.logits"]),
        ("dataclass", ["output.logits"]),
        ("namedtuple", ["output.logits"]),
        ("nested", ["output[0]", "output[1].k[1]"]),
        ("none", []),
        ("int", []),
    ],
)
def test_nested_outputs_are_named_by_path(kind: str, expected: list[str]) -> None:
    m = OutModel(kind)
    x = torch.tensor([[1.0, 2.0]])
    with nantrace.trace(m) as tr:
        out = m(x)
        if expected:
            _pick(out, kind).sum().backward()
    rec = tr.records
    assert paths(rec, phase="forward", module="out", call=0)[1:] == expected  # [0] is input[0]
    assert paths(rec, phase="forward", module="")[:] == expected
    if expected:
        y = m.lin(x) * 2
        for p in expected:
            assert_stats(one(rec, phase="forward", module="out", tensor=p), y if "k[1]" not in p else y + 1)
        used = "grad_" + expected[-1]
        want = ["grad_output[1].k[1]", "grad_output[0]"] if kind == "nested" else [used]
        assert paths(rec, phase="backward", module="out") == [*want, "grad_input[0]"]
        assert paths(rec, phase="loss", module="") == want
        assert_stats(one(rec, phase="backward", module="out", tensor=used), torch.ones(1, 2))


# ------------------------------------------------------------------------------------------------ 4. step rules
class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(2, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x)


def _x(i: float) -> torch.Tensor:
    return torch.full((1, 2), float(i))


def test_without_boundaries_each_root_forward_is_a_step() -> None:
    m = Tiny()
    with nantrace.trace(m) as tr:
        for i in range(3):
            m(_x(i)).sum().backward()
    data = select(tr.records, phase="data")
    assert pairs(data) == [(0, 0), (1, 0), (2, 0)]
    for i in range(3):
        assert one(data, step=i)["max"] == float(i)
    assert tr.steps["step"].tolist() == [0, 1, 2]
    assert tr.steps["micro_steps"].tolist() == [1, 1, 1]
    # the backward of each forward belongs to its step
    assert select(tr.records, phase="backward")["step"].unique().tolist() == [0, 1, 2]


def test_explicit_step_is_the_boundary() -> None:
    m = Tiny()
    with nantrace.trace(m) as tr:
        for i in range(3):
            m(_x(i)).sum().backward()
            tr.step()
    assert pairs(select(tr.records, phase="data")) == [(0, 0), (1, 0), (2, 0)]
    assert tr.steps["step"].tolist() == [0, 1, 2]


def test_explicit_step_with_gradient_accumulation() -> None:
    m = Tiny()
    with nantrace.trace(m) as tr:
        for s in range(2):
            for k in range(3):
                m(_x(3 * s + k)).sum().backward()
            tr.step()
    assert pairs(select(tr.records, phase="data")) == [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (1, 2)]
    assert tr.steps["micro_steps"].tolist() == [3, 3]


def test_optimizer_step_is_the_boundary_and_micro_steps_count_forwards() -> None:
    m = Tiny()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    with nantrace.trace(m, optimizer=opt) as tr:
        for s in range(2):
            for k in range(3):
                m(_x(3 * s + k)).sum().backward()
            opt.step()
            opt.zero_grad()
    rec = tr.records
    assert pairs(select(rec, phase="data")) == [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (1, 2)]
    assert [float(v) for v in select(rec, phase="data")["max"]] == [0, 1, 2, 3, 4, 5]
    assert tr.steps["micro_steps"].tolist() == [3, 3]
    assert (
        select(rec, phase="forward", module="fc")["call"] == 0
    ).all()  # call counts restart each micro-step
    # backward rows of micro-batch k carry micro_step k
    back = select(rec, phase="backward", module="fc", tensor="grad_output[0]")
    assert pairs(back) == [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (1, 2)]
    # optimizer rows close the step
    assert pairs(select(rec, phase="optimizer", tensor="weight")) == [(0, 2), (1, 2)]
    # tr.step() with an optimizer is not a boundary
    with nantrace.trace(m, optimizer=opt) as tr2:
        m(_x(1)).sum().backward()
        tr2.step()
        m(_x(2)).sum().backward()
        opt.step()
    assert pairs(select(tr2.records, phase="data")) == [(0, 0), (0, 1)]


def test_scaler_update_is_the_boundary_and_a_skipped_step_is_a_step() -> None:
    m = Tiny()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    factors = [1e38, 1.0, 1.0]  # step 0: scaled loss overflows float32, the scaler skips
    with nantrace.trace(m, scaler=scaler, optimizer=opt) as tr:
        for s, f in enumerate(factors):
            for k in range(2):
                scaler.scale(m(_x(2 * s + k)).sum() * f).backward()
            scaler.step(opt)
            with torch.no_grad():  # after optimizer.step(), before scaler.update(): evaluation, not recorded
                m(_x(-1))
            m(_x(-2))  # a forward with grad on before update(): still the same step
            scaler.update()
            opt.zero_grad()
    data = select(tr.records, phase="data")
    assert pairs(data) == [(s, k) for s in range(3) for k in range(3)]
    assert [float(v) for v in data["max"]] == [v for s in range(3) for v in (2 * s, 2 * s + 1, -2)]
    assert tr.steps["skipped"].tolist() == [True, False, False]
    assert tr.steps["step"].tolist() == [0, 1, 2]
    assert tr.steps["micro_steps"].tolist() == [3, 3, 3]
    # the skipped step has no optimizer rows; the others have theirs
    assert select(tr.records, phase="optimizer")["step"].unique().tolist() == [1, 2]


def test_first_forward_of_a_step_is_micro_step_0() -> None:
    m = Tiny()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    with nantrace.trace(m, optimizer=opt) as tr:
        for i in range(2):
            loss = m(_x(i)).sum()
            loss.backward()
            opt.step()
            tr.step(loss=loss)
    assert pairs(select(tr.records, phase="data")) == [(0, 0), (1, 0)]
    assert tr.steps["micro_steps"].tolist()[:2] == [1, 1]


def test_steps_close_on_exit_with_partial_step() -> None:
    m = Tiny()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    with nantrace.trace(m, optimizer=opt) as tr:
        m(_x(1)).sum().backward()
        opt.step()
        m(_x(2))  # a forward after the last optimizer step
    assert tr.steps["step"].tolist() == [0, 1]
    assert pairs(select(tr.records, phase="data")) == [(0, 0), (1, 0)]


# ------------------------------------------------------------------------------------------------ 5. backward
class Wrap(nn.Module):
    def __init__(self, inner: nn.Linear) -> None:
        super().__init__()
        self.fc = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x)


def _planted_linear() -> nn.Linear:
    lin = nn.Linear(3, 2)
    with torch.no_grad():
        lin.weight.copy_(torch.tensor([[1.0, 2.0, -1.0], [0.0, -3.0, 2.0]]))
        lin.bias.copy_(torch.tensor([0.5, -1.0]))
    return lin


def test_backward_rows_of_a_linear_with_planted_weights() -> None:
    x0 = torch.tensor([[1.0, 0.0, 2.0], [-1.0, 3.0, 1.0]])
    c = torch.tensor([[1.0, -2.0], [3.0, 0.0]])
    # reference: autograd without tracing
    ref = Wrap(_planted_linear())
    xr = x0.clone().requires_grad_(True)
    yr = ref(xr)
    yr.retain_grad()
    (yr * c).sum().backward()
    # traced
    m = Wrap(_planted_linear())
    x = x0.clone().requires_grad_(True)
    with nantrace.trace(m) as tr:
        y = m(x)
        (y * c).sum().backward()
    rec = tr.records
    assert_stats(one(rec, phase="backward", module="fc", tensor="grad_output[0]"), grad(yr))
    assert_stats(one(rec, phase="loss", module="", tensor="grad_output[0]"), grad(yr))
    assert_stats(one(rec, phase="backward", module="fc", tensor="grad_input[0]"), grad(xr))
    assert_stats(one(rec, phase="backward", module="", tensor="grad_input[0]"), grad(xr))
    assert_stats(one(rec, phase="backward", module="fc", tensor="weight.grad"), grad(ref.fc.weight))
    assert_stats(one(rec, phase="backward", module="fc", tensor="bias.grad"), grad(ref.fc.bias))
    w = one(rec, phase="backward", module="fc", tensor="weight.grad")
    assert w["module_type"] == "Linear" and w["call"] == 0
    # forward rows too
    assert_stats(one(rec, phase="forward", module="fc", tensor="output"), yr)
    # the traced run computed the same gradients
    assert torch.equal(grad(x), grad(xr))
    assert torch.equal(grad(m.fc.weight), grad(ref.fc.weight))
    assert torch.equal(grad(m.fc.bias), grad(ref.fc.bias))
    # exactly these backward/loss rows, nothing invented
    back = select(rec, phase="backward")
    assert sorted(zip(back["module"], back["tensor"], strict=True)) == sorted(
        [
            ("fc", "grad_output[0]"),
            ("fc", "grad_input[0]"),
            ("", "grad_input[0]"),
            ("fc", "weight.grad"),
            ("fc", "bias.grad"),
        ]
    )


class LinReLU(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = _planted_linear()
        self.act = nn.ReLU(inplace=True)
        self.head = nn.Linear(2, 1, bias=False)
        with torch.no_grad():
            self.head.weight.copy_(torch.tensor([[2.0, -1.0]]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.act(self.fc(x)))


def test_inplace_relu_after_linear() -> None:
    x = torch.tensor([[1.0, 0.0, 2.0], [-1.0, 3.0, 1.0], [0.0, 1.0, 0.0]])
    ref = LinReLU()
    h = ref.fc(x)
    h.retain_grad()
    r = ref.act(h.clone())  # out-of-place twin, to read the gradient before and after the ReLU
    r.retain_grad()
    ref.head(r).sum().backward()
    m = LinReLU()
    with nantrace.trace(m) as tr:
        out = m(x)
        out.sum().backward()
    rec = tr.records
    assert_stats(one(rec, phase="backward", module="act", tensor="grad_output[0]"), grad(r))
    assert_stats(one(rec, phase="backward", module="head", tensor="grad_input[0]"), grad(r))
    assert_stats(one(rec, phase="backward", module="fc", tensor="grad_output[0]"), grad(h))  # masked by ReLU
    assert_stats(one(rec, phase="backward", module="act", tensor="grad_input[0]"), grad(h))
    assert_stats(one(rec, phase="backward", module="fc", tensor="weight.grad"), grad(ref.fc.weight))
    assert torch.equal(grad(m.fc.weight), grad(ref.fc.weight))
    assert torch.equal(grad(m.head.weight), grad(ref.head.weight))
    # forward rows: the ReLU's input is the Linear's output before the in-place op
    assert_stats(one(rec, phase="forward", module="act", tensor="input[0]"), ref.fc(x))
    assert_stats(one(rec, phase="forward", module="act", tensor="output"), torch.relu(ref.fc(x)))


class UserHookBetween(nn.Module):
    """fc's output gets a user tensor hook (``times`` its gradient) before head takes it as input
    (``after=True``: after head ran; ``copy=True``: on ``fc(x) * 1.0``, an intermediate of the root's code
    that no module returned)."""

    def __init__(self, times: float = 2.0, after: bool = False, copy: bool = False) -> None:
        super().__init__()
        self.fc = _planted_linear()
        self.head = nn.Linear(2, 1, bias=False)
        self.times, self.after, self.copy = times, after, copy
        with torch.no_grad():
            self.head.weight.copy_(torch.tensor([[2.0, -1.0]]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x) * 1.0 if self.copy else self.fc(x)
        if not self.after:
            h.register_hook(lambda g: g * self.times)
        out = self.head(h)
        if self.after:
            h.register_hook(lambda g: g * self.times)
        return out


def test_one_tensor_hook_per_tensor_passed_between_modules() -> None:
    """fc's output is head's input: one hook records both rows (grad_output of fc, grad_input of head)."""
    m = LinReLU()
    m.act = nn.Identity()  # no in-place op: fc's output reaches head unchanged
    x = torch.tensor([[1.0, 0.0, 2.0], [-1.0, 3.0, 1.0]], requires_grad=True)
    registered: list[int] = []
    real = torch.Tensor.register_hook

    def counting(self: torch.Tensor, hook: Any) -> Any:
        registered.append(id(self))
        return real(self, hook)

    with nantrace.trace(m) as tr:
        torch.Tensor.register_hook = counting  # type: ignore[method-assign]
        try:
            out = m(x)
        finally:
            torch.Tensor.register_hook = real  # type: ignore[method-assign]
        out.sum().backward()
    # x (root and fc inputs), fc's output (fc, act, head see it: Identity returns its input), the root's output
    assert len(registered) == len(set(registered)) == 3
    rec = tr.records
    g = torch.tensor([[2.0, -1.0], [2.0, -1.0]])
    for module, tensor in [("fc", "grad_output[0]"), ("act", "grad_input[0]"), ("act", "grad_output[0]")]:
        assert_stats(one(rec, phase="backward", module=module, tensor=tensor), g, f"{module} {tensor}")
    assert_stats(one(rec, phase="backward", module="head", tensor="grad_input[0]"), g)


@pytest.mark.parametrize(
    ("after", "copy"),
    [(False, False), (True, False), (False, True), (True, True)],
    ids=["before_head", "after_head", "on_an_intermediate_before_head", "on_an_intermediate_after_head"],
)
def test_a_user_hook_between_modules_changes_what_reaches_the_producer_not_what_the_consumer_made(
    after: bool, copy: bool
) -> None:
    """A user hook on fc's output (or on ``fc(x) * 1.0``) doubles its gradient, registered before head takes it
    or after head ran: head's grad_input is what head's backward made (g), fc's grad_output what reached fc
    after the user's hook (2g), and fc's parameter gradients agree with 2g. Tensor hooks run in registration
    order, so nantrace's producer row moves to a hook after the user's, and head's consumer hook on a tensor
    that already has the user's hook runs before it."""
    m = UserHookBetween(after=after, copy=copy)
    x = torch.tensor([[1.0, 0.0, 2.0], [-1.0, 3.0, 1.0]])
    with nantrace.trace(m) as tr:
        m(x).sum().backward()
    rec = tr.records
    g = torch.tensor([[2.0, -1.0], [2.0, -1.0]])
    assert_stats(one(rec, phase="backward", module="head", tensor="grad_input[0]"), g)
    assert_stats(one(rec, phase="backward", module="fc", tensor="grad_output[0]"), g * 2)
    assert m.fc.bias.grad is not None
    assert m.fc.bias.grad.tolist() == [8.0, -4.0]  # the sum over the batch of 2g: the user's hook took effect


@pytest.mark.parametrize("copy", [False, True], ids=["on_fcs_output", "on_an_intermediate"])
def test_an_inf_a_user_hook_writes_between_modules_is_the_parents_code(copy: bool) -> None:
    """A user hook on fc's output (or on ``fc(x) * 1.0``) that multiplies its gradient by inf: head's backward
    made a finite gradient, the infs (±: g has both signs) are first seen in what reached fc, so the producer
    is the code of the model that registered the hook (the root's backward), not head's; watch's replay names
    the same."""
    answers = []
    for make in (nantrace.trace, nantrace.watch):
        m = UserHookBetween(times=math.inf, copy=copy)
        x = torch.tensor([[1.0, 0.0, 2.0], [-1.0, 3.0, 1.0]])
        with make(m) as tr:
            m(x).sum().backward()
        ov = tr.first_overflow()
        assert ov is not None
        answers.append((ov.step, ov.phase, ov.module, ov.module_type, ov.tensor, ov.kind))
    assert answers[0] == answers[1] == (0, "backward", "", "UserHookBetween", "fc.grad_output[0]", "inf")


class HookInside(nn.Module):
    """A submodule whose own forward registers a hook (times inf) on ``x * 1.0`` before its child ``l`` takes it."""

    def __init__(self) -> None:
        super().__init__()
        self.l = nn.Linear(2, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x * 1.0
        h.register_hook(lambda g: g * math.inf)
        return self.l(h)


def test_an_inf_a_submodules_own_hook_writes_is_that_submodules_code_not_its_childs() -> None:
    """``inner``'s forward hooks the input of its child ``l``: l's grad_input is what l's backward made
    (finite), the inf is first seen in inner's grad_input, so the producer is inner, under trace and watch."""
    answers = []
    for make in (nantrace.trace, nantrace.watch):
        m = nn.Sequential(_planted_linear(), HookInside())
        x = torch.tensor([[1.0, 0.0, 2.0], [-1.0, 3.0, 1.0]])
        with make(m) as tr:
            m(x).sum().backward()
        ov = tr.first_overflow()
        assert ov is not None
        answers.append((ov.step, ov.phase, ov.module, ov.module_type, ov.tensor, ov.kind))
        if make is nantrace.trace:
            assert_stats(
                one(tr.records, phase="backward", module="1.l", tensor="grad_input[0]"),
                m[1].l.weight.expand(2, 2),
            )
    assert answers[0] == answers[1] == (0, "backward", "1", "HookInside", "grad_input[0]", "inf")


def _two_linears() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 3), nn.ReLU(), nn.Linear(3, 2))


def _nan_where_negative(mod: nn.Module, args: tuple[Any, ...], out: torch.Tensor) -> torch.Tensor:
    return out * torch.where(out > 0, 1.0, math.nan)


def _inf_input(mod: nn.Module, args: tuple[Any, ...]) -> tuple[torch.Tensor]:
    return (args[0] * math.inf,)


@pytest.mark.parametrize("make", [nantrace.trace, nantrace.watch], ids=["trace", "watch"])
def test_a_hook_the_user_registers_after_the_trace_started_is_recorded_as_that_modules(make: Any) -> None:
    """Hooks registered after the trace started run before the recording's (moved to the end at the next root
    forward): module 0's output row is what its user hook returned, module 2's input row what its user
    pre-hook returned, and the first producer is module 0, not the root's code that passes its output on.
    The user's hooks still take effect (the model's output equals an untraced run's), and on exit only the
    user's hooks are left, in the order they were registered."""
    x = torch.tensor([[1.0, -2.0, 0.5], [0.25, 1.0, -1.0]])
    ref = _two_linears()
    ref[0].register_forward_hook(_nan_where_negative)
    ref[2].register_forward_pre_hook(_inf_input)
    want = ref(x)
    m = _two_linears()
    with make(m, every=1) if make is nantrace.watch else make(m) as tr:
        m(x)  # step 0: no user hook yet
        h0 = m[0].register_forward_hook(_nan_where_negative)
        h2 = m[2].register_forward_pre_hook(_inf_input)
        extra = m[0].register_forward_hook(lambda mod, a, o: None)
        got = m(x)
    assert torch.equal(got.isnan(), want.isnan()) and torch.equal(got.nan_to_num(), want.nan_to_num())
    ov = tr.first_overflow()
    assert ov is not None
    assert (ov.step, ov.phase, ov.module, ov.tensor, ov.kind) == (1, "forward", "0", "output", "nan")
    hooked = m[0](x).detach()
    row = one(tr.records, step=1, phase="forward", module="0", tensor="output")
    assert int(row["n_nan"]) == int(hooked.isnan().sum()) > 0
    row2 = one(tr.records, step=1, phase="forward", module="2", tensor="input[0]")
    assert int(row2["n_nan"]) == int(hooked.relu().isnan().sum())
    assert int(row2["n_posinf"] + row2["n_neginf"]) == int((hooked.relu() > 0).sum())
    assert list(m[0]._forward_hooks) == [h0.id, extra.id]
    assert list(m[2]._forward_pre_hooks) == [h2.id]


class Shared(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.shared = nn.Linear(2, 2)
        with torch.no_grad():
            self.shared.weight.copy_(torch.tensor([[1.0, -1.0], [2.0, 0.5]]))
            self.shared.bias.copy_(torch.tensor([0.25, -0.5]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for _ in range(3):
            x = self.shared(x)
        return x


def test_module_called_three_times_gets_calls_0_1_2() -> None:
    x = torch.tensor([[1.0, 2.0], [-3.0, 0.5]])
    ref = Shared()
    hs = [x]
    for _ in range(3):
        hs.append(ref.shared(hs[-1]))
        hs[-1].retain_grad()
    (hs[-1] * torch.tensor([1.0, -2.0])).sum().backward()
    m = Shared()
    with nantrace.trace(m) as tr:
        (m(x) * torch.tensor([1.0, -2.0])).sum().backward()
    rec = tr.records
    fwd = select(rec, phase="forward", module="shared")
    assert list(zip(fwd["call"], fwd["tensor"], strict=True)) == [
        (0, "input[0]"),
        (0, "output"),
        (1, "input[0]"),
        (1, "output"),
        (2, "input[0]"),
        (2, "output"),
    ]
    for call in range(3):
        assert_stats(one(fwd, call=call, tensor="input[0]"), hs[call])
        assert_stats(one(fwd, call=call, tensor="output"), hs[call + 1])
        g = hs[call + 1].grad
        assert g is not None
        assert_stats(one(rec, phase="backward", module="shared", call=call, tensor="grad_output[0]"), g)
    for call in (1, 2):
        g_in = hs[call].grad
        assert g_in is not None
        assert_stats(one(rec, phase="backward", module="shared", call=call, tensor="grad_input[0]"), g_in)
    # backward runs in reverse call order
    back = select(rec, phase="backward", module="shared", tensor="grad_output[0]")
    assert back["call"].tolist() == [2, 1, 0]
    # accumulated parameter gradient, one row
    assert_stats(one(rec, phase="backward", tensor="weight.grad"), grad(ref.shared.weight))


class PartlyDetached(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(2, 2)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        y = self.fc(x)
        return y, y.detach() * 2, torch.ones(3), torch.arange(3)


class PDModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.pd = PartlyDetached()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y, d, c, _ = self.pd(x)
        return y.sum() + d.sum() + c.sum()


def test_outputs_not_requiring_grad() -> None:
    m = PDModel()
    with nantrace.trace(m) as tr:
        m(torch.ones(1, 2)).backward()
    rec = tr.records
    assert paths(rec, phase="forward", module="pd") == ["input[0]", "output[0]", "output[1]", "output[2]"]
    assert paths(rec, phase="backward", module="pd") == ["grad_output[0]"]


@pytest.mark.parametrize("ctx", [torch.no_grad, torch.inference_mode])
def test_no_grad_and_inference_mode_give_no_backward_rows(ctx: Callable[[], Any]) -> None:
    """Without scaler or optimizer each root forward is a step, also under no_grad: data and forward rows."""
    m = LinReLU()
    with nantrace.trace(m) as tr:
        with ctx():
            for _ in range(2):
                m(torch.ones(2, 3))
        m(torch.ones(2, 3)).sum().backward()
    rec = tr.records
    assert list(tr.steps["step"]) == [0, 1, 2]
    assert set(select(rec, step=0)["phase"]) == {"data", "forward"}
    assert set(select(rec, step=1)["phase"]) == {"data", "forward"}
    assert set(select(rec, step=2)["phase"]) == {"data", "forward", "loss", "backward"}


def _eval_batches(m: nn.Module, ctx: Callable[[], Any], nan_last: bool = True) -> None:
    m.eval()
    with ctx():
        for k in range(3):
            x = torch.ones(2, 3)
            if nan_last and k == 2:
                x[0, 0] = float("nan")
            m(x)
    m.train()


@pytest.mark.parametrize("ctx", [torch.no_grad, torch.inference_mode])
@pytest.mark.parametrize("with_scaler", [False, True])
def test_evaluation_forwards_of_a_training_trace_are_not_micro_steps(
    ctx: Callable[[], Any], with_scaler: bool
) -> None:
    """With an optimizer (or a GradScaler) a root forward under no_grad/inference_mode is evaluation: it is
    not recorded, so the NaN of an eval batch is not a training step's data and no step is invented after
    the last optimizer step."""
    m = LinReLU()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=1.0) if with_scaler else None
    with nantrace.trace(m, optimizer=opt, scaler=scaler) as tr:
        for _ in range(2):
            loss = m(torch.ones(2, 3)).sum()
            if scaler is not None:
                scaler.scale(loss).backward()
                scaler.step(opt)
                scaler.update()
            else:
                loss.backward()
                opt.step()
            opt.zero_grad()
            _eval_batches(m, ctx)  # after step 0, and after the last optimizer step
    assert tr.steps["step"].tolist() == [0, 1]
    assert tr.steps["micro_steps"].tolist() == [1, 1]
    assert tr.steps["n_nonfinite"].tolist() == [0, 0]
    assert tr.first_overflow() is None
    rec = tr.records
    assert pairs(select(rec, phase="data")) == [(0, 0), (1, 0)]
    assert len(rec) == 2 * len(select(rec, step=0))


def test_grad_enabled_forward_under_eval_mode_is_still_a_micro_step() -> None:
    """The rule reads autograd, not ``module.training``: an eval-mode forward with grad on is a micro-step."""
    m = LinReLU()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    with nantrace.trace(m, optimizer=opt) as tr:
        m.eval()
        m(torch.ones(2, 3)).sum().backward()
        m(torch.ones(2, 3)).sum().backward()
        opt.step()
    assert tr.steps["micro_steps"].tolist() == [2]


class KwCall(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = _planted_linear()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(input=x)


def test_kwargs_forward_call() -> None:
    m = KwCall()
    x = torch.tensor([[1.0, 0.0, 2.0]], requires_grad=True)
    with nantrace.trace(m) as tr:
        m(x).sum().backward()
    rec = tr.records
    assert_stats(one(rec, phase="forward", module="fc", tensor="input.input"), x)
    assert_stats(one(rec, phase="backward", module="fc", tensor="grad_input.input"), grad(x))
    assert_stats(one(rec, phase="backward", module="fc", tensor="grad_output[0]"), torch.ones(1, 2))


# ------------------------------------------------------------------------------------------------ 6. loss phase
def test_loss_through_scaler_scale() -> None:
    m = Wrap(_planted_linear())
    opt = torch.optim.SGD(m.parameters(), lr=0.0)
    scaler = torch.amp.GradScaler("cpu", init_scale=8.0)
    x = torch.tensor([[1.0, 0.0, 2.0]])
    c = torch.tensor([[0.5, -3.0]])
    with nantrace.trace(m, scaler=scaler, optimizer=opt) as tr:
        loss = (m(x) * c).sum()
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
    rec = tr.records
    row = one(rec, phase="loss", tensor="loss")
    assert_stats(row, loss)
    assert row["scale"] == 1.0
    assert tr.steps["loss"].tolist() == [loss.item()]
    g = one(rec, phase="loss", tensor="grad_output[0]")
    assert_stats(g, c * 8.0)  # the gradient arriving at the outputs is the scaled one
    assert g["module"] == "" and g["scale"] == 8.0
    # in time order: forward, then the loss, then the gradient at the outputs
    fwd_last = select(rec, phase="forward")["seq"].max()
    assert fwd_last < row["seq"] < g["seq"]


def test_loss_through_tr_step() -> None:
    m = Wrap(_planted_linear())
    x = torch.tensor([[1.0, 0.0, 2.0]])
    losses = []
    with nantrace.trace(m) as tr:
        for i in range(2):
            per_sample = (m(x) * (i + 1)).pow(2)  # a non-scalar loss: its mean is the step's loss
            per_sample.sum().backward()
            tr.step(loss=per_sample)
            losses.append(per_sample.mean().item())
    assert tr.steps["loss"].tolist() == losses
    assert paths(tr.records, phase="loss") == ["grad_output[0]", "loss", "grad_output[0]", "loss"]
    assert_stats(one(tr.records, phase="loss", tensor="loss", step=1), per_sample)
    # with an optimizer, tr.step(loss=...) before optimizer.step() records into the current step
    opt = torch.optim.SGD(m.parameters(), lr=0.0)
    with nantrace.trace(m, optimizer=opt) as tr2:
        loss = m(x).sum()
        tr2.step(loss=loss)
        loss.backward()
        opt.step()
    assert tr2.steps["loss"].tolist() == [loss.item()]
    assert len(tr2.steps) == 1


def test_no_loss_seen_gives_nan() -> None:
    m = Tiny()
    with nantrace.trace(m) as tr:
        m(_x(1)).sum().backward()
    assert math.isnan(tr.steps["loss"].iloc[0])


# ------------------------------------------------------------------------------------------------ 7. optimizer phase
def test_params_after_optimizer_step_and_lr() -> None:
    torch.manual_seed(1)
    m = TwoLayer()
    opt = torch.optim.SGD(m.parameters(), lr=0.5)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    after: list[dict[str, torch.Tensor]] = []
    with nantrace.trace(m, optimizer=opt) as tr:
        for _ in range(3):
            m(torch.randn(4, 3)).pow(2).mean().backward()
            opt.step()
            after.append({k: v.detach().clone() for k, v in m.named_parameters()})
            sched.step()
            opt.zero_grad()
    assert tr.steps["lr"].tolist() == [0.5, 0.25, 0.125]
    rec = tr.records
    opt_rows = select(rec, phase="optimizer")
    assert sorted(set(zip(opt_rows["module"], opt_rows["tensor"], strict=True))) == [
        ("fc1", "bias"),
        ("fc1", "weight"),
        ("fc2", "bias"),
        ("fc2", "weight"),
    ]
    for s in range(3):
        for name, value in after[s].items():
            mod, pname = name.split(".")
            row = one(rec, step=s, phase="optimizer", module=mod, tensor=pname)
            assert_stats(row, value)
            assert row["scale"] == 1.0 and row["module_type"] == "Linear"
    # optimizer rows come last in the step
    for s in range(3):
        g = select(rec, step=s)
        assert (g.sort_values("seq")["phase"].iloc[-4:] == "optimizer").all()


def _grad_norm(model: nn.Module) -> float:
    return float(torch.nn.utils.get_total_norm([p.grad for p in model.parameters() if p.grad is not None]))


@pytest.mark.parametrize("sync_free", [None, True], ids=["default", "sync_free"])
@pytest.mark.parametrize("init_scale", [None, 2.0**12], ids=["no_scaler", "scaler"])
def test_grad_norm_is_the_unscaled_total_norm(init_scale: float | None, sync_free: bool | None) -> None:
    torch.manual_seed(2)
    m = TwoLayer()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    scaler = (
        None if init_scale is None else torch.amp.GradScaler("cpu", init_scale=init_scale, growth_interval=1)
    )
    norms, scales = [], []
    with nantrace.trace(m, optimizer=opt, scaler=scaler, sync_free=sync_free) as tr:
        for _ in range(3):
            for _ in range(2):  # gradient accumulation: the norm of the accumulated gradient
                loss = m(torch.randn(4, 3)).pow(2).mean()
                (loss if scaler is None else scaler.scale(loss)).backward()
            if scaler is None:
                opt.step()
            else:
                scales.append(scaler.get_scale())
                scaler.step(opt)  # unscales .grad in place
                scaler.update()
            norms.append(_grad_norm(m))
            opt.zero_grad()
    np.testing.assert_allclose(tr.steps["grad_norm"].to_numpy(), norms, rtol=1e-6)
    rec = tr.records
    grads = rec[rec["phase"].isin(["backward", "loss"]) & rec["tensor"].astype(str).str.contains("grad")]
    other = rec.drop(grads.index)
    assert len(grads) and len(other)
    if scaler is None:
        assert (rec["scale"] == 1.0).all()
        assert tr.steps["scale"].isna().all()
    else:
        assert scales == [4096.0, 8192.0, 16384.0]
        for s in range(3):
            assert (select(grads, step=s)["scale"] == scales[s]).all()
        assert (other["scale"] == 1.0).all()
        assert tr.steps["scale"].tolist() == scales


def test_float64_model_trains() -> None:
    m = TwoLayer(dtype=torch.float64)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    with nantrace.trace(m, optimizer=opt) as tr:
        m(torch.ones(2, 3, dtype=torch.float64)).pow(2).mean().backward()
        opt.step()
    assert tr.steps["grad_norm"].iloc[0] == pytest.approx(_grad_norm(m), rel=1e-12)


# ------------------------------------------------------------------------------------------------ 8. scaler
@pytest.mark.parametrize("sync_free", [None, True], ids=["default", "sync_free"])
def test_scaler_state_step_by_step(sync_free: bool | None) -> None:
    torch.manual_seed(3)
    m = TwoLayer()
    opt = torch.optim.SGD(m.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**14, growth_interval=2)
    factors = [1e38, 1.0, 1.0, 1.0, 1e38, 1.0]  # 1e38 * 2**14 overflows float32: those steps skip
    expected = []
    with nantrace.trace(m, scaler=scaler, optimizer=opt, sync_free=sync_free) as tr:
        for f in factors:
            loss = m(torch.randn(4, 3)).pow(2).mean() * f
            scaler.scale(loss).backward()
            before = [p.detach().clone() for p in m.parameters()]
            scale = scaler.get_scale()
            scaler.step(opt)
            skipped = all(torch.equal(a, p) for a, p in zip(before, m.parameters(), strict=True))
            scaler.update()
            expected.append(
                {
                    "loss": loss.item(),
                    "scale": scale,
                    "next_scale": scaler.get_scale(),
                    "skipped": skipped,
                    "growth_tracker": scaler.state_dict()["_growth_tracker"],
                }
            )
            opt.zero_grad()
    steps = tr.steps
    for col in ("loss", "scale", "next_scale", "skipped", "growth_tracker"):
        assert steps[col].tolist() == [e[col] for e in expected], col
    # the run skips, backs off, then grows
    assert [e["skipped"] for e in expected] == [True, False, False, False, True, False]
    assert [e["scale"] for e in expected] == [2.0**14, 2.0**13, 2.0**13, 2.0**14, 2.0**14, 2.0**13]
    assert steps["n_nonfinite"].gt(0).tolist() == [e["skipped"] for e in expected]
    assert steps["lr"].tolist() == [0.01] * len(factors)  # a skipped step still had a learning rate


def test_columns_that_cannot_be_known_are_missing() -> None:
    m = Tiny()
    with nantrace.trace(m) as tr:
        m(_x(1)).sum().backward()
    row = tr.steps.iloc[0]
    for col in ("loss", "scale", "next_scale", "lr"):
        assert math.isnan(row[col]), col
    assert pd.isna(row["skipped"]) and pd.isna(row["growth_tracker"])
    assert row["grad_norm"] == pytest.approx(_grad_norm(m), rel=1e-6)
    # a disabled scaler knows no scale either
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    with nantrace.trace(m, scaler=scaler, optimizer=opt) as tr2:
        for i in range(2):
            scaler.scale(m(_x(i)).sum()).backward()
            scaler.step(opt)
            scaler.update()
    st2 = tr2.steps
    assert st2["step"].tolist() == [0, 1]
    assert st2["scale"].isna().all() and st2["next_scale"].isna().all()
    assert st2["skipped"].isna().all() and st2["growth_tracker"].isna().all()
    assert (tr2.records["scale"] == 1.0).all()


# ------------------------------------------------------------------------------------------------ 9. hooks removed
class Boom(Exception):
    pass


def _assert_no_hooks(m: nn.Module, opt: torch.optim.Optimizer, scaler: torch.amp.GradScaler) -> None:
    for name, mod in m.named_modules():
        for attr in (
            "_forward_hooks",
            "_forward_pre_hooks",
            "_forward_hooks_with_kwargs",
            "_forward_pre_hooks_with_kwargs",
            "_forward_hooks_always_called",
            "_backward_hooks",
            "_backward_pre_hooks",
        ):
            assert not getattr(mod, attr), (name, attr)
    for name, p in m.named_parameters():
        assert not getattr(p, "_post_accumulate_grad_hooks", None), name
        assert not p._backward_hooks, name
    assert not opt._optimizer_step_pre_hooks and not opt._optimizer_step_post_hooks
    assert "scale" not in vars(scaler) and "update" not in vars(scaler)
    assert scaler.scale.__func__ is torch.amp.GradScaler.scale  # type: ignore[attr-defined]
    assert scaler.update.__func__ is torch.amp.GradScaler.update  # type: ignore[attr-defined]
    mm = torch.nn.modules.module
    assert not mm._global_forward_hooks and not mm._global_forward_pre_hooks


def test_hooks_removed_on_exit_and_after_an_exception() -> None:
    torch.manual_seed(4)
    m = TwoLayer()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=4.0)
    with nantrace.trace(m, scaler=scaler, optimizer=opt) as tr:
        _train(m, [torch.randn(2, 3)], opt, scaler)
    _assert_no_hooks(m, opt, scaler)
    n_rows = len(tr.records)

    err = Boom("inside the loop")
    kept: list[torch.Tensor] = []
    with pytest.raises(Boom) as info, nantrace.trace(m, scaler=scaler, optimizer=opt) as tr2:
        _train(m, [torch.randn(2, 3)], opt, scaler)
        out = m(torch.randn(2, 3))  # step 1 is open: its tensor hooks are registered
        kept.append(out)
        raise err
    assert info.value is err
    _assert_no_hooks(m, opt, scaler)
    assert not kept[0]._backward_hooks
    # records up to the crash are readable, the open step included
    rec = tr2.records
    assert len(select(rec, step=0)) == n_rows
    assert paths(rec, step=1, phase="data") == ["input[0]"]
    assert tr2.steps["step"].tolist() == [0, 1]
    # the model trains normally afterwards, without tracing, and can be traced again
    kept[0].sum().backward()
    with nantrace.trace(m, scaler=scaler, optimizer=opt) as tr3:
        _train(m, [torch.randn(2, 3)], opt, scaler)
    assert len(tr3.records) == n_rows
    _assert_no_hooks(m, opt, scaler)


class Crashing(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(2, 2)
        self.bad = Boomer()
        self.armed = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        return self.bad(h) if self.armed else h


class Boomer(nn.Module):
    error = Boom("in forward")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise self.error


def test_exception_inside_a_module_forward() -> None:
    m = Crashing()
    m.armed = True
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu")
    with pytest.raises(Boom) as info, nantrace.trace(m, optimizer=opt, scaler=scaler) as tr:
        m(torch.ones(1, 2))
    assert info.value is Boomer.error
    _assert_no_hooks(m, opt, scaler)
    assert paths(tr.records, module="fc") == ["input[0]", "output"]
    assert paths(tr.records, module="bad") == ["input[0]"]


def test_exception_caught_inside_the_loop_keeps_counting_right() -> None:
    m = Crashing()
    with nantrace.trace(m) as tr:
        m(torch.ones(1, 2))
        m.armed = True
        with pytest.raises(Boom):
            m(torch.ones(1, 2))
        m.armed = False
        m(torch.ones(1, 2)).sum().backward()
    rec = tr.records
    assert pairs(select(rec, phase="data")) == [(0, 0), (1, 0), (2, 0)]
    assert select(rec, step=2, module="fc")["call"].tolist() == [0, 0, 0, 0, 0]  # in, out, grad_out, b, w
    assert set(select(rec, step=2)["phase"]) == {"data", "forward", "loss", "backward"}


class KeepsRef(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(3, 3)
        self.b = nn.Linear(3, 1)
        self.hidden: weakref.ref[torch.Tensor] | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        self.hidden = weakref.ref(h)
        return self.b(h)


@pytest.mark.parametrize("sync_free", [None, True], ids=["default", "sync_free"])
def test_no_reference_kept_to_activations_or_gradients(sync_free: bool | None) -> None:
    m = KeepsRef()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu")
    with nantrace.trace(m, optimizer=opt, scaler=scaler, sync_free=sync_free):
        x = torch.randn(2, 3, requires_grad=True)
        loss = m(x).sum()
        scaler.scale(loss).backward()
        refs = [weakref.ref(x), weakref.ref(loss), weakref.ref(grad(x)), m.hidden]
        del x, loss
        gc.collect()
        assert all(r is not None and r() is None for r in refs)  # freed mid-step, before the boundary
        scaler.step(opt)
        scaler.update()


# ------------------------------------------------------------------------------------------------ 10. bit-identical
class Overflowing(nn.Module):
    """Its own multiply overflows fp16 when the input is large: that call is replayed by the recorder."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.bn = nn.BatchNorm1d(8)
        self.drop = nn.Dropout(0.25)
        self.gain = 0.01

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        return self.drop(self.bn(h)) + h * self.gain


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(4, 8)
        self.bn = nn.BatchNorm1d(8)
        self.drop = nn.Dropout(0.5)
        self.block = Overflowing()
        self.head = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.block(self.drop(torch.relu(self.bn(self.inp(x))))))


def _run(template: Net, trace: bool, overflow_step: int = -1, init_scale: float = 2.0**10) -> dict[str, Any]:
    model = copy.deepcopy(template)
    model.inp.bias.requires_grad_(False)  # a frozen parameter
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    scaler = torch.amp.GradScaler("cpu", init_scale=init_scale, growth_interval=2)
    gen = torch.Generator().manual_seed(7)
    xs = [torch.randn(6, 4, generator=gen) for i in range(5)]
    torch.manual_seed(11)
    losses, grads = [], []
    ctx = nantrace.trace(model, scaler=scaler, optimizer=opt) if trace else None
    if ctx is not None:
        ctx.__enter__()
    try:
        for i, x in enumerate(xs):
            model.block.gain = 1e6 if i == overflow_step else 0.01  # the block's own multiply overflows fp16
            with torch.autocast("cpu", dtype=torch.float16):
                loss = model(x).float().pow(2).mean()
            scaler.scale(loss).backward()
            losses.append(loss.detach().clone())
            grads.append([p.grad.clone() for p in model.parameters() if p.grad is not None])
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
    finally:
        if ctx is not None:
            ctx.__exit__(None, None, None)
    return {
        "model": model,
        "losses": losses,
        "grads": grads,
        "state": model.state_dict(),
        "rng": torch.get_rng_state(),
        "scale": scaler.get_scale(),
        "trace": ctx,
        "requires_grad": [p.requires_grad for p in model.parameters()],
    }


def _assert_same_training(plain: dict[str, Any], traced: dict[str, Any]) -> None:
    assert len(plain["losses"]) == len(traced["losses"]) == 5
    for a, b in zip(plain["losses"], traced["losses"], strict=True):
        assert same_bits(a, b)
    for ga, gb in zip(plain["grads"], traced["grads"], strict=True):
        assert len(ga) == len(gb)
        for a, b in zip(ga, gb, strict=True):
            assert same_bits(a, b)
    assert plain["state"].keys() == traced["state"].keys()
    for k in plain["state"]:
        assert same_bits(plain["state"][k], traced["state"][k]), k
    assert torch.equal(plain["rng"], traced["rng"])
    assert plain["scale"] == traced["scale"]
    assert plain["requires_grad"] == traced["requires_grad"]
    assert traced["requires_grad"].count(False) == 1
    tr = traced["trace"]
    np.testing.assert_array_equal(tr.steps["loss"].to_numpy(), [float(v) for v in traced["losses"]])


def test_training_is_bit_identical_with_and_without_tracing() -> None:
    """Dropout (RNG), batch norm (buffers), fp16 autocast, a GradScaler that grows and skips, AdamW."""
    torch.manual_seed(0)
    template = Net()
    plain = _run(template, trace=False, init_scale=2.0**16)
    traced = _run(template, trace=True, init_scale=2.0**16)
    skipped = traced["trace"].steps["skipped"].tolist()
    assert True in skipped and False in skipped  # the run exercised a skipped step and real updates
    _assert_same_training(plain, traced)


def test_training_is_bit_identical_when_a_forward_call_is_replayed() -> None:
    torch.manual_seed(0)
    template = Net()
    plain = _run(template, trace=False, overflow_step=2, init_scale=2.0**16)
    traced = _run(template, trace=True, overflow_step=2, init_scale=2.0**16)
    assert "block" in set(traced["trace"].ops["module"])  # the block (dropout + batch norm) was replayed
    _assert_same_training(plain, traced)


class BNBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.bn = nn.BatchNorm1d(2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.bn(x) * 1e39  # a new +inf made by this module's own multiply: the call is replayed


def test_replayed_batchnorm_call_still_backpropagates() -> None:
    m = nn.Sequential(BNBlock())
    x = torch.randn(4, 2, requires_grad=True)
    m(x).sum().backward()  # fine without tracing
    with nantrace.trace(m) as tr:
        m(x).sum().backward()
    assert one(tr.records, phase="forward", module="0", tensor="output")["n_posinf"] > 0


class AddInPlace(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.add_(60000.0)


class InPlaceNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(2, 2, bias=False, dtype=torch.float16)
        with torch.no_grad():
            self.fc.weight.copy_(torch.eye(2))
        self.add = AddInPlace()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.add(self.fc(x))


def test_inplace_module_output_unchanged_by_tracing() -> None:
    m = InPlaceNet()
    x = torch.tensor([[10000.0, 1.0]], dtype=torch.float16)
    expected = m(x)  # [inf, 60000]
    with nantrace.trace(m) as tr:
        got = m(x)
    assert same_bits(got, expected)
    assert one(tr.records, module="add", tensor="output")["n_posinf"] == 1


def test_requires_grad_of_inputs_untouched() -> None:
    m = Wrap(_planted_linear())
    x = torch.ones(1, 3)
    xg = torch.ones(1, 3, requires_grad=True)
    with nantrace.trace(m) as tr:
        m(x).sum().backward()
        m(xg).sum().backward()
    assert not x.requires_grad and x.grad is None
    assert xg.requires_grad and xg.grad is not None
    assert all(p.requires_grad for p in m.parameters())
    assert paths(tr.records, step=0, phase="backward", module="") == []
    assert paths(tr.records, step=1, phase="backward", module="") == ["grad_input[0]"]


@pytest.mark.parametrize("phase", ["data", "forward", "loss", "backward", "optimizer"])
def test_phases_option_records_only_those_phases(phase: str) -> None:
    m = TwoLayer()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=4.0)
    with nantrace.trace(m, scaler=scaler, optimizer=opt, phases=[phase]) as tr:
        _train(m, [torch.ones(2, 3)], opt, scaler)
    assert set(tr.records["phase"]) == {phase}
    assert tr.steps["scale"].tolist() == [4.0]


# ------------------------------------------------------------------------------------------------ 11. misuse, filters
def test_tracing_the_same_model_twice_at_once_is_refused() -> None:
    m = TwoLayer()
    with nantrace.trace(m) as tr:
        with pytest.raises(nantrace.NantraceError) as info, nantrace.trace(m):
            pass
        assert isinstance(info.value, ValueError)
        with pytest.raises(nantrace.NantraceError), nantrace.trace(m.fc1):  # a traced submodule too
            pass
        m(torch.ones(1, 3))  # the first trace still records
    assert paths(tr.records, phase="data") == ["input[0]"]
    assert len(select(tr.records, module="fc1")) == 2
    # after exit the model can be traced again; a used Trace cannot be re-entered
    with nantrace.trace(m):
        pass
    with pytest.raises(nantrace.NantraceError), tr:
        pass


def test_step_outside_with_and_bad_loss() -> None:
    m = Tiny()
    tr = nantrace.trace(m)
    with pytest.raises(nantrace.NantraceError):
        tr.step()
    with tr, pytest.raises(TypeError, match=r"loss must be a torch\.Tensor, a Python float or None; got str"):
        tr.step(loss="3.0")  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("kwargs", "error", "name"),
    [
        ({"model": "not a module"}, TypeError, "model"),
        ({"model": torch.ones(2)}, TypeError, "model"),
        ({"scaler": object()}, TypeError, "scaler"),
        ({"scaler": torch.cuda.amp}, TypeError, "scaler"),
        ({"optimizer": object()}, TypeError, "optimizer"),
        ({"optimizer": [torch.ones(1)]}, TypeError, "optimizer"),
        ({"modules": "nothing.*"}, ValueError, "modules"),
        ({"modules": nn.Conv2d}, ValueError, "modules"),
        ({"modules": []}, ValueError, "modules"),
        ({"modules": [3]}, TypeError, "modules"),
        ({"phases": ["forward", "sideways"]}, ValueError, "phases"),
        ({"sync_free": "yes"}, TypeError, "sync_free"),
    ],
)
def test_bad_arguments_name_the_argument(kwargs: dict[str, Any], error: type[Exception], name: str) -> None:
    args: dict[str, Any] = {"model": TwoLayer(), **kwargs}
    model = args.pop("model")
    with pytest.raises(error, match=name):
        nantrace.trace(model, **args)


class Filtered(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.enc = nn.Sequential(nn.Linear(2, 3), nn.ReLU(), nn.Linear(3, 3))
        self.dec = nn.Linear(3, 3)
        self.head = nn.Sequential(nn.Linear(3, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.dec(self.enc(x)))


@pytest.mark.parametrize(
    ("modules", "expected"),
    [
        ("enc.*", {"enc.0", "enc.1", "enc.2"}),
        ("enc", {"enc"}),
        (nn.Linear, {"enc.0", "enc.2", "dec", "head.0"}),
        (lambda name, mod: name.startswith("head"), {"head", "head.0"}),
        (["dec", nn.ReLU], {"dec", "enc.1"}),
        (nn.Sequential, {"", "enc", "head"}),
    ],
    ids=["glob", "name", "type", "callable", "list", "root_type"],
)
def test_modules_filter_hooks_exactly_the_expected_modules(modules: Any, expected: set[str]) -> None:
    m = Filtered()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    names = {mod: name for name, mod in m.named_modules()}
    with nantrace.trace(m, modules=modules, optimizer=opt) as tr:
        hooked = {names[mod] for mod in m.modules() if mod._forward_hooks or mod._forward_pre_hooks}
        with_param_hooks = {
            n.rsplit(".", 1)[0]
            for n, p in m.named_parameters()
            if getattr(p, "_post_accumulate_grad_hooks", None)
        }
        m(torch.ones(1, 2)).sum().backward()
        opt.step()
    assert hooked == expected | {""}  # the root always records the model's inputs and outputs
    assert set(tr.records["module"].unique()) == expected | {""}
    owners = {n.rsplit(".", 1)[0] for n, _ in m.named_parameters()}
    assert with_param_hooks == expected & owners
    assert set(select(tr.records, phase="optimizer")["module"]) == expected & owners
    for mod in m.modules():
        assert not mod._forward_hooks and not mod._forward_pre_hooks
