"""Diagnosis (one exact cause per failure kind), fp16 readiness and run comparison, on tiny CPU models.

Every cause of ``nantrace._diagnosis.CAUSES`` has its own tiny case, and the CASES of CASES.md (rebuilt here)
are diagnosed with the cause they stand for.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pandas as pd
import pytest
import torch
import torch.nn.functional as F
from conftest import SqrtBetween
from test_cases import AttnModel, C01Model, C06Model, Gate, Residual  # the CASES models, shared
from torch import nn

import nantrace
from nantrace._compare import Comparison, compare
from nantrace._diagnosis import CAUSES, Diagnosis
from nantrace._facts import update_ratios
from nantrace._fmt import num
from nantrace._readiness import READINESS_COLUMNS, fp16_readiness

Trace = nantrace.Trace
diagnose = nantrace.Trace.diagnose


def _cause(tr: Trace) -> str:
    return diagnose(tr).cause


def _amp_loop(
    model: nn.Module,
    steps: int,
    batch: Callable[[int], tuple[torch.Tensor, torch.Tensor]],
    *,
    lr: float = 1e-3,
    init_scale: float = 65536.0,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
) -> Trace:
    """fp32 model, fp16 autocast forward, GradScaler, SGD: the standard AMP loop."""
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    scaler = torch.amp.GradScaler("cpu", init_scale=init_scale)
    loss_fn = loss_fn or (lambda out, y: F.mse_loss(out.float(), y))
    with nantrace.trace(model, scaler=scaler, optimizer=opt) as tr:
        for step in range(steps):
            x, y = batch(step)
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16):
                out = model(x)
            scaler.scale(loss_fn(out, y)).backward()
            scaler.step(opt)
            scaler.update()
    return tr


# ============================================================================================ CASES.md


def _c01(wo_weight: float = 1.0) -> C01Model:
    m = C01Model()
    with torch.no_grad():
        m.ff.wi.weight.fill_(1 / 16)
        m.ff.wi.bias.zero_()
        m.ff.wo.weight.fill_(wo_weight)
        m.ff.wo.bias.zero_()
    return m


def test_c01_t5_feed_forward_is_forward_overflow_with_specific_advice() -> None:
    m = _c01().half()
    with nantrace.trace(m) as tr:
        m(torch.full((2, 16), 1100.0, dtype=torch.float16))
    d = diagnose(tr)
    assert d.cause == "forward_overflow"
    assert d.overflow is not None and (d.overflow.module, d.overflow.phase) == ("ff.wo", "forward")
    text = str(d)
    assert "ff.wo" in text and "float16" in text and "65504" in text and "1100" in text
    assert any("ff.wo" in a and "float32" in a for a in d.advice)
    assert any("bfloat16" in a for a in d.advice)


def test_c02_residual_add_is_forward_overflow_in_the_blocks_own_code() -> None:
    m = nn.Sequential()
    m.add_module("block", Residual())
    with torch.no_grad():
        m.block.fc.weight.copy_(torch.eye(8))
        m.block.fc.bias.zero_()
    m = m.half()
    with nantrace.trace(m) as tr:
        m(torch.full((2, 8), 40000.0, dtype=torch.float16))
    d = diagnose(tr)
    assert d.cause == "forward_overflow"
    assert d.overflow is not None and d.overflow.module == "block"
    assert any("own forward" in a and "block" in a for a in d.advice)


def test_c03_attention_scores_are_forward_overflow_with_scaling_advice() -> None:
    m = AttnModel(64)
    with torch.no_grad():
        for lin in (m.attn.q, m.attn.k, m.attn.v):
            lin.weight.copy_(torch.eye(64))
    m = m.half()
    with nantrace.trace(m) as tr:
        m(torch.full((1, 4, 64), 40.0, dtype=torch.float16))
    d = diagnose(tr)
    assert d.cause == "forward_overflow" and d.overflow is not None and d.overflow.module == "attn"
    assert any("sqrt(head_dim)" in a for a in d.advice)


def _mask(fully_padded_row: bool) -> torch.Tensor:
    mask = torch.zeros(2, 1, 4, dtype=torch.float16)
    mask[0, 0, 3] = -math.inf
    if fully_padded_row:
        mask[1] = -math.inf
    return mask


def test_c04_fully_masked_softmax_row_is_invalid_op_and_mask_alone_is_healthy() -> None:
    torch.manual_seed(0)
    m = AttnModel(8).half()
    x = torch.randn(2, 4, 8).half()
    with nantrace.trace(m) as tr:
        m(x, _mask(True))
    d = diagnose(tr)
    assert d.cause == "invalid_op" and d.overflow is not None and d.overflow.module == "attn"
    assert any("masked" in a for a in d.advice)
    with nantrace.trace(m) as tr2:
        m(x, _mask(False))
    assert _cause(tr2) == "healthy"


def test_c05_log_of_zero_count_is_data() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))

    def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        counts = torch.randint(1, 50, (8, 4)).float()
        if step == 2:
            counts[3, 1] = 0
        return torch.log(counts), torch.randn(8, 1)

    tr = _amp_loop(model, 4, batch, init_scale=1024)
    d = diagnose(tr)
    assert d.cause == "data"
    assert d.overflow is not None and (d.overflow.step, d.overflow.phase) == (2, "data")
    assert any("step 2" in a for a in d.advice)
    assert any("log" in a for a in d.advice)


def test_c06_backward_zero_times_inf_is_invalid_op() -> None:
    m = C06Model()
    with torch.no_grad():
        m.proj.weight.zero_()
        m.proj.bias.fill_(-20.0)
    m = m.half()
    with nantrace.trace(m) as tr:
        m(torch.tensor([[0.1, 0.2, 1.0, 0.3]], dtype=torch.float16)).sum().backward()
    d = diagnose(tr)
    assert d.cause == "invalid_op"
    assert d.overflow is not None and (d.overflow.phase, d.overflow.module) == ("backward", "gate")
    assert any("torch.where" in a for a in d.advice)


def test_c07_adam_eps_in_pure_fp16_is_optimizer() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4).half())
    opt = torch.optim.Adam(model.parameters(), lr=1e-3, eps=1e-8)
    x = torch.full((2, 4), 1e-3, dtype=torch.float16)
    with nantrace.trace(model, optimizer=opt) as tr:
        for _ in range(2):
            opt.zero_grad()
            (model(x).sum() * 1e-3).backward()
            opt.step()
    d = diagnose(tr)
    assert d.cause == "optimizer"
    assert d.overflow is not None and (d.overflow.phase, d.overflow.module) == ("optimizer", "0")
    assert any("eps" in a and "1e-4" in a for a in d.advice)
    assert any("master weights" in a for a in d.advice)


class DivideByState(torch.optim.Optimizer):
    """Plain SGD whose second step() divides the biases by a zero state: a float32 optimizer fault with finite
    gradients and a finite learning rate."""

    def __init__(self, params: Any) -> None:
        super().__init__(params, {"lr": 0.01})
        self.calls = 0

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        self.calls += 1
        for p in self.param_groups[0]["params"]:
            p.sub_(0.01 * p.grad)
            if self.calls == 2 and p.dim() == 1:
                p.div_(torch.zeros_like(p))


def _float32_optimizer_run(opt_of: Any) -> Trace:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4))
    opt = opt_of(model.parameters())
    with nantrace.trace(model, optimizer=opt) as tr:
        for _ in range(3):
            opt.zero_grad()
            model(torch.ones(2, 4)).sum().backward()
            opt.step()
    return tr


def test_a_float32_optimizer_fault_is_not_explained_by_eps_rounding() -> None:
    """In float32 eps=1e-8 and grad² do not round to 0: the text names the optimizer's own arithmetic, not Adam
    or model.half() (was the float16 eps advice for an SGD in float32, found by the new-user check)."""
    tr = _float32_optimizer_run(DivideByState)
    ov = tr.first_overflow()
    assert ov is not None and (ov.step, ov.phase, ov.module, ov.tensor) == (1, "optimizer", "0", "bias")
    assert str(ov).splitlines()[1] == (
        "At step 1, gradients were finite but optimizer.step() made `bias` of `0` (Linear) +inf (float32). In "
        "float32 a finite gradient becomes non-finite only in the optimizer's own arithmetic: an update beyond "
        "3.403e+38 (learning rate 0.01) or an invalid operation in step() (0/0, a division by a zero state): check "
        "the learning rate and the optimizer's hyper-parameters, and a custom optimizer's step()."
    )
    d = diagnose(tr)
    assert d.cause == "optimizer"
    assert d.advice == [
        "In float32 a finite gradient becomes non-finite only in DivideByState.step()'s own arithmetic: an update "
        "beyond 3.403e+38 or an invalid operation (0/0, a division by a state that is 0). Check the learning rate "
        "and the optimizer's hyper-parameters, and a custom optimizer's step()."
    ]
    assert not any("eps" in e or "Adam" in e for e in d.evidence)


def test_an_infinite_learning_rate_is_named_as_the_fix() -> None:
    tr = _float32_optimizer_run(lambda p: torch.optim.SGD(p, lr=math.inf))
    ov = tr.first_overflow()
    assert ov is not None and (ov.step, ov.phase) == (0, "optimizer")
    assert (
        str(ov)
        .splitlines()[1]
        .endswith("The learning rate was inf at this step: set a finite one (check what set it).")
    )
    d = diagnose(tr)
    assert d.cause == "optimizer" and "learning rate inf" in d.evidence
    assert d.advice == [
        "Set a finite learning rate: it was inf at step 0 (check what set it: a scheduler, a config)."
    ]


def test_adam_in_float16_counts_the_gradients_that_are_exactly_zero() -> None:
    """ReLU zeros half of the first layer's gradient rows: their grad² is 0 in any dtype, and with eps 0 in
    float16 Adam's step there is 0/0. The text says how many, and 'every non-zero value' for the range."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 1)).half()
    with torch.no_grad():
        model[0].weight.copy_(torch.eye(4))
        model[0].bias.copy_(torch.tensor([1.0, 1.0, -9.0, -9.0]))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3, eps=1e-8)
    with nantrace.trace(model, optimizer=opt) as tr:
        opt.zero_grad()
        model(torch.ones(2, 4, dtype=torch.float16)).sum().backward()
        opt.step()
    d = diagnose(tr)
    assert d.cause == "optimizer" and d.overflow is not None
    name = d.overflow.tensor
    grad = tr.records.query(
        f"phase == 'backward' and module == '{d.overflow.module}' and tensor == '{name}.grad'"
    )
    n0, n = int(grad["n_zero"].iloc[0]), int(grad["numel"].iloc[0])
    assert n0 > 0
    line = next(e for e in d.evidence if e.startswith("Adam's default eps=1e-8 rounds to 0 in float16"))
    assert line.endswith(
        f"; {n0} of {n} values of `{name}.grad` are exactly 0: their grad² and first moment are 0, and with eps 0 "
        "Adam's step there is 0/0 = NaN"
    )
    assert "(every value above" not in line


