"""trace(path=...) streams finished steps to parquet, keeps a bounded window in memory, and loads back whole."""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import pytest
import torch
from torch import nn

import nantrace


def _model() -> nn.Sequential:
    m = nn.Sequential(nn.Linear(2, 2, bias=False), nn.Linear(2, 1, bias=False))
    with torch.no_grad():
        m[0].weight.fill_(1.0)
        m[1].weight.fill_(1.0)
    return m.half()


def _x(step: int) -> torch.Tensor:
    return torch.full((1, 2), 20000.0 if step == 3 else 1.0, dtype=torch.float16)  # step 3: 80000 in m[1]


def test_streaming_keeps_a_window_and_loads_the_whole_run(tmp_path: Path) -> None:
    path = tmp_path / "run.nantrace"
    m = _model()
    with nantrace.trace(m, path=path, flush_every=2) as tr:
        for step in range(5):
            with torch.no_grad():
                m(_x(step))
            if step == 3:
                in_memory = sorted(set(tr._recording.store.records()["step"].tolist()))
                assert not path.exists()  # written under a temporary name until exit
    assert in_memory == [2]  # steps 0-1 were written when the second step closed; step 3 is still open
    assert path.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run.nantrace"]
    rec = tr.records
    assert sorted(set(rec["step"].tolist())) == [0, 1, 2, 3, 4]
    assert len(rec) == 5 * 6  # data, 2 × (input, output), root output
    ov = tr.first_overflow()
    assert ov is not None and (ov.step, ov.phase, ov.module, ov.kind) == (3, "forward", "1", "inf")
    back = nantrace.load(path)
    pd.testing.assert_frame_equal(back.records, rec)
    pd.testing.assert_frame_equal(back.steps, tr.steps)
    assert back.first_overflow() == ov
    assert back.header["options"]["path"] == str(path)


def test_streamed_file_is_completed_when_the_loop_raises(tmp_path: Path) -> None:
    path = tmp_path / "crash.nantrace"
    m = _model()
    boom = RuntimeError("loader died")
    with pytest.raises(RuntimeError) as info, nantrace.trace(m, path=path, flush_every=1):
        for step in range(4):
            with torch.no_grad():
                m(_x(step))
            if step == 3:
                raise boom
    assert info.value is boom
    back = nantrace.load(path)
    assert sorted(set(back.records["step"].tolist())) == [0, 1, 2, 3]
    assert back.first_overflow() is not None and back.first_overflow().step == 3


def test_streaming_rejects_bad_paths_and_flush_every(tmp_path: Path) -> None:
    m = _model()
    with pytest.raises(ValueError, match="does not exist"):
        nantrace.trace(m, path=tmp_path / "no" / "x.nantrace")
    with pytest.raises(ValueError, match="flush_every"):
        nantrace.trace(m, path=tmp_path / "x.nantrace", flush_every=0)


def test_during_the_run_every_step_is_seen_flushed_or_not(tmp_path: Path) -> None:
    """Issue 18 item 8: the overflow at step 3 is still found at step 9, after its step was written and dropped
    from memory; records, overflows() and diagnose() see the same steps as after exit."""
    path = tmp_path / "live.nantrace"
    m = _model()
    seen: dict[int, tuple] = {}
    with nantrace.trace(m, path=path, flush_every=2) as tr:
        for step in range(10):
            with torch.no_grad():
                m(_x(step))
            if step in (5, 9):  # step `step` is still open: steps 0..step-1 are closed
                in_memory = sorted(set(tr._recording.store.records()["step"].tolist()))
                ov = tr.first_overflow()
                seen[step] = (
                    in_memory,
                    sorted(set(tr.records["step"].tolist())),
                    len(tr.records),
                    (ov.step, ov.phase, ov.module, ov.tensor, ov.kind),
                    tr.overflows()[["step", "module", "kind"]].values.tolist(),
                    tr.diagnose().cause,
                )
    where = (3, "forward", "1", "output", "inf")
    # steps 0-3 (then 4-7) were written and dropped from memory when step 3 (then 7) closed
    assert seen[5] == ([4], [0, 1, 2, 3, 4], 5 * 6, where, [[3, "1", "inf"]], "forward_overflow")
    assert seen[9] == ([8], list(range(9)), 9 * 6, where, [[3, "1", "inf"]], "forward_overflow")
    assert tr.diagnose().cause == "forward_overflow"
    assert len(tr.records) == 10 * 6
