"""Save/load round trips, atomic writes, clear errors for foreign files, and the text/HTML reprs."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from torch import nn

import nantrace
from nantrace import _format as _io


class Overflowing(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(4, 4, bias=False)
        self.down = nn.Linear(4, 2, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(self.up(x))


def _overflowing_trace(steps: int = 3) -> nantrace.Trace:
    m = Overflowing()
    with torch.no_grad():
        m.up.weight.fill_(1.0)
        m.down.weight.fill_(1.0)
    m = m.half()
    with nantrace.trace(m) as tr:
        for i in range(steps):
            # inputs 100, 1000, 10000: `up` gives 4x (40000 at step 2, finite), `down` 16x (160000: inf)
            m(torch.full((2, 4), 10.0 ** (i + 2), dtype=torch.float16))
    return tr


def test_save_load_round_trip_is_equal(tmp_path: Path) -> None:
    tr = _overflowing_trace()
    path = tr.save(tmp_path / "run.nantrace")
    assert path == tmp_path / "run.nantrace" and path.exists()
    back = nantrace.load(path)
    pd.testing.assert_frame_equal(back.records, tr.records)
    pd.testing.assert_frame_equal(back.steps, tr.steps)
    pd.testing.assert_frame_equal(back.ops, tr.ops)
    ov = tr.first_overflow()
    assert ov is not None and (ov.step, ov.module, ov.kind) == (2, "down", "inf")
    assert back.first_overflow() == ov and str(back.first_overflow()) == str(ov)
    pd.testing.assert_frame_equal(back.overflows(), tr.overflows())
    assert repr(back) == repr(tr)
    assert back._repr_html_() == tr._repr_html_()
    head = _io.read_header(path)
    assert head["format"] == _io.FORMAT_VERSION
    assert head["torch"] == torch.__version__ and head["nantrace"] == nantrace.__version__
    assert head["model_class"] == "Overflowing" and head["dtypes"] == ["float16"]
    assert head["options"]["phases"] == ["data", "forward", "loss", "backward", "optimizer"]
    assert [p.name for p in tmp_path.iterdir()] == ["run.nantrace"]  # no temporary files left


@pytest.mark.parametrize("loaded", [False, True], ids=["live", "loaded"])
def test_changing_returned_frames_does_not_change_the_trace(tmp_path: Path, loaded: bool) -> None:
    import warnings

    tr = _overflowing_trace()
    if loaded:
        tr = nantrace.load(tr.save(tmp_path / "a.nantrace"))
    n, ov, n_steps, n_ops = len(tr.records), tr.first_overflow(), len(tr.steps), len(tr.ops)
    assert ov is not None and (ov.step, ov.module) == (2, "down") and n > 0 and n_ops > 0
    r = tr.records
    assert r is not tr.records
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # pandas 3.1 deprecates inplace=
        warnings.simplefilter("ignore", FutureWarning)
        r.drop(r[r["module"].astype(str) == "down"].index, inplace=True)
        r["n_posinf"] = 0
        st = tr.steps
        st.drop(st.index, inplace=True)
        ops = tr.ops
        ops.drop(ops.index, inplace=True)
    assert len(r) < n and len(st) == 0 and len(ops) == 0
    assert len(tr.records) == n and len(tr.steps) == n_steps and len(tr.ops) == n_ops
    assert tr.first_overflow() == ov
    assert int(tr.records["n_posinf"].sum()) > 0


def test_loaded_trace_is_read_only(tmp_path: Path) -> None:
    back = nantrace.load(_overflowing_trace(1).save(tmp_path / "a.nantrace"))
    with pytest.raises(nantrace.NantraceError, match="read-only"), back:
        pass


def test_interrupted_save_leaves_old_file_and_no_half_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    tr = _overflowing_trace(1)
    target = tmp_path / "t.nantrace"
    tr.save(target)
    before = target.read_bytes()

    def broken(table: pa.Table, where: object, **kw: object) -> None:
        assert hasattr(where, "write")
        where.write(b"PAR1 half a file")  # type: ignore[attr-defined]
        raise KeyboardInterrupt

    monkeypatch.setattr(pq, "write_table", broken)
    with pytest.raises(KeyboardInterrupt):
        tr.save(target)
    assert target.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t.nantrace"]


def test_load_rejects_files_that_are_not_traces(tmp_path: Path) -> None:
    text = tmp_path / "notes.txt"
    text.write_text("hello")
    with pytest.raises(nantrace.NantraceError, match="not a nantrace trace"):
        nantrace.load(text)
    plain = tmp_path / "plain.parquet"
    pq.write_table(pa.table({"a": [1, 2]}), plain)
    with pytest.raises(nantrace.NantraceError, match="no nantrace metadata"):
        nantrace.load(plain)
    with pytest.raises(FileNotFoundError, match="no such trace file"):
        nantrace.load(tmp_path / "missing.nantrace")
    with pytest.raises(TypeError, match="path must be"):
        nantrace.load(42)  # type: ignore[arg-type]


def test_load_rejects_incompatible_format_version(tmp_path: Path) -> None:
    path = _overflowing_trace(1).save(tmp_path / "old.nantrace")
    table = pq.read_table(path)
    meta = json.loads(table.schema.metadata[b"nantrace"])
    meta["header"]["format"] = _io.FORMAT_VERSION + 1
    md = dict(table.schema.metadata)
    md[b"nantrace"] = json.dumps(meta).encode()
    pq.write_table(table.replace_schema_metadata(md), path)
    with pytest.raises(nantrace.NantraceError, match=f"format {_io.FORMAT_VERSION + 1}"):
        nantrace.load(path)


def test_save_rejects_bad_paths(tmp_path: Path) -> None:
    tr = _overflowing_trace(1)
    with pytest.raises(ValueError, match="is a directory"):
        tr.save(tmp_path)
    with pytest.raises(ValueError, match="does not exist"):
        tr.save(tmp_path / "nope" / "t.nantrace")
    with pytest.raises(TypeError, match="path must be"):
        tr.save(3.5)  # type: ignore[arg-type]
    if os.geteuid() != 0:  # root can write anywhere
        ro = tmp_path / "ro"
        ro.mkdir()
        ro.chmod(0o500)
        with pytest.raises(ValueError, match="not writable"):
            tr.save(ro / "t.nantrace")


def test_text_repr_names_steps_dtypes_overflow_and_headroom() -> None:
    tr = _overflowing_trace()
    text = repr(tr)
    lines = text.splitlines()
    assert lines[0] == "<nantrace.Trace of Overflowing: 3 steps, 18 records, no GradScaler>"
    assert lines[1] == "dtypes: float16 18"
    assert lines[2] == "first overflow: step 2 forward: `down` (`linear`) overflowed float16 (+inf)"
    assert "least fp16 headroom (bits = log2(65504 / absmax)):" in lines
    assert "  down (Linear): overflowed (held inf)" in lines
    assert "  up (Linear): absmax 4e+04, +0.7 bits" in lines


def test_html_repr_escapes_and_has_text_fallback() -> None:
    m = nn.Sequential()
    m.add_module("<b>evil</b>", nn.Linear(2, 2))
    with nantrace.trace(m) as tr:
        m(torch.ones(1, 2))
    page = tr._repr_html_()
    assert "<b>evil</b>" not in page
    assert "&lt;b&gt;evil&lt;/b&gt;" in page
    assert "<pre" in page and "No overflow" in page
    assert "first overflow: none (every recorded value finite)" in repr(tr)


def test_healthy_headroom_bits_are_exact() -> None:
    m = nn.Linear(2, 2, bias=False)
    with torch.no_grad():
        m.weight.copy_(torch.tensor([[2.0, 0.0], [0.0, 0.5]]))
    with nantrace.trace(m) as tr:
        m(torch.tensor([[1024.0, 1.0]]))
    from nantrace._ranges import headroom_table

    hr = headroom_table(tr.records)
    assert hr["module"].tolist() == [""]
    assert hr["absmax"].tolist() == [2048.0]
    assert hr["headroom_bits"].tolist() == [pytest.approx(4.999295387)]  # log2(65504 / 2048)


def test_a_wrapped_model_is_named_by_its_own_class_then_the_wrapper(tmp_path: Path) -> None:
    """Module names drop wrappers, so the report's model line names the unwrapped class first."""
    inner = nn.Sequential(nn.Linear(2, 2))
    wrapped = nn.DataParallel(inner)  # no GPU: DataParallel calls the module itself
    with nantrace.trace(wrapped) as tr:
        wrapped(torch.ones(1, 2))
    assert repr(tr).startswith("<nantrace.Trace of Sequential (in DataParallel):")
    assert (
        nantrace.load(tr.save(tmp_path / "w.nantrace")).header["model_class"]
        == "Sequential (in DataParallel)"
    )
