"""The ``nantrace`` command: ``demo``, ``report``, ``plot`` and ``run``.

Exit codes: 0 = done and no non-finite value in the trace; 1 = done and the trace holds an overflow (``report``)
; 2 = usage error, or the file is not a readable trace; 3 = a needed optional extra (matplotlib, tensorboard) is
missing; 141 = the reader closed the output pipe early (``nantrace report PATH | head``). ``run`` exits with the
script's own exit code.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import math
import os
import sys
import textwrap
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = ["main"]

EXIT_OK, EXIT_OVERFLOW, EXIT_USAGE, EXIT_MISSING_EXTRA = 0, 1, 2, 3
EXIT_BROKEN_PIPE = 141  # 128 + SIGPIPE: what a shell reports for a reader that closed the pipe early


def _parser() -> argparse.ArgumentParser:
    """The ``nantrace`` argument parser: the top-level options and one subparser per command."""
    from ._version import __version__

    p = argparse.ArgumentParser(
        prog="nantrace",
        description="Find where and why fp16/bf16 PyTorch training goes NaN.",
        epilog="Exit codes: 0 done (report: no overflow in the trace), 1 report: the trace holds an overflow, "
        "2 usage or file error, 3 an optional extra (matplotlib, tensorboard) is missing. demo and plot exit 0 "
        "when they complete, whatever the trace holds; 141 the reader closed the output pipe early "
        "(report PATH | head); run exits with the script's exit code.",
    )
    p.add_argument("--version", action="version", version=f"nantrace {__version__}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    _add_demo_parser(sub)
    _add_report_parser(sub)
    _add_plot_parser(sub)
    _add_run_parser(sub)
    return p


def _add_demo_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``nantrace demo`` to the subparsers ``sub``; its defaults and their help come from the demo's own
    :class:`~nantrace.examples.chargpt.DemoConfig`, so the help says what the demo runs."""
    from .examples.chargpt import DemoConfig

    cfg = DemoConfig()
    d = sub.add_parser(
        "demo",
        help="train a small character-level GPT on the stdlib's source in fp16 and locate its overflow",
        description=(
            "Train a small GPT-style character model on the Python standard library's own source files "
            "(nothing is downloaded) under autocast with a GradScaler, traced by nantrace. The default "
            f"configuration ({cfg.n_layer} layers, d_model {cfg.d_model}, "
            f"{'pre-LayerNorm blocks' if cfg.norm else 'no LayerNorm inside the blocks'}, "
            f"{cfg.steps} steps, Adam warming up to lr {cfg.lr:g}) genuinely overflows float16; --dtype bfloat16 "
            "runs the same thing in bf16. "
            "Prints the locator's report and diagnosis, the loss-scale history, and writes the trace and plots."
        ),
    )
    d.add_argument("--steps", type=int, default=None, help=f"optimizer steps to run (default: {cfg.steps})")
    d.add_argument(
        "--lr",
        type=float,
        default=None,
        help=f"peak Adam learning rate, reached by a linear warmup over the first {cfg.warmup_steps} optimizer "
        f"updates, steps the GradScaler skips not counted (default: {cfg.lr:g}, deliberately high)",
    )
    d.add_argument(
        "--dtype",
        choices=("float16", "bfloat16"),
        default=cfg.dtype,
        help=f"autocast dtype (default: {cfg.dtype})",
    )
    d.add_argument(
        "--seed", type=int, default=cfg.seed, help=f"seed for weights and batches (default: {cfg.seed})"
    )
    d.add_argument(
        "--out",
        type=Path,
        default=None,
        help="output directory (default: a new ./nantrace-demo-<time> folder)",
    )
    d.add_argument("--overwrite", action="store_true", help="replace a trace an earlier run left in --out")
    d.add_argument("--device", default=None, help="torch device (default: cuda when available, else cpu)")
    d.add_argument("--no-progress", action="store_true", help="no progress bar")


