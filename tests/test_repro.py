"""trace(capture=...), Overflow.save_repro and nantrace.load_repro: the overflowing call, rebuilt in isolation."""

from __future__ import annotations

import importlib
import os
import sys
from pathlib import Path

import pytest
import torch
from _models_hunt import Boom, FirstSecond, GateNet, line_of, t5_model
from test_cases import T5FF, C02Model, C06Model, Gate
from torch import nn

import nantrace

X = torch.full((2, 16), 1100.0, dtype=torch.float16)


def test_round_trip_reproduces_the_same_inf_and_hunt_names_the_op(tmp_path: Path) -> None:
    m = t5_model()
    with nantrace.trace(m, capture="first") as tr:
        out = m(X)
    ov = tr.first_overflow()
    assert ov is not None and (ov.phase, ov.module, ov.kind) == ("forward", "ff.wo", "inf")
    assert ov.to_dict()["module"] == "ff.wo" and "_captured" not in ov.to_dict()
    path = ov.save_repro(tmp_path / "wo.repro")
    assert path == tmp_path / "wo.repro" and sorted(os.listdir(tmp_path)) == ["wo.repro"]

    repro = nantrace.load_repro(path)
    assert isinstance(repro, nantrace.Repro)
    assert (repro.module_name, repro.module_type, repro.module_class) == (
        "ff.wo",
        "Linear",
        "torch.nn.modules.linear.Linear",
    )
    assert (repro.step, repro.micro_step, repro.call, repro.kinds, repro.dtype) == (
        0,
        0,
        0,
        ("posinf",),
        "float16",
    )
    assert repro.autocast == {"device_type": "cpu", "enabled": False, "dtype": "bfloat16"}
    assert repro.module is not m.ff.wo and torch.equal(repro.module.weight, m.ff.wo.weight)
    wo_in = m.ff.act(m.ff.wi(X))
    assert torch.equal(repro.args[0], wo_in) and repro.kwargs == {}
    again = repro.run()
    ref = m.ff.wo(wo_in)
    assert torch.equal(again, ref) and int(torch.isposinf(again).sum()) == 16  # the same inf, every element
    row = tr.records.query("module == 'ff.wo' and tensor == 'output'")
    assert row["n_posinf"].tolist() == [16]
    assert torch.equal(repro.run(), again)  # run() works on copies: it can be repeated
    assert torch.equal(repro.args[0], wo_in)
    assert out.shape == (2, 8)

    c = nantrace.hunt(repro.run)
    assert c is not None
    assert (c.op, c.module, c.module_type, c.phase, c.kind) == (
        "aten::addmm",
        "ff.wo",
        "Linear",
        "forward",
        "inf",
    )
    assert c.source is None  # nn.Linear's forward is torch's own code, called by Repro.run
    in_lambda = nantrace.hunt(lambda: repro.run().float().sum())
    assert in_lambda == c and in_lambda.module == "ff.wo"  # named as in the traced model here too
    assert "Repro `ff.wo` (torch.nn.modules.linear.Linear), step 0" in repr(repro)


def test_capture_by_name_keeps_that_modules_call_and_hunt_finds_the_line(tmp_path: Path) -> None:
    m = t5_model()
    with nantrace.trace(m, capture="ff") as tr:
        m(X)
    ov = tr.first_overflow()
    assert ov is not None and ov.module == "ff.wo"
    repro = nantrace.load_repro(ov.save_repro(tmp_path / "ff.repro"))
    assert (repro.module_name, repro.module_class) == ("ff", "test_cases.T5FF")
    assert torch.equal(repro.args[0], X)
    c = nantrace.hunt(repro.run)
    assert c is not None
    assert (c.op, c.module) == ("aten::addmm", "ff.wo")  # names as in the traced model
    assert c.source == f"test_cases.py:{line_of(T5FF.forward, 'self.wo(')}"
    assert tr.options["capture"] == ["ff"]


