"""CASES.md C01–C14: each failure kind as a tiny CPU model with the exact expected locator answer."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import nantrace


def _where(ov: nantrace.Overflow | None) -> tuple | None:
    if ov is None:
        return None
    return (ov.step, ov.micro_step, ov.phase, ov.module, ov.call, ov.kind)


# ----------------------------------------------------------------------------------------------- C01
class RMSNorm(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt((x * x).mean(-1, keepdim=True) + 1e-6)


class T5FF(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.wi = nn.Linear(16, 64)
        self.act = nn.ReLU()
        self.wo = nn.Linear(64, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.wo(self.act(self.wi(x)))


class C01Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ff = T5FF()
        self.norm = RMSNorm()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.ff(x))


def test_c01_t5_feed_forward_overflow_then_norm_nan() -> None:
    m = C01Model()
    with torch.no_grad():
        m.ff.wi.weight.fill_(1 / 16)
        m.ff.wi.bias.zero_()
        m.ff.wo.weight.fill_(1.0)
        m.ff.wo.bias.zero_()
    m = m.half()
    x = torch.full((2, 16), 1100.0, dtype=torch.float16)
    with nantrace.trace(m) as tr:
        m(x)
    ov = tr.first_overflow()
    assert _where(ov) == (0, 0, "forward", "ff.wo", 0, "inf")
    assert ov is not None and ov.module_type == "Linear" and ov.tensor == "output"
    assert ov.dtype == "float16" and ov.dtype == torch.float16
    assert "65504" in str(ov) and "1100" in str(ov)
    nan = tr.first_overflow(kind="nan")
    assert _where(nan) == (0, 0, "forward", "norm", 0, "nan")
    assert nan is not None and nan.module_type == "RMSNorm"
    assert _where(tr.first_overflow(kind="inf")) == (0, 0, "forward", "ff.wo", 0, "inf")


# ----------------------------------------------------------------------------------------------- C02
class Residual(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc(x)


class C02Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.block = Residual()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.block(x)


def test_c02_residual_add_is_the_blocks_own_code() -> None:
    m = C02Model()
    with torch.no_grad():
        m.block.fc.weight.copy_(torch.eye(8))
        m.block.fc.bias.zero_()
    m = m.half()
    with nantrace.trace(m) as tr:
        m(torch.full((2, 8), 40000.0, dtype=torch.float16))
    ov = tr.first_overflow()
    assert _where(ov) == (0, 0, "forward", "block", 0, "inf")
    assert ov is not None and ov.module_type == "Residual"
    fc_out = tr.records.query("module == 'block.fc' and tensor == 'output'")
    assert fc_out["absmax"].tolist() == [40000.0] and fc_out["n_posinf"].tolist() == [0]


# ----------------------------------------------------------------------------------------------- C03/C04
class HandAttention(nn.Module):
    """Unscaled dot-product attention with softmax written by hand (no fp32 internals)."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.q = nn.Linear(d, d, bias=False)
        self.k = nn.Linear(d, d, bias=False)
        self.v = nn.Linear(d, d, bias=False)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        scores = self.q(x) @ self.k(x).transpose(-1, -2)
        if mask is not None:
            scores = scores + mask
        e = torch.exp(scores - scores.amax(-1, keepdim=True))
        return (e / e.sum(-1, keepdim=True)) @ self.v(x)


