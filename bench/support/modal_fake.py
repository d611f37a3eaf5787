"""A stand-in for a Modal sandbox and its ``ContainerProcess`` (``text=False``), without Modal's servers.

:class:`FakeModalSandbox` is a real isolated place: a ``bwrap`` holder process with its own network
namespace (loopback only: no route anywhere), PID namespace and a tmpfs root (the host's ``/usr``,
``/etc`` and Python read-only; ``/tmp``, ``/workspace``, ``/.ares`` its own), the holder being PID 1 as
Modal's entrypoint is.  Every ``exec`` runs a real process in it (``nsenter``), and
:class:`FakeProcess` gives it the surface of ``modal.container_process.ContainerProcess``: ``stdin``
with ``write``/``write_eof`` (synchronous, buffered, at most 16 MiB between drains as in
``modal.io_streams``) and ``drain.aio``; ``stdout``/``stderr`` async iterables of bytes; ``wait.aio``,
``poll.aio`` and ``returncode``.  tests/sandbox/test_modal.py checks these names against the SDK's
classes so the stand-in cannot drift from it.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

# As modal.io_streams.TASK_COMMAND_ROUTER_MAX_BUFFER_SIZE: what stdin.write takes between drains.
MAX_BUFFER = 16 * 1024 * 1024
PY_DIR = os.path.dirname(sys.executable)
PATH = f"{PY_DIR}:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


class Aio:
    """A method of the SDK's shape: ``.aio(...)`` is the coroutine; the blocking form is not offered."""

    def __init__(self, fn: Callable[..., Awaitable[Any]]) -> None:
        self.aio = fn

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("the fake offers only the .aio form (the backend is async)")


class FakeStreamWriter:
    def __init__(self, pipe: asyncio.StreamWriter) -> None:
        self._pipe = pipe
        self._buffer = bytearray()
        self._eof = False
        self.drain = Aio(self._drain)

    def write(self, data: bytes | bytearray | memoryview) -> None:
        if self._eof:
            raise ValueError("Stdin is closed. Cannot write to it.")
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise TypeError(f"data argument must be a bytes-like object, not {type(data).__name__}")
        if len(self._buffer) + len(data) > MAX_BUFFER:
            raise BufferError("Buffer size exceed limit. Call drain to flush the buffer.")
        self._buffer += data

    def write_eof(self) -> None:
        self._eof = True

    async def _drain(self) -> None:
        data, self._buffer = bytes(self._buffer), bytearray()
        if self._pipe.is_closing():
            return  # the process has exited and reads no more input: drop it
        if data:
            self._pipe.write(data)
            try:
                await self._pipe.drain()
            except (BrokenPipeError, ConnectionResetError):
                return
        if self._eof and self._pipe.can_write_eof() and not self._pipe.is_closing():
            self._pipe.close()


class FakeStreamReader:
    def __init__(self, pipe: asyncio.StreamReader, fd: int) -> None:
        self._pipe = pipe
        self.file_descriptor = fd
        self.read = Aio(self._read)

    async def _read(self) -> bytes:
        return await self._pipe.read()

    def __aiter__(self) -> AsyncIterator[bytes]:
        return self._chunks()

    async def _chunks(self) -> AsyncIterator[bytes]:
        while chunk := await self._pipe.read(65536):
            yield chunk


class FakeProcess:
    """One process in the fake sandbox, shaped as ``ContainerProcess[bytes]``."""

    def __init__(self, proc: asyncio.subprocess.Process) -> None:
        assert proc.stdin is not None and proc.stdout is not None and proc.stderr is not None
        self._proc = proc
        self._returncode: int | None = None
        self.stdin = FakeStreamWriter(proc.stdin)
        self.stdout = FakeStreamReader(proc.stdout, 1)
        self.stderr = FakeStreamReader(proc.stderr, 2)
        self.wait = Aio(self._wait)
        self.poll = Aio(self._poll)

    @property
    def returncode(self) -> int:
        if self._returncode is None:
            raise RuntimeError("You must call wait() before accessing the returncode.")
        return self._returncode

    async def _wait(self) -> int:
        code = await self._proc.wait()
        self._returncode = 128 - code if code < 0 else code  # a signal: 128 + n, as Modal reports it
        return self._returncode

    async def _poll(self) -> int | None:
        if self._proc.returncode is None:
            return None
        return await self._wait()


def _comm(pid: int) -> str:
    return Path(f"/proc/{pid}/comm").read_text().strip()


def _children(pid: int) -> list[str]:
    return Path(f"/proc/{pid}/task/{pid}/children").read_text().split()


_CLOSE_FDS = 'for fd in $(ls /proc/$$/fd); do [ "$fd" -gt 2 ] && eval "exec $fd>&-"; done; exec "$@"'


