"""docs/ARCHITECTURE.md is the map of the code: every module its tables list exists, and every
library module is listed (a new module without a row, or a row for a module that is gone, fails)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "ARCHITECTURE.md"
PACKAGES = ("protocol", "client", "validator")
_HEADING = re.compile(r"^#{2,4} `([a-z_/]+/)`\s*$")  # ### `client/`
_CAPTION = re.compile(r"^`([a-z_/]+/)`\s*$")  # a table's caption line: `protocol/codec/`
_TICKED = re.compile(r"`([\w./-]+(?:\.py|\.toml|/))`")  # a file or folder name in backticks


def documented() -> list[str]:
    """Paths (relative to the repository) that the module tables of the document name, in order."""
    out: list[str] = []
    package: str | None = None
    in_table = False
    for line in DOC.read_text(encoding="utf-8").splitlines():
        m = _HEADING.match(line) or _CAPTION.match(line)
        if m and m.group(1).split("/")[0] in PACKAGES:
            package, in_table = m.group(1), False
            continue
        if line.startswith("| module |"):
            in_table = package is not None
            continue
        if not in_table or not line.startswith("|") or line.startswith("|---"):
            in_table = in_table and line.startswith("|")
            continue
        assert package is not None
        first, rest = line.strip("|").split("|", 1)
        for name in _TICKED.findall(first):
            if name.endswith("/"):  # a subpackage described in one row: its modules in the text
                out.append(package + name)
                out.extend(package + name + m for m in _TICKED.findall(rest) if m.endswith(".py") and "/" not in m)
            else:
                out.append(package + name)
    return out


def library_modules() -> set[str]:
    return {
        p.relative_to(ROOT).as_posix()
        for pkg in PACKAGES
        for p in (ROOT / pkg).rglob("*.py")
        if p.name != "__init__.py"
    }


def test_every_listed_module_exists() -> None:
    missing = sorted(p for p in documented() if not (ROOT / p).exists())
    assert not missing, f"docs/ARCHITECTURE.md lists modules that do not exist: {missing}"


def test_every_library_module_is_listed() -> None:
    unlisted = sorted(library_modules() - set(documented()))
    assert not unlisted, f"docs/ARCHITECTURE.md does not list: {unlisted}"


def test_every_module_has_one_row() -> None:
    names = documented()
    twice = sorted({n for n in names if names.count(n) > 1})
    assert not twice, f"docs/ARCHITECTURE.md lists these more than once: {twice}"


def test_the_parser_reads_the_tables() -> None:
    names = set(documented())
    assert {"protocol/config.py", "protocol/codec/sparse.py", "client/trainer.py", "validator/publish.py"} <= names
