"""nantrace.watch: the sentinel, the replay of a non-finite step, the full step every N, bit-identical training,
and the same first_overflow() as nantrace.trace on CASES and a zoo of faults."""

from __future__ import annotations

import contextlib
import inspect
import math
from collections.abc import Callable
from typing import Any

import pandas as pd
import pytest
import test_cases as cases
import torch
import torch.nn.functional as F
from test_sync import watch_reads
from torch import nn

import nantrace
from nantrace import _store

FIELDS = ("step", "micro_step", "phase", "module", "module_type", "call", "tensor", "kind")


def _fields(ov: nantrace.Overflow | None) -> tuple[Any, ...] | None:
    return None if ov is None else tuple(getattr(ov, f) for f in FIELDS)


# ------------------------------------------------------------------ CASES under watch
_CASE_NAMES = [
    n
    for n, f in inspect.getmembers(cases, inspect.isfunction)
    if n.startswith("test_c") and n != "test_c11_transformer_encoder_with_causal_mask_is_healthy"
]


@pytest.mark.parametrize("name", _CASE_NAMES)
def test_every_case_gives_the_same_answers_under_watch(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each CASES test, with nantrace.trace replaced by nantrace.watch(every=None): no step recorded in full
    unless the sentinel flags it, and every assertion of the case (exact locator answers) still holds."""
    real_watch = nantrace.watch

    def as_watch(model: nn.Module, **kw: Any) -> nantrace.Trace:
        kw.pop("every", None)
        return real_watch(model, every=None, **kw)

    monkeypatch.setattr(nantrace, "trace", as_watch)
    getattr(cases, name)()


def test_c11_causal_mask_is_not_flagged_by_the_sentinel() -> None:
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(d_model=16, nhead=2, dim_feedforward=32, dropout=0.0, batch_first=True)
    model = nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu", init_scale=256)
    causal = nn.Transformer.generate_square_subsequent_mask(6)
    with nantrace.watch(model, scaler=scaler, optimizer=opt, every=None) as tr:
        for _ in range(3):
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16):
                out = model(torch.randn(2, 6, 16), mask=causal)
            scaler.scale(out.float().pow(2).mean()).backward()
            scaler.step(opt)
            scaler.update()
    assert tr.first_overflow() is None
    assert tr.steps["recorded"].tolist() == ["watch", "watch", "watch"]  # the mask's -inf is no fault
    assert len(tr.records) == 0
    assert tr.diagnose().cause == "healthy"


# ------------------------------------------------------------------ the zoo: trace and watch on one loop
def _big_first_layer(model: nn.Sequential) -> None:
    with torch.no_grad():
        model[0].weight.fill_(300.0)
        model[0].bias.zero_()


def _amp_loop(fault: str) -> Callable[[Any], tuple[nn.Module, Any, Any, Callable[[], None]]]:
    """A model, scaler, optimizer and a 5-step loop with ``fault`` planted in step 3."""

    def build(_: Any) -> tuple[nn.Module, Any, Any, Callable[[], None]]:
        torch.manual_seed(0)
        model = nn.Sequential(
            nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2)
        )  # ReLU passes +inf on to the output
        # lr 0 with the forward fault: the weights stay at 300, so only step 3's float16 input overflows
        opt = torch.optim.SGD(model.parameters(), lr=0.0 if fault == "forward" else 1e-2)
        scaler = torch.amp.GradScaler("cpu", init_scale=4.0)

        def loop() -> None:
            torch.manual_seed(1)
            for step in range(5):
                opt.zero_grad()
                x = torch.randn(3, 4)
                if step == 3 and fault == "data":
                    x[0, 1] = math.nan
                if step == 3 and fault == "forward":
                    x = x.half() * 0 + 300.0  # float16: 4 inputs · 300 · 300 = 360000 > 65504
                    with torch.autocast("cpu", dtype=torch.float16):
                        out = model(x)
                else:
                    out = model(x)
                loss = out.float().pow(2).mean()
                if step == 3 and fault == "loss":
                    loss = loss * 0 + torch.tensor(math.inf) * 0  # 0 · inf = NaN, outside the model
                scaler.scale(loss).backward()
                scaler.step(opt)
                scaler.update()

        if fault == "forward":
            _big_first_layer(model)
        return model, scaler, opt, loop

    return build


@pytest.mark.parametrize(
    ("fault", "expected"),
    [
        ("data", (3, 0, "data", "", "Sequential", 0, "input[0]", "nan")),
        ("forward", (3, 0, "forward", "0", "Linear", 0, "output", "inf")),
        ("loss", (3, 0, "loss", "", "loss", 0, "loss", "nan")),
    ],
)
def test_watch_equals_trace_on_planted_faults(fault: str, expected: tuple[Any, ...]) -> None:
    answers = []
    for make in (nantrace.trace, nantrace.watch):
        model, scaler, opt, loop = _amp_loop(fault)(None)
        with make(model, scaler=scaler, optimizer=opt) as tr:
            loop()
        answers.append((tr, _fields(tr.first_overflow())))
    (traced, a), (watched, b) = answers
    assert a == b == expected
    assert watched.steps["recorded"].tolist() == ["full", "watch", "watch", "replay", "watch"]
    assert watched.steps["skipped"].tolist() == traced.steps["skipped"].tolist()
    assert "replaying it" in str(watched.first_overflow())
    assert _fields(watched.diagnose().overflow) == _fields(traced.diagnose().overflow)
    assert watched.diagnose().cause == traced.diagnose().cause


def _same_rows(a: pd.DataFrame, b: pd.DataFrame) -> None:
    """Equal records (the internal ``event`` id aside, which counts statistics computed over the whole run)."""
    left = a.drop(columns=["event"]).reset_index(drop=True).astype(object)
    right = b.drop(columns=["event"]).reset_index(drop=True).astype(object)
    pd.testing.assert_frame_equal(left, right)


class Twice(nn.Module):
    """Called twice per step before one backward: the second call's forward precedes the first's backward."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x)


class InfGrad(torch.autograd.Function):
    """Identity forward; backward multiplies the incoming gradient by inf (a planted backward fault)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
        return g * math.inf


class BadBackward(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return InfGrad.apply(x)


def _zoo_twice(make: Any) -> nantrace.Trace:
    torch.manual_seed(0)
    model = Twice()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    with make(model, optimizer=opt) as tr:
        for step in range(3):
            opt.zero_grad()
            a = model(torch.randn(2, 4))
            b = torch.randn(2, 4)
            if step == 2:
                b[1, 1] = math.inf
            loss = a.sum() + model(b).sum()
            loss.backward()
            opt.step()
    return tr


def _zoo_accumulation(make: Any) -> nantrace.Trace:
    """CASES C14's float16 Linear whose grad_input overflows (8 · 400 · 30 = 96000 > 65504), in micro-step 2
    of step 1 only: the other micro-steps scale the loss by 1e-3."""
    model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 8), nn.Linear(8, 1))
    with torch.no_grad():
        for layer, w in zip(model, (0.01, 400.0, 30.0), strict=True):
            layer.weight.fill_(w)
            layer.bias.zero_()
    model = model.half()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    with make(model, optimizer=opt) as tr:
        for step in range(3):
            opt.zero_grad()
            for micro in range(3):
                out = model(torch.full((1, 4), 0.5, dtype=torch.float16))
                (out.sum() * (1.0 if (step, micro) == (1, 2) else 1e-3)).backward()
            opt.step()
    return tr


def _zoo_no_grad(make: Any) -> nantrace.Trace:
    model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 1)).half()
    _big_first_layer(model)
    with make(model) as tr, torch.no_grad():
        for step in range(4):
            model(torch.full((1, 4), 60.0 if step == 2 else 0.01, dtype=torch.float16))  # 4·300·60 = 72000
    return tr


def _zoo_optimizer(make: Any, micro_steps: int = 1) -> nantrace.Trace:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    with make(model, optimizer=opt) as tr:
        for step in range(3):
            opt.zero_grad()
            for _ in range(micro_steps):
                model(torch.ones(2, 4)).sum().mul(100.0).backward()
            # finite gradients, but lr · grad overflows float32 at step 1
            opt.param_groups[0]["lr"] = 3e38 if step == 1 else 1e-2
            opt.step()
    return tr


def _zoo_optimizer_accumulated(make: Any) -> nantrace.Trace:
    """The optimizer fault of :func:`_zoo_optimizer` after two micro-steps: the rows of the optimizer's step
    belong to the step's last micro-step (1), under watch as under trace."""
    return _zoo_optimizer(make, micro_steps=2)


@pytest.mark.parametrize(
    ("zoo", "expected", "recorded"),
    [
        (
            _zoo_optimizer_accumulated,
            (1, 1, "optimizer", "0", "Linear", 0, "weight", "inf"),
            ["full", "post_step", "replay"],
        ),
        (_zoo_twice, (2, 1, "data", "", "Twice", 0, "input[0]", "inf"), ["full", "watch", "replay"]),
        (
            _zoo_accumulation,
            (1, 2, "backward", "1", "Linear", 0, "grad_input[0]", "inf"),
            ["full", "replay", "replay"],
        ),
        (
            _zoo_no_grad,
            (2, 0, "forward", "0", "Linear", 0, "output", "inf"),
            ["full", "watch", "replay", "watch"],
        ),
        (_zoo_optimizer, (1, 0, "optimizer", "0", "Linear", 0, "weight", "inf"), None),
    ],
)
def test_watch_equals_trace_on_the_zoo(
    zoo: Any, expected: tuple[Any, ...], recorded: list[str] | None
) -> None:
    traced = zoo(nantrace.trace)
    watched = zoo(nantrace.watch)
    assert _fields(traced.first_overflow()) == expected
    assert _fields(watched.first_overflow()) == expected
    assert _fields(watched.first_overflow(kind="nan")) == _fields(traced.first_overflow(kind="nan"))
    step = expected[0]
    _same_rows(watched.records.query(f"step == {step}"), traced.records.query(f"step == {step}")) if expected[
        2
    ] != "optimizer" else None
    if recorded is not None:
        assert watched.steps["recorded"].tolist() == recorded
    assert watched.steps["micro_steps"].tolist() == traced.steps["micro_steps"].tolist()
    cols = list(FIELDS)
    pd.testing.assert_frame_equal(watched.overflows()[cols], traced.overflows()[cols])


# ------------------------------------------------------------------ bit for bit
class DropBN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(6, 16)
        self.bn = nn.BatchNorm1d(16)
        self.drop = nn.Dropout(0.3)
        self.fc2 = nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.drop(torch.relu(self.bn(self.fc1(x)))))


