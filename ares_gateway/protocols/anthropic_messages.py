"""Anthropic messages (``POST /v1/messages``) <-> canonical form.

Spoken by Claude Code (always streaming, ``?beta=true``).

Mapping:

* ``system`` (a string, or an array of text blocks with ``cache_control``)
  becomes the first canonical message, role ``system``; a ``role: "system"``
  message inside ``messages`` stays a system message where it is.
* A user turn holding ``tool_result`` blocks becomes one canonical ``tool``
  message per result (``tool_call_id``, ``is_error``, content string or parts)
  and the other blocks of the turn become ``user`` messages around them, in
  order. Pieces after the first carry ``extra["same_turn"] = True`` unless
  they are a tool result following a tool result (those always share a turn).
* Assistant ``thinking`` / ``redacted_thinking`` blocks stay content parts
  (``extra["signature"]`` / ``extra["data"]``) and the thinking text is also
  put in ``Message.reasoning``; ``tool_use`` blocks become ``tool_calls`` with
  the JSON of ``input`` as ``arguments``. An assistant turn made only of
  ``tool_use`` blocks has ``content=None``.
* Images: base64 sources become ``data:`` URLs, url sources their URL; other
  sources stay in ``extra["source"]``. Unknown blocks (documents, server tool
  blocks, ...) are kept as parts of their own type with every key in ``extra``.

Documented normalizations of a native -> canonical -> native round trip:
``tool_use`` blocks come after the other blocks of an assistant turn; tool
results of consecutive user turns with nothing else between them are merged
into one user turn.
"""

from __future__ import annotations

from typing import Any

import orjson

from ares_gateway.core.canonical import (
    CanonicalRequest,
    Completion,
    ContentPart,
    Message,
    Tool,
    ToolCall,
    Usage,
    WireProtocol,
)
from ares_gateway.core.wire import ProtocolAdapter, Reuse
from ares_gateway.protocols._shared import (
    MARKERS,
    MAX_TOKENS_LIMIT,
    NO_USAGE,
    data_url,
    expect,
    fail,
    int_or0,
    json_str,
    message,
    mk_completion,
    mk_request,
    mk_sampling,
    mk_tool,
    new_id,
    opt_int,
    opt_num,
    opt_str,
    part,
    require_object,
    rest,
    split_data_url,
    sse_event,
    tool_call,
    usage,
)
from ares_gateway.protocols._stream import StreamEncoderBase

PROTOCOL = WireProtocol.ANTHROPIC_MESSAGES

_REQ_KNOWN = frozenset(
    {"model", "messages", "system", "tools", "tool_choice", "max_tokens", "temperature", "top_p", "top_k",
     "stop_sequences", "stream"}
)
_TYPE = frozenset({"type"})
_TEXT_KNOWN = frozenset({"type", "text"})
_THINK_KNOWN = frozenset({"type", "thinking"})
_TOOL_USE_KNOWN = frozenset({"type", "id", "name", "input"})
_TOOL_RESULT_KNOWN = frozenset({"type", "tool_use_id", "content", "is_error"})
_TOOL_KNOWN = frozenset({"name", "description", "input_schema"})
_MSG_KNOWN = frozenset({"role", "content"})
#: canonical ``extra`` keys of other protocols that must not leak into Anthropic blocks
_FOREIGN_PART_KEYS = frozenset({"detail", "image_url_extra", "bare"})
_FOREIGN_TOOL_KEYS = frozenset({"tool_extra", "legacy", "no_type"})


# =========================================================================== request


def _parse_block(b: Any, param: str) -> ContentPart:
    if not isinstance(b, dict):
        fail(f"'{param}' must be an object", param)
    t = b.get("type")
    if not isinstance(t, str):
        fail(f"'{param}.type' must be a string", f"{param}.type")
    if t == "text":
        text = b.get("text")
        if not isinstance(text, str):
            fail(f"'{param}.text' must be a string", f"{param}.text")
        return part("text", text, extra=rest(b, _TEXT_KNOWN) if len(b) > 2 else {})
    if t == "image":
        src = b.get("source")
        extra = rest(b, _TYPE)
        url = None
        if isinstance(src, dict):
            st = src.get("type")
            if st == "base64" and isinstance(src.get("data"), str) and isinstance(src.get("media_type"),
                                                                                  str) \
                    and len(src) == 3:
                url = data_url(src["media_type"], src["data"])
                del extra["source"]
            elif st == "url" and isinstance(src.get("url"), str) and len(src) == 2:
                url = src["url"]
                del extra["source"]
        elif src is None:
            fail(f"'{param}.source' is required", f"{param}.source")
        return part("image", url=url, extra=extra)
    if t == "thinking":
        th = b.get("thinking")
        if not isinstance(th, str):
            fail(f"'{param}.thinking' must be a string", f"{param}.thinking")
        return part("thinking", th, extra=rest(b, _THINK_KNOWN))
    text = b.get("text")
    if isinstance(text, str):
        return part(t, text, extra=rest(b, _TEXT_KNOWN))
    return part(t, extra=rest(b, _TYPE))