def _c08(steps: int) -> Trace:
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    with torch.no_grad():
        model.weight.zero_()
        model.bias.copy_(torch.tensor([0.0, 30.0, 0.0]))
    target = torch.tensor([0, 0])

    def loss_fn(logits: torch.Tensor, _: torch.Tensor) -> torch.Tensor:
        probs = torch.softmax(logits.half(), dim=-1)  # fp16: exp(-30) -> 0
        return -torch.log(probs[torch.arange(2), target]).mean()

    return _amp_loop(model, steps, lambda s: (torch.randn(2, 4), target), loss_fn=loss_fn)


def test_c08_loss_outside_the_model_is_loss() -> None:
    d = diagnose(_c08(3))
    assert d.cause == "loss"
    assert d.overflow is not None and d.overflow.phase == "loss"
    assert any("log_softmax" in a or "cross_entropy" in a for a in d.advice)


def test_scale_halving_every_step_because_the_loss_is_inf_is_loss_not_collapse() -> None:
    tr = _c08(12)
    assert tr.steps["skipped"].tolist() == [True] * 12  # the symptom: a long run of skips, scale 65536 → 2
    assert tr.steps["next_scale"].tolist()[-1] == 65536.0 / 2**12
    d = diagnose(tr)
    assert d.cause == "loss"
    assert any("symptom" in e for e in d.evidence)


def test_c09_shared_layer_third_call_is_forward_overflow() -> None:
    class Thrice(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.shared = nn.Linear(4, 4, bias=False)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.shared(self.shared(self.shared(x)))

    m = Thrice()
    with torch.no_grad():
        m.shared.weight.fill_(12.0)
    m = m.half()
    with nantrace.trace(m) as tr:
        m(torch.full((1, 4), 10.0, dtype=torch.float16))
    d = diagnose(tr)
    assert d.cause == "forward_overflow"
    assert d.overflow is not None and (d.overflow.module, d.overflow.call) == ("shared", 2)


def test_c10_inplace_relu_amp_step_is_forward_overflow() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(inplace=True), nn.Linear(4, 4), nn.ReLU(inplace=True))
    with torch.no_grad():
        model[0].weight.fill_(1.0)
        model[0].bias.fill_(1.0)
        model[2].weight.fill_(3000.0)
    tr = _amp_loop(
        model, 1, lambda s: (torch.full((2, 4), 2.0), torch.zeros(2, 4)), loss_fn=lambda o, y: o.float().sum()
    )
    d = diagnose(tr)
    assert d.cause == "forward_overflow"
    assert d.overflow is not None and d.overflow.module == "2"
    assert any("autocast" in a and "model[2]" in a for a in d.advice)


def test_c11_transformer_with_causal_mask_is_healthy() -> None:
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(d_model=16, nhead=2, dim_feedforward=32, dropout=0.0, batch_first=True)
    model = nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False)
    causal = nn.Transformer.generate_square_subsequent_mask(6)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu", init_scale=256)
    with nantrace.trace(model, scaler=scaler, optimizer=opt) as tr:
        for _ in range(3):
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16):
                out = model(torch.randn(2, 6, 16), mask=causal)
            scaler.scale(out.float().pow(2).mean()).backward()
            scaler.step(opt)
            scaler.update()
    d = diagnose(tr)
    assert d.cause == "healthy" and d.overflow is None and d.advice == []


def _c12(steps: int = 6) -> Trace:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 1))
    x, y = torch.randn(256, 8) * 4, torch.randn(256, 1) * 3
    return _amp_loop(model, steps, lambda s: (x, y))


def test_c12_default_scaler_backoff_is_scaler_backoff() -> None:
    tr = _c12()
    assert tr.steps["skipped"].tolist() == [True, False, False, False, False, False]
    d = diagnose(tr)
    assert d.cause == "scaler_backoff" and d.ok
    assert d.overflow is not None and (d.overflow.step, d.overflow.phase, d.overflow.module) == (
        0,
        "backward",
        "4",
    )
    assert any("init_scale=32768" in a for a in d.advice)


def test_c13_gradient_accumulation_nan_is_data_at_micro_step_1() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    with nantrace.trace(model, optimizer=opt) as tr:
        for step in range(4):
            opt.zero_grad()
            for micro in range(3):
                x = torch.randn(2, 4)
                if (step, micro) == (2, 1):
                    x[1, 2] = math.nan
                (model(x).sum() / 3).backward()
            opt.step()
    d = diagnose(tr)
    assert d.cause == "data"
    assert d.overflow is not None and (d.overflow.step, d.overflow.micro_step) == (2, 1)
    assert any("step 2, micro-step 1" in a for a in d.advice)


