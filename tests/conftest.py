"""Shared pieces of the test suite: tiny models used by several test files, and builders of ``records`` /
``steps`` frames for analysis tests that run without a forward pass."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import pandas as pd
import torch
from torch import nn

from nantrace._schema import RECORD_COLUMNS, STEP_COLUMNS
from nantrace._store import canonical_records, canonical_steps
from nantrace._view import RunView, loaded_view

# ------------------------------------------------------------------------------------------ tiny models


def sgd_run(mode: str, steps: int, before: Callable[[nn.Sequential, int], Any]) -> Any:
    """``steps`` SGD steps (lr 0.01, seed 0) of Linear(4, 8) → ReLU → Linear(8, 2) on inputs of 1 (3 rows), the
    loss ``mean(y²)`` given to ``tr.step``, under ``nantrace.trace`` (``mode="trace"``) or ``nantrace.watch``.
    ``before(model, step)`` runs before each step's forward (a hand edit, a hook registered); what it returns,
    when it has ``remove()`` (a hook handle), is removed after that step. Returns the Trace."""
    import nantrace

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    ctx = nantrace.trace if mode == "trace" else nantrace.watch
    with ctx(model, optimizer=opt) as tr:
        for step in range(steps):
            handle = before(model, step)
            loss = model(torch.ones(3, 4)).pow(2).mean()
            tr.step(loss=loss)
            opt.zero_grad()
            loss.backward()
            opt.step()
            if hasattr(handle, "remove"):
                handle.remove()
    return tr


class TwoLinear(nn.Module):
    """Linear(4→4) → ReLU → Linear(4→2), named ``fc1`` and ``fc2``."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(4, 4)
        self.act = nn.ReLU()
        self.fc2 = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class ScaledLinear(nn.Module):
    """One Linear(8→8) whose weights are all ``w`` and bias 0, so its output is ``8·w·x`` for a constant input."""

    def __init__(self, w: float) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        with torch.no_grad():
            self.fc.weight.fill_(w)
            self.fc.bias.zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x)


class SqrtBetween(nn.Module):
    """fc1 (Linear 4→4, weights ``weight``, bias 0), then the root's own code ``sqrt(fc1(x) - shift)``, then fc2
    (Linear 4→2): NaN made between the submodules where ``fc1(x) < shift`` (for a constant input ``v``, fc1 gives
    ``4·weight·v``)."""

    def __init__(self, weight: float, shift: float) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(4, 4), nn.Linear(4, 2)
        self.shift = shift
        with torch.no_grad():
            self.fc1.weight.fill_(weight)
            self.fc1.bias.zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.sqrt(self.fc1(x) - self.shift))


# ------------------------------------------------------------------------------------------ frames

_DEFAULT_ROW: dict[str, Any] = {
    "step": 0,
    "micro_step": 0,
    "call": 0,
    "module_type": "Linear",
    "dtype": "float16",
    "shape": "(2, 8)",
    "numel": 16,
    "min": -1.0,
    "max": 1.0,
    "absmax": 1.0,
    "absmin": 0.5,
    "n_nan": 0,
    "n_posinf": 0,
    "n_neginf": 0,
    "n_zero": 0,
    "scale": 1.0,
    "parent": None,
    "arg": None,
    "rank": 0,
    "reduced": False,
}


def records_frame(rows: list[dict[str, Any]]) -> pd.DataFrame:
    """A ``records`` frame in the recorder's dtypes from partial rows (``phase``, ``module``, ``tensor`` and the
    counts that matter); ``seq`` and ``event`` default to the row's position (each row its own value)."""
    full = []
    for i, r in enumerate(rows):
        row = {**_DEFAULT_ROW, "seq": i + 1, "event": i + 1, **r}
        full.append({c: row[c] for c in RECORD_COLUMNS})
    return canonical_records(pd.DataFrame(full, columns=list(RECORD_COLUMNS)))


def steps_frame(rows: list[dict[str, Any]]) -> pd.DataFrame:
    """A ``steps`` frame from partial rows (missing columns NaN/None/0)."""
    full = []
    for r in rows:
        row = {c: math.nan for c in STEP_COLUMNS}
        row.update(
            skipped=None,
            growth_tracker=None,
            n_nonfinite=0,
            micro_steps=1,
            n_records=0,
            rank=0,
            recorded="full",
        )
        row.update(r)
        full.append(row)
    df = pd.DataFrame(full, columns=list(STEP_COLUMNS))
    df["skipped"] = pd.array(df["skipped"].tolist(), dtype="boolean")
    return canonical_steps(df)


def frame_view(
    records: pd.DataFrame,
    steps: pd.DataFrame | None = None,
    *,
    world_size: int = 1,
    ranks: list[int] | None = None,
) -> RunView:
    """A run view of built frames, as a loaded trace would have it (no live model)."""
    st = steps if steps is not None else steps_frame([{"step": s} for s in sorted(set(records["step"]))])
    ops = pd.DataFrame(columns=["step", "micro_step", "module", "call", "op", "kind"])
    header: dict[str, Any] = {"model_class": "Built", "options": {}, "world_size": world_size}
    if ranks is not None and len(ranks) > 1:
        header.update(rank=None, ranks=ranks)
    else:
        header["rank"] = 0 if ranks is None else ranks[0]
    return loaded_view(records, st, ops, header)
