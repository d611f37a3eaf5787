"""OpenAI chat completions (``POST /v1/chat/completions``) <-> canonical form.

Used by mini-swe-agent and Terminus-2 (through litellm, non-streaming) and by
ares-proxy pollers (which answer ``/respond`` with a ``chat.completion`` body).

Documented normalizations of a native -> canonical -> native round trip:

* ``stop`` given as a string comes back as a one-element list;
* ``content`` is always present on rendered messages (``null`` when absent);
* an ``image_url`` given as a bare string comes back as ``{"url": ...}``;
* ``function_call`` on an assistant message (legacy functions) comes back as
  ``tool_calls`` with a ``legacy`` marker only if it had no id.

Everything else (unknown top-level keys, unknown message / part / tool keys)
is kept in the ``extra`` dicts and rendered back verbatim.
"""

from __future__ import annotations

from typing import Any

from ares_gateway.core.canonical import (
    CanonicalRequest,
    Completion,
    ContentPart,
    Message,
    TokenRecord,
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
    SEED_MAX,
    SEED_MIN,
    SSE_DONE,
    check_numbers,
    expect,
    fail,
    int_or0,
    json_str,
    message,
    mk_completion,
    mk_request,
    mk_sampling,
    mk_tokens,
    mk_tool,
    new_id,
    now,
    openai_error_body,
    opt_bool,
    opt_int,
    opt_num,
    opt_str,
    part,
    require_object,
    rest,
    sse_data,
    tool_call,
    usage,
)
from ares_gateway.protocols._stream import StreamEncoderBase

PROTOCOL = WireProtocol.OPENAI_CHAT

_REQ_KNOWN = frozenset(
    {
        "model", "messages", "tools", "tool_choice", "parallel_tool_calls", "max_tokens",
        "max_completion_tokens", "temperature", "top_p", "top_k", "stop", "seed", "stream",
        "stream_options", "functions",
    }
)
_MSG_KNOWN = frozenset(
    {"role", "content", "name", "tool_calls", "tool_call_id", "is_error", "reasoning_content", "reasoning",
     "function_call"}
)
_TEXT_PART_KNOWN = frozenset({"type", "text"})
_IMAGE_PART_KNOWN = frozenset({"type", "image_url"})
_FN_KNOWN = frozenset({"name", "description", "parameters"})
_TC_KNOWN = frozenset({"id", "type", "function", "custom"})


# =========================================================================== request


def _parse_parts(parts: list[Any], param: str) -> list[ContentPart]:
    out: list[ContentPart] = []
    for j, p in enumerate(parts):
        pp = f"{param}[{j}]"
        if isinstance(p, str):  # tolerated: a bare string part
            out.append(part("text", p, extra={"bare": True}))
            continue
        if not isinstance(p, dict):
            fail(f"'{pp}' must be an object", pp)
        t = p.get("type")
        if t == "text" or (t is None and "text" in p):
            text = p.get("text")
            if not isinstance(text, str):
                fail(f"'{pp}.text' must be a string", f"{pp}.text")
            out.append(part("text", text, extra=rest(p, _TEXT_PART_KNOWN) if len(p) > 2 else {}))
        elif t == "image_url":
            iu = p.get("image_url")
            extra = rest(p, _IMAGE_PART_KNOWN)
            url: Any
            if isinstance(iu, str):
                url = iu
            elif isinstance(iu, dict):
                url = iu.get("url")
                for k, v in iu.items():
                    if k == "detail":
                        extra["detail"] = v
                    elif k != "url":
                        extra.setdefault("image_url_extra", {})[k] = v
            else:
                fail(f"'{pp}.image_url' must be an object with a url", f"{pp}.image_url")
            if not isinstance(url, str):
                fail(f"'{pp}.image_url.url' must be a string", f"{pp}.image_url.url")
            out.append(part("image", url=url, extra=extra))
        elif t == "input_audio":
            out.append(part("audio", extra=rest(p, frozenset({"type"}))))
        elif isinstance(t, str):
            text = p.get("text")
            out.append(
                part(t, text if isinstance(text, str) else None,
                     extra=rest(p, _TEXT_PART_KNOWN) if isinstance(text, str)
                     else rest(p, frozenset({"type"})))
            )
        else:
            fail(f"'{pp}.type' must be a string", f"{pp}.type")
    return out


