"""OpenAI chat completions: mini-swe-agent / Terminus-2 shapes, ares-proxy answers, vLLM token records."""

from __future__ import annotations

import copy
import json
from typing import Any

import numpy as np
import pytest

from ares_gateway.core.canonical import CanonicalRequest, Completion, ToolCall, WireProtocol
from ares_gateway.protocols import RequestError, get_adapter

AD = get_adapter(WireProtocol.OPENAI_CHAT)

BASH_TOOL = {"type": "function", "function": {
    "name": "bash", "description": "Execute a bash command",
    "parameters": {"type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]}}}


def mini_swe_agent_body() -> dict[str, Any]:
    return {
        "model": "my-policy",
        "messages": [
            {"role": "system", "content": "You are a helpful assistant that can interact with a computer."},
            {"role": "user", "content": "<pr_description>Fix the bug</pr_description>"},
            {"role": "assistant", "content": "THOUGHT: look around", "tool_calls": [
                {"id": "call_1", "type": "function",
                 "function": {"name": "bash", "arguments": "{\"command\": \"ls\"}"}},
                {"id": "call_2", "type": "function",
                 "function": {"name": "bash", "arguments": "{\"command\": \"pwd\"}"}},
            ]},
            {"role": "tool", "tool_call_id": "call_1",
             "content": "{\"returncode\":0,\"output\":\"a.py\\n\"}"},
            {"role": "tool", "tool_call_id": "call_2",
             "content": "{\"returncode\":0,\"output\":\"/repo\\n\"}"},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "call_3", "type": "function",
                 "function": {"name": "bash", "arguments": "{\"command\": \"echo "
                                                           "COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT\"}"}}]},
        ],
        "tools": [BASH_TOOL],
        "tool_choice": "auto",
        "temperature": 0.0,
        "drop_params": True,
    }


def test_mini_swe_agent_body() -> None:
    body = mini_swe_agent_body()
    before = copy.deepcopy(body)
    r = AD.parse_request(body)
    assert r.protocol is WireProtocol.OPENAI_CHAT and r.raw is body and not r.stream
    assert [m.role for m in r.messages] == ["system", "user", "assistant", "tool", "tool", "assistant"]
    a = r.messages[2]
    assert [(t.id, t.name, json.loads(t.arguments)) for t in a.tool_calls] == [
        ("call_1", "bash", {"command": "ls"}), ("call_2", "bash", {"command": "pwd"})]
    assert r.messages[3].tool_call_id == "call_1"
    assert r.tools[0].name == "bash" and r.tools[0].parameters == BASH_TOOL["function"]["parameters"]
    assert r.sampling.temperature == 0.0 and r.tool_choice == "auto"
    assert r.extra == {"drop_params": True}
    assert AD.render_request(r) == body
    assert body == before
    assert CanonicalRequest.model_validate(r.model_dump()) == r  # the fast-built models are valid models


def test_terminus_plain_body() -> None:
    body = {"model": "hosted_vllm/policy", "messages": [{"role": "user", "content": "You are an AI assistant "
            "tasked with solving command-line tasks...\nCurrent terminal state:\n$ "}]}
    r = AD.parse_request(body)
    assert r.messages[0].content == body["messages"][0]["content"]  # type: ignore[index]
    assert not r.tools and r.sampling.max_tokens is None
    assert AD.render_request(r) == body


