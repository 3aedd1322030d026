"""torch.distributed: the rank of a recording, per-rank trace files and their merge, the cross-rank locator, and
the optional live check.

Under an initialised default process group (``torch.distributed.init_process_group``) every rank records its own
trace; rows of ``records`` and ``steps`` carry that rank (0 without a process group).

Local and reduced gradients
---------------------------
Module-boundary gradients (``grad_input``/``grad_output``) and the parameter gradients seen by
``register_post_accumulate_grad_hook`` are *local*: DDP starts its bucket all-reduce only after those hooks ran,
so they hold what this rank's own data, forward, loss and backward computed. What the optimizer applies is the
gradient after DDP's all-reduce. With ``world_size > 1`` a trace records it once more per step, as ``backward``
rows ``<param>.grad`` with ``reduced=True``, at the first of ``scaler.unscale_()`` (also the one inside
``scaler.step()``) or the optimizer's step pre-hook (still scaled by the loss scale when a scaler is used). A
DTensor parameter (FSDP2 ``fully_shard``) receives its gradient only after the reduce-scatter, so its
post-accumulate rows are already ``reduced=True`` (this rank's shard); it is not recorded twice.

A non-finite value a rank holds only in ``reduced`` rows was *received* through the reduction (``propagated``),
not produced by that rank.

Cross-rank ordering rule
------------------------
Ranks run concurrently and their clocks are not comparable, so the merged locator orders each rank's own first
producer (from its local rows) by the key ``(step, micro_step, phase, seq, rank)``:

1. the same step first: within a step ranks exchange values only through the gradient reduction at the end of
   backward (and, under FSDP, parameter all-gathers that carry the previous step's optimizer result), so a
   value produced in step ``s`` cannot come from another rank's step ``s`` before that point;
2. then the pipeline phase order ``data → forward → loss → backward → optimizer`` (micro-step first, as on one
   rank): the earlier phase is upstream of everything after it;
3. then ``seq``, the position in the step's execution order: every rank runs the same program, so equal
   positions are the same tensor on every rank (on the in-between steps of ``every=N`` only non-finite tensors
   are numbered, so there the position is among those);
4. then the lowest rank: two ranks that produced the same event independently are both producers (nothing
   passed between them before the reduction), and the lowest rank is the deterministic choice.

When every rank's local rows are finite but the reduced gradients are not, the reduction itself produced the
value (e.g. a DDP communication hook that compresses gradients to float16): it is reported on the lowest rank
holding it, ``propagated=False``. A trace that holds only some of the ranks cannot tell the two apart and reports
such a value as ``propagated=True``.

Files
-----
Under a process group with ``world_size > 1``, ``Trace.save(path)`` makes ``path`` a folder and writes this
rank's part ``rank-RRRRR-of-WWWWW.nantrace`` into it (atomically, as a single-process save writes its file), so
every rank can pass the same path. ``nantrace.load(path)`` on the folder merges the parts into one read-only
trace.

A part saved by an earlier run into the same folder (a rank that crashed before its save this time, or a part
copied in by hand) would otherwise be merged as if it belonged to this run. So each distributed recording has a
run id that all its ranks share: creating the trace (``nantrace.trace`` under a process group with
``world_size > 1``) is a collective in which rank 0 makes a uuid and broadcasts it
(``torch.distributed.broadcast_object_list``). Each part's header holds it (``run_id``) and the time of the save
(``saved_at``, ISO 8601 UTC). ``load(folder)`` keeps the parts of the newest run only (the run whose latest
``saved_at`` is newest; a part written without these fields, e.g. by an older nantrace, counts as one run saved
at its file's modification time) and warns which parts it ignored, then warns about the ranks that run lacks.
"""

from __future__ import annotations

import os
import re
import sys
import warnings
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

import numpy as np
import pandas as pd
import torch

if TYPE_CHECKING:
    from ._diagnose import Diagnosis
    from ._locate import Overflow
    from ._store import Store
    from ._trace import Trace

__all__ = [
    "PART_RE",
    "Live",
    "find_across_ranks",
    "load_folder",
    "part_name",
    "part_target",
    "process_group",
    "shared_run_id",
]

