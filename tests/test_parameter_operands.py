"""The forward replay names the operands that are the module's own parameters and buffers, and an op that reads
a trainable weight already holding inf/NaN is named as the producer: the call computed from its own non-finite
weights, written before the forward. Faults are written by hand (``weight[0, 0] = inf``), so they exist on every
torch and CPU."""

from __future__ import annotations

import json
import math

import pytest
import torch
from conftest import sgd_run
from torch import nn

import nantrace

INF_BIAS_SENTENCE = {
    "trace": (
        "its parameter `bias` (operand arg2) held +inf when the forward read it; its optimizer row of step 1 was "
        "finite: it was written outside optimizer.step() (after the update of step 1, before this forward)."
    ),
    "watch": (
        "its parameter `bias` (operand arg2) held +inf when the forward read it; its optimizer row of step 0 was "
        "finite, and nantrace.watch's parameter check after optimizer.step() of step(s) 1 found every parameter it updated "
        "finite: it was written outside optimizer.step() (after the update of step 1, before this forward)."
    ),
}


def _edited_run(mode: str, value: float, at: str = "bias") -> nantrace.Trace:
    """Three SGD steps (:func:`conftest.sgd_run`); before step 2 the loop writes ``value`` into element 0 of
    the first Linear's ``at`` (outside optimizer.step())."""

    def edit(model: nn.Sequential, step: int) -> None:
        if step == 2:
            with torch.no_grad():
                getattr(model[0], at).view(-1)[0] = value

    result: nantrace.Trace = sgd_run(mode, 3, edit)
    return result


@pytest.mark.parametrize("mode", ["trace", "watch"])
def test_an_inf_written_into_a_bias_is_named_as_the_weight_the_forward_read(mode: str) -> None:
    """+inf in a bias makes a +inf output and nothing new: before, the drill-down found no producing op and the
    Linear was said to overflow "from finite inputs"."""
    tr = _edited_run(mode, math.inf)
    ov = tr.first_overflow()
    assert ov is not None
    assert (ov.step, ov.phase, ov.module, ov.kind, ov.tensor) == (2, "forward", "0", "inf", "output")
    lines = str(ov).splitlines()
    assert (
        lines[0] == "step 2 forward: `0` (`linear`) computed +inf from its own non-finite weights (float32)"
    )
    assert lines[1].endswith(INF_BIAS_SENTENCE[mode])
    assert "operand arg2 (float32, 8 values, parameter `bias`): absmax " in lines[4]
    assert lines[4].endswith(", 1 +inf")
    assert lines[2].startswith("operand arg0 (float32, 12 values): absmax 1, smallest non-zero |x| 1")
    d = tr.diagnose()
    assert d.cause == "invalid_op"
    assert d.summary == (
        "`0` computed +inf at step 2 from its own weights, which already held non-finite values: not this "
        "forward's arithmetic."
    )
    assert d.advice == [
        "The weights of `0` were already non-finite when its forward read them: the fault is what wrote them (an "
        "optimizer step whose own fault came first, a manual edit, a state-dict load), not this forward. Restore "
        "them from a checkpoint and fix that writer."
    ]


def test_a_nan_written_into_a_weight_is_found_the_same_by_trace_and_watch() -> None:
    """A NaN weight is no new kind for the op that reads it (its operand holds NaN), yet the call made NaN from
    finite inputs: both modes name `linear` and the parameter."""
    got = {}
    for mode in ("trace", "watch"):
        tr = _edited_run(mode, math.nan, at="weight")
        ov = tr.first_overflow()
        assert ov is not None
        got[mode] = (ov.step, ov.micro_step, ov.phase, ov.module, ov.module_type, ov.call, ov.tensor, ov.kind)
        row = tr.ops.iloc[0]
        assert (row["op"], row["kind"]) == ("linear", "nan")
        doc = json.loads(row["operands"])
        assert [(o["name"], o.get("param")) for o in doc["operands"]] == [
            ("arg0", None),
            ("arg1", "weight"),
            ("arg2", "bias"),
        ]
        assert doc["operands"][1]["n_nan"] == 1
        assert "its parameter `weight` (operand arg1) held NaN when the forward read it" in str(ov)
    assert got["trace"] == got["watch"] == (2, 0, "forward", "0", "Linear", 0, "output", "nan")


