"""The internet in a box: every participant of a local swarm in its own network namespace, behind
a link shaped to a home, DSL or cloud connection, on one Linux machine.

    with Wan.for_swarm("mix", peers=3) as wan:        # root, `ip` and `tc` (Wan.available() says)
        wan.address("store")                          # 10.213.N.2: bind the S3 server here
        wan.launcher("peer-0")                        # ["ip", "netns", "exec", NS]: argv prefix
        wan.down("peer-1"); wan.up("peer-1")          # an outage of peer-1's link
        wan.counters("peer-0")                        # bytes and packets up and down, at the link

**The box.** A bridge in the root namespace holds the run's /24 (``10.213.N.0/24``, an N no
interface of the root namespace uses yet) with ``.1`` on the bridge itself, so the process that
built the box (a test, the launcher) reaches every participant. Each participant gets a namespace
and a veth pair: the host end is a port of the bridge, the namespace end holds the participant's
address (``.2`` upwards, in the order given), its ``lo`` is up and its default route goes via the
bridge. Participants reach each other through the bridge, so traffic between two of them crosses
both their links.

**Forwarding.** Where the bridge netfilter hook is on (``net.bridge.bridge-nf-call-iptables``
= 1) frames between two ports of a bridge cross the root namespace's iptables ``FORWARD`` chain,
which a running Docker engine sets to ``DROP``: the store would answer the process that built the
box and no participant. So the box inserts one rule first in that chain,
``-i <bridge> -o <bridge> -j ACCEPT`` with the comment ``sparseloco-wan <tag>``, and deletes it
with the bridge; a box that cannot insert it there says why. Nothing else of the firewall changes.

**Shaping** is the kernel's token bucket filter (``tc qdisc … tbf``), one per direction: the host
end's egress is what reaches the participant (its downlink), the namespace end's egress what it
sends (its uplink). The kernel here has no netem, so links have a rate and a queue but no added
delay or loss; an outage is the link taken down (``ip link set DEV down``). A bucket must hold at
least one full frame and enough tokens for the timer's granularity at high rates: the burst is
:func:`burst_bytes` = max(16 KiB, 10 ms at the rate): 16 KiB at 2, 10 and 16 Mbit/s, 62.5 KB at
50 Mbit/s, 1.25 MB at 1 Gbit/s, each accepted by tbf (``tc -s qdisc`` shows it back). The queue
holds :data:`LATENCY_MS` of traffic at the rate (tbf's ``latency``), then drops, as a router would.
Segmentation offload is turned off on both ends (``gso_max_segs 1``): every packet the counters
count is one frame on the wire, and the token buckets see frames, not 64 KiB super-packets.

**Profiles** (:data:`LINKS`, Mbit/s up/down): ``home`` 10/50, ``dsl`` 2/16, ``cloud`` 1000/1000;
``mix`` gives the peers cloud, home, dsl in turn (the last peer is dsl when fewer than three would
leave none). The store and the validators are always on ``cloud``. On a 2-core machine a cloud link
is bound by the CPU (a few hundred Mbit/s through veth) well before its bucket.

**Counters** are the host end's ``/sys/class/net/<dev>/statistics``: its ``rx`` is what the
participant sent (up), its ``tx`` what it received (down), bytes of whole Ethernet frames and their
number. :func:`payload_estimate` subtracts :data:`FRAME_OVERHEAD` (Ethernet 14 + IPv4 20 + TCP 32
with timestamps = 66 bytes) per packet: an estimate of the TCP payload, exact for full-sized data
segments, rough for ARP and control packets (pure ACKs carry 66 bytes and no payload, so they
subtract what they add).

**Names.** Every interface and namespace carries the run's tag ``<pid>-<seq>`` (this process and
which of its boxes): namespace ``slw-<tag>-<participant>``, host end ``w<tag>h<i>``, bridge
``w<tag>br``, at most 15 characters as the kernel requires. When a box starts it removes what
boxes of processes no longer alive left behind (a SIGKILLed test). Everything it made goes on
:meth:`Wan.close` — on exit from the ``with``, on an exception, on the KeyboardInterrupt that
:func:`client.demo.processes.install_signal_handlers` makes of SIGINT/SIGTERM, and through
``atexit`` as the last resort: the processes left in its namespaces are killed, then the
namespaces (with their veth ends), the bridge and its forwarding rule are deleted.
"""

from __future__ import annotations

import atexit
import ipaddress
import itertools
import os
import re
import shutil
import signal
import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from protocol.events import Event, PeerWindow
from protocol.store.traffic import FRAME_BYTES, framing_estimate

