"""Tracing overhead as a CPU-time ratio, for a machine shared with other work.

On a loaded machine wall-clock ratios swing by tens of percent. With one torch thread the whole training step
(forward, autograd's CPU backward, the optimizer, every nantrace hook) runs on the calling thread, so
``time.thread_time`` around it counts only this step's own work and barely moves with the load. Per model:
rounds of two untraced steps then two steps inside a fresh ``nantrace.trace`` (default options), the median
over rounds of each and of the per-round ratio, records/step and CPU µs per record ((traced - untraced) /
records). Models: ``a`` (``overhead.py``'s transformer) and the small real architectures of
``real_models.py`` (``gpt2``, ``bert``, ``roberta``, ``resnet18``, ``convnext``); the median ratio over the
real architectures is printed last.

To compare two checkouts on the same machine, run it alternately with ``PYTHONPATH`` pointing at each.

    python benchmarks/cpu_time.py --models a,gpt2,bert,roberta,resnet18,convnext --rounds 3
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import overhead
import real_models

import nantrace

REAL = ("gpt2", "bert", "roberta", "resnet18", "convnext")


def _workload(name: str) -> overhead.Workload:
    if name == "a":
        return overhead.make_transformer(torch.device("cpu"))
    if name in ("gpt2", "bert", "roberta"):
        return real_models._hf(name)
    return real_models._cnn(name)


def measure(name: str, rounds: int) -> tuple[float, float, float, int]:
    """(untraced CPU s/step, traced CPU s/step, median per-round ratio, records/step) of one model."""
    w = _workload(name)
    for _ in range(2):
        w.step()
    base, traced, ratios = [], [], []
    records = 0
    for _ in range(rounds):
        t0 = time.thread_time()
        w.step()
        w.step()
        t1 = time.thread_time()
        with nantrace.trace(w.model, optimizer=w.optimizer, scaler=w.scaler) as tr:
            t2 = time.thread_time()
            w.step()
            w.step()
            t3 = time.thread_time()
        records = len(tr.records) // 2
        base.append((t1 - t0) / 2)
        traced.append((t3 - t2) / 2)
        ratios.append(traced[-1] / base[-1])
    return statistics.median(base), statistics.median(traced), statistics.median(ratios), records


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="a," + ",".join(REAL))
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    warnings.simplefilter("ignore")  # the optimizer-without-loss warning, transformers' config notes
    torch.set_num_threads(1)
    print(overhead.machine_line())
    print(
        "| model | untraced CPU ms/step | traced CPU ms/step | CPU-time ratio | records/step | CPU µs/record |"
    )
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    real = []
    for name in args.models.split(","):
        b, t, r, n = measure(name, args.rounds)
        if name in REAL:
            real.append(r)
        print(
            f"| {name} | {b * 1e3:.1f} | {t * 1e3:.1f} | {r:.3f}× | {n} | {(t - b) / max(n, 1) * 1e6:.1f} |"
        )
        sys.stdout.flush()
    if real:
        print(f"\nmedian CPU-time ratio over {len(real)} real architectures: {statistics.median(real):.3f}×")


if __name__ == "__main__":
    main()
