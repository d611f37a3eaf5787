"""The upstream policy end to end: real SDK agents -> gateway -> PolicyServer -> UpstreamPolicy -> a
local OpenAI-compatible server over loopback; the trajectory carries the server's tokens exactly."""

from __future__ import annotations

from typing import Any

import anthropic
import openai
import pytest

from ares_gateway import Gateway
from ares_gateway.core.canonical import CanonicalRequest, Message, WireProtocol
from ares_gateway.policies import PolicyServer, Prices, UpstreamError, UpstreamPolicy
from tests.helpers import free_port

from .fake_llm import END, FakeLLM, tok


def oai(gw_session: Any) -> openai.AsyncOpenAI:
    # max_retries=0: a retry by the SDK would hide a gateway or policy failure.
    return openai.AsyncOpenAI(base_url=gw_session.base_url + "/v1", api_key=gw_session.token, max_retries=0,
                              timeout=30)


def policy(llm: FakeLLM, **kw: Any) -> UpstreamPolicy:
    return UpstreamPolicy(base_url=llm.url, model="served-model", backoff_initial=0.01, backoff_max=0.05,
                          **kw)


async def two_turns(client: openai.AsyncOpenAI, *, stream: bool = False) -> list[str]:
    msgs: list[dict[str, Any]] = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "hello there"},
    ]
    texts = []
    for follow_up in ("and again", None):
        if stream:
            chunks = []
            s = await client.chat.completions.create(model="agent-label", messages=msgs, stream=True)  # type: ignore[arg-type]
            async for chunk in s:
                if chunk.choices and chunk.choices[0].delta.content:
                    chunks.append(chunk.choices[0].delta.content)
            assert len(chunks) > 1, "the relay should arrive as several deltas"
            text = "".join(chunks)
        else:
            r = await client.chat.completions.create(model="agent-label", messages=msgs)  # type: ignore[arg-type]
            text = r.choices[0].message.content or ""
        texts.append(text)
        msgs.append({"role": "assistant", "content": text})
        if follow_up:
            msgs.append({"role": "user", "content": follow_up})
    return texts


def assert_trajectory_matches_server(gateway: Gateway, session_id: str, llm: FakeLLM) -> None:
    first, last = llm.turns[0], llm.turns[-1]
    # Turn 2's prompt extends turn 1's prompt + output, so the trajectory is one sample.
    assert last.prompt_ids[: len(first.prompt_ids)
                           + len(first.output_ids)] == first.prompt_ids + first.output_ids
    samples = gateway.trajectory(session_id, reward=1.0)
    assert len(samples) == 1
    s = samples[0]
    assert s.tokens.tolist() == last.prompt_ids + last.output_ids
    assert s.prompt_length == len(first.prompt_ids)
    mask = s.loss_mask.tolist()
    lps = s.logprobs.tolist()
    n1 = len(first.output_ids)
    env_len = len(last.prompt_ids) - len(first.prompt_ids) - n1
    assert mask == [1] * n1 + [0] * env_len + [1] * len(last.output_ids)
    assert lps[:n1] == pytest.approx(first.logprobs, abs=1e-6)
    assert lps[n1 + env_len :] == pytest.approx(last.logprobs, abs=1e-6)
    assert all(v == 0.0 for v in lps[n1 : n1 + env_len])
    # The raw turn log keeps the exact token records (no float32 rounding) too.
    log = gateway.turn_log(session_id)
    for turn, served in zip(log, llm.turns, strict=True):
        assert turn["completion"]["tokens"]["prompt_ids"] == served.prompt_ids
        assert turn["completion"]["tokens"]["output_ids"] == served.output_ids
        assert turn["completion"]["tokens"]["output_logprobs"] == served.logprobs


async def test_openai_agent_token_faithful_with_retries(gateway: Gateway, llm: FakeLLM) -> None:
    llm.fail_next = [429, 500, 503]  # the first call succeeds on its 4th attempt
    info = await gateway.create_session()
    async with policy(llm) as pol, PolicyServer(gateway, pol, concurrency=2) as server:
        async with oai(info) as client:
            texts = await two_turns(client)
    assert texts == [llm.turns[0].text, llm.turns[1].text]
    assert llm.hits == 5 and server.stats.answered == 2 and server.stats.failed == 0
    # What went upstream: the served model, the vLLM token-record fields, no stream.
    sent = llm.bodies[-1]
    assert sent["model"] == "served-model"
    assert sent["return_token_ids"] is True and sent["logprobs"] is True and sent["top_logprobs"] == 0
    assert sent["stream"] is False
    assert [m["role"] for m in sent["messages"]] == ["system", "user", "assistant", "user"]
    assert_trajectory_matches_server(gateway, info.session_id, llm)
    attempts = [t["completion"]["extra"]["upstream"]["attempts"] for t in gateway.turn_log(info.session_id)]
    assert attempts == [4, 1]


