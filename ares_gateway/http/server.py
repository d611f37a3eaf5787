"""The gateway's HTTP/1.1 server: aiohttp's low-level server, with the limits a hostile client needs.

Why aiohttp's low-level server (``aiohttp.web_server.Server``) and not ``aiohttp.web``: the
gateway serves a fixed set of paths (:mod:`ares_gateway.http.routes` finds a handler with one
dict lookup), so an ``Application`` would add a regex router, match-info and a middleware chain
to every agent turn for nothing. The low-level server keeps what matters and is maintained:
llhttp parsing, keep-alive and pipelining, chunked bodies, write back-pressure, handler
cancellation when a client disconnects.

What aiohttp does itself (checked against aiohttp 3.14's ``web_protocol``/``http_parser``):

* request line and each header line at most ``max_line_bytes`` / ``max_field_bytes``, at most
  ``max_headers`` headers: beyond that the parser stops and the connection gets one error
  answer and is closed (here: 431, in the control API's JSON shape);
* pipelining: at most 32 parsed requests wait per connection; past that the transport stops
  reading, so a client that pipelines and never reads its answers holds a bounded buffer;
* a request body is a stream that pauses the transport past ``read_bufsize`` (bodies behind a
  parked request are not read into memory);
* every response write waits for the socket to drain (write back-pressure);
* an idle keep-alive connection is closed after ``keepalive_timeout`` (counted from the
  connection's start or its last response, not reset by bytes that arrive).

What this module adds at the depth it belongs:

* a **header deadline**: a request's head must arrive within ``header_timeout`` of its first
  byte, else the connection is closed (aiohttp alone would wait the whole keep-alive timeout);
* a **body deadline** (:func:`read_body`): each piece of a body within ``body_timeout`` of the
  last, the whole body within ``body_total_timeout`` (408 and close otherwise); ``Expect:
  100-continue`` answered when the body is first read; bodies over ``max_body_bytes`` refused
  (413) from their ``Content-Length`` or as soon as they pass the limit;
* **request body codings** decoded here, not by aiohttp (its ``auto_decompress`` is off): a
  ``gzip`` or ``deflate`` body is inflated piece by piece as it is read, each piece counted
  against ``max_body_bytes`` and the caller's budget, so a small body that inflates past them is
  a 413 once it passes, never inflated whole; one that does not decode is a 400; any other
  coding (``br``, ``zstd``, unknown) a 415 naming the accepted ones. aiohttp's own decoder
  raised inside the handler's read (a 500), refused ``br``/``zstd`` as a malformed request telling
  the client to install Brotli, and passed unknown codings through undecoded;
* errors aiohttp answers itself (malformed requests, a handler that raised) come in the JSON
  shape of the API the path belongs to, via the server's ``error`` factory;
* a **head budget**: a request's line and headers together at most ``max_head_bytes`` (431 and
  close), far under what aiohttp's per-line and header-count limits allow (128 x 8190 bytes:
  1 MiB per connection, which 500 unfinished heads turned into 1 GiB of resident memory);
* a **connection cap**: past ``max_connections`` open connections a new one gets one 503 (in
  the control API's shape, with ``retry-after``) and is closed, before anything is parsed; by
  default the cap follows the process's open-file limit (:mod:`ares_gateway.http.open_files`);
* **memory back after a flood**: once many connections or large heads have gone, glibc is
  asked to return its free heap (``malloc_trim``), at most once a second, so the resident size
  falls back after the flood instead of staying at its peak.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import logging
import os
import stat
import zlib
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any

from aiohttp import web_protocol, web_server
from aiohttp.base_protocol import PAUSE_RESUME_READING_ERRORS
from aiohttp.http_exceptions import BadHttpMessage, LineTooLong
from aiohttp.streams import EMPTY_PAYLOAD
from aiohttp.web_request import BaseRequest
from aiohttp.web_response import Response, StreamResponse

from ares_gateway.core.errors import StatusError
from ares_gateway.http.open_files import connection_cap

log = logging.getLogger(__name__)

#: The private names of aiohttp this module relies on, by the class (or module) that holds them: the
#: connection's request queue, its counters and waiter (the head deadline and the 431), its parse-error
#: record, the server's connection set and the keyword arguments it hands each connection. Nowhere else in
#: the project touches aiohttp's private names; tests/gateway/test_aiohttp_internals.py fails when an
#: aiohttp release drops or renames one, or when this module starts using one not listed here.
AIOHTTP_INTERNALS: dict[str, tuple[str, ...]] = {
    "aiohttp.web_protocol.RequestHandler": ("_current_request", "_loop", "_messages", "_request_count",
                                            "_waiter"),
    "aiohttp.web_protocol": ("_ErrInfo",),
    "aiohttp.web_server.Server": ("_connections", "_kwargs", "_loop"),
}

#: Answers a status and a message for a path, in the shape of the API the path belongs to.
ErrorFactory = Callable[[str, int, str], Response]
Handler = Callable[[BaseRequest], Awaitable[StreamResponse]]


def _flag(help_text: str) -> dict[str, str]:
    """Field metadata: the field is an ``ares-gateway serve`` flag of its own name with this help."""
    return {"help": help_text}


@dataclass(frozen=True, slots=True)
class HttpLimits:
    """What one connection may send, and how slowly: ``GatewayConfig.http``. Each field is a ``Gateway``
    keyword of its own name, and one with a ``help`` in its metadata an ``ares-gateway serve`` flag."""

    #: Largest request body; bigger ones get a 413 in the API's error shape (``serve --max-body-mb``).
    max_body_bytes: int = 32 * 1024 * 1024
    #: Longest request line (method, target, version).
    max_line_bytes: int = field(default=8190,
                                metadata=_flag("longest request line, in bytes (longer: 431, closed)"))
    #: Longest header line (name and value).
    max_field_bytes: int = field(default=8190,
                                 metadata=_flag("longest header line, in bytes (longer: 431, closed)"))
    #: Most header lines in one request.
    max_headers: int = field(default=128,
                             metadata=_flag("most header lines in one request (more: 431, closed)"))
    #: Seconds from a request's first byte to the end of its headers.
    header_timeout: float = field(default=10.0, metadata=_flag(
        "seconds from a request's first byte to the end of its headers (slower: closed)"))
    #: Longest pause, in seconds, between two pieces of a request body.
    body_timeout: float = field(default=10.0, metadata=_flag(
        "longest pause between two pieces of a request body, in seconds (408, closed)"))
    #: Seconds a whole request body may take to arrive.
    body_total_timeout: float = field(default=120.0, metadata=_flag(
        "seconds a whole request body may take to arrive (408, closed)"))
    #: Seconds an idle keep-alive connection stays open.
    keepalive_timeout: float = field(default=75.0,
                                     metadata=_flag("seconds an idle keep-alive connection stays open"))
    #: Seconds spent discarding a body nobody read (after a 413, say) before closing instead.
    lingering_time: float = 5.0
    #: Bytes of a request body buffered before the connection stops reading.
    read_bufsize: int = 64 * 1024
    #: Most bytes of one request head (request line and every header line together); more: 431, closed.
    max_head_bytes: int = field(default=64 * 1024, metadata=_flag(
        "most bytes of one request head, line and headers together (more: 431, closed)"))
    #: Most client connections open at once; a new one past it gets a 503 and is closed. ``None``:
    #: follow the open-file limit when the server starts
    #: (:func:`~ares_gateway.http.open_files.connection_cap`:
    #: the soft limit less a reserve of up to 1,024 descriptors for everything else).
    max_connections: int | None = field(default=None, metadata=_flag(
        "most client connections open at once (a new one past it: 503, closed); default: the open-file "
        "limit (raised to its hard limit at start) less a reserve"))

    def __post_init__(self) -> None:
        for name in ("max_body_bytes", "max_line_bytes", "max_field_bytes", "max_headers", "read_bufsize",
                     "max_head_bytes", "max_connections"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be at least 1")
        for name in ("header_timeout", "body_timeout", "body_total_timeout", "keepalive_timeout"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be a positive number of seconds")


class BodyError(StatusError):
    """A request body that cannot be read: too large (413), too slow (408), not decodable (400),
    in a coding the gateway does not take (415)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message, status=status)


_CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"

#: The request body codings the gateway decodes (``Content-Encoding``), besides ``identity``.
ACCEPTED_ENCODINGS = "gzip, deflate"
#: Most bytes one decompress call may produce: what a bomb can add past the limit before it is refused.
_INFLATE_PIECE = 64 * 1024


def body_coding(request: BaseRequest) -> str | None:
    """The body's ``Content-Encoding`` (``gzip`` or ``deflate``), ``None`` for none or ``identity``;
    raises :class:`BodyError` 415 for any other."""
    codings = [c.strip().lower() for v in request.headers.getall("content-encoding", ())
               for c in v.split(",")]
    codings = [c for c in codings if c and c != "identity"]
    if not codings:
        return None
    if len(codings) == 1 and codings[0] in ("gzip", "x-gzip", "deflate"):
        return "deflate" if codings[0] == "deflate" else "gzip"
    # 415, not 400: RFC 9110 15.5.16 names it for a content coding the server does not support.
    # The message is for the client (which coding to send), not the operator (no "install Brotli").
    shown = ", ".join(codings)
    shown = shown if len(shown) <= 100 else shown[:100] + "..."
    raise BodyError(415, f"request body Content-Encoding {shown!r} is not accepted: send it uncompressed "
                         f"(identity) or in one of: {ACCEPTED_ENCODINGS}")