def test_autocast_state_is_saved_and_restored(tmp_path: Path) -> None:
    m = t5_model(half=False)  # fp32 weights; autocast runs the Linears in fp16
    x = X.float()
    with nantrace.trace(m, capture="first") as tr, torch.autocast("cpu", dtype=torch.float16):
        m(x)
    ov = tr.first_overflow()
    assert ov is not None and ov.module == "ff.wo"
    repro = nantrace.load_repro(ov.save_repro(tmp_path / "amp.repro"))
    assert repro.autocast == {"device_type": "cpu", "enabled": True, "dtype": "float16"}
    assert repro.dtype == "float32"
    assert not torch.is_autocast_enabled("cpu")
    out = repro.run()  # outside autocast here: run() restores it
    assert out.dtype == torch.float16 and int(torch.isposinf(out).sum()) == 16
    assert m.ff.wo(m.ff.act(m.ff.wi(x))).dtype == torch.float32  # without autocast it stays finite fp32
    assert torch.isfinite(m.ff.wo(m.ff.act(m.ff.wi(x)))).all()


def test_capture_first_keeps_the_producer_of_own_code_overflows(tmp_path: Path) -> None:
    m = C02Model()
    with torch.no_grad():
        m.block.fc.weight.copy_(torch.eye(8))
        m.block.fc.bias.zero_()
    m = m.half()
    with nantrace.trace(m, capture="first") as tr:
        m(torch.full((2, 8), 40000.0, dtype=torch.float16))
    ov = tr.first_overflow()
    assert ov is not None and ov.module == "block"
    repro = nantrace.load_repro(ov.save_repro(tmp_path / "block.repro"))
    assert repro.module_name == "block" and repro.module_class == "test_cases.Residual"
    c = nantrace.hunt(repro.run)
    assert c is not None and (c.op, c.module, c.code) == (
        "aten::add.Tensor",
        "block",
        "return x + self.fc(x)",
    )
    assert c.internal is False


class InPlaceScale(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.mul_(1000.0)


def test_captured_inputs_are_the_values_before_the_call(tmp_path: Path) -> None:
    m = nn.Sequential(nn.Identity(), InPlaceScale())
    x = torch.full((3,), 100.0, dtype=torch.float16)
    with nantrace.trace(m, capture="1") as tr:
        m(x)
    assert torch.isinf(x).all()  # the user's tensor was scaled in place, as written
    ov = tr.first_overflow()
    assert ov is not None
    repro = nantrace.load_repro(ov.save_repro(tmp_path / "inplace.repro"))
    assert repro.args[0].tolist() == [100.0, 100.0, 100.0]
    assert torch.isinf(repro.run()).all() and repro.args[0].tolist() == [100.0, 100.0, 100.0]


def test_nothing_is_kept_when_every_call_is_clean() -> None:
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    x = torch.randn(3, 4)
    ref = m(x)
    with nantrace.trace(m, capture="first") as tr:
        out = m(x)
        assert (
            tr._recording.capture is not None and tr._recording.capture.open == []
        )  # copies dropped as each call returned
    assert torch.equal(out, ref)
    assert tr._recording.capture.kept is None
    assert tr.first_overflow() is None


def test_save_repro_without_a_capture_says_how_to_get_one(tmp_path: Path) -> None:
    m = t5_model()
    with nantrace.trace(m) as tr:
        m(X)
    ov = tr.first_overflow()
    assert ov is not None
    with pytest.raises(nantrace.NantraceError, match=r"this trace has no capture.*capture='first'"):
        ov.save_repro(tmp_path / "x.repro")
    g = GateNet().half()  # forward finite, backward NaN: no forward call to keep
    with nantrace.trace(g, capture="first") as tr:
        g(torch.tensor([[1.0, 2.0, 100.0, 3.0]], dtype=torch.float16)).sum().backward()
    ov = tr.first_overflow()
    assert ov is not None and ov.phase == "backward"
    with pytest.raises(nantrace.NantraceError, match=r"nantrace.hunt\(step_fn\)"):
        ov.save_repro(tmp_path / "x.repro")
    assert os.listdir(tmp_path) == []


def _overflow_of(layer: nn.Module, capture: str = "first") -> nantrace.Overflow:
    """Trace ``nn.Sequential(layer)`` on a float16 input of 100s with ``capture``; the first overflow."""
    m = nn.Sequential(layer)
    with nantrace.trace(m, capture=capture) as tr:
        m(torch.full((2,), 100.0, dtype=torch.float16))
    ov = tr.first_overflow()
    assert ov is not None
    return ov


def test_classes_that_cannot_be_imported_get_a_clear_error_at_save(tmp_path: Path) -> None:
    class Local(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x * 1000.0

    ov = _overflow_of(Local())
    with pytest.raises(
        nantrace.NantraceError, match=r"test_repro\..*<locals>\.Local, defined inside a function"
    ):
        ov.save_repro(tmp_path / "local.repro")
    main_cls = type("NotebookNet", (nn.Module,), {"forward": Local.forward, "__module__": "__main__"})
    ov2 = _overflow_of(main_cls(), capture="0")
    with pytest.raises(
        nantrace.NantraceError, match=r"__main__\.NotebookNet, defined in __main__ .*importable \.py"
    ):
        ov2.save_repro(tmp_path / "main.repro")
    assert os.listdir(tmp_path) == []


def test_a_class_gone_at_load_time_gets_a_clear_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "gone_model.py").write_text(
        "import torch\n\nclass Boom(torch.nn.Module):\n    def forward(self, x):\n        return x * 1000.0\n"
    )
    monkeypatch.syspath_prepend(str(pkg))
    mod = importlib.import_module("gone_model")
    ov = _overflow_of(mod.Boom())
    path = ov.save_repro(tmp_path / "gone.repro")
    monkeypatch.delitem(sys.modules, "gone_model")
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p != str(pkg)])
    with pytest.raises(
        nantrace.NantraceError, match=r"cannot rebuild module `0`: its class gone_model\.Boom"
    ):
        nantrace.load_repro(path)


