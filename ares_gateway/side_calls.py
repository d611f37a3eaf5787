"""Telling side calls (titles, summaries, sub-agent calls) from an agent's main line.

A side call is still answered by the policy, but it is tagged on the parked
request and recorded in its own trajectory tree, so trainers can exclude or
weight it. Harnesses may install their own detector; an agent (or a wrapper)
can also tag a request with the header ``x-ares-side-call: 1``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from ares_gateway.canonical import CanonicalRequest, WireProtocol

SideCallDetector = Callable[[CanonicalRequest, Mapping[str, str]], bool]


def default_side_call_detector(request: CanonicalRequest, headers: Mapping[str, str]) -> bool:
    """Claude Code's title request: no tools, and a JSON-schema ``output_config`` format.

    Claude Code's main-line requests always carry its ~25 tools, so a tool-less
    request with a structured-output format is the side request that names the
    conversation.
    """
    if request.protocol is not WireProtocol.ANTHROPIC_MESSAGES or request.tools:
        return False
    output_config = request.raw.get("output_config")
    if not isinstance(output_config, dict):
        return False
    fmt = output_config.get("format")
    return isinstance(fmt, dict) and fmt.get("type") == "json_schema"
