"""Prerequisites of the end-to-end rollout tests: a missing one skips with the fixing command, and
fails in CI (``ARES_CI=1``; ``ARES_REQUIRE_DOCKER=1`` for the Docker ones)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from functools import cache
from pathlib import Path

import pytest

from harnesses import registry
from harnesses.base import INSTALL_ROOT

AGENTS_IMAGE = "ares-gateway/agents:latest"
PROVISION = "bash .ci/provision-docker.sh && bash .ci/provision-agents.sh"
REPO = Path(__file__).resolve().parents[2]


def require(ok: bool, reason: str, *, docker: bool = False) -> None:
    if ok:
        return
    if os.environ.get("ARES_CI") == "1" or (docker and os.environ.get("ARES_REQUIRE_DOCKER") == "1"):
        pytest.fail(f"prerequisite missing in CI: {reason}")
    pytest.skip(reason)


@cache
def _docker_ok() -> bool:
    try:
        from sandbox.docker import engine_available

        return bool(engine_available())
    except Exception:
        return False


@cache
def _image_present(tag: str) -> bool:
    if not shutil.which("docker"):
        return False
    return subprocess.run(["docker", "image", "inspect", tag], capture_output=True, check=False).returncode == 0


def require_mini(backend: str = "local") -> None:
    """mini-swe-agent provisioned for local sandboxes, or the agents image for Docker."""
    if backend == "docker":
        require(_docker_ok(), f"no Docker engine answers: run {PROVISION}", docker=True)
        require(_image_present(AGENTS_IMAGE), f"the agents image {AGENTS_IMAGE} is missing: run {PROVISION}",
                docker=True)
        return
    version = registry.create("mini-swe-agent").version
    prefix = f"{INSTALL_ROOT}/mini-swe-agent/{version}"
    require(os.path.isfile(f"{prefix}/.ares-complete"), f"mini-swe-agent {version} is not provisioned at {prefix}: "
                                                        "run bash .ci/provision-agents.sh")


def cli(*args: str) -> list[str]:
    """The ``ares-gateway`` command line, run with this interpreter."""
    return [sys.executable, "-m", "ares_gateway.cli", *args]


def owned_containers(pid: int) -> list[str]:
    """Containers (any state) whose owner label names process ``pid``."""
    out = subprocess.run(
        ["docker", "ps", "-a", "--filter", "label=ares-gateway.owner",
         "--format", '{{.ID}} {{.Label "ares-gateway.owner"}}'],
        capture_output=True, text=True, check=True,
    ).stdout
    return [line.split()[0] for line in out.splitlines() if f":{pid}:" in line]