def test_load_repro_refuses_other_files(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="no such reproducer file"):
        nantrace.load_repro(tmp_path / "missing.repro")
    torch.save({"weights": torch.ones(2)}, tmp_path / "ckpt.pt")
    with pytest.raises(nantrace.NantraceError, match="is not a nantrace reproducer"):
        nantrace.load_repro(tmp_path / "ckpt.pt")
    with pytest.raises(TypeError, match=r"path must be a str or os\.PathLike; got int"):
        nantrace.load_repro(3)  # type: ignore[arg-type]


def test_save_repro_inside_with_leaves_the_model_hooked_and_saves_without_its_hooks(tmp_path: Path) -> None:
    m = t5_model()
    with nantrace.trace(m, capture="ff.wo") as tr:
        m(X)
        tr.step()
        ov = tr.first_overflow()
        assert ov is not None
        n_hooks = len(m.ff.wo._forward_hooks)
        repro = nantrace.load_repro(ov.save_repro(tmp_path / "inside.repro"))
        assert len(m.ff.wo._forward_hooks) == n_hooks > 0  # the traced model keeps its hooks
    assert len(repro.module._forward_hooks) == 0 and len(repro.module._forward_pre_hooks) == 0
    assert len(m.ff.wo._forward_hooks) == 0


def test_capture_argument_is_validated() -> None:
    m = t5_model()
    with pytest.raises(ValueError, match=r"capture= names 'ff.nope', which is not a traced module.*'ff.wo'"):
        nantrace.trace(m, capture="ff.nope")
    with pytest.raises(TypeError, match=r"capture= must be None, 'first'.*got int: 3"):
        nantrace.trace(m, capture=3)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"capture= is an empty list"):
        nantrace.trace(m, capture=[])
    with pytest.raises(ValueError, match=r"capture= names 'ff\.wo', which is not a traced module"):
        nantrace.trace(m, modules="norm", capture="ff.wo")


