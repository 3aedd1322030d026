"""Without op facts (``drill=False``, a loaded trace), the advice for a leaf call that overflowed or made NaN from
finite inputs rests on a recorded fact, the parameters the module owns (its ``optimizer`` and ``.grad`` rows),
never on its class name: a hand-written leaf with a parameter is treated like ``nn.Linear``, a leaf with none is
not told to shrink weights it does not have."""

from __future__ import annotations

from pathlib import Path

import torch
from conftest import records_frame
from torch import nn

import nantrace
from nantrace._fmt import num
from nantrace._ranges import own_parameters


class Gain(nn.Module):
    """A hand-written leaf with one parameter: ``x * g``."""

    def __init__(self, d: int, value: float) -> None:
        super().__init__()
        self.g = nn.Parameter(torch.full((d,), value))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.g


class Times(nn.Module):
    """A hand-written leaf without parameters: ``x * c``."""

    def __init__(self, c: float) -> None:
        super().__init__()
        self.c = c

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.c


def test_own_parameters_come_from_optimizer_and_grad_rows_of_that_module_only() -> None:
    rows = records_frame(
        [
            {"phase": "forward", "module": "a", "tensor": "output"},
            {"phase": "backward", "module": "a", "tensor": "weight.grad"},
            {"phase": "backward", "module": "a", "tensor": "grad_input[0]"},
            {"phase": "optimizer", "module": "a", "tensor": "bias"},
            {"phase": "optimizer", "module": "a.b", "tensor": "weight"},
        ]
    )
    assert own_parameters(rows, "a") == ["bias", "weight"]
    assert own_parameters(rows, "a.b") == ["weight"]
    assert own_parameters(rows, "c") == []


def _half_run(model: nn.Module) -> nantrace.Trace:
    model = model.half()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    torch.manual_seed(0)
    with nantrace.trace(model, optimizer=opt, drill=False) as tr:
        x = torch.randn(8, 16).half()
        loss = model(x).float().mean()
        loss.backward()
        tr.step(loss=loss)
        opt.step()
    return tr


def test_a_hand_written_leaf_with_a_parameter_is_told_about_its_own_parameters() -> None:
    tr = _half_run(nn.Sequential(nn.Linear(16, 16), Gain(16, 60000.0)))
    d = tr.diagnose()
    assert d.cause == "forward_overflow"
    assert d.overflow is not None and (d.overflow.module, d.overflow.module_type) == ("1", "Gain")
    inputs = tr.records.query("phase == 'forward' and module == '1' and tensor == 'input[0]'")
    absmax = float(inputs["absmax"].iloc[0])
    assert d.advice[0] == (
        f"`1` turns inputs of absmax {num(absmax)} into values above 65504 with its own parameters "
        "(`1.g`): rescale or normalise its input (a norm layer before it), or shrink its weights (init, weight "
        "decay)."
    )


def test_a_leaf_without_parameters_is_not_told_to_shrink_weights() -> None:
    tr = _half_run(nn.Sequential(nn.Linear(16, 16), Times(60000.0)))
    d = tr.diagnose()
    assert d.cause == "forward_overflow"
    assert d.overflow is not None and d.overflow.module == "1"
    assert not any("its own parameters" in a or "shrink its weights" in a for a in d.advice)


def test_a_loaded_linear_nan_names_its_recorded_parameters(tmp_path: Path) -> None:
    m = nn.Sequential(nn.Linear(16, 16), nn.ReLU())
    with torch.no_grad():
        m[0].weight[0, 0] = float(
            "nan"
        )  # a NaN weight no optimizer row shows: the loaded trace cannot read it
    sc = torch.amp.GradScaler("cpu")
    opt = torch.optim.SGD(m.parameters(), lr=0.0)
    with nantrace.trace(m, scaler=sc, optimizer=opt, drill=False) as tr:
        with torch.autocast("cpu", dtype=torch.float16):
            loss = m(torch.randn(8, 16)).float().mean()
        sc.scale(loss).backward()
        sc.step(opt)
        sc.update()
    tr.save(tmp_path / "t.parquet")
    ov = nantrace.load(tmp_path / "t.parquet").first_overflow()
    assert ov is not None and (ov.module, ov.kind, ov.phase) == ("0", "nan", "forward")
    assert (
        "from inputs holding no inf/NaN: a torch.nn layer with no code of its own and its own parameters "
        "(`0.bias`, `0.weight`) points to non-finite weights, not to an op such as 0/0"
    ) in str(ov)
