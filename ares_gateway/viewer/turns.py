"""An episode's turn log as the viewer shows it: per turn, only what is new.

An agent re-sends its whole history with every request, so a 200-turn Claude Code session's log is
~70 MB of mostly repeated messages. Each turn is shown as the messages its request added to the
previous request of the same line (main line or side calls), in canonical form, plus the policy's
answer; a request that did not continue the previous one (a fork, a rewritten history) says where it
diverged. Long texts are cut (:data:`TEXT_LIMIT`), so no page ships megabytes.
"""

from __future__ import annotations

import mmap
import os
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import orjson

from ares_gateway.core.canonical import Message, WireProtocol
from ares_gateway.protocols import get_adapter

#: Characters of one text shown (a tool's output, a message); the rest is counted, not sent.
TEXT_LIMIT = 20_000

#: The key of each protocol's message list in a request body.
_LIST_KEY = {WireProtocol.OPENAI_CHAT: "messages", WireProtocol.ANTHROPIC_MESSAGES: "messages",
             WireProtocol.OPENAI_RESPONSES: "input"}


def cut(text: str | None, limit: int = TEXT_LIMIT) -> dict[str, Any] | None:
    """``{"text": ..., "cut": N}``: ``text`` up to ``limit`` characters and how many were left out."""
    if text is None:
        return None
    if len(text) <= limit:
        return {"text": text}
    return {"text": text[:limit], "cut": len(text) - limit}


def display_message(m: Message) -> dict[str, Any]:
    """A canonical message as the page draws it: role, text, reasoning, tool calls, tool result id."""
    out: dict[str, Any] = {"role": m.role, "text": cut(m.text())}
    # Thinking blocks are the message's ``reasoning``, shown as that.
    others = [p.type for p in m.content
              if p.type not in ("text", "thinking", "redacted_thinking", "reasoning")] \
        if isinstance(m.content, list) else []
    if others:
        out["parts"] = others
    if m.reasoning:
        out["reasoning"] = cut(m.reasoning)
    if m.tool_calls:
        out["tool_calls"] = [{"id": c.id, "name": c.name, "arguments": cut(c.arguments)}
                             for c in m.tool_calls]
    if m.tool_call_id:
        out["tool_call_id"] = m.tool_call_id
    if m.is_error:
        out["is_error"] = True
    if m.name:
        out["name"] = m.name
    return out


def _common_prefix(a: list[Any], b: list[Any]) -> int:
    n = min(len(a), len(b))
    if a[:n] == b[:n]:  # the usual case, one C-level comparison
        return n
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def _without_cache_marks(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _without_cache_marks(v) for k, v in value.items() if k != "cache_control"}
    if isinstance(value, list):
        return [_without_cache_marks(v) for v in value]
    return value


def _messages(protocol: WireProtocol, body: dict[str, Any], items: list[Any] | None,
              first: bool) -> list[dict[str, Any]]:
    """``items`` of ``body``'s list (all of it when ``None``) as display messages; the system prompt
    only for the line's first turn (``first``)."""
    key = _LIST_KEY.get(protocol)
    sub = dict(body)
    if key is not None and items is not None:
        sub[key] = items
    if not first:
        for k in ("system", "instructions"):
            sub.pop(k, None)
    try:
        req = get_adapter(protocol).parse_request(sub)
    except Exception as exc:  # a body the protocol refuses is still shown, raw
        return [{"role": "unparsed", "text": cut(f"{exc}: {items if items is not None else body!s}")}]
    msgs = req.messages
    if not first:
        msgs = [m for m in msgs if m.role not in ("system", "developer")] or msgs
    return [display_message(m) for m in msgs]


def _answer(entry: dict[str, Any]) -> dict[str, Any]:
    completion = entry.get("completion")
    if not isinstance(completion, dict):
        err = entry.get("error") or {}
        return {"error": cut(str(err.get("message", err)) if isinstance(err, dict) else str(err)),
                "status": err.get("status") if isinstance(err, dict) else None}
    calls = completion.get("tool_calls") or []
    tokens = completion.get("tokens") or {}
    out: dict[str, Any] = {
        "text": cut(completion.get("text")),
        "reasoning": cut(completion.get("reasoning")),
        "tool_calls": [{"id": c.get("id"), "name": c.get("name"), "arguments": cut(c.get("arguments"))}
                       for c in calls if isinstance(c, dict)],
        "finish_reason": completion.get("finish_reason"),
    }
    if isinstance(tokens, dict) and tokens.get("output_ids") is not None:
        out["output_tokens"] = len(tokens["output_ids"])
        out["prompt_tokens"] = len(tokens.get("prompt_ids") or [])
    usage = completion.get("usage")
    if isinstance(usage, dict):
        out["usage"] = {k: usage.get(k) for k in ("input_tokens", "output_tokens")}
    return out


def _protocol(entry: dict[str, Any]) -> WireProtocol:
    try:
        return WireProtocol(entry.get("protocol") or WireProtocol.OPENAI_CHAT.value)
    except ValueError:
        return WireProtocol.OPENAI_CHAT


def list_items(entry: dict[str, Any]) -> list[Any] | None:
    """The message list of a turn-log entry's request (``messages`` / ``input``), if it has one."""
    body = entry.get("request")
    key = _LIST_KEY.get(_protocol(entry))
    items = body.get(key) if isinstance(body, dict) and key else None
    return items if isinstance(items, list) else None