async def test_streaming_relay_is_token_faithful(gateway: Gateway, llm: FakeLLM) -> None:
    llm.fail_next = [502]  # retried before the stream opens
    info = await gateway.create_session()
    async with policy(llm, stream=True) as pol, PolicyServer(gateway, pol):
        async with oai(info) as client:
            texts = await two_turns(client, stream=True)
    assert texts == [llm.turns[0].text, llm.turns[1].text]
    assert llm.bodies[-1]["stream"] is True and llm.bodies[-1]["stream_options"] == {"include_usage": True}
    assert_trajectory_matches_server(gateway, info.session_id, llm)


async def test_streaming_policy_answers_a_non_streaming_agent(gateway: Gateway, llm: FakeLLM) -> None:
    info = await gateway.create_session()
    async with policy(llm, stream=True) as pol, PolicyServer(gateway, pol):
        async with oai(info) as client:
            texts = await two_turns(client, stream=False)
    assert texts[0] == llm.turns[0].text
    assert_trajectory_matches_server(gateway, info.session_id, llm)


async def test_retries_exhausted_reach_the_agent_as_an_error(gateway: Gateway, llm: FakeLLM) -> None:
    llm.fail_next = [500] * 10
    info = await gateway.create_session()
    async with policy(llm, max_attempts=3) as pol, PolicyServer(gateway, pol) as server:
        with pytest.raises(openai.APIStatusError) as err:
            async with oai(info) as client:
                await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}])
    assert err.value.status_code == 502
    assert "gave up after 3 attempts" in str(err.value)
    assert llm.hits == 3 and server.stats.failed == 1


async def test_client_errors_are_not_retried_and_pass_their_status(gateway: Gateway, llm: FakeLLM) -> None:
    llm.fail_next = [400]
    info = await gateway.create_session()
    async with policy(llm) as pol, PolicyServer(gateway, pol):
        with pytest.raises(openai.BadRequestError):
            async with oai(info) as client:
                await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}])
    assert llm.hits == 1


async def test_unreachable_upstream_gives_502_after_retries(gateway: Gateway) -> None:
    info = await gateway.create_session()
    port = free_port()  # nothing listens there
    pol = UpstreamPolicy(base_url=f"http://127.0.0.1:{port}/v1", model="m", max_attempts=2,
                         backoff_initial=0.01)
    async with pol, PolicyServer(gateway, pol):
        with pytest.raises(openai.APIStatusError) as err:
            async with oai(info) as client:
                await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}])
    assert err.value.status_code == 502 and "cannot reach upstream" in str(err.value)


async def test_token_fields_dropped_for_a_server_that_rejects_them(llm: FakeLLM) -> None:
    llm.reject_token_fields = True
    req = CanonicalRequest(protocol=WireProtocol.OPENAI_CHAT, messages=[Message(role="user", content="hi")])
    async with policy(llm) as pol:
        first = await pol(req)
        second = await pol(req)
    assert first.text == second.text == llm.turns[0].text  # type: ignore[union-attr]
    assert first.tokens is None  # type: ignore[union-attr]
    # Asked once with the fields (rejected), then never again.
    assert ["return_token_ids" in b for b in llm.bodies] == [True, False, False]


async def test_token_fields_can_be_required(llm: FakeLLM) -> None:
    llm.reject_token_fields = True
    req = CanonicalRequest(protocol=WireProtocol.OPENAI_CHAT, messages=[Message(role="user", content="hi")])
    async with policy(llm, token_ids=True) as pol:
        with pytest.raises(UpstreamError) as err:
            await pol(req)
    assert err.value.status == 400 and "return_token_ids" in err.value.message


async def test_cost_per_turn_and_totals(gateway: Gateway, llm: FakeLLM) -> None:
    info = await gateway.create_session()
    prices = Prices(input=2.0, output=10.0)
    async with policy(llm, prices=prices) as pol, PolicyServer(gateway, pol):
        async with oai(info) as client:
            await two_turns(client)
    log = gateway.turn_log(info.session_id)
    for turn, served in zip(log, llm.turns, strict=True):
        want = (len(served.prompt_ids) * 2.0 + len(served.output_ids) * 10.0) / 1e6
        assert turn["completion"]["extra"]["cost_usd"] == pytest.approx(want)
    totals = pol.usage[info.session_id]
    assert totals.turns == 2
    assert totals.input_tokens == sum(len(t.prompt_ids) for t in llm.turns)
    assert totals.cost_usd == pytest.approx(sum(t["completion"]["extra"]["cost_usd"] for t in log))