def test_parts_developer_stream_options_and_legacy() -> None:
    body = {
        "model": "m", "stream": True, "stream_options": {"include_usage": True},
        "max_completion_tokens": 100, "stop": ["\n\n"], "seed": 7, "top_p": 0.9, "n": 1,
        "messages": [
            {"role": "developer",
             "content": [{"type": "text", "text": "dev rules", "cache_control": {"type": "ephemeral"}}]},
            {"role": "user", "name": "alice", "content": [
                {"type": "text", "text": "what is in this image?"},
                {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA", "detail": "high"}},
                {"type": "input_audio", "input_audio": {"data": "UklG", "format": "wav"}},
                {"type": "file", "file": {"file_id": "file-1"}},
            ]},
            {"role": "assistant", "content": "", "reasoning_content": "thinking...", "refusal": None},
            {"role": "assistant", "content": None, "function_call": {"name": "get", "arguments": "{}"}},
            {"role": "function", "name": "get", "content": "42"},
        ],
        "functions": [{"name": "get", "parameters": {"type": "object"}}],
        "function_call": "auto",
    }
    r = AD.parse_request(body)
    assert r.stream and r.include_usage and r.sampling.max_tokens == 100 and r.sampling.stop == ["\n\n"]
    dev, user, a1, a2, fn = r.messages
    assert dev.role == "developer" and dev.content[0].extra == {"cache_control": {"type": "ephemeral"}}  # type: ignore[index]
    assert [p.type for p in user.content] == ["text", "image", "audio", "file"]  # type: ignore[union-attr]
    assert user.content[1].url == "data:image/png;base64,AAAA" and user.content[1].extra == {"detail": "high"}  # type: ignore[index]
    assert a1.reasoning == "thinking..."
    assert a2.tool_calls[0].name == "get"
    assert fn.role == "function" and fn.name == "get"
    assert r.tools[0].name == "get"
    assert AD.render_request(r) == body


def test_stop_string_normalized() -> None:
    r = AD.parse_request({"messages": [], "stop": "END"})
    assert r.sampling.stop == ["END"]
    assert AD.render_request(r)["stop"] == ["END"]


def test_other_tool_types_kept() -> None:
    body = {"messages": [],
            "tools": [BASH_TOOL, {"type": "custom", "custom": {"name": "patch", "format": {"type": "text"}}},
                                     {"type": "web_search_preview"}]}
    r = AD.parse_request(body)
    assert [(t.type, t.name) for t in r.tools] == [("function", "bash"), ("custom", "patch"),
                                                   ("web_search_preview", None)]
    assert AD.render_request(r) == body


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ([1, 2], None),
        ({"model": "m"}, "messages"),
        ({"messages": "hi"}, "messages"),
        ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
        ({"messages": [{"content": "x"}]}, "messages[0].role"),
        ({"messages": [{"role": "user", "content": [{"type": "text", "text": 1}]}]},
         "messages[0].content[0].text"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": 5}]}]},
         "messages[0].content[0].image_url"),
        ({"messages": [{"role": "assistant", "tool_calls": [{"id": "c", "type": "function"}]}]},
         "messages[0].tool_calls[0].function"),
        ({"messages": [{"role": "assistant", "tool_calls": {"id": "c"}}]}, "messages[0].tool_calls"),
        ({"messages": [], "tools": [{"type": "function", "function": {"description": "x"}}]},
         "tools[0].function.name"),
        ({"messages": [], "max_tokens": "5"}, "max_tokens"),
        ({"messages": [], "stream": 1}, "stream"),
        ({"messages": [], "stop": [1]}, "stop"),
        ({"messages": [], "stream_options": []}, "stream_options"),
        ({"messages": [], "model": 3}, "model"),
    ],
)
def test_rejects_unusable(body: Any, param: str | None) -> None:
    with pytest.raises(RequestError) as ei:
        AD.parse_request(body)
    assert ei.value.param == param


def ares_proxy_answer() -> dict[str, Any]:
    """What an ares-proxy poller posts to /respond: a full chat.completion (here from vLLM, with token
    ids)."""
    return {
        "id": "chatcmpl-9f", "object": "chat.completion", "created": 1764470000, "model": "Qwen/Qwen3-8B",
        "prompt_token_ids": [1, 2, 3, 4],
        "choices": [{
            "index": 0,
            "message": {"role": "assistant", "content": "I'll list files.", "reasoning_content": "need ls",
                        "tool_calls": [
                            {"id": "chatcmpl-tool-1", "type": "function",
                             "function": {"name": "bash", "arguments": "{\"command\": \"ls\"}"}},
                            {"id": "chatcmpl-tool-2", "type": "function",
                             "function": {"name": "bash", "arguments": "{\"command\": \"pwd\"}"}}]},
            "logprobs": {
                "content": [{"token": "token_id:11", "logprob": -0.5, "bytes": None, "top_logprobs": []},
                            {"token": "token_id:12", "logprob": -0.25, "bytes": None, "top_logprobs": []},
                            {"token": "token_id:13", "logprob": 0.0, "bytes": None, "top_logprobs": []}]},
            "finish_reason": "tool_calls", "stop_reason": None, "token_ids": [11, 12, 13],
        }],
        "usage": {"prompt_tokens": 4, "completion_tokens": 3, "total_tokens": 7,
                  "prompt_tokens_details": {"cached_tokens": 2}},
    }