def _parse_blocks(content: Any, param: str) -> str | list[ContentPart] | None:
    if content is None or isinstance(content, str):
        return content
    if isinstance(content, list):
        return [_parse_block(b, f"{param}[{j}]") for j, b in enumerate(content)]
    fail(f"'{param}' must be a string or an array of content blocks", param)


def _parse_user(m: dict[str, Any], content: list[Any], param: str, out: list[Message]) -> None:
    pieces_before = len(out)
    cur: list[ContentPart] | None = None
    prev_tool = False
    msg_extra = rest(m, _MSG_KNOWN) if len(m) > 2 else {}

    def flush() -> None:
        nonlocal cur
        if cur is not None:
            ex: dict[str, Any] = {"same_turn": True} if len(out) > pieces_before else dict(msg_extra)
            out.append(message("user", cur, extra=ex))
            cur = None

    for j, b in enumerate(content):
        bp = f"{param}[{j}]"
        if isinstance(b, dict) and b.get("type") == "tool_result":
            flush()
            tid = b.get("tool_use_id")
            if not isinstance(tid, str):
                fail(f"'{bp}.tool_use_id' must be a string", f"{bp}.tool_use_id")
            is_err = b.get("is_error")
            if is_err is not None and not isinstance(is_err, bool):
                fail(f"'{bp}.is_error' must be a boolean", f"{bp}.is_error")
            ex = rest(b, _TOOL_RESULT_KNOWN)
            if len(out) > pieces_before and not prev_tool:
                ex["same_turn"] = True
            elif len(out) == pieces_before and msg_extra:
                ex.update(msg_extra)
            out.append(message("tool", _parse_blocks(b.get("content"), f"{bp}.content"), tool_call_id=tid,
                               is_error=is_err, extra=ex))
            prev_tool = True
        else:
            if cur is None:
                cur = []
            cur.append(_parse_block(b, bp))
            prev_tool = False
    flush()
    if len(out) == pieces_before:  # empty content list
        out.append(message("user", [], extra=msg_extra))


def _parse_assistant(m: dict[str, Any], content: list[Any], param: str) -> Message:
    parts: list[ContentPart] = []
    calls: list[ToolCall] = []
    thinking: list[str] = []
    for j, b in enumerate(content):
        bp = f"{param}[{j}]"
        if isinstance(b, dict) and b.get("type") == "tool_use":
            tid, name = b.get("id"), b.get("name")
            if not isinstance(tid, str):
                fail(f"'{bp}.id' must be a string", f"{bp}.id")
            if not isinstance(name, str):
                fail(f"'{bp}.name' must be a string", f"{bp}.name")
            inp = b.get("input", {})
            calls.append(tool_call(tid, name, json_str(inp), "function",
                                   rest(b, _TOOL_USE_KNOWN) if len(b) > 4 else {}))
        else:
            p = _parse_block(b, bp)
            if p.type == "thinking":
                thinking.append(p.text or "")
            parts.append(p)
    return message(
        "assistant",
        parts if (parts or not calls) else None,
        tool_calls=calls,
        reasoning="\n\n".join(thinking) if thinking else None,
        extra=rest(m, _MSG_KNOWN) if len(m) > 2 else {},
    )


def _parse_tool(t: Any, param: str) -> Tool:
    if not isinstance(t, dict):
        fail(f"'{param}' must be an object", param)
    typ = t.get("type")
    if typ is None or typ == "custom":
        name = t.get("name")
        if not isinstance(name, str):
            fail(f"'{param}.name' must be a string", f"{param}.name")
        schema = t.get("input_schema")
        if schema is not None and not isinstance(schema, dict):
            fail(f"'{param}.input_schema' must be an object", f"{param}.input_schema")
        return mk_tool(
            type="function", name=name, description=opt_str(t, "description", f"{param}.description"),
            parameters=schema, extra=rest(t, _TOOL_KNOWN),
        )
    name = t.get("name")
    return mk_tool(
        type=typ if isinstance(typ, str) else "unknown", name=name if isinstance(name, str) else None,
        description=None, parameters=None, extra={"raw": t},
    )


