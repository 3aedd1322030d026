"""Saving and loading traces: one parquet file (pyarrow) per trace.

The file's table is ``records``. Its schema metadata holds, under the key ``b"nantrace"``, a JSON header
(format version, nantrace/torch/python versions, model class, dtypes, the arguments of ``trace``, rank and
world size, the run id all ranks of a distributed recording share, the time of the save ``saved_at``) and, as
base64 Arrow IPC streams, the ``steps`` and ``ops`` tables, so dtypes survive the round trip exactly.

Writes are atomic: the file is written to a temporary name in the target directory, flushed to disk, then
renamed over the target (``os.replace``), so an interrupted save leaves either the old file or none, never a
half-written one.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import platform
import tempfile
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO

import pandas as pd
import torch

from ._store import canonical_records, category_index

if TYPE_CHECKING:
    from ._trace import Trace

__all__ = ["FORMAT_VERSION", "MAGIC", "load", "read_header", "save"]

MAGIC = b"nantrace"
FORMAT_VERSION = 1  # bump on incompatible schema changes; a reader accepts files with the same major version


def _pa() -> Any:
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError as e:  # pragma: no cover - pyarrow is a core dependency
        raise ImportError("saving and loading traces needs pyarrow: pip install pyarrow") from e
    return pa, pq


def _ipc(df: pd.DataFrame) -> str:
    pa, _ = _pa()
    table = pa.Table.from_pandas(df, preserve_index=False)
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema) as w:
        w.write_table(table)
    return base64.b64encode(sink.getvalue().to_pybytes()).decode("ascii")


def _from_ipc(text: str) -> pd.DataFrame:
    pa, _ = _pa()
    reader = pa.ipc.open_stream(pa.py_buffer(base64.b64decode(text)))
    return _normalise(reader.read_all().to_pandas())


def _normalise(df: pd.DataFrame) -> pd.DataFrame:
    """Categorical columns with categories of pandas' default string dtype, as the recorder builds them."""
    for c in df.columns:
        if isinstance(df[c].dtype, pd.CategoricalDtype):
            cats = df[c].cat.categories
            df[c] = pd.Categorical.from_codes(
                df[c].cat.codes.to_numpy(), categories=category_index([str(v) for v in cats]), validate=False
            )
    return df


def _check_target(path: str | os.PathLike[str]) -> Path:
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"path must be a str or os.PathLike; got {type(path).__name__}: {path!r:.80}")
    p = Path(path).expanduser()  # "~/x.nantrace" is the home directory, as in a shell
    if p.is_dir():
        raise ValueError(
            f"path {str(p)!r} is a directory; give a file name such as {str(p / 'trace.nantrace')!r}"
        )
    parent = p.parent if str(p.parent) else Path(".")
    if not parent.is_dir():
        raise ValueError(f"path {str(p)!r}: directory {str(parent)!r} does not exist; create it first")
    if not os.access(parent, os.W_OK):
        raise ValueError(
            f"path {str(p)!r}: directory {str(parent)!r} is not writable; choose another location"
        )
    return p


def header(tr: Trace, records: pd.DataFrame | None = None) -> dict[str, Any]:
    from . import __version__

    rec = tr.records if records is None else records
    return {
        "format": FORMAT_VERSION,
        "nantrace": __version__,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "model_class": tr._model_class,
        "dtypes": sorted({str(d) for d in rec["dtype"].astype(str).unique()}) if len(rec) else [],
        "options": tr.options,
        "rank": getattr(tr, "rank", 0),
        "world_size": getattr(tr, "world_size", 1),
        # shared by every rank of one distributed recording (None in a single process): see nantrace._dist
        "run_id": getattr(tr, "_run_id", None),
        "saved_at": datetime.now(timezone.utc).isoformat(timespec="microseconds"),
    }


def footer(tr: Trace, records: pd.DataFrame | None = None) -> bytes:
    """The nantrace metadata of a trace file: JSON header, and ``steps``/``ops`` as Arrow IPC."""
    head = header(tr, records)
    return json.dumps({"header": head, "steps": _ipc(tr.steps), "ops": _ipc(tr.ops)}).encode("utf-8")


def save(tr: Trace, path: str | os.PathLike[str]) -> Path:
    """Write ``tr`` to ``path`` atomically; returns the path. See :meth:`nantrace.Trace.save`."""
    pa, pq = _pa()
    if not tr._read_only and tr.world_size > 1 and tr.rank is not None:
        from ._dist import part_target  # one part per rank in a folder at ``path``

        target = part_target(path, tr.rank, tr.world_size)
    else:
        target = _check_target(path)
    records = tr.records
    table = pa.Table.from_pandas(records, preserve_index=False)
    schema_meta = dict(table.schema.metadata or {})
    schema_meta[MAGIC] = footer(tr, records)
    table = table.replace_schema_metadata(schema_meta)
    return atomic_write(target, lambda f: pq.write_table(table, f, compression="zstd"))


