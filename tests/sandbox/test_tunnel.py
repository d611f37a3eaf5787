"""The exec tunnel: sandbox/_relay.py's multiplexing mode and its host end, sandbox/tunnel.py.

Unit tests drive the codec and a host-side Mux with hand-made frames.  End-to-end tests run a real
relay process over each local transport (a pipe, a PTY whose shell prints noise first, in binary and
base64 line mode, and Docker's exec attach into a ``network_mode=none`` container with the client as
the unprivileged ``agent``) to a real aiohttp server on a unix socket, and check: a 200-event SSE
stream byte-exact, an 8 MiB body, all 256 byte values, 64 concurrent streams, a transport drop
mid-response that the client's retry survives, and hostile frame sequences that tear the channel down
with bounded memory while the server stays healthy.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import glob
import hashlib
import json
import os
import shutil
import socket
import struct
import sys
import tempfile
import time
import tracemalloc
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from ares_gateway import EpisodeConfig, RunConfig
from sandbox import _relay
from sandbox._relay import (
    DATA,
    FIN,
    HEADER,
    LINE_MAX_PAYLOAD,
    MAX_FRAME,
    MAX_PAYLOAD,
    OPEN,
    PING,
    PONG,
    RST,
    WINDOW,
    Mux,
    TunnelError,
    encode_frame,
    read_frame,
)
from sandbox.tunnel import Channel, Tunnel, docker_exec_channel, pipe_channel, pty_channel
from tests.helpers import free_port

from .conftest import AGENT_IMAGE, docker_required

RELAY = str(Path(_relay.__file__).resolve())
# A real 3.8 interpreter (not pyenv's shim, which refuses versions that are not selected).
PY38 = next((p for p in [*sorted(glob.glob(os.path.expanduser("~/.pyenv/versions/3.8.*/bin/python3"))),
                         shutil.which("python3.8")] if p and "/shims/" not in p and os.access(p, os.X_OK)),
            None)
SSE_EVENTS = 200
N_CONCURRENT = 64


# ----------------------------------------------------------------------------------------- codec


def _reader(data: bytes, *, eof: bool = True) -> asyncio.StreamReader:
    r = asyncio.StreamReader(limit=_relay.READER_LIMIT)
    r.feed_data(data)
    if eof:
        r.feed_eof()
    return r


@pytest.mark.parametrize("line", [False, True])
async def test_codec_round_trip_and_limits(line: bool) -> None:
    biggest = LINE_MAX_PAYLOAD if line else MAX_PAYLOAD
    frames = [(OPEN, 1, b""), (DATA, 7, bytes(range(256))), (DATA, 2**32 - 1, b"\n" * biggest), (FIN, 3, b""),
              (RST, 3, b""), (WINDOW, 0, struct.pack(">I", 5)), (PING, 0, b"12345678"),
              (PONG, 0, b"12345678")]
    wire = b"".join(encode_frame(*f, line=line) for f in frames)
    if line:
        assert all(len(x) + 1 <= MAX_FRAME for x in wire.split(b"\n")), "a line over 64 KiB"
    else:
        assert len(encode_frame(DATA, 1, b"x" * biggest)) == MAX_FRAME
    reader = _reader(wire)
    assert [await read_frame(reader, line=line) for _ in frames] == frames
    with pytest.raises(asyncio.IncompleteReadError):
        await read_frame(reader, line=line)
    with pytest.raises(ValueError, match="over the limit"):
        encode_frame(DATA, 1, b"x" * (biggest + 1), line=line)


async def test_codec_rejects_bad_frames_before_reading_their_payload() -> None:
    # A header claiming 1 GiB: refused from the header alone (no payload follows, and no EOF either).
    with pytest.raises(TunnelError, match="over the limit"):
        await asyncio.wait_for(read_frame(_reader(HEADER.pack(DATA, 1, 1 << 30), eof=False)), 2)
    with pytest.raises(TunnelError, match="unknown frame type 99"):
        await read_frame(_reader(HEADER.pack(99, 1, 0)))
    with pytest.raises(TunnelError, match="not base64"):
        await read_frame(_reader(b"!!!!\n"), line=True)
    with pytest.raises(TunnelError, match="length field"):
        await read_frame(_reader(base64.b64encode(HEADER.pack(DATA, 1, 5) + b"abc") + b"\n"), line=True)
    with pytest.raises(TunnelError, match="shorter than its header"):
        await read_frame(_reader(base64.b64encode(b"abc") + b"\n"), line=True)
    with pytest.raises(TunnelError, match="line"):  # no newline within the reader's limit
        await asyncio.wait_for(read_frame(_reader(b"A" * (_relay.READER_LIMIT + 10), eof=False), line=True),
                               2)
    with pytest.raises(TunnelError, match="over the limit"):  # a newline, but too far
        await read_frame(_reader(base64.b64encode(b"x" * 60000) + b"\n"), line=True)


class _Sink:
    """A writer that keeps what the Mux sends."""

    def __init__(self) -> None:
        self.data = bytearray()

    def write(self, b: bytes) -> None:
        self.data += b

    async def drain(self) -> None:
        return None

    def close(self) -> None:
        return None

    @property
    def transport(self) -> _Sink:  # nothing is ever taken: the backlog is all that was written
        return self

    def get_write_buffer_size(self) -> int:
        return len(self.data)

    def frames(self) -> list[tuple[int, int, bytes]]:
        out, view = [], bytes(self.data)
        while view:
            t, sid, n = HEADER.unpack_from(view)
            out.append((t, sid, view[HEADER.size:HEADER.size + n]))
            view = view[HEADER.size + n:]
        return out


async def _host_mux(wire: bytes, *, eof: bool = False, **kwargs: Any) -> tuple[Mux, _Sink, list[int]]:
    connects: list[int] = []

    async def connect() -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        connects.append(1)
        raise ConnectionRefusedError("no session here")

    sink = _Sink()
    mux = Mux(_reader(wire, eof=eof), sink, connect=connect, **kwargs)
    await asyncio.wait_for(mux.run(), 5)
    return mux, sink, connects


@pytest.mark.parametrize(("wire", "expected"), [
    (encode_frame(OPEN, 1) + HEADER.pack(42, 1, 0), "unknown frame type 42"),
    (b"".join(encode_frame(OPEN, sid) for sid in range(1, 10_000)), "more than 8 streams"),
    (encode_frame(OPEN, 5) + encode_frame(OPEN, 5), "opened again"),
    (encode_frame(OPEN, 5) + encode_frame(OPEN, 4), "opened again"),
    (encode_frame(DATA, 9, b"x"), "never opened"),
    (encode_frame(OPEN, 1) + encode_frame(DATA, 1, b"x" * 40000) * 2, "over its window"),
    (encode_frame(OPEN, 1) + encode_frame(WINDOW, 1, struct.pack(">I", 2**31)), "credit over"),
    (encode_frame(WINDOW, 0, b"\0\0\0\0"), "granting nothing"),
    (encode_frame(PING, 0, b"x" * 100), "a ping of 100 bytes"),
    (encode_frame(DATA, 0, b"x"), "on stream 0"),
    (HEADER.pack(DATA, 1, MAX_PAYLOAD + 1), "over the limit"),
])
async def test_host_mux_tears_down_on_hostile_frames(wire: bytes, expected: str) -> None:
    mux, _, connects = await _host_mux(wire, max_streams=8, stream_window=64 * 1024, conn_window=1 << 20)
    assert mux.violation is not None and expected in mux.violation, mux.violation
    assert mux.dead and not mux.streams
    assert len(connects) <= 8


async def test_a_ping_flood_from_a_peer_that_does_not_read_stays_bounded() -> None:
    mux, sink, _ = await _host_mux(encode_frame(PING, 0, b"12345678") * 200_000, eof=True)
    assert mux.violation is None
    assert _relay.PONG_BACKLOG <= len(sink.data) <= _relay.PONG_BACKLOG + MAX_FRAME  # not 200000 pongs


async def test_host_mux_answers_pings_and_resets_streams_it_cannot_connect() -> None:
    connects: list[int] = []

    async def connect() -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        connects.append(1)
        raise ConnectionRefusedError("no session here")

    sink, reader = _Sink(), _reader(b"", eof=False)
    mux = Mux(reader, sink, connect=connect)
    run = asyncio.ensure_future(mux.run())
    reader.feed_data(encode_frame(PING, 0, b"abcdefgh") + encode_frame(OPEN, 1)
                     + encode_frame(DATA, 1, b"hello"))
    for _ in range(100):
        if (RST, 1, b"") in sink.frames():
            break
        await asyncio.sleep(0.01)
    assert (PONG, 0, b"abcdefgh") in sink.frames() and (RST, 1, b"") in sink.frames()
    assert connects == [1] and not mux.streams
    # Late frames for the reset stream are dropped, not violations; the channel's credit comes back.
    reader.feed_data(encode_frame(DATA, 1, b"x" * 60000) * 30 + encode_frame(FIN, 1))
    reader.feed_eof()
    assert await asyncio.wait_for(run, 5) == "the channel ended"
    assert mux.violation is None
    assert mux.recv_conn_left + mux.conn_consumed == _relay.CONN_WINDOW


# ------------------------------------------------------------------------------------ the session


def _sse_body() -> bytes:
    events = []
    for i in range(SSE_EVENTS):
        data = json.dumps({"i": i, "text": "ünïcode ✓ " * (i % 7), "raw": "\r\n"}, ensure_ascii=False)
        events.append(f"id: {i}\nevent: delta\ndata: {data}\n\n".encode())
    return b"".join(events)


class Session:
    """A gateway-like aiohttp server on a unix socket (the session's agent socket)."""

    def __init__(self) -> None:
        self.dir = tempfile.mkdtemp(prefix="ares-tun-", dir="/tmp")
        self.path = os.path.join(self.dir, "agent.sock")
        self.in_flight = 0
        self.together = asyncio.Event()
        self.chat_calls = 0
        self.first_chat_started = asyncio.Event()
        self.stopping = asyncio.Event()

    async def start(self) -> None:
        async def sse(request: web.Request) -> web.StreamResponse:
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            for event in _sse_body().split(b"\n\n")[:-1]:
                await resp.write(event + b"\n\n")
            await resp.write_eof()
            return resp

        async def echo(request: web.Request) -> web.Response:
            return web.Response(body=await request.read())

        async def all_bytes(request: web.Request) -> web.Response:
            return web.Response(body=bytes(range(256)) * 16)

        async def together(request: web.Request) -> web.Response:
            # Answers only once N_CONCURRENT requests are in flight at once: proof they are concurrent.
            body = await request.read()
            self.in_flight += 1
            if self.in_flight >= N_CONCURRENT:
                self.together.set()
            try:
                await asyncio.wait_for(self.together.wait(), 60)
            finally:
                self.in_flight -= 1
            return web.Response(body=body)

        async def chat(request: web.Request) -> web.StreamResponse:
            await request.read()
            self.chat_calls += 1
            body = json.dumps({
                "id": "chatcmpl-1", "object": "chat.completion", "created": 1, "model": "m",
                "choices": [{"index": 0, "finish_reason": "stop",
                             "message": {"role": "assistant", "content": "hello after retry"}}],
                "usage": {"prompt_tokens": 1, "completion_tokens": 3, "total_tokens": 4},
            }).encode()
            resp = web.StreamResponse(headers={"Content-Type": "application/json"})
            resp.content_length = len(body)
            await resp.prepare(request)
            if self.chat_calls == 1:  # half the answer, then hang until the transport drops
                await resp.write(body[: len(body) // 2])
                self.first_chat_started.set()
                # aiohttp does not cancel a handler whose client went away: wait for stop() instead.
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self.stopping.wait(), 120)
                return resp
            await resp.write(body)
            return resp

        async def big(request: web.Request) -> web.StreamResponse:
            resp = web.StreamResponse()
            await resp.prepare(request)
            for _ in range(64):
                await resp.write(b"z" * 65536)
            return resp

        async def health(request: web.Request) -> web.Response:
            return web.Response(text="ok")

        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_get("/sse", sse)
        app.router.add_post("/echo", echo)
        app.router.add_get("/bytes", all_bytes)
        app.router.add_post("/together", together)
        app.router.add_post("/v1/chat/completions", chat)
        app.router.add_get("/health", health)
        app.router.add_get("/big", big)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        await web.UnixSite(self.runner, self.path).start()

    async def healthy(self) -> bool:
        async with aiohttp.ClientSession(connector=aiohttp.UnixConnector(path=self.path)) as c:
            async with c.get("http://session/health", timeout=aiohttp.ClientTimeout(total=5)) as r:
                return r.status == 200 and await r.text() == "ok"

    async def stop(self) -> None:
        self.stopping.set()
        await self.runner.cleanup()


@pytest.fixture
async def session() -> AsyncIterator[Session]:
    s = Session()
    await s.start()
    yield s
    await s.stop()


# Stdlib only: runs on the host (pipe, PTY) or as the agent inside the container.
CLIENT = r"""
import concurrent.futures as cf, hashlib, http.client, json, sys, time
port, what = int(sys.argv[1]), sys.argv[2]
def req(method, path, body=None):
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    c.request(method, path, body=body)
    r = c.getresponse(); data = r.read(); c.close()
    return r.status, data
out = {}
if what == "traffic":
    st, data = req("GET", "/sse"); out["sse"] = [st, hashlib.sha256(data).hexdigest(), len(data)]
    body = bytes(range(256)) * (8 * 1024 * 1024 // 256)
    t0 = time.perf_counter(); st, data = req("POST", "/echo", body)
    out["big"] = [st, data == body, round(2 * len(body) / (time.perf_counter() - t0) / 1e6, 1)]
    st, data = req("GET", "/bytes"); out["bytes"] = [st, data == bytes(range(256)) * 16]
    def one(i):
        body = (b"%d-" % i) * 4000
        st, data = req("POST", "/together", body)
        return st == 200 and data == body
    with cf.ThreadPoolExecutor(64) as ex:
        out["concurrent"] = sum(ex.map(one, range(64)))
elif what == "retry":  # what an agent SDK does: retry a dropped connection with backoff
    body = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}]}).encode()
    for attempt in range(8):
        try:
            st, data = req("POST", "/v1/chat/completions", body)
            out["answer"] = json.loads(data)["choices"][0]["message"]["content"]; out["attempts"] = attempt + 1
            break
        except (OSError, http.client.HTTPException, ValueError) as exc:
            out.setdefault("errors", []).append(type(exc).__name__)
            time.sleep(0.2 * 2 ** attempt)
print(json.dumps(out))
"""  # noqa: E501 (an embedded script, kept as it runs)

# A "relay" that breaks the protocol, run over the same transport: the host must tear it down.
HOSTILE = r"""
import os, struct, sys, threading, time
if os.isatty(0):
    import tty; tty.setraw(0)
mode, line = sys.argv[1], sys.argv[2] == "line"
threading.Thread(target=lambda: (sys.stdin.buffer.read(), os._exit(0)), daemon=True).start()
out = sys.stdout.buffer
H = struct.Struct(">BII")
def frame(t, sid, payload=b""):
    f = H.pack(t, sid, len(payload)) + payload
    import base64
    return base64.b64encode(f) + b"\n" if line else f
out.write(b"\n@@ARES-TUNNEL-1@@\n")
try:
    if mode == "oversized":  # a header claiming 1 GiB (in line mode: a line that never ends), then 64 MiB
        out.write(b"A" * 100 if line else H.pack(2, 1, 1 << 30))
        for _ in range(1024):
            out.write(b"A" * 65536)
    elif mode == "unknown":
        out.write(frame(1, 1) + frame(99, 1))
    elif mode == "flood":
        for sid in range(1, 200001):
            out.write(frame(1, sid))
    out.flush()
except OSError:
    os._exit(0)
time.sleep(60)  # keep the channel open: the host must end it, not wait for an EOF
"""


# ------------------------------------------------------------------------------------ transports

def _count_relays(port: int) -> str:
    """A shell line: how many relays of ``port`` run in the container (grep's own line does not match)."""
    return ("for d in /proc/[0-9]*; do tr '\\0' ' ' <$d/cmdline; echo; done 2>/dev/null "
            f"| grep -c 'relay[.]py --listen 127[.]0[.]0[.]1:{port} '")


# What a PTY shell prints before the relay starts (motd, prompt, colours, CRLFs).
_NOISE = "printf 'Last login: Thu Dec  3 from 10.0.0.1\\r\\n\\033[1;32mWelcome\\033[0m\\n$ '; "


class Harness:
    """One transport: opens tunnels (a relay or a hostile script at the far end) and runs clients
    where the relay listens."""

    kind: str
    line = False
    port: int

    async def open_tunnel(self, session: Session, **kwargs: Any) -> Tunnel:
        raise NotImplementedError

    def hostile_opener(self, mode: str) -> Callable[[], Awaitable[Channel]]:
        raise NotImplementedError

    async def client(self, what: str) -> dict[str, Any]:
        raise NotImplementedError

    async def close(self) -> None:
        return None


class LocalHarness(Harness):
    def __init__(self, kind: str) -> None:
        self.kind = kind
        self.line = kind == "pty-line"
        self.port = free_port()

    def _opener(self, argv: list[str]) -> Callable[[], Awaitable[Channel]]:
        if self.kind == "pipe-py3.8":  # the oldest python3 an image may bring runs the relay
            return lambda: pipe_channel([PY38, *argv[1:]])
        if self.kind == "pipe":
            return lambda: pipe_channel(argv)
        shell = _NOISE + "exec " + " ".join(argv)
        return lambda: pty_channel(["/bin/bash", "--login", "-c", shell])

    async def open_tunnel(self, session: Session, **kwargs: Any) -> Tunnel:
        argv = [sys.executable, "-I", RELAY, "--listen", f"127.0.0.1:{self.port}",
                "--tunnel", "line" if self.line else "binary", "--max-connections", "256"]
        tunnel = Tunnel(self._opener(argv), session.path, line=self.line, **kwargs)
        await tunnel.start()
        return tunnel

    def hostile_opener(self, mode: str) -> Callable[[], Awaitable[Channel]]:
        path = os.path.join(tempfile.mkdtemp(prefix="ares-hostile-"), "hostile.py")
        Path(path).write_text(HOSTILE)
        return self._opener([sys.executable, path, mode, "line" if self.line else "binary"])

    async def client(self, what: str) -> dict[str, Any]:
        proc = await asyncio.create_subprocess_exec(sys.executable, "-c", CLIENT, str(self.port), what,
                                                    stdout=asyncio.subprocess.PIPE,
                                                    stderr=asyncio.subprocess.PIPE)
        out, err = await asyncio.wait_for(proc.communicate(), 180)
        assert proc.returncode == 0, err.decode()
        return dict(json.loads(out))


class DockerHarness(Harness):
    """A ``network_mode=none`` container from the agent image; clients run as the unprivileged agent."""

    kind = "docker"

    def __init__(self) -> None:
        self.port = 18080
        self.sb: Any = None

    async def open_tunnel(self, session: Session, **kwargs: Any) -> Tunnel:
        import sandbox
        from sandbox.docker import DockerSandbox

        self.sb = DockerSandbox(sandbox.SandboxSpec(image=AGENT_IMAGE, network="none",
                                                    forwards={self.port: session.path}), tunnel="exec")
        await self.sb.start()
        tunnel = self.sb.tunnel_for(self.port)
        assert tunnel is not None
        return tunnel

    def hostile_opener(self, mode: str) -> Callable[[], Awaitable[Channel]]:
        cid = self.sb.container_id
        return lambda: docker_exec_channel(cid, ["python3", "-c", HOSTILE, mode, "binary"])

    async def client(self, what: str) -> dict[str, Any]:
        r = await self.sb.exec(["python3", "-c", CLIENT, str(self.port), what], user="agent", cwd="/",
                               timeout=180)
        assert r.ok, r
        return dict(json.loads(r.stdout))

    async def close(self) -> None:
        if self.sb is not None:
            await self.sb.stop()


@pytest.fixture(
    params=["pipe", "pipe-py3.8", "pty", "pty-line", pytest.param("docker", marks=pytest.mark.docker)])
async def harness(request: pytest.FixtureRequest) -> AsyncIterator[Harness]:
    h: Harness
    if request.param == "pipe-py3.8" and not PY38:
        pytest.skip("no python3.8 on this host (pyenv's 3.8 or python3.8 on PATH)")
    if request.param == "docker":
        docker_required("agent image")
        h = DockerHarness()
    else:
        h = LocalHarness(request.param)
    yield h
    await h.close()


# ------------------------------------------------------------------------------------ end to end


async def test_traffic_sse_big_body_all_bytes_and_64_concurrent_streams(harness: Harness,
                                                                        session: Session) -> None:
    tunnel = await harness.open_tunnel(session)
    try:
        got = await harness.client("traffic")
        body = _sse_body()
        assert got["sse"] == [200, hashlib.sha256(body).hexdigest(), len(body)]
        assert got["big"][:2] == [200, True]
        assert got["bytes"] == [200, True]
        assert got["concurrent"] == N_CONCURRENT
        assert tunnel.running and tunnel.channels_opened == 1 and tunnel.violation is None
        assert tunnel.mux is not None and tunnel.mux.opened >= 3 + N_CONCURRENT
    finally:
        await tunnel.close()
    assert not tunnel.running


async def test_transport_drop_mid_response_and_the_agents_retry_succeeds(harness: Harness,
                                                                         session: Session) -> None:
    tunnel = await harness.open_tunnel(session)
    try:
        if isinstance(harness, LocalHarness):
            import openai  # the official SDK as the agent, with its own retries

            client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{harness.port}/v1", api_key="sk-tunnel",
                                        max_retries=5, timeout=60)
            call: Any = asyncio.ensure_future(client.chat.completions.create(
                model="m", messages=[{"role": "user", "content": "hi"}]))
        else:  # the image has no openai SDK: a stdlib client that retries as the SDKs do
            call = asyncio.ensure_future(harness.client("retry"))
        await asyncio.wait_for(session.first_chat_started.wait(), 60)
        await tunnel.drop()  # the transport goes away with the response half sent
        result = await asyncio.wait_for(call, 120)
        if isinstance(harness, LocalHarness):
            assert result.choices[0].message.content == "hello after retry"
            await client.close()
        else:
            assert result["answer"] == "hello after retry" and result["attempts"] >= 2, result
            # One relay serves the port: the dropped channel's relay is gone.
            r = await harness.sb.exec(_count_relays(harness.port), user="root", cwd="/", timeout=30)  # type: ignore[attr-defined]
            assert r.stdout.strip() == "1", r
        assert session.chat_calls >= 2
        assert tunnel.channels_opened >= 2 and tunnel.running and tunnel.violation is None
    finally:
        await tunnel.close()


@pytest.mark.parametrize(("mode", "expected"), [
    ("oversized", "over"), ("unknown", "unknown frame type 99"), ("flood", "more than 64 streams")])
async def test_hostile_relay_is_torn_down_with_bounded_memory(
    harness: Harness, session: Session, mode: str, expected: str
) -> None:
    if harness.line and mode == "unknown":
        expected = "unknown frame type 99"
    if isinstance(harness, DockerHarness):
        await harness.open_tunnel(session)  # the container; its own tunnel is not under test here
    tunnel = Tunnel(harness.hostile_opener(mode), session.path, line=harness.line, max_streams=64)
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        await tunnel.start()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(tunnel.wait(), 30)
        peak = tracemalloc.get_traced_memory()[1] - base
    finally:
        tracemalloc.stop()
        await tunnel.close()
    assert not tunnel.running, "the channel was not torn down"
    assert tunnel.violation is not None and expected in tunnel.violation, (tunnel.violation,
                                                                           tunnel.last_reason)
    assert tunnel.channels_opened == 1, "a violating channel must not be reopened"
    assert tunnel.mux is not None and tunnel.mux.opened <= 64
    assert peak < 16 * 1024 * 1024, f"{peak / 1e6:.1f} MB held for a hostile channel"
    assert await session.healthy()


@pytest.mark.parametrize("kind", ["pipe", "pty"])
async def test_full_duplex_load_with_stalled_readers_does_not_deadlock(kind: str, session: Session) -> None:
    """Bodies both ways on many streams at once, with readers that stop reading: the channel's frame
    loops must keep reading while their writers are full (both waiting to write was a deadlock)."""
    h = LocalHarness(kind)
    tunnel = await h.open_tunnel(session)
    try:
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=100)) as c:
            async def echo(i: int) -> bool:
                body = os.urandom(8 << 20)
                async with c.post(f"http://127.0.0.1:{h.port}/echo", data=body) as r:
                    return await r.read() == body

            async def stalled() -> bool:  # its stream's window fills up; the others must not stop
                async with c.get(f"http://127.0.0.1:{h.port}/big") as r:
                    await asyncio.sleep(5)
                    return await r.read() == b"z" * (64 * 65536)

            results = await asyncio.wait_for(asyncio.gather(*[stalled() for _ in range(8)],
                                                            *[echo(i) for i in range(16)]), 90)
        assert all(results)
        assert tunnel.running and tunnel.channels_opened == 1, tunnel.last_reason
    finally:
        await tunnel.close()


