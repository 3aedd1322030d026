"""Issue 17 kind 3: transient infs inside a module call, which never reach a module boundary.

The output is finite (``tanh(inf) = 1`` in a tanh-GELU), or silently zero (``rsqrt(inf) = 0`` in an RMSNorm
without a float32 upcast, ``x / inf = 0`` in a cosine similarity or a cumsum-normalised sequence). The drill-down
replays such a call at op level when the recorded statistics point to it (more zeros out than in, or an input
beyond the cube root of its dtype's max) and names the op that made the inf, with its source line, as the
producer, when the inf changed what the call computed. A value that a selection discards is not a forward
fault; the backward NaN it makes names the forward op."""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pandas as pd
import pytest
import torch
from torch import nn

import nantrace


def _line(cls: type, offset: int = 1) -> str:
    """``path:line`` of the ``offset``-th line of ``cls.forward`` (the line holding the op)."""
    code = cls.forward.__code__  # type: ignore[attr-defined]
    return f"{code.co_filename}:{code.co_firstlineno + offset}"


class TanhGELU(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return 0.5 * x * (1.0 + torch.tanh(0.7978845608 * (x + 0.044715 * torch.pow(x, 3))))


class RMSNorm(nn.Module):
    """No float32 upcast: ``x²`` of 300 is 90000 > 65504, so the mean is inf and ``rsqrt(inf) = 0``."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


class Cosine(nn.Module):
    """``a·b / sqrt(|a|²·|b|²)``: |a|² = 8·200² = 320000 > 65504 is inf, so the similarity is a silent 0."""

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return (a * b).sum(-1) / torch.sqrt((a * a).sum(-1) * (b * b).sum(-1))


class CumNorm(nn.Module):
    """``x / cumsum(x)`` over a sequence of 30000s: the running sum passes 65504 at the third position."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x / torch.cumsum(x, dim=1)


class Discard(nn.Module):
    """``where(p < 0.5, log(0.5 - p) ... )``: log of 0 where p = 0.5 is -inf in an entry that ``where``
    discards, so the output is the same whatever finite value it had; its backward is 0·inf = NaN."""

    def forward(self, p: torch.Tensor) -> torch.Tensor:
        y = torch.log(0.5 - p)
        return torch.where(p < 0.5, y, torch.zeros_like(y))


class Wrap(nn.Module):
    """An identity Linear ``fc`` (weights the identity, bias 0), then the module under test as ``inner`` (on
    ``h`` and ``h / 100`` when ``pair``)."""

    def __init__(self, inner: nn.Module, pair: bool = False) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.inner = inner
        self.pair = pair
        with torch.no_grad():
            self.fc.weight.copy_(torch.eye(8))
            self.fc.bias.zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        return self.inner(h, h * 0.01) if self.pair else self.inner(h)


def _run(inner: nn.Module, x: torch.Tensor, *, pair: bool = False) -> tuple[nantrace.Trace, torch.Tensor]:
    m = Wrap(inner, pair).half()
    with nantrace.trace(m) as tr:
        out = m(x)
        out.float().sum().backward()
    return tr, out.detach()


def _where(ov: nantrace.Overflow | None) -> tuple | None:
    return None if ov is None else (ov.step, ov.phase, ov.module, ov.call, ov.tensor, ov.kind)


def _ops(tr: nantrace.Trace) -> list[list]:
    return tr.ops[["module", "call", "op", "kind", "source", "reaches"]].values.tolist()


def _full(value: float, rows: int = 2) -> torch.Tensor:
    return torch.full((rows, 8), value, dtype=torch.float16)


def test_tanh_gelu_pow_inf_saturated_by_tanh_is_the_producer() -> None:
    """x = 300: x³ is inf, tanh(inf) = 1, the output is a finite 300 (the input beyond the cube root of
    65504, 40.3, is the recorded signal); the backward's 3·x² = inf times tanh's zero gradient is NaN. The
    producer is the forward `pow`, kind inf, at its line."""
    tr, out = _run(TanhGELU(), _full(300.0))
    assert bool(torch.isfinite(out).all()) and float(out.max()) == 300.0
    rec = tr.records
    bwd = rec[(rec["phase"] == "backward") & (rec["module"] == "inner") & (rec["tensor"] == "grad_input[0]")]
    assert int(bwd["n_nan"].iloc[0]) == 16  # without the drill-down this would be the first non-finite value
    ov = tr.first_overflow()
    assert _where(ov) == (0, "forward", "inner", 0, "output", "inf")
    assert _ops(tr) == [["inner", 0, "pow", "posinf", _line(TanhGELU), True]]
    assert (
        f"produced +inf in `pow` at {_line(TanhGELU)} inside its forward (float16), from finite inputs (input absmax 300)"
        in str(ov)
    )


@pytest.mark.parametrize(("value", "named"), [(50.0, True), (40.0, False)], ids=["x50", "x40"])
def test_tanh_gelu_pow_inf_below_the_square_root_is_found_from_the_cube_root(
    monkeypatch: pytest.MonkeyPatch, value: float, named: bool
) -> None:
    """x = 50, below sqrt(65504) = 256 but beyond its cube root 40.3: x³ = 125000 is inf, tanh(inf) = 1, the
    output is a finite 50. The input's absmax is the signal: the identity Linear (input 50, nothing found) and
    the TanhGELU (its `pow` named) are replayed; the root, whose input is 50 too, is not: it holds a call that
    named a transient value. The backward stays finite (3·x² = 7500 times tanh's zero gradient is 0). x = 40:
    x³ = 64000 < 65504, no inf and no input beyond 40.3: nothing is replayed, nothing named."""
    replays, _ = _count_replays(monkeypatch)
    tr, out = _run(TanhGELU(), _full(value))
    assert bool(torch.isfinite(out).all()) and float(out.max()) == value
    assert tr.first_overflow(kind="nan") is None
    if not named:
        assert replays == [] and len(tr.ops) == 0 and tr.first_overflow() is None
        return
    assert replays == [("Linear", 0), ("TanhGELU", 0)]
    ov = tr.first_overflow()
    assert _where(ov) == (0, "forward", "inner", 0, "output", "inf")
    assert _ops(tr) == [["inner", 0, "pow", "posinf", _line(TanhGELU), True]]
    assert (
        f"produced +inf in `pow` at {_line(TanhGELU)} inside its forward (float16), from finite inputs "
        "(input absmax 50)" in str(ov)
    )


@pytest.mark.parametrize(("value", "clean"), [(50.0, True), (300.0, False)], ids=["x50", "x300"])
def test_a_transient_diagnosis_says_the_output_stayed_finite_and_whether_the_step_broke(
    value: float, clean: bool
) -> None:
    """The diagnosis of a transient says the call's output stayed finite, in its summary and evidence, and,
    only when no recorded tensor of the step held inf/NaN (x = 50: the backward's 3·x² = 7500 is finite), that it
    broke no step; x = 300 makes the backward NaN (3·x² = inf times tanh's zero gradient), so it does not."""
    tr, _ = _run(TanhGELU(), _full(value))
    d = tr.diagnose()
    assert d.cause == "forward_overflow"
    assert d.summary == (
        "`inner` (TanhGELU) overflowed float16 inside its forward at step 0: `pow` exceeded 65504 from finite "
        "inputs; the call's output stayed finite."
    )
    assert (
        f"its output stayed finite (absmax {value:g}): the inf of `pow` did not leave the call, but the output "
        "depends on it (a replay with a finite value in its place computes another output)"
    ) in d.evidence
    broke = "no tensor recorded at step 0 held inf/NaN: so far it only changed values, it broke no step"
    assert (broke in d.evidence) is clean


def test_rmsnorm_without_upcast_silent_zero_is_the_producer() -> None:
    """Row 0 of 300s: x² = 90000 is inf, rsqrt(inf) = 0, the row is silently 0 (8 zeros out, none in)."""
    x = _full(300.0)
    x[1] = 1.0
    tr, out = _run(RMSNorm(), x)
    assert float(out[0].abs().max()) == 0.0 and float(out[1].min()) == 1.0
    assert _where(tr.first_overflow()) == (0, "forward", "inner", 0, "output", "inf")
    assert _ops(tr) == [["inner", 0, "pow", "posinf", _line(RMSNorm, 1), True]]
    assert tr.first_overflow(kind="nan") is None  # the backward of rsqrt's saturated zero stays finite here


def test_cosine_similarity_squared_norms_overflow_is_the_producer() -> None:
    """a = h = 200, b = h/100: a·b = 3200, |a|² = 320000 is inf (the `sum`), the similarity a silent 0."""
    tr, out = _run(Cosine(), _full(200.0), pair=True)
    assert out.tolist() == [0.0, 0.0]
    assert _where(tr.first_overflow()) == (0, "forward", "inner", 0, "output", "inf")
    assert _ops(tr) == [["inner", 0, "sum", "posinf", _line(Cosine, 1), True]]


def test_cumsum_over_a_long_sequence_is_the_producer() -> None:
    """30000 · 3 = 90000 > 65504 at the third position: x / inf = 0 from there on (6 zeros in a row of 8)."""
    tr, out = _run(CumNorm(), _full(30000.0, rows=1))
    assert int((out == 0).sum()) == 6
    assert _where(tr.first_overflow()) == (0, "forward", "inner", 0, "output", "inf")
    assert _ops(tr) == [["inner", 0, "cumsum", "posinf", _line(CumNorm, 1), True]]


def test_a_discarded_value_is_not_a_forward_fault_its_backward_nan_names_the_op() -> None:
    """log(0) = -inf where p = 0.5, discarded by `where`: the replays with 0, 65504 and -65504 in its place give
    the same output, so ``reaches`` is False, and the fault is the backward NaN (0·inf) of `inner`."""
    m = Wrap(Discard()).half()
    p = torch.tensor([[0.1, 0.2, 0.5, 0.3, 0.1, 0.1, 0.1, 0.1]], dtype=torch.float16)
    with nantrace.trace(m) as tr:
        m(p).float().sum().backward()
    assert _ops(tr) == [["inner", 0, "log", "neginf", _line(Discard, 1), False]]
    ov = tr.first_overflow()
    assert _where(ov) == (0, "backward", "inner", 0, "grad_input[0]", "nan")
    assert "made by `log`" in str(ov)


def test_healthy_calls_with_large_inputs_and_relu_zeros_name_nothing() -> None:
    """Inputs of 300 through an identity Linear and a ReLU (half its outputs 0): the signals fire, the replays
    find no inf, so nothing is reported and the ops table stays empty."""
    m = nn.Sequential(nn.Linear(8, 8), nn.ReLU()).half()
    with torch.no_grad():
        m[0].weight.copy_(torch.eye(8))
        m[0].bias.zero_()
    x = torch.full((2, 8), 300.0, dtype=torch.float16)
    x[:, ::2] = -300.0
    with nantrace.trace(m) as tr:
        m(x).float().sum().backward()
    assert tr.first_overflow() is None
    assert len(tr.ops) == 0


def test_a_transient_producer_is_the_same_after_save_and_load(tmp_path: Path) -> None:
    tr, _ = _run(RMSNorm(), _full(300.0))
    tr.save(tmp_path / "t.parquet")
    back = nantrace.load(tmp_path / "t.parquet")
    pd.testing.assert_frame_equal(
        back.ops.reset_index(drop=True), tr.ops.reset_index(drop=True), check_dtype=False
    )
    assert str(back.first_overflow()) == str(tr.first_overflow())
    assert not math.isnan(float(back.records["absmax"].max()))


def _discard_run() -> nantrace.Trace:
    m = Wrap(Discard()).half()
    p = torch.tensor([[0.1, 0.2, 0.5, 0.3, 0.1, 0.1, 0.1, 0.1]], dtype=torch.float16)
    with nantrace.trace(m) as tr:
        m(p).float().sum().backward()
    return tr


def _rms_rows() -> torch.Tensor:
    x = _full(300.0)
    x[1] = 1.0
    return x


# (name, run, op named in both texts, op class, diagnosis cause)
AGREE = [
    ("tanh_gelu_pow", lambda: _run(TanhGELU(), _full(300.0))[0], "pow", "overflow", "forward_overflow"),
    ("rmsnorm_pow", lambda: _run(RMSNorm(), _rms_rows())[0], "pow", "overflow", "forward_overflow"),
    (
        "cosine_sum",
        lambda: _run(Cosine(), _full(200.0), pair=True)[0],
        "sum",
        "reduction",
        "forward_overflow",
    ),
    ("cumsum", lambda: _run(CumNorm(), _full(30000.0, rows=1))[0], "cumsum", "reduction", "forward_overflow"),
    ("discarded_log", _discard_run, "log", "invalid", "invalid_op"),
]


@pytest.mark.parametrize(("name", "run", "op", "op_class", "cause"), AGREE, ids=[a[0] for a in AGREE])
def test_overflow_text_and_diagnosis_name_the_same_transient_op_and_class(
    name: str, run: Callable[[], nantrace.Trace], op: str, op_class: str, cause: str
) -> None:
    """On each transient instance ``str(tr.first_overflow())`` and ``tr.diagnose()`` are about the same event,
    give the op the same class from its operands (``pow``/``sum``/``cumsum`` of finite values: overflow or
    reduction, not the ``rsqrt(inf) = 0`` or ``x / inf = 0`` downstream, which are its consequence) and both
    name the producing op."""
    tr = run()
    ov, d = tr.first_overflow(), tr.diagnose()
    assert ov is not None and d.overflow == ov
    assert (ov.op_class, d.op_class, d.cause) == (op_class, op_class, cause)
    assert d.headline == str(ov).splitlines()[0]
    assert f"`{op}`" in str(ov) and f"`{op}`" in str(d)
    for downstream in ("rsqrt", "`div`", "`sqrt`", "`tanh`"):
        assert downstream not in str(ov) and downstream not in str(d)


def test_the_discarded_op_is_named_with_its_line_in_the_diagnosis_evidence() -> None:
    tr = _discard_run()
    d = tr.diagnose()
    assert (
        f"its forward held a non-finite value made by `log` at {_line(Discard, 1)} that the forward discarded (the "
        "output is the same whatever finite value it had); the backward still goes through `log`"
    ) in d.evidence
    assert d.headline == (
        "step 0 backward: the backward of `inner` (Discard) made NaN by an invalid operation: 0·inf, inf − inf "
        "or 0/0 in a derivative (float16)"
    )


def test_the_transient_op_is_classed_from_its_recorded_operands() -> None:
    """The pow's operand facts are recorded by the transient replay like any other: arg0 float16 of absmax 300
    (two rows: 300 and 1), the exponent 2, and a result holding 8 +inf (row 0's squares)."""
    tr, _ = _run(RMSNorm(), _rms_rows())
    doc = json.loads(tr.ops["operands"].iloc[0])
    arg0, arg1 = doc["operands"]
    assert (arg0["name"], arg0["dtype"], arg0["absmax"], arg0["absmin"], arg0["n_posinf"]) == (
        "arg0",
        "float16",
        300.0,
        1.0,
        0,
    )
    assert arg1 == {"name": "arg1", "value": 2.0}
    assert (doc["result"]["n_posinf"], doc["result"]["absmax"]) == (8, 1.0)
    assert (
        "the producing op: `pow` (overflow: finite operands (absmax 300) gave a result beyond 65504)"
        in str(tr.first_overflow())
    )


def _healthy(
    monkeypatch: pytest.MonkeyPatch, last: nn.Module, lr: float = 1e-3
) -> tuple[list[str], nantrace.Trace, nantrace.Trace]:
    """Three SGD steps of a float16 MLP (Linear, LayerNorm, GELU, Linear, ``last``) on inputs of absmax < 4,
    traced with the drill-down on and off: the classes of the modules whose calls were replayed, both traces."""
    import nantrace._hooks as hooks

    calls: list[str] = []
    real = hooks.drill_call

    def counted(module: nn.Module, *a: Any, **k: Any) -> Any:
        calls.append(type(module).__name__)
        return real(module, *a, **k)

    monkeypatch.setattr(hooks, "drill_call", counted)

    def run(drill: bool) -> nantrace.Trace:
        torch.manual_seed(0)
        m = nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.GELU(), nn.Linear(16, 8), last).half()
        opt = torch.optim.SGD(m.parameters(), lr=lr)
        x = torch.randn(4, 8).half()
        with nantrace.trace(m, drill=drill) as tr:
            for _ in range(3):
                opt.zero_grad()
                m(x).float().sum().backward()
                opt.step()
        return tr

    on = run(True)
    n = len(calls)
    off = run(False)
    assert len(calls) == n  # drill=False replays nothing
    return calls, on, off


