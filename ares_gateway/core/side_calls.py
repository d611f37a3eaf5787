"""Telling side calls (titles, summaries, sub-agent calls) from an agent's main line.

A side call is still answered by the policy, but it is tagged on the parked
request and recorded in its own trajectory tree, so trainers can exclude or
weight it. The default detector asks the harness-side detector of the client
that speaks the request's protocol (each documented in docs/harnesses.md);
``Gateway(side_call_detector=...)`` replaces it, and an agent (or a wrapper)
can tag any request with the header ``x-ares-side-call: 1``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from ares_gateway.core.canonical import CanonicalRequest, WireProtocol
from harnesses import claude_code_is_side_call, codex_is_side_call, terminus2_is_side_call

SideCallDetector = Callable[[CanonicalRequest, Mapping[str, str]], bool]

_BY_PROTOCOL: dict[WireProtocol, Callable[[Mapping[str, Any], Mapping[str, str]], bool]] = {
    # Claude Code is the client that speaks /v1/messages, Codex /v1/responses; of the
    # chat-completions clients only Terminus-2 makes side calls (its summarization sub-agents).
    WireProtocol.ANTHROPIC_MESSAGES: claude_code_is_side_call,
    WireProtocol.OPENAI_RESPONSES: codex_is_side_call,
    WireProtocol.OPENAI_CHAT: terminus2_is_side_call,
}


def default_side_call_detector(request: CanonicalRequest, headers: Mapping[str, str]) -> bool:
    """Claude Code titles, summaries and sub-agents; Codex sub-agents and compaction; Terminus-2 summaries."""
    return _BY_PROTOCOL[request.protocol](request.raw, headers)
