"""Prerequisites of the harness tests: real CLIs, real sandboxes, a real gateway on loopback.

A missing prerequisite skips with the reason and the command that fixes it; in CI (``ARES_CI=1``)
it fails instead.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from functools import cache

import pytest

from harnesses import registry
from harnesses.base import INSTALL_ROOT

AGENTS_IMAGE = os.environ.get("ARES_AGENTS_IMAGE", "ares-gateway/agents:latest")
PROVISION = "bash .ci/provision-agents.sh"


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
    r = subprocess.run(["docker", "image", "inspect", tag], capture_output=True, check=False)
    return r.returncode == 0


def require_backend(backend: str, harness_name: str) -> None:
    harness = registry.create(harness_name)
    if backend == "local":
        prefix = f"{INSTALL_ROOT}/{harness_name}/{harness.version}"
        require(os.path.isfile(f"{prefix}/.ares-complete"),
                f"{harness_name} {harness.version} is not provisioned at {prefix}: run {PROVISION}")
        if harness_name == "terminus-2":
            require(shutil.which("tmux") is not None, "tmux is not installed: apt-get install tmux")
    else:
        require(_docker_ok(), "no Docker engine answers: run bash .ci/provision-docker.sh", docker=True)
        require(_image_present(AGENTS_IMAGE), f"the agents image {AGENTS_IMAGE} is missing: run {PROVISION}",
                docker=True)