@pytest.mark.parametrize("kind", ["pipe", "pty"])
async def test_a_silent_channel_is_dropped_by_the_ping_deadline_and_reopened(kind: str,
                                                                             session: Session) -> None:
    # A far end that prints the marker and then never answers a ping (a hung exec, a frozen PTY).
    # (On a PTY raw first, as the relay does: else the tty turns the marker's \\n into \\r\\n.)
    argv = ["/bin/sh", "-c", "[ -t 0 ] && stty raw -echo; printf '\\n@@ARES-TUNNEL-1@@\\n'; exec sleep 60"]
    opener = (lambda: pipe_channel(argv, exit_timeout=0.2)) if kind == "pipe" else (lambda: pty_channel(argv))
    tunnel = Tunnel(opener, session.path, ping_interval=0.2, ping_timeout=0.3)
    await tunnel.start()
    try:
        for _ in range(100):
            if tunnel.channels_opened >= 2:
                break
            await asyncio.sleep(0.05)
        assert tunnel.channels_opened >= 2, tunnel.last_reason
        assert tunnel.last_reason is not None and "no frame from the peer" in tunnel.last_reason
        assert tunnel.violation is None
    finally:
        await tunnel.close()
    assert not tunnel.running


async def test_relay_exits_on_stdin_eof_and_closes_connections_over_its_limit(session: Session) -> None:
    port = free_port()
    argv = [sys.executable, "-I", RELAY, "--listen", f"127.0.0.1:{port}", "--tunnel", "binary",
            "--max-connections", "4"]
    channels: list[Channel] = []

    async def opener() -> Channel:
        channels.append(await pipe_channel(argv))
        return channels[-1]

    tunnel = Tunnel(opener, session.path, max_streams=4)
    await tunnel.start()
    conns = []
    try:
        for _ in range(6):
            conns.append(await asyncio.open_connection("127.0.0.1", port))
        closed = []
        for reader, _writer in conns:
            try:
                closed.append(await asyncio.wait_for(reader.read(1), 0.5) == b"")
            except TimeoutError:
                closed.append(False)
        assert closed == [False] * 4 + [True] * 2  # over the relay's limit: closed at once, never a stream
        assert (tunnel.running and tunnel.violation is None and tunnel.mux is not None
                and tunnel.mux.opened == 4)
    finally:
        for _reader, writer in conns:
            writer.close()
        started = time.monotonic()
        await tunnel.close()
    # The relay ended on its stdin's EOF by itself: pipe_channel kills it only after 5 s.
    assert time.monotonic() - started < 4
    proc_line = channels[0].description
    assert "pid" in proc_line
    pid = int(proc_line.rsplit("pid ", 1)[1].rstrip(")"))
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


