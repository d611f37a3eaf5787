"""ares-gateway: intercept every LLM call of real coding agents and answer it with a policy.

The public API: :class:`Gateway` (HTTP server + in-process policy API),
:class:`GatewayEnv` (dm_env-style, one step per LLM call) and its TimeStep helpers, :class:`RolloutSource`
(episodes streamed to a trainer as they finish) and its blocking wrapper, :class:`EpisodeConfig` and
:class:`RunConfig` (what each episode runs, and how a run runs them), the canonical
request / completion models, the answer types, and the error classes. Where each lives:
docs/architecture.md.
"""

from ares_gateway.core.answers import ErrorAnswer, NativeAnswer, StreamAnswer
from ares_gateway.core.broker import ParkedRequest
from ares_gateway.core.canonical import (
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
from ares_gateway.core.errors import (
    AlreadyAnsweredError,
    DrainTimeoutError,
    FencedAnswerError,
    FenceError,
    GatewayClosedError,
    GatewayError,
    InvalidAnswerError,
    InvalidFenceError,
    InvalidSessionError,
    RequestGoneError,
    SamplingNotPausedError,
    SamplingPausedError,
    SessionExistsError,
    TooManyParkedError,
    UnknownRequestError,
    UnknownSessionError,
)
from ares_gateway.core.fence import PauseReport, SamplingFence
from ares_gateway.core.recorder import RecordedTurn
from ares_gateway.core.sessions import SessionInfo
from ares_gateway.episodes.atif import AtifExport, export_atif, import_atif
from ares_gateway.episodes.config import EpisodeConfig, RunConfig
from ares_gateway.episodes.driver import EpisodeRecord, renamed_names
from ares_gateway.episodes.env import (
    GatewayEnv,
    LaunchTimeoutError,
    StepType,
    TimeStep,
    restart,
    termination,
    transition,
    truncation,
)
from ares_gateway.episodes.stream import (
    BlockingRolloutSource,
    NoFenceError,
    RolloutGroup,
    RolloutSource,
    RolloutSourceError,
    SourceClosedError,
)
from ares_gateway.gateway import Gateway, GatewayConfig
from ares_gateway.http import HttpLimits
from ares_gateway.telemetry import Telemetry, TelemetryUnavailableError

__all__ = [
    "AlreadyAnsweredError",
    "AtifExport",
    "BlockingRolloutSource",
    "CanonicalRequest",
    "Completion",
    "CompletionDelta",
    "ContentPart",
    "DrainTimeoutError",
    "EpisodeConfig",
    "EpisodeRecord",
    "ErrorAnswer",
    "FenceError",
    "FencedAnswerError",
    "Gateway",
    "GatewayClosedError",
    "GatewayConfig",
    "GatewayEnv",
    "GatewayError",
    "HttpLimits",
    "InvalidAnswerError",
    "InvalidFenceError",
    "InvalidSessionError",
    "LaunchTimeoutError",
    "Message",
    "NativeAnswer",
    "NoFenceError",
    "ParkedRequest",
    "PauseReport",
    "RecordedTurn",
    "RequestGoneError",
    "RolloutGroup",
    "RolloutSource",
    "RolloutSourceError",
    "RunConfig",
    "SamplingFence",
    "SamplingNotPausedError",
    "SamplingParams",
    "SamplingPausedError",
    "SessionExistsError",
    "SessionInfo",
    "SourceClosedError",
    "StepType",
    "StreamAnswer",
    "Telemetry",
    "TelemetryUnavailableError",
    "TimeStep",
    "TokenRecord",
    "TooManyParkedError",
    "Tool",
    "ToolCall",
    "UnknownRequestError",
    "UnknownSessionError",
    "Usage",
    "WireProtocol",
    "export_atif",
    "import_atif",
    "restart",
    "termination",
    "transition",
    "truncation",
]


__getattr__ = renamed_names(__name__)