class _Scaled(nn.Module):
    """``x / scale`` with ``scale`` a buffer of 0: x/0 at the singular point."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("scale", torch.zeros(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x / self.scale


def test_a_buffer_operand_is_named_and_keeps_its_class() -> None:
    model = nn.Sequential(_Scaled())
    with nantrace.trace(model) as tr:
        model(torch.ones(2, 2))
    ov = tr.first_overflow()
    assert ov is not None
    assert (
        str(ov).splitlines()[0] == "step 0 forward: `0` (`div`) hit a singular point: x/0 gave +inf (float32)"
    )
    assert "operand arg1 (float32, 1 value, buffer `scale`): absmax 0, 1 zero" in str(ov).splitlines()
    assert tr.diagnose().cause == "invalid_op"


class _MaskParam(nn.Module):
    """``softmax(x + mask)`` with the additive mask kept as a parameter (frozen or not, as user code does); its
    second row is all -inf."""

    def __init__(self, trainable: bool) -> None:
        super().__init__()
        m = torch.tensor([[0.0, -math.inf], [-math.inf, -math.inf]])
        self.mask = nn.Parameter(m, requires_grad=trainable)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.softmax(x + self.mask, dim=-1)


@pytest.mark.parametrize("trainable", [False, True], ids=["frozen", "trainable"])
def test_a_parameter_holding_a_mask_is_not_taken_for_a_non_finite_weight(trainable: bool) -> None:
    """A parameter's -inf may be a mask (``nn.Parameter(mask)`` requires grad unless told not to): it is read
    as before (the fully masked row's softmax is the producer), not as weights written non-finite; only NaN and
    +inf in a parameter count as that."""
    model = nn.Sequential(_MaskParam(trainable))
    with nantrace.trace(model) as tr:
        model(torch.ones(2, 2))
    ov = tr.first_overflow()
    assert ov is not None
    assert str(ov).splitlines()[0] == (
        "step 0 forward: `0` (`softmax`) made NaN by mask arithmetic: a fully masked row (float32)"
    )
    d = tr.diagnose()
    assert (d.cause, d.summary) == (
        "invalid_op",
        "`0` made a non-finite value by mask arithmetic at step 0 (`softmax`: a fully masked row): not an overflow.",
    )


def _scaled_weight_run(edit: bool) -> nantrace.Trace:
    """Four float16-autocast steps of Linear(4, 4) (weight 0.5, bias 0, SGD at lr 0: the optimizer changes
    nothing) on inputs of 1: the output is 2. Before step 2 the loop multiplies the weight by 1e5 when ``edit``:
    the output is then 4 · 5e4 = 2e5, beyond float16's 65504."""
    model = nn.Sequential(nn.Linear(4, 4))
    with torch.no_grad():
        model[0].weight.fill_(0.5)
        model[0].bias.zero_()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)  # 1024 · dloss/dy = 1024 stays finite in float16
    with nantrace.trace(model, scaler=scaler, optimizer=opt) as tr:
        for step in range(4):
            if edit and step == 2:
                with torch.no_grad():
                    model[0].weight.mul_(1e5)
            with torch.autocast("cpu", dtype=torch.float16):
                loss = model(torch.ones(2, 4)).float().sum()
            opt.zero_grad()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
    return tr


def test_a_weight_multiplied_between_steps_is_named_as_written_outside_the_optimizer() -> None:
    """The weight the forward read (the producing op's parameter operand) has another absmax than the optimizer
    left in it after step 1, with no optimizer.step() in between: a write outside the optimizer, said in the
    explanation and the diagnosis, with the advice to find that writer first."""
    tr = _scaled_weight_run(edit=True)
    ov = tr.first_overflow()
    assert ov is not None and (ov.step, ov.phase, ov.module, ov.kind) == (2, "forward", "0", "inf")
    fact = (
        "its parameter `weight` had absmax 0.5 after optimizer.step() of step 1 and 50000 when this forward read it "
        "(×100000), with no optimizer.step() in between: it was written outside the optimizer"
    )
    advice = (
        "Find what wrote `0.weight` after optimizer.step() of step 1 and before this forward (a manual edit, a "
        "state-dict load, a weight average): the optimizer did not change it in between."
    )
    lines = str(ov).splitlines()
    assert "I" + fact[1:] + "." in lines
    assert lines[lines.index("I" + fact[1:] + ".") + 1] == advice
    d = tr.diagnose()
    assert d.cause == "forward_overflow"
    assert fact in d.evidence
    assert d.advice[0] == advice


def test_weights_the_optimizer_left_as_the_forward_read_them_are_not_called_written() -> None:
    """The same run without the edit: the forward of every step reads what optimizer.step() left; nothing is
    non-finite and no parameter is said to be written outside the optimizer (the check, run on the edited
    run's event, compares equal absmax values here)."""
    tr = _scaled_weight_run(edit=False)
    assert tr.first_overflow() is None
    rows = tr.records.query("phase == 'optimizer' and tensor == 'weight'")
    assert rows["absmax"].tolist() == [0.5, 0.5, 0.5, 0.5]


