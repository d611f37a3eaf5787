"""The interface every wire-protocol module implements.

A protocol module holds pure functions only (no I/O): it converts a native
request body to a :class:`CanonicalRequest` and back, a native response body
to a :class:`Completion` and back, renders errors in the protocol's shape, and
encodes a completion (whole or as deltas) as the protocol's real SSE stream.
"""

from __future__ import annotations

from typing import Any, Protocol

from ares_gateway.canonical import CanonicalRequest, Completion, CompletionDelta, WireProtocol


class RequestError(ValueError):
    """A request body the protocol cannot accept; becomes a 400 in the protocol's error shape.

    ``param`` names the offending field (e.g. ``"messages[2].content"``) when known.
    """

    def __init__(self, message: str, *, param: str | None = None, status: int = 400) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.status = status


class StreamEncoder(Protocol):
    """Turns a completion into the protocol's SSE bytes, incrementally.

    ``start()`` once, then ``feed(delta)`` any number of times, then
    ``finish(completion)`` once with the whole completion (finish reason, usage,
    and any content not yet fed, which ``finish`` emits itself, so a caller
    that never fed deltas gets the full synthesized stream from ``start() + finish(c)``).
    Each call returns the bytes to write (possibly empty).
    """

    def start(self) -> bytes: ...

    def feed(self, delta: CompletionDelta) -> bytes: ...

    def finish(self, completion: Completion) -> bytes: ...

    def error(self, status: int, message: str) -> bytes:
        """Bytes that end the stream with an error event in the protocol's shape."""
        ...


class ProtocolAdapter(Protocol):
    """What :mod:`ares_gateway.protocols` exposes for each :class:`WireProtocol`."""

    protocol: WireProtocol

    def parse_request(self, body: Any) -> CanonicalRequest:
        """Native request body (parsed JSON) -> canonical. Raises :class:`RequestError`."""
        ...

    def render_request(self, request: CanonicalRequest) -> dict[str, Any]:
        """Canonical -> native request body (used to forward upstream and for round trips)."""
        ...

    def parse_response(self, body: Any, request: CanonicalRequest | None = None) -> Completion:
        """Native (non-stream) response body -> canonical. Raises :class:`RequestError`."""
        ...

    def render_response(
        self, completion: Completion, request: CanonicalRequest, response_id: str
    ) -> dict[str, Any]:
        """Canonical completion -> native non-stream response body."""
        ...

    def stream_encoder(self, request: CanonicalRequest, response_id: str) -> StreamEncoder:
        """A fresh encoder for one streamed response."""
        ...

    def error_body(self, status: int, message: str, *, param: str | None = None) -> dict[str, Any]:
        """An error body in the protocol's own shape for HTTP ``status``."""
        ...
