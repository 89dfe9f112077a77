"""The packages import one way: protocol ← client, protocol ← validator; client and validator never
import each other; nothing in protocol/ outside protocol/store/ imports a store backend, and the
wire format and codec load without boto3 or hivemind."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
BACKENDS = ("protocol.store.local", "protocol.store.memory", "protocol.store.s3", "protocol.store.dht")


def imported_modules(path: Path) -> set[str]:
    """Absolute module names ``path`` imports (``from protocol import wire`` counts as protocol.wire)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.add(node.module)
            out |= {f"{node.module}.{alias.name}" for alias in node.names}
    return out


def sources(package: str) -> list[Path]:
    return sorted((ROOT / package).rglob("*.py"))


@pytest.mark.parametrize(
    "package, forbidden",
    [("protocol", ("client", "validator")), ("client", ("validator",)), ("validator", ("client",))],
)
def test_packages_import_one_way(package: str, forbidden: tuple[str, ...]) -> None:
    offending = {
        str(path.relative_to(ROOT)): sorted(m for m in imported_modules(path) if m.split(".")[0] in forbidden)
        for path in sources(package)
    }
    assert {k: v for k, v in offending.items() if v} == {}


def test_only_the_store_package_imports_store_backends() -> None:
    offending = {}
    for path in sources("protocol"):
        if (ROOT / "protocol" / "store") in path.parents:
            continue
        hits = sorted(m for m in imported_modules(path) if m.startswith(BACKENDS))
        if hits:
            offending[str(path.relative_to(ROOT))] = hits
    assert offending == {}


def test_wire_and_codec_load_without_store_libraries() -> None:
    code = (
        "import sys, protocol.wire, protocol.codec, protocol.chain, protocol.store; "
        "print(sorted(m for m in ('boto3', 'botocore', 'hivemind') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_the_command_line_entry_points_load_without_torch() -> None:
    """``sparseloco-validator logs`` (what ``sparseloco demo`` runs while a swarm goes on) and the
    commands' ``--help`` stay quick: torch loads only once a command that needs it runs."""
    code = (
        "import sys, validator.cli, client.cli, client.tools; "
        "print(sorted(m for m in ('torch', 'boto3') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
