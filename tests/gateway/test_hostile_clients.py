"""Clients that attack or misbehave, against a real gateway on loopback.

Floods of headers must not grow the gateway's memory without bound, slow clients must not keep
connections open forever, a client that pipelines and never reads must not make it buffer answers
without limit, and a disconnect racing a ``respond`` must not answer 500. Every loop here is bounded
in count and in time.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import socket
import time
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest

from ares_gateway import (
    Completion,
    CompletionDelta,
    Gateway,
    RequestGoneError,
    SessionInfo,
)

from .conftest import handler_tasks

MiB = 1024 * 1024
CHAT_BODY = b'{"model": "m", "messages": [{"role": "user", "content": "hi"}]}'


def _rss() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS")


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


async def _read_all(sock: socket.socket, limit: float) -> tuple[bytes, bool]:
    """What the server sends within ``limit`` seconds, and whether it closed the connection."""
    loop = asyncio.get_running_loop()
    got = b""
    deadline = loop.time() + limit
    sock.setblocking(False)
    while loop.time() < deadline:
        try:
            chunk = await asyncio.wait_for(loop.sock_recv(sock, 65536), deadline - loop.time())
        except TimeoutError:
            return got, False
        except ConnectionResetError:
            return got, True
        if not chunk:
            return got, True
        got += chunk
    return got, False


async def _push(sock: socket.socket, data_source: Any, seconds: float) -> int:
    """Write as fast as the server takes it, never reading, for ``seconds``; returns bytes accepted."""
    sock.setblocking(False)
    sent = 0
    deadline = time.monotonic() + seconds
    pending = b""
    while time.monotonic() < deadline:
        if not pending:
            pending = next(data_source, b"")
            if not pending:
                break
        try:
            n = sock.send(pending)
        except BlockingIOError:
            await asyncio.sleep(0.01)
            continue
        except (BrokenPipeError, ConnectionResetError):
            break
        sent += n
        pending = pending[n:]
    return sent


def _connect(port: int) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 65536)  # the non-reader's window stays small
    return sock


# ---------------------------------------------------------------------------------- header floods


async def test_too_many_headers_is_431_and_closed(gateway: Gateway) -> None:
    head = (b"GET /healthz HTTP/1.1\r\nHost: x\r\n" + b"".join(b"x-h%d: v\r\n" % i for i in range(200))
            + b"\r\n")
    with _connect(gateway.port) as sock:
        sock.sendall(head)
        got, closed = await _read_all(sock, 5)
    assert got.startswith((b"HTTP/1.1 431", b"HTTP/1.0 431")), got[:80]
    assert json.loads(got.split(b"\r\n\r\n", 1)[1])["status"] == "error"
    assert closed


async def test_a_flood_of_small_headers_is_cut_off_with_bounded_memory(gateway: Gateway) -> None:
    """64 MiB of small header lines on one unauthenticated connection: answered and closed
    after the first KiBs, and the server's memory does not grow with what was sent."""
    before = _rss()
    line = b"x-flood: " + b"a" * 50 + b"\r\n"
    chunk = line * (65536 // len(line))

    def flood() -> Any:
        yield b"GET /healthz HTTP/1.1\r\nHost: x\r\n"
        for _ in range(64 * MiB // len(chunk)):
            yield chunk

    with _connect(gateway.port) as sock:
        sent = await _push(sock, flood(), 10)
        got, closed = await _read_all(sock, 5)
    assert got.startswith((b"HTTP/1.1 431", b"HTTP/1.0 431")), got[:80]
    assert closed and sent < 32 * MiB, sent  # the server stopped taking bytes long before 64 MiB
    assert _rss() - before < 48 * MiB


async def test_a_huge_request_line_is_refused_quickly(gateway: Gateway) -> None:
    """A 64 MiB request target: refused after the line limit, without stalling the loop."""
    started = time.monotonic()

    def line() -> Any:
        yield b"GET /"
        for _ in range(1024):
            yield b"a" * 65536

    with _connect(gateway.port) as sock:
        sent = await _push(sock, line(), 10)
        got, closed = await _read_all(sock, 5)
    assert got.startswith((b"HTTP/1.1 431", b"HTTP/1.0 431")), got[:80]
    assert closed and sent < 32 * MiB and time.monotonic() - started < 8
    # The loop stayed responsive throughout.
    async with aiohttp.ClientSession() as s, s.get(f"{gateway.url}/healthz") as r:
        assert r.status == 200


# ---------------------------------------------------------------------------------- slow clients


async def test_slow_headers_are_closed_at_the_header_deadline() -> None:
    """Slowloris: 40 connections each sending a header byte every 0.3 s. All are closed within
    the header deadline (1 s here) though every byte arrives well inside the idle timeout."""
    async with Gateway(port=0, header_timeout=1.0, keepalive_timeout=60) as gw:
        baseline = _fds()
        socks = [_connect(gw.port) for _ in range(40)]
        for s in socks:
            s.setblocking(False)
            s.send(b"GET /healthz HTTP/1.1\r\nHost: x\r\n")
        started = time.monotonic()
        open_ = set(range(len(socks)))
        while open_ and time.monotonic() - started < 6:
            await asyncio.sleep(0.3)
            for i in list(open_):
                try:
                    socks[i].send(b"x")
                    if socks[i].recv(1) == b"":
                        open_.discard(i)
                except BlockingIOError:
                    continue
                except OSError:
                    open_.discard(i)
        elapsed = time.monotonic() - started
        for s in socks:
            s.close()
        assert not open_, f"{len(open_)} slow connections still open after {elapsed:.1f} s"
        assert elapsed < 4
        for _ in range(50):
            if _fds() <= baseline:
                break
            await asyncio.sleep(0.05)
        assert _fds() <= baseline


async def test_slow_bodies_are_closed_at_the_body_deadline(session: SessionInfo) -> None:
    async with Gateway(port=0, body_timeout=0.5, body_total_timeout=1.5) as gw:
        info = await gw.create_session()
        baseline = _fds()
        head = (
            f"POST /s/{info.session_id}/v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
            f"Authorization: Bearer {info.token}\r\nContent-Length: 1000\r\n\r\n"
        ).encode()
        # One connection stops sending; one drips a byte every 0.3 s (inside the pause limit,
        # past the total limit).
        silent, dripping = _connect(gw.port), _connect(gw.port)
        silent.sendall(head + b"{")
        dripping.sendall(head + b"{")
        started = time.monotonic()

        async def drip() -> None:
            with contextlib.suppress(OSError):
                for _ in range(20):
                    await asyncio.sleep(0.3)
                    dripping.send(b" ")

        dripper = asyncio.create_task(drip())
        got_silent, closed_silent = await _read_all(silent, 4)
        got_drip, closed_drip = await _read_all(dripping, 4)
        dripper.cancel()
        elapsed = time.monotonic() - started
        silent.close()
        dripping.close()
        assert got_silent.startswith(b"HTTP/1.1 408") and closed_silent, got_silent[:80]
        assert got_drip.startswith(b"HTTP/1.1 408") and closed_drip, got_drip[:80]
        assert json.loads(got_silent.split(b"\r\n\r\n", 1)[1])["error"]["message"].startswith(
            "request body too slow")
        assert elapsed < 4 and gw.broker.pending_count == 0
        for _ in range(50):
            if _fds() <= baseline:
                break
            await asyncio.sleep(0.05)
        assert _fds() <= baseline


# ---------------------------------------------------------------------------------- pipelining


async def test_a_pipelining_client_that_never_reads_is_held_to_a_bounded_buffer(gateway: Gateway) -> None:
    """GETs pipelined without reading a single answer: the server stops reading once its
    answers back up, so what it accepts and what it holds stay bounded."""
    before = _rss()
    # Unknown paths: each 404 repeats its path, so unread answers pile up as fast as requests.
    request = b"GET /nowhere-" + b"x" * 2000 + b" HTTP/1.1\r\nHost: x\r\n\r\n"
    chunk = request * (65536 // len(request))

    def flood() -> Any:
        for _ in range(2048):  # 128 MiB offered
            yield chunk

    with _connect(gateway.port) as sock:
        sent = await _push(sock, flood(), 6)
        grown = _rss() - before
    assert sent < 16 * MiB, sent
    assert grown < 48 * MiB, grown


async def test_pipelined_large_bodies_behind_a_parked_request_are_not_buffered(
    gateway: Gateway, session: SessionInfo
) -> None:
    before = _rss()
    head = (
        f"POST /s/{session.session_id}/v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
        f"Authorization: Bearer {session.token}\r\nContent-Type: application/json\r\n"
    ).encode()
    first = head + b"Content-Length: %d\r\n\r\n%b" % (len(CHAT_BODY), CHAT_BODY)
    big = 30 * MiB

    def stream() -> Any:
        yield first
        for _ in range(3):
            yield head + b"Content-Length: %d\r\n\r\n" % big
            for _ in range(big // 65536):
                yield b" " * 65536

    with _connect(gateway.port) as sock:
        sent = await _push(sock, stream(), 4)
        assert gateway.broker.pending_count == 1  # the first is parked; nothing behind it is
    assert sent < 24 * MiB, sent
    assert _rss() - before < 64 * MiB


# ---------------------------------------------------------------------------------- respond vs disconnect


async def test_respond_in_the_iteration_the_agent_is_cancelled_is_gone(gateway: Gateway,
                                                                       session: SessionInfo) -> None:
    """The agent's handler is cancelled and respond() runs in the same loop iteration, before
    the handler's task can run again: RequestGoneError, never InvalidStateError, and nothing leaks."""
    async with aiohttp.ClientSession() as s:
        agent = asyncio.create_task(
            s.post(f"{session.base_url}/v1/chat/completions", data=CHAT_BODY,
                   headers={"Authorization": f"Bearer {session.token}"})
        )
        req = await gateway.next_request(session=session.session_id, timeout=5)
        assert req is not None
        (task,) = handler_tasks()
        task.cancel()  # what aiohttp does when the client disconnects
        with pytest.raises(RequestGoneError):
            await gateway.respond(req.id, "too late")
        agent.cancel()
        await asyncio.gather(agent, return_exceptions=True)
    await asyncio.sleep(0.05)
    assert gateway.broker.pending_count == 0 and not gateway.recorder.turns(session.session_id)


async def test_a_batch_with_one_gone_item_answers_each_on_its_own(
    gateway: Gateway, session: SessionInfo, http: aiohttp.ClientSession
) -> None:
    async with aiohttp.ClientSession() as s:
        headers = {"Authorization": f"Bearer {session.token}"}
        url = f"{session.base_url}/v1/chat/completions"
        leaving = asyncio.create_task(s.post(url, data=CHAT_BODY, headers=headers))
        staying = asyncio.create_task(s.post(url, data=CHAT_BODY, headers=headers))
        async with http.get(f"{gateway.url}/poll", params={"wait": "5", "max": "2"}) as r:
            items = await r.json()
        for _ in range(100):
            if len(items) == 2:
                break
            async with http.get(f"{gateway.url}/poll", params={"wait": "1", "max": "2"}) as r:
                items += await r.json()
        assert len(items) == 2
        for task in handler_tasks()[:1]:
            task.cancel()  # one agent goes away
        await asyncio.sleep(0.05)
        answers = [{"id": it["id"], "completion": {"text": "ok"}} for it in items]
        async with http.post(f"{gateway.url}/respond", json=answers) as r:
            assert r.status == 200
            results = await r.json()
        assert sorted(x.get("code", 200) for x in results) == [200, 410]
        done = await asyncio.wait_for(asyncio.gather(leaving, staying, return_exceptions=True), 5)
        ok = [d for d in done if not isinstance(d, BaseException)]
        assert any(d.status == 200 for d in ok)
        for d in ok:
            d.release()
    assert gateway.broker.pending_count == 0


async def test_disconnecting_agents_under_load_give_no_500_and_strand_no_lease(
    gateway: Gateway, http: aiohttp.ClientSession
) -> None:
    """60 agents, every other one hanging up while parked, a poller answering in batches: every
    /respond item is 200 or 410, the staying agents all get their answers, nothing stays leased."""
    sessions = [await gateway.create_session() for _ in range(6)]
    statuses: list[int] = []
    answered: list[int] = []

    async def agent(i: int, client: aiohttp.ClientSession) -> None:
        info = sessions[i % len(sessions)]
        call = client.post(f"{info.base_url}/v1/chat/completions", data=CHAT_BODY,
                           headers={"Authorization": f"Bearer {info.token}"})
        if i % 2:
            with contextlib.suppress(TimeoutError, aiohttp.ClientError):
                async with asyncio.timeout(0.05 + (i % 7) * 0.02):
                    async with call as r:
                        await r.read()
            return
        async with call as r:
            assert r.status == 200, await r.text()
            answered.append(i)

    async def poller() -> None:
        while True:
            async with http.get(f"{gateway.url}/poll", params={"wait": "1", "max": "16", "lease": "30"}) as r:
                assert r.status == 200
                items = await r.json()
            if items:
                await asyncio.sleep(0.03)  # some agents leave meanwhile
                body = [{"id": it["id"], "completion": {"text": "ok"}} for it in items]
                async with http.post(f"{gateway.url}/respond", json=body) as r:
                    statuses.append(r.status)
                    statuses.extend(x.get("code", 200) for x in await r.json())

    connector = aiohttp.TCPConnector(limit=0, force_close=True)
    async with aiohttp.ClientSession(connector=connector) as client:
        polling = asyncio.create_task(poller())
        try:
            await asyncio.wait_for(asyncio.gather(*(agent(i, client) for i in range(60))), 30)
            for _ in range(100):
                if gateway.broker.pending_count == 0:
                    break
                await asyncio.sleep(0.05)
        finally:
            polling.cancel()
            await asyncio.gather(polling, return_exceptions=True)
    assert 500 not in statuses and set(statuses) <= {200, 410}, statuses
    assert sorted(answered) == list(range(0, 60, 2))
    assert gateway.broker.pending_count == 0


async def test_disconnecting_agents_under_load_in_process_never_break_respond(gateway: Gateway) -> None:
    """The same with the policy in process, answering as fast as requests park: a disconnect
    lands between a handler's cancellation and its withdrawal now and then. respond() then
    raises RequestGoneError, nothing else, and the staying agents all get their answers."""
    sessions = [await gateway.create_session() for _ in range(8)]
    outcomes: dict[str, int] = {"ok": 0, "gone": 0}
    answered: list[int] = []

    async def agent(i: int, client: aiohttp.ClientSession) -> None:
        info = sessions[i % len(sessions)]
        for turn in range(4):
            call = client.post(f"{info.base_url}/v1/chat/completions", data=CHAT_BODY,
                               headers={"Authorization": f"Bearer {info.token}"})
            if (i + turn) % 2:
                with contextlib.suppress(TimeoutError, aiohttp.ClientError):
                    async with asyncio.timeout(0.001 * (i % 5)):
                        async with call as r:
                            await r.read()
                continue
            async with call as r:
                assert r.status == 200, await r.text()
                answered.append(i)

    async def policy() -> None:
        while True:
            req = await gateway.next_request(timeout=10)
            if req is None:
                continue
            try:
                await gateway.respond(req.id, "ok")
                outcomes["ok"] += 1
            except RequestGoneError:
                outcomes["gone"] += 1

    connector = aiohttp.TCPConnector(limit=0, force_close=True)
    async with aiohttp.ClientSession(connector=connector) as client:
        answering = asyncio.create_task(policy())
        try:
            await asyncio.wait_for(asyncio.gather(*(agent(i, client) for i in range(80))), 60)
            for _ in range(100):
                if gateway.broker.pending_count == 0:
                    break
                await asyncio.sleep(0.05)
        finally:
            answering.cancel()
            results = await asyncio.gather(answering, return_exceptions=True)
    assert all(isinstance(r, asyncio.CancelledError) for r in results), results  # the policy never failed
    assert len(answered) == 160 and outcomes["ok"] >= 160
    assert gateway.broker.pending_count == 0
    for _ in range(100):  # every agent handler has finished, none is left suspended
        if not handler_tasks():
            break
        await asyncio.sleep(0.05)
    assert not handler_tasks()


# ---------------------------------------------------------------------------------- sessions and answers


async def test_auto_sessions_reject_bad_ids_and_reused_tokens_with_4xx() -> None:
    async with Gateway(port=0, auto_sessions=True) as gw:
        taken = await gw.create_session("owner", token="tok-owner-0123456789")
        async with aiohttp.ClientSession() as s:
            for sid, token, status in (
                ("bad!id", "tok-fresh-0123456789", 400),
                ("x" * 200, "tok-fresh-0123456789", 400),
                ("other", taken.token, 401),
            ):
                async with s.post(f"{gw.url}/s/{sid}/v1/chat/completions", data=CHAT_BODY,
                                  headers={"Authorization": f"Bearer {token}"}) as r:
                    body = await r.json()
                    assert r.status == status, (sid, body)
                    assert isinstance(body["error"]["message"], str)
        assert gw.broker.pending_count == 0 and len(gw.sessions) == 1


@pytest.mark.parametrize("stream", [True, False])
async def test_a_stalled_in_process_stream_times_out_cleanly(stream: bool) -> None:
    async with Gateway(port=0, stream_idle_timeout=0.5) as gw:
        info = await gw.create_session()
        closed = asyncio.Event()

        async def stalls() -> AsyncIterator[CompletionDelta | Completion]:
            try:
                yield CompletionDelta(text="partial")
                await asyncio.sleep(3600)
                yield Completion(text="never")
            finally:
                closed.set()

        body = json.dumps({"model": "m", "stream": stream, "messages": [{"role": "user", "content": "x"}]})
        async with aiohttp.ClientSession() as s:
            agent = asyncio.create_task(s.post(f"{info.base_url}/v1/chat/completions", data=body,
                                               headers={"Authorization": f"Bearer {info.token}"}))
            req = await gw.next_request(timeout=5)
            assert req is not None
            started = time.monotonic()
            await gw.respond(req.id, stalls())
            r = await asyncio.wait_for(agent, 5)
            text = await asyncio.wait_for(r.text(), 5)
            elapsed = time.monotonic() - started
        assert elapsed < 3
        if stream:
            assert r.status == 200 and "partial" in text and '"error"' in text and "sent nothing" in text
        else:
            assert r.status == 504 and "sent nothing" in json.loads(text)["error"]["message"]
        assert closed.is_set()  # the policy's generator was closed
        assert not gw.recorder.turns(info.session_id)  # a broken stream is not a turn


@pytest.mark.parametrize(
    "body",
    [{"truncated": "no"}, {"truncated": 1}, {"reward": True}, {"reward": "1"}, {"reward": [1]}, [1]],
)
async def test_end_session_validates_types_strictly(
    body: Any, gateway: Gateway, session: SessionInfo, http: aiohttp.ClientSession
) -> None:
    async with http.post(f"{gateway.url}/sessions/{session.session_id}/end", json=body) as r:
        assert r.status == 400, await r.text()
    assert not gateway.sessions.get(session.session_id).ended
    async with http.post(f"{gateway.url}/sessions/{session.session_id}/end",
                         json={"reward": 0.5, "truncated": False}) as r:
        assert r.status == 200
    s = gateway.sessions.get(session.session_id)
    assert s.ended and s.reward == 0.5 and s.truncated is False


async def test_per_session_cap_on_parked_requests_is_429_in_the_agents_shape() -> None:
    async with Gateway(port=0, max_parked_per_session=2) as gw:
        info = await gw.create_session()
        other = await gw.create_session()
        body = json.dumps({"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "x"}]})
        async with aiohttp.ClientSession() as s:
            def call(sess: SessionInfo) -> Any:
                return s.post(f"{sess.base_url}/v1/messages", data=body, headers={"x-api-key": sess.token})

            waiting = [asyncio.create_task(call(info)) for _ in range(2)]
            for _ in range(100):
                if gw.broker.pending_for(info.session_id) == 2:
                    break
                await asyncio.sleep(0.02)
            async with call(info) as r:
                out = await r.json()
                assert r.status == 429 and out["type"] == "error" and r.headers["retry-after"] == "1"
                assert "limit is 2" in out["error"]["message"]
            other_call = asyncio.create_task(call(other))  # another session is not affected
            for _ in range(100):
                if gw.broker.pending_count == 3:
                    break
                await asyncio.sleep(0.02)
            assert gw.broker.pending_count == 3
            for p in gw.broker.pending():
                await gw.respond(p.id, "ok")
            for t in [*waiting, other_call]:
                r = await asyncio.wait_for(t, 5)
                assert r.status == 200
                r.release()
