"""The hivemind record validator every node of a run runs: only signed, permitted records are kept.

hivemind calls a node's ``RecordValidatorBase.validate`` for every record another node asks it to
store and for every record another node returns to one of its queries; a record that fails is
neither stored nor used. :class:`SignedRecordValidator` accepts exactly the records of
:mod:`protocol.store.dht.records` that :class:`~protocol.store.dht.policy.WritePolicy` permits, and
refuses everything else, signed or not (a run's DHT holds nothing but the run's records)::

    node = await DHTNode.create(..., record_validator=SignedRecordValidator(policy))

What hivemind hands over is hashed and serialized: ``record.key`` is the DHT id (sha1 of the
msgpack'd key), ``record.subkey`` the msgpack'd subkey, ``record.value`` the msgpack'd value. The
signed record carries the plain key and subkey, so they are checked against those bytes here: a
record signed for one key cannot be stored under another.

Records are signed by the writer before they reach hivemind (:class:`~protocol.store.dht.store.DHTStore`),
so ``sign_value``/``strip_value`` keep their pass-through defaults.

hivemind validates every entry of a dictionary value each time a node receives it, and a listing
receives the whole directory record on every poll: 10,000 entries cost about 2 s of Ed25519
checks (about 0.2 ms each on a busy 2-core machine). The validator therefore remembers the
records that passed, by the sha256 of everything a record is judged on (DHT id, subkey, value,
expiration), in a bounded LRU set (:data:`VERIFIED_CACHE` records, about 10 MiB); a record seen
before costs one hash (a few µs). The verdict depends on nothing else (the policy never changes),
so remembering it changes no verdict; ``verifications`` counts the full checks made.
"""

from __future__ import annotations

import hashlib
import logging
import struct
from collections import OrderedDict

from hivemind.dht.validation import DHTRecord, RecordValidatorBase
from hivemind.utils.serializer import MSGPackSerializer

from protocol.errors import MalformedPayload, ProtocolError
from protocol.store.dht.policy import WritePolicy
from protocol.store.dht.records import Record, open_record

log = logging.getLogger(__name__)

#: hivemind's subkey of a plain (non-dictionary) value: msgpack of None.
REGULAR_VALUE_SUBKEY = b"\xc0"
#: Records that passed, remembered by digest (most recently seen kept).
VERIFIED_CACHE = 1 << 16


class SignedRecordValidator(RecordValidatorBase):  # type: ignore[misc]  # hivemind ships no type information
    """Accepts a record only if it is signed, bound to where it is stored, and permitted."""

    def __init__(self, policy: WritePolicy, cache_size: int = VERIFIED_CACHE) -> None:
        self.policy, self.cache_size = policy, cache_size
        self._passed: OrderedDict[bytes, None] = OrderedDict()  # digests of records that passed
        self.verifications = 0  # full checks made (a record remembered as passed costs a hash)

    def validate(self, record: DHTRecord) -> bool:
        digest = _record_digest(record)
        if digest is not None and digest in self._passed:
            self._passed.move_to_end(digest)
            return True
        self.verifications += 1
        try:
            self.verified(record)
        except ProtocolError as exc:
            log.debug("refused DHT record: %s", exc)
            return False
        if digest is not None and self.cache_size > 0:
            self._passed[digest] = None
            if len(self._passed) > self.cache_size:
                self._passed.popitem(last=False)
        return True

    def verified(self, record: DHTRecord) -> Record:
        """The signed record inside a hivemind record, if everything checks; else ProtocolError."""
        rec = open_record(unwrap_bin(record.value))
        if hashlib.sha1(MSGPackSerializer.dumps(rec.key)).digest() != record.key:
            raise MalformedPayload(f"record signed for {rec.key!r} is stored under another DHT key")
        subkey = MSGPackSerializer.dumps(rec.subkey) if rec.subkey else REGULAR_VALUE_SUBKEY
        if subkey != record.subkey:
            raise MalformedPayload(f"record signed for subkey {rec.subkey!r} is stored under another one")
        if rec.expiration != record.expiration_time:
            raise MalformedPayload(f"record of {rec.key!r} carries another expiration than it was signed with")
        self.policy.check(rec)
        return rec

    def merge_with(self, other: RecordValidatorBase) -> bool:
        # Two of these with the same policy are one; different policies both apply.
        return isinstance(other, SignedRecordValidator) and other.policy == self.policy


def _record_digest(record: DHTRecord) -> bytes | None:
    """sha256 over the length-prefixed fields a verdict depends on; None for fields of the wrong type."""
    fields = (record.key, record.subkey, record.value)
    if not all(isinstance(f, bytes) for f in fields) or not isinstance(record.expiration_time, float | int):
        return None
    h = hashlib.sha256(struct.pack("<d", float(record.expiration_time)))
    for f in fields:
        h.update(struct.pack("<Q", len(f)))
        h.update(f)
    return h.digest()


_BIN_HEADERS = {0xC4: struct.Struct(">B"), 0xC5: struct.Struct(">H"), 0xC6: struct.Struct(">I")}


def unwrap_bin(raw: bytes) -> bytes:
    """The bytes inside one msgpack ``bin`` object that fills ``raw`` exactly (how hivemind
    serializes a ``bytes`` value); ``MalformedPayload`` for anything else. Parsed by hand so that a
    hostile value is never handed to a general deserializer."""
    if not raw or raw[0] not in _BIN_HEADERS:
        raise MalformedPayload("DHT value is not a msgpack bin object")
    head = _BIN_HEADERS[raw[0]]
    if len(raw) < 1 + head.size:
        raise MalformedPayload("DHT value is truncated")
    (n,) = head.unpack_from(raw, 1)
    if 1 + head.size + n != len(raw):
        raise MalformedPayload("DHT value length does not match its msgpack header")
    return raw[1 + head.size :]
