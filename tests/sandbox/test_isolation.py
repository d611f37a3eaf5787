"""Exploits a policy-written agent would try from inside a sandbox; each must fail.

Local sandboxes are ``hardened`` with ``network="none"``; Docker ones use the agent image with
``network="none"``.  The agent runs as the unprivileged ``agent`` user.  Every probe also has a
control that must succeed (host networking, a visible path, root), so a probe that cannot fail
does not pass silently.  Only loopback addresses are ever contacted.
"""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
import tempfile
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

import sandbox
from sandbox import ForwardError, SandboxSpec
from sandbox._hardening import CONFINE_SCRIPT
from sandbox.local import DEFAULT_PATH, ROOT_CAPS, seccomp_filter
from tests.prereq import require_hardened_local

from .conftest import AGENT_IMAGE, docker_required

REPO = Path(__file__).resolve().parents[2]
SOLUTIONS = sorted(str(p) for p in (REPO / "examples" / "tasks").glob("*/solution"))
HOST_SECRETS = ["/root", "/work", str(REPO), "/var/run/docker.sock", *SOLUTIONS[:2]]


def _host_probes() -> list[str]:
    """Paths that exist on this host under each secret place (an image may have its own empty /root)."""
    probes = []
    for place in HOST_SECRETS:
        path = Path(place)
        if path.is_dir():
            entries = sorted(os.listdir(path))
            if entries:
                probes.append(str(path / entries[0]))
        elif path.exists():
            probes.append(place)
    return probes
FORWARD_PORT = 18080


@pytest.fixture(params=["local", pytest.param("docker", marks=pytest.mark.docker)])
def isolated_backend(request: pytest.FixtureRequest) -> str:
    if request.param == "local":
        require_hardened_local()
    else:
        docker_required("agent image")
    return str(request.param)


def _spec(backend: str, **kwargs: Any) -> SandboxSpec:
    kwargs.setdefault("network", "none")
    if backend == "docker":
        kwargs.setdefault("image", AGENT_IMAGE)
    else:
        kwargs.setdefault("hardened", True)
    return SandboxSpec(**kwargs)


class UnixHTTP:
    """An aiohttp server on a unix socket in its own directory (as the gateway serves one per session)."""

    def __init__(self) -> None:
        self.dir = tempfile.mkdtemp(prefix="ares-sock-", dir="/tmp")
        os.chmod(self.dir, 0o755)
        self.path = os.path.join(self.dir, "session.sock")
        self.hits = 0

    async def start(self) -> None:
        async def hello(request: web.Request) -> web.Response:
            self.hits += 1
            return web.Response(text="hello-from-the-host-socket")

        async def echo(request: web.Request) -> web.Response:
            return web.Response(body=await request.read())

        app = web.Application(client_max_size=16 * 1024 * 1024)
        app.router.add_get("/hello", hello)
        app.router.add_post("/echo", echo)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        await web.UnixSite(self.runner, self.path).start()

    async def stop(self) -> None:
        await self.runner.cleanup()


@pytest.fixture
async def unix_http() -> AsyncIterator[UnixHTTP]:
    server = UnixHTTP()
    await server.start()
    yield server
    await server.stop()


