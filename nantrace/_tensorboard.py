"""TensorBoard export of a :class:`~nantrace.Trace`: per-step scalars and per-module absmax/fp16 headroom.

What is written (``P`` is ``tag_prefix``, default ``"nantrace"``; ``global_step`` is nantrace's step):

* per step: ``P/loss``, ``P/loss_scale`` (the scale the step's backward used), ``P/skipped`` (1.0 when the
  GradScaler skipped the optimizer step, else 0.0), ``P/grad_norm`` (L2 norm of the unscaled gradients) and
  ``P/n_nonfinite`` (records holding NaN/±inf, attention masks excluded);
* per module, per step: ``P/absmax/<module>``, the largest |x| over the module's forward *outputs* in that step
  (all calls and micro-steps), and ``P/headroom_bits/<module>`` = log2(65504 / absmax), where 65504 =
  ``torch.finfo(torch.float16).max``, whatever dtype the run used (so an fp32/bf16 run shows how far it is from
  overflowing fp16). The root model is ``(root)``.

Non-finite values are never dropped. TensorBoard's charts do not draw NaN or ±inf points, so each value that can
be non-finite has a companion marker series, written at every step the value is written:
``P/nonfinite/loss``, ``P/nonfinite/loss_scale`` and ``P/nonfinite/grad_norm`` hold 1.0 at a step where that
value was NaN or ±inf and 0.0 otherwise, so a fault shows as a spike. ``P/nonfinite/absmax/<module>`` is *not* a
marker of the absmax value: it is 1.0 at a step where the module's outputs held NaN or ±inf, else 0.0. The values
themselves are written as they are (NaN, +inf or -inf), so a program reading the event file sees the truth:
``absmax/<module>`` is +inf where the outputs held ±inf, else the absmax of their finite values (NaN elements
never raise it: outputs holding NaN only show a finite absmax with the marker at 1.0, or NaN when no value was
finite); ``headroom_bits/<module>`` is -inf where absmax is +inf (as in :func:`nantrace._ranges.headroom_table`)
and is not written where absmax is 0 (an all-zero output has no defined headroom) or NaN.

Each export to a directory adds a new event file (a writer given in is written to as it is): exporting the same
trace twice into one directory makes TensorBoard show every point twice. Use a new directory per export.

Values the run could not know are not written at all (no GradScaler: no ``loss_scale``/``skipped``; no loss seen:
no ``loss``; no gradient recorded: no ``grad_norm``). A NaN counts as a recorded NaN, not as unknown, when the
column holds a non-NaN value at some step or the step's records show the loss/gradients themselves.

With ``trace(every=N)``, the steps between full ones only hold rows for tensors with inf/NaN, so per-module
scalars on those steps are written for those modules only.

The first overflow's explanation is written as text (``P/first_overflow``) at its step. With torch's
``SummaryWriter`` all scalars of one step go into one event (about 13x faster than one ``add_scalar`` call
each); another writer gets one ``add_scalar(tag, value, global_step)`` call per scalar.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from ._explain import first_overflow
from ._masks import unmasked
from ._schema import FP16_MAX
from ._view import RunView

__all__ = ["MISSING_TENSORBOARD", "ROOT_TAG", "summary_writer_class", "write_tensorboard"]

ROOT_TAG = "(root)"

MISSING_TENSORBOARD = 'TensorBoard export needs the tensorboard package, which is not installed: pip install "nantrace[tensorboard]"'


def summary_writer_class() -> Any:
    try:
        import tensorboard  # noqa: F401  (torch.utils.tensorboard fails late and vaguely without it)
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as e:
        raise ImportError(MISSING_TENSORBOARD) from e
    return SummaryWriter


def _marker(v: float) -> float:
    return 0.0 if math.isfinite(v) else 1.0


def _known(values: np.ndarray, evidence: np.ndarray) -> np.ndarray:
    """Which steps' values to write: non-NaN ones, and NaN ones that are recorded NaNs (see module docstring)."""
    nan = np.isnan(values)
    if not nan.all():
        return np.ones(len(values), dtype=bool)
    return ~nan | evidence