def _add_report_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``nantrace report`` to the subparsers ``sub``."""
    r = sub.add_parser("report", help="print the locator report, diagnosis and summary of a saved trace")
    r.add_argument("path", type=Path, help="a file written by Trace.save (e.g. OUT/trace.nantrace)")
    r.add_argument(
        "--tensorboard",
        type=Path,
        default=None,
        metavar="DIR",
        help="also write the trace's per-step scalars and per-module absmax/headroom to a TensorBoard log "
        "directory (needs nantrace[tensorboard])",
    )


_PLOT_KINDS = ("overview", "heatmap", "scale", "ranges")
_PHASED_PLOTS = ("overview", "heatmap", "ranges")  # the --what that --phase applies to


def _add_plot_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``nantrace plot`` to the subparsers ``sub``."""
    from .plot import PHASES

    pl = sub.add_parser(
        "plot",
        help="draw a saved trace to a PNG",
        description="Draw a saved trace to a PNG: the headroom heatmap of every module per step (every module "
        "row named), the loss-scale timeline, both (overview), or the value range of each module at one step.",
    )
    pl.add_argument("path", type=Path, help="a file written by Trace.save")
    pl.add_argument("-o", "--output", type=Path, required=True, help="PNG file to write")
    pl.add_argument(
        "--what",
        choices=_PLOT_KINDS,
        default="overview",
        help="overview (default): headroom heatmap + loss-scale timeline; heatmap; scale; ranges (one step)",
    )
    pl.add_argument(
        "--step",
        type=int,
        default=None,
        help="the step for --what ranges only (default: the step of the trace's first overflow when it lies in "
        "--phase; when it lies in another phase, the first step with a NaN/inf in --phase; the last step when "
        "the trace has no overflow)",
    )
    pl.add_argument(
        "--phase",
        default=None,
        metavar="PHASE",
        help=f"phase(s) to draw for --what {', '.join(_PHASED_PLOTS)}: one of {','.join(PHASES)}, a "
        "comma-separated list of them, or all (default: forward)",
    )