def _train(mode: str) -> dict[str, Any]:
    """6 steps, AdamW, GradScaler, 2 micro-steps each, NaN in the data of step 2 micro-step 1 and a loss scale
    so large that step 4's gradients overflow; returns every number of the run."""
    torch.manual_seed(0)
    model = DropBN()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
    torch.manual_seed(1)
    data = [torch.randn(8, 6) for _ in range(12)]
    data[5][3, 2] = math.nan
    out: dict[str, Any] = {"losses": [], "outputs": [], "scales": [], "grads": []}
    ctx = (
        nantrace.watch(model, scaler=scaler, optimizer=opt, every=3)
        if mode == "watch"
        else contextlib.nullcontext()
    )
    with ctx as tr:
        for step in range(6):
            opt.zero_grad()
            for micro in range(2):
                y = model(data[2 * step + micro])
                loss = y.pow(2).mean() * (2.0**127 if step == 4 else 1.0)
                out["losses"].append(loss.detach().clone())
                out["outputs"].append(y.detach().clone())
                scaler.scale(loss).backward()
            out["grads"].append([p.grad.clone() for p in model.parameters()])
            scaler.step(opt)
            scaler.update()
            out["scales"].append(scaler.get_scale())
    out["params"] = [p.detach().clone() for p in model.parameters()]
    out["buffers"] = [b.clone() for b in model.buffers()]
    out["state"] = [{k: v.clone() for k, v in s.items()} for s in opt.state.values()]
    out["rng"] = torch.get_rng_state()
    out["trace"] = tr
    return out


def _equal(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return torch.equal(a, b) or (
            a.shape == b.shape and bool(torch.equal(a.nan_to_num(7.0), b.nan_to_num(7.0)))
        )
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b, strict=True))
    return a == b


def test_training_with_watch_is_bit_identical_across_replayed_steps() -> None:
    plain, watched = _train("plain"), _train("watch")
    for key in ("losses", "outputs", "grads", "scales", "params", "buffers", "state", "rng"):
        assert _equal(plain[key], watched[key]), key
    tr = watched["trace"]
    assert tr.steps["recorded"].tolist() == ["full", "watch", "replay", "full", "replay", "watch"]
    assert tr.steps["skipped"].tolist() == [False, False, True, False, True, False]
    assert plain["scales"] == [256.0, 256.0, 128.0, 128.0, 64.0, 64.0]
    assert _fields(tr.first_overflow()) == (2, 1, "data", "", "DropBN", 0, "input[0]", "nan")
    assert tr.steps["micro_steps"].tolist() == [2] * 6


def test_replayed_step_records_what_trace_records() -> None:
    """The replay of step 2 (dropout masks from the saved RNG state, BatchNorm in training mode) gives the
    same rows as tracing that step for real."""
    watched = _train("watch")["trace"]
    torch.manual_seed(0)
    model = DropBN()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
    torch.manual_seed(1)
    data = [torch.randn(8, 6) for _ in range(12)]
    data[5][3, 2] = math.nan
    with nantrace.trace(model, scaler=scaler, optimizer=opt) as traced:
        for step in range(3):
            opt.zero_grad()
            for micro in range(2):
                loss = model(data[2 * step + micro]).pow(2).mean()
                scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
    _same_rows(watched.records.query("step == 2"), traced.records.query("step == 2"))
    assert watched.steps.loc[2, "loss"] is not None and math.isnan(watched.steps.loc[2, "loss"])
    for col in ("scale", "next_scale", "skipped", "growth_tracker", "lr", "micro_steps", "n_nonfinite"):
        assert watched.steps.loc[2, col] == traced.steps.loc[2, col], col


# ------------------------------------------------------------------ not reproduced, every, sync, errors
def test_a_fault_the_replay_cannot_reproduce_is_reported_as_detected() -> None:
    """The loop repairs its input in place after the forward: the replay sees finite data, so nothing is
    invented; first_overflow() and diagnose() say where the sentinel saw it and that it was not reproduced."""
    model = nn.Sequential(nn.Linear(3, 2))
    with nantrace.watch(model, every=None) as tr, torch.no_grad():
        for step in range(3):
            x = torch.ones(2, 3)
            if step == 1:
                x[0, 0] = math.inf
            model(x)
            x.nan_to_num_(posinf=0.0)  # in place, after the forward; the step is checked at the next forward
    assert tr.steps["recorded"].tolist() == ["watch", "not_reproduced", "watch"]
    assert len(tr.records.query("n_posinf > 0 or n_nan > 0")) == 0
    ov = tr.first_overflow()
    assert _fields(ov) == (1, 0, "data", "", "Sequential", 0, "input[0]", "inf")
    assert ov is not None and ov.dtype == "float32"  # the dtype of the tensor the sentinel checked
    assert "did not reproduce" not in str(ov) and "recorded no non-finite value" in str(ov)
    assert "changed in place" in str(ov)
    d = tr.diagnose()
    assert d.cause == "data" and _fields(d.overflow) == _fields(ov)
    assert "replay did not reproduce it" in d.summary


class ThirdCallInf(nn.Module):
    """Its output is +inf (``value``) on the third forward call ever made, a replay included: Python state a
    replay cannot restore."""

    def __init__(self, value: float = math.inf) -> None:
        super().__init__()
        self.fc, self.calls, self.value = nn.Linear(3, 2), 0, value

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        out = self.fc(x)
        return out * self.value if self.calls == 3 else out


def test_a_nan_the_replay_cannot_reproduce_is_no_overflow_and_keeps_its_dtype() -> None:
    """NaN seen at the model's float16 output and not reproduced: the diagnosis names no overflow (its cause is
    the one NaN in forward gets, invalid_op) and the event keeps the dtype of the tensor the sentinel checked."""
    torch.manual_seed(0)
    model = ThirdCallInf(math.nan).half()
    with nantrace.watch(model, every=None) as tr:
        for _ in range(4):
            tr.step(model(torch.ones(2, 3, dtype=torch.float16)).float().sum())
    assert tr.steps["recorded"].tolist() == ["watch", "watch", "not_reproduced", "watch"]
    ov = tr.first_overflow()
    assert _fields(ov) == (2, 0, "forward", "", "ThirdCallInf", 0, "output", "nan")
    assert ov is not None and ov.dtype == "float16"
    d = tr.diagnose()
    assert (d.cause, d.summary) == (
        "invalid_op",
        "Step 2 went non-finite (forward), but its replay did not reproduce it.",
    )


