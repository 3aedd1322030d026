"""Per-step buffers turned into pandas tables: the one module that copies recorded data to the host.

Hooks append one row of metadata (small Python ints) and one statistics item per recorded tensor. A statistics
item is either a float64 device tensor of shape ``(8,)`` (accelerator path, not yet read) or a tuple of floats
(CPU path). At the step boundary :meth:`Store.flush` stacks every pending device tensor of the step together
with the step's scalar tensors (loss, loss scale, gradient norms) and copies them to the host in **one**
transfer (:func:`to_host`), then appends compact numpy columns to the in-memory table. The DataFrames are built
lazily and cached until the next flush.
"""

from __future__ import annotations

import math
from array import array
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import torch

from ._files import atomic_write
from ._schema import META_COLUMNS, N_STATS, PHASES, RECORD_COLUMNS, RECORDED, STAT_NAMES, STEP_COLUMNS

__all__ = [
    "Interner",
    "PendingStep",
    "StepRows",
    "Store",
    "canonical_records",
    "canonical_steps",
    "category_index",
    "segment_dir",
    "to_host",
]


def to_host(tensors: Sequence[torch.Tensor]) -> np.ndarray:
    """Concatenate flattened ``tensors`` (any devices) into one float64 numpy vector, copying once per device.

    This is the only place nantrace reads tensor values recorded by hooks.
    """
    if not tensors:
        return np.zeros(0, dtype=np.float64)
    by_device: dict[torch.device, list[int]] = {}
    for i, t in enumerate(tensors):
        by_device.setdefault(t.device, []).append(i)
    sizes = [t.numel() for t in tensors]
    offsets = np.concatenate([[0], np.cumsum(sizes)])
    out = np.empty(int(offsets[-1]), dtype=np.float64)
    for idxs in by_device.values():
        by_dtype: dict[torch.dtype, list[int]] = {}
        for i in idxs:  # one cat per dtype, so every value is widened once, exactly (no promotion to float16)
            by_dtype.setdefault(tensors[i].dtype, []).append(i)
        order = [i for group in by_dtype.values() for i in group]
        with torch.no_grad():  # no detach per tensor: nothing here is recorded by autograd
            parts = [
                torch.cat([tensors[i].reshape(-1) for i in g]).to(torch.float64) for g in by_dtype.values()
            ]
            flat = (parts[0] if len(parts) == 1 else torch.cat(parts)).cpu().numpy()
        pos = 0
        for i in order:
            out[offsets[i] : offsets[i + 1]] = flat[pos : pos + sizes[i]]
            pos += sizes[i]
    return out


class Interner:
    """Maps strings to small integer codes, for categorical columns."""

    def __init__(self, values: Sequence[str] = ()) -> None:
        self.values: list[str] = []
        self._codes: dict[str, int] = {}
        for v in values:
            self.code(v)

    def code(self, value: str) -> int:
        c = self._codes.get(value)
        if c is None:
            c = len(self.values)
            self._codes[value] = c
            self.values.append(value)
        return c


_STR_DTYPE = pd.Index(["x"]).dtype  # pandas' default string dtype (object before pandas 3, str from 3)


def category_index(values: Sequence[str]) -> pd.Index:
    """Categories as an Index of pandas' default string dtype (what a parquet round trip gives back too)."""
    return pd.Index(list(values), dtype=_STR_DTYPE)


MAX_UNWRITTEN = 10  # while stream writes fail, at most this many × flush_every steps wait in memory


def segment_dir(path: Path) -> Path:
    """The hidden folder next to a streamed trace ``path`` that holds its flushed segments until it is closed."""
    return path.parent / f".{path.name}.segments"


def _write_parquet(target: Path, table: Any, meta: dict[bytes, bytes]) -> None:
    """``table`` with ``meta`` in its schema metadata as one parquet file (zstd, page checksums), atomically."""
    import pyarrow.parquet as pq

    table = table.replace_schema_metadata({**(table.schema.metadata or {}), **meta})
    atomic_write(target, lambda f: pq.write_table(table, f, compression="zstd", write_page_checksum=True))


