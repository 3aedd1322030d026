"""The one number formatter and the small word helpers every text of nantrace uses (a leaf module)."""

from __future__ import annotations

import math
from collections.abc import Sequence

__all__ = ["attr_path", "module_label", "num", "steps_text"]


def num(v: float | None) -> str:
    """A number in 4 significant digits (``n/a`` for None/NaN); an integer from 1e4 to 1e7 in full, so float16's
    limit prints as ``65504``, not ``6.55e+04``."""
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "n/a"
    v = float(v)
    if math.isnan(v):
        return "n/a"
    if math.isfinite(v) and 1e4 <= abs(v) < 1e7 and v == round(v):
        return f"{v:.0f}"
    return f"{v:.4g}"


def module_label(module: str) -> str:
    """```name``` in backticks, or ``the root model`` for ``""``."""
    return f"`{module}`" if module else "the root model"


def attr_path(module: str) -> str:
    """Python expression reaching ``module`` from ``model``: ``"layers.0.attn"`` → ``model.layers[0].attn``."""
    out = "model"
    if not module:
        return out
    for part in module.split("."):
        out += f"[{part}]" if part.isdigit() else (f".{part}" if part.isidentifier() else f"[{part!r}]")
    return out


def steps_text(steps: Sequence[int]) -> str:
    """``"3"``, ``"3–7"`` for a range, else the first eight and a count: ``"0, 4, 5, … (12 in all)"``."""
    s = sorted(set(steps))
    if not s:
        return "none"
    if len(s) == 1:
        return str(s[0])
    if s[-1] - s[0] == len(s) - 1:
        return f"{s[0]}–{s[-1]}"
    shown = ", ".join(str(x) for x in s[:8])
    return shown + (f", … ({len(s)} in all)" if len(s) > 8 else "")