class _Body:
    """A body's bytes as they arrive, at most ``limit`` of them, each told to ``hold`` first."""

    def __init__(self, limit: int, hold: Callable[[int], None] | None) -> None:
        self.limit = limit
        self.hold = hold
        self.size = 0
        self.chunks: list[bytes] = []

    def add(self, chunk: bytes) -> None:
        self.size += len(chunk)
        if self.size > self.limit:
            raise BodyError(413, f"request body exceeds the gateway's limit of {self.limit} bytes")
        if self.hold is not None:
            self.hold(len(chunk))
        self.chunks.append(chunk)

    def finish(self) -> bytes:
        return b"".join(self.chunks)


class _Inflated(_Body):
    """A ``gzip`` or ``deflate`` body, inflated as it arrives: what is counted and kept is what it
    inflates to, ``_INFLATE_PIECE`` bytes at a time (a bomb stops at the limit, not in memory)."""

    def __init__(self, coding: str, limit: int, hold: Callable[[int], None] | None) -> None:
        super().__init__(limit, hold)
        self.coding = coding
        self.sent = 0
        self._z: Any = None

    def _fail(self, why: object) -> BodyError:
        return BodyError(400,
                         f"request body could not be decoded as {self.coding} (its Content-Encoding): {why}")

    def add(self, chunk: bytes) -> None:
        if not chunk:
            return
        self.sent += len(chunk)
        if self.sent > self.limit:  # as sent, too (a body read whole skips _read_slow's count)
            raise BodyError(413, f"request body exceeds the gateway's limit of {self.limit} bytes")
        data = chunk
        try:
            while True:
                if self._z is None:
                    # gzip: a header of its own (wbits 31). HTTP's deflate is a zlib stream, but some
                    # clients send raw deflate: told apart by the zlib header's method nibble (as aiohttp).
                    wbits = 31 if self.coding == "gzip" else (15 if data[0] & 0x0F == 8 else -15)
                    self._z = zlib.decompressobj(wbits)
                piece = self._z.decompress(data, _INFLATE_PIECE)
                data = self._z.unconsumed_tail
                if piece:
                    super().add(piece)
                if self._z.eof:
                    data = self._z.unused_data
                    if not data:
                        return
                    if self.coding != "gzip":
                        raise self._fail("data after the end of the stream")
                    self._z = None  # gzip: another member follows (RFC 1952 allows several)
                elif not data and len(piece) < _INFLATE_PIECE:
                    return  # all input taken, no output pending
        except zlib.error as exc:
            raise self._fail(exc) from None

    def finish(self) -> bytes:
        if self.sent and not self._z.eof:  # (a body with any bytes has a decompressor)
            raise self._fail("the data ends before its stream does (truncated)")
        return super().finish()


