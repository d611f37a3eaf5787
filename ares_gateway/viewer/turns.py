"""An episode's turn log as the viewer shows it: per turn, only what is new.

An agent re-sends its whole history with every request, so a 200-turn Claude Code session's log is
~70 MB of mostly repeated messages. Each turn is shown as the messages its request added to the
previous request of the same line (main line or side calls), in canonical form, plus the policy's
answer; a request that did not continue the previous one (a fork, a rewritten history) says where it
diverged. Long texts are cut (:data:`TEXT_LIMIT`), so no page ships megabytes.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

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
    others = [p.type for p in m.content if p.type != "text"] if isinstance(m.content, list) else []
    if others:
        out["parts"] = others
    if m.reasoning:
        out["reasoning"] = cut(m.reasoning)
    if m.tool_calls:
        out["tool_calls"] = [{"id": c.id, "name": c.name, "arguments": cut(c.arguments)} for c in m.tool_calls]
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


class TurnViews:
    """Builds the display view of each turn of one episode, in order (feed it log entries as they come).

    Keeps, per line, the previous request's message list (what the next request is compared with),
    and the views built so far; nothing else of the raw log.
    """

    def __init__(self) -> None:
        self.views: list[dict[str, Any]] = []
        self._prev: dict[bool, list[Any]] = {}

    def add(self, entries: Iterable[dict[str, Any]]) -> None:
        """Append the views of ``entries`` (turn-log entries: ``request``, ``completion``, ``protocol`` ...)."""
        for entry in entries:
            self.views.append(self._view(entry, len(self.views) + 1))

    def _view(self, entry: dict[str, Any], index: int) -> dict[str, Any]:
        side = bool(entry.get("side_call"))
        body = entry.get("request")
        view: dict[str, Any] = {"index": index, "side_call": side, "request_id": entry.get("request_id"),
                                "timestamp": entry.get("timestamp"), "latency": entry.get("latency"),
                                "answer": _answer(entry)}
        try:
            protocol = WireProtocol(entry.get("protocol") or "openai_chat")
        except ValueError:
            protocol = WireProtocol.OPENAI_CHAT
        view["protocol"] = protocol.value
        if not isinstance(body, dict):
            view["messages"] = [{"role": "unparsed", "text": cut(str(body))}]
            return view
        key = _LIST_KEY.get(protocol)
        items = body.get(key) if key else None
        prev = self._prev.get(side)
        if isinstance(items, list):
            shared = 0 if prev is None else _common_prefix(prev, items)
            if prev is not None and shared == len(prev) - 1 < len(items) and \
                    _without_cache_marks(prev[shared]) == _without_cache_marks(items[shared]):
                shared += 1  # Claude Code moves its cache_control mark to the newest message each turn
            view["history"] = len(items)
            view["shared"] = shared
            if prev is not None and shared < len(prev):
                # The request did not continue the previous one: forked or rewritten at `shared`.
                view["diverged_at"] = shared
            self._prev[side] = items
            view["messages"] = _messages(protocol, body, items[shared:], first=prev is None)
        else:  # a Responses string input, or no list at all: shown whole
            view["messages"] = _messages(protocol, body, None, first=True)
        return view


def page(views: list[dict[str, Any]], *, offset: int, limit: int, line: str = "all") -> dict[str, Any]:
    """``limit`` views from ``offset`` of the line asked for (``main``, ``side`` or ``all``), with counts."""
    picked = views if line == "all" else [v for v in views if v["side_call"] == (line == "side")]
    return {"total": len(picked), "all": len(views), "side_calls": sum(v["side_call"] for v in views),
            "offset": offset, "turns": picked[offset: offset + limit]}
