"""The interface every wire-protocol module implements, owned by the core, and where the adapters are found.

A protocol module (:mod:`ares_gateway.protocols`) holds pure functions only (no I/O): it converts a
native request body to a :class:`CanonicalRequest` and back, a native response body to a
:class:`Completion` and back, renders errors in the protocol's shape, and encodes a completion (whole
or as deltas) as the protocol's real SSE stream. It hands its :class:`ProtocolAdapter` to the core
with :func:`register_adapter` when it is imported; the core finds it with :func:`adapter_for` (to
check that an answer renders, to read a native answer, to parse a recorded body again) and so knows
the interface, never a protocol module.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from ares_gateway.core.canonical import CanonicalRequest, Completion, CompletionDelta, WireProtocol
from ares_gateway.core.errors import StatusError


class RequestError(StatusError, ValueError):
    """A request body the protocol cannot accept; becomes a 400 in the protocol's error shape.

    ``param`` names the offending field (e.g. ``"messages[2].content"``) when known.
    """

    status = 400


#: Deepest nesting of objects and arrays the gateway takes in a body from the wire, an agent's request
#: or a policy's native answer (the body itself is level 1). Real bodies nest under 20 levels (tool
#: schemas, tool inputs); every encoder a body goes through again (the turn record, ``/poll``'s canonical
#: form, the answer sent) is orjson, which stops at 255 levels, and each wraps the body in a few of its own.
MAX_JSON_DEPTH = 128


def nests_deeper(value: Any, limit: int = MAX_JSON_DEPTH, depth: int = 1) -> bool:
    """Whether ``value`` (at nesting level ``depth``) nests objects and arrays past level ``limit``;
    iterative, so that no depth exhausts the stack. Its cost is the number of containers and their
    members, never their strings' lengths."""
    if not isinstance(value, _CONTAINERS):
        return False
    stack: list[tuple[Any, int]] = [(value, depth)]
    pop, push = stack.pop, stack.append
    while stack:
        v, d = pop()
        if d > limit:
            return True
        for child in v.values() if isinstance(v, dict) else v:
            t = type(child)
            # Exact types first: a decoded body holds only these, and strings are most of its members.
            if t is dict or t is list or (t is not str and isinstance(child, _CONTAINERS)):
                push((child, d + 1))
    return False


_CONTAINERS = (dict, list, tuple)


@dataclass(frozen=True, slots=True)
class Reuse:
    """What a request's parse may take over from the same session's previous request on the same line.

    Found from the two bodies' raw bytes (:mod:`ares_gateway.core._body_layout`), never their
    parsed values (``1``, ``1.0`` and ``true`` compare equal in Python): an agent re-sends its history
    as the same bytes every turn, so only what follows the shared history is converted again. The
    objects taken over are the previous request's own: a canonical request is read-only.
    """

    #: Leading items of the body's list (``messages`` / ``input``) whose bytes are the previous body's.
    kept: int
    #: Every byte outside that list (``system``, ``tools``, sampling fields ...) is the previous body's.
    outside: bool
    #: The previous request's canonical messages and tools.
    messages: list[Any]
    tools: list[Any]
    #: ``ends[0]``: how many of those messages came before the list; ``ends[i + 1]``: how many after item
    #: ``i``.
    ends: list[int]


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


class ParseRequest(Protocol):
    """Native request body (parsed JSON) -> canonical; raises :class:`RequestError`. ``reuse``: what it
    may take over from the session's previous request (:class:`Reuse`); ``ends``: a list it fills as
    :attr:`Reuse.ends` describes, for the next request's reuse."""

    def __call__(self, body: Any, /, *, reuse: Reuse | None = None,
                 ends: list[int] | None = None) -> CanonicalRequest: ...


class ParseResponse(Protocol):
    """Native non-stream response body -> canonical (``request``: the request it answers, when known);
    raises :class:`RequestError`."""

    def __call__(self, body: Any, request: CanonicalRequest | None = None, /) -> Completion: ...


class ErrorBody(Protocol):
    """An error body in the protocol's own shape."""

    def __call__(self, status: int, message: str, /, *, param: str | None = None) -> dict[str, Any]: ...


@dataclass(frozen=True, slots=True)
class ProtocolAdapter:
    """What each protocol module exposes as ``ADAPTER``: its pure functions, by role."""

    protocol: WireProtocol
    #: Native request body (parsed JSON) -> canonical (:class:`ParseRequest`).
    parse_request: ParseRequest
    #: Canonical -> native request body (to forward upstream, and for round trips).
    render_request: Callable[[CanonicalRequest], dict[str, Any]]
    #: ``parse_response(body, request=None)``: native non-stream response body -> canonical
    #: (:class:`ParseResponse`).
    parse_response: ParseResponse
    #: ``render_response(completion, request, response_id)`` -> native non-stream response body.
    render_response: Callable[[Completion, CanonicalRequest, str], dict[str, Any]]
    #: ``stream_encoder(request, response_id)``: a fresh encoder for one streamed response.
    stream_encoder: Callable[[CanonicalRequest, str], StreamEncoder]
    #: ``error_body(status, message, *, param=None)``: an error body in the protocol's own shape.
    error_body: ErrorBody


_ADAPTERS: dict[WireProtocol, ProtocolAdapter] = {}


def register_adapter(adapter: ProtocolAdapter) -> None:
    """Make ``adapter`` the one for ``adapter.protocol`` (done by :mod:`ares_gateway.protocols` on import)."""
    _ADAPTERS[adapter.protocol] = adapter


def adapter_for(protocol: WireProtocol | str) -> ProtocolAdapter:
    """The adapter registered for ``protocol`` (a :class:`WireProtocol` or its string value)."""
    try:
        return _ADAPTERS[WireProtocol(protocol)]
    except KeyError:
        raise LookupError(
            f"no adapter registered for {protocol!r}: import ares_gateway.protocols first") from None
