"""Extra peak memory of the statistics of one large tensor, on each statistics path.

Each case runs in a fresh Python process: it builds one float16 tensor of ``--mib`` MiB (filled in place, chunk
by chunk, so filling leaves no temporary), reads the process's peak RSS, computes the statistics the way a hook
does, and reads the peak again. The difference is the temporaries' peak; the goal is ≤ 1.25× the tensor.

    python benchmarks/stats_memory.py --mib 128
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys

CASES = {
    "host, mixed signs (integer min/max over the bits)": ("host", "mixed"),
    "host, ReLU-like (zeros counted on the magnitude bits, a chunk at a time)": ("host", "relu"),
    "host, holds NaN (falls back to the device reductions)": ("host", "nan"),
    "sync_free, clean": ("device", "mixed"),
    "sync_free, holds NaN and inf": ("device", "nan"),
}


def _child(path: str, fill: str, mib: int) -> None:
    import torch

    from nantrace._stats import stats_device, stats_host

    torch.set_num_threads(2)
    t = torch.empty(mib * 2**20 // 2, dtype=torch.float16)
    g = torch.Generator().manual_seed(0)
    for c in t.split(1 << 20):
        c.normal_(generator=g)
    if fill == "relu":
        t.clamp_(min=0)
    if fill == "nan":
        t[[10, 2**20 + 7]] = torch.tensor([float("nan"), float("inf")], dtype=torch.float16)
    stats_host(t[:1000]) if path == "host" else stats_device(t[:1000])  # import/warm-up allocations
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    out = stats_host(t) if path == "host" else stats_device(t).tolist()
    after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(json.dumps({"extra_mib": (after - before) / 1024, "stats": list(out)}))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mib", type=int, default=128, help="size of the float16 tensor in MiB (128)")
    p.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        _child(args.child[0], args.child[1], args.mib)
        return
    print(f"one float16 tensor of {args.mib} MiB; extra peak RSS of computing its statistics")
    print("| path | extra peak MiB | × tensor |")
    print("| --- | ---: | ---: |")
    for label, (path, fill) in CASES.items():
        res = subprocess.run(
            [sys.executable, __file__, "--mib", str(args.mib), "--child", path, fill],
            capture_output=True,
            text=True,
            check=True,
        )
        extra = json.loads(res.stdout.strip().splitlines()[-1])["extra_mib"]
        print(f"| {label} | {extra:.1f} | {extra / args.mib:.3f}× |")


if __name__ == "__main__":
    main()
