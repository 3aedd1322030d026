"""Memory of the trace store: bytes per record, and RSS over a long streamed run.

Drives nantrace's store directly with synthetic rows (no model), the way hooks do: 50 modules × one
statistics row each per step, a step boundary (host copy, ``steps`` row) after each, and streaming to parquet
every ``--flush-every`` steps. Prints bytes per row in memory and RSS every 10% of the run.

    python benchmarks/memory.py --steps 100000 --modules 50
"""

from __future__ import annotations

import argparse
import resource
import tempfile
import time
from pathlib import Path

import numpy as np

import nantrace
from nantrace._format import MAGIC, read_records
from nantrace._hooks import Recorder
from nantrace._store import Store


def rss_mib() -> float:
    with open("/proc/self/statm") as f:
        pages = int(f.read().split()[1])
    return pages * resource.getpagesize() / 2**20


def fill(store: Store, rec: Recorder, modules: int) -> None:
    codes = [store.modules.code(f"layers.{i}") for i in range(modules)]
    tcode, ocode, dcode, scode = store.types.code("Linear"), store.tensors.code("output"), 0, 0
    store.dtypes.code("float16")
    store.shapes.code("(8, 64)")
    stats = (-1.5, 2.5, 2.5, 0.001, 0.0, 0.0, 0.0, 3.0)
    for i, m in enumerate(codes):
        meta = (rec.step, 0, i + 1, 1, m, tcode, 0, ocode, dcode, scode, 512, 0, 0, -1, i + 1, 0)
        store.add(meta, stats)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=100_000)
    p.add_argument("--modules", type=int, default=50)
    p.add_argument("--flush-every", type=int, default=100)
    args = p.parse_args()

    # bytes per row held in memory (no streaming), over 1000 steps
    store = Store()
    rec = Recorder(store, sync_free=False, record_phases=frozenset())
    for _ in range(1000):
        fill(store, rec, args.modules)
        rec.end_step(lambda chunk, st: np.zeros(len(chunk["seq"]), dtype=bool))
    df = store.records()
    print(
        f"store chunks: {store.nbytes_per_row():.1f} bytes/row; records DataFrame: "
        f"{df.memory_usage(deep=True).sum() / len(df):.1f} bytes/row ({len(df)} rows)"
    )

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "long.nantrace"
        store = Store()
        store.stream_to(path, args.flush_every)
        rec = Recorder(store, sync_free=False, record_phases=frozenset())
        t0 = time.perf_counter()
        start = rss_mib()
        print(f"streaming {args.steps} steps × {args.modules} modules; RSS at start {start:.1f} MiB")
        for step in range(args.steps):
            fill(store, rec, args.modules)
            rec.end_step(lambda chunk, st: np.zeros(len(chunk["seq"]), dtype=bool))
            store.maybe_spill()
            if (step + 1) % (args.steps // 10) == 0:
                print(
                    f"  step {step + 1:>7}: RSS {rss_mib():7.1f} MiB, rows in memory "
                    f"{sum(len(c['seq']) for c in store.chunks):>6}, written {store.spilled_rows:>9}"
                )
        store.close_stream({MAGIC: b'{"header": {"format": 1}}'})
        print(
            f"  done in {time.perf_counter() - t0:.0f} s; file {path.stat().st_size / 2**20:.1f} MiB; "
            f"steps rows kept in memory: {len(store.step_rows)}"
        )
        rows = len(read_records(path))
        print(
            f"  read back: {rows} rows (expected {args.steps * args.modules}); nantrace {nantrace.__version__}"
        )


if __name__ == "__main__":
    main()
