"""One rank of a DDP job gets a corrupt batch; nantrace names the rank, the step and where the NaN came from.

Run it on CPU (gloo, no GPU needed)::

    torchrun --nproc_per_node 2 examples/ddp_nan.py

On a machine with GPUs the same command uses NCCL and one GPU per rank. Every rank traces its own copy of the
model (``nantrace.trace(ddp_model, ...)``, unchanged training loop) and saves its part to the same path; rank 0
then merges the parts with ``nantrace.load(path)``. Rank 1's batch at step 3 holds one NaN: after DDP's gradient
all-reduce every rank's gradients are NaN and the GradScaler skips the step on all of them, but only rank 1
produced it. With ``--live-every N`` rank 0 prints the producing rank while the job runs.
"""

from __future__ import annotations

import argparse
import os
import textwrap

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import nantrace


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(d, 4 * d)
        self.fc2 = nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(F.gelu(self.fc1(x)))


class MLP(nn.Module):
    def __init__(self, d: int = 16, n_layers: int = 2) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Block(d) for _ in range(n_layers))
        self.head = nn.Linear(d, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def batch(
    rank: int, step: int, bad_rank: int, bad_step: int, device: torch.device
) -> tuple[torch.Tensor, ...]:
    """A synthetic batch that differs per rank (as a DistributedSampler's would); one sample is corrupt."""
    g = torch.Generator().manual_seed(1000 * rank + step)
    x = torch.randn(8, 16, generator=g)
    y = x.sum(dim=1, keepdim=True) / 4
    if rank == bad_rank and step == bad_step:
        x[5, 7] = float("nan")  # e.g. a log(0) / 0 in preprocessing
    return x.to(device), y.to(device)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="ddp_nan.nantrace", help="path every rank saves to (becomes a folder)")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--bad-rank", type=int, default=1)
    p.add_argument("--bad-step", type=int, default=3)
    p.add_argument("--live-every", type=int, default=1, help="live cross-rank check every N steps (0: off)")
    p.add_argument("--cpu", action="store_true", help="gloo on CPU even when GPUs are available")
    args = p.parse_args()

    cuda = torch.cuda.is_available() and not args.cpu
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if cuda:
        local = int(os.environ.get("LOCAL_RANK", rank))
        torch.cuda.set_device(local)
        device = torch.device("cuda", local)
    else:
        torch.set_num_threads(1)
        device = torch.device("cpu")

    torch.manual_seed(0)  # the same initial weights on every rank (DDP also broadcasts rank 0's)
    model = nn.parallel.DistributedDataParallel(MLP().to(device), device_ids=[device.index] if cuda else None)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler(device.type, init_scale=2.0**10)

    with nantrace.trace(model, scaler=scaler, optimizer=opt, live_every=args.live_every or None) as tr:
        for step in range(args.steps):
            x, y = batch(rank, step, args.bad_rank, args.bad_step, device)
            with torch.autocast(device.type, dtype=torch.float16):
                out = model(x)
            loss = F.mse_loss(out.float(), y)
            opt.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
    tr.save(args.out)  # this rank's part: <out>/rank-0000R-of-0000W.nantrace
    dist.barrier()  # every part is written before rank 0 reads them

    if rank == 0:
        merged = nantrace.load(args.out)
        ov = merged.first_overflow()
        if ov is None:
            print(f"no overflow on any of the {world} ranks")
        else:
            print(
                f"first overflow: rank {ov.rank}, step {ov.step}, {ov.phase}, module `{ov.module}`, {ov.kind}"
            )
            print(textwrap.indent(str(ov), "  "))  # a headline line, then evidence and advice lines
            print(
                merged.overflows(per_rank=True)[["step", "rank", "phase", "module", "tensor", "propagated"]]
            )
            print(merged.diagnose())
        print(f"read it again with: nantrace report {args.out}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
