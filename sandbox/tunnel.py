"""The host's end of the exec tunnel: a sandbox's agent HTTP over the channel that runs its commands.

A sandbox with no network and no bind-mounted socket (a remote one, or Docker with ``tunnel="exec"``)
runs ``_relay.py --tunnel`` on a long-lived exec/PTY/pipe: the relay listens on the sandbox's
``127.0.0.1:PORT`` and carries each accepted connection as one stream over its stdin/stdout.  A
:class:`Tunnel` serves that channel here: every stream the relay opens is connected to ``unix_path``
(the session's agent socket) and to nothing else, whatever a frame says; the frame format and limits
are in docs/sandbox.md ("The exec tunnel").

Channels (``open_channel`` returns a fresh :class:`Channel` each time):

* :func:`pipe_channel`: a local process's stdin/stdout (the local backend, tests);
* :func:`pty_channel`: a local process on a PTY (what SSH and PTY-only SDKs give; shell noise before
  the relay's marker is skipped);
* :func:`docker_exec_channel`: ``docker exec`` attached over the engine's socket (stdout and stderr
  arrive multiplexed in 8-byte-header frames, demultiplexed here).

A channel that drops (EOF, error, no frame within the ping deadline) resets its streams (their
clients see the connection close, and agent SDKs retry) and is opened again after a backoff.  A
protocol violation tears the channel down for good: only the relay (root in the sandbox) writes it,
so a violation means the sandbox is not to be trusted with another one.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import logging
import os
import pty
import signal
import socket
import struct
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from ._relay import CONN_WINDOW, MARKER, READER_LIMIT, STREAM_WINDOW, Mux, TunnelError

log = logging.getLogger(__name__)

__all__ = ["Channel", "Tunnel", "TunnelError", "docker_exec_channel", "pipe_channel", "pty_channel"]


@dataclass
class Channel:
    """One opened byte channel to a relay: frames are read from ``reader`` and written to ``writer``."""

    reader: asyncio.StreamReader
    writer: Any  # an asyncio.StreamWriter (write, drain, close)
    close: Callable[[], Awaitable[None]]
    description: str = "channel"
    #: What the channel's other output said (stderr), kept bounded for error messages.
    stderr: bytearray = field(default_factory=bytearray)


class Tunnel:
    """Serve a relay's streams, over channels from ``open_channel``, to the unix socket ``unix_path``.

    ``await start()`` opens the first channel and returns once the relay's marker arrived (the port
    is listening inside); ``await close()`` ends it.  Limits: ``max_streams`` streams at once,
    ``stream_window``/``conn_window`` bytes in flight per stream/in all, ``max_noise`` bytes before the
    marker, ``start_timeout`` for the marker, ``connect_timeout`` per unix connection, a ping every
    ``ping_interval`` s (a channel silent for ``ping_interval + ping_timeout`` is dropped).  A dropped
    channel is reopened after ``reopen_delay`` (doubling to ``max_reopen_delay`` while reopening fails;
    after ``max_reopen_failures`` failures in a row the tunnel gives up: the sandbox is gone).
    """

    def __init__(
        self,
        open_channel: Callable[[], Awaitable[Channel]],
        unix_path: str,
        *,
        line: bool = False,
        max_streams: int = 256,
        stream_window: int = STREAM_WINDOW,
        conn_window: int = CONN_WINDOW,
        start_timeout: float = 30.0,
        connect_timeout: float = 10.0,
        ping_interval: float = 15.0,
        ping_timeout: float = 15.0,
        reopen_delay: float = 0.05,
        max_reopen_delay: float = 5.0,
        max_reopen_failures: int = 8,
    ) -> None:
        if max_streams < 1 or start_timeout <= 0 or ping_interval <= 0 or reopen_delay <= 0:
            raise ValueError("max_streams, start_timeout, ping_interval and reopen_delay must be positive")
        self.open_channel, self.unix_path, self.line = open_channel, unix_path, line
        self.max_streams, self.stream_window, self.conn_window = max_streams, stream_window, conn_window
        self.start_timeout, self.connect_timeout = start_timeout, connect_timeout
        self.ping_interval, self.ping_timeout = ping_interval, ping_timeout
        self.reopen_delay, self.max_reopen_delay = reopen_delay, max_reopen_delay
        self.max_reopen_failures = max_reopen_failures
        #: Channels opened so far (1 after start; each reopen adds one).
        self.channels_opened = 0
        #: Why the last channel ended; the protocol violation that ended the tunnel, if one did.
        self.last_reason: str | None = None
        self.violation: str | None = None
        self.mux: Mux | None = None
        self._channel: Channel | None = None
        self._task: asyncio.Task[None] | None = None
        self._closed = False

    @property
    def running(self) -> bool:
        return self._task is not None and not self._task.done()

    async def _connect(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        # The only place a stream goes: nothing in a frame names a target.
        return await asyncio.open_unix_connection(self.unix_path, limit=READER_LIMIT)

    async def _open(self) -> tuple[Channel, Mux]:
        channel = await self.open_channel()
        try:
            try:
                await asyncio.wait_for(channel.reader.readuntil(MARKER), self.start_timeout)
            except asyncio.LimitOverrunError as exc:
                raise TunnelError(
                    f"no tunnel marker in the first {READER_LIMIT} bytes of {channel.description}") from exc
            except (TimeoutError, asyncio.IncompleteReadError, OSError) as exc:
                what = "timed out" if isinstance(exc, asyncio.TimeoutError) else "ended"
                said = bytes(channel.stderr[-500:]).decode(errors="replace").strip()
                raise TunnelError(f"{channel.description} {what} before the relay's marker"
                                  + (f": {said}" if said else "")) from exc
        except BaseException:
            await channel.close()
            raise
        mux = Mux(channel.reader, channel.writer, line=self.line, connect=self._connect,
                  max_streams=self.max_streams, stream_window=self.stream_window,
                  conn_window=self.conn_window, connect_timeout=self.connect_timeout,
                  ping_interval=self.ping_interval, ping_timeout=self.ping_timeout)
        self.channels_opened += 1
        return channel, mux

    async def start(self) -> None:
        """Open the first channel; raises :class:`TunnelError` when the relay does not come up."""
        if self._task is not None:
            return
        self._channel, self.mux = await self._open()
        self._task = asyncio.ensure_future(self._serve())

    async def _serve(self) -> None:
        delay = self.reopen_delay
        while not self._closed:
            assert self._channel is not None and self.mux is not None
            reason = self.last_reason = await self.mux.run()
            with contextlib.suppress(Exception):  # closing a broken channel must not end the tunnel
                await self._channel.close()
            if self.mux.violation is not None:
                self.violation = self.mux.violation
                log.warning("tunnel to %s torn down: %s", self.unix_path, reason)
                return
            if self._closed:
                return
            log.info("tunnel to %s: %s; reopening", self.unix_path, reason)
            failures = 0
            while not self._closed:
                await asyncio.sleep(delay)
                try:
                    self._channel, self.mux = await self._open()
                    delay = self.reopen_delay
                    break
                except Exception as exc:  # any failure to reopen (the SDK's own errors too) is retried
                    self.last_reason = f"reopening failed: {exc}"
                    delay = min(delay * 2, self.max_reopen_delay)
                    failures += 1
                    if failures >= self.max_reopen_failures:
                        log.warning("tunnel to %s: giving up after %d failed reopens: %s", self.unix_path,
                                    failures, exc)
                        return

    async def close(self) -> None:
        self._closed = True
        if self.mux is not None:
            self.mux.close()
        if self._channel is not None:
            await self._channel.close()
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(BaseException):
                await self._task

    async def wait(self) -> None:
        """Until the tunnel ends for good (closed, torn down after a violation, or given up)."""
        if self._task is not None:
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.shield(self._task)

    async def drop(self) -> None:
        """Close the current channel as if the transport dropped (tests; the tunnel reopens)."""
        if self._channel is not None:
            await self._channel.close()


# -- channels --------------------------------------------------------------------------------------

async def _collect(stream: asyncio.StreamReader | None, into: bytearray, cap: int = 64 * 1024) -> None:
    if stream is None:
        return
    with contextlib.suppress(Exception):
        while chunk := await stream.read(65536):
            into += chunk
            del into[:-cap]


async def pipe_channel(argv: list[str], *, env: dict[str, str] | None = None,
                       exit_timeout: float = 5.0) -> Channel:
    """``argv`` (a relay in tunnel mode, possibly inside a sandbox's command) on pipes.  Closing it
    closes the process's stdin and gives it ``exit_timeout`` s to exit before killing its group."""
    proc = await asyncio.create_subprocess_exec(
        *argv, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        env=env, limit=READER_LIMIT, start_new_session=True,
    )
    assert proc.stdin is not None and proc.stdout is not None
    stderr = bytearray()
    drain_err = asyncio.ensure_future(_collect(proc.stderr, stderr))

    async def close() -> None:
        with contextlib.suppress(Exception):
            proc.stdin.close()  # type: ignore[union-attr]
        try:
            await asyncio.wait_for(proc.wait(), exit_timeout)  # the relay exits on its stdin's EOF
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            await proc.wait()
        drain_err.cancel()

    return Channel(proc.stdout, proc.stdin, close, f"pipe to {argv[0]} (pid {proc.pid})", stderr)


class ReaderFlow:
    """A StreamReader's transport for a channel fed by a pump: the reader calls ``pause_reading`` when
    it holds too much and ``resume_reading`` once it was read down; the pump waits on :attr:`resumed`
    (backpressure instead of an unbounded buffer), and ``on_pause`` / ``on_resume`` pass the calls on."""

    def __init__(self, on_pause: Callable[[], None] | None = None,
                 on_resume: Callable[[], None] | None = None) -> None:
        self.resumed = asyncio.Event()
        self.resumed.set()
        self.on_pause, self.on_resume = on_pause, on_resume

    def pause_reading(self) -> None:
        self.resumed.clear()
        if self.on_pause is not None:
            self.on_pause()

    def resume_reading(self) -> None:
        self.resumed.set()
        if self.on_resume is not None:
            self.on_resume()


class _FdReading:
    """Reads a non-blocking descriptor into a StreamReader with the loop's reader callbacks; the reader
    pauses it (``pause_reading``) when it holds too much.  For a PTY master: uvloop's pipe transports
    do not read character devices."""

    def __init__(self, fd: int, reader: asyncio.StreamReader) -> None:
        self.fd, self.reader, self.loop = fd, reader, asyncio.get_running_loop()
        self.reading = False
        reader.set_transport(self)  # type: ignore[arg-type]
        self.resume_reading()

    def _ready(self) -> None:
        try:
            data = os.read(self.fd, 65536)
        except BlockingIOError:
            return
        except OSError:  # EIO: the PTY's other side is gone
            data = b""
        if data:
            self.reader.feed_data(data)
        else:
            self.pause_reading()
            self.reader.feed_eof()

    def pause_reading(self) -> None:
        if self.reading:
            self.loop.remove_reader(self.fd)
            self.reading = False

    def resume_reading(self) -> None:
        if not self.reading and not self.reader.at_eof():
            self.loop.add_reader(self.fd, self._ready)
            self.reading = True


class _FdWriter:
    """The writing half: what the descriptor does not take at once waits for the loop's writable
    callback; ``drain()`` waits while more than ``high_water`` bytes wait."""

    def __init__(self, fd: int, high_water: int = 256 * 1024) -> None:
        self.fd, self.high_water, self.loop = fd, high_water, asyncio.get_running_loop()
        self.buf = bytearray()
        self.error: OSError | None = None
        self.closed = False
        self._drained = asyncio.Event()
        self._drained.set()

    def write(self, data: bytes) -> None:
        if self.closed or self.error is not None:
            return
        if not self.buf:
            try:
                data = data[os.write(self.fd, data):]
            except BlockingIOError:
                pass
            except OSError as exc:
                self.error = exc
                return
            if not data:
                return
            self.loop.add_writer(self.fd, self._ready)
        self.buf += data
        if len(self.buf) > self.high_water:
            self._drained.clear()

    def _ready(self) -> None:
        try:
            del self.buf[:os.write(self.fd, self.buf)]
        except BlockingIOError:
            return
        except OSError as exc:
            self.error = exc
            self.buf.clear()
        if not self.buf:
            self.loop.remove_writer(self.fd)
        if len(self.buf) <= self.high_water:
            self._drained.set()

    @property
    def transport(self) -> _FdWriter:  # what Mux asks for the write backlog
        return self

    def get_write_buffer_size(self) -> int:
        return len(self.buf)

    async def drain(self) -> None:
        if self.error is not None:
            raise self.error
        if self.closed:
            raise ConnectionResetError("the channel is closed")
        await self._drained.wait()
        if self.error is not None:
            raise self.error

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            if self.buf:
                self.loop.remove_writer(self.fd)
            self._drained.set()


async def pty_channel(argv: list[str], *, env: dict[str, str] | None = None) -> Channel:
    """``argv`` on a new PTY (its stdin, stdout and stderr), e.g. a login shell that then runs the relay."""
    pid, master = pty.fork()
    if pid == 0:  # the child: only exec (or _exit) here
        try:
            if env is None:
                os.execvp(argv[0], argv)
            else:
                os.execvpe(argv[0], argv, env)
        finally:
            os._exit(127)
    os.set_blocking(master, False)
    reader = asyncio.StreamReader(limit=READER_LIMIT)
    reading = _FdReading(master, reader)
    writer = _FdWriter(master)

    closed: list[bool] = []

    async def close() -> None:  # idempotent: drop() and the tunnel may both close a channel
        if closed:
            return
        closed.append(True)
        writer.close()
        reading.pause_reading()
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)  # a PTY has no stdin EOF to give; hang up for good
        os.close(master)
        if not reader.at_eof():
            reader.feed_eof()
        with contextlib.suppress(ChildProcessError):
            await asyncio.to_thread(os.waitpid, pid, 0)

    return Channel(reader, writer, close, f"pty to {argv[0]} (pid {pid})")


