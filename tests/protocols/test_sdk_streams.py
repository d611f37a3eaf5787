"""The encoders' SSE bytes, served on loopback, parsed by the REAL openai / anthropic SDKs."""

from __future__ import annotations

import json
from typing import Any

import anthropic
import openai
import pytest

from ares_gateway.core.canonical import Completion, CompletionDelta, ToolCall, Usage
from ares_gateway.core.streaming import DeltaAccumulator
from ares_gateway.protocols import get_adapter

from ._helpers import deltas_of, encode, parse, rich_completion

MODES = ["synth", "deltas1", "deltas7", "half"]


def _deltas(c: Completion, mode: str) -> list[CompletionDelta]:
    if mode == "synth":
        return []
    if mode == "deltas1":
        return deltas_of(c, 1)
    if mode == "deltas7":
        return deltas_of(c, 7)
    # "half": some of everything was fed; finish() must emit the rest
    ds = deltas_of(c, 4)
    return ds[: len(ds) // 2]


# =========================================================================== chat completions

CHAT_BODY: dict[str, Any] = {
    "model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True,
    "stream_options": {"include_usage": True},
}


def _chat_accumulate(chunks: list[Any]) -> dict[str, Any]:
    text, reasoning, calls, finish, usage = "", "", {}, None, None
    ids = set()
    for ch in chunks:
        ids.add(ch.id)
        if ch.usage is not None:
            usage = ch.usage
        for choice in ch.choices:
            d = choice.delta
            text += d.content or ""
            reasoning += (d.model_extra or {}).get("reasoning_content") or ""
            for tc in d.tool_calls or []:
                slot = calls.setdefault(tc.index, {"id": None, "name": "", "arguments": ""})
                if tc.id:
                    slot["id"] = tc.id
                if tc.function is not None:
                    slot["name"] += tc.function.name or ""
                    slot["arguments"] += tc.function.arguments or ""
            if choice.finish_reason:
                finish = choice.finish_reason
    return {"text": text, "reasoning": reasoning, "calls": [calls[i] for i in sorted(calls)],
            "finish": finish, "usage": usage, "ids": ids}


@pytest.mark.parametrize("mode", MODES)
async def test_chat_stream_sdk(replay: Any, mode: str) -> None:
    c = rich_completion()
    req = parse("openai.chat", CHAT_BODY)
    replay.sse(encode("openai.chat", req, c, _deltas(c, mode)))
    client = replay.openai()
    stream = await client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": "hi"}], stream=True,
        stream_options={"include_usage": True},
    )
    got = _chat_accumulate([ch async for ch in stream])
    assert got["text"] == c.text
    assert got["reasoning"] == c.reasoning
    assert got["calls"] == [{"id": tc.id, "name": tc.name, "arguments": tc.arguments} for tc in c.tool_calls]
    assert got["finish"] == "tool_calls"
    assert got["ids"] == {"chatcmpl-abc123"}
    assert got["usage"].prompt_tokens == 1234 and got["usage"].completion_tokens == 56
    assert got["usage"].prompt_tokens_details.cached_tokens == 1000


async def test_chat_stream_helper_accumulates(replay: Any) -> None:
    """The SDK's own accumulator (chat.completions.stream) rebuilds the same message."""
    c = rich_completion()
    req = parse("openai.chat", {"model": "m", "messages": [{"role": "user", "content": "x"}], "stream": True})
    replay.sse(encode("openai.chat", req, c, deltas_of(c, 2)))
    async with replay.openai().chat.completions.stream(model="m",
                                                       messages=[{"role": "user", "content": "x"}]) as s:
        final = await s.get_final_completion()
    msg = final.choices[0].message
    assert msg.content == c.text
    assert [(t.id, t.function.name, t.function.arguments) for t in msg.tool_calls or []] == [
        (t.id, t.name, t.arguments) for t in c.tool_calls
    ]
    assert final.choices[0].finish_reason == "tool_calls"


async def test_chat_stream_no_usage_chunk_without_include_usage(replay: Any) -> None:
    req = parse("openai.chat", {"model": "m", "messages": [], "stream": True})
    chunks = encode("openai.chat", req, Completion(text="ok"))
    raw = b"".join(chunks)
    assert raw.endswith(b"data: [DONE]\n\n")
    assert b'"usage"' not in raw
    replay.sse(chunks)
    stream = await replay.openai().chat.completions.create(model="m", messages=[], stream=True)
    got = _chat_accumulate([ch async for ch in stream])
    assert got["text"] == "ok" and got["finish"] == "stop" and got["usage"] is None