PART_RE = re.compile(r"^rank-(\d{5})-of-(\d{5})\.nantrace$")
_WHAT = {"nan": "NaN", "posinf": "+inf", "neginf": "-inf"}
_KIND_CODE = {"nan": 0, "posinf": 1, "neginf": 2}


def shared_run_id() -> str:
    """A run id (32 hex digits) that every rank of the default process group shares: rank 0 makes a uuid4 and
    broadcasts it (``torch.distributed.broadcast_object_list``, a collective: every rank must call it)."""
    import uuid

    import torch.distributed as dist

    box: list[Any] = [uuid.uuid4().hex if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)
    return str(box[0])


def process_group() -> tuple[int, int]:
    """``(rank, world_size)`` of the initialised default process group, or ``(0, 1)`` without one."""
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        return 0, 1
    return int(dist.get_rank()), int(dist.get_world_size())


# ---------------------------------------------------------------------------------------------- files
def part_name(rank: int, world_size: int) -> str:
    """File name of one rank's part, e.g. ``rank-00001-of-00002.nantrace``."""
    return f"rank-{rank:05d}-of-{world_size:05d}.nantrace"


def _parts(folder: Path) -> list[tuple[int, int, Path]]:
    out = []
    for p in sorted(folder.iterdir()):
        m = PART_RE.match(p.name)
        if m and p.is_file():
            out.append((int(m.group(1)), int(m.group(2)), p))
    return out


def part_target(path: str | os.PathLike[str], rank: int, world_size: int) -> Path:
    """The part file this rank writes for ``save(path)``/``trace(path=...)``; creates the folder ``path``.

    Raises:
        TypeError: ``path`` is not a str or path-like.
        ValueError: ``path`` is an existing file (e.g. a single-process trace), its parent folder does not exist
            or is not writable, or the folder holds parts of a run with another world size.
    """
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"path must be a str or os.PathLike; got {type(path).__name__}: {path!r:.80}")
    folder = Path(path)
    parent = folder.parent if str(folder.parent) else Path(".")
    if folder.exists() and not folder.is_dir():
        raise ValueError(
            f"path {str(folder)!r} is an existing file, but under torch.distributed (rank {rank} of "
            f"{world_size}) every rank saves its part into a folder at that path; remove the file or pass "
            "another path"
        )
    if not parent.is_dir():
        raise ValueError(f"path {str(folder)!r}: directory {str(parent)!r} does not exist; create it first")
    if not os.access(parent, os.W_OK) and not folder.is_dir():
        raise ValueError(
            f"path {str(folder)!r}: directory {str(parent)!r} is not writable; choose another location"
        )
    folder.mkdir(exist_ok=True)  # every rank may create it at once
    other = sorted({w for _, w, _ in _parts(folder) if w != world_size})
    if other:
        raise ValueError(
            f"path {str(folder)!r} holds trace parts of a run with world size {other[0]} (this run has "
            f"{world_size} ranks); remove them or pass another path, so the runs' parts are not merged"
        )
    return folder / part_name(rank, world_size)