async def read_body(
    request: BaseRequest, limits: HttpLimits, hold: Callable[[int], None] | None = None
) -> bytes:
    """The whole body of ``request``, decoded (:func:`body_coding`), within the size and time
    limits; raises :class:`BodyError`.

    ``hold(n)`` is told of the body's bytes before they are kept (an uncoded body's
    ``Content-Length``, else each piece as it comes or is inflated), so a caller can count them
    against a budget; what it raises ends the read."""
    coding = body_coding(request)  # before anything is read or held: a 415 reads nothing
    length = request.content_length
    if length is not None and length > limits.max_body_bytes:
        raise BodyError(413, f"request body exceeds the gateway's limit of {limits.max_body_bytes} bytes")
    if hold is not None and length is not None and coding is None:
        hold(length)
        hold = None
    # A coded body's Content-Length is not its size: its inflated pieces are counted instead.
    body = (_Body if coding is None else partial(_Inflated, coding))(limits.max_body_bytes, hold)
    content = request.content
    if content.is_eof():  # all of it arrived with the head: the usual case, no timer needed
        body.add(await content.read())
    else:
        if request.version >= (1, 1) and request.headers.get("expect", "").lower() == "100-continue":
            # curl sends this with large bodies and waits for the interim response.
            await request.writer.write(_CONTINUE)
        await _read_slow(request, limits, body)
    return body.finish()


async def _read_slow(request: BaseRequest, limits: HttpLimits, body: _Body) -> None:
    loop = asyncio.get_running_loop()
    content = request.content
    sent = 0
    last = loop.time() + limits.body_total_timeout
    try:
        async with asyncio.timeout(None) as timer:
            while True:
                timer.reschedule(min(loop.time() + limits.body_timeout, last))
                chunk = await content.readany()
                if not chunk:
                    break
                sent += len(chunk)
                if sent > limits.max_body_bytes:  # as sent (a coded body's inflated size is body's to count)
                    raise BodyError(
                        413, f"request body exceeds the gateway's limit of {limits.max_body_bytes} bytes"
                    )
                body.add(chunk)
    except TimeoutError:
        # The client is sending too slowly (or stopped): answer, then close at once rather than
        # spend aiohttp's lingering time reading the rest of a body that may never come.
        protocol = request.protocol
        if isinstance(protocol, _Connection):
            protocol.close_after_response()
        raise BodyError(
            408,
            f"request body too slow: each piece must come within {limits.body_timeout:g} s "
            f"and the whole body within {limits.body_total_timeout:g} s",
        ) from None


class _HeadTooLarge(BadHttpMessage):
    """A request head over ``max_head_bytes``."""


