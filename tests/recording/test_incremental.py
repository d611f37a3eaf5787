"""Incremental recording: bodies stored as what is new, token ids kept as int32 arrays.

Each turn's body is encoded against the previous turn of its line; these tests check that the
turn log gives back every body exactly through appends, edits inside the history, compactions,
repeats and a restart, that the common case (an agent appending to its history) does not re-digest
the history message by message, and that token ids never become lists of Python ints.
"""

from __future__ import annotations

import asyncio
import copy
import sqlite3
import time
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
import orjson
import pytest

import ares_gateway.core.record_codec as recorder_mod
from ares_gateway import Completion, Gateway, TokenRecord
from ares_gateway.core.canonical import CanonicalRequest, WireProtocol
from ares_gateway.core.errors import InvalidAnswerError
from ares_gateway.core.recorder import RecordedTurn
from ares_gateway.core.session_recorder import SessionRecorder
from ares_gateway.core.store import TurnStore
from ares_gateway.core.token_ids import encode_token_ids
from ares_gateway.protocols import get_adapter

ANTH = WireProtocol.ANTHROPIC_MESSAGES


def _msg(role: str, text: str) -> dict[str, Any]:
    return {"role": role, "content": [{"type": "text", "text": text}]}


def _body(messages: list[dict[str, Any]], system: str = "You are a coding agent.") -> dict[str, Any]:
    return {
        "model": "claude-x",
        "max_tokens": 1000,
        "system": [{"type": "text", "text": system}],
        "tools": [{"name": "bash", "description": "run", "input_schema": {"type": "object"}}],
        "metadata": {"user_id": "u"},
        "messages": messages,
    }


def _turn(body: dict[str, Any], i: int, sid: str = "s", tokens: TokenRecord | None = None,
          request: CanonicalRequest | None = None) -> RecordedTurn:
    return RecordedTurn(
        session_id=sid, request_id=f"r{i}", protocol=ANTH, raw_body=orjson.dumps(body), request=request,
        completion=Completion(text=f"answer {i}", tokens=tokens), side_call=False, timestamp=time.time(),
        latency=0.01,
    )


def _history() -> list[dict[str, Any]]:
    """The bodies of a session whose history is appended to, edited inside, compacted and repeated."""
    msgs = [_msg("user", "fix the bug")]
    bodies = [_body(copy.deepcopy(msgs))]
    for i in range(4):  # appends
        msgs += [_msg("assistant", f"step {i}"), _msg("user", f"result {i} " * 50)]
        bodies.append(_body(copy.deepcopy(msgs)))
    msgs[2]["content"][0]["text"] = "an edited step"  # an edit inside the history
    bodies.append(_body(copy.deepcopy(msgs)))
    msgs = [_msg("user", "summary of the work so far"), *msgs[-2:]]  # a compaction
    bodies.append(_body(copy.deepcopy(msgs)))
    bodies.append(_body(copy.deepcopy(msgs)))  # the same body again
    msgs.append(_msg("assistant", "more"))
    # system changed too
    bodies.append(_body(copy.deepcopy(msgs), system="You are a coding agent. New reminder."))
    msgs = msgs[:2]  # the history cut short
    bodies.append(_body(copy.deepcopy(msgs)))
    return bodies


@pytest.mark.parametrize("durable", [False, True])
def test_turn_log_gives_back_every_body_exactly(tmp_path: Path, durable: bool) -> None:
    store = TurnStore(tmp_path / "d") if durable else None
    try:
        rec = SessionRecorder(store=store)
        bodies = _history()
        for i, body in enumerate(bodies):
            rec(_turn(body, i))
        log = rec.turn_log("s")
        assert [t["request"] for t in log] == bodies
        assert [t["completion"]["text"] for t in log] == [f"answer {i}" for i in range(len(bodies))]
    finally:
        if store is not None:
            store.close()


