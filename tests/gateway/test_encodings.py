"""Request bodies with a ``Content-Encoding``, on each of the three agent APIs.

A real gateway on loopback; the agent is aiohttp sending raw bytes with the header (as an agent
that compresses its bodies does), or the official openai and anthropic SDKs. A gzip or deflate body
that decodes is answered; one that does not is a 400 in the agent's shape (aiohttp's decoder made
it a 500); ``br``, ``zstd`` and unknown codings are a 415 in the agent's shape naming the accepted
ones (aiohttp told the client to install Brotli, in the control API's shape, or passed an unknown
coding through undecoded); a small body that inflates past a limit is a 413 without being
inflated whole. No case is a 500, and the server logs no traceback.
"""

from __future__ import annotations

import asyncio
import contextlib
import gzip
import json
import logging
import tracemalloc
import zlib
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import anthropic
import openai
import pytest

from ares_gateway import Completion, Gateway, SessionInfo

PATHS = {"chat": "/v1/chat/completions", "messages": "/v1/messages", "responses": "/v1/responses"}
BODIES: dict[str, dict[str, Any]] = {
    "chat": {"model": "m", "messages": [{"role": "user", "content": "hi from a compressed body"}]},
    "messages": {"model": "m", "max_tokens": 16,
                 "messages": [{"role": "user", "content": "hi from a compressed body"}]},
    "responses": {"model": "m", "input": "hi from a compressed body"},
}
MiB = 1024 * 1024


def _raw_deflate(data: bytes) -> bytes:
    z = zlib.compressobj(wbits=-15)
    return z.compress(data) + z.flush()


def _assert_shape(api: str, status: int, body: dict[str, Any]) -> str:
    """The error's message, after checking the body is the agent's protocol's error shape."""
    if api == "messages":
        assert body["type"] == "error" and set(body["error"]) == {"type", "message"}, body
    else:
        assert set(body["error"]) >= {"message", "type", "param", "code"}, body
    assert "status" not in body  # not the control API's shape
    message = body["error"]["message"]
    assert isinstance(message, str)
    return message


def _server_trouble(caplog: pytest.LogCaptureFixture) -> list[str]:
    ours = [r for r in caplog.records if r.name.startswith(("ares_gateway", "aiohttp"))]
    return [r.getMessage() for r in ours if r.levelno >= logging.WARNING or r.exc_info]


async def _answer_all(gw: Gateway, info: SessionInfo, seen: list[Any]) -> None:
    while True:
        req = await gw.next_request(session=info.session_id, timeout=30)
        if req is not None:
            seen.append(req)
            await gw.respond(req.id, Completion(text="ok"))


@pytest.fixture
async def gw_session() -> AsyncIterator[tuple[Gateway, SessionInfo, list[Any]]]:
    async with Gateway(port=0, data_dir=False) as gw:
        info = await gw.create_session()
        seen: list[Any] = []
        task = asyncio.create_task(_answer_all(gw, info, seen))
        try:
            yield gw, info, seen
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task


async def _post(http: aiohttp.ClientSession, url: str, token: str, data: bytes,
                coding: str) -> tuple[int, Any, Any]:
    async with http.post(url, data=data, timeout=aiohttp.ClientTimeout(total=30), headers={
        "content-type": "application/json", "x-api-key": token, "content-encoding": coding,
    }) as r:
        return r.status, r.headers, await r.json(content_type=None)


