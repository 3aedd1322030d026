"""nantrace's one error class (a leaf: imports nothing of nantrace)."""

from __future__ import annotations

__all__ = ["NantraceError"]


class NantraceError(ValueError):
    """nantrace's one error class for misuse that is not a plain wrong type (a ``ValueError``)."""
