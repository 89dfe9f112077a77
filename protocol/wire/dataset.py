"""The validator's signed description of a run's dataset: which token shards it holds, and how.

Body: tokenizer (``bytes`` or ``hf:<sha256 of its tokenizer.json>``), token width in bytes (2 or
4), vocabulary size, end-of-document id (or none), tokens per block, metadata, then the shards in
stream order — every train shard before every validation shard — each as (split, sha256, tokens,
the sha256 of each of its blocks). No payload: the shards are separate, content-addressed objects
(``<run>/data/shard/<sha256>``).

A **block** is ``block_tokens`` consecutive tokens of a shard (its last block may be shorter), the
unit a reader fetches with one ranged read and verifies on its own: a peer that trains on a few
hundred sequences spread over the whole dataset reads those blocks, never whole shards. Each
block costs the manifest 32 bytes: 1/64 of the data it names at 1,024 byte tokens per block, so a
manifest of a 1 G-token dataset is 32 MiB, read once.

The dataset's **digest** is the sha256 of the body alone, so it exists before any run does: it
goes into the RunSpec (``data.dataset``), hence into the run hash, and the signed envelope then
carries that run hash. A reader checks both: the signature by a validator key of the run, and that
the body hashes to the RunSpec's ``data.dataset``::

    shards = (DatasetShard("train", sha256_hex, tokens, block_digests(shard_bytes, 2 * 1024)), ...)
    m = DatasetManifest("bytes", 2, 256, 0, shards, {"name": "stdlib"}, block_tokens=1024)
    spec = spec.replace(data={"dataset": dataset_digest(m)})
    blob = encode_dataset(m, spec.hash(), validator)
    ds = decode_dataset(blob, run_hash=spec.hash(), max_bytes=cap,
                        allowed_signers=spec.validator.public_keys, digest=spec.data.dataset).value
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Collection
from dataclasses import dataclass, field

from protocol.errors import DigestMismatch, MalformedPayload
from protocol.identity import Identity
from protocol.wire.fields import Metadata, Reader, Writer, digest_to_bytes, read_metadata, write_metadata
from protocol.wire.frame import Kind, open_envelope, seal
from protocol.wire.verified import Verified, check_signer, verified

__all__ = [
    "DEFAULT_BLOCK_TOKENS",
    "MAX_SHARDS",
    "MAX_SHARD_TOKENS",
    "SPLITS",
    "DatasetManifest",
    "DatasetShard",
    "block_digests",
    "dataset_body",
    "dataset_digest",
    "decode_dataset",
    "encode_dataset",
]

SPLITS = ("train", "val")  # split codes 0 and 1, in this order in the stream
TOKEN_BYTES = (2, 4)  # uint16 (vocab ≤ 65536) or uint32
MAX_SHARDS = 1 << 22
MAX_SHARD_TOKENS = 1 << 30  # one shard is at most 4 GiB, a read cap every reader can afford
MAX_VOCAB = 1 << 32
TOKENIZER_RE = re.compile(r"bytes|hf:[0-9a-f]{64}")
_SHARD_MIN_BYTES = 1 + 32 + 1 + 32  # split, sha256, a one-byte varint, one block's sha256
DEFAULT_BLOCK_TOKENS = 1 << 10  # 2 KiB of byte tokens: a page of a window spans a few blocks
MIN_BLOCK_TOKENS = 1 << 6
MAX_BLOCK_TOKENS = 1 << 24


def block_digests(data: bytes | memoryview, block_bytes: int) -> bytes:
    """The sha256 digests (32 bytes each, concatenated) of the ``block_bytes`` blocks of ``data``."""
    view = memoryview(data)
    return b"".join(hashlib.sha256(view[i : i + block_bytes]).digest() for i in range(0, len(view), block_bytes))


@dataclass(frozen=True)
class DatasetShard:
    """One shard: its ``split`` (``train`` or ``val``), the sha256 hex of its bytes (its name in
    the store), its length in tokens (its size is ``tokens × token_bytes``) and ``blocks``, the
    sha256 digests of its blocks (32 bytes each, in order: :func:`block_digests`)."""

    split: str
    sha256: str
    tokens: int
    blocks: bytes

    def block(self, index: int) -> bytes:
        """The sha256 digest of block ``index``."""
        return self.blocks[32 * index : 32 * index + 32]


@dataclass(frozen=True)
class DatasetManifest:
    """A run's dataset (see the module docstring). ``eos_id``: the end-of-document token, if any."""

    tokenizer: str
    token_bytes: int
    vocab_size: int
    eos_id: int | None
    shards: tuple[DatasetShard, ...]
    metadata: Metadata = field(default_factory=dict)
    block_tokens: int = DEFAULT_BLOCK_TOKENS

    @property
    def dtype(self) -> str:
        """The numpy dtype name of a token: ``uint16`` or ``uint32`` (little-endian on the wire)."""
        return "uint16" if self.token_bytes == 2 else "uint32"

    def split(self, name: str) -> tuple[DatasetShard, ...]:
        """The shards of split ``name`` in stream order."""
        return tuple(s for s in self.shards if s.split == name)

    def shard_bytes(self, shard: DatasetShard) -> int:
        return shard.tokens * self.token_bytes

    @property
    def block_bytes(self) -> int:
        return self.block_tokens * self.token_bytes

    def n_blocks(self, shard: DatasetShard) -> int:
        return -(-shard.tokens // self.block_tokens)


def dataset_body(m: DatasetManifest) -> bytes:
    """The canonical body bytes of ``m`` (MalformedPayload for a manifest that breaks the rules)."""
    _check(m)
    w = Writer()
    w.text(m.tokenizer, 80)
    w.u8(m.token_bytes)
    w.varint(m.vocab_size)
    w.varint(0 if m.eos_id is None else m.eos_id + 1)
    w.varint(m.block_tokens)
    write_metadata(w, m.metadata)
    w.varint(len(m.shards))
    for s in m.shards:
        w.u8(SPLITS.index(s.split))
        w.raw(digest_to_bytes(s.sha256, what="shard sha256"))
        w.varint(s.tokens)
        w.raw(s.blocks)
    return w.getvalue()


def dataset_digest(m: DatasetManifest) -> str:
    """The dataset's name: sha256 of its canonical body (what ``data.dataset`` of a RunSpec holds)."""
    return hashlib.sha256(dataset_body(m)).hexdigest()


def encode_dataset(m: DatasetManifest, run_hash: str, identity: Identity) -> bytes:
    """Sign the manifest for run ``run_hash`` (window 0: a dataset belongs to the whole run)."""
    return seal(Kind.DATASET, run_hash, 0, identity, dataset_body(m), b"")


def decode_dataset(
    data: bytes,
    *,
    run_hash: str | None,
    max_bytes: int,
    allowed_signers: Collection[bytes | str] | None,
    digest: str | None = None,
) -> Verified[DatasetManifest]:
    """Verify and parse a dataset manifest. ``allowed_signers``: the run's validator keys (None
    skips the check: inspection only). ``digest``: the RunSpec's ``data.dataset``, which the body
    must hash to (DigestMismatch otherwise). Raises the envelope errors, UnknownSigner and
    MalformedPayload (unknown tokenizer or width, an id outside the vocabulary, empty or
    out-of-order splits, shards of no tokens or too many, a window other than 0, a payload)."""
    env = open_envelope(data, max_bytes=max_bytes, run_hash=run_hash, kind=Kind.DATASET)
    check_signer(env, allowed_signers)
    if env.window != 0:
        raise MalformedPayload(f"a dataset manifest is for window 0, this one names {env.window}")
    if len(env.payload):
        raise MalformedPayload("a dataset manifest has no payload")
    body_digest = hashlib.sha256(env.body).hexdigest()
    if digest is not None and body_digest != digest:
        raise DigestMismatch(f"dataset manifest hashes to {body_digest[:16]}…, the run names {digest[:16]}…")
    r = Reader(env.body, "dataset manifest")
    tokenizer = r.text(80)
    token_bytes = r.u8()
    vocab_size = r.varint(MAX_VOCAB)
    eos = r.varint(MAX_VOCAB)
    block_tokens = r.varint(MAX_BLOCK_TOKENS)
    if block_tokens < MIN_BLOCK_TOKENS:
        raise r.fail(f"blocks of {block_tokens} tokens: at least {MIN_BLOCK_TOKENS}")
    metadata = read_metadata(r)
    shards = []
    for _ in range(r.count(_SHARD_MIN_BYTES, MAX_SHARDS, "shards")):
        code = r.u8()
        if code >= len(SPLITS):
            raise r.fail(f"unknown split code {code}")
        sha, tokens = r.digest(), r.varint(MAX_SHARD_TOKENS)
        blocks = bytes(r.take(32 * -(-tokens // block_tokens)))
        shards.append(DatasetShard(SPLITS[code], sha, tokens, blocks))
    r.end()
    manifest = DatasetManifest(
        tokenizer, token_bytes, vocab_size, None if eos == 0 else eos - 1, tuple(shards), metadata, block_tokens
    )
    _check(manifest)
    return verified(manifest, env)


def _check(m: DatasetManifest) -> None:
    """The rules every manifest obeys, on both sides (so that one dataset has one encoding)."""
    if not TOKENIZER_RE.fullmatch(m.tokenizer):
        raise MalformedPayload(f"tokenizer {m.tokenizer!r} is neither 'bytes' nor 'hf:<sha256>'")
    if m.token_bytes not in TOKEN_BYTES:
        raise MalformedPayload(f"tokens of {m.token_bytes} bytes: only 2 or 4")
    if not 1 <= m.vocab_size <= (1 << 16 if m.token_bytes == 2 else MAX_VOCAB):
        raise MalformedPayload(f"vocabulary of {m.vocab_size} does not fit {m.token_bytes}-byte tokens")
    if m.eos_id is not None and not 0 <= m.eos_id < m.vocab_size:
        raise MalformedPayload(f"end-of-document id {m.eos_id} outside the vocabulary")
    if len(m.shards) > MAX_SHARDS:
        raise MalformedPayload(f"{len(m.shards)} shards exceed {MAX_SHARDS}")
    codes = [SPLITS.index(s.split) if s.split in SPLITS else -1 for s in m.shards]
    if -1 in codes or codes != sorted(codes):
        raise MalformedPayload("shards must be train shards, then validation shards")
    if set(codes) != {0, 1}:
        raise MalformedPayload("a dataset needs train and validation shards")
    if not MIN_BLOCK_TOKENS <= m.block_tokens <= MAX_BLOCK_TOKENS:
        raise MalformedPayload(f"blocks of {m.block_tokens} tokens: only {MIN_BLOCK_TOKENS}..{MAX_BLOCK_TOKENS}")
    for s in m.shards:
        if not 1 <= s.tokens <= MAX_SHARD_TOKENS:
            raise MalformedPayload(f"shard {s.sha256[:16]}… of {s.tokens} tokens")
        if len(s.blocks) != 32 * m.n_blocks(s):
            raise MalformedPayload(
                f"shard {s.sha256[:16]}… of {s.tokens} tokens needs {m.n_blocks(s)} block digests, "
                f"has {len(s.blocks) / 32:g}"
            )