def test_the_list_boundary_check_catches_a_grown_last_item() -> None:
    # A list whose serialization starts with the old one's bytes although its last item changed:
    # [.., 12] then [.., 123]. Only an item boundary after the old bytes makes it a prefix.
    rec = SessionRecorder()
    u = _msg("user", "hi")
    tails: list[list[Any]] = [[12], [123], [123, [4]], [123, [4, 5]], [123, [4, 5], "a"], [123, [4, 5], "ab"]]
    bodies = [{"model": "m", "max_tokens": 10, "messages": [u, *tail]} for tail in tails]
    # The encoder is generic over the list's items; a parsed stand-in spares them the protocol's checks.
    parsed = get_adapter(ANTH).parse_request(_body([u])).model_copy(update={"raw": {}})
    for i, body in enumerate(bodies):
        rec(_turn(body, i, request=parsed))
    assert [t["request"] for t in rec.turn_log("s")] == bodies


def test_a_restarted_recorder_continues_the_delta_encoding(tmp_path: Path) -> None:
    bodies = _history()
    with TurnStore(tmp_path / "d") as store:
        rec = SessionRecorder(store=store)
        for i, body in enumerate(bodies[:3]):
            rec(_turn(body, i))
    with TurnStore(tmp_path / "d") as store:
        rec = SessionRecorder(store=store)
        rec.known({"s"})
        for i, body in enumerate(bodies[3:], start=3):
            rec(_turn(body, i))
        assert [t["request"] for t in rec.turn_log("s")] == bodies
        # The first turn after the restart was stored as a delta: only its two new messages.
        rows, damaged = store.load_turns("s")
        assert not damaged
        assert len(rows[3][1]) < len(rows[1][1]) + 400


