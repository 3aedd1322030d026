"""nantrace.hunt: the first aten op that made a non-finite value, its module, phase and source line."""

from __future__ import annotations

import inspect
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from _models_hunt import (
    Boom,
    CheckpointNet,
    CosineSimilarity,
    ExpGate,
    FnNet,
    GateNet,
    HandLayerNorm,
    Healthy,
    NormNet,
    SimNet,
    SqrtGate,
    SqrtNet,
    ZeroDivGrad,
    line_of,
    t5_model,
)
from test_cases import T5FF, AttnModel, HandAttention, RMSNorm
from torch import nn
from torch.nn.modules import module as nn_module

import nantrace

MODELS_FILE = inspect.getsourcefile(HandLayerNorm)


def _src(obj: object, text: str) -> str:
    return f"{inspect.getsourcefile(obj).rsplit('/', 1)[-1]}:{line_of(obj, text)}"  # type: ignore[union-attr]


def _no_hunt_left() -> None:
    assert len(nn_module._global_forward_pre_hooks) == 0
    assert len(nn_module._global_forward_hooks) == 0
    assert torch._C._len_torch_dispatch_stack() == 0
    assert not torch._C._is_torch_function_mode_enabled()


def test_hand_layernorm_variance_overflow_is_internal_and_named_with_its_line() -> None:
    m = NormNet().half()
    x = torch.tensor([[300.0, -300.0, 1.0, 2.0]], dtype=torch.float16)
    out = m(x)
    assert torch.isfinite(out).all() and out.abs().max().item() == 0.0  # finite zeros: nothing to see
    with nantrace.trace(m) as tr:
        m(x)
    # module boundaries show nothing, but the input beyond the cube root of 65504 (40.3) makes the drill-down
    # replay the call and name the transient inf that rsqrt turned into zeros (issue 17 kind 3)
    ov = tr.first_overflow()
    assert ov is not None and (ov.phase, ov.module, ov.tensor, ov.kind) == (
        "forward",
        "norm",
        "output",
        "inf",
    )
    line = f"{MODELS_FILE}:{line_of(HandLayerNorm.forward, '** 2')}"
    assert tr.ops[["module", "op", "kind", "source", "reaches"]].values.tolist() == [
        ["norm", "pow", "posinf", line, True]
    ]
    c = nantrace.hunt(m, x)
    assert c is not None
    assert (c.op, c.module, c.module_type, c.phase, c.kind, c.value) == (
        "aten::pow.Tensor_Scalar",
        "norm",
        "HandLayerNorm",
        "forward",
        "inf",
        "posinf",
    )
    assert c.dtype == "float16" and c.dtype == torch.float16
    assert c.source == _src(HandLayerNorm.forward, "** 2")
    assert c.filename == MODELS_FILE and c.lineno == line_of(HandLayerNorm.forward, "** 2")
    assert c.code == "var = ((x - mean) ** 2).mean(-1, keepdim=True)"
    # inputs of the pow: x - mean with mean 0.75: 299.25, -300.75, 0.25, 1.25
    assert (c.input_absmax, c.input_absmin) == (300.75, 0.25)
    assert c.internal is True and c.output_kinds == frozenset()
    assert "internal: output was finite" in str(c)
    assert f"at {c.source}: `{c.code}`" in str(c)
    _no_hunt_left()


def test_cosine_similarity_product_sum_overflows_and_returns_zero() -> None:
    m = SimNet().half()
    a = torch.full((1, 4), 200.0, dtype=torch.float16)
    b = torch.full((1, 4), 0.01, dtype=torch.float16)
    assert m(a, b).tolist() == [0.0]  # cos(a, b) is 1; |a|^2 = 160000 overflowed
    c = nantrace.hunt(m, a, b)
    assert c is not None
    assert (c.op, c.module, c.module_type, c.phase, c.kind) == (
        "aten::sum.dim_IntList",
        "sim",
        "CosineSimilarity",
        "forward",
        "inf",
    )
    assert c.source == _src(CosineSimilarity.forward, "na = ")
    assert (c.input_absmax, c.input_absmin) == (40000.0, 40000.0)  # a * a
    assert c.internal is True and c.output_kinds == frozenset()


def _gate_step(m: nn.Module, x: torch.Tensor) -> None:
    m(x).sum().backward()


