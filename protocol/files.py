"""Writing a local file so that a crash leaves either the old content or the new, never half of it.

    atomic_write(state_dir / "progress.json", payload)              # temp file, fsync, rename
    atomic_write(path, payload, mode=0o600)                          # a secret key

Every local file that a restart reads (peer and validator state, keys, prepared data, the local
directory store) goes through this one function.
"""

from __future__ import annotations

import os
from pathlib import Path


def atomic_write(path: str | os.PathLike[str], data: bytes, *, mode: int | None = None, durable: bool = True) -> None:
    """Replace ``path`` with ``data`` atomically.

    The bytes go to a temporary file beside ``path`` (same directory, so the rename cannot cross
    file systems), are flushed and, with ``durable``, fsynced; then the file is renamed over
    ``path``. ``mode`` sets the permissions before any byte is written (keys are never readable by
    others, not even for a moment). A leftover ``.<name>.<pid>.tmp`` means a crash mid-write; it was
    never visible under ``path``.
    """
    target = Path(path)
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
    fd = os.open(tmp, flags, 0o666 if mode is None else mode)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            if durable:
                os.fsync(f.fileno())
        if mode is not None:
            os.chmod(tmp, mode)  # the umask may have narrowed it; never widened beyond ``mode``
        os.replace(tmp, target)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
