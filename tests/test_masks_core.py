"""Masks and intended -inf: the op drill-down's scalar rule, the features input, and a mask's -inf that leaks."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import nantrace
from nantrace._stats import op_input_kinds, scalar_kinds


def _where(ov: nantrace.Overflow | None) -> tuple[object, ...] | None:
    return None if ov is None else (ov.step, ov.phase, ov.module, ov.call, ov.tensor, ov.kind)


def _ops(tr: nantrace.Trace) -> list[tuple[str, int, str, str]]:
    return [(str(r.module), int(r.call), str(r.op), str(r.kind)) for r in tr.ops.itertuples()]


# ------------------------------------------------------------------------------------ the shared op rule
def test_op_input_kinds_counts_nonfinite_scalars_as_inputs() -> None:
    x = torch.tensor([1.0, math.inf])
    m = torch.tensor([True, False])
    tensors, before = op_input_kinds((x, m, -math.inf), {"value": math.nan})
    assert [t is x for t in tensors] == [True]  # the bool mask is not describable
    assert before == frozenset({"posinf", "neginf", "nan"})
    assert op_input_kinds((torch.ones(2), 2.0), {})[1] == frozenset()
    assert scalar_kinds(-math.inf) == frozenset({"neginf"})
    assert scalar_kinds(math.inf) == frozenset({"posinf"})
    assert scalar_kinds(math.nan) == frozenset({"nan"})
    assert scalar_kinds(3) == frozenset() and scalar_kinds("inf") == frozenset()


# ------------------------------------------------------------------------------------ finding: masked_fill
class PadAttn(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q = nn.Linear(8, 8)
        self.k = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, pad: torch.Tensor) -> torch.Tensor:  # pad: bool, True = padded key
        sc = self.q(x) @ self.k(x).transpose(-1, -2)
        sc = sc.masked_fill(pad[:, None, :], float("-inf"))
        return torch.softmax(sc, -1) @ x


class PadModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn = PadAttn()
        self.out = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor, pad: torch.Tensor) -> torch.Tensor:
        return self.out(self.attn(x, pad))


def test_masked_fill_minus_inf_is_intended_and_the_fully_masked_row_is_nan_in_attention() -> None:
    torch.manual_seed(0)
    m = PadModel()
    x = torch.randn(2, 4, 8)
    pad = torch.zeros(2, 4, dtype=torch.bool)
    pad[0, 3] = True
    with nantrace.trace(m) as tr:
        m(x, pad)
    assert tr.first_overflow() is None and _ops(tr) == []
    pad[1, :] = True  # batch row 1 is padding only: its softmax row is NaN
    with nantrace.trace(m) as tr:
        m(x, pad)
    ov = tr.first_overflow()
    assert _where(ov) == (0, "forward", "attn", 0, "output", "nan")
    assert _ops(tr) == [("attn", 0, "softmax", "nan")]
    assert "softmax" in str(ov) and "overflows" not in str(ov)
    d = tr.diagnose()
    assert d.cause == "invalid_op"
    assert "overflowed" not in str(d)


class HFMask(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        add = (1.0 - attention_mask)[:, None, :] * -math.inf  # 0 * -inf = NaN where the mask is 1
        scores = self.proj(x) @ x.transpose(-1, -2) + add
        return torch.softmax(scores, -1)


def test_hf_style_times_minus_inf_mask_makes_nan_in_mul() -> None:
    torch.manual_seed(0)
    m = HFMask()
    x, am = torch.randn(2, 3, 4), torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    with nantrace.trace(m) as tr:
        m(x, am)
    ov = tr.first_overflow()
    assert _where(ov) == (0, "forward", "", 0, "output", "nan")
    assert _ops(tr) == [("", 0, "mul", "nan")]
    assert tr.diagnose().cause == "invalid_op"
    culprit = nantrace.hunt(m, x, am)
    assert culprit is not None and (culprit.op, culprit.value) == ("aten::mul.Tensor", "nan")


class BuildsCausal(nn.Module):
    """Builds its own causal mask with torch.full(-inf) and keeps the masked scores as its output."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = x.shape[-2]
        causal = torch.full((n, n), -math.inf).triu(1)
        scores = x @ x.transpose(-1, -2) + causal
        return torch.where(torch.isinf(scores), torch.zeros_like(scores), scores.softmax(-1))


