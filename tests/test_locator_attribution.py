"""Issue 18 items 4 and 6: a gradient made by a module's own code in backward is attributed to the gradient it
made; light steps (``every=N``) name the producing op and keep the facts of its call, as full steps do."""

from __future__ import annotations

import torch
from torch import nn

import nantrace


def _where(ov: nantrace.Overflow | None) -> tuple | None:
    if ov is None:
        return None
    return (ov.step, ov.micro_step, ov.phase, ov.module, ov.call, ov.tensor, ov.kind)


class ZeroTimesInf(torch.autograd.Function):
    """Identity in forward; its backward returns ``grad · 0 · inf``, NaN from a finite gradient on every torch."""

    @staticmethod
    def forward(ctx: object, x: torch.Tensor) -> torch.Tensor:
        return x * 1.0

    @staticmethod
    def backward(ctx: object, g: torch.Tensor) -> torch.Tensor:
        return g * 0.0 * torch.tensor(float("inf"), dtype=g.dtype)


class Pair(nn.Module):
    """``b(ZeroTimesInf(a(x)))``: the custom Function is this module's own code, between its children."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(ZeroTimesInf.apply(self.a(x)))


class Outer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.pre = nn.Linear(4, 4)
        self.enc = Pair()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.enc(self.pre(x))


def _one_step(m: nn.Module) -> nantrace.Trace:
    with nantrace.trace(m) as tr:
        m(torch.ones(2, 4, dtype=torch.float16)).float().sum().backward()
    return tr


def test_custom_function_in_the_roots_forward_names_the_gradient_it_made() -> None:
    """The root's grad_output[0] is finite (all ones); the NaN first appears at `a`'s grad_output, made by the
    root's own code (the custom Function) in backward: module '' with tensor `a.grad_output[0]`."""
    torch.manual_seed(0)
    tr = _one_step(Pair().half())
    rec = tr.records
    root_gout = rec[(rec["module"] == "") & (rec["tensor"] == "grad_output[0]")]
    assert int(root_gout["n_nan"].sum()) == 0 and float(root_gout["absmax"].iloc[0]) == 1.0
    ov = tr.first_overflow()
    assert _where(ov) == (0, 0, "backward", "", 0, "a.grad_output[0]", "nan")
    assert ov is not None and ov.module_type == "Pair"
    assert "into NaN in `a.grad_output[0]` (float16)" in str(ov)


def test_custom_function_in_a_submodules_forward_names_its_childs_gradient() -> None:
    """The same code inside `enc` (not the root): `enc` made it, in `a.grad_output[0]` (path relative to `enc`)."""
    torch.manual_seed(0)
    ov = _one_step(Outer().half()).first_overflow()
    assert _where(ov) == (0, 0, "backward", "enc", 0, "a.grad_output[0]", "nan")
    assert ov is not None and ov.module_type == "Pair"


class Scores(nn.Module):
    """Hand-written attention scores and softmax: ``q @ kᵀ`` of entries 300·8·0.125 = 300 over 8 dims gives
    8·300² = 720000 > 65504, +inf inside the call; the softmax turns it into NaN (inf − inf) at the output."""

    def __init__(self) -> None:
        super().__init__()
        self.q = nn.Linear(8, 8, bias=False)
        self.k = nn.Linear(8, 8, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = self.q(x) @ self.k(x).transpose(-1, -2)
        a = a - a.amax(-1, keepdim=True)
        return a.exp() / a.exp().sum(-1, keepdim=True)


def _scores_run(every: int) -> nantrace.Trace:
    m = Scores().half()
    with torch.no_grad():
        m.q.weight.fill_(0.125)
        m.k.weight.fill_(0.125)
    with nantrace.trace(m, every=every) as tr:
        for value in (1.0, 300.0):  # step 0 clean, step 1 overflows (a light step when every=2)
            m(torch.full((1, 3, 8), value, dtype=torch.float16))
    return tr


def test_light_step_names_the_op_and_its_inputs_as_a_full_step_does() -> None:
    full, light = _scores_run(1), _scores_run(2)
    ov_full, ov_light = full.first_overflow(), light.first_overflow()
    assert _where(ov_light) == (1, 0, "forward", "", 0, "output", "inf")
    assert _where(ov_light) == _where(ov_full)
    assert light.ops[["step", "module", "call", "op", "kind"]].values.tolist() == [
        [1, "", 0, "matmul", "posinf"]
    ]
    # the light step kept the producing call's (clean) input row, so the words are those of the full step
    rec = light.records
    ins = rec[(rec["step"] == 1) & (rec["tensor"] == "input[0]")]
    assert ins[["phase", "module", "absmax", "n_posinf"]].values.tolist() == [["data", "", 300.0, 0]]
    code = Scores.forward.__code__
    line = f"{code.co_filename}:{code.co_firstlineno + 1}"
    assert (
        f"produced +inf in `matmul` at {line} inside its forward (float16), from finite inputs (input absmax 300)"
        in str(ov_light)
    )
    assert str(ov_light) == str(ov_full)