def parse_request(body: Any, *, require_max_tokens: bool = True, reuse: Reuse | None = None,
                  ends: list[int] | None = None) -> CanonicalRequest:
    """Parse a ``/v1/messages`` body; ``require_max_tokens=False`` for ``/v1/messages/count_tokens``.

    ``reuse``/``ends``: see :class:`~ares_gateway.core.wire.Reuse` (each item's messages depend on
    the item alone and on how many messages came before the list)."""
    b = require_object(body)
    msgs = b.get("messages")
    if msgs is None:
        fail("messages: Field required", "messages")
    expect(msgs, list, "messages", "an array")
    max_tokens = opt_int(b, "max_tokens", "max_tokens", 1, MAX_TOKENS_LIMIT)
    if max_tokens is None and require_max_tokens:
        fail("max_tokens: Field required", "max_tokens")

    messages: list[Message] = []
    if reuse is not None and reuse.outside:
        messages.extend(reuse.messages[: reuse.ends[0]])  # the same system bytes: the same messages
    else:
        system = b.get("system")
        if system is not None:
            if isinstance(system, str):
                messages.append(message("system", system))
            elif isinstance(system, list):
                messages.append(
                    message("system", [_parse_block(x, f"system[{j}]") for j, x in enumerate(system)]))
            else:
                fail("'system' must be a string or an array of text blocks", "system")
    start = 0
    if reuse is not None and reuse.kept and len(messages) == reuse.ends[0]:
        start = reuse.kept
        messages.extend(reuse.messages[reuse.ends[0] : reuse.ends[start]])
        if ends is not None:
            ends.extend(reuse.ends[: start + 1])
    elif ends is not None:
        ends.append(len(messages))
    for i in range(start, len(msgs)):
        m = msgs[i]
        param = f"messages[{i}]"
        if not isinstance(m, dict):
            fail(f"'{param}' must be an object", param)
        role = m.get("role")
        if not isinstance(role, str):
            fail(f"'{param}.role' must be a string", f"{param}.role")
        if "content" not in m:
            fail(f"'{param}.content' is required", f"{param}.content")
        content = m["content"]
        if isinstance(content, list) and role == "user":
            _parse_user(m, content, f"{param}.content", messages)
        elif isinstance(content, list) and role == "assistant":
            messages.append(_parse_assistant(m, content, f"{param}.content"))
        else:
            if not isinstance(content, (str, list)):
                fail(f"'{param}.content' must be a string or an array of content blocks", f"{param}.content")
            extra = rest(m, _MSG_KNOWN) if len(m) > 2 else {}
            if role == "system" and not messages:
                extra["in_messages"] = True
            messages.append(message(role, _parse_blocks(content, f"{param}.content"), extra=extra))
        if ends is not None:
            ends.append(len(messages))

    tools: list[Tool] = []
    if reuse is not None and reuse.outside:
        tools = reuse.tools
    elif b.get("tools") is not None:
        expect(b["tools"], list, "tools", "an array")
        tools = [_parse_tool(t, f"tools[{i}]") for i, t in enumerate(b["tools"])]
    stop = b.get("stop_sequences")
    if stop is not None and (not isinstance(stop, list) or not all(isinstance(s, str) for s in stop)):
        fail("'stop_sequences' must be an array of strings", "stop_sequences")
    stream = b.get("stream")
    if stream is not None and not isinstance(stream, bool):
        fail("'stream' must be a boolean", "stream")
    model = b.get("model")
    if model is not None and not isinstance(model, str):
        fail("'model' must be a string", "model")
    return mk_request(
        protocol=PROTOCOL,
        model=model,
        messages=messages,
        tools=tools,
        tool_choice=b.get("tool_choice"),
        parallel_tool_calls=None,
        sampling=mk_sampling(
            max_tokens=max_tokens,
            temperature=opt_num(b, "temperature", "temperature", 0.0, 1.0),
            top_p=opt_num(b, "top_p", "top_p", 0.0, 1.0),
            top_k=opt_int(b, "top_k", "top_k", 0, MAX_TOKENS_LIMIT),
            stop=stop,
            seed=None,
            extra={},
        ),
        stream=bool(stream),
        include_usage=False,
        extra=rest(b, _REQ_KNOWN),
        raw=b,
    )


