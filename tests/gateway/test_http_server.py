"""The gateway's HTTP/1.1 framing (aiohttp's server under ares_gateway/http/), over raw loopback sockets.

The SDK tests drive the ordinary path; these send what real clients send less
often: pipelined requests, HTTP/1.0, chunked bodies, unknown expectations,
malformed request lines, upgrades, idle connections, handler failures.
"""

from __future__ import annotations

import asyncio
import json

import aiohttp
import openai
import pytest
from aiohttp.web_request import BaseRequest
from aiohttp.web_response import Response, StreamResponse
from multidict import CIMultiDict

from ares_gateway import Gateway, HttpLimits, SessionInfo
from ares_gateway.http.server import HttpServer

from .conftest import ADMIN


async def _read_response(reader: asyncio.StreamReader, *,
                         head_only: bool = False) -> tuple[int, CIMultiDict[str], bytes] | None:
    """One HTTP/1.1 response (by content-length or chunked); None when the server closed first."""
    try:
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
    except asyncio.IncompleteReadError:
        return None
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split(" ", 2)[1])
    headers: CIMultiDict[str] = CIMultiDict()
    for line in lines[1:]:
        if line:
            name, _, value = line.partition(":")
            headers.add(name.strip(), value.strip())
    if head_only or status in (100, 204, 304):
        return status, headers, b""
    if headers.get("transfer-encoding", "").lower() == "chunked":
        body = b""
        while True:
            size = int((await asyncio.wait_for(reader.readuntil(b"\r\n"), 5)).strip(), 16)
            chunk = await asyncio.wait_for(reader.readexactly(size + 2), 5)
            if size == 0:
                return status, headers, body
            body += chunk[:-2]
    length = headers.get("content-length")
    if length is None:
        return status, headers, await asyncio.wait_for(reader.read(), 5)
    return status, headers, await asyncio.wait_for(reader.readexactly(int(length)), 5)


