"""Checks a run makes once, before any sandbox starts (``ares-gateway run`` and ``demo`` call
:func:`preflight`).

* the upstream server answers (``upstream`` policy): ``GET {base_url}/models``, one try, a few
  seconds; a server without ``/models`` is asked one tiny chat completion instead;
* the Docker engine answers and has the image the tasks run in (``--sandbox docker``);
* the harness's CLI is installed, or can be installed now, for local sandboxes (once for the run).

Without them a run found out per episode: an unreachable ``--base-url`` cost ~37 s of retries in
every episode before an empty error, and a missing engine was reported once per episode. A failed
check raises :class:`PreflightError` with one line that says what to do.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ares_gateway.episodes.episode import DEFAULT_IMAGE, one_line
from ares_gateway.episodes.tasks import Task
from ares_gateway.policies.base import Policy

if TYPE_CHECKING:
    from ares_gateway.policies.upstream import UpstreamPolicy

#: Seconds each check may take before it counts as failed.
CHECK_TIMEOUT = 10.0


class PreflightError(Exception):
    """A check before the run failed; the message is one line saying what failed and what to do."""


@dataclass
class PreflightReport:
    """What the checks found: one line per check, and the harness options local sandboxes need."""

    lines: list[str] = field(default_factory=list)
    harness_options: dict[str, Any] = field(default_factory=dict)


async def check_upstream(policy: UpstreamPolicy, *, timeout: float = CHECK_TIMEOUT) -> str:
    """Whether ``policy`` (an :class:`~ares_gateway.policies.UpstreamPolicy`) reaches its server: its
    :meth:`~ares_gateway.policies.UpstreamPolicy.check`, with the failure as a :class:`PreflightError`."""
    from ares_gateway.policies import UpstreamError

    try:
        return str(await policy.check(timeout=timeout))
    except UpstreamError as exc:
        raise PreflightError(one_line(exc.message) or "the upstream check failed") from None


async def check_docker(tasks: Sequence[Task], *, image: str | None = None,
                       timeout: float = CHECK_TIMEOUT) -> str:
    """The Docker engine answers a ping, and the image tasks without their own run in (``image``, else the
    agents image) is there: sandboxes do not pull one unless ``ARES_DOCKER_PULL=1``."""
    return await asyncio.to_thread(_check_docker, list(tasks), image, timeout)


def _check_docker(tasks: list[Task], image: str | None, timeout: float) -> str:
    from sandbox.docker import docker  # the docker SDK, imported untyped as the backend does

    try:
        client = docker.from_env(timeout=int(max(1, timeout)))
    except Exception as exc:
        raise PreflightError(_no_engine(exc)) from None
    try:
        try:
            client.ping()
        except Exception as exc:
            raise PreflightError(_no_engine(exc)) from None
        wanted = image or DEFAULT_IMAGE
        if not any(not t.needs_image for t in tasks):
            return "Docker engine answers (each task builds its own image)"
        try:
            client.images.get(wanted)
        except docker.errors.ImageNotFound:
            if os.environ.get("ARES_DOCKER_PULL") == "1":
                return f"Docker engine answers (image {wanted} is not here yet: the first sandbox pulls it)"
            build = ("bash .ci/provision-docker.sh && bash .ci/provision-agents.sh" if wanted == DEFAULT_IMAGE
                     else f"docker pull {wanted}")
            raise PreflightError(
                f"the Docker image {wanted} is not on this engine (sandboxes do not pull it): get it "
                f"with {build}, "
                "let sandboxes pull it (ARES_DOCKER_PULL=1), pass another --image, or use --sandbox local"
            ) from None
        except Exception as exc:
            raise PreflightError(
                f"the Docker engine could not look up image {wanted}: {one_line(str(exc))}") from None
        return f"Docker engine answers, image {wanted} is there"
    finally:
        client.close()


def _no_engine(exc: BaseException) -> str:
    return (
        f"no Docker engine answers ({one_line(str(exc), 200)}): start one (bash .ci/provision-docker.sh), "
        "point DOCKER_HOST at one, or use --sandbox local")


async def check_harness(harness: str, backend: str, *, quiet: bool = False) -> tuple[str, dict[str, Any]]:
    """For local sandboxes: the harness's CLI installed once on this host (installed now when it is
    missing); the install root to give each harness comes back in the options. Container backends
    find the CLI in the image or install it in each sandbox, so nothing is checked for them."""
    if backend != "local":
        return "", {}
    from ares_gateway.episodes.installs import ensure_local_install
    from harnesses import HarnessError

    try:
        root = await ensure_local_install(harness, quiet=quiet)
    except HarnessError as exc:
        raise PreflightError(f"installing the agent failed: {one_line(str(exc))}") from None
    except OSError as exc:
        raise PreflightError(f"installing {harness} failed: {one_line(str(exc))}") from None
    return f"{harness} installed under {root}", {"install_root": root}


async def preflight(
    *, policy: Policy | None, backend: str, harness: str, tasks: Sequence[Task], image: str | None = None,
    timeout: float = CHECK_TIMEOUT, quiet: bool = False, host_checks: bool = True,
) -> PreflightReport:
    """Every check for a run (see the module docstring), in order; the first failure raises
    :class:`PreflightError`. ``host_checks=False`` leaves out this host's Docker and harness checks
    (episodes that run on other machines: each of those checks itself)."""
    from ares_gateway.policies import UpstreamPolicy

    report = PreflightReport()
    if isinstance(policy, UpstreamPolicy):
        report.lines.append(await check_upstream(policy, timeout=timeout))
    if not host_checks:
        return report
    if backend == "docker":
        report.lines.append(await check_docker(tasks, image=image, timeout=timeout))
    line, options = await check_harness(harness, backend, quiet=quiet)
    if line:
        report.lines.append(line)
    report.harness_options.update(options)
    return report