def parse_count_tokens_request(body: Any) -> CanonicalRequest:
    """``/v1/messages/count_tokens`` takes the same body without ``max_tokens``."""
    return parse_request(body, require_max_tokens=False)


def _render_part(p: ContentPart) -> dict[str, Any]:
    t = p.type
    ex = p.extra
    if t == "text":
        d: dict[str, Any] = {"type": "text", "text": p.text or ""}
    elif t == "image":
        d = {"type": "image"}
        if p.url is not None:
            du = split_data_url(p.url)
            d["source"] = (
                {"type": "base64", "media_type": du[0], "data": du[1]} if du
                else {"type": "url", "url": p.url}
            )
    elif t == "thinking":
        d = {"type": "thinking", "thinking": p.text or ""}
    else:
        d = {"type": t}
        if p.text is not None:
            d["text"] = p.text
        if p.url is not None and t != "redacted_thinking":
            d["url"] = p.url
    if ex:
        for k, v in ex.items():
            if k not in _FOREIGN_PART_KEYS:
                d[k] = v
    return d


def _render_content(content: str | list[ContentPart] | None) -> Any:
    if content is None or isinstance(content, str):
        return content
    return [_render_part(p) for p in content]


def _render_args(tc: ToolCall) -> Any:
    if tc.type == "custom":
        return {"input": tc.arguments}
    try:
        v = orjson.loads(tc.arguments) if tc.arguments else {}
    except orjson.JSONDecodeError:
        return {}
    return v if isinstance(v, dict) else {}


def _render_tool_use(tc: ToolCall) -> dict[str, Any]:
    d: dict[str, Any] = {"type": "tool_use", "id": tc.id or new_id("toolu_"), "name": tc.name,
                         "input": _render_args(tc)}
    if tc.extra:
        for k, v in tc.extra.items():
            if k not in ("legacy", "no_type", "function_extra", "type", "id", "status"):
                d[k] = v
    return d


def _msg_extra(m: Message) -> dict[str, Any]:
    return {k: v for k, v in m.extra.items() if k not in MARKERS}


def _render_assistant(m: Message) -> dict[str, Any]:
    content = m.content
    if not m.tool_calls and m.reasoning is None and content is not None:
        return {"role": "assistant", "content": _render_content(content), **_msg_extra(m)}
    blocks: list[dict[str, Any]] = []
    has_thinking = isinstance(content, list) and any(
        p.type in ("thinking", "redacted_thinking") for p in content)
    if m.reasoning is not None and not has_thinking:
        blocks.append({"type": "thinking", "thinking": m.reasoning})
    if isinstance(content, str):
        if content:
            blocks.append({"type": "text", "text": content})
    elif content:
        blocks.extend(_render_part(p) for p in content)
    blocks.extend(_render_tool_use(tc) for tc in m.tool_calls)
    return {"role": "assistant", "content": blocks, **_msg_extra(m)}


def _tool_result(m: Message) -> dict[str, Any]:
    d: dict[str, Any] = {"type": "tool_result", "tool_use_id": m.tool_call_id or ""}
    if m.content is not None:
        d["content"] = _render_content(m.content)
    if m.is_error is not None:
        d["is_error"] = m.is_error
    for k, v in m.extra.items():
        if k not in MARKERS:
            d[k] = v
    return d


def render_messages(messages: list[Message]) -> tuple[Any, list[dict[str, Any]]]:
    """Canonical messages -> (``system`` or None, Anthropic ``messages``)."""
    system: Any = None
    start = 0
    if messages and messages[0].role == "system" and not messages[0].extra.get("in_messages"):
        system = _render_content(messages[0].content)
        start = 1
    out: list[dict[str, Any]] = []
    prev_role: str | None = None
    for m in messages[start:]:
        if "item" in m.extra:  # a Responses item with no Anthropic form
            continue
        role = m.role
        last = out[-1] if out else None
        can_join = last is not None and last["role"] == "user" and isinstance(last["content"], list)
        if role == "tool":
            block = _tool_result(m)
            if can_join and (prev_role == "tool" or m.extra.get("same_turn")):
                last["content"].append(block)  # type: ignore[index]
            else:
                out.append({"role": "user", "content": [block]})
        elif role == "user" and m.extra.get("same_turn") and can_join and isinstance(m.content, list):
            last["content"].extend(_render_part(p) for p in m.content)  # type: ignore[index]
        elif role == "assistant":
            out.append(_render_assistant(m))
        else:
            if role == "developer":
                role = "system"
            content = _render_content(m.content)
            out.append({"role": role, "content": "" if content is None else content, **_msg_extra(m)})
        prev_role = m.role
    return system, out


