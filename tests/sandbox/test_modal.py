"""The Modal backend (sandbox/modal.py) without Modal's servers, and live behind a token.

The stand-in (bench/support/modal_fake.py) is a real sandbox: a bwrap holder with no network (loopback
only), its own PID namespace and root, every exec a real process in it.  ``ModalSandbox`` adopts it two
ways: ``stand-in``, its processes duck-typed as ``modal``'s ``ContainerProcess`` (``text=False``); and
``sdk``, the SDK's own exec path (``exec_via_tcr``, ``TaskCommandRouterClient``, the synchronicity-wrapped
``ContainerProcess`` and its ``io_streams``) speaking gRPC to a stand-in task command router
(bench/support/modal_router_fake.py).  The backend runs unchanged on both: the exec wrapper (cwd, env,
user, a timeout killing the group), tar transfers over stdin/stdout, kill_processes, and the exec
tunnel, on which test_tunnel.py's shared transport suite runs (SSE byte-exact, 8 MiB, all 256 bytes, 64
streams, a transport drop and the agent's retry, hostile frames).  A test checks every name the
stand-in offers (and the backend uses) on the SDK's classes.  Only the live test covers sandbox
creation (image, resources, block_network, tags), Modal's control plane and network, termination and
gc listing.
"""

from __future__ import annotations

import asyncio
import hashlib
import inspect
import json
import os
import socket
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

import sandbox
from bench.support.modal_fake import FakeModalSandbox, FakeProcess, bwrap_usable
from sandbox.modal import MODAL_TAG, ModalSandbox, modal_process_channel
from sandbox.tunnel import Channel, Tunnel

from .test_tunnel import (  # noqa: F401  (the shared suite runs here on the Modal transport)
    CLIENT,
    HOSTILE,
    Harness,
    Session,
    _count_relays,
    _sse_body,
    test_hostile_relay_is_torn_down_with_bounded_memory,
    test_traffic_sse_big_body_all_bytes_and_64_concurrent_streams,
    test_transport_drop_mid_response_and_the_agents_retry_succeeds,
)

PORT = 18080


@pytest.fixture(name="session")
async def _session() -> AsyncIterator[Session]:
    """test_tunnel's session server (the fixture, not imported: a parameter would shadow the import)."""
    s = Session()
    await s.start()
    yield s
    await s.stop()


def _need_fake() -> None:
    why = bwrap_usable()
    if why:
        pytest.skip(why)


async def _adopted(spec: sandbox.SandboxSpec | None = None, *, via: str = "stand-in",
                   **kwargs: Any) -> tuple[ModalSandbox, Any]:
    """A started ModalSandbox adopting the stand-in: ``via="stand-in"`` its duck-typed processes,
    ``via="sdk"`` the SDK's own exec path and ContainerProcess over a stand-in task command router."""
    fake = FakeModalSandbox()
    await fake.start()
    handle: Any = fake
    if via == "sdk":
        from bench.support.modal_router_fake import RouterModalSandbox, RouterStandIn

        # (The router's calls off the exec path are filled in after the class: not abstract.)
        router = RouterStandIn(fake)  # type: ignore[abstract]
        await router.start()
        handle = RouterModalSandbox(fake, router)
    sb = ModalSandbox(spec or sandbox.SandboxSpec(network="none"), sandbox=handle, **kwargs)
    await sb.start()
    return sb, handle


class ModalHarness(Harness):
    """The tunnel over a ``ModalSandbox`` adopting the fake: the relay uploaded and run by the backend's
    own ``_forward``; clients run by ``sb.exec`` inside the sandbox's network namespace."""

    def __init__(self, via: str = "stand-in") -> None:
        self.kind = f"modal-{via}"
        self.via = via
        self.port = PORT
        self.sb: ModalSandbox | None = None
        self.fake: Any = None

    async def _ensure(self) -> tuple[ModalSandbox, Any]:
        if self.sb is None or self.fake is None:
            self.sb, self.fake = await _adopted(via=self.via)
        return self.sb, self.fake

    async def open_tunnel(self, session: Session, **kwargs: Any) -> Tunnel:
        sb, _ = await self._ensure()
        await sb.forward(self.port, session.path)
        tunnel = sb.tunnel_for(self.port)
        assert tunnel is not None
        return tunnel

    def hostile_opener(self, mode: str) -> Callable[[], Awaitable[Channel]]:
        async def opener() -> Channel:
            _, fake = await self._ensure()
            proc = await fake.exec.aio("python3", "-c", HOSTILE, mode, "binary", text=False)
            return await modal_process_channel(proc, description="hostile modal exec")

        return opener

    async def client(self, what: str) -> dict[str, Any]:
        sb, _ = await self._ensure()
        r = await sb.exec(["python3", "-c", CLIENT, str(self.port), what], cwd="/", timeout=180)
        assert r.ok, r
        return dict(json.loads(r.stdout))

    async def close(self) -> None:
        if self.sb is not None:
            await self.sb.stop()