class _DockerDemux(asyncio.streams.FlowControlMixin, asyncio.Protocol):  # type: ignore[name-defined,misc]
    """The attached socket of a ``tty=False`` exec: 8-byte headers (stream, 0, 0, 0, size) then data;
    stdout (1) feeds the tunnel's reader, stderr (2) a bounded buffer.  The reader pauses the socket
    when it holds too much (the same backpressure as asyncio's own streams)."""

    def __init__(self, out: asyncio.StreamReader, err: bytearray, err_cap: int = 64 * 1024) -> None:
        super().__init__()
        self.out, self.err, self.err_cap = out, err, err_cap
        self.buf = bytearray()
        self.kind = 0
        self.left = 0
        #: Done once the engine closed the attach (the exec ended) or we did.
        self.closed: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.out.set_transport(transport)  # type: ignore[arg-type]

    def data_received(self, data: bytes) -> None:
        mv = memoryview(data)
        while mv:
            if self.left:
                n = min(self.left, len(mv))
                part, mv = mv[:n], mv[n:]
                self.left -= n
                if self.kind == 1:
                    self.out.feed_data(bytes(part))
                elif self.kind == 2:
                    self.err += part
                    del self.err[:-self.err_cap]
                continue
            need = 8 - len(self.buf)
            self.buf += mv[:need]
            mv = mv[need:]
            if len(self.buf) == 8:
                self.kind, self.left = self.buf[0], struct.unpack(">I", self.buf[4:8])[0]
                self.buf.clear()

    def eof_received(self) -> bool:
        self.out.feed_eof()
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        if exc is None:
            self.out.feed_eof()
        else:
            self.out.set_exception(exc)
        if not self.closed.done():
            self.closed.set_result(None)
        super().connection_lost(exc)


