"""Budgets per session and per connection, and large bodies parsed off the event loop.

Each attack runs for real against a gateway on loopback: a session's 25 MB bodies past its byte
budget get a 429 while other sessions work; connections past the cap get a 503; unfinished 1 MiB
heads are refused early, with bounded memory, instead of held until the header deadline; and a
30 MB body is parsed off the event loop, so another session's turn does not wait for it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
from collections.abc import AsyncIterator

import aiohttp
import orjson
import pytest

from ares_gateway import Completion, Gateway
from tests.gateway.test_hostile_clients import CHAT_BODY as CHAT
from tests.gateway.test_hostile_clients import MiB, _rss


def _big_body(size: int, messages: int) -> bytes:
    per = max(1, size // messages - 42)
    msgs = [{"role": "user" if i % 2 == 0 else "assistant", "content": "x" * per} for i in range(messages)]
    return orjson.dumps({"model": "m", "messages": msgs})


@contextlib.asynccontextmanager
async def _answering(gw: Gateway, seen: list[str]) -> AsyncIterator[None]:
    """A policy in process answering every request, noting each request's session as it takes it."""

    async def loop() -> None:
        while True:
            req = await gw.next_request(timeout=60)
            if req is not None:
                seen.append(req.session_id)
                await gw.respond(req.id, Completion(text="ok"))

    task = asyncio.create_task(loop())
    try:
        yield
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


# ---------------------------------------------------------------------------------- parked bytes


async def test_a_sessions_bodies_past_its_byte_budget_get_429_while_another_session_works() -> None:
    """Default settings: one session parks two 25 MB bodies; its third (75 MB held, the budget is
    64 MiB) is a 429 in the OpenAI shape with retry-after, and nothing more is parked for it; another
    session still parks and gets its answer."""
    body = _big_body(25 * 1000 * 1000, 1000)
    async with Gateway(port=0, request_timeout=60) as gw:
        greedy, other = await gw.create_session(), await gw.create_session()
        timeout = aiohttp.ClientTimeout(total=120)
        async with aiohttp.ClientSession(timeout=timeout) as s:
            url = f"{greedy.base_url}/v1/chat/completions"
            headers = {"Authorization": f"Bearer {greedy.token}", "Content-Type": "application/json"}
            parked = [asyncio.create_task(s.post(url, data=body, headers=headers)) for _ in range(2)]
            for _ in range(600):
                if gw.broker.pending_for(greedy.session_id) == 2:
                    break
                await asyncio.sleep(0.05)
            assert gw.broker.pending_for(greedy.session_id) == 2
            async with s.post(url, data=body, headers=headers) as r:
                assert r.status == 429, await r.text()
                assert r.headers.get("retry-after")
                err = (await r.json())["error"]
                assert "per session" in err["message"] and err["type"]
            assert gw.broker.pending_for(greedy.session_id) == 2
            # The other session's turn is parked and answered as usual.
            seen: list[str] = []
            async with _answering(gw, seen):
                ours = {"Authorization": f"Bearer {other.token}"}
                async with s.post(f"{other.base_url}/v1/chat/completions", data=CHAT, headers=ours) as r:
                    assert r.status == 200, await r.text()
                for t in parked:
                    (await t).release()
        assert other.session_id in seen
        assert gw.broker.held_bytes_for(greedy.session_id) == 0  # answered: the budget is back


async def test_a_body_over_the_whole_session_budget_is_413_before_it_is_read() -> None:
    async with Gateway(port=0, max_parked_bytes_per_session=1 * MiB) as gw:
        info = await gw.create_session()
        body = _big_body(2 * MiB, 100)
        async with aiohttp.ClientSession() as s, s.post(
            f"{info.base_url}/v1/messages", data=body,
            headers={"x-api-key": info.token, "content-type": "application/json"},
        ) as r:
            assert r.status == 413
            got = await r.json()
            assert got["type"] == "error" and "per session" in got["error"]["message"]  # Anthropic's shape
        assert gw.broker.pending_count == 0 and gw.broker.held_bytes_for(info.session_id) == 0


# ---------------------------------------------------------------------------------- connections


async def test_connections_past_the_cap_get_a_503_and_the_server_stays_healthy() -> None:
    async with Gateway(port=0, max_connections=8) as gw:
        held = [socket.create_connection(("127.0.0.1", gw.port)) for _ in range(8)]
        await asyncio.sleep(0.1)
        loop = asyncio.get_running_loop()
        extra = socket.create_connection(("127.0.0.1", gw.port))
        extra.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
        extra.settimeout(5)
        got = await loop.run_in_executor(None, extra.recv, 65536)
        assert got.startswith(b"HTTP/1.1 503"), got[:80]
        assert b"retry-after" in got.lower()
        assert "connections open" in json.loads(got.split(b"\r\n\r\n", 1)[1])["error"]
        assert await loop.run_in_executor(None, extra.recv, 65536) == b""  # then closed
        extra.close()
        for sock in held:
            sock.close()
        for _ in range(100):
            if gw._http is not None and gw._http.connections == 0:
                break
            await asyncio.sleep(0.02)
        async with aiohttp.ClientSession() as s, s.get(f"{gw.url}/healthz") as r:
            assert r.status == 200


# ---------------------------------------------------------------------------------- request heads