_COLS = ["step", "micro_step", "phase", "module", "call", "tensor", "absmax", "n_zero", "n_nan", "n_posinf"]


def test_a_healthy_model_is_never_replayed_and_gets_no_extra_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    """No input beyond the cube root of 65504 (40.3) and no call with more zeros out than in: no replay, no
    ops row, and the records are the same rows as with ``drill=False``."""
    calls, on, off = _healthy(monkeypatch, nn.Tanh())
    assert calls == [] and len(on.ops) == 0 and on.first_overflow() is None
    pd.testing.assert_frame_equal(on.records[_COLS], off.records[_COLS])


def test_relu_zeros_cost_one_replay_per_new_high_and_name_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    """A ReLU's zeros are the zeros signal (more zeros out than in) at its first call: replayed once, at step 0;
    the same zero fraction at steps 1 and 2 (lr 0: the same weights, so the same zeros) is no new high. The
    root's output is the ReLU's output, so the root's zeros signal counts what reached the ReLU (a Linear's
    output, no zero): the root is not replayed. The replay finds no inf, so nothing is reported and the records
    are those of ``drill=False``."""
    calls, on, off = _healthy(monkeypatch, nn.ReLU(), lr=0.0)
    assert calls == ["ReLU"] and len(on.ops) == 0 and on.first_overflow() is None
    pd.testing.assert_frame_equal(on.records[_COLS], off.records[_COLS])