def bwrap_usable() -> str | None:
    """Why the fake cannot run here, or None."""
    if shutil.which("bwrap") is None or shutil.which("nsenter") is None:
        return "needs bubblewrap and nsenter"
    if os.geteuid() != 0:
        return "the fake Modal sandbox enters its namespaces with nsenter, which needs root"
    return None


class FakeModalSandbox:
    """A ``modal.Sandbox`` stand-in: ``exec.aio``, ``terminate.aio``, ``object_id``."""

    def __init__(self) -> None:
        self.object_id = f"sb-fake-{os.urandom(4).hex()}"
        self._holder: asyncio.subprocess.Process | None = None
        self.pid = 0
        self.exec = Aio(self._exec)
        self.terminate = Aio(self._terminate)
        self.execs = 0
        self._procs: list[asyncio.subprocess.Process] = []

    async def start(self) -> None:
        argv = ["bwrap", "--unshare-net", "--unshare-pid", "--as-pid-1", "--die-with-parent",
                "--ro-bind", "/usr", "/usr", "--ro-bind", "/etc", "/etc", "--ro-bind",
                PY_DIR.rsplit("/bin", 1)[0], PY_DIR.rsplit("/bin", 1)[0], "--symlink", "usr/bin", "/bin",
                "--symlink", "usr/lib", "/lib", "--symlink", "usr/lib64", "/lib64", "--symlink", "usr/sbin",
                "/sbin", "--proc", "/proc", "--dev", "/dev", "--tmpfs", "/tmp", "--dir", "/workspace",
                "--chdir", "/", "sleep", "infinity"]
        self._holder = await asyncio.create_subprocess_exec(*argv, stdin=asyncio.subprocess.DEVNULL,
                                                            start_new_session=True)
        # bwrap forks once more to enter the namespaces: the holder is its child (PID 1 inside).
        for _ in range(200):
            with contextlib.suppress(OSError, ValueError):
                kids = _children(self._holder.pid)
                # Ready once the child exec'd the holder (its mounts and namespaces are all set up).
                if kids and _comm(int(kids[0])) == "sleep":
                    self.pid = int(kids[0])
                    return
            await asyncio.sleep(0.02)
        raise RuntimeError("the fake Modal sandbox did not start")

    async def spawn(self, args: list[str] | tuple[str, ...], env: dict[str, str] | None = None,
                    workdir: str | None = None) -> asyncio.subprocess.Process:
        """A real process in the sandbox on pipes (what both stand-ins' execs run)."""
        if not self.pid:
            raise RuntimeError("the sandbox is not running")
        self.execs += 1
        environ = [f"{k}={v}" for k, v in {"PATH": PATH, "HOME": "/root", **(env or {})}.items()]
        if workdir:  # nsenter's --wd=DIR is looked up on the host: change directory inside instead
            args = ("/bin/sh", "-c", 'cd "$0" && exec "$@"', workdir, *args)
        # -w: the holder's directory, "/" inside (a bare -r would keep ours, which is not there).
        # _CLOSE_FDS: uvloop's spawn leaves copies of the pipes at high descriptors; a daemon the
        # command leaves behind would hold them, and the output would never end (Modal's would).
        argv = ["nsenter", "-t", str(self.pid), "-n", "-m", "-p", "-r", "-w", "--", "/bin/bash", "-c",
                _CLOSE_FDS, "ares-fake", "env", "-i", *environ, *args]
        proc = await asyncio.create_subprocess_exec(*argv, stdin=asyncio.subprocess.PIPE,
                                                    stdout=asyncio.subprocess.PIPE,
                                                    stderr=asyncio.subprocess.PIPE,
                                                    start_new_session=True)
        self._procs.append(proc)
        return proc

    async def _exec(self, *args: str, env: dict[str, str] | None = None, timeout: int | None = None,
                    workdir: str | None = None, text: bool = True, **_: Any) -> FakeProcess:
        if text:
            raise AssertionError("the backend must exec with text=False")
        return FakeProcess(await self.spawn(args, env, workdir))

    async def _terminate(self) -> None:
        if self._holder is not None and self._holder.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self._holder.pid, signal.SIGKILL)
            await self._holder.wait()
        self.pid = 0
        # Every process died with the namespace; read their pipes to EOF so that their transports
        # close on this loop (one whose reader stopped reading would otherwise outlive it).
        procs, self._procs = self._procs, []
        for proc in procs:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            for pipe in (proc.stdout, proc.stderr):
                with contextlib.suppress(Exception):
                    while pipe is not None and not pipe.at_eof():
                        if not await asyncio.wait_for(pipe.read(1 << 20), 2):
                            break
            if proc.stdin is not None:
                proc.stdin.close()
            await proc.wait()