def test_a_replay_whose_forward_stays_finite_does_not_blame_the_real_steps_loss() -> None:
    """The real step 2's outputs are +inf, its loss -inf; its replay's outputs are finite and only the recorded real loss
    is not. The replay did not reproduce what the sentinel saw in the forward: first_overflow() and diagnose() say
    where it was seen (the model's output), not 'finite outputs but an inf loss'."""
    torch.manual_seed(0)
    model = ThirdCallInf()
    with nantrace.watch(model, every=None) as tr:
        for _ in range(4):
            tr.step(model(torch.ones(2, 3)).sum())
    assert tr.steps["recorded"].tolist() == ["watch", "watch", "not_reproduced", "watch"]
    assert model.calls == 4  # the replay's call is not counted: its plain attributes were set back
    assert len(tr.records.query("step == 2 and phase == 'forward' and (n_posinf > 0 or n_nan > 0)")) == 0
    assert len(tr.records.query("step == 2 and phase == 'loss' and n_neginf > 0")) == 1  # the real loss, -inf
    ov = tr.first_overflow()
    assert _fields(ov) == (2, 0, "forward", "", "ThirdCallInf", 0, "output", "inf")
    # overflows() shows the same, not the replay's loss row ("the model's outputs were finite")
    rows = tr.overflows()
    assert rows[["step", "phase", "tensor"]].values.tolist() == [[2, "forward", "output"]]
    assert rows["message"].iloc[0] == ov.message
    assert tr.diagnose().advice[1] == (
        "For watch to replay the step: keep the forward free of Python state that changes per call (a counter, a "
        "flag set by the loop) and use deterministic kernels (torch.use_deterministic_algorithms(True))."
    )
    assert (
        "nantrace.watch saw inf at step 2 (micro-step 0, forward: output of the model), but the replayed forward of "
        "micro-step(s) 0 computed other outputs than the real one (their smallest or largest value differ)"
    ) in str(ov)
    d = tr.diagnose()
    assert d.cause == "forward_overflow" and _fields(d.overflow) == _fields(ov)
    assert d.summary == "Step 2 went non-finite (forward), but its replay did not reproduce it."


def test_default_every_records_step_0_and_100_in_full() -> None:
    model = nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    with nantrace.watch(model, optimizer=opt) as tr:
        for _ in range(102):
            opt.zero_grad()
            model(torch.ones(1, 2)).sum().backward()
            opt.step()
    rec = tr.steps["recorded"]
    assert rec[rec == "full"].index.tolist() == [0, 100]
    assert (rec == "watch").sum() == 100
    assert sorted(set(tr.records["step"].tolist())) == [0, 100]
    assert tr.steps["grad_norm"].notna().all() and tr.steps["lr"].tolist() == [1e-3] * 102


def test_watch_hooks_read_nothing_outside_the_host_copies() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Dropout(0.1), nn.Linear(16, 4))
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**20, growth_interval=1)
    x, y = torch.randn(32, 8) * 100, torch.randn(32, 4)
    with (
        nantrace.watch(model, scaler=scaler, optimizer=opt, sync_free=True, every=3) as tr,
        watch_reads() as (violations, copies),
    ):
        for _ in range(4):
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16):
                out = model(x)
            scaler.scale(F.mse_loss(out.float(), y)).backward()
            scaler.step(opt)
            scaler.update()
    assert violations == []
    # per step: the flag read before optimizer.step() and the step's flush; the post-step parameter flag
    # after a step the optimizer ran; step 0 and 3 in full (flush only); a replayed step (the GradScaler's
    # found-inf) also reads its replayed outputs' extremes once, to compare them with the real ones
    recorded = tr.steps["recorded"].tolist()
    assert recorded == ["full", "replay", "replay", "full"]
    assert copies[0] == 4 + 2 + sum(not s for s in tr.steps["skipped"].tolist()[1:3]) + 2


