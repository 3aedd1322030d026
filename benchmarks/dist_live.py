"""Cost of the live cross-rank check (``nantrace.trace(..., live_every=N)``) under torch.distributed.

Spawns ``--world`` processes on the gloo backend (CPU, one thread each) that train a small DDP MLP under float16
autocast with a GradScaler, and times ``--steps`` steps (after 5 warm-up steps) in one run for: no tracing,
tracing with live mode off, ``live_every=10`` and ``live_every=1``, each repeated ``--rounds`` times in turn
(the fastest round is reported: the machine is shared, and noise only adds time). It also times the time spent
inside the live check itself (``Live.check``: flags, the gather, the line) and the check's collective alone
(one ``all_gather`` of 7 int64 per rank). Prints ms per step on rank 0 and the live check's cost per step.

    python benchmarks/dist_live.py --world 2 --steps 100 --rounds 3
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn

import nantrace
from nantrace._live import Live

CHECK_TIME: list[float] = []


def _timed_check(self: Live, store: object) -> str | None:
    t0 = time.perf_counter()
    try:
        return _orig_check(self, store)  # type: ignore[arg-type]
    finally:
        CHECK_TIME.append(time.perf_counter() - t0)


_orig_check = Live.check
Live.check = _timed_check  # type: ignore[method-assign]


class MLP(nn.Module):
    def __init__(self, d: int = 64, n_layers: int = 4) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(d, d) for _ in range(n_layers))
        self.head = nn.Linear(d, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = F.relu(layer(x))
        return self.head(x)


def train(model: nn.Module, opt: torch.optim.Optimizer, scaler: torch.amp.GradScaler, steps: int) -> None:
    for _ in range(steps):
        x = torch.randn(16, 64)
        with torch.autocast("cpu", dtype=torch.float16):
            out = model(x)
        loss = out.float().pow(2).mean()
        opt.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()


def timed(mode: str, steps: int) -> float:
    torch.manual_seed(0)
    model = nn.parallel.DistributedDataParallel(MLP())
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu", init_scale=256.0)
    live = {"off": None, "live10": 10, "live1": 1}.get(mode)
    ctx = nantrace.trace(model, scaler=scaler, optimizer=opt, live_every=live) if mode != "none" else None
    if ctx is not None:
        ctx.__enter__()
    try:
        train(model, opt, scaler, 5)
        dist.barrier()
        t0 = time.perf_counter()
        train(model, opt, scaler, steps)
        dist.barrier()
        return (time.perf_counter() - t0) / steps * 1e3
    finally:
        if ctx is not None:
            ctx.__exit__(None, None, None)


def gather_cost(world: int, n: int = 500) -> float:
    flags = torch.zeros(7, dtype=torch.int64)
    out = [torch.zeros_like(flags) for _ in range(world)]
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(n):
        dist.all_gather(out, flags)
        _ = [g.tolist() for g in out]
    return (time.perf_counter() - t0) / n * 1e6


def worker(rank: int, world: int, port: int, steps: int, rounds: int) -> None:
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    modes = ["none", "off", "live10", "live1"]
    times: dict[str, list[float]] = {m: [] for m in modes}
    inside: list[float] = []
    for i in range(rounds):
        for m in modes[i % 2 :] + modes[: i % 2]:  # alternate the order between rounds
            CHECK_TIME.clear()
            times[m].append(timed(m, steps))
            if m == "live1":
                inside.append(sum(CHECK_TIME[5:]) / steps * 1e3)  # without the warm-up steps
    us = gather_cost(world)
    if rank == 0:
        med = {m: min(v) for m, v in times.items()}
        print(f"world {world}, gloo, {steps} steps x {rounds} rounds, torch {torch.__version__}")
        print(f"{'mode':<28} {'ms/step':>8}  vs live off")
        names = {
            "none": "no tracing",
            "off": "trace, live off (default)",
            "live10": "trace, live_every=10",
            "live1": "trace, live_every=1",
        }
        for m in modes:
            print(f"{names[m]:<28} {med[m]:8.3f}  {med[m] / med['off']:.3f}x")
        print(f"live_every=1, difference of step times: {med['live1'] - med['off']:+.3f} ms")
        print(f"live_every=1, time inside the check per step: {statistics.median(inside):.3f} ms (median)")
        print(f"one all_gather of 7 int64 per rank (the check's collective): {us:.1f} µs")
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    mp.start_processes(
        worker, args=(args.world, port, args.steps, args.rounds), nprocs=args.world, start_method="spawn"
    )


if __name__ == "__main__":
    main()