# ------------------------------------------------------------------ replays passed over: no intermediate value


def _count_replays(monkeypatch: pytest.MonkeyPatch) -> tuple[list[tuple[str, int]], list[bool]]:
    """Wrap ``Recorder.replay`` (each replay: module class, step) and ``Suspects.skips`` (asked for each call
    whose signal was at a new high: True when it was passed over)."""
    import nantrace._drill as drill
    import nantrace._hooks as hooks

    replays: list[tuple[str, int]] = []
    skipped: list[bool] = []
    real_replay, real_skips = hooks.Recorder.replay, drill.Suspects.skips

    def replay(self: Any, module: nn.Module, *a: Any, **k: Any) -> bool:
        replays.append((type(module).__name__, self.step))
        return real_replay(self, module, *a, **k)

    def skips(self: Any, *a: Any) -> bool:
        skipped.append(real_skips(self, *a))
        return skipped[-1]

    monkeypatch.setattr(hooks.Recorder, "replay", replay)
    monkeypatch.setattr(drill.Suspects, "skips", skips)
    return replays, skipped


class Leaf(nn.Module):
    """``inner`` between an identity Linear (no zero in its output) and ``+ 0.5`` (no zero after): the zeros
    signal is the inner module's alone."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.fc = _eye()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(self.fc(x)) + 0.5


def _eye() -> nn.Linear:
    """An identity Linear(8→8): its output is its input, so an input's signs set a ReLU's zeros after it."""
    fc = nn.Linear(8, 8)
    with torch.no_grad():
        fc.weight.copy_(torch.eye(8))
        fc.bias.zero_()
    return fc


def _steps(m: nn.Module, xs: list[torch.Tensor]) -> nantrace.Trace:
    with nantrace.trace(m) as tr:
        for x in xs:
            m(x).sum().backward()
            tr.step()
    return tr


def _growing(n: int = 20, rows: int = 4) -> list[torch.Tensor]:
    """Inputs drifting negative step by step: a ReLU's zero fraction reaches new highs (no exact zero in them)."""
    torch.manual_seed(0)
    return [torch.randn(rows, 8) - 0.3 * i for i in range(n)]