_WAIT = ("import socket,sys,time\nfor _ in range(400):\n    try: socket.create_connection(('127.0.0.1', "
         "int(sys.argv[1])), 1).close(); break\n    except OSError: time.sleep(0.05)\n")
_PROBE = ("import socket,sys\ns=socket.socket(); s.settimeout(3)\n"
          "try:\n s.connect(('127.0.0.1', int(sys.argv[1]))); print('connected')\n"
          "except OSError as e: print('failed', type(e).__name__)\n")


def _text(directory: str, name: str) -> str | None:
    path = Path(directory, name)
    return path.read_text() if path.exists() else None


async def test_relay_over_a_pipe_into_a_bwrap_network_namespace(session: Session, tmp_path: Path) -> None:
    """The relay and its client inside ``bwrap --unshare-net`` (loopback only), the channel a pipe."""
    if shutil.which("bwrap") is None:
        pytest.skip("needs bubblewrap")
    probe = await asyncio.create_subprocess_exec("bwrap", "--unshare-net", "--dev-bind", "/", "/", "true",
                                                 stderr=asyncio.subprocess.DEVNULL)
    if await probe.wait() != 0:
        pytest.skip("bwrap --unshare-net is not permitted here")
    host = socket.socket()
    host.bind(("127.0.0.1", 0))
    host.listen(4)
    port, out = 18080, str(tmp_path)
    script = ('{ "$PY" -c "$WAIT" $PORT && "$PY" -c "$CLIENT" $PORT traffic >"$OUT/client.json" '
              '2>"$OUT/client.err"; "$PY" -c "$PROBE" $HOSTPORT >"$OUT/probe.txt"; touch "$OUT/done"; } '
              '</dev/null & exec "$PY" -I "$RELAY" --listen 127.0.0.1:$PORT --tunnel binary')
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "PY": sys.executable, "WAIT": _WAIT,
           "CLIENT": CLIENT, "PROBE": _PROBE, "RELAY": RELAY, "PORT": str(port),
           "HOSTPORT": str(host.getsockname()[1]), "OUT": out}
    argv = ["bwrap", "--unshare-net", "--die-with-parent", "--dev-bind", "/", "/", "/bin/sh", "-c", script]
    tunnel = Tunnel(lambda: pipe_channel(argv, env=env), session.path)
    await tunnel.start()
    try:
        for _ in range(1200):
            if _text(out, "done") is not None:
                break
            await asyncio.sleep(0.05)
        got = json.loads(_text(out, "client.json") or "{}")
        assert got.get("concurrent") == N_CONCURRENT, (_text(out, "client.err") or "")[-2000:]
        assert got["big"][:2] == [200, True] and got["bytes"] == [200, True]
        assert got["sse"][1] == hashlib.sha256(_sse_body()).hexdigest()
        # The host's loopback (a listening port there) is out of reach from inside.
        assert (_text(out, "probe.txt") or "").startswith("failed")
    finally:
        host.close()
        await tunnel.close()


