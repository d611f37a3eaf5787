"""Anthropic messages: Claude Code request shapes, round trips, rejections, response bodies."""

from __future__ import annotations

import copy
import json
from typing import Any

import pytest

from ares_gateway.core.canonical import CanonicalRequest, Completion, ToolCall, Usage, WireProtocol
from ares_gateway.protocols import RequestError, get_adapter
from ares_gateway.protocols.anthropic_messages import parse_count_tokens_request

AD = get_adapter(WireProtocol.ANTHROPIC_MESSAGES)

CC = {"type": "ephemeral"}


def claude_code_body() -> dict[str, Any]:
    """The shape Claude Code 2.1 sends (trimmed): billing block, cache_control, thinking, tools, mid-run
    system."""
    return {
        "model": "claude-sonnet-4-5",
        "max_tokens": 32000,
        "stream": True,
        "system": [
            {"type": "text",
             "text": "x-anthropic-billing-header: cc_version=2.1.197.a1b; cc_entrypoint=sdk-cli"},
            {"type": "text", "text": "You are Claude Code, Anthropic's official CLI for Claude.",
             "cache_control": CC},
            {"type": "text", "text": "Environment: linux, cwd /repo", "cache_control": CC},
        ],
        "messages": [
            {"role": "user", "content": [
                {"type": "text",
                 "text": "<system-reminder>\nAs you answer, use the context below.\n</system-reminder>"},
                {"type": "text", "text": "Fix the failing test in tests/test_x.py", "cache_control": CC},
            ]},
            {"role": "assistant", "content": [
                {"type": "thinking", "thinking": "I should run the tests first.",
                 "signature": "EqQBCkgIBxAB..."},
                {"type": "redacted_thinking", "data": "EmwKAhgBEgy3va..."},
                {"type": "text", "text": "Running the tests."},
                {"type": "tool_use", "id": "toolu_01A", "name": "Bash",
                 "input": {"command": "pytest -q tests/test_x.py", "description": "Run tests"}},
                {"type": "tool_use", "id": "toolu_01B", "name": "Read", "input": {"file_path": "/repo/x.py"}},
            ]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "toolu_01A", "content": "1 failed", "is_error": True},
                {"type": "tool_result", "tool_use_id": "toolu_01B",
                 "content": [{"type": "text", "text": "def f():\n    return 1\n"}], "cache_control": CC},
                {"type": "text",
                 "text": "<system-reminder>The TodoWrite tool hasn't been used.</system-reminder>"},
            ]},
            {"role": "system", "content": "The user switched to plan mode."},
            {"role": "assistant", "content": "Here is the plan."},
            {"role": "user", "content": [
                {"type": "image",
                 "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}},
                {"type": "image", "source": {"type": "url", "url": "https://example.com/a.png"}},
                {"type": "document", "source": {"type": "text", "media_type": "text/plain", "data": "doc"},
                 "title": "notes"},
                {"type": "text", "text": "see these"},
            ]},
        ],
        "tools": [
            {"name": "Bash", "description": "Run a command", "input_schema": {
                "type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"],
                "additionalProperties": False, "$schema": "http://json-schema.org/draft-07/schema#"}},
            {"name": "Read", "description": "Read a file", "input_schema": {"type": "object"},
             "cache_control": CC},
            {"type": "web_search_20250305", "name": "web_search", "max_uses": 5},
        ],
        "tool_choice": {"type": "auto"},
        "metadata": {"user_id": json.dumps({"device_id": "abc", "session_id": "s1"})},
        "thinking": {"type": "enabled", "budget_tokens": 31999},
        "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
        "output_config": {"effort": "high"},
        "temperature": 1,
    }