def atomic_write(target: Path, write: Callable[[BinaryIO], object]) -> Path:
    """Call ``write(f)`` on a temporary file next to ``target``, flush it to disk, then rename it over
    ``target`` (``os.replace``): an interrupted write leaves the old file or none, never a half-written one.
    The file gets the ordinary mode (0666 minus the umask); the temporary file is removed on any error."""
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # mkstemp creates 0600
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    return target


def read_header(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The JSON header of a saved trace (versions, model class, dtypes, options) without reading the rows.

    Raises:
        FileNotFoundError: ``path`` does not exist.
        NantraceError: ``path`` is not a nantrace trace, or was written by an incompatible format version.
    """
    return _meta(path)["header"]


def _meta(path: str | os.PathLike[str]) -> dict[str, Any]:
    from ._trace import NantraceError

    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"path must be a str or os.PathLike; got {type(path).__name__}: {path!r:.80}")
    p = Path(path).expanduser()
    if not p.exists():
        raise FileNotFoundError(f"no such trace file: {str(p)!r}")
    _, pq = _pa()
    try:
        file_meta = pq.ParquetFile(p).metadata.metadata
    except Exception as e:
        if _is_repro(p):
            raise NantraceError(
                f"{str(p)!r} is a nantrace reproducer (written by save_repro), not a trace: rebuild it with "
                "nantrace.load_repro(path)"
            ) from None
        raise NantraceError(f"{str(p)!r} is not a nantrace trace (not a parquet file: {e})") from None
    raw = (file_meta or {}).get(MAGIC)
    if raw is None:
        raise NantraceError(f"{str(p)!r} is a parquet file but not a nantrace trace (no nantrace metadata)")
    try:
        meta = json.loads(raw.decode("utf-8"))
        fmt = int(meta["header"]["format"])
    except (ValueError, KeyError, TypeError) as e:
        raise NantraceError(f"{str(p)!r} has damaged nantrace metadata ({e})") from None
    if fmt != FORMAT_VERSION:
        raise NantraceError(
            f"{str(p)!r} was written in trace format {fmt} by nantrace {meta['header'].get('nantrace')}; "
            f"this nantrace reads format {FORMAT_VERSION}. Load it with a matching nantrace version."
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


def read_records(path: str | os.PathLike[str]) -> pd.DataFrame:
    """The ``records`` table of a trace file (written by ``save`` or streamed with ``trace(path=...)``)."""
    _, pq = _pa()
    return canonical_records(pq.read_table(Path(path).expanduser()).to_pandas())


def load(path: str | os.PathLike[str]) -> Trace:
    """Read a trace written by :meth:`Trace.save` as a read-only :class:`~nantrace.Trace`.

    Its ``records``, ``steps``, ``ops``, ``first_overflow()``, ``overflows()`` and reprs equal the original's.

    A folder that the ranks of a ``torch.distributed`` run saved into (same ``path`` on every rank) loads as one
    trace merged from all rank parts: every row keeps its ``rank``, and the locator works across ranks. Only the
    parts of the newest run (by their header's ``run_id`` and ``saved_at``) are merged: parts left over from
    another run in the folder are ignored with a ``UserWarning`` naming them, and ranks missing from the newest
    run give another ``UserWarning``.

    Raises:
        FileNotFoundError: ``path`` does not exist.
        NantraceError: ``path`` is not a trace (a nantrace reproducer is named as such: rebuild it with
            :func:`nantrace.load_repro`), or comes from an incompatible format version; a folder without
            rank parts, or with parts of several world sizes.
    """
    from ._trace import Trace

    if isinstance(path, (str, os.PathLike)):
        path = Path(path).expanduser()  # "~" is the home directory, as in a shell
        if path.is_dir():
            from ._dist import load_folder

            return Trace._from_saved(*load_folder(path))

    meta = _meta(path)
    _, _pq = _pa()
    records = read_records(path)
    steps = _from_ipc(meta["steps"])
    if "rank" not in steps.columns:  # written before the rank column existed: one process, rank 0
        steps["rank"] = pd.array([meta["header"].get("rank") or 0] * len(steps), dtype="int32")
    ops = _from_ipc(meta["ops"])
    return Trace._from_saved(records, steps, ops, meta["header"])