def _stream_schema() -> Any:
    import pyarrow as pa

    string = {"phase", "module", "module_type", "tensor", "dtype", "shape", "parent", "arg"}
    types = {"micro_step": pa.int32(), "call": pa.int32(), "scale": pa.float32(), "reduced": pa.bool_()}
    fields = []
    for name in RECORD_COLUMNS:
        if name in string:
            fields.append(pa.field(name, pa.string()))
        elif name in types:
            fields.append(pa.field(name, types[name]))
        elif name in STAT_NAMES and not name.startswith("n_"):
            fields.append(pa.field(name, pa.float64()))
        else:
            fields.append(pa.field(name, pa.int64()))
    return pa.schema(fields)


def canonical_records(df: pd.DataFrame) -> pd.DataFrame:
    """Records read from a file in the recorder's dtypes: categorical text columns (categories in order of
    first appearance, pandas' default string dtype) and int64 integer columns. Files written before the
    ``rank``/``reduced`` columns existed read as rank 0, not reduced."""
    if "rank" not in df.columns:
        df["rank"] = 0
    if "reduced" not in df.columns:
        df["reduced"] = False
    df["reduced"] = df["reduced"].fillna(False).astype(bool)
    for name in ("phase", "module", "module_type", "tensor", "dtype", "shape", "parent", "arg"):
        col = df[name]
        if isinstance(col.dtype, pd.CategoricalDtype):
            values = [str(v) for v in col.cat.categories]
            codes = col.cat.codes.to_numpy()
        else:
            obj = col.astype(object).where(col.notna(), None).to_numpy()
            values = [str(v) for v in pd.unique(obj[pd.notna(obj)])] if len(obj) else []
            if name == "phase":
                values = list(PHASES)
            index = {v: i for i, v in enumerate(values)}
            codes = np.array([index.get(str(v), -1) if v is not None else -1 for v in obj], dtype=np.int64)
        df[name] = pd.Categorical.from_codes(codes, categories=category_index(values), validate=False)
    ints = ("step", "micro_step", "seq", "call", "n_nan", "n_posinf", "n_neginf", "n_zero", "event", "rank")
    for name in ints:
        df[name] = df[name].to_numpy().astype(np.int64)
    return df


def canonical_steps(df: pd.DataFrame) -> pd.DataFrame:
    """``steps`` read from a file with the integer columns as :meth:`Store.steps` makes them: int64
    (``growth_tracker`` nullable Int64); files written before these were int64 held int32."""
    for name in ("step", "n_nonfinite", "micro_steps", "n_records", "rank"):
        if name in df.columns:
            df[name] = df[name].astype("int64")
    if "growth_tracker" in df.columns:
        df["growth_tracker"] = df["growth_tracker"].astype("Int64")
    if "recorded" not in df.columns:  # written before nantrace.watch: every step recorded in full
        df["recorded"] = "full"
    if "applied_grad_norm" not in df.columns:  # written before it was recorded: not known
        df["applied_grad_norm"] = np.full(len(df), np.nan)
    df["recorded"] = df["recorded"].astype("string")
    if "stale_grads" not in df.columns:  # written before the column existed: not recorded
        df["stale_grads"] = np.full(len(df), math.nan)
    return df


_INT_RANGES = [(dt, int(np.iinfo(dt).min), int(np.iinfo(dt).max)) for dt in (np.int8, np.int16, np.int32)]


def _smallest_int(a: np.ndarray) -> np.ndarray:
    if a.size == 0:
        return a.astype(np.int32)
    lo, hi = int(a.min()), int(a.max())
    for dt, low, high in _INT_RANGES:
        if low <= lo and hi <= high:
            return a.astype(dt)
    return a.astype(np.int64)


def _stale_total(stale: dict[int, torch.Tensor | float | None], host: list[np.ndarray]) -> float:
    """``steps.stale_grads``: the sum of the step's stale flags (``host``: the tensors' values as read, in
    order; a float is a value already read, None a parameter without ``.grad``); NaN when there is none."""
    if not stale:
        return math.nan
    read = iter(host)
    return float(
        sum(
            float(next(read)[0]) if isinstance(f, torch.Tensor) else 0.0 if f is None else float(f)
            for f in stale.values()
        )
    )


