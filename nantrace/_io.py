"""Saving and loading run views: one trace file (:mod:`nantrace._format`), or a folder of rank parts that
the ranks of a ``torch.distributed`` run saved into and that loads as one merged view.

Writes are atomic (:func:`nantrace._files.atomic_write`): an interrupted save leaves either the old file or
none, never a half-written one.

A part saved by an earlier run into the same folder (a rank that crashed before its save this time, or a part
copied in by hand) would otherwise be merged as if it belonged to this run. So each distributed recording has a
run id that all its ranks share (:func:`nantrace._procgroup.shared_run_id`). Each part's header holds it
(``run_id``) and the time of the save (``saved_at``, ISO 8601 UTC). ``load(folder)`` keeps the parts of the
newest run only (the run whose latest ``saved_at`` is newest; a part written without these fields, e.g. by an
older nantrace, counts as one run saved at its file's modification time) and warns which parts it ignored, then
warns about the ranks that run lacks.
"""

from __future__ import annotations

import os
import warnings
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import pandas as pd

from ._errors import NantraceError
from ._files import check_target
from ._format import from_ipc, make_header, read_meta, read_records, read_trace, write_trace
from ._procgroup import part_name, part_target
from ._procgroup import parts as rank_parts
from ._store import canonical_records
from ._view import RunView, loaded_view

__all__ = ["load_folder", "load_view", "refuse_non_trace", "save_view"]


def save_view(view: RunView, path: str | os.PathLike[str], *, recording: bool) -> Path:
    """Write ``view`` to ``path`` atomically; returns the path. See :meth:`nantrace.Trace.save`.

    ``recording``: the view is of a live recording; under torch.distributed with ``world_size > 1`` its rank
    then writes its part into a folder at ``path``."""
    m = view.meta
    if recording and m.world_size > 1 and m.rank is not None:
        target = part_target(path, m.rank, m.world_size)  # one part per rank in a folder at ``path``
    else:
        target = check_target(path)
    refuse_non_trace(target, "Trace.save")
    records = view.records
    head = make_header(m, records)
    return write_trace(target, records, view.steps, view.ops, head)


def refuse_non_trace(target: Path, who: str) -> None:
    """Raise ``NantraceError`` when ``target`` is an existing file that is not a readable nantrace trace (``who``
    names what would have replaced it: ``"Trace.save"``, ``"trace(path=...)"``), so no file of the user's is
    overwritten by a trace."""
    if not target.is_file():
        return
    try:
        read_meta(target)
    except NantraceError as e:
        raise NantraceError(
            f"path {str(target)!r} exists and is not a nantrace trace, so {who} does not replace it ({e}); "
            "choose another path, or delete the file first"
        ) from None


def load_view(path: str | os.PathLike[str]) -> RunView:
    """The run view of a trace file, or of a folder of rank parts (merged). See :func:`nantrace.load`."""
    if isinstance(path, (str, os.PathLike)):
        path = Path(path).expanduser()  # "~" is the home directory, as in a shell
        if path.is_dir():
            return loaded_view(*load_folder(path))
    return loaded_view(*read_trace(path))


def load_folder(path: Path) -> tuple[pd.DataFrame, pd.DataFrame, pd.DataFrame, dict[str, Any]]:
    """Read every rank part in ``path`` and merge them: ``records, steps, ops, header`` of one trace.

    Records, steps and ops of all ranks are concatenated (each row keeps its ``rank``); steps and ops are sorted
    by ``step`` then ``rank``. The header is rank 0's (else the lowest rank's) with ``rank`` = None,
    ``world_size`` and ``ranks``. Only the parts of the newest run are read (parts left over from another run
    give a ``UserWarning`` naming them); ranks missing from it give a ``UserWarning``; the trace still loads.

    Raises:
        NantraceError: no part in the folder, parts of several world sizes, or an unreadable part.
    """
    parts = rank_parts(path)
    if not parts:
        inside = Path(path) / "trace.nantrace"
        hint = f"; did you mean {str(inside)!r} (a `nantrace run` output folder)?" if inside.exists() else ""
        raise NantraceError(
            f"{str(path)!r} is a folder without nantrace rank parts (files named like {part_name(0, 2)!r})"
            + hint
        )
    metas = {p: read_meta(p) for _, _, p in parts}
    parts = _newest_run(path, parts, metas)
    worlds = sorted({w for _, w, _ in parts})
    if len(worlds) > 1:
        raise NantraceError(
            f"{str(path)!r} mixes parts of runs with world sizes {worlds}; keep the parts of one run only"
        )
    world = worlds[0]
    recs, steps, ops = [], [], []
    head: dict[str, Any] = {}
    samples: list[list[Any]] = []
    for rank, _, p in parts:
        meta = metas[p]
        if p.exists():
            r, s, o = read_records(p), from_ipc(meta["steps"]), from_ipc(meta["ops"])
        else:  # a rank killed while streaming: the segments it flushed (read_trace warns that it was not closed)
            r, s, o, _ = read_trace(p)
        r["rank"] = rank
        recs.append(r)
        s["rank"] = pd.array([rank] * len(s), dtype="int32")
        steps.append(s)
        o["rank"] = rank
        ops.append(o)
        if not head:
            head = dict(meta["header"])
        samples += [[rank, *b[1:]] for b in meta["header"].get("bad_samples", [])]
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
    head.update(
        rank=None, world_size=world, ranks=ranks, parts=[p.name for _, _, p in parts], bad_samples=samples
    )
    return records, steps_df.reset_index(drop=True), ops_df.reset_index(drop=True), head


def _newest_run(
    folder: Path, parts: list[tuple[int, int, Path]], metas: dict[Path, dict[str, Any]]
) -> list[tuple[int, int, Path]]:
    """The parts of the newest run in ``folder`` (see the module docstring); a ``UserWarning`` names the parts
    of other runs that are left out."""

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
