"""In-memory object store for tests, with fault injection.

Stores opened with the same name share their objects (``open_store("memory://swarm")`` in a
validator and in three peers of one test process see one namespace); ``memory://`` alone is
private. Faults belong to one handle, so one reader can be shown corrupted bytes while the others
read the truth — the attack a content hash in the envelope must catch.

    store = MemoryStore("swarm")
    store.faults.corrupt("run/contrib/3/")            # every read under the prefix is bit-flipped
    store.faults.fail_put(nth=2)                      # the 2nd put from now raises StoreError
    store.faults.crash_mid_upload("run/contrib/4/")   # put raises SimulatedCrash, leaves nothing
    store.faults.delay("run/aggregate/", 0.5)         # reads sleep first (deadline tests)
    store.faults.drop("run/peers/")                   # puts succeed but the object is lost
    store.faults.clear()

Every fired fault is recorded in ``store.faults.fired`` as ``(action, op, key)``. A ranged read
(``store.get_range(key, start, length)``) is a ``get`` to the rules and to ``store.counts``: a
``get`` fault delays it, fails it, or flips a bit in the middle of the range it returns.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Literal

from protocol.errors import ObjectExists, ObjectNotFound, PayloadTooLarge, StoreError
from protocol.store.base import (
    DEFAULT_MAX_BYTES,
    ObjectStore,
    check_key,
    check_prefix,
    check_range,
    range_past_end,
)

Op = Literal["put", "get", "list", "size", "delete"]
Action = Literal["drop", "delay", "corrupt", "fail", "crash"]
ALL_OPS: frozenset[str] = frozenset({"put", "get", "list", "size", "delete"})


class SimulatedCrash(BaseException):
    """The simulated death of the process during an upload.

    A ``BaseException`` like ``KeyboardInterrupt``, so that the code under test cannot swallow it
    with ``except Exception`` the way it may handle an ordinary failed upload.
    """


@dataclass
class Fault:
    """One rule: fire ``action`` on operations ``ops`` touching keys under ``prefix``.

    ``nth`` (1-based) fires only on that matching operation; ``times`` caps how often it fires.
    """

    action: Action
    prefix: str
    ops: frozenset[str]
    nth: int | None = None
    times: int | None = None
    seconds: float = 0.0
    keep_bytes: int | None = None
    error: type[StoreError] = StoreError
    seen: int = 0
    fired: int = 0

    def take(self, op: str, key: str) -> bool:
        """Count a matching operation and say whether the fault fires on it."""
        if op not in self.ops or not key.startswith(self.prefix):
            return False
        self.seen += 1
        if self.nth is not None and self.seen != self.nth:
            return False
        if self.times is not None and self.fired >= self.times:
            return False
        self.fired += 1
        return True


def corrupt_bytes(data: bytes) -> bytes:
    """Flip one bit in the middle (or return one junk byte for an empty value)."""
    if not data:
        return b"\x00"
    mid = len(data) // 2
    return data[:mid] + bytes([data[mid] ^ 0x01]) + data[mid + 1 :]


@dataclass
class FaultInjector:
    """The fault rules of one :class:`MemoryStore` handle."""

    rules: list[Fault] = field(default_factory=list)
    fired: list[tuple[str, str, str]] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, fault: Fault) -> Fault:
        check_prefix(fault.prefix)
        with self._lock:
            self.rules.append(fault)
        return fault

    def drop(self, prefix: str = "", *, times: int | None = None) -> Fault:
        """Puts under ``prefix`` report success but store nothing (a lost write)."""
        return self.add(Fault("drop", prefix, frozenset({"put"}), times=times))

    def delay(self, prefix: str, seconds: float, *, ops: tuple[Op, ...] = ("get",), times: int | None = None) -> Fault:
        """Operations under ``prefix`` sleep ``seconds`` before they run."""
        return self.add(Fault("delay", prefix, frozenset(ops), times=times, seconds=seconds))

    def corrupt(self, prefix: str = "", *, times: int | None = None) -> Fault:
        """Reads under ``prefix`` return the object (or the range asked) with one bit flipped; the
        stored copy is intact."""
        return self.add(Fault("corrupt", prefix, frozenset({"get"}), times=times))

    def fail(
        self,
        prefix: str = "",
        *,
        ops: tuple[Op, ...] = ("put",),
        nth: int | None = None,
        times: int | None = None,
        error: type[StoreError] = StoreError,
    ) -> Fault:
        """Matching operations raise ``error`` (a transient backend failure by default)."""
        return self.add(Fault("fail", prefix, frozenset(ops), nth=nth, times=times, error=error))

    def fail_put(self, nth: int, prefix: str = "", *, error: type[StoreError] = StoreError) -> Fault:
        """The ``nth`` put (1-based, counted from now) under ``prefix`` raises ``error``."""
        return self.fail(prefix, ops=("put",), nth=nth, error=error)

    def crash_mid_upload(self, prefix: str = "", *, keep_bytes: int | None = None, nth: int | None = None) -> Fault:
        """The uploading process "dies": put raises :class:`SimulatedCrash`.

        With ``keep_bytes=None`` nothing is stored (an atomic backend: S3, the local directory);
        with ``keep_bytes=n`` the first ``n`` bytes are (a non-atomic or malicious writer).
        """
        fault = Fault("crash", prefix, frozenset({"put"}), nth=nth, times=1, keep_bytes=keep_bytes)
        return self.add(fault)

    def clear(self) -> None:
        with self._lock:
            self.rules.clear()

    def matching(self, op: str, key: str) -> list[Fault]:
        """The rules that fire on this operation, recorded in ``fired``."""
        with self._lock:
            hits = [rule for rule in self.rules if rule.take(op, key)]
            self.fired.extend((rule.action, op, key) for rule in hits)
        return hits


class _Namespace:
    """Objects shared by every handle opened with one name."""

    def __init__(self) -> None:
        self.objects: dict[str, bytes] = {}
        self.lock = threading.Lock()


_NAMED: dict[str, _Namespace] = {}
_NAMED_LOCK = threading.Lock()


class MemoryStore(ObjectStore):
    """Objects in a dict. ``name`` shares the namespace with other handles of that name."""

    atomic_create = True

    def __init__(self, name: str = "") -> None:
        self.name = name
        if name:
            with _NAMED_LOCK:
                self._ns = _NAMED.setdefault(name, _Namespace())
        else:
            self._ns = _Namespace()
        self.faults = FaultInjector()
        self.counts: dict[str, int] = dict.fromkeys(ALL_OPS, 0)
        self._count_lock = threading.Lock()

    @staticmethod
    def forget(name: str) -> None:
        """Drop the shared namespace ``name`` (tests call this to start clean)."""
        with _NAMED_LOCK:
            _NAMED.pop(name, None)

    def _before(self, op: str, key: str) -> list[Fault]:
        with self._count_lock:
            self.counts[op] += 1
        faults = self.faults.matching(op, key)
        for fault in faults:
            if fault.action == "delay":
                time.sleep(fault.seconds)
            elif fault.action == "fail":
                raise fault.error(f"injected {op} failure on {key!r}")
        return faults

    def put(self, key: str, data: bytes, *, if_absent: bool = False) -> None:
        check_key(key)
        data = bytes(data)
        faults = self._before("put", key)
        crash = next((f for f in faults if f.action == "crash"), None)
        if crash is not None:
            if crash.keep_bytes is not None:
                with self._ns.lock:
                    self._ns.objects[key] = data[: crash.keep_bytes]
            raise SimulatedCrash(f"simulated crash while uploading {key!r}")
        with self._ns.lock:
            if if_absent and key in self._ns.objects:
                raise ObjectExists(f"{key!r} already exists")
            if not any(f.action == "drop" for f in faults):
                self._ns.objects[key] = data

    def get(self, key: str, *, max_bytes: int = DEFAULT_MAX_BYTES) -> bytes:
        check_key(key)
        data, corrupt = self._read(key)
        if len(data) > max_bytes:
            raise PayloadTooLarge(f"{key!r} is {len(data)} bytes, cap is {max_bytes}")
        return corrupt_bytes(data) if corrupt else data

    def get_range(self, key: str, start: int, length: int) -> bytes:
        end = check_range(key, start, length)
        data, corrupt = self._read(key)
        if len(data) < end:
            raise range_past_end(key, start, length, len(data))
        return corrupt_bytes(data[start:end]) if corrupt else data[start:end]

    def _read(self, key: str) -> tuple[bytes, bool]:
        """A read's object after the ``get`` faults (delay, fail) and whether one corrupts it."""
        faults = self._before("get", key)
        with self._ns.lock:
            data = self._ns.objects.get(key)
        if data is None:
            raise ObjectNotFound(f"{key!r} not found")
        return data, any(f.action == "corrupt" for f in faults)

    def list(self, prefix: str) -> list[str]:
        check_prefix(prefix)
        self._before("list", prefix)
        with self._ns.lock:
            return sorted(k for k in self._ns.objects if k.startswith(prefix))

    def size(self, key: str) -> int:
        check_key(key)
        self._before("size", key)
        with self._ns.lock:
            data = self._ns.objects.get(key)
        if data is None:
            raise ObjectNotFound(f"{key!r} not found")
        return len(data)

    def delete(self, key: str) -> None:
        check_key(key)
        self._before("delete", key)
        with self._ns.lock:
            self._ns.objects.pop(key, None)

    def __repr__(self) -> str:
        return f"MemoryStore({self.name!r})"