@pytest.fixture
def host_port() -> Iterator[int]:
    """A TCP listener on the host's 127.0.0.1 that accepts (so 'refused' can only mean unreachable)."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(16)
    yield srv.getsockname()[1]
    srv.close()


_CONNECT = (
    "import socket,sys\n"
    "s=socket.socket(); s.settimeout(3)\n"
    "try:\n s.connect(('127.0.0.1', int(sys.argv[1]))); print('connected')\n"
    "except OSError as e: print('failed', type(e).__name__)\n"
)


async def _connect_from_inside(sb: sandbox.BaseSandbox, port: int) -> str:
    r = await sb.exec(["python3", "-c", _CONNECT, str(port)], user="agent", cwd="/", timeout=60)
    assert r.ok, r
    return r.stdout.strip()


_GET = (
    "import sys,urllib.request\n"
    "print(urllib.request.urlopen(f'http://127.0.0.1:{sys.argv[1]}/hello', timeout=20).read().decode())\n"
)


# ------------------------------------------------------------------------------------------- filesystem


async def test_host_files_and_sockets_are_not_visible(isolated_backend: str) -> None:
    assert SOLUTIONS, "examples/tasks/*/solution not found: the probe list would be short"
    probes = _host_probes()
    assert len(probes) >= 4, probes
    async with sandbox.create(_spec(isolated_backend), backend=isolated_backend) as sb:
        for path in probes:
            r = await sb.exec(
                ["sh", "-c", 'test -e "$0" && echo EXISTS; cat "$0" 2>/dev/null | head -c 100', path],
                user="agent", cwd="/", timeout=30)
            assert "EXISTS" not in r.stdout, f"{path} is visible from inside: {r.stdout!r}"
        # Control: the probe does see what is there.
        r = await sb.exec(["sh", "-c", 'test -e /usr/bin && echo EXISTS'], user="agent", cwd="/", timeout=30)
        assert "EXISTS" in r.stdout
        # An honest command still works, as the agent, in the workdir.
        ok = await sb.exec("echo hi > note.txt && cat note.txt && python3 -c 'print(6*7)'", user="agent",
                           timeout=60)
        assert ok.ok and ok.stdout.split() == ["hi", "42"], ok


async def test_the_agent_user_has_no_capabilities_and_root_still_works(isolated_backend: str) -> None:
    async with sandbox.create(_spec(isolated_backend), backend=isolated_backend) as sb:
        agent = await sb.exec("id -u; grep -E '^Cap(Eff|Prm|Bnd|Amb)' /proc/self/status", user="agent",
                              timeout=30)
        lines = agent.stdout.split("\n")
        assert lines[0] != "0", agent
        caps = dict(line.split(":\t") for line in lines[1:] if line)
        assert int(caps["CapEff"], 16) == 0 and int(caps["CapPrm"], 16) == 0, caps
        if isolated_backend == "local":  # setpriv empties the bounding set and sets no_new_privs
            assert int(caps["CapBnd"], 16) == 0, caps
            nnp = await sb.exec("grep NoNewPrivs /proc/self/status", user="agent", timeout=30)
            assert nnp.stdout.split()[-1] == "1", nnp
        # Root (installs, verifiers) keeps the powers it needs inside the sandbox.
        root = await sb.exec("id -u; grep CapEff /proc/self/status; mkdir -p /opt/x-root-only 2>/dev/null; "
                             "mkdir -p /srv/verifier && echo ok > /srv/verifier/r && cat /srv/verifier/r",
                             timeout=30)
        out = root.stdout.split("\n")
        assert out[0] == "0" and int(out[1].split()[-1], 16) != 0 and "ok" in out, root
        # ... and the agent cannot write where root put the verifier's files.
        forge = await sb.exec("echo 1.0 > /srv/verifier/r", user="agent", timeout=30)
        assert not forge.ok


_HOST_HAS_SHADOW = os.path.isfile("/etc/shadow") and os.path.getsize("/etc/shadow") > 0


async def test_hardened_local_root_is_confined_and_has_an_environment_of_its_own(tmp_path: Path) -> None:
    """Root (installs, the verifier) is not the host's root: a reduced bounding set, the
    seccomp filter, HOME=/root and no caller variable that loads code from elsewhere."""
    require_hardened_local()
    planted = {"PYTHONPATH": "/workspace/evil", "PYTHONSTARTUP": "/workspace/s.py",
               "LD_PRELOAD": "/workspace/x.so", "BASH_ENV": "/workspace/rc", "HOME": "/workspace",
               "PATH": "/workspace/bin:/usr/bin", "TASK_VAR": "kept"}
    show = ("grep -E '^(CapBnd|CapEff|Seccomp):' /proc/self/status; env; "
            "python3 -c 'import site; print(\"USER_SITE\", site.ENABLE_USER_SITE)'")
    async with sandbox.LocalSandbox(_spec("local")) as sb:
        root = await sb.exec(show, env=planted, timeout=60)
        agent = await sb.exec(show, env=planted, user="agent", timeout=60)
        for r in (root, agent):
            assert r.ok, r
        status = dict(line.split(":\t") for line in root.stdout.splitlines()
                      if line.startswith(("Cap", "Seccomp")))
        env = dict(line.split("=", 1) for line in root.stdout.splitlines() if "=" in line
                   and ":" not in line[:8])
        allowed = {"chown": 0, "dac_override": 1, "fowner": 3, "fsetid": 4, "kill": 5, "setgid": 6,
                   "setuid": 7, "setpcap": 8, "net_bind_service": 10, "sys_chroot": 18, "audit_write": 29}
        assert set(allowed) == set(ROOT_CAPS)
        assert int(status["CapBnd"], 16) == int(status["CapEff"],
                                                16) == sum(1 << b for b in allowed.values()), status
        assert status["Seccomp"] == "2"
        assert env["HOME"] == "/root" and env["PATH"] == DEFAULT_PATH and env["TASK_VAR"] == "kept", env
        assert env["PYTHONNOUSERSITE"] == "1" and "USER_SITE False" in root.stdout
        for var in ("PYTHONPATH", "PYTHONSTARTUP", "LD_PRELOAD", "BASH_ENV"):
            assert var not in env, var
        # Control: the agent's own commands keep what the caller passes (and the filter applies).
        assert "PYTHONPATH=/workspace/evil" in agent.stdout and "Seccomp:\t2" in agent.stdout, agent
        # Root can still do a verifier's work.
        work = await sb.exec("mkdir -p /logs/v && chown agent /logs/v && runuser -u agent -- id -u && "
                             "echo 1 > /logs/v/r && cat /logs/v/r && ls -ld /root", timeout=60)
        assert work.ok and work.stdout.split()[:2] == ["1000", "1"] and "drwx------" in work.stdout, work
        # The host's password hashes read as empty, even for root (control: /etc/passwd has content).
        if _HOST_HAS_SHADOW:
            etc = await sb.exec("wc -c < /etc/shadow; wc -c < /etc/passwd", timeout=30)
            shadow, passwd = etc.stdout.split()
            assert shadow == "0" and int(passwd) > 0, etc


def test_the_confine_launcher_never_runs_a_command_unconfined(tmp_path: Path) -> None:
    bad = tmp_path / "bad.bpf"
    bad.write_bytes(b"not a filter")
    marker = tmp_path / "ran"
    for filt in (bad, tmp_path / "missing.bpf"):
        r = subprocess.run(
            [sys.executable, "-I", "-S", str(CONFINE_SCRIPT), str(filt), "--", "touch", str(marker)],
            capture_output=True, text=True, timeout=30)
        assert r.returncode == 126 and "ares-confine" in r.stderr, r
        assert not marker.exists()
    good = tmp_path / "good.bpf"
    good.write_bytes(seccomp_filter())
    r = subprocess.run([sys.executable, "-I", "-S", str(CONFINE_SCRIPT), str(good), "--", "sh", "-c",
                        "grep Seccomp: /proc/self/status; unshare -U true && echo USERNS"],
                       capture_output=True, text=True, timeout=30)
    assert r.returncode == 1 and r.stdout.split() == ["Seccomp:", "2"], r


async def test_transfers_never_follow_an_agents_symlink_onto_the_host(tmp_path: Path) -> None:
    """Hardened local transfers run inside the sandbox: a planted symlink cannot redirect them."""
    require_hardened_local()
    target = tmp_path / "host-dir"
    target.mkdir()
    payload = tmp_path / "payload.txt"
    payload.write_text("from the verifier\n")
    async with sandbox.LocalSandbox(_spec("local")) as sb:
        # The same path exists inside too (in the sandbox's private /tmp), so the link resolves there.
        planted = await sb.exec(f"mkdir -p {target} && chmod 777 {target} && ln -s {target} link",
                                user="agent", timeout=30)
        assert planted.ok, planted
        await sb.upload_file(payload, "link/x.txt")
        await sb.upload_dir(tmp_path / "host-dir", "link/sub")
        assert list(target.iterdir()) == [], "the upload followed the symlink onto the host"
        inside = await sb.exec(f"cat {target}/x.txt", timeout=30)  # it went to the sandbox's own /tmp
        assert inside.stdout == "from the verifier\n", inside
        secret = tmp_path / "secret.txt"
        secret.write_text("host secret\n")
        await sb.exec(["ln", "-s", str(secret), "leak.txt"], user="agent", timeout=30)
        with pytest.raises(sandbox.FileTransferError):
            await sb.download_file("leak.txt", tmp_path / "got.txt")


# ------------------------------------------------------------------------------------------- network


async def test_no_network_but_the_forwarded_socket(isolated_backend: str, host_port: int,
                                                   unix_http: UnixHTTP) -> None:
    spec = _spec(isolated_backend, forwards={FORWARD_PORT: unix_http.path})
    async with sandbox.create(spec, backend=isolated_backend) as sb:
        # The host's loopback services (the gateway's TCP port among them) cannot be reached...
        assert (await _connect_from_inside(sb, host_port)).startswith(
            "failed"), "reached a host loopback port"
        # ... there is no route anywhere and no interface but lo ...
        r = await sb.exec("tail -n +2 /proc/net/route; tail -n +3 /proc/net/dev | cut -d: -f1", user="agent",
                          timeout=30)
        assert r.stdout.split() == ["lo"], r
        # ... but the session's socket is, through the relay on the sandbox's own loopback.
        got = await sb.exec(["python3", "-c", _GET, str(FORWARD_PORT)], user="agent", cwd="/", timeout=60)
        assert got.stdout.strip() == "hello-from-the-host-socket", got
        assert unix_http.hits == 1
    # Control: with host networking the same probe connects (it can fail).
    async with sandbox.create(_spec(isolated_backend, network="host"), backend=isolated_backend) as sb:
        assert await _connect_from_inside(sb, host_port) == "connected"


async def test_forward_after_start_many_connections_and_large_bodies(
    isolated_backend: str, unix_http: UnixHTTP
) -> None:
    # Docker mounts socket directories at creation: declare one socket, forward a second port later.
    spec = _spec(isolated_backend, forwards={FORWARD_PORT: unix_http.path})
    async with sandbox.create(spec, backend=isolated_backend) as sb:
        await sb.forward(FORWARD_PORT + 1, unix_http.path)
        await sb.forward(FORWARD_PORT + 1, unix_http.path)  # again, same socket: nothing to do
        with pytest.raises(ForwardError, match="already forwards"):
            await sb.forward(FORWARD_PORT + 1, unix_http.path + ".other")
        script = (
            "import concurrent.futures as cf, hashlib, os, sys, urllib.request\n"
            "port = int(sys.argv[1])\n"
            "def one(i):\n"
            "    body = os.urandom(1024 * 1024 if i % 10 == 0 else 2000)\n"
            "    req = urllib.request.Request(f'http://127.0.0.1:{port}/echo', data=body, method='POST')\n"
            "    return urllib.request.urlopen(req, timeout=60).read() == body\n"
            "with cf.ThreadPoolExecutor(64) as ex: print(sum(ex.map(one, range(200))))\n"
        )
        r = await sb.exec(["python3", "-c", script, str(FORWARD_PORT + 1)], user="agent", cwd="/",
                          timeout=180)
        assert r.stdout.strip() == "200", r
        if isolated_backend == "docker":
            outside = tempfile.mkdtemp(dir="/tmp")
            with pytest.raises(ForwardError, match="mounted when the container was created"):
                await sb.forward(FORWARD_PORT + 2, os.path.join(outside, "x.sock"))


async def test_forward_refuses_host_networking_and_unsupported_backends(tmp_path: Path) -> None:
    require_hardened_local()
    async with sandbox.LocalSandbox(SandboxSpec(network="host")) as sb:
        with pytest.raises(ForwardError, match="network='none'"):
            await sb.forward(FORWARD_PORT, str(tmp_path / "s.sock"))
    with pytest.raises(sandbox.SandboxStartError, match="network='none'"):
        await sandbox.LocalSandbox(SandboxSpec(forwards={FORWARD_PORT: str(tmp_path / "s.sock")})).start()
    with pytest.raises(ValueError, match=r"1\.\.65535"):
        SandboxSpec(network="none", forwards={0: "/x.sock"})


async def test_a_daytona_sandbox_whose_tunnel_cannot_start_is_removed(daytona_fake: Any,
                                                                      tmp_path: Path) -> None:
    # Daytona forwards over the exec tunnel (tests/sandbox/test_tunnel_daytona.py); when the relay cannot
    # be installed (here: a relay directory that cannot exist) start fails and nothing is left behind.
    from bench.support.daytona_fake import API_KEY

    spec = SandboxSpec(image=AGENT_IMAGE, network="none", workdir=str(tmp_path),
                       forwards={FORWARD_PORT: "/x.sock"})
    sb = sandbox.create(spec, backend="daytona", api_key=API_KEY, api_url=daytona_fake.api_url,
                        relay_dir="/proc/ares-no-such-dir")
    with pytest.raises(ForwardError, match="installing the relay"):
        await sb.start()
    assert not daytona_fake.live(), "a sandbox was left although it could not be set up"


# ------------------------------------------------------------------------------------------- processes


async def test_a_detached_loop_survives_exec_but_not_kill_processes(isolated_backend: str,
                                                                    unix_http: UnixHTTP) -> None:
    spec = _spec(isolated_backend, forwards={FORWARD_PORT: unix_http.path})
    async with sandbox.create(spec, backend=isolated_backend) as sb:
        await sb.exec("mkdir -p /tmp/v && chmod 777 /tmp/v", timeout=30)
        # What a reward-forging agent leaves behind: a detached loop, in its own session, that forks.
        loop = ("setsid sh -c 'while :; do echo 1.0 > /tmp/v/reward.txt; (sleep 30 &); sleep 0.05; done' "
                ">/dev/null 2>&1 </dev/null &")
        assert (await sb.exec(loop, user="agent", timeout=30)).ok
        await asyncio.sleep(0.5)
        alive = await sb.exec("rm -f /tmp/v/reward.txt; sleep 0.5; cat /tmp/v/reward.txt", timeout=30)
        assert alive.stdout.strip() == "1.0", "the detached loop did not survive its exec"
        killed = await sb.kill_processes()
        assert killed >= 2
        after = await sb.exec(
            "rm -f /tmp/v/reward.txt; sleep 0.5; cat /tmp/v/reward.txt 2>/dev/null || echo gone",
            timeout=30)
        assert after.stdout.strip() == "gone", "an agent process survived kill_processes()"
        assert await sb.kill_processes() == 0
        # The sandbox and its relay still work for the verifier.
        assert (await sb.exec("echo verifier", timeout=30)).stdout == "verifier\n"
        got = await sb.exec(["python3", "-c", _GET, str(FORWARD_PORT)], user="agent", cwd="/", timeout=60)
        assert got.stdout.strip() == "hello-from-the-host-socket", got


async def test_kill_processes_of_one_user(isolated_backend: str) -> None:
    async with sandbox.create(_spec(isolated_backend), backend=isolated_backend) as sb:
        await sb.exec("setsid sleep 300 >/dev/null 2>&1 </dev/null &", user="agent", timeout=30)
        await sb.exec("setsid sleep 301 >/dev/null 2>&1 </dev/null &", timeout=30)
        assert await sb.kill_processes(user="agent") == 1
        left = await sb.exec("ps -eo user=,args= | grep 'sleep 30[01]'", timeout=30)
        assert left.stdout.split() == ["root", "sleep", "301"], left
