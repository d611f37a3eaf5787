"""Docker-only behaviour, against the real engine: image cache, limits, labels, host network, agent image."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from aiohttp import web

import sandbox
from sandbox import DockerSandbox, SandboxSpec, janitor
from sandbox.docker import client

from .conftest import AGENT_IMAGE, BASE_IMAGE, TEST_DOCKERFILE, docker_required

pytestmark = pytest.mark.docker


async def test_dockerfile_image_is_built_once_and_cached_by_content(tmp_path: Path) -> None:
    ctx = tmp_path / "ctx"
    ctx.mkdir()
    (ctx / "payload.txt").write_text("v1\n")
    dockerfile = ctx / "Dockerfile"
    dockerfile.write_text(
        f"FROM {BASE_IMAGE}\nCOPY payload.txt /payload.txt\nRUN cat /proc/sys/kernel/random/uuid > /stamp\n")
    stamps = []
    for _ in range(2):
        async with DockerSandbox(SandboxSpec(dockerfile=dockerfile)) as sb:
            stamps.append((sb.image, (await sb.exec("cat /stamp /payload.txt")).stdout))
    assert stamps[0] == stamps[1], "the second sandbox must reuse the cached image, not rebuild"
    (ctx / "payload.txt").write_text("v2\n")  # a context change is a new image
    async with DockerSandbox(SandboxSpec(dockerfile=dockerfile)) as sb:
        assert sb.image != stamps[0][0]
        assert (await sb.exec("cat /payload.txt")).stdout == "v2\n"


async def test_broken_dockerfile_is_a_clear_error(tmp_path: Path) -> None:
    dockerfile = tmp_path / "Dockerfile"
    dockerfile.write_text(f"FROM {BASE_IMAGE}\nRUN exit 3\n")
    with pytest.raises(sandbox.ImageBuildError, match="exit"):
        await DockerSandbox(SandboxSpec(dockerfile=dockerfile)).start()
    with pytest.raises(sandbox.SandboxStartError, match="not on this Docker engine"):
        await DockerSandbox(SandboxSpec(image="ares-gateway/no-such-image:never")).start()


async def test_limits_and_labels_are_applied() -> None:
    spec = SandboxSpec(
        dockerfile=TEST_DOCKERFILE, resources=sandbox.Resources(cpus=0.5, memory="256m"), labels={"team": "x"}
    )
    async with DockerSandbox(spec) as sb:
        attrs = client().api.inspect_container(sb.container_id)
        assert attrs["HostConfig"]["NanoCpus"] == 500_000_000
        assert attrs["HostConfig"]["Memory"] == 256 * 1024 * 1024
        assert attrs["HostConfig"]["NetworkMode"] == "host"
        labels = attrs["Config"]["Labels"]
        assert labels["team"] == "x"
        assert labels[janitor.OWNER_LABEL] == janitor.owner_id()
        assert labels[janitor.SESSION_LABEL] == janitor.session_id()
        assert abs(int(labels[janitor.CREATED_LABEL]) - time.time()) < 300
        # The limit is enforced by the kernel, as seen from inside.
        limit = await sb.exec(
            "cat /sys/fs/cgroup/memory.max 2>/dev/null || cat /sys/fs/cgroup/memory/memory.limit_in_bytes"
        )
        assert limit.stdout.strip() == str(256 * 1024 * 1024)


async def test_host_network_reaches_a_loopback_server() -> None:
    async def ping(_: web.Request) -> web.Response:
        return web.Response(text="pong-from-host")

    app = web.Application()
    app.router.add_get("/ping", ping)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    try:
        async with DockerSandbox(SandboxSpec(dockerfile=TEST_DOCKERFILE)) as sb:
            script = (
                f"exec 3<>/dev/tcp/127.0.0.1/{port}; "
                "printf 'GET /ping HTTP/1.0\\r\\nHost: 127.0.0.1\\r\\n\\r\\n' >&3; cat <&3"
            )
            result = await sb.exec(["bash", "-c", script], timeout=30)
            assert "pong-from-host" in result.stdout, result
    finally:
        await runner.cleanup()


async def test_agent_base_image() -> None:
    docker_required("agent image")
    async with DockerSandbox(SandboxSpec(image=AGENT_IMAGE)) as sb:
        tools = await sb.exec("bash --version | head -1; git --version; tmux -V; node --version; npm "
                              "--version; python3 --version")
        assert tools.ok, tools
        for word in ("bash", "git version", "tmux", "v", "Python 3"):
            assert word in tools.stdout
        who = await sb.exec("id -un; id -u; echo $HOME; npm config get prefix", user="agent")
        assert who.stdout.split() == ["agent", "1000", "/home/agent", "/home/agent/.npm-global"]
        assert (await sb.exec("touch /workspace/x", user="agent")).ok


async def test_auto_backend_picks_docker_when_an_engine_answers() -> None:
    sb = sandbox.create(SandboxSpec(dockerfile=TEST_DOCKERFILE))
    assert isinstance(sb, DockerSandbox)


async def test_uploads_belong_to_the_default_user(tmp_path: Path) -> None:
    (tmp_path / "f.txt").write_text("x")
    async with DockerSandbox(SandboxSpec(dockerfile=TEST_DOCKERFILE, user="agent")) as sb:
        await sb.upload_file(tmp_path / "f.txt", "repo/f.txt")
        result = await sb.exec("stat -c %U repo/f.txt; whoami; echo y >> repo/f.txt && cat repo/f.txt")
        assert result.stdout.split() == ["agent", "agent", "xy"]


def test_auto_backend_falls_back_to_local_without_an_engine(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DOCKER_HOST", "unix:///nonexistent/docker.sock")
    assert not sandbox.docker.engine_available(timeout=1)
    assert isinstance(sandbox.create(SandboxSpec()), sandbox.LocalSandbox)
