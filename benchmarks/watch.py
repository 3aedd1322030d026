"""Cost of ``nantrace.watch`` per training step against no tracing (and full ``nantrace.trace``), in one run,
interleaved, as ratios.

Workloads: ``a`` (benchmarks/overhead.py's 4-layer d256 ``nn.TransformerEncoder``, SGD) and small real
architectures built from configs, fp32, AdamW: ``gpt2`` and ``bert`` (transformers, from ``GPT2Config`` /
``BertConfig``, no weights downloaded), ``resnet`` (a ResNet-18-style stack of BasicBlocks with BatchNorm, built
here) and ``convnext`` (ConvNeXt blocks: depthwise 7x7 conv, LayerNorm, MLP, layer scale, built here, as timm
cannot run on this machine).

Method: each mode has its own copy of the model (same seed), entered once for the whole run, so ``watch``'s
full step every ``every`` steps falls where it would in training. Every round runs ``--steps`` steps of each mode
(the order rotates each round); a warm-up round is not counted. The table gives, per workload and mode, the
median over rounds of the per-round ratio to the untraced steps of the same round (the sentinel's steady cost:
rounds holding a full step are outliers the median passes over) and the ratio of total time over all rounds
(the amortized cost, full steps included), in wall time and in this process's CPU time, with the load average
at the start and the end (the machine may be shared).

Mode ``control`` is a second untraced copy of the model measured like the others: its ratio to ``none`` is
the noise floor of the run (two identical untraced steps interleaved on a shared machine); read a watch ratio
against it.

Run: ``python benchmarks/watch.py --threads 2`` (about 6 minutes on the 2-core machine), ``--quick`` to smoke.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

import nantrace

sys.path.insert(0, str(Path(__file__).resolve().parent))
from overhead import make_transformer

Step = Callable[[], None]


def _adamw_step(model: nn.Module, loss_fn: Callable[[], torch.Tensor]) -> tuple[torch.optim.Optimizer, Step]:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        loss_fn().backward()
        opt.step()

    return opt, step


def make_a() -> tuple[nn.Module, torch.optim.Optimizer, Step]:
    w = make_transformer(torch.device("cpu"))
    return w.model, w.optimizer, w.step


def make_gpt2() -> tuple[nn.Module, torch.optim.Optimizer, Step]:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    model = GPT2LMHeadModel(
        GPT2Config(
            n_layer=4, n_embd=256, n_head=4, vocab_size=8192, n_positions=128, bos_token_id=0, eos_token_id=0
        )
    )
    ids = torch.randint(0, 8192, (8, 64))
    opt, step = _adamw_step(model, lambda: model(input_ids=ids, labels=ids).loss)
    return model, opt, step


def make_bert() -> tuple[nn.Module, torch.optim.Optimizer, Step]:
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(0)
    cfg = BertConfig(
        num_hidden_layers=4, hidden_size=256, num_attention_heads=4, intermediate_size=1024, vocab_size=8192
    )
    model = BertForSequenceClassification(cfg)
    ids = torch.randint(0, 8192, (8, 64))
    mask = torch.ones(8, 64, dtype=torch.long)
    labels = torch.randint(0, 2, (8,))
    opt, step = _adamw_step(model, lambda: model(input_ids=ids, attention_mask=mask, labels=labels).loss)
    return model, opt, step


class BasicBlock(nn.Module):
    def __init__(self, i: int, o: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(i, o, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(o)
        self.conv2 = nn.Conv2d(o, o, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(o)
        self.relu = nn.ReLU(inplace=True)
        self.down = (
            nn.Sequential(nn.Conv2d(i, o, 1, stride, bias=False), nn.BatchNorm2d(o))
            if stride != 1 or i != o
            else nn.Identity()
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.relu(self.bn2(self.conv2(self.relu(self.bn1(self.conv1(x))))) + self.down(x))


def make_resnet() -> tuple[nn.Module, torch.optim.Optimizer, Step]:
    torch.manual_seed(0)
    widths = [32, 64, 128, 256]
    layers: list[nn.Module] = [
        nn.Conv2d(3, 32, 3, 1, 1, bias=False),
        nn.BatchNorm2d(32),
        nn.ReLU(inplace=True),
    ]
    prev = 32
    for i, w in enumerate(widths):
        layers += [BasicBlock(prev, w, 1 if i == 0 else 2), BasicBlock(w, w, 1)]
        prev = w
    model = nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(prev, 10))
    x, y = torch.randn(16, 3, 32, 32), torch.randint(0, 10, (16,))
    opt, step = _adamw_step(model, lambda: nn.functional.cross_entropy(model(x), y))
    return model, opt, step


class ConvNeXtBlock(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.dw = nn.Conv2d(d, d, 7, padding=3, groups=d)
        self.norm = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, 4 * d)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(4 * d, d)
        self.gamma = nn.Parameter(torch.full((d,), 1e-6))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.dw(x).permute(0, 2, 3, 1)
        y = self.fc2(self.act(self.fc1(self.norm(y)))) * self.gamma
        return x + y.permute(0, 3, 1, 2)


def make_convnext() -> tuple[nn.Module, torch.optim.Optimizer, Step]:
    torch.manual_seed(0)
    dims = [32, 64, 128, 256]
    layers: list[nn.Module] = [nn.Conv2d(3, dims[0], 4, 4)]
    for i, d in enumerate(dims):
        if i:
            layers.append(nn.Conv2d(dims[i - 1], d, 2, 2))
        layers += [ConvNeXtBlock(d), ConvNeXtBlock(d)]
    model = nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(dims[-1], 10))
    x, y = torch.randn(16, 3, 64, 64), torch.randint(0, 10, (16,))
    opt, step = _adamw_step(model, lambda: nn.functional.cross_entropy(model(x), y))
    return model, opt, step


WORKLOADS: dict[str, Callable[[], tuple[nn.Module, torch.optim.Optimizer, Step]]] = {
    "a": make_a,
    "gpt2": make_gpt2,
    "bert": make_bert,
    "resnet": make_resnet,
    "convnext": make_convnext,
}


def _context(mode: str, model: nn.Module, opt: torch.optim.Optimizer, every: int) -> Any:
    if mode == "watch":
        return nantrace.watch(model, optimizer=opt, every=every)
    if mode == "trace":
        return nantrace.trace(model, optimizer=opt)
    if mode in ("none", "control"):
        return contextlib.nullcontext()
    raise SystemExit(f"--modes: unknown mode {mode!r}; the modes are watch, trace and control")


def measure(
    key: str, modes: list[str], rounds: int, steps: int, every: int
) -> dict[str, dict[str, tuple[float, float, float]]]:
    """``{mode: {"wall" | "cpu": (median per-round ratio, total-time ratio, best-round ratio)}}`` against
    ``none`` (best: the fastest round of the mode over the fastest untraced round, the least disturbed by other
    processes). CPU time is
    this process's (``time.process_time``): on a loaded machine it moves less than wall time with other
    processes' load, but counts the time torch's worker threads spin."""
    runs = {m: WORKLOADS[key]() for m in ["none", *modes]}
    with contextlib.ExitStack() as stack:
        for m, (model, opt, _) in runs.items():
            stack.enter_context(_context(m, model, opt, every))
        order = list(runs)
        times: dict[str, dict[str, list[float]]] = {c: {m: [] for m in order} for c in ("wall", "cpu")}
        for r in range(rounds + 1):
            order = order[1:] + order[:1]
            for m in order:
                step = runs[m][2]
                t0, c0 = time.perf_counter(), time.process_time()
                for _ in range(steps):
                    step()
                if r:
                    times["wall"][m].append(time.perf_counter() - t0)
                    times["cpu"][m].append(time.process_time() - c0)
    out: dict[str, dict[str, tuple[float, float, float]]] = {m: {} for m in modes}
    for clock, t in times.items():
        base = t["none"]
        for m in modes:
            ratios = [a / b for a, b in zip(t[m], base, strict=True)]
            out[m][clock] = (statistics.median(ratios), sum(t[m]) / sum(base), min(t[m]) / min(base))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", default=",".join(WORKLOADS))
    p.add_argument("--modes", default="watch,trace,control")
    p.add_argument("--rounds", type=int, default=12)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--every", type=int, default=nantrace_default_every())
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--quick", action="store_true")
    a = p.parse_args()
    if a.quick:
        a.rounds, a.steps = 2, 2
    torch.set_num_threads(a.threads)
    modes = a.modes.split(",")
    print(
        f"torch {torch.__version__}, {a.threads} threads, {a.rounds} rounds x {a.steps} steps, every={a.every}, "
        f"load average {' '.join(f'{x:.1f}' for x in os.getloadavg())}"
    )
    head = " | ".join(f"{m} median | {m} total | {m} best | {m} CPU median | {m} CPU total" for m in modes)
    print(f"| workload | {head} |")
    print(f"| --- | {' | '.join('---: | ---: | ---: | ---: | ---:' for _ in modes)} |")
    medians: dict[str, list[float]] = {m: [] for m in modes}
    for key in a.models.split(","):
        res = measure(key, modes, a.rounds, a.steps, a.every)
        for m in modes:
            if key != "a":
                medians[m].append(res[m]["wall"][0])
        cells = " | ".join(
            " | ".join(f"{v:.3f}x" for v in (*res[m]["wall"], *res[m]["cpu"][:2])) for m in modes
        )
        print(f"| {key} | {cells} |", flush=True)
    for m in modes:
        if medians[m]:
            print(f"median over real architectures, {m} (wall): {statistics.median(medians[m]):.3f}x")
    print(f"load average at the end {' '.join(f'{x:.1f}' for x in os.getloadavg())}")


def nantrace_default_every() -> int:
    from nantrace._watch import DEFAULT_EVERY

    return DEFAULT_EVERY


if __name__ == "__main__":
    main()
