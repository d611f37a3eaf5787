"""How a local sandbox runs one command: a child in its own session and process group whose pipes and
exit are read through the running event loop (:class:`LocalProcess`), and the /proc checks that tell a
live process or group from a gone one."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess


class LocalProcess:
    """A child in its own session and process group, run the same way on every event loop.

    ``subprocess.Popen`` closes every inherited fd in the child (``close_fds``), which uvloop's spawn
    does not; the pipes are read and the exit is awaited through the running loop (a pidfd), so no
    thread is held per command however long it runs.

    The pipes are plain fds this object owns, read with ``add_reader`` and closed exactly once, not
    ``connect_read_pipe`` transports: uvloop closes a pipe transport's fd twice (libuv, then the file
    object), and with other threads opening fds meanwhile (``asyncio.to_thread`` file transfers,
    ``subprocess.run``) the second close hits one of theirs: a command then gets another command's
    output, none at all, or fails to start with EBADF.
    """

    def __init__(self, argv: list[str], *, cwd: str, env: dict[str, str],
                 popen_kwargs: dict[str, object]) -> None:
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        try:
            self._popen = subprocess.Popen(
                argv, stdin=subprocess.DEVNULL, stdout=out_w, stderr=err_w, cwd=cwd, env=env,
                start_new_session=True, close_fds=True, **popen_kwargs,  # type: ignore[call-overload]
            )
        except BaseException:
            os.close(out_r)
            os.close(err_r)
            raise
        finally:
            os.close(out_w)
            os.close(err_w)
        self.pid = self._popen.pid
        loop = asyncio.get_running_loop()
        self._out = PipeReader(loop, out_r)
        self._err = PipeReader(loop, err_r)
        self._exited: asyncio.Future[int] = loop.create_future()
        self._pidfd: int | None = None
        try:
            self._pidfd = os.pidfd_open(self.pid)
        except OSError:  # no pidfd (old kernel): poll for the exit instead
            self._poller = asyncio.ensure_future(self._poll_exit())
        else:
            loop.add_reader(self._pidfd, self._reap)

    @property
    def returncode(self) -> int | None:
        return self._popen.returncode

    def _reap(self) -> None:
        code = self._popen.poll()
        if code is None:
            return
        self._close_pidfd()
        if not self._exited.done():
            self._exited.set_result(code)

    async def _poll_exit(self) -> None:
        while (code := self._popen.poll()) is None:  # noqa: ASYNC110 (no event to wait on without a pidfd)
            await asyncio.sleep(0.05)
        if not self._exited.done():
            self._exited.set_result(code)

    def _close_pidfd(self) -> None:
        if self._pidfd is not None:
            with contextlib.suppress(Exception):
                asyncio.get_running_loop().remove_reader(self._pidfd)
            os.close(self._pidfd)
            self._pidfd = None

    async def communicate(self, timeout: float | None) -> tuple[bytes, bytes]:
        """Wait for the exit and the end of both pipes: ``(stdout, stderr)``; TimeoutError after
        ``timeout``."""
        async with asyncio.timeout(timeout):
            await asyncio.gather(asyncio.shield(self._exited), asyncio.shield(self._out.closed),
                                 asyncio.shield(self._err.closed))
        return bytes(self._out.data), bytes(self._err.data)

    def kill_group(self) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.pid, signal.SIGKILL)

    def abandon(self) -> tuple[bytes, bytes]:
        """Stop reading (something outside the group holds the pipes); reap the child if it has exited."""
        self._out.close()
        self._err.close()
        if self._popen.poll() is not None:
            self._close_pidfd()
        return b"", b""


class PipeReader:
    """Collects what one pipe carries, read through the running loop; ``closed`` resolves at its end
    (or when :meth:`close` stops reading). Owns the fd and closes it once."""

    def __init__(self, loop: asyncio.AbstractEventLoop, fd: int) -> None:
        self.data = bytearray()
        self.closed: asyncio.Future[None] = loop.create_future()
        self._loop = loop
        self._fd = fd
        os.set_blocking(fd, False)
        loop.add_reader(fd, self._read)

    def _read(self) -> None:
        try:
            chunk = os.read(self._fd, 1 << 16)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            chunk = b""
        if chunk:
            self.data += chunk
        else:
            self.close()

    def close(self) -> None:
        if self._fd >= 0:
            self._loop.remove_reader(self._fd)
            os.close(self._fd)
            self._fd = -1
        if not self.closed.done():
            self.closed.set_result(None)


def start_time(pid: int) -> int | None:
    """A process's start time (clock ticks since boot, field 22 of /proc/PID/stat); None when gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            return int(fh.read().rsplit(b")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None


def group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
