"""Hypothesis round trips: canonical -> native -> canonical for what each protocol expresses,
completion -> native response -> completion, and streamed SSE -> reconstructed completion."""

from __future__ import annotations

import json
from typing import Any

import orjson
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ares_gateway.core.canonical import (
    CanonicalRequest,
    Completion,
    ContentPart,
    Message,
    SamplingParams,
    TokenRecord,
    Tool,
    ToolCall,
    Usage,
    WireProtocol,
)
from ares_gateway.protocols import get_adapter

from ._helpers import deltas_of

SETTINGS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])

text = st.text(max_size=12)
name = st.from_regex(r"[a-zA-Z_][a-zA-Z0-9_]{0,8}", fullmatch=True)
json_scalar = st.one_of(st.none(), st.booleans(), st.integers(-1000, 1000), st.text(max_size=6))
json_obj = st.dictionaries(name, json_scalar, max_size=3)
cache = st.sampled_from([{}, {"cache_control": {"type": "ephemeral"}}])


def _strip_raw(r: CanonicalRequest) -> CanonicalRequest:
    return r.model_copy(update={"raw": {}})


def _counter() -> Any:
    n = [0]

    def nxt() -> str:
        n[0] += 1
        return f"call_{n[0]}"

    return nxt


@st.composite
def sampling(draw: Any, *, top_k: bool = True, stop: bool = True, seed: bool = True,
             max_tokens_required: bool = False, max_temperature: float = 2.0) -> SamplingParams:
    # Within what each API accepts (temperature up to 2 for OpenAI, 1 for Anthropic; top_p up to 1).
    mt = st.integers(1, 100000)
    return SamplingParams(
        max_tokens=draw(mt if max_tokens_required else st.one_of(st.none(), mt)),
        temperature=draw(st.one_of(st.none(), st.floats(0, max_temperature, allow_nan=False))),
        top_p=draw(st.one_of(st.none(), st.floats(0, 1, allow_nan=False))),
        top_k=draw(st.one_of(st.none(), st.integers(1, 100))) if top_k else None,
        stop=draw(st.one_of(st.none(), st.lists(text, min_size=1, max_size=3))) if stop else None,
        seed=draw(st.one_of(st.none(), st.integers(0, 2**31))) if seed else None,
    )


# =========================================================================== chat


@st.composite
def chat_request(draw: Any) -> CanonicalRequest:
    nid = _counter()
    parts = st.lists(st.one_of(
        st.builds(lambda t, c: ContentPart(type="text", text=t, extra=c), text, cache),
        st.builds(lambda u, d: ContentPart(type="image", url=u, extra=d),
                  st.sampled_from(["https://x/a.png", "data:image/png;base64,AAAA"]),
                  st.sampled_from([{}, {"detail": "low"}])),
    ), max_size=3)
    content = st.one_of(st.none(), text, parts)
    msgs: list[Message] = []
    for _ in range(draw(st.integers(0, 6))):
        role = draw(st.sampled_from(["system", "developer", "user", "assistant", "tool"]))
        if role == "assistant":
            calls = [
                ToolCall(id=nid(), name=draw(name), arguments=draw(st.one_of(text, json_obj.map(json.dumps))),
                         type=draw(st.sampled_from(["function", "custom"])))
                for _ in range(draw(st.integers(0, 3)))]
            msgs.append(Message(role=role, content=draw(content), tool_calls=calls,
                                reasoning=draw(st.one_of(st.none(), text))))
        elif role == "tool":
            msgs.append(Message(role=role, content=draw(st.one_of(text, parts)), tool_call_id=nid(),
                                is_error=draw(st.one_of(st.none(), st.booleans()))))
        else:
            msgs.append(Message(role=role, content=draw(content), name=draw(st.one_of(st.none(), name))))
    tools = [Tool(name=draw(name), description=draw(st.one_of(st.none(), text)),
                  parameters=draw(st.one_of(st.none(), st.just({"type": "object"}))),
                  extra=draw(st.sampled_from([{}, {"strict": True}])))
             for _ in range(draw(st.integers(0, 2)))]
    return CanonicalRequest(
        protocol=WireProtocol.OPENAI_CHAT, model=draw(st.one_of(st.none(), name)), messages=msgs, tools=tools,
        tool_choice=draw(st.sampled_from([None, "auto", "required"])),
        parallel_tool_calls=draw(st.one_of(st.none(), st.booleans())), sampling=draw(sampling()),
        stream=draw(st.booleans()), include_usage=draw(st.booleans()),
        extra=draw(st.sampled_from([{}, {"user": "u1", "logprobs": True}])),
    )