def _parse_content(content: Any, param: str) -> str | list[ContentPart] | None:
    if content is None or isinstance(content, str):
        return content
    if isinstance(content, list):
        return _parse_parts(content, param)
    fail(f"'{param}' must be a string, an array of content parts, or null", param)


def _parse_tool_calls(tcs: Any, param: str, lenient: bool = False) -> list[ToolCall]:
    if not isinstance(tcs, list):
        fail(f"'{param}' must be an array", param)
    out: list[ToolCall] = []
    for j, tc in enumerate(tcs):
        pp = f"{param}[{j}]"
        if not isinstance(tc, dict):
            fail(f"'{pp}' must be an object", pp)
        tid = tc.get("id")
        if tid is None:
            tid = new_id("call_") if lenient else ""
        elif not isinstance(tid, str):
            fail(f"'{pp}.id' must be a string", f"{pp}.id")
        typ = tc.get("type", "function")
        extra = rest(tc, _TC_KNOWN) if len(tc) > 3 else {}
        if "type" not in tc:
            extra["no_type"] = True
        if typ == "custom":
            cu = tc.get("custom")
            if not isinstance(cu, dict) or not isinstance(cu.get("name"), str):
                fail(f"'{pp}.custom.name' must be a string", f"{pp}.custom.name")
            inp = cu.get("input", "")
            out.append(
                tool_call(tid, cu["name"], inp if isinstance(inp, str) else json_str(inp), "custom", extra))
            continue
        fn = tc.get("function")
        if not isinstance(fn, dict):
            fail(f"'{pp}.function' must be an object", f"{pp}.function")
        name = fn.get("name")
        if not isinstance(name, str):
            fail(f"'{pp}.function.name' must be a string", f"{pp}.function.name")
        args = fn.get("arguments", "{}")
        if args is None:
            args = "{}"
        elif not isinstance(args, str):
            args = json_str(args)
        if typ != "function":
            extra["type"] = typ
        fx = rest(fn, frozenset({"name", "arguments"}))
        if fx:
            extra["function_extra"] = fx
        out.append(tool_call(tid, name, args, "function", extra))
    return out


def _parse_message(m: Any, i: int) -> Message:
    # Most messages are exactly {"role", "content"} with a string content: nothing else to read.
    if type(m) is dict and len(m) == 2 and type(m.get("content")) is str and type(m.get("role")) is str:
        return message(m["role"], m["content"])
    param = f"messages[{i}]"
    if not isinstance(m, dict):
        fail(f"'{param}' must be an object", param)
    role = m.get("role")
    if not isinstance(role, str):
        fail(f"'{param}.role' must be a string", f"{param}.role")
    content = _parse_content(m.get("content"), f"{param}.content")
    extra = rest(m, _MSG_KNOWN) if len(m) > 2 else {}
    if "content" not in m:
        extra["no_content"] = True
    tool_calls: list[ToolCall] = []
    if m.get("tool_calls") is not None:
        tool_calls = _parse_tool_calls(m["tool_calls"], f"{param}.tool_calls")
    fc = m.get("function_call")
    if fc is not None:
        if not isinstance(fc, dict) or not isinstance(fc.get("name"), str):
            fail(f"'{param}.function_call.name' must be a string", f"{param}.function_call.name")
        args = fc.get("arguments", "{}")
        tool_calls.append(
            tool_call("", fc["name"], args if isinstance(args, str) else json_str(args), "function",
                      {"legacy": True})
        )
    # rendered as ``reasoning_content`` (vLLM / DeepSeek / litellm); ``reasoning`` (OpenRouter, newer vLLM) is
    # marked
    reasoning = m.get("reasoning_content")
    if reasoning is not None:
        if "reasoning" in m:
            extra["reasoning"] = m["reasoning"]
        if not isinstance(reasoning, str):
            extra["reasoning_content"] = reasoning
            reasoning = None
    else:
        reasoning = m.get("reasoning")
        if reasoning is not None:
            if isinstance(reasoning, str):
                extra["reasoning_key"] = "reasoning"
            else:  # structured reasoning: kept verbatim
                extra["reasoning"] = reasoning
                reasoning = None
    is_error = m.get("is_error")
    return message(
        role,
        content,
        name=opt_str(m, "name", f"{param}.name"),
        tool_calls=tool_calls,
        tool_call_id=opt_str(m, "tool_call_id", f"{param}.tool_call_id"),
        is_error=is_error if isinstance(is_error, bool) else None,
        reasoning=reasoning,
        extra=extra,
    )