@pytest.mark.parametrize(
    ("inner", "name"), [(nn.Dropout(0.5), "Dropout"), (nn.ReLU(), "ReLU")], ids=["dropout", "relu"]
)
def test_a_single_op_module_is_replayed_once_per_trace(
    monkeypatch: pytest.MonkeyPatch, inner: nn.Module, name: str
) -> None:
    """Dropout in train mode and ReLU run one op whose output is the call's output: no value in between could
    hold a transient inf. The first signal replays the call and learns that; every later new high of the zero
    fraction is passed over (there are some: without the rule each would be a replay)."""
    replays, skipped = _count_replays(monkeypatch)
    torch.manual_seed(1)
    tr = _steps(Leaf(inner), _growing())
    assert replays == [(name, 0)]
    assert skipped[0] is False and len(skipped) >= 2 and all(skipped[1:])
    assert len(tr.ops) == 0


def _negatives(rows: int, n: int) -> torch.Tensor:
    """``rows`` x 8 values of 1, the first ``n`` of them (row-major) -1: a ReLU makes exactly ``n`` zeros."""
    x = torch.ones(rows * 8)
    x[:n] = -1.0
    return x.reshape(rows, 8)


def test_a_new_input_shape_is_learned_again(monkeypatch: pytest.MonkeyPatch) -> None:
    """The rule is learned per input structure: a ReLU on 4 rows (zero fractions 0.25, then 0.875 at step 3)
    and on 2 rows (0.5 at step 1, 0.75 at step 2) is replayed at the first new high of each shape only."""
    replays, skipped = _count_replays(monkeypatch)
    xs = [_negatives(4, 8), _negatives(2, 8), _negatives(2, 12), _negatives(4, 28)]
    tr = _steps(Leaf(nn.ReLU()), xs)
    assert replays == [("ReLU", 0), ("ReLU", 1)]
    assert skipped == [False, False, True, True]
    assert len(tr.ops) == 0


_RISING = [_negatives(2, 2), _negatives(2, 4), _negatives(2, 6), _negatives(2, 8)]  # 1/8, 1/4, 3/8, 1/2 zeros


class OwnOp(nn.Module):
    """A container whose own code makes values that no child receives or returns (``h²``, its mean, the
    ``rsqrt``), and its output, the product of the ReLU's zeros and the ``rsqrt``."""

    def __init__(self) -> None:
        super().__init__()
        self.fc, self.relu = _eye(), nn.ReLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        return self.relu(h) * torch.rsqrt(h.pow(2).mean(-1, keepdim=True))


class Doubled(nn.Module):
    """``fc(relu(x) + relu(x))``: the block's own sum, holding the ReLU's zeros, is only the Linear's input."""

    def __init__(self) -> None:
        super().__init__()
        self.fc, self.relu = _eye(), nn.ReLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.relu(x)
        return self.fc(h + h)


def test_a_container_of_single_op_children_is_replayed_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """``fc(relu(x) + relu(x))``: the block's own sum, holding the ReLU's zeros, is the Linear's input, and the
    Linear's output is the block's, so the block's zeros signal counts the sum's zeros (made by its own code).
    Every value made in its call is a child's output or input (recorded, finite), so after its first replay its
    new highs (steps 1-3, like the ReLU's) are passed over."""
    replays, skipped = _count_replays(monkeypatch)
    tr = _steps(Leaf(Doubled()), _RISING)
    assert replays == [("ReLU", 0), ("Doubled", 0)]
    assert skipped == [False, False, True, True, True, True, True, True]
    assert len(tr.ops) == 0


