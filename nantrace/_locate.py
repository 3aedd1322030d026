"""The locator: plain pandas over ``records``, naming who *produced* the first non-finite value. It returns
facts (:class:`Event`), never words: :mod:`nantrace._explain` writes them.

Rules (from the design contract), applied to one step's rows in time order: execution order (``seq``) across
the whole step, so a model called twice before one backward has its second call's data and forward before the
first call's backward. When the first non-finite tensor holds both inf and NaN, the kind is inf (NaN follows
from inf, never the reverse):

1. A module call produced a kind (NaN, +inf, -inf) when its output holds it and none of its inputs did. Taken in
   time order, the first row holding a kind not seen before is exactly that output.
2. A kind that first shows up at a module's *input* was made by the enclosing module's own ``forward`` (an op
   between its children): that enclosing module (the row's ``parent``) is reported. When the forward
   drill-down of that call found an op of its own code making another kind (``ops.reaches``), that op's value is
   the first one: a replay stops at the first op of the call's own code that makes a non-finite value, so it ran
   before what the child saw (q·kᵀ overflowing to +inf, then a softmax NaN at the output projection's input);
   the event is that op's kind at the call's output, as for a value that never left the call.
3. An attention mask is not a fault (:mod:`nantrace._masks`): its -inf is recorded (``n_neginf``) but never
   reported, and passing it on in activations is not producing it, also when it reaches the model's output.
   NaN/+inf, or -inf in a model input that is not a mask (e.g. ``log(0)`` in a feature), is a ``data`` fault.
   The forward drill-down names an op only for a kind it *produced* (a non-finite scalar argument such as
   ``masked_fill(m, -inf)`` counts as an input: ``_stats.op_input_kinds``). A call's output whose -inf the
   replay showed was made only by such ops (``ops.kind`` ``"mask"``: masked logits, a causal mask built in the
   forward) is a mask too, whatever its other values.
4. ``loss``: outputs were finite but the loss, or the gradient arriving at the outputs, was not.
5. ``backward``: the first non-finite gradient. One gradient value can be seen by several hooks (the output of
   one module is the input of the next; rows sharing an ``event``); it is attributed to the module whose
   backward computed it: a parameter's owner, else the module it is ``grad_input`` of (the innermost), else
   the enclosing module whose own code consumed that output (code of its ``forward`` that runs in backward, such
   as a custom ``autograd.Function``); ``tensor`` then names the gradient that code made by the child's path,
   ``a.grad_output[0]``, since the enclosing module's own ``grad_output`` can be finite.
6. ``optimizer``: the first parameter that ``optimizer.step()`` made non-finite; ``module`` is its owner.

One locator for one rank and for many
-------------------------------------
Each rank's own first producer of a step is found from its *local* rows (a trace of one process is one rank).
Rows marked ``reduced`` hold parameter gradients after the cross-rank reduction (DDP all-reduce, FSDP
reduce-scatter): a value a rank holds only there was *received*, not produced. Ranks run concurrently and
their clocks are not comparable, so the producers of one step are ordered by the key
``(step, seq, phase, rank)``:

1. the same step first: within a step ranks exchange values only through the gradient reduction at the end of
   backward (and, under FSDP, parameter all-gathers that carry the previous step's optimizer result);
2. then ``seq``, the position in the step's execution order: every rank runs the same program, so equal
   positions are the same tensor on every rank (on the in-between steps of ``every=N`` only non-finite tensors
   are numbered on the host path, so there the position is among those);
3. then the pipeline phase order ``data → forward → loss → backward → optimizer``;
4. then the lowest rank: two ranks that produced the same event independently are both producers.

When every rank's local rows are finite but the reduced gradients are not, the reduction itself produced the
value (e.g. a DDP communication hook that compresses gradients to float16): it is reported on the lowest rank
holding it, ``propagated=False``. A trace that holds only some of the ranks cannot tell the two apart and reports
such a value as ``propagated=True``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd

from ._evidence import op_base
from ._masks import call_outputs, intended_rows, is_mask
from ._schema import PHASE_RANK, DType

__all__ = [
    "KIND_PRIORITY",
    "Event",
    "Finding",
    "by_priority",
    "find",
    "overflow_fields",
    "rank_events",
    "reaching",
]


@dataclass(frozen=True)
class Event:
    """One rank's first non-finite value in one step, and who produced it.

    Attributes:
        fields: the :class:`~nantrace.Overflow` fields ``step .. dtype`` (producer attributed).
        raw_kind: ``"nan"``, ``"posinf"`` or ``"neginf"``.
        op: the torch op the forward drill-down named inside the producing call, or None; for a NaN made in
            backward, the forward op whose non-finite value the call discarded (``ops.reaches`` False).
        row: the record row where the value was first seen.
        step_rows: that rank's local rows of the step (what the explanation reads).
        rank: the rank whose rows hold it.
        received: True when the rank holds it only in reduced rows (it came through the reduction).
        source: the user's ``path:line`` that ran ``op`` (the drill-down's ``ops.source``), or None.
    """

    fields: dict[str, Any]
    raw_kind: str
    op: str | None
    row: pd.Series = field(compare=False)
    step_rows: pd.DataFrame = field(compare=False)
    rank: int
    received: bool
    source: str | None = None

    @property
    def key(self) -> tuple[int, int, int, int, int]:
        """``(step, micro_step, phase order, seq, rank)``: where the event happened (the live check's flags)."""
        r = self.row
        return (int(r["step"]), int(r["micro_step"]), PHASE_RANK[str(r["phase"])], int(r["seq"]), self.rank)

    @property
    def order(self) -> tuple[int, int, int, int]:
        """The cross-rank ordering key ``(step, seq, phase order, rank)`` (module docstring)."""
        r = self.row
        return (int(r["step"]), int(r["seq"]), PHASE_RANK[str(r["phase"])], self.rank)


@dataclass(frozen=True)
class Finding:
    """What the locator reports for one step (or, ``per_rank``, one rank of a step).

    Attributes:
        event: the producing (or, when nothing was produced, the first received) event.
        how: ``"produced"``; ``"reduction"`` (every rank's local rows finite, the reduction made it: ``event`` is
            the lowest rank's); ``"received"`` (only received values, and the trace lacks ranks to tell more).
        receivers: ranks that only received the value (``produced``), or every rank holding it (``reduction``).
        n_ranks: ranks in the trace.
    """

    event: Event
    how: str
    receivers: tuple[int, ...] = ()
    n_ranks: int = 1


# When one tensor holds several kinds, the kind reported: inf before NaN (NaN follows from inf: inf - inf,
# 0 * inf; never the reverse), so the answer does not depend on which elements a kernel happened to combine.
KIND_PRIORITY: tuple[str, ...] = ("posinf", "neginf", "nan")


def by_priority(kinds: Any) -> list[str]:
    """``kinds`` (an iterable of ``"nan"``/``"posinf"``/``"neginf"``) in reporting order: inf before NaN."""
    present = set(kinds)
    return [k for k in KIND_PRIORITY if k in present]


def _ordered(step_df: pd.DataFrame) -> pd.DataFrame:
    """One step's rows in execution order: ``seq`` runs across the whole step, so a model called twice
    before one backward has its second call's data and forward before the first call's backward."""
    return step_df.sort_values("seq", kind="stable")


def reaching(ops: pd.DataFrame | None) -> pd.DataFrame | None:
    """The drill-down ops whose value changed what their call computed: a value that a selection discarded
    (``reaches`` False: the call's output is the same whatever finite value it had) is not a forward fault.
    Traces recorded before the column existed only named ops whose values reached a boundary."""
    if ops is None or "reaches" not in ops.columns or not len(ops):
        return ops
    return ops[ops["reaches"].to_numpy(dtype=bool)]


def _op_rows(
    df: pd.DataFrame, wanted: tuple[str, ...], ops: pd.DataFrame | None
) -> dict[int, tuple[str, str]]:
    """Row position (in ``df``) of the output of each module call where the drill-down named an op -> (kind, op):
    the first output row holding that kind, or the call's first output when no output holds it."""
    extra: dict[int, tuple[str, str]] = {}
    ops = reaching(ops)
    if ops is None or not len(ops):
        return extra
    tensors = df["tensor"].astype(str).to_numpy().astype(str)
    phases = df["phase"].astype(str).to_numpy()
    modules = df["module"].astype(str).to_numpy()
    outputs = np.char.startswith(tensors, "output")
    for op in ops.itertuples():
        if op.kind not in wanted:
            continue
        hit = np.nonzero(
            (phases == "forward")
            & (modules == op.module)
            & (df["call"].to_numpy() == op.call)
            & (df["micro_step"].to_numpy() == op.micro_step)
            & outputs
        )[0]
        if len(hit):  # the output that holds the op's kind, else (it never left the call) the first output
            counts = df["n_" + str(op.kind)].to_numpy()
            holding = [i for i in hit if counts[i] > 0]
            extra.setdefault(int(holding[0] if holding else hit[0]), (str(op.kind), str(op.op)))
    return extra


#: The ops that make a mask's -inf from finite values: a log of a 0/1 mask (``mask.log()``). Another op that
#: makes -inf from finite operands one of which is a weight (a linear, a matmul with a parameter) overflowed: its
#: output is no mask even when it holds only 0 and -inf. (A product of a mask by a constant past the dtype's
#: range, ``(1 - m) * -1e9`` in float16, involves no weight and stays a mask by the value rule.)
MASK_BUILDERS = frozenset({"log", "log2", "log10"})


def _weight_ops(df: pd.DataFrame, ops: pd.DataFrame | None) -> set[int]:
    """Row positions (in ``df``, forward outputs) of calls whose named op took one of the module's parameters
    (``ops.operands``: a ``param`` or ``frozen`` entry)."""
    if ops is None or not len(ops) or "operands" not in ops.columns:
        return set()
    heavy = ops[ops["operands"].astype(str).str.contains('"param"|"frozen"', regex=True).to_numpy()]
    return {int(i) for i in np.nonzero(call_outputs(df, heavy))[0]}


def first_in_step(
    step_df: pd.DataFrame, wanted: tuple[str, ...], ops: pd.DataFrame | None = None
) -> tuple[pd.Series, str, str | None] | None:
    """The first row of one step holding a wanted kind not seen before, that kind, and the torch op that made
    it when a forward replay found one (``ops``)."""
    df = _ordered(step_df)
    extra = _op_rows(df, wanted, ops)
    mask = is_mask(df) | intended_rows(df, ops)
    weighed = _weight_ops(df, ops) if any(k == "neginf" for k, _ in extra.values()) else set()
    # -inf an op computed from a weight is no mask, whatever the values (a log builds one)
    for i, (k, op) in extra.items():
        if k == "neginf" and op_base(op) not in MASK_BUILDERS and i in weighed:
            mask[i] = False
    phase = df["phase"].astype(str).to_numpy()
    activation = (phase == "data") | (phase == "forward")
    has = {k: df[f"n_{k}"].to_numpy() > 0 for k in wanted}
    masked = False  # an attention mask's -inf is around: passing it on (in activations) is not producing it
    for i in range(len(df)):
        kinds = by_priority(k for k in wanted if has[k][i])
        if mask[i]:
            masked = True
        if masked and activation[i]:
            kinds = [k for k in kinds if k != "neginf"]
        if i in extra and not (mask[i] and extra[i][0] == "neginf"):  # a module that builds a mask
            return df.iloc[i], extra[i][0], extra[i][1]
        if kinds:
            return _as_loss_row(df, i), kinds[0], None
    return None


def _as_loss_row(df: pd.DataFrame, i: int) -> pd.Series:
    """Row ``i``, or the ``loss``-phase row of the same tensor (same ``event``) when row ``i`` is a backward row:
    the gradient arriving at the model's outputs is also a last child's ``grad_output``, whose hook can fire
    before the root's; the loss's backward made it, before any module's backward ran."""
    row = df.iloc[i]
    if str(row["phase"]) != "backward":
        return row
    same = df[(df["event"].to_numpy() == row["event"]) & (df["phase"].astype(str).to_numpy() == "loss")]
    return same.iloc[0] if len(same) else row


def call_of(step_df: pd.DataFrame, module: str, micro: int, before_seq: int) -> int:
    """The call index of ``module``'s invocation that was open at ``before_seq`` (its latest input row)."""
    rows = step_df[
        (step_df["module"].astype(str) == module)
        & (step_df["micro_step"] == micro)
        & (step_df["seq"] < before_seq)
        & step_df["phase"].isin(["data", "forward"])
    ]
    if len(rows) == 0:
        return 0
    return int(rows.sort_values("seq")["call"].iloc[-1])


def _type_of(records: pd.DataFrame, module: str) -> str:
    rows = records.loc[records["module"].astype(str) == module, "module_type"]
    return str(rows.iloc[0]) if len(rows) else ""


def producer(step_df: pd.DataFrame, row: pd.Series) -> tuple[str, str, int, str]:
    """(module, module_type, call, tensor) that produced the value first seen in ``row``."""
    phase = str(row["phase"])
    module, mtype, call = str(row["module"]), str(row["module_type"]), int(row["call"])
    tensor = str(row["tensor"])
    parent = row["parent"]
    if phase == "forward" and tensor.startswith("input") and isinstance(parent, str):
        pcall = call_of(step_df, parent, int(row["micro_step"]), int(row["seq"]))
        return parent, _type_of(step_df, parent), pcall, tensor
    if phase == "backward":
        owners = step_df[(step_df["event"] == row["event"])].sort_values("seq")
        owners = owners[owners["phase"].astype(str) == "backward"]
        tensors = owners["tensor"].astype(str)
        params = owners[tensors.str.endswith(".grad")]
        if len(params):
            r = params.iloc[0]
            return str(r["module"]), str(r["module_type"]), int(r["call"]), str(r["tensor"])
        gin = owners[tensors.str.startswith("grad_input")]
        if len(gin):
            r = gin.iloc[-1]
            return str(r["module"]), str(r["module_type"]), int(r["call"]), str(r["tensor"])
        first = owners.iloc[0] if len(owners) else row
        p = first["parent"]
        if isinstance(p, str):  # the enclosing module's own code made it in backward (rule 5)
            pcall = call_of(step_df, p, int(first["micro_step"]), int(first["seq"]))
            return p, _type_of(step_df, p), pcall, _child_path(p, str(first["module"]), str(first["tensor"]))
    return module, mtype, call, tensor


def _child_path(parent: str, child: str, tensor: str) -> str:
    """The gradient that an enclosing module's own code made in backward, named as its child's tensor
    (``a.grad_output[0]``: the ``grad_output`` of child ``a``), not as the enclosing module's own
    ``grad_output``, which can be finite."""
    rel = child[len(parent) + 1 :] if parent and child.startswith(parent + ".") else child
    return f"{rel}.{tensor}" if rel else tensor


def overflow_fields(row: pd.Series, raw_kind: str, who: tuple[str, str, int, str]) -> dict[str, Any]:
    """The :class:`~nantrace.Overflow` fields ``step .. dtype`` of the record ``row`` holding ``raw_kind``,
    attributed to ``who`` = ``(module, module_type, call, tensor)``."""
    module, mtype, call, tensor = who
    return dict(
        step=int(row["step"]),
        micro_step=int(row["micro_step"]),
        phase=str(row["phase"]),
        module=module,
        module_type=mtype,
        call=call,
        tensor=tensor,
        kind="nan" if raw_kind == "nan" else "inf",
        dtype=DType(str(row["dtype"])),
    )


def _candidates(records: pd.DataFrame, wanted: tuple[str, ...], ops: pd.DataFrame | None) -> list[int]:
    """Steps holding any wanted kind, or a drill-down op of one (cheap vectorised pre-filter)."""
    hit = np.zeros(len(records), dtype=bool)
    for k in wanted:
        hit |= records[f"n_{k}"].to_numpy() > 0
    steps = set(np.unique(records["step"].to_numpy()[hit]).tolist())
    ops = reaching(ops)
    if ops is not None and len(ops):
        steps |= set(ops.loc[ops["kind"].isin(wanted), "step"].tolist())
    return sorted(int(s) for s in steps)


def _rank_of(df: pd.DataFrame | None, rank: int, multi: bool) -> pd.DataFrame | None:
    if df is None or not multi or "rank" not in df.columns or not len(df):
        return df
    return df[df["rank"].to_numpy() == rank]


def rank_events(
    records: pd.DataFrame,
    wanted: tuple[str, ...],
    ops: pd.DataFrame | None = None,
    *,
    first_only: bool = False,
) -> dict[int, list[Event]]:
    """Per step: every rank's first producer (local rows), or its first received value (reduced rows only).
    Steps are read in order, each from its own rows (one grouping of the records, not a scan per step);
    ``first_only`` stops after the first step with an event."""
    out: dict[int, list[Event]] = {}
    if not len(records):
        return out
    if "reduced" not in records.columns:
        records = records.assign(reduced=False)
    if "rank" not in records.columns:
        records = records.assign(rank=0)
    ranks = sorted(int(r) for r in pd.unique(records["rank"]))
    multi = len(ranks) > 1
    per_rank = []
    for r in ranks:
        rec_r = records[records["rank"].to_numpy() == r] if multi else records
        ops_r = _rank_of(ops, r, "rank" in (ops.columns if ops is not None else ()))
        steps = set(_candidates(rec_r, wanted, ops_r))
        op_rows = _step_rows(ops_r, steps) if ops_r is not None and len(ops_r) else None
        per_rank.append((r, rec_r, ops_r, _step_rows(rec_r, steps), op_rows))
    for step in sorted({s for *_, rows, _ in per_rank for s in rows}):
        for r, rec_r, ops_r, rows, op_rows in per_rank:
            if step in rows:
                step_ops = None
                if ops_r is not None and op_rows is not None:
                    step_ops = ops_r.iloc[op_rows.get(step, _NO_ROWS)]
                ev = _step_event(rec_r.iloc[rows[step]], step, wanted, step_ops, r)
                if ev is not None:
                    out.setdefault(step, []).append(ev)
        if first_only and step in out:
            break
    return out


_NO_ROWS = np.zeros(0, dtype=np.int64)


def _step_rows(records: pd.DataFrame, steps: set[int]) -> dict[int, np.ndarray]:
    """Positions of the rows of each of ``steps`` in ``records``, in their order (one stable sort)."""
    at = records["step"].to_numpy()
    order = np.argsort(at, kind="stable")
    uniq, starts = np.unique(at[order], return_index=True)
    ends = [*starts[1:].tolist(), len(order)]
    return {
        int(u): order[a:b]
        for u, a, b in zip(uniq.tolist(), starts.tolist(), ends, strict=True)
        if int(u) in steps
    }


def _step_event(
    step_all: pd.DataFrame, step: int, wanted: tuple[str, ...], step_ops: pd.DataFrame | None, rank: int
) -> Event | None:
    """The event of one rank's ``step``, from that step's rows (``step_all``) and drill-down ops (``step_ops``;
    None when the rank's trace has none), or None."""
    reduced = step_all["reduced"].to_numpy(dtype=bool)
    step_local = step_all[~reduced]
    hit = first_in_step(step_local, wanted, step_ops) if len(step_local) else None
    red_hit = first_in_step(step_all[reduced], wanted) if reduced.any() else None
    received = False
    if red_hit is not None and (hit is None or str(hit[0]["phase"]) == "optimizer"):
        # nothing local before the reduction: what the rank holds came through it (parameters that
        # optimizer.step() made non-finite from a non-finite reduced gradient were not produced here)
        hit, received = red_hit, True
    if hit is None:
        return None
    row, k, op = hit
    who = (
        (str(row["module"]), str(row["module_type"]), int(row["call"]), str(row["tensor"]))
        if received
        else producer(step_local, row)
    )
    if op is None and step_ops is not None and who[0] != str(row["module"]):  # the enclosing call's own code
        mine = step_ops[
            (step_ops["module"].astype(str) == who[0])
            & (step_ops["call"] == who[2])
            & (step_ops["micro_step"] == int(row["micro_step"]))
            & (step_ops["kind"] == k)
        ]
        op = str(mine["op"].iloc[0]) if len(mine) else None
        if op is None:
            row, k, op = _earlier_op(step_local, step_ops, who, row, k, wanted)
            if op is not None:  # named at the call's output, as a value that never left the call
                who = (who[0], who[1], who[2], str(row["tensor"]))
    if op is None and step_ops is not None and str(row["phase"]) == "backward":
        op = _discarded_op(step_ops, who, int(row["micro_step"]))
    line = _source_of(step_ops, who, int(row["micro_step"]), op)
    return Event(overflow_fields(row, k, who), k, op, row, step_local, rank, received, line)


def _earlier_op(
    step_df: pd.DataFrame,
    step_ops: pd.DataFrame,
    who: tuple[str, str, int, str],
    row: pd.Series,
    k: str,
    wanted: tuple[str, ...],
) -> tuple[pd.Series, str, str | None]:
    """For a value first seen at a child's input that the enclosing call's own code made (``who``): the op the
    drill-down found making another wanted kind in that call, when there is one (``ops.reaches``). A replay stops
    at the first op of the call's own code that makes a non-finite value, so that op ran before the value the
    child saw (a q·kᵀ overflowing to inf, then a softmax NaN at the output projection's input): the first
    non-finite value is the op's. Returns the call's first output row holding the op's kind (else its first
    output), that kind and the op; ``(row, k, None)`` unchanged when the drill-down found none."""
    ops = reaching(step_ops)
    if ops is None or not len(ops) or str(row["phase"]) != "forward":
        return row, k, None
    micro = int(row["micro_step"])
    mine = ops[
        (ops["module"].astype(str) == who[0])
        & (ops["call"] == who[2])
        & (ops["micro_step"] == micro)
        & ops["kind"].isin(wanted)
    ]
    if not len(mine):
        return row, k, None
    kind, op = str(mine["kind"].iloc[0]), str(mine["op"].iloc[0])
    outs = step_df[
        (step_df["phase"].astype(str) == "forward")
        & (step_df["module"].astype(str) == who[0])
        & (step_df["call"] == who[2])
        & (step_df["micro_step"] == micro)
        & step_df["tensor"].astype(str).str.startswith("output")
    ]
    if not len(outs):
        return row, k, None
    holding = outs[outs["n_" + kind].to_numpy() > 0]
    return (holding if len(holding) else outs).iloc[0], kind, op


def _source_of(
    step_ops: pd.DataFrame | None, who: tuple[str, str, int, str], micro: int, op: str | None
) -> str | None:
    """The user's source line the drill-down noted for ``op`` in the producing call (``ops.source``)."""
    if op is None or step_ops is None or "source" not in step_ops.columns:
        return None
    mine = step_ops[
        (step_ops["module"].astype(str) == who[0])
        & (step_ops["call"] == who[2])
        & (step_ops["micro_step"] == micro)
        & (step_ops["op"].astype(str) == op)
    ]
    lines = [v for v in mine["source"].tolist() if isinstance(v, str)]
    return lines[0] if lines else None


def _discarded_op(step_ops: pd.DataFrame, who: tuple[str, str, int, str], micro: int) -> str | None:
    """For a NaN made in backward: the op of the producing call's forward whose non-finite value its output
    discarded (``reaches`` False), which the backward then turned into NaN (0·inf of ``where``'s backward)."""
    if "reaches" not in step_ops.columns:
        return None
    mine = step_ops[
        (step_ops["module"].astype(str) == who[0])
        & (step_ops["call"] == who[2])
        & (step_ops["micro_step"] == micro)
        & ~step_ops["reaches"].to_numpy(dtype=bool)
    ]
    return str(mine["op"].iloc[0]) if len(mine) else None


def find(
    records: pd.DataFrame,
    wanted: tuple[str, ...],
    ops: pd.DataFrame | None,
    *,
    world_size: int | None,
    first_only: bool,
    per_rank: bool = False,
) -> list[Finding]:
    """The locator over records of one or more ranks (ordering rule in the module docstring).

    ``per_rank=False``: for each step, the first producer across ranks; ``per_rank=True``: for each step,
    every rank's own first non-finite value (``received`` where the rank only received it)."""
    events = rank_events(records, wanted, ops, first_only=first_only)
    ranks = sorted(int(r) for r in pd.unique(records["rank"])) if len(records) and "rank" in records else [0]
    complete = len(ranks) == world_size if world_size is not None else len(ranks) > 1
    n = len(ranks)
    found: list[Finding] = []
    for step in sorted(events):
        evs = sorted(events[step], key=lambda e: e.order)
        holders = tuple(e.rank for e in evs)
        if per_rank:
            mine = sorted(evs, key=lambda e: e.rank)
            made = complete and all(e.received for e in evs)
            for i, e in enumerate(mine):
                how = "reduction" if made and i == 0 else ("received" if e.received else "produced")
                found.append(Finding(e, how, holders if how == "reduction" else (), n))
        else:
            produced = [e for e in evs if not e.received]
            if produced:
                got = tuple(e.rank for e in evs if e.received)
                found.append(Finding(produced[0], "produced", got, n))
            else:
                first = min(evs, key=lambda e: e.rank)
                found.append(Finding(first, "reduction" if complete else "received", holders, n))
        if first_only and found:
            break
    return found
