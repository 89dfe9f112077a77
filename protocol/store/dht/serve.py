"""A standalone DHT node process: a bootstrap node for a run, or a scripted peer in tests/benchmarks.

    python -m protocol.store.dht.serve --host 0.0.0.0 --port 31337 --identity dht.key \
        --validator-key <hex public key of the run's validator>
    MADDR /ip4/203.0.113.5/tcp/31337/p2p/12D3KooW...
    READY

Like every node of a run it refuses records that break the run's write rules, so it must be given
the run's validator public keys (``--validator-key``, repeatable: ``validator.public_keys`` of the
RunSpec); see :mod:`protocol.store.dht.policy`. It prints its multiaddrs (``MADDR`` lines) and ``READY``, then serves until SIGTERM/SIGINT, and
shuts its node and p2pd down on the way out. With ``--control`` it also reads one command per stdin
line and answers one line (``OK ...`` or ``ERR <reason> <message>``), and stops when stdin closes
(``quit`` or EOF) — so a child started by a test or script cannot outlive its parent. Writes are
signed with the Ed25519 key of ``--key`` (a PEM file, as ``sparseloco-validator keygen`` writes)::

    put KEY NBYTES SEED   store NBYTES deterministic bytes    -> OK <sha256> <seconds>
    get KEY               fetch and verify                     -> OK <sha256> <nbytes> <seconds>
    list PREFIX           keys under PREFIX                    -> OK <key> <key> ...
    delete KEY                                                 -> OK
"""

from __future__ import annotations

import argparse
import hashlib
import random
import signal
import sys
import threading
import time
from collections.abc import Sequence
from types import FrameType

from protocol.errors import ConfigError, ProtocolError, StoreError
from protocol.identity import Identity, public_key_from_hex
from protocol.store.dht.store import DEFAULT_EXPIRATION_S, DHTStore


def payload(nbytes: int, seed: int) -> bytes:
    """The deterministic bytes ``put KEY NBYTES SEED`` stores (so a reader can check them)."""
    return random.Random(seed).randbytes(nbytes)


def _command(store: DHTStore, line: str) -> str:
    words = line.split()
    if not words:
        return "ERR usage empty command"
    op, args = words[0], words[1:]
    start = time.perf_counter()
    try:
        if op == "put" and len(args) == 3:
            data = payload(int(args[1]), int(args[2]))
            store.put(args[0], data)
            return f"OK {hashlib.sha256(data).hexdigest()} {time.perf_counter() - start:.6f}"
        if op == "get" and len(args) == 1:
            data = store.get(args[0], max_bytes=1 << 40)
            return f"OK {hashlib.sha256(data).hexdigest()} {len(data)} {time.perf_counter() - start:.6f}"
        if op == "list" and len(args) <= 1:
            return " ".join(["OK", *store.list(args[0] if args else "")])
        if op == "delete" and len(args) == 1:
            store.delete(args[0])
            return "OK"
    except (ProtocolError, StoreError) as err:
        return f"ERR {err.reason} {err}".replace("\n", " ")
    except ValueError as err:
        return f"ERR usage {err}"
    return f"ERR usage unknown command {line.strip()!r}"


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m protocol.store.dht.serve", description=__doc__.split("\n")[0])
    parser.add_argument("--initial-peer", action="append", default=[], help="multiaddr of a running node")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--announce", action="append", default=[], help="public multiaddr to announce")
    parser.add_argument("--identity", default=None, help="key file: keeps the peer id across restarts")
    parser.add_argument("--expiration-s", type=float, default=DEFAULT_EXPIRATION_S)
    parser.add_argument("--control", action="store_true", help="read commands from stdin (see module doc)")
    parser.add_argument(
        "--validator-key", action="append", default=[], help="hex public key of a validator of the run (repeatable)"
    )
    parser.add_argument("--key", default=None, help="Ed25519 PEM key that signs the writes of --control")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = _parse(argv)
    stop = threading.Event()

    def on_signal(signum: int, frame: FrameType | None) -> None:
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    try:
        store = DHTStore(
            args.initial_peer,
            host=args.host,
            port=args.port,
            expiration_s=args.expiration_s,
            announce_maddrs=args.announce,
            identity_path=args.identity,
            identity=Identity.load(args.key) if args.key else None,
            validator_keys=[public_key_from_hex(k) for k in args.validator_key],
        )
    except StoreError as err:
        print(f"ERR {err.reason} {err}", flush=True)
        return 1
    except ConfigError as err:
        print(f"ERR config_error {err}", flush=True)
        return 2
    try:
        for maddr in store.visible_maddrs():
            print(f"MADDR {maddr}")
        print("READY", flush=True)
        if args.control:  # read on a side thread so that a signal still ends the wait promptly
            threading.Thread(target=_serve_stdin, args=(store, stop), daemon=True).start()
        stop.wait()
    finally:
        store.close()
    return 0


def _serve_stdin(store: DHTStore, stop: threading.Event) -> None:
    for line in sys.stdin:
        if line.strip() == "quit":
            break
        print(_command(store, line), flush=True)
    stop.set()  # EOF: whoever started us is gone or done


if __name__ == "__main__":
    sys.exit(main())
