"""Telling side calls (titles, summaries, sub-agent calls) from an agent's main line.

A side call is still answered by the policy, but it is tagged on the parked
request and recorded in its own trajectory tree, so trainers can exclude or
weight it. What a side call looks like is each harness's knowledge
(``BaseHarness.is_side_call``, documented in docs/harnesses.md); this module
only knows which client speaks which protocol. The default detector asks the
harness of the client that speaks the request's protocol;
``Gateway(side_call_detector=...)`` replaces it (``harness_side_call_detector``
adds the checks of the harnesses an episode runs), and an agent (or a wrapper)
can tag any request with the header ``x-ares-side-call: 1``. The gateway core
knows none of this: a detector is handed to it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
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


def with_harness_checks(
    checks: Iterable[Callable[[Mapping[str, Any], Mapping[str, str]], bool]]) -> SideCallDetector:
    """The default detector, then each of ``checks`` over the raw body; a check that is already the
    default's for the request's protocol is not run a second time."""
    extra = list(dict.fromkeys(checks))

    def detect(request: CanonicalRequest, headers: Mapping[str, str]) -> bool:
        default = _BY_PROTOCOL[request.protocol]
        if default(request.raw, headers):
            return True
        return any(check(request.raw, headers) for check in extra if check is not default)

    return detect