def _add_run_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``nantrace run`` to the subparsers ``sub``."""
    ru = sub.add_parser(
        "run",
        help="run an unmodified training script with nantrace attached (like python -m cProfile)",
        description=(
            "Run SCRIPT as `python SCRIPT ARGS` would, tracing every model it calls (a module with parameters "
            "called while no other module runs), with the optimizers and GradScalers it creates. When the "
            "script ends, also by an exception, sys.exit or Ctrl-C, the trace is saved to OUT/trace.nantrace "
            "(further models: OUT/trace.<name>.nantrace) and the report and diagnosis are printed to stderr; "
            "the script's stdout is untouched. The exit code is the script's (1 after an uncaught exception, "
            "130 after Ctrl-C). Options after SCRIPT are the script's."
        ),
    )
    ru.add_argument(
        "--out",
        type=Path,
        default=None,
        metavar="DIR",
        help="output directory (default: a new ./nantrace-run-<time> folder)",
    )
    ru.add_argument("--overwrite", action="store_true", help="replace a trace an earlier run left in --out")
    ru.add_argument(
        "--modules",
        action="append",
        default=None,
        metavar="GLOB",
        help="trace only modules whose qualified name matches GLOB (repeatable; default: all)",
    )
    ru.add_argument(
        "--phases",
        default=None,
        metavar="LIST",
        help="comma-separated phases to record, from data,forward,loss,backward,optimizer (default: all)",
    )
    ru.add_argument(
        "--every", type=int, default=1, metavar="N", help="full statistics every N-th step (default: 1)"
    )
    ru.add_argument(
        "--watch",
        type=int,
        nargs="?",
        const=100,
        default=None,
        metavar="N",
        help="nantrace.watch: a cheap check every step, a faulty step replayed in full, a full step every N "
        "(default N: 100)",
    )
    ru.add_argument("--no-drill", action="store_true", help="do not replay a module call to name the op")
    ru.add_argument(
        "--sync-free", action="store_true", help="on-device statistics only, also for CPU tensors"
    )
    ru.add_argument(
        "--tensorboard",
        type=Path,
        default=None,
        metavar="DIR",
        help="also write TensorBoard scalars to DIR (needs nantrace[tensorboard])",
    )
    ru.add_argument("script", help="the Python script to run")
    rest = ru.add_argument("args", nargs=argparse.REMAINDER, help="the script's arguments (optional)")
    rest.required = False  # argparse counts a REMAINDER positional as required in its error message


#: ``nantrace run``'s options that take a value (``--watch`` takes one only when it is an integer).
_RUN_VALUED = frozenset({"--out", "--modules", "--phases", "--every", "--tensorboard"})


def _watch_value(argv: Sequence[str]) -> list[str]:
    """``argv`` with ``--watch``'s default N written out where ``nantrace run --watch`` is followed by no integer
    (``--watch train.py``: argparse would read the script as N). Only ``run``'s own options are looked at, up to
    the script: the script's arguments are its own."""
    out = list(argv)
    if "run" not in out:
        return out
    i = out.index("run") + 1
    while i < len(out) and out[i].startswith("-") and out[i] != "--":
        flag = out[i]
        if flag == "--watch":
            nxt = out[i + 1] if i + 1 < len(out) else ""
            if not nxt.lstrip("-").isdigit():
                from ._watch import DEFAULT_EVERY

                out.insert(i + 1, str(DEFAULT_EVERY))
            i += 2
            continue
        i += 2 if flag in _RUN_VALUED else 1
    return out


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``nantrace`` console script; returns the exit code."""
    args = _parser().parse_args(_watch_value(sys.argv[1:] if argv is None else argv))
    if args.command == "run":
        return _run(args)  # the script's own output and exit code, untouched
    try:
        if args.command == "demo":
            rc = _demo(args)
        elif args.command == "report":
            rc = _report(args.path, args.tensorboard)
        elif args.command == "plot":
            rc = _plot(args.path, args.output, args.what, args.step, args.phase)
        else:
            _parser().print_help()
            rc = EXIT_USAGE
        sys.stdout.flush()  # inside the try: a closed pipe shows here, not at interpreter exit
        return rc
    except BrokenPipeError:
        # the reader went away (`nantrace report PATH | head`): stop quietly, as a process killed by SIGPIPE
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return EXIT_BROKEN_PIPE


# ------------------------------------------------------------------------------------------- helpers
def _err(msg: str) -> None:
    print(f"nantrace: error: {msg}", file=sys.stderr)


def _make_out(out: Path, overwrite: bool = False) -> bool:
    """Create the ``--out`` directory; False (after saying why) when it cannot be created or written, or holds
    a trace of an earlier run (``trace*.nantrace``) and ``overwrite`` is not set."""
    earlier = sorted(p.name for p in out.glob("trace*.nantrace")) if out.is_dir() else []
    if earlier and not overwrite:
        _err(
            f"--out {str(out)!r} already holds {', '.join(earlier)} of an earlier run; pass --overwrite to replace "
            "it, or choose another --out"
        )
        return False
    blocked = next((p for p in (out, *out.parents) if p.exists() and not p.is_dir()), None)
    if blocked is not None:
        what = "--out" if blocked == out else f"its parent {str(blocked)!r}"
        _err(f"--out {str(out)!r}: {what} is a file, not a directory; choose a directory for --out")
        return False
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        _err(f"--out {str(out)!r}: cannot create it ({e})")
        return False
    if not os.access(out, os.W_OK):
        _err(f"--out {str(out)!r} is not writable; choose another directory")
        return False
    return True


# ------------------------------------------------------------------------------------------- report
def _load(path: Path) -> Any:
    from ._errors import NantraceError
    from ._trace import load

    try:  # load's warnings (e.g. a missing rank) become clean lines, not raw Python warnings
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            tr = load(path)
    except (FileNotFoundError, NantraceError) as e:
        _err(str(e))
        return None
    for w in caught:
        if issubclass(w.category, UserWarning):
            print(f"nantrace: warning: {w.message}", file=sys.stderr)
        else:  # not one of ours (a library's DeprecationWarning...): shown as Python would
            warnings.showwarning(w.message, w.category, w.filename, w.lineno)
    return tr


def _report(path: Path, tensorboard: Path | None = None) -> int:
    tr = _load(path)
    if tr is None:
        return EXIT_USAGE
    if tensorboard is not None:
        try:
            written = tr.to_tensorboard(tensorboard)
        except ImportError as e:
            _err(str(e))
            return EXIT_MISSING_EXTRA
        except ValueError as e:
            _err(f"--tensorboard: {e}")
            return EXIT_USAGE
        print(f"wrote TensorBoard scalars to {written}", file=sys.stderr)
    from ._report import print_report

    ov = print_report(tr, path)
    return EXIT_OK if ov is None else EXIT_OVERFLOW


# ------------------------------------------------------------------------------------------- plot
def _figures(
    tr: Any, what: str, step: int | None, phase: tuple[str, ...] | str | None = "default"
) -> dict[str, Any]:
    """``{name: Figure}`` of ``--what`` for the trace ``tr``; ``phase``: the phases to draw (None: all), or
    ``"default"`` for the plot's own default (forward)."""
    from . import plot

    kw: dict[str, Any] = {} if phase == "default" else {"phase": phase}
    if what == "heatmap":
        return {"heatmap": plot.heatmap(tr, **kw)}
    if what == "scale":
        return {"scale": plot.scale_timeline(tr)}
    if what == "ranges":
        return {"ranges": plot.ranges(tr, step, **kw)}
    return {"overview": plot.overview(tr, **kw)}


