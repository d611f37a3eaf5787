"""OpenAI responses (``POST /v1/responses``) <-> canonical form.

Codex speaks only this API (always streaming).

Mapping of ``input`` items to canonical messages:

* ``instructions`` becomes a leading ``system`` message; a string ``input``
  becomes one ``user`` message (marked ``extra["input_string"]``).
* ``message`` items (typed or bare ``{role, content}``, the latter marked
  ``extra["bare"]``) become messages of their role (``developer`` stays
  ``developer``); ``input_text`` / ``output_text`` parts become ``text`` parts,
  ``input_image`` an ``image`` part (``image_url`` -> ``url``), ``input_file``
  a ``file`` part; item ids / status are kept in ``extra``.
* Consecutive ``reasoning`` -> assistant ``message`` -> ``function_call`` /
  ``custom_tool_call`` items (in the order the API emits them) merge into ONE
  assistant message: reasoning summary text -> ``reasoning`` (the rest of the
  reasoning item, e.g. ``id`` / ``encrypted_content``, in
  ``extra["reasoning_item"]``), calls -> ``tool_calls`` (``call_id`` -> ``id``;
  item ``id`` / ``status`` in the call's ``extra``; custom calls have
  ``type="custom"`` and their ``input`` as ``arguments``).
* ``function_call_output`` / ``custom_tool_call_output`` become ``tool``
  messages (``call_id`` -> ``tool_call_id``).
* Any other item (``item_reference``, ``web_search_call``, ``compaction``,
  ...) becomes a message with ``content=None`` and the verbatim item in
  ``extra["item"]``; tools other than ``function`` are kept verbatim in
  ``Tool.extra["raw"]``.

Native -> canonical -> native round trips are exact (dict key order aside).
"""

from __future__ import annotations

from typing import Any

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
    check_numbers,
    expect,
    fail,
    int_or0,
    message,
    mk_completion,
    mk_request,
    mk_sampling,
    mk_tool,
    new_id,
    now,
    openai_error_body,
    openai_error_code,
    opt_bool,
    opt_int,
    opt_num,
    opt_str,
    part,
    require_object,
    rest,
    sse_event,
    tool_call,
    usage,
)
from ares_gateway.protocols._stream import StreamEncoderBase

PROTOCOL = WireProtocol.OPENAI_RESPONSES

_REQ_KNOWN = frozenset(
    {"model", "input", "instructions", "tools", "tool_choice", "parallel_tool_calls", "max_output_tokens",
     "temperature", "top_p", "stream"}
)
_MSG_ITEM_KNOWN = frozenset({"type", "role", "content"})
_TEXT_KNOWN = frozenset({"type", "text"})
_IMAGE_KNOWN = frozenset({"type", "image_url"})
_FC_KNOWN = frozenset({"type", "call_id", "name", "arguments"})
_CTC_KNOWN = frozenset({"type", "call_id", "name", "input"})
_OUT_KNOWN = frozenset({"type", "call_id", "output"})
_REASONING_KNOWN = frozenset({"type", "summary"})
_FN_TOOL_KNOWN = frozenset({"type", "name", "description", "parameters"})
_MARKERS = MARKERS
_PART_MARKERS = frozenset({"part_type", "bare", "image_url_extra", "cache_control"})


# =========================================================================== request


def _default_part_type(role: str) -> str:
    return "output_text" if role == "assistant" else "input_text"


