"""Every public entry point validates its arguments up front, with an error that names the argument and says
what to do, and leaves the model untouched when it refuses."""

from __future__ import annotations

import re
import warnings
from typing import Any

import pytest
import torch
from torch import nn

import nantrace

# the wrong arguments below are deliberate; keep the type checker out of it
trace: Any = nantrace.trace


def model() -> nn.Sequential:
    return nn.Sequential(nn.Linear(2, 2), nn.ReLU())


def hooks(m: nn.Module) -> list[int]:
    return [
        len(sub._forward_hooks) + len(sub._forward_pre_hooks) + len(sub._backward_hooks)
        for sub in m.modules()
    ] + [len(p._post_accumulate_grad_hooks or {}) + len(p._backward_hooks or {}) for p in m.parameters()]


def check(
    exc: type[BaseException],
    call: Any,
    *,
    names: str,
    hints: tuple[str, ...] = (),
    m: nn.Module | None = None,
) -> str:
    """``call()`` raises ``exc`` whose message names argument ``names`` and contains every hint; no hook left."""
    before = hooks(m) if m is not None else None
    with pytest.raises(exc) as info:
        call()
    msg = str(info.value)
    assert re.search(rf"\b{re.escape(names)}\b", msg), f"argument {names!r} not named in: {msg}"
    for h in hints:
        assert h in msg, f"hint {h!r} missing from: {msg}"
    if m is not None:
        assert hooks(m) == before
    return msg


# ------------------------------------------------------------------------------------------------ trace(model)


@pytest.mark.parametrize(
    "bad",
    [None, "model", 3, nn.Linear, [nn.Linear(1, 1)], lambda x: x],
    ids=["None", "str", "int", "class-not-instance", "list-of-modules", "function"],
)
def test_trace_model_must_be_a_module(bad: Any) -> None:
    check(TypeError, lambda: trace(bad), names="model", hints=("torch.nn.Module",))


# ------------------------------------------------------------------------------------------------ scaler / optimizer


def test_trace_scaler_must_be_a_grad_scaler() -> None:
    m = model()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    check(TypeError, lambda: trace(m, scaler=opt), names="scaler", hints=("GradScaler",), m=m)
    check(TypeError, lambda: trace(m, scaler=2.0**16), names="scaler", hints=("GradScaler",), m=m)


def test_trace_optimizer_must_be_an_optimizer() -> None:
    m = model()
    scaler = torch.amp.GradScaler("cpu")
    check(TypeError, lambda: trace(m, optimizer=scaler), names="optimizer", hints=("Optimizer",), m=m)
    params = list(m.parameters())
    check(TypeError, lambda: trace(m, optimizer=params), names="optimizer", hints=("Optimizer",), m=m)


def test_a_class_passed_for_an_instance_is_named_as_such() -> None:
    """The GradScaler or optimizer class itself (not an instance) is named as a class, with what to pass."""
    m = model()
    msg = check(TypeError, lambda: trace(m, scaler=torch.amp.GradScaler), names="scaler", m=m)
    assert msg == (
        "scaler must be a torch.amp.GradScaler (or None); got the class GradScaler itself, not an instance of it. "
        "Pass the GradScaler object your loop calls scale()/step()/update() on (e.g. scaler = "
        "torch.amp.GradScaler('cuda'))."
    )
    msg = check(TypeError, lambda: nantrace.watch(m, optimizer=torch.optim.AdamW), names="optimizer", m=m)
    assert "got the class AdamW itself, not an instance of it. Pass the optimizer object" in msg
    msg = check(TypeError, lambda: trace(m, scaler=torch.optim.AdamW), names="scaler", m=m)
    assert "got the class AdamW, which is not a GradScaler. Pass the GradScaler object" in msg
    msg = check(TypeError, lambda: trace(nn.Linear), names="model")
    assert msg == (
        "model must be a torch.nn.Module; got the class Linear itself, not an instance of it. Pass the model "
        "object your loop calls (e.g. model = Net())."
    )