def test_full_minus_inf_built_inside_a_module_is_not_produced() -> None:
    m = nn.Sequential(nn.Linear(4, 4), BuildsCausal())
    with nantrace.trace(m) as tr:
        m(torch.randn(3, 4))
    assert tr.first_overflow() is None and _ops(tr) == []
    assert tr.steps["n_nonfinite"].tolist() == [0]


# ------------------------------------------------------------------------------------ finding: features input
def test_log_one_hot_features_are_data_not_a_mask() -> None:
    torch.manual_seed(0)
    m = nn.Linear(6, 2)
    opt = torch.optim.SGD(m.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu")
    feats = torch.log(F.one_hot(torch.tensor([0, 1, 2, 3]), 6).float())  # only 0 and -inf
    with nantrace.trace(m, scaler=scaler, optimizer=opt) as tr:
        with torch.autocast("cpu", dtype=torch.float16):
            out = m(feats)
        scaler.scale(out.float().sum()).backward()
        scaler.step(opt)
        scaler.update()
    ov = tr.first_overflow()
    assert _where(ov) == (0, "data", "", 0, "input[0]", "inf")
    assert "20 -inf" in str(ov)
    assert tr.diagnose().cause == "data"


def test_log_of_zero_one_counts_as_only_input_is_data() -> None:
    m = nn.Sequential(nn.Linear(3, 3), nn.Tanh())
    counts = torch.tensor([[1.0, 0.0, 1.0], [0.0, 1.0, 1.0]])
    with nantrace.trace(m) as tr:
        m(torch.log(counts))
    assert _where(tr.first_overflow()) == (0, "data", "", 0, "input[0]", "inf")


class TwoArgAttn(nn.Module):
    """Takes an unnamed additive mask as its second positional argument `m`."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
        return torch.softmax(self.proj(x) @ x.transpose(-1, -2) + m, -1) @ x


def test_unnamed_zero_minus_inf_mask_as_a_later_argument_is_still_a_mask() -> None:
    torch.manual_seed(0)
    m = TwoArgAttn()
    mask = torch.zeros(3, 3)
    mask[0, 2] = -math.inf
    with nantrace.trace(m) as tr:
        m(torch.randn(3, 4), mask)
    assert tr.first_overflow() is None
    assert tr.steps["n_nonfinite"].tolist() == [0]


# ------------------------------------------------------------------------------------ finding: leaked mask
class UserBias(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.l = nn.Linear(4, 1)

    def forward(self, x: torch.Tensor, user_bias: torch.Tensor) -> torch.Tensor:
        return self.l(x + user_bias)


def test_named_bias_whose_minus_inf_reaches_the_output_is_not_reported() -> None:
    """DESIGN rule 3: a mask's -inf is never reported, also when it is passed on to the model's output (masked
    logits are a legitimate output). The rows downstream of the mask still count in ``n_nonfinite``."""
    torch.manual_seed(0)
    m = UserBias()
    with torch.no_grad():
        m.l.weight.fill_(0.5)
    ub = torch.randn(8, 4)
    ub[3, 0] = -math.inf
    with nantrace.trace(m) as tr:
        out = m(torch.randn(8, 4), ub)
    assert int(out.isneginf().sum()) == 1
    assert tr.first_overflow() is None
    assert tr.first_overflow(kind="inf") is None
    assert tr.steps["n_nonfinite"].tolist() == [3]  # l's input, l's output, the root's output


def test_mask_minus_inf_turned_into_plus_inf_names_the_mask() -> None:
    m = UserBias()
    with torch.no_grad():
        m.l.weight.fill_(-0.5)
    ub = torch.zeros(2, 4)
    ub[1, 0] = -math.inf
    with nantrace.trace(m) as tr:
        m(torch.ones(2, 4), ub)
    ov = tr.first_overflow()
    assert _where(ov) == (0, "forward", "l", 0, "output", "inf")
    assert "mask/bias input(s) `user_bias`" in str(ov)
    assert tr.diagnose().cause == "data"


class MaskedC14(nn.Module):
    """C14's three Linears (big one in the middle, weights -400), plus an attention mask input that the model
    only applies where it cannot reach the output: its -inf never leaks, its gradients are another matter."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 8)
        self.big = nn.Linear(8, 8)
        self.head = nn.Linear(8, 1)
        for lin, w in ((self.a, 0.01), (self.big, -400.0), (self.head, 30.0)):
            with torch.no_grad():
                lin.weight.fill_(w)
                lin.bias.zero_()

    def forward(self, x: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        h = h + torch.softmax(attention_mask, -1).sum(-1, keepdim=True) * 0  # a mask row sums to 1
        return self.head(self.big(h))


def test_a_mask_around_does_not_hide_a_minus_inf_gradient_in_backward() -> None:
    m = MaskedC14().half()
    mask = torch.tensor([[0.0, -math.inf]], dtype=torch.float16)
    with nantrace.trace(m) as tr:
        out = m(torch.full((1, 4), 0.5, dtype=torch.float16), mask)
        out.sum().backward()
    fwd = tr.records.query("phase == 'forward'")
    assert int(fwd[["n_nan", "n_posinf", "n_neginf"]].to_numpy().sum()) == 0
    ov = tr.first_overflow()
    assert _where(ov) == (0, "backward", "big", 0, "grad_input[0]", "inf")
    assert int(tr.records.query("module == 'big' and tensor == 'grad_input[0]'")["n_neginf"].iloc[0]) == 8


# ------------------------------------------------------------------------------------ all -inf is no mask
class NegHead(nn.Module):
    """A body and a one-output head whose weights send every output below the dtype's lowest value."""

    def __init__(self, dtype: torch.dtype, weight: float) -> None:
        super().__init__()
        self.body = nn.Linear(4, 4)
        self.head = nn.Linear(4, 1)
        with torch.no_grad():
            self.body.weight.copy_(torch.eye(4))
            self.body.bias.zero_()
            self.head.weight.fill_(weight)
            self.head.bias.zero_()
        self.to(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))


@pytest.mark.parametrize("make", [nantrace.trace, nantrace.watch], ids=["trace", "watch"])
@pytest.mark.parametrize(
    ("dtype", "weight"), [(torch.float32, -1e38), (torch.float16, -30000.0)], ids=["float32", "float16"]
)
def test_an_output_that_overflowed_to_minus_inf_everywhere_is_an_overflow_not_a_mask(
    make: Any, dtype: torch.dtype, weight: float
) -> None:
    """Every output of the head is -inf (2 x 4 x 3.0 x weight, past the dtype's lowest value): a tensor of -inf
    alone masks every position, so it is no mask and the head produced it. Before, it passed as a mask and the
    event was a loss "from finite outputs (absmax n/a)"."""
    m = NegHead(dtype, weight)
    opt = torch.optim.SGD(m.parameters(), lr=0.01)
    with make(m, optimizer=opt) as tr:
        opt.zero_grad()
        loss = m(torch.full((2, 4), 3.0, dtype=dtype)).float().sum()
        tr.step(loss=loss)
    ov = tr.first_overflow()
    assert _where(ov) == (0, "forward", "head", 0, "output", "inf")
    assert ov is not None and ov.dtype == str(dtype).removeprefix("torch.")
    assert _ops(tr) == [("head", 0, "linear", "neginf")]


def test_a_zero_and_minus_inf_output_is_still_a_mask_and_minus_inf_alone_is_not() -> None:
    from nantrace._masks import mask_rows

    one = np.ones(1, dtype=bool)
    z = np.zeros(1, dtype=np.int64)
    # (n_zero, n_neginf, numel): 0 and -inf / -inf alone / -inf beside finite values
    got = [
        bool(mask_rows(z, z, np.array([ni]), np.array([nz]), np.array([n]), one, ~one)[0])
        for nz, ni, n in [(2, 2, 4), (0, 4, 4), (1, 2, 4)]
    ]
    assert got == [True, False, False]
    # a name says mask whatever the values
    assert bool(mask_rows(z, z, np.array([4]), z, np.array([4]), one, one)[0])


def test_capture_keeps_the_call_whose_output_is_minus_inf_alone() -> None:
    m = NegHead(torch.float32, -1e38)
    with nantrace.trace(m, capture="first") as tr:
        m(torch.full((2, 4), 3.0))
    ov = tr.first_overflow()
    assert _where(ov) == (0, "forward", "head", 0, "output", "inf")
    assert tr._recording is not None and tr._recording.capture is not None
    kept = tr._recording.capture.kept
    assert kept is not None and kept.module_name == "head"


# ------------------------------------------------------------------------------------ masked logits
class MaskedHead(nn.Module):
    """Logits masked with -inf where an action or token is not allowed (the root's own code)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 6)

    def forward(self, x: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
        return self.fc(x).masked_fill(~allowed, float("-inf"))


def _masked_logits_run(make: Any, loss_fn: Any) -> nantrace.Trace:
    torch.manual_seed(0)
    m = MaskedHead()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    allowed = torch.tensor([[True] * 4 + [False] * 2] * 3)
    with make(m, optimizer=opt) as tr:
        for _ in range(2):
            opt.zero_grad()
            loss = loss_fn(m(torch.randn(3, 4), allowed))
            tr.step(loss=loss)
            loss.backward()
            opt.step()
    return tr


def _smoothed_ce(o: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(o, torch.tensor([0, 1, 2]), label_smoothing=0.1)


def _hand_kl(o: torch.Tensor) -> torch.Tensor:
    p = torch.tensor([[0.5, 0.5, 0.0, 0.0, 0.0, 0.0]] * 3)
    return (p * (p.log() - F.softmax(o, -1).log())).sum(-1).mean()


@pytest.mark.parametrize("make", [nantrace.trace, nantrace.watch], ids=["trace", "watch"])
@pytest.mark.parametrize(("loss_fn", "kind"), [(_smoothed_ce, "inf"), (_hand_kl, "nan")], ids=["ce", "kl"])
def test_logits_masked_with_masked_fill_minus_inf_are_no_fault_and_the_loss_over_them_is(
    make: Any, loss_fn: Any, kind: str
) -> None:
    """`masked_fill(~allowed, -inf)` in the root's forward makes outputs of finite logits and -inf: an intended
    mask value (its -inf comes from the -inf scalar only). The loss that weighs the masked entries (label
    smoothing, p·log q with p = 0) is the fault. Before, the root was reported as overflowing float32 (-inf)."""
    tr = _masked_logits_run(make, loss_fn)
    ov = tr.first_overflow()
    assert _where(ov) == (0, "loss", "", 0, "loss", kind)
    d = tr.diagnose()
    assert d.cause == "loss"
    r = tr.records
    out = r[(r["step"] == 0) & (r["phase"] == "forward") & (r["module"] == "") & (r["tensor"] == "output")]
    assert int(out["n_neginf"].iloc[0]) == 6
    absmax = nantrace._fmt.num(float(out["absmax"].iloc[0]))
    assert d.evidence[0] == (
        f"the model's outputs at step 0 held only a mask's -inf (6 values; finite absmax {absmax}) but the loss "
        f"was {kind} (float32)"
    )
    assert d.advice[0] == (
        "The model's outputs hold -inf where they are masked (6 values): a loss that weighs every output, such as "
        "cross-entropy with `label_smoothing`, a KL divergence p·(log p − log q) or a sum of log-probabilities, "
        "multiplies that -inf by a non-zero weight (inf) or by 0 (NaN). Leave the masked entries out of the loss: "
        "spread label smoothing over the allowed entries only, and sum p·log q where p > 0 (`torch.xlogy`, "
        "`F.kl_div`); a finite stand-in for -inf (`torch.finfo(dtype).min`) keeps the loss finite but huge. If the "
        "model masks nothing there, the -inf is a log of an exact 0 (a softmax that saturated, `log(softmax(x))` "
        "written by hand): `torch.log_softmax` stays finite."
    )
    assert d.summary == "The model's outputs held only a mask's -inf but the loss was non-finite at step 0."


def test_the_drill_down_notes_the_op_that_made_an_intended_minus_inf() -> None:
    tr = _masked_logits_run(nantrace.trace, _smoothed_ce)
    assert _ops(tr) == [("", 0, "masked_fill", "mask")] * 2  # once per step: the -inf is new in each


def _zero_and_overflow_head(rows: int) -> nn.Linear:
    """fp16 Linear(4→rows) whose row 0 is 0 and other rows -1000: on inputs of 100 it gives 0 and -400000 → -inf,
    an output of only 0 and -inf that no mask made."""
    head = nn.Linear(4, rows, bias=False).half()
    with torch.no_grad():
        head.weight[0].fill_(0.0)
        head.weight[1:].fill_(-1000.0)
    return head


@pytest.mark.parametrize("make", [nantrace.trace, nantrace.watch], ids=["trace", "watch"])
def test_an_overflow_to_minus_inf_beside_zeros_is_the_modules_fault_not_a_mask(make: Any) -> None:
    """The value rule alone (only 0 and -inf) would call `1`'s output a mask; the replay shows `linear` made the
    -inf from finite operands with no -inf scalar: an overflow (a log of a 0/1 mask would build one). Before,
    nothing was reported (found by the third new-user check)."""
    m = nn.Sequential(nn.Identity(), _zero_and_overflow_head(2))
    with make(m) as tr:
        m(torch.full((1, 4), 100.0, dtype=torch.float16))
    assert _where(tr.first_overflow()) == (0, "forward", "1", 0, "output", "inf")
    assert _ops(tr) == [("1", 0, "linear", "neginf")]


def test_the_nan_a_later_layer_makes_of_that_overflow_is_not_called_a_masked_row() -> None:
    mix = nn.Linear(3, 1, bias=False).half()
    with torch.no_grad():
        mix.weight.copy_(torch.tensor([[1.0, 1.0, -1.0]]))
    m = nn.Sequential(nn.Identity(), _zero_and_overflow_head(3), mix)
    with nantrace.trace(m) as tr:
        m(torch.full((1, 4), 100.0, dtype=torch.float16))
    assert _where(tr.first_overflow()) == (0, "forward", "1", 0, "output", "inf")
    assert tr.diagnose().cause == "forward_overflow"


def test_a_healthy_run_with_masked_logits_shows_no_minus_inf_in_its_headroom_line() -> None:
    """DESIGN: a mask's -inf is never shown as an overflow, in text or tables of headroom. The masked logits'
    row holds finite values and the masked_fill's -inf; the headroom line was 'the root model (M), absmax inf,
    exceeds float16's 65504 by inf bits' (found by the third new-user check)."""
    tr = _masked_logits_run(nantrace.trace, lambda o: F.cross_entropy(o, torch.tensor([0, 1, 2])))
    d = tr.diagnose()
    assert d.cause == "healthy"
    line = next(e for e in d.evidence if e.startswith("least float16 headroom"))
    assert "inf" not in line.replace("float16", "")
    assert line.startswith("least float16 headroom: `fc` (Linear), absmax ")


def test_plots_read_a_forward_masked_output_without_its_minus_inf() -> None:
    """The plots' frame of a trace leaves out the -inf the drill-down showed was masked in the forward, as they
    leave out a mask input's (DESIGN: never drawn as an overflow)."""
    from nantrace.plot import _frame_of

    tr = _masked_logits_run(nantrace.trace, lambda o: F.cross_entropy(o, torch.tensor([0, 1, 2])))
    frame, _ = _frame_of(tr, "trace", ["step", "module", "tensor", "n_neginf"])
    root = frame[(frame["module"] == "") & (frame["tensor"] == "output") & (frame["phase"] == "forward")]
    assert len(root) == 2 and root["n_neginf"].tolist() == [0, 0]
    raw = tr.records
    assert raw[(raw["module"] == "") & (raw["tensor"] == "output")]["n_neginf"].tolist() == [6, 6]


def test_tensorboard_scalars_of_a_forward_masked_output_are_finite() -> None:
    from nantrace._tensorboard import module_scalars

    tr = _masked_logits_run(nantrace.trace, lambda o: F.cross_entropy(o, torch.tensor([0, 1, 2])))
    root = module_scalars(tr.records, tr.ops).query("module == ''")
    assert root["nonfinite"].tolist() == [False, False]
    assert bool(module_scalars(tr.records).query("module == ''")["nonfinite"].all())  # without ops: -inf


class BigConstantMask(nn.Module):
    """Builds an additive mask as (1 - keep) * -1e9 in float16: -1e9 is past float16's range, so the masked
    entries are -inf and the kept ones 0 (a mask, by the value rule)."""

    def forward(self, keep: torch.Tensor) -> torch.Tensor:
        return (1.0 - keep) * -1e9


class UsesBigMask(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.mask = BigConstantMask()

    def forward(self, scores: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        return torch.softmax((scores + self.mask(keep)).float(), -1)


def test_a_mask_built_from_a_constant_past_the_range_stays_a_mask() -> None:
    """Its -inf comes from a product with no weight among its operands: the value rule (only 0 and -inf, one 0
    at least) keeps it a mask, and every row keeps a key, so nothing is reported."""
    m = UsesBigMask()
    keep = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]], dtype=torch.float16)
    with nantrace.trace(m) as tr:
        m(torch.zeros(2, 3, dtype=torch.float16), keep)
    r = tr.records
    built = r[(r["module"] == "mask") & (r["tensor"] == "output")]
    assert (int(built["n_neginf"].iloc[0]), int(built["n_zero"].iloc[0])) == (3, 3)
    assert tr.first_overflow() is None