@SETTINGS
@given(chat_request())
def test_chat_request_round_trip(r: CanonicalRequest) -> None:
    ad = get_adapter(WireProtocol.OPENAI_CHAT)
    native = ad.render_request(r)
    native = orjson.loads(orjson.dumps(native))  # what goes over the wire
    back = ad.parse_request(native)
    assert _strip_raw(back) == r
    assert ad.render_request(back) == native


# =========================================================================== anthropic


@st.composite
def anthropic_request(draw: Any) -> CanonicalRequest:
    nid = _counter()
    text_part = st.builds(lambda t, c: ContentPart(type="text", text=t, extra=c), text, cache)
    image_part = st.builds(lambda u, c: ContentPart(type="image", url=u, extra=c),
                           st.sampled_from(["https://x/a.png", "data:image/jpeg;base64,/9j/4AAQ"]), cache)
    user_parts = st.lists(st.one_of(text_part, image_part), min_size=1, max_size=3)
    msgs: list[Message] = []
    if draw(st.booleans()):
        msgs.append(Message(role="system", content=draw(st.one_of(text, st.lists(text_part, max_size=2)))))
    for _ in range(draw(st.integers(0, 6))):
        kind = draw(st.sampled_from(["user", "assistant", "tools", "system"]))
        if kind == "user" or (kind == "system" and not msgs):
            msgs.append(Message(role="user", content=draw(st.one_of(text, user_parts))))
        elif kind == "system":
            msgs.append(Message(role="system", content=draw(text)))
        elif kind == "tools":
            for _ in range(draw(st.integers(1, 3))):
                msgs.append(Message(role="tool", tool_call_id=nid(),
                                    content=draw(st.one_of(st.none(), text, st.lists(text_part, max_size=2))),
                                    is_error=draw(st.one_of(st.none(), st.booleans())), extra=draw(cache)))
            if draw(st.booleans()):
                msgs.append(Message(role="user", content=draw(user_parts), extra={"same_turn": True}))
        else:
            calls = [ToolCall(id=nid(), name=draw(name), arguments=orjson.dumps(draw(json_obj)).decode())
                     for _ in range(draw(st.integers(0, 3)))]
            if not calls and draw(st.booleans()):
                msgs.append(Message(role="assistant", content=draw(text)))
                continue
            thinking = draw(st.lists(st.builds(lambda t, s: ContentPart(type="thinking", text=t,
                                                                        extra={"signature": s}), text, text),
                                     max_size=2))
            redacted = draw(
                st.lists(st.builds(lambda d: ContentPart(type="redacted_thinking", extra={"data": d}),
                                   text), max_size=1))
            texts = draw(st.lists(text_part, max_size=2))
            parts = thinking + redacted + texts
            msgs.append(Message(
                role="assistant", content=parts if (parts or not calls) else None, tool_calls=calls,
                reasoning="\n\n".join(p.text or "" for p in thinking) if thinking else None))
    tools: list[Tool] = []
    for _ in range(draw(st.integers(0, 2))):
        if draw(st.booleans()):
            tools.append(Tool(name=draw(name), description=draw(st.one_of(st.none(), text)),
                              parameters=draw(st.one_of(st.none(), st.just({"type": "object"}))),
                              extra=draw(cache)))
        else:
            raw = {"type": "bash_20250124", "name": "bash"}
            tools.append(Tool(type="bash_20250124", name="bash", extra={"raw": raw}))
    return CanonicalRequest(
        protocol=WireProtocol.ANTHROPIC_MESSAGES, model=draw(st.one_of(st.none(), name)), messages=msgs,
        tools=tools, tool_choice=draw(st.sampled_from([None, {"type": "auto"}, {"type": "any"}])),
        sampling=draw(sampling(seed=False, max_tokens_required=True, max_temperature=1.0)),
        stream=draw(st.booleans()),
        extra=draw(st.sampled_from([{}, {"thinking": {"type": "enabled", "budget_tokens": 1024},
                                         "metadata": {"user_id": "u"}}])),
    )


