"""A session's next request converts only what it adds (ParseMemo + the adapters' ``reuse``).

Every parse through a memo must equal a fresh parse of the same bytes, whatever the session sent
before; what is taken over must be the previous request's own objects (else nothing was saved);
and nothing is ever taken over on equal *values* with different bytes (``1`` and ``true``).
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ares_gateway.core.canonical import CanonicalRequest, Message, WireProtocol
from ares_gateway.http.body_parser import ParseMemo, parse_inline
from ares_gateway.protocols import RequestError, get_adapter

A, C, R = WireProtocol.ANTHROPIC_MESSAGES, WireProtocol.OPENAI_CHAT, WireProtocol.OPENAI_RESPONSES


def _fresh(protocol: WireProtocol, raw: bytes) -> CanonicalRequest:
    return get_adapter(protocol).parse_request(orjson.loads(raw))


def _dump(req: CanonicalRequest) -> Any:
    return req.model_dump(mode="json", exclude={"raw"})


def _through(memo: ParseMemo, protocol: WireProtocol, body: dict[str, Any], **dumps: Any) -> CanonicalRequest:
    raw = json.dumps(body, **dumps).encode()
    parsed = parse_inline(raw, protocol, memo)
    got = parsed.request
    assert got is not None
    assert _dump(got) == _dump(_fresh(protocol, raw))
    # Polled: the line's encoder gives pydantic's bytes, whatever it reused from the last request.
    assert parsed.encoder is not None
    assert parsed.encoder.encode(got) == got.model_dump_json(exclude={"raw"}).encode()
    return got


def _anthropic(turns: int, *, system: str = "You are Claude Code.", tools: int = 3,
               messages_first: bool = False) -> dict[str, Any]:
    msgs: list[dict[str, Any]] = [{"role": "user", "content": [{"type": "text", "text": "fix the bug"}]}]
    for i in range(turns):
        msgs.append({"role": "assistant", "content": [{"type": "text", "text": f"step {i}"},
                                                      {"type": "tool_use", "id": f"t{i}", "name": "Bash",
                                                       "input": {"command": f"ls {i}", "n": i}}]})
        msgs.append(
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": f"t{i}", "content": "ok"},
                                         {"type": "text", "text": "go on"}]})
    body = {"model": "claude", "max_tokens": 100, "system": [{"type": "text", "text": system}],
            "tools": [{"name": f"T{j}", "description": "d", "input_schema": {"type": "object"}}
                      for j in range(tools)],
            "messages": msgs, "stream": False}
    if messages_first:  # Claude Code's own order: what changes outside the list comes after it
        body = {"model": body.pop("model"), "messages": body.pop("messages"), **body}
    return body


def _chat(turns: int) -> dict[str, Any]:
    msgs: list[dict[str, Any]] = [{"role": "system", "content": "be brief"},
                                  {"role": "user", "content": "fix it"}]
    for i in range(turns):
        msgs.append({"role": "assistant", "content": None, "tool_calls": [
            {"id": f"c{i}", "type": "function",
             "function": {"name": "bash", "arguments": json.dumps({"cmd": i})}}]})
        msgs.append({"role": "tool", "tool_call_id": f"c{i}", "content": f"out {i}"})
    return {"model": "m", "messages": msgs,
            "tools": [{"type": "function", "function": {"name": "bash", "parameters": {"type": "object"}}}]}


def _responses(turns: int) -> dict[str, Any]:
    items: list[dict[str, Any]] = [
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "hi"}]}]
    for i in range(turns):
        items.append(
            {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": f"s{i}"}]})
        # Folds into the assistant message just before it: the message must never be shared.
        items.append({"type": "function_call", "call_id": f"f{i}", "name": "shell", "arguments": "{}"})
        items.append({"type": "function_call_output", "call_id": f"f{i}", "output": "ok"})
    return {"model": "m", "instructions": "sys", "input": items,
            "tools": [{"type": "function", "name": "shell", "parameters": {"type": "object"}}]}


def test_a_growing_anthropic_session_takes_over_its_history_and_tools() -> None:
    memo = ParseMemo()
    prev = _through(memo, A, _anthropic(3))
    before = _dump(prev)
    nxt = _through(memo, A, _anthropic(4))
    # The system message and every message of the shared items are the previous request's objects;
    # the last shared item is converted from its bytes too, which are the same: all shared.
    assert all(a is b for a, b in zip(prev.messages, nxt.messages, strict=False))
    assert len(nxt.messages) > len(prev.messages)
    assert nxt.tools is prev.tools
    assert _dump(prev) == before  # the earlier request was not changed by the later parse


def test_a_changed_system_or_tool_list_is_converted_again() -> None:
    for first_list in (False, True):
        memo = ParseMemo()
        plan = "You are Claude Code, now in plan mode."
        first = _through(memo, A, _anthropic(3, messages_first=first_list))
        other_system = _through(memo, A, _anthropic(4, system=plan, messages_first=first_list))
        assert other_system.tools is not first.tools and other_system.messages[0] is not first.messages[0]
        # With the list first, its items are still shared byte for byte: their messages are taken over
        # (with the system before it, the bodies differ before the list: all is read again).
        assert (other_system.messages[1] is first.messages[1]) is first_list
        more_tools = _through(memo, A, _anthropic(5, system=plan, tools=4, messages_first=first_list))
        assert len(more_tools.tools) == 4 and more_tools.tools is not other_system.tools
        assert (more_tools.messages[1] is other_system.messages[1]) is first_list


def test_an_edited_earlier_item_is_converted_again_from_there() -> None:
    memo = ParseMemo()
    _through(memo, A, _anthropic(5))
    edited = _anthropic(6)
    edited["messages"][3]["content"][0]["content"] = "compacted"
    prev_then = _through(memo, A, edited)
    assert prev_then.messages[4].content is not None


def test_a_number_that_grows_in_place_is_not_taken_for_the_same() -> None:
    # "n": 1 followed by more digits shares the bytes "1" with the previous body, but is another value.
    memo = ParseMemo()
    _through(memo, C, {"model": "m", "messages": [{"role": "user", "content": "a"}], "temperature": 1})
    got = _through(memo, C,
                   {"model": "m", "messages": [{"role": "user", "content": "a"}], "temperature": 1.5})
    assert got.sampling.temperature == 1.5


def test_equal_values_with_other_bytes_are_read_again() -> None:
    # Python says 1 == True: a memo comparing parsed values would take over a valid "is_error": true
    # for an invalid "is_error": 1. Compared as bytes, the new item is read, and refused.
    memo = ParseMemo()
    body = _anthropic(2)
    body["messages"][2]["content"][0]["is_error"] = True
    _through(memo, A, body)
    body["messages"].append({"role": "assistant", "content": "x"})
    body["messages"][2]["content"][0]["is_error"] = 1
    with pytest.raises(RequestError) as err:
        parse_inline(json.dumps(body).encode(), A, memo)
    assert err.value.param == "messages[2].content[0].is_error"


def test_an_invalid_new_item_after_a_shared_history_names_its_own_index() -> None:
    memo = ParseMemo()
    body = _chat(3)
    _through(memo, C, body)
    body["messages"].append({"role": 7, "content": "x"})
    with pytest.raises(RequestError) as err:
        parse_inline(json.dumps(body).encode(), C, memo)
    assert err.value.param is not None and err.value.param.startswith(
        f"messages[{len(body['messages']) - 1}]")


def test_side_calls_between_main_turns_keep_the_main_line() -> None:
    memo = ParseMemo()
    main = _through(memo, A, _anthropic(3))
    side = {"model": "claude-haiku", "max_tokens": 10,
            "messages": [{"role": "user", "content": "title this"}]}
    _through(memo, A, side)
    nxt = _through(memo, A, _anthropic(4))
    assert nxt.messages[1] is main.messages[1] and nxt.tools is main.tools
    _through(memo, A, side)
    assert _through(memo, A, _anthropic(5)).messages[1] is main.messages[1]
    _through(memo, C, _chat(2))  # another protocol on the same session: never taken for this one
    assert _through(memo, C, _chat(3)).messages[1] is not main.messages[1]


def test_chat_and_responses_sessions() -> None:
    memo = ParseMemo()
    prev = _through(memo, C, _chat(3))
    nxt = _through(memo, C, _chat(4))
    assert nxt.messages[:7] == prev.messages[:7] and nxt.messages[6] is prev.messages[6]
    assert nxt.tools is prev.tools
    memo = ParseMemo()
    r1 = _through(memo, R, _responses(2))
    before = _dump(r1)
    r2 = _through(memo, R, _responses(3))
    assert r2.tools is r1.tools and not any(a is b for a, b in zip(r1.messages, r2.messages, strict=False))
    assert _dump(r1) == before  # the fold into an assistant message touched only the new request's


def test_bodies_the_layout_cannot_follow_are_parsed_whole() -> None:
    memo = ParseMemo()
    twice = (b'{"model": "m", "messages": [{"role": "user", "content": "a"}], "messages": [{"role": "user", '
             b'"content": "b"}]}')
    for _ in range(2):
        got = parse_inline(twice, C, memo).request
        assert got is not None and _dump(got) == _dump(_fresh(C, twice))
    # Unicode before and inside the list: byte offsets, not character offsets.
    body = _anthropic(2, system="Ünïcødé 😀 system")
    _through(memo, A, body, ensure_ascii=False)
    body["messages"].append({"role": "user", "content": "ñ 😀"})
    _through(memo, A, body, ensure_ascii=False)


_item = st.sampled_from(["edit", "grow", "system", "tools", "shrink", "side", "same"])


@settings(max_examples=60, deadline=None)
@given(st.lists(_item, min_size=1, max_size=12), st.booleans())
def test_any_sequence_of_bodies_parses_as_a_fresh_parse(steps: list[str], pretty: bool) -> None:
    memo = ParseMemo()
    turns, system, tools, edit = 2, "sys", 2, 0
    for step in steps:
        if step == "grow":
            turns += 1
        elif step == "shrink":
            turns = max(0, turns - 2)
        elif step == "system":
            system += "!"
        elif step == "tools":
            tools += 1
        elif step == "edit":
            edit += 1
        if step == "side":
            _through(memo, A, {"model": "h", "max_tokens": 5, "messages": [{"role": "user", "content": "t"}]})
            continue
        body = _anthropic(turns, system=system, tools=tools, messages_first=pretty)
        if edit and len(body["messages"]) > 1:
            body["messages"][1]["content"][0]["text"] = f"edited {edit}"
        _through(memo, A, body, **({"indent": 1} if pretty else {}))
        chat = _chat(turns)
        chat["messages"][0]["content"] = system
        _through(memo, C, chat, **({"indent": 1} if pretty else {}))


async def test_a_real_client_session_over_http_polls_what_a_fresh_parse_gives(
    monkeypatch: pytest.MonkeyPatch) -> None:
    """Turns of the anthropic SDK over loopback, history growing with a side call between: every
    polled canonical form is what a fresh parse of the polled body gives, with the memo on, and the
    recorder takes the parse's layout instead of comparing the bodies again."""
    import anthropic

    from ares_gateway import Completion, Gateway
    from ares_gateway.core import record_codec

    compared: list[int] = []
    real = record_codec.continue_layout

    def spy(*args: Any, **kwargs: Any) -> Any:
        compared.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(record_codec, "continue_layout", spy)

    async with Gateway(port=0, data_dir=False, request_timeout=30) as gw:
        info = await gw.create_session()
        client = anthropic.AsyncAnthropic(base_url=info.base_url, api_key=info.token, max_retries=0)
        polled: list[dict[str, Any]] = []

        async def answer() -> None:
            while True:
                req = await gw.next_request(session=info.session_id, timeout=30)
                assert req is not None
                polled.append(orjson.loads(req.poll_json()))
                await gw.respond(req.id, Completion(text=f"answer {len(polled)}"))

        task = asyncio.create_task(answer())
        try:
            history: list[dict[str, Any]] = [{"role": "user", "content": "fix the bug"}]
            tools = [{"name": "Bash", "description": "run", "input_schema": {"type": "object"}}]
            for i in range(6):
                # Past the size under which a body is converted whole (a Claude Code system prompt is ~10 KB).
                got = await client.messages.create(model="claude-x", max_tokens=50,
                                                   system="You are Claude Code. " * 500,
                                                   tools=tools, messages=history)
                history += [{"role": "assistant", "content": got.content[0].text},
                            {"role": "user", "content": f"go on {i}"}]
                if i == 2:  # three main turns in a row: the recorder compared nothing itself
                    assert compared == []
                if i >= 3 and i % 2:
                    await client.messages.create(model="claude-haiku", max_tokens=5,
                                                 messages=[{"role": "user", "content": "a title"}])
        finally:
            task.cancel()
            await client.close()
        assert len(polled) == 8
        for item in polled:
            fresh = get_adapter(A).parse_request(item["request"])
            assert item["canonical"] == _dump(fresh)
        assert isinstance(gw.sessions.get(info.session_id).parse_memo, ParseMemo)
        log = gw.turn_log(info.session_id)
        assert [orjson.loads(t["request"]) if isinstance(t["request"], bytes) else t["request"]
                for t in log] \
            == [item["request"] for item in polled]
    assert compared  # after a side call on its line, it does compare