def _parse_tool(t: Any, param: str) -> Tool:
    if not isinstance(t, dict):
        fail(f"'{param}' must be an object", param)
    typ = t.get("type", "function" if "function" in t else None)
    if typ == "function":
        fn = t.get("function")
        if not isinstance(fn, dict):
            fail(f"'{param}.function' must be an object", f"{param}.function")
        return _parse_function(fn, f"{param}.function", rest(t, frozenset({"type", "function"})),
                               no_type="type" not in t)
    name = None
    inner = t.get(typ) if isinstance(typ, str) else None
    if isinstance(inner, dict) and isinstance(inner.get("name"), str):
        name = inner["name"]
    elif isinstance(t.get("name"), str):
        name = t["name"]
    return mk_tool(
        type=typ if isinstance(typ, str) else "unknown", name=name, description=None, parameters=None,
        extra={"raw": t},
    )


def _parse_function(fn: dict[str, Any], param: str, outer: dict[str, Any], no_type: bool = False) -> Tool:
    name = fn.get("name")
    if not isinstance(name, str):
        fail(f"'{param}.name' must be a string", f"{param}.name")
    params = fn.get("parameters")
    if params is not None and not isinstance(params, dict):
        fail(f"'{param}.parameters' must be an object", f"{param}.parameters")
    extra = rest(fn, _FN_KNOWN)
    if outer:
        extra["tool_extra"] = outer
    if no_type:
        extra["no_type"] = True
    return mk_tool(
        type="function", name=name, description=opt_str(fn, "description", f"{param}.description"),
        parameters=params, extra=extra,
    )


def _parse_tools(b: dict[str, Any]) -> list[Tool]:
    tools: list[Tool] = []
    if b.get("tools") is not None:
        expect(b["tools"], list, "tools", "an array")
        tools = [_parse_tool(t, f"tools[{i}]") for i, t in enumerate(b["tools"])]
    if b.get("functions") is not None:
        expect(b["functions"], list, "functions", "an array")
        for i, fn in enumerate(b["functions"]):
            if not isinstance(fn, dict):
                fail(f"'functions[{i}]' must be an object", f"functions[{i}]")
            t = _parse_function(fn, f"functions[{i}]", {})
            t.extra["legacy"] = True
            tools.append(t)
    return tools


def parse_request(body: Any, *, reuse: Reuse | None = None,
                  ends: list[int] | None = None) -> CanonicalRequest:
    """Parse a ``/v1/chat/completions`` body. ``reuse``/``ends``: see :class:`~ares_gateway.core.wire.Reuse`
    (each message is read from its item alone)."""
    b = require_object(body)
    msgs = b.get("messages")
    if msgs is None:
        fail("'messages' is required", "messages")
    expect(msgs, list, "messages", "an array")
    start = reuse.kept if reuse is not None else 0
    if reuse is not None and start:
        messages = reuse.messages[:start]
        messages.extend(_parse_message(msgs[i], i) for i in range(start, len(msgs)))
    else:
        messages = [_parse_message(m, i) for i, m in enumerate(msgs)]
    if ends is not None:
        ends.extend(range(len(messages) + 1))
    # ``tools`` and ``functions`` as bytes unchanged: the same tools.
    tools = reuse.tools if reuse is not None and reuse.outside else _parse_tools(b)

    # Numbers the gateway passes on verbatim, within what the API accepts (never a value a policy
    # or the record cannot hold).
    check_numbers(b, {"n": (1, 128), "top_logprobs": (0, 20)},
                  {"presence_penalty": (-2.0, 2.0), "frequency_penalty": (-2.0, 2.0)})
    s_extra: dict[str, Any] = {}
    max_tokens = opt_int(b, "max_completion_tokens", "max_completion_tokens", 1, MAX_TOKENS_LIMIT)
    extra = rest(b, _REQ_KNOWN)
    if max_tokens is not None:
        s_extra["max_tokens_field"] = "max_completion_tokens"
        if "max_tokens" in b:
            opt_int(b, "max_tokens", "max_tokens", 1, MAX_TOKENS_LIMIT)
            extra["max_tokens"] = b["max_tokens"]
    else:
        max_tokens = opt_int(b, "max_tokens", "max_tokens", 1, MAX_TOKENS_LIMIT)
    stop = b.get("stop")
    if stop is not None:
        if isinstance(stop, str):
            stop = [stop]
        elif not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
            fail("'stop' must be a string or an array of strings", "stop")
    sampling = mk_sampling(
        max_tokens=max_tokens,
        temperature=opt_num(b, "temperature", "temperature", 0.0, 2.0),
        top_p=opt_num(b, "top_p", "top_p", 0.0, 1.0),
        top_k=opt_int(b, "top_k", "top_k", -1, MAX_TOKENS_LIMIT),  # vLLM's: -1 (or 0) is off
        stop=stop,
        seed=opt_int(b, "seed", "seed", SEED_MIN, SEED_MAX),
        extra=s_extra,
    )
    include_usage = False
    so = b.get("stream_options")
    if so is not None:
        expect(so, dict, "stream_options", "an object")
        iu = so.get("include_usage")
        if iu is True:
            include_usage = True
            so_rest = {k: v for k, v in so.items() if k != "include_usage"}
            if so_rest:
                extra["stream_options"] = so_rest
        else:
            extra["stream_options"] = so
    return mk_request(
        protocol=PROTOCOL,
        model=opt_str(b, "model", "model"),
        messages=messages,
        tools=tools,
        tool_choice=b.get("tool_choice"),
        parallel_tool_calls=opt_bool(b, "parallel_tool_calls", "parallel_tool_calls"),
        sampling=sampling,
        stream=bool(opt_bool(b, "stream", "stream")),
        include_usage=include_usage,
        extra=extra,
        raw=b,
    )