@pytest.fixture(params=["stand-in", "sdk"])
async def harness(request: pytest.FixtureRequest) -> AsyncIterator[Harness]:
    _need_fake()
    h = ModalHarness(request.param)
    # The sandbox and the SDK's connection to its router first, as DockerHarness's container: what the
    # hostile test measures is the channel's memory, not the SDK's imports and set-up.
    await h._ensure()
    yield h
    await h.close()


# ------------------------------------------------------------------------ the stand-in and the SDK


# What the backend and its channel use on a process: (object, name, kind) where kind is "property",
# "sync" (a plain call that only buffers), "aio" (a call with an ``.aio`` coroutine form) or "aiter".
_PROCESS_SURFACE = [
    ("process", "stdin", "property"), ("process", "stdout", "property"), ("process", "stderr", "property"),
    ("process", "returncode", "property"), ("process", "wait", "aio"), ("process", "poll", "aio"),
    ("stdin", "write", "sync"), ("stdin", "write_eof", "sync"), ("stdin", "drain", "aio"),
    ("stdout", "__aiter__", "aiter"), ("stdout", "read", "aio"),
]


def _kind_ok(owner: Any, name: str, kind: str, *, on_class: bool) -> bool:
    if kind == "property":
        if on_class:
            return isinstance(inspect.getattr_static(owner, name), property)
        return isinstance(inspect.getattr_static(type(owner), name, None), property) or name in vars(owner)
    attr = getattr(owner, name, None)
    if kind == "sync":
        return callable(attr) and not hasattr(attr, "aio")
    if kind == "aio":
        return attr is not None and inspect.iscoroutinefunction(attr.aio)
    return callable(attr)


async def test_the_stand_in_has_the_sdks_surface() -> None:
    """Every name the backend and its channel use on a process exists on modal's own classes with the
    same kind (a plain buffering call, or one with an ``.aio`` coroutine form), and so on the stand-in."""
    modal = pytest.importorskip("modal")
    from modal import io_streams
    from modal.container_process import ContainerProcess

    sdk = {"process": ContainerProcess, "stdin": io_streams.StreamWriter, "stdout": io_streams.StreamReader}
    proc = await asyncio.create_subprocess_exec("true", stdin=asyncio.subprocess.PIPE,
                                                stdout=asyncio.subprocess.PIPE,
                                                stderr=asyncio.subprocess.PIPE)
    fake = FakeProcess(proc)
    ours = {"process": fake, "stdin": fake.stdin, "stdout": fake.stdout}
    for owner, name, kind in _PROCESS_SURFACE:
        assert _kind_ok(sdk[owner], name, kind, on_class=True), f"modal's {owner}.{name} is not {kind}"
        assert _kind_ok(ours[owner], name, kind,
                        on_class=False), f"the stand-in's {owner}.{name} is not {kind}"
    assert await fake.wait.aio() == 0 and fake.returncode == 0
    for name in ("exec", "terminate", "set_tags", "get_tags", "from_id", "list"):
        assert hasattr(getattr(modal.Sandbox, name), "aio"), name
    for name in ("exec", "terminate"):
        assert hasattr(getattr(FakeModalSandbox(), name), "aio"), name
    params = inspect.signature(modal.Sandbox.create.aio).parameters
    for name in ("app", "image", "env", "timeout", "cpu", "memory", "gpu", "block_network", "tags"):
        assert name in params, name
    assert {"env", "timeout", "text"} <= set(inspect.signature(modal.Sandbox.exec.aio).parameters)
    # The channel writes at most 1 MiB between drains; the SDK's writer takes this much, as the stand-in's.
    from bench.support.modal_fake import MAX_BUFFER

    assert io_streams.TASK_COMMAND_ROUTER_MAX_BUFFER_SIZE == MAX_BUFFER >= 1024 * 1024


