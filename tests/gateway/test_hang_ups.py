"""Clients that hang up at the worst moment: an agent around its answer, a poller in the middle of a batch.

The gateway records a turn at the end of the loop iteration it was answered in, after the agent's
handler has sent the answer (``SessionRecorder(defer=True)``). These tests put the agent's hang-up
at each point around that: in the iteration the policy answers, before and after the answer, while
the answer is being written, and in the middle of a stream. Whatever the timing: an answer the
policy was told went through is in the record exactly once and durable, one it was refused (the
agent was already gone) is not, and nothing is left parked, held, leased or running; the session
goes on with its next request. A poller gone mid-batch loses no leased request. None of it is
logged as an error of the gateway's.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import socket
import struct
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest

from ares_gateway import Completion, CompletionDelta, Gateway, RequestGoneError

from .conftest import handler_tasks

CHAT = "/v1/chat/completions"


def _request(info: Any, body: dict[str, Any]) -> bytes:
    raw = orjson.dumps(body)
    path = info.base_url.split("://", 1)[1].split("/", 1)[1]
    return (f"POST /{path}{CHAT} HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {info.token}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(raw)}\r\n\r\n").encode() + raw


def _reset(writer: asyncio.StreamWriter) -> None:
    """Hang up at once with a TCP reset (SO_LINGER 0), as a killed agent's kernel does."""
    sock = writer.get_extra_info("socket")
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.transport.abort()


async def _settled(gw: Gateway, sid: str) -> None:
    for _ in range(200):
        if gw.broker.pending_count == 0 and not handler_tasks() and gw.broker.held_bytes_for(sid) == 0:
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"not settled: {gw.broker.pending_count} parked, {len(handler_tasks())} handlers, "
                         f"{gw.broker.held_bytes_for(sid)} bytes held")


WHEN = ["before-answer", "after-answer", "next-iteration", "while-reading", "polite-close"]