def _parse_parts(parts: list[Any], role: str, param: str) -> list[ContentPart]:
    out: list[ContentPart] = []
    default = _default_part_type(role)
    for j, p in enumerate(parts):
        pp = f"{param}[{j}]"
        if not isinstance(p, dict):
            fail(f"'{pp}' must be an object", pp)
        t = p.get("type")
        if t in ("input_text", "output_text", "text"):
            text = p.get("text")
            if not isinstance(text, str):
                fail(f"'{pp}.text' must be a string", f"{pp}.text")
            extra = rest(p, _TEXT_KNOWN) if len(p) > 2 else {}
            if t != default:
                extra["part_type"] = t
            out.append(part("text", text, extra=extra))
        elif t == "input_image":
            url = p.get("image_url")
            if url is not None and not isinstance(url, str):
                fail(f"'{pp}.image_url' must be a string", f"{pp}.image_url")
            out.append(part("image", url=url, extra=rest(p, _IMAGE_KNOWN)))
        elif t == "input_file":
            out.append(part("file", extra=rest(p, frozenset({"type"}))))
        elif t == "input_audio":
            out.append(part("audio", extra=rest(p, frozenset({"type"}))))
        elif isinstance(t, str):
            text = p.get("text")
            if isinstance(text, str):
                out.append(part(t, text, extra=rest(p, _TEXT_KNOWN)))
            else:
                out.append(part(t, extra=rest(p, frozenset({"type"}))))
        else:
            fail(f"'{pp}.type' must be a string", f"{pp}.type")
    return out


def _parse_content(content: Any, role: str, param: str) -> str | list[ContentPart] | None:
    if content is None or isinstance(content, str):
        return content
    if isinstance(content, list):
        return _parse_parts(content, role, param)
    fail(f"'{param}' must be a string or an array of content parts", param)


def _summary_text(summary: Any) -> tuple[str | None, bool]:
    """(reasoning text, whether the summary is exactly one plain summary_text part)."""
    if not isinstance(summary, list) or not summary:
        return None, False
    texts = []
    plain = True
    for s in summary:
        if isinstance(s, dict) and isinstance(s.get("text"), str):
            texts.append(s["text"])
            if s.get("type") != "summary_text" or len(s) != 2:
                plain = False
        else:
            plain = False
    return ("\n\n".join(texts) if texts else None), plain and len(summary) == 1


def _reasoning_from_item(item: dict[str, Any]) -> tuple[str | None, dict[str, Any] | None]:
    summary = item.get("summary")
    text, plain = _summary_text(summary)
    extra = rest(item, _REASONING_KNOWN)
    if not plain and "summary" in item:  # several parts, empty, or extra keys: keep it verbatim
        extra["summary"] = summary
    return text, (extra or None)


def parse_input(items: list[Any], messages: list[Message]) -> None:
    """Append the canonical messages of Responses ``input`` items to ``messages``."""
    pending: Message | None = None
    stage = 0  # of pending: 1 reasoning, 2 message, 3 tool calls
    custom_ids: set[str] = set()
    for i, item in enumerate(items):
        param = f"input[{i}]"
        if not isinstance(item, dict):
            fail(f"'{param}' must be an object", param)
        t = item.get("type")
        if t is None and "role" in item:
            t = "message"
        if t == "message":
            role = item.get("role")
            if not isinstance(role, str):
                fail(f"'{param}.role' must be a string", f"{param}.role")
            content = _parse_content(item.get("content"), role, f"{param}.content")
            extra = rest(item, _MSG_ITEM_KNOWN) if len(item) > 3 else {}
            if "type" not in item:
                extra["bare"] = True
            if role == "assistant":
                if pending is not None and stage <= 1:
                    pending.content = content
                    pending.extra.update(extra)
                    stage = 2
                    continue
                pending = message("assistant", content, extra=extra)
                stage = 2
                messages.append(pending)
                continue
            pending = None
            if role == "system" and not messages and isinstance(content, str):
                extra["in_messages"] = True
            messages.append(message(role, content, extra=extra))
        elif t in ("function_call", "custom_tool_call"):
            cid, name = item.get("call_id"), item.get("name")
            if not isinstance(cid, str):
                fail(f"'{param}.call_id' must be a string", f"{param}.call_id")
            if not isinstance(name, str):
                fail(f"'{param}.name' must be a string", f"{param}.name")
            if t == "function_call":
                args = item.get("arguments", "")
                if not isinstance(args, str):
                    fail(f"'{param}.arguments' must be a string", f"{param}.arguments")
                tc = tool_call(cid, name, args, "function", rest(item, _FC_KNOWN))
            else:
                inp = item.get("input", "")
                if not isinstance(inp, str):
                    fail(f"'{param}.input' must be a string", f"{param}.input")
                tc = tool_call(cid, name, inp, "custom", rest(item, _CTC_KNOWN))
                custom_ids.add(cid)
            if pending is None:
                pending = message("assistant", None)
                messages.append(pending)
            pending.tool_calls.append(tc)
            stage = 3
        elif t in ("function_call_output", "custom_tool_call_output"):
            pending = None
            cid = item.get("call_id")
            if not isinstance(cid, str):
                fail(f"'{param}.call_id' must be a string", f"{param}.call_id")
            extra = rest(item, _OUT_KNOWN)
            if t == "custom_tool_call_output" and cid not in custom_ids:
                extra["custom"] = True
            elif t == "function_call_output" and cid in custom_ids:
                extra["custom"] = False
            messages.append(message("tool", _parse_content(item.get("output"), "tool", f"{param}.output"),
                                    tool_call_id=cid, extra=extra))
        elif t == "reasoning":
            text, rextra = _reasoning_from_item(item)
            if pending is None or stage >= 1:
                pending = message("assistant", None)
                messages.append(pending)
            pending.reasoning = text
            if rextra is not None or text is None:
                pending.extra["reasoning_item"] = rextra or {}
            stage = 1
        elif isinstance(t, str):
            pending = None
            role = "assistant" if t.endswith("_call") else ("tool" if t.endswith("_output") else "user")
            messages.append(message(role, None, extra={"item": item}))
        else:
            fail(f"'{param}.type' must be a string", f"{param}.type")