def test_constructor_checks_and_credentials_are_named_not_shown(monkeypatch: pytest.MonkeyPatch,
                                                                tmp_path: Path) -> None:
    monkeypatch.delenv("MODAL_TOKEN_ID", raising=False)
    monkeypatch.setenv("MODAL_TOKEN_SECRET", "as-secret-xyz")
    monkeypatch.setenv("MODAL_CONFIG_PATH", str(tmp_path / "none.toml"))
    import modal.config

    monkeypatch.setattr(modal.config.config, "get", lambda key, *a, **k: None)
    with pytest.raises(sandbox.BackendUnavailableError, match="set MODAL_TOKEN_ID") as info:
        ModalSandbox(sandbox.SandboxSpec(network="none"))
    assert "as-secret-xyz" not in str(info.value)
    with pytest.raises(ValueError, match="network"):
        ModalSandbox(sandbox.SandboxSpec(network="bridge"), sandbox=object())
    with pytest.raises(ValueError, match="positive"):
        ModalSandbox(sandbox.SandboxSpec(), sandbox=object(), max_output=0)


def test_create_arguments_follow_the_spec() -> None:
    modal = pytest.importorskip("modal")
    spec = sandbox.SandboxSpec(image="python:3.12-slim", network="none", env={"A": "1"},
                               resources=sandbox.Resources(cpus=1.5, memory="1.5g"), labels={"task": "t1"})
    sb = ModalSandbox(spec, sandbox=object(), sandbox_timeout=900)
    kwargs = sb._create_kwargs(modal, "APP")
    assert kwargs["block_network"] is True and kwargs["cpu"] == 1.5 and kwargs["memory"] == 1536
    assert kwargs["env"] == {"A": "1"} and kwargs["timeout"] == 900 and kwargs["app"] == "APP"
    assert isinstance(kwargs["image"], modal.Image)
    tags = kwargs["tags"]
    assert tags == sb.tags() and tags["task"] == "t1" and tags[MODAL_TAG] == "modal" and tags[
        sandbox.janitor.SANDBOX_LABEL] == sb.id
    assert sandbox.janitor.OWNER_LABEL in tags
    open_sb = ModalSandbox(sandbox.SandboxSpec(), sandbox=object())
    assert open_sb._create_kwargs(modal, "APP")["block_network"] is False


# ------------------------------------------------------------------- the backend over the stand-in


@pytest.mark.parametrize("via", ["stand-in", "sdk"])
async def test_exec_cwd_env_user_stderr_exit_code_and_timeout_kills_the_group(via: str) -> None:
    _need_fake()
    sb, handle = await _adopted(sandbox.SandboxSpec(network="none", env={"FROM_SPEC": "s"}), via=via)
    fake: FakeModalSandbox = getattr(handle, "_sandbox", handle)
    try:
        r = await sb.exec("echo out; echo err >&2; pwd; echo $FROM_SPEC $X; exit 7", env={"X": "x y"})
        assert (r.stdout, r.stderr, r.exit_code, r.timed_out) == ("out\n/workspace\ns x y\n", "err\n", 7,
                                                                  False)
        r = await sb.exec(["printf", "%s", "a 'quoted' $arg"], cwd="/tmp")
        assert r.stdout == "a 'quoted' $arg" and r.ok
        r = await sb.exec("id -un", user="nobody", cwd="/")
        assert r.stdout.strip() == "nobody", r
        with pytest.raises(sandbox.ExecError, match="does not exist"):
            await sb.exec("true", cwd="/nope")
        # A timeout kills the command's whole group inside (a background child too), not just the exec.
        started = time.monotonic()
        r = await sb.exec("sleep 300 & echo $! >/tmp/child; sleep 300", timeout=1)
        assert r.timed_out and r.exit_code == -9 and time.monotonic() - started < 20
        # (A zombie is gone too: the fake's PID 1 is a bare `sleep`, which reaps no orphans.)
        r = await sb.exec(
            'st=$(sed -n "s/^State:[[:space:]]*//p" /proc/$(cat /tmp/child)/status 2>/dev/null); '
            'case $st in ""|Z*) echo gone;; *) echo alive;; esac')
        assert r.stdout.strip() == "gone", r
        # Binary-safe, large output over the stream.
        r = await sb.exec("head -c 3000000 /dev/zero | tr '\\0' x")
        assert r.stdout == "x" * 3_000_000
        assert fake.execs >= 8
    finally:
        await sb.stop()
    assert fake.pid == 0  # stop terminated the adopted sandbox