def _c14() -> Trace:
    model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 8), nn.Linear(8, 1))
    with torch.no_grad():
        model[0].weight.fill_(0.01)
        model[0].bias.zero_()
        model[1].weight.fill_(400.0)
        model[1].bias.zero_()
        model[2].weight.fill_(30.0)
        model[2].bias.zero_()
    model = model.half()
    with nantrace.trace(model) as tr:
        model(torch.full((1, 4), 0.5, dtype=torch.float16)).sum().backward()
    return tr


def test_c14_backward_grad_input_overflow_is_backward_overflow() -> None:
    d = diagnose(_c14())
    assert d.cause == "backward_overflow"
    assert d.overflow is not None and (d.overflow.phase, d.overflow.module) == ("backward", "1")
    assert any("no GradScaler" in e for e in d.evidence)
    assert any("`1`" in a for a in d.advice)
    assert (
        d.summary
        == "The backward of `1` (Linear) overflowed float16 at step 0; with no GradScaler, nothing skipped the step."
    )


# ============================================================================================ one per cause
def test_data_nan_in_the_input_of_a_plain_fp32_model() -> None:
    model = nn.Sequential(nn.Linear(3, 2))
    with nantrace.trace(model) as tr:
        model(torch.tensor([[1.0, math.nan, 2.0]]))
    d = diagnose(tr)
    assert d.cause == "data" and any("nan_to_num" in a for a in d.advice)


class Normalize(nn.Module):
    """L2 normalisation written without eps: an all-zero row is 0/0."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x / x.norm(dim=-1, keepdim=True)


def test_invalid_op_forward_zero_over_zero_advises_eps() -> None:
    model = nn.Sequential(nn.Linear(4, 4), Normalize())
    with torch.no_grad():
        model[0].weight.zero_()
        model[0].bias.zero_()
    with nantrace.trace(model) as tr:
        model(torch.ones(2, 4))
    d = diagnose(tr)
    assert d.cause == "invalid_op"
    assert d.overflow is not None and d.overflow.module == "1" and d.overflow.phase == "forward"
    assert any("eps" in a for a in d.advice)


def test_invalid_op_evidence_quotes_the_faulty_micro_step_and_names_the_submodule_input() -> None:
    """Two micro-steps: the first's input (3: fc1 gives 12) is healthy, the second's (2: fc1 gives 8) makes NaN in
    the root's own code. The evidence quotes the second micro-step's input absmax (2, not 3) and says where the NaN
    was first seen (``fc2``'s input, not the root's)."""
    m = SqrtBetween(weight=1.0, shift=10.0)
    opt = torch.optim.SGD(m.parameters(), lr=0.0)
    with nantrace.trace(m, optimizer=opt) as tr:
        opt.zero_grad()
        for v in (3.0, 2.0):
            loss = m(torch.full((2, 4), v)).sum()
            loss.backward()
        tr.step(loss=loss)
        opt.step()
    d = diagnose(tr)
    assert d.cause == "invalid_op"
    assert d.evidence[0] == (
        "the root model (SqrtBetween, call 0) at step 0, micro-step 1 produced NaN, first seen in `input[0]` of "
        "`fc2` (float32), from inputs holding no NaN (finite absmax 2, no -inf)"
    )


def _collapse(init_scale: float, steps: int) -> Trace:
    """The backward of `1` overflows float16 at every scale: its weights (1000) times a large incoming
    gradient (loss = 100 · out) exceed 65504 even unscaled, while the forward stays small."""
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1))
    with torch.no_grad():
        model[0].weight.fill_(1e-3)
        model[0].bias.zero_()
        model[1].weight.fill_(1000.0)
        model[1].bias.zero_()
    return _amp_loop(
        model,
        steps,
        lambda s: (torch.ones(2, 4), torch.zeros(2, 1)),
        init_scale=init_scale,
        loss_fn=lambda o, y: o.float().sum() * 100.0,
    )


def test_loss_scale_collapse_scale_below_one() -> None:
    tr = _collapse(4.0, 4)
    assert tr.steps["skipped"].tolist() == [True] * 4
    assert tr.steps["next_scale"].tolist()[-1] < 1
    d = diagnose(tr)
    assert d.cause == "loss_scale_collapse"
    assert d.overflow is not None and (d.overflow.phase, d.overflow.step) == ("backward", 3)  # lowest scale
    assert any("below 1" in e for e in d.evidence)


def test_a_collapse_of_one_skip_says_one_scale_was_tried_not_that_the_scale_kept_falling() -> None:
    tr = _collapse(1.0, 1)
    assert tr.steps["skipped"].tolist() == [True] and tr.steps["next_scale"].tolist() == [0.5]
    d = diagnose(tr)
    assert d.cause == "loss_scale_collapse"
    assert d.summary == (
        "The gradients overflowed at loss scale 1, the only scale tried (step 0), and the GradScaler lowered it to "
        "0.5: they overflow without loss scaling."
    )


def test_loss_scale_collapse_long_run_of_skips() -> None:
    tr = _collapse(2.0**14, 9)
    assert tr.steps["skipped"].tolist() == [True] * 9 and tr.steps["next_scale"].min() >= 1
    assert _cause(tr) == "loss_scale_collapse"


def test_short_trailing_backoff_with_default_scale_is_benign() -> None:
    tr = _c12(1)
    assert tr.steps["skipped"].tolist() == [True]
    d = diagnose(tr)
    assert d.cause == "scaler_backoff" and any("trace more steps" in e for e in d.evidence)


def test_real_fault_after_a_benign_backoff_is_reported_not_the_backoff() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 1))
    x, y = torch.randn(256, 8) * 4, torch.randn(256, 1) * 3

    def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        return (x * 1e4 if step == 4 else x), y  # an outlier batch at step 4

    tr = _amp_loop(model, 5, batch)
    assert tr.steps["skipped"].tolist()[0] is True
    d = diagnose(tr)
    assert d.cause == "forward_overflow"
    assert d.overflow is not None and d.overflow.step == 4


def _diverging(lr: float, steps: int = 12, spike_at: int | None = None) -> Trace:
    """A linear layer under fp16 autocast trained by SGD on a fixed batch. With lr=2 every step multiplies the
    error by 1 - 2.5·lr = -4: weights, outputs and loss grow 4x/4x/16x per step until the output overflows
    float16 at step 8. With a small lr training is stable, and ``spike_at`` feeds one outlier batch."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4))
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    y = torch.zeros(8, 4)
    with nantrace.trace(model, optimizer=opt) as tr:
        for step in range(steps):
            x = torch.ones(8, 4) * (1e5 if step == spike_at else 1.0)
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16):
                out = model(x)
            loss = F.mse_loss(out.float(), y)
            tr.step(loss)
            loss.backward()
            opt.step()
            if not torch.isfinite(out).all():
                break
    return tr


def test_divergence_too_high_lr_grows_until_forward_overflow() -> None:
    tr = _diverging(lr=2.0)
    ov = tr.first_overflow()
    assert ov is not None and (ov.phase, ov.module, ov.step) == ("forward", "0", 8)
    d = diagnose(tr)
    assert d.cause == "divergence"
    assert d.overflow == ov
    assert any("update-to-weight ratio" in e for e in d.evidence)
    assert any("loss rose" in e for e in d.evidence)
    assert any("learning rate from 2" in a for a in d.advice)
    ratios = update_ratios(tr.records)
    assert set(ratios.columns) >= {"step", "module", "tensor", "ratio"} and ratios["ratio"].median() > 1