class AttnModel(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.attn = HandAttention(d)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        return self.attn(x, mask)


def test_c03_attention_scores_overflow_inside_attention() -> None:
    m = AttnModel(64)
    with torch.no_grad():
        for lin in (m.attn.q, m.attn.k, m.attn.v):
            lin.weight.copy_(torch.eye(64))
    m = m.half()
    x = torch.full((1, 4, 64), 40.0, dtype=torch.float16)
    with nantrace.trace(m) as tr:
        m(x)
    ov = tr.first_overflow()
    assert _where(ov) == (0, 0, "forward", "attn", 0, "inf")
    qkv = tr.records.query("module in ['attn.q', 'attn.k', 'attn.v'] and tensor == 'output'")
    assert len(qkv) == 3 and int(qkv[["n_nan", "n_posinf", "n_neginf"]].to_numpy().sum()) == 0


def _mask(rows_padded: bool) -> torch.Tensor:
    mask = torch.zeros(2, 1, 4, dtype=torch.float16)
    mask[0, 0, 3] = -math.inf  # key 3 of batch row 0 is padding
    if rows_padded:
        mask[1] = -math.inf  # batch row 1 is padding only: its softmax row is NaN
    return mask


def test_c04_fully_masked_row_is_nan_in_attention_and_mask_never_reported() -> None:
    torch.manual_seed(0)
    m = AttnModel(8).half()
    x = torch.randn(2, 4, 8).half()
    with nantrace.trace(m) as tr:
        m(x, _mask(True))
    assert _where(tr.first_overflow()) == (0, 0, "forward", "attn", 0, "nan")
    data = tr.records.query("phase == 'data' and tensor == 'input[1]'")
    assert data["n_neginf"].tolist() == [4 + 1]
    assert tr.first_overflow(kind="inf") is None
    with nantrace.trace(m) as tr2:
        m(x, _mask(False))
    assert tr2.first_overflow() is None
    assert tr2.overflows().empty


# ----------------------------------------------------------------------------------------------- C05
def test_c05_log_of_zero_count_in_data_is_reported() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024)
    with nantrace.trace(model, scaler=scaler, optimizer=opt) as tr:
        for step in range(4):
            counts = torch.randint(1, 50, (8, 4)).float()
            if step == 2:
                counts[3, 1] = 0
            x = torch.log(counts)  # the loader's feature
            y = torch.randn(8, 1)
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16):
                loss = F.mse_loss(model(x).float(), y)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
    ov = tr.first_overflow()
    assert _where(ov) == (2, 0, "data", "", 0, "inf")
    assert ov is not None and ov.tensor == "input[0]"
    assert tr.overflows()["step"].tolist()[0] == 2


# ----------------------------------------------------------------------------------------------- C06
class Gate(nn.Module):
    """``where(p < 0.5, log(1 - p + 1e-6), 0)``: float16 rounds the guard away (``1e-6 - 1.0`` is ``-1.0``), so
    ``log1p(-1) = -inf`` in an entry that ``where`` discards. The forward is finite; in backward ``where`` sends
    that entry a gradient of exactly 0 and ``log1p``'s derivative ``1 / (1 + x)`` is inf there: 0·inf = NaN.

    The guard is an added epsilon, whose gradient is 1 everywhere, and not the ``p.clamp(max=1 - 1e-6)`` of CASES
    C06: that clamp's gradient at its bound (which float16 rounds to 1.0, the clamped value) is a convention that
    torch changed (2.13 passes the NaN on to ``p``, 2.14 sends 0), so with it the NaN leaves the gate on some
    versions only (``test_c06_clamp_guard_depends_on_clamp_gradient_at_its_bound``)."""

    def forward(self, p: torch.Tensor) -> torch.Tensor:
        y = torch.log1p(1e-6 - p)
        return torch.where(p < 0.5, y, torch.zeros_like(y))


class ClampGate(nn.Module):
    """CASES C06 as written: the guard is ``p.clamp(max=1 - 1e-6)``, whose bound float16 rounds to 1.0."""

    def forward(self, p: torch.Tensor) -> torch.Tensor:
        y = torch.log1p(-p.clamp(max=1 - 1e-6))
        return torch.where(p < 0.5, y, torch.zeros_like(y))


class C06Model(nn.Module):
    def __init__(self, gate: nn.Module | None = None) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)
        self.gate = Gate() if gate is None else gate

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.gate(torch.sigmoid(self.proj(x)) + x)


