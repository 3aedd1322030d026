"""Robustness: tracing never breaks the user's loop, never slows it to a crawl and never changes its numbers.

One tiny model per situation, each asserting the exact records nantrace must produce (or, for the
"never changes training" tests, bit-identical losses, gradients, parameters, buffers and RNG state).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import gc
import math
import os
import random
import time
import types
import warnings
import weakref
from collections import OrderedDict, namedtuple
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pandas as pd
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

import nantrace

# ------------------------------------------------------------------------------------------------ helpers


def keys(tr: nantrace.Trace, phase: str | None = None, **eq: Any) -> list[tuple]:
    """``(phase, module, call, tensor)`` of the records in ``seq`` order, optionally filtered."""
    df = tr.records
    if phase is not None:
        df = df[df["phase"].astype(str) == phase]
    for col, v in eq.items():
        df = df[df[col].astype(type(v)) == v]
    df = df.sort_values(["step", "micro_step", "seq"])
    return [
        (str(p), str(mo), int(c), str(t)) for p, mo, c, t in df[["phase", "module", "call", "tensor"]].values
    ]


def row(tr: nantrace.Trace, phase: str, module: str, tensor: str, call: int = 0, step: int = 0) -> pd.Series:
    df = tr.records
    sel = df[
        (df["phase"].astype(str) == phase)
        & (df["module"].astype(str) == module)
        & (df["tensor"].astype(str) == tensor)
        & (df["call"] == call)
        & (df["step"] == step)
    ]
    assert len(sel) == 1, f"expected one {phase}/{module}/{tensor}/call {call}, got {len(sel)}"
    return sel.iloc[0]


def minmax(tr: nantrace.Trace, phase: str, module: str, tensor: str, call: int = 0, step: int = 0) -> tuple:
    r = row(tr, phase, module, tensor, call, step)
    return (float(r["min"]), float(r["max"]))


def hook_state(
    model: nn.Module, optimizer: torch.optim.Optimizer | None = None, scaler: Any = None
) -> dict[str, Any]:
    """Every place a hook could be left behind, as comparable counts."""
    state: dict[str, Any] = {}
    for name, m in model.named_modules():
        for attr in (
            "_forward_hooks",
            "_forward_pre_hooks",
            "_backward_hooks",
            "_backward_pre_hooks",
            "_forward_hooks_with_kwargs",
            "_forward_pre_hooks_with_kwargs",
            "_forward_hooks_always_called",
            "_state_dict_hooks",
            "_load_state_dict_pre_hooks",
        ):
            state[f"{name}:{attr}"] = len(getattr(m, attr, None) or {})
    for name, p in model.named_parameters(remove_duplicate=False):
        state[f"{name}:post_acc"] = len(p._post_accumulate_grad_hooks or {})
        state[f"{name}:tensor_hooks"] = len(p._backward_hooks or {})
    mod = torch.nn.modules.module
    state["global"] = tuple(
        len(getattr(mod, a, None) or {})
        for a in (
            "_global_forward_hooks",
            "_global_forward_pre_hooks",
            "_global_backward_hooks",
            "_global_backward_pre_hooks",
            "_global_forward_hooks_always_called",
        )
    )
    if optimizer is not None:
        state["opt"] = (
            len(optimizer._optimizer_step_pre_hooks),
            len(optimizer._optimizer_step_post_hooks),
            len(getattr(optimizer, "_optimizer_state_dict_pre_hooks", {})),
            sorted(vars(optimizer)),
        )
    if scaler is not None:
        state["scaler"] = sorted(k for k in vars(scaler) if callable(vars(scaler)[k]))
    return state


def set_linear(lin: nn.Linear, weight: list, bias: list | None = None) -> nn.Linear:
    with torch.no_grad():
        lin.weight.copy_(torch.tensor(weight, dtype=lin.weight.dtype))
        if lin.bias is not None:
            lin.bias.copy_(torch.tensor(bias if bias is not None else [0.0] * lin.out_features))
    return lin


def grads(model: nn.Module) -> dict[str, torch.Tensor | None]:
    return {n: (None if p.grad is None else p.grad.clone()) for n, p in model.named_parameters()}


def assert_bit_identical(a: Any, b: Any, what: str = "") -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor), what
        assert a.dtype == b.dtype and a.shape == b.shape, what
        torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True, msg=lambda m: f"{what}: {m}")
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), what
        for k in a:
            assert_bit_identical(a[k], b[k], f"{what}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), what
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_bit_identical(x, y, f"{what}[{i}]")
    elif isinstance(a, float) and a != a:
        assert b != b, what
    else:
        assert a == b, what


# ------------------------------------------------------------------------------------------------ in-place


class InplaceAfter(nn.Module):
    """In-place ops on children's outputs: in the parent's forward and by ReLU(inplace=True)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = set_linear(nn.Linear(2, 2), [[1.0, 0.0], [0.0, 1.0]])
        self.act = nn.ReLU(inplace=True)
        self.fc2 = set_linear(nn.Linear(2, 1), [[1.0, 1.0]])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        h.mul_(2.0)  # the parent's own in-place op on fc's output
        y = self.fc2(self.act(h))  # ReLU(inplace=True) mutates its input
        y.add_(1.0)
        return y


