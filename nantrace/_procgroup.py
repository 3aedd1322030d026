"""torch.distributed for the recorder: the rank and world size of a recording, the run id every rank shares,
and the file each rank's part is written to (see :mod:`nantrace._locate` for the cross-rank ordering rule and
:mod:`nantrace._io` for the merged folder)."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

__all__ = ["PART_RE", "part_name", "part_target", "parts", "process_group", "shared_run_id"]

PART_RE = re.compile(r"^rank-(\d{5})-of-(\d{5})\.nantrace$")


def shared_run_id() -> str:
    """A run id (32 hex digits) that every rank of the default process group shares: rank 0 makes a uuid4 and
    broadcasts it (``torch.distributed.broadcast_object_list``, a collective: every rank must call it)."""
    import uuid

    import torch.distributed as dist

    box: list[Any] = [uuid.uuid4().hex if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)
    return str(box[0])


def process_group() -> tuple[int, int]:
    """``(rank, world_size)`` of the initialised default process group, or ``(0, 1)`` without one."""
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        return 0, 1
    return int(dist.get_rank()), int(dist.get_world_size())


def part_name(rank: int, world_size: int) -> str:
    """File name of one rank's part, e.g. ``rank-00001-of-00002.nantrace``."""
    return f"rank-{rank:05d}-of-{world_size:05d}.nantrace"


def parts(folder: Path) -> list[tuple[int, int, Path]]:
    """``(rank, world size, part path)`` of the rank parts in ``folder``, by name; a part that a rank killed
    while streaming never completed counts by its hidden segment folder ``.rank-…nantrace.segments``."""
    out = []
    for p in sorted(folder.iterdir()):
        m = PART_RE.match(p.name)
        if m and p.is_file():
            out.append((int(m.group(1)), int(m.group(2)), p))
        elif p.is_dir() and p.name.startswith(".") and p.name.endswith(".segments"):
            name = p.name[1 : -len(".segments")]
            m = PART_RE.match(name)
            if m and not (folder / name).exists() and any(p.iterdir()):
                out.append((int(m.group(1)), int(m.group(2)), folder / name))
    return sorted(out)


def part_target(path: str | os.PathLike[str], rank: int, world_size: int) -> Path:
    """The part file this rank writes for ``save(path)``/``trace(path=...)``; creates the folder ``path``.

    Raises:
        TypeError: ``path`` is not a str or path-like.
        ValueError: ``path`` is an existing file (e.g. a single-process trace), its parent folder does not exist
            or is not writable, or the folder holds parts of a run with another world size.
    """
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"path must be a str or os.PathLike; got {type(path).__name__}: {path!r:.80}")
    folder = Path(path)
    parent = folder.parent if str(folder.parent) else Path(".")
    if folder.exists() and not folder.is_dir():
        raise ValueError(
            f"path {str(folder)!r} is an existing file, but under torch.distributed (rank {rank} of "
            f"{world_size}) every rank saves its part into a folder at that path; remove the file or pass "
            "another path"
        )
    if not parent.is_dir():
        if parent.exists():
            raise ValueError(f"path {str(folder)!r}: {str(parent)!r} is a file, not a directory")
        raise ValueError(f"path {str(folder)!r}: directory {str(parent)!r} does not exist; create it first")
    if not os.access(parent, os.W_OK) and not folder.is_dir():
        raise ValueError(
            f"path {str(folder)!r}: directory {str(parent)!r} is not writable; choose another location"
        )
    folder.mkdir(exist_ok=True)  # every rank may create it at once
    other = sorted({w for _, w, _ in parts(folder) if w != world_size})
    if other:
        raise ValueError(
            f"path {str(folder)!r} holds trace parts of a run with world size {other[0]} (this run has "
            f"{world_size} ranks); remove them or pass another path, so the runs' parts are not merged"
        )
    return folder / part_name(rank, world_size)