def test_claude_code_body_canonical() -> None:
    body = claude_code_body()
    r = AD.parse_request(body)
    assert r.protocol is WireProtocol.ANTHROPIC_MESSAGES
    assert r.raw is body and r.stream and r.model == "claude-sonnet-4-5"
    assert r.sampling.max_tokens == 32000 and r.sampling.temperature == 1
    roles = [m.role for m in r.messages]
    assert roles == ["system", "user", "assistant", "tool", "tool", "user", "system", "assistant", "user"]
    system = r.messages[0]
    assert isinstance(system.content, list) and len(system.content) == 3
    assert system.content[0].text.startswith("x-anthropic-billing-header")  # type: ignore[union-attr]
    assert system.content[1].extra == {"cache_control": CC}
    asst = r.messages[2]
    assert asst.reasoning == "I should run the tests first."
    assert [(p.type, p.extra) for p in asst.content][:2] == [  # type: ignore[union-attr]
        ("thinking", {"signature": "EqQBCkgIBxAB..."}), ("redacted_thinking", {"data": "EmwKAhgBEgy3va..."})]
    assert asst.text() == "Running the tests."
    assert [(tc.id, tc.name, json.loads(tc.arguments)) for tc in asst.tool_calls] == [
        ("toolu_01A", "Bash", {"command": "pytest -q tests/test_x.py", "description": "Run tests"}),
        ("toolu_01B", "Read", {"file_path": "/repo/x.py"}),
    ]
    t1, t2, reminder = r.messages[3:6]
    assert (t1.tool_call_id, t1.content, t1.is_error) == ("toolu_01A", "1 failed", True)
    assert t2.tool_call_id == "toolu_01B" and t2.is_error is None and t2.extra == {"cache_control": CC}
    assert t2.content[0].text.startswith("def f()")  # type: ignore[index,union-attr]
    assert reminder.role == "user" and reminder.extra == {"same_turn": True}
    assert r.messages[6].content == "The user switched to plan mode."
    imgs = r.messages[8].content
    assert imgs[0].type == "image" and imgs[0].url == "data:image/png;base64,iVBORw0KGgo="  # type: ignore[index]
    assert imgs[1].url == "https://example.com/a.png"  # type: ignore[index]
    assert imgs[2].type == "document" and imgs[2].extra["title"] == "notes"  # type: ignore[index]
    assert [t.type for t in r.tools] == ["function", "function", "web_search_20250305"]
    assert r.tools[0].parameters["required"] == ["command"]  # type: ignore[index]
    assert r.tools[1].extra == {"cache_control": CC}
    assert r.tools[2].name == "web_search" and r.tools[2].extra["raw"]["max_uses"] == 5
    assert r.tool_choice == {"type": "auto"}
    for k in ("metadata", "thinking", "context_management", "output_config"):
        assert r.extra[k] == body[k]
    # the canonical form is a valid model and serializes
    assert CanonicalRequest.model_validate(r.model_dump()) == r  # the fast-built models are valid models


def test_claude_code_body_round_trip_exact() -> None:
    body = claude_code_body()
    before = copy.deepcopy(body)
    assert AD.render_request(AD.parse_request(body)) == body
    assert body == before  # parsing never mutates the agent's body


def test_tool_result_pieces_keep_order() -> None:
    body = {"model": "m", "max_tokens": 5, "messages": [
        {"role": "user", "content": [
            {"type": "text", "text": "before"},
            {"type": "tool_result", "tool_use_id": "a"},
            {"type": "tool_result", "tool_use_id": "b", "content": "B"},
            {"type": "text", "text": "between"},
            {"type": "tool_result", "tool_use_id": "c", "content": "C"},
        ]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "d", "content": "D"}]},
    ]}
    r = AD.parse_request(body)
    assert [(m.role, m.tool_call_id, m.text() if m.role == "user" else m.content) for m in r.messages] == [
        ("user", None, "before"), ("tool", "a", None), ("tool", "b", "B"), ("user", None, "between"),
        ("tool", "c", "C"), ("tool", "d", "D"),
    ]
    out = AD.render_request(r)
    # documented normalization: the last turn (only tool results, right after tool results) joins the previous
    # one
    assert out["messages"] == [
        {"role": "user", "content": body["messages"][0]["content"] + body["messages"][1]["content"]}]


def test_system_string_and_first_message_system() -> None:
    b1 = {"model": "m", "max_tokens": 1, "system": "be brief",
          "messages": [{"role": "user", "content": "hi"}]}
    r = AD.parse_request(b1)
    assert [(m.role, m.content) for m in r.messages] == [("system", "be brief"), ("user", "hi")]
    assert AD.render_request(r) == b1
    b2 = {"model": "m", "max_tokens": 1, "messages": [{"role": "system", "content": "s"},
                                                        {"role": "user", "content": "hi"}]}
    assert AD.render_request(AD.parse_request(b2)) == b2