@pytest.mark.parametrize("api", list(PATHS))
async def test_each_content_encoding_on_each_api(
    api: str, gw_session: tuple[Gateway, SessionInfo, list[Any]], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    gw, info, seen = gw_session
    url = info.base_url + PATHS[api]
    raw = json.dumps(BODIES[api]).encode()
    good = {
        "gzip": gzip.compress(raw),
        "x-gzip": gzip.compress(raw),
        "deflate": zlib.compress(raw),  # HTTP's deflate: a zlib stream
        "Deflate": _raw_deflate(raw),  # raw deflate, as some clients send; any case
        "identity": raw,
        "gzip, identity": gzip.compress(raw),
    }
    undecodable = {
        "gzip": b"this is not gzip at all",
        "deflate": b"this is not deflate",
        # A gzip body cut short: aiohttp passed it on, and it read as bad JSON.
        "GZIP": gzip.compress(raw)[:-12],
        # A good gzip body followed by bytes that are not another gzip member.
        "x-gzip": gzip.compress(raw) + b"trailing junk",
    }
    unaccepted = {"br": raw, "zstd": raw, "compress": raw, "x-unknown-coding": raw, "gzip, br": raw,
                  "gzip, gzip": gzip.compress(gzip.compress(raw))}
    async with aiohttp.ClientSession() as http:
        for coding, data in good.items():
            status, _, body = await _post(http, url, info.token, data, coding)
            assert status == 200, (coding, status, body)
            # the policy got it decoded
            assert seen[-1].request.raw == BODIES[api] and seen[-1].raw_body == raw
        assert len(seen) == len(good)
        for coding, data in undecodable.items():
            status, _, body = await _post(http, url, info.token, data, coding)
            assert status == 400, (coding, status, body)
            message = _assert_shape(api, status, body)
            assert message.startswith("request body could not be decoded as gzip" if "gzip" in coding.lower()
                                      else "request body could not be decoded as deflate"), message
        for coding, data in unaccepted.items():
            status, headers, body = await _post(http, url, info.token, data, coding)
            assert status == 415, (coding, status, body)
            message = _assert_shape(api, status, body)
            assert "is not accepted" in message and "gzip, deflate" in message, message
            assert "install" not in message.lower() and "brotli" not in message.lower(), message
            assert headers["accept-encoding"] == "gzip, deflate"
    assert len(seen) == len(good)  # nothing refused reached the policy
    assert gw.broker.pending_count == 0 and gw.broker.held_bytes_for(info.session_id) == 0
    assert _server_trouble(caplog) == []


async def test_the_sdks_see_an_unaccepted_coding_as_a_415_and_do_not_retry(
    gw_session: tuple[Gateway, SessionInfo, list[Any]], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    gw, info, seen = gw_session
    oa = openai.AsyncOpenAI(base_url=info.base_url + "/v1", api_key=info.token, max_retries=2)
    an = anthropic.AsyncAnthropic(base_url=info.base_url, api_key=info.token, max_retries=2)
    async with oa, an:
        for coding in ("br", "zstd", "x-unknown-coding"):
            extra = {"content-encoding": coding}
            with pytest.raises(openai.APIStatusError) as got:
                await oa.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}],
                                                 extra_headers=extra)
            assert got.value.status_code == 415 and "gzip, deflate" in got.value.message
            with pytest.raises(openai.APIStatusError) as got:
                await oa.responses.create(model="m", input="hi", extra_headers=extra)
            assert got.value.status_code == 415 and "gzip, deflate" in got.value.message
            with pytest.raises(anthropic.APIStatusError) as got2:
                await an.messages.create(model="m", max_tokens=16,
                                         messages=[{"role": "user", "content": "hi"}],
                                         extra_headers=extra)
            assert got2.value.status_code == 415 and "gzip, deflate" in got2.value.message
    assert gw.metrics.rejected_by_status == {415: 9}  # one request each: a 415 is not retried
    assert seen == [] and gw.broker.pending_count == 0
    assert _server_trouble(caplog) == []


def _bomb(api: str, inflated: int) -> bytes:
    """A gzip body of the API's, its message ``inflated`` bytes of spaces, built without holding them."""
    head, tail = json.dumps(BODIES[api]).encode().split(b"hi from a compressed body")
    z = zlib.compressobj(wbits=31)
    block = b" " * MiB
    out = [z.compress(head)]
    for _ in range(inflated // MiB):
        out.append(z.compress(block))
    out.append(z.compress(tail))
    out.append(z.flush())
    return b"".join(out)


@pytest.mark.parametrize("api", list(PATHS))
@pytest.mark.parametrize("limit", ["session budget", "max body"])
async def test_a_gzip_bomb_is_a_413_without_inflating_it_whole(
    api: str, limit: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    # The budget case: 8 MiB inflated is under max_body_bytes, over a 1 MiB budget (the inflated size
    # counts, not the compressed Content-Length of about 8 KiB, which would park the body whole).
    kwargs = {"max_parked_bytes_per_session": MiB} if limit == "session budget" else {"max_body_bytes": MiB}
    bomb = _bomb(api, 8 * MiB if limit == "session budget" else 256 * MiB)
    assert len(bomb) < MiB // 2
    async with Gateway(port=0, data_dir=False, **kwargs) as gw, aiohttp.ClientSession() as http:  # type: ignore[arg-type]
        info = await gw.create_session()
        tracemalloc.start()
        try:
            status, _, body = await _post(http, info.base_url + PATHS[api], info.token, bomb, "gzip")
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        assert status == 413, (status, body)
        message = _assert_shape(api, status, body)
        assert f"limit of {MiB} bytes" in message, message
        # Refused once it passed the limit, a piece at a time: never the 8 or 256 MiB in memory.
        assert peak < 6 * MiB, peak
        assert gw.broker.pending_count == 0 and gw.broker.held_bytes_for(info.session_id) == 0
        # The client's next request still works (the rest of the bomb was drained, or the connection closed).
        async with http.get(info.base_url + "/v1/models", headers={"x-api-key": info.token}) as r:
            assert r.status == 200
    assert _server_trouble(caplog) == []
