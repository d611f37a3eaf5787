"""SGLang and vLLM engines against aiohttp fakes on 127.0.0.1 that follow the projects' documented schemas.

SGLang ``POST /generate`` (``GenerateReqInput``: ``input_ids``, ``sampling_params``, ``return_logprob``,
``stream``; answer ``meta_info.output_token_logprobs`` = ``[[logprob, token_id, text], ...]``,
``meta_info.finish_reason.type``). vLLM ``POST /inference/v1/generate`` (``token_ids``,
``sampling_params``; answer ``choices[0].token_ids`` / ``logprobs.content[i].logprob``).
Live tests run against real servers when ``ARES_SGLANG_URL`` / ``ARES_VLLM_URL`` are set.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest
from aiohttp import web

from ares_gateway.engines import (
    EngineResponseError,
    EngineUnavailableError,
    GenerateResult,
    PromptTooLongError,
    Sampling,
    TokenChunk,
)
from ares_gateway.engines.sglang import SGLangEngine
from ares_gateway.engines.vllm import VLLMEngine

EOS = 2


def _continuation(prompt: list[int], n: int) -> list[int]:
    """The fake model: counts up from the prompt's last token, then ends with EOS."""
    return [(prompt[-1] + 1 + i) % 1000 + 10 for i in range(n - 1)] + [EOS]


