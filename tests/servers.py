"""The SeaweedFS S3 server for tests: a re-export of :mod:`client.demo.seaweed` (tests import ``servers``).

    with SeaweedS3() as s3:
        alice = s3.issue_credentials(*peer_grants(run, alice_id), name="alice")

As a pytest fixture: ``seaweed = pytest.fixture(scope="module")(seaweed_server)``.
"""

from __future__ import annotations

from client.demo.seaweed import (
    REGION,
    Credentials,
    SeaweedS3,
    WeedMissing,
    free_port_pair,
    free_ports,
    peer_grants,
    seaweed_server,
    weed_available,
    write_actions,
)

__all__ = [
    "REGION",
    "Credentials",
    "SeaweedS3",
    "WeedMissing",
    "free_port_pair",
    "free_ports",
    "peer_grants",
    "seaweed_server",
    "weed_available",
    "write_actions",
]
