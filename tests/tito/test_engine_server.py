"""EngineServer: the real llama.cpp engine served as SGLang's ``/generate``, read by the real SGLangEngine
client.

Everything over loopback (127.0.0.1). What the client gets must be what the engine samples when called
directly with the same seed: the same ids, the same logprobs (exactly: JSON carries floats losslessly),
streamed or not; a request that breaks the protocol is a 400 JSON error, never a 500.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest

from ares_gateway.core.canonical import Message
from ares_gateway.engines import (
    EngineUnavailableError,
    GenerateResult,
    PromptTooLongError,
    Sampling,
    TokenChunk,
)
from ares_gateway.engines.engine_server import EngineServer
from ares_gateway.engines.sglang import SGLangEngine

TOKEN = "test-token-1"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


@pytest.fixture
async def served(llama_engine: Any) -> AsyncIterator[tuple[Any, EngineServer, SGLangEngine]]:
    server = EngineServer(llama_engine, api_key=TOKEN, max_body_bytes=64 * 1024)
    await server.start()
    client = SGLangEngine(server.url, model="smollm2", headers=AUTH, max_attempts=1)
    try:
        yield llama_engine, server, client
    finally:
        await client.aclose()
        await server.close()


def _prompt(smol_renderer: Any, text: str) -> list[int]:
    return list(smol_renderer.render(
        smol_renderer.template_messages([Message(role="user", content=text)])).prompt_ids)


async def test_the_client_gets_exactly_what_the_engine_samples(served: Any, smol_renderer: Any) -> None:
    engine, server, client = served
    assert server.url.startswith("http://127.0.0.1:") and server.port > 0
    stop = tuple(smol_renderer.stop_token_ids)
    prompt = _prompt(smol_renderer, "Write a haiku about the sea.")
    cases = [
        Sampling(max_tokens=24, temperature=1.0, seed=11, stop_token_ids=stop),
        Sampling(max_tokens=24, temperature=0.7, top_p=0.9, top_k=20, seed=5, stop_token_ids=stop),
        Sampling(max_tokens=40, temperature=0.0, stop_token_ids=stop),  # greedy
        Sampling(max_tokens=6, seed=3),  # no stop token: ends at max_tokens
    ]
    for s in cases:
        direct = await engine.generate(prompt, s)
        remote = await client.generate(prompt, s)
        assert remote.output_ids == direct.output_ids and remote.logprobs == direct.logprobs, s
        assert remote.finish_reason == direct.finish_reason and remote.prompt_tokens == len(prompt)
        assert remote.extra["id"]  # the request id SGLang answers with
    short = _prompt(smol_renderer, "What is 2+2? Answer with a number.")
    assert (await client.generate(short, cases[2])).finish_reason == "stop"  # greedy: ends at the stop token
    assert (await client.generate(prompt, cases[3])).finish_reason == "length"

    # The raw answer follows SGLang's schema (what other SGLang clients read too).
    async with aiohttp.ClientSession(headers=AUTH) as http:
        body = client._body(short, cases[2], False)
        async with http.post(server.url + "/generate", json={**body, "rid": "r-1"}) as resp:
            assert resp.status == 200
            data = await resp.json()
        meta = data["meta_info"]
        direct = await engine.generate(short, cases[2])
        assert data["output_ids"] == direct.output_ids and meta["id"] == "r-1"
        assert meta["completion_tokens"] == len(direct.output_ids) and meta["prompt_tokens"] == len(short)
        assert meta["finish_reason"] == {"type": "stop", "matched": direct.output_ids[-1]}
        assert [e[:2] for e in meta["output_token_logprobs"]] == [[lp, t] for t, lp in
                                                                  zip(direct.output_ids, direct.logprobs,
                                                                      strict=True)]
        assert isinstance(meta["sampling_seed"], int)  # drawn by the engine (the request set none)
    # The seed the engine sampled with reaches the client's result (the turn record keeps it).
    assert (await client.generate(prompt, cases[0])).extra["seed"] == 11
    async with aiohttp.ClientSession(headers=AUTH) as http:
        async with http.get(server.url + "/get_model_info") as resp:
            assert (await resp.json())["is_generation"] is True
    assert server.generations == 8  # every request above was one generation


@pytest.mark.parametrize("incremental", [False, True])
async def test_streaming_equals_not_streaming(llama_engine: Any, smol_renderer: Any,
                                              incremental: bool) -> None:
    server = EngineServer(llama_engine, incremental_streaming=incremental)
    await server.start()
    client = SGLangEngine(server.url, max_attempts=1)
    try:
        prompt = _prompt(smol_renderer, "Name three colors.")
        for s in (Sampling(max_tokens=32, seed=21, stop_token_ids=tuple(smol_renderer.stop_token_ids)),
                  Sampling(max_tokens=9, temperature=0.8, top_k=40, seed=2)):
            whole = await client.generate(prompt, s)
            chunks: list[TokenChunk] = []
            result: GenerateResult | None = None
            async for item in client.stream(prompt, s):
                if isinstance(item, GenerateResult):
                    result = item
                else:
                    chunks.append(item)
            assert result is not None and len(chunks) > 1  # token by token, not one lump at the end
            assert [t for c in chunks for t in c.ids] == result.output_ids == whole.output_ids
            assert [x for c in chunks for x in c.logprobs] == result.logprobs == whole.logprobs
            assert result.finish_reason == whole.finish_reason
            direct = await llama_engine.generate(prompt, s)
            assert direct.output_ids == whole.output_ids and direct.logprobs == whole.logprobs
    finally:
        await client.aclose()
        await server.close()


BAD_BODIES: list[tuple[Any, str]] = [
    ([1, 2, 3], "JSON object"),
    ({}, "input_ids"),
    ({"input_ids": []}, "input_ids"),
    ({"text": "hello"}, "not text"),
    ({"input_ids": [[1, 2], [3]]}, "batched"),
    ({"input_ids": [1, -2]}, "input_ids[1]"),
    ({"input_ids": [1, 10**9]}, "vocabulary size"),
    ({"input_ids": [1, "2"]}, "input_ids[1]"),
    ({"input_ids": [1, True]}, "input_ids[1]"),
    ({"input_ids": [1], "sampling_params": []}, "sampling_params must be an object"),
    ({"input_ids": [1], "sampling_params": {"max_new_tokens": 0}}, "max_new_tokens"),
    ({"input_ids": [1], "sampling_params": {"max_new_tokens": "8"}}, "max_new_tokens"),
    ({"input_ids": [1], "sampling_params": {"temperature": -1}}, "temperature"),
    ({"input_ids": [1], "sampling_params": {"temperature": "hot"}}, "temperature"),
    ({"input_ids": [1], "sampling_params": {"top_p": 0}}, "top_p"),
    ({"input_ids": [1], "sampling_params": {"top_k": -5}}, "top_k"),
    ({"input_ids": [1], "sampling_params": {"sampling_seed": -1}}, "sampling_seed"),
    ({"input_ids": [1], "sampling_params": {"stop_token_ids": [1, "x"]}}, "stop_token_ids"),
    ({"input_ids": [1], "sampling_params": {"frequency_penalty": 0.5}}, "frequency_penalty"),
    ({"input_ids": [1], "sampling_params": {"stop": ["\n"]}}, "stop"),
    ({"input_ids": [1], "sampling_params": {"beam_width": 4}}, "beam_width"),
    ({"input_ids": [1], "logprob_start_len": 0}, "input-token logprobs"),
    ({"input_ids": [1], "top_logprobs_num": 5}, "top_logprobs_num"),
    ({"input_ids": [1], "stream": "yes"}, "stream"),
    ({"input_ids": [1], "rid": 7}, "rid"),
    ({"input_ids": [1], "lora_path": "adapters/x"}, "lora_path"),
]


async def test_bad_requests_are_400s_with_the_reason(served: Any, smol_renderer: Any) -> None:
    engine, server, client = served
    async with aiohttp.ClientSession(headers=AUTH) as http:
        async def post(data: bytes) -> tuple[int, Any]:
            async with http.post(server.url + "/generate", data=data,
                                 headers={"Content-Type": "application/json"}) as resp:
                text = await resp.text()
                return resp.status, json.loads(text)

        status, doc = await post(b"{not json")
        assert status == 400 and "not JSON" in doc["error"]["message"]
        status, doc = await post(b"\xff\xfe")
        assert status == 400
        for body, fragment in BAD_BODIES:
            status, doc = await post(json.dumps(body).encode())
            assert status == 400, (body, doc)
            assert fragment in doc["error"]["message"], (body, doc)
        # Neutral values of options the engine does not implement are accepted (clients send them).
        ok = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 2, "frequency_penalty": 0.0,
                                                          "repetition_penalty": 1.0, "stop": [], "n": 1,
                                                          "skip_special_tokens": False, "sampling_seed": 1},
              "return_logprob": True, "logprob_start_len": -1, "return_hidden_states": False}
        status, doc = await post(json.dumps(ok).encode())
        assert status == 200 and doc["meta_info"]["completion_tokens"] == 2
        # Too large a body: 413, JSON, before it is parsed.
        status, doc = await post(json.dumps({"input_ids": [1] * 40_000}).encode())
        assert status == 413 and "max_body_bytes" in doc["error"]["message"]
        # Unknown routes and methods are JSON errors too.
        async with http.get(server.url + "/generate") as resp:
            assert resp.status == 405 and "error" in await resp.json()
        async with http.get(server.url + "/nope") as resp:
            assert resp.status == 404 and "error" in await resp.json()
    # No token, a wrong one: 401; /health needs none.
    async with aiohttp.ClientSession() as anon:
        async with anon.post(server.url + "/generate", json={"input_ids": [1]}) as resp:
            assert resp.status == 401 and "Bearer" in (await resp.json())["error"]["message"]
        async with anon.post(server.url + "/generate", json={"input_ids": [1]},
                             headers={"Authorization": "Bearer wrong"}) as resp:
            assert resp.status == 401
        async with anon.get(server.url + "/health") as resp:
            assert resp.status == 200
    # Through the client: a prompt longer than the engine's context is a 400, the client's PromptTooLongError
    # (the in-process engine's error: the policy answers the agent alike).
    with pytest.raises(PromptTooLongError) as info:
        await client.generate([1] * (engine.n_ctx + 5), Sampling(max_tokens=4))
    assert (info.value.prompt_tokens, info.value.context) == (engine.n_ctx + 5, engine.n_ctx)
    async with aiohttp.ClientSession(headers=AUTH) as http:
        async with http.post(server.url + "/generate", json={"input_ids": [1] * (engine.n_ctx + 5)}) as resp:
            assert resp.status == 400 and "context holds" in (await resp.json())["error"]["message"]
    # The server still answers normally afterwards.
    prompt = _prompt(smol_renderer, "hi")
    s = Sampling(max_tokens=4, seed=9)
    assert (await client.generate(prompt, s)).output_ids == (await engine.generate(prompt, s)).output_ids


class _Announcing:
    """The real engine, announcing when a generation starts."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.name = engine.name
        self.model = engine.model
        self.started = asyncio.Event()

    async def generate(self, prompt_ids: Any, sampling: Sampling) -> GenerateResult:
        self.started.set()
        return await self.engine.generate(prompt_ids, sampling)  # type: ignore[no-any-return]


