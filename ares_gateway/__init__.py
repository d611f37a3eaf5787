"""ares-gateway: intercept every LLM call of real coding agents and answer it with a policy.

The public API: :class:`Gateway` (HTTP server + in-process policy API),
:class:`GatewayEnv` (dm_env-style, one step per LLM call), the canonical
request / completion models, and the error classes.
"""

from ares_gateway._native import install_guard

install_guard()  # first: it decides whether the compiled modules load compiled or from source

from ares_gateway.broker import ErrorAnswer, ParkedRequest, RecordedTurn
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
from ares_gateway.env import GatewayEnv, StepType, TimeStep
from ares_gateway.errors import (
    AlreadyAnsweredError,
    GatewayClosedError,
    GatewayError,
    InvalidAnswerError,
    RequestGoneError,
    SessionExistsError,
    UnknownRequestError,
    UnknownSessionError,
)
from ares_gateway.gateway import Gateway, GatewayConfig
from ares_gateway.sessions import SessionInfo

__all__ = [
    "AlreadyAnsweredError",
    "CanonicalRequest",
    "Completion",
    "CompletionDelta",
    "ContentPart",
    "ErrorAnswer",
    "Gateway",
    "GatewayClosedError",
    "GatewayConfig",
    "GatewayEnv",
    "GatewayError",
    "InvalidAnswerError",
    "Message",
    "ParkedRequest",
    "RecordedTurn",
    "RequestGoneError",
    "SamplingParams",
    "SessionExistsError",
    "SessionInfo",
    "StepType",
    "TimeStep",
    "TokenRecord",
    "Tool",
    "ToolCall",
    "UnknownRequestError",
    "UnknownSessionError",
    "Usage",
    "WireProtocol",
]