def test_an_appended_history_is_not_re_digested_message_by_message(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = 0
    real = recorder_mod._digest

    def counting(value: Any) -> bytes:
        nonlocal calls
        calls += 1
        return real(value)

    monkeypatch.setattr(recorder_mod, "_digest", counting)
    for moving_mark in (False, True):
        rec = SessionRecorder()
        msgs = [_msg("user", "go")]
        per_turn: list[int] = []
        sent = []
        for i in range(60):
            body = _body(copy.deepcopy(msgs))
            if moving_mark:
                # As Claude Code does: a cache_control mark on the last message only, so the
                # previous turn's last message changes every turn.
                body["messages"][-1]["content"][-1]["cache_control"] = {"type": "ephemeral"}
            sent.append(body)
            calls = 0
            rec(_turn(body, i))
            per_turn.append(calls)
            msgs += [_msg("assistant", f"step {i}"), _msg("user", f"out {i}")]
        # The two new messages and (with the moving mark) the changed one, whatever the history's
        # length; the top-level fields, their bytes unchanged, are not digested again (the first
        # encoder digested every message every turn).
        assert max(per_turn[1:]) == 2 + moving_mark, per_turn
        assert [t["request"] for t in rec.turn_log("s")] == sent


def test_token_records_hold_int32_arrays_from_every_form() -> None:
    for given in ([5, 6, 7], encode_token_ids([5, 6, 7]), np.array([5, 6, 7], dtype=np.int64)):
        rec = TokenRecord(prompt_ids=given, output_ids=[8], output_logprobs=[-0.5])
        assert isinstance(rec.prompt_ids, np.ndarray) and rec.prompt_ids.dtype == np.int32
        assert rec.prompt_ids.tolist() == [5, 6, 7]
        assert rec.output_logprobs.dtype == np.float64
        assert rec.model_dump() == {"prompt_ids": [5, 6, 7], "output_ids": [8], "output_logprobs": [-0.5],
                                    "finish_reason": None}
        assert TokenRecord.model_validate_json(rec.model_dump_json()) == rec
    assert TokenRecord(prompt_ids=[1], output_ids=[2]) != TokenRecord(prompt_ids=[1], output_ids=[3])
    assert TokenRecord.model_json_schema()["properties"]["prompt_ids"]["type"] == "array"
    with pytest.raises(ValueError, match="one logprob per output token"):
        TokenRecord(prompt_ids=[1], output_ids=[2, 3], output_logprobs=[-1.0])
    with pytest.raises(ValueError, match=">= 0"):
        TokenRecord(prompt_ids=[1, -1], output_ids=[2])
    with pytest.raises(ValueError, match="must be integers"):
        TokenRecord(prompt_ids=[1, 2.5], output_ids=[2])


async def test_respond_keeps_ids_as_arrays_and_copies_the_callers_buffer() -> None:
    seen: list[RecordedTurn] = []
    async with Gateway(port=0, data_dir=False, recorder=seen.append) as gw, aiohttp.ClientSession() as http:
        info = await gw.create_session("t")
        post = asyncio.ensure_future(
            http.post(f"{info.base_url}/v1/messages", json=_body([_msg("user", "hi")]),
                      headers={"authorization": f"Bearer {info.token}",
                               "anthropic-version": "2023-06-01"}))
        req = await gw.next_request(session="t", timeout=10)
        assert req is not None
        prompt = np.arange(1000, dtype=np.int32)
        await gw.respond(req.id, "x", tokens={"prompt_ids": prompt, "output_ids": [7, 8]})
        prompt[:] = 0  # the policy reuses its buffer
        (await post).release()
        (turn,) = seen
        tokens = turn.completion.tokens
        assert (tokens is not None and tokens.prompt_ids.dtype == np.int32
                and tokens.output_ids.dtype == np.int32)
        assert tokens.prompt_ids.tolist() == list(range(1000))
        (s,) = gw.trajectory("t")
        assert s.tokens.tolist() == [*range(1000), 7, 8]
        with pytest.raises(InvalidAnswerError):
            await gw.respond(req.id, "again", tokens={"prompt_ids": [1], "output_ids": [2], "extra": 1})


def _conversations() -> list[tuple[WireProtocol, dict[str, Any], str]]:
    """A conversation in each protocol, with the items that fold into their neighbours."""
    anth = {"model": "c", "max_tokens": 100, "system": "be brief", "messages": [
        {"role": "user", "content": [{"type": "text", "text": "fix it"}]},
        {"role": "assistant", "content": [{"type": "thinking", "thinking": "hm", "signature": "s1"},
                                          {"type": "text", "text": "looking"},
                                          {"type": "tool_use", "id": "t1", "name": "bash",
                                           "input": {"c": "ls"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "a.py"},
                                     {"type": "text", "text": "<system-reminder>x</system-reminder>"}]},
        {"role": "assistant",
         "content": [{"type": "tool_use", "id": "t2", "name": "bash", "input": {"c": "cat"}},
                     {"type": "tool_use", "id": "t3", "name": "bash", "input": {"c": "pwd"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t2", "content": "x"},
                                     {"type": "tool_result", "tool_use_id": "t3", "content": "/r",
                                      "is_error": True}]},
        {"role": "assistant", "content": "done"},
        {"role": "user", "content": "thanks"},
    ]}
    chat = {"model": "m", "messages": [
        {"role": "system", "content": "sys"},
        {"role": "user", "content": "fix it"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "bash", "arguments": "{\"c\": \"ls\"}"}},
            {"id": "c2", "type": "function", "function": {"name": "bash", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "a.py"},
        {"role": "tool", "tool_call_id": "c2", "content": "b"},
        {"role": "assistant", "content": "done", "reasoning_content": "ok"},
        {"role": "user", "content": [{"type": "text", "text": "thanks"}]},
    ]}
    fc = {"type": "function_call", "call_id": "call_1", "name": "exec", "arguments": "{\"cmd\":\"ls\"}"}
    responses = {"model": "g", "instructions": "be brief", "input": [
        {"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "rules"}]},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "fix it"}]},
        {"type": "reasoning", "id": "rs_1", "summary": [{"type": "summary_text", "text": "plan"}],
         "encrypted_content": "e1"},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "running"}]},
        fc,
        {**fc, "call_id": "call_2", "arguments": "{\"cmd\":\"pwd\"}"},
        {"type": "function_call_output", "call_id": "call_1", "output": "a.py"},
        {"type": "function_call_output", "call_id": "call_2", "output": "/r"},
        {"type": "reasoning", "id": "rs_2", "summary": [], "encrypted_content": "e2"},
        {"type": "custom_tool_call", "call_id": "call_3", "name": "apply_patch", "input": "*** Begin Patch"},
        {"type": "custom_tool_call_output", "call_id": "call_3", "output": "ok"},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "done"}]},
        {"role": "user", "content": "thanks"},
    ]}
    return [(WireProtocol.ANTHROPIC_MESSAGES, anth, "messages"), (WireProtocol.OPENAI_CHAT, chat, "messages"),
            (WireProtocol.OPENAI_RESPONSES, responses, "input")]