class _CausalMix(nn.Module):
    """``softmax(fc(x) + attn_mask)`` with the causal mask (0 on and below the diagonal, -inf above) kept as a
    frozen parameter, then a Linear."""

    def __init__(self) -> None:
        super().__init__()
        self.fc, self.out = nn.Linear(4, 4), nn.Linear(4, 2)
        mask = torch.triu(torch.full((4, 4), -math.inf), 1)
        self.attn_mask = nn.Parameter(mask, requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.softmax(self.fc(x) + self.attn_mask, dim=-1))


@pytest.mark.parametrize("mode", ["trace", "watch"])
def test_a_frozen_mask_parameter_is_no_optimizer_fault(mode: str) -> None:
    """optimizer.step() updates only parameters with a gradient: the frozen -inf mask gets no optimizer row,
    and watch's post-step check leaves it out (both reported 'optimizer.step() made `attn_mask` -inf' at step 0,
    found by the new-user check)."""

    torch.manual_seed(0)
    model = _CausalMix()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ctx = nantrace.trace if mode == "trace" else nantrace.watch
    with ctx(model, optimizer=opt) as tr:
        for _ in range(3):
            loss = model(torch.ones(4, 4)).pow(2).sum()
            tr.step(loss=loss)
            loss.backward()
            opt.step()
            opt.zero_grad()
    assert tr.first_overflow() is None
    assert tr.diagnose().cause == "healthy"
    opt_rows = tr.records[tr.records["phase"].astype(str) == "optimizer"]
    assert "attn_mask" not in set(opt_rows["tensor"].astype(str))
    if mode == "trace":
        assert sorted(set(opt_rows["tensor"].astype(str))) == ["bias", "weight"] and len(opt_rows) == 12


@pytest.mark.parametrize("mode", ["trace", "watch"])
def test_a_nan_written_into_a_frozen_weight_is_named_as_the_weight(mode: str) -> None:
    """A frozen Linear (fine-tuning the rest) whose weight is set to NaN before step 2: the forward computed NaN
    from that weight, not 'an invalid operation: add eps' (found by the new-user check)."""

    def edit(model: nn.Sequential, step: int) -> None:
        if step == 0:
            model[0].requires_grad_(False)
        if step == 2:
            with torch.no_grad():
                model[0].weight[0, 0] = math.nan

    tr = sgd_run(mode, 3, edit)
    ov = tr.first_overflow()
    assert ov is not None and (ov.step, ov.phase, ov.module, ov.kind) == (2, "forward", "0", "nan")
    lines = str(ov).splitlines()
    assert lines[0] == "step 2 forward: `0` (`linear`) computed NaN from its own non-finite weights (float32)"
    assert lines[1].endswith(
        "its parameter `weight` (operand arg1; frozen: requires_grad=False, so no optimizer.step() changes it) "
        "held NaN when the forward read it."
    )
    assert tr.diagnose().advice[0] == (  # no optimizer step among the writers of a frozen weight
        "The weights of `0` were already non-finite when its forward read them: the fault is what wrote them (a "
        "manual edit, a state-dict load), not this forward. Restore them from a checkpoint and fix that writer."
    )


def test_an_embedding_row_set_to_inf_is_named_with_its_integer_inputs() -> None:
    """An Embedding reads token ids (no floating-point input with an absmax; was "input absmax n/a") and its
    own weight, whose row 2 the loop set to +inf before step 1."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(4, 3), nn.Linear(3, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    with nantrace.trace(model, optimizer=opt) as tr:
        for step in range(2):
            if step == 1:
                with torch.no_grad():
                    model[0].weight[2, 0] = math.inf
            loss = model(torch.tensor([[1, 2]])).sum()
            tr.step(loss=loss)
            loss.backward()
            opt.step()
            opt.zero_grad()
    ov = tr.first_overflow()
    assert ov is not None and (ov.step, ov.module, ov.kind) == (1, "0", "inf")
    lines = str(ov).splitlines()
    assert (
        lines[0]
        == "step 1 forward: `0` (`embedding`) computed +inf from its own non-finite weights (float32)"
    )
    assert lines[1].endswith(
        "from inputs with no recorded floating-point tensor (token ids, indices): its parameter `weight` (operand arg1) "
        "held +inf when the "
        "forward read it; its optimizer row of step 0 was finite: it was written outside optimizer.step() (after "
        "the update of step 0, before this forward)."
    )