def _parse_tool(t: Any, param: str) -> Tool:
    if not isinstance(t, dict):
        fail(f"'{param}' must be an object", param)
    typ = t.get("type")
    if not isinstance(typ, str):
        fail(f"'{param}.type' must be a string", f"{param}.type")
    if typ == "function":
        name = t.get("name")
        if not isinstance(name, str):
            fail(f"'{param}.name' must be a string", f"{param}.name")
        params = t.get("parameters")
        if params is not None and not isinstance(params, dict):
            fail(f"'{param}.parameters' must be an object", f"{param}.parameters")
        return mk_tool(
            type="function", name=name, description=opt_str(t, "description", f"{param}.description"),
            parameters=params, extra=rest(t, _FN_TOOL_KNOWN),
        )
    name, desc = t.get("name"), t.get("description")
    return mk_tool(
        type=typ, name=name if isinstance(name, str) else None,
        description=desc if isinstance(desc, str) else None, parameters=None, extra={"raw": t},
    )


def parse_request(body: Any, *, reuse: Reuse | None = None,
                  ends: list[int] | None = None) -> CanonicalRequest:
    """Parse a ``/v1/responses`` body. ``reuse``: only its tools are taken over (an input item may fold
    into the message before it, so items are always read again); ``ends`` is left empty."""
    b = require_object(body)
    check_numbers(b, {"top_logprobs": (0, 20)}, {})  # passed on verbatim: within what the API accepts
    messages: list[Message] = []
    instr = b.get("instructions")
    extra = rest(b, _REQ_KNOWN)
    if isinstance(instr, str):
        messages.append(message("system", instr))
    elif instr is not None:
        extra["instructions"] = instr  # a list of items (as echoed in response objects): kept verbatim
    inp = b.get("input")
    if isinstance(inp, str):
        messages.append(message("user", inp, extra={"input_string": True}))
    elif isinstance(inp, list):
        parse_input(inp, messages)
    elif inp is not None:
        fail("'input' must be a string or an array of input items", "input")
    tools: list[Tool] = []
    if reuse is not None and reuse.outside:
        tools = reuse.tools
    elif b.get("tools") is not None:
        expect(b["tools"], list, "tools", "an array")
        tools = [_parse_tool(t, f"tools[{i}]") for i, t in enumerate(b["tools"])]
    model = b.get("model")
    if model is not None and not isinstance(model, str):
        fail("'model' must be a string", "model")
    return mk_request(
        protocol=PROTOCOL,
        model=model,
        messages=messages,
        tools=tools,
        tool_choice=b.get("tool_choice"),
        parallel_tool_calls=opt_bool(b, "parallel_tool_calls", "parallel_tool_calls"),
        sampling=mk_sampling(
            max_tokens=opt_int(b, "max_output_tokens", "max_output_tokens", 1, MAX_TOKENS_LIMIT),
            temperature=opt_num(b, "temperature", "temperature", 0.0, 2.0),
            top_p=opt_num(b, "top_p", "top_p", 0.0, 1.0),
            top_k=None,
            stop=None,
            seed=None,
            extra={},
        ),
        stream=bool(opt_bool(b, "stream", "stream")),
        include_usage=False,
        extra=extra,
        raw=b,
    )