@pytest.mark.parametrize("every", [1, 2, 4])
def test_update_ratio_is_a_change_per_step_whatever_the_steps_between_recordings(every: int) -> None:
    # SGD on sum(w · 1) moves every weight by lr = 2**-7 per step, exactly in float32, from w = 1
    m = nn.Linear(4, 1, bias=False)
    with torch.no_grad():
        m.weight.fill_(1.0)
    opt = torch.optim.SGD(m.parameters(), lr=2**-7)
    with nantrace.trace(m, optimizer=opt, every=every) as tr:
        for _ in range(9):
            opt.zero_grad()
            loss = m(torch.ones(1, 4)).sum()
            loss.backward()
            tr.step(loss=loss)
            opt.step()
    ur = update_ratios(tr.records)
    assert ur["step"].tolist() == list(range(every, 9, every))
    assert ur["gap"].tolist() == [every] * len(ur)
    assert ur["absmax"].tolist() == [1 - (s + 1) * 2**-7 for s in ur["step"]]
    assert ur["ratio"].tolist() == pytest.approx((2**-7 / ur["absmax_before"]).tolist(), rel=1e-12)


def test_one_outlier_batch_after_stable_training_is_forward_overflow_not_divergence() -> None:
    tr = _diverging(lr=1e-3, steps=6, spike_at=5)
    ov = tr.first_overflow()
    assert ov is not None and (ov.phase, ov.step) == ("forward", 5)
    assert _cause(tr) == "forward_overflow"


def test_gradient_underflow_fp16_without_scaler() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 1)).half()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    with nantrace.trace(model, optimizer=opt) as tr:
        for _ in range(2):
            opt.zero_grad()
            (model(torch.randn(16, 8).half()).mean() * 1e-6).backward()  # gradients ~1e-8: below 2**-24
            opt.step()
    assert tr.first_overflow() is None
    d = diagnose(tr)
    assert d.cause == "gradient_underflow" and d.overflow is None
    assert any("GradScaler" in a for a in d.advice)
    assert any("zeros" in e for e in d.evidence)


def test_healthy_fp32_mlp_and_quiet_growth_is_not_flagged() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 1))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    x, y = torch.randn(32, 4), torch.randn(32, 1)
    with nantrace.trace(model, optimizer=opt) as tr:
        for _ in range(5):
            opt.zero_grad()
            loss = F.mse_loss(model(x), y)
            tr.step(loss)
            loss.backward()
            opt.step()
    d = diagnose(tr)
    assert d.cause == "healthy"
    assert "healthy" in str(d).lower()


@pytest.mark.parametrize(
    ("options", "caveat"),
    [
        ({}, None),
        (
            {"drill": False},
            "drill=False: no finite module call was replayed, so a transient inf inside one is not seen",
        ),
        (
            {"sync_free": True},
            "statistics were computed on the sync-free path (on-device reductions): the drill-down replays no "
            "module call there, so a transient inf inside one is not seen",
        ),
        (
            {"every": 2},
            "1 of 3 steps were light (every=2: only tensors holding inf/NaN get a row), so no signal of a "
            "transient inf inside a module was read on them",
        ),
    ],
    ids=["default", "drill_off", "sync_free", "every_2"],
)
def test_a_healthy_verdict_says_when_a_transient_inf_could_not_be_looked_for(
    options: dict[str, Any], caveat: str | None
) -> None:
    """Healthy runs: the default trace looks for transient infs on every step (no caveat); with the drill-down
    off, on the sync-free path or on light steps it could not, and the healthy verdict says which."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    with nantrace.trace(model, **options) as tr:
        for _ in range(3):
            model(torch.randn(2, 4)).sum().backward()
            tr.step()
    d = diagnose(tr)
    assert d.cause == "healthy"
    if caveat is None:
        assert d.summary == "Healthy: every recorded value was finite and nothing points to a fault."
        assert not any("transient inf" in e for e in d.evidence)
    else:
        assert caveat in d.evidence
        assert d.summary == (
            "Healthy as far as recorded: every recorded value was finite, but a transient inf inside a module "
            "(turned finite by its own code, e.g. tanh(inf) = 1) could not be looked for on every step."
        )


class _OwnCodeBlock(nn.Module):
    """An identity Linear, then a multiply in the block's own forward that overflows float16."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(2, 2, bias=False)
        with torch.no_grad():
            self.fc.weight.copy_(torch.eye(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x) * 1e4


def test_overflow_in_a_blocks_own_code_is_said_to_be_seen_at_its_own_output() -> None:
    m = nn.Sequential(_OwnCodeBlock()).half()
    with nantrace.trace(m) as tr:
        m(torch.full((1, 2), 10.0, dtype=torch.float16))
    d = diagnose(tr)
    assert (d.cause, d.overflow.module if d.overflow else None) == ("forward_overflow", "0")
    assert d.evidence[1] == (
        "first seen at `output` of `0` itself, not of a submodule: the overflow is in `0`'s own forward code "
        "between its submodules (every submodule output before it was finite)"
    )


def _shared_scaler_run(phases: list[str] | None = None) -> Trace:
    """G traced; the optimizer also steps ``extra``, a parameter outside G whose gradient is +inf at steps 1-2
    (as a discriminator sharing the GradScaler would overflow): the scaler skips steps 1 and 2."""
    torch.manual_seed(0)
    g = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 1))
    extra = nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([*g.parameters(), extra], lr=1e-3)
    scaler = torch.amp.GradScaler("cpu", init_scale=4.0)
    with nantrace.trace(g, scaler=scaler, optimizer=opt, phases=phases) as tr:
        for step in range(4):
            opt.zero_grad()
            scaler.scale(g(torch.ones(1, 2)).sum()).backward()
            extra.grad = torch.full((1,), math.inf if step in (1, 2) else 0.0)
            scaler.step(opt)
            scaler.update()
    return tr


def test_scaler_skips_with_no_nonfinite_value_in_the_model_are_not_blamed_on_it() -> None:
    tr = _shared_scaler_run()
    assert tr.steps["skipped"].tolist() == [False, True, True, False]
    assert tr.first_overflow() is None
    d = diagnose(tr)
    assert (d.cause, d.overflow, d.ok) == ("scaler_backoff", None, True)
    assert d.summary == (
        "The GradScaler skipped 2 step(s), but this model's gradients stayed finite: the overflow came from "
        "outside the traced model (e.g. another model sharing the GradScaler)."
    )
    assert d.evidence[:2] == [
        "no value recorded in this model's forward, loss or backward held inf/NaN, at the skipped steps 1–2 or "
        "any other (the backward of every module and parameter was traced)",
        "so the non-finite gradients the scaler found were outside the traced model: another model sharing the "
        "GradScaler (e.g. a GAN's discriminator), or parameters the optimizer steps that are not in it",
    ]
    assert d.advice[0].startswith("Nothing to fix in this model.")
    assert d.headline == "GradScaler skipped step(s) 1–2; this model's traced gradients stayed finite"
    # without the backward recorded nothing proves the gradients finite: not this rule
    assert "outside the traced model" not in diagnose(_shared_scaler_run(["forward"])).summary


def test_every_cause_is_covered_above() -> None:
    import inspect
    import sys

    src = inspect.getsource(sys.modules[__name__])
    # "received" needs the reduced gradients of a process group: tests/test_distributed.py covers it
    src += (Path(__file__).parent / "test_distributed.py").read_text()
    for cause in CAUSES:
        assert f'"{cause}"' in src


# ============================================================================================ the object
def test_diagnosis_str_html_escape_and_validation(tmp_path: Path) -> None:
    d = Diagnosis("healthy", None, ["<b>&"], ['use "x" <y>'], summary="a<b")
    h = d._repr_html_()
    assert "<b>&" not in h and "&lt;b&gt;&amp;" in h and "&lt;y&gt;" in h and "a&lt;b" in h
    assert "evidence" in str(d) and "<b>&" in str(d)
    with pytest.raises(ValueError, match="cause"):
        Diagnosis("nan", None)
    from nantrace import _diagnose

    with pytest.raises(TypeError, match="run view"):
        _diagnose.diagnose(object())  # type: ignore[arg-type]
    tr = _c14()
    d = diagnose(tr)
    assert d.to_dict()["overflow"]["module"] == "1"
    assert "backward_overflow" in repr(d) and "<code>backward_overflow</code>" in d._repr_html_()
    back = nantrace.load(tr.save(tmp_path / "c14.nantrace"))
    assert diagnose(back) == d