def _plot_options(
    what: str, step: int | None, phase: str | None
) -> tuple[bool, tuple[str, ...] | str | None]:
    """``(ok, phases)``: check that ``--step`` and ``--phase`` apply to ``--what``, and parse ``--phase``
    (None: all; ``"default"`` when not given). ``ok`` is False (after saying why) for a usage error."""
    from .plot import PHASES

    if step is not None and what != "ranges":
        _err(f"--step applies only to --what ranges (got --what {what}); drop --step or use --what ranges")
        return False, None
    if phase is None:
        return True, "default"
    if what not in _PHASED_PLOTS:
        _err(f"--phase does not apply to --what {what}: the loss-scale timeline has no phases; drop --phase")
        return False, None
    if phase.strip() == "all":
        return True, None
    phases = tuple(p.strip() for p in phase.split(","))
    if not all(p in PHASES for p in phases):
        _err(f"--phase {phase!r}: choose one of {','.join(PHASES)}, a comma-separated list of them, or all")
        return False, None
    return True, phases[0] if len(phases) == 1 else phases  # one phase reads as phase='forward' in messages


def _plot(path: Path, output: Path, what: str, step: int | None, phase: str | None = None) -> int:
    ok, phases = _plot_options(what, step, phase)
    if not ok:
        return EXIT_USAGE
    tr = _load(path)
    if tr is None:
        return EXIT_USAGE
    try:
        fig = next(iter(_figures(tr, what, step, phases).values()))
    except ImportError as e:
        _err(str(e))
        return EXIT_MISSING_EXTRA
    except (ValueError, TypeError) as e:
        _err(str(e))
        return EXIT_USAGE
    if output.is_dir():
        _err(f"-o {str(output)!r} is a directory; give a file name such as {str(output / 'overview.png')!r}")
        return EXIT_USAGE
    if not output.parent.is_dir():
        _err(f"output directory {str(output.parent)!r} does not exist")
        return EXIT_USAGE
    kinds = fig.canvas.get_supported_filetypes()  # what matplotlib writes, by file suffix
    suffix = output.suffix.lower().lstrip(".")
    if suffix and suffix not in kinds:
        _err(
            f"-o {str(output)!r}: matplotlib cannot write a .{suffix} file; end the name with one of "
            + ", ".join(f".{k}" for k in sorted(kinds))
            + " (e.g. .png)"
        )
        return EXIT_USAGE
    fig.savefig(output, dpi=110, bbox_inches="tight")
    print(f"wrote {output}")
    return EXIT_OK


