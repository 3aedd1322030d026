"""The mask rule (locator rule 3), on arrays and on ``records`` frames (a leaf module).

A tensor is an attention mask when it holds no NaN or +inf and either its name says so (the forward parameter it
was passed as, or its path, contains ``"mask"`` or ``"bias"``, as in ``attention_mask`` or ``attn_bias``) or
every value is 0 or -inf with at least one 0 (a tensor of -inf alone would mask every position: it is an
overflow to -inf, as in a small head whose every output went below the dtype's lowest value); the value rule does
not apply to the model's first positional argument (``input[0]``
of phase data: the features, where ``log(one_hot)`` is data). A mask's -inf is recorded but never reported.

A *finite* additive mask (``torch.finfo(dtype).min`` where masked, 0 elsewhere, as transformers builds them) holds
no inf, so rule 3 never applies to it; but its absmax is its dtype's max, which is no activation's range.
:func:`lowest_masks` finds such rows from their statistics alone (every non-zero value is the dtype's lowest),
so headroom tables and the input ranges quoted in explanations leave them out.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pandas as pd

from ._schema import MASK_KIND, dtype_max

__all__ = [
    "FEATURES",
    "MASK_WORDS",
    "RULE_COLUMNS",
    "call_outputs",
    "intended_rows",
    "is_mask",
    "lowest_masks",
    "mask_named",
    "mask_rows",
    "names_flag",
    "unmasked",
]

MASK_WORDS = ("mask", "bias")  # attention_mask, src_mask, attn_bias, position_bias, alibi_bias, ...
FEATURES = "input[0]"  # the path of the model's first positional argument (phase "data"): its features
# the records columns the rule reads (``arg`` is optional: without it only the tensor path is read for names)
RULE_COLUMNS = ("phase", "tensor", "n_nan", "n_posinf", "n_neginf", "n_zero", "numel")


def mask_named(name: str) -> bool:
    """True when a parameter name or tensor path says it is an additive attention mask or bias."""
    low = name.lower()
    return any(w in low for w in MASK_WORDS)


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
    argument, ``input[0]`` of phase data, where the value rule "every value is 0 or -inf, and one is 0" does not
    apply, so
    ``log(one_hot)`` there is data, not a mask)."""
    only_mask_values = ((n_zero + n_neginf) == numel) & (n_zero > 0)  # all -inf masks everything: no mask
    if features is not None:
        only_mask_values = only_mask_values & ~features
    return (n_neginf > 0) & (n_nan == 0) & (n_posinf == 0) & activation & (named | only_mask_values)


def names_flag(col: Any) -> np.ndarray:
    """Boolean array: which values of a (categorical or plain) text column are mask names."""
    if isinstance(col.dtype, pd.CategoricalDtype):
        cats = np.array([mask_named(str(v)) for v in col.cat.categories], dtype=bool)
        codes = col.cat.codes.to_numpy()
        return np.where(codes >= 0, cats[np.maximum(codes, 0)] if len(cats) else False, False)
    return np.array([mask_named(str(v)) for v in col.fillna("").to_numpy()], dtype=bool)


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
        names_flag(df["tensor"]) | (names_flag(df["arg"]) if "arg" in df.columns else False),
        (phase == "data") & (df["tensor"].astype(str).to_numpy() == FEATURES),
    )


def intended_rows(df: pd.DataFrame, ops: pd.DataFrame | None) -> np.ndarray:
    """Boolean array over ``df`` (records): the forward output rows, holding -inf and no NaN or +inf, of module
    calls whose -inf the drill-down showed was made only by ops taking a -inf scalar (``ops.kind`` equal to
    :data:`~nantrace._schema.MASK_KIND`: masked logits, a causal mask built in the forward): intended mask
    values, like a mask input (rule 3)."""
    out = np.zeros(len(df), dtype=bool)
    if ops is None or not len(ops) or "kind" not in ops.columns or not len(df):
        return out
    made = ops[ops["kind"].astype(str).to_numpy() == MASK_KIND]
    clean = (df["n_nan"].to_numpy() == 0) & (df["n_posinf"].to_numpy() == 0) & (df["n_neginf"].to_numpy() > 0)
    return call_outputs(df, made) & clean


def call_outputs(df: pd.DataFrame, calls: pd.DataFrame) -> np.ndarray:
    """Boolean array over ``df`` (records): the forward output rows of the module calls listed in ``calls`` (an
    ``ops`` frame: ``step, micro_step, module, call``, and ``rank`` when both have it)."""
    out = np.zeros(len(df), dtype=bool)
    if not len(calls) or not len(df):
        return out
    key_cols = ["step", "micro_step", "module", "call"]
    if "rank" in calls.columns and "rank" in df.columns:
        key_cols.append("rank")
    wanted = set(zip(*(calls[c].astype(str).tolist() for c in key_cols), strict=True))
    tensors = df["tensor"].astype(str).to_numpy().astype(str)
    where = (df["phase"].astype(str).to_numpy() == "forward") & np.char.startswith(tensors, "output")
    keys = zip(*(df[c].astype(str).tolist() for c in key_cols), strict=True)
    for i, key in enumerate(keys):
        out[i] = bool(where[i]) and key in wanted
    return out


def unmasked(df: pd.DataFrame, ops: pd.DataFrame | None = None) -> pd.DataFrame:
    """``df`` (records) with each attention mask's -inf left out of its counts: ``n_neginf`` is 0 on the rows
    :func:`is_mask` calls masks, and on those ``ops`` shows were masked in the forward (:func:`intended_rows`;
    their ``absmax`` is already over finite values only).

    For what people read as overflow (headroom tables, absmax summaries, reprs, plots): a mask's -inf is
    intended, never an overflow. ``records`` itself keeps the counts. A frame lacking one of
    :data:`RULE_COLUMNS` (a hand-made subset), or one without a mask row, is returned as it is (not copied).
    """
    if not len(df) or any(c not in df.columns for c in RULE_COLUMNS):
        return df
    mask = is_mask(df) | intended_rows(df, ops)
    if not mask.any():
        return df
    out = df.copy()
    neginf = out["n_neginf"].to_numpy().copy()
    neginf[mask] = 0
    out["n_neginf"] = neginf
    return out


def lowest_masks(df: pd.DataFrame) -> np.ndarray:
    """Boolean array: the data/forward rows of ``df`` (records) that are finite additive masks, every value 0 or
    its dtype's lowest finite value (``torch.finfo(dtype).min``): no inf/NaN, ``max <= 0``, ``min`` at minus the
    dtype's max and the smallest non-zero ``|x|`` equal to it. Read from the row's statistics only."""
    if len(df) == 0:
        return np.zeros(0, dtype=bool)
    phase = df["phase"].astype(str).to_numpy()
    lim = np.array([dtype_max(d) for d in df["dtype"].astype(str).to_numpy()], dtype=np.float64)
    lo = df["min"].to_numpy(dtype=np.float64)
    hi = df["max"].to_numpy(dtype=np.float64)
    least = df["absmin"].to_numpy(dtype=np.float64)
    clean = (df["n_nan"].to_numpy() + df["n_posinf"].to_numpy() + df["n_neginf"].to_numpy()) == 0
    with np.errstate(invalid="ignore"):
        return ((phase == "data") | (phase == "forward")) & clean & (hi <= 0) & (lo == -lim) & (least == lim)
