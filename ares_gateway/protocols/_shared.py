"""Small shared helpers for the protocol modules: SSE framing, ids, JSON, validation.

Private to :mod:`ares_gateway.protocols`; everything here is pure and cheap.
"""

from __future__ import annotations

import json
import math
import os
import time
from typing import Any, NoReturn

import orjson
from pydantic import BaseModel

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
from ares_gateway.core.token_ids import logprob_array, token_array
from ares_gateway.core.wire import RequestError

dumps = orjson.dumps


def loads(data: str | bytes) -> Any:
    return orjson.loads(data)


def json_str(obj: Any) -> str:
    """Compact JSON text of ``obj`` (used for tool-call ``arguments``)."""
    try:
        return orjson.dumps(obj).decode()
    except TypeError:  # e.g. an integer beyond 64 bits from a non-orjson parser
        return json.dumps(obj, separators=(",", ":"), ensure_ascii=False)


def new_id(prefix: str, nbytes: int = 12) -> str:
    """A random id such as ``chatcmpl-…``, ``msg_…``, ``toolu_…``."""
    return prefix + os.urandom(nbytes).hex()


def now() -> int:
    return int(time.time())


# --------------------------------------------------------------------------- SSE


def sse_event(event: str, data: Any) -> bytes:
    """``event: <type>\\ndata: <json>\\n\\n`` (Anthropic, OpenAI Responses)."""
    return b"event: " + event.encode() + b"\ndata: " + orjson.dumps(data) + b"\n\n"


def sse_data(data: Any) -> bytes:
    """``data: <json>\\n\\n`` (OpenAI chat completions)."""
    return b"data: " + orjson.dumps(data) + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"


#: ``Message.extra`` keys that are round-trip markers of some protocol, never native fields
#: (see the package docstring); every renderer drops the ones it does not consume.
MARKERS = frozenset({"same_turn", "in_messages", "no_content", "reasoning_key", "bare", "input_string",
                     "reasoning_item", "custom"})


# --------------------------------------------------------------------------- validation


def fail(message: str, param: str | None = None) -> NoReturn:
    raise RequestError(message, param=param)


def require_object(body: Any) -> dict[str, Any]:
    if not isinstance(body, dict):
        fail(f"request body must be a JSON object, got {_json_type(body)}")
    return body


def _json_type(v: Any) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "boolean"
    if isinstance(v, (int, float)):
        return "number"
    if isinstance(v, str):
        return "string"
    if isinstance(v, list):
        return "array"
    if isinstance(v, dict):
        return "object"
    return type(v).__name__


def expect(value: Any, types: type | tuple[type, ...], param: str, what: str) -> Any:
    if not isinstance(value, types) or (isinstance(value, bool) and bool not in _as_tuple(types)):
        fail(f"'{param}' must be {what}, got {_json_type(value)}", param)
    return value


def _as_tuple(t: type | tuple[type, ...]) -> tuple[type, ...]:
    return t if isinstance(t, tuple) else (t,)


def opt_str(d: dict[str, Any], key: str, param: str) -> str | None:
    v = d.get(key)
    if v is None:
        return None
    if not isinstance(v, str):
        fail(f"'{param}' must be a string, got {_json_type(v)}", param)
    return v


#: The largest token count a request may ask for: int32, as every token count downstream (engines,
#: token ids, the record) holds it. The APIs cap it far lower (the model's context); a value beyond
#: this is no request any model serves.
MAX_TOKENS_LIMIT = 2**31 - 1
#: ``seed``: what a signed 64-bit integer holds (OpenAI's bound; the record's codec packs no more).
SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1


def _range_text(lo: float | None, hi: float | None) -> str:
    if lo is not None and hi is not None:
        return (f"from {lo:g} to {hi:g}" if isinstance(lo, float) or isinstance(hi, float)
                else f"from {lo} to {hi}")
    return f">= {lo}" if lo is not None else f"<= {hi}"


def opt_int(d: dict[str, Any], key: str, param: str, lo: int | None = None,
            hi: int | None = None) -> int | None:
    """``d[key]`` as an int (``None`` when absent), in ``[lo, hi]``; else a 400 naming ``param``.

    A JSON number with no fractional part (``1000.0``, ``1e3``) counts as that integer, as JSON
    itself does not tell them apart; one outside the bounds does not (``1e308`` is no token count).
    """
    v = d.get(key)
    if v is None:
        return None
    if (isinstance(v, bool) or not isinstance(v, (int, float))
        or (isinstance(v, float) and not v.is_integer())):
        fail(f"'{param}' must be an integer, got {_json_type(v)}", param)
    if (lo is not None and v < lo) or (hi is not None and v > hi):
        fail(f"'{param}' must be an integer {_range_text(lo, hi)}, got {v!r}", param)
    return int(v)