async def test_chat_stream_error_raises(replay: Any) -> None:
    req = parse("openai.chat", CHAT_BODY)
    enc = get_adapter("openai.chat").stream_encoder(req, "x")
    replay.sse([enc.start(), enc.feed(CompletionDelta(text="par")), enc.error(500, "policy died")])
    stream = await replay.openai().chat.completions.create(model="m", messages=[], stream=True)
    with pytest.raises(openai.APIError, match="policy died"):
        async for _ in stream:
            pass


async def test_chat_nonstream_sdk(replay: Any) -> None:
    c = rich_completion()
    req = parse("openai.chat", {"model": "m", "messages": []})
    replay.json(get_adapter("openai.chat").render_response(c, req, "r1"))
    out = await replay.openai().chat.completions.create(model="m", messages=[])
    msg = out.choices[0].message
    assert out.id == "chatcmpl-r1" and out.object == "chat.completion"
    assert msg.content == c.text
    assert (msg.model_extra or {}).get("reasoning_content") == c.reasoning
    assert [(t.id, t.function.name, t.function.arguments) for t in msg.tool_calls or []] == [
        (t.id, t.name, t.arguments) for t in c.tool_calls
    ]
    assert out.choices[0].finish_reason == "tool_calls"
    assert out.usage is not None and out.usage.total_tokens == 1290


async def test_chat_error_body_sdk(replay: Any) -> None:
    ad = get_adapter("openai.chat")
    for status, exc in [(400, openai.BadRequestError), (401, openai.AuthenticationError),
                        (404, openai.NotFoundError), (429, openai.RateLimitError)]:
        replay.json(ad.error_body(status, f"boom {status}", param="messages"), status=status)
        with pytest.raises(exc) as ei:
            await replay.openai().chat.completions.create(model="m", messages=[])
        assert ei.value.body["message"] == f"boom {status}"  # type: ignore[index]


# =========================================================================== anthropic messages

ANTH_BODY: dict[str, Any] = {"model": "claude", "max_tokens": 100,
                             "messages": [{"role": "user", "content": "hi"}],
                             "stream": True}


@pytest.mark.parametrize("mode", MODES)
async def test_anthropic_stream_sdk(replay: Any, mode: str) -> None:
    c = rich_completion()
    c.extra["signature"] = "sig-xyz"
    req = parse("anthropic.messages", ANTH_BODY)
    replay.sse(encode("anthropic.messages", req, c, _deltas(c, mode)))
    texts: list[str] = []
    async with replay.anthropic().messages.stream(
        model="claude", max_tokens=100, messages=[{"role": "user", "content": "hi"}]
    ) as s:
        async for t in s.text_stream:
            texts.append(t)
        msg = await s.get_final_message()
    assert "".join(texts) == c.text
    assert msg.id == "msg_abc123"
    kinds = [b.type for b in msg.content]
    assert kinds == ["thinking", "text", "tool_use", "tool_use"]
    assert msg.content[0].thinking == c.reasoning  # type: ignore[union-attr]
    if mode == "synth":  # the signature rides on a thinking block still open at finish()
        assert msg.content[0].signature == "sig-xyz"  # type: ignore[union-attr]
    else:  # text started before any signature came: the stopped thinking block cannot take it
        assert msg.content[0].signature == ""  # type: ignore[union-attr]
    assert msg.content[1].text == c.text  # type: ignore[union-attr]
    tools = [(b.id, b.name, b.input) for b in msg.content if b.type == "tool_use"]
    assert tools == [(tc.id, tc.name, json.loads(tc.arguments)) for tc in c.tool_calls]
    assert msg.stop_reason == "tool_use"
    assert msg.usage.output_tokens == 56
    assert msg.usage.input_tokens == 234 and msg.usage.cache_read_input_tokens == 1000


async def test_anthropic_stream_event_order(replay: Any) -> None:
    c = Completion(text="hello", reasoning="think", tool_calls=[ToolCall(id="toolu_1", name="Bash",
                   arguments='{"command":"ls"}')])
    req = parse("anthropic.messages", ANTH_BODY)
    raw = b"".join(encode("anthropic.messages", req, c))
    events = [line[7:].decode() for line in raw.split(b"\n") if line.startswith(b"event: ")]
    assert events == [
        "message_start", "ping",
        "content_block_start", "content_block_delta", "content_block_stop",
        "content_block_start", "content_block_delta", "content_block_stop",
        "content_block_start", "content_block_delta", "content_block_stop",
        "message_delta", "message_stop",
    ]
    # every event line is followed by its data line and a blank line
    for block in raw.split(b"\n\n")[:-1]:
        ev, data = block.split(b"\n")
        assert ev.startswith(b"event: ") and data.startswith(b"data: ")
        assert json.loads(data[6:])["type"] == ev[7:].decode()


