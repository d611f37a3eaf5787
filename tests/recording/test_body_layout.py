"""The shared history found in the raw bytes, so that a turn's recording cost stays flat.

:mod:`ares_gateway.core._body_layout` compares a body's bytes with the previous turn's and reads
only the bytes after the shared items. These tests check it against the items compared as values,
over random edits and the ways real clients write JSON, that a body it cannot vouch for (the list's
key twice, a list changed before its end) falls back, and that through the recorder the turn log
still gives back every body exactly while reading only the new items.
"""

from __future__ import annotations

import copy
import json
import random
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import orjson
import pytest

import ares_gateway.core._body_layout as layout_mod
import ares_gateway.core.record_codec as recorder_mod
import ares_gateway.core.session_recorder as session_mod
from ares_gateway import Completion, TokenRecord
from ares_gateway.core._body_layout import continue_layout, layout_of
from ares_gateway.core.canonical import WireProtocol
from ares_gateway.core.recorder import RecordedTurn
from ares_gateway.core.session_recorder import SessionRecorder
from ares_gateway.core.store import TurnStore
from ares_gateway.protocols import get_adapter

ANTH = WireProtocol.ANTHROPIC_MESSAGES

#: How clients write JSON: compact (Node's JSON.stringify, serde_json, orjson), Python's json.dumps
#: defaults (", " and ": ", non-ASCII escaped), indented, and raw UTF-8.
WRITERS: dict[str, Callable[[Any], bytes]] = {
    "compact": orjson.dumps,
    "python": lambda v: json.dumps(v).encode(),
    "indented": lambda v: json.dumps(v, indent=2).encode(),
    "utf8": lambda v: json.dumps(v, ensure_ascii=False, separators=(",", ":")).encode(),
}


def _item(rng: random.Random, i: int) -> Any:
    kind = rng.randrange(6)
    if kind == 0:
        return rng.randrange(1000)  # numbers: "12" may grow into "123"
    if kind == 1:
        return f"str {i} é ✓ \"q\" \\ {rng.random()}"
    if kind == 2:
        return [i, None, True, {"k": [1.5, -2e-3]}]
    return {"role": rng.choice(["user", "assistant"]),
            "content": [{"type": "text", "text": f"m{i} " * rng.randrange(1, 30)}],
            "n": i, "ünï": "cødé"}


def _lcp(a: list[Any], b: list[Any]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n] and type(a[n]) is type(b[n]):
        n += 1
    return n


def _mutate(rng: random.Random, items: list[Any], step: int) -> list[Any]:
    items = copy.deepcopy(items)
    op = rng.randrange(10)
    if op < 5:
        items += [_item(rng, 1000 * step + k) for k in range(rng.randrange(1, 4))]
    elif op == 5 and items:  # the last item changes (Claude Code's moving cache_control mark)
        last = items[-1]
        items[-1] = ({**last, "cache_control": {"type": "ephemeral"}} if isinstance(last, dict)
                     else _item(rng, step))
    elif op == 6 and items:  # a number item grows by a digit, or an item inside changes
        i = rng.randrange(len(items))
        items[i] = (items[i] * 10 + 3 if isinstance(items[i], int) and not isinstance(items[i], bool)
                    else _item(rng, -step))
    elif op == 7:  # cut short
        items = items[: rng.randrange(len(items) + 1)]
    elif op == 8:  # compacted
        items = [_item(rng, -step), *items[-2:]]
    # op 9: the same list again
    return items


