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
    lines = out.splitlines()
    start = lines.index("first overflow: step 0, forward, module `0` (Linear), inf") + 1
    body = lines[start : lines.index("", start)]
    # every line of the explanation sits under its heading (only the first was indented)
    assert len(body) > 2 and all(line.startswith("  ") for line in body)
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
    assert "float16 autocast + GradScaler, Adam warming up to lr 0.1, 2 steps, cpu" in text.splitlines()[0]
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


def _stepped(tmp_path: Path) -> Path:
    """A saved trace of 3 steps (one per forward, no optimizer): x = 1, 1, 40000 into a Linear with weights 1,
    so its output 2x overflows float16 first at step 2."""
    lin = nn.Linear(2, 2, bias=False)
    m = nn.Sequential(lin).half()
    with torch.no_grad():
        lin.weight.fill_(1.0)
    with nantrace.trace(m) as tr:
        for v in (1.0, 1.0, 40000.0):
            m(torch.full((1, 2), v, dtype=torch.float16))
    return tr.save(tmp_path / "stepped.nantrace")


@pytest.mark.parametrize("what", ["overview", "heatmap", "scale"])
def test_plot_step_applies_to_ranges_only(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], what: str
) -> None:
    png = tmp_path / "x.png"
    assert cli.main(["plot", str(_stepped(tmp_path)), "-o", str(png), "--what", what, "--step", "1"]) == 2
    assert cli.EXIT_USAGE == 2  # the exit code of argparse's own usage errors
    assert capsys.readouterr().err == (
        f"nantrace: error: --step applies only to --what ranges (got --what {what}); "
        "drop --step or use --what ranges\n"
    )
    assert not png.exists()
    with pytest.raises(SystemExit) as info:  # a usage error argparse finds exits with the same code
        cli.main(["plot", str(png), "-o", str(png), "--what", "bars"])
    assert info.value.code == cli.EXIT_USAGE


