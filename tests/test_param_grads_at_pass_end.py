"""Small parameter gradients: their rows are appended in the post-accumulate-grad hook and their statistics
computed together when the backward pass ends (``nantrace._hooks.add_later``/``resolve_later``). The records
are the ones computing each gradient's statistics in its hook gives, and the statistics are those of the
gradient as accumulated: a user's hook after nantrace's that changes it in place does not leak into them, nor
does a backward pass that raised lose them."""

from __future__ import annotations

from typing import Any

import pandas as pd
import pytest
import torch
from torch import nn

import nantrace
import nantrace._hooks as hooks
from nantrace._stats import stats_host


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3))


def _run(monkeypatch: pytest.MonkeyPatch, *, later: bool, micro: int = 2) -> tuple[pd.DataFrame, list[int]]:
    """Three steps of ``micro`` micro-steps each (gradient accumulation: one backward pass per micro-step)."""
    m = _model()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    xs, ys = torch.randn(micro, 4, 6), torch.randn(micro, 4, 3)
    batches: list[int] = []
    real = hooks.stats_host_many

    def counted(ts: Any) -> Any:
        batches.append(len(ts))
        return real(ts)

    monkeypatch.setattr(hooks, "stats_host_many", counted)
    if not later:
        monkeypatch.setattr("nantrace._scaler.add_later", lambda *a: False)
    with nantrace.trace(m, optimizer=opt) as tr:
        for _ in range(3):
            opt.zero_grad()
            for i in range(micro):
                loss = nn.functional.mse_loss(m(xs[i]), ys[i])
                loss.backward()
            tr.step(loss=loss)
            opt.step()
    monkeypatch.undo()
    return tr.records, batches


def test_rows_at_the_pass_end_are_the_rows_computed_in_the_hook(monkeypatch: pytest.MonkeyPatch) -> None:
    """Column for column (statistics, seq, event ids, micro-steps) the same records; the four gradients of
    each backward pass (two micro-steps a step, three steps) were reduced in one call at its end, and the
    optimizer's post-step hook reduced the four parameters in one call a step."""
    together, batches = _run(monkeypatch, later=True)
    alone, none = _run(monkeypatch, later=False)
    pd.testing.assert_frame_equal(together, alone)
    grads = together[(together["phase"] == "backward") & together["tensor"].astype(str).str.endswith(".grad")]
    assert len(grads) == 3 * 2 * 4 and grads["micro_step"].tolist() == ([0] * 4 + [1] * 4) * 3
    assert batches == [4, 4, 4] * 3  # per step: two passes' gradients, then the optimizer's parameters
    assert none == [4, 4, 4]  # without add_later only the optimizer's batch runs


def test_a_later_user_hook_that_changes_the_gradient_leaves_the_row_as_accumulated() -> None:
    """A post-accumulate-grad hook of the user's registered after nantrace's (it runs after it) scales the
    gradient in place: the row holds the gradient as accumulated (computed in nantrace's hook, not at the pass
    end), equal to the statistics of a clone taken before the user's hook in an untraced run."""

    def train(traced: bool) -> tuple[list[tuple[float, ...]], Any]:
        m = _model()
        seen: list[tuple[float, ...]] = []
        x, y = torch.randn(4, 6), torch.randn(4, 3)

        def user(p: torch.Tensor) -> None:
            if not traced:
                seen.append(stats_host(p.grad))
            p.grad.mul_(1e3)

        tr = nantrace.trace(m)
        if traced:
            tr.__enter__()
        h = m[2].weight.register_post_accumulate_grad_hook(user)
        nn.functional.mse_loss(m(x), y).backward()
        h.remove()
        if traced:
            tr.__exit__(None, None, None)
        return seen, tr

    expected, _ = train(traced=False)
    _, tr = train(traced=True)
    row = tr.records[(tr.records["module"] == "2") & (tr.records["tensor"] == "weight.grad")]
    got = tuple(
        float(row.iloc[0][c])
        for c in ("min", "max", "absmax", "absmin", "n_nan", "n_posinf", "n_neginf", "n_zero")
    )
    assert got == expected[0]


def test_a_backward_pass_that_raised_keeps_the_rows_statistics() -> None:
    """A tensor hook on the input raises after the last layer's gradients were accumulated (autograd runs
    accumulations as soon as they are ready), so the pass never reaches its end: the rows appended in the pass
    get their statistics when the step ends (the trace's exit), equal to those of the gradients left in
    ``.grad``; a parameter the pass did not reach has no row."""
    m = _model()
    x = torch.randn(4, 6, requires_grad=True)
    y = torch.randn(4, 3)

    def fail(g: torch.Tensor) -> None:
        raise RuntimeError("user hook")

    with nantrace.trace(m) as tr:
        x.register_hook(fail)
        with pytest.raises(RuntimeError, match="user hook"):
            nn.functional.mse_loss(m(x), y).backward()
    rows = tr.records[tr.records["tensor"].astype(str).str.endswith(".grad")]
    reached = {
        f"{i}.{n}" for i, layer in enumerate(m) for n, p in layer.named_parameters() if p.grad is not None
    }
    assert {"2.weight", "2.bias"} <= reached
    assert (
        set(rows["module"].astype(str) + "." + rows["tensor"].astype(str).str.removesuffix(".grad"))
        == reached
    )
    for _, row in rows.iterrows():
        module = m[int(row["module"])]
        p = getattr(module, str(row["tensor"]).removesuffix(".grad"))
        got = tuple(
            float(row[c])
            for c in ("min", "max", "absmax", "absmin", "n_nan", "n_posinf", "n_neginf", "n_zero")
        )
        assert got == stats_host(p.grad)
