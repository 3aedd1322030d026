"""The trace file format: one parquet file (pyarrow) per trace, or per rank part.

The file's table is ``records``. Its schema metadata holds, under the key ``b"nantrace"``, a JSON header
(format version, nantrace/torch/python versions, model class, dtypes, the arguments of ``trace``, rank and
world size, the run id all ranks of a distributed recording share, the time of the save ``saved_at``) and, as
base64 Arrow IPC streams, the ``steps`` and ``ops`` tables, so dtypes survive the round trip exactly.

This module encodes and decodes; :mod:`nantrace._io` saves and loads run views with it, and the recorder's
streaming writes the same footer.
"""

from __future__ import annotations

import base64
import json
import os
import platform
from collections.abc import Iterable, Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Protocol

import pandas as pd
import torch

from ._errors import NantraceError
from ._files import atomic_write
from ._schema import RECORD_COLUMNS
from ._store import canonical_records, canonical_steps, category_index, segment_dir

__all__ = [
    "FORMAT_VERSION",
    "MAGIC",
    "HeaderSource",
    "footer",
    "joined_records",
    "make_header",
    "read_header",
    "read_meta",
    "read_records",
    "read_trace",
    "segments",
    "segments_records",
    "streamed_records",
    "write_trace",
]

MAGIC = b"nantrace"
FORMAT_VERSION = 1  # bump on incompatible schema changes; a reader accepts files with the same major version


def _pa() -> Any:
    import pyarrow as pa
    import pyarrow.parquet as pq

    return pa, pq


def _ipc(df: pd.DataFrame) -> str:
    pa, _ = _pa()
    table = pa.Table.from_pandas(df, preserve_index=False)
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema) as w:
        w.write_table(table)
    return base64.b64encode(sink.getvalue().to_pybytes()).decode("ascii")


def from_ipc(text: str) -> pd.DataFrame:
    """A table written by the footer's Arrow IPC encoding, with categorical columns normalised."""
    pa, _ = _pa()
    reader = pa.ipc.open_stream(pa.py_buffer(base64.b64decode(text)))
    df = reader.read_all().to_pandas()
    for c in df.columns:  # categories of pandas' default string dtype, as the recorder builds them
        if isinstance(df[c].dtype, pd.CategoricalDtype):
            cats = df[c].cat.categories
            df[c] = pd.Categorical.from_codes(
                df[c].cat.codes.to_numpy(), categories=category_index([str(v) for v in cats]), validate=False
            )
    return df


class HeaderSource(Protocol):
    """What a trace file's header says of its run: a live ``Recording`` and a view's ``RunMeta`` both have it.

    ``bad_samples``: rows ``(rank, step, micro_step, tensor, n_bad, first indices)`` of the model inputs that held
    inf/NaN (:mod:`nantrace._samples`). ``builtin_modules``: the traced modules that run torch's own ``forward``
    (None: not known), which the explanations read, so a loaded trace words them as the live one did;
    ``untraced_modules``: the modules a ``modules=`` filter left out (empty without a filter; None: not known).
    """

    @property
    def model_class(self) -> str: ...
    @property
    def options(self) -> dict[str, Any]: ...
    @property
    def rank(self) -> int | None: ...
    @property
    def world_size(self) -> int: ...
    @property
    def run_id(self) -> str | None: ...
    @property
    def bad_samples(self) -> Iterable[Sequence[Any]]: ...
    @property
    def builtin_modules(self) -> Iterable[str] | None: ...
    @property
    def untraced_modules(self) -> Iterable[str] | None: ...