def test_a_container_whose_own_code_makes_a_value_is_replayed_at_every_new_high(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``relu(h · rsqrt(mean(h²)))``: ``h²`` is an intermediate that no module call receives or returns, so
    the container is replayed at each new high of its zero fraction (steps 0-3); its ReLU child once."""
    replays, skipped = _count_replays(monkeypatch)
    _steps(Leaf(OwnOp()), _RISING)
    assert replays == [("ReLU", 0), ("OwnOp", 0), ("OwnOp", 1), ("OwnOp", 2), ("OwnOp", 3)]
    assert skipped == [False, False, True, False, True, False, True, False]


class MaskThenSeq(nn.Module):
    """A sibling makes -inf (``masked_fill``) before a :class:`Doubled` block runs on a finite tensor."""

    def __init__(self) -> None:
        super().__init__()
        self.mask = Masker()
        self.seq = Doubled()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mask = self.mask(x)
        return self.seq(x) + mask.exp()


class Masker(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.masked_fill(x < 0, float("-inf"))


def test_a_container_is_replayed_when_a_kind_was_recorded_in_the_micro_step(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """-inf was recorded (the Masker's output) and is not among the block's input kinds: a child's output
    could hold a kind its replay would call new, so the block is replayed at each new high (steps 0-3)
    while its single-op ReLU (whose values are its own output, recorded finite) is replayed once."""
    replays, _ = _count_replays(monkeypatch)
    _steps(MaskThenSeq(), _RISING)
    assert [r for r in replays if r[0] in ("ReLU", "Doubled")] == [
        ("ReLU", 0),
        ("Doubled", 0),
        ("Doubled", 1),
        ("Doubled", 2),
        ("Doubled", 3),
    ]


class Gate(nn.Module):
    """``relu(x) · rsqrt(mean(relu(x)²))``, no float32 upcast: several ops with values in between. A row of 300s
    makes x² = 90000 > 65504, so the mean is inf and ``rsqrt(inf) = 0`` turns the row silently to 0."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(x)
        return h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)


def test_a_multi_op_module_with_a_transient_inf_at_step_3_is_named_at_step_3(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Steps 0-2 are clean (1, 2, 3 negatives of 16: new highs of the zero fraction, replayed, nothing found);
    at step 3 row 0 is 300s: the Gate's `pow` makes +inf that `rsqrt` turns to 0. The Gate ran several ops,
    so its replays are never passed over, and the op is named at step 3."""
    replays, skipped = _count_replays(monkeypatch)
    m = Wrap(Gate()).half()
    xs = [_negatives(2, n).half() for n in (1, 2, 3)]
    bad = _negatives(2, 12).half()
    bad[0] = 300.0
    xs.append(bad)
    with nantrace.trace(m) as tr:
        for x in xs:
            m(x).float().sum().backward()
            tr.step()
    assert tr.ops[["step", "module", "call", "op", "kind", "source", "reaches"]].values.tolist() == [
        [3, "inner", 0, "pow", "posinf", _line(Gate, 2), True]
    ]
    assert [r for r in replays if r[0] == "Gate"] == [("Gate", 0), ("Gate", 1), ("Gate", 2), ("Gate", 3)]
    assert not any(skipped)
    assert _where(tr.first_overflow()) == (3, "forward", "inner", 0, "output", "inf")


class InPlaceOnChild(nn.Module):
    """``h = fc(x); h.mul_(1e5); h.tanh_(); relu(h)``: the in-place product is a new value (a new version of
    ``h``) that the ReLU never sees: ``tanh_`` overwrote it first."""

    def __init__(self) -> None:
        super().__init__()
        self.fc, self.relu = _eye(), nn.ReLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        h.mul_(1e5)
        h.tanh_()
        return self.relu(h)


class Residual(nn.Module):
    """``relu(fc(x) + x)``: the sum, made by the block's own code, is the ReLU's recorded input."""

    def __init__(self) -> None:
        super().__init__()
        self.fc, self.relu = _eye(), nn.ReLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.relu(self.fc(x) + x)


class Raises(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("boom")


@pytest.mark.parametrize(
    ("module", "plain", "intermediate"),
    [
        (nn.ReLU(), "own", False),
        (nn.Dropout(0.5), "own", False),
        (nn.Identity(), "own", False),
        (nn.Linear(8, 8), "own", False),
        (nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8), nn.ReLU()), "children", False),
        (OwnOp(), None, True),
        (InPlaceOnChild(), None, True),
        (Residual(), "children", False),
        (Gate(), None, True),
        (Raises(), None, False),
    ],
    ids=[
        "relu",
        "dropout",
        "identity",
        "linear",
        "sequential",
        "own_op",
        "inplace",
        "residual",
        "gate",
        "raises",
    ],
)
def test_a_replay_tells_whether_it_made_an_intermediate_value(
    module: nn.Module, plain: str | None, intermediate: bool
) -> None:
    """:class:`Made` during a replay: ``"own"`` when every floating value an op made is the call's output,
    ``"children"`` when some are outputs or inputs of its child calls (BatchNorm's counter ``add_`` is an
    integer, not a floating value; the residual sum is the ReLU's input), an intermediate otherwise; nothing learned from a replay that raised. The global module
    hooks it registers are gone after the replay either way."""
    from torch.nn.modules import module as torch_module

    from nantrace._drill import Made, drill_call

    before = (dict(torch_module._global_forward_pre_hooks), dict(torch_module._global_forward_hooks))
    made = Made()
    assert drill_call(module, (torch.randn(4, 8),), {}, frozenset(), transient=True, made=made) is None
    assert (made.plain, made.intermediate) == (plain, intermediate)
    assert (dict(torch_module._global_forward_pre_hooks), dict(torch_module._global_forward_hooks)) == before
    assert made.order == [] and made.by_id == {}  # nothing kept once the replay ended


def test_a_replay_that_stops_at_the_producer_learns_nothing_plain() -> None:
    """The RMSNorm's replay stops at `pow` (it made +inf): the call did not run to its end, so it is not plain;
    the values before the stop were not judged yet, so it is not proved to have an intermediate either."""
    from nantrace._drill import Made, drill_call

    made = Made()
    found = drill_call(RMSNorm(), (_full(300.0),), {}, frozenset(), transient=True, made=made)
    assert found is not None and found[:2] == ("pow", "posinf")
    assert (made.plain, made.intermediate) == (None, False)


def test_nothing_is_passed_over_under_cpu_autocast() -> None:
    """Under CPU autocast a single op holds a dispatch-level cast (an intermediate CastWatch names): no key."""
    from nantrace._drill import call_key

    m = nn.ReLU()
    x = torch.randn(2, 8)
    assert call_key(3, m, (x,), {}) == (
        3,
        True,
        True,
        (("input[0]", torch.Size([2, 8]), torch.float32, False),),
        (),
    )
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert call_key(3, m, (x,), {}) is None
    assert call_key(3, m, (x, 0.5, None), {"flag": True, "extra": [x]})[4] == (
        (1, 0.5),
        (2, None),
        ("extra", list),
        ("flag", True),
    )


def test_a_container_whose_child_is_not_recorded_is_replayed_at_every_new_high(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With ``modules=`` leaving the block's Linear out, its output is no recorded boundary: the block's replay
    counts it as an intermediate, so the block is replayed at each new high (0-3) (its zeros signal counts its
    output's own zeros: the Linear, not recorded, says nothing of what reached it)."""
    replays, _ = _count_replays(monkeypatch)
    m = Leaf(Doubled())
    with nantrace.trace(m, modules=["inner", "inner.relu"]) as tr:
        for x in _RISING:
            m(x).sum().backward()
            tr.step()
    assert replays == [
        ("ReLU", 0),
        ("Doubled", 0),
        ("Doubled", 1),
        ("Doubled", 2),
        ("Doubled", 3),
    ]


def test_only_recorded_children_are_boundaries() -> None:
    from nantrace._drill import Made, drill_call

    seq = nn.Sequential(nn.Linear(8, 8), nn.ReLU())
    made = Made(lambda mod: mod is not seq[0])
    drill_call(seq, (torch.randn(2, 8),), {}, frozenset(), transient=True, made=made)
    assert (made.plain, made.intermediate) == (None, True)


def test_a_residual_block_whose_output_is_its_relus_is_not_replayed(monkeypatch: pytest.MonkeyPatch) -> None:
    """``relu(fc(x) + x)``: the block's output is its ReLU's, and what reached the ReLU (the sum, ±2) holds no
    zero, so the block's zeros signal never fires; the ReLU's zeros are judged at the ReLU (replayed once)."""
    replays, skipped = _count_replays(monkeypatch)
    _steps(Leaf(Residual()), _RISING)
    assert replays == [("ReLU", 0)]
    assert skipped == [False, True, True, True]


# ------------------------------------------------------------------ leaf modules that run the same code share


class Drops(nn.Module):
    """An identity Linear, then one Dropout per entry of ``ps``, each followed by ``+ 0.5`` in the container's
    own code: no zero reaches the next Dropout or the output, so each Dropout's zeros are its own signal."""

    def __init__(self, ps: tuple[float, ...]) -> None:
        super().__init__()
        self.fc = _eye()
        self.drops = nn.ModuleList(nn.Dropout(p) for p in ps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        for d in self.drops:
            h = d(h) + 0.5
        return h


def _positive(n: int = 3) -> list[torch.Tensor]:
    torch.manual_seed(0)
    return [torch.rand(4, 8) + 1.0 for _ in range(n)]


def test_identical_dropouts_are_replayed_once_in_all(monkeypatch: pytest.MonkeyPatch) -> None:
    """Four Dropout(0.5) leaves (same class, p, inplace, no parameters, the same hooks, input structure): the
    first one's replay shows it makes no intermediate value, and that holds for the other three, whose zeros
    signals (each its first, so a new high for each module) are passed over. Three steps, one replay."""
    replays, skipped = _count_replays(monkeypatch)
    tr = _steps(Drops((0.5, 0.5, 0.5, 0.5)), _positive())
    assert replays == [("Dropout", 0)]
    assert skipped[:4] == [False, True, True, True] and all(skipped[4:])
    assert len(tr.ops) == 0 and tr.first_overflow() is None


def test_dropouts_of_different_p_are_replayed_apart(monkeypatch: pytest.MonkeyPatch) -> None:
    """Dropout(0.5) and Dropout(0.25) differ in a plain attribute (``p``): each is replayed once."""
    replays, skipped = _count_replays(monkeypatch)
    _steps(Drops((0.5, 0.25)), _positive())
    assert replays == [("Dropout", 0), ("Dropout", 0)]
    assert skipped[:2] == [False, False]


class Scale(nn.Module):
    """A leaf holding a plain scalar and a shared object (compared by identity)."""

    def __init__(self, factor: float, cfg: Any) -> None:
        super().__init__()
        self.factor = factor
        self.cfg = cfg

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.factor


class Cfg:
    """A configuration object shared by modules (compared by identity)."""


def _hook(module: nn.Module, args: Any, output: Any) -> None:
    return None


def test_which_leaves_share_a_key() -> None:
    """``leaf_key``: equal for leaves of one class with the same plain attributes, parameter structure, hooks
    and input structure (weights' values do not count); different when any of those differ; None for a
    container, a per-instance ``forward``, an attribute with no identity to hold, and under CPU autocast."""
    from nantrace._drill import leaf_key

    x, y = torch.randn(2, 8), torch.randn(3, 8)

    def key(m: nn.Module, *args: Any) -> Any:
        return leaf_key(m, args or (x,), {})

    assert key(nn.Dropout(0.5)) == key(nn.Dropout(0.5)) is not None
    assert key(nn.Dropout(0.5)) != key(nn.Dropout(0.25))
    assert key(nn.Dropout(0.5)) != key(nn.Dropout(0.5, inplace=True))
    assert key(nn.Dropout(0.5)) != key(nn.Dropout(0.5).eval())
    assert key(nn.Dropout(0.5)) != key(nn.Dropout(0.5), y)  # another input shape
    assert key(nn.Dropout(0.5)) != key(nn.Dropout(0.5), x.t().contiguous().t())  # other strides
    assert key(nn.Linear(8, 8)) == key(nn.Linear(8, 8)) is not None  # other weights, same structure
    assert key(nn.Linear(8, 8)) != key(nn.Linear(8, 8, bias=False))
    assert key(nn.Linear(8, 8)) != key(nn.Linear(8, 8).half(), x.half())
    assert key(nn.Linear(8, 8)) != key(nn.Linear(8, 8).requires_grad_(False))
    assert key(nn.Dropout(0.5)) != key(nn.Dropout(0.5), x.clone().requires_grad_())
    grad_on = key(nn.Dropout(0.5))
    with torch.no_grad():
        assert grad_on != key(nn.Dropout(0.5))
    cfg, other = Cfg(), Cfg()
    assert key(Scale(2.0, cfg)) == key(Scale(2.0, cfg)) is not None
    assert key(Scale(2.0, cfg)) != key(Scale(2.0, other))  # a shared object counts by identity
    assert key(Scale(2.0, cfg)) != key(Scale(3.0, cfg))
    assert key(Scale(2, cfg)) != key(Scale(2.0, cfg))  # an int is not a float
    hooked, hooked2, other_hook = nn.Dropout(0.5), nn.Dropout(0.5), nn.Dropout(0.5)
    hooked.register_forward_hook(_hook)
    hooked2.register_forward_hook(_hook)
    other_hook.register_forward_hook(lambda m, a, o: None)
    assert key(hooked) == key(hooked2) is not None
    assert key(hooked) != key(nn.Dropout(0.5))
    assert key(hooked) != key(other_hook)
    assert key(nn.Sequential(nn.ReLU())) is None  # a container: per-instance keys only
    own = nn.Dropout(0.5)
    own.forward = lambda t: t  # type: ignore[method-assign]
    assert key(own) is None
    assert key(Scale(2.0, {"a": 1})) is None  # a dict has no weak reference: nothing to compare it by
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert key(nn.Dropout(0.5)) is None


def test_a_leaf_key_holds_no_object_alive() -> None:
    """An attribute counts by identity through a weak reference: the key keeps no object alive, and a key of an
    object that died equals no key of a new one."""
    import gc
    import weakref

    from nantrace._drill import leaf_key

    cfg = Cfg()
    ref = weakref.ref(cfg)
    m = Scale(2.0, cfg)
    k = leaf_key(m, (torch.randn(2, 8),), {})
    assert k is not None
    del m, cfg
    gc.collect()
    assert ref() is None
    m2 = Scale(2.0, Cfg())
    assert k != leaf_key(m2, (torch.randn(2, 8),), {})


def test_a_shared_verdict_is_learned_for_both_keys_and_mixed_wins() -> None:
    """``Suspects``: a plain replay under (call key, leaf key) passes over a call of another instance with the same
    leaf key; one mixed replay under that leaf key stops every pass-over through it (its own call key still
    holds for the first instance)."""
    from nantrace._drill import Made, Suspects, drill_call

    def made_of(module: nn.Module) -> Made:
        made = Made()
        drill_call(module, (torch.randn(2, 8),), {}, frozenset(), transient=True, made=made)
        return made

    s = Suspects()
    out = torch.ones(2, 8)
    stats = lambda t: (0,) * 8  # noqa: E731  host statistics present
    s.learn(("a",), made_of(nn.ReLU()), ("leaf",))
    assert s.skips(("b",), out, stats, True, ("leaf",)) is True
    assert s.skips(("b",), out, stats, True) is False  # without the leaf key: nothing learned for b
    assert s.skips(("b",), out, lambda t: None, True, ("leaf",)) is False  # finiteness not read: never
    s.learn(("c",), made_of(Gate()), ("leaf",))
    assert s.skips(("b",), out, stats, True, ("leaf",)) is False
    assert s.skips(("a",), out, stats, True, ("leaf",)) is False
    assert s.skips(("a",), out, stats, True) is True


# ------------------------------------------------------------------ a container's output that is a child's output


class Tail(nn.Module):
    """``dropout(fc(x) · 2)``: the container's own product holds no zero; its output is the Dropout's."""

    def __init__(self) -> None:
        super().__init__()
        self.fc, self.drop = _eye(), nn.Dropout(0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.fc(x) * 2.0)


class Pass(nn.Module):
    """A container returning its child's output as it is."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x)


@pytest.mark.parametrize("nested", [False, True], ids=["container", "container_of_container"])
def test_a_container_whose_output_is_its_dropouts_is_not_replayed(
    monkeypatch: pytest.MonkeyPatch, nested: bool
) -> None:
    """The Dropout's zeros are judged at the Dropout (replayed once); the container's zeros signal counts what
    reached the Dropout (the product, no zero), so it never fires, nor for a container returning that
    container's output (what reached the Dropout is passed up)."""
    replays, skipped = _count_replays(monkeypatch)
    torch.manual_seed(0)
    tr = _steps(Leaf(Pass(Tail()) if nested else Tail()), _positive())
    assert replays == [("Dropout", 0)]
    assert skipped[0] is False and all(skipped[1:])
    assert len(tr.ops) == 0


class NormThenDrop(nn.Module):
    """``dropout(h · rsqrt(sum(h²)))`` with ``h = 4 · fc(x)``, no float32 upcast: a row of 25s makes h = 100
    and sum(h²) = 80000 > 65504, so the sum is inf and ``rsqrt(inf) = 0`` turns the row into zeros before the
    Dropout (25 is below the cube root of 65504, 40.3: no input is beyond the absmax signal's bound, only the
    zeros signal can see it)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc, self.drop = _eye(), nn.Dropout(0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x) * 4.0
        return self.drop(h * torch.rsqrt(h.pow(2).sum(-1, keepdim=True)))


def test_zeros_made_before_the_child_still_replay_the_container_and_name_the_op(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The container's own zeros (row 0, from ``rsqrt(inf)``) reach its Dropout's input: its zeros signal fires
    and its replay names `sum` at its line, kind inf, reaching the output, as without the rule."""
    replays, _ = _count_replays(monkeypatch)
    torch.manual_seed(0)
    m = Leaf(NormThenDrop()).half()
    x = _full(25.0)
    x[1] = 1.0
    with nantrace.trace(m) as tr:
        m(x).float().sum().backward()
    assert replays == [("Dropout", 0), ("NormThenDrop", 0)]
    assert _ops(tr) == [["inner", 0, "sum", "posinf", _line(NormThenDrop, 2), True]]
    assert _where(tr.first_overflow()) == (0, "forward", "inner", 0, "output", "inf")


class Prod(nn.Module):
    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return a * b


class TwoIn(nn.Module):
    """``prod(h · rsqrt(sum(h²)), |x| + 1)`` with ``h = 4 · x``, no float32 upcast: row 0 of 25s (h = 100)
    becomes zeros (sum 80000 > 65504, ``rsqrt(inf) = 0``) before the two-input child ``prod``, whose second
    input holds no zero (no input of a call is beyond 40.3, the cube root of 65504: only the zeros signal
    fires)."""

    def __init__(self) -> None:
        super().__init__()
        self.prod = Prod()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x * 4.0
        a = h * torch.rsqrt(h.pow(2).sum(-1, keepdim=True))
        return self.prod(a, x.abs() + 1.0)


def test_a_child_with_two_inputs_passes_up_no_zeros(monkeypatch: pytest.MonkeyPatch) -> None:
    """Rows 1-2 hold 4 zeros of 8 (the container's input: 8 zeros of 24); row 0's transient zeros make the
    product's first input 16 of 24 zeros. Counted over both of the child's inputs that is 16 of 48, no more
    than the container's input, which would hide the transient; so a child with several tensor inputs passes
    nothing up and the container counts its output's own zeros (16 of 24): replayed, `sum` named."""
    replays, _ = _count_replays(monkeypatch)
    x = torch.zeros(3, 8, dtype=torch.float16)
    x[0] = 25.0
    x[1:, 4:] = 1.0
    m = Leaf(TwoIn()).half()
    with nantrace.trace(m) as tr:
        m(x).float().sum().backward()
    assert replays == [("Prod", 0), ("TwoIn", 0)]
    assert _ops(tr) == [["inner", 0, "sum", "posinf", _line(TwoIn, 2), True]]


@pytest.mark.parametrize(
    ("inner", "children"),
    [
        (lambda: nn.Sequential(nn.ReLU(), _eye()), [("ReLU", 0)]),
        (lambda: nn.Sequential(_eye(), nn.ReLU(), nn.Dropout(0.5)), [("ReLU", 0), ("Dropout", 0)]),
    ],
    ids=["relu_linear", "linear_relu_dropout"],
)
def test_zeros_made_by_a_sibling_child_do_not_replay_the_container(
    monkeypatch: pytest.MonkeyPatch, inner: Callable[[], nn.Module], children: list[tuple[str, int]]
) -> None:
    """The walk back from the output goes through each child to its one input while that input is another
    child's output: the ReLU's zeros reach the Linear (or the Dropout) but were made by the ReLU, judged at the
    ReLU; what reached the first child is the Sequential's own input (no zero), so the Sequential is not
    replayed."""
    replays, _ = _count_replays(monkeypatch)
    torch.manual_seed(0)
    _steps(Leaf(inner()), _RISING)
    assert replays == children


def _shifted() -> nn.Linear:
    """An identity Linear with bias 0.5: no zero in its output for inputs of 0 and 1."""
    fc = _eye()
    with torch.no_grad():
        fc.bias.fill_(0.5)
    return fc


@pytest.mark.parametrize(
    ("inner", "expected", "passed"),
    [
        (
            lambda: nn.Sequential(_eye(), nn.ReLU(inplace=True)),
            [("Sequential", 0)],
            [False, True, True, True],
        ),
        (lambda: nn.Sequential(_eye(), nn.ReLU(inplace=True), _shifted()), [], []),
    ],
    ids=["inplace_last", "inplace_then_shift"],
)
def test_an_in_place_child_ends_the_walk_and_the_container_counts_its_own_zeros(
    monkeypatch: pytest.MonkeyPatch,
    inner: Callable[[], nn.Module],
    expected: list[tuple[str, int]],
    passed: list[bool],
) -> None:
    """A ReLU(inplace=True) changed its input in place, so what reached it is no longer recorded: the walk
    cannot see through it and the Sequential's zeros signal counts its output's own zeros, as without the
    walk. Last in the Sequential, its zeros are the output's: replayed at step 0, the later new highs passed
    over (its values are children's outputs); followed by a Linear adding 0.5, the output holds no zero and
    nothing is replayed (the ReLU's zeros are not taken for the container's). The in-place ReLU itself is not
    replayed (a replay of a call that changed its input is not faithful)."""
    replays, skipped = _count_replays(monkeypatch)
    _steps(Leaf(inner()), _RISING)
    assert replays == expected
    assert skipped == passed


class KVCache:
    """A cache object a call is given and appends to (as transformers' key/value caches are)."""

    def __init__(self) -> None:
        self.keys: list[torch.Tensor] = []


class CachedLogGate(nn.Module):
    """``where(x > 0, log(x), 0)`` (log(0) = -inf, discarded) plus how many inputs the cache held before this
    call: on inputs of 1 and 0 every output is 0 for the first call on a fresh cache, more zeros than its input
    held, so the drill-down replays it."""

    def forward(self, x: torch.Tensor, cache: KVCache) -> torch.Tensor:
        before = len(cache.keys)
        cache.keys.append(x)
        return torch.where(x > 0, torch.log(x), torch.zeros_like(x)) + before


class WithCache(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gate = CachedLogGate()
        self.caches: list[KVCache] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        cache = KVCache()
        self.caches.append(cache)
        return self.gate(x, cache=cache)


def test_a_replay_runs_on_a_copy_of_a_cache_object_and_leaves_the_callers_cache_alone() -> None:
    """A replay appends to a copy of the cache, not to the caller's (which keeps its one entry), and every replay
    sees the cache as the call did: the discarded log(0) does not reach the output, so nothing is reported (was
    a false 'invalid op' when each replay grew the shared cache and so changed the output, found on T5)."""
    model = WithCache()
    x = torch.tensor([[1.0, 0.0, 1.0, 0.0]], requires_grad=True)
    with nantrace.trace(model) as tr:
        for _ in range(2):
            tr.step(model(x).sum())
    assert [len(c.keys) for c in model.caches] == [1, 1]
    assert len(tr.records.query("module == 'gate' and tensor == 'output' and n_zero == 4")) == 2
    assert tr.first_overflow() is None
    assert tr.diagnose().cause == "healthy"


class ScoresAttention(nn.Module):
    """Attention with its projections as submodules: ``q·kᵀ`` of q and k whose values are 8·50 = 400 sums 8
    products of 160000, beyond 65504, so the scores are +inf; the softmax of a row of +inf is NaN, first seen at
    the input of the output projection ``out`` (the identity)."""

    def __init__(self) -> None:
        super().__init__()
        self.q, self.k, self.out = (nn.Linear(8, 8, bias=False) for _ in range(3))
        with torch.no_grad():
            self.q.weight.fill_(50.0)
            self.k.weight.fill_(50.0)
            self.out.weight.copy_(torch.eye(8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scores = self.q(x) @ self.k(x).transpose(-1, -2)
        return self.out(torch.softmax(scores, -1) @ x)


def test_a_score_overflow_before_a_softmax_nan_at_a_child_is_the_first_value_and_names_the_matmul() -> None:
    """The NaN at `out`'s input is what the module boundaries show first; the drill-down of the enclosing call
    stops at the `@` that made +inf before it (a replay stops at the call's first op making a non-finite
    value). The first overflow is that +inf, made by the matmul, with the product's advice; kind="nan" still
    gives the NaN where it was seen (was 'made NaN by an invalid operation: add eps' for the classic q·kᵀ
    overflow, found on Llama)."""
    tr, out = _run(ScoresAttention(), _full(1.0))
    assert bool(torch.isnan(out).all())
    rec = tr.records
    seen = rec[(rec["module"] == "inner.out") & (rec["tensor"] == "input[0]")]
    assert (int(seen["n_nan"].iloc[0]), int(seen["n_posinf"].iloc[0])) == (16, 0)
    assert _ops(tr) == [["inner", 0, "matmul", "posinf", _line(ScoresAttention, 1), True]]
    ov = tr.first_overflow()
    assert _where(ov) == (0, "forward", "inner", 0, "output", "inf")
    assert str(ov).splitlines()[0] == "step 0 forward: `inner` (`matmul`) overflowed float16 (+inf)"
    assert "`matmul` sums 8 products of operands of absmax 400 and 400 (up to 1280000 > 65504)" in str(ov)
    assert _where(tr.first_overflow(kind="nan")) == (0, "forward", "inner", 0, "input[0]", "nan")
    d = tr.diagnose()
    assert d.cause == "forward_overflow" and _where(d.overflow) == _where(ov)


class InfThenZero(nn.Module):
    """``x * inf * 0``: the scalar inf is an intended value, and a negative ``x`` only flips its sign; the
    product with 0 is the 0·inf that makes NaN."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * math.inf * 0.0


def test_a_sign_flip_of_an_intended_inf_is_not_produced_the_nan_of_0_times_inf_is() -> None:
    """Inputs of both signs: ``x * inf`` holds +inf and -inf, both explained by the scalar +inf (either sign);
    the op that produced a kind is the ``* 0`` (was '-inf made by an invalid operation: 0·inf' at the first
    multiply, found on BERT)."""
    x = torch.tensor([[1.0, -1.0, 2.0, -2.0, 1.0, -1.0, 2.0, -2.0]], dtype=torch.float16)
    tr, out = _run(InfThenZero(), x)
    assert bool(torch.isnan(out).all())
    assert _ops(tr) == [["inner", 0, "mul", "nan", _line(InfThenZero), True]]
    ov = tr.first_overflow()
    assert _where(ov) == (0, "forward", "inner", 0, "output", "nan")
    assert (
        str(ov).splitlines()[0]
        == "step 0 forward: `inner` (`mul`) made NaN by an invalid operation: 0·inf (float16)"
    )
    culprit = nantrace.hunt(lambda: InfThenZero()(x))
    assert culprit is not None and (culprit.op, culprit.kind) == ("aten::mul.Tensor", "nan")
