"""OpenAI responses: Codex request shapes, round trips, rejections, response bodies."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from ares_gateway.core.canonical import CanonicalRequest, Completion, ToolCall, Usage, WireProtocol
from ares_gateway.protocols import RequestError, get_adapter

AD = get_adapter(WireProtocol.OPENAI_RESPONSES)

EXEC_TOOL = {"type": "function", "name": "exec_command", "description": "Runs a command in a PTY",
             "strict": False, "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}},
                                             "required": ["cmd"], "additionalProperties": False}}
APPLY_PATCH = {"type": "custom", "name": "apply_patch", "description": "Use apply_patch to edit files.",
               "format": {"type": "grammar", "syntax": "lark",
                          "definition": "start: begin_patch hunk+ end_patch"}}


def codex_body() -> dict[str, Any]:
    """The shape Codex CLI 0.171 sends on its second turn (trimmed)."""
    return {
        "model": "gpt-5",
        "input": [
            {"type": "message", "role": "developer",
             "content": [{"type": "input_text", "text": "You are Codex, based on GPT-5. ..."}]},
            {"type": "message", "role": "user", "content": [
                {"type": "input_text",
                 "text": "<environment_context>\n  <cwd>/repo</cwd>\n</environment_context>"}]},
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "say hi"}]},
            {"type": "reasoning", "id": "rs_1",
             "summary": [{"type": "summary_text", "text": "**Running echo**"}],
             "content": None, "encrypted_content": "gAAAAABo..."},
            {"type": "function_call", "id": "fc_1", "call_id": "call_1", "name": "exec_command",
             "arguments": "{\"cmd\":\"echo hi\"}", "status": "completed"},
            {"type": "function_call_output", "call_id": "call_1",
             "output": "Chunk ID: 1\nWall time: 0.01 seconds\nProcess exited with code 0\nOutput:\nhi\n"},
            {"type": "reasoning", "id": "rs_2", "summary": [], "encrypted_content": "gAAAAABp..."},
            {"type": "custom_tool_call", "id": "ctc_1", "call_id": "call_2", "name": "apply_patch",
             "input": "*** Begin Patch\n*** Add File: hi.txt\n+hi\n*** End Patch\n", "status": "completed"},
            {"type": "custom_tool_call_output", "call_id": "call_2", "output": "Success. Updated: A hi.txt"},
            {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
             "content": [{"type": "output_text", "text": "Done: hi", "annotations": []}]},
            {"role": "user", "content": "thanks"},
        ],
        "tools": [
            EXEC_TOOL,
            {"type": "namespace", "name": "mcp__fs",
             "tools": [{"type": "function", "name": "read", "parameters": {}}]},
            APPLY_PATCH,
            {"type": "web_search", "external_web_access": False},
            {"type": "tool_search"},
            {"type": "something_new", "x": 1},
        ],
        "tool_choice": "auto",
        "parallel_tool_calls": True,
        "reasoning": {"effort": "medium", "summary": "auto"},
        "store": False,
        "stream": True,
        "include": ["reasoning.encrypted_content"],
        "prompt_cache_key": "0199a-thread",
        "client_metadata": {"originator": "codex_exec"},
        "text": {"verbosity": "low"},
    }


def test_codex_body_canonical() -> None:
    body = codex_body()
    r = AD.parse_request(body)
    assert r.protocol is WireProtocol.OPENAI_RESPONSES and r.raw is body and r.stream
    assert [m.role for m in r.messages] == ["developer", "user", "user", "assistant", "tool", "assistant",
                                            "tool", "assistant", "user"]
    dev = r.messages[0]
    assert dev.text() == "You are Codex, based on GPT-5. ..."
    a1 = r.messages[3]
    assert a1.reasoning == "**Running echo**" and a1.content is None
    assert a1.extra["reasoning_item"] == {"id": "rs_1", "content": None, "encrypted_content": "gAAAAABo..."}
    assert [(t.id, t.name, t.arguments, t.type, t.extra) for t in a1.tool_calls] == [
        ("call_1", "exec_command", '{"cmd":"echo hi"}', "function", {"id": "fc_1", "status": "completed"})]
    out1 = r.messages[4]
    assert out1.tool_call_id == "call_1" and "Output:\nhi" in out1.content  # type: ignore[operator]
    a2 = r.messages[5]
    assert a2.reasoning is None and a2.extra["reasoning_item"]["encrypted_content"] == "gAAAAABp..."
    assert a2.tool_calls[0].type == "custom" and a2.tool_calls[0].arguments.startswith("*** Begin Patch")
    assert r.messages[6].tool_call_id == "call_2" and "custom" not in r.messages[6].extra
    assert r.messages[7].text() == "Done: hi" and r.messages[7].extra["id"] == "msg_1"
    assert r.messages[8].content == "thanks" and r.messages[8].extra == {"bare": True}
    assert [(t.type, t.name) for t in r.tools] == [
        ("function", "exec_command"), ("namespace", "mcp__fs"), ("custom", "apply_patch"),
        ("web_search", None), ("tool_search", None), ("something_new", None)]
    assert r.tools[0].parameters == EXEC_TOOL["parameters"] and r.tools[0].extra == {"strict": False}
    assert r.tools[2].description == "Use apply_patch to edit files." and r.tools[2].extra[
        "raw"] == APPLY_PATCH
    assert r.parallel_tool_calls is True and r.tool_choice == "auto"
    for k in ("reasoning", "store", "include", "prompt_cache_key", "client_metadata", "text"):
        assert r.extra[k] == body[k]
    assert CanonicalRequest.model_validate(r.model_dump()) == r  # the fast-built models are valid models


def test_codex_body_round_trip_exact() -> None:
    body = codex_body()
    before = copy.deepcopy(body)
    assert AD.render_request(AD.parse_request(body)) == body
    assert body == before


def test_instructions_string_input_images() -> None:
    b1 = {"model": "m", "instructions": "be terse", "input": "hello", "max_output_tokens": 50,
          "temperature": 0.2}
    r = AD.parse_request(b1)
    assert [(m.role, m.content) for m in r.messages] == [("system", "be terse"), ("user", "hello")]
    assert r.sampling.max_tokens == 50
    assert AD.render_request(r) == b1
    b2 = {"model": "m", "input": [{"role": "user", "content": [
        {"type": "input_text", "text": "what's this"},
        {"type": "input_image", "image_url": "https://x/y.png", "detail": "low"},
        {"type": "input_file", "file_id": "file-1"},
    ]}, {"role": "system", "content": "late system"}]}
    r2 = AD.parse_request(b2)
    parts = r2.messages[0].content
    assert [p.type for p in parts] == ["text", "image", "file"]  # type: ignore[union-attr]
    assert parts[1].url == "https://x/y.png" and parts[1].extra == {"detail": "low"}  # type: ignore[index]
    assert AD.render_request(r2) == b2


def test_no_input_is_accepted() -> None:
    """The real API allows a body without input (previous_response_id / prompt)."""
    r = AD.parse_request({"model": "m", "previous_response_id": "resp_1"})
    assert r.messages == [] and r.extra == {"previous_response_id": "resp_1"}


def test_parallel_calls_and_unknown_items() -> None:
    body = {"input": [
        {"type": "message", "role": "user", "content": "go"},
        {"type": "reasoning",
         "summary": [{"type": "summary_text", "text": "a"}, {"type": "summary_text", "text": "b"}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "calling"}]},
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
        {"type": "function_call", "call_id": "c2", "name": "g", "arguments": "{\"x\":1}"},
        {"type": "function_call_output", "call_id": "c1", "output": [{"type": "input_text", "text": "r1"}]},
        {"type": "function_call_output", "call_id": "c2", "output": "r2"},
        {"type": "item_reference", "id": "msg_old"},
        {"type": "web_search_call", "id": "ws_1", "status": "completed", "action": {"type": "search"}},
        {"type": "compaction", "encrypted_content": "zzz"},
        # Codex "responses lite" dialect items
        {"type": "additional_tools",
         "tools": [{"type": "function", "name": "exec_command", "parameters": {}}]},
        {"type": "configuration_update", "model": "gpt-5.1-codex", "reasoning": {"effort": "high"}},
    ]}
    r = AD.parse_request(body)
    roles = [m.role for m in r.messages]
    assert roles == ["user", "assistant", "tool", "tool", "user", "assistant", "user", "user", "user"]
    a = r.messages[1]
    assert a.reasoning == "a\n\nb" and a.text() == "calling" and [t.id for t in a.tool_calls] == ["c1", "c2"]
    assert r.messages[4].extra == {"item": {"type": "item_reference", "id": "msg_old"}}
    assert AD.render_request(r) == body


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ("hi", None),
        ({"input": 5}, "input"),
        ({"input": [5]}, "input[0]"),
        ({"input": [{"type": "message", "content": "x"}]}, "input[0].role"),
        ({"input": [{"role": "user", "content": 7}]}, "input[0].content"),
        ({"input": [{"role": "user", "content": [{"type": "input_text", "text": None}]}]},
         "input[0].content[0].text"),
        ({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]}, "input[0].call_id"),
        ({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": {}}]},
         "input[0].arguments"),
        ({"input": [{"type": "function_call_output", "output": "x"}]}, "input[0].call_id"),
        ({"input": [{"content": "x"}]}, "input[0].type"),
        ({"input": [], "tools": [{"name": "f"}]}, "tools[0].type"),
        ({"input": [], "tools": [{"type": "function"}]}, "tools[0].name"),
        ({"input": [], "max_output_tokens": 1.5}, "max_output_tokens"),
    ],
)
def test_rejects_unusable(body: Any, param: str | None) -> None:
    with pytest.raises(RequestError) as ei:
        AD.parse_request(body)
    assert ei.value.param == param


def native_response() -> dict[str, Any]:
    return {
        "id": "resp_1", "object": "response", "created_at": 1, "status": "completed", "model": "gpt-5",
        "output": [
            {"id": "rs_1", "type": "reasoning", "summary": [{"type": "summary_text", "text": "plan"}],
             "encrypted_content": "enc"},
            {"id": "msg_1", "type": "message", "status": "completed", "role": "assistant",
             "content": [{"type": "output_text", "text": "ok ", "annotations": []},
                         {"type": "output_text", "text": "go", "annotations": []}]},
            {"id": "fc_1", "type": "function_call", "status": "completed", "call_id": "call_1",
             "name": "exec_command", "arguments": "{\"cmd\":\"ls\"}"},
            {"id": "ctc_1", "type": "custom_tool_call", "call_id": "call_2", "name": "apply_patch",
             "input": "*** Begin"},
        ],
        "usage": {"input_tokens": 100, "input_tokens_details": {"cached_tokens": 80}, "output_tokens": 20,
                  "output_tokens_details": {"reasoning_tokens": 12}, "total_tokens": 120},
    }


def test_parse_response() -> None:
    c = AD.parse_response(native_response())
    assert c.text == "ok go" and c.reasoning == "plan" and c.extra == {"encrypted_content": "enc"}
    assert [(t.id, t.name, t.type) for t in c.tool_calls] == [("call_1", "exec_command", "function"),
                                                               ("call_2", "apply_patch", "custom")]
    assert c.finish_reason == "tool_calls"
    assert c.usage == Usage(input_tokens=100, output_tokens=20, cached_input_tokens=80, reasoning_tokens=12)
    inc = {**native_response(), "status": "incomplete", "incomplete_details": {"reason": "max_output_tokens"}}
    assert AD.parse_response(inc).finish_reason == "length"
    with pytest.raises(RequestError):
        AD.parse_response({"output": "x"})


def test_render_response_items() -> None:
    req = AD.parse_request(codex_body())
    c = Completion(text="hi", reasoning="r", tool_calls=[
        ToolCall(id="call_1", name="exec_command", arguments="{}"),
        ToolCall(id="call_2", name="exec_command", arguments="{\"cmd\":\"ls\"}"),
        ToolCall(id="call_3", name="apply_patch", arguments="*** Begin Patch", type="custom")])
    out = AD.render_response(c, req, "abc")
    assert out["id"] == "resp_abc" and out["object"] == "response" and out["status"] == "completed"
    assert [o["type"] for o in out["output"]] == ["reasoning", "message", "function_call", "function_call",
                                                  "custom_tool_call"]
    assert out["output"][1]["content"] == [
        {"type": "output_text", "text": "hi", "annotations": [], "logprobs": []}]
    assert [o["call_id"] for o in out["output"][2:]] == ["call_1", "call_2", "call_3"]
    assert all(o["status"] == "completed" for o in out["output"][1:])
    assert out["output"][2]["id"].startswith("fc_") and out["output"][4]["id"].startswith("ctc_")
    assert out["tools"] == req.raw["tools"] and out["reasoning"] == req.raw["reasoning"]
    back = AD.parse_response(out)
    assert back.tool_calls == c.tool_calls and back.text == "hi" and back.reasoning == "r"
    # the next Codex request echoes these items: they parse back into one assistant turn
    echo = {"input": [{k: v for k, v in o.items()} for o in out["output"]]}
    r = AD.parse_request(echo)
    assert len(r.messages) == 1 and r.messages[0].tool_calls == [
        ToolCall(id=t.id, name=t.name, arguments=t.arguments, type=t.type,
                 extra={"id": o["id"], "status": "completed"})
        for t, o in zip(c.tool_calls, out["output"][2:], strict=True)]


def test_error_body() -> None:
    assert AD.error_body(401, "bad key") == {"error": {"message": "bad key", "type": "authentication_error",
                                                       "param": None, "code": "invalid_api_key"}}
    assert AD.error_body(400, "x", param="input")["error"]["param"] == "input"


def test_get_adapter() -> None:
    from ares_gateway.protocols import ANTHROPIC_MESSAGES, OPENAI_CHAT, OPENAI_RESPONSES

    for proto, ad in [(WireProtocol.OPENAI_CHAT, OPENAI_CHAT),
                      (WireProtocol.ANTHROPIC_MESSAGES, ANTHROPIC_MESSAGES),
                      (WireProtocol.OPENAI_RESPONSES, OPENAI_RESPONSES)]:
        assert get_adapter(proto) is ad and get_adapter(proto.value) is ad and ad.protocol is proto
        assert ad.parse_request(
            {"messages": [], "max_tokens": 1} if proto is not WireProtocol.OPENAI_RESPONSES
            else {}).protocol is proto
