"""Writing files safely: checking a target path, and the atomic write every saved file goes through (a leaf)."""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

__all__ = ["atomic_write", "check_target"]


def check_target(path: str | os.PathLike[str]) -> Path:
    """``path`` (``~`` expanded) as a ``Path`` a file can be written to.

    Raises:
        TypeError: ``path`` is not a str or path-like.
        ValueError: ``path`` is a directory, or its directory does not exist or is not writable.
    """
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"path must be a str or os.PathLike; got {type(path).__name__}: {path!r:.80}")
    p = Path(path).expanduser()  # "~/x.nantrace" is the home directory, as in a shell
    if p.is_dir():
        raise ValueError(
            f"path {str(p)!r} is a directory; give a file name such as {str(p / 'trace.nantrace')!r}"
        )
    parent = p.parent if str(p.parent) else Path(".")
    if not parent.is_dir():
        if parent.exists():
            raise ValueError(f"path {str(p)!r}: {str(parent)!r} is a file, not a directory")
        raise ValueError(f"path {str(p)!r}: directory {str(parent)!r} does not exist; create it first")
    if not os.access(parent, os.W_OK):
        raise ValueError(
            f"path {str(p)!r}: directory {str(parent)!r} is not writable; choose another location"
        )
    return p


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
