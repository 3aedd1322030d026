"""How often the forward drill-down replays module calls on healthy models (nothing non-finite).

A finite call is replayed when the recorded statistics point to a transient inf (``nantrace._drill.Suspects``:
more zeros out than in, an input beyond the cube root of its dtype's max, each at a new high per module),
unless an earlier replay of such a call (same module and input structure, or a leaf module running the same
code) made no intermediate value
(``Suspects.skips``: such a signal is *passed over*). This counts, per workload, the drill-downs (``drill_call``)
and the forward replays they ran (``replay_call``: one per drill-down, plus up to three when an op made a kind in
a finite call, to tell whether it reached the output), over ``--steps`` traced training steps, the module classes
replayed, the signals passed over (0 where ``Suspects.skips`` does not exist: before the rule), and the
drill-downs at step 0 (``Recorder.replay`` calls; the benchmarks start a fresh trace every few steps, so the
first step's replays are most of the drill-down's cost there). Workloads: ``a``, ``b``,
``c`` of ``overhead.py``, the ResNet-18 and ConvNeXt-like CNN of ``real_models.py``, and HF GPT-2/BERT/RoBERTa
when ``transformers`` is installed.

    python benchmarks/replays.py --steps 20
"""

from __future__ import annotations

import argparse
import collections
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

import nantrace
import nantrace._drill as drill
import nantrace._hooks as hooks

sys.path.insert(0, str(Path(__file__).resolve().parent))
from overhead import WORKLOADS, Workload, machine_line
from real_models import _cnn, _hf


def _workloads(names: list[str]) -> list[Callable[[], Workload]]:
    out: list[Callable[[], Workload]] = []
    for n in names:
        if n in WORKLOADS:
            out.append(lambda n=n: WORKLOADS[n](torch.device("cpu")))
        elif n in ("gpt2", "bert", "roberta"):
            try:
                import transformers  # noqa: F401
            except ImportError:
                print(f"{n}: skipped (transformers not installed)")
                continue
            out.append(lambda n=n: _hf(n))
        else:
            out.append(lambda n=n: _cnn(n))
    return out


def count(
    make: Callable[[], Workload], steps: int
) -> tuple[str, int, int, collections.Counter[str], int, int, int]:
    """(title, drill-downs, replays, module classes drilled, ops rows, signals passed over, drill-downs at step 0)
    over ``steps`` traced steps of a fresh trace."""
    w = make()
    drilled: collections.Counter[str] = collections.Counter()
    replays = [0]
    passed = [0]
    at_step: collections.Counter[int] = collections.Counter()
    real_drill, real_replay, real_call = hooks.drill_call, drill.replay_call, hooks.Recorder.replay
    real_skips = getattr(drill.Suspects, "skips", None)

    def counted_skips(self: Any, *a: Any) -> bool:
        skip = bool(real_skips(self, *a))  # type: ignore[misc]
        passed[0] += skip
        return skip

    def counted_drill(module: torch.nn.Module, *a: Any, **k: Any) -> Any:
        drilled[type(module).__name__] += 1
        return real_drill(module, *a, **k)

    def counted_replay(*a: Any, **k: Any) -> Any:
        replays[0] += 1
        return real_replay(*a, **k)

    def counted_call(self: Any, *a: Any, **k: Any) -> Any:
        at_step[self.step] += 1
        return real_call(self, *a, **k)

    hooks.drill_call, drill.replay_call = counted_drill, counted_replay  # type: ignore[assignment]
    hooks.Recorder.replay = counted_call  # type: ignore[method-assign]
    if real_skips is not None:
        drill.Suspects.skips = counted_skips  # type: ignore[method-assign]
    try:
        with nantrace.trace(w.model, optimizer=w.optimizer, scaler=w.scaler) as tr:
            for _ in range(steps):
                w.step()
    finally:
        hooks.drill_call, drill.replay_call = real_drill, real_replay  # type: ignore[assignment]
        hooks.Recorder.replay = real_call  # type: ignore[method-assign]
        if real_skips is not None:
            drill.Suspects.skips = real_skips  # type: ignore[method-assign]
    return w.title, sum(drilled.values()), replays[0], drilled, len(tr.ops), passed[0], at_step[0]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--models", default="a,b,c,resnet18,convnext,gpt2,bert,roberta")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    print(machine_line())
    print(
        f"| workload | drill-downs in {args.steps} steps | at step 0 | forward replays | ops rows "
        "| signals passed over | module classes drilled |"
    )
    print("| --- | ---: | ---: | ---: | ---: | ---: | --- |")
    for make in _workloads(args.models.split(",")):
        title, n, r, by, rows, passed, first = count(make, args.steps)
        classes = ", ".join(f"{k} {v}" for k, v in by.most_common()) or "none"
        print(f"| {title} | {n} | {first} | {r} | {rows} | {passed} | {classes} |", flush=True)


if __name__ == "__main__":
    main()