def make_header(run: HeaderSource, records: pd.DataFrame) -> dict[str, Any]:
    """The JSON header of a trace file of ``run`` whose rows are ``records`` (only its ``dtype`` column is read;
    ``saved_at`` is now)."""
    from ._version import __version__

    return {
        "format": FORMAT_VERSION,
        "nantrace": __version__,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "model_class": run.model_class,
        "dtypes": sorted({str(d) for d in records["dtype"].astype(str).unique()}) if len(records) else [],
        "options": run.options,
        "rank": run.rank,
        "world_size": run.world_size,
        # shared by every rank of one distributed recording (None in a single process): see nantrace._procgroup
        "run_id": run.run_id,
        "saved_at": datetime.now(timezone.utc).isoformat(timespec="microseconds"),
        "bad_samples": [[r, s, m, p, n, list(f)] for r, s, m, p, n, f in run.bad_samples],
        "builtin_modules": None if run.builtin_modules is None else sorted(run.builtin_modules),
        "untraced_modules": None if run.untraced_modules is None else sorted(run.untraced_modules),
    }


def footer(header: dict[str, Any], steps: pd.DataFrame, ops: pd.DataFrame) -> bytes:
    """The nantrace metadata of a trace file: JSON header, ``steps``/``ops`` as Arrow IPC, and ``sha256``, the
    digest of the three that :func:`read_meta` verifies (the records pages carry parquet page CRCs)."""
    meta = {"header": header, "steps": _ipc(steps), "ops": _ipc(ops)}
    return json.dumps({**meta, "sha256": _digest(meta)}).encode("utf-8")


_META_KEYS = ("header", "steps", "ops", "sha256")  # sha256 is absent in files written before it existed


def _digest(meta: dict[str, Any]) -> str:
    import hashlib

    text = json.dumps([meta["header"], meta["steps"], meta["ops"]], sort_keys=True)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def write_trace(
    target: Path, records: pd.DataFrame, steps: pd.DataFrame, ops: pd.DataFrame, header: dict[str, Any]
) -> Path:
    """Write one trace file at ``target``, atomically (:func:`nantrace._files.atomic_write`)."""
    pa, pq = _pa()
    table = pa.Table.from_pandas(records, preserve_index=False)
    schema_meta = dict(table.schema.metadata or {})
    schema_meta[MAGIC] = footer(header, steps, ops)
    table = table.replace_schema_metadata(schema_meta)
    return atomic_write(
        target, lambda f: pq.write_table(table, f, compression="zstd", write_page_checksum=True)
    )


def read_header(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The JSON header of a saved trace (versions, model class, dtypes, options) without reading the rows.

    Raises:
        FileNotFoundError: ``path`` does not exist.
        NantraceError: ``path`` is not a nantrace trace, or was written by an incompatible format version.
    """
    return dict(read_meta(path)["header"])


def read_meta(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The nantrace metadata of a trace file: ``header``, and ``steps``/``ops`` still encoded.

    Raises:
        TypeError: ``path`` is not a str or path-like.
        FileNotFoundError: ``path`` does not exist.
        NantraceError: not a trace file (a reproducer is named as such), damaged metadata, another format.
    """
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"path must be a str or os.PathLike; got {type(path).__name__}: {path!r:.80}")
    p = Path(path).expanduser()
    if not p.exists():
        segs = segments(p)
        if segs:
            return read_meta(segs[-1])
        raise FileNotFoundError(f"no such trace file: {str(p)!r}")
    _, pq = _pa()
    try:
        file_meta = pq.ParquetFile(p, page_checksum_verification=True).metadata.metadata
    except Exception as e:
        if _is_repro(p):
            raise NantraceError(
                f"{str(p)!r} is a nantrace reproducer (written by save_repro), not a trace: rebuild it with "
                "nantrace.load_repro(path)"
            ) from None
        raise NantraceError(
            f"{str(p)!r} is not a nantrace trace, or a damaged one (it does not read as parquet: {e})"
        ) from None
    raw = (file_meta or {}).get(MAGIC)
    if raw is None:
        raise NantraceError(f"{str(p)!r} is a parquet file but not a nantrace trace (no nantrace metadata)")
    try:
        meta = json.loads(raw.decode("utf-8"))
        fmt = int(meta["header"]["format"])
        keys = set(meta)
    except (ValueError, KeyError, TypeError) as e:
        raise NantraceError(f"{str(p)!r} has damaged nantrace metadata ({e})") from None
    if not set(_META_KEYS[:3]) <= keys or not keys <= set(
        _META_KEYS
    ):  # a renamed key: the checksum cannot be trusted
        raise NantraceError(
            f"{str(p)!r} has damaged nantrace metadata (keys {sorted(keys)}, expected {list(_META_KEYS)}); "
            "restore it from a copy"
        )
    if fmt != FORMAT_VERSION:
        raise NantraceError(
            f"{str(p)!r} was written in trace format {fmt} by nantrace {meta['header'].get('nantrace')}; "
            f"this nantrace reads format {FORMAT_VERSION}. Load it with a matching nantrace version."
        )
    if "sha256" in meta and meta["sha256"] != _digest(meta):
        raise NantraceError(
            f"{str(p)!r} is damaged: its nantrace metadata does not match its checksum (the file changed after "
            "it was written); restore it from a copy"
        )
    return dict(meta)