class _Connection(web_protocol.RequestHandler):
    """aiohttp's connection protocol plus a deadline on receiving a request's head, and a budget on its
    size."""

    __slots__ = ("_error", "_head_bytes", "_head_count", "_head_peak", "_head_refused", "_head_timeout",
                 "_head_timer", "_last_payload", "_max_head", "_on_lost")

    def __init__(
        self, manager: Any, *, header_timeout: float, max_head_bytes: int, error: ErrorFactory, **kwargs: Any
    ) -> None:
        super().__init__(manager, **kwargs)
        self._head_timeout = header_timeout
        self._head_timer: asyncio.TimerHandle | None = None
        self._head_count = 0
        self._error = error
        self._on_lost: Callable[[], None] | None = None
        self._max_head = max_head_bytes
        #: Bytes received since the last request head was complete, while no body was being read.
        self._head_bytes = 0
        self._head_peak = 0
        self._head_refused = False
        #: The body stream of the last request parsed (its head is complete once it exists).
        self._last_payload: Any = None

    def data_received(self, data: bytes) -> None:
        if self._head_refused:
            return  # the 431 is queued; nothing more is parsed
        # Between requests (no body still being read) every byte belongs to a head: what the
        # parser has not turned into a request yet is counted against max_head_bytes. A chunk
        # that ends one body and starts the next head is not counted (so at most one chunk more).
        last = self._last_payload
        in_head = last is None or last.is_eof()
        queued = len(self._messages)
        super().data_received(data)
        if len(self._messages) > queued:
            self._last_payload = self._messages[-1][1]
            self._head_bytes = 0
        elif in_head and data:
            self._head_bytes += len(data)
            self._head_peak = max(self._head_peak, self._head_bytes)
            if self._head_bytes > self._max_head:
                self._refuse_head()
                return
        # Bytes came while no whole request is waiting to be served: a head has begun (or is
        # dribbling in). Its deadline runs from the first of them; any byte does not reset it.
        # (Not "the handler is waiting": on a new connection the first bytes can come before it is.)
        if data and self._head_timer is None and self._current_request is None and not self._messages:
            self._head_count = self._request_count
            self._head_timer = self._loop.call_later(self._head_timeout, self._head_overdue)

    def _refuse_head(self) -> None:
        """Queue a 431 the way aiohttp queues its own parser errors, and stop reading."""
        self._head_refused = True
        exc = _HeadTooLarge(f"the request head passed {self._max_head} bytes")
        # aiohttp's own form for a request that failed to parse (web_protocol._ErrInfo): the
        # connection's loop answers it through handle_error, after any request before it.
        self._messages.append(
            (web_protocol._ErrInfo(status=431, exc=exc, message=exc.message), EMPTY_PAYLOAD))
        self._request_count += 1
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)
        if self.transport is not None:
            with contextlib.suppress(*PAUSE_RESUME_READING_ERRORS):
                self.transport.pause_reading()

    def _head_overdue(self) -> None:
        self._head_timer = None
        if self._request_count == self._head_count and self._current_request is None and not self._messages:
            log.debug("closing a connection whose request head took over %g s", self._head_timeout)
            self.force_close()

    def close_after_response(self) -> None:
        """Close once the current response is written, without reading the rest of its body."""
        self._lingering_time = 0.0  # aiohttp's drain-the-unread-body step is skipped at 0
        self.close()

    def on_lost(self, callback: Callable[[], None] | None) -> None:
        """Call ``callback`` the moment the client disconnects, before the handler is cancelled
        (``None`` clears it). The agent API withdraws its parked request this way, so nothing can
        answer a request whose agent is gone, however the cancelled handler is scheduled."""
        self._on_lost = callback

    def connection_lost(self, exc: BaseException | None) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None
        callback, self._on_lost = self._on_lost, None
        if callback is not None:
            try:
                callback()
            except Exception:  # the connection must still be torn down
                log.exception("disconnect callback failed")
        super().connection_lost(exc)

    def handle_error(
        self,
        request: BaseRequest,
        status: int = 500,
        exc: BaseException | None = None,
        message: str | None = None,
    ) -> StreamResponse:
        """Errors aiohttp answers itself, in the API's JSON shape; the connection then closes."""
        if status == 500 and isinstance(exc, ConnectionError) and _client_gone(request):
            # A write to a client that hung up (an agent killed mid-stream, a poller gone mid-batch):
            # nothing to answer and nothing wrong here. aiohttp drops the connection on this error.
            log.debug("%s %s: the client went away before its answer was written", request.method,
                      request.path)
            raise exc
        if status == 500:
            log.error("unhandled error serving %s %s", request.method, request.path, exc_info=exc)
            text = "internal error in the gateway; see its log"
        elif isinstance(exc, _HeadTooLarge):
            status = 431
            text = (
                f"request head too large: the gateway takes request heads (request line and headers) "
                f"up to {self._max_head} bytes"
            )
        elif isinstance(exc, LineTooLong) or (
            isinstance(exc, BadHttpMessage) and "too many headers" in str(exc).lower()
        ):
            status = 431
            text = (
                f"request head too large ({_reason(exc)}): the gateway takes lines up to "
                f"{self.max_field_size} bytes and up to {self.max_headers} headers"
            )
        else:
            text = f"malformed HTTP request: {_reason(exc) if exc is not None else message or 'bad request'}"
        if request.writer.output_size > 0:
            raise ConnectionError("the response was partly sent; the connection is closed")
        resp = self._error(request.path, status, text)
        resp.force_close()
        return resp