@pytest.mark.asyncio(loop_factories=["uvloop", "asyncio"])
async def test_a_hang_up_at_any_point_around_the_answer_loses_and_leaks_nothing(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING)
    rng = random.Random(5)
    big = "x" * 200_000  # an answer larger than a socket buffer: the write is still going when the agent goes
    async with Gateway(port=0, data_dir=str(tmp_path / "data"), request_timeout=30) as gw:
        info = await gw.create_session()
        told_ok: list[str] = []  # request ids whose respond() went through, in order
        plan = [WHEN[i % len(WHEN)] for i in range(60)]
        rng.shuffle(plan)
        for turn, when in enumerate(plan):
            body = {"model": "m", "messages": [{"role": "user", "content": f"turn {turn}"}]}
            reader, writer = await asyncio.open_connection("127.0.0.1", gw.port)
            writer.write(_request(info, body))
            await writer.drain()
            req = await gw.next_request(timeout=5)
            assert req is not None
            answer = Completion(text=big if when == "while-reading" else f"answer {turn}")
            try:
                if when == "before-answer":
                    _reset(writer)  # the loop has not seen it yet: the answer is still taken
                    await gw.respond(req.id, answer)
                elif when == "after-answer":
                    await gw.respond(req.id, answer)
                    _reset(writer)  # before the handler could write a byte of it
                elif when == "next-iteration":
                    await gw.respond(req.id, answer)
                    await asyncio.sleep(0)  # the handler writes, the turn is recorded, then the hang-up
                    _reset(writer)
                elif when == "while-reading":
                    await gw.respond(req.id, answer)
                    await reader.read(1024)  # the first bytes of a 200 KB answer
                    _reset(writer)
                else:
                    await gw.respond(req.id, answer)
                    writer.close()  # a FIN, unread answer in flight
            except RequestGoneError:
                pass  # the agent was seen gone first: refused, and never recorded
            else:
                told_ok.append(req.id)
            await _settled(gw, info.session_id)
        await gw.durable()
        log = gw.turn_log(info.session_id)
        # Every answer the policy was told went through is recorded once, in order; nothing else is.
        assert [e["request_id"] for e in log] == told_ok
        assert len(told_ok) >= 48, told_ok  # only a hang-up the loop saw before respond() is refused
        texts = [e["completion"]["text"] for e in log]
        assert all(t == big or t.startswith("answer ") for t in texts)
        # The session goes on: the next request is answered and recorded after them.
        reader, writer = await asyncio.open_connection("127.0.0.1", gw.port)
        writer.write(_request(info, {"model": "m", "messages": [{"role": "user", "content": "still here?"}]}))
        await writer.drain()
        req = await gw.next_request(timeout=5)
        assert req is not None
        await gw.respond(req.id, "yes")
        head = await reader.readuntil(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200"), head
        writer.close()
        await gw.durable()
        assert [e["request_id"] for e in gw.turn_log(info.session_id)] == [*told_ok, req.id]
        await _settled(gw, info.session_id)
    # The store has them too, read back by a gateway that opens the same data dir.
    async with Gateway(port=0, data_dir=str(tmp_path / "data")) as again:
        assert [e["request_id"] for e in again.turn_log(info.session_id)] == [*told_ok, req.id]
    bad = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert not bad, [r.getMessage() for r in bad]


@pytest.mark.asyncio(loop_factories=["uvloop", "asyncio"])
async def test_a_hang_up_mid_stream_records_nothing_and_closes_the_policys_stream(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING)
    async with Gateway(port=0, data_dir=str(tmp_path / "data"), request_timeout=30) as gw:
        info = await gw.create_session()
        for turn in range(10):
            closed = asyncio.Event()

            async def stream(n: int = turn, done: asyncio.Event = closed) -> Any:
                try:
                    for i in range(10_000):
                        yield CompletionDelta(text=f"t{n}.{i} " * 50)
                        if i % 10 == 0:
                            await asyncio.sleep(0)
                    yield Completion(text="never")
                finally:
                    done.set()

            body = {"model": "m", "stream": True, "messages": [{"role": "user", "content": f"turn {turn}"}]}
            reader, writer = await asyncio.open_connection("127.0.0.1", gw.port)
            writer.write(_request(info, body))
            await writer.drain()
            req = await gw.next_request(timeout=5)
            assert req is not None
            await gw.respond(req.id, stream())
            await reader.readuntil(b"data: ")  # the first delta arrived
            _reset(writer)
            await asyncio.wait_for(closed.wait(), 10)
            await _settled(gw, info.session_id)
        await gw.durable()
        assert gw.turn_log(info.session_id) == []  # an abandoned stream is no turn
    bad = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert not bad, [r.getMessage() for r in bad]  # an agent gone is no error of the gateway's


@pytest.mark.asyncio(loop_factories=["uvloop", "asyncio"])
async def test_a_poller_that_hangs_up_mid_batch_loses_no_leased_request(
    caplog: pytest.LogCaptureFixture) -> None:
    """/poll writes a batch of Claude-Code-sized bodies piece by piece (never joined into one
    allocation); a poller gone halfway through gets nothing more, its leased items come back when
    the lease ends, and the next poller answers every one. Nothing is logged as an error."""
    caplog.set_level(logging.WARNING)
    admin = "hang-up-admin-token-0123456789"
    async with Gateway(port=0, admin_token=admin, request_timeout=60, lease_seconds=30) as gw:
        infos = [await gw.create_session() for _ in range(12)]
        agents = []
        for i, info in enumerate(infos):
            r, w = await asyncio.open_connection("127.0.0.1", gw.port)
            body = {"model": "m", "messages": [{"role": "user", "content": f"agent {i} " + "y" * 96_000}]}
            w.write(_request(info, body))
            agents.append((r, w))
        for _ in range(200):
            if gw.broker.pending_count == len(infos):
                break
            await asyncio.sleep(0.01)
        assert gw.broker.pending_count == len(infos)
        # A poller that reads the head and a little of a ~1.2 MB batch, then resets.
        reader, writer = await asyncio.open_connection("127.0.0.1", gw.port)
        writer.write("GET /poll?max=100&lease=0.5 HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer "
                     f"{admin}\r\n\r\n".encode())
        await writer.drain()
        head = await reader.readuntil(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200") and b"Content-Length" in head, head
        await reader.readexactly(50_000)
        _reset(writer)
        await asyncio.sleep(0.7)  # the lease ends: the items are pollable again
        async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {admin}"}) as s:
            async with s.get(f"{gw.url}/poll", params={"max": "100", "wait": "5"}) as r:
                assert r.status == 200
                items = await r.json()
            assert sorted(it["session_id"] for it in items) == sorted(i.session_id for i in infos)
            assert all(len(it["request"]["messages"][0]["content"]) > 96_000 for it in items)
            async with s.post(f"{gw.url}/respond", json=[{"id": it["id"], "completion": {"text": "ok"}}
                                                        for it in items]) as r:
                assert r.status == 200 and all(x["status"] == "ok" for x in await r.json())
        for r, w in agents:
            assert (await r.readuntil(b"\r\n\r\n")).startswith(b"HTTP/1.1 200")
            w.close()
        assert gw.broker.pending_count == 0
    bad = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert not bad, [r.getMessage() for r in bad]