def test_a_watched_step_copies_twice_and_an_optimizer_fault_is_named_as_before(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Without a GradScaler a watched step copies to the host twice, both inside ``optimizer.step()``: its flags
    before the update (with the step's loss and gradient norm) and the parameter flag after it (with the rest
    of its row), so the flush copies nothing more, and the steps table holds the same numbers. The step whose
    ``lr · grad`` overflows float32 is still named from the post-step check: that parameter, its owner, that
    step."""
    copies = [0]  # host copies that copied anything
    real = _store.to_host

    def counting(tensors: Any) -> Any:
        copies[0] += bool(len(tensors))
        return real(tensors)

    monkeypatch.setattr(_store, "to_host", counting)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    per_step, losses, norms = [], [], []
    with nantrace.watch(model, optimizer=opt, every=None) as tr:
        for step in range(3):
            opt.zero_grad()
            loss = model(torch.ones(2, 4)).sum().mul(100.0)
            loss.backward()
            tr.step(loss)
            losses.append(float(loss.detach().float()))
            grads = [p.grad for p in model.parameters()]
            norms.append(float(torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads, 2)))))
            if step == 2:
                opt.param_groups[0]["lr"] = 3e38  # finite gradients, but lr · grad overflows float32
            before = copies[0]
            opt.step()  # the check before the update, the parameter check after it, the flush
            per_step.append(copies[0] - before)
    # step 2: a third copy, the element test of the weight whose float32 norm is inf (an overflowed norm of
    # finite values would not be a fault)
    assert per_step == [2, 2, 3] and copies[0] == 7
    assert _fields(tr.first_overflow()) == (2, 0, "optimizer", "0", "Linear", 0, "weight", "inf")
    assert "after optimizer.step() of step 2" in str(tr.first_overflow())
    steps = tr.steps
    assert steps["recorded"].tolist() == ["watch", "watch", "post_step"]
    assert steps["loss"].tolist() == losses
    assert steps["grad_norm"].tolist() == norms
    assert steps["lr"].tolist() == [1e-2, 1e-2, 3e38]
    assert steps["n_records"].tolist() == [0, 0, 4] and steps["n_nonfinite"].tolist() == [0, 0, 4]


@pytest.mark.parametrize(
    ("every", "error"), [(0, ValueError), (-1, ValueError), (1.5, TypeError), (True, TypeError)]
)
def test_watch_every_must_be_a_positive_int_or_none(every: Any, error: type[Exception]) -> None:
    with pytest.raises(error) as e:
        nantrace.watch(nn.Linear(1, 1), every=every)
    assert str(e.value) == (
        "every must be None (no periodic full step) or an int ≥ 1 (a full step every N steps); got "
        f"{every!r}. Pass e.g. every=100 (the default), or every=None for only the replayed steps."
    )


def test_watch_saves_and_loads_with_its_steps_column(tmp_path: Any) -> None:
    tr = _zoo_twice(nantrace.watch)
    back = nantrace.load(tr.save(tmp_path / "w.nantrace"))
    assert back.steps["recorded"].tolist() == ["full", "watch", "replay"]
    assert _fields(back.first_overflow()) == _fields(tr.first_overflow())
    assert str(back.first_overflow()) == str(tr.first_overflow())


# ------------------------------------------------------------------ front-ends
def test_transformers_callback_with_watch_names_the_same_data_fault(tmp_path: Any) -> None:
    pytest.importorskip("transformers")
    import test_integration_transformers as hf

    from nantrace.integrations.transformers import NanTraceCallback

    cb = NanTraceCallback(watch=True)
    t = hf.trainer(tmp_path, cb)
    t.train()
    tr = cb.trace
    hf.assert_data_fault(tr)
    assert tr is not None
    # step 0 in full, the clean steps watched, step 3 (the NaN batch) replayed; AdamW carries the NaN on
    assert tr.steps["recorded"].tolist() == ["full", "watch", "watch", "replay", "replay"]
    assert tr.steps["n_nonfinite"].tolist()[:3] == [0, 0, 0]
    # the callback's loss hook runs again in the replayed forward: the loss is recorded once, by the replay
    loss_rows = tr.records[(tr.records["phase"] == "loss") & (tr.records["tensor"] == "loss")]
    assert loss_rows["step"].tolist() == [0, 3, 4]
    assert hf.training_logs(t)[1]["n_nonfinite"] == 0
    hf.assert_data_fault(nantrace.load(tmp_path / "out" / "trace.nantrace"))
    assert hf.hooks_left(t.model) == 0


@pytest.mark.parametrize("watch", [0, -2, "yes", 1.5])
def test_callback_watch_option_is_checked(watch: Any) -> None:
    from nantrace.integrations._common import check_watch

    with pytest.raises(ValueError, match="watch must be False"):
        check_watch(watch)
    assert check_watch(True) == 100 and check_watch(False) is False and check_watch(None) is None
    assert check_watch(7) == 7


_SCRIPT = """
import math, torch
from torch import nn
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
opt = torch.optim.SGD(model.parameters(), lr=1e-2)
for step in range(5):
    opt.zero_grad()
    x = torch.randn(3, 4)
    if step == 3:
        x[1, 2] = math.nan
    model(x).pow(2).mean().backward()
    opt.step()
"""


def test_nantrace_run_watch_replays_the_faulty_step(tmp_path: Any) -> None:
    from nantrace._run import run_script

    script = tmp_path / "train.py"
    script.write_text(_SCRIPT)
    out = tmp_path / "out"
    out.mkdir()
    result = run_script(script, out=out, watch=2)
    assert result.exit_code == 0
    (tr,) = result.traces.values()
    assert tr.steps["recorded"].tolist() == ["full", "watch", "full", "replay", "full"]
    assert _fields(tr.first_overflow()) == (3, 0, "data", "", "Sequential", 0, "input[0]", "nan")
    (path,) = result.paths.values()
    assert nantrace.load(path).steps["recorded"].tolist()[3] == "replay"


def test_cli_run_watch_option(tmp_path: Any, capsys: pytest.CaptureFixture[str]) -> None:
    from nantrace import cli

    script = tmp_path / "train.py"
    script.write_text(_SCRIPT)
    assert cli.main(["run", "--watch", "0", "--out", str(tmp_path / "o"), str(script)]) == 2
    assert "--watch 0: N must be an int ≥ 1" in capsys.readouterr().err
    assert cli.main(["run", "--watch", "--out", str(tmp_path / "o2"), str(script)]) == 0
    (saved,) = (tmp_path / "o2").glob("*.nantrace")
    steps = nantrace.load(saved).steps
    assert steps["recorded"].tolist() == ["full", "watch", "watch", "replay", "replay"]


def test_nantrace_run_watch_without_full_steps_watches_the_first_call(tmp_path: Any) -> None:
    """``nantrace run`` attaches during the root's first call: the sentinel's pre-hook must run for it too, or
    with ``every=None`` a fault in step 0's inputs is never seen."""
    from nantrace._run import run_script

    script = tmp_path / "train.py"
    script.write_text(_SCRIPT.replace("if step == 3:", "if step == 0:"))
    out = tmp_path / "out"
    out.mkdir()
    result = run_script(script, out=out, watch=None)
    assert result.exit_code == 0
    (tr,) = result.traces.values()
    # SGD writes step 0's NaN gradients into the weights: every later step's forward is non-finite too
    assert tr.steps["recorded"].tolist() == ["replay"] * 5
    assert _fields(tr.first_overflow()) == (0, 0, "data", "", "Sequential", 0, "input[0]", "nan")
    assert tr.overflows()["phase"].tolist() == ["data", "forward", "forward", "forward", "forward"]


@pytest.mark.parametrize(
    ("dtype", "value"), [(torch.float32, 3e38), (torch.float64, 1e300), (torch.float16, 65504.0)]
)
def test_large_finite_inputs_and_outputs_are_not_flagged(dtype: torch.dtype, value: float) -> None:
    """A sum of these inputs and outputs overflows their dtype (and float32): the sentinel's check must not, so
    no step is replayed. Zero weights keep the loss and the gradients at 0; the bias makes the output large."""
    model = nn.Linear(4, 1).to(dtype)
    nn.init.zeros_(model.weight)
    nn.init.constant_(model.bias, value)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    with nantrace.watch(model, optimizer=opt, every=None) as tr:
        for _ in range(2):
            opt.zero_grad()
            out = model(torch.full((8, 4), value, dtype=dtype))
            loss = (out * 0).sum()
            tr.step(loss=loss)
            loss.backward()
            opt.step()
    assert tr.steps["recorded"].tolist() == ["watch", "watch"]
    assert len(tr.records) == 0 and tr.first_overflow() is None


class MaskedLogits(nn.Module):
    """Outputs an additive mask: 0 and a masked_fill(-inf) column (a tensor holding only 0 and -inf is a mask)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(3, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mask = torch.tensor([False, False, False, True])
        return (self.fc(x) * 0.0).masked_fill(mask, -math.inf)


def test_a_masked_minus_inf_output_is_replayed_and_found_healthy() -> None:
    model = MaskedLogits()
    with nantrace.watch(model, every=None) as tr, torch.no_grad():
        for _ in range(2):
            model(torch.ones(2, 3))
    # the sentinel cannot tell a mask's -inf from an overflow: each step is replayed, the locator decides
    assert tr.steps["recorded"].tolist() == ["replay", "replay"]
    assert tr.first_overflow() is None
    assert tr.options["watch"]["sentinel"] == {}
    assert tr.diagnose().cause == "healthy"


# ------------------------------------------------------------------ a non-finite value hidden inside the model
class HandSigmoid(nn.Module):
    """``1 / (1 + exp(-x))`` by hand: at x = -100, float32 ``exp(100) = inf`` and the output is a finite 0; its
    backward multiplies 0 by ``exp(100)``: NaN."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return 1 / (1 + torch.exp(-x))


class Squash(nn.Module):
    """``tanh(x · 1e40)``: the product is inf in float32, tanh makes it 1, and the gradient stays finite (0)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x * 1e30 * 1e10)


def _hidden_inf_run(make: Any, act: nn.Module) -> nantrace.Trace:
    """Linear(4→4, weights 25) → ``act`` → Linear(4→1), SGD; step 1's inputs are -1 (the Linear gives -100),
    the others 0.01."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), act, nn.Linear(4, 1))
    with torch.no_grad():
        model[0].weight.fill_(25.0)
        model[0].bias.zero_()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    with make(model, optimizer=opt) as tr:
        for step in range(3):
            opt.zero_grad()
            loss = model(torch.full((2, 4), -1.0 if step == 1 else 0.01)).sum()
            tr.step(loss=loss)
            loss.backward()
            opt.step()
    return tr


def test_a_hidden_inf_that_makes_a_backward_nan_is_replayed_and_named_as_trace_names_it() -> None:
    traced = _hidden_inf_run(nantrace.trace, HandSigmoid())
    watched = _hidden_inf_run(lambda m, **kw: nantrace.watch(m, every=None, **kw), HandSigmoid())
    # the call's output is a finite 0 computed from exp's inf (1 / inf): the zeros signal replays the call and
    # names the forward `exp` as the producer (DESIGN turn 2: an op's inf carried into the output as a finite
    # value counts), under trace and under watch's replay alike
    expected = (1, 0, "forward", "1", "HandSigmoid", 0, "output", "inf")
    assert _fields(traced.first_overflow()) == _fields(watched.first_overflow()) == expected
    # the NaN gradients reach the weights (SGD: w - 0 · NaN), so step 2's forward is non-finite and replayed too;
    # its first Linear's `linear` is named there as reading its own NaN weight
    assert traced.ops[["step", "module", "op", "kind", "reaches"]].values.tolist() == [
        [1, "1", "exp", "posinf", True],
        [2, "0", "linear", "nan", True],
    ]
    assert watched.steps["recorded"].tolist() == ["watch", "replay", "replay"]
    assert watched.diagnose().cause == traced.diagnose().cause == "forward_overflow"
    assert "replaying it after its sentinel saw a non-finite value" in str(watched.first_overflow())


def test_a_hidden_inf_that_stays_hidden_is_seen_only_on_full_steps() -> None:
    """``tanh(inf) = 1`` reaches no tensor the sentinel checks: no step is flagged; full steps record what
    trace records of them (here trace finds nothing non-finite either)."""
    traced = _hidden_inf_run(nantrace.trace, Squash())
    watched = _hidden_inf_run(lambda m, **kw: nantrace.watch(m, every=2, **kw), Squash())
    assert watched.steps["recorded"].tolist() == ["full", "watch", "full"]
    assert traced.first_overflow() is None and watched.first_overflow() is None
    assert watched.options["watch"]["sentinel"] == {}
    full = traced.records[traced.records["step"].isin([0, 2])]
    _same_rows(full, watched.records)


def test_a_backward_fault_in_a_custom_autograd_function_is_replayed_and_named_as_trace_names_it() -> None:
    """InfGrad's backward multiplies finite incoming gradients by inf: the backward of its module produced it.
    Under watch(every=None) no step is recorded unless the gradient check flags it."""
    traced = _zoo_bad_backward(nantrace.trace)
    watched = _zoo_bad_backward(lambda m, **kw: nantrace.watch(m, every=None, **kw))
    expected = (0, 0, "backward", "1", "BadBackward", 0, "grad_input[0]", "inf")
    assert _fields(traced.first_overflow()) == _fields(watched.first_overflow()) == expected
    assert watched.steps["recorded"].tolist() == ["replay", "replay"]
    _same_rows(watched.records.query("step == 0"), traced.records.query("step == 0"))


def test_healthy_under_watch_says_how_many_steps_were_only_watched() -> None:
    """A healthy verdict covers what was recorded: on a watched step the sentinel sees the model's boundaries
    only, so the diagnosis says how many steps that was instead of "nothing points to a fault"."""
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 1))
    opt = torch.optim.SGD(m.parameters(), lr=0.01)
    with nantrace.watch(m, optimizer=opt, every=100) as tr:
        for _ in range(5):
            opt.zero_grad()
            loss = m(torch.randn(8, 4)).pow(2).mean()
            tr.step(loss=loss)
            loss.backward()
            opt.step()
    assert tr.steps["recorded"].tolist() == ["full", "watch", "watch", "watch", "watch"]
    d = tr.diagnose()
    assert d.cause == "healthy"
    assert d.summary == (
        "Healthy as far as recorded: every recorded value was finite; 4 of 5 steps were only watched, so a "
        "transient inf inside the model on those steps would not show."
    )
    assert d.evidence[-1] == (
        "4 of 5 steps were only watched (nantrace.watch's sentinel: model inputs, outputs, loss, gradients, "
        "parameters); a value that went non-finite and back to finite inside the model on those steps is not seen"
    )


