"""A TCP-to-unix-socket relay: listens on ``HOST:PORT`` and pipes every connection to a unix socket.

Stdlib only and Python 3.8-compatible: it runs with the host's interpreter in a sandbox's network
namespace (local backend) or with the image's ``python3`` inside a container (Docker backend), where
nothing but this file is available.  See :meth:`sandbox.protocol.BaseSandbox.forward`.

    python3 _relay.py --listen 127.0.0.1:8080 --unix /run/gw/session.sock [--ready-file F] [--watch-pid P]

* Every accepted connection opens its own connection to the unix socket; bytes are copied both ways
  with bounded buffers (a slow reader stops the other side's reads: backpressure, not memory growth).
* EOF from one side is passed on as a half-close (``shutdown(SHUT_WR)``) and the other direction keeps
  flowing; when both directions are done, or on any error, both sockets are closed.
* ``--max-connections`` bounds concurrent connections; one over the limit is closed at once.
* It prints ``ready`` (and writes ``--ready-file``) once listening; it exits when its stdin reaches
  EOF (``--exit-on-stdin-eof``: its parent died) or when ``--watch-pid`` exits (the sandbox died).

Tunnel mode (``--tunnel binary|line``, no ``--unix``): no socket reaches the host, so every accepted
connection becomes one stream multiplexed over this process's own stdin/stdout (an exec, PTY or SSH
channel); :class:`Mux` is both ends of that protocol (the host's end is :mod:`sandbox.tunnel`) and the
frame format is in docs/sandbox.md ("The exec tunnel").

    python3 _relay.py --listen 127.0.0.1:8080 --tunnel binary [--ready-file F] [--max-connections N]
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import binascii
import collections
import contextlib
import os
import socket
import struct
import sys
import time
from collections.abc import Awaitable, Callable
from typing import Any

CHUNK = 64 * 1024
# Pause reading one side while the other side's transport holds more than this unsent.
HIGH_WATER = 256 * 1024


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    while True:
        data = await reader.read(CHUNK)
        if not data:
            break
        writer.write(data)
        await writer.drain()
    if writer.can_write_eof():
        with contextlib.suppress(OSError):
            writer.write_eof()


def _close(writer: asyncio.StreamWriter) -> None:
    with contextlib.suppress(Exception):
        writer.close()


class Relay:
    def __init__(self, unix_path: str, *, max_connections: int = 1024, connect_timeout: float = 10.0) -> None:
        self.unix_path = unix_path
        self.max_connections = max_connections
        self.connect_timeout = connect_timeout
        self.active = 0
        self._logged = 0
        # The loop holds tasks weakly and asyncio's stream protocol drops its handler task when the
        # client's side closes: without these references a pending connection could be collected.
        self._tasks: set[asyncio.Task[None]] = set()

    def _log(self, line: str) -> None:
        # A bounded log: a client hammering a missing socket must not fill the disk.
        self._logged += 1
        if self._logged <= 20:
            sys.stderr.write(line)
            sys.stderr.flush()

    async def handle(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        if self.active >= self.max_connections:
            _close(client_w)
            return
        self.active += 1
        me = asyncio.current_task()
        if me is not None:
            self._tasks.add(me)
        upstream_w = None
        try:
            client_w.transport.set_write_buffer_limits(high=HIGH_WATER)
            try:
                upstream_r, upstream_w = await asyncio.wait_for(
                    asyncio.open_unix_connection(self.unix_path, limit=CHUNK), self.connect_timeout
                )
            except (OSError, asyncio.TimeoutError) as exc:  # noqa: UP041 (Python < 3.11 inside images)
                self._log(f"relay: cannot connect to {self.unix_path}: {exc}\n")
                return
            upstream_w.transport.set_write_buffer_limits(high=HIGH_WATER)
            up = asyncio.ensure_future(_pipe(client_r, upstream_w))
            down = asyncio.ensure_future(_pipe(upstream_r, client_w))
            self._tasks.update((up, down))
            try:
                # Both directions run to their EOF; an error in one ends both.
                done, pending = await asyncio.wait({up, down}, return_when=asyncio.FIRST_EXCEPTION)
                for task in pending:
                    task.cancel()
                for task in pending:
                    with contextlib.suppress(BaseException):
                        await task
                for task in done:
                    with contextlib.suppress(BaseException):
                        task.result()
            finally:
                up.cancel()
                down.cancel()
                self._tasks.difference_update((up, down))
        except Exception:  # one connection's failure never ends the relay
            pass
        finally:
            self.active -= 1
            if me is not None:
                self._tasks.discard(me)
            _close(client_w)
            if upstream_w is not None:
                _close(upstream_w)


# -- tunnel mode: many streams over one byte channel ------------------------------------------------

#: Written once listening (after any noise a PTY's shell printed): the host skips everything before it.
MARKER = b"\n@@ARES-TUNNEL-1@@\n"
#: A frame: type (1 byte), stream id (4 bytes), payload length (4 bytes), all big-endian; the payload.
HEADER = struct.Struct(">BII")
#: The largest frame on the wire, header included (Daytona's WebSocket limit); in line mode the base64
#: line with its newline also fits in it.
MAX_FRAME = 64 * 1024
MAX_PAYLOAD = MAX_FRAME - HEADER.size
LINE_MAX_PAYLOAD = ((MAX_FRAME - 1) // 4) * 3 - HEADER.size
OPEN, DATA, FIN, RST, WINDOW, PING, PONG = 1, 2, 3, 4, 5, 6, 7
FRAME_NAMES = {OPEN: "open", DATA: "data", FIN: "fin", RST: "rst", WINDOW: "window", PING: "ping",
               PONG: "pong"}
#: Bytes a side may send on one stream before the other grants more (WINDOW on that stream).
STREAM_WINDOW = 256 * 1024
#: Bytes a side may send on all streams together before the other grants more (WINDOW on stream 0).
CONN_WINDOW = 4 * 1024 * 1024
#: Pings are answered only while less than this waits on the channel's writer.
PONG_BACKLOG = 1024 * 1024
#: A reader of the channel must buffer at least one line-mode frame.
READER_LIMIT = 256 * 1024
_MAX_CREDIT = 2 ** 31


class TunnelError(Exception):
    """The peer broke the tunnel protocol: the channel is torn down."""


def encode_frame(ftype: int, sid: int, payload: bytes = b"", *, line: bool = False) -> bytes:
    limit = LINE_MAX_PAYLOAD if line else MAX_PAYLOAD
    if len(payload) > limit:
        raise ValueError(f"a frame payload of {len(payload)} bytes is over the limit of {limit}")
    frame = HEADER.pack(ftype, sid, len(payload)) + payload
    return base64.b64encode(frame) + b"\n" if line else frame


async def read_frame(reader: asyncio.StreamReader, *, line: bool = False) -> tuple[int, int, bytes]:
    """The next frame; ``asyncio.IncompleteReadError`` at the channel's end, :class:`TunnelError` on a
    violation.  Sizes are checked before a payload is read, so a lying header costs no memory."""
    if line:
        try:
            raw = await reader.readuntil(b"\n")
        except (asyncio.LimitOverrunError, ValueError) as exc:
            raise TunnelError(f"a line over {MAX_FRAME} bytes") from exc
        if len(raw) > MAX_FRAME:
            raise TunnelError(f"a line of {len(raw)} bytes is over the limit of {MAX_FRAME}")
        try:
            frame = base64.b64decode(raw.rstrip(b"\r\n"), validate=True)
        except (binascii.Error, ValueError) as exc:
            raise TunnelError("a line that is not base64") from exc
        if len(frame) < HEADER.size:
            raise TunnelError(f"a frame of {len(frame)} bytes is shorter than its header")
        ftype, sid, n = HEADER.unpack_from(frame)
        if n != len(frame) - HEADER.size:
            raise TunnelError(f"a frame's length field says {n}, its line holds {len(frame) - HEADER.size}")
        payload = frame[HEADER.size:]
        limit = LINE_MAX_PAYLOAD
    else:
        ftype, sid, n = HEADER.unpack(await reader.readexactly(HEADER.size))
        limit = MAX_PAYLOAD
        if n > limit:
            raise TunnelError(
                f"a {FRAME_NAMES.get(ftype, ftype)} frame of {n} bytes is over the limit of {limit}")
        payload = await reader.readexactly(n) if n else b""
    if n > limit:
        raise TunnelError(f"a frame of {n} bytes is over the limit of {limit}")
    if ftype not in FRAME_NAMES:
        raise TunnelError(f"unknown frame type {ftype}")
    return ftype, sid, payload


class _Stream:
    __slots__ = (
        "consumed",
        "credit",
        "fin_in",
        "inbox",
        "inbox_event",
        "reader",
        "recv_left",
        "send_credit",
        "sid",
        "task",
        "writer",
    )

    def __init__(self, sid: int, window: int) -> None:
        self.sid = sid
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None
        self.send_credit = window  # what we may still send
        self.recv_left = window  # what the peer may still send us
        self.consumed = 0  # delivered to our socket, not yet granted back
        self.inbox: collections.deque[bytes] = collections.deque()
        self.inbox_event = asyncio.Event()
        self.credit = asyncio.Event()
        self.fin_in = False
        self.task: asyncio.Future[None] | None = None


class Mux:
    """One end of the tunnel over ``reader``/``writer`` (the channel, already past :data:`MARKER`).

    The relay's end (``connect=None``) opens a stream per connection it accepts (:meth:`accept`); the
    host's end (``connect``: a coroutine function returning the stream's far end, e.g. the session's
    unix socket) connects each stream the relay opens and may open none itself.  Everything received
    is checked: a frame over the size limit, an unknown type, data over a window, a reused or flooded
    stream id end :meth:`run` with :attr:`violation` set.  Memory per channel is bounded by
    ``conn_window`` (data not yet delivered) and ``max_streams`` (sockets).
    """

    def __init__(
        self,
        reader: asyncio.StreamReader,
        writer: Any,
        *,
        line: bool = False,
        connect: Callable[[], Awaitable[tuple[asyncio.StreamReader, asyncio.StreamWriter]]] | None = None,
        max_streams: int = 1024,
        stream_window: int = STREAM_WINDOW,
        conn_window: int = CONN_WINDOW,
        connect_timeout: float = 10.0,
        ping_interval: float | None = None,
        ping_timeout: float = 15.0,
    ) -> None:
        if max_streams < 1 or not 0 < stream_window <= conn_window < _MAX_CREDIT:
            raise ValueError("need max_streams >= 1 and 0 < stream_window <= conn_window < 2**31")
        self.reader, self.writer, self.line, self.connect = reader, writer, line, connect
        self.max_streams, self.stream_window, self.conn_window = max_streams, stream_window, conn_window
        self.connect_timeout, self.ping_interval, self.ping_timeout = (connect_timeout, ping_interval,
                                                                      ping_timeout)
        self.max_payload = LINE_MAX_PAYLOAD if line else MAX_PAYLOAD
        self.streams: dict[int, _Stream] = {}
        self.next_sid = 1  # relay: the next id to assign; host: the lowest id a new stream may have
        self.send_conn_credit = conn_window
        self.recv_conn_left = conn_window
        self.conn_consumed = 0
        self.dead = False
        #: Why :meth:`run` ended: None while running, else a sentence.
        self.reason: str | None = None
        #: Set when the peer broke the protocol (the reason).
        self.violation: str | None = None
        self.opened = 0
        self.last_seen = time.monotonic()
        self._drain_lock = asyncio.Lock()  # Python < 3.10 allows one drain() waiter per writer
        self._runner: asyncio.Task[Any] | None = None
        self._stopping = False

    # -- sending -------------------------------------------------------------------------------------
    def _send(self, ftype: int, sid: int, payload: bytes = b"") -> None:
        if not self.dead:
            self.writer.write(encode_frame(ftype, sid, payload, line=self.line))

    def _backlog(self) -> int:
        """Bytes queued on the channel's writer, not yet taken by the channel."""
        try:
            return int(self.writer.transport.get_write_buffer_size())
        except (AttributeError, TypeError):
            return 0

    async def _drain(self) -> None:
        async with self._drain_lock:
            await self.writer.drain()

    def _grant(self, st: _Stream | None, n: int) -> None:
        # Credit goes back in batches of a quarter window: a frame per chunk would double the frames.
        self.conn_consumed += n
        if self.conn_consumed >= self.conn_window // 4:
            self.recv_conn_left += self.conn_consumed
            self._send(WINDOW, 0, struct.pack(">I", self.conn_consumed))
            self.conn_consumed = 0
        if st is not None and st.sid in self.streams:
            st.consumed += n
            if st.consumed >= self.stream_window // 4:
                st.recv_left += st.consumed
                self._send(WINDOW, st.sid, struct.pack(">I", st.consumed))
                st.consumed = 0

    # -- streams -------------------------------------------------------------------------------------
    async def accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """The relay's listener callback: one stream per connection (closed at once over the limit)."""
        if self.dead or len(self.streams) >= self.max_streams or self.next_sid >= 2 ** 32:
            _close(writer)
            return
        st = _Stream(self.next_sid, self.stream_window)
        self.next_sid += 1
        st.reader, st.writer = reader, writer
        self.streams[st.sid] = st
        self._send(OPEN, st.sid)
        st.task = asyncio.ensure_future(self._run_stream(st))
        with contextlib.suppress(BaseException):
            await st.task

    async def _connect_stream(self, st: _Stream) -> None:
        assert self.connect is not None
        try:
            st.reader, st.writer = await asyncio.wait_for(self.connect(), self.connect_timeout)
        except (OSError, asyncio.TimeoutError):  # noqa: UP041 (Python < 3.11 inside images)
            self._reset(st, send=True)
            return
        await self._run_stream(st)

    async def _run_stream(self, st: _Stream) -> None:
        assert st.writer is not None
        with contextlib.suppress(Exception):
            st.writer.transport.set_write_buffer_limits(high=HIGH_WATER)
        up = asyncio.ensure_future(self._up(st))
        down = asyncio.ensure_future(self._down(st))
        failed = False
        try:
            done, _pending = await asyncio.wait({up, down}, return_when=asyncio.FIRST_EXCEPTION)
            failed = any(not t.cancelled() and t.exception() is not None for t in done)
        finally:
            up.cancel()
            down.cancel()
            if self.streams.get(st.sid) is st:
                self._reset(st, send=failed)

    async def _up(self, st: _Stream) -> None:
        """The stream's socket -> DATA frames, within the stream's and the channel's credit."""
        assert st.reader is not None
        while True:
            data = await st.reader.read(self.max_payload)
            if not data:
                break
            while data:
                while st.send_credit <= 0 or self.send_conn_credit <= 0:
                    st.credit.clear()
                    await st.credit.wait()
                    if self.dead:
                        return
                n = min(len(data), st.send_credit, self.send_conn_credit)
                chunk, data = data[:n], data[n:]
                st.send_credit -= n
                self.send_conn_credit -= n
                self._send(DATA, st.sid, chunk)
                await self._drain()
        self._send(FIN, st.sid)

    async def _down(self, st: _Stream) -> None:
        """DATA frames -> the stream's socket; credit is granted back once the socket took the bytes."""
        assert st.writer is not None
        while True:
            while not st.inbox and not st.fin_in:
                st.inbox_event.clear()
                await st.inbox_event.wait()
            if st.inbox:
                data = st.inbox.popleft()
                st.writer.write(data)
                await st.writer.drain()
                self._grant(st, len(data))
            else:
                if st.writer.can_write_eof():
                    st.writer.write_eof()
                return

    def _reset(self, st: _Stream, *, send: bool) -> None:
        if self.streams.get(st.sid) is st:
            del self.streams[st.sid]
            if send:
                self._send(RST, st.sid)
        pending = sum(len(b) for b in st.inbox)
        st.inbox.clear()
        if pending:
            self._grant(None, pending)  # the channel's credit comes back even for discarded bytes
        if st.writer is not None:
            _close(st.writer)
        if st.task is not None and st.task is not asyncio.current_task():
            st.task.cancel()
        st.credit.set()

    # -- receiving -----------------------------------------------------------------------------------
    def _handle(self, ftype: int, sid: int, payload: bytes) -> None:
        if ftype == PING:
            if len(payload) != 8:
                raise TunnelError(f"a ping of {len(payload)} bytes (8 expected)")
            if self._backlog() < PONG_BACKLOG:  # a peer that pings but does not read gets no more pongs
                self._send(PONG, 0, payload)
            return
        if ftype == PONG:
            return
        if ftype == WINDOW:
            if len(payload) != 4:
                raise TunnelError(f"a window frame of {len(payload)} bytes (4 expected)")
            (inc,) = struct.unpack(">I", payload)
            if inc == 0:
                raise TunnelError("a window frame granting nothing")
            if sid == 0:
                self.send_conn_credit += inc
                if self.send_conn_credit > _MAX_CREDIT:
                    raise TunnelError("the channel's credit over 2**31")
                for other in self.streams.values():
                    other.credit.set()
                return
            st = self.streams.get(sid)
            if st is not None:
                st.send_credit += inc
                if st.send_credit > _MAX_CREDIT:
                    raise TunnelError(f"stream {sid}'s credit over 2**31")
                st.credit.set()
            return
        if sid == 0:
            raise TunnelError(f"a {FRAME_NAMES[ftype]} frame on stream 0")
        if ftype == OPEN:
            if self.connect is None:
                raise TunnelError("the host opened a stream")
            if payload:
                raise TunnelError("an open frame with a payload")
            if sid < self.next_sid:
                raise TunnelError(f"stream {sid} opened again (ids only grow)")
            if len(self.streams) >= self.max_streams:
                raise TunnelError(f"more than {self.max_streams} streams open at once")
            self.next_sid = sid + 1
            self.opened += 1
            st = _Stream(sid, self.stream_window)
            self.streams[sid] = st
            st.task = asyncio.ensure_future(self._connect_stream(st))
            return
        st = self.streams.get(sid)
        if st is None:
            if sid >= self.next_sid:
                raise TunnelError(f"a {FRAME_NAMES[ftype]} frame for stream {sid}, never opened")
            if ftype == DATA and payload:
                # A stream just reset: the bytes still count against the channel's window (a peer
                # cannot send more by aiming at closed streams); dropped, and their credit granted back.
                if len(payload) > self.recv_conn_left:
                    raise TunnelError(f"{len(payload)} bytes over the channel's window")
                self.recv_conn_left -= len(payload)
                self._grant(None, len(payload))
            return
        if ftype == DATA:
            if st.fin_in:
                raise TunnelError(f"data on stream {sid} after its fin")
            n = len(payload)
            if n > st.recv_left or n > self.recv_conn_left:
                raise TunnelError(f"stream {sid} sent {n} bytes over its window")
            if n:
                st.recv_left -= n
                self.recv_conn_left -= n
                st.inbox.append(payload)
                st.inbox_event.set()
        elif ftype == FIN:
            st.fin_in = True
            st.inbox_event.set()
        elif ftype == RST:
            self._reset(st, send=False)

    async def _pinger(self) -> None:
        assert self.ping_interval is not None
        n = 0
        while not self.dead:
            await asyncio.sleep(self.ping_interval)
            if time.monotonic() - self.last_seen > self.ping_interval + self.ping_timeout:
                self._stop_run(f"no frame from the peer in {self.ping_interval + self.ping_timeout:.0f} s")
                return
            n += 1
            self._send(PING, 0, struct.pack(">Q", n))

    def _stop_run(self, reason: str) -> None:
        # A silent or closed channel may never deliver an EOF (a PTY, a hung exec): end run() itself.
        self.reason = self.reason or reason
        self._stopping = True
        if self._runner is not None and self._runner is not asyncio.current_task():
            self._runner.cancel()

    async def run(self) -> str:
        """Serve the channel until it ends; returns why (also in :attr:`reason`)."""
        self._runner = asyncio.current_task()
        pinger = asyncio.ensure_future(self._pinger()) if self.ping_interval else None
        try:
            while True:
                try:
                    if self._stopping:
                        break
                    ftype, sid, payload = await read_frame(self.reader, line=self.line)
                    self.last_seen = time.monotonic()
                    # Never wait for the writer here: both ends waiting to write while neither
                    # reads is a deadlock.  What this loop queues is bounded without it: window
                    # frames by the data received (itself bounded by credit), pongs by _handle.
                    self._handle(ftype, sid, payload)
                except asyncio.IncompleteReadError:
                    self.reason = self.reason or "the channel ended"
                    break
                except TunnelError as exc:
                    self.violation = str(exc)
                    self.reason = f"protocol violation: {exc}"
                    break
                except (OSError, RuntimeError) as exc:  # a broken pipe or socket under us
                    self.reason = self.reason or f"the channel failed: {exc or type(exc).__name__}"
                    break
                except asyncio.CancelledError:
                    if not self._stopping:  # not ours: whoever cancelled run() wants it gone
                        raise
                    break
        finally:
            self.close()
            if pinger is not None:
                pinger.cancel()
        return self.reason or "closed"

    def close(self) -> None:
        """Reset every stream (their sockets close: clients see the connection drop) and stop."""
        if self.dead:
            return
        self._stop_run("closed")
        self.dead = True
        for st in list(self.streams.values()):
            self._reset(st, send=False)