def test_where_exp_first_culprit_is_the_discarded_exp_and_nan_is_its_backward() -> None:
    x = torch.tensor([[1.0, 2.0, 100.0, 3.0]], dtype=torch.float16)
    where_line = _src(ExpGate.forward, "torch.where")
    m = GateNet().half()
    c = nantrace.hunt(_gate_step, m, x)
    assert c is not None
    assert (c.op, c.module, c.phase, c.kind, c.source) == ("aten::exp", "gate", "forward", "inf", where_line)
    assert c.internal is True and c.output_kinds == frozenset()  # hidden by where
    assert m.fc.weight.grad is not None and torch.isnan(m.fc.weight.grad).any()  # the step ran to the end
    m.zero_grad()
    nan = nantrace.hunt(_gate_step, m, x, kind="nan")
    assert nan is not None
    assert (nan.op, nan.module, nan.module_type, nan.phase, nan.kind, nan.value) == (
        "aten::mul.Tensor",
        "gate",
        "ExpGate",
        "backward",
        "nan",
        "nan",
    )
    assert nan.source == where_line and nan.lineno == line_of(ExpGate.forward, "torch.where")
    assert nan.internal is None
    assert str(nan).startswith(
        f"aten::mul.Tensor in the backward of `gate` (ExpGate), for the forward line {where_line}"
    )
    assert nantrace.hunt(_gate_step, m, x, kind="inf") == c
    _no_hunt_left()


def test_t5_wo_linear_is_addmm_called_from_the_feed_forward_line() -> None:
    m = t5_model()
    x = torch.full((2, 16), 1100.0, dtype=torch.float16)
    c = nantrace.hunt(m, x)
    assert c is not None
    assert (c.op, c.module, c.module_type, c.phase, c.kind) == (
        "aten::addmm",
        "ff.wo",
        "Linear",
        "forward",
        "inf",
    )
    assert c.source == _src(T5FF.forward, "self.wo(")  # nn.Linear's own code is torch's: the caller's line
    assert c.internal is False and c.output_kinds == frozenset({"posinf"})
    assert c.input_absmax == 1100.0
    nan = nantrace.hunt(m, x, kind="nan")
    assert nan is not None
    assert (nan.op, nan.module, nan.phase, nan.source) == (
        "aten::mul.Tensor",
        "norm",
        "forward",
        _src(RMSNorm.forward, "torch.rsqrt"),
    )  # inf * rsqrt(inf) = inf * 0


def _healthy_params(hunt_first: bool) -> tuple[nantrace.Culprit | None, list[torch.Tensor], torch.Tensor]:
    torch.manual_seed(0)
    m = Healthy()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    x, y = torch.randn(8, 4), torch.randn(8, 4)

    def step() -> None:
        opt.zero_grad()
        F.mse_loss(m(x), y).backward()
        opt.step()

    found = nantrace.hunt(step) if hunt_first else step()
    step()
    return found, [p.detach().clone() for p in m.parameters()], torch.get_rng_state()


def test_healthy_training_step_returns_none_and_changes_no_value() -> None:
    found, hunted, rng_hunted = _healthy_params(True)
    _, plain, rng_plain = _healthy_params(False)
    assert found is None
    # a hunted step followed by a plain one ends exactly where two plain steps do
    assert all(torch.equal(a, b) for a, b in zip(hunted, plain, strict=True))
    assert torch.equal(rng_hunted, rng_plain)
    _no_hunt_left()


def test_optimizer_step_and_loss_outside_the_model_have_no_module() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4).half())
    opt = torch.optim.Adam(model.parameters(), lr=1e-3, eps=1e-8)  # CASES C07: eps rounds to 0 in fp16
    x = torch.full((2, 4), 1e-3, dtype=torch.float16)

    def step() -> None:
        opt.zero_grad()
        (model(x).sum() * 1e-3).backward()
        opt.step()  # the optimizer line

    c = nantrace.hunt(step)
    assert c is not None
    assert (c.phase, c.module, c.module_type, c.kind, c.value) == ("optimizer", None, None, "inf", "neginf")
    assert c.op == "aten::addcdiv_" and c.code == "opt.step()  # the optimizer line"
    assert "outside any module, optimizer" in str(c)

    lin = nn.Linear(4, 3)
    with torch.no_grad():
        lin.weight.zero_()
        lin.bias.copy_(torch.tensor([0.0, 30.0, 0.0]))

    def loss_step() -> None:  # CASES C08: log(softmax) underflows to log(0) in fp16
        with torch.autocast("cpu", dtype=torch.float16):
            p = torch.softmax(lin(torch.ones(2, 4)), -1)[:, 0]
            loss = -torch.log(p).mean()
        loss.backward()

    c = nantrace.hunt(loss_step)
    assert c is not None
    assert (c.op, c.phase, c.module, c.value, c.dtype) == ("aten::log", "forward", None, "neginf", "float16")
    assert c.code == "loss = -torch.log(p).mean()"
    assert (c.input_absmax, math.isnan(c.input_absmin)) == (0.0, True)  # the probability underflowed to 0


