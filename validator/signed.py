"""What this validator signed: one aggregate digest per window, written down before it is signed.

A validator of a run with several (:mod:`protocol.quorum`) must never endorse two different
aggregates of one window, also across a crash and restart: the safety argument rests on it. So
the endorsement is preceded by a durable record, ``signed.json`` in the state directory (temp
file, fsync, rename), and a window with a record is only ever endorsed again for the same digest::

    record = SigningRecord(state_dir)
    record.claim(window, digest)    # True: recorded (or already this digest) — now sign
                                    # False: this window was signed for another digest — refuse

Records older than :data:`KEEP_WINDOWS` behind the newest are dropped: the file stays small
however long the run (a window that far back has long been certified).
"""

from __future__ import annotations

import json
import threading
from pathlib import Path

from protocol.files import atomic_write

__all__ = ["KEEP_WINDOWS", "SIGNED_FILE", "SigningRecord"]

SIGNED_FILE = "signed.json"
KEEP_WINDOWS = 64


class SigningRecord:
    """The digests this validator signed, per window (module doc)."""

    def __init__(self, state_dir: Path) -> None:
        self.path = Path(state_dir) / SIGNED_FILE
        self._lock = threading.Lock()
        self._signed = self._load()

    def _load(self) -> dict[int, str]:
        try:
            raw = json.loads(self.path.read_text())
        except FileNotFoundError:
            return {}
        except (OSError, ValueError) as exc:  # a record that cannot be read must stop signing, not reset it
            raise RuntimeError(f"{self.path} cannot be read ({exc}); refusing to sign without it") from exc
        return {int(w): str(d) for w, d in raw.items()}

    def signed(self, window: int) -> str | None:
        """The digest signed for ``window``, if any."""
        return self._signed.get(window)

    def claim(self, window: int, digest: str) -> bool:
        """Record ``digest`` for ``window`` durably unless another digest is recorded; whether
        ``digest`` may be signed now."""
        with self._lock:
            held = self._signed.get(window)
            if held is not None:
                return held == digest
            signed = {**self._signed, window: digest}
            newest = max(signed)
            signed = {w: d for w, d in signed.items() if w > newest - KEEP_WINDOWS}
            atomic_write(self.path, json.dumps({str(w): d for w, d in sorted(signed.items())}).encode())
            self._signed = signed
            return True