def _is_repro(p: Path) -> bool:
    """True when ``p`` is a ``torch.save`` zip archive holding a nantrace reproducer (read without unpickling)."""
    import zipfile

    try:
        with zipfile.ZipFile(p) as z:
            names = z.namelist()
            pkl = next((n for n in names if n.endswith("/data.pkl")), None)
            return pkl is not None and b"module_pickle" in z.read(pkl)
    except (OSError, zipfile.BadZipFile, KeyError):
        return False


def segments(path: Path) -> list[Path]:
    """The flushed segment files of a streamed trace at ``path`` that was not closed (a killed run), in order;
    empty when there are none. Temporary files of an interrupted segment write are not segments."""
    folder = segment_dir(path)
    if not folder.is_dir():
        return []
    return sorted(folder.glob("[0-9]*.nantrace"))


def read_records(path: str | os.PathLike[str]) -> pd.DataFrame:
    """The ``records`` table of a trace file (written by ``save`` or streamed with ``trace(path=...)``; the
    segments of a stream that was never closed).

    Raises:
        NantraceError: the file is damaged (a page fails its checksum, or it does not decode); names the file.
    """
    p = Path(path).expanduser()
    if not p.exists() and segments(p):
        return canonical_records(pd.concat([_plain_records(s) for s in segments(p)], ignore_index=True))
    return canonical_records(_plain_records(p))


def streamed_records(path: Path, in_memory: pd.DataFrame) -> pd.DataFrame:
    """Every record of a closed streaming recording: what reached ``path`` (the file, else its segments, else
    nothing when every write failed) followed by ``in_memory``, the rows never written."""
    if not path.exists() and not segments(path):
        return in_memory
    on_disk = read_records(path)
    if not len(in_memory):
        return on_disk
    return canonical_records(pd.concat([_plain(on_disk), _plain(in_memory)], ignore_index=True))


def segments_records(segs: list[Path]) -> pd.DataFrame:
    """The ``records`` of the given segment files of a stream still being written (in order), as one table."""
    return canonical_records(pd.concat([_plain_records(s) for s in segs], ignore_index=True))


def joined_records(on_disk: pd.DataFrame, in_memory: pd.DataFrame) -> pd.DataFrame:
    """``on_disk`` rows followed by ``in_memory`` rows, as one canonical ``records`` table."""
    if not len(in_memory):
        return on_disk
    if not len(on_disk):
        return in_memory
    return canonical_records(pd.concat([_plain(on_disk), _plain(in_memory)], ignore_index=True))


def _plain(df: pd.DataFrame) -> pd.DataFrame:
    out = df.copy()
    for c in out.columns:
        if isinstance(out[c].dtype, pd.CategoricalDtype):
            out[c] = out[c].astype(object).where(out[c].notna(), None)
    return out