def test_c06_backward_zero_times_inf_in_gate() -> None:
    m = C06Model()
    with torch.no_grad():
        m.proj.weight.zero_()
        m.proj.bias.fill_(-20.0)  # sigmoid ≈ 0, so p = x
    m = m.half()
    x = torch.tensor([[0.1, 0.2, 1.0, 0.3]], dtype=torch.float16)  # p = 1.0 in a discarded entry
    with nantrace.trace(m) as tr:
        out = m(x)
        out.sum().backward()
    fwd = tr.records.query("phase == 'forward' and module == 'gate' and tensor == 'output'")
    assert int(fwd[["n_nan", "n_posinf", "n_neginf"]].to_numpy().sum()) == 0
    assert _where(tr.first_overflow()) == (0, 0, "backward", "gate", 0, "nan")
    assert tr.first_overflow().tensor == "grad_input[0]"


def _clamp_passes_the_gradient_at_its_bound() -> bool:
    """Whether this torch's ``clamp`` backward passes the incoming gradient of an element that float16 rounded onto
    the bound (``1.0`` clamped to ``1 - 1e-6``, which is 1.0): torch 2.13 does, torch 2.14 sends 0."""
    p = torch.ones(1, dtype=torch.float16, requires_grad=True)
    p.clamp(max=1 - 1e-6).backward(torch.ones(1, dtype=torch.float16))
    assert p.grad is not None
    return bool(p.grad.item() == 1.0)


def test_c06_clamp_guard_depends_on_clamp_gradient_at_its_bound() -> None:
    """CASES C06 with its clamp guard. Inside the gate's backward ``log1p`` makes the NaN (0·inf) on every torch;
    whether it leaves the gate is the clamp's gradient at its bound. Where the clamp passes it (torch 2.13) the
    gate's grad_input is NaN: backward · gate · nan. Where it sends 0 (torch 2.14) every gradient the hooks see is
    finite and there is nothing to report."""
    m = C06Model(ClampGate())
    with torch.no_grad():
        m.proj.weight.zero_()
        m.proj.bias.fill_(-20.0)
    m = m.half()
    x = torch.tensor([[0.1, 0.2, 1.0, 0.3]], dtype=torch.float16)
    c = nantrace.hunt(lambda: m(x).sum().backward(), kind="nan")
    assert c is not None
    assert (c.op, c.module, c.phase, c.kind) == ("aten::div.Tensor", "gate", "backward", "nan")
    m.zero_grad()
    with nantrace.trace(m) as tr:
        m(x).sum().backward()
    if _clamp_passes_the_gradient_at_its_bound():
        assert _where(tr.first_overflow()) == (0, 0, "backward", "gate", 0, "nan")
        assert tr.first_overflow().tensor == "grad_input[0]"
    else:
        assert tr.first_overflow() is None
        assert int(tr.records[["n_nan", "n_posinf", "n_neginf"]].to_numpy().sum()) == 0
        assert m.proj.bias.grad is not None and bool(torch.isfinite(m.proj.bias.grad).all())


# ----------------------------------------------------------------------------------------------- C07
def test_c07_adam_eps_underflows_in_pure_fp16() -> None:
    torch.manual_seed(0)
    lin = nn.Linear(4, 4).half()
    model = nn.Sequential(lin)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3, eps=1e-8)
    x = torch.full((2, 4), 1e-3, dtype=torch.float16)
    with nantrace.trace(model, optimizer=opt) as tr:
        for _ in range(2):
            opt.zero_grad()
            (model(x).sum() * 1e-3).backward()
            opt.step()
    ov = tr.first_overflow()
    assert ov is not None
    assert (ov.step, ov.phase, ov.module, ov.module_type) == (0, "optimizer", "0", "Linear")
    step0 = tr.records.query("step == 0 and phase != 'optimizer'")
    assert int(step0[["n_nan", "n_posinf", "n_neginf"]].to_numpy().sum()) == 0