@pytest.mark.parametrize("writer", sorted(WRITERS))
def test_the_shared_items_are_those_equal_as_values(writer: str) -> None:
    write = WRITERS[writer]
    rng = random.Random(writer)
    hits = 0
    for _ in range(20):
        items = [_item(rng, i) for i in range(rng.randrange(0, 6))]
        body = {"model": "m", "messages": items, "max_tokens": 5}
        lay = layout_of(write(body), "messages", len(items))
        assert lay is not None
        max_tokens = 5
        for step in range(25):
            new_items = _mutate(rng, items, step)
            # a field after the list
            before, max_tokens = max_tokens, 5 + step if rng.random() < 0.1 else max_tokens
            new_body = {"model": "m", "messages": new_items, "max_tokens": max_tokens}
            raw = write(new_body)
            got = continue_layout(lay, raw, "messages", len(new_items))
            assert got is not None, (writer, items, new_items)
            kept, new_lay, same_after = got
            # The shared items are exactly those equal as values (same writer: same bytes).
            assert kept == _lcp(items, new_items), (items, new_items)
            assert same_after == (max_tokens == before)
            whole = layout_of(raw, "messages", len(new_items))
            assert whole is not None
            assert (new_lay.start, new_lay.ends, new_lay.close) == (whole.start, whole.ends, whole.close)
            prev = new_lay.start
            for end, item in zip(new_lay.ends, new_items, strict=True):  # each item's bytes are exactly it
                assert json.loads(raw[prev:end].lstrip(b" \t\r\n,")) == item
                prev = end
            items, lay = new_items, new_lay
            hits += 1
    assert hits == 500


def test_a_body_it_cannot_vouch_for_gets_no_layout() -> None:
    good = b'{"model":"m","messages":[{"a":1},{"b":2}]}'
    assert layout_of(good, "messages", 2) is not None
    # The list's key twice (orjson keeps the last), absent, not a list, a count that disagrees, not an object.
    assert layout_of(b'{"messages":[{"a":1},{"b":2}],"messages":[{"x":0},{"b":2}]}', "messages", 2) is None
    assert layout_of(b'{"model":"m"}', "messages", 0) is None
    assert layout_of(b'{"messages":{"a":1}}', "messages", 1) is None
    assert layout_of(good, "messages", 3) is None
    assert layout_of(b'[{"a":1}]', "messages", 1) is None
    assert layout_of(b'{"messages":[1,2]} trailing', "messages", 2) is None
    lay = layout_of(good, "messages", 2)
    assert lay is not None
    # A second list key smuggled in after the list, where the bytes changed.
    sneaky = b'{"model":"m","messages":[{"a":1},{"b":2},{"c":3}],"messages":[{"z":9}]}'
    assert orjson.loads(sneaky)["messages"] == [{"z": 9}]
    assert continue_layout(lay, sneaky, "messages", 1) is None
    assert continue_layout(lay, sneaky, "messages", 3) is None
    escaped = b'{"model":"m","messages":[{"a":1},{"b":2},{"c":3}],"\\u006dessages":[{"z":9}]}'
    assert orjson.loads(escaped)["messages"] == [{"z": 9}]
    assert continue_layout(lay, escaped, "messages", 1) is None
    # Fields after the list that changed but cannot name it: not walked, the layout goes on.
    walked = 0
    real = layout_mod._members

    def members(*a: Any, **kw: Any) -> Any:
        nonlocal walked
        walked += 1
        return real(*a, **kw)

    layout_mod._members = members  # type: ignore[assignment]
    try:
        head = b'{"model":"m","messages":[{"a":1},{"b":2},{"c":3}],'
        after = b'"system":"header %d","tools":[{"name":"messages tool","d":"\\n"}]}'
        got = continue_layout(lay, head + after % 1, "messages", 3)
        assert got is not None and got[0] == 2 and not got[2] and walked == 0
        got = continue_layout(got[1], head + after % 2, "messages", 3)
        assert got is not None and got[0] == 3 and not got[2] and walked == 0
        # With a \u escape after the list, the fields are walked (and pass).
        got = continue_layout(got[1],
                              b'{"model":"m","messages":[{"a":1},{"b":2},{"c":3}],"system":"\\u00e9"}',
                              "messages", 3)
        assert got is not None and got[0] == 3 and walked == 1
    finally:
        layout_mod._members = real  # type: ignore[assignment]
    # A change before the list: not this layout's to continue.
    assert continue_layout(lay, b'{"model":"n","messages":[{"a":1},{"b":2}]}', "messages", 2) is None


