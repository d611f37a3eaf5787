"""The official openai and anthropic SDKs against a real gateway over loopback HTTP.

Each test runs twice: answered by a separate-process-style HTTP poller (/poll + /respond)
and in process through GatewayEnv. What the SDK parses must equal what the policy sent.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from typing import Any

import anthropic
import openai
import pytest

from ares_gateway import Completion, Gateway, GatewayEnv, SessionInfo, StepType

from .conftest import http_responder

MODES = ["http", "env"]


async def drive(
    mode: str,
    gateway: Gateway,
    session: SessionInfo,
    answers: list[dict[str, Any]],
    agent: Callable[[], Awaitable[Any]],
) -> tuple[Any, list[dict[str, Any]]]:
    """Run ``agent()`` while a policy answers its requests with ``answers`` in order.

    Each answer is a /respond payload: {"completion": {...}} or {"response": {...}} or {"error": {...}}.
    Returns the agent's result and the polled items (observations) the policy saw.
    """
    queue = list(answers)
    if mode == "http":

        def answer(item: dict[str, Any]) -> dict[str, Any]:
            return queue.pop(0)

        async with http_responder(gateway, answer) as seen:
            result = await asyncio.wait_for(agent(), 20)
        return result, seen

    env = GatewayEnv(gateway, session_id=session.session_id, request_timeout=20)
    observations: list[dict[str, Any]] = []

    async def policy() -> Any:
        ts = await env.reset()
        assert ts.step_type is StepType.FIRST and ts.reward is None and ts.discount is None
        while not ts.last():
            assert ts.observation is not None
            observations.append(ts.observation.poll_item())
            payload = queue.pop(0)
            if "completion" in payload:
                action: Any = Completion.model_validate(payload["completion"])
            else:
                action = payload["response"]
            ts = await env.step(action)
        return ts

    policy_task = asyncio.create_task(policy())
    result = await asyncio.wait_for(agent(), 20)
    await gateway.end_session(session.session_id, reward=1.0)
    last = await asyncio.wait_for(policy_task, 5)
    assert last.step_type is StepType.LAST and last.reward == 1.0 and last.discount == 0.0
    return result, observations


def oai(session: SessionInfo) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{session.base_url}/v1", api_key=session.token, max_retries=0)


def ant(session: SessionInfo) -> anthropic.AsyncAnthropic:
    return anthropic.AsyncAnthropic(base_url=session.base_url, api_key=session.token, max_retries=0)


TOOLS_CHAT = [
    {
        "type": "function",
        "function": {
            "name": "bash",
            "description": "run a command",
            "parameters": {"type": "object", "properties": {"command": {"type": "string"}},
                           "required": ["command"]},
        },
    }
]
TWO_CALLS = [
    {"id": "call_a", "name": "bash", "arguments": json.dumps({"command": "ls -la"})},
    {"id": "call_b", "name": "bash", "arguments": json.dumps({"command": "echo 'hi there'"})},
]


# ---------------------------------------------------------------- chat completions


@pytest.mark.parametrize("mode", MODES)
async def test_chat_non_stream_text(mode: str, gateway: Gateway, session: SessionInfo) -> None:
    async def agent() -> Any:
        return await oai(session).chat.completions.create(
            model="m", messages=[{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
        )

    resp, seen = await drive(
        mode, gateway, session,
        [{"completion": {"text": "hello there", "usage": {"input_tokens": 7, "output_tokens": 2}}}], agent
    )
    assert resp.choices[0].message.content == "hello there"
    assert resp.choices[0].finish_reason == "stop"
    assert resp.usage.prompt_tokens == 7 and resp.usage.completion_tokens == 2
    item = seen[0]
    assert item["protocol"] == "openai.chat" and item["session_id"] == session.session_id
    assert item["request"]["messages"][1] == {"role": "user", "content": "hi"}
    assert [m["role"] for m in item["canonical"]["messages"]] == ["system", "user"]
    assert item["attempt"] == 1 and item["timestamp"] > 0


@pytest.mark.parametrize("mode", MODES)
async def test_chat_stream_with_usage(mode: str, gateway: Gateway, session: SessionInfo) -> None:
    async def agent() -> Any:
        stream = await oai(session).chat.completions.create(
            model="m",
            messages=[{"role": "user", "content": "count"}],
            stream=True,
            stream_options={"include_usage": True},
        )
        chunks = [c async for c in stream]
        return chunks

    text = "one, two, three — ünïcode ✓"
    chunks, _ = await drive(
        mode, gateway, session,
        [{"completion": {"text": text, "usage": {"input_tokens": 3, "output_tokens": 9}}}], agent
    )
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    assert [c.choices[0].finish_reason for c in chunks if c.choices
            and c.choices[0].finish_reason] == ["stop"]
    usage = [c.usage for c in chunks if c.usage]
    assert usage and usage[-1].completion_tokens == 9


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("stream", [False, True])
async def test_chat_parallel_tool_calls(mode: str, stream: bool, gateway: Gateway,
                                        session: SessionInfo) -> None:
    async def agent() -> Any:
        client = oai(session)
        kwargs: dict[str, Any] = {"model": "m", "messages": [{"role": "user", "content": "go"}],
                                  "tools": TOOLS_CHAT}
        if not stream:
            r = await client.chat.completions.create(**kwargs)
            return r.choices[0].message.tool_calls, r.choices[0].finish_reason
        calls: dict[int, dict[str, str]] = {}
        finish = None
        async for chunk in await client.chat.completions.create(stream=True, **kwargs):
            for d in chunk.choices[0].delta.tool_calls or []:
                slot = calls.setdefault(d.index, {"id": "", "name": "", "arguments": ""})
                slot["id"] += d.id or ""
                slot["name"] += (d.function.name or "") if d.function else ""
                slot["arguments"] += (d.function.arguments or "") if d.function else ""
            finish = chunk.choices[0].finish_reason or finish
        return [calls[i] for i in sorted(calls)], finish

    (calls, finish), seen = await drive(
        mode, gateway, session, [{"completion": {"tool_calls": TWO_CALLS, "finish_reason": "tool_calls"}}],
        agent
    )
    assert finish == "tool_calls"
    got = [(c.id, c.function.name, c.function.arguments) if not stream
           else (c["id"], c["name"], c["arguments"]) for c in calls]
    assert got == [(c["id"], c["name"], c["arguments"]) for c in TWO_CALLS]
    assert seen[0]["canonical"]["tools"][0]["name"] == "bash"


# ---------------------------------------------------------------- responses


@pytest.mark.parametrize("mode", MODES)
async def test_responses_non_stream_function_calls(mode: str, gateway: Gateway, session: SessionInfo) -> None:
    async def agent() -> Any:
        return await oai(session).responses.create(
            model="gpt-5",
            input=[
                {"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "sys"}]},
                {"type": "message", "role": "user",
                 "content": [{"type": "input_text", "text": "list files"}]},
            ],
            tools=[{"type": "function", "name": "exec_command",
                    "parameters": {"type": "object", "properties": {}}}],
        )

    calls = [
        {"id": "call_1", "name": "exec_command", "arguments": '{"cmd":"ls"}'},
        {"id": "call_2", "name": "exec_command", "arguments": '{"cmd":"pwd"}'},
    ]
    resp, seen = await drive(
        mode, gateway, session,
        [{"completion": {"text": "running", "tool_calls": calls, "finish_reason": "tool_calls"}}], agent
    )
    fcs = [o for o in resp.output if o.type == "function_call"]
    assert [(f.call_id, f.name, f.arguments) for f in fcs] == [(c["id"], c["name"], c["arguments"])
                                                               for c in calls]
    assert resp.output_text == "running"
    assert seen[0]["protocol"] == "openai.responses"
    assert [m["role"] for m in seen[0]["canonical"]["messages"]] == ["developer", "user"]


@pytest.mark.parametrize("mode", MODES)
async def test_responses_stream(mode: str, gateway: Gateway, session: SessionInfo) -> None:
    async def agent() -> Any:
        deltas: list[str] = []
        async with oai(session).responses.stream(model="gpt-5", input="say hi") as stream:
            async for event in stream:
                if event.type == "response.output_text.delta":
                    deltas.append(event.delta)
            final = await stream.get_final_response()
        return deltas, final

    (deltas, final), _ = await drive(
        mode,
        gateway,
        session,
        [{"completion": {"text": "hi from the policy", "tool_calls": [
            {"id": "c9", "name": "f", "arguments": "{}"}], "finish_reason": "tool_calls"}}],
        agent,
    )
    assert "".join(deltas) == "hi from the policy" == final.output_text
    assert [(o.call_id, o.name) for o in final.output if o.type == "function_call"] == [("c9", "f")]


# ---------------------------------------------------------------- anthropic messages


@pytest.mark.parametrize("mode", MODES)
async def test_anthropic_create_tool_use(mode: str, gateway: Gateway, session: SessionInfo) -> None:
    async def agent() -> Any:
        return await ant(session).messages.create(
            model="claude-x",
            max_tokens=1000,
            system=[{"type": "text", "text": "you are an agent", "cache_control": {"type": "ephemeral"}}],
            messages=[{"role": "user", "content": "list files"}],
            tools=[{"name": "Bash", "description": "run",
                    "input_schema": {"type": "object", "properties": {"command": {"type": "string"}}}}],
        )

    calls = [
        {"id": "toolu_1", "name": "Bash", "arguments": '{"command": "ls"}'},
        {"id": "toolu_2", "name": "Bash", "arguments": '{"command": "cat x"}'},
    ]
    msg, seen = await drive(
        mode, gateway, session,
        [{"completion": {"text": "ok", "tool_calls": calls, "finish_reason": "tool_calls"}}], agent
    )
    assert msg.stop_reason == "tool_use"
    assert [b.type for b in msg.content] == ["text", "tool_use", "tool_use"]
    assert [(b.id, b.name, b.input) for b in msg.content if b.type == "tool_use"] == [
        ("toolu_1", "Bash", {"command": "ls"}),
        ("toolu_2", "Bash", {"command": "cat x"}),
    ]
    canon = seen[0]["canonical"]
    assert canon["messages"][0]["role"] == "system" and seen[0]["protocol"] == "anthropic.messages"


@pytest.mark.parametrize("mode", MODES)
async def test_anthropic_stream_thinking_text_tool(mode: str, gateway: Gateway, session: SessionInfo) -> None:
    async def agent() -> Any:
        async with ant(session).messages.stream(
            model="claude-x",
            max_tokens=2000,
            thinking={"type": "enabled", "budget_tokens": 1024},
            messages=[{"role": "user", "content": "think then act"}],
            tools=[{"name": "Bash", "input_schema": {"type": "object"}}],
        ) as stream:
            texts = [t async for t in stream.text_stream]
            final = await stream.get_final_message()
        return texts, final

    completion = {
        "reasoning": "let me think about it",
        "text": "I will run ls",
        "tool_calls": [{"id": "toolu_9", "name": "Bash", "arguments": '{"command": "ls"}'}],
        "finish_reason": "tool_calls",
        "usage": {"input_tokens": 12, "output_tokens": 34},
    }
    (texts, final), _ = await drive(mode, gateway, session, [{"completion": completion}], agent)
    assert "".join(texts) == "I will run ls"
    assert [b.type for b in final.content] == ["thinking", "text", "tool_use"]
    assert final.content[0].thinking == "let me think about it"
    assert final.content[2].input == {"command": "ls"}
    assert final.stop_reason == "tool_use" and final.usage.output_tokens == 34


async def test_anthropic_count_tokens(gateway: Gateway, session: SessionInfo) -> None:
    r = await ant(session).messages.count_tokens(model="m",
                                                 messages=[{"role": "user", "content": "hello " * 100}])
    assert r.input_tokens > 100


async def test_models_and_probe(gateway: Gateway, session: SessionInfo) -> None:
    models = await oai(session).models.list()
    assert [m.id for m in models.data] == ["ares-gateway"]
    import aiohttp

    async with aiohttp.ClientSession() as s:
        async with s.head(f"{session.base_url}/") as r:
            assert r.status == 200
        async with s.get(f"{session.base_url}/v1/responses",
                         headers={"Upgrade": "websocket", "Connection": "Upgrade"}) as r:
            assert r.status == 426


# ---------------------------------------------------------------- native answers and multi-turn


@pytest.mark.parametrize("mode", MODES)
async def test_native_chat_body_answer_ares_proxy_style(mode: str, gateway: Gateway,
                                                        session: SessionInfo) -> None:
    body = {
        "id": "chatcmpl-xyz",
        "object": "chat.completion",
        "created": 1,
        "model": "m",
        "choices": [
            {"index": 0, "message": {"role": "assistant", "content": "native!"}, "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
    }

    async def agent() -> Any:
        return await oai(session).chat.completions.create(model="m",
                                                          messages=[{"role": "user", "content": "x"}])

    resp, _ = await drive(mode, gateway, session, [{"response": body}], agent)
    assert resp.id == "chatcmpl-xyz" and resp.choices[0].message.content == "native!"


@pytest.mark.parametrize("mode", MODES)
async def test_multi_turn_tool_loop_recorded(mode: str, gateway: Gateway, session: SessionInfo) -> None:
    """Two turns: a tool call, then the tool result comes back in the next request."""

    async def agent() -> Any:
        client = oai(session)
        msgs: list[dict[str, Any]] = [{"role": "user", "content": "make a file"}]
        r1 = await client.chat.completions.create(model="m", messages=msgs, tools=TOOLS_CHAT)
        call = r1.choices[0].message.tool_calls[0]
        msgs.append(r1.choices[0].message.model_dump(exclude_none=True))
        msgs.append({"role": "tool", "tool_call_id": call.id, "content": "done: wrote x"})
        r2 = await client.chat.completions.create(model="m", messages=msgs, tools=TOOLS_CHAT)
        return r2.choices[0].message.content

    answers = [
        {
            "completion": {"tool_calls": [TWO_CALLS[0]], "finish_reason": "tool_calls"},
            "tokens": {"prompt_ids": [1, 2, 3], "output_ids": [4, 5], "output_logprobs": [-0.1, -0.2]},
        },
        {
            "completion": {"text": "all done"},
            "tokens": {"prompt_ids": [1, 2, 3, 4, 5, 6, 7], "output_ids": [8], "output_logprobs": [-0.3]},
        },
    ]
    if mode == "env":
        # In process, tokens ride on the Completion itself.
        for a in answers:
            a["completion"]["tokens"] = a.pop("tokens")
    text, seen = await drive(mode, gateway, session, answers, agent)
    assert text == "all done"
    second = seen[1]["canonical"]["messages"]
    assert second[-1]["role"] == "tool" and second[-1]["tool_call_id"] == "call_a"
    assert second[-1]["content"] == "done: wrote x"
    assert second[-2]["tool_calls"][0]["name"] == "bash"
    log = gateway.turn_log(session.session_id)
    assert len(log) == 2
    samples = gateway.trajectory(session.session_id, reward=1.0)
    assert len(samples) == 1
    s = samples[0]
    assert list(s.tokens) == [1, 2, 3, 4, 5, 6, 7, 8]
    assert list(s.loss_mask) == [1, 1, 0, 0, 1]
    assert list(s.logprobs) == pytest.approx([-0.1, -0.2, 0.0, 0.0, -0.3])
    assert s.reward == 1.0
    # The same samples over HTTP, for a trainer in another process.
    import aiohttp

    from .conftest import ADMIN

    async with aiohttp.ClientSession(headers={"authorization": f"Bearer {ADMIN}"}) as http:
        async with http.get(f"{gateway.url}/sessions/{session.session_id}/trajectory",
                            params={"reward": "1.0"}) as r:
            assert r.status == 200
            over_http = await r.json()
        async with http.get(f"{gateway.url}/sessions/{session.session_id}/turns") as r:
            turns = await r.json()
    assert len(over_http) == 1
    assert over_http[0]["tokens"] == [1, 2, 3, 4, 5, 6, 7, 8] and over_http[0]["loss_mask"] == [1, 1, 0, 0, 1]
    assert over_http[0]["reward"] == 1.0 and over_http[0]["response_length"] == 5
    assert [t["completion"].get("text") for t in turns] == [None, "all done"]