def test_unknown_fields_kept_everywhere() -> None:
    body = {"model": "m", "max_tokens": 1, "future_field": {"x": 1}, "messages": [
        {"role": "user", "content": [{"type": "text", "text": "a", "citations": None, "new_key": 2},
                                     {"type": "brand_new_block", "payload": [1, 2]}], "msg_key": True},
        {"role": "assistant",
         "content": [{"type": "server_tool_use", "id": "srvtoolu_1", "name": "web_search",
                                           "input": {"query": "q"}},
                                          {"type": "web_search_tool_result", "tool_use_id": "srvtoolu_1",
                                           "content": []}]},
    ], "tools": [{"type": "custom", "name": "t", "input_schema": {"type": "object"}, "strict": True}]}
    r = AD.parse_request(body)
    assert r.extra == {"future_field": {"x": 1}}
    assert r.messages[0].content[1].type == "brand_new_block"  # type: ignore[index]
    assert AD.render_request(r) == body


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ([], None),
        ("x", None),
        ({"model": "m", "max_tokens": 1}, "messages"),
        ({"model": "m", "max_tokens": 1, "messages": {"role": "user"}}, "messages"),
        ({"model": "m", "messages": []}, "max_tokens"),
        ({"model": "m", "max_tokens": "10", "messages": []}, "max_tokens"),
        ({"model": "m", "max_tokens": 1, "messages": [{"role": "user", "content": 5}]},
         "messages[0].content"),
        ({"model": "m", "max_tokens": 1, "messages": [{"role": "user"}]}, "messages[0].content"),
        ({"model": "m", "max_tokens": 1, "messages": [{"content": "x"}]}, "messages[0].role"),
        ({"model": "m", "max_tokens": 1, "messages": ["hi"]}, "messages[0]"),
        ({"model": "m", "max_tokens": 1, "messages": [{"role": "user", "content": [{"type": "text"}]}]},
         "messages[0].content[0].text"),
        ({"model": "m", "max_tokens": 1, "messages": [{"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": 3}]}]}, "messages[0].content[0].tool_use_id"),
        ({"model": "m", "max_tokens": 1, "messages": [{"role": "assistant", "content": [
            {"type": "tool_use", "id": "x", "input": {}}]}]}, "messages[0].content[0].name"),
        ({"model": "m", "max_tokens": 1, "system": 3, "messages": []}, "system"),
        ({"model": "m", "max_tokens": 1, "messages": [], "tools": {}}, "tools"),
        ({"model": "m", "max_tokens": 1, "messages": [], "stream": "yes"}, "stream"),
        ({"model": "m", "max_tokens": 1, "messages": [], "temperature": "hot"}, "temperature"),
    ],
)
def test_rejects_unusable(body: Any, param: str | None) -> None:
    with pytest.raises(RequestError) as ei:
        AD.parse_request(body)
    assert ei.value.status == 400 and ei.value.param == param
    if param:
        assert param.split("[")[0] in ei.value.message


def test_count_tokens_needs_no_max_tokens() -> None:
    r = parse_count_tokens_request({"model": "m", "messages": [{"role": "user", "content": "hi"}]})
    assert r.sampling.max_tokens is None


def test_parse_response_native_body() -> None:
    body = {
        "id": "msg_1", "type": "message", "role": "assistant", "model": "claude",
        "content": [
            {"type": "thinking", "thinking": "hmm", "signature": "sig"},
            {"type": "text", "text": "Done."},
            {"type": "tool_use", "id": "toolu_9", "name": "Bash", "input": {"command": "ls"}},
            {"type": "tool_use", "id": "toolu_10", "name": "Read", "input": {"file_path": "a"}},
        ],
        "stop_reason": "tool_use", "stop_sequence": None,
        "usage": {"input_tokens": 10, "cache_read_input_tokens": 90, "cache_creation_input_tokens": 5,
                  "output_tokens": 7},
    }
    c = AD.parse_response(body)
    assert c.text == "Done." and c.reasoning == "hmm" and c.extra["signature"] == "sig"
    assert [(t.id, t.name, t.arguments) for t in c.tool_calls] == [
        ("toolu_9", "Bash", '{"command":"ls"}'), ("toolu_10", "Read", '{"file_path":"a"}')]
    assert c.finish_reason == "tool_calls"
    assert c.usage == Usage(input_tokens=105, output_tokens=7, cached_input_tokens=90)
    with pytest.raises(RequestError):
        AD.parse_response({"content": "x"})


@pytest.mark.parametrize(
    ("finish", "tools", "stop"),
    [("stop", False, "end_turn"), ("stop", True, "tool_use"), ("tool_calls", True, "tool_use"),
     ("length", False, "max_tokens"), ("content_filter", False, "refusal")],
)
def test_render_response_stop_reasons(finish: Any, tools: bool, stop: str) -> None:
    req = AD.parse_request({"model": "claude", "max_tokens": 5, "messages": []})
    calls = [ToolCall(id="", name="Bash", arguments='{"command":"ls"}')] if tools else []
    out = AD.render_response(Completion(text="t", tool_calls=calls, finish_reason=finish), req, "abc")
    assert out["stop_reason"] == stop and out["id"] == "msg_abc" and out["type"] == "message"
    if tools:
        assert out["content"][-1]["id"].startswith("toolu_")
        assert out["content"][-1]["input"] == {"command": "ls"}


def test_render_response_block_order() -> None:
    req = AD.parse_request({"model": "claude", "max_tokens": 5, "messages": []})
    c = Completion(text="x", reasoning="r", tool_calls=[ToolCall(id="toolu_1", name="a", arguments="{}"),
                                                         ToolCall(id="toolu_2", name="b", arguments="{}")])
    out = AD.render_response(c, req, "msg_1")
    assert out["id"] == "msg_1"
    assert [b["type"] for b in out["content"]] == ["thinking", "text", "tool_use", "tool_use"]
    assert AD.parse_response(out).tool_calls == c.tool_calls


@pytest.mark.parametrize(
    ("status", "etype"),
    [(400, "invalid_request_error"), (401, "authentication_error"), (403, "permission_error"),
     (404, "not_found_error"), (413, "request_too_large"), (429, "rate_limit_error"), (500, "api_error"),
     (529, "overloaded_error")],
)
def test_error_body(status: int, etype: str) -> None:
    assert AD.error_body(status, "nope") == {"type": "error", "error": {"type": etype, "message": "nope"}}
