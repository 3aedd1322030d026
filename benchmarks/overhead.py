"""Training-step overhead of nantrace against no tracing and two alternatives, in one run, as ratios.

Three workloads (``--models a,b,c``):

* ``a``  ``nn.TransformerEncoder``: 4 layers, d=256, 4 heads, ff 1024, batch 8 x seq 64, fp32, SGD;
* ``b``  a small CNN (3 conv blocks with BatchNorm, 16 x 3 x 32 x 32 images, cross-entropy), fp32, SGD;
* ``c``  a tiny MLP under fp16 ``torch.autocast`` with a ``torch.amp.GradScaler``, SGD.

Modes (``--modes``, default all):

* ``none``                    no tracing (the baseline every ratio is relative to);
* ``nantrace``                ``nantrace.trace(model, optimizer=..., scaler=...)``: all phases, full statistics
  every step (the default);
* ``nantrace every=10``       all phases, full statistics every 10th step, one ``aminmax`` per tensor between;
* ``nantrace fwd-only``       ``phases=("data", "forward", "loss")``: no backward/optimizer hooks;
* ``nantrace-cheapest``       the cheapest nantrace setting that exists now (:data:`CHEAPEST`: forward phases
  and ``every=10``);
* ``DebugUnderflowOverflow``  ``transformers.debug_utils.DebugUnderflowOverflow`` (skipped when transformers is
  not installed);
* ``detect_anomaly``          ``torch.autograd.detect_anomaly(check_nan=True)``.

More nantrace settings are added without editing this file with ``--add-mode 'label={"every": 10}'`` (the JSON
object is passed to ``nantrace.trace`` as keyword arguments), or by adding an entry to :data:`NANTRACE_MODES`.

Method: every round runs every mode for ``--steps-per-round`` training steps, interleaved (A B C A B C ...; the
order rotates each round), each mode entered once per round around its steps like a real training loop. A
warm-up round comes first and is not counted. Per mode, the table gives the median over rounds of ms/step and
of the per-round ratio to the untraced step of the same round (which cancels slow drifts in machine load), and
the same ratio in process CPU time (robust when other processes share the cores; use it with ``--threads 1``).

Run ``python benchmarks/overhead.py`` (4.5 minutes at ``--threads 1`` on a 2-core machine shared with other
work; less on an idle one) or ``--quick`` for a smoke run.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import gc
import inspect
import json
import os
import platform
import statistics
import sys
import time
import warnings
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from typing import Any

import torch
from torch import nn

import nantrace

FORWARD_PHASES = ("data", "forward", "loss")

# The cheapest nantrace setting among the options nantrace has today: no backward and optimizer hooks
# (inputs, activations, the loss and the gradient arriving at the model's outputs), and full statistics on
# every 10th step only (one aminmax per tensor on the steps between).
CHEAPEST: dict[str, Any] = {"phases": FORWARD_PHASES, "every": 10}

# label -> keyword arguments for nantrace.trace (besides model/optimizer/scaler). Order = table order.
# A mode whose options nantrace.trace() does not have is reported as skipped. With every=N, a round runs a
# multiple of N steps (each round enters a new trace, whose step 0 is a full one).
NANTRACE_MODES: dict[str, dict[str, Any]] = {
    "nantrace": {},
    "nantrace every=10": {"every": 10},
    "nantrace fwd-only": {"phases": FORWARD_PHASES},
    "nantrace-cheapest": CHEAPEST,
}


# ---------------------------------------------------------------------------------------------- workloads
@dataclasses.dataclass
class Workload:
    """A model with its optimizer, optional GradScaler, and a closure running one training step."""

    key: str
    title: str
    model: nn.Module
    optimizer: torch.optim.Optimizer
    scaler: torch.amp.GradScaler | None
    step: Callable[[], None]
    device: torch.device


def make_transformer(device: torch.device) -> Workload:
    """(a) ``nn.TransformerEncoder``: 4 layers, d=256, 4 heads, ff 1024, batch 8 x seq 64, fp32, SGD."""
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(256, 4, 1024, batch_first=True)
    model = nn.TransformerEncoder(layer, 4, enable_nested_tensor=False).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x = torch.randn(8, 64, 256, device=device)
    y = torch.randn(8, 64, 256, device=device)

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()

    return Workload("a", "TransformerEncoder 4x256, fp32", model, opt, None, step, device)


class SmallCNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()

        def block(i: int, o: int) -> nn.Sequential:
            return nn.Sequential(nn.Conv2d(i, o, 3, padding=1), nn.BatchNorm2d(o), nn.ReLU(), nn.MaxPool2d(2))

        self.features = nn.Sequential(block(3, 32), block(32, 64), block(64, 128))
        self.head = nn.Sequential(nn.Flatten(), nn.Linear(128 * 4 * 4, 128), nn.ReLU(), nn.Linear(128, 10))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x))


def make_cnn(device: torch.device) -> Workload:
    """(b) 3 conv blocks (conv, BatchNorm, ReLU, max-pool) and a 2-layer head; 16 x 3 x 32 x 32, fp32, SGD."""
    torch.manual_seed(0)
    model = SmallCNN().to(device)
    opt = torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9)
    x = torch.randn(16, 3, 32, 32, device=device)
    y = torch.randint(0, 10, (16,), device=device)

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()

    return Workload("b", "small CNN 16x3x32x32, fp32", model, opt, None, step, device)


def make_amp(device: torch.device) -> Workload:
    """(c) a tiny MLP (64-128-128-10, LayerNorm, GELU) on 32 rows under fp16 autocast, with a GradScaler."""
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(64, 128), nn.GELU(), nn.LayerNorm(128), nn.Linear(128, 128), nn.GELU(), nn.Linear(128, 10)
    ).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler(device.type)
    x = torch.randn(32, 64, device=device)
    y = torch.randint(0, 10, (32,), device=device)

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        with torch.autocast(device.type, dtype=torch.float16):
            loss = nn.functional.cross_entropy(model(x), y)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()

    return Workload("c", "tiny MLP, fp16 autocast + GradScaler", model, opt, scaler, step, device)


WORKLOADS: dict[str, Callable[[torch.device], Workload]] = {
    "a": make_transformer,
    "b": make_cnn,
    "c": make_amp,
}


# ---------------------------------------------------------------------------------------------- modes
@dataclasses.dataclass
class Mode:
    """A way of running the training loop: ``enter(workload)`` is the context entered once per round."""

    name: str
    enter: Callable[[Workload], AbstractContextManager[Any]]
    skip_reason: str | None = None
    period: int = 1  # a round runs a multiple of this many steps (nantrace's every=N)


def nantrace_mode(name: str, kwargs: dict[str, Any]) -> Mode:
    params = inspect.signature(nantrace.trace).parameters
    unknown = sorted(set(kwargs) - set(params))
    if unknown:
        return Mode(name, _no_ctx, f"nantrace.trace() has no option(s) {unknown} yet")

    def enter(w: Workload) -> AbstractContextManager[Any]:
        return nantrace.trace(w.model, optimizer=w.optimizer, scaler=w.scaler, **kwargs)

    return Mode(name, enter, period=int(kwargs.get("every", 1)))


def _no_ctx(w: Workload) -> AbstractContextManager[Any]:
    return contextlib.nullcontext()


@contextlib.contextmanager
def _debug_underflow_overflow(w: Workload) -> Iterator[Any]:
    """``DebugUnderflowOverflow(model)`` for the round; its forward hooks (it keeps no handles) removed after."""
    from transformers.debug_utils import DebugUnderflowOverflow

    before = {id(m): set(m._forward_hooks) for m in w.model.modules()}
    debug = DebugUnderflowOverflow(w.model)
    try:
        yield debug
    finally:
        for m in w.model.modules():
            for k in set(m._forward_hooks) - before[id(m)]:
                m._forward_hooks.pop(k, None)
                m._forward_hooks_with_kwargs.pop(k, None)
                m._forward_hooks_always_called.pop(k, None)


@contextlib.contextmanager
def _detect_anomaly(w: Workload) -> Iterator[None]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "Anomaly Detection has been enabled..." on every enter
        with torch.autograd.detect_anomaly(check_nan=True):
            yield


def _transformers_missing() -> str | None:
    try:
        import transformers.debug_utils  # noqa: F401
    except ImportError:
        return "transformers is not installed (pip install transformers)"
    return None


def all_modes(extra: dict[str, dict[str, Any]] | None = None) -> list[Mode]:
    modes = [Mode("none", _no_ctx)]
    modes += [nantrace_mode(k, v) for k, v in {**NANTRACE_MODES, **(extra or {})}.items()]
    modes.append(Mode("DebugUnderflowOverflow", _debug_underflow_overflow, _transformers_missing()))
    modes.append(Mode("detect_anomaly", _detect_anomaly))
    return modes


# ---------------------------------------------------------------------------------------------- timing
@dataclasses.dataclass
class Result:
    model: str
    title: str
    mode: str
    ms: list[float] = dataclasses.field(default_factory=list)  # per round, wall ms/step
    ratio: list[float] = dataclasses.field(default_factory=list)  # per round, vs "none" of the same round
    cpu_ms: list[float] = dataclasses.field(default_factory=list)  # per round, process CPU ms/step
    cpu_ratio: list[float] = dataclasses.field(default_factory=list)
    records_per_step: float | None = None
    skipped: str | None = None


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_block(w: Workload, mode: Mode, steps: int) -> tuple[float, float, Any]:
    """Wall and process-CPU seconds per step of ``steps`` training steps inside one ``mode`` context, and the
    context's value."""
    gc.collect()
    _sync(w.device)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with mode.enter(w) as ctx:
            _sync(w.device)
            t0, c0 = time.perf_counter(), time.process_time()
            for _ in range(steps):
                w.step()
            _sync(w.device)
            dt, dc = time.perf_counter() - t0, time.process_time() - c0
    return dt / steps, dc / steps, ctx