@pytest.mark.docker
async def test_docker_exec_tunnel_reaches_only_its_own_session(session: Session) -> None:
    docker_required("agent image")
    h = DockerHarness()
    try:
        tunnel = await h.open_tunnel(session)
        sb = h.sb
        # Nothing is bind-mounted: the session's socket is reached only through the exec channel.
        r = await sb.exec("cat /proc/mounts", user="agent", timeout=30)
        assert session.dir not in r.stdout and "/.ares/forward" not in r.stdout
        # No interface but lo, no route; a host loopback port is unreachable; the tunnel port works.
        r = await sb.exec("tail -n +2 /proc/net/route; tail -n +3 /proc/net/dev | cut -d: -f1", user="agent",
                          timeout=30)
        assert r.stdout.split() == ["lo"], r
        host = socket.socket()
        host.bind(("127.0.0.1", 0))
        host.listen(4)
        probe = ("import socket,sys\ns=socket.socket(); s.settimeout(3)\n"
                 "try:\n s.connect(('127.0.0.1', int(sys.argv[1]))); print('connected')\n"
                 "except OSError as e: print('failed', type(e).__name__)\n")
        try:
            r = await sb.exec(["python3", "-c", probe, str(host.getsockname()[1])], user="agent", timeout=30)
            assert r.stdout.startswith("failed"), r
        finally:
            host.close()
        r = await sb.exec(["python3", "-c", probe, str(h.port)], user="agent", timeout=30)
        assert r.stdout.strip() == "connected", r
        # After start, any socket path (nothing has to be mounted at creation).
        other = Session()
        await other.start()
        try:
            await sb.forward(h.port + 1, other.path)
            r = await sb.exec(["python3", "-c", CLIENT, str(h.port + 1), "traffic"], user="agent", cwd="/",
                              timeout=60)
            assert json.loads(r.stdout)["concurrent"] == N_CONCURRENT, r
            assert other.together.is_set() and not session.together.is_set()  # it reached the other socket
            assert "exec tunnel" in sb.description
        finally:
            await other.stop()
        # The agent cannot kill the root relay; kill_processes() spares it and the tunnel keeps working.
        r = await sb.exec("kill -9 $(cat /.ares/relay-18080.pid)", user="agent", timeout=30)
        assert not r.ok
        assert await sb.kill_processes() >= 0
        got = await h.client("traffic")
        assert got["bytes"] == [200, True]
        assert tunnel.channels_opened == 1
        # A relay that cannot exit (stopped: it never sees its stdin's EOF) keeps the port after its
        # channel drops; the next channel's relay kills it first and serves the port.
        r = await sb.exec("kill -STOP $(cat /.ares/relay-18080.pid)", user="root", cwd="/", timeout=30)
        assert r.ok, r
        await tunnel.drop()
        for _ in range(100):
            if tunnel.channels_opened == 2:
                break
            await asyncio.sleep(0.05)
        got = await h.client("traffic")
        assert got["bytes"] == [200, True] and tunnel.channels_opened == 2 and tunnel.running
        # Closing the tunnel ends the relay itself (its stdin's EOF: the attach is half-closed).
        await tunnel.close()
        r = await sb.exec(_count_relays(h.port), user="root", cwd="/", timeout=30)
        assert r.stdout.strip() == "0", r
    finally:
        await h.close()