def _with_signature(c: Completion, sig: str, *, joined: bool = False) -> list[CompletionDelta]:
    """deltas_of(c, 5) with a signature delta after the reasoning (or on its last piece when ``joined``)."""
    ds = deltas_of(c, 5)
    last = max(i for i, d in enumerate(ds) if d.reasoning)
    if joined:
        ds[last] = ds[last].model_copy(update={"signature": sig})
    else:
        ds.insert(last + 1, CompletionDelta(signature=sig))
    return ds


def _events(raw: bytes) -> list[dict[str, Any]]:
    return [json.loads(line[6:]) for line in raw.split(b"\n") if line.startswith(b"data: ")]


@pytest.mark.parametrize("final_sig", [None, "sig-streamed", "sig-other"])
@pytest.mark.parametrize("joined", [False, True])
async def test_anthropic_stream_signature_delta(replay: Any, final_sig: str | None, joined: bool) -> None:
    """A streamed signature closes the thinking block; the final Completion cannot add a second one."""
    c = rich_completion()
    deltas = _with_signature(c, "sig-streamed", joined=joined)
    if final_sig is not None:
        c.extra["signature"] = final_sig
    req = parse("anthropic.messages", ANTH_BODY)
    chunks = encode("anthropic.messages", req, c, deltas)
    replay.sse(chunks)
    async with replay.anthropic().messages.stream(model="claude", max_tokens=100, messages=[]) as s:
        msg = await s.get_final_message()
    assert [b.type for b in msg.content] == ["thinking", "text", "tool_use", "tool_use"]
    assert msg.content[0].thinking == c.reasoning  # type: ignore[union-attr]
    assert msg.content[0].signature == "sig-streamed"  # type: ignore[union-attr]
    assert msg.content[1].text == c.text  # type: ignore[union-attr]
    # Anthropic's own order: thinking deltas, one signature_delta, the block's stop, then the text block.
    block0 = [(e["type"], (e.get("delta") or e.get("content_block") or {}).get("type"))
              for e in _events(b"".join(chunks)) if e.get("index") == 0]
    assert block0[0] == ("content_block_start", "thinking")
    assert block0[-2:] == [("content_block_delta", "signature_delta"), ("content_block_stop", None)]
    assert set(block0[1:-2]) == {("content_block_delta", "thinking_delta")}
    assert b"".join(chunks).count(b"signature_delta") == 1


async def test_anthropic_stream_signature_without_open_thinking(replay: Any) -> None:
    """A signature with no thinking block open opens one (empty thinking) to carry it."""
    req = parse("anthropic.messages", ANTH_BODY)
    deltas = [CompletionDelta(signature="sig-only"), CompletionDelta(text="hi")]
    replay.sse(encode("anthropic.messages", req, Completion(text="hi"), deltas))
    async with replay.anthropic().messages.stream(model="claude", max_tokens=100, messages=[]) as s:
        msg = await s.get_final_message()
    assert [(b.type, getattr(b, "thinking", None), getattr(b, "signature", None)) for b in msg.content] == [
        ("thinking", "", "sig-only"), ("text", None, None)]


def test_accumulator_keeps_signature() -> None:
    c = rich_completion()
    acc = DeltaAccumulator()
    for d in _with_signature(c, "sig-acc"):
        acc.add(d)
    got = acc.completion()
    assert got.extra == {"signature": "sig-acc"}
    assert (got.reasoning, got.text, got.tool_calls) == (c.reasoning, c.text, c.tool_calls)
    plain = DeltaAccumulator()
    for d in deltas_of(c, 5):
        plain.add(d)
    assert plain.completion().extra == {}


async def test_anthropic_stream_custom_tool_and_bad_args(replay: Any) -> None:
    """A custom (free-form) call streams as {"input": ...}; non-JSON arguments never break the SDK."""
    c = Completion(tool_calls=[
        ToolCall(id="toolu_1", name="apply_patch", type="custom", arguments='*** Begin "Patch"\n+x\n'),
        ToolCall(id="toolu_2", name="Bash", arguments="not json"),
    ])
    req = parse("anthropic.messages", ANTH_BODY)
    for deltas in ([], deltas_of(Completion(tool_calls=c.tool_calls[:1]), 3)):
        replay.sse(encode("anthropic.messages", req, c, deltas))
        async with replay.anthropic().messages.stream(model="claude", max_tokens=100, messages=[]) as s:
            msg = await s.get_final_message()
        assert [(b.name, b.input) for b in msg.content] == [  # type: ignore[union-attr]
            ("apply_patch", {"input": '*** Begin "Patch"\n+x\n'}), ("Bash", {})]