# ============================================================================================ fp16 readiness
def test_fp16_readiness_from_fp32_run_lists_overflow_and_underflow_worst_first() -> None:
    m = _c01()  # float32: ff.wo gives 1100·64/16·... ≈ 7e4, above float16's 65504
    tiny = nn.Linear(8, 8)
    with torch.no_grad():
        tiny.weight.fill_(1e-9)
        tiny.bias.zero_()
    model = nn.Sequential(m, tiny)
    with nantrace.trace(model) as tr:
        out = model(torch.full((2, 16), 1100.0))
        out.sum().backward()
    assert tr.first_overflow() is None  # float32 holds it
    df = fp16_readiness(tr)
    assert list(df.columns) == list(READINESS_COLUMNS)
    first = df.iloc[0]
    assert first["verdict"] == "overflow"
    over = df[df["verdict"] == "overflow"]
    assert "0.ff.wo" in set(over["module"])
    wo = over[(over["module"] == "0.ff.wo") & (over["tensor_kind"] == "output")].iloc[0]
    assert wo["absmax"] == pytest.approx(70400.0)
    assert wo["headroom_bits"] == pytest.approx(math.log2(65504 / 70400))
    out1 = df[(df["module"] == "1") & (df["tensor_kind"] == "output")].iloc[0]
    assert out1["verdict"] in ("underflow", "subnormal") and out1["footroom_bits"] < 0
    ranks = df["verdict"].map({"nonfinite": 0, "overflow": 1, "underflow": 2, "subnormal": 3, "ok": 4})
    assert ranks.is_monotonic_increasing
    assert set(df["phase"]) >= {"data", "forward", "backward"}
    # a GradScaler-sized loss scale pushes gradients up: more overflow rows, never fewer
    scaled = fp16_readiness(tr.records, loss_scale=65536.0)
    assert (scaled["verdict"] == "overflow").sum() >= (df["verdict"] == "overflow").sum()
    with pytest.raises(ValueError, match="loss_scale"):
        fp16_readiness(tr, loss_scale=0)
    with pytest.raises(TypeError):
        fp16_readiness(3)  # type: ignore[arg-type]


def test_fp16_readiness_of_a_small_healthy_run_is_ok() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh())
    with nantrace.trace(model) as tr:
        model(torch.full((2, 4), 0.5))
    df = fp16_readiness(tr)
    assert set(df["verdict"]) == {"ok"}
    assert (df["headroom_bits"] > 10).all()


# ============================================================================================ compare
def _c01_run(dtype: torch.dtype) -> Trace:
    m = _c01().to(dtype)
    with nantrace.trace(m) as tr:
        m(torch.full((2, 16), 1100.0, dtype=dtype))
    return tr


def test_compare_fp32_against_fp16_names_the_overflowing_layer() -> None:
    a, b = _c01_run(torch.float32), _c01_run(torch.float16)
    c = compare(a, b)
    assert isinstance(c, Comparison) and c.diverged
    assert c.first is not None
    assert (c.first["phase"], c.first["module"], c.first["tensor"]) == ("forward", "ff.wo", "output")
    assert bool(c.first["finite_a"]) and not bool(c.first["finite_b"])
    assert c.n_only_a == c.n_only_b == 0
    assert len(c.diffs) == len(a.records) and len(c.divergent) >= 1
    assert "ff.wo" in str(c) and "ff.wo" in c._repr_html_()
    # rows before it (data, ff.wi, ff.act) agree within the default tolerance
    before = c.diffs.iloc[: c.diffs.index[c.diffs["diverged"]][0]]
    assert len(before) >= 3 and not before["diverged"].any()


def test_compare_identical_runs_and_tolerances() -> None:
    a, b = _c01_run(torch.float32), _c01_run(torch.float32)
    c = compare(a.records, b.records)
    assert not c.diverged and c.first is None and (c.diffs["diff_bits"] == 0).all()
    assert "no divergence" in str(c)
    loose = compare(_c01_run(torch.float32), _c01_run(torch.float16), tol_bits=40)
    assert loose.first is not None and loose.first["module"] == "ff.wo"  # finiteness differs at any tolerance
    with pytest.raises(ValueError, match="not both"):
        compare(a, b, rtol=0.1, tol_bits=1.0)
    with pytest.raises(ValueError, match="rtol"):
        compare(a, b, rtol=-1)
    with pytest.raises(TypeError):
        compare(a, 3)  # type: ignore[arg-type]


def test_compare_scaled_fp16_gradients_against_fp32_are_unscaled() -> None:
    def run(amp: bool) -> pd.DataFrame:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 1))
        opt = torch.optim.SGD(model.parameters(), lr=1e-3)
        scaler = torch.amp.GradScaler("cpu", init_scale=1024, enabled=amp)
        x = torch.randn(8, 4)
        with nantrace.trace(model, scaler=scaler if amp else None, optimizer=opt) as tr:
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16, enabled=amp):
                out = model(x)
            scaler.scale(out.float().mean()).backward()
            scaler.step(opt)
            scaler.update()
        return tr.records

    c = compare(run(False), run(True), tol_bits=0.05)
    grads = c.diffs[c.diffs["tensor"].str.endswith(".grad")]
    assert len(grads) == 4 and (grads["diff_bits"] < 0.05).all()


def test_quiet_divergence_before_any_overflow() -> None:
    tr = _diverging(lr=2.0, steps=6)  # outputs 1.2 → 1243: still finite in float16
    assert tr.first_overflow() is None
    d = diagnose(tr)
    assert d.cause == "divergence" and d.overflow is None
    assert "no overflow yet" in d.summary


class HalfGate(Gate):
    """Gate computed in float16 even under autocast, so its 1e-6 guard rounds away and log1p(-1) = -inf."""

    def forward(self, p: torch.Tensor) -> torch.Tensor:
        return super().forward(p.half())


def test_backward_nan_that_persists_under_a_scaler_is_invalid_op_not_backoff() -> None:
    model = nn.Sequential(nn.Linear(4, 4), HalfGate())
    with torch.no_grad():
        model[0].weight.zero_()
        model[0].bias.copy_(torch.tensor([0.1, 0.2, 1.0, 0.3]))  # p = 1.0 in a discarded entry
    tr = _amp_loop(
        model, 3, lambda s: (torch.ones(1, 4), torch.zeros(1, 4)), loss_fn=lambda o, y: o.float().sum()
    )
    assert tr.steps["skipped"].tolist() == [True, True, True]
    d = diagnose(tr)
    assert d.cause == "invalid_op"
    assert d.overflow is not None and (d.overflow.phase, d.overflow.module, d.overflow.kind) == (
        "backward",
        "1",
        "nan",
    )


