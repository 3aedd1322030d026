"""Cost of ``nantrace.hunt`` (op-level checking) against an untraced step and a ``nantrace.trace`` step.

One training step (forward, loss, backward, SGD step) of a small model, fp32 on CPU, healthy (hunt checks every
op and finds nothing, its worst case). Modes rotate within each round (untraced, trace, hunt); the table gives
the median over rounds of ms/step and of the per-round ratio to the untraced step.

    python benchmarks/hunt.py --rounds 7 --threads 2

Models: (a) ``nn.TransformerEncoder``, 2 layers, d=64, 4 heads, ff 256, batch 8 x seq 32;
(b) MLP 3 x Linear(256) + ReLU, batch 64.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

import nantrace


def model_a() -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    layer = nn.TransformerEncoderLayer(64, 4, 256, batch_first=True, dropout=0.0)
    return (
        nn.TransformerEncoder(layer, 2, enable_nested_tensor=False),
        torch.randn(8, 32, 64),
        torch.randn(8, 32, 64),
    )


def model_b() -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    m = nn.Sequential(nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 256))
    return m, torch.randn(64, 256), torch.randn(64, 256)


def step_fn(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> Callable[[], None]:
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)

    def step() -> None:
        opt.zero_grad()
        F.mse_loss(model(x), y).backward()
        opt.step()

    return step


def timed(fn: Callable[[], None]) -> float:
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    print(f"torch {torch.__version__}, {args.threads} threads, {args.rounds} rounds")
    print("| model | untraced ms/step | trace ms/step (×) | hunt ms/step (×) | ops checked |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for name, build in (("a", model_a), ("b", model_b)):
        print(measure(name, build, args.rounds))


def measure(name: str, build: Callable[[], tuple[nn.Module, torch.Tensor, torch.Tensor]], rounds: int) -> str:
    """One table row: median ms/step of the three modes and their median per-round ratios."""
    model, x, y = build()
    step = step_fn(model, x, y)
    for _ in range(2):  # warm-up
        step()
        nantrace.hunt(step)
    times: dict[str, list[float]] = {"plain": [], "trace": [], "hunt": []}
    ratios: dict[str, list[float]] = {"trace": [], "hunt": []}

    def traced() -> None:
        with nantrace.trace(model):
            step()

    def hunted() -> None:
        assert nantrace.hunt(step) is None

    for _ in range(rounds):
        plain = timed(step)
        t_trace = timed(traced)
        t_hunt = timed(hunted)
        times["plain"].append(plain)
        times["trace"].append(t_trace)
        times["hunt"].append(t_hunt)
        ratios["trace"].append(t_trace / plain)
        ratios["hunt"].append(t_hunt / plain)
    from nantrace._hunt import _Hunter, _OpMode

    hunter = _Hunter(("nan", "posinf", "neginf"))
    with _OpMode(hunter):
        step()
    med = statistics.median
    return (
        f"| ({name}) | {med(times['plain']):.1f} | {med(times['trace']):.1f} ({med(ratios['trace']):.1f}×) | "
        f"{med(times['hunt']):.1f} ({med(ratios['hunt']):.1f}×) | {hunter.n_ops} |"
    )


if __name__ == "__main__":
    main()
