"""Tunnel channels for Daytona: a toolbox PTY session (the SDK's WebSocket) or an SSH exec channel.

Both turn what the transport gives into a :class:`sandbox.tunnel.Channel` (an ``asyncio.StreamReader``
fed with what the far end prints, a writer with ``write``/``drain``/``close`` and a write backlog):

* :func:`daytona_pty_channel`: ``sandbox.process.create_pty_session`` of the ``daytona`` SDK.  The
  daemon sends the PTY's output as binary WebSocket messages and writes every inbound message (at most
  64 KiB: its read limit) to the PTY.  It queues at most 256 messages per client and drops a client
  whose queue is full, so the reader here never blocks the SDK for long: what it buffers is bounded by
  the tunnel's own credit windows (and by ``max_buffer``, past which the SDK's receive loop waits).
* :func:`ssh_exec_channel`: an ``asyncssh`` exec channel (no PTY): binary-clean, flow-controlled by
  SSH's channel windows both ways, stderr kept apart.  Daytona's SSH gateway authenticates the access
  token as the user name.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import shlex
from collections.abc import Awaitable, Callable
from typing import Any

from ._relay import READER_LIMIT
from .tunnel import Channel, ReaderFlow

#: The daemon's read limit for one inbound WebSocket message (gorilla ``SetReadLimit``).
MAX_WS_MESSAGE = 64 * 1024


class _QueuedWriter:
    """A writer whose bytes a sender task hands to ``send`` in pieces of at most ``max_message``;
    ``drain()`` waits while more than ``high_water`` bytes wait.  A failed send ends the writer (and
    calls ``on_error``): the tunnel sees the channel fail and reopens it."""

    def __init__(self, send: Callable[[bytes], Awaitable[None]], *, max_message: int = MAX_WS_MESSAGE,
                 high_water: int = 256 * 1024,
                 on_error: Callable[[BaseException], None] | None = None) -> None:
        if max_message < 1:
            raise ValueError("max_message must be positive")
        self.send, self.max_message, self.high_water, self.on_error = send, max_message, high_water, on_error
        self.buf = bytearray()
        self.error: BaseException | None = None
        self.closed = False
        self._wake = asyncio.Event()
        self._drained = asyncio.Event()
        self._drained.set()
        self._task = asyncio.ensure_future(self._run())

    def write(self, data: bytes) -> None:
        if self.closed or self.error is not None or not data:
            return
        self.buf += data
        self._wake.set()
        if len(self.buf) > self.high_water:
            self._drained.clear()

    async def _run(self) -> None:
        try:
            while True:
                await self._wake.wait()
                self._wake.clear()
                while self.buf:
                    piece = bytes(self.buf[:self.max_message])
                    del self.buf[:len(piece)]
                    if len(self.buf) <= self.high_water:
                        self._drained.set()
                    await self.send(piece)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            self.error = exc
            self.buf.clear()
            self._drained.set()
            if self.on_error is not None:
                self.on_error(exc)

    @property
    def transport(self) -> _QueuedWriter:  # what the Mux asks for the write backlog
        return self

    def get_write_buffer_size(self) -> int:
        return len(self.buf)

    async def drain(self) -> None:
        if self.error is not None:
            raise ConnectionResetError(f"the channel failed: {self.error}")
        if self.closed:
            raise ConnectionResetError("the channel is closed")
        await self._drained.wait()
        if self.error is not None:
            raise ConnectionResetError(f"the channel failed: {self.error}")

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self._task.cancel()
            self._drained.set()


async def daytona_pty_channel(
    process: Any,
    command: str,
    *,
    session_id: str,
    max_message: int = MAX_WS_MESSAGE,
    max_buffer: int = 8 * 1024 * 1024,
    kill_timeout: float = 10.0,
) -> Channel:
    """``command`` in a new toolbox PTY session of a Daytona sandbox (``process``: an ``AsyncProcess``).

    The session starts the sandbox's interactive login shell; the line sent to it first puts the PTY in
    raw mode (``stty raw -echo``: no echo, no line editing, no CR/LF translation, 8-bit clean), then
    ``exec``s ``command``; whatever the shell printed before the relay's marker is skipped by the tunnel.
    Inbound messages are at most ``max_message`` bytes; past ``max_buffer`` unread bytes the SDK's
    receive loop waits (the Mux reads continuously, so only a peer sending over its window gets there).
    Closing it kills the session (the daemon kills the PTY's process tree) and closes the WebSocket.
    """
    reader = asyncio.StreamReader(limit=READER_LIMIT)
    flow = ReaderFlow()
    # The reader's own pause threshold (2 * limit) is far below one credit window: it waits only at
    # max_buffer.  Tracking the size ourselves keeps StreamReader's internals out of it.
    reader.set_transport(flow)  # type: ignore[arg-type]
    held = [0]

    async def on_data(data: bytes) -> None:
        if reader.at_eof():
            return
        reader.feed_data(data)
        held[0] += len(data)
        if held[0] > max_buffer:
            await flow.resumed.wait()
            held[0] = 0

    handle = await process.create_pty_session(id=session_id, on_data=on_data)
    ended = asyncio.ensure_future(handle.wait())
    said = bytearray()  # why the session ended, for the tunnel's messages (a PTY has no stderr)

    def eof(_: object = None) -> None:
        if not reader.at_eof():
            reader.feed_eof()

    def on_end(_: object) -> None:
        if handle.exit_code is not None or handle.error:
            said.extend((f"the PTY session ended (exit code {handle.exit_code}: "
                         f"{handle.error or 'no error'})").encode())
        eof()

    ended.add_done_callback(on_end)
    writer = _QueuedWriter(handle.send_input, max_message=max_message, on_error=eof)
    writer.write(f"stty raw -echo 2>/dev/null; exec {command}\n".encode())

    closed: list[bool] = []

    async def close() -> None:  # idempotent: drop() and the tunnel may both close a channel
        if closed:
            return
        closed.append(True)
        writer.close()
        eof()  # from here on what still arrives is dropped, not buffered
        with contextlib.suppress(Exception):
            await asyncio.wait_for(process.kill_pty_session(session_id), kill_timeout)
        with contextlib.suppress(Exception):
            await handle.disconnect()
        ended.cancel()
        flow.resume_reading()

    return Channel(reader, writer, close, f"daytona pty session {session_id}", said)


class _SSHSession:
    """An asyncssh client session feeding a StreamReader (stdout) and a bounded buffer (stderr)."""

    def __init__(self, reader: asyncio.StreamReader, stderr: bytearray, err_cap: int = 64 * 1024) -> None:
        self.reader, self.stderr, self.err_cap = reader, stderr, err_cap
        self.chan: Any = None
        self.writable = asyncio.Event()
        self.writable.set()
        self.closed: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    def connection_made(self, chan: Any) -> None:
        self.chan = chan
        # The reader pauses the channel when it holds too much: SSH's window does the rest.
        self.reader.set_transport(ReaderFlow(chan.pause_reading, chan.resume_reading))  # type: ignore[arg-type]

    def session_started(self) -> None:
        return None

    def data_received(self, data: bytes, datatype: int | None) -> None:
        if datatype is None:
            self.reader.feed_data(data)
        else:
            self.stderr += data
            del self.stderr[:-self.err_cap]

    def eof_received(self) -> bool:
        self.reader.feed_eof()
        return False

    def exit_status_received(self, status: int) -> None:
        return None

    def exit_signal_received(self, signal: str, core_dumped: bool, msg: str, lang: str) -> None:
        return None

    def pause_writing(self) -> None:
        self.writable.clear()

    def resume_writing(self) -> None:
        self.writable.set()

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.reader.at_eof():
            if exc is None:
                self.reader.feed_eof()
            else:
                self.reader.set_exception(exc)
        self.writable.set()
        if not self.closed.done():
            self.closed.set_result(None)


class _SSHWriter:
    def __init__(self, session: _SSHSession) -> None:
        self.session = session
        self.closed = False

    def write(self, data: bytes) -> None:
        if not self.closed and self.session.chan is not None and not self.session.closed.done():
            self.session.chan.write(data)

    @property
    def transport(self) -> _SSHWriter:
        return self

    def get_write_buffer_size(self) -> int:
        chan = self.session.chan
        return int(chan.get_write_buffer_size()) if chan is not None else 0

    async def drain(self) -> None:
        if self.closed or self.session.closed.done():
            raise ConnectionResetError("the SSH channel is closed")
        await self.session.writable.wait()
        if self.session.closed.done():
            raise ConnectionResetError("the SSH channel is closed")

    def close(self) -> None:
        self.closed = True


class _Redact(logging.Filter):
    """Blanks the access tokens (asyncssh logs the user name, which is the token) out of asyncssh's log."""

    def __init__(self) -> None:
        super().__init__()
        self.secrets: set[str] = set()

    def filter(self, record: logging.LogRecord) -> bool:
        if self.secrets:
            text = record.getMessage()
            if any(secret in text for secret in self.secrets):
                for secret in self.secrets:
                    text = text.replace(secret, "<token>")
                record.msg, record.args = text, ()
        return True


_redact = _Redact()
logging.getLogger("asyncssh").addFilter(_redact)


def parse_ssh_command(ssh_command: str) -> tuple[str, int, str]:
    """``(host, port, user)`` from Daytona's ``sshCommand`` (``ssh [-p PORT] TOKEN@HOST``).  The error
    never repeats the command: its user is the access token."""
    try:
        words = shlex.split(ssh_command)
    except ValueError:
        words = []
    port, target = 22, None
    i = 1 if words[:1] == ["ssh"] else len(words)
    while i < len(words):
        word = words[i]
        if word == "-p" and i + 1 < len(words) and words[i + 1].isdigit():
            port, i = int(words[i + 1]), i + 2
            continue
        if word.startswith("-p") and word[2:].isdigit():
            port = int(word[2:])
        elif not word.startswith("-") and "@" in word:
            target = word
        i += 1
    if target is None or not 0 < port < 65536:
        raise ValueError("Daytona's SSH command is not of the form 'ssh [-p PORT] TOKEN@HOST'")
    user, _, host = target.rpartition("@")
    return host, port, user


async def ssh_exec_channel(
    host: str,
    port: int,
    username: str,
    command: str,
    *,
    known_hosts: Any = None,
    connect_timeout: float = 30.0,
    keepalive_interval: float = 30.0,
    exit_timeout: float = 5.0,
) -> Channel:
    """``command`` on an SSH exec channel (no PTY) of a new connection to ``host:port`` as ``username``.

    No key, agent or password is offered: Daytona's gateway authenticates the access token given as
    the user name.  ``known_hosts`` is asyncssh's (None: the server's host key is not checked; pass a
    known_hosts file to pin the gateway's key).  Closing it sends EOF (the relay exits on its stdin's
    EOF), waits ``exit_timeout`` s for the channel to close, then closes the connection.
    """
    import asyncssh

    _redact.secrets.add(username)
    conn = await asyncssh.connect(
        host, port, username=username, known_hosts=known_hosts, client_keys=None, agent_path=None,
        password=None, kbdint_auth=False, gss_host=None, preferred_auth="none,publickey,keyboard-interactive",
        connect_timeout=connect_timeout, keepalive_interval=keepalive_interval, keepalive_count_max=3,
        request_pty=False, x11_forwarding=False, agent_forwarding=False,
    )
    reader = asyncio.StreamReader(limit=READER_LIMIT)
    stderr = bytearray()
    session = _SSHSession(reader, stderr)
    factory: Any = lambda: session  # noqa: E731 - asyncssh's protocol, duck-typed (asyncssh is imported lazily)
    try:
        await conn.create_session(factory, command, encoding=None, request_pty=False)
    except BaseException:
        conn.close()
        raise
    writer = _SSHWriter(session)

    closed: list[bool] = []

    async def close() -> None:
        if closed:
            return
        closed.append(True)
        writer.close()
        with contextlib.suppress(Exception):
            session.chan.write_eof()
            await asyncio.wait_for(asyncio.shield(session.closed), exit_timeout)
        with contextlib.suppress(Exception):
            session.chan.close()
        conn.close()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(conn.wait_closed(), exit_timeout)

    return Channel(reader, writer, close, f"ssh exec channel to {host}:{port}", stderr)