def _render_tool(t: Tool) -> dict[str, Any]:
    if "raw" in t.extra:
        return t.extra["raw"]  # type: ignore[no-any-return]
    d: dict[str, Any] = {"name": t.name or ""}
    if t.description is not None:
        d["description"] = t.description
    if t.parameters is not None:
        d["input_schema"] = t.parameters
    for k, v in t.extra.items():
        if k not in _FOREIGN_TOOL_KEYS:
            d[k] = v
    return d


def render_request(request: CanonicalRequest) -> dict[str, Any]:
    body: dict[str, Any] = {}
    if request.model is not None:
        body["model"] = request.model
    system, msgs = render_messages(request.messages)
    body["messages"] = msgs
    if system is not None:
        body["system"] = system
    s = request.sampling
    if s.max_tokens is not None:
        body["max_tokens"] = s.max_tokens
    if s.temperature is not None:
        body["temperature"] = s.temperature
    if s.top_p is not None:
        body["top_p"] = s.top_p
    if s.top_k is not None:
        body["top_k"] = s.top_k
    if s.stop is not None:
        body["stop_sequences"] = s.stop
    if request.tools:
        body["tools"] = [_render_tool(t) for t in request.tools]
    if request.tool_choice is not None:
        body["tool_choice"] = request.tool_choice
    if request.stream:
        body["stream"] = True
    elif "stream" in request.raw:
        body["stream"] = False
    body.update(request.extra)
    return body


# =========================================================================== response

_STOP_IN = {"end_turn": "stop", "stop_sequence": "stop", "pause_turn": "stop", "tool_use": "tool_calls",
            "max_tokens": "length", "model_context_window_exceeded": "length", "refusal": "content_filter"}
_STOP_OUT = {"stop": "end_turn", "tool_calls": "tool_use", "length": "max_tokens",
             "content_filter": "refusal"}


def stop_reason_of(c: Completion) -> str:
    if c.tool_calls and c.finish_reason == "stop":
        return "tool_use"
    if c.finish_reason == "stop" and c.extra.get("stop_sequence"):
        return "stop_sequence"
    return _STOP_OUT.get(c.finish_reason, "end_turn")


def parse_usage(u: Any) -> Usage | None:
    if not isinstance(u, dict):
        return None
    cached = int_or0(u.get("cache_read_input_tokens"))
    return usage(
        int_or0(u.get("input_tokens")) + cached + int_or0(u.get("cache_creation_input_tokens")),
        int_or0(u.get("output_tokens")),
        cached,
    )


def render_usage(u: Usage | None) -> dict[str, Any]:
    if u is None:
        u = NO_USAGE
    return {
        "input_tokens": max(u.input_tokens - u.cached_input_tokens, 0),
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": u.cached_input_tokens,
        "output_tokens": u.output_tokens,
    }


def parse_response(body: Any, request: CanonicalRequest | None = None) -> Completion:
    b = require_object(body)
    content = b.get("content")
    if not isinstance(content, list):
        fail("'content' must be an array of content blocks", "content")
    texts: list[str] = []
    thinking: list[str] = []
    calls: list[ToolCall] = []
    extra: dict[str, Any] = {}
    for j, blk in enumerate(content):
        if not isinstance(blk, dict):
            fail(f"'content[{j}]' must be an object", f"content[{j}]")
        t = blk.get("type")
        if t == "text" and isinstance(blk.get("text"), str):
            texts.append(blk["text"])
        elif t == "thinking" and isinstance(blk.get("thinking"), str):
            thinking.append(blk["thinking"])
            if isinstance(blk.get("signature"), str) and blk["signature"]:
                extra["signature"] = blk["signature"]
        elif t == "redacted_thinking":
            extra.setdefault("redacted_thinking", []).append(blk.get("data"))
        elif t == "tool_use":
            if not isinstance(blk.get("name"), str):
                fail(f"'content[{j}].name' must be a string", f"content[{j}].name")
            tid = blk.get("id")
            calls.append(tool_call(tid if isinstance(tid, str) else new_id("toolu_"), blk["name"],
                                   json_str(blk.get("input", {}))))
    sr = b.get("stop_reason")
    finish = _STOP_IN.get(sr, "tool_calls" if calls else "stop") if isinstance(sr, str) else (
        "tool_calls" if calls else "stop")
    if sr == "stop_sequence" and isinstance(b.get("stop_sequence"), str):
        extra["stop_sequence"] = b["stop_sequence"]
    model = b.get("model")
    return mk_completion(
        text="".join(texts) if texts else None,
        reasoning="\n\n".join(thinking) if thinking else None,
        tool_calls=calls,
        finish_reason=finish,
        usage=parse_usage(b.get("usage")),
        tokens=None,
        model=model if isinstance(model, str) else None,
        extra=extra,
    )


