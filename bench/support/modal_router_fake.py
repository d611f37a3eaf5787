"""Modal's exec path with the real SDK end to end, but for the worker: a stand-in ``TaskCommandRouter``.

Since modal 1.x a sandbox's ``exec`` talks gRPC straight to the worker's task command router
(``modal_proto.task_command_router``: ``TaskExecStart``, ``TaskExecStdinWrite`` with byte offsets and
EOF, ``TaskExecStdioRead`` streaming from an offset, ``TaskExecWait``/``TaskExecPoll``).
:class:`RouterStandIn` serves those calls with grpclib on 127.0.0.1, each exec a real process in a
:class:`~bench.support.modal_fake.FakeModalSandbox`.  :class:`RouterModalSandbox` is what
``ModalSandbox`` adopts: its ``exec.aio`` runs the SDK's own ``exec_via_tcr`` with the SDK's own
``TaskCommandRouterClient`` (plain HTTP/2 to localhost, as the SDK allows for a localhost server), on
the SDK's own event loop thread, and returns the SDK's own ``ContainerProcess`` (synchronicity
wrapper, ``io_streams`` writer and readers).  Only the sandbox's creation and the control plane that
hands out the router's address and JWT are left out.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import time
from collections.abc import Coroutine
from types import SimpleNamespace
from typing import Any, TypeVar

from grpclib.server import Server, Stream
from modal._utils.async_utils import synchronizer
from modal.sandbox._common import exec_via_tcr
from modal.sandbox._task_command_router_client import TaskCommandRouterClient
from modal.stream_type import StreamType
from modal_proto import task_command_router_pb2 as sr_pb2
from modal_proto.task_command_router_grpc import TaskCommandRouterBase

from bench.support.modal_fake import Aio, FakeModalSandbox

T = TypeVar("T")
STDOUT, STDERR = sr_pb2.TASK_EXEC_STDIO_FILE_DESCRIPTOR_STDOUT, sr_pb2.TASK_EXEC_STDIO_FILE_DESCRIPTOR_STDERR


class _Output:
    """One output stream kept by offset.  The pipe is read only while less than ``window`` bytes wait
    unsent past what a reader has taken (the worker does not buffer without bound either)."""

    def __init__(self, pipe: asyncio.StreamReader, window: int) -> None:
        self.data = bytearray()
        self.base = 0  # the offset of data[0]
        self.taken = 0
        self.eof = False
        self.window = window
        self.changed = asyncio.Condition()
        self.task = asyncio.ensure_future(self._pump(pipe))

    @property
    def end(self) -> int:
        return self.base + len(self.data)

    async def _pump(self, pipe: asyncio.StreamReader) -> None:
        while True:
            async with self.changed:
                await self.changed.wait_for(lambda: self.end - self.taken < self.window)
            chunk = await pipe.read(65536)
            async with self.changed:
                if chunk:
                    self.data += chunk
                else:
                    self.eof = True
                self.changed.notify_all()
            if not chunk:
                return

    async def take(self, offset: int) -> bytes | None:
        """The bytes from ``offset`` on (at most 64 KiB), waiting for some; None at the end."""
        async with self.changed:
            await self.changed.wait_for(lambda: offset < self.end or self.eof)
            if offset >= self.end:
                return None
            if offset < self.base:
                raise ValueError(f"offset {offset} was already dropped")
            chunk = bytes(self.data[offset - self.base: offset - self.base + 65536])
            self.taken = max(self.taken, offset + len(chunk))
            # What every reader took is never asked for again (the SDK re-reads only from its offset).
            drop = self.taken - self.base - self.window
            if drop > 0:
                del self.data[:drop]
                self.base += drop
            self.changed.notify_all()
            return chunk


class _Exec:
    def __init__(self, proc: asyncio.subprocess.Process, window: int) -> None:
        assert proc.stdin is not None and proc.stdout is not None and proc.stderr is not None
        self.proc = proc
        self.stdin_offset = 0
        self.stdin_lock = asyncio.Lock()
        self.out = {STDOUT: _Output(proc.stdout, window), STDERR: _Output(proc.stderr, window)}


class RouterStandIn(TaskCommandRouterBase):
    """The exec calls of Modal's task command router, over real processes in ``sandbox``."""

    def __init__(self, sandbox: FakeModalSandbox, *, window: int = 1024 * 1024) -> None:
        self.sandbox, self.window = sandbox, window
        self.execs: dict[str, _Exec] = {}
        self.calls: dict[str, int] = {}
        self.server: Server | None = None
        self.port = 0

    async def start(self) -> None:
        self.server = Server([self])
        await self.server.start("127.0.0.1", 0)
        assert self.server._server is not None
        self.port = int(self.server._server.sockets[0].getsockname()[1])  # type: ignore[attr-defined]

    async def stop(self) -> None:
        if self.server is not None:
            self.server.close()
            await self.server.wait_closed()
        for ex in self.execs.values():  # the processes and their pipes are the sandbox's to end
            for out in ex.out.values():
                out.task.cancel()
                with contextlib.suppress(BaseException):
                    await out.task

    def _count(self, name: str) -> None:
        self.calls[name] = self.calls.get(name, 0) + 1

    async def TaskExecStart(self, stream: Stream[Any, Any]) -> None:
        self._count("TaskExecStart")
        req = await stream.recv_message()
        assert req is not None
        env: dict[str, str] = {}
        for source in req.secret_sources:
            if source.WhichOneof("source") == "env":
                env.update(source.env.contents)
        proc = await self.sandbox.spawn(list(req.command_args), env, req.workdir or None)
        self.execs[req.exec_id] = _Exec(proc, self.window)
        await stream.send_message(sr_pb2.TaskExecStartResponse())

    async def TaskExecStdinWrite(self, stream: Stream[Any, Any]) -> None:
        self._count("TaskExecStdinWrite")
        req = await stream.recv_message()
        assert req is not None
        ex = self.execs[req.exec_id]
        pipe = ex.proc.stdin
        assert pipe is not None
        async with ex.stdin_lock:
            # Offsets make a retried write idempotent: skip what was already written.
            data = req.data[max(0, ex.stdin_offset - req.offset):] if req.offset <= ex.stdin_offset else None
            if data is None:
                raise ValueError(f"a stdin write at {req.offset}, ahead of {ex.stdin_offset}")
            if data and not pipe.is_closing():
                pipe.write(data)
                try:
                    await pipe.drain()
                except (ConnectionError, BrokenPipeError):
                    pass
            ex.stdin_offset = max(ex.stdin_offset, req.offset + len(req.data))
            if req.eof and not pipe.is_closing():
                pipe.close()
        await stream.send_message(sr_pb2.TaskExecStdinWriteResponse())

    async def TaskExecStdioRead(self, stream: Stream[Any, Any]) -> None:
        self._count("TaskExecStdioRead")
        req = await stream.recv_message()
        assert req is not None
        out = self.execs[req.exec_id].out[req.file_descriptor]
        offset = req.offset
        while (chunk := await out.take(offset)) is not None:
            await stream.send_message(sr_pb2.TaskExecStdioReadResponse(data=chunk))
            offset += len(chunk)

    async def TaskExecWait(self, stream: Stream[Any, Any]) -> None:
        self._count("TaskExecWait")
        req = await stream.recv_message()
        assert req is not None
        code = await self.execs[req.exec_id].proc.wait()
        reply = (sr_pb2.TaskExecWaitResponse(signal=-code) if code < 0
                 else sr_pb2.TaskExecWaitResponse(code=code))
        await stream.send_message(reply)

    async def TaskExecPoll(self, stream: Stream[Any, Any]) -> None:
        self._count("TaskExecPoll")
        req = await stream.recv_message()
        assert req is not None
        code = self.execs[req.exec_id].proc.returncode
        if code is None:
            await stream.send_message(sr_pb2.TaskExecPollResponse())
        else:
            await stream.send_message(sr_pb2.TaskExecPollResponse(signal=-code) if code < 0
                                      else sr_pb2.TaskExecPollResponse(code=code))


