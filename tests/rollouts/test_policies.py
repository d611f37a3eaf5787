"""PolicyServer and the in-process policies: bounded concurrency, errors to the agent, streams, http."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import openai
import pytest

from ares_gateway import CanonicalRequest, Completion, CompletionDelta, ErrorAnswer, Gateway, ParkedRequest
from ares_gateway.policies import (
    FunctionPolicy,
    HttpPolicy,
    PolicyError,
    PolicyServer,
    UpstreamPolicy,
    as_policy,
    call_policy,
    is_external,
    make_policy,
    policy_names,
    register_policy,
)


def oai(info: Any) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=info.base_url + "/v1", api_key=info.token, max_retries=0, timeout=30)


async def ask(info: Any, text: str, *, stream: bool = False) -> str:
    async with oai(info) as client:
        return await _ask(client, text, stream=stream)


async def _ask(client: openai.AsyncOpenAI, text: str, *, stream: bool) -> str:
    if stream:
        out = []
        s = await client.chat.completions.create(model="m", messages=[{"role": "user", "content": text}],
                                                 stream=True)
        async for chunk in s:
            if chunk.choices and chunk.choices[0].delta.content:
                out.append(chunk.choices[0].delta.content)
        return "".join(out)
    r = await client.chat.completions.create(model="m", messages=[{"role": "user", "content": text}])
    return r.choices[0].message.content or ""


async def test_concurrency_is_bounded(gateway: Gateway) -> None:
    running = 0
    peak = 0
    release = asyncio.Event()

    async def slow(req: ParkedRequest) -> Completion:
        nonlocal running, peak
        running += 1
        peak = max(peak, running)
        await release.wait()
        running -= 1
        return Completion(text="echo: " + req.request.messages[-1].text())

    sessions = [await gateway.create_session() for _ in range(6)]
    async with PolicyServer(gateway, FunctionPolicy(slow), concurrency=2, poll_interval=0.1) as server:
        agents = [asyncio.create_task(ask(s, f"q{i}")) for i, s in enumerate(sessions)]
        for _ in range(100):
            await asyncio.sleep(0.02)
            if gateway.broker.pending_count == 6 and server.stats.in_flight == 2:
                break
        # Two in the policy, four still parked for anyone to take.
        assert server.stats.in_flight == 2 and peak == 2
        release.set()
        answers = await asyncio.gather(*agents)
    assert answers == [f"echo: q{i}" for i in range(6)]
    assert peak == 2 and server.stats.answered == 6


async def test_policy_failures_reach_the_agent(gateway: Gateway) -> None:
    async def policy(req: ParkedRequest) -> Completion:
        text = req.request.messages[-1].text()
        if text == "teapot":
            raise PolicyError("short and stout", status=418)
        if text == "bad-answer":
            return {"not": "a chat completion"}  # type: ignore[return-value]
        if text == "crash":
            raise RuntimeError("boom")
        return Completion(text="ok")

    info = await gateway.create_session()
    async with PolicyServer(gateway, FunctionPolicy(policy)) as server:
        with pytest.raises(openai.APIStatusError) as e418:
            await ask(info, "teapot")
        with pytest.raises(openai.APIStatusError) as e502:
            await ask(info, "crash")
        with pytest.raises(openai.APIStatusError) as invalid:
            await ask(info, "bad-answer")
        assert await ask(info, "fine") == "ok"  # the loop survived all of that
    assert e418.value.status_code == 418 and "short and stout" in str(e418.value)
    assert e502.value.status_code == 502 and "RuntimeError: boom" in str(e502.value)
    assert invalid.value.status_code == 502 and "invalid answer" in str(invalid.value)
    assert server.stats.failed == 3 and server.stats.answered == 1


async def test_async_generator_policy_streams(gateway: Gateway) -> None:
    async def gen(req: CanonicalRequest) -> AsyncIterator[CompletionDelta | Completion]:
        for word in ("one ", "two ", "three"):
            yield CompletionDelta(text=word)
        yield Completion(text="one two three")

    info = await gateway.create_session()
    async with PolicyServer(gateway, FunctionPolicy(gen, canonical=True)):
        assert await ask(info, "count", stream=True) == "one two three"
        assert await ask(info, "count") == "one two three"


async def test_call_policy_normalizes() -> None:
    req = CanonicalRequest(protocol="openai.chat")

    async def text(r: Any) -> str:
        return "hi"

    assert await call_policy(text, req) == Completion(text="hi")
    assert await call_policy(lambda r: ErrorAnswer(429, "slow down"), req) == ErrorAnswer(429, "slow down")
    with pytest.raises(TypeError, match="returned int: return a Completion"):
        await call_policy(lambda r: 3, req)
    # as_policy wraps plain functions, leaves policy objects alone.
    assert isinstance(as_policy(text), FunctionPolicy)
    up = UpstreamPolicy(base_url="http://127.0.0.1:1/v1")
    assert as_policy(up) is up


async def test_http_policy_leaves_requests_parked(gateway: Gateway) -> None:
    pol = make_policy("http")
    assert isinstance(pol, HttpPolicy) and is_external(pol)
    assert "/poll" in pol.describe(gateway.url)
    info = await gateway.create_session()
    async with PolicyServer(gateway, pol):
        agent = asyncio.create_task(ask(info, "for the trainer"))
        req = await gateway.next_request(info.session_id, timeout=10)
        assert req is not None and req.request.messages[-1].text() == "for the trainer"
        # Nobody in process answered it; an external trainer does.
        await gateway.respond(req.id, "from the trainer")
        assert await agent == "from the trainer"
    with pytest.raises(RuntimeError, match="answers nothing in process"):
        pol(req)


def test_policy_registry() -> None:
    assert {"http", "upstream"} <= set(policy_names())
    assert isinstance(make_policy("upstream", base_url="http://127.0.0.1:1/v1", model="x"), UpstreamPolicy)
    register_policy("rollouts-test-echo", lambda **kw: FunctionPolicy(lambda r: "echo"), replace=True)
    assert isinstance(make_policy("rollouts-test-echo"), FunctionPolicy)
    with pytest.raises(ValueError, match="unknown policy 'nope': use one of"):
        make_policy("nope")
    with pytest.raises(ValueError, match="base_url must be an http"):
        UpstreamPolicy(base_url="localhost:8000")