def response_id_of(response_id: str) -> str:
    return response_id if response_id.startswith("msg_") else "msg_" + response_id


def render_content_blocks(c: Completion) -> list[dict[str, Any]]:
    blocks: list[dict[str, Any]] = []
    if c.reasoning is not None:
        blocks.append(
            {"type": "thinking", "thinking": c.reasoning, "signature": c.extra.get("signature", "")})
    for data in c.extra.get("redacted_thinking", ()):
        blocks.append({"type": "redacted_thinking", "data": data})
    if c.text or (c.text == "" and not c.tool_calls):
        blocks.append({"type": "text", "text": c.text})
    for tc in c.tool_calls:
        blocks.append({"type": "tool_use", "id": tc.id or new_id("toolu_"), "name": tc.name,
                       "input": _render_args(tc)})
    return blocks


def render_response(completion: Completion, request: CanonicalRequest, response_id: str) -> dict[str, Any]:
    c = completion
    return {
        "id": response_id_of(response_id),
        "type": "message",
        "role": "assistant",
        "model": c.model or request.model or "unknown",
        "content": render_content_blocks(c),
        "stop_reason": stop_reason_of(c),
        "stop_sequence": c.extra.get("stop_sequence"),
        "usage": render_usage(c.usage),
    }


# =========================================================================== errors


def error_type(status: int) -> str:
    if status == 401:
        return "authentication_error"
    if status == 403:
        return "permission_error"
    if status == 404:
        return "not_found_error"
    if status == 413:
        return "request_too_large"
    if status == 429:
        return "rate_limit_error"
    if status in (503, 529):
        return "overloaded_error"
    if status == 504:
        return "timeout_error"
    if status >= 500:
        return "api_error"
    return "invalid_request_error"


def error_body(status: int, message: str, *, param: str | None = None) -> dict[str, Any]:
    return {"type": "error", "error": {"type": error_type(status), "message": message}}


# =========================================================================== streaming


class _Block:
    __slots__ = ("custom", "fed", "index", "kind", "tool_index")

    def __init__(self, kind: str, index: int, tool_index: int | None = None, custom: bool = False) -> None:
        self.kind = kind
        self.index = index
        self.tool_index = tool_index
        self.custom = custom
        self.fed = ""