async def test_many_unfinished_huge_heads_are_refused_early_with_bounded_memory() -> None:
    """200 connections each send 126 header lines of 8,000 bytes (each line within aiohttp's own
    limits, about 1 MiB a head) and never finish: each gets a 431 and is closed once its head
    passes the head budget, and the memory they take stays bounded (generously: the bench
    measures it precisely)."""
    async with Gateway(port=0, header_timeout=30) as gw:
        before = _rss()
        loop = asyncio.get_running_loop()
        value = b"v" * 8000
        head = (b"GET /healthz HTTP/1.1\r\nHost: x\r\n"
                + b"".join(b"x-h%03d: %b\r\n" % (i, value) for i in range(126)))
        socks = [socket.create_connection(("127.0.0.1", gw.port)) for _ in range(200)]
        for sock in socks:
            sock.setblocking(False)

        async def send(sock: socket.socket) -> None:
            with contextlib.suppress(OSError):
                await loop.sock_sendall(sock, head)

        await asyncio.wait_for(asyncio.gather(*(send(s) for s in socks)), 30)
        await asyncio.sleep(0.5)
        grown = _rss() - before
        async def answer(sock: socket.socket) -> bytes:
            try:
                return await asyncio.wait_for(loop.sock_recv(sock, 64), 5)
            except (OSError, TimeoutError):
                return b""

        answers = await asyncio.gather(*(answer(s) for s in socks))
        for sock in socks:
            sock.close()
        assert all(a.startswith((b"HTTP/1.1 431", b"HTTP/1.0 431")) for a in answers), {a[:20]
                                                                                        for a in answers}
        assert grown < 120 * MiB, grown / MiB  # 200 whole heads held were about 400 MiB
        async with aiohttp.ClientSession() as s, s.get(f"{gw.url}/healthz") as r:
            assert r.status == 200


async def test_a_head_within_the_budget_is_served() -> None:
    async with Gateway(port=0) as gw:
        headers = {f"x-h{i}": "v" * 1000 for i in range(40)}  # 40 KB of headers: fine
        async with aiohttp.ClientSession() as s, s.get(f"{gw.url}/healthz", headers=headers) as r:
            assert r.status == 200


# ---------------------------------------------------------------------------------- big bodies


@pytest.mark.parametrize("protocol_path", ["/v1/chat/completions"])
async def test_another_sessions_turn_completes_while_a_30mb_body_is_parsed(protocol_path: str) -> None:
    """A 30 MB, 60,000-message body arrives whole; right after, another session takes a turn. That
    turn is parked and answered before the big request is parked (its parsing is off the event
    loop); the big one is then answered too. Parsed on the event loop, the big body (about 0.6 s)
    would hold the other turn back until it was done."""
    body = _big_body(30 * 1000 * 1000, 60_000)
    async with Gateway(port=0, request_timeout=120) as gw:
        big, small = await gw.create_session(), await gw.create_session()
        seen: list[str] = []
        loop = asyncio.get_running_loop()
        async with _answering(gw, seen):
            sock = socket.create_connection(("127.0.0.1", gw.port))
            head = (f"POST /s/{big.session_id}{protocol_path} HTTP/1.1\r\nHost: x\r\n"
                    f"Authorization: Bearer {big.token}\r\nContent-Type: application/json\r\n"
                    f"Content-Length: {len(body)}\r\n\r\n").encode()
            # Sent from a thread: the whole body is in the kernel's buffers when this returns, and
            # the gateway has it a moment later.
            await loop.run_in_executor(None, sock.sendall, head + body)
            await asyncio.sleep(0.2)
            async with aiohttp.ClientSession() as s, s.post(
                f"{small.base_url}/v1/chat/completions", data=CHAT,
                headers={"Authorization": f"Bearer {small.token}"},
            ) as r:
                assert r.status == 200, await r.text()
            # The small turn is done, and the big request is not even parked yet.
            assert seen == [small.session_id]
            sock.settimeout(60)
            got = await loop.run_in_executor(None, sock.recv, 65536)
            sock.close()
        assert got.startswith(b"HTTP/1.1 200"), got[:200]
        assert seen == [small.session_id, big.session_id]


async def test_a_large_body_parsed_off_the_loop_gives_the_same_errors_and_request() -> None:
    """Off the loop, a large body is read exactly as a small one: the same 400s, the same request."""
    async with Gateway(port=0, parse_offload_bytes=1024) as gw:
        info = await gw.create_session()
        headers = {"Authorization": f"Bearer {info.token}", "Content-Type": "application/json"}
        url = f"{info.base_url}/v1/chat/completions"
        filler = "y" * 4000
        async with aiohttp.ClientSession() as s:
            async with s.post(url, data=b'{"model": "m", "messages": [' + b" " * 4000 + b"}",
                              headers=headers) as r:
                assert r.status == 400 and "not valid JSON" in (await r.json())["error"]["message"]
            bad = orjson.dumps({"model": "m", "messages": [{"role": "user", "content": filler}, {"role": 7}]})
            async with s.post(url, data=bad, headers=headers) as r:
                assert r.status == 400, await r.text()
                assert (await r.json())["error"]["param"].startswith("messages[1]")
            nested = {"model": "m", "temperature": 0.5, "metadata": {"k": [1, 2.5, None, True, "é" * 10]},
                      "messages": [{"role": "user", "content": [{"type": "text", "text": filler}]},
                                   {"role": "assistant", "content": filler}]}
            seen: list[str] = []
            async with _answering(gw, seen), s.post(url, data=orjson.dumps(nested), headers=headers) as r:
                assert r.status == 200, await r.text()
        assert gw.body_parser.offloaded == 3
        log = gw.turn_log(info.session_id)
        assert log[0]["request"] == nested