def _render_part(p: ContentPart, role: str) -> dict[str, Any]:
    ex = p.extra
    t = p.type
    if t == "text":
        d: dict[str, Any] = {"type": ex.get("part_type", _default_part_type(role)), "text": p.text or ""}
    elif t == "image":
        d = {"type": "input_image"}
        if p.url is not None:
            d["image_url"] = p.url
        if "detail" not in ex and "file_id" not in ex and p.url is not None:
            d["detail"] = "auto"
    elif t == "file":
        d = {"type": "input_file"}
    elif t == "audio":
        d = {"type": "input_audio"}
    else:
        d = {"type": t}
        if p.text is not None:
            d["text"] = p.text
    if ex:
        for k, v in ex.items():
            if k not in _PART_MARKERS:
                d[k] = v
    return d


def _render_content(content: str | list[ContentPart] | None, role: str) -> Any:
    if content is None or isinstance(content, str):
        return content
    return [_render_part(p, role) for p in content]


def _clean(extra: dict[str, Any], drop: frozenset[str] = _MARKERS) -> dict[str, Any]:
    return {k: v for k, v in extra.items() if k not in drop}


def _render_call_item(tc: ToolCall) -> dict[str, Any]:
    if tc.type == "custom":
        d: dict[str, Any] = {"type": "custom_tool_call", "call_id": tc.id, "name": tc.name,
                             "input": tc.arguments}
    else:
        d = {"type": "function_call", "call_id": tc.id, "name": tc.name, "arguments": tc.arguments}
    for k, v in tc.extra.items():
        if k not in ("legacy", "no_type", "function_extra", "type", "cache_control"):
            d[k] = v
    return d


def _reasoning_item(reasoning: str | None, rextra: dict[str, Any] | None) -> dict[str, Any]:
    item: dict[str, Any] = {"type": "reasoning"}
    if rextra and "summary" in rextra:
        item.update(rextra)
        return item
    item["summary"] = [{"type": "summary_text", "text": reasoning}] if reasoning is not None else []
    if rextra:
        item.update(rextra)
    return item


def render_input(messages: list[Message]) -> list[dict[str, Any]]:
    items: list[dict[str, Any]] = []
    custom_ids: set[str] = set()
    for m in messages:
        ex = m.extra
        if "item" in ex:
            items.append(ex["item"])
            continue
        role = m.role
        if role == "assistant":
            rextra = ex.get("reasoning_item")
            if m.reasoning is not None or rextra is not None:
                items.append(_reasoning_item(m.reasoning, rextra))
            if m.content is not None:
                d: dict[str, Any] = {} if ex.get("bare") else {"type": "message"}
                d["role"] = "assistant"
                d["content"] = _render_content(m.content, role)
                d.update(_clean(ex))
                items.append(d)
            for tc in m.tool_calls:
                if tc.type == "custom":
                    custom_ids.add(tc.id)
                items.append(_render_call_item(tc))
        elif role == "tool":
            custom = ex.get("custom")
            if custom is None:
                custom = m.tool_call_id in custom_ids
            items.append({
                "type": "custom_tool_call_output" if custom else "function_call_output",
                "call_id": m.tool_call_id or "",
                "output": _render_content(m.content, role) if m.content is not None else "",
                **_clean(ex),
            })
        else:
            d = {} if ex.get("bare") else {"type": "message"}
            d["role"] = role
            d["content"] = _render_content(m.content, role)
            d.update(_clean(ex))
            items.append(d)
    return items


