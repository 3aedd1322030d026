"""Issue 18: locator facts that hold in every training pattern (time order across calls, inf before NaN,
autocast's casts, backward attribution, masks, light steps, interrupted steps, streaming, live = loaded)."""

from __future__ import annotations

import math

import torch
from torch import nn

import nantrace


def _where(ov: nantrace.Overflow | None) -> tuple | None:
    if ov is None:
        return None
    return (ov.step, ov.micro_step, ov.phase, ov.module, ov.tensor, ov.kind)


# ------------------------------------------------------------------------------------------ 1: time order
def test_second_call_input_before_first_calls_backward() -> None:
    """A siamese loss: the model runs on a clean batch and on a batch holding +inf, then one backward.
    The +inf entered with the second call (data, micro-step 1), before any backward ran."""
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    a = torch.ones(3, 4)
    b = torch.ones(3, 4)
    b[1, 2] = math.inf
    with nantrace.trace(m, optimizer=opt) as tr:
        loss = (m(a) - m(b)).pow(2).mean()
        loss.backward()
        opt.step()
    assert _where(tr.first_overflow()) == (0, 1, "data", "", "input[0]", "inf")


# ------------------------------------------------------------------------------------------ 2: inf before NaN
def test_first_bad_tensor_with_inf_and_nan_is_inf() -> None:
    """One op whose output holds +inf and NaN (``x / 0`` with x = [1, 0]): NaN follows from inf, never the
    reverse, so the kind is inf; restricted to NaN the same output is named."""

    class Both(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x / (x - x)  # one op: 1 / 0 = +inf and 0 / 0 = NaN side by side

    class Root(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.both = Both()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.both(x)

    m = Root()
    x = torch.tensor([[1.0, 0.0]], dtype=torch.float16)
    with nantrace.trace(m) as tr:
        m(x)
    ov = tr.first_overflow()
    assert _where(ov) == (0, 0, "forward", "both", "output", "inf")
    nan = tr.first_overflow(kind="nan")
    assert _where(nan) == (0, 0, "forward", "both", "output", "nan")


# ------------------------------------------------------------------------------------------ 3: autocast casts
def _cast_run(layer: nn.Module) -> nantrace.Trace:
    """``layer`` (float32, weights 1e5, beyond float16's 65504) under float16 autocast on x = [0, 1]:
    autocast's cast makes the weights +inf, and inf·0 in the matmul gives NaN in the output."""

    class Root(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj = layer

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.proj(x)

    m = Root()
    with torch.no_grad():
        for p in m.proj.parameters():
            p.fill_(1e5)
    with nantrace.trace(m) as tr, torch.autocast("cpu", dtype=torch.float16):
        m(torch.tensor([[0.0, 1.0]]))
    return tr


def test_autocast_cast_of_a_linear_weight_is_the_producing_op() -> None:
    tr = _cast_run(nn.Linear(2, 1, bias=False))
    ov = tr.first_overflow()
    assert _where(ov) == (0, 0, "forward", "proj", "output", "inf")
    assert (
        str(ov).splitlines()[0]
        == "step 0 forward: `proj` (`aten._to_copy`) overflowed in a cast to float16 (+inf)"
    )
    assert " ".join(str(ov).splitlines()[1:]).startswith(
        "At step 0, `proj` (Linear, call 0) produced +inf in `aten._to_copy` inside its forward (float16)"
    )
    assert tr.records.query("module == 'proj' and tensor == 'output'")[
        ["n_nan", "n_posinf"]
    ].values.tolist() == [[1, 0]]


def test_autocast_cast_of_a_gpt2_conv1d_weight_is_the_producing_op() -> None:
    from transformers.pytorch_utils import Conv1D

    tr = _cast_run(Conv1D(1, 2))  # GPT-2's projection: addmm(bias, x, weight), weight (in, out)
    ov = tr.first_overflow()
    assert _where(ov) == (0, 0, "forward", "proj", "output", "inf")
    assert "`aten._to_copy` inside its forward (float16)" in str(ov)
    assert "an invalid operation such as 0/0" not in str(tr.diagnose())


def test_a_loss_gradient_that_is_also_the_last_childs_grad_output_is_the_loss_phase() -> None:
    # the root's output is its last child's output: the gradient the loss sends back (1e6 per element, +inf in
    # float16) is recorded as child `1`'s grad_output before the root's; the loss's backward made it
    m = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2)).half()
    with nantrace.trace(m) as tr:
        (m(torch.ones(1, 2, dtype=torch.float16)).float() * 1e6).sum().backward()
        tr.step()
    ov = tr.first_overflow()
    assert ov is not None
    assert (ov.step, ov.phase, ov.module, ov.tensor, ov.kind) == (0, "loss", "", "grad_output[0]", "inf")
    r = tr.records
    assert r[(r["phase"] == "backward") & (r["module"] == "1") & (r["tensor"] == "grad_output[0]")][
        "n_posinf"
    ].tolist() == [2]