def test_plot_phase_checks(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path, png = str(_stepped(tmp_path)), str(tmp_path / "x.png")
    assert cli.main(["plot", path, "-o", png, "--what", "scale", "--phase", "forward"]) == cli.EXIT_USAGE
    assert capsys.readouterr().err == (
        "nantrace: error: --phase does not apply to --what scale: the loss-scale timeline has no phases; "
        "drop --phase\n"
    )
    assert cli.main(["plot", path, "-o", png, "--phase", "forward,fwd"]) == cli.EXIT_USAGE
    assert capsys.readouterr().err == (
        "nantrace: error: --phase 'forward,fwd': choose one of data,forward,loss,backward,optimizer, "
        "a comma-separated list of them, or all\n"
    )
    assert cli.main(["plot", path, "-o", png, "--what", "ranges", "--phase", "backward"]) == cli.EXIT_USAGE
    assert capsys.readouterr().err == (
        "nantrace: error: records has no rows with phase='backward'; phases present: ['data', 'forward']\n"
    )
    assert not Path(png).exists()


def test_plot_options_parse_the_phase() -> None:
    assert cli._plot_options("ranges", 2, None) == (True, "default")
    assert cli._plot_options("heatmap", None, "all") == (True, None)
    assert cli._plot_options("overview", None, "backward") == (True, "backward")
    assert cli._plot_options("ranges", None, "data, forward") == (True, ("data", "forward"))


def test_plot_ranges_shows_the_first_overflow_step_and_the_chosen_phase(tmp_path: Path) -> None:
    back = nantrace.load(_stepped(tmp_path))
    (fig,) = cli._figures(back, "ranges", None).values()
    assert fig.axes[0].get_title(loc="left") == (
        "Value range per module at step 2, phase forward (2 modules, 2 with NaN/inf)\n"
        "first overflow in the trace: step 2, forward, '0' output (inf)"
    )
    (fig,) = cli._figures(back, "ranges", 1, "data").values()
    assert fig.axes[0].get_title(loc="left").split("\n")[0] == (
        "Value range per module at step 1, phase data (1 modules, 0 with NaN/inf)"
    )
    (fig,) = cli._figures(back, "heatmap", None, None).values()
    assert fig.axes[0].get_title(loc="left") == (
        "Headroom to float16 max 65504: log2(65504 / max|x|) [bits], all phases\n"
        "first non-finite value at step 2 in '<root>', '0'\n"
        "first overflow in the trace: step 2, forward, '0' output (inf)"
    )


@pytest.mark.parametrize(
    ("args", "title"),
    [
        (["--what", "ranges"], "Value range per module at step 2, phase forward"),
        (
            ["--what", "ranges", "--step", "0", "--phase", "data"],
            "Value range per module at step 0, phase data",
        ),
        (["--what", "heatmap", "--phase", "data,forward"], "[bits], phase data+forward"),
        (["--phase", "all"], "[bits], all phases"),
    ],
)
def test_plot_writes_what_the_options_ask_for(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    args: list[str],
    title: str,
) -> None:
    from matplotlib.figure import Figure

    titles: list[str] = []
    save = Figure.savefig

    def record(fig: Figure, *a: object, **kw: object) -> None:
        titles.append(fig.axes[0].get_title(loc="left"))
        save(fig, *a, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(Figure, "savefig", record)
    png = tmp_path / "x.png"
    assert cli.main(["plot", str(_stepped(tmp_path)), "-o", str(png), *args]) == cli.EXIT_OK
    assert capsys.readouterr().out == f"wrote {png}\n"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    (shown,) = titles
    assert title in shown.split("\n")[0]


def test_demo_help_states_the_demos_own_defaults(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from nantrace.examples.chargpt import DemoConfig

    cfg = DemoConfig()  # what `nantrace demo` runs when no option is given
    monkeypatch.setenv("COLUMNS", "250")  # one line per option
    with pytest.raises(SystemExit) as info:
        cli.main(["demo", "--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    expected = [
        f"  --steps STEPS         optimizer steps to run (default: {cfg.steps})",
        f"  --lr LR               peak Adam learning rate, reached by a linear warmup over the first "
        f"{cfg.warmup_steps} optimizer updates, steps the GradScaler skips not counted "
        f"(default: {cfg.lr:g}, deliberately high)",
        f"                        autocast dtype (default: {cfg.dtype})",
        f"  --seed SEED           seed for weights and batches (default: {cfg.seed})",
    ]
    assert [line for line in lines if line in expected] == expected
    description = " ".join(out.split())  # the description wraps: compare its words
    assert (
        f"The default configuration ({cfg.n_layer} layers, d_model {cfg.d_model}, no LayerNorm inside the blocks, "
        f"{cfg.steps} steps, Adam warming up to lr {cfg.lr:g}) genuinely overflows float16" in description
    )
    assert not cfg.norm  # "no LayerNorm inside the blocks" is the config's norm=False


def test_demo_option_defaults_are_the_configs() -> None:
    from nantrace.examples.chargpt import DemoConfig

    cfg = DemoConfig()
    args = cli._parser().parse_args(["demo"])
    assert (args.dtype, args.seed) == (cfg.dtype, cfg.seed)
    assert (args.steps, args.lr) == (None, None)  # None: the demo keeps the config's steps and lr


def test_demo_draws_the_ranges_of_the_diagnosed_step(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    drawn: list[tuple[str, object, object]] = []
    real = cli._figures

    def spy(tr: object, what: str, step: object, phase: object = "default") -> dict[str, object]:
        drawn.append((what, step, phase))
        return real(tr, what, step, phase)  # type: ignore[arg-type]

    monkeypatch.setattr(cli, "_figures", spy)
    out = tmp_path / "demo"
    assert cli.main(["demo", "--steps", "3", "--out", str(out), "--no-progress", "--device", "cpu"]) == 0
    capsys.readouterr()
    d = nantrace.load(out / "trace.nantrace").diagnose()
    assert d.overflow is not None
    assert drawn == [("overview", None, "default"), ("ranges", d.overflow.step, (d.overflow.phase,))]
    assert (out / "ranges.png").exists()


def test_the_bfloat16_demo_runs_without_loss_scaling(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from nantrace.examples.chargpt import DemoConfig, build

    assert build(DemoConfig(dtype="float16", steps=1))[2].is_enabled()
    assert not build(DemoConfig(dtype="bfloat16", steps=1))[2].is_enabled()
    out = tmp_path / "bf16"
    argv = [
        "demo",
        "--dtype",
        "bfloat16",
        "--steps",
        "2",
        "--out",
        str(out),
        "--no-progress",
        "--device",
        "cpu",
    ]
    assert cli.main(argv) == 0
    header = capsys.readouterr().out.splitlines()[0]
    assert "bfloat16 autocast (no GradScaler), Adam warming up" in header and "GradScaler," not in header
    steps = nantrace.load(out / "trace.nantrace").steps
    assert steps["scale"].isna().all() and steps["skipped"].isna().all()  # no loss scale, no skipped steps


def test_plot_output_that_is_a_directory_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    saved = _saved(tmp_path, True)
    assert cli.main(["plot", str(saved), "-o", str(tmp_path), "--what", "scale"]) == cli.EXIT_USAGE
    err = capsys.readouterr().err
    assert f"-o '{tmp_path}' is a directory; give a file name such as '{tmp_path / 'overview.png'}'" in err
    assert not Path(f"{tmp_path}.png").exists()


def test_plot_output_with_a_suffix_matplotlib_cannot_write_is_a_usage_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    saved = _saved(tmp_path, True)
    notes = tmp_path / "notes.txt"
    assert cli.main(["plot", str(saved), "-o", str(notes), "--what", "scale"]) == cli.EXIT_USAGE
    err = capsys.readouterr().err
    assert f"-o '{notes}': matplotlib cannot write a .txt file; end the name with one of " in err
    assert ".png" in err and "Traceback" not in err
    assert not notes.exists()
    assert cli.main(["plot", str(saved), "-o", str(tmp_path / "scale.PDF"), "--what", "scale"]) == cli.EXIT_OK
    assert (tmp_path / "scale.PDF").stat().st_size > 0


@pytest.mark.parametrize("under", [False, True])
def test_demo_out_that_is_a_file_is_refused_by_name(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], under: bool
) -> None:
    f = tmp_path / "taken"
    f.write_text("keep me")
    out = f / "sub" if under else f
    assert cli.main(["demo", "--steps", "1", "--out", str(out), "--no-progress", "--device", "cpu"]) == 2
    what = f"its parent {str(f)!r}" if under else "--out"
    assert capsys.readouterr().err == (
        f"nantrace: error: --out {str(out)!r}: {what} is a file, not a directory; choose a directory for --out\n"
    )
    assert f.read_text() == "keep me"


def test_scale_history_prints_scales_with_the_one_number_formatter() -> None:
    steps = pd.DataFrame(
        {"step": [0, 1, 2], "scale": [2.0**20, 2.0**19, 2.0**-7], "skipped": [True, True, False]}
    )
    assert _report.scale_history(steps) == (
        "1048576 (step 0, 1 skipped) → 524288 (step 1, 1 skipped) → 0.007812 (step 2)"
    )