def _leading_bytes(a: bytes, b: bytes) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


@pytest.mark.parametrize("count", [0, 1, 2, 3, 4, 5, 9, 40])
def test_the_shared_items_are_those_whose_bytes_come_again_at_their_places(count: int) -> None:
    """Every item up to the first whose bytes differ (the last ones, as Claude Code's moving mark does,
    or one before the single check of the items before them, or the first; one byte other is enough)
    and no further; a body that differs before the list shares nothing; each as the bytes themselves
    compared say."""
    rng = random.Random(count)
    items = [{"role": "user", "content": f"m{i} " * rng.randrange(1, 40)} for i in range(count)]
    raw = orjson.dumps({"model": "m", "messages": items, "system": "s"})
    lay = layout_of(raw, "messages", count)
    assert lay is not None
    for at in sorted({0, 1, count // 2, count - 4, count - 3, count - 2, count - 1} & set(range(count))):
        for edit in ("changed", "same length", "cut", "grown"):
            new_items = copy.deepcopy(items)
            if edit == "changed":
                new_items[at]["cache_control"] = {"type": "ephemeral"}
            elif edit == "same length":  # one byte other, every offset as before
                new_items[at]["content"] = "M" + new_items[at]["content"][1:]
            elif edit == "cut":
                new_items = new_items[:at]
            else:
                new_items += [{"role": "user", "content": "more"}]
            new = orjson.dumps({"model": "m", "messages": new_items, "system": "s"})
            same = _leading_bytes(raw, new)
            want = sum(1 for e in lay.ends if e <= same)
            got = layout_mod.shared_items(lay, new)
            assert got is not None and got.kept == want, (at, edit)
            assert got.kept == _lcp(items, new_items)
    assert layout_mod.shared_items(lay, orjson.dumps({"model": "n", "messages": items})) is None


def test_an_unchanged_tail_walks_only_the_new_items(monkeypatch: pytest.MonkeyPatch) -> None:
    """Claude Code sends its system prompt and tools after the messages: when they are as before, only
    the new items' bytes are decoded and walked, and the layout is the one a whole walk gives."""
    walked: list[int] = []
    real = layout_mod._items

    def items(text: str, i: int, after: bool) -> Any:
        walked.append(len(text) - i)
        return real(text, i, after)

    monkeypatch.setattr(layout_mod, "_items", items)
    tail = {"system": [{"type": "text", "text": "You are Claude Code. ✓ " * 2000}],
            "tools": [{"name": "Bash"}] * 50, "max_tokens": 32000}
    msgs: list[Any] = [{"role": "user", "content": "fix it"}]
    for write in WRITERS.values():
        raw = write({"model": "m", "messages": msgs, **tail})
        lay = layout_of(raw, "messages", len(msgs))
        assert lay is not None
        for t in range(5):
            new_msgs = [*msgs, {"role": "assistant", "content": "step " + str(t) + " ]},"},
                        {"role": "user", "content": f"out {t}"}]
            new = write({"model": "m", "messages": new_msgs, **tail})
            walked.clear()
            got = continue_layout(lay, new, "messages", len(new_msgs))
            assert got is not None and got[0] == len(msgs) and got[2]
            assert walked and max(walked) < 400 < len(new) // 100, walked  # the new items, not the 60 KB tail
            whole = layout_of(new, "messages", len(new_msgs))
            assert whole is not None and (got[1].start, got[1].ends,
                                          got[1].close) == (whole.start, whole.ends, whole.close)
            msgs, lay = new_msgs, got[1]


@pytest.mark.parametrize(("old", "new", "count"), [
    # The new body ends with the old tail, but its list closes before: another list, or the key again.
    (b'{"messages":[1],"x":3}', b'{"messages":[1],"y":[2],"x":3}', 1),
    (b'{"messages":[1],"x":3}', b'{"messages":[1],"messages":[5],"x":3}', 1),
    (b'{"messages":[1],"x":3}', b'{"messages":[1,"a\\"],\\"x\\":3}"],"x":3}', 2),
    # A number item that runs on into what looks like the tail.
    (b'{"messages":[12],"x":3}', b'{"messages":[123],"x":3}', 1),
])
def test_a_tail_that_only_looks_unchanged_is_walked_whole(old: bytes, new: bytes, count: int) -> None:
    lay = layout_of(old, "messages", len(orjson.loads(old)["messages"]))
    assert lay is not None
    got = continue_layout(lay, new, "messages", count)
    whole = layout_of(new, "messages", count)
    if whole is None:
        assert got is None
    else:
        assert got is not None and (got[1].ends, got[1].close) == (whole.ends, whole.close)
        assert got[0] == _lcp(orjson.loads(old)["messages"], orjson.loads(new)["messages"])


def _turn(raw: bytes, i: int, tokens: TokenRecord | None = None, side: bool = False) -> RecordedTurn:
    body = orjson.loads(raw)
    return RecordedTurn(session_id="s", request_id=f"r{i}", protocol=ANTH, raw_body=raw,
                        request=get_adapter(ANTH).parse_request(body),
                        completion=Completion(text=f"answer {i}", tokens=tokens), side_call=side,
                        timestamp=time.time(), latency=0.0)


def _cc_bodies(turns: int) -> list[dict[str, Any]]:
    """Claude-Code-shaped bodies: the moving cache_control mark, system and tools after the list."""
    msgs: list[dict[str, Any]] = [{"role": "user", "content": [{"type": "text", "text": "fix ✓ the bug"}]}]
    out = []
    for t in range(turns):
        cut = copy.deepcopy(msgs)
        cut[-1]["content"][-1]["cache_control"] = {"type": "ephemeral"}
        out.append({"model": "claude-x", "messages": cut,
                    "system": [{"type": "text", "text": "You are Claude Code."}],
                    "tools": [{"name": "Bash", "input_schema": {"type": "object"}}], "max_tokens": 32000,
                    "stream": True})
        msgs.append({"role": "assistant",
                     "content": [{"type": "tool_use", "id": f"t{t}", "name": "Bash", "input": {"c": "ls"}}]})
        msgs.append({"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": f"t{t}", "content": f"out {t}\n" * 40}]})
    return out


