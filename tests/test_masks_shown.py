"""A mask's -inf is never shown as an overflow (issue 18 item 5): reprs, the healthy diagnosis's evidence, the
headroom table, the report, TensorBoard's scalars and the plots leave it out; ``records`` keeps its counts."""

from __future__ import annotations

import io
import math
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

import nantrace
from nantrace import plot
from nantrace._masks import unmasked
from nantrace._ranges import headroom_table
from nantrace._report import print_report
from nantrace._tensorboard import module_scalars

SEQ = 3


class Attn(nn.Module):
    """Dot-product attention of ``x`` with itself plus an additive ``mask``: for ``x`` all ones every allowed
    score is 4, so each softmax row is uniform over the allowed keys and the output is all ones."""

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        scores = x @ x.transpose(-1, -2)
        if mask is not None:
            scores = scores + mask
        return torch.softmax(scores, dim=-1) @ x


class Net(nn.Module):
    """``head(attn(x, mask=mask))``, ``head`` a Linear(4→4) with weights 2 and no bias: output 8 for ones."""

    def __init__(self) -> None:
        super().__init__()
        self.attn = Attn()
        self.head = nn.Linear(4, 4, bias=False)
        with torch.no_grad():
            self.head.weight.fill_(2.0)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return self.head(self.attn(x, mask=mask))


@pytest.fixture(scope="module")
def causal() -> Any:
    """Two steps (SGD with lr 0: the values stay) with the standard causal float mask passed as ``mask=``."""
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    mask = nn.Transformer.generate_square_subsequent_mask(SEQ)
    assert int(torch.isneginf(mask).sum()) == SEQ * (SEQ - 1) // 2
    with nantrace.trace(model, optimizer=opt) as tr:
        for _ in range(2):
            opt.zero_grad()
            loss = model(torch.ones(1, SEQ, 4), mask).sum()
            tr.step(loss=loss)
            loss.backward()
            opt.step()
    return tr


def test_records_keep_the_masks_counts(causal: Any) -> None:
    r = causal.records
    held = r[r["n_neginf"] > 0]
    assert [
        (s, p, m, t) for s, p, m, t in held[["step", "phase", "module", "tensor"]].itertuples(index=False)
    ] == [
        (0, "data", "", "input[1]"),
        (0, "forward", "attn", "input.mask"),
        (1, "data", "", "input[1]"),
        (1, "forward", "attn", "input.mask"),
    ]
    assert held["n_neginf"].tolist() == [3] * 4
    assert causal.first_overflow() is None
    assert (unmasked(r)["n_neginf"] == 0).all()


def test_headroom_and_repr_leave_the_mask_out(causal: Any) -> None:
    hr = headroom_table(causal.records)
    assert hr[["module", "module_type", "absmax"]].values.tolist() == [
        ["head", "Linear", 8.0],
        ["", "Net", 8.0],
        ["attn", "Attn", 1.0],
    ]
    assert hr["headroom_bits"].tolist() == [math.log2(65504 / 8)] * 2 + [math.log2(65504)]
    assert repr(causal) == (
        "<nantrace.Trace of Net: 2 steps, 26 records, no GradScaler>\n"
        "dtypes: float32 26\n"
        "first overflow: none (every recorded value finite)\n"
        "least fp16 headroom (bits = log2(65504 / absmax)):\n"
        "  head (Linear): absmax 8, +13.0 bits\n"
        "  (root) (Net): absmax 8, +13.0 bits\n"
        "  attn (Attn): absmax 1, +16.0 bits"
    )
    page = causal._repr_html_()
    assert "<tr><td>attn</td><td>Attn</td><td>1</td><td>+16.0</td></tr>" in page
    assert "overflowed" not in page and ">inf<" not in page


def test_healthy_evidence_and_report_name_finite_headroom(causal: Any) -> None:
    d = causal.diagnose()
    assert d.cause == "healthy"
    (line,) = [e for e in d.evidence if "headroom" in e]
    assert (
        line == "least float16 headroom: `head` (Linear), absmax 8, headroom 13.0 bits below float16's 65504"
    )
    out = io.StringIO()
    print_report(causal, None, file=out)
    text = out.getvalue()
    assert "first overflow: none: every recorded value was finite." in text
    assert line in text
    assert "inf" not in text.replace("inf/NaN", "").replace("finite", "")