def _render_tool(t: Tool) -> dict[str, Any]:
    if "raw" in t.extra:
        return t.extra["raw"]  # type: ignore[no-any-return]
    d: dict[str, Any] = {"type": "function", "name": t.name or ""}
    if t.description is not None:
        d["description"] = t.description
    if t.parameters is not None:
        d["parameters"] = t.parameters
    for k, v in t.extra.items():
        if k not in ("tool_extra", "legacy", "no_type", "cache_control"):
            d[k] = v
    return d


def render_request(request: CanonicalRequest) -> dict[str, Any]:
    body: dict[str, Any] = {}
    if request.model is not None:
        body["model"] = request.model
    msgs = request.messages
    if msgs and msgs[0].role == "system" and isinstance(msgs[0].content, str) \
            and not msgs[0].extra.get("in_messages") and "item" not in msgs[0].extra:
        body["instructions"] = msgs[0].content
        msgs = msgs[1:]
    if len(msgs) == 1 and msgs[0].extra.get("input_string") and isinstance(msgs[0].content, str):
        body["input"] = msgs[0].content
    elif msgs or "input" in request.raw or not request.raw:
        body["input"] = render_input(msgs)
    if request.tools:
        body["tools"] = [_render_tool(t) for t in request.tools]
    if request.tool_choice is not None:
        body["tool_choice"] = request.tool_choice
    if request.parallel_tool_calls is not None:
        body["parallel_tool_calls"] = request.parallel_tool_calls
    s = request.sampling
    if s.max_tokens is not None:
        body["max_output_tokens"] = s.max_tokens
    if s.temperature is not None:
        body["temperature"] = s.temperature
    if s.top_p is not None:
        body["top_p"] = s.top_p
    if request.stream:
        body["stream"] = True
    elif "stream" in request.raw:
        body["stream"] = False
    body.update(request.extra)
    return body


# =========================================================================== response


def parse_usage(u: Any) -> Usage | None:
    if not isinstance(u, dict):
        return None
    itd, otd = u.get("input_tokens_details"), u.get("output_tokens_details")
    return usage(
        int_or0(u.get("input_tokens")),
        int_or0(u.get("output_tokens")),
        int_or0(itd.get("cached_tokens")) if isinstance(itd, dict) else 0,
        int_or0(otd.get("reasoning_tokens")) if isinstance(otd, dict) else 0,
    )


def render_usage(u: Usage | None) -> dict[str, Any]:
    if u is None:
        u = NO_USAGE
    return {
        "input_tokens": u.input_tokens,
        "input_tokens_details": {"cached_tokens": u.cached_input_tokens},
        "output_tokens": u.output_tokens,
        "output_tokens_details": {"reasoning_tokens": u.reasoning_tokens},
        "total_tokens": u.input_tokens + u.output_tokens,
    }


