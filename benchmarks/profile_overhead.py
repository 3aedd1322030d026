"""Where nantrace's overhead goes, on one workload of ``overhead.py`` (default: the transformer, model a).

Sections (``--sections``, default all):

``records``    records per step by phase, and how many of them needed a statistics computation (the rest
               reuse the statistics of the same tensor recorded just before: an output that is the next
               module's input).
``breakdown``  interleaved rounds of: no tracing, nantrace default with every hook and ``Store.flush`` wrapped
               in timers, nantrace with the statistics replaced by a constant (``stats_host`` stubbed), and
               with one ``torch.aminmax`` read per tensor instead (the floor of one read per tensor). It
               splits the per-step overhead into statistics reductions, per-record bookkeeping
               (``Recorder.add`` minus statistics), hook glue (flatten, tensor-hook registration, grad norms,
               minus ``add``), the flush, and what no timer sees (PyTorch's slow path for modules with hooks,
               autograd running the tensor hooks, garbage collection). Times are process-CPU time (robust to
               other processes on the machine) and wall time.
``replay``     the tensors of one step, saved and re-run through each statistics candidate of
               ``stats_alternatives.py`` and through the pieces of ``stats_host`` (aminmax, count_nonzero,
               absmin pass, float conversions); best of N, µs per step.
``ops``        ``torch.profiler``: the ATen ops a traced step runs beyond the untraced step (calls and
               self-CPU ms per step).
``cprofile``   ``cProfile`` of traced steps: the top functions by own time (Python functions and the torch
               calls they make). cProfile roughly doubles the cost of Python code; read it for ranking.

``python benchmarks/profile_overhead.py [--model a] [--threads 2] [--sections records,breakdown,...]``
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import cProfile
import gc
import io
import math
import pstats
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import overhead
import stats_alternatives

import nantrace
import nantrace._hooks as _hooks
import nantrace._scaler as _scaler
import nantrace._store as _store

SECTIONS = ("records", "breakdown", "replay", "ops", "cprofile")


def _start(w: overhead.Workload, **kw: Any) -> nantrace.Trace:
    return nantrace.trace(w.model, optimizer=w.optimizer, scaler=w.scaler, **kw)


# ---------------------------------------------------------------------------------------------- records
def section_records(w: overhead.Workload) -> dict[str, Any]:
    calls = [0]
    orig = _hooks.stats_host

    def counting(t: torch.Tensor) -> tuple[float, ...]:
        calls[0] += 1
        return orig(t)

    with _patched(_hooks, "stats_host", counting), _start(w) as tr:
        w.step()
        calls[0] = 0
        w.step()
    r = tr.records
    r = r[r.step == r.step.max()]
    by_phase = r.groupby("phase", observed=True).size().to_dict()
    n = len(r)
    print(f"records/step: {n}  ({', '.join(f'{k} {v}' for k, v in by_phase.items())})")
    print(f"statistics computed/step: {calls[0]} (the other {n - calls[0]} rows reuse a cached result)")
    elems = int(r.drop_duplicates("event").numel.sum())
    print(f"elements reduced/step: {elems / 1e6:.1f} M")
    return {"records": n, "stats_calls": calls[0], "by_phase": by_phase, "elements": elems}


# ---------------------------------------------------------------------------------------------- breakdown
@contextlib.contextmanager
def _patched(obj: Any, name: str, value: Any) -> Iterator[None]:
    old = getattr(obj, name)
    setattr(obj, name, value)
    try:
        yield
    finally:
        setattr(obj, name, old)


class Timers:
    """Inclusive time (wall and process-CPU, which includes intra-op worker threads) and call counts of
    wrapped functions."""

    def __init__(self) -> None:
        self.wall: dict[str, float] = collections.defaultdict(float)
        self.cpu: dict[str, float] = collections.defaultdict(float)
        self.calls: dict[str, int] = collections.defaultdict(int)

    def wrap(self, name: str, f: Callable[..., Any]) -> Callable[..., Any]:
        wall, cpu, calls = self.wall, self.cpu, self.calls
        perf, tcpu = time.perf_counter, time.process_time

        def timed(*args: Any, **kwargs: Any) -> Any:
            t0, c0 = perf(), tcpu()
            try:
                return f(*args, **kwargs)
            finally:
                wall[name] += perf() - t0
                cpu[name] += tcpu() - c0
                calls[name] += 1

        return timed

    def reset(self) -> None:
        self.wall.clear()
        self.cpu.clear()
        self.calls.clear()


@contextlib.contextmanager
def instrumented(timers: Timers) -> Iterator[None]:
    """Wrap nantrace's hooks, ``Recorder.add``, ``stats_host`` and ``Store.flush`` in timers (attach-time
    factories are wrapped, so enter the trace inside this context). Missing names are skipped."""
    R = _hooks.Recorder
    stack = contextlib.ExitStack()

    def factory(cls: Any, meth: str, names: tuple[str, ...]) -> None:
        orig = getattr(cls, meth, None)
        if orig is None:
            return

        def make(self: Any, *a: Any, **k: Any) -> Any:
            out = orig(self, *a, **k)
            if isinstance(out, tuple):
                return tuple(timers.wrap(n, f) for n, f in zip(names, out, strict=True))
            return timers.wrap(names[0], out)

        stack.enter_context(_patched(cls, meth, make))

    def method(cls: Any, meth: str, name: str) -> None:
        orig = getattr(cls, meth, None)
        if orig is not None:
            stack.enter_context(_patched(cls, meth, timers.wrap(name, orig)))

    def function_factory(name: str, label: str) -> None:
        orig = getattr(_scaler, name, None)
        if orig is not None:
            stack.enter_context(_patched(_scaler, name, lambda *a, **k: timers.wrap(label, orig(*a, **k))))

    with stack:
        factory(R, "module_hooks", ("forward pre-hooks", "forward hooks"))
        factory(R, "grad_hook", ("tensor grad hooks",))
        function_factory("param_hook", "param grad hooks")
        method(R, "add", "Recorder.add")
        method(_store.Store, "flush", "Store.flush")
        stack.enter_context(_patched(_hooks, "stats_host", timers.wrap("stats_host", _hooks.stats_host)))
        yield


_TOP = (
    "forward pre-hooks",
    "forward hooks",
    "tensor grad hooks",
    "param grad hooks",
)


def _stub_stats(t: torch.Tensor) -> tuple[float, ...]:
    return (0.0, 1.0, 1.0, 0.5, 0.0, 0.0, 0.0, 0.0)


def _one_pass(t: torch.Tensor) -> tuple[float, ...]:
    """One ``torch.aminmax`` read per tensor (min, max, absmax; the rest placeholders): what the statistics would
    cost at the floor of one read of each tensor. Not nantrace's statistics: for measuring only."""
    lo, hi = torch.aminmax(t.detach())
    a, b = float(lo), float(hi)
    return (a, b, max(-a, b), 1.0, 0.0, 0.0, 0.0, 0.0)


