"""Which samples of a batch held the bad values: for a data fault, the indices along the batch dimension (dim 0)
of the model inputs' rows that held NaN or ±inf, so the user can find the record in the loader.

A forward pre-hook on the root (after the recorder's own) looks at each floating model input of a training
micro-step. On the host path (CPU tensors) it reads one ``aminmax`` and, only for an input holding inf/NaN, the
per-sample flags. On the accelerator path nothing is read in the hook: a fixed-size device summary (the count
of bad samples and the first indices) joins the step's one host copy (``Store.flush``).
"""

from __future__ import annotations

from typing import Any

import torch

from ._stats import describable, is_clean_host
from ._tree import flatten

__all__ = ["MAX_SAMPLES", "SampleWatch", "bad_samples"]

MAX_SAMPLES = 8  # indices kept per input tensor (the count of bad samples is kept in full)


def bad_samples(t: torch.Tensor) -> torch.Tensor:
    """One bool per sample (``t.shape[0]``): the sample holds NaN or ±inf. A scalar is one sample."""
    x = t.detach()
    if x.dim() == 0:
        x = x.reshape(1)
    return (~torch.isfinite(x)).reshape(x.shape[0], -1).any(dim=1)


def summary(flags: torch.Tensor) -> torch.Tensor:
    """``[count, first indices...]`` (float64, ``1 + min(MAX_SAMPLES, len(flags))`` values) of per-sample flags,
    computed on their device without a host read (indices past the end mark unused slots)."""
    n = flags.numel()
    order = torch.where(
        flags, torch.arange(n, device=flags.device), torch.full_like(flags, n, dtype=torch.long)
    )
    first = order.sort().values[: min(MAX_SAMPLES, n)]
    return torch.cat([flags.sum().reshape(1), first]).double()


def _indices(flags: torch.Tensor) -> tuple[int, tuple[int, ...]]:
    idx = flags.nonzero().flatten()
    return int(idx.numel()), tuple(int(i) for i in idx[:MAX_SAMPLES].tolist())


class SampleWatch:
    """The per-sample flags of one recording's model inputs (see the module docstring).

    ``rows``: ``(rank, step, micro_step, tensor path, n_bad, first indices)`` of every model input that held
    inf/NaN.
    """

    def __init__(self, sync_free: bool, rank: int) -> None:
        self.sync_free = sync_free
        self.rank = rank
        self.rows: list[tuple[int, int, int, str, int, tuple[int, ...]]] = []
        self.pending: list[tuple[int, int, str, int]] = []  # step, micro-step, path, batch size

    def look(self, step: int, micro: int, args: Any, kwargs: Any, out: list[torch.Tensor]) -> None:
        """Called in the root's forward pre-hook of a recorded micro-step; device summaries go to ``out`` (the
        open step's ``PendingStep.samples``)."""
        for path, t in [*flatten(args, "input"), *flatten(kwargs, "input")]:
            if not describable(t):
                continue
            if t.device.type == "cpu" and not self.sync_free:
                if not is_clean_host(t):
                    n, first = _indices(bad_samples(t))
                    self.rows.append((self.rank, step, micro, path, n, first))
            else:
                flags = bad_samples(t)
                out.append(summary(flags))
                self.pending.append((step, micro, path, flags.numel()))

    def merge_leading_steps(self, count: int) -> None:
        """As ``Store.merge_leading_steps``: steps ``0 .. count-1`` (one root forward each) become micro-steps of
        step 0."""
        self.rows = [
            (r, 0, s + m, p, n, f) if s < count else (r, s, m, p, n, f) for r, s, m, p, n, f in self.rows
        ]

    def end_step(self, host: list[Any]) -> None:
        """After the step's flush: ``host`` holds the summaries of :meth:`look`, as host arrays, in order."""
        pending, self.pending = self.pending, []
        for (step, micro, path, size), values in zip(pending, host, strict=False):
            n = int(values[0])
            if n:
                first = tuple(int(v) for v in values[1:] if v < size)
                self.rows.append((self.rank, step, micro, path, n, first))