# ----------------------------------------------------------------------------------------------- C08
def test_c08_loss_outside_the_model_underflows_and_every_step_is_skipped() -> None:
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    with torch.no_grad():
        model.weight.zero_()
        model.bias.copy_(torch.tensor([0.0, 30.0, 0.0]))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu")
    target = torch.tensor([0, 0])
    with nantrace.trace(model, scaler=scaler, optimizer=opt) as tr:
        for _ in range(3):
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16):
                logits = model(torch.randn(2, 4))
            probs = torch.softmax(logits.half(), dim=-1)  # fp16: exp(-30) -> 0
            loss = -torch.log(probs[torch.arange(2), target]).mean()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
    assert _where(tr.first_overflow()) == (0, 0, "loss", "", 0, "inf")
    assert tr.steps["skipped"].tolist() == [True, True, True]
    assert tr.steps["scale"].tolist() == [65536.0, 32768.0, 16384.0]


# ----------------------------------------------------------------------------------------------- C09
def test_c09_shared_layer_overflows_on_third_call() -> None:
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
    ov = tr.first_overflow()
    outs = tr.records.query("module == 'shared' and tensor == 'output'")["absmax"].tolist()
    assert outs[:2] == [480.0, 23040.0]
    assert _where(ov) == (0, 0, "forward", "shared", 2, "inf")


# ----------------------------------------------------------------------------------------------- C10
def test_c10_inplace_relu_after_linear_with_backward_hooks() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(inplace=True), nn.Linear(4, 4), nn.ReLU(inplace=True))
    with torch.no_grad():
        model[0].weight.fill_(1.0)
        model[0].bias.fill_(1.0)
        model[2].weight.fill_(3000.0)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu")
    with nantrace.trace(model, scaler=scaler, optimizer=opt) as tr:
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            out = model(torch.full((2, 4), 2.0))
        scaler.scale(out.float().sum()).backward()
        scaler.step(opt)
        scaler.update()
    assert _where(tr.first_overflow()) == (0, 0, "forward", "2", 0, "inf")
    assert tr.first_overflow().module_type == "Linear"
    assert tr.steps["skipped"].tolist() == [True]
    assert len(tr.records.query("phase == 'backward'")) > 0


# ----------------------------------------------------------------------------------------------- C11
def test_c11_transformer_encoder_with_causal_mask_is_healthy() -> None:
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(d_model=16, nhead=2, dim_feedforward=32, dropout=0.0, batch_first=True)
    model = nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu", init_scale=256)
    causal = nn.Transformer.generate_square_subsequent_mask(6)
    with nantrace.trace(model, scaler=scaler, optimizer=opt) as tr:
        for _ in range(3):
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16):
                out = model(torch.randn(2, 6, 16), mask=causal)
            scaler.scale(out.float().pow(2).mean()).backward()
            scaler.step(opt)
            scaler.update()
    assert tr.first_overflow() is None
    assert tr.overflows().empty
    assert tr.steps["skipped"].tolist() == [False, False, False]
    assert tr.steps["n_nonfinite"].tolist() == [0, 0, 0]
    mask_rows = tr.records.query("phase == 'data' and arg == 'mask'")
    assert mask_rows["n_neginf"].tolist() == [15, 15, 15]