_TEXT = ("phase", "module", "module_type", "tensor", "dtype", "shape", "parent", "arg")


def _check_types(table: Any) -> None:
    """Raise ``ValueError`` when a column has a type no nantrace writer gives it (a flipped type in a file)."""
    pa, _ = _pa()
    for f in table.schema:
        t = f.type.value_type if pa.types.is_dictionary(f.type) else f.type
        ok = (
            (pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_null(t))
            if f.name in _TEXT
            else (pa.types.is_integer(t) or pa.types.is_floating(t) or pa.types.is_boolean(t))
        )
        if not ok:
            raise ValueError(f"column {f.name!r} has type {f.type}")


def _plain_records(p: Path) -> pd.DataFrame:
    _, pq = _pa()
    try:
        table = pq.read_table(p, page_checksum_verification=True)
        _check_types(table)
        df = table.to_pandas(ignore_metadata=True)
        extra = sorted(set(df.columns) - set(RECORD_COLUMNS))
        missing = sorted(
            set(RECORD_COLUMNS) - set(df.columns) - {"rank", "reduced"}
        )  # older files lack those
        if extra or missing:
            raise ValueError(f"unexpected columns {extra}, missing {missing}")
    except FileNotFoundError:
        raise
    except Exception as e:  # pyarrow raises OSError or ArrowInvalid with no file name
        raise NantraceError(
            f"{str(p)!r} is damaged: its records do not read ({e}); restore it from a copy"
        ) from None
    return df


def read_trace(path: Path) -> tuple[pd.DataFrame, pd.DataFrame, pd.DataFrame, dict[str, Any]]:
    """``records, steps, ops, header`` of one trace file, or of the flushed segments of a streamed trace that
    was never closed (a ``UserWarning`` says so). See :func:`read_meta` and :func:`read_records` for what is
    raised."""
    meta = read_meta(path)  # checks the type of ``path`` first
    path = Path(path).expanduser()
    if not path.exists():
        return _read_segments(path)  # read_meta found its segments
    records = read_records(path)
    try:
        steps = from_ipc(meta["steps"])
        ops = from_ipc(meta["ops"])
    except Exception as e:
        raise NantraceError(f"{str(path)!r} is damaged: its steps/ops tables do not decode ({e})") from None
    return _finish(records, steps, ops, meta)


def _finish(
    records: pd.DataFrame, steps: pd.DataFrame, ops: pd.DataFrame, meta: dict[str, Any]
) -> tuple[pd.DataFrame, pd.DataFrame, pd.DataFrame, dict[str, Any]]:
    if "rank" not in steps.columns:  # written before the rank column existed: one process, rank 0
        steps["rank"] = pd.array([meta["header"].get("rank") or 0] * len(steps), dtype="int32")
    return records, canonical_steps(steps), ops, dict(meta["header"])


def _read_segments(path: Path) -> tuple[pd.DataFrame, pd.DataFrame, pd.DataFrame, dict[str, Any]]:
    """A streamed trace that was never closed, joined from its segments (each a complete trace file)."""
    import warnings

    segs = segments(path)
    metas = [read_meta(s) for s in segs]
    records = read_records(path)
    steps = pd.concat([from_ipc(m["steps"]) for m in metas], ignore_index=True)
    ops = pd.concat([from_ipc(m["ops"]) for m in metas], ignore_index=True)
    meta = dict(metas[-1])
    head = dict(meta["header"])
    head["dtypes"] = sorted({d for m in metas for d in m["header"].get("dtypes", [])})
    head["incomplete"] = True
    meta["header"] = head
    warnings.warn(
        f"{str(path)!r} was not closed (the run was killed?): loading the {len(steps)} step(s) flushed to "
        f"{len(segs)} segment(s) in {str(segment_dir(path))!r}; steps after the last flush are lost.",
        UserWarning,
        stacklevel=4,
    )
    return _finish(records, steps, ops, meta)