def _client_gone(request: BaseRequest) -> bool:
    transport = request.transport
    return transport is None or transport.is_closing()


def _reason(exc: BaseException | None) -> str:
    # aiohttp's HttpProcessingError reads "400, message: ..." as a string; its .message is the reason.
    text = str(getattr(exc, "message", "") or exc)
    return text if len(text) <= 200 else text[:200] + "..."


class _Refused(asyncio.Protocol):
    """A connection past ``max_connections``: one 503, then closed (whatever it sends is dropped)."""

    def __init__(self, response: bytes) -> None:
        self._response = response
        self._transport: Any = None

    def connection_made(self, transport: Any) -> None:  # uvloop's transports are no asyncio.Transport
        self._transport = transport
        transport.write(self._response)
        # Half-close, then give the client a moment to read the answer (a close with its request
        # still unread would reset the connection, and the client would see no 503).
        with contextlib.suppress(OSError, RuntimeError, NotImplementedError):
            transport.write_eof()
        asyncio.get_running_loop().call_later(1.0, transport.close)

    def data_received(self, data: bytes) -> None:
        pass

    def eof_received(self) -> bool:
        if self._transport is not None:
            self._transport.close()
        return False


def _malloc_trim() -> Callable[[], None] | None:
    try:
        trim = ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):  # not glibc: nothing to ask
        return None
    trim.argtypes = [ctypes.c_size_t]

    def run() -> None:
        trim(0)

    return run


_TRIM = _malloc_trim()
#: Closed connections (each large head counting as more) after which the free heap is returned.
_TRIM_AFTER = 64
_HEAD_WEIGHT = 64 * 1024


