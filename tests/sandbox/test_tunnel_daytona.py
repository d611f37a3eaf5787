"""The exec tunnel on Daytona: over a toolbox PTY session and over an SSH exec channel.

The real ``daytona`` SDK drives the fake of bench/support/daytona_fake.py: its PTY WebSocket (a host
PTY whose shell prints noise first) and its SSH gateway (an in-process asyncssh server that refuses
port forwarding).  A ``network="none"`` sandbox there runs in its own network namespace (``bwrap
--unshare-net``), so its relay and its clients have only their loopback.  The transport suite of
test_tunnel.py runs unchanged on both transports; then a full DaytonaSandbox life (create with
``network_block_all``, the agent's HTTP over the tunnel, stop: access revoked, sandbox deleted), and a
live test against Daytona when ``DAYTONA_API_KEY`` is set.
"""

from __future__ import annotations

import json
import logging
import os
import shlex
import shutil
import socket
import subprocess
import sys
import tempfile
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from ares_gateway import EpisodeConfig, RunConfig
from bench.support.daytona_fake import API_KEY, DaytonaFake, netns_available
from sandbox import DaytonaSandbox, SandboxSpec
from sandbox._daytona_channels import parse_ssh_command
from sandbox.tunnel import Channel, Tunnel
from tests.helpers import free_port

from .test_tunnel import (  # the shared transport suite runs here on Daytona's transports
    CLIENT,
    HOSTILE,
    N_CONCURRENT,
    Harness,
    Session,
    _count_relays,
    session,
    test_hostile_relay_is_torn_down_with_bounded_memory,
    test_traffic_sse_big_body_all_bytes_and_64_concurrent_streams,
    test_transport_drop_mid_response_and_the_agents_retry_succeeds,
)

# Collected here with this module's `harness` fixture: the same assertions on Daytona's transports.
SHARED = (session, test_hostile_relay_is_torn_down_with_bounded_memory,
          test_traffic_sse_big_body_all_bytes_and_64_concurrent_streams,
          test_transport_drop_mid_response_and_the_agents_retry_succeeds)

REPO = str(Path(__file__).resolve().parents[2])
_PROBE = ("import socket,sys\ns=socket.socket(); s.settimeout(3)\n"
          "try:\n s.connect((sys.argv[1], int(sys.argv[2]))); print('connected')\n"
          "except OSError as e: print('failed', type(e).__name__)\n")