@pytest.mark.parametrize("mark", [False, True])
@pytest.mark.parametrize("step", [1, 2, 3])
@pytest.mark.parametrize("conv", range(3))
def test_reused_chat_messages_equal_a_full_conversion(conv: int, step: int, mark: bool) -> None:
    # The tree is handed the previous turn's chat dicts for the history a body kept; at every cut of
    # every conversation (an item that folds into the one before it included), with the last item
    # marked or not (as Claude Code moves its cache_control mark to the last message every turn),
    # they must be what converting the whole request gives.
    proto, whole, key = _conversations()[conv]
    rec = SessionRecorder()
    items = whole[key]
    reused = 0
    for turn, n in enumerate(range(1, len(items) + 1, step)):
        cut = copy.deepcopy(items[:n])
        if mark:
            last = cut[-1]
            if proto == ANTH and isinstance(last["content"], list):
                last["content"][-1]["cache_control"] = {"type": "ephemeral"}
            else:
                last["x_mark"] = True  # kept in the canonical message's extra
        body = {**whole, key: cut}
        request = get_adapter(proto).parse_request(body)
        tokens = TokenRecord(prompt_ids=list(range(10 * turn + 1)), output_ids=[10 * turn + 1])
        line = rec._states["s"].lines[False] if "s" in rec._states else None
        before = None if line is None else line.chat
        rec(RecordedTurn(session_id="s", request_id=f"r{turn}", protocol=proto, raw_body=orjson.dumps(body),
                         request=request, completion=Completion(text="x", tokens=tokens), side_call=False,
                         timestamp=time.time(), latency=0.0))
        line = rec._states["s"].lines[False]
        assert line.chat == [m.to_chat_dict() for m in request.messages], (proto, n)
        if before is not None and line.chat and before and line.chat[0] is before[0]:
            reused += 1
    assert reused >= (len(items) // step) - (3 if mark else 2)  # the reuse did happen


def test_a_damaged_record_in_the_middle_costs_only_the_turns_up_to_the_next_keyframe(tmp_path: Path) -> None:
    msgs = [_msg("user", "go")]
    bodies = []
    with TurnStore(tmp_path / "d") as store:
        rec = SessionRecorder(store=store, keyframe_every=4)
        for i in range(12):
            bodies.append(_body(copy.deepcopy(msgs)))
            tokens = TokenRecord(prompt_ids=list(range(5 * i + 3)), output_ids=[5 * i + 3, 5 * i + 4])
            rec(_turn(bodies[-1], i, tokens=tokens))
            msgs += [_msg("assistant", f"step {i}"), _msg("user", f"out {i}")]
        # Keyframes (stored whole, continuing nothing) are turns 1, 5 and 9; the rest are deltas.
        whole = [seq for seq, d in rec._decoded("s") if "base" not in d["header"]["body"]
                 and d["header"]["tok"]["base"] is None]
        assert whole == [1, 5, 9]
    with sqlite3.connect(tmp_path / "d" / "gateway.sqlite3") as db:
        (payload,) = db.execute("SELECT payload FROM turns WHERE seq = 3").fetchone()
        # a bit rot
        db.execute("UPDATE turns SET payload = ? WHERE seq = 3", (bytes([payload[0] ^ 0xFF]) + payload[1:],))
        db.execute("UPDATE turns SET payload = 'edited by hand' WHERE seq = 11")  # text where a blob was
    with TurnStore(tmp_path / "d") as store:
        rec = SessionRecorder(store=store, keyframe_every=4)
        rec.known({"s"})
        log = rec.turn_log("s")
        # Turn 3 fails its CRC and turn 4 continues it; turn 5 is a keyframe and decodes, and so do the
        # rest but turn 11 (text) and turn 12 (which continues it). Request ids are 0-based.
        kept = (0, 1, 4, 5, 6, 7, 8, 9)
        assert [int(t["request_id"][1:]) for t in log] == list(kept)
        assert [t["request"] for t in log] == [bodies[i] for i in kept]
        assert sorted(d.seq for d in rec.damaged["s"]) == [3, 4, 11, 12]
        assert log[-1]["completion"]["tokens"]["prompt_ids"] == list(range(5 * 9 + 3))


def test_the_kept_history_is_reused_across_keyframes_and_matched_by_identity() -> None:
    # A keyframe stores every field, but none changed: the chat dicts of the kept history are still
    # reused, and the message tree holds the very same objects (so it matches them by identity).
    rec = SessionRecorder(keyframe_every=3)
    msgs = [_msg("user", "go")]
    first: dict[str, Any] | None = None
    for i in range(10):
        body = _body(copy.deepcopy(msgs))
        body["messages"][-1]["content"][-1]["cache_control"] = {"type": "ephemeral"}
        tokens = TokenRecord(prompt_ids=list(range(3 * i + 1)), output_ids=[3 * i + 1, 3 * i + 2])
        rec(_turn(body, i, tokens=tokens))
        chat = rec._states["s"].lines[False].chat
        assert chat is not None
        if i == 1:
            first = chat[0]  # turn 2 kept nothing of turn 1's one message (its mark moved)
        elif i > 1:
            assert chat[0] is first, i  # the system message, reused every turn, keyframes included
        raws = rec._tm._sessions["s"].main._path_raws
        assert all(raws[j] is chat[j] for j in range(len(chat))), i
        msgs += [_msg("assistant", f"step {i}"), _msg("user", f"out {i}")]


def _repack(payload: bytes, edit: Any) -> bytes:
    """A record with its header edited (as another version of the writer would have written it)."""
    data = recorder_mod.zlib.decompress(payload[1:]) if payload[:1] == b"Z" else payload[1:]
    (n,) = recorder_mod._HEADER.unpack_from(data)
    header = orjson.loads(data[4 : 4 + n])
    edit(header)
    return recorder_mod.pack(header, bytes(data[4 + n :]))


def test_records_carry_their_format_version_and_old_and_unknown_versions_are_told_apart() -> None:
    rec = SessionRecorder(keyframe_every=0)
    msgs = [_msg("user", "go")]
    for i in range(3):
        rec(_turn(_body(copy.deepcopy(msgs)), i,
                  tokens=TokenRecord(prompt_ids=[1, 2, 3 + i], output_ids=[9])))
        msgs += [_msg("assistant", f"step {i}"), _msg("user", f"out {i}")]
    payloads = list(rec._records("s"))
    decoded = [recorder_mod.Decoder().decode(seq, p) for seq, p in payloads[:1]]
    assert decoded[0]["header"]["v"] == recorder_mod.FORMAT_VERSION == 1
    # A record of the writer before the version key (no "v") reads as version 1, with its deltas.
    dec = recorder_mod.Decoder()
    old = [dec.decode(seq, _repack(p, lambda h: h.pop("v"))) for seq, p in payloads]
    assert [d["body"] for d in old] == [t["request"] for t in rec.turn_log("s")]
    assert old[2]["prompt_ids"].tolist() == [1, 2, 5]
    # A version this reader does not know is refused, saying which, not misread.
    with pytest.raises(ValueError, match="record format version 2"):
        recorder_mod.Decoder().decode(1, _repack(payloads[0][1], lambda h: h.update(v=2)))
