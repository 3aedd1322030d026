"""A weight written outside optimizer.step() (by hand, a hook, a load) between the backward and the update: the
recorded absmax, learning rate and gradients bound what the update can do, and a value beyond that bound is named
as the write, not as the optimizer's arithmetic."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import nantrace


def _run(opt_class: Any, lr: float, write: float = float("inf")) -> nantrace.Trace:
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    opt = opt_class(m.parameters(), lr=lr)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(4, 4, generator=g), torch.randn(4, 2, generator=g)
    with nantrace.trace(m, optimizer=opt) as tr:
        for s in range(5):
            opt.zero_grad()
            loss = F.mse_loss(m(x), y)
            tr.step(loss=loss)
            loss.backward()
            if s == 3:
                with torch.no_grad():
                    m[0].weight[0, 0] = write
            opt.step()
            if not torch.isfinite(m[0].weight).all():
                break
    return tr


@pytest.mark.parametrize(
    ("opt_class", "lr", "name"), [(torch.optim.SGD, 1e-2, "SGD"), (torch.optim.AdamW, 1e-3, "AdamW")]
)
def test_an_inf_written_before_the_update_is_not_the_optimizers(opt_class: Any, lr: float, name: str) -> None:
    """The weight had absmax ~0.5 after step 2; one update at this lr moves it by well under 1: the +inf after
    step 3's update was written before it (found by the third new-user check: 'SGD.step() made it inf … check
    the learning rate')."""
    tr = _run(opt_class, lr)
    ov = tr.first_overflow()
    assert ov is not None and (ov.step, ov.phase, ov.module, ov.tensor, ov.kind) == (
        3,
        "optimizer",
        "0",
        "weight",
        "inf",
    )
    d = tr.diagnose()
    assert d.cause == "optimizer"
    assert d.summary == (
        f"`weight` of `0` was non-finite after {name}.step() at step 3, but no update of it can reach that value: "
        "it was written outside optimizer.step()."
    )
    assert d.advice == [
        f"Find what writes `weight` of `0` outside {name}.step() (a manual edit, a hook, a state-dict load, a weight "
        "average) after the last update and before this one; the learning rate is not the cause."
    ]
    line = d.evidence[1]
    assert line.startswith("`weight` had absmax ") and line.endswith(
        "far from float32's 3.403e+38: optimizer.step() cannot have made it inf; it was written outside "
        "optimizer.step() (by hand, a hook, a state-dict load) before this update"
    )
    assert "after optimizer.step()." in str(ov) and "optimizer.step() cannot have made it inf" in str(ov)


def test_no_write_is_claimed_where_the_update_could_reach_the_value() -> None:
    """The same event, with the weight's absmax after step 2 set near float32's max in the view: one update may
    then overflow it, so the bound proves nothing and no write is claimed; nor for an optimizer without a
    bound (RMSprop's step is not read)."""
    from dataclasses import replace

    from nantrace._evidence import unreachable_update

    tr = _run(torch.optim.SGD, 1e-2)
    ov = tr.first_overflow()
    assert ov is not None
    view = tr._view()
    assert unreachable_update(view, ov) is not None
    r = view.records.copy()
    near = (r["phase"] == "optimizer") & (r["module"] == "0") & (r["tensor"] == "weight") & (r["step"] == 2)
    r.loc[near, "absmax"] = 3.4e38
    assert unreachable_update(replace(view, records=r), ov) is None
    meta = replace(view.meta, options={**view.meta.options, "optimizer": "RMSprop"})
    assert unreachable_update(replace(view, meta=meta), ov) is None