def test_divergence_under_a_grad_scaler_is_not_called_backoff_or_collapse() -> None:
    """With a scaler the growing gradients overflow first: the scaler skips and halves again and again, and
    the weights grow on every step it lets through. The root cause is the learning rate."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4))
    tr = _amp_loop(model, 14, lambda s: (torch.ones(8, 4), torch.zeros(8, 4)), lr=2.0)
    assert tr.steps["skipped"].sum() >= 7
    d = diagnose(tr)
    assert d.cause == "divergence"
    assert d.overflow is not None and d.overflow.phase == "backward"
    assert d.overflow.dtype == "float32"  # the float32 `.grad` of a backward computed in float16
    assert d.advice[1] == (
        "Clip gradients: `scaler.unscale_(optimizer)` then `torch.nn.utils.clip_grad_norm_(model.parameters(), "
        "1.0)` before `scaler.step(optimizer)`."
    )
    assert (
        d.advice[2]
        == "Keeping a layer in float32 only postpones the overflow: the weights themselves grow step after step."
    )


def test_a_float32_divergence_without_a_scaler_is_not_told_to_keep_float32_or_use_the_scaler() -> None:
    """An fp32 run with a learning rate of 3 grows until float32 itself overflows in backward: float32 cannot be
    the remedy, and a loop with no GradScaler is told to clip without one."""
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    opt = torch.optim.SGD(m.parameters(), lr=3.0)
    x, y = torch.randn(32, 8), torch.randn(32, 1)
    with nantrace.trace(m, optimizer=opt) as tr:
        for _ in range(12):
            opt.zero_grad()
            loss = ((m(x) - y) ** 2).mean()
            loss.backward()
            opt.step()
            if not torch.isfinite(loss):
                break
    d = diagnose(tr)
    assert d.cause == "divergence"
    assert d.overflow is not None and d.overflow.dtype == "float32"
    assert d.advice[1:] == [
        "Clip gradients: `torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)` just before `optimizer.step()`.",
        "A wider dtype does not help: float32 itself overflowed, and each update changes the weights too much for "
        "the activations to stay in range.",
    ]


def test_fp16_readiness_from_a_bf16_run_flags_what_float16_cannot_hold() -> None:
    lin = nn.Linear(4, 4, bias=False).to(torch.bfloat16)
    with torch.no_grad():
        lin.weight.fill_(1000.0)
    model = nn.Sequential(lin)
    with nantrace.trace(model) as tr:
        model(torch.full((1, 4), 100.0, dtype=torch.bfloat16))  # 4e5: fine in bf16, inf in fp16
    assert tr.first_overflow() is None
    df = fp16_readiness(tr)
    top = df.iloc[0]
    assert (top["module"], top["tensor_kind"], top["verdict"], top["dtype"]) == (
        "0",
        "output",
        "overflow",
        "bfloat16",
    )
    assert top["headroom_bits"] == pytest.approx(math.log2(65504 / 400000), abs=0.01)


def test_a_later_step_computing_from_weights_the_optimizer_made_nan_says_so() -> None:
    """After step 1's optimizer.step() divides the biases by 0 (±inf), step 2's Linear computes +inf from them: its
    event says which weights held it since which step, not 'an invalid op: add eps' (found by the new-user
    check)."""
    tr = _float32_optimizer_run(DivideByState)
    later = tr.overflows().set_index("step")
    assert later.loc[2, "module"] == "0" and later.loc[2, "phase"] == "forward"
    msg = later.loc[2, "message"]
    assert (
        msg.splitlines()[0]
        == "step 2 forward: `0` (`linear`) computed +inf from its own non-finite weights (float32)"
    )
    assert (
        "from finite inputs (input absmax 1): its parameter `bias` (operand arg2) held +inf and -inf when the "
        "forward read it, since optimizer.step() of step 1."
    ) in msg
    assert (
        "operand arg2 (float32, 4 values, parameter `bias`): absmax n/a, 2 +inf, 2 -inf" in msg.splitlines()
    )
    assert "add eps" not in msg


class NormNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc, self.norm = nn.Linear(4, 4), nn.LayerNorm(4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.fc(x))


@pytest.mark.parametrize("drill", [True, False], ids=["op_facts", "live_model"])
def test_a_nan_written_into_a_norm_weight_between_steps_is_named(drill: bool) -> None:
    """Before step 2 the loop writes NaN into the LayerNorm's weight (outside optimizer.step()). The forward
    replay names the operand that is that parameter; without it (``drill=False``), the GradScaler skips every
    later step, so the live weight is the one that forward used."""
    torch.manual_seed(0)
    model = NormNet()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu", init_scale=256.0)
    with nantrace.trace(model, scaler=scaler, optimizer=opt, drill=drill) as tr:
        for step in range(4):
            if step == 2:
                with torch.no_grad():
                    model.norm.weight[1] = math.nan
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16):
                loss = model(torch.ones(2, 4)).float().pow(2).mean()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
    assert tr.steps["skipped"].tolist() == [False, False, True, True]
    ov = tr.first_overflow()
    assert ov is not None and (ov.step, ov.phase, ov.module, ov.kind) == (2, "forward", "norm", "nan")
    d = diagnose(tr)
    assert d.cause == "invalid_op"
    assert d.summary == (
        "`norm` computed NaN at step 2 from its own weights, which already held non-finite values: not this "
        "forward's arithmetic."
    )
    live = (
        "invalid: its own parameter `weight` held NaN in the live model, where its last optimizer row (step 1) was "
        "finite: it was written outside optimizer.step()"
    )
    read = (
        "`norm`'s parameter `weight` held NaN when the forward read it; its optimizer row of step 1 was finite: it "
        "was written outside optimizer.step() (after the update of step 1, before this forward)"
    )
    assert (live in d.evidence, read in d.evidence) == ((False, True) if drill else (True, False))
    if drill:
        line = next(e for e in d.evidence if e.startswith("operand weight "))
        assert line.startswith("operand weight (float32, 4 values, parameter `weight`): absmax ")
        assert line.endswith(", 1 NaN")
    assert d.advice == [
        "The weights of `norm` were already non-finite when its forward read them: the fault is what wrote them (an "
        "optimizer step whose own fault came first, a manual edit, a state-dict load), not this forward. Restore "
        "them from a checkpoint and fix that writer."
    ]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bfloat16", "float32"])
def test_an_overflow_in_a_dtype_of_float32s_range_gets_no_wider_dtype_advice(dtype: torch.dtype) -> None:
    """A Linear of weights 1e20 on inputs of 1e20 sums 4 products of 1e40, beyond ~3.4e38 in bfloat16 and in
    float32 alike: neither 'keep it in float32' nor 'train in bfloat16' helps (was advised to a bfloat16 run and
    a float32 one, found by both new-user checks)."""
    model = nn.Sequential(nn.Linear(4, 2)).to(dtype)
    with torch.no_grad():
        model[0].weight.fill_(1e20)
        model[0].bias.zero_()
    with nantrace.trace(model) as tr:
        model(torch.full((1, 4), 1e20, dtype=dtype)).float().sum().backward()
    ov = tr.first_overflow()
    name = str(dtype).removeprefix("torch.")
    assert ov is not None and (ov.phase, ov.module, ov.kind, ov.dtype) == ("forward", "0", "inf", name)
    text = str(ov)
    assert "use bfloat16" not in text and "compute the product in float32" not in text
    assert f"Values beyond the {name} range mean a computation that blows up" in text
    d = diagnose(tr)
    assert d.cause == "forward_overflow"
    limit = "3.39e+38" if dtype == torch.bfloat16 else "3.403e+38"
    assert d.advice[-1] == (
        f"Values beyond {name}'s {limit} in `0` mean a computation that blows up (exp or pow of a large input, a "
        "growing residual, weights or values growing over steps), not a dtype too narrow: clamp or rescale what "
        "feeds it, or lower the learning rate if they grew over steps."
    )
    assert not any("bfloat16 (`torch.autocast" in a or "in float32 while the rest" in a for a in d.advice)


def test_an_input_already_beyond_float16_is_to_be_rescaled_where_it_is_made() -> None:
    """A float32 input of absmax 2e5 that autocast casts to float16 for a Linear: the advice is about the input,
    not the Linear's weights (was 'multiplies inputs … into values above 65504: … or shrink its weights')."""
    model = nn.Sequential(nn.Linear(4, 2))
    with nantrace.trace(model) as tr, torch.autocast("cpu", dtype=torch.float16):
        model(torch.full((1, 4), 2e5)).float().sum().backward()
    d = diagnose(tr)
    assert d.cause == "forward_overflow" and d.overflow is not None and d.overflow.module == "0"
    assert d.advice[0] == (
        "The input of `0` (absmax 200000) is already beyond float16's 65504 before it computes anything: rescale "
        "or normalise it where it is made (the data, or what runs before this module)."
    )
    assert not any("shrink its weights" in a for a in d.advice)