# ------------------------------------------------------------------------------------------- run
def _run(args: argparse.Namespace) -> int:
    from ._options import TraceOptions
    from ._run import print_run_report, run_script

    script = str(args.script)
    if not os.path.isfile(script):
        _err(f"script {script!r} is not a file")
        return EXIT_USAGE
    try:  # the options are checked once, by the one options object
        options = TraceOptions(
            modules=args.modules,
            phases=args.phases,
            sync_free=True if args.sync_free else None,
            drill=not args.no_drill,
            every=args.every,
        )
    except (TypeError, ValueError) as e:
        flag = next((f for f in ("phases", "every", "modules") if str(e).startswith(f)), None)
        value = getattr(args, flag) if flag is not None else None
        # the option's own spelling: `every=1` of the API is `--every 1` here
        text = str(e).replace(f"{flag}= ", f"--{flag} ").replace(f"{flag}=", f"--{flag} ") if flag else str(e)
        _err(f"--{flag} {value!r}: {text}" if flag is not None else text)
        return EXIT_USAGE
    if args.tensorboard is not None:
        try:
            from ._tensorboard import summary_writer_class

            summary_writer_class()
        except ImportError as e:
            _err(str(e))
            return EXIT_MISSING_EXTRA
    out: Path = args.out if args.out is not None else _new_out_dir("run")
    if not _make_out(out, args.overwrite):
        return EXIT_USAGE
    if args.watch is not None and args.watch < 1:
        _err(f"--watch {args.watch!r}: N must be an int ≥ 1 (a full step every N steps)")
        return EXIT_USAGE
    if args.watch is not None and args.every != 1:
        _err(
            f"--every {args.every} with --watch: under --watch the full steps come every N of --watch N "
            "(--every is for full tracing); give one of them"
        )
        return EXIT_USAGE
    watch = False if args.watch is None else args.watch
    result = run_script(script, args.args, out=out, options=options, watch=watch)
    print_run_report(result, sys.stderr)
    if args.tensorboard is not None:
        several = len(result.traces) > 1
        for name, tr in result.traces.items():
            prefix = f"nantrace/{name}" if several else "nantrace"
            try:
                written = tr.to_tensorboard(args.tensorboard, tag_prefix=prefix)
            except ValueError as e:
                _err(f"--tensorboard: {e}")
                break
            print(f"wrote TensorBoard scalars ({prefix}/...) to {written}", file=sys.stderr)
    return result.exit_code


# ------------------------------------------------------------------------------------------- demo
def _new_out_dir(kind: str = "demo") -> Path:
    stamp = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    base = Path.cwd() / f"nantrace-{kind}-{stamp}"
    out, n = base, 1
    while out.exists():
        n += 1
        out = Path(f"{base}-{n}")
    return out


