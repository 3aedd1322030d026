"""``stats_host`` of this checkout against another checkout's, on the tensors one training step records.

One traced step of a workload (``overhead.py``'s model ``a`` or a ``real_models.py`` architecture) is run with
the statistics function wrapped to keep a copy of every tensor it is handed; then both implementations reduce
that list alternately (``--reps`` times, interleaved), after checking that they give the same eight numbers for
every tensor. Prints the median ms per step of each and their ratio.

    python benchmarks/stats_ab.py --old /path/to/other/checkout --model a --threads 2
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import overhead
import real_models

import nantrace
import nantrace._hooks as hooks
import nantrace._stats as current


def _other(checkout: Path) -> Any:
    """The other checkout's ``_stats`` module, loaded inside the ``nantrace`` package (its relative imports)."""
    spec = importlib.util.spec_from_file_location(
        "nantrace._stats_other", checkout / "nantrace" / "_stats.py"
    )
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules["nantrace._stats_other"] = mod
    spec.loader.exec_module(mod)
    return mod


def _recorded(name: str) -> list[torch.Tensor]:
    """Copies of the tensors whose statistics one traced step computes."""
    if name == "a":
        w = overhead.make_transformer(torch.device("cpu"))
    elif name in ("gpt2", "bert", "roberta"):
        w = real_models._hf(name)
    else:
        w = real_models._cnn(name)
    w.step()
    seen: list[torch.Tensor] = []
    orig = hooks.stats_host

    def keep(t: torch.Tensor) -> tuple[float, ...]:
        seen.append(t.detach().clone())
        return orig(t)

    hooks.stats_host = keep  # type: ignore[assignment]
    try:
        with nantrace.trace(w.model, optimizer=w.optimizer, drill=False):
            w.step()
    finally:
        hooks.stats_host = orig  # type: ignore[assignment]
    return seen


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--old", type=Path, required=True, help="the other checkout (holds nantrace/_stats.py)")
    p.add_argument("--model", default="a")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--reps", type=int, default=15)
    args = p.parse_args()
    warnings.simplefilter("ignore")
    torch.set_num_threads(args.threads)
    old = _other(args.old)
    tensors = _recorded(args.model)
    for t in tensors:
        a, b = old.stats_host(t), current.stats_host(t)
        assert all(x == y or (x != x and y != y) for x, y in zip(a, b, strict=True)), (a, b)

    def run(fn: Any) -> float:
        t0 = time.perf_counter()
        for t in tensors:
            fn(t)
        return time.perf_counter() - t0

    o, n = [], []
    for _ in range(args.reps):
        o.append(run(old.stats_host))
        n.append(run(current.stats_host))
    mo, mn = statistics.median(o), statistics.median(n)
    print(overhead.machine_line())
    print(
        f"{args.model}: {len(tensors)} tensors, other {mo * 1e3:.2f} ms, this {mn * 1e3:.2f} ms per step, "
        f"ratio {mn / mo:.3f} (same statistics for every tensor)"
    )


if __name__ == "__main__":
    main()