@pytest.mark.parametrize("via", ["stand-in", "sdk"])
async def test_files_travel_as_tar_over_the_exec(tmp_path: Path, via: str) -> None:
    _need_fake()
    src = tmp_path / "src"
    (src / "sub").mkdir(parents=True)
    (src / "a.bin").write_bytes(bytes(range(256)) * 9000)
    (src / "sub" / "b.txt").write_text("bee")
    (src / "run.sh").write_text("#!/bin/sh\necho ran\n")
    (src / "run.sh").chmod(0o755)
    sb, _ = await _adopted(via=via)
    try:
        await sb.upload_dir(src, "proj")
        r = await sb.exec("cat sub/b.txt; echo; ./run.sh; sha256sum a.bin | cut -c1-64",
                          cwd="/workspace/proj")
        assert r.stdout.split() == ["bee", "ran", hashlib.sha256((src / "a.bin").read_bytes()).hexdigest()], r
        await sb.upload_file(src / "sub" / "b.txt", "/tmp/deep/er/b2.txt")
        assert (await sb.exec("cat /tmp/deep/er/b2.txt")).stdout == "bee"
        await sb.exec("mkdir -p out/x && printf made >out/x/m.txt && head -c 5000000 /dev/urandom >out/big")
        await sb.download_dir("out", tmp_path / "got")
        assert (tmp_path / "got" / "x" / "m.txt").read_text() == "made"
        big = (tmp_path / "got" / "big").read_bytes()
        assert len(big) == 5_000_000
        assert (await sb.exec("sha256sum out/big | cut -c1-64")).stdout.strip() == hashlib.sha256(
            big).hexdigest()
        await sb.download_file("proj/a.bin", tmp_path / "one" / "a.bin")
        assert (tmp_path / "one" / "a.bin").read_bytes() == (src / "a.bin").read_bytes()
        with pytest.raises(sandbox.FileTransferError, match="no such file"):
            await sb.download_file("missing.txt", tmp_path / "m")
        with pytest.raises(sandbox.FileTransferError, match="no such directory"):
            await sb.download_dir("missing", tmp_path / "m")
    finally:
        await sb.stop()


@pytest.mark.parametrize("via", ["stand-in", "sdk"])
async def test_forward_reaches_only_its_own_session_and_survives_kill_processes(session: Session,
                                                                                via: str) -> None:
    _need_fake()
    h = ModalHarness(via)
    try:
        tunnel = await h.open_tunnel(session)
        sb = h.sb
        assert sb is not None and "exec tunnel" in sb.description
        # Only loopback in the sandbox; a listening port on the host's loopback is out of reach.
        r = await sb.exec("tail -n +3 /proc/net/dev | cut -d: -f1")
        assert r.stdout.split() == ["lo"], r
        host = socket.socket()
        host.bind(("127.0.0.1", 0))
        host.listen(4)
        probe = ("import socket,sys\ns=socket.socket(); s.settimeout(3)\n"
                 "try:\n s.connect((sys.argv[1], int(sys.argv[2]))); print('connected')\n"
                 "except OSError as e: print('failed', type(e).__name__)\n")
        try:
            r = await sb.exec(["python3", "-c", probe, "127.0.0.1", str(host.getsockname()[1])])
            assert r.stdout.startswith("failed"), r
            r = await sb.exec(["python3", "-c", probe, "192.0.2.1", "80"])  # an outside address: no route
            assert r.stdout.startswith("failed"), r
        finally:
            host.close()
        # The relay is root's; the agent cannot kill it, kill_processes() spares it.
        r = await sb.exec(f"kill -9 $(cat /.ares/relay-{PORT}.pid)", user="nobody", cwd="/")
        assert not r.ok
        await sb.exec("setsid sleep 300 >/dev/null 2>&1 &")
        assert (await sb.exec("pgrep -c -x sleep")).stdout.strip() == "2"  # PID 1 and this one
        assert await sb.kill_processes() >= 1
        assert (await sb.exec(_count_relays(PORT), cwd="/")).stdout.strip() == "1"
        got = await h.client("traffic")
        assert got["bytes"] == [200, True] and got["concurrent"] == 64
        assert got["sse"][1] == hashlib.sha256(_sse_body()).hexdigest()
        assert tunnel.channels_opened == 1 and tunnel.violation is None
        # Closing the tunnel ends the relay on its stdin's EOF.
        await tunnel.close()
        r = await sb.exec(_count_relays(PORT), cwd="/")
        assert r.stdout.strip() == "0", r
    finally:
        await h.close()