def _render_part(p: ContentPart) -> dict[str, Any] | str:
    if p.type == "text":
        if p.extra.get("bare"):
            return p.text or ""
        return {"type": "text", "text": p.text or "", **p.extra}
    if p.type == "image":
        iu: dict[str, Any] = {"url": p.url}
        out: dict[str, Any] = {"type": "image_url", "image_url": iu}
        for k, v in p.extra.items():
            if k == "detail":
                iu["detail"] = v
            elif k == "image_url_extra":
                iu.update(v)
            elif k not in ("source", "media_type"):
                out[k] = v
        return out
    if p.type == "audio":
        return {"type": "input_audio", **p.extra}
    d: dict[str, Any] = {"type": p.type}
    if p.text is not None:
        d["text"] = p.text
    if p.url is not None and "url" not in p.extra:
        d["url"] = p.url
    d.update(p.extra)
    return d


def _render_content(content: str | list[ContentPart] | None) -> Any:
    if content is None or isinstance(content, str):
        return content
    return [_render_part(p) for p in content]


def render_tool_call(tc: ToolCall) -> dict[str, Any]:
    ex = tc.extra
    if tc.type == "custom":
        d: dict[str, Any] = {"id": tc.id, "type": "custom",
                             "custom": {"name": tc.name, "input": tc.arguments}}
    else:
        fn: dict[str, Any] = {"name": tc.name, "arguments": tc.arguments}
        if "function_extra" in ex:
            fn.update(ex["function_extra"])
        d = {"id": tc.id, "type": ex.get("type", "function"), "function": fn}
    if ex:
        for k, v in ex.items():
            if k not in ("no_type", "type", "function_extra", "legacy"):
                d[k] = v
        if ex.get("no_type"):
            del d["type"]
    return d


def _render_message(m: Message) -> dict[str, Any]:
    ex = m.extra
    d: dict[str, Any] = {"role": m.role}
    if not ex.get("no_content") or m.content is not None:
        d["content"] = _render_content(m.content)
    if m.name is not None:
        d["name"] = m.name
    if m.tool_calls:
        calls = [tc for tc in m.tool_calls if not tc.extra.get("legacy")]
        for tc in m.tool_calls:
            if tc.extra.get("legacy"):
                d["function_call"] = {"name": tc.name, "arguments": tc.arguments}
        if calls:
            d["tool_calls"] = [render_tool_call(tc) for tc in calls]
    if m.tool_call_id is not None:
        d["tool_call_id"] = m.tool_call_id
    if m.is_error is not None:
        d["is_error"] = m.is_error
    if m.reasoning is not None:
        d[ex.get("reasoning_key", "reasoning_content")] = m.reasoning
    for k, v in ex.items():
        if k not in MARKERS:
            d[k] = v
    return d