def bench_workload(
    w: Workload, modes: list[Mode], rounds: int, steps: int, warmup: int, log: Callable[[str], None]
) -> list[Result]:
    results = {m.name: Result(w.key, w.title, m.name, skipped=m.skip_reason) for m in modes}
    active = [m for m in modes if m.skip_reason is None]
    for m in active:  # warm-up: every mode once (allocator, autograd graph, nantrace string tables)
        time_block(w, m, warmup)
    for r in range(rounds):
        k = r % len(active)
        order = active[k:] + active[:k]
        times: dict[str, float] = {}
        cpu: dict[str, float] = {}
        for m in order:
            dt, dc, ctx = time_block(w, m, -(-steps // m.period) * m.period)
            times[m.name], cpu[m.name] = dt, dc
            if isinstance(ctx, nantrace.Trace):
                n = ctx.steps["n_records"]
                results[m.name].records_per_step = float(n.mean()) if len(n) else 0.0
        for name, dt in times.items():
            results[name].ms.append(dt * 1e3)
            results[name].ratio.append(dt / times["none"])
            results[name].cpu_ms.append(cpu[name] * 1e3)
            results[name].cpu_ratio.append(cpu[name] / cpu["none"])
        log(
            f"  [{w.key}] round {r + 1}/{rounds}: "
            + ", ".join(f"{n} {times[n] * 1e3:.1f}" for n in (m.name for m in active))
            + " ms/step"
        )
    return list(results.values())


# ---------------------------------------------------------------------------------------------- report
def machine_line() -> str:
    cpu = platform.processor() or platform.machine()
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    load = ""
    with contextlib.suppress(OSError):
        load = " · load average {:.2f} {:.2f} {:.2f}".format(*os.getloadavg())
    return (
        f"{cpu}, {os.cpu_count()} cores, torch {torch.__version__} ({torch.get_num_threads()} threads), "
        f"Python {platform.python_version()}, {datetime.date.today().isoformat()}{load}"
    )


def table(results: list[Result]) -> str:
    """Markdown table: wall-clock ms/step and ratio (median over rounds, with the range of the per-round
    ratios), the process-CPU-time ratio (robust when other processes share the cores), records/step."""
    lines = [
        "| model | mode | ms/step | ratio | ratio min–max | CPU-time ratio | records/step |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in results:
        label = f"({r.model}) {r.title}"
        if r.skipped:
            lines.append(f"| {label} | {r.mode} | skipped: {r.skipped} | | | | |")
            continue
        rec = "" if r.records_per_step is None else f"{r.records_per_step:.0f}"
        lines.append(
            f"| {label} | {r.mode} | {statistics.median(r.ms):.2f} | {statistics.median(r.ratio):.3f}× "
            f"| {min(r.ratio):.2f}–{max(r.ratio):.2f} | {statistics.median(r.cpu_ratio):.3f}× | {rec} |"
        )
    return "\n".join(lines)


def load_warning(threads: int) -> str | None:
    """A warning when other processes compete for the cores (the wall-clock ratios are then unreliable)."""
    try:
        load = os.getloadavg()[0]
    except OSError:
        return None
    cores = os.cpu_count() or 1
    if load <= max(cores - threads, 0) + 0.5:
        return None
    spin = (
        f" With {threads} torch threads every parallel op also waits for a descheduled worker."
        if threads > 1
        else ""
    )
    return (
        f"WARNING: load average {load:.1f} on {cores} cores: other processes compete for the CPU.{spin} "
        "Wall-clock ratios are unreliable; compare the CPU-time ratio (most robust with --threads 1), or rerun "
        "on an idle machine."
    )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter
    )
    p.add_argument("--models", default="a,b,c", help="comma-separated subset of a,b,c (default: a,b,c)")
    p.add_argument(
        "--modes", default=None, help="comma-separated mode names (default: all; 'none' is always run)"
    )
    p.add_argument(
        "--rounds", type=int, default=7, help="interleaved rounds (default 7; the median is reported)"
    )
    p.add_argument(
        "--steps-per-round",
        default="a=6,b=12,c=50",
        help="training steps per mode per round: one number, or per model as a=6,b=12,c=50 (the default)",
    )
    p.add_argument(
        "--warmup", type=int, default=2, help="warm-up steps per mode before the rounds (default 2)"
    )
    p.add_argument("--threads", type=int, default=2, help="torch.set_num_threads (default 2)")
    p.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    p.add_argument(
        "--add-mode",
        action="append",
        default=[],
        metavar="LABEL=JSON",
        help="extra nantrace setting, e.g. --add-mode 'every10={\"every\": 10}' (kwargs of nantrace.trace)",
    )
    p.add_argument("--quick", action="store_true", help="smoke run: 2 rounds of 2 steps, 1 warm-up step")
    p.add_argument("--json", default=None, help="also write the per-round numbers to this JSON file")
    return p.parse_args(argv)


def steps_for(spec: str, key: str) -> int:
    if "=" not in spec:
        return int(spec)
    per = dict(item.split("=") for item in spec.split(","))
    return int(per.get(key, max(int(v) for v in per.values())))


def run(args: argparse.Namespace, log: Callable[[str], None] = print) -> list[Result]:
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    extra = {}
    for item in args.add_mode:
        label, _, kw = item.partition("=")
        extra[label] = json.loads(kw) if kw else {}
    modes = all_modes(extra)
    if args.modes:
        wanted = {"none", *args.modes.split(",")}
        unknown = wanted - {m.name for m in modes}
        if unknown:
            raise SystemExit(f"unknown mode(s) {sorted(unknown)}; known: {[m.name for m in modes]}")
        modes = [m for m in modes if m.name in wanted]
    rounds, warmup = (2, 1) if args.quick else (args.rounds, args.warmup)
    results: list[Result] = []
    for key in args.models.split(","):
        w = WORKLOADS[key](device)
        steps = 2 if args.quick else steps_for(args.steps_per_round, key)
        log(f"model ({key}) {w.title}: {rounds} rounds x {steps} steps per mode")
        results += bench_workload(w, modes, rounds, steps, warmup, log)
    return results


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    log = lambda s: print(s, file=sys.stderr, flush=True)  # noqa: E731
    log(f"machine: {machine_line()}")
    warn = load_warning(args.threads)
    if warn:
        log(warn)
    results = run(args, log)
    print(f"\nMachine: {machine_line()}")
    print(
        f"Command: python benchmarks/overhead.py {' '.join(sys.argv[1:] if argv is None else argv)}".rstrip()
    )
    print(f"Wall time: {time.perf_counter() - t0:.0f} s\n")
    print(table(results))
    warn = warn or load_warning(args.threads)
    if warn:
        print(f"\n{warn}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump([dataclasses.asdict(r) for r in results], f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
