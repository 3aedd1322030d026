"""GPU checks for nantrace: its hooks never make the host wait for the device, and its overhead on a GPU.

Needs a CUDA GPU; without one it prints why and exits 0. Three parts:

1. **Sync census** (``torch.cuda.set_sync_debug_mode("warn")``, one traced AMP step): every synchronizing
   CUDA call is listed with where it came from: a nantrace hook (a bug: DESIGN.md "Performance contract"),
   ``Store.flush`` (the one host copy per step, by design) or PyTorch itself.
2. **Strict run** (``set_sync_debug_mode("error")``): ``--steps`` traced AMP steps (fp16 autocast, GradScaler,
   fused SGD so ``GradScaler.step`` does not call ``.item()``) with the whole loop under "error" mode except
   ``Store.flush``, which runs under "warn" mode with its syncs counted (expected: the one copy per step).
   Any sync elsewhere raises; the script prints the place and exits 1. The loop without tracing is run
   under "error" mode first, so a sync in PyTorch itself is told apart from one in nantrace.
3. **Overhead**: ``overhead.py`` for model (a) on the GPU (all modes; ``--skip-overhead`` to leave out).

``python benchmarks/gpu_check.py [--steps 5] [--rounds 5] [--skip-overhead]``. Exit status: 0 all checks
passed (or no GPU), 1 a sync in nantrace's hooks or a wrong trace, 2 the untraced loop itself syncs.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import traceback
import warnings
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))

import overhead

import nantrace
import nantrace._store as _store

PKG = str(Path(nantrace.__file__).resolve().parent)
SYNC_MSG = "synchroniz"  # "called a synchronizing CUDA operation"


# --dry-run-cpu: the same code paths on the CPU with nantrace's sync-free (device) statistics forced, and no
# sync debug mode (the CPU has none); for testing this script on a machine without a GPU.
DRY_RUN = False
TRACE_KW: dict[str, Any] = {}


def set_mode(mode: str) -> None:
    if not DRY_RUN:
        torch.cuda.set_sync_debug_mode(mode)


def get_mode() -> int:
    return 0 if DRY_RUN else torch.cuda.get_sync_debug_mode()


def sync() -> None:
    if not DRY_RUN:
        torch.cuda.synchronize()


# ---------------------------------------------------------------------------------------------- workload
class AmpNet(nn.Module):
    """Embedding-free transformer-ish block stack: Linear, LayerNorm, GELU, attention via SDPA, residuals."""

    def __init__(self, d: int = 256, layers: int = 2) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(
            nn.TransformerEncoderLayer(d, 4, 4 * d, batch_first=True, dropout=0.0) for _ in range(layers)
        )
        self.head = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def make_amp_loop(device: torch.device) -> tuple[nn.Module, Any, Any, Callable[[], None]]:
    torch.manual_seed(0)
    model = AmpNet().to(device)
    fused = device.type == "cuda"
    opt = torch.optim.SGD(model.parameters(), lr=1e-3, fused=fused)  # fused: no .item() in GradScaler.step
    scaler = torch.amp.GradScaler(device.type)
    x = torch.randn(8, 64, 256, device=device)
    y = torch.randn(8, 64, 256, device=device)

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        with torch.autocast(device.type, dtype=torch.float16):
            loss = nn.functional.mse_loss(model(x).float(), y)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()

    return model, opt, scaler, step


# ---------------------------------------------------------------------------------------------- census
def _site(stack: list[traceback.FrameSummary]) -> tuple[str, str]:
    """(category, place) of a sync from the Python stack at the warning."""
    ours = [f for f in stack if f.filename.startswith(PKG)]
    if ours:
        names = {f.name for f in ours}
        f = ours[-1]
        place = f"nantrace/{Path(f.filename).name}:{f.lineno} {f.name}"
        if "flush" in names or "to_host" in names:
            return "Store.flush (by design, once per step)", place
        return "nantrace hook (contract violation)", place
    user = [f for f in stack if "/torch/" in f.filename or "/benchmarks/" in f.filename]
    f = user[-1] if user else stack[-1]
    return "PyTorch / user code", f"{Path(f.filename).name}:{f.lineno} {f.name}"


@contextlib.contextmanager
def capture_syncs(sink: list[tuple[str, str]]) -> Iterator[None]:
    """Record the site of every sync warning raised while the sync debug mode is "warn"."""
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        old = warnings.showwarning

        def show(
            message: Any, category: Any, filename: str, lineno: int, file: Any = None, line: Any = None
        ) -> None:
            if SYNC_MSG in str(message):
                sink.append(_site(traceback.extract_stack()[:-1]))
            else:
                old(message, category, filename, lineno, file, line)

        warnings.showwarning = show
        yield


def census(step: Callable[[], None], model: nn.Module, opt: Any, scaler: Any) -> Counter[tuple[str, str]]:
    sites: list[tuple[str, str]] = []
    with nantrace.trace(model, optimizer=opt, scaler=scaler, **TRACE_KW):
        step()  # first traced step: string tables, lazily created tensors
        sync()
        prev = get_mode()
        set_mode("warn")
        try:
            with capture_syncs(sites):
                step()
        finally:
            set_mode(prev)
    return Counter(sites)


# ---------------------------------------------------------------------------------------------- strict
@contextlib.contextmanager
def flush_in_warn_mode(counts: list[int]) -> Iterator[None]:
    """Run ``Store.flush`` under "warn" mode (its one host copy is by design) and count its syncs."""
    orig = _store.Store.flush

    def flush(self: Any, *args: Any, **kwargs: Any) -> Any:
        prev = get_mode()
        set_mode("warn")
        sites: list[tuple[str, str]] = []
        try:
            with capture_syncs(sites):
                return orig(self, *args, **kwargs)
        finally:
            set_mode(prev)
            counts.append(len(sites))

    _store.Store.flush = flush  # type: ignore[method-assign]
    try:
        yield
    finally:
        _store.Store.flush = orig  # type: ignore[method-assign]


def strict(step: Callable[[], None], model: nn.Module, opt: Any, scaler: Any, steps: int) -> int:
    # the untraced loop first: a sync there is PyTorch's (or this script's), not nantrace's
    step()
    sync()
    set_mode("error")
    try:
        step()
    except RuntimeError as e:
        set_mode("default")
        print(f"  the UNTRACED loop syncs under 'error' mode, so this check cannot isolate nantrace:\n  {e}")
        traceback.print_exc()
        return 2
    finally:
        set_mode("default")
    sync()

    flush_syncs: list[int] = []
    with nantrace.trace(model, optimizer=opt, scaler=scaler, **TRACE_KW) as tr:
        step()  # warm-up traced step outside "error" mode
        sync()
        with flush_in_warn_mode(flush_syncs):
            done = 0
            set_mode("error")
            try:
                while done < steps:
                    step()
                    done += 1
            except RuntimeError as e:
                set_mode("default")
                tb = traceback.extract_tb(e.__traceback__)
                ours = [f for f in tb if f.filename.startswith(PKG)]
                where = ours[-1] if ours else (tb[-1] if tb else None)
                print(f"  FAIL: sync under 'error' mode in traced step {done}: {e}")
                if where is not None:
                    print(f"  at {where.filename}:{where.lineno} in {where.name}: {where.line}")
                traceback.print_exc()
                return 1
            finally:
                set_mode("default")
    sync()
    rec, st = tr.records, tr.steps
    print(f"  {steps} traced steps under 'error' mode: no sync outside Store.flush")
    print(f"  Store.flush calls: {len(flush_syncs)}, syncs per flush: {flush_syncs}")
    print(f"  records: {len(rec)} rows, {len(st)} steps, {len(rec) / max(len(st), 1):.0f} rows/step")
    problems = []
    if len(st) != steps + 1:
        problems.append(f"expected {steps + 1} steps rows, got {len(st)}")
    if rec.empty or not set(rec.phase.astype(str)) >= {"data", "forward", "loss", "backward", "optimizer"}:
        problems.append(f"phases recorded: {sorted(set(rec.phase.astype(str)))}")
    if st.scale.isna().any():
        problems.append("steps.scale has NaN with a GradScaler")
    finite = rec[(rec.n_nan + rec.n_posinf + rec.n_neginf) == 0]
    if finite[["min", "max", "absmax"]].isna().any().any():
        problems.append("NaN min/max/absmax in rows without non-finite values")
    if any(n > 1 for n in flush_syncs):
        problems.append(f"Store.flush synced more than once in a step: {flush_syncs}")
    for p in problems:
        print(f"  FAIL: {p}")
    return 1 if problems else 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="nantrace GPU checks (sync-freedom, overhead)")
    p.add_argument("--steps", type=int, default=5, help="traced steps under 'error' mode (default 5)")
    p.add_argument("--rounds", type=int, default=5, help="overhead rounds (default 5)")
    p.add_argument("--steps-per-round", default="20", help="overhead steps per mode per round (default 20)")
    p.add_argument("--skip-overhead", action="store_true")
    p.add_argument("--dry-run-cpu", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.dry_run_cpu:
        global DRY_RUN
        DRY_RUN = True
        TRACE_KW["sync_free"] = True
    elif not torch.cuda.is_available():
        print(
            "gpu_check: no CUDA GPU here (torch.cuda.is_available() is False; "
            f"torch {torch.__version__}): nothing to check. Run it on a machine with a CUDA GPU."
        )
        return 0
    device = torch.device("cpu" if DRY_RUN else "cuda")
    name = "CPU (dry run)" if DRY_RUN else torch.cuda.get_device_name(device)
    print(f"gpu_check on {name}, torch {torch.__version__}, CUDA {torch.version.cuda}")

    print("\n1. sync census: one traced AMP step under set_sync_debug_mode('warn')")
    model, opt, scaler, step = make_amp_loop(device)
    step()
    sites = census(step, model, opt, scaler)
    if not sites:
        print("  no synchronizing call at all")
    for (cat, place), n in sorted(sites.items()):
        print(f"  {n:3d} x {cat}: {place}")
    bad_census = any(cat.startswith("nantrace hook") for cat, _ in sites)

    print("\n2. strict: traced AMP steps under set_sync_debug_mode('error'), Store.flush excepted")
    model, opt, scaler, step = make_amp_loop(device)
    rc = strict(step, model, opt, scaler, args.steps)
    if bad_census and rc == 0:
        rc = 1
        print("  FAIL: the census found syncs in nantrace hooks")

    if not args.skip_overhead:
        print("\n3. overhead on the GPU, model (a)")
        cli = ["--device", device.type, "--models", "a", "--rounds", str(args.rounds)]
        cli += ["--steps-per-round", str(args.steps_per_round)]
        oargs = overhead.parse_args(cli)
        torch.set_num_threads(oargs.threads)
        results = overhead.run(oargs, log=lambda s: print(s, file=sys.stderr, flush=True))
        print(f"\n{overhead.machine_line()}, {name}\n")
        print(overhead.table(results))
    print(f"\ngpu_check: {'PASS' if rc == 0 else 'FAIL'} (exit {rc})")
    return rc


if __name__ == "__main__":
    sys.exit(main())
