"""Listing a DHT window under a flood of valid, self-signed entries (``bench_dht.py --flood N``).

A DHT server node runs in a child process; this process holds a client-mode attacker node and
three client-mode readers: ``written_by`` (the validator's listing: ``list_written_by`` the 5
announced peers, default caps), ``capped`` (a plain ``list`` with the default caps) and
``uncapped`` (a plain ``list`` decoding everything: how every listing worked before the caps, the
baseline). Each lists ``contrib/<w>/`` and ``contrib/`` before and after the flood (N entries of
``contrib/<w>/`` in one store RPC, a fresh key each, and F fake window folders); the median time
of ``repeats`` listings, the entries the directory records held, the entries decoded, the keys
returned, and whether all 5 honest keys were among them.
"""

from __future__ import annotations

import hashlib
import json
import statistics
import time
from collections.abc import Callable
from contextlib import ExitStack
from typing import Any

from rich.console import Console
from rich.table import Table

from protocol.identity import Identity
from protocol.store.dht.listing import ListBounds
from protocol.store.dht.policy import FILE, FOLDER, entry_subkey
from protocol.store.dht.records import seal_record
from protocol.store.dht.store import DHTStore

HONEST = [Identity.from_seed(hashlib.sha256(b"bench honest %d" % i).digest()) for i in range(5)]
RUN = "benchflood"
WINDOW = f"{RUN}/contrib/00000003"
UNCAPPED = ListBounds(max_entries=1 << 30, max_folders=1 << 30)


def _fresh(n: int, tag: bytes) -> list[Identity]:
    return [Identity.from_seed(hashlib.sha256(tag + i.to_bytes(4, "little")).digest()) for i in range(n)]


def _flood(attacker: DHTStore, n: int, folders: int) -> None:
    """n self-signed entries of WINDOW in one store RPC; ``folders`` fake window folders."""
    from hivemind.utils.timed_storage import get_dht_time

    exp = get_dht_time() + 600

    def entries(signers: list[Identity], folder: str, names: list[str], marker: bytes) -> None:
        key = attacker.policy.dht_key("dir", folder)
        subkeys = [entry_subkey(s.peer_id, name) for s, name in zip(signers, names)]
        values = [seal_record(s, key=key, subkey=k, expiration=exp, content=marker) for s, k in zip(signers, subkeys)]
        attacker._run(attacker._node.store_many([key] * len(values), values, exp, subkeys=subkeys), "flood")

    fakes = _fresh(folders, b"bench folder")
    names = [f"{10_000 + i:08d}" for i in range(folders)]
    entries(fakes, f"{RUN}/contrib", [f"{name}/" for name in names], FOLDER)
    for fake, name in zip(fakes, names):
        entries([fake], f"{RUN}/contrib/{name}", [fake.peer_id], FILE)
    # last: a node busy checking 10,000 entries lets the RPCs that follow time out
    flood = _fresh(n, b"bench flood")
    entries(flood, WINDOW, [f.peer_id for f in flood], FILE)


def _measure(readers: dict[str, DHTStore], repeats: int) -> dict[str, dict[str, Any]]:
    honest = {f"{WINDOW}/{i.peer_id}" for i in HONEST}
    ids = [i.peer_id for i in HONEST]
    out: dict[str, dict[str, Any]] = {}
    for prefix in (f"{WINDOW}/", f"{RUN}/contrib/"):
        for mode, reader in readers.items():
            keys: list[str] = []
            samples = []
            for _ in range(repeats):
                start = time.perf_counter()
                keys = reader.list_written_by(prefix, ids) if mode == "written_by" else reader.list(prefix)
                samples.append(time.perf_counter() - start)
            s = reader.last_listing
            out[f"{prefix} {mode}"] = {
                "ms": round(1e3 * statistics.median(samples), 1),
                "entries": s.entries,
                "decoded": s.decoded,
                "keys": len(keys),
                "honest_found": honest <= set(keys),
            }
    return out


def run_flood(
    n: int, folders: int, repeats: int, as_json: bool, start_server: Callable[[], Any], signer: Identity
) -> int:
    server, maddrs = start_server()
    keys = [signer.public_key]
    try:
        with ExitStack() as stack:

            def node(**options: Any) -> DHTStore:
                return stack.enter_context(DHTStore(maddrs, client_mode=True, validator_keys=keys, **options))

            for ident in HONEST:
                with DHTStore(maddrs, client_mode=True, identity=ident, validator_keys=keys) as peer:
                    peer.put(f"{WINDOW}/{ident.peer_id}", b"contribution")
            readers = {"written_by": node(), "capped": node(), "uncapped": node(list_bounds=UNCAPPED)}
            before = _measure(readers, repeats)
            _flood(node(), n, folders)
            after = _measure(readers, repeats)
    finally:
        server.stdin.close()
        server.wait(30)
    rows = [{"listing": name, "before": before[name], "after": after[name]} for name in before]
    if as_json:
        print(json.dumps({"flood": n, "fake_folders": folders, "repeats": repeats, "results": rows}))
    else:
        _show(rows, n, folders)
    return 0


def _show(rows: list[dict[str, Any]], n: int, folders: int) -> None:
    table = Table(title=f"DHT listings before → after a flood of {n} entries and {folders} fake folders (median)")
    for col in ("listing", "ms", "entries", "decoded", "keys", "honest found"):
        table.add_column(col, justify="right")
    for r in rows:
        b, a = r["before"], r["after"]
        cells = [f"{b[c]} → {a[c]}" for c in ("ms", "entries", "decoded", "keys", "honest_found")]
        table.add_row(r["listing"], *cells)
    Console(width=140).print(table)