class WhereSqrt(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.where(x > 0, torch.sqrt(x), torch.zeros_like(x))


def test_a_discarded_sqrt_of_a_negative_is_explained_as_0_times_nan_not_only_0_times_inf() -> None:
    """sqrt(-1) is NaN, discarded by where; its derivative there is NaN, and 0·NaN is the backward's NaN: the text
    names both kinds of non-finite derivative (was '0·inf … derivative is infinite' only)."""
    model = nn.Sequential(WhereSqrt())
    x = torch.tensor([[1.0, -1.0, 4.0]], requires_grad=True)
    with nantrace.trace(model) as tr:
        model(x).sum().backward()
    d = diagnose(tr)
    assert d.cause == "invalid_op" and d.overflow is not None and d.overflow.phase == "backward"
    assert d.advice[0].startswith(
        "In the backward of `0`: an op whose derivative is not finite at the values it saw (inf for log/log1p or "
        "sqrt at 0 and x/0, NaN for sqrt/log of a negative)"
    )
    assert "0·inf or 0·NaN = NaN" in d.advice[0]


def test_inputs_that_grow_every_step_are_named_in_a_forward_overflow() -> None:
    """The hunt example's features double every step (``GROWTH = 2``) until ``q @ kᵀ`` overflows float16 at step
    8: the diagnosis says the model's inputs grew (their recorded absmax over the trailing 8 steps) and leads its
    advice with normalising them; a trace with ``every=10`` records the inputs of step 0 only and says nothing
    about them."""
    from nantrace.examples.hunting import Trainer, batch, build

    for every, seen in ((1, True), (10, False)):
        model = build()
        trainer = Trainer(model, lr=0.001)
        with nantrace.trace(model, optimizer=trainer.optimizer, every=every) as tr:
            for i in range(9):
                if not math.isfinite(trainer.step(i)):
                    break
        d = tr.diagnose()
        assert d.cause == "forward_overflow"
        assert d.overflow is not None and (d.overflow.step, d.overflow.module) == (8, "blocks.0.attn")
        first, last = (float(batch(s)[0].abs().max()) for s in (1, 8))
        line = (
            f"the model's inputs (phase data) grew ×{num(last / first)} over steps 1–8 (absmax {num(first)} → "
            f"{num(last)}), rising in 100% of the steps"
        )
        assert (line in d.evidence) is seen
        assert d.advice[0].startswith("The model's inputs grow step after step") is seen


class _ShiftedSqrt(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.shift = -100.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sqrt(x - self.shift)


class _SqrtNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.sq, self.b = nn.Linear(4, 8), _ShiftedSqrt(), nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.sq(self.a(x)))


@pytest.mark.parametrize("make", [nantrace.trace, nantrace.watch], ids=["trace", "watch"])
def test_a_singular_point_during_fast_updates_is_invalid_op_not_divergence(make: Any) -> None:
    """float32, SGD at an lr whose updates are far too fast, and at step 2 a sqrt of a negative: the value was
    made at the op's singular point, not by growth, so the cause is invalid_op under trace and watch (the
    divergence rule alone would fire on trace's history) and no text calls it an overflow."""
    from nantrace._facts import Facts, divergence

    torch.manual_seed(0)
    m = _SqrtNet()
    opt = torch.optim.SGD(m.parameters(), lr=0.01)
    x, y = torch.randn(8, 4), torch.randn(8, 1)
    with make(m, optimizer=opt) as tr:
        for s in range(4):
            m.sq.shift = 100.0 if s == 2 else -100.0
            loss = ((m(x) - y) ** 2).mean()
            loss.backward()
            tr.step(loss=loss)
            opt.step()
            opt.zero_grad()
    d = tr.diagnose()
    assert d.overflow is not None and (d.overflow.step, d.overflow.module, d.overflow.kind) == (
        2,
        "sq",
        "nan",
    )
    assert d.cause == "invalid_op" and d.op_class == "singular"
    assert "overflowed" not in str(d)
    if make is nantrace.trace:
        assert divergence(Facts(tr._view()), 2, "sq").found


def _scaled_loss_run(
    init_scale: float, factor: float, steps: int, m: nn.Module | None = None, batch: int = 4
) -> nantrace.Trace:
    torch.manual_seed(0)
    m = m or nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 1))
    opt = torch.optim.SGD(m.parameters(), lr=0.0)
    scaler = torch.amp.GradScaler("cpu", init_scale=init_scale)
    with nantrace.trace(m, optimizer=opt, scaler=scaler) as tr:
        for _ in range(steps):
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16):
                loss = m(torch.rand(batch, 8) * 0.5).float().mean() * factor
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
    return tr


def test_a_loss_gradient_still_overflowing_at_a_large_scale_is_not_said_to_overflow_at_a_small_one() -> None:
    d = _scaled_loss_run(2.0**40, 1.0, 12).diagnose()  # a walk-down from 2**40, still falling at 2**29
    assert d.cause == "loss_scale_collapse"
    assert d.advice[0] == (
        "The gradient of the loss w.r.t. the outputs still exceeded 65504 at loss scale 5.369e+08. If the scale "
        "goes on falling towards 1, the loss is too large for it (e.g. a sum over many elements): use a mean, "
        "divide it, or compute it in float32."
    )


def test_a_loss_gradient_overflowing_below_loss_scale_1_says_the_loss_is_too_large() -> None:
    # one output, inputs below 0.5: only the gradient at the output (1e7 x scale) overflows float16
    d = _scaled_loss_run(2.0, 1e7, 10, nn.Linear(8, 1), batch=1).diagnose()
    assert d.cause == "loss_scale_collapse"
    assert (
        "The gradient of the loss w.r.t. the outputs exceeds 65504 even below loss scale 1 (0.007812): the loss is "
        "too large (e.g. a sum over many elements); use a mean, divide it, or compute it in float32."
    ) in d.advice


def test_a_nan_loss_recorded_after_its_backward_is_said_to_be_nan_not_unrecorded() -> None:
    torch.manual_seed(0)
    m = nn.Linear(4, 1)
    opt = torch.optim.SGD(m.parameters(), lr=0.01)
    with nantrace.trace(m, optimizer=opt) as tr:
        for i in range(3):
            valid = torch.full((8,), i != 2)  # step 2: no valid target, so the loss is 0/0
            opt.zero_grad()
            loss = ((m(torch.randn(8, 4)).squeeze(-1) - torch.randn(8)) ** 2 * valid).sum() / valid.sum()
            loss.backward()
            tr.step(loss=loss)  # as the README says, after the backward
            opt.step()
    ov = tr.first_overflow()
    assert ov is not None and (ov.step, ov.phase, ov.tensor, ov.kind) == (2, "loss", "grad_output[0]", "nan")
    d = tr.diagnose()
    assert (
        "loss value at step 2: NaN (float32), recorded after the backward that sent the gradient"
        in d.evidence
    )
    assert d.advice[-1].startswith(
        "The loss was NaN and so was the gradient it sent back to the model's outputs: "
    )
    assert not any("not recorded" in line for line in [*d.evidence, *d.advice])


class _ScaledTable(nn.Module):
    """Looks rows up in its own table and doubles them: its only input is integer indices."""

    def __init__(self) -> None:
        super().__init__()
        self.table = nn.Parameter(torch.full((10, 4), 40000.0, dtype=torch.float16))
        self.out = nn.Linear(4, 1).half()

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.out(self.table[idx] * 2)  # 80000 > 65504 in float16, between no submodule outputs