@SETTINGS
@given(anthropic_request())
def test_anthropic_request_round_trip(r: CanonicalRequest) -> None:
    ad = get_adapter(WireProtocol.ANTHROPIC_MESSAGES)
    native = orjson.loads(orjson.dumps(ad.render_request(r)))
    back = ad.parse_request(native)
    assert _strip_raw(back) == r
    assert ad.render_request(back) == native


# =========================================================================== responses


@st.composite
def responses_request(draw: Any) -> CanonicalRequest:
    nid = _counter()
    in_part = st.one_of(
        st.builds(lambda t: ContentPart(type="text", text=t), text),
        st.builds(lambda u, d: ContentPart(type="image", url=u, extra=d),
                  st.sampled_from(["https://x/a.png", "data:image/png;base64,AAAA"]),
                  st.sampled_from([{"detail": "auto"}, {"detail": "high"}])),
    )
    out_part = st.builds(lambda t, a: ContentPart(type="text", text=t, extra=a), text,
                         st.sampled_from([{}, {"annotations": []}]))
    msgs: list[Message] = []
    if draw(st.booleans()):
        msgs.append(Message(role="system", content=draw(text)))
    last_assistant = False
    for _ in range(draw(st.integers(0, 6))):
        kind = draw(st.sampled_from(["user", "developer", "assistant", "tool"]))
        if kind == "assistant" and not last_assistant:
            calls = [ToolCall(id=nid(), name=draw(name), arguments=draw(text),
                              type=draw(st.sampled_from(["function", "custom"])),
                              extra=draw(st.sampled_from([{}, {"id": "fc_1", "status": "completed"}])))
                     for _ in range(draw(st.integers(0, 3)))]
            reasoning = draw(st.one_of(st.none(), text))
            content = draw(st.one_of(st.none(), text, st.lists(out_part, max_size=2)))
            if reasoning is None and content is None and not calls:
                content = ""
            msgs.append(Message(role="assistant", content=content, tool_calls=calls, reasoning=reasoning))
            last_assistant = True
            continue
        last_assistant = False
        if kind == "tool":
            msgs.append(Message(role="tool", tool_call_id=nid(), content=draw(text)))
        else:
            role = "user" if kind == "assistant" else kind
            msgs.append(Message(role=role, content=draw(st.one_of(text, st.lists(in_part, max_size=3)))))
    tools: list[Tool] = []
    for _ in range(draw(st.integers(0, 2))):
        if draw(st.booleans()):
            tools.append(Tool(name=draw(name), description=draw(st.one_of(st.none(), text)),
                              parameters=draw(st.one_of(st.none(), st.just({"type": "object"}))),
                              extra=draw(st.sampled_from([{}, {"strict": False}]))))
        else:
            raw = {"type": "custom", "name": "apply_patch", "description": "patch",
                   "format": {"type": "text"}}
            tools.append(Tool(type="custom", name="apply_patch", description="patch", extra={"raw": raw}))
    return CanonicalRequest(
        protocol=WireProtocol.OPENAI_RESPONSES, model=draw(st.one_of(st.none(), name)), messages=msgs,
        tools=tools, tool_choice=draw(st.sampled_from([None, "auto", "none"])),
        parallel_tool_calls=draw(st.one_of(st.none(), st.booleans())),
        sampling=draw(sampling(top_k=False, stop=False, seed=False)), stream=draw(st.booleans()),
        extra=draw(st.sampled_from([{}, {"store": False, "include": ["reasoning.encrypted_content"],
                                         "reasoning": {"effort": "low"}}])),
    )