# ------------------------------------------------------------------ stale gradients: a loop without zero_grad()
def _no_zero_grad(make: Any, *, zero_grad: bool | None = None, steps: int = 4) -> nantrace.Trace:
    """float16 autocast + GradScaler; step 0's scaled gradient overflows (outputs near 300, scale 65536), the
    later batches are small. ``zero_grad`` None: the loop never resets ``.grad``, so step 0's inf stays there;
    False: ``zero_grad(set_to_none=False)`` (zeros kept in place); True: ``zero_grad()``."""
    m = nn.Linear(4, 4)
    with torch.no_grad():
        m.weight.copy_(torch.linspace(-0.5, 0.5, 16).reshape(4, 4))
        m.bias.fill_(0.1)
    opt = torch.optim.SGD(m.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16)
    with make(m, scaler=scaler, optimizer=opt) as tr:
        for s in range(steps):
            if zero_grad is not None:
                opt.zero_grad(set_to_none=zero_grad)
            with torch.autocast("cpu", dtype=torch.float16):
                y = m(torch.full((2, 4), 300.0 if s == 0 else 1.0))
            scaler.scale(y.float().pow(2).mean()).backward()
            scaler.step(opt)
            scaler.update()
    return tr


def _watch_none(m: nn.Module, **kw: Any) -> nantrace.Trace:
    return nantrace.watch(m, every=None, **kw)


@pytest.mark.parametrize("make", [_watch_none, nantrace.watch], ids=["every=None", "every=100"])
def test_stale_gradients_are_recorded_on_watched_steps_and_diagnosed_as_under_trace(make: Any) -> None:
    """The loop never calls zero_grad(): from step 1 on, the weight's and the bias's ``.grad`` already hold
    step 0's inf when the backward reaches them. The sentinel counts them at the first gradient of each watched
    step's backward, so the steps table and the diagnosis are trace's: the gradients are never reset (not
    "overflow at every scale"). The replay records what each step's own backward added (finite from step 1 on):
    the step was reproduced, not 'not_reproduced'."""
    traced, watched = _no_zero_grad(nantrace.trace), _no_zero_grad(make)
    assert traced.steps["stale_grads"].tolist() == [0.0, 2.0, 2.0, 2.0]
    assert watched.steps["stale_grads"].tolist() == [0.0, 2.0, 2.0, 2.0]
    first = "full" if make is nantrace.watch else "replay"
    assert watched.steps["recorded"].tolist() == [first, "replay", "replay", "replay"]
    assert watched.steps["skipped"].tolist() == traced.steps["skipped"].tolist() == [True] * 4
    assert _fields(watched.first_overflow()) == _fields(traced.first_overflow())
    assert _fields(traced.first_overflow()) == (0, 0, "loss", "", "Linear", 0, "grad_output[0]", "inf")
    d, t = watched.diagnose(), traced.diagnose()
    assert d.cause == t.cause == "loss_scale_collapse"
    assert (
        d.summary
        == t.summary
        == (
            "The gradients are never reset: the inf of step 0 stays in `.grad`, so the GradScaler skips every step "
            "from 0 on and the loss scale falls (65536 → 4096)."
        )
    )
    assert (
        "at steps 1–3 the `.grad` of 2 parameter(s) already held inf/NaN before the backward added to it: the loop "
        "did not reset the gradients (no `zero_grad()` since), so that value stays in `.grad` and every later step "
        "is skipped"
    ) in d.evidence
    assert d.advice[0].startswith("Reset the gradients every step: `optimizer.zero_grad()`")
    assert watched.options["watch"]["sentinel"]["3"]["carried_over"] == 2


@pytest.mark.parametrize("zero_grad", [True, False])
def test_a_loop_that_resets_its_gradients_has_no_stale_gradients_under_watch(zero_grad: bool) -> None:
    """zero_grad() (``.grad`` None: nothing to check) and zero_grad(set_to_none=False) (zeros: one fused
    float64 L2 norm over them, read with the step's flags): 0 stale gradients on every step, as under trace, and the
    step-0 overflow is a benign backoff."""
    traced = _no_zero_grad(nantrace.trace, zero_grad=zero_grad)
    watched = _no_zero_grad(_watch_none, zero_grad=zero_grad)
    assert watched.steps["stale_grads"].tolist() == traced.steps["stale_grads"].tolist() == [0.0] * 4
    assert watched.steps["recorded"].tolist() == ["replay", "watch", "watch", "watch"]
    assert watched.diagnose().cause == traced.diagnose().cause == "scaler_backoff"