def test_tensorboard_scalars_leave_the_mask_out(causal: Any) -> None:
    sc = module_scalars(causal.records)
    assert not sc["nonfinite"].any()
    assert np.isfinite(sc["absmax"].to_numpy(dtype=float)).all()


def test_plots_paint_no_mask_red(causal: Any) -> None:
    assert not plot.nonfinite_grid(causal).to_numpy().any()
    assert not plot.nonfinite_grid(causal, phase="data").to_numpy().any()
    grid = plot.heatmap_grid(causal, value="log2_absmax")
    assert grid.loc["attn"].tolist() == [0.0, 0.0]
    ax = plot.ranges(causal).axes[0]
    assert ax.get_title(loc="left") == (
        "Value range per module at step 1, phase forward (3 modules, 0 with NaN/inf)\n"
        "no overflow: the locator found no NaN/inf produced in this trace"
    )
    assert {t.get_color() for t in ax.get_yticklabels()} == {"black"}
    title = plot.heatmap(causal).axes[0].get_title(loc="left")
    assert title.split("\n")[1:] == ["no overflow: the locator found no NaN/inf produced in this trace"]


def test_transformer_encoder_with_the_causal_mask_shows_no_overflow() -> None:
    """C11's pattern: nn.TransformerEncoder fed the causal mask as ``mask=``: the mask reaches the encoder,
    each layer and each attention as an input; none is shown as having overflowed."""
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(8, 2, 16, batch_first=True, dropout=0.0)
    enc = nn.TransformerEncoder(layer, 1, enable_nested_tensor=False)
    mask = nn.Transformer.generate_square_subsequent_mask(4)
    with nantrace.trace(enc) as tr:
        enc(torch.randn(1, 4, 8), mask=mask)
    r = tr.records
    assert sorted(set(r.loc[r["n_neginf"] > 0, "module"].astype(str))) == [
        "",
        "layers.0",
        "layers.0.self_attn",
    ]
    hr = headroom_table(r, top=100)
    assert np.isfinite(hr["absmax"].to_numpy(dtype=float)).all()
    assert "overflowed" not in repr(tr)
    assert "exceeds" not in " ".join(tr.diagnose().evidence)
    assert not plot.nonfinite_grid(tr).to_numpy().any()


class ScoresPlusMask(nn.Module):
    """A float16 projection of its input, plus an additive mask as transformers builds it: ``finfo(float32).min``
    where masked, 0 elsewhere (finite: no -inf anywhere)."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)
        with torch.no_grad():
            self.proj.weight.copy_(torch.eye(4) * 16.0)
            self.proj.bias.zero_()

    def forward(self, x: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        return torch.softmax(self.proj(x).float() + attention_mask, -1)


class HoldsMask(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn = ScoresPlusMask()

    def forward(self, x: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        return self.attn(x, attention_mask=attention_mask)


def test_a_finite_finfo_min_mask_is_no_activation_in_headroom_or_input_ranges() -> None:
    """The mask's absmax is float32's max (3.403e+38) but it is no value any module computed: the headroom
    table starts at the projection (absmax 16: 12 bits below 65504), and the mask rows are the only ones the rule
    picks (found on Llama: 'least float16 headroom: model.layers.0, absmax 3.403e+38')."""
    from nantrace._masks import lowest_masks

    m = HoldsMask()
    low = torch.finfo(torch.float32).min
    mask = torch.tensor([[0.0, low, 0.0, low]])
    with nantrace.trace(m) as tr, torch.autocast("cpu", dtype=torch.float16):
        m(torch.ones(1, 4), mask).sum().backward()
    rec = tr.records
    picked = rec[lowest_masks(rec)]
    assert sorted(zip(picked["module"], picked["tensor"], strict=True)) == [
        ("", "input[1]"),
        ("attn", "input.attention_mask"),
    ]
    hr = headroom_table(rec)
    assert hr.iloc[0][["module", "absmax", "headroom_bits"]].tolist() == [
        "attn.proj",
        16.0,
        math.log2(65504 / 16),
    ]
    assert float(hr["absmax"].max()) < 65504