async def test_forward_needs_python3_in_the_image_and_says_so(session: Session,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    _need_fake()
    sb, fake = await _adopted()
    real = fake.exec.aio

    async def no_python(*args: str, **kwargs: Any) -> FakeProcess:
        if args[:2] == ("/bin/sh", "-c") and "command -v python3" in args[2]:
            args = (args[0], args[1], args[2].replace("command -v python3", "command -v no-such-python3"),
                    *args[3:])
        return await real(*args, **kwargs)

    monkeypatch.setattr(fake.exec, "aio", no_python)
    try:
        with pytest.raises(sandbox.ForwardError, match="has no python3"):
            await sb.forward(PORT, session.path)
    finally:
        await sb.stop()


async def test_the_channel_bounds_what_it_buffers_for_a_slow_reader() -> None:
    """A relay that floods stdout while the tunnel does not read: the pump stops pulling from Modal
    (the reader's limit), and the writer's drain() blocks past its high-water mark."""
    _need_fake()
    fake = FakeModalSandbox()
    await fake.start()
    try:
        proc = await fake.exec.aio("/bin/sh", "-c", "head -c 50000000 /dev/zero; exec sleep 60", text=False)
        ch = await modal_process_channel(proc, high_water=1024, exit_timeout=1)
        await asyncio.sleep(1.0)
        held = len(ch.reader._buffer)  # type: ignore[attr-defined]
        assert 0 < held <= 2 * 256 * 1024 + 65536, held
        ch.writer.write(b"x" * 4096)
        assert (ch.writer.transport.get_write_buffer_size() >= 4096
                or ch.writer.transport.get_write_buffer_size() == 0)
        await asyncio.wait_for(ch.writer.drain(), 5)  # the sh reads nothing, but the pipe takes 4 KiB
        await ch.close()
        await ch.close()  # idempotent
    finally:
        await fake.terminate.aio()


# ------------------------------------------------------------------------------------ live (Modal)


def _live_or_skip() -> None:
    missing = [n for n in ("MODAL_TOKEN_ID", "MODAL_TOKEN_SECRET") if not os.environ.get(n)]
    if missing:
        pytest.skip(f"live Modal test: set {' and '.join(missing)} to run it")
    pytest.importorskip("modal")


async def test_live_modal_block_network_and_the_exec_tunnel(session: Session) -> None:
    _live_or_skip()
    spec = sandbox.SandboxSpec(image="python:3.12-slim", network="none", forwards={PORT: session.path})
    sb = ModalSandbox(spec, sandbox_timeout=900)
    async with sb:
        assert sb.remote_id and "block_network" in sb.description
        r = await sb.exec(["python3", "-c", CLIENT, str(PORT), "traffic"], cwd="/", timeout=300)
        assert r.ok, r
        got = json.loads(r.stdout)
        assert got["sse"][1] == hashlib.sha256(_sse_body()).hexdigest() and got["bytes"] == [200, True]
        probe = ("import socket\ns=socket.socket(); s.settimeout(5)\n"
                 "try:\n s.connect(('1.1.1.1', 443)); print('connected')\n"
                 "except OSError as e: print('failed', type(e).__name__)\n")
        r = await sb.exec(["python3", "-c", probe], timeout=60)
        assert r.stdout.startswith("failed"), r
        with_file = Path(session.dir) / "up.txt"
        with_file.write_text("up")
        await sb.upload_file(with_file, "/tmp/up.txt")
        assert (await sb.exec("cat /tmp/up.txt")).stdout == "up"
        tunnel = sb.tunnel_for(PORT)
        assert tunnel is not None and tunnel.violation is None
    assert sb.state == "stopped"


@pytest.mark.parametrize("how", ["start time", "owner"])
async def test_a_relay_record_naming_another_process_spares_nothing(session: Session, how: str) -> None:
    """The pid a dead relay's files still name, taken by another user's process (as pid reuse would
    have it): kill_processes() kills it.  The record differs from it by start time, or by owner."""
    _need_fake()
    h = ModalHarness("stand-in")
    try:
        await h.open_tunnel(session)
        sb = h.sb
        assert sb is not None
        r = await sb.exec("setsid sleep 4323 >/dev/null 2>&1 </dev/null & echo $!", user="nobody", cwd="/")
        other = int(r.stdout.strip())
        relay = int((await sb.exec(f"cat /.ares/relay-{PORT}.pid", cwd="/")).stdout.strip())
        stat = await sb.exec(f"cat /proc/{other}/stat /proc/{relay}/stat", cwd="/")
        other_start, relay_start = (line.rsplit(")", 1)[1].split()[19] for line in stat.stdout.splitlines())
        start = relay_start if how == "start time" else other_start
        forged = await sb.exec(
            f"echo {other} >/.ares/relay-{PORT}.pid; echo '{other} {start}' >/.ares/relay-{PORT}.id",
            cwd="/")
        assert forged.ok, forged
        await sb.kill_processes(timeout=20)
        left = await sb.exec(f"s=$(cut -d')' -f2 /proc/{other}/stat 2>/dev/null | cut -d' ' -f2); "
                             "case $s in ''|Z|X) echo gone;; *) echo alive;; esac", cwd="/")
        assert left.stdout.strip() == "gone", left
    finally:
        await h.close()