def _block(w: overhead.Workload, ctx: Any, steps: int) -> tuple[float, float]:
    gc.collect()
    with ctx:
        t0, c0 = time.perf_counter(), time.process_time()
        for _ in range(steps):
            w.step()
        return (time.perf_counter() - t0) / steps, (time.process_time() - c0) / steps


def section_breakdown(w: overhead.Workload, rounds: int, steps: int, records: int) -> dict[str, Any]:
    timers = Timers()
    per: dict[str, list[tuple[float, float]]] = collections.defaultdict(list)
    parts: dict[str, list[float]] = collections.defaultdict(list)
    calls: dict[str, int] = {}

    def none() -> Any:
        return contextlib.nullcontext()

    def timed() -> Any:
        stack = contextlib.ExitStack()
        stack.enter_context(instrumented(timers))
        stack.enter_context(_start(w))
        return stack

    def stubbed() -> Any:
        stack = contextlib.ExitStack()
        stack.enter_context(_patched(_hooks, "stats_host", _stub_stats))
        stack.enter_context(_start(w))
        return stack

    def plain() -> Any:
        return _start(w)

    def no_add() -> Any:
        stack = contextlib.ExitStack()
        stack.enter_context(_patched(_hooks.Recorder, "add", lambda self, *a, **k: None))
        stack.enter_context(_start(w))
        return stack

    def one_pass() -> Any:
        stack = contextlib.ExitStack()
        stack.enter_context(_patched(_hooks, "stats_host", _one_pass))
        stack.enter_context(_start(w))
        return stack

    variants = {
        "none": none,
        "nantrace": plain,
        "nantrace+timers": timed,
        "nantrace, Recorder.add a no-op (hooks only)": no_add,
        "nantrace, stats stubbed": stubbed,
        "nantrace, one-pass statistics (aminmax only: the floor)": one_pass,
    }
    for f in variants.values():  # warm-up
        _block(w, f(), 2)
    for r in range(rounds):
        names = list(variants)
        names = names[r % len(names) :] + names[: r % len(names)]
        for name in names:
            timers.reset()
            per[name].append(_block(w, variants[name](), steps))
            if name == "nantrace+timers":
                for k, v in timers.cpu.items():
                    parts[k].append(v / steps)
                calls = {k: v // steps for k, v in timers.calls.items()}
        print(
            f"  round {r + 1}/{rounds}: "
            + ", ".join(f"{n} {per[n][-1][0] * 1e3:.1f}/{per[n][-1][1] * 1e3:.1f}" for n in variants)
            + " ms/step wall/CPU",
            file=sys.stderr,
            flush=True,
        )

    def med(name: str, i: int) -> float:
        return statistics.median(v[i] for v in per[name]) * 1e3

    def ratio(name: str, i: int) -> float:
        return statistics.median(a[i] / b[i] for a, b in zip(per[name], per["none"], strict=True))

    print("\n| variant | wall ms/step | CPU ms/step | wall ratio | CPU ratio |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for name in variants:
        print(
            f"| {name} | {med(name, 0):.1f} | {med(name, 1):.1f} | {ratio(name, 0):.3f}× | {ratio(name, 1):.3f}× |"
        )

    p = {k: statistics.median(v) * 1e3 for k, v in parts.items()}
    base = med("none", 1)
    total = med("nantrace", 1) - base
    timed_total = med("nantrace+timers", 1) - base
    hooks = sum(p.get(k, 0.0) for k in _TOP)
    stats = p.get("stats_host", 0.0)
    add = p.get("Recorder.add", 0.0)
    flush = p.get("Store.flush", 0.0)
    rows = [
        ("statistics reductions (stats_host)", stats, calls.get("stats_host", 0)),
        ("per-record bookkeeping (Recorder.add − stats)", add - stats, calls.get("Recorder.add", 0)),
        ("hook glue (hooks − add − flush)", hooks - add - flush, sum(calls.get(k, 0) for k in _TOP)),
        ("Store.flush (once per step)", flush, calls.get("Store.flush", 0)),
        ("not in any hook (module-hook slow path, autograd, gc)", timed_total - hooks, 0),
    ]
    print(
        f"\nCPU-time breakdown of the traced step (timed run: {timed_total:.1f} ms/step over the untraced "
        f"{base:.1f} ms; the uninstrumented overhead is {total:.1f} ms"
        + (f" = {total * 1e3 / records:.0f} µs/record for {records} records/step" if records else "")
        + ")\n"
    )
    print("| part | ms/step | share | calls/step | µs/call |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for name, ms, n in rows:
        per_call = f"{ms * 1e3 / n:.1f}" if n else ""
        print(f"| {name} | {ms:.2f} | {ms / timed_total:.0%} | {n or ''} | {per_call} |")
    stub_saving = med("nantrace", 1) - med("nantrace, stats stubbed", 1)
    hooks_only = med("nantrace, Recorder.add a no-op (hooks only)", 1) - base
    add_only = med("nantrace, stats stubbed", 1) - med("nantrace, Recorder.add a no-op (hooks only)", 1)
    print(
        f"\nwithout timers (CPU ms/step): statistics {stub_saving:.1f} (full − stats stubbed), per-record "
        f"bookkeeping {add_only:.1f} (stats stubbed − add no-op"
        + (f"; {add_only * 1e3 / records:.1f} µs/record), " if records else "), ")
        + f"hooks without recording {hooks_only:.1f} (add no-op − none: hook dispatch, flatten, tensor-hook "
        "registration, grad norms, flush)"
    )
    print("inclusive hook times (ms/step CPU): " + ", ".join(f"{k} {p[k]:.2f}" for k in _TOP if k in p))
    return {"parts_ms": p, "calls": calls, "overhead_ms": total, "base_ms": base}


# ---------------------------------------------------------------------------------------------- replay
def capture(w: overhead.Workload) -> list[torch.Tensor]:
    """Clones of the tensors ``stats_host`` saw in one traced step."""
    seen: list[torch.Tensor] = []
    orig = _hooks.stats_host

    def spy(t: torch.Tensor) -> tuple[float, ...]:
        seen.append(t.detach().clone())
        return orig(t)

    with _patched(_hooks, "stats_host", spy), _start(w):
        w.step()
        seen.clear()
        w.step()
    return seen


def _pass_us(f: Callable[[torch.Tensor], object], ts: list[torch.Tensor], reps: int) -> float:
    for t in ts:
        f(t)
    best = math.inf
    for _ in range(reps):
        t0 = time.perf_counter()
        for t in ts:
            f(t)
        best = min(best, time.perf_counter() - t0)
    return best * 1e6


def _category(t: torch.Tensor) -> str:
    lo, hi = float(t.min()), float(t.max())
    if lo > 0 or hi < 0:
        return "one sign, no zeros"
    return "mixed sign, no zeros" if int((t == 0).sum()) == 0 else "holds zeros"


def _clean_by_aminmax(x: torch.Tensor) -> bool:
    lo, hi = torch.aminmax(x)
    return math.isfinite(float(lo)) and math.isfinite(float(hi))


def _clean_by_sum(x: torch.Tensor) -> bool:
    """No NaN/±inf in ``x`` if its sum is finite (NaN and inf propagate into a sum; +inf + -inf is NaN). A
    non-finite sum can also be an overflow of finite values: then the exact check decides. One read-only pass
    that is cheaper than aminmax (no NaN-propagating compare)."""
    return math.isfinite(float(x.sum(dtype=torch.float32 if x.element_size() < 4 else None)))


def section_replay(w: overhead.Workload, reps: int) -> dict[str, Any]:
    ts = capture(w)
    groups: dict[str, list[torch.Tensor]] = collections.defaultdict(list)
    for t in ts:
        groups[_category(t)].append(t)
    cats = sorted(groups)
    small = sum(t.numel() <= 4096 for t in ts)
    print(
        f"{len(ts)} tensors/step ({small} with <= 4096 elements): "
        + ", ".join(f"{len(groups[c])} {c}" for c in cats)
    )
    fns: dict[str, Callable[[torch.Tensor], object]] = {
        "light-step check now: aminmax + 2 float() (is_clean_host)": _clean_by_aminmax,
        "light-step check proposed: isfinite(x.sum(dtype=float32))": _clean_by_sum,
        "count_nonzero (float tensor) + int()": lambda x: int(torch.count_nonzero(x)),
        **stats_alternatives.CANDIDATES,
    }
    out: dict[str, float] = {}
    head = " | ".join(f"{c} ({len(groups[c])})" for c in cats)
    print(f"\n| µs per step, by tensor kind | {head} | all | µs/tensor |")
    print("| --- | " + " | ".join("---:" for _ in cats) + " | ---: | ---: |")
    for name, f in fns.items():
        per = [_pass_us(f, groups[c], reps) for c in cats]
        out[name] = sum(per)
        cells = " | ".join(f"{v:.0f}" for v in per)
        print(f"| {name} | {cells} | {sum(per):.0f} | {sum(per) / len(ts):.1f} |")
    w.step()
    grads = [p.grad for p in w.model.parameters() if p.grad is not None]
    us = _pass_us(lambda g: torch.linalg.vector_norm(g, dtype=torch.float64), grads, reps)
    print(f"\nvector_norm of each parameter gradient (steps.grad_norm): {us:.0f} µs/step, {len(grads)} grads")
    return out


# ---------------------------------------------------------------------------------------------- ops
def section_ops(w: overhead.Workload, steps: int) -> None:
    from torch.profiler import ProfilerActivity, profile

    def run(ctx: Any) -> dict[str, tuple[int, float]]:
        with ctx:
            w.step()
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                for _ in range(steps):
                    w.step()
        return {e.key: (e.count, e.self_cpu_time_total) for e in prof.key_averages()}

    base = run(contextlib.nullcontext())
    traced = run(_start(w))
    rows = []
    for k, (n, us) in traced.items():
        n0, us0 = base.get(k, (0, 0.0))
        if n > n0 or us - us0 > 50 * steps:
            rows.append((k, (n - n0) / steps, (us - us0) / steps / 1e3))
    rows.sort(key=lambda r: -r[2])
    print("| ATen op | extra calls/step | extra self-CPU ms/step |")
    print("| --- | ---: | ---: |")
    for k, n, ms in rows[:20]:
        print(f"| {k} | {n:.0f} | {ms:.2f} |")
    print(f"| total of the rows above | | {sum(r[2] for r in rows):.2f} |")


# ---------------------------------------------------------------------------------------------- cProfile
def section_cprofile(w: overhead.Workload, steps: int, top: int) -> None:
    with _start(w):
        w.step()
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(steps):
            w.step()
        prof.disable()
    s = io.StringIO()
    st = pstats.Stats(prof, stream=s)
    rows = []
    for (file, line, fn), (_cc, nc, tt, ct, _callers) in st.stats.items():  # type: ignore[attr-defined]
        where = "torch" if file == "~" else Path(file).parent.name + "/" + Path(file).name
        rows.append((tt, ct, nc, f"{where}:{line} {fn}" if file != "~" else fn))
    rows.sort(reverse=True)
    print("| own ms/step | incl. ms/step | calls/step | function |")
    print("| ---: | ---: | ---: | --- |")
    for tt, ct, nc, name in rows[:top]:
        print(f"| {tt / steps * 1e3:.2f} | {ct / steps * 1e3:.2f} | {nc / steps:.0f} | `{name}` |")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="a", choices=sorted(overhead.WORKLOADS))
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--sections", default=",".join(SECTIONS))
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=4, help="steps per timed block")
    p.add_argument("--reps", type=int, default=7, help="best-of repetitions in the replay section")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    sections = args.sections.split(",")
    w = overhead.WORKLOADS[args.model](torch.device("cpu"))
    print(f"# nantrace overhead profile: model ({w.key}) {w.title}\n\n{overhead.machine_line()}\n")
    for _ in range(2):
        w.step()
    info: dict[str, Any] = {"records": 0}
    if "records" in sections:
        print("## records\n")
        info.update(section_records(w))
    if "breakdown" in sections:
        print("\n## breakdown (process/thread CPU time)\n")
        section_breakdown(w, args.rounds, args.steps, info["records"])
    if "replay" in sections:
        print(f"\n## replay: statistics of one step's tensors (best of {args.reps}, wall µs)\n")
        section_replay(w, args.reps)
    if "ops" in sections:
        print("\n## ops: torch.profiler, traced minus untraced\n")
        section_ops(w, 2)
    if "cprofile" in sections:
        print("\n## cProfile of traced steps (top own time)\n")
        section_cprofile(w, 3, 30)
    return 0


if __name__ == "__main__":
    sys.exit(main())