def test_the_stale_count_costs_no_host_copy_and_no_read_inside_a_hook(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With ``.grad`` kept between steps (never reset), the sentinel's stale count is one more device value in
    the read it already makes before optimizer.step(): a healthy watched step still copies to the host twice
    (that read and the post-step parameter flag; the flush copies nothing), and no hook reads a tensor."""
    nonempty = [0]
    real = _store.to_host

    def counting(tensors: Any) -> Any:
        nonempty[0] += bool(len(tensors))
        return real(tensors)

    monkeypatch.setattr(_store, "to_host", counting)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    with (
        nantrace.watch(model, optimizer=opt, sync_free=True, every=None) as tr,
        watch_reads() as (violations, copies),
    ):
        for _ in range(3):
            loss = model(torch.randn(8, 4)).pow(2).mean()
            tr.step(loss=loss)
            loss.backward()
            opt.step()
    assert violations == []
    assert nonempty[0] == 2 * 3 and copies[0] == 3 * 3  # and one empty to_host per flush
    assert tr.steps["recorded"].tolist() == ["watch"] * 3
    assert tr.steps["stale_grads"].tolist() == [0.0, 0.0, 0.0]


def test_a_large_finite_gradient_is_not_counted_stale() -> None:
    """A float32 ``.grad`` of 3e38 whose L2 norm overflows float32: accumulated in float64 the norm is finite,
    so it is no stale gradient (a float32 norm would have called it inf)."""
    model = nn.Linear(2, 1, bias=False)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    with nantrace.watch(model, optimizer=opt, every=None) as tr:
        for _ in range(2):
            model.weight.grad = torch.full((1, 2), 3e38)
            loss = (model(torch.ones(1, 2)) * 0.0).sum()
            tr.step(loss=loss)
            loss.backward()
            opt.step()
    assert tr.steps["stale_grads"].tolist() == [0.0, 0.0]
    assert tr.steps["recorded"].tolist() == ["watch", "watch"]


@pytest.mark.parametrize(("value", "stale"), [(1e200, 0.0), (math.inf, 1.0)])
def test_a_float64_gradient_is_counted_stale_only_when_it_holds_inf_or_nan(
    value: float, stale: float
) -> None:
    """A float64 ``.grad`` of 1e200, beside a float32 one: its L2 norm would overflow float64, its largest |g|
    does not, so it is no stale gradient; an inf there is one."""
    model = nn.Sequential(nn.Linear(2, 1, bias=False).double(), nn.Linear(1, 1, bias=False))
    model[1].forward = lambda x: torch.nn.functional.linear(x.float(), model[1].weight)  # type: ignore[method-assign]
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    with nantrace.watch(model, optimizer=opt, every=None) as tr:
        model[0].weight.grad = torch.full((1, 2), value, dtype=torch.float64)
        model[1].weight.grad = torch.zeros(1, 1)
        loss = (model(torch.ones(1, 2, dtype=torch.float64)) * 0.0).sum()
        tr.step(loss=loss)
        loss.backward()
        opt.step()
    assert tr.steps["stale_grads"].tolist() == [stale]


# ------------------------------------------------------------------ diagnose() under watch and under trace
def _traces_of(name: str, make: Any, monkeypatch: pytest.MonkeyPatch) -> list[nantrace.Trace]:
    """The traces a CASES test makes, with nantrace.trace replaced by ``make``; its own assertions hold."""
    made: list[nantrace.Trace] = []

    def capture(model: nn.Module, **kw: Any) -> nantrace.Trace:
        tr = make(model, **kw)
        made.append(tr)
        return tr

    with monkeypatch.context() as m:
        m.setattr(nantrace, "trace", capture)
        getattr(cases, name)()
    return made


def _as_watch(model: nn.Module, **kw: Any) -> nantrace.Trace:
    kw.pop("every", None)
    return nantrace.watch(model, every=None, **kw)


# the diagnosis of each trace a CASES test makes (C04 makes two: the fully padded row, then none)
CASE_CAUSES = {
    "test_c01_t5_feed_forward_overflow_then_norm_nan": ["forward_overflow"],
    "test_c02_residual_add_is_the_blocks_own_code": ["forward_overflow"],
    "test_c03_attention_scores_overflow_inside_attention": ["forward_overflow"],
    "test_c04_fully_masked_row_is_nan_in_attention_and_mask_never_reported": ["invalid_op", "healthy"],
    "test_c05_log_of_zero_count_in_data_is_reported": ["data"],
    "test_c06_backward_zero_times_inf_in_gate": ["invalid_op"],
    "test_c06_clamp_guard_depends_on_clamp_gradient_at_its_bound": ["invalid_op"],
    "test_c07_adam_eps_underflows_in_pure_fp16": ["optimizer"],
    "test_c08_loss_outside_the_model_underflows_and_every_step_is_skipped": ["loss"],
    "test_c09_shared_layer_overflows_on_third_call": ["forward_overflow"],
    "test_c10_inplace_relu_after_linear_with_backward_hooks": ["forward_overflow"],
    "test_c12_default_scaler_backs_off_then_trains": ["scaler_backoff"],
    "test_c13_gradient_accumulation_nan_in_micro_batch_1_of_step_2": ["data"],
    "test_c14_backward_grad_input_overflows_in_big_linear": ["backward_overflow"],
}


def _expected_causes(name: str) -> tuple[list[str], list[str]]:
    """The causes diagnose() gives for a CASES test's traces: (under trace, under watch(every=None)). Where this
    torch's clamp sends 0 at its bound, C06's clamped run holds nothing non-finite: trace's full rows show the
    gate's flushed float16 gradients (gradient_underflow, all of proj's gradient elements 0), while watch records
    no ranges on watched steps and says healthy with that caveat."""
    if name == "test_c06_clamp_guard_depends_on_clamp_gradient_at_its_bound" and not (
        cases._clamp_passes_the_gradient_at_its_bound()
    ):
        return ["gradient_underflow"], ["healthy"]
    return CASE_CAUSES[name], CASE_CAUSES[name]


@pytest.mark.parametrize("name", _CASE_NAMES)
def test_every_case_is_diagnosed_under_watch_as_under_trace(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """diagnose() of each CASES run under watch(every=None): the same cause and the same headline (who, what,
    where) as under trace, except where nothing is non-finite and only trace's full rows show a fault
    (:func:`_expected_causes`)."""
    assert sorted(CASE_CAUSES) == sorted(_CASE_NAMES)  # a new case gets its expected causes here
    traced = _traces_of(name, nantrace.trace, monkeypatch)
    watched = _traces_of(name, _as_watch, monkeypatch)
    t = [tr.diagnose() for tr in traced]
    w = [tr.diagnose() for tr in watched]
    assert ([d.cause for d in t], [d.cause for d in w]) == _expected_causes(name)
    for a, b in zip(t, w, strict=True):
        assert _fields(a.overflow) == _fields(b.overflow)
        if (
            a.cause == b.cause != "healthy"
        ):  # a healthy headline counts trace's update ratios: watch records none
            assert str(a).splitlines()[0] == str(b).splitlines()[0]
        if a.cause != b.cause:  # nothing non-finite and no full step: watch says what it could not judge
            assert "float16 gradient underflow (gradients flushed to zero) could not be judged" in str(b)


def _amp(fault: str) -> Callable[[Any], nantrace.Trace]:
    def run(make: Any) -> nantrace.Trace:
        model, scaler, opt, loop = _amp_loop(fault)(None)
        with make(model, scaler=scaler, optimizer=opt) as tr:
            loop()
        return tr

    return run


def _zoo_bad_backward(make: Any) -> nantrace.Trace:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), BadBackward(), nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    with make(model, optimizer=opt) as tr:
        for _ in range(2):
            opt.zero_grad()
            loss = model(torch.ones(2, 4)).sum()
            tr.step(loss=loss)
            loss.backward()
            opt.step()
    return tr


def _zoo_shared_scaler(make: Any) -> nantrace.Trace:
    """The traced model's gradients stay finite; the optimizer also steps ``extra``, a parameter outside it
    whose gradient is +inf at steps 1-2 (a discriminator sharing the GradScaler): the scaler skips them."""
    torch.manual_seed(0)
    g = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 1))
    extra = nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([*g.parameters(), extra], lr=1e-3)
    scaler = torch.amp.GradScaler("cpu", init_scale=4.0)
    with make(g, scaler=scaler, optimizer=opt) as tr:
        for step in range(4):
            opt.zero_grad()
            scaler.scale(g(torch.ones(1, 2)).sum()).backward()
            extra.grad = torch.full((1,), math.inf if step in (1, 2) else 0.0)
            scaler.step(opt)
            scaler.update()
    return tr


def _zoo_late_loss(make: Any) -> nantrace.Trace:
    """No scaler or optimizer; the loss reaches ``tr.step`` after ``loss.backward()``, and at step 1 it is
    ``0 · inf``: its NaN gradient arrives at the model's outputs before the loss is seen."""
    m = nn.Linear(4, 3)
    with make(m) as tr:
        for s in range(2):
            loss = m(torch.ones(2, 4)).mean() * (0.0 * math.inf if s == 1 else 1.0)
            loss.backward()
            tr.step(loss=loss)
    return tr


ZOO_CAUSES = [
    (_amp("data"), "data"),
    (_amp("forward"), "forward_overflow"),
    (_amp("loss"), "loss"),
    (_zoo_twice, "data"),
    (_zoo_accumulation, "backward_overflow"),
    (_zoo_no_grad, "forward_overflow"),
    (_zoo_optimizer, "optimizer"),
    (lambda make: _hidden_inf_run(make, HandSigmoid()), "forward_overflow"),
    (_zoo_bad_backward, "invalid_op"),  # its backward multiplies by inf: an infinite derivative
    (lambda make: _no_zero_grad(make), "loss_scale_collapse"),
    (_zoo_shared_scaler, "scaler_backoff"),
    (_zoo_late_loss, "loss"),
]


@pytest.mark.parametrize(
    ("zoo", "cause"),
    ZOO_CAUSES,
    ids=[
        "amp_data",
        "amp_forward",
        "amp_loss",
        "twice",
        "accumulation",
        "no_grad",
        "optimizer",
        "hand_sigmoid",
        "bad_backward",
        "no_zero_grad",
        "shared_scaler",
        "late_loss",
    ],
)
def test_every_zoo_case_is_diagnosed_under_watch_as_under_trace(zoo: Any, cause: str) -> None:
    """The same cause, producer and headline under watch(every=None) as under trace, and the same summary (the
    why) once the replay's own note is left aside."""
    traced, watched = zoo(nantrace.trace), zoo(_watch_none)
    t, w = traced.diagnose(), watched.diagnose()
    assert t.cause == w.cause == cause
    assert _fields(w.overflow) == _fields(t.overflow)
    assert _fields(watched.first_overflow()) == _fields(traced.first_overflow())
    assert str(t).splitlines()[0] == str(w).splitlines()[0]
    assert w.summary == t.summary


