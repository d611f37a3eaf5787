"""Prerequisites of the end-to-end rollout tests: a missing one skips with the fixing command, and
fails in CI (``ARES_CI=1``; ``ARES_REQUIRE_DOCKER=1`` for the Docker ones)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from harnesses import registry
from harnesses.base import INSTALL_ROOT
from tests.prereq import docker_ok, image_present, require, require_hardened_local

AGENTS_IMAGE = "ares-gateway/agents:latest"
PROVISION = "bash .ci/provision-docker.sh && bash .ci/provision-agents.sh"
REPO = Path(__file__).resolve().parents[2]
# The hostile-sandbox tests' image: the agents image's base (.ci/provision-docker.sh builds it).
AGENT_BASE_IMAGE = os.environ.get("ARES_AGENT_IMAGE", "ares-gateway/agent-base:latest")


def require_mini(backend: str = "local") -> None:
    """mini-swe-agent provisioned for local sandboxes, or the agents image for Docker."""
    if backend == "docker":
        require(docker_ok(), f"no Docker engine answers: run {PROVISION}", docker=True)
        require(image_present(AGENTS_IMAGE), f"the agents image {AGENTS_IMAGE} is missing: run {PROVISION}",
                docker=True)
        return
    version = registry.create("mini-swe-agent").version
    prefix = f"{INSTALL_ROOT}/mini-swe-agent/{version}"
    require(os.path.isfile(f"{prefix}/.ares-complete"),
            f"mini-swe-agent {version} is not provisioned at {prefix}: "
                                                        "run bash .ci/provision-agents.sh")


def require_backend(backend: str) -> None:
    """What episodes of the tiny agent need on ``backend``: the hardened local sandbox, or a Docker
    engine and the image :data:`AGENTS_IMAGE`."""
    if backend != "docker":
        require_hardened_local()
        return
    require(docker_ok(), "no Docker engine answers: run bash .ci/provision-docker.sh", docker=True)
    require(image_present(AGENTS_IMAGE),
            f"the image {AGENTS_IMAGE} is missing: run bash .ci/provision-agents.sh", docker=True)


def require_agent_base() -> None:
    """A Docker engine and the image :data:`AGENT_BASE_IMAGE`."""
    require(docker_ok(), f"no Docker engine answers: run {PROVISION}", docker=True)
    require(image_present(AGENT_BASE_IMAGE), f"the image {AGENT_BASE_IMAGE} is missing: run {PROVISION}",
            docker=True)


def owned_containers(pid: int) -> list[str]:
    """Containers (any state) whose owner label names process ``pid``."""
    out = subprocess.run(
        ["docker", "ps", "-a", "--filter", "label=ares-gateway.owner",
         "--format", '{{.ID}} {{.Label "ares-gateway.owner"}}'],
        capture_output=True, text=True, check=True,
    ).stdout
    return [line.split()[0] for line in out.splitlines() if f":{pid}:" in line]
