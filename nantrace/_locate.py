"""The locator: plain pandas over ``records``, naming who *produced* the first non-finite value.

Rules (from the design contract), applied to one step's rows in time order — data, forward in call order,
loss, backward in execution order, optimizer — within each micro-step:

1. A module call produced a kind (NaN, +inf, -inf) when its output holds it and none of its inputs did. Taken in
   time order, the first row holding a kind not seen before is exactly that output.
2. A kind that first shows up at a module's *input* was made by the enclosing module's own ``forward`` (an op
   between its children): that enclosing module (the row's ``parent``) is reported.
3. An attention mask is not a fault. A tensor is a mask when it holds no NaN or +inf and either its name says so
   (the forward parameter it was passed as, or its path, contains ``"mask"`` or ``"bias"``, as in
   ``attention_mask`` or ``attn_bias``) or every value is 0 or -inf; the value rule does not apply to the
   model's first positional argument (``input[0]`` of phase data: the features, where ``log(one_hot)`` is
   data). Its -inf is recorded (``n_neginf``) but never reported, and passing it on in activations is not
   producing it, also when it reaches the model's output (masked logits are a legitimate output; the contract
   says a mask's -inf is never reported). NaN/+inf, or -inf in a model input that is not a mask (e.g. ``log(0)`` in a feature), is a
   ``data`` fault. The forward drill-down names an op only for a kind it *produced* (a non-finite scalar
   argument such as ``masked_fill(m, -inf)`` counts as an input: ``_stats.op_input_kinds``).
4. ``loss``: outputs were finite but the loss, or the gradient arriving at the outputs, was not.
5. ``backward``: the first non-finite gradient. One gradient value can be seen by several hooks (the output of
   one module is the input of the next; rows sharing an ``event``); it is attributed to the module whose
   backward computed it: a parameter's owner, else the module it is ``grad_input`` of (the innermost), else
   the enclosing module whose own code consumed that output.
6. ``optimizer``: the first parameter that ``optimizer.step()`` made non-finite; ``module`` is its owner.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import torch

__all__ = ["KINDS", "Overflow", "is_mask", "locate", "mask_rows", "overflows"]

KINDS = ("nan", "posinf", "neginf")
_PHASE_RANK = {"data": 0, "forward": 1, "loss": 2, "backward": 3, "optimizer": 4}
OVERFLOW_COLUMNS = (
    "step",
    "micro_step",
    "phase",
    "module",
    "module_type",
    "call",
    "tensor",
    "kind",
    "dtype",
    "rank",
    "propagated",
)


class DType(str):
    """A dtype name (``"float16"``) that also compares equal to ``torch.float16`` and ``"torch.float16"``."""

    def __eq__(self, other: object) -> bool:
        if isinstance(other, torch.dtype):
            return str(other) == "torch." + str(self)
        if isinstance(other, str):
            return str.__eq__(self, other.removeprefix("torch."))
        return NotImplemented

    def __ne__(self, other: object) -> bool:
        eq = self.__eq__(other)
        return eq if eq is NotImplemented else not eq

    __hash__ = str.__hash__


@dataclass(frozen=True)
class Overflow:
    """Where the first non-finite value was produced, and why, in words.

    Attributes:
        step: optimizer step (0-based).
        micro_step: root forward call inside the step (0-based; > 0 with gradient accumulation).
        phase: ``"data"``, ``"forward"``, ``"loss"``, ``"backward"`` or ``"optimizer"``.
        module: qualified module name of the producer (``""`` is the root model).
        module_type: the producer's class name, e.g. ``"Linear"``.
        call: 0-based index of the producer's call inside the micro-step (a module reused 3 times has 0, 1, 2).
        tensor: path of the first non-finite tensor, e.g. ``"output"``, ``"grad_input[0]"``, ``"weight"``.
        kind: ``"inf"`` (+inf or -inf) or ``"nan"``.
        dtype: dtype name of that tensor, e.g. ``"float16"`` (compares equal to ``torch.float16`` too).
        message: one or two sentences explaining it, with the numbers that matter; ``str(overflow)``.
        rank: the ``torch.distributed`` rank whose trace holds it (0 without a process group); in a merged trace
            of several ranks, the rank that produced it (ordering rule: ``nantrace._dist``).
        propagated: True when this rank did not produce the value but only received it through the gradient
            reduction (it is only in ``reduced`` rows: DDP's all-reduce, FSDP's reduce-scatter).
    """

    step: int
    micro_step: int
    phase: str
    module: str
    module_type: str
    call: int
    tensor: str
    kind: str
    dtype: str
    message: str = field(default="", compare=False, repr=False)
    rank: int = 0
    propagated: bool = False
    # the trace's capture state (nantrace._repro.Capture) with trace(capture=...), for save_repro(); not a field
    _captured: Any = field(default=None, compare=False, repr=False)

    def __str__(self) -> str:
        return self.message

    def to_dict(self) -> dict[str, Any]:
        """The fields (without ``message``) as a plain dict."""
        return {k: getattr(self, k) for k in OVERFLOW_COLUMNS}

    def save_repro(self, path: str | os.PathLike[str]) -> Path:
        """Write a reproducer of *this* overflow's module call, captured by ``nantrace.trace(..., capture=...)``,
        to ``path`` (``~`` is expanded).

        The file holds the captured module's class path and pickled object, its ``state_dict`` right after
        the call, the call's args/kwargs (copies taken when the call started) with their ``requires_grad``,
        its dtype and the autocast state (format: ``nantrace._repro``). The write is atomic (a temporary file
        renamed over ``path``). :func:`nantrace.load_repro` rebuilds it; ``repro.run()`` reproduces the call
        in isolation and ``nantrace.hunt(repro.run)`` names the op.

        Only a forward overflow whose own call was captured can be saved here: the trace's captured call (the
        first watched call whose forward produced a non-finite value) must be this Overflow's event (same
        step, micro-step, module and call), or the call of a module enclosing it in the same step and
        micro-step (``capture="ff"`` for an overflow in ``ff.wo``: the saved call contains it). Otherwise (a scaler backoff in ``loss``, a backward overflow, an
        overflow in a module that was not watched) it raises rather than save another event; save whatever
        was captured with :meth:`nantrace.Trace.save_repro`.

        Returns:
            the path written, as a ``pathlib.Path``.

        Raises:
            NantraceError: the trace had no ``capture=`` or captured nothing (the message names the watched
                modules and where this overflow is), the captured call is not this overflow's event (the
                message names both), or the module's class (or a submodule's) cannot be imported back by its
                path (defined in ``__main__``, e.g. a notebook, or inside a function): move it to an importable
                module.
            TypeError / ValueError: ``path`` is not a path, is a directory, or its directory does not exist
                or is not writable.
        """
        from ._repro import captured_call, save_repro

        return save_repro(captured_call(self._captured, self, for_overflow=True), path)


# ---------------------------------------------------------------------------------------------- masks
MASK_WORDS = ("mask", "bias")  # attention_mask, src_mask, attn_bias, position_bias, alibi_bias, ...


def mask_named(name: str) -> bool:
    """True when a parameter name or tensor path says it is an additive attention mask or bias."""
    low = name.lower()
    return any(w in low for w in MASK_WORDS)


def _names_mask(values: Any) -> np.ndarray:
    return np.array([mask_named(str(v)) for v in values], dtype=bool)


FEATURES = "input[0]"  # the path of the model's first positional argument (phase "data"): its features


def mask_rows(
    n_nan: np.ndarray,
    n_posinf: np.ndarray,
    n_neginf: np.ndarray,
    n_zero: np.ndarray,
    numel: np.ndarray,
    activation: np.ndarray,
    named: np.ndarray,
    features: np.ndarray | None = None,
) -> np.ndarray:
    """Rule 3 on arrays: rows that are attention masks (``activation``: data/forward rows; ``named``: the
    parameter name or path contains "mask" or "bias"; ``features``: the rows of the model's first positional
    argument, ``input[0]`` of phase data, where the value rule "every value is 0 or -inf" does not apply, so
    ``log(one_hot)`` there is data, not a mask)."""
    only_mask_values = (n_zero + n_neginf) == numel
    if features is not None:
        only_mask_values = only_mask_values & ~features
    return (n_neginf > 0) & (n_nan == 0) & (n_posinf == 0) & activation & (named | only_mask_values)


def is_mask(df: pd.DataFrame) -> np.ndarray:
    """Boolean array: which rows of ``df`` (records) are attention masks whose -inf is not a fault (rule 3)."""
    if len(df) == 0:
        return np.zeros(0, dtype=bool)
    phase = df["phase"].astype(str).to_numpy()
    return mask_rows(
        df["n_nan"].to_numpy(),
        df["n_posinf"].to_numpy(),
        df["n_neginf"].to_numpy(),
        df["n_zero"].to_numpy(),
        df["numel"].to_numpy(),
        (phase == "data") | (phase == "forward"),
        _categorical_flag(df["tensor"]) | _categorical_flag(df["arg"]),
        (phase == "data") & (df["tensor"].astype(str).to_numpy() == FEATURES),
    )


def _categorical_flag(col: pd.Series) -> np.ndarray:
    if isinstance(col.dtype, pd.CategoricalDtype):
        cats = _names_mask(col.cat.categories)
        codes = col.cat.codes.to_numpy()
        return np.where(codes >= 0, cats[np.maximum(codes, 0)] if len(cats) else False, False)
    return _names_mask(col.fillna("").to_numpy())


# ---------------------------------------------------------------------------------------------- locator
def _wanted(kind: str | None) -> tuple[str, ...]:
    if kind is None:
        return KINDS
    if kind == "nan":
        return ("nan",)
    if kind == "inf":
        return ("posinf", "neginf")
    raise ValueError(f"kind must be None, 'inf' or 'nan'; got {kind!r}")


def _ordered(step_df: pd.DataFrame) -> pd.DataFrame:
    rank = step_df["phase"].astype(str).map(_PHASE_RANK).to_numpy()
    return step_df.assign(_rank=rank).sort_values(["micro_step", "_rank", "seq"], kind="stable")


def _first_in_step(
    step_df: pd.DataFrame, wanted: tuple[str, ...], ops: pd.DataFrame | None = None
) -> tuple[pd.Series, str, str | None] | None:
    """The first row of one step holding a wanted kind not seen before, that kind, and the torch op that made
    it when a forward replay found one (``ops``)."""
    df = _ordered(step_df)
    mask = is_mask(df)
    phase = df["phase"].astype(str).to_numpy()
    activation = (phase == "data") | (phase == "forward")
    has = {k: df[f"n_{k}"].to_numpy() > 0 for k in wanted}
    extra: dict[int, tuple[str, str]] = {}
    if ops is not None and len(ops):
        tensors = df["tensor"].astype(str).to_numpy()
        phases = df["phase"].astype(str).to_numpy()
        modules = df["module"].astype(str).to_numpy()
        for op in ops.itertuples():
            if op.kind not in wanted:
                continue
            hit = np.nonzero(
                (phases == "forward")
                & (modules == op.module)
                & (df["call"].to_numpy() == op.call)
                & (df["micro_step"].to_numpy() == op.micro_step)
                & np.char.startswith(tensors.astype(str), "output")
            )[0]
            if len(hit):
                extra.setdefault(int(hit[0]), (str(op.kind), str(op.op)))
    masked = False  # an attention mask's -inf is around: passing it on (in activations) is not producing it
    for i in range(len(df)):
        kinds = [k for k in wanted if has[k][i]]
        if mask[i]:
            masked = True
        if masked and activation[i]:
            kinds = [k for k in kinds if k != "neginf"]
        if i in extra and not (mask[i] and extra[i][0] == "neginf"):  # a module that builds a mask
            return df.iloc[i], extra[i][0], extra[i][1]
        if kinds:
            return df.iloc[i], kinds[0], None
    return None


def _call_of(step_df: pd.DataFrame, module: str, micro: int, before_seq: int) -> int:
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


def _producer(step_df: pd.DataFrame, row: pd.Series) -> tuple[str, str, int, str]:
    """(module, module_type, call, tensor) that produced the value first seen in ``row``."""
    phase = str(row["phase"])
    module, mtype, call = str(row["module"]), str(row["module_type"]), int(row["call"])
    tensor = str(row["tensor"])
    parent = row["parent"]
    has_parent = isinstance(parent, str)
    if phase == "forward" and tensor.startswith("input") and has_parent:
        pcall = _call_of(step_df, parent, int(row["micro_step"]), int(row["seq"]))
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
        if isinstance(p, str):
            pcall = _call_of(step_df, p, int(first["micro_step"]), int(first["seq"]))
            return p, _type_of(step_df, p), pcall, str(first["tensor"])
    return module, mtype, call, tensor


def torch_builtin(module: Any) -> bool:
    """True when ``module``'s class runs torch's own ``forward`` (``type(module).forward`` is defined in a
    ``torch.*`` module): ``nn.Linear`` and ``class MyLinear(nn.Linear): pass`` are, a hand-written class named
    ``Linear`` or ``LayerNorm`` is not."""
    fwd = getattr(type(module), "forward", None)
    return str(getattr(fwd, "__module__", "") or "").split(".", 1)[0] == "torch"


def hunt_hint(
    step_df: pd.DataFrame,
    row: pd.Series,
    fields: dict[str, Any],
    raw_kind: str,
    op: str | None,
    builtin: Callable[[str], bool | None] | None = None,
) -> str:
    """A sentence pointing to ``nantrace.hunt`` when module hooks cannot name the op, else ``""``.

    Rule (forward and backward overflows only), any of:

    * *internal*: the forward drill-down named an op whose kind is not the kind at the module's output (e.g. a
      ``matmul`` inf that the module returned as NaN);
    * *container*: at least one traced submodule ran inside the module in this step, so its own code between
      them holds ops that module hooks cannot tell apart;
    * *hand-written*: the module's class does not run torch's own ``forward``, so its forward (and backward)
      is the user's own sequence of ops. With the live model (``builtin``: the recording Trace resolves the
      reported name to the module, :func:`torch_builtin`) that is judged by where ``type(m).forward`` is
      defined, so a subclass ``class MyLinear(nn.Linear): pass`` is built-in and a hand-written class named
      ``Linear`` is not. Without it (a loaded trace, a model gone) by the class name: ``module_type`` is
      not a name of a ``torch.nn`` module class.

    So only a built-in ``torch.nn`` leaf layer (``Linear``, ``Conv2d``, ``Embedding``...) whose output held the
    kind its op made is reported without the hint: the layer is the answer.
    """
    phase, module = fields["phase"], str(fields["module"])
    if phase not in ("forward", "backward"):
        return ""
    prefix = f"{module}." if module else ""
    names = step_df["module"].astype(str).unique()
    n_sub = sum(1 for n in names if n != module and n.startswith(prefix))
    internal = phase == "forward" and op is not None and int(row[f"n_{raw_kind}"]) == 0
    mtype = str(fields["module_type"])
    is_builtin = builtin(module) if builtin is not None else None
    if is_builtin is None:
        layer = getattr(torch.nn, mtype, None)
        is_builtin = isinstance(layer, type) and issubclass(layer, torch.nn.Module)
    if not internal and n_sub == 0 and is_builtin:
        return ""
    name = f"`{module}`" if module else "the root model"
    what = {"nan": "NaN", "posinf": "+inf", "neginf": "-inf"}[raw_kind]
    if internal:
        why = f"the {what} was made inside {name} by `{op}` and never reached its output"
    elif n_sub:
        why = f"{name} has {n_sub} traced submodule(s), and the ops of its own code between them are not seen one by one"
    else:
        why = f"{name} is hand-written code ({mtype}), a sequence of ops"

    how = (
        f'; or trace again with capture="{module}" and hunt the saved call: ov.save_repro(path), then '
        "nantrace.hunt(nantrace.load_repro(path).run)"
        if phase == "forward"
        else ": it names the backward op and the forward line it belongs to"
    )
    also = ' (kind="nan" for the op that made the NaN itself)' if fields["kind"] == "nan" else ""
    return (
        f" To name the exact op and source line ({why}), run this step under nantrace.hunt(step_fn){also}, "
        f"which is slow: every op is checked{how}."
    )


def overflow_fields(row: pd.Series, raw_kind: str, producer: tuple[str, str, int, str]) -> dict[str, Any]:
    """The :class:`Overflow` fields (without ``message``/``rank``) of the record ``row`` holding ``raw_kind``
    (``"nan"``, ``"posinf"``, ``"neginf"``), attributed to ``producer`` = ``(module, module_type, call, tensor)``."""
    module, mtype, call, tensor = producer
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


def _candidates(records: pd.DataFrame, wanted: tuple[str, ...]) -> pd.Series:
    """Steps holding any wanted kind (cheap vectorised pre-filter)."""
    hit = np.zeros(len(records), dtype=bool)
    for k in wanted:
        hit |= records[f"n_{k}"].to_numpy() > 0
    return pd.Series(np.unique(records["step"].to_numpy()[hit]))


def _find(
    records: pd.DataFrame,
    kind: str | None,
    steps: pd.DataFrame | None,
    first_only: bool,
    ops: pd.DataFrame | None = None,
    world_size: int | None = None,
    per_rank: bool = False,
    builtin: Callable[[str], bool | None] | None = None,
) -> list[Overflow]:
    from ._report import explain

    wanted = _wanted(kind)
    found: list[Overflow] = []
    if len(records) == 0:
        return found
    rank = int(records["rank"].iloc[0]) if "rank" in records.columns else 0
    reduced = "reduced" in records.columns and bool(records["reduced"].to_numpy(dtype=bool).any())
    if "rank" in records.columns and (reduced or bool((records["rank"] != rank).any())):
        from ._dist import find_across_ranks  # several ranks, or reduced gradients: the cross-rank rules

        return find_across_ranks(records, wanted, steps, first_only, ops, world_size, per_rank)
    candidates = set(_candidates(records, wanted).tolist())
    if ops is not None and len(ops):
        candidates |= set(ops.loc[ops["kind"].isin(wanted), "step"].tolist())
    for step in sorted(candidates):
        step_df = records[records["step"] == step]
        step_ops = ops[ops["step"] == step] if ops is not None and len(ops) else None
        hit = _first_in_step(step_df, wanted, step_ops)
        if hit is None:
            continue
        row, k, op = hit
        fields = overflow_fields(row, k, _producer(step_df, row))
        message = explain(records, step_df, row, fields, k, steps, op)
        message += hunt_hint(step_df, row, fields, k, op, builtin)
        found.append(Overflow(**fields, message=message, rank=rank))
        if first_only:
            break
    return found


def locate(
    records: pd.DataFrame,
    kind: str | None = None,
    steps: pd.DataFrame | None = None,
    ops: pd.DataFrame | None = None,
    world_size: int | None = None,
    builtin: Callable[[str], bool | None] | None = None,
) -> Overflow | None:
    """The first producer of a non-finite value in ``records`` (``None`` when there is none).

    ``builtin(module_name)``: whether that module runs torch's own ``forward`` (``None``: unknown), for the
    hunt hint (:func:`hunt_hint`); the recording Trace passes one that looks at the live model.

    With rows of several ranks (``records["rank"]``) or reduced gradients, the cross-rank rules of
    ``nantrace._dist`` apply; ``world_size`` says how many ranks the run had (``None``: the ranks present).

    Raises:
        ValueError: ``kind`` is not ``None``, ``"inf"`` or ``"nan"``.
    """
    found = _find(records, kind, steps, True, ops, world_size, builtin=builtin)
    return found[0] if found else None


def overflows(
    records: pd.DataFrame,
    kind: str | None = None,
    steps: pd.DataFrame | None = None,
    ops: pd.DataFrame | None = None,
    world_size: int | None = None,
    per_rank: bool = False,
    builtin: Callable[[str], bool | None] | None = None,
) -> pd.DataFrame:
    """One row per step that saw a non-finite value: that step's first producer (columns of :class:`Overflow`
    plus ``message``). ``per_rank=True``: one row per (step, rank) instead, each rank's own first non-finite
    value (``propagated`` where the rank only received it through the gradient reduction)."""
    found = _find(records, kind, steps, False, ops, world_size, per_rank, builtin)
    cols = [*OVERFLOW_COLUMNS, "message"]
    df = pd.DataFrame([{**o.to_dict(), "message": o.message} for o in found], columns=cols)
    if len(df):
        ints = ["step", "micro_step", "call", "rank"]
        df[ints] = df[ints].astype("int64")
        df["propagated"] = df["propagated"].astype(bool)
    return df