def turn_view(entry: dict[str, Any], index: int, prev: list[Any] | None) -> dict[str, Any]:
    """The view of turn ``index`` (from 1): the messages its request added to ``prev`` (the message list
    of the previous request on its line; ``None`` for the line's first), and the policy's answer."""
    side = bool(entry.get("side_call"))
    body = entry.get("request")
    protocol = _protocol(entry)
    view: dict[str, Any] = {"index": index, "side_call": side, "request_id": entry.get("request_id"),
                            "timestamp": entry.get("timestamp"), "latency": entry.get("latency"),
                            "answer": _answer(entry), "protocol": protocol.value,
                            "policy_version": entry.get("policy_version"), "usage": entry.get("usage")}
    if not isinstance(body, dict):
        view["messages"] = [{"role": "unparsed", "text": cut(str(body))}]
        return view
    items = list_items(entry)
    if items is None:  # a Responses string input, or no list at all: shown whole
        view["messages"] = _messages(protocol, body, None, first=True)
        return view
    shared = 0 if prev is None else _common_prefix(prev, items)
    if prev is not None and shared == len(prev) - 1 < len(items) and \
            _without_cache_marks(prev[shared]) == _without_cache_marks(items[shared]):
        shared += 1  # Claude Code moves its cache_control mark to the newest message each turn
    view["history"] = len(items)
    view["shared"] = shared
    if prev is not None and shared < len(prev):
        # The request did not continue the previous one: forked or rewritten at `shared`.
        view["diverged_at"] = shared
    view["messages"] = _messages(protocol, body, items[shared:], first=prev is None)
    return view


def _page(views: list[dict[str, Any]], total: int, side_calls: int, offset: int) -> dict[str, Any]:
    return {"total": total, "side_calls": side_calls, "offset": offset, "turns": views}


class TurnViews:
    """The views of a turn log held in memory (a live gateway's, a data dir's), built in order as
    entries are added. Keeps, per line, the previous request's message list and the views."""

    def __init__(self) -> None:
        self.views: list[dict[str, Any]] = []
        self._prev: dict[bool, list[Any] | None] = {}

    def add(self, entries: Iterable[dict[str, Any]]) -> None:
        """Append the views of ``entries`` (turn-log entries: ``request``, ``completion``, ``protocol``
        ...)."""
        for entry in entries:
            side = bool(entry.get("side_call"))
            self.views.append(turn_view(entry, len(self.views) + 1, self._prev.get(side)))
            self._prev[side] = list_items(entry)

    def count(self) -> int:
        """How many turns."""
        return len(self.views)

    def side_count(self) -> int:
        """How many of them are side calls."""
        return sum(v["side_call"] for v in self.views)

    def page(self, *, offset: int, limit: int, line: str = "all") -> dict[str, Any]:
        """``limit`` views from ``offset`` of the line asked for (``main``, ``side`` or ``all``), with
        counts."""
        views = self.views
        picked = views if line == "all" else [v for v in views if v["side_call"] == (line == "side")]
        out = _page(picked[offset: offset + limit], len(picked), self.side_count(), offset)
        out["all"] = len(views)
        return out


#: Where a ``turns/*.jsonl`` line says whether it is a side call (the writer puts the field first).
_SIDE = re.compile(rb'"side_call":\s*(true|false)')


class FileTurns:
    """The views of a run's ``turns/KEY.jsonl``, built only for the turns a page shows.

    The file is indexed once (where each line starts, whether it is a side call: read from the line's
    head, without parsing the request); a turn's view needs its own line and its line's previous
    request, so a page of a 200-turn, 60 MB log parses about two pages' lines, not the file.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self._starts: list[int] = []
        self._sides: list[bool] = []
        self._ends: list[int] = []
        self._prev: list[int | None] = []
        self._views: dict[int, dict[str, Any]] = {}
        self._index()

    def _index(self) -> None:
        with open(self.path, "rb") as fh:
            size = os.fstat(fh.fileno()).st_size
            if size == 0:
                return
            with mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as mm:
                pos = 0
                last: dict[bool, int] = {}
                while pos < size:
                    end = mm.find(b"\n", pos)
                    if end < 0:
                        break  # a line still being written
                    if end > pos:
                        found = _SIDE.search(mm[pos: min(end, pos + 512)])
                        side = found.group(1) == b"true" if found else \
                            bool(orjson.loads(mm[pos:end]).get("side_call"))
                        self._prev.append(last.get(side))
                        last[side] = len(self._starts)
                        self._starts.append(pos)
                        self._sides.append(side)
                    pos = end + 1
                self._ends = [*self._starts[1:], pos]

    def _entry(self, i: int) -> dict[str, Any]:
        with open(self.path, "rb") as fh:
            fh.seek(self._starts[i])
            data = fh.read(self._ends[i] - self._starts[i])
        try:
            entry = orjson.loads(data)
        except orjson.JSONDecodeError as exc:
            return {"request": f"(this line of {self.path.name} is not JSON: {exc})"}
        return entry if isinstance(entry, dict) else {"request": entry}

    def view(self, i: int) -> dict[str, Any]:
        """Turn ``i``'s view (from 0), built on first use."""
        got = self._views.get(i)
        if got is None:
            j = self._prev[i]
            prev = None if j is None else list_items(self._entry(j))
            got = self._views[i] = turn_view(self._entry(i), i + 1, prev)
        return got

    def count(self) -> int:
        """How many turns (complete lines)."""
        return len(self._starts)

    def side_count(self) -> int:
        """How many of them are side calls."""
        return sum(self._sides)

    def page(self, *, offset: int, limit: int, line: str = "all") -> dict[str, Any]:
        """As :meth:`TurnViews.page`, building only the views it returns."""
        picked = range(len(self._starts)) if line == "all" else \
            [i for i, side in enumerate(self._sides) if side == (line == "side")]
        out = _page([self.view(i) for i in picked[offset: offset + limit]], len(picked), self.side_count(),
                    offset)
        out["all"] = self.count()
        return out