def test_inplace_ops_after_modules_record_the_value_each_module_saw() -> None:
    x = torch.tensor([[1.0, -2.0], [-3.0, 4.0]])
    ref = InplaceAfter()
    ref_out = ref(x)
    ref_out.sum().backward()
    m = InplaceAfter()
    opt = torch.optim.SGD(m.parameters(), lr=0.0)
    with nantrace.trace(m, optimizer=opt) as tr:
        out = m(x)
        out.sum().backward()
        opt.step()
    assert_bit_identical(out, ref_out, "output")
    assert_bit_identical(grads(m), grads(ref), "grads")
    assert keys(tr, "forward") == [
        ("forward", "fc", 0, "input[0]"),
        ("forward", "fc", 0, "output"),
        ("forward", "act", 0, "input[0]"),
        ("forward", "act", 0, "output"),
        ("forward", "fc2", 0, "input[0]"),
        ("forward", "fc2", 0, "output"),
        ("forward", "", 0, "output"),
    ]
    # each module's output as it returned it, each input as the module received it
    assert minmax(tr, "forward", "fc", "output") == (-3.0, 4.0)
    assert minmax(tr, "forward", "act", "input[0]") == (-6.0, 8.0)
    assert minmax(tr, "forward", "act", "output") == (0.0, 8.0)
    assert row(tr, "forward", "act", "output")["n_zero"] == 2
    assert minmax(tr, "forward", "fc2", "input[0]") == (0.0, 8.0)
    assert minmax(tr, "forward", "fc2", "output") == (2.0, 8.0)
    assert minmax(tr, "forward", "", "output") == (3.0, 9.0)
    # gradients: each hook sees the gradient of the value it was registered on
    assert minmax(tr, "backward", "fc2", "grad_output[0]") == (1.0, 1.0)
    assert minmax(tr, "backward", "fc2", "grad_input[0]") == (1.0, 1.0)
    assert minmax(tr, "backward", "act", "grad_output[0]") == (1.0, 1.0)
    assert minmax(tr, "backward", "act", "grad_input[0]") == (0.0, 1.0)
    assert row(tr, "backward", "act", "grad_input[0]")["n_zero"] == 2
    assert minmax(tr, "backward", "fc", "grad_output[0]") == (0.0, 2.0)  # before the parent's *2
    assert minmax(tr, "backward", "fc", "weight.grad") == (-6.0, 8.0)
    assert minmax(tr, "backward", "fc2", "weight.grad") == (2.0, 8.0)
    assert tr.first_overflow() is None


# ------------------------------------------------------------------------------------------------ reuse


