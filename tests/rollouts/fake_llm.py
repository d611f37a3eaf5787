"""A local OpenAI-compatible chat-completions server that returns vLLM-style token records.

Tokens are deterministic: each message is ``[ROLE] + chars + [END]``, the prompt ends with the
assistant role token, and a reply is ``chars + [END]``, so every turn's prompt extends the previous
turn's prompt + output exactly, as with a real chat template. It can fail on purpose (``fail_next``),
reject the token-record fields like a strict hosted API (``reject_token_fields``), and stream.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

ROLES = {"system": 1, "developer": 1, "user": 2, "assistant": 3, "tool": 4}
END = 9


def tok(text: str) -> list[int]:
    return [100 + ord(c) for c in text]


def content_text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return ""


def prompt_ids(messages: list[dict[str, Any]]) -> list[int]:
    ids: list[int] = []
    for m in messages:
        ids += [ROLES.get(m["role"], 5), *tok(content_text(m.get("content"))), END]
    return [*ids, ROLES["assistant"]]


def logprob(i: int, token: int) -> float:
    return -round(0.001 * ((token * 7 + i) % 97) + 0.001, 6)


@dataclass
class Turn:
    body: dict[str, Any]
    prompt_ids: list[int]
    output_ids: list[int]
    logprobs: list[float]
    text: str


@dataclass
class FakeLLM:
    #: Statuses to answer with before answering properly (consumed one per HTTP request).
    fail_next: list[int] = field(default_factory=list)
    reject_token_fields: bool = False
    #: Seconds between streamed chunks.
    chunk_delay: float = 0.0
    hits: int = 0
    bodies: list[dict[str, Any]] = field(default_factory=list)
    turns: list[Turn] = field(default_factory=list)
    url: str = ""
    _runner: web.AppRunner | None = None

    def reply_for(self, messages: list[dict[str, Any]]) -> str:
        n = sum(1 for m in messages if m["role"] == "assistant")
        last = content_text(messages[-1].get("content"))
        return f"reply {n} to {last[:20]}"

    async def handle(self, request: web.Request) -> web.StreamResponse:
        self.hits += 1
        body = await request.json()
        self.bodies.append(body)
        if self.fail_next:
            status = self.fail_next.pop(0)
            headers = {"retry-after": "0"} if status == 429 else {}
            return web.json_response(
                {"error": {"message": f"injected {status}", "type": "server_error", "code": status}},
                status=status,
                headers=headers,
            )
        if self.reject_token_fields and "return_token_ids" in body:
            return web.json_response(
                {"error": {"message": "Unrecognized request argument supplied: return_token_ids",
                           "type": "invalid_request_error"}},
                status=400,
            )
        messages = body["messages"]
        text = self.reply_for(messages)
        p_ids = prompt_ids(messages)
        out_ids = [*tok(text), END]
        lps = [logprob(i, t) for i, t in enumerate(out_ids)]
        self.turns.append(Turn(body, p_ids, out_ids, lps, text))
        want_tokens = bool(body.get("return_token_ids"))
        usage = {"prompt_tokens": len(p_ids), "completion_tokens": len(out_ids),
                 "total_tokens": len(p_ids) + len(out_ids)}
        if body.get("stream"):
            return await self._stream(request, body, text, p_ids, out_ids, lps, want_tokens, usage)
        choice: dict[str, Any] = {
            "index": 0,
            "message": {"role": "assistant", "content": text},
            "finish_reason": "stop",
            "logprobs": None,
        }
        out: dict[str, Any] = {
            "id": f"chatcmpl-fake{self.hits}",
            "object": "chat.completion",
            "created": 1,
            "model": body["model"],
            "choices": [choice],
            "usage": usage,
        }
        if body.get("logprobs"):
            choice["logprobs"] = {
                "content": [{"token": chr(t - 100) if t >= 100 else "<end>", "logprob": lp, "bytes": None,
                             "top_logprobs": []}
                            for t, lp in zip(out_ids, lps, strict=True)]
            }
        if want_tokens:
            out["prompt_token_ids"] = p_ids
            choice["token_ids"] = out_ids
        return web.json_response(out)

    async def _stream(
        self, request: web.Request, body: dict[str, Any], text: str, p_ids: list[int], out_ids: list[int],
        lps: list[float], want_tokens: bool, usage: dict[str, int],
    ) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await resp.prepare(request)

        async def send(data: dict[str, Any]) -> None:
            await resp.write(f"data: {json.dumps(data)}\n\n".encode())
            if self.chunk_delay:
                await asyncio.sleep(self.chunk_delay)

        base = {"id": f"chatcmpl-fake{self.hits}", "object": "chat.completion.chunk", "created": 1,
                "model": body["model"]}
        first: dict[str, Any] = {**base, "choices": [
            {"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]}
        if want_tokens:
            first["prompt_token_ids"] = p_ids
        await send(first)
        # One chunk per word; the END token rides on the last chunk.
        words = text.split(" ")
        pos = 0
        for w_i, word in enumerate(words):
            piece = word if w_i == 0 else " " + word
            ids = tok(piece)
            if w_i == len(words) - 1:
                ids = [*ids, END]
            choice: dict[str, Any] = {"index": 0, "delta": {"content": piece}, "finish_reason": None}
            if body.get("logprobs"):
                choice["logprobs"] = {
                    "content": [{"token": "x", "logprob": lps[pos + k], "bytes": None, "top_logprobs": []}
                                for k in range(len(ids))]}
            if want_tokens:
                choice["token_ids"] = ids
            pos += len(ids)
            await send({**base, "choices": [choice]})
        await send({**base, "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]})
        await send({**base, "choices": [], "usage": usage})
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    async def start(self) -> None:
        app = web.Application()
        app.router.add_post("/v1/chat/completions", self.handle)
        self._runner = web.AppRunner(app, handle_signals=False)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        self.url = f"http://127.0.0.1:{port}/v1"

    async def close(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()


async def running(llm: FakeLLM) -> AsyncIterator[FakeLLM]:
    await llm.start()
    try:
        yield llm
    finally:
        await llm.close()