def opt_num(d: dict[str, Any], key: str, param: str, lo: float | None = None,
            hi: float | None = None) -> float | None:
    """``d[key]`` as a finite float (``None`` when absent), in ``[lo, hi]``; else a 400 naming ``param``."""
    v = d.get(key)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        fail(f"'{param}' must be a number, got {_json_type(v)}", param)
    try:
        f = float(v)  # as the float-typed canonical fields hold it after validation
    except OverflowError:  # an integer too large for a float (only from Python callers; JSON has none)
        fail(f"'{param}' is out of range", param)
    if not math.isfinite(f) or (lo is not None and f < lo) or (hi is not None and f > hi):
        fail(f"'{param}' must be a number {_range_text(lo, hi)}, got {v!r}", param)
    return f


def check_numbers(d: dict[str, Any], ints: dict[str, tuple[int, int]],
                  nums: dict[str, tuple[float, float]]) -> None:
    """400 for any of the named fields that is present and not a number within its bounds (fields
    the gateway only passes on verbatim, such as OpenAI's ``n`` or ``presence_penalty``)."""
    for key, (ilo, ihi) in ints.items():
        opt_int(d, key, key, ilo, ihi)
    for key, (flo, fhi) in nums.items():
        opt_num(d, key, key, flo, fhi)


def opt_bool(d: dict[str, Any], key: str, param: str) -> bool | None:
    v = d.get(key)
    if v is None:
        return None
    if not isinstance(v, bool):
        fail(f"'{param}' must be a boolean, got {_json_type(v)}", param)
    return v


def rest(d: dict[str, Any], known: frozenset[str]) -> dict[str, Any]:
    """The keys of ``d`` not in ``known`` (kept verbatim in ``extra``)."""
    return {k: v for k, v in d.items() if k not in known}


# --------------------------------------------------------------------------- fast constructors
# The protocol modules validate native input themselves, so they build the
# canonical models without a second validation pass. ``model_construct`` is
# itself slow (it walks every field's default), so these fill the instance
# dict directly, exactly as ``model_construct`` does in the end: every field
# present, in declaration order; no extras, no private attributes.

_setattr = object.__setattr__
_new = object.__new__
# BaseModel's slot descriptors: setting through them skips BaseModel.__setattr__'s checks
_set_fields_set = BaseModel.__dict__["__pydantic_fields_set__"].__set__
_set_extra = BaseModel.__dict__["__pydantic_extra__"].__set__
_set_private = BaseModel.__dict__["__pydantic_private__"].__set__


# One fields-set per class, shared by every instance built with all its fields (as ``_build``'s callers
# do): a set of 5-8 names takes 728 bytes, more than the instance's values, and a 200-turn session holds
# thousands of these. Sharing is safe: pydantic only ever adds a field's name to it (on assignment),
# which is already there, and copies it in ``model_copy``.
_ALL_FIELDS: dict[type, set[str]] = {}


def _build(cls: Any, values: dict[str, Any]) -> Any:
    m = _new(cls)
    _setattr(m, "__dict__", values)
    every = _ALL_FIELDS.get(cls)
    if every is None:
        every = _ALL_FIELDS[cls] = set(cls.model_fields)
    _set_fields_set(m, every if values.keys() == every else set(values))
    _set_extra(m, None)
    _set_private(m, None)
    return m


def part(type_: str = "text", text: str | None = None, url: str | None = None,
         extra: dict[str, Any] | None = None) -> ContentPart:
    return _build(ContentPart,
                  {"type": type_, "text": text, "url": url, "extra": {} if extra is None else extra})


def tool_call(id_: str, name: str, arguments: str, type_: str = "function",
              extra: dict[str, Any] | None = None) -> ToolCall:
    return _build(ToolCall, {"id": id_, "name": name, "arguments": arguments, "type": type_,
                             "extra": {} if extra is None else extra})


def message(role: str, content: str | list[ContentPart] | None = None, *, name: str | None = None,
            tool_calls: list[ToolCall] | None = None, tool_call_id: str | None = None,
            is_error: bool | None = None, reasoning: str | None = None,
            extra: dict[str, Any] | None = None) -> Message:
    return _build(Message, {
        "role": role,
        "content": content,
        "name": name,
        "tool_calls": [] if tool_calls is None else tool_calls,
        "tool_call_id": tool_call_id,
        "is_error": is_error,
        "reasoning": reasoning,
        "extra": {} if extra is None else extra,
    })