def test_a_long_repr_of_a_wrong_model_is_left_out_rather_than_cut_off() -> None:
    m = model()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)  # a multi-line repr
    msg = check(TypeError, lambda: trace(opt), names="model")  # type: ignore[arg-type]
    assert msg == (
        "model must be a torch.nn.Module; got SGD. Pass the model object your loop calls (e.g. model = Net())."
    )
    msg = check(TypeError, lambda: trace("gpt2"), names="model")  # type: ignore[arg-type]
    assert msg.startswith("model must be a torch.nn.Module; got str: 'gpt2'. ")


@pytest.mark.parametrize("make", [trace, nantrace.watch], ids=["trace", "watch"])
def test_every_of_a_wrong_type_is_a_type_error_and_below_one_a_value_error(make: Any) -> None:
    m = model()
    check(TypeError, lambda: make(m, every="x"), names="every", m=m)
    check(TypeError, lambda: make(m, every=1.5), names="every", m=m)
    check(ValueError, lambda: make(m, every=0), names="every", m=m)


def test_an_unknown_option_names_the_function_it_was_given_to() -> None:
    m = model()
    msg = check(TypeError, lambda: nantrace.watch(m, evry=3), names="evry", m=m)
    assert msg.startswith(
        "nantrace.watch() got unknown option(s) ['evry']; the options are ['every', 'modules'"
    )
    msg = check(
        TypeError, lambda: trace(m, evry=3), names="evry", m=m
    )  # Python's own: trace() lists its options
    assert msg == "trace() got an unexpected keyword argument 'evry'"


def test_valid_scaler_and_optimizer_are_accepted() -> None:
    m = model()
    tr = trace(
        m,
        scaler=torch.amp.GradScaler("cpu", enabled=False),
        optimizer=torch.optim.SGD(m.parameters(), lr=0.1),
    )
    assert isinstance(tr, nantrace.Trace)
    assert hooks(m) == hooks(model())  # nothing attached before `with`


# ------------------------------------------------------------------------------------------------ modules=


def test_trace_modules_empty_list() -> None:
    m = model()
    check(ValueError, lambda: trace(m, modules=[]), names="modules", hints=("None",), m=m)
    check(ValueError, lambda: trace(m, modules=()), names="modules", hints=("None",), m=m)


@pytest.mark.parametrize(
    "bad", [[3], [None], [int], ["0", 2.5]], ids=["int", "None", "non-module-type", "mixed"]
)
def test_trace_modules_items_of_a_bad_type(bad: Any) -> None:
    m = model()
    check(TypeError, lambda: trace(m, modules=bad), names="modules", hints=("str",), m=m)


@pytest.mark.parametrize("bad", [3, 2.5])
def test_trace_modules_scalar_of_a_bad_type(bad: Any) -> None:
    m = model()
    check(TypeError, lambda: trace(m, modules=bad), names="modules", hints=("str",), m=m)


def test_trace_modules_given_a_module_instance() -> None:
    m = model()
    try:
        tr = trace(m, modules=m[0])
    except (TypeError, ValueError) as e:  # refusing is fine, with a message about modules=
        assert re.search(r"\bmodules\b", str(e)), str(e)
        assert "forward()" not in str(e)
        return
    with tr:  # accepting it is fine too, if it selects that module
        m(torch.ones(1, 2))
    assert set(tr.records.loc[tr.records["phase"] == "forward", "module"].astype(str)) <= {"0", ""}


@pytest.mark.parametrize(
    "sel",
    ["enc*", ["decoder", "head.*"], nn.Conv2d, lambda name, mod: False],
    ids=["glob", "list", "type", "fn"],
)
def test_trace_modules_matching_nothing(sel: Any) -> None:
    m = model()
    msg = check(ValueError, lambda: trace(m, modules=sel), names="modules", m=m)
    assert "'0'" in msg  # shows what the names look like


def test_trace_modules_valid_forms_are_accepted() -> None:
    m = model()
    for sel in ("0", ["0", "1"], nn.ReLU, lambda name, mod: name == "0", ("0*", nn.ReLU)):
        assert isinstance(trace(m, modules=sel), nantrace.Trace)