def test_a_shared_scaler_skip_is_not_called_unreproduced_under_watch() -> None:
    """Only the GradScaler's found-inf was set while the sentinel found this model's gradients finite: the
    replay agrees (its values are finite), so the step was reproduced and the overflow was outside the model."""
    watched = _zoo_shared_scaler(_watch_none)
    assert watched.steps["recorded"].tolist() == ["watch", "replay", "replay", "watch"]
    assert watched.steps["skipped"].tolist() == [False, True, True, False]
    assert watched.first_overflow() is None
    assert watched.options["watch"]["sentinel"]["1"]["outside"] is True
    d = watched.diagnose()
    assert (d.cause, d.overflow) == ("scaler_backoff", None)
    assert d.summary == (
        "The GradScaler skipped 2 step(s), but this model's gradients stayed finite: the overflow came from "
        "outside the traced model (e.g. another model sharing the GradScaler)."
    )


def test_a_loss_seen_after_its_backward_is_replayed_after_it() -> None:
    """``tr.step(loss)`` after ``loss.backward()``: the replay records the loss after the backward, as the real
    step ran, so the first non-finite value is the gradient at the model's outputs, as under trace."""
    watched = _zoo_late_loss(_watch_none)
    assert _fields(watched.first_overflow()) == (1, 0, "loss", "", "Linear", 0, "grad_output[0]", "nan")
    rows = watched.records.query("step == 1 and phase == 'loss'")
    assert rows["tensor"].tolist() == ["grad_output[0]", "loss"]


# ------------------------------------------------------------------ what watched steps do not record, said
def _diverging(make: Any) -> nantrace.Trace:
    """A Linear(4→4) under float16 autocast trained by SGD with lr 2 on fixed inputs: the weights grow every
    step until the forward overflows float16 at step 8."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4))
    opt = torch.optim.SGD(model.parameters(), lr=2.0)
    with make(model, optimizer=opt) as tr:
        for _ in range(10):
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16):
                out = model(torch.ones(8, 4))
            loss = F.mse_loss(out.float(), torch.zeros(8, 4))
            tr.step(loss)
            loss.backward()
            opt.step()
            if not torch.isfinite(out).all():
                break
    return tr


def test_a_divergence_not_recorded_on_watched_steps_is_said_not_known() -> None:
    """trace sees the activations and weights grow over steps 0-7 (divergence); watch records no ranges on
    those steps, so it cannot tell: it names the same overflow and says, as evidence and advice, that whether
    the run was diverging is not known (never "exceeded 65504" as the whole why with nothing said)."""
    traced, watched = _diverging(nantrace.trace), _diverging(_watch_none)
    assert traced.diagnose().cause == "divergence"
    d = watched.diagnose()
    assert d.cause == "forward_overflow"
    assert (
        _fields(d.overflow)
        == _fields(traced.diagnose().overflow)
        == (8, 0, "forward", "0", "Linear", 0, "output", "inf")
    )
    assert d.evidence[-1] == (
        "8 of the 8 step(s) before step 8 were only watched (nantrace.watch records no activation or weight "
        "ranges on them): whether activations and weights grew towards this event (a diverging run) is not "
        "known (only the jumps of the loss and the gradient norm, recorded on every step, were read)"
    )
    assert d.advice[-1] == (
        "Before changing dtypes, record the steps before step 8 in full (nantrace.trace(), or "
        "nantrace.watch(..., every=1)) to see whether activations and weights grew towards it: a diverging run "
        "needs a lower learning rate, not a wider dtype."
    )


def test_watch_every_1_records_every_step_and_diagnoses_the_divergence() -> None:
    watched = _diverging(lambda m, **kw: nantrace.watch(m, every=1, **kw))
    assert set(watched.steps["recorded"].tolist()) == {"full"}
    assert watched.diagnose().cause == "divergence"


def _underflowing(make: Any) -> nantrace.Trace:
    """A float16 MLP without a GradScaler whose parameter gradients are all below float16's smallest normal."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 1)).half()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    with make(model, optimizer=opt) as tr:
        for _ in range(2):
            opt.zero_grad()
            loss = model(torch.randn(4, 8).half()).float().mean() * 1e-6
            tr.step(loss)
            loss.backward()
            opt.step()
    return tr


def test_a_healthy_verdict_under_watch_says_underflow_and_slow_divergence_were_not_judged() -> None:
    traced, watched = _underflowing(nantrace.trace), _underflowing(_watch_none)
    assert traced.diagnose().cause == "gradient_underflow"
    d = watched.diagnose()
    assert d.cause == "healthy"
    assert d.evidence[-2] == (
        "nantrace.watch recorded no activation, gradient or weight ranges on the 2 watched step(s): a divergence "
        "with no overflow yet (activations, loss and weights growing) and float16 gradient underflow (gradients "
        "flushed to zero) could not be judged: no step was recorded in full"
    )
    assert d.evidence[-1].startswith("2 of 2 steps were only watched")


def _linear_overflow_step(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model(x)  # the user's line that calls the model: the op of a built-in layer is named at it


def test_watch_names_the_op_at_the_line_that_called_the_model_as_trace_does() -> None:
    """A Sequential of built-in layers overflows float16 in `linear`: no user code runs inside its forward, so
    the op's source is the user's line that called the model. watch replays that call from its own frame after
    the step; it names the same line as trace, not the loop line that triggered the replay."""
    line = f"{__file__}:{inspect.getsourcelines(_linear_overflow_step)[1] + 1}"
    sources = []
    for make in (nantrace.trace, nantrace.watch):
        m = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)).half()
        with torch.no_grad():
            m[0].weight.fill_(1.0)
            m[1].weight.fill_(30000.0)
        opt = torch.optim.SGD(m.parameters(), lr=0.0)
        kwargs = (
            {"every": None} if make is nantrace.watch else {}
        )  # watch: step 0 replayed, not recorded in full
        with make(m, optimizer=opt, **kwargs) as tr:
            out = _linear_overflow_step(m, torch.ones(2, 4, dtype=torch.float16))
            loss = out.float().sum()
            loss.backward()
            tr.step(loss=loss)
            opt.step()
        ov = tr.first_overflow()
        assert ov is not None and (ov.module, ov.phase) == ("1", "forward")
        sources.append(tr.ops["source"].tolist()[:1])
    assert sources == [[line], [line]]


def test_a_weight_written_between_steps_is_not_claimed_to_be_the_optimizers_doing_under_watch() -> None:
    """A weight set to inf by hand before step 2's forward; tanh turns the inf into ±1, so the model's outputs,
    the loss and the gradients stay finite. trace sees the Linear's inf output at step 2's forward; watch sees
    it first in its post-step check and says that a write since the previous check reads the same as the
    step."""
    answers = []
    for make in (nantrace.trace, nantrace.watch):
        torch.manual_seed(0)
        m = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
        opt = torch.optim.SGD(m.parameters(), lr=0.01)
        x, y = torch.randn(8, 4), torch.randn(8, 2)
        with make(m, optimizer=opt) as tr:
            for s in range(3):
                if s == 2:
                    with torch.no_grad():
                        m[0].weight[0, 0] = math.inf
                loss = ((m(x) - y) ** 2).mean()
                loss.backward()
                tr.step(loss=loss)
                opt.step()
                opt.zero_grad()
        ov = tr.first_overflow()
        assert ov is not None
        answers.append((ov.step, ov.phase, ov.module, ov.tensor))
        if make is nantrace.watch:
            assert ov.message.endswith(
                "It checks parameters only after optimizer.step(), so a write to them since the previous check (a "
                "manual edit, a state-dict load) reads the same as the step making them non-finite; "
                "nantrace.trace() records the forward that would tell them apart.)"
            )
    assert answers == [(2, "forward", "0", "output"), (2, "optimizer", "0", "weight")]


class SparseMix(nn.Module):
    """``fc(x)`` plus the sum of a sparse product; the output is multiplied by 1e39 (past float32's max) when
    ``x[0, 0] > 100``. With ``echo`` the sparse input is also returned."""

    def __init__(self, echo: bool = False) -> None:
        super().__init__()
        self.fc, self.echo = nn.Linear(3, 3), echo

    def forward(self, x: torch.Tensor, adj: torch.Tensor) -> Any:
        out = self.fc(x) * (1e39 if bool(x[0, 0] > 100) else 1.0) + torch.sparse.mm(adj, x).sum()
        return (out, adj) if self.echo else out