@pytest.mark.parametrize("durable", [False, True])
@pytest.mark.parametrize("writer", sorted(WRITERS))
def test_the_turn_log_gives_back_every_body_and_only_new_items_are_read(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, writer: str, durable: bool) -> None:
    scanned: list[int] = []
    digests = 0
    real_scan, real_digest = layout_mod._scan, recorder_mod._digest

    def scan(text: str, i: int) -> tuple[Any, int]:
        scanned[-1] += 1
        return real_scan(text, i)

    def digest(value: Any) -> bytes:
        nonlocal digests
        digests += 1
        return real_digest(value)

    monkeypatch.setattr(layout_mod, "_scan", scan)
    monkeypatch.setattr(recorder_mod, "_digest", digest)
    store = TurnStore(tmp_path / "d") if durable else None
    try:
        rec = SessionRecorder(store=store)
        bodies = _cc_bodies(40)
        per_turn = []
        for i, body in enumerate(bodies):
            scanned.append(0)
            digests = 0
            rec(_turn(WRITERS[writer](body), i))
            per_turn.append(digests)
        assert [t["request"] for t in rec.turn_log("s")] == bodies
        # After the first turn: the changed last item and the two new ones are scanned and digested,
        # whatever the history's length; the fields outside the list, unchanged bytes, are not digested.
        assert max(scanned[1:]) == 3 and max(per_turn[1:]) == 3, (scanned, per_turn)
        assert scanned[0] > 5  # the first body is walked whole
    finally:
        if store is not None:
            store.close()