def _render_tool(t: Tool) -> tuple[dict[str, Any], bool]:
    if "raw" in t.extra:
        return t.extra["raw"], False
    ex = t.extra
    fn: dict[str, Any] = {"name": t.name or ""}
    if t.description is not None:
        fn["description"] = t.description
    if t.parameters is not None:
        fn["parameters"] = t.parameters
    for k, v in ex.items():
        if k not in ("tool_extra", "legacy", "no_type", "cache_control", "input_schema_extra"):
            fn[k] = v
    if ex.get("legacy"):
        return fn, True
    out: dict[str, Any] = {"type": "function", "function": fn}
    if "tool_extra" in ex:
        out.update(ex["tool_extra"])
    if ex.get("no_type"):
        del out["type"]
    return out, False


def render_request(request: CanonicalRequest) -> dict[str, Any]:
    body: dict[str, Any] = {}
    if request.model is not None:
        body["model"] = request.model
    body["messages"] = [_render_message(m) for m in request.messages if "item" not in m.extra]
    if request.tools:
        tools: list[dict[str, Any]] = []
        functions: list[dict[str, Any]] = []
        for t in request.tools:
            d, legacy = _render_tool(t)
            (functions if legacy else tools).append(d)
        if tools:
            body["tools"] = tools
        if functions:
            body["functions"] = functions
    if request.tool_choice is not None:
        body["tool_choice"] = request.tool_choice
    if request.parallel_tool_calls is not None:
        body["parallel_tool_calls"] = request.parallel_tool_calls
    s = request.sampling
    if s.max_tokens is not None:
        body[s.extra.get("max_tokens_field", "max_tokens")] = s.max_tokens
    if s.temperature is not None:
        body["temperature"] = s.temperature
    if s.top_p is not None:
        body["top_p"] = s.top_p
    if s.top_k is not None:
        body["top_k"] = s.top_k
    if s.stop is not None:
        body["stop"] = s.stop
    if s.seed is not None:
        body["seed"] = s.seed
    if request.stream:
        body["stream"] = True
    elif "stream" in request.raw:
        body["stream"] = False
    body.update(request.extra)
    if request.include_usage:
        body["stream_options"] = {**request.extra.get("stream_options", {}), "include_usage": True}
    return body


# =========================================================================== response

_FINISH = {"stop": "stop", "length": "length", "tool_calls": "tool_calls", "content_filter": "content_filter",
           "function_call": "tool_calls"}


def finish_reason_of(c: Completion) -> str:
    if c.tool_calls and c.finish_reason == "stop":
        return "tool_calls"
    return c.finish_reason


def parse_usage(u: Any) -> Usage | None:
    if not isinstance(u, dict):
        return None
    ptd = u.get("prompt_tokens_details")
    ctd = u.get("completion_tokens_details")
    return usage(
        int_or0(u.get("prompt_tokens")),
        int_or0(u.get("completion_tokens")),
        int_or0(ptd.get("cached_tokens")) if isinstance(ptd, dict) else 0,
        int_or0(ctd.get("reasoning_tokens")) if isinstance(ctd, dict) else 0,
    )


def render_usage(u: Usage | None) -> dict[str, Any]:
    if u is None:
        u = NO_USAGE
    return {
        "prompt_tokens": u.input_tokens,
        "completion_tokens": u.output_tokens,
        "total_tokens": u.input_tokens + u.output_tokens,
        "prompt_tokens_details": {"cached_tokens": u.cached_input_tokens},
        "completion_tokens_details": {"reasoning_tokens": u.reasoning_tokens},
    }


def _int_list(v: Any) -> list[int] | None:
    if isinstance(v, list) and all(isinstance(x, int) and not isinstance(x, bool) for x in v):
        return v
    return None