class StepRows:
    """The rows of ``steps``, stored as one ``array('d')`` per column (8 bytes per value, so a long run's
    steps table stays small); appended and read back as dicts."""

    _INTS = frozenset({"step", "n_nonfinite", "micro_steps", "n_records", "rank"})
    _OPTIONAL = frozenset({"applied_grad_norm", "stale_grads"})  # NaN in rows that do not set them

    def __init__(self) -> None:
        self.cols: dict[str, array] = {c: array("d") for c in STEP_COLUMNS}

    def __len__(self) -> int:
        return len(self.cols["step"])

    def append(self, row: dict[str, Any]) -> None:
        for c, a in self.cols.items():
            v = row.get(c, "full") if c == "recorded" else row.get(c) if c in self._OPTIONAL else row[c]
            a.append(float(RECORDED.index(v)) if c == "recorded" else math.nan if v is None else float(v))

    def row(self, i: int) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for c, a in self.cols.items():
            v = a[i]
            if c == "skipped":
                out[c] = None if math.isnan(v) else bool(v)
            elif c == "growth_tracker":
                out[c] = None if math.isnan(v) else int(v)
            elif c == "recorded":
                out[c] = RECORDED[int(v)]
            elif c in self._INTS:
                out[c] = int(v)
            else:
                out[c] = v
        return out

    def __iter__(self) -> Iterator[dict[str, Any]]:
        return (self.row(i) for i in range(len(self)))

    def since(self, start: int) -> list[dict[str, Any]]:
        """The rows from index ``start`` on, as dicts."""
        return [self.row(i) for i in range(start, len(self))]

    def head(self, count: int) -> list[dict[str, Any]]:
        return [self.row(i) for i in range(min(count, len(self)))]

    def replace_head(self, count: int, row: dict[str, Any]) -> None:
        """Replace the first ``count`` rows by ``row``."""
        for c, a in self.cols.items():
            v = row[c]
            del a[:count]
            a.insert(0, float(RECORDED.index(v)) if c == "recorded" else math.nan if v is None else float(v))


@dataclass
class PendingStep:
    """Scalars of the open step that become one row of ``steps`` at flush."""

    # a tensor, or its value already read (nantrace.watch reads them with its flags)
    losses: list[torch.Tensor | float] = field(default_factory=list)
    grad_norms: dict[int, torch.Tensor | float] = field(default_factory=dict)  # param index -> latest L2 norm
    applied_norm: torch.Tensor | None = None  # L2 norm of the gradients when optimizer.step() began
    # param index -> (weak reference to the .grad whose norm is in grad_norms, its version then); when every
    # gradient optimizer.step() applies is still that one, unchanged, applied_same: the applied norm is grad_norm
    grad_versions: dict[int, tuple[Any, int]] = field(default_factory=dict)
    applied_same: bool = False
    # the autograd graph task (backward pass) whose end takes the hooked gradients' norms (-2: none queued)
    norms_task: int = -2
    scale: torch.Tensor | float | None = None
    next_scale: torch.Tensor | float | None = None
    growth_tracker: torch.Tensor | float | None = None
    found_inf: torch.Tensor | float | None = None
    lr: Any = None
    # param index -> device flag (1: its .grad held inf/NaN before this step's backward added to it), None: no
    # .grad yet; one entry per parameter, from the first backward of the step that reached it. nantrace.watch
    # puts its count of such parameters under -1 (a device count, or its value already read)
    stale: dict[int, torch.Tensor | float | None] = field(default_factory=dict)
    micro_steps: int = 0
    # device summaries of the model inputs' per-sample flags (nantrace._samples), copied with the rest
    samples: list[torch.Tensor] = field(default_factory=list)


