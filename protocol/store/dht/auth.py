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
"""

from __future__ import annotations

import hashlib
import logging
import struct

from hivemind.dht.validation import DHTRecord, RecordValidatorBase
from hivemind.utils.serializer import MSGPackSerializer

from protocol.errors import MalformedPayload, ProtocolError
from protocol.store.dht.policy import WritePolicy
from protocol.store.dht.records import Record, open_record

log = logging.getLogger(__name__)

#: hivemind's subkey of a plain (non-dictionary) value: msgpack of None.
REGULAR_VALUE_SUBKEY = b"\xc0"


class SignedRecordValidator(RecordValidatorBase):  # type: ignore[misc]  # hivemind ships no type information
    """Accepts a record only if it is signed, bound to where it is stored, and permitted."""

    def __init__(self, policy: WritePolicy) -> None:
        self.policy = policy

    def validate(self, record: DHTRecord) -> bool:
        try:
            self.verified(record)
        except ProtocolError as exc:
            log.debug("refused DHT record: %s", exc)
            return False
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