def parse_response(body: Any, request: CanonicalRequest | None = None) -> Completion:
    b = require_object(body)
    if b.get("object") != "response" and isinstance(b.get("response"), dict):
        b = b["response"]  # a response.completed event
    output = b.get("output")
    if not isinstance(output, list):
        fail("'output' must be an array of output items", "output")
    texts: list[str] = []
    reasoning: list[str] = []
    calls: list[ToolCall] = []
    extra: dict[str, Any] = {}
    for j, item in enumerate(output):
        if not isinstance(item, dict):
            fail(f"'output[{j}]' must be an object", f"output[{j}]")
        t = item.get("type")
        if t == "message":
            content = item.get("content")
            if isinstance(content, str):
                texts.append(content)
            elif isinstance(content, list):
                for p in content:
                    if isinstance(p, dict):
                        if isinstance(p.get("text"), str):
                            texts.append(p["text"])
                        elif isinstance(p.get("refusal"), str):
                            extra["refusal"] = p["refusal"]
        elif t == "reasoning":
            text, _ = _summary_text(item.get("summary"))
            if text is None:
                rc = item.get("content")
                if isinstance(rc, list):
                    text = "".join(p.get("text", "") for p in rc if isinstance(p, dict)) or None
            if text is not None:
                reasoning.append(text)
            if isinstance(item.get("encrypted_content"), str):
                extra["encrypted_content"] = item["encrypted_content"]
        elif t in ("function_call", "custom_tool_call"):
            name = item.get("name")
            if not isinstance(name, str):
                fail(f"'output[{j}].name' must be a string", f"output[{j}].name")
            cid = item.get("call_id")
            cid = cid if isinstance(cid, str) else new_id("call_")
            if t == "function_call":
                args = item.get("arguments")
                calls.append(tool_call(cid, name, args if isinstance(args, str) else "{}"))
            else:
                inp = item.get("input")
                calls.append(tool_call(cid, name, inp if isinstance(inp, str) else "", "custom"))
    finish = "tool_calls" if calls else "stop"
    if b.get("status") == "incomplete":
        det = b.get("incomplete_details")
        reason = det.get("reason") if isinstance(det, dict) else None
        finish = "content_filter" if reason == "content_filter" else "length"
    model = b.get("model")
    return mk_completion(
        text="".join(texts) if texts else None,
        reasoning="\n\n".join(reasoning) if reasoning else None,
        tool_calls=calls,
        finish_reason=finish,
        usage=parse_usage(b.get("usage")),
        tokens=None,
        model=model if isinstance(model, str) else None,
        extra=extra,
    )


def response_id_of(response_id: str) -> str:
    return response_id if response_id.startswith("resp_") else "resp_" + response_id


def _reasoning_out(text: str, rid: str, c: Completion | None) -> dict[str, Any]:
    item: dict[str, Any] = {"id": rid, "type": "reasoning",
                            "summary": [{"type": "summary_text", "text": text}] if text else []}
    if c is not None and isinstance(c.extra.get("encrypted_content"), str):
        item["encrypted_content"] = c.extra["encrypted_content"]
    return item


def _text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _message_out(text: str, mid: str, status: str = "completed") -> dict[str, Any]:
    return {"id": mid, "type": "message", "status": status, "role": "assistant",
            "content": [_text_part(text)] if status == "completed" else []}


def _call_out(tc_type: str, iid: str, call_id: str, name: str, args: str,
              status: str = "completed") -> dict[str, Any]:
    if tc_type == "custom":
        return {"id": iid, "type": "custom_tool_call", "status": status, "call_id": call_id, "name": name,
                "input": args}
    return {"id": iid, "type": "function_call", "status": status, "arguments": args, "call_id": call_id,
            "name": name}


def _status(c: Completion) -> tuple[str, dict[str, Any] | None]:
    if c.finish_reason == "length":
        return "incomplete", {"reason": "max_output_tokens"}
    if c.finish_reason == "content_filter":
        return "incomplete", {"reason": "content_filter"}
    return "completed", None


def _envelope(request: CanonicalRequest, rid: str, created: int, model: str) -> dict[str, Any]:
    raw = request.raw
    reasoning = raw.get("reasoning")
    return {
        "id": rid,
        "object": "response",
        "created_at": created,
        "status": "in_progress",
        "background": False,
        "error": None,
        "incomplete_details": None,
        "instructions": raw.get("instructions"),
        "max_output_tokens": raw.get("max_output_tokens"),
        "model": model,
        "output": [],
        "parallel_tool_calls": raw.get("parallel_tool_calls", True),
        "previous_response_id": raw.get("previous_response_id"),
        "reasoning": reasoning if isinstance(reasoning, dict) else {"effort": None, "summary": None},
        "store": raw.get("store", True),
        "temperature": raw.get("temperature", 1.0),
        "text": raw.get("text", {"format": {"type": "text"}}),
        "tool_choice": raw.get("tool_choice", "auto"),
        "tools": raw.get("tools", []),
        "top_p": raw.get("top_p", 1.0),
        "truncation": raw.get("truncation", "disabled"),
        "usage": None,
        "user": raw.get("user"),
        "metadata": raw.get("metadata", {}),
    }