def _demo(args: argparse.Namespace) -> int:
    import torch

    from ._report import overflow_runs, summary_lines
    from ._trace import trace
    from .examples.chargpt import DemoConfig, build, train_step

    if args.steps is not None and args.steps < 1:
        _err(f"--steps must be ≥ 1; got {args.steps}")
        return EXIT_USAGE
    if args.lr is not None and not (args.lr > 0 and math.isfinite(args.lr)):
        _err(f"--lr must be a positive number; got {args.lr}")
        return EXIT_USAGE
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except RuntimeError as e:
        _err(f"--device {device!r}: {e}")
        return EXIT_USAGE
    if dev.type == "cuda" and not torch.cuda.is_available():
        _err(f"--device {device!r}: this torch has no CUDA device available; use --device cpu")
        return EXIT_USAGE
    if dev.type not in ("cpu", "cuda"):
        _err(f"--device {device!r}: the demo runs on cpu or cuda")
        return EXIT_USAGE
    cfg = DemoConfig(dtype=args.dtype, seed=args.seed, device=device)
    if args.steps is not None:
        cfg.steps = args.steps
    if args.lr is not None:
        cfg.lr = args.lr
    out: Path = args.out if args.out is not None else _new_out_dir()
    if not _make_out(out, args.overwrite):
        return EXIT_USAGE

    torch.set_num_threads(min(torch.get_num_threads(), 4))
    print(
        f"nantrace demo: a {cfg.n_layer}-layer character GPT (d_model {cfg.d_model}, no normalisation inside "
        "its blocks) on the "
        f"stdlib's source, {cfg.dtype} autocast{' + GradScaler' if cfg.dtype == 'float16' else ' (no GradScaler)'}, "
        f"Adam warming up to lr {cfg.lr:g}, {cfg.steps} steps, "
        f"{device}"
    )
    model, optimizer, scaler, batch_iter = build(cfg)
    from tqdm.auto import tqdm

    bar = tqdm(range(cfg.steps), desc="training", unit="step", disable=args.no_progress)
    with trace(model, scaler=scaler, optimizer=optimizer) as tr:
        for step in bar:
            x, y = next(batch_iter)
            loss = train_step(model, optimizer, scaler, x, y, cfg.torch_dtype, device)
            bar.set_postfix(step=step, loss=f"{float(loss):.3f}", scale=f"{scaler.get_scale():g}")
    bar.close()

    print()
    ov = tr.first_overflow()
    if ov is None:
        print("locator: no overflow: every recorded activation and gradient stayed finite.")
    else:
        print(
            f"locator: first non-finite value at step {ov.step}, {ov.phase}, module `{ov.module}` ({ov.module_type}):"
        )
        print(textwrap.indent(str(ov), "  "))  # the headline line, then evidence and advice lines
        ovs = tr.overflows(messages=False)
        print(f"\nsteps with a non-finite value ({len(ovs)}), by first producer:")
        print("\n".join(overflow_runs(ovs)))
    diagnosis = tr.diagnose()
    print(f"\n{diagnosis}")
    print()
    for line in summary_lines(tr):
        print(line)
    if cfg.dtype == "bfloat16":
        _bf16_note(tr)

    path = tr.save(out / "trace.nantrace")
    written = [path]
    try:
        for name, fig in _figures(tr, "overview", None).items():
            png = out / f"{name}.png"
            fig.savefig(png, dpi=110, bbox_inches="tight")
            written.append(png)
        fault = diagnosis.overflow  # the diagnosed event (not the first scaler backoff)
        if fault is not None:
            phase: Any = (fault.phase,) if fault.phase in ("data", "forward", "backward") else "default"
            for name, fig in _figures(tr, "ranges", fault.step, phase).items():
                png = out / f"{name}.png"
                fig.savefig(png, dpi=110, bbox_inches="tight")
                written.append(png)
    except ImportError:
        print('\nplots skipped: matplotlib is not installed (pip install "nantrace[plot]")')
    print("\nwrote:")
    for w in written:
        print(f"  {w}")
    print(f"read it back with: nantrace report {path}")
    return EXIT_OK


def _bf16_note(tr: Any) -> None:
    from ._ranges import headroom_table
    from ._schema import FP16_MAX

    hr = headroom_table(tr.records, top=10_000, ops=tr.ops)  # forward activations only
    over = hr[hr["absmax"] > FP16_MAX]
    print(
        "\nbfloat16 has float32's 8 exponent bits (max 3.39e38) where float16 has 5 (max 65504): "
        "activations that overflow float16 stay finite in bfloat16."
    )
    if len(over):
        print(
            f"{len(over)} module(s) of this run exceeded float16's 65504 and would have overflowed in float16:"
        )
        for module, mtype, absmax in over.head(8)[["module", "module_type", "absmax"]].itertuples(
            index=False
        ):
            print(f"  {str(module) or '(root)'} ({mtype}): absmax {float(absmax):.4g}")
        if len(over) > 8:
            print(f"  … and {len(over) - 8} more")
    else:
        print("In this run every value stayed below 65504 as well.")


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