__all__ = [
    "FRAME_OVERHEAD",
    "LINKS",
    "PROFILES",
    "Counters",
    "Ledger",
    "Link",
    "Wan",
    "WanError",
    "burst_bytes",
    "payload_estimate",
    "swarm_links",
]

FRAME_OVERHEAD = FRAME_BYTES  # Ethernet header, IPv4 header, TCP header with the timestamp option
MIN_BURST = 16 * 1024
BURST_S = 0.010
LATENCY_MS = 100
SUBNET_BASE = "10.213"
MAX_IFNAME = 15
NS_PREFIX = "slw-"
SYS_NET = Path("/sys/class/net")
BRIDGE_NF = Path("/proc/sys/net/bridge/bridge-nf-call-iptables")
RULE_COMMENT = "sparseloco-wan"


class WanError(RuntimeError):
    """A command that builds or changes the box failed (its stderr is in the message)."""


@dataclass(frozen=True)
class Link:
    """A participant's connection: its upload and download rates in Mbit/s."""

    up_mbit: float
    down_mbit: float
    profile: str = ""


LINKS: dict[str, Link] = {
    "home": Link(10, 50, "home"),
    "dsl": Link(2, 16, "dsl"),
    "cloud": Link(1000, 1000, "cloud"),
}
MIX = ("cloud", "home", "dsl")
PROFILES = (*LINKS, "mix")


def peer_links(profile: str, peers: int) -> list[Link]:
    """The link of each of ``peers`` peers under ``profile`` (``mix``: cloud, home, dsl in turn,
    the last one dsl when the turn would give none)."""
    if profile in LINKS:
        return [LINKS[profile]] * peers
    if profile != "mix":
        raise ValueError(f"unknown WAN profile {profile!r}; choose one of {', '.join(PROFILES)}")
    links = [LINKS[MIX[i % len(MIX)]] for i in range(peers)]
    if peers and all(link.profile != "dsl" for link in links):
        links[-1] = LINKS["dsl"]
    return links


def swarm_links(profile: str, peers: int, validators: int = 1) -> dict[str, Link]:
    """Every participant of a swarm and its link: ``store`` and ``validator-<i>`` on cloud, and
    ``peer-<i>`` under ``profile``."""
    out = {"store": LINKS["cloud"]}
    out.update({f"validator-{i}": LINKS["cloud"] for i in range(validators)})
    out.update({f"peer-{i}": link for i, link in enumerate(peer_links(profile, peers))})
    return out


def burst_bytes(rate_mbit: float) -> int:
    """The token bucket's size at ``rate_mbit``: max(16 KiB, 10 ms of traffic at the rate)."""
    return max(MIN_BURST, round(rate_mbit * 1e6 / 8 * BURST_S))


def payload_estimate(nbytes: int, packets: int) -> int:
    """TCP payload in ``nbytes`` of ``packets`` frames: bytes − packets × :data:`FRAME_OVERHEAD`
    (:func:`protocol.store.traffic.framing_estimate`; an estimate, see the module docstring)."""
    return framing_estimate(nbytes, packets)


@dataclass(frozen=True)
class Counters:
    """What crossed a participant's link: ``up`` it sent, ``down`` it received (whole frames)."""

    up_bytes: int
    up_packets: int
    down_bytes: int
    down_packets: int

    def __sub__(self, other: Counters) -> Counters:
        return Counters(
            self.up_bytes - other.up_bytes,
            self.up_packets - other.up_packets,
            self.down_bytes - other.down_bytes,
            self.down_packets - other.down_packets,
        )

    @property
    def up_payload(self) -> int:
        return payload_estimate(self.up_bytes, self.up_packets)

    @property
    def down_payload(self) -> int:
        return payload_estimate(self.down_bytes, self.down_packets)

    def to_dict(self) -> dict[str, int]:
        return {
            "up_bytes": self.up_bytes,
            "up_packets": self.up_packets,
            "down_bytes": self.down_bytes,
            "down_packets": self.down_packets,
            "up_payload_est": self.up_payload,
            "down_payload_est": self.down_payload,
        }