class Store:
    """Recorded rows of a trace: pending rows of the open step, and flushed numpy chunks."""

    def __init__(self, rank: int = 0) -> None:
        self.rank = rank  # torch.distributed rank of the process recording (a constant column)
        self.modules = Interner([""])
        self.types = Interner()
        self.tensors = Interner()
        self.dtypes = Interner()
        self.shapes = Interner()
        self.args = Interner()
        self.pending_meta = array("q")  # the rows' META_COLUMNS, flat: one int64 per field
        self.pending_stats: list[torch.Tensor | tuple[float, ...]] = []
        self.chunks: list[dict[str, np.ndarray]] = []
        self.step_rows = StepRows()
        # first op inside a module call that made a new non-finite kind (forward replay, host path)
        self.ops: list[tuple[int, int, int, int, str, str, str, str | None, bool]] = []
        self.samples_host: list[np.ndarray] = []
        self._records: pd.DataFrame | None = None
        self._steps: pd.DataFrame | None = None

    # ----------------------------------------------------------------- recording (hot path)
    def add(self, meta: tuple[int, ...], stats: torch.Tensor | tuple[float, ...]) -> None:
        """Append one row; ``meta`` follows ``META_COLUMNS`` (codes for categorical fields, -1 for None)."""
        self.pending_meta.extend(meta)
        self.pending_stats.append(stats)

    # ----------------------------------------------------------------- step boundary
    def flush(self, step: int, pending: PendingStep, mask_rule: Any) -> None:
        """Close ``step``: one host copy of the step's tensors, then numpy columns and a ``steps`` row."""
        stats_items = self.pending_stats
        meta = self.pending_meta
        self.pending_stats, self.pending_meta = [], array("q")
        dev_idx = [i for i, s in enumerate(stats_items) if isinstance(s, torch.Tensor)]
        scalars: list[torch.Tensor] = []
        names: list[tuple[str, int]] = []

        def want(name: str, v: Any, n: int = 1) -> None:
            if isinstance(v, torch.Tensor):
                scalars.append(v)
                names.append((name, n))

        for i in dev_idx:
            want("stats", stats_items[i], N_STATS)
        for t in pending.losses:
            want("loss", t)
        for t in pending.grad_norms.values():
            want("grad_norm", t)
        for f in pending.stale.values():
            want("stale", f)
        for key in ("scale", "next_scale", "growth_tracker", "found_inf", "lr", "applied_norm"):
            want(key, getattr(pending, key))
        for t in pending.samples:
            want("samples", t, t.numel())
        host = to_host(scalars)
        got: dict[str, list[np.ndarray]] = {}
        pos = 0
        for name, n in names:
            got.setdefault(name, []).append(host[pos : pos + n])
            pos += n

        def scalar(key: str) -> float:
            v = getattr(pending, key)
            if isinstance(v, torch.Tensor):
                return float(got[key][0][0])
            return math.nan if v is None else float(v)

        read = iter(got.get("loss", []))
        losses = [float(next(read)[0]) if isinstance(x, torch.Tensor) else float(x) for x in pending.losses]
        scale = scalar("scale")
        n = len(stats_items)
        if n:
            if dev_idx:
                dev_vals = iter(got.get("stats", []))
                mat = np.array([next(dev_vals) if isinstance(s, torch.Tensor) else s for s in stats_items])
            else:  # the CPU path: tuples of floats only
                mat = np.array(stats_items, dtype=np.float64)
            m = np.frombuffer(meta, dtype=np.int64).reshape(n, len(META_COLUMNS))
            self.chunks.append(self._columns(m, mat.reshape(n, N_STATS), 1.0 if math.isnan(scale) else scale))
        read = iter(got.get("grad_norm", []))
        norms = [
            float(next(read)[0]) if isinstance(x, torch.Tensor) else float(x)
            for x in pending.grad_norms.values()
        ]
        grad_norm = math.nan
        if norms:
            grad_norm = math.sqrt(sum(v * v for v in norms))
            if not math.isnan(scale) and scale > 0:
                grad_norm /= scale
        found_inf = scalar("found_inf")
        n_nonfinite = 0
        if n:
            chunk = self.chunks[-1]
            bad = (chunk["n_nan"] + chunk["n_posinf"] + chunk["n_neginf"]) > 0
            if bad.any():  # the mask rule only ever clears rows that hold inf/NaN
                bad &= ~mask_rule(chunk, self)
                n_nonfinite = int(bad.sum())
        growth = scalar("growth_tracker")
        stale = _stale_total(pending.stale, got.get("stale", []))
        self.step_rows.append(
            {
                "step": step,
                "loss": float(np.mean(losses)) if losses else math.nan,
                "scale": scale,
                "next_scale": scalar("next_scale"),
                "skipped": None if math.isnan(found_inf) else bool(found_inf > 0),
                "growth_tracker": None if math.isnan(growth) else int(growth),
                "lr": scalar("lr"),
                "grad_norm": grad_norm,
                "applied_grad_norm": grad_norm if pending.applied_same else scalar("applied_norm"),
                "n_nonfinite": n_nonfinite,
                "micro_steps": pending.micro_steps,
                "n_records": n,
                "rank": self.rank,
                "stale_grads": stale,
            }
        )
        self.samples_host = got.get("samples", [])  # read by the recording's SampleWatch after the flush
        self._records = None
        self._steps = None

    def merge_leading_steps(self, count: int) -> None:
        """Fold steps ``0 .. count-1`` (one root forward each) into step 0 with micro-steps ``0 .. count-1``.

        Used once, when a loop without scaler or optimizer first calls ``Trace.step()``: the forwards before it
        were provisionally counted as steps of their own, and all belong to the first step.
        """
        if count <= 1:
            return
        seq_offset = 0
        micro_offset = 0
        offsets: dict[int, int] = {}
        for chunk in self.chunks:
            step = chunk["step"]
            if len(step) == 0 or int(step[0]) >= count:
                continue
            offsets[int(step[0])] = micro_offset
            chunk["micro_step"] = (chunk["micro_step"] + micro_offset).astype(np.int32)
            chunk["seq"] = (chunk["seq"] + seq_offset).astype(np.int32)
            chunk["step"] = np.zeros_like(step)
            micro_offset = int(chunk["micro_step"].max()) + 1
            seq_offset = int(chunk["seq"].max())
        rows = self.step_rows.head(count)
        losses = [r["loss"] for r in rows if not math.isnan(r["loss"])]
        norms = [r["grad_norm"] for r in rows if not math.isnan(r["grad_norm"])]
        merged = dict(rows[-1])
        merged.update(
            step=0,
            loss=float(np.mean(losses)) if losses else math.nan,
            grad_norm=norms[-1] if norms else math.nan,
            n_nonfinite=sum(r["n_nonfinite"] for r in rows),
            micro_steps=sum(max(r["micro_steps"], 1) for r in rows),
            n_records=sum(r["n_records"] for r in rows),
            stale_grads=rows[0]["stale_grads"],  # later forwards were micro-steps accumulating into .grad
        )
        self.step_rows.replace_head(count, merged)
        self.ops = [(0, r[1] + offsets.get(r[0], 0), *r[2:]) if r[0] < count else r for r in self.ops]
        self._records = None
        self._steps = None

    def _columns(self, m: np.ndarray, mat: np.ndarray, scale: float) -> dict[str, np.ndarray]:
        col = {name: m[:, i] for i, name in enumerate(META_COLUMNS)}
        out: dict[str, np.ndarray] = {
            name: _smallest_int(col[name]) for name in META_COLUMNS if name not in ("is_grad", "reduced")
        }
        out["is_grad"] = col["is_grad"].astype(bool)
        out["reduced"] = col["reduced"].astype(bool)
        out["scale"] = np.where(out["is_grad"], scale, 1.0).astype(np.float32)
        for i, name in enumerate(STAT_NAMES):
            out[name] = _smallest_int(mat[:, i].astype(np.int64)) if name.startswith("n_") else mat[:, i]
        return out

    def nbytes_per_row(self) -> float:
        """Bytes of in-memory storage per flushed row (numpy chunks, excluding the cached DataFrame)."""
        rows = sum(len(c["seq"]) for c in self.chunks)
        size = sum(a.nbytes for c in self.chunks for a in c.values())
        return size / rows if rows else 0.0

    # ----------------------------------------------------------------- streaming to parquet
    def stream_to(
        self, path: Any, every: int, meta: Callable[[list[str], pd.DataFrame, pd.DataFrame], Any]
    ) -> None:
        """Write finished steps under ``path`` whenever ``every`` steps are in memory, then drop them.

        Each flush is one complete trace file, a *segment* in the hidden folder :func:`segment_dir` next to
        ``path``, written atomically (fsync, then rename), with the ``steps``/``ops`` rows of its steps: after a
        kill, every flushed step is on disk and loads. :meth:`close_stream` joins the segments into ``path``.
        ``meta(dtypes, steps, ops)`` gives a file's nantrace metadata (``{MAGIC: footer}``).

        A write that fails (disk full, quota, a lost mount) never raises: it warns once, naming ``path`` and the
        error, keeps the steps in memory and retries at the next flush. While writes fail at most
        :data:`MAX_UNWRITTEN` × ``every`` steps stay in memory; older ones are dropped and counted
        (:attr:`stream_lost_steps`), and the recording reports it at exit.
        """
        self.stream_path = path
        self.stream_every = every
        self.stream_meta = meta
        self.stream_segments: list[Path] = []
        self.stream_dtypes: set[str] = set()
        self.stream_error: BaseException | None = None
        self.stream_lost_steps = 0
        self.spilled_rows = 0
        self.spilled_steps = 0
        self.spilled_ops = 0

    def maybe_spill(self) -> None:
        if getattr(self, "stream_path", None) is not None and len(self.chunks) >= self.stream_every:
            self.spill()

    def _stream_table(self, chunks: list[dict[str, np.ndarray]]) -> Any:
        import pyarrow as pa

        return pa.Table.from_pandas(
            self.frame(chunks, plain=True), schema=_stream_schema(), preserve_index=False
        )

    def spill(self) -> None:
        """Write every in-memory chunk, with the steps and ops rows not yet written, as one segment file and
        free them; on a write error keep them (within the bound) for the next try."""
        if not self.chunks:
            return
        try:
            table = self._stream_table(self.chunks)
            dtypes = sorted({str(v) for v in table.column("dtype").unique().to_pylist()})
            steps = self.steps().iloc[self.spilled_steps :].reset_index(drop=True)
            ops = self.ops_frame().iloc[self.spilled_ops :].reset_index(drop=True)
            folder = segment_dir(self.stream_path)
            folder.mkdir(exist_ok=True)
            seg = folder / f"{len(self.stream_segments):06d}.nantrace"
            _write_parquet(seg, table, self.stream_meta(dtypes, steps, ops))
        except Exception as e:  # never into the user's loop: the disk's problem is reported, training goes on
            self._write_failed(e)
            return
        self.stream_segments.append(seg)
        self.stream_dtypes.update(dtypes)
        self.spilled_rows += table.num_rows
        self.spilled_steps += len(steps)
        self.spilled_ops += len(ops)
        self.chunks = []
        self._records = None

    def _write_failed(self, e: BaseException) -> None:
        import warnings

        if self.stream_error is None:
            warnings.warn(
                f"nantrace: writing the trace to {str(self.stream_path)!r} failed ({type(e).__name__}: {e}). "
                f"Training continues; the unwritten steps stay in memory (at most {MAX_UNWRITTEN} x flush_every) "
                "and the write is retried at the next flush.",
                RuntimeWarning,
                stacklevel=2,
            )
        self.stream_error = e
        limit = MAX_UNWRITTEN * self.stream_every
        if len(self.chunks) > limit:
            drop = len(self.chunks) - limit
            self.stream_lost_steps += len({int(c["step"][0]) for c in self.chunks[:drop] if len(c["step"])})
            self.chunks = self.chunks[drop:]
            self._records = None

    def close_stream(self) -> bool:
        """Join the segments and what is left in memory into the stream file at ``path`` (atomically) and remove
        the segments; True when it is written. On a write error it warns, keeps the segments already on disk
        (``nantrace.load(path)`` reads them) and the rest in memory, and returns False."""
        import shutil

        import pyarrow.parquet as pq

        try:
            rest = self._stream_table(self.chunks)
            dtypes = self.stream_dtypes | {str(v) for v in rest.column("dtype").unique().to_pylist()}
            meta = self.stream_meta(sorted(dtypes), self.steps(), self.ops_frame())
            schema = rest.schema.with_metadata(meta)

            def write(f: Any) -> None:
                with pq.ParquetWriter(f, schema, compression="zstd", write_page_checksum=True) as w:
                    for seg in self.stream_segments:
                        w.write_table(pq.read_table(seg, page_checksum_verification=True).cast(schema))
                    w.write_table(rest.cast(schema))

            atomic_write(self.stream_path, write)
        except Exception as e:
            self._write_failed(e)
            self.spill()  # the last steps as a segment, if the disk takes it now
            return False
        shutil.rmtree(segment_dir(self.stream_path), ignore_errors=True)
        self.spilled_rows += rest.num_rows
        self.stream_segments = []
        self.chunks = []
        self._records = None
        return True

    # ----------------------------------------------------------------- tables
    # ----------------------------------------------------------------- tables
    def records(self) -> pd.DataFrame:
        """All flushed rows in memory as a DataFrame with the columns :data:`RECORD_COLUMNS`."""
        if self._records is None:
            self._records = self.frame(self.chunks, plain=False)
        return self._records

    def frame(self, chunks: list[dict[str, np.ndarray]], *, plain: bool) -> pd.DataFrame:
        """Rows of ``chunks`` as a DataFrame: categoricals and int64 integer columns (the chunks keep the
        smallest int dtypes), or (``plain``) strings and the fixed dtypes of the stream file's schema."""
        if chunks:
            keys = chunks[0].keys()
            cat = {k: np.concatenate([c[k] for c in chunks]) for k in keys}
        else:
            cat = self._columns(np.zeros((0, len(META_COLUMNS)), dtype=np.int64), np.zeros((0, N_STATS)), 1.0)

        def categorical(codes: np.ndarray, values: list[str]) -> Any:
            codes = codes.astype(np.int64)
            if plain:
                lookup = np.array([*values, None], dtype=object)
                return lookup[np.where(codes >= 0, codes, len(values))]
            return pd.Categorical.from_codes(codes, categories=category_index(values), validate=False)

        def integer(a: np.ndarray, fixed: Any) -> np.ndarray:
            # users get int64 (no wrap-around in arithmetic); the stream file keeps its schema's dtypes
            return a.astype(fixed if plain else np.int64)

        data: dict[str, Any] = {
            "step": integer(cat["step"], np.int64),
            "micro_step": integer(cat["micro_step"], np.int32),
            "seq": integer(cat["seq"], np.int64),
            "phase": categorical(cat["phase"], list(PHASES)),
            "module": categorical(cat["module"], self.modules.values),
            "module_type": categorical(cat["module_type"], self.types.values),
            "call": integer(cat["call"], np.int32),
            "tensor": categorical(cat["tensor"], self.tensors.values),
            "dtype": categorical(cat["dtype"], self.dtypes.values),
            "shape": categorical(cat["shape"], self.shapes.values),
            "numel": cat["numel"].astype(np.int64),
        }
        for name in STAT_NAMES:
            v = cat[name]
            data[name] = integer(v, np.int64) if name.startswith("n_") else v.astype(np.float64)
        data["scale"] = cat["scale"].astype(np.float32)
        data["parent"] = categorical(cat["parent"], self.modules.values)
        data["arg"] = categorical(cat["arg"], self.args.values)
        data["event"] = integer(cat["event"], np.int64)
        data["rank"] = np.full(len(data["step"]), self.rank, dtype=np.int64)
        data["reduced"] = cat["reduced"].astype(bool)
        return pd.DataFrame(data, columns=list(RECORD_COLUMNS))

    def ops_frame(self) -> pd.DataFrame:
        """``step, micro_step, module, call, op, kind, operands, source, reaches``: the first torch op inside a
        module call that produced a new non-finite kind (``nan``, ``posinf``, ``neginf``), found by replaying that
        call's forward; ``operands``: the facts of its operands (JSON text, :mod:`nantrace._opfacts`; ``""`` when
        they could not be read); ``source``: the user's ``path:line`` that ran it (None when not known, e.g.
        autocast's cast); ``reaches``: False for a value the call's output does not depend on (a selection
        discarded it)."""
        rows = [(s, m, self.modules.values[c], *rest) for s, m, c, *rest in self.ops]
        cols = ["step", "micro_step", "module", "call", "op", "kind", "operands", "source", "reaches"]
        return pd.DataFrame(rows, columns=cols).astype({"reaches": bool})

    def steps(self) -> pd.DataFrame:
        """One row per closed step, columns :data:`STEP_COLUMNS`."""
        if self._steps is not None:
            return self._steps
        rows = list(self.step_rows)
        df = pd.DataFrame(
            {
                "step": pd.array([r["step"] for r in rows], dtype="int64"),
                "loss": np.array([r["loss"] for r in rows], dtype=np.float64),
                "scale": np.array([r["scale"] for r in rows], dtype=np.float64),
                "next_scale": np.array([r["next_scale"] for r in rows], dtype=np.float64),
                "skipped": pd.array([r["skipped"] for r in rows], dtype="boolean"),
                "growth_tracker": pd.array([r["growth_tracker"] for r in rows], dtype="Int64"),
                "lr": np.array([r["lr"] for r in rows], dtype=np.float64),
                "grad_norm": np.array([r["grad_norm"] for r in rows], dtype=np.float64),
                "n_nonfinite": pd.array([r["n_nonfinite"] for r in rows], dtype="int64"),
                "micro_steps": pd.array([r["micro_steps"] for r in rows], dtype="int64"),
                "n_records": pd.array([r["n_records"] for r in rows], dtype="int64"),
                "rank": pd.array([r["rank"] for r in rows], dtype="int64"),
                "recorded": pd.array([r["recorded"] for r in rows], dtype="string"),
                "applied_grad_norm": np.array([r["applied_grad_norm"] for r in rows], dtype=np.float64),
                "stale_grads": np.array([r["stale_grads"] for r in rows], dtype=np.float64),
            },
            columns=list(STEP_COLUMNS),
        )
        self._steps = df
        return df
