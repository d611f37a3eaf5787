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
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import socket
import sys

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
    parser.add_argument("--unix", required=True, help="the unix socket each connection is piped to")
    parser.add_argument("--ready-file", help="a file written once listening")
    parser.add_argument("--watch-pid", type=int, help="exit when this process exits")
    parser.add_argument("--exit-on-stdin-eof", action="store_true", help="exit when stdin reaches EOF")
    parser.add_argument("--max-connections", type=int, default=1024)
    args = parser.parse_args(argv)
    host, _, port = args.listen.rpartition(":")
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
