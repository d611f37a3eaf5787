"""Prerequisites of the harness tests: real CLIs, real sandboxes, a real gateway on loopback.

A missing prerequisite skips with the reason and the command that fixes it; in CI (``ARES_CI=1``)
it fails instead.
"""

from __future__ import annotations

import os
import shutil

from harnesses import registry
from harnesses.base import INSTALL_ROOT
from tests.prereq import docker_ok, image_present, require

AGENTS_IMAGE = os.environ.get("ARES_AGENTS_IMAGE", "ares-gateway/agents:latest")
PROVISION = "bash .ci/provision-agents.sh"


def require_backend(backend: str, harness_name: str) -> None:
    harness = registry.create(harness_name)
    if backend == "local":
        prefix = f"{INSTALL_ROOT}/{harness_name}/{harness.version}"
        require(os.path.isfile(f"{prefix}/.ares-complete"),
                f"{harness_name} {harness.version} is not provisioned at {prefix}: run {PROVISION}")
        if harness_name == "terminus-2":
            require(shutil.which("tmux") is not None, "tmux is not installed: apt-get install tmux")
    else:
        require(docker_ok(), "no Docker engine answers: run bash .ci/provision-docker.sh", docker=True)
        require(image_present(AGENTS_IMAGE), f"the agents image {AGENTS_IMAGE} is missing: run {PROVISION}",
                docker=True)