def test_only_the_new_items_are_decoded_and_the_body_shares_the_old_ones() -> None:
    memo = ParseMemo()
    first = parse_inline(json.dumps(_chat(3)).encode(), C, memo)
    raw = json.dumps(_chat(4)).encode()
    second = parse_inline(raw, C, memo)
    assert second.body == orjson.loads(raw)
    assert second.body["messages"][2] is first.body["messages"][2]  # not decoded again
    assert second.body["tools"] is first.body["tools"]
    assert second.request is not None and second.request.raw is second.body
    assert first.body["messages"] is not second.body["messages"] and len(first.body["messages"]) == 8


@pytest.mark.parametrize("token", [
    "NaN", "Infinity", "-Infinity", "1e999", "123456789012345678901234567890", '"\\ud800"', '"\\udc00x"',
    '{"a": 1, "a": 2}', "-0", "1.0", "[" * 300 + "]" * 300, '"caf\u00e9 \U0001f600"', "tru", '"unterminated',
])
def test_a_new_item_decodes_as_orjson_decodes_the_whole_body(token: str) -> None:
    """The scanner that finds the items' ends accepts what orjson refuses (NaN, lone surrogates):
    every new item must come out as a whole-body decode does, value or error."""
    memo = ParseMemo()
    base = _chat(3)
    parse_inline(json.dumps(base).encode(), C, memo)
    text = json.dumps(base)
    raw = (text[: text.index("]", text.rindex('"out 2"'))] + ', {"role": "user", "content": ' + token + "}"
           + text[text.index("]", text.rindex('"out 2"')):]).encode()
    try:
        want: Any = _dump(parse_inline(raw, C).request)  # type: ignore[arg-type]
    except RequestError as exc:
        want = ("error", exc.message, exc.param)
    try:
        got: Any = _dump(parse_inline(raw, C, memo).request)  # type: ignore[arg-type]
    except RequestError as exc:
        got = ("error", exc.message, exc.param)
    assert got == want


