"""Real-client request shapes replayed over HTTP, with the headers and query strings those clients send.

Claude Code always streams (`POST /v1/messages?beta=true`) and needs `event:` lines; Codex always
streams Responses events. The SSE wire bytes are checked event by event, not just through an SDK.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import aiohttp

from ares_gateway import Completion, Gateway, SessionInfo, ToolCall
from tests.protocols.test_anthropic_messages import claude_code_body
from tests.protocols.test_openai_responses import codex_body


def parse_sse(raw: str) -> list[tuple[str | None, Any]]:
    events: list[tuple[str | None, Any]] = []
    for block in raw.split("\n\n"):
        if not block.strip():
            continue
        name = None
        data_lines = []
        for line in block.split("\n"):
            if line.startswith("event:"):
                name = line[6:].strip()
            elif line.startswith("data:"):
                data_lines.append(line[5:].strip())
        data = "\n".join(data_lines)
        events.append((name, data if data == "[DONE]" else json.loads(data)))
    return events


async def _agent_post(url: str, body: dict[str, Any], headers: dict[str, str]) -> tuple[int, str, str]:
    async with aiohttp.ClientSession() as s, s.post(url, json=body, headers=headers) as r:
        return r.status, r.headers.get("content-type", ""), await r.text()


async def test_claude_code_request_replayed(gateway: Gateway, session: SessionInfo) -> None:
    body = claude_code_body()
    headers = {
        "x-api-key": session.token,
        "anthropic-version": "2023-06-01",
        "anthropic-beta": "claude-code-20250219,interleaved-thinking-2025-05-14,"
                          "fine-grained-tool-streaming-2025-05-14",
        "x-app": "cli",
        "X-Claude-Code-Session-Id": "0b0c-11",
        "x-stainless-lang": "js",
    }
    agent = asyncio.create_task(_agent_post(f"{session.base_url}/v1/messages?beta=true", body, headers))
    req = await gateway.next_request(session=session.session_id, timeout=5)
    assert req is not None
    assert req.request.raw == body  # the native body verbatim
    canon = req.request
    roles = [m.role for m in canon.messages]
    assert roles[0] == "system" and "system" in roles[1:]  # top-level system and the mid-conversation one
    assert [m.role for m in canon.messages if m.tool_call_id] == ["tool", "tool"]
    assert [tc.name for m in canon.messages for tc in m.tool_calls] == ["Bash", "Read"]
    assert {t.name for t in canon.tools} >= {"Bash", "Read", "web_search"}
    assert canon.stream is True
    await gateway.respond(
        req.id,
        Completion(
            reasoning="thinking...",
            text="Let me look.",
            tool_calls=[ToolCall(id="toolu_X", name="Bash", arguments='{"command": "ls"}')],
            finish_reason="tool_calls",
        ),
    )
    status, ctype, raw = await agent
    assert status == 200 and ctype.startswith("text/event-stream")
    events = parse_sse(raw)
    names = [n for n, _ in events]
    assert all(n is not None for n in names)  # Claude Code requires event: lines
    assert names[0] == "message_start" and names[-1] == "message_stop" and "message_delta" in names
    starts = [d["content_block"]["type"] for n, d in events if n == "content_block_start"]
    assert starts == ["thinking", "text", "tool_use"]
    partial = "".join(d["delta"].get("partial_json", "") for n, d in events if n == "content_block_delta")
    assert json.loads(partial) == {"command": "ls"}
    delta = next(d for n, d in events if n == "message_delta")
    assert delta["delta"]["stop_reason"] == "tool_use"


async def test_claude_code_title_request_is_side_call(gateway: Gateway, session: SessionInfo) -> None:
    body = {
        "model": "claude-haiku",
        "max_tokens": 512,
        "stream": True,
        "system": [{"type": "text", "text": "Summarize this coding conversation in under 50 characters."}],
        "messages": [{"role": "user", "content": "fix the failing test"}],
        "tools": [],
        "output_config": {"format": {"type": "json_schema", "schema": {"type": "object"}}},
    }
    agent = asyncio.create_task(
        _agent_post(f"{session.base_url}/v1/messages?beta=true", body, {"x-api-key": session.token}))
    req = await gateway.next_request(timeout=5)
    assert req is not None and req.side_call and req.poll_item()["side_call"] is True
    await gateway.respond(req.id, '{"title": "Fix failing test"}')
    status, _, _ = await agent
    assert status == 200
    assert gateway.turn_log(session.session_id)[0]["side_call"] is True


async def test_codex_request_replayed(gateway: Gateway, session: SessionInfo) -> None:
    body = codex_body()
    headers = {"authorization": f"Bearer {session.token}", "originator": "codex_exec", "session-id": "s",
               "thread-id": "t"}
    agent = asyncio.create_task(_agent_post(f"{session.base_url}/v1/responses", body, headers))
    req = await gateway.next_request(timeout=5)
    assert req is not None and req.request.raw == body
    canon = req.request
    assert canon.messages[0].role == "developer"
    tool_types = [t.type for t in canon.tools]
    assert tool_types[:5] == ["function", "namespace", "custom", "web_search", "tool_search"]
    outputs = [m for m in canon.messages if m.role == "tool"]
    assert [m.tool_call_id for m in outputs] == ["call_1", "call_2"]
    await gateway.respond(
        req.id,
        Completion(
            text="ok",
            tool_calls=[ToolCall(id="call_9", name="exec_command", arguments='{"cmd":"cat hi.txt"}')],
            finish_reason="tool_calls",
        ),
    )
    status, ctype, raw = await agent
    assert status == 200 and ctype.startswith("text/event-stream")
    events = parse_sse(raw)
    names = [n for n, _ in events]
    assert names[0] == "response.created" and names[-1] == "response.completed"
    for needed in ("response.output_item.added", "response.output_text.delta", "response.output_item.done",
                   "response.function_call_arguments.done"):
        assert needed in names
    seqs = [d["sequence_number"] for _, d in events]
    assert seqs == sorted(seqs) and len(set(seqs)) == len(seqs)
    final = events[-1][1]["response"]
    fc = [o for o in final["output"] if o["type"] == "function_call"]
    assert fc[0]["call_id"] == "call_9" and fc[0]["arguments"] == '{"cmd":"cat hi.txt"}'


async def test_mini_swe_agent_and_terminus_shapes(gateway: Gateway, session: SessionInfo) -> None:
    from tests.protocols.test_openai_chat import mini_swe_agent_body

    body = mini_swe_agent_body()
    agent = asyncio.create_task(_agent_post(f"{session.base_url}/v1/chat/completions", body,
                                            {"authorization": f"Bearer {session.token}"}))
    req = await gateway.next_request(timeout=5)
    assert req is not None and req.request.tools[0].name == "bash"
    await gateway.respond(
        req.id,
        Completion(tool_calls=[ToolCall(id="call_1", name="bash",
                                        arguments='{"command": "echo '
                                                  'COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"}')],
                   finish_reason="tool_calls"),
    )
    status, _, raw = await agent
    out = json.loads(raw)
    assert status == 200 and out["choices"][0]["message"]["tool_calls"][0]["function"]["name"] == "bash"
    # Terminus-2: {model, messages} only, one big user message, a JSON reply in text.
    terminus = {"model": "openai/label",
                "messages": [{"role": "user", "content": "You are an AI assistant... " * 200}]}
    agent = asyncio.create_task(_agent_post(f"{session.base_url}/v1/chat/completions", terminus,
                                            {"authorization": f"Bearer {session.token}"}))
    req = await gateway.next_request(timeout=5)
    assert req is not None and req.request.messages[0].role == "user"
    reply = json.dumps({"analysis": "a", "plan": "p", "commands": [{"keystrokes": "ls\n", "duration": 0.5}],
                        "task_complete": False})
    await gateway.respond(req.id, reply)
    status, _, raw = await agent
    assert json.loads(raw)["choices"][0]["message"]["content"] == reply


async def test_claude_code_subagent_header_is_side_call(gateway: Gateway, session: SessionInfo) -> None:
    body = {"model": "m", "max_tokens": 100, "messages": [{"role": "user", "content": "search the repo"}],
            "tools": [{"name": "Grep", "input_schema": {"type": "object"}}]}
    headers = {"x-api-key": session.token, "x-claude-code-agent-id": "agent-123"}
    agent = asyncio.create_task(_agent_post(f"{session.base_url}/v1/messages?beta=true", body, headers))
    req = await gateway.next_request(timeout=5)
    assert req is not None and req.side_call
    await gateway.respond(req.id, "found it")
    assert (await agent)[0] == 200
    # The same body without the sub-agent header is main line.
    agent = asyncio.create_task(
        _agent_post(f"{session.base_url}/v1/messages", body, {"x-api-key": session.token}))
    req = await gateway.next_request(timeout=5)
    assert req is not None and not req.side_call
    await gateway.respond(req.id, "ok")
    await agent