# ------------------------------------------------------------------------------------------------ phases=


@pytest.mark.parametrize("bad", [["forwards"], "nope", ["data", "grad"], [None]])
def test_trace_phases_unknown(bad: Any) -> None:
    m = model()
    msg = check(ValueError, lambda: trace(m, phases=bad), names="phases", m=m)
    for p in ("data", "forward", "loss", "backward", "optimizer"):
        assert p in msg  # lists the valid choices


def test_trace_phases_of_a_bad_type() -> None:
    m = model()
    check(TypeError, lambda: trace(m, phases=5), names="phases", hints=("forward",), m=m)


def test_trace_phases_empty() -> None:
    m = model()
    check(ValueError, lambda: trace(m, phases=[]), names="phases", hints=("None",), m=m)


def test_trace_phases_valid_forms_are_accepted() -> None:
    m = model()
    for ph in ("forward", ["data", "forward"], ("backward",), {"loss", "optimizer"}):
        assert isinstance(trace(m, phases=ph), nantrace.Trace)


def test_trace_sync_free_must_be_bool_or_none() -> None:
    m = model()
    check(TypeError, lambda: trace(m, sync_free="yes"), names="sync_free", m=m)


@pytest.mark.parametrize("make", [trace, nantrace.watch], ids=["trace", "watch"])
def test_scaler_and_optimizer_may_be_passed_positionally(make: Any) -> None:
    """``trace(model, scaler, optimizer)`` is ``trace(model, scaler=scaler, optimizer=optimizer)``; the options
    after them are keyword-only."""
    m = model()
    scaler = torch.amp.GradScaler("cpu", init_scale=8.0)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    with make(m, scaler, opt) as tr:
        for _ in range(2):
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16):
                loss = m(torch.ones(1, 2)).float().sum()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
    assert list(tr.steps["step"]) == [0, 1]
    assert list(tr.steps["scale"]) == [8.0, 8.0]
    with pytest.raises(TypeError, match="positional"):
        make(m, scaler, opt, None)


def test_an_optimizer_in_the_scaler_place_says_to_pass_it_by_name() -> None:
    m = model()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    msg = check(TypeError, lambda: trace(m, opt), names="scaler", m=m)
    assert msg == (
        "scaler must be a torch.amp.GradScaler (or None); got SGD. It is an optimizer: pass it as optimizer=opt "
        "(by position, the scaler comes first: model, scaler, optimizer). Pass the GradScaler object your loop calls "
        "scale()/step()/update() on (e.g. scaler = torch.amp.GradScaler('cuda'))."
    )
    scaler = torch.amp.GradScaler("cpu")
    msg = check(TypeError, lambda: nantrace.watch(m, None, scaler), names="optimizer", m=m)
    assert msg == (
        "optimizer must be a torch.optim.Optimizer (or None); got GradScaler. It is a GradScaler: pass it as "
        "scaler=scaler (by position, the scaler comes first: model, scaler, optimizer). Pass the optimizer object "
        "your loop calls step() on (e.g. opt = torch.optim.AdamW(model.parameters()))."
    )


# ------------------------------------------------------------------------------------------------ kind=


def _recorded_trace() -> nantrace.Trace:
    m = model()
    with trace(m) as tr:
        m(torch.tensor([[1.0, float("inf")]]))
    return tr


@pytest.mark.parametrize("bad", ["NaN", "posinf", "-inf", "", 1, ["nan"], True])
def test_first_overflow_and_overflows_kind(bad: Any) -> None:
    tr = _recorded_trace()
    for fn in (tr.first_overflow, tr.overflows):
        check(ValueError, lambda fn=fn: fn(kind=bad), names="kind", hints=("'inf'", "'nan'"))


def test_kind_is_checked_up_front_even_on_an_empty_trace() -> None:
    tr = trace(model())  # never entered: nothing recorded
    check(ValueError, lambda: tr.first_overflow(kind="bogus"), names="kind", hints=("'inf'",))
    check(ValueError, lambda: tr.overflows(kind="bogus"), names="kind", hints=("'inf'",))
    assert tr.first_overflow() is None and tr.first_overflow(kind="nan") is None
    assert len(tr.overflows(kind="inf")) == 0