def render_output(c: Completion) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    if c.reasoning is not None or "encrypted_content" in c.extra:
        out.append(_reasoning_out(c.reasoning or "", new_id("rs_", 16), c))
    if c.text:
        out.append(_message_out(c.text, new_id("msg_", 16)))
    for tc in c.tool_calls:
        out.append(_call_out(tc.type, new_id("fc_" if tc.type == "function" else "ctc_", 16),
                             tc.id or new_id("call_"), tc.name, tc.arguments))
    return out


def render_response(completion: Completion, request: CanonicalRequest, response_id: str) -> dict[str, Any]:
    c = completion
    body = _envelope(request, response_id_of(response_id), now(), c.model or request.model or "unknown")
    status, details = _status(c)
    body["status"] = status
    body["incomplete_details"] = details
    body["output"] = render_output(c)
    body["usage"] = render_usage(c.usage)
    return body


# =========================================================================== streaming


class _Item:
    __slots__ = ("call_id", "done", "id", "index", "kind", "name", "text", "tool_index", "tool_type")

    def __init__(self, kind: str, index: int, iid: str) -> None:
        self.kind = kind  # reasoning | message | call
        self.index = index
        self.id = iid
        self.text = ""
        self.done = False
        self.tool_index: int | None = None
        self.tool_type = "function"
        self.call_id = ""
        self.name = ""


