"""Random and mutated bodies: every adapter either parses or raises RequestError -- never anything else --
and whatever parses can be rendered back and answered (non-stream and stream)."""

from __future__ import annotations

import copy
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ares_gateway.core.broker import _canonical_json
from ares_gateway.core.canonical import Completion, ToolCall
from ares_gateway.protocols import RequestError, get_adapter

from .test_anthropic_messages import claude_code_body
from .test_openai_chat import ares_proxy_answer, mini_swe_agent_body
from .test_openai_responses import codex_body, native_response

FUZZ = settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])

KEYS = ["model", "messages", "input", "system", "role", "content", "type", "text", "tool_calls",
        "tool_call_id", "function", "name", "arguments", "tools", "tool_use_id", "id", "call_id", "output",
        "summary", "source", "max_tokens", "stream", "stream_options", "include_usage", "instructions",
        "image_url", "is_error", "choices", "message", "usage", "finish_reason", "stop_reason", "status",
        "thinking", "input_schema", "parameters", "stop", "temperature", "url", "data", "media_type"]
leaf = st.one_of(st.none(), st.booleans(), st.integers(-5, 10**6),
                 st.floats(allow_nan=False, allow_infinity=False), st.text(max_size=5),
                 st.sampled_from(["user", "assistant", "system", "tool", "developer", "text",
                                                       "message", "function_call", "tool_use", "tool_result",
                                                       "image", "thinking", "reasoning", "function", "custom",
                                                       "input_text", "output_text", "base64", "url"]))
json_value = st.recursive(
    leaf, lambda kids: st.one_of(st.lists(kids, max_size=4),
                                 st.dictionaries(st.sampled_from(KEYS), kids, max_size=5)),
    max_leaves=25)

PROTOS = ["openai.chat", "anthropic.messages", "openai.responses"]
BODIES = {"openai.chat": mini_swe_agent_body, "anthropic.messages": claude_code_body,
          "openai.responses": codex_body}
RESPONSES = {"openai.chat": ares_proxy_answer, "openai.responses": native_response,
             "anthropic.messages": lambda: {"content": [{"type": "text", "text": "x"}],
                                            "stop_reason": "end_turn"}}


def _paths(v: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    out = [prefix]
    if isinstance(v, dict):
        for k, x in v.items():
            out += _paths(x, (*prefix, k))
    elif isinstance(v, list):
        for i, x in enumerate(v):
            out += _paths(x, (*prefix, i))
    return out


def _set(root: Any, path: tuple[Any, ...], value: Any) -> Any:
    if not path:
        return value
    cur = root
    for p in path[:-1]:
        cur = cur[p]
    cur[path[-1]] = value
    return root


@st.composite
def mutated(draw: Any, base: Any) -> Any:
    body = copy.deepcopy(base)
    for _ in range(draw(st.integers(1, 3))):
        paths = _paths(body)
        path = paths[draw(st.integers(0, len(paths) - 1))]
        body = _set(body, path, draw(json_value))
    return body


def _exercise(proto: str, body: Any) -> None:
    ad = get_adapter(proto)
    try:
        r = ad.parse_request(body)
    except RequestError as e:
        assert e.message and e.status == 400
        return
    ad.render_request(r)
    # what /poll sends as "canonical" is what pydantic would write
    assert _canonical_json(r) == r.model_dump_json(exclude={"raw"}).encode()
    c = Completion(text="ok", reasoning="r",
                   tool_calls=[ToolCall(id="call_1", name="f", arguments='{"a":1}')])
    ad.render_response(c, r, "x")
    enc = ad.stream_encoder(r, "x")
    assert enc.start() and enc.finish(c)


@FUZZ
@given(st.sampled_from(PROTOS), json_value)
def test_random_bodies(proto: str, body: Any) -> None:
    _exercise(proto, body)


@FUZZ
@given(st.data())
def test_mutated_real_bodies(data: Any) -> None:
    proto = data.draw(st.sampled_from(PROTOS))
    _exercise(proto, data.draw(mutated(BODIES[proto]())))


@FUZZ
@given(st.data())
def test_mutated_response_bodies(data: Any) -> None:
    proto = data.draw(st.sampled_from(PROTOS))
    body = data.draw(st.one_of(mutated(RESPONSES[proto]()), json_value))
    ad = get_adapter(proto)
    try:
        c = ad.parse_response(body)
    except RequestError:
        return
    Completion.model_validate(c.model_dump())