class _MaskedSoftmax(nn.Module):
    def forward(self, s: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        s = s.masked_fill(~keep, float("-inf"))  # an intended -inf: a scalar argument
        e = torch.exp(s - s.amax(-1, keepdim=True))
        return e / e.sum(-1, keepdim=True)


def test_minus_inf_mask_from_a_scalar_is_not_a_culprit_but_a_fully_masked_row_is() -> None:
    m = _MaskedSoftmax()
    s = torch.randn(2, 3)
    keep = torch.tensor([[True, True, False], [True, False, True]])
    assert nantrace.hunt(m, s, keep) is None
    keep[1] = False  # row 1 fully masked: -inf - (-inf) = NaN
    c = nantrace.hunt(m, s, keep)
    assert c is not None
    assert (c.op, c.module, c.kind, c.code) == (
        "aten::sub.Tensor",
        "",
        "nan",
        "e = torch.exp(s - s.amax(-1, keepdim=True))",
    )
    assert "in the root model (_MaskedSoftmax)" in str(c)


class _Scale(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.mul_(1000.0)  # in place: its input was finite before the op


def test_in_place_op_is_judged_on_its_inputs_before_it_ran() -> None:
    x = torch.full((3,), 100.0, dtype=torch.float16)
    c = nantrace.hunt(_Scale(), x)
    assert c is not None
    assert (c.op, c.module, c.kind, c.input_absmax) == ("aten::mul_.Tensor", "", "inf", 100.0)
    assert torch.isinf(x).all()  # the user's op ran as written


def test_module_called_outside_the_first_tree_is_named_by_its_class() -> None:
    lin = nn.Linear(2, 2)
    with torch.no_grad():
        lin.weight.copy_(torch.eye(2))
        lin.bias.zero_()
    norm = HandLayerNorm(2)

    def step() -> None:
        h = lin(torch.tensor([[300.0, -300.0]]))  # the first module called: the root ""
        norm(h.half())  # not in lin's tree

    c = nantrace.hunt(step)
    assert c is not None and (c.module, c.op) == ("<HandLayerNorm>", "aten::pow.Tensor_Scalar")


def test_an_exception_in_fn_propagates_and_removes_every_mode_and_hook() -> None:
    def boom() -> None:
        nn.Linear(2, 2)(torch.ones(2))
        raise KeyError("from the step")

    with pytest.raises(KeyError, match="from the step"):
        nantrace.hunt(boom)
    _no_hunt_left()


def test_bad_arguments_are_refused() -> None:
    with pytest.raises(TypeError, match="fn must be a callable"):
        nantrace.hunt(3)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="kind must be None, 'inf' or 'nan'; got 'posinf'"):
        nantrace.hunt(lambda: None, kind="posinf")
    _no_hunt_left()


def test_culprit_to_dict_holds_every_field() -> None:
    c = nantrace.hunt(SimNet().half(), torch.full((1, 4), 200.0).half(), torch.ones(1, 4).half())
    assert c is not None
    d = c.to_dict()
    assert list(d) == [
        "op",
        "module",
        "module_type",
        "phase",
        "kind",
        "value",
        "dtype",
        "source",
        "filename",
        "lineno",
        "code",
        "input_absmax",
        "input_absmin",
        "internal",
        "output_kinds",
        "ops_checked",
        "source_role",
        "input_kinds",
    ]
    assert (d["op"], d["dtype"], d["output_kinds"], d["internal"]) == (
        "aten::sum.dim_IntList",
        "float16",
        [],
        True,
    )


# ------------------------------------------------------------------ the locator points to the hunt
def test_locator_suggests_hunt_for_hand_written_containers_and_internal_overflows() -> None:
    m = t5_model()
    with nantrace.trace(m) as tr:
        m(torch.full((2, 16), 1100.0, dtype=torch.float16))
    assert "nantrace.hunt" not in str(
        tr.first_overflow()
    )  # `ff.wo`, a Linear that output its inf: the answer

    class Wrap(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.sm = _MaskedSoftmax()

        def forward(self, s: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
            return self.sm(s, keep)

    w = Wrap()
    with nantrace.trace(w) as tr:
        w(torch.randn(2, 3), torch.tensor([[True, False, True], [False, False, False]]))
    nan = str(tr.first_overflow(kind="nan"))
    line = inspect.getsourcelines(_MaskedSoftmax.forward)[1] + 2  # e = torch.exp(s - s.amax(...))
    # the replay named the op and its line: no hint to hunt for what is already said
    assert (
        f"produced NaN in `sub` at {inspect.getsourcefile(_MaskedSoftmax)}:{line} inside its forward" in nan
    )
    assert "nantrace.hunt" not in nan
    with nantrace.trace(w, drill=False) as tr:  # without the replay, hunt is the way to the op
        w(torch.randn(2, 3), torch.tensor([[True, False, True], [False, False, False]]))
    nan = str(tr.first_overflow(kind="nan"))
    assert (
        'nantrace.hunt(step_fn) (kind="nan" for the op that made the NaN itself)' in nan
        and "`sm` is hand-written code (_MaskedSoftmax)" in nan
    )

    a = AttnModel(64)
    with torch.no_grad():
        for lin in (a.attn.q, a.attn.k, a.attn.v):
            lin.weight.copy_(torch.eye(64))
    a = a.half()
    with nantrace.trace(a) as tr:
        a(torch.full((1, 4, 64), 40.0, dtype=torch.float16))
    msg = str(tr.first_overflow())  # the matmul's inf left `attn` as NaN: internal, its op and line named
    line = (
        inspect.getsourcelines(HandAttention.forward)[1] + 1
    )  # scores = self.q(x) @ self.k(x).transpose(...)
    assert (
        f"produced +inf in `matmul` at {inspect.getsourcefile(HandAttention)}:{line} inside its forward"
        in msg
    )
    assert "nantrace.hunt" not in msg and "To name the exact op" not in msg  # nothing left for hunt to name
    with nantrace.trace(a, drill=False) as tr:  # without the replay nothing names it: hunt is the way
        a(torch.full((1, 4, 64), 40.0, dtype=torch.float16))
    msg = str(tr.first_overflow())
    assert "nantrace.hunt(step_fn)" in msg and 'capture="attn"' in msg

    g = GateNet().half()
    with nantrace.trace(g) as tr:
        g(torch.tensor([[1.0, 2.0, 100.0, 3.0]], dtype=torch.float16)).sum().backward()
    ov = tr.first_overflow()
    assert ov is not None and (ov.phase, ov.module) == ("backward", "gate")
    assert "it names the backward op and the forward line it belongs to" in str(ov)


def test_gradient_accumulation_overflow_is_the_parameters_owner() -> None:
    model = nn.Sequential(nn.Linear(1, 1, bias=False)).half()
    x = torch.full((1, 1), 40000.0, dtype=torch.float16)
    model(x).sum().backward()  # weight.grad = 40000
    c = nantrace.hunt(lambda: model(x).sum().backward())  # accumulates 40000 + 40000 = inf
    assert c is not None
    assert (c.op, c.module, c.module_type, c.phase, c.kind) == (
        "aten::add_.Tensor",
        "0",
        "Linear",
        "backward",
        "inf",
    )
    assert c.input_absmax == 40000.0
    # the line that called backward(): the lambda above (CPU: the engine runs on the calling thread)
    here = inspect.getsourcelines(test_gradient_accumulation_overflow_is_the_parameters_owner)
    call_line = here[1] + next(i for i, t in enumerate(here[0]) if "c = nantrace.hunt(lambda" in t)
    assert (c.source, c.source_role) == (f"test_hunt.py:{call_line}", "backward_call")
    assert "accumulating into a parameter's .grad in the backward() at test_hunt.py:" in str(c)
    assert torch.isposinf(model[0].weight.grad).all()


# ------------------------------------------------------------------ fresh-user findings
def test_every_empty_family_overload_is_skipped() -> None:
    def buf() -> torch.Tensor:
        a = torch.full((4096,), float("nan"))
        del a  # its memory may come back from torch.empty below
        b = torch.empty(4096)  # aten::empty.memory_format
        b.copy_(torch.ones(4096))
        return b.sum()

    assert nantrace.hunt(buf) is None
    ones = torch.ones(8)
    others = [
        lambda: torch.empty_like(ones).fill_(1.0),  # aten::empty_like
        lambda: ones.new_empty(8).fill_(1.0),  # aten::new_empty
        lambda: torch.empty_strided((8,), (1,)).fill_(1.0),  # aten::empty_strided
    ]
    assert [nantrace.hunt(f) for f in others] == [None, None, None]
    from nantrace._hunt import uninitialised

    assert [
        uninitialised(n) for n in ("aten::empty.memory_format", "aten::new_empty_strided", "aten::emptyish")
    ] == [
        True,
        True,
        False,
    ]


def test_custom_function_backward_names_the_forward_module_and_the_backward_line() -> None:
    torch.manual_seed(0)
    n = FnNet()
    c = nantrace.hunt(lambda: n(torch.randn(2, 4)).sum().backward())
    assert c is not None
    assert (c.op, c.module, c.module_type, c.phase, c.kind, c.value) == (
        "aten::div.Tensor",
        "f",
        "FnMod",
        "backward",
        "inf",
        "posinf",
    )
    assert c.source == _src(ZeroDivGrad.backward, "g / (x - x)") and c.source_role == "python_backward"
    assert c.code == "return g / (x - x)"
    assert f"in the backward of `f` (FnMod), run by the Python backward at {c.source}" in str(c)
    _no_hunt_left()


@pytest.mark.parametrize("reentrant", [False, True])
def test_checkpointed_backward_keeps_module_and_line(reentrant: bool) -> None:
    m = CheckpointNet(reentrant)
    x = torch.tensor([[-1.0, 0.0, 1.0, 2.0]], requires_grad=True)  # relu gives 0 at two entries
    c = nantrace.hunt(lambda: m(x).sum().backward(), kind="nan")
    assert c is not None
    assert (c.op, c.module, c.module_type, c.phase, c.kind, c.source, c.source_role) == (
        "aten::div.Tensor",
        "g",
        "SqrtGate",
        "backward",
        "nan",
        _src(SqrtGate.forward, "torch.where"),
        "forward",
    )
    _no_hunt_left()


def test_a_parameter_free_module_called_before_the_model_does_not_become_the_root() -> None:
    m = NormNet().half()
    x = torch.tensor([[300.0, -300.0, 1.0, 2.0]], dtype=torch.float16)
    with nantrace.trace(m) as tr:
        m(x)
    traced = set(tr.records["module"].astype(str))
    pre = nn.Identity()
    c = nantrace.hunt(lambda: m(pre(x)))
    assert c is not None and (c.module, c.op) == ("norm", "aten::pow.Tensor_Scalar")
    assert c.module in traced  # the same name as nantrace.trace(m)
    boom = Boom()
    c = nantrace.hunt(lambda: m(boom(torch.full((1, 4), 100.0, dtype=torch.float16))))
    assert c is not None and (c.module, c.module_type, c.op) == ("<Boom>", "Boom", "aten::mul.Tensor")
    # no module with parameters at all: the first one called is the root, as for hunt(module, x)
    c = nantrace.hunt(lambda: SimNet().half()(torch.full((1, 4), 200.0).half(), torch.ones(1, 4).half()))
    assert c is not None and c.module == "sim"


def test_generators_coroutines_and_call_results_are_refused() -> None:
    def gen() -> object:
        yield torch.ones(1) * 2

    async def coro() -> None:
        return None

    with pytest.raises(
        TypeError, match=r"fn 'test_generators.*gen' is a generator function: calling it only"
    ):
        nantrace.hunt(gen)
    with pytest.raises(TypeError, match=r"is a coroutine \(async\) function"):
        nantrace.hunt(coro)
    with pytest.raises(TypeError, match=r"got Tensor: .*usually the result of a call, hunt\(step\(x\)\)"):
        nantrace.hunt(torch.ones(1))  # type: ignore[arg-type]
    _no_hunt_left()


def test_inf_over_inf_says_the_inputs_held_inf() -> None:
    inf = torch.full((2,), float("inf"))
    c = nantrace.hunt(lambda: inf / inf)
    assert c is not None and (c.op, c.value, c.input_kinds) == (
        "aten::div.Tensor",
        "nan",
        frozenset({"posinf"}),
    )
    assert "made NaN (float32) from inputs holding no NaN but +inf (finite input absmax n/a" in str(c)


class Linear(nn.Module):
    """A hand-written class that happens to be named like torch's."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.full((2,), 1000.0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.w


class MyLinear(nn.Linear):
    pass


def test_hunt_hint_judges_built_in_by_where_forward_is_defined(tmp_path: Path) -> None:
    mine = MyLinear(2, 2).half()
    with torch.no_grad():
        mine.weight.fill_(1000.0)
        mine.bias.zero_()
    for layer, hinted in ((mine, False), (Linear().half(), True)):
        m = nn.Sequential(layer)
        with nantrace.trace(m, drill=False) as tr:  # no replay names the op: the hint is judged by the class
            m(torch.full((1, 2), 100.0, dtype=torch.float16))
        ov = tr.first_overflow()
        assert ov is not None and (ov.module, ov.phase) == ("0", "forward")
        assert ("nantrace.hunt" in str(ov)) is hinted, str(ov)
        if hinted:
            assert "`0` is hand-written code (Linear)" in str(ov)
        # the trace file keeps which modules run torch's own forward: the loaded trace words it the same way
        back = nantrace.load(tr.save(tmp_path / "t.nantrace"))
        assert str(back.first_overflow()) == str(ov)


def test_backward_nan_is_explained_as_an_invalid_operation_not_an_overflow() -> None:
    for dtype in (torch.float32, torch.float16):
        m = SqrtNet().to(dtype)
        with nantrace.trace(m) as tr:
            m(torch.tensor([[0.0, 1.0, 4.0, 9.0]], dtype=dtype)).sum().backward()
        ov = tr.first_overflow()
        assert ov is not None and (ov.phase, ov.module, ov.kind, ov.tensor) == (
            "backward",
            "g",
            "nan",
            "grad_input[0]",
        )
        msg = str(ov)
        name = str(dtype).removeprefix("torch.")
        assert msg.splitlines()[0] == (
            "step 0 backward: the backward of `g` (SqrtGate) made NaN by an invalid operation: 0·inf, inf − inf or "
            f"0/0 in a derivative ({name})"
        )
        assert " ".join(msg.splitlines()[1:]).startswith(
            "At step 0, the backward of `g` (SqrtGate) turned finite incoming gradients (grad_output absmax 1) "
            f"into NaN in `grad_input[0]` ({name}): an invalid operation in its backward (0·inf, inf−inf, 0/0, "
            "sqrt/log of a negative). Not an overflow"
        ), msg
        assert "float32 or" not in msg and "overflows above" not in msg
        assert tr.diagnose().cause == "invalid_op"


def test_float32_forward_overflow_does_not_advise_float32() -> None:
    lin = nn.Linear(2, 2)
    with torch.no_grad():
        lin.weight.fill_(1e30)
        lin.bias.zero_()
    m = nn.Sequential(lin)
    with nantrace.trace(m) as tr:
        m(torch.full((1, 2), 1e10))
    msg = str(tr.first_overflow())
    assert "float32 overflows above 3.403e+38" in msg and "Keep `0` in float32" not in msg
    assert "Values beyond the float32 range mean a computation that blows up" in msg


class _DivByZero(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x / torch.zeros_like(x)


def test_an_op_making_inf_and_nan_at_once_is_reported_as_inf_on_the_root_model() -> None:
    # [1, 0] / 0 = [+inf, NaN] in one op: the culprit's value is +inf (NaN follows from inf, never the reverse)
    c = nantrace.hunt(_DivByZero(), torch.tensor([1.0, 0.0], dtype=torch.float16))
    assert c is not None
    assert (c.op, c.module, c.kind, c.value) == ("aten::div.Tensor", "", "inf", "posinf")
    assert str(c).startswith("aten::div.Tensor in the root model (_DivByZero), forward, at test_hunt.py:")


class _ExpTimesZero(nn.Module):
    """``exp(x) · (x − x)``: inf · 0 = NaN from finite inputs past 88.7 (float32's exp limit)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.exp(x) * (x - x)


class _NanWritten(nn.Module):
    """A NaN written as a constant: no op computes it."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = x * 2
        out[0, 0] = float("nan")
        return out


def test_a_forward_nan_with_no_op_named_says_why_from_the_trace_options() -> None:
    """Without the replay (``drill=False``) the advice says that is why no op is named and how to name it; it
    no longer sends the user looking for a NaN written as a constant. With the replay, a NaN written as a constant
    names no op and the advice says to look for one; the replay names `exp` for the same module that drill=False
    could not see into."""

    def nan_of(module: nn.Module, drill: bool) -> str:
        m = nn.Sequential(nn.Linear(3, 3), module)
        with torch.no_grad():
            m[0].weight.copy_(torch.eye(3) * 100)
            m[0].bias.zero_()
        with nantrace.trace(m, drill=drill) as tr, torch.no_grad():
            m(torch.ones(2, 3))
        return str(tr.diagnose())

    blind = nan_of(_ExpTimesZero(), drill=False)
    assert (
        "No op is named because the trace ran with drill=False, so no forward call was replayed; trace again "
        "with the default drill=True, whose replay names the op." in blind
    )
    assert "look for one of those if no op is named" not in blind
    assert "the forward replay names the op: `exp`" in nan_of(_ExpTimesZero(), drill=True)
    written = nan_of(_NanWritten(), drill=True)
    assert (
        "it names none for a NaN written as a constant" in written and "No op is named because" not in written
    )


class _SqrtAtZero(nn.Module):
    """``sqrt(x − x) + x``: finite forward; the derivative of sqrt at 0 is inf, times d(x − x) = 0 gives NaN."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x - x).sqrt() + x


def test_a_backward_nan_from_a_kept_derivative_says_whether_the_forward_could_be_replayed() -> None:
    """The backward NaN of a derivative at a value the forward kept: with the drill-down the evidence says the
    forward is replayed only when its statistics point to a value; with ``drill=False`` it says no forward call
    was replayed (the other wording would be false there), in the diagnosis and in the explanation."""

    def texts(drill: bool) -> tuple[str, str]:
        m = nn.Sequential(nn.Linear(3, 3), _SqrtAtZero())
        with nantrace.trace(m, drill=drill) as tr:
            m(torch.ones(2, 3)).sum().backward()
        ov = tr.first_overflow()
        assert ov is not None and (ov.phase, ov.module, ov.kind) == ("backward", "1", "nan")
        return str(tr.diagnose()), str(ov)

    on, off = texts(True), texts(False)
    replayed = (
        "the forward discarded (the forward is replayed only when its recorded statistics point to one)"
    )
    blind = "the forward discarded (the trace ran with drill=False, so no forward call was replayed)"
    assert all(replayed in t and blind not in t for t in on)
    assert all(blind in t and replayed not in t for t in off)


class _TimesConstant(nn.Module):
    """``(x − x) · c`` with ``c`` a Python number: 0·inf = NaN when ``c`` is ±inf."""

    def __init__(self, c: float) -> None:
        super().__init__()
        self.c = c

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x - x) * self.c


def test_nan_from_an_inf_written_in_the_code_is_advised_as_such() -> None:
    """A NaN from ``0 · inf`` where the inf is a Python number in the code: no inf was made anywhere to be
    found, so the advice is to use the dtype's largest finite value, or ``torch.where``; an inf that a tensor
    operand held keeps the advice to find where it was made. (A ``-inf`` number is a mask value by DESIGN's
    rule: its NaN is mask arithmetic, with the advice to apply the mask with ``masked_fill``.)"""

    def diagnosis(c: float, held: bool) -> str:
        class HeldInf(nn.Module):
            def forward(self, x: torch.Tensor) -> torch.Tensor:
                return (x - x) * torch.full_like(x, c)

        m = nn.Sequential(nn.Linear(3, 3), HeldInf() if held else _TimesConstant(c))
        with nantrace.trace(m) as tr, torch.no_grad():
            m(torch.ones(2, 3))
        return str(tr.diagnose())

    written = diagnosis(math.inf, held=False)
    assert (
        "In `1`: `mul` is given an inf written in the code (a Python number), and 0·inf is NaN: use a large finite "
        "value (`torch.finfo(dtype).max`, `.min` for -inf) or select with `torch.where` instead of computing "
        "with inf." in written
    )
    assert "find where that inf was made" not in written
    held = diagnosis(math.inf, held=True)
    assert "written in the code" not in held and "find where that inf was made" in held
    mask = diagnosis(-math.inf, held=False)
    assert "mask arithmetic" in mask and "written in the code" not in mask