@SETTINGS
@given(responses_request())
def test_responses_request_round_trip(r: CanonicalRequest) -> None:
    ad = get_adapter(WireProtocol.OPENAI_RESPONSES)
    native = orjson.loads(orjson.dumps(ad.render_request(r)))
    back = ad.parse_request(native)
    assert _strip_raw(back) == r
    assert ad.render_request(back) == native


# =========================================================================== completions


@st.composite
def completion(draw: Any, proto: str) -> Completion:
    nid = _counter()
    anth = proto == "anthropic.messages"
    args = json_obj.map(lambda d: orjson.dumps(d).decode())
    calls = [ToolCall(id=nid(), name=draw(name),
                      arguments=draw(args if anth else st.one_of(text, args)),
                      type="function" if anth else draw(st.sampled_from(["function", "custom"])))
             for _ in range(draw(st.integers(0, 3)))]
    nonempty = st.text(min_size=1, max_size=20)
    txt = draw(st.one_of(st.none(), nonempty if proto != "openai.chat" else text))
    reasoning = draw(st.one_of(st.none(), nonempty if proto == "openai.responses" else text))
    fr = draw(st.sampled_from(["stop", "length", "content_filter"]))
    if fr == "stop" and calls:
        fr = "tool_calls"
    inp = draw(st.integers(0, 10**6))
    u = Usage(input_tokens=inp, output_tokens=draw(st.integers(0, 10**5)),
              cached_input_tokens=draw(st.integers(0, inp)),
              reasoning_tokens=0 if anth else draw(st.integers(0, 100)))
    tokens = None
    if proto == "openai.chat" and draw(st.booleans()):
        out_ids = draw(st.lists(st.integers(0, 150000), max_size=5))
        tokens = TokenRecord(prompt_ids=draw(st.lists(st.integers(0, 150000), max_size=5)),
                             output_ids=out_ids,
                             output_logprobs=[-0.5] * len(out_ids) if draw(st.booleans()) else [],
                             finish_reason=fr)
    extra: dict[str, Any] = {}
    if anth and reasoning is not None and draw(st.booleans()):
        extra["signature"] = "sig"
    return Completion(text=txt, reasoning=reasoning, tool_calls=calls, finish_reason=fr, usage=u,
                      tokens=tokens, model=draw(st.one_of(st.none(), name)), extra=extra)


def _completion_round_trip(proto: str, c: Completion) -> None:
    ad = get_adapter(proto)
    # Token ids and logprobs come back to an agent that asks for them (vLLM's request fields).
    asks = {"return_token_ids": True, "logprobs": True} if proto == "openai.chat" else {}
    req = ad.parse_request({"model": "m", "messages": [], "max_tokens": 10, **asks}
                           if proto != "openai.responses"
                           else {"model": "m"})
    native = orjson.loads(orjson.dumps(ad.render_response(c, req, "rid")))
    back = ad.parse_response(native, req)
    expect = c if c.model else c.model_copy(update={"model": "m"})
    assert back == expect


@SETTINGS
@given(completion("openai.chat"))
def test_chat_completion_round_trip(c: Completion) -> None:
    _completion_round_trip("openai.chat", c)


@SETTINGS
@given(completion("anthropic.messages"))
def test_anthropic_completion_round_trip(c: Completion) -> None:
    _completion_round_trip("anthropic.messages", c)


@SETTINGS
@given(completion("openai.responses"))
def test_responses_completion_round_trip(c: Completion) -> None:
    _completion_round_trip("openai.responses", c)


# =========================================================================== streams, reassembled offline