@pytest.mark.slow
@pytest.mark.docker
async def test_episode_over_the_docker_exec_tunnel_gets_full_reward(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """mini-swe-agent with the oracle policy, every LLM call over the exec tunnel: reward 1.0."""
    from ares_gateway.episodes.rollouts import run_rollouts
    from ares_gateway.episodes.tasks import load_dataset
    from ares_gateway.policies import make_policy
    from sandbox import tunnel as tunnel_mod
    from tests.rollouts.e2e import require_mini

    require_mini("docker")
    monkeypatch.setenv("ARES_DOCKER_TUNNEL", "exec")
    started: list[Tunnel] = []
    real_start = tunnel_mod.Tunnel.start

    async def counting_start(self: Tunnel) -> None:  # the real start, counted: proof the tunnel carried it
        started.append(self)
        await real_start(self)

    monkeypatch.setattr(tunnel_mod.Tunnel, "start", counting_start)
    task = next(t for t in load_dataset("examples").tasks if t.name == "write-greeting-file")
    summary = await run_rollouts(
        [task], policy=make_policy("oracle"),
        episode=EpisodeConfig("mini-swe-agent", sandbox="docker", time_limit=300),
        run=RunConfig(out=tmp_path / "out", stats="null"),
    )
    [episode] = summary.episodes
    assert episode.exit_reason == "completed" and episode.reward == 1.0, episode.to_dict()
    assert len(started) == 1
    # the agent's turns went through it (one kept-alive stream)
    assert started[0].mux is not None and started[0].mux.opened >= 1
    assert started[0].violation is None


@pytest.mark.slow
@pytest.mark.docker
def test_cli_run_tunnel_exec(tmp_path: Path) -> None:
    """`ares-gateway run --sandbox docker --tunnel exec`: reward 1.0; --tunnel is refused for other
    backends."""
    import subprocess

    from tests.helpers import cli
    from tests.rollouts.e2e import REPO, require_mini

    require_mini("docker")
    env = {k: v for k, v in os.environ.items() if k != "ARES_DOCKER_TUNNEL"}
    bad = subprocess.run(
        cli("run", "examples-mswea", "--policy", "oracle", "--sandbox", "local", "--tunnel", "exec"),
        cwd=REPO, env=env, capture_output=True, text=True, timeout=120, check=False)
    assert (bad.returncode == 2
            and "--tunnel exec is not a tunnel of --sandbox local" in bad.stderr), bad.stderr
    assert "docker: mount, exec" in bad.stderr and "daytona: ssh, pty" in bad.stderr
    out = tmp_path / "out"
    proc = subprocess.run(
        cli("run", "examples-mswea:0:1", "--policy", "oracle", "--sandbox", "docker", "--tunnel", "exec",
            "-n", "1", "--out", str(out), "--stats", "null"),
        cwd=REPO, env=env, capture_output=True, text=True, timeout=400, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    [episode] = json.loads((out / "results.json").read_text())["episodes"]
    assert episode["reward"] == 1.0 and episode["exit_reason"] == "completed", episode


@pytest.mark.docker
async def test_docker_exec_tunnel_needs_python3_and_says_so(session: Session) -> None:
    import sandbox
    from sandbox.docker import DockerSandbox

    from .conftest import BASE_IMAGE  # debootstrap's minimal Debian: no python3

    sb = DockerSandbox(sandbox.SandboxSpec(image=BASE_IMAGE, network="none", forwards={18080: session.path}),
                       tunnel="exec")
    with pytest.raises(sandbox.ForwardError, match="has no python3, which the exec tunnel's relay needs"):
        await sb.start()
    assert sb.state == "stopped"
    with pytest.raises(ValueError, match="tunnel must be"):
        DockerSandbox(sandbox.SandboxSpec(), tunnel="ssh")