def test_the_canonical_form_of_a_growing_line_reuses_the_encoding_of_what_it_shares() -> None:
    memo = ParseMemo()
    first = parse_inline(json.dumps(_anthropic(30)).encode(), A, memo)
    assert first.encoder is not None and first.request is not None
    first.encoder.encode(first.request)
    pieces = list(first.encoder._pieces)
    second = parse_inline(json.dumps(_anthropic(31)).encode(), A, memo)
    assert second.encoder is first.encoder and second.request is not None
    out = second.encoder.encode(second.request)
    assert out == second.request.model_dump_json(exclude={"raw"}).encode()
    now = second.encoder._pieces
    assert len(now) == len(second.request.messages) > len(pieces)
    assert all(a is b for a, b in zip(pieces, now, strict=False))
    # An integer orjson cannot hold (put there in process): pydantic's encoding, the cache untouched.
    big = second.request.model_copy(update={"messages": [
        *second.request.messages, Message(role="user", content="x", extra={"big": 2**70})]})
    assert second.encoder.encode(big) == big.model_dump_json(exclude={"raw"}).encode()
    assert second.encoder._pieces is now


def test_converted_messages_share_one_fields_set_and_stay_independent() -> None:
    body = {"model": "m", "max_tokens": 8, "messages": [
        {"role": "user", "content": "one"}, {"role": "assistant", "content": "two"},
        {"role": "user", "content": [{"type": "text", "text": "three"}]}]}
    msgs = _fresh(A, json.dumps(body).encode()).messages
    assert len(msgs) == 3
    every = set(Message.model_fields)
    # One set for all (a set of eight names is 728 bytes: a long session holds thousands of messages).
    assert all(m.model_fields_set == every for m in msgs)
    assert msgs[0].__pydantic_fields_set__ is msgs[2].__pydantic_fields_set__
    # What pydantic does with it leaves the others as they were.
    msgs[0].content = "changed"
    copied = msgs[1].model_copy(update={"content": "copied"})
    assert copied.content == "copied" and msgs[1].content == "two" and msgs[2].model_fields_set == every
    assert copied.__pydantic_fields_set__ is not msgs[1].__pydantic_fields_set__
    assert msgs[1].model_dump(exclude_unset=True) == msgs[1].model_dump()