def _step_evidence(records: pd.DataFrame, steps: np.ndarray, mask: pd.Series) -> np.ndarray:
    hit = set(records.loc[mask, "step"].astype(int).tolist())
    return np.array([s in hit for s in steps.tolist()], dtype=bool)


def module_scalars(records: pd.DataFrame, ops: pd.DataFrame | None = None) -> pd.DataFrame:
    """Per ``(step, module)`` over forward outputs: ``absmax`` (+inf if an output held ±inf), ``nonfinite``
    (bool: an output held NaN or ±inf) and ``headroom_bits`` = log2(65504 / absmax) (NaN where absmax is 0/NaN)."""
    cols = ["step", "module", "absmax", "nonfinite", "headroom_bits"]
    if len(records) == 0:
        return pd.DataFrame(columns=cols)
    rows = unmasked(  # an attention mask's -inf is intended, not an overflow (nantrace._masks)
        records[
            (records["phase"].astype(str) == "forward")
            & records["tensor"].astype(str).str.startswith("output")
        ],
        ops,  # and the -inf the drill-down showed was masked in the forward
    )
    if len(rows) == 0:
        return pd.DataFrame(columns=cols)
    inf = (rows["n_posinf"].to_numpy() + rows["n_neginf"].to_numpy()) > 0
    bad = inf | (rows["n_nan"].to_numpy() > 0)
    absmax = rows["absmax"].to_numpy(dtype=np.float64)
    absmax = np.where(inf, np.inf, absmax)
    g = (
        pd.DataFrame(
            {
                "step": rows["step"].astype(int).to_numpy(),
                "module": rows["module"].astype(str).to_numpy(),
                "absmax": absmax,
                "nonfinite": bad,
            }
        )
        .groupby(["step", "module"], sort=True)
        .agg(absmax=("absmax", "max"), nonfinite=("nonfinite", "any"))
        .reset_index()
    )
    a = g["absmax"].to_numpy(dtype=np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        bits = np.where((a > 0) & ~np.isnan(a), np.log2(FP16_MAX / a), np.nan)
    g["headroom_bits"] = bits
    return g[cols]


def write_tensorboard(
    view: RunView, logdir_or_writer: str | os.PathLike[str] | Any, *, tag_prefix: str = "nantrace"
) -> Path | None:
    """Write ``view``'s per-step scalars and per-module absmax/headroom to TensorBoard; see the module docstring
    for every tag and how non-finite values are marked.

    Args:
        view: the run view of a recording or loaded trace (inside ``with``, the steps closed so far).
        logdir_or_writer: a directory (created if needed; a new event file is written in it and closed), or an
            open ``torch.utils.tensorboard.SummaryWriter`` (or any writer with ``add_scalar``/``add_text``),
            which is flushed and left open.
        tag_prefix: the first part of every tag (non-empty, no leading/trailing ``/``).

    Returns:
        the log directory written to, or ``None`` when a writer that does not tell its directory was given.

    Raises:
        ImportError: a directory was given and the ``tensorboard`` package is not installed (install the
            ``nantrace[tensorboard]`` extra).
        TypeError: ``logdir_or_writer`` is neither a path nor a writer, or ``tag_prefix`` is not a str.
        ValueError: ``tag_prefix`` is empty or starts/ends with ``/``; the directory cannot be created.
    """
    if not isinstance(tag_prefix, str):
        raise TypeError(f"tag_prefix must be a str; got {type(tag_prefix).__name__}: {tag_prefix!r:.80}")
    if not tag_prefix or tag_prefix.startswith("/") or tag_prefix.endswith("/"):
        raise ValueError(
            f"tag_prefix {tag_prefix!r} must be non-empty and not start or end with '/'; e.g. 'nantrace'"
        )
    own = isinstance(logdir_or_writer, (str, os.PathLike))
    if own:
        logdir = Path(logdir_or_writer)
        if logdir.exists() and not logdir.is_dir():
            raise ValueError(
                f"logdir {str(logdir)!r} exists and is not a directory; give a directory for the event file"
            )
        writer_cls = summary_writer_class()
        try:
            logdir.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise ValueError(f"logdir {str(logdir)!r}: cannot create it ({e})") from e
        writer = writer_cls(log_dir=str(logdir))
    elif callable(getattr(logdir_or_writer, "add_scalar", None)):
        writer = logdir_or_writer
        got = getattr(writer, "log_dir", None) or getattr(writer, "logdir", None)
        logdir = Path(got) if isinstance(got, (str, os.PathLike)) else None  # type: ignore[assignment]
    else:
        raise TypeError(
            "logdir_or_writer must be a directory (str or os.PathLike) or a "
            f"torch.utils.tensorboard.SummaryWriter; got {type(logdir_or_writer).__name__}: "
            f"{logdir_or_writer!r:.80}"
        )
    try:
        _write(view, writer, tag_prefix)
    finally:
        if own:
            writer.close()
        elif callable(getattr(writer, "flush", None)):
            writer.flush()
    return logdir


def scalar_events(view: RunView, p: str = "nantrace") -> dict[int, list[tuple[str, float]]]:
    """Every scalar :func:`write_tensorboard` writes: ``{step: [(tag, value), ...]}``, steps ascending."""
    steps = view.steps
    records = view.records
    ids = steps["step"].astype(int).to_numpy()
    out: dict[int, list[tuple[str, float]]] = {int(s): [] for s in ids.tolist()}
    phase = records["phase"].astype(str)
    tensor = records["tensor"].astype(str)

    def series(name: str, values: np.ndarray, evidence: np.ndarray | None) -> None:
        known = _known(values, np.zeros(len(values), dtype=bool) if evidence is None else evidence)
        for s, v, k in zip(ids.tolist(), values.tolist(), known.tolist(), strict=True):
            if k:
                out[s].append((f"{p}/{name}", v))
                out[s].append((f"{p}/nonfinite/{name}", _marker(v)))

    loss_ev = _step_evidence(records, ids, (phase == "loss") & tensor.str.startswith("loss"))
    grad_ev = _step_evidence(records, ids, (phase == "backward") & tensor.str.endswith(".grad"))
    series("loss", steps["loss"].to_numpy(dtype=np.float64), loss_ev)
    scale = steps["scale"].to_numpy(dtype=np.float64)
    if not np.isnan(scale).all():
        series("loss_scale", scale, None)
    for s, v in zip(ids.tolist(), steps["skipped"].tolist(), strict=True):
        if v is not None and v is not pd.NA:
            out[s].append((f"{p}/skipped", 1.0 if v else 0.0))
    series("grad_norm", steps["grad_norm"].to_numpy(dtype=np.float64), grad_ev)
    for s, n in zip(ids.tolist(), steps["n_nonfinite"].astype(int).tolist(), strict=True):
        out[s].append((f"{p}/n_nonfinite", float(n)))
    for s, m, a, bad, bits in module_scalars(records, view.ops).itertuples(index=False):
        name = m or ROOT_TAG
        row = out.setdefault(int(s), [])
        row.append((f"{p}/absmax/{name}", float(a)))
        row.append((f"{p}/nonfinite/absmax/{name}", 1.0 if bad else 0.0))
        if not math.isnan(bits):
            row.append((f"{p}/headroom_bits/{name}", float(bits)))
    return dict(sorted(out.items()))


def _write(view: RunView, writer: Any, p: str) -> None:
    events = scalar_events(view, p)
    file_writer = getattr(writer, "_get_file_writer", None)
    if callable(file_writer):  # torch's SummaryWriter: one event per step holding all its scalars
        from tensorboard.compat.proto.summary_pb2 import Summary

        fw = file_writer()
        for s, pairs in events.items():
            if pairs:
                values = [Summary.Value(tag=t, simple_value=v) for t, v in pairs]
                fw.add_summary(Summary(value=values), global_step=s)
    else:
        for s, pairs in events.items():
            for t, v in pairs:
                writer.add_scalar(t, v, global_step=s)
    ov = first_overflow(view)
    if ov is not None and callable(getattr(writer, "add_text", None)):
        writer.add_text(f"{p}/first_overflow", str(ov), global_step=int(ov.step))