class ResponsesStreamEncoder(StreamEncoderBase[_Item]):
    """``event:`` + ``data:`` lines from response.created to response.completed, with sequence numbers."""

    def __init__(self, request: CanonicalRequest, response_id: str) -> None:
        super().__init__()
        self.request = request
        self.id = response_id_of(response_id)
        self.created = now()
        self.model = request.model or "unknown"
        self.seq = 0
        self.items: list[_Item] = []
        self.open: _Item | None = None
        self.started = False
        self.completion: Completion | None = None

    def _ev(self, typ: str, data: dict[str, Any]) -> bytes:
        data["type"] = typ
        data["sequence_number"] = self.seq
        self.seq += 1
        return sse_event(typ, data)

    def _envelope(self) -> dict[str, Any]:
        return _envelope(self.request, self.id, self.created, self.model)

    def _start(self) -> bytes:
        self.started = True
        return self._ev("response.created", {"response": self._envelope()}) + \
            self._ev("response.in_progress", {"response": self._envelope()})

    def _before_feed(self) -> bytes:
        return b"" if self.started else self.start()

    def _before_finish(self, completion: Completion) -> bytes:
        self.completion = completion
        return b"" if self.started else self.start()

    # -- items
    def _item_json(self, it: _Item, final: bool) -> dict[str, Any]:
        status = "completed" if final else "in_progress"
        if it.kind == "reasoning":
            d = _reasoning_out(it.text if final else "", it.id, self.completion if final else None)
            return d
        if it.kind == "message":
            return _message_out(it.text, it.id, status)
        return _call_out(it.tool_type, it.id, it.call_id, it.name, it.text if final else "", status)

    def _open(self, it: _Item) -> bytes:
        out = self._close()
        self.items.append(it)
        self.open = it
        out += self._ev("response.output_item.added",
                        {"output_index": it.index, "item": self._item_json(it, False)})
        if it.kind == "reasoning":
            out += self._ev("response.reasoning_summary_part.added", {
                "item_id": it.id, "output_index": it.index, "summary_index": 0,
                "part": {"type": "summary_text", "text": ""}})
        elif it.kind == "message":
            out += self._ev("response.content_part.added", {
                "item_id": it.id, "output_index": it.index, "content_index": 0,
                "part": _text_part("")})
        return out

    def _close(self) -> bytes:
        it = self.open
        if it is None:
            return b""
        self.open = None
        it.done = True
        base = {"item_id": it.id, "output_index": it.index}
        if it.kind == "reasoning":
            out = self._ev("response.reasoning_summary_text.done",
                           {**base, "summary_index": 0, "text": it.text})
            out += self._ev("response.reasoning_summary_part.done", {
                **base, "summary_index": 0, "part": {"type": "summary_text", "text": it.text}})
        elif it.kind == "message":
            out = self._ev("response.output_text.done",
                           {**base, "content_index": 0, "text": it.text, "logprobs": []})
            out += self._ev("response.content_part.done",
                            {**base, "content_index": 0, "part": _text_part(it.text)})
        elif it.tool_type == "custom":
            out = self._ev("response.custom_tool_call_input.done", {**base, "input": it.text})
        else:
            out = self._ev("response.function_call_arguments.done",
                           {**base, "name": it.name, "arguments": it.text})
        return out + self._ev("response.output_item.done",
                              {"output_index": it.index, "item": self._item_json(it, True)})

    def _reasoning(self, text: str) -> bytes:
        out = b""
        if self.open is None or self.open.kind != "reasoning":
            out = self._open(_Item("reasoning", len(self.items), new_id("rs_", 16)))
        it = self.open
        assert it is not None
        it.text += text
        return out + self._ev("response.reasoning_summary_text.delta", {
            "item_id": it.id, "output_index": it.index, "summary_index": 0, "delta": text})

    def _text(self, text: str) -> bytes:
        out = b""
        if self.open is None or self.open.kind != "message":
            out = self._open(_Item("message", len(self.items), new_id("msg_", 16)))
        it = self.open
        assert it is not None
        it.text += text
        return out + self._ev("response.output_text.delta", {
            "item_id": it.id, "output_index": it.index, "content_index": 0, "delta": text, "logprobs": []})

    def _tool_open(self, index: int, call_id: str, name: str, tool_type: str) -> bytes:
        it = _Item("call", len(self.items), new_id("fc_" if tool_type == "function" else "ctc_", 16))
        it.tool_index, it.tool_type, it.call_id, it.name = index, tool_type, call_id, name
        self.tools[index] = it
        return self._open(it)

    def _tool_resume(self, index: int) -> bytes:
        return self._close() if self.open is not self.tools[index] else b""

    def _tool_args(self, index: int, args: str) -> bytes:
        it = self.tools[index]
        it.text += args
        typ = "response.custom_tool_call_input.delta" if it.tool_type == "custom" else \
            "response.function_call_arguments.delta"
        return self._ev(typ, {"item_id": it.id, "output_index": it.index, "delta": args})

    def _fed_reasoning(self) -> str:
        return "".join(it.text for it in self.items if it.kind == "reasoning")

    def _fed_text(self) -> str:
        return "".join(it.text for it in self.items if it.kind == "message")

    def _fed_args(self, index: int) -> str:
        return self.tools[index].text

    def _end(self, completion: Completion) -> bytes:
        c = completion
        out = self._close()
        resp = self._envelope()
        status, details = _status(c)
        resp["status"] = status
        resp["incomplete_details"] = details
        resp["output"] = [self._item_json(it, True) for it in self.items]
        resp["usage"] = render_usage(c.usage)
        return out + self._ev("response.completed" if status == "completed" else "response.incomplete",
                              {"response": resp})

    def _error(self, status: int, message: str) -> bytes:
        code = openai_error_code(status) or "invalid_request"
        out = self._ev("error", {"code": code, "message": message, "param": None})
        if self.started:
            resp = self._envelope()
            resp["status"] = "failed"
            resp["error"] = {"code": code, "message": message}
            resp["output"] = [self._item_json(it, True) for it in self.items]
            out += self._ev("response.failed", {"response": resp})
        return out


ADAPTER = ProtocolAdapter(
    protocol=PROTOCOL,
    parse_request=parse_request,
    render_request=render_request,
    parse_response=parse_response,
    render_response=render_response,
    stream_encoder=ResponsesStreamEncoder,
    error_body=openai_error_body,
)

__all__ = ["ADAPTER", "ResponsesStreamEncoder"]