async def _stdio_channel() -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    loop = asyncio.get_running_loop()
    if os.isatty(0):
        # A PTY: no echo, no line editing, no CR/LF translation, 8-bit clean, before the marker.
        import tty

        tty.setraw(0)
    reader = asyncio.StreamReader(limit=READER_LIMIT)
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), os.fdopen(0, "rb", 0))
    # stdout may be the same tty as stdin: a separate file object, so closing one leaves the other.
    transport, protocol = await loop.connect_write_pipe(asyncio.streams.FlowControlMixin,  # type: ignore[attr-defined]
                                                        os.fdopen(os.dup(1), "wb", 0))
    writer = asyncio.StreamWriter(transport, protocol, None, loop)  # type: ignore[arg-type]
    return reader, writer


async def serve_tunnel(host: str, port: int, *, line: bool, ready_file: str | None,
                       max_connections: int) -> int:
    reader, writer = await _stdio_channel()
    mux = Mux(reader, writer, line=line, max_streams=max_connections)
    server = await asyncio.start_server(mux.accept, host, port, limit=CHUNK, reuse_address=True,
                                        family=socket.AF_INET, backlog=1024)
    if ready_file:
        _write_ready(ready_file)
    writer.write(MARKER)
    async with server:
        reason = await mux.run()  # stdin's EOF (the host went away) ends it
    sys.stderr.write(f"relay: tunnel ended: {reason}\n")
    return 0 if mux.violation is None else 2