def test_an_overflow_from_integer_inputs_says_no_floating_input_was_recorded_instead_of_an_absmax_of_n_a() -> (
    None
):
    m = _ScaledTable()
    with nantrace.trace(m) as tr:
        loss = m(torch.tensor([1, 2])).float().sum()
        loss.backward()
        tr.step(loss=loss)
    d = tr.diagnose()
    assert d.cause == "forward_overflow"
    assert d.evidence[0] == (
        "the root model (_ScaledTable, call 0) at step 0 turned inputs with no recorded floating-point tensor (token "
        "ids, indices) into inf in float16, whose largest finite value is 65504"
    )
    assert not [line for line in [*d.evidence, *d.advice] if "n/a" in line]


class _SqrtFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        y = x.sqrt()
        ctx.save_for_backward(y)
        return y

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
        (y,) = ctx.saved_tensors
        return g / (2 * y)  # x/0 where the input was 0


class _SqrtAct(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _SqrtFn.apply(x)


class _DivByZeroNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.act, self.fc2 = nn.Linear(4, 8, bias=False), _SqrtAct(), nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x).abs()))


def test_an_inf_in_a_parameterless_backward_that_no_product_reaches_is_a_singular_point_not_an_overflow() -> (
    None
):
    torch.manual_seed(0)
    m = _DivByZeroNet()
    opt = torch.optim.SGD(m.parameters(), lr=0.01)
    with nantrace.trace(m, optimizer=opt) as tr:
        for i in range(3):
            x = torch.randn(16, 4) + 3
            if i == 2:
                x[5] = 0  # fc1's output row is exactly 0: sqrt's derivative 1/(2·0) is infinite
            opt.zero_grad()
            loss = m(x).pow(2).mean()
            loss.backward()
            tr.step(loss=loss)
            opt.step()
    ov = tr.first_overflow()
    assert ov is not None and (ov.step, ov.phase, ov.module, ov.tensor, ov.kind) == (
        2, "backward", "act", "grad_input[0]", "inf",
    )  # fmt: skip
    assert ov.op_class == "singular"
    d = tr.diagnose()
    assert d.cause == "invalid_op"
    assert d.summary == (
        "The backward of `act` made +inf from finite gradients at step 2: a derivative at or near a singular point, "
        "not values growing too large."
    )
    assert d.evidence[0].startswith(
        "the backward of `act` (_SqrtAct) at step 2 made +inf in `grad_input[0]` (float32): with no recorded "
        "parameters, its incoming gradients (absmax "
    )
    assert not [a for a in d.advice if "clip" in a.lower() and "does not remove" not in a]


def test_a_backward_inf_that_the_recorded_magnitudes_can_reach_stays_an_overflow() -> None:
    # C14's kind: a Linear with large weights: its own parameters multiply the gradient, no bound is claimed
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 1)).half()
    with torch.no_grad():
        m[1].weight.fill_(400.0)
        m[2].weight.fill_(30.0)
    with nantrace.trace(m) as tr:
        loss = m(torch.full((2, 8), 0.01, dtype=torch.float16)).float().sum() * 64
        loss.backward()
        tr.step(loss=loss)
    ov = tr.first_overflow()
    assert ov is not None and (ov.phase, ov.kind) == ("backward", "inf")
    assert tr.diagnose().cause == "backward_overflow"


def _decayed_up(make: Any) -> nantrace.Trace:
    """Pure float16 SGD with lr·weight_decay = 3 and gradients exactly 0: each step multiplies the weights by
    1 − 3 = −2, so |w| = 2**(s + 1) after step s and step 15 makes 65536 > 65504."""
    m = nn.Linear(4, 4).half()
    with torch.no_grad():
        m.weight.fill_(1.0)
        m.bias.fill_(0.5)
    opt = torch.optim.SGD(m.parameters(), lr=1.0, weight_decay=3.0)
    with make(m, optimizer=opt) as tr:
        for _ in range(17):
            opt.zero_grad()
            loss = (m(torch.zeros(2, 4, dtype=torch.float16)).float() * 0).sum()
            loss.backward()
            tr.step(loss=loss)
            opt.step()
    return tr


def test_weights_grown_by_weight_decay_alone_are_not_told_to_clip_gradients_or_raise_eps() -> None:
    tr = _decayed_up(nantrace.trace)
    ov = tr.first_overflow()
    assert ov is not None and (ov.step, ov.phase, ov.module, ov.tensor, ov.kind) == (
        15, "optimizer", "", "weight", "inf",
    )  # fmt: skip
    assert str(ov).splitlines()[1] == (
        "At step 15, gradients were finite but optimizer.step() made `weight` of the root model (Linear) +inf "
        "(float16). SGD.step() has no eps or squared gradients that round to 0: its update went beyond float16's "
        "65504 (`weight` had absmax 32768 after step 14, learning rate 1) or made an invalid operation: check the "
        "learning rate and weight decay (with no gradient, SGD's w·(1 − lr·weight_decay) grows |w| when "
        "lr·weight_decay > 2)."
    )
    d = tr.diagnose()
    assert d.cause == "divergence"
    assert (
        "the gradient norm was exactly 0 at each of the 8 recorded step(s) before: the updates that grew the "
        "weights did not come from gradients"
    ) in d.evidence
    assert [a for a in d.advice if a.startswith("Clip gradients:")] == []
    assert d.advice[1].startswith("Clipping gradients cannot help: they were 0.")


def test_a_nan_written_as_a_constant_by_a_hook_is_named_as_one_possibility_not_only_arithmetic() -> None:
    torch.manual_seed(0)
    m = nn.Sequential(nn.Embedding(10, 4), nn.Linear(4, 1))

    def poison(mod: nn.Module, args: Any, out: torch.Tensor) -> None:
        out[0, 0] = float("nan")  # no op makes it from finite operands: a constant written in place

    m[0].register_forward_hook(poison)
    with nantrace.trace(m) as tr:
        loss = m(torch.tensor([1, 2])).sum()
        loss.backward()
        tr.step(loss=loss)
    ov = tr.first_overflow()
    assert ov is not None and (ov.phase, ov.module, ov.tensor, ov.kind) == ("forward", "0", "output", "nan")
    d = tr.diagnose()
    assert d.cause == "invalid_op"
    assert d.headline == (
        "step 0 forward: `0` (Embedding) made NaN by an invalid operation: 0/0, 0·inf or inf − inf inside the call, "
        "or a NaN written as a constant (float32)"
    )
    assert d.evidence[0] == (
        "`0` (Embedding, call 0) at step 0 produced NaN, first seen in `output` (float32), from inputs holding no NaN "
        "(no recorded floating-point input: token ids, indices)"
    )
    assert any(
        "it names none for a NaN written as a constant (`x[i] = float('nan')`, `fill_(nan)`)" in a
        for a in d.advice
    )


class _Twice(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x) + self.proj(x * 1.0)


def test_a_weight_gradient_summed_over_two_calls_says_so_and_points_at_inputs_not_weights() -> None:
    m = _Twice().half()
    with torch.no_grad():
        m.proj.weight.fill_(1.0)
    with nantrace.trace(m) as tr:
        out = m(torch.full((1, 4), 200.0, dtype=torch.float16))
        out.backward(
            torch.full_like(out, 200.0)
        )  # each call's share of weight.grad: 200·200 = 40000; sum 80000
        tr.step(loss=None)
    ov = tr.first_overflow()
    assert ov is not None and (ov.phase, ov.module, ov.tensor, ov.kind) == (
        "backward",
        "proj",
        "weight.grad",
        "inf",
    )
    d = tr.diagnose()
    assert d.cause == "backward_overflow"
    assert (
        "`proj` ran 2 times in this micro-step: `weight.grad` is the sum of the shares of those calls, so the "
        "overflow can be their sum, not one call's product"
    ) in d.evidence
    assert d.advice[0].startswith(
        "With no GradScaler (scale 1) the gradient of `proj` itself exceeds 65504: check its inputs (large inputs or "
        "incoming gradients multiply into it)"
    )