class Fake:
    """Both engines' endpoints; ``fail_first`` answers 503 that many times first; ``mutate`` edits answers."""

    def __init__(self) -> None:
        self.bodies: list[dict[str, Any]] = []
        self.fail_first = 0
        self.mutate: Callable[[dict[str, Any]], None] | None = None
        self.incremental = False
        #: Answer every request with this (status, message) instead.
        self.reject: tuple[int, str] | None = None
        #: SGLang's ``meta_info.weight_version`` (its label of the weights served: a string); ``None``: left
        #: out.
        self.weight_version: Any = None

    def _out(self, body: dict[str, Any], ids_key: str, max_key: str) -> tuple[list[int], str]:
        prompt = body[ids_key]
        n = body["sampling_params"][max_key]
        out = _continuation(prompt, 4)
        if n < len(out):
            return out[:n], "length"
        return out, "stop"

    async def sglang(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.bodies.append(body)
        if self.fail_first > 0:
            self.fail_first -= 1
            return web.Response(status=503, text="warming up")
        if self.reject is not None:
            return web.json_response({"error": {"message": self.reject[1]}}, status=self.reject[0])
        out, reason = self._out(body, "input_ids", "max_new_tokens")
        lps = [[-0.25 * (i + 1), t, None] for i, t in enumerate(out)]
        fr = {"type": reason, "length": len(out)} if reason == "length" else {"type": "stop", "matched": EOS}

        def answer(upto: int, start: int = 0) -> dict[str, Any]:
            return {
                "text": "...",
                "output_ids": out[start:upto],
                "meta_info": {
                    "id": "rid-1", "prompt_tokens": len(body["input_ids"]), "completion_tokens": upto,
                    "cached_tokens": 3, "output_token_logprobs": lps[start:upto],
                    "finish_reason": fr if upto == len(out) else None,
                    **({} if self.weight_version is None else {"weight_version": self.weight_version}),
                },
            }

        if not body.get("stream"):
            data = answer(len(out))
            if self.mutate:
                self.mutate(data)
            return web.json_response(data)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for k in range(1, len(out) + 1):
            chunk = answer(k, k - 1) if self.incremental else answer(k)
            await resp.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
        await resp.write(b"data: [DONE]\n\n")
        return resp

    async def vllm(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.bodies.append(body)
        if self.fail_first > 0:
            self.fail_first -= 1
            return web.Response(status=503, text="warming up")
        out, reason = self._out(body, "token_ids", "max_tokens")
        data = {
            "request_id": "gen-1",
            "choices": [{
                "index": 0, "token_ids": out, "finish_reason": reason,
                "logprobs": {
                    "content": [{"token": f"token_id:{t}", "logprob": -0.5, "bytes": None} for t in out]},
            }],
            "usage": {"prompt_tokens": len(body["token_ids"]), "completion_tokens": len(out),
                      "prompt_tokens_details": {"cached_tokens": 2}},
        }
        if self.mutate:
            self.mutate(data)
        return web.json_response(data)


@contextlib.asynccontextmanager
async def serve_fake() -> AsyncIterator[tuple[Fake, str]]:
    """A :class:`Fake` serving SGLang's ``/generate`` and vLLM's ``/inference/v1/generate`` on a free
    loopback port: the fake and its URL."""
    f = Fake()
    app = web.Application()
    app.router.add_post("/generate", f.sglang)
    app.router.add_post("/inference/v1/generate", f.vllm)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    try:
        yield f, f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()


@pytest.fixture
async def fake() -> AsyncIterator[tuple[Fake, str]]:
    async with serve_fake() as served:
        yield served


SAMPLING = Sampling(max_tokens=16, temperature=0.7, top_p=0.9, top_k=20, seed=7, stop_token_ids=(EOS,))


async def test_sglang_request_and_answer_follow_the_schema(fake: tuple[Fake, str]) -> None:
    f, url = fake
    eng = SGLangEngine(url, model="m")
    try:
        res = await eng.generate([5, 6, 7], SAMPLING)
    finally:
        await eng.aclose()
    body = f.bodies[-1]
    assert body["input_ids"] == [5, 6, 7] and body["return_logprob"] is True and body["stream"] is False
    sp = body["sampling_params"]
    assert (sp["max_new_tokens"], sp["temperature"], sp["top_p"], sp["top_k"]) == (16, 0.7, 0.9, 20)
    assert sp["stop_token_ids"] == [EOS] and sp["sampling_seed"] == 7 and sp["skip_special_tokens"] is False
    assert res.output_ids == _continuation([5, 6, 7], 4)
    assert res.logprobs == [-0.25, -0.5, -0.75, -1.0]
    assert (res.finish_reason, res.prompt_tokens, res.cached_tokens) == ("stop", 3, 3)


@pytest.mark.parametrize("stream", [False, True])
async def test_sglang_weight_version_is_the_results_version(fake: tuple[Fake, str], stream: bool) -> None:
    f, url = fake
    eng = SGLangEngine(url, model="m")
    got = []
    try:
        # A decimal label (or a number) is a version; SGLang's default label and any other are none.
        for label in ("12", 5, "default", "v5", "-1", None):
            f.weight_version = label
            if stream:
                items = [x async for x in eng.stream([5, 6, 7], SAMPLING)]
                res = items[-1]
                assert isinstance(res, GenerateResult)
            else:
                res = await eng.generate([5, 6, 7], SAMPLING)
            got.append(res.weight_version)
    finally:
        await eng.aclose()
    assert got == [12, 5, None, None, None, None]


@pytest.mark.parametrize("incremental", [False, True])
async def test_sglang_streams_cumulative_or_incremental_chunks(fake: tuple[Fake, str],
                                                               incremental: bool) -> None:
    f, url = fake
    f.incremental = incremental
    eng = SGLangEngine(url)
    chunks: list[int] = []
    result: GenerateResult | None = None
    try:
        async for item in eng.stream([5, 6, 7], SAMPLING):
            if isinstance(item, TokenChunk):
                chunks.extend(item.ids)
            else:
                result = item
    finally:
        await eng.aclose()
    assert result is not None and f.bodies[-1]["stream"] is True
    assert chunks == result.output_ids == _continuation([5, 6, 7], 4)
    assert result.logprobs == [-0.25, -0.5, -0.75, -1.0]


async def test_vllm_request_and_answer_follow_the_schema(fake: tuple[Fake, str]) -> None:
    f, url = fake
    eng = VLLMEngine(url, model="Qwen/Qwen3-0.6B")
    try:
        res = await eng.generate([5, 6, 7], SAMPLING)
        short = await eng.generate([5, 6, 7], Sampling(max_tokens=2))
    finally:
        await eng.aclose()
    body = f.bodies[0]
    assert body["model"] == "Qwen/Qwen3-0.6B" and body["token_ids"] == [5, 6, 7]
    sp = body["sampling_params"]
    assert (sp["max_tokens"], sp["temperature"], sp["top_p"], sp["top_k"], sp["seed"]) == (16, 0.7, 0.9, 20,
                                                                                           7)
    assert sp["logprobs"] == 1 and sp["stop_token_ids"] == [EOS]
    assert res.output_ids == _continuation([5, 6, 7], 4) and res.logprobs == [-0.5] * 4
    assert (res.finish_reason, res.cached_tokens) == ("stop", 2)
    assert short.finish_reason == "length" and len(short.output_ids) == 2
    assert f.bodies[1]["sampling_params"]["top_k"] == -1  # 0 (off) is sent as vLLM's "off"


@pytest.mark.parametrize("engine_cls", [SGLangEngine, VLLMEngine])
async def test_retries_then_gives_up_with_a_clear_error(fake: tuple[Fake, str], engine_cls: type) -> None:
    f, url = fake
    eng = engine_cls(url, max_attempts=3, backoff_s=0.01)
    try:
        f.fail_first = 2
        res = await eng.generate([1, 2], SAMPLING)
        assert res.output_ids and eng.retries == 2
        f.fail_first = 5
        with pytest.raises(EngineUnavailableError, match=r"HTTP 503.*after 3 attempts"):
            await eng.generate([1, 2], SAMPLING)
    finally:
        await eng.aclose()


@pytest.mark.parametrize("stream", [False, True])
async def test_sglang_context_overflow_is_a_prompt_too_long_error(fake: tuple[Fake, str],
                                                                  stream: bool) -> None:
    f, url = fake
    eng = SGLangEngine(url, max_attempts=1)

    async def call() -> None:
        if stream:
            async for _ in eng.stream([1, 2], SAMPLING):
                pass
        else:
            await eng.generate([1, 2], SAMPLING)

    try:
        # SGLang's own wording (tokenizer_manager), as ares' EngineServer's in test_engine_server.py.
        f.reject = (400, "The input (4100 tokens) is longer than the model's context length (4096 tokens).")
        with pytest.raises(PromptTooLongError) as info:
            await call()
        assert (info.value.prompt_tokens, info.value.context) == (4100, 4096)
        f.reject = (400, "something else is wrong")
        with pytest.raises(EngineResponseError, match=r"HTTP 400: .*something else"):
            await call()
    finally:
        await eng.aclose()


@pytest.mark.parametrize("engine_cls", [SGLangEngine, VLLMEngine])
async def test_unreachable_engine(engine_cls: type) -> None:
    eng = engine_cls("http://127.0.0.1:9", max_attempts=2, backoff_s=0.01)
    try:
        with pytest.raises(EngineUnavailableError, match="after 2 attempts"):
            await eng.generate([1, 2], SAMPLING)
    finally:
        await eng.aclose()


def _drop_logprobs_sglang(d: dict[str, Any]) -> None:
    del d["meta_info"]["output_token_logprobs"]


def _wrong_ids_sglang(d: dict[str, Any]) -> None:
    d["output_ids"] = [999, *d["output_ids"][1:]]


def _abort_sglang(d: dict[str, Any]) -> None:
    d["meta_info"]["finish_reason"] = {"type": "abort", "message": "out of memory"}


def _short_logprobs_vllm(d: dict[str, Any]) -> None:
    d["choices"][0]["logprobs"]["content"].pop()


def _sentinel_vllm(d: dict[str, Any]) -> None:
    d["choices"][0]["logprobs"]["content"][0]["logprob"] = -9999.0


def _other_token_vllm(d: dict[str, Any]) -> None:
    d["choices"][0]["logprobs"]["content"][1]["token"] = "token_id:123456"


@pytest.mark.parametrize(
    ("engine_cls", "mutate", "match"),
    [
        (SGLangEngine, _drop_logprobs_sglang, "output_token_logprobs is missing"),
        (SGLangEngine, _wrong_ids_sglang, "name different tokens"),
        (SGLangEngine, _abort_sglang, "out of memory"),
        (VLLMEngine, _short_logprobs_vllm, "4 token ids but 3 logprob entries"),
        (VLLMEngine, _sentinel_vllm, "not a usable number"),
        (VLLMEngine, _other_token_vllm, "token_id:123456"),
    ],
)
async def test_schema_violations_are_engine_response_errors(
    fake: tuple[Fake, str], engine_cls: type, mutate: Callable[[dict[str, Any]], None], match: str
) -> None:
    f, url = fake
    f.mutate = mutate
    eng = engine_cls(url)
    try:
        with pytest.raises(EngineResponseError, match=match):
            await eng.generate([5, 6, 7], SAMPLING)
    finally:
        await eng.aclose()


def _live(var: str) -> str:
    url = os.environ.get(var)
    if not url:
        pytest.skip(f"set {var} to run against a live server")
    return url


@pytest.mark.parametrize(("var", "engine_cls"),
                         [("ARES_SGLANG_URL", SGLangEngine), ("ARES_VLLM_URL", VLLMEngine)])
async def test_live_server(var: str, engine_cls: type) -> None:
    url = _live(var)
    eng = engine_cls(url, model=os.environ.get("ARES_LIVE_MODEL", ""))
    try:
        res = await eng.generate([1, 2, 3, 4, 5, 6, 7, 8], Sampling(max_tokens=8, temperature=1.0))
    finally:
        await eng.aclose()
    assert 1 <= len(res.output_ids) <= 8 and len(res.logprobs) == len(res.output_ids)
    assert all(lp <= 0.0 for lp in res.logprobs)