class FakeProcess:
    """The Daytona fake in its own process (the daemon is another machine): what the transport suite
    measures (memory under a hostile relay, throughput) is then the host's alone."""

    def __init__(self) -> None:
        self.proc = subprocess.Popen([sys.executable, "-m", "bench.support.daytona_fake"], cwd=REPO,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert self.proc.stdout is not None
        info = json.loads(self.proc.stdout.readline())
        self.api_url: str = info["api_url"]

    def stop(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        try:
            self.proc.wait(20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


@pytest.fixture(scope="module")
def fake_process() -> Iterator[FakeProcess]:
    fake = FakeProcess()
    yield fake
    fake.stop()


class DaytonaHarness(Harness):
    """A ``network="none"`` DaytonaSandbox on the fake (``tunnel`` "pty" or "ssh"); clients run in it."""

    def __init__(self, fake: DaytonaFake | FakeProcess, tunnel: str) -> None:
        self.kind, self.tunnel, self.fake = f"daytona-{tunnel}", tunnel, fake
        self.port = free_port()
        self.dir = tempfile.mkdtemp(prefix="ares-daytona-")
        self.sb: Any = None
        self.bare: Any = None  # a sandbox without forwards, where hostile "relays" run

    async def prepare(self) -> None:
        """Start the bare sandbox now: its SDK's first use (imports, clients) is not what a hostile
        relay's memory test measures (the Docker harness, too, has its container before)."""
        self.bare = self.new({})
        await self.bare.start()

    def new(self, forwards: dict[int, str]) -> DaytonaSandbox:
        spec = SandboxSpec(network="none", forwards=forwards, workdir=f"{self.dir}/work")
        return DaytonaSandbox(spec, api_key=API_KEY, api_url=self.fake.api_url, tunnel=self.tunnel,
                              relay_dir=f"{self.dir}/relay")

    async def open_tunnel(self, session: Session, **kwargs: Any) -> Tunnel:
        self.sb = self.new({self.port: session.path})
        await self.sb.start()
        tunnel = self.sb.tunnel_for(self.port)
        assert tunnel is not None
        return tunnel

    def hostile_opener(self, mode: str) -> Callable[[], Awaitable[Channel]]:
        path = Path(self.dir, "hostile.py")
        path.write_text(HOSTILE)

        async def opener() -> Channel:
            return await self.bare.open_channel(shlex.join(["python3", str(path), mode, "binary"]))

        return opener

    async def client(self, what: str) -> dict[str, Any]:
        r = await self.sb.exec(["python3", "-c", CLIENT, str(self.port), what], cwd="/", timeout=180)
        assert r.ok, r
        return dict(json.loads(r.stdout))

    async def close(self) -> None:
        for sb in (self.sb, self.bare):
            if sb is not None:
                await sb.stop()
        shutil.rmtree(self.dir, ignore_errors=True)


@pytest.fixture(params=["pty", "ssh"])
async def harness(request: pytest.FixtureRequest, fake_process: FakeProcess) -> AsyncIterator[Harness]:
    h = DaytonaHarness(fake_process, request.param)
    await h.prepare()
    yield h
    await h.close()


# ------------------------------------------------------------------------------- the whole sandbox


@pytest.mark.parametrize("tunnel", ["pty", "ssh"])
async def test_sandbox_life_over_the_tunnel(tunnel: str, daytona_fake: DaytonaFake, session: Session,
                                            caplog: pytest.LogCaptureFixture) -> None:
    """Create (network_block_all) -> the agent's HTTP over the tunnel, and nothing else reachable ->
    stop: the SSH access revoked or the PTY session killed, the sandbox deleted; no token in the log."""
    caplog.set_level(logging.INFO)
    h = DaytonaHarness(daytona_fake, tunnel)
    sb = h.new({h.port: session.path})
    host = socket.socket()
    host.bind(("127.0.0.1", 0))
    host.listen(4)
    try:
        await sb.start()
        body = daytona_fake.created[-1]
        assert body["name"] == f"ares-sbx-{sb.id}" and body["networkBlockAll"] is True
        assert f"forwards over a {tunnel} tunnel" in sb.description
        # The relay is root's: installed root-owned, not writable by others.
        st = os.stat(f"{h.dir}/relay/relay.py")
        assert (st.st_uid, st.st_mode & 0o777) == (0, 0o644)
        tunnel_obj = sb.tunnel_for(h.port)
        assert tunnel_obj is not None and tunnel_obj.running
        r = await sb.exec(["python3", "-c", CLIENT, str(h.port), "traffic"], cwd="/", timeout=180)
        assert r.ok, r
        got = json.loads(r.stdout)
        assert got["concurrent"] == N_CONCURRENT and got["bytes"] == [200, True] and got["big"][:2] == [200,
                                                                                                        True]
        assert session.together.is_set()
        if netns_available():  # the sandbox has only its loopback: the host's listening port is out of reach
            r = await sb.exec(["python3", "-c", _PROBE, "127.0.0.1", str(host.getsockname()[1])], cwd="/",
                              timeout=30)
            assert r.stdout.startswith("failed"), r
            r = await sb.exec("cat /proc/net/dev | tail -n +3 | cut -d: -f1", cwd="/", timeout=30)
            assert r.stdout.split() == ["lo"], r
        r = await sb.exec(_count_relays(h.port), user="root", cwd="/", timeout=30)
        assert r.stdout.strip() == "1", r
        if tunnel == "ssh":
            [token] = [t for t, owner in daytona_fake.ssh_tokens.items() if owner == sb.remote_id]
            assert token not in daytona_fake.ssh_revoked
            assert daytona_fake.ssh_execs and f"{h.dir}/relay/tunnel.sh" in daytona_fake.ssh_execs[-1]
        else:
            [pty_id] = [p for p in daytona_fake.pty_opened if p in daytona_fake.sandboxes[sb.remote_id].ptys]
            assert not daytona_fake.pty_dropped
    finally:
        host.close()
        await sb.stop()
        shutil.rmtree(h.dir, ignore_errors=True)
    assert sb.remote_id in daytona_fake.deleted
    if tunnel == "ssh":
        assert token in daytona_fake.ssh_revoked and sb.ssh_revoked == 1
        assert "Auth for user <token> succeeded" in caplog.text and token not in caplog.text
    else:
        assert pty_id in daytona_fake.pty_killed
    r_count = sum(1 for p in daytona_fake.sandboxes[sb.remote_id].procs if p.returncode is None)
    assert r_count == 0
    assert not daytona_fake.unknown_routes, daytona_fake.unknown_routes


async def test_ssh_gateway_refuses_forwards_and_revoked_tokens(daytona_fake: DaytonaFake,
                                                               session: Session) -> None:
    """What the tunnel's SSH transport relies on, checked on the stand-in: the token is the login, a
    remote forward (``ssh -R``) is refused, and a revoked token no longer gets in."""
    import asyncssh

    h = DaytonaHarness(daytona_fake, "ssh")
    sb = h.new({h.port: session.path})
    try:
        await sb.start()
        token, host, port = await sb._ssh_access()
        async with asyncssh.connect(host, port, username=token, known_hosts=None, client_keys=None,
                                    agent_path=None) as conn:
            with pytest.raises(asyncssh.ChannelListenError):
                await conn.forward_remote_port("127.0.0.1", 0, "127.0.0.1", 9)
            assert (await conn.run("echo hi", check=True)).stdout == "hi\n"
        assert any(r.startswith("tcpip-forward") for r in daytona_fake.ssh_refused)
        with pytest.raises(asyncssh.PermissionDenied):
            await asyncssh.connect(host, port, username="not-a-token", known_hosts=None, client_keys=None,
                                   agent_path=None)
    finally:
        await sb.stop()
        shutil.rmtree(h.dir, ignore_errors=True)
    with pytest.raises(asyncssh.PermissionDenied):
        await asyncssh.connect(host, port, username=token, known_hosts=None, client_keys=None,
                               agent_path=None)


async def test_bad_parameters_are_refused_and_the_ssh_command_is_parsed(daytona_fake: DaytonaFake,
                                                                       session: Session) -> None:
    with pytest.raises(ValueError, match="tunnel must be"):
        DaytonaSandbox(SandboxSpec(), api_key=API_KEY, api_url=daytona_fake.api_url, tunnel="exec")
    with pytest.raises(ValueError, match="pty_max_message"):
        DaytonaSandbox(SandboxSpec(), api_key=API_KEY, api_url=daytona_fake.api_url, pty_max_message=1 << 20)
    with pytest.raises(ValueError, match="relay_dir"):
        DaytonaSandbox(SandboxSpec(), api_key=API_KEY, api_url=daytona_fake.api_url, relay_dir="rel")
    assert parse_ssh_command("ssh -p 2222 tok@gw.example") == ("gw.example", 2222, "tok")
    assert parse_ssh_command("ssh tok@ssh.app.daytona.io") == ("ssh.app.daytona.io", 22, "tok")
    with pytest.raises(ValueError) as info:
        parse_ssh_command("ssh secret-token-here")
    assert "secret-token-here" not in str(info.value)


async def test_pty_messages_stay_within_the_daemons_read_limit(daytona_fake: DaytonaFake,
                                                               session: Session) -> None:
    """An 8 MiB body goes to the PTY in messages of at most 64 KiB: the fake closes a connection on a
    bigger one (as the daemon's read limit does), which would drop the channel."""
    h = DaytonaHarness(daytona_fake, "pty")
    tunnel = await h.open_tunnel(session)
    try:
        got = await h.client("traffic")
        assert got["big"][:2] == [200, True]
        assert tunnel.channels_opened == 1 and not daytona_fake.pty_dropped, tunnel.last_reason
    finally:
        await h.close()


# ------------------------------------------------------------------------------------------- live


@pytest.mark.skipif(not os.environ.get("DAYTONA_API_KEY"),
                    reason="live Daytona tunnel test: set DAYTONA_API_KEY (and DAYTONA_API_URL for a "
                           "self-hosted Daytona)")
@pytest.mark.parametrize("tunnel", ["ssh", "pty"])
async def test_live_daytona_tunnel(tunnel: str) -> None:
    """A real sandbox with network_block_all: a request through the tunnel reaches a local aiohttp
    session socket, and an outside address is unreachable from inside."""
    seen: list[str] = []

    async def hello(request: web.Request) -> web.Response:
        seen.append(request.path)
        return web.Response(text="hello from the session")

    app = web.Application()
    app.router.add_get("/hello", hello)
    runner = web.AppRunner(app)
    await runner.setup()
    path = os.path.join(tempfile.mkdtemp(prefix="ares-live-"), "agent.sock")
    await web.UnixSite(runner, path).start()
    spec = SandboxSpec(network="none", forwards={18080: path}, workdir="/tmp/ares-live", auto_stop_minutes=5,
                       auto_delete_minutes=0)
    try:
        async with DaytonaSandbox(spec, tunnel=tunnel) as sb:
            fetch = ("import urllib.request,sys\n"
                     "print(urllib.request.urlopen(sys.argv[1], timeout=20).read().decode())")
            r = await sb.exec(["python3", "-c", fetch, "http://127.0.0.1:18080/hello"], timeout=60)
            assert r.stdout.strip() == "hello from the session", r
            assert seen == ["/hello"]
            r = await sb.exec(["python3", "-c", _PROBE, "1.1.1.1", "443"], timeout=60)
            assert r.stdout.startswith("failed"), r
    finally:
        await runner.cleanup()


def _episode_task(root: Path, work: Path, name: str, *, internet: bool) -> Any:
    """A task whose workdir is ``work``: a sandbox of the stand-in shares the host's disk, and its agent
    user must be able to reach the folder (pytest's own are root's alone)."""
    from ares_gateway.episodes.tasks import Task

    d = root / name
    (d / "tests").mkdir(parents=True)
    (d / "solution").mkdir()
    (d / "task.toml").write_text('version = "1.0"\n[agent]\ntimeout_sec = 120\n[verifier]\ntimeout_sec = 60\n'
                                 f'[environment]\nworkdir = "{work}"\n'
                                 + ("allow_internet = true\n" if internet else ""))
    (d / "instruction.md").write_text("Write hello to greeting.txt\n")
    (d / "solution" / "solve.sh").write_text("#!/bin/sh\necho hello > greeting.txt\n")
    (d / "tests" / "test.sh").write_text(
        f'#!/bin/sh\nv="${{ARES_VERIFIER_DIR:-/logs/verifier}}"; mkdir -p "$v"\n'
        f'if grep -q hello {work}/greeting.txt; then echo 1 > "$v/reward.txt"; else echo 0 > '
        '"$v/reward.txt"; fi\n')
    return Task.load(d)


@pytest.mark.parametrize("tunnel", ["ssh", "pty"])
async def test_episodes_on_daytona_run_with_the_network_blocked_and_say_how(
        tunnel: str, daytona_fake: DaytonaFake, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A real harness episode (tiny-agent, the oracle) on the stand-in through the real SDK: its sandbox
    is created with the network blocked, the agent's LLM calls go over the tunnel, reward 1.0, and
    results.json says how each sandbox was networked (a task that opts into internet says so, and still
    reaches its session over the tunnel)."""
    from ares_gateway.episodes.rollouts import run_rollouts
    from ares_gateway.policies import make_policy
    from sandbox import tunnel as tunnel_mod

    if not netns_available():
        pytest.skip("the stand-in needs bwrap --unshare-net and nsenter to block a sandbox's network")
    monkeypatch.setenv("DAYTONA_API_KEY", API_KEY)
    monkeypatch.setenv("DAYTONA_API_URL", daytona_fake.api_url)
    monkeypatch.setenv("ARES_DAYTONA_TUNNEL", tunnel)
    started: list[Tunnel] = []
    real_start = tunnel_mod.Tunnel.start

    async def counting_start(self: Tunnel) -> None:  # the real start, counted: proof the tunnel carried it
        started.append(self)
        await real_start(self)

    monkeypatch.setattr(tunnel_mod.Tunnel, "start", counting_start)
    created = len(daytona_fake.created)
    top = Path(tempfile.mkdtemp(prefix="ares-daytona-episode-"))
    os.chmod(top, 0o755)
    try:
        tasks = [_episode_task(tmp_path, top / "closed", "closed", internet=False),
                 _episode_task(tmp_path, top / "open", "open", internet=True)]
        # One at a time: the stand-in's sandboxes share the host's disk (the harness's own folders too).
        summary = await run_rollouts(
            tasks, policy=make_policy("oracle"),
            episode=EpisodeConfig("tiny-agent", sandbox="daytona", time_limit=120),
            run=RunConfig(out=tmp_path / "out", stats="null", concurrency=1),
        )
    finally:
        shutil.rmtree(top, ignore_errors=True)
    by_task = {e.task: e for e in summary.episodes}
    assert all(e.exit_reason == "completed" and e.reward == 1.0 for e in summary.episodes), \
        [(e.task, e.exit_reason, e.reward, e.error) for e in summary.episodes]
    doc = json.loads((tmp_path / "out" / "results.json").read_text())
    assert {e["task"]: e["network"] for e in doc["episodes"]} == {"closed": "relay", "open": "internet"}
    assert doc["summary"]["networks"] == {"internet": 1, "relay": 1}
    # Both reached their session over the tunnel: the one with open egress too (the host's loopback URL
    # means nothing on another machine).
    assert by_task["closed"].turns >= 1 and len(started) == 2
    assert all(t.mux is not None and t.mux.opened >= 1 and t.violation is None for t in started)
    # Each episode made two sandboxes, the agent's and the fresh one its tests ran in, networked alike.
    made = daytona_fake.created[created:]
    roles = sorted((c.get("labels") or {}).get("ares-gateway.role", "agent") for c in made)
    assert roles == ["agent", "agent", "grading", "grading"], roles
    blocked = [bool(c.get("networkBlockAll")) for c in made]
    assert sorted(blocked) == [False, False, True, True]
    assert {e["grading"] for e in doc["episodes"]} == {"fresh"}
