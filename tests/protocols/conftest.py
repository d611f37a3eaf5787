"""Fixtures for protocol tests: a loopback aiohttp server that replays encoder bytes to the real SDKs."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import anthropic
import openai
import orjson
import pytest
from aiohttp import web


@dataclass
class Replay:
    """What the next POST gets: a list of byte chunks (SSE) or a JSON body."""

    url: str = ""
    chunks: list[bytes] = field(default_factory=list)
    json_body: Any = None
    status: int = 200
    requests: list[dict[str, Any]] = field(default_factory=list)
    paths: list[str] = field(default_factory=list)

    def sse(self, chunks: list[bytes]) -> None:
        self.chunks, self.json_body, self.status = [c for c in chunks if c], None, 200

    def json(self, body: Any, status: int = 200) -> None:
        self.chunks, self.json_body, self.status = [], body, status

    def openai(self) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=self.url + "/v1", api_key="sk-test", max_retries=0, timeout=10)

    def anthropic(self) -> anthropic.AsyncAnthropic:
        return anthropic.AsyncAnthropic(base_url=self.url, api_key="sk-test", max_retries=0, timeout=10)


@pytest.fixture
async def replay(aiohttp_server: Callable[[web.Application], Awaitable[Any]]) -> Replay:
    r = Replay()

    async def handler(request: web.Request) -> web.StreamResponse:
        r.requests.append(orjson.loads(await request.read()))
        r.paths.append(request.path_qs)
        if r.json_body is not None:
            return web.Response(body=orjson.dumps(r.json_body), status=r.status,
                                content_type="application/json")
        resp = web.StreamResponse(status=200, headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for c in r.chunks:  # one write per encoder call: the SDK sees the deltas arrive separately
            await resp.write(c)
        await resp.write_eof()
        return resp

    app = web.Application()
    app.router.add_route("POST", "/{tail:.*}", handler)
    server = await aiohttp_server(app)
    r.url = str(server.make_url("")).rstrip("/")
    return r