def load_folder(path: Path) -> tuple[pd.DataFrame, pd.DataFrame, pd.DataFrame, dict[str, Any]]:
    """Read every rank part in ``path`` and merge them: ``records, steps, ops, header`` of one trace.

    Records, steps and ops of all ranks are concatenated (each row keeps its ``rank``); steps and ops are sorted
    by ``step`` then ``rank``. The header is rank 0's (else the lowest rank's) with ``rank`` = None,
    ``world_size`` and ``ranks``. Only the parts of the newest run are read (parts left over from another run
    give a ``UserWarning`` naming them); ranks missing from it give a ``UserWarning``; the trace still loads.

    Raises:
        NantraceError: no part in the folder, parts of several world sizes, or an unreadable part.
    """
    from ._io import _from_ipc, _meta, read_records
    from ._store import canonical_records
    from ._trace import NantraceError

    parts = _parts(path)
    if not parts:
        inside = Path(path) / "trace.nantrace"
        hint = f"; did you mean {str(inside)!r} (a `nantrace run` output folder)?" if inside.exists() else ""
        raise NantraceError(
            f"{str(path)!r} is a folder without nantrace rank parts (files named like {part_name(0, 2)!r})"
            + hint
        )
    metas = {p: _meta(p) for _, _, p in parts}
    parts = _newest_run(path, parts, metas)
    worlds = sorted({w for _, w, _ in parts})
    if len(worlds) > 1:
        raise NantraceError(
            f"{str(path)!r} mixes parts of runs with world sizes {worlds}; keep the parts of one run only"
        )
    world = worlds[0]
    recs, steps, ops = [], [], []
    head: dict[str, Any] = {}
    for rank, _, p in parts:
        meta = metas[p]
        r = read_records(p)
        r["rank"] = rank
        recs.append(r)
        s = _from_ipc(meta["steps"])
        s["rank"] = pd.array([rank] * len(s), dtype="int32")
        steps.append(s)
        o = _from_ipc(meta["ops"])
        o["rank"] = rank
        ops.append(o)
        if not head:
            head = dict(meta["header"])
    ranks = [rank for rank, _, _ in parts]
    missing = sorted(set(range(world)) - set(ranks))
    if missing:
        warnings.warn(
            f"{str(path)!r} holds {len(ranks)} of {world} rank parts; ranks {missing} are missing (did they "
            "crash before Trace.save?). The merged trace covers the ranks present.",
            stacklevel=3,
        )
    records = canonical_records(
        pd.concat([_plain(r) for r in recs], ignore_index=True) if len(recs) > 1 else recs[0]
    )
    steps_df = pd.concat(steps, ignore_index=True).sort_values(["step", "rank"], kind="stable")
    ops_df = pd.concat(ops, ignore_index=True)
    if len(ops_df):
        ops_df = ops_df.sort_values(["step", "rank"], kind="stable")
    head.update(rank=None, world_size=world, ranks=ranks, parts=[p.name for _, _, p in parts])
    return records, steps_df.reset_index(drop=True), ops_df.reset_index(drop=True), head


def _newest_run(
    folder: Path, parts: list[tuple[int, int, Path]], metas: dict[Path, dict[str, Any]]
) -> list[tuple[int, int, Path]]:
    """The parts of the newest run in ``folder`` (see the module docstring); a ``UserWarning`` names the parts
    of other runs that are left out."""
    from datetime import datetime, timezone

    def saved(p: Path) -> datetime:
        text = metas[p]["header"].get("saved_at")
        if isinstance(text, str):
            try:
                return datetime.fromisoformat(text)
            except ValueError:
                pass
        return datetime.fromtimestamp(p.stat().st_mtime, timezone.utc)

    runs: dict[str | None, list[tuple[int, int, Path]]] = {}
    for part in parts:
        rid = metas[part[2]]["header"].get("run_id")
        runs.setdefault(rid if isinstance(rid, str) else None, []).append(part)
    if len(runs) == 1:
        return parts
    last = {rid: max(saved(p) for _, _, p in ps) for rid, ps in runs.items()}
    newest = max(runs, key=lambda rid: last[rid])
    kept = runs[newest]
    ignored = sorted(p.name for rid, ps in runs.items() if rid != newest for _, _, p in ps)

    def run_name(rid: str | None) -> str:
        return f"run {rid}" if rid is not None else "a run without run id"

    others = "; ".join(
        f"{', '.join(p.name for _, _, p in runs[rid])} ({run_name(rid)}, saved {last[rid]:%Y-%m-%d %H:%M:%S} UTC)"
        for rid in sorted((r for r in runs if r != newest), key=lambda r: last[r])
    )
    warnings.warn(
        f"{str(folder)!r} holds parts of {len(runs)} runs: loading the newest, {run_name(newest)} (saved "
        f"{last[newest]:%Y-%m-%d %H:%M:%S} UTC, {len(kept)} part(s)), and ignoring {len(ignored)} part(s) left "
        f"over from another run: {others}. Delete them, or save each run to a new path.",
        stacklevel=4,
    )
    return kept


def _plain(df: pd.DataFrame) -> pd.DataFrame:
    """Categorical columns as plain strings, so parts with different categories concatenate."""
    out = df.copy()
    for c in out.columns:
        if isinstance(out[c].dtype, pd.CategoricalDtype):
            out[c] = out[c].astype(object).where(out[c].notna(), None)
    return out


