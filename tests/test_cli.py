"""The nantrace command: demo, report, plot, and their exit codes."""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import pytest
import torch
from torch import nn

import nantrace
from nantrace import _report, cli


def _saved(tmp_path: Path, overflow: bool) -> Path:
    m = nn.Sequential(nn.Linear(2, 2, bias=False)).half()
    with torch.no_grad():
        m[0].weight.fill_(1.0)
    with nantrace.trace(m) as tr:
        m(torch.full((1, 2), 40000.0 if overflow else 1.0, dtype=torch.float16))
    return tr.save(tmp_path / ("bad.nantrace" if overflow else "good.nantrace"))


def test_report_exit_codes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["report", str(_saved(tmp_path, True))]) == cli.EXIT_OVERFLOW
    out = capsys.readouterr().out
    assert "first overflow: step 0, forward, module `0` (Linear), inf" in out
    assert "nantrace diagnosis: forward_overflow" in out
    assert cli.main(["report", str(_saved(tmp_path, False))]) == cli.EXIT_OK
    assert "first overflow: none" in capsys.readouterr().out
    assert cli.main(["report", str(tmp_path / "missing.nantrace")]) == cli.EXIT_USAGE
    assert "no such trace file" in capsys.readouterr().err
    text = tmp_path / "notes.txt"
    text.write_text("not a trace")
    assert cli.main(["report", str(text)]) == cli.EXIT_USAGE
    assert "not a nantrace trace" in capsys.readouterr().err


def test_plot_writes_a_png(tmp_path: Path) -> None:
    png = tmp_path / "trace.png"
    assert cli.main(["plot", str(_saved(tmp_path, True)), "-o", str(png)]) == cli.EXIT_OK
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (
        cli.main(["plot", str(_saved(tmp_path, True)), "-o", str(tmp_path / "no" / "x.png")])
        == cli.EXIT_USAGE
    )


def test_demo_runs_a_short_training_and_writes_its_files(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "demo"
    assert cli.main(["demo", "--steps", "2", "--out", str(out), "--no-progress", "--device", "cpu"]) == 0
    text = capsys.readouterr().out
    assert "nantrace demo: a 2-layer character GPT" in text
    assert str(out / "trace.nantrace") in text
    back = nantrace.load(out / "trace.nantrace")
    assert back.steps["step"].tolist() == [0, 1]
    assert back.header["model_class"] == "CharGPT"
    assert (out / "overview.png").exists()


def test_demo_rejects_bad_arguments(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["demo", "--steps", "0"]) == cli.EXIT_USAGE
    assert "--steps must be ≥ 1; got 0" in capsys.readouterr().err
    assert cli.main(["demo", "--lr", "-1"]) == cli.EXIT_USAGE
    with pytest.raises(SystemExit) as info:
        cli.main(["demo", "--dtype", "float8"])
    assert info.value.code == 2


def test_scale_history_and_overflow_runs_are_compact() -> None:
    steps = pd.DataFrame(
        {
            "step": [0, 1, 2, 3],
            "scale": [65536.0, 32768.0, 32768.0, 32768.0],
            "skipped": pd.array([True, False, False, False], dtype="boolean"),
        }
    )
    assert _report.scale_history(steps) == "65536 (step 0, 1 skipped) → 32768 (steps 1-3)"
    ovs = pd.DataFrame(
        {
            "step": [0, 1, 5, 6, 7],
            "phase": ["backward", "backward", "forward", "forward", "forward"],
            "module": ["head", "head", "attn", "attn", "attn"],
            "tensor": ["weight.grad"] * 2 + ["output"] * 3,
            "kind": ["inf"] * 5,
        }
    )
    assert _report.overflow_runs(ovs) == [
        "  steps 0-1     backward  `head` weight.grad inf",
        "  steps 5-7     forward   `attn` output inf",
    ]


def test_report_into_a_closed_pipe_stops_quietly(tmp_path: Path) -> None:
    """`nantrace report PATH | head`: the reader has closed the pipe; no BrokenPipeError traceback, exit 141."""
    import subprocess
    import sys

    path = _saved(tmp_path, True)
    p = subprocess.Popen(
        [sys.executable, "-m", "nantrace", "report", str(path)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    assert p.stdout is not None and p.stderr is not None
    p.stdout.close()  # closed before the report is written
    err = p.stderr.read().decode()
    assert p.wait(timeout=120) == cli.EXIT_BROKEN_PIPE
    assert "Traceback" not in err and "BrokenPipeError" not in err
