"""The plain, read-only run view every analysis takes: a recording, a loaded file and one rank of a merged
trace are all a :class:`RunView`, so they give the same answers by construction.

A view holds the three tables (``records``, ``steps``, ``ops``, served as they are: analysis never changes
them), the run's :class:`RunMeta`, and, only while a recording's model is alive, a narrow :class:`LiveModel`
handle (whether a module runs torch's own forward, whether a ``modules=`` filter left submodules of it out, the
absmax of its own parameters) plus the recording's capture state. Nothing else of the recording is reachable.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any

import pandas as pd
import torch
from torch import nn

from ._capture import Capture
from ._naming import module_names, torch_builtin
from ._recording import Recording
from ._schema import dtype_max

__all__ = ["LiveModel", "RunMeta", "RunView", "loaded_view", "view_of"]


@dataclass(frozen=True)
class RunMeta:
    """What a run view knows besides its tables.

    Attributes:
        model_class: the traced model's class name (``"GPT"``, or ``"GPT (in DistributedDataParallel)"``).
        options: the arguments of ``trace`` as recorded (``Trace.options``).
        header: a loaded file's JSON header (empty while recording).
        rank: the rank this view's rows come from; None for a merged view of several ranks.
        world_size: ranks of the run (1 without a process group).
        run_id: the id all ranks of one distributed recording share (None in a single process).
        ranks: the ranks whose rows the view holds.
        bad_samples: ``(rank, step, micro_step, tensor, n_bad, first indices)`` for each model input that held
            inf/NaN: which samples along the batch dimension (:mod:`nantrace._samples`).
        builtin_modules: the traced modules that run torch's own ``forward`` (``nn.Linear``, not a hand-written
            class that shares a torch name such as ``RMSNorm``), recorded while the model lived; None when not
            known (a file written before it was recorded).
        untraced_modules: the modules of the model that a ``modules=`` filter left untraced (empty without a
            filter); None when not known.
    """

    model_class: str
    options: dict[str, Any]
    header: dict[str, Any]
    rank: int | None
    world_size: int
    run_id: str | None
    ranks: tuple[int, ...]
    bad_samples: tuple[tuple[int, int, int, str, int, tuple[int, ...]], ...] = ()
    builtin_modules: frozenset[str] | None = None
    untraced_modules: frozenset[str] | None = None

    def hides_submodules_of(self, name: str) -> bool | None:
        """True when a ``modules=`` filter left a submodule of ``name`` untraced (None: not known)."""
        if self.untraced_modules is None:
            return None
        prefix = f"{name}." if name else ""
        return any(n.startswith(prefix) and n != name for n in self.untraced_modules)


class LiveModel:
    """A narrow handle on the live model of a recording (held weakly: analysis never keeps it alive)."""

    def __init__(self, model: nn.Module, traced: set[str], filtered: bool) -> None:
        self._by_name = dict(module_names(model))
        self._traced = traced
        self._filtered = filtered

    def builtin(self, name: str) -> bool | None:
        """Whether module ``name`` runs torch's own ``forward`` (None: no such module)."""
        m = self._by_name.get(name)
        return None if m is None else torch_builtin(m)

    def hides_submodules_of(self, name: str) -> bool:
        """True when a ``modules=`` filter left a submodule of ``name`` untraced."""
        if not self._filtered:
            return False
        prefix = f"{name}." if name else ""
        return any(n.startswith(prefix) and n != name and n not in self._traced for n in self._by_name)

    def params_nonfinite(self, name: str) -> list[tuple[str, str]]:
        """The own parameters of module ``name`` that hold NaN or inf now: ``(parameter, "nan" | "inf")``. One
        on-device reduction and one host read per parameter of that one module."""
        m = self._by_name.get(name)
        if m is None:
            return []
        out: list[tuple[str, str]] = []
        with torch.no_grad():
            for pname, p in m.named_parameters(recurse=False):
                if (
                    type(p) not in (torch.Tensor, nn.Parameter)
                    or not p.is_floating_point()
                    or p.numel() == 0
                    or p.is_meta
                ):
                    continue
                total = float(p.detach().sum(dtype=torch.float64).item())  # NaN or ±inf when some value is
                if not math.isfinite(total):
                    out.append((pname, "nan" if bool(torch.isnan(p).any()) else "inf"))
        return out

    def params_beyond(self, name: str, limit: float) -> list[tuple[str, str, float, int]]:
        """The own parameters of module ``name`` whose finite absmax exceeds ``limit`` while their dtype is wider
        than the limit's: ``(parameter, dtype, absmax, -1)``, largest first. One on-device reduction
        (``torch.linalg.vector_norm(p, inf)``, no copy) and one host read per parameter of that one module."""
        m = self._by_name.get(name)
        if m is None:
            return []
        out: list[tuple[str, str, float, int]] = []
        with torch.no_grad():
            for pname, p in m.named_parameters(recurse=False):
                if (
                    type(p)
                    not in (torch.Tensor, nn.Parameter)  # a DTensor shard: a reduction may be collective
                    or not p.is_floating_point()
                    or p.numel() == 0
                    or p.is_meta
                    or dtype_max(str(p.dtype).removeprefix("torch.")) <= limit
                ):
                    continue
                a = float(torch.linalg.vector_norm(p.detach(), ord=math.inf).item())
                if math.isfinite(a) and a > limit:
                    out.append((pname, str(p.dtype).removeprefix("torch."), a, -1))
        return sorted(out, key=lambda t: -t[2])