@pytest.mark.parametrize(
    ("layout", "echo"), [("coo", False), ("coo", True), ("csr", False)], ids=["coo", "coo_output", "csr"]
)
def test_watch_skips_sparse_tensors_and_replays_a_step_that_has_them(layout: str, echo: bool) -> None:
    """The sentinel's aminmax does not run on sparse tensors (it raised NotImplementedError/RuntimeError into
    the loop, found by the new-user check): they are skipped, as trace skips them, and a faulty step with a
    sparse input is replayed and named as trace names it."""
    answers = []
    for make in (nantrace.trace, nantrace.watch):
        m = SparseMix(echo)
        with torch.no_grad():  # every output positive: the product is +inf
            m.fc.weight.fill_(0.5)
            m.fc.bias.zero_()
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        adj = torch.eye(2).to_sparse() if layout == "coo" else torch.eye(2).to_sparse_csr()
        with make(m, optimizer=opt) as tr:
            for step in range(3):
                x = torch.ones(2, 3)
                x[0, 0] = 200.0 if step == 1 else 0.0
                out = m(x, adj)
                loss = (out[0] if echo else out).sum()
                tr.step(loss=loss)
                loss.backward()
                opt.step()
                opt.zero_grad()
        answers.append(_fields(tr.first_overflow()))
    assert (
        answers[0]
        == answers[1]
        == (1, 0, "forward", "", "SparseMix", 0, "output[0]" if echo else "output", "inf")
    )


def _written_in_place_run(what: str) -> Any:
    """watch over four float32 steps of Linear(3, 2) (weight 0.5, bias 0), two micro-steps each, SGD at lr 0 via
    a GradScaler. Step 2 is faulty: ``what="inputs"``: micro-step 0's input holds 3e38 and the loop zeroes it
    in place after its backward (the real loss, a square of 4.5e38, is +inf); ``what="weights"``: the loop sets
    the weight to +inf in place between micro-step 0 and 1 (micro-step 0 was finite)."""
    model = nn.Sequential(nn.Linear(3, 2))
    with torch.no_grad():
        model[0].weight.fill_(0.5)
        model[0].bias.zero_()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0)
    with nantrace.watch(model, scaler=scaler, optimizer=opt, every=None) as tr:
        for step in range(4):
            for micro in range(2):
                x = torch.ones(2, 3)
                if step == 2 and micro == 0 and what == "inputs":
                    x[0, 0] = 3e38
                if step == 2 and micro == 1 and what == "weights":
                    with torch.no_grad():
                        model[0].weight[0, 0] = math.inf
                loss = model(x).pow(2).sum()
                scaler.scale(loss).backward()
                if step == 2 and micro == 0 and what == "inputs":
                    x.zero_()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
            if step == 2 and what == "weights":
                with torch.no_grad():
                    model[0].weight[0, 0] = 0.5
    return tr


def test_a_step_whose_inputs_were_written_after_the_forward_is_not_reproduced() -> None:
    """The replay ran on the zeroed input: what it recorded (a finite output, a loss from the real step) is not
    this step's, so the step is not_reproduced and overflows() shows what the sentinel saw (it said the model's
    outputs were finite, absmax 0.5, and blamed the loss; found by the new-user check)."""
    tr = _written_in_place_run("inputs")
    assert tr.steps["recorded"].tolist() == ["watch", "watch", "not_reproduced", "watch"]
    ov = tr.first_overflow()
    assert _fields(ov) == (2, 0, "loss", "", "loss", 0, "loss", "inf")
    assert str(ov).startswith(
        "nantrace.watch saw inf at step 2 (micro-step 0, loss: loss of the model), but its inputs were written in "
        "place after the forward, so the values its replay recorded are not this step's and are not used"
    )
    rows = tr.overflows()
    assert rows["step"].tolist() == [2] and rows["message"].iloc[0] == ov.message
    assert tr.diagnose().advice[1] == (
        "For watch to replay the step: do not change the model's inputs in place after its forward."
    )


def test_weights_written_between_micro_steps_are_not_replayed_into_the_first() -> None:
    """The weight set to inf between micro-step 0 and 1: a replay of both with the weights as they are now
    would put the inf in micro-step 0, which was finite; the step is not_reproduced and named where the
    sentinel saw it, micro-step 1 (found by the new-user check)."""
    tr = _written_in_place_run("weights")
    assert tr.steps["recorded"].tolist() == ["watch", "watch", "not_reproduced", "watch"]
    ov = tr.first_overflow()
    assert ov is not None and (ov.step, ov.micro_step, ov.phase, ov.tensor, ov.kind) == (
        2,
        1,
        "forward",
        "output",
        "inf",
    )
    assert (
        "The model's parameters had been written in place after the forward of micro-step(s) 0 (before the "
        "replay, which runs before optimizer.step()), so the replay could not compute what that forward did."
    ) in str(ov)
    assert tr.diagnose().advice[1] == (
        "For watch to replay the step: write the weights only outside the step (not between its micro-steps)."
    )


def test_watch_runs_a_model_whose_parameters_are_inference_tensors() -> None:
    """A model built under torch.inference_mode (its parameters have no version counter) watched in a no_grad
    loop: the sentinel's per-forward sum of the parameters' versions leaves them out (it raised into the loop),
    and the +inf input of step 1 is named."""
    with torch.inference_mode():
        m = nn.Linear(2, 2)
    with nantrace.watch(m) as tr, torch.no_grad():
        for step in range(3):
            m(torch.ones(1, 2) * (1e39 if step == 1 else 1.0))
    assert _fields(tr.first_overflow()) == (1, 0, "data", "", "Linear", 0, "input[0]", "inf")


def test_save_repro_of_a_step_watch_did_not_reproduce_reads_the_capture() -> None:
    """watch(..., capture='first') whose faulty step was not reproduced: save_repro of that Overflow reads the
    trace's capture (it said 'this trace has no capture' though capture was passed; found by the second new-user
    check). The replayed call was finite, so nothing was kept, and the error says so."""
    torch.manual_seed(0)
    model = ThirdCallInf()
    with nantrace.watch(model, every=None, capture="first") as tr:
        for _ in range(4):
            tr.step(model(torch.ones(2, 3)).sum())
    assert tr.steps["recorded"].tolist() == ["watch", "watch", "not_reproduced", "watch"]
    ov = tr.first_overflow()
    assert ov is not None
    with pytest.raises(
        nantrace.NantraceError, match=r"^save_repro: capture='first' watched every traced module"
    ):
        ov.save_repro("unused.repro")


class LossAndLogits(nn.Module):
    """Returns the loss and the logits it was computed from (as HF models do with ``labels``)."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(4, 4)
        self.head = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        logits = self.head(torch.relu(self.body(x)))
        return {"loss": (logits.float() ** 2).mean(), "logits": logits}


def _loss_and_logits_run(make: Any) -> nantrace.Trace:
    torch.manual_seed(0)
    m = LossAndLogits()
    opt = torch.optim.SGD(m.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16)
    with make(m, scaler=scaler, optimizer=opt) as tr:
        for i in range(3):
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16):
                out = m(torch.randn(2, 4) * (300.0 if i == 1 else 1.0))
            scaler.scale(out["loss"]).backward()
            scaler.step(opt)
            scaler.update()
    return tr


def test_a_replay_of_a_model_returning_its_loss_and_logits_records_what_the_real_step_did() -> None:
    """The hook on `logits` saw the loss's share of their gradient; feeding it again beside the loss's gradient
    counted that share twice (the replayed `head` gradients were 2× the real ones, and held +inf where the real
    ones did not). The replay feeds each output what it received from outside the model."""
    t, w = _loss_and_logits_run(nantrace.trace), _loss_and_logits_run(nantrace.watch)
    cols = ["phase", "module", "tensor", "absmax", "min", "max", "n_nan", "n_posinf", "n_neginf", "n_zero"]
    rows_t = t.records[t.records["step"] == 1][cols].reset_index(drop=True)
    rows_w = w.records[w.records["step"] == 1][cols].reset_index(drop=True)
    assert int(rows_t["n_posinf"].sum()) > 0  # the step did overflow in backward
    pd.testing.assert_frame_equal(rows_t, rows_w)
    assert w.steps.loc[w.steps["step"] == 1, "recorded"].iloc[0] == "replay"
    assert t.first_overflow() == w.first_overflow()
