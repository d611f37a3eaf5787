"""ares-gateway: intercept every LLM call of real coding agents and answer it with a policy."""

from ares_gateway.canonical import (
    CanonicalRequest,
    Completion,
    CompletionDelta,
    ContentPart,
    Message,
    SamplingParams,
    TokenRecord,
    Tool,
    ToolCall,
    Usage,
    WireProtocol,
)

__all__ = [
    "CanonicalRequest",
    "Completion",
    "CompletionDelta",
    "ContentPart",
    "Message",
    "SamplingParams",
    "TokenRecord",
    "Tool",
    "ToolCall",
    "Usage",
    "WireProtocol",
]