def _parse_tokens(body: dict[str, Any], choice: dict[str, Any], finish: str | None) -> TokenRecord | None:
    prompt_ids = _int_list(body.get("prompt_token_ids"))
    if prompt_ids is None:
        prompt_ids = _int_list(choice.get("prompt_token_ids"))
    output_ids = _int_list(choice.get("token_ids"))
    logprobs: list[float] = []
    lp = choice.get("logprobs")
    content = lp.get("content") if isinstance(lp, dict) else None
    if isinstance(content, list) and content:
        ids_from_tokens: list[int] = []
        for e in content:
            if not isinstance(e, dict) or not isinstance(e.get("logprob"), (int, float)):
                logprobs = []
                break
            logprobs.append(float(e["logprob"]))
            tok = e.get("token")
            if isinstance(tok, str) and tok.startswith("token_id:"):
                try:
                    ids_from_tokens.append(int(tok[9:]))
                except ValueError:
                    pass
        if output_ids is None and ids_from_tokens and len(ids_from_tokens) == len(content):
            output_ids = ids_from_tokens
    if prompt_ids is None or output_ids is None:
        return None
    if len(logprobs) != len(output_ids):
        logprobs = []
    return mk_tokens(
        prompt_ids=prompt_ids, output_ids=output_ids, output_logprobs=logprobs, finish_reason=finish
    )


def parse_response(body: Any, request: CanonicalRequest | None = None) -> Completion:
    b = require_object(body)
    choices = b.get("choices")
    if not isinstance(choices, list) or not choices:
        fail("'choices' must be a non-empty array", "choices")
    ch = choices[0]
    if not isinstance(ch, dict):
        fail("'choices[0]' must be an object", "choices[0]")
    msg = ch.get("message")
    if msg is None:
        msg = {}
    if not isinstance(msg, dict):
        fail("'choices[0].message' must be an object", "choices[0].message")
    content = msg.get("content")
    if isinstance(content, list):
        text: str | None = "".join(
            p.get("text", "") for p in content if isinstance(p, dict) and isinstance(p.get("text"), str)
        )
    elif content is None or isinstance(content, str):
        text = content
    else:
        fail("'choices[0].message.content' must be a string or null", "choices[0].message.content")
    reasoning = msg.get("reasoning_content")
    if not isinstance(reasoning, str):
        reasoning = msg.get("reasoning")
        if not isinstance(reasoning, str):
            reasoning = None
    tool_calls: list[ToolCall] = []
    if msg.get("tool_calls"):
        tool_calls = _parse_tool_calls(msg["tool_calls"], "choices[0].message.tool_calls", lenient=True)
        for tc in tool_calls:
            if tc.extra:
                tc.extra = {k: v for k, v in tc.extra.items() if k not in ("no_type", "index")}
    fc = msg.get("function_call")
    if isinstance(fc, dict) and isinstance(fc.get("name"), str):
        args = fc.get("arguments", "{}")
        tool_calls.append(
            tool_call(new_id("call_"), fc["name"], args if isinstance(args, str) else json_str(args)))
    fr_raw = ch.get("finish_reason")
    finish = _FINISH.get(fr_raw, "tool_calls" if tool_calls else "stop") if isinstance(fr_raw, str) else (
        "tool_calls" if tool_calls else "stop")
    extra: dict[str, Any] = {}
    if isinstance(msg.get("refusal"), str):
        extra["refusal"] = msg["refusal"]
    model = b.get("model")
    return mk_completion(
        text=text,
        reasoning=reasoning,
        tool_calls=tool_calls,
        finish_reason=finish,
        usage=parse_usage(b.get("usage")),
        tokens=_parse_tokens(b, ch, fr_raw if isinstance(fr_raw, str) else None),
        model=model if isinstance(model, str) else None,
        extra=extra,
    )


def response_id_of(response_id: str) -> str:
    return response_id if response_id.startswith("chatcmpl-") else "chatcmpl-" + response_id


def _out_tool_call(tc: ToolCall) -> dict[str, Any]:
    tid = tc.id or new_id("call_")
    if tc.type == "custom":
        return {"id": tid, "type": "custom", "custom": {"name": tc.name, "input": tc.arguments}}
    return {"id": tid, "type": "function", "function": {"name": tc.name, "arguments": tc.arguments}}