async def test_anthropic_stream_error_raises(replay: Any) -> None:
    req = parse("anthropic.messages", ANTH_BODY)
    enc = get_adapter("anthropic.messages").stream_encoder(req, "x")
    replay.sse([enc.start(), enc.feed(CompletionDelta(text="par")), enc.error(529, "overloaded now")])
    with pytest.raises(anthropic.APIStatusError, match="overloaded now"):
        async with replay.anthropic().messages.stream(model="claude", max_tokens=100, messages=[]) as s:
            await s.get_final_message()


async def test_anthropic_nonstream_sdk(replay: Any) -> None:
    c = rich_completion()
    c.extra["signature"] = "sig"
    req = parse("anthropic.messages", {**ANTH_BODY, "stream": False})
    replay.json(get_adapter("anthropic.messages").render_response(c, req, "m1"))
    msg = await replay.anthropic().messages.create(model="claude", max_tokens=100, messages=[])
    assert msg.id == "msg_m1" and msg.stop_reason == "tool_use"
    assert [b.type for b in msg.content] == ["thinking", "text", "tool_use", "tool_use"]
    assert msg.content[0].signature == "sig"  # type: ignore[union-attr]
    assert [b.input for b in msg.content[2:]] == [json.loads(t.arguments) for t in c.tool_calls]  # type: ignore[union-attr]


async def test_anthropic_error_body_sdk(replay: Any) -> None:
    ad = get_adapter("anthropic.messages")
    for status, exc in [(400, anthropic.BadRequestError), (401, anthropic.AuthenticationError),
                        (404, anthropic.NotFoundError), (429, anthropic.RateLimitError),
                        (500, anthropic.InternalServerError)]:
        replay.json(ad.error_body(status, f"boom {status}"), status=status)
        with pytest.raises(exc) as ei:
            await replay.anthropic().messages.create(model="claude", max_tokens=10, messages=[])
        assert ei.value.body["error"]["message"] == f"boom {status}"  # type: ignore[index]


# =========================================================================== responses

RESP_BODY: dict[str, Any] = {"model": "gpt-5", "input": "hi", "stream": True}


@pytest.mark.parametrize("mode", MODES)
async def test_responses_stream_sdk(replay: Any, mode: str) -> None:
    c = rich_completion(custom=True)
    req = parse("openai.responses", RESP_BODY)
    replay.sse(encode("openai.responses", req, c, _deltas(c, mode)))
    async with replay.openai().responses.stream(model="gpt-5", input="hi") as s:
        text_deltas = [ev.delta async for ev in s if ev.type == "response.output_text.delta"]
        final = await s.get_final_response()
    assert "".join(text_deltas) == c.text
    assert final.id == "resp_abc123" and final.status == "completed"
    assert [o.type for o in final.output] == ["reasoning", "message", "function_call", "function_call",
                                              "custom_tool_call"]
    assert final.output_text == c.text
    assert final.output[0].summary[0].text == c.reasoning  # type: ignore[union-attr]
    calls = [(o.call_id, o.name, o.arguments) for o in final.output if o.type == "function_call"]
    assert calls == [(t.id, t.name, t.arguments) for t in c.tool_calls[:2]]
    custom = final.output[4]
    assert (custom.call_id, custom.name,
            custom.input) == ("call_c3", "apply_patch", c.tool_calls[2].arguments)  # type: ignore[union-attr]
    assert final.usage is not None and final.usage.input_tokens == 1234
    assert final.usage.input_tokens_details.cached_tokens == 1000


async def test_responses_stream_raw_events(replay: Any) -> None:
    c = rich_completion()
    req = parse("openai.responses", RESP_BODY)
    replay.sse(encode("openai.responses", req, c, deltas_of(c, 5)))
    stream = await replay.openai().responses.create(model="gpt-5", input="hi", stream=True)
    events = [ev async for ev in stream]
    types = [e.type for e in events]
    assert types[:2] == ["response.created", "response.in_progress"]
    assert types[-1] == "response.completed"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    for t in ["response.output_item.added", "response.content_part.added", "response.output_text.delta",
              "response.output_text.done", "response.content_part.done", "response.output_item.done",
              "response.function_call_arguments.delta", "response.function_call_arguments.done",
              "response.reasoning_summary_part.added", "response.reasoning_summary_text.delta",
              "response.reasoning_summary_text.done", "response.reasoning_summary_part.done"]:
        assert t in types, t
    args = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta"
                   and e.output_index == 2)
    assert args == c.tool_calls[0].arguments
    # message item: added -> part added -> deltas -> text done -> part done -> item done
    msg_events = [e.type for e in events if getattr(e, "output_index", None) == 1]
    assert msg_events[0] == "response.output_item.added" and msg_events[-1] == "response.output_item.done"
    assert msg_events[-3:-1] == ["response.output_text.done", "response.content_part.done"]