def test_an_item_sent_again_in_other_bytes_keeps_the_previous_strings_not_its_values() -> None:
    # Claude Code marks its last message for caching and moves the mark on the next turn: that message
    # comes again in other bytes. Its strings are the previous decoding's (the tree holds those), its
    # values and structure the new bytes' (1 is not true).
    memo = ParseMemo()
    first = _anthropic(2, messages_first=True)
    big = "file.txt\n" * 500
    first["messages"][-1]["content"] = [
        {"type": "tool_result", "tool_use_id": "t1", "content": big, "cache_control": {"type": "ephemeral"}},
        {"type": "text", "text": "n", "flag": 1}]
    before = _through(memo, A, first)
    second = json.loads(json.dumps(first))
    del second["messages"][-1]["content"][0]["cache_control"]
    second["messages"][-1]["content"][1]["flag"] = True
    second["messages"].append({"role": "assistant", "content": "done"})
    after = _through(memo, A, second)
    old_block, new_block = before.raw["messages"][4]["content"], after.raw["messages"][4]["content"]
    assert new_block is not old_block and "cache_control" not in new_block[0]
    assert new_block[0]["content"] is old_block[0]["content"]  # one copy of the long string
    assert new_block[1]["flag"] is True and old_block[1]["flag"] == 1 and old_block[1]["flag"] is not True
    tool = next(m for m in after.messages if m.role == "tool" and m.tool_call_id == "t1")
    assert tool.content == big and tool.content is old_block[0]["content"]  # the canonical form's too