class Ledger:
    """What each peer says its store traffic was, against what its link counted.

    Fed every event of a swarm (``LocalSwarm(on_event=ledger.on_event)``): each peer window report
    adds its ``wire_up_bytes`` / ``wire_down_bytes`` (what the peer's store sockets moved since its
    previous report, headers, grant requests and retries included) to the peer's sum, and the
    peer's link counters are read as the report arrives. :meth:`rel_diff` then compares the sums
    with the TCP payload the link carried up to the last report: the same interval, both ends
    counted independently (the peer in its sockets, the kernel at the veth).
    """

    def __init__(self, wan: Wan) -> None:
        self.wan = wan
        self.reported: dict[str, tuple[int, int]] = {}  # peer → (wire up, wire down) summed
        self.counted: dict[str, Counters] = {}  # peer → its link's counters at its last report

    def on_event(self, name: str, event: Event) -> None:
        if isinstance(event, PeerWindow) and name in self.wan.links:
            up, down = self.reported.get(name, (0, 0))
            self.reported[name] = (up + event.wire_up_bytes, down + event.wire_down_bytes)
            self.counted[name] = self.wan.counters(name)

    def rel_diff(self, name: str) -> tuple[float, float]:
        """(up, down): |reported − link payload| / link payload, up to the peer's last report."""
        (up, down), link = self.reported[name], self.counted[name]
        return abs(up - link.up_payload) / max(link.up_payload, 1), abs(down - link.down_payload) / max(
            link.down_payload, 1
        )

    def max_rel_diff(self, names: Sequence[str]) -> float | None:
        """The largest :meth:`rel_diff` over ``names`` and both directions; None: no report yet."""
        diffs = [d for name in names if name in self.counted for d in self.rel_diff(name)]
        return max(diffs) if diffs else None


# ---------------------------------------------------------------------- names
_SEQ = itertools.count()
_HOST_RE = re.compile(r"^w(\d+)-([0-9a-z])(?:br|h\d+)$")
_NS_RE = re.compile(r"^slw-(\d+)-([0-9a-z])-")


def run_tag(pid: int, seq: int) -> str:
    """``<pid>-<seq>``: which process and which of its boxes (seq in base 36, one character)."""
    return f"{pid}-{'0123456789abcdefghijklmnopqrstuvwxyz'[seq % 36]}"


def host_ifname(tag: str, index: int) -> str:
    return _ifname(f"w{tag}h{index}")


def ns_ifname(index: int) -> str:
    """The namespace end's name (inside its own namespace, so it needs no tag)."""
    return _ifname(f"eth{index}")


def bridge_name(tag: str) -> str:
    return _ifname(f"w{tag}br")


def ns_name(tag: str, participant: str) -> str:
    if not re.fullmatch(r"[a-z0-9][a-z0-9-]{0,40}", participant):
        raise ValueError(f"participant name {participant!r}: lower-case letters, digits and '-' only")
    return f"{NS_PREFIX}{tag}-{participant}"


def _ifname(name: str) -> str:
    if len(name) > MAX_IFNAME:
        raise ValueError(f"interface name {name!r} is longer than {MAX_IFNAME} characters")
    return name


def owner_pid(name: str) -> int | None:
    """The pid in the tag of a box's interface or namespace name; None for any other name."""
    m = _HOST_RE.match(name) or _NS_RE.match(name)
    return int(m.group(1)) if m else None


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