async def test_responses_stream_incomplete(replay: Any) -> None:
    req = parse("openai.responses", RESP_BODY)
    replay.sse(encode("openai.responses", req, Completion(text="trunc", finish_reason="length")))
    stream = await replay.openai().responses.create(model="gpt-5", input="hi", stream=True)
    events = [ev async for ev in stream]
    assert events[-1].type == "response.incomplete"
    assert events[-1].response.incomplete_details.reason == "max_output_tokens"  # type: ignore[union-attr]


async def test_responses_stream_error(replay: Any) -> None:
    req = parse("openai.responses", RESP_BODY)
    enc = get_adapter("openai.responses").stream_encoder(req, "x")
    replay.sse([enc.start(), enc.feed(CompletionDelta(text="par")), enc.error(500, "policy died")])
    stream = await replay.openai().responses.create(model="gpt-5", input="hi", stream=True)
    events = [ev async for ev in stream]
    assert [e.type for e in events][-2:] == ["error", "response.failed"]
    assert events[-2].message == "policy died"  # type: ignore[union-attr]
    assert events[-1].response.error.message == "policy died"  # type: ignore[union-attr]


async def test_responses_nonstream_sdk(replay: Any) -> None:
    c = rich_completion(custom=True)
    req = parse("openai.responses", {"model": "gpt-5", "input": "hi"})
    replay.json(get_adapter("openai.responses").render_response(c, req, "r9"))
    out = await replay.openai().responses.create(model="gpt-5", input="hi")
    assert out.id == "resp_r9" and out.status == "completed"
    assert out.output_text == c.text
    assert [o.type for o in out.output] == ["reasoning", "message", "function_call", "function_call",
                                            "custom_tool_call"]
    assert out.usage is not None and out.usage.output_tokens == 56


async def test_responses_error_body_sdk(replay: Any) -> None:
    replay.json(get_adapter("openai.responses").error_body(401, "bad key"), status=401)
    with pytest.raises(openai.AuthenticationError, match="bad key"):
        await replay.openai().responses.create(model="gpt-5", input="hi")


async def test_openai_streams_ignore_signature_delta(replay: Any) -> None:
    """Chat and Responses have no place for an Anthropic signature: the delta adds no bytes."""
    c = rich_completion()
    deltas = _with_signature(c, "sig-anthropic")
    for proto, body in (("openai.chat", CHAT_BODY), ("openai.responses", RESP_BODY)):
        enc = get_adapter(proto).stream_encoder(parse(proto, body), "abc123")
        enc.start()
        assert enc.feed(CompletionDelta(signature="sig-anthropic")) == b""
        raw = b"".join(encode(proto, parse(proto, body), c, deltas))
        assert b"sig-anthropic" not in raw
    replay.sse(encode("openai.chat", parse("openai.chat", CHAT_BODY), c, deltas))
    stream = await replay.openai().chat.completions.create(model="m", messages=[], stream=True)
    got = _chat_accumulate([ch async for ch in stream])
    assert (got["text"], got["reasoning"], got["finish"]) == (c.text, c.reasoning, "tool_calls")
    replay.sse(encode("openai.responses", parse("openai.responses", RESP_BODY), c, deltas))
    async with replay.openai().responses.stream(model="gpt-5", input="hi") as s:
        final = await s.get_final_response()
    assert final.output_text == c.text
    assert final.output[0].summary[0].text == c.reasoning  # type: ignore[union-attr]
    assert final.output[0].encrypted_content is None  # type: ignore[union-attr]


def test_usage_roundtrip_through_native() -> None:
    u = Usage(input_tokens=10, output_tokens=3, cached_input_tokens=4, reasoning_tokens=1)
    for proto in ("openai.chat", "openai.responses"):
        ad = get_adapter(proto)
        req = parse(proto, {"model": "m", "messages": []} if proto == "openai.chat" else {"model": "m"})
        assert ad.parse_response(ad.render_response(Completion(text="x", usage=u), req, "i")).usage == u
    ad = get_adapter("anthropic.messages")
    req = parse("anthropic.messages", ANTH_BODY)
    got = ad.parse_response(ad.render_response(Completion(text="x", usage=u), req, "i")).usage
    assert got is not None and (got.input_tokens, got.output_tokens, got.cached_input_tokens) == (10, 3, 4)
