"""No host sync in hooks: on the sync-free (accelerator) path, forced on CPU tensors, nantrace code never reads a
tensor value outside the one host copy per step (``_store.to_host``)."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import nantrace
from nantrace import _stats, _store

PACKAGE = str(Path(nantrace.__file__).resolve().parent)
READS = ("item", "tolist", "cpu", "numpy", "__bool__", "__float__", "__int__", "__index__")


@contextmanager
def watch_reads() -> Iterator[tuple[list[str], list[int]]]:
    """Record every tensor read whose *immediate caller* is nantrace code, except inside ``to_host``; and count
    ``to_host`` calls."""
    violations: list[str] = []
    copies = [0]
    originals = {name: getattr(torch.Tensor, name) for name in READS}

    def wrap(name: str):  # type: ignore[no-untyped-def]
        orig = originals[name]

        def read(self, *args, **kwargs):  # type: ignore[no-untyped-def]
            caller = sys._getframe(1)
            path = str(Path(caller.f_code.co_filename).resolve())
            if path.startswith(PACKAGE) and caller.f_code.co_name != "to_host":
                violations.append(f"{name} in {Path(path).name}:{caller.f_lineno} ({caller.f_code.co_name})")
            return orig(self, *args, **kwargs)

        return read

    orig_to_host = _store.to_host

    def counting_to_host(tensors):  # type: ignore[no-untyped-def]
        copies[0] += 1
        return orig_to_host(tensors)

    for name in READS:
        setattr(torch.Tensor, name, wrap(name))
    _store.to_host = counting_to_host  # type: ignore[assignment]
    try:
        yield violations, copies
    finally:
        for name, orig in originals.items():
            setattr(torch.Tensor, name, orig)
        _store.to_host = orig_to_host  # type: ignore[assignment]


def test_detector_catches_a_read_in_nantrace_code() -> None:
    with watch_reads() as (violations, _):
        _stats.stats_host(torch.tensor([1.0, -2.0, 0.0]))  # the CPU path reads values: allowed only on CPU
    assert violations and violations[0].startswith("numpy in _stats.py")  # its bits, read in place


def test_sync_free_traced_amp_steps_read_nothing_outside_the_step_copy() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(inplace=True), nn.Dropout(0.1), nn.Linear(16, 4))
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**20, growth_interval=1)  # skips, then trains
    x, y = torch.randn(32, 8) * 100, torch.randn(32, 4)
    with (
        nantrace.trace(model, scaler=scaler, optimizer=opt, sync_free=True) as tr,
        watch_reads() as (violations, copies),
    ):
        for _ in range(4):
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16):
                out = model(x)
            scaler.scale(F.mse_loss(out.float(), y)).backward()
            scaler.step(opt)
            scaler.update()
    assert violations == []
    assert copies[0] == 4  # one host copy per step
    assert len(tr.steps) == 4 and len(tr.records) > 0
    assert tr.steps["skipped"].tolist()[0] is True


@pytest.mark.parametrize("every", [1, 3])
def test_sync_free_plain_loop_reads_nothing_outside_the_step_copy(every: int) -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 1))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    with (
        nantrace.trace(model, optimizer=opt, sync_free=True, every=every) as tr,
        watch_reads() as (violations, copies),
    ):
        for _ in range(3):
            opt.zero_grad()
            model(torch.randn(5, 4)).pow(2).mean().backward()
            opt.step()
    assert violations == []
    assert copies[0] == 3
    # per step: data 1, forward 7, loss 1 (gradient at the output), backward 9, optimizer 4; every step in
    # full on the sync-free path, whatever `every` says
    assert len(tr.records) == 3 * 22