def test_valid_kinds_are_accepted() -> None:
    tr = _recorded_trace()
    ov = tr.first_overflow(kind="inf")
    assert ov is not None and ov.kind == "inf"
    assert tr.first_overflow(kind="nan") is None
    assert len(tr.overflows(kind=None)) == 1


# ------------------------------------------------------------------------------------------------ Trace.step


@pytest.mark.parametrize("bad", ["loss", [torch.tensor(1.0)], True, b"2.0"])
def test_step_loss_must_be_a_tensor_or_a_number(bad: Any) -> None:
    m = model()
    with trace(m) as tr:
        m(torch.ones(1, 2))
        check(TypeError, lambda: tr.step(loss=bad), names="loss", hints=("Tensor",))
        tr.step(loss=torch.tensor(2.0))  # still usable after the refusal
    assert tr.steps["loss"].tolist() == [2.0]


def test_step_outside_with_is_refused() -> None:
    m = model()
    tr = trace(m)
    check(nantrace.NantraceError, lambda: tr.step(), names="with")  # before enter
    check(nantrace.NantraceError, lambda: tr.step(loss=torch.tensor(1.0)), names="with")
    with tr:
        m(torch.ones(1, 2))
    check(nantrace.NantraceError, lambda: tr.step(), names="with")  # after exit
    check(nantrace.NantraceError, lambda: tr.step(loss=torch.tensor(1.0)), names="with")
    assert issubclass(nantrace.NantraceError, ValueError)
    assert len(tr.steps) == 1


# ------------------------------------------------------------------------------------------------ re-entry


def test_reentering_a_used_trace_is_refused() -> None:
    m = model()
    tr = trace(m)
    with tr:
        m(torch.ones(1, 2))
    before = hooks(m)
    check(nantrace.NantraceError, lambda: tr.__enter__(), names="Trace", hints=("trace(",), m=m)
    assert hooks(m) == before
    assert len(tr.steps) == 1  # the recording is intact


def test_reentering_an_active_trace_is_refused_and_it_keeps_recording() -> None:
    m = model()
    with trace(m) as tr:
        m(torch.ones(1, 2))
        with pytest.raises(nantrace.NantraceError, match="already"), tr:
            pass
        m(torch.ones(1, 2))
    assert len(tr.steps) == 2
    assert hooks(m) == hooks(model())


def test_overflows_per_rank_must_be_a_bool() -> None:
    m = model()
    with trace(m) as tr:
        m(torch.ones(1, 2))
    check(TypeError, lambda: tr.overflows(per_rank="x"), names="per_rank", hints=("True or False",))


def test_an_optimizer_of_another_model_gets_a_warning_naming_the_fix() -> None:
    """trace(model, optimizer=opt) where opt holds none of model's parameters: its step() updates another
    model, so the warning says which optimizer to pass (found by the new-user check: no error, no warning)."""
    a, b = nn.Linear(2, 2), nn.Linear(2, 2)
    opt = torch.optim.SGD(b.parameters(), lr=0.1)
    with pytest.warns(UserWarning) as got, nantrace.trace(a, optimizer=opt):
        pass
    texts = [str(w.message) for w in got if "holds none" in str(w.message)]
    assert texts == [
        "nantrace: the optimizer (SGD) holds none of the traced Linear's parameters, so its step() updates another "
        "model: the `optimizer` rows, lr and step boundaries are this optimizer's. Pass the optimizer that steps "
        "this model (e.g. torch.optim.AdamW(model.parameters()))."
    ]
    assert got[0].filename == __file__
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*holds none.*")
        with nantrace.trace(b, optimizer=opt) as tr:  # its own optimizer: no such warning
            loss = b(torch.ones(1, 2)).sum()
            tr.step(loss=loss)
            loss.backward()
            opt.step()