class AnthropicStreamEncoder(StreamEncoderBase[_Block]):
    """``event: <type>\\ndata: <json>\\n\\n`` from message_start to message_stop."""

    tool_id_prefix = "toolu_"

    def __init__(self, request: CanonicalRequest, response_id: str) -> None:
        super().__init__()
        self.id = response_id_of(response_id)
        self.model = request.model or "unknown"
        self.blocks: list[_Block] = []
        self.open: _Block | None = None
        self.reasoning = ""
        self.text = ""
        self.signed = False

    def _start(self) -> bytes:
        msg: dict[str, Any] = {
            "id": self.id, "type": "message", "role": "assistant", "model": self.model, "content": [],
            "stop_reason": None, "stop_sequence": None,
            "usage": {"input_tokens": 0, "cache_creation_input_tokens": 0, "cache_read_input_tokens": 0,
                      "output_tokens": 0},
        }
        return sse_event("message_start", {"type": "message_start", "message": msg}) + \
            sse_event("ping", {"type": "ping"})

    # -- block helpers
    def _close(self) -> bytes:
        b = self.open
        if b is None:
            return b""
        self.open = None
        out = b""
        if b.custom:
            out = self._delta(b, {"type": "input_json_delta", "partial_json": '"}'})
        return out + sse_event("content_block_stop", {"type": "content_block_stop", "index": b.index})

    def _open(self, kind: str, cb: dict[str, Any], tool_index: int | None = None,
              custom: bool = False) -> bytes:
        out = self._close()
        b = _Block(kind, len(self.blocks), tool_index, custom)
        self.blocks.append(b)
        self.open = b
        if tool_index is not None:
            self.tools[tool_index] = b
        out += sse_event("content_block_start", {"type": "content_block_start", "index": b.index,
                                                 "content_block": cb})
        if custom:
            out += self._delta(b, {"type": "input_json_delta", "partial_json": '{"input": "'})
        return out

    def _delta(self, b: _Block, delta: dict[str, Any]) -> bytes:
        return sse_event("content_block_delta",
                         {"type": "content_block_delta", "index": b.index, "delta": delta})

    # -- the skeleton's hooks
    def _reasoning(self, text: str) -> bytes:
        out = b""
        if self.open is None or self.open.kind != "thinking":
            out = self._open("thinking", {"type": "thinking", "thinking": "", "signature": ""})
        self.reasoning += text
        return out + self._delta(self.open, {"type": "thinking_delta", "thinking": text})  # type: ignore[arg-type]

    def _signature(self, signature: str) -> bytes:
        # As Anthropic streams it: the signature is the thinking block's last delta, then the block stops.
        out = b""
        if self.open is None or self.open.kind != "thinking":
            out = self._open("thinking", {"type": "thinking", "thinking": "", "signature": ""})
        b = self.open
        assert b is not None
        self.signed = True
        return out + self._delta(b, {"type": "signature_delta", "signature": signature}) + self._close()

    def _finish_signature(self, completion: Completion) -> bytes:
        sig = completion.extra.get("signature")
        # Only a thinking block still open can take the signature: once text or a tool call has
        # started, the thinking block is stopped and there is no way back into it.
        if sig and not self.signed and self.open is not None and self.open.kind == "thinking":
            return self._delta(self.open, {"type": "signature_delta", "signature": sig})
        return b""

    def _text(self, text: str) -> bytes:
        out = b""
        if self.open is None or self.open.kind != "text":
            out = self._open("text", {"type": "text", "text": ""})
        self.text += text
        return out + self._delta(self.open, {"type": "text_delta", "text": text})  # type: ignore[arg-type]

    def _tool_open(self, index: int, call_id: str, name: str, tool_type: str) -> bytes:
        return self._open("tool", {"type": "tool_use", "id": call_id, "name": name, "input": {}}, index,
                          tool_type == "custom")

    def _tool_resume(self, index: int) -> bytes:
        return self._close() if self.open is not self.tools[index] else b""

    def _tool_args(self, index: int, args: str) -> bytes:
        b = self.tools[index]
        b.fed += args
        frag = orjson.dumps(args).decode()[1:-1] if b.custom else args
        return self._delta(b, {"type": "input_json_delta", "partial_json": frag})

    def _fresh_tool_args(self, index: int, call: ToolCall) -> bytes:
        args = call.arguments
        if call.type != "custom":
            args = orjson.dumps(_render_args(call)).decode() if args else ""
        return self._tool_args(index, args) if args and args != "{}" else b""

    def _fed_reasoning(self) -> str:
        return self.reasoning

    def _fed_text(self) -> str:
        return self.text

    def _fed_args(self, index: int) -> str:
        return self.tools[index].fed

    def _end(self, completion: Completion) -> bytes:
        c = completion
        stop = "tool_use" if (self.tools and c.finish_reason == "stop") else stop_reason_of(c)
        return self._close() + sse_event("message_delta", {
            "type": "message_delta",
            "delta": {"stop_reason": stop, "stop_sequence": c.extra.get("stop_sequence")},
            "usage": render_usage(c.usage),
        }) + sse_event("message_stop", {"type": "message_stop"})

    def _error(self, status: int, message: str) -> bytes:
        return sse_event("error", error_body(status, message))


ADAPTER = ProtocolAdapter(
    protocol=PROTOCOL,
    parse_request=parse_request,
    render_request=render_request,
    parse_response=parse_response,
    render_response=render_response,
    stream_encoder=AnthropicStreamEncoder,
    error_body=error_body,
)

__all__ = ["ADAPTER", "AnthropicStreamEncoder", "parse_count_tokens_request"]
