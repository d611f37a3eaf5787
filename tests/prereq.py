"""Prerequisites shared by the suites that need real CLIs, a Docker engine or images.

A missing prerequisite skips with the reason and the command that fixes it; in CI
(``ARES_CI=1``, or ``ARES_REQUIRE_DOCKER=1`` for Docker ones) it fails instead.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from functools import cache

import pytest


def require(ok: bool, reason: str, *, docker: bool = False) -> None:
    if ok:
        return
    if os.environ.get("ARES_CI") == "1" or (docker and os.environ.get("ARES_REQUIRE_DOCKER") == "1"):
        pytest.fail(f"prerequisite missing in CI: {reason}")
    pytest.skip(reason)


@cache
def docker_ok() -> bool:
    """Whether a Docker engine answers."""
    try:
        from sandbox.docker import engine_available

        return bool(engine_available())
    except Exception:
        return False


@cache
def image_present(tag: str) -> bool:
    if not shutil.which("docker"):
        return False
    return subprocess.run(["docker", "image", "inspect", tag], capture_output=True,
                          check=False).returncode == 0


def require_hardened_local() -> None:
    """The hardened local sandbox: root, bubblewrap, nsenter and setpriv."""
    from ares_gateway.episodes.episode import local_can_harden

    require(local_can_harden(), "the hardened local sandbox needs root, bubblewrap, nsenter and setpriv")