def mk_tool(*, type: str, name: str | None, description: str | None, parameters: dict[str, Any] | None,
            extra: dict[str, Any]) -> Tool:
    return _build(Tool, {"type": type, "name": name, "description": description, "parameters": parameters,
                         "extra": extra})


def mk_sampling(*, max_tokens: int | None, temperature: float | None, top_p: float | None, top_k: int | None,
                stop: list[str] | None, seed: int | None, extra: dict[str, Any]) -> SamplingParams:
    return _build(SamplingParams, {"max_tokens": max_tokens, "temperature": temperature, "top_p": top_p,
                                   "top_k": top_k, "stop": stop, "seed": seed, "extra": extra})


def mk_request(*, protocol: WireProtocol, model: str | None, messages: list[Message], tools: list[Tool],
               tool_choice: Any, parallel_tool_calls: bool | None, sampling: SamplingParams, stream: bool,
               include_usage: bool, extra: dict[str, Any], raw: dict[str, Any]) -> CanonicalRequest:
    return _build(CanonicalRequest, {
        "protocol": protocol, "model": model, "messages": messages, "tools": tools,
        "tool_choice": tool_choice, "parallel_tool_calls": parallel_tool_calls, "sampling": sampling,
        "stream": stream, "include_usage": include_usage, "extra": extra, "raw": raw,
    })


def mk_completion(*, text: str | None, reasoning: str | None, tool_calls: list[ToolCall], finish_reason: str,
                  usage: Usage | None, tokens: TokenRecord | None, model: str | None,
                  extra: dict[str, Any]) -> Completion:
    return _build(Completion, {"text": text, "reasoning": reasoning, "tool_calls": tool_calls,
                               "finish_reason": finish_reason, "usage": usage, "tokens": tokens,
                               "model": model, "policy_version": None, "extra": extra})


def mk_tokens(*, prompt_ids: list[int], output_ids: list[int], output_logprobs: list[float],
              finish_reason: str | None) -> TokenRecord:
    out = token_array(output_ids, "output_ids")
    return _build(TokenRecord, {"prompt_ids": token_array(prompt_ids, "prompt_ids"), "output_ids": out,
                                "output_logprobs": logprob_array(output_logprobs, int(out.shape[0])),
                                "finish_reason": finish_reason})


def usage(input_tokens: int = 0, output_tokens: int = 0, cached: int = 0, reasoning: int = 0) -> Usage:
    return _build(Usage, {"input_tokens": input_tokens, "output_tokens": output_tokens,
                          "cached_input_tokens": cached, "reasoning_tokens": reasoning})


#: What the renderers read when a completion carries no usage (read only, never handed out).
NO_USAGE = usage()


def int_or0(v: Any) -> int:
    return v if isinstance(v, int) and not isinstance(v, bool) else 0


# --------------------------------------------------------------------------- data URLs


def data_url(media_type: str, data: str) -> str:
    return f"data:{media_type};base64,{data}"


def split_data_url(url: str) -> tuple[str, str] | None:
    """``data:<media>;base64,<data>`` -> (media, data); None for anything else."""
    if not url.startswith("data:"):
        return None
    head, sep, data = url.partition(",")
    if not sep or not head.endswith(";base64"):
        return None
    return head[5:-7], data


# --------------------------------------------------------------------------- errors


def openai_error_type(status: int) -> str:
    if status == 401:
        return "authentication_error"
    if status == 403:
        return "permission_error"
    if status == 404:
        return "not_found_error"
    if status == 409:
        return "conflict_error"
    if status == 429:
        return "rate_limit_error"
    if status >= 500:
        return "server_error"
    return "invalid_request_error"


def openai_error_code(status: int) -> str | None:
    if status == 401:
        return "invalid_api_key"
    if status == 429:
        return "rate_limit_exceeded"
    if status >= 500:
        return "server_error"
    return None


def openai_error_body(status: int, message: str, param: str | None = None) -> dict[str, Any]:
    return {
        "error": {
            "message": message,
            "type": openai_error_type(status),
            "param": param,
            "code": openai_error_code(status),
        }
    }


def remainder(fed: str, full: str | None) -> str:
    """What of ``full`` was not streamed yet (nothing if the stream diverged from it)."""
    if not full:
        return ""
    if not fed:
        return full
    return full[len(fed):] if full.startswith(fed) else ""