class _Server(web_server.Server):
    def __init__(
        self,
        handler: Handler,
        *,
        header_timeout: float,
        max_head_bytes: int,
        max_connections: int,
        error: ErrorFactory,
        **kwargs: Any,
    ) -> None:
        super().__init__(handler, handler_cancellation=True, **kwargs)  # type: ignore[arg-type]
        self._header_timeout = header_timeout
        self._max_head = max_head_bytes
        self._max_connections = max_connections
        self._error = error
        self._gone = 0
        self._trim_timer: asyncio.TimerHandle | None = None
        #: Connections refused at the cap.
        self.refused = 0

    def __call__(self) -> asyncio.Protocol:  # type: ignore[override]  # _Refused is no RequestHandler
        if len(self._connections) >= self._max_connections:
            self.refused += 1
            if self.refused == 1 or self.refused % 1000 == 0:
                log.warning("refusing connections: %d open, the limit (max_connections)",
                            len(self._connections))
            return _Refused(self._refusal())
        return _Connection(
            self,
            loop=self._loop,
            header_timeout=self._header_timeout,
            max_head_bytes=self._max_head,
            error=self._error,
            **self._kwargs,
        )

    def _refusal(self) -> bytes:
        resp = self._error(
            "/", 503, f"the gateway has {self._max_connections} connections open, its limit; retry later"
        )
        body = resp.body if isinstance(resp.body, bytes) else b""
        return (
            b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
            b"Retry-After: 1\r\nConnection: close\r\nContent-Length: %d\r\n\r\n%b" % (len(body), body)
        )

    def connection_lost(self, handler: web_protocol.RequestHandler, exc: BaseException | None = None) -> None:
        super().connection_lost(handler, exc)
        if _TRIM is None:
            return
        # A flood of connections (or of large heads) leaves glibc's heap fragmented and its free
        # memory resident; ask for it back once the flood is over, at most once a second.
        self._gone += 1 + (handler._head_peak // _HEAD_WEIGHT if isinstance(handler, _Connection) else 0)
        if self._gone >= _TRIM_AFTER and self._trim_timer is None:
            self._trim_timer = self._loop.call_later(1.0, self._trim)

    def _trim(self) -> None:
        self._trim_timer = None
        self._gone = 0
        if _TRIM is not None:
            _TRIM()

    def stop_trimming(self) -> None:
        if self._trim_timer is not None:
            self._trim_timer.cancel()
            self._trim_timer = None


class HttpServer:
    """Serves ``handler`` over HTTP/1.1 on one listening socket (TCP or unix), within ``limits``."""

    def __init__(
        self, handler: Handler, error: ErrorFactory, limits: HttpLimits, *, access_log: bool = False
    ) -> None:
        self.handler = handler
        self.error = error
        self.limits = limits
        self.access_log = access_log
        self._server: _Server | None = None
        self._listener: asyncio.AbstractServer | None = None
        self._unix_path: str | None = None

    @property
    def connections(self) -> int:
        """Open client connections."""
        return len(self._server.connections) if self._server is not None else 0

    @property
    def max_connections(self) -> int | None:
        """The connection cap in force (``None`` before the server starts)."""
        return self._server._max_connections if self._server is not None else None

    @property
    def refused_connections(self) -> int:
        """Connections refused at ``max_connections`` so far."""
        return self._server.refused if self._server is not None else 0

    async def start(self, host: str, port: int) -> int:
        """Listen on TCP; returns the bound port."""
        self._server = self._make_server()
        loop = asyncio.get_running_loop()
        self._listener = await loop.create_server(self._server, host, port, backlog=1024)
        sockets: Any = self._listener.sockets  # a list under uvloop, a tuple under asyncio
        return int(sockets[0].getsockname()[1])

    async def start_unix(self, path: str, *, mode: int = 0o600) -> None:
        """Listen on the unix socket ``path`` (a stale socket file there is replaced), made ``mode``."""
        self._server = self._make_server()
        loop = asyncio.get_running_loop()
        with contextlib.suppress(FileNotFoundError):
            if stat.S_ISSOCK(os.lstat(path).st_mode):
                os.unlink(path)
        self._listener = await loop.create_unix_server(self._server, path, backlog=1024)
        os.chmod(path, mode)
        self._unix_path = path

    def _make_server(self) -> _Server:
        lim = self.limits
        kwargs: dict[str, Any] = {
            "max_line_size": lim.max_line_bytes,
            "max_field_size": lim.max_field_bytes,
            "max_headers": lim.max_headers,
            "keepalive_timeout": lim.keepalive_timeout,
            "lingering_time": lim.lingering_time,
            "read_bufsize": lim.read_bufsize,
            # read_body decodes bodies itself (module docs): aiohttp's decoder fails inside the read.
            "auto_decompress": False,
        }
        if not self.access_log:
            kwargs["access_log"] = None
        return _Server(
            self.handler,
            header_timeout=lim.header_timeout,
            max_head_bytes=lim.max_head_bytes,
            max_connections=lim.max_connections if lim.max_connections is not None else connection_cap(),
            error=self.error,
            **kwargs,
        )

    async def close(self, grace: float = 5.0) -> None:
        """Stop listening, let requests in flight finish (for ``grace`` seconds), then close every
        connection."""
        if self._listener is None or self._server is None:
            return
        listener, self._listener = self._listener, None
        listener.close()
        server = self._server
        server.stop_trimming()
        server.pre_shutdown()
        await server.shutdown(grace)
        await listener.wait_closed()
        path, self._unix_path = self._unix_path, None
        if path is not None:
            with contextlib.suppress(OSError):
                os.unlink(path)


def on_disconnect(request: BaseRequest, callback: Callable[[], None] | None) -> None:
    """Run ``callback`` synchronously when ``request``'s client disconnects (``None``: no longer)."""
    protocol = request.protocol
    if isinstance(protocol, _Connection):
        protocol.on_lost(callback)


__all__ = ["ACCEPTED_ENCODINGS", "BodyError", "HttpLimits", "HttpServer", "on_disconnect", "read_body"]