async def test_requests_beyond_max_requests_are_503s(llama_engine: Any, smol_renderer: Any) -> None:
    engine = _Announcing(llama_engine)
    server = EngineServer(engine, max_requests=1)  # type: ignore[arg-type]
    await server.start()
    client = SGLangEngine(server.url, max_attempts=1)
    try:
        prompt = _prompt(smol_renderer, "Tell me a long story about a lighthouse keeper.")
        long = asyncio.create_task(client.generate(prompt, Sampling(max_tokens=300, seed=1)))
        await asyncio.wait_for(engine.started.wait(), timeout=60)  # the first request is in the engine
        with pytest.raises(EngineUnavailableError, match=r"HTTP 503.*max_requests"):
            await client.generate(prompt, Sampling(max_tokens=2, seed=1))
        assert len((await long).output_ids) > 0
        assert len((await client.generate(prompt, Sampling(max_tokens=2, seed=1))).output_ids) == 2
    finally:
        await client.aclose()
        await server.close()


def test_limits_are_checked() -> None:
    with pytest.raises(ValueError, match="max_body_bytes"):
        EngineServer(object(), max_body_bytes=10)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="max_requests"):
        EngineServer(object(), max_requests=0)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="api_key"):
        EngineServer(object(), api_key="")  # type: ignore[arg-type]
    with pytest.raises(RuntimeError, match="not started"):
        _ = EngineServer(object()).url  # type: ignore[arg-type]


async def test_the_engines_weight_label_reaches_the_client(served: Any, smol_renderer: Any) -> None:
    import pickle

    engine, _server, client = served
    prompt = _prompt(smol_renderer, "Hi.")
    s = Sampling(max_tokens=3, seed=1)
    assert (await client.generate(prompt, s)).weight_version is None  # unlabelled: no version sent
    engine.set_weight_version(7)
    assert (await engine.generate(prompt, s)).weight_version == 7
    assert (await client.generate(prompt, s)).weight_version == 7
    streamed = [item async for item in client.stream(prompt, s)]
    assert isinstance(streamed[-1], GenerateResult) and streamed[-1].weight_version == 7
    assert pickle.loads(pickle.dumps(engine)).weight_version == 7  # a copy for another node keeps the label