async def test_anthropic_agent_is_forwarded_as_clean_chat(gateway: Gateway, llm: FakeLLM) -> None:
    """Claude-Code-shaped requests: fields only the Messages API knows never reach the chat server."""
    info = await gateway.create_session()
    client = anthropic.AsyncAnthropic(base_url=info.base_url, api_key=info.token, max_retries=0, timeout=30)
    async with client, policy(llm, max_tokens_cap=1024) as pol, PolicyServer(gateway, pol):
        msg = await client.messages.create(
            model="claude-test",
            max_tokens=32000,
            system=[{"type": "text", "text": "You are Claude Code.", "cache_control": {"type": "ephemeral"}}],
            messages=[{"role": "user", "content": [
                {"type": "text", "text": "fix it", "cache_control": {"type": "ephemeral"}}]}],
            metadata={"user_id": "u1"},
            tools=[
                {"name": "Bash", "description": "run", "input_schema": {"type": "object", "properties": {}}}],
        )
    assert msg.content[0].type == "text" and msg.content[0].text == llm.turns[0].text
    sent = llm.bodies[0]
    assert sent["max_tokens"] == 1024
    assert "metadata" not in sent and "system" not in sent
    assert sent["messages"] == [
        {"role": "system", "content": "You are Claude Code."},
        {"role": "user", "content": "fix it"},
    ]
    assert sent["tools"][0]["function"]["name"] == "Bash"
    samples = gateway.trajectory(info.session_id, reward=0.5)
    assert samples[0].tokens.tolist() == llm.turns[0].prompt_ids + llm.turns[0].output_ids
    assert llm.turns[0].output_ids[-1] == END and llm.turns[0].output_ids[:-1] == tok(llm.turns[0].text)


def test_stream_chunk_deltas_split_tool_call_pieces() -> None:
    from ares_gateway.policies.upstream import _deltas

    got = _deltas(
        {
            "reasoning_content": "think",
            "content": "hi",
            "tool_calls": [{"index": 1, "id": "call_1", "type": "function",
                            "function": {"name": "bash", "arguments": "{\"c"}}],
        }
    )
    assert [d.model_dump(exclude_defaults=True) for d in got] == [
        {"reasoning": "think"},
        {"text": "hi"},
        {"tool_index": 1, "tool_call_id": "call_1", "tool_name": "bash"},
        {"tool_index": 1, "arguments": "{\"c"},
    ]
    assert _deltas(None) == [] and _deltas({"content": ""}) == []


def test_responses_request_body_is_clean_chat() -> None:
    from ares_gateway.protocols import get_adapter

    req = get_adapter("openai.responses").parse_request(
        {
            "model": "gpt-5-codex",
            "instructions": "be",
            "input": [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": "hi"}]}],
            "reasoning": {"effort": "high"},
            "store": False,
            "include": ["reasoning.encrypted_content"],
            "stream": True,
            "tools": [{"type": "function", "name": "shell", "parameters": {"type": "object"}},
                      {"type": "web_search"}],
        }
    )
    body = UpstreamPolicy(base_url="http://127.0.0.1:1/v1", token_ids=False).build_body(req, stream=False)
    assert body == {
        "model": "gpt-5-codex",
        "messages": [{"role": "system", "content": "be"}, {"role": "user", "content": "hi"}],
        "tools": [{"type": "function", "function": {"name": "shell", "parameters": {"type": "object"}}}],
        "stream": False,
    }


async def test_unconsumed_stream_releases_its_connection(llm: FakeLLM) -> None:
    req = CanonicalRequest(protocol=WireProtocol.OPENAI_CHAT, messages=[Message(role="user", content="hi")])
    llm.chunk_delay = 0.2  # the stream is still open when the relay is dropped
    async with policy(llm, stream=True) as pol:
        relay = await pol(req)
        resp = relay._resp  # type: ignore[union-attr]
        assert resp.connection is not None
        await relay.aclose()  # type: ignore[union-attr]
        assert resp.connection is None
        llm.chunk_delay = 0.0
        # A consumed stream ends with the whole completion and its token record.
        items = [item async for item in await pol(req)]  # type: ignore[union-attr]
    final = items[-1]
    assert final.text == llm.turns[-1].text and final.tokens.output_ids.tolist() == llm.turns[-1].output_ids