def test_parse_response_ares_proxy_vllm() -> None:
    c = AD.parse_response(ares_proxy_answer())
    assert c.text == "I'll list files." and c.reasoning == "need ls" and c.model == "Qwen/Qwen3-8B"
    assert [(t.id, t.arguments) for t in c.tool_calls] == [
        ("chatcmpl-tool-1", '{"command": "ls"}'), ("chatcmpl-tool-2", '{"command": "pwd"}')]
    assert c.finish_reason == "tool_calls"
    assert c.usage is not None and (c.usage.input_tokens, c.usage.output_tokens,
                                    c.usage.cached_input_tokens) == (4, 3, 2)
    assert c.tokens is not None
    assert (c.tokens.prompt_ids.tolist(), c.tokens.output_ids.tolist(),
            c.tokens.output_logprobs.tolist()) == (
        [1, 2, 3, 4], [11, 12, 13], [-0.5, -0.25, 0.0])
    assert c.tokens.prompt_ids.dtype == np.int32 and c.tokens.output_logprobs.dtype == np.float64
    Completion.model_validate(c.model_dump())


def test_parse_response_token_ids_from_logprob_tokens_only() -> None:
    body = ares_proxy_answer()
    del body["choices"][0]["token_ids"]
    c = AD.parse_response(body)
    assert c.tokens is not None and c.tokens.output_ids.tolist() == [11, 12, 13]
    del body["prompt_token_ids"]
    assert AD.parse_response(body).tokens is None  # no prompt ids: no token record


def test_parse_response_minimal_and_bad() -> None:
    c = AD.parse_response({"choices": [{"message": {"content": "hi"}, "finish_reason": "length"}]})
    assert (c.text, c.finish_reason, c.usage, c.tokens) == ("hi", "length", None, None)
    for bad in ({}, {"choices": []}, {"choices": [3]}, {"choices": [{"message": {"content": 3}}]}, "x"):
        with pytest.raises(RequestError):
            AD.parse_response(bad)


def test_render_response_shape_and_round_trip() -> None:
    # An agent that asks for token ids and logprobs (vLLM's return_token_ids / logprobs) gets them back.
    req = AD.parse_request({"model": "m", "messages": [], "return_token_ids": True, "logprobs": True})
    c = AD.parse_response(ares_proxy_answer())
    out = AD.render_response(c, req, "xyz")
    assert out["id"] == "chatcmpl-xyz" and out["object"] == "chat.completion"
    ch = out["choices"][0]
    assert ch["finish_reason"] == "tool_calls" and ch["message"]["role"] == "assistant"
    assert out["usage"]["prompt_tokens"] == 4 and out["usage"]["total_tokens"] == 7
    assert out["prompt_token_ids"] == [1, 2, 3, 4] and ch["token_ids"] == [11, 12, 13]
    assert AD.parse_response(out) == c
    # One that did not ask gets neither: a long session's prompt ids would be a megabyte per turn.
    req = AD.parse_request({"model": "m", "messages": []})
    bare = AD.render_response(c, req, "xyz")
    assert "prompt_token_ids" not in bare and "token_ids" not in bare["choices"][0]
    assert bare["choices"][0]["logprobs"] is None
    # a completion with tool calls but the default finish_reason still tells the agent to run them
    plain = AD.render_response(Completion(tool_calls=[ToolCall(id="", name="bash", arguments="{}")]), req,
                               "chatcmpl-1")
    assert plain["id"] == "chatcmpl-1" and plain["choices"][0]["finish_reason"] == "tool_calls"
    assert plain["choices"][0]["message"]["tool_calls"][0]["id"].startswith("call_")


@pytest.mark.parametrize(
    ("status", "etype"),
    [(400, "invalid_request_error"), (401, "authentication_error"), (404, "not_found_error"),
     (413, "invalid_request_error"), (429, "rate_limit_error"), (500, "server_error"), (503, "server_error")],
)
def test_error_body(status: int, etype: str) -> None:
    body = AD.error_body(status, "bad", param="messages")
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["type"] == etype and body["error"]["message"] == "bad" and body["error"][
        "param"] == "messages"
