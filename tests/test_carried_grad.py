"""A `.grad` that holds NaN from an earlier step because nothing reset it: the later step's backward only added
finite values to it, and its row in `overflows()` says so instead of blaming that backward."""

from __future__ import annotations

import torch
from torch import nn

import nantrace


class AbsBySqrt(nn.Module):
    """|x| as sqrt(x²): finite at 0, but its derivative there is inf·0 = NaN."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sqrt(x * x)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(4, 4, bias=False)
        self.act = AbsBySqrt()
        self.fc2 = nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


def test_a_grad_left_holding_nan_by_an_optimizer_of_other_parameters_is_said_to_be_carried_over() -> None:
    """The optimizer holds fc2 only, so its zero_grad() never resets fc1's `.grad`: step 1's NaN (made by the
    backward of `act` at a zero row) is still in `fc1.weight.grad` at step 2, whose own gradients are finite."""
    torch.manual_seed(0)
    m = Net()
    opt = torch.optim.SGD(m.fc2.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(1)
    with nantrace.trace(m, optimizer=opt) as tr:
        for step in range(3):
            x = torch.randn(2, 4, generator=g)
            if step == 1:
                x[0] = 0.0  # fc1 (no bias) gives an exact zero row: sqrt(0·0) backward is NaN
            opt.zero_grad()
            loss = m(x).sum()
            tr.step(loss=loss)
            loss.backward()
            opt.step()
    first = tr.first_overflow()
    assert first is not None
    assert (first.step, first.phase, first.module, first.kind) == (1, "backward", "act", "nan")
    rows = tr.overflows().set_index("step")
    assert (rows.loc[2, "phase"], rows.loc[2, "module"], rows.loc[2, "tensor"]) == (
        "backward",
        "fc1",
        "weight.grad",
    )
    gout = tr.records[
        (tr.records["step"] == 2)
        & (tr.records["module"] == "fc1")
        & (tr.records["tensor"] == "grad_output[0]")
    ]
    assert int(gout["n_nan"].iloc[0]) == 0
    absmax = nantrace._fmt.num(float(gout["absmax"].iloc[0]))
    assert rows.loc[2, "message"] == (
        "step 2 backward: `weight.grad` of `fc1` already held NaN before this step's backward (float32)\n"
        "At step 2, the `.grad` of 1 parameter(s) already held inf/NaN when the backward began "
        f"(steps.stale_grads), and the gradients arriving at `fc1` were finite (grad_output absmax {absmax}): "
        "this backward added finite values to a `.grad` that was not reset, it did not make the NaN. It held NaN "
        "at step 1 already.\n"
        "Reset the gradients every step: `optimizer.zero_grad()` resets only the optimizer's own parameters, "
        "`model.zero_grad()` every parameter of the model; and find the step that first made the value: "
        "tr.first_overflow()."
    )
    assert list(tr.steps["stale_grads"]) == [0.0, 0.0, 1.0]