def render_response(completion: Completion, request: CanonicalRequest, response_id: str) -> dict[str, Any]:
    c = completion
    msg: dict[str, Any] = {"role": "assistant", "content": c.text, "refusal": c.extra.get("refusal")}
    if c.reasoning is not None:
        msg["reasoning_content"] = c.reasoning
    if c.tool_calls:
        msg["tool_calls"] = [_out_tool_call(tc) for tc in c.tool_calls]
    choice: dict[str, Any] = {"index": 0, "message": msg, "logprobs": None,
                              "finish_reason": finish_reason_of(c)}
    body: dict[str, Any] = {
        "id": response_id_of(response_id),
        "object": "chat.completion",
        "created": now(),
        "model": c.model or request.model or "unknown",
        "choices": [choice],
        "usage": render_usage(c.usage),
    }
    # Token ids and logprobs only for an agent that asked, as vLLM does (``return_token_ids``,
    # ``logprobs``): a long session's prompt ids are a megabyte of JSON the agent would not read.
    tokens = c.tokens
    if tokens is not None and request.extra.get("return_token_ids") is True:
        body["prompt_token_ids"] = tokens.prompt_ids.tolist()
        choice["token_ids"] = tokens.output_ids.tolist()
    if tokens is not None and tokens.output_logprobs.shape[0] and request.extra.get("logprobs") is True:
        choice["logprobs"] = {
            "content": [
                {"token": f"token_id:{t}", "logprob": lp, "bytes": None, "top_logprobs": []}
                for t, lp in zip(tokens.output_ids.tolist(), tokens.output_logprobs.tolist(), strict=False)
            ]
        }
    return body


# =========================================================================== streaming


class ChatStreamEncoder(StreamEncoderBase[list[str]]):
    """``data: {chunk}`` lines then ``data: [DONE]``, as the chat completions API streams."""

    def __init__(self, request: CanonicalRequest, response_id: str) -> None:
        super().__init__()
        self.id = response_id_of(response_id)
        self.model = request.model or "unknown"
        self.created = now()
        self.include_usage = request.include_usage
        self.text = ""
        self.reasoning = ""
        # self.tools: index -> [id, name, arguments so far, type]

    def _chunk(self, delta: dict[str, Any], finish: str | None = None) -> bytes:
        d: dict[str, Any] = {
            "id": self.id,
            "object": "chat.completion.chunk",
            "created": self.created,
            "model": self.model,
            "system_fingerprint": None,
            "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}],
        }
        if self.include_usage:
            d["usage"] = None
        return sse_data(d)

    def _start(self) -> bytes:
        return self._chunk({"role": "assistant", "content": "", "refusal": None})

    def _reasoning(self, text: str) -> bytes:
        self.reasoning += text
        return self._chunk({"reasoning_content": text})

    def _text(self, text: str) -> bytes:
        self.text += text
        return self._chunk({"content": text})

    def _tool_open(self, index: int, call_id: str, name: str, tool_type: str) -> bytes:
        self.tools[index] = [call_id, name, "", tool_type]
        if tool_type == "custom":
            entry: dict[str, Any] = {"index": index, "id": call_id, "type": "custom",
                                     "custom": {"name": name, "input": ""}}
        else:
            entry = {"index": index, "id": call_id, "type": "function",
                     "function": {"name": name, "arguments": ""}}
        return self._chunk({"tool_calls": [entry]})

    def _tool_args(self, index: int, args: str) -> bytes:
        tool = self.tools[index]
        tool[2] += args
        key, inner = ("custom", "input") if tool[3] == "custom" else ("function", "arguments")
        return self._chunk({"tool_calls": [{"index": index, key: {inner: args}}]})

    def _fed_reasoning(self) -> str:
        return self.reasoning

    def _fed_text(self) -> str:
        return self.text

    def _fed_args(self, index: int) -> str:
        return self.tools[index][2]

    def _end(self, completion: Completion) -> bytes:
        c = completion
        finish = "tool_calls" if (self.tools and c.finish_reason == "stop") else c.finish_reason
        out = self._chunk({}, finish)
        if self.include_usage:
            out += sse_data({
                "id": self.id, "object": "chat.completion.chunk", "created": self.created,
                "model": self.model, "system_fingerprint": None, "choices": [],
                "usage": render_usage(c.usage),
            })
        return out + SSE_DONE

    def _error(self, status: int, message: str) -> bytes:
        return sse_data(openai_error_body(status, message))


ADAPTER = ProtocolAdapter(
    protocol=PROTOCOL,
    parse_request=parse_request,
    render_request=render_request,
    parse_response=parse_response,
    render_response=render_response,
    stream_encoder=ChatStreamEncoder,
    error_body=openai_error_body,
)

__all__ = ["ADAPTER", "ChatStreamEncoder"]