async def _not_served(self: RouterStandIn, stream: Stream[Any, Any]) -> None:
    raise NotImplementedError("the stand-in serves only the exec calls")


# The router's other calls (containers, snapshots, mounts) are not on the exec path: refused.
for _name in TaskCommandRouterBase.__abstractmethods__ - set(vars(RouterStandIn)):
    setattr(RouterStandIn, _name, _not_served)
RouterStandIn.__abstractmethods__ = frozenset()


def _jwt() -> str:
    """An unsigned token of the JWT's shape with a far expiry (the SDK reads ``exp`` to refresh)."""
    def part(obj: dict[str, Any]) -> str:
        return base64.urlsafe_b64encode(json.dumps(obj).encode()).rstrip(b"=").decode()

    return f"{part({'alg': 'none'})}.{part({'exp': time.time() + 86400})}.sig"


async def _on_sdk_loop(coro: Coroutine[Any, Any, T]) -> T:
    """Run ``coro`` on the SDK's own event loop (its thread), as every ``.aio`` call does."""
    loop = synchronizer._get_loop(start=True)
    return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coro, loop))


class RouterModalSandbox:
    """A ``modal.Sandbox``-shaped handle whose ``exec.aio`` is the SDK's own exec path to the router."""

    def __init__(self, sandbox: FakeModalSandbox, router: RouterStandIn) -> None:
        self.object_id = sandbox.object_id
        self.task_id = f"ta-{sandbox.object_id}"
        self._sandbox, self._router = sandbox, router
        self._client: TaskCommandRouterClient | None = None
        self.exec = Aio(self._exec)
        self.terminate = Aio(self._terminate)

    async def _connect(self) -> TaskCommandRouterClient:
        if self._client is None:
            async def fetch_access() -> Any:
                return SimpleNamespace(url=f"http://127.0.0.1:{self._router.port}", jwt=_jwt())

            self._client = await TaskCommandRouterClient._connect(
                SimpleNamespace(_is_localhost=True), self.task_id, f"http://127.0.0.1:{self._router.port}",
                _jwt(), fetch_access=fetch_access)
        return self._client

    async def _exec(self, *args: str, env: dict[str, str] | None = None, timeout: int | None = None,
                    workdir: str | None = None, text: bool = True) -> Any:
        async def run() -> Any:
            client = await self._connect()
            task_id = self.task_id

            class _Impl:
                async def get_task_id(self, raise_if_task_complete: bool = False) -> str:
                    return task_id

                async def get_command_router_client(self, _task_id: str) -> TaskCommandRouterClient:
                    return client

            proc = await exec_via_tcr(_Impl(), None, *args, pty_info=None,  # type: ignore[arg-type]
                                      stdout=StreamType.PIPE, stderr=StreamType.PIPE, timeout=timeout,
                                      workdir=workdir, env=dict(env or {}), secrets=None, text=text,
                                      bufsize=-1, container_id=None)
            return synchronizer._translate_out(proc)  # the public ContainerProcess, as Sandbox.exec returns

        return await _on_sdk_loop(run())

    async def _terminate(self) -> None:
        try:
            if self._client is not None:
                client, self._client = self._client, None
                await _on_sdk_loop(client.close())
        finally:
            await self._router.stop()
            await self._sandbox.terminate.aio()