def _sse(raw: bytes) -> list[tuple[str | None, Any]]:
    events = []
    assert raw.endswith(b"\n\n")
    for block in raw.split(b"\n\n")[:-1]:
        ev, data = None, None
        for line in block.split(b"\n"):
            if line.startswith(b"event: "):
                ev = line[7:].decode()
            elif line.startswith(b"data: "):
                data = line[6:]
        assert data is not None
        events.append((ev, data if data == b"[DONE]" else orjson.loads(data)))
    return events


def _rebuild_chat(raw: bytes) -> dict[str, Any]:
    events = _sse(raw)
    assert events[-1] == (None, b"[DONE]")
    text, reasoning, calls = "", "", {}
    for _, d in events[:-1]:
        for ch in d["choices"]:
            dl = ch["delta"]
            text += dl.get("content") or ""
            reasoning += dl.get("reasoning_content") or ""
            for tc in dl.get("tool_calls", []):
                slot = calls.setdefault(tc["index"], {"id": tc.get("id"), "name": "", "args": ""})
                inner = tc.get("function") or tc.get("custom") or {}
                slot["name"] += inner.get("name") or ""
                slot["args"] += inner.get("arguments") or inner.get("input") or ""
    return {"text": text, "reasoning": reasoning,
            "calls": [(v["id"], v["name"], v["args"]) for _, v in sorted(calls.items())]}


def _rebuild_anthropic(raw: bytes) -> dict[str, Any]:
    events = _sse(raw)
    assert [e for e, _ in events][:2] == ["message_start", "ping"] and events[-1][0] == "message_stop"
    blocks: dict[int, dict[str, Any]] = {}
    open_ = None
    for ev, d in events:
        assert d["type"] == ev
        if ev == "content_block_start":
            assert open_ is None
            open_ = d["index"]
            blocks[d["index"]] = {**d["content_block"], "json": ""}
        elif ev == "content_block_delta":
            assert d["index"] == open_
            b, dl = blocks[d["index"]], d["delta"]
            if dl["type"] == "text_delta":
                b["text"] += dl["text"]
            elif dl["type"] == "thinking_delta":
                b["thinking"] += dl["thinking"]
            elif dl["type"] == "input_json_delta":
                b["json"] += dl["partial_json"]
        elif ev == "content_block_stop":
            assert d["index"] == open_
            open_ = None
    assert sorted(blocks) == list(range(len(blocks)))
    out = [blocks[i] for i in sorted(blocks)]
    return {
        "text": "".join(b["text"] for b in out if b["type"] == "text"),
        "reasoning": "".join(b["thinking"] for b in out if b["type"] == "thinking"),
        "calls": [(b["id"], b["name"], orjson.loads(b["json"]) if b["json"] else {}) for b in out
                  if b["type"] == "tool_use"],
    }


def _rebuild_responses(raw: bytes) -> dict[str, Any]:
    events = _sse(raw)
    assert [d["sequence_number"] for _, d in events] == list(range(len(events)))
    assert events[0][0] == "response.created" and events[-1][0] in ("response.completed",
                                                                    "response.incomplete")
    text, reasoning, calls = "", "", {}
    for ev, d in events:
        assert d["type"] == ev
        if ev == "response.output_text.delta":
            text += d["delta"]
        elif ev == "response.reasoning_summary_text.delta":
            reasoning += d["delta"]
        elif (ev == "response.output_item.added"
              and d["item"]["type"] in ("function_call", "custom_tool_call")):
            calls[d["output_index"]] = [d["item"]["call_id"], d["item"]["name"], ""]
        elif ev in ("response.function_call_arguments.delta", "response.custom_tool_call_input.delta"):
            calls[d["output_index"]][2] += d["delta"]
    final = events[-1][1]["response"]
    # the final response object agrees with what was streamed
    assert "".join(p["text"] for o in final["output"] if o["type"] == "message" for p in o["content"]) == text
    assert [(o["call_id"], o["name"], o.get("arguments", o.get("input"))) for o in final["output"]
            if o["type"] in ("function_call", "custom_tool_call")] == [tuple(v) for _,
                                                                       v in sorted(calls.items())]
    return {"text": text, "reasoning": reasoning, "calls": [tuple(v) for _, v in sorted(calls.items())]}


