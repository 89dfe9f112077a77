"""atomic_write: old or new content, never half; exact permissions; exclusive creation."""

from __future__ import annotations

import os
import stat
import threading
from pathlib import Path

import pytest

from protocol.files import atomic_write


def test_replaces_the_file_and_leaves_no_temp_file(tmp_path: Path) -> None:
    path = tmp_path / "state.json"
    atomic_write(path, b"old")
    atomic_write(path, b"new", durable=False)
    assert path.read_bytes() == b"new"
    assert os.listdir(tmp_path) == ["state.json"]


def test_a_failed_write_keeps_the_old_content(tmp_path: Path) -> None:
    path = tmp_path / "state.json"
    atomic_write(path, b"old")
    with pytest.raises(TypeError):
        atomic_write(path, "not bytes")  # type: ignore[arg-type]
    assert path.read_bytes() == b"old"
    assert os.listdir(tmp_path) == ["state.json"]


def test_mode_is_exact_whatever_the_umask(tmp_path: Path) -> None:
    old = os.umask(0)
    try:
        atomic_write(tmp_path / "key.pem", b"secret", mode=0o600)
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "key.pem").stat().st_mode) == 0o600


def test_exclusive_never_replaces(tmp_path: Path) -> None:
    path = tmp_path / "key.pem"
    atomic_write(path, b"first", exclusive=True)
    with pytest.raises(FileExistsError):
        atomic_write(path, b"second", exclusive=True)
    assert path.read_bytes() == b"first"
    assert os.listdir(tmp_path) == ["key.pem"]


def test_concurrent_exclusive_writers_have_one_winner(tmp_path: Path) -> None:
    path = tmp_path / "once"
    barrier = threading.Barrier(6)
    won: list[int] = []

    def create(i: int) -> None:
        barrier.wait()
        try:
            atomic_write(path, f"writer {i}".encode(), durable=False, exclusive=True)
            won.append(i)
        except FileExistsError:
            pass

    threads = [threading.Thread(target=create, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(won) == 1 and path.read_bytes() == f"writer {won[0]}".encode()
    assert os.listdir(tmp_path) == ["once"]


def test_a_long_name_still_fits(tmp_path: Path) -> None:
    path = tmp_path / ("k" * 250)
    atomic_write(path, b"1")
    assert path.read_bytes() == b"1"