@dataclass(frozen=True)
class RunView:
    """One run's tables and facts, read-only (see the module docstring).

    Attributes:
        records: ``records`` (columns of ``nantrace._schema.RECORD_COLUMNS``).
        steps: ``steps`` (``STEP_COLUMNS``).
        ops: the forward drill-down (``step, micro_step, module, call, op, kind``; plus ``rank`` when merged).
        meta: :class:`RunMeta`.
        model: the live model's handle, or None (a loaded trace, a model gone).
        capture: the recording's capture state (``trace(capture=...)``), or None.
    """

    records: pd.DataFrame
    steps: pd.DataFrame
    ops: pd.DataFrame
    meta: RunMeta
    model: LiveModel | None = None
    capture: Capture | None = field(default=None, compare=False)

    def rank_view(self, rank: int) -> RunView:
        """The rows of one rank, as a view of its own (no live model: the other ranks' model is not here)."""

        def pick(df: pd.DataFrame) -> pd.DataFrame:
            if "rank" not in df.columns or not len(df):
                return df
            return df[df["rank"].to_numpy() == rank].reset_index(drop=True)

        mine = tuple(b for b in self.meta.bad_samples if b[0] == rank)
        meta = replace(
            self.meta, rank=rank, ranks=(rank,), header=dict(self.meta.header, rank=rank), bad_samples=mine
        )
        return RunView(pick(self.records), pick(self.steps), pick(self.ops), meta)


def view_of(rec: Recording, records: pd.DataFrame | None = None) -> RunView:
    """The run view of a recording: its closed steps (``records`` overrides the in-memory rows, e.g. those read
    back from a streamed file)."""
    model = rec.model_ref()
    live = None
    if model is not None:
        live = LiveModel(model, {n for n, _ in rec.selected}, rec.options.get("modules") is not None)
    meta = RunMeta(
        model_class=rec.model_class,
        options=rec.options,
        header={},
        rank=rec.rank,
        world_size=rec.world_size,
        run_id=rec.run_id,
        ranks=(rec.rank,),
        bad_samples=tuple(rec.samples.rows),
        builtin_modules=rec.builtin_modules,
        untraced_modules=rec.untraced_modules,
    )
    rows = rec.store.records() if records is None else records
    return RunView(rows, rec.store.steps(), rec.store.ops_frame(), meta, live, rec.capture)


def loaded_view(
    records: pd.DataFrame, steps: pd.DataFrame, ops: pd.DataFrame, header: dict[str, Any]
) -> RunView:
    """The run view of tables read from a file (or merged from rank parts: ``header["ranks"]``)."""
    rank = header.get("rank", 0)
    if "ranks" in header:
        ranks = tuple(int(r) for r in header["ranks"])
    elif rank is not None:
        ranks = (int(rank),)
    else:
        ranks = tuple(sorted(int(r) for r in pd.unique(records["rank"]))) if len(records) else (0,)
    meta = RunMeta(
        model_class=str(header.get("model_class", "?")),
        options=dict(header.get("options", {})),
        header=dict(header),
        rank=None if rank is None else int(rank),
        world_size=int(header.get("world_size", 1) or 1),
        run_id=header.get("run_id"),
        ranks=ranks,
        bad_samples=tuple(
            (int(r), int(s), int(m), str(p), int(n), tuple(int(i) for i in f))
            for r, s, m, p, n, f in header.get("bad_samples", [])
        ),
        builtin_modules=None
        if header.get("builtin_modules") is None
        else frozenset(header["builtin_modules"]),
        untraced_modules=None
        if header.get("untraced_modules") is None
        else frozenset(header["untraced_modules"]),
    )
    return RunView(records, steps, ops, meta)