# ---------------------------------------------------------------------- commands
def _run(*argv: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(list(argv), capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=30)
    if check and proc.returncode != 0:
        raise WanError(f"{' '.join(argv)} failed ({proc.returncode}): {proc.stderr.strip()}")
    return proc


def _list_netns() -> list[str]:
    out = _run("ip", "netns", "list", check=False).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def _root_links() -> list[str]:
    return [p.name for p in SYS_NET.iterdir()] if SYS_NET.is_dir() else []


def remove_leftovers() -> list[str]:
    """Delete the namespaces, veths and bridges of boxes whose process is no longer alive; the
    names removed."""
    removed = []
    for ns in _list_netns():
        pid = owner_pid(ns)
        if pid is not None and not _pid_alive(pid):
            _kill_ns_processes(ns)
            _run("ip", "netns", "delete", ns, check=False)
            removed.append(ns)
    for dev in _root_links():
        pid = owner_pid(dev)
        if pid is not None and not _pid_alive(pid):
            _run("ip", "link", "delete", dev, check=False)
            removed.append(dev)
    for bridge in forward_rules():
        pid = owner_pid(bridge)
        if pid is not None and not _pid_alive(pid):
            _run("iptables", "-D", *forward_rule(bridge), check=False)
            removed.append(f"FORWARD {bridge}")
    return removed


def forward_rule(bridge: str) -> list[str]:
    """The chain and match of the rule that lets frames between ports of ``bridge`` through."""
    comment = f"{RULE_COMMENT} {bridge}"
    return ["FORWARD", "-i", bridge, "-o", bridge, "-m", "comment", "--comment", comment, "-j", "ACCEPT"]


def bridge_netfilter_on() -> bool:
    """Whether bridged frames cross iptables here (the bridge netfilter hook is on)."""
    try:
        return BRIDGE_NF.read_text().strip() == "1"
    except OSError:
        return False


def forward_rules() -> list[str]:
    """The bridges that rules of boxes (:func:`forward_rule`) name in the FORWARD chain."""
    if shutil.which("iptables") is None:
        return []
    out = _run("iptables", "-S", "FORWARD", check=False).stdout
    return re.findall(rf'--comment "?{RULE_COMMENT} (\S+?)"? ', out)


def _kill_ns_processes(ns: str) -> None:
    out = _run("ip", "netns", "pids", ns, check=False).stdout
    for pid in (int(p) for p in out.split() if p.isdigit()):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _free_subnet() -> ipaddress.IPv4Network:
    """A ``10.213.N.0/24`` no address of the root namespace lies in: the first from N = pid mod
    256 on, so that boxes of processes started together rarely try the same one (nothing locks
    the choice against another process's box that is being built at the same instant)."""
    out = _run("ip", "-o", "-4", "addr", "show", check=False).stdout
    used = [ipaddress.ip_interface(tok) for tok in re.findall(r"inet (\S+)", out)]
    for n in ((os.getpid() + i) % 256 for i in range(256)):
        net = ipaddress.IPv4Network(f"{SUBNET_BASE}.{n}.0/24")
        if not any(addr.ip in net or net.overlaps(addr.network) for addr in used):
            return net
    raise WanError(f"no free /24 left in {SUBNET_BASE}.0.0/16")


# ---------------------------------------------------------------------- the box
class Wan:
    """The box (module docstring): a bridge and a shaped namespace per participant."""

    def __init__(self, links: Mapping[str, Link] | Sequence[tuple[str, Link]]) -> None:
        items = list(links.items()) if isinstance(links, Mapping) else list(links)
        if not items or len(items) > 250:
            raise ValueError("a box holds 1 to 250 participants")
        self.links: dict[str, Link] = dict(items)
        self.tag = run_tag(os.getpid(), next(_SEQ))
        self.bridge = bridge_name(self.tag)
        self.subnet: ipaddress.IPv4Network | None = None
        self._index = {name: i for i, name in enumerate(self.links)}
        for name in self.links:
            ns_name(self.tag, name), host_ifname(self.tag, self._index[name])  # validate now
        self._made: list[tuple[str, str]] = []  # ("ns" | "link" | "rule", name), in creation order
        self._closed = False

    @classmethod
    def for_swarm(cls, profile: str, peers: int, validators: int = 1) -> Wan:
        """A box for a store, ``validators`` validators and ``peers`` peers (:func:`swarm_links`)."""
        return cls(swarm_links(profile, peers, validators))

    # ------------------------------------------------------------------ availability
    @staticmethod
    def available() -> str | None:
        """None when a box can be built here, else why not (not root, no ``ip`` or ``tc``,
        namespaces or veths cannot be made)."""
        if os.name != "posix" or not hasattr(os, "geteuid") or os.geteuid() != 0:
            return "the WAN box needs root (network namespaces, veth pairs, tc)"
        for tool in ("ip", "tc"):
            if shutil.which(tool) is None:
                return f"the WAN box needs the `{tool}` command (iproute2)"
        ns = f"{NS_PREFIX}{run_tag(os.getpid(), 35)}-probe"
        try:
            made = _run("ip", "netns", "add", ns, check=False)
            if made.returncode != 0:
                return f"cannot create a network namespace: {made.stderr.strip()}"
            veth = _run("ip", "-n", ns, "link", "add", "a0", "type", "veth", "peer", "name", "b0", check=False)
            if veth.returncode != 0:
                return f"cannot create a veth pair: {veth.stderr.strip()}"
            tbf = _run("tc", "-n", ns, "qdisc", "add", "dev", "a0", "root", *_tbf(10), check=False)
            if tbf.returncode != 0:
                return f"tc cannot add a tbf qdisc: {tbf.stderr.strip()}"
        finally:
            _run("ip", "netns", "delete", ns, check=False)
        return None

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> Wan:
        remove_leftovers()
        atexit.register(self.close)
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def _build(self) -> None:
        self.subnet = _free_subnet()
        _run("ip", "link", "add", self.bridge, "type", "bridge")
        self._made.append(("link", self.bridge))
        _run("ip", "addr", "add", f"{self.gateway}/24", "dev", self.bridge)
        _run("ip", "link", "set", self.bridge, "up")
        if bridge_netfilter_on():
            self._let_bridge_forward()
        for name, link in self.links.items():
            self._add_participant(name, link)

    def _let_bridge_forward(self) -> None:
        """The box's one firewall rule (module docstring, *Forwarding*)."""
        if shutil.which("iptables") is None:
            raise WanError(
                "bridged frames cross iptables here (net.bridge.bridge-nf-call-iptables = 1) and "
                "there is no `iptables` command to let the box's bridge forward them"
            )
        rule = forward_rule(self.bridge)
        _run("iptables", "-I", rule[0], "1", *rule[1:])
        self._made.append(("rule", self.bridge))

    def _add_participant(self, name: str, link: Link) -> None:
        i = self._index[name]
        ns, host, inner = ns_name(self.tag, name), host_ifname(self.tag, i), ns_ifname(0)
        _run("ip", "netns", "add", ns)
        self._made.append(("ns", ns))
        _run("ip", "link", "add", host, "type", "veth", "peer", "name", inner, "netns", ns)
        self._made.append(("link", host))
        _run("ip", "link", "set", host, "gso_max_segs", "1", "master", self.bridge, "up")
        _run("ip", "-n", ns, "link", "set", inner, "gso_max_segs", "1", "up")
        _run("ip", "-n", ns, "link", "set", "lo", "up")
        _run("ip", "-n", ns, "addr", "add", f"{self.address(name)}/24", "dev", inner)
        _run("ip", "-n", ns, "route", "add", "default", "via", self.gateway)
        _run("tc", "qdisc", "add", "dev", host, "root", *_tbf(link.down_mbit))
        _run("tc", "-n", ns, "qdisc", "add", "dev", inner, "root", *_tbf(link.up_mbit))

    def close(self) -> None:
        """Kill what runs in the box's namespaces, delete them, the bridge and its forwarding
        rule. Idempotent."""
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self.close)
        for kind, name in reversed(self._made):
            if kind == "ns":
                _kill_ns_processes(name)
                _run("ip", "netns", "delete", name, check=False)
            elif kind == "rule":
                _run("iptables", "-D", *forward_rule(name), check=False)
            elif (SYS_NET / name).exists():
                _run("ip", "link", "delete", name, check=False)
        self._made.clear()

    def __enter__(self) -> Wan:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ access
    @property
    def gateway(self) -> str:
        """The bridge's address: the root namespace as seen from inside the box."""
        assert self.subnet is not None, "the box is not started"
        return str(self.subnet.network_address + 1)

    def address(self, name: str) -> str:
        """The participant's address (``.2`` upwards, in the order the box was given them)."""
        assert self.subnet is not None, "the box is not started"
        return str(self.subnet.network_address + 2 + self._index[name])

    def namespace(self, name: str) -> str:
        self._check(name)
        return ns_name(self.tag, name)

    def launcher(self, name: str) -> list[str]:
        """The argv prefix that runs a command as participant ``name``."""
        return ["ip", "netns", "exec", self.namespace(name)]

    def host_end(self, name: str) -> str:
        self._check(name)
        return host_ifname(self.tag, self._index[name])

    def counters(self, name: str) -> Counters:
        """Bytes and packets through ``name``'s link since the box started (module docstring)."""
        stats = SYS_NET / self.host_end(name) / "statistics"

        def read(field: str) -> int:
            return int((stats / field).read_text())

        return Counters(read("rx_bytes"), read("rx_packets"), read("tx_bytes"), read("tx_packets"))

    def down(self, name: str) -> None:
        """Take ``name``'s link down: nothing passes until :meth:`up`."""
        _run("ip", "link", "set", self.host_end(name), "down")

    def up(self, name: str) -> None:
        _run("ip", "link", "set", self.host_end(name), "up")

    def qdiscs(self, name: str) -> str:
        """``tc -s qdisc`` of both ends of ``name``'s link (what the kernel made of the shaping)."""
        host = _run("tc", "-s", "qdisc", "show", "dev", self.host_end(name)).stdout
        inner = _run("tc", "-n", self.namespace(name), "-s", "qdisc", "show", "dev", ns_ifname(0)).stdout
        return f"down ({self.host_end(name)}):\n{host}up ({ns_ifname(0)} in {self.namespace(name)}):\n{inner}"

    def names(self) -> list[str]:
        return list(self.links)

    def _check(self, name: str) -> None:
        if name not in self._index:
            raise KeyError(f"no participant {name!r} in the box (has {', '.join(self.links)})")


def _tbf(rate_mbit: float) -> list[str]:
    """The tbf arguments of one direction at ``rate_mbit``."""
    return ["tbf", "rate", f"{rate_mbit:g}mbit", "burst", str(burst_bytes(rate_mbit)), "latency", f"{LATENCY_MS}ms"]
