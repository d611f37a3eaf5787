"""The gateway's HTTP/1.1 server: httptools' parser under a small asyncio protocol.

Why not aiohttp's server: with its request objects, payload streams, writers and
tasks, a bare park loop costs 226 k instructions per in-process turn on aiohttp's
low-level server and 88 k on this one (573 k and 313 k over ``/poll`` +
``/respond``; docs/performance.md), and every agent turn is one request plus a
share of a ``/poll`` and a ``/respond``. httptools (llhttp, the parser aiohttp and
uvicorn also use) does the parsing; this module only frames.

The gateway serves a small, fixed surface, so this supports what agents and
pollers use and no more: HTTP/1.1 keep-alive and pipelining, HTTP/1.0, bodies by
length or chunked, ``Expect: 100-continue``, a body-size limit, responses by
length or chunked (streams, with write back-pressure), an idle timeout, and
cancelling a request's handler when its client goes away (which withdraws a
parked request).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable, Mapping
from email.utils import formatdate
from http import HTTPStatus
from typing import Any, cast
from urllib.parse import parse_qsl, unquote

import httptools
from multidict import CIMultiDict

log = logging.getLogger(__name__)
access_log = logging.getLogger("ares_gateway.access")


class Request:
    """One fully received HTTP request."""

    __slots__ = (
        "_conn",
        "_query",
        "_reject",
        "_sent",
        "body",
        "body_too_large",
        "headers",
        "keep_alive",
        "method",
        "path",
        "query_string",
        "version",
    )

    def __init__(
        self,
        method: str,
        path: str,
        query_string: str,
        headers: CIMultiDict[str],
        body: bytes,
        version: str = "1.1",
        keep_alive: bool = True,
        body_too_large: bool = False,
    ) -> None:
        self.method = method
        #: The percent-decoded path, without the query string.
        self.path = path
        self.query_string = query_string
        #: Case-insensitive, as HTTP header names are.
        self.headers = headers
        self.body = body
        self.version = version
        self.keep_alive = keep_alive
        #: The body went over the server's limit and was discarded (``body`` is then empty).
        self.body_too_large = body_too_large
        self._query: dict[str, str] | None = None
        self._conn: _Connection | None = None
        # Answered by the server itself, without a handler (e.g. an unknown Expect).
        self._reject: tuple[int, str] | None = None
        self._sent: Response | None = None

    @property
    def query(self) -> Mapping[str, str]:
        """Query parameters; the first value of a repeated name."""
        if self._query is None:
            query: dict[str, str] = {}
            for key, value in parse_qsl(self.query_string, keep_blank_values=True):
                query.setdefault(key, value)
            self._query = query
        return self._query

    @property
    def can_read_body(self) -> bool:
        return bool(self.body)

    @property
    def sent(self) -> Response | None:
        """The response :meth:`send` wrote, if any."""
        return self._sent

    def send(self, response: Response) -> bool:
        """Write ``response`` now, while the handler is still running; it must then return it.

        Lets code outside the handler's task answer at once (the gateway answers an agent from
        inside the policy's ``respond`` call, without waiting for the handler to be scheduled).
        Returns False when the client is gone or a response was already sent.
        """
        conn = self._conn
        if conn is None or self._sent is not None:
            return False
        try:
            conn._write(self, response)
        except ConnectionResetError:
            return False
        self._sent = response
        return True


class Response:
    """A response with its whole body."""

    __slots__ = ("body", "content_type", "headers", "status")

    def __init__(
        self,
        body: bytes = b"",
        status: int = 200,
        content_type: str = "application/json",
        headers: Mapping[str, str] | None = None,
    ) -> None:
        self.status = status
        self.body = body
        self.content_type = content_type
        self.headers = headers


class StreamResponse:
    """A response written piece by piece (chunked), such as a server-sent event stream."""

    __slots__ = ("_chunked", "_conn", "finished", "headers", "status")

    def __init__(self, status: int = 200, headers: Mapping[str, str] | None = None) -> None:
        self.status = status
        self.headers = dict(headers or {})
        self._conn: _Connection | None = None
        self._chunked = True
        self.finished = False

    async def prepare(self, request: Request) -> None:
        """Send the status line and headers."""
        conn = request._conn
        if conn is None:
            raise RuntimeError("this request is not being served")
        self._conn = conn
        # HTTP/1.0 has no chunked encoding: the body then ends when the connection closes.
        self._chunked = request.version != "1.0"
        if self._chunked:
            extra = b"transfer-encoding: chunked\r\n"
        else:
            extra = b"connection: close\r\n"
            conn.close_after_response = True
        conn.write(_head(self.status, self.headers.items(), extra))
        conn.streaming = True
        await conn.drain()

    async def write(self, data: bytes) -> None:
        """Send part of the body; raises ConnectionResetError once the client is gone."""
        if not data:
            return
        conn = self._conn
        if conn is None:
            raise RuntimeError("call prepare() before write()")
        conn.write(b"%x\r\n%b\r\n" % (len(data), data) if self._chunked else data)
        await conn.drain()

    async def write_eof(self) -> None:
        """End the body."""
        if self.finished:
            return
        self.finished = True
        if self._conn is not None and self._chunked:
            self._conn.write(b"0\r\n\r\n")


#: Answers a request with a status and message in the shape of the API its path belongs to.
ErrorFactory = Callable[[Request, int, str], Response]
Handler = Callable[[Request], Awaitable[Response | StreamResponse]]


class HttpServer:
    """Serves ``handler`` over HTTP/1.1 on one listening socket."""

    def __init__(
        self,
        handler: Handler,
        error: ErrorFactory,
        *,
        max_body_bytes: int,
        keepalive_timeout: float = 75.0,
        access_log: bool = False,
    ) -> None:
        self.handler = handler
        self.error = error
        self.max_body_bytes = max_body_bytes
        self.keepalive_timeout = keepalive_timeout
        self.access_log = access_log
        self.connections: set[_Connection] = set()
        self._server: asyncio.AbstractServer | None = None
        self._sweeper: asyncio.Task[None] | None = None

    async def start(self, host: str, port: int) -> int:
        """Listen; returns the bound port."""
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(lambda: _Connection(self), host, port, backlog=1024)
        self._sweeper = loop.create_task(self._sweep_idle())
        sockets = cast(Any, self._server).sockets  # a list under uvloop, not typeshed's tuple (compiled code checks)
        return int(sockets[0].getsockname()[1])

    async def close(self, grace: float = 5.0) -> None:
        """Stop listening, let requests in flight finish (for ``grace`` seconds), then close every connection."""
        if self._server is None:
            return
        server, self._server = self._server, None
        server.close()
        if self._sweeper is not None:
            self._sweeper.cancel()
        busy = [c.task for c in self.connections if c.task is not None]
        if busy:
            await asyncio.wait(busy, timeout=grace)
        for conn in list(self.connections):
            conn.abort()
        await server.wait_closed()

    async def _sweep_idle(self) -> None:
        # One timer for all connections rather than one per request, as aiohttp arms.
        loop = asyncio.get_running_loop()
        period = max(0.05, min(self.keepalive_timeout / 4, 15.0))
        while True:
            await asyncio.sleep(period)
            deadline = loop.time() - self.keepalive_timeout
            for conn in list(self.connections):
                if conn.task is None and conn.idle_since < deadline:
                    conn.abort()


class _Connection(asyncio.Protocol):
    """One client connection: parses requests, serves them one at a time, in order."""

    def __init__(self, server: HttpServer) -> None:
        self.server = server
        self.loop = asyncio.get_running_loop()
        self.parser = httptools.HttpRequestParser(self)
        self.transport: asyncio.Transport | None = None
        self.task: asyncio.Task[None] | None = None
        self.queue: deque[Request] = deque()
        self.idle_since = self.loop.time()
        self.close_after_response = False
        #: A StreamResponse of the current request has sent its head.
        self.streaming = False
        self._reading_paused = False
        self._write_paused = False
        self._drain_waiter: asyncio.Future[None] | None = None
        self._url = b""
        self._raw_headers: list[tuple[str, str]] = []
        self._headers: CIMultiDict[str] = CIMultiDict()
        self._body: list[bytes] = []
        self._body_size = 0
        self._too_large = False
        self._expect_failed: str | None = None

    # -- transport events ---------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's transports do not subclass it
        self.server.connections.add(self)

    def connection_lost(self, exc: Exception | None) -> None:
        self.server.connections.discard(self)
        self.transport = None
        if self.task is not None:
            # The client is gone: cancel its handler, which withdraws a parked request.
            self.task.cancel()
        self.queue.clear()
        self._wake_writer(ConnectionResetError("the client closed the connection"))

    def pause_writing(self) -> None:
        self._write_paused = True

    def resume_writing(self) -> None:
        self._write_paused = False
        self._wake_writer(None)

    def data_received(self, data: bytes) -> None:
        if self.task is None:
            self.idle_since = self.loop.time()
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            # The request is served (on_message_complete ran); what follows is not HTTP.
            self.close_after_response = True
            self._pause_reading()
        except httptools.HttpParserError as exc:
            self._bad_request(f"malformed HTTP request: {exc}")

    # -- parser callbacks ---------------------------------------------------------------------

    def on_message_begin(self) -> None:
        self._url = b""
        self._raw_headers = []
        self._body = []
        self._body_size = 0
        self._too_large = False
        self._expect_failed = None

    def on_url(self, url: bytes) -> None:
        self._url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        self._raw_headers.append((name.decode("latin-1"), value.decode("latin-1")))

    def on_headers_complete(self) -> None:
        self._headers = headers = CIMultiDict(self._raw_headers)
        length = headers.get("content-length", "")
        if length.strip().isdigit() and int(length) > self.server.max_body_bytes:
            self._too_large = True
        expect = headers.get("expect")
        if expect is not None and self.parser.get_http_version() == "1.1":
            if expect.lower() != "100-continue":
                self._expect_failed = expect
            elif not self._too_large and self.transport is not None:
                # curl sends this with large bodies and waits for the interim response.
                self.transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")

    def on_body(self, chunk: bytes) -> None:
        if self._too_large:
            return
        self._body_size += len(chunk)
        if self._body_size > self.server.max_body_bytes:
            self._too_large = True
            self._body = []
            return
        self._body.append(chunk)

    def on_message_complete(self) -> None:
        parser = self.parser
        url = self._url
        if not url.startswith(b"/"):  # absolute-form ("http://host/path") or "*"
            try:
                parsed = httptools.parse_url(url)
                raw_path, query = parsed.path or b"/", parsed.query or b""
            except httptools.HttpParserInvalidURLError:
                raw_path, query = url, b""
        else:
            raw_path, _, query = url.partition(b"?")
            raw_path = raw_path.partition(b"#")[0]
        path = raw_path.decode("latin-1")
        if "%" in path:
            path = unquote(path)
        body = b"".join(self._body) if len(self._body) != 1 else self._body[0]
        request = Request(
            parser.get_method().decode("latin-1"),
            path,
            query.decode("latin-1"),
            self._headers,
            body,
            parser.get_http_version(),
            parser.should_keep_alive(),
            self._too_large,
        )
        self._body = []
        request._conn = self
        if self._expect_failed is not None:
            request._reject = (417, f"unknown Expect: {self._expect_failed}; only 100-continue is supported")
            request.keep_alive = False
        if self.task is None:
            self.task = self.loop.create_task(self._serve(request))
        else:
            self.queue.append(request)
            if len(self.queue) >= 16:  # a client pipelining without reading answers
                self._pause_reading()

    # -- serving ------------------------------------------------------------------------------

    async def _serve(self, request: Request) -> None:
        server = self.server
        while True:
            started = time.perf_counter() if server.access_log else 0.0
            self.streaming = False
            response: Response | StreamResponse
            try:
                if request._reject is not None:
                    response = server.error(request, *request._reject)
                else:
                    response = await server.handler(request)
                if isinstance(response, StreamResponse):
                    if response._conn is None:  # never prepared: nothing was sent
                        response = server.error(request, 500, "the handler sent no response")
                    else:
                        await response.write_eof()
                if isinstance(response, Response) and request._sent is None:
                    self._write(request, response)
            except ConnectionResetError:  # the client went away while its answer was written
                self.task = None
                return
            except asyncio.CancelledError:
                self.task = None
                raise
            except Exception:
                log.exception("unhandled error serving %s %s", request.method, request.path)
                response = server.error(request, 500, "internal error in the gateway; see its log")
                request.keep_alive = False
                if not self.streaming and request._sent is None:  # else closing is all that is left
                    try:
                        self._write(request, response)
                    except ConnectionResetError:
                        pass
            finally:
                request._conn = None
            if server.access_log:
                access_log.info(
                    '"%s %s HTTP/%s" %d %.1f ms',
                    request.method,
                    request.path,
                    request.version,
                    response.status,
                    (time.perf_counter() - started) * 1000,
                )
            if not request.keep_alive or self.close_after_response:
                self.task = None
                if self.transport is not None:
                    self.transport.close()
                return
            if not self.queue:
                self.task = None
                self.idle_since = self.loop.time()
                if self._reading_paused:
                    self._reading_paused = False
                    if self.transport is not None:
                        self.transport.resume_reading()
                return
            request = self.queue.popleft()

    def _write(self, request: Request, response: Response) -> None:
        body = response.body
        extra = b"content-type: %b\r\ncontent-length: %d\r\n" % (response.content_type.encode("latin-1"), len(body))
        if not request.keep_alive or self.close_after_response:
            extra += b"connection: close\r\n"
        elif request.version == "1.0":
            extra += b"connection: keep-alive\r\n"
        head = _head(response.status, response.headers.items() if response.headers else (), extra)
        self.write(head if request.method == "HEAD" else head + body)

    def write(self, data: bytes) -> None:
        if self.transport is None or self.transport.is_closing():
            raise ConnectionResetError("the client closed the connection")
        self.transport.write(data)

    async def drain(self) -> None:
        if self.transport is None:
            raise ConnectionResetError("the client closed the connection")
        if not self._write_paused:
            return
        waiter = self.loop.create_future()
        self._drain_waiter = waiter
        await waiter

    def _wake_writer(self, exc: Exception | None) -> None:
        waiter, self._drain_waiter = self._drain_waiter, None
        if waiter is not None and not waiter.done():
            if exc is None:
                waiter.set_result(None)
            else:
                waiter.set_exception(exc)

    def _pause_reading(self) -> None:
        if not self._reading_paused and self.transport is not None:
            self._reading_paused = True
            self.transport.pause_reading()

    def _bad_request(self, message: str) -> None:
        # The stream is out of step: answer once (after any request in flight) and close.
        request = Request("GET", "/", "", CIMultiDict(), b"", keep_alive=False)
        response = self.server.error(request, 400, message)
        self.close_after_response = True
        if self.task is None:
            try:
                self._write(request, response)
            except ConnectionResetError:
                return
            if self.transport is not None:
                self.transport.close()
        self._pause_reading()

    def abort(self) -> None:
        if self.transport is not None:
            self.transport.abort()


_REASONS = {s.value: s.phrase.encode() for s in HTTPStatus}
_date: list[Any] = [0, b""]


def _date_header() -> bytes:
    now = int(time.time())
    if _date[0] != now:
        _date[0] = now
        _date[1] = b"date: " + formatdate(now, usegmt=True).encode() + b"\r\n"
    return bytes(_date[1])


def _head(status: int, headers: Any, extra: bytes) -> bytes:
    lines = [b"HTTP/1.1 %d %b\r\n" % (status, _REASONS.get(status, b"Unknown")), _date_header(), extra]
    for name, value in headers:
        lines.append(b"%b: %b\r\n" % (name.encode("latin-1"), value.encode("latin-1")))
    lines.append(b"\r\n")
    return b"".join(lines)


__all__ = ["HttpServer", "Request", "Response", "StreamResponse"]
