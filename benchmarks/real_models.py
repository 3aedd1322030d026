"""Tracing overhead on small real architectures built from configs (nothing downloaded).

HF GPT-2, BERT and RoBERTa (``transformers`` config classes, 2 layers, d=128), and a ResNet-18 and a
ConvNeXt-like CNN built by hand (torchvision's CPU build is not available here, so timm cannot run). fp32,
AdamW. Two measurements per architecture:

* steady state, the cost of leaving tracing on: an untraced copy and a traced copy of the model (the trace
  entered once for the whole run, as in training), rounds of ``--steps`` steps of each, the order alternating;
  the median of the per-round wall ratios, the CPU-time ratio, records/step and µs per record
  ((traced - untraced) / records);
* the first ``--first`` steps of a fresh trace over as many untraced steps (what a short run pays once: the
  first calls' drill-down replays, the string tables);
* with ``--floor``, a third copy in the steady-state rounds, traced with nantrace's statistics replaced by one
  ``torch.aminmax`` per tensor (:func:`one_pass`): what tracing would cost if the eight statistics read each
  tensor once, the physical floor the issue names. Its rows are not nantrace's statistics (only min, max and
  absmax are right; it sees no zeros, so no drill-down replay starts): a measurement, nothing else.

Prints the per-model table and the medians over the architectures.

    python benchmarks/real_models.py --rounds 8 --threads 2
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from overhead import Workload, machine_line

import nantrace
import nantrace._hooks as _hooks


def _hf(name: str) -> Workload:
    import transformers as tf

    torch.manual_seed(0)
    # BERT and RoBERTa: the same encoder shape
    enc = dict(
        num_hidden_layers=2,
        hidden_size=128,
        num_attention_heads=4,
        intermediate_size=512,
        vocab_size=1000,
        max_position_embeddings=128,
    )
    if name == "gpt2":
        model: nn.Module = tf.GPT2LMHeadModel(
            tf.GPT2Config(
                n_layer=2,
                n_embd=128,
                n_head=4,
                n_positions=128,
                vocab_size=1000,
                bos_token_id=0,
                eos_token_id=0,
            )
        )
    elif name == "bert":
        model = tf.BertForMaskedLM(tf.BertConfig(**enc))
    else:
        model = tf.RobertaForMaskedLM(tf.RobertaConfig(pad_token_id=1, **enc))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ids = torch.randint(3, 1000, (4, 64))

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()

    return Workload(name, f"HF {name} 2x128", model, opt, None, step, torch.device("cpu"))


class _Basic(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.c1, self.b1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False), nn.BatchNorm2d(cout)
        self.c2, self.b2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False), nn.BatchNorm2d(cout)
        self.relu = nn.ReLU(inplace=True)
        self.down = (
            nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))
            if stride != 1 or cin != cout
            else nn.Identity()
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.relu(self.b2(self.c2(self.relu(self.b1(self.c1(x))))) + self.down(x))


def resnet18(classes: int = 10) -> nn.Module:
    """ResNet-18 (BasicBlock, [2, 2, 2, 2], widths 64-512), as torchvision builds it."""
    layers: list[nn.Module] = [
        nn.Conv2d(3, 64, 7, 2, 3, bias=False),
        nn.BatchNorm2d(64),
        nn.ReLU(inplace=True),
        nn.MaxPool2d(3, 2, 1),
    ]
    cin = 64
    for i, w in enumerate((64, 128, 256, 512)):
        layers += [_Basic(cin, w, 1 if i == 0 else 2), _Basic(w, w, 1)]
        cin = w
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(512, classes)]
    return nn.Sequential(*layers)


class _CNBlock(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.dw = nn.Conv2d(d, d, 7, padding=3, groups=d)
        self.norm = nn.LayerNorm(d)
        self.pw1, self.act, self.pw2 = nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.dw(x).permute(0, 2, 3, 1)
        return x + self.pw2(self.act(self.pw1(self.norm(y)))).permute(0, 3, 1, 2)


def convnext_small(classes: int = 10) -> nn.Module:
    """ConvNeXt-like: stem 4x4/4, stages of depths (1, 1, 2, 1) and widths 48-384, downsampling 2x2/2."""
    dims, depths = (48, 96, 192, 384), (1, 1, 2, 1)
    layers: list[nn.Module] = [nn.Conv2d(3, dims[0], 4, 4)]
    for i, (d, n) in enumerate(zip(dims, depths, strict=True)):
        if i:
            layers.append(nn.Conv2d(dims[i - 1], d, 2, 2))
        layers += [_CNBlock(d) for _ in range(n)]
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(dims[-1], classes)]
    return nn.Sequential(*layers)


def _cnn(name: str) -> Workload:
    torch.manual_seed(0)
    model = resnet18() if name == "resnet18" else convnext_small()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x, y = torch.randn(4, 3, 64, 64), torch.randint(0, 10, (4,))

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()

    return Workload(name, name, model, opt, None, step, torch.device("cpu"))


def _build(name: str) -> Workload:
    return _hf(name) if name in ("gpt2", "bert", "roberta") else _cnn(name)


def _timed(step: Callable[[], None], n: int) -> tuple[float, float]:
    """Wall and process-CPU seconds per step of ``n`` calls of ``step``."""
    t0, c0 = time.perf_counter(), time.process_time()
    for _ in range(n):
        step()
    return (time.perf_counter() - t0) / n, (time.process_time() - c0) / n


def one_pass(t: torch.Tensor) -> tuple[float, ...]:
    """The ``--floor`` copy's statistic: one ``torch.aminmax`` read of ``t``; min, max and absmax, the other
    five are placeholders (not nantrace's statistics: for measuring only)."""
    lo, hi = torch.aminmax(t.detach())
    a, b = float(lo), float(hi)
    return (a, b, max(-a, b), 1.0, 0.0, 0.0, 0.0, 0.0)


def _floor_step(w: Workload) -> Callable[[], None]:
    """``w.step`` with nantrace's statistics replaced by :func:`one_pass` while it runs."""

    def step() -> None:
        real = _hooks.stats_host
        _hooks.stats_host = one_pass
        try:
            w.step()
        finally:
            _hooks.stats_host = real

    return step


def steady(name: str, rounds: int, steps: int, floor: bool = False) -> dict[str, float]:
    """One untraced copy and one traced copy of the architecture (same seed), the trace entered once for the
    whole run as in training; a warm-up round, then ``rounds`` rounds of ``steps`` steps per copy, the order
    alternating. The per-round ratios' median in wall and CPU time, records/step and µs/record. ``floor``: a
    third traced copy with one-pass statistics (:func:`one_pass`) in the same rounds, its median ratio as
    ``"floor"``."""
    plain, traced = _build(name), _build(name)
    low = _build(name) if floor else None
    ratios, cpu_ratios, base_ms, tr_ms, floors = [], [], [], [], []
    with warnings.catch_warnings(), contextlib.ExitStack() as stack:
        warnings.simplefilter("ignore")
        tr = stack.enter_context(nantrace.trace(traced.model, optimizer=traced.optimizer))
        steps_of = {id(plain): plain.step, id(traced): traced.step}
        if low is not None:
            stack.enter_context(nantrace.trace(low.model, optimizer=low.optimizer))
            steps_of[id(low)] = _floor_step(low)
        copies = [plain, traced] + ([low] if low is not None else [])
        for w in copies:
            _timed(steps_of[id(w)], steps)
        for r in range(rounds):
            order = copies[r % len(copies) :] + copies[: r % len(copies)]
            got = {id(w): _timed(steps_of[id(w)], steps) for w in order}
            (bw, bc), (tw, tc) = got[id(plain)], got[id(traced)]
            ratios.append(tw / bw)
            cpu_ratios.append(tc / bc)
            base_ms.append(bw * 1e3)
            tr_ms.append(tw * 1e3)
            if low is not None:
                floors.append(got[id(low)][0] / bw)
    recs = float(tr.steps["n_records"].iloc[-1])
    extra = statistics.median(tr_ms) - statistics.median(base_ms)
    return {
        "base": statistics.median(base_ms),
        "traced": statistics.median(tr_ms),
        "ratio": statistics.median(ratios),
        "cpu": statistics.median(cpu_ratios),
        "records": recs,
        "us": extra * 1e3 / recs if recs else math.nan,
        "floor": statistics.median(floors) if floors else math.nan,
    }


def first_steps(name: str, rounds: int, steps: int) -> float:
    """The first ``steps`` steps of a fresh trace (its drill-down replays, the string tables it builds) over
    as many untraced steps, median over ``rounds`` alternating pairs, after one warm-up pair."""
    w = _build(name)
    ratios = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for r in range(rounds + 1):
            base, _ = _timed(w.step, steps)
            with nantrace.trace(w.model, optimizer=w.optimizer):
                fresh, _ = _timed(w.step, steps)
            if r:
                ratios.append(fresh / base)
    return statistics.median(ratios)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--steps", type=int, default=4, help="steps per copy per round (4)")
    p.add_argument(
        "--first", type=int, default=4, help="the first steps of a fresh trace measured (4; 0: not)"
    )
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--models", default="gpt2,bert,roberta,resnet18,convnext")
    p.add_argument(
        "--floor", action="store_true", help="also a copy traced with one-pass statistics (the floor)"
    )
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    print(machine_line())
    print(
        "| model | untraced ms/step | traced ms/step | ratio | CPU-time ratio | records/step | µs/record "
        f"| first {args.first} steps of a fresh trace |" + (" one-pass floor |" if args.floor else "")
    )
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |" + (" ---: |" if args.floor else ""))
    ratios, firsts, floors = [], [], []
    for name in args.models.split(","):
        got = steady(name, args.rounds, args.steps, floor=args.floor)
        floors.append(got["floor"])
        first = first_steps(name, max(3, args.rounds // 2), args.first) if args.first > 0 else math.nan
        ratios.append(got["ratio"])
        firsts.append(first)
        print(
            f"| {_build(name).title} | {got['base']:.1f} | {got['traced']:.1f} | {got['ratio']:.2f}× "
            f"| {got['cpu']:.2f}× | {got['records']:.0f} | {got['us']:.0f} | "
            + (f"{first:.2f}× |" if args.first > 0 else "– |")
            + (f" {got['floor']:.2f}× |" if args.floor else ""),
            flush=True,
        )
    print(
        f"median ratio over {len(ratios)} architectures: {statistics.median(ratios):.2f}× "
        + (
            f"(first {args.first} steps of a fresh trace: {statistics.median(firsts):.2f}×)"
            if args.first > 0
            else ""
        )
    )
    with contextlib.suppress(OSError):
        print("load average at the end {:.1f} {:.1f} {:.1f}".format(*os.getloadavg()))


if __name__ == "__main__":
    main()
