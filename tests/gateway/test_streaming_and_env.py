"""Streamed answers reach the agent as they arrive; GatewayEnv's episode boundaries."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import anthropic
import openai
import pytest

from ares_gateway import Completion, CompletionDelta, Gateway, GatewayEnv, SessionInfo, StepType, ToolCall


def relay(first_seen: asyncio.Event) -> AsyncIterator[CompletionDelta | Completion]:
    """A policy stream that only goes on once the agent has seen its first delta."""

    async def gen() -> AsyncIterator[CompletionDelta | Completion]:
        yield CompletionDelta(text="Hel")
        await asyncio.wait_for(first_seen.wait(), 5)
        yield CompletionDelta(text="lo")
        yield CompletionDelta(tool_index=0, tool_call_id="call_7", tool_name="bash")
        yield CompletionDelta(tool_index=0, arguments='{"command":')
        yield CompletionDelta(tool_index=0, arguments=' "ls"}')
        yield Completion(
            text="Hello",
            tool_calls=[ToolCall(id="call_7", name="bash", arguments='{"command": "ls"}')],
            finish_reason="tool_calls",
        )

    return gen()


async def test_chat_stream_relayed_incrementally(gateway: Gateway, session: SessionInfo) -> None:
    seen = asyncio.Event()

    async def agent() -> tuple[str, str]:
        client = openai.AsyncOpenAI(base_url=f"{session.base_url}/v1", api_key=session.token, max_retries=0)
        text, args = "", ""
        async for chunk in await client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": "x"}], stream=True):
            d = chunk.choices[0].delta if chunk.choices else None
            if d and d.content:
                text += d.content
                seen.set()  # the first delta arrived while the policy is still blocked
            for tc in (d.tool_calls or []) if d else []:
                args += tc.function.arguments or "" if tc.function else ""
        return text, args

    task = asyncio.create_task(agent())
    req = await gateway.next_request(timeout=5)
    assert req is not None
    await gateway.respond(req.id, relay(seen))
    text, args = await asyncio.wait_for(task, 10)
    assert text == "Hello" and args == '{"command": "ls"}'
    # The recorded turn is the whole completion.
    assert gateway.turn_log(session.session_id)[0]["completion"]["tool_calls"][0][
        "arguments"] == '{"command": "ls"}'


async def test_anthropic_stream_relayed_incrementally(gateway: Gateway, session: SessionInfo) -> None:
    seen = asyncio.Event()

    async def agent() -> Any:
        client = anthropic.AsyncAnthropic(base_url=session.base_url, api_key=session.token, max_retries=0)
        async with client.messages.stream(model="m", max_tokens=10,
                                          messages=[{"role": "user", "content": "x"}]) as stream:
            async for _ in stream.text_stream:
                seen.set()
            return await stream.get_final_message()

    task = asyncio.create_task(agent())
    req = await gateway.next_request(timeout=5)
    assert req is not None
    await gateway.respond(req.id, relay(seen))
    final = await asyncio.wait_for(task, 10)
    assert [b.type for b in final.content] == ["text",
                                               "tool_use"] and final.content[1].input == {"command": "ls"}


@pytest.mark.parametrize("final_extra", [None, {}, {"signature": "other"}])
@pytest.mark.parametrize("agent_streams", [True, False])
async def test_anthropic_stream_keeps_streamed_signature(
    gateway: Gateway, session: SessionInfo, final_extra: dict[str, str] | None, agent_streams: bool
) -> None:
    """Thinking deltas, a signature delta, then text, and a final Completion that lacks the
    signature, repeats a different one, or is absent: the agent gets the streamed signature on
    its thinking block (as SSE or, drained, as JSON), and the recorded turn keeps that one."""

    async def gen() -> AsyncIterator[CompletionDelta | Completion]:
        yield CompletionDelta(reasoning="Let me ")
        yield CompletionDelta(reasoning="think.")
        yield CompletionDelta(signature="EqQBsig==")
        yield CompletionDelta(text="Done.")
        if final_extra is not None:
            yield Completion(reasoning="Let me think.", text="Done.", extra=final_extra)

    client = anthropic.AsyncAnthropic(base_url=session.base_url, api_key=session.token, max_retries=0)

    async def agent() -> Any:
        messages: Any = [{"role": "user", "content": "x"}]
        if not agent_streams:
            return await client.messages.create(model="m", max_tokens=10, messages=messages)
        async with client.messages.stream(model="m", max_tokens=10, messages=messages) as stream:
            return await stream.get_final_message()

    task = asyncio.create_task(agent())
    req = await gateway.next_request(timeout=5)
    assert req is not None
    await gateway.respond(req.id, gen())
    final = await asyncio.wait_for(task, 10)
    assert [b.type for b in final.content] == ["thinking", "text"]
    assert final.content[0].thinking == "Let me think." and final.content[0].signature == "EqQBsig=="  # type: ignore[union-attr]
    assert gateway.turn_log(session.session_id)[0]["completion"]["extra"]["signature"] == "EqQBsig=="


async def test_responses_stream_relayed_incrementally(gateway: Gateway, session: SessionInfo) -> None:
    seen = asyncio.Event()

    async def agent() -> Any:
        client = openai.AsyncOpenAI(base_url=f"{session.base_url}/v1", api_key=session.token, max_retries=0)
        async with client.responses.stream(model="gpt-5", input="x") as stream:
            async for event in stream:
                if event.type == "response.output_text.delta":
                    seen.set()
            return await stream.get_final_response()

    task = asyncio.create_task(agent())
    req = await gateway.next_request(timeout=5)
    assert req is not None
    await gateway.respond(req.id, relay(seen))
    final = await asyncio.wait_for(task, 10)
    assert final.output_text == "Hello"
    assert [(o.call_id, o.arguments) for o in final.output
            if o.type == "function_call"] == [("call_7", '{"command": "ls"}')]


async def test_streamed_answer_to_non_stream_request(gateway: Gateway, session: SessionInfo) -> None:
    seen = asyncio.Event()
    seen.set()
    client = openai.AsyncOpenAI(base_url=f"{session.base_url}/v1", api_key=session.token, max_retries=0)
    task = asyncio.create_task(
        client.chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}]))
    req = await gateway.next_request(timeout=5)
    assert req is not None
    await gateway.respond(req.id, relay(seen))
    resp = await task
    assert resp.choices[0].message.content == "Hello" and resp.choices[0].message.tool_calls[0].id == "call_7"


async def _chatty_agent(info: Any, turns: int) -> list[str]:
    client = openai.AsyncOpenAI(base_url=f"{info.base_url}/v1", api_key=info.token, max_retries=0)
    out = []
    for i in range(turns):
        try:
            r = await client.chat.completions.create(model="m",
                                                     messages=[{"role": "user", "content": f"turn {i}"}])
        except openai.APIStatusError:
            break
        out.append(r.choices[0].message.content or "")
    return out


async def test_env_launch_step_limit_truncates() -> None:
    async with Gateway(port=0) as gw:
        agents: list[asyncio.Task[list[str]]] = []

        async def launch(info: Any) -> None:
            agents.append(asyncio.create_task(_chatty_agent(info, 100)))

        env = GatewayEnv(gw, launch=launch, step_limit=3)
        ts = await env.reset()
        assert ts.first() and "turn 0" in ts.observation.request.messages[-1].text()  # type: ignore[union-attr]
        steps = 0
        while not ts.last():
            ts = await env.step(f"answer {steps}")
            steps += 1
        assert steps == 3 and ts.discount == 1.0 and ts.info["truncated"] is True and ts.info[
            "reason"] == "step limit reached"
        sid = env.session.session_id  # type: ignore[union-attr]
        assert len(gw.turn_log(sid)) == 3
        await env.close()  # the env-created session is deleted; the agent's pending request fails
        assert await asyncio.wait_for(agents[0], 5) == ["answer 0", "answer 1", "answer 2"]
        assert gw.sessions.find(sid) is None and gw.broker.pending_count == 0


async def test_env_time_limit_truncates() -> None:
    async with Gateway(port=0) as gw:
        # nobody ever calls the model
        env = GatewayEnv(gw, launch=lambda info: asyncio.sleep(0), time_limit=0.3)
        ts = await asyncio.wait_for(env.reset(), 5)
        assert ts.last() and ts.discount == 1.0 and ts.info["truncated"] is True
        await env.close()


async def test_env_reset_cleans_previous_episode_and_step_without_reset_fails() -> None:
    async with Gateway(port=0) as gw:
        tasks: list[asyncio.Task[list[str]]] = []

        async def launch(info: Any) -> None:
            tasks.append(asyncio.create_task(_chatty_agent(info, 5)))

        env = GatewayEnv(gw, launch=launch)
        with pytest.raises(RuntimeError):
            await env.step("x")
        ts = await env.reset()
        first = env.session.session_id  # type: ignore[union-attr]
        ts = await env.step("a")
        assert ts.mid() and ts.reward == 0.0 and ts.discount == 1.0
        ts = await env.reset()  # mid-episode: the old session is cleaned up first
        assert ts.first() and env.session.session_id != first  # type: ignore[union-attr]
        assert gw.sessions.find(first) is None
        assert await asyncio.wait_for(tasks[0], 5) == ["a"]
        await gw.end_session(env.session.session_id, reward=0.5)  # type: ignore[union-attr]
        ts = await env.step("b")
        assert ts.step_type is StepType.LAST and ts.reward == 0.5 and ts.discount == 0.0
        await env.close()
        await asyncio.gather(*tasks, return_exceptions=True)
        assert gw.broker.pending_count == 0


async def test_broken_policy_stream_gives_non_stream_agent_a_502(gateway: Gateway,
                                                                 session: SessionInfo) -> None:
    async def broken() -> AsyncIterator[CompletionDelta | Completion]:
        yield CompletionDelta(text="partial")
        raise RuntimeError("inference server went away")

    client = openai.AsyncOpenAI(base_url=f"{session.base_url}/v1", api_key=session.token, max_retries=0)
    task = asyncio.create_task(
        client.chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}]))
    req = await gateway.next_request(timeout=5)
    assert req is not None
    await gateway.respond(req.id, broken())
    with pytest.raises(openai.APIStatusError) as err:
        await task
    assert err.value.status_code == 502 and "inference server went away" in str(err.value)


@pytest.mark.parametrize("answer", ["completion", "native", "error"])
async def test_a_whole_answer_reaches_the_agent_once(gateway: Gateway, session: SessionInfo,
                                                     answer: str) -> None:
    """A non-streamed answer reaches the agent's socket as soon as the handler runs after respond(),
    exactly once, and the turn is recorded (error answers are not turns)."""
    import socket

    body = b'{"model": "m", "messages": [{"role": "user", "content": "hi"}]}'
    head = (
        f"POST /s/{session.session_id}/v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
        f"Authorization: Bearer {session.token}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode()
    with socket.create_connection(("127.0.0.1", gateway.port)) as sock:
        sock.sendall(head + body)
        req = await gateway.next_request(session=session.session_id, timeout=10)
        assert req is not None
        sock.setblocking(False)
        with pytest.raises(BlockingIOError):
            sock.recv(65536)  # nothing before the answer
        if answer == "completion":
            gateway.broker.respond(req.id, Completion(text="right away"))
        elif answer == "native":
            gateway.broker.respond(req.id, {"id": "chatcmpl-1", "object": "chat.completion", "created": 1,
                                            "model": "m", "choices": [{"index": 0, "finish_reason": "stop",
                                            "message": {"role": "assistant", "content": "right away"}}]})
        else:
            from ares_gateway import ErrorAnswer

            gateway.broker.respond(req.id, ErrorAnswer(429, "right away"))
        got = b""
        for _ in range(200):  # a few loop iterations at most; bounded at 2 s
            await asyncio.sleep(0.01)
            try:
                got += sock.recv(65536)
            except BlockingIOError:
                continue
            if b"right away" in got:
                break
        status = b"429" if answer == "error" else b"200"
        assert got.startswith(b"HTTP/1.1 " + status), got[:80]
        assert b"right away" in got
        await asyncio.sleep(0.05)  # the handler finishes without writing a second response
        with pytest.raises(BlockingIOError):
            sock.recv(65536)
    await asyncio.sleep(0.05)
    assert gateway.broker.pending_count == 0
    assert len(gateway.recorder.turns(session.session_id)) == (0 if answer == "error" else 1)
