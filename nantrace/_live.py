"""The optional live check of a distributed run (``trace(live_every=N)``): every N-th step boundary, one
``all_gather`` tells every rank which rank produced the first non-finite value since the last check."""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, TextIO

import numpy as np
import torch

from ._locate import rank_events
from ._schema import KIND_WORDS, KINDS, PHASES

if TYPE_CHECKING:
    from ._recording import Recording
    from ._store import Store

__all__ = ["Live"]

_WHAT = KIND_WORDS
_KIND_CODE = {k: i for i, k in enumerate(KINDS)}


class Live:
    """The optional live check (``trace(live_every=N)``): at every N-th step boundary one ``all_gather`` of 7
    int64 per rank tells every rank which rank produced the first non-finite value since the last check; rank
    0 prints it to ``stream`` (default ``sys.stderr``), e.g. ``nantrace: rank 3 produced +inf in
    `layers.7.mlp.fc2` at step 120 (forward)``.

    It is a collective: every rank must reach the same step boundaries (true of DDP and FSDP loops). It never
    runs when the ``with`` block exits, so a rank that raised does not leave the others waiting in it.
    """

    def __init__(self, every: int, rank: int, world_size: int, stream: TextIO | None = None) -> None:
        self.every = every
        self.rank = rank
        self.world_size = world_size
        self.stream = stream
        self.pending: list[dict[str, np.ndarray]] = []
        self.reports: list[str] = []
        self.checks = 0

    def __call__(self, recording: Recording, n_chunks_before: int, closed_step: int, final: bool) -> None:
        """A step observer of the recording (:meth:`~nantrace._recording.Recording.add_step_observer`): called
        after a step was flushed; at every ``every``-th step runs the check (never when ``final``)."""
        store = recording.store
        if len(store.chunks) > n_chunks_before and store.step_rows.cols["n_nonfinite"][-1] > 0:
            self.pending.append(store.chunks[-1])
        if final or (closed_step + 1) % self.every != 0:
            return
        import torch.distributed as dist

        if not dist.is_available() or not dist.is_initialized():
            return
        self.check(store)

    def _flags(self, store: Store) -> torch.Tensor:
        """``[status, step, micro_step, phase, seq, module code, kind]``; status 0 clean, 1 produced here,
        2 received only through the reduction."""
        flags = torch.zeros(7, dtype=torch.int64)
        if not self.pending:
            return flags
        frame = store.frame(self.pending, plain=False)
        events = rank_events(frame, KINDS)
        self.pending = []
        if not events:
            return flags
        evs = sorted(events[min(events)], key=lambda e: e.key)
        produced = [e for e in evs if not e.received]
        e = produced[0] if produced else evs[0]
        step, micro, phase, seq, _ = e.key
        flags[:] = torch.tensor(
            [
                2 if e.received else 1,
                step,
                micro,
                phase,
                seq,
                store.modules.code(str(e.fields["module"])),
                _KIND_CODE[e.raw_kind],
            ],
            dtype=torch.int64,
        )
        return flags

    def check(self, store: Store) -> str | None:
        """One all-gather of every rank's flags; the line rank 0 prints (every rank keeps it in ``reports``)."""
        import torch.distributed as dist

        flags = self._flags(store).to(_device())
        gathered = [torch.zeros_like(flags) for _ in range(self.world_size)]
        dist.all_gather(gathered, flags)
        self.checks += 1
        rows = [g.cpu().tolist() for g in gathered]
        produced = [(r[1], r[2], r[3], r[4], rank) for rank, r in enumerate(rows) if r[0] == 1]
        kinds = list(_KIND_CODE)
        line = None
        if produced:
            step, _, phase, _, rank = min(produced)
            r = rows[rank]
            module = store.modules.values[r[5]] if 0 <= r[5] < len(store.modules.values) else f"#{r[5]}"
            pname = PHASES[phase]
            where = (
                "the model inputs"
                if pname == "data"
                else "the loss"
                if pname == "loss"
                else (f"`{module}`" if module else "the root model")
            )
            line = f"nantrace: rank {rank} produced {_WHAT[kinds[r[6]]]} in {where} at step {step} ({pname})"
        else:
            got = [rank for rank, r in enumerate(rows) if r[0] == 2]
            if got:
                step = min(rows[g][1] for g in got)
                line = (
                    f"nantrace: at step {step} rank{'s' if len(got) > 1 else ''} {', '.join(map(str, got))} "
                    "held non-finite gradients only after the gradient reduction; no rank produced one locally"
                )
        if line is not None:
            self.reports.append(line)
            if self.rank == 0:
                print(line, file=self.stream if self.stream is not None else sys.stderr, flush=True)
        return line


def _device() -> torch.device:
    """The device the default process group's collectives take tensors on (CPU for gloo)."""
    import torch.distributed as dist

    backend = str(dist.get_backend()).lower()
    if "gloo" in backend or "mpi" in backend or not torch.cuda.is_available():
        return torch.device("cpu")
    return torch.device("cuda", torch.cuda.current_device())