# ---------------------------------------------------------------------------------------------- locator
@dataclass
class _Event:
    """One rank's first non-finite value in one step."""

    key: tuple[int, int, int, int, int]  # (step, micro_step, phase order, seq, rank)
    overflow: Overflow
    raw_kind: str  # nan, posinf, neginf
    received: bool  # only in reduced rows


def _rank_events(
    records: pd.DataFrame,
    wanted: tuple[str, ...],
    steps: pd.DataFrame | None,
    ops: pd.DataFrame | None,
    world_size: int | None,
) -> dict[int, list[_Event]]:
    """Per step: every rank's first producer (local rows), or its first received value (reduced rows only)."""
    from ._locate import _PHASE_RANK, Overflow, _candidates, _first_in_step, _producer, overflow_fields
    from ._report import explain

    out: dict[int, list[_Event]] = {}
    if "reduced" not in records.columns:
        records = records.assign(reduced=False)
    ranks = sorted(int(r) for r in pd.unique(records["rank"]))
    multi = len(ranks) > 1
    for r in ranks:
        rec_r = records[records["rank"].to_numpy() == r] if multi else records
        reduced = rec_r["reduced"].to_numpy(dtype=bool)
        local_r = rec_r[~reduced]
        steps_r = steps
        if steps is not None and multi and "rank" in steps.columns:
            steps_r = steps[steps["rank"].to_numpy() == r]
        ops_r = ops
        if ops is not None and len(ops) and "rank" in ops.columns:
            ops_r = ops[ops["rank"].to_numpy() == r]
        cand = set(_candidates(rec_r, wanted).tolist())
        if ops_r is not None and len(ops_r):
            cand |= set(ops_r.loc[ops_r["kind"].isin(wanted), "step"].tolist())
        for step in sorted(cand):
            step_all = rec_r[rec_r["step"].to_numpy() == step]
            step_local = step_all[~step_all["reduced"].to_numpy(dtype=bool)]
            step_ops = ops_r[ops_r["step"] == step] if ops_r is not None and len(ops_r) else None
            hit = _first_in_step(step_local, wanted, step_ops) if len(step_local) else None
            red = step_all[step_all["reduced"].to_numpy(dtype=bool)]
            red_hit = _first_in_step(red, wanted) if len(red) else None
            received = False
            if red_hit is not None and (hit is None or str(hit[0]["phase"]) == "optimizer"):
                # nothing local before the reduction: what the rank holds came through it (parameters that
                # optimizer.step() made non-finite from a non-finite reduced gradient were not produced here)
                hit, received = red_hit, True
            if hit is None:
                continue
            row, k, op = hit
            producer = (
                (str(row["module"]), str(row["module_type"]), int(row["call"]), str(row["tensor"]))
                if received
                else _producer(step_local, row)
            )
            fields = overflow_fields(row, k, producer)
            if received:
                message = _received_text(fields, k, r, world_size)
            else:
                message = explain(local_r, step_local, row, fields, k, steps_r, op)
            ov = Overflow(**fields, message=message, rank=r, propagated=received)
            key = (int(step), int(row["micro_step"]), _PHASE_RANK[str(row["phase"])], int(row["seq"]), r)
            out.setdefault(int(step), []).append(_Event(key, ov, k, received))
    return out


def _received_text(fields: dict[str, Any], raw_kind: str, rank: int, world_size: int | None) -> str:
    name = f"`{fields['module']}`" if fields["module"] else "the root model"
    of = f" of {world_size}" if world_size else ""
    return (
        f"At step {fields['step']}, rank {rank}{of} computed finite local gradients, but `{fields['tensor']}` of "
        f"{name} held {_WHAT[raw_kind]} after the gradient reduction (DDP all-reduce / FSDP reduce-scatter): "
        f"rank {rank} received it and did not produce it. Load the parts of every rank (nantrace.load on the "
        "path all ranks saved to) to name the rank that produced it."
    )