def test_a_body_with_the_list_key_twice_is_recorded_as_parsed() -> None:
    # A hostile agent sends two "messages" lists: what the gateway handled (the last) is what is recorded.
    rec = SessionRecorder()
    bodies = _cc_bodies(6)
    raws = [orjson.dumps(b) for b in bodies]
    # A second list of as many items as the first (so no count gives it away), the first item forged.
    forged = copy.deepcopy(bodies[4]["messages"])
    forged[0]["content"][0]["text"] = "forged"
    raws[4] = raws[4][:-1] + b',"messages":' + orjson.dumps(forged) + b"}"
    raws[5] = b'{"messages":' + orjson.dumps(bodies[5]["messages"]) + b"," + raws[5][1:]
    for i, raw in enumerate(raws):
        rec(_turn(raw, i))
    assert [t["request"] for t in rec.turn_log("s")] == [orjson.loads(r) for r in raws]


def _tokens(full: np.ndarray, new: int, out: int) -> TokenRecord:
    rng = np.random.default_rng(len(full))  # random ids: a delta's size is not hidden by compression
    prompt = np.concatenate([full, rng.integers(0, 50_000, new).astype(np.int32)])
    return TokenRecord(prompt_ids=prompt, output_ids=rng.integers(0, 50_000, out).astype(np.int32),
                       output_logprobs=np.full(out, -0.25))


def test_token_ids_are_encoded_against_the_trees_last_turn(tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    # Empty generations between turns (the tree stores no turn for them), a turn the tree fails on,
    # and a restart: the token ids still come back exactly, and continuing turns are stored as deltas.
    bodies = _cc_bodies(12)
    full = np.zeros(0, dtype=np.int32)
    sent: list[TokenRecord] = []
    real_tree = session_mod._tree_turn

    def failing(*a: Any, **kw: Any) -> bool:
        raise RuntimeError("a tree bug")

    with TurnStore(tmp_path / "d") as store:
        rec = SessionRecorder(store=store)
        for i in range(8):
            tok = _tokens(full, 3000 if i == 0 else 50, 0 if i in (2, 3) else 20)
            sent.append(tok)
            monkeypatch.setattr(session_mod, "_tree_turn", failing if i in (5, 7) else real_tree)
            if i in (5, 7):
                with pytest.raises(RuntimeError):
                    rec(_turn(orjson.dumps(bodies[i]), i, tok))
            else:
                rec(_turn(orjson.dumps(bodies[i]), i, tok))
            if tok.output_ids.shape[0]:
                full = np.concatenate([tok.prompt_ids, tok.output_ids])
        rows, _ = store.load_turns("s")
        sizes = [len(p) for _, p in rows]
    monkeypatch.setattr(session_mod, "_tree_turn", real_tree)
    with TurnStore(tmp_path / "d") as store:
        rec = SessionRecorder(store=store)
        rec.known({"s"})
        for i in range(8, 12):
            tok = _tokens(full, 50, 20)
            sent.append(tok)
            rec(_turn(orjson.dumps(bodies[i]), i, tok))
            full = np.concatenate([tok.prompt_ids, tok.output_ids])
        log = rec.turn_log("s")
        rows, _ = store.load_turns("s")
        sizes += [len(p) for _, p in rows[8:]]
    assert len(log) == 12
    for entry, tok in zip(log, sent, strict=True):
        assert entry["completion"]["tokens"]["prompt_ids"] == tok.prompt_ids.tolist()
        assert entry["completion"]["tokens"]["output_ids"] == tok.output_ids.tolist()
    # A 3,000-id prompt is ~12 KB as int32; a delta against the tree's last turn is a fraction of it.
    # A turn the tree failed on and the one after it store their ids whole. The tree rebuilt at the
    # restart stores turn 7, which the records do not continue from: turn 8 goes whole too.
    assert all(sizes[i] < 2500 for i in range(1, 12) if i not in (5, 6, 7, 8)), sizes
    assert min(sizes[5:9]) > 5000, sizes
