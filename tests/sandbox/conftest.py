"""Fixtures for the sandbox tests.

Docker-dependent tests (marked ``docker``) skip with a clear reason when no engine answers, but FAIL
when ``ARES_CI=1`` (set by ``.ci/run``) or ``ARES_REQUIRE_DOCKER=1``: CI provisions a real engine
(``.ci/provision-docker.sh``) and a missing one must not pass silently.
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

import sandbox
from bench.support.daytona_fake import API_KEY, DaytonaFake
from sandbox.docker import engine_available

HERE = Path(__file__).parent
BASE_IMAGE = os.environ.get("ARES_BASE_IMAGE", "ares-gateway/debian-base:bookworm")
AGENT_IMAGE = os.environ.get("ARES_AGENT_IMAGE", "ares-gateway/agent-base:latest")
TEST_DOCKERFILE = HERE / "images" / "Dockerfile"
REQUIRE_DOCKER = os.environ.get("ARES_CI") == "1" or os.environ.get("ARES_REQUIRE_DOCKER") == "1"

_engine: bool | None = None


def docker_required(what: str = "a Docker engine") -> None:
    """Skip (locally) or fail (CI) when the Docker engine or an image is missing."""
    global _engine
    if _engine is None:
        _engine = engine_available()
    missing = None
    if not _engine:
        missing = "no Docker engine answers"
    else:
        import docker as docker_sdk

        client = docker_sdk.from_env()
        try:
            for image in (BASE_IMAGE,) + ((AGENT_IMAGE,) if what == "agent image" else ()):
                try:
                    client.images.get(image)
                except docker_sdk.errors.ImageNotFound:
                    missing = f"image {image} is not built"
        finally:
            client.close()
    if missing is None:
        return
    message = f"{missing} (needed: {what}); run `bash .ci/provision-docker.sh` to provision Docker"
    if REQUIRE_DOCKER:
        pytest.fail(f"{message} [ARES_CI/ARES_REQUIRE_DOCKER is set, so this fails instead of skipping]")
    pytest.skip(message)


def pytest_runtest_setup(item: pytest.Item) -> None:
    if item.get_closest_marker("docker") is not None:
        docker_required()


@pytest.fixture(scope="session")
def daytona_fake() -> Iterator[DaytonaFake]:
    fake = DaytonaFake().start()
    yield fake
    fake.stop()


@pytest.fixture
def local_root(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> Path:
    root = tmp_path_factory.mktemp("local-sandboxes")
    monkeypatch.setenv("ARES_SANDBOX_LOCAL_ROOT", str(root))
    return root


def user_for(backend: str) -> str:
    """A non-root user that exists where the backend runs commands."""
    return "agent" if backend == "docker" else "nobody"


def spec_for(backend: str, tmp_path: Path, **kwargs: Any) -> sandbox.SandboxSpec:
    if backend == "docker":
        kwargs.setdefault("dockerfile", TEST_DOCKERFILE)
    if backend == "daytona":
        # The fake runs commands on this host: give each sandbox its own directory as workdir.
        workdir = tmp_path / "daytona-workdir"
        kwargs.setdefault("workdir", str(workdir))
        kwargs.setdefault("image", "ares-gateway/agent-base:latest")
    return sandbox.SandboxSpec(**kwargs)


def new_sandbox(backend: str, spec: sandbox.SandboxSpec, fake: DaytonaFake | None) -> sandbox.BaseSandbox:
    if backend == "daytona":
        assert fake is not None
        return sandbox.create(spec, backend="daytona", api_key=API_KEY, api_url=fake.api_url)
    return sandbox.create(spec, backend=backend)


SandboxFactory = Callable[..., Any]


def container_exists(ref: str) -> bool:
    import docker as docker_sdk

    client = docker_sdk.from_env()
    try:
        client.containers.get(ref)
        return True
    except docker_sdk.errors.NotFound:
        return False
    finally:
        client.close()


def backend_holds(sb: Any, fake: DaytonaFake | None) -> bool:
    """Whether the backend still holds anything of ``sb`` (directory, container, remote sandbox)."""
    if sb.backend == "local":
        return bool(sb.root.exists())
    if sb.backend == "docker":
        return container_exists(sb.container_id)
    assert fake is not None
    return any(live.id == sb.remote_id for live in fake.live())


@pytest.fixture(
    params=[
        "local",
        pytest.param("docker", marks=pytest.mark.docker),
        "daytona",
    ]
)
def backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def backend_fake(backend: str, request: pytest.FixtureRequest) -> DaytonaFake | None:
    """The Daytona stand-in for the daytona backend (what ``backend_holds`` looks in), else ``None``."""
    return request.getfixturevalue("daytona_fake") if backend == "daytona" else None


@pytest.fixture
async def make_sandbox(
    backend: str, tmp_path: Path, local_root: Path, backend_fake: DaytonaFake | None
) -> AsyncIterator[SandboxFactory]:
    """``await make_sandbox(**spec_kwargs)`` -> a started sandbox of the current backend, removed after."""
    made: list[sandbox.BaseSandbox] = []

    async def factory(start: bool = True, **kwargs: Any) -> sandbox.BaseSandbox:
        sb = new_sandbox(backend, spec_for(backend, tmp_path, **kwargs), backend_fake)
        made.append(sb)
        if start:
            await sb.start()
        return sb

    yield factory
    for sb in made:
        await sb.stop()
