"""Writing a local file so that a crash leaves either the old content or the new, never half of it.

    atomic_write(state_dir / "progress.json", payload)              # temp file, fsync, rename
    atomic_write(path, payload, mode=0o600)                          # a secret key
    atomic_write(path, payload, exclusive=True)                      # create; never replace

    with atomic_stream(path) as f:                                    # written piece by piece
        f.write(header); f.write(memoryview(array))

Every local file that a restart reads (peer and validator state, keys, prepared data, the local
directory store) goes through one of these two functions.
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO


def atomic_write(
    path: str | os.PathLike[str],
    data: bytes | memoryview,
    *,
    mode: int | None = None,
    durable: bool = True,
    exclusive: bool = False,
) -> None:
    """Replace ``path`` with ``data`` atomically.

    The bytes go to a temporary file beside ``path`` (same directory, so the rename cannot cross
    file systems), are flushed and, with ``durable``, fsynced; then the file is renamed over
    ``path``. ``mode`` sets the permissions before any byte is written (keys are never readable by
    others, not even for a moment). With ``exclusive`` an existing ``path`` is never replaced: the
    temporary file is hard-linked to ``path``, which fails atomically with ``FileExistsError`` when
    the name exists, so of concurrent creators exactly one wins.

    Each call has its own temporary file, so threads and processes may write the same ``path`` at
    once. A leftover ``.<name>.<pid>-<random>.tmp`` means a crash mid-write; it was never visible
    under ``path``. The parent directory must exist, and is not fsynced.
    """
    target = Path(path)
    # Own name per call; the target's name is cut so that a long one still leaves room (NAME_MAX).
    tmp = target.with_name(f".{target.name[:64]}.{os.getpid()}-{secrets.token_hex(4)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666 if mode is None else mode)
    try:
        with os.fdopen(fd, "wb") as f:
            if mode is not None:
                os.fchmod(f.fileno(), mode)  # exactly ``mode``, whatever the umask
            f.write(data)
            f.flush()
            if durable:
                os.fsync(f.fileno())
        if exclusive:
            os.link(tmp, target)
        else:
            os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)


@contextmanager
def atomic_stream(path: str | os.PathLike[str], *, durable: bool = True) -> Iterator[BinaryIO]:
    """:func:`atomic_write` for content written piece by piece (a file larger than what one wants
    to hold in memory twice): the pieces go to the temporary file, which replaces ``path`` (flushed
    and, with ``durable``, fsynced) only when the block ends without an exception."""
    target = Path(path)
    tmp = target.with_name(f".{target.name[:64]}.{os.getpid()}-{secrets.token_hex(4)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        with os.fdopen(fd, "wb") as f:
            yield f
            f.flush()
            if durable:
                os.fsync(f.fileno())
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)