@st.composite
def stream_case(draw: Any, proto: str) -> tuple[Completion, list[Any]]:
    c = draw(completion(proto))
    ds = deltas_of(c, draw(st.integers(1, 6)))
    return c, ds[: draw(st.integers(0, len(ds)))]


def _check_stream(proto: str, case: tuple[Completion, list[Any]]) -> None:
    c, ds = case
    ad = get_adapter(proto)
    req = ad.parse_request({"model": "m", "messages": [], "max_tokens": 10, "stream": True,
                            "stream_options": {"include_usage": True}} if proto != "openai.responses"
                           else {"model": "m", "stream": True})
    enc = ad.stream_encoder(req, "sid")
    raw = enc.start() + b"".join(enc.feed(d) for d in ds) + enc.finish(c)
    assert enc.finish(c) == b"" and enc.error(500, "late") == b""  # closed streams stay closed
    if proto == "openai.chat":
        got = _rebuild_chat(raw)
        want_calls = [(t.id, t.name, t.arguments) for t in c.tool_calls]
    elif proto == "anthropic.messages":
        got = _rebuild_anthropic(raw)
        want_calls = [(t.id, t.name, orjson.loads(t.arguments)) for t in c.tool_calls]
    else:
        got = _rebuild_responses(raw)
        want_calls = [(t.id, t.name, t.arguments) for t in c.tool_calls]
    assert got["text"] == (c.text or "")
    assert got["reasoning"] == (c.reasoning or "")
    assert got["calls"] == want_calls


@SETTINGS
@given(stream_case("openai.chat"))
def test_chat_stream_reassembles(case: tuple[Completion, list[Any]]) -> None:
    _check_stream("openai.chat", case)


@SETTINGS
@given(stream_case("anthropic.messages"))
def test_anthropic_stream_reassembles(case: tuple[Completion, list[Any]]) -> None:
    _check_stream("anthropic.messages", case)


@SETTINGS
@given(stream_case("openai.responses"))
def test_responses_stream_reassembles(case: tuple[Completion, list[Any]]) -> None:
    _check_stream("openai.responses", case)


# =========================================================================== across protocols


def test_cross_protocol_rendering_is_accepted() -> None:
    """Any protocol's canonical request renders into a body every other protocol parses (forwarding
    upstream)."""
    from ares_gateway.protocols._shared import MARKERS

    from .test_anthropic_messages import claude_code_body
    from .test_openai_chat import mini_swe_agent_body
    from .test_openai_responses import codex_body

    protos = ["openai.chat", "anthropic.messages", "openai.responses"]
    codex = codex_body()
    codex["input"].append({"type": "item_reference", "id": "msg_1"})
    for src, body in zip(protos, [mini_swe_agent_body(), claude_code_body(), codex], strict=True):
        r = get_adapter(src).parse_request(body)
        for dst in protos:
            native = orjson.loads(orjson.dumps(get_adapter(dst).render_request(r)))
            if dst == "anthropic.messages":
                native.setdefault("max_tokens", 1024)
            for m in native.get("messages") or native.get("input") or []:
                assert not (set(m) & MARKERS), (src, dst, m)
            back = get_adapter(dst).parse_request(native)
            # the conversation's text and tool calls survive the trip
            assert [tc.name for m in back.messages for tc in m.tool_calls] == [
                tc.name for m in r.messages for tc in m.tool_calls], (src, dst)
            assert [m.tool_call_id for m in back.messages if m.role == "tool"] == [
                m.tool_call_id for m in r.messages if m.role == "tool"], (src, dst)
            assert "".join(m.text() for m in back.messages if m.role == "user") == "".join(
                m.text() for m in r.messages if m.role == "user"), (src, dst)