class CausalMask(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = x.shape[-2]
        keep = torch.ones(n, n, dtype=torch.bool).tril()
        return torch.zeros(n, n, dtype=x.dtype).masked_fill(~keep, float("-inf"))


class MaskedMean(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.mask = CausalMask()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = torch.softmax(self.mask(x), -1)
        return w @ x


def test_a_module_that_builds_a_minus_inf_mask_is_neither_captured_nor_reported() -> None:
    m = MaskedMean()
    x = torch.randn(4, 3)
    with nantrace.trace(m, capture="first") as tr:
        out = m(x)
    assert torch.isfinite(out).all()
    assert tr._recording.capture is not None and tr._recording.capture.kept is None
    assert tr.first_overflow() is None


# ------------------------------------------------------------------ fresh-user findings
def _gate_then_fc_overflow() -> tuple[nn.Module, nantrace.Trace]:
    """Step 0: a backward-only NaN in `gate`; step 1: a forward +inf in `fc` (weights x10, inputs 10000)."""
    g = GateNet().half()
    with nantrace.trace(g, capture="first") as tr:
        g(torch.tensor([[1.0, 2.0, 100.0, 3.0]], dtype=torch.float16)).sum().backward()
        tr.step()
        with torch.no_grad():
            g.fc.weight.mul_(10.0)
        g(torch.full((1, 4), 10000.0, dtype=torch.float16))
        tr.step()
    return g, tr


def test_overflow_save_repro_refuses_a_captured_call_of_another_event(tmp_path: Path) -> None:
    _, tr = _gate_then_fc_overflow()
    ov = tr.first_overflow()
    assert ov is not None and (ov.step, ov.phase, ov.module) == (0, "backward", "gate")
    with pytest.raises(nantrace.NantraceError) as e:
        ov.save_repro(tmp_path / "x.repro")
    assert str(e.value).startswith(
        "save_repro: this Overflow is a backward overflow in `gate` (call 0, `grad_input[0]`) at step 0, but the "
        "captured call is `fc` call 0 at step 1 whose forward produced posinf: a reproducer of it would not be "
        "this event. To save the captured call anyway use trace.save_repro(path)"
    )
    assert os.listdir(tmp_path) == []
    repro = nantrace.load_repro(tr.save_repro(tmp_path / "fc.repro"))  # whatever was captured
    assert (repro.module_name, repro.step, repro.call, repro.kinds) == ("fc", 1, 0, ("posinf",))
    fwd = tr.overflows().query("phase == 'forward'")
    assert fwd[["step", "module"]].values.tolist() == [[1, "fc"]]


def test_backward_only_nan_is_reproduced_from_a_named_capture(tmp_path: Path) -> None:
    m = C06Model()
    with torch.no_grad():
        m.proj.weight.zero_()
        m.proj.bias.fill_(-20.0)  # sigmoid ≈ 0, so p = x
    m = m.half()
    x = torch.tensor([[0.1, 0.2, 1.0, 0.3]], dtype=torch.float16)
    with nantrace.trace(m, capture="gate") as tr:
        m(x).sum().backward()
    ov = tr.first_overflow()
    assert ov is not None and (ov.phase, ov.module, ov.kind) == ("backward", "gate", "nan")
    with pytest.raises(nantrace.NantraceError, match=r"this Overflow is a backward overflow in `gate`"):
        ov.save_repro(tmp_path / "x.repro")  # the captured call is the forward, not this backward event
    repro = nantrace.load_repro(tr.save_repro(tmp_path / "gate.repro"))
    assert (repro.module_name, repro.step, repro.call, repro.kinds, repro.input_grad) == (
        "gate",
        0,
        0,
        (),
        (True,),
    )
    assert "forward clean (kept for a backward fault)" in repr(repro)
    c = nantrace.hunt(lambda: repro.run().sum().backward(), kind="nan")
    assert c is not None
    assert (c.op, c.module, c.module_type, c.phase, c.kind) == (
        "aten::div.Tensor",
        "gate",
        "Gate",
        "backward",
        "nan",
    )
    assert c.source == f"test_cases.py:{line_of(Gate.forward, 'log1p')}"
    assert repro.last_args is not None
    grad = repro.last_args[0].grad
    assert grad is not None and torch.isnan(grad).tolist() == [[False, False, True, False]]


def test_parameters_keep_their_requires_grad_and_inputs_theirs(tmp_path: Path) -> None:
    lin = nn.Linear(2, 2).half()
    with torch.no_grad():
        lin.weight.fill_(1000.0)
    lin.bias.requires_grad_(False)
    m = nn.Sequential(lin)
    x = torch.full((1, 2), 100.0, dtype=torch.float16)  # a data input: requires_grad False
    with nantrace.trace(m, capture="first") as tr:
        m(x)
    repro = nantrace.load_repro(tr.first_overflow().save_repro(tmp_path / "lin.repro"))  # type: ignore[union-attr]
    assert repro.input_grad == (False,)
    assert (repro.module.weight.requires_grad, repro.module.bias.requires_grad) == (True, False)
    repro.run().float().sum().backward()
    assert repro.last_args is not None and repro.last_args[0].grad is None
    assert repro.module.weight.grad is not None and repro.module.bias.grad is None


def test_a_named_capture_that_never_overflowed_names_itself_and_the_overflow(tmp_path: Path) -> None:
    m = FirstSecond().half()
    with nantrace.trace(m, capture="first") as tr:  # "first" = every module
        m(torch.full((1, 2), 100.0, dtype=torch.float16))
    assert tr.options["capture"] == "first"
    assert nantrace.load_repro(tr.save_repro(tmp_path / "all.repro")).module_name == "second"
    with nantrace.trace(m, capture=["first"]) as tr:  # the module literally named `first`
        m(torch.full((1, 2), 100.0, dtype=torch.float16))
    assert tr.options["capture"] == ["first"]
    ov = tr.first_overflow()
    assert ov is not None and ov.module == "second"
    with pytest.raises(nantrace.NantraceError) as e:
        ov.save_repro(tmp_path / "x.repro")
    assert str(e.value) == (
        "save_repro: this Overflow is a forward overflow in `second` (call 0, `output`) at step 0, but the "
        "captured call is `first` call 0 at step 0 (its forward never produced a non-finite value; kept because "
        "its step recorded one): a reproducer of it would not be this event. To save the captured call anyway "
        "use trace.save_repro(path) (the Trace's method); trace again with capture='second' to capture this "
        "module's call."
    )
    with nantrace.trace(m, capture="first") as tr:
        m(torch.ones(1, 2, dtype=torch.float16))  # healthy
    with nantrace.trace(m, capture=["first"]) as tr2:
        m(torch.ones(1, 2, dtype=torch.float16))
    with pytest.raises(nantrace.NantraceError) as e:
        tr2.save_repro(tmp_path / "x.repro")
    assert str(e.value) == (
        "save_repro: capture= watched `first`, which never produced a non-finite value in a forward call, and "
        "no step recorded one while it was watched, so nothing was kept."
    )
    with pytest.raises(
        nantrace.NantraceError, match=r"capture='first' watched every traced module and no forward"
    ):
        tr.save_repro(tmp_path / "x.repro")
    assert os.listdir(tmp_path) == ["all.repro"]


def test_error_messages_name_the_root_and_the_other_file_kind(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with pytest.raises(ValueError) as e:
        nantrace.trace(FirstSecond(), capture="nope")
    assert str(e.value).endswith("traced ('' is the root model), e.g. ['', 'first', 'second']")
    main_cls = type("NotebookNet", (nn.Module,), {"forward": Boom.forward, "__module__": "__main__"})
    root = main_cls()
    with nantrace.trace(root, capture="first") as tr:
        root(torch.full((2,), 100.0, dtype=torch.float16))
    with pytest.raises(
        nantrace.NantraceError, match=r"^save_repro: the root model uses class __main__\.NotebookNet"
    ):
        tr.save_repro(tmp_path / "x.repro")

    monkeypatch.setenv("HOME", str(tmp_path))  # Path.expanduser reads HOME
    m = FirstSecond().half()
    with nantrace.trace(m, capture="first") as tr:
        m(torch.full((1, 2), 100.0, dtype=torch.float16))
    assert tr.first_overflow().save_repro("~/s.repro") == tmp_path / "s.repro"  # type: ignore[union-attr]
    assert tr.save("~/t.nantrace") == tmp_path / "t.nantrace"
    assert nantrace.load_repro("~/s.repro").module_name == "second"
    assert nantrace.load("~/t.nantrace").first_overflow() == tr.first_overflow()

    with pytest.raises(nantrace.NantraceError) as e:
        nantrace.load_repro(tmp_path / "t.nantrace")
    assert str(e.value).startswith(
        f"{str(tmp_path / 't.nantrace')!r} is a nantrace trace (a parquet file), not a reproducer: read it with "
        "nantrace.load(path)."
    )
    with pytest.raises(nantrace.NantraceError) as e:
        nantrace.load(tmp_path / "s.repro")
    assert str(e.value) == (
        f"{str(tmp_path / 's.repro')!r} is a nantrace reproducer (written by save_repro), not a trace: rebuild it "
        "with nantrace.load_repro(path)"
    )
    (tmp_path / "notes.txt").write_text("hello\n")
    with pytest.raises(nantrace.NantraceError) as e:
        nantrace.load_repro(tmp_path / "notes.txt")
    assert str(e.value).startswith(
        f"{str(tmp_path / 'notes.txt')!r} is not a nantrace reproducer (not a torch.save file)"
    )


def test_hunt_hint_of_a_captured_call_says_to_hunt_it_not_to_trace_again(tmp_path: Path) -> None:
    """C02's residual add (hand-written `block`): with the call already captured, the explanation points to the
    capture instead of asking for another traced run; without a capture it asks for one."""

    def c02() -> nn.Module:
        m = C02Model()
        with torch.no_grad():
            m.block.fc.weight.copy_(torch.eye(8))
            m.block.fc.bias.zero_()
        return m.half()

    x = torch.full((2, 8), 40000.0, dtype=torch.float16)
    m = c02()
    # without the forward replay (which names the op and its line, and then gives no hunt hint at all)
    with nantrace.trace(m, capture="block", drill=False) as tr:
        m(x)
    ov = tr.first_overflow()
    assert ov is not None and (ov.phase, ov.module, ov.kind) == ("forward", "block", "inf")
    assert "; this trace captured that call, so hunt it in isolation: ov.save_repro(path), then " in str(ov)
    assert "trace again with capture=" not in str(ov)
    culprit = nantrace.hunt(nantrace.load_repro(ov.save_repro(tmp_path / "block.repro")).run)
    assert culprit is not None and (culprit.op, culprit.module) == ("aten::add.Tensor", "block")

    m = c02()
    with nantrace.trace(m, drill=False) as plain:
        m(x)
    assert '; or trace again with capture="block" and hunt the saved call: ' in str(plain.first_overflow())
    m = c02()
    with nantrace.trace(m) as named:
        m(x)
    text = str(named.first_overflow())
    assert "produced +inf in `add` at " in text and "nantrace.hunt" not in text


class SecondCallBoom(nn.Module):
    """Counts its calls; on the second one its output is multiplied by 1e39 (beyond float32's 3.4e38)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls, self.mode = 0, {"scale": 1e39}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return x * self.mode["scale"] if self.calls == 2 else x


def test_a_reproducer_keeps_the_python_attributes_the_call_started_with(tmp_path: Path) -> None:
    """The reproducer is saved after a third call moved the counter on: it rebuilds the module with the counter
    as the captured call saw it (1 before it ran), so its run overflows again (it was pickled with the counter at
    save time, 3, and stayed finite). The user's counter is 3, the real calls: the drill-down's replay of the
    overflowing call set it back (it was 4)."""
    m = nn.Sequential(SecondCallBoom())
    with nantrace.trace(m, capture="first") as tr:
        for _ in range(3):
            m(torch.ones(2, 2))
    assert m[0].calls == 3
    ov = tr.first_overflow()
    assert ov is not None and (ov.step, ov.module) == (1, "0")
    repro = nantrace.load_repro(ov.save_repro(tmp_path / "count.repro"))
    assert repro.module.calls == 1 and repro.module.mode == {"scale": 1e39}
    assert torch.isinf(repro.run()).all()
    assert repro.module.calls == 2 and m[0].calls == 3