async def docker_exec_channel(
    container: str, argv: list[str], *, user: str = "root", api: Any = None, exit_timeout: float = 2.0
) -> Channel:
    """``argv`` run by ``docker exec`` (stdin attached, no TTY) in ``container``, over the engine's socket.
    Closing it half-closes the socket (the process's stdin ends) and waits ``exit_timeout`` s for the
    engine to end the attach before closing it."""
    # By name: the repository's own docker/ directory (Dockerfiles) would shadow the SDK for type checkers.
    docker = importlib.import_module("docker")
    owned = api is None
    if api is None:
        api = docker.from_env(timeout=30).api  # DOCKER_HOST or the default socket

    def attach() -> socket.socket:
        exec_id = api.exec_create(container, argv, stdin=True, stdout=True, stderr=True, tty=False, user=user,
                                  workdir="/")["Id"]
        sock = api.exec_start(exec_id, socket=True)
        raw = getattr(sock, "_sock", sock)
        # Our own descriptor: asyncio owns it from here, the SDK's response object can go.
        dup = socket.socket(raw.family, raw.type, fileno=os.dup(raw.fileno()))
        sock.close()
        return dup

    sock = await asyncio.to_thread(attach)
    if owned:
        api.close()
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader(limit=READER_LIMIT)
    stderr = bytearray()
    transport, protocol = await loop.create_connection(lambda: _DockerDemux(reader, stderr), sock=sock)
    writer = asyncio.StreamWriter(transport, protocol, None, loop)

    closed: list[bool] = []

    async def close() -> None:
        if closed:
            return
        closed.append(True)
        # Only a half-close ends the exec's stdin (the engine keeps it open when the socket just
        # closes), and the relay exits on that EOF; the engine then ends the attach.
        with contextlib.suppress(Exception):
            if writer.can_write_eof():
                writer.write_eof()
            await asyncio.wait_for(asyncio.shield(protocol.closed), exit_timeout)
        writer.close()

    return Channel(reader, writer, close, f"docker exec in {container[:12]}", stderr)