async def _wait_for_pid(pid: int) -> None:
    loop = asyncio.get_running_loop()
    gone = loop.create_future()
    try:
        fd = os.pidfd_open(pid)  # type: ignore[attr-defined]
    except (AttributeError, OSError):
        while True:  # no pidfd: poll
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                return
            except PermissionError:
                pass
            await asyncio.sleep(0.5)
    def on_exit() -> None:
        if not gone.done():
            gone.set_result(None)

    loop.add_reader(fd, on_exit)
    try:
        await gone
    finally:
        loop.remove_reader(fd)
        os.close(fd)


async def _wait_for_stdin_eof() -> None:
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    while await reader.read(4096):
        pass


def _write_ready(path: str) -> None:
    """Our pid, written atomically: the sandbox reads it to spare the relay when killing processes."""
    tmp = path + ".tmp"
    with open(tmp, "w") as fh:
        fh.write(str(os.getpid()))
    os.replace(tmp, path)


async def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="relay TCP connections to a unix socket")
    parser.add_argument("--listen", required=True, help="HOST:PORT to listen on")
    parser.add_argument("--unix", help="the unix socket each connection is piped to")
    parser.add_argument("--tunnel", choices=("binary", "line"),
                        help="multiplex connections over stdin/stdout instead (line: base64, for "
                             "text-only channels)")
    parser.add_argument("--ready-file", help="a file written once listening")
    parser.add_argument("--watch-pid", type=int, help="exit when this process exits")
    parser.add_argument("--exit-on-stdin-eof", action="store_true", help="exit when stdin reaches EOF")
    parser.add_argument("--max-connections", type=int, default=1024)
    args = parser.parse_args(argv)
    host, _, port = args.listen.rpartition(":")
    if args.tunnel:
        return await serve_tunnel(host, int(port), line=args.tunnel == "line", ready_file=args.ready_file,
                                  max_connections=args.max_connections)
    if not args.unix:
        parser.error("one of --unix and --tunnel is required")
    relay = Relay(args.unix, max_connections=args.max_connections)
    server = await asyncio.start_server(relay.handle, host, int(port), limit=CHUNK, reuse_address=True,
                                        family=socket.AF_INET, backlog=1024)
    if args.ready_file:
        _write_ready(args.ready_file)
    sys.stdout.write("ready\n")
    sys.stdout.flush()
    waits = []
    if args.watch_pid:
        waits.append(asyncio.ensure_future(_wait_for_pid(args.watch_pid)))
    if args.exit_on_stdin_eof:
        waits.append(asyncio.ensure_future(_wait_for_stdin_eof()))
    async with server:
        if waits:
            await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        else:
            await server.serve_forever()
    return 0


if __name__ == "__main__":
    try:
        sys.exit(asyncio.run(main()))
    except KeyboardInterrupt:
        sys.exit(130)