def find_across_ranks(
    records: pd.DataFrame,
    wanted: tuple[str, ...],
    steps: pd.DataFrame | None,
    first_only: bool,
    ops: pd.DataFrame | None,
    world_size: int | None,
    per_rank: bool,
) -> list[Overflow]:
    """The locator over records of one or more ranks (see the module docstring for the ordering rule).

    ``per_rank=False``: for each step, the cross-rank first producer; ``per_rank=True``: for each step, every
    rank's own first non-finite value (``propagated=True`` where the rank only received it).
    """
    events = _rank_events(records, wanted, steps, ops, world_size)
    ranks = sorted(int(r) for r in pd.unique(records["rank"]))
    complete = len(ranks) == world_size if world_size is not None else len(ranks) > 1
    found: list[Overflow] = []
    for step in sorted(events):
        evs = sorted(events[step], key=lambda e: e.key)
        if per_rank:
            mine = sorted(evs, key=lambda e: e.key[-1])
            if complete and all(e.received for e in evs):
                # the reduction itself produced it: the rank the merged answer names is its producer
                mine[0] = replace(mine[0], overflow=_made_by_reduction(mine[0], evs))
            found.extend(e.overflow for e in mine)
        else:
            produced = [e for e in evs if not e.received]
            if produced:
                best = produced[0]
                got = [e.key[-1] for e in evs if e.received]
                note = ""
                if len(ranks) > 1:
                    note = f"Rank {best.key[-1]} of {world_size or len(ranks)} produced it. "
                tail = ""
                if got:
                    who = ", ".join(map(str, got))
                    tail = (
                        f" Rank{'s' if len(got) > 1 else ''} {who} only received it through the gradient "
                        "reduction (propagated, not produced)."
                    )
                found.append(replace(best.overflow, message=note + best.overflow.message + tail))
            else:
                first = min(evs, key=lambda e: e.key[-1])
                if complete:
                    found.append(_made_by_reduction(first, evs))
                else:
                    found.append(first.overflow)
        if first_only and found:
            break
    return found


def _made_by_reduction(first: _Event, evs: list[_Event]) -> Overflow:
    """``first`` (the lowest rank's event) as the producer of a value the reduction itself made."""
    ov = first.overflow
    name = f"`{ov.module}`" if ov.module else "the root model"
    msg = (
        f"At step {ov.step} every rank's local gradients were finite, but `{ov.tensor}` of {name} "
        f"held {_WHAT[first.raw_kind]} after the gradient reduction on "
        f"rank{'s' if len(evs) > 1 else ''} {', '.join(str(e.key[-1]) for e in evs)}: the "
        "reduction itself produced it (e.g. a communication hook that compresses gradients "
        "to float16, whose max is 65504). Reduce in float32 or scale gradients down first."
    )
    return replace(ov, propagated=False, message=msg)


def diagnose_merged(tr: Trace) -> Diagnosis:
    """:func:`nantrace._diagnose.diagnose` of the rank that produced the first non-finite value (rank 0 of a
    healthy run), with the rank named in its summary and evidence. The merged events tell it which of that
    rank's received values the reduction itself made, and which rank produced the others."""
    from ._diagnose import _diagnose, _overflow_from_row

    ov = tr.first_overflow()
    rank = ov.rank if ov is not None else min(tr.ranks)
    merged = [_overflow_from_row(r) for r in tr.overflows().to_dict("records")]
    d = _diagnose(tr.rank_view(rank), merged)
    evidence = [f"rank {rank} of {tr.world_size}: the diagnosis reads this rank's trace", *d.evidence]
    overflow = replace(d.overflow, rank=rank) if d.overflow is not None else None
    summary = f"Rank {rank}: {d.summary}" if d.summary else d.summary
    return replace(d, overflow=overflow, evidence=evidence, summary=summary)


# ---------------------------------------------------------------------------------------------- live mode
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

    def after_step(self, store: Store, n_chunks_before: int, closed_step: int, final: bool) -> None:
        """Called after a step was flushed; at every ``every``-th step runs the check (never when ``final``)."""
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
        from ._locate import KINDS

        flags = torch.zeros(7, dtype=torch.int64)
        if not self.pending:
            return flags
        frame = store._frame(self.pending, plain=False)
        events = _rank_events(frame, KINDS, None, None, self.world_size)
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
                store.modules.code(e.overflow.module),
                _KIND_CODE[e.raw_kind],
            ],
            dtype=torch.int64,
        )
        return flags

    def check(self, store: Store) -> str | None:
        """One all-gather of every rank's flags; the line rank 0 prints (every rank keeps it in ``reports``)."""
        import torch.distributed as dist

        from ._store import PHASES

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
