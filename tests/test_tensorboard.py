"""TensorBoard export: event files read back with tensorboard's EventAccumulator, exact step/value pairs."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import nantrace
from nantrace.cli import main

pytest.importorskip("tensorboard")
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

NAN = math.nan
INF = math.inf
BITS_2 = math.log2(65504 / 2)  # fp16 headroom of |x| = 2


def _planted_trace() -> nantrace.Trace:
    """Four steps of a 1-weight model (w = 2, SGD lr 0 keeps it) under fp16 autocast with a GradScaler at
    scale 8: x = 1, NaN, 1, 1e5. Step 1 is all NaN; at step 3 the fp16 cast inside the Linear makes +inf."""
    model = nn.Sequential(nn.Linear(1, 1, bias=False))
    with torch.no_grad():
        model[0].weight.fill_(2.0)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    scaler = torch.amp.GradScaler("cpu", init_scale=8.0)
    with nantrace.trace(model, scaler=scaler, optimizer=opt) as tr:
        for x in (1.0, NAN, 1.0, 1e5):
            with torch.autocast("cpu", dtype=torch.float16):
                loss = model(torch.full((1, 1), x)).float().sum()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
    return tr


@pytest.fixture(scope="module")
def planted() -> nantrace.Trace:
    return _planted_trace()


def _scalars(logdir: Path) -> dict[str, list[tuple[int, float]]]:
    ea = EventAccumulator(str(logdir))
    ea.Reload()
    return {tag: [(e.step, e.value) for e in ea.Scalars(tag)] for tag in ea.Tags()["scalars"]}


def _same(got: list[tuple[int, float]], want: list[tuple[int, float]]) -> bool:
    """Exact step/value pairs; NaN equals NaN; float32 rounding (the event file stores float32) allowed."""
    if [s for s, _ in got] != [s for s, _ in want]:
        return False
    for (_, g), (_, w) in zip(got, want, strict=True):
        if math.isnan(w):
            if not math.isnan(g):
                return False
        elif math.isinf(w):
            if g != w:
                return False
        elif g != pytest.approx(w, rel=1e-6):
            return False
    return True


def test_scalars_and_nonfinite_markers(planted: nantrace.Trace, tmp_path: Path) -> None:
    logdir = planted.to_tensorboard(tmp_path / "tb")
    assert logdir == tmp_path / "tb"
    sc = _scalars(logdir)
    n_bad = [int(v) for v in planted.steps["n_nonfinite"]]
    assert n_bad[0] == 0 and n_bad[2] == 0 and n_bad[1] > 0 and n_bad[3] > 0
    want = {
        "nantrace/loss": [(0, 2.0), (1, NAN), (2, 2.0), (3, INF)],
        "nantrace/nonfinite/loss": [(0, 0.0), (1, 1.0), (2, 0.0), (3, 1.0)],
        "nantrace/loss_scale": [(0, 8.0), (1, 8.0), (2, 4.0), (3, 4.0)],
        "nantrace/nonfinite/loss_scale": [(0, 0.0), (1, 0.0), (2, 0.0), (3, 0.0)],
        "nantrace/skipped": [(0, 0.0), (1, 1.0), (2, 0.0), (3, 1.0)],
        # unscaled: d(w*x)/dw = x = 1 on the finite steps
        "nantrace/grad_norm": [(0, 1.0), (1, NAN), (2, 1.0), (3, INF)],
        "nantrace/nonfinite/grad_norm": [(0, 0.0), (1, 1.0), (2, 0.0), (3, 1.0)],
        "nantrace/n_nonfinite": [(s, float(n)) for s, n in enumerate(n_bad)],
        # forward outputs of the root and of its Linear `0`: w*x = 2; all NaN at step 1; +inf at step 3
        "nantrace/absmax/(root)": [(0, 2.0), (1, NAN), (2, 2.0), (3, INF)],
        "nantrace/absmax/0": [(0, 2.0), (1, NAN), (2, 2.0), (3, INF)],
        "nantrace/nonfinite/absmax/(root)": [(0, 0.0), (1, 1.0), (2, 0.0), (3, 1.0)],
        "nantrace/nonfinite/absmax/0": [(0, 0.0), (1, 1.0), (2, 0.0), (3, 1.0)],
        # no headroom where absmax is NaN (step 1); -inf bits where the output overflowed
        "nantrace/headroom_bits/(root)": [(0, BITS_2), (2, BITS_2), (3, -INF)],
        "nantrace/headroom_bits/0": [(0, BITS_2), (2, BITS_2), (3, -INF)],
    }
    assert sorted(sc) == sorted(want)
    for tag, pairs in want.items():
        assert _same(sc[tag], pairs), (tag, sc[tag], pairs)


def test_first_overflow_written_as_text(planted: nantrace.Trace, tmp_path: Path) -> None:
    planted.to_tensorboard(tmp_path)
    ea = EventAccumulator(str(tmp_path))
    ea.Reload()
    events = ea.Tensors("nantrace/first_overflow/text_summary")
    ov = planted.first_overflow()
    assert ov is not None and ov.step == 1
    assert [e.step for e in events] == [1]
    assert events[0].tensor_proto.string_val[0].decode() == str(ov)


def test_open_writer_and_prefix(planted: nantrace.Trace, tmp_path: Path) -> None:
    from torch.utils.tensorboard import SummaryWriter

    writer = SummaryWriter(log_dir=str(tmp_path))
    writer.add_scalar("user/own", 5.0, global_step=0)
    assert planted.to_tensorboard(writer, tag_prefix="run7/nan") == tmp_path
    writer.add_scalar("user/own", 6.0, global_step=1)  # still open: the export flushed it, did not close it
    writer.close()
    sc = _scalars(tmp_path)
    assert sc["user/own"] == [(0, 5.0), (1, 6.0)]
    assert _same(sc["run7/nan/loss"], [(0, 2.0), (1, NAN), (2, 2.0), (3, INF)])
    assert not any(t.startswith("nantrace/") for t in sc)


class _ListWriter:
    """A writer that is not torch's SummaryWriter (e.g. tensorboardX's): only add_scalar/add_text/flush."""

    def __init__(self) -> None:
        self.scalars: dict[str, list[tuple[int, float]]] = {}
        self.texts: list[tuple[str, str, int]] = []
        self.flushed = 0

    def add_scalar(self, tag: str, value: float, global_step: int) -> None:
        self.scalars.setdefault(tag, []).append((global_step, value))

    def add_text(self, tag: str, text: str, global_step: int) -> None:
        self.texts.append((tag, text, global_step))

    def flush(self) -> None:
        self.flushed += 1


def test_other_writer_gets_the_same_scalars(planted: nantrace.Trace, tmp_path: Path) -> None:
    w = _ListWriter()
    assert planted.to_tensorboard(w) is None  # it does not tell its directory
    assert w.flushed == 1
    from_file = _scalars(planted.to_tensorboard(tmp_path))  # type: ignore[arg-type]
    assert sorted(w.scalars) == sorted(from_file)
    for tag, pairs in from_file.items():
        assert _same(w.scalars[tag], pairs), tag
    ov = planted.first_overflow()
    assert w.texts == [("nantrace/first_overflow", str(ov), 1)]


def test_no_scaler_no_loss_scale_or_skipped(tmp_path: Path) -> None:
    """Values a run cannot know are not written: no GradScaler, no loss_scale/skipped; no loss seen, no loss."""
    model = nn.Linear(1, 1, bias=False)
    with torch.no_grad():
        model.weight.fill_(3.0)
    with nantrace.trace(model) as tr:
        model(torch.ones(1, 1))
        model(torch.full((1, 1), INF))
    sc = _scalars(tr.to_tensorboard(tmp_path))  # type: ignore[arg-type]
    assert sorted(sc) == [
        "nantrace/absmax/(root)",
        "nantrace/headroom_bits/(root)",
        "nantrace/n_nonfinite",
        "nantrace/nonfinite/absmax/(root)",
    ]
    assert _same(sc["nantrace/absmax/(root)"], [(0, 3.0), (1, INF)])
    assert _same(sc["nantrace/headroom_bits/(root)"], [(0, math.log2(65504 / 3)), (1, -INF)])
    assert _same(sc["nantrace/nonfinite/absmax/(root)"], [(0, 0.0), (1, 1.0)])
    assert _same(sc["nantrace/n_nonfinite"], [(0, 0.0), (1, 2.0)])  # the +inf input and output


def test_report_cli_writes_tensorboard(planted: nantrace.Trace, tmp_path: Path) -> None:
    path = planted.save(tmp_path / "t.nantrace")
    assert main(["report", str(path), "--tensorboard", str(tmp_path / "tb")]) == 1  # the trace overflowed
    loaded = _scalars(tmp_path / "tb")
    planted.to_tensorboard(tmp_path / "direct")
    direct = _scalars(tmp_path / "direct")
    assert sorted(loaded) == sorted(direct)
    for tag in direct:
        assert _same(loaded[tag], direct[tag]), tag


def test_bad_arguments(planted: nantrace.Trace, tmp_path: Path) -> None:
    with pytest.raises(TypeError, match="logdir_or_writer must be a directory"):
        planted.to_tensorboard(3)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="tag_prefix '' must be non-empty"):
        planted.to_tensorboard(tmp_path, tag_prefix="")
    with pytest.raises(ValueError, match="tag_prefix '/x' must be non-empty and not start or end with '/'"):
        planted.to_tensorboard(tmp_path, tag_prefix="/x")
    (tmp_path / "f").write_text("x")
    with pytest.raises(ValueError, match="exists and is not a directory"):
        planted.to_tensorboard(tmp_path / "f")


def test_missing_tensorboard_is_a_clear_error(
    planted: nantrace.Trace,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.setitem(sys.modules, "tensorboard", None)  # `import tensorboard` now raises ImportError
    with pytest.raises(ImportError, match=r'pip install "nantrace\[tensorboard\]"'):
        planted.to_tensorboard(tmp_path / "tb")
    path = planted.save(tmp_path / "t.nantrace")
    assert main(["report", str(path), "--tensorboard", str(tmp_path / "tb")]) == 3
    assert 'pip install "nantrace[tensorboard]"' in capsys.readouterr().err


def test_import_nantrace_imports_no_optional_extra() -> None:
    code = (
        "import nantrace, sys; "
        "print([m for m in ('tensorboard', 'transformers', 'lightning') if m in sys.modules])"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


class _Scale(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.ones(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.w


def test_nan_only_outputs_keep_a_finite_absmax_and_mark_the_module(tmp_path: Path) -> None:
    """``nonfinite/absmax/<module>`` marks outputs holding NaN; ``absmax`` stays the finite absmax (3), and
    headroom is written from it."""
    model = nn.Sequential(_Scale())  # elementwise: the NaN stays in one element of the output
    with nantrace.trace(model) as tr:
        model(torch.tensor([[NAN, 3.0]]))
    sc = _scalars(tr.to_tensorboard(tmp_path / "tb"))  # type: ignore[arg-type]
    assert _same(sc["nantrace/absmax/0"], [(0, 3.0)])
    assert _same(sc["nantrace/nonfinite/absmax/0"], [(0, 1.0)])
    assert _same(sc["nantrace/headroom_bits/0"], [(0, math.log2(65504 / 3))])
