"""The options of :func:`nantrace.trace`, in one object: :class:`TraceOptions` checks them once, and the
recording, ``nantrace run``, the CLI and the framework callbacks all take them from it."""

from __future__ import annotations

import dataclasses
import fnmatch
import os
from collections.abc import Callable, Iterable
from typing import Any

from torch import nn

from ._schema import PHASES

__all__ = ["ModuleFilter", "TraceOptions", "compile_filter"]

ModuleFilter = (
    str | type | Callable[[str, nn.Module], bool] | Iterable[str | type | Callable[[str, nn.Module], bool]]
)


def compile_filter(modules: ModuleFilter | None) -> Callable[[str, nn.Module], bool]:
    """``modules=`` as a predicate ``(name, module) -> bool``.

    Raises:
        TypeError: ``modules`` (or one of its items) is not a name glob, an ``nn.Module`` subclass or instance,
            or a callable.
        ValueError: ``modules`` is an empty collection.
    """
    if modules is None:
        return lambda name, m: True
    single = isinstance(modules, (str, type, nn.Module)) or callable(modules)
    if not single and not isinstance(modules, (list, tuple, set, frozenset)):
        raise TypeError(
            f"modules= must be a name glob (str), an nn.Module subclass or instance, a callable "
            f"(name, module) -> bool, or a list of these; got {type(modules).__name__}: {modules!r:.80}"
        )
    items: list[Any] = [modules] if single else list(modules)  # type: ignore[arg-type]
    if not items:
        raise ValueError(
            "modules= is an empty collection; pass None to trace every module, or names/globs/types"
        )
    for it in items:
        ok = isinstance(it, (str, nn.Module)) or (isinstance(it, type) and issubclass(it, nn.Module))
        if not ok and (isinstance(it, type) or not callable(it)):
            raise TypeError(
                "modules= items must be name globs (str), nn.Module subclasses or instances, or callables "
                f"(name, module) -> bool; got {it!r:.80} of type {type(it).__name__}"
            )

    def keep(name: str, m: nn.Module) -> bool:
        for it in items:
            if isinstance(it, str):
                if fnmatch.fnmatchcase(name, it):
                    return True
            elif isinstance(it, nn.Module):
                if m is it:
                    return True
            elif isinstance(it, type):
                if isinstance(m, it):
                    return True
            elif it(name, m):
                return True
        return False

    return keep


def _phase_set(phases: Iterable[str] | str | None) -> frozenset[str]:
    if phases is None:
        return frozenset(PHASES)
    if isinstance(phases, str):  # "forward" or a comma-separated list, as the CLI takes it
        phases = [p.strip() for p in phases.split(",")] if "," in phases else [phases]
    if not isinstance(phases, (list, tuple, set, frozenset)):
        raise TypeError(
            f"phases= must be a phase name or a list of them, from {list(PHASES)}; got {phases!r}"
        )
    phase_set = frozenset(phases)
    unknown = sorted(repr(p) for p in phase_set - set(PHASES))
    if unknown:
        raise ValueError(f"phases= has unknown phase(s) {', '.join(unknown)}; choose from {list(PHASES)}")
    if not phase_set:
        raise ValueError(
            "phases= is empty, so nothing would be recorded; pass None to record every phase, "
            f"or some of {list(PHASES)}"
        )
    return phase_set


def _positive(value: Any, name: str, what: str, *, optional: bool = False) -> None:
    if optional and value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        none = "None (off) or " if optional else ""
        raise ValueError(f"{name} must be {none}an int ≥ 1 ({what}); got {value!r}")


@dataclasses.dataclass(frozen=True)
class TraceOptions:
    """The keyword options of :func:`nantrace.trace` (see there for their meaning), checked on construction.

    Raises:
        TypeError: ``phases``, ``modules``, ``drill``, ``sync_free``, ``path`` or ``capture`` has the wrong type.
        ValueError: an unknown or empty ``phases``, an empty ``modules``, or ``every``/``flush_every``/
            ``live_every`` not an int ≥ 1 (``live_every`` may be None).
    """

    modules: Any = None
    phases: Any = None
    sync_free: bool | None = None
    drill: bool = True
    every: int = 1
    path: str | os.PathLike[str] | None = None
    flush_every: int = 100
    live_every: int | None = None
    capture: str | list[str] | tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        compile_filter(self.modules)  # its type only: whether it matches a module needs the model
        _phase_set(self.phases)
        if isinstance(self.every, bool) or not isinstance(self.every, int):
            raise TypeError(
                f"every must be an int ≥ 1 (record full statistics every N-th step); got {self.every!r}. "
                "Use every=1 to record every step."
            )
        if self.every < 1:
            raise ValueError(
                f"every must be an int ≥ 1 (record full statistics every N-th step); got {self.every!r}. "
                "Use every=1 to record every step."
            )
        _positive(self.flush_every, "flush_every", "steps kept in memory between writes")
        _positive(self.live_every, "live_every", "check every N-th step across ranks", optional=True)
        if not isinstance(self.drill, bool):
            raise TypeError(f"drill must be True or False; got {self.drill!r}")
        if self.sync_free is not None and not isinstance(self.sync_free, bool):
            raise TypeError(f"sync_free must be True, False or None; got {self.sync_free!r}")
        if self.path is not None and not isinstance(self.path, (str, os.PathLike)):
            raise TypeError(
                f"path must be a str or os.PathLike; got {type(self.path).__name__}: {self.path!r:.80}"
            )

    @property
    def phase_set(self) -> frozenset[str]:
        """The phases to record."""
        return _phase_set(self.phases)

    def replace(self, **changes: Any) -> TraceOptions:
        """A copy with ``changes`` applied (and checked)."""
        return dataclasses.replace(self, **changes)

    @classmethod
    def names(cls) -> tuple[str, ...]:
        """The option names, in the order of :func:`nantrace.trace`'s signature."""
        return tuple(f.name for f in dataclasses.fields(cls))