# ----------------------------------------------------------------------------------------------- C12
def test_c12_default_scaler_backs_off_then_trains() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 1))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu")  # init_scale 65536
    x, y = torch.randn(256, 8) * 4, torch.randn(256, 1) * 3
    with nantrace.trace(model, scaler=scaler, optimizer=opt) as tr:
        for _ in range(6):
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16):
                out = model(x)
            scaler.scale(F.mse_loss(out.float(), y)).backward()
            scaler.step(opt)
            scaler.update()
    assert tr.steps["skipped"].tolist() == [True, False, False, False, False, False]
    assert tr.steps["scale"].tolist() == [65536.0, 32768.0, 32768.0, 32768.0, 32768.0, 32768.0]
    assert tr.steps["next_scale"].tolist()[:2] == [32768.0, 32768.0]
    assert tr.steps["growth_tracker"].tolist() == [0, 1, 2, 3, 4, 5]
    ov = tr.first_overflow()
    assert _where(ov) == (0, 0, "backward", "4", 0, "inf")
    assert ov is not None and ov.module_type == "Linear" and ov.tensor == "weight.grad"
    # independently: the first backward row holding a non-finite value is that layer's weight gradient,
    # and the gradient arriving at that layer was finite
    bwd = tr.records.query("step == 0 and phase == 'backward'").sort_values("seq")
    bad = bwd[(bwd["n_nan"] + bwd["n_posinf"] + bwd["n_neginf"]) > 0]
    assert (str(bad.iloc[0]["module"]), str(bad.iloc[0]["tensor"])) == ("4", "weight.grad")
    gout = bwd[(bwd["module"] == "4") & (bwd["tensor"] == "grad_output[0]")]
    assert int(gout[["n_nan", "n_posinf", "n_neginf"]].to_numpy().sum()) == 0
    assert tr.overflows()["step"].tolist() == [0]
    assert "65536" in str(ov)


# ----------------------------------------------------------------------------------------------- C13
def test_c13_gradient_accumulation_nan_in_micro_batch_1_of_step_2() -> None:
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
    ov = tr.first_overflow()
    assert _where(ov) == (2, 1, "data", "", 0, "nan")
    assert tr.steps["micro_steps"].tolist() == [3, 3, 3, 3]
    assert sorted(set(tr.records["micro_step"].tolist())) == [0, 1, 2]


# ----------------------------------------------------------------------------------------------- C14
def test_c14_backward_grad_input_overflows_in_big_linear() -> None:
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
        out = model(torch.full((1, 4), 0.5, dtype=torch.float16))
        (out.sum() * 1.0).backward()
    fwd = tr.records.query("phase in ['data', 'forward']")
    assert int(fwd[["n_nan", "n_posinf", "n_neginf"]].to_numpy().sum()) == 0
    ov = tr.first_overflow()
    assert _where(ov) == (0, 0, "backward", "1", 0, "inf")
    assert ov is not None and ov.tensor == "grad_input[0]"
    gout = tr.records.query("module == '1' and tensor == 'grad_output[0]'")
    assert gout["absmax"].tolist() == [30.0] and gout["n_posinf"].tolist() == [0]


@pytest.mark.parametrize("kind", ["bad", 3])
def test_first_overflow_rejects_unknown_kind(kind: object) -> None:
    m = nn.Linear(2, 2)
    with nantrace.trace(m) as tr:
        m(torch.ones(1, 2))
    with pytest.raises(ValueError, match="kind"):
        tr.first_overflow(kind=kind)  # type: ignore[arg-type]


def test_additive_attention_bias_named_bias_is_a_mask_not_data() -> None:
    """ALiBi-style bias: finite slopes plus a causal -inf, passed as `attn_bias`: not a data fault."""

    class Biased(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor, attn_bias: torch.Tensor) -> torch.Tensor:
            scores = self.proj(x) @ x.transpose(-1, -2) + attn_bias
            return torch.softmax(scores, dim=-1) @ x

    bias = torch.tensor([[0.0, -math.inf, -math.inf], [-0.5, 0.0, -math.inf], [-1.0, -0.5, 0.0]])
    m = Biased()
    with nantrace.trace(m) as tr:
        m(torch.randn(3, 4), attn_bias=bias)
    assert tr.records.query("phase == 'data' and arg == 'attn_bias'")["n_neginf"].tolist() == [3]
    assert tr.first_overflow() is None
    assert tr.steps["n_nonfinite"].tolist() == [0]