async def _exchange(port: int, data: bytes, *, expect: int,
                    head_first: bool = False) -> tuple[list[tuple[int, CIMultiDict[str], bytes]], bool]:
    """Send raw bytes, read ``expect`` responses; returns them and whether the server then closed."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    responses: list[tuple[int, CIMultiDict[str], bytes]] = []
    writer.write(data)
    await writer.drain()
    closed = False
    try:
        while len(responses) < expect:
            # A HEAD response has a content-length but no body: read its head alone.
            got = await _read_response(reader, head_only=head_first and not responses)
            if got is None:
                closed = True
                break
            if got[0] == 100:
                continue
            responses.append(got)
        if not closed:
            try:
                closed = await asyncio.wait_for(reader.read(1), 0.3) == b""
            except TimeoutError:
                closed = False
    finally:
        writer.close()
    return responses, closed


def _get(path: str, *extra: str, version: str = "1.1") -> bytes:
    lines = [f"GET {path} HTTP/{version}", "Host: 127.0.0.1", *extra]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


async def test_pipelined_requests_are_answered_in_order(gateway: Gateway) -> None:
    await gateway.create_session("pipelined")
    auth = f"Authorization: Bearer {ADMIN}"
    data = (_get("/healthz") + _get("/sessions/pipelined", auth)
            + _get("/sessions/nope", auth, "Connection: close"))
    responses, closed = await _exchange(gateway.port, data, expect=3)
    assert [r[0] for r in responses] == [200, 200, 404]
    assert json.loads(responses[1][2])["session_id"] == "pipelined"
    assert json.loads(responses[2][2])["code"] == 404
    assert closed  # the last asked for Connection: close


async def test_http10_closes_unless_keep_alive(gateway: Gateway) -> None:
    responses, closed = await _exchange(gateway.port, _get("/healthz", version="1.0"), expect=1)
    assert responses[0][0] == 200 and json.loads(responses[0][2])["status"] == "ok" and closed
    responses, closed = await _exchange(gateway.port,
                                        _get("/healthz", "Connection: keep-alive", version="1.0"), expect=1)
    assert responses[0][0] == 200 and responses[0][1]["connection"] == "keep-alive" and not closed


async def test_chunked_request_body_is_read(gateway: Gateway, session: SessionInfo) -> None:
    body = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}]}).encode()
    half = len(body) // 2
    chunks = b"%x\r\n%b\r\n%x\r\n%b\r\n0\r\n\r\n" % (half, body[:half], len(body) - half, body[half:])
    head = (
        f"POST /s/{session.session_id}/v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer "
        f"{session.token}\r\n"
        "Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n"
    )

    async def answer() -> None:
        req = await gateway.next_request(session=session.session_id, timeout=5)
        assert req is not None and req.request.messages[0].text() == "hi"
        await gateway.respond(req.id, "hello")

    answering = asyncio.create_task(answer())
    responses, _ = await _exchange(gateway.port, head.encode() + chunks, expect=1)
    await answering
    assert responses[0][0] == 200
    assert json.loads(responses[0][2])["choices"][0]["message"]["content"] == "hello"


async def test_chunked_body_over_the_limit_is_413_in_shape() -> None:
    async with Gateway(port=0, max_body_bytes=1000) as gw:
        info = await gw.create_session()
        chunk = b"x" * 600
        head = (
            f"POST /s/{info.session_id}/v1/messages HTTP/1.1\r\nHost: x\r\nx-api-key: {info.token}\r\n"
            "Transfer-Encoding: chunked\r\n\r\n"
        ).encode()
        data = (head + (b"%x\r\n%b\r\n" % (len(chunk), chunk)) * 3 + b"0\r\n\r\n"
                + _get("/healthz", "Connection: close"))
        responses, _ = await _exchange(gw.port, data, expect=2)
        assert responses[0][0] == 413
        assert json.loads(responses[0][2])["type"] == "error"  # Anthropic's error shape
        assert responses[1][0] == 200  # the connection stays usable after the discarded body
        assert gw.broker.pending_count == 0


async def test_unknown_expectation_is_417_and_closes(gateway: Gateway) -> None:
    data = (
        f"POST /sessions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {ADMIN}\r\nExpect: something-else\r\n"
        "Content-Length: 2\r\n\r\n{}"
    ).encode()
    responses, closed = await _exchange(gateway.port, data, expect=1)
    assert responses[0][0] == 417 and "100-continue" in json.loads(responses[0][2])["error"]
    assert closed and len(gateway.sessions) == 0


async def test_malformed_request_is_400_and_closes(gateway: Gateway) -> None:
    responses, closed = await _exchange(gateway.port, b"NOT AN HTTP REQUEST\r\n\r\n", expect=1)
    assert responses[0][0] == 400 and json.loads(responses[0][2])["status"] == "error"
    assert closed
    # The server is unharmed.
    responses, _ = await _exchange(gateway.port, _get("/healthz", "Connection: close"), expect=1)
    assert responses[0][0] == 200


async def test_websocket_upgrade_is_426_then_closed(gateway: Gateway, session: SessionInfo) -> None:
    data = _get(
        f"/s/{session.session_id}/v1/responses",
        f"Authorization: Bearer {session.token}",
        "Upgrade: websocket",
        "Connection: Upgrade",
        "Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==",
        "Sec-WebSocket-Version: 13",
    )
    responses, closed = await _exchange(gateway.port, data + b"\x81\x05hello", expect=1)
    assert responses[0][0] == 426 and "POST /v1/responses" in json.loads(responses[0][2])["error"]["message"]
    assert closed


async def test_head_has_length_but_no_body(gateway: Gateway) -> None:
    data = (
        b"HEAD / HTTP/1.1\r\nHost: x\r\n\r\n" + _get("/healthz", "Connection: close")
    )
    responses, _ = await _exchange(gateway.port, data, expect=2, head_first=True)
    assert responses[0][0] == 200 and int(responses[0][1]["content-length"]) > 0
    assert responses[1][0] == 200 and json.loads(responses[1][2])["status"] == "ok"


async def test_absolute_form_and_percent_encoded_paths(gateway: Gateway) -> None:
    await gateway.create_session("pct-session")
    auth = f"Authorization: Bearer {ADMIN}"
    data = (_get(f"http://127.0.0.1:{gateway.port}/healthz?x=1")
            + _get("/sessions/pct%2Dsession", auth, "Connection: close"))
    responses, _ = await _exchange(gateway.port, data, expect=2)
    assert [r[0] for r in responses] == [200, 200]
    assert json.loads(responses[1][2])["session_id"] == "pct-session"


async def _serve(handler, **limits) -> tuple[HttpServer, int]:  # type: ignore[no-untyped-def]
    def error(path: str, status: int, message: str) -> Response:
        return Response(body=json.dumps({"error": message}).encode(), status=status,
                        content_type="application/json")

    server = HttpServer(handler, error, HttpLimits(**limits))
    return server, await server.start("127.0.0.1", 0)


async def test_idle_connections_are_closed() -> None:
    async def ok(request: BaseRequest) -> Response:
        return Response(body=b"{}")

    server, port = await _serve(ok, keepalive_timeout=0.2)
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(_get("/"))
        await writer.drain()
        assert (await reader.readuntil(b"{}")).startswith(b"HTTP/1.1 200")
        # Idle past the timeout: the server hangs up.
        assert await asyncio.wait_for(reader.read(), 2) == b""
        await asyncio.sleep(0.05)
        assert not server.connections
        writer.close()
    finally:
        await server.close()


async def test_a_failing_handler_is_500_and_the_server_goes_on() -> None:
    async def handler(request: BaseRequest) -> Response:
        if request.path == "/boom":
            raise RuntimeError("bug")
        return Response(body=b'{"fine": true}', content_type="application/json")

    server, port = await _serve(handler)
    try:
        responses, closed = await _exchange(port, _get("/boom") + _get("/fine"), expect=1)
        assert responses[0][0] == 500 and "internal error" in json.loads(responses[0][2])["error"]
        assert closed  # after an unexpected failure the connection is not trusted further
        async with aiohttp.ClientSession() as s, s.get(f"http://127.0.0.1:{port}/fine") as r:
            assert r.status == 200 and await r.json() == {"fine": True}
    finally:
        await server.close()


async def test_a_connection_error_of_the_handlers_own_is_still_a_500(
    caplog: pytest.LogCaptureFixture) -> None:
    """Only a client that went away is let go quietly (tests/gateway/test_hang_ups.py): a handler's own
    ConnectionError (a policy's server refused, say) with the client still there is a logged 500."""
    async def handler(request: BaseRequest) -> Response:
        raise ConnectionRefusedError("the policy's server refused")

    server, port = await _serve(handler)
    try:
        responses, _ = await _exchange(port, _get("/x"), expect=1)
        assert responses[0][0] == 500 and "internal error" in json.loads(responses[0][2])["error"]
        assert any("unhandled error serving GET /x" in r.getMessage() for r in caplog.records
                   if r.levelno >= 40)
    finally:
        await server.close()


async def test_stream_writes_wait_for_a_slow_reader() -> None:
    """Back-pressure: a client that does not read stalls the writer instead of growing its buffer."""
    written: list[int] = []
    chunk = b"x" * 65536

    async def stream(request: BaseRequest) -> StreamResponse:
        resp = StreamResponse(status=200, headers={"content-type": "application/octet-stream"})
        await resp.prepare(request)
        for _ in range(400):  # 25 MiB, far over the socket buffers
            await resp.write(chunk)
            written.append(len(chunk))
        await resp.write_eof()
        return resp

    server, port = await _serve(stream)
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port, limit=1 << 16)
        writer.write(_get("/"))
        await writer.drain()
        await asyncio.sleep(0.5)
        stalled_at = sum(written)
        assert stalled_at < 400 * len(chunk) // 2  # the writer waits for the reader
        total = 0
        while True:
            data = await asyncio.wait_for(reader.read(1 << 20), 5)
            total += len(data)
            if data.endswith(b"0\r\n\r\n"):
                break
        assert sum(written) == 400 * len(chunk) and total > sum(written)
        writer.close()
    finally:
        await server.close()


async def test_close_lets_answers_in_flight_go_out() -> None:
    """Closing the gateway fails parked requests; their agents still receive the error."""
    async with Gateway(port=0) as gw:
        info = await gw.create_session()
        client = openai.AsyncOpenAI(base_url=f"{info.base_url}/v1", api_key=info.token, max_retries=0)
        agent = asyncio.create_task(
            client.chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}]))
        parked = await gw.next_request(timeout=5)  # parked, and left unanswered
        assert parked is not None
    with pytest.raises(openai.APIStatusError) as err:
        await agent
    assert err.value.status_code == 503
