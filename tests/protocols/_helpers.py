"""Shared builders for protocol tests."""

from __future__ import annotations

from typing import Any

from ares_gateway.core.canonical import CanonicalRequest, Completion, CompletionDelta, ToolCall, Usage
from ares_gateway.core.wire import StreamEncoder
from ares_gateway.protocols import get_adapter


def pieces(s: str, n: int) -> list[str]:
    return [s[i : i + n] for i in range(0, len(s), n)] or []


def rich_completion(custom: bool = False) -> Completion:
    """Reasoning, text with unicode/newlines/quotes, and two parallel tool calls."""
    calls = [
        ToolCall(id="call_a1", name="exec_command",
                 arguments='{"cmd":"echo \\"hi\\" && ls -la","timeout":5}'),
        ToolCall(id="call_b2", name="read_file", arguments='{"path":"/tmp/ü ñ.txt"}'),
    ]
    if custom:
        calls.append(ToolCall(id="call_c3", name="apply_patch", type="custom",
                              arguments='*** Begin Patch\n*** Add File: a.py\n+print("x")\n*** End Patch'))
    return Completion(
        text='Let me check — "quoted" text\nline two 😀',
        reasoning="First I think about it.\nThen I decide: use tools.",
        tool_calls=calls,
        finish_reason="tool_calls",
        usage=Usage(input_tokens=1234, output_tokens=56, cached_input_tokens=1000, reasoning_tokens=7),
        model="policy-model",
    )


def deltas_of(c: Completion, n: int = 3) -> list[CompletionDelta]:
    out: list[CompletionDelta] = []
    for p in pieces(c.reasoning or "", n):
        out.append(CompletionDelta(reasoning=p))
    for p in pieces(c.text or "", n):
        out.append(CompletionDelta(text=p))
    for i, tc in enumerate(c.tool_calls):
        out.append(CompletionDelta(tool_index=i, tool_call_id=tc.id, tool_name=tc.name, tool_type=tc.type))
        for p in pieces(tc.arguments, n):
            out.append(CompletionDelta(tool_index=i, tool_type=tc.type, arguments=p))
    return out


def encode(protocol: str, request: CanonicalRequest, c: Completion,
           deltas: list[CompletionDelta] | None = None, response_id: str = "abc123") -> list[bytes]:
    enc: StreamEncoder = get_adapter(protocol).stream_encoder(request, response_id)
    chunks = [enc.start()]
    for d in deltas or []:
        chunks.append(enc.feed(d))
    chunks.append(enc.finish(c))
    return chunks


def parse(protocol: str, body: dict[str, Any]) -> CanonicalRequest:
    return get_adapter(protocol).parse_request(body)
