"""The seed corpus of the parser fuzz targets (``tests/fuzz_corpus/<target>/*.bin``).

Each target starts from these inputs and mutates them: valid objects of every kind, and inputs
that once broke a parser (a codec block of 128 with packed-12 indices, a deeply nested DHT
manifest, a rice payload whose unary stream is all ones, a huge codec block on a prime row
count). The files are committed; when a format changes, write them again::

    PYTHONPATH=. python tests/fuzz_seeds.py          # rewrites tests/fuzz_corpus/
"""

from __future__ import annotations

import dataclasses
import hashlib
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))

from wire_samples import CODEC, PEER, RUN, VALIDATOR, all_blobs, contribution

from protocol import codec
from protocol.config import CodecConfig
from protocol.store.dht.pieces import encode_manifest, split, tombstone
from protocol.store.dht.policy import FILE, entry_subkey
from protocol.store.dht.records import seal_record
from protocol.wire import Kind
from protocol.wire import fields as wire_fields
from protocol.wire.frame import seal

CORPUS = Path(__file__).parent / "fuzz_corpus"
PACKED12 = CodecConfig(index_coding="packed12")
#: The shape and codec a seed of the ``codec`` target is a payload for.
CODEC_INPUTS: dict[str, tuple[tuple[int, ...], CodecConfig]] = {
    "ok-rice-64x64": ((64, 64), CODEC),
    "ok-rice-vector": ((5000,), CODEC),
    "ok-packed12-64x64": ((64, 64), PACKED12),
    "unary-all-ones": ((64, 64), CODEC),
}
EXPIRATION = 1_900_000_000.5
NS = "sparseloco"


def _contribution_with(cfg_fields: dict[str, object], shape: tuple[int, ...], payload: bytes, name: str = "w") -> bytes:
    """A contribution signed by PEER whose codec parameters and one tensor are written raw."""
    w = wire_fields.Writer()
    wire_fields.write_base(w, contribution().base)
    wire_fields.write_fields(w, cfg_fields)  # type: ignore[arg-type]
    wire_fields.write_metadata(w, {})
    wire_fields.write_table(w, [wire_fields.TensorEntry(name, shape, 0, (len(payload),))])
    return seal(Kind.CONTRIBUTION, RUN, 7, PEER, w.getvalue(), payload)


def _codec_fields(**change: object) -> dict[str, object]:
    return {**{f.name: getattr(CODEC, f.name) for f in dataclasses.fields(CODEC)}, **change}


def seeds() -> dict[str, dict[str, bytes]]:
    """target -> seed name -> bytes."""
    g = torch.Generator().manual_seed(1)
    objects = {f"ok-{kind.label}": blob for kind, blob in all_blobs().items()}
    rice = codec.pack(codec.encode(torch.randn(64, 64, generator=g), CODEC))
    payloads = {
        "ok-rice-64x64": rice,
        "ok-rice-vector": codec.pack(codec.encode(torch.randn(5000, generator=g), CODEC)),
        "ok-packed12-64x64": codec.pack(codec.encode(torch.randn(64, 64, generator=g), PACKED12)),
        "unary-all-ones": rice + b"\xff" * 4096,
    }
    hostile = {
        "block128-packed12": _contribution_with(
            _codec_fields(block=128, index_coding="packed12"), (256, 256), b"\x14" + bytes(4) + bytes(8) + bytes(64)
        ),
        "huge-block-prime-rows": _contribution_with(_codec_fields(block=1 << 29), (1_000_000_007, 1), bytes(64)),
        "control-chars-in-name": _contribution_with(_codec_fields(), (8,), b"\x10junk", "\x1b[2K\rOK contribution"),
        "unary-all-ones": _contribution_with(_codec_fields(), (64, 64), rice + b"\xff" * 4096),
    }
    manifest, _ = split(bytes(range(256)) * 10, 1000)
    dht_piece = bytes(range(200))
    records = {
        "ok-manifest": seal_record(
            PEER,
            key=f"{NS}:obj:0123456789abcdef/peers/{PEER.peer_id}",
            subkey="",
            expiration=EXPIRATION,
            content=encode_manifest(manifest),
        ),
        "ok-piece": seal_record(
            VALIDATOR,
            key=f"{NS}:piece:{hashlib.sha256(dht_piece).hexdigest()}",
            subkey="",
            expiration=EXPIRATION,
            content=dht_piece,
        ),
        "ok-directory-entry": seal_record(
            PEER,
            key=f"{NS}:dir:0123456789abcdef/contrib/00000003",
            subkey=entry_subkey(PEER.peer_id, PEER.peer_id),
            expiration=EXPIRATION,
            content=FILE,
        ),
    }
    return {
        "objects": {**objects, **hostile},
        "codec": payloads,
        "manifests": {
            "ok-manifest": encode_manifest(manifest),
            "ok-tombstone": encode_manifest(tombstone()),
            "deep-json": b"[" * 20_000,
        },
        "records": records,
    }


def write_corpus(root: Path = CORPUS) -> None:
    for target, named in seeds().items():
        folder = root / target
        folder.mkdir(parents=True, exist_ok=True)
        for old in folder.glob("*.bin"):
            old.unlink()
        for name, data in named.items():
            (folder / f"{name}.bin").write_bytes(data)


def load(target: str, root: Path = CORPUS) -> dict[str, bytes]:
    """The committed seeds of ``target``: name -> bytes."""
    return {p.stem: p.read_bytes() for p in sorted((root / target).glob("*.bin"))}


if __name__ == "__main__":
    write_corpus()