class Reuse(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = set_linear(nn.Linear(1, 1, bias=False), [[2.0]])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for _ in range(3):
            x = self.fc(x)
        return x


def test_module_reused_within_a_forward_gets_call_indices_per_micro_step() -> None:
    m = Reuse()
    opt = torch.optim.SGD(m.parameters(), lr=0.0)
    with nantrace.trace(m, optimizer=opt) as tr:
        for _ in range(2):  # gradient accumulation: two micro-steps, one optimizer step
            m(torch.tensor([[1.0]])).sum().backward()
        opt.step()
    r = tr.records
    for micro in (0, 1):
        fwd = r[(r["phase"].astype(str) == "forward") & (r["module"].astype(str) == "fc")]
        fwd = fwd[fwd["micro_step"] == micro].sort_values("seq")
        got = [
            (int(c), str(t), float(v)) for c, t, v in zip(fwd["call"], fwd["tensor"], fwd["max"], strict=True)
        ]
        assert got == [
            (0, "input[0]", 1.0),
            (0, "output", 2.0),
            (1, "input[0]", 2.0),
            (1, "output", 4.0),
            (2, "input[0]", 4.0),
            (2, "output", 8.0),
        ]
        bwd = r[(r["phase"].astype(str) == "backward") & (r["micro_step"] == micro)]
        got_b = {
            (int(c), str(t)): float(v)
            for c, t, v in zip(bwd["call"], bwd["tensor"], bwd["max"], strict=True)
            if str(t) != "weight.grad"
        }
        # y = 8x; grad arriving at call 2's output is 1, at call 1's output 2, at call 0's output 4
        assert got_b == {
            (2, "grad_output[0]"): 1.0,
            (1, "grad_output[0]"): 2.0,
            (0, "grad_output[0]"): 4.0,
            (2, "grad_input[0]"): 2.0,
            (1, "grad_input[0]"): 4.0,
        }  # call 0's input is the data, which needs no gradient
        wg = bwd[bwd["tensor"].astype(str) == "weight.grad"]
        # d(w^3 x)/dw = 3 w^2 x = 12 per micro-step, accumulated over micro-steps
        assert wg["call"].tolist() == [0] and wg["max"].tolist() == [12.0 * (micro + 1)]
    assert tr.steps["micro_steps"].tolist() == [2]


# ------------------------------------------------------------------------------------------------ kwargs


class KwInner(nn.Module):
    def forward(
        self, *, h: torch.Tensor, scale: float = 1.0, mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        out = h * scale
        return out if mask is None else out + mask


class KwOnly(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = set_linear(nn.Linear(2, 2, bias=False), [[1.0, 0.0], [0.0, 1.0]])
        self.inner = KwInner()

    def forward(self, *, x: torch.Tensor, attention_mask: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
        return self.inner(h=self.fc(input=x), scale=scale, mask=attention_mask)


def test_modules_taking_kwargs_only() -> None:
    m = KwOnly()
    x = torch.tensor([[1.0, 2.0]])
    mask = torch.tensor([[0.0, float("-inf")]])
    with nantrace.trace(m) as tr:
        out = m(x=x, attention_mask=mask, scale=3.0)
        out[:, :1].sum().backward()
    assert keys(tr) == [
        ("data", "", 0, "input.x"),
        ("data", "", 0, "input.attention_mask"),
        ("forward", "fc", 0, "input.input"),
        ("forward", "fc", 0, "output"),
        ("forward", "inner", 0, "input.h"),
        ("forward", "inner", 0, "input.mask"),
        ("forward", "inner", 0, "output"),
        ("forward", "", 0, "output"),
        ("backward", "inner", 0, "grad_output[0]"),
        ("loss", "", 0, "grad_output[0]"),
        ("backward", "fc", 0, "grad_output[0]"),
        ("backward", "inner", 0, "grad_input.h"),
        ("backward", "fc", 0, "weight.grad"),
    ]
    r = tr.records
    inputs = r[r["tensor"].astype(str).str.startswith("input")]
    assert inputs["arg"].astype(str).tolist() == ["x", "attention_mask", "input", "h", "mask"]
    assert minmax(tr, "forward", "inner", "output") == (3.0, 3.0)
    assert row(tr, "forward", "inner", "output")["n_neginf"] == 1
    assert minmax(tr, "backward", "inner", "grad_input.h") == (0.0, 3.0)


def test_attention_mask_passed_on_through_kwargs_is_not_an_overflow() -> None:
    m = KwOnly()
    with nantrace.trace(m) as tr:
        m(x=torch.tensor([[1.0, 2.0]]), attention_mask=torch.tensor([[0.0, float("-inf")]]))
    assert row(tr, "forward", "inner", "output")["n_neginf"] == 1
    assert tr.first_overflow() is None


# ------------------------------------------------------------------------------------------------ outputs


@dataclasses.dataclass
class DC:
    a: torch.Tensor
    n: int = 3
    s: str = "x"


NT = namedtuple("NT", ["p", "q"])


@dataclasses.dataclass
class CausalLMOutput(OrderedDict):
    """Shaped like transformers' ``ModelOutput``: a dataclass and an OrderedDict of the non-None fields."""

    loss: torch.Tensor | None = None
    logits: torch.Tensor | None = None
    hidden_states: tuple[torch.Tensor, ...] | None = None

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if v is not None:
                self[f.name] = v


class ReturnsNone(nn.Module):
    def forward(self, x: torch.Tensor) -> None:
        return None


class ReturnsInt(nn.Module):
    def forward(self, x: torch.Tensor) -> int:
        return 5


class ReturnsStr(nn.Module):
    def forward(self, x: torch.Tensor) -> str:
        return "hello"


class ReturnsTuple(nn.Module):
    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, int, torch.Tensor]:
        return x + 1, 7, x + 2


class ReturnsNested(nn.Module):
    def forward(self, x: torch.Tensor) -> dict[Any, Any]:
        return {
            "nested": {"y": x * 2, "none": None, "i": 3, "s": "str"},
            "list": [x * 3, [x * 4, None]],
            "dc": DC(x * 5),
            "nt": NT(x * 6, "q"),
            "odd key": x * 7,
            0: x * 8,
        }


class OutputsModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.none = ReturnsNone()
        self.int = ReturnsInt()
        self.str = ReturnsStr()
        self.tup = ReturnsTuple()
        self.nested = ReturnsNested()

    def forward(self, x: torch.Tensor) -> CausalLMOutput:
        assert self.none(x) is None and self.int(x) == 5 and self.str(x) == "hello"
        a, _, b = self.tup(x)
        d = self.nested(a)
        total = (
            d["nested"]["y"]
            + d["list"][1][0]
            + d["dc"].a
            + d["nt"].p
            + d["odd key"]
            + d[0]
            + b
            + d["list"][0]
        )
        return CausalLMOutput(logits=total, hidden_states=(a, b))


def test_outputs_of_every_shape_are_flattened_with_paths() -> None:
    m = OutputsModel()
    x = torch.ones(1, 2, requires_grad=True)
    with nantrace.trace(m) as tr:
        out = m(x)
        assert isinstance(out, CausalLMOutput) and list(out.keys()) == ["logits", "hidden_states"]
        assert out.logits is not None
        out.logits.sum().backward()
    fwd = [k for k in keys(tr, "forward") if k[3] != "input[0]"]
    assert fwd == [
        ("forward", "tup", 0, "output[0]"),
        ("forward", "tup", 0, "output[2]"),
        ("forward", "nested", 0, "output.nested.y"),
        ("forward", "nested", 0, "output.list[0]"),
        ("forward", "nested", 0, "output.list[1][0]"),
        ("forward", "nested", 0, "output.dc.a"),
        ("forward", "nested", 0, "output.nt.p"),
        ("forward", "nested", 0, "output['odd key']"),
        ("forward", "nested", 0, "output[0]"),
        ("forward", "", 0, "output.logits"),
        ("forward", "", 0, "output.hidden_states[0]"),
        ("forward", "", 0, "output.hidden_states[1]"),
    ]
    # modules returning None / int / str: their input is recorded, no output row, no crash
    for name in ("none", "int", "str"):
        assert keys(tr, "forward", module=name) == [("forward", name, 0, "input[0]")]
    # values: a = 2, b = 3; logits = a*(2+4+5+6+7+8+3) + b = 70 + 3
    assert minmax(tr, "forward", "nested", "output.nt.p") == (12.0, 12.0)
    assert minmax(tr, "forward", "", "output.logits") == (73.0, 73.0)
    # gradients arrive at the nested outputs under the same paths
    bwd = {k[3] for k in keys(tr, "backward", module="nested")}
    assert bwd == {
        "grad_output.nested.y",
        "grad_output.list[0]",
        "grad_output.list[1][0]",
        "grad_output.dc.a",
        "grad_output.nt.p",
        "grad_output['odd key']",
        "grad_output[0]",
        "grad_input[0]",
    }
    # the gradient arriving at each model output (hidden_states also feed logits, so they get one too)
    assert sorted(keys(tr, "loss")) == [
        ("loss", "", 0, "grad_output.hidden_states[0]"),
        ("loss", "", 0, "grad_output.hidden_states[1]"),
        ("loss", "", 0, "grad_output.logits"),
    ]
    assert minmax(tr, "backward", "nested", "grad_input[0]") == (35.0, 35.0)
    assert x.grad is not None and x.grad.tolist() == [[36.0, 36.0]]


# ------------------------------------------------------------------------------------------------ dtypes


class MixedDtypes(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(4, 2, sparse=True)
        self.cplx = nn.Identity()
        self.sparse = nn.Identity()
        self.empty = nn.Identity()
        self.flags = nn.Identity()
        with torch.no_grad():
            self.emb.weight.copy_(torch.arange(8.0).reshape(4, 2))

    def forward(
        self, ids: torch.Tensor, flag: torch.Tensor, z: torch.Tensor, x: torch.Tensor, e: torch.Tensor
    ) -> torch.Tensor:
        emb = self.emb(ids)
        c = self.cplx(z * 2)
        s = self.sparse(x.to_sparse())
        em = self.empty(e * 2)
        f = self.flags(~flag)
        return emb.sum() + c.real.sum() + s.to_dense().sum() + em.sum() + f.sum() + x.sum()


def test_integer_bool_complex_sparse_and_empty_tensors_are_skipped() -> None:
    m = MixedDtypes()
    opt = torch.optim.SGD(m.parameters(), lr=1.0)
    ids = torch.tensor([1, 3])
    flag = torch.tensor([True, False])
    z = torch.tensor([1 + 2j, 3 - 1j])
    x = torch.tensor([[1.0, 0.0], [0.0, -2.0]], requires_grad=True)
    e = torch.zeros(0, 3)
    with nantrace.trace(m, optimizer=opt) as tr:
        loss = m(ids, flag, z, x, e)
        loss.backward()
        opt.step()
    # emb 2+3+6+7, complex 2*(1+3), sparse -1, empty 0, ~flag 1, x -1
    assert float(loss.detach()) == 25.0
    assert keys(tr, "data") + keys(tr, "forward") + keys(tr, "loss") + keys(tr, "optimizer") == [
        ("data", "", 0, "input[3]"),
        ("forward", "emb", 0, "output"),
        ("forward", "", 0, "output"),
        ("loss", "", 0, "grad_output[0]"),
        ("optimizer", "emb", 0, "weight"),
    ]
    assert sorted(keys(tr, "backward")) == [
        ("backward", "", 0, "grad_input[3]"),
        ("backward", "emb", 0, "grad_output[0]"),
    ]
    assert minmax(tr, "forward", "emb", "output") == (2.0, 7.0)
    assert minmax(tr, "optimizer", "emb", "weight") == (0.0, 6.0)
    # d loss/dx = 1 (x.sum()) + 1 where x is non-zero (to_sparse keeps only those)
    assert minmax(tr, "backward", "", "grad_input[3]") == (1.0, 2.0)
    assert m.emb.weight.grad is not None and m.emb.weight.grad.is_sparse
    assert tr.steps["n_nonfinite"].tolist() == [0]


# ------------------------------------------------------------------------------------------------ channels_last


class ConvNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(self.bn(self.conv(x)))


def test_channels_last_conv_records_true_values_and_keeps_memory_format() -> None:
    torch.manual_seed(0)
    ref = ConvNet().to(memory_format=torch.channels_last)  # type: ignore[call-overload]
    m = copy.deepcopy(ref)
    x = torch.randn(2, 3, 5, 5).to(memory_format=torch.channels_last)
    seen: dict[str, torch.Tensor] = {}
    ref.conv.register_forward_hook(lambda mod, a, o: seen.__setitem__("conv", o.detach().clone()))
    out_ref = ref(x)
    out_ref.sum().backward()
    with nantrace.trace(m) as tr:
        out = m(x)
        assert out.is_contiguous(memory_format=torch.channels_last)
        out.sum().backward()
    assert_bit_identical(out, out_ref, "output")
    assert_bit_identical(grads(m), grads(ref), "grads")
    c = seen["conv"]
    r = row(tr, "forward", "conv", "output")
    assert (float(r["min"]), float(r["max"])) == (float(c.min()), float(c.max()))
    assert float(r["absmin"]) == float(c.abs()[c != 0].min())
    assert str(r["shape"]) == "(2, 4, 5, 5)"
    g = ref.conv.weight.grad
    assert g is not None
    assert minmax(tr, "backward", "conv", "weight.grad") == (float(g.min()), float(g.max()))


# ------------------------------------------------------------------------------------------------ tied


class Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(4, 3)
        self.body = nn.Linear(3, 3)
        self.head = nn.Linear(3, 4)
        self.head.weight = self.emb.weight  # tied parameter
        self.body_again = self.body  # the same module under a second name

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.body_again(self.body(self.emb(ids))))


def test_shared_parameters_and_modules_are_recorded_once_under_the_first_name() -> None:
    torch.manual_seed(0)
    ref = Tied()
    m = copy.deepcopy(ref)
    ids = torch.tensor([0, 2, 3])
    ref(ids).pow(2).sum().backward()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    with nantrace.trace(m, optimizer=opt) as tr:
        m(ids).pow(2).sum().backward()
        opt.step()
    assert [k for k in keys(tr) if k[0] in ("optimizer",) or k[3].endswith(".grad")] == [
        ("backward", "head", 0, "bias.grad"),
        ("backward", "body", 0, "bias.grad"),
        ("backward", "body", 0, "weight.grad"),
        ("backward", "emb", 0, "weight.grad"),
        ("optimizer", "emb", 0, "weight"),
        ("optimizer", "body", 0, "weight"),
        ("optimizer", "body", 0, "bias"),
        ("optimizer", "head", 0, "bias"),
    ]
    modules = set(tr.records["module"].astype(str))
    assert modules == {"", "emb", "body", "head"}  # never "body_again"
    assert sorted({int(c) for c in tr.records.query("module == 'body' and phase == 'forward'")["call"]}) == [
        0,
        1,
    ]
    g = ref.emb.weight.grad  # the accumulated gradient of both uses
    assert g is not None
    assert minmax(tr, "backward", "emb", "weight.grad") == (float(g.min()), float(g.max()))
    n_params = len(list(m.parameters()))
    assert n_params == 4  # emb.weight (= head.weight), body.weight, body.bias, head.bias
    assert (tr.records["phase"].astype(str) == "optimizer").sum() == n_params


# ------------------------------------------------------------------------------------------------ checkpointing


class CkptBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(2, 2)
        self.b = nn.Linear(2, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(x)))


class CkptModel(nn.Module):
    def __init__(self, reentrant: bool | None) -> None:
        super().__init__()
        self.blk = CkptBlock()
        self.head = nn.Linear(2, 1)
        self.reentrant = reentrant

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.reentrant is None:
            return self.head(self.blk(x))
        return self.head(checkpoint(self.blk, x, use_reentrant=self.reentrant))


def _ckpt_run(reentrant: bool | None, traced: bool) -> tuple[nn.Module, nantrace.Trace | None]:
    torch.manual_seed(0)
    m = CkptModel(reentrant)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    x = torch.randn(3, 2, requires_grad=True)
    tr = nantrace.trace(m, optimizer=opt) if traced else None
    with tr if tr is not None else contextlib.nullcontext():
        for _ in range(2):
            m(x).sum().backward()
            opt.step()
            opt.zero_grad()
    return m, tr


@pytest.mark.parametrize("reentrant", [True, False])
def test_checkpointing_is_not_broken_by_tracing(reentrant: bool) -> None:
    plain, _ = _ckpt_run(reentrant, traced=False)
    traced, tr = _ckpt_run(reentrant, traced=True)
    assert tr is not None
    assert_bit_identical(dict(traced.state_dict()), dict(plain.state_dict()), "params")
    # every parameter's gradient is recorded once per step, under its real owner
    for step in (0, 1):
        got = sorted(k[1:] for k in keys(tr, "backward", step=step) if k[3].endswith(".grad"))
        assert got == sorted(
            (mod, 0, f"{p}.grad") for mod in ("blk.a", "blk.b", "head") for p in ("bias", "weight")
        )


@pytest.mark.parametrize(
    "reentrant",
    [
        pytest.param(
            True,
        ),
        pytest.param(
            False,
        ),
    ],
)
def test_checkpoint_recompute_is_not_double_counted(reentrant: bool) -> None:
    _, tr = _ckpt_run(None, traced=True)  # the same model without checkpointing
    _, tr_ck = _ckpt_run(reentrant, traced=True)
    assert tr is not None and tr_ck is not None
    r = tr_ck.records
    if "recompute" in r.columns:  # clearly marked recomputation is fine, as long as it is not a forward call
        r = r[~r["recompute"].astype(bool)]
    r = r[r["phase"].astype(str) == "forward"].sort_values(["step", "micro_step", "seq"])
    fwd_ck = [
        (str(a), str(b), int(c), str(d)) for a, b, c, d in r[["phase", "module", "call", "tensor"]].values
    ]
    assert fwd_ck == keys(tr, "forward")
    assert set(r["call"].tolist()) == {0}


# ------------------------------------------------------------------------------------------------ torch.compile


class Small(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(3, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x).relu()


def _small_steps(m: nn.Module, call: Any, n: int, traced: bool) -> tuple[nantrace.Trace | None, float]:
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    x = torch.linspace(-1, 1, 15).reshape(5, 3)
    tr = nantrace.trace(call, optimizer=opt) if traced else None
    first = 0.0
    with tr if tr is not None else contextlib.nullcontext():
        for i in range(n):
            t0 = time.perf_counter()
            loss = call(x).sum()
            loss.backward()
            if tr is not None:
                tr.step(loss=loss)  # an optimizer without a GradScaler: the loop hands nantrace its loss
            opt.step()
            opt.zero_grad()
            if i == 0:
                first = time.perf_counter() - t0
    return tr, first


@pytest.fixture(scope="module")
def compiled_run() -> Iterator[dict[str, Any]]:
    import torch._dynamo

    torch._dynamo.reset()
    torch.manual_seed(0)
    base = Small()
    # untraced compile, for the overhead comparison
    plain = copy.deepcopy(base)
    _, plain_first = _small_steps(plain, torch.compile(plain, backend="eager"), 1, traced=False)
    torch._dynamo.reset()
    ref = copy.deepcopy(base)
    ref_tr, _ = _small_steps(ref, ref, 2, traced=True)
    m = copy.deepcopy(base)
    cm = torch.compile(m, backend="eager")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        tr, traced_first = _small_steps(m, cm, 2, traced=True)
    torch._dynamo.reset()
    yield {
        "ref": ref_tr,
        "tr": tr,
        "ref_model": ref,
        "model": m,
        "compiled": cm,
        "warnings": [w for w in caught if "nantrace" in str(w.filename) or "nantrace" in str(w.message)],
        "plain_first": plain_first,
        "traced_first": traced_first,
    }


def test_compiled_model_traces_with_names_without_orig_mod(compiled_run: dict[str, Any]) -> None:
    tr, ref = compiled_run["tr"], compiled_run["ref"]
    assert type(compiled_run["compiled"]).__name__ == "OptimizedModule"
    modules = set(tr.records["module"].astype(str))
    assert not any("_orig_mod" in n for n in modules)
    if compiled_run["warnings"]:  # fell back: exactly one clear warning naming torch.compile
        assert len(compiled_run["warnings"]) == 1
        assert "compile" in str(compiled_run["warnings"][0].message)
    else:  # traced: the same records as the uncompiled model
        assert modules == {"", "fc"}
        cols = ["step", "phase", "module", "call", "tensor", "min", "max", "n_zero"]
        pd.testing.assert_frame_equal(
            tr.records[cols].astype(str).reset_index(drop=True),
            ref.records[cols].astype(str).reset_index(drop=True),
        )
    assert_bit_identical(
        dict(compiled_run["model"].state_dict()), dict(compiled_run["ref_model"].state_dict()), "params"
    )


def test_compiled_model_first_step_is_not_a_crawl(compiled_run: dict[str, Any]) -> None:
    assert compiled_run["traced_first"] < 4 * compiled_run["plain_first"] + 1.0


# ------------------------------------------------------------------------------------------------ DDP


def test_ddp_single_process_names_without_module_prefix(tmp_path: Any) -> None:
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("gloo is not available")
    store = dist.FileStore(os.fspath(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        inner = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))
        ref = copy.deepcopy(inner)
        ddp = nn.parallel.DistributedDataParallel(inner)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
        ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
        x = torch.linspace(-1, 1, 15).reshape(5, 3)
        with nantrace.trace(ddp, optimizer=opt) as tr:
            for _ in range(2):
                ddp(x).sum().backward()
                opt.step()
                opt.zero_grad()
        for _ in range(2):
            ref(x).sum().backward()
            ref_opt.step()
            ref_opt.zero_grad()
        assert set(tr.records["module"].astype(str)) == {"", "0", "1", "2"}
        assert str(row(tr, "data", "", "input[0]")["module_type"]) == "Sequential"
        assert keys(tr, "optimizer", step=1) == [
            ("optimizer", "0", 0, "weight"),
            ("optimizer", "0", 0, "bias"),
            ("optimizer", "2", 0, "weight"),
            ("optimizer", "2", 0, "bias"),
        ]
        assert len(tr.steps) == 2
        assert_bit_identical(dict(inner.state_dict()), dict(ref.state_dict()), "params")
        last = ref[2]
        assert isinstance(last, nn.Linear)
        w = last.weight.detach()
        assert minmax(tr, "optimizer", "2", "weight", step=1) == (float(w.min()), float(w.max()))
    finally:
        dist.destroy_process_group()


# ------------------------------------------------------------------------------------------------ several traces


def test_two_models_traced_at_once() -> None:
    a = nn.Sequential(set_linear(nn.Linear(1, 1), [[2.0]]))
    b = nn.Sequential(set_linear(nn.Linear(1, 1), [[3.0]]), nn.ReLU())
    opt_a = torch.optim.SGD(a.parameters(), lr=0.0)
    with nantrace.trace(a, optimizer=opt_a) as tra, nantrace.trace(b) as trb:
        for _ in range(2):
            a(torch.ones(1, 1)).sum().backward()
            b(torch.ones(1, 1))
            b(torch.ones(1, 1))
        opt_a.step()
    assert len(tra.steps) == 1 and tra.steps["micro_steps"].tolist() == [2]
    assert len(trb.steps) == 4  # no optimizer: every root forward is a step
    assert set(tra.records["module"].astype(str)) == {"", "0"}
    assert set(trb.records["module"].astype(str)) == {"", "0", "1"}
    assert tra.records.query("module == '0' and tensor == 'output'")["max"].tolist() == [2.0, 2.0]
    assert trb.records.query("module == '0' and tensor == 'output'")["max"].tolist() == [3.0] * 4
    assert (tra.records["phase"].astype(str) == "optimizer").sum() == 2


def test_nested_trace_of_the_same_model_is_refused_and_the_outer_keeps_working() -> None:
    m = nn.Sequential(nn.Linear(2, 2))
    with nantrace.trace(m) as outer:
        m(torch.ones(1, 2))
        inner = nantrace.trace(m)
        with pytest.raises(nantrace.NantraceError, match="already being traced"), inner:
            pass
        m(torch.ones(1, 2))
    assert len(outer.steps) == 2
    assert keys(outer, step=1) == keys(outer, step=0)
    # and after exit the model can be traced again
    with nantrace.trace(m) as again:
        m(torch.ones(1, 2))
    assert len(again.steps) == 1


# ------------------------------------------------------------------------------------------------ exceptions


class Boom(Exception):
    pass


class MaybeFail(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = set_linear(nn.Linear(1, 1), [[2.0]])
        self.bad = nn.Linear(1, 1)
        self.fail: BaseException | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        if self.fail is not None:
            raise self.fail
        return self.bad(h)


def _exception_case(kind: str) -> None:
    m = MaybeFail()
    opt = torch.optim.SGD(m.parameters(), lr=0.0)
    scaler = torch.amp.GradScaler("cpu")
    err: BaseException = KeyboardInterrupt() if kind == "keyboard" else Boom(kind)
    before = hook_state(m, opt, scaler)
    armed: list[bool] = []

    def fail(*args: Any) -> None:
        if armed:
            raise err

    user_handles: list[Any] = []
    if kind == "backward":  # raised by the autograd engine while nantrace's gradient hooks are live
        user_handles.append(m.fc.weight.register_hook(fail))
    if kind == "user_hook":
        user_handles.append(m.bad.register_forward_hook(fail))
    if kind == "optimizer":
        user_handles.append(opt.register_step_pre_hook(fail))
    captured: list[torch.Tensor] = []
    with pytest.raises(BaseException) as info, nantrace.trace(m, scaler=scaler, optimizer=opt) as tr:
        # step 0 completes
        scaler.scale(m(torch.ones(1, 1)).sum()).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        # step 1 fails somewhere
        armed.append(True)
        if kind == "forward":
            m.fail = err
        out = m(torch.ones(1, 1))
        captured.append(out)
        scaler.scale(out.sum()).backward()
        scaler.step(opt)
        if kind == "keyboard":
            raise err
        scaler.update()
    assert info.value is err
    for h in user_handles:
        h.remove()
    assert hook_state(m, opt, scaler) == before
    for t in captured:
        assert not t._backward_hooks
    # the recording up to the failure is readable
    assert len(tr.steps) == 2
    assert tr.steps["step"].tolist() == [0, 1]
    r1 = keys(tr, step=1)
    assert r1[:3] == [
        ("data", "", 0, "input[0]"),
        ("forward", "fc", 0, "input[0]"),
        ("forward", "fc", 0, "output"),
    ]
    assert (
        minmax(tr, "forward", "fc", "output", step=1)
        == minmax(tr, "forward", "fc", "output", step=0)
        == (2.0, 2.0)
    )
    expect_bad_output = kind != "forward"  # a failing user hook runs after bad's forward returned
    assert (("forward", "bad", 0, "output") in r1) == expect_bad_output
    assert tr.first_overflow() is None
    repr(tr)
    # and the model trains normally afterwards, untraced and traced again
    m.fail = None
    m(torch.ones(1, 1)).sum().backward()
    opt.step()
    with nantrace.trace(m) as again:
        m(torch.ones(1, 1))
    assert keys(again, "forward", module="fc") == [
        ("forward", "fc", 0, "input[0]"),
        ("forward", "fc", 0, "output"),
    ]


@pytest.mark.parametrize("kind", ["forward", "backward", "optimizer", "user_hook", "keyboard"])
def test_exceptions_propagate_unchanged_and_every_hook_is_removed(kind: str) -> None:
    _exception_case(kind)


def test_exception_in_a_user_modules_filter_propagates_unchanged() -> None:
    err = Boom("filter")
    m = nn.Sequential(nn.Linear(1, 1))

    def bad_filter(name: str, mod: nn.Module) -> bool:
        raise err

    before = hook_state(m)
    with pytest.raises(Boom) as info:
        nantrace.trace(m, modules=bad_filter)
    assert info.value is err
    assert hook_state(m) == before


# ------------------------------------------------------------------------------------------------ bit-identical


class DropoutMLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.drop = nn.Dropout(0.3)
        self.fc2 = nn.Linear(16, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.drop(F.gelu(self.fc1(x))))


class BNNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(2, 4, 3)
        self.bn = nn.BatchNorm2d(4)
        self.drop = nn.Dropout2d(0.2)
        self.head = nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.drop(F.relu(self.bn(self.conv(x))))
        return self.head(h.mean((2, 3)))


class OverflowWithDropout(nn.Module):
    """Makes +inf in float16 in its own forward, after dropout and a random op, so the locator's forward
    replay (which must not advance the RNG stream) runs."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.drop = nn.Dropout(0.5)
        self.fc2 = nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.drop(self.fc(x))
        return self.fc2(h * 7e4 + torch.rand_like(h))


def _train(
    factory: Callable[[], nn.Module],
    make_x: Callable[[int], torch.Tensor],
    traced: bool,
    *,
    amp: bool = False,
    half: bool = False,
    steps: int = 3,
) -> dict[str, Any]:
    torch.manual_seed(1234)
    m = factory()
    if half:
        m = m.half()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**20, growth_interval=1) if amp else None
    losses: list[torch.Tensor] = []
    all_grads: list[dict[str, Any]] = []
    tr = nantrace.trace(m, optimizer=opt, scaler=scaler) if traced else None
    with tr if tr is not None else contextlib.nullcontext():
        for i in range(steps):
            x = make_x(i)
            with torch.autocast("cpu", dtype=torch.float16, enabled=amp):
                out = m(x)
                loss = out.float().pow(2).mean()
            losses.append(loss.detach().clone())
            if scaler is not None:
                scaler.scale(loss).backward()
                scaler.unscale_(opt)
                torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
                all_grads.append(grads(m))
                scaler.step(opt)
                scaler.update()
            else:
                loss.backward()
                all_grads.append(grads(m))
                opt.step()
            opt.zero_grad(set_to_none=True)
    result = {
        "losses": losses,
        "grads": all_grads,
        "state": {k: v.clone() for k, v in m.state_dict().items()},
        "opt": copy.deepcopy(opt.state_dict()["state"]),
        "rng": torch.get_rng_state(),
        "scaler": None if scaler is None else scaler.state_dict(),
        "trace": tr,
    }
    return result


_BIT_CASES: dict[str, tuple[Callable[[], nn.Module], Callable[[int], torch.Tensor], dict[str, bool]]] = {
    "dropout": (DropoutMLP, lambda i: torch.randn(6, 8), {}),
    "batchnorm": (BNNet, lambda i: torch.randn(3, 2, 5, 5), {}),
    "amp_fp16_scaler": (DropoutMLP, lambda i: torch.randn(6, 8) * (1 + 100 * i), {"amp": True}),
    "fp16_overflow_replay": (
        OverflowWithDropout,
        lambda i: torch.randn(5, 4, dtype=torch.float16),
        {"half": True},
    ),
}


@pytest.mark.parametrize("case", list(_BIT_CASES))
def test_bit_identical_training_with_and_without_tracing(case: str) -> None:
    factory, make_x, kw = _BIT_CASES[case]
    plain = _train(factory, make_x, traced=False, **kw)
    traced = _train(factory, make_x, traced=True, **kw)
    for key in ("losses", "grads", "state", "opt", "rng", "scaler"):
        assert_bit_identical(traced[key], plain[key], key)
    tr = traced["trace"]
    assert len(tr.steps) == 3
    if case == "amp_fp16_scaler":
        # the first huge scale overflowed: the comparison covers skipped steps
        assert tr.steps["skipped"].any()
    if case == "fp16_overflow_replay":
        ov = tr.first_overflow()
        assert ov is not None and ov.module == "" and ov.phase == "forward"


class BNThenOverflow(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.bn = nn.BatchNorm1d(2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.bn(x) * 1e39  # float32 overflow: +inf made by this module's own code, the replay runs


def test_replay_of_a_module_with_batch_norm_does_not_break_backward() -> None:
    m = BNThenOverflow()
    ref = copy.deepcopy(m)
    x = torch.tensor([[1.0, 2.0], [3.0, 5.0]])
    ref(x).sum().backward()
    with nantrace.trace(m) as tr:
        m(x).sum().backward()
    ov = tr.first_overflow()
    assert ov is not None and (ov.module, ov.phase, ov.kind) == ("", "forward", "inf")
    assert_bit_identical(dict(m.state_dict()), dict(ref.state_dict()), "buffers")
    assert_bit_identical(grads(m), grads(ref), "grads")


class BumpInput(nn.Module):
    def forward(self, h: torch.Tensor) -> torch.Tensor:
        h.add_(1.0)  # in-place update of its input (a residual stream, a running sum)
        return h * 3e38  # float32 overflow: a new non-finite kind, the replay runs


class BumpModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.bump = BumpInput()

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = x * 1.0
        return h, self.bump(h)


def test_replay_does_not_change_inputs_a_module_mutates_in_place() -> None:
    m = BumpModel()
    with nantrace.trace(m) as tr:
        h, _ = m(torch.ones(1, 2))
    assert tr.first_overflow() is not None
    assert h.tolist() == [[2.0, 2.0]]


class SideEffects(nn.Module):
    """A forward with Python-side state (a call counter, a cache list), as KV caches and EMA wrappers have."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(2, 2)
        self.calls = 0
        self.cache: list[torch.Tensor] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        y = self.fc(x) * 1e38
        self.cache.append(y.detach())
        return y * 10  # +inf in float32: a new non-finite kind, the forward replay runs


def test_replay_runs_forward_code_once_more_only_when_drill_is_on() -> None:
    side = SideEffects()
    m = nn.Sequential(side)
    with nantrace.trace(m, drill=False) as tr:
        m(torch.ones(1, 2))
    assert tr.first_overflow() is not None and tr.ops.empty
    assert side.calls == 1
    assert len(side.cache) == 1
    side2 = SideEffects()
    m2 = nn.Sequential(side2)
    with nantrace.trace(m2) as tr2:
        m2(torch.ones(1, 2))
    assert tr2.ops["module"].tolist() == ["0"]
    # documented: the drill-down replays the producing call once; the modules' plain attributes are set back
    # afterwards (the counter), other Python state is not (the list of tensors got the replay's entry too)
    assert side2.calls == 1
    assert len(side2.cache) == 2


# ------------------------------------------------------------------------------------------------ memory


def test_no_activation_or_gradient_survives_its_step() -> None:
    m = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    refs: list[weakref.ref[torch.Tensor]] = []

    def keep_grad(g: torch.Tensor) -> None:
        refs.append(weakref.ref(g))

    def keep_out(mod: nn.Module, args: Any, out: torch.Tensor) -> None:
        refs.append(weakref.ref(out))
        out.register_hook(keep_grad)

    handle = m[0].register_forward_hook(keep_out)
    with nantrace.trace(m, optimizer=opt) as tr:
        for _ in range(2):
            x = torch.randn(3, 4, requires_grad=True)
            out = m(x)
            refs.append(weakref.ref(out))
            out.sum().backward()
            refs.append(weakref.ref(x.grad))  # type: ignore[arg-type]
            refs.append(weakref.ref(m[2].weight.grad))  # type: ignore[arg-type]
            opt.step()
            opt.zero_grad(set_to_none=True)
            del x, out
            gc.collect()
            alive = [t for r in refs if (t := r()) is not None]
            assert not alive, (
                f"{len(alive)} activations/gradients survived the step: {[t.shape for t in alive]}"
            )
        assert len(refs) == 2 * 5
    handle.remove()
    assert len(tr.steps) == 2


def test_inference_mode_and_no_grad_loops_record_without_hooks_piling_up() -> None:
    m = nn.Sequential(nn.Linear(2, 2), nn.ReLU())
    with nantrace.trace(m) as tr:
        with torch.inference_mode():
            for _ in range(3):
                m(torch.ones(1, 2))
        with torch.no_grad():
            m(torch.ones(1, 2))
    assert len(tr.steps) == 4
    assert (
        keys(tr, step=3)
        == keys(tr, step=0)
        == [
            ("data", "", 0, "input[0]"),
            ("forward", "0", 0, "input[0]"),
            ("forward", "0", 0, "output"),
            ("forward", "1", 0, "input[0]"),
            ("forward", "1", 0, "output"),
            ("forward", "", 0, "output"),
        ]
    )


def test_flatten_list_gives_the_paths_of_flatten_for_every_shape() -> None:
    from nantrace._tree import flatten, flatten_list

    a, b = torch.ones(1), torch.zeros(2)
    Pair = namedtuple("Pair", ["p", "q"])
    shapes: list[Any] = [
        a,
        (),
        [],
        {},
        (a,),
        (a, b),
        [a, b],
        (a, None, b),
        {"x": a, "odd key": b},
        Pair(a, b),
        (a, (b, a)),
        None,
        3,
    ]
    for obj in shapes:
        got = flatten_list(obj, "input")
        want = list(flatten(obj, "input"))
        assert [(p, id(t)) for p, t in got] == [(p, id(t)) for p, t in want], obj
    assert [p for p, _ in flatten_list((a, b), "output")] == ["output[0]", "output[1]"]


class SuperStepSGD(torch.optim.SGD):
    """An optimizer subclass whose step() calls its base class's: once SGD itself has been instantiated in the
    process, torch runs the step hooks for both patched step() calls."""

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        return super().step(closure)


@pytest.mark.parametrize("make", [nantrace.trace, nantrace.watch], ids=["trace", "watch"])
def test_an_optimizer_subclass_calling_super_step_is_one_step(make: Any) -> None:
    torch.optim.SGD(nn.Linear(1, 1).parameters(), lr=0.1)  # SGD.step patched, as in any process that used SGD
    torch.manual_seed(0)
    model = nn.Linear(2, 2)
    opt = SuperStepSGD(model.parameters(), lr=0.1)
    fired: list[int] = []
    opt.register_step_post_hook(lambda *a: fired.append(1))
    with make(model, optimizer=opt, **({"every": 1} if make is nantrace.watch else {})) as tr:
        for _ in range(3):
            opt.zero_grad()
            model(torch.ones(1, 2)).sum().backward()
            opt.step()
    assert len(fired) == 6  # torch's own double firing, which nantrace must not count as steps
    assert tr.steps["step"].tolist() == [0, 1, 2]
    rows = tr.records.query("phase == 'optimizer'")
    assert rows.groupby("step").size().tolist() == [2, 2, 2]  # weight and bias once per step


class HostRandom(nn.Module):
    """Scales its hidden values by draws from Python's ``random`` and NumPy's global RNG; ``bad`` multiplies
    them by 1e39 (past float32's max): a faulty step that the drill-down (trace) and the replay (watch) run
    again."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2, self.bad = nn.Linear(4, 4), nn.Linear(4, 1), False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc1(x) * (1.0 + random.random()) * (1.0 + float(np.random.rand()))
        return self.fc2(h * 1e39 if self.bad else h)


@pytest.mark.parametrize("mode", ["none", "trace", "watch"])
def test_replays_leave_python_and_numpy_random_streams_where_the_run_had_them(mode: str) -> None:
    """The losses after a replayed faulty step are the untraced run's: a forward drawing from ``random`` or
    NumPy drew a second time in each replay, and every later step differed (found by the new-user check)."""

    def run(make: Any) -> list[float]:
        torch.manual_seed(0)
        random.seed(0)
        np.random.seed(0)
        m = HostRandom()
        opt = torch.optim.SGD(m.parameters(), lr=0.01)
        losses = []
        with make(m, optimizer=opt) as tr:
            for step in range(4):
                m.bad = step == 1
                loss = m(torch.ones(2, 4)).pow(2).mean()
                tr.step(loss=loss)
                losses.append(loss.item())
                if step != 1:
                    loss.backward()
                    opt.step()
                opt.zero_grad()
        return losses

    untraced = run(lambda m, **kw: contextlib.nullcontext(types.SimpleNamespace(step=lambda loss: None)))
    if mode == "none":
        assert not math.isfinite(untraced[1]) and all(math.isfinite(v) for v in untraced[::2])
        return
    got = run(nantrace.trace if mode == "trace" else nantrace.watch)
    assert got[0] == untraced[0] and got[2:] == untraced[2:]


class _NoCopyInt(int):
    """An int attribute that refuses to be copied."""

    def __deepcopy__(self, memo: Any) -> Any:
        raise RuntimeError("no copies")


class _Stubborn(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc, self.count = nn.Linear(2, 2), _NoCopyInt(1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x) * 1e39  # past float32's max: the drill-down replays this call


def test_an_attribute_that_refuses_a_copy_does_not_reach_the_loop() -> None:
    """Copying the plain attributes around the drill-down's replay (and at each call under capture=) fails on
    this one: it is kept as the object itself, and the op is still named (the copy's error went into the user's
    forward)."""
    for capture in (None, "first"):  # capture= saves them at every call too
        m = nn.Sequential(_Stubborn())
        with nantrace.trace(m, capture=capture) as tr:
            m(torch.ones(1, 2))
        assert tr.ops["op"].tolist() == ["mul"]
        assert m[0].count == 1
